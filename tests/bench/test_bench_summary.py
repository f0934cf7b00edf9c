"""The benchmark's accounting on synthetic runs with known numbers: acceleration, overhead, speedup, tokens/s, outputs
that diverge, replies that loop.

Wall-clock figures are never asserted: only arithmetic on given numbers and the files a run writes.
"""

from __future__ import annotations

import math

import pytest

from medusa_core.bench import ALL, Run, find_divergences, first_difference, loops, summarise


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
