"""N-gram drafts in the tree (issue 20): the prompt lookup, the grafted step tree, and the engine with drafts.

Part 1 checks ``NgramDrafter`` on hand-written contexts: a match, no match, the longest and latest
match preferred, a copy that overlaps its own suffix, and a chain cut at a limit. Part 2 checks
``steptree.graft`` on a hand-drawn tree. Part 3 is the key property: greedy decoding with n-gram drafts
(alone or beside the heads) equals plain greedy decoding on every tiny architecture, with heads that
are always right or always wrong, drafts that are always right (a reply that repeats the prompt)
or always wrong, a repetition penalty, and a context window that the chain would run past.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ARCH_SETTINGS, PROMPT  # plain data, shared with the fixtures
from tiny_models import random_heads, tiny_backbone

from medusa_core import DRAFT_SOURCES, DraftConfig, MedusaModel, NgramDrafter
from medusa_core.steptree import confident_nodes, graft, prune, static_tree

N_NEW = 40


def reply(records) -> list[int]:
    return [t for r in records for t in r.token_ids]


# ------------------------------------------------------------------------------------- the lookup
def test_the_tokens_after_the_latest_earlier_occurrence_of_the_suffix_are_proposed():
    drafter = NgramDrafter(DraftConfig(max_ngram=3, min_ngram=1, max_tokens=3), [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2])
    # suffix [1, 2] (no [6, 1, 2] earlier) occurs at 1 and 6: the latest, at 6, is followed by 3, 4, 5
    assert drafter.propose(10) == [3, 4, 5]


def test_no_match_proposes_nothing():
    assert NgramDrafter(DraftConfig(), [1, 2, 3, 4]).propose(10) == []
    assert NgramDrafter(DraftConfig(), []).propose(10) == []
    assert NgramDrafter(DraftConfig(min_ngram=2), [5, 6, 7, 5]).propose(10) == []  # [5] alone is too short


def test_a_longer_suffix_match_wins_over_a_later_shorter_one():
    # [8, 1] occurs at 0 (followed by 2); [1] alone occurs later at 4 (followed by 3)
    drafter = NgramDrafter(DraftConfig(max_ngram=2, max_tokens=1), [8, 1, 2, 0, 1, 3, 8, 1])
    assert drafter.propose(5) == [2]


def test_a_copy_that_overlaps_the_suffix_continues_the_repeating_pattern():
    # [a b a b]: the suffix [a b] last occurred at 0; the copy reads 2, 3 and then its own tokens
    drafter = NgramDrafter(DraftConfig(max_ngram=2, max_tokens=7), [4, 5, 4, 5])
    assert drafter.propose(7) == [4, 5, 4, 5, 4, 5, 4]
    assert NgramDrafter(DraftConfig(max_ngram=3, max_tokens=4), [9, 9, 9]).propose(4) == [9, 9, 9, 9]


def test_the_chain_is_cut_at_the_limit_and_at_max_tokens():
    drafter = NgramDrafter(DraftConfig(max_tokens=4), [1, 2, 3, 4, 5, 6, 7, 1])
    assert drafter.propose(2) == [2, 3]  # e.g. the room left in the context window
    assert drafter.propose(100) == [2, 3, 4, 5]
    assert drafter.propose(0) == [] and drafter.propose(-3) == []


def test_extending_the_context_indexes_new_tokens_like_building_it_at_once():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    always = DraftConfig(min_path_probability=0.0)  # every proposal as long as the copy allows
    grown = NgramDrafter(always)
    for i, t in enumerate(tokens):
        grown.extend([t])
        assert grown.propose(10) == NgramDrafter(always, tokens[: i + 1]).propose(10)


def test_chain_positions_that_were_rarely_right_in_this_reply_are_no_longer_proposed():
    drafter = NgramDrafter(DraftConfig(max_ngram=1, max_tokens=4, min_path_probability=0.3), [1, 2, 3, 4, 5, 1])
    assert drafter.propose(4) == [2, 3, 4, 5]  # the prior: 1 right in 2 at every position
    drafter.extend([2, 3, 9])  # two copied tokens right, then the reply went elsewhere
    assert drafter.path_probability(1, 1) == 2 / 3 and drafter.path_probability(1, 2) == 1 / 3
    drafter.extend([1])  # the suffix [1] again, latest at 5: copy 2, 3, 9, 1 (1 in 3 is still >= 0.3)
    assert drafter.propose(4) == [2, 3, 9, 1]
    drafter.extend([2, 7])  # one right
    assert drafter.path_probability(1, 1) == 2 / 4 and drafter.path_probability(1, 2) == 1 / 4
    drafter.extend([1])  # the suffix [1], latest at 10: the copy 2, 7, ... stops where 1 in 4 < 0.3
    assert drafter.propose(4) == [2, 7]


def test_earlier_replies_are_searched_when_the_context_has_no_match_and_their_copy_ends_with_them():
    config = DraftConfig(max_ngram=2, max_tokens=5, min_path_probability=0.0)
    earlier = [[4, 5, 6, 7], [8, 1, 2, 9]]
    drafter = NgramDrafter(config, [3, 8, 1], earlier=earlier)
    assert drafter.propose(10) == [2, 9]  # [8, 1] is in reply 1 only; the copy stops at its end
    in_context = NgramDrafter(config, [8, 1, 5, 8, 1], earlier=earlier)
    assert in_context.propose(10) == [5, 8, 1, 5, 8]  # the context's own match wins
    assert NgramDrafter(config, [3, 0], earlier=earlier).propose(10) == []


@pytest.mark.parametrize("kwargs", [dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(max_tokens=0),
                                    dict(min_path_probability=1.5), dict(min_head_probability=-0.1)])
def test_draft_sizes_out_of_range_are_refused(kwargs):
    with pytest.raises(ValueError, match="ngram|max_tokens|probability"):
        DraftConfig(**kwargs)


# ------------------------------------------------------------------------------ the grafted tree
TREE = [[0], [1], [0, 0]]  # nodes: 0 root, 1 = [0], 2 = [1], 3 = [0, 0]


def test_a_chain_follows_the_nodes_that_hold_its_tokens_and_hangs_the_rest_below_them():
    tree = static_tree("t", TREE, torch.float32, torch.device("cpu"))
    tokens = [10, 11, 12, 13]
    grafted, ids = graft(tree, tokens, [11, 13, 20, 21])  # shares [0] and [0, 0], adds two nodes
    assert ids == [10, 11, 12, 13, 20, 21]
    assert grafted.node_parents == (-1, 0, 0, 1, 3, 4)
    assert grafted.node_sources == ("root", "head", "head", "head", "ngram", "ngram")
    assert grafted.position_ids.tolist() == [0, 1, 1, 2, 3, 4]
    sees = (grafted.bias == 0).int().tolist()
    assert sees[4] == [1, 1, 0, 1, 1, 0] and sees[5] == [1, 1, 0, 1, 1, 1]
    assert sees[3][4:] == [0, 0]  # old nodes never see the new ones
    assert [0, 1, 3, 4, 5] in grafted.retrieve_indices.tolist()
    assert grafted.depth == 4 and grafted.head_depth == 2


def test_a_chain_whose_first_token_no_head_proposed_becomes_a_new_child_of_the_root():
    tree = static_tree("t", TREE, torch.float32, torch.device("cpu"))
    grafted, ids = graft(tree, [10, 11, 12, 13], [30, 31])
    assert grafted.node_parents == (-1, 0, 0, 1, 0, 4) and ids[4:] == [30, 31]
    assert grafted.children[0] == (1, 2, 4)  # tried after the heads' candidates
    assert sorted(map(tuple, grafted.retrieve_indices.tolist()))[-1][:3] == (0, 4, 5)


def test_a_chain_already_in_the_tree_leaves_the_tree_unchanged():
    tree = static_tree("t", TREE, torch.float32, torch.device("cpu"))
    assert graft(tree, [10, 11, 12, 13], [11, 13]) == (tree, [10, 11, 12, 13])


def test_the_decoding_loop_builds_each_grafted_tree_once_as_graft_builds_it(backbone_for, random_model):
    steps = random_model(backbone_for("llama"))._steps
    tree = static_tree("t", TREE, torch.float32, torch.device("cpu"))
    tokens = [10, 11, 12, 13]
    first, ids = steps.grafted(tree, tokens, [11, 13, 20, 21])
    again, other_ids = steps.grafted(tree, tokens, [11, 13, 40, 41])  # the same graft point and length
    assert again is first and ids[4:] == [20, 21] and other_ids[4:] == [40, 41]
    expected, expected_ids = graft(tree, tokens, [11, 13, 20, 21])
    assert ids == expected_ids and first.node_parents == expected.node_parents and first.node_sources == expected.node_sources
    for name in ("bias", "position_ids", "retrieve_indices", "path_nodes", "path_valid", "parents"):
        assert torch.equal(getattr(first, name), getattr(expected, name)), name
    assert steps.grafted(tree, tokens, [30, 31])[0].node_parents == (-1, 0, 0, 1, 0, 4)  # another point: another tree
    assert steps.grafted(tree, tokens, [11, 13]) == (tree, tokens)


def test_a_pruned_tree_keeps_the_chosen_nodes_in_order_with_their_ancestry_and_paths():
    tree = static_tree("t", [[0], [1], [0, 0], [0, 1], [1, 0]], torch.float32, torch.device("cpu"))
    # nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0]; keep the root, [0], [1], [0, 1]
    pruned = prune(tree, [0, 1, 2, 4])
    assert pruned.node_parents == (-1, 0, 0, 1) and pruned.node_ranks == (0, 0, 1, 1)
    assert pruned.position_ids.tolist() == [0, 1, 1, 2] and pruned.depth == 2
    assert (pruned.bias == 0).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert sorted(map(tuple, pruned.retrieve_indices.tolist())) == [(0, 1, 3), (0, 2, -1)]
    assert prune(tree, list(range(6))) is tree
    assert prune(tree, [0]).num_nodes == 1


def test_confident_nodes_are_those_whose_path_probability_reaches_the_threshold():
    tree = static_tree("t", [[0], [1], [0, 0], [0, 1], [1, 0]], torch.float32, torch.device("cpu"))
    p = torch.tensor([1.0, 0.8, 0.1, 0.5, 0.3, 0.9])  # each node's own probability under its head
    # paths: [0] 0.8, [1] 0.1, [0,0] 0.4, [0,1] 0.24, [1,0] 0.09
    assert confident_nodes(tree, p.log(), 0.25) == [0, 1, 3]
    assert confident_nodes(tree, p.log(), 0.08) == [0, 1, 2, 3, 4, 5]
    assert confident_nodes(tree, p.log(), 0.95) == [0]


# ---------------------------------------------------------------------------- the engine with drafts
@pytest.mark.parametrize("drafts", ["hybrid", "ngram"])
@pytest.mark.parametrize("heads", ["oracle", "random"])
@pytest.mark.parametrize("arch", list(ARCH_SETTINGS))
def test_greedy_decoding_with_ngram_drafts_equals_plain_greedy_decoding(
    arch, heads, drafts, backbone_for, reference_for, oracle_model, random_model
):
    backbone = backbone_for(arch)
    model = oracle_model(backbone, N_NEW) if heads == "oracle" else random_model(backbone)
    records = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree="sparse_16", drafts=drafts))
    assert reply(records) == reference_for(arch, N_NEW)
    for r in records[1:]:
        assert r.drafts == drafts and len(r.node_sources) == r.tree_nodes
        assert r.head_tokens + r.ngram_tokens == r.draft_tokens
        if drafts == "ngram":
            assert set(r.node_sources) <= {"root", "ngram"} and r.tree_name in ("ngram", "baseline")


class ScriptedDrafter:
    """A stand-in for ``NgramDrafter`` that knows the greedy reply: it proposes its next tokens
    (``right``) or the same tokens shifted by one id (always wrong)."""

    def __init__(self, full: list[int], right: bool, vocab: int):
        self.full, self.right, self.vocab = full, right, vocab
        self.tokens: list[int] = []

    def __call__(self, config, tokens, earlier):  # called as NgramDrafter(config, prompt ids, earlier replies)
        self.config, self.tokens = config, list(tokens)
        return self

    def extend(self, tokens):
        self.tokens += list(tokens)

    def propose(self, limit):
        chain = self.full[len(self.tokens) : len(self.tokens) + min(limit, 6)]
        self.verify_alone = 0 < self.config.chain_only_from <= len(chain)
        return chain if self.right else [(t + 1) % self.vocab for t in chain]


@pytest.mark.parametrize("drafts", ["hybrid", "ngram"])
def test_drafts_that_are_always_right_are_accepted_whole_and_always_wrong_ones_never(
    drafts, backbone_for, reference_for, random_model, monkeypatch
):
    backbone = backbone_for("mistral")
    model = random_model(backbone)
    expected = reference_for("mistral", N_NEW)
    full = PROMPT[0].tolist() + expected
    for right in (True, False):
        monkeypatch.setattr("medusa_core.model.NgramDrafter", ScriptedDrafter(full, right, model.vocab_size))
        records = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree="chain_2", drafts=drafts))
        assert reply(records) == expected
        copied = sum(r.ngram_tokens for r in records)
        if right:  # 6 copied tokens + the next root per step; the last steps are cut at the limit
            assert copied >= N_NEW - 2 * len(records) and len(records) <= N_NEW // 6 + 3
        else:
            assert copied == 0 and all("ngram" in r.node_sources for r in records[1:-1])


@pytest.mark.parametrize("right", [True, False])
def test_a_long_chain_is_verified_alone_when_chain_only_from_says_so_and_the_reply_stays_exact(
    right, backbone_for, reference_for, random_model, monkeypatch
):
    backbone = backbone_for("llama")
    model = random_model(backbone)
    expected = reference_for("llama", N_NEW)
    drafter = ScriptedDrafter(PROMPT[0].tolist() + expected, right, model.vocab_size)  # chains of 6 tokens
    monkeypatch.setattr("medusa_core.model.NgramDrafter", drafter)
    for chain_only_from, alone in ((6, True), (7, False)):
        config = DraftConfig(chain_only_from=chain_only_from)
        records = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree="sparse_16", drafts="hybrid", draft_config=config))
        assert reply(records) == expected
        if alone:  # steps with a whole chain: the root and the chain, no heads' node
            chain_steps = [r for r in records[1:] if r.tree_name == "ngram"]
            assert chain_steps and all(set(r.node_sources) == {"root", "ngram"} and r.tree_nodes == 7 for r in chain_steps)
            # the heads' tree only where the token limit cut the chain below 6 tokens
            assert all(r.total_tokens - len(r.token_ids) > N_NEW - 7 for r in records[1:] if r.tree_name == "sparse_16")
        else:
            assert all(r.tree_name == "sparse_16" for r in records[1:] if r.tree_nodes > 1)
    with pytest.raises(ValueError, match="chain_only_from must be >= 0"):
        DraftConfig(chain_only_from=-1)


@pytest.mark.parametrize("fields, message", [
    (dict(chain_depth=0), "chain_depth must be an integer >= 1 \\(drafts a step\\), got 0"),
    (dict(chain_depth=2.5), "chain_depth must be an integer >= 1 \\(drafts a step\\), got 2.5"),
    (dict(chain_threshold=1.2), "chain_threshold must be in \\[0, 1\\], got 1.2"),
])
def test_a_drafter_chain_setting_out_of_range_is_refused_naming_it(fields, message):
    with pytest.raises(ValueError, match=message):
        DraftConfig(**fields)


def test_greedy_with_a_repetition_penalty_and_drafts_equals_hf_generate(backbone_for, random_model):
    backbone = backbone_for("qwen2")
    model = random_model(backbone)
    with torch.inference_mode():
        out = backbone.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=N_NEW,
                                repetition_penalty=1.3)
    expected = out[0, PROMPT.shape[1]:].tolist()
    for drafts in ("hybrid", "ngram"):
        records = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree="sparse_16", repetition_penalty=1.3, drafts=drafts))
        assert reply(records) == expected


def test_a_chain_that_would_run_past_the_context_window_is_cut_and_the_reply_stays_exact(greedy):
    backbone = tiny_backbone("llama", seed=3, max_position_embeddings=40)
    model = MedusaModel(backbone, random_heads(backbone))
    prompt = torch.tensor([[5, 17, 42, 8] * 7])  # 28 tokens that repeat: the lookup always finds a long chain
    records = list(model.generate(prompt, max_new_tokens=30, drafts="hybrid", tree="chain_2"))
    cached = prompt.shape[1]
    for r in records[1:]:
        assert cached + r.tree_nodes <= model.max_context  # every step's tree fitted the window
        cached += len(r.token_ids)
    assert records[-1].stop_reason == "context"
    expected = greedy(backbone, prompt, len(reply(records)))
    assert reply(records) == expected


@pytest.mark.parametrize("heads", ["oracle", "random"])
@pytest.mark.parametrize("arch", ["llama", "gemma", "phi3"])
def test_trees_shaped_by_the_heads_confidence_keep_greedy_output_and_drop_unlikely_nodes(
    arch, heads, backbone_for, reference_for, oracle_model, random_model
):
    backbone = backbone_for(arch)
    model = oracle_model(backbone, N_NEW) if heads == "oracle" else random_model(backbone)
    shaped = DraftConfig(min_head_probability=0.05)
    full = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree="sparse_16", drafts="heads"))
    for drafts in ("heads", "hybrid"):
        records = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree="sparse_16", drafts=drafts, draft_config=shaped))
        assert reply(records) == reference_for(arch, N_NEW)
        heads_nodes = [sum(s == "head" for s in r.node_sources) for r in records[1:]]
        assert max(heads_nodes) <= 16 and sum(heads_nodes) < sum(r.tree_nodes - 1 for r in full[1:])


def test_an_earlier_reply_to_the_same_prompt_is_copied_and_the_new_reply_stays_exact(backbone_for, reference_for, random_model):
    model = random_model(backbone_for("qwen2"))
    expected = reference_for("qwen2", N_NEW)
    alone = list(model.generate(PROMPT, max_new_tokens=N_NEW, drafts="ngram"))
    again = list(model.generate(PROMPT, max_new_tokens=N_NEW, drafts="ngram", earlier_replies=[[1, 2, 3], expected]))
    assert reply(alone) == reply(again) == expected
    assert sum(r.ngram_tokens for r in again) > sum(r.ngram_tokens for r in alone) and len(again) < len(alone)


def test_an_unknown_draft_source_is_refused_before_any_work(random_model, backbone_for):
    model = random_model(backbone_for("llama"))
    with pytest.raises(ValueError, match="drafts must be one of 'hybrid', 'heads', 'ngram', 'corpus', 'eagle'"):
        model.generate(PROMPT, max_new_tokens=4, drafts="lookup")
    assert DRAFT_SOURCES == ("hybrid", "heads", "ngram", "corpus", "eagle")


# ------------------------------------------------------------ calibrated shaping (issue 20, part 2)
def test_head_temperatures_scale_each_heads_log_probabilities_and_keep_its_ranks(backbone_for):
    backbone = backbone_for("llama")
    temperatures = (0.5, 2.0, 3.0, 1.5)
    heads = random_heads(backbone)
    plain, scaled = MedusaModel(backbone, heads), MedusaModel(backbone, heads, head_temperatures=temperatures)
    tree = plain._tree("sparse_16")
    hidden = 0.1 * torch.randn(1, backbone.config.hidden_size, generator=torch.Generator().manual_seed(0))  # [1, H]
    with torch.no_grad():
        tokens, log_p = scaled._steps.candidates(tree, hidden, torch.tensor(3), with_log_p=True)
        plain_tokens, plain_log_p = plain._steps.candidates(tree, hidden, torch.tensor(3), with_log_p=True)
        logits = heads(hidden, num_heads=tree.head_depth)[:, 0].float()  # [D, V]
    assert torch.equal(tokens, plain_tokens)  # temperature never changes a head's ranking
    for node in range(1, tree.num_nodes):
        k = tree.node_heads[node]
        assert log_p[node].item() == pytest.approx((logits[k] / temperatures[k]).log_softmax(-1)[tokens[node]].item(), abs=1e-5)
        assert plain_log_p[node].item() == pytest.approx(logits[k].log_softmax(-1)[tokens[node]].item(), abs=1e-5)
    assert (log_p - plain_log_p)[1:].abs().min() > 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_with_calibrated_shaping_equals_plain_greedy(arch, backbone_for, reference_for, oracle_heads):
    backbone = backbone_for(arch)
    model = MedusaModel(backbone, oracle_heads(backbone, N_NEW), head_temperatures=(0.7, 1.8, 2.5, 4.0), min_head_probability=0.3)
    for drafts in ("heads", "hybrid"):
        records = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree="sparse_16", drafts=drafts))
        assert reply(records) == reference_for(arch, N_NEW)


def test_the_models_tuned_threshold_shapes_the_tree_unless_the_caller_sets_one(backbone_for, random_model):
    backbone = backbone_for("llama")
    heads = random_heads(backbone)
    flat = (50.0,) * 4  # hot enough that no node of random heads is 10 % sure
    tuned = MedusaModel(backbone, heads, head_temperatures=flat, min_head_probability=0.1)
    untuned = MedusaModel(backbone, heads, head_temperatures=flat)
    assert tuned.min_head_probability == 0.1 and untuned.min_head_probability == 0.0

    def head_nodes(model, **kwargs):
        return [sum(s == "head" for s in r.node_sources) for r in model.generate(PROMPT, max_new_tokens=12, tree="sparse_16", **kwargs)]

    assert max(head_nodes(tuned)) == 0  # the default: the model's tuned threshold
    assert max(head_nodes(tuned, draft_config=DraftConfig(max_tokens=4))) == 0  # a config that leaves it unset
    assert max(head_nodes(tuned, draft_config=DraftConfig(min_head_probability=0.0))) == 16  # 0: shaping off
    assert max(head_nodes(untuned)) == 16


@pytest.mark.parametrize("kwargs, message", [
    (dict(head_temperatures=(1.0, 2.0)), r"head_temperatures must hold one temperature per head \(4\), got 2: \(1.0, 2.0\)"),
    (dict(head_temperatures=(1.0, 0.0, 1.0, 1.0)), r"head_temperatures must be finite and > 0, got 0.0 for head 1"),
    (dict(head_temperatures=(1.0, 1.0, float("nan"), 1.0)), r"head_temperatures must be finite and > 0, got nan for head 2"),
    (dict(min_head_probability=1.5), r"min_head_probability must be in \[0, 1\], got 1.5"),
])
def test_wrong_temperatures_or_threshold_are_refused_naming_the_value(kwargs, message, backbone_for):
    backbone = backbone_for("llama")
    with pytest.raises(ValueError, match=message):
        MedusaModel(backbone, random_heads(backbone), **kwargs)
