"""Checkpoint loading and saving: the three reference layouts, clear errors, the vLLM export and a
4-bit NF4 backbone on CPU (see MEDUSA_FACTS.md, "Checkpoint layouts to load").

Every checkpoint is written to disk by the test itself from a tiny random Llama.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import ARCH_SETTINGS, PROMPT  # plain data, shared with the fixtures
from safetensors.torch import load_file, save_file
from tiny_models import HIDDEN, VOCAB, random_heads, tiny_backbone, tiny_tokenizer

from medusa_core import (
    CHAT_PRESET,
    MedusaCheckpointError,
    MedusaHeads,
    MedusaModel,
    SamplingConfig,
    TunedSettings,
    export_vllm,
    load_medusa_model,
    save_medusa_heads,
)
from medusa_core.heads import DRAFT_RANKING_FILE
from medusa_core.quant.layers import LM_HEAD_REFINE

HEADS = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny Llama saved with its tokenizer: (folder, the backbone object)."""
    folder = tmp_path_factory.mktemp("base")
    backbone = tiny_backbone("llama", **ARCH_SETTINGS["llama"])
    backbone.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder, backbone


def fp16_exact(heads: MedusaHeads) -> MedusaHeads:
    """Round ``heads`` to values fp16 holds exactly, so a round trip through fp16 files is lossless."""
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(p.half().float())
    return heads


def assert_same_heads(loaded: torch.nn.Module, original: torch.nn.Module) -> None:
    got, want = loaded.state_dict(), original.state_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key].float(), want[key].float()), key


def load(folder: Path, **kwargs) -> MedusaModel:
    return load_medusa_model(folder, quantization=None, device="cpu", head_dtype=torch.float32, **kwargs)


# ----------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("file", ["medusa_lm_head.safetensors", "medusa_lm_head.pt"])
def test_head_only_checkpoint_round_trips_through_either_head_file(file, base, tmp_path):
    folder, backbone = base
    heads = fp16_exact(random_heads(backbone, HEADS))
    save_medusa_heads(heads, tmp_path, base_model_name_or_path=str(folder))
    if file.endswith(".pt"):
        torch.save(heads.state_dict(), tmp_path / file)
        (tmp_path / "medusa_lm_head.safetensors").unlink()
    assert sorted(p.name for p in tmp_path.glob("medusa_lm_head.*")) == [file]
    model = load(tmp_path)
    assert model.num_heads == HEADS and not model.heads.shares_lm_head
    assert_same_heads(model.heads, heads)


def test_head_only_checkpoint_with_two_blocks_per_head_keeps_their_weights_independent(base, tmp_path):
    folder, backbone = base
    heads = MedusaHeads(HIDDEN, VOCAB, 3, num_layers=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    fp16_exact(heads)
    save_medusa_heads(heads, tmp_path, base_model_name_or_path=str(folder))
    model = load(tmp_path)
    assert model.num_heads == 3 and model.heads.num_layers == 2
    assert_same_heads(model.heads, heads)
    assert not torch.equal(model.heads[0][0].linear.weight, model.heads[0][1].linear.weight)


def test_config_head_count_is_ignored_in_favour_of_the_tensors(base, tmp_path):
    folder, backbone = base
    heads = fp16_exact(random_heads(backbone, HEADS))
    save_medusa_heads(heads, tmp_path, base_model_name_or_path=str(folder))
    config = json.loads((tmp_path / "config.json").read_text())
    config["medusa_num_heads"] = 2  # what the published Vicuna configs do
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load(tmp_path)
    assert model.num_heads == HEADS
    assert_same_heads(model.heads, heads)


def test_version_2_checkpoint_loads_residual_blocks_that_share_the_backbone_lm_head(base, tmp_path):
    folder, backbone = base
    heads = MedusaHeads(HIDDEN, VOCAB, HEADS, shared_lm_head=backbone.get_output_embeddings())
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(std=0.1)
    fp16_exact(heads)
    save_medusa_heads(heads, tmp_path, base_model_name_or_path=str(folder))
    assert json.loads((tmp_path / "config.json").read_text())["version"] == "2"
    assert all(".linear." in k for k in load_file(tmp_path / "medusa_lm_head.safetensors"))
    model = load(tmp_path)
    assert model.heads.shares_lm_head and model.num_heads == HEADS
    assert_same_heads(model.heads, heads)
    hidden = torch.randn(3, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(model.heads(hidden), heads(hidden))  # [K, 3, V]
    # In bfloat16 the heads read a bfloat16 copy of the LM head; the backbone's stays float32.
    bf16 = load_medusa_model(tmp_path, quantization=None, device="cpu", head_dtype="bfloat16")
    lm_head = bf16.backbone.get_output_embeddings()
    assert bf16.heads._shared_lm_head[0] is not lm_head and lm_head.weight.dtype == torch.float32
    assert bf16.heads._shared_lm_head[0].weight.dtype == next(bf16.heads.parameters()).dtype == torch.bfloat16
    assert bf16.heads.state_dict().keys() == model.heads.state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(bf16.heads(hidden.bfloat16()).float(), heads(hidden), atol=0.05, rtol=0.05)
    plain = [t for r in model.generate(PROMPT, max_new_tokens=16, medusa=False) for t in r.token_ids]
    assert [t for r in bf16.generate(PROMPT, max_new_tokens=16, tree="sparse_16") for t in r.token_ids] == plain


def test_root_conditioned_heads_load_as_their_own_layout_and_decode_exactly(base, tmp_path):
    folder, backbone = base
    heads = MedusaHeads(HIDDEN, VOCAB, HEADS, shared_lm_head=backbone.get_output_embeddings(),
                        root_embedding=backbone.get_input_embeddings())
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(std=0.1)
    fp16_exact(heads)
    save_medusa_heads(heads, tmp_path, base_model_name_or_path=str(folder))
    assert json.loads((tmp_path / "config.json").read_text())["medusa_root_conditioned"] is True
    assert load_file(tmp_path / "medusa_lm_head.safetensors")["root_weight"].shape == (HEADS, HIDDEN, HIDDEN)
    model = load(tmp_path)
    assert model.heads.root_conditioned and model.heads.shares_lm_head and model.num_heads == HEADS
    assert_same_heads(model.heads, heads)
    hidden, root = torch.randn(3, HIDDEN), torch.tensor([5, 6, 7])
    with torch.no_grad():
        torch.testing.assert_close(model.heads(hidden, root=root), heads(hidden, root=root))  # [K, 3, V]
        assert not torch.allclose(model.heads(hidden, root=root), model.heads(hidden, root=root.flip(0)))  # the root counts
    with pytest.raises(ValueError, match="need root="):
        model.heads(hidden)
    with pytest.raises(ValueError, match="vLLM"):
        export_vllm(model.heads, tmp_path / "vllm")
    plain = [t for r in model.generate(PROMPT, max_new_tokens=16, medusa=False) for t in r.token_ids]
    assert [t for r in model.generate(PROMPT, max_new_tokens=16, tree="sparse_16") for t in r.token_ids] == plain


def test_a_root_conditioned_head_file_for_another_backbone_names_the_root_tensor_and_both_shapes(base, tmp_path):
    folder, backbone = base
    heads = MedusaHeads(HIDDEN, VOCAB, HEADS, shared_lm_head=backbone.get_output_embeddings(),
                        root_embedding=backbone.get_input_embeddings())
    save_medusa_heads(heads, tmp_path, base_model_name_or_path=str(folder))
    state = load_file(tmp_path / "medusa_lm_head.safetensors")
    state["root_weight"] = torch.zeros(HEADS, HIDDEN, 2 * HIDDEN, dtype=torch.float16)
    save_file(state, tmp_path / "medusa_lm_head.safetensors")
    with pytest.raises(MedusaCheckpointError, match=re.escape(f"'root_weight' has shape [{HEADS}, {HIDDEN}, {2 * HIDDEN}], "
                                                              f"expected [{HEADS}, {HIDDEN}, {HIDDEN}]")):
        load(tmp_path)


def test_medusa_2_full_checkpoint_loads_heads_from_the_model_weights(base, tmp_path):
    _, backbone = base
    heads = random_heads(backbone, HEADS)
    backbone.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights.update({f"medusa_head.{k}": v.clone() for k, v in heads.state_dict().items()})
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(medusa_num_heads=HEADS, medusa_num_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load(tmp_path)
    assert model.num_heads == HEADS
    assert_same_heads(model.heads, heads)  # float32 in the shard: identical without rounding
    assert_same_heads(model.backbone, backbone)


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "hidden, vocab, key, found, expected",
    [
        (32, VOCAB, "0.0.linear.weight", [32, 32], [HIDDEN, HIDDEN]),
        (HIDDEN, 50, "0.1.weight", [50, HIDDEN], [VOCAB, HIDDEN]),
    ],
    ids=["wrong_hidden_size", "wrong_vocabulary"],
)
def test_heads_for_another_backbone_raise_naming_the_key_and_both_shapes(
    hidden, vocab, key, found, expected, base, tmp_path
):
    folder, _ = base
    save_medusa_heads(MedusaHeads(hidden, vocab, HEADS), tmp_path, base_model_name_or_path=str(folder))
    with pytest.raises(MedusaCheckpointError) as err:
        load(tmp_path)
    message = str(err.value)
    assert "medusa_lm_head.safetensors" in message
    assert repr(key) in message and str(found) in message and str(expected) in message
    assert message.index(str(found)) < message.index(str(expected))  # "has shape found, expected ..."


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda state: state.update({"0.5.weight": torch.zeros(VOCAB, HIDDEN)}), "unexpected tensors ['0.5.weight']"),
        (lambda state: state.update({"lm_head.weight": torch.zeros(VOCAB, HIDDEN)}), "unexpected key 'lm_head.weight'"),
        (lambda state: state.pop("2.0.linear.bias"), "missing tensor '2.0.linear.bias' of shape [64]"),
    ],
    ids=["extra_tensor", "foreign_key", "missing_tensor"],
)
def test_a_head_file_with_extra_or_missing_tensors_is_rejected_not_loaded_loosely(change, message, base, tmp_path):
    folder, backbone = base
    save_medusa_heads(random_heads(backbone, HEADS), tmp_path, base_model_name_or_path=str(folder))
    state = load_file(tmp_path / "medusa_lm_head.safetensors")
    change(state)
    save_file(state, tmp_path / "medusa_lm_head.safetensors")
    with pytest.raises(MedusaCheckpointError, match=re.escape(message)):
        load(tmp_path)


def test_a_folder_without_heads_raises_a_clear_error(base, tmp_path):
    folder, _ = base
    (tmp_path / "config.json").write_text(json.dumps({"base_model_name_or_path": str(folder)}))
    with pytest.raises(MedusaCheckpointError, match=r"no Medusa heads in .*medusa_lm_head\.safetensors"):
        load(tmp_path)
    with pytest.raises(MedusaCheckpointError, match=r"no Medusa heads in .*medusa_head\.\* tensors"):
        load(folder)  # a plain model folder: weights but no medusa_head.* keys


def test_a_missing_folder_raises_a_clear_error(tmp_path):
    missing = tmp_path / "no" / "such" / "folder"
    with pytest.raises(MedusaCheckpointError, match=re.escape(f"{missing}: no such folder")):
        load(missing)
    with pytest.raises(MedusaCheckpointError, match="has no config.json"):
        load(tmp_path)  # exists, but is empty


def test_a_hub_id_not_in_the_cache_while_offline_raises_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once at import: set the module constant too.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(MedusaCheckpointError, match=r"nobody/not-a-model is not in the local Hugging Face cache"):
        load_medusa_model("nobody/not-a-model", quantization=None, device="cpu")


@pytest.mark.parametrize("file", ["medusa_lm_head.safetensors", "medusa_lm_head.pt"])
def test_a_truncated_head_file_raises_a_checkpoint_error_naming_the_file(file, base, tmp_path):
    folder, backbone = base
    heads = random_heads(backbone, HEADS)
    save_medusa_heads(heads, tmp_path, base_model_name_or_path=str(folder))
    if file.endswith(".pt"):
        torch.save(heads.state_dict(), tmp_path / file)
        (tmp_path / "medusa_lm_head.safetensors").unlink()
    data = (tmp_path / file).read_bytes()
    (tmp_path / file).write_bytes(data[: len(data) // 2])
    with pytest.raises(MedusaCheckpointError, match=re.escape(f"{tmp_path / file} could not be read")):
        load(tmp_path)


@pytest.mark.parametrize("file", ["config.json", "medusa_calibration.json"])
def test_a_json_file_that_is_not_an_object_raises_a_checkpoint_error_naming_the_file(file, base, tmp_path):
    folder, backbone = base
    save_medusa_heads(random_heads(backbone, HEADS), tmp_path, base_model_name_or_path=str(folder))
    (tmp_path / file).write_text('["a", "list"]')
    with pytest.raises(MedusaCheckpointError, match=re.escape(f"{tmp_path / file} holds a JSON list, expected an object")):
        load(tmp_path)


def test_calibrated_and_tuned_trees_deeper_than_the_heads_are_dropped_with_a_warning_and_the_default_falls_back(
    base, tmp_path, caplog
):
    # A calibration written for 4 heads next to 2 heads: its default tree cannot run here. Before,
    # the model kept it as its default, and the app's tree dropdown stayed empty.
    folder, backbone = base
    calibration = {"trees": {"deep": [[0], [0, 0], [0, 0, 0]], "fits": [[0], [1], [0, 0]]}, "default_tree": "deep"}
    save_medusa_heads(random_heads(backbone, 2), tmp_path, base_model_name_or_path=str(folder), calibration=calibration)
    (tmp_path / "medusa_tuned.json").write_text(json.dumps({"cpu/none": {"choices": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}}))
    with caplog.at_level("WARNING", logger="medusa_core.loading"):
        model = load(tmp_path)
    assert list(model.trees) == ["fits"]
    assert model.default_tree == "chain_2"  # the device's default for 2 heads
    assert model.resolve_tree(model.default_tree)[1] == [[0], [0, 0]]
    log = caplog.text
    assert "medusa_tuned.json: tree 'tuned' dropped: path [0, 0, 0, 0] has depth 4 but the model has only 2 Medusa heads" in log
    assert "medusa_calibration.json: tree 'deep' dropped: path [0, 0, 0] has depth 3" in log
    assert "default tree 'deep' not used" in log


def test_a_calibration_default_tree_that_fits_is_kept_when_the_tuned_tree_is_dropped(base, tmp_path, caplog):
    folder, backbone = base
    calibration = {"trees": {"fits": [[0], [1]]}, "default_tree": "fits"}
    save_medusa_heads(random_heads(backbone, 2), tmp_path, base_model_name_or_path=str(folder), calibration=calibration)
    (tmp_path / "medusa_tuned.json").write_text(json.dumps({"cpu/none": {"choices": [[0], [0, 0], [0, 0, 0]]}}))
    with caplog.at_level("WARNING", logger="medusa_core.loading"):
        model = load(tmp_path)
    assert (list(model.trees), model.default_tree) == (["fits"], "fits")
    assert "default tree 'tuned' not used" in caplog.text


def test_heads_trained_for_the_requested_backbone_precision_are_taken_from_their_subfolder(base, tmp_path):
    folder, backbone = base
    default = fp16_exact(random_heads(backbone, HEADS, seed=1))
    save_medusa_heads(default, tmp_path, base_model_name_or_path=str(folder),
                      calibration={"trees": {"for_nf4": [[0], [1]]}, "default_tree": "for_nf4"})
    plain = fp16_exact(random_heads(backbone, 2, seed=2))  # trained for the plain backbone
    save_medusa_heads(plain, tmp_path / "backbone-none", base_model_name_or_path=str(folder),
                      calibration={"trees": {"for_plain": [[0], [0, 0]]}, "default_tree": "for_plain"})
    model = load(tmp_path)  # quantization=None: the plain backbone
    assert model.num_heads == 2 and (list(model.trees), model.default_tree) == (["for_plain"], "for_plain")
    assert_same_heads(model.heads, plain)
    (tmp_path / "backbone-none").rename(tmp_path / "backbone-int8")  # only another precision has its own heads
    model = load(tmp_path)
    assert model.num_heads == HEADS and (list(model.trees), model.default_tree) == (["for_nf4"], "for_nf4")
    assert_same_heads(model.heads, default)


def test_a_model_given_a_tree_that_does_not_fit_its_heads_raises_naming_the_tree(base):
    _, backbone = base
    with pytest.raises(ValueError, match=re.escape("the model's tree 'deep' does not fit: path [0, 0, 0] has depth 3")):
        MedusaModel(backbone, random_heads(backbone, 2), trees={"deep": [[0], [0, 0], [0, 0, 0]]})
    with pytest.raises(ValueError, match=re.escape("the model's tree 'chain_3' does not fit")):
        MedusaModel(backbone, random_heads(backbone, 2), default_tree="chain_3")


_UNPICKLED: list[str] = []


def _record_unpickling(what: str) -> str:
    _UNPICKLED.append(what)
    return what


class _CodeOnLoad:
    """Unpickling this object runs ``_record_unpickling``: the shape of a malicious .pt file."""

    def __reduce__(self):
        return _record_unpickling, ("code ran",)


def test_a_pt_head_file_that_would_run_code_is_refused(base, tmp_path):
    folder, backbone = base
    save_medusa_heads(random_heads(backbone, HEADS), tmp_path, base_model_name_or_path=str(folder))
    (tmp_path / "medusa_lm_head.safetensors").unlink()
    torch.save({"0.0.linear.weight": _CodeOnLoad()}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises((pickle.UnpicklingError, MedusaCheckpointError)):
        load(tmp_path)
    assert _UNPICKLED == []
    assert pickle.loads(pickle.dumps(_CodeOnLoad())) == "code ran" and _UNPICKLED == ["code ran"]
    _UNPICKLED.clear()


# ------------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("num_layers", [1, 2])
def test_vllm_export_has_the_documented_keys_and_config(num_layers, tmp_path):
    heads = MedusaHeads(HIDDEN, VOCAB, 3, num_layers=num_layers)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    fp16_exact(heads)
    export_vllm(heads, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["hidden_size"], config["vocab_size"]) == (HIDDEN, VOCAB)
    assert (config["num_heads"], config["num_hidden_layers"], config["medusa_fc_bias"]) == (3, num_layers, True)
    state = load_file(tmp_path / "model.safetensors")
    expected = {f"lm_heads.{i}.weight" for i in range(3)}
    expected |= {f"blocks.{i}.layers.{j}.{p}" for i in range(3) for j in range(num_layers) for p in ("weight", "bias")}
    assert set(state) == expected
    for i in range(3):
        assert torch.equal(state[f"lm_heads.{i}.weight"].float(), heads[i][num_layers].weight)
        for j in range(num_layers):
            assert torch.equal(state[f"blocks.{i}.layers.{j}.weight"].float(), heads[i][j].linear.weight)
            assert torch.equal(state[f"blocks.{i}.layers.{j}.bias"].float(), heads[i][j].linear.bias)


def test_vllm_export_of_version_2_heads_copies_the_backbone_lm_head_per_head(base, tmp_path):
    _, backbone = base
    heads = MedusaHeads(HIDDEN, VOCAB, 2, shared_lm_head=backbone.get_output_embeddings())
    export_vllm(heads, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    lm_head = backbone.get_output_embeddings().weight.half()
    assert torch.equal(state["lm_heads.0.weight"], lm_head) and torch.equal(state["lm_heads.1.weight"], lm_head)


# --------------------------------------------------------------------------------------------- nf4
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
    out = [t for r in model.generate(PROMPT, max_new_tokens=n, tree="sparse_16") for t in r.token_ids]
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
    got = [t for r in model.generate(ids, max_new_tokens=24, tree="chain_3") for t in r.token_ids]
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
