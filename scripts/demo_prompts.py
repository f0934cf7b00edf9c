"""The demo model's seed prompts for self-distillation (paper 2.3.2), built offline.

No dataset can be downloaded here, so prompts come from four sources, all on this machine:

1. hand-written seed topics × task templates over MT-Bench's eight categories (writing, roleplay,
   reasoning, math, coding, extraction, STEM, humanities) plus everyday questions and advice;
   reasoning and math prompts draw fresh names and numbers from a seeded generator;
2. Python's own documentation: docstrings of the standard library (``inspect.getdoc``), asked
   about, summarised or extracted from;
3. Debian's documentation: package descriptions from ``/var/lib/dpkg/status``;
4. self-instruct: questions the backbone itself writes about seed topics (``--self-instruct FILE``,
   made by ``scripts/build_demo.py --stages self_instruct``).

Round 3 (``--round 3``, ``train_wide.jsonl``; distilled on a GPU) widens the training set without touching
rounds 1-2: every pairing of the seed topics with every task template, more drawn problems and texts,
docstrings of the whole standard library, and the short descriptions of the ~63,000 packages in the
Debian archive's index (``/var/lib/apt/lists``, read with ``lz4cat``); prompts already in a round, and
every prompt of a held-out group, are left out. Round 4 (``--round 4``, ``train_deep.jsonl``; distilled
on a GPU at the app's chat settings, then left out of the heads and the repository: the model card says why)
goes deeper into the same sources, the templates being used up: 7,000 more packages of the index (with
writing, everyday and roleplay tasks too), 3,000 more docstrings, more drawn problems and extraction texts.
Round 5 (``--round 5``, ``train_topics.jsonl``) gives round 3's task templates new topics, written by the
backbone itself: it continues lists of seed topics (``topic_requests``, sampled by ``scripts/build_demo.py --stages
topics`` into ``prompts/topics.jsonl``), and every new topic that is no seed or held-out topic (up to case,
articles and a plural) gets two task templates of its kind. Round 6 (``--round 6``, ``train_topics6.jsonl``)
does the same with lists whose examples are round 5's topics (``--stages topics --topic-round 6`` into
``prompts/topics6.jsonl``), leaving out every topic of the rounds before.

About one prompt in seven gets a follow-up turn (``"followup"``), which distillation answers after
the model's own first reply, so the heads also see multi-turn conversations.

Held-out prompts never share a *topic group* with training prompts: the split hashes the group
(category + seed topic, or source document), not the prompt text, so held-out figures are not
inflated by near-duplicates. Output rows: ``{"id", "category", "source", "messages", "followup"?}``.

    python scripts/demo_prompts.py --out assets/demo/prompts [--self-instruct build/demo/self_instruct.jsonl]
    python scripts/demo_prompts.py --round 3   # round 3 only: assets/demo/prompts/train_wide.jsonl
    python scripts/demo_prompts.py --round 4   # round 4 only: assets/demo/prompts/train_deep.jsonl
    python scripts/demo_prompts.py --round 5   # round 5 only: assets/demo/prompts/train_topics.jsonl, from topics.jsonl
    python scripts/demo_prompts.py --round 6   # round 6 only: assets/demo/prompts/train_topics6.jsonl, from topics6.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_seeds import FOLLOWUPS, MORE_PYTHON_MODULES  # noqa: E402
from demo_build.prompt_sources import (SEED, template_prompts, more_template_prompts, wide_template_prompts,
                                       reasoning_and_math, python_doc_prompts, debian_doc_prompts, DEEP_INDEX_TASKS,
                                       debian_index_prompts, extraction_prompts, self_instruct_prompts, is_heldout)  # noqa: E402  (scripts/ is on the path)
from demo_build.topic_rounds import TOPIC_ROUNDS, read_topics, topic_prompts  # noqa: E402


def _rows(sources, rng: random.Random, seen: set[str]) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) of new prompts from ``(source, prompts)`` pairs, in order."""
    train, heldout = [], []
    for source, prompts in sources:
        for category, group, prompt in prompts:
            if prompt in seen:
                continue
            seen.add(prompt)
            row = {"category": category, "source": source, "group": group,
                   "messages": [{"role": "user", "content": prompt}]}
            if rng.random() < 1 / 7:
                row["followup"] = rng.choice(FOLLOWUPS)
            (heldout if is_heldout(group) else train).append(row)
    for split in (train, heldout):
        rng.shuffle(split)
        for n, row in enumerate(split):
            row["id"] = n
    return train, heldout


def build(self_instruct: Path | None = None) -> tuple[list[dict], list[dict], list[dict]]:
    """(round-1 train rows, held-out rows, round-2 train rows), deterministic for a given machine and
    self-instruct file.

    Round 2 is a second, larger set of training prompts (new seed topics and templates, more
    documentation, more drawn problems) that never repeats a round-1 prompt; its prompts in held-out
    groups are dropped, so the held-out set stays the one the first heads were measured on.
    """
    rng = random.Random(SEED)
    sources = [("template", template_prompts(rng)), ("generated", reasoning_and_math(rng, 420)),
               ("generated", extraction_prompts(rng, 160)), ("python-docs", python_doc_prompts(rng, 420)),
               ("debian-docs", debian_doc_prompts(rng, 260)), ("self-instruct", self_instruct_prompts(self_instruct))]
    seen: set[str] = set()
    train, heldout = _rows(sources, rng, seen)
    rng = random.Random(SEED + 1)
    more = [("template", more_template_prompts(rng)), ("generated", reasoning_and_math(rng, 900, start=420)),
            ("generated", extraction_prompts(rng, 300, start=160)),
            ("python-docs", python_doc_prompts(rng, 900, MORE_PYTHON_MODULES)),
            ("debian-docs", debian_doc_prompts(rng, 1000))]
    train_more, _ = _rows(more, rng, seen)
    return train, heldout, train_more


def _existing_rows(existing: list[Path]) -> list[dict]:
    """Every row of the ``existing`` prompt files."""
    return [json.loads(line) for path in existing for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _seen_prompts(rows: list[dict]) -> set[str]:
    """Every user message of prompt ``rows``."""
    return {m["content"] for row in rows for m in row["messages"] if m["role"] == "user"}


def _stdlib_modules() -> list[str]:
    """The standard library's public modules that import on this machine."""
    stdlib = sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in ("antigravity", "this", "idlelib", "turtledemo"))
    modules = []
    for name in stdlib:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(name)
            modules.append(name)
        except Exception:  # platform-only or broken modules (msvcrt, tkinter without Tk...)
            continue
    return modules


def build_wide(existing: list[Path]) -> list[dict]:
    """Round-3 training rows: prompts of none of the ``existing`` prompt files and of no held-out group."""
    rng = random.Random(SEED + 2)
    sources = [("template", wide_template_prompts(rng)), ("generated", reasoning_and_math(rng, 2000, start=1320)),
               ("generated", extraction_prompts(rng, 800, start=460)), ("python-docs", python_doc_prompts(rng, 2500, _stdlib_modules())),
               ("debian-index", debian_index_prompts(rng, 2500))]
    train, _ = _rows(sources, rng, _seen_prompts(_existing_rows(existing)))
    return train


def build_deep(existing: list[Path]) -> list[dict]:
    """Round-4 training rows (``train_deep``): deeper into the same documentation and drawn problems, none
    of the ``existing`` prompt files' prompts and no held-out group. The templates were used up by round 3,
    so this round is the Debian archive's index (7,000 more packages, with writing, everyday and roleplay
    tasks too), the standard library (3,000 more docstrings, those round 3 did not ask about), 2,000 more
    reasoning/math problem pairs and 1,000 more extraction texts."""
    rng = random.Random(SEED + 3)
    sources = [("debian-index", debian_index_prompts(rng, 7000, tasks=DEEP_INDEX_TASKS)),
               ("python-docs", python_doc_prompts(rng, 3000, _stdlib_modules())),
               ("generated", reasoning_and_math(rng, 2000, start=3320)), ("generated", extraction_prompts(rng, 1000, start=1260))]
    train, _ = _rows(sources, rng, _seen_prompts(_existing_rows(existing)))
    return train


def build_topics(existing: list[Path], topics: Path, seed: int = SEED + 4) -> list[dict]:
    """A topic round's training rows (round 5: ``train_topics``, round 6: ``train_topics6``): topics the backbone listed
    itself (``topics``: ``read_topics``), each with round 3's task templates of its kind, for self-distillation (paper
    2.3.2); none of the ``existing`` files' prompts, topics or held-out groups. Deterministic for a ``seed``.
    Raises ``SystemExit`` saying how to write ``topics`` when it is not there."""
    listed = read_topics(topics)
    before = _existing_rows(existing)
    rng = random.Random(seed)
    sources = [("backbone-topics", topic_prompts(rng, listed, {r["group"] for r in before}))]
    train, _ = _rows(sources, rng, _seen_prompts(before))
    return train


#: The prompt files in the order they were written (``build`` writes the first three).
PROMPT_FILES = ("train", "heldout", "train_more", "train_wide", "train_deep", "train_topics", "train_topics6")


#: ``--round N``: (its file, the function that builds its rows from the files before it; a topic round's also reads
#: its topics file).
LATER_ROUNDS = {3: ("train_wide", build_wide), 4: ("train_deep", build_deep), 5: ("train_topics", build_topics),
                6: ("train_topics6", build_topics)}


def write_rows(path: Path, rows: list[dict]) -> None:
    """Prompt rows as JSONL, each row's ``id`` first."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"id": row.pop("id"), **row}, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "assets" / "demo" / "prompts")
    p.add_argument("--self-instruct", type=Path, help="questions the backbone wrote (JSONL)")
    p.add_argument("--round", type=int, choices=sorted(LATER_ROUNDS), help="write only this training round (3: "
                   "train_wide.jsonl; 4: train_deep.jsonl; 5: train_topics.jsonl, from --topics; 6: train_topics6.jsonl, "
                   "from --topics), next to the rounds before it")
    p.add_argument("--topics", type=Path, help="rounds 5 and 6: the topics the backbone listed (default: topics.jsonl, "
                   "round 6 topics6.jsonl, in --out, from scripts/build_demo.py --stages topics --topic-round N)")
    args = p.parse_args(argv)
    if args.round:
        name, build_round = LATER_ROUNDS[args.round]
        before = PROMPT_FILES[: PROMPT_FILES.index(name)]  # every file written before this round
        missing = [earlier for earlier in before if not (args.out / f"{earlier}.jsonl").exists()]
        if missing:
            later = [n for n, (f, _) in LATER_ROUNDS.items() if f in missing]
            raise SystemExit(f"round {args.round} reads every prompt file before it; missing in {args.out}: "
                             + ", ".join(f"{m}.jsonl" for m in missing)
                             + (f" (write it first: python scripts/demo_prompts.py --round {later[0]})" if later else ""))
        topics = TOPIC_ROUNDS.get(args.round)
        rows = build_round([args.out / f"{earlier}.jsonl" for earlier in before],
                           *([args.topics or args.out / topics[0], topics[1]] if topics else []))
        write_rows(args.out / f"{name}.jsonl", rows)
        counts = Counter(row["category"] for row in rows)
        print(f"{len(rows)} round-{args.round} training prompts ({sum('followup' in r for r in rows)} with a follow-up turn): "
              + ", ".join(f"{c} {n}" for c, n in sorted(counts.items())), file=sys.stderr)
        return
    train, heldout, train_more = build(args.self_instruct)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("heldout", heldout), ("train_more", train_more)):
        write_rows(args.out / f"{name}.jsonl", rows)
    counts: dict[str, list[int]] = {}
    for split, rows in ((0, train), (1, heldout), (2, train_more)):
        for row in rows:
            counts.setdefault(row["category"], [0, 0, 0])[split] += 1
    print(f"{len(train)} training prompts, {len(heldout)} held out, {len(train_more)} round-2 training prompts "
          f"({sum('followup' in r for r in train + heldout + train_more)} with a follow-up turn)", file=sys.stderr)
    print(f"  {'category':<11} {'train':>5} {'held':>5} {'more':>5}", file=sys.stderr)
    for cat, (a, b, c) in sorted(counts.items()):
        print(f"  {cat:<11} {a:5d} {b:5d} {c:5d}", file=sys.stderr)


if __name__ == "__main__":
    main()
