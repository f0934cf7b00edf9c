"""Sampling settings and the logits processors applied at every tree node (paper 2.3.1, with HF semantics).

``SamplingConfig`` holds what shapes the distribution a reply is drawn from: temperature, top-k, top-p,
min-p and the repetition penalty, with the meaning Hugging Face ``generate`` gives them.
``NodeProcessors`` applies them, equal to transformers' own processor classes, to a batch of rows,
each row with its own prefix: in a Medusa step the rows are the N tree nodes, and the prefix of node i is the context
plus i's ancestors in the tree, root and i included. Greedy, typical and exact verification then
judge every candidate by the processed distribution *given that candidate's own prefix*, so a
repetition penalty sees the tokens earlier in the same path, as it would in plain decoding.

The order is ``generate``'s (``GenerationMixin._get_logits_processor``, transformers 5.x): the
repetition penalty (always applied), then, when sampling only, temperature, top-k, top-p, min-p.
The filters decide on each row's most likely tokens (a partial ``topk``) and fall back to HF's classes
where the kept set may reach past them; every row of a tree step at once.
Greedy decoding is the argmax of the penalised logits, as ``generate(do_sample=False)``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinPLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def _check(value: Any, name: str, allowed: str, ok: Any) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or math.isnan(value) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SamplingConfig:
    """What a reply is drawn from; HF ``generate`` semantics. The defaults are greedy with nothing else on.

    Raises ``ValueError`` naming the field, the value and the allowed range for a value outside it.
    """

    temperature: float = 0.0  # 0 = greedy (argmax); > 0: logits / T, then the filters below (TemperatureLogitsWarper)
    top_k: int = 0  # keep the k most likely tokens; 0 = off (HF's GenerationConfig default is 50: pass it explicitly)
    top_p: float = 1.0  # nucleus: keep the most likely tokens up to this cumulative mass; 1 = off (TopPLogitsWarper)
    min_p: float = 0.0  # keep tokens whose p >= min_p × the top token's p; 0 = off (MinPLogitsWarper)
    repetition_penalty: float = 1.0  # CTRL penalty on every token already in the prefix, prompt included; 1 = off

    def __post_init__(self) -> None:
        _check(self.temperature, "temperature", "a finite number >= 0 (0 = greedy)", lambda v: 0 <= v < math.inf)
        if not (isinstance(self.top_k, numbers.Integral) and not isinstance(self.top_k, bool)) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        _check(self.top_p, "top_p", "in (0, 1] (1 = off)", lambda v: 0 < v <= 1)
        _check(self.min_p, "min_p", "in [0, 1] (0 = off)", lambda v: 0 <= v <= 1)
        _check(self.repetition_penalty, "repetition_penalty", "a finite number > 0 (1 = off, > 1 discourages repeats)",
               lambda v: 0 < v < math.inf)

    @property
    def greedy(self) -> bool:
        """True at temperature 0: the argmax of the penalised logits; top-k, top-p and min-p do nothing."""
        return self.temperature <= 0

    @classmethod
    def from_generation_config(cls, generation_config: Any) -> "SamplingConfig | None":
        """What HF ``generate`` would use by default with a model's ``generation_config``, or None when
        it sets no sampling value (``do_sample`` not true and no repetition penalty).

        Unset values take ``generate``'s defaults (temperature 1, top-k 50, top-p 1, no min-p); with
        ``do_sample`` not true the reply is greedy (the penalty still applies), as in ``generate``.
        """
        def get(name: str, default: Any) -> Any:
            value = getattr(generation_config, name, None)
            return default if value is None else value

        penalty = float(get("repetition_penalty", 1.0))
        if not get("do_sample", False):
            return cls(repetition_penalty=penalty) if penalty != 1.0 else None
        return cls(temperature=float(get("temperature", 1.0)), top_k=int(get("top_k", 50)), top_p=float(get("top_p", 1.0)),
                   min_p=float(get("min_p", 0.0)), repetition_penalty=penalty)

    def describe(self) -> str:
        """A short label of the settings in force, e.g. ``"T 0.2 · top-p 0.9 · rep. 1.1"`` or ``"greedy"``."""
        if self.greedy:
            parts = ["greedy"]  # the filters do nothing at temperature 0
        else:
            parts = [f"T {self.temperature:g}"]
            if self.top_k > 0:
                parts.append(f"top-k {self.top_k}")
            if self.top_p < 1:
                parts.append(f"top-p {self.top_p:g}")
            if self.min_p > 0:
                parts.append(f"min-p {self.min_p:g}")
        if self.repetition_penalty != 1:
            parts.append(f"rep. {self.repetition_penalty:g}")
        return " · ".join(parts)


#: The chat preset of the app and the benchmark when the model's generation config sets no sampling
#: values: SmolLM2's model card recommends T = 0.2, top-p 0.9; the penalty is measured (README, "Defaults").
CHAT_PRESET = SamplingConfig(temperature=0.2, top_p=0.9, repetition_penalty=1.1)
#: Medusa's verification with the chat preset (``SAMPLING_MODES``), chosen by measurement (README, "Defaults").
CHAT_SAMPLING = "exact"


class NodeProcessors:
    """A ``SamplingConfig`` applied to rows that each have their own prefix, equal to transformers' processors.

    The reference is ``generate``'s ``LogitsProcessorList``: ``RepetitionPenaltyLogitsProcessor``,
    then when sampling ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``,
    ``MinPLogitsWarper``. A tree step runs them on every node's row, and HF's top-p sorts all V tokens
    of a row (3–9 ms for SmolLM2's 49,152 on this project's CPU), so the rows take a cheaper route with
    the same result: the penalty and the temperature are the same tensor operations on one copy of the
    logits; the filters decide on the ``candidates`` most likely tokens of every row (``top_slice``),
    all rows of a tree step at once, and where a row's kept tokens could reach past them (top-p: the slice holds less than
    ``top_p`` of the mass; top-k: ties with the k-th score past the slice; min-p alone: the slice's
    last token passes) every row goes through HF's own filters. The kept scores are the input's, so
    the result equals HF's wherever the kept sets agree: everywhere but where a token's share is within
    float rounding of a threshold (the sums run in another order).

    Where the compiled kernels load (``medusa_core.lean``; ``invariant.load_kernel`` sets ``slice_kernel``), the slice
    and its decisions are one call on CPU rows, the same decisions in the same order (``sampling.h`` filter_slice).

    Args:
        config: the settings; greedy applies only the repetition penalty (as ``do_sample=False``).
        candidates: c, the tokens of a row the filters look at first (more when ``top_k`` needs them).
    """

    #: The compiled slice filter (``medusa_core.lean`` ``filter_slice``: in place, False where a row's kept set may
    #: reach past the slice), set by ``invariant.load_kernel`` where the kernels build; None: the ATen ops below.
    slice_kernel: Callable[..., bool] | None = None
    #: The compiled penalty and temperature (``medusa_core.lean`` ``penalise_rows(logits, ids, penalty, temperature)``:
    #: the bits of ``_penalise`` then the division, in one call), set with ``slice_kernel``; None: the ATen ops.
    penalty_kernel: Callable[..., torch.Tensor] | None = None

    def __init__(self, config: SamplingConfig, candidates: int = 64):
        self.config = config
        self.candidates = candidates
        self.penalty = float(config.repetition_penalty)
        self.filters: list[LogitsProcessor] = []  # HF's own filters after the temperature: the fallback
        if not config.greedy:
            if config.top_k > 0:
                self.filters.append(TopKLogitsWarper(int(config.top_k)))
            if config.top_p < 1:
                self.filters.append(TopPLogitsWarper(float(config.top_p)))
            if config.min_p > 0:
                self.filters.append(MinPLogitsWarper(float(config.min_p)))

    @property
    def needs_prefix(self) -> bool:
        """True when the result depends on the prefix (a repetition penalty is on)."""
        return self.penalty != 1

    def __call__(self, logits: torch.Tensor, prefix_ids: torch.Tensor | None) -> torch.Tensor:
        """Processed scores of ``logits`` [M, V]: penalised (given ``prefix_ids`` [M, L], each row's
        prefix; only read when ``needs_prefix``), then warped when sampling. Greedy with no penalty
        returns ``logits`` unchanged; otherwise a contiguous float32 [M, V], -inf where a filter removed
        a token. softmax of the result is the distribution sampling draws from (``generate(do_sample=True)``).
        """
        if not self.needs_prefix and self.config.greedy:
            return logits
        temperature = 0.0 if self.config.greedy else float(self.config.temperature)
        if self.needs_prefix and self.penalty_kernel is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
            scores = self.penalty_kernel(logits, prefix_ids, self.penalty, temperature)  # one call, the same bits
        else:
            scores = self._penalise(logits, prefix_ids) if self.needs_prefix else logits.float()
            if temperature:  # TemperatureLogitsWarper's own operation, in place on our copy
                scores = scores.div_(temperature) if self.needs_prefix else scores / temperature
        if self.config.greedy or not self.filters:
            return scores
        filtered = self._filter_on_slice(scores)
        if filtered is None:  # a row's kept tokens may reach past the slice: HF's filters over all V
            for f in self.filters:
                scores = f(None, scores)  # the warpers read only the scores
            return scores
        return filtered

    def _penalise(self, scores: torch.Tensor, prefix_ids: torch.Tensor) -> torch.Tensor:
        """``RepetitionPenaltyLogitsProcessor``'s result on one contiguous float32 copy [M, V]: each row's
        prefix ids gathered, divided (or multiplied, where negative) by the penalty and written back; ids past
        the LM head's width change nothing, as in HF. An id repeated in a prefix writes the same value, and an
        id past the width writes back what it read from the last column; ``scatter_reduce`` with the minimum
        (penalty > 1: the penalised value is the lower) or the maximum (< 1) makes the write deterministic.
        (HF writes into a padded [M, V + 1] copy and returns a strided view of it: a row-wise ``argmax`` over
        16 such rows took 10 ms on this project's CPU.)"""
        vocab = scores.shape[-1]
        scores = scores.to(torch.float32, copy=True)  # [M, V] the one copy
        ids = prefix_ids.clamp(max=vocab - 1)  # [M, L]
        seen = scores.gather(1, ids)  # [M, L]
        penalised = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)
        penalised = torch.where(prefix_ids < vocab, penalised, seen)  # past the LM head: unchanged
        return scores.scatter_reduce_(1, ids, penalised, reduce="amin" if self.penalty > 1 else "amax")

    def _filter_on_slice(self, scores: torch.Tensor) -> torch.Tensor | None:
        """Top-k, top-p and min-p decided on each row's c most likely tokens, or None when a row's kept
        set may reach past them. ``scores`` [M, V] after the temperature."""
        config, vocab = self.config, scores.shape[-1]
        top_k = min(config.top_k, vocab)
        width = min(max(self.candidates, top_k + 1), vocab)
        if self.slice_kernel is not None and scores.device.type == "cpu" and scores.dtype == torch.float32:
            scores = scores.contiguous()  # our own copy: the kernel filters it in place, or leaves it as it was
            return scores if self.slice_kernel(scores, width, top_k, float(config.top_p), float(config.min_p)) else None
        whole = width == vocab  # the slice is the whole row: nothing lies past it
        top, index = top_slice(scores, width)  # [M, c] most likely first
        keep = torch.ones_like(top, dtype=torch.bool)  # [M, c]
        short = torch.zeros(top.shape[0], dtype=torch.bool, device=top.device)  # [M] the slice may not hold the kept set
        if 0 < top_k < vocab:  # HF removes the scores below the k-th
            kth = top[:, top_k - 1 : top_k]  # [M, 1]
            keep = top >= kth
            short |= (top[:, -1:] >= kth)[:, 0] & (not whole)  # a tie with the k-th may lie past the slice
            whole = True  # otherwise every kept token is in the slice
        if config.top_p < 1:
            # p over the kept tokens: within the slice after top-k, else over the row (HF's softmax).
            probs = torch.softmax(top.masked_fill(~keep, -math.inf), dim=-1) if whole else (
                torch.softmax(scores, dim=-1).gather(1, index))  # [M, c]
            cumulative = probs.cumsum(dim=-1)  # [M, c]
            above = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))  # [M, c] mass of the more likely kept tokens
            keep &= above < config.top_p  # HF keeps a token while the mass below it (1 - above) exceeds 1 - top_p
            short |= (cumulative[:, -1] < config.top_p) & (not whole)
            whole = True
        if config.min_p > 0:
            probs = torch.softmax(top.masked_fill(~keep, -math.inf), dim=-1) if whole else (
                torch.softmax(scores, dim=-1).gather(1, index))  # [M, c] p over the kept tokens
            passes = probs >= config.min_p * probs[:, :1]  # the slice's first token is the most likely
            short |= passes[:, -1] & (not whole)  # min-p alone: a later token may pass too
            keep &= passes
        if bool(short.any()):  # host sync (free on a CPU): the rare row whose kept set may reach further
            return None
        return torch.full_like(scores, -math.inf).scatter_(1, index, top.masked_fill(~keep, -math.inf))


def top_slice(scores: torch.Tensor, width: int, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` largest scores of every row and their indices, most likely first: ``scores.topk(width)``
    in two small steps. A row's ``width`` largest lie in the ``width`` blocks of ``block`` tokens with the
    largest maxima (each of them is at most its own block's maximum), so ``topk`` runs over the block
    maxima and then over those blocks' tokens: a third of ``topk``'s time over 49,152 tokens on a CPU.
    Tied scores may be taken in another order than ``topk``'s (``topk`` promises none).

    Args:
        scores: [M, V] float.
        width: c, 1 <= c <= V.

    Returns (top [M, c] descending, index [M, c] long).
    """
    rows, vocab = scores.shape
    blocks = -(-vocab // block)
    if width * block >= vocab:  # the blocks would hold the whole row anyway
        return scores.topk(width, dim=-1)
    padded = torch.nn.functional.pad(scores, (0, blocks * block - vocab), value=-math.inf) if blocks * block > vocab else scores
    grid = padded.view(rows, blocks, block)  # [M, B, block]
    chosen = grid.amax(dim=-1).topk(width, dim=-1).indices  # [M, c] blocks with the largest maxima
    candidates = grid.gather(1, chosen[..., None].expand(-1, -1, block)).flatten(1)  # [M, c * block]
    top, at = candidates.topk(width, dim=-1)  # [M, c]
    return top, chosen.gather(1, at // block) * block + at % block


def tree_prefixes(context: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """Each tree node's prefix as ids, for a repetition penalty: ``[N, C + D + 1]``.

    Row i is ``context`` followed by the tokens of node i and its ancestors up to the root; rows of
    shallower nodes repeat the root's token (already in the prefix, so a set-based penalty is unchanged).

    Args:
        context: [C] ids before the root (the prompt and the reply so far; order and repeats do not matter).
        tokens: [N] token of every node, root first.
        ancestors: [N, D+1] each node's index, then its ancestors' (``steptree.ancestor_index``; a step's tree
            keeps its own, ``StepTree.ancestors``).
    """
    return torch.cat([context.view(1, -1).expand(tokens.shape[0], -1), tokens[ancestors]], dim=1)
