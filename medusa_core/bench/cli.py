"""The command line: ``python -m medusa_core.bench [run|tune|profile|agreement] ...`` (``--help`` lists the flags)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from ..cpu import physical_cores
from ..drafts import DraftConfig
from ..generation import SAMPLING_MODES
from ..processors import CHAT_SAMPLING, SamplingConfig
from ..tuned import TUNED_PRESETS
from .agreement import cmd_agreement
from .methods import DRAFT_METHODS, METHOD_KINDS, build_methods, default_trees
from .profiling import cmd_profile
from .prompts import load_prompts
from .report import environment, write_report
from .run import run_benchmark
from .tune import cmd_tune, preset_settings
from .tune_rules import TUNE_SIZES
from .tune_chain import CHAIN_VALUES, parse_chains

DESCRIPTION = "Speed, measured: the benchmark program and the hardware-aware tree tuner (paper appendix B.1, 2.3.3)."


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="'demo', a Medusa checkpoint folder or a Hub id (default: demo)")
    p.add_argument("--base-model", default=None, help="backbone to use instead of the checkpoint's")
    p.add_argument("--quantization", default="auto", choices=["auto", "gguf", "nf4", "int8", "none"],
                   help="backbone precision (default auto: a GGUF file's own 4-bit blocks on a CPU, else nf4)")
    p.add_argument("--dtype", default=None, help="compute dtype (default float32 on CPU, float16 on CUDA)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (default auto)")
    p.add_argument("--drafter", type=Path, default=None,
                   help="an EAGLE-style drafter file for the 'eagle' method (MedusaModel.load_drafter; CPU only), e.g. "
                        "assets/eagle-probe/drafter.safetensors")
    p.add_argument("--prompts", default=None,
                   help="JSONL rows with 'prompt' (one user message) or 'messages' (a conversation ending with a user "
                        "turn; only the last reply is timed) and an optional 'category' (default: the shipped set)")
    p.add_argument("--limit", type=int, default=None, help="use N prompts spread over the set")
    p.add_argument("--categories", type=_csv_list, default=None,
                   help="comma list: only prompts of these categories (before --limit; default: all)")
    p.add_argument("--system", default=None, help="system message put before every prompt (default: none)")
    p.add_argument("--out", type=Path, default=None, help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _presets(text: str) -> list[str]:
    presets = _csv_list(text)
    unknown = [p for p in presets if p not in TUNED_PRESETS]
    if unknown or not presets:
        raise argparse.ArgumentTypeError(f"{text!r}: presets are a comma list of {', '.join(TUNED_PRESETS)}")
    return presets


def _preset_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--preset", default="greedy", choices=["greedy", "chat"],
                   help=what + "greedy, or the app's chat defaults (the model's generation config, else "
                               "medusa_core.CHAT_PRESET, with its verification mode) (default greedy)")


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive count")
    return n


def build_parser(command: str) -> argparse.ArgumentParser:
    """The argument parser of ``run`` (default), ``tune``, ``profile`` or ``agreement``."""
    prog = "python -m medusa_core.bench" + ("" if command == "run" else f" {command}")
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION if command == "run" else None)
    _model_args(p)
    cores = physical_cores()
    if command == "run":
        p.add_argument("--threads", type=_positive_int, nargs="+", default=[cores], metavar="N",
                       help="torch CPU threads; several counts (e.g. --threads 1 2) give a row per method and count, "
                            f"interleaved prompt by prompt (default: {cores}, the physical cores this process may use)")
        p.add_argument("--methods", type=_csv_list, default=list(METHOD_KINDS + DRAFT_METHODS),
                       help="comma list of hf, hf_pld, llama_cpp, baseline, medusa, medusa:<tree>, ngram (this engine's n-gram "
                            "drafts alone), medusa+ngram, medusa+ngram:<tree> (the hybrid: heads and n-gram drafts in one tree), "
                            "medusa+corpus[:<tree>] (the heads, and chains from the model's corpus of its replies) "
                            "(default: hf, hf_pld, llama_cpp, baseline, medusa, ngram, medusa+ngram, medusa+corpus)")
        p.add_argument("--trees", type=_csv_list, default=None,
                       help="trees for 'medusa' (default: the model's own trees, else chain_4,sparse_8,sparse_16,sparse_32)")
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens of hf_pld (default 10)")
        _preset_arg(p, "sampling settings the flags below start from: ")
        p.add_argument("--temperature", type=float, default=None,
                       help="0: greedy, outputs compared with HF generate; > 0: every method samples (default: the preset's)")
        p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens, 0 = off (default: the preset's)")
        p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1], 1 = off (default: the preset's)")
        p.add_argument("--min-p", type=float, default=None, help="min-p in [0, 1], 0 = off (default: the preset's)")
        p.add_argument("--repetition-penalty", type=float, default=None,
                       help="HF repetition penalty > 0, 1 = off; HF methods get the same (default: the preset's)")
        defaults = DraftConfig()
        p.add_argument("--draft-tokens", type=int, default=defaults.max_tokens,
                       help=f"longest n-gram chain of ngram and medusa+ngram (default {defaults.max_tokens})")
        p.add_argument("--min-path-probability", type=float, default=defaults.min_path_probability,
                       help="cut an n-gram chain where this reply's chains were right less often than this up to that "
                            f"position (default {defaults.min_path_probability})")
        p.add_argument("--min-head-probability", type=float, default=defaults.min_head_probability,
                       help="shape the heads' tree of every medusa and medusa+ngram method per step: verify only nodes whose path probability (product of the "
                            "heads' calibrated probabilities) reaches this; 0 = the whole tree (default: the model's tuned threshold, "
                            "medusa_tuned.json's min_head_probability, 0 when untuned)")
        p.add_argument("--chain-only-from", type=int, default=defaults.chain_only_from,
                       help="medusa+ngram: a step whose n-gram chain has at least this many tokens verifies the chain alone, "
                            f"without the heads' tree; 0 = never (default {defaults.chain_only_from})")
        p.add_argument("--sampling", default=None, choices=list(SAMPLING_MODES),
                       help="Medusa's verification at temperature > 0: typical acceptance or exact rejection sampling "
                            f"(default: typical; with --preset chat, {CHAT_SAMPLING})")
    else:
        p.add_argument("--threads", type=_positive_int, default=cores, metavar="N",
                       help=f"torch CPU threads (default: {cores}, the physical cores this process may use)")
    if command == "tune":
        p.add_argument("--presets", type=_presets, default=list(TUNED_PRESETS),
                       help="settings to tune at, comma list of greedy and chat (the app's chat defaults with their verification "
                            "mode); each writes its own medusa_tuned.json entry, '<device>/<precision>@<preset>' (default: greedy,chat)")
        p.add_argument("--sizes", type=lambda s: [int(x) for x in _csv_list(s)], default=list(TUNE_SIZES),
                       help=f"tree sizes in paths (default {','.join(map(str, TUNE_SIZES))})")
        p.add_argument("--latency-prompts", type=int, default=6, help="prompts used to time each size (default 6)")
        p.add_argument("--latency-tokens", type=int, default=64, help="new tokens per timing run (default 64)")
        p.add_argument("--confirm-top", type=int, default=3, help="predicted-best sizes confirmed by a benchmark (default 3)")
        p.add_argument("--confirm-prompts", type=int, default=16, help="prompts of the confirming benchmark (default 16)")
        p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per confirming run (default 128)")
        p.add_argument("--repeats", type=int, default=2, help="repeats of the confirming benchmark and of the drafter's chains' timing, a seed each (default 2)")
        p.add_argument("--tolerance", type=float, default=0.02,
                       help="prefer a smaller tree whose predicted speedup is within this fraction of the best, and "
                            "keep the predicted pick unless a confirmed size ran more than this fraction faster (default 0.02)")
        p.add_argument("--rank-accuracy", type=Path, default=None,
                       help="JSON file with 'rank_accuracy' [K][ranks] (default: the model's medusa_calibration.json)")
        p.add_argument("--tuned-file", type=Path, default=None,
                       help="where to merge the result (default: medusa_tuned.json next to the model)")
        p.add_argument("--dry-run", action="store_true", help="do not write the tuned-tree file")
        p.add_argument("--chains", type=parse_chains, default=list(CHAIN_VALUES),
                       help="the drafter's chains to time, depth:threshold pairs (for a model with a drafter; default "
                            + ",".join(f"{d}:{t:g}" for d, t in CHAIN_VALUES) + ")")
        p.add_argument("--chains-only", action="store_true",
                       help="tune the drafter's chain alone, into the tuned entries the trees' tuning wrote")
        p.add_argument("--threshold-only", action="store_true",
                       help="measure nothing: derive τ (min_head_probability) from the figures this device and precision's "
                            "tuned entry of each preset already stores, and write it there")
    elif command == "agreement":
        p.set_defaults(quantization="none")
        p.add_argument("--candidates", type=_csv_list, default=["gguf", "nf4"],
                       help="precisions compared with --quantization's greedy replies (default gguf,nf4)")
        p.add_argument("--max-new-tokens", type=int, default=128)
    elif command == "profile":
        _preset_arg(p, "sampling settings of the split table's steps: ")
        p.add_argument("--tree", default=None, help="tree to profile (default: the model's default tree, tuned at --preset)")
        p.add_argument("--max-new-tokens", type=int, default=64)
        p.add_argument("--runs", type=int, default=3, help="generations profiled (default 3)")
        p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the split table (default 2)")
        p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                       help="time the split by wall clock or by the decoding thread's CPU time (loaded machines; use --threads 1)")
        p.add_argument("--split-only", action="store_true", help="only the split table (no cProfile, no torch.profiler)")
    return p


def load_model(args: argparse.Namespace) -> Any:
    """The model named by the model flags, after setting torch's CPU threads (the first of several)."""
    from ..loading import load_medusa_model

    torch.set_num_threads(args.threads[0] if isinstance(args.threads, list) else args.threads)
    model = load_medusa_model(args.model, base_model=args.base_model, quantization=args.quantization,
                              dtype=args.dtype, device=args.device)
    if getattr(args, "drafter", None) is not None:
        model.load_drafter(args.drafter)
    return model


def sampling_settings(model: Any, args: argparse.Namespace) -> tuple[SamplingConfig, str]:
    """(settings, Medusa verification mode) of a run: ``--preset``, overridden by the explicit flags.
    Raises ``ValueError`` (from ``SamplingConfig``) naming a value out of range."""
    base, mode = preset_settings(model, args.preset)
    flags = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                 repetition_penalty=args.repetition_penalty)
    config = dataclasses.replace(base, **{k: v for k, v in flags.items() if v is not None})
    return config, args.sampling or mode


def cmd_run(model: Any, args: argparse.Namespace, command: str) -> int:
    """The benchmark: print the table, write CSV, markdown and the chart."""
    prompts = load_prompts(args.prompts, args.limit, args.categories)
    config, sampling = sampling_settings(model, args)
    methods = build_methods(model, args.methods, args.trees or default_trees(model), config)
    drafts = DraftConfig(max_tokens=args.draft_tokens, min_path_probability=args.min_path_probability,
                         min_head_probability=args.min_head_probability, chain_only_from=args.chain_only_from)
    out = args.out or Path("out") / "bench"
    runs, notes = run_benchmark(model, prompts, methods, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                                pld_tokens=args.pld_tokens, system=args.system, progress=not args.no_progress,
                                config=config, sampling=sampling, threads=args.threads, draft_config=drafts)
    settings = {"prompts": len({r.prompt for r in runs}), "threads": ", ".join(map(str, dict.fromkeys(args.threads))),
                "max_new_tokens": args.max_new_tokens,
                "repeats": args.repeats, "pld_tokens": args.pld_tokens, "system": args.system or "none",
                "temperature": config.temperature, "sampling": "greedy" if config.greedy else sampling,
                "top_k": config.top_k, "top_p": config.top_p, "min_p": config.min_p,
                "repetition_penalty": config.repetition_penalty, "draft_tokens": drafts.max_tokens,
                "min_path_probability": drafts.min_path_probability, "min_head_probability": model.shaping_threshold(config) if drafts.min_head_probability is None else drafts.min_head_probability,
                "chain_only_from": drafts.chain_only_from}
    env = {k: v for k, v in environment(model).items() if k != "torch_threads"}  # "threads" in settings says it
    text, paths = write_report(out, runs, command=command, env=env, settings=settings, notes=notes)
    print(text)
    print("wrote " + ", ".join(map(str, paths)))
    return 0


COMMANDS = {"run": cmd_run, "tune": cmd_tune, "profile": cmd_profile, "agreement": cmd_agreement}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m medusa_core.bench [tune|profile] ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "run"
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    line = "python -m medusa_core.bench " + shlex.join(([command] if command != "run" else []) + argv)
    torch_threads = torch.get_num_threads()
    try:
        return COMMANDS[command](load_model(args), args, line.strip())
    finally:
        torch.set_num_threads(torch_threads)  # a caller in the same process keeps its own setting

