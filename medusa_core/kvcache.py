"""The decoding loop's KV cache: transformers' ``DynamicCache`` with full-attention layers that grow in place,
and the cache update after a tree step (paper 2.1.2).

``DynamicLayer.update`` concatenates the new entries to the whole cache, so every step copies all of it
(a quarter of a one-token step of the demo at 150 cached tokens, more as replies grow). ``GrowingLayer``
keeps its keys and values as views of a buffer that doubles when full: a step writes only its own
entries. The views hold exactly the values the concatenated tensors would, and the attention reads
them through the same calls, so outputs are unchanged (``tests/test_kvcache.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

#: Smallest buffer a layer allocates, in tokens.
MIN_CAPACITY = 256
#: Reservations (``reserve``) are rounded up to a multiple of this many tokens: a conversation whose
#: kept cache grows a little each turn is reallocated once per this many tokens, not at every turn.
RESERVE_STEP = 1024


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` / ``values`` ([B, H, L, Dh]) are views of a [B, H, C, Dh] buffer.

    ``update`` writes the new entries at positions L.. and returns the views [B, H, L + n, Dh]; when
    they do not fit, the buffer is reallocated with capacity ``reserved`` if that holds them (``reserve``:
    the tokens a reply will need, so a long prompt is not copied at every doubling and no capacity is
    wasted), else max(2·C, L + n, ``MIN_CAPACITY``), and the L entries are copied once. ``crop``
    (inherited) shortens the views; the buffer is kept.
    """

    reserved = 0  # tokens the next reallocation makes room for, if they are at least as many as needed

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._keys_buffer = self._values_buffer = None
        self._capacity = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if end > self._capacity or self.reserved > self._capacity:
            self._capacity = self.reserved if self.reserved >= end else max(2 * self._capacity, end, MIN_CAPACITY)
            keys = key_states.new_empty(*key_states.shape[:-2], self._capacity, key_states.shape[-1])
            values = value_states.new_empty(*value_states.shape[:-2], self._capacity, value_states.shape[-1])
            if length:
                keys[..., :length, :] = self.keys
                values[..., :length, :] = self.values
            self._keys_buffer, self._values_buffer = keys, values
        self._keys_buffer[..., length:end, :] = key_states
        self._values_buffer[..., length:end, :] = value_states
        self.keys = self._keys_buffer[..., :end, :]
        self.values = self._values_buffer[..., :end, :]
        return self.keys, self.values


def new_cache(config: Any) -> DynamicCache:
    """A ``DynamicCache`` for a model with this config whose full-attention layers are ``GrowingLayer``;
    sliding-window and other layer kinds keep transformers' own classes."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if not cache.layers:  # a config transformers does not map: layers are made on first use
        cache.layer_class_to_replicate = GrowingLayer
    return cache


def reserve(cache: DynamicCache, tokens: int, limit: int) -> None:
    """Make the next update of every ``GrowingLayer`` of ``cache`` allocate room for ``tokens`` entries
    (at once, if it has less), rounded up to a multiple of ``RESERVE_STEP`` but at most ``limit`` (the
    most entries the cache can ever need); other layer kinds are left as they are."""
    room = min(-(-tokens // RESERVE_STEP) * RESERVE_STEP, max(tokens, limit))
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.reserved = room


def compact_cache(cache: DynamicCache, start: int, nodes: list[int], appended: int) -> None:
    """Keep only the accepted nodes' K/V entries after ``start`` (paper 2.1.2, cache update).

    ``nodes`` are tree-node indices, root first; their entries move to ``start, start+1, ...`` and the
    rest of the ``appended`` entries are cut. Touches ``DynamicLayer.keys/values`` (transformers 5.x).
    """
    kept = len(nodes)
    if nodes != list(range(kept)):
        src = torch.tensor(nodes, device=cache.layers[0].keys.device) + start
        for layer in cache.layers:
            layer.keys[:, :, start : start + kept] = layer.keys[:, :, src]
            layer.values[:, :, start : start + kept] = layer.values[:, :, src]
    if appended > kept:
        cache.crop(kept - appended)
