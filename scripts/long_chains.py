"""When should a hybrid step verify a long n-gram chain alone (``DraftConfig.chain_only_from``)? Tokens per
step and tokens/s of the plain loop, heads only, and the hybrid at several ``chain_only_from`` values on the
demo, interleaved per prompt, every greedy reply checked identical to the plain loop's.
Figures: docs/BENCH.md, "Long copied chains verified alone".

    python scripts/long_chains.py [--prompts 24] [--threads 2] [--values 0,3,5,8]
"""

from __future__ import annotations

import argparse

import torch
from shaped_trees import time_configs  # scripts/ is on the path when a script runs

from medusa_core import DraftConfig, load_medusa_model
from medusa_core.bench.prompts import encode_prompt, load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--values", default="0,3,5,8", help="chain_only_from values, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_medusa_model("demo")
    configs = {"baseline": dict(medusa=False), "heads:tuned": dict(tree="tuned", drafts="heads")}
    for value in map(int, args.values.split(",")):
        configs[f"hybrid:tuned chain_only_from={value}"] = dict(
            tree="tuned", drafts="hybrid", draft_config=DraftConfig(chain_only_from=value))
    prompts = [encode_prompt(model.tokenizer, p, None) for p in load_prompts(None, args.prompts, None)]
    totals = time_configs(model, prompts, configs)
    base = totals["baseline"][0] / totals["baseline"][2]
    for name, (tokens, steps, seconds) in totals.items():
        print(f"{name:36s} tokens/step {(tokens - len(prompts)) / steps:.2f}  tokens/s {tokens / seconds:.1f}"
              f"  vs plain {tokens / seconds / base:.2f}x")


if __name__ == "__main__":
    main()
