"""Reading the prompt (the prefill before step 0): in chunks, with progress, and from a conversation's KV
cache kept between turns.

A chat sends the whole conversation as each turn's prompt. Like llama.cpp's server and LM Studio, the
engine keeps the KV cache of a conversation (``ConversationCache``) and reads only what it does not
already hold: the cache is cut to the longest common prefix of the tokens it holds and the new prompt,
and the rest is read. Nothing else decides whether it is reused: a K/V entry depends only on the
model and the tokens up to it, so an edit, a regenerate or a new system prompt simply shares a shorter
prefix, and sampling, tree and Medusa settings do not touch the entries. A cache belongs to the model
that wrote it; another model starts afresh.

The prompt is read ``PREFILL_CHUNK`` tokens at a time, so a caller can stop between chunks and show
progress (``ReadProgress`` records, ``MedusaModel.generate(progress=True)``).

Exactness: an entry that was decoded (a reply's token, written by a tree or one-token pass) is reused
instead of being read again with the next prompt, and a pass after cached entries runs its attention as
one SDPA call (``invariant.READING``), as passes of more than ``invariant.MAX_ROWWISE`` rows always do.
Batched SDPA and matmuls differ from one-row passes in the last bits, so a kept cache's entries are not
bitwise a fresh run's; greedy replies on a kept cache equal fresh ones unless two top logits are that
close (``tests/test_prefill.py`` on tiny models, ``tests/test_demo_model.py`` on the demo). Decoding
steps stay batch-invariant: greedy Medusa equals plain greedy on a kept cache too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

import torch
from transformers import DynamicCache

from .invariant import READING, ROWWISE
from .kvcache import GrowingLayer, release_rows, reserve

#: Prompt tokens read per pass: the longest a Stop waits and the granularity of ``ReadProgress``.
PREFILL_CHUNK = 256


@dataclass(frozen=True)
class ReadProgress:
    """How far the prompt has been read. ``generate(progress=True)`` yields one before the first chunk
    and one after every chunk but the last (whose end is step 0, the first ``StepRecord``) when the
    tokens to read take more than one chunk; none otherwise.

    Attributes:
        read: prompt tokens in the cache so far, ``reused`` ones included.
        total: T, the prompt's tokens.
        reused: tokens taken from the kept ``ConversationCache`` (0 without one).
        elapsed_s: seconds since the reading started.
    """

    read: int
    total: int
    reused: int
    elapsed_s: float

    @property
    def fraction(self) -> float:
        """Share of the tokens to read (those not ``reused``) read so far, in [0, 1)."""
        return (self.read - self.reused) / (self.total - self.reused)


class ConversationCache:
    """A conversation's KV cache, kept between its turns, and the token ids it holds.

    Pass the same object to every turn's ``MedusaModel.generate(kept=...)``; the engine reuses the
    entries of the longest common prefix of ``token_ids`` and the new prompt (at most T − 1: the last
    prompt token is read again for its logits) and records every token it writes. Not thread-safe:
    one reply at a time per conversation.

    Args:
        max_bytes: memory the cache may keep between turns (None: no limit). When a reply ends with its
            buffers over it, the cache keeps the conversation's first ``max_bytes // bytes_per_token``
            entries in buffers of exactly that size; a later turn reads the rest of its prompt again.
            So memory stays bounded over a long session, and conversations that fit keep every entry.

    Raises:
        ValueError: ``max_bytes`` is negative.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} is not allowed: use None (no limit) or a number of bytes ≥ 0")
        self.max_bytes = max_bytes
        self.token_ids: list[int] = []  # the tokens whose K/V entries the cache holds, in order
        self._cache: DynamicCache | None = None
        self._owner: Callable[[], Any] = lambda: None  # weak reference to the model that wrote it

    def clear(self) -> None:
        """Forget the entries (and free their memory)."""
        self.token_ids, self._cache, self._owner = [], None, lambda: None
        release_free_memory()

    def settle(self) -> None:
        """End of a reply: free the scratch replicas its tree passes made (``kvcache.release_rows``), keep only
        the entries that fit when the buffers exceed ``max_bytes`` (``GrowingLayer.fit``), hold the values as
        bfloat16 until the next turn where that is exact (``GrowingLayer.pack_values``: a quarter of the memory
        less on a GGUF backbone, the same bits when the next turn unpacks them), and give the freed memory back
        to the operating system (``release_free_memory``)."""
        if self._cache is None:
            return
        release_rows(self._cache)
        if self.max_bytes is not None and self.nbytes > self.max_bytes:
            self._fit()
        for layer in self._cache.layers:
            if isinstance(layer, GrowingLayer):
                layer.pack_values()
        release_free_memory()

    def _fit(self) -> None:
        """Keep the first entries that fit in ``max_bytes``, in buffers of exactly that size."""
        layers = [layer for layer in self._cache.layers if layer.is_initialized]
        per_token = sum(t[..., :1, :].numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
        keep = min(len(self.token_ids), self.max_bytes // max(per_token, 1))
        for layer in layers:
            if isinstance(layer, GrowingLayer):
                layer.fit(keep)
            elif layer.get_seq_length() > keep:
                layer.crop(keep)
        self.token_ids = self.token_ids[:keep]

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers the kept entries live in (their capacity, see ``kvcache.GrowingLayer``), with
        any tree-row replicas still held (none between turns: ``release_rows``)."""
        if self._cache is None:
            return 0
        layers = [layer for layer in self._cache.layers if layer.is_initialized]
        replicas = [x for layer in layers for x in (getattr(layer, "_row_buffers", None) or ())]
        return sum(x.untyped_storage().nbytes() for x in [*(t for layer in layers for t in (layer.keys, layer.values)), *replicas])

    def take(self, owner: Any, new_cache: Callable[[], DynamicCache], prompt: Sequence[int]) -> tuple[DynamicCache, int]:
        """The cache to read ``prompt`` with, cut to the entries it shares with it, and their number.

        ``owner`` is the model (held weakly): a cache of another model is dropped and ``new_cache()``
        made. Call inside ``torch.inference_mode`` (the cut makes views of inference tensors).
        """
        if self._cache is None or self._owner() is not owner:
            self.clear()
            self._cache, self._owner = new_cache(), weakref.ref(owner)
        reused = min(common_prefix(self.token_ids, prompt), len(prompt) - 1)
        for layer in self._cache.layers:  # a failed pass may have left more entries in some layers
            extra = layer.get_seq_length() - reused if layer.is_initialized else 0
            if extra > 0:
                layer.crop(-extra)
        for layer in self._cache.layers:
            if isinstance(layer, GrowingLayer):
                layer.unpack_values()
        self.token_ids = list(prompt[:reused])
        return self._cache, reused


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the operating system (glibc's ``malloc_trim(0)``; elsewhere nothing).

    A kept cache's buffers are a few MB per layer, below glibc's adaptive mmap threshold, so they live in
    the heap; a turn's larger buffers freed between smaller ones leave holes that glibc keeps, and the
    process's memory would grow by a conversation's size every turn. Costs well under a millisecond.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    library = ctypes.CDLL(name) if name else None
    return getattr(library, "malloc_trim", None)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def read_prompt(
    decoder: Any, cache: DynamicCache, input_ids: torch.Tensor, reused: int, chunk: int, capacity: tuple[int, int],
    kept: ConversationCache | None, progress: bool, all_states: bool = False, lean: Any = None,
) -> Generator[ReadProgress, None, torch.Tensor]:
    """Read ``input_ids`` [1, T] from position ``reused`` on (the cache holds the first ``reused``), ``chunk``
    tokens per decoder pass; with ``progress`` and more than one pass, yields a ``ReadProgress`` before the
    first pass and after each but the last.
    Reserves room in the cache first: ``capacity`` is (entries the reply needs, most it can ever need),
    see ``kvcache.reserve``. Returns the last position's final-norm hidden
    state [1, H] (with ``all_states``: every position read, [T - reused, H]). ``kept`` (if any) learns each chunk's
    tokens once their entries are written. ``lean`` (a ``lean.step.LeanStep``, or None) reads each pass in one call
    (``LeanStep.read``), with the same bits."""
    total, start = input_ids.shape[1], time.perf_counter()
    rowwise = getattr(getattr(decoder, "config", None), "_attn_implementation", None) in ROWWISE
    reading = {READING: True} if rowwise else {}  # only the batch-invariant attention knows this keyword
    with torch.inference_mode():
        reserve(cache, *capacity)
    read, states = reused, []
    if progress and total - reused > chunk:
        yield ReadProgress(read=read, total=total, reused=reused, elapsed_s=0.0)
    while True:
        end = min(read + chunk, total)
        with torch.inference_mode():  # not across the yield: the mode is the consumer's thread's state
            hidden = lean.read(input_ids[0, read:end], cache) if lean is not None else None  # [N, H]
            if hidden is None:
                hidden = decoder(input_ids=input_ids[:, read:end], cache=cache, use_cache=True, **reading).last_hidden_state[0]
        if kept is not None:
            kept.token_ids += input_ids[0, read:end].tolist()
        read = end
        if all_states:
            states.append(hidden)
        if read == total:
            return torch.cat(states) if all_states else hidden[-1:]  # [T - reused, H] or [1, H]
        del hidden  # a chunk's activations are not kept while the caller looks at the progress
        if progress:
            yield ReadProgress(read=read, total=total, reused=reused, elapsed_s=time.perf_counter() - start)
