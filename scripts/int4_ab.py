"""The compiled 4-bit product of this tree against another git revision's, side by side in one process (issue 25).

Builds the lean extension's sources as they are at ``--against`` (``git show REV:medusa_core/lean/...``) under
another module name and C++ namespace, so that both builds load in one process; then multiplies random bfloat16
rows by the weights of every decoder ``Int4Linear`` of the demo's backbone (the LM head left out), with each build
in turn, the order alternating each round, and prints each row count's median wall time per build and their ratio.
Both builds must give the same bits (an edit that keeps every row's operations), or the script says how many
products differ. The two builds share the CPU's caches as a decoding loop would not: compare the ratios, not the
times (docs/BENCH.md, "Products of up to 8 rows in one pass").

    python scripts/int4_ab.py --against HEAD~1 --rows 1 2 3 4 5 6 8 --rounds 10
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_revision(rev: str, folder: Path):
    """The lean extension as of git revision ``rev``, built in ``folder`` as module ``medusa_lean_ab`` (its C++
    namespace renamed, so that its types do not clash with the current build's). Raises ``CalledProcessError`` for a
    revision git does not know."""
    from torch.utils import cpp_extension

    from medusa_core.lean.build import CFLAGS, FILES, LDFLAGS

    for path in FILES:
        source = subprocess.run(["git", "show", f"{rev}:{path.relative_to(ROOT).as_posix()}"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
        if path.name == "lean_step.cpp":
            source = "#define medusa_lean medusa_lean_ab\n" + source
        (folder / path.name).write_text(source, encoding="utf-8")
    return cpp_extension.load(name="medusa_lean_ab", sources=[str(folder / "lean_step.cpp")], build_directory=str(folder),
                              extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, verbose=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="the git revision whose product to compare with (e.g. HEAD~1)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import torch

    from medusa_core import load_medusa_model
    from medusa_core.lean.build import load_extension
    from medusa_core.quant.layers import Int4Linear

    torch.set_num_threads(args.threads)
    current, why = load_extension()
    if current is None or not current.has_int4_matmul():
        raise SystemExit(f"no compiled int4 product here: {why or 'this CPU has no AVX512-BF16'}")
    model = load_medusa_model("demo", drafter=None)
    tiles = [m.kernel_weights()[0] for m in model.backbone.get_decoder().modules() if isinstance(m, Int4Linear)]
    with tempfile.TemporaryDirectory() as folder:
        builds = {"this tree": current, args.against: build_revision(args.against, Path(folder))}
        times: dict[tuple[str, int], list[float]] = {}
        differ = 0
        for r in range(args.rounds):
            for rows in args.rows:
                xs = [torch.randn(rows, t.shape[1] * 32).to(torch.bfloat16) for t in tiles]
                outs = {}
                for name in list(builds)[:: 1 if r % 2 else -1]:
                    start = time.perf_counter()
                    outs[name] = [builds[name].int4_matmul(x, t) for x, t in zip(xs, tiles)]
                    times.setdefault((name, rows), []).append(time.perf_counter() - start)
                differ += sum(not torch.equal(a, b) for a, b in zip(*outs.values()))
    print(f"{len(tiles)} linears, {args.rounds} rounds, {args.threads} threads; median ms per round of products")
    print(f"| rows | {args.against} | this tree | this ÷ {args.against} |")
    print("|---:|---:|---:|---:|")
    for rows in args.rows:
        old, new = (1e3 * statistics.median(times[(name, rows)]) for name in (args.against, "this tree"))
        print(f"| {rows} | {old:.3f} | {new:.3f} | {new / old:.3f} |")
    print("every product the same bits" if differ == 0 else f"{differ} products differ")


if __name__ == "__main__":
    main()
