"""The demo's prompt set (scripts/demo_prompts.py): held-out prompts stay unseen in every training round."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import demo_prompts  # noqa: E402
from demo_build import prompt_sources, topic_rounds  # noqa: E402

PROMPTS = ROOT / "assets" / "demo" / "prompts"


def _read(name: str) -> list[dict]:
    return [json.loads(line) for line in (PROMPTS / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def built():
    return demo_prompts.build(self_instruct=None)


def test_round_two_adds_new_prompts_and_never_a_held_out_group(built):
    train, heldout, more = built
    first = {r["messages"][0]["content"] for r in train + heldout}
    assert len(more) > len(train)
    assert not first & {r["messages"][0]["content"] for r in more}
    assert not any(prompt_sources.is_heldout(r["group"]) for r in more)
    assert {r["group"] for r in heldout}.isdisjoint(r["group"] for r in train + more)
    assert [r["id"] for r in more] == list(range(len(more)))


def test_round_two_writing_prompts_are_four_forms_a_topic_as_shipped():
    """Round 2's templates, as the shipped file was written: four writing forms for each writing topic (round 5's
    ``TEMPLATES_PER_TOPIC`` is its own)."""
    import random

    from demo_seeds import MORE_WRITING_TOPICS, WRITING_TOPICS

    writing = [row for row in prompt_sources.more_template_prompts(random.Random(prompt_sources.SEED + 1)) if row[0] == "writing"]
    assert len(writing) == 4 * len(WRITING_TOPICS + MORE_WRITING_TOPICS)


def test_shipped_prompt_files_keep_held_out_prompts_unseen():
    train, heldout, more = _read("train"), _read("heldout"), _read("train_more")
    held_groups = {r["group"] for r in heldout}
    assert len(train) >= 3000 and len(heldout) >= 200 and len(more) >= 3000
    assert held_groups.isdisjoint(r["group"] for r in train + more)
    assert all(prompt_sources.is_heldout(r["group"]) for r in heldout)
    texts = [r["messages"][0]["content"] for r in train + heldout + more]
    assert len(texts) == len(set(texts))


def test_later_rounds_repeat_no_prompt_and_hold_no_held_out_group():
    rounds = {name: _read(name) for name in ("train", "train_more", "train_wide")}
    held_groups = {r["group"] for r in _read("heldout")}
    seen: set[str] = {r["messages"][0]["content"] for r in _read("heldout")}
    for name, rows in rounds.items():
        texts = {r["messages"][0]["content"] for r in rows}
        assert len(texts) == len(rows), name
        assert not texts & seen, name
        seen |= texts
        assert held_groups.isdisjoint(r["group"] for r in rows), name
        assert not any(prompt_sources.is_heldout(r["group"]) for r in rows), name


def test_round_four_asks_nothing_the_rounds_before_it_asked():
    names = ("train", "heldout", "train_more", "train_wide")
    rows = demo_prompts.build_deep([PROMPTS / f"{name}.jsonl" for name in names])
    before = {r["messages"][0]["content"] for name in names for r in _read(name)}
    texts = {r["messages"][0]["content"] for r in rows}
    assert len(texts) == len(rows) and not before & texts
    assert not any(prompt_sources.is_heldout(r["group"]) for r in rows)
    assert {r["source"] for r in rows} >= {"python-docs", "generated"}
    assert [r["id"] for r in rows] == list(range(len(rows)))


def test_topics_are_read_from_the_backbones_list_lines_only():
    continuation = " a dream gone wrong\n- A sunset over a cathedral.\n- 100 stars\n- a poem: love\n\n- a red kite\nThe end\n- x y"
    assert topic_rounds.parse_topics("writing", continuation) == ["a dream gone wrong", "A sunset over a cathedral", "a red kite"]
    assert topic_rounds.parse_topics("writing", "100 stars\n- a lighthouse") == []  # the list's first item is not one
    coding = " Write a function that checks if a number is prime.\n- Write a function that sums.\n- Sort a list.\n- Write a"
    assert topic_rounds.parse_topics("coding", coding) == ["checks if a number is prime"]


def test_topic_requests_show_only_training_topics():
    requests = topic_rounds.topic_requests(30)
    assert len(requests) == 30 * len(topic_rounds.TOPIC_KINDS) and requests == topic_rounds.topic_requests(30)
    for row in requests:
        _, prefix, _, _ = topic_rounds.TOPIC_KINDS[row["kind"]]
        shown = [line[2:] for line in row["request"].splitlines()[1:-1]]
        assert len(shown) == 6 and row["request"].endswith("\n-")
        topics = [topic_rounds.parse_topics("coding", " " + s)[0] for s in shown] if row["kind"] == "coding" else shown
        assert not any(prompt_sources.is_heldout(prefix + t) for t in topics)


def test_round_five_gives_new_topics_the_round_three_templates_and_keeps_held_out_topics_out(tmp_path):
    names = ("train", "heldout", "train_more", "train_wide", "train_deep")
    (tmp_path / "train_deep.jsonl").write_text("")  # round 4's file, which the repository does not hold
    existing = [PROMPTS / f"{n}.jsonl" for n in names[:-1]] + [tmp_path / "train_deep.jsonl"]
    held = next(r["group"] for r in _read("heldout") if r["group"].startswith("w:"))[2:]
    variant = "The " + held.split(" ", 1)[1] + "s" if held.split()[0] in ("a", "an", "the") else "The " + held + "s"
    topics = [("writing", "a paper boat in the gutter"), ("roleplay", "a lighthouse keeper's cat"),
              ("stem", "tidal energy"), ("coding", "counts the words in a sentence"),
              ("writing", variant),  # a held-out topic, up to an article and a plural
              ("writing", "autumn leaves"),  # a seed topic
              ("writing", "A paper boat in the gutter")]  # the first one again
    topics += [("everyday", f"fold paper crane number {n}") for n in range(40)]
    file = tmp_path / "topics.jsonl"
    file.write_text("".join(json.dumps({"kind": k, "topic": t}) + "\n" for k, t in topics))
    assert not any(prompt_sources.is_heldout(g) for g in ("w:a paper boat in the gutter", "s:tidal energy"))
    rows = demo_prompts.build_topics(existing, file)
    groups = {r["group"] for r in rows}
    assert "w:a paper boat in the gutter" in groups and "s:tidal energy" in groups
    assert not {"w:" + variant, "w:autumn leaves", "w:A paper boat in the gutter"} & groups
    assert not any(prompt_sources.is_heldout(g) for g in groups)
    assert sum(not prompt_sources.is_heldout("d:" + t) for k, t in topics if k == "everyday") * topic_rounds.TEMPLATES_PER_TOPIC == sum(
        r["category"] == "everyday" for r in rows)  # held-out hashes dropped
    before = {r["messages"][0]["content"] for n in names[:-1] for r in _read(n)}
    texts = [r["messages"][0]["content"] for r in rows]
    assert len(set(texts)) == len(texts) and not before & set(texts)
    assert any(t.startswith("Pretend you are a lighthouse keeper's cat. ") for t in texts)
    assert any("function that counts the words in a sentence" in t for t in texts)
    with pytest.raises(SystemExit, match="--stages topics"):
        demo_prompts.build_topics(existing, tmp_path / "missing.jsonl")


def test_distilling_a_round_whose_prompt_file_is_missing_says_how_to_write_it(tmp_path, monkeypatch):
    import argparse

    from demo_build import replies

    monkeypatch.setattr(replies, "PROMPTS", tmp_path)
    monkeypatch.setattr(replies, "load_served", lambda args: pytest.fail("the backbone loads before the check"))
    args = argparse.Namespace(distill_splits=["train_deep"], served_settings=["chat"], quantization="gguf")
    with pytest.raises(SystemExit, match=r"train_deep\.jsonl.*--round 4"):
        replies.stage_distill_served(args)


def test_the_topics_stage_keeps_a_topics_file_it_did_not_write_here(tmp_path, monkeypatch):
    import argparse

    from demo_build import replies

    (tmp_path / "topics.jsonl").write_text('{"kind": "stem", "topic": "tidal energy"}\n')
    monkeypatch.setattr(replies, "PROMPTS", tmp_path)
    monkeypatch.setattr(replies, "WORK", tmp_path / "work")
    monkeypatch.setattr(replies, "load", lambda dtype: pytest.fail("the backbone loads to write the file again"))
    replies.stage_topics(argparse.Namespace(topic_requests=3, distill_dtype="float32", topic_round=5))
    assert (tmp_path / "topics.jsonl").read_text() == '{"kind": "stem", "topic": "tidal energy"}\n'


def test_round_six_lists_show_round_five_topics_and_say_how_to_write_them_when_missing(tmp_path, monkeypatch):
    import argparse

    from demo_build import replies

    listed = topic_rounds.read_topics(PROMPTS / "topics.jsonl")
    requests = topic_rounds.topic_requests(20, topic_rounds.TOPIC_ROUNDS[6][1], listed)
    assert requests == topic_rounds.topic_requests(20, topic_rounds.TOPIC_ROUNDS[6][1], listed)
    assert requests != topic_rounds.topic_requests(20)  # not round 5's lists
    for row in requests:
        _, prefix, _, _ = topic_rounds.TOPIC_KINDS[row["kind"]]
        shown = [line[2:] for line in row["request"].splitlines()[1:-1]]
        topics = [topic_rounds.parse_topics("coding", " " + s)[0] for s in shown] if row["kind"] == "coding" else shown
        assert len(set(topics)) == 6 and set(topics) <= {t for k, t in listed if k == row["kind"]}
        assert not any(prompt_sources.is_heldout(prefix + t) for t in topics)
    monkeypatch.setattr(replies, "PROMPTS", tmp_path)  # no round-5 topics here
    monkeypatch.setattr(replies, "WORK", tmp_path / "work")
    monkeypatch.setattr(replies, "load", lambda dtype: pytest.fail("the backbone loads before the check"))
    with pytest.raises(SystemExit, match=r"topics\.jsonl.*--stages topics --topic-round 5"):
        replies.stage_topics(argparse.Namespace(topic_requests=3, distill_dtype="float32", topic_round=6))
    assert not (tmp_path / "topics6.jsonl").exists()


def test_round_six_leaves_out_round_fives_topics_and_prompts(tmp_path):
    for name in ("train", "heldout", "train_more", "train_wide"):
        (tmp_path / f"{name}.jsonl").write_text((PROMPTS / f"{name}.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "train_deep.jsonl").write_text("")  # round 4's file, which the repository does not hold
    round5 = [("stem", "tidal energy"), ("coding", "counts the words in a sentence")]
    (tmp_path / "topics.jsonl").write_text("".join(json.dumps({"kind": k, "topic": t}) + "\n" for k, t in round5))
    round6 = round5 + [("stem", "The Tidal energy"), ("stem", "ocean acidification"), ("coding", "reverses a linked list")]
    (tmp_path / "topics6.jsonl").write_text("".join(json.dumps({"kind": k, "topic": t}) + "\n" for k, t in round6))
    with pytest.raises(SystemExit, match=r"train_topics\.jsonl \(write it first: python scripts/demo_prompts\.py --round 5\)"):
        demo_prompts.main(["--out", str(tmp_path), "--round", "6"])
    demo_prompts.main(["--out", str(tmp_path), "--round", "5"])
    demo_prompts.main(["--out", str(tmp_path), "--round", "6"])
    groups5 = {json.loads(line)["group"] for line in (tmp_path / "train_topics.jsonl").read_text().splitlines()}
    rows6 = [json.loads(line) for line in (tmp_path / "train_topics6.jsonl").read_text().splitlines()]
    groups6 = {r["group"] for r in rows6}
    assert groups5 == {"s:tidal energy", "c:counts the words in a sentence"}
    assert groups6 == {g for g in ("s:ocean acidification", "c:reverses a linked list") if not prompt_sources.is_heldout(g)}
    assert len(rows6) == topic_rounds.TEMPLATES_PER_TOPIC * len(groups6) and groups6


def test_a_round_whose_earlier_prompt_file_is_missing_says_which_round_writes_it(tmp_path):
    for name in ("train", "heldout", "train_more", "train_wide"):
        (tmp_path / f"{name}.jsonl").write_text((PROMPTS / f"{name}.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    with pytest.raises(SystemExit, match=r"train_deep\.jsonl \(write it first: python scripts/demo_prompts\.py --round 4\)"):
        demo_prompts.main(["--out", str(tmp_path), "--round", "5", "--topics", str(tmp_path / "topics.jsonl")])
    assert not (tmp_path / "train_topics.jsonl").exists()


def test_served_replies_of_rounds_the_repository_does_not_hold_stay_out_of_the_shipped_corpus():
    import argparse

    import probe_eagle
    from demo_build import common

    ignored = {line.strip().lstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()}
    assert {f"assets/demo/prompts/{split}.jsonl" for split in common.UNSHIPPED_SPLITS} <= ignored
    args = argparse.Namespace(quantization="gguf")
    for split in common.TRAIN_SPLITS:
        replies = common.served_distilled(split, args, "chat")
        folder = common.TRAINING_REPLIES if split in common.UNSHIPPED_SPLITS else common.DISTILLED
        assert replies == folder / f"{split}-gguf-chat.jsonl.gz"
        assert probe_eagle.replies_file(f"{split}-gguf-chat") == replies  # the drafter's training reads them there
    assert common.served_distilled("heldout", args, "greedy").parent == common.DISTILLED
