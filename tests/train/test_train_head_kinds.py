"""Kinds of heads and targets: root-conditioned heads (on a GPU-like path too), "version 2" heads, the backbone's own
tokens or distribution as targets, a warm start."""

import dataclasses
import json

import pytest

import torch
from safetensors.torch import load_file

from medusa_core import MedusaHeads
from medusa_core.train import (HeadTrainingConfig, backbone_targets, collect_positions, head_loss, rank_accuracy,
                               target_ranks, train_heads)
from tiny_models import HIDDEN, VOCAB, tiny_backbone

from .support import distilled_rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_root_conditioned_heads_train_on_a_gpu_like_on_the_cpu(tmp_path):
    """The same batches and schedule on a CUDA device: heads within float32 rounding of the CPU's, saved as CPU tensors."""
    backbone, _, rows = distilled_rows(tmp_path, n=8)
    hidden, labels, roots = collect_positions(backbone, rows, num_heads=2, with_roots=True)
    cfg = HeadTrainingConfig(num_heads=2, share_lm_head=True, vocab="data", epochs=6, batch_size=32, warmup_steps=1,
                             lr=1e-2, checkpoint_every=0, bf16=False, soft_targets=True, root_conditioned=True)
    on_cpu, cpu_stats = train_heads(backbone, hidden, labels, tmp_path / "cpu", cfg, base_model_name_or_path="b", roots=roots)
    cpu_ranks = target_ranks(on_cpu, hidden, labels, roots=roots)  # before the backbone the heads read moves
    gpu_backbone = backbone.to("cuda")
    on_gpu, gpu_stats = train_heads(gpu_backbone, hidden, labels, tmp_path / "gpu", cfg, base_model_name_or_path="b",
                                    roots=roots, device="cuda")
    assert next(on_gpu.parameters()).is_cuda and gpu_stats["steps"] == cpu_stats["steps"]
    for k, v in on_cpu.state_dict().items():
        assert torch.allclose(on_gpu.state_dict()[k].cpu(), v, atol=1e-3), k
    assert torch.equal(load_file(tmp_path / "gpu" / "medusa_lm_head.safetensors")["0.0.linear.weight"],
                       on_gpu.state_dict()["0.0.linear.weight"].to("cpu", torch.float16))
    ranks = target_ranks(on_gpu, hidden, labels, roots=roots)  # GPU heads, CPU positions
    assert (ranks == cpu_ranks).float().mean() > 0.95


def test_version_2_heads_train_only_their_blocks_and_save_without_projections(tmp_path):
    backbone, _, rows = distilled_rows(tmp_path, n=6)
    hidden, labels = collect_positions(backbone, rows, num_heads=2)
    cfg = HeadTrainingConfig(num_heads=2, share_lm_head=True, epochs=10, batch_size=32, warmup_steps=1, lr=1e-2, checkpoint_every=0, bf16=False)
    lm_before = backbone.get_output_embeddings().weight.clone()
    heads, stats = train_heads(backbone, hidden, labels, tmp_path / "v2", cfg, base_model_name_or_path="base")
    assert heads.shares_lm_head and torch.equal(backbone.get_output_embeddings().weight, lm_before)
    assert json.loads((tmp_path / "v2" / "config.json").read_text())["version"] == "2"
    assert set(load_file(tmp_path / "v2" / "medusa_lm_head.safetensors")) == {
        f"{i}.0.linear.{w}" for i in range(2) for w in ("weight", "bias")
    }
    assert any(p.abs().sum() > 0 for p in heads.parameters())  # the zero-initialised blocks moved


def test_version_2_heads_trained_on_the_label_vocabulary_learn_and_are_evaluated_on_the_whole_vocabulary(tmp_path):
    backbone, _, rows = distilled_rows(tmp_path, n=8)
    hidden, labels = collect_positions(backbone, rows, num_heads=2)
    cfg = HeadTrainingConfig(num_heads=2, share_lm_head=True, vocab="data", epochs=30, batch_size=32, warmup_steps=1,
                             lr=1e-2, checkpoint_every=0, bf16=False)
    fresh = MedusaHeads(HIDDEN, VOCAB, 2, shared_lm_head=backbone.get_output_embeddings())
    heads, stats = train_heads(backbone, hidden, labels, tmp_path / "v2", cfg, base_model_name_or_path="base")
    assert stats["softmax_vocabulary"] == len(labels[labels != -100].unique()) < VOCAB
    before, after = rank_accuracy(fresh, hidden, labels), rank_accuracy(heads, hidden, labels)  # whole vocabulary
    assert after[0][0] > before[0][0] + 0.2
    with pytest.raises(ValueError, match="vocab must be 'full', or 'data' with share_lm_head=True"):
        train_heads(backbone, hidden, labels, tmp_path / "v1", HeadTrainingConfig(vocab="data"), base_model_name_or_path="b")


def test_fresh_root_conditioned_heads_are_medusa_heads_and_need_the_root(tmp_path):
    backbone, _, rows = distilled_rows(tmp_path, n=2)
    hidden, labels, roots = collect_positions(backbone, rows, num_heads=2, with_roots=True)
    seq, p = rows[0]["prompt_ids"] + rows[0]["reply_ids"], len(rows[0]["prompt_ids"])
    assert roots.shape == (len(hidden),) and roots[: len(seq) - p].tolist() == seq[p:]  # the token after each position
    plain = MedusaHeads.from_backbone(backbone, 2)
    rooted = MedusaHeads.from_backbone(backbone, 2, root_conditioned=True)
    assert rooted.root_conditioned and len(rooted) == 2 and rooted.root_weight.shape == (2, HIDDEN, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(rooted(hidden.float(), root=roots), plain(hidden.float()))  # R_k = 0 at first
    cfg = HeadTrainingConfig(num_heads=2, root_conditioned=True, checkpoint_every=0, bf16=False)
    with pytest.raises(ValueError, match=rf"roots of shape \[{len(hidden)}\] \(one per position\), got None"):
        train_heads(backbone, hidden, labels, tmp_path / "h", cfg, base_model_name_or_path="b")


def test_root_conditioned_heads_learn_what_only_the_root_token_tells(tmp_path):
    """Head 1's target is the root token's successor under a fixed random map, unrelated to the hidden
    state: plain heads cannot learn it, root-conditioned ones can (the reason for layout "root")."""
    backbone = tiny_backbone()
    g = torch.Generator().manual_seed(0)
    successor = torch.randperm(VOCAB, generator=g)  # token -> the token after it
    hidden = torch.randn(6000, HIDDEN, generator=g).half()
    roots = torch.randint(0, VOCAB, (6000,), generator=g)
    labels = successor[roots][:, None]  # [M, 1]
    train, held = slice(0, 5000), slice(5000, None)
    cfg = dict(num_heads=1, share_lm_head=True, epochs=20, batch_size=250, warmup_steps=5, lr=3e-2, checkpoint_every=0, bf16=False)
    plain, _ = train_heads(backbone, hidden[train], labels[train], tmp_path / "plain", HeadTrainingConfig(**cfg),
                           base_model_name_or_path="b")
    rooted, _ = train_heads(backbone, hidden[train], labels[train], tmp_path / "rooted",
                            HeadTrainingConfig(**cfg, root_conditioned=True), base_model_name_or_path="b", roots=roots[train])
    plain_top1 = rank_accuracy(plain, hidden[held], labels[held])[0][0]
    rooted_top1 = rank_accuracy(rooted, hidden[held], labels[held], roots=roots[held])[0][0]
    assert rooted_top1 > plain_top1 + 0.15, (plain_top1, rooted_top1)


def test_collect_positions_backbone_targets_are_the_backbones_own_greedy_tokens(tmp_path):
    backbone, _, rows = distilled_rows(tmp_path, n=4)
    other = tiny_backbone(seed=5)  # a different backbone: its own greedy tokens differ from the replies
    hidden, labels = collect_positions(other, rows, num_heads=3, targets="backbone")
    _, reply_labels = collect_positions(other, rows, num_heads=3)
    assert torch.equal(labels == -100, reply_labels == -100)
    start = 0
    for r in sorted(rows, key=lambda r: len(r["prompt_ids"]) + len(r["reply_ids"])):
        seq = torch.tensor([r["prompt_ids"] + r["reply_ids"]])
        greedy = other(seq).logits[0].argmax(-1)  # [T] token after each position
        p, n = len(r["prompt_ids"]), len(r["reply_ids"])
        for j in range(n):
            for k in range(3):
                if j + k + 1 < n:
                    assert labels[start + j, k] == greedy[p - 1 + j + k + 1]
        start += n
    assert (labels != reply_labels).any()
    with pytest.raises(ValueError, match="targets must be one of"):
        collect_positions(other, rows, num_heads=3, targets="teacher")


def test_backbone_targets_are_the_backbones_distribution_for_each_heads_place(tmp_path):
    backbone, _, rows = distilled_rows(tmp_path, n=4)
    other = tiny_backbone(seed=5)
    hidden, labels = collect_positions(other, rows, num_heads=3, targets="backbone")
    soft = backbone_targets(hidden, torch.arange(len(hidden)), other.get_output_embeddings().weight, 3)  # [K, M, V]
    start = 0
    for r in sorted(rows, key=lambda r: len(r["prompt_ids"]) + len(r["reply_ids"])):
        seq = torch.tensor([r["prompt_ids"] + r["reply_ids"]])
        probs = other(seq).logits[0].softmax(-1)  # [T, V] the distribution after each position
        p, n = len(r["prompt_ids"]), len(r["reply_ids"])
        for j in range(n):
            for k in range(3):
                if j + k + 1 < n:  # head k at reply position j predicts the token after p-1+j+k+1
                    assert torch.allclose(soft[k, start + j], probs[p - 1 + j + k + 1], atol=1e-3)
        start += n
    valid = labels.T != -100  # [K, M]
    assert torch.equal(soft.argmax(-1)[valid], labels.T[valid])


def test_head_loss_with_one_hot_soft_targets_is_the_hard_loss_and_soft_training_lowers_it(tmp_path):
    logits = torch.randn(2, 6, 5)
    labels = torch.tensor([[1, 2], [0, 4], [3, -100], [2, 2], [4, 0], [1, -100]])
    one_hot = torch.nn.functional.one_hot(labels.clamp(min=0).T, 5).float()  # [K, B, V]
    assert torch.allclose(head_loss(logits, labels, one_hot)[0], head_loss(logits, labels)[0], atol=1e-5)

    backbone, _, rows = distilled_rows(tmp_path, n=12)
    hidden, labels = collect_positions(backbone, rows, num_heads=2, targets="backbone")
    cfg = HeadTrainingConfig(num_heads=2, share_lm_head=True, soft_targets=True, epochs=30, batch_size=64,
                             warmup_steps=2, lr=1e-2, checkpoint_every=0, bf16=False)
    lm = backbone.get_output_embeddings()
    soft = backbone_targets(hidden, torch.arange(len(hidden)), lm.weight, 2)
    untrained = MedusaHeads(lm.in_features, lm.out_features, 2, 1, shared_lm_head=lm)
    entropy = head_loss(soft.log(), labels, soft)[0].item()  # the loss of heads that equal the targets
    kl0 = head_loss(untrained(hidden.float()), labels, soft)[0].item() - entropy
    heads, stats = train_heads(backbone, hidden, labels, tmp_path / "heads", cfg, base_model_name_or_path="base")
    kl = head_loss(heads(hidden.float()), labels, soft)[0].item() - entropy
    assert 0 <= kl < kl0 * 0.5
    with pytest.raises(ValueError, match="soft_targets needs share_lm_head"):
        train_heads(backbone, hidden, labels, tmp_path / "own", HeadTrainingConfig(num_heads=2, soft_targets=True),
                    base_model_name_or_path="base")


def test_a_warm_start_begins_at_the_given_heads_and_a_root_conditioned_one_keeps_them_at_step_zero(tmp_path):
    backbone, _, rows = distilled_rows(tmp_path, n=4)
    hidden, labels, roots = collect_positions(backbone, rows, num_heads=2, with_roots=True)
    plain_cfg = HeadTrainingConfig(num_heads=2, share_lm_head=True, epochs=5, batch_size=32, warmup_steps=1, lr=1e-2,
                                   checkpoint_every=0, bf16=False)
    plain, _ = train_heads(backbone, hidden, labels, tmp_path / "plain", plain_cfg, base_model_name_or_path="b")
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    rooted_cfg = dataclasses.replace(plain_cfg, root_conditioned=True, lr=0.0, warmup_steps=1_000)  # no step moves them
    rooted, _ = train_heads(backbone, hidden, labels, tmp_path / "rooted", rooted_cfg, base_model_name_or_path="b",
                            roots=roots, init=start)
    with torch.no_grad():
        torch.testing.assert_close(rooted(hidden.float(), root=roots), plain(hidden.float()))
    assert not rooted.root_weight.any()
    wrong = {**start, "0.0.linear.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"'0.0.linear.weight' of shape \[3, 3\], expected"):
        train_heads(backbone, hidden, labels, tmp_path / "bad", plain_cfg, base_model_name_or_path="b", init=wrong)
    with pytest.raises(ValueError, match="missing '1.0.linear.bias'"):
        train_heads(backbone, hidden, labels, tmp_path / "bad2", plain_cfg, base_model_name_or_path="b",
                    init={k: v for k, v in start.items() if k != "1.0.linear.bias"})
