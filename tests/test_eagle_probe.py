"""The drafter probe's served distribution (scripts/eagle_probe/served.py): what its held-out figures and its
``--teacher`` loss measure drafts against must be HF ``generate``'s processed distribution."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper

from medusa_core.processors import CHAT_PRESET

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from eagle_probe.served import first_seen, processed  # noqa: E402


@pytest.mark.parametrize("scale", [4.0, 0.05])  # sharp rows (top-p decided on the top 64) and flat ones (the fallback)
def test_the_served_distribution_is_hf_generates_processors_in_their_order(scale):
    g = torch.Generator().manual_seed(0)
    n, vocab = 24, 1000
    logits = torch.randn(n, vocab, generator=g) * scale
    ids = torch.randint(0, vocab, (n, 30), generator=g)  # each row's context
    seen = torch.zeros(n, vocab, dtype=torch.bool).scatter_(1, ids, True)
    hf = logits.clone()
    for processor in (RepetitionPenaltyLogitsProcessor(CHAT_PRESET.repetition_penalty),
                      TemperatureLogitsWarper(CHAT_PRESET.temperature), TopPLogitsWarper(CHAT_PRESET.top_p)):
        hf = processor(ids, hf)
    ours = processed(logits, seen, CHAT_PRESET)
    assert torch.allclose(ours, torch.softmax(hf, -1), atol=1e-6)
    assert ((ours > 0) == (hf > -float("inf"))).all()  # the same tokens kept
    if scale < 1:
        assert (torch.softmax(logits / CHAT_PRESET.temperature, -1).topk(64).values.sum(-1) < CHAT_PRESET.top_p).all()


def test_first_seen_gives_each_columns_first_position_in_each_sequence():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 12, (3, 20), generator=g)
    columns = torch.full((12,), -100)
    columns[torch.tensor([3, 5, 7, 0])] = torch.arange(4)  # tokens 3, 5, 7, 0 have columns 0..3; the rest none
    first = first_seen(x, columns, 4)
    for b in range(3):
        for token, column in ((3, 0), (5, 1), (7, 2), (0, 3)):
            where = (x[b] == token).nonzero()
            assert first[b, column] == (int(where[0]) if len(where) else 20)
    assert torch.equal(first_seen(x, None, 12)[:, 7], first[:, 2])  # token ids as the columns


def test_a_fused_drafter_starts_as_the_drafter_of_the_last_state():
    from types import SimpleNamespace

    from eagle_probe.drafter import Drafter

    cfg = SimpleNamespace(hidden_size=16, num_attention_heads=2, intermediate_size=32, rms_norm_eps=1e-5, rope_theta=1e4)
    torch.manual_seed(0)
    alone, fused = Drafter(cfg), Drafter(cfg, 3)
    missing, unexpected = fused.load_state_dict(alone.state_dict(), strict=False)  # probe_eagle.py --init
    assert not unexpected and missing and all(k.startswith("fuse") for k in missing)
    states = torch.randn(2, 5, 3, 16) * torch.tensor([3000.0, 10000.0, 1.0])[:, None]  # two residual states, the last
    emb = torch.randn(2, 5, 16)
    assert torch.equal(fused.fused(states), states[:, :, -1])
    torch.testing.assert_close(fused(fused.fused(states), emb)[0], alone(states[:, :, -1], emb)[0])
