"""Smoke runs of the benchmark program and its profile on a tiny model: the files a run writes, thread counts,
presets, the llama.cpp anchor, draft methods, the corpus.

Wall-clock figures are never asserted: only arithmetic on given numbers and the files a run writes.
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from medusa_core import load_medusa_model, physical_cores
from medusa_core.bench import ALL, build_parser, encode_prompt, main
from tiny_models import write_tiny_medusa


def bench(heads, prompts, out, *args: str) -> int:
    """``python -m medusa_core.bench`` with ``args`` (a subcommand first, if any) on a tiny float32 model: its folder,
    the prompt file and the output folder added."""
    command = [args[0]] if args and not args[0].startswith("-") else []
    return main([*command, "--model", str(heads), "--quantization", "none", "--prompts", str(prompts), "--out", str(out),
                 *args[len(command):]])


def read_rows(path) -> list[dict[str, str]]:
    """The rows of a CSV file the benchmark wrote."""
    with open(path) as f:
        return list(csv.DictReader(f))


def test_benchmark_program_on_a_tiny_model_writes_csv_and_markdown_for_every_method(tiny, tmp_path):
    heads, prompts = tiny
    out = tmp_path / "out"
    assert bench(heads, prompts, out, "--trees", "chain_2,sparse_8", "--max-new-tokens", "12", "--repeats", "2",
                 "--no-progress", "--threads", "1") == 0
    methods = {"hf", "hf_pld", "baseline", "medusa:chain_2", "medusa:sparse_8", "ngram", "medusa+ngram:chain_2",
               "medusa+ngram:sparse_8"}
    rows = read_rows(out / "summary.csv")
    assert {r["method"] for r in rows} == methods
    assert {r["category"] for r in rows} == {"python", "coding", ALL}
    runs = read_rows(out / "runs.csv")
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
    assert bench(heads, prompts, out, "--methods", "hf,baseline,medusa:chain_2", "--max-new-tokens", "6", "--repeats",
                 "1", "--no-progress", "--threads", "1", "2") == 0
    assert torch.get_num_threads() == before  # the caller's setting is restored
    runs = read_rows(out / "runs.csv")
    assert sorted((r["method"], r["threads"], r["category"]) for r in runs) == sorted(
        (m, t, c) for m in ("hf", "baseline", "medusa:chain_2") for t in ("1", "2") for c in ("python", "multi-turn"))
    overall = [r for r in read_rows(out / "summary.csv") if r["category"] == ALL]
    assert [(r["method"], r["threads"]) for r in overall] == [
        ("hf", "1"), ("baseline", "1"), ("medusa:chain_2", "1"), ("hf", "2"), ("baseline", "2"), ("medusa:chain_2", "2")]
    assert all((r["identical"], r["compared"]) == ("2", "2") for r in overall if r["method"] != "hf")
    markdown = (out / "summary.md").read_text()
    assert "| medusa:chain_2 | 1 |" in markdown and "| medusa:chain_2 | 2 |" in markdown
    assert "medusa:chain_2 @2t" in markdown and "threads: 1, 2" in markdown


def test_greedy_with_a_repetition_penalty_gives_hf_the_same_penalty_and_reports_loops_and_endings(tiny, tmp_path):
    heads, prompts = tiny
    out = tmp_path / "out"
    assert bench(heads, prompts, out, "--methods", "hf,baseline,medusa:chain_2", "--max-new-tokens", "24",
                 "--repeats", "1", "--no-progress", "--threads", "1", "--repetition-penalty", "1.5") == 0
    overall = {r["method"]: r for r in read_rows(out / "summary.csv") if r["category"] == ALL}
    # the penalty changes the tiny model's reply, so identity with HF proves HF got the same processor
    assert all((overall[m]["identical"], overall[m]["compared"]) == ("2", "2") for m in ("baseline", "medusa:chain_2"))
    assert all(r["ended"] in ("True", "False") for r in read_rows(out / "runs.csv"))
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
    assert bench(heads, prompts, out, "--trees", "chain_2", "--max-new-tokens", "8", "--repeats", "1",
                 "--no-progress", "--temperature", "0.7", "--sampling", sampling, "--threads", "1") == 0
    rules = {r["method"]: r["sampling"] for r in read_rows(out / "runs.csv")}
    assert rules == {"hf": "sample", "hf_pld": "sample", "baseline": "sample", "medusa:chain_2": sampling, "ngram": sampling,
                     "medusa+ngram:chain_2": sampling}
    overall = {r["method"]: r for r in read_rows(out / "summary.csv") if r["category"] == ALL}
    assert float(overall["medusa:chain_2"]["acceleration"]) >= 1.0 and float(overall["medusa:chain_2"]["speedup"]) > 0
    assert all(r["compared"] == "0" for r in overall.values())
    markdown = (out / "summary.md").read_text()
    note = next(line for line in markdown.splitlines() if line.startswith("Sampled runs"))
    assert sampling in note and "sample" in note and "No divergence" not in markdown
    assert f"temperature: 0.7, sampling: {sampling}" in markdown


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
    assert bench(heads, prompts, out, "--methods", "hf,medusa:sparse_8,medusa+ngram:sparse_8", "--max-new-tokens",
                 "12", "--repeats", "1", "--no-progress", "--threads", "1", "--draft-tokens", "4",
                 "--min-path-probability", "0.1", "--min-head-probability", "0.9") == 0
    markdown = (out / "summary.md").read_text()
    assert "draft_tokens: 4, min_path_probability: 0.1, min_head_probability: 0.9" in markdown
    assert "No divergence" in markdown
    assert seen and set(seen) == {DraftConfig(max_tokens=4, min_path_probability=0.1, min_head_probability=0.9)}


def test_profile_split_only_times_each_stage_of_plain_medusa_and_hybrid_steps_and_they_add_up(tiny, tmp_path):
    from medusa_core.bench.stepsplit import STAGES, step_split

    heads, prompts = tiny
    out = tmp_path / "prof"
    assert bench(heads, prompts, out, "profile", "--split-only", "--tree", "chain_2", "--max-new-tokens", "8",
                 "--rounds", "1", "--threads", "1") == 0
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
    assert bench(heads, prompts, out, "--methods", "hf,medusa+corpus:chain_2", "--max-new-tokens", "12", "--repeats",
                 "1", "--no-progress", "--threads", "1") == 0
    markdown = (out / "summary.md").read_text()
    assert "| medusa+corpus:chain_2 |" in markdown and "No divergence" in markdown
    rows = read_rows(out / "runs.csv")
    assert int(next(r for r in rows if r["method"] == "medusa+corpus:chain_2")["ngram_tokens"]) > 0  # the corpus's chains accepted
    assert bench(heads, prompts, tmp_path / "prof", "profile", "--split-only", "--tree", "chain_2",
                 "--max-new-tokens", "8", "--rounds", "1", "--threads", "1") == 0
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
    assert bench(heads, prompts, out, "profile", "--split-only", "--preset", "chat", "--tree", "chain_2",
                 "--max-new-tokens", "6", "--rounds", "1", "--threads", "1") == 0
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
    assert bench(heads, prompts, out, "--methods", "baseline,medusa:tuned", "--preset", "chat", "--max-new-tokens",
                 "6", "--repeats", "1", "--no-progress", "--threads", "1") == 0
    assert "min_head_probability: 0.33," in (out / "summary.md").read_text()  # what the chat preset's replies use
