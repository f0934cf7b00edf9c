"""Reading the prompt (``medusa_core.prefill``): chunked prefill, ``ReadProgress`` records, and a
conversation's KV cache kept between turns, on tiny random models with the batch-invariant decoding
step of the CPU (``make_batch_invariant``): greedy replies on a kept cache equal fresh runs', and each
turn reads only the tokens the cache does not hold."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from tiny_models import random_heads, tiny_backbone

from medusa_core import ConversationCache, MedusaModel, ReadProgress, StepRecord
from medusa_core.invariant import MAX_ROWWISE, make_batch_invariant
from medusa_core.kvcache import RESERVE_STEP, GrowingLayer
from medusa_core import prefill
from medusa_core.prefill import common_prefix, read_prompt, release_free_memory

N_NEW = 12
CHUNK = 16  # prompt tokens per pass


@pytest.fixture(scope="module")
def model() -> MedusaModel:
    backbone = make_batch_invariant(tiny_backbone("llama", seed=3, max_position_embeddings=1024), quantized=False)
    return MedusaModel(backbone, random_heads(backbone))


def ids(*tokens: int | list[int]) -> torch.Tensor:
    flat = [t for part in tokens for t in (part if isinstance(part, list) else [part])]
    return torch.tensor([flat])


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, input_ids, **kwargs) -> tuple[list[int], list[ReadProgress], int]:
    """The reply's tokens, the progress records and the prompt tokens read (passes before step 0) of one
    ``generate``."""
    kwargs = {"max_new_tokens": N_NEW, "tree": "sparse_16", "prefill_chunk": CHUNK, **kwargs}
    passes = []
    hook = model.backbone.get_input_embeddings().register_forward_pre_hook(lambda _, args: passes.append(args[0].shape[1]))
    try:
        items, read = [], None
        for item in model.generate(input_ids, **kwargs):
            read = sum(passes) if read is None and isinstance(item, StepRecord) else read
            items.append(item)
    finally:
        hook.remove()
    steps = [r for r in items if isinstance(r, StepRecord)]
    assert items[len(items) - len(steps) :] == steps  # progress first, then the steps
    return [t for r in steps for t in r.token_ids], [r for r in items if isinstance(r, ReadProgress)], read


def read(model, input_ids, chunk, cache=None) -> tuple[torch.Tensor, object]:
    """Final hidden state [1, H] and cache after reading ``input_ids`` in chunks of ``chunk`` tokens."""
    cache = cache if cache is not None else model._new_cache()
    reader = read_prompt(model._steps.decoder, cache, input_ids, 0, chunk, (input_ids.shape[1],) * 2, None, False)
    while True:
        try:
            next(reader)
        except StopIteration as done:
            return done.value, cache


def test_a_prompt_read_in_chunks_agrees_with_one_pass_to_rounding_and_token_by_token_bitwise(model):
    # Passes after cached entries take one batched SDPA call (invariant.READING): not bitwise, as
    # passes of more than MAX_ROWWISE rows never were. One-token passes are decoding steps: bitwise.
    input_ids = ids(prompt(3 * MAX_ROWWISE, seed=1))
    whole, whole_cache = read(model, input_ids, input_ids.shape[1])
    for chunk in (7, 16, MAX_ROWWISE + 1):
        hidden, cache = read(model, input_ids, chunk)
        torch.testing.assert_close(hidden, whole, rtol=1e-5, atol=1e-5)
        for a, b in zip(cache.layers, whole_cache.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
    short = ids(prompt(MAX_ROWWISE, seed=2))  # read in one row-wise pass, or token by token
    assert torch.equal(read(model, short, 1)[0], read(model, short, MAX_ROWWISE)[0])


def test_only_passes_after_cached_entries_take_one_batched_attention_call(model, monkeypatch):
    import medusa_core.invariant as invariant

    batched = []
    sdpa = invariant.sdpa_attention_forward
    monkeypatch.setattr(invariant, "sdpa_attention_forward", lambda m, q, *a, **k: batched.append(q.shape[2]) or sdpa(m, q, *a, **k))
    read(model, ids(prompt(60, seed=3)), CHUNK)  # the first pass has nothing cached: row by row
    assert batched == [CHUNK] * 2 * model.config.num_hidden_layers + [60 - 3 * CHUNK] * model.config.num_hidden_layers
    batched.clear()
    run(model, ids(prompt(30, seed=3)), prefill_chunk=60)  # one pass, then decoding steps: all row by row
    assert batched == []


def test_progress_comes_before_the_first_chunk_and_after_every_chunk_but_the_last_then_step_0(model):
    reply, progress, read = run(model, ids(prompt(50, seed=3)), progress=True)
    assert [(p.read, p.total, p.reused) for p in progress] == [(0, 50, 0), (16, 50, 0), (32, 50, 0), (48, 50, 0)]
    assert [p.fraction for p in progress] == [0, 16 / 50, 32 / 50, 48 / 50] and read == 50
    assert run(model, ids(prompt(50, seed=3)))[0] == reply  # without progress: no records, same reply
    assert run(model, ids(prompt(50, seed=3)), prefill_chunk=50)[0] == reply


def test_each_turn_on_a_kept_cache_equals_a_fresh_run_and_reads_only_its_new_tokens(model):
    kept, history = ConversationCache(), prompt(30, seed=4)
    for turn in range(4):
        history += prompt(5 + 7 * turn, seed=10 + turn)  # the next user message
        fresh = run(model, ids(history))[0]
        again, progress, read = run(model, ids(history), kept=kept, progress=True, prefill_chunk=4)
        assert again == fresh, turn
        held = len(history) - (5 + 7 * turn) if turn else 0  # what the cache holds of this prompt
        assert progress[0].reused == held and read == len(history) - held
        assert progress[1].fraction == 4 / (len(history) - held)  # of the tokens it has to read
        assert kept.token_ids[: len(history)] == history
        history += again[:-1]  # the reply, as the next prompt holds it (its last token is not in the cache)


@pytest.mark.parametrize("change", ["edit", "regenerate", "medusa off", "system prompt"])
def test_an_edit_regenerate_or_setting_change_reuses_only_the_shared_prefix_and_stays_exact(model, change):
    kept, first = ConversationCache(), prompt(40, seed=5)
    reply = run(model, ids(first), kept=kept)[0]
    second = first + reply + prompt(9, seed=6)
    run(model, ids(second), kept=kept)
    nxt = {
        "edit": first + reply + prompt(9, seed=7),  # the last message, edited
        "regenerate": second,
        "medusa off": second + prompt(3, seed=8),
        "system prompt": prompt(4, seed=9) + second[4:],
    }[change]
    settings = {"medusa": False} if change == "medusa off" else {"temperature": 0.0}
    again, _, read = run(model, ids(nxt), kept=kept, prefill_chunk=4, **settings)
    assert again == run(model, ids(nxt), **settings)[0]
    assert read == len(nxt) - min(common_prefix(second + reply, nxt), len(nxt) - 1)


def test_a_cache_kept_for_another_model_is_not_reused(model):
    other = MedusaModel(model.backbone, random_heads(model.backbone, seed=9))
    kept, input_ids = ConversationCache(), ids(prompt(40, seed=11))
    run(model, input_ids, kept=kept)
    assert run(other, input_ids, kept=kept)[2] == 40


def test_stopping_while_reading_keeps_the_chunks_already_read_for_the_next_turn(model):
    kept, input_ids = ConversationCache(), ids(prompt(70, seed=12))
    steps = model.generate(input_ids, max_new_tokens=N_NEW, kept=kept, progress=True, prefill_chunk=CHUNK)
    assert next(steps).read == 0 and next(steps).read == CHUNK
    steps.close()  # Stop: the iterator is closed between chunks
    assert kept.token_ids == input_ids[0, :CHUNK].tolist()
    reply, _, read = run(model, input_ids, kept=kept)
    assert read == 70 - CHUNK and reply == run(model, input_ids)[0]


def test_a_kept_cache_reserves_room_in_steps_of_whole_kilotokens_up_to_the_context_and_frees_it_on_clear(model):
    kept = ConversationCache()
    per_token = model.config.num_hidden_layers * 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # float32
    run(model, ids(prompt(300, seed=13)), kept=kept)
    assert kept.nbytes == per_token * RESERVE_STEP  # 300 + N_NEW + 17 tokens, rounded up
    history = kept.token_ids
    run(model, ids(history + prompt(20, seed=14)), kept=kept)
    assert kept.nbytes == per_token * RESERVE_STEP  # the next turn fits: no reallocation
    run(model, ids(prompt(1000, seed=15)), kept=kept, prefill_chunk=MAX_ROWWISE)
    assert kept.nbytes == per_token * (model.max_context + 17)  # not 2 * RESERVE_STEP: more never fits
    kept.clear()
    assert kept.nbytes == 0 and kept.token_ids == []


def test_a_kept_cache_over_its_budget_keeps_the_conversations_first_entries_that_fit_and_stays_exact(model):
    per_token = model.config.num_hidden_layers * 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # float32
    kept, history = ConversationCache(max_bytes=100 * per_token), prompt(300, seed=16)
    reply = run(model, ids(history), kept=kept)[0]
    assert kept.nbytes == 100 * per_token and kept.token_ids == history[:100]  # not the 1,024-token reservation
    history += reply[:-1] + prompt(9, seed=17)
    again, _, read = run(model, ids(history), kept=kept)
    assert read == len(history) - 100  # the part past the budget is read again
    assert again == run(model, ids(history))[0]
    assert kept.nbytes == 100 * per_token


def test_a_kept_cache_within_its_budget_keeps_every_entry(model):
    per_token = model.config.num_hidden_layers * 2 * model.config.num_key_value_heads * model.config.head_dim * 4
    kept = ConversationCache(max_bytes=RESERVE_STEP * per_token)
    run(model, ids(prompt(300, seed=18)), kept=kept)
    assert len(kept.token_ids) > 300 and kept.nbytes == RESERVE_STEP * per_token


@pytest.fixture(scope="module")
def int4_model() -> MedusaModel:
    """A tiny Llama with int4 decoder linears and no biases, as a GGUF backbone is served: its values are bfloat16 numbers."""
    from tests.test_lean import int4_backbone

    backbone = int4_backbone("llama", seed=3, max_position_embeddings=1024)
    return MedusaModel(backbone, random_heads(backbone))


def test_between_turns_an_int4_backbones_kept_values_are_bfloat16_and_every_turn_stays_exact(int4_model):
    config = int4_model.config
    kept, history = ConversationCache(), prompt(60, seed=21)
    for turn in range(3):
        history += prompt(6, seed=22 + turn)
        again = run(int4_model, ids(history), kept=kept)[0]
        assert again == run(int4_model, ids(history))[0], turn
        layers = [layer for layer in kept._cache.layers if layer.is_initialized]
        assert all(layer.values.dtype == torch.bfloat16 and layer.keys.dtype == torch.float32 for layer in layers)
        held = len(kept.token_ids)
        per_layer = config.num_key_value_heads * config.head_dim
        keys = sum(layer._keys_buffer.untyped_storage().nbytes() for layer in layers)  # the keys' float32 room
        assert kept.nbytes == keys + len(layers) * per_layer * held * 2  # the values: exactly the held entries, 2 bytes each
        history += again[:-1]


def test_values_that_are_not_bfloat16_numbers_stay_float32_between_turns(model):
    kept = ConversationCache()
    run(model, ids(prompt(40, seed=25)), kept=kept)  # a float32 backbone: its values use all of float32's bits
    assert all(layer.values.dtype == torch.float32 for layer in kept._cache.layers if layer.is_initialized)


def test_packed_values_unpack_to_the_same_bits_in_a_buffer_of_the_keys_capacity():
    layer = GrowingLayer()
    keys = torch.randn(1, 2, 5, 8)
    values = torch.randn(1, 2, 5, 8).to(torch.bfloat16).float()  # bfloat16 numbers
    layer.update(keys, values)
    capacity = layer._keys_buffer.shape[-2]
    assert layer.pack_values() and layer.values.dtype == torch.bfloat16
    layer.crop(-1)  # a later turn shares 4 of the 5 entries
    layer.unpack_values()
    assert layer.values.dtype == torch.float32 and layer._values_buffer.shape[-2] == capacity
    assert torch.equal(layer.values, values[..., :4, :]) and torch.equal(layer.keys, keys[..., :4, :])
    layer.update(keys[..., :1, :], values[..., :1, :])  # and the buffer takes the next entries in place
    assert torch.equal(layer.values[..., 4:, :], values[..., :1, :])
    other = GrowingLayer()
    other.update(keys, torch.randn(1, 2, 5, 8))
    assert not other.pack_values() and other.values.dtype == torch.float32  # not exact: left as it is


def test_every_reply_on_a_kept_cache_and_every_clear_give_freed_memory_back(model, monkeypatch):
    calls = []
    monkeypatch.setattr(prefill, "release_free_memory", lambda: calls.append(1))
    kept = ConversationCache(max_bytes=0)
    run(model, ids(prompt(40, seed=19)), kept=kept)
    calls.clear()
    run(model, ids(prompt(40, seed=20)), kept=kept)  # a later turn
    assert calls == [1] and kept.nbytes == 0
    kept.clear()
    assert calls == [1, 1]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(prefill._malloc_trim() is None, reason="glibc's malloc_trim only")
def test_buffers_freed_between_smaller_ones_go_back_to_the_system_instead_of_growing_the_process():
    """What a kept cache over its budget does each turn: grow every layer's buffer past the last turn's, then
    keep a smaller copy. Without giving the holes back, the process grows ~120 MB a turn here."""
    kept = [torch.zeros(3, 3000, 64) for _ in range(40)]  # 40 layers, 2.3 MB each
    before = None
    for turn in range(6):
        grown = [torch.ones(3, 4500 + 400 * turn, 64) for _ in kept]
        kept = [g[:, :3000].clone() for g in grown]
        del grown
        release_free_memory()
        before = before or rss_mb()
    assert rss_mb() - before < 60


def test_a_negative_kept_cache_budget_is_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match=r"max_bytes=-1 .*None \(no limit\) or a number of bytes ≥ 0"):
        ConversationCache(max_bytes=-1)


def test_generate_passes_the_current_cache_keyword_and_warns_nothing(model, monkeypatch):
    logged = []
    monkeypatch.setattr(logging.Logger, "warning_once", lambda self, *a, **k: logged.append(a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(model, ids(prompt(40, seed=14)), kept=ConversationCache())
    assert logged == []


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True])
def test_prefill_chunk_must_be_a_positive_integer(model, chunk):
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 1"):
        model.generate(ids(1, 2, 3), max_new_tokens=2, prefill_chunk=chunk)
