"""GGUF's 4-bit blocks as ``Int4Linear`` groups, without re-quantizing (llama.cpp ``ggml-quants.c`` layouts).

A block holds 32 consecutive weights of one row: Q4_0 = fp16 d, 16 bytes of nibbles, w = d·(q − 8);
Q4_1 = fp16 d, fp16 m, 16 bytes, w = d·q + m. Byte j holds weight j in its low nibble and weight
j + 16 in its high nibble. Both are exactly ``Int4Linear``'s w = (q − 8)·scale + zero with scale = d and
zero = 0 (Q4_0) or m + 8d (Q4_1); the layer keeps scale and zero in bfloat16, which rounds the fp16
d and m to 8 significant bits (a relative change of at most 2⁻⁹, against the 4-bit step of d).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

#: GGUF types whose blocks map onto ``Int4Linear`` as they are.
INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)


def int4_groups(data: np.ndarray, kind: GGMLQuantizationType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and zeros of a GGUF Q4_0 / Q4_1 tensor.

    Args:
        data: [N, K / 32 · block bytes] uint8, the raw blocks of an N × K weight (``ReaderTensor.data``).
        kind: ``GGMLQuantizationType.Q4_0`` or ``Q4_1``.

    Returns:
        (codes [N, K] uint8 in 0..15, scale [N, K / 32] float32, zero [N, K / 32] float32) with
        w = (codes − 8)·scale + zero.

    Raises ``ValueError`` for another type or a byte count that is not whole blocks.
    """
    if kind not in INT4_TYPES:
        raise ValueError(f"int4_groups takes Q4_0 or Q4_1 blocks, not {kind.name}")
    header = 2 if kind == GGMLQuantizationType.Q4_0 else 4  # fp16 d (and fp16 m)
    block = header + 16
    rows, width = data.shape
    if width % block:
        raise ValueError(f"{kind.name} rows must be whole {block}-byte blocks, got {width} bytes")
    blocks = np.ascontiguousarray(data).reshape(rows, width // block, block)  # [N, G, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
    nibbles = blocks[..., header:]  # [N, G, 16]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)  # [N, K]
    if kind == GGMLQuantizationType.Q4_0:
        zero = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero)
