"""An EAGLE-style drafter as a draft source (Li et al. 2024; trained by ``scripts/probe_eagle.py``).

One Llama decoder layer reads fc([f_t, e(x_{t+1})]) -- the backbone's final-norm state at t and the embedding of
the token after it -- attends over its own states at earlier positions (a KV cache of its own, written for
accepted tokens only) and proposes the next token through the backbone's LM head rows of the heads' draft
vocabulary; each further draft chains from its own output, while the chain's probability under the drafter stays
above a threshold (EAGLE-2's confidence). The layer runs in the lean step's compiled decoder, and each pass --
reading the accepted rows, proposing a chain -- is one compiled call (``lean/eagle_chain.h``). The chain is verified
alone by the backbone (point-mass drafts: greedy output stays plain greedy output, exact sampling stays exact).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from .errors import MedusaCheckpointError
from .invariant import MAX_ROWWISE
from .quant.layers import Int4Linear

#: Tensor names and shapes (H: hidden size, I: MLP width) of a drafter file.
LAYOUT = {"fc.weight": ("H", "2H"), "n1.w": ("H",), "q.weight": ("H", "H"), "k.weight": ("H", "H"),
          "v.weight": ("H", "H"), "o.weight": ("H", "H"), "n2.w": ("H",), "g.weight": ("I", "H"),
          "u.weight": ("I", "H"), "d.weight": ("H", "I")}


#: The most drafts a step, and the chain probability a draft needs (``EagleDrafts.propose``), where neither
#: ``DraftConfig`` nor the model's tuned entry (``bench tune``, ``medusa_core.bench.tune_chain``) sets them: with the
#: drafter trained on prompt rounds 1-5 (docs/BENCH.md, "The drafter on prompt rounds 1-5, five drafts deep, the app's
#: default"), depth 5 at 0.3 made the most tokens/s at the chat preset (1.88 tokens per step against 1.67 two deep)
#: and was within noise of the most at greedy (24 held-out prompts); the drafter was trained two drafts deep, and
#: deeper chains still pay.
DEPTH, THRESHOLD = 5, 0.3


class EagleDrafter:
    """The drafter's layer compiled (the lean step's ``LeanDecoder``, one layer, no final norm: its 4-bit products,
    row attention over its own cache and elementwise loops in one call) behind its input linear ``fc`` (2H -> H);
    every linear in 4 bits (``Int4Linear.quantize``'s groups, which cost the probe's draft 1 about one point of
    top-1: docs/BENCH.md, "An EAGLE-style drafter"); RoPE as the backbone's (θ, head width).

    Args:
        path: the drafter's safetensors file (``LAYOUT``).
        config: the backbone's text config (hidden and MLP widths, heads, θ, ε of the norms).
        module: the lean step's compiled extension (``medusa_core.lean.build.load_extension``).
    Raises ``MedusaCheckpointError`` for a file that is missing, unreadable, or whose tensors do not fit the backbone
    (the message names the tensor, the expected and the found shape)."""

    def __init__(self, path: str | Path, config, module):
        try:
            sd = load_file(str(path))
        except (OSError, ValueError, RuntimeError) as e:
            raise MedusaCheckpointError(f"{path}: not a readable drafter file ({e})") from e
        h, i = config.hidden_size, config.intermediate_size
        sizes = {"H": h, "2H": 2 * h, "I": i}
        for name, dims in LAYOUT.items():
            want = [sizes[d] for d in dims]
            if name not in sd or list(sd[name].shape) != want:
                found = list(sd[name].shape) if name in sd else "missing"
                raise MedusaCheckpointError(f"{path}: drafter tensor {name} should be {want} for this backbone, found {found}")
        self.heads = config.num_attention_heads
        self.head_dim = h // self.heads
        params = getattr(config, "rope_parameters", None) or {}
        self.theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        self.fc = list(Int4Linear.quantize(sd["fc.weight"]).kernel_weights())  # the input linear (2H -> H)
        self.observe_rows, self.chain = module.eagle_observe, module.eagle_chain  # eagle_chain.h
        linears = [Int4Linear.quantize(sd[f"{name}.weight"]) for name in "qkvogud"]  # LeanDecoder's order
        tensors = [sd["n1.w"].float(), sd["n2.w"].float()]
        for linear in linears:
            tensors += [*linear.kernel_weights(), torch.empty(0)]
        self.layer = module.LeanDecoder(
            [tensors], [float(config.rms_norm_eps)], [linear.out_features for linear in linears], torch.empty(0), 0.0,
            self.heads, self.heads, self.head_dim, self.head_dim**-0.5, True,
        )

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, head_dim] float32 for positions 0 .. length-1."""
        d = self.head_dim
        inv = 1.0 / self.theta ** (torch.arange(0, d, 2).float() / d)
        angles = torch.arange(length).float()[:, None] * inv[None]
        return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


class EagleDrafts:
    """One reply's drafter state, with ``NgramDrafter``'s interface for the decoding loop (``extend``, ``propose``,
    ``verify_alone``) plus ``observe``, which the loop calls with the states of the tokens it accepts.

    Args:
        drafter: the weights.
        embed: the backbone's input embedding, an ``nn.Embedding`` (its table [V, H] is read for each token).
        projection: the LM head's rows the drafts choose among (H -> S, an ``Int4Linear``); ``draft_ids`` [S] their
            token ids (None: 0..S-1).
        capacity: entries the cache can hold (prompt + reply).
        depth: the most drafts a step; threshold: the chain probability a draft needs (None: ``DEPTH``, ``THRESHOLD``).
        chains: the model's corpus chains (an ``NgramDrafter`` over its ``corpus``, ``copy=False``; None: none): a
            step takes the corpus's chain where it has one, the drafter's elsewhere (docs/BENCH.md: ~5 % more
            tokens/s than the drafter alone at the chat preset and at greedy).
    """

    verify_alone = True
    #: Rows the compiled layer reads in one call (at most the lean step's largest pass; a prompt goes in chunks).
    CHUNK = MAX_ROWWISE

    def __init__(self, drafter: EagleDrafter, embed: torch.nn.Embedding, projection: Int4Linear, draft_ids: torch.Tensor | None,
                 capacity: int, depth: int | None = None, threshold: float | None = None, chains=None):
        self.d, self.chains = drafter, chains
        table = embed.weight.detach()
        self.embed = table if table.dtype in (torch.bfloat16, torch.float32) else table.float()  # as the fc reads it
        self.projection, self.vocabulary = list(projection.kernel_weights()), projection.out_features
        self.draft_ids = torch.empty(0, dtype=torch.long) if draft_ids is None else draft_ids.long().contiguous()
        depth, threshold = DEPTH if depth is None else depth, THRESHOLD if threshold is None else threshold
        self.depth, self.log_threshold = depth, math.log(threshold) if threshold > 0 else -math.inf
        # keys and values, with room for the drafts' rows after the accepted entries
        self.cache = torch.zeros(2, 1, drafter.heads, capacity + depth, drafter.head_dim)
        self.cos, self.sin = drafter.rope_tables(capacity + depth)
        self._read, self._last = 0, None  # entries the layer has read into the cache; its output at the last one
        self._pending: list[tuple[torch.Tensor, list[int]]] = []  # observed, not yet read: (states [r, H], next tokens)

    def extend(self, tokens) -> None:
        """The corpus chains' context grows (the drafter learns the accepted tokens with their states: ``observe``)."""
        if self.chains is not None:
            self.chains.extend(tokens)

    def observe(self, states: torch.Tensor, next_tokens: list[int]) -> None:
        """Append the accepted positions: ``states`` [r, H] their final-norm states, ``next_tokens`` the token after
        each (the last one: the step's new root). The layer reads them when its output is next needed (``propose``
        without a corpus chain, ``last``), every position observed since in one call (``CHUNK`` rows a call), each
        row attending to the cache's entries before it: a step that takes the corpus's chain runs no pass of the
        drafter's, and the rows it accepted are read with the next step's (the same bits: the layer computes each row
        on its own). Raises ``ValueError`` when the cache is full."""
        r = states.shape[0]
        if self.length + r > self.cache.shape[3] - self.depth:
            raise ValueError(f"the drafter's cache holds {self.cache.shape[3] - self.depth} entries; {self.length + r} asked")
        self._pending.append((states.detach().float().clone(), list(next_tokens)))

    @property
    def length(self) -> int:
        """Entries observed: those the layer has read into the cache, then the pending ones."""
        return self._read + sum(s.shape[0] for s, _ in self._pending)

    @property
    def last(self) -> torch.Tensor | None:
        """The layer's output [1, H] at the last observed position (the pending ones read first); None before any."""
        if self._pending:
            states = torch.cat([s for s, _ in self._pending]).contiguous()
            tokens = [t for _, ts in self._pending for t in ts]
            self._pending = []
            self._last = self.d.observe_rows(self.d.layer, self.d.fc, self.embed, states, tokens, self.cache, self.cos,
                                             self.sin, self._read, self.CHUNK)  # [1, H]
            self._read += states.shape[0]
        return self._last

    def propose(self, limit: int) -> list[int]:
        """Drafts after the root, each chained from the drafter's output before it, while their chain's probability
        (the product of each draft's softmax probability over the draft vocabulary, EAGLE-2's confidence) stays
        ≥ ``threshold``: at most ``depth`` and ``limit`` of them, none when the first is below it. Where the corpus
        has a chain (``chains``), that chain instead."""
        chain = self.chains.propose(limit) if self.chains is not None else []
        last = None if chain else self.last
        if last is None:
            return chain
        return self.d.chain(self.d.layer, self.d.fc, self.projection, self.vocabulary, self.draft_ids,
                            self.embed, last, self.cache, self.cos, self.sin, self.length, min(limit, self.depth),
                            self.log_threshold)
