"""Training positions (paper 2.2.1): the frozen backbone's hidden states and each head's target token.

Head k at position t is trained to predict the token at t+k+2; only reply tokens are targets.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterable

import torch
from tqdm import tqdm

@torch.no_grad()
def collect_positions(
    backbone, rows: Iterable[dict], num_heads: int, *, bf16: bool = False, batch_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-norm hidden states of the frozen backbone and each head's target at every reply position.

    For a sequence ``prompt + reply`` of length T, the positions used are ``t = len(prompt)-1 .. T-2``;
    head k's label at t is the token at ``t+k+2`` when that token belongs to the reply, else -100.

    Returns (hidden [M, H] float16 on CPU, labels [M, K] int64).
    """
    decoder = backbone.get_decoder()
    device = next(backbone.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    rows = sorted(rows, key=lambda r: len(r["prompt_ids"]) + len(r["reply_ids"]))
    hidden_parts, label_parts = [], []
    for start in tqdm(range(0, len(rows), batch_size), desc="hidden states", unit="batch"):
        batch = rows[start : start + batch_size]
        seqs = [r["prompt_ids"] + r["reply_ids"] for r in batch]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for n, s in enumerate(seqs):
            ids[n, : len(s)] = torch.tensor(s)  # right padding: causal attention never sees it
        with autocast:
            hidden = decoder(input_ids=ids.to(device)).last_hidden_state.float().cpu()  # [B, W, H]
        for n, (r, s) in enumerate(zip(batch, seqs)):
            p, t_len = len(r["prompt_ids"]), len(s)
            if t_len - p < 2:
                continue
            positions = torch.arange(p - 1, t_len - 1)
            seq = torch.tensor(s)
            labels = torch.full((len(positions), num_heads), -100, dtype=torch.long)
            for k in range(num_heads):
                target = positions + k + 2
                ok = target < t_len
                labels[ok, k] = seq[target[ok]]
            hidden_parts.append(hidden[n, positions].to(torch.float16))
            label_parts.append(labels)
    return torch.cat(hidden_parts), torch.cat(label_parts)
