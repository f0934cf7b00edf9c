"""The backbone's served distribution for the drafter probe: what exact sampling at the app's chat settings accepts a
point-mass draft with (``scripts/probe_eagle.py``'s held-out figures and its ``--teacher`` loss)."""

import torch


def processed(logits: torch.Tensor, seen: torch.Tensor, config, top: int = 64) -> torch.Tensor:
    """The served distribution [n, C] over the columns of ``logits`` [n, C] (float32): HF ``generate``'s processors in
    their order -- the repetition penalty on the ``seen`` [n, C] (bool) columns, the temperature, top-p (each row's most
    likely token always kept) -- with ``config``'s values (a ``medusa_core.SamplingConfig`` at temperature > 0, top-k
    and min-p off). Top-p is decided on each row's ``top`` most likely tokens, and on all of them where those hold less
    than top-p (as the app's filters do); the rows sum to 1."""
    pen = config.repetition_penalty
    logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits) / config.temperature
    vals, order = logits.topk(min(top, logits.shape[-1]), -1)
    probs = torch.exp(vals - torch.logsumexp(logits, -1, keepdim=True))
    short = probs.sum(-1) < config.top_p
    probs = torch.where(probs.cumsum(-1) - probs < config.top_p, probs, torch.zeros_like(probs))  # the mass before each
    out = torch.zeros_like(logits).scatter_(-1, order, probs / probs.sum(-1, keepdim=True))
    if short.any():  # the filter over every column of those rows
        full, full_order = torch.softmax(logits[short], -1).sort(-1, descending=True)
        full = torch.where(full.cumsum(-1) - full < config.top_p, full, torch.zeros_like(full))
        out[short] = torch.zeros_like(full).scatter_(-1, full_order, full / full.sum(-1, keepdim=True))
    return out


def first_seen(x: torch.Tensor, columns: torch.Tensor | None, width: int) -> torch.Tensor:
    """[B, width] (int64): each sequence of ``x`` [B, W]'s first position of each column's token, or W where it never
    occurs. ``columns`` [V] maps a token id to its column (-100: none), None: the token id is the column."""
    B, W = x.shape
    col = columns[x] if columns is not None else x
    pos = torch.where(col >= 0, torch.arange(W, device=x.device).expand(B, W), W)
    first = torch.full((B, width), W, dtype=torch.long, device=x.device)
    return first.scatter_reduce_(1, col.clamp(min=0), pos, "amin")  # a token without a column: W at column 0
