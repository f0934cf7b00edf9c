"""What a ``MedusaModel`` is, for callers and panels: its device, widths, context, default tree and settings, the
tuned choices per settings preset, and ``describe``'s facts (``ModelFacts``, a base class of ``MedusaModel``).

Read-only: nothing here decodes. ``MedusaModel`` (``model.py``) sets the attributes these read: ``backbone``,
``heads``, ``config`` (the backbone's text config), ``name``, ``base_model``, ``quantization``, ``trees``, ``tuned``,
``head_temperatures``, ``min_head_probability``, ``_default_tree`` and ``_steps`` (its ``decoding.StepRunner``).
"""

from __future__ import annotations

from typing import Any

import torch

from .invariant import ATTENTION, ATTENTION_KERNEL
from .processors import CHAT_PRESET, SamplingConfig
from .quant.layers import Int4Linear
from .trees import TREE_PRESETS
from .tuned import TunedSettings, settings_preset


class ModelFacts:
    """The read-only facts of a ``MedusaModel`` (its base class; the attributes it reads are in the module's docstring)."""

    @property
    def device(self) -> torch.device:
        """Device of the backbone's input embeddings."""
        return self.backbone.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the activations (a 4-bit backbone computes in its compute dtype)."""
        return self.backbone.get_input_embeddings().weight.dtype

    @property
    def num_heads(self) -> int:
        """K, the number of Medusa heads."""
        return self.heads.num_heads

    @property
    def vocab_size(self) -> int:
        """V, the tokens each head ranks (the backbone's LM-head width)."""
        return self.backbone.get_output_embeddings().out_features

    @property
    def _draft_vocabulary(self) -> int:
        """S, the token ids 0..S−1 the heads draft from (``MedusaHeads.restrict_drafts``; V by default)."""
        return getattr(self.heads, "draft_vocabulary", self.vocab_size)

    @property
    def max_context(self) -> int:
        """Tokens the KV cache may hold: the position limit, capped by a sliding window if any."""
        limit = getattr(self.config, "max_position_embeddings", None) or 2048
        window = getattr(self.config, "sliding_window", None)
        return min(limit, window - 1) if window else limit

    @property
    def default_tree(self) -> str:
        """The tree used when none is given: the model's own, else a preset that suits the device."""
        if self._default_tree:
            return self._default_tree
        if self.device.type == "cuda" and self.num_heads >= 4:
            return "mc_sim_7b_63"
        return "sparse_16" if self.num_heads >= 4 else f"chain_{self.num_heads}"

    @property
    def sampling_defaults(self) -> SamplingConfig:
        """``generate``'s settings when none are given: what HF ``generate`` uses for this model, i.e.
        the generation config's sampling values (``SamplingConfig.from_generation_config``), else greedy."""
        return SamplingConfig.from_generation_config(getattr(self.backbone, "generation_config", None)) or SamplingConfig()

    @property
    def chat_defaults(self) -> SamplingConfig:
        """The settings a chat starts with (app, benchmark): the generation config's sampling values when it
        sets any, else ``CHAT_PRESET`` (greedy loops on small models: README, "Defaults and why")."""
        return SamplingConfig.from_generation_config(getattr(self.backbone, "generation_config", None)) or CHAT_PRESET

    def tuned_for(self, config: SamplingConfig) -> TunedSettings | None:
        """``bench tune``'s choice for the preset that serves ``config`` (``settings_preset``), None if untuned."""
        return self.tuned.get(settings_preset(config))

    def shaping_threshold(self, config: SamplingConfig) -> float:
        """τ that ``generate`` shapes trees with at ``config`` when ``DraftConfig.min_head_probability`` is None:
        the tuned entry of its settings' preset (``tuned_for``), else ``min_head_probability``."""
        tuned = self.tuned_for(config)
        return tuned.min_head_probability if tuned else self.min_head_probability

    def tree_names(self) -> list[str]:
        """Tree names offered to users: the model's own trees first, then the presets that fit."""
        fitting = [n for n, c in TREE_PRESETS.items() if max(map(len, c)) <= self.num_heads]
        return list(self.trees) + [n for n in fitting if n not in self.trees]

    def describe(self) -> dict[str, Any]:
        """Facts for a model panel: names, precision (backbone compute dtype, head dtype), device, heads,
        their temperatures and the tuned tree-shaping threshold τ, context, which decoding pass runs (``step``:
        ``"lean"``, the compiled one of ``medusa_core.lean``, or ``"transformers"``, with ``step_note`` saying why
        not lean), how decoding rows attend (``attention``: ``"row kernel"``, ``"SDPA rows"`` or the model's own
        implementation's name), the draft vocabulary (``draft_vocabulary`` S, ``draft_ranked``: the heads' frequency
        ranking, else ids 0..S−1), how the heads propose (``proposal``: ``"compiled"``, ``medusa_core.lean.drafting``,
        or ``"ATen"``, with ``proposal_note`` saying why not compiled), which product the 4-bit layers run
        (``int4_product``: ``"amx"`` or ``"avx512-bf16"``, the compiled ``int4_matmul`` of ``medusa_core.lean`` on AMX
        tiles or AVX512-BF16 dot products, ``"torch"``, its int4-pack kernel, or None without ``Int4Linear`` layers),
        memory (bytes)."""
        params = list(self.backbone.parameters()) + list(self.heads.parameters())
        attention = getattr(self.backbone.config, "_attn_implementation", None)
        return {
            "model": self.name,
            "base_model": self.base_model,
            "quantization": self.quantization or "none",
            "dtype": str(self.dtype).replace("torch.", ""),
            "head_dtype": str(self._steps.head_dtype).replace("torch.", ""),
            "device": str(self.device),
            "num_heads": self.num_heads,
            "head_layers": getattr(self.heads, "num_layers", None),
            "default_tree": self.default_tree,
            "head_temperatures": self.head_temperatures,
            "min_head_probability": self.min_head_probability,
            "max_context": self.max_context,
            "step": "lean" if self._steps.lean is not None else "transformers",
            "step_note": self._steps.lean_reason,
            "attention": {ATTENTION_KERNEL: "row kernel", ATTENTION: "SDPA rows"}.get(attention, attention),
            "draft_vocabulary": self._draft_vocabulary,
            "draft_ranked": getattr(self.heads, "draft_ids", None) is not None,
            "proposal": "compiled" if self._steps.lean_drafts is not None else "ATen",
            "proposal_note": self._steps.lean_drafts_reason,
            "int4_product": Int4Linear.kernel_name if any(isinstance(m, Int4Linear) for m in self.backbone.modules()) else None,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        }
