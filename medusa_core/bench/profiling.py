"""Where a Medusa step spends its time: ``python -m medusa_core.bench profile`` (the step split by stage of
``stepsplit``, then cProfile and torch.profiler unless ``--split-only``)."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path
from typing import Any

from .methods import TRANSFORMERS_PASS
from .prompts import encode_prompt, load_prompts
from .report import _fmt, markdown_table
from .stepsplit import STAGES, step_split
from .tune import preset_settings


def cmd_profile(model: Any, args: argparse.Namespace, command: str) -> int:
    """Profile Medusa generation: Python time per engine function (cProfile) and per torch op."""
    from torch.profiler import ProfilerActivity, profile

    prompts = load_prompts(args.prompts, args.limit or args.runs, args.categories)[: args.runs]
    ids = [encode_prompt(model.tokenizer, p, args.system) for p in prompts]
    tree = args.tree or model.default_tree

    config, sampling = preset_settings(model, args.preset)
    settings = dict(config=config, sampling=sampling, seed=0)  # greedy, or the app's chat defaults
    lines = [f"# Profile of {tree} on {model.name}", "", f"`{command}`", ""] + split_table(model, ids, args, tree, settings)
    if args.split_only:
        return _write(lines, args)

    def generate_all() -> tuple[int, int]:
        steps = tokens = 0
        for x in ids:
            for rec in model.generate(x, max_new_tokens=args.max_new_tokens, tree=tree, **settings):
                if rec.step > 0:  # decoding steps; step 0 is the prefill
                    steps, tokens = steps + 1, tokens + len(rec.token_ids)
        return steps, tokens

    generate_all()  # warm-up
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    steps, tokens = generate_all()
    prof.disable()
    elapsed = time.perf_counter() - start
    out = args.out or Path("out") / "profile"
    out.mkdir(parents=True, exist_ok=True)
    stats = pstats.Stats(prof)
    stages = []
    for (file, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():
        if file.endswith(("medusa_core/model.py", "medusa_core/model_facts.py", "medusa_core/decoding.py", "medusa_core/acceptance.py", "medusa_core/heads.py")):
            stages.append([f"{Path(file).name}:{func}", calls, _fmt(1e3 * cumtime / steps, 3), _fmt(1e3 * tottime / steps, 3)])
    stages.sort(key=lambda r: -float(r[2]))
    lines += [f"{steps} steps, {tokens} tokens, {elapsed:.2f} s under cProfile: {1e3 * elapsed / steps:.2f} ms/step, "
             f"{tokens / steps:.2f} tokens/step", "", "## medusa_core functions (ms per step)", "",
             markdown_table(stages, ["function", "calls", "cumulative ms/step", "own ms/step"])]
    with open(out / "cprofile.txt", "w") as f:
        pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(60)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])) as tp:
        generate_all()
    table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    (out / "torch_ops.txt").write_text(table, encoding="utf-8")
    tp.export_chrome_trace(str(out / "trace.json"))
    lines += ["", "## torch ops (self CPU time, all steps)", "", "```", table, "```"]
    _write(lines, args)
    print(f"wrote {out / 'cprofile.txt'}, {out / 'torch_ops.txt'}, {out / 'trace.json'}")
    return 0


def split_table(model: Any, ids: list, args: argparse.Namespace, tree: str, settings: dict[str, Any]) -> list[str]:
    """Markdown lines: ms per decoding step by stage (``stepsplit.STAGES``) for a plain, a Medusa (``tree``)
    and a hybrid (``tree`` + n-gram chain) step (and a corpus-drafts step for a model with a corpus, an ``eagle`` step,
    the drafter's chain or the corpus's, for a model with a drafter), ``args.rounds`` interleaved rounds, each reply decoded with ``settings``
    (``generate``'s config / sampling / seed: ``--preset``'s); with the lean pass
    (``medusa_core.lean``) also the plain and Medusa steps through transformers' forward (``@transformers``), whose
    split shows the int4 linears, attention and cache writes that the lean pass does in one call."""
    import contextlib
    import time

    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    kinds = {"plain": dict(medusa=False), f"medusa:{tree}": dict(tree=tree), f"medusa+ngram:{tree}": dict(tree=tree, drafts="hybrid")}
    if model.has_corpus:
        kinds[f"medusa+corpus:{tree}"] = dict(tree=tree, drafts="corpus")
    if model.has_drafter:
        kinds["eagle"] = dict(drafts="eagle")  # as the bench's method: the chain tuned at the preset
    if model._steps.lean is not None:
        kinds |= {f"plain{TRANSFORMERS_PASS}": dict(medusa=False), f"medusa:{tree}{TRANSFORMERS_PASS}": dict(tree=tree)}
    step_split(model, ids[:1], max_new_tokens=8, clock=clock, **settings)  # warm-up
    totals: dict[str, list] = {k: [] for k in kinds}
    for _ in range(args.rounds):  # interleaved: each round times every kind once
        for kind, kwargs in kinds.items():
            with model._steps.transformers_pass() if kind.endswith(TRANSFORMERS_PASS) else contextlib.nullcontext():
                totals[kind].append(step_split(model, ids, max_new_tokens=args.max_new_tokens, clock=clock, **kwargs, **settings))
    rows = []
    for kind, runs in totals.items():
        steps = sum(r["steps"] for r in runs)
        ms = {s: sum(r["ms"][s] * r["steps"] for r in runs) / steps for s in STAGES}
        step_ms = sum(r["step_ms"] * r["steps"] for r in runs) / steps
        tokens = sum(r["tokens"] for r in runs) / steps
        rows.append([kind, _fmt(step_ms, 2), _fmt(tokens, 2)] + [_fmt(ms[s], 2) for s in STAGES])
    what = "CPU ms of the decoding thread" if args.clock == "cpu" else "wall ms"
    at = "greedy" if settings["config"].greedy else f"the {args.preset} preset, {settings['sampling']} verification"
    return [f"## {what} per decoding step, by stage ({args.rounds} interleaved rounds, {at})", "",
            markdown_table(rows, ["step", "ms/step", "tokens/step", *STAGES]), ""]


def _write(lines: list[str], args: argparse.Namespace) -> int:
    out = args.out or Path("out") / "profile"
    out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    (out / "profile.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out / 'profile.md'}")
    return 0

