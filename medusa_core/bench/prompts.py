"""The benchmark's prompts: a JSONL loader and the chat-template encoder.

The prompt file holds one JSON object per line, in one of two forms (other fields, e.g. ``source``,
are ignored; blank lines are skipped):

    {"category": "math", "prompt": "What is 56 times 13?"}
    {"category": "multi-turn", "messages": [
        {"role": "user", "content": "Write a haiku about autumn rain."},
        {"role": "assistant", "content": "Cold rain on the roof ..."},
        {"role": "user", "content": "Now make it about spring."}]}

``prompt`` is one user message. ``messages`` is a conversation whose turns alternate ``user`` and
``assistant``, starting and ending with ``user``: the earlier turns are fixed text written into the
file (not generated), the whole conversation goes through the chat template, and the benchmark times
only the reply to the last user turn. ``category`` is optional (``uncategorised``); the shipped set
(``medusa_core/data/bench_prompts.jsonl``) uses MT-Bench's eight categories and ``multi-turn``. A
system message is not part of a row: ``--system`` puts one before every conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import torch

ROLES = ("user", "assistant")  # the roles of a ``messages`` row, alternating, first and last ``user``


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: the user message whose reply is timed, the conversation before it, its category.

    Attributes:
        text: the last user message.
        category: MT-Bench's eight (writing, roleplay, reasoning, math, coding, extraction, stem,
            humanities), ``multi-turn``, or any label of the prompt file.
        history: the turns before ``text``, oldest first, as (role, content) pairs alternating user and
            assistant; empty for a single-turn prompt.
    """

    text: str
    category: str = "uncategorised"
    history: tuple[tuple[str, str], ...] = ()

    def messages(self, system: str | None = None) -> list[dict[str, str]]:
        """The conversation as chat messages: ``system`` (when given), the history, then ``text``."""
        turns = [*self.history, ("user", self.text)]
        return ([{"role": "system", "content": system}] if system else []) + [
            {"role": role, "content": content} for role, content in turns
        ]


def _conversation(messages: Any, where: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(last user message, earlier turns) of a ``messages`` field; ``ValueError`` naming ``where`` otherwise."""
    if not isinstance(messages, list) or len(messages) % 2 == 0:
        raise ValueError(f"{where}: 'messages' must be a list of an odd number of turns: user, assistant, ..., user")
    turns = []
    for i, m in enumerate(messages):
        role = ROLES[i % 2]
        if not isinstance(m, dict) or m.get("role") != role or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} must be {{'role': '{role}', 'content': <text>}} "
                             "(turns alternate user and assistant, first and last user; --system adds a system message)")
        turns.append((role, m["content"]))
    return turns[-1][1], tuple(turns[:-1])


def load_prompts(
    path: str | Path | None = None, limit: int | None = None, categories: Sequence[str] | None = None
) -> list[Prompt]:
    """Prompts from a JSONL file of ``prompt`` or ``messages`` rows (format: this module's docstring).

    ``path=None`` reads the shipped set (``medusa_core/data/bench_prompts.jsonl``). ``categories``
    keeps only those categories; ``limit`` then keeps that many, taken round robin over the categories
    (so every category stays represented).
    Raises ``ValueError`` naming the file and line of a record with neither (or both) or a malformed
    conversation, or the categories asked for when no prompt has them.
    """
    if path is None:
        text = resources.files("medusa_core").joinpath("data/bench_prompts.jsonl").read_text(encoding="utf-8")
        source = "medusa_core/data/bench_prompts.jsonl"
    else:
        text, source = Path(path).read_text(encoding="utf-8"), str(path)
    prompts = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{line_no}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from e
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
            raise ValueError(f"{where}: expected an object with either a string field 'prompt' or a list 'messages'")
        category = str(record.get("category") or "uncategorised")
        if "messages" in record:
            last, history = _conversation(record["messages"], where)
            prompts.append(Prompt(last, category, history))
        elif isinstance(record["prompt"], str):
            prompts.append(Prompt(record["prompt"], category))
        else:
            raise ValueError(f"{where}: 'prompt' must be a string")
    if not prompts:
        raise ValueError(f"{source}: no prompts")
    if categories is not None:
        found = sorted({p.category for p in prompts})
        prompts = [p for p in prompts if p.category in categories]
        if not prompts:
            raise ValueError(f"{source}: no prompt of the categories {', '.join(categories)}; it has {', '.join(found)}")
    if limit is not None and 0 < limit < len(prompts):
        # round robin over the categories, each in file order, then back to file order
        queues: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            queues.setdefault(p.category, []).append(i)
        picked: list[int] = []
        while len(picked) < limit:
            for q in queues.values():
                if q and len(picked) < limit:
                    picked.append(q.pop(0))
        prompts = [prompts[i] for i in sorted(picked)]
    return prompts


def encode_prompt(tokenizer: Any, prompt: Prompt | str, system: str | None = None) -> torch.Tensor:
    """[1, T] token ids of a whole conversation (an optional system message, the prompt's history and its
    last user message; a string is one user message) through the tokenizer's chat template, ending with
    the assistant's turn opening. Without a template: the turns' texts joined by blank lines, no system."""
    if tokenizer is None:
        raise ValueError("the model has no tokenizer: the benchmark needs one to encode its prompts")
    if isinstance(prompt, str):
        prompt = Prompt(prompt)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(prompt.messages(system), tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    text = "\n\n".join([content for _, content in prompt.history] + [prompt.text])
    return tokenizer(text, return_tensors="pt").input_ids
