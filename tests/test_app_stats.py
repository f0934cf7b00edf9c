"""Tests of app.stats and app.charts on hand-made step records: summary arithmetic, CSV, figures."""

from __future__ import annotations

import csv
import dataclasses

import plotly.graph_objects as go
import pytest

from app.charts import empty_figure, speed_figure, tree_figure, tree_layout
from app.stats import CSV_COLUMNS, StepRow, rolling_mean, summarize, summary_markdown, write_csv
from medusa_core import SamplingConfig, StepRecord, node_status

# A 6-node tree: root 0; head-1 candidates 1 (rank 0) and 2 (rank 1); 3 = [0, 0], 4 = [0, 1], 5 = [0, 0, 0].
PARENTS = (-1, 0, 0, 1, 1, 3)
HEADS = (-1, 0, 0, 1, 1, 2)  # 0-based head index, as medusa_core records it
RANKS = (0, 0, 1, 0, 1, 0)


def record(step=0, accepted=(0, 1, 3), mode="medusa", latency=0.010, prefill=0.0, stop=None, sampling="greedy") -> StepRecord:
    nodes = len(PARENTS) if mode == "medusa" else 1
    status = node_status(PARENTS[:nodes], accepted) if sampling == "exact" else ()
    return StepRecord(
        step=step, mode=mode, tree_name="hand" if mode == "medusa" else "baseline", tree_nodes=nodes,
        node_token_ids=tuple(range(10, 10 + nodes)), node_parents=PARENTS[:nodes], node_heads=HEADS[:nodes],
        node_ranks=RANKS[:nodes], accepted_nodes=accepted, sampling=sampling, node_status=status, token_ids=tuple(10 + i for i in accepted[1:]) + (9,),
        accept_length=len(accepted) - 1, latency_s=latency, total_tokens=len(accepted), prefill_s=prefill, stop_reason=stop,
    )


def row(rec: StepRecord, reply_index=0) -> StepRow:
    return StepRow.from_record(
        rec, session_id="s1", reply_index=reply_index, source="chat", config=SamplingConfig(), posterior_threshold=0.09, posterior_alpha=0.3
    )


def test_step_row_converts_units_and_counts_tokens():
    r = row(record(accepted=(0, 1, 3), latency=0.020, prefill=0.005, stop="eos"))
    assert (r.accepted_tokens, r.head_tokens) == (3, 2)
    assert (r.step_latency_ms, r.prefill_ms) == (20.0, 5.0)
    assert r.tokens_per_s == pytest.approx(150.0)
    assert r.stop_reason == "eos" and r.mode == "medusa" and r.tree_nodes == 6


def test_summary_gives_acceleration_speedup_and_per_head_acceptance():
    prefill = record(0, accepted=(0,), mode="baseline", latency=0.030, prefill=0.030)  # 1 token, no decoding
    rows = [
        row(dataclasses.replace(prefill, mode="medusa", tree_name="prefill")),
        row(record(1, accepted=(0, 1, 3, 5), latency=0.020)),  # 4 tokens
        row(record(2, accepted=(0, 2), latency=0.020)),  # 2 tokens
        row(record(3, accepted=(0,), latency=0.020)),  # 1 token
        row(prefill, reply_index=1),
        *[row(record(i, accepted=(0,), mode="baseline", latency=0.010), reply_index=1) for i in range(1, 5)],
    ]
    s = summarize(rows, num_heads=4)
    assert (s.medusa_steps, s.baseline_steps) == (3, 4)
    assert s.acceleration_rate == pytest.approx(7 / 3)
    assert s.medusa_tokens_per_s == pytest.approx(7 / 0.060)
    assert s.baseline_tokens_per_s == pytest.approx(100.0)
    assert s.speedup == pytest.approx(7 / 0.060 / 100.0)
    assert s.medusa_step_ms == pytest.approx(20.0)
    assert s.head_acceptance[:3] == pytest.approx((2 / 3, 1 / 3, 1 / 3)) and s.head_acceptance[3] is None
    text = summary_markdown(s)
    assert "1.17×" in text and "67%" in text


def test_summary_without_baseline_has_no_speedup_and_the_root_alone_near_the_token_limit_is_left_out():
    # near the token limit (or the context's end) a Medusa reply verifies the root alone, its tree "baseline"
    tail = dataclasses.replace(row(record(2)), tree_name="baseline", tree_nodes=1, accepted_tokens=1, head_tokens=0)
    s = summarize([row(record(1)), tail], num_heads=3)
    assert s.speedup is None and s.medusa_steps == 1 and s.acceleration_rate == 3
    assert "–×" in summary_markdown(s)
    assert summarize([], 4).head_acceptance == ()


def test_steps_that_verify_the_root_alone_by_the_methods_own_choice_count_as_medusa_steps():
    # the drafter unsure of its first draft, or no head node reaching τ: the root alone, mid-reply, is the method
    unsure = dataclasses.replace(row(drafter_record(2)), tree_nodes=1, accepted_tokens=1, head_tokens=0, ngram_tokens=0)
    shaped = dataclasses.replace(row(record(3)), tree_nodes=1, accepted_tokens=1, head_tokens=0)
    s = summarize([row(drafter_record(1)), unsure], num_heads=3)
    assert s.medusa_steps == 2 and s.acceleration_rate == 2.0  # (3 + 1) / 2, as the reply's own stats line says
    s = summarize([row(record(1)), shaped], num_heads=3)
    assert s.medusa_steps == 2 and s.acceleration_rate == 2.0


def test_head_acceptance_is_over_the_steps_that_verified_the_heads_tree_and_absent_without_any():
    drafter = [row(drafter_record(i)) for i in range(1, 4)]
    s = summarize(drafter, num_heads=3)
    assert s.head_acceptance == () and "acceptance rate" not in summary_markdown(s)
    s = summarize(drafter + [row(record(4)), row(record(5, accepted=(0, 1)))], num_heads=3)
    assert s.head_acceptance == pytest.approx((1.0, 0.5, 0.0))  # 2 heads steps: both reached head 1, one head 2


def test_a_head_no_steps_tree_reached_has_no_acceptance_rate_rather_than_zero():
    # the demo's tuned trees at the chat preset verify head 1 alone: heads 2-4 were never verified, not rejected
    head_1_tree = dict(node_parents=PARENTS[:3], node_heads=HEADS[:3], node_ranks=RANKS[:3], node_token_ids=(10, 11, 12), tree_nodes=3)
    steps = [row(dataclasses.replace(record(i, accepted=(0, 1) if i % 2 else (0,)), **head_1_tree)) for i in range(1, 5)]
    assert [r.head_depth for r in steps] == [1] * 4
    s = summarize(steps + [row(record(5, accepted=(0, 1, 3)))], num_heads=4)  # one step of a deeper tree
    assert s.head_acceptance[:3] == pytest.approx((3 / 5, 1.0, 0.0)) and s.head_acceptance[3] is None
    assert "| acceptance rate | 60% | 100% | 0% | – |" in summary_markdown(s)
    assert "no step's tree held a node of head 4" in summary_markdown(s)


def test_rolling_mean_averages_the_last_window_values():
    assert rolling_mean([2, 4, 6, 8], 2) == [2, 3, 5, 7]
    assert rolling_mean([], 3) == []


def test_csv_has_every_column_and_one_row_per_step(tmp_path):
    rows = [row(record(i)) for i in range(3)]
    path = write_csv(rows, tmp_path / "deep" / "s.csv")
    with path.open() as f:
        read = list(csv.DictReader(f))
    assert tuple(read[0]) == CSV_COLUMNS
    assert [r["step"] for r in read] == ["0", "1", "2"]
    required = {"session_id", "reply_index", "step", "mode", "tree_name", "tree_nodes", "temperature", "posterior_threshold",
                "posterior_alpha", "accepted_tokens", "step_latency_ms", "tokens_per_s", "timestamp"}
    assert required <= set(CSV_COLUMNS)


def test_tree_layout_puts_nodes_at_their_depth_and_parents_between_their_children():
    x, y = tree_layout(PARENTS)
    assert x == [0, 1, 1, 2, 2, 3]
    assert y[5] == y[3] == 0.0 and y[4] == -1.0 and y[2] == -2.0  # leaves top-down in rank order
    assert y[1] == (y[3] + y[4]) / 2 and y[0] == (y[1] + y[2]) / 2


def test_tree_figure_is_valid_plotly_and_draws_the_accepted_path_in_red():
    fig = tree_figure(record(accepted=(0, 1, 3)), labels=["r", "a", "b", "c", "d", "e"])
    go.Figure(fig.to_dict())  # raises on anything plotly does not accept
    path = next(t for t in fig.data if t.get("name") == "accepted path")
    assert path["x"] == [0, 1, 2] and path["line"]["color"] == "#d62728"
    names = [t["name"] for t in fig.data if t.get("mode") == "markers+text"]
    assert names == ["backbone", "head 1", "head 2", "head 3"]  # shown 1-based, as in the paper
    head1 = fig.data[names.index("head 1") + 2]
    assert head1["text"] == ["a", "b"] and head1["customdata"][1] == ["b", 12, "head 1 rank 1", 1, 2, "not accepted"]
    assert "step 0" in fig.layout["title"]["text"] and "2 from heads" in fig.layout["title"]["text"]
    assert set(head1["marker"]["symbol"]) == {"circle"}  # only exact sampling knows what was tried


def test_tree_figure_marks_the_candidates_exact_sampling_tried_and_rejected():
    # The walk took 0 -> 2: node 1 (rank 0) was tried first and rejected; node 2 is a leaf.
    fig = tree_figure(record(accepted=(0, 2), sampling="exact"), labels=["r", "a", "b", "c", "d", "e"])
    go.Figure(fig.to_dict())
    by_name = {t["name"]: t for t in fig.data if t.get("mode") == "markers+text"}
    assert list(by_name["head 1"]["marker"]["symbol"]) == ["x", "circle"]  # nodes 1 (rejected), 2 (accepted)
    assert [c[5] for c in by_name["head 1"]["customdata"]] == ["rejected", "accepted"]
    assert [c[5] for c in by_name["head 2"]["customdata"]] == ["untried", "untried"]  # children of node 1
    assert "exact" in fig.layout["title"]["text"]


def test_summary_shows_tokens_per_step_for_each_sampling_rule_and_the_csv_carries_the_rule(tmp_path):
    rows = [row(record(0, accepted=(0, 1, 3), sampling="typical")), row(record(1, accepted=(0, 1, 3), sampling="typical")),
            row(record(0, accepted=(0,), sampling="exact"), reply_index=1), row(record(1, accepted=(0, 2), sampling="exact"), reply_index=1)]
    s = summarize(rows, num_heads=3)
    assert s.acceleration_by_sampling == (("typical", 2, 3.0), ("exact", 2, 1.5))
    assert "**typical** 3.00 (2 steps) · **exact** 1.50 (2 steps)" in summary_markdown(s)
    lines = write_csv(rows, tmp_path / "s.csv").read_text().splitlines()
    column = lines[0].split(",").index("sampling")
    assert [line.split(",")[column] for line in lines[1:]] == ["typical", "typical", "exact", "exact"]


def test_speed_figure_separates_modes_and_replies_and_is_valid_plotly():
    def prefill(mode: str, reply: int) -> StepRow:  # step 0: the prompt's prefill and the first token
        rec = record(0, accepted=(0,), mode="baseline", latency=0.5, prefill=0.5)
        return row(dataclasses.replace(rec, mode=mode, tree_name="prefill"), reply_index=reply)

    rows = [
        prefill("medusa", 0), row(record(1)), row(record(2)),
        prefill("baseline", 1), row(record(1, accepted=(0,), mode="baseline"), reply_index=1),
        prefill("medusa", 2), row(record(1, accepted=(0,)), reply_index=2),
    ]
    fig = speed_figure(rows)
    go.Figure(fig.to_dict())
    go.Figure(speed_figure([]).to_dict())
    go.Figure(empty_figure("x").to_dict())
    by_name = {t["name"]: t for t in fig.data}
    assert by_name["medusa tokens/s"]["x"] == [1, 2, 6]  # prefills (rows 0, 3, 5) are not decoding steps
    assert by_name["baseline tokens/s"]["x"] == [4]
    assert by_name["medusa tokens/step"]["y"] == [3, 3, None, 1]
    mean = by_name["medusa rolling mean (8 steps)"]
    assert mean["x"] == [1, 2, None, 6]  # each reply has its own rolling mean; no line across other replies
    assert mean["y"] == [300.0, 300.0, None, 100.0]
    assert by_name["medusa tokens/s"]["marker"]["color"] != by_name["baseline tokens/s"]["marker"]["color"]


def test_the_speed_figure_ticks_whole_steps_on_a_short_session_and_leaves_a_long_one_to_plotly():
    short = speed_figure([row(record(i)) for i in range(1, 4)])
    assert short.layout["xaxis2"]["dtick"] == 1  # no step 1.5 on a three-step reply
    assert "dtick" not in speed_figure([row(record(i)) for i in range(1, 200)]).layout["xaxis2"]


def test_speed_figure_draws_dots_only_for_the_latest_steps_but_lines_for_all():
    from app.charts import MAX_MARKERS

    rows = [row(record(i)) for i in range(MAX_MARKERS + 50)]
    by_name = {t["name"]: t for t in speed_figure(rows).data}
    assert by_name["medusa tokens/s"]["x"][0] == 50 and len(by_name["medusa tokens/s"]["x"]) == MAX_MARKERS
    assert len(by_name["medusa rolling mean (8 steps)"]["x"]) == MAX_MARKERS + 49  # step 0, the prefill, left out
    assert 0 not in by_name["medusa rolling mean (8 steps)"]["x"]


def test_head_tokens_are_counted_after_the_cut_at_the_token_limit():
    # The tree accepted 3 head tokens (path 0-1-3-5) but the token limit kept only the first 2 tokens.
    cut = dataclasses.replace(record(accepted=(0, 1, 3, 5), stop="max_new_tokens"), token_ids=(11, 13), total_tokens=2)
    r = row(cut)
    assert (r.accepted_tokens, r.head_tokens) == (2, 2)
    assert summarize([r], num_heads=3).head_acceptance == (1.0, 1.0, 0.0)  # head 3's node was verified, then cut
    figure = tree_figure(cut, [str(t) for t in cut.node_token_ids])
    assert "+2 tokens (2 from heads; 1 cut at the token limit" in figure.layout["title"]["text"]
    path = next(t for t in figure.data if t.get("name") == "accepted path")
    assert len(path["x"]) == 3  # the root and the two candidates in the reply


def test_every_figure_has_a_transparent_background_so_it_follows_the_pages_light_or_dark_theme():
    rows = [row(record(0)), row(record(1))]
    for fig in (tree_figure(record(), list("rabcde")), speed_figure(rows), speed_figure([]), empty_figure("x")):
        for key in ("paper_bgcolor", "plot_bgcolor"):
            assert fig.layout.get(key) == "rgba(0,0,0,0)", key


def big_record() -> StepRecord:
    """A published 63-node tree (64 nodes): 4 heads, up to 10 ranks at depth 1."""
    from medusa_core import TREE_PRESETS

    choices = TREE_PRESETS["vicuna_7b_stage2"]
    paths = sorted(choices, key=lambda p: (len(p), p))
    index = {tuple(p): i + 1 for i, p in enumerate(paths)}
    parents = (-1, *[index.get(tuple(p[:-1]), 0) for p in paths])
    heads = (-1, *[len(p) - 1 for p in paths])
    ranks = (0, *[p[-1] for p in paths])
    accepted = (0, index[(0,)], index[(0, 0)])
    return StepRecord(
        step=3, mode="medusa", tree_name="vicuna_7b_stage2", tree_nodes=len(parents), node_token_ids=tuple(range(100, 100 + len(parents))),
        node_parents=parents, node_heads=heads, node_ranks=ranks, accepted_nodes=accepted, token_ids=tuple(100 + i for i in accepted),
        accept_length=2, latency_s=0.05, total_tokens=10, sampling="greedy",
    )


def test_a_64_node_tree_shows_no_overlapping_labels_and_always_labels_the_accepted_path():
    rec = big_record()
    fig = tree_figure(rec, [f"tok{i}" for i in range(rec.tree_nodes)])
    go.Figure(fig.to_dict())
    x, y = tree_layout(rec.node_parents)
    plot_px = fig.layout["height"] - fig.layout["margin"]["t"] - fig.layout["margin"]["b"]
    px_per_unit = plot_px / (max(y) - min(y))
    shown = {}  # node -> label shown next to it
    for trace in fig.data:
        for node, text in zip(trace.get("customdata") and [c[4] for c in trace["customdata"]] or [], trace.get("text") or []):
            if text:
                shown[node] = text
    assert set(rec.accepted_nodes) <= set(shown)
    for a in shown:
        for b in shown:
            if a < b and x[a] == x[b]:
                assert abs(y[a] - y[b]) * px_per_unit >= 12, (a, b)  # 11 px text needs about 12 px


def test_the_tree_plot_labels_its_rank_axis_and_its_legend_shows_no_accepted_ring():
    fig = tree_figure(record(accepted=(0, 1, 3)), list("rabcde"))
    assert "rank" in fig.layout["yaxis"]["title"]["text"]
    for trace in fig.data:
        if trace.get("showlegend", True) and trace.get("mode", "").startswith("markers"):
            line = trace["marker"].get("line", {})
            assert not isinstance(line.get("color"), list) and line.get("color") != "#d62728", trace["name"]


def hybrid_record(step=1) -> StepRecord:
    """The 6-node tree with an n-gram chain grafted below node 3 (nodes 6, 7), accepted 0-1-3-6-7."""
    base = record(step, accepted=(0, 1, 3, 6, 7))
    return dataclasses.replace(
        base, tree_name="hand", tree_nodes=8, node_token_ids=tuple(range(10, 18)), node_parents=PARENTS + (3, 6),
        node_heads=HEADS + (-1, -1), node_ranks=RANKS + (0, 0), node_sources=("root",) + ("head",) * 5 + ("ngram",) * 2,
        drafts="hybrid", token_ids=(11, 13, 16, 17, 9), total_tokens=5,
    )


def test_the_tree_figure_marks_n_gram_copies_apart_from_the_heads_and_the_title_counts_both():
    rec = hybrid_record()
    fig = tree_figure(rec, [f"t{i}" for i in range(8)])
    go.Figure(fig.to_dict())
    by_name = {t["name"]: t for t in fig.data if t.get("mode") == "markers+text"}
    assert list(by_name) == ["backbone", "head 1", "head 2", "head 3", "n-gram copy"]
    copies = by_name["n-gram copy"]
    assert [c[4] for c in copies["customdata"]] == [6, 7] and {c[2] for c in copies["customdata"]} == {"n-gram copy"}
    assert set(copies["marker"]["symbol"]) == {"diamond"} and copies["marker"]["color"] != by_name["backbone"]["marker"]["color"]
    assert by_name["head 2"]["customdata"][0][2] == "head 2 rank 0"
    assert "(2 from heads, 2 from n-gram)" in fig.layout["title"]["text"] and "hand + n-gram" in fig.layout["title"]["text"]
    path = next(t for t in fig.data if t.get("name") == "accepted path")
    assert len(path["x"]) == 5


def test_a_hybrid_step_that_verified_a_long_chain_alone_is_titled_as_the_chain_not_the_heads_tree():
    chain = dataclasses.replace(
        hybrid_record(), tree_name="ngram", tree_nodes=3, node_token_ids=(10, 16, 17), node_parents=(-1, 0, 1),
        node_heads=(-1, -1, -1), node_ranks=(0, 0, 0), node_sources=("root", "ngram", "ngram"), accepted_nodes=(0, 1, 2),
        accept_length=2, token_ids=(16, 17, 9), total_tokens=3,
    )
    title = tree_figure(chain, ["t0", "t6", "t7"]).layout["title"]["text"]
    assert "· chain (3 nodes)" in title and "ngram" not in title and "+ n-gram" not in title  # not the internal "ngram"
    assert "(0 from heads, 2 from n-gram)" in title


def drafter_record(step=1) -> StepRecord:
    """A drafter + corpus step (``drafts="eagle"``): the root and a chain of two drafts, both accepted."""
    return dataclasses.replace(
        hybrid_record(step), tree_name="ngram", tree_nodes=3, node_token_ids=(10, 16, 17), node_parents=(-1, 0, 1),
        node_heads=(-1, -1, -1), node_ranks=(0, 0, 0), node_sources=("root", "ngram", "ngram"), accepted_nodes=(0, 1, 2),
        accept_length=2, token_ids=(16, 17, 9), total_tokens=3, drafts="eagle",
    )


def test_a_drafter_step_names_its_chain_as_the_drafter_or_corpus_chain_not_an_n_gram_copy_or_the_heads():
    fig = tree_figure(drafter_record(), ["t0", "t6", "t7"])
    by_name = {t["name"]: t for t in fig.data if t.get("mode") == "markers+text"}
    assert list(by_name) == ["backbone", "drafter or corpus chain"]
    assert {c[2] for c in by_name["drafter or corpus chain"]["customdata"]} == {"drafter or corpus chain"}
    assert "head" not in fig.layout["xaxis"]["title"]["text"]  # no head proposed a node of this step
    assert "+3 tokens (2 from the drafter or corpus)" in fig.layout["title"]["text"]  # no "0 from heads": none drafts here
    assert "head k" in tree_figure(hybrid_record(), [f"t{i}" for i in range(8)]).layout["xaxis"]["title"]["text"]
    corpus = dataclasses.replace(drafter_record(), drafts="corpus")
    assert "corpus chain" in {t.get("name") for t in tree_figure(corpus, ["t0", "t6", "t7"]).data}


def test_the_summary_names_the_drafts_as_the_drafts_control_does_and_counts_every_chain_source():
    s = summarize([row(drafter_record(1)), row(drafter_record(2)), row(hybrid_record(3))], num_heads=3)
    text = summary_markdown(s)
    assert "**drafter + corpus** 3.00 (2 steps)" in text and "**hybrid (heads + n-gram)** 5.00 (1 steps)" in text
    assert "**2** from the heads, **6** from chains (n-gram, corpus or drafter)" in text


def test_rows_summary_and_csv_say_how_many_accepted_tokens_came_from_the_heads_and_from_n_gram_drafts(tmp_path):
    rows = [row(hybrid_record(1)), row(hybrid_record(2)), row(record(3, accepted=(0, 1)))]
    assert [(r.head_tokens, r.ngram_tokens, r.drafts) for r in rows] == [(2, 2, "hybrid"), (2, 2, "hybrid"), (1, 0, "")]
    s = summarize(rows, num_heads=3)
    assert (s.head_tokens, s.ngram_tokens) == (5, 4)
    assert s.acceleration_by_drafts == (("hybrid", 2, 5.0), ("", 1, 2.0))
    assert "**5** from the heads, **4** from chains (n-gram, corpus or drafter)" in summary_markdown(s)
    with write_csv(rows, tmp_path / "s.csv").open() as f:
        read = list(csv.DictReader(f))
    assert [(r["drafts"], r["head_tokens"], r["ngram_tokens"]) for r in read][0] == ("hybrid", "2", "2")


def test_root_only_steps_of_n_gram_drafts_count_as_medusa_steps_but_a_prefill_does_not():
    lone = dataclasses.replace(record(2, accepted=(0,)), tree_name="ngram", tree_nodes=1, node_token_ids=(10,), node_parents=(-1,),
                               node_heads=(-1,), node_ranks=(0,), node_sources=("root",), drafts="ngram", token_ids=(9,))
    prefill = dataclasses.replace(lone, step=0, tree_name="prefill")
    s = summarize([row(prefill), row(lone), row(hybrid_record(3))], num_heads=3)
    assert s.medusa_steps == 2 and s.acceleration_rate == 3.0
