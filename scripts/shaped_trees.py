"""A quick look at trees shaped by the heads' confidence (issue 20, part 2) on the demo: the calibration of
the heads' path probabilities (share of nodes accepted per predicted-probability bin, heads only on
``optimised_8``), with the raw softmax (every T_k = 1) and with the heads' fitted temperatures
(``head_temperatures`` in ``medusa_calibration.json``: ``scripts/fit_temperatures.py``), then tokens per
step and tokens/s of heads, hybrid and shaped trees (the model's tuned τ) against the plain loop,
interleaved per prompt, every greedy output checked identical to the first configuration's.
Figures: docs/BENCH.md, "Trees shaped by the heads' confidence".

    python scripts/shaped_trees.py [--prompts 8] [--threads 2] [--calibration-only]

It wraps ``StepRunner.candidates`` (``medusa_core.decoding``) (and sets its temperatures to 1 for the raw table) to read each
step's path probabilities: a measurement, not an API.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from medusa_core import DraftConfig, load_medusa_model
from medusa_core.bench.prompts import encode_prompt, load_prompts

WHOLE = DraftConfig(min_head_probability=0.0)  # shaping off; no draft_config: the model's tuned τ
CONFIGS = {
    "heads:tuned": dict(tree="tuned", drafts="heads", draft_config=WHOLE),
    "hybrid:tuned": dict(tree="tuned", drafts="hybrid", draft_config=WHOLE),
    "hybrid:tuned shaped (model's τ)": dict(tree="tuned", drafts="hybrid"),
    "hybrid:optimised_8 shaped (model's τ)": dict(tree="optimised_8", drafts="hybrid"),
    "heads:optimised_8 shaped (model's τ)": dict(tree="optimised_8", drafts="heads"),
    "baseline": dict(medusa=False),
}


def calibration(model, prompts, raw: bool) -> dict[int, list[float]]:
    """Predicted path probability bin (tenths) -> [nodes accepted, nodes, sum of predicted] over heads-only
    greedy replies on the whole ``optimised_8``; ``raw``: with every head's temperature at 1."""
    steps = model._steps
    candidates, temperatures = steps.candidates, steps.temperatures
    seen: dict[str, list[float]] = {}

    def with_path_probability(tree, hidden, root, with_log_p=False):
        tokens, log_p = candidates(tree, hidden, root, tree.num_nodes > 1)
        if log_p is not None:
            seen["p"] = ((tree.bias == 0).float() @ log_p).exp().tolist()  # [N] product over each node's path
        return tokens, log_p if with_log_p else None

    bins: dict[int, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])
    steps.candidates = with_path_probability
    if raw:
        steps.temperatures = torch.ones_like(temperatures)
    try:
        for ids in prompts:
            for record in model.generate(ids, max_new_tokens=128, tree="optimised_8", draft_config=WHOLE):
                if record.tree_nodes > 1:
                    for node in range(1, record.tree_nodes):
                        b = bins[min(int(seen["p"][node] * 10), 9)]
                        b[0] += node in record.accepted_nodes
                        b[1] += 1
                        b[2] += seen["p"][node]
    finally:
        steps.candidates, steps.temperatures = candidates, temperatures
    return bins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calibration-only", action="store_true", help="print the reliability tables, skip the speed runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_medusa_model("demo")
    prompts = [encode_prompt(model.tokenizer, p, None) for p in load_prompts(None, args.prompts, None)]
    print(f"head temperatures {model.head_temperatures}, tuned τ {model.min_head_probability}")
    for raw in (True, False):
        bins = calibration(model, prompts, raw)
        total = sum(n for _, n, _ in bins.values())
        ece = sum(abs(a - p) for a, _, p in bins.values()) / total  # Σ_b n_b/N · |accepted_b − mean predicted_b|
        print(f"{'raw softmax (T = 1)' if raw else 'calibrated'}: predicted path probability -> mean predicted, share "
              f"accepted (nodes); expected calibration error {ece:.3f}")
        for b, (accepted, nodes, predicted) in sorted(bins.items()):
            print(f"  {b / 10:.1f}-{(b + 1) / 10:.1f}: {predicted / nodes:.2f}, {accepted / nodes:.2f} ({nodes})")
    if args.calibration_only:
        return
    for name, (tokens, steps, seconds) in time_configs(model, prompts, CONFIGS).items():
        print(f"{name:32s} tokens/step {(tokens - len(prompts)) / steps:.2f}  tokens/s {tokens / seconds:.1f}")


def time_configs(model, prompts, configs: dict[str, dict]) -> dict[str, list]:
    """Greedy 128-token replies of every configuration (``generate`` keywords), interleaved per prompt
    (encoded ids); every reply must equal the first configuration's. Returns name -> [tokens, decoding
    steps, seconds]. Also used by ``scripts/long_chains.py``."""
    totals = {name: [0, 0, 0.0] for name in configs}  # tokens, decoding steps, seconds
    for ids in prompts:
        first = None
        for name, kwargs in configs.items():
            start = time.perf_counter()
            records = list(model.generate(ids, max_new_tokens=128, **kwargs))
            seconds = time.perf_counter() - start
            reply = [t for r in records for t in r.token_ids]
            first = first or reply
            if reply != first:
                raise SystemExit(f"{name}: the greedy reply differs from {next(iter(configs))}'s")
            totals[name][0] += len(reply)
            totals[name][1] += len(records) - 1  # records[0]: the prefill and its token
            totals[name][2] += seconds
    return totals

if __name__ == "__main__":
    main()
