"""A corpus of the model's own replies as an n-gram draft source (REST, He et al. 2023; SuffixDecoding, Oliaro et al. 2024).

A chat model says the same things in many replies ("Here's a ...", "I hope this helps!", the list and code
scaffolding it always writes). REST drafts from a datastore of text by matching the context's last tokens;
SuffixDecoding keeps such an index over the model's previous outputs and proposes continuations by how often
they followed. ``Datastore`` is that index over replies of the served backbone (for the demo, the
self-distillation replies in ``assets/demo/distill``): for every context of 1..``max_context`` tokens that
precedes a reply token, the token that followed it most often, how often, and out of how many. ``chain``
walks it: the longest context suffix found, its most frequent next token while that token's share of the
continuations is high enough, then again from the context plus that token.

The drafts are point masses chosen from the context alone, like the heads' candidates and prompt lookup's,
so the backbone's verification keeps greedy output equal to plain greedy output and exact sampling exact.

Works on token ids only; the index is numpy arrays (keys sorted for ``searchsorted``), saved with safetensors.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

_MULT = np.uint64(0x9E3779B97F4A7C15)
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64's finaliser
_MASK = (1 << 64) - 1
#: Bumped when the index's layout changes, so that a cached index of an older layout is built again, not read.
_LAYOUT = 4


@dataclass(frozen=True)
class CorpusRule:
    """When a corpus chain is proposed (``Datastore.chain``). Raises ``ValueError`` for values out of range.

    The defaults were the fastest of the variants timed at the app's chat settings on the bench prompts
    (docs/BENCH.md, "Drafts from the model's own replies"): a chain verified alone costs ~0.15 of a plain step
    per token on a 2-core CPU, and a share over-states how often a held-out reply goes on that way.
    """

    first_share: float = 0.7  # the first token's share of its context's continuations, at least
    first_context: int = 2  # the first token's matched context, in tokens, at least
    next_share: float = 0.7  # every later token's share, at least (any context length)
    max_tokens: int = 4  # the longest chain

    def __post_init__(self) -> None:
        for name in ("first_share", "next_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("first_context", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (tokens), got {getattr(self, name)}")


def _context_hash(tokens: Sequence[int]) -> int:
    """The 64-bit hash of a context (its length seeds it; splitmix64's finaliser mixes every token into the high
    bits, which the keys keep): what ``_context_hashes`` computes in bulk."""
    h = len(tokens)
    for t in tokens:
        h = (h * 0x9E3779B97F4A7C15 + t + 1) & _MASK
    h = ((h ^ (h >> 30)) * _MIX[0]) & _MASK
    h = ((h ^ (h >> 27)) * _MIX[1]) & _MASK
    return h ^ (h >> 31)


def _context_hashes(seq: np.ndarray, targets: np.ndarray, n: int) -> np.ndarray:
    """64-bit hashes [len(targets)] of the n tokens before each index in ``targets`` (each >= n) of ``seq`` [T] int64."""
    h = np.full(len(targets), n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for back in range(n, 0, -1):
            h = h * _MULT + (seq[targets - back] + 1).astype(np.uint64)
        h = (h ^ (h >> np.uint64(30))) * np.uint64(_MIX[0])
        h = (h ^ (h >> np.uint64(27))) * np.uint64(_MIX[1])
    return h ^ (h >> np.uint64(31))


def _sources(path: Path) -> list[str] | None:
    """The files an index was built from (``Datastore.save``'s metadata), or None when it does not say (an older
    version's index) or cannot be read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            return json.loads((f.metadata() or {})["sources"])
    except Exception:  # a foreign, truncated or older file
        return None


class Datastore:
    """Most frequent next token per context of the model's replies.

    Args (use ``build`` or ``load``): ``keys`` [E] uint64 sorted context keys (a context's hash shifted right by
    ``bits``), ``tokens`` [E] the most frequent next token, ``counts`` [E] how often it followed, ``totals`` [E] how
    often the context occurred before a reply token (the three kept as int32); ``max_context``: the longest context
    indexed (tokens).

    ``chain`` walks the index in Python, or in one compiled call after ``use_kernel`` (the same drafts).
    """

    def __init__(self, keys: np.ndarray, tokens: np.ndarray, counts: np.ndarray, totals: np.ndarray, max_context: int, bits: int):
        self.keys = keys
        self.tokens, self.counts, self.totals = (np.ascontiguousarray(a, dtype=np.int32) for a in (tokens, counts, totals))
        self.max_context, self.bits = max_context, bits
        self.kernel = None  # the compiled walk and its columns as tensors (``use_kernel``), or None

    def use_kernel(self, module) -> None:
        """Walk chains with ``module.corpus_chain`` (``medusa_core.lean``'s extension: ``lean/corpus_chain.h``), which
        proposes the same tokens as the Python walk at a small fraction of its cost; None keeps the Python walk. The
        columns are shared with the arrays, not copied."""
        import torch

        if module is None:
            self.kernel = None
            return
        columns = [torch.from_numpy(self.keys.view(np.int64))]
        columns += [torch.from_numpy(a) for a in (self.tokens, self.counts, self.totals)]
        self.kernel = (module.corpus_chain, columns)

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def build(
        cls, sequences: Iterable[tuple[Sequence[int], int]], max_context: int = 6, min_total: int = 2, min_share: float = 0.5
    ) -> "Datastore":
        """Index ``sequences``: (token ids of prompt + reply, prompt length) pairs; every reply token is a
        continuation of the 1..``max_context`` tokens before it (which may reach into the prompt). Contexts seen
        fewer than ``min_total`` times, or whose top token's share is below ``min_share``, are left out (no rule
        would propose them). A context's key keeps the high 64 − b bits of its hash, b the bits of the largest
        token id, so that (context, next token) sorts as one 64-bit number: of C contexts about C² / 2^(65 − b)
        pairs share a key (under one for the demo's ~14 M contexts and b = 16), and a shared key only mixes two
        contexts' drafts, which the backbone verifies.
        Raises ``ValueError`` for ``max_context`` < 1."""
        if max_context < 1:
            raise ValueError(f"max_context must be >= 1 (tokens), got {max_context}")
        pairs = [(np.asarray(ids, dtype=np.int64), prompt_len) for ids, prompt_len in sequences]
        pairs = [(seq, p) for seq, p in pairs if len(seq)]
        if not pairs:
            empty = np.zeros(0, dtype=np.int64)
            return cls(np.zeros(0, dtype=np.uint64), empty, empty, empty, max_context, 0)
        tokens = np.concatenate([seq for seq, _ in pairs])  # [P] every sequence, one after another
        lengths = np.array([len(seq) for seq, _ in pairs])
        offset = np.repeat(np.cumsum(lengths) - lengths, lengths)
        position = np.arange(len(tokens)) - offset  # [P] index within its own sequence
        first_target = np.repeat(np.array([p for _, p in pairs]), lengths)  # [P] its sequence's prompt length
        bits = max(int(tokens.max()).bit_length(), 1)
        composite = []
        for n in range(1, max_context + 1):
            targets = np.flatnonzero(position >= np.maximum(first_target, n))
            keys = _context_hashes(tokens, targets, n) >> np.uint64(bits)
            composite.append((keys << np.uint64(bits)) | tokens[targets].astype(np.uint64))
        pair = np.sort(np.concatenate(composite))  # (context, next) pairs, by context, then next token
        starts = np.flatnonzero(np.r_[True, pair[1:] != pair[:-1]])
        pair_count = np.diff(np.r_[starts, len(pair)])
        pair = pair[starts]
        context = pair >> np.uint64(bits)
        is_first = np.r_[True, context[1:] != context[:-1]]
        group_start = np.flatnonzero(is_first)
        group = np.cumsum(is_first) - 1  # [pairs] which context each pair belongs to
        totals = np.add.reduceat(pair_count, group_start)
        counts = np.maximum.reduceat(pair_count, group_start)
        top = np.flatnonzero(pair_count == counts[group])  # pairs at their context's maximum; the smallest id kept
        _, first_top = np.unique(group[top], return_index=True)
        nexts = (pair[top[first_top]] & np.uint64((1 << bits) - 1)).astype(np.int64)
        keep = (totals >= min_total) & (counts >= min_share * totals)
        return cls(context[group_start][keep], nexts[keep], counts[keep], totals[keep], max_context, bits)

    def save(self, path: str | Path, sources: Sequence[str | Path] = ()) -> None:
        """Write the index as a safetensors file (keys as int64 bits, the rest int32: 20 bytes a context), with the
        paths of the files it was built from (``sources``) in its metadata."""
        import torch
        from safetensors.torch import save_file

        tensors = {name: torch.from_numpy(getattr(self, name)) for name in ("tokens", "counts", "totals")}
        tensors["keys"] = torch.from_numpy(self.keys.view(np.int64))
        metadata = {"max_context": str(self.max_context), "bits": str(self.bits), "sources": json.dumps(sorted(map(str, sources)))}
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path) -> "Datastore":
        """Read a file ``save`` wrote. Raises ``ValueError`` naming the file when it is not such a file."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="np") as f:
                arrays = {name: f.get_tensor(name) for name in ("keys", "tokens", "counts", "totals")}
                max_context, bits = int(f.metadata()["max_context"]), int(f.metadata()["bits"])
        except Exception as e:  # a truncated or foreign file
            raise ValueError(f"{path} is not a corpus index (keys, tokens, counts, totals; max_context, bits): {e}") from None
        return cls(arrays["keys"].view(np.uint64), arrays["tokens"], arrays["counts"], arrays["totals"], max_context, bits)

    @staticmethod
    def _cache_path(files: Sequence[Path], folder: Path, build_kwargs: dict) -> Path:
        """``folder/corpus-<these files>-<their sizes and times, the layout, build_kwargs>.safetensors``."""
        which = hashlib.sha256(repr(sorted(str(Path(f).resolve()) for f in files)).encode())
        state = hashlib.sha256(repr((_LAYOUT, sorted(build_kwargs.items()))).encode())
        for f in files:
            st = Path(f).stat()
            state.update(f"{Path(f).name}:{st.st_size}:{st.st_mtime_ns}".encode())
        return Path(folder) / f"corpus-{which.hexdigest()[:8]}-{state.hexdigest()[:12]}.safetensors"

    @classmethod
    def is_cached(cls, files: Sequence[Path], folder: Path, **build_kwargs) -> bool:
        """Whether ``cached`` would read its index from ``folder`` instead of building it."""
        return cls._cache_path(files, folder, build_kwargs).exists()

    @classmethod
    def cached(cls, files: Sequence[Path], folder: Path, **build_kwargs) -> "Datastore":
        """The index of the replies in distillation ``files`` (``medusa_core.train.read_distilled`` rows),
        built once and kept in ``folder`` under a name from the files' paths, sizes and modification times
        (and ``build_kwargs``, passed to ``build``). A new index replaces the indexes it supersedes: those of the
        same files or of some of them (a distillation file that grew, or a new one beside them), and those of an
        older version that do not say which files they came from."""
        from .train.distill import read_distilled

        path = cls._cache_path(files, folder, build_kwargs)
        if path.exists():
            return cls.load(path)
        rows = (row for f in files for row in read_distilled(f))
        store = cls.build(((r["prompt_ids"] + r["reply_ids"], len(r["prompt_ids"])) for r in rows), **build_kwargs)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        sources = [str(Path(f).resolve()) for f in files]
        store.save(partial, sources)
        partial.replace(path)
        for older in path.parent.glob("corpus-*.safetensors"):
            if older != path and set(_sources(older) or ()) <= set(sources):
                older.unlink(missing_ok=True)
        return store

    @classmethod
    def cache_apart(cls, files: Sequence[Path], folder: Path, **build_kwargs) -> bool:
        """Make ``cached``'s index file in a Python process of its own at the lowest CPU priority (nice 19 where the OS
        has it), and wait for it. Built in the caller's process, the index takes the CPU and, reading its replies in
        Python, the GIL from the caller's other threads: on the demo a reply decoded beside it ran at 62–92 tokens/s
        against ~400 alone, and at full speed beside the process (docs/BENCH.md, "The greedy walk compiled, the rotary
        table, filtered blocks skipped": the app's own speed). Returns whether the index is cached now; False when the
        process failed (``cached`` in the caller's process then raises what went wrong)."""
        if cls.is_cached(files, folder, **build_kwargs):
            return True
        job = json.dumps({"files": [str(f) for f in files], "folder": str(folder), "kwargs": build_kwargs})
        code = ("import json, os, sys\n"
                "hasattr(os, 'nice') and os.nice(19)\n"
                "from medusa_core.datastore import Datastore\n"
                "job = json.loads(sys.argv[1])\n"
                "Datastore.cached(job['files'], job['folder'], **job['kwargs'])\n")
        done = subprocess.run([sys.executable, "-c", code, job], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return done.returncode == 0 and cls.is_cached(files, folder, **build_kwargs)

    def next_token(self, context: Sequence[int]) -> tuple[int, float, int] | None:
        """(token, its share of the continuations, context length matched) for the longest suffix of ``context``
        that the index holds, or None."""
        longest = min(self.max_context, len(context))
        if longest == 0 or len(self.keys) == 0:
            return None
        wanted = np.array([_context_hash(context[len(context) - n :]) >> self.bits for n in range(longest, 0, -1)], dtype=np.uint64)
        at = np.minimum(np.searchsorted(self.keys, wanted), len(self.keys) - 1)
        hits = np.flatnonzero(self.keys[at] == wanted)
        if len(hits) == 0:
            return None
        i = at[hits[0]]
        return int(self.tokens[i]), float(self.counts[i] / self.totals[i]), longest - int(hits[0])

    def chain(self, context: Sequence[int], limit: int, rule: CorpusRule = CorpusRule()) -> list[int]:
        """Up to ``min(limit, rule.max_tokens)`` tokens drafted after ``context`` (token ids): the first when its
        share and matched context reach ``rule.first_share`` and ``rule.first_context``, each next while its share
        reaches ``rule.next_share``; ``[]`` when the first does not qualify."""
        context, chain = list(context[len(context) - self.max_context :]), []
        if self.kernel is not None:
            walk, columns = self.kernel
            return walk(*columns, context, self.bits, self.max_context, limit, rule.max_tokens, rule.first_share,
                        rule.first_context, rule.next_share)
        while len(chain) < min(limit, rule.max_tokens):
            found = self.next_token(context)
            if found is None:
                break
            token, share, matched = found
            if chain and share < rule.next_share or not chain and (share < rule.first_share or matched < rule.first_context):
                break
            chain.append(token)
            context.append(token)
        return chain
