"""Stages that ship the build: heads, config and calibration into the assets with the build's figures (``export``),
and the shipped model measured on held-out prompts (``evaluate``)."""

from __future__ import annotations

import json
import shutil
import time

import torch

from .common import (ASSET, PROMPTS, TRAIN_SPLITS, WORK, asset_folder, backbone_folder, figures, heads_folder, log,
                     served_distilled, served_suffix, training_replies)


def stage_export(args) -> None:
    """Heads, config and calibration into ``asset_folder``; build figures beside them."""
    target = asset_folder(args)
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "medusa_lm_head.safetensors", "medusa_calibration.json"):
        shutil.copy(heads_folder(args) / name, target / name)
    record = {
        "build": figures(),
        "heads": json.loads((heads_folder(args) / "train_stats.json").read_text()),
        "distill": _distill_figures(args),
    }
    (target / "build_figures.json").write_text(json.dumps(record, indent=2) + "\n")
    size = sum(f.stat().st_size for f in ASSET.rglob("*") if f.is_file())
    log(f"export: {target}; {size / 1e6:.1f} MB in {ASSET}")


def _distill_figures(args) -> dict:
    from transformers import AutoTokenizer

    from medusa_core.train import read_distilled

    tok = AutoTokenizer.from_pretrained(backbone_folder())  # the tokenizer only: no need to load the model
    if args.heads_data == "served":  # the distill_served files the heads read, by file name
        files = {f.name: f for s in args.served_settings for split in ("heldout", *TRAIN_SPLITS[: args.train_rounds])
                 if (f := served_distilled(split, args, s)).exists()}
    else:
        files = {split: WORK / f"distill_{split}.jsonl"
                 for split in dict.fromkeys(("heldout", f"heldout{served_suffix(args)}", *training_replies(args)))}
    out = {}
    for split, file in files.items():
        rows = read_distilled(file)
        ended = sum(1 for r in rows if tok.eos_token_id in r["reply_ids"])
        out[split] = {
            "replies": len(rows),
            "follow_up_replies": sum(1 for r in rows if isinstance(r["id"], str)),
            "reply_tokens": sum(len(r["reply_ids"]) for r in rows),
            "ended_with_end_of_turn": round(ended / max(1, len(rows)), 3),
        }
    return out


def stage_evaluate(args) -> None:
    """The shipped model on held-out prompts, greedy, NF4 backbone by default.

    1. Acceleration rate of every calibrated tree up to 32 nodes and of the machine-tuned tree, and
       whether each reply equals plain greedy decoding (``--eval-prompts`` prompts, 128 new tokens).
    2. Replies that end with the end-of-turn token within ``--eval-tokens`` new tokens: Hugging Face
       ``generate`` (greedy, batched) on the same backbone, over ``--end-prompts`` prompts.
    """
    from medusa_core import load_medusa_model
    from medusa_core.train import read_prompts

    chats = [c for c in read_prompts(PROMPTS / "heldout.jsonl") if len(c) == 1]
    record = json.loads((asset_folder(args) / "build_figures.json").read_text())
    model = load_medusa_model("demo", quantization=args.quantization)
    tok = model.tokenizer
    trees = [t for t, paths in model.trees.items() if len(paths) + 1 <= 33]
    same = runs = 0
    accel: dict[str, list[int]] = {t: [0, 0] for t in trees}
    t0 = time.time()
    for chat in chats[: args.eval_prompts]:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        plain = [t for rec in model.generate(ids, max_new_tokens=128, medusa=False) for t in rec.token_ids]
        for tree in trees:
            recs = list(model.generate(ids, max_new_tokens=128, tree=tree))
            out = [t for rec in recs for t in rec.token_ids]
            accel[tree][0] += len(out)
            accel[tree][1] += len(recs)
            same += out == plain
            runs += 1
    result = {tree: {"nodes": len(model.trees[tree]) + 1, "acceleration_rate": round(a / max(1, n), 3)}
              for tree, (a, n) in accel.items()}
    log(f"evaluate: acceleration {json.dumps(result)}, identical {same}/{runs} in {time.time() - t0:.0f} s")
    ended = total = 0
    tok.padding_side = "left"
    end_chats = chats[: args.end_prompts]
    for start in range(0, len(end_chats), 16):
        enc = tok.apply_chat_template(end_chats[start : start + 16], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True, padding=True)
        with torch.inference_mode():
            gen = model.backbone.generate(**enc, max_new_tokens=args.eval_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        for row in gen[:, enc["input_ids"].shape[1] :].tolist():
            ended += any(t in model.eos_token_ids for t in row)
            total += 1
        log(f"evaluate: {ended}/{total} replies ended within {args.eval_tokens} tokens")
    record["evaluation"] = {
        "prompts": min(args.eval_prompts, len(chats)),
        "max_new_tokens": 128,
        "quantization": args.quantization,
        "trees": result,
        "identical_to_plain_greedy": f"{same}/{runs}",
        "ended_with_end_of_turn": {"replies": f"{ended}/{total}", "within_tokens": args.eval_tokens},
        "seconds": round(time.time() - t0),
    }
    (asset_folder(args) / "build_figures.json").write_text(json.dumps(record, indent=2) + "\n")
