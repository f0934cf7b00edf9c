"""What the sampling tests share: the chi-square test and its significance."""

from __future__ import annotations

import torch

ALPHA = 1e-3  # significance of each chi-square test (joint law and the 3 positions' laws)
MIN_EXPECTED = 5  # cells expected fewer times are pooled by shared prefix (the usual validity rule)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's goodness-of-fit test of token-sequence ``counts`` [V, ..., V] against ``probs`` (same shape).

    Cells expected fewer than ``MIN_EXPECTED`` times are pooled by their shared prefix: first into
    (t1, t2, *), what is still too rare into (t1, *, *), the rest into one cell. Returns (statistic,
    degrees of freedom, p-value); the p-value is the chi-square survival function Q(dof/2, stat/2),
    the regularised upper incomplete gamma function.
    """
    length, vocab = counts.dim(), counts.shape[0]
    observed_all, expected_all = counts.flatten().double(), probs.flatten().double() * counts.sum()
    remaining = torch.ones_like(observed_all, dtype=torch.bool)
    observed, expected = [], []
    for level in range(length, -1, -1):  # prefix length shared by a pooled cell
        group = torch.arange(len(observed_all)) // vocab ** (length - level)  # [cells] pooled cell of each
        pooled_o = torch.zeros(vocab**level, dtype=torch.float64).index_add(0, group, observed_all * remaining)
        pooled_e = torch.zeros(vocab**level, dtype=torch.float64).index_add(0, group, expected_all * remaining)
        keep = pooled_e >= MIN_EXPECTED if level else pooled_e > 0
        observed.append(pooled_o[keep])
        expected.append(pooled_e[keep])
        remaining &= ~keep[group]
    observed, expected = torch.cat(observed), torch.cat(expected)
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    return stat, dof, float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))
