"""Writing Medusa heads: the reference head-only layout and vLLM's layout (see ``MEDUSA_FACTS.md``).

``save_medusa_heads`` writes what ``load_medusa_model`` reads back (layout 1, or "version 2" for heads
that share the backbone's LM head); ``export_vllm`` writes vLLM's own layout. Which serving engine reads
which is in the README ("Serving engines") and checked by ``tests/test_serving_layouts.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .heads import MedusaHeads
from .loading import CALIBRATION_FILE


def save_medusa_heads(
    heads: MedusaHeads,
    folder: str | Path,
    *,
    base_model_name_or_path: str,
    calibration: dict[str, Any] | None = None,
) -> Path:
    """Write a head-only checkpoint in the reference layout (layout 1, or 2 for shared-LM-head heads).

    Files: ``config.json`` and ``medusa_lm_head.safetensors`` (fp16), plus ``medusa_calibration.json``
    when ``calibration`` is given. Who reads them (README, "Serving engines"; checked by
    ``tests/test_serving_layouts.py``): this project and text-generation-inference read both layouts
    (TGI version 2 only with one block per head); TensorRT-LLM reads layout 1 only, as its loader needs
    a projection ``{i}.{L}.weight`` per head, which version 2 heads do not have; vLLM reads neither
    (use ``export_vllm``); the reference code reads only ``medusa_lm_head.pt``. Root-conditioned heads
    (layout "root" of ``medusa_core.heads``) add the tensor ``root_weight`` and
    ``"medusa_root_conditioned": true``; only this project reads them.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "base_model_name_or_path": base_model_name_or_path,
        "medusa_num_heads": heads.num_heads,
        "medusa_num_layers": heads.num_layers,
    }
    if heads.shares_lm_head:
        config["version"] = "2"
    if heads.root_conditioned:
        config["medusa_root_conditioned"] = True
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in heads.state_dict().items()}
    save_file(state, folder / "medusa_lm_head.safetensors", metadata={"format": "pt"})
    if calibration is not None:
        (folder / CALIBRATION_FILE).write_text(json.dumps(calibration, indent=1) + "\n")
    return folder


def export_vllm(heads: MedusaHeads, folder: str | Path) -> Path:
    """Write vLLM's Medusa layout: ``config.json`` (model_type "medusa") and ``model.safetensors``.

    Keys: ``blocks.{i}.layers.{j}.weight/.bias`` and ``lm_heads.{i}.weight`` (for shared-LM-head heads,
    a copy of the backbone's LM head per head, which vLLM expects). The only layout of the three
    that vLLM reads, and the only way version 2 heads reach it. Raises ``ValueError`` for
    root-conditioned heads, which vLLM's Medusa model cannot run (its heads read the hidden state only).
    """
    if heads.root_conditioned:
        raise ValueError("root-conditioned Medusa heads have no vLLM layout: vLLM's Medusa heads read the hidden state only")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for i, head in enumerate(heads):
        for j in range(heads.num_layers):
            state[f"blocks.{i}.layers.{j}.weight"] = head[j].linear.weight
            state[f"blocks.{i}.layers.{j}.bias"] = head[j].linear.bias
        proj = heads._shared_lm_head[0] if heads.shares_lm_head else head[heads.num_layers]
        state[f"lm_heads.{i}.weight"] = proj.weight
    state = {k: v.detach().to("cpu", torch.float16).contiguous().clone() for k, v in state.items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "medusa_fc_bias": True,
        "truncated_vocab_size": None,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
