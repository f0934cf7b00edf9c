"""Probe (issue 25): an EAGLE-style drafter on the served backbone's features, trained and measured apart from the app.

One Llama decoder layer (the backbone's widths: 9 heads of 64, a SiLU MLP of 1,536) reads fc([f_t, e(x_{t+1})]) -- the
backbone's final-norm state at t and the embedding of the token after it (a step's root) -- attends over its own
states at every earlier position (its own KV cache at decode time), and predicts x_{t+2} through the backbone's
frozen LM head, with a light regression of f_{t+1} (EAGLE, Li et al. 2024). The second, chained draft reads
(its own output for t+1, e(x_{t+2})) and attends to the true-feature positions before it, as a chain tree's second
node would at decode time; training runs that second draft too (EAGLE-3's "training-time test", one step deep).

Measured on the 252 held-out chat replies at the positions head 1 is measured at (t = p-1 .. T-3, the reply's token
as the target, which exact sampling at the chat preset accepts with that probability): draft 1's top-1, draft 2's
top-1 where draft 1 is right, and a 2-draft chain's tokens per step 1 + P(d1) + P(d1 and d2) (no τ, no corpus); and
draft 1 against the served distribution p (the backbone's, processed as the chat preset, from the cached features):
E[p(draft 1)] (what exact sampling accepts it with), how often it is p's mode, and the ceiling E[max p].

    # on a GPU (the GGUF weights dequantized to float32): train, write eagle_probe.json and eagle_drafter.safetensors
    python scripts/probe_eagle.py --device cuda --epochs 4 --with-greedy --out out/eagle
    # the same on the replies of prompt rounds 1-5 (rounds 4 and 5: chat replies only, written by build_demo.py)
    python scripts/probe_eagle.py --device cuda --epochs 4 --with-greedy --train-rounds 5 --out out/eagle
    # the same, continued from saved weights at a lower learning rate
    python scripts/probe_eagle.py --device cuda --epochs 2 --lr 3e-4 --with-greedy --init assets/eagle-probe/drafter.safetensors
    # on this CPU (the app's own int4 states, features cached per file): continued on round 6's chat replies and a
    # sample of 2,000 of each earlier file's, the drafts' loss over the served chain's 8,192-token draft vocabulary
    python scripts/probe_eagle.py --device cpu --quantization gguf --tokens 4096 --epochs 1 --budget 7200 --lr 3e-4 \
        --init assets/eagle-probe/drafter.safetensors --train-rounds 6 --replay 2000 --draft-vocabulary 8192 --out out/eagle-cpu
    # the same against the backbone's served distribution (the chat preset's, from the next position's cached feature)
    # instead of the reply's token: docs/BENCH.md, "The drafter against the served distribution"
    python scripts/probe_eagle.py --device cpu --quantization gguf --tokens 4096 --epochs 1 --lr 3e-4 --teacher 1.0 \
        --init assets/eagle-probe/drafter.safetensors --train-rounds 6 --replay 500 --draft-vocabulary 8192 --out out/eagle-teacher
    # EAGLE-3's fused features (layers 2 and 15 and the final-norm state), from scratch on round 6's first 2,000 chat
    # replies; --final-only: the drafter of the last state alone on the same cache (docs/BENCH.md, "The drafter against
    # the served distribution"); with --init a drafter of the last state continues as a fused one from its own start
    python scripts/probe_eagle.py --device cpu --quantization gguf --tokens 4096 --epochs 3 --budget 900 --lr 1e-3 \
        --train-rounds 6 --replay 1 --limit 2000 --feature-layers 2 15 30 --draft-vocabulary 8192 [--final-only]
    # the shipped drafter learning only to add the fused states (its own weights frozen; docs/BENCH.md, "EAGLE-3's
    # fused features at 1.67 M tokens on a CPU")
    python scripts/probe_eagle.py --device cpu --quantization gguf --tokens 4096 --epochs 1 --lr 1e-3 --train-only fuse \
        --init assets/eagle-probe/drafter.safetensors --train-rounds 6 --replay 500 --limit 5504 --feature-layers 2 15 30 --draft-vocabulary 8192
    # on this CPU (the app's own int4 states): measure saved weights, with attention limited to the last w positions
    python scripts/probe_eagle.py --device cpu --quantization gguf --tokens 4096 --eval assets/eagle-probe/drafter.safetensors
    # the same with the drafter's linears in 4 bits (as a compiled int4 product would hold them), all positions
    python scripts/probe_eagle.py --device cpu --quantization gguf --tokens 4096 --eval assets/eagle-probe/drafter.safetensors --int4 --windows 0
    # what the drafter's work costs a decoding step on this CPU in ATen calls
    python scripts/probe_eagle.py --cost

Results: docs/BENCH.md, "An EAGLE-style drafter". The drafter module and the step-cost timing live in
``scripts/eagle_probe/``. Reads ``assets/demo/distill`` (and ``assets/demo-training/distill``, rounds 4-6); the
backbone is ``$MEDUSA_DEMO_GGUF`` or the installed demo GGUF file.
"""

import argparse
import json
import math
import os
import random
import time

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from medusa_core.gguf import demo_gguf_file  # noqa: E402
from medusa_core.loading import load_backbone  # noqa: E402
from medusa_core.processors import CHAT_PRESET  # noqa: E402
from medusa_core.train import read_distilled  # noqa: E402

from demo_build.common import TRAIN_SPLITS, distilled_folder  # noqa: E402  (scripts/ is on the path when a script runs)
from eagle_probe.cost import step_cost  # noqa: E402
from eagle_probe.drafter import Drafter  # noqa: E402
from eagle_probe.served import processed, seen_prefixes  # noqa: E402


def replies_file(name: str) -> Path:
    """``{split}-gguf-{settings}``'s served replies: in ``assets/demo/distill``, or ``assets/demo-training/distill``
    for a round whose prompts the repository does not hold (``demo_build.common.distilled_folder``)."""
    return distilled_folder(name.split("-")[0]) / f"{name}.jsonl.gz"


def log(msg):
    print(f"[probe {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--gguf", default=os.environ.get("MEDUSA_DEMO_GGUF") or str(demo_gguf_file()))
    p.add_argument("--limit", type=int, default=0, help="replies per file (0: all)")
    p.add_argument("--budget", type=float, default=240, help="training seconds at most (the cosine schedule is cut there)")
    p.add_argument("--with-greedy", action="store_true", help="train on the greedy replies too (else the chat ones)")
    p.add_argument("--train-rounds", type=int, choices=range(1, len(TRAIN_SPLITS) + 1), default=3,
                   help="the prompt rounds whose replies it trains on (build_demo's --train-rounds; a round without replies "
                        "for a setting, such as round 4's and 5's greedy ones, is skipped with a line in the log)")
    p.add_argument("--replay", type=int, default=0,
                   help="replies per file of the rounds before the last of --train-rounds, a seeded random sample (the "
                        "newest round's all): continuing a drafter on a new round without its features of every "
                        "earlier one (~40 minutes per 1.6 M tokens on a 2-core CPU); 0: all")
    p.add_argument("--epochs", type=float, default=4)
    p.add_argument("--tokens", type=int, default=16384, help="padded tokens per batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--w2", type=float, default=0.5, help="weight of the chained draft's loss")
    p.add_argument("--wreg", type=float, default=0.1, help="weight of the feature regression (EAGLE-1)")
    p.add_argument("--deadline", type=float, default=0, help="epoch seconds by which the results must be written")
    p.add_argument("--init", default="", help="drafter weights to continue training from (else EAGLE's start)")
    p.add_argument("--eval", default="", help="drafter weights: only measure them, once per attention window (--windows)")
    p.add_argument("--windows", type=int, nargs="+", default=[0, 1, 2, 4, 16, 64], help="with --eval: attention windows (0: all)")
    p.add_argument("--int4", action="store_true", help="with --eval: the drafter's linears quantized to 4 bits first")
    p.add_argument("--quantization", default=None, help="gguf: the CPU's int4 backbone states")
    p.add_argument("--cost", action="store_true", help="only time a decoding step's drafter work on this CPU in ATen calls "
                   "(bf16, 2 threads, 400 cached positions): catch-up of 1-3 accepted rows, then two drafts")
    p.add_argument("--draft-vocabulary", type=int, default=0,
                   help="train the drafts' loss over the first N tokens of the heads' frequency ranking (assets/demo/"
                        "draft_ranking.json; the served chain drafts over 8,192 of them), a position whose token lies "
                        "outside left out of the loss; 0: the whole vocabulary. Held-out figures stay over all tokens")
    p.add_argument("--teacher", type=float, default=0.0,
                   help="weight of the teacher loss: cross-entropy against the backbone's own next-token distribution at the "
                        "served chat settings (CHAT_PRESET: penalty on the tokens seen, temperature, top-p; from the cached "
                        "features of the next position), the rest on the reply's token; 0: the reply's token only")
    p.add_argument("--feature-layers", type=int, nargs="+", default=None,
                   help="the backbone's hidden states the drafter reads, as indices into transformers' hidden_states "
                        "(0: the embeddings, k: layer k's output, the last: the final-norm state), fused by one more "
                        "linear (EAGLE-3's low, middle and high features, Li et al. 2025); the chained draft reads its own "
                        "output in their place. Default: the final-norm state alone")
    p.add_argument("--final-only", action="store_true",
                   help="with --feature-layers: the drafter reads only the last of them (the baseline, on the same cache)")
    p.add_argument("--train-only", nargs="+", default=None,
                   help="train only the drafter's parameters whose names start with one of these (e.g. fuse: with --init "
                        "and --feature-layers, the drafter keeps its weights and learns only to mix in the new states)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = p.parse_args()
    if a.cost:
        return step_cost()
    t0 = time.time()
    dev = torch.device(a.device)
    if dev.type == "cpu":  # the app's compiled 4-bit product for the features (torch's int4-pack is ~5x slower)
        from medusa_core.invariant import load_kernel

        log(f"compiled kernels: {load_kernel(log)}")
    model = load_backbone(a.gguf, a.quantization, torch.float32, device=a.device, batch_invariant=False)
    cfg = model.config
    dec, lm = model.get_decoder(), model.get_output_embeddings()
    embed = model.get_input_embeddings()
    log(f"backbone loaded in {time.time() - t0:.0f} s")

    def replayed(name):
        """Whether ``name`` is an earlier round's training replies, of which --replay keeps a sample."""
        return bool(a.replay) and name.split("-")[0] in TRAIN_SPLITS[: a.train_rounds - 1]

    def rows_of(names):
        rows = []
        for n in names:
            r = read_distilled(replies_file(n))
            r = r[: a.limit] if a.limit else r
            rows += random.Random(0).sample(r, min(a.replay, len(r))) if replayed(n) else r
        return [(x["prompt_ids"] + x["reply_ids"], len(x["prompt_ids"])) for x in rows if len(x["reply_ids"]) >= 3]

    def features(names):
        """``featurize`` over the replies of ``names``, one file at a time, each cached on disk on a CPU
        (``build/demo/eagle_features/{name}-{backbone}-{limit}[-replay{N}].pt``; a file that has grown since is featurized again):
        the features of ~1.6 M tokens take ~40 minutes on this 2-core CPU."""
        parts = []
        for name in names:
            rows = rows_of([name])
            kept = f"{a.limit}-replay{a.replay}" if replayed(name) else str(a.limit)
            if a.feature_layers:
                kept += "-layers" + "_".join(map(str, a.feature_layers))
            cache = ROOT / "build/demo/eagle_features" / f"{name}-{a.quantization or 'float32'}-{kept}.pt"
            part = torch.load(cache, weights_only=True) if dev.type == "cpu" and cache.exists() else None
            if part is None or part["rows"] != len(rows):
                part = dict(zip(("feats", "ids", "offs"), featurize(rows)), rows=len(rows))
                part["offs"] = torch.tensor(part["offs"])
                if dev.type == "cpu":
                    cache.parent.mkdir(parents=True, exist_ok=True)
                    torch.save(part, cache)
            parts.append(part)
        starts = [0]
        for part in parts[:-1]:
            starts.append(starts[-1] + len(part["feats"]))
        offs = sorted(((o + start, L, pl) for part, start in zip(parts, starts) for o, L, pl in part["offs"].tolist()),
                      key=lambda off: off[1])  # by length, as one featurize call would give them (batches pad less)
        return torch.cat([part["feats"] for part in parts]), torch.cat([part["ids"] for part in parts]), offs

    @torch.no_grad()
    def featurize(rows):
        """Sorted by length; flat bf16 features and ids on the device, with offsets."""
        rows = sorted(rows, key=lambda r: len(r[0]))
        total = sum(len(s) for s, _ in rows)
        layers = a.feature_layers or [cfg.num_hidden_layers]  # hidden_states[num_hidden_layers]: the final-norm state
        feats = torch.empty(total, len(layers), cfg.hidden_size, dtype=torch.bfloat16, device=dev)
        ids = torch.empty(total, dtype=torch.long, device=dev)
        offs, o, i = [], 0, 0
        while i < len(rows):
            j = i
            while j < len(rows) and (j - i + 1) * len(rows[j][0]) <= 4 * a.tokens:
                j += 1
            j = max(j, i + 1)
            batch = rows[i:j]
            W = len(batch[-1][0])
            t = torch.zeros(len(batch), W, dtype=torch.long)
            for n, (s, _) in enumerate(batch):
                t[n, : len(s)] = torch.tensor(s)
            t = t.to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                if a.feature_layers:
                    states = dec(input_ids=t, output_hidden_states=True).hidden_states
                    h = torch.stack([states[k] for k in layers], 2)  # [B, W, layers, H]
                else:
                    h = dec(input_ids=t).last_hidden_state[:, :, None]
            for n, (s, pl) in enumerate(batch):
                feats[o : o + len(s)] = h[n, : len(s)].to(torch.bfloat16)
                ids[o : o + len(s)] = t[n, : len(s)]
                offs.append((o, len(s), pl))
                o += len(s)
            i = j
        return (feats if a.feature_layers else feats[:, 0]), ids, offs

    # batches by padded tokens
    def batches(offs):
        out, i = [], 0
        while i < len(offs):
            j = i
            while j < len(offs) and (j - i + 1) * offs[j][1] <= a.tokens:
                j += 1
            j = max(j, i + 1)
            out.append(offs[i:j])
            i = j
        return out

    def assemble(feats, ids, batch):
        W = max(L for _, L, _ in batch)
        B = len(batch)
        f = torch.zeros(B, W, *feats.shape[1:], dtype=torch.bfloat16, device=dev)  # [B, W, (layers,) H]
        x = torch.zeros(B, W, dtype=torch.long, device=dev)
        m1 = torch.zeros(B, W, dtype=torch.bool, device=dev)  # draft 1 at t: t in [p-1, T-3]
        for n, (o, L, pl) in enumerate(batch):
            f[n, :L], x[n, :L] = feats[o : o + L], ids[o : o + L]
            m1[n, pl - 1 : L - 2] = True
        return f, x, m1

    fused = len(a.feature_layers) if a.feature_layers and not a.final_only else 1
    drafter = Drafter(cfg, fused).to(dev)
    if a.init:  # a drafter of the final-norm state alone continues as a fused one from its start (Drafter.fuse)
        from safetensors.torch import load_file

        missing, unexpected = drafter.load_state_dict({k: v.float() for k, v in load_file(a.init).items()}, strict=False)
        if unexpected or any(not k.startswith("fuse") for k in missing):
            raise SystemExit(f"{a.init} does not fit this drafter: missing {missing}, unexpected {unexpected}")
    else:
        with torch.no_grad():  # EAGLE's start: fc reads the feature half as identity
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, : cfg.hidden_size].copy_(torch.eye(cfg.hidden_size))
            drafter.o.weight.zero_()
            drafter.d.weight.zero_()
    for prm in model.parameters():
        prm.requires_grad_(False)
    draft_head = draft_index = None  # with --draft-vocabulary: the LM head's rows of the ranked ids, and each id's row
    if a.draft_vocabulary:
        from medusa_core.heads import DRAFT_RANKING_FILE
        from medusa_core.loading import read_ranking  # the loader's own checked reading of the ranking

        ranked = read_ranking(ROOT / "assets/demo" / DRAFT_RANKING_FILE, cfg.vocab_size)[: a.draft_vocabulary]
        draft_head = lm.weight.detach()[ranked].to(device=dev, dtype=torch.bfloat16)  # [N, H]
        draft_index = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
        draft_index[ranked] = torch.arange(len(ranked))
        draft_index = draft_index.to(dev)  # [V] -100 (the loss's ignore index) outside the draft vocabulary

    def logits_and_targets(h, tgt, train):
        """Logits of drafts ``h`` [n, H] and their targets [n]: over the whole vocabulary, or in training with
        --draft-vocabulary over the draft vocabulary's rows (targets outside it -100)."""
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            if train and draft_head is not None:
                return F.linear(h, draft_head).float(), draft_index[tgt]
            return lm(h).float(), tgt

    def teacher(f, x, mask, weight, columns, chunk=512):
        """The backbone's served distribution of x_{s+2} at each (b, s) of ``mask`` [B, W], over the rows of
        ``weight`` [C, H] (the LM head's, or the draft vocabulary's with ``columns``), computed from the cached feature
        f_{s+1} with the tokens x_0 .. x_{s+1} seen: [n, C] per ``chunk`` rows (an iterator)."""
        b, s = mask.nonzero(as_tuple=True)
        for i in range(0, len(b), chunk):
            bi, si = b[i : i + chunk], s[i : i + chunk]
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = F.linear(f[bi, si + 1], weight).float()
            yield processed(logits, seen_prefixes(x, columns, weight.shape[0], bi, si), CHAT_PRESET)

    def soft_ce(logits, target):
        """Cross-entropy of ``logits`` [n, C] against the distributions ``target`` [n, C]."""
        return -(target * torch.log_softmax(logits, -1)).sum(-1).mean()

    def run(f, x, m1, train):
        """Losses and counts for draft 1 (at t, predicts x_{t+2}) and draft 2 (chained from t, predicts x_{t+3}).
        ``f`` [B, W, H], or [B, W, layers, H] with --feature-layers (the last: the final-norm state)."""
        if f.dim() == 4:
            g = drafter.fused(f) if drafter.fuse is not None else f[:, :, -1]
            f = f[:, :, -1]  # the final-norm state: the regression's target and the teacher's logits
        else:
            g = f
        e_next = embed(torch.roll(x, -1, 1)).to(torch.bfloat16)  # e(x_{t+1}) at t
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            ox, _ = drafter(g, e_next)
            # Y at position t+1: (f^_{t+1} = ox[t], e(x_{t+2}))
            f2 = torch.cat([torch.zeros_like(ox[:, :1]), ox[:, :-1]], 1)
            _, oy = drafter(g, e_next, f2, e_next)
        tgt1 = torch.roll(x, -2, 1)  # x_{t+2} at t
        m2 = torch.zeros_like(m1)  # draft 2 at position t+1 (chained from t): predicts x_{t+3}; needs t+3 <= T-1
        m2[:, 1:] = m1[:, :-1] & m1[:, 1:]
        ftgt = torch.roll(f, -1, 1)  # f_{t+1} at t
        h1, h2 = ox[m1], oy[m2]
        (l1, t1), (l2, t2) = logits_and_targets(h1, tgt1[m1], train), logits_and_targets(h2, tgt1[m2], train)
        ce1 = F.cross_entropy(l1, t1)
        ce2 = F.cross_entropy(l2, t2) if len(h2) else l1.sum() * 0
        if train and a.teacher:  # the served distribution of the same tokens, over the logits' columns
            weight, columns = (draft_head, draft_index) if draft_head is not None else (lm.weight, None)
            q1 = torch.cat(list(teacher(f, x, m1, weight, columns, chunk=1 << 20)))
            ce1 = (1 - a.teacher) * ce1 + a.teacher * soft_ce(l1, q1)
            if len(h2):  # draft 2's positions are among draft 1's, in the same order
                ce2 = (1 - a.teacher) * ce2 + a.teacher * soft_ce(l2, q1[m2[m1]])
        reg = F.smooth_l1_loss(h1.float(), ftgt[m1].float())
        right1 = (l1.argmax(-1) == t1)
        right2 = (l2.argmax(-1) == t2)
        # draft 1 right at t (position t's entry) and draft 2 right at t+1
        r1_full = torch.zeros_like(m1)
        r1_full[m1] = right1
        r2_full = torch.zeros_like(m1)
        r2_full[m2] = right2
        both = (r1_full[:, :-1] & r2_full[:, 1:]).sum()
        first_with_next = (r1_full[:, :-1] & m2[:, 1:]).sum()
        loss = a.wreg * reg + ce1 + a.w2 * ce2 if train else None
        served_counts = dict(accept=0.0, ceiling=0.0, mode=0, sampled_mode=0)
        if not train:  # draft 1 against the backbone's served distribution over the whole vocabulary
            draft, start = l1.argmax(-1), 0
            for q in teacher(f, x, m1, lm.weight, None):
                d, tk = draft[start : start + len(q)], t1[start : start + len(q)]
                start += len(q)
                served_counts["accept"] += float(q.gather(1, d[:, None]).sum())  # E[p(draft 1)]
                served_counts["ceiling"] += float(q.max(-1).values.sum())
                served_counts["mode"] += int((q.argmax(-1) == d).sum())
                served_counts["sampled_mode"] += int((q.argmax(-1) == tk).sum())
        return loss, dict(n1=int(m1.sum()), r1=int(right1.sum()), both=int(both), r1n=int(first_with_next), ce1=float(ce1.detach()), ce2=float(ce2.detach()), reg=float(reg.detach()), **served_counts)

    def evaluate(feats, ids, offs, limit=None):
        """Held-out-style figures over every batch of ``offs``, or over a seeded random sample of ``limit`` of them
        (the batches are sorted by length: their first ones would be the shortest replies)."""
        drafter.eval()
        tot = dict(n1=0, r1=0, both=0, r1n=0, accept=0.0, ceiling=0.0, mode=0, sampled_mode=0)
        chosen = batches(offs)
        if limit is not None:
            chosen = random.Random(0).sample(chosen, min(limit, len(chosen)))
        with torch.no_grad():
            for b in chosen:
                _, s = run(*assemble(feats, ids, b), train=False)
                for k in tot:
                    tot[k] += s[k]
        drafter.train()
        n = max(tot["n1"], 1)
        top1 = tot["r1"] / n
        cond2 = tot["both"] / max(tot["r1n"], 1)
        return dict(positions=tot["n1"], draft1_top1=round(top1, 4), draft2_top1_given_draft1=round(cond2, 4),
                    chain_tokens_per_step=round(1 + top1 + top1 * cond2, 4),
                    # against the served distribution p (CHAT_PRESET): exact sampling accepts draft 1 with p(draft 1)
                    draft1_served_acceptance=round(tot["accept"] / n, 4), served_ceiling=round(tot["ceiling"] / n, 4),
                    draft1_is_served_mode=round(tot["mode"] / n, 4), reply_token_is_served_mode=round(tot["sampled_mode"] / n, 4))

    if a.eval:
        from safetensors.torch import load_file
        hf, hi, hoffs = features(["heldout-gguf-chat"])
        drafter.load_state_dict({k: v.float() for k, v in load_file(a.eval).items()})
        if a.int4:  # every linear as the compiled int4 product would hold it (GGUF Q4_1-style groups of 32)
            from medusa_core.quant.layers import Int4Linear

            for m in (drafter.fc, drafter.q, drafter.k, drafter.v, drafter.o, drafter.g, drafter.u, drafter.d):
                m.weight.data = Int4Linear.quantize(m.weight.data).dequantized()
        for prm in list(model.parameters()) + list(drafter.parameters()):
            prm.requires_grad_(False)
        res = {}
        for win in a.windows:
            drafter.window = win
            res[win] = evaluate(hf, hi, hoffs)
            log(f"window {win}: {res[win]}")
        print(json.dumps({"eval": a.eval, "int4": a.int4, "backbone": f"{a.quantization or 'float32'} on {a.device}", "windows": res}))
        return
    names = [f"{split}-gguf-{setting}" for setting in ("chat", "greedy") if setting == "chat" or a.with_greedy
             for split in TRAIN_SPLITS[: a.train_rounds]]
    files = [n for n in names if replies_file(n).exists()]
    if len(files) < len(names):
        log(f"no replies for {', '.join(n for n in names if n not in files)}: trained without them")
    t1 = time.time()
    tf, ti, toffs = features(files)
    hf, hi, hoffs = features(["heldout-gguf-chat"])
    log(f"features: {len(toffs)} training sequences ({len(tf)} tokens), {len(hoffs)} held-out, {time.time() - t1:.0f} s")

    log(f"before training, held-out: {evaluate(hf, hi, hoffs)}")
    for n, q in drafter.named_parameters():  # "" begins every name: without --train-only, every parameter
        q.requires_grad_(n.startswith(tuple(a.train_only or [""])))
    trainable = [q for q in drafter.parameters() if q.requires_grad]
    if not trainable:
        raise SystemExit(f"--train-only {a.train_only}: no such parameters (the drafter's: {[n for n, _ in drafter.named_parameters()]})")
    opt = torch.optim.AdamW(trainable, lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    tb = batches(toffs)
    g = torch.Generator().manual_seed(0)
    per_epoch = len(tb)
    planned = int(a.epochs * per_epoch)
    step, t2, warm = 0, time.time(), 100
    if a.deadline:
        a.budget = max(10.0, min(a.budget, a.deadline - time.time() - 45))
        log(f"training budget {a.budget:.0f} s")
    stop_at = t2 + a.budget + 5
    history = []
    while step < planned:
        for k in torch.randperm(per_epoch, generator=g).tolist():
            if step >= planned or time.time() > stop_at:
                planned = step
                break
            lr = a.lr * min(1, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1, step / planned))))
            for pg in opt.param_groups:
                pg["lr"] = lr
            loss, s = run(*assemble(tf, ti, tb[k]), train=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            step += 1
            if step % 200 == 0 or step == planned:
                history.append(dict(step=step, **{k2: round(v, 4) for k2, v in s.items() if k2 in ("ce1", "ce2", "reg")},
                                    top1=round(s["r1"] / max(s["n1"], 1), 3)))
                log(f"step {step}/{planned} {history[-1]}")
    log(f"trained {step} steps in {time.time() - t2:.0f} s")
    held = evaluate(hf, hi, hoffs)
    train_eval = evaluate(tf, ti, toffs, limit=40)
    result = dict(heldout=held, train_sample=train_eval, steps=step, epochs=round(step / per_epoch, 3),
                  training_files=files, training_sequences=len(toffs), training_tokens=len(tf), seconds=round(time.time() - t0),
                  config=vars(a), device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", history=history)
    log(json.dumps({k: v for k, v in result.items() if k != "history"}))
    os.makedirs(a.out, exist_ok=True)
    with open(f"{a.out}/eagle_probe.json", "w") as fh:
        json.dump(result, fh, indent=1)
    from safetensors.torch import save_file

    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}, f"{a.out}/eagle_drafter.safetensors")


if __name__ == "__main__":
    main()
