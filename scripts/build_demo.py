"""Build the shipped demo model (``assets/demo``) from this machine's Python standard library.

One reproducible command, fixed seed, resumable stages (a stage whose output exists is skipped):

    python scripts/build_demo.py                 # everything, about an hour on 2 CPU cores
    python scripts/build_demo.py --stages corpus tokenizer backbone

Stages (work files under ``build/demo``; the result under ``assets/demo``):

1. ``corpus``    — stdlib ``.py`` files (no tests, no site-packages), 5 % of files held out by a hash
   of their path; chat pairs ``docstring paragraph -> function source`` extracted with ``ast``.
2. ``tokenizer`` — byte-level BPE (``tokenizers``), vocab 4096, chat template with end-of-turn token.
3. ``backbone``  — a small Llama trained from scratch (bf16 autocast on CPU).
4. ``distill``   — self-distillation: the backbone's greedy replies to training prompts (paper 2.3.2).
5. ``heads``     — 4 Medusa-1 heads on the frozen backbone (paper 2.2.1), ``medusa_core.train``.
6. ``calibrate`` — per-head rank accuracies on held-out distilled replies and optimised trees (2.3.3).
7. ``export``    — fp16 backbone + heads + tokenizer + calibration into ``assets/demo``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORK = ROOT / "build" / "demo"
ASSET = ROOT / "assets" / "demo"
SEED = 0
SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SYSTEM_PROMPT = "You are a helpful Python coding assistant."
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
MAX_REPLY_CHARS = 900  # keeps a reply well under 256 tokens (about 3.5 characters per token)


def log(msg: str) -> None:
    print(f"[build_demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def is_held_out(rel_path: str) -> bool:
    """5 % of files, chosen by a stable hash of the path relative to the stdlib root."""
    return int(hashlib.md5(rel_path.encode()).hexdigest(), 16) % 100 < 5


def render_chat(prompt: str, reply: str | None, system: str | None = None) -> str:
    """The chat template of ``CHAT_TEMPLATE`` as plain string formatting (for building training text)."""
    text = f"<|system|>\n{system}<|end|>\n" if system else ""
    text += f"<|user|>\n{prompt}<|end|>\n<|assistant|>\n"
    return text if reply is None else text + f"{reply}<|end|>\n"


def extract_chats(source: str) -> list[dict]:
    """Chat pairs from one module: first docstring paragraph as the request, the function as the reply."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    chats = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        code = ast.get_source_segment(source, node)
        if not doc or not code:
            continue
        request = " ".join(doc.strip().split("\n\n")[0].split())
        code = textwrap.dedent(" " * node.col_offset + code).strip()
        if len(request) < 12 or len(code) > MAX_REPLY_CHARS or len(code.splitlines()) < 3:
            continue
        chats.append({"prompt": request, "reply": code})
    return chats


def stage_corpus() -> None:
    out = WORK / "corpus"
    if (out / "stats.json").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    split = {"train": {"modules": [], "chats": []}, "heldout": {"modules": [], "chats": []}}
    files = sorted(
        p for p in stdlib.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(stdlib).parts[:-1])
    )
    for path in files:
        rel = path.relative_to(stdlib).as_posix()
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        part = split["heldout" if is_held_out(rel) else "train"]
        part["modules"].append({"path": rel, "text": source})
        part["chats"].extend(extract_chats(source))
    stats = {}
    for name, part in split.items():
        for kind, rows in part.items():
            with open(out / f"{name}_{kind}.jsonl", "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        stats[name] = {
            "files": len(part["modules"]),
            "module_chars": sum(len(m["text"]) for m in part["modules"]),
            "chats": len(part["chats"]),
        }
    stats["stdlib"] = str(stdlib)
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    log(f"corpus: {json.dumps(stats)}")


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def training_documents(split: str, chat_repeats: int) -> list[str]:
    """Text documents: modules once, chats ``chat_repeats`` times (a third of them with a system turn)."""
    corpus = WORK / "corpus"
    rng = random.Random(SEED)
    docs = [m["text"] for m in read_jsonl(corpus / f"{split}_modules.jsonl")]
    chats = read_jsonl(corpus / f"{split}_chats.jsonl")
    for _ in range(chat_repeats):
        for c in chats:
            system = SYSTEM_PROMPT if rng.random() < 0.33 else None
            docs.append(render_chat(c["prompt"], c["reply"], system))
    rng.shuffle(docs)
    return docs


def stage_tokenizer() -> None:
    out = WORK / "tokenizer"
    if (out / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t0 = time.time()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(training_documents("train", 1), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIALS[1:4],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    fast.save_pretrained(out)
    log(f"tokenizer: vocab {fast.vocab_size} in {time.time() - t0:.0f} s")


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(WORK / "tokenizer")


def token_stream(split: str, chat_repeats: int) -> torch.Tensor:
    """All documents of a split, tokenised and joined by ``<|endoftext|>``: [T] int64."""
    tok = load_tokenizer()
    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    docs = training_documents(split, chat_repeats)
    for batch_start in range(0, len(docs), 256):
        for enc in tok(docs[batch_start : batch_start + 256])["input_ids"]:
            ids.extend(enc)
            ids.append(sep)
    return torch.tensor(ids, dtype=torch.long)


def backbone_config():
    from transformers import LlamaConfig

    tok = load_tokenizer()
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=6,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=[tok.convert_tokens_to_ids("<|end|>"), tok.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )


@torch.no_grad()
def heldout_loss(model, data: torch.Tensor, seq_len: int, max_batches: int = 40) -> float:
    model.eval()
    n = (len(data) - 1) // seq_len
    losses = []
    for i in range(min(n, max_batches)):
        chunk = data[i * seq_len : (i + 1) * seq_len + 1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=chunk[None, :-1]).logits
        losses.append(torch.nn.functional.cross_entropy(logits[0].float(), chunk[1:]).item())
    model.train()
    return sum(losses) / len(losses)


def stage_backbone(args) -> None:
    out = WORK / "backbone"
    if (out / "config.json").exists():
        return
    from tqdm import tqdm
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    t0 = time.time()
    train = token_stream("train", chat_repeats=3)
    heldout = token_stream("heldout", chat_repeats=1)
    log(f"backbone: {len(train):,} training tokens, {len(heldout):,} held-out tokens")
    config = backbone_config()
    model = LlamaForCausalLM(config)
    log(f"backbone: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    seq, batch, steps = args.seq_len, args.batch_size, args.backbone_steps
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.backbone_lr,
        betas=(0.9, 0.95),
    )
    warmup = 100

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.backbone_lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return args.backbone_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(SEED)
    n_windows = (len(train) - 1) // seq
    order = torch.randperm(n_windows, generator=gen)
    model.train()
    bar = tqdm(range(steps), desc="backbone", unit="step")
    for step in bar:
        idx = order[(step * batch + torch.arange(batch)) % n_windows]
        rows = torch.stack([train[i * seq : i * seq + seq + 1] for i in idx.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr_at(step):.1e}")
    train_loss = loss.item()
    held = heldout_loss(model, heldout, seq)
    tok = load_tokenizer()
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    stats = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens_seen": steps * batch * seq,
        "train_stream_tokens": len(train),
        "heldout_tokens": len(heldout),
        "final_train_loss": round(train_loss, 3),
        "heldout_loss": round(held, 3),
        "seconds": round(time.time() - t0),
    }
    (out / "train_stats.json").write_text(json.dumps(stats, indent=2))
    log(f"backbone: {json.dumps(stats)}")


def _chat_prompts(split: str, limit: int | None) -> list[list[dict]]:
    """Seed conversations for self-distillation: a chat's request, a third with the system prompt."""
    rng = random.Random(SEED + 1)
    chats = read_jsonl(WORK / "corpus" / f"{split}_chats.jsonl")
    rng.shuffle(chats)
    out = []
    for c in chats[:limit]:
        system = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.33 else []
        out.append(system + [{"role": "user", "content": c["prompt"]}])
    return out


def stage_distill(args) -> None:
    from transformers import AutoTokenizer

    from medusa_core.loading import load_backbone
    from medusa_core.train import distill

    backbone = load_backbone(str(WORK / "backbone"))
    tok = AutoTokenizer.from_pretrained(WORK / "backbone")
    for split, limit, max_new in (("heldout", None, 256), ("train", args.distill_prompts, 200)):
        out = WORK / f"distill_{split}.jsonl"
        chats = _chat_prompts(split, limit)
        if out.exists() and len(out.read_text().splitlines()) >= len(chats):
            continue
        distill(backbone, tok, chats, out, max_new_tokens=max_new, batch_size=48, bf16=True)


def stage_heads(args) -> None:
    out = WORK / "heads"
    if (out / "train_stats.json").exists():
        return
    from medusa_core.loading import load_backbone
    from medusa_core.train import (
        CALIBRATION_FILE,
        HeadTrainingConfig,
        calibration,
        collect_positions,
        rank_accuracy,
        read_distilled,
        train_heads,
    )

    t0 = time.time()
    backbone = load_backbone(str(WORK / "backbone"))
    cfg = HeadTrainingConfig(num_heads=4, epochs=args.head_epochs, batch_size=2048, lr=1e-3, warmup_steps=30, seed=SEED)
    hidden, labels = collect_positions(backbone, read_distilled(WORK / "distill_train.jsonl"), cfg.num_heads, bf16=True)
    heads, stats = train_heads(backbone, hidden, labels, out, cfg, base_model_name_or_path="backbone")
    held_h, held_l = collect_positions(backbone, read_distilled(WORK / "distill_heldout.jsonl"), cfg.num_heads)
    record = calibration(rank_accuracy(heads, held_h, held_l), budgets=(8, 16, 32, 64), default=32)
    train_acc = rank_accuracy(heads, hidden[:50_000], labels[:50_000])
    (out / CALIBRATION_FILE).write_text(json.dumps(record, indent=1) + "\n")
    stats.update(
        heldout_positions=len(held_h),
        heldout_top1=record["top1"],
        heldout_top5=record["top5"],
        train_top1=[round(r[0], 4) for r in train_acc],
        expected_acceleration=record["expected_acceleration"],
        seconds_total=round(time.time() - t0),
    )
    (out / "train_stats.json").write_text(json.dumps(stats, indent=2))
    log(f"heads: {json.dumps({k: v for k, v in stats.items() if k != 'config'})}")


def stage_export(args) -> None:
    """fp16 backbone + tokenizer in assets/demo/backbone; heads, calibration and build figures beside."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    ASSET.mkdir(parents=True, exist_ok=True)
    backbone = AutoModelForCausalLM.from_pretrained(WORK / "backbone", dtype=torch.float16)
    backbone.save_pretrained(ASSET / "backbone")
    AutoTokenizer.from_pretrained(WORK / "backbone").save_pretrained(ASSET / "backbone")
    for name in ("config.json", "medusa_lm_head.safetensors", "medusa_calibration.json"):
        shutil.copy(WORK / "heads" / name, ASSET / name)
    figures = {
        "corpus": json.loads((WORK / "corpus" / "stats.json").read_text()),
        "backbone": json.loads((WORK / "backbone" / "train_stats.json").read_text()),
        "heads": json.loads((WORK / "heads" / "train_stats.json").read_text()),
        "distill": _distill_figures(),
    }
    (ASSET / "build_figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    log(f"export: {sum(f.stat().st_size for f in ASSET.rglob('*') if f.is_file()) / 1e6:.1f} MB in {ASSET}")


def _distill_figures() -> dict:
    from medusa_core.train import read_distilled

    out = {}
    end_id = load_tokenizer().convert_tokens_to_ids("<|end|>")
    for split in ("train", "heldout"):
        rows = read_distilled(WORK / f"distill_{split}.jsonl")
        ended = sum(1 for r in rows if end_id in r["reply_ids"])
        out[split] = {
            "prompts": len(rows),
            "reply_tokens": sum(len(r["reply_ids"]) for r in rows),
            "ended_with_end_of_turn": round(ended / max(1, len(rows)), 3),
        }
    return out


def stage_evaluate(args) -> None:
    """Acceleration rate of the shipped model on held-out prompts (greedy, optimised trees)."""
    from medusa_core import load_medusa_model
    from medusa_core.train import read_distilled

    rows = read_distilled(WORK / "distill_heldout.jsonl")[: args.eval_prompts]
    figures = json.loads((ASSET / "build_figures.json").read_text())
    result = {}
    for quant in ("none", "nf4"):
        model = load_medusa_model(ASSET, quantization=quant)
        for tree in ("optimised_16", "optimised_32", "optimised_64"):
            steps = tokens = same = 0
            for r in rows:
                ids = torch.tensor([r["prompt_ids"]])
                recs = list(model.generate(ids, max_new_tokens=128, tree=tree))
                out = [t for rec in recs for t in rec.token_ids]
                steps += len(recs)
                tokens += len(out)
                plain = [t for rec in model.generate(ids, max_new_tokens=128, medusa=False) for t in rec.token_ids]
                same += out == plain
            result[f"{quant}/{tree}"] = {
                "acceleration_rate": round(tokens / steps, 3),
                "identical_to_plain_greedy": f"{same}/{len(rows)}",
            }
            log(f"evaluate {quant}/{tree}: {result[f'{quant}/{tree}']}")
    figures["evaluation"] = {"prompts": len(rows), "max_new_tokens": 128, "results": result}
    (ASSET / "build_figures.json").write_text(json.dumps(figures, indent=2) + "\n")


STAGES = {
    "corpus": lambda a: stage_corpus(),
    "tokenizer": lambda a: stage_tokenizer(),
    "backbone": stage_backbone,
    "distill": stage_distill,
    "heads": stage_heads,
    "export": stage_export,
    "evaluate": stage_evaluate,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--backbone-steps", type=int, default=1300)
    p.add_argument("--backbone-lr", type=float, default=1.5e-3)
    p.add_argument("--distill-prompts", type=int, default=3000, help="training prompts to self-distil")
    p.add_argument("--head-epochs", type=float, default=2.0)
    p.add_argument("--eval-prompts", type=int, default=20)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    WORK.mkdir(parents=True, exist_ok=True)
    for name in args.stages:
        t0 = time.time()
        STAGES[name](args)
        log(f"stage {name} done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
