"""The hardware-aware tree tuner (paper 2.3.3, fig. 4): ``python -m medusa_core.bench tune``.

It measures step latency per tree size and tokens per step, applies ``tune_rules`` (the pure prediction,
choice and τ rules), and writes the chosen tree and τ to ``medusa_tuned.json``. It tunes at each settings
preset of ``medusa_core.tuned`` (greedy, and the app's chat defaults): a tree that pays at greedy may not
under sampling, where the processors run on every tree row and fewer candidates are accepted. With a
drafter, ``tune_chain`` then times its chains.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..drafts import DraftConfig
from ..processors import CHAT_SAMPLING, SamplingConfig
from ..tuned import machine_class, tuned_key
from .accounting import ALL, Summary, _ratio, summarise
from .methods import Method
from .prompts import encode_prompt, load_prompts
from .report import _fmt, environment, markdown_table, write_csv, write_figure
from .run import run_benchmark
from .tune_chain import tune_chain_at
from .tune_rules import choose_tree_size, confirm_choice, monotone_latency, predict_speedups, tuned_threshold

def measure_step_latency(
    model: Any, prompt_ids: Sequence[torch.Tensor], trees: Mapping[int, Sequence[Sequence[int]]],
    *, max_new_tokens: int = 64, progress: bool = True, config: SamplingConfig = SamplingConfig(), sampling: str = "typical",
) -> tuple[dict[int, float], dict[int, float]]:
    """Step latency (s) and acceleration rate of every tree size, through the real decode loop, at the
    sampling settings ``config`` (verified as ``sampling`` says when it samples; seed 0 for every run).

    ``trees[n]`` are the paths of size n; size 0 is plain decoding (``medusa=False``). Sizes are
    interleaved per prompt. A run's step latency is the mean over the steps that verified the full tree
    (the engine drops to a root-only step near the token limit), step 0's prefill subtracted; a size's
    latency is the median over runs, which shrugs off a run slowed by another process.
    """
    from tqdm.auto import tqdm

    sizes = sorted(trees)
    per_run: dict[int, list[float]] = {n: [] for n in sizes}
    tokens = dict.fromkeys(sizes, 0)
    steps = dict.fromkeys(sizes, 0)

    def go(n: int, ids: torch.Tensor, limit: int) -> list[Any]:
        kwargs = dict(medusa=False) if n == 0 else dict(tree=[list(p) for p in trees[n]])
        return list(model.generate(ids, max_new_tokens=limit, config=config, sampling=sampling, seed=0,  # whole trees
                                   draft_config=DraftConfig(min_head_probability=0.0), **kwargs))

    for n in sizes:
        go(n, prompt_ids[0], 8)  # warm-up and tree buffers
    bar = tqdm(total=len(prompt_ids) * len(sizes), desc="step latency", unit="run", disable=not progress)
    for j, ids in enumerate(prompt_ids):
        k = j % len(sizes)
        for n in sizes[k:] + sizes[:k]:
            records = go(n, ids, max_new_tokens)
            decode = records[1:]  # records[0] is the prefill and its first token
            full = [r.latency_s for r in decode if r.tree_nodes == len(trees[n]) + 1]
            if full:
                per_run[n].append(sum(full) / len(full))
            tokens[n] += sum(len(r.token_ids) for r in decode)
            steps[n] += len(decode)
            bar.update()
    bar.close()
    latency = {n: statistics.median(v) for n, v in per_run.items() if v}
    accel = {n: tokens[n] / steps[n] for n in sizes if steps[n]}
    return latency, accel


def dump_tuned(data: Mapping[str, Any]) -> str:
    """JSON text of a tuned-tree file with one line per field (paths stay on one line)."""
    parts = []
    for key, entry in data.items():
        if isinstance(entry, dict):
            inner = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in entry.items())
            parts.append(f" {json.dumps(key)}: {{\n{inner}\n }}")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(entry)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_tuned(path: Path, key: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Merge ``{key: entry}`` into the tuned-tree file at ``path`` (other keys kept), atomically."""
    data: dict[str, Any] = {}
    if path.exists():
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"{path} does not hold a JSON object; move it away and tune again")
    data[key] = entry
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dump_tuned(data), encoding="utf-8")
    os.replace(tmp, path)
    return data



def _model_folder(name_or_path: str) -> Path:
    from ..loading import local_folder  # the same resolution the loader uses ("demo", folder, Hub id)

    return local_folder(name_or_path)


def preset_settings(model: Any, preset: str) -> tuple[SamplingConfig, str]:
    """(settings, Medusa verification mode) a tuned preset is measured at: greedy, or the app's chat defaults
    (``MedusaModel.chat_defaults`` verified with ``CHAT_SAMPLING``, as the app and ``bench --preset chat``)."""
    return (SamplingConfig(), "typical") if preset == "greedy" else (model.chat_defaults, CHAT_SAMPLING)


def cmd_tune(model: Any, args: argparse.Namespace, command: str) -> int:
    """Measure step latency per tree size at each of ``--presets``, predict, confirm the best sizes, and write
    one ``medusa_tuned.json`` entry per preset with the chosen tree and τ (``--threshold-only``: τ alone,
    from the entries' stored figures); for a model with a drafter, then its chain (``tune_chain``; ``--chains-only``:
    the chain alone, into the existing entries)."""
    from ..loading import TUNED_FILE
    from ..trees import optimal_tree

    target = args.tuned_file or _model_folder(args.model) / TUNED_FILE
    if args.chains_only:
        if not model.has_drafter:
            raise SystemExit(f"--chains-only tunes the drafter's chain; {args.model} has no drafter (pass --drafter FILE)")
        for preset in args.presets:
            tune_chain_at(model, args, command, preset, target)
        return 0
    if args.threshold_only:
        data = json.loads(target.read_text(encoding="utf-8")) if target.exists() else {}
        for preset in args.presets:
            key = tuned_key(model.device, model.quantization, preset, machine_class(model.device, model.quantization))
            entry = data.get(key)
            if not isinstance(entry, dict):
                raise SystemExit(f"{target} has no entry {key!r} to derive τ from: run bench tune --presets {preset} first")
            entry |= {"min_head_probability": round(tuned_threshold(entry), 4), "min_head_probability_command": command}
            print(f"τ (min_head_probability) = {entry['min_head_probability']} from the figures stored in {target} [{key}]")
            if not args.dry_run:
                write_tuned(target, key, entry)
        return 0

    if args.rank_accuracy:
        rank_accuracy = json.loads(args.rank_accuracy.read_text(encoding="utf-8"))["rank_accuracy"]
    else:
        rank_accuracy = model.rank_accuracy
    if not rank_accuracy:
        raise SystemExit(
            f"{args.model} has no calibrated rank accuracies (medusa_calibration.json with 'rank_accuracy'): "
            "calibrate the heads first, or pass --rank-accuracy FILE.json"
        )
    rank_accuracy = [list(r) for r in rank_accuracy[: model.num_heads]]
    trees: dict[int, list[list[int]]] = {0: []}
    expected: dict[int, float] = {0: 0.0}
    for n in sorted(set(args.sizes)):
        paths, e = optimal_tree(rank_accuracy, n)
        if len(paths) == n:  # a budget beyond the calibrated ranks adds nothing
            trees[n], expected[n] = paths, e
    for preset in args.presets:
        entry = tune_at(model, args, command, preset, trees, expected, target)
        if model.has_drafter:  # the chain goes into the entry the tree stage has just made
            tune_chain_at(model, args, command, preset, target, entry)
    return 0


def tune_at(model: Any, args: argparse.Namespace, command: str, preset: str, trees: Mapping[int, list[list[int]]],
            expected: Mapping[int, float], target: Path) -> dict[str, Any]:
    """One preset's tuning (``cmd_tune``): time every size of ``trees`` (paths n -> the tree, 0 the plain loop;
    ``expected`` accepted tokens from the rank accuracies), confirm the best by a benchmark, print and write
    the report under ``--out``/<preset>, and merge the entry into ``target``. Returns the entry."""
    key = tuned_key(model.device, model.quantization, preset, machine_class(model.device, model.quantization))
    config, sampling = preset_settings(model, preset)
    label = config.describe() + ("" if config.greedy else f", {sampling}")
    print(f"tuning at {preset} ({label}) → {target} [{key}]")
    timing_ids = [encode_prompt(model.tokenizer, p, args.system) for p in load_prompts(args.prompts, args.latency_prompts, args.categories)]
    latency, accel = measure_step_latency(model, timing_ids, trees, max_new_tokens=args.latency_tokens,
                                          progress=not args.no_progress, config=config, sampling=sampling)
    fitted = monotone_latency(latency)
    predicted = predict_speedups(expected, fitted)
    pick = choose_tree_size({n: s for n, s in predicted.items() if n}, args.tolerance)
    ranked = sorted((n for n in predicted if n), key=lambda n: (n != pick, -predicted[n]))[: max(args.confirm_top, 1)]

    confirm_prompts = load_prompts(args.prompts, args.limit or args.confirm_prompts, args.categories)
    methods = [Method("hf", "hf"), Method("baseline", "baseline")] + [
        Method(f"medusa:optimal_{n}", "medusa", tuple(map(tuple, trees[n]))) for n in ranked
    ]
    runs, notes = run_benchmark(model, confirm_prompts, methods, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                                system=args.system, progress=not args.no_progress, config=config, sampling=sampling,
                                draft_config=DraftConfig(min_head_probability=0.0))
    overall = {s.method: s for s in summarise(runs) if s.category == ALL}
    base_tok_s = overall["baseline"].tok_s
    measured = {n: overall[f"medusa:optimal_{n}"] for n in ranked}
    best = confirm_choice(pick, {n: measured[n].tok_s for n in ranked}, args.tolerance)
    if measured[best].tok_s < base_tok_s:
        notes.append(f"no tree beat plain decoding here: the best, {best} paths, ran at "
                     f"{_ratio(measured[best].tok_s, base_tok_s):.2f}× the plain loop's tokens/s (the app says so beside "
                     "its Medusa toggle at these settings)")
    if pick != best:
        notes.append(f"the prediction picked {pick} paths; the confirming benchmark measured {best} paths faster")

    rows = []
    for n in sorted(predicted):
        m = measured.get(n)
        rows.append([
            n, n + 1, _fmt(1 + expected[n]), _fmt(accel.get(n, math.nan)), _fmt(1e3 * latency[n]), _fmt(1e3 * fitted[n]),
            _fmt(fitted[n] / fitted[0]), _fmt(predicted[n]) + "×", _fmt(accel.get(n, math.nan) * fitted[0] / fitted[n]) + "×",
            _fmt(_ratio(m.tok_s, base_tok_s)) + "×" if m else "", _fmt(m.speedup) + "×" if m else "",
            ("**chosen**" if n == best else "") + (" predicted best" if n == pick else ""),
        ])
    env = environment(model)
    table = markdown_table(rows, ["paths n", "tree tokens", "expected accel.", "accel. in timing runs", "step ms",
                                  "step ms (monotone fit)", "step cost ×", "predicted speedup",
                                  "step speedup in timing runs", "measured speedup vs baseline", "measured speedup vs HF", ""])
    text = "\n".join([
        f"# Tree tuning at {preset}: {label}", "", f"`{command}`", "", ", ".join(f"{k}: {v}" for k, v in env.items()), "", table, "",
        "predicted speedup = expected accel. (from the calibrated rank accuracies, paper 2.3.3) ÷ step cost "
        "(fitted step latency ÷ plain step latency); step speedup in timing runs = the acceleration the timing runs "
        "reached ÷ step cost; measured = tokens/s ÷ the plain loop's tokens/s "
        f"(and ÷ HF generate's) in a confirming benchmark of {len({r.prompt for r in runs})} prompts × "
        f"{args.max_new_tokens} tokens at the same settings.", "",
    ] + [f"- {n}" for n in notes])
    out = write_tune_report(args, preset, "tune", text, [
        "paths", "tree_tokens", "expected_acceleration", "timing_acceleration", "step_ms", "step_ms_fitted",
        "predicted_speedup", "measured_speedup_vs_baseline", "measured_speedup_vs_hf"], [
        [n, n + 1, 1 + expected[n], accel.get(n), 1e3 * latency[n], 1e3 * fitted[n], predicted[n],
         _ratio(measured[n].tok_s, base_tok_s) if n in measured else "", measured[n].speedup if n in measured else ""]
        for n in sorted(predicted)])
    write_csv(out / "runs.csv", runs, exclude=("output",))
    paths = write_figure(_tune_figure(predicted, measured, base_tok_s, env), out / "tune")

    m = measured[best]
    entry = {
        "choices": trees[best],
        "nodes": best + 1,
        "settings": label,
        "predicted_speedup": round(predicted[best], 4),
        "measured_speedup": round(_ratio(m.tok_s, base_tok_s), 4),
        "measured_speedup_vs_hf": round(m.speedup, 4),
        "predicted_acceleration": round(1 + expected[best], 4),
        "measured_acceleration": round(m.acceleration, 4),
        "measured_overhead": round(m.overhead, 4),
        **({"identical_to_hf": f"{m.identical}/{m.compared}"} if config.greedy else {}),
        "step_latency_ms": {str(n): round(1e3 * v, 4) for n, v in sorted(latency.items())},
        "step_latency_fitted_ms": {str(n): round(1e3 * v, 4) for n, v in sorted(fitted.items())},
        "predicted_best_paths": pick,
        "device_name": env["device_name"],
        "dtype": env["dtype"],
        "torch_threads": env["torch_threads"],
        "tuned_at": env["date"],
        "command": command,
    }
    entry["min_head_probability"] = round(tuned_threshold(entry), 4)
    print(f"τ (min_head_probability) = {entry['min_head_probability']}: a node of the chosen tree is verified when its "
          "calibrated path probability beats the marginal cost of one more tree token (Δ·A/T)")
    if args.dry_run:
        print(f"--dry-run: not writing {target} [{key}]")
    else:
        write_tuned(target, key, entry)
        print(f"wrote the tree tuned at {preset} ({best} paths, {best + 1} tree tokens) to {target} [{key}]")
    print("wrote " + ", ".join(map(str, [out / "tune.md", out / "tune.csv", out / "runs.csv", *paths])))
    return entry


def write_tune_report(args: argparse.Namespace, preset: str, name: str, text: str, header: Sequence[str],
                      rows: Sequence[Sequence[Any]]) -> Path:
    """Print a tuning report ``text`` and write it as ``<name>.md``, with ``rows`` under ``header`` as
    ``<name>.csv``, into ``--out``/<preset> (default ``out/tune/<preset>``). Returns that folder."""
    print(text)
    out = (args.out or Path("out") / "tune") / preset
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text, encoding="utf-8")
    with (out / f"{name}.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return out


def _tune_figure(predicted: Mapping[int, float], measured: Mapping[int, Summary], base_tok_s: float, env: Mapping[str, Any]) -> Any:
    import plotly.graph_objects as go

    x = sorted(predicted)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[n + 1 for n in x], y=[predicted[n] for n in x], mode="lines+markers", name="predicted"))
    mx = sorted(measured)
    fig.add_trace(go.Scatter(x=[n + 1 for n in mx], y=[_ratio(measured[n].tok_s, base_tok_s) for n in mx],
                             mode="markers", marker=dict(size=12, symbol="diamond"), name="measured"))
    fig.update_xaxes(title_text="tree tokens per step (N, root included)", type="log")
    fig.update_yaxes(title_text="speedup vs the plain loop (×)")
    fig.update_layout(title=f"Tree size vs speedup — {env['device_name']}, {env['quantization']}", template="plotly_white")
    return fig

