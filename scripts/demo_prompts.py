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

About one prompt in seven gets a follow-up turn (``"followup"``), which distillation answers after
the model's own first reply, so the heads also see multi-turn conversations.

Held-out prompts never share a *topic group* with training prompts: the split hashes the group
(category + seed topic, or source document), not the prompt text, so held-out figures are not
inflated by near-duplicates. Output rows: ``{"id", "category", "source", "messages", "followup"?}``.

    python scripts/demo_prompts.py --out assets/demo/prompts [--self-instruct build/demo/self_instruct.jsonl]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import random
import re
import sys
from pathlib import Path

SEED = 0
HELDOUT_PER_MILLE = 80  # ~8 % of topic groups are held out

# ----------------------------------------------------------------------------------- seed topics
WRITING_FORMS = ["short story", "poem", "haiku", "limerick", "blog post", "product description", "speech",
                 "letter", "diary entry", "news headline and summary", "motivational message", "toast",
                 "short essay", "dialogue", "slogan", "review", "cover letter", "thank-you note", "tweet",
                 "birthday message"]
WRITING_TOPICS = ["autumn leaves", "a lost cat", "the first day of school", "a rainy city", "the ocean", "friendship",
                  "a robot learning to paint", "climate change", "a small bakery", "space travel", "a mountain hike",
                  "the importance of sleep", "a new smartphone", "a local library", "learning a language",
                  "a winter morning", "a grandmother's recipe", "electric cars", "a dragon who is afraid of fire",
                  "working from home", "a summer festival", "the moon", "a village by the sea", "coffee",
                  "a train journey", "recycling", "a chess tournament", "the internet", "gardening",
                  "a time traveler", "music", "a football match", "a lighthouse keeper", "volunteering",
                  "a forgotten key", "the city at night", "honeybees", "a birthday party", "a quiet forest",
                  "a job interview", "kindness", "a snowstorm", "the desert", "an old photograph", "bicycles"]
AUDIENCES = ["children", "a teenager", "my boss", "a close friend", "new employees", "customers", "my neighbours",
             "a teacher", "the city council", "my grandparents"]
EMAIL_SITUATIONS = ["asking for a day off", "apologising for a late reply", "inviting them to a meeting",
                    "complaining about a broken product", "thanking them for their help", "asking for feedback",
                    "announcing a new project", "requesting a refund", "introducing myself", "rescheduling an appointment"]

ROLES = ["a pirate captain", "a medieval knight", "a friendly librarian", "a travel guide in Rome", "a detective",
         "a chef in a busy restaurant", "a fitness coach", "a wise old wizard", "an astronaut on the ISS",
         "a museum tour guide", "a customer support agent", "a job interviewer", "a history teacher",
         "Sherlock Holmes", "a tour guide in Tokyo", "a park ranger", "a radio DJ", "a shopkeeper in a small town",
         "a robot butler", "a sports commentator", "a doctor", "a poet", "a startup founder", "a farmer",
         "a ship's navigator", "a jazz musician", "a kindergarten teacher", "a mountain guide", "a news reporter",
         "a famous painter", "a space alien visiting Earth", "a barista", "a lawyer", "a zookeeper",
         "a video game character", "a king giving a speech", "a gardener", "a taxi driver in London",
         "a marine biologist", "a stand-up comedian"]
ROLE_REQUESTS = ["Introduce yourself.", "Describe a typical day.", "Give me some advice.", "Tell me a short story.",
                 "What is the most important lesson you have learned?", "Welcome me and explain what you do.",
                 "Answer my question: what should I do first?", "Describe your favourite place.",
                 "What do you like most about your work?", "Tell me about the hardest day you remember."]

STEM_CONCEPTS = ["photosynthesis", "gravity", "the water cycle", "DNA", "black holes", "electricity", "magnetism",
                 "evolution", "the immune system", "climate change", "plate tectonics", "the speed of light",
                 "atoms", "chemical reactions", "vaccines", "the greenhouse effect", "machine learning",
                 "the internet", "binary numbers", "encryption", "renewable energy", "the human heart",
                 "the solar system", "earthquakes", "volcanoes", "friction", "sound waves", "rainbows",
                 "the periodic table", "bacteria and viruses", "nuclear energy", "the brain", "tides",
                 "compound interest", "probability", "a neural network", "an algorithm", "a CPU", "RAM",
                 "batteries", "antibiotics", "cells", "the ozone layer", "seasons", "inflation", "entropy",
                 "the Pythagorean theorem", "prime numbers", "fractions", "statistics", "GPS", "solar panels"]
STEM_PAIRS = [("a virus", "a bacterium"), ("weather", "climate"), ("speed", "velocity"), ("mass", "weight"),
              ("an atom", "a molecule"), ("AC", "DC current"), ("RAM", "storage"), ("a comet", "an asteroid"),
              ("mitosis", "meiosis"), ("heat", "temperature"), ("a list", "a tuple in Python"),
              ("HTTP", "HTTPS"), ("a planet", "a star"), ("an acid", "a base"), ("DNA", "RNA")]
HUMANITIES = ["the Roman Empire", "the French Revolution", "the Renaissance", "ancient Egypt", "World War I",
              "the Industrial Revolution", "the Cold War", "democracy", "the printing press", "the Silk Road",
              "Shakespeare", "Leonardo da Vinci", "Mahatma Gandhi", "Martin Luther King Jr.", "Marie Curie",
              "the Great Wall of China", "ancient Greece", "philosophy", "Socrates", "impressionism",
              "the Olympic Games", "the Maya civilisation", "the Vikings", "the United Nations", "human rights",
              "the invention of writing", "Buddhism", "Greek mythology", "the Beatles", "jazz", "architecture",
              "the moon landing", "the fall of the Berlin Wall", "Confucius", "the Magna Carta", "Napoleon",
              "the Byzantine Empire", "the Aztecs", "classical music", "Pride and Prejudice", "Don Quixote",
              "The Odyssey", "existentialism", "the Enlightenment", "globalisation", "urbanisation"]
EVERYDAY = ["sleep better", "save money", "learn a new language", "cook rice", "stay focused while studying",
            "start running", "reduce stress", "make new friends", "organise my desk", "prepare for a job interview",
            "keep houseplants alive", "eat healthier", "wake up earlier", "write a good CV", "plan a trip",
            "make a cup of tea", "clean a laptop keyboard", "learn to swim", "be more productive",
            "speak in public", "fix a flat bicycle tyre", "choose a good book", "drink more water",
            "start a small garden", "keep a budget", "stop procrastinating", "take better photos with my phone",
            "get along with my roommate", "prepare for an exam", "bake bread", "remember names",
            "learn to play the guitar", "spend less time on my phone", "pack a suitcase", "care for a puppy",
            "make a good first impression", "start meditating", "stay warm in winter", "host a dinner party"]
EVERYDAY_QUESTIONS = ["Why is the sky blue?", "How many hours should an adult sleep?", "What should I eat for breakfast?",
                      "Is coffee bad for you?", "How do I boil an egg?", "What is a good name for a cat?",
                      "How do airplanes stay in the air?", "What is the best way to learn maths?",
                      "Why do we dream?", "How do I tie a tie?", "What can I cook with potatoes and eggs?",
                      "How long should I walk every day?", "What is the capital of France?",
                      "What is the capital of Japan?", "How far is the Moon from Earth?",
                      "Which is the largest ocean?", "Who wrote Romeo and Juliet?", "How many continents are there?",
                      "What is the tallest mountain in the world?", "How does a refrigerator work?"]

CODING_TASKS = ["reverses a string", "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
                "counts the vowels in a string", "finds the largest number in a list", "removes duplicates from a list",
                "sorts a list of dictionaries by a key", "checks whether a number is prime", "computes a factorial",
                "merges two sorted lists", "flattens a nested list", "counts word frequencies in a text",
                "converts Celsius to Fahrenheit", "reads a CSV file and prints each row",
                "returns the sum of the squares of a list", "finds the second largest number in a list",
                "capitalises every word in a sentence", "checks whether two strings are anagrams",
                "computes the average of a list of numbers", "generates a random password",
                "returns the greatest common divisor of two numbers", "validates an email address with a regex",
                "counts the lines in a file", "implements binary search", "implements bubble sort",
                "transposes a matrix", "groups words by their first letter", "returns the intersection of two lists",
                "converts a Roman numeral to an integer", "checks if brackets in a string are balanced",
                "chunks a list into pieces of size n", "computes the median of a list", "rotates a list by k steps",
                "returns all even numbers from a list", "parses a date string", "implements a stack class",
                "implements a simple queue", "computes the dot product of two vectors", "finds all primes below n",
                "writes a dictionary to a JSON file"]
CODING_LANGS = ["Python", "JavaScript", "Bash", "SQL", "C", "Java", "Rust", "Go"]
CODING_HOWTO = ["read a file line by line", "make an HTTP request", "sort a list", "handle exceptions",
                "write a for loop", "define a class", "use a dictionary", "join strings", "get the current date",
                "create a virtual environment", "write a unit test", "iterate over two lists at once",
                "remove whitespace from a string", "convert a string to an integer", "format a number with two decimals",
                "list the files in a folder", "count occurrences in a list", "reverse a list", "copy a file"]
CODE_SNIPPETS = ["def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
                 "for i in range(1, 11):\n    print(i, i ** 2)",
                 "s = 'hello world'\nprint(s[::-1].upper())",
                 "import collections\nc = collections.Counter('mississippi')\nprint(c.most_common(2))",
                 "def g(n):\n    return n if n < 2 else g(n - 1) + g(n - 2)",
                 "nums = [3, 1, 2]\nnums.sort(reverse=True)\nprint(nums)",
                 "with open('data.txt') as f:\n    total = sum(int(line) for line in f)",
                 "SELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY 2 DESC;",
                 "x = {k: v for k, v in zip('abc', range(3))}",
                 "while n > 0:\n    n //= 2\n    steps += 1"]

NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Hassan", "Ines", "Jamal", "Kenji", "Lena",
         "Maria", "Noah", "Olivia", "Pablo", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wei", "Yara", "Zoe"]
ITEMS = ["apples", "pencils", "books", "cupcakes", "marbles", "stickers", "oranges", "cookies", "tickets", "coins"]
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Dublin", "Oslo", "Athens", "Cairo",
          "Tokyo", "Seoul", "Lima", "Toronto", "Nairobi", "Sydney", "Mumbai", "Mexico City", "Istanbul"]

FOLLOWUPS = ["Can you make it shorter?", "Can you explain that more simply?", "Give me one more example.",
             "Can you put that in a bulleted list?", "Why is that?", "Can you summarise that in one sentence?",
             "What would you add to that?", "Can you make it more formal?", "Thanks! Can you give me a tip to remember it?",
             "How would you explain it to a ten-year-old?", "What is the most important point?",
             "Can you write it again with a happier tone?", "Is there anything I should be careful about?"]


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


def reasoning_and_math(rng: random.Random, n: int):
    """Fresh reasoning and math problems with drawn names and numbers; each its own group."""
    for i in range(n):
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


def python_doc_prompts(rng: random.Random, n: int):
    """Questions about the standard library, with its own docstrings as the text to work on."""
    modules = ["string", "json", "math", "random", "collections", "itertools", "functools", "os.path", "re",
               "datetime", "statistics", "textwrap", "pathlib", "shutil", "csv", "heapq", "bisect", "fractions",
               "decimal", "calendar", "time", "copy", "operator", "difflib", "base64", "hashlib", "uuid", "zipfile"]
    funcs = []
    for name in modules:
        mod = importlib.import_module(name)
        for attr in sorted(dir(mod)):
            obj = getattr(mod, attr, None)
            if attr.startswith("_") or not callable(obj):
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


def extraction_prompts(rng: random.Random, n: int):
    """Extraction from short texts made of drawn names, places, dates and prices."""
    months = ["January", "March", "May", "July", "September", "November"]
    for i in range(n):
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


def build(self_instruct: Path | None = None) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows), deterministic for a given machine and self-instruct file."""
    rng = random.Random(SEED)
    sources = [("template", template_prompts(rng)), ("generated", reasoning_and_math(rng, 420)),
               ("generated", extraction_prompts(rng, 160)), ("python-docs", python_doc_prompts(rng, 420)),
               ("debian-docs", debian_doc_prompts(rng, 260)), ("self-instruct", self_instruct_prompts(self_instruct))]
    seen, train, heldout = set(), [], []
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "assets" / "demo" / "prompts")
    p.add_argument("--self-instruct", type=Path, help="questions the backbone wrote (JSONL)")
    args = p.parse_args(argv)
    train, heldout = build(args.self_instruct)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("heldout", heldout)):
        with open(args.out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"id": row.pop("id"), **row}, ensure_ascii=False) + "\n")
    counts: dict[str, list[int]] = {}
    for split, rows in ((0, train), (1, heldout)):
        for row in rows:
            counts.setdefault(row["category"], [0, 0])[split] += 1
    print(f"{len(train)} training prompts, {len(heldout)} held out "
          f"({sum('followup' in r for r in train + heldout)} with a follow-up turn)", file=sys.stderr)
    for cat, (a, b) in sorted(counts.items()):
        print(f"  {cat:<11} {a:5d} {b:4d}", file=sys.stderr)


if __name__ == "__main__":
    main()
