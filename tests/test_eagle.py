"""The EAGLE-style drafter as a draft source (medusa_core.eagle): its file is checked against the backbone, its
chains are verified like any draft (greedy output equals plain greedy decoding, whatever the drafter proposes), and
the trained one (assets/eagle-probe) drafts several tokens a step on the demo."""

from pathlib import Path

import pytest
import torch

from medusa_core import MedusaCheckpointError, eagle, load_medusa_model
from medusa_core.corpus import LazyCorpus
from medusa_core.eagle import EagleDrafter, EagleDrafts
from medusa_core.lean.build import load_extension
from medusa_core.quant.layers import Int4Linear
from test_demo_model import PROMPTS, _ids  # the demo's prompts and chat template
from tiny_models import random_drafter

TRAINED = Path(__file__).resolve().parent.parent / "assets" / "eagle-probe" / "drafter.safetensors"


@pytest.fixture(scope="module")
def demo():
    return load_medusa_model("demo", drafter=None)


def _greedy(model, ids, **kw):
    records = list(model.generate(ids, max_new_tokens=40, temperature=0.0, **kw))
    return [t for r in records for t in r.token_ids], records


def test_a_drafter_file_that_does_not_fit_the_backbone_is_refused_with_the_tensor_and_shapes(demo, tmp_path):
    bad = random_drafter(tmp_path / "bad.safetensors", demo.config, **{"fc.weight": torch.zeros(576, 1000)})
    with pytest.raises(MedusaCheckpointError, match=r"fc.weight should be \[576, 1152\].*found \[576, 1000\]"):
        demo.load_drafter(bad)
    with pytest.raises(MedusaCheckpointError, match="not a readable drafter file"):
        demo.load_drafter(tmp_path / "missing.safetensors")
    assert not demo.has_drafter


def test_eagle_drafts_need_a_drafter(demo):
    assert not demo.has_drafter
    with pytest.raises(ValueError, match="drafts='eagle' needs a drafter"):
        demo.generate(_ids(demo, PROMPTS[0]), max_new_tokens=4, drafts="eagle")


def test_greedy_eagle_drafts_equal_plain_greedy_even_from_a_random_drafter(tmp_path, monkeypatch):
    from medusa_core import DraftConfig

    model = load_medusa_model("demo")
    model.load_drafter(random_drafter(tmp_path / "random.safetensors", model.config))
    every_draft = DraftConfig(chain_depth=eagle.DEPTH, chain_threshold=0.0)  # every chain DEPTH deep: a random drafter is never confident
    monkeypatch.setattr(model, "_corpus", LazyCorpus(None))  # the drafter's chains alone
    for text in PROMPTS[:2]:
        ids = _ids(model, text)
        plain, _ = _greedy(model, ids, medusa=False)
        drafted, records = _greedy(model, ids, drafts="eagle", draft_config=every_draft)
        assert drafted == plain
        assert all(r.tree_nodes <= 1 + eagle.DEPTH for r in records[1:])  # the root and a chain of at most DEPTH drafts
        assert any(r.tree_nodes == 1 + eagle.DEPTH for r in records[1:])  # chains were proposed and verified


def test_the_trained_drafter_drafts_several_tokens_a_step_on_the_demo_and_stays_exact():
    model = load_medusa_model("demo")  # drafter="auto": the demo's shipped drafter (TRAINED)
    assert model.has_drafter
    produced = steps = 0
    for text in PROMPTS:
        ids = _ids(model, text)
        plain, _ = _greedy(model, ids, medusa=False)
        drafted, records = _greedy(model, ids, drafts="eagle")
        assert drafted == plain
        produced, steps = produced + len(drafted) - 1, steps + len(records) - 1
    assert produced / steps > 1.4  # accepted drafts: the probe's held-out chain makes ~1.8 tokens a step


def test_the_drafters_cache_refuses_more_entries_than_it_holds(demo, tmp_path):
    drafter = EagleDrafter(random_drafter(tmp_path / "d.safetensors", demo.config), demo.config, load_extension()[0])
    state = EagleDrafts(drafter, demo.backbone.get_input_embeddings(), Int4Linear.quantize(torch.randn(64, 576)), None, capacity=4)
    state.observe(torch.randn(3, 576), [1, 2, 3])
    assert state.length == 3 and len(state.propose(2)) == 2 and all(0 <= t < 64 for t in state.propose(2))
    with pytest.raises(ValueError, match="holds 4 entries; 5 asked"):
        state.observe(torch.randn(2, 576), [4, 5])


def test_observing_a_prompt_in_chunks_or_a_row_at_a_time_gives_the_same_states_and_drafts(demo, tmp_path):
    # the compiled layer computes each row on its own (batch-invariant products, attention per row): a prompt longer
    # than CHUNK read in chunks leaves the same cache and output as one token a step
    drafter = EagleDrafter(TRAINED, demo.config, load_extension()[0])
    embed, projection = demo.backbone.get_input_embeddings(), Int4Linear.quantize(torch.randn(256, 576))
    states, tokens = torch.randn(EagleDrafts.CHUNK + 37, 576), list(range(10, EagleDrafts.CHUNK + 47))
    whole, single = (EagleDrafts(drafter, embed, projection, None, capacity=128, threshold=0.0) for _ in range(2))
    whole.observe(states, tokens)
    for i in range(states.shape[0]):
        single.observe(states[i : i + 1], tokens[i : i + 1])
        assert single.last is not None  # read now, one row a call
    assert whole.length == single.length == states.shape[0]
    assert torch.equal(whole.last, single.last)
    assert torch.equal(whole.cache[:, :, :, : whole.length], single.cache[:, :, :, : single.length])
    assert whole.propose(2) == single.propose(2) and len(whole.propose(2)) == 2


def test_a_step_that_takes_the_corpus_chain_runs_no_pass_of_the_drafter_and_its_rows_are_read_with_the_next(demo):
    class Corpus:  # a chain at the steps listed
        def __init__(self, steps):
            self.steps, self.calls = steps, 0

        def extend(self, tokens):
            pass

        def propose(self, limit):
            self.calls += 1
            return [7] if self.calls in self.steps else []

    drafter = EagleDrafter(TRAINED, demo.config, load_extension()[0])
    embed, projection = demo.backbone.get_input_embeddings(), Int4Linear.quantize(torch.randn(256, 576))
    lazy, eager = (EagleDrafts(drafter, embed, projection, None, capacity=32, threshold=0.0, chains=Corpus({2, 3}))
                   for _ in range(2))
    reads = []
    observe_rows = drafter.observe_rows
    drafter.observe_rows = lambda *a: reads.append(a[3].shape[0]) or observe_rows(*a)
    rows = torch.randn(9, 576, generator=torch.Generator().manual_seed(5))
    chains = {"lazy": [], "eager": []}
    for step, (begin, end) in enumerate([(0, 3), (3, 4), (4, 6), (6, 7), (7, 9)]):
        tokens = list(range(10 + begin, 10 + end))
        eager.observe(rows[begin:end], tokens)
        assert eager.last is not None  # read at once, a call a step
        lazy.observe(rows[begin:end], tokens)
        chains["eager"].append(eager.propose(3))
        chains["lazy"].append(lazy.propose(3))
    assert chains["lazy"] == chains["eager"] and chains["lazy"][1:3] == [[7], [7]]  # the corpus's at steps 1 and 2
    # eager: a call a step (3, 1, 2, 1, 2 rows); lazy: none at the corpus's steps, their rows read with step 3's
    assert reads == [3, 3, 1, 2, 1, 4, 2, 2]
    assert torch.equal(lazy.cache[:, :, :, :9], eager.cache[:, :, :, :9]) and lazy.length == eager.length == 9


class _Reference:
    """The drafter's passes as the Python calls computed them before eagle_chain.h (the 4-bit fc and projection
    through ``Int4Linear``, the embedding module, the compiled layer one pass a call, ``draft_top``): the compiled
    observe and chain must give the same bits."""

    def __init__(self, state, path, module):
        from safetensors.torch import load_file

        self.s, self.module = state, module  # the state's cache, tables and threshold; its own length and output
        self.length, self.last = 0, None
        self.fc = Int4Linear.quantize(load_file(str(path))["fc.weight"])

    def layer(self, x, start):
        from medusa_core.invariant import row_keys
        from medusa_core.lean.step import MODEL

        s, r = self.s, x.shape[0]
        rows = row_keys(None, r, start + r)
        return s.d.layer.forward(x[None].contiguous(), s.cos[None, start : start + r], s.sin[None, start : start + r],
                                 [s.cache[0]], [s.cache[1]], start, [], [], [], rows.prefix, rows.offsets, rows.extras, MODEL)[0]

    def observe(self, embed, states, tokens):
        x = self.fc(torch.cat([states.float(), embed(torch.tensor(tokens)).float()], -1))
        for begin in range(0, x.shape[0], EagleDrafts.CHUNK):
            out = self.layer(x[begin : begin + EagleDrafts.CHUNK], self.length + begin)
        self.length += x.shape[0]
        self.last = out[-1:]

    def propose(self, embed, projection, draft_ids, most):
        drafts, out, log_chance = [], self.last, 0.0
        before = self.module.set_one_row_dots(True)  # the chain's one-row products take the dot products, AMX or not
        try:
            while len(drafts) < most:
                column, log_p = self.module.draft_top(projection(out), 1, torch.ones(1))
                log_chance += float(log_p)
                if log_chance < self.s.log_threshold:
                    break
                drafts.append(int(draft_ids[column[0, 0]]))
                if len(drafts) < most:
                    x = self.fc(torch.cat([out, embed(torch.tensor(drafts[-1:])).float()], -1))
                    out = self.layer(x, self.length + len(drafts) - 1)
        finally:
            self.module.set_one_row_dots(before)
        return drafts


def test_the_compiled_observe_and_chain_give_the_python_calls_bits(demo):
    module = load_extension()[0]
    drafter = EagleDrafter(TRAINED, demo.config, module)
    embed = demo.backbone.get_input_embeddings()
    projection = Int4Linear.quantize(torch.randn(512, 576, generator=torch.Generator().manual_seed(1)) * 0.1)
    draft_ids = torch.randperm(demo.vocab_size, generator=torch.Generator().manual_seed(2))[:512]
    states = torch.randn(EagleDrafts.CHUNK + 5, 576, generator=torch.Generator().manual_seed(3)) * 3
    tokens = torch.randint(demo.vocab_size, (states.shape[0],), generator=torch.Generator().manual_seed(4)).tolist()
    lengths = []
    for threshold in (0.0, 0.1):
        compiled, python = (EagleDrafts(drafter, embed, projection, draft_ids, capacity=128, depth=4, threshold=threshold)
                            for _ in range(2))
        reference = _Reference(python, TRAINED, module)
        compiled.observe(states, tokens)
        reference.observe(embed, states, tokens)
        assert compiled.length == reference.length and torch.equal(compiled.last, reference.last)
        chain = compiled.propose(6)
        assert chain == reference.propose(embed, projection, draft_ids, 4)
        assert torch.equal(compiled.cache, python.cache)  # the drafts' entries past length too
        lengths.append(len(chain))
    assert lengths[0] == 4 and 0 < lengths[1] < 4, lengths  # every draft, then a chain the threshold stops
    assert module.set_one_row_dots(False) is False  # the chain and the reference left the thread's products as they were


def test_a_chain_stops_where_its_probability_falls_below_the_threshold(demo):
    # a projection of zeros: every draft has probability 1/256, a chain of k drafts 256**-k
    drafter = EagleDrafter(TRAINED, demo.config, load_extension()[0])
    embed, flat = demo.backbone.get_input_embeddings(), Int4Linear.quantize(torch.zeros(256, 576))
    chains = {}
    for threshold in (0.0, 0.003, 0.01):
        state = EagleDrafts(drafter, embed, flat, None, capacity=8, depth=3, threshold=threshold)
        state.observe(torch.randn(2, 576), [1, 2])
        chains[threshold] = state.propose(5)
    assert chains[0.0] == [0, 0, 0]  # depth drafts (the limit of 5 is larger); ties go to the first column
    assert chains[0.003] == [0]  # 1/256 ≥ 0.003 > 1/256²
    assert chains[0.01] == []  # not even the first draft


def test_the_corpus_chain_is_taken_where_the_corpus_has_one():
    class Corpus:  # an NgramDrafter's interface: a chain at every other step
        def __init__(self):
            self.calls = 0

        def extend(self, tokens):
            pass

        def propose(self, limit):
            self.calls += 1
            return [7, 8, 9][:limit] if self.calls % 2 else []

    model = load_medusa_model("demo")  # with its shipped drafter (TRAINED)
    drafter = EagleDrafts(model._drafter[0], model.backbone.get_input_embeddings(), *model._drafter[1:], capacity=8,
                          threshold=0.0, chains=Corpus())
    drafter.observe(torch.randn(2, 576), [1, 2])
    assert drafter.propose(3) == [7, 8, 9]
    assert len(drafter.propose(3)) == min(3, eagle.DEPTH) and drafter.propose(2) == [7, 8]  # the drafter's, then the corpus's


def test_without_the_compiled_extension_a_drafter_is_refused_with_the_reason(monkeypatch, tmp_path):
    import medusa_core.model as model_module

    model = load_medusa_model("demo", drafter=None)
    monkeypatch.setattr(model._steps, "extension", None)
    monkeypatch.setattr(model_module, "load_extension", lambda: (None, "no C++ compiler found"))
    with pytest.raises(ValueError, match="compiled extension, which is not available here: no C\\+\\+ compiler found"):
        model.load_drafter(random_drafter(tmp_path / "d.safetensors", model.config))
    assert not model.has_drafter


def test_the_demo_loads_its_shipped_drafter_unless_told_not_to():
    assert load_medusa_model("demo").has_drafter
    assert not load_medusa_model("demo", drafter=None).has_drafter


def test_a_head_folder_with_a_drafter_beside_its_heads_gets_it_and_a_given_file_that_does_not_fit_is_refused(demo, tmp_path):
    from medusa_core.gguf import demo_gguf_file
    from medusa_core.loading import DEMO_MODEL_DIR, DRAFTER_FILE

    for name in ("config.json", "medusa_lm_head.safetensors"):
        (tmp_path / name).symlink_to(DEMO_MODEL_DIR / name)
    base = str(demo_gguf_file())
    assert not load_medusa_model(tmp_path, base_model=base).has_drafter  # none shipped
    random_drafter(tmp_path / DRAFTER_FILE, demo.config)
    assert load_medusa_model(tmp_path, base_model=base).has_drafter
    bad = random_drafter(tmp_path / "bad.safetensors", demo.config, **{"n1.w": torch.ones(7)})
    with pytest.raises(MedusaCheckpointError, match=r"n1.w should be \[576\]"):
        load_medusa_model(tmp_path, base_model=base, drafter=bad)


def test_a_shipped_drafter_that_cannot_run_here_is_left_out_with_a_line_and_a_given_one_raises(monkeypatch):
    from medusa_core import MedusaModel
    from medusa_core.loading import DEMO_DRAFTER

    def no_extension(self, path):
        raise ValueError("the drafter runs in the lean step's compiled extension, which is not available here: no C++ compiler")

    monkeypatch.setattr(MedusaModel, "load_drafter", no_extension)
    lines = []
    model = load_medusa_model("demo", report=lines.append)
    assert not model.has_drafter
    assert any(line.startswith("no EAGLE drafter: ") and "no C++ compiler" in line for line in lines)
    with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
        load_medusa_model("demo", drafter=DEMO_DRAFTER)


def _tuned_demo_folder(tmp_path, entry_fields):
    """A head folder of the demo's files whose medusa_tuned.json holds, for this machine at both presets, a one-path
    tree and ``entry_fields``."""
    import json

    from medusa_core.loading import DEMO_MODEL_DIR, TUNED_FILE
    from medusa_core.tuned import TUNED_PRESETS, machine_class, tuned_key

    for name in ("config.json", "medusa_lm_head.safetensors", "medusa_calibration.json", "draft_ranking.json"):
        (tmp_path / name).symlink_to(DEMO_MODEL_DIR / name)
    machine = machine_class(torch.device("cpu"), "gguf")
    entries = {tuned_key(torch.device("cpu"), "gguf", p, machine): {"choices": [[0]], "nodes": 2, **entry_fields}
               for p in TUNED_PRESETS}
    (tmp_path / TUNED_FILE).write_text(json.dumps(entries))
    return tmp_path


def test_the_chain_tuned_for_the_settings_sets_the_drafters_depth_unless_the_draft_config_sets_one(tmp_path):
    from medusa_core import DraftConfig
    from medusa_core.gguf import demo_gguf_file
    from medusa_core.processors import CHAT_PRESET, SamplingConfig

    folder = _tuned_demo_folder(tmp_path, {"chain_depth": 2, "chain_threshold": 0.0, "chain_measured_speedup": 1.3})
    model = load_medusa_model(folder, base_model=str(demo_gguf_file()), drafter=None)
    for config in (SamplingConfig(), CHAT_PRESET):
        tuned = model.tuned_for(config)
        assert (tuned.chain_depth, tuned.chain_threshold, tuned.chain_measured_speedup) == (2, 0.0, 1.3)
    model.load_drafter(random_drafter(tmp_path / "random.safetensors", model.config))  # never confident: threshold 0
    model._corpus = LazyCorpus(None)  # the drafter's chains alone
    ids = _ids(model, PROMPTS[0])
    plain, _ = _greedy(model, ids, medusa=False)
    nodes = {}
    for draft_config, depth in ((DraftConfig(), 2), (DraftConfig(chain_depth=4), 4), (DraftConfig(chain_threshold=0.99), 2)):
        drafted, records = _greedy(model, ids, drafts="eagle", draft_config=draft_config)
        assert drafted == plain
        assert max(r.tree_nodes for r in records[1:]) <= 1 + depth  # the root and chains of the tuned (or given) depth
        nodes[draft_config] = [r.tree_nodes for r in records[1:]]
    assert max(nodes[DraftConfig(chain_depth=4)]) == 5 and max(nodes[DraftConfig()]) == 3
    # the tuned threshold 0 takes every draft; a given 0.99 cuts the random drafter's chains
    assert sum(n == 3 for n in nodes[DraftConfig()]) >= len(nodes[DraftConfig()]) - 2  # all but where the limit cuts
    assert sum(nodes[DraftConfig(chain_threshold=0.99)]) < sum(nodes[DraftConfig()])


def test_a_tuned_chain_out_of_range_is_refused_naming_the_file_and_the_value(tmp_path):
    from medusa_core.gguf import demo_gguf_file

    cases = (({"chain_depth": 0, "chain_threshold": 0.3}, "chain_depth must be an integer >= 1, got 0"),
             ({"chain_depth": 3, "chain_threshold": 1.5}, "chain_threshold must be in \\[0, 1\\], got 1.5"))
    for i, (fields, message) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        folder = _tuned_demo_folder(tmp_path / str(i), fields)
        with pytest.raises(MedusaCheckpointError, match=f"medusa_tuned.json .*{message}"):
            load_medusa_model(folder, base_model=str(demo_gguf_file()), drafter=None)


def test_the_profiles_split_times_the_drafter_as_a_stage_of_its_own_and_lists_an_eagle_step(tmp_path):
    import argparse
    import math

    from medusa_core.bench.profiling import split_table
    from medusa_core.bench.stepsplit import step_split
    from medusa_core.bench.tune import preset_settings

    model = load_medusa_model("demo")  # with its drafter
    ids = [_ids(model, PROMPTS[0])]
    split = step_split(model, ids, max_new_tokens=12, temperature=0.0, drafts="eagle")
    assert split["calls"]["drafter"] >= 2 and split["ms"]["drafter"] > 0  # each step reads its accepted rows, then proposes
    assert math.isclose(sum(split["ms"].values()), split["step_ms"], rel_tol=1e-9)
    plain = step_split(model, ids, max_new_tokens=12, temperature=0.0, medusa=False)
    assert plain["calls"]["drafter"] == 0
    config, sampling = preset_settings(model, "greedy")
    args = argparse.Namespace(rounds=1, max_new_tokens=6, clock="wall", preset="greedy")
    table = "\n".join(split_table(model, ids, args, model.default_tree, dict(config=config, sampling=sampling, seed=0)))
    assert "| eagle |" in table and "| drafter |" in table
