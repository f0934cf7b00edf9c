"""Greedy tokens of a float32 LM head at bfloat16 cost, with the float32 argmax.

On CPUs with native bfloat16 matmuls, a float32 LM head is the costliest part of a verification
step after the decoder (SmolLM2: 49,152 × 576; 20–40 ms for 2–17 rows in float32, 5–8 ms in
bfloat16; docs/BENCH.md). Greedy decoding only needs each row's argmax, so ``GreedyHead`` computes
the logits in bfloat16, bounds their error, and settles in float32 only the tokens that could still
be the row's maximum. The result is the argmax of the float32 logits, not of the bfloat16 ones: a
bfloat16 LM head would change greedy replies.

Error bound (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1–3.5): with
unit roundoff u = 2⁻⁸ for bfloat16, rounding h and W to bfloat16, accumulating the products in
float32 (H·2⁻²⁴ ≤ 2⁻¹⁰ relative for H ≤ 16,384) and rounding the result to bfloat16 give
``|z_j − z̃_j| ≤ (3u + 2⁻¹⁰ + O(u²)) · Σ_i |h_i W_ji| ≤ 2⁻⁶ · ‖h‖₂ · ‖W_j‖₂`` (Cauchy–Schwarz).
With ``b = 2⁻⁶ · ‖h‖ · max_j ‖W_j‖`` every token whose float32 logit can be the largest has
``z̃_j ≥ max_k z̃_k − 2b``; those are recomputed in float32 and the largest wins (the first on ties,
as ``argmax``). The float32 values are dot products over the same hidden state, so they agree with
a float32 ``F.linear`` up to float32 summation order, as a tree pass over N tokens already does with
a one-token pass.
"""

from __future__ import annotations

import torch
from torch import nn

#: Relative error bound of a bfloat16 dot product against the exact one, in units of Σ|h_i W_ji|.
REL_ERROR = 2.0**-6


class GreedyHead:
    """Exact greedy argmax of a bias-free float32 ``nn.Linear`` LM head, at bfloat16 cost.

    Args:
        lm_head: the backbone's output projection, weight [V, H] in float32, no bias.

    Holds a bfloat16 copy of the weight (V·H·2 bytes: 57 MB for SmolLM2) and its row norms.
    Raises ``ValueError`` for a head with a bias or a weight that is not float32.
    """

    def __init__(self, lm_head: nn.Linear):
        weight = lm_head.weight
        if lm_head.bias is not None or weight.dtype != torch.float32:
            raise ValueError(f"GreedyHead needs a bias-free float32 linear LM head, got {lm_head!r} in {weight.dtype}")
        self.weight = weight  # [V, H] float32, shared with the backbone
        self.low = weight.detach().to(torch.bfloat16)  # [V, H]
        self.max_norm = float(weight.detach().norm(dim=1).max())

    @staticmethod
    def suits(lm_head: nn.Module, device: torch.device) -> bool:
        """True when ``GreedyHead`` applies and pays: a bias-free float32 ``nn.Linear`` on a CPU with
        native bfloat16 matmuls."""
        return (
            type(lm_head) is nn.Linear
            and lm_head.bias is None
            and lm_head.weight.dtype == torch.float32
            and device.type == "cpu"
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Argmax over the vocabulary of ``hidden @ weight.T`` in float32.

        Args:
            hidden: [N, H] float32 final-norm hidden states.
        Returns:
            [N] int64 token ids.
        """
        approx = nn.functional.linear(hidden.to(torch.bfloat16), self.low).float()  # [N, V]
        bound = REL_ERROR * hidden.norm(dim=1, keepdim=True) * self.max_norm  # [N, 1]
        contenders = approx >= approx.max(dim=1, keepdim=True).values - 2 * bound  # [N, V]
        rows, cols = contenders.nonzero(as_tuple=True)  # [K] each; usually a few per row
        exact = (hidden[rows] * self.weight[cols]).sum(dim=-1)  # [K] float32
        scores = torch.full_like(approx, float("-inf"))
        scores[rows, cols] = exact
        return scores.argmax(dim=1)
