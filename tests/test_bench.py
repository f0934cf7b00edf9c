"""Tests of the benchmark program (``medusa_core.bench``): its accounting on synthetic runs with known
numbers, the tree tuner's choice on synthetic latency curves, the prompt set and its encoding, and smoke
runs on a tiny model.

Wall-clock figures are never asserted: only arithmetic on given numbers and the files a run writes.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from medusa_core import CHAT_PRESET, load_medusa_model, optimal_tree, physical_cores
from medusa_core.bench import (
    ALL,
    Prompt,
    Run,
    build_parser,
    choose_min_head_probability,
    choose_tree_size,
    confirm_choice,
    encode_prompt,
    find_divergences,
    first_difference,
    load_prompts,
    loops,
    main,
    marginal_token_cost,
    monotone_latency,
    predict_speedups,
    summarise,
    tuned_threshold,
    write_tuned,
)
from medusa_core.trees import SMALL_MODEL_RANK_ACCURACY
from tiny_models import tiny_tokenizer, write_tiny_medusa

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
SHIPPED = Path(__file__).resolve().parents[1] / "medusa_core" / "data" / "bench_prompts.jsonl"
DEMO_PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "demo" / "prompts"


def run(method, *, prompt=0, category="code", repeat=0, tokens=100, steps=100, wall=1.0, ttft=0.01,
        step_time=None, timed_steps=None, nodes=1, output=None, cpu=None, threads=1, ended=False):
    """A synthetic run; by default its step time is the whole wall time over all steps."""
    return Run(
        method=method, prompt=prompt, category=category, repeat=repeat, tokens=tokens, steps=steps, wall_s=wall,
        ttft_s=ttft, step_time_s=wall if step_time is None else step_time,
        timed_steps=steps if timed_steps is None else timed_steps, tree_nodes=nodes,
        output=tuple(range(tokens)) if output is None else tuple(output), cpu_s=wall if cpu is None else cpu,
        threads=threads, ended=ended, loops=loops(output or ()),
    )


def by_method(summaries, category=ALL, threads=1):
    return {s.method: s for s in summaries if s.category == category and s.threads == threads}


# ------------------------------------------------------------------------------------ accounting
def test_summary_gives_acceleration_overhead_and_speedup_of_a_synthetic_run():
    # Two prompts of 100 tokens each. HF: 1 token per pass, 1.0 s per prompt. Baseline loop: 100
    # steps of 8 ms. Medusa: 40 steps of 10 ms -> 2.5 tokens/step, overhead 10/8, 250 tokens/s.
    runs = []
    for p in (0, 1):
        runs += [
            run("hf", prompt=p, wall=1.0, ttft=0.01, step_time=0.99, timed_steps=99),
            run("baseline", prompt=p, wall=0.8),
            run("medusa:t", prompt=p, steps=40, wall=0.4, nodes=9),
        ]
    s = by_method(summarise(runs))
    assert s["hf"].tok_s == pytest.approx(100.0)
    assert s["hf"].acceleration == pytest.approx(1.0)
    assert s["hf"].step_ms == pytest.approx(10.0)
    assert s["baseline"].step_ms == pytest.approx(8.0)
    assert s["medusa:t"].acceleration == pytest.approx(2.5)
    assert s["medusa:t"].step_ms == pytest.approx(10.0)
    assert s["medusa:t"].overhead == pytest.approx(1.25)
    assert s["medusa:t"].speedup == pytest.approx(2.5)
    assert s["baseline"].speedup == pytest.approx(1.25)
    # the paper's identity: speedup over the plain loop = acceleration / overhead
    assert s["medusa:t"].tok_s / s["baseline"].tok_s == pytest.approx(s["medusa:t"].acceleration / s["medusa:t"].overhead)
    assert s["medusa:t"].tree_nodes == 9 and s["medusa:t"].tokens == 200 and s["medusa:t"].prompts == 2
    assert s["medusa:t"].ttft_ms == pytest.approx(10.0)
    assert (s["medusa:t"].identical, s["medusa:t"].compared) == (2, 2)
    assert (s["hf"].identical, s["hf"].compared) == (0, 0)


def test_tokens_per_second_is_the_median_over_repeats_with_min_and_max_as_spread():
    runs = [run("hf", repeat=r, wall=w) for r, w in enumerate([1.0, 0.5, 2.0])]  # 100, 200, 50 tokens/s
    s = by_method(summarise(runs))["hf"]
    assert (s.tok_s, s.tok_s_min, s.tok_s_max) == pytest.approx((100.0, 50.0, 200.0))


def test_cpu_per_wall_shows_how_much_of_the_wall_time_this_process_ran():
    runs = [run("hf", prompt=0, wall=1.0, cpu=1.0), run("hf", prompt=1, wall=3.0, cpu=1.0)]  # second run: 2 s stolen
    assert by_method(summarise(runs))["hf"].cpu_per_wall == pytest.approx(0.5)


def test_tokens_per_second_pools_prompts_by_total_tokens_over_total_time():
    runs = [run("hf", prompt=0, tokens=100, wall=1.0), run("hf", prompt=1, tokens=20, wall=1.0)]
    assert by_method(summarise(runs))["hf"].tok_s == pytest.approx(60.0)  # 120 tokens in 2 s, not mean(100, 20)


def test_each_category_is_summarised_alone_and_pooled_under_all():
    runs = [
        run("hf", prompt=0, category="math", wall=1.0), run("medusa:t", prompt=0, category="math", steps=50, wall=0.5),
        run("hf", prompt=1, category="python", wall=1.0), run("medusa:t", prompt=1, category="python", steps=25, wall=0.25),
    ]
    summaries = summarise(runs)
    assert [s.category for s in summaries if s.method == "hf"] == ["math", "python", ALL]
    assert by_method(summaries, "math")["medusa:t"].speedup == pytest.approx(2.0)
    assert by_method(summaries, "python")["medusa:t"].speedup == pytest.approx(4.0)
    assert by_method(summaries)["medusa:t"].speedup == pytest.approx(200 / 0.75 / 100)
    assert by_method(summaries)["medusa:t"].acceleration == pytest.approx(200 / 75)


def test_overhead_and_speedup_are_nan_without_their_reference_methods():
    s = by_method(summarise([run("medusa:t", steps=50)]))["medusa:t"]
    assert math.isnan(s.overhead) and math.isnan(s.speedup)
    assert s.acceleration == pytest.approx(2.0)


def test_a_diverging_output_is_counted_and_located_never_hidden():
    ref = [5, 6, 7, 8, 9]
    runs = [
        run("hf", prompt=0, tokens=5, output=ref), run("hf", prompt=1, tokens=5, output=ref),
        run("medusa:t", prompt=0, tokens=5, output=ref),
        run("medusa:t", prompt=1, tokens=5, output=[5, 6, 7, 1, 9]),
        run("baseline", prompt=1, tokens=3, output=ref[:3]),  # stopped early: diverges by length
    ]
    divergences = {(d.method, d.prompt): d for d in find_divergences(runs)}
    assert set(divergences) == {("medusa:t", 1), ("baseline", 1)}
    d = divergences[("medusa:t", 1)]
    assert (d.position, d.expected, d.got, d.repeats) == (3, 8, 1, 1)
    d = divergences[("baseline", 1)]
    assert (d.position, d.expected, d.got) == (3, 8, None)
    s = by_method(summarise(runs))
    assert (s["medusa:t"].identical, s["medusa:t"].compared) == (1, 2)
    assert (s["baseline"].identical, s["baseline"].compared) == (0, 1)


def test_each_thread_count_gets_its_own_row_measured_against_hf_at_that_count():
    # 1 thread: HF 100 tokens/s, Medusa 200. 2 threads: HF 160 tokens/s, Medusa 400, and one diverging token
    # at 2 threads only (a different summation order may flip an argmax; counts are never compared across).
    runs = []
    for threads, hf_wall, medusa_wall, medusa_out in [(1, 1.0, 0.5, None), (2, 0.625, 0.25, [0, 1, 9] + list(range(3, 100)))]:
        runs += [
            run("hf", threads=threads, wall=hf_wall), run("baseline", threads=threads, wall=hf_wall * 0.8),
            run("medusa:t", threads=threads, steps=40, wall=medusa_wall, output=medusa_out),
        ]
    summaries = summarise(runs)
    assert [(s.method, s.threads) for s in summaries if s.category == ALL] == [
        ("hf", 1), ("baseline", 1), ("medusa:t", 1), ("hf", 2), ("baseline", 2), ("medusa:t", 2)]
    one, two = by_method(summaries, threads=1), by_method(summaries, threads=2)
    assert one["hf"].tok_s == pytest.approx(100.0) and two["hf"].tok_s == pytest.approx(160.0)
    assert one["medusa:t"].speedup == pytest.approx(2.0) and two["medusa:t"].speedup == pytest.approx(2.5)
    assert two["medusa:t"].overhead == pytest.approx((0.25 / 40) / (0.5 / 100))
    assert (one["medusa:t"].identical, two["medusa:t"].identical, two["medusa:t"].compared) == (1, 0, 1)
    [d] = find_divergences(runs)
    assert (d.method, d.threads, d.position, d.expected, d.got) == ("medusa:t", 2, 2, 2, 9)


def test_a_reply_loops_when_some_6_token_sequence_occurs_4_times_overlaps_included():
    phrase = [1, 2, 3, 4, 5, 6]
    assert not loops(phrase * 3 + [9]) and loops(phrase * 4)
    assert loops([7] * 9) and not loops([7] * 8)  # 9 sevens hold the 6-gram (7,)*6 four times, overlapping
    assert loops([1, 2, 3, 4, 5] * 5) and not loops([1, 2, 3, 4, 5] * 4)  # a shorter cycle loops once 21 tokens long
    assert not loops(list(range(100))) and loops([1, 2, 3] * 4, n=3)


def test_the_summary_counts_replies_that_loop_and_replies_that_ended_with_eos():
    runs = [run("hf", prompt=0, output=[1, 2, 3, 4, 5, 6] * 4, ended=False), run("hf", prompt=1, ended=True),
            run("hf", prompt=2, ended=True)]
    s = by_method(summarise(runs))["hf"]
    assert (s.looping, s.ended, s.runs) == (1, 2, 3)


def test_first_difference_finds_changed_tokens_and_unequal_lengths():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None


# ------------------------------------------------------------------------------------------ tuner
def test_predicted_speedup_is_expected_tokens_per_step_over_relative_step_cost():
    predicted = predict_speedups({4: 1.2, 8: 1.5}, {0: 0.010, 4: 0.011, 8: 0.012})
    assert predicted == pytest.approx({0: 1.0, 4: 2.2 / 1.1, 8: 2.5 / 1.2})


def test_tuner_picks_a_mid_size_tree_when_step_cost_grows_like_a_cpu():
    accept = {4: 1.2, 8: 1.5, 16: 1.7, 64: 2.0}
    cpu = {0: 10.0, 4: 11.0, 8: 12.0, 16: 16.0, 64: 40.0}  # 2.00, 2.08, 1.69, 0.75
    assert choose_tree_size({n: s for n, s in predict_speedups(accept, cpu).items() if n}) == 8


def test_tuner_picks_the_largest_tree_when_step_cost_is_flat_like_a_gpu():
    accept = {4: 1.2, 8: 1.5, 16: 1.7, 64: 2.0}
    gpu = {0: 10.0, 4: 10.0, 8: 10.0, 16: 10.1, 64: 10.5}
    assert choose_tree_size({n: s for n, s in predict_speedups(accept, gpu).items() if n}) == 64


def test_tuner_tolerance_prefers_the_smaller_of_two_near_ties():
    assert choose_tree_size({4: 2.00, 8: 2.08, 16: 1.69}, tolerance=0.05) == 4
    assert choose_tree_size({4: 2.00, 8: 2.08, 16: 1.69}, tolerance=0.0) == 8


def test_confirmation_overrules_the_prediction_only_by_more_than_the_tolerance():
    assert confirm_choice(4, {4: 100.0, 8: 101.0, 16: 90.0}, tolerance=0.02) == 4  # within noise: keep the pick
    assert confirm_choice(4, {4: 100.0, 8: 105.0, 16: 90.0}, tolerance=0.02) == 8
    assert confirm_choice(4, {4: 100.0, 8: 101.0}, tolerance=0.0) == 8


def test_tuner_on_the_feasibility_runs_cpu_forward_costs_picks_the_8_token_tree():
    # DEMO_FEASIBILITY.md: one forward of 1 / 8 / 16 / 32 / 64 tokens took 5.5 / 6.3 / 8.4 / 12.4 / 18.4 ms
    # on the 2-core CPU; with its heads' rank accuracies the 8-token tree wins, as it did when measured.
    latency = {0: 5.5, 7: 6.3, 15: 8.4, 31: 12.4, 63: 18.4}
    accept = {n: optimal_tree(SMALL_MODEL_RANK_ACCURACY, n)[1] for n in latency if n}
    predicted = predict_speedups(accept, latency)
    assert choose_tree_size({n: s for n, s in predicted.items() if n}) == 7
    assert predicted[63] < 1.0 < predicted[7]


def test_monotone_latency_pools_a_step_that_measured_cheaper_than_a_smaller_tree():
    fitted = monotone_latency({0: 10.0, 2: 14.0, 4: 12.0, 8: 20.0})  # 4 paths cannot cost less than 2
    assert fitted == pytest.approx({0: 10.0, 2: 13.0, 4: 13.0, 8: 20.0})
    assert monotone_latency({0: 1.0, 1: 2.0}) == {0: 1.0, 1: 2.0}


def test_marginal_token_cost_is_the_least_squares_slope_of_step_latency_per_tree_token():
    assert marginal_token_cost({1: 12.0, 3: 16.0, 7: 24.0}) == pytest.approx(2.0)  # a line: 10 + 2 per path
    assert marginal_token_cost({1: 11.0, 2: 14.0, 3: 13.0}) == pytest.approx(1.0)  # noise around a slope of 1
    assert marginal_token_cost({1: 12.0, 3: 11.0}) == 0.0  # a bigger tree never costs less: no negative cost
    with pytest.raises(ValueError, match="at least two tree sizes"):
        marginal_token_cost({4: 12.0})


def test_a_node_pays_when_its_path_probability_beats_the_marginal_cost_of_one_more_token():
    # a 20 ms step making 2 tokens; one more token costs 2 ms: (2 + p) / 22 > 2 / 20 <=> p > 0.2
    tau = choose_min_head_probability(marginal_s=0.002, step_latency_s=0.020, tokens_per_step=2.0)
    assert tau == pytest.approx(0.2)
    assert (2.0 + tau + 0.01) / 0.022 > 2.0 / 0.020 > (2.0 + tau - 0.01) / 0.022
    assert choose_min_head_probability(0.0, 0.020, 2.0) == 0.0  # free tokens (a GPU): verify the whole tree
    assert choose_min_head_probability(0.05, 0.020, 2.0) == 1.0  # dearer than a step's worth: only sure nodes
    with pytest.raises(ValueError, match="step_latency_s must be > 0, got 0"):
        choose_min_head_probability(0.002, 0, 2.0)


def test_the_threshold_of_a_tuned_entry_uses_its_fitted_latencies_or_else_its_overhead():
    tuner_run = {"nodes": 5, "measured_acceleration": 1.8,
                 "step_latency_fitted_ms": {"0": 70.0, "1": 90.0, "2": 92.0, "4": 96.0, "8": 104.0}}
    # the slope over the Medusa trees (the heads' pass is paid whatever a shaped step keeps): 2 ms per path
    assert tuned_threshold(tuner_run) == pytest.approx(2.0 * 1.8 / 96.0)
    # shaping only drops nodes of the chosen tree: trees larger than it, dearer per path, do not count (this AMD
    # EPYC's greedy run, 2026-11-29: the slope over 1-8 paths, 1.0 ms, made τ 0.35 for a one-node tree whose node
    # costs ~0.35 ms)
    measured = {"0": 4.14, "1": 4.36, "2": 4.71, "3": 6.04, "4": 6.58, "6": 8.70, "8": 11.15}
    one_node = {"nodes": 2, "measured_acceleration": 1.56, "step_latency_fitted_ms": measured}
    # one Medusa size up to it: the slope to the next size (from the plain step it would count the heads' pass, which a
    # shaped step pays whatever it keeps)
    assert tuned_threshold(one_node) == pytest.approx((4.71 - 4.36) * 1.56 / 4.36)
    two_nodes = {"nodes": 3, "measured_acceleration": 1.7, "step_latency_fitted_ms": measured}
    assert tuned_threshold(two_nodes) == pytest.approx((4.71 - 4.36) * 1.7 / 4.71)
    by_hand = {"nodes": 3, "measured_acceleration": 1.41, "measured_overhead": 1.46}  # a tree picked from a benchmark
    assert tuned_threshold(by_hand) == pytest.approx((0.46 / 2) * 1.41 / 1.46)  # slope from the plain step
    with pytest.raises(ValueError, match="neither step_latency_fitted_ms nor measured_overhead"):
        tuned_threshold({"nodes": 3, "measured_acceleration": 1.4})


def test_write_tuned_merges_a_device_entry_and_keeps_the_others(tmp_path):
    path = tmp_path / "medusa_tuned.json"
    write_tuned(path, "cuda/none", {"choices": [[0]], "nodes": 2})
    write_tuned(path, "cpu/nf4", {"choices": [[0], [0, 0]], "nodes": 3})
    write_tuned(path, "cpu/nf4", {"choices": [[0], [1]], "nodes": 3})
    data = json.loads(path.read_text())
    assert data == {"cuda/none": {"choices": [[0]], "nodes": 2}, "cpu/nf4": {"choices": [[0], [1]], "nodes": 3}}


# ---------------------------------------------------------------------------------------- prompts
def test_shipped_prompts_cover_mt_bench_categories_and_multi_turn_conversations():
    prompts = load_prompts()
    categories = {p.category for p in prompts}
    assert len(prompts) >= 80
    assert MT_BENCH | {"multi-turn"} == categories
    assert all(sum(p.category == c for p in prompts) >= 10 for c in categories)
    assert len({(p.history, p.text) for p in prompts}) == len(prompts)
    multi = [p for p in prompts if p.category == "multi-turn"]
    assert all(len(p.history) == 2 and [role for role, _ in p.history] == ["user", "assistant"] for p in multi)
    assert not any(p.history for p in prompts if p.category != "multi-turn")


def test_shipped_prompts_taken_from_the_demo_are_held_out_and_never_trained_on():
    if not (DEMO_PROMPTS / "heldout.jsonl").exists():
        pytest.skip("no demo prompt files in this checkout")
    def user_texts(name):
        return {json.loads(line)["messages"][-1]["content"] for line in (DEMO_PROMPTS / name).open(encoding="utf-8")}

    heldout, train = user_texts("heldout.jsonl"), user_texts("train.jsonl")
    rows = [json.loads(line) for line in SHIPPED.open(encoding="utf-8")]
    copied = [r["prompt"] for r in rows if r["source"] == "heldout"]
    assert len(copied) >= 60 and {r["source"] for r in rows} == {"heldout", "written"}
    assert [t for t in copied if t not in heldout] == []
    assert [t for r in rows for t in ([r["prompt"]] if "prompt" in r else [m["content"] for m in r["messages"]])
            if t in train] == []


def test_limit_takes_prompts_round_robin_over_the_categories():
    assert {p.category for p in load_prompts(limit=9)} == MT_BENCH | {"multi-turn"}


def test_categories_keep_only_their_prompts_and_an_unknown_one_names_those_there_are():
    prompts = load_prompts(None, 4, ["writing", "stem"])
    assert len(prompts) == 4 and {p.category for p in prompts} == {"writing", "stem"}
    with pytest.raises(ValueError, match="no prompt of the categories poetry; it has coding, extraction"):
        load_prompts(None, None, ["poetry"])


def test_a_prompt_file_without_a_prompt_field_is_named_with_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2"):
        load_prompts(path)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],  # ends with the assistant
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "system", "content": "s"}],
    [],
])
def test_a_conversation_that_does_not_alternate_and_end_with_the_user_is_named_with_its_line(tmp_path, messages):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n' + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2: .*(message|turns)"):
        load_prompts(path)


def test_a_messages_row_is_encoded_as_the_whole_conversation_ending_with_the_assistants_turn(tmp_path):
    path = tmp_path / "p.jsonl"
    conversation = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."},
                    {"role": "user", "content": "And an even one?"}]
    path.write_text(json.dumps({"category": "multi-turn", "messages": conversation}) + "\n")
    [prompt] = load_prompts(path)
    assert prompt == Prompt("And an even one?", "multi-turn", (("user", "Name a prime."), ("assistant", "Seven.")))
    tok = tiny_tokenizer()  # its template: <|role|>\ncontent<|end|>\n per message, then <|assistant|>\n

    def ids_of(text):
        return tok(text, add_special_tokens=False, return_tensors="pt").input_ids.tolist()

    assert encode_prompt(tok, prompt, system="Be brief.").tolist() == ids_of(
        "<|system|>\nBe brief.<|end|>\n<|user|>\nName a prime.<|end|>\n<|assistant|>\nSeven.<|end|>\n"
        "<|user|>\nAnd an even one?<|end|>\n<|assistant|>\n"
    )
    # a single-turn row (or a plain string) is the last user message alone
    assert encode_prompt(tok, "And an even one?").tolist() == ids_of("<|user|>\nAnd an even one?<|end|>\n<|assistant|>\n")


# -------------------------------------------------------------------------------------- smoke runs
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    heads = write_tiny_medusa(folder)
    prompts = folder / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):", "category": "python"}\n{"prompt": "return a + b", "category": "coding"}\n')
    return heads, prompts


def test_benchmark_program_on_a_tiny_model_writes_csv_and_markdown_for_every_method(tiny, tmp_path):
    heads, prompts = tiny
    out = tmp_path / "out"
    assert main([
        "--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--trees", "chain_2,sparse_8",
        "--max-new-tokens", "12", "--repeats", "2", "--out", str(out), "--no-progress", "--threads", "1",
    ]) == 0
    methods = {"hf", "hf_pld", "baseline", "medusa:chain_2", "medusa:sparse_8", "ngram", "medusa+ngram:chain_2",
               "medusa+ngram:sparse_8"}
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["method"] for r in rows} == methods
    assert {r["category"] for r in rows} == {"python", "coding", ALL}
    with open(out / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == len(methods) * 2 * 2  # methods x prompts x repeats
    assert all(r["ngram_tokens"] == "0" for r in runs if not r["method"].endswith("ngram") and "+ngram" not in r["method"])
    assert all(r["head_tokens"] == "0" for r in runs if r["method"] == "ngram")
    overall = {r["method"]: r for r in rows if r["category"] == ALL}
    assert overall["medusa:sparse_8"]["tree_nodes"] == "9"
    # float32 on CPU: every greedy method reproduces HF generate token for token
    for m in methods - {"hf"}:
        assert (overall[m]["identical"], overall[m]["compared"]) == ("2", "2"), m
    markdown = (out / "summary.md").read_text()
    assert all(f"| {m} |" in markdown for m in methods)
    assert "No divergence" in markdown
    assert (out / "speedup_by_tree.html").exists()


def test_threads_default_to_the_physical_cores_and_take_several_counts_in_a_run_only():
    assert build_parser("run").parse_args([]).threads == [physical_cores()]
    assert build_parser("run").parse_args(["--threads", "1", "2"]).threads == [1, 2]
    assert build_parser("tune").parse_args([]).threads == physical_cores()
    with pytest.raises(SystemExit):
        build_parser("profile").parse_args(["--threads", "1", "2"])
    with pytest.raises(SystemExit):
        build_parser("run").parse_args(["--threads", "0"])


def test_a_run_at_two_thread_counts_reports_a_row_per_method_and_count_and_a_conversation_prompt(tiny, tmp_path):
    heads, _ = tiny
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):", "category": "python"}) + "\n" + json.dumps({
        "category": "multi-turn", "messages": [{"role": "user", "content": "def add(a, b):"},
                                               {"role": "assistant", "content": "return a + b"},
                                               {"role": "user", "content": "and sub?"}]}) + "\n")
    out, before = tmp_path / "out", torch.get_num_threads()
    assert main([
        "--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--methods", "hf,baseline,medusa:chain_2",
        "--max-new-tokens", "6", "--repeats", "1", "--out", str(out), "--no-progress", "--threads", "1", "2",
    ]) == 0
    assert torch.get_num_threads() == before  # the caller's setting is restored
    with open(out / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert sorted((r["method"], r["threads"], r["category"]) for r in runs) == sorted(
        (m, t, c) for m in ("hf", "baseline", "medusa:chain_2") for t in ("1", "2") for c in ("python", "multi-turn"))
    with open(out / "summary.csv") as f:
        overall = [r for r in csv.DictReader(f) if r["category"] == ALL]
    assert [(r["method"], r["threads"]) for r in overall] == [
        ("hf", "1"), ("baseline", "1"), ("medusa:chain_2", "1"), ("hf", "2"), ("baseline", "2"), ("medusa:chain_2", "2")]
    assert all((r["identical"], r["compared"]) == ("2", "2") for r in overall if r["method"] != "hf")
    markdown = (out / "summary.md").read_text()
    assert "| medusa:chain_2 | 1 |" in markdown and "| medusa:chain_2 | 2 |" in markdown
    assert "medusa:chain_2 @2t" in markdown and "threads: 1, 2" in markdown


def test_greedy_with_a_repetition_penalty_gives_hf_the_same_penalty_and_reports_loops_and_endings(tiny, tmp_path):
    heads, prompts = tiny
    out = tmp_path / "out"
    assert main([
        "--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--methods", "hf,baseline,medusa:chain_2",
        "--max-new-tokens", "24", "--repeats", "1", "--out", str(out), "--no-progress", "--threads", "1",
        "--repetition-penalty", "1.5",
    ]) == 0
    with open(out / "summary.csv") as f:
        overall = {r["method"]: r for r in csv.DictReader(f) if r["category"] == ALL}
    # the penalty changes the tiny model's reply, so identity with HF proves HF got the same processor
    assert all((overall[m]["identical"], overall[m]["compared"]) == ("2", "2") for m in ("baseline", "medusa:chain_2"))
    with open(out / "runs.csv") as f:
        assert all(r["ended"] in ("True", "False") for r in csv.DictReader(f))
    markdown = (out / "summary.md").read_text()
    assert "repetition_penalty: 1.5" in markdown and "| loops | ends (EOS) |" in markdown


def test_the_chat_preset_starts_from_the_models_chat_defaults_and_flags_override_it(tiny):
    from medusa_core import CHAT_PRESET, SamplingConfig
    from medusa_core.bench.cli import sampling_settings
    from medusa_core.processors import CHAT_SAMPLING

    heads, _ = tiny
    model = load_medusa_model(heads, quantization=None, device="cpu")
    parse = build_parser("run").parse_args
    assert sampling_settings(model, parse([])) == (SamplingConfig(), "typical")
    assert sampling_settings(model, parse(["--preset", "chat"])) == (CHAT_PRESET, CHAT_SAMPLING)
    config, mode = sampling_settings(model, parse(["--preset", "chat", "--top-k", "20", "--sampling", "typical"]))
    assert config.top_k == 20 and config.top_p == CHAT_PRESET.top_p and mode == "typical"
    with pytest.raises(ValueError, match="top_p must be in"):
        sampling_settings(model, parse(["--top-p", "0"]))


@pytest.mark.parametrize("sampling", ["typical", "exact"])
def test_a_sampled_benchmark_records_each_runs_rule_and_compares_no_outputs(sampling, tiny, tmp_path):
    heads, prompts = tiny
    out = tmp_path / "out"
    assert main([
        "--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--trees", "chain_2",
        "--max-new-tokens", "8", "--repeats", "1", "--out", str(out), "--no-progress",
        "--temperature", "0.7", "--sampling", sampling, "--threads", "1",
    ]) == 0
    with open(out / "runs.csv") as f:
        rules = {r["method"]: r["sampling"] for r in csv.DictReader(f)}
    assert rules == {"hf": "sample", "hf_pld": "sample", "baseline": "sample", "medusa:chain_2": sampling, "ngram": sampling,
                     "medusa+ngram:chain_2": sampling}
    with open(out / "summary.csv") as f:
        overall = {r["method"]: r for r in csv.DictReader(f) if r["category"] == ALL}
    assert float(overall["medusa:chain_2"]["acceleration"]) >= 1.0 and float(overall["medusa:chain_2"]["speedup"]) > 0
    assert all(r["compared"] == "0" for r in overall.values())
    markdown = (out / "summary.md").read_text()
    note = next(line for line in markdown.splitlines() if line.startswith("Sampled runs"))
    assert sampling in note and "sample" in note and "No divergence" not in markdown
    assert f"temperature: 0.7, sampling: {sampling}" in markdown


def test_tune_writes_a_tree_per_settings_preset_that_the_loader_gives_those_settings(tiny, tmp_path):
    heads, prompts = tiny
    (heads / "medusa_calibration.json").write_text(json.dumps({"rank_accuracy": [list(r) for r in SMALL_MODEL_RANK_ACCURACY]}))
    tuned = heads / "medusa_tuned.json"
    tuned.write_text(json.dumps({"cuda/nf4": {"choices": [[0]], "nodes": 2}}))
    try:
        assert main([
            "tune", "--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--sizes", "2,4",
            "--latency-prompts", "2", "--latency-tokens", "8", "--confirm-top", "2", "--max-new-tokens", "8",
            "--out", str(tmp_path / "tune"), "--no-progress", "--threads", "1",
        ]) == 0
        data = json.loads(tuned.read_text())
        assert set(data) == {"cuda/nf4", "cpu/none@greedy", "cpu/none@chat"}
        for preset, settings in (("greedy", "greedy"), ("chat", "T 0.2 · top-p 0.9 · rep. 1.1, exact")):
            entry = data[f"cpu/none@{preset}"]
            assert entry["settings"] == settings and ("identical_to_hf" in entry) == (preset == "greedy")
            assert len(entry["choices"]) in (2, 4) and entry["nodes"] == len(entry["choices"]) + 1
            assert entry["choices"] == optimal_tree(SMALL_MODEL_RANK_ACCURACY, len(entry["choices"]))[0]
            assert entry["predicted_speedup"] > 0 and entry["measured_speedup"] > 0
            report = (tmp_path / "tune" / preset / "tune.md").read_text()
            assert report.startswith(f"# Tree tuning at {preset}: {settings}") and (tmp_path / "tune" / preset / "tune.csv").exists()
        model = load_medusa_model(heads, quantization=None, device="cpu")
        assert model.default_tree == "tuned" and model.trees["tuned"] == data["cpu/none@greedy"]["choices"]
        chat = model.tuned_for(CHAT_PRESET)
        assert model.trees[chat.tree] == data["cpu/none@chat"]["choices"] and chat.measured_at == "chat"
        assert chat.measured_speedup == data["cpu/none@chat"]["measured_speedup"]
    finally:
        tuned.unlink(missing_ok=True)
        (heads / "medusa_calibration.json").unlink()


def test_the_chain_tuner_keeps_the_default_chain_unless_another_ran_more_than_the_tolerance_faster():
    from medusa_core.bench.tune_chain import choose_chain

    measured = {(3, 0.3): 150.0, (5, 0.3): 148.0, (8, 0.3): 140.0}
    assert choose_chain(measured, (5, 0.3), 0.02) == (5, 0.3)  # 150 is within 2 % of 148
    assert choose_chain(measured, (5, 0.3), 0.01) == (3, 0.3)
    assert choose_chain({(3, 0.3): 150.0, (8, 0.3): 140.0}, (5, 0.3), 0.02) == (3, 0.3)  # the default not measured
    with pytest.raises(ValueError, match="no chain was measured"):
        choose_chain({}, (5, 0.3), 0.02)


def test_tune_chains_only_writes_the_drafters_chain_into_this_machines_entry_and_needs_one(tmp_path, capsys):
    from medusa_core.tuned import machine_class, tuned_key

    tuned = tmp_path / "medusa_tuned.json"
    args = ["tune", "--model", "demo", "--chains-only", "--presets", "greedy", "--chains", "1:0,2:0", "--limit", "1",
            "--max-new-tokens", "8", "--tuned-file", str(tuned), "--out", str(tmp_path / "tune"), "--no-progress",
            "--threads", "1"]
    with pytest.raises(SystemExit, match="has no entry .*@greedy.* for the chain: run bench tune --presets greedy first"):
        main(args)
    key = tuned_key(torch.device("cpu"), "gguf", "greedy", machine_class(torch.device("cpu"), "gguf"))
    tuned.write_text(json.dumps({key: {"choices": [[0]], "nodes": 2}, "cuda/nf4@greedy": {"choices": [[1]]}}))
    assert main(args) == 0
    data = json.loads(tuned.read_text())
    entry = data[key]
    assert entry["choices"] == [[0]] and data["cuda/nf4@greedy"] == {"choices": [[1]]}  # the rest kept
    assert (entry["chain_depth"], entry["chain_threshold"]) in ((1, 0.0), (2, 0.0))
    assert entry["chain_measured_speedup"] > 0 and 1 <= entry["chain_measured_acceleration"] <= 3
    report = (tmp_path / "tune" / "greedy" / "chains.md").read_text()
    assert report.startswith("# Drafter chain tuning at greedy") and "**chosen**" in report
    with open(tmp_path / "tune" / "greedy" / "chains.csv") as f:
        assert [(r["chain_depth"], r["chain_threshold"]) for r in csv.DictReader(f)] == [("0", ""), ("1", "0.0"), ("2", "0.0")]


def test_a_dry_run_tune_of_a_model_with_a_drafter_reports_its_chain_too_and_writes_no_entry(tmp_path, capsys):
    tuned = tmp_path / "medusa_tuned.json"
    assert main(["tune", "--model", "demo", "--presets", "greedy", "--sizes", "2", "--latency-prompts", "1",
                 "--latency-tokens", "4", "--confirm-top", "1", "--confirm-prompts", "1", "--max-new-tokens", "4",
                 "--chains", "1:0", "--dry-run", "--tuned-file", str(tuned), "--out", str(tmp_path / "tune"),
                 "--no-progress", "--threads", "1"]) == 0
    assert not tuned.exists() and capsys.readouterr().out.count("--dry-run: not writing") == 2  # the tree's, the chain's
    report = (tmp_path / "tune" / "greedy" / "chains.md").read_text()
    assert report.startswith("# Drafter chain tuning at greedy") and "| 1:0 " in report


def test_tune_chains_only_refuses_a_model_without_a_drafter(tiny):
    heads, prompts = tiny
    with pytest.raises(SystemExit, match="--chains-only tunes the drafter's chain; .* has no drafter"):
        main(["tune", "--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--chains-only",
              "--no-progress", "--threads", "1"])


def test_tune_refuses_an_unknown_preset_naming_the_allowed_ones(capsys):
    with pytest.raises(SystemExit):
        build_parser("tune").parse_args(["--presets", "greedy,creative"])
    assert "'greedy,creative': presets are a comma list of greedy, chat" in capsys.readouterr().err


def test_the_llama_cpp_anchor_is_skipped_with_one_line_for_a_backbone_that_is_not_gguf(capsys):
    from medusa_core.bench.methods import build_methods

    class NotGGUF:
        backbone_file = None

    assert build_methods(NotGGUF(), ["llama_cpp"], []) == []
    assert "llama_cpp skipped: the backbone is not a GGUF file" in capsys.readouterr().out


def test_the_llama_cpp_anchor_is_skipped_with_one_line_when_llama_cpp_python_is_missing(capsys, monkeypatch):
    from medusa_core.bench import llama_cpp
    from medusa_core.bench.methods import build_methods

    class Demo:
        backbone_file = "/models/demo.gguf"

    monkeypatch.setattr(llama_cpp, "available", lambda: False)
    assert build_methods(Demo(), ["llama_cpp"], []) == []
    assert 'pip install -e ".[anchors]"' in capsys.readouterr().out
    monkeypatch.setattr(llama_cpp, "available", lambda: True)
    [method] = build_methods(Demo(), ["llama_cpp"], [])
    assert (method.kind, method.source, method.tree_nodes) == ("llama_cpp", "/models/demo.gguf", 1)


def test_the_draft_methods_run_the_engine_with_n_gram_drafts_alone_or_beside_each_tree():
    from medusa_core.bench.methods import build_methods

    class Model:
        def resolve_tree(self, tree):
            return tree, [[0], [0, 0]]

    methods = build_methods(Model(), ["ngram", "medusa+ngram", "medusa+ngram:x", "medusa"], ["a", "b"])
    assert [(m.name, m.kind, m.drafts, m.tree_nodes) for m in methods] == [
        ("ngram", "medusa", "ngram", 1), ("medusa+ngram:a", "medusa", "hybrid", 3), ("medusa+ngram:b", "medusa", "hybrid", 3),
        ("medusa+ngram:x", "medusa", "hybrid", 3), ("medusa:a", "medusa", "heads", 3), ("medusa:b", "medusa", "heads", 3),
    ]
    with pytest.raises(ValueError, match="medusa\\+ngram:<tree>"):
        build_methods(Model(), ["lookup"], ["a"])


def test_the_tuned_tree_of_a_bench_run_is_the_one_tuned_at_the_runs_settings_as_generate_reads_it():
    from medusa_core import CHAT_PRESET, SamplingConfig
    from medusa_core.bench.methods import build_methods
    from medusa_core.tuned import TunedSettings

    class Model:
        trees = {"tuned": [[0], [1], [0, 0]], "tuned_chat": [[0]]}
        has_corpus = True

        def resolve_tree(self, tree):
            return tree, self.trees[tree]

        def tuned_for(self, config):
            return TunedSettings("greedy", "tuned", 0.1, "greedy") if config.greedy else TunedSettings("chat", "tuned_chat", 0.1, "chat")

    chat = build_methods(Model(), ["medusa:tuned", "medusa+corpus:tuned_chat"], [], CHAT_PRESET)
    assert [(m.name, m.choices) for m in chat] == [("medusa:tuned", ((0,),)), ("medusa+corpus:tuned_chat", ((0,),))]
    [greedy] = build_methods(Model(), ["medusa:tuned"], [], SamplingConfig())
    assert (greedy.name, greedy.tree_nodes) == ("medusa:tuned", 4)


def test_draft_flags_reach_the_engine_and_the_report_and_shaped_trees_stay_identical_to_hf(tiny, tmp_path, monkeypatch):
    from medusa_core import DraftConfig, MedusaModel

    heads, prompts = tiny
    out = tmp_path / "out"
    seen = []
    generate = MedusaModel.generate

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("draft_config"))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(MedusaModel, "generate", spy)
    assert main([
        "--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--methods", "hf,medusa:sparse_8,medusa+ngram:sparse_8",
        "--max-new-tokens", "12", "--repeats", "1", "--out", str(out), "--no-progress", "--threads", "1",
        "--draft-tokens", "4", "--min-path-probability", "0.1", "--min-head-probability", "0.9",
    ]) == 0
    markdown = (out / "summary.md").read_text()
    assert "draft_tokens: 4, min_path_probability: 0.1, min_head_probability: 0.9" in markdown
    assert "No divergence" in markdown
    assert seen and set(seen) == {DraftConfig(max_tokens=4, min_path_probability=0.1, min_head_probability=0.9)}


def test_profile_split_only_times_each_stage_of_plain_medusa_and_hybrid_steps_and_they_add_up(tiny, tmp_path):
    from medusa_core.bench.stepsplit import STAGES, step_split

    heads, prompts = tiny
    out = tmp_path / "prof"
    assert main(["profile", "--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--split-only",
                 "--tree", "chain_2", "--max-new-tokens", "8", "--rounds", "1", "--out", str(out), "--threads", "1"]) == 0
    table = (out / "profile.md").read_text()
    assert all(f"| {kind} |" in table for kind in ("plain", "medusa:chain_2", "medusa+ngram:chain_2"))
    model = load_medusa_model(heads, quantization="none")
    ids = torch.tensor([[1, 2, 3, 4]])
    layers = model.config.num_hidden_layers
    plain, tree = (step_split(model, [ids], max_new_tokens=8, **kw) for kw in (dict(medusa=False), dict(tree="chain_2")))
    for split in (plain, tree):
        assert split["steps"] > 0 and math.isclose(sum(split["ms"].values()), split["step_ms"], rel_tol=1e-9)
        assert split["calls"]["attention"] == layers and split["calls"]["LM head"] == 1  # one pass a step
        assert all(split["ms"][s] > 0 for s in ("attention", "LM head"))
    assert plain["calls"]["heads"] == 1 and plain["ms"]["heads"] < tree["ms"]["heads"]  # a root-only step skips the heads
    assert list(plain["ms"]) == list(STAGES)


def test_corpus_drafts_run_in_the_bench_and_the_profile_for_a_model_with_a_corpus_and_stay_identical_to_hf(tmp_path, monkeypatch):
    import gzip

    from medusa_core import gguf

    monkeypatch.setenv(gguf.CACHE_ENV, str(tmp_path / "cache"))
    heads = write_tiny_medusa(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):", "category": "python"}\n')
    model = load_medusa_model(heads, quantization="none")
    ids = encode_prompt(model.tokenizer, "def add(a, b):")
    reply = [t for r in model.generate(ids, max_new_tokens=12, temperature=0.0, medusa=False) for t in r.token_ids]
    (heads / "distill").mkdir()
    with gzip.open(heads / "distill" / "train-none-greedy.jsonl.gz", "wt") as f:  # the model's own reply, twice
        for i in range(2):
            f.write(json.dumps({"id": i, "messages": [], "prompt_ids": ids[0].tolist(), "reply_ids": reply, "reply": ""}) + "\n")
    out = tmp_path / "out"
    assert main(["--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--methods", "hf,medusa+corpus:chain_2",
                 "--max-new-tokens", "12", "--repeats", "1", "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    markdown = (out / "summary.md").read_text()
    assert "| medusa+corpus:chain_2 |" in markdown and "No divergence" in markdown
    rows = list(csv.DictReader((out / "runs.csv").open()))
    assert int(next(r for r in rows if r["method"] == "medusa+corpus:chain_2")["ngram_tokens"]) > 0  # the corpus's chains accepted
    assert main(["profile", "--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--split-only",
                 "--tree", "chain_2", "--max-new-tokens", "8", "--rounds", "1", "--out", str(tmp_path / "prof"), "--threads", "1"]) == 0
    assert "| medusa+corpus:chain_2 |" in (tmp_path / "prof" / "profile.md").read_text()


def test_profile_at_the_chat_preset_decodes_every_step_at_the_apps_chat_settings(tiny, tmp_path, monkeypatch):
    import medusa_core.bench.profiling as profiling
    from medusa_core.bench.stepsplit import step_split
    from medusa_core.processors import CHAT_SAMPLING

    heads, prompts = tiny
    seen = []

    def recording(model, prompts, **kwargs):
        seen.append((kwargs["config"], kwargs["sampling"], model.chat_defaults))
        return step_split(model, prompts, **kwargs)

    monkeypatch.setattr(profiling, "step_split", recording)
    out = tmp_path / "prof"
    assert main(["profile", "--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--split-only",
                 "--preset", "chat", "--tree", "chain_2", "--max-new-tokens", "6", "--rounds", "1", "--out", str(out),
                 "--threads", "1"]) == 0
    assert len(seen) == 1 + 3  # the warm-up, then plain, Medusa and hybrid steps
    assert all(config == chat and not config.greedy and sampling == CHAT_SAMPLING for config, sampling, chat in seen)
    assert f"the chat preset, {CHAT_SAMPLING} verification" in (out / "profile.md").read_text()


def test_a_chat_preset_run_reports_the_tau_tuned_for_the_chat_preset_not_the_greedy_one(tmp_path):
    heads = write_tiny_medusa(tmp_path / "heads")
    (heads / "medusa_tuned.json").write_text(json.dumps({
        "cpu/none@greedy": {"choices": [[0]], "min_head_probability": 0.11},
        "cpu/none@chat": {"choices": [[0], [1]], "min_head_probability": 0.33},
    }))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):", "category": "python"}\n')
    out = tmp_path / "out"
    assert main([
        "--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--methods", "baseline,medusa:tuned",
        "--preset", "chat", "--max-new-tokens", "6", "--repeats", "1", "--out", str(out), "--no-progress", "--threads", "1",
    ]) == 0
    assert "min_head_probability: 0.33," in (out / "summary.md").read_text()  # what the chat preset's replies use
