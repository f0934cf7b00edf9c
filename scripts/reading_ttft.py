"""Time to the first token of a conversation's next message and of a long prompt: each pass of the prompt's reading
through the lean step (``LeanStep.read``) against transformers' forward, interleaved per prompt on the demo.

For each of the first ``--prompts`` shipped bench prompts: the prompt as a first message (greedy reply of
``--reply-tokens``, a ``ConversationCache`` kept), then a follow-up message read after the kept cache (the app's
next turn), then a long prompt of ``--long-prompts`` bench prompts in one message (read in chunks of 256 tokens, no
kept cache). Both ways of reading run for every prompt, their order swapped in the second round; the replies of
both must be the same tokens (the script stops otherwise). Prints the median TTFT of each (``StepRecord`` 0's
latency: the reading, the LM head and the first token).

    python scripts/reading_ttft.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FOLLOW_UP = "Can you make it shorter, and explain why in one sentence?"


class TransformersReading:
    """The lean step for decoding passes, transformers' forward for every pass of a prompt's reading."""

    def __init__(self, lean):
        self.lean = lean

    def __call__(self, *args, **kwargs):
        return self.lean(*args, **kwargs)

    def read(self, *args):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reply-tokens", type=int, default=48, help="the first message's reply")
    p.add_argument("--long-prompts", type=int, default=20, help="bench prompts joined into the long prompt")
    args = p.parse_args()

    import torch

    from medusa_core import ConversationCache, load_medusa_model
    from medusa_core.bench.prompts import Prompt, encode_prompt, load_prompts

    torch.set_num_threads(args.threads)
    model = load_medusa_model("demo")
    lean = model._steps.lean
    if lean is None:
        sys.exit(f"no lean step here: {model.describe()['step']}")
    ways = {"lean read": lean, "transformers' read": TransformersReading(lean)}
    prompts = load_prompts(None, args.prompts, None)
    long_ids = encode_prompt(model.tokenizer, "Summarise this text.\n\n" + " ".join(
        q.text for q in load_prompts(None, args.long_prompts, None)))

    ttft = {name: {"next message": [], "long prompt": []} for name in ways}
    new = []
    for round_ in range(args.rounds):
        for prompt in prompts:
            replies = {}
            for name in list(ways)[:: 1 if round_ % 2 == 0 else -1]:
                model._steps.lean = ways[name]
                kept = ConversationCache()
                first = [t for r in model.generate(encode_prompt(model.tokenizer, prompt), max_new_tokens=args.reply_tokens,
                                                   temperature=0.0, kept=kept) for t in r.token_ids]
                history = (*prompt.history, ("user", prompt.text), ("assistant", model.tokenizer.decode(first, skip_special_tokens=True)))
                ids = encode_prompt(model.tokenizer, Prompt(FOLLOW_UP, prompt.category, history))
                held = len(kept.token_ids)
                records = list(model.generate(ids, max_new_tokens=16, temperature=0.0, kept=kept))
                long_records = list(model.generate(long_ids, max_new_tokens=8, temperature=0.0))
                ttft[name]["next message"].append(records[0].latency_s)
                ttft[name]["long prompt"].append(long_records[0].latency_s)
                replies[name] = (first, [t for r in records for t in r.token_ids], [t for r in long_records for t in r.token_ids])
                if name == "lean read" and round_ == 0:
                    new.append(ids.shape[1] - held)
            if len({tuple(map(tuple, r)) for r in replies.values()}) != 1:
                sys.exit(f"the two readings gave different replies for {prompt.text[:60]!r}")
    model._steps.lean = lean
    print(f"{len(prompts)} prompts x {args.rounds} rounds, replies identical; the next message reads {statistics.mean(new):.0f} "
          f"new tokens on average after the kept cache; the long prompt is {long_ids.shape[1]} tokens")
    for name, times in ttft.items():
        print(f"{name}: " + ", ".join(f"{what} TTFT median {statistics.median(t) * 1e3:.1f} ms" for what, t in times.items()))


if __name__ == "__main__":
    main()
