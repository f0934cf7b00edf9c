"""Drafts from the model's own replies (``medusa_core.datastore``, REST / SuffixDecoding; issue 25, item 2).

Part 1 checks ``Datastore`` on hand-written replies: the most frequent continuation and its share, the longest
context preferred, contexts left out by ``min_total`` / ``min_share``, the chain rule, the file round trip, a
bad file, and the cache that builds once. Part 2 is the key property: greedy decoding with corpus drafts equals
plain greedy decoding, with a corpus that is right (the tiny model's own reply) and one that is wrong, and a
model without a corpus refuses ``drafts="corpus"``.
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from conftest import PROMPT

from medusa_core import MedusaModel
from medusa_core.datastore import CorpusRule, Datastore, _context_hash, _context_hashes

N_NEW = 40


def reply(records) -> list[int]:
    return [t for r in records for t in r.token_ids]


# (prompt + reply ids, prompt length): [2, 3] is followed by 4 twice and by 5 once, [9, 2, 3] by 4 once
SEQUENCES = [([1, 2, 3, 4], 1), ([1, 2, 3, 5], 1), ([9, 2, 3, 4], 1), ([7, 7, 6, 8, 6, 8], 2)]


# ------------------------------------------------------------------------------------- the index
def test_the_bulk_context_keys_are_the_lookup_keys():
    seq = np.array([5, 1, 2, 3, 4, 0, 9])
    for n in (1, 2, 4):
        targets = np.arange(n, len(seq))
        assert _context_hashes(seq, targets, n).tolist() == [_context_hash(seq[t - n : t].tolist()) for t in targets]


@pytest.mark.parametrize("vocab", [5, 70_000])  # few token ids (3 bits) and more than 16 bits' worth
def test_the_index_agrees_with_counting_every_context_by_hand(vocab):
    from collections import Counter, defaultdict

    rng = np.random.default_rng(vocab)
    sequences = [(rng.integers(0, vocab, rng.integers(3, 12)).tolist(), int(rng.integers(0, 3))) for _ in range(60)]
    store = Datastore.build(sequences, max_context=3, min_total=1, min_share=0.0)
    seen: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for ids, prompt_len in sequences:
        for j in range(prompt_len, len(ids)):
            for n in range(1, min(3, j) + 1):
                seen[tuple(ids[j - n : j])][ids[j]] += 1
    assert len(store) == len(seen)
    for context, nexts in seen.items():
        best = max(nexts.values())
        token = min(t for t, c in nexts.items() if c == best)  # ties: the smallest id
        assert store.next_token(list(context)) == (token, best / sum(nexts.values()), len(context)), context


def test_the_most_frequent_continuation_of_the_longest_context_is_found():
    store = Datastore.build(SEQUENCES, max_context=3, min_total=1, min_share=0.0)
    assert store.next_token([8, 2, 3]) == (4, 2 / 3, 2)  # [8, 2, 3] unseen: [2, 3] → 4 twice in 3
    assert store.next_token([9, 2, 3]) == (4, 1.0, 3)  # the longer context wins
    assert store.next_token([6, 8]) == (6, 1.0, 2)  # prompt tokens may be context, never targets
    assert store.next_token([42]) is None and store.next_token([]) is None


def test_contexts_seen_too_rarely_or_without_a_clear_continuation_are_left_out():
    kept = Datastore.build(SEQUENCES, max_context=3, min_total=2, min_share=0.5)
    assert kept.next_token([9, 2, 3]) == (4, 2 / 3, 2)  # [9, 2, 3] occurred once: left out, [2, 3] answers
    strict = Datastore.build(SEQUENCES, max_context=3, min_total=2, min_share=0.7)
    assert strict.next_token([9, 2, 3]) is None  # [2, 3] and [3] go on with 4 in 2 of 3 only
    assert strict.next_token([6, 8]) is None and kept.next_token([6, 8]) is None  # [8] → 6 once: too rare
    with pytest.raises(ValueError, match="max_context must be >= 1"):
        Datastore.build(SEQUENCES, max_context=0)


def test_the_chain_follows_the_rule():
    store = Datastore.build([([0, 1, 2, 3, 4, 5], 1)] * 3 + [([0, 1, 2, 3, 9, 5], 1)], max_context=2, min_total=1, min_share=0.0)
    assert store.chain([0, 1], 10, CorpusRule(first_share=1.0, next_share=0.7, max_tokens=10)) == [2, 3, 4, 5]
    assert store.chain([0, 1], 2, CorpusRule(max_tokens=10)) == [2, 3]  # the caller's limit
    assert store.chain([0, 1], 10, CorpusRule(max_tokens=3)) == [2, 3, 4]
    assert store.chain([0, 1], 10, CorpusRule(next_share=0.8, max_tokens=10)) == [2, 3]  # 3 → 4 in 3 of 4
    assert store.chain([1], 10, CorpusRule(first_context=2)) == []  # a one-token match may not start a chain
    assert store.chain([5, 2, 3], 10, CorpusRule(first_share=0.8)) == []  # [2, 3] → 4 in 3 of 4 only
    for bad in (dict(first_share=0.0), dict(next_share=1.5), dict(first_context=0), dict(max_tokens=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CorpusRule(**bad)


@pytest.mark.parametrize("vocab", [5, 70_000])
def test_the_compiled_walk_drafts_the_python_walks_chains(vocab):
    from medusa_core.lean.build import load_extension

    module, why = load_extension()
    if module is None:
        pytest.skip(f"no compiled extension on this machine: {why}")  # the README's install gives CI a compiler
    rng = np.random.default_rng(vocab)
    # few distinct contexts repeat often, so that long confident chains occur beside misses and weak shares
    phrases = [rng.integers(0, vocab, 6).tolist() for _ in range(8)]
    sequences = [(sum((phrases[i] for i in rng.integers(0, 8, 4)), []), int(rng.integers(0, 4))) for _ in range(80)]
    store = Datastore.build(sequences, max_context=4, min_total=1, min_share=0.0)
    contexts = [ids[:j] for ids, _ in sequences[:30] for j in range(0, len(ids) + 1, 3)] + [[vocab + 7]]
    rules = [CorpusRule(), CorpusRule(0.3, 1, 0.3, 6), CorpusRule(0.9, 3, 0.5, 2)]
    python = [store.chain(c, limit, rule) for c in contexts for rule in rules for limit in (1, 3, 8)]
    store.use_kernel(module)
    compiled = [store.chain(c, limit, rule) for c in contexts for rule in rules for limit in (1, 3, 8)]
    assert compiled == python
    assert sum(len(chain) > 1 for chain in python) > 20 and sum(not chain for chain in python) > 20  # both kinds met
    assert Datastore.build([], max_context=2).chain([1, 2], 4) == []  # an empty index, Python walk
    empty = Datastore.build([], max_context=2)
    empty.use_kernel(module)
    assert empty.chain([1, 2], 4) == [] and empty.chain([], 4) == []


def test_the_index_round_trips_through_a_file_and_a_foreign_file_is_refused(tmp_path):
    store = Datastore.build(SEQUENCES, max_context=3, min_total=1, min_share=0.0)
    store.save(tmp_path / "corpus.safetensors")
    again = Datastore.load(tmp_path / "corpus.safetensors")
    assert len(again) == len(store) and again.max_context == 3
    assert again.next_token([8, 2, 3]) == store.next_token([8, 2, 3])
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="bad.safetensors is not a corpus index"):
        Datastore.load(tmp_path / "bad.safetensors")


def test_the_cache_builds_once_and_again_when_a_file_changes(tmp_path, monkeypatch):
    rows = [{"id": i, "messages": [], "prompt_ids": ids[:n], "reply_ids": ids[n:], "reply": ""} for i, (ids, n) in enumerate(SEQUENCES)]
    replies = tmp_path / "train-gguf-chat.jsonl.gz"
    with gzip.open(replies, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    first = Datastore.cached([replies], tmp_path / "cache", min_total=1)
    assert first.next_token([8, 2, 3]) == (4, 2 / 3, 2) and Datastore.is_cached([replies], tmp_path / "cache", min_total=1)
    monkeypatch.setattr(Datastore, "build", classmethod(lambda *a, **k: pytest.fail("built again")))
    assert len(Datastore.cached([replies], tmp_path / "cache", min_total=1)) == len(first)
    with gzip.open(replies, "at") as f:  # the distillation file grew
        f.write(json.dumps(rows[0] | {"id": 9}) + "\n")
    assert not Datastore.is_cached([replies], tmp_path / "cache", min_total=1)
    monkeypatch.undo()
    assert Datastore.cached([replies], tmp_path / "cache", min_total=1).next_token([8, 2, 3]) == (4, 3 / 4, 2)
    assert len(list((tmp_path / "cache").glob("corpus-*.safetensors"))) == 1  # the older index was replaced


def test_an_index_made_in_a_process_of_its_own_is_the_one_this_process_reads(tmp_path, monkeypatch):
    rows = [{"id": i, "messages": [], "prompt_ids": ids[:n], "reply_ids": ids[n:], "reply": ""} for i, (ids, n) in enumerate(SEQUENCES)]
    replies = tmp_path / "train-gguf-chat.jsonl.gz"
    with gzip.open(replies, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert Datastore.cache_apart([replies], tmp_path / "cache", min_total=1)
    monkeypatch.setattr(Datastore, "build", classmethod(lambda *a, **k: pytest.fail("built in this process")))
    assert Datastore.cached([replies], tmp_path / "cache", min_total=1).next_token([8, 2, 3]) == (4, 2 / 3, 2)
    assert Datastore.cache_apart([replies], tmp_path / "cache", min_total=1)  # already made: no process
    # a process that fails says so, and leaves nothing: the caller's own build then raises what went wrong
    assert not Datastore.cache_apart([replies], tmp_path / "cache", no_such_option=1)  # its build raises TypeError
    assert not Datastore.is_cached([replies], tmp_path / "cache", no_such_option=1)


def test_an_index_of_fewer_files_is_replaced_and_one_of_other_files_is_kept(tmp_path):
    def write(name: str) -> object:
        path = tmp_path / name
        with gzip.open(path, "wt") as f:
            f.writelines(json.dumps({"id": i, "messages": [], "prompt_ids": ids[:n], "reply_ids": ids[n:], "reply": ""}) + "\n"
                         for i, (ids, n) in enumerate(SEQUENCES))
        return path

    chat, greedy, other = write("train-gguf-chat.jsonl.gz"), write("train-gguf-greedy.jsonl.gz"), write("train-nf4-chat.jsonl.gz")
    cache = tmp_path / "cache"
    Datastore.cached([chat], cache)
    Datastore.cached([other], cache)  # another model's corpus in the same cache folder
    assert len(list(cache.glob("corpus-*.safetensors"))) == 2
    Datastore.cached([chat, greedy], cache)  # a new distillation file beside the first: the chat-only index is superseded
    assert Datastore.is_cached([chat, greedy], cache) and Datastore.is_cached([other], cache)
    assert not Datastore.is_cached([chat], cache) and len(list(cache.glob("corpus-*.safetensors"))) == 2


# ------------------------------------------------------------------------ the engine with corpus drafts
@pytest.fixture
def compiled_or_not(request):
    """None (the Python walk) or the compiled extension (skipped where it cannot be built)."""
    if not request.param:
        return None
    from medusa_core.lean.build import load_extension

    module, why = load_extension()
    if module is None:
        pytest.skip(f"no compiled extension on this machine: {why}")
    return module


@pytest.mark.parametrize("compiled_or_not", [False, True], indirect=True, ids=["python-walk", "compiled-walk"])
@pytest.mark.parametrize("right", [True, False])
def test_greedy_decoding_with_corpus_drafts_equals_plain_greedy_decoding(
    right, compiled_or_not, backbone_for, reference_for, random_heads_model
):
    backbone = backbone_for("llama")
    expected = reference_for("llama", N_NEW)
    prompt = PROMPT[0].tolist()
    vocab = backbone.config.vocab_size
    full = prompt + expected
    if right:  # the reply itself, twice
        replies = [(full, len(prompt))] * 2
    else:  # every context of the reply, each followed by another token than the reply's (the last token the only target)
        replies = [(full[:j] + [(full[j] + 1) % vocab], j) for j in range(len(prompt), len(full))] * 2
    corpus = Datastore.build(replies, max_context=3)
    model = random_heads_model(backbone, corpus)
    model._steps.extension = compiled_or_not  # as a model whose step loaded the extension (or none) has it
    assert (model.corpus.kernel is not None) == (compiled_or_not is not None)
    records = list(model.generate(PROMPT, max_new_tokens=N_NEW, tree="sparse_16", drafts="corpus"))
    assert reply(records) == expected
    chains = [r for r in records[1:] if r.tree_name == "ngram"]  # steps that verified a corpus chain alone
    assert chains and all(set(r.node_sources) <= {"root", "ngram"} for r in chains)
    assert all(r.drafts == "corpus" and r.head_tokens + r.ngram_tokens == r.draft_tokens for r in records[1:])
    copied = sum(r.ngram_tokens for r in records)
    assert copied >= N_NEW // 2 if right else copied == 0
    assert len(records) < N_NEW // 2 if right else len(records) > N_NEW // 2


def test_a_model_without_a_corpus_refuses_corpus_drafts_before_any_work(backbone_for, random_model):
    model = random_model(backbone_for("llama"))
    assert not model.has_corpus and model.corpus is None
    with pytest.raises(ValueError, match="drafts='corpus' needs a model with a corpus"):
        model.generate(PROMPT, max_new_tokens=4, drafts="corpus")
    assert len(list(model.generate(PROMPT, max_new_tokens=4, drafts="corpus", medusa=False))) >= 2  # Medusa off: no drafts


def test_a_corpus_function_is_called_once_at_first_use(backbone_for, random_heads_model):
    calls = []

    def make() -> Datastore:
        calls.append(1)
        return Datastore.build(SEQUENCES)

    model = random_heads_model(backbone_for("llama"), make)
    assert model.has_corpus and calls == []
    list(model.generate(PROMPT, max_new_tokens=4, drafts="corpus"))
    list(model.generate(PROMPT, max_new_tokens=4, drafts="corpus"))
    assert calls == [1] and isinstance(model.corpus, Datastore)


def test_indexing_in_the_background_builds_once_and_a_call_meanwhile_starts_no_second_build(backbone_for, random_heads_model):
    import threading

    calls, release = [], threading.Event()

    def make() -> Datastore:
        release.wait(30)
        calls.append(1)
        return Datastore.build(SEQUENCES)

    model = random_heads_model(backbone_for("llama"), make)
    model.index_corpus_in_background()
    model.index_corpus_in_background()  # the first thread still builds
    assert not model.corpus_ready
    release.set()
    model._corpus.thread.join(30)
    assert model.corpus_ready and calls == [1]
    model.index_corpus_in_background()  # made: nothing to do
    assert calls == [1]
    without = random_heads_model(backbone_for("llama"), None)
    without.index_corpus_in_background()
    assert without._corpus.thread is None


def test_indexing_in_the_background_makes_the_index_apart_first_where_its_source_can(backbone_for, random_heads_model):
    # a source with ``prepare_apart`` (a head folder's replies: loading.CorpusIndex) makes its index file in a process of
    # its own, then the model reads it; a reply decoding meanwhile keeps the CPU and the GIL
    steps = []

    class Source:
        def prepare_apart(self) -> None:
            steps.append("apart")

        def __call__(self) -> Datastore:
            steps.append("read")
            return Datastore.build(SEQUENCES)

    model = random_heads_model(backbone_for("llama"), Source())
    model.index_corpus_in_background()
    model._corpus.thread.join(30)
    assert model.corpus_ready and steps == ["apart", "read"]


@pytest.fixture
def random_heads_model():
    """``random_heads_model(backbone, corpus)``: a ``MedusaModel`` with random heads and ``corpus``."""
    from tiny_models import random_heads

    return lambda backbone, corpus: MedusaModel(backbone, random_heads(backbone, 4), corpus=corpus)


# ------------------------------------------------------------------------------------- loading
def write_replies(path, replies: list[tuple[list[int], list[int]]]) -> None:
    """A ``train.distill`` file of (prompt ids, reply ids) rows."""
    with gzip.open(path, "wt") as f:
        for i, (prompt, answer) in enumerate(replies):
            f.write(json.dumps({"id": i, "messages": [], "prompt_ids": prompt, "reply_ids": answer, "reply": ""}) + "\n")


def test_a_head_folder_with_replies_of_its_backbone_gets_them_as_its_corpus_without_the_held_out_ones(tmp_path, monkeypatch):
    from medusa_core import gguf, load_medusa_model
    from tiny_models import write_tiny_medusa

    monkeypatch.setenv(gguf.CACHE_ENV, str(tmp_path / "cache"))
    folder = write_tiny_medusa(tmp_path / "tiny")
    assert not load_medusa_model(folder, quantization=None).has_corpus  # no distill/ folder
    (folder / "distill").mkdir()
    write_replies(folder / "distill" / "train-none-chat.jsonl.gz", [([1, 2], [3, 4, 5])] * 2)
    write_replies(folder / "distill" / "heldout-none-chat.jsonl.gz", [([1, 2], [3, 6, 7])] * 9)  # never indexed
    write_replies(folder / "distill" / "train-gguf-chat.jsonl.gz", [([1, 2], [3, 8, 9])] * 9)  # another precision's
    lines: list[str] = []
    model = load_medusa_model(folder, quantization=None, report=lines.append)
    assert model.has_corpus and lines == []  # indexed at first use, not at load
    assert model.corpus.next_token([2, 3]) == (4, 1.0, 2) and model.corpus.next_token([3, 4]) == (5, 1.0, 2)
    assert lines and "Indexing the model's own replies (1 files)" in lines[0]
    assert list((tmp_path / "cache" / "corpus").glob("corpus-*.safetensors"))  # kept for the next start
    again = load_medusa_model(folder, quantization=None)
    again._corpus.source.prepare_apart()  # made already: read, not built again
    assert again.corpus.next_token([2, 3]) == (4, 1.0, 2)
