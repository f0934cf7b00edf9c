"""Speed, measured: the benchmark program and the hardware-aware tree tuner (paper appendix B.1, 2.3.3).

    python -m medusa_core.bench [options]           # Medusa vs HF generate, HF prompt lookup, plain loop
    python -m medusa_core.bench --temperature 0.7 --sampling exact   # the same, sampled (typical or exact)
    python -m medusa_core.bench tune [options]      # pick the tree size that suits this device/precision
    python -m medusa_core.bench profile [options]   # where a Medusa step spends its time

Terms (paper appendix B.1, ``MEDUSA_FACTS.md``):

- **acceleration rate** = tokens per decoding step (one backbone forward pass each; 1.0 for plain decoding).
- **overhead** = mean step latency ÷ mean step latency of this project's plain loop (``baseline``).
- **speedup** = tokens/s ÷ tokens/s of Hugging Face ``generate`` on the same weights (wall clock,
  prefill included, so it is what a user sees).

Every method runs on the same loaded weights, in one process, after a warm-up, interleaved prompt by
prompt (with the method order rotated) so that machine drift hits all of them alike. Greedy outputs are
compared token for token with HF ``generate``; every divergence is listed in the report. At temperature > 0
every method samples from softmax(logits / T) (HF with ``top_k=0``), seeded per (prompt, repeat) so typical
and exact runs see the same prompts and seeds; outputs are then not compared (exactness of the distribution
is a statistical property, tested in ``tests/test_sampling.py``).

The accounting (``summarise``, ``find_divergences``, ``predict_speedups``, ``choose_tree_size``) is
pure: it sees only token counts, step counts and latencies, and is tested on synthetic runs. Tree
sizes in the tuner are counted in paths ``n`` (nodes without the root, ``optimal_tree``'s budget);
a tree then verifies ``N = n + 1`` tokens per step (``StepRecord.tree_nodes``).
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import json
import logging
import math
import os
import platform
import pstats
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from .model import SAMPLING_MODES

log = logging.getLogger(__name__)

#: Method kinds: HF greedy ``generate``, HF prompt lookup decoding, this project's plain loop, Medusa.
METHOD_KINDS = ("hf", "hf_pld", "baseline", "medusa")
REFERENCE = "hf"  # speedup and token-for-token identity are measured against this method
BASELINE = "baseline"  # overhead is measured against this method's step latency
ALL = "all"  # category label of the rows that pool every prompt
#: Tree sizes (paths, root excluded) the tuner measures by default.
TUNE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: Small trees benchmarked when the model ships none of its own.
DEFAULT_TREES = ("chain_4", "sparse_8", "sparse_16", "sparse_32")


# ------------------------------------------------------------------------------------------ prompts
@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: the user's message and its category (MT-Bench's eight, or ``python``)."""

    text: str
    category: str = "uncategorised"


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[Prompt]:
    """Prompts from a JSONL file with a ``prompt`` field and an optional ``category`` field.

    ``path=None`` reads the shipped set (``medusa_core/data/bench_prompts.jsonl``). ``limit`` keeps
    that many, taken round robin over the categories (so every category stays represented).
    Raises ``ValueError`` naming the file and line of a record without a ``prompt``.
    """
    if path is None:
        text = resources.files("medusa_core").joinpath("data/bench_prompts.jsonl").read_text(encoding="utf-8")
        source = "medusa_core/data/bench_prompts.jsonl"
    else:
        text, source = Path(path).read_text(encoding="utf-8"), str(path)
    prompts = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}:{line_no}: not valid JSON ({e})") from e
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{source}:{line_no}: expected an object with a string field 'prompt'")
        prompts.append(Prompt(record["prompt"], str(record.get("category") or "uncategorised")))
    if not prompts:
        raise ValueError(f"{source}: no prompts")
    if limit is not None and 0 < limit < len(prompts):
        # round robin over the categories, each in file order, then back to file order
        queues: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            queues.setdefault(p.category, []).append(i)
        picked: list[int] = []
        while len(picked) < limit:
            for q in queues.values():
                if q and len(picked) < limit:
                    picked.append(q.pop(0))
        prompts = [prompts[i] for i in sorted(picked)]
    return prompts


def encode_prompt(tokenizer: Any, text: str, system: str | None = None) -> torch.Tensor:
    """[1, T] token ids of one user message (after an optional system message) through the tokenizer's
    chat template; plain text when the tokenizer has no template."""
    if tokenizer is None:
        raise ValueError("the model has no tokenizer: the benchmark needs one to encode its prompts")
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return tokenizer(text, return_tensors="pt").input_ids


# ------------------------------------------------------------------------------------------ methods
@dataclass(frozen=True)
class Method:
    """A decoding method under test.

    Attributes:
        name: its label in tables: ``hf``, ``hf_pld``, ``baseline`` or ``medusa:<tree>``.
        kind: one of ``METHOD_KINDS``.
        choices: the Medusa tree's paths (kind ``medusa`` only).
    """

    name: str
    kind: str
    choices: tuple[tuple[int, ...], ...] = ()

    @property
    def tree_nodes(self) -> int:
        """N, tokens verified per step (root included); 1 for every non-Medusa method."""
        return len(self.choices) + 1


def build_methods(model: Any, methods: Sequence[str], trees: Sequence[str]) -> list[Method]:
    """Methods from names: ``hf``, ``hf_pld``, ``baseline``, ``medusa`` (one per tree in ``trees``)
    or ``medusa:<tree>``. Raises ``ValueError`` for an unknown method or a tree the model cannot run."""
    out: list[Method] = []
    for name in methods:
        if name in ("hf", "hf_pld", "baseline"):
            out.append(Method(name, name))
        elif name == "medusa" or name.startswith("medusa:"):
            for tree in trees if name == "medusa" else [name.split(":", 1)[1]]:
                tree_name, choices = model.resolve_tree(tree)
                out.append(Method(f"medusa:{tree_name}", "medusa", tuple(map(tuple, choices))))
        else:
            raise ValueError(f"unknown method {name!r}: use {', '.join(METHOD_KINDS)} or medusa:<tree>")
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ValueError(f"methods listed twice: {names}")
    return out


def default_trees(model: Any) -> list[str]:
    """The model's own trees (calibrated, tuned) when it has any, else small presets that fit its heads."""
    if model.trees:
        return list(model.trees)
    names = [t for t in DEFAULT_TREES if t in model.tree_names()]
    if model.device.type == "cuda" and "mc_sim_7b_63" in model.tree_names():
        names.append("mc_sim_7b_63")
    return names or [f"chain_{model.num_heads}"]


# ------------------------------------------------------------------------------------------- a run
@dataclass(frozen=True)
class Run:
    """One generation of one prompt by one method. Times are wall-clock seconds.

    Attributes:
        method, prompt (index in the prompt set), category, repeat: what was run.
        tokens: new tokens produced.
        steps: decoding steps (backbone forward passes) that produced them. For HF methods the
            prefill pass counts, since it yields the first token; for this project's loop the prefill's
            token is emitted by step 0, so steps = records.
        wall_s: the whole call, prefill included.
        ttft_s: until the first new token is in the caller's hands.
        step_time_s: time of the ``timed_steps`` decoding steps, prefill excluded.
        timed_steps: steps that ``step_time_s`` covers.
        tree_nodes: N verified per Medusa step (1 for other methods).
        output: the new token ids (compared with the reference method's when greedy).
        sampling: the rule the tokens were chosen by: ``StepRecord.sampling`` for this project's loop
            (greedy, sample, typical, exact); greedy or sample for HF methods.
        cpu_s: CPU time this process used during the call (all threads); well below
            ``wall_s × threads`` when other processes took the cores.
    """

    method: str
    prompt: int
    category: str
    repeat: int
    tokens: int
    steps: int
    wall_s: float
    ttft_s: float
    step_time_s: float
    timed_steps: int
    tree_nodes: int = 1
    output: tuple[int, ...] = field(default=(), repr=False)
    cpu_s: float = 0.0
    sampling: str = "greedy"


class _HFClock:
    """A streamer for HF ``generate`` that timestamps the first new token (the first ``put`` is the
    prompt) and a forward pre-hook that counts backbone passes; remove with ``close``."""

    def __init__(self, backbone: torch.nn.Module, device: torch.device):
        self.device = device
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.forwards = 0
        self._puts = 0
        self._hook = backbone.register_forward_pre_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.forwards += 1

    def put(self, value: torch.Tensor) -> None:  # called by generate; value is already on the host
        self._puts += 1
        if self._puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass

    def close(self) -> None:
        self._hook.remove()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # wall-clock timing must wait for queued kernels


def run_once(
    model: Any, method: Method, input_ids: torch.Tensor, *, max_new_tokens: int, pld_tokens: int = 10,
    prompt: int = 0, category: str = "", repeat: int = 0, temperature: float = 0.0, sampling: str = "typical",
) -> Run:
    """Generate one reply to ``input_ids`` [1, T] with ``method`` and time it: greedy at temperature 0,
    else sampled (Medusa verifies by ``sampling``, see ``MedusaModel.generate``) with seed
    ``1000 * repeat + prompt``."""
    input_ids = input_ids.to(model.device)
    prompt_len = input_ids.shape[1]
    seed = 1000 * repeat + prompt
    meta = dict(method=method.name, prompt=prompt, category=category, repeat=repeat, tree_nodes=method.tree_nodes)
    if method.kind in ("hf", "hf_pld"):
        eos = sorted(model.eos_token_ids)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos or None,  # the same stopping rule as the engine's
            pad_token_id=eos[0] if eos else getattr(model.tokenizer, "pad_token_id", None) or 0,
            attention_mask=torch.ones_like(input_ids),
        )
        if method.kind == "hf_pld":
            kwargs["prompt_lookup_num_tokens"] = pld_tokens
        if temperature > 0:  # plain softmax sampling, as the engine does: no top-k
            kwargs.update(do_sample=True, temperature=temperature, top_k=0)
            torch.manual_seed(seed)  # HF samples from the global generator
        _sync(model.device)
        cpu0 = time.process_time()
        clock = _HFClock(model.backbone, model.device)
        try:
            with torch.inference_mode():
                out = model.backbone.generate(input_ids, streamer=clock, **kwargs)
            _sync(model.device)
            end = time.perf_counter()
        finally:
            clock.close()
        output = tuple(out[0, prompt_len:].tolist())
        ttft = (clock.first_token_at or end) - clock.start
        return Run(
            **meta, tokens=len(output), steps=clock.forwards, wall_s=end - clock.start, ttft_s=ttft,
            step_time_s=end - clock.start - ttft, timed_steps=max(clock.forwards - 1, 0), output=output,
            cpu_s=time.process_time() - cpu0, sampling="sample" if temperature > 0 else "greedy",
        )
    if method.kind not in ("baseline", "medusa"):
        raise ValueError(f"unknown method kind {method.kind!r}")
    _sync(model.device)
    cpu0 = time.process_time()
    start = time.perf_counter()
    records = []
    first_at = None
    for record in model.generate(
        input_ids, max_new_tokens=max_new_tokens, medusa=method.kind == "medusa",
        tree=[list(p) for p in method.choices] if method.kind == "medusa" else None,
        temperature=temperature, sampling=sampling, seed=seed,
    ):
        first_at = first_at or time.perf_counter()
        records.append(record)
    end = time.perf_counter()
    output = tuple(t for r in records for t in r.token_ids)
    return Run(
        **meta, tokens=len(output), steps=len(records), wall_s=end - start, ttft_s=(first_at or end) - start,
        step_time_s=sum(r.latency_s for r in records) - records[0].prefill_s, timed_steps=len(records),
        output=output, cpu_s=time.process_time() - cpu0, sampling=records[0].sampling,
    )


def run_benchmark(
    model: Any,
    prompts: Sequence[Prompt],
    methods: Sequence[Method],
    *,
    max_new_tokens: int = 128,
    repeats: int = 3,
    pld_tokens: int = 10,
    warmup_tokens: int = 16,
    system: str | None = None,
    progress: bool = True,
    temperature: float = 0.0,
    sampling: str = "typical",
) -> tuple[list[Run], list[str]]:
    """Run every method on every prompt ``repeats`` times, interleaved prompt by prompt.

    Prompts that do not leave room for ``max_new_tokens`` in the context window are skipped.
    Returns (runs, notes): notes name each skipped prompt.
    """
    from tqdm.auto import tqdm

    encoded, notes = [], []
    for i, p in enumerate(prompts):
        ids = encode_prompt(model.tokenizer, p.text, system)
        if ids.shape[1] + max_new_tokens > model.max_context:
            notes.append(f"prompt {i} skipped: {ids.shape[1]} tokens + {max_new_tokens} new > context {model.max_context}")
            continue
        encoded.append((i, p, ids))
    if not encoded:
        raise ValueError("no prompt fits the context window: lower --max-new-tokens")
    for m in methods:  # warm-up: allocator, kernels, tree buffers
        run_once(model, m, encoded[0][2], max_new_tokens=min(warmup_tokens, max_new_tokens), pld_tokens=pld_tokens,
                 temperature=temperature, sampling=sampling)
    runs: list[Run] = []
    bar = tqdm(total=repeats * len(encoded) * len(methods), desc="bench", unit="run", disable=not progress)
    for r in range(repeats):
        for j, (i, p, ids) in enumerate(encoded):
            k = (j + r) % len(methods)
            for m in list(methods[k:]) + list(methods[:k]):
                bar.set_postfix_str(m.name, refresh=False)
                runs.append(run_once(
                    model, m, ids, max_new_tokens=max_new_tokens, pld_tokens=pld_tokens,
                    prompt=i, category=p.category, repeat=r, temperature=temperature, sampling=sampling,
                ))
                bar.update()
    bar.close()
    return runs, notes


# --------------------------------------------------------------------------------------- accounting
@dataclass(frozen=True)
class Summary:
    """One method on one category (or ``all``), pooled over its prompts.

    Attributes:
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
    """

    method: str
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


@dataclass(frozen=True)
class Divergence:
    """The first token where a method's output differs from the reference's on one prompt.

    ``expected`` / ``got`` are None where that output had already ended. ``repeats`` counts the
    repeats that diverged.
    """

    method: str
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
    """Every (method, prompt) whose output differs from the reference's output on the same prompt
    and repeat (or its first repeat), with the first differing position. Greedy runs only: sampled
    replies are not meant to be equal."""
    runs = [r for r in runs if r.sampling == "greedy"]
    ref = {}
    for r in runs:
        if r.method == reference:
            ref.setdefault((r.prompt, r.repeat), r.output)
            ref.setdefault((r.prompt, None), r.output)
    found: dict[tuple[str, int], Divergence] = {}
    for r in runs:
        if r.method == reference:
            continue
        expected = ref.get((r.prompt, r.repeat), ref.get((r.prompt, None)))
        if expected is None:
            continue
        pos = first_difference(expected, r.output)
        if pos is None:
            continue
        key = (r.method, r.prompt)
        if key in found:
            found[key] = Divergence(**{**asdict(found[key]), "repeats": found[key].repeats + 1})
        else:
            at = lambda seq: seq[pos] if pos < len(seq) else None  # noqa: E731
            found[key] = Divergence(r.method, r.prompt, r.category, pos, at(expected), at(r.output), 1)
    return list(found.values())


def summarise(runs: Sequence[Run], *, reference: str = REFERENCE, baseline: str = BASELINE) -> list[Summary]:
    """Per method × (each category, then ``all``) summaries of ``runs``; pure arithmetic.

    Methods keep their first-seen order; categories are sorted with ``all`` last.
    """
    methods = list(dict.fromkeys(r.method for r in runs))
    categories = sorted({r.category for r in runs}) + [ALL]
    diverged = {(d.method, d.prompt) for d in find_divergences(runs, reference)}
    ref_prompts = {r.prompt for r in runs if r.method == reference and r.sampling == "greedy"}

    def pooled(method: str, category: str) -> list[Run]:
        return [r for r in runs if r.method == method and category in (ALL, r.category)]

    def step_ms(group: list[Run]) -> float:
        return 1e3 * _ratio(sum(r.step_time_s for r in group), sum(r.timed_steps for r in group))

    def tok_s_by_repeat(group: list[Run]) -> list[float]:
        repeats = sorted({r.repeat for r in group})
        return [
            _ratio(sum(r.tokens for r in group if r.repeat == k), sum(r.wall_s for r in group if r.repeat == k))
            for k in repeats
        ]

    out = []
    for category in categories:
        ref_group, base_group = pooled(reference, category), pooled(baseline, category)
        ref_tok_s = statistics.median(tok_s_by_repeat(ref_group)) if ref_group else math.nan
        base_step = step_ms(base_group) if base_group else math.nan
        for method in methods:
            group = pooled(method, category)
            if not group:
                continue
            rates = tok_s_by_repeat(group)
            prompts = {r.prompt for r in group}
            compared = prompts & ref_prompts if method != reference else set()
            out.append(Summary(
                method=method,
                category=category,
                tree_nodes=group[0].tree_nodes,
                prompts=len(prompts),
                runs=len(group),
                tokens=sum(r.tokens for r in group),
                tok_s=statistics.median(rates),
                tok_s_min=min(rates),
                tok_s_max=max(rates),
                acceleration=_ratio(sum(r.tokens for r in group), sum(r.steps for r in group)),
                step_ms=step_ms(group),
                overhead=_ratio(step_ms(group), base_step),
                speedup=_ratio(statistics.median(rates), ref_tok_s),
                ttft_ms=1e3 * statistics.median(r.ttft_s for r in group),
                identical=sum(1 for p in compared if (method, p) not in diverged),
                compared=len(compared),
                cpu_per_wall=_ratio(sum(r.cpu_s for r in group), sum(r.wall_s for r in group)),
            ))
    return out


# ------------------------------------------------------------------------------------- the tuner
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


def measure_step_latency(
    model: Any, prompt_ids: Sequence[torch.Tensor], trees: Mapping[int, Sequence[Sequence[int]]],
    *, max_new_tokens: int = 64, progress: bool = True,
) -> tuple[dict[int, float], dict[int, float]]:
    """Step latency (s) and acceleration rate of every tree size, through the real decode loop.

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
        return list(model.generate(ids, max_new_tokens=limit, **kwargs))

    for n in sizes:
        go(n, prompt_ids[0], 8)  # warm-up and tree buffers
    bar = tqdm(total=len(prompt_ids) * len(sizes), desc="step latency", unit="run", disable=not progress)
    for j, ids in enumerate(prompt_ids):
        k = j % len(sizes)
        for n in sizes[k:] + sizes[:k]:
            records = go(n, ids, max_new_tokens)
            full = [r.latency_s - r.prefill_s for r in records if r.tree_nodes == len(trees[n]) + 1]
            if full:
                per_run[n].append(sum(full) / len(full))
            tokens[n] += sum(len(r.token_ids) for r in records)
            steps[n] += len(records)
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


# ------------------------------------------------------------------------------------------ reports
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
    """The main table: one row per method for ``category``."""
    rows = []
    for s in summaries:
        if s.category != category:
            continue
        same = "ref." if s.method == REFERENCE else "—" if s.compared == 0 else f"{s.identical}/{s.compared}"
        rows.append([
            s.method, s.tree_nodes, f"{s.tok_s:.1f} ({s.tok_s_min:.1f}–{s.tok_s_max:.1f})", _fmt(s.acceleration),
            _fmt(s.step_ms), _fmt(s.overhead), _fmt(s.speedup) + "×", _fmt(s.ttft_ms, 1), same,
            _fmt(s.cpu_per_wall),
        ])
    header = ["method", "tree tokens", "tokens/s median (min–max)", "accel. rate", "step ms", "overhead",
              "speedup vs HF", "TTFT ms", "identical to HF", "CPU/wall"]
    return markdown_table(rows, header)


def category_matrix(summaries: Sequence[Summary], attr: str, digits: int = 2) -> str:
    """Categories × methods table of one Summary attribute."""
    methods = list(dict.fromkeys(s.method for s in summaries))
    categories = list(dict.fromkeys(s.category for s in summaries))
    by = {(s.category, s.method): getattr(s, attr) for s in summaries}
    rows = [[c] + [_fmt(by.get((c, m), math.nan), digits) for m in methods] for c in categories]
    return markdown_table(rows, ["category"] + methods)


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

    rows = sorted((s for s in summaries if s.category == ALL and s.method.startswith("medusa:")), key=lambda s: s.tree_nodes)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    x = [s.tree_nodes for s in rows]
    fig.add_trace(go.Scatter(x=x, y=[s.speedup for s in rows], mode="lines+markers+text", name="speedup vs HF",
                             text=[s.method.split(":", 1)[1] for s in rows], textposition="top center"))
    fig.add_trace(go.Scatter(x=x, y=[s.acceleration for s in rows], mode="lines+markers", name="acceleration rate",
                             line=dict(dash="dot")), secondary_y=True)
    for s in summaries:
        if s.category == ALL and not s.method.startswith("medusa:") and not math.isnan(s.speedup):
            fig.add_hline(y=s.speedup, line_dash="dash", annotation_text=s.method, annotation_position="bottom right")
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
        "speedup: tokens/s ÷ HF `generate`'s; TTFT: time to the first new token; CPU/wall: this process's CPU "
        "time ÷ wall time (about the thread count on a quiet machine; lower means other processes took the cores).", "",
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
        md += [f"{len(divergences)} (method, prompt) pairs diverge:", "", markdown_table(
            [[d.method, d.prompt, d.category, d.position, d.expected, d.got, d.repeats] for d in divergences],
            ["method", "prompt", "category", "first diverging token", "HF token", "method token", "repeats"],
        )]
    else:
        compared = sum(s.compared for s in summaries if s.category == ALL)
        md.append(f"No divergence: all {compared} (method, prompt) outputs are identical to HF generate, token for token.")
    if notes:
        md += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    text = "\n".join(md) + "\n"
    (out / "summary.md").write_text(text, encoding="utf-8")
    paths.append(out / "summary.md")
    if any(s.method.startswith("medusa:") for s in summaries):
        paths += write_figure(speedup_figure(summaries, f"Medusa speedup per tree size — {env.get('model')}, "
                                             f"{env.get('device_name')}, {env.get('quantization')}"), out / "speedup_by_tree")
    return text, paths


# --------------------------------------------------------------------------------------------- CLI
def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="'demo', a Medusa checkpoint folder or a Hub id (default: demo)")
    p.add_argument("--base-model", default=None, help="backbone to use instead of the checkpoint's")
    p.add_argument("--quantization", default="nf4", choices=["nf4", "int8", "none"], help="backbone precision (default nf4)")
    p.add_argument("--dtype", default=None, help="compute dtype (default float32 on CPU, float16 on CUDA)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (default auto)")
    p.add_argument("--prompts", default=None, help="JSONL with 'prompt' and optional 'category' (default: shipped set)")
    p.add_argument("--limit", type=int, default=None, help="use N prompts spread over the set")
    p.add_argument("--system", default=None, help="system message put before every prompt (default: none)")
    p.add_argument("--out", type=Path, default=None, help="output folder")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser(command: str) -> argparse.ArgumentParser:
    """The argument parser of ``run`` (default), ``tune`` or ``profile``."""
    prog = "python -m medusa_core.bench" + ("" if command == "run" else f" {command}")
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0] if command == "run" else None)
    _model_args(p)
    if command == "run":
        p.add_argument("--methods", type=_csv_list, default=list(METHOD_KINDS),
                       help="comma list of hf, hf_pld, baseline, medusa, medusa:<tree> (default: all)")
        p.add_argument("--trees", type=_csv_list, default=None,
                       help="trees for 'medusa' (default: the model's own trees, else chain_4,sparse_8,sparse_16,sparse_32)")
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens of hf_pld (default 10)")
        p.add_argument("--temperature", type=float, default=0.0,
                       help="0: greedy, outputs compared with HF generate; > 0: every method samples (default 0)")
        p.add_argument("--sampling", default="typical", choices=list(SAMPLING_MODES),
                       help="Medusa's verification at temperature > 0: typical acceptance or exact rejection sampling (default typical)")
    elif command == "tune":
        p.add_argument("--sizes", type=lambda s: [int(x) for x in _csv_list(s)], default=list(TUNE_SIZES),
                       help=f"tree sizes in paths (default {','.join(map(str, TUNE_SIZES))})")
        p.add_argument("--latency-prompts", type=int, default=6, help="prompts used to time each size (default 6)")
        p.add_argument("--latency-tokens", type=int, default=64, help="new tokens per timing run (default 64)")
        p.add_argument("--confirm-top", type=int, default=3, help="predicted-best sizes confirmed by a benchmark (default 3)")
        p.add_argument("--confirm-prompts", type=int, default=16, help="prompts of the confirming benchmark (default 16)")
        p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per confirming run (default 128)")
        p.add_argument("--repeats", type=int, default=2, help="repeats of the confirming benchmark (default 2)")
        p.add_argument("--tolerance", type=float, default=0.02,
                       help="prefer a smaller tree whose predicted speedup is within this fraction of the best, and "
                            "keep the predicted pick unless a confirmed size ran more than this fraction faster (default 0.02)")
        p.add_argument("--rank-accuracy", type=Path, default=None,
                       help="JSON file with 'rank_accuracy' [K][ranks] (default: the model's medusa_calibration.json)")
        p.add_argument("--tuned-file", type=Path, default=None,
                       help="where to merge the result (default: medusa_tuned.json next to the model)")
        p.add_argument("--dry-run", action="store_true", help="do not write the tuned-tree file")
    elif command == "profile":
        p.add_argument("--tree", default=None, help="tree to profile (default: the model's default tree)")
        p.add_argument("--max-new-tokens", type=int, default=64)
        p.add_argument("--runs", type=int, default=3, help="generations profiled (default 3)")
    return p


def _load(args: argparse.Namespace) -> Any:
    from .loading import load_medusa_model

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_medusa_model(args.model, base_model=args.base_model, quantization=args.quantization,
                             dtype=args.dtype, device=args.device)


def cmd_run(args: argparse.Namespace, command: str) -> int:
    """The benchmark: print the table, write CSV, markdown and the chart."""
    model = _load(args)
    prompts = load_prompts(args.prompts, args.limit)
    methods = build_methods(model, args.methods, args.trees or default_trees(model))
    out = args.out or Path("out") / "bench"
    runs, notes = run_benchmark(model, prompts, methods, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                                pld_tokens=args.pld_tokens, system=args.system, progress=not args.no_progress,
                                temperature=args.temperature, sampling=args.sampling)
    settings = {"prompts": len({r.prompt for r in runs}), "max_new_tokens": args.max_new_tokens,
                "repeats": args.repeats, "pld_tokens": args.pld_tokens, "system": args.system or "none",
                "temperature": args.temperature, "sampling": args.sampling if args.temperature > 0 else "greedy"}
    text, paths = write_report(out, runs, command=command, env=environment(model), settings=settings, notes=notes)
    print(text)
    print("wrote " + ", ".join(map(str, paths)))
    return 0


def _model_folder(name_or_path: str) -> Path:
    from .loading import _local_folder  # the same resolution the loader uses ("demo", folder, Hub id)

    return _local_folder(name_or_path)


def cmd_tune(args: argparse.Namespace, command: str) -> int:
    """Measure step latency per tree size, predict, confirm the best sizes, write ``medusa_tuned.json``."""
    from .loading import TUNED_FILE, tuned_key
    from .trees import optimal_tree

    model = _load(args)
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
    timing_ids = [encode_prompt(model.tokenizer, p.text, args.system) for p in load_prompts(args.prompts, args.latency_prompts)]
    latency, accel = measure_step_latency(model, timing_ids, trees, max_new_tokens=args.latency_tokens,
                                          progress=not args.no_progress)
    fitted = monotone_latency(latency)
    predicted = predict_speedups(expected, fitted)
    pick = choose_tree_size({n: s for n, s in predicted.items() if n}, args.tolerance)
    ranked = sorted((n for n in predicted if n), key=lambda n: (n != pick, -predicted[n]))[: max(args.confirm_top, 1)]

    confirm_prompts = load_prompts(args.prompts, args.limit or args.confirm_prompts)
    methods = [Method("hf", "hf"), Method("baseline", "baseline")] + [
        Method(f"medusa:optimal_{n}", "medusa", tuple(map(tuple, trees[n]))) for n in ranked
    ]
    runs, notes = run_benchmark(model, confirm_prompts, methods, max_new_tokens=args.max_new_tokens,
                                repeats=args.repeats, system=args.system, progress=not args.no_progress)
    overall = {s.method: s for s in summarise(runs) if s.category == ALL}
    base_tok_s = overall["baseline"].tok_s
    measured = {n: overall[f"medusa:optimal_{n}"] for n in ranked}
    best = confirm_choice(pick, {n: measured[n].tok_s for n in ranked}, args.tolerance)
    if measured[best].tok_s < base_tok_s:
        notes.append(f"no tree beat plain decoding here: the best, {best} paths, ran at "
                     f"{_ratio(measured[best].tok_s, base_tok_s):.2f}× the plain loop's tokens/s")
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
        "# Tree tuning", "", f"`{command}`", "", ", ".join(f"{k}: {v}" for k, v in env.items()), "", table, "",
        "predicted speedup = expected accel. (from the calibrated rank accuracies, paper 2.3.3) ÷ step cost "
        "(fitted step latency ÷ plain step latency); step speedup in timing runs = the acceleration the timing runs "
        "reached ÷ step cost; measured = tokens/s ÷ the plain loop's tokens/s "
        f"(and ÷ HF generate's) in a confirming benchmark of {len({r.prompt for r in runs})} prompts × "
        f"{args.max_new_tokens} tokens.", "",
    ] + [f"- {n}" for n in notes])
    print(text)
    out = args.out or Path("out") / "tune"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.md").write_text(text, encoding="utf-8")
    with (out / "tune.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["paths", "tree_tokens", "expected_acceleration", "timing_acceleration", "step_ms", "step_ms_fitted",
                    "predicted_speedup", "measured_speedup_vs_baseline", "measured_speedup_vs_hf"])
        for n in sorted(predicted):
            m = measured.get(n)
            w.writerow([n, n + 1, 1 + expected[n], accel.get(n), 1e3 * latency[n], 1e3 * fitted[n], predicted[n],
                        _ratio(m.tok_s, base_tok_s) if m else "", m.speedup if m else ""])
    write_csv(out / "runs.csv", runs, exclude=("output",))
    paths = write_figure(_tune_figure(predicted, measured, base_tok_s, env), out / "tune")

    m = measured[best]
    entry = {
        "choices": trees[best],
        "nodes": best + 1,
        "predicted_speedup": round(predicted[best], 4),
        "measured_speedup": round(_ratio(m.tok_s, base_tok_s), 4),
        "measured_speedup_vs_hf": round(m.speedup, 4),
        "predicted_acceleration": round(1 + expected[best], 4),
        "measured_acceleration": round(m.acceleration, 4),
        "measured_overhead": round(m.overhead, 4),
        "identical_to_hf": f"{m.identical}/{m.compared}",
        "step_latency_ms": {str(n): round(1e3 * v, 4) for n, v in sorted(latency.items())},
        "step_latency_fitted_ms": {str(n): round(1e3 * v, 4) for n, v in sorted(fitted.items())},
        "predicted_best_paths": pick,
        "device_name": env["device_name"],
        "dtype": env["dtype"],
        "torch_threads": env["torch_threads"],
        "tuned_at": env["date"],
        "command": command,
    }
    key = tuned_key(model.device, model.quantization)
    target = args.tuned_file or _model_folder(args.model) / TUNED_FILE
    if args.dry_run:
        print(f"--dry-run: not writing {target} [{key}]")
    else:
        write_tuned(target, key, entry)
        print(f"wrote tree 'tuned' ({best} paths, {best + 1} tree tokens) to {target} [{key}]")
    print("wrote " + ", ".join(map(str, [out / "tune.md", out / "tune.csv", out / "runs.csv", *paths])))
    return 0


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


def cmd_profile(args: argparse.Namespace, command: str) -> int:
    """Profile Medusa generation: Python time per engine function (cProfile) and per torch op."""
    from torch.profiler import ProfilerActivity, profile

    model = _load(args)
    prompts = load_prompts(args.prompts, args.limit or args.runs)[: args.runs]
    ids = [encode_prompt(model.tokenizer, p.text, args.system) for p in prompts]
    tree = args.tree or model.default_tree

    def generate_all() -> tuple[int, int]:
        steps = tokens = 0
        for x in ids:
            for rec in model.generate(x, max_new_tokens=args.max_new_tokens, tree=tree):
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
        if file.endswith(("medusa_core/model.py", "medusa_core/acceptance.py", "medusa_core/heads.py")):
            stages.append([f"{Path(file).name}:{func}", calls, _fmt(1e3 * cumtime / steps, 3), _fmt(1e3 * tottime / steps, 3)])
    stages.sort(key=lambda r: -float(r[2]))
    lines = [f"# Profile of {tree} on {model.name}", "", f"`{command}`", "",
             f"{steps} steps, {tokens} tokens, {elapsed:.2f} s under cProfile: {1e3 * elapsed / steps:.2f} ms/step, "
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
    text = "\n".join(lines) + "\n"
    (out / "profile.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out / 'profile.md'}, {out / 'cprofile.txt'}, {out / 'torch_ops.txt'}, {out / 'trace.json'}")
    return 0


COMMANDS = {"run": cmd_run, "tune": cmd_tune, "profile": cmd_profile}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m medusa_core.bench [tune|profile] ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "run"
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    line = "python -m medusa_core.bench " + shlex.join(([command] if command != "run" else []) + argv)
    return COMMANDS[command](args, line.strip())


if __name__ == "__main__":
    sys.exit(main())
