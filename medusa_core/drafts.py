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

Every token in the tree costs time (on the project's 2-core CPU about 2.5 ms per extra token beside a
15 ms step), so a chain is cut where it stops paying: the drafter counts, per matched suffix length
and chain position, how often the copied tokens up to there were right in this reply, and proposes a
position only while that path probability is at least ``min_path_probability`` (the rule of
optimised trees, paper 2.3.3, applied to the copied chain, and learned as the reply goes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .datastore import CorpusRule, Datastore


@dataclass(frozen=True)
class DraftConfig:
    """How n-gram drafts are looked up. Raises ``ValueError`` for sizes out of range."""

    max_ngram: int = 3  # the longest context suffix looked up first (tokens)
    min_ngram: int = 1  # the shortest suffix that may match; 1 = a single token
    max_tokens: int = 10  # tokens copied per step at most (HF prompt lookup's default is 10)
    # A chain position is proposed while the share of this reply's chains (same suffix length) that
    # were right up to it is at least this: one more tree token costs ~0.15–0.2 of a step on a 2-core
    # CPU (row-wise attention); 0.3 made the most tokens/s of 0.1, 0.2, 0.3 on 8 shipped prompts.
    min_path_probability: float = 0.3
    # Trees shaped per step (EAGLE-2-like, within the static tree as the budget): verify a head node only
    # when the product of the heads' calibrated probabilities along its path is at least this; 0 = every
    # node; None = the model's tuned threshold (``MedusaModel.min_head_probability``, 0 when untuned).
    min_head_probability: float | None = None
    # A hybrid step whose chain has at least this many tokens verifies the chain alone (a long copied chain
    # instead of the heads' bushy tree): no heads' pass, no head rows; 0 = never. 3, 5 and 8 all beat 0 by
    # ~6 % tokens/s on 24 shipped prompts (scripts/long_chains.py, docs/BENCH.md); 5 is the middle one.
    chain_only_from: int = 5
    # The EAGLE-style drafter's chains (``drafts="eagle"``, ``eagle.EagleDrafts``): the most drafts a step, and the
    # chain probability a draft needs; None = the values ``bench tune`` chose for the settings' preset on this machine
    # (``TunedSettings.chain_depth``, ``chain_threshold``), else ``eagle.DEPTH``, ``eagle.THRESHOLD``.
    chain_depth: int | None = None
    chain_threshold: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.chain_only_from < 0:
            raise ValueError(f"chain_only_from must be >= 0 (0: never), got {self.chain_only_from}")
        if self.chain_depth is not None and (isinstance(self.chain_depth, bool) or not isinstance(self.chain_depth, int)
                                             or self.chain_depth < 1):
            raise ValueError(f"chain_depth must be an integer >= 1 (drafts a step), got {self.chain_depth!r}")
        for name in ("min_path_probability", "min_head_probability", "chain_threshold"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


class NgramDrafter:
    """The context's n-grams and a lookup of the longest suffix match (prompt lookup).

    Args:
        config: n-gram sizes and the longest chain proposed.
        tokens: the context so far (prompt ids), as ``extend`` would add them.
        earlier: token ids of earlier replies that are not in the context (a session's index, as
            SuffixDecoding keeps one): looked up when the context itself has no match of that length.
        corpus: an index of the model's own replies (``datastore.Datastore``, SuffixDecoding's global tree),
            drafted from when the context offers no long copy; ``corpus_rule`` says when.
        copy: False: no copies from the context or the earlier replies, the corpus alone (``drafts="corpus"``).
    """

    def __init__(
        self,
        config: DraftConfig = DraftConfig(),
        tokens: Iterable[int] = (),
        earlier: Iterable[Iterable[int]] = (),
        corpus: Datastore | None = None,
        corpus_rule: CorpusRule = CorpusRule(),
        copy: bool = True,
    ):
        self.config = config
        self.corpus, self.corpus_rule, self.copy = corpus, corpus_rule, copy
        self.verify_alone = False  # whether the last proposal is to be verified without the heads' tree
        self.tokens: list[int] = []
        sizes = range(config.min_ngram, config.max_ngram + 1) if copy else range(0)  # nothing to index without copies
        # size n -> {n-gram: start of its latest occurrence that has a next token}
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        # the same over the earlier replies: size n -> {n-gram: (reply, start)}, later replies winning
        self._earlier = [list(map(int, reply)) for reply in earlier]
        self._earlier_latest: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {n: {} for n in sizes}
        for r, reply in enumerate(self._earlier):
            for n, latest in self._earlier_latest.items():
                for start in range(len(reply) - n):  # every n-gram that has a next token
                    latest[tuple(reply[start : start + n])] = (r, start)
        # size n -> per chain position i: [chains right up to i, chains that reached i]; prior 1 of 2
        self._record: dict[int, list[list[int]]] = {n: [[1, 2] for _ in range(config.max_tokens)] for n in sizes}
        self._pending: tuple[int, list[int]] | None = None  # (suffix length, chain) of the last proposal
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the context. An n-gram is indexed once the token after it arrives, so
        the suffix itself is never its own match. The first tokens after a proposal say how much of
        the chain was right (``path_probability``)."""
        tokens = list(tokens)
        if self._pending is not None:
            n, chain = self._pending
            right = next((i for i, (a, b) in enumerate(zip(chain, tokens)) if a != b), min(len(chain), len(tokens)))
            for i in range(len(chain)):
                self._record[n][i][0] += i < right
                self._record[n][i][1] += 1
            self._pending = None
        for token in tokens:
            end = len(self.tokens)
            for n, latest in self._latest.items():
                if end >= n:
                    latest[tuple(self.tokens[end - n : end])] = end - n
            self.tokens.append(int(token))

    def path_probability(self, n: int, position: int) -> float:
        """Share of this reply's chains after a suffix match of ``n`` tokens that were right up to
        ``position`` (0-based), counting a prior of 1 right in 2."""
        right, tried = self._record[n][position]
        return right / tried

    def propose(self, limit: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching suffix
        (``max_ngram`` tokens down to ``min_ngram``), at most ``min(limit, config.max_tokens)`` of them
        and only while ``path_probability`` is at least ``config.min_path_probability``; ``[]`` when
        no suffix occurs earlier or ``limit`` < 1. A suffix the context lacks is looked up in the
        earlier replies (their copy ends where the reply ended). The next ``extend`` scores the proposal.

        The copy may run into the suffix itself (the match overlaps it): then it goes on with the tokens
        it has just copied, as an LZ77 copy does, so a repeating pattern is continued with its period.
        ``limit`` is where the caller caps the chain, e.g. at the room left in the context window.

        With a ``corpus``, a copy shorter than ``config.chain_only_from`` gives way to the corpus's chain
        when the corpus has one (``Datastore.chain`` under ``corpus_rule``). ``verify_alone`` then says
        whether the step should verify the chain without the heads' tree: a corpus chain always, a copy
        from the context when it is at least ``chain_only_from`` tokens long.
        """
        length = min(limit, self.config.max_tokens)
        self.verify_alone = False
        if length < 1:
            return []
        n, copy = self._copy(length) if self.copy else (0, [])
        long_copy = 0 < self.config.chain_only_from <= len(copy)
        if self.corpus is not None and not long_copy:
            drafted = self.corpus.chain(self.tokens, length, self.corpus_rule)
            if drafted:
                self._pending, self.verify_alone = None, True
                return drafted
        self._pending, self.verify_alone = ((n, copy) if copy else None), long_copy
        return copy

    def _copy(self, length: int) -> tuple[int, list[int]]:
        """(suffix length matched, the copied tokens) of prompt lookup; (0, []) without a match."""
        end = len(self.tokens)
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            suffix = tuple(self.tokens[end - n :]) if end >= n else None
            start = self._latest[n].get(suffix)
            if start is not None:
                source = start + n  # < end: an indexed n-gram has a next token
                text = self.tokens
            elif suffix in self._earlier_latest[n]:
                reply, at = self._earlier_latest[n][suffix]
                text, source = self._earlier[reply], at + n
                length = min(length, len(text) - source)
            else:
                continue
            copy: list[int] = []
            for i in range(length):
                if self.path_probability(n, i) < self.config.min_path_probability:
                    break
                j = source + i
                copy.append(text[j] if j < len(text) else copy[j - len(text)])
            return n, copy
        return 0, []
