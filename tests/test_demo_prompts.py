"""The demo's prompt set (scripts/demo_prompts.py): held-out prompts stay unseen in every training round."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import demo_prompts  # noqa: E402

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
    assert not any(demo_prompts.is_heldout(r["group"]) for r in more)
    assert {r["group"] for r in heldout}.isdisjoint(r["group"] for r in train + more)
    assert [r["id"] for r in more] == list(range(len(more)))


def test_shipped_prompt_files_keep_held_out_prompts_unseen():
    train, heldout, more = _read("train"), _read("heldout"), _read("train_more")
    held_groups = {r["group"] for r in heldout}
    assert len(train) >= 3000 and len(heldout) >= 200 and len(more) >= 3000
    assert held_groups.isdisjoint(r["group"] for r in train + more)
    assert all(demo_prompts.is_heldout(r["group"]) for r in heldout)
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
        assert not any(demo_prompts.is_heldout(r["group"]) for r in rows), name


def test_round_four_asks_nothing_the_rounds_before_it_asked():
    names = ("train", "heldout", "train_more", "train_wide")
    rows = demo_prompts.build_deep([PROMPTS / f"{name}.jsonl" for name in names])
    before = {r["messages"][0]["content"] for name in names for r in _read(name)}
    texts = {r["messages"][0]["content"] for r in rows}
    assert len(texts) == len(rows) and not before & texts
    assert not any(demo_prompts.is_heldout(r["group"]) for r in rows)
    assert {r["source"] for r in rows} >= {"python-docs", "generated"}
    assert [r["id"] for r in rows] == list(range(len(rows)))


def test_distilling_a_round_whose_prompt_file_is_missing_says_how_to_write_it(tmp_path, monkeypatch):
    import argparse

    import build_demo

    monkeypatch.setattr(build_demo, "PROMPTS", tmp_path)
    monkeypatch.setattr(build_demo, "load_served", lambda args: pytest.fail("the backbone loads before the check"))
    args = argparse.Namespace(distill_splits=["train_deep"], served_settings=["chat"], quantization="gguf")
    with pytest.raises(SystemExit, match=r"train_deep\.jsonl.*--round 4"):
        build_demo.stage_distill_served(args)
