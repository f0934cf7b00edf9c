"""Speed, measured: the benchmark program and the hardware-aware tree tuner (paper appendix B.1, 2.3.3).

    python -m medusa_core.bench [options]           # Medusa vs HF generate, HF prompt lookup, plain loop
    python -m medusa_core.bench --temperature 0.7 --sampling exact   # the same, sampled (typical or exact)
    python -m medusa_core.bench tune [options]      # pick the tree size and shaping threshold τ for this device/precision
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
is a statistical property, tested in ``tests/sampling/test_sampling_statistics.py``).

One module per job, in the order a run uses them:

- ``prompts``: the JSONL prompt set and its chat-template encoding.
- ``methods``: the methods under test (``hf``, ``hf_pld``, ``baseline``, ``medusa:<tree>``, ``ngram``, ``medusa+ngram:<tree>``).
- ``run``: one timed generation (``run_once``) and the interleaved benchmark (``run_benchmark``).
- ``accounting``: ``summarise`` and ``find_divergences``, pure arithmetic on ``Run`` records.
- ``report``: markdown, CSV and charts.
- ``tune``: the tree tuner (pure prediction, latency measurement, ``medusa_tuned.json``).
- ``profiling``: cProfile and torch.profiler of a Medusa step.
- ``cli``: ``python -m medusa_core.bench [run|tune|profile]`` (``--help`` lists the flags).
"""

from .accounting import (
    ALL,
    BASELINE,
    REFERENCE,
    Divergence,
    Summary,
    find_divergences,
    first_difference,
    summarise,
)
from .cli import build_parser, main
from .methods import DEFAULT_TREES, METHOD_KINDS, Method, build_methods, default_trees
from .prompts import Prompt, encode_prompt, load_prompts
from .report import environment, markdown_table, summary_markdown, write_report
from .run import LOOP_NGRAM, LOOP_TIMES, Run, loops, run_benchmark, run_once
from .tune import dump_tuned, measure_step_latency, write_tuned
from .tune_rules import (
    TUNE_SIZES,
    choose_min_head_probability,
    choose_tree_size,
    confirm_choice,
    marginal_token_cost,
    monotone_latency,
    predict_speedups,
    tuned_threshold,
)

__all__ = [
    "ALL",
    "BASELINE",
    "DEFAULT_TREES",
    "LOOP_NGRAM",
    "LOOP_TIMES",
    "METHOD_KINDS",
    "REFERENCE",
    "TUNE_SIZES",
    "Divergence",
    "Method",
    "Prompt",
    "Run",
    "Summary",
    "build_methods",
    "build_parser",
    "choose_min_head_probability",
    "choose_tree_size",
    "confirm_choice",
    "default_trees",
    "dump_tuned",
    "encode_prompt",
    "environment",
    "find_divergences",
    "first_difference",
    "load_prompts",
    "loops",
    "main",
    "marginal_token_cost",
    "markdown_table",
    "measure_step_latency",
    "monotone_latency",
    "predict_speedups",
    "run_benchmark",
    "run_once",
    "summarise",
    "summary_markdown",
    "tuned_threshold",
    "write_report",
    "write_tuned",
]
