"""Self-distillation (paper 2.3.2): greedy and sampled replies written batched and resumed (follow-up turns, a prompt file
in another order, a gz file cut mid-batch), and the prompt files it reads."""

import json
import types


import torch

from medusa_core import SamplingConfig
from medusa_core.train import distill, generate_kwargs, read_distilled, MODEL_TURN, SampledTokens, read_prompts
from tiny_models import tiny_backbone, tiny_tokenizer

from .support import distilled_rows


def test_distill_writes_greedy_replies_that_equal_generate_and_resumes(tmp_path):
    backbone, tok, rows = distilled_rows(tmp_path, n=6)
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
