"""Medusa-1 head training, self-distillation and tree calibration (paper 2.2.1, 2.3.2, 2.3.3).

Command line (``python -m medusa_core.train --help``):

    # 1. the backbone's own greedy replies to seed prompts (JSONL chats/prompts or a .txt of prompts)
    python -m medusa_core.train distill --model BASE --prompts prompts.jsonl --out distilled.jsonl
    # 2. K heads on the frozen backbone, loss Σ_k 0.8^k · CE(head k, token t+k+2) over reply tokens; beside them
    #    the replies' tokens by frequency (draft_ranking.json: the heads draft among the most frequent, FR-Spec)
    python -m medusa_core.train heads --model BASE --data distilled.jsonl --out HEADS_DIR [--export vllm DIR]
    # 3. per-head rank accuracies on held-out replies, optimised trees for several node budgets,
    #    each tree's acceleration replayed on those replies (exact for greedy decoding) and each
    #    head's temperature (temperature scaling, Guo et al. 2017: calibrated tree shaping)
    python -m medusa_core.train calibrate --heads HEADS_DIR --data heldout.jsonl

The heads folder is a reference head-only checkpoint (``config.json`` + ``medusa_lm_head.safetensors``)
that ``load_medusa_model`` and text-generation-inference read; TensorRT-LLM reads it only for heads
with their own projections (not ``--share-lm-head``), vLLM only through ``--export vllm`` (README,
"Serving engines").
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from ..export import export_vllm
from ..heads import MedusaHeads
from ..loading import CALIBRATION_FILE, backbone_source, heads_from_state_dict, load_backbone, resolve_device
from .calibrate import accuracy_from_ranks, calibration, head_temperatures, target_ranks
from .distill import distill, read_distilled, read_prompts
from .heads import HeadTrainingConfig, train_heads
from .positions import TARGETS, collect_positions
from .ranking import rank_tokens, write_ranking


def _backbone_and_tokenizer(args):
    from transformers import AutoTokenizer

    device = resolve_device(args.device)
    source = backbone_source(args.model, args.trust_remote_code)  # a .gguf file: its config and tokenizer folder
    backbone = load_backbone(args.model, None if args.quantization == "none" else args.quantization, torch.float32, device,
                             args.trust_remote_code, batch_invariant=False)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    return backbone, tokenizer


def _load_heads_folder(folder: Path, backbone) -> MedusaHeads:
    from safetensors.torch import load_file

    return heads_from_state_dict(load_file(folder / "medusa_lm_head.safetensors"), backbone, source=str(folder))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m medusa_core.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--model", required=True, help="backbone: local folder, Hub id or .gguf file")
        sp.add_argument("--quantization", default="none", choices=["gguf", "nf4", "int8", "none"],
                        help="backbone precision (gguf: a .gguf file's own 4-bit blocks; QLoRA-style 4-bit: nf4)")
        sp.add_argument("--device", default="auto")
        sp.add_argument("--bf16", action="store_true", help="bfloat16 autocast for the backbone passes")
        sp.add_argument("--trust-remote-code", action="store_true")

    d = sub.add_parser("distill", help="self-distillation: the backbone's greedy replies to seed prompts")
    common(d)
    d.add_argument("--prompts", required=True, help=".jsonl (messages or prompt[/system]) or .txt (one per line)")
    d.add_argument("--out", required=True, help="output JSONL (resumable)")
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--limit", type=int, default=None, help="use only the first N prompts")

    h = sub.add_parser("heads", help="train Medusa-1 heads on a frozen backbone")
    common(h)
    h.add_argument("--data", required=True, help="distilled JSONL (from 'distill')")
    h.add_argument("--heldout", help="held-out distilled JSONL: report per-head top-1/top-5 and calibrate")
    h.add_argument("--out", required=True, help="heads folder (reference head-only layout)")
    h.add_argument("--base-name", help="base_model_name_or_path written to config.json (default: --model)")
    h.add_argument("--export", nargs=2, metavar=("FORMAT", "DIR"), help="also export, e.g. --export vllm DIR")
    h.add_argument("--no-resume", action="store_true")
    h.add_argument("--targets", choices=TARGETS, default="reply",
                   help="what head k learns at t: the reply's token t+k+2, or this backbone's own greedy token there "
                        "(when the replies came from other weights, e.g. heads for an NF4 backbone on bf16 replies)")
    for field, default in asdict(HeadTrainingConfig()).items():
        if isinstance(default, bool):
            if field != "bf16":  # --bf16 (common) covers the heads' autocast too
                h.add_argument(f"--{field.replace('_', '-')}", action="store_true")
        else:
            h.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)

    c = sub.add_parser("calibrate", help="rank accuracies on held-out replies and optimised trees (paper 2.3.3)")
    common(c)
    c.add_argument("--heads", required=True, help="heads folder")
    c.add_argument("--data", required=True, help="held-out distilled JSONL")
    c.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64])

    args = p.parse_args(argv)
    backbone, tokenizer = _backbone_and_tokenizer(args)
    if args.command == "distill":
        chats = read_prompts(args.prompts)[: args.limit]
        distill(backbone, tokenizer, chats, args.out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, bf16=args.bf16)
    elif args.command == "heads":
        cfg_fields = {f: getattr(args, f) for f in asdict(HeadTrainingConfig())}
        cfg = HeadTrainingConfig(**cfg_fields)
        replies = read_distilled(args.data)
        hidden, labels, roots = collect_positions(backbone, replies, cfg.num_heads, bf16=args.bf16, targets=args.targets,
                                                  with_roots=True)
        heads, stats = train_heads(backbone, hidden, labels, args.out, cfg, base_model_name_or_path=args.base_name or args.model,
                                   resume=not args.no_resume, roots=roots)
        write_ranking(args.out, rank_tokens(r["reply_ids"] for r in replies), f"{len(replies):,} replies of {args.data}")
        if args.heldout:
            hh, hl, hr = collect_positions(backbone, read_distilled(args.heldout), cfg.num_heads, bf16=args.bf16, with_roots=True)
            ranks = target_ranks(heads, hh, hl, roots=hr)
            record = calibration(accuracy_from_ranks(ranks), replayed=(ranks, hl), temperatures=head_temperatures(heads, hh, hl, roots=hr))
            (Path(args.out) / CALIBRATION_FILE).write_text(json.dumps(record, indent=1) + "\n")
            stats["heldout_top1"], stats["heldout_top5"] = record["top1"], record["top5"]
        print(json.dumps(stats, indent=1))
        if args.export:
            fmt, folder = args.export
            if fmt != "vllm":
                p.error(f"unknown export format {fmt!r}: only 'vllm'")
            export_vllm(heads, folder)
    elif args.command == "calibrate":
        heads = _load_heads_folder(Path(args.heads), backbone)
        hidden, labels, roots = collect_positions(backbone, read_distilled(args.data), heads.num_heads, bf16=args.bf16, with_roots=True)
        ranks = target_ranks(heads, hidden, labels, roots=roots)
        record = calibration(accuracy_from_ranks(ranks), args.budgets, replayed=(ranks, labels),
                             temperatures=head_temperatures(heads, hidden, labels, roots=roots))
        (Path(args.heads) / CALIBRATION_FILE).write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps({k: record[k] for k in ("top1", "top5", "expected_acceleration", "simulated_acceleration", "head_temperatures")}, indent=1))
