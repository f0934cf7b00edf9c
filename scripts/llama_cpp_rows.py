"""What an extra tree row costs llama.cpp on this CPU: one ``llama_decode`` of n tokens vs one token.

Medusa pays only if verifying n candidate tokens in one pass costs much less than n one-token steps.
This decodes n tokens as one batch after a 200-token context (``llama-cpp-python``'s low-level API,
the demo's GGUF file, logits for every row as a tree step needs them), removes them again, and
prints the median time per batch: the calling thread's CPU time (robust on a shared machine) with
``--threads 1``, wall time otherwise. Needs ``pip install -e ".[anchors]"``.

    python scripts/llama_cpp_rows.py --threads 1
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
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    import llama_cpp as L

    from medusa_core.gguf import demo_gguf_file

    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(demo_gguf_file()).encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 1024, 512, args.threads, args.threads
    ctx = L.llama_init_from_model(model, cp)
    memory = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(512, 0, 1)

    def decode(tokens: list[int], start: int) -> None:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, start + i, 1, 1
            batch.seq_id[i][0] = 0
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        L.llama_synchronize(ctx)

    decode(list(range(1000, 1200)), 0)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    base = None
    print(f"rows  ms/pass  x one row   ({'thread CPU time' if args.threads == 1 else 'wall time'}, {args.threads} thread(s))")
    for n in args.rows:
        times = []
        for _ in range(args.repeats):
            t0 = clock()
            decode([500 + i for i in range(n)], 200)
            times.append(clock() - t0)
            L.llama_memory_seq_rm(memory, 0, 200, -1)
        ms = statistics.median(times) * 1e3
        base = base or ms
        print(f"{n:4d}  {ms:7.2f}  {ms / base:9.2f}")


if __name__ == "__main__":
    main()
