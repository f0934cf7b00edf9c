"""Backbone quality: ``python -m medusa_core.bench agreement`` (teacher-forced greedy agreement).

A 4-bit backbone is as good as the share of positions where its greedy token equals the full-precision
model's. The reference (``--quantization none``: the weights in float32, for a GGUF file exactly its
dequantized values) writes a greedy reply to each prompt; every candidate precision then reads prompt +
that reply in one pass (teacher forcing), and each reply position counts as agreeing when the
candidate's argmax there is the reference's token. Prompts are the benchmark's (``--prompts``/``--limit``).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Any

import torch

from .prompts import encode_prompt, load_prompts
from .report import markdown_table


def agreement(reference: Any, candidates: dict[str, Any], prompts: list, max_new_tokens: int,
              system: str | None = None) -> dict[str, tuple[int, int]]:
    """Teacher-forced greedy agreement of each candidate backbone with ``reference``.

    Args:
        reference: a ``MedusaModel`` whose greedy replies are the targets.
        candidates: name → ``MedusaModel`` on the same tokenizer.
        prompts: ``Prompt`` rows; max_new_tokens: reply length limit (tokens).

    Returns name → (agreeing positions, positions), summed over the prompts; the reference itself is
    included under ``"reference"`` as a check (it agrees everywhere, up to its own batch effects).
    """
    counts = {name: [0, 0] for name in ["reference", *candidates]}
    for prompt in prompts:
        ids = encode_prompt(reference.tokenizer, prompt, system)
        reply = [t for r in reference.generate(ids, max_new_tokens=max_new_tokens, medusa=False) for t in r.token_ids]
        sequence = torch.cat([ids, torch.tensor([reply])], dim=1)  # [1, T + R]
        targets = torch.tensor(reply)  # [R]
        for name, model in [("reference", reference), *candidates.items()]:
            with torch.inference_mode():
                logits = model.backbone(sequence.to(model.device)).logits[0, ids.shape[1] - 1 : -1]  # [R, V]
            counts[name][0] += int((logits.argmax(-1).cpu() == targets).sum())
            counts[name][1] += len(reply)
    return {name: (a, n) for name, (a, n) in counts.items()}


def cmd_agreement(reference: Any, args: argparse.Namespace, command: str) -> int:
    """Print and write (``agreement.csv``, ``agreement.md``) the agreement of each ``--candidates`` precision."""
    from ..loading import load_medusa_model

    prompts = load_prompts(args.prompts, args.limit, args.categories)
    candidates = {q: load_medusa_model(args.model, base_model=args.base_model, quantization=q, dtype=args.dtype,
                                       device=args.device) for q in args.candidates}
    result = agreement(reference, candidates, prompts, args.max_new_tokens, args.system)
    rows = [[name, a, n, f"{a / max(n, 1):.4f}"] for name, (a, n) in result.items()]
    header = ["backbone", "agreeing positions", "positions", "agreement"]
    out = args.out or Path("out") / "agreement"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "agreement.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([header, *rows])
    text = (f"Teacher-forced greedy agreement with the float32 model ({len(prompts)} prompts, replies of up to "
            f"{args.max_new_tokens} tokens)\n\n{markdown_table(rows, header)}\n\n`{command}`\n")
    (out / "agreement.md").write_text(text, encoding="utf-8")
    print(text)
    return 0
