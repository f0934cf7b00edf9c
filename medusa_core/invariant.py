"""A batch-invariant decoding step on the CPU: greedy Medusa ≡ plain greedy by construction.

Greedy Medusa is exact only if the logits of an accepted tree node are those that one-token
decoding computes at the same position. A tree pass computes N rows at once; one-token decoding
one row. Every op therefore has to give row r the same bits whatever the other rows are
(the approach of thinking-machines-lab/batch_invariant_ops and vLLM's batch-invariant mode: replace
the few ops that are not, and test 1-row against N-row results bit for bit):

- linears: ``Int4Linear`` and ``BF16Linear`` (``medusa_core.quant.layers``) are; bitsandbytes'
  fused NF4 CPU kernel is (``../shared/reference/CPU_4BIT.md``); float32 ``F.linear`` is not (MKL
  takes a gemv path for one row and gemm paths for more, and rows of a 4-row gemm already differ
  from a 2-row one), so float32 layers become ``RowwiseLinear``: one gemv per row in decoding passes.
- norms, rotary embeddings, activations, residual adds: row by row already.
- attention: ``rowwise_attention`` below. SDPA over N query rows with a tree mask differs from SDPA
  over one row (other blocking, masked keys interleaved in its reductions), so each query row runs
  as its own SDPA call over exactly the keys it may see, in cache order. That is the same call, on
  the same values, that one-token decoding makes at that position (keys 0..p), so the result is the
  same bits. Passes of more than ``MAX_ROWWISE`` rows (a long prompt's prefill, shared by every
  decoding mode) use transformers' SDPA as they are.
- the LM head: ``int4_lm_head`` for a 4-bit backbone (a 4-bit first pass, the top logits refined in
  float32), ``RowwiseLinear`` for a float32 one.

It is registered with transformers' public ``AttentionInterface`` / ``AttentionMaskInterface`` under
``ATTENTION`` and selected with ``model.set_attn_implementation``; no modelling code is copied.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .quant.layers import int4_lm_head

#: Name of the attention implementation (``config._attn_implementation``).
ATTENTION = "medusa_rowwise"
#: Largest pass (query rows) run row by row: decoding steps and trees; longer passes are prefills.
MAX_ROWWISE = 64
#: Keyword the engine passes through the decoder while it reads a prompt (``prefill.read_prompt``): a
#: pass after entries already cached (a conversation's next message, a later chunk) runs as one SDPA call.
READING = "medusa_reading"


def rowwise_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention with an ``AttentionInterface`` signature whose every query row is computed alone.

    Args:
        query: [B, H, N, Dh]; key, value: [B, Hkv, L, Dh] (the cache, this pass's N entries last).
        attention_mask: None (causal: row i sees keys 0 .. L−N+i), or [1, 1, N, L] boolean (True:
            may attend) or additive float (0: may attend; anything below half the dtype's minimum: not).
        scaling: softmax scale (None: 1/√Dh).

    Returns (output [1, N, H, Dh], None), as transformers' attention functions do.
    Row i's output is bitwise equal to this function's output for row i alone with only its visible
    keys (``tests/test_invariance.py``). Batches of several sequences (distillation, training),
    passes of more than ``MAX_ROWWISE`` rows, and passes of a prompt's reading (``READING`` set) after
    cached entries go to transformers' SDPA unchanged: row by row, each of N new tokens would read the
    whole cache (on the demo, 40 new tokens after 1,500 cached took 2.5x as long), and a prompt's
    reading is shared by every decoding mode, so greedy Medusa stays plain greedy.
    """
    n, length = query.shape[2], key.shape[2]
    reading_after_cache = kwargs.pop(READING, False) and length > n
    if n > MAX_ROWWISE or query.shape[0] != 1 or reading_after_cache:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    rows = _visible_keys(attention_mask, n, length)
    out = []
    for i, keys in enumerate(rows):
        if isinstance(keys, int):  # keys 0 .. keys-1: a view, as one-token decoding sees its cache
            k, v = key[:, :, :keys], value[:, :, :keys]
        else:
            k, v = key.index_select(2, keys), value.index_select(2, keys)
        out.append(F.scaled_dot_product_attention(query[:, :, i : i + 1], k, v, scale=scaling, enable_gqa=gqa))
    return (out[0] if n == 1 else torch.cat(out, dim=2)).transpose(1, 2).contiguous(), None


# One pass hands the same mask tensor to every layer: read its rows once. The last mask is held weakly
# and compared by identity (a tensor's == is elementwise), so a freed mask is never mistaken for a new one.
_last_rows: list = [lambda: None, None]  # [weakref to the mask, its rows]


def _visible_keys(mask: torch.Tensor | None, n: int, length: int) -> list[int | torch.Tensor]:
    """Per query row, the keys it may see: an int m for keys 0..m−1, else their indices [m] (ascending)."""
    if mask is None:
        return [length - n + i + 1 for i in range(n)]
    if _last_rows[0]() is not mask:
        _last_rows[:] = [weakref.ref(mask), _read_rows(mask, n)]
    return _last_rows[1]


def _read_rows(mask: torch.Tensor, n: int) -> list[int | torch.Tensor]:
    mask = mask[0, 0, -n:]  # [N, L]
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    counts = visible.sum(dim=-1)  # [N]
    prefix = visible.cumprod(dim=-1).sum(dim=-1)  # [N] leading run of visible keys
    rows: list[int | torch.Tensor] = []
    for i, (c, p) in enumerate(zip(counts.tolist(), prefix.tolist())):
        rows.append(c if c == p else visible[i].nonzero()[:, 0])
    return rows


class RowwiseLinear(nn.Linear):
    """``nn.Linear`` that multiplies each row on its own in passes of at most ``MAX_ROWWISE`` rows.

    ``forward(x [..., K]) -> [..., N]``: row r's result is ``F.linear(x[r:r+1])``, the product one-token
    decoding computes, whatever the other rows; longer passes (prefills) take one ``F.linear``.
    The price: a tree of N tokens costs N one-row products, so Medusa gains nothing over plain
    decoding on a float32 CPU backbone; it stays exact. Build it with ``from_linear`` (shares weights).
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "RowwiseLinear":
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [M, K]
        if not 1 < flat.shape[0] <= MAX_ROWWISE:
            return F.linear(x, self.weight, self.bias)
        rows = [F.linear(flat[r : r + 1], self.weight, self.bias) for r in range(flat.shape[0])]
        return torch.cat(rows).reshape(*x.shape[:-1], self.out_features)


def register() -> None:
    """Make ``ATTENTION`` known to transformers (idempotent): ``rowwise_attention`` and SDPA's mask format."""
    AttentionInterface.register(ATTENTION, rowwise_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def make_batch_invariant(model: nn.Module, *, quantized: bool) -> nn.Module:
    """Make a CPU causal LM's decoding step batch-invariant, in place; returns the model.

    Selects ``rowwise_attention``. Float ``nn.Linear`` layers become ``RowwiseLinear`` (same
    weights) when the decoder's linears are float too (``quantized=False``); with a 4-bit decoder
    (``Int4Linear``, bitsandbytes NF4: batch-invariant kernels already) a float LM head is replaced by
    ``int4_lm_head``: a 4-bit first pass whose top logits each row refines in float32 (a tied
    input embedding keeps its own weights).
    """
    register()
    model.set_attn_implementation(ATTENTION)
    head = model.get_output_embeddings()
    if quantized:
        if type(head) is nn.Linear:
            bias = None if head.bias is None else head.bias.detach()
            model.set_output_embeddings(int4_lm_head(head.weight.detach(), bias))
            model.config.tie_word_embeddings = False
        return model
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear:
            model.set_submodule(name, RowwiseLinear.from_linear(module))
    return model
