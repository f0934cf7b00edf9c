"""Sampling settings and the logits processors applied at every tree node (paper 2.3.1, with HF semantics).

``SamplingConfig`` holds what shapes the distribution a reply is drawn from: temperature, top-k, top-p,
min-p and the repetition penalty, with the meaning Hugging Face ``generate`` gives them.
``NodeProcessors`` applies transformers' own processor classes to a batch of rows, each row with its
own prefix: in a Medusa step the rows are the N tree nodes, and the prefix of node i is the context
plus i's ancestors in the tree, root and i included. Greedy, typical and exact verification then
judge every candidate by the processed distribution *given that candidate's own prefix*, so a
repetition penalty sees the tokens earlier in the same path, as it would in plain decoding.

The order is ``generate``'s (``GenerationMixin._get_logits_processor``, transformers 5.x): the
repetition penalty (always applied), then, when sampling only, temperature, top-k, top-p, min-p.
Top-p runs through ``NucleusWarper``, HF's class with a fast path for a batch of rows.
Greedy decoding is the argmax of the penalised logits, as ``generate(do_sample=False)``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
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


class NucleusWarper(TopPLogitsWarper):
    """HF's ``TopPLogitsWarper`` (keeps the tokens with less than ``top_p`` of the mass above them) with a
    fast path: HF sorts the whole vocabulary, 3–4 ms a row for SmolLM2's 49,152 tokens on this
    project's CPU, and a tree step processes every node's row. When the ``candidates`` most likely
    tokens of every row hold at least ``top_p`` of the mass, the nucleus lies among them, so a partial
    ``topk`` (0.04 ms a row) finds the same kept set; otherwise HF's own sort decides. The kept scores
    are the input's unchanged, so the result equals HF's wherever the kept sets agree (they can differ
    only when a token's mass above it is within float rounding of ``top_p``).
    """

    def __init__(self, top_p: float, candidates: int = 64):
        super().__init__(top_p)
        self.candidates = candidates

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` [M, V] with -inf outside each row's nucleus."""
        top, index = scores.topk(min(self.candidates, scores.shape[-1]), dim=-1)  # [M, c] most likely first
        probs = (top - scores.logsumexp(dim=-1, keepdim=True)).exp()  # [M, c]
        above = probs.cumsum(dim=-1) - probs  # [M, c] mass of the more likely tokens
        if bool((above[:, -1] + probs[:, -1] < self.top_p).any()):  # host sync; the nucleus may reach further
            return super().__call__(input_ids, scores)
        keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, index, above < self.top_p)
        return scores.masked_fill(~keep, self.filter_value)


#: The chat preset of the app and the benchmark when the model's generation config sets no sampling
#: values: SmolLM2's model card recommends T = 0.2, top-p 0.9; the penalty is measured (README, "Defaults").
CHAT_PRESET = SamplingConfig(temperature=0.2, top_p=0.9, repetition_penalty=1.1)
#: Medusa's verification with the chat preset (``SAMPLING_MODES``), chosen by measurement (README, "Defaults").
CHAT_SAMPLING = "exact"


class NodeProcessors:
    """A ``SamplingConfig`` as transformers processors, applied to rows that each have their own prefix.

    Args:
        config: the settings; greedy applies only the repetition penalty (as ``do_sample=False``).
    """

    def __init__(self, config: SamplingConfig):
        self.config = config
        self.penalty = (
            RepetitionPenaltyLogitsProcessor(float(config.repetition_penalty)) if config.repetition_penalty != 1 else None
        )
        self.warpers: list[LogitsProcessor] = []
        if not config.greedy:
            self.warpers.append(TemperatureLogitsWarper(float(config.temperature)))
            if config.top_k > 0:
                self.warpers.append(TopKLogitsWarper(int(config.top_k)))
            if config.top_p < 1:
                self.warpers.append(NucleusWarper(float(config.top_p)))
            if config.min_p > 0:
                self.warpers.append(MinPLogitsWarper(float(config.min_p)))

    @property
    def needs_prefix(self) -> bool:
        """True when the result depends on the prefix (a repetition penalty is on)."""
        return self.penalty is not None

    def __call__(self, logits: torch.Tensor, prefix_ids: torch.Tensor | None) -> torch.Tensor:
        """Processed scores of ``logits`` [M, V]: penalised (given ``prefix_ids`` [M, L], each row's
        prefix; only read when ``needs_prefix``), then warped when sampling. Greedy with no penalty
        returns ``logits`` unchanged; otherwise float32 [M, V], -inf where a filter removed a token.
        softmax of the result is the distribution sampling draws from (``generate(do_sample=True)``).
        """
        if self.penalty is None and not self.warpers:
            return logits
        scores = logits.float()
        if self.penalty is not None:
            scores = self.penalty(prefix_ids, scores)
        for warper in self.warpers:
            scores = warper(None, scores)  # warpers read only the scores
        return scores


def tree_prefixes(context: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depth: int) -> torch.Tensor:
    """Each tree node's prefix as ids, for a repetition penalty: ``[N, C + D + 1]``.

    Row i is ``context`` followed by the tokens of node i and its ancestors up to the root; rows of
    shallower nodes repeat the root's token (already in the prefix, so a set-based penalty is unchanged).

    Args:
        context: [C] ids before the root (the prompt and the reply so far; order and repeats do not matter).
        tokens: [N] token of every node, root first.
        parents: [N] parent node index of every node (-1 for the root).
        depth: D, the deepest node's depth.
    """
    node = torch.arange(tokens.shape[0], device=tokens.device)  # [N]
    up = parents.clamp(min=0)  # [N] the root is its own parent
    chain = [node]
    for _ in range(depth):
        chain.append(up[chain[-1]])
    ancestors = tokens[torch.stack(chain, dim=1)]  # [N, D + 1]
    return torch.cat([context.view(1, -1).expand(tokens.shape[0], -1), ancestors], dim=1)
