"""What an extra tree row costs this engine: one verification pass of n tree tokens vs one token (issue 27).

Runs ``StepRunner.tree_forward`` (the backbone's pass and the LM head, what a Medusa step verifies with) on the
demo for a chain of n tokens after a 200-token context, removes the n entries again, and prints the median
wall time per pass with the lean step (attention by the compiled row kernel, and by SDPA calls per row group) and
with transformers' forward, and with torch's int4-pack kernel in place of the compiled int4 product (every 4-bit
layer, the LM head's first pass included), interleaved. Each timed pass follows an untimed pass of the same kind
and size, so that it finds the CPU's caches as a decoding loop leaves them (timed right after another kind of pass,
a one-token pass found its weights evicted, which made it look dearer and a second row almost free: docs/BENCH.md).
The heads' proposal, sampling and the cache update are not in it: ``python -m medusa_core.bench profile
--split-only`` has them.

    python scripts/step_rows.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--context", type=int, default=200)
    args = p.parse_args()
    import torch

    from medusa_core import load_medusa_model
    from medusa_core.invariant import ATTENTION, ATTENTION_KERNEL
    from medusa_core.lean import LeanStep
    from medusa_core.lean.build import load_extension
    from medusa_core.quant.layers import Int4Linear
    from medusa_core.steptree import static_tree

    torch.set_num_threads(args.threads)
    model = load_medusa_model("demo")
    runner = model._steps
    cache = model._new_cache()
    with torch.inference_mode():
        runner.decoder(input_ids=torch.arange(1000, 1000 + args.context)[None], cache=cache, use_cache=True)
    trees = {n: static_tree(f"chain_{n - 1}", [[0] * d for d in range(1, n)], model.dtype, model.device) for n in args.rows}
    backbone = model.backbone
    attention = backbone.config._attn_implementation
    compiled = Int4Linear.kernel
    passes = {"lean": (runner.lean, attention, compiled), "transformers": (None, attention, compiled)}
    if attention == ATTENTION_KERNEL:  # the same lean step with SDPA rows, for comparison
        backbone.set_attn_implementation(ATTENTION)
        passes["lean, SDPA rows"] = (LeanStep(backbone, load_extension()[0]), ATTENTION, compiled)
        backbone.set_attn_implementation(attention)
    if compiled is not None:  # the same lean step on torch's int4-pack kernel
        Int4Linear.kernel = None
        passes["lean, torch int4"] = (LeanStep(backbone, load_extension()[0]), attention, None)
        Int4Linear.kernel = compiled
    times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in passes for n in args.rows}
    with torch.inference_mode():
        for repeat in range(args.repeats + 3):  # 3 warm-up rounds
            for kind, (lean, implementation, kernel) in passes.items():
                runner.lean = lean
                backbone.set_attn_implementation(implementation)
                Int4Linear.kernel = kernel
                for n, tree in trees.items():
                    tokens = torch.arange(500, 500 + n)
                    for timed in (False, True):  # the timed pass follows the same pass, as in a decoding loop
                        start = time.perf_counter()
                        runner.tree_forward(tree, tokens, args.context, cache)
                        spent = time.perf_counter() - start
                        cache.crop(-n)
                    if repeat >= 3:
                        times[kind, n].append(spent)
    runner.lean = passes["lean"][0]
    backbone.set_attn_implementation(attention)
    Int4Linear.kernel = compiled
    print(f"median wall ms per verification pass after {args.context} tokens ({args.threads} threads, {args.repeats} interleaved rounds)")
    print("rows  " + "  ".join(f"{k:>22s}" for k in passes))
    for n in args.rows:
        cells = []
        for kind in passes:
            ms, one = (1e3 * statistics.median(times[kind, m]) for m in (n, args.rows[0]))
            cells.append(f"{ms:7.2f} ms ({(ms - one) / one / max(n - 1, 1):.3f}/row)" if n > 1 else f"{ms:7.2f} ms            ")
        print(f"{n:4d}  " + "  ".join(f"{c:>22s}" for c in cells))


if __name__ == "__main__":
    main()
