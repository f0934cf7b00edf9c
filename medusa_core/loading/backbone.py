"""The backbone a checkpoint names: its precision (``resolve_quantization``), where its config and tokenizer are read
from (``backbone_source``), the model itself (``load_backbone``) and its tokenizer (``load_tokenizer``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import MedusaCheckpointError
from ..gguf import gguf_model_folder
from ..invariant import make_batch_invariant
from ..quant.gguf_backbone import load_gguf_backbone

log = logging.getLogger(__name__)

#: Backbone precisions: "auto" picks "gguf" for a GGUF backbone on the CPU, else "nf4" (``resolve_quantization``).
QUANTIZATIONS = ("auto", "gguf", "nf4", "int8", None)


def resolve_quantization(quantization: str | None, base: str, device: torch.device) -> str | None:
    """The precision ``"auto"`` stands for: ``"gguf"`` for a ``.gguf`` backbone on the CPU (the file's own
    4-bit blocks, nothing re-quantized), else ``"nf4"``; any other value as given."""
    if quantization != "auto":
        return quantization
    return "gguf" if str(base).lower().endswith(".gguf") and device.type == "cpu" else "nf4"


def backbone_source(base: str, trust_remote_code: bool = False) -> str:
    """Where transformers reads a backbone's config and tokenizer from: a Hub id or folder as given; a
    ``.gguf`` file (llama.cpp, LM Studio, Ollama) its folder in the cache (``gguf_model_folder``: made
    once; the weights stay in the file).

    Raises ``MedusaCheckpointError`` for a GGUF file that is missing or of an architecture
    transformers cannot read from GGUF.
    """
    if str(base).lower().endswith(".gguf"):
        return str(gguf_model_folder(base, trust_remote_code=trust_remote_code))
    return base


def load_backbone(
    base: str,
    quantization: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    batch_invariant: bool = True,
    report: Callable[[str], None] | None = None,
):
    """A frozen Hugging Face causal LM in eval mode in the precision ``quantization`` (see
    ``load_medusa_model``; ``"auto"`` is resolved here with ``resolve_quantization``).

    ``base`` is a Hub id, a folder or a ``.gguf`` file. A GGUF file's tensors are read from the file
    itself (``load_gguf_backbone``): ``"gguf"`` keeps its 4-bit blocks, ``"nf4"`` and ``"none"`` dequantize
    them at load; a folder or Hub id loads through ``from_pretrained`` (bitsandbytes for ``"nf4"`` and
    ``"int8"``). On a CPU the model's decoding step is then made batch-invariant (``make_batch_invariant``)
    unless ``batch_invariant=False`` (batched distillation and training, which need no exactness: a
    float32 backbone's linears would multiply row by row); ``report`` is told when that compiles the row
    attention (a first start).

    Raises ``MedusaCheckpointError`` when transformers cannot load ``base``, or for a precision the
    backbone cannot have (``"gguf"`` for a model that is not a GGUF file or on a GPU; ``"int8"`` for GGUF).
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    device = torch.device(device)
    quantization = resolve_quantization(None if quantization == "none" else quantization, base, device)
    if str(base).lower().endswith(".gguf"):
        folder = gguf_model_folder(base, trust_remote_code=trust_remote_code)
        model = load_gguf_backbone(base, folder, quantization, dtype, device, trust_remote_code)
    elif quantization == "gguf":
        raise MedusaCheckpointError(f"quantization 'gguf' needs a .gguf backbone file, got {base!r}: use 'nf4' or 'none'")
    else:
        kwargs: dict[str, Any] = {"dtype": dtype, "device_map": {"": str(device)}, "trust_remote_code": trust_remote_code}
        if quantization == "nf4":
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
            )
        elif quantization == "int8":
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        try:
            model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
        except (OSError, ValueError) as e:
            raise MedusaCheckpointError(f"could not load the backbone {base!r}: {e}") from e
    if device.type == "cpu" and batch_invariant:
        make_batch_invariant(model, quantized=quantization is not None, report=report)
    return model.eval().requires_grad_(False)


def load_tokenizer(folder: Path, base: str, trust_remote_code: bool):
    """The tokenizer in the checkpoint ``folder`` where it has one, else the backbone's (``base``, a folder or Hub id);
    None, with a logged warning, where transformers cannot load either."""
    from transformers import AutoTokenizer

    source = str(folder) if (folder / "tokenizer_config.json").exists() else base
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        log.warning("no tokenizer for %s: %s", source, e)
        return None
