"""Shared by the e2e test and the live-view cost measurement: launch the real app, drive Chromium.

``launched_app`` runs ``python launch.py`` in a subprocess with its own config/data folders and yields
its URL once the model is ready; ``chromium`` starts Debian's Chromium through Playwright (Playwright
never downloads a browser); ``send`` types a message and waits until its reply has ended.
"""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("MEDUSA_CHAT_E2E_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LOAD_TIMEOUT_S = 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(folder: Path) -> str:
    """A tiny random Medusa checkpoint (gibberish text) written to ``folder``; returns its path."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import write_tiny_medusa

    return str(write_tiny_medusa(folder))


@contextlib.contextmanager
def launched_app(model: str, quantization: str, home: Path, *args: str) -> Iterator[str]:
    """``python launch.py --model model ...`` until the block ends; yields ``http://127.0.0.1:<port>``.

    Raises RuntimeError with the app's output when it exits or is not ready in time.
    """
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "launch.py", "--model", model, "--quantization", quantization, "--port", str(port), *args],
        cwd=REPO,
        env={**os.environ, "XDG_CONFIG_HOME": str(home / "config"), "XDG_DATA_HOME": str(home / "data"), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    log: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            log.append(line)
            if "ready in" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while not ready.wait(0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the app did not become ready:\n" + "".join(log))
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def chromium() -> Iterator[object]:
    """A headless Chromium ``Browser`` (Playwright's sync API) on Debian's binary."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


# Records the length of the last bot message at every change of the chat's DOM (every render).
# textContent, not innerText: it needs no layout, so watching adds little work to the page.
WATCH_REPLY_JS = """
() => {
  window.__replyLengths = [];
  const chat = document.querySelector('#chat');
  const record = () => {
    const bots = chat.querySelectorAll('[data-testid=bot]');
    if (bots.length) window.__replyLengths.push([bots.length, bots[bots.length - 1].textContent.length]);
  };
  if (window.__replyObserver) window.__replyObserver.disconnect();
  window.__replyObserver = new MutationObserver(record);
  window.__replyObserver.observe(chat, {subtree: true, childList: true, characterData: true});
}
"""
# The reply has ended: its bot message exists and the status line reports it ("Waiting…"/"Generating…" before).
REPLY_DONE_JS = """
(expected) => document.querySelectorAll('#chat [data-testid=bot]').length === expected
  && document.querySelector('#reply-status').textContent.trim().startsWith('Latest reply')
"""


def send(page, text: str, timeout_s: float = 60.0, screenshot: Path | None = None, watch: bool = True) -> list[int]:
    """Send ``text`` and wait until its reply has ended, checking twice a second (polling faster
    would load the browser that renders the reply).

    With ``watch``, returns the reply's text length at every render of the chat, in order (a
    streamed reply shows several partial lengths); else returns [].
    """
    expected = page.locator("#chat [data-testid=bot]").count() + 1
    if watch:
        page.evaluate(WATCH_REPLY_JS)
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")
    try:
        page.wait_for_function(REPLY_DONE_JS, arg=expected, polling=500, timeout=timeout_s * 1000)
    except Exception:
        if screenshot is not None:
            page.screenshot(path=str(screenshot), full_page=True)
        status = page.locator("#reply-status").inner_text()
        raise AssertionError(f"the reply did not finish in {timeout_s} s; status: {status!r}") from None
    if not watch:
        return []
    seen = page.evaluate("() => window.__replyLengths")
    return [length for count, length in seen if count == expected]


def download(page, button: str, target: Path) -> Path:
    """Press an Export button (``#export``, ``#export-md``, ``#export-json``) on the Export tab and
    save the file the browser downloads to ``target``."""
    page.get_by_role("tab", name="Export").click()
    with page.expect_download(timeout=30_000) as download:
        page.locator(f"#{button}").click()
    download.value.save_as(target)
    return target


def download_csv(page, target: Path) -> list[dict[str, str]]:
    """Press Export (on the Export tab) and read the downloaded CSV's rows."""
    with download(page, "export", target).open() as f:
        return list(csv.DictReader(f))


# The page's longest main-thread stalls from now on: long tasks (PerformanceObserver 'longtask',
# any task over 50 ms) and gaps between animation frames (what a user sees as a frozen page), and
# which parts of the page changed during the longest task.
WATCH_STALLS_JS = """
() => {
  const s = window.__stalls = {longest_task_ms: 0, tasks: 0, longest_frame_gap_ms: 0, frames: 0, longest_task_parts: []};
  const changes = [];
  let longest = null;
  if (window.__stallObservers) window.__stallObservers.forEach((o) => o.disconnect());
  const task = new PerformanceObserver((list) => {
    for (const e of list.getEntries()) {
      s.tasks += 1;
      if (e.duration > s.longest_task_ms) { s.longest_task_ms = e.duration; longest = [e.startTime, e.duration]; }
    }
  });
  task.observe({type: "longtask"});
  window.__stallObservers = [task];
  for (const id of ["#chat", "#tree-plot", "#speed-plot", "#step-slider", "#summary", "#reply-status", "#model-panel", "#send"]) {
    const el = document.querySelector(id);
    if (!el) continue;
    const o = new MutationObserver(() => changes.push([performance.now(), id]));
    o.observe(el, {subtree: true, childList: true, characterData: true, attributes: id === "#send"});
    window.__stallObservers.push(o);
  }
  s.parts = () => longest ? [...new Set(changes.filter(([t]) => t >= longest[0] - 5 && t <= longest[0] + longest[1] + 5).map(([, id]) => id))] : [];
  let last = performance.now();
  const frame = (t) => {
    s.frames += 1;
    s.longest_frame_gap_ms = Math.max(s.longest_frame_gap_ms, t - last);
    last = t;
    if (window.__stalls === s) requestAnimationFrame(frame);
  };
  requestAnimationFrame(frame);
}
"""


def stalls(page) -> dict[str, float]:
    """What ``WATCH_STALLS_JS`` measured since it was installed."""
    return page.evaluate("() => ({...window.__stalls, longest_task_parts: window.__stalls.parts()})")
