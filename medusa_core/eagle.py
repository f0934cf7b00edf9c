"""An EAGLE-style drafter as a draft source (Li et al. 2024; trained by ``scripts/probe_eagle.py``).

One Llama decoder layer reads fc([f_t, e(x_{t+1})]) -- the backbone's final-norm state at t and the embedding of
the token after it -- attends over its own states at earlier positions (a KV cache of its own, written for
accepted tokens only) and proposes the next token through the backbone's LM head rows of the heads' draft
vocabulary; the second draft chains from its own output. The chain is verified alone by the backbone (point-mass
drafts: greedy output stays plain greedy output, exact sampling stays exact).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .errors import MedusaCheckpointError
from .quant.layers import Int4Linear

#: Tensor names and shapes (H: hidden size, I: MLP width) of a drafter file.
LAYOUT = {"fc.weight": ("H", "2H"), "n1.w": ("H",), "q.weight": ("H", "H"), "k.weight": ("H", "H"),
          "v.weight": ("H", "H"), "o.weight": ("H", "H"), "n2.w": ("H",), "g.weight": ("I", "H"),
          "u.weight": ("I", "H"), "d.weight": ("H", "I")}


class EagleDrafter:
    """The drafter's linears in 4 bits (``Int4Linear``: the compiled int4 product where it is loaded, ~10× a bfloat16
    product's speed for one row), fused for few calls: ``fc`` (2H -> H), ``qkv`` (H -> 3H), ``o`` (H -> H), ``gu``
    (H -> 2I), ``down`` (I -> H); norms [H] bfloat16; RoPE as the backbone's (θ, head width). 4-bit weights cost
    the probe's draft 1 about one point of top-1 (docs/BENCH.md, "An EAGLE-style drafter").

    Raises ``MedusaCheckpointError`` for a file that is missing, unreadable, or whose tensors do not fit the backbone
    (the message names the tensor, the expected and the found shape)."""

    def __init__(self, path: str | Path, config):
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
        self.hidden, self.heads = h, config.num_attention_heads
        self.head_dim, self.eps = h // self.heads, config.rms_norm_eps
        params = getattr(config, "rope_parameters", None) or {}
        self.theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        self.fc = Int4Linear.quantize(sd["fc.weight"])
        self.qkv = Int4Linear.quantize(torch.cat([sd["q.weight"], sd["k.weight"], sd["v.weight"]]))
        self.o, self.down = Int4Linear.quantize(sd["o.weight"]), Int4Linear.quantize(sd["d.weight"])
        self.gu = Int4Linear.quantize(torch.cat([sd["g.weight"], sd["u.weight"]]))
        self.n1, self.n2 = sd["n1.w"].to(torch.bfloat16), sd["n2.w"].to(torch.bfloat16)

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, 1, head_dim] bfloat16 for positions 0 .. length-1."""
        d = self.head_dim
        inv = 1.0 / self.theta ** (torch.arange(0, d, 2).float() / d)
        angles = torch.arange(length).float()[:, None] * inv[None]
        return tuple(torch.cat([f(angles)] * 2, -1).to(torch.bfloat16)[:, None] for f in (torch.cos, torch.sin))


class EagleDrafts:
    """One reply's drafter state, with ``NgramDrafter``'s interface for the decoding loop (``extend``, ``propose``,
    ``verify_alone``) plus ``observe``, which the loop calls with the states of the tokens it accepts.

    Args:
        drafter: the weights.
        embed: the backbone's input embedding (token ids [r] -> [r, H]).
        projection: the LM head's rows the drafts choose among (H -> S, an ``Int4Linear``); ``draft_ids`` [S] their
            token ids (None: 0..S-1).
        capacity: entries the cache can hold (prompt + reply).
    """

    verify_alone = True

    def __init__(self, drafter: EagleDrafter, embed, projection: Int4Linear, draft_ids: torch.Tensor | None, capacity: int):
        self.d, self.embed = drafter, embed
        self.projection, self.draft_ids = projection, draft_ids
        self.cache = torch.zeros(2, drafter.heads, capacity, drafter.head_dim, dtype=torch.bfloat16)
        self.cos, self.sin = drafter.rope_tables(capacity + 1)
        self.length, self.last = 0, None

    def extend(self, tokens) -> None:
        """Nothing: the drafter learns the accepted tokens with their states (``observe``)."""

    def observe(self, states: torch.Tensor, next_tokens: list[int]) -> None:
        """Append the accepted positions: ``states`` [r, H] their final-norm states, ``next_tokens`` the token after
        each (the last one: the step's new root). Raises ``ValueError`` when the cache is full."""
        r = states.shape[0]
        if self.length + r > self.cache.shape[2]:
            raise ValueError(f"the drafter's cache holds {self.cache.shape[2]} entries; {self.length + r} asked")
        emb = self.embed(torch.tensor(next_tokens)).to(torch.bfloat16)
        x = self.d.fc(torch.cat([states.to(torch.bfloat16), emb], -1))
        self.last = self._layer(x, keep=True)[-1:]
        self.length += r

    def propose(self, limit: int) -> list[int]:
        """Up to two drafts after the root (``limit`` caps them): [d1, d2]."""
        if limit < 1 or self.last is None:
            return []
        first = self._top(self.last)
        if limit == 1:
            return [first]
        x = self.d.fc(torch.cat([self.last, self.embed(torch.tensor([first])).to(torch.bfloat16)], -1))
        return [first, self._top(self._layer(x, keep=False))]

    def _top(self, out: torch.Tensor) -> int:
        column = int(self.projection(out).argmax())
        return column if self.draft_ids is None else int(self.draft_ids[column])

    def _layer(self, x: torch.Tensor, keep: bool) -> torch.Tensor:
        """The decoder layer over rows x [r, H] at positions length .. length+r-1; ``keep`` writes their keys and
        values into the cache (accepted rows), else they attend to the cache and themselves only."""
        d, r, start = self.d, x.shape[0], self.length
        h, nh, hd = d.hidden, d.heads, d.head_dim
        qkv = d.qkv(F.rms_norm(x, (h,), d.n1, d.eps)).view(r, 3, nh, hd)
        qk = qkv[:, :2]
        cos, sin = self.cos[start : start + r, None], self.sin[start : start + r, None]
        qk = qk * cos + torch.cat([-qk[..., hd // 2 :], qk[..., : hd // 2]], -1) * sin
        k_new, v_new = qk[:, 1].transpose(0, 1), qkv[:, 2].transpose(0, 1)  # [nh, r, hd]
        if keep:
            self.cache[0, :, start : start + r], self.cache[1, :, start : start + r] = k_new, v_new
            k, v = self.cache[0, :, : start + r], self.cache[1, :, : start + r]
        else:
            k = torch.cat([self.cache[0, :, :start], k_new], 1)
            v = torch.cat([self.cache[1, :, :start], v_new], 1)
        mask = None if r == 1 else torch.ones(r, start + r, dtype=torch.bool).tril(start)
        a = F.scaled_dot_product_attention(qk[:, 0].transpose(0, 1), k, v, attn_mask=mask)  # [nh, r, hd]
        x = x + d.o(a.transpose(0, 1).reshape(r, h))
        g, u = d.gu(F.rms_norm(x, (h,), d.n2, d.eps)).chunk(2, -1)
        return x + d.down(F.silu(g) * u)
