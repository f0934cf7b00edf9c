"""Batch invariance (medusa_core.invariant, medusa_core.quant): every op of a CPU decoding step gives a
row the same bits alone or among N rows, so greedy Medusa equals plain greedy by construction. Kernel
by kernel, then on the real demo model: every accepted tree node's logits are bitwise those of plain
one-token decoding at the same position, for the 4-bit default backbone and the float32 one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, dequantize, quantize

from medusa_core import load_medusa_model
from medusa_core.invariant import ATTENTION_KERNEL, RowwiseLinear, kernel_attention, load_kernel, rowwise_attention
from medusa_core.quant.gguf_blocks import int4_groups
from medusa_core.quant.layers import LM_HEAD_REFINE, BF16Linear, Int4Linear, int4_lm_head

ROWS = (2, 3, 4, 5, 8, 17, 33)
BF16_CPU = torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _rows_alone_equal_rows_together(layer, width: int) -> None:
    torch.manual_seed(0)
    for m in ROWS:
        x = torch.randn(m, width)
        together = layer(x)
        alone = torch.cat([layer(x[r : r + 1]) for r in range(m)])
        assert torch.equal(together, alone), m


@pytest.mark.parametrize("kernel", ["torch", "compiled"])
def test_int4_linear_rows_are_bitwise_the_same_alone_and_in_passes_of_any_size(kernel, monkeypatch):
    if kernel == "compiled":
        load_kernel()
        if Int4Linear.kernel is None:
            pytest.skip("no compiled int4 product here (no compiler, or no AVX512-BF16)")
    else:
        monkeypatch.setattr(Int4Linear, "kernel", None)  # torch's int4-pack kernel
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (64, 96))
    layer = Int4Linear(codes, torch.rand(64, 3) * 0.01, torch.randn(64, 3) * 0.01, bias=torch.randn(64))
    _rows_alone_equal_rows_together(layer, 96)
    x = torch.randn(5, 96)  # both kernels multiply by dequantized(), each output rounded to bfloat16 once
    exact = x.to(torch.bfloat16).double() @ layer.dequantized().double().T + layer.bias.double()
    assert ((layer(x).double() - exact).abs() <= exact.abs() * 2**-7 + 1e-3).all()


@pytest.mark.skipif(not BF16_CPU, reason="bfloat16 matmuls are batch-invariant on CPUs with AVX512-BF16")
@pytest.mark.parametrize("refine_top", [0, 16])
def test_bf16_linear_rows_are_bitwise_the_same_alone_and_in_passes_of_any_size(refine_top):
    _rows_alone_equal_rows_together(BF16Linear.from_weight(torch.randn(4096, 576) * 0.02, refine_top=refine_top), 576)


def test_a_bf16_lm_head_gives_its_top_logits_as_float32_products_of_its_weights():
    torch.manual_seed(2)
    head = BF16Linear.from_weight(torch.randn(4096, 576) * 0.05, refine_top=16)
    x = torch.randn(5, 576)
    logits = head(x)
    exact = x @ head.weight.float().T  # float32 products of the stored weights
    top = logits.topk(16, dim=-1).indices
    torch.testing.assert_close(logits.gather(-1, top), exact.gather(-1, top), rtol=1e-6, atol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    coarse = BF16Linear.from_weight(head.weight)(x)  # without refinement: bf16-rounded logits
    assert (coarse.gather(-1, top) != exact.gather(-1, top)).any()


@pytest.mark.skipif(not BF16_CPU, reason="bfloat16 matmuls are batch-invariant on CPUs with AVX512-BF16")
def test_an_int4_lm_head_rows_are_bitwise_the_same_alone_and_in_passes_of_any_size():
    head = int4_lm_head(torch.randn(4096, 576) * 0.05)
    assert isinstance(head.coarse, Int4Linear)
    _rows_alone_equal_rows_together(head, 576)


def test_an_int4_lm_head_gives_its_top_logits_as_float32_products_and_the_rest_within_a_4bit_step():
    torch.manual_seed(3)
    weight = torch.randn(4096, 576) * 0.05
    head, x = int4_lm_head(weight), torch.randn(5, 576)
    logits, coarse = head(x), head.coarse(x)  # coarse: the 4-bit first pass alone
    exact = x @ head.weight.float().T  # float32 products of the bfloat16 weights
    top = coarse.topk(LM_HEAD_REFINE, dim=-1).indices  # the logits the head refines
    torch.testing.assert_close(logits.gather(-1, top), exact.gather(-1, top), rtol=1e-6, atol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    rest = torch.ones_like(logits, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(logits[rest], coarse[rest]) and not torch.equal(coarse, exact)
    assert (coarse - exact).abs().mean() < 0.1 * exact.abs().mean()  # 4-bit weights: close, not equal


def test_int4_quantization_keeps_each_weight_within_half_a_step_of_its_group():
    torch.manual_seed(4)
    weight = torch.randn(48, 64)
    weight[0, :32] = 0.25  # a constant group
    layer = Int4Linear.quantize(weight, rows=16)  # three chunks of rows
    groups = weight.reshape(48, 2, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)  # [48, 64]
    error = (layer.dequantized() - weight).abs()
    # bfloat16 scale and zero add their own rounding to the half step of the codes
    assert (error <= step / 2 + 0.01 * weight.abs().amax()).all()
    assert error[0, :32].max() < 1e-2


def test_an_lm_head_that_needs_gradients_takes_the_bfloat16_product_so_heads_can_train_through_it():
    head = int4_lm_head(torch.randn(4096, 576) * 0.05)
    x = torch.randn(3, 576, requires_grad=True)
    head(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_an_lm_head_shape_the_int4_kernel_cannot_tile_keeps_the_bfloat16_first_pass():
    head = int4_lm_head(torch.randn(261, 64))  # the tiny GGUF test models' vocabulary: 261 % 16 != 0
    assert head.coarse is None and head(torch.randn(2, 64)).shape == (2, 261)


def test_rowwise_linear_rows_are_bitwise_the_same_alone_and_in_passes_of_any_size():
    _rows_alone_equal_rows_together(RowwiseLinear.from_linear(torch.nn.Linear(576, 1536)), 576)


def test_plain_float32_linear_is_not_batch_invariant_here_which_is_why_rowwise_exists():
    # If this starts to fail, MKL became batch-invariant and RowwiseLinear could go.
    torch.manual_seed(0)
    w, x = torch.randn(1536, 576), torch.randn(8, 576)
    assert not torch.equal(F.linear(x, w), torch.cat([F.linear(x[r : r + 1], w) for r in range(8)]))


@pytest.mark.skipif(not BF16_CPU, reason="bitsandbytes' fused NF4 CPU kernel needs AVX512-BF16")
def test_bitsandbytes_nf4_linear_in_eval_and_inference_mode_is_batch_invariant():
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(576, 1536, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(1536, 576) * 0.02, requires_grad=False, quant_type="nf4")
    layer = layer.to("cpu").eval()
    with torch.inference_mode():
        _rows_alone_equal_rows_together(layer, 576)


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_gguf_4bit_blocks_become_int4_groups_without_requantizing(kind):
    weights = (np.random.default_rng(0).standard_normal((32, 128)) * 0.1).astype(np.float32)
    blocks = quantize(weights, kind)  # [32, 4 blocks × bytes]
    codes, scale, zero = int4_groups(blocks, kind)
    exact = (codes.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    assert torch.equal(exact, torch.from_numpy(dequantize(blocks, kind)))
    # The layer keeps scale and zero in bfloat16: within bf16 rounding of the zero and the scale.
    kernel = Int4Linear(codes, scale, zero).dequantized()
    bound = (zero.abs() + 8 * scale.abs()).repeat_interleave(32, 1) * 2**-7
    assert ((kernel - exact).abs() <= bound).all()


def test_int4_groups_refuse_other_types_and_partial_blocks():
    with pytest.raises(ValueError, match="Q8_0"):
        int4_groups(np.zeros((2, 34), np.uint8), GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="whole 20-byte blocks"):
        int4_groups(np.zeros((2, 30), np.uint8), GGMLQuantizationType.Q4_1)


def _tree_mask(parents: list[int], prefix: int, additive: bool) -> torch.Tensor:
    n = len(parents)
    visible = torch.zeros(n, prefix + n, dtype=torch.bool)
    visible[:, :prefix] = True
    for i in range(n):
        j = i
        while j >= 0:
            visible[i, prefix + j] = True
            j = parents[j]
    if not additive:
        return visible[None, None]
    return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]


@pytest.mark.parametrize("additive", [True, False])
def test_rowwise_attention_gives_each_tree_row_what_one_token_decoding_computes_over_its_own_keys(additive):
    torch.manual_seed(0)
    parents = [-1, 0, 0, 1, 2, 0, 3, 3, 6]  # siblings interleaved with descendants
    prefix, n, heads, kv_heads, dim = 37, len(parents), 6, 2, 16
    module = torch.nn.Module()
    q = torch.randn(1, heads, n, dim)
    k, v = torch.randn(1, kv_heads, prefix + n, dim), torch.randn(1, kv_heads, prefix + n, dim)
    mask = _tree_mask(parents, prefix, additive)
    out, _ = rowwise_attention(module, q, k, v, mask, scaling=0.25)  # [1, N, H, Dh]
    for i in range(n):
        keys = mask[0, 0, i].nonzero()[:, 0] if not additive else (mask[0, 0, i] == 0).nonzero()[:, 0]
        # one-token decoding at this node's position: its ancestors' K/V are the cache, in order
        alone, _ = rowwise_attention(module, q[:, :, i : i + 1], k[:, :, keys], v[:, :, keys], None, scaling=0.25)
        assert torch.equal(out[:, i], alone[:, 0]), i


@pytest.fixture(scope="module")
def row_kernel():
    loaded, why = load_kernel()
    if not loaded:
        pytest.skip(f"no compiled row attention here: {why}")  # the README's install gives CI a compiler


@pytest.mark.parametrize(("additive", "dim", "prefix"), [(True, 16, 37), (False, 64, 37), (True, 128, 1030)])
def test_the_row_kernel_gives_each_tree_row_what_one_token_decoding_computes_over_its_own_keys(row_kernel, additive, dim, prefix):
    torch.manual_seed(1)
    parents = [-1, 0, 0, 1, 2, 0, 3, 3, 6]  # siblings interleaved with descendants
    n, heads, kv_heads = len(parents), 9, 3
    module = torch.nn.Module()
    q = torch.randn(1, heads, n, dim)
    k, v = torch.randn(1, kv_heads, prefix + n, dim), torch.randn(1, kv_heads, prefix + n, dim)
    mask = _tree_mask(parents, prefix, additive)
    out, _ = kernel_attention(module, q, k, v, mask, scaling=dim**-0.5)  # [1, N, H, Dh]
    for i in range(n):
        keys = mask[0, 0, i].nonzero()[:, 0] if not additive else (mask[0, 0, i] == 0).nonzero()[:, 0]
        # one-token decoding at this node's position: its ancestors' K/V are the cache, in order
        alone, _ = kernel_attention(module, q[:, :, i : i + 1], k[:, :, keys], v[:, :, keys], None, scaling=dim**-0.5)
        assert torch.equal(out[:, i], alone[:, 0]), i
        sdpa = F.scaled_dot_product_attention(q[:, :, i : i + 1], k[:, :, keys], v[:, :, keys], scale=dim**-0.5, enable_gqa=True)
        torch.testing.assert_close(alone[:, 0], sdpa[:, :, 0], rtol=0, atol=2e-6)


def test_the_demo_computes_its_decoding_rows_with_the_row_kernel_where_it_is_built(row_kernel, demo):
    assert demo.backbone.config._attn_implementation == ATTENTION_KERNEL


def _accepted_logits(model, ids, monkeypatch, **kwargs) -> tuple[list[int], list[torch.Tensor]]:
    """The reply and, per reply position after the first, the logits the step's pass computed there."""
    passes = []
    forward = model._steps.tree_forward

    def spy(tree, tokens, cur_len, cache):
        logits, hidden = forward(tree, tokens, cur_len, cache)
        passes.append(logits.clone())
        return logits, hidden

    monkeypatch.setattr(model._steps, "tree_forward", spy)
    records = list(model.generate(ids, max_new_tokens=40, **kwargs))
    monkeypatch.undo()
    rows = [logits[n] for logits, r in zip(passes, records[1:]) for n in r.accepted_nodes]
    return [t for r in records for t in r.token_ids], rows


def _ids(model, text: str):
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"]


@pytest.fixture(scope="module")
def demo():
    return load_medusa_model("demo")  # the default: the GGUF file's own 4-bit blocks


def _check_bitwise(model, monkeypatch, prompts, trees):
    for text in prompts:
        ids = _ids(model, text)
        plain_tokens, plain = _accepted_logits(model, ids, monkeypatch, medusa=False)
        for tree in trees:
            tokens, rows = _accepted_logits(model, ids, monkeypatch, tree=tree)
            assert tokens == plain_tokens, (text, tree)
            n = min(len(rows), len(plain))
            assert n >= 30
            for pos in range(n):
                assert torch.equal(rows[pos], plain[pos]), (text, tree, pos)


def test_every_accepted_tree_node_of_the_4bit_demo_has_bitwise_the_logits_of_plain_decoding(demo, monkeypatch):
    assert demo.quantization == "gguf"
    _check_bitwise(demo, monkeypatch, ["Write a short poem about the sea.", "What is 17 times 23? Explain.",
                                       "Give me three tips to sleep better."], ["optimised_4", "optimised_16", "sparse_32"])


def test_every_accepted_tree_node_of_the_float32_demo_has_bitwise_the_logits_of_plain_decoding(monkeypatch):
    model = load_medusa_model("demo", quantization="none")
    assert isinstance(model.backbone.model.layers[0].mlp.up_proj, RowwiseLinear)
    _check_bitwise(model, monkeypatch, ["Write a short poem about the sea."], ["optimised_8"])


@pytest.mark.parametrize("paths", [[[0], [0, 0]], [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]], [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]])
def test_a_trees_row_keys_from_its_parents_are_those_read_from_its_mask(paths):
    from medusa_core.invariant import row_keys, tree_row_keys
    from medusa_core.steptree import static_tree

    tree = static_tree("t", paths, torch.float32, "cpu")
    for length in (0, 7, 300):
        mask = torch.cat([torch.zeros(tree.num_nodes, length), tree.bias], dim=1)[None, None]
        want = row_keys(mask, tree.num_nodes, length + tree.num_nodes)
        got = tree_row_keys(tree.node_parents, length)
        assert got.prefix == want.prefix and got.offsets == want.offsets and torch.equal(got.extras, want.extras), length
