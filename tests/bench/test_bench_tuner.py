"""The tree tuner's choices on synthetic latency curves (size, τ, confirmation), its tuned file, and its runs and
the chain tuner on a tiny model.

Wall-clock figures are never asserted: only arithmetic on given numbers and the files a run writes.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

from medusa_core import CHAT_PRESET, load_medusa_model, optimal_tree
from medusa_core.bench import (build_parser, choose_min_head_probability, choose_tree_size, confirm_choice, main,
                               marginal_token_cost, monotone_latency, predict_speedups, tuned_threshold, write_tuned)
from medusa_core.trees import SMALL_MODEL_RANK_ACCURACY


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
