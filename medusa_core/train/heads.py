"""Medusa-1 head training on a frozen backbone (paper 2.2.1): loss, schedule and a resumable loop.

Loss Σ_k λ_k · CE(head k, token t+k+2) with λ_k = 0.8^k, or with soft targets the cross-entropy to
the frozen backbone's own distribution for that place (self-distillation, paper 2.3.2); AdamW with
linear warm-up and cosine decay.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..export import save_medusa_heads
from ..heads import MedusaHeads
from ..loading import ROOT_KEY

#: Loss weight of head k is LOSS_DECAY ** k (paper 2.2.1, λ_k = 0.8^k).
LOSS_DECAY = 0.8
TRAINER_STATE = "trainer_state.pt"


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
    # softmax over "full" (the whole vocabulary) or "data" (only the tokens that occur as labels;
    # version-2 heads only: the frozen LM head's rows of the other tokens get no gradient anyway,
    # and a 49k-token vocabulary costs 3-4x more on a CPU than the ~12k tokens of English replies)
    vocab: str = "full"
    # soft targets (self-distillation, paper 2.3.2): head k at t learns the backbone's whole
    # distribution for token t+k+2 (its softmax at t+k+1, from the cached state there) instead of
    # one token; needs the shared LM head and collect_positions' layout (a reply's positions in a row)
    soft_targets: bool = False
    # layout "root" (medusa_core.heads): head k also reads R_k · e(root), the embedding of the token
    # chosen after the state (Hydra-style conditioning on what is known at step time); needs roots
    root_conditioned: bool = False


def head_loss(
    logits: torch.Tensor, labels: torch.Tensor, soft: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_k 0.8^k · CE(head k) and each head's top-1 accuracy.

    Args: logits [K, B, V]; labels [B, K] (-100 = ignored); soft [K, B, V]: target distributions
    (rows sum to 1; ``None``: the labels' tokens). The cross-entropy to a soft target is its KL
    divergence plus the target's entropy (paper 2.3.2). Returns (loss [], top1 [K] against labels).
    """
    loss = logits.new_zeros((), dtype=torch.float32)
    top1 = []
    for k in range(logits.shape[0]):
        target = labels[:, k]
        valid = target != -100
        if valid.any():
            if soft is None:
                ce = torch.nn.functional.cross_entropy(logits[k].float(), target, ignore_index=-100)
            else:
                log_q = torch.log_softmax(logits[k][valid].float(), dim=-1)
                ce = -(soft[k][valid] * log_q).sum(-1).mean()
            loss = loss + LOSS_DECAY**k * ce
            top1.append((logits[k].argmax(-1) == target)[valid].float().mean())
        else:
            top1.append(logits.new_zeros((), dtype=torch.float32))
    return loss, torch.stack(top1)


@torch.no_grad()
def backbone_targets(hidden: torch.Tensor, idx: torch.Tensor, lm_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Soft targets: the frozen backbone's distribution for the token each head predicts (paper 2.3.2).

    Head k at row i predicts the token at t+k+2, which the backbone's LM head gives from its state at
    t+k+1: row i+k+1 of ``hidden`` when a reply's positions are in a row (``collect_positions``).
    Args: hidden [M, H]; idx [B] rows; lm_weight [V, H] (the LM head's rows of the training
    vocabulary). Returns [K, B, V] float32 softmax; rows past the end of ``hidden`` repeat its last
    row (those rows have no label for that head and are masked out by ``head_loss``).
    """
    rows = (idx[None, :] + torch.arange(1, num_heads + 1, device=idx.device)[:, None]).clamp(max=len(hidden) - 1)  # [K, B]
    return torch.softmax((hidden[rows].to(lm_weight.dtype) @ lm_weight.T).float(), dim=-1)


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
    roots: torch.Tensor | None = None,
    init: dict[str, torch.Tensor] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[MedusaHeads, dict]:
    """Train K Medusa-1 heads on precomputed positions of a frozen backbone (paper 2.2.1).

    Args:
        hidden: [M, H] final-norm hidden states; labels: [M, K] targets (``collect_positions``).
        roots: [M] the token after each position (``collect_positions(with_roots=True)``); required
            with ``cfg.root_conditioned``, which trains root-conditioned heads (layout "root").
        out: heads folder; checkpoints (heads + ``trainer_state.pt``) go there every
            ``cfg.checkpoint_every`` steps and training resumes from them when ``resume``.
        init: head tensors to start from (a warm start, e.g. the shipped heads' ``medusa_lm_head.safetensors``),
            keyed as ``MedusaHeads.state_dict()`` for ``cfg``'s K heads of L blocks; root-conditioned heads may
            start from plain ones: their ``root_weight`` then starts at zero, so step 0 equals the plain heads.
        device: where the heads train (``"cuda"``: the positions, labels and roots are copied there once; the
            batches, learning-rate schedule and seed are the same as on the CPU); the backbone's LM head and
            embedding, which the heads read, must be there too. The returned heads are on ``device``; the
            saved files hold CPU tensors.

    With ``cfg.vocab == "data"`` the softmax runs over the label vocabulary only (the training
    replies' tokens); the heads are the same module and are evaluated over the whole vocabulary.
    With ``cfg.soft_targets`` head k at row i learns softmax(LM head(hidden[i+k+1])), the backbone's
    distribution for its place (over the same vocabulary), so ``hidden`` must keep each reply's
    positions in a row, as ``collect_positions`` returns them.

    Returns (heads, stats) with the final loss and per-head training top-1 accuracy.
    Raises ``ValueError`` for ``cfg.vocab`` other than "full", or "data" with own projections, and for
    ``cfg.soft_targets`` with own projections, for ``cfg.root_conditioned`` without ``roots`` [M], and for
    an ``init`` whose keys or shapes are not those of ``cfg``'s heads (naming the first difference).
    """
    out = Path(out)
    if cfg.vocab not in ("full", "data") or (cfg.vocab == "data" and not cfg.share_lm_head):
        raise ValueError(f"vocab must be 'full', or 'data' with share_lm_head=True; got {cfg.vocab!r}")
    if cfg.soft_targets and not cfg.share_lm_head:
        raise ValueError("soft_targets needs share_lm_head=True (the targets come from the backbone's LM head)")
    if cfg.root_conditioned and (roots is None or tuple(roots.shape) != (len(hidden),)):
        found = None if roots is None else list(roots.shape)
        raise ValueError(f"root_conditioned heads need roots of shape [{len(hidden)}] (one per position), got {found}")
    torch.manual_seed(cfg.seed)
    device = torch.device(device)
    embedding = backbone.get_input_embeddings() if cfg.root_conditioned else None
    if cfg.share_lm_head:
        lm_head = backbone.get_output_embeddings()
        heads = MedusaHeads(lm_head.in_features, lm_head.out_features, cfg.num_heads, cfg.num_layers, shared_lm_head=lm_head,
                            root_embedding=embedding)
    else:
        heads = MedusaHeads.from_backbone(backbone, cfg.num_heads, cfg.num_layers, root_conditioned=cfg.root_conditioned)
    heads = heads.float().to(device).train()
    if init is not None:
        _warm_start(heads, init)
    weight = None  # [V', H] rows of the frozen LM head with vocab="data"
    if cfg.vocab == "data":
        tokens = labels[labels != -100].unique()  # [V'] the label vocabulary, sorted
        remap = torch.full((heads.vocab_size,), -100, dtype=torch.long)
        remap[tokens] = torch.arange(len(tokens))
        labels = torch.where(labels == -100, labels, remap[labels.clamp(min=0)])
        weight = lm_head.weight.detach()[tokens].float().to(device)
    lm_weight = None  # [V or V', H] the softmax vocabulary's LM head rows, for soft targets
    if cfg.soft_targets:
        lm_weight = weight if weight is not None else lm_head.weight.detach().float().to(device)
    hidden, labels = hidden.to(device), labels.to(device)
    roots = roots.to(device) if roots is not None else None

    def forward(h: torch.Tensor, root: torch.Tensor | None) -> torch.Tensor:  # [B, H] -> [K, B, V] (V' with vocab="data")
        return heads(h, root=root) if weight is None else heads.states(h, root=root) @ weight.T
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    micro = cfg.batch_size // cfg.grad_accum
    total_steps = max(1, int(cfg.epochs * len(hidden) / cfg.batch_size))
    step = resumed_from = 0
    state_file = out / TRAINER_STATE
    if resume and state_file.exists():
        state = torch.load(state_file, map_location=device, weights_only=True)
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["optimizer"])
        step = resumed_from = int(state["step"])
        tqdm.write(f"resuming head training at step {step}/{total_steps}")
    generator = torch.Generator().manual_seed(cfg.seed)
    order = torch.cat([torch.randperm(len(hidden), generator=generator) for _ in range(math.ceil(cfg.epochs) + 1)])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.bf16 else nullcontext()
    bar = tqdm(range(step, total_steps), desc="heads", unit="step", initial=step, total=total_steps)
    loss_value, top1 = float("nan"), torch.zeros(cfg.num_heads)
    t0 = time.time()
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total_steps, cfg)
        for a in range(cfg.grad_accum):
            start = (step * cfg.grad_accum + a) * micro
            idx = order[start : start + micro].to(device)
            with autocast:
                logits = forward(hidden[idx].float(), roots[idx] if cfg.root_conditioned else None)  # [K, B, V]
                soft = backbone_targets(hidden, idx, lm_weight, cfg.num_heads) if cfg.soft_targets else None
            loss, top1 = head_loss(logits, labels[idx], soft)
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
        "softmax_vocabulary": heads.vocab_size if weight is None else int(weight.shape[0]),
        "final_loss": round(loss_value, 4),
        "train_top1_last_batch": [round(a, 4) for a in top1.tolist()],
        "seconds": round(time.time() - t0, 1),
        "config": asdict(cfg),
    }
    return heads, stats


def _warm_start(heads: MedusaHeads, init: dict[str, torch.Tensor]) -> None:
    """Copy ``init`` into ``heads``; only ``root_weight`` may be missing (it keeps its zero initialisation)."""
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(init) - {ROOT_KEY})
    extra = sorted(set(init) - set(expected))
    wrong = sorted(k for k in set(init) & set(expected) if tuple(init[k].shape) != tuple(expected[k].shape))
    if missing or extra or wrong:
        first = (f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}" if extra
                 else f"{wrong[0]!r} of shape {list(init[wrong[0]].shape)}, expected {list(expected[wrong[0]].shape)}")
        raise ValueError(f"init does not fit {heads.num_heads} heads of this configuration: {first}")
    heads.load_state_dict({k: v.float() for k, v in init.items()}, strict=False)


def _checkpoint(heads, opt, step, out, base) -> None:
    save_medusa_heads(heads, out, base_model_name_or_path=base)  # copies each tensor to the CPU
    torch.save({"heads": heads.state_dict(), "optimizer": opt.state_dict(), "step": step}, out / TRAINER_STATE)
