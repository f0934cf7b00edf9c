"""Low-bit linear and embedding layers for the CPU that keep their weights small and are batch-invariant.

Batch-invariant means: row r of an M-row product is bit-for-bit the product of row r alone, for
every M. Greedy Medusa verifies N tree tokens in one pass and must reproduce what one-token
decoding computes at each accepted node, so every op of a decoding step must have this property
(``medusa_core.invariant`` has the attention; ``tests/test_invariance.py`` checks each layer).
Measured on this project's CPU (``../shared/reference/CPU_4BIT.md``), float32 ``F.linear`` is not
batch-invariant (a 1-row product takes a gemv path, several rows a gemm path: 1e-6 apart); these are:

- ``Int4Linear``: torch's ``_weight_int4pack_mm_for_cpu`` (``aten/src/ATen/native/cpu/int4mm_kernel.cpp``):
  4-bit codes q in groups of 32 along the input, w = (q − 8)·scale + zero, bf16 activations, one
  float32 accumulator per output, K never split. GGUF's Q4_0 / Q4_1 blocks map onto it without
  re-quantizing (``medusa_core.quant.gguf_blocks``).
- ``BF16Linear`` / ``BF16Embedding``: bfloat16 weights through oneDNN's AVX512-BF16 matmul (the LM head,
  and the token embedding it is tied to); outputs are cast back to the model's compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: Top logits of each row an LM head recomputes in float32 (``BF16Linear.refine_top``).
LM_HEAD_REFINE = 16
#: Inputs per int4 group (GGUF blocks hold 32 weights; the int4-pack kernel takes 32, 64, 128 or 256).
GROUP_SIZE = 32


class Int4Linear(nn.Module):
    """A bias-optional linear layer with 4-bit weights, run by torch's int4-pack CPU kernel.

    Args:
        codes: [N, K] unsigned 4-bit codes (0..15) in any integer dtype; N output, K input features.
        scale: [N, K // 32] per-group scales; zero: [N, K // 32] per-group zeros, so that
            w[n, k] = (codes[n, k] − 8) · scale[n, k // 32] + zero[n, k // 32]. Stored as bfloat16
            (the kernel's only vectorised dtype).
        bias: [N] or None.

    ``forward(x [..., K]) -> [..., N]`` in x's dtype; x is rounded to bfloat16 first, as bitsandbytes'
    CPU kernel does. Raises ``ValueError`` when K is not a multiple of 32, N not a multiple of 16
    (the kernel's tiles), or the shapes disagree.
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        n, k = codes.shape
        if k % GROUP_SIZE or n % 16:
            raise ValueError(f"int4 weights need in_features % {GROUP_SIZE} == 0 and out_features % 16 == 0, got {n} x {k}")
        if scale.shape != (n, k // GROUP_SIZE) or zero.shape != scale.shape:
            raise ValueError(f"scale and zero must have shape {[n, k // GROUP_SIZE]}, got {list(scale.shape)}, {list(zero.shape)}")
        self.in_features, self.out_features = k, n
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)  # layout depends on the CPU: packed at load, never saved
        self.register_buffer("scale_zero", torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous())  # [K/32, N, 2]
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, K]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP_SIZE, self.scale_zero)  # [M, N]
        out = out.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weights [N, K] as float32 (what the kernel multiplies by; for tests and the heads)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, self.scale_zero).float().T

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=4, group={GROUP_SIZE}"


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
    bf16 top-k, which needs a row's k-th logit to trail its best by more than the bf16 rounding.
    """

    refine_top: int = 0

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
        out = F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)
        if not self.refine_top:
            return out
        flat, rows = x.reshape(-1, self.in_features).float(), out.reshape(-1, self.out_features)  # [M, K], [M, N]
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
