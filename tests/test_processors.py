"""Sampling settings inside the tree: ``SamplingConfig`` and ``NodeProcessors`` (HF ``generate`` semantics).

The key guarantee: greedy Medusa with a repetition penalty equals HF ``generate(do_sample=False,
repetition_penalty=...)`` token for token on every architecture, with heads that propose the penalised
reply (so deep paths are accepted) and with random heads; a variant that penalises only the context
and not the node's ancestors in the tree breaks it, so the test has teeth. Typical and exact
verification judge candidates by the processed distribution: with top-k 1 both must equal greedy.
The chi-square proof that exact sampling with processors follows plain sampling is in sampling/test_sampling_statistics.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ARCH_SETTINGS, PROMPT, OracleHeads  # plain data and a fake, shared with the fixtures
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import medusa_core.decoding
from medusa_core import CHAT_PRESET, MedusaModel, SamplingConfig, draw
from medusa_core.acceptance import score_children
from medusa_core.processors import NodeProcessors, top_slice, tree_prefixes
from medusa_core.steptree import ancestor_index

PENALTY = 1.3


def reply(records) -> list[int]:
    return [t for r in records for t in r.token_ids]


def hf_greedy(backbone, max_new_tokens: int, penalty: float) -> list[int]:
    """HF ``generate(do_sample=False, repetition_penalty=penalty)`` of ``PROMPT``: new tokens only."""
    with torch.inference_mode():
        out = backbone.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False,
                                max_new_tokens=max_new_tokens, repetition_penalty=penalty)
    return out[0, PROMPT.shape[1]:].tolist()


def penalised_oracle(backbone, max_new_tokens: int) -> MedusaModel:
    """A model whose heads know HF's penalised greedy reply and rank its true continuation first."""
    sequence = torch.cat([PROMPT, torch.tensor([hf_greedy(backbone, max_new_tokens + 6, PENALTY)])], dim=1)
    return MedusaModel(backbone, OracleHeads(backbone, sequence))


# ------------------------------------------------------------------------------------ the settings
@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_k=2.5), "top_k must be an integer >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(min_p=-0.5), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=True), "repetition_penalty must be a finite number > 0"),
])
def test_a_setting_out_of_range_raises_naming_it_its_value_and_the_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_generate_checks_the_settings_before_any_work(backbone_for, random_model):
    model = random_model(backbone_for("llama"))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\] \(1 = off\), got 2"):
        model.generate(PROMPT, max_new_tokens=4, temperature=0.5, top_p=2)


def test_the_generation_config_gives_hf_generates_defaults_and_none_when_it_sets_nothing():
    assert SamplingConfig.from_generation_config(GenerationConfig(eos_token_id=2)) is None
    assert SamplingConfig.from_generation_config(GenerationConfig(repetition_penalty=1.2)) == SamplingConfig(
        repetition_penalty=1.2)
    # do_sample: unset values are generate's own defaults (temperature 1, top-k 50).
    assert SamplingConfig.from_generation_config(GenerationConfig(do_sample=True, top_p=0.8)) == SamplingConfig(
        temperature=1.0, top_k=50, top_p=0.8)


def test_generate_defaults_to_the_models_generation_config_and_chats_to_the_preset(backbone_for, random_model, monkeypatch):
    backbone = backbone_for("llama")
    model = random_model(backbone)
    assert model.sampling_defaults == SamplingConfig() and model.chat_defaults == CHAT_PRESET
    monkeypatch.setattr(backbone, "generation_config", GenerationConfig(do_sample=True, temperature=0.6, top_k=20))
    assert model.sampling_defaults == model.chat_defaults == SamplingConfig(temperature=0.6, top_k=20)
    assert list(model.generate(PROMPT, max_new_tokens=2, seed=0))[0].sampling == "typical"


def test_a_tree_nodes_prefix_is_the_context_plus_the_node_and_its_ancestors():
    # root 0 -> 1, 2; node 1 -> 3; node 3 -> 4. Shallow rows repeat the root's token.
    tokens, parents = torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, 0, 0, 1, 3])
    prefixes = tree_prefixes(torch.tensor([7, 8]), tokens, ancestor_index(parents, 3))
    assert prefixes.tolist() == [
        [7, 8, 10, 10, 10, 10], [7, 8, 11, 10, 10, 10], [7, 8, 12, 10, 10, 10], [7, 8, 13, 11, 10, 10],
        [7, 8, 14, 13, 11, 10],
    ]
    assert tree_prefixes(torch.tensor([7, 8]), tokens[:1], ancestor_index(parents[:1], 0)).tolist() == [[7, 8, 10]]  # root alone


def test_node_processors_apply_hfs_classes_in_generates_order():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    prefix = torch.tensor([[1, 2], [3, 3], [4, 5]])
    config = SamplingConfig(temperature=0.7, top_p=0.8, repetition_penalty=1.4)
    expected = RepetitionPenaltyLogitsProcessor(1.4)(prefix, logits)
    expected = TopPLogitsWarper(0.8)(prefix, TemperatureLogitsWarper(0.7)(prefix, expected))
    assert torch.equal(NodeProcessors(config)(logits, prefix), expected)
    # Greedy applies only the penalty; with nothing on, the logits pass through untouched.
    greedy = NodeProcessors(SamplingConfig(top_p=0.5, repetition_penalty=1.4))(logits, prefix)
    assert torch.equal(greedy, RepetitionPenaltyLogitsProcessor(1.4)(prefix, logits))
    assert NodeProcessors(SamplingConfig(top_k=3))(logits, None) is logits


def hf_processors(config: SamplingConfig) -> LogitsProcessorList:
    """transformers' processors for ``config`` in ``generate``'s order (``_get_logits_processor``, 5.x)."""
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(config.repetition_penalty)])
    if not config.greedy:
        processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            processors.append(TopKLogitsWarper(config.top_k))
        if config.top_p < 1:
            processors.append(TopPLogitsWarper(config.top_p))
        if config.min_p:
            processors.append(MinPLogitsWarper(config.min_p))
    return processors


SLICE_CASES = [  # (settings, logit scale): which path each takes with 32 candidates of 5,000 tokens
    (CHAT_PRESET, 3.0),  # peaked rows: the nucleus lies in the slice
    (CHAT_PRESET, 0.05),  # flat rows: the slice holds less than top_p, HF's full sort decides
    (SamplingConfig(temperature=0.7, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=1.3), 1.0),  # k > slice
    (SamplingConfig(temperature=1.0, top_k=8, repetition_penalty=0.8), 1.0),
    (SamplingConfig(temperature=0.5, min_p=0.2), 3.0),  # min-p alone, decided in the slice
    (SamplingConfig(temperature=1.5, min_p=0.01), 0.3),  # min-p alone, passes past the slice: fallback
    (SamplingConfig(temperature=1.2, top_p=0.5, min_p=0.3), 2.0),  # fallback
    (SamplingConfig(temperature=0.3, top_p=0.95, min_p=0.01), 3.0),  # top-p then min-p in the slice
    (SamplingConfig(temperature=0.9), 1.0),  # temperature alone: no filter
]


@pytest.mark.parametrize("config, scale", SLICE_CASES)
def test_node_processors_equal_hfs_processors_in_generates_order_on_the_slice_and_in_the_fallback(config, scale, sampling_path):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 5000, generator=gen) * scale
    prefix = torch.randint(5000, (16, 40), generator=gen)  # [M, L] each row's own prefix, repeats included
    expected = hf_processors(config)(prefix, logits.clone())
    processed = NodeProcessors(config, candidates=32)(logits, prefix)
    assert torch.equal(processed, expected) and processed.is_contiguous()  # HF's penalty returns a strided view: slow rows
    assert torch.isfinite(expected).sum() > 16  # the filters kept more than one token somewhere


@pytest.mark.parametrize("vocab", [5000, 4999, 200])  # a whole number of blocks, a ragged last block, fewer tokens than c blocks
def test_the_top_slice_holds_topks_values_at_distinct_indices_ties_included(vocab):
    gen = torch.Generator().manual_seed(2)
    for scores in (torch.randn(5, vocab, generator=gen), torch.randint(0, 6, (5, vocab), generator=gen).float()):  # many ties
        top, index = top_slice(scores, 32)
        assert torch.equal(top, scores.topk(32).values) and torch.equal(scores.gather(1, index), top)
        assert all(len(set(row)) == 32 for row in index.tolist())


def test_the_compiled_penalty_and_temperature_are_the_bits_of_the_aten_ops():
    from medusa_core.lean.build import load_extension

    module, why = load_extension()
    if module is None:
        pytest.skip(f"no compiled kernels on this machine: {why}")
    torch.manual_seed(0)
    logits = torch.randn(5, 1000) * 8
    logits[:, :50] = -logits[:, :50].abs()  # negative logits: multiplied by the penalty
    # repeated ids, ids past the width (they change nothing) and the last column, which HF's clamp writes back to
    ids = torch.cat([torch.randint(0, 1000, (5, 300)), torch.tensor([[999, 1000, 5000, 3, 3]] * 5)], dim=1)
    for penalty in (1.1, 1.3, 0.8):
        for config in (SamplingConfig(repetition_penalty=penalty), SamplingConfig(temperature=0.2, repetition_penalty=penalty),
                       SamplingConfig(temperature=1.7, repetition_penalty=penalty)):
            processors = NodeProcessors(config)
            expected = processors._penalise(logits, ids)
            if not config.greedy:
                expected = expected.div_(float(config.temperature))
            got = module.penalise_rows(logits, ids, penalty, 0.0 if config.greedy else float(config.temperature))
            assert torch.equal(got, expected), (penalty, config)
    with pytest.raises(RuntimeError, match="a row per logits row"):
        module.penalise_rows(logits, ids[:2], 1.1, 0.2)


def test_the_slice_decides_where_it_holds_the_kept_tokens_and_hfs_sort_where_it_may_not(monkeypatch, sampling_path):
    sorts = []
    monkeypatch.setattr(TopPLogitsWarper, "__call__", lambda self, ids, scores: sorts.append(1) or scores)
    peaked, flat = torch.randn(4, 5000) * 3.0, torch.randn(4, 5000) * 0.05
    NodeProcessors(CHAT_PRESET, candidates=32)(peaked, torch.zeros(4, 1, dtype=torch.long))
    assert sorts == []
    NodeProcessors(CHAT_PRESET, candidates=32)(flat, torch.zeros(4, 1, dtype=torch.long))
    assert sorts == [1]


def test_ids_past_the_lm_heads_width_are_not_penalised_as_in_hf():
    logits = torch.tensor([[0.5, -1.0, 2.0, 3.0, -0.5, 1.0, 1.5, -2.0, 0.3, 4.0]] * 2)
    prefix = torch.tensor([[3, 12, 12, 9], [0, 10, 1, 1]])  # ids past the width, with and without the last column's 9
    for penalty in (2.0, 0.5):
        config = SamplingConfig(repetition_penalty=penalty)
        processed = NodeProcessors(config)(logits, prefix)
        assert torch.equal(processed, hf_processors(config)(prefix, logits.clone()))
        assert processed[0, 9] == 4.0 / penalty and processed[1, 9] == 4.0 and processed[0, 8] == 0.3


def test_typical_acceptance_never_takes_a_token_the_filters_removed():
    # Row 0 after top-p: token 0 kept, tokens 1.. removed (-inf). Even with ε = δ = 1e-9 they fail.
    scores = torch.tensor([[0.0] + [float("-inf")] * 3])
    accepted, log_p = score_children(scores, torch.tensor([0, 0]), torch.tensor([0, 2]), 1.0, 1e-9, 1e-9)
    assert accepted.tolist() == [True, False] and log_p[0] == 0 and log_p[1] == float("-inf")


# ---------------------------------------------------------------------------- greedy equals HF's
@pytest.mark.parametrize("arch", list(ARCH_SETTINGS))
def test_greedy_medusa_with_a_repetition_penalty_equals_hf_generate(arch, backbone_for, random_model):
    backbone = backbone_for(arch)
    expected = hf_greedy(backbone, 40, PENALTY)
    assert expected != hf_greedy(backbone, 40, 1.0), "the penalty must change the reply, or the test proves nothing"
    oracle = penalised_oracle(backbone, 40)
    records = list(oracle.generate(PROMPT, max_new_tokens=40, tree="mc_sim_7b_63", repetition_penalty=PENALTY))
    assert reply(records) == expected
    assert sum(r.accept_length for r in records) >= 20  # deep paths accepted: the ancestors' penalty mattered
    for model, medusa in ((random_model(backbone), True), (oracle, False)):
        out = model.generate(PROMPT, max_new_tokens=40, tree="sparse_16", repetition_penalty=PENALTY, medusa=medusa)
        assert reply(out) == expected


def test_penalising_the_context_without_the_nodes_ancestors_breaks_the_equality(backbone_for, monkeypatch):
    backbone = backbone_for("qwen2")
    expected = hf_greedy(backbone, 40, PENALTY)
    oracle = penalised_oracle(backbone, 40)
    context_only = lambda context, tokens, ancestors: context.view(1, -1).expand(tokens.shape[0], -1)  # noqa: E731
    monkeypatch.setattr(medusa_core.decoding, "tree_prefixes", context_only)
    assert reply(oracle.generate(PROMPT, max_new_tokens=40, tree="mc_sim_7b_63", repetition_penalty=PENALTY)) != expected


@pytest.mark.parametrize("sampling", ["typical", "exact"])
def test_with_top_k_1_typical_and_exact_sampling_equal_penalised_greedy(sampling, backbone_for, random_model):
    # Top-k 1 leaves one token of mass 1: the processed distribution is the penalised argmax, so both
    # modes must reproduce greedy even with ε = δ = 1e-6 (which on unprocessed p accepts nearly anything).
    backbone = backbone_for("llama")
    expected = hf_greedy(backbone, 40, PENALTY)
    for model in (penalised_oracle(backbone, 40), random_model(backbone)):
        out = model.generate(PROMPT, max_new_tokens=40, tree="sparse_16", temperature=0.9, top_k=1, repetition_penalty=PENALTY,
                             sampling=sampling, posterior_threshold=1e-6, posterior_alpha=1e-6, seed=3)
        assert reply(out) == expected


def test_plain_sampling_with_processors_draws_from_hfs_processed_distribution(backbone_for, random_model):
    # medusa=False: token i = draw(softmax(processed logits_i)) with one seeded generator, the
    # processors being HF's in generate's order, the penalty over the prompt and the reply so far.
    backbone = backbone_for("mistral")
    generator = torch.Generator().manual_seed(5)
    expected, seq = [], PROMPT
    with torch.inference_mode():
        for _ in range(16):
            scores = RepetitionPenaltyLogitsProcessor(1.2)(seq, backbone(seq).logits[:, -1].float())
            scores = TopPLogitsWarper(0.9)(seq, TemperatureLogitsWarper(0.8)(seq, scores))
            expected.append(int(draw(torch.softmax(scores[0], -1), generator)))
            seq = torch.cat([seq, torch.tensor([[expected[-1]]])], dim=1)
    config = SamplingConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.2)
    records = list(random_model(backbone).generate(PROMPT, max_new_tokens=16, config=config, medusa=False, seed=5))
    assert reply(records) == expected
