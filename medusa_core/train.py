"""Medusa-1 head training, self-distillation and tree calibration (paper 2.2.1, 2.3.2, 2.3.3).

Command line (``python -m medusa_core.train --help``):

    # 1. the backbone's own greedy replies to seed prompts (JSONL chats/prompts or a .txt of prompts)
    python -m medusa_core.train distill --model BASE --prompts prompts.jsonl --out distilled.jsonl
    # 2. K heads on the frozen backbone, loss Σ_k 0.8^k · CE(head k, token t+k+2) over reply tokens
    python -m medusa_core.train heads --model BASE --data distilled.jsonl --out HEADS_DIR [--export vllm DIR]
    # 3. per-head rank accuracies on held-out replies and optimised trees for several node budgets
    python -m medusa_core.train calibrate --heads HEADS_DIR --data heldout.jsonl

The heads folder is a reference head-only checkpoint (``config.json`` + ``medusa_lm_head.safetensors``)
that ``load_medusa_model`` and text-generation-inference read; TensorRT-LLM reads it only for heads
with their own projections (not ``--share-lm-head``), vLLM only through ``--export vllm`` (README,
"Serving engines").
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import torch
from tqdm import tqdm

from .heads import MedusaHeads
from .loading import (
    CALIBRATION_FILE,
    backbone_source,
    export_vllm,
    heads_from_state_dict,
    load_backbone,
    resolve_device,
    save_medusa_heads,
)
from .trees import optimal_tree

#: Loss weight of head k is LOSS_DECAY ** k (paper 2.2.1, λ_k = 0.8^k).
LOSS_DECAY = 0.8
TRAINER_STATE = "trainer_state.pt"


# --------------------------------------------------------------------------- self-distillation
#: An assistant turn whose content is None in a seed chat: the backbone writes it during distillation.
MODEL_TURN = {"role": "assistant", "content": None}


def read_prompts(path: str | Path) -> list[list[dict]]:
    """Seed conversations from a ``.txt`` (one prompt per line) or ``.jsonl`` file.

    A JSONL row holds ``messages`` (a chat; trailing assistant turns are dropped so the model answers
    the last user turn) or ``prompt`` with an optional ``system``, and optionally ``followup``: a
    further user turn asked after the model's own reply (the chat then holds ``MODEL_TURN`` between
    the two user turns). Returns a list of message lists.
    Raises ``ValueError`` for a row with neither ``messages`` nor ``prompt``.
    """
    path = Path(path)
    if path.suffix == ".txt":
        return [[{"role": "user", "content": line.strip()}] for line in path.read_text().splitlines() if line.strip()]
    chats = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "messages" in row:
            messages = list(row["messages"])
            while messages and messages[-1]["role"] == "assistant":
                messages.pop()
        elif "prompt" in row:
            messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else [])
            messages.append({"role": "user", "content": row["prompt"]})
        else:
            raise ValueError(f"{path}:{n}: a row needs 'messages' or 'prompt'")
        if row.get("followup"):
            messages += [dict(MODEL_TURN), {"role": "user", "content": row["followup"]}]
        chats.append(messages)
    return chats


def distill(
    backbone,
    tokenizer,
    chats: list[list[dict]],
    out: str | Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    bf16: bool = False,
) -> Path:
    """Write the backbone's greedy replies to ``chats`` as JSONL (paper 2.3.2, self-distillation).

    Each row: ``id``, ``messages``, ``prompt_ids``, ``reply_ids`` (cut after the first EOS), ``reply``.
    A chat holding ``MODEL_TURN`` placeholders is answered turn by turn: the model's reply fills the
    first placeholder, then the conversation goes on with that reply. The first reply of chat ``i``
    has id ``i``, its later replies ``"i.1"``, ``"i.2"``, ... Resumable: ids already in ``out`` are
    skipped (their replies are read back for the next turn). Prompts are batched by length with
    left padding. ``bf16`` runs under bfloat16 autocast (CPU/CUDA); plain bf16 weights
    (``backbone.to(torch.bfloat16)``) are faster on CPU.
    """
    out = Path(out)
    done = {row["id"]: row for row in read_distilled(out)} if out.exists() else {}
    eos = backbone.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
    device = next(backbone.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    pending = list(enumerate(chats))  # (chat index, messages) still holding turns to write
    turn = 0
    with open(out, "a", encoding="utf-8") as f:
        while pending:
            todo, ready = [], []
            for i, messages in pending:
                cut = next((n for n, m in enumerate(messages) if m == MODEL_TURN), len(messages))
                key = i if turn == 0 else f"{i}.{turn}"
                (ready if key in done else todo).append((key, i, messages[:cut], messages[cut + 1 :]))
            todo = [(k, i, m, rest, _chat_ids(tokenizer, m)) for k, i, m, rest in todo]
            todo.sort(key=lambda r: len(r[4]))
            replies = {k: done[k]["reply_ids"] for k, *_ in ready}
            for start in tqdm(range(0, len(todo), batch_size), desc=f"distill turn {turn + 1}", unit="batch"):
                batch = todo[start : start + batch_size]
                width = max(len(r[4]) for r in batch)
                input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
                mask = torch.zeros_like(input_ids)
                for row, ids in enumerate(r[4] for r in batch):
                    input_ids[row, width - len(ids) :] = torch.tensor(ids)
                    mask[row, width - len(ids) :] = 1
                with torch.inference_mode(), autocast:
                    generated = backbone.generate(
                        input_ids=input_ids.to(device),
                        attention_mask=mask.to(device),
                        max_new_tokens=max_new_tokens,
                        do_sample=False,
                        pad_token_id=pad_id,
                    )[:, width:].tolist()
                for (key, _, messages, _, ids), reply in zip(batch, generated):
                    reply = reply[: next((n + 1 for n, t in enumerate(reply) if t in eos_ids), len(reply))]
                    replies[key] = reply
                    row = {"id": key, "messages": messages, "prompt_ids": ids, "reply_ids": reply,
                           "reply": tokenizer.decode(reply, skip_special_tokens=True)}
                    f.write(json.dumps(row) + "\n")
                f.flush()
            turn += 1
            pending = [
                (i, messages + [{"role": "assistant", "content": tokenizer.decode(replies[key], skip_special_tokens=True)}] + rest)
                for key, i, messages, rest, *_ in ready + todo
                if rest
            ]
    return out


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat with the generation prompt appended."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def read_distilled(path: str | Path) -> list[dict]:
    """Rows written by ``distill``."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------ training data
@torch.no_grad()
def collect_positions(
    backbone, rows: Iterable[dict], num_heads: int, *, bf16: bool = False, batch_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-norm hidden states of the frozen backbone and each head's target at every reply position.

    For a sequence ``prompt + reply`` of length T, the positions used are ``t = len(prompt)-1 .. T-2``;
    head k's label at t is the token at ``t+k+2`` when that token belongs to the reply, else -100.

    Returns (hidden [M, H] float16 on CPU, labels [M, K] int64).
    """
    decoder = backbone.get_decoder()
    device = next(backbone.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    rows = sorted(rows, key=lambda r: len(r["prompt_ids"]) + len(r["reply_ids"]))
    hidden_parts, label_parts = [], []
    for start in tqdm(range(0, len(rows), batch_size), desc="hidden states", unit="batch"):
        batch = rows[start : start + batch_size]
        seqs = [r["prompt_ids"] + r["reply_ids"] for r in batch]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for n, s in enumerate(seqs):
            ids[n, : len(s)] = torch.tensor(s)  # right padding: causal attention never sees it
        with autocast:
            hidden = decoder(input_ids=ids.to(device)).last_hidden_state.float().cpu()  # [B, W, H]
        for n, (r, s) in enumerate(zip(batch, seqs)):
            p, t_len = len(r["prompt_ids"]), len(s)
            if t_len - p < 2:
                continue
            positions = torch.arange(p - 1, t_len - 1)
            seq = torch.tensor(s)
            labels = torch.full((len(positions), num_heads), -100, dtype=torch.long)
            for k in range(num_heads):
                target = positions + k + 2
                ok = target < t_len
                labels[ok, k] = seq[target[ok]]
            hidden_parts.append(hidden[n, positions].to(torch.float16))
            label_parts.append(labels)
    return torch.cat(hidden_parts), torch.cat(label_parts)


# ----------------------------------------------------------------------------------- training
@dataclass(frozen=True)
class HeadTrainingConfig:
    """Medusa-1 head training hyper-parameters (paper 2.2.1; reference recipe lr 1e-3, cosine, warm-up)."""

    num_heads: int = 4  # K
    num_layers: int = 1  # residual blocks per head
    share_lm_head: bool = False  # "version 2" heads: residual blocks only, the backbone's LM head projects
    epochs: float = 2.0  # passes over the reply positions
    batch_size: int = 2048  # positions per optimizer step (after accumulation)
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.0
    seed: int = 0
    bf16: bool = True  # bfloat16 autocast for the head matmuls
    checkpoint_every: int = 200  # optimizer steps between checkpoints (0: only at the end)


def head_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_k 0.8^k · CE(head k) and each head's top-1 accuracy.

    Args: logits [K, B, V]; labels [B, K] (-100 = ignored). Returns (loss [], top1 [K]).
    """
    loss = logits.new_zeros((), dtype=torch.float32)
    top1 = []
    for k in range(logits.shape[0]):
        target = labels[:, k]
        valid = target != -100
        if valid.any():
            loss = loss + LOSS_DECAY**k * torch.nn.functional.cross_entropy(logits[k].float(), target, ignore_index=-100)
            top1.append((logits[k].argmax(-1) == target)[valid].float().mean())
        else:
            top1.append(logits.new_zeros((), dtype=torch.float32))
    return loss, torch.stack(top1)


def lr_at(step: int, total: int, cfg: HeadTrainingConfig) -> float:
    """Linear warm-up then cosine decay to ``lr * min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_heads(
    backbone,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    out: str | Path,
    cfg: HeadTrainingConfig,
    *,
    base_model_name_or_path: str,
    resume: bool = True,
) -> tuple[MedusaHeads, dict]:
    """Train K Medusa-1 heads on precomputed positions of a frozen backbone (paper 2.2.1).

    Args:
        hidden: [M, H] final-norm hidden states; labels: [M, K] targets (``collect_positions``).
        out: heads folder; checkpoints (heads + ``trainer_state.pt``) go there every
            ``cfg.checkpoint_every`` steps and training resumes from them when ``resume``.

    Returns (heads, stats) with the final loss and per-head training top-1 accuracy.
    """
    out = Path(out)
    torch.manual_seed(cfg.seed)
    if cfg.share_lm_head:
        lm_head = backbone.get_output_embeddings()
        heads = MedusaHeads(lm_head.in_features, lm_head.out_features, cfg.num_heads, cfg.num_layers, shared_lm_head=lm_head)
    else:
        heads = MedusaHeads.from_backbone(backbone, cfg.num_heads, cfg.num_layers)
    heads = heads.float().cpu().train()
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    micro = cfg.batch_size // cfg.grad_accum
    total_steps = max(1, int(cfg.epochs * len(hidden) / cfg.batch_size))
    step = resumed_from = 0
    state_file = out / TRAINER_STATE
    if resume and state_file.exists():
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["optimizer"])
        step = resumed_from = int(state["step"])
        tqdm.write(f"resuming head training at step {step}/{total_steps}")
    generator = torch.Generator().manual_seed(cfg.seed)
    order = torch.cat([torch.randperm(len(hidden), generator=generator) for _ in range(math.ceil(cfg.epochs) + 1)])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if cfg.bf16 else nullcontext()
    bar = tqdm(range(step, total_steps), desc="heads", unit="step", initial=step, total=total_steps)
    loss_value, top1 = float("nan"), torch.zeros(cfg.num_heads)
    t0 = time.time()
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total_steps, cfg)
        for a in range(cfg.grad_accum):
            start = (step * cfg.grad_accum + a) * micro
            idx = order[start : start + micro]
            with autocast:
                logits = heads(hidden[idx].float())  # [K, B, V]
            loss, top1 = head_loss(logits, labels[idx])
            (loss / cfg.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        bar.set_postfix(loss=f"{loss_value:.3f}", top1="/".join(f"{a:.2f}" for a in top1.tolist()))
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < total_steps:
            _checkpoint(heads, opt, step + 1, out, base_model_name_or_path)
    heads.eval()
    save_medusa_heads(heads, out, base_model_name_or_path=base_model_name_or_path)
    state_file.unlink(missing_ok=True)
    stats = {
        "steps": total_steps,
        "resumed_from": resumed_from,
        "positions": len(hidden),
        "final_loss": round(loss_value, 4),
        "train_top1_last_batch": [round(a, 4) for a in top1.tolist()],
        "seconds": round(time.time() - t0, 1),
        "config": asdict(cfg),
    }
    return heads, stats


def _checkpoint(heads, opt, step, out, base) -> None:
    save_medusa_heads(heads, out, base_model_name_or_path=base)
    torch.save({"heads": heads.state_dict(), "optimizer": opt.state_dict(), "step": step}, out / TRAINER_STATE)


# -------------------------------------------------------------------------------- calibration
@torch.inference_mode()
def rank_accuracy(
    heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, max_rank: int = 10, batch_size: int = 4096
) -> list[list[float]]:
    """``a[k][i]``: fraction of positions where the target is exactly rank i of head k (paper 2.3.3).

    Top-n accuracy of head k is ``sum(a[k][:n])``. Args: hidden [M, H], labels [M, K].
    """
    counts = torch.zeros(heads.num_heads, max_rank)
    totals = torch.zeros(heads.num_heads)
    dtype = next(heads.parameters()).dtype
    device = next(heads.parameters()).device
    for start in range(0, len(hidden), batch_size):
        h = hidden[start : start + batch_size].to(device, dtype)
        lab = labels[start : start + batch_size].to(device)
        logits = heads(h)  # [K, B, V]
        for k in range(heads.num_heads):
            valid = lab[:, k] != -100
            if not valid.any():
                continue
            lk = logits[k][valid]
            target_logit = lk.gather(1, lab[valid, k, None])
            rank = (lk > target_logit).sum(dim=1)  # [B'] 0 = top-1
            counts[k] += torch.bincount(rank.clamp(max=max_rank), minlength=max_rank + 1)[:max_rank].cpu()
            totals[k] += valid.sum().cpu()
    return (counts / totals.clamp(min=1)[:, None]).tolist()


def calibration(acc: list[list[float]], budgets: Iterable[int] = (8, 16, 32, 64), default: int = 32) -> dict:
    """Calibration record written next to the heads: accuracies and the optimised tree per budget."""
    trees, expected = {}, {}
    for n in budgets:
        paths, value = optimal_tree(acc, n)
        trees[f"optimised_{n}"] = paths
        expected[f"optimised_{n}"] = round(1 + value, 4)
    return {
        "rank_accuracy": [[round(a, 5) for a in row] for row in acc],
        "top1": [round(row[0], 4) for row in acc],
        "top5": [round(sum(row[:5]), 4) for row in acc],
        "expected_acceleration": expected,
        "trees": trees,
        "default_tree": f"optimised_{default}" if default in budgets else None,
    }


# ----------------------------------------------------------------------------------------- CLI
def _backbone_and_tokenizer(args):
    from transformers import AutoTokenizer

    device = resolve_device(args.device)
    source = backbone_source(args.model, args.trust_remote_code)  # a .gguf file: its converted folder
    backbone = load_backbone(source, None if args.quantization == "none" else args.quantization, torch.float32, device, args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    return backbone, tokenizer


def _load_heads_folder(folder: Path, backbone) -> MedusaHeads:
    from safetensors.torch import load_file

    return heads_from_state_dict(load_file(folder / "medusa_lm_head.safetensors"), backbone, source=str(folder))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m medusa_core.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--model", required=True, help="backbone: local folder or Hub id")
        sp.add_argument("--quantization", default="none", choices=["nf4", "int8", "none"], help="backbone precision (QLoRA-style 4-bit: nf4)")
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
        hidden, labels = collect_positions(backbone, read_distilled(args.data), cfg.num_heads, bf16=args.bf16)
        heads, stats = train_heads(backbone, hidden, labels, args.out, cfg, base_model_name_or_path=args.base_name or args.model, resume=not args.no_resume)
        if args.heldout:
            hh, hl = collect_positions(backbone, read_distilled(args.heldout), cfg.num_heads, bf16=args.bf16)
            record = calibration(rank_accuracy(heads, hh, hl))
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
        hidden, labels = collect_positions(backbone, read_distilled(args.data), heads.num_heads, bf16=args.bf16)
        record = calibration(rank_accuracy(heads, hidden, labels), args.budgets)
        (Path(args.heads) / CALIBRATION_FILE).write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps({k: record[k] for k in ("top1", "top5", "expected_acceleration")}, indent=1))


if __name__ == "__main__":
    main()
