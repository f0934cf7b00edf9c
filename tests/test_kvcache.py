"""The decoding loop's KV cache (``medusa_core.kvcache``): growing layers hold exactly what transformers'
concatenating ``DynamicLayer`` holds, through updates, buffer growth, crops and tree compaction."""

import torch
from transformers import DynamicCache, LlamaConfig
from transformers.cache_utils import DynamicLayer

from medusa_core.kvcache import MIN_CAPACITY, GrowingLayer, compact_cache, new_cache, reserve


def _config() -> LlamaConfig:
    return LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=64)


def _entries(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)


def test_new_cache_uses_growing_layers_for_full_attention():
    cache = new_cache(_config())
    assert len(cache.layers) == 2 and all(type(layer) is GrowingLayer for layer in cache.layers)


def test_growing_layer_matches_dynamic_layer_through_growth_crop_and_compaction():
    growing, plain = new_cache(_config()), DynamicCache(config=_config())
    assert all(type(layer) is DynamicLayer for layer in plain.layers)
    steps = [MIN_CAPACITY - 3, 1, 5, MIN_CAPACITY, 2]  # the second, fourth updates overflow the buffer
    length = 0
    for i, n in enumerate(steps):
        for layer in range(2):
            k, v = _entries(n, seed=10 * i + layer)
            out_g, out_p = growing.update(k, v, layer), plain.update(k, v, layer)
            assert torch.equal(out_g[0], out_p[0]) and torch.equal(out_g[1], out_p[1])
        length += n
        if n > 1:  # a tree step: keep nodes 0, 2 of the n appended entries, as the engine does
            nodes = [0, 2] if n > 2 else [0]
            compact_cache(growing, length - n, nodes, n)
            compact_cache(plain, length - n, nodes, n)
            length += len(nodes) - n
        assert growing.get_seq_length() == plain.get_seq_length() == length
        for lg, lp in zip(growing.layers, plain.layers):
            assert torch.equal(lg.keys, lp.keys) and torch.equal(lg.values, lp.values)


def test_growing_layer_writes_in_place_until_full():
    cache = new_cache(_config())
    k, v = _entries(4, seed=0)
    cache.update(k, v, 0)
    buffer = cache.layers[0].keys.untyped_storage().data_ptr()
    cache.update(*_entries(1, seed=1), 0)
    assert cache.layers[0].keys.untyped_storage().data_ptr() == buffer  # no copy of the cache
    cache.update(*_entries(MIN_CAPACITY, seed=2), 0)
    assert cache.layers[0].keys.shape[-2] == MIN_CAPACITY + 5
    assert torch.equal(cache.layers[0].keys[:, :, :4], k)


def test_a_reserved_cache_allocates_its_room_once_and_holds_the_same_entries():
    reserved, plain = new_cache(_config()), DynamicCache(config=_config())
    reserved.update(*_entries(3, seed=0), 0)
    plain.update(*_entries(3, seed=0), 0)
    reserve(reserved, 5 * MIN_CAPACITY, limit=5 * MIN_CAPACITY)  # below RESERVE_STEP: the limit caps it
    for n in (MIN_CAPACITY, 2 * MIN_CAPACITY, MIN_CAPACITY):  # past the first buffer: one reallocation to the reserved room
        k, v = _entries(n, seed=n)
        reserved.update(k, v, 0)
        plain.update(k, v, 0)
        assert reserved.layers[0]._keys_buffer.shape[-2] == 5 * MIN_CAPACITY
        assert torch.equal(reserved.layers[0].keys, plain.layers[0].keys)
    buffer = reserved.layers[0].keys.untyped_storage().data_ptr()
    reserved.update(*_entries(MIN_CAPACITY - 3, seed=9), 0)  # exactly full: still the same buffer
    assert reserved.layers[0].keys.untyped_storage().data_ptr() == buffer
