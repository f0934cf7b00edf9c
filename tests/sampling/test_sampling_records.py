"""Exact sampling in the engine's records: a seed repeats a reply, each node's status, the bonus token, temperature 0 as
greedy, plain sampling's seeded draws."""

from __future__ import annotations


import pytest
import torch
from conftest import PROMPT  # plain data, shared with the fixtures

from medusa_core import NODE_STATUSES, SAMPLING_RULES, draw, node_status


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
