"""Where the demo's seed prompts come from (``scripts/demo_prompts.py`` builds the rounds from them): seed topics ×
task templates, drawn reasoning, math and extraction problems, Python's and Debian's documentation on this machine,
the backbone's own questions; and the held-out split on topic groups."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import random
import re
import subprocess
import warnings
from pathlib import Path

from demo_seeds import (  # the seed tables
    WRITING_FORMS, WRITING_TOPICS, AUDIENCES, EMAIL_SITUATIONS, ROLES,
    ROLE_REQUESTS, STEM_CONCEPTS, STEM_PAIRS, HUMANITIES, EVERYDAY,
    EVERYDAY_QUESTIONS, CODING_TASKS, CODING_LANGS, CODING_HOWTO, CODE_SNIPPETS,
    NAMES, ITEMS, CITIES, PYTHON_MODULES,
    MORE_WRITING_TOPICS, MORE_WRITING_TASKS, MORE_ROLES, MORE_ROLE_REQUESTS, MORE_STEM_CONCEPTS,
    MORE_STEM_TASKS, MORE_HUMANITIES, MORE_HUMANITIES_TASKS, MORE_EVERYDAY, MORE_EVERYDAY_TASKS,
    MORE_CODING_TASKS, MORE_CODING_TEMPLATES, MORE_CODING_HOWTO,
)

SEED = 0
HELDOUT_PER_MILLE = 80  # ~8 % of topic groups are held out


#: Round 3's task templates of each kind (round 2 draws from the writing ones, round 5 two of its kind a topic).
WRITING_TASKS = MORE_WRITING_TASKS + ["Write a {form} about {topic}."]
STEM_TASKS = MORE_STEM_TASKS + ["Explain {c} in simple terms.", "How does {c} work?", "Explain {c} to a ten-year-old."]
HUMANITIES_TASKS = MORE_HUMANITIES_TASKS + ["Tell me about {c}.", "What can we learn today from {c}?"]
EVERYDAY_TASKS = MORE_EVERYDAY_TASKS + ["Give me three tips to {g}.", "I want to {g}. Where should I start?"]


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
            "Is the statement 'every square is a rectangle' true? Explain why.",
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


def is_heldout(group: str) -> bool:
    """Stable split on the topic group (not the prompt): ~8 % of groups are held out."""
    return int(hashlib.sha256(group.encode()).hexdigest(), 16) % 1000 < HELDOUT_PER_MILLE
