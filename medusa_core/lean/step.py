"""The lean decoding step: a decoding pass of a Llama-family 4-bit backbone in one C++ call (issue 27).

On this project's CPU more than half of a one-token step was overhead around the int4 linears: Python
module calls, hooks, output capture, thousands of small ops (docs/BENCH.md, "Where a step's time goes").
``LeanStep`` runs the decoder layers of a pass of at most ``MAX_ROWWISE`` rows (a decoding step: one token
or a tree) through ``decoder.h`` (bound in ``lean_step.cpp``), which computes every value as transformers' Llama modules and this
project's layers do: the same kernels for products and attention, ATen's SiLU, the norms' sums in ATen's order,
and chains of elementwise operations as loops of the same IEEE operations in the same order. The hidden states are the
same bits (``tests/test_lean.py``): greedy output stays HF ``generate``'s and greedy Medusa stays plain greedy.
On the demo a plain step takes 7.1 ms instead of 15.6 ms (docs/BENCH.md, "The lean step").
The token embedding is the model's own module, and RoPE's cos / sin are rows of a table the model's own rotary
embedding made (RoPE scaling included; the same bits, ``LeanStep._rotary``); the LM head and everything after it are
unchanged. ``read`` runs a prompt's reading passes the same way, with their
attention as transformers' reading computes it.

Supported: Llama, Mistral and Qwen2 configurations without sliding windows, SiLU MLPs, RMS norms, every
decoder linear an ``Int4Linear`` (GGUF Q4_0 / Q4_1 backbones, ``quantization="gguf"``), on a CPU, with the
batch-invariant attention (``invariant.ROWWISE``: the step computes attention as the model's does, by
the compiled row kernel or by SDPA calls). Anything else keeps transformers' forward;
``MedusaModel.describe()["step"]`` says which runs and why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from ..invariant import ATTENTION_KERNEL, MAX_ROWWISE, REPLICAS_FROM, ROWWISE, RowKeys, row_groups, row_keys
from ..kvcache import GrowingLayer
from ..quant.layers import Int4Linear
from .build import ENV, enabled, load_extension

#: Model types whose decoder layer the C++ step reproduces (their modules are Llama's, op for op).
ARCHITECTURES = ("llama", "mistral", "qwen2")
_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def unsupported(backbone: nn.Module) -> str:
    """Why the lean step cannot run ``backbone`` (a transformers causal LM), or "" when it can."""
    config = backbone.config.get_text_config(decoder=True)
    decoder = backbone.get_decoder()
    if config.model_type not in ARCHITECTURES:
        return f"the lean step covers {', '.join(ARCHITECTURES)} models, not {config.model_type!r}"
    if getattr(config, "_attn_implementation", None) not in ROWWISE:
        return "the lean step needs the batch-invariant attention (a CPU backbone)"
    if getattr(config, "hidden_act", None) != "silu":
        return f"the lean step covers SiLU MLPs, not {getattr(config, 'hidden_act', None)!r}"
    layer_types = getattr(config, "layer_types", None)
    windowed = any(t != "full_attention" for t in layer_types) if layer_types else getattr(config, "sliding_window", None)
    if windowed:
        return "the lean step covers full attention only, not sliding windows"
    if not all(hasattr(decoder, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the decoder has no embed_tokens / layers / norm / rotary_emb"
    for i, layer in enumerate(decoder.layers):
        for name in _LINEARS:
            if not isinstance(layer.get_submodule(name), Int4Linear):
                return f"layer {i}'s {name} is not a 4-bit Int4Linear (the lean step runs GGUF Q4_0 / Q4_1 backbones)"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n).__name__ not in _NORMS for n in norms) or {name for name, _ in layer.self_attn.named_children()} != {
            "q_proj", "k_proj", "v_proj", "o_proj"
        }:
            return f"layer {i} is not a plain Llama-family layer"
    if type(decoder.norm).__name__ not in _NORMS:
        return "the final norm is not an RMS norm"
    norms = [decoder.norm] + [n for layer in decoder.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    embedded = getattr(decoder.embed_tokens, "out_dtype", decoder.embed_tokens.weight.dtype)  # BF16Embedding: float32 out
    if any(n.weight.dtype != torch.float32 for n in norms) or embedded != torch.float32:
        return "the lean step computes in float32 (the CPU's compute dtype), not in this model's dtype"
    return ""


#: How a pass attends (``decoder.h`` ``LeanDecoder::forward``): as the model decodes (the row kernel or SDPA
#: calls per row group), by SDPA calls per row group (a prompt's short first pass), or as one SDPA call over the
#: cache (every other pass of a prompt's reading).
MODEL, ROW_GROUPS, READING_PASS = 0, 1, 2
_NO_EXTRAS = torch.empty(0, dtype=torch.long)  # a pass without the row kernel's keys
#: Positions the rotary table first holds (``LeanStep`` ``_rotary``); it doubles when a pass reaches past it.
ROTARY_TABLE = 4096


class LeanStep:
    """Runs a decoding pass of a supported backbone (``unsupported``) through the compiled decoder.

    Build it with ``for_backbone``. ``__call__(tokens [N], positions [N], mask, cache, rows=None)`` returns the
    final-norm hidden states [N, H] of a decoding pass, or None when this pass is not one it runs (more than
    ``MAX_ROWWISE`` rows, a cache it cannot write, or, with SDPA rows, a branching tree over a cache long enough for
    ``rowwise_attention`` to read rows from replicas); the caller then runs transformers' forward. Either way the N
    entries end up in the cache, with the same bits. ``read(tokens, cache)`` does the same for a pass of a prompt's
    reading.
    """

    def __init__(self, backbone: nn.Module, module: Any):
        self.module = module  # the compiled extension (``build.load_extension``)
        config = backbone.config.get_text_config(decoder=True)
        self.decoder = decoder = backbone.get_decoder()
        layers, eps = [], []
        for layer in decoder.layers:
            tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for name in _LINEARS:
                linear = layer.get_submodule(name)
                tensors += [*linear.kernel_weights(), linear.bias if linear.bias is not None else torch.empty(0)]
            layers.append([t.detach() for t in tensors])
            eps.append(float(layer.input_layernorm.variance_epsilon))
            if layer.post_attention_layernorm.variance_epsilon != layer.input_layernorm.variance_epsilon:
                raise ValueError("the lean step assumes one epsilon per layer for both norms")
        first = decoder.layers[0]
        out_features = [first.get_submodule(name).out_features for name in _LINEARS]
        attention = first.self_attn
        self.row_kernel = config._attn_implementation == ATTENTION_KERNEL  # attention as the model computes it
        self.kv_shape = (config.num_key_value_heads, attention.head_dim)  # a cache entry's heads, width
        # cos / sin of positions 0..P-1 (``_rotary``), or None: the rotary embedding's own call at every pass
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        rope_type = getattr(decoder.rotary_emb, "rope_type", "default")
        self._tabled = attention.head_dim % 32 == 0 and "dynamic" not in rope_type and rope_type != "longrope"
        self._decoder = module.LeanDecoder(
            layers, eps, out_features, decoder.norm.weight.detach(), float(decoder.norm.variance_epsilon),
            config.num_attention_heads, config.num_key_value_heads, attention.head_dim, float(attention.scaling),
            self.row_kernel,
        )

    @property
    def fused(self) -> tuple[int, int]:
        """Layers whose q/k/v, and whose gate/up, run as one int4 product (``decoder_ops.h`` ``fuse``)."""
        qkv, gate_up = self._decoder.fused()
        return qkv, gate_up

    @property
    def own_mean(self) -> bool:
        """True when the RMS norms' variance is summed in the step itself in ATen's order (checked against
        ``pow(2).mean(-1)`` on this machine when the step is built), False where ATen's two calls run instead."""
        return bool(self._decoder.own_mean())

    @classmethod
    def for_backbone(cls, backbone: nn.Module, report: Callable[[str], None] | None = None) -> tuple[LeanStep | None, str]:
        """``(LeanStep, "")`` for a supported backbone (compiling the extension on first use, with ``report`` told),
        else ``(None, why)``: the backbone is not supported, ``$MEDUSA_LEAN_STEP`` is 0, or the extension cannot be
        built here."""
        why = unsupported(backbone)
        if why:
            return None, why
        if not enabled():
            return None, f"the lean step is turned off (${ENV}=0)"
        module, why = load_extension(report)
        return (cls(backbone, module), "") if module is not None else (None, why)

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: DynamicCache,
        rows: RowKeys | None = None,
    ) -> torch.Tensor | None:
        """Hidden states [N, H] of a decoding pass: ``tokens`` [N] at ``positions`` [N] after the cache's entries,
        ``mask`` as ``StepRunner.tree_forward`` gives the decoder ([1, 1, N, L + N], or None: causal); or None (see
        class). ``rows``: with the row kernel (``row_kernel``), the keys each row sees (``invariant.tree_row_keys``),
        instead of reading them from ``mask``."""
        n = tokens.shape[0]
        if n > MAX_ROWWISE or not self._writable(cache) or not all(layer.is_initialized for layer in cache.layers):
            return None
        length = cache.layers[0].get_seq_length()
        if self.row_kernel:
            return self._pass(tokens, positions, cache, MODEL, [], rows if rows is not None else row_keys(mask, n, length + n))
        groups = row_groups(mask, n, length + n) if mask is not None or n > 1 else []  # none: one row that sees every key
        if length >= REPLICAS_FROM and any(not g.view for g in groups):
            return None  # rowwise_attention reads such rows from replicas: transformers' pass does this better
        return self._pass(tokens, positions, cache, MODEL, groups, None)

    def read(self, tokens: torch.Tensor, cache: DynamicCache) -> torch.Tensor | None:
        """Final-norm hidden states [N, H] of a pass of a prompt's reading: ``tokens`` [N] after the cache's entries
        (none yet: a prompt's first pass; some: a later chunk, or a conversation's next message after its kept
        cache), each row attending as transformers' pass reads a prompt (``prefill.read_prompt`` with ``READING``):
        a first pass of at most ``MAX_ROWWISE`` rows by SDPA calls per row (``invariant.rowwise_attention``), any
        other as one SDPA call over the cache with the causal mask (transformers' ``sdpa_attention_forward``). The
        same bits as that pass (``tests/test_lean.py``), without the Python between its ops: on the demo the
        held-out prompts' time to the first token 54.8 -> 36.1 ms (docs/BENCH.md, "Prefetched 4-bit weights, a
        prompt's first pass in one call, the drafter compiled"), a conversation's next message: docs/BENCH.md,
        "Every pass of a prompt's reading in one call". None for a cache it cannot write (not of ``GrowingLayer``s,
        of another batch size); the caller then runs transformers' forward."""
        n, layers = tokens.shape[0], cache.layers
        if not self._writable(cache):
            return None
        written = [layer.is_initialized for layer in layers]
        if any(written) and not all(written):
            return None
        if not any(written):
            empty = torch.empty(1, self.kv_shape[0], 0, self.kv_shape[1])  # float32 entries
            for layer in layers:  # as a first ``update`` would: then room for n entries (or as ``kvcache.reserve`` set)
                layer.lazy_initialization(empty, empty)
                layer.room_for(n, empty, empty)
        length = layers[0].get_seq_length()
        positions = torch.arange(length, length + n, device=tokens.device)
        if length == 0 and n <= MAX_ROWWISE:
            return self._pass(tokens, positions, cache, ROW_GROUPS, row_groups(None, n, n) if n > 1 else [], None)
        return self._pass(tokens, positions, cache, READING_PASS, [], None)

    def _writable(self, cache: DynamicCache) -> bool:
        """The cache is one this step writes: a ``GrowingLayer`` per decoder layer, of one sequence."""
        layers = cache.layers
        if len(layers) != len(self.decoder.layers) or not all(type(layer) is GrowingLayer for layer in layers):
            return False
        return layers[0].batch == 1

    def _pass(self, tokens: torch.Tensor, positions: torch.Tensor, cache: DynamicCache, attention: int,
              groups: list, rows: RowKeys | None) -> torch.Tensor:
        """Run the compiled decoder over ``tokens`` [N] at ``positions`` [N] (attention mode ``attention``; the keys
        each row sees as SDPA row ``groups`` or the row kernel's ``rows``), write their N entries, return [N, H]."""
        n, layers = tokens.shape[0], cache.layers
        length = layers[0].get_seq_length()
        buffers = [layer.room_for(n) for layer in layers]
        hidden = self.decoder.embed_tokens(tokens[None])  # [1, N, H]
        cos, sin = self._rotary(hidden, positions, length + n)  # [1, N, Dh] each
        ints = [[g.rows[0], g.rows[-1] + 1, int(g.span), g.count, int(g.view)] for g in groups]
        out = self._decoder.forward(
            hidden, cos, sin, [b[0] for b in buffers], [b[1] for b in buffers], length, ints,
            [g.index for g in groups], [g.keys for g in groups],
            *((rows.prefix, rows.offsets, rows.extras) if rows else ([], [], _NO_EXTRAS)), attention,
        )
        for layer in layers:
            layer.extend(n)
        return out[0]

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's cos and sin [1, N, Dh] at ``positions`` [N] (all below ``end``) for ``hidden``
        [1, N, H]: rows of a table that the model's own rotary embedding made over positions 0..P-1 in one call, grown
        by doubling. Its elements are each position's own product, cosine and sine, computed 32 to a vector call
        (Dh a multiple of 32), so a row is the bits of a pass's own call; checked against such calls whenever the
        table is made, and a table that differs is dropped for good. A rotary embedding that changes with the length
        (dynamic RoPE, LongRoPE) or an odd head size: the module's call each pass (~15 us on the demo; docs/BENCH.md,
        "The greedy walk compiled, the rotary table, filtered blocks skipped")."""
        if self._tabled and (self._table is None or end > self._table[0].shape[0]):
            size = max(ROTARY_TABLE, 1 << (end - 1).bit_length())
            self._table = self._made_table(hidden, size)
            self._tabled = self._table is not None
        if not self._tabled:
            return self.decoder.rotary_emb(hidden, positions[None])
        cos, sin = self._table
        return cos.index_select(0, positions)[None], sin.index_select(0, positions)[None]

    def _made_table(self, hidden: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin [size, Dh] of positions 0..size-1, or None where a row differs from the rotary embedding's own
        call over one position or over a pass of several."""
        rotary, probe = self.decoder.rotary_emb, hidden[:, :1]
        cos, sin = (t[0] for t in rotary(probe, torch.arange(size, device=hidden.device)[None]))
        for at in ([0], [size - 1], [1, 2, 3], list(range(size - 7, size))):
            index = torch.tensor(at, device=hidden.device)
            want_cos, want_sin = rotary(probe, index[None])
            if not (torch.equal(cos[index], want_cos[0]) and torch.equal(sin[index], want_sin[0])):
                return None
        return cos, sin
