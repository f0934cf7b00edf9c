"""Topic rounds (5 and 6) of the demo's prompts: list openings the backbone continues with new topics
(``scripts/build_demo.py --stages topics``), the topics read back from its continuations, and each new topic with
task templates of its kind (``scripts/demo_prompts.py --round 5`` / ``--round 6``)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from demo_seeds import (WRITING_FORMS, WRITING_TOPICS, AUDIENCES, ROLES, ROLE_REQUESTS, STEM_CONCEPTS, HUMANITIES,
                        EVERYDAY, CODING_TASKS, CODING_LANGS, MORE_WRITING_TOPICS, MORE_ROLES, MORE_ROLE_REQUESTS,
                        MORE_STEM_CONCEPTS, MORE_HUMANITIES, MORE_EVERYDAY, MORE_CODING_TASKS, MORE_CODING_TEMPLATES)

from .prompt_sources import SEED, WRITING_TASKS, STEM_TASKS, HUMANITIES_TASKS, EVERYDAY_TASKS, is_heldout


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
