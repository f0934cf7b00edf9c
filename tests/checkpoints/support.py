"""What the checkpoint tests share: the head count, heads fp16 holds exactly, comparing heads, loading a folder on the CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from medusa_core import MedusaHeads, MedusaModel, load_medusa_model

HEADS = 4


def fp16_exact(heads: MedusaHeads) -> MedusaHeads:
    """Round ``heads`` to values fp16 holds exactly, so a round trip through fp16 files is lossless."""
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(p.half().float())
    return heads


def assert_same_heads(loaded: torch.nn.Module, original: torch.nn.Module) -> None:
    got, want = loaded.state_dict(), original.state_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key].float(), want[key].float()), key


def load(folder: Path, **kwargs) -> MedusaModel:
    return load_medusa_model(folder, quantization=None, device="cpu", head_dtype=torch.float32, **kwargs)


def generated(model: MedusaModel, input_ids, **kwargs) -> list[int]:
    """Every token id a reply of ``model.generate(input_ids, **kwargs)`` adds, in order."""
    return [t for r in model.generate(input_ids, **kwargs) for t in r.token_ids]
