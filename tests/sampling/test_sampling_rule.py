"""Exact sampling's per-node rule on hand-built distributions (recursive rejection sampling over the tree: Leviathan et al.
2023; Chen et al. 2023; SpecInfer), the seeded draws, and the compiled walk against the ATen ops."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper

from medusa_core import SamplingConfig, draw, node_status, residual_distributions, try_children
from medusa_core.acceptance import choose_token
from medusa_core.train import SampledTokens

from .support import ALPHA, chi_square

P = torch.tensor([[0.4, 0.3, 0.2, 0.1]])  # [1, V] one parent's distribution


def taken(children: list[int], uniforms: list[float], probs: torch.Tensor = P) -> list[bool]:
    """``try_children`` for children of row 0 with the given uniforms, as a list."""
    n = len(children)
    return try_children(probs, torch.zeros(n, dtype=torch.long), torch.tensor(children), torch.tensor(uniforms)).tolist()


def test_the_first_child_is_accepted_with_its_probability_under_p():
    # Child token 1 has p = 0.3: accepted exactly when u < 0.3 (point-mass draft: min(1, p/q) = p).
    assert taken([1], [0.299]) == [True]
    assert taken([1], [0.301]) == [False]
    assert taken([3], [0.099]) == [True] and taken([3], [0.101]) == [False]


def test_after_one_rejection_the_next_child_is_judged_by_the_renormalised_residual():
    # Token 0 (p = .4) rejected; the residual is [0, .3, .2, .1] / .6, so token 1 passes when u < .5.
    assert taken([0, 1], [0.9, 0.499]) == [False, True]
    assert taken([0, 1], [0.9, 0.501]) == [False, False]
    residual = residual_distributions(P, torch.tensor([0]), torch.tensor([0]))[0]
    assert torch.allclose(residual / residual.sum(), torch.tensor([0.0, 0.5, 1 / 3, 1 / 6]))


def test_after_two_rejections_the_third_child_is_judged_by_the_residual_without_both():
    # Tokens 0 and 1 rejected: the residual is [0, 0, .2, .1] / .3, so token 2 passes when u < 2/3.
    assert taken([0, 1, 2], [0.9, 0.9, 0.666]) == [False, False, True]
    assert taken([0, 1, 2], [0.9, 0.9, 0.667]) == [False, False, False]
    residual = residual_distributions(P, torch.tensor([0, 0]), torch.tensor([0, 1]))[0]
    assert torch.allclose(residual / residual.sum(), torch.tensor([0.0, 0.0, 2 / 3, 1 / 3]))


def test_when_every_child_is_rejected_the_last_token_comes_from_what_they_leave():
    assert taken([0, 1, 2], [0.9, 0.9, 0.9]) == [False, False, False]
    residual = residual_distributions(P, torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]))[0]
    assert torch.allclose(residual / residual.sum(), torch.tensor([0.0, 0.0, 0.0, 1.0]))


def test_only_the_first_passing_sibling_is_taken_and_each_parent_judges_its_own_children():
    # Row 0 is P; row 1 puts all mass on token 2. Children: (row 0: tokens 1, 0), (row 1: tokens 3, 2).
    probs = torch.cat([P, torch.tensor([[0.0, 0.0, 1.0, 0.0]])])
    rows, tokens = torch.tensor([0, 0, 1, 1]), torch.tensor([1, 0, 3, 2])
    # Token 1 passes (u = .1 < .3), so token 0 is never tried although its u would pass too. In row 1,
    # token 3 has p = 0 and is rejected; token 2 holds all the mass left and is accepted even at u = .99.
    assert try_children(probs, rows, tokens, torch.tensor([0.1, 0.0, 0.5, 0.99])).tolist() == [True, False, False, True]


def test_node_status_marks_the_path_the_rejected_siblings_before_it_and_the_last_nodes_children():
    # root 0 -> children 1, 2, 3; node 1 -> 4, 5; node 2 -> 6. The walk took 0 -> 2 and stopped there.
    parents = (-1, 0, 0, 0, 1, 1, 2)
    assert node_status(parents, [0, 2]) == (
        "accepted", "rejected", "accepted", "untried", "untried", "untried", "rejected",
    )
    # Nothing accepted: every child of the root was tried and rejected.
    assert node_status(parents, [0]) == ("accepted", "rejected", "rejected", "rejected") + ("untried",) * 3


def test_a_draw_follows_the_weights_and_never_takes_an_index_of_zero_weight(sampling_path):
    # Unnormalised weights with zeros first, inside and last: 20,000 seeded draws fit weights / sum.
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 6.0, 0.0])
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.stack([draw(weights, generator) for _ in range(20000)]), minlength=6).double()
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]
    assert chi_square(counts[[1, 3, 4]], torch.tensor([0.3, 0.1, 0.6]))[2] > ALPHA
    # All the mass on the last index, or on the first: always that one.
    assert {int(draw(torch.tensor([0.0, 0.0, 2.0]), generator)) for _ in range(50)} == {2}
    assert {int(draw(torch.tensor([1e-30, 0.0, 0.0]), generator)) for _ in range(50)} == {0}
    # Weights spread over several blocks of 16 and a ragged tail (the compiled draw walks block sums).
    spread = torch.zeros(53)
    spread[[3, 17, 18, 40, 52]] = torch.tensor([1.0, 2.0, 0.5, 4.0, 2.5])
    counts = torch.bincount(torch.stack([draw(spread, generator) for _ in range(20000)]), minlength=53).double()
    assert counts.nonzero().flatten().tolist() == [3, 17, 18, 40, 52]
    assert chi_square(counts[[3, 17, 18, 40, 52]], spread[[3, 17, 18, 40, 52]] / 10)[2] > ALPHA


def test_a_sampled_token_follows_the_softmax_of_the_scores_and_never_a_removed_one(sampling_path):
    # choose_token over processed scores: -inf where a filter removed a token, spread over blocks of 16.
    scores = torch.full((70,), -math.inf)
    scores[[0, 15, 16, 33, 69]] = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.7])
    generator = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.stack([choose_token(scores, False, generator) for _ in range(20000)]), minlength=70).double()
    assert counts.nonzero().flatten().tolist() == [0, 15, 16, 33, 69]
    assert chi_square(counts[[0, 15, 16, 33, 69]], torch.softmax(scores, -1)[[0, 15, 16, 33, 69]])[2] > ALPHA
    assert int(choose_token(scores, True, generator)) == 33


def test_a_distillation_draw_follows_hfs_processed_distribution_row_by_row(sampling_path):
    # SampledTokens (distill's sampling inside generate's greedy search): each row's token follows the softmax of HF's
    # repetition penalty, temperature and top-p over that row's own ids, never a token they remove.
    config = SamplingConfig(temperature=0.7, top_p=0.8, repetition_penalty=1.3)
    scores = torch.randn(2, 40, generator=torch.Generator().manual_seed(5)) * 1.5  # [B, V]
    ids = torch.tensor([[3, 3, 7, 0], [1, 2, 5, 9]])  # [B, L]: each row penalises its own
    reference = RepetitionPenaltyLogitsProcessor(1.3)(ids, scores.clone())
    probs = torch.softmax(TopPLogitsWarper(0.8)(ids, TemperatureLogitsWarper(0.7)(ids, reference)), -1)  # [B, V]
    step = SampledTokens(config, torch.Generator().manual_seed(0))
    out = step(ids, scores.clone())
    assert ((out == 0).sum(-1) == 1).all() and ((out == 0) | (out == -math.inf)).all()  # one token a row to take
    drawn = torch.stack([step(ids, scores.clone()).argmax(-1) for _ in range(10000)])  # [N, B]
    for row in range(2):
        counts = torch.bincount(drawn[:, row], minlength=40).double()
        kept = probs[row] > 0
        assert 2 <= int(kept.sum()) < 40 and counts[~kept].sum() == 0
        assert chi_square(counts[kept], probs[row][kept])[2] > ALPHA
    with pytest.raises(ValueError, match="temperature 0"):
        SampledTokens(SamplingConfig(), torch.Generator())


def test_the_compiled_walk_keeps_the_path_length_and_next_root_of_the_aten_ops(monkeypatch):
    """``verify_tree`` at greedy and in exact mode, compiled (one call) against ATen's ops, on trees with
    siblings, a chain, one node, ties for the argmax and -inf scores: the same path, length and next root, and
    the same uniforms taken from the generator (the draws after it agree)."""
    from medusa_core import acceptance
    from medusa_core.lean.build import load_extension
    from medusa_core.steptree import static_tree

    module, why = load_extension()
    if module is None:
        pytest.skip(f"no compiled kernels on this machine: {why}")
    trees = [[[0]], [[0], [1], [0, 0], [0, 1], [1, 0]], [[0], [0, 0], [0, 0, 0]], [[0], [1], [2], [0, 0], [0, 0, 0], [1, 0], [0, 1]]]
    g = torch.Generator().manual_seed(0)
    vocab, checked = 40, 0
    for choices in trees:
        tree = static_tree("t", choices, torch.float32, torch.device("cpu"))
        n = tree.num_nodes
        for trial in range(150):
            scores = torch.randn(n, vocab, generator=g) * 2
            if trial % 3 == 0:  # a tie for each row's largest score: the first of them is the argmax
                scores[:, 5] = scores[:, 9] = scores.max() + 1
            if trial % 5 == 0:  # filtered tokens
                scores[:, 20:] = -math.inf
            # tokens: the argmax of the parent's row half of the time, so walks go deep
            tokens = torch.randint(0, vocab, (n,), generator=g)
            for c in range(1, n):
                if torch.rand((), generator=g) < 0.5:
                    tokens[c] = scores[tree.node_parents[c]].argmax()
            for i, c in enumerate(tree.children):  # siblings hold distinct tokens, as every tree the engine builds
                seen = set()
                for child in c:
                    while int(tokens[child]) in seen:
                        tokens[child] = (tokens[child] + 1) % vocab
                    seen.add(int(tokens[child]))
            for rule in ("greedy", "exact"):
                results = []
                for kernels in ({}, {"draw_index": module.draw_index, "tree_walk": module.tree_walk}):
                    monkeypatch.setattr(acceptance, "SAMPLING_KERNELS", kernels)
                    gen = torch.Generator().manual_seed(trial)
                    path, length, root = acceptance.verify_tree(tree, scores, tokens, rule, 0.09, 0.3, gen)
                    results.append((path.tolist(), int(length), int(root), float(torch.rand((), generator=gen))))
                assert results[0] == results[1], (choices, trial, rule)
                checked += results[0][1] > 1
    assert checked > 100  # walks past the first candidate were compared


def test_the_compiled_calls_skip_blocks_a_filter_removed_and_keep_every_bit(sampling_path):
    """A block of 16 scores of -inf (a row filtered to a few tokens) is skipped by the compiled draw and walk, which
    must then take the same token as for the same row with -1e30 there (whose e^x is the same +0, computed)."""
    from medusa_core import acceptance
    from medusa_core.steptree import static_tree

    g = torch.Generator().manual_seed(5)
    tree = static_tree("t", [[0], [1], [0, 0]], torch.float32, torch.device("cpu"))
    for trial in range(200):
        filtered = torch.full((4, 1000), -math.inf)
        for row in filtered:  # a few kept tokens, some in the same block, and the ragged last block
            kept = torch.cat([torch.randint(0, 1000, (5,), generator=g), torch.tensor([998])])
            row[kept] = torch.randn(6, generator=g) * 2
        finite = filtered.masked_fill(filtered == -math.inf, -1e30)
        tokens = torch.cat([torch.tensor([0]), filtered[[0, 0, 1]].argmax(-1)])
        results = []
        for scores in (filtered, finite):
            gen = torch.Generator().manual_seed(trial)
            drawn = int(choose_token(scores[3], False, gen))
            path, length, root = acceptance.verify_tree(tree, scores, tokens, "exact", 0.09, 0.3, gen)
            results.append((drawn, path.tolist(), int(length), int(root)))
        assert results[0] == results[1], trial
        assert filtered[3, results[0][0]] > -math.inf
