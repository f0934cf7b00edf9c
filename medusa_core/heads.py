"""Medusa heads (paper 2.1.1): ``logits_k = W2_k · (h + SiLU(W1_k · h + b1_k))``.

The module's ``state_dict`` keys are exactly the reference's head-only keys — ``{i}.{j}.linear.weight``,
``{i}.{j}.linear.bias`` for residual block j < L and ``{i}.{L}.weight`` for head i's [V, H] projection —
so files round-trip with published checkpoints and text-generation-inference. "Version 2" heads have
no projection of their own and reuse the backbone's LM head.

Layout "root" (this project's, after Hydra, Ankner et al. 2024): at step time the root token t+1 is
already chosen when the heads run, so a root-conditioned head k reads ``h + R_k · e(root)`` instead of
``h``, with ``e`` the backbone's own (frozen) input embedding and ``R_k`` [H, H] its one extra tensor,
saved under the key ``root_weight`` ([K, H, H], zero at initialisation: a fresh root-conditioned head
is a Medusa head). Everything else, keys included, is the Medusa-1 / "version 2" layout.
"""

from __future__ import annotations

import torch
from torch import nn

#: Token ids the heads score when drafting on a CPU without a frequency ranking (``MedusaHeads.restrict_drafts``):
#: the first third of a 49,152-token vocabulary, 94.7 % of the tokens of the demo's held-out served chat replies.
DRAFT_VOCABULARY = 16384
#: Token ids they score when the heads come with a frequency ranking (``DRAFT_RANKING_FILE``): the most frequent
#: 8,192 of the demo's training replies cover 95.2 % of the same held-out tokens, at half the projection's cost.
RANKED_DRAFT_VOCABULARY = 8192
#: File beside a head checkpoint that ranks token ids by their frequency in the replies the heads trained on
#: (``{"ranked_ids": [...], "source": ...}``, most frequent first; ``medusa_core.train.ranking``).
DRAFT_RANKING_FILE = "draft_ranking.json"


class ResBlock(nn.Module):
    """``h + SiLU(W h + b)`` with W [H, H] zero-initialised, so a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + nn.functional.silu(self.linear(h))


class MedusaHeads(nn.ModuleList):
    """K Medusa heads; head k predicts the token k+2 positions after the hidden state's position.

    Args:
        hidden_size: H of the backbone.
        vocab_size: V of the backbone's LM head.
        num_heads: K.
        num_layers: residual blocks per head (independent weights; 1 in published checkpoints).
        shared_lm_head: for "version 2" checkpoints, the backbone's LM head ([V, H] linear) that every
            head uses instead of a projection of its own. It is not part of this module's state.
        root_embedding: the backbone's input embedding ([V, H]) for root-conditioned heads (layout
            "root", module docstring); they then take ``root=`` in ``forward``. Not part of the state.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int,
        num_layers: int = 1,
        shared_lm_head: nn.Module | None = None,
        root_embedding: nn.Module | None = None,
    ):
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
        heads = []
        for _ in range(num_heads):
            layers: list[nn.Module] = [ResBlock(hidden_size) for _ in range(num_layers)]
            if shared_lm_head is None:
                layers.append(nn.Linear(hidden_size, vocab_size, bias=False))
            heads.append(nn.Sequential(*layers))
        super().__init__(heads)
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        # A plain tuple keeps the shared LM head out of this module's parameters and state_dict.
        self._shared_lm_head = (shared_lm_head,) if shared_lm_head is not None else ()
        self._root_embedding = (root_embedding,) if root_embedding is not None else ()
        if root_embedding is not None:  # a parameter, not a module: len(self) stays K
            self.root_weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))  # [K, H, H]
        self._draft_projections: tuple[nn.Module, ...] = ()  # restrict_drafts: one per head, or one shared
        self._draft_ids: tuple[torch.Tensor, ...] = ()  # restrict_drafts with a ranking: the draft ids [S]

    @property
    def num_heads(self) -> int:
        """K."""
        return len(self)

    @property
    def shares_lm_head(self) -> bool:
        """True for "version 2" heads that use the backbone's LM head."""
        return bool(self._shared_lm_head)

    @property
    def root_conditioned(self) -> bool:
        """True for heads of layout "root", which read the root token too (module docstring)."""
        return bool(self._root_embedding)

    def own_lm_head_copy(self, dtype: torch.dtype) -> None:
        """Use a private copy of the shared LM head in ``dtype`` (e.g. bfloat16 on a CPU: half the
        bytes read per step), so that the heads can run in another dtype than the backbone.

        The copy stays out of ``state_dict``, as the shared head does. Raises ``ValueError`` for
        heads with projections of their own (their dtype is set with ``.to``)."""
        if not self._shared_lm_head:
            raise ValueError("own_lm_head_copy is for heads that share the backbone's LM head")
        lm_head = self._shared_lm_head[0]
        copy = nn.Linear(lm_head.in_features, lm_head.out_features, bias=False, device=lm_head.weight.device, dtype=dtype)
        with torch.no_grad():
            copy.weight.copy_(_dense_weight(lm_head))
        self._shared_lm_head = (copy.requires_grad_(False),)

    @property
    def draft_vocabulary(self) -> int:
        """How many token ids ``draft_logits`` scores (S = V unless ``restrict_drafts`` cut it)."""
        return self._draft_projections[0].out_features if self._draft_projections else self.vocab_size

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """The token ids [S] that ``draft_logits``' S columns stand for, or None when they are ids 0..S−1."""
        return self._draft_ids[0] if self._draft_ids else None

    def restrict_drafts(self, size: int, ranking: torch.Tensor | None = None) -> None:
        """Make ``draft_logits`` score only S token ids: a frequency-ranked vocabulary subset for drafting (FR-Spec,
        Zhao et al. 2025, "FR-Spec: Accelerating large-vocabulary language models via frequency-ranked speculative
        sampling"). With ``ranking`` (token ids [R] int64, most frequent first, as ``DRAFT_RANKING_FILE`` holds)
        they are its first min(size, R) ids; without, ids 0..size−1 (a BPE vocabulary lists its tokens roughly
        in frequency order). Drafts only need each head's top few tokens, and the backbone still verifies over the
        whole vocabulary, so outputs are unchanged; a token outside the subset is never proposed (measured in
        docs/BENCH.md). ``forward`` (training, calibration) keeps the whole vocabulary.

        The projections are the heads' own (or the shared LM head's) rows of those ids: views for 0..S−1, copies
        for a ranking; a shared LM head with a 4-bit first pass (``quant.layers.int4_lm_head``) gets a 4-bit copy
        of those rows (the same codes) without the float32 refinement of the top logits: ranks are all drafts use.
        Raises ``ValueError`` unless 0 < size <= V, for a ranking with ids outside 0..V−1 or repeated, or for an LM
        head whose rows cannot be taken (bitsandbytes 4-bit).
        """
        from .quant.layers import BF16Linear, Int4Linear

        if not 0 < size <= self.vocab_size:
            raise ValueError(f"a draft vocabulary must have 1..{self.vocab_size} tokens, got {size}")
        ids = None
        if ranking is not None:
            ids = torch.as_tensor(ranking, dtype=torch.long)[:size]
            if ids.dim() != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size or len(ids.unique()) != len(ids):
                raise ValueError(f"a draft ranking must list distinct token ids in 0..{self.vocab_size - 1}")
            size = len(ids)

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t[:size] if ids is None else t.index_select(0, ids.to(t.device))

        projections = [self._shared_lm_head[0]] if self._shared_lm_head else [head[-1] for head in self]
        restricted = []
        for layer in projections:
            if isinstance(layer, BF16Linear) and isinstance(layer.coarse, Int4Linear):
                restricted.append(Int4Linear.quantize(rows(layer.weight), rows(layer.bias)))
            elif type(layer) in (nn.Linear, BF16Linear):
                part = type(layer)(layer.in_features, size, bias=layer.bias is not None, device="meta")
                part.weight = nn.Parameter(rows(layer.weight), requires_grad=False)  # 0..S−1: a view, no copy
                part.bias = None if layer.bias is None else nn.Parameter(rows(layer.bias), requires_grad=False)
                restricted.append(part)
            else:
                raise ValueError(f"cannot restrict the drafts of a {type(layer).__name__} projection: its rows are not sliceable")
        self._draft_projections = tuple(restricted)
        self._draft_ids = () if ids is None else (ids.to(projections[0].weight.device),)

    def draft_logits(self, hidden: torch.Tensor, num_heads: int | None = None, root: torch.Tensor | None = None) -> torch.Tensor:
        """``forward``'s logits over the draft vocabulary: hidden [..., H] -> [k, ..., S], column j for token id
        ``draft_ids[j]`` (j itself when ``draft_ids`` is None); ``root`` as in ``forward``."""
        return self.project_drafts(self.block_states(hidden, num_heads, root))

    def block_states(self, hidden: torch.Tensor, num_heads: int | None = None, root: torch.Tensor | None = None) -> torch.Tensor:
        """Each head's input to its projection, [k, ..., H]: its residual blocks' output (paper 2.1.1; for layout
        "root" over ``hidden + R_k · e(root)``). Args as ``forward``."""
        blocks = self.residual_blocks(num_heads)
        return torch.stack([block(x) for block, x in zip(blocks, self._inputs(hidden, len(blocks), root))])

    def residual_blocks(self, num_heads: int | None = None) -> list[nn.Sequential]:
        """The first ``num_heads`` heads' residual blocks (all heads by default), each head's without its projection."""
        heads = list(self)[: num_heads or len(self)]
        return heads if self._shared_lm_head else [head[:-1] for head in heads]

    def project_drafts(self, states: torch.Tensor) -> torch.Tensor:
        """The first k heads' projections of ``block_states`` [k, ..., H] over the draft vocabulary: [k, ..., S]
        (S = V without ``restrict_drafts``)."""
        if self._shared_lm_head:
            return (self._draft_projections or self._shared_lm_head)[0](states)
        projections = self._draft_projections or tuple(head[-1] for head in self)
        return torch.stack([projection(x) for projection, x in zip(projections, states)])

    @property
    def root_embedding(self) -> nn.Module | None:
        """The backbone's input embedding that root-conditioned heads read (None for other heads)."""
        return self._root_embedding[0] if self._root_embedding else None

    @classmethod
    def from_backbone(
        cls, backbone: nn.Module, num_heads: int, num_layers: int = 1, *, root_conditioned: bool = False
    ) -> "MedusaHeads":
        """Fresh heads for a Hugging Face causal LM: W1 = 0, each projection a copy of the LM head.

        A fresh head therefore predicts what the LM head predicts; training moves it to t+k+2.
        The heads get the LM head's device and (floating) dtype; a quantized LM head is dequantized.
        ``root_conditioned``: layout "root", reading the backbone's input embedding of the root token.
        """
        lm_head = backbone.get_output_embeddings()
        weight = _dense_weight(lm_head)  # [V, H]
        embedding = backbone.get_input_embeddings() if root_conditioned else None
        heads = cls(weight.shape[1], weight.shape[0], num_heads, num_layers, root_embedding=embedding)
        heads.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            for head in heads:
                head[-1].weight.copy_(weight)
        return heads

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None, root: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the first ``num_heads`` heads (all by default).

        Args:
            hidden: [..., H] final-norm hidden states of the backbone.
            root: [...] int64, the token chosen after each state (the step's root); required by
                root-conditioned heads, ignored by others.
        Returns:
            [k, ..., V] with k = ``num_heads``.
        Raises ``ValueError`` when root-conditioned heads get no ``root``.
        """
        states = self.states(hidden, num_heads, root)  # [k, ..., H] ([k, ..., V] with own projections)
        return self._shared_lm_head[0](states) if self._shared_lm_head else states  # one LM-head pass

    def states(self, hidden: torch.Tensor, num_heads: int | None = None, root: torch.Tensor | None = None) -> torch.Tensor:
        """What the heads hand to the LM head: [k, ..., H] for "version 2" heads (their residual blocks'
        output), [k, ..., V] logits for heads with projections of their own. Args as ``forward``."""
        heads = list(self)[: num_heads or len(self)]
        return torch.stack([head(x) for head, x in zip(heads, self._inputs(hidden, len(heads), root))])

    def _inputs(self, hidden: torch.Tensor, k: int, root: torch.Tensor | None) -> list[torch.Tensor]:
        """Each head's input [..., H]: ``hidden``, plus ``R_k · e(root)`` for root-conditioned heads."""
        if not self._root_embedding:
            return [hidden] * k
        if root is None:
            raise ValueError("root-conditioned Medusa heads need root= (the token chosen after each hidden state)")
        embedded = self._root_embedding[0](root).to(self.root_weight.dtype)  # [..., H]
        return [hidden + embedded @ self.root_weight[i].T for i in range(k)]


def _dense_weight(linear: nn.Module) -> torch.Tensor:
    """The [out, in] weight of a linear layer, dequantized when bitsandbytes quantized it."""
    weight = linear.weight
    if hasattr(weight, "quant_state"):
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, weight.quant_state).detach().clone()
    return weight.detach().clone()
