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
    shortens the views; the buffer is kept. ``extend`` (the lean step's writes) and ``crop`` move L only: the
    views are made when ``keys`` or ``values`` is next read (making 60 views a step cost the demo's lean step
    0.13 ms of its 2.3, docs/BENCH.md "Nothing around the lean pass"), so ``get_seq_length`` reads L itself.

    Replicas (none until ``row_keys`` asks; ``release_rows`` frees them) are scratch copies of the cache,
    in buffers of their own, for the rows of a tree pass: ``row_keys`` gives B rows each a replica that
    holds the shared prefix followed by that row's own keys, so batch-invariant attention runs B rows as
    one batched call over views shaped exactly like one-token decoding's (``invariant.rowwise_attention``). The returned views carry
    ``rows_cache`` (this layer) for that purpose.
    """

    reserved = 0  # tokens the next reallocation makes room for, if they are at least as many as needed
    # L, the batch, and whether ``keys`` / ``values`` must be made again from the buffers before they are read
    _length, _batch, _stale = 0, 1, False

    @property
    def keys(self) -> torch.Tensor | None:
        if self._stale:
            self._views()
        return self._keys

    @keys.setter
    def keys(self, keys: torch.Tensor | None) -> None:
        if self._stale:  # the values' view first: it is made from the length the keys are about to lose
            self._views()
        self._keys = keys
        self._length = keys.shape[-2] if keys is not None and keys.dim() > 1 else 0

    @property
    def values(self) -> torch.Tensor | None:
        if self._stale:
            self._views()
        return self._values

    @values.setter
    def values(self, values: torch.Tensor | None) -> None:
        if self._stale:
            self._views()
        self._values = values

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._keys_buffer = self._values_buffer = None
        self._capacity = 0
        self._row_buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # replicas' keys, values [R, H, C, Dh]
        self._replicated = 0  # entries 0.._replicated−1 of every replica equal the cache's

    @property
    def batch(self) -> int:
        """B, the sequences the cache holds (1 before its first entries)."""
        return self._batch

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, n, batch = self.get_seq_length(), key_states.shape[-2], key_states.shape[0]
        self.room_for(n, key_states, value_states)
        self._keys_buffer[:batch, ..., length : length + n, :] = key_states
        self._values_buffer[:batch, ..., length : length + n, :] = value_states
        self.extend(n, batch)
        return self.keys, self.values

    def room_for(self, n: int, key_states: torch.Tensor | None = None, value_states: torch.Tensor | None = None):
        """Make room for ``n`` entries after the cache's (reallocating as ``update`` does) and return the buffers
        ([B, H, C, Dh] keys, values), for a writer that fills entries L..L+n−1 in place and then calls ``extend(n)``
        (``medusa_core.lean``). ``key_states`` / ``value_states``: the new entries' shape and dtype (default: the
        cache's). An initialized layer only."""
        length = self.get_seq_length()
        end = length + n
        if end > self._capacity or self.reserved > self._capacity:
            capacity = self.reserved if self.reserved >= end else max(2 * self._capacity, end, MIN_CAPACITY)
            self._reallocate(self.keys if key_states is None else key_states, self.values if value_states is None else value_states, capacity)
        self._replicated = min(self._replicated, length)  # a crop may have cut below it; writes start at length
        return self._keys_buffer, self._values_buffer

    def extend(self, n: int, batch: int = 1) -> None:
        """Take the ``n`` entries written after the cache's into it: the views grow to L + n (made when read)."""
        self._length, self._batch, self._stale = self._length + n, batch, True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` entries (``DynamicLayer.crop``'s argument); the buffers are kept."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of entries to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        if self._values_buffer is None:  # values held packed (``pack_values``): not views of a buffer
            super().crop(tokens_to_remove)
            return
        self._length, self._stale = max(self._length + tokens_to_remove, 0), True

    def _views(self) -> None:
        """``keys`` / ``values``: the buffers' first L entries of the batch's sequences."""
        self._stale = False
        end, batch = self._length, self._batch
        self._keys = self._keys_buffer[:batch, ..., :end, :]
        self._values = self._values_buffer[:batch, ..., :end, :]
        self._keys.rows_cache = self._values.rows_cache = self if batch == 1 else None

    def _reallocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        """New buffers [B, H, capacity, Dh] holding the cache's entries; the replicas are dropped."""
        length, batch = self.get_seq_length(), key_states.shape[0]
        keys = key_states.new_empty(batch, *key_states.shape[1:-2], capacity, key_states.shape[-1])
        values = value_states.new_empty(batch, *value_states.shape[1:-2], capacity, value_states.shape[-1])
        if length:
            keys[..., :length, :] = self.keys
            values[..., :length, :] = self.values
        self._keys_buffer, self._values_buffer, self._capacity, self._batch = keys, values, capacity, batch
        self.keys, self.values = keys[..., :length, :], values[..., :length, :]
        self.release_rows()

    def fit(self, length: int) -> None:
        """Keep the first ``length`` entries (at most those held) in buffers of exactly that capacity, freeing the
        larger ones and the replicas: what a kept conversation's cache holds between turns when over its budget."""
        length = min(length, self.get_seq_length())
        keys, values = self.keys[..., :length, :].clone(), self.values[..., :length, :].clone()
        self._keys_buffer, self._values_buffer, self._capacity = keys, values, length
        self.keys, self.values = keys, values
        self.release_rows()

    def pack_values(self) -> bool:
        """Between a conversation's turns: hold the values as bfloat16 where that loses nothing, and free their
        float32 buffer. A bias-free int4 ``v_proj`` (``quant.layers.Int4Linear``: a bfloat16 product cast to
        float32) writes values that are bfloat16 numbers, so they round-trip exactly; keys have RoPE applied in
        float32 and stay as they are. Returns True when packed; False (nothing changed) for values that are not
        all bfloat16 numbers, or not float32. ``unpack_values`` restores the buffer before the next pass."""
        if not self.is_initialized or self._values_buffer is None or self.values.dtype != torch.float32:
            return False
        packed = self.values.to(torch.bfloat16)
        if not torch.equal(packed.float(), self.values):
            return False
        self._values_buffer, self.values = None, packed
        self.release_rows()
        return True

    def unpack_values(self) -> None:
        """Undo ``pack_values``: the values back in a float32 buffer of the keys' capacity (the same bits)."""
        if not self.is_initialized or self._values_buffer is not None:
            return
        length = self.values.shape[-2]
        buffer = self._keys_buffer.new_empty(self._keys_buffer.shape)
        buffer[..., :length, :] = self.values
        self._values_buffer, self.values = buffer, buffer[..., :length, :]
        self.values.rows_cache = getattr(self.keys, "rows_cache", None)

    def release_rows(self) -> None:
        """Free the replicas (``row_keys`` makes them again, prefix copied once, when a tree pass needs them)."""
        self._row_buffers, self._replicated = None, 0

    def row_keys(self, start: int, paths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of B tree rows, each the shared prefix then its own entries, as one batch.

        Args:
            start: P, the entries every row sees first (0..P−1: the cache before this pass).
            paths: [B, d] positions (≥ P, in this pass's entries) of each row's further keys, in order.

        Returns (keys, values), each [B, H, P + d, Dh]: views of replicas 0..B−1 (buffers [R, H, C, Dh] of
        their own, beside the cache's), whose entries P..P+d−1 are overwritten with row b's. The cache is
        left as it is. Batch size 1 only.
        """
        rows, depth = paths.shape
        if self._row_buffers is None or self._row_buffers[0].shape[0] < rows:
            shape = (rows, *self.keys.shape[1:-2], self._capacity, self.keys.shape[-1])
            self._row_buffers, self._replicated = (self.keys.new_empty(shape), self.values.new_empty(shape)), 0
        if self._replicated < start:  # bring the replicas' prefix up to date (the entries since the last tree pass)
            for buffer, cache in zip(self._row_buffers, (self.keys, self.values)):
                buffer[..., self._replicated : start, :] = cache[..., self._replicated : start, :]  # [1, ...] broadcast
            self._replicated = start
        count = start + depth
        for buffer, cache in zip(self._row_buffers, (self.keys, self.values)):
            buffer[:rows, ..., start:count, :] = cache[0][..., paths, :].transpose(0, 1)  # [H, B, d, Dh] -> [B, H, d, Dh]
        return self._row_buffers[0][:rows, ..., :count, :], self._row_buffers[1][:rows, ..., :count, :]


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


def release_rows(cache: DynamicCache) -> None:
    """Free the tree rows' replicas of every ``GrowingLayer`` of ``cache`` (a kept conversation's cache between
    turns holds only its entries)."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer) and layer.is_initialized:
            layer.release_rows()


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
