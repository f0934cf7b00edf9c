"""The accounting: summaries per method and category, divergences from HF ``generate`` (paper appendix B.1),
and how many replies loop or end.

Pure arithmetic on token counts, step counts and latencies of ``Run`` records; tested on synthetic runs.
A method run at several torch thread counts is summarised once per count, and each count is compared
with the reference and the baseline at the same count (more threads change float summation order, so
only equal counts are expected to agree token for token).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Sequence

from .run import Run

REFERENCE = "hf"  # speedup and token-for-token identity are measured against this method
BASELINE = "baseline"  # overhead is measured against this method's step latency
ALL = "all"  # category label of the rows that pool every prompt


@dataclass(frozen=True)
class Summary:
    """One method at one torch thread count on one category (or ``all``), pooled over its prompts.

    Attributes:
        threads: torch's intra-op CPU threads of its runs; speedup, overhead and identity are measured
            against the reference and the baseline at the same count.
        tok_s / tok_s_min / tok_s_max: median, min and max over repeats of Σ tokens ÷ Σ wall time.
        acceleration: Σ tokens ÷ Σ steps.
        step_ms: Σ step time ÷ Σ timed steps, in ms.
        overhead: step_ms ÷ the baseline's step_ms (NaN without a baseline run).
        speedup: tok_s ÷ the reference's tok_s (NaN without a reference run).
        ttft_ms: median time to first token.
        identical / compared: prompts whose every output equals the reference's, of those compared
            (0 / 0 for the reference itself).
        cpu_per_wall: Σ CPU time ÷ Σ wall time; with one torch thread, values well below 1 mean other
            processes took the core and the wall-clock figures are inflated.
        looping: runs whose reply loops (``loops``); ended: runs whose reply ended with EOS within the limit.
    """

    method: str
    threads: int
    category: str
    tree_nodes: int
    prompts: int
    runs: int
    tokens: int
    tok_s: float
    tok_s_min: float
    tok_s_max: float
    acceleration: float
    step_ms: float
    overhead: float
    speedup: float
    ttft_ms: float
    identical: int
    compared: int
    cpu_per_wall: float = math.nan
    looping: int = 0
    ended: int = 0


@dataclass(frozen=True)
class Divergence:
    """The first token where a method's output differs from the reference's on one prompt.

    ``expected`` / ``got`` are None where that output had already ended. ``repeats`` counts the
    repeats that diverged. ``threads``: the torch thread count of the method's and the reference's runs.
    """

    method: str
    threads: int
    prompt: int
    category: str
    position: int
    expected: int | None
    got: int | None
    repeats: int


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (length included), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def find_divergences(runs: Sequence[Run], reference: str = REFERENCE) -> list[Divergence]:
    """Every (method, thread count, prompt) whose output differs from the reference's output on the same
    prompt, thread count and repeat (or its first repeat), with the first differing position. Greedy runs
    only: sampled replies are not meant to be equal."""
    runs = [r for r in runs if r.sampling == "greedy"]
    ref = {}
    for r in runs:
        if r.method == reference:
            ref.setdefault((r.threads, r.prompt, r.repeat), r.output)
            ref.setdefault((r.threads, r.prompt, None), r.output)
    found: dict[tuple[str, int, int], Divergence] = {}
    for r in runs:
        if r.method == reference:
            continue
        expected = ref.get((r.threads, r.prompt, r.repeat), ref.get((r.threads, r.prompt, None)))
        if expected is None:
            continue
        pos = first_difference(expected, r.output)
        if pos is None:
            continue
        key = (r.method, r.threads, r.prompt)
        if key in found:
            found[key] = Divergence(**{**asdict(found[key]), "repeats": found[key].repeats + 1})
        else:
            at = lambda seq: seq[pos] if pos < len(seq) else None  # noqa: E731
            found[key] = Divergence(method=r.method, threads=r.threads, prompt=r.prompt, category=r.category,
                                    position=pos, expected=at(expected), got=at(r.output), repeats=1)
    return list(found.values())


def _step_ms(group: Sequence[Run]) -> float:
    return 1e3 * _ratio(sum(r.step_time_s for r in group), sum(r.timed_steps for r in group))


def _tok_s_by_repeat(group: Sequence[Run]) -> list[float]:
    """Σ tokens ÷ Σ wall time of each repeat of ``group``."""
    repeats = sorted({r.repeat for r in group})
    return [
        _ratio(sum(r.tokens for r in group if r.repeat == k), sum(r.wall_s for r in group if r.repeat == k))
        for k in repeats
    ]


def summarise(runs: Sequence[Run], *, reference: str = REFERENCE, baseline: str = BASELINE) -> list[Summary]:
    """Per thread count × (each category, then ``all``) × method summaries of ``runs``; pure arithmetic.

    Thread counts ascend; categories are sorted with ``all`` last; methods keep their first-seen order.
    """
    methods = list(dict.fromkeys(r.method for r in runs))
    categories = sorted({r.category for r in runs}) + [ALL]
    diverged = {(d.method, d.threads, d.prompt) for d in find_divergences(runs, reference)}
    out = []
    for threads in sorted({r.threads for r in runs}):
        at_threads = [r for r in runs if r.threads == threads]
        ref_prompts = {r.prompt for r in at_threads if r.method == reference and r.sampling == "greedy"}
        for category in categories:
            in_category = [r for r in at_threads if category in (ALL, r.category)]
            ref_group = [r for r in in_category if r.method == reference]
            base_group = [r for r in in_category if r.method == baseline]
            ref_tok_s = statistics.median(_tok_s_by_repeat(ref_group)) if ref_group else math.nan
            base_step = _step_ms(base_group) if base_group else math.nan
            for method in methods:
                group = [r for r in in_category if r.method == method]
                if not group:
                    continue
                rates = _tok_s_by_repeat(group)
                prompts = {r.prompt for r in group}
                compared = prompts & ref_prompts if method != reference else set()
                out.append(Summary(
                    method=method,
                    threads=threads,
                    category=category,
                    tree_nodes=group[0].tree_nodes,
                    prompts=len(prompts),
                    runs=len(group),
                    tokens=sum(r.tokens for r in group),
                    tok_s=statistics.median(rates),
                    tok_s_min=min(rates),
                    tok_s_max=max(rates),
                    acceleration=_ratio(sum(r.tokens for r in group), sum(r.steps for r in group)),
                    step_ms=_step_ms(group),
                    overhead=_ratio(_step_ms(group), base_step),
                    speedup=_ratio(statistics.median(rates), ref_tok_s),
                    ttft_ms=1e3 * statistics.median(r.ttft_s for r in group),
                    identical=sum(1 for p in compared if (method, threads, p) not in diverged),
                    compared=len(compared),
                    cpu_per_wall=_ratio(sum(r.cpu_s for r in group), sum(r.wall_s for r in group)),
                    looping=sum(r.loops for r in group),
                    ended=sum(r.ended for r in group),
                ))
    return out
