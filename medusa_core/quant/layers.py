"""Low-bit linear and embedding layers for the CPU that keep their weights small and are batch-invariant.

Batch-invariant means: row r of an M-row product is bit-for-bit the product of row r alone, for
every M. Greedy Medusa verifies N tree tokens in one pass and must reproduce what one-token
decoding computes at each accepted node, so every op of a decoding step must have this property
(``medusa_core.invariant`` has the attention; ``tests/test_invariance.py`` checks each layer).
Measured on this project's CPU (``../shared/reference/CPU_4BIT.md``), float32 ``F.linear`` is not
batch-invariant (a 1-row product takes a gemv path, several rows a gemm path: 1e-6 apart); these are:

- ``Int4Linear``: 4-bit codes q in groups of 32 along the input, w = (q − 8)·scale + zero, bf16
  activations, one float32 accumulator per output, K never split: the compiled ``int4_matmul``
  (``medusa_core/lean/int4_matmul.h``, AVX512-BF16 dot products) where it loads, else torch's
  ``_weight_int4pack_mm_for_cpu`` (``aten/src/ATen/native/cpu/int4mm_kernel.cpp``). GGUF's Q4_0 / Q4_1
  blocks map onto it without re-quantizing (``medusa_core.quant.gguf_blocks``).
- ``BF16Linear`` / ``BF16Embedding``: bfloat16 weights through oneDNN's AVX512-BF16 matmul (the LM head,
  and the token embedding it is tied to); outputs are cast back to the model's compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: Top logits of each row an LM head recomputes in float32 (``BF16Linear.refine_top``).
LM_HEAD_REFINE = 16
#: Inputs per int4 group (GGUF blocks hold 32 weights; the int4-pack kernel takes 32, 64, 128 or 256).
GROUP_SIZE = 32


class Int4Linear(nn.Module):
    """A bias-optional linear layer with 4-bit weights, for the CPU.

    Args:
        codes: [N, K] unsigned 4-bit codes (0..15) in any integer dtype; N output, K input features.
        scale: [N, K // 32] per-group scales; zero: [N, K // 32] per-group zeros, so that
            w[n, k] = (codes[n, k] − 8) · scale[n, k // 32] + zero[n, k // 32]. Stored as bfloat16.
        bias: [N] or None.

    The weights are kept as ``int4_tiles`` (``tiles`` [N/16, K/32, 320] uint8: codes, scales and zeros).
    ``forward(x [..., K]) -> [..., N]`` in x's dtype; x is rounded to bfloat16
    first, as bitsandbytes' CPU kernel does. The product is ``Int4Linear.kernel`` (the compiled ``int4_matmul`` of
    ``medusa_core.lean``, on AMX tiles or AVX512-BF16 dot products, which ``invariant.load_kernel`` installs for the process) or, where
    that is not loaded, torch's int4-pack kernel, whose CPU-specific packing is then made on the first pass.
    Both are batch-invariant. Raises ``ValueError`` when K is not a multiple of 32, N not a multiple of 16
    (the kernels' tiles), or the shapes disagree.
    """

    #: The compiled product ``kernel(x [M, K] bfloat16, tiles) -> [M, N] bfloat16``, or None for
    #: torch's int4-pack kernel. One choice per process, made when the lean extension loads (before a model's
    #: first pass: the two kernels round differently, and a conversation's cached keys must come from one).
    kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    #: Which product runs: ``"amx"`` (the compiled product on AMX tiles), ``"avx512-bf16"`` (on AVX512-BF16 dot
    #: products) or ``"torch"`` (the int4-pack kernel); set with ``kernel``.
    kernel_name: str = "torch"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        n, k = codes.shape
        if k % GROUP_SIZE or n % 16:
            raise ValueError(f"int4 weights need in_features % {GROUP_SIZE} == 0 and out_features % 16 == 0, got {n} x {k}")
        if scale.shape != (n, k // GROUP_SIZE) or zero.shape != scale.shape:
            raise ValueError(f"scale and zero must have shape {[n, k // GROUP_SIZE]}, got {list(scale.shape)}, {list(zero.shape)}")
        self.in_features, self.out_features = k, n
        self.register_buffer("tiles", int4_tiles(codes, scale, zero))
        self._int4pack: tuple[torch.Tensor, torch.Tensor] | None = None  # torch's layout, made when first needed
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [M, K]
        if Int4Linear.kernel is not None:
            out = Int4Linear.kernel(flat, self.tiles)  # [M, N]
        else:
            packed, scale_zero = self.int4pack()
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, GROUP_SIZE, scale_zero)
        out = out.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [N, K] uint8, scale [N, K/32] bfloat16, zero [N, K/32] bfloat16) back from the tiles."""
        records = _block_major(self.tiles)  # [N/16, K/32, 320]
        blocks, groups = records.shape[:2]
        code_bytes = records[..., :256].reshape(blocks, groups, 8, 32)
        nibbles = torch.stack([code_bytes & 15, code_bytes >> 4], -1).reshape(blocks, groups, 8, 16, 2, 2)  # [b, g, c, j, s, h]
        codes = nibbles.permute(0, 3, 1, 2, 5, 4).reshape(self.out_features, self.in_features)  # k = 32g + 4c + 2h + s
        scales = records[..., 256:].contiguous().view(torch.bfloat16).reshape(blocks, groups, 2, 16)
        scale, zero = scales.permute(2, 0, 3, 1).reshape(2, self.out_features, groups)
        return codes, scale, zero

    def int4pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's int4-pack weights (packed [N, K/2] uint8 in the CPU's tile order, scale_zero [K/32, N, 2]
        bfloat16), made on the first call (the layout depends on the CPU: never saved)."""
        if self._int4pack is None:
            codes, scale, zero = self.groups()
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            self._int4pack = packed, torch.stack([scale.T, zero.T], dim=-1).contiguous()
        return self._int4pack

    def kernel_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The two weight tensors the product in use reads: (tiles, an empty tensor: the scales are in the tiles), or
        torch's ``int4pack()``."""
        return (self.tiles, torch.empty(0)) if Int4Linear.kernel is not None else self.int4pack()

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = 4096) -> "Int4Linear":
        """4-bit weights of a float ``weight`` [N, K]: per group of 32 inputs, min–max codes 0..15 (as
        GGUF's Q4_1: scale = (max − min) / 15, w ≈ codes · scale + min), quantized ``rows`` rows at a time
        to keep float temporaries small. Raises ``ValueError`` as the constructor does."""
        n, k = weight.shape
        if k % GROUP_SIZE:
            raise ValueError(f"int4 weights need in_features % {GROUP_SIZE} == 0, got {n} x {k}")
        codes = torch.empty(n, k, dtype=torch.uint8)
        scale, low = torch.empty(n, k // GROUP_SIZE), torch.empty(n, k // GROUP_SIZE)
        for start in range(0, n, rows):
            g = weight[start : start + rows].float().reshape(-1, k // GROUP_SIZE, GROUP_SIZE)  # [r, K/32, 32]
            lo, hi = g.amin(-1), g.amax(-1)
            step = ((hi - lo) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny)  # a constant group: any step
            codes[start : start + rows] = ((g - lo[..., None]) / step[..., None]).round_().clamp_(0, 15).reshape(-1, k)
            scale[start : start + rows], low[start : start + rows] = step, lo
        return cls(codes, scale, low + 8 * scale, bias)

    def dequantized(self) -> torch.Tensor:
        """The weights [N, K] as float32: (codes − 8)·scale + zero, what both kernels multiply by (for tests and the heads)."""
        codes, scale, zero = self.groups()
        return (codes.float() - 8) * scale.float().repeat_interleave(GROUP_SIZE, 1) + zero.float().repeat_interleave(GROUP_SIZE, 1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=4, group={GROUP_SIZE}"


def int4_tiles(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """4-bit weights in the compiled ``int4_matmul``'s layout (``medusa_core/lean/int4_matmul.h``).

    Args: codes [N, K] (0..15), scale and zero [N, K/32], N % 16 == 0 and K % 32 == 0 (``Int4Linear`` checks).
    Returns: tiles [N/16, K/32, 320] uint8, one 320-byte record per block of 16 outputs and group of 32 inputs: 256
    bytes of codes [8, 32] — for chunk c and output j, byte 2j + s holds the code of input 32g + 4c + s in its low
    nibble and of 32g + 4c + 2 + s in its high one — then the 16 outputs' scales and their 16 zeros (bfloat16 bytes).
    The records are stored pair-major (``_pair_major``): blocks 2p and 2p + 1 group by group, so that the kernel reads
    a pair as one stream; ``tiles[b]`` is therefore block b's records only for a layer of one block.
    """
    n, k = codes.shape
    blocks, groups = n // 16, k // GROUP_SIZE
    nibbles = codes.to(torch.uint8).reshape(blocks, 16, groups, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)  # [b, g, c, j, s, h]
    code_bytes = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(blocks, groups, 256)
    scales = torch.stack([scale, zero]).to(torch.bfloat16).reshape(2, blocks, 16, groups).permute(1, 3, 0, 2)  # [b, g, 2, 16]
    records = torch.cat([code_bytes, scales.contiguous().view(torch.uint8).reshape(blocks, groups, 64)], -1)
    return _pair_major(records)


def _pair_major(records: torch.Tensor) -> torch.Tensor:
    """Block-major records [B, G, 320] -> the same shape stored pair-major: for each pair of blocks (2p, 2p + 1) its
    groups in order, each group the pair's two records; an unpaired last block's records after them."""
    blocks, groups, width = records.shape
    paired = blocks - blocks % 2
    pairs = records[:paired].reshape(paired // 2, 2, groups, width).transpose(1, 2).reshape(paired, groups, width)
    return torch.cat([pairs, records[paired:]]).contiguous()


def _block_major(tiles: torch.Tensor) -> torch.Tensor:
    """``_pair_major``'s inverse: records [B, G, 320] indexed by block."""
    blocks, groups, width = tiles.shape
    paired = blocks - blocks % 2
    pairs = tiles[:paired].reshape(paired // 2, groups, 2, width).transpose(1, 2).reshape(paired, groups, width)
    return torch.cat([pairs, tiles[paired:]])


class BF16Linear(nn.Linear):
    """``nn.Linear`` with bfloat16 weights whose output comes back in the input's dtype.

    ``forward(x [..., K]) -> [..., N]``: x rounded to bfloat16, one oneDNN bf16 matmul (float32
    accumulation, result rounded to bfloat16), cast to x's dtype. Batch-invariant on CPUs with
    AVX512-BF16 (``tests/test_invariance.py``). Build it with ``from_weight``.

    With ``refine_top = k > 0`` (LM heads) the k largest outputs of each row are recomputed from the
    float input and the weights in float32 (one small batched product per row): bfloat16 rounds a
    logit of 25 to steps of 0.125, which ties or swaps the top tokens of close calls (on the demo,
    "The" and "L'" as the first token of "What is the capital of France?"); the refined top-k are
    the float32 products of the bf16-stored weights. The argmax is exact whenever it lies in the
    coarse top-k, which needs a row's k-th logit to trail its best by more than the coarse error.

    With a ``coarse`` layer (``lm_head``: an ``Int4Linear`` copy of the weights) the first pass runs
    from 4-bit weights instead of bfloat16 ones: an LM head reads its whole [V, H] weight every step
    (the demo's is 56 MB in bfloat16, as much as all its 4-bit decoder layers together), and the
    refinement still gives the top-k their float32 values. Passes that need gradients (training the
    heads through the shared LM head) take the bfloat16 product: the int4 kernel has no backward.
    """

    refine_top: int = 0
    #: The compiled refinement (``medusa_core.lean`` ``refine_top``: the same k values, each a fixed-order float32 sum,
    #: in one call instead of a top-k and a gemv per row), set by ``invariant.make_batch_invariant`` where it builds.
    refine_kernel: Callable[..., None] | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.coarse: nn.Module | None = None  # a submodule slot (a class attribute would hide the module)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, refine_top: int = 0) -> "BF16Linear":
        """A layer holding ``weight`` [N, K] (converted to bfloat16; shared, not copied, if it already is)."""
        layer = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)
        layer.refine_top = refine_top
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.coarse is not None and not (torch.is_grad_enabled() and x.requires_grad):
            out = self.coarse(x)
        else:
            out = F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)
        if not self.refine_top:
            return out
        flat, rows = x.reshape(-1, self.in_features).float(), out.reshape(-1, self.out_features)  # [M, K], [M, N]
        if self.refine_kernel is not None and rows.dtype == torch.float32 and not torch.is_grad_enabled():
            bias = self.bias if self.bias is not None else rows.new_empty(0, dtype=torch.bfloat16)
            self.refine_kernel(rows, self.weight, flat.contiguous(), bias, self.refine_top)  # in place
            return rows.reshape(out.shape)
        top = rows.topk(self.refine_top, dim=-1).indices  # [M, k]
        # one float32 gemv per row, the same call whatever M (a batched product would not be batch-invariant)
        exact = torch.stack([torch.mv(self.weight[t].float(), h) for t, h in zip(top, flat)])  # [M, k]
        if self.bias is not None:
            exact = exact + self.bias[top].float()
        return rows.scatter(-1, top, exact.to(rows.dtype)).reshape(out.shape)


class BF16Embedding(nn.Embedding):
    """``nn.Embedding`` with bfloat16 weights that returns ``out_dtype`` (the model's compute dtype).

    Lets the token embedding share one bfloat16 tensor with a tied ``BF16Linear`` LM head.
    ``forward(ids [...]) -> [..., H]``.
    """

    @classmethod
    def from_weight(cls, weight: torch.Tensor, out_dtype: torch.dtype, padding_idx: int | None = None) -> "BF16Embedding":
        """An embedding holding ``weight`` [V, H] (converted to bfloat16; shared if it already is)."""
        layer = cls(weight.shape[0], weight.shape[1], padding_idx=padding_idx, device="meta")
        layer.weight = nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
        layer.out_dtype = out_dtype
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).to(self.out_dtype)


def int4_lm_head(weight: torch.Tensor, bias: torch.Tensor | None = None) -> BF16Linear:
    """The LM head of a 4-bit CPU backbone: a 4-bit first pass (``Int4Linear.quantize`` of ``weight`` [V, H]),
    then each row's top ``LM_HEAD_REFINE`` logits recomputed in float32 from the bfloat16 weights (shared
    with a tied embedding when ``weight`` already is bfloat16). Batch-invariant: both passes are. A shape
    the int4 kernel does not tile (V % 16 or H % 32) keeps the bfloat16 first pass."""
    layer = BF16Linear.from_weight(weight, bias, refine_top=LM_HEAD_REFINE)
    try:
        layer.coarse = Int4Linear.quantize(layer.weight, None if bias is None else layer.bias)
    except ValueError:
        pass  # untiled shape: the bfloat16 product, as documented
    return layer
