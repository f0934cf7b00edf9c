"""Greedy and typical acceptance (paper 2.3.1) on hand-built logits.

``evaluate_posterior(logits [P, D+1, V], candidates [P, D+1], ...)``: position j of a path's logits
judges the candidate at position j+1. Typical acceptance accepts x when
``p(x) > min(ε, δ·exp(−H(p)))`` with p = softmax(logits / T).
"""

from __future__ import annotations

import math

import pytest
import torch

from medusa_core import evaluate_posterior

EPS, ALPHA = 0.09, 0.3  # paper defaults ε, δ


def peaked(argmaxes: list[list[int]], vocab: int = 4) -> torch.Tensor:
    """Logits [P, D+1, V] whose argmax at path p, position j is ``argmaxes[p][j]``."""
    idx = torch.tensor(argmaxes)
    return torch.nn.functional.one_hot(idx, vocab).float() * 5.0


def from_probs(probs: list[list[list[float]]]) -> torch.Tensor:
    """Logits [P, D+1, V] = log p, so softmax at temperature 1 gives back ``probs``."""
    return torch.tensor(probs).log()


def entropy(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in p if x > 0)


# ----------------------------------------------------------------------------------------- greedy
def test_greedy_accepts_the_longest_prefix_matching_the_argmax_and_the_first_longest_path_wins():
    # argmax after the root is 1, then 2. Path 0 matches once; paths 1 and 2 match twice.
    logits = peaked([[1, 2, 0], [1, 2, 0], [1, 2, 0]])
    candidates = torch.tensor([[7, 1, 3], [7, 1, 2], [7, 1, 2]])
    assert evaluate_posterior(logits, candidates, 0.0) == (1, 2)


def test_greedy_stops_at_the_first_mismatch_even_if_later_positions_match():
    logits = peaked([[1, 2, 0], [1, 2, 0]])
    candidates = torch.tensor([[7, 3, 0], [7, 1, 3]])  # path 0 matches position 2 only after a miss
    assert evaluate_posterior(logits, candidates, 0.0) == (1, 1)


def test_greedy_with_nothing_accepted_keeps_path_zero_with_length_zero():
    logits = peaked([[1, 2, 0], [1, 2, 0]])
    candidates = torch.tensor([[7, 3, 2], [7, 0, 2]])
    assert evaluate_posterior(logits, candidates, 0.0) == (0, 0)


# ------------------------------------------------------------------------------ typical acceptance
def test_typical_acceptance_accepts_a_token_above_the_hard_threshold():
    # p = [.7, .1, .1, .1]: H = 0.94, δ·e^−H = 0.117, threshold = min(.09, .117) = .09 < p(1) = .1
    logits = from_probs([[[0.7, 0.1, 0.1, 0.1], [0.25] * 4]])
    assert evaluate_posterior(logits, torch.tensor([[0, 1]]), 1.0, EPS, ALPHA) == (0, 1)


def test_typical_acceptance_rejects_a_token_below_the_threshold():
    # p = [.7, .2, .05, .05]: H = 0.87, threshold = min(.09, .126) = .09 > p(2) = .05
    logits = from_probs([[[0.7, 0.2, 0.05, 0.05], [0.25] * 4]])
    assert evaluate_posterior(logits, torch.tensor([[0, 2]]), 1.0, EPS, ALPHA) == (0, 0)


def test_a_flat_distribution_accepts_a_token_that_a_peaked_one_rejects():
    # Both give the candidate (token 1) p = 1/16 = 0.0625 < ε.
    # flat: H = ln 16 = 2.77, δ·e^−H = 0.3/16 = 0.019 → threshold 0.019 < 0.0625: accepted.
    # peaked: p = [.9, .0625, 14 × .0027], H = 0.49, δ·e^−H = 0.18 → threshold ε = .09 > 0.0625: rejected.
    flat = [1 / 16] * 16
    sharp = [0.9, 0.0625] + [0.0375 / 14] * 14
    assert entropy(flat) > 2.7 and entropy(sharp) < 0.5
    candidates = torch.tensor([[0, 1]])
    assert evaluate_posterior(from_probs([[flat, flat]]), candidates, 1.0, EPS, ALPHA) == (0, 1)
    assert evaluate_posterior(from_probs([[sharp, flat]]), candidates, 1.0, EPS, ALPHA) == (0, 0)


def test_the_hard_threshold_caps_the_entropy_threshold():
    # p = [.85, .1, .025, .025]: H = 0.55, δ·e^−H = 0.17 > p(1) = .1 > ε = .09 — accepted only
    # because the threshold is the min; with ε = .2 the threshold is 0.17 and the token is rejected.
    probs = [0.85, 0.1, 0.025, 0.025]
    assert ALPHA * math.exp(-entropy(probs)) > 0.1
    candidates = torch.tensor([[0, 1]])
    assert evaluate_posterior(from_probs([[probs, probs]]), candidates, 1.0, EPS, ALPHA) == (0, 1)
    assert evaluate_posterior(from_probs([[probs, probs]]), candidates, 1.0, 0.2, ALPHA) == (0, 0)


def test_temperature_scales_the_distribution_before_the_threshold():
    # p(1) = .1 is accepted at T = 1; at T = 0.5 p ∝ p², p(1) = .01/.52 ≈ .019 < .09: rejected.
    logits = from_probs([[[0.7, 0.1, 0.1, 0.1], [0.25] * 4]])
    candidates = torch.tensor([[0, 1]])
    assert evaluate_posterior(logits, candidates, 1.0, EPS, ALPHA) == (0, 1)
    assert evaluate_posterior(logits, candidates, 0.5, EPS, ALPHA) == (0, 0)


def test_typical_acceptance_breaks_ties_among_the_longest_paths_by_likelihood():
    # p = [.5, .3, .17, .03], ε = .05 is the threshold (δ·e^−H = .098). Paths 0 and 1 accept 2 tokens,
    # path 1's are likelier (.5·.5 vs .3·.3); path 2 accepts 1 (p(3) = .03 is rejected).
    p = [0.5, 0.3, 0.17, 0.03]
    logits = from_probs([[p, p, p]] * 3)
    candidates = torch.tensor([[0, 1, 1], [0, 0, 0], [0, 0, 3]])
    assert evaluate_posterior(logits, candidates, 1.0, 0.05, ALPHA) == (1, 2)
    # Greedy on the same input: only token 0 matches; the first path of maximal length is path 1.
    assert evaluate_posterior(logits, candidates, 0.0) == (1, 2)
    # Swapping the rows moves the winner with them: the choice is by likelihood, not position.
    assert evaluate_posterior(logits, candidates[[1, 0, 2]], 1.0, 0.05, ALPHA) == (0, 2)


def test_typical_acceptance_with_nothing_accepted_keeps_path_zero():
    # Path 1's candidate is likelier than path 0's, but both are below the threshold.
    p = [0.94, 0.04, 0.015, 0.005]
    logits = from_probs([[p, p]] * 2)
    candidates = torch.tensor([[0, 3], [0, 1]])
    assert evaluate_posterior(logits, candidates, 1.0, EPS, ALPHA) == (0, 0)


# -------------------------------------------------------------------------------------- padding
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_padded_position_is_never_counted_as_accepted(temperature):
    # Path 0 is root + 1 node, padded with token 0 — which is exactly what the backbone predicts
    # there, so without path_lengths it would count as a second accepted token.
    p_first = [0.05, 0.9, 0.025, 0.025]  # argmax 1
    p_next = [0.9, 0.05, 0.025, 0.025]  # argmax 0
    logits = from_probs([[p_first, p_next, p_next], [p_first, p_next, p_next]])
    candidates = torch.tensor([[7, 1, 0], [7, 1, 0]])
    assert evaluate_posterior(logits, candidates, temperature, EPS, ALPHA) == (0, 2)
    lengths = torch.tensor([2, 3])
    assert evaluate_posterior(logits, candidates, temperature, EPS, ALPHA, path_lengths=lengths) == (1, 2)
    only_short = torch.tensor([2, 2])
    assert evaluate_posterior(logits, candidates, temperature, EPS, ALPHA, path_lengths=only_short) == (0, 1)
