"""Calibration (paper 2.3.3): per-head rank accuracies on held-out replies and optimised trees, and
each head's temperature (temperature scaling, Guo et al. 2017, "On calibration of modern neural networks").

The record written next to the heads (``medusa_calibration.json``) holds the accuracies, the
optimised tree per node budget, its expected acceleration (heads assumed independent) and, when the
held-out replies are given, its acceleration replayed on them (exact for greedy decoding) and the
heads' temperatures (``head_temperatures``: softmax(logits_k / T_k) is then a calibrated probability,
which trees shaped per step threshold, EAGLE-2 style: ``MedusaModel.generate``).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from ..heads import MedusaHeads
from ..trees import optimal_tree

#: The range a fitted temperature is kept in: a head whose targets are always (never) its top-1 would
#: otherwise drive T to 0 (infinity).
TEMPERATURE_RANGE = (0.01, 100.0)


@torch.inference_mode()
def fit_temperature(logits: torch.Tensor, targets: torch.Tensor, *, iterations: int = 50, chunk: int = 1024) -> float:
    """The temperature T minimising the mean negative log-likelihood of ``targets`` under softmax(logits / T)
    (temperature scaling: Guo et al. 2017, "On calibration of modern neural networks", section 4.2).

    Args:
        logits: [M, V] scores of M positions (any float dtype; computed in float32, ``chunk`` rows at a time).
        targets: [M] token ids, the true outcome at each position.
        iterations: Newton steps at most.
    Returns T > 0 (dimensionless), kept within ``TEMPERATURE_RANGE``; T > 1 flattens over-confident scores.

    With β = 1/T, NLL(β) = mean(logsumexp(β·z) − β·z_y) is convex in β, with gradient mean(E_p[z] − z_y) and
    second derivative mean(Var_p[z]) under p = softmax(β·z): Newton's method on β, kept inside the bracket
    of the signs of the gradient seen so far, converges in a few passes over the logits.
    Raises ``ValueError`` for empty or mismatched inputs, naming their shapes.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1] or len(targets) == 0:
        raise ValueError(f"fit_temperature needs logits [M, V] and targets [M], got {list(logits.shape)} and {list(targets.shape)}")
    lo, hi = 1 / TEMPERATURE_RANGE[1], 1 / TEMPERATURE_RANGE[0]  # the bracket of β
    beta = 1.0
    for _ in range(iterations):
        grad = curvature = 0.0
        for start in range(0, len(targets), chunk):
            z = logits[start : start + chunk].float()  # [C, V]
            p = (beta * z).softmax(dim=-1)
            mean = (p * z).sum(-1)  # [C] E_p[z]
            grad += (mean - z.gather(1, targets[start : start + chunk, None].long())[:, 0]).sum().item()
            curvature += ((p * z.square()).sum(-1) - mean.square()).clamp(min=0).sum().item()
        if grad > 0:  # the NLL grows with β: the optimum is below
            hi = beta
        else:
            lo = beta
        step = beta - grad / curvature if curvature > 0 else math.nan
        new = step if lo < step < hi else math.sqrt(lo * hi)
        if abs(new - beta) <= 1e-6 * beta:
            beta = new
            break
        beta = new
    return float(min(max(1 / beta, TEMPERATURE_RANGE[0]), TEMPERATURE_RANGE[1]))


@torch.inference_mode()
def head_temperatures(
    heads: MedusaHeads,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    max_positions: int = 4096,
    batch_size: int = 512,
    roots: torch.Tensor | None = None,
) -> list[float]:
    """Each head's ``fit_temperature`` on held-out positions: T_k such that softmax(logits_k / T_k) best
    predicts the token k+2 places ahead (Guo et al. 2017; the probabilities then shape trees, EAGLE-2).

    Args: hidden [M, H], labels [M, K] (``collect_positions``; -100 = no target); ``max_positions``: at most
    that many positions, evenly spaced, whose logits are kept in bfloat16 ([K, max_positions, V]);
    roots [M] for root-conditioned heads (``collect_positions(with_roots=True)``).
    Returns [K] temperatures. Raises ``ValueError`` when no position has a target.
    """
    rows = (labels != -100).any(dim=1).nonzero().flatten()
    if not len(rows):
        raise ValueError(f"no position of labels {list(labels.shape)} has a target: nothing to fit temperatures on")
    rows = rows[torch.linspace(0, len(rows) - 1, min(len(rows), max_positions)).round().long()]
    logits = torch.cat([_head_logits(heads, hidden, roots, rows[s : s + batch_size]).to(torch.bfloat16).cpu()
                        for s in range(0, len(rows), batch_size)], dim=1)  # [K, M', V]
    temperatures = []
    for k in range(heads.num_heads):
        ok = labels[rows, k] != -100
        temperatures.append(fit_temperature(logits[k][ok], labels[rows, k][ok]))
    return temperatures


@torch.inference_mode()
def target_ranks(
    heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, batch_size: int = 4096, roots: torch.Tensor | None = None
) -> torch.Tensor:
    """Rank of each head's target token among that head's logits over the whole vocabulary (paper 2.3.3).

    Args: hidden [M, H], labels [M, K] (``collect_positions``; -100 = no target); roots [M] for
    root-conditioned heads.
    Returns ranks [M, K] int64: 0 = the target is the head's top-1, -1 where there is no target.
    """
    ranks = torch.full(labels.shape, -1, dtype=torch.long)
    device = next(heads.parameters()).device
    for start in range(0, len(hidden), batch_size):
        lab = labels[start : start + batch_size].to(device)
        logits = _head_logits(heads, hidden, roots, torch.arange(start, min(start + batch_size, len(hidden))))  # [K, B, V]
        for k in range(heads.num_heads):
            target_logit = logits[k].gather(1, lab[:, k, None].clamp(min=0))
            rank = (logits[k] > target_logit).sum(dim=1)  # [B]
            ranks[start : start + batch_size, k] = torch.where(lab[:, k] != -100, rank, -1).cpu()
    return ranks


def rank_accuracy(
    heads: MedusaHeads,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    max_rank: int = 10,
    batch_size: int = 4096,
    roots: torch.Tensor | None = None,
) -> list[list[float]]:
    """``a[k][i]``: fraction of positions where the target is exactly rank i of head k (paper 2.3.3).

    Top-n accuracy of head k is ``sum(a[k][:n])``. Args: hidden [M, H], labels [M, K], roots [M] for
    root-conditioned heads.
    """
    return accuracy_from_ranks(target_ranks(heads, hidden, labels, batch_size, roots), max_rank)


def _head_logits(heads: MedusaHeads, hidden: torch.Tensor, roots: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """The heads' logits [K, B, V] at positions ``rows`` [B] of ``hidden`` [M, H] (and ``roots`` [M])."""
    param = next(heads.parameters())
    rooted = {} if roots is None else {"root": roots[rows].to(param.device)}  # only root-conditioned heads take it
    return heads(hidden[rows].to(param.device, param.dtype), **rooted)


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
    temperatures: Sequence[float] | None = None,
) -> dict:
    """Calibration record written next to the heads: accuracies and the optimised tree per budget.

    ``expected_acceleration`` is the tree's value under ``acc`` (paper 2.3.3, heads independent).
    With ``replayed = (ranks, labels)`` (``target_ranks``, ``collect_positions``) the record also
    holds each tree's ``simulated_acceleration`` on those replies (``simulated_acceleration``); with
    ``temperatures`` ([K], ``head_temperatures``) it holds them as ``head_temperatures``.
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
    if temperatures is not None:
        record["head_temperatures"] = [round(t, 4) for t in temperatures]
    return record
