"""The heads' proposal in compiled calls (``draft_heads.h``, built with the lean step): issue 27, item 3.

Each step the heads run once, at the last accepted position, on weights the backbone's pass has just pushed out
of the caches. Through ATen that was a dozen small ops, each product a [1, H] by [H, H] bfloat16 matmul that
pulled its weights from memory at a third of the bandwidth (0.92 ms of an 8.5 ms Medusa step on the demo).
``LeanDrafts`` computes the heads' residual blocks in one call (rows of each product split over torch's threads,
bfloat16 dot products), leaves the projection over the draft vocabulary to the heads' own layer (the int4
kernel), and takes each head's top-k with its log-probabilities in one more call. Drafts only rank tokens and
the backbone verifies each of them, so outputs are unchanged (tests/test_lean_drafts.py); the values differ from
the ATen path's by bfloat16 rounding, and are the same for the same input on the same machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..heads import MedusaHeads, ResBlock
from ..quant.layers import BF16Embedding
from .build import ENV, enabled, load_extension


def unsupported(heads: nn.Module) -> str:
    """Why the compiled proposal cannot run ``heads``, or "" when it can: it covers ``MedusaHeads`` of residual
    blocks on a CPU, their weights (and root weights) in bfloat16."""
    if not isinstance(heads, MedusaHeads):
        return f"the compiled proposal runs MedusaHeads, not {type(heads).__name__}"
    blocks = [block for head in heads.residual_blocks() for block in head]
    tensors = [t for block in blocks if isinstance(block, ResBlock) for t in (block.linear.weight, block.linear.bias)]
    if len(tensors) != 2 * len(blocks):
        return "the heads have blocks other than residual blocks"
    if heads.root_conditioned:
        tensors.append(heads.root_weight)
    if any(t.device.type != "cpu" or t.dtype != torch.bfloat16 for t in tensors):
        return "the compiled proposal runs bfloat16 heads on a CPU"
    return ""


class LeanDrafts:
    """Each head's top-k and log-probabilities from one hidden state, through the compiled kernels.

    Build it with ``for_heads``. ``top(hidden, root, depth, topk, temperatures)`` gives what
    ``StepRunner.candidates`` needs; the heads' weights are read at each call, so training or restricting the
    heads' drafts (``MedusaHeads.restrict_drafts``) afterwards is seen.
    """

    def __init__(self, heads: MedusaHeads, module: Any):
        self.heads = heads
        self.module = module  # the compiled extension (``build.load_extension``)

    @classmethod
    def for_heads(cls, heads: nn.Module, report: Callable[[str], None] | None = None) -> tuple[LeanDrafts | None, str]:
        """``(LeanDrafts, "")`` when the compiled proposal can run ``heads`` here, else ``(None, why)``: heads it
        does not cover (``unsupported``), ``$MEDUSA_LEAN_STEP`` = 0, no extension, or a CPU without a bfloat16
        dot product (AVX512-BF16), where ATen's products are as fast."""
        why = unsupported(heads)
        if why:
            return None, why
        if not enabled():
            return None, f"the compiled kernels are turned off (${ENV}=0)"
        module, why = load_extension(report)
        if module is None:
            return None, why
        if not module.has_bf16_dot():
            return None, "this CPU has no bfloat16 dot product (AVX512-BF16)"
        return cls(heads, module), ""

    def top(
        self, hidden: torch.Tensor, root: torch.Tensor | None, depth: int, topk: int, temperatures: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``depth`` heads' top ``topk`` draft columns at one position (paper 2.1.1).

        Args:
            hidden: [1, H] or [H], the backbone's final-norm hidden state there.
            root: [1] int64, the token chosen after it (read by root-conditioned heads only).
            temperatures: [≥ depth] (or [≥ depth, 1]), each head's calibration temperature T_k > 0.
        Returns:
            (columns [depth, topk] int64 into the draft vocabulary, best first, as ``MedusaHeads.draft_ids``
            maps them; log_p [depth, topk] float32, log_softmax(logits_k / T_k) over the draft vocabulary).
        Raises ``ValueError`` when root-conditioned heads get no ``root`` or ``depth`` exceeds the heads.
        """
        heads = self.heads
        if not 1 <= depth <= heads.num_heads:
            raise ValueError(f"depth must be 1..{heads.num_heads} (the heads), got {depth}")
        table, row, root_weight = torch.empty(0), 0, torch.empty(0)
        if heads.root_conditioned:
            if root is None:
                raise ValueError("root-conditioned Medusa heads need root= (the token chosen after the hidden state)")
            embedding, row, root_weight = heads.root_embedding, int(root.reshape(-1)[0]), heads.root_weight.detach()
            table = embedding.weight.detach()  # its row is read in place: a plain lookup table in bfloat16
            if type(embedding) not in (nn.Embedding, BF16Embedding) or table.dtype != torch.bfloat16:
                table, row = embedding(root.reshape(1)).to(torch.bfloat16), 0  # [1, H]: whatever the module computes
        blocks = [block for head in heads.residual_blocks(depth) for block in head]
        states = self.module.head_states(
            hidden.reshape(-1).float().contiguous(), table, row, root_weight,
            [b.linear.weight.detach() for b in blocks], [b.linear.bias.detach() for b in blocks], depth,
        )  # [depth, H] bfloat16
        logits = heads.project_drafts(states)  # [depth, S]
        return self.module.draft_top(logits, topk, temperatures.reshape(-1)[:depth])
