"""Plotly figures of the live view: one step's candidate tree (paper 2.1.2, Figure 2) and the session's
per-step speed. Pure functions of ``StepRecord`` / ``StepRow`` data; they know nothing of Gradio.

Figures are built as plain plotly JSON (``Figure``), not ``plotly.graph_objects``: validating a
graph object costs 30–100 ms on a small CPU, which would slow generation at every redraw. The tests
check every figure against plotly's schema instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from medusa_core import StepRecord

from .stats import CHAIN_NAMES, StepRow, drafted_from, rolling_mean

ACCEPTED = "#d62728"  # the accepted path: strong red, used for nothing else
BACKBONE = "#444444"  # the root: the backbone's own token
NGRAM = "#e6550d"  # n-gram copies (prompt lookup), drawn as diamonds
HEAD_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22")
MODE_COLOURS = {"medusa": "#1f77b4", "baseline": "#ff7f0e"}
ROLLING_WINDOW = 8
LABEL_PX = 12  # vertical room one node label needs (11 px text)
TRANSPARENT = "rgba(0,0,0,0)"  # figure backgrounds: the page's own (light or dark) shows through
GRID = "rgba(128,128,128,0.25)"  # readable on light and dark backgrounds
MAX_MARKERS = 150  # per-step dots for the session's latest steps only: every SVG dot costs the browser a redraw
WHOLE_TICKS = 12  # sessions of at most this many steps get a tick at every step (plotly would tick halves)


@dataclass(frozen=True)
class Figure:
    """A plotly figure as plain data. ``gr.Plot`` takes it like a plotly figure (it calls ``to_json``)."""

    data: list[dict[str, Any]]
    layout: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"data": self.data, "layout": self.layout}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def empty_figure(message: str, height: int = 300) -> Figure:
    """A blank figure with a centred message."""
    return Figure(
        data=[],
        layout=dict(
            height=height,
            xaxis=dict(visible=False),
            yaxis=dict(visible=False),
            margin=dict(l=10, r=10, t=30, b=10),
            paper_bgcolor=TRANSPARENT,
            plot_bgcolor=TRANSPARENT,
            annotations=[dict(text=message, showarrow=False, font=dict(size=14, color="#888"), x=0.5, y=0.5, xref="paper", yref="paper")],
        ),
    )


def tree_layout(parents: Sequence[int]) -> tuple[list[int], list[float]]:
    """(x, y) of every node: x = depth, leaves stacked top-down in rank order, a parent at its children's mean.

    ``parents`` is in tree-buffer order (root first, parents before children, siblings by rank).
    """
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    depth = [0] * n
    for i in range(1, n):
        children[parents[i]].append(i)
        depth[i] = depth[parents[i]] + 1
    y = [0.0] * n
    next_leaf = 0

    def place(i: int) -> None:  # recursion depth ≤ number of heads
        nonlocal next_leaf
        if not children[i]:
            y[i] = -float(next_leaf)
            next_leaf += 1
            return
        for c in children[i]:
            place(c)
        y[i] = sum(y[c] for c in children[i]) / len(children[i])

    place(0)
    return depth, y


def shown_labels(x: Sequence[int], y: Sequence[float], priority: Sequence[int], min_gap: float) -> set[int]:
    """Nodes whose labels fit: taken in ``priority`` order, a label is kept when no kept label in the
    same column (depth) is closer than ``min_gap`` (in y units). The others show on hover only."""
    kept: dict[int, list[float]] = {}
    shown = set()
    for i in priority:
        column = kept.setdefault(x[i], [])
        if all(abs(y[i] - other) >= min_gap for other in column):
            column.append(y[i])
            shown.add(i)
    return shown


EMPTY_TREE = "Each step's candidate tree<br>appears here while a reply streams"


def tree_figure(record: StepRecord, labels: Sequence[str], height: int = 380) -> Figure:
    """One step's candidate tree: nodes by depth with their token text, coloured by source: the backbone's
    root, head k (paler for lower-ranked candidates) or a chain's draft (orange diamonds, named by the reply's drafts:
    an n-gram copy from the context, the corpus's chain, or the drafter's or the corpus's chain, ``CHAIN_NAMES``); the
    accepted path in red; hover shows token id, source (head k rank r / the chain's name) and status.
    Exact sampling steps also mark the candidates tried and rejected with an ✕ (``record.node_status``).

    Labels that would overlap (a 64-node tree has ~40 leaves) are left to the hover, the accepted
    path's first; the legend shows plain head markers, the accepted nodes' red rings are a separate,
    unlisted trace. ``labels`` [N] is the display text of every node's token.
    """
    parents = record.node_parents
    x, y = tree_layout(parents)
    path = list(record.accepted_nodes[: 1 + record.draft_tokens])  # nodes cut at EOS / the token limit are not in the reply
    accepted = set(path)
    status = record.node_status or tuple("accepted" if i in accepted else "not accepted" for i in range(record.tree_nodes))
    margin = dict(l=50, r=10, t=60, b=80)
    span = max(y) - min(y)
    min_gap = LABEL_PX * span / (height - margin["t"] - margin["b"]) if span else 0.0
    priority = sorted(range(record.tree_nodes), key=lambda i: (i not in accepted, record.node_ranks[i], x[i], -y[i]))
    labelled = shown_labels(x, y, priority, min_gap)
    edge_x: list[float | None] = []
    edge_y: list[float | None] = []
    for i in range(1, record.tree_nodes):
        edge_x += [x[parents[i]], x[i], None]
        edge_y += [y[parents[i]], y[i], None]
    data: list[dict[str, Any]] = [
        dict(type="scatter", x=edge_x, y=edge_y, mode="lines", line=dict(color="#c8c8c8", width=1), hoverinfo="skip", showlegend=False),
        dict(type="scatter", x=[x[i] for i in path], y=[y[i] for i in path], mode="lines", line=dict(color=ACCEPTED, width=4), hoverinfo="skip", name="accepted path"),
    ]
    sources = record.node_sources or ("root",) + ("head",) * (record.tree_nodes - 1)
    chain = CHAIN_NAMES.get(record.drafts, "n-gram copy")
    # One trace per source: the root (head -1), each head (0-based; shown 1-based, as in the paper), n-gram copies.
    groups = sorted({(sources[i] == "ngram", record.node_heads[i]) for i in range(record.tree_nodes)})
    for ngram, head in groups:
        nodes = [i for i in range(record.tree_nodes) if (sources[i] == "ngram", record.node_heads[i]) == (ngram, head)]
        where = [chain if ngram else _source_text(record.node_heads[i], record.node_ranks[i]) for i in nodes]
        data.append(
            dict(
                type="scatter",
                x=[x[i] for i in nodes],
                y=[y[i] for i in nodes],
                mode="markers+text",
                name=chain if ngram else "backbone" if head < 0 else f"head {head + 1}",
                text=[_short(labels[i]) if i in labelled else "" for i in nodes],
                textposition="middle right",
                textfont=dict(size=11, color=[ACCEPTED if i in accepted else "#333333" for i in nodes]),
                marker=dict(
                    symbol=["x" if status[i] == "rejected" else "diamond" if ngram else "circle" for i in nodes],
                    size=10,
                    color=NGRAM if ngram else BACKBONE if head < 0 else HEAD_COLOURS[head % len(HEAD_COLOURS)],
                    opacity=[1.0 if i in accepted else max(0.3, 0.9 - 0.15 * record.node_ranks[i]) for i in nodes],
                    line=dict(color="white", width=1),
                ),
                customdata=[[labels[i], record.node_token_ids[i], w, record.node_ranks[i], i, status[i]] for i, w in zip(nodes, where)],
                hovertemplate="token %{customdata[0]} (id %{customdata[1]})<br>%{customdata[2]}<br>%{customdata[5]}<extra></extra>",
            )
        )
    data.append(  # red rings on the accepted nodes, kept out of the legend
        dict(
            type="scatter", x=[x[i] for i in path], y=[y[i] for i in path], mode="markers", showlegend=False, hoverinfo="skip",
            marker=dict(size=14, color=TRANSPARENT, line=dict(color=ACCEPTED, width=3)),
        )
    )
    added, kept = len(record.token_ids), record.draft_tokens
    cut = record.accept_length - kept
    where = "after EOS" if record.stop_reason == "eos" else "at the token limit"
    # the prefill (step 0) names every source's count, 0 each
    counts = drafted_from(record.drafts, record.head_tokens, record.ngram_tokens, count_heads=True if record.step == 0 else None)
    # the prefill verifies no tree; a hybrid step with a long chain verifies the chain alone (tree "ngram")
    drafts = " + n-gram" if record.drafts == "hybrid" and record.step > 0 and record.tree_name != "ngram" else ""
    name = "chain" if record.tree_name == "ngram" else record.tree_name  # a chain verified alone
    title = (
        f"step {record.step} · {name}{drafts} ({record.tree_nodes} node{'' if record.tree_nodes == 1 else 's'})<br>"
        f"+{added} token{'' if added == 1 else 's'} ({counts}{f'; {cut} cut {where}' if cut else ''})"
        f" · {record.sampling}"
    )
    return Figure(
        data=data,
        layout=dict(
            title=dict(text=title, font=dict(size=13), x=0.01, xanchor="left", y=0.97, yref="container", yanchor="top"),
            height=height,
            margin=margin,
            xaxis=dict(
                title=dict(text="depth (head k proposes depth k)" if "head" in sources else "depth (draft d of the chain)", standoff=4),
                tickmode="linear", dtick=1,
                range=[-0.3, max(x) + 0.9], zeroline=False, gridcolor=GRID,
            ),
            yaxis=dict(title=dict(text="rank: best first ↓"), showticklabels=False, showgrid=False, zeroline=False),
            legend=dict(orientation="h", x=0, y=-0.22, yanchor="top"),
            paper_bgcolor=TRANSPARENT,
            plot_bgcolor=TRANSPARENT,
            uirevision="tree",
        ),
    )


def _source_text(head: int, rank: int) -> str:
    """A root's or a head's node's source for its hover: ``"backbone (root)"`` or ``"head 2 rank 0"`` (1-based head)."""
    return "backbone (root)" if head < 0 else f"head {head + 1} rank {rank}"


def _short(label: str, limit: int = 8) -> str:
    """A node label short enough not to run into the next depth's column."""
    return label if len(label) <= limit else label[: limit - 1] + "…"


def speed_figure(rows: Sequence[StepRow], height: int = 300) -> Figure:
    """Session steps in order: tokens/s per step (dots, for the latest ``MAX_MARKERS`` steps) with a
    rolling mean per reply (lines) on top, tokens accepted per step (a stepped line) below; Medusa and
    baseline steps in different colours. Lines are one SVG path each, so the figure redraws fast.
    Step 0 of each reply, the prompt's prefill and its first token, is left out: it is not a decoding
    step (the reply's stats line gives it as TTFT)."""
    if not rows:
        return empty_figure("tokens/s per step appear here<br>once a reply streams", height)
    data: list[dict[str, Any]] = []
    for mode in ("medusa", "baseline"):
        idx = [i for i, r in enumerate(rows) if r.mode == mode and r.step > 0]
        if not idx:
            continue
        colour = MODE_COLOURS[mode]
        dots = [i for i in idx if i >= len(rows) - MAX_MARKERS]
        line_x: list[int | None] = []
        mean_y: list[float | None] = []
        tokens_y: list[int | None] = []
        for reply in _replies(rows, idx):  # one line per reply, with a gap between replies
            line_x += [*reply, None]
            mean_y += [*rolling_mean([rows[i].tokens_per_s for i in reply], ROLLING_WINDOW), None]
            tokens_y += [*(rows[i].accepted_tokens for i in reply), None]
        data += [
            dict(
                type="scatter", x=dots, y=[rows[i].tokens_per_s for i in dots], mode="markers", name=f"{mode} tokens/s",
                marker=dict(color=colour, size=4, opacity=0.5),
                customdata=[[rows[i].reply_index, rows[i].step] for i in dots],
                hovertemplate="reply %{customdata[0]}, step %{customdata[1]}<br>%{y:.1f} tokens/s<extra></extra>",
            ),
            dict(
                type="scatter", x=line_x[:-1], y=mean_y[:-1], mode="lines",
                name=f"{mode} rolling mean ({ROLLING_WINDOW} steps)", line=dict(color=colour, width=2), hoverinfo="skip",
            ),
            dict(
                type="scatter", x=line_x[:-1], y=tokens_y[:-1], mode="lines", name=f"{mode} tokens/step",
                line=dict(color=colour, width=1.5, shape="hv"), showlegend=False, xaxis="x2", yaxis="y2",
            ),
        ]
    return Figure(
        data=data,
        layout=dict(
            height=height,
            margin=dict(l=60, r=10, t=50, b=40),
            legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom"),
            xaxis=dict(anchor="y", matches="x2", showticklabels=False, gridcolor=GRID),
            yaxis=dict(domain=[0.42, 1.0], title=dict(text="tokens/s"), rangemode="tozero", gridcolor=GRID),
            xaxis2=dict(anchor="y2", title=dict(text="session step"), gridcolor=GRID, **({"dtick": 1} if len(rows) <= WHOLE_TICKS else {})),
            yaxis2=dict(domain=[0.0, 0.34], title=dict(text="tokens/step"), rangemode="tozero", dtick=1, gridcolor=GRID),
            bargap=0.1,
            paper_bgcolor=TRANSPARENT,
            plot_bgcolor=TRANSPARENT,
            uirevision="speed",
        ),
    )


def _replies(rows: Sequence[StepRow], idx: list[int]) -> list[list[int]]:
    """``idx`` (positions in ``rows``) split into runs of the same reply."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and rows[runs[-1][-1]].reply_index == rows[i].reply_index:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
