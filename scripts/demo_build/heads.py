"""Stages around the heads: training on the frozen served backbone's states (``heads``), their held-out measures and
calibration (``calibrate``, ``measure``), and the draft vocabulary's ranking (``ranking``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .common import (BASE_MODEL_ID, DISTILLED, SEED, TRAIN_SPLITS, asset_folder, heads_data, heads_folder,
                     load_served, log, positions, served_distilled, served_name)


def stage_heads(args) -> None:
    from safetensors.torch import load_file

    from medusa_core.train import HeadTrainingConfig, rank_accuracy, train_heads

    out = heads_folder(args)
    if (out / "train_stats.json").exists():
        return
    t0 = time.time()
    model = load_served(args)
    cfg = HeadTrainingConfig(num_heads=args.num_heads, num_layers=args.head_layers, share_lm_head=True,
                             vocab="data", epochs=args.head_epochs, batch_size=512, lr=args.head_lr,
                             warmup_steps=30, seed=SEED, checkpoint_every=50, soft_targets=args.soft_targets,
                             root_conditioned=args.root_conditioned)
    (train_files, train_targets), _ = heads_data(args)
    parts = [positions(model, file, name, cfg.num_heads, bf16=True, targets=train_targets) for file, name in train_files]
    hidden, labels, roots = (torch.cat(column) for column in zip(*parts))
    log(f"heads: {len(hidden)} training positions from {len(parts)} reply file(s) in {time.time() - t0:.0f} s")
    init = load_file(asset_folder(args) / "medusa_lm_head.safetensors") if args.warm_start else None  # the shipped heads
    heads, stats = train_heads(model, hidden, labels, out, cfg, base_model_name_or_path=BASE_MODEL_ID, roots=roots, init=init,
                               device=args.device)
    train_acc = rank_accuracy(heads, hidden[:50_000], labels[:50_000], roots=roots[:50_000] if cfg.root_conditioned else None)
    stats.update(backbone_quantization=args.quantization, targets=train_targets, heads_data=args.heads_data,
                 training_files=[name for _, name in train_files], device=args.device,
                 train_top1=[round(r[0], 4) for r in train_acc])
    evaluate_heads(args, model, heads, out, stats)
    stats["seconds_total"] = round(time.time() - t0)
    (out / "train_stats.json").write_text(json.dumps(stats, indent=2))
    log(f"heads: {json.dumps({k: v for k, v in stats.items() if k != 'config'})}")


def heldout_record(model, heads, held_file: Path, held_name: str, *, temperatures: bool = True) -> tuple[dict, int]:
    """``heads``' ranks on ``model``'s states of the replies in ``held_file`` (over the whole vocabulary): (the
    calibration record -- rank accuracies, optimised trees of 4-64 paths and each tree's acceleration replayed on those
    replies, paper 2.3.3, and with ``temperatures`` each head's fitted temperature --, the held-out positions counted)."""
    from medusa_core.train import accuracy_from_ranks, calibration, head_temperatures, target_ranks

    held_h, held_l, held_r = positions(model, held_file, held_name, heads.num_heads)  # the served backbone's replies, its states
    rooted = {"roots": held_r} if heads.root_conditioned else {}
    ranks = target_ranks(heads, held_h, held_l, **rooted)
    fitted = head_temperatures(heads, held_h, held_l, **rooted) if temperatures else None  # calibrated path probabilities shape the trees
    record = calibration(accuracy_from_ranks(ranks), budgets=(4, 8, 12, 16, 32, 64), default=16, replayed=(ranks, held_l),
                         temperatures=fitted)
    return record, len(held_h)


def evaluate_heads(args, model, heads, out: Path, stats: dict) -> None:
    """Held-out ranks of ``heads`` on ``model``'s states of the first ``--served-settings``' held-out replies,
    calibration and replayed acceleration into ``out``'s calibration file, the figures into ``stats``."""
    from medusa_core.loading import CALIBRATION_FILE

    _, (held_file, held_name) = heads_data(args)
    record, counted = heldout_record(model, heads, held_file, held_name)
    (out / CALIBRATION_FILE).write_text(json.dumps(record, indent=1) + "\n")
    stats.update(heldout_replies=held_file.name, heldout_positions=counted, heldout_backbone=f"{args.quantization} on {args.device}",
                 heldout_top1=record["top1"], heldout_top5=record["top5"],
                 expected_acceleration=record["expected_acceleration"], simulated_acceleration=record["simulated_acceleration"])


def trained_heads(args):
    """The trained heads folder of ``args`` (``heads_folder``): (folder, its ``train_stats.json``, this machine's served
    backbone, the heads as shipped: float16 values in float32)."""
    from safetensors.torch import load_file

    from medusa_core.loading import heads_from_state_dict

    out = heads_folder(args)
    stats = json.loads((out / "train_stats.json").read_text())
    model = load_served(args)
    heads = heads_from_state_dict(load_file(out / "medusa_lm_head.safetensors"), model, source=str(out)).float()
    return out, stats, model, heads


def stage_calibrate(args) -> None:
    """``evaluate_heads`` of the trained heads folder again, on this machine's served backbone (``train_stats.json``
    keeps the earlier figures under ``heldout_before``)."""
    out, stats, model, heads = trained_heads(args)
    stats["heldout_before"] = {k: stats[k] for k in ("heldout_backbone", "heldout_top1", "heldout_top5", "simulated_acceleration") if k in stats}
    evaluate_heads(args, model, heads, out, stats)
    (out / "train_stats.json").write_text(json.dumps(stats, indent=2))
    log(f"calibrate: held-out top-1 {stats['heldout_top1']}, replayed {stats['simulated_acceleration']}")


def stage_measure(args) -> None:
    """The trained heads folder measured on the held-out replies of each ``--heldout-settings`` (``chat`` and
    ``greedy`` by default) on this machine's served backbone, into its ``train_stats.json`` as ``heldout_by_settings``
    (per settings: top-1 and top-5 per head, the replayed acceleration of the optimised trees); the calibration file
    is left as it is. Raises ``SystemExit`` when a held-out reply file is missing."""
    held_files = {settings: served_distilled("heldout", args, settings) for settings in args.heldout_settings}
    for settings, held_file in held_files.items():
        if not held_file.exists():
            raise SystemExit(f"measure: no held-out replies at {settings} settings: {held_file} (run distill_served first)")
    out, stats, model, heads = trained_heads(args)
    measured = {}
    for settings, held_file in held_files.items():
        record, counted = heldout_record(model, heads, held_file, served_name("heldout", args, settings), temperatures=False)
        measured[settings] = {"replies": held_file.name, "positions": counted, "top1": record["top1"],
                              "top5": record["top5"], "simulated_acceleration": record["simulated_acceleration"]}
        log(f"measure {settings}: held-out top-1 {record['top1']}, replayed {record['simulated_acceleration']}")
    stats["heldout_by_settings"] = measured | {"backbone": f"{args.quantization} on {args.device}"}
    (out / "train_stats.json").write_text(json.dumps(stats, indent=2))


def stage_ranking(args) -> None:
    """The draft vocabulary's frequency ranking (``medusa_core.train.ranking``) from the served replies of every
    training split and ``--served-settings`` (the held-out split left out), into ``asset_folder``."""
    from medusa_core.train import read_distilled
    from medusa_core.train.ranking import rank_tokens, write_ranking

    files = [f for s in args.served_settings for split in TRAIN_SPLITS if (f := served_distilled(split, args, s)).exists()]
    if not files:
        raise SystemExit(f"ranking: no served replies of {args.quantization} in {DISTILLED} (run distill_served first)")
    replies = [row["reply_ids"] for f in files for row in read_distilled(f)]
    ranked = rank_tokens(replies)
    source = f"{len(replies):,} served replies ({', '.join(f.name for f in files)})"
    log(f"ranking: {len(ranked):,} distinct tokens of {source} -> {write_ranking(asset_folder(args), ranked, source)}")
