"""The vLLM export of trained heads: its documented keys and config, version-2 heads with the backbone's LM head copied
per head."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import HIDDEN, VOCAB

from medusa_core import MedusaHeads, export_vllm

from .support import fp16_exact


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
