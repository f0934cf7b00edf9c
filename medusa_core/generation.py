"""What ``MedusaModel.generate`` takes and yields: its argument checks (and the model's head temperatures')
and the ``StepRecord`` of each step.

The engine (``model.py``) checks its arguments here before any work and yields these records; UIs
and benchmarks read the records without touching the model.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

from .acceptance import node_status

#: Stop reasons recorded on the last ``StepRecord`` of a reply.
STOP_REASONS = ("eos", "max_new_tokens", "context")
#: Values of ``generate(sampling=...)``: how candidates are verified at temperature > 0.
SAMPLING_MODES = ("typical", "exact")
#: Values of ``StepRecord.sampling``: the rule a step's tokens were chosen by.
SAMPLING_RULES = ("greedy", "sample", "typical", "exact")
#: Values of ``generate(drafts=...)``: where a Medusa step's candidates come from (the heads' tree, n-gram
#: prompt lookup, or both in one tree).
DRAFT_SOURCES = ("hybrid", "heads", "ngram", "corpus", "eagle")
#: The draft sources whose steps verify the root and a chain alone, never the heads' tree (``generate`` ignores ``tree``).
CHAIN_SOURCES = ("ngram", "eagle")


@dataclass(frozen=True)
class StepRecord:
    """Everything a UI needs about one decoding step, without touching the model.

    Node tuples are all of length ``tree_nodes`` (N, root included), in tree-buffer order. Step 0 is
    the prefill: one pass over the prompt that emits the first token at once (so time to first
    token is the prefill's time, as with Hugging Face ``generate``); it verifies no tree
    (``tree_name`` ``"prefill"``, one node: that token). Every later step verifies a tree whose root
    is the token the step before emitted last, and emits the accepted candidates, then the token
    chosen from the last accepted node's logits (the next step's root).

    Attributes:
        step: 0-based step index within the reply; 0 is the prefill.
        mode: ``"medusa"`` or ``"baseline"`` (plain decoding, one token per step).
        tree_name: name of the Medusa tree used; ``"prefill"`` for step 0; ``"baseline"`` for a root-only
            step (baseline mode, or a Medusa step when one token remains or the context is nearly full);
            ``"ngram"`` for a step that verifies the root and an n-gram chain alone (``drafts="ngram"``, a long
            copy of ``"hybrid"``, a corpus chain of ``"corpus"``).
        tree_nodes: N, nodes of the tree verified this step, root included.
        node_token_ids: token id of every node.
        node_parents: parent node index of every node (-1 for the root).
        node_heads: 0-based Medusa head that proposed every node (head k guesses k+2 tokens ahead;
            -1 for the root, the backbone's own token, and for n-gram nodes).
        node_ranks: rank of every node's token in its head's top-k (0 for the root and n-gram nodes).
        node_sources: where every node's token comes from, one of ``steptree.NODE_SOURCES``:
            ``"root"``, ``"head"`` (head ``node_heads[i]``, rank ``node_ranks[i]``) or ``"ngram"`` (copied
            from the context by prompt lookup, or drafted from the model's corpus; a drafted token that a head
            also proposed stays ``"head"``).
        drafts: the reply's ``generate(drafts=...)``, one of ``DRAFT_SOURCES``; ``""`` in baseline mode.
        accepted_nodes: node indices of the accepted path, root first.
        sampling: the rule the step used, one of ``SAMPLING_RULES``: ``"greedy"`` (temperature 0:
            argmax root, candidates must equal the argmax), ``"sample"`` (baseline mode at
            temperature > 0: plain sampling from softmax(logits / T)), ``"typical"`` (sampled root,
            typical acceptance, paper 2.3.1) or ``"exact"`` (rejection sampling over the tree; the
            reply follows the backbone's sampling distribution exactly).
        node_status: ``"exact"`` steps only (else empty): every node's fate in the walk, one of
            ``NODE_STATUSES``: ``"accepted"`` (on the accepted path, root included), ``"rejected"``
            (tried and rejected) or ``"untried"`` (never reached).
        token_ids: tokens added to the reply this step: the tokens of ``accepted_nodes[1:]``, then
            the next root (after cutting at EOS / the token limit); step 0: the first token.
        accept_length: candidates (head or n-gram nodes) accepted this step (before any cut).
        latency_s: wall-clock seconds of the step (synchronised on CUDA); step 0: the prefill.
        prefill_s: seconds of the prompt's prefill (step 0 only, equal to its ``latency_s``; else 0).
        total_tokens: tokens generated so far in the reply, this step included.
        stop_reason: on the last record, one of ``STOP_REASONS``; otherwise None.
    """

    step: int
    mode: str
    tree_name: str
    tree_nodes: int
    node_token_ids: tuple[int, ...]
    node_parents: tuple[int, ...]
    node_heads: tuple[int, ...]
    node_ranks: tuple[int, ...]
    accepted_nodes: tuple[int, ...]
    sampling: str
    token_ids: tuple[int, ...]
    accept_length: int
    latency_s: float
    total_tokens: int
    prefill_s: float = 0.0
    stop_reason: str | None = None
    node_status: tuple[str, ...] = ()
    node_sources: tuple[str, ...] = ()
    drafts: str = ""

    @property
    def draft_tokens(self) -> int:
        """Candidates of this step that are in the reply: ``accept_length`` after the cut at EOS /
        the token limit (the cut drops the next root first, then candidates from the end)."""
        return min(self.accept_length, len(self.token_ids))

    @property
    def head_tokens(self) -> int:
        """Of ``draft_tokens``, those proposed by the heads (all of them when ``node_sources`` is empty)."""
        return self.draft_tokens - self.ngram_tokens

    @property
    def ngram_tokens(self) -> int:
        """Of ``draft_tokens``, those of chains: prompt lookup's, the corpus's or the drafter's (``node_sources`` ``"ngram"``)."""
        if not self.node_sources:
            return 0
        kept = self.accepted_nodes[1 : 1 + self.draft_tokens]
        return sum(self.node_sources[i] == "ngram" for i in kept)

    @property
    def tokens_per_s(self) -> float:
        """Tokens added per second of this step."""
        return len(self.token_ids) / self.latency_s if self.latency_s > 0 else 0.0


def step_record(
    step: int, tree: Any, nodes: tuple[int, ...], token_list: list[int], new_tokens: list[int], latency_s: float, *,
    medusa: bool, rule: str, produced: int, max_new_tokens: int, cur_len: int, drafts: str,
    eos_token_ids: frozenset[int], max_context: int,
) -> StepRecord:
    """The ``StepRecord`` of a step that accepted ``nodes`` of ``tree`` (a ``steptree.StepTree`` whose
    tokens are ``token_list``) and emits ``new_tokens``, cut at the first of ``eos_token_ids`` and at the
    token limit (``produced`` tokens came before); ``cur_len`` tokens are in the cache, and a reply whose
    next root would not fit in ``max_context`` stops with ``"context"``. ``latency_s`` in seconds."""
    stop = None
    for i, t in enumerate(new_tokens):
        if t in eos_token_ids:
            new_tokens, stop = new_tokens[: i + 1], "eos"
            break
    remaining = max_new_tokens - produced
    if len(new_tokens) >= remaining:
        new_tokens = new_tokens[:remaining]
        stop = stop or "max_new_tokens"
    if stop is None and cur_len + 1 > max_context:  # no room left for the next root
        stop = "context"
    return StepRecord(
        step=step,
        mode="medusa" if medusa else "baseline",
        tree_name="prefill" if step == 0 else tree.name,
        tree_nodes=tree.num_nodes,
        node_token_ids=tuple(token_list),
        node_parents=tree.node_parents,
        node_heads=tree.node_heads,
        node_ranks=tree.node_ranks,
        node_sources=tree.node_sources,
        drafts=drafts,
        accepted_nodes=nodes,
        sampling=rule,
        node_status=node_status(tree.node_parents, list(nodes)) if rule == "exact" else (),
        token_ids=tuple(new_tokens),
        accept_length=len(nodes) - 1,
        latency_s=latency_s,
        prefill_s=latency_s if step == 0 else 0.0,
        total_tokens=produced + len(new_tokens),
        stop_reason=stop,
    )


def check_generate_args(
    max_new_tokens: Any, posterior_threshold: Any, posterior_alpha: Any, seed: Any, sampling: Any, drafts: Any
) -> None:
    """Check ``MedusaModel.generate``'s scalar arguments before any work (the sampling settings are
    checked by ``SamplingConfig``).

    Raises ``ValueError`` naming the first bad one and what is allowed: ``max_new_tokens`` an integer
    >= 1 (tokens); ``posterior_threshold`` (ε) and ``posterior_alpha`` (δ) in (0, 1] (paper 2.3.1);
    ``seed`` an integer in [0, 2**63) or None; ``sampling`` one of ``SAMPLING_MODES``; ``drafts`` one of
    ``DRAFT_SOURCES``. Booleans are not accepted as numbers.
    """
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    for name, symbol, value in (("posterior_threshold", "ε", posterior_threshold), ("posterior_alpha", "δ", posterior_alpha)):
        if not _is_real(value) or not 0 < value <= 1:
            why = (
                ": typical acceptance takes a candidate when p > min(ε, δ·exp(-entropy)), "
                "so 0 would accept every candidate, whatever its probability"
                if _is_real(value) and value <= 0
                else ""
            )
            raise ValueError(f"{name} ({symbol}) must be in (0, 1], got {value!r}{why}")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise ValueError(f"seed must be an integer in [0, 2**63) or None (a fresh seed), got {seed!r}")
    if sampling not in SAMPLING_MODES:
        raise ValueError(f"sampling must be one of {', '.join(map(repr, SAMPLING_MODES))}, got {sampling!r}")
    if drafts not in DRAFT_SOURCES:
        raise ValueError(f"drafts must be one of {', '.join(map(repr, DRAFT_SOURCES))}, got {drafts!r}")


def check_head_temperatures(temperatures: Sequence[float] | None, num_heads: int) -> tuple[float, ...]:
    """[K] temperatures as floats, one per head (None: 1.0 each); ``ValueError`` naming a wrong count or value."""
    if temperatures is None:
        return (1.0,) * num_heads
    temperatures = tuple(float(t) for t in temperatures)
    if len(temperatures) != num_heads:
        raise ValueError(f"head_temperatures must hold one temperature per head ({num_heads}), got {len(temperatures)}: {temperatures}")
    for k, t in enumerate(temperatures):
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"head_temperatures must be finite and > 0, got {t} for head {k}")
    return temperatures


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def eos_ids(backbone: Any) -> frozenset[int]:
    """EOS ids as Hugging Face ``generate`` sees them: the generation config's, else the model config's."""
    eos = getattr(getattr(backbone, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(backbone.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))
