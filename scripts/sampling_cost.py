"""What the sampling settings cost per tree row: the processors (``NodeProcessors``, each row given its own
prefix) and the verification (``verify_tree``) of one decoding step, on logits of the demo's size, per
setting and per tree size. Synthetic logits (no model is loaded), so the figures are the sampling code
alone; the "extra" columns are the cost above greedy without a penalty (the argmax of raw logits), which is
what the settings add to a step: the median step and the fastest (the better estimate on a busy machine). The
compiled sampling calls run where they build, as in the engine (``medusa_core.lean`` ``sampling.h``); ``--aten``
keeps the ATen ops. Figures: docs/BENCH.md, "Sampling per tree row" and "Sampling in compiled calls".

    python scripts/sampling_cost.py [--vocab 49152] [--context 600] [--threads 2] [--repeats 300] [--aten]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from medusa_core import CHAT_PRESET, SamplingConfig
from medusa_core.acceptance import verify_tree
from medusa_core.invariant import load_kernel
from medusa_core.processors import NodeProcessors, tree_prefixes
from medusa_core.steptree import static_tree

SETTINGS = {
    "greedy": SamplingConfig(),
    "greedy, rep. 1.1": SamplingConfig(repetition_penalty=1.1),
    "chat preset (exact)": CHAT_PRESET,
    "T 0.7 top-k 50 top-p 0.95 min-p 0.05 rep. 1.1": SamplingConfig(
        temperature=0.7, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=1.1),
}
# Trees by rows: the plain loop's one row, a 3-row chain, a 16-row tree.
TREES = {1: [], 3: [[0], [0, 0]], 16: [[i] for i in range(5)] + [[i, j] for i in range(2) for j in range(5)]}


def step_ms(config: SamplingConfig, rows: int, vocab: int, context: int, repeats: int, scale: float) -> tuple[float, float]:
    """(median, fastest) ms of the sampling part of one step with ``rows`` tree rows: the penalty's context
    tensor, the rows' prefixes, the processors and the verification. The median shrugs off a step slowed by
    another process; on a busy machine the fastest step is the better estimate of the cost alone."""
    gen = torch.Generator().manual_seed(0)
    tree = static_tree("t", TREES[rows], torch.float32, torch.device("cpu"))
    seen = dict.fromkeys(torch.randint(vocab, (context,), generator=gen).tolist())
    processors = NodeProcessors(config)
    rule = "greedy" if config.greedy else "exact"
    logits = [torch.randn(rows, vocab, generator=gen) * scale for _ in range(8)]  # [N, V] a few different steps
    tokens = torch.randint(vocab, (rows,), generator=gen)
    times = []
    for i in range(repeats + 10):
        start = time.perf_counter()
        prefixes = None
        if processors.needs_prefix:
            context_ids = torch.tensor(list(seen))  # [C]
            prefixes = tree_prefixes(context_ids, tokens, tree.ancestors)
        scores = processors(logits[i % 8], prefixes)
        path, length, root = verify_tree(tree, scores, tokens, rule, 0.09, 0.3, gen)
        torch.cat([length.view(1), root.view(1), path, tokens]).tolist()  # the step's host sync
        if i >= 10:  # warm-up
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152, help="V (the demo's SmolLM2 vocabulary)")
    parser.add_argument("--context", type=int, default=600, help="ids in the prompt and reply so far")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--scale", type=float, default=3.0, help="std of the synthetic logits")
    parser.add_argument("--aten", action="store_true", help="ATen ops only, not the compiled sampling calls")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compiled, why = (False, "--aten") if args.aten else load_kernel(print)
    path = "compiled sampling calls" if compiled else f"ATen ops ({why})"
    print(f"V {args.vocab}, context {args.context} ids, {args.threads} threads, logits N(0, {args.scale:g}²), {path}")
    print(f"{'setting':48s} {'rows':>4s} {'ms/step':>8s} {'extra ms/row':>12s} {'fastest: ms/step':>16s} {'extra ms/row':>12s}")
    for rows in TREES:
        floor = step_ms(SETTINGS["greedy"], rows, args.vocab, args.context, args.repeats, args.scale)
        for name, config in SETTINGS.items():
            ms = floor if name == "greedy" else step_ms(config, rows, args.vocab, args.context, args.repeats, args.scale)
            extra = [(t - f) / rows for t, f in zip(ms, floor)]
            print(f"{name:48s} {rows:4d} {ms[0]:8.3f} {extra[0]:12.3f} {ms[1]:16.3f} {extra[1]:12.3f}")


if __name__ == "__main__":
    main()
