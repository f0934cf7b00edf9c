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
  over one row (other blocking, masked keys interleaved in its reductions), so each query row is
  computed over exactly the keys it may see, in cache order, as a query of length 1: the same
  computation, on the same values, that one-token decoding makes at that position (keys 0..p), so the
  result is the same bits. Rows with as many keys go as one call, in SDPA's batch dimension. Passes of more than ``MAX_ROWWISE`` rows (a long prompt's prefill, shared by every
  decoding mode) use transformers' SDPA as they are. Where the lean step's C++ extension is built
  (``medusa_core.lean``), ``kernel_attention`` runs every row of a pass in one call per layer instead
  for decoding passes (``row_attention`` in ``row_attention.h``: each row over its own keys, read in place from
  the cache in blocks of 128 ranks combined in order, every sum in a fixed order), faster than SDPA on one row, and
  the same bits for a row whatever the other rows are (``tests/test_invariance.py``); prompts are read as before.
- the LM head: ``int4_lm_head`` for a 4-bit backbone (a 4-bit first pass, the top logits refined in
  float32), ``RowwiseLinear`` for a float32 one.

It is registered with transformers' public ``AttentionInterface`` / ``AttentionMaskInterface`` under
``ATTENTION`` (SDPA rows) and ``ATTENTION_KERNEL`` (the compiled rows), and selected per model with
``model.set_attn_implementation``, so a model keeps one attention for its life; no modelling code is copied.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .acceptance import SAMPLING_KERNELS
from .processors import NodeProcessors
from .quant.layers import BF16Linear, Int4Linear, int4_lm_head

#: Name of the attention implementation whose rows run as SDPA calls (``config._attn_implementation``).
ATTENTION = "medusa_rowwise"
#: Name of the one whose rows run through the compiled ``row_attention`` (``kernel_attention``).
ATTENTION_KERNEL = "medusa_rowwise_kernel"
#: Both batch-invariant attentions.
ROWWISE = (ATTENTION, ATTENTION_KERNEL)
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
    """Attention with an ``AttentionInterface`` signature whose every query row is computed as if alone.

    Args:
        query: [B, H, N, Dh]; key, value: [B, Hkv, L, Dh] (the cache, this pass's N entries last).
        attention_mask: None (causal: row i sees keys 0 .. L−N+i), or [1, 1, N, L] boolean (True:
            may attend) or additive float (0: may attend; anything below half the dtype's minimum: not).
        scaling: softmax scale (None: 1/√Dh).

    Returns (output [1, N, H, Dh], None), as transformers' attention functions do.
    Row i's output is bitwise equal to this function's output for row i alone with only its visible
    keys (``tests/test_invariance.py``). Rows that see the same number of keys run as one SDPA call with
    the rows in SDPA's batch dimension (its CPU kernel computes each (batch, head) item on its own, so a
    row's bits do not depend on the others'): a tree pass takes one call per tree depth. Each row's keys
    are the shared prefix then its ancestors, in cache order: views of the cache's replicas
    (``kvcache.GrowingLayer.row_keys``) when ``key`` comes from one and holds at least ``REPLICAS_FROM``
    earlier entries, else gathered copies. Batches of several sequences (distillation, training),
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
    if n == 1 and attention_mask is None:  # one-token decoding: every key, as a view of the cache
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    layer = getattr(key, "rows_cache", None)
    groups = row_groups(attention_mask, n, length)
    outs = []
    for group in groups:
        if group.view:  # one row whose keys are 0 .. count−1: a view, as one-token decoding sees its cache
            k, v = key[:, :, : group.count], value[:, :, : group.count]
        elif group.paths is not None and layer is not None and length - n >= REPLICAS_FROM:
            k, v = layer.row_keys(length - n, group.paths)  # [B, Hkv, count, Dh] views of replicas
        else:  # [Hkv, B·count, Dh] -> [B, Hkv, count, Dh]
            shape = (key.shape[1], len(group.rows), group.count, key.shape[3])
            k = key[0].index_select(1, group.keys).view(shape).transpose(0, 1)
            v = value[0].index_select(1, group.keys).view(shape).transpose(0, 1)
        first, last = group.rows[0], group.rows[-1] + 1
        q = query[0, :, first:last] if group.span else query[0].index_select(1, group.index)  # [H, B, Dh]
        outs.append(F.scaled_dot_product_attention(q.transpose(0, 1)[:, :, None], k, v, scale=scaling, enable_gqa=gqa))
    rows = outs[0] if len(outs) == 1 else torch.cat(outs)  # [ΣB, H, 1, Dh], the groups' rows in turn
    if all(g.span for g in groups) and all(a.rows[-1] + 1 == b.rows[0] for a, b in zip(groups, groups[1:])):
        return rows.view(1, n, query.shape[1], query.shape[3]), None  # rows in order (a tree listed by depth)
    order = torch.cat([g.index for g in groups])
    return rows.new_empty(rows.shape).index_copy_(0, order, rows).view(1, n, query.shape[1], query.shape[3]), None


# The compiled extension whose ``row_attention`` ``kernel_attention`` calls (set by ``make_batch_invariant``).
_kernel: list[ModuleType] = []


def kernel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``rowwise_attention`` with every row of a decoding pass in one compiled call (``row_attention.h`` ``row_attention``).

    Args and returns as ``rowwise_attention``. Each query row of a decoding pass (one token, or a tree's rows,
    after cached entries) is computed over exactly its visible keys (``row_keys``), read in place from the cache
    in cache order, in blocks of 128 ranks whose partial softmaxes are combined in order, every sum in a fixed
    order that depends on the row's own keys only: row i's output is the same bits whatever the other rows are,
    and as close to the exact result as SDPA's (on the demo both within 2.7e-6 of float64). A prompt's reading (a model's first pass, or ``READING`` set), batches and passes
    of more than ``MAX_ROWWISE`` rows go to ``rowwise_attention`` unchanged: a prompt is read exactly as before
    the kernel existed, shared by every decoding mode and by HF ``generate`` (docs/BENCH.md, "The row kernel").
    Raises ``RuntimeError`` when no kernel was loaded (``make_batch_invariant`` selects this one only then).
    """
    n, length = query.shape[2], key.shape[2]
    reading = kwargs.pop(READING, False)
    if reading or length == n or n > MAX_ROWWISE or query.shape[0] != 1:
        return rowwise_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs, **{READING: reading})
    if not _kernel:
        raise RuntimeError(f"{ATTENTION_KERNEL!r} needs the lean step's compiled extension (make_batch_invariant loads it)")
    rows = row_keys(attention_mask, n, length)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _kernel[0].row_attention(query[0].transpose(0, 1), key[0], value[0], rows.prefix, rows.offsets, rows.extras, scale)
    return out[None], None  # [1, N, H, Dh]


class RowKeys(NamedTuple):
    """The keys each query row of a pass sees: positions 0 .. prefix[i]−1, then ``extras[offsets[i]:offsets[i+1]]``
    (ascending, each at least prefix[i]): the form ``row_attention`` reads."""

    prefix: list[int]  # [N]
    offsets: list[int]  # [N + 1]
    extras: torch.Tensor  # [Σ extras] int64


_last_keys: list = [lambda: None, None]  # [weakref to the mask, its RowKeys], as _last_groups


def row_keys(mask: torch.Tensor | None, n: int, length: int) -> RowKeys:
    """``RowKeys`` of a pass of ``n`` rows over ``length`` keys; ``mask`` as ``rowwise_attention`` takes it
    (None: causal, row i sees keys 0 .. L−N+i). Read once per mask."""
    if mask is None:
        return RowKeys([length - n + i + 1 for i in range(n)], [0] * (n + 1), torch.empty(0, dtype=torch.long))
    if _last_keys[0]() is not mask:
        visible = mask[0, 0, -n:]
        visible = visible if visible.dtype == torch.bool else visible > torch.finfo(visible.dtype).min / 2  # [N, L]
        prefix = visible.cumprod(dim=-1).sum(dim=-1)  # [N] leading run of visible keys
        beyond = visible & (torch.arange(length) >= prefix[:, None])  # [N, L] the rest
        offsets = [0] + beyond.sum(dim=-1).cumsum(0).tolist()
        _last_keys[:] = [weakref.ref(mask), RowKeys(prefix.tolist(), offsets, beyond.nonzero()[:, 1].contiguous())]
    return _last_keys[1]


def tree_row_keys(parents: tuple[int, ...], length: int) -> RowKeys:
    """``RowKeys`` of a tree pass after ``length`` cached entries, from its nodes' parents (``StepTree.node_parents``,
    -1 for the root, a parent listed before its children): node i sees the cache, then its ancestors and itself
    (paper 2.1.2's tree mask) -- what ``row_keys`` reads from that mask, without building it (a decoding step's
    mask is [N, L + N] and reading it cost the lean step ~0.06 ms)."""
    prefix, offsets, extras = _tree_rows(tuple(parents))
    return RowKeys([length + p for p in prefix], offsets, extras + length if length and extras.numel() else extras)


@functools.lru_cache(maxsize=1024)
def _tree_rows(parents: tuple[int, ...]) -> tuple[list[int], list[int], torch.Tensor]:
    """``tree_row_keys`` with no cached entries: (prefix [N], offsets [N + 1], extras [Σ]) of a tree's shape."""
    prefix, offsets, extras = [], [0], []
    for node in range(len(parents)):
        seen, at = set(), node
        while at >= 0:
            seen.add(at)
            at = parents[at]
        lead = 0
        while lead in seen:
            lead += 1
        prefix.append(lead)
        extras += sorted(k for k in seen if k > lead)
        offsets.append(len(extras))
    return prefix, offsets, torch.tensor(extras, dtype=torch.long)


class _RowGroup(NamedTuple):
    """Query rows of a pass that see the same number of keys: one batched SDPA call."""

    rows: list[int]  # query rows
    span: bool  # consecutive rows
    index: torch.Tensor  # [B] the same, as a tensor
    count: int  # keys each row sees
    view: bool  # a single row whose keys are 0 .. count−1
    keys: torch.Tensor  # [B·count] each row's key positions, ascending
    paths: torch.Tensor | None  # [B, count − P] positions after the pass's first P = L − N, when every row sees 0 .. P−1


# One pass hands the same mask tensor to every layer: read its rows once. The last mask is held weakly
# and compared by identity (a tensor's == is elementwise), so a freed mask is never mistaken for a new one.
_last_groups: list = [lambda: None, None]  # [weakref to the mask, its groups]

#: Most rows in one batched call (a tree pass's cache keeps a replica per row of its largest call: each a
#: copy of the KV cache, 46 KB a token on the demo, so this bounds the memory they take).
MAX_BATCH = 4
#: Cached tokens from which a batched call reads its rows' keys from the cache's replicas; below, copies
#: of each row's keys cost less than keeping the replicas' prefix up to date (docs/BENCH.md, issue 27).
REPLICAS_FROM = 256


def row_groups(mask: torch.Tensor | None, n: int, length: int) -> list[_RowGroup]:
    """The query rows of a pass of ``n`` rows over ``length`` keys (the cache, then the pass's entries), grouped by
    how many keys they see; ``mask`` as ``rowwise_attention`` takes it (None: causal). Read once per mask."""
    if mask is None:  # causal: row i sees keys 0 .. L−N+i, each a view
        return [_RowGroup([i], True, torch.tensor([i]), length - n + i + 1, True, torch.arange(length - n + i + 1), None)
                for i in range(n)]
    if _last_groups[0]() is not mask:
        _last_groups[:] = [weakref.ref(mask), _read_groups(mask, n, length)]
    return _last_groups[1]


def _read_groups(mask: torch.Tensor, n: int, length: int) -> list[_RowGroup]:
    mask = mask[0, 0, -n:]  # [N, L]
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    counts = visible.sum(dim=-1).tolist()  # [N]
    prefix = visible.cumprod(dim=-1).sum(dim=-1).tolist()  # [N] leading run of visible keys
    start = length - n
    by_count: dict[int, list[int]] = {}
    for i, c in enumerate(counts):
        by_count.setdefault(c, []).append(i)
    groups = []
    for count, rows in sorted(by_count.items()):
        for at in range(0, len(rows), MAX_BATCH):
            chunk = rows[at : at + MAX_BATCH]
            keys = visible[chunk].nonzero()[:, 1]  # [B·count] row-major, ascending within a row
            view = len(chunk) == 1 and prefix[chunk[0]] == count
            shared = all(prefix[i] >= start for i in chunk)
            paths = keys.view(len(chunk), count)[:, start:] if shared else None
            span = chunk == list(range(chunk[0], chunk[-1] + 1))
            groups.append(_RowGroup(chunk, span, torch.tensor(chunk), count, view, keys, paths))
    return groups


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
    """Make ``ATTENTION`` and ``ATTENTION_KERNEL`` known to transformers (idempotent): ``rowwise_attention`` and
    ``kernel_attention``, with SDPA's mask format."""
    for name, function in ((ATTENTION, rowwise_attention), (ATTENTION_KERNEL, kernel_attention)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)


def load_kernel(report: Callable[[str], None] | None = None) -> tuple[bool, str]:
    """Load the compiled ``row_attention`` (``medusa_core.lean``, compiling it on a first start with ``report``
    told): ``(True, "")``, or ``(False, why)`` when ``$MEDUSA_LEAN_STEP`` is 0 or it cannot be built here. Where
    the build has AVX512-BF16, also makes its ``int4_matmul`` every ``Int4Linear``'s product (``Int4Linear.kernel``), and
    its sampling calls those of ``NodeProcessors`` and ``acceptance.draw`` (``sampling.h``)."""
    from .lean.build import ENV, enabled, load_extension  # the lean package imports this module

    if not enabled():
        return False, f"the lean step is turned off (${ENV}=0)"
    module, why = load_extension(report)
    if module is None:
        return False, why
    _kernel[:] = [module]
    if module.has_int4_matmul() and Int4Linear.kernel is None:  # every 4-bit layer's product, from now on
        Int4Linear.kernel, Int4Linear.kernel_name = module.int4_matmul, module.int4_kernel()
    NodeProcessors.slice_kernel = module.filter_slice  # sampling's filters and draws on CPU rows, from now on
    NodeProcessors.penalty_kernel = module.penalise_rows
    SAMPLING_KERNELS.update(draw_index=module.draw_index, tree_walk=module.tree_walk)
    return True, ""


def make_batch_invariant(model: nn.Module, *, quantized: bool, report: Callable[[str], None] | None = None) -> nn.Module:
    """Make a CPU causal LM's decoding step batch-invariant, in place; returns the model.

    Selects ``kernel_attention`` where the compiled row attention loads (``load_kernel``: ``report`` is told of a
    first-start compile), else ``rowwise_attention``. Float ``nn.Linear`` layers become ``RowwiseLinear`` (same
    weights) when the decoder's linears are float too (``quantized=False``); with a 4-bit decoder
    (``Int4Linear``, bitsandbytes NF4: batch-invariant kernels already) a float LM head is replaced by
    ``int4_lm_head``: a 4-bit first pass whose top logits each row refines in float32 (a tied
    input embedding keeps its own weights), by the compiled ``refine_top`` where the kernels load.
    """
    register()
    compiled = load_kernel(report)[0]
    model.set_attn_implementation(ATTENTION_KERNEL if compiled else ATTENTION)
    head = model.get_output_embeddings()
    if quantized:
        if type(head) is nn.Linear:
            bias = None if head.bias is None else head.bias.detach()
            model.set_output_embeddings(int4_lm_head(head.weight.detach(), bias))
            model.config.tie_word_embeddings = False
        head = model.get_output_embeddings()
        if compiled and isinstance(head, BF16Linear) and head.refine_top:
            head.refine_kernel = _kernel[0].refine_top  # the top logits refined in one compiled call per pass
        return model
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear:
            model.set_submodule(name, RowwiseLinear.from_linear(module))
    return model
