"""Shared fakes for the engine tests: tiny backbones, greedy references, random and oracle heads.

``OracleHeads`` always ranks the true greedy continuation first, so a tree's top-1 path is accepted
to its full depth; random heads propose almost nothing right. Together they drive the engine through
both extremes of paper 2.3.1 (accept nothing, accept everything) and through cache compaction.

Helpers are factory fixtures; test modules import only the plain data ``ARCH_SETTINGS`` and ``PROMPT``.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from tiny_models import random_heads, tiny_backbone, write_tiny_medusa

from medusa_core import MedusaModel, load_medusa_model

#: Architectures the engine must support, with the seed / overrides that give each tiny random
#: model a varied greedy reply (default-initialised tiny Gemma repeats one token forever, which
#: would let a broken engine pass, so its weights are drawn wider).
ARCH_SETTINGS = {
    "llama": dict(seed=3),
    "mistral": dict(seed=2),
    "qwen2": dict(seed=1),
    "gemma": dict(seed=0, initializer_range=1.0),
    "phi3": dict(seed=0),
}
PROMPT = torch.tensor([[5, 17, 42, 8, 23, 61, 3, 30]])  # [1, T]

# Tiny models gain nothing from intra-op threads, and on a shared CPU the threads' spin-waits make
# the suite an order of magnitude slower (measured: 61 s vs 3 s for test_engine.py under load).
torch.set_num_threads(1)


def greedy_reference(backbone: nn.Module, input_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Plain Hugging Face greedy decoding of ``input_ids`` [1, T]: the new tokens only."""
    with torch.inference_mode():
        out = backbone.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    return out[0, input_ids.shape[1] :].tolist()


class OracleHeads(nn.Module):
    """Heads that know the reference greedy sequence and always rank its true continuation first.

    Head k (0-based) at the hidden state of position t proposes the token at t+k+2. The position of
    an incoming hidden state is found by nearest neighbour among the backbone's own final-norm hidden
    states of the whole reference sequence. Other ranks follow a fixed random order.

    Args:
        backbone: the Hugging Face causal LM the engine decodes with.
        sequence: [1, L] prompt plus reference greedy continuation, long enough that heads at the
            last generated position still have targets.
        num_heads: K.

    Attributes:
        calls: ``(hidden shape, num_heads asked)`` of every call, to check how the engine uses heads.
    """

    def __init__(self, backbone: nn.Module, sequence: torch.Tensor, num_heads: int = 4):
        super().__init__()
        self.num_heads = num_heads
        self.hidden_size = backbone.config.hidden_size
        vocab = backbone.get_output_embeddings().out_features
        with torch.inference_mode():
            states = backbone.get_decoder()(input_ids=sequence).last_hidden_state[0]  # [L, H]
        self.register_buffer("states", states.float().clone())
        self.register_buffer("sequence", sequence[0].clone())  # [L]
        g = torch.Generator().manual_seed(7)
        self.register_buffer("noise", torch.rand(num_heads, vocab, generator=g))  # [K, V] in [0, 1)
        self.calls: list[tuple[tuple[int, ...], int | None]] = []

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[B, H] -> [k, B, V]: the true token at t+k+2 scores 10, every other token < 1."""
        self.calls.append((tuple(hidden.shape), num_heads))
        k = num_heads or self.num_heads
        batch = hidden.shape[0]
        pos = torch.cdist(hidden.float(), self.states).argmin(dim=-1)  # [B]
        logits = self.noise[:k, None, :].repeat(1, batch, 1)  # [k, B, V]
        for j in range(k):
            target = (pos + j + 2).clamp(max=len(self.sequence) - 1)  # [B]
            logits[j, torch.arange(batch), self.sequence[target]] = 10.0
        return logits


@pytest.fixture(params=["aten", "compiled"])
def sampling_path(request, monkeypatch):
    """Each sampling test twice: with the penalty, filters and draws of ATen ops, then with the compiled ones
    (``medusa_core.lean`` ``sampling.h``, skipped where the extension cannot be built)."""
    from medusa_core import acceptance
    from medusa_core.lean.build import load_extension
    from medusa_core.processors import NodeProcessors

    slice_kernel, penalty_kernel, kernels = None, None, {}
    if request.param == "compiled":
        module, why = load_extension()
        if module is None:
            pytest.skip(f"no compiled kernels on this machine: {why}")
        slice_kernel, penalty_kernel = module.filter_slice, module.penalise_rows
        kernels = {"draw_index": module.draw_index, "tree_walk": module.tree_walk}
    monkeypatch.setattr(NodeProcessors, "slice_kernel", slice_kernel)
    monkeypatch.setattr(NodeProcessors, "penalty_kernel", penalty_kernel)
    monkeypatch.setattr(acceptance, "SAMPLING_KERNELS", kernels)
    return request.param


@pytest.fixture(scope="session")
def backbone_for():
    """``backbone_for(arch)``: the tiny random backbone of ``arch``, built once per session.

    Tests that change a backbone (its generation config) must do it through ``monkeypatch``.
    """
    cache: dict[str, nn.Module] = {}

    def get(arch: str) -> nn.Module:
        if arch not in cache:
            cache[arch] = tiny_backbone(arch, **ARCH_SETTINGS[arch])
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def reference_for(backbone_for):
    """``reference_for(arch, n)``: plain HF greedy reply of ``n`` tokens to ``PROMPT``, cached."""
    cache: dict[tuple[str, int], list[int]] = {}

    def get(arch: str, n: int) -> list[int]:
        if (arch, n) not in cache:
            cache[arch, n] = greedy_reference(backbone_for(arch), PROMPT, n)
        return cache[arch, n]

    return get


@pytest.fixture(scope="session")
def oracle_heads(greedy):
    """``oracle_heads(backbone, max_new_tokens, num_heads=4)``: fresh ``OracleHeads`` that know the
    greedy reply to ``PROMPT`` (plus slack for the deepest head). Build them before patching the
    backbone's EOS: the reference must not stop early."""
    references: weakref.WeakKeyDictionary[nn.Module, dict[int, list[int]]] = weakref.WeakKeyDictionary()

    def build(backbone: nn.Module, max_new_tokens: int, num_heads: int = 4) -> OracleHeads:
        n = max_new_tokens + num_heads + 2
        known = references.setdefault(backbone, {})
        if n not in known:
            known[n] = greedy(backbone, PROMPT, n)
        sequence = torch.cat([PROMPT, torch.tensor([known[n]])], dim=1)  # [1, L]
        return OracleHeads(backbone, sequence, num_heads)

    return build


@pytest.fixture(scope="session")
def oracle_model(oracle_heads):
    """``oracle_model(backbone, max_new_tokens, num_heads=4)``: a ``MedusaModel`` with ``OracleHeads``."""

    def build(backbone: nn.Module, max_new_tokens: int, num_heads: int = 4) -> MedusaModel:
        return MedusaModel(backbone, oracle_heads(backbone, max_new_tokens, num_heads))

    return build


@pytest.fixture(scope="session")
def random_model():
    """``random_model(backbone, num_heads=4)``: a ``MedusaModel`` with random heads."""

    def build(backbone: nn.Module, num_heads: int = 4) -> MedusaModel:
        return MedusaModel(backbone, random_heads(backbone, num_heads))

    return build


@pytest.fixture(scope="session")
def greedy():
    """``greedy(backbone, input_ids, max_new_tokens)``: plain HF greedy decoding, new tokens only."""
    return greedy_reference



@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The app's ``Engine`` around a tiny random Medusa model loaded from disk (app tests)."""
    from app.engine import Engine

    folder = write_tiny_medusa(tmp_path_factory.mktemp("tiny"))
    return Engine.of(load_medusa_model(folder, quantization=None))
