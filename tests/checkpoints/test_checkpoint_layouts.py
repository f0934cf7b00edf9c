"""The reference checkpoint layouts round trip (MEDUSA_FACTS.md, "Checkpoint layouts to load"): Medusa-1 head-only
folders (either head file), "version 2" heads sharing the backbone's LM head, root-conditioned heads, Medusa-2 full
checkpoints. Every checkpoint is written to disk by the test itself from a tiny random Llama."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import PROMPT  # plain data, shared with the fixtures
from safetensors.torch import load_file, save_file
from tiny_models import HIDDEN, VOCAB, random_heads

from medusa_core import MedusaCheckpointError, MedusaHeads, export_vllm, load_medusa_model, save_medusa_heads

from .support import HEADS, assert_same_heads, fp16_exact, generated, load


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
    assert generated(bf16, PROMPT, max_new_tokens=16, tree="sparse_16") == generated(model, PROMPT, max_new_tokens=16, medusa=False)


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
    assert generated(model, PROMPT, max_new_tokens=16, tree="sparse_16") == generated(model, PROMPT, max_new_tokens=16, medusa=False)


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
