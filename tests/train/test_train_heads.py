"""Head training on tiny models (paper 2.2.1): positions from distilled replies (cached and extended), the heads' loss,
training that lowers it, a resumed run, rank accuracy and the calibrated tree (paper 2.3.3), the command line."""

import json

import pytest

import torch
from safetensors.torch import load_file

from medusa_core import MedusaHeads, load_medusa_model, optimal_tree
from medusa_core.train import (HeadTrainingConfig, cached_positions, calibration, collect_positions, head_loss, main,
                               rank_accuracy, train_heads)
from tiny_models import write_tiny_medusa

from .support import distilled_rows


def test_collect_positions_labels_are_the_reply_tokens_k_plus_2_ahead(tmp_path):
    backbone, _, rows = distilled_rows(tmp_path, n=1)
    row = rows[0]
    hidden, labels = collect_positions(backbone, rows, num_heads=3)
    p, seq = len(row["prompt_ids"]), row["prompt_ids"] + row["reply_ids"]
    assert hidden.shape == (len(seq) - p, 64)
    assert labels[0, 0] == seq[p + 1] and labels[0, 2] == seq[p + 3]
    assert (labels[-1] == -100).all()  # nothing beyond the end


def test_cached_positions_extend_a_growing_distillation_file_with_only_its_new_replies(tmp_path, monkeypatch):
    import medusa_core.train.positions as positions

    backbone, _, rows = distilled_rows(tmp_path, n=7)
    cache = tmp_path / "positions.pt"
    seen = []
    collect = positions.collect_positions
    monkeypatch.setattr(positions, "collect_positions", lambda b, r, *a, **k: seen.append(len(r)) or collect(b, r, *a, **k))
    first = cached_positions(cache, backbone, rows[:4], 3)
    grown = cached_positions(cache, backbone, rows, 3)  # the file has grown by three replies
    again = cached_positions(cache, backbone, rows, 3)
    assert seen == [4, 3]  # the cached replies are not read again, nor is anything on the third call
    expected = [torch.cat(pair) for pair in zip(collect(backbone, rows[:4], 3, with_roots=True),
                                                collect(backbone, rows[4:], 3, with_roots=True))]
    for got, want, cached in zip(grown, expected, again):
        assert torch.equal(got, want) and torch.equal(cached, want)
    assert all(torch.equal(a, b[: len(a)]) for a, b in zip(first, grown))
    assert torch.load(cache, weights_only=True)["replies"] == 7
    shrunk = cached_positions(cache, backbone, rows[:2], 3)  # a different, shorter file: rebuilt from scratch
    assert seen == [4, 3, 2]
    assert all(torch.equal(a, b) for a, b in zip(shrunk, collect(backbone, rows[:2], 3, with_roots=True)))
    other = rows[1:2] + rows[:1] + rows[2:5]  # another file whose first two replies differ: rebuilt, not extended
    rebuilt = cached_positions(cache, backbone, other, 3)
    assert seen == [4, 3, 2, 5]
    assert all(torch.equal(a, b) for a, b in zip(rebuilt, collect(backbone, other, 3, with_roots=True)))


def test_head_loss_weights_heads_by_point_eight_to_the_k():
    logits = torch.zeros(2, 1, 5)
    labels = torch.tensor([[1, 2]])
    loss, top1 = head_loss(logits, labels)
    assert torch.isclose(loss, torch.tensor((1 + 0.8) * torch.log(torch.tensor(5.0)).item()))
    assert top1.shape == (2,)


def test_training_lowers_the_loss_and_writes_a_folder_that_loads_back_identically(tmp_path):
    backbone, _, rows = distilled_rows(tmp_path, n=12)
    hidden, labels = collect_positions(backbone, rows, num_heads=2)
    cfg = HeadTrainingConfig(num_heads=2, epochs=30, batch_size=64, warmup_steps=2, lr=1e-2, checkpoint_every=0, bf16=False)
    base = tmp_path / "base"
    backbone.save_pretrained(base)
    logits0 = MedusaHeads.from_backbone(backbone, 2)(hidden.float())
    loss0 = head_loss(logits0, labels)[0].item()
    heads, stats = train_heads(backbone, hidden, labels, tmp_path / "heads", cfg, base_model_name_or_path=str(base))
    assert stats["final_loss"] < loss0 * 0.8
    loaded = load_medusa_model(tmp_path / "heads", quantization=None, head_dtype=torch.float32)
    saved = load_file(tmp_path / "heads" / "medusa_lm_head.safetensors")
    for k, v in loaded.heads.state_dict().items():
        assert torch.equal(v, saved[k].float())
        assert torch.allclose(v, heads.state_dict()[k], atol=1e-2)


def test_an_interrupted_training_resumes_from_its_checkpoint_to_the_same_heads(tmp_path, monkeypatch):
    import medusa_core.train.heads as train  # where train_heads looks _checkpoint up

    backbone, _, rows = distilled_rows(tmp_path, n=6)
    hidden, labels = collect_positions(backbone, rows, num_heads=2)
    cfg = HeadTrainingConfig(num_heads=2, epochs=8, batch_size=32, warmup_steps=1, checkpoint_every=2, bf16=False)
    reference, _ = train_heads(backbone, hidden, labels, tmp_path / "ref", cfg, base_model_name_or_path="base")

    original = train._checkpoint

    def checkpoint_then_die(*args):
        original(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "_checkpoint", checkpoint_then_die)
    try:
        train_heads(backbone, hidden, labels, tmp_path / "run", cfg, base_model_name_or_path="base")
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(train, "_checkpoint", original)
    assert (tmp_path / "run" / "trainer_state.pt").exists()
    resumed, stats = train_heads(backbone, hidden, labels, tmp_path / "run", cfg, base_model_name_or_path="base")
    assert stats["resumed_from"] == 2 and not (tmp_path / "run" / "trainer_state.pt").exists()
    for k, v in reference.state_dict().items():
        assert torch.allclose(resumed.state_dict()[k], v, atol=1e-6), k


def test_rank_accuracy_counts_exact_ranks_and_calibration_builds_the_optimal_tree():
    class Fixed(torch.nn.Module):
        num_heads = 2

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, h):
            # vocabulary of 4 with logits 3 > 2 > 1 > 0 for tokens 0..3, for both heads
            return torch.tensor([3.0, 2.0, 1.0, 0.0]).expand(2, h.shape[0], 4)

    labels = torch.tensor([[0, 1], [0, 0], [1, 3], [2, -100]])
    acc = rank_accuracy(Fixed(), torch.zeros(4, 8), labels, max_rank=4)
    assert acc[0] == [0.5, 0.25, 0.25, 0.0]
    assert acc[1] == pytest.approx([1 / 3, 1 / 3, 0.0, 1 / 3])
    record = calibration(acc, budgets=[3])
    assert record["trees"]["optimised_3"] == optimal_tree(acc, 3)[0]
    # values: [0] .5, [1] .25, [2] .25, [0,0] .5/3 -> the three first-level ranks win over [0,0]
    # node values: [0] .5, [1] .25, [2] .25, [0,0] .5/3, so the three first-level ranks are chosen
    assert record["trees"]["optimised_3"] == [[0], [1], [2]]
    assert record["expected_acceleration"]["optimised_3"] == 2.0


def test_cli_distill_heads_and_vllm_export_run_end_to_end(tmp_path):
    folder = write_tiny_medusa(tmp_path)
    base = str(tmp_path / "base")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"def f{i}"}) for i in range(4)) + "\n")
    main(["distill", "--model", base, "--prompts", str(prompts), "--out", str(tmp_path / "d.jsonl"), "--max-new-tokens", "12"])
    main(["heads", "--model", base, "--data", str(tmp_path / "d.jsonl"), "--heldout", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "h"),
          "--num-heads", "2", "--epochs", "1", "--batch-size", "8", "--targets", "backbone", "--export", "vllm", str(tmp_path / "vllm")])
    assert json.loads((tmp_path / "h" / "config.json").read_text())["medusa_num_heads"] == 2
    record = json.loads((tmp_path / "h" / "medusa_calibration.json").read_text())
    assert "optimised_32" in record["trees"] and record["simulated_acceleration"]["optimised_32"] >= 1
    assert len(record["head_temperatures"]) == 2 and min(record["head_temperatures"]) > 0
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["model_type"] == "medusa"
    replies = [t for line in (tmp_path / "d.jsonl").read_text().splitlines() for t in json.loads(line)["reply_ids"]]
    ranking = json.loads((tmp_path / "h" / "draft_ranking.json").read_text())["ranked_ids"]  # beside the heads
    assert set(ranking) == set(replies) and replies.count(ranking[0]) == max(map(replies.count, replies))
    assert folder.exists()
