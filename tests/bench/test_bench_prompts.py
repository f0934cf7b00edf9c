"""The benchmark's prompt set: its categories, held out from the demo's training, limits and categories, and how a
row is encoded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medusa_core.bench import Prompt, encode_prompt, load_prompts
from tiny_models import tiny_tokenizer

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
SHIPPED = Path(__file__).resolve().parents[2] / "medusa_core" / "data" / "bench_prompts.jsonl"
DEMO_PROMPTS = Path(__file__).resolve().parents[2] / "assets" / "demo" / "prompts"


def test_shipped_prompts_cover_mt_bench_categories_and_multi_turn_conversations():
    prompts = load_prompts()
    categories = {p.category for p in prompts}
    assert len(prompts) >= 80
    assert MT_BENCH | {"multi-turn"} == categories
    assert all(sum(p.category == c for p in prompts) >= 10 for c in categories)
    assert len({(p.history, p.text) for p in prompts}) == len(prompts)
    multi = [p for p in prompts if p.category == "multi-turn"]
    assert all(len(p.history) == 2 and [role for role, _ in p.history] == ["user", "assistant"] for p in multi)
    assert not any(p.history for p in prompts if p.category != "multi-turn")


def test_shipped_prompts_taken_from_the_demo_are_held_out_and_never_trained_on():
    if not (DEMO_PROMPTS / "heldout.jsonl").exists():
        pytest.skip("no demo prompt files in this checkout")
    def user_texts(name):
        return {json.loads(line)["messages"][-1]["content"] for line in (DEMO_PROMPTS / name).open(encoding="utf-8")}

    heldout, train = user_texts("heldout.jsonl"), user_texts("train.jsonl")
    rows = [json.loads(line) for line in SHIPPED.open(encoding="utf-8")]
    copied = [r["prompt"] for r in rows if r["source"] == "heldout"]
    assert len(copied) >= 60 and {r["source"] for r in rows} == {"heldout", "written"}
    assert [t for t in copied if t not in heldout] == []
    assert [t for r in rows for t in ([r["prompt"]] if "prompt" in r else [m["content"] for m in r["messages"]])
            if t in train] == []


def test_limit_takes_prompts_round_robin_over_the_categories():
    assert {p.category for p in load_prompts(limit=9)} == MT_BENCH | {"multi-turn"}


def test_categories_keep_only_their_prompts_and_an_unknown_one_names_those_there_are():
    prompts = load_prompts(None, 4, ["writing", "stem"])
    assert len(prompts) == 4 and {p.category for p in prompts} == {"writing", "stem"}
    with pytest.raises(ValueError, match="no prompt of the categories poetry; it has coding, extraction"):
        load_prompts(None, None, ["poetry"])


def test_a_prompt_file_without_a_prompt_field_is_named_with_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2"):
        load_prompts(path)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],  # ends with the assistant
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "system", "content": "s"}],
    [],
])
def test_a_conversation_that_does_not_alternate_and_end_with_the_user_is_named_with_its_line(tmp_path, messages):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n' + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2: .*(message|turns)"):
        load_prompts(path)


def test_a_messages_row_is_encoded_as_the_whole_conversation_ending_with_the_assistants_turn(tmp_path):
    path = tmp_path / "p.jsonl"
    conversation = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."},
                    {"role": "user", "content": "And an even one?"}]
    path.write_text(json.dumps({"category": "multi-turn", "messages": conversation}) + "\n")
    [prompt] = load_prompts(path)
    assert prompt == Prompt("And an even one?", "multi-turn", (("user", "Name a prime."), ("assistant", "Seven.")))
    tok = tiny_tokenizer()  # its template: <|role|>\ncontent<|end|>\n per message, then <|assistant|>\n

    def ids_of(text):
        return tok(text, add_special_tokens=False, return_tensors="pt").input_ids.tolist()

    assert encode_prompt(tok, prompt, system="Be brief.").tolist() == ids_of(
        "<|system|>\nBe brief.<|end|>\n<|user|>\nName a prime.<|end|>\n<|assistant|>\nSeven.<|end|>\n"
        "<|user|>\nAnd an even one?<|end|>\n<|assistant|>\n"
    )
    # a single-turn row (or a plain string) is the last user message alone
    assert encode_prompt(tok, "And an even one?").tolist() == ids_of("<|user|>\nAnd an even one?<|end|>\n<|assistant|>\n")
