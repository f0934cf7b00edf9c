"""Verification of candidate paths: greedy exact match and typical acceptance (paper 2.3.1).

Pure functions on tensors. ``evaluate_posterior`` takes the per-path layout of the reference; the
decode loop scores each tree node once (``score_children``) and reads paths out of that with
``select_path``, which is the same arithmetic without gathering ``[P, D+1, V]`` logits.
"""

from __future__ import annotations

import torch


def score_children(
    logits: torch.Tensor,
    parent_rows: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    posterior_threshold: float,
    posterior_alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Judge each candidate token against the backbone distribution at its parent.

    Args:
        logits: [M, V] backbone logits; row m predicts the token after position m.
        parent_rows: [C] row of ``logits`` that judges each candidate.
        tokens: [C] candidate token ids.
        temperature: 0 for greedy exact match, > 0 for typical acceptance.
        posterior_threshold: ε, the hard threshold of typical acceptance.
        posterior_alpha: δ, the entropy-dependent threshold factor.

    Returns:
        (accepted [C] bool, log_prob [C] float32): greedy accepts the argmax; typical acceptance
        accepts x when ``p(x) > min(ε, δ·exp(−H(p)))`` with p = softmax(logits / T) (paper 2.3.1).
        ``log_prob`` is log p(x) (zeros when greedy).
    """
    if temperature <= 0:
        accepted = logits.argmax(dim=-1)[parent_rows] == tokens
        return accepted, torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)  # [M, V]
    entropy = -(log_p.exp() * log_p).sum(dim=-1)  # [M]
    token_log_p = log_p[parent_rows, tokens]  # [C]
    threshold = torch.minimum(
        torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy)
    )[parent_rows]
    return token_log_p.exp() > threshold, token_log_p


def select_path(
    accepted: torch.Tensor, log_prob: torch.Tensor, valid: torch.Tensor, temperature: float
) -> tuple[int, int]:
    """Pick the path to keep from per-position acceptance.

    Args:
        accepted: [P, D] bool, candidate at depth j+1 of path p accepted.
        log_prob: [P, D] log p of those candidates.
        valid: [P, D] bool, position exists (paths shorter than D are padded).
        temperature: 0 → the first path with the longest accepted prefix; > 0 → among the longest,
            the largest sum of log p over the accepted prefix; path 0 when nothing is accepted.

    Returns:
        (best_path, accept_length) as Python ints (one host sync).
    """
    prefix = torch.cumprod((accepted & valid).to(torch.int32), dim=1)  # [P, D]
    lengths = prefix.sum(dim=1)  # [P]
    if temperature <= 0:
        best = int(torch.argmax(lengths))  # argmax returns the first maximum
        return best, int(lengths[best])
    max_len = int(lengths.max())
    if max_len == 0:
        return 0, 0
    score = torch.where(prefix.bool(), log_prob, torch.zeros_like(log_prob)).sum(dim=1)
    score = torch.where(lengths == max_len, score, torch.full_like(score, float("-inf")))
    return int(torch.argmax(score)), max_len


def evaluate_posterior(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    temperature: float,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    path_lengths: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Choose the best candidate path (paper 2.3.1).

    Args:
        logits: [P, D+1, V] backbone logits along each path; position j predicts position j+1.
        candidates: [P, D+1] token ids of each path, root first.
        temperature: 0 → greedy exact match; > 0 → typical acceptance.
        posterior_threshold: ε (default 0.09).
        posterior_alpha: δ (default 0.3).
        path_lengths: [P] valid nodes of each path, root included (default: all D+1 valid).

    Returns:
        (best_candidate, accept_length): the chosen path index and the number of its candidates
        after the root that are accepted (0..D).
    """
    num_paths, width, vocab = logits.shape
    rows = torch.arange(num_paths * width, device=logits.device).view(num_paths, width)[:, :-1]
    accepted, log_prob = score_children(
        logits.reshape(-1, vocab),
        rows.reshape(-1),
        candidates[:, 1:].reshape(-1),
        temperature,
        posterior_threshold,
        posterior_alpha,
    )
    if path_lengths is None:
        valid = torch.ones(num_paths, width - 1, dtype=torch.bool, device=logits.device)
    else:
        valid = torch.arange(1, width, device=logits.device)[None, :] < path_lengths[:, None]
    return select_path(
        accepted.view(num_paths, -1), log_prob.view(num_paths, -1), valid, temperature
    )
