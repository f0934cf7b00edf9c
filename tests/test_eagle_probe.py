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

from eagle_probe.served import processed, seen_prefixes  # noqa: E402


@pytest.mark.parametrize("scale", [4.0, 0.05])  # sharp rows (top-p decided on the top 64) and flat ones (the fallback)
def test_the_served_distribution_is_hf_generates_processors_in_their_order(scale):
    g = torch.Generator().manual_seed(0)
    n, vocab = 24, 1000
    logits = torch.randn(n, vocab, generator=g) * scale
    ids = torch.randint(0, vocab, (n, 30), generator=g)  # each row's context
    padded = torch.cat([ids, torch.full((n, 5), vocab)], 1)  # ids past the logits: what seen_prefixes pads with
    hf = logits.clone()
    for processor in (RepetitionPenaltyLogitsProcessor(CHAT_PRESET.repetition_penalty),
                      TemperatureLogitsWarper(CHAT_PRESET.temperature), TopPLogitsWarper(CHAT_PRESET.top_p)):
        hf = processor(ids, hf)
    ours = processed(logits, padded, CHAT_PRESET)
    assert torch.allclose(ours, torch.softmax(hf, -1), atol=1e-6)
    assert ((ours > 0) == (hf > -float("inf"))).all()  # the same tokens kept
    if scale < 1:
        assert (torch.softmax(logits / CHAT_PRESET.temperature, -1).topk(64).values.sum(-1) < CHAT_PRESET.top_p).all()


def test_seen_prefixes_give_each_rows_tokens_up_to_the_next_position_as_columns():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 12, (3, 20), generator=g)
    columns = torch.full((12,), -100)
    columns[torch.tensor([3, 5, 7, 0])] = torch.arange(4)  # tokens 3, 5, 7, 0 have columns 0..3; the rest none
    b, s = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 7, 3, 18])
    prefixes = seen_prefixes(x, columns, 4, b, s)
    for row in range(4):
        seen = {int(columns[t]) for t in x[b[row], : s[row] + 2] if columns[t] >= 0}
        assert set(prefixes[row].tolist()) - {4} == seen  # 4: past the 4 columns
        assert (prefixes[row, s[row] + 2 :] == 4).all()
    assert torch.equal(seen_prefixes(x, None, 12, b, s)[:, :2], x[b, :2])  # token ids as the columns


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
