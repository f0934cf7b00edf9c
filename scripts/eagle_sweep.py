"""How deep and how sure should the EAGLE-style drafter's chains be (``medusa_core.eagle`` ``DEPTH``, ``THRESHOLD``)?
Tokens per step and decoding tokens/s (the prefill left out) of the plain loop, heads + corpus (the app's default)
and ``drafts="eagle"`` at each depth:threshold, interleaved per prompt on the held-out prompts, at greedy (every reply
checked identical to the plain loop's) or at the chat preset (exact sampling, seed 1).
Figures: docs/BENCH.md, "The drafter compiled".

    python scripts/eagle_sweep.py --preset chat --prompts 24 --values 2:0.2,2:0.3,3:0.3,3:0.4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from medusa_core import eagle, load_medusa_model
from medusa_core.bench.prompts import encode_prompt, load_prompts
from medusa_core.processors import CHAT_PRESET, CHAT_SAMPLING

DRAFTER = Path(__file__).resolve().parent.parent / "assets" / "eagle-probe" / "drafter.safetensors"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("greedy", "chat"), default="greedy")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--values", default="2:0.2,2:0.3,3:0.3,3:0.4", help="depth:threshold pairs, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_medusa_model("demo")
    model.load_drafter(DRAFTER)
    settings = dict(temperature=0.0) if args.preset == "greedy" else dict(config=CHAT_PRESET, sampling=CHAT_SAMPLING)
    configs = {"baseline": (None, dict(medusa=False)), "heads + corpus": (None, dict(drafts="corpus"))}
    for value in args.values.split(","):
        depth, threshold = value.split(":")
        configs[f"eagle depth {depth} threshold {threshold}"] = ((int(depth), float(threshold)), dict(drafts="eagle"))
    prompts = [encode_prompt(model.tokenizer, p, None) for p in load_prompts(None, args.prompts, None)]
    totals = {name: [0, 0, 0.0] for name in configs}  # tokens after the first, decoding steps, their seconds
    chains = eagle.DEPTH, eagle.THRESHOLD
    try:
        for ids in prompts:
            first = None
            for name, (chain, kwargs) in configs.items():
                eagle.DEPTH, eagle.THRESHOLD = chain or chains
                records = list(model.generate(ids, max_new_tokens=args.max_new_tokens, seed=1, **settings, **kwargs))
                reply = [t for r in records for t in r.token_ids]
                first = first or reply
                if args.preset == "greedy" and reply != first:
                    raise SystemExit(f"{name}: the greedy reply differs from the plain loop's")
                totals[name][0] += len(reply) - 1  # records[0]: the prefill and its token
                totals[name][1] += len(records) - 1
                totals[name][2] += sum(r.latency_s for r in records[1:])
    finally:
        eagle.DEPTH, eagle.THRESHOLD = chains
    base = totals["baseline"][0] / totals["baseline"][2]
    for name, (tokens, steps, seconds) in totals.items():
        print(f"{name:32s} tokens/step {tokens / steps:.2f}  step {seconds / steps * 1e3:.2f} ms"
              f"  tokens/s {tokens / seconds:.1f}  vs plain {tokens / seconds / base:.3f}x")


if __name__ == "__main__":
    main()
