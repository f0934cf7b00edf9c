"""Token ids → text for the app: the one UTF-8-safe streaming detokenizer, reply text that remembers
which tokens came from the Medusa heads, prompts through the model's chat template, and token labels.

A byte-level BPE token can end in the middle of a UTF-8 character (an emoji or a CJK character is
often 2–4 tokens), SentencePiece tokenizers decode a token differently depending on what comes
before it, and byte-fallback tokenizers (``<0x00>`` … ``<0xFF>``) decode a whole run of byte tokens
at once, so one invalid byte turns every byte of its run into U+FFFD. ``StreamingDetokenizer`` is the
only place that deals with all three: it decodes a short window of recent tokens and emits only
text that can no longer change.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token's name


class StreamingDetokenizer:
    """Turns token ids, pushed one at a time, into text pieces made only of whole characters.

    ``push`` returns the text the token completes ("" while a character is still incomplete);
    ``flush`` returns what is left at the end of the reply. Joining every piece gives
    ``tokenizer.decode(all_ids, skip_special_tokens=True)`` (special tokens such as EOS give ""),
    less an unfinished character at the very end.

    This holds for any ids, invalid UTF-8 included.

    The window trick (as in text-generation-inference): decode ``ids[prefix:]`` and the already
    emitted ``ids[prefix:read]``; the difference is new text unless it ends in U+FFFD, i.e. a cut
    character. A run of byte-fallback tokens is decoded as a whole (one invalid byte makes every byte
    of the run U+FFFD), so nothing is emitted while the last token that decode keeps is a byte token:
    the window's edges then never cut a run, and emitted text never changes.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``, ``convert_ids_to_tokens``, ``all_special_ids``).
    """

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._skipped = frozenset(tokenizer.all_special_ids)  # ids decode(skip_special_tokens=True) drops
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (keeps SentencePiece's leading-space context)
        self._read = 0  # tokens before this index are already emitted as text
        self._in_byte_run = False  # the last token decode keeps is a byte-fallback token

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes."""
        token_id = int(token_id)
        self._ids.append(token_id)
        if token_id not in self._skipped:
            self._in_byte_run = _BYTE_TOKEN.fullmatch(self._tokenizer.convert_ids_to_tokens(token_id) or "") is not None
        if self._in_byte_run:  # a later byte token may still make this run invalid
            return ""
        emitted = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) > len(emitted) and not text.endswith(REPLACEMENT_CHAR):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(emitted) :]
        return ""

    def flush(self) -> str:
        """Text of the tokens not yet emitted. A character the last tokens left unfinished (a reply cut
        by its token limit mid-emoji) is dropped: it would show as U+FFFD."""
        emitted = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(emitted) :].rstrip(REPLACEMENT_CHAR)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


@dataclass
class ReplyText:
    """A reply as runs of text, each marked by whether its tokens were accepted from drafts (heads, drafter,
    n-gram or corpus).

    ``free`` runs are the tokens a step accepted beyond the backbone's own token (paper 2.3.1): the
    tokens Medusa got without an extra forward pass. A character made of several tokens' bytes is free
    when any of them was.
    """

    runs: list[tuple[str, bool]] = field(default_factory=list)
    #: A free token's piece was empty (its character still incomplete): the next piece holds its bytes.
    _pending_free: bool = field(default=False, repr=False, compare=False)

    def append(self, text: str, free: bool) -> None:
        """Add the piece of text one token completed (``StreamingDetokenizer.push``; "" while its character is
        incomplete, or for a special token)."""
        if not text:
            self._pending_free |= free
            return
        free, self._pending_free = free or self._pending_free, False
        if self.runs and self.runs[-1][1] == free:
            self.runs[-1] = (self.runs[-1][0] + text, free)
        else:
            self.runs.append((text, free))

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.runs)

    def html(self, highlight: bool) -> str:
        """The reply as preformatted HTML; with ``highlight``, free runs are wrapped in ``<mark>``."""
        parts = [
            f'<mark class="medusa-free">{html.escape(t)}</mark>' if free and highlight else html.escape(t)
            for t, free in self.runs
        ]
        # The newline after <pre> is dropped by HTML, and it stops Gradio's Chatbot (which runs
        # inspect.cleandoc on every message) from removing the reply's common indentation.
        return '<pre class="medusa-reply">\n' + "".join(parts) + "</pre>"


#: White space and characters that show nothing (zero-width spaces and joiners, word joiner, BOM, soft hyphen).
_BLANK = re.compile(r"[\s\u00ad\u034f\u180e\u200b-\u200f\u2060-\u2064\ufeff]*")


def is_blank(message: str) -> bool:
    """True when ``message`` shows nothing: empty, or only white space and invisible characters."""
    return _BLANK.fullmatch(message) is not None


def plain_text(message: str) -> str:
    """The text of a chat message as the page renders it (``ReplyText.html``, escaped user text) or as
    typed: tags dropped, entities decoded. Plain text passes through unchanged."""
    if not message.lstrip().startswith("<pre class=\"medusa-"):
        return message
    return html.unescape(re.sub(r"<[^>]+>", "", message.replace("<pre class=\"medusa-user\">\n", "", 1)
                                                     .replace("<pre class=\"medusa-reply\">\n", "", 1)))


def token_label(tokenizer: Any, token_id: int) -> str:
    """A short visible label for one token: its decoded text with spaces and newlines made visible."""
    text = tokenizer.decode([int(token_id)], skip_special_tokens=False)
    text = text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥")
    if not text:  # an id the tokenizer cannot decode (the model's vocabulary can be larger)
        return f"#{int(token_id)}"
    return text if len(text) <= 12 else text[:11] + "…"


#: Used when a tokenizer has no chat template (e.g. Vicuna v1.3, the backbone of the published Medusa heads).
VICUNA_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }} "
    "{% elif m['role'] == 'user' %}USER: {{ m['content'] }} "
    "{% else %}ASSISTANT: {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def chat_messages(system_prompt: str, history: Sequence[tuple[str, str]], user: str) -> list[dict[str, str]]:
    """Chat-template messages: the system prompt (if any), past (user, reply) pairs, the new user message."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    for question, answer in history:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": user}]


def template_system_prompt(tokenizer: Any) -> str | None:
    """The system prompt the tokenizer's chat template writes when a chat has none, e.g. SmolLM2's
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face"; None if it writes none.

    Found by rendering a chat with a marker system prompt and the same chat without one: what the
    second has where the first has the marker is the template's own default.
    """
    marker, user = "\x00system\x00", [{"role": "user", "content": "\x00user\x00"}]
    try:
        with_marker = prompt_text(tokenizer, [{"role": "system", "content": marker}, *user])
        without = prompt_text(tokenizer, user)
    except Exception:  # noqa: BLE001 - a template that cannot render either chat has no default to show
        return None
    head, sep, tail = with_marker.partition(marker)
    if not sep or not without.startswith(head) or not without.endswith(tail) or len(without) <= len(head) + len(tail):
        return None
    return without[len(head) : len(without) - len(tail)].strip() or None


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """Token ids [1, T] of ``prompt_text(tokenizer, messages)``, control tokens only where the template
    writes them.

    Message text that spells a control token (``<|im_start|>system``, ``<|end|>``, any special token)
    is encoded as plain text (transformers' ``sanitize_control_tokens``), so a message can never open
    a turn of another role. Other text is encoded exactly as the rendered prompt would be; the
    template writes any BOS itself, so no special tokens are added around it.
    Raises ``ValueError`` if the tokenizer cannot encode such text without producing the token.
    """
    return _apply_template(
        tokenizer, messages, tokenize=True, sanitize_control_tokens=True, return_dict=True, return_tensors="pt"
    )["input_ids"]


def prompt_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """``messages`` through the tokenizer's chat template, ending where the assistant's reply starts.

    Templates that reject a system role get the system prompt prepended to the first user message.
    Tokenizers without a template use the Vicuna v1.1 format.
    """
    return _apply_template(tokenizer, messages, tokenize=False)


def _apply_template(tokenizer: Any, messages: list[dict[str, str]], **kwargs: Any) -> Any:
    """``tokenizer.apply_chat_template`` with the generation prompt, the fallbacks of ``prompt_text``
    and ``kwargs``."""
    from jinja2 import TemplateError

    template = None if getattr(tokenizer, "chat_template", None) else VICUNA_TEMPLATE
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, **kwargs)
    except TemplateError:
        if messages[0]["role"] != "system":
            raise
        system, first, *rest = messages
        merged = {"role": "user", "content": f"{system['content']}\n\n{first['content']}"}
        return tokenizer.apply_chat_template([merged, *rest], chat_template=template, add_generation_prompt=True, **kwargs)
