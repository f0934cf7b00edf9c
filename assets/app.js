() => {
  // medusa-chat page behaviour that lives in the browser (run once on load by app.ui):
  //  - keys: Esc stops the reply, Ctrl+Enter (Cmd+Enter) regenerates the last reply;
  //  - the chat's copy button copies a message as plain text, and the edit box shows plain text
  //    (messages are rendered as HTML: <pre class="medusa-reply">…</pre> plus stats lines).
  if (window.__medusaChat) return [];
  window.__medusaChat = true;
  const plain = (text) => {
    if (typeof text !== "string" || !/^\s*<pre class="medusa-/.test(text)) return text;
    const doc = new DOMParser().parseFromString(text, "text/html");
    const pre = doc.querySelector("pre.medusa-reply, pre.medusa-user");
    return pre ? pre.textContent.replace(/^\n/, "") : doc.body.textContent;
  };
  window.__medusaPlainText = plain;
  if (navigator.clipboard && navigator.clipboard.writeText) {
    const write = navigator.clipboard.writeText.bind(navigator.clipboard);
    navigator.clipboard.writeText = (text) => write(plain(text));
  }
  window.addEventListener("keydown", (e) => {
    if (e.key === "Escape") {
      const stop = document.querySelector("#stop");
      if (stop) stop.click();
    } else if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      e.stopPropagation();  // not also a send from the message box
      const again = document.querySelector("#regenerate");
      if (again) again.click();
    }
  }, true);
  const chat = document.querySelector("#chat");
  if (chat) {
    new MutationObserver(() => {
      for (const box of chat.querySelectorAll("textarea")) {
        const text = plain(box.value);
        if (text !== box.value) {
          box.value = text;
          box.dispatchEvent(new Event("input", { bubbles: true }));
        }
      }
    }).observe(chat, { subtree: true, childList: true });
  }
  return [];
}
