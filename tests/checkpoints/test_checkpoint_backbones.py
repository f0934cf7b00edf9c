"""What loads beside the heads: an NF4 backbone on a CPU decoding as its own greedy ``generate``, bfloat16 heads, the
calibration's temperatures and the tuned entries per preset and machine class, the draft ranking."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import PROMPT  # plain data, shared with the fixtures
from tiny_models import VOCAB, random_heads, tiny_backbone

from medusa_core import (CHAT_PRESET, MedusaCheckpointError, MedusaModel, SamplingConfig, TunedSettings,
                         load_medusa_model, save_medusa_heads)
from medusa_core.heads import DRAFT_RANKING_FILE
from medusa_core.quant.layers import LM_HEAD_REFINE

from .support import HEADS, generated, load


def test_an_nf4_backbone_loads_on_cpu_and_decodes_exactly_like_its_own_greedy_generate(
    base, tmp_path, greedy, oracle_heads
):
    import bitsandbytes as bnb

    folder, backbone = base
    save_medusa_heads(random_heads(backbone, HEADS), tmp_path, base_model_name_or_path=str(folder))
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = load_medusa_model(tmp_path, quantization="nf4", device="cpu")
    assert model.quantization == "nf4"
    # The NF4 weights stay 4-bit: bitsandbytes' own layers (its fused kernel on CPUs with AVX512-BF16),
    # the logits of transformers' NF4 model where the LM head refines them (each row's top logits, in float32:
    # the rest come from its 4-bit first pass) up to the row-wise attention (medusa_core.invariant).
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.backbone.modules())
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    bnb_model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.float32).eval()
    with torch.inference_mode():
        ours, theirs = model.backbone(PROMPT).logits, bnb_model(PROMPT).logits  # [1, T, V]
        top = ours.topk(LM_HEAD_REFINE, dim=-1).indices
        torch.testing.assert_close(ours.gather(-1, top), theirs.gather(-1, top), rtol=0.02, atol=0.02)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert all(p.dtype in (torch.float32, torch.bfloat16) for p in model.heads.parameters())  # never quantized
    n = 24
    reference = greedy(model.backbone, PROMPT, n)
    assert reference != greedy(backbone, PROMPT, n)  # 4 bits really changed the model
    out = generated(model, PROMPT, max_new_tokens=n, tree="sparse_16")
    assert out == reference
    oracle = MedusaModel(model.backbone, oracle_heads(model.backbone, n))  # deep acceptance on 4 bits
    records = list(oracle.generate(PROMPT, max_new_tokens=n, tree="chain_4"))
    assert [t for r in records for t in r.token_ids] == reference
    assert n / len(records) > 3


def test_heads_default_to_bfloat16_on_cpus_with_native_bf16_and_output_stays_greedy(tmp_path):
    backbone = tiny_backbone("llama", seed=3)
    heads = random_heads(backbone, 3)
    backbone.save_pretrained(tmp_path / "base")
    save_medusa_heads(heads, tmp_path / "heads", base_model_name_or_path=str(tmp_path / "base"))
    model = load_medusa_model(tmp_path / "heads", quantization=None, device="cpu")
    expected = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    assert next(model.heads.parameters()).dtype == expected
    assert model.dtype == torch.float32
    ids = torch.tensor([[5, 9, 17, 3, 44]])
    want = backbone.generate(ids, max_new_tokens=24, do_sample=False)[0, 5:].tolist()
    got = generated(model, ids, max_new_tokens=24, tree="chain_3")
    assert got == want


def test_head_temperatures_and_the_tuned_threshold_are_read_from_the_calibration_and_tuned_files(base, tmp_path):
    folder, backbone = base
    save_medusa_heads(random_heads(backbone, HEADS), tmp_path, base_model_name_or_path=str(folder))
    assert load(tmp_path).head_temperatures == (1.0,) * HEADS and load(tmp_path).min_head_probability == 0.0
    calibration = {"head_temperatures": [1.5, 2.0, 2.5, 3.0]}
    save_medusa_heads(random_heads(backbone, HEADS), tmp_path, base_model_name_or_path=str(folder), calibration=calibration)
    tuned = {"cpu/none": {"choices": [[0], [1]], "min_head_probability": 0.25}, "cpu/nf4": {"choices": [[0]], "min_head_probability": 0.5}}
    (tmp_path / "medusa_tuned.json").write_text(json.dumps(tuned))
    model = load(tmp_path)
    assert model.head_temperatures == (1.5, 2.0, 2.5, 3.0)
    assert model.min_head_probability == 0.25  # this device and precision's entry


def test_tuned_entries_per_settings_give_each_preset_its_tree_and_tau_and_an_old_file_serves_both(base, tmp_path):
    folder, backbone = base
    save_medusa_heads(random_heads(backbone, HEADS), tmp_path, base_model_name_or_path=str(folder))
    # A file from before entries were per settings: one entry, measured greedy, serves both presets.
    old = {"cpu/none": {"choices": [[0], [1]], "min_head_probability": 0.25, "measured_speedup": 0.9}}
    (tmp_path / "medusa_tuned.json").write_text(json.dumps(old))
    model = load(tmp_path)
    greedy, chat = model.tuned_for(SamplingConfig()), model.tuned_for(CHAT_PRESET)
    assert (greedy.tree, greedy.min_head_probability, greedy.measured_at) == ("tuned", 0.25, "greedy")
    assert (chat.tree, chat.measured_at) == ("tuned", "greedy")
    assert greedy.slower_than_plain("heads") and not chat.slower_than_plain("heads")  # a greedy figure says nothing of chat
    assert not greedy.slower_than_plain("eagle")  # the entry measured no drafter's chain
    # Entries per settings: the chat preset gets its own tree, τ and verdict; generate takes them by default.
    tuned = {"cpu/none@greedy": {"choices": [[0], [1]], "min_head_probability": 0.1, "measured_speedup": 1.2},
             "cpu/none@chat": {"choices": [[0]], "min_head_probability": 0.3, "measured_speedup": 0.92, "device_name": "a CPU"},
             "cpu/none": {"choices": [[0], [0, 0]]}}
    (tmp_path / "medusa_tuned.json").write_text(json.dumps(tuned))
    model = load(tmp_path)
    assert model.default_tree == "tuned" and model.trees == {"tuned": [[0], [1]], "tuned_chat": [[0]]}
    chat = model.tuned_for(SamplingConfig(temperature=0.7, top_k=5))  # any sampled settings: the chat preset's entry
    assert chat == TunedSettings("chat", "tuned_chat", 0.3, "chat", 0.92, "a CPU") and chat.slower_than_plain("corpus")
    assert model.min_head_probability == 0.1 and not model.tuned_for(SamplingConfig()).slower_than_plain("corpus")
    ids = torch.tensor([[5, 9, 17, 3, 44]])
    assert {r.tree_name for r in model.generate(ids, max_new_tokens=6, config=CHAT_PRESET, seed=0)} <= {"prefill", "baseline", "tuned_chat"}
    assert {r.tree_name for r in model.generate(ids, max_new_tokens=6)} <= {"prefill", "baseline", "tuned"}
    chat_tuned = model.generate(ids, max_new_tokens=6, tree="tuned", config=CHAT_PRESET, seed=0)  # "tuned": of these settings
    assert {r.tree_name for r in chat_tuned} <= {"prefill", "baseline", "tuned_chat"}


def test_a_cpu_whose_4bit_product_runs_on_amx_tiles_reads_its_own_tuned_entries_and_else_the_cpus(monkeypatch):
    from medusa_core.quant.layers import Int4Linear
    from medusa_core.tuned import machine_class, tuned_entries

    tuned = {"cpu/gguf@greedy": {"choices": [[0]]}, "cpu/gguf@chat": {"choices": [[0]]},
             "cpu+amx/gguf@greedy": {"choices": [[0], [1], [0, 0]]}, "cpu/none@greedy": {"choices": [[0]]}}
    cpu = torch.device("cpu")
    monkeypatch.setattr(Int4Linear, "kernel_name", "avx512-bf16")
    assert machine_class(cpu, "gguf") == "cpu" and {p: k for p, (k, _, _) in tuned_entries(tuned, cpu, "gguf").items()} == {
        "greedy": "cpu/gguf@greedy", "chat": "cpu/gguf@chat"}
    monkeypatch.setattr(Int4Linear, "kernel_name", "amx")
    assert machine_class(cpu, "gguf") == "cpu+amx" and {p: k for p, (k, _, _) in tuned_entries(tuned, cpu, "gguf").items()} == {
        "greedy": "cpu+amx/gguf@greedy", "chat": "cpu/gguf@chat"}  # no AMX entry at chat: the CPU's
    # a float backbone has no 4-bit layer: its trees are the CPU's whatever the product
    assert machine_class(cpu, None) == "cpu" and machine_class(torch.device("meta"), "gguf") == "meta"
    assert {p: k for p, (k, _, _) in tuned_entries(tuned, cpu, None).items()} == {"greedy": "cpu/none@greedy"}


def test_head_temperatures_of_the_wrong_length_raise_a_checkpoint_error_naming_the_file_and_the_value(base, tmp_path):
    folder, backbone = base
    calibration = {"head_temperatures": [1.5, 2.0]}
    save_medusa_heads(random_heads(backbone, HEADS), tmp_path, base_model_name_or_path=str(folder), calibration=calibration)
    with pytest.raises(MedusaCheckpointError, match=re.escape(f"{tmp_path / 'medusa_calibration.json'}: head_temperatures must hold "
                                                              "one temperature per head (4), got 2: (1.5, 2.0)")):
        load(tmp_path)
    (tmp_path / "medusa_tuned.json").write_text(json.dumps({"cpu/none": {"choices": [[0]], "min_head_probability": -1}}))
    (tmp_path / "medusa_calibration.json").write_text("{}")
    with pytest.raises(MedusaCheckpointError, match=re.escape(f"{tmp_path / 'medusa_tuned.json'} ['cpu/none']: min_head_probability must be in [0, 1], got -1")):
        load(tmp_path)


def test_a_draft_ranking_beside_the_heads_makes_them_draft_its_first_ids_and_greedy_stays_plain_greedy(base, tmp_path):
    folder, backbone = base
    save_medusa_heads(random_heads(backbone, HEADS), tmp_path, base_model_name_or_path=str(folder))
    ranking = list(range(VOCAB - 1, -1, -3))  # every third id, from the top: not 0..S−1
    (tmp_path / DRAFT_RANKING_FILE).write_text(json.dumps({"ranked_ids": ranking}))
    model = load(tmp_path, draft_vocabulary=12)
    assert model.heads.draft_ids.tolist() == ranking[:12]
    ids = torch.tensor([[5, 9, 17, 3, 44]])
    want = backbone.generate(ids, max_new_tokens=24, do_sample=False)[0, 5:].tolist()
    records = list(model.generate(ids, max_new_tokens=24, tree="mc_sim_7b_63"))
    assert [t for r in records for t in r.token_ids] == want
    assert {t for r in records[1:] for t in r.node_token_ids[1:]} <= set(ranking[:12])  # the heads propose ranked ids only


@pytest.mark.parametrize("ranked", [[1, 2, VOCAB], [3, 3, 4], "1,2,3", []], ids=["out-of-range", "repeated", "not-a-list", "empty"])
def test_a_bad_draft_ranking_raises_a_checkpoint_error_naming_the_file(ranked, base, tmp_path):
    folder, backbone = base
    save_medusa_heads(random_heads(backbone, HEADS), tmp_path, base_model_name_or_path=str(folder))
    (tmp_path / DRAFT_RANKING_FILE).write_text(json.dumps({"ranked_ids": ranked}))
    with pytest.raises(MedusaCheckpointError, match=re.escape(DRAFT_RANKING_FILE)):
        load(tmp_path, draft_vocabulary=12)
