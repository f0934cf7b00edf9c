"""The tree tuner's rules (paper 2.3.3, fig. 4), pure and tested on synthetic curves.

Tree sizes are counted in paths ``n`` (nodes without the root, ``optimal_tree``'s budget); a tree then
verifies ``N = n + 1`` tokens per step. ``predict_speedups``, ``monotone_latency``, ``choose_tree_size`` and
``confirm_choice`` pick a tree size from measured step latencies and the heads' expected acceptance;
``marginal_token_cost``, ``choose_min_head_probability`` and ``tuned_threshold`` pick τ, the path probability
a node of the chosen tree needs to be verified in trees shaped per step (EAGLE-2). ``tune`` measures and
writes; this module only computes.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Mapping

#: Tree sizes (paths, root excluded) the tuner measures by default.
TUNE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def predict_speedups(expected_accept: Mapping[int, float], latency_s: Mapping[int, float]) -> dict[int, float]:
    """Predicted speedup over plain decoding of each tree size (paper 2.3.3, fig. 4).

    speedup(n) = (1 + expected_accept(n)) / (latency(n) / latency(0)), where n counts paths (root
    excluded), ``expected_accept[n]`` is ``optimal_tree(rank_accuracy, n)[1]`` and ``latency_s[0]``
    is the plain step. Sizes without a latency are left out. Raises ``ValueError`` without ``latency_s[0]``.
    """
    if latency_s.get(0, 0) <= 0:
        raise ValueError("latency_s[0], the plain decoding step, is needed as the unit of step cost")
    return {
        n: (1.0 + (0.0 if n == 0 else expected_accept[n])) / (latency_s[n] / latency_s[0])
        for n in sorted(latency_s)
        if n == 0 or n in expected_accept
    }


def monotone_latency(latency_s: Mapping[int, float]) -> dict[int, float]:
    """The closest non-decreasing curve to measured step latencies (least squares, pool adjacent violators).

    A bigger tree never costs less per step; a measurement that says so is noise from other processes,
    and fitting it out keeps the tuner from picking a size for its lucky timing.
    """
    blocks: list[list[float]] = []  # [mean, count]
    for n in sorted(latency_s):
        blocks.append([latency_s[n], 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    fitted = [m for m, c in blocks for _ in range(int(c))]
    return dict(zip(sorted(latency_s), fitted))


def choose_tree_size(predicted: Mapping[int, float], tolerance: float = 0.0) -> int:
    """The smallest size whose predicted speedup is within ``tolerance`` (relative) of the best.

    A tolerance of a few percent prefers the smaller tree when a larger one wins only by noise.
    """
    if not predicted:
        raise ValueError("no predicted speedups to choose from")
    best = max(predicted.values())
    return min(n for n, s in predicted.items() if s >= best * (1.0 - tolerance))


def confirm_choice(pick: int, measured_tok_s: Mapping[int, float], tolerance: float = 0.0) -> int:
    """The tree size to keep after the confirming benchmark: the predicted ``pick``, unless another
    confirmed size ran more than ``tolerance`` (relative) faster, in which case the fastest."""
    fastest = max(measured_tok_s, key=measured_tok_s.get)
    if pick not in measured_tok_s or measured_tok_s[fastest] > measured_tok_s[pick] * (1.0 + tolerance):
        return fastest
    return pick


def marginal_token_cost(latency_s: Mapping[int, float]) -> float:
    """Δ, the cost of one more tree token: the least-squares slope of step latency against tree size.

    ``latency_s[n]`` is the step latency (any unit: Δ comes in the same unit per token) of a tree of n paths,
    i.e. n + 1 tokens. A negative slope (noise) gives 0: a bigger tree never costs less.
    Raises ``ValueError`` with fewer than two sizes.
    """
    if len(latency_s) < 2:
        raise ValueError(f"the marginal cost of a token needs step latencies of at least two tree sizes, got {dict(latency_s)}")
    mean_n = statistics.fmean(latency_s)
    mean_t = statistics.fmean(latency_s.values())
    spread = sum((n - mean_n) ** 2 for n in latency_s)
    return max(0.0, sum((n - mean_n) * (t - mean_t) for n, t in latency_s.items()) / spread)


def choose_min_head_probability(marginal_s: float, step_latency_s: float, tokens_per_step: float) -> float:
    """τ: the path probability above which one more node pays for itself (trees shaped per step, EAGLE-2).

    A step of latency T that makes A tokens on average, given one more node whose path is right with
    probability p (a calibrated path probability: ``MedusaModel.head_temperatures``), makes A + p tokens in
    T + Δ: more tokens per second exactly when (A + p) / (T + Δ) > A / T, i.e. p > Δ·A / T.
    Args: ``marginal_s`` Δ ≥ 0 and ``step_latency_s`` T > 0 in one unit (seconds, or the plain step);
    ``tokens_per_step`` A > 0 (the acceleration rate of the tree). Returns Δ·A/T, capped at 1.
    Raises ``ValueError`` for a value out of range, naming it.
    """
    for name, value, ok in (("marginal_s", marginal_s, marginal_s >= 0), ("step_latency_s", step_latency_s, step_latency_s > 0),
                            ("tokens_per_step", tokens_per_step, tokens_per_step > 0)):
        if not ok or not math.isfinite(value):
            raise ValueError(f"{name} must be {'>= 0' if name == 'marginal_s' else '> 0'}, got {value}")
    return min(1.0, marginal_s * tokens_per_step / step_latency_s)


def tuned_threshold(entry: Mapping[str, Any]) -> float:
    """``choose_min_head_probability`` from the figures a ``medusa_tuned.json`` entry stores.

    A tuner run stores ``step_latency_fitted_ms`` per size: Δ is the slope over the Medusa trees (n ≥ 1:
    a shaped step runs the heads' pass whatever it keeps) up to the chosen tree's size (shaping drops only that
    tree's nodes, so larger trees, dearer per path where a pass outgrows a group of rows, do not count; a one-path
    tree's is the slope to the next size), T the chosen tree's (``nodes`` − 1 paths). An
    entry picked by hand from a benchmark stores only its tree's ``measured_overhead`` (step cost ÷ the
    plain step's): Δ is then the slope from the plain step to that tree, which counts the heads' pass as
    per-token cost and so overstates Δ. A is ``measured_acceleration`` either way.
    Raises ``ValueError`` for an entry with neither figure.
    """
    paths, accel = int(entry["nodes"]) - 1, float(entry["measured_acceleration"])
    if "step_latency_fitted_ms" in entry:
        latency = {int(n): float(t) for n, t in entry["step_latency_fitted_ms"].items()}
        medusa = sorted(n for n in latency if n >= 1)
        sizes = [n for n in medusa if n <= paths]
        sizes += [n for n in medusa if n > paths][: max(0, 2 - len(sizes))]  # a one-path tree: to the next size
        slope = marginal_token_cost({n: latency[n] for n in sizes} if len(sizes) >= 2 else latency)
        return choose_min_head_probability(slope, latency[paths], accel)
    if "measured_overhead" in entry:
        overhead = float(entry["measured_overhead"])
        return choose_min_head_probability(marginal_token_cost({0: 1.0, paths: overhead}), overhead, accel)
    raise ValueError("the tuned entry has neither step_latency_fitted_ms nor measured_overhead to derive τ from")
