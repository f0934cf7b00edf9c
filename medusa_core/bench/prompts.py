"""The benchmark's prompts: a JSONL loader and the chat-template encoder."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: the user's message and its category (MT-Bench's eight, or ``python``)."""

    text: str
    category: str = "uncategorised"


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[Prompt]:
    """Prompts from a JSONL file with a ``prompt`` field and an optional ``category`` field.

    ``path=None`` reads the shipped set (``medusa_core/data/bench_prompts.jsonl``). ``limit`` keeps
    that many, taken round robin over the categories (so every category stays represented).
    Raises ``ValueError`` naming the file and line of a record without a ``prompt``.
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
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}:{line_no}: not valid JSON ({e})") from e
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{source}:{line_no}: expected an object with a string field 'prompt'")
        prompts.append(Prompt(record["prompt"], str(record.get("category") or "uncategorised")))
    if not prompts:
        raise ValueError(f"{source}: no prompts")
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


def encode_prompt(tokenizer: Any, text: str, system: str | None = None) -> torch.Tensor:
    """[1, T] token ids of one user message (after an optional system message) through the tokenizer's
    chat template; plain text when the tokenizer has no template."""
    if tokenizer is None:
        raise ValueError("the model has no tokenizer: the benchmark needs one to encode its prompts")
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return tokenizer(text, return_tensors="pt").input_ids

