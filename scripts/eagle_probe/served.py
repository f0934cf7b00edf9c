"""The backbone's served distribution for the drafter probe: what exact sampling at the app's chat settings accepts a
point-mass draft with (``scripts/probe_eagle.py``'s held-out figures and its ``--teacher`` loss), through the app's
own processors (``medusa_core.processors.NodeProcessors``)."""

import torch

from medusa_core.processors import NodeProcessors


def seen_prefixes(x: torch.Tensor, columns: torch.Tensor | None, width: int, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[n, W] (int64): for each row i, sequence ``b[i]`` of ``x`` [B, W]'s tokens up to position ``s[i]`` + 1 as
    columns of logits ``width`` wide (``columns`` [V] maps a token id to its column, -100: none; None: the id is the
    column), ``width`` elsewhere (past the logits: the repetition penalty leaves it alone)."""
    col = columns[x] if columns is not None else x
    col = torch.where(col >= 0, col, width)
    return torch.where(torch.arange(x.shape[1], device=x.device) <= (s + 1)[:, None], col[b], width)


def processed(logits: torch.Tensor, prefixes: torch.Tensor, config) -> torch.Tensor:
    """The served distribution [n, C] of ``logits`` [n, C] (float32) given each row's ``prefixes`` [n, L] (the ids the
    repetition penalty reads; ids ≥ C change nothing): softmax of ``NodeProcessors(config)``'s scores, equal to HF
    ``generate``'s processors in their order; the rows sum to 1."""
    return torch.softmax(NodeProcessors(config)(logits, prefixes), -1)
