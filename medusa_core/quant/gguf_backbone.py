"""A Hugging Face causal LM built straight from a GGUF file's tensors, in the precision asked for.

The model is created empty (``accelerate.init_empty_weights``: no weights allocated), from the
config cached by ``gguf_model_folder``, whose tensor index (transformers' own GGUF name map) says
where each GGUF tensor goes; transformers' tensor processor (``modeling_gguf_pytorch_utils``:
llama.cpp's Q/K row permutation, Gemma's norm offsets, ...) undoes the file's conventions. The
tensors are memory-mapped from the file, then each is placed:

- ``"gguf"`` (the file's own 4-bit weights): Q4_0 / Q4_1 linear weights become ``Int4Linear`` from
  their blocks as they are (``gguf_blocks``; a row permutation is applied to codes and scales alike);
  other linear weights and the token embedding are dequantized to bfloat16 (``BF16Linear`` /
  ``BF16Embedding``); the LM head is ``int4_lm_head`` (a 4-bit first pass, each row's top logits
  refined in float32 from its bfloat16 weights); norms and biases stay float32. CPU only.
- ``"none"``: every tensor dequantized to ``dtype`` (float32 by default), plain ``nn.Linear``.
- ``"nf4"``: dequantized one linear at a time and re-quantized by bitsandbytes (``Linear4bit``).

No float32 copy of the whole model is ever made for ``"gguf"`` or ``"nf4"``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from gguf import GGMLQuantizationType

from ..errors import MedusaCheckpointError
from ..gguf import TENSOR_INDEX
from .gguf_blocks import INT4_TYPES, int4_groups
from .layers import BF16Embedding, BF16Linear, Int4Linear, int4_lm_head

log = logging.getLogger(__name__)

#: Precisions ``load_gguf_backbone`` builds.
GGUF_PRECISIONS = ("gguf", "none", "nf4")


def load_gguf_backbone(
    path: str | Path, folder: str | Path, quantization: str | None, dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu", trust_remote_code: bool = False,
) -> nn.Module:
    """The causal LM stored in the GGUF file ``path`` (config and tokenizer cached in ``folder``).

    Args:
        quantization: ``"gguf"`` (keep the file's 4-bit blocks; CPU only), ``None``/``"none"`` or ``"nf4"``.
        dtype: compute dtype of the activations (norms, attention, residual stream).
        device: where the model runs.

    Returns the model in eval mode with gradients off.

    Raises:
        MedusaCheckpointError: an unsupported precision for GGUF, ``"gguf"`` on a GPU, or a tensor the
            model has no place for / a parameter the file does not provide (naming it).
    """
    from accelerate import init_empty_weights
    from gguf import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    quantization = quantization or "none"
    if quantization not in GGUF_PRECISIONS:
        raise MedusaCheckpointError(f"quantization {quantization!r} is not offered for GGUF backbones: use one of {GGUF_PRECISIONS}")
    device = torch.device(device)
    if quantization == "gguf" and device.type != "cpu":
        raise MedusaCheckpointError(f"quantization 'gguf' (the file's own 4-bit blocks) runs on the CPU, not {device}: use 'nf4'")
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers (rotary) real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    index = json.loads((Path(folder) / TENSOR_INDEX).read_text(encoding="utf-8"))
    processor = TENSOR_PROCESSORS.get(index["architecture"], TensorProcessor)(config=config.to_dict())
    tensors = {e["hf_name"]: _mapped(path, e) for e in index["tensors"] if e["hf_name"]}
    unused = [e["name"] for e in index["tensors"] if not e["hf_name"]]
    if unused:
        log.info("%s: tensors without a place in %s: %s", Path(path).name, type(model).__name__, unused[:5])

    def values(t: _Tensor) -> np.ndarray:
        weights = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name).weights
        return np.require(weights, requirements=["W"])  # copied only when read-only (a float tensor's memory map)

    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    lm_head = next(n for n, m in linears.items() if m is model.get_output_embeddings())
    embed = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    tied = f"{lm_head}.weight" not in tensors  # GGUF stores a tied LM head once, as token_embd
    for name, module in linears.items():
        if name == lm_head and tied:
            continue
        weight, bias = f"{name}.weight", f"{name}.bias"
        if weight not in tensors:
            raise MedusaCheckpointError(f"{path}: no tensor for {weight} of {type(model).__name__}")
        # Each tensor leaves ``tensors`` as it is placed: its memory map closes, and its pages leave the
        # process's resident memory at once instead of at the end of the load (peak RSS: README, "Memory").
        w, b = tensors.pop(weight), (torch.from_numpy(values(tensors.pop(bias))) if bias in tensors else None)
        if quantization == "gguf" and name == lm_head:
            layer = int4_lm_head(torch.from_numpy(values(w)), b)
        elif quantization == "gguf":
            layer = _int4_linear(w, processor, b) or BF16Linear.from_weight(torch.from_numpy(values(w)), b)
        else:
            layer = _dense_linear(torch.from_numpy(values(w)), b, quantization, dtype, device)
        model.set_submodule(name, layer)
        del w, layer
    emb = torch.from_numpy(values(tensors.pop(f"{embed}.weight")))
    padding = model.get_input_embeddings().padding_idx
    if quantization == "gguf":
        model.set_submodule(embed, BF16Embedding.from_weight(emb, dtype, padding))
        if tied:
            model.set_submodule(lm_head, int4_lm_head(model.get_input_embeddings().weight))
    else:
        model.set_submodule(embed, nn.Embedding.from_pretrained(emb.to(dtype), freeze=True, padding_idx=padding))
        if tied:
            model.set_submodule(lm_head, _dense_linear(emb, None, "none", dtype, device))
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
    for name, tensor in tensors.items():  # what is left: norms and other small parameters
        module, _, attr = name.rpartition(".")
        value = torch.from_numpy(values(tensor)).to(dtype)
        model.get_submodule(module).register_parameter(attr, nn.Parameter(value, requires_grad=False))
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise MedusaCheckpointError(f"{path}: the file has no tensor for {missing[:5]} of {type(model).__name__}")
    return model.to(device).eval().requires_grad_(False)


class _Tensor(NamedTuple):
    """A GGUF tensor memory-mapped from its file: GGUF name, GGML type, raw data (``ReaderTensor``'s fields)."""

    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray


def _mapped(path: str | Path, entry: dict) -> _Tensor:
    """The tensor an entry of ``gguf_tensors.json`` describes, memory-mapped read-only from ``path``."""
    data = np.memmap(str(path), dtype=np.dtype(entry["dtype"]), mode="r", offset=entry["offset"], shape=tuple(entry["shape"]))
    return _Tensor(entry["name"], GGMLQuantizationType(entry["type"]), data)


def _int4_linear(tensor, processor, bias: torch.Tensor | None) -> Int4Linear | None:
    """``Int4Linear`` from a Q4_0 / Q4_1 GGUF tensor, rows in transformers' order; None for other types,
    or when transformers' processor does more to the tensor than permute its rows."""
    if tensor.tensor_type not in INT4_TYPES:
        return None
    codes, scale, zero = int4_groups(tensor.data, tensor.tensor_type)
    rows = codes.shape[0]
    order = processor.process(weights=np.arange(rows, dtype=np.int64)[:, None], name=tensor.name).weights[:, 0]
    if sorted(order.tolist()) != list(range(rows)):
        return None
    order = torch.from_numpy(np.ascontiguousarray(order))
    try:
        return Int4Linear(codes[order], scale[order], zero[order], bias)
    except ValueError:  # a shape the kernel does not tile (N % 16, K % 32)
        return None


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str, dtype: torch.dtype, device) -> nn.Module:
    """A float ``nn.Linear`` (``"none"``) or a bitsandbytes NF4 ``Linear4bit`` (``"nf4"``) holding ``weight`` [N, K]."""
    if quantization == "nf4":
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(weight.shape[1], weight.shape[0], bias=bias is not None, compute_dtype=dtype,
                                  quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(weight.float(), requires_grad=False, quant_type="nf4")
        if bias is not None:
            layer.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        return layer.to(device)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=dtype)
    layer.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return layer
