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


def test_tree_rows_attend_through_the_caches_replicas_bitwise_as_one_token_decoding_does():
    """Rows of a tree pass run batched over replica views of a growing cache; each equals a one-token
    step over the cache holding exactly its prefix and ancestors, across steps that compact and crop."""
    from medusa_core.invariant import REPLICAS_FROM, rowwise_attention

    torch.manual_seed(0)
    parents = [-1, 0, 0, 0, 1, 2, 4]  # three children of the root, then a chain under the first
    n, heads, kv_heads, dim = len(parents), 6, 2, 16
    cache = new_cache(_config())
    layer, other = cache.layers
    prompt = [torch.randn(1, kv_heads, REPLICAS_FROM, dim) for _ in range(2)]  # long enough for the replicas
    layer.update(*prompt), other.update(*prompt)
    for step in range(3):
        start = layer.get_seq_length()
        k_new, v_new = torch.randn(1, kv_heads, n, dim), torch.randn(1, kv_heads, n, dim)
        keys, values = layer.update(k_new, v_new)
        other.update(k_new, v_new)
        visible = torch.zeros(n, start + n, dtype=torch.bool)
        visible[:, :start] = True
        for i in range(n):
            j = i
            while j >= 0:
                visible[i, start + j], j = True, parents[j]
        q = torch.randn(1, heads, n, dim)
        out, _ = rowwise_attention(torch.nn.Module(), q, keys, values, visible[None, None], scaling=0.25)
        assert layer._row_buffers is not None  # the replicas were used
        for i in range(n):
            ids = visible[i].nonzero()[:, 0]
            alone, _ = rowwise_attention(torch.nn.Module(), q[:, :, i : i + 1], keys[:, :, ids], values[:, :, ids], None, scaling=0.25)
            assert torch.equal(out[:, i], alone[:, 0]), (step, i)
        compact_cache(cache, start, [0, 1, 4][: step + 1], n)  # keep a path of 1..3 nodes


def test_writes_in_place_then_extend_and_crop_hold_what_updates_would_and_pack_round_trips():
    """The lean step's way of writing: entries written into ``room_for``'s buffers, then ``extend``; ``crop`` and
    ``extend`` only move the length, and the views read afterwards are the same as ``update``'s."""
    written, updated = new_cache(_config()), new_cache(_config())
    for cache in (written, updated):
        cache.update(*_entries(5, seed=0), 0)
    layer = written.layers[0]
    for step, n in enumerate([1, 3, 2]):
        k, v = _entries(n, seed=step + 1)
        start = layer.get_seq_length()
        keys, values = layer.room_for(n)
        keys[:, :, start : start + n], values[:, :, start : start + n] = k, v
        layer.extend(n)
        updated.update(k, v, 0)
        assert layer.get_seq_length() == updated.get_seq_length() == start + n
        assert torch.equal(layer.keys, updated.layers[0].keys) and torch.equal(layer.values, updated.layers[0].values)
        assert layer.keys.rows_cache is layer  # what the SDPA rows read replicas through
        if n > 1:  # a tree step's rejected rows
            written.crop(1 - n), updated.crop(1 - n)
            assert layer.get_seq_length() == start + 1
            assert torch.equal(layer.keys, updated.layers[0].keys) and torch.equal(layer.values, updated.layers[0].values)
    # held packed between turns (values that are bfloat16 numbers), cropped, then unpacked: the same entries
    packed, plain = new_cache(_config()), DynamicCache(config=_config())
    k, v = _entries(6, seed=9)
    for cache in (packed, plain):
        cache.update(k, v.bfloat16().float(), 0)
    assert packed.layers[0].pack_values() and packed.layers[0].values.dtype == torch.bfloat16
    packed.crop(-2), plain.crop(-2)
    packed.layers[0].unpack_values()
    assert packed.get_seq_length() == 4
    assert torch.equal(packed.layers[0].keys, plain.layers[0].keys) and torch.equal(packed.layers[0].values, plain.layers[0].values)
