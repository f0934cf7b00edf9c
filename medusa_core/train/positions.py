"""Training positions (paper 2.2.1): the frozen backbone's hidden states and each head's target token.

Head k at position t is trained to predict the token at t+k+2; only reply tokens are targets.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Iterable

import torch
from tqdm import tqdm

#: What a head is trained to predict at t (``collect_positions``'s ``targets``).
TARGETS = ("reply", "backbone")


@torch.no_grad()
def collect_positions(
    backbone,
    rows: Iterable[dict],
    num_heads: int,
    *,
    bf16: bool = False,
    batch_size: int = 16,
    targets: str = "reply",
    with_roots: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Final-norm hidden states of the frozen backbone and each head's target at every reply position.

    For a sequence ``prompt + reply`` of length T, the positions used are ``t = len(prompt)-1 .. T-2``;
    a reply's positions are consecutive in the result and its last one has no target for any head.
    Head k's label at t is -100 unless the token at ``t+k+2`` belongs to the reply; otherwise it is

    - ``targets="reply"``: that token of the reply (paper 2.2.1);
    - ``targets="backbone"``: this backbone's own greedy token for that place, i.e. the argmax of its
      logits at ``t+k+1`` given the reply before it. Use it when the backbone that serves the heads is
      not the one that wrote the replies (e.g. replies distilled from the bfloat16 weights, heads
      served on the NF4 backbone): the heads then learn what the served backbone will verify.

    Returns (hidden [M, H] float16 on CPU, labels [M, K] int64), and with ``with_roots`` also roots [M]
    int64: the token at t+1 of the sequence, which is the step's root when the heads run at t (what
    root-conditioned heads read, layout "root" of ``medusa_core.heads``).
    Raises ``ValueError`` for ``targets`` not in ``TARGETS``.
    """
    if targets not in TARGETS:
        raise ValueError(f"targets must be one of {TARGETS}, got {targets!r}")
    decoder = backbone.get_decoder()
    lm_head = backbone.get_output_embeddings()
    device = next(backbone.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    rows = sorted(rows, key=lambda r: len(r["prompt_ids"]) + len(r["reply_ids"]))
    hidden_parts, label_parts, root_parts = [], [], []
    for start in tqdm(range(0, len(rows), batch_size), desc="hidden states", unit="batch"):
        batch = rows[start : start + batch_size]
        seqs = [r["prompt_ids"] + r["reply_ids"] for r in batch]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for n, s in enumerate(seqs):
            ids[n, : len(s)] = torch.tensor(s)  # right padding: causal attention never sees it
        with autocast:
            hidden = decoder(input_ids=ids.to(device)).last_hidden_state  # [B, W, H]
        for n, (r, s) in enumerate(zip(batch, seqs)):
            p, t_len = len(r["prompt_ids"]), len(s)
            if t_len - p < 2:
                continue
            positions = torch.arange(p - 1, t_len - 1)
            states = hidden[n, p - 1 : t_len - 1]  # [T-p, H] at the positions
            if targets == "reply":
                seq = torch.tensor(s)
            else:  # seq[u] = the backbone's greedy token after position u-1; only u >= p is read below
                with autocast:
                    greedy = lm_head(states).argmax(-1).cpu()  # after t = p-1 .. T-2
                seq = torch.cat([torch.zeros(p, dtype=torch.long), greedy])
            labels = torch.full((len(positions), num_heads), -100, dtype=torch.long)
            for k in range(num_heads):
                target = positions + k + 2
                ok = target < t_len
                labels[ok, k] = seq[target[ok]]
            hidden_parts.append(states.float().cpu().to(torch.float16))
            label_parts.append(labels)
            root_parts.append(torch.tensor(s[p : t_len]))  # the token after each position t = p-1 .. T-2
    if with_roots:
        return torch.cat(hidden_parts), torch.cat(label_parts), torch.cat(root_parts)
    return torch.cat(hidden_parts), torch.cat(label_parts)


def cached_positions(path, backbone, rows: list[dict], num_heads: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``collect_positions(..., with_roots=True)`` of ``rows``, cached in ``path`` and extended as ``rows`` grows.

    A distillation file only grows (``distill`` appends each batch, across sessions), so a cache of its
    first n replies stays valid: only ``rows[n:]`` go through the backbone, and their positions are
    appended to the cached ones. The cache keeps a fingerprint of the n replies' token ids; a cache whose
    fingerprint differs from ``rows[:n]``'s (another file), of more replies than ``rows`` holds, or
    without roots is rebuilt. ``kwargs`` go to ``collect_positions`` and must be the same on every call
    for one ``path``.

    Returns (hidden [M, H] float16, labels [M, K] int64, roots [M] int64); the cache is a
    ``torch.save`` dict of those three plus ``replies`` (n) and ``fingerprint``, loaded with ``weights_only=True``.
    """
    path = Path(path)
    part = torch.load(path, weights_only=True) if path.exists() else {}
    done = part.get("replies", 0) if "roots" in part and part.get("replies", 0) <= len(rows) else 0
    digest = _fingerprint(hashlib.sha256(), rows[:done])  # the cached replies' ids, extended below with the new ones
    if done and part.get("fingerprint") != digest.hexdigest():
        done, digest = 0, hashlib.sha256()
    old = (part["hidden"], part["labels"], part["roots"]) if done else None
    if done == len(rows) and old is not None:
        return old
    new = collect_positions(backbone, rows[done:], num_heads, with_roots=True, **kwargs)
    hidden, labels, roots = new if old is None else (torch.cat(pair) for pair in zip(old, new))
    torch.save({"hidden": hidden, "labels": labels, "roots": roots, "replies": len(rows),
                "fingerprint": _fingerprint(digest, rows[done:]).hexdigest()}, path)
    return hidden, labels, roots


def replies_fingerprint(rows: list[dict]) -> str:
    """SHA-256 (hex) of the rows' ``prompt_ids`` and ``reply_ids`` in order: what ``cached_positions`` checks."""
    return _fingerprint(hashlib.sha256(), rows).hexdigest()


def _fingerprint(digest, rows: list[dict]):
    """``digest`` (a hashlib object) updated with the rows' ids, in order; returned for chaining."""
    for row in rows:
        digest.update(json.dumps([row["prompt_ids"], row["reply_ids"]]).encode())
    return digest
