"""Calibration (paper 2.3.3): per-head rank accuracies on held-out replies and optimised trees.

The record written next to the heads (``medusa_calibration.json``) holds the accuracies, the
optimised tree per node budget and its expected acceleration.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..heads import MedusaHeads
from ..trees import optimal_tree

@torch.inference_mode()
def rank_accuracy(
    heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, max_rank: int = 10, batch_size: int = 4096
) -> list[list[float]]:
    """``a[k][i]``: fraction of positions where the target is exactly rank i of head k (paper 2.3.3).

    Top-n accuracy of head k is ``sum(a[k][:n])``. Args: hidden [M, H], labels [M, K].
    """
    counts = torch.zeros(heads.num_heads, max_rank)
    totals = torch.zeros(heads.num_heads)
    dtype = next(heads.parameters()).dtype
    device = next(heads.parameters()).device
    for start in range(0, len(hidden), batch_size):
        h = hidden[start : start + batch_size].to(device, dtype)
        lab = labels[start : start + batch_size].to(device)
        logits = heads(h)  # [K, B, V]
        for k in range(heads.num_heads):
            valid = lab[:, k] != -100
            if not valid.any():
                continue
            lk = logits[k][valid]
            target_logit = lk.gather(1, lab[valid, k, None])
            rank = (lk > target_logit).sum(dim=1)  # [B'] 0 = top-1
            counts[k] += torch.bincount(rank.clamp(max=max_rank), minlength=max_rank + 1)[:max_rank].cpu()
            totals[k] += valid.sum().cpu()
    return (counts / totals.clamp(min=1)[:, None]).tolist()


def calibration(acc: list[list[float]], budgets: Iterable[int] = (8, 16, 32, 64), default: int = 32) -> dict:
    """Calibration record written next to the heads: accuracies and the optimised tree per budget."""
    trees, expected = {}, {}
    for n in budgets:
        paths, value = optimal_tree(acc, n)
        trees[f"optimised_{n}"] = paths
        expected[f"optimised_{n}"] = round(1 + value, 4)
    return {
        "rank_accuracy": [[round(a, 5) for a in row] for row in acc],
        "top1": [round(row[0], 4) for row in acc],
        "top5": [round(sum(row[:5]), 4) for row in acc],
        "expected_acceleration": expected,
        "trees": trees,
        "default_tree": f"optimised_{default}" if default in budgets else None,
    }
