"""A quick look at trees shaped by the heads' confidence (issue 20, part 2) on the demo: the calibration of
the heads' path probabilities (share of nodes accepted per predicted-probability bin, heads only on
``optimised_8``), then tokens per step and tokens/s of heads, hybrid and shaped hybrid trees against the plain
loop, interleaved per prompt, every greedy output checked identical to the first configuration's.
Figures: docs/BENCH.md, "Trees shaped by the heads' confidence".

    python scripts/shaped_trees.py [--prompts 8] [--threads 2]

It wraps ``MedusaModel._candidates`` to read each step's path probabilities: a measurement, not an API.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from medusa_core import DraftConfig, load_medusa_model
from medusa_core.bench.prompts import encode_prompt, load_prompts

CONFIGS = {
    "heads:tuned": dict(tree="tuned", drafts="heads"),
    "hybrid:tuned": dict(tree="tuned", drafts="hybrid"),
    "hybrid:optimised_8 shaped 0.2": dict(tree="optimised_8", drafts="hybrid", draft_config=DraftConfig(min_head_probability=0.2)),
    "hybrid:optimised_8 shaped 0.35": dict(tree="optimised_8", drafts="hybrid", draft_config=DraftConfig(min_head_probability=0.35)),
    "heads:optimised_8 shaped 0.2": dict(tree="optimised_8", drafts="heads", draft_config=DraftConfig(min_head_probability=0.2)),
    "baseline": dict(medusa=False),
}


def calibration(model, prompts) -> dict[int, list[int]]:
    """Predicted path probability bin (tenths) -> [nodes accepted, nodes] over heads-only greedy replies."""
    candidates = model._candidates
    seen: dict[str, list[float]] = {}

    def with_path_probability(tree, hidden, root, with_log_p=False):
        tokens, log_p = candidates(tree, hidden, root, tree.num_nodes > 1)
        if log_p is not None:
            seen["p"] = ((tree.bias == 0).float() @ log_p).exp().tolist()  # [N] product over each node's path
        return tokens, log_p if with_log_p else None

    bins: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])
    model._candidates = with_path_probability
    try:
        for ids in prompts:
            for record in model.generate(ids, max_new_tokens=128, tree="optimised_8"):
                if record.tree_nodes > 1:
                    for node in range(1, record.tree_nodes):
                        b = bins[min(int(seen["p"][node] * 10), 9)]
                        b[0] += node in record.accepted_nodes
                        b[1] += 1
    finally:
        model._candidates = candidates
    return bins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_medusa_model("demo")
    prompts = [encode_prompt(model.tokenizer, p, None) for p in load_prompts(None, args.prompts, None)]
    print("predicted path probability -> share accepted (nodes)")
    for b, (accepted, nodes) in sorted(calibration(model, prompts).items()):
        print(f"  {b / 10:.1f}-{(b + 1) / 10:.1f}: {accepted / nodes:.2f} ({nodes})")
    totals = {name: [0, 0, 0.0] for name in CONFIGS}  # tokens, decoding steps, seconds
    for ids in prompts:
        first = None
        for name, kwargs in CONFIGS.items():
            start = time.perf_counter()
            records = list(model.generate(ids, max_new_tokens=128, **kwargs))
            seconds = time.perf_counter() - start
            reply = [t for r in records for t in r.token_ids]
            first = first or reply
            if reply != first:
                raise SystemExit(f"{name}: the greedy reply differs from {next(iter(CONFIGS))}'s")
            totals[name][0] += len(reply)
            totals[name][1] += len(records) - 1  # records[0]: the prefill and its token
            totals[name][2] += seconds
    for name, (tokens, steps, seconds) in totals.items():
        print(f"{name:32s} tokens/step {(tokens - len(prompts)) / steps:.2f}  tokens/s {tokens / seconds:.1f}")


if __name__ == "__main__":
    main()
