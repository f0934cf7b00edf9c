"""The lean decoding step (``medusa_core.lean``): the same bits as transformers' forward, or no lean step at all."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from medusa_core import MedusaModel
from medusa_core.invariant import ATTENTION, ATTENTION_KERNEL, MAX_ROWWISE, READING, make_batch_invariant
from medusa_core.kvcache import new_cache
from medusa_core.lean import build
from medusa_core.lean.step import ROTARY_TABLE, LeanStep, unsupported
from medusa_core.quant.layers import Int4Linear
from medusa_core.steptree import static_tree
from tests.tiny_models import random_heads, tiny_backbone

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def int4_backbone(arch: str, attention: str | None = None, **overrides):
    """A tiny ``arch`` model whose decoder linears are ``Int4Linear`` (biases kept), batch-invariant as loading makes it;
    ``attention``: one of ``invariant.ROWWISE`` instead of the one loading picks (the compiled rows where built)."""
    model = tiny_backbone(arch, **overrides)
    for name, module in list(model.model.named_modules()):
        if name.rsplit(".", 1)[-1] in LINEARS:
            bias = None if module.bias is None else module.bias.detach()
            model.model.set_submodule(name, Int4Linear.quantize(module.weight.detach(), bias))
    model = make_batch_invariant(model, quantized=True)
    if attention is not None:
        model.set_attn_implementation(attention)
    return model


@pytest.fixture(scope="module")
def extension():
    module, why = build.load_extension()
    if module is None:
        pytest.skip(f"no lean step on this machine: {why}")  # the README's install gives CI a compiler
    return module


def _prefill(model, ids):
    cache = new_cache(model.config)
    with torch.inference_mode():
        model.model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def _tree_mask(tree, cur_len):
    prefix = torch.zeros(tree.num_nodes, cur_len, dtype=tree.bias.dtype)
    return torch.cat([prefix, tree.bias], dim=1)[None, None]


#: 128 wide with 4 heads of 32: q, k and v fill whole tiles of torch's packed layout, so the step fuses them (the demo's
#: case); the default 64-wide model's k and v (32 rows) do not, so with torch's kernel they run one by one. The
#: compiled int4_matmul's tiles are 16 outputs: it fuses both.
WIDE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


@pytest.mark.parametrize("kernel", ["compiled", "torch"], ids=["compiled-int4", "torch-int4"])
@pytest.mark.parametrize("attention", [ATTENTION_KERNEL, ATTENTION], ids=["row-kernel", "sdpa-rows"])
@pytest.mark.parametrize("shape", [{}, WIDE], ids=["narrow", "wide"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_the_lean_pass_gives_the_hidden_states_and_cache_entries_of_transformers_forward_bit_for_bit(
    extension, arch, shape, attention, kernel, monkeypatch
):
    model = int4_backbone(arch, attention, **shape)
    if kernel == "torch":  # torch's int4-pack kernel for every 4-bit layer (as on CPUs without AVX512-BF16)
        monkeypatch.setattr(Int4Linear, "kernel", None)
    elif Int4Linear.kernel is None:
        pytest.skip("no compiled int4 product here (no AVX512-BF16)")
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # biases go through the lean step too
    lean, why = LeanStep.for_backbone(model)
    assert lean is not None, why
    assert lean.row_kernel == (attention == ATTENTION_KERNEL)
    assert lean.fused == ((2, 2) if shape or Int4Linear.kernel is not None else (0, 2))
    # the norms' variance summed in the step in ATen's order (checked when built); other CPUs may keep ATen's calls
    assert lean.own_mean or platform.machine() not in ("x86_64", "AMD64")
    ids = torch.tensor([[5, 17, 40, 33, 3, 60, 7]])
    ours, theirs = _prefill(model, ids), _prefill(model, ids)
    # one token; a chain (every row a view of the cache); a branching tree (rows gathered, rows out of order)
    trees = [None, static_tree("chain", [[0], [0, 0]], torch.float32, "cpu"),
             static_tree("branchy", [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]], torch.float32, "cpu")]
    length = ids.shape[1]
    for step, tree in enumerate(trees * 2):
        n = 1 if tree is None else tree.num_nodes
        tokens = torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(step))
        positions = torch.arange(n) + length if tree is None else tree.position_ids + length
        mask = None if tree is None else _tree_mask(tree, length)
        with torch.inference_mode():
            got = lean(tokens, positions, mask, ours)
            want = model.model(input_ids=tokens[None], position_ids=positions[None], attention_mask=mask,
                               cache=theirs, use_cache=True).last_hidden_state[0]
        assert got is not None and torch.equal(got, want), (arch, step)
        for a, b in zip(ours.layers, theirs.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        if tree is not None:  # keep the root and its first child, as a step's cache update does
            ours.crop(2 - n), theirs.crop(2 - n)
        length = ours.get_seq_length()


@pytest.mark.parametrize("rope", [None, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}], ids=["default", "dynamic"])
def test_the_rotary_table_gives_the_rotary_embeddings_bits_and_grows_past_its_first_size(extension, rope):
    overrides = dict(WIDE, **({"rope_parameters": rope} if rope else {}))
    model = int4_backbone("llama", **overrides)  # head_dim 32: a table, unless the frequencies change with the length
    lean, why = LeanStep.for_backbone(model)
    assert lean is not None, why
    hidden = torch.zeros(1, 5, 128)
    for positions in (torch.tensor([0]), torch.tensor([9, 10, 10, 11, 12]), torch.tensor([ROTARY_TABLE + 70, 3])):
        rows = hidden[:, : len(positions)]
        with torch.inference_mode():
            got = lean._rotary(rows, positions, int(positions.max()) + 1)
            want = model.model.rotary_emb(rows, positions[None])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), positions
    assert (lean._table is None) == bool(rope)
    if not rope:
        assert lean._table[0].shape == (2 * ROTARY_TABLE, 32)


#: Passes of a prompt's reading: a short first pass (SDPA calls per row), or a first chunk of more than
#: ``MAX_ROWWISE`` rows (one causal SDPA call) and chunks after cached entries (one SDPA call with the causal mask),
#: long, short and of one token (a regenerated reply's prompt).
READING_PASSES = {"short-first-pass": [(0, 23)], "chunks": [(0, MAX_ROWWISE + 6), (MAX_ROWWISE + 6, 150), (150, 159), (159, 160)]}


@pytest.mark.parametrize("passes", list(READING_PASSES))
@pytest.mark.parametrize("attention", [ATTENTION_KERNEL, ATTENTION], ids=["row-kernel", "sdpa-rows"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_prompts_reading_in_one_call_a_pass_gives_transformers_reading_bit_for_bit(extension, arch, attention, passes):
    model = int4_backbone(arch, attention, **WIDE)
    lean, why = LeanStep.for_backbone(model)
    assert lean is not None, why
    chunks = READING_PASSES[passes]
    ids = torch.randint(0, 96, (1, chunks[-1][1]), generator=torch.Generator().manual_seed(4))
    ours, theirs = new_cache(model.config), new_cache(model.config)
    with torch.inference_mode():
        for begin, end in chunks:
            got = lean.read(ids[0, begin:end], ours)
            want = model.model(input_ids=ids[:, begin:end], cache=theirs, use_cache=True, **{READING: True}).last_hidden_state[0]
            assert got is not None and torch.equal(got, want), (begin, end)
            for a, b in zip(ours.layers, theirs.layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        step = torch.tensor([7])  # and decoding goes on from the same entries
        got = lean(step, torch.tensor([ids.shape[1]]), None, ours)
        want = model.model(input_ids=step[None], cache=theirs, use_cache=True).last_hidden_state[0]
    assert torch.equal(got, want)


def test_greedy_medusa_with_the_lean_step_repeats_transformers_forward_token_for_token(extension):
    backbone = int4_backbone("llama")
    model = MedusaModel(backbone, random_heads(backbone))
    assert model._steps.lean is not None and model.describe()["step"] == "lean"
    ids = torch.tensor([[5, 17, 40, 33, 3]])
    runs = {}
    for lean in (model._steps.lean, None):
        model._steps.lean = lean
        for medusa in (False, True):
            records = list(model.generate(ids, max_new_tokens=40, temperature=0, medusa=medusa, tree="sparse_16"))
            runs[lean is not None, medusa] = [t for r in records for t in r.token_ids]
    assert len(set(map(tuple, runs.values()))) == 1, runs


def test_with_sdpa_rows_a_lean_step_declines_a_branching_tree_over_a_cache_long_enough_for_replicas(extension, monkeypatch):
    from medusa_core.lean import step as step_mod

    model = int4_backbone("llama", ATTENTION)
    lean, _ = LeanStep.for_backbone(model)
    cache = _prefill(model, torch.tensor([[5, 17, 40, 33]]))
    monkeypatch.setattr(step_mod, "REPLICAS_FROM", 4)
    tree = static_tree("branchy", [[0], [1], [0, 0]], torch.float32, "cpu")
    with torch.inference_mode():
        assert lean(torch.tensor([1, 2, 3, 4]), tree.position_ids + 4, _tree_mask(tree, 4), cache) is None
        chain = static_tree("chain", [[0], [0, 0]], torch.float32, "cpu")  # views only: still lean
        assert lean(torch.tensor([1, 2, 3]), chain.position_ids + 4, _tree_mask(chain, 4), cache) is not None
    assert cache.get_seq_length() == 7  # the declined pass wrote nothing


def test_with_the_row_kernel_a_lean_step_runs_a_branching_tree_over_a_long_cache(extension, monkeypatch):
    from medusa_core.lean import step as step_mod

    model = int4_backbone("llama", ATTENTION_KERNEL)
    lean, _ = LeanStep.for_backbone(model)
    monkeypatch.setattr(step_mod, "REPLICAS_FROM", 4)
    ids = torch.tensor([[5, 17, 40, 33]])
    ours, theirs = _prefill(model, ids), _prefill(model, ids)
    tree = static_tree("branchy", [[0], [1], [0, 0]], torch.float32, "cpu")
    tokens, positions, mask = torch.tensor([1, 2, 3, 4]), tree.position_ids + 4, _tree_mask(tree, 4)
    with torch.inference_mode():
        got = lean(tokens, positions, mask, ours)
        want = model.model(input_ids=tokens[None], position_ids=positions[None], attention_mask=mask, cache=theirs,
                           use_cache=True).last_hidden_state[0]
    assert got is not None and torch.equal(got, want)


@pytest.mark.parametrize(
    ("arch", "overrides", "reason"),
    [("gemma", {}, "not 'gemma'"), ("llama", {"hidden_act": "gelu"}, "SiLU"),
     ("mistral", {"sliding_window": 64}, "sliding windows")],
)
def test_backbones_the_lean_step_does_not_cover_say_why(arch, overrides, reason):
    assert reason in unsupported(int4_backbone(arch, **overrides))


def test_a_float_backbone_keeps_transformers_forward_and_says_so():
    backbone = make_batch_invariant(tiny_backbone("llama"), quantized=False)
    model = MedusaModel(backbone, random_heads(backbone))
    assert model._steps.lean is None and "Int4Linear" in model._steps.lean_reason
    assert model.describe()["step"] == "transformers"


def test_the_loading_status_says_when_the_lean_step_is_being_compiled(monkeypatch):
    from app.engine import Engine

    engine = Engine("demo (gguf) on cpu")
    assert "compiling" not in engine.status()
    monkeypatch.setattr(build._building, "is_set", lambda: True)
    assert "compiling the lean decoding step" in engine.status()


def test_the_lean_step_can_be_turned_off_and_a_missing_compiler_is_a_reason_not_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv(build.ENV, "0")
    lean, why = LeanStep.for_backbone(int4_backbone("llama"))
    assert lean is None and build.ENV in why
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert "no C++ compiler" in build._build(tmp_path / "lean", print)


def test_bench_methods_ending_in_at_transformers_run_without_the_lean_pass_and_give_the_same_replies(extension):
    from medusa_core.bench.methods import build_methods
    from medusa_core.bench.run import run_once

    backbone = int4_backbone("llama")
    model = MedusaModel(backbone, random_heads(backbone))
    methods = build_methods(model, ["baseline", "baseline@transformers", "medusa:chain_2@transformers"], [])
    assert [(m.name, m.lean) for m in methods] == [
        ("baseline", True), ("baseline@transformers", False), ("medusa:chain_2@transformers", False)]
    with pytest.raises(ValueError, match="baseline and Medusa methods"):
        build_methods(model, ["hf@transformers"], [])
    passes = []
    lean = model._steps.lean

    class Counting:  # the lean step, counting its decoding passes (a prompt's reading is not one)
        def __call__(self, *args):
            passes.append(len(args[0]))
            return lean(*args)

        def read(self, *args):
            return lean.read(*args)

    model._steps.lean = Counting()
    runs = [run_once(model, m, torch.tensor([[5, 17, 40, 33]]), max_new_tokens=12) for m in methods]
    assert passes == [1] * 11  # the lean pass ran the first reply's steps only
    assert runs[0].output == runs[1].output == runs[2].output
    assert model._steps.lean is not None  # given back after the @transformers replies


def test_with_the_lean_step_turned_off_decoding_rows_run_as_sdpa_calls(monkeypatch):
    monkeypatch.setenv(build.ENV, "0")
    assert make_batch_invariant(tiny_backbone("llama"), quantized=False).config._attn_implementation == ATTENTION


def test_int4_tiles_hold_the_codes_scales_and_zeros_they_were_given():
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (48, 96), dtype=torch.uint8)
    scale, zero = torch.rand(48, 3), torch.randn(48, 3)
    back = Int4Linear(codes, scale, zero).groups()
    assert torch.equal(back[0], codes)
    assert torch.equal(back[1], scale.to(torch.bfloat16)) and torch.equal(back[2], zero.to(torch.bfloat16))


def test_the_compiled_int4_product_is_batch_invariant_side_by_side_and_within_one_rounding_of_float64(extension):
    if not extension.has_int4_matmul():
        pytest.skip("this build has no AVX512-BF16: torch's int4-pack kernel runs")
    torch.manual_seed(0)
    # 6, 26, 3 and 1 blocks of 16 outputs: whole pairs, then a pair and an unpaired block, then one block alone
    layers = [Int4Linear(torch.randint(0, 16, (n, 160)), torch.rand(n, 5) * 0.02, torch.randn(n, 5) * 0.01) for n in (96, 416, 48, 16)]
    x = torch.randn(40, 160).to(torch.bfloat16)
    for layer in layers:
        # 40 rows: five passes of 8 on AVX512-BF16 (9 rows: 4 + 5, 17: 5 + 6 + 6), of 16 and a last of 8 on AMX tiles
        full = extension.int4_matmul(x, layer.tiles)
        for m in (*range(1, 10), 15, 16, 17, 31, 32, 33):  # every row the bits of the same row in a call of m rows
            assert torch.equal(extension.int4_matmul(x[:m], layer.tiles), full[:m])
        exact = x.double() @ layer.dequantized().double().T
        assert ((full.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()  # one bfloat16 rounding
    separate = torch.cat([extension.int4_matmul(x, layer.tiles) for layer in layers[:3]], dim=1)
    # fused linears, every part but the last of whole pairs: side by side is the layout, and each column keeps its bits
    assert torch.equal(extension.int4_matmul(x, torch.cat([layer.tiles for layer in layers[:3]])), separate)
    # a part with an unpaired block before another: not the layout (decoder.h fuse's probe refuses such a fusion)
    odd_first = torch.cat([layers[2].tiles, layers[0].tiles])
    assert not torch.equal(extension.int4_matmul(x, odd_first), torch.cat([separate[:, 512:], separate[:, :96]], dim=1))
    with pytest.raises(RuntimeError, match="160 inputs, the weights 128"):
        extension.int4_matmul(torch.zeros(1, 160, dtype=torch.bfloat16), layers[0].tiles[:, :4].contiguous())


def test_loading_the_kernels_makes_every_int4_layer_use_the_compiled_product(extension):
    int4_backbone("llama")  # loading makes the model batch-invariant, which loads the kernels
    assert (Int4Linear.kernel is not None) == extension.has_int4_matmul()
    assert Int4Linear.kernel_name == (extension.int4_kernel() if extension.has_int4_matmul() else "torch")


def test_the_int4_product_runs_on_amx_tiles_where_the_cpu_has_them_unless_turned_off(extension):
    if not extension.has_int4_matmul():
        pytest.skip("this build has no AVX512-BF16: torch's int4-pack kernel runs")
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "").split()
    if "amx_bf16" not in flags:
        assert extension.int4_kernel() == "avx512-bf16"
        return
    assert extension.int4_kernel() == "amx"  # Linux ≥ 5.16 lets a process use the tiles
    # $MEDUSA_LEAN_AMX=0: the AVX512-BF16 dot products, within one bfloat16 rounding of the same products in float64
    script = """
import torch
from medusa_core.lean.build import load_extension
from medusa_core.quant.layers import Int4Linear
module, _ = load_extension()
torch.manual_seed(0)
layer = Int4Linear(torch.randint(0, 16, (64, 160)), torch.rand(64, 5) * 0.02, torch.randn(64, 5) * 0.01)
x = torch.randn(6, 160).to(torch.bfloat16)
out, exact = module.int4_matmul(x, layer.tiles).double(), x.double() @ layer.dequantized().double().T
print(module.int4_kernel(), bool(((out - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()))
"""
    env = {**os.environ, build.AMX_ENV: "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["avx512-bf16", "True"], done.stderr[-2000:]


def test_a_build_killed_midway_does_not_leave_the_next_start_waiting_forever(extension):
    """A first start stopped during the compile (Ctrl+C, a closed terminal) leaves torch's build ``lock`` file behind;
    torch then waits for it to go, for ever. The next load must notice that no process is building and go on."""
    import subprocess
    import sys

    stale = build.build_folder() / "lock"
    stale.touch()  # what a killed build leaves
    try:
        done = subprocess.run([sys.executable, "-c", "from medusa_core.lean import build; m, why = build.load_extension(); "
                               "print('loaded' if m is not None else why)"], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("load_extension waited on a stale build lock")
    finally:
        stale.unlink(missing_ok=True)
    assert done.stdout.strip() == "loaded", done.stderr[-2000:]


def test_a_torch_installed_elsewhere_builds_into_its_own_folder_and_is_announced(monkeypatch):
    """The build reads torch's headers from where torch is installed: another environment (a second clone's venv)
    must not reuse, and silently rebuild, this one's folder, but build its own and say so."""
    here = build.build_folder()
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    assert build.build_folder() != here


def test_the_profiles_stage_split_times_the_lean_pass_and_leaves_the_prompts_reading_to_it(extension):
    from medusa_core.bench.stepsplit import step_split

    backbone = int4_backbone("llama")
    model = MedusaModel(backbone, random_heads(backbone))
    lean = model._steps.lean
    split = step_split(model, [torch.tensor([[5, 17, 40, 33]])], max_new_tokens=6, medusa=False)
    assert split["steps"] == 5 and split["calls"]["lean pass"] == 1.0 and split["ms"]["lean pass"] > 0
    assert model._steps.lean is lean and type(lean).__call__ is LeanStep.__call__  # given back


def test_loading_a_cpu_model_compiles_the_lean_step_in_the_background_while_the_backbone_is_read(tmp_path, monkeypatch):
    """A first start builds the extension in a thread of its own, started before the backbone is read; the
    model's own ``load_extension`` calls wait for it, so it is built once."""
    from medusa_core import load_medusa_model, loading
    from tests.tiny_models import write_tiny_medusa

    monkeypatch.setattr(build, "_loaded", {})  # as in a fresh process (restored after: the real module stays loaded)
    monkeypatch.setattr(build, "_background", {})
    events = []
    monkeypatch.setattr(build, "_build", lambda folder, report: events.append(("build", threading.current_thread().name))
                        or "not built in this test")
    read = loading.load_backbone
    monkeypatch.setattr(loading, "load_backbone", lambda *a, **k: events.append(("read", [t.name for t in threading.enumerate()]))
                        or read(*a, **k))
    model = load_medusa_model(write_tiny_medusa(tmp_path), quantization=None)
    assert events[0][0] == "read" and "lean-build" in events[0][1] or events[0] == ("build", "lean-build")
    assert [e for e in events if e[0] == "build"] == [("build", "lean-build")]  # one build, the background one
    assert model.describe()["step"] == "transformers"  # it said why it could not build
