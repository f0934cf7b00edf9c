"""Checkpoints that do not fit are refused with a clear error naming the file, the value and what is allowed: heads
for another backbone, extra or missing tensors, no heads, a missing folder or Hub id, truncated or non-object files,
trees deeper than the heads, a ``.pt`` file that would run code."""

from __future__ import annotations

import json
import pickle
import re

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import HIDDEN, VOCAB, random_heads

from medusa_core import MedusaCheckpointError, MedusaHeads, MedusaModel, load_medusa_model, save_medusa_heads

from .support import HEADS, fp16_exact, assert_same_heads, load


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
