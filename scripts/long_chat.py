"""Long conversations through the app's own chat handlers (issue 26): time to first token with the kept
KV cache, and memory over a long session. A documented measurement, not a test; it prints its figures.

    python scripts/long_chat.py ttft     # a 2,000-token message, then short questions: TTFT vs a fresh chat
    python scripts/long_chat.py memory   # 50 turns, five of them ~5,000-token messages: RSS after turn 1, at the end,
                                         # and once the conversation's kept cache is dropped

Each turn goes through ``app.handlers.add_user`` and ``respond``, as the page sends it (chat template,
context fitting, the conversation's kept cache, statistics, plots); TTFT is the stats line's: from the
send to the first decoded token. Both load the model the app loads by default (``--model demo``) with the
app's thread count, and use the app's default settings except ``--max-new-tokens``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

WORDS = ("amber falcon river quiet valley copper market winter lantern harbor orchard silver meadow "
         "granite bridge tide willow ember canyon festival").split()


def long_message(tokenizer, tokens: int, seed: int) -> str:
    """Varied English-like notes of about ``tokens`` tokens (never repeated, so no cache or n-gram luck)."""
    rng, lines = random.Random(seed), []
    while len(tokenizer.encode("\n".join(lines))) < tokens:
        for _ in range(20):
            a, b, c = rng.sample(WORDS, 3)
            lines.append(f"Note {len(lines) + 1}: the {a} {b} met the {c} at {rng.randint(1, 12)} o'clock.")
    return "Read these notes, then answer my questions about them.\n" + "\n".join(lines)


def rss_mb() -> tuple[float, float]:
    """Resident set size of this process now and its anonymous part (heap, tensors: without the pages of
    memory-mapped files such as the GGUF weights, which the kernel drops and re-reads under memory
    pressure), in MB (Linux)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return tuple(int(fields[k].split()[0]) * 1024 / 1e6 for k in ("VmRSS", "RssAnon"))


def setup(args):
    """The app's engine, settings and controls, as ``launch.py`` makes them."""
    import dataclasses

    import torch

    from app import handlers
    from app.engine import Engine
    from app.settings import AppSettings
    from medusa_core import load_medusa_model

    settings = AppSettings(model=args.model, max_new_tokens=args.max_new_tokens)
    torch.set_num_threads(settings.threads)
    engine = Engine(settings.model, settings.kept_cache_mb)
    engine.load(lambda: load_medusa_model(settings.model, quantization=settings.quantization, device=settings.device))
    controls = dataclasses.replace(handlers.Controls.from_settings(settings), **handlers.GREEDY_PRESET)
    return engine, settings, controls


def turn(engine, settings, session, controls, message: str):
    """Send ``message`` and run its reply to the end; returns the turn (``first_token_at``, ``sent_at``...)."""
    from app import handlers

    handlers.add_user(engine, session, controls, message)
    for _ in handlers.respond(engine, settings, session, controls):
        pass
    done = session.turns[-1]
    if done.state != "done":
        raise RuntimeError(f"the turn ended {done.state}: {done.error}")
    return done


def ttft_s(done) -> float:
    return done.first_token_at - done.sent_at


def measure_ttft(args) -> None:
    from app.session import Session

    engine, settings, controls = setup(args)
    questions = ["Which metal is mentioned most?", "What happens at noon?", "Name three places.", "Is there a bridge?",
                 "Summarise the notes in one line.", "Which word repeats most?", "What season is it?",
                 "Who met the falcon?", "Give me a title for the notes."][: args.turns - 1]
    tokenizer = engine.model.tokenizer
    conversation = Session()
    first = turn(engine, settings, conversation, controls, long_message(tokenizer, args.long_tokens, seed=1))
    print(f"turn 1: a {args.long_tokens}-token message, TTFT {ttft_s(first):.2f} s (read in full)", flush=True)
    print("turn  question                           kept cache TTFT  fresh chat TTFT  ratio")
    ratios = []
    for k, question in enumerate(questions, start=2):
        kept = ttft_s(turn(engine, settings, conversation, controls, question))
        fresh = ttft_s(turn(engine, settings, Session(), controls, question))
        ratios.append(kept / fresh)
        print(f"{k:>4}  {question:<34} {kept:>13.2f} s  {fresh:>13.2f} s  {kept / fresh:5.2f}", flush=True)
    print(f"ratio kept / fresh: median {statistics.median(ratios):.2f}, max {max(ratios):.2f} (target <= 1.5)")
    engine.forget(conversation.id)  # what every turn cost before the kept cache: the whole conversation read again
    again = ttft_s(turn(engine, settings, conversation, controls, questions[0]))
    print(f"the same conversation without its kept cache (turn {len(conversation.turns)}): TTFT {again:.2f} s")


def measure_memory(args) -> None:
    from app.session import Session

    engine, settings, controls = setup(args)
    tokenizer = engine.model.tokenizer
    session = Session()
    long_turns = {5, 15, 25, 35, 45}
    after_first, first_kept_tokens = (0.0, 0.0), 0
    start = time.monotonic()
    for k in range(1, args.turns + 1):
        message = long_message(tokenizer, args.long_tokens, seed=k) if k in long_turns else f"Question {k}: what is note {k} about?"
        done = turn(engine, settings, session, controls, message)
        rss, anon = rss_mb()
        after_first = after_first if k > 1 else (rss, anon)
        kept = engine.conversation(session.id)
        first_kept_tokens = first_kept_tokens if k > 1 else len(kept.token_ids)
        print(f"turn {k:>2}: RSS {rss:7.0f} MB (anonymous {anon:5.0f} MB), kept cache {kept.nbytes / 1e6:5.0f} MB ({len(kept.token_ids)} tokens), "
              f"TTFT {ttft_s(done):6.2f} s{', long message' if k in long_turns else ''}{', ' + done.note if done.note else ''}",
              flush=True)
    print(f"RSS after turn 1 {after_first[0]:.0f} MB, at the end {rss:.0f} MB ({rss / after_first[0]:.2f}x; target <= 1.2x); "
          f"anonymous {after_first[1]:.0f} MB, {anon:.0f} MB ({anon / after_first[1]:.2f}x); "
          f"{args.turns} turns in {time.monotonic() - start:.0f} s")
    engine.forget(session.id)  # what is left when the kept cache goes: the rest of the session's growth
    rss, anon = rss_mb()
    print(f"after dropping the conversation's kept cache: RSS {rss:.0f} MB (anonymous {anon:.0f} MB; "
          f"{rss / after_first[0]:.2f}x turn 1's, whose kept cache held {first_kept_tokens} tokens)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["ttft", "memory"])
    parser.add_argument("--model", default="demo", help="what the app loads (--model)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per reply (the app's default is 256)")
    parser.add_argument("--turns", type=int, help="turns of the conversation (ttft: 10, memory: 50)")
    parser.add_argument("--long-tokens", type=int, help="tokens of each long message (ttft: 2000, memory: 5000)")
    args = parser.parse_args()
    args.turns = args.turns or (10 if args.what == "ttft" else 50)
    args.long_tokens = args.long_tokens or (2000 if args.what == "ttft" else 5000)
    (measure_ttft if args.what == "ttft" else measure_memory)(args)


if __name__ == "__main__":
    main()
