"""Peak memory of a 1.1B-parameter Llama loaded in 4 bits on the CPU (issue "4-bit for real on the CPU").

A documented measurement, not a test. It writes a randomly initialised Llama of TinyLlama-1.1B's shape
(22 layers, hidden 2048, FFN 5632, 32 heads, 4 KV heads, vocabulary 32,000) once into ``--folder``, in
one of two forms, then loads it in a fresh process as the app would on a CPU and decodes one step:

- ``--format gguf``: a GGUF file (linears Q4_0, token embedding and output Q8_0, a byte-level tokenizer),
  loaded with ``quantization="gguf"`` (the file's own 4-bit blocks; the default for a GGUF on a CPU);
- ``--format folder``: bfloat16 safetensors (about 2.2 GB), loaded with ``quantization="nf4"``
  (bitsandbytes; the default for a folder).

It prints the process's peak resident set size (``ru_maxrss``: it counts the file's pages that were
read through a memory map), and the same after importing torch and transformers only.

    python scripts/measure_memory.py --format gguf --folder /tmp/llama-1.1b
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path


def peak_gb() -> float:
    """Peak resident set size of this process so far, in GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)


def write_model(folder: Path) -> None:
    """A random TinyLlama-1.1B-shaped ``LlamaForCausalLM`` saved as bfloat16 safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPE, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B")
    model.save_pretrained(folder)


def write_gguf(path: Path) -> None:
    """The same shape as a GGUF file: linears Q4_0, embedding and output Q8_0, norms float32."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q, GGUFWriter, quantize

    rng = np.random.default_rng(0)
    hidden, ffn, heads, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    specials = ["<unk>", "<s>", "</s>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + ["t", "0"]
    tokens += [f"t{i}" for i in range(SHAPE["vocab_size"] - len(tokens))]  # "t0" is the one merge's result
    w = GGUFWriter(str(path), "llama")
    w.add_name("random-1.1b")
    w.add_context_length(SHAPE["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(SHAPE["num_hidden_layers"])
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges(["t 0"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def tensor(name: str, *shape: int, kind: Q | None = None) -> None:
        data = (rng.standard_normal(shape, dtype=np.float32) * 0.02)
        w.add_tensor(name, quantize(data, kind), raw_dtype=kind) if kind else w.add_tensor(name, np.ones(shape, np.float32))

    tensor("token_embd.weight", len(tokens), hidden, kind=Q.Q8_0)
    tensor("output.weight", len(tokens), hidden, kind=Q.Q8_0)
    tensor("output_norm.weight", hidden)
    head_dim = hidden // heads
    for i in range(SHAPE["num_hidden_layers"]):
        for name, rows, cols in [("attn_q", hidden, hidden), ("attn_k", kv * head_dim, hidden), ("attn_v", kv * head_dim, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden),
                                 ("ffn_down", hidden, ffn)]:
            tensor(f"blk.{i}.{name}.weight", rows, cols, kind=Q.Q4_0)
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def measure(source: Path, quantization: str) -> dict[str, float]:
    """Load ``source`` (folder or GGUF file) in ``quantization`` and decode one step; peak RSS (GB) along the way."""
    import torch
    import transformers  # noqa: F401  (counted in the runtime's share)

    from medusa_core.loading import load_backbone

    runtime = peak_gb()
    model = load_backbone(str(source), quantization=quantization)
    loaded = peak_gb()
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4]]))
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    return {"runtime_gb": runtime, "peak_after_load_gb": loaded, "peak_after_step_gb": peak_gb(), "weights_gb": weights / 1e9}


FORMATS = {"gguf": ("model.gguf", "gguf"), "folder": ("config.json", "nf4")}  # file written, precision loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=sorted(FORMATS), default="gguf", help="GGUF file (Q4_0) or bfloat16 folder (NF4)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/llama-1.1b"), help="where the random model is written once")
    parser.add_argument("--child", choices=["write", "measure"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    marker, quantization = FORMATS[args.format]
    source = args.folder / marker if args.format == "gguf" else args.folder
    if args.child == "write":
        write_gguf(source) if args.format == "gguf" else write_model(args.folder)
        return
    if args.child == "measure":
        print(json.dumps(measure(source, quantization)))
        return
    child = [sys.executable, __file__, "--format", args.format, "--folder", str(args.folder), "--child"]
    if not (args.folder / marker).exists():  # written in its own process: its memory is not counted
        args.folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([*child, "write"], check=True)
    out = subprocess.run([*child, "measure"], check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{args.format} ({quantization}): weights {result['weights_gb']:.2f} GB; peak RSS: torch+transformers "
          f"{result['runtime_gb']:.2f} GB, after load {result['peak_after_load_gb']:.2f} GB, "
          f"after one step {result['peak_after_step_gb']:.2f} GB")


if __name__ == "__main__":
    main()
