"""Head training, self-distillation and calibration on tiny models (paper 2.2.1, 2.3.2, 2.3.3)."""

import dataclasses
import json
import types

import pytest

import torch
from safetensors.torch import load_file

from medusa_core import MedusaHeads, SamplingConfig, load_medusa_model, optimal_tree
from medusa_core.train import (
    HeadTrainingConfig,
    accuracy_from_ranks,
    backbone_targets,
    cached_positions,
    calibration,
    collect_positions,
    distill,
    fit_temperature,
    generate_kwargs,
    head_loss,
    head_temperatures,
    main,
    rank_accuracy,
    read_distilled,
    MODEL_TURN,
    SampledTokens,
    read_prompts,
    simulated_acceleration,
    target_ranks,
    train_heads,
)
from tiny_models import HIDDEN, VOCAB, tiny_backbone, tiny_tokenizer, write_tiny_medusa


def _distilled_rows(tmp_path, n=12):
    tok = tiny_tokenizer()
    backbone = tiny_backbone(eos_token_id=tok.convert_tokens_to_ids("<|end|>"))
    chats = [[{"role": "user", "content": "def add" + " a" * i}] for i in range(n)]
    out = distill(backbone, tok, chats, tmp_path / "d.jsonl", max_new_tokens=24, batch_size=5)
    return backbone, tok, read_distilled(out)


def test_distill_writes_greedy_replies_that_equal_generate_and_resumes(tmp_path):
    backbone, tok, rows = _distilled_rows(tmp_path, n=6)
    assert sorted(r["id"] for r in rows) == list(range(6))
    row = rows[0]
    expected = backbone.generate(torch.tensor([row["prompt_ids"]]), max_new_tokens=24, do_sample=False)[0, len(row["prompt_ids"]) :]
    assert row["reply_ids"] == expected.tolist()[: len(row["reply_ids"])]
    # resuming with more prompts only generates the missing ones
    chats = [[{"role": "user", "content": "def add" + " a" * i}] for i in range(8)]
    distill(backbone, tok, chats, tmp_path / "d.jsonl", max_new_tokens=24, batch_size=5)
    ids = [r["id"] for r in read_distilled(tmp_path / "d.jsonl")]
    assert sorted(ids) == list(range(8)) and len(ids) == 8


def test_distill_answers_follow_up_turns_after_the_models_own_reply_and_resumes(tmp_path):
    tok = tiny_tokenizer()
    backbone = tiny_backbone(eos_token_id=tok.convert_tokens_to_ids("<|end|>"))
    chats = [[{"role": "user", "content": "def add a"}, dict(MODEL_TURN), {"role": "user", "content": "def sub b"}],
             [{"role": "user", "content": "def mul c"}]]
    out = distill(backbone, tok, chats, tmp_path / "d.jsonl", max_new_tokens=12, batch_size=2)
    rows = {r["id"]: r for r in read_distilled(out)}
    assert set(rows) == {0, 1, "0.1"}
    first = tok.decode(rows[0]["reply_ids"], skip_special_tokens=True)
    assert rows["0.1"]["messages"][1] == {"role": "assistant", "content": first}
    assert rows["0.1"]["messages"][2]["content"] == "def sub b"
    expected = backbone.generate(torch.tensor([rows["0.1"]["prompt_ids"]]), max_new_tokens=12, do_sample=False)
    assert rows["0.1"]["reply_ids"] == expected[0, len(rows["0.1"]["prompt_ids"]) :].tolist()[: len(rows["0.1"]["reply_ids"])]
    # a second run writes nothing new
    distill(backbone, tok, chats, out, max_new_tokens=12, batch_size=2)
    assert len(read_distilled(out)) == 3


def test_a_distillation_resumed_from_a_prompt_file_in_another_order_skips_the_prompts_it_has_answered(tmp_path):
    # a prompt file rebuilt on another machine may hold the same prompts at other indices (round 4's prompts read the
    # machine's Debian packages, and later rounds leave out what earlier ones hold): resuming matches conversations
    # by their content, not by their index, so no prompt is answered twice and none is skipped
    tok = tiny_tokenizer()
    backbone = tiny_backbone(eos_token_id=tok.convert_tokens_to_ids("<|end|>"))
    chat = lambda i: [{"role": "user", "content": "def add" + " a" * i}, dict(MODEL_TURN), {"role": "user", "content": f"def sub {i}"}]
    out = distill(backbone, tok, [chat(i) for i in range(4)], tmp_path / "d.jsonl", max_new_tokens=12, batch_size=3)
    first = {json.dumps(r["messages"]): r["reply_ids"] for r in read_distilled(out)}
    assert len(first) == 8
    distill(backbone, tok, [chat(i) for i in (5, 3, 2, 1, 0, 4)], out, max_new_tokens=12, batch_size=3)
    rows = read_distilled(out)
    by_content = {json.dumps(r["messages"]): r["reply_ids"] for r in rows}
    assert len(rows) == len(by_content) == 12  # two new chats of two turns each; nothing answered twice
    assert all(by_content[k] == v for k, v in first.items())
    assert len({r["id"] for r in rows}) == 12  # ids stay unique labels
    # the same first turn with another follow-up (drawn otherwise on another machine): only that turn is new
    other = [{"role": "user", "content": "def add a a"}, dict(MODEL_TURN), {"role": "user", "content": "def mul 9"}]
    distill(backbone, tok, [other], out, max_new_tokens=12, batch_size=3)
    rows = read_distilled(out)
    assert len(rows) == 13 and len({r["id"] for r in rows}) == 13
    assert rows[-1]["messages"][-1]["content"] == "def mul 9" and rows[-1]["id"] == "2.1.1"


def test_distill_samples_with_the_served_settings_reproducibly_into_a_gz_file(tmp_path):
    tok = tiny_tokenizer()
    backbone = tiny_backbone(eos_token_id=tok.convert_tokens_to_ids("<|end|>"))
    chats = [[{"role": "user", "content": "def add" + " a" * i}] for i in range(6)]
    chat = SamplingConfig(temperature=1.5, top_p=0.9, repetition_penalty=1.1)
    sampled = read_distilled(distill(backbone, tok, chats, tmp_path / "s.jsonl.gz", max_new_tokens=16, batch_size=3, sampling=chat))
    again = read_distilled(distill(backbone, tok, chats, tmp_path / "t.jsonl.gz", max_new_tokens=16, batch_size=3, sampling=chat))
    greedy = read_distilled(distill(backbone, tok, chats, tmp_path / "g.jsonl", max_new_tokens=16, batch_size=3))
    assert [r["reply_ids"] for r in sampled] == [r["reply_ids"] for r in again]  # seeded per batch
    assert [r["reply_ids"] for r in sampled] != [r["reply_ids"] for r in greedy]  # sampled, not argmax
    generator = torch.Generator()
    assert generate_kwargs(SamplingConfig(repetition_penalty=1.1), generator) == {"do_sample": False, "repetition_penalty": 1.1}
    drawn = generate_kwargs(chat, generator)  # a greedy search over SampledTokens' draws
    assert drawn["do_sample"] is False and drawn["repetition_penalty"] == 1.0  # penalised once, by SampledTokens
    assert [type(p) for p in drawn["logits_processor"]] == [SampledTokens]
    on_a_gpu = types.SimpleNamespace(device=torch.device("cuda"))  # HF's sampling there: its sort and draws are cheap
    assert generate_kwargs(chat, on_a_gpu) == {"do_sample": True, "repetition_penalty": 1.1, "temperature": 1.5,
                                               "top_k": None, "top_p": 0.9, "min_p": None}


def test_a_gz_distillation_cut_mid_batch_drops_that_batch_and_resumes_it(tmp_path):
    tok = tiny_tokenizer()
    backbone = tiny_backbone(eos_token_id=tok.convert_tokens_to_ids("<|end|>"))
    chats = [[{"role": "user", "content": "def add" + " a" * i}] for i in range(6)]
    out = distill(backbone, tok, chats, tmp_path / "d.jsonl.gz", max_new_tokens=12, batch_size=3)
    whole = read_distilled(out)
    out.write_bytes(out.read_bytes()[:-7])  # a crash while the second batch's member was written
    assert len(read_distilled(out)) == 3
    distill(backbone, tok, chats, out, max_new_tokens=12, batch_size=3)
    assert sorted(map(json.dumps, read_distilled(out))) == sorted(map(json.dumps, whole))


def test_collect_positions_labels_are_the_reply_tokens_k_plus_2_ahead(tmp_path):
    backbone, _, rows = _distilled_rows(tmp_path, n=1)
    row = rows[0]
    hidden, labels = collect_positions(backbone, rows, num_heads=3)
    p, seq = len(row["prompt_ids"]), row["prompt_ids"] + row["reply_ids"]
    assert hidden.shape == (len(seq) - p, 64)
    assert labels[0, 0] == seq[p + 1] and labels[0, 2] == seq[p + 3]
    assert (labels[-1] == -100).all()  # nothing beyond the end


def test_cached_positions_extend_a_growing_distillation_file_with_only_its_new_replies(tmp_path, monkeypatch):
    import medusa_core.train.positions as positions

    backbone, _, rows = _distilled_rows(tmp_path, n=7)
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
    backbone, _, rows = _distilled_rows(tmp_path, n=12)
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

    backbone, _, rows = _distilled_rows(tmp_path, n=6)
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


def test_read_prompts_accepts_chats_prompts_and_text(tmp_path):
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    assert read_prompts(tmp_path / "p.txt") == [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]]
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, {"prompt": "p", "system": "s"},
            {"prompt": "p", "followup": "f"}]
    (tmp_path / "p.jsonl").write_text("\n".join(map(json.dumps, rows)))
    chats = read_prompts(tmp_path / "p.jsonl")
    assert chats[0] == [{"role": "user", "content": "q"}]
    assert chats[1] == [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}]
    assert chats[2] == [{"role": "user", "content": "p"}, MODEL_TURN, {"role": "user", "content": "f"}]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_root_conditioned_heads_train_on_a_gpu_like_on_the_cpu(tmp_path):
    """The same batches and schedule on a CUDA device: heads within float32 rounding of the CPU's, saved as CPU tensors."""
    backbone, _, rows = _distilled_rows(tmp_path, n=8)
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
    backbone, _, rows = _distilled_rows(tmp_path, n=6)
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
    backbone, _, rows = _distilled_rows(tmp_path, n=8)
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
    backbone, _, rows = _distilled_rows(tmp_path, n=2)
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
    backbone, _, rows = _distilled_rows(tmp_path, n=4)
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
    backbone, _, rows = _distilled_rows(tmp_path, n=4)
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

    backbone, _, rows = _distilled_rows(tmp_path, n=12)
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

    backbone, tok, rows = _distilled_rows(tmp_path, n=8)
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


# ------------------------------------------------------------------ temperature scaling (Guo et al. 2017)
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


def test_a_warm_start_begins_at_the_given_heads_and_a_root_conditioned_one_keeps_them_at_step_zero(tmp_path):
    backbone, _, rows = _distilled_rows(tmp_path, n=4)
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


def test_a_draft_ranking_lists_reply_tokens_most_frequent_first_and_is_read_back_by_loading(tmp_path):
    from medusa_core.heads import DRAFT_RANKING_FILE
    from medusa_core.train.ranking import rank_tokens, write_ranking

    ranked = rank_tokens([[7, 3, 7, 9], [3, 7], [12]])
    assert ranked == [7, 3, 9, 12]  # 7 thrice, 3 twice, then the ties by id
    path = write_ranking(tmp_path, ranked, "three replies")
    assert path.name == DRAFT_RANKING_FILE and json.loads(path.read_text())["ranked_ids"] == ranked
    with pytest.raises(ValueError, match="no reply tokens"):
        rank_tokens([[], []])
