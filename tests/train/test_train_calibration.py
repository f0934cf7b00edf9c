"""What ships beside trained heads: the replayed acceleration of greedy steps, each head's fitted temperature
(temperature scaling, Guo et al. 2017), the draft ranking."""

import json

import pytest

import torch

from medusa_core.train import (HeadTrainingConfig, accuracy_from_ranks, collect_positions, fit_temperature,
                               head_temperatures, rank_accuracy, simulated_acceleration, target_ranks, train_heads)

from .support import distilled_rows


def test_simulated_acceleration_replays_greedy_steps_on_each_reply():
    # reply A: 5 tokens (positions 0..4), reply B: 3 tokens; two heads; tree [0], [0, 0], [1]
    labels = torch.full((8, 2), 7)
    for last, n in ((4, 5), (7, 3)):
        for j in range(n):
            for k in range(2):
                if j + k + 1 >= n:
                    labels[last - n + 1 + j, k] = -100
    ranks = torch.where(labels == -100, -1, 3)
    ranks[0] = torch.tensor([0, 0])  # A: step from token 0 accepts 2 -> tokens 0..3 known
    ranks[3, 0] = 1  # A: step from token 3 accepts [1] -> done; 1 prefill + 2 steps for 5 tokens
    ranks[5] = torch.tensor([2, 0])  # B: step from token 0 accepts nothing
    ranks[6, 0] = 0  # B: step from token 1 accepts [0] -> done; 1 prefill + 2 steps for 3 tokens
    assert simulated_acceleration(ranks, labels, [[0], [0, 0], [1]]) == 8 / 6
    assert simulated_acceleration(ranks, labels, []) == 1.0  # plain decoding: one token per step
    with pytest.raises(ValueError, match="3 deep, the heads give 2 ranks"):
        simulated_acceleration(ranks, labels, [[0], [0, 0], [0, 0, 0]])


def test_simulated_acceleration_equals_the_engines_greedy_decoding(tmp_path):
    from medusa_core import MedusaModel
    from medusa_core.trees import dense_tree

    backbone, tok, rows = distilled_rows(tmp_path, n=8)
    hidden, labels = collect_positions(backbone, rows, num_heads=3)
    cfg = HeadTrainingConfig(num_heads=3, epochs=30, batch_size=32, warmup_steps=1, lr=1e-2, checkpoint_every=0, bf16=False)
    heads, _ = train_heads(backbone, hidden, labels, tmp_path / "heads", cfg, base_model_name_or_path="base")
    model = MedusaModel(backbone, heads)
    paths = dense_tree([3, 2, 2])
    replies, tokens, steps = [], 0, 0
    for r in rows:
        ids = torch.tensor([r["prompt_ids"]])
        plain = [t for rec in model.generate(ids, max_new_tokens=24, medusa=False) for t in rec.token_ids]
        recs = list(model.generate(ids, max_new_tokens=24, tree=paths))
        assert [t for rec in recs for t in rec.token_ids] == plain
        replies.append({"prompt_ids": r["prompt_ids"], "reply_ids": plain})
        tokens, steps = tokens + len(plain), steps + len(recs)
    hidden, labels = collect_positions(backbone, replies, num_heads=3)
    ranks = target_ranks(heads, hidden, labels)
    assert simulated_acceleration(ranks, labels, paths) == pytest.approx(tokens / steps, abs=1e-12)
    assert tokens / steps > 1.5  # the heads are right often enough for the replay to mean something
    assert accuracy_from_ranks(ranks) == rank_accuracy(heads, hidden, labels)


def _sampled_at_temperature(temperature: float, m: int = 20000, v: int = 30, seed: int = 0):
    """Logits [m, v] and targets [m] drawn from softmax(logits / temperature): data whose best temperature is known."""
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(m, v, generator=g)
    targets = torch.multinomial((logits / temperature).softmax(-1), 1, generator=g)[:, 0]
    return logits, targets


def _nll(logits, targets, temperature):
    return torch.nn.functional.cross_entropy(logits / temperature, targets).item()


@pytest.mark.parametrize("true_temperature", [0.6, 1.0, 2.5])
def test_fit_temperature_recovers_the_temperature_the_targets_were_drawn_at(true_temperature):
    logits, targets = _sampled_at_temperature(true_temperature)
    assert fit_temperature(logits, targets, chunk=4096) == pytest.approx(true_temperature, rel=0.05)


def test_the_fitted_temperature_minimises_the_negative_log_likelihood():
    logits, targets = _sampled_at_temperature(1.7, m=3000, seed=1)
    t = fit_temperature(logits.to(torch.bfloat16), targets)
    for other in (0.9 * t, 1.1 * t, 1.0):
        assert _nll(logits, targets, t) < _nll(logits, targets, other)


def test_fit_temperature_refuses_empty_or_mismatched_input_naming_the_shapes():
    with pytest.raises(ValueError, match=r"logits \[M, V\] and targets \[M\], got \[0, 5\] and \[0\]"):
        fit_temperature(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"got \[3, 5\] and \[2\]"):
        fit_temperature(torch.zeros(3, 5), torch.zeros(2, dtype=torch.long))


def test_head_temperatures_fit_each_head_on_its_own_targets_and_skip_positions_without_one():
    class Scaled(torch.nn.Module):
        """Head k's logits are the fixed ``logits`` times ``scale[k]``."""

        num_heads = 2

        def __init__(self, logits, scale):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.logits, self.scale = logits, scale

        def forward(self, h):
            rows = h[:, 0].long()  # the hidden state holds the row's index
            return torch.stack([self.logits[rows] * s for s in self.scale])

    logits, targets = _sampled_at_temperature(1.0, m=6000, seed=2)
    hidden = torch.arange(6000, dtype=torch.float32)[:, None].expand(6000, 4)
    labels = torch.stack([targets, torch.where(torch.arange(6000) % 3 == 0, -100, targets)], dim=1)  # [M, K]
    fitted = head_temperatures(Scaled(logits, (2.0, 0.5)), hidden, labels, batch_size=1000)
    # head 0 is twice too sharp (best T 2.0), head 1 twice too flat (best T 0.5)
    assert fitted == pytest.approx([2.0, 0.5], rel=0.06)
    assert head_temperatures(Scaled(logits, (2.0, 0.5)), hidden, labels, max_positions=500)[1] == pytest.approx(0.5, rel=0.25)


def test_a_draft_ranking_lists_reply_tokens_most_frequent_first_and_is_read_back_by_loading(tmp_path):
    from medusa_core.heads import DRAFT_RANKING_FILE
    from medusa_core.train.ranking import rank_tokens, write_ranking

    ranked = rank_tokens([[7, 3, 7, 9], [3, 7], [12]])
    assert ranked == [7, 3, 9, 12]  # 7 thrice, 3 twice, then the ties by id
    path = write_ranking(tmp_path, ranked, "three replies")
    assert path.name == DRAFT_RANKING_FILE and json.loads(path.read_text())["ranked_ids"] == ranked
    with pytest.raises(ValueError, match="no reply tokens"):
        rank_tokens([[], []])
