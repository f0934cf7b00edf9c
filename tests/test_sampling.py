"""Exact sampling at temperature > 0: recursive rejection sampling over the tree (Leviathan et al. 2023;
Chen et al. 2023; SpecInfer) beside typical acceptance (paper 2.3.1).

Part 1 checks the per-node rule on hand-built distributions. Part 2 is the proof by statistics: on a
tiny model with a 16-token vocabulary, the first 3 tokens of thousands of seeded ``"exact"`` replies
follow plain sampling's distribution (computed from the backbone, and matched by ``medusa=False``
replies) under a chi-square test, for random heads, oracle heads and heads that never propose the
argmax, with n-gram drafts from the context in the tree (``drafts="hybrid"`` / ``"ngram"``), and with a
drafter's chains verified alone (``drafts="eagle"``, the app's default drafts; a random drafter);
typical acceptance with ε = δ = 1e-6 fails the same test. The same holds with temperature,
top-p and a repetition penalty (HF's processors, each node judged given its own prefix), and a penalty
blind to the node's ancestors in the tree fails it (the power check). Part 3 checks the engine's records.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import PROMPT  # plain data, shared with the fixtures
from torch import nn
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper
from tiny_models import random_drafter, random_heads, tiny_backbone

import medusa_core.decoding
from medusa_core import (
    NODE_STATUSES,
    DraftConfig,
    SAMPLING_RULES,
    MedusaModel,
    SamplingConfig,
    draw,
    node_status,
    residual_distributions,
    try_children,
)
from medusa_core.acceptance import choose_token
from medusa_core.train import SampledTokens

# ------------------------------------------------------------------------------- the per-node rule
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


# ------------------------------------------------------------------------------ proof by statistics
VOCAB = 16
TEMPERATURE = 0.7
# Every processor that shapes p, strong enough that a penalty blind to the tree's ancestors shows.
PROCESSED = SamplingConfig(temperature=TEMPERATURE, top_p=0.9, repetition_penalty=3.0)
RUNS = 2000  # seeded replies per case
TYPICAL_RUNS = 500  # typical acceptance is far off: a quarter of the runs rejects it by many orders of magnitude
BLIND_RUNS = 6000  # a penalty blind to the tree's ancestors is off by little: t3 repeats t2 in 4.65 % of replies, not 3.69 %
ALPHA = 1e-3  # significance of each chi-square test (joint law and the 3 positions' laws)
MIN_EXPECTED = 5  # cells expected fewer times are pooled by shared prefix (the usual validity rule)
# Wide at both depths (6 x 3): candidates hold much of p's mass, so a wrong residual shows.
TREE = [[i] for i in range(6)] + [[i, j] for i in range(6) for j in range(3)]
STAT_PROMPT = torch.tensor([[3, 1, 4, 1, 5]])  # [1, T]


def tiny_vocab_backbone(hidden_size: int = 16) -> nn.Module:
    """A 1-layer Llama with 16 tokens; weights drawn wide enough that p is peaked at T = 0.7 (their spread shrinks
    as 1/√width, so a wider model's logits spread as the 16-wide one's)."""
    return tiny_backbone(
        "llama", seed=0, vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2 * math.sqrt(16 / hidden_size),
    )


def forward_all(backbone: nn.Module, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-norm hidden [B, T, H], p = softmax(logits / T) [B, T, V]) of full sequences [B, T]."""
    with torch.inference_mode():
        hidden = backbone.get_decoder()(input_ids=seqs).last_hidden_state
        probs = torch.softmax(backbone.get_output_embeddings()(hidden).double() / TEMPERATURE, dim=-1)
    return hidden, probs


def continuations(length: int) -> torch.Tensor:
    """Every token sequence of ``length`` after ``STAT_PROMPT``, prompt included: [V^length, T + length]."""
    tails = list(itertools.product(range(VOCAB), repeat=length))
    tails = torch.tensor(tails, dtype=torch.long).view(len(tails), length)
    return torch.cat([STAT_PROMPT.repeat(tails.shape[0], 1), tails], dim=1)


def processed_probs(backbone: nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    """p [B, T, V] float64 of full sequences [B, T] with ``PROCESSED``'s settings, as HF ``generate``
    computes them: at position j, the repetition penalty over ``seqs[:, :j+1]``, then temperature, top-p."""
    with torch.inference_mode():
        logits = backbone(seqs).logits.float()  # [B, T, V]
    rows = []
    for j in range(seqs.shape[1]):
        scores = RepetitionPenaltyLogitsProcessor(PROCESSED.repetition_penalty)(seqs[:, : j + 1], logits[:, j])
        scores = TopPLogitsWarper(PROCESSED.top_p)(None, TemperatureLogitsWarper(PROCESSED.temperature)(None, scores))
        rows.append(torch.softmax(scores.double(), dim=-1))
    return torch.stack(rows, dim=1)


def plain_sampling_distribution(backbone: nn.Module, processed: bool = False) -> torch.Tensor:
    """Law of the first 3 tokens under plain sampling: p(t1) p(t2 | t1) p(t3 | t1, t2), [V, V, V] float64;
    p = softmax(logits / T), or with ``processed`` HF's processors at ``PROCESSED``'s settings."""
    seqs = continuations(2)  # row (t1, t2)
    probs = processed_probs(backbone, seqs) if processed else forward_all(backbone, seqs)[1]
    t = STAT_PROMPT.shape[1]
    p1 = probs[0, t - 1]  # [V]
    p2 = probs[::VOCAB, t]  # [V, V] rows (t1, 0) hold p(. | t1)
    p3 = probs[:, t + 1].view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


class ContextHeads(nn.Module):
    """Heads that recognise their context by its hidden state and propose fixed tokens for it.

    For every context the first 3 tokens can see (the prompt plus 0, 1 or 2 tokens), head k's "true"
    token is the greedy continuation's token k+2 positions ahead: ``oracle`` ranks it first,
    ``misses`` ranks it last (outside the top-10 that trees draw from); the other tokens follow a
    fixed random order. Lookup is nearest neighbour: the contexts' hidden states lie at least 0.3 apart
    (checked) and the engine's tree forward reproduces them to ~2e-3, so a distance above 0.05 fails loudly.
    """

    def __init__(self, backbone: nn.Module, kind: str, num_heads: int = 2):
        super().__init__()
        self.num_heads = num_heads
        self.hidden_size = backbone.config.hidden_size
        keys, logits = [], []
        noise = torch.rand(num_heads, VOCAB, generator=torch.Generator().manual_seed(7))  # [K, V] in [0, 1)
        for length in range(3):
            seqs = continuations(length)
            keys.append(forward_all(backbone, seqs)[0][:, -1])  # [C, H] the context's last hidden state
            for _ in range(num_heads + 1):  # greedy chain: append the argmax num_heads + 1 times
                _, probs = forward_all(backbone, seqs)
                seqs = torch.cat([seqs, probs[:, -1].argmax(-1, keepdim=True)], dim=1)
            truth = seqs[:, -num_heads:]  # [C, K] greedy tokens 2..K+1 ahead
            table = noise[None].repeat(truth.shape[0], 1, 1)  # [C, K, V]
            table.scatter_(2, truth[..., None], 10.0 if kind == "oracle" else -10.0)
            logits.append(table)
        self.register_buffer("keys", torch.cat(keys))  # [C, H]
        assert float(torch.pdist(self.keys).min()) > 0.3, "two contexts share a hidden state: the lookup is ambiguous"
        self.register_buffer("table", torch.cat(logits))  # [C, K, V]

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[B, H] -> [k, B, V]."""
        distance, index = torch.cdist(hidden.float(), self.keys).min(dim=-1)  # [B]
        assert float(distance.max()) < 0.05, f"context not recognised (distance {float(distance.max()):.2g})"
        return self.table[index, : num_heads or self.num_heads].transpose(0, 1)


def heads_of(kind: str, backbone: nn.Module) -> nn.Module:
    return random_heads(backbone, 2) if kind == "random" else ContextHeads(backbone, kind)


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


def test_the_chi_square_p_value_matches_known_quantiles():
    # Chi-square quantiles from tables: P(X > 3.841 | dof 1) = .05, P(X > 18.307 | dof 10) = .05,
    # P(X > 29.588 | dof 10) = .001.
    def p_value(stat: float, dof: int) -> float:
        return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))

    assert p_value(3.841, 1) == pytest.approx(0.05, abs=1e-4)
    assert p_value(18.307, 10) == pytest.approx(0.05, abs=1e-4)
    assert p_value(29.588, 10) == pytest.approx(0.001, abs=1e-5)
    # A perfect fit has statistic 0 and p-value 1; a fit far off has p-value ~0.
    counts = torch.tensor([500.0, 300.0, 200.0])
    assert chi_square(counts, torch.tensor([0.5, 0.3, 0.2])) == pytest.approx((0.0, 2, 1.0), abs=1e-9)
    assert chi_square(counts, torch.tensor([0.3, 0.3, 0.4]))[2] < 1e-10


def test_rare_cells_are_pooled_by_their_shared_prefix():
    # 100 two-token sequences over 3 tokens. Kept alone: (0, 0) 50, (1, 0) 30. Pooled by prefix:
    # (0, *) = (0, 1) + (0, 2) = 6 and (2, *) = 10. Still too rare, pooled last: (1, 1) + (1, 2) = 4.
    probs = torch.tensor([[0.50, 0.03, 0.03], [0.30, 0.02, 0.02], [0.04, 0.03, 0.03]])
    assert chi_square(probs * 100, probs) == pytest.approx((0.0, 4, 1.0), abs=1e-9)
    shifted_in_a_pool = torch.tensor([[50.0, 6.0, 0.0], [30.0, 4.0, 0.0], [10.0, 0.0, 0.0]])
    assert chi_square(shifted_in_a_pool, probs)[0] == pytest.approx(0.0, abs=1e-9)
    shifted_across = torch.tensor([[56.0, 0.0, 0.0], [30.0, 4.0, 0.0], [10.0, 0.0, 0.0]])
    assert chi_square(shifted_across, probs)[0] == pytest.approx(36 / 50 + 36 / 6)


CASES = [
    ("plain", None, False),
    ("exact", "random", False),
    ("exact", "oracle", False),
    ("exact", "misses", False),
    ("typical", "random", False),
    ("typical", "oracle", False),
    ("typical", "misses", False),
    # With temperature + top-p + repetition penalty; "blind" penalises the context but not the node's
    # ancestors in the tree (a deliberately wrong variant the test must reject: its power check).
    ("plain", None, True),
    ("exact", "random", True),
    ("exact", "oracle", True),
    ("blind", "oracle", True),
]
# The same with n-gram drafts from the context (prompt lookup) in the tree: point masses like the heads';
# "-shaped": the heads' tree pruned per step by their own confidence (DraftConfig.min_head_probability).
# "eagle": the app's default drafts, a drafter's chains (here a random drafter, two drafts a step whatever its
# confidence) verified alone, on a backbone whose widths the drafter's 4-bit layer takes.
DRAFT_CASES = [("exact", "random", False, "hybrid"), ("exact", "misses", True, "hybrid"), ("exact", "oracle", True, "ngram"),
               ("typical", "random", False, "ngram"), ("exact", "oracle", False, "hybrid-shaped"),
               ("exact", "random", True, "eagle")]
ALL_CASES = [(*case, "heads") for case in CASES] + DRAFT_CASES


@pytest.mark.parametrize("sampling, heads, processed, drafts", ALL_CASES,
                         ids=[f"{s}-{h or ''}-{'processed' if p else 'T'}{'' if d == 'heads' else '-' + d}".replace("--", "-")
                              for s, h, p, d in ALL_CASES])
def test_the_first_three_tokens_follow_plain_sampling_in_exact_mode_and_not_in_typical_mode(
    sampling, heads, processed, drafts, record_property, monkeypatch, sampling_path, tmp_path
):
    backbone = tiny_vocab_backbone(64 if drafts == "eagle" else 16)
    target = plain_sampling_distribution(backbone, processed)  # [V, V, V]
    model = MedusaModel(backbone, heads_of(heads or "random", backbone))
    medusa = sampling != "plain"
    drafts, shaped = drafts.removesuffix("-shaped"), drafts.endswith("-shaped")
    chain = {}
    if drafts == "eagle":
        model.load_drafter(random_drafter(tmp_path / "drafter.safetensors", backbone.config))
        chain = dict(chain_depth=2, chain_threshold=0.0)
    kwargs = dict(max_new_tokens=3, tree=TREE, config=PROCESSED if processed else SamplingConfig(TEMPERATURE), medusa=medusa,
                  drafts=drafts, draft_config=DraftConfig(min_head_probability=0.5 if shaped else 0.0, **chain))
    blind_case = sampling == "blind"
    if blind_case:
        blind = lambda context, tokens, ancestors: context.view(1, -1).expand(tokens.shape[0], -1)  # noqa: E731
        monkeypatch.setattr(medusa_core.decoding, "tree_prefixes", blind)
        sampling = "exact"
    if medusa:
        kwargs |= dict(sampling=sampling, posterior_threshold=1e-6, posterior_alpha=1e-6)  # ε, δ: typical only
    counts = torch.zeros(VOCAB**3)
    steps = accepted = copied = 0
    runs = TYPICAL_RUNS if sampling == "typical" else BLIND_RUNS if blind_case else RUNS
    for seed in range(runs):
        records = list(model.generate(STAT_PROMPT, seed=seed, **kwargs))
        t1, t2, t3 = [t for r in records for t in r.token_ids]
        counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
        steps += len(records)
        accepted += sum(r.accept_length for r in records)
        copied += sum(r.ngram_tokens for r in records)
    # The joint law of (t1, t2, t3), and each position's own law, which shows a shift at one position
    # with 15 degrees of freedom instead of the joint's ~170.
    counts = counts.view(VOCAB, VOCAB, VOCAB)
    tests = {"joint": chi_square(counts, target)}
    for i, other in enumerate([(1, 2), (0, 2), (0, 1)]):
        tests[f"t{i + 1}"] = chi_square(counts.sum(other), target.sum(other))
    # How often t3 repeats t2: what a repetition penalty acts on, and what a penalty blind to the
    # tree's ancestors gets wrong (measured over 3 × 2000 seeds: 3.9 %, 5.35 %, 4.7 % blind vs 3.69 % true, so
    # 2000 runs reject it only by luck; 6000 runs by about 4 standard errors).
    repeat = torch.eye(VOCAB, dtype=torch.bool).expand(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]: t3 == t2
    tests["t3=t2"] = chi_square(torch.stack([counts[repeat].sum(), counts[~repeat].sum()]),
                                torch.stack([target[repeat].sum(), target[~repeat].sum()]))
    summary = f"{'blind ' * blind_case}{sampling}/{heads or '-'}{' processed' * processed}/{drafts} ({runs} runs, {accepted / steps:.2f} candidates accepted per step, {copied} n-gram tokens): " + "; ".join(
        f"{name} chi2 = {stat:.1f}, dof = {dof}, p = {p:.3g}" for name, (stat, dof, p) in tests.items()
    )
    print(summary)
    record_property("chi_square", summary)
    if sampling == "typical" or blind_case:  # far from p: ε = δ = 1e-6 accepts almost everything; a blind penalty
        assert min(p for _, _, p in tests.values()) < ALPHA, summary
    else:
        assert min(p for _, _, p in tests.values()) >= ALPHA, summary
    if sampling == "exact":  # the walk really went both ways: candidates accepted, and bonus tokens drawn
        assert 0 < accepted < steps * 2, summary
    if drafts != "heads" and medusa:  # n-gram candidates were accepted, so the test saw them
        assert copied > 0, summary


# ----------------------------------------------------------------------------------- engine records
def test_exact_sampling_repeats_with_a_seed_and_records_its_rule_and_every_nodes_status(backbone_for, random_model):
    model = random_model(backbone_for("llama"))
    kwargs = dict(max_new_tokens=24, tree="sparse_16", temperature=0.7, sampling="exact")
    first = list(model.generate(PROMPT, seed=4, **kwargs))
    assert [r.token_ids for r in model.generate(PROMPT, seed=4, **kwargs)] == [r.token_ids for r in first]
    assert [r.token_ids for r in model.generate(PROMPT, seed=5, **kwargs)] != [r.token_ids for r in first]
    for r in first:
        assert r.sampling == "exact" and r.sampling in SAMPLING_RULES
        assert len(r.node_status) == r.tree_nodes and set(r.node_status) <= set(NODE_STATUSES)
        assert [n for n, s in enumerate(r.node_status) if s == "accepted"] == sorted(r.accepted_nodes)
        assert r.node_status == node_status(r.node_parents, r.accepted_nodes)
    assert any("rejected" in r.node_status for r in first)


def test_the_bonus_token_is_never_a_candidate_the_last_node_rejected(backbone_for, oracle_model):
    # The next step's root is drawn from the residual at the last accepted node, which excludes its
    # rejected children; drawing it from p instead would repeat a rejected token now and then.
    model = oracle_model(backbone_for("llama"), 60)
    records = list(model.generate(PROMPT, max_new_tokens=60, tree="sparse_16", temperature=1.0, sampling="exact", seed=0))
    checked = 0
    for r, following in zip(records[1:], records[2:]):  # records[0] is the prefill
        last = r.accepted_nodes[-1]
        rejected = {r.node_token_ids[c] for c, a in enumerate(r.node_parents) if a == last}
        assert all(r.node_status[c] == "rejected" for c, a in enumerate(r.node_parents) if a == last)
        assert r.token_ids[-1] == following.node_token_ids[0]  # the step's last token: the next root
        assert r.token_ids[-1] not in rejected
        checked += bool(rejected)
    assert checked >= 5


@pytest.mark.parametrize("sampling", ["typical", "exact"])
def test_temperature_zero_is_greedy_in_both_sampling_modes(sampling, backbone_for, reference_for, oracle_model):
    model = oracle_model(backbone_for("qwen2"), 40)
    records = list(model.generate(PROMPT, max_new_tokens=40, tree="mc_sim_7b_63", sampling=sampling))
    assert [t for r in records for t in r.token_ids] == reference_for("qwen2", 40)
    assert all(r.sampling == "greedy" and r.node_status == () for r in records)


def test_plain_sampling_draws_each_token_from_the_softmax_with_the_seeded_generator(backbone_for, random_model):
    # medusa=False must keep its behaviour: token i = draw(softmax(logits_i / T)) with one
    # torch.Generator seeded once, whatever the sampling mode says.
    backbone = backbone_for("llama")
    model = random_model(backbone)
    generator = torch.Generator().manual_seed(11)
    expected, seq = [], PROMPT
    with torch.inference_mode():
        for _ in range(12):
            probs = torch.softmax(backbone(seq).logits[0, -1].float() / 0.8, dim=-1)
            expected.append(int(draw(probs, generator)))
            seq = torch.cat([seq, torch.tensor([[expected[-1]]])], dim=1)
    for sampling in ("typical", "exact"):
        records = list(model.generate(PROMPT, max_new_tokens=12, temperature=0.8, medusa=False, seed=11, sampling=sampling))
        assert [t for r in records for t in r.token_ids] == expected
        assert all(r.sampling == "sample" for r in records) and "sample" in SAMPLING_RULES
