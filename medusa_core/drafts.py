"""N-gram drafts (prompt lookup): tree nodes copied from the context instead of guessed by the heads.

Prompt lookup decoding (Saxena 2023; HF ``generate(prompt_lookup_num_tokens=...)``) finds the last
few tokens of the context earlier in the context and proposes what followed them there. Replies that
copy the prompt (code edits, extraction, quotes, role play) get long runs of right guesses that the
heads, trained to guess from one hidden state, cannot make. SAM-Decoding and Token Recycling put such
retrieved drafts into the Medusa/EAGLE tree; this module proposes the chain and ``steptree.graft``
puts it into the tree of the step, where the backbone verifies it in the same pass as the heads'
candidates. The drafts are deterministic given the context (point masses), so greedy decoding stays
plain greedy decoding and exact sampling stays exact (``MedusaModel.generate``).

Works on token ids only. ``NgramDrafter`` keeps an index of every n-gram of the context that has a
continuation, updated as tokens arrive, so a lookup costs a few dict reads, not a scan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class DraftConfig:
    """How n-gram drafts are looked up. Raises ``ValueError`` for sizes out of range."""

    max_ngram: int = 3  # the longest context suffix looked up first (tokens)
    min_ngram: int = 1  # the shortest suffix that may match; 1 = a single token
    max_tokens: int = 10  # tokens copied per step at most (HF prompt lookup's default is 10)

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


class NgramDrafter:
    """The context's n-grams and a lookup of the longest suffix match (prompt lookup).

    Args:
        config: n-gram sizes and the longest chain proposed.
        tokens: the context so far (prompt ids), as ``extend`` would add them.
    """

    def __init__(self, config: DraftConfig = DraftConfig(), tokens: Iterable[int] = ()):
        self.config = config
        self.tokens: list[int] = []
        # size n -> {n-gram: start of its latest occurrence that has a next token}
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(config.min_ngram, config.max_ngram + 1)}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the context. An n-gram is indexed once the token after it arrives, so
        the suffix itself is never its own match."""
        for token in tokens:
            end = len(self.tokens)
            for n, latest in self._latest.items():
                if end >= n:
                    latest[tuple(self.tokens[end - n : end])] = end - n
            self.tokens.append(int(token))

    def propose(self, limit: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching suffix
        (``max_ngram`` tokens down to ``min_ngram``), at most ``min(limit, config.max_tokens)`` of them;
        ``[]`` when no suffix occurs earlier or ``limit`` < 1.

        The copy may run into the suffix itself (the match overlaps it): then it goes on with the tokens
        it has just copied, as an LZ77 copy does, so a repeating pattern is continued with its period.
        ``limit`` is where the caller caps the chain, e.g. at the room left in the context window.
        """
        length = min(limit, self.config.max_tokens)
        if length < 1:
            return []
        end = len(self.tokens)
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            start = self._latest[n].get(tuple(self.tokens[end - n :])) if end >= n else None
            if start is None:
                continue
            source = start + n  # < end: an indexed n-gram has a next token
            copy: list[int] = []
            for i in range(length):
                j = source + i
                copy.append(self.tokens[j] if j < end else copy[j - end])
            return copy
        return []
