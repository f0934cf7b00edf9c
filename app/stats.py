"""Session statistics: one row per decoding step, the summary the page shows, and the CSV export.

Pure functions over ``StepRow`` lists. Definitions (Medusa paper, section 3):

- *acceleration rate*: tokens per decoding step of Medusa replies (plain decoding is 1.0);
- *tokens/s* of a group of steps: tokens / (Σ step latency − Σ prefill), i.e. decoding speed without
  the prompt's prefill, so short and long prompts compare fairly;
- *speedup*: Medusa tokens/s over the tokens/s of the session's baseline (Medusa off) steps;
- *acceptance rate of head k*: the share of the Medusa steps whose tree held a node of head k that kept a token
  proposed by head k (their accepted path reached depth k); none for a head no step's tree reached;
- per *sampling rule* (``StepRecord.sampling``: greedy, typical, exact): the acceleration rate of the
  Medusa steps that used it, so typical and exact acceptance compare side by side;
- per *draft source* (``StepRecord.drafts``: hybrid, heads, ngram): the same, and how many accepted
  tokens the heads and the n-gram lookup proposed.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Sequence

from medusa_core import CHAIN_SOURCES, SamplingConfig, StepRecord

#: The Drafts control's choices: (label, ``generate(drafts=...)`` value), those ``drafts_default`` gives first; the
#: summary names a reply's drafts by the same labels.
DRAFT_CHOICES = [("drafter + corpus", "eagle"), ("heads only", "heads"), ("heads + corpus", "corpus"), ("hybrid (heads + n-gram)", "hybrid"),
                 ("n-gram only", "ngram")]
DRAFT_LABELS = {value: label for label, value in DRAFT_CHOICES}  # a Drafts value -> its label on the page
#: What the tree plot calls a chain's nodes (``node_sources`` "ngram") under each Drafts value that verifies chains.
CHAIN_NAMES = {"hybrid": "n-gram copy", "ngram": "n-gram copy", "corpus": "corpus chain", "eagle": "drafter or corpus chain"}
#: Where a chain's accepted tokens came from, under each Drafts value that verifies chains ("2 from the corpus").
CHAIN_SOURCE_TEXT = {"hybrid": "n-gram", "ngram": "n-gram", "corpus": "the corpus", "eagle": "the drafter or corpus"}


def drafted_from(drafts: str, head_tokens: int, chain_tokens: int, *, count_heads: bool | None = None) -> str:
    """Accepted drafted tokens by source as a reply's drafts make them, e.g. ``"12 from heads, 2 from n-gram"``: the
    heads' count unless the drafts are chains alone (``CHAIN_SOURCES``; ``count_heads`` decides instead when given),
    the chain's where the drafts verify chains (``CHAIN_SOURCE_TEXT``)."""
    source = CHAIN_SOURCE_TEXT.get(drafts)
    heads = drafts not in CHAIN_SOURCES if count_heads is None else count_heads
    return ", ".join(([f"{head_tokens} from heads"] if heads else []) + ([f"{chain_tokens} from {source}"] if source else []))


def verified_heads_tree(tree_name: str) -> bool:
    """Whether a step of this ``tree_name`` verified the heads' tree: not the prefill (``"prefill"``), not the root
    alone near the token limit (``"baseline"``), not a chain alone (``"ngram"``)."""
    return tree_name not in ("prefill", "baseline", "ngram")


@dataclass(frozen=True)
class StepRow:
    """One decoding step as exported to CSV (the field order is the column order)."""

    session_id: str
    reply_index: int  # 0-based, counts every reply of the session (chat and compare runs)
    source: str  # "chat" or "compare"
    step: int  # 0-based step within the reply
    mode: str  # "medusa" or "baseline"
    tree_name: str
    tree_nodes: int  # N, nodes verified this step, root included (1 = plain decoding)
    head_depth: int  # the deepest head with a node in the step's tree (1-based; 0 = none: a chain or the root alone)
    drafts: str  # where candidates came from (medusa_core.DRAFT_SOURCES: heads, hybrid, ngram, corpus, eagle); "" with Medusa off
    temperature: float  # the sampling settings of the reply (medusa_core.SamplingConfig), HF generate semantics
    top_k: int  # 0 = off
    top_p: float  # 1 = off
    min_p: float  # 0 = off
    repetition_penalty: float  # 1 = off
    posterior_threshold: float  # ε
    posterior_alpha: float  # δ
    sampling: str  # the step's rule (medusa_core.SAMPLING_RULES): greedy, sample (baseline), typical or exact
    accepted_tokens: int  # tokens added to the reply this step (the backbone's own + those from heads)
    head_tokens: int  # of which proposed by the heads
    ngram_tokens: int  # of which from a chain: the n-gram lookup's (prompt lookup), the corpus's or the drafter's
    step_latency_ms: float  # includes the prefill on step 0
    prefill_ms: float
    tokens_per_s: float  # accepted_tokens / step latency
    total_tokens: int  # reply tokens so far
    stop_reason: str  # on the reply's last step: eos / max_new_tokens / context / stopped; else ""
    timestamp: str  # ISO 8601, UTC, when the step finished

    @classmethod
    def from_record(
        cls,
        record: StepRecord,
        *,
        session_id: str,
        reply_index: int,
        source: str,
        config: SamplingConfig,
        posterior_threshold: float,
        posterior_alpha: float,
        when: datetime | None = None,
    ) -> "StepRow":
        when = when or datetime.now(timezone.utc)
        return cls(
            session_id=session_id,
            reply_index=reply_index,
            source=source,
            step=record.step,
            mode=record.mode,
            tree_name=record.tree_name,
            tree_nodes=record.tree_nodes,
            head_depth=max(record.node_heads, default=-1) + 1,
            drafts=record.drafts,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            min_p=config.min_p,
            repetition_penalty=config.repetition_penalty,
            posterior_threshold=posterior_threshold,
            posterior_alpha=posterior_alpha,
            sampling=record.sampling,
            accepted_tokens=len(record.token_ids),
            head_tokens=record.head_tokens,
            ngram_tokens=record.ngram_tokens,
            step_latency_ms=round(record.latency_s * 1e3, 4),
            prefill_ms=round(record.prefill_s * 1e3, 4),
            tokens_per_s=round(record.tokens_per_s, 3),
            total_tokens=record.total_tokens,
            stop_reason=record.stop_reason or "",
            timestamp=when.isoformat(timespec="milliseconds"),
        )


CSV_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(StepRow))


def write_csv(rows: Iterable[StepRow], path: Path) -> Path:
    """Write ``rows`` with a header line to ``path`` (parents created); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    return path


def decode_tokens_per_s(rows: Sequence[StepRow]) -> float | None:
    """Tokens per second of the decoding steps of ``rows`` (step 0, the prefill, and its first token
    left out); None when there is no decoding time."""
    decode = [r for r in rows if r.step > 0]
    seconds = sum(r.step_latency_ms for r in decode) / 1e3
    return sum(r.accepted_tokens for r in decode) / seconds if seconds > 0 else None


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and up to ``window - 1`` values before it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


@dataclass(frozen=True)
class Summary:
    """What the summary panel shows about a session's steps."""

    medusa_steps: int
    baseline_steps: int
    acceleration_rate: float | None  # tokens per Medusa step
    medusa_step_ms: float | None  # mean Medusa step latency without prefill
    baseline_step_ms: float | None
    medusa_tokens_per_s: float | None
    baseline_tokens_per_s: float | None
    speedup: float | None  # medusa / baseline tokens per second
    head_acceptance: tuple[float | None, ...]  # heads 1..K, each over the steps whose tree held its nodes (None: no
    # step's did); empty when no step verified the heads' tree
    acceleration_by_sampling: tuple[tuple[str, int, float], ...]  # (rule, Medusa steps, tokens / step), first use first
    acceleration_by_drafts: tuple[tuple[str, int, float], ...] = ()  # (draft source, Medusa steps, tokens / step)
    head_tokens: int = 0  # accepted tokens the heads proposed, over the Medusa steps
    ngram_tokens: int = 0  # accepted tokens from chains (n-gram lookup, corpus, drafter)


def summarize(rows: Sequence[StepRow], num_heads: int) -> Summary:
    """Summary of a session's decoding steps (prefills, tree ``"prefill"``, left out). A Medusa reply's steps
    near its token limit or the context's end verify the root alone (tree ``"baseline"``) and count as neither; a
    step that verifies the root alone by the method's own choice (no chain the drafter or the lookup was sure of,
    no head node reaching τ) is a Medusa step. Head acceptance is over the steps that verified the heads' tree
    (not a chain alone, tree ``"ngram"``): head k's over those whose tree held a node of head k (``head_depth``); None
    for a head that no step's tree reached (a tree shallower than the heads: its rate is unknown, not 0)."""
    medusa = [r for r in rows if r.mode == "medusa" and r.tree_name not in ("prefill", "baseline")]
    with_heads = [r for r in medusa if verified_heads_tree(r.tree_name)]
    baseline = [r for r in rows if r.mode == "baseline" and r.step > 0]
    medusa_speed, baseline_speed = decode_tokens_per_s(medusa), decode_tokens_per_s(baseline)
    return Summary(
        medusa_steps=len(medusa),
        baseline_steps=len(baseline),
        acceleration_rate=sum(r.accepted_tokens for r in medusa) / len(medusa) if medusa else None,
        medusa_step_ms=_mean_step_ms(medusa),
        baseline_step_ms=_mean_step_ms(baseline),
        medusa_tokens_per_s=medusa_speed,
        baseline_tokens_per_s=baseline_speed,
        speedup=medusa_speed / baseline_speed if medusa_speed and baseline_speed else None,
        head_acceptance=tuple(_acceptance([r for r in with_heads if r.head_depth >= k], k) for k in range(1, num_heads + 1))
        if with_heads
        else (),
        acceleration_by_sampling=_acceleration_by(medusa, "sampling"),
        acceleration_by_drafts=_acceleration_by(medusa, "drafts"),
        head_tokens=sum(r.head_tokens for r in medusa),
        ngram_tokens=sum(r.ngram_tokens for r in medusa),
    )


def _acceptance(rows: Sequence[StepRow], k: int) -> float | None:
    """Share of ``rows`` that kept a token of head ``k`` (1-based); None without rows."""
    return sum(r.head_tokens >= k for r in rows) / len(rows) if rows else None


def _acceleration_by(medusa: Sequence[StepRow], field: str) -> tuple[tuple[str, int, float], ...]:
    """(value of ``field``, steps, tokens / step) of the steps grouped by that field, first use first."""
    groups: dict[str, list[StepRow]] = {}
    for r in medusa:
        groups.setdefault(getattr(r, field), []).append(r)
    return tuple((value, len(g), sum(r.accepted_tokens for r in g) / len(g)) for value, g in groups.items())


def _mean_step_ms(rows: Sequence[StepRow]) -> float | None:
    return sum(r.step_latency_ms for r in rows) / len(rows) if rows else None


def summary_markdown(summary: Summary) -> str:
    """The summary panel as a Markdown table."""

    def num(x: float | None, fmt: str) -> str:
        return "–" if x is None else format(x, fmt)

    s = summary
    lines = [
        "| | Medusa | baseline |",
        "|---|---|---|",
        f"| steps | {s.medusa_steps} | {s.baseline_steps} |",
        f"| tokens / step (acceleration rate) | {num(s.acceleration_rate, '.2f')} | {'1.00' if s.baseline_steps else '–'} |",
        f"| mean step latency (ms) | {num(s.medusa_step_ms, '.1f')} | {num(s.baseline_step_ms, '.1f')} |",
        f"| tokens / s | {num(s.medusa_tokens_per_s, '.1f')} | {num(s.baseline_tokens_per_s, '.1f')} |",
        "",
        f"**Speedup vs this session's baseline replies: {num(s.speedup, '.2f')}×**"
        + ("" if s.speedup is not None else " (send a reply with Medusa off, or press Compare)"),
    ]
    if s.head_acceptance:
        lines += [
            "",
            "| head | " + " | ".join(str(k) for k in range(1, len(s.head_acceptance) + 1)) + " |",
            "|---|" + "---|" * len(s.head_acceptance),
            "| acceptance rate | " + " | ".join(num(a, ".0%") for a in s.head_acceptance) + " |",
        ]
        unreached = [str(k) for k, a in enumerate(s.head_acceptance, 1) if a is None]
        if unreached:
            lines += ["", f"– : no step's tree held a node of head{'s' if len(unreached) > 1 else ''} {', '.join(unreached)} "
                          "(the tree in use is shallower)"]
    if s.acceleration_by_sampling:
        lines += [
            "",
            "Tokens / step by sampling rule: "
            + " · ".join(f"**{rule}** {rate:.2f} ({n} steps)" for rule, n, rate in s.acceleration_by_sampling),
            "",
            "Tokens / step by drafts: "
            + " · ".join(f"**{DRAFT_LABELS.get(drafts, drafts)}** {rate:.2f} ({n} steps)" for drafts, n, rate in s.acceleration_by_drafts),
            "",
            f"Accepted beyond the backbone's own token: **{s.head_tokens}** from the heads, "
            f"**{s.ngram_tokens}** from chains (n-gram, corpus or drafter)",
        ]
    return "\n".join(lines)
