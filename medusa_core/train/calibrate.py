"""Calibration (paper 2.3.3): per-head rank accuracies on held-out replies and optimised trees.

The record written next to the heads (``medusa_calibration.json``) holds the accuracies, the
optimised tree per node budget, its expected acceleration (heads assumed independent) and, when the
held-out replies are given, its acceleration replayed on them (exact for greedy decoding).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ..heads import MedusaHeads
from ..trees import optimal_tree

@torch.inference_mode()
def target_ranks(heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
    """Rank of each head's target token among that head's logits over the whole vocabulary (paper 2.3.3).

    Args: hidden [M, H], labels [M, K] (``collect_positions``; -100 = no target).
    Returns ranks [M, K] int64: 0 = the target is the head's top-1, -1 where there is no target.
    """
    ranks = torch.full(labels.shape, -1, dtype=torch.long)
    dtype = next(heads.parameters()).dtype
    device = next(heads.parameters()).device
    for start in range(0, len(hidden), batch_size):
        h = hidden[start : start + batch_size].to(device, dtype)
        lab = labels[start : start + batch_size].to(device)
        logits = heads(h)  # [K, B, V]
        for k in range(heads.num_heads):
            target_logit = logits[k].gather(1, lab[:, k, None].clamp(min=0))
            rank = (logits[k] > target_logit).sum(dim=1)  # [B]
            ranks[start : start + batch_size, k] = torch.where(lab[:, k] != -100, rank, -1).cpu()
    return ranks


def rank_accuracy(
    heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, max_rank: int = 10, batch_size: int = 4096
) -> list[list[float]]:
    """``a[k][i]``: fraction of positions where the target is exactly rank i of head k (paper 2.3.3).

    Top-n accuracy of head k is ``sum(a[k][:n])``. Args: hidden [M, H], labels [M, K].
    """
    return accuracy_from_ranks(target_ranks(heads, hidden, labels, batch_size), max_rank)


def accuracy_from_ranks(ranks: torch.Tensor, max_rank: int = 10) -> list[list[float]]:
    """``a[k][i]`` of ``rank_accuracy`` (paper 2.3.3) from the ranks [M, K] of ``target_ranks``.

    Ranks ≥ ``max_rank`` count in no column; rows of -1 (no target) are left out. Returns [K][max_rank].
    """
    acc = []
    for column in ranks.T:
        valid = column[column >= 0]
        counts = torch.bincount(valid.clamp(max=max_rank), minlength=max_rank + 1)[:max_rank]
        acc.append((counts / max(1, len(valid))).tolist())
    return acc


def simulated_acceleration(ranks: torch.Tensor, labels: torch.Tensor, paths: Sequence[Sequence[int]]) -> float:
    """Acceleration rate of greedy Medusa decoding with tree ``paths``, replayed on the replies themselves.

    For greedy decoding this is exact given the hidden states: Medusa must reproduce each reply token
    for token, so at every step the state is a prefix of the reply, the backbone's token is the
    reply's next token, and the step accepts the longest tree path whose ranks equal the ranks of the
    reply's following tokens under the heads (paper 2.3.1; ``ranks`` from ``target_ranks``). The
    prefill counts as a step of one token, as in the engine's accounting.

    Args:
        ranks: [M, K] from ``target_ranks``; labels: [M, K] from ``collect_positions``, whose replies
            are consecutive positions, the last of each having no target for any head.
        paths: the tree (``medusa_choices``), each path a list of per-head ranks.
    Returns tokens per step (≥ 1). Raises ``ValueError`` if a path is deeper than the heads.
    """
    depth = ranks.shape[1]
    if any(len(p) > depth for p in paths):
        raise ValueError(f"a path of the tree is {max(map(len, paths))} deep, the heads give {depth} ranks")
    accepted = torch.zeros(len(ranks), dtype=torch.long)  # [M] candidate tokens the step at each position accepts
    for path in paths:
        match = torch.ones(len(ranks), dtype=torch.bool)
        for d, r in enumerate(path):
            match &= ranks[:, d] == r
        accepted = torch.where(match, accepted.clamp(min=len(path)), accepted)
    accepted = accepted.tolist()
    tokens = steps = start = 0
    for end in (labels[:, 0] == -100).nonzero().flatten().tolist():  # each reply's last position
        n, j = end - start + 1, 0  # reply tokens; the prefill gives token 0
        steps += 1
        while j < n - 1:  # a tree step from the state "tokens 0..j known"
            j += accepted[start + j] + 1
            steps += 1
        tokens += n
        start = end + 1
    return tokens / max(1, steps)


def calibration(
    acc: list[list[float]],
    budgets: Iterable[int] = (8, 16, 32, 64),
    default: int = 32,
    replayed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict:
    """Calibration record written next to the heads: accuracies and the optimised tree per budget.

    ``expected_acceleration`` is the tree's value under ``acc`` (paper 2.3.3, heads independent).
    With ``replayed = (ranks, labels)`` (``target_ranks``, ``collect_positions``) the record also
    holds each tree's ``simulated_acceleration`` on those replies (``simulated_acceleration``).
    """
    trees, expected, simulated = {}, {}, {}
    for n in budgets:
        paths, value = optimal_tree(acc, n)
        trees[f"optimised_{n}"] = paths
        expected[f"optimised_{n}"] = round(1 + value, 4)
        if replayed is not None:
            simulated[f"optimised_{n}"] = round(simulated_acceleration(*replayed, paths), 4)
    record = {
        "rank_accuracy": [[round(a, 5) for a in row] for row in acc],
        "top1": [round(row[0], 4) for row in acc],
        "top5": [round(sum(row[:5]), 4) for row in acc],
        "expected_acceleration": expected,
        "trees": trees,
        "default_tree": f"optimised_{default}" if default in budgets else None,
    }
    if replayed is not None:
        record["simulated_acceleration"] = simulated
    return record
