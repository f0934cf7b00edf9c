"""Stages that write the build's data: the backbone's own questions (``self_instruct``), a topic round's topics
(``topics``), the prompt files (``prompts``), and distilled replies: greedy (``distill``) and as the app serves them
(``distill_served``), batched and resumable."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .common import (DTYPES, PROMPTS, SEED, TRAIN_SPLITS, WORK, backbone_folder, load, load_served, log, own_replies,
                     save_figures, served_distilled, served_suffix)


def continuations(model, tok, enc, **generate) -> list[str]:
    """HF ``generate`` on a left-padded batch ``enc`` (``input_ids`` [B, T]) with the keyword arguments ``generate``;
    each row's new tokens decoded, special tokens left out."""
    with torch.inference_mode():
        gen = model.generate(**enc, **generate, pad_token_id=tok.pad_token_id)
    return [tok.decode(ids, skip_special_tokens=True) for ids in gen[:, enc["input_ids"].shape[1] :]]


def stage_self_instruct(args) -> None:
    """Questions the backbone writes itself, one per seed topic and style (greedy, batched)."""
    from .prompt_sources import self_instruct_requests

    out = WORK / "self_instruct.jsonl"
    if out.exists():
        return
    model, tok = load(DTYPES[args.distill_dtype])
    tok.padding_side = "left"
    requests = self_instruct_requests()
    rows, t0 = [], time.time()
    for start in range(0, len(requests), 64):
        batch = requests[start : start + 64]
        chats = [[{"role": "user", "content": r["request"]}] for r in batch]
        enc = tok.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt", return_dict=True, padding=True)
        for r, reply in zip(batch, continuations(model, tok, enc, max_new_tokens=40, do_sample=False)):
            text = reply.strip().splitlines()
            q = text[0].strip().strip('"') if text else ""
            if 15 <= len(q) <= 200 and q.endswith("?"):
                rows.append({"category": r["category"], "topic": r["topic"], "question": q})
        log(f"self-instruct: {start + len(batch)}/{len(requests)} requests, {len(rows)} questions")
    unique = list({r["question"]: r for r in rows}.values())
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in unique))
    save_figures(self_instruct={"requests": len(requests), "questions": len(unique), "seconds": round(time.time() - t0)})


def stage_topics(args) -> None:
    """A topic round's topics (``--topic-round`` N, ``demo_prompts.TOPIC_ROUNDS``): the backbone continues
    ``demo_prompts.topic_requests`` (``--topic-requests`` per kind; round 6's lists show round 5's topics), sampled
    (T 0.8, top-p 0.95, seeded per batch), into the round's topics file (``assets/demo/prompts/topics.jsonl``, round 6
    ``topics6.jsonl``), rows ``{"kind", "topic"}`` (resumable by batch on the machine that writes it,
    ``build/demo/<file>.done`` counting the requests done; a file without that count, as the repository holds it, is
    kept); ``demo_prompts.py --round N`` makes them prompts. Raises ``SystemExit`` when the topics a round's lists show
    are not there."""
    from .topic_rounds import TOPIC_ROUNDS, parse_topics, read_topics, topic_requests

    name, seed, shown = TOPIC_ROUNDS[args.topic_round]
    out, done = PROMPTS / name, WORK / f"{Path(name).stem}.done"
    if out.exists() and not done.exists():
        log(f"topics: {out} is there (delete it to write it again)")
        return
    requests = topic_requests(args.topic_requests, seed, read_topics(PROMPTS / shown) if shown else None)
    first = int(done.read_text()) if done.exists() else 0
    if first >= len(requests):
        return
    model, tok = load(DTYPES[args.distill_dtype])
    tok.padding_side = "left"
    t0, topics = time.time(), 0
    for start in range(first, len(requests), 64):
        batch = requests[start : start + 64]
        enc = tok([r["request"] for r in batch], return_tensors="pt", padding=True)
        torch.manual_seed(SEED + start)
        texts = continuations(model, tok, enc, max_new_tokens=60, do_sample=True, temperature=0.8, top_p=0.95)
        rows = [{"kind": r["kind"], "topic": t} for r, text in zip(batch, texts) for t in parse_topics(r["kind"], text)]
        with open(out, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        done.write_text(str(start + len(batch)))
        topics += len(rows)
        log(f"topics: {start + len(batch)}/{len(requests)} requests, {topics} topics this run")
    save_figures(topics={"requests": len(requests), "seconds": round(time.time() - t0)})


def stage_prompts(args) -> None:
    import demo_prompts

    demo_prompts.main(["--out", str(PROMPTS), "--self-instruct", str(WORK / "self_instruct.jsonl")])


def stage_distill(args) -> None:
    model, tok = load(DTYPES[args.distill_dtype])
    rounds = TRAIN_SPLITS[: args.train_rounds]
    for split in ("heldout",) if own_replies(args) else ("heldout", *rounds):
        _distill_split(model, tok, split, split, args, "plain", args.distill_dtype)
    if args.quantization == "none":
        return
    served = load_served(args)  # the held-out replies Medusa must reproduce with the served backbone
    suffix = served_suffix(args)
    _distill_split(served, tok, "heldout", "heldout" + suffix, args, args.quantization, "float32")
    if own_replies(args):  # its own replies to the training prompts, by its own 4-bit kernels
        for split in rounds:
            _distill_split(served, tok, split, split + suffix, args, args.quantization, "float32")


def prompt_file(split: str) -> Path:
    """``assets/demo/prompts/{split}.jsonl``; raises ``SystemExit`` saying how to write it when it is not there (rounds
    4-6's, which the repository does not hold: ``UNSHIPPED_SPLITS``)."""
    path = PROMPTS / f"{split}.jsonl"
    if not path.exists():
        how = f"python scripts/demo_prompts.py --round {TRAIN_SPLITS.index(split) + 1}" if split in TRAIN_SPLITS else "--stages prompts"
        raise SystemExit(f"no prompt file {path} ({how} writes it)")
    return path


def _distill_split(model, tok, split: str, name: str, args, backbone: str, dtype: str) -> None:
    """Greedy replies to ``prompts/{split}.jsonl`` into ``distill_{name}.jsonl`` (resumed), and the run's speed."""
    from medusa_core.train import distill, read_prompts

    out = WORK / f"distill_{name}.jsonl"
    _timed(f"distill {name}", f"distill_{name}", out, lambda: distill(
        model, tok, read_prompts(prompt_file(split)), out, max_new_tokens=args.max_reply_tokens, batch_size=args.distill_batch),
        backbone=backbone, dtype=dtype, batch_size=args.distill_batch)


def _timed(label: str, key: str, out: Path, run, **figures) -> None:
    """``run()``, a distillation appending to ``out``, then what it added logged as ``label`` (replies, reply tokens,
    reply tokens/s) and saved in the build's figures under ``key`` with the run's time and ``figures``."""
    from medusa_core.train import read_distilled

    before = len(read_distilled(out)) if out.exists() else 0
    t0 = time.time()
    run()
    rows = read_distilled(out)
    new_tokens, seconds = sum(len(r["reply_ids"]) for r in rows[before:]), time.time() - t0
    if new_tokens:
        log(f"{label}: {len(rows) - before} replies, {new_tokens} tokens in {seconds:.0f} s "
            f"({new_tokens / seconds:.0f} reply tokens/s)")
        save_figures(**{f"{key}_run_{int(time.time())}": {
            "replies": len(rows) - before, "reply_tokens": new_tokens, "seconds": round(seconds),
            **figures, "threads": torch.get_num_threads()}})


def stage_distill_served(args) -> None:
    """The served backbone's replies at the served settings, held-out prompts first (resumable). A prompt file
    that is not there (round 4's, which the repository does not hold) is skipped, or with ``--distill-splits``
    naming it, refused (``SystemExit`` saying how to write it) before the backbone loads."""
    from transformers import AutoTokenizer

    from medusa_core import CHAT_PRESET, SamplingConfig
    from medusa_core.train import distill, read_prompts

    if args.distill_splits:
        for split in args.distill_splits:
            prompt_file(split)  # a missing one is refused before the backbone loads
        splits = args.distill_splits
    else:
        splits = [split for split in ("heldout", *TRAIN_SPLITS) if (PROMPTS / f"{split}.jsonl").exists()]
        for split in sorted(set(TRAIN_SPLITS) - set(splits)):
            log(f"distill_served: no prompt file {split}.jsonl; skipped (python scripts/demo_prompts.py --round N writes rounds 3-6)")
    served, tok = load_served(args), AutoTokenizer.from_pretrained(backbone_folder())
    for settings in args.served_settings:
        sampling = CHAT_PRESET if settings == "chat" else SamplingConfig()
        for split in splits:
            out = served_distilled(split, args, settings)
            out.parent.mkdir(parents=True, exist_ok=True)
            _timed(f"distill_served {out.name}", f"distill_served_{out.name}", out, lambda: distill(
                served, tok, read_prompts(prompt_file(split)), out, max_new_tokens=args.served_reply_tokens,
                batch_size=args.distill_batch, sampling=sampling, seed=SEED), settings=settings, batch_size=args.distill_batch)
