"""The decoding engine (paper 2.1–2.3.1) on tiny random models: exactness, step records, stopping, input
checks and seeded sampling.

The key property: greedy Medusa output equals plain greedy decoding token for token, whether the heads
are always wrong (random heads) or always right (oracle heads, which exercise deep acceptance and
cache compaction).
"""

from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch
from conftest import ARCH_SETTINGS, PROMPT  # plain data, shared with the fixtures
from tiny_models import tiny_backbone

from medusa_core import MedusaModel, build_tree_buffers, resolve_tree

N_NEW = 40
TREES = ["mc_sim_7b_63", "chain_4", "dense_3x2x2"]


def reply(records) -> list[int]:
    return [t for r in records for t in r.token_ids]


def tokens_per_step(records) -> float:
    """Tokens per decoding step: records[0] is the prefill and its first token."""
    return sum(len(r.token_ids) for r in records[1:]) / len(records[1:])


# ------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("heads", ["oracle", "random"])
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("arch", list(ARCH_SETTINGS))
def test_greedy_medusa_output_equals_plain_greedy_decoding(
    arch, tree, heads, backbone_for, reference_for, oracle_model, random_model
):
    backbone = backbone_for(arch)
    model = oracle_model(backbone, N_NEW) if heads == "oracle" else random_model(backbone)
    records = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree=tree))
    assert reply(records) == reference_for(arch, N_NEW)
    depth = build_tree_buffers(resolve_tree(tree)[1]).depth
    if heads == "oracle":  # almost every step accepts the full depth: D + 1 tokens
        assert tokens_per_step(records) > 0.75 * (depth + 1)
    else:  # random heads are almost never right
        assert tokens_per_step(records) < 1.5


def test_heads_restricted_to_a_draft_vocabulary_propose_only_its_ids_and_greedy_stays_plain_greedy(
    backbone_for, reference_for
):
    from medusa_core import MedusaHeads

    backbone = backbone_for("llama")
    vocab = backbone.get_output_embeddings().out_features
    heads = MedusaHeads.from_backbone(backbone, 4)  # fresh heads predict what the LM head predicts
    heads.restrict_drafts(vocab // 2)
    model = MedusaModel(backbone, heads)
    records = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree="mc_sim_7b_63"))
    assert reply(records) == reference_for("llama", N_NEW)
    assert all(t < vocab // 2 for r in records[1:] for t in r.node_token_ids[1:])
    hidden = torch.randn(3, backbone.config.hidden_size)
    draft, whole = heads.draft_logits(hidden, 2), heads(hidden, 2)  # [2, 3, S], [2, 3, V]
    assert torch.equal(draft, whole[..., : vocab // 2])  # the same scores for the ids it keeps
    assert heads.draft_vocabulary == vocab // 2
    with pytest.raises(ValueError, match="draft vocabulary"):
        heads.restrict_drafts(vocab + 1)
    ranking = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    heads.restrict_drafts(vocab // 3, ranking)  # FR-Spec: the most frequent ids, in any order
    assert torch.equal(heads.draft_ids, ranking[: vocab // 3])
    assert torch.equal(heads.draft_logits(hidden, 2), whole[..., ranking[: vocab // 3]])
    with pytest.raises(ValueError, match="distinct token ids"):
        heads.restrict_drafts(4, torch.tensor([1, 1, 2, 3]))


def test_oracle_heads_accept_the_whole_chain_at_every_step_and_random_heads_almost_nothing(
    backbone_for, oracle_model, random_model
):
    backbone = backbone_for("llama")
    oracle = list(oracle_model(backbone, N_NEW).generate(PROMPT, max_new_tokens=N_NEW, tree="chain_4"))
    # The prefill emits the first token; each step then 4 candidates + the next root; the last is cut.
    assert [r.accept_length for r in oracle] == [0] + [4] * (N_NEW // 5)
    assert [len(r.token_ids) for r in oracle] == [1] + [5] * (N_NEW // 5 - 1) + [4]
    rand = list(random_model(backbone).generate(PROMPT, max_new_tokens=N_NEW, tree="chain_4"))
    assert tokens_per_step(rand) < 1.2


def test_a_short_path_beside_a_deeper_branch_never_accepts_its_padding(backbone_for, reference_for, oracle_model):
    # Rows of retrieve_indices: [0, 2, 3, 4] (the wrong branch [1] ...) and [0, 1, -1, -1] (the right
    # [0], padded). Counting padding as accepted would read node -1 and emit a wrong token.
    tree = [[0], [1], [1, 0], [1, 0, 0]]
    assert build_tree_buffers(tree).retrieve_indices.tolist() == [[0, 2, 3, 4], [0, 1, -1, -1]]
    model = oracle_model(backbone_for("gemma"), N_NEW)
    records = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree=tree))
    assert reply(records) == reference_for("gemma", N_NEW)
    assert records[0].tree_name == "prefill" and records[1].tree_name == "custom_4"
    assert all(r.accepted_nodes == (0, 1) for r in records if r.tree_nodes > 1)


def test_heads_run_once_per_step_at_the_last_accepted_position_and_only_for_the_trees_depth(
    backbone_for, oracle_model
):
    model = oracle_model(backbone_for("qwen2"), N_NEW)
    records = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree="dense_3x2x2"))
    tree_steps = sum(1 for r in records if r.tree_nodes > 1)
    assert tree_steps >= len(records) - 1
    hidden = backbone_for("qwen2").config.hidden_size
    assert model.heads.calls == [((1, hidden), 3)] * tree_steps


# ----------------------------------------------------------------------------------- step records
@pytest.mark.parametrize("heads", ["oracle", "random"])
def test_step_records_describe_the_tree_the_accepted_path_and_the_running_total(
    heads, backbone_for, reference_for, oracle_model, random_model
):
    backbone = backbone_for("llama")
    model = oracle_model(backbone, N_NEW) if heads == "oracle" else random_model(backbone)
    records = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree="mc_sim_7b_63"))
    choices = build_tree_buffers(resolve_tree("mc_sim_7b_63")[1]).choices
    assert reply(records) == reference_for("llama", N_NEW)
    total = 0
    for i, r in enumerate(records):
        assert r.step == i and r.mode == "medusa"
        assert (r.tree_name == "prefill") == (i == 0) and (r.tree_nodes == 1 or i > 0)
        if r.tree_nodes > 1:
            assert r.tree_name == "mc_sim_7b_63" and r.tree_nodes == 64
            assert r.node_heads == (-1,) + tuple(len(c) - 1 for c in choices)
            assert r.node_ranks == (0,) + tuple(c[-1] for c in choices)
        for nodes in (r.node_token_ids, r.node_parents, r.node_heads, r.node_ranks):
            assert len(nodes) == r.tree_nodes
        assert r.accepted_nodes[0] == 0 and r.node_parents[0] == -1
        for parent, child in zip(r.accepted_nodes, r.accepted_nodes[1:]):
            assert r.node_parents[child] == parent
        assert r.accept_length == len(r.accepted_nodes) - 1
        # The accepted candidates, then the next step's root (cut at the limit on the last step).
        emitted = [r.node_token_ids[n] for n in r.accepted_nodes[1:]]
        if i + 1 < len(records):
            emitted.append(records[i + 1].node_token_ids[0])
        assert list(r.token_ids[: len(emitted)]) == emitted[: len(r.token_ids)]
        total += len(r.token_ids)
        assert r.total_tokens == total
        assert r.latency_s > 0
        assert (r.stop_reason is None) == (i < len(records) - 1)
    assert records[-1].stop_reason == "max_new_tokens"
    assert records[0].prefill_s == records[0].latency_s > 0 and all(r.prefill_s == 0 for r in records[1:])
    assert records[0].token_ids == (reference_for("llama", N_NEW)[0],)  # the first token right after the prefill
    if heads == "oracle":  # the oracle is always right: the top-1 chain [0], [0,0], ... to depth 4
        top1 = (0,) + tuple(choices.index((0,) * d) + 1 for d in range(1, 5))
        assert all(r.accepted_nodes == top1 for r in records[1:])


def test_baseline_mode_decodes_one_token_per_step_and_equals_plain_greedy(
    backbone_for, reference_for, oracle_model
):
    model = oracle_model(backbone_for("phi3"), N_NEW)  # heads that would be right are not used
    records = list(model.generate(PROMPT, max_new_tokens=N_NEW, medusa=False))
    assert len(records) == N_NEW
    assert all(len(r.token_ids) == 1 and r.mode == "baseline" and r.tree_nodes == 1 for r in records)
    assert all(r.accepted_nodes == (0,) and r.accept_length == 0 for r in records)
    assert reply(records) == reference_for("phi3", N_NEW)
    assert model.heads.calls == []


# --------------------------------------------------------------------------------------- stopping
@pytest.mark.parametrize("several_ids", [False, True], ids=["one_eos_id", "list_of_eos_ids"])
def test_decoding_stops_right_after_an_eos_token_like_hf_generate(
    several_ids, backbone_for, reference_for, oracle_heads, greedy, monkeypatch
):
    backbone = backbone_for("llama")
    ref = reference_for("llama", N_NEW)
    heads = oracle_heads(backbone, N_NEW)  # built before EOS is set: it knows the continuation past it
    # The first token after position 5 that has not occurred before; oracle steps bring 5 tokens
    # (positions 0-4, 5-9, ...), so an EOS off a step boundary also drops accepted tokens after it.
    cut = next(i for i in range(6, N_NEW) if ref[i] not in ref[:i] and i % 5 != 4)
    eos = [ref[cut], 95] if several_ids else ref[cut]  # 95 never occurs before the cut
    assert 95 not in ref[: cut + 1]
    monkeypatch.setattr(backbone.generation_config, "eos_token_id", eos)
    records = list(MedusaModel(backbone, heads).generate(PROMPT, max_new_tokens=N_NEW, tree="chain_4"))
    assert reply(records) == ref[: cut + 1]
    assert reply(records) == greedy(backbone, PROMPT, N_NEW)  # HF generate stops there too
    assert records[-1].stop_reason == "eos"
    assert records[-1].accept_length + 1 > len(records[-1].token_ids)  # tokens past EOS were dropped


@pytest.mark.parametrize("limit", [1, 2, 8, 14])
def test_max_new_tokens_counts_tokens_even_when_a_step_accepts_past_the_limit(
    limit, backbone_for, reference_for, oracle_model
):
    model = oracle_model(backbone_for("mistral"), N_NEW)
    records = list(model.generate(PROMPT, max_new_tokens=limit, tree="chain_4"))
    assert reply(records) == reference_for("mistral", N_NEW)[:limit]
    assert records[-1].stop_reason == "max_new_tokens" and records[-1].total_tokens == limit
    if limit in (7, 13):  # after the prefill's token, the last step accepted the whole chain (5 tokens) but only 2 / 3 fit
        assert records[-1].accept_length == 4 and len(records[-1].token_ids) == (limit - 1) % 5


@pytest.mark.parametrize("tree", ["chain_4", "sparse_16"])  # 17 nodes: too many beside the prompt from step 0
def test_decoding_stops_before_the_context_window_overflows(tree, oracle_model, greedy):
    context = 24
    backbone = tiny_backbone("llama", **ARCH_SETTINGS["llama"], max_position_embeddings=context)
    model = oracle_model(backbone, context)
    assert model.max_context == context
    records = list(model.generate(PROMPT, max_new_tokens=100, tree=tree))
    assert records[-1].stop_reason == "context"
    assert all(r.stop_reason is None for r in records[:-1])
    out = reply(records)
    # The cache is filled exactly, never past it; the last token emitted is never fed back.
    assert len(out) == context - PROMPT.shape[1] + 1
    assert out == greedy(backbone, PROMPT, len(out))


def test_a_prompt_one_token_short_of_the_window_still_gets_two_tokens(backbone_for, random_model, greedy):
    backbone = backbone_for("llama")
    model = random_model(backbone)
    prompt = torch.arange(model.max_context - 1)[None] % 90  # [1, 255]
    records = list(model.generate(prompt, max_new_tokens=10, tree="chain_4"))
    # The prefill's token, then a root-only step (a 5-node chain does not fit) that fills the window.
    assert [r.stop_reason for r in records] == [None, "context"] and records[1].tree_nodes == 1
    assert reply(records) == greedy(backbone, prompt, 2)


def test_stopping_the_iteration_early_releases_the_kv_cache(backbone_for, random_model, monkeypatch):
    model = random_model(backbone_for("llama"))
    caches = []
    new_cache = MedusaModel._new_cache

    def spy(self):
        cache = new_cache(self)
        caches.append(weakref.ref(cache))
        return cache

    monkeypatch.setattr(MedusaModel, "_new_cache", spy)
    steps = model.generate(PROMPT, max_new_tokens=N_NEW, tree="chain_4")
    first = next(steps)
    assert first.stop_reason is None
    gc.collect()
    assert len(caches) == 1 and caches[0]() is not None  # alive while the caller iterates
    steps.close()
    gc.collect()
    assert caches[0]() is None


# ------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty"),
        (dict(input_ids=torch.ones(1, 256, dtype=torch.long)), "256 tokens"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
        (dict(max_new_tokens=float("nan")), "max_new_tokens must be an integer >= 1, got nan"),
        (dict(temperature=-0.1), "temperature must be a finite number >= 0 (0 = greedy), got -0.1"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0 (0 = greedy), got nan"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0 (0 = greedy), got inf"),
        (dict(posterior_threshold=0.0), "posterior_threshold (ε) must be in (0, 1], got 0.0: typical acceptance"),
        (dict(posterior_threshold=1.5), "posterior_threshold (ε) must be in (0, 1], got 1.5"),
        (dict(posterior_alpha=0), "posterior_alpha (δ) must be in (0, 1], got 0: typical acceptance"),
        (dict(posterior_alpha=float("nan")), "posterior_alpha (δ) must be in (0, 1], got nan"),
        (dict(seed=2**63), f"seed must be an integer in [0, 2**63) or None (a fresh seed), got {2**63}"),
        (dict(seed=-1), "seed must be an integer in [0, 2**63) or None (a fresh seed), got -1"),
        (dict(seed=1.5), "seed must be an integer in [0, 2**63) or None (a fresh seed), got 1.5"),
        (dict(sampling="rejection"), "sampling must be one of 'typical', 'exact', got 'rejection'"),
        (dict(input_ids=PROMPT.repeat(2, 1)), "[1, T]"),
        (dict(tree="no_such_tree"), "no_such_tree"),
        (dict(tree=[[0], [1, 1]]), "path [1, 1] has no parent [1]"),
        (dict(tree=[[0], [96]]), "path [96]: rank 96 is not below the vocabulary size 96"),
        (dict(tree="dense_16x16"), "tree 'dense_16x16' has 273 nodes (root included) but the model's context window is 256"),
    ],
    ids=[
        "empty_prompt",
        "prompt_fills_context",
        "zero_new_tokens",
        "fractional_new_tokens",
        "nan_new_tokens",
        "negative_temperature",
        "nan_temperature",
        "infinite_temperature",
        "zero_epsilon",
        "epsilon_above_one",
        "zero_delta",
        "nan_delta",
        "seed_too_large",
        "negative_seed",
        "fractional_seed",
        "unknown_sampling",
        "batch_of_two",
        "unknown_tree",
        "invalid_tree",
        "rank_outside_vocabulary",
        "tree_larger_than_context",
    ],
)
def test_bad_input_raises_value_error_before_any_work(kwargs, message, backbone_for, random_model, monkeypatch):
    model = random_model(backbone_for("llama"))
    monkeypatch.setattr(MedusaModel, "_new_cache", lambda self: pytest.fail("a cache was created"))
    args = dict(input_ids=PROMPT, max_new_tokens=8, tree="chain_4") | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        model.generate(args.pop("input_ids"), **args)  # raises on the call, not on first iteration


def test_a_tree_deeper_than_the_heads_raises_naming_the_path_and_depth(backbone_for, random_model):
    model = random_model(backbone_for("llama"), num_heads=2)
    with pytest.raises(ValueError, match=re.escape("path [0, 0, 0, 0] has depth 4")) as err:
        model.generate(PROMPT, max_new_tokens=8, tree="chain_4")
    assert "2 Medusa heads" in str(err.value)
    assert list(model.generate(PROMPT, max_new_tokens=4, tree="chain_2"))  # a tree that fits runs


# --------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("medusa", [True, False], ids=["medusa", "baseline"])
def test_sampling_with_the_same_seed_repeats_and_different_seeds_differ(
    medusa, backbone_for, reference_for, random_model
):
    model = random_model(backbone_for("llama"))

    def sample(seed):
        steps = model.generate(PROMPT, max_new_tokens=24, tree="chain_4", temperature=0.7, medusa=medusa, seed=seed)
        return reply(steps)

    first = sample(1)
    assert len(first) == 24
    assert sample(1) == first
    assert sample(2) != first
    assert first != reference_for("llama", N_NEW)[:24]  # the root really is sampled


@pytest.mark.parametrize("medusa", [True, False], ids=["medusa", "baseline"])
def test_every_root_is_sampled_not_only_the_first(medusa, backbone_for, random_model):
    # The tiny Llama's next-token distribution is nearly flat, so a sampled root rarely is the
    # argmax; a loop that samples only its first token would pick it at every later root.
    backbone = backbone_for("llama")
    model = random_model(backbone)
    # The strictest ε and δ let few candidates pass, so most tokens are roots.
    kwargs = dict(temperature=0.7, medusa=medusa, seed=5, posterior_threshold=1.0, posterior_alpha=1.0)
    records = list(model.generate(PROMPT, max_new_tokens=24, tree="chain_4", **kwargs))
    out = reply(records)
    roots = [r.total_tokens - len(r.token_ids) for r in records]  # each step's root: its first token in out
    with torch.inference_mode():
        argmax = backbone(torch.cat([PROMPT, torch.tensor([out])], dim=1)).logits[0].argmax(-1)  # [T + 24]
    greedy_picks = sum(int(out[i] == argmax[PROMPT.shape[1] - 1 + i]) for i in roots)
    assert len(out) == 24 and len(roots) >= 12
    assert greedy_picks < len(roots) // 2


def test_typical_acceptance_in_the_engine_follows_the_thresholds(backbone_for, random_model):
    # Random heads, sampled roots. Tiny ε and δ accept every candidate (p(x) > 1e-9): the chain's
    # full depth every step. ε = δ = 1, the strictest allowed, accept only candidates more likely
    # than exp(-entropy): far fewer.
    model = random_model(backbone_for("llama"))
    kwargs = dict(max_new_tokens=20, tree="chain_4", temperature=0.7, seed=3)
    everything = list(model.generate(PROMPT, posterior_threshold=1e-9, posterior_alpha=1e-9, **kwargs))
    assert [r.accept_length for r in everything] == [0] + [4] * 4
    strict = list(model.generate(PROMPT, posterior_threshold=1.0, posterior_alpha=1.0, **kwargs))
    assert sum(r.accept_length for r in strict) < len(strict) < 20
    assert reply(strict) != reply(everything)
    assert len(reply(strict)) == 20 and strict[-1].stop_reason == "max_new_tokens"
