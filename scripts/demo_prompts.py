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
import hashlib
import importlib
import inspect
import json
import random
import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

SEED = 0
HELDOUT_PER_MILLE = 80  # ~8 % of topic groups are held out

from demo_seeds import (  # the seed tables
    WRITING_FORMS, WRITING_TOPICS, AUDIENCES, EMAIL_SITUATIONS, ROLES,
    ROLE_REQUESTS, STEM_CONCEPTS, STEM_PAIRS, HUMANITIES, EVERYDAY,
    EVERYDAY_QUESTIONS, CODING_TASKS, CODING_LANGS, CODING_HOWTO, CODE_SNIPPETS,
    NAMES, ITEMS, CITIES, FOLLOWUPS, PYTHON_MODULES,
    MORE_WRITING_TOPICS, MORE_WRITING_TASKS, MORE_ROLES, MORE_ROLE_REQUESTS, MORE_STEM_CONCEPTS,
    MORE_STEM_TASKS, MORE_HUMANITIES, MORE_HUMANITIES_TASKS, MORE_EVERYDAY, MORE_EVERYDAY_TASKS,
    MORE_CODING_TASKS, MORE_CODING_TEMPLATES, MORE_CODING_HOWTO, MORE_PYTHON_MODULES,
)

#: Round 3's task templates of each kind (round 2 draws from the writing ones, round 5 two of its kind a topic).
WRITING_TASKS = MORE_WRITING_TASKS + ["Write a {form} about {topic}."]
STEM_TASKS = MORE_STEM_TASKS + ["Explain {c} in simple terms.", "How does {c} work?", "Explain {c} to a ten-year-old."]
HUMANITIES_TASKS = MORE_HUMANITIES_TASKS + ["Tell me about {c}.", "What can we learn today from {c}?"]
EVERYDAY_TASKS = MORE_EVERYDAY_TASKS + ["Give me three tips to {g}.", "I want to {g}. Where should I start?"]


# --------------------------------------------------------------------------------- generators
def template_prompts(rng: random.Random):
    """(category, group, prompt) from seed topics × templates."""
    for form in WRITING_FORMS:
        for topic in rng.sample(WRITING_TOPICS, 12):
            yield "writing", f"w:{topic}", f"Write a {form} about {topic}."
    for topic in WRITING_TOPICS:
        for audience in rng.sample(AUDIENCES, 3):
            yield "writing", f"w:{topic}", f"Write a short message for {audience} about {topic}."
    for situation in EMAIL_SITUATIONS:
        for person in rng.sample(AUDIENCES, 4):
            yield "writing", f"e:{situation}", f"Write an email to {person} {situation}."
    for role in ROLES:
        for request in rng.sample(ROLE_REQUESTS, 6):
            yield "roleplay", f"r:{role}", f"Pretend you are {role}. {request}"
        yield "roleplay", f"r:{role}", f"You are {role}. Stay in character and greet a visitor."
    for concept in STEM_CONCEPTS:
        for t in ["Explain {c} in simple terms.", "What is {c}?", "How does {c} work?",
                  "Why is {c} important?", "Give me three facts about {c}.", "Explain {c} to a ten-year-old."]:
            if rng.random() < 0.75:
                yield "stem", f"s:{concept}", t.format(c=concept)
    for a, b in STEM_PAIRS:
        yield "stem", f"sp:{a}", f"What is the difference between {a} and {b}?"
        yield "stem", f"sp:{a}", f"Compare {a} and {b} in a short table."
    for topic in HUMANITIES:
        for t in ["Tell me about {c}.", "Why is {c} important in history?", "Summarise {c} in a paragraph.",
                  "What can we learn today from {c}?", "Give three interesting facts about {c}.",
                  "Write a short essay question and answer about {c}."]:
            if rng.random() < 0.75:
                yield "humanities", f"h:{topic}", t.format(c=topic)
    for goal in EVERYDAY:
        for t in ["How can I {g}?", "Give me three tips to {g}.", "What is the easiest way to {g}?",
                  "I want to {g}. Where should I start?"]:
            if rng.random() < 0.8:
                yield "everyday", f"d:{goal}", t.format(g=goal)
    for q in EVERYDAY_QUESTIONS:
        yield "everyday", f"q:{q}", q
    for task in CODING_TASKS:
        for t in ["Write a Python function that {t}.", "Write a function that {t}, with a docstring and an example.",
                  "How would you write code that {t}? Explain your approach."]:
            yield "coding", f"c:{task}", t.format(t=task)
        lang = rng.choice(CODING_LANGS[1:])
        yield "coding", f"c:{task}", f"Write a {lang} function that {task}."
    for howto in CODING_HOWTO:
        for lang in rng.sample(CODING_LANGS, 3):
            yield "coding", f"ch:{howto}", f"How do I {howto} in {lang}?"
    for n, code in enumerate(CODE_SNIPPETS):
        for t in ["Explain what this code does:\n\n{c}", "Is there a bug in this code? \n\n{c}",
                  "How could I improve this code?\n\n{c}"]:
            yield "coding", f"cs:{n}", t.format(c=code)


def more_template_prompts(rng: random.Random):
    """Round 2 (category, group, prompt): new seed topics and templates, and unused round-1 pairings."""
    for topic in WRITING_TOPICS + MORE_WRITING_TOPICS:
        for form in rng.sample(WRITING_FORMS, 4):
            template = rng.choice(WRITING_TASKS)
            yield "writing", f"w:{topic}", template.format(form=form, topic=topic, audience=rng.choice(AUDIENCES))
    for role in ROLES + MORE_ROLES:
        for request in rng.sample(ROLE_REQUESTS + MORE_ROLE_REQUESTS, 5):
            yield "roleplay", f"r:{role}", f"Pretend you are {role}. {request}"
    for concept in STEM_CONCEPTS + MORE_STEM_CONCEPTS:
        for template in rng.sample(MORE_STEM_TASKS, 5):
            yield "stem", f"s:{concept}", template.format(c=concept)
    for topic in HUMANITIES + MORE_HUMANITIES:
        for template in rng.sample(MORE_HUMANITIES_TASKS, 4):
            yield "humanities", f"h:{topic}", template.format(c=topic)
    for goal in EVERYDAY + MORE_EVERYDAY:
        for template in rng.sample(MORE_EVERYDAY_TASKS, 3):
            yield "everyday", f"d:{goal}", template.format(g=goal)
    for task in CODING_TASKS + MORE_CODING_TASKS:
        for template in rng.sample(MORE_CODING_TEMPLATES, 3):
            yield "coding", f"c:{task}", template.format(t=task, lang=rng.choice(CODING_LANGS[1:]))
    for howto in CODING_HOWTO + MORE_CODING_HOWTO:
        for lang in rng.sample(CODING_LANGS, 3):
            yield "coding", f"ch:{howto}", f"How do I {howto} in {lang}?"


def wide_template_prompts(rng: random.Random):
    """Round 3 (category, group, prompt): every seed topic with every task template of its category."""
    for topic in WRITING_TOPICS + MORE_WRITING_TOPICS:
        for form in WRITING_FORMS:
            template = rng.choice(WRITING_TASKS)
            yield "writing", f"w:{topic}", template.format(form=form, topic=topic, audience=rng.choice(AUDIENCES))
    for situation in EMAIL_SITUATIONS:
        for person in AUDIENCES:
            yield "writing", f"e:{situation}", f"Write an email to {person} {situation}."
    for role in ROLES + MORE_ROLES:
        for request in ROLE_REQUESTS + MORE_ROLE_REQUESTS:
            yield "roleplay", f"r:{role}", f"Pretend you are {role}. {request}"
    for concept in STEM_CONCEPTS + MORE_STEM_CONCEPTS:
        for template in STEM_TASKS:
            yield "stem", f"s:{concept}", template.format(c=concept)
    for topic in HUMANITIES + MORE_HUMANITIES:
        for template in HUMANITIES_TASKS:
            yield "humanities", f"h:{topic}", template.format(c=topic)
    for goal in EVERYDAY + MORE_EVERYDAY:
        for template in EVERYDAY_TASKS:
            yield "everyday", f"d:{goal}", template.format(g=goal)
    for task in CODING_TASKS + MORE_CODING_TASKS:
        for lang in CODING_LANGS:
            yield "coding", f"c:{task}", f"Write a {lang} function that {task}."
        for template in MORE_CODING_TEMPLATES:
            yield "coding", f"c:{task}", template.format(t=task, lang=rng.choice(CODING_LANGS[1:]))
    for howto in CODING_HOWTO + MORE_CODING_HOWTO:
        for lang in CODING_LANGS:
            yield "coding", f"ch:{howto}", f"How do I {howto} in {lang}?"


def reasoning_and_math(rng: random.Random, n: int, start: int = 0):
    """Fresh reasoning and math problems with drawn names and numbers; each its own group (numbered from ``start``)."""
    for i in range(start, start + n):
        a, b, c = rng.sample(NAMES, 3)
        x, y, z = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 12)
        item, city = rng.choice(ITEMS), rng.choice(CITIES)
        reasoning = [
            f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain.",
            f"If all {item} in the box are red and {a} takes one from the box, what colour is it?",
            f"{a} is older than {b}. {c} is younger than {b}. Who is the oldest?",
            f"What comes next in the sequence {x}, {x + z}, {x + 2 * z}, {x + 3 * z}?",
            f"A train leaves {city} at {z % 12 + 1} o'clock and the trip takes {z % 5 + 2} hours. When does it arrive?",
            f"{a} has {x} {item} and gives {b} {min(x, y)}. How many does {a} have left? Think step by step.",
            f"If today is Monday, what day will it be in {x} days?",
            f"There are {x} people in a room and each shakes hands with everyone else once. How many handshakes?",
            f"Is the statement 'every square is a rectangle' true? Explain why.",
            f"{a}, {b} and {c} sit in a row. {a} is not at either end. Who sits in the middle?",
        ]
        math = [
            f"What is {x} times {y}?", f"What is {x * y} divided by {y}?", f"Solve for x: {z}x + {y} = {z * x + y}.",
            f"What is {x}% of {y * 10}?", f"What is the area of a rectangle that is {x} cm by {y} cm?",
            f"{a} buys {z} {item} at ${y} each. How much does {a} pay in total?",
            f"What is the square root of {z * z}?", f"Simplify the fraction {x * z}/{y * z}.",
            f"A car travels {x * 10} km in {z} hours. What is its average speed?",
            f"What is {x} + {y} × {z}? Remember the order of operations.",
            f"Convert {x} kilometres to metres.", f"What is the perimeter of a square with sides of {y} cm?",
            f"Find the mean of {x}, {y} and {z}.", f"Is {x * 2 + 1} a prime number?",
        ]
        yield "reasoning", f"rm:{i}", rng.choice(reasoning)
        yield "math", f"rm:{i}", rng.choice(math)


#: (category, template) of the tasks on a standard-library docstring; one is drawn per function.
PYTHON_DOC_TASKS = [
    ("coding", "What does the Python function `{func}` do? Give an example."),
    ("extraction", "Summarise this Python documentation in one sentence:\n\n{para}"),
    ("coding", "Show me how to use `{func}` in a short Python example."),
    ("extraction", "Here is the documentation of `{func}`:\n\n{para}\n\nList the arguments or inputs it mentions."),
]
#: (category, template) of the tasks on a Debian package description; one is drawn per package.
DEBIAN_DOC_TASKS = [
    ("extraction", "Summarise this software description in two sentences:\n\n{text}"),
    ("extraction", "Extract the main features from this text as a list:\n\n{text}"),
    ("stem", "What is a tool like '{name}' ({short}) used for?"),
]


def python_doc_prompts(rng: random.Random, n: int, modules: list[str] = PYTHON_MODULES):
    """Questions about the standard library (``modules``), with its own docstrings as the text to work on."""
    funcs = []
    for name in modules:
        mod = importlib.import_module(name)
        for attr in sorted(a for a in dir(mod) if not a.startswith("_")):
            with warnings.catch_warnings():  # deprecated aliases such as typing.io warn when looked at
                warnings.simplefilter("ignore", DeprecationWarning)
                obj = getattr(mod, attr, None)
                if not callable(obj):
                    continue
                doc = inspect.getdoc(obj) or ""
            para = doc.split("\n\n")[0].strip()
            if 40 <= len(para) <= 600 and not para.startswith(attr + "("):
                funcs.append((name, attr, para))
    rng.shuffle(funcs)
    for name, attr, para in funcs[:n]:
        category, template = rng.choice(PYTHON_DOC_TASKS)
        yield category, f"py:{name}", template.format(func=f"{name}.{attr}", para=para)


def debian_doc_prompts(rng: random.Random, n: int, status: Path = Path("/var/lib/dpkg/status")):
    """Extraction and summary prompts from Debian package descriptions on this machine."""
    if not status.exists():
        return
    entries = []
    for block in status.read_text(encoding="utf-8", errors="replace").split("\n\n"):
        name = re.search(r"^Package: (.+)$", block, re.M)
        desc = re.search(r"^Description: (.+(?:\n .+)*)", block, re.M)
        if name and desc:
            lines = [ln.strip() for ln in desc.group(1).splitlines()]
            text = " ".join(ln for ln in lines[1:] if ln != ".")
            if 80 <= len(text) <= 900:
                entries.append((name.group(1), lines[0], text))
    rng.shuffle(entries)
    for name, short, text in entries[:n]:
        category, template = rng.choice(DEBIAN_DOC_TASKS)
        yield category, f"deb:{name}", template.format(name=name, short=short, text=text)


#: (category, template) of the tasks on a package of the Debian archive's index (short description only).
DEBIAN_INDEX_TASKS = [
    ("stem", "What is a tool like '{name}' ({short}) used for?"),
    ("everyday", "I need {lower}. What should I look for in such a program?"),
    ("stem", "Explain what '{short}' means to someone new to computers."),
    ("coding", "How would I install and start using the Debian package '{name}'?"),
]
#: Round 4's tasks on a package of the index: round 3's and some of the other categories'.
DEEP_INDEX_TASKS = DEBIAN_INDEX_TASKS + [
    ("writing", "Write a short announcement for a new release of '{name}' ({short})."),
    ("everyday", "A friend recommends '{name}' ({short}). What are the pros and cons of trying it?"),
    ("writing", "Write a two-sentence description of '{name}' for a software catalogue: {short}."),
    ("roleplay", "Pretend you are the author of '{name}' ({short}). Introduce your program to a new user."),
]


def debian_index_prompts(rng: random.Random, n: int, lists: Path = Path("/var/lib/apt/lists"),
                         tasks: list[tuple[str, str]] = DEBIAN_INDEX_TASKS):
    """Prompts about packages of the Debian archive's index (``*_Packages.lz4``, read with ``lz4cat``), one of
    ``tasks`` each; nothing when the index or ``lz4cat`` is missing."""
    entries = {}
    for index in sorted(lists.glob("*_Packages.lz4")):
        try:
            text = subprocess.run(["lz4cat", str(index)], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            continue
        for name, short in re.findall(r"^Package: (.+)\n(?:.+\n)*?Description: (.+)$", text, re.M):
            if 12 <= len(short) <= 90 and not re.search(r"\b(data|transitional|dummy|debug|development files|library)\b", short, re.I):
                entries[name] = short
    items = sorted(entries.items())
    rng.shuffle(items)
    for name, short in items[:n]:
        category, template = rng.choice(tasks)
        lower = short[0].lower() + short[1:] if short[:2].isalpha() and not short[:2].isupper() else short
        yield category, f"deb:{name}", template.format(name=name, short=short, lower=lower)


def extraction_prompts(rng: random.Random, n: int, start: int = 0):
    """Extraction from short texts made of drawn names, places, dates and prices (groups numbered from ``start``)."""
    months = ["January", "March", "May", "July", "September", "November"]
    for i in range(start, start + n):
        a, b = rng.sample(NAMES, 2)
        city, month, day = rng.choice(CITIES), rng.choice(months), rng.randint(1, 28)
        price, qty, item = rng.randint(5, 300), rng.randint(1, 9), rng.choice(ITEMS)
        texts = [
            f"Dear {b}, I will arrive in {city} on {month} {day} and stay for {qty} nights. Best, {a}",
            f"Order #{rng.randint(1000, 9999)}: {qty} boxes of {item} at ${price} each, shipped to {a} in {city}.",
            f"Meeting notes: {a} and {b} agreed to launch the project in {month}. Budget: ${price * 100}.",
            f"Review by {a}: The hotel in {city} was clean and quiet, but breakfast was expensive (${price % 40 + 10}). 4/5.",
        ]
        text = rng.choice(texts)
        q = rng.choice(["Extract all names, places and dates from this text.",
                        "Extract the key facts from this text as JSON.",
                        "What is the main point of this text? Answer in one sentence.",
                        "List every number in this text and what it refers to."])
        yield "extraction", f"x:{i}", f"{q}\n\n{text}"


def self_instruct_prompts(path: Path | None):
    """Questions the backbone wrote itself (see ``scripts/build_demo.py --stages self_instruct``)."""
    if path is None or not path.exists():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        question = row["question"]
        if '"' in question:  # 'A beginner might ask: "How do I ...?' -> the quoted question
            question = question.split('"', 1)[1].strip()
        if len(question) >= 15 and not question.lower().startswith(("what would you ask", "what a ")):
            yield row["category"], f"si:{row['topic']}", question


SELF_INSTRUCT_TOPICS = ([("stem", c) for c in STEM_CONCEPTS] + [("humanities", h) for h in HUMANITIES]
                        + [("everyday", f"how to {e}") for e in EVERYDAY] + [("writing", w) for w in WRITING_TOPICS])


def self_instruct_requests() -> list[dict]:
    """The requests that make the backbone write its own questions: one per seed topic and style."""
    styles = ["a curious student", "a beginner", "someone planning a project", "a teacher preparing a lesson"]
    return [{"category": cat, "topic": topic, "style": style,
             "request": f"Write one question that {style} might ask about {topic}. Reply with the question only."}
            for cat, topic in SELF_INSTRUCT_TOPICS for style in styles]


# ---------------------------------------------------------------------------------------- build
def is_heldout(group: str) -> bool:
    """Stable split on the topic group (not the prompt): ~8 % of groups are held out."""
    return int(hashlib.sha256(group.encode()).hexdigest(), 16) % 1000 < HELDOUT_PER_MILLE


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


#: Round 5's topic kinds: kind -> (category, group prefix as in round 3, what the list is of, the seed topics
#: a request shows as examples). Coding seeds are whole exercises, "Write a function that ...".
TOPIC_KINDS = {
    "writing": ("writing", "w:", "things someone could write a poem or a story about", WRITING_TOPICS + MORE_WRITING_TOPICS),
    "roleplay": ("roleplay", "r:", "characters someone could pretend to be", ROLES + MORE_ROLES),
    "stem": ("stem", "s:", "science and technology concepts", STEM_CONCEPTS + MORE_STEM_CONCEPTS),
    "humanities": ("humanities", "h:", "topics in history, art, literature and culture", HUMANITIES + MORE_HUMANITIES),
    "everyday": ("everyday", "d:", "things people want to learn to do", EVERYDAY + MORE_EVERYDAY),
    "coding": ("coding", "c:", "small programming exercises",
               [f"Write a function that {t}." for t in CODING_TASKS + MORE_CODING_TASKS]),
}
#: Round 5's prompts per new topic: many topics, few prompts each (the topics are what round 3 used up).
TEMPLATES_PER_TOPIC = 2
_CODING_EXERCISE = re.compile(r"Write a function that ([a-z][^.?!:;`]{8,90})\.?$")


#: Topic rounds: round -> (its topics file in the prompts folder, the seed of its list openings and of its prompts'
#: templates, the topics file whose topics its lists show as examples, None: ``TOPIC_KINDS``' seed topics).
TOPIC_ROUNDS = {5: ("topics.jsonl", SEED + 4, None), 6: ("topics6.jsonl", SEED + 6, "topics.jsonl")}


def read_topics(path: Path) -> list[tuple[str, str]]:
    """(kind, topic) of a topics file (JSONL rows ``{"kind", "topic"}``, ``scripts/build_demo.py --stages topics``).
    Raises ``SystemExit`` saying how to write it when it is not there."""
    if not path.exists():
        round_ = next((n for n, (name, *_) in TOPIC_ROUNDS.items() if name == path.name), 5)
        raise SystemExit(f"no topics file {path} (python scripts/build_demo.py --stages topics --topic-round {round_} writes it)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [(r["kind"], r["topic"]) for r in rows]


def topic_requests(per_kind: int, seed: int = SEED + 4, examples: list[tuple[str, str]] | None = None) -> list[dict]:
    """A topic round's requests: ``per_kind`` list openings of each ``TOPIC_KINDS`` kind for the backbone to continue
    (plain text, no chat template), each with six topics of training groups as its first items: ``TOPIC_KINDS``' seed
    topics (round 5), or those of ``examples`` (kind, topic), e.g. an earlier round's topics (round 6); the topics
    become prompts for self-distillation (paper 2.3.2). Rows ``{"kind", "request"}``; deterministic for a seed.
    Raises ``ValueError`` (``random.sample``) when a kind has fewer than six training topics to show."""
    rng = random.Random(seed)
    requests = []
    for kind, (_, prefix, what, seeds) in TOPIC_KINDS.items():
        if examples is None:
            shown = [s for s in seeds if not is_heldout(prefix + _coding_task(s) if kind == "coding" else prefix + s)]
        else:  # an earlier round's topics, once each (coding: its tasks as exercises)
            topics = dict.fromkeys(t for k, t in examples if k == kind and not is_heldout(prefix + t))
            shown = [f"Write a function that {t}." if kind == "coding" else t for t in topics]
        for _ in range(per_kind):
            items = "".join(f"- {s}\n" for s in rng.sample(shown, 6))
            requests.append({"kind": kind, "request": f"A list of {what}:\n{items}-"})
    return requests


def _coding_task(line: str) -> str:
    match = _CODING_EXERCISE.match(line)
    return match.group(1).strip() if match else ""


def parse_topics(kind: str, continuation: str) -> list[str]:
    """The topics in the backbone's continuation of a ``topic_requests`` list (which ends with ``"-"``): its
    ``"- item"`` lines up to the first line that is not one, each kept when it reads like a seed topic
    (3-60 characters, ≤ 8 words, starting with a letter, no digits, quotes or sentence punctuation;
    coding: the task of a "Write a function that ..." exercise)."""
    topics = []
    for n, line in enumerate(("-" + continuation).splitlines()):
        if not line.startswith("- "):
            if n == 0 or line.strip():
                break
            continue
        item = line[2:].strip().rstrip(".").strip()
        if kind == "coding":
            item = _coding_task(item + ".")
        elif not (3 <= len(item) <= 60 and len(item.split()) <= 8 and item[0].isalpha()
                  and not re.search(r"[0-9\"*:;?!()\[\]{}<>/#=_`|]", item)):
            continue
        if item:
            topics.append(item)
    return topics


def _topic_key(topic: str) -> str:
    """A topic compared without case, a leading article or a trailing plural "s"."""
    words = topic.lower().split()
    if words and words[0] in ("a", "an", "the"):
        words = words[1:]
    return " ".join(words).rstrip("s")


def topic_prompts(rng: random.Random, topics: list[tuple[str, str]], seen_groups: set[str]):
    """Round 5 (category, group, prompt): each new topic with ``TEMPLATES_PER_TOPIC`` of round 3's task templates of
    its kind, drawn (coding: a language's function, then the rest). A topic that is a seed topic, or a held-out topic up to case, articles and a
    plural, is left out (``seen_groups``: the groups of the files before, held-out ones included; and every seed
    topic, whose held-out groups round 3 dropped)."""
    taken = {_topic_key(g.split(":", 1)[1]) for g in seen_groups if ":" in g}
    taken |= {_topic_key(_coding_task(s) if kind == "coding" else s) for kind, (*_, seeds) in TOPIC_KINDS.items() for s in seeds}
    for kind, topic in topics:
        category, prefix, _, _ = TOPIC_KINDS[kind]
        if _topic_key(topic) in taken:
            continue
        taken.add(_topic_key(topic))
        group = prefix + topic
        if kind == "writing":
            for form in rng.sample(WRITING_FORMS, TEMPLATES_PER_TOPIC):
                template = rng.choice(WRITING_TASKS)
                yield category, group, template.format(form=form, topic=topic, audience=rng.choice(AUDIENCES))
        elif kind == "roleplay":
            for request in rng.sample(ROLE_REQUESTS + MORE_ROLE_REQUESTS, TEMPLATES_PER_TOPIC):
                yield category, group, f"Pretend you are {topic}. {request}"
        elif kind == "coding":
            yield category, group, f"Write a {rng.choice(CODING_LANGS)} function that {topic}."
            for template in rng.sample(MORE_CODING_TEMPLATES, TEMPLATES_PER_TOPIC - 1):
                yield category, group, template.format(t=topic, lang=rng.choice(CODING_LANGS[1:]))
        else:
            templates = {"stem": STEM_TASKS, "humanities": HUMANITIES_TASKS, "everyday": EVERYDAY_TASKS}[kind]
            for template in rng.sample(templates, TEMPLATES_PER_TOPIC):
                yield category, group, template.format(c=topic, g=topic)


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
