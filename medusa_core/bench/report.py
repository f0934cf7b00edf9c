"""Reports: markdown tables, CSV files, plotly charts and the benchmark's ``summary.md``."""

from __future__ import annotations

import csv
import logging
import math
import os
import platform
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from ..cpu import physical_cores
from .accounting import ALL, REFERENCE, Summary, find_divergences, summarise
from .run import LOOP_NGRAM, LOOP_TIMES, Run

log = logging.getLogger(__name__)


def _fmt(x: float, digits: int = 2) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A GitHub markdown table; numbers right-aligned."""
    numeric = lambda cell: str(cell)[:1] in set("0123456789-—.")  # noqa: E731
    align = ["---:" if rows and all(numeric(r[i]) for r in rows) else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def summary_markdown(summaries: Sequence[Summary], category: str = ALL) -> str:
    """The main table: one row per method and thread count for ``category``."""
    rows = []
    for s in summaries:
        if s.category != category:
            continue
        same = "ref." if s.method == REFERENCE else "—" if s.compared == 0 else f"{s.identical}/{s.compared}"
        rows.append([
            s.method, s.threads, s.tree_nodes, f"{s.tok_s:.1f} ({s.tok_s_min:.1f}–{s.tok_s_max:.1f})", _fmt(s.acceleration),
            _fmt(s.step_ms), _fmt(s.overhead), _fmt(s.speedup) + "×", _fmt(s.ttft_ms, 1), same,
            _fmt(s.cpu_per_wall), f"{s.looping}/{s.runs}", f"{s.ended}/{s.runs}",
        ])
    header = ["method", "threads", "tree tokens", "tokens/s median (min–max)", "accel. rate", "step ms", "overhead",
              "speedup vs HF", "TTFT ms", "identical to HF", "CPU/wall", "loops", "ends (EOS)"]
    return markdown_table(rows, header)


def method_label(s: Summary, several_thread_counts: bool) -> str:
    """``s.method``, with ``@<threads>t`` when the run had several thread counts."""
    return f"{s.method} @{s.threads}t" if several_thread_counts else s.method


def category_matrix(summaries: Sequence[Summary], attr: str, digits: int = 2) -> str:
    """Categories × methods (× thread counts, when there are several) table of one Summary attribute."""
    several = len({s.threads for s in summaries}) > 1
    columns = list(dict.fromkeys(method_label(s, several) for s in summaries))
    categories = list(dict.fromkeys(s.category for s in summaries))
    by = {(s.category, method_label(s, several)): getattr(s, attr) for s in summaries}
    rows = [[c] + [_fmt(by.get((c, m), math.nan), digits) for m in columns] for c in categories]
    return markdown_table(rows, ["category"] + columns)


def write_csv(path: Path, items: Iterable[Any], exclude: Sequence[str] = ()) -> Path:
    """Dataclass instances as CSV rows (field order = columns)."""
    items = list(items)
    if not items:
        path.write_text("", encoding="utf-8")
        return path
    names = [f.name for f in fields(items[0]) if f.name not in exclude]
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(names)
        for it in items:
            w.writerow([getattr(it, n) for n in names])
    return path


def write_figure(fig: Any, stem: Path) -> list[Path]:
    """The figure as self-contained HTML, and PNG when kaleido is importable."""
    paths = [stem.with_suffix(".html")]
    fig.write_html(paths[0], include_plotlyjs=True)
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return paths
    try:
        fig.write_image(stem.with_suffix(".png"), width=900, height=520)
        paths.append(stem.with_suffix(".png"))
    except Exception as e:  # kaleido needs a browser it may not find; HTML is the deliverable
        log.warning("PNG export failed (%s); the HTML chart is written", e)
    return paths


def speedup_figure(summaries: Sequence[Summary], title: str) -> Any:
    """Speedup vs HF and acceleration rate per tree size (Medusa methods), other methods as lines."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    counts = sorted({s.threads for s in summaries})
    several = len(counts) > 1
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for t in counts:  # one pair of curves per thread count
        rows = sorted((s for s in summaries if s.category == ALL and s.threads == t and s.method.startswith("medusa:")),
                      key=lambda s: s.tree_nodes)
        x, suffix = [s.tree_nodes for s in rows], f", {t} threads" if several else ""
        fig.add_trace(go.Scatter(x=x, y=[s.speedup for s in rows], mode="lines+markers+text", name="speedup vs HF" + suffix,
                                 text=[s.method.split(":", 1)[1] for s in rows], textposition="top center"))
        fig.add_trace(go.Scatter(x=x, y=[s.acceleration for s in rows], mode="lines+markers",
                                 name="acceleration rate" + suffix, line=dict(dash="dot")), secondary_y=True)
    for s in summaries:
        if s.category == ALL and not s.method.startswith("medusa:") and not math.isnan(s.speedup):
            fig.add_hline(y=s.speedup, line_dash="dash", annotation_text=method_label(s, several),
                          annotation_position="bottom right")
    fig.update_xaxes(title_text="tree tokens per step (N, root included)", type="log")
    fig.update_yaxes(title_text="speedup vs HF generate (×)", secondary_y=False)
    fig.update_yaxes(title_text="tokens per step", secondary_y=True)
    fig.update_layout(title=title, template="plotly_white")
    return fig


def environment(model: Any) -> dict[str, Any]:
    """What the numbers depend on: device, precision, threads, versions."""
    import transformers

    dev = model.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    if dev.type == "cpu":
        try:
            name = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
    return {
        "model": model.name,
        "device": str(dev),
        "device_name": name,
        "cpu_count": os.cpu_count(),
        "physical_cores": physical_cores(),
        "torch_threads": torch.get_num_threads(),
        "quantization": model.quantization or "none",
        "dtype": str(model.dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def write_report(
    out: Path, runs: Sequence[Run], *, command: str, env: Mapping[str, Any], settings: Mapping[str, Any],
    notes: Sequence[str] = (),
) -> tuple[str, list[Path]]:
    """Write ``runs.csv``, ``summary.csv``, ``summary.md`` and ``speedup_by_tree.html`` (+ PNG) into
    ``out``; returns the markdown and the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    summaries = summarise(runs)
    divergences = find_divergences(runs)
    paths = [write_csv(out / "runs.csv", runs, exclude=("output",)), write_csv(out / "summary.csv", summaries)]
    md = [
        "# Medusa benchmark", "",
        f"`{command}`", "",
        ", ".join(f"{k}: {v}" for k, v in {**env, **settings}.items()), "",
        summary_markdown(summaries), "",
        "tokens/s: new tokens ÷ wall time of the whole call (prefill included), median over repeats; "
        "accel. rate: tokens per decoding step; overhead: step latency ÷ the `baseline` loop's; "
        "speedup: tokens/s ÷ HF `generate`'s at the same thread count; TTFT: time to the first new token; CPU/wall: this process's CPU "
        "time ÷ wall time (about the thread count on a quiet machine; lower means other processes took the cores); "
        f"loops: replies in which some {LOOP_NGRAM}-token sequence occurs at least {LOOP_TIMES} times; ends (EOS): "
        "replies that ended with EOS within the token limit"
        + ("; `@Nt` in the tables below: N torch threads." if len({s.threads for s in summaries}) > 1 else "."), "",
        "## Speedup vs HF generate per category", "", category_matrix(summaries, "speedup"), "",
        "## Tokens/s per category (median over repeats)", "", category_matrix(summaries, "tok_s", 1), "",
        "## Acceleration rate per category", "", category_matrix(summaries, "acceleration"), "",
        "## Greedy outputs compared with HF generate", "",
    ]
    sampled = sorted({r.sampling for r in runs} - {"greedy"})
    if sampled:
        md.append(f"Sampled runs ({', '.join(sampled)}): outputs are not compared, only greedy decoding must equal HF "
                  "generate token for token.")
    elif divergences:
        md += [f"{len(divergences)} (method, threads, prompt) triples diverge from HF generate at the same thread count:",
               "", markdown_table(
            [[d.method, d.threads, d.prompt, d.category, d.position, d.expected, d.got, d.repeats] for d in divergences],
            ["method", "threads", "prompt", "category", "first diverging token", "HF token", "method token", "repeats"],
        )]
    else:
        compared = sum(s.compared for s in summaries if s.category == ALL)
        md.append(f"No divergence: all {compared} (method, threads, prompt) outputs are identical to HF generate "
                  "at the same thread count, token for token.")
    if notes:
        md += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    text = "\n".join(md) + "\n"
    (out / "summary.md").write_text(text, encoding="utf-8")
    paths.append(out / "summary.md")
    if any(s.method.startswith("medusa:") for s in summaries):
        paths += write_figure(speedup_figure(summaries, f"Medusa speedup per tree size — {env.get('model')}, "
                                             f"{env.get('device_name')}, {env.get('quantization')}"), out / "speedup_by_tree")
    return text, paths

