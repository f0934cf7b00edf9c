"""The compiled helpers around the lean step: the heads' proposal (``medusa_core.lean.drafting``, ``draft_heads.h``), the
row attention's thread split, and the LM head's refinement (``refine_top.h``)."""

from __future__ import annotations

import copy

import pytest
import torch

from medusa_core import MedusaModel
from medusa_core.heads import MedusaHeads
from medusa_core.lean import build
from medusa_core.lean.drafting import LeanDrafts, unsupported
from tests.test_lean import extension, int4_backbone  # noqa: F401 (extension: the module's fixture)
from tests.tiny_models import random_heads, tiny_backbone


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def _reference_states(hidden, row, root_weight, weights, biases, depth):
    """The kernel's arithmetic in float64: x = h (+ R_k e), then x += SiLU(W bf16(x) + b) per block."""
    layers = len(weights) // depth
    out = []
    for k in range(depth):
        x = hidden.double()
        if row is not None:
            x = x + _bf16(root_weight[k]) @ _bf16(row)
        for w, b in zip(weights[k * layers:(k + 1) * layers], biases[k * layers:(k + 1) * layers]):
            x = x + torch.nn.functional.silu(_bf16(w) @ _bf16(x) + b.double())
        out.append(x)
    return torch.stack(out)


@pytest.mark.parametrize("size", [64, 48, 576], ids=["H64", "H48-tail", "H576"])
@pytest.mark.parametrize("layers", [0, 1, 2])
@pytest.mark.parametrize("rooted", [False, True], ids=["medusa", "root"])
def test_head_states_computes_the_residual_blocks_over_the_root_conditioned_input(extension, size, layers, rooted):
    g = torch.Generator().manual_seed(size + layers)
    depth = 3
    hidden = torch.randn(size, generator=g)
    row = torch.randn(size, generator=g).to(torch.bfloat16) if rooted else None
    root_weight = (torch.randn(depth, size, size, generator=g) / size**0.5).to(torch.bfloat16) if rooted else None
    weights = [(torch.randn(size, size, generator=g) / size**0.5).to(torch.bfloat16) for _ in range(depth * layers)]
    biases = [torch.randn(size, generator=g).to(torch.bfloat16) for _ in range(depth * layers)]
    table = torch.empty(0) if row is None else torch.stack([torch.zeros(size, dtype=torch.bfloat16), row])  # row 1
    states = extension.head_states(
        hidden, table, 1, torch.empty(0) if root_weight is None else root_weight, weights, biases, depth,
    )
    assert states.dtype == torch.bfloat16 and states.shape == (depth, size)
    expected = _reference_states(hidden, row, root_weight, weights, biases, depth)
    torch.testing.assert_close(states.double(), expected, rtol=1e-2, atol=1e-2)  # the output is rounded to bfloat16


def test_head_states_are_the_same_bits_on_one_thread_and_on_two(extension, threads):
    g = torch.Generator().manual_seed(7)
    hidden, row = torch.randn(576, generator=g), torch.randn(576, generator=g).to(torch.bfloat16)
    root_weight = (torch.randn(2, 576, 576, generator=g) / 24).to(torch.bfloat16)
    weights = [(torch.randn(576, 576, generator=g) / 24).to(torch.bfloat16) for _ in range(4)]
    biases = [torch.randn(576, generator=g) for _ in range(4)]
    runs = []
    for n in (1, 2):
        threads(n)
        runs.append(extension.head_states(hidden, row[None], 0, root_weight, weights, biases, 2))
    assert torch.equal(runs[0], runs[1])


def test_draft_top_gives_each_rows_top_k_and_its_log_probabilities_at_its_temperature(extension):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 1000, generator=g) * 4
    temperatures = torch.tensor([1.0, 0.5, 2.0])
    columns, log_p = extension.draft_top(logits, 5, temperatures)
    top = logits.topk(5, dim=-1)
    assert torch.equal(columns, top.indices)
    expected = torch.log_softmax(logits.double() / temperatures[:, None].double(), dim=-1).gather(-1, top.indices)
    torch.testing.assert_close(log_p.double(), expected, rtol=0, atol=2e-5)
    bf16_columns, _ = extension.draft_top(logits.to(torch.bfloat16), 5, temperatures)  # the heads' own dtype
    assert torch.equal(bf16_columns[:, 0], logits.to(torch.bfloat16).float().argmax(-1))


def test_draft_top_breaks_ties_towards_the_lower_column_and_takes_k_up_to_the_whole_row(extension):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    columns, log_p = extension.draft_top(logits, 5, torch.ones(1))
    assert columns.tolist() == [[1, 2, 4, 0, 3]]
    assert torch.allclose(log_p.exp().sum(), torch.tensor(1.0), atol=1e-6)
    with pytest.raises(RuntimeError, match="1 <= k <= S"):
        extension.draft_top(logits, 6, torch.ones(1))


def _bf16_heads(backbone, rooted: bool, layers: int = 1) -> MedusaHeads:
    heads = random_heads(backbone, num_heads=4) if not rooted else MedusaHeads.from_backbone(backbone, 4, root_conditioned=True)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        if rooted:
            heads.root_weight.add_(torch.randn(heads.root_weight.shape, generator=g) * 0.2)
            for head in heads:
                for p in head[:-1].parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return heads.to(torch.bfloat16)


@pytest.mark.parametrize("rooted", [False, True], ids=["medusa", "root"])
def test_the_compiled_proposal_ranks_drafts_as_the_heads_in_float64_do(extension, rooted):
    backbone = int4_backbone("llama")
    heads = _bf16_heads(backbone, rooted)
    reference = copy.deepcopy(heads).double()
    if rooted:
        reference._root_embedding = (copy.deepcopy(heads.root_embedding).double(),)
    model = MedusaModel(backbone, heads)
    steps = model._steps
    if steps.lean_drafts is None:
        pytest.skip(f"no compiled proposal here: {steps.lean_drafts_reason}")
    temperatures = torch.tensor([0.5, 1.0, 1.5, 2.0])
    g = torch.Generator().manual_seed(11)
    checked = 0
    with torch.inference_mode():
        for _ in range(20):
            hidden = torch.randn(1, backbone.config.hidden_size, generator=g)
            root = torch.randint(0, backbone.config.vocab_size, (1,), generator=g)
            columns, log_p = steps.lean_drafts.top(hidden, root, 4, 3, temperatures)  # [4, 3] each
            logits = reference.draft_logits(hidden.double(), 4, root=root if rooted else None)[:, 0]  # [4, V]
            # First-order bound of bfloat16 rounding: of each state (2^-8 of it, through |W|) and of each logit (2^-8 of
            # it), twice over for the roundings inside the residual blocks.
            states = reference.block_states(hidden.double(), 4, root=root if rooted else None)[:, 0]  # [4, H]
            weights = torch.stack([head[-1].weight.double() for head in reference])  # [4, V, H]
            error = 2 * 2**-8 * ((weights.abs() @ states.abs()[..., None])[..., 0] + logits.abs())  # [4, V]
            top = logits.topk(2, dim=-1)
            clear = top.values[:, 0] - top.values[:, 1] > error.gather(-1, top.indices).sum(-1)  # no rounding flips these
            assert torch.equal(columns[clear, 0], top.indices[clear, 0])
            checked += int(clear.sum())
            # a log-probability carries its logit's error and the log-sum-exp's (at most the largest)
            bound = (error.gather(-1, columns) + error.amax(dim=-1, keepdim=True)) / temperatures[:, None].double()
            expected = torch.log_softmax(logits / temperatures[:, None].double(), dim=-1).gather(-1, columns)
            assert ((log_p.double() - expected).abs() <= bound).all()
    assert checked >= 40


def test_greedy_medusa_with_the_compiled_proposal_repeats_plain_greedy(extension):
    backbone = int4_backbone("llama")
    model = MedusaModel(backbone, _bf16_heads(backbone, rooted=True))
    if model._steps.lean_drafts is None:
        pytest.skip(f"no compiled proposal here: {model._steps.lean_drafts_reason}")
    ids = torch.tensor([[5, 17, 40, 33, 3]])
    runs = {}
    for medusa in (False, True):
        records = list(model.generate(ids, max_new_tokens=40, temperature=0, medusa=medusa, tree="mc_sim_7b_63"))
        runs[medusa] = [t for r in records for t in r.token_ids]
        steps = len(records)
    assert runs[True] == runs[False]
    assert steps < 41  # the drafts were used: some step accepted more than one token


def test_heads_the_compiled_proposal_does_not_run_say_why(monkeypatch):
    backbone = tiny_backbone("llama")
    assert "bfloat16" in unsupported(random_heads(backbone))  # float32 heads keep ATen's products
    assert "MedusaHeads" in unsupported(torch.nn.Linear(4, 4))
    monkeypatch.setenv(build.ENV, "0")
    drafts, why = LeanDrafts.for_heads(random_heads(backbone).to(torch.bfloat16))
    assert drafts is None and build.ENV in why


def test_a_depth_beyond_the_heads_is_an_error_that_names_the_range(extension):
    backbone = int4_backbone("llama")
    drafts = LeanDrafts(_bf16_heads(backbone, rooted=True), extension)
    with pytest.raises(ValueError, match=r"depth must be 1\.\.4"):
        drafts.top(torch.zeros(1, backbone.config.hidden_size), torch.tensor([1]), 5, 2, torch.ones(4))
    with pytest.raises(ValueError, match="need root="):
        drafts.top(torch.zeros(1, backbone.config.hidden_size), None, 1, 2, torch.ones(4))


def test_the_row_attention_split_over_threads_gives_the_bits_of_one_thread(extension, threads):
    g = torch.Generator().manual_seed(2)
    rows, heads, kv_heads, dh, length = 4, 8, 2, 64, 700
    query = torch.randn(rows, heads, dh, generator=g)
    key, value = torch.randn(kv_heads, length, dh, generator=g), torch.randn(kv_heads, length, dh, generator=g)
    prefix = [600, 600, 650, 690]
    extras = torch.tensor([600, 601, 650, 660, 695])
    offsets = [0, 1, 3, 3, 5]
    runs = []
    for n in (1, 2):
        threads(n)
        runs.append(extension.row_attention(query, key, value, prefix, offsets, extras, dh**-0.5))
    assert torch.equal(runs[0], runs[1])


def test_refine_top_recomputes_each_rows_k_largest_in_float32_and_leaves_the_rest(extension):
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(300, 72, generator=g).to(torch.bfloat16)  # K = 72: a tail after four 16-lane chunks
    bias = torch.randn(300, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 72, generator=g)
    coarse = (x @ weight.float().T + bias.float()) + torch.randn(3, 300, generator=g) * 0.05  # a first pass's error
    logits = coarse.clone()
    extension.refine_top(logits, weight, x, bias, 8)
    exact = x.double() @ weight.double().T + bias.double()
    top = coarse.topk(8, dim=-1).indices
    changed = logits != coarse
    assert changed.sum(-1).tolist() == [8, 8, 8] and torch.equal(changed.nonzero()[:, 1].view(3, 8).sort().values, top.sort().values)
    torch.testing.assert_close(logits.gather(-1, top).double(), exact.gather(-1, top), rtol=1e-6, atol=1e-5)
    alone = torch.cat([coarse[i : i + 1].clone() for i in range(3)])
    for i in range(3):
        extension.refine_top(alone[i : i + 1], weight, x[i : i + 1].contiguous(), bias, 8)
    assert torch.equal(alone, logits)  # a row's values do not depend on the other rows


def test_refine_top_breaks_ties_towards_the_lower_column(extension):
    weight, x = torch.ones(6, 16, dtype=torch.bfloat16), torch.ones(1, 16)
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 0.0]])
    extension.refine_top(logits, weight, x, torch.empty(0, dtype=torch.bfloat16), 2)
    assert logits.tolist() == [[0.0, 16.0, 1.0, 16.0, 2.0, 0.0]]


def test_an_int4_backbones_lm_head_refines_through_the_compiled_call_with_the_values_of_aten(extension):
    backbone = int4_backbone("llama")  # make_batch_invariant: an int4 LM head with the compiled refinement
    head = backbone.get_output_embeddings()
    assert head.refine_kernel is not None and head.refine_top > 0
    x = torch.randn(4, backbone.config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        compiled = head(x)
        head.refine_kernel = None
        aten = head(x)
    torch.testing.assert_close(compiled, aten, rtol=1e-6, atol=1e-5)  # the same k values, summed in another order
    assert torch.equal(compiled.argmax(-1), aten.argmax(-1))


def test_a_bfloat16_lookup_tables_root_row_is_read_in_place_with_the_values_the_module_gives(extension):
    from medusa_core.quant.layers import BF16Embedding

    backbone = int4_backbone("llama")
    heads = _bf16_heads(backbone, rooted=True)  # the tiny backbone's float32 nn.Embedding: read through the module
    drafts = LeanDrafts(heads, extension)
    hidden = torch.randn(1, backbone.config.hidden_size, generator=torch.Generator().manual_seed(8))
    through_module = [drafts.top(hidden, torch.tensor([r]), 4, 3, torch.ones(4)) for r in (3, 50)]
    heads._root_embedding = (BF16Embedding.from_weight(heads.root_embedding.weight.detach(), torch.float32),)
    in_place = [drafts.top(hidden, torch.tensor([r]), 4, 3, torch.ones(4)) for r in (3, 50)]
    for (a_columns, a_log_p), (b_columns, b_log_p) in zip(through_module, in_place):
        assert torch.equal(a_columns, b_columns) and torch.equal(a_log_p, b_log_p)
    assert not torch.equal(in_place[0][1], in_place[1][1])  # the root matters
