"""Handler-level tests of the app on a tiny random Llama with Medusa heads: no browser, no server.

Handlers are called as the page calls them; streaming handlers are iterated, and a Stop is either
the Stop handler's flag or closing the generator (what Gradio's ``cancels=`` does).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import random
import re
import threading
from pathlib import Path

import gradio as gr
import pytest
import torch
from transformers import GenerationConfig

import medusa_core.model
from app import handlers
from app.engine import Engine
from app.handlers import CUSTOM_TREE, Controls
from app.handlers.controls import drafts_default
from app.handlers.generation import fit_prompt
from app.session import Session, Turn
from app.settings import AppSettings
from app.stats import CSV_COLUMNS, summarize, summary_markdown
from app.ui import build_ui
from medusa_core import CHAT_PRESET, TunedSettings
from medusa_core.invariant import ATTENTION_KERNEL
from medusa_core.processors import CHAT_SAMPLING


@pytest.fixture
def settings(tmp_path) -> AppSettings:
    # Redraw on every step so the tests see every intermediate update.
    return AppSettings(data_dir=tmp_path / "data", stream_interval_s=0.0, redraw_interval_s=0.0, max_new_tokens=24)


@pytest.fixture
def controls(settings) -> Controls:
    """The page's controls after a click on "Greedy (exactness demo)": replies equal the engine's greedy output."""
    return dataclasses.replace(Controls.from_settings(settings), tree="sparse_16", system_prompt="be brief", **handlers.GREEDY_PRESET)


def send(engine, settings, session, controls, message="def add"):
    handlers.add_user(engine, session, controls, message)
    return list(handlers.respond(engine, settings, session, controls))


def reply_html(update) -> str:
    return update["chatbot"][-1]["content"]


def greedy_reference(engine, session, controls, index=-1) -> str:
    """The reply plain medusa_core gives for the same prompt, decoded in one go."""
    model = engine.model
    ids, _ = fit_prompt(model, controls, session.history(len(session.turns) + index), session.turns[index].user)
    tokens = [t for r in model.generate(ids, max_new_tokens=controls.max_new_tokens, tree=controls.tree) for t in r.token_ids]
    return model.tokenizer.decode(tokens, skip_special_tokens=True)


def test_a_reply_streams_step_by_step_and_equals_the_engines_greedy_output(engine, settings, controls):
    session = Session()
    updates = send(engine, settings, session, controls)
    texts = [reply_html(u) for u in updates if "chatbot" in u]
    assert len(texts) > 3
    assert len(set(texts)) > 3  # the text grew across updates
    turn = session.turns[0]
    assert turn.state == "done" and not session.busy
    assert turn.reply.text == greedy_reference(engine, session, controls)
    assert len(session.rows) == len(session.last_records) > 1
    assert sum(r.accepted_tokens for r in session.rows) == session.rows[-1].total_tokens
    final = {}
    for update in updates:  # what the page shows at the end: the latest value of every output
        final |= update
    assert {"tree_plot", "step_slider", "speed_plot", "summary", "model_panel", "send", "saved"} <= set(final)
    shown = max(i for i, r in enumerate(session.last_records) if r.tree_nodes > 1)  # not a trailing one-token step
    assert final["tree_plot"].layout["title"]["text"].startswith(f"step {shown} ")
    assert final["step_slider"].value == shown


def test_the_highlight_marks_exactly_the_tokens_accepted_from_drafts(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls)
    drafted = sum(r.head_tokens + r.ngram_tokens for r in session.rows)
    free_text = "".join(t for t, free in session.turns[0].reply.runs if free)
    assert bool(free_text) == (drafted > 0)
    shown = handlers.rerender_chat(session, True)["chatbot"][-1]["content"]
    assert ("<mark" in shown) == bool(free_text)
    assert "<mark" not in handlers.rerender_chat(session, False)["chatbot"][-1]["content"]


def test_stop_ends_the_reply_after_the_current_step_and_keeps_the_partial_reply(engine, settings, controls):
    session = Session()
    handlers.add_user(engine, session, controls, "def add")
    stream = handlers.respond(engine, settings, session, controls)
    next(stream)
    next(stream)
    session.stop_requested.set()  # what the Stop handler does first
    rest = list(stream)
    turn = session.turns[0]
    assert turn.state == "stopped" and turn.reply.text
    assert session.rows[-1].stop_reason == "stopped"
    assert len(session.rows) <= 3 and sum(r.accepted_tokens for r in session.rows) < controls.max_new_tokens
    assert "stopped" in reply_html(rest[-1])
    shown = handlers.stop(engine, session, False)["chatbot"][-1]["content"]
    assert turn.reply.html(False) in shown


def test_a_cancelled_stream_keeps_its_text_and_frees_the_session(engine, settings, controls):
    session = Session()
    handlers.add_user(engine, session, controls, "def add")
    stream = handlers.respond(engine, settings, session, controls)
    next(stream)
    next(stream)
    assert session.busy
    stream.close()  # Gradio's cancels= closes the handler's generator
    assert not session.busy
    assert session.turns[0].state == "stopped" and session.turns[0].reply.text
    shown = handlers.stop(engine, session, False)["chatbot"]
    assert "stopped" in shown[-1]["content"]
    # The app keeps serving: the next message gets a complete reply.
    send(engine, settings, session, controls, "return")
    assert session.turns[1].state == "done"


def test_regenerate_replaces_the_last_reply(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls)
    first = session.turns[0].reply.text
    updates = handlers.regenerate(engine, session, controls)
    assert updates["chatbot"][-1]["role"] == "user"  # the old reply is gone
    list(handlers.respond(engine, settings, session, controls))
    assert len(session.turns) == 1 and session.turns[0].state == "done"
    assert session.turns[0].reply.text == first  # greedy: the same reply again
    assert session.replies == 2 and {r.reply_index for r in session.rows} == {0, 1}


def test_sampling_with_a_fixed_seed_repeats_and_different_seeds_vary(engine, settings, controls):
    def reply(seed):
        session = Session()
        send(engine, settings, session, dataclasses.replace(controls, temperature=1.0, seed=seed))
        return session.turns[0].reply.text

    assert reply(7) == reply(7)
    assert len({reply(s) for s in (1, 2, 3)}) > 1


def test_the_sampling_control_reaches_the_engine_and_the_page_marks_rejected_nodes_and_acceptance_per_mode(
    engine, settings, controls
):
    session = Session()
    sampled = dataclasses.replace(controls, temperature=1.0, seed=3, sampling="typical")
    send(engine, settings, session, sampled)
    typical = [r for r in session.last_records if r.tree_nodes > 1]
    updates = send(engine, settings, session, dataclasses.replace(sampled, sampling="exact"))
    final = {k: v for u in updates for k, v in u.items()}  # each component as the page shows it at the end
    exact = [r for r in session.last_records if r.tree_nodes > 1]
    assert {r.sampling for r in typical} == {"typical"} and {r.sampling for r in exact} == {"exact"}
    assert all(len(r.node_status) == r.tree_nodes for r in exact) and not any(r.node_status for r in typical)
    assert {r.sampling for r in session.rows} == {"typical", "exact"}  # the CSV's column
    assert "**typical**" in final["summary"] and "**exact**" in final["summary"]
    symbols = [s for t in final["tree_plot"].data if t.get("mode") == "markers+text" for s in t["marker"]["symbol"]]
    assert symbols.count("x") == exact[-1].node_status.count("rejected") > 0  # the last step with a tree
    assert "exact" in final["tree_plot"].layout["title"]["text"]


def test_clear_empties_the_chat_but_keeps_the_statistics(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls)
    steps = len(session.rows)
    updates = handlers.clear(engine, session)
    assert updates["chatbot"] == [] and session.turns == []
    assert len(session.rows) == steps


def test_export_writes_every_column_and_one_row_per_step(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls)
    send(engine, settings, session, dataclasses.replace(controls, medusa=False), "return")
    out = handlers.export_csv(settings, session)
    path = Path(out["export_file"])
    assert path.parent == settings.exports_dir and str(path) in out["export_path"]
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == len(session.rows)
    assert {r["session_id"] for r in rows} == {session.id}
    assert [r["mode"] for r in rows].count("baseline") == sum(1 for r in session.rows if r.mode == "baseline") > 0
    assert all(r["tokens_per_s"] and float(r["step_latency_ms"]) > 0 for r in rows)
    for reply in ("0", "1"):
        steps = [int(r["step"]) for r in rows if r["reply_index"] == reply]
        assert steps == list(range(len(steps)))


def test_export_while_a_reply_streams_gives_the_steps_so_far(engine, settings, controls):
    session = Session()
    handlers.add_user(engine, session, controls, "def add")
    stream = handlers.respond(engine, settings, session, controls)
    while len(session.rows) < 2:
        next(stream)
    with Path(handlers.export_csv(settings, session)["export_file"]).open() as f:
        assert len(list(csv.DictReader(f))) == len(session.rows) >= 2
    stream.close()


def test_an_empty_message_is_ignored(engine, settings, controls):
    session = Session()
    assert handlers.add_user(engine, session, controls, "   \n") == {"message": ""}
    assert session.turns == []
    assert list(handlers.respond(engine, settings, session, controls)) == [{"reply_status": gr.skip()}]


def test_a_message_longer_than_the_context_is_refused_with_the_reason_and_the_chat_continues(engine, settings, controls):
    session = Session()
    with pytest.warns(UserWarning, match="too long .* the model's 256-token context"):
        assert handlers.add_user(engine, session, controls, "def add " * 400) == {"message": gr.skip()}  # kept in the box
    assert session.turns == [] and session.saved() == []
    send(engine, settings, session, controls, "def add")
    assert session.turns[0].state == "done" and session.turns[0].reply.text


def test_old_turns_are_left_out_when_the_conversation_outgrows_the_context(engine, settings, controls):
    session = Session()
    long = dataclasses.replace(controls, max_new_tokens=60)
    for _ in range(6):
        send(engine, settings, session, long, "def add(a, b): return a + b " * 2)
    assert all(t.state == "done" for t in session.turns)
    assert "left out to fit the 256-token context" in session.turns[-1].note
    assert not session.turns[0].note


def test_an_invalid_custom_tree_gets_the_validators_message(engine, settings, controls):
    session = Session()
    bad = dataclasses.replace(controls, tree=CUSTOM_TREE, custom_tree="[[0], [0, 0, 1]]")
    updates = send(engine, settings, session, bad)
    assert session.turns[0].state == "error"
    message = updates[-1]["tree_status"]
    assert "[0, 0]" in message  # the validator names the missing prefix
    assert handlers.check_tree(engine, CUSTOM_TREE, "[[0], [0, 0, 1]]")["tree_status"] == message
    assert "not valid JSON" in handlers.check_tree(engine, CUSTOM_TREE, "[[0]")["tree_status"]
    too_deep = handlers.check_tree(engine, CUSTOM_TREE, "[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]")
    assert too_deep["tree_status"].startswith("⚠") and "4" in too_deep["tree_status"]


def test_corpus_drafts_on_a_model_without_a_corpus_are_refused_and_the_message_is_kept(engine, settings, controls):
    session = Session()
    send(engine, settings, session, dataclasses.replace(controls, drafts="corpus"), "keep me")
    turn = session.turns[0]
    assert turn.state == "error" and turn.user == "keep me" and not session.busy
    assert "drafts='corpus' needs a model with a corpus" in turn.error and "'heads'" in turn.error
    send(engine, settings, session, controls, "again")  # the chat goes on with another draft source
    assert session.turns[1].state == "done"


def test_a_valid_custom_tree_is_used_for_the_reply(engine, settings, controls):
    session = Session()
    custom = dataclasses.replace(controls, tree=CUSTOM_TREE, custom_tree="[[0], [1], [0, 0]]")
    assert handlers.check_tree(engine, CUSTOM_TREE, custom.custom_tree)["tree_status"].startswith("✓")
    send(engine, settings, session, custom)
    assert session.rows[0].tree_name == "prefill"  # step 0 emits the prefill's token
    assert session.rows[1].tree_nodes == 4 and session.rows[1].tree_name == "custom_3"


def test_an_error_inside_generation_appears_in_the_chat_and_the_app_keeps_serving(engine, settings, controls, monkeypatch):
    session = Session()
    model = engine.model
    real = model._steps.tree_forward

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(model._steps, "tree_forward", broken)
    updates = send(engine, settings, session, controls)
    assert session.turns[0].state == "error" and not session.busy
    assert "out of memory (simulated)" in reply_html(updates[-1])
    monkeypatch.setattr(model._steps, "tree_forward", real)
    send(engine, settings, session, controls, "return")
    assert session.turns[1].state == "done"


def test_compare_runs_medusa_off_then_heads_n_gram_and_hybrid_drafts_and_reports_identical_greedy_replies(
    engine, settings, controls
):
    session = Session()
    send(engine, settings, session, dataclasses.replace(controls, temperature=0.7))
    updates = list(handlers.compare(engine, settings, session, controls))
    table = updates[-1]["compare_result"]
    for variant in ("Medusa off", "heads", "n-gram", "hybrid"):
        assert f"| {variant} |" in table
    assert table.count("**yes** ✓") == 3 and "speedup" in table
    assert "| from heads | from chains |" in table and "chains: n-gram, corpus or drafter" in table
    assert table.startswith("| | tok/s | tok/step |")  # the speed first: a side panel too narrow for the table scrolls
    compare_rows = [r for r in session.rows if r.source == "compare"]
    assert {r.mode for r in compare_rows} == {"baseline", "medusa"}
    assert {r.drafts for r in compare_rows} == {"", "heads", "ngram", "hybrid"}
    assert {r.temperature for r in compare_rows} == {0.0}
    assert updates[-1]["summary"].count("–") < summary_markdown(summarize([], 4)).count("–")



def test_compare_also_runs_corpus_drafts_for_a_model_with_a_corpus_of_its_replies(engine, settings, controls):
    from medusa_core import MedusaModel
    from medusa_core.datastore import Datastore

    from app.engine import Engine

    session = Session()
    send(engine, settings, session, controls)
    reply = [t for r in session.last_records for t in r.token_ids]
    prompt_ids = list(range(1, 5))
    model = engine.model
    with_corpus = MedusaModel(model.backbone, model.heads, model.tokenizer, name="tiny with a corpus", trees=model.trees,
                              corpus=Datastore.build([(prompt_ids + reply, len(prompt_ids))] * 2))
    updates = list(handlers.compare(Engine.of(with_corpus), settings, session, controls))
    table = updates[-1]["compare_result"]
    assert "| corpus |" in table and table.count("**yes** ✓") == 4  # heads, n-gram, hybrid, corpus: identical to Medusa off
    assert {r.drafts for r in session.rows if r.source == "compare"} == {"", "heads", "ngram", "hybrid", "corpus"}


def test_a_model_with_a_corpus_of_its_replies_starts_with_heads_plus_corpus_drafts_unless_the_settings_say_otherwise(
    engine, settings
):
    from medusa_core import MedusaModel
    from medusa_core.datastore import Datastore

    from app.engine import Engine

    model = engine.model
    with_corpus = Engine.of(MedusaModel(model.backbone, model.heads, model.tokenizer, name="tiny with a corpus",
                                        trees=model.trees, corpus=Datastore.build([([1, 2, 3, 4], 1)] * 2)))
    assert Controls.from_settings(settings).drafts == "heads"  # while no model is loaded
    assert Controls.from_settings(settings, with_corpus.model).drafts == "corpus"
    assert handlers.page_status(with_corpus, settings)["drafts"].value == "corpus"  # the page once the model is ready
    chosen = settings.model_copy(update={"drafts": "hybrid"})
    assert Controls.from_settings(chosen, with_corpus.model).drafts == "hybrid"
    assert handlers.page_status(with_corpus, chosen)["drafts"].value == "hybrid"


def _with_drafter(engine, tmp_path, **corpus) -> Engine:
    """The tiny model (its weights shared) with a random EAGLE-style drafter, and ``corpus`` if given."""
    from medusa_core import MedusaModel
    from tiny_models import random_drafter

    model = engine.model
    drafted = MedusaModel(model.backbone, model.heads, model.tokenizer, name="tiny with a drafter", trees=model.trees, **corpus)
    drafted.load_drafter(random_drafter(tmp_path / "drafter.safetensors", drafted.config))
    return Engine.of(drafted)


def test_a_model_with_a_drafter_starts_with_drafter_plus_corpus_drafts_and_compare_runs_them(engine, settings, controls,
                                                                                              tmp_path):
    from medusa_core.datastore import Datastore

    session = Session()
    send(engine, settings, session, controls)
    reply = [t for r in session.last_records for t in r.token_ids]
    drafted = _with_drafter(engine, tmp_path, corpus=Datastore.build([(list(range(1, 5)) + reply, 4)] * 2))
    assert Controls.from_settings(settings, drafted.model).drafts == "eagle"
    ready = handlers.page_status(drafted, settings)
    assert ready["drafts"].value == "eagle"
    # the tree the page shows once ready is greyed out as explain_controls greys it for those drafts, whichever of the
    # two handlers' updates reaches the page last (the new-user check found page_status's landing after explain's)
    assert ready["tree"].interactive is False and "verifies a chain" in ready["tree"].info
    chosen = settings.model_copy(update={"drafts": "corpus"})
    assert Controls.from_settings(chosen, drafted.model).drafts == "corpus"
    assert handlers.page_status(drafted, chosen)["tree"].interactive is True
    updates = list(handlers.compare(drafted, settings, session, controls))
    table = updates[-1]["compare_result"]
    assert "| drafter |" in table and table.count("**yes** ✓") == 5  # each source of drafts: identical to Medusa off
    assert {r.drafts for r in session.rows if r.source == "compare"} == {"", "heads", "ngram", "hybrid", "corpus", "eagle"}
    eagle = dataclasses.replace(controls, drafts="eagle")
    send(drafted, settings, session, eagle)
    turn = session.turns[-1]
    assert not turn.error and "drafter + corpus chains" in turn.stats and "from the drafter or corpus" in turn.stats


class _HeldIndex:
    """A corpus (``MedusaModel(corpus=...)``'s callable) whose index is "being built" until ``finish``."""

    def __init__(self):
        self.built, self._release = [], threading.Event()

    def __call__(self):
        from medusa_core.datastore import Datastore

        self._release.wait(30)
        self.built.append(1)
        return Datastore.build([([1, 2, 3, 4], 1)] * 2)

    def finish(self, model) -> None:
        """Let the build end, and wait (up to 3 s) until ``model`` has its corpus."""
        self._release.set()
        for _ in range(300):
            if model.corpus_ready:
                break
            threading.Event().wait(0.01)


def test_a_reply_sent_before_the_corpus_index_is_built_drafts_with_the_heads_and_says_so(engine, settings, controls):
    # A first start indexes the model's own replies after ``ready`` (~9 s on the demo): a reply sent meanwhile does
    # not wait for the index (its time to the first token was those seconds); it drafts with the heads alone, its
    # note says why, the index is built in the background, and a later reply drafts from the corpus too.
    from medusa_core import MedusaModel

    from app.engine import Engine

    model = engine.model
    index = _HeldIndex()

    lazy = Engine.of(MedusaModel(model.backbone, model.heads, model.tokenizer, name="tiny with a lazy corpus", trees=model.trees,
                                 corpus=index))
    corpus = dataclasses.replace(controls, drafts="corpus")
    session = Session()
    updates = send(lazy, settings, session, corpus)
    assert updates[-1]["reply_status"].startswith("Latest reply: ") and index.built == []  # answered while not indexed
    first = session.turns[-1]
    assert "corpus" not in first.stats.split(" · ")[4] and "from heads" in first.stats  # drafted by the heads alone
    assert "still being indexed" in first.note and "still being indexed" in reply_html(updates[-1])
    index.finish(lazy.model)
    assert index.built == [1]
    send(lazy, settings, session, corpus)
    assert " + corpus" in session.turns[-1].stats and session.turns[-1].note == ""


def test_a_drafter_reply_sent_before_the_corpus_index_is_built_drafts_with_the_drafter_without_waiting(
    engine, settings, controls, tmp_path
):
    # Drafter + corpus needs no corpus to draft: while a first start indexes the model's replies in the background, a
    # reply drafts with the drafter alone (not the heads, not a wait for the index); once indexed, with both.
    index = _HeldIndex()

    lazy = _with_drafter(engine, tmp_path, corpus=index)
    eagle = dataclasses.replace(controls, drafts="eagle")
    session = Session()
    updates = send(lazy, settings, session, eagle)
    assert updates[-1]["reply_status"].startswith("Latest reply: ") and index.built == []  # answered while not indexed
    first = session.turns[-1]
    assert "drafter + corpus chains" in first.stats and first.note == ""  # the drafter's chains, no fallback
    index.finish(lazy.model)
    assert index.built == [1]
    send(lazy, settings, session, eagle)
    assert "drafter + corpus chains" in session.turns[-1].stats and session.turns[-1].note == ""


def test_compare_without_a_message_says_what_to_do(engine, settings, controls):
    (update,) = handlers.compare(engine, settings, Session(), controls)
    assert "Send a message first" in update["compare_result"]


def test_the_step_slider_shows_any_step_of_the_latest_reply(engine, settings, controls):
    session = Session()
    updates = send(engine, settings, session, controls)
    slider = [u["step_slider"] for u in updates if "step_slider" in u][-1]
    assert slider.maximum == len(session.last_records) - 1
    shown = handlers.show_step(engine, session, 1)["tree_plot"]
    assert shown.layout["title"]["text"].startswith("step 1 ")
    assert handlers.show_step(engine, session, 999)["tree_plot"].layout["title"]["text"].startswith(f"step {slider.maximum} ")


def test_tree_choices_put_the_models_own_trees_first_and_the_published_63_node_trees_last(engine):
    choices = handlers.tree_choices(engine.model)
    values = [v for _, v in choices]
    own = list(engine.model.trees)
    assert values[: len(own)] == own
    assert {"chain_1", "chain_4", "dense_3x2x2", "dense_2x2x2x2", CUSTOM_TREE} <= set(values)
    assert "dense_3x3x2x2x1" not in values  # deeper than the 4 heads
    published = [i for i, (label, _) in enumerate(choices) if "sized for 7B–33B models on GPUs" in label]
    assert "vicuna_7b_stage2" in [values[i] for i in published]
    assert published == list(range(len(choices) - 1 - len(published), len(choices) - 1))  # a group just before custom
    assert all(re.search(r"\(\d+ nodes", label) for label, v in choices if v != CUSTOM_TREE)


def test_the_model_panel_shows_names_precision_device_heads_and_memory(engine):
    panel = handlers.model_panel(engine, Session())
    for needle in ("base model", "not quantized", "float32", "cpu", "| Medusa heads | 4", "sparse_16 (the model's default)", "MiB",
                   "| decoding pass | transformers' forward (layer 0's self_attn.q_proj is not a 4-bit Int4Linear"):
        assert needle in panel
    assert f"heads {str(engine.model.heads[0][0].linear.weight.dtype).removeprefix('torch.')}" in panel
    kernel = engine.model.backbone.config._attn_implementation == ATTENTION_KERNEL
    assert ("attention of decoding rows: the compiled row kernel" if kernel else "attention of decoding rows: SDPA, one call per row group") in panel
    assert f"drafting among all {engine.model.vocab_size:,} tokens" in panel  # a vocabulary this small is not cut
    d = engine.model.describe()  # bfloat16 heads on a CPU with bfloat16 dot products propose through the kernels
    assert ("; proposals by the compiled kernels" if d["proposal"] == "compiled" else f"; proposals by ATen ops ({d['proposal_note']})") in panel
    assert d["int4_product"] is None and "int4 product" not in panel  # a float backbone has no 4-bit layer


def test_replies_are_shaped_by_the_models_tuned_threshold_which_the_model_panel_shows(engine, settings, controls, monkeypatch):
    assert "| tree shaping | off: every node of the tree is verified (no tuned τ) |" in handlers.model_panel(engine, Session())
    monkeypatch.setattr(engine.model, "head_temperatures", (50.0,) * 4)  # hot enough that no node of random heads is 10 % sure
    monkeypatch.setattr(engine.model._steps, "temperatures", torch.full((4, 1), 50.0))
    monkeypatch.setattr(engine.model, "min_head_probability", 0.1)
    session = Session()
    send(engine, settings, session, dataclasses.replace(controls, tree="sparse_16", drafts="heads"))
    assert session.last_records and all("head" not in r.node_sources for r in session.last_records)
    panel = handlers.model_panel(engine, session)
    assert "| tree shaping | τ = 0.1: a head node is verified when its calibrated path probability reaches it" in panel
    assert "head temperatures 50, 50, 50, 50" in panel
    from medusa_core.tuned import TunedSettings

    tuned = {"greedy": TunedSettings("greedy", "sparse_16", 0.4, "greedy"), "chat": TunedSettings("chat", "sparse_16", 0.46, "chat")}
    monkeypatch.setattr(engine.model, "tuned", tuned)  # a reply takes its settings' τ: the panel gives each
    assert "| tree shaping | τ = 0.4 at greedy, τ = 0.46 at the chat defaults: a head node" in handlers.model_panel(engine, Session())


def test_the_model_panel_names_the_tree_of_the_latest_reply(engine, settings, controls):
    session = Session()
    send(engine, settings, session, dataclasses.replace(controls, tree="chain_3"))
    assert "chain_3 (latest reply)" in handlers.model_panel(engine, session)
    # drafts that verify a chain at every step (drafter + corpus, n-gram only) use no tree: the panel says so, not
    # the internal name of a chain's step ("ngram")
    send(engine, settings, session, dataclasses.replace(controls, drafts="ngram"), "def add(a, b): return a + b\ndef add")
    panel = handlers.model_panel(engine, session)
    assert "| tree in use | none: each step of the latest reply verified a chain (n-gram only drafts) |" in panel, panel


def test_while_the_model_loads_the_page_shows_progress_and_a_failed_load_says_why(settings, controls, monkeypatch):
    loading = Engine("demo (nf4)")
    assert handlers.page_status(loading, settings)["banner"].startswith("**Loading demo (nf4)")
    with pytest.raises(ValueError):
        loading.load(lambda: (_ for _ in ()).throw(ValueError("no such folder")))
    failed = handlers.page_status(loading, settings)
    assert "no such folder" in failed["banner"] and "timer" in failed
    warnings = []
    monkeypatch.setattr(gr, "Warning", lambda msg, *a, **k: warnings.append(msg))
    session = Session()
    assert handlers.add_user(loading, session, controls, "hi") == {"message": gr.skip()} and session.turns == []
    assert "no such folder" in warnings[0]  # after a failed load a send is refused, the message kept in the box


def test_a_message_sent_while_the_model_loads_is_answered_once_it_is_ready_at_the_pages_ready_controls(engine, settings, controls,
                                                                                                         monkeypatch):
    # the ready controls sample with a fresh seed, whose reply from the random tiny model was now and then EOS alone
    monkeypatch.setattr(medusa_core.model.random, "SystemRandom", lambda: random.Random(0))
    loading = Engine(engine.description)
    session = Session()
    sent = handlers.add_user(loading, session, dataclasses.replace(controls, drafts="ngram"), "def add")
    assert sent["message"] == "" and [t.state for t in session.turns] == ["pending"]
    assert "once it is ready" in sent["reply_status"]
    warnings = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gr, "Warning", lambda msg, *a, **k: warnings.append(msg))
        assert handlers.add_user(loading, session, controls, "def sub") == {"message": gr.skip()}  # one waits already
    assert "still waiting for the model to load" in warnings[0] and len(session.turns) == 1
    replying = handlers.respond(loading, settings, session, dataclasses.replace(controls, drafts="ngram"))
    assert "Loading" in next(replying)["reply_status"]  # it waits, saying for what
    threading.Thread(target=loading.load, args=(lambda: engine.model,)).start()
    list(replying)
    turn = session.turns[0]
    assert turn.state == "done" and turn.reply.text
    # the controls the page shows once the model is ready (page_status): its default drafts and chat settings
    ready = handlers.page_status(loading, settings)
    assert {r.drafts for r in session.rows} <= {ready["drafts"].value, "plain"}
    assert {r.temperature for r in session.rows} == {ready["temperature"].value}


def test_the_engine_has_its_load_time_from_the_moment_its_model_is_there(engine):
    # A reply waiting for the load polls the engine from another thread and reads its status as soon as a model is
    # there: the load time must be set by then (it was set after the model, a window in which status() raised).
    seen = []

    class Watched(Engine):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name == "model" and value is not None:
                seen.append((self.status(), self.elapsed_s))

    Watched("demo").load(lambda: engine.model)
    assert seen and "ready (loaded in" in seen[0][0] and seen[0][1] >= 0


def waiting_reply(settings, controls):
    """A message sent while a model loads, its reply waiting for it: (engine, session, the reply's updates)."""
    loading = Engine("demo (nf4)")
    session = Session()
    handlers.add_user(loading, session, controls, "def add")
    replying = handlers.respond(loading, settings, session, controls)
    assert "Loading" in next(replying)["reply_status"]
    return loading, session, replying


def test_a_message_waiting_for_a_load_that_fails_stays_in_the_chat_with_the_reason(settings, controls):
    loading, session, replying = waiting_reply(settings, controls)
    threading.Thread(target=lambda: pytest.raises(ValueError, loading.load, lambda: (_ for _ in ()).throw(ValueError("no such folder")))).start()
    final = list(replying)[-1]
    turn = session.turns[0]
    assert turn.user == "def add" and turn.state == "error" and "no such folder" in turn.error
    assert "no such folder" in final["chatbot"][-1]["content"] and final["send"].interactive


def test_clear_while_a_message_waits_for_the_model_ends_the_wait_and_nothing_is_generated_later(engine, settings, controls):
    loading, session, replying = waiting_reply(settings, controls)
    handlers.clear(loading, session)
    loading.load(lambda: engine.model)  # the model arrives after the chat was cleared
    list(replying)
    assert session.turns == [] and session.rows == []


def test_stop_while_a_message_waits_for_the_model_ends_the_wait(settings, controls):
    loading, session, replying = waiting_reply(settings, controls)
    handlers.stop(loading, session, controls.highlight)
    list(replying)  # returns without a model
    assert session.turns[0].state == "stopped" and session.turns[0].user == "def add"


def test_the_medusa_toggle_says_when_the_tree_tuned_at_the_settings_ran_slower_than_the_plain_loop(engine, settings, monkeypatch):
    assert handlers.medusa_notice(engine, 0.2, "hybrid")["medusa"].info == ""  # untuned: nothing to say
    monkeypatch.setattr(engine.model, "tuned", {
        "greedy": TunedSettings("greedy", "sparse_16", 0.0, "greedy", 1.05),
        "chat": TunedSettings("chat", "chain_2", 0.0, "chat", 0.92, "Intel Xeon"),
    })
    assert handlers.medusa_notice(engine, 0.0, "hybrid")["medusa"].info == ""  # faster at greedy
    note = handlers.medusa_notice(engine, 0.7, "hybrid")["medusa"].info
    assert note == ("⚠ Medusa (hybrid (heads + n-gram)) measured 0.92× the plain loop at these settings (chat preset) on "
                    "Intel Xeon: plain decoding is faster here")
    # the page opens at the chat defaults and the default drafts
    opening = handlers.medusa_notice(engine, 0.2, drafts_default(settings, engine.model))["medusa"].info
    assert opening.startswith("⚠ Medusa (") and handlers.page_status(engine, settings)["medusa"].info == opening
    # A greedy figure read from an old file says nothing about sampled settings.
    monkeypatch.setattr(engine.model, "tuned", {"chat": TunedSettings("chat", "chain_2", 0.0, "greedy", 0.92)})
    assert handlers.medusa_notice(engine, 0.7, "hybrid")["medusa"].info == ""


def test_with_the_drafter_the_medusa_toggle_speaks_of_its_tuned_chain_not_of_the_heads_tree(engine, monkeypatch):
    monkeypatch.setattr(engine.model, "tuned", {"chat": TunedSettings("chat", "chain_2", 0.0, "chat", 0.92, None, 5, 0.3, 1.31)})
    assert handlers.medusa_notice(engine, 0.7, "eagle")["medusa"].info == ""  # the chain ran 1.31×
    assert handlers.medusa_notice(engine, 0.7, "heads")["medusa"].info.startswith("⚠ Medusa (heads only) measured 0.92×")
    monkeypatch.setattr(engine.model, "tuned", {"chat": TunedSettings("chat", "chain_2", 0.0, "chat", 1.2, None, 5, 0.3, 0.95)})
    assert handlers.medusa_notice(engine, 0.7, "eagle")["medusa"].info == (
        "⚠ Medusa (drafter + corpus) measured 0.95× the plain loop at these settings (chat preset) on this machine: "
        "plain decoding is faster here")
    assert handlers.medusa_notice(engine, 0.7, "corpus")["medusa"].info == ""
    # no chain measured: nothing to say about the drafter
    monkeypatch.setattr(engine.model, "tuned", {"chat": TunedSettings("chat", "chain_2", 0.0, "chat", 0.92)})
    assert handlers.medusa_notice(engine, 0.7, "eagle")["medusa"].info == ""


def test_the_model_tab_gives_the_drafters_chain_tuned_per_preset_else_eagles_defaults():
    from app.handlers.views import _drafter_chain
    from medusa_core import eagle

    assert _drafter_chain({}) == (f"one decoder layer in 4 bits, chains of up to {eagle.DEPTH} drafts while their probability "
                                  f"stays ≥ {eagle.THRESHOLD} (Drafts: drafter + corpus)")
    tuned = {"greedy": TunedSettings("greedy", "tuned", 0.1, "greedy", 1.2, None, 5, 0.3, 1.7),
             "chat": TunedSettings("chat", "tuned_chat", 0.1, "chat", 1.2, None, 3, 0.4, 1.4)}
    assert _drafter_chain(tuned) == ("one decoder layer in 4 bits, chains of up to 5 drafts while their probability stays ≥ 0.3 "
                                     "at greedy, up to 3 drafts while their probability stays ≥ 0.4 at the chat defaults "
                                     "(`bench tune`) (Drafts: drafter + corpus)")


def test_the_default_tree_runs_the_tree_tuned_at_each_replys_settings(engine, settings, controls, monkeypatch):
    monkeypatch.setattr(engine.model, "tuned", {"chat": TunedSettings("chat", "chain_2", 0.0, "chat", 1.3)})
    controls = dataclasses.replace(controls, drafts="heads")  # the heads' tree alone: every step names it
    assert controls.tree == engine.model.default_tree
    label = dict((v, label) for label, v in handlers.tree_choices(engine.model))[controls.tree]
    session = Session()
    send(engine, settings, session, controls)  # greedy: no tuned entry, the model's default tree
    assert {r.tree_name for r in session.last_records[1:]} <= {"sparse_16", "baseline"}
    send(engine, settings, session, dataclasses.replace(controls, **dataclasses.asdict(CHAT_PRESET), sampling="exact", seed=1))
    assert {r.tree_name for r in session.last_records[1:]} <= {"chain_2", "baseline"} and len(session.last_records) > 2
    send(engine, settings, session, dataclasses.replace(controls, tree="chain_3", **dataclasses.asdict(CHAT_PRESET)))
    assert {r.tree_name for r in session.last_records[1:]} <= {"chain_3", "baseline"}  # a tree picked by hand stays
    assert "sparse_16" in label


def test_page_status_fills_the_tree_choices_once_ready(engine, settings):
    updates = handlers.page_status(engine, settings)
    assert updates["banner"] == "" and updates["tree"].value == engine.model.default_tree


def test_the_ui_builds_without_a_model_and_with_one(engine, settings):
    assert isinstance(build_ui(Engine("not loaded"), settings), gr.Blocks)
    assert isinstance(build_ui(engine, settings), gr.Blocks)


def test_session_state_copies_are_independent_and_usable():
    import copy

    original = Session()
    original.turns.append(Turn(user="x"))
    copied = copy.deepcopy(original)
    assert copied.turns[0].user == "x" and copied.turns is not original.turns
    assert not copied.busy and copied.id != original.id


def test_prompts_are_built_on_the_cpu_host_side(engine, controls):
    ids, dropped = fit_prompt(engine.model, controls, [], "def add")
    assert ids.dtype == torch.long and ids.shape[0] == 1 and dropped == 0


def test_generations_share_one_model_queue_and_stop_cancels_them(engine, settings):
    fns = list(build_ui(engine, settings).fns.values())
    generating = [f for f in fns if f.name in ("respond", "compare")]
    assert len(generating) == 4  # reply after send, after regenerate, after an edit; compare
    assert {(f.concurrency_id, f.concurrency_limit, f.queue) for f in generating} == {("model", 1, True)}
    generating_ids = {i for i, f in enumerate(fns) if f in generating}
    cancellers = [f for f in fns if f.cancels]
    assert len(cancellers) == 3 and all(set(f.cancels) == generating_ids for f in cancellers)  # Stop, Clear, trash icon
    assert all(not f.queue for f in fns if f.name in ("stop", "export_csv", "show_step"))  # run beside a reply
    asking = [f for f in fns if f.name in ("add_user", "regenerate", "edit_user")]  # queued, so their warnings reach the page
    assert len(asking) == 3 and {(f.concurrency_id, f.concurrency_limit, f.queue) for f in asking} == {("ask", None, True)}


def test_stop_during_compare_ends_it_and_says_so(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls)
    stream = handlers.compare(engine, settings, session, controls)
    next(stream)
    session.stop_requested.set()
    final = list(stream)[-1]["compare_result"]
    assert "Stopped before every run finished" in final and "| hybrid |" not in final
    assert not session.busy


def test_a_stop_pressed_after_a_reply_ended_does_not_stop_the_next_one(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls)
    handlers.stop(engine, session, False)  # nothing running: only the flag is left behind
    send(engine, settings, session, controls, "return")
    assert session.turns[1].state == "done"
    table = list(handlers.compare(engine, settings, session, controls))[-1]["compare_result"]
    assert "identical reply" in table


def test_the_status_line_follows_the_latest_reply(engine, settings, controls):
    session = Session()
    assert handlers.add_user(engine, session, controls, "def add")["reply_status"] == "Waiting for the model…"
    stream = handlers.respond(engine, settings, session, controls)
    assert next(stream)["reply_status"] == "Generating…"
    final = list(stream)[-1]["reply_status"]
    tokens = sum(r.accepted_tokens for r in session.rows)
    assert final.startswith(f"Latest reply: {tokens} tokens · ") and "tree sparse_16" in final
    handlers.add_user(engine, session, controls, "def add")
    bad_tree = dataclasses.replace(controls, tree=CUSTOM_TREE, custom_tree="[[0], [")
    assert list(handlers.respond(engine, settings, session, bad_tree))[-1]["reply_status"] == "Latest reply: not generated (see the chat)."
    handlers.add_user(engine, session, controls, "return")
    stream = handlers.respond(engine, settings, session, dataclasses.replace(controls, medusa=False))
    next(stream)
    session.stop_requested.set()  # the Stop handler's first act; the reply ends after this step
    list(stream)
    shown = handlers.stop(engine, session, False)["reply_status"]
    assert "Medusa off" in shown and shown.endswith(" · stopped")


def test_every_handler_returns_only_the_outputs_its_event_declares(engine, settings, controls):
    session = Session()
    returned: dict[str, set[str]] = {}

    def note(name, updates):
        returned.setdefault(name, set()).update(updates)

    note("page_status", handlers.page_status(engine, settings))
    note("add_user", handlers.add_user(engine, session, controls, "def add"))
    for u in handlers.respond(engine, settings, session, controls):
        note("respond", u)
    note("regenerate", handlers.regenerate(engine, session, controls))
    for u in handlers.respond(engine, settings, session, dataclasses.replace(controls, tree=CUSTOM_TREE, custom_tree="[[")):
        note("respond", u)
    handlers.regenerate(engine, session, controls)
    for u in handlers.respond(engine, settings, session, controls):
        note("respond", u)
    for u in handlers.compare(engine, settings, session, controls):
        note("compare", u)
    note("stop", handlers.stop(engine, session, False))
    note("rerender_chat", handlers.rerender_chat(session, True))
    note("show_step", handlers.show_step(engine, session, 0))
    note("check_tree", handlers.check_tree(engine, CUSTOM_TREE, "[[0]]"))
    note("medusa_notice", handlers.medusa_notice(engine, 0.2, "eagle"))
    note("export_csv", handlers.export_csv(settings, session))
    note("export_transcript", handlers.export_transcript(engine, settings, session, "sys", fmt="md"))
    note("explain_controls", handlers.explain_controls(True, 0.0))
    note("greedy_preset", handlers.greedy_preset())
    note("chat_preset", handlers.chat_preset(engine, settings))
    note("edit_user", handlers.edit_user(engine, session, controls, 0, "def sub"))
    for u in handlers.respond(engine, settings, session, controls):
        note("respond", u)
    note("restore_chat", handlers.restore_chat(Session(), session.saved(), False))
    note("clear", handlers.clear(engine, session))
    assert set(returned) == set(handlers.OUTPUTS)
    for name, keys in returned.items():
        assert keys <= set(handlers.OUTPUTS[name]), name


def test_stop_during_compares_medusa_on_run_says_stopped_and_draws_no_verdict(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls)
    stream = handlers.compare(engine, settings, session, controls)
    for update in stream:
        if any(r.source == "compare" and r.mode == "medusa" for r in session.rows):
            break
    session.stop_requested.set()
    final = list(stream)[-1]["compare_result"]
    assert "Stopped" in final
    assert "identical reply" not in final and "×" not in final
    assert "Stopped" in handlers.stop(engine, session, False)["compare_result"]  # also when Stop cancelled the stream


def test_each_reply_shows_its_stats_with_ttft_and_wall_time_from_send_to_last_token(engine, settings, controls):
    session = Session()
    handlers.add_user(engine, session, controls, "def add")
    live = [u["chatbot"][-1]["content"] for u in handlers.respond(engine, settings, session, controls) if "chatbot" in u]
    assert any("generating…" in c and "tokens/s" in c for c in live[:-1])  # live tokens/s while it streams
    turn = session.turns[0]
    tokens = sum(r.accepted_tokens for r in session.rows)
    assert turn.stats.startswith(f"{tokens} tokens · ") and "TTFT" in turn.stats and "s total" in turn.stats
    assert 0 <= turn.first_token_at - turn.sent_at <= turn.last_token_at - turn.sent_at
    assert f'<p class="medusa-stats">{turn.stats}</p>' in live[-1]
    send(engine, settings, session, controls, "return")
    first = handlers.rerender_chat(session, False)["chatbot"][1]["content"]
    assert turn.stats in first  # kept per message


def test_send_is_disabled_while_a_reply_streams_and_enabled_when_it_ends_or_is_stopped(engine, settings, controls):
    session = Session()
    assert handlers.add_user(engine, session, controls, "def add")["send"].interactive is False
    assert list(handlers.respond(engine, settings, session, controls))[-1]["send"].interactive is True
    handlers.regenerate(engine, session, controls)
    stream = handlers.respond(engine, settings, session, controls)
    next(stream)
    stream.close()
    assert handlers.stop(engine, session, False)["send"].interactive is True


def test_editing_a_user_message_replaces_the_conversation_from_there_and_resends_it(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls, "def add")
    send(engine, settings, session, controls, "return")
    send(engine, settings, session, controls, "class")
    edited = handlers.edit_user(engine, session, controls, 2, '<pre class="medusa-user">\nwhile a &lt; b</pre>')  # the 2nd user message
    assert [t.user for t in session.turns] == ["def add", "while a < b"] and session.turns[1].state == "pending"
    assert edited["chatbot"][-1] == {"role": "user", "content": '<pre class="medusa-user">\nwhile a &lt; b</pre>'}
    list(handlers.respond(engine, settings, session, controls))
    assert session.turns[1].state == "done" and session.turns[1].reply.text


def test_an_edit_is_refused_while_a_reply_streams_and_the_chat_shows_the_old_text(engine, settings, controls, monkeypatch):
    warnings = []
    monkeypatch.setattr(gr, "Warning", lambda msg, *a, **k: warnings.append(msg))
    session = Session()
    send(engine, settings, session, controls, "def add")
    session.begin()
    shown = handlers.edit_user(engine, session, controls, 0, "changed")
    session.end()
    assert "still streaming" in warnings[0] and session.turns[0].user == "def add"
    assert "def add" in shown["chatbot"][0]["content"]


def test_the_conversation_survives_a_reload_through_the_browsers_storage(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls, "def add")
    saved = json.loads(json.dumps(session.saved()))  # what the browser keeps
    reloaded = Session()
    shown = handlers.restore_chat(reloaded, saved, True)["chatbot"]
    assert [t.user for t in reloaded.turns] == ["def add"]
    assert reloaded.turns[0].reply.runs == session.turns[0].reply.runs and reloaded.turns[0].stats == session.turns[0].stats
    assert shown == handlers.rerender_chat(session, True)["chatbot"]
    send(engine, settings, reloaded, controls, "return")  # the restored turns are the next prompt's history
    assert reloaded.history(1) == [("def add", session.turns[0].reply.text)]
    assert handlers.restore_chat(Session(), "not a conversation", False)["chatbot"] == gr.skip()


def test_the_transcript_exports_as_markdown_and_json_with_plain_text_and_stats(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls, "print('<b>')")
    reply = session.turns[0].reply.text
    md = Path(handlers.export_transcript(engine, settings, session, "be brief", fmt="md")["export_file"])
    text = md.read_text()
    assert md.suffix == ".md" and md.parent == settings.exports_dir
    assert "## System" in text and "print('<b>')" in text and reply in text and session.turns[0].stats in text
    data = json.loads(Path(handlers.export_transcript(engine, settings, session, "be brief", fmt="json")["export_file"]).read_text())
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant"]
    assert data["messages"][2]["content"] == reply and data["messages"][2]["stats"] == session.turns[0].stats


def test_epsilon_and_delta_are_inactive_with_the_reason_at_temperature_0_and_tree_too_with_medusa_off():
    greedy = handlers.explain_controls(True, 0.0)
    assert greedy["tree"].interactive is True
    assert greedy["posterior_threshold"].interactive is False and "temperature 0" in greedy["posterior_threshold"].info
    sampled = handlers.explain_controls(True, 0.7)
    assert sampled["posterior_alpha"].interactive is True
    exact = handlers.explain_controls(True, 0.7, "exact")
    assert exact["posterior_threshold"].interactive is False and "exact sampling" in exact["posterior_alpha"].info
    off = handlers.explain_controls(False, 0.7)
    assert all(off[k].interactive is False and "Medusa is off" in off[k].info for k in ("tree", "posterior_threshold", "posterior_alpha"))


def test_the_tree_is_inactive_with_the_reason_where_the_drafts_are_a_chain_the_tree_does_not_shape():
    for drafts in ("eagle", "ngram"):
        for temperature, sampling in ((0.0, "typical"), (0.2, "exact")):
            chain = handlers.explain_controls(True, temperature, sampling, drafts)
            assert chain["tree"].interactive is False and "verifies a chain" in chain["tree"].info
            assert chain["drafts"].interactive is True
    for drafts in ("heads", "corpus", "hybrid"):
        assert handlers.explain_controls(True, 0.2, "exact", drafts)["tree"].interactive is True
    assert "Medusa is off" in handlers.explain_controls(False, 0.2, "exact", "eagle")["tree"].info


def test_top_k_top_p_and_min_p_are_inactive_at_temperature_0_where_greedy_ignores_them():
    greedy, sampled = handlers.explain_controls(True, 0.0), handlers.explain_controls(True, 0.2, "exact")
    for name in ("top_k", "top_p", "min_p"):
        assert greedy[name].interactive is False and "temperature 0" in greedy[name].info
        assert sampled[name].interactive is True and "temperature 0" not in sampled[name].info


def test_the_controls_start_at_the_chat_preset_and_the_settings_override_it(tmp_path):
    controls = Controls.from_settings(AppSettings(data_dir=tmp_path))
    assert (controls.temperature, controls.top_k, controls.top_p, controls.min_p, controls.repetition_penalty) == (
        CHAT_PRESET.temperature, CHAT_PRESET.top_k, CHAT_PRESET.top_p, CHAT_PRESET.min_p, CHAT_PRESET.repetition_penalty)
    assert controls.sampling == CHAT_SAMPLING
    mine = Controls.from_settings(AppSettings(data_dir=tmp_path, top_p=0.5, repetition_penalty=1.0, temperature=0.0))
    assert (mine.temperature, mine.top_p, mine.repetition_penalty) == (0.0, 0.5, 1.0) and mine.top_k == CHAT_PRESET.top_k


def test_once_ready_the_page_shows_the_models_own_sampling_defaults_from_its_generation_config(engine, settings, monkeypatch):
    shown = {k: v.value for k, v in handlers.page_status(engine, settings).items() if k in ("temperature", "top_p", "repetition_penalty")}
    assert shown == {"temperature": CHAT_PRESET.temperature, "top_p": CHAT_PRESET.top_p,
                     "repetition_penalty": CHAT_PRESET.repetition_penalty}  # the tiny model's config sets none
    generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    monkeypatch.setattr(engine.model.backbone, "generation_config", generation_config)
    updates = handlers.page_status(engine, settings)
    assert (updates["temperature"].value, updates["top_p"].value, updates["top_k"].value, updates["repetition_penalty"].value) == (
        0.6, 0.95, 20, 1.0)
    assert handlers.chat_preset(engine, settings)["top_k"].value == 20  # "Chat defaults" restores them too


def test_the_greedy_preset_turns_sampling_and_the_penalty_off_so_medusa_equals_plain_greedy(engine, settings, controls):
    preset = {name: update.value for name, update in handlers.greedy_preset().items()}
    assert preset == handlers.GREEDY_PRESET == {"temperature": 0.0, "repetition_penalty": 1.0}
    session = Session()
    chat = dataclasses.replace(controls, **{n: getattr(CHAT_PRESET, n) for n in ("temperature", "top_p", "repetition_penalty")})
    send(engine, settings, session, dataclasses.replace(chat, **preset))
    assert session.turns[-1].reply.text == greedy_reference(engine, session, controls)


def test_each_reply_records_its_sampling_settings_in_its_stats_line_and_the_csv(engine, settings, controls):
    session = Session()
    chat = dataclasses.replace(controls, temperature=0.2, top_p=0.9, top_k=0, min_p=0.05, repetition_penalty=1.1,
                               sampling="exact", seed=1)
    send(engine, settings, session, chat)
    send(engine, settings, session, controls)  # then greedy
    assert "T 0.2 · top-p 0.9 · min-p 0.05 · rep. 1.1 · exact" in session.turns[0].stats
    assert "greedy" in session.turns[1].stats and "rep." not in session.turns[1].stats
    with open(handlers.export_csv(settings, session)["export_file"]) as f:
        rows = list(csv.DictReader(f))
    first = {(r["temperature"], r["top_k"], r["top_p"], r["min_p"], r["repetition_penalty"]) for r in rows if r["reply_index"] == "0"}
    assert first == {("0.2", "0", "0.9", "0.05", "1.1")}
    assert {r["repetition_penalty"] for r in rows if r["reply_index"] == "1"} == {"1.0"}


def test_a_sampling_value_out_of_range_is_not_sent_and_says_why(engine, settings, controls):
    session = Session()
    updates = send(engine, settings, session, dataclasses.replace(controls, top_k=-2))
    assert session.turns[-1].state == "error" and "top_k must be an integer >= 0" in session.turns[-1].error
    assert "top_k" in updates[-1]["tree_status"]


def test_while_loading_the_page_shows_a_progress_bar_against_the_last_load_time(settings, engine, monkeypatch):
    loading = Engine(engine.description)
    first = handlers.page_status(loading, settings)["banner"]
    assert first.startswith("**Loading ") and "no estimate yet" in first
    monkeypatch.setattr(engine, "load_seconds", 20.0)
    handlers.page_status(engine, settings)  # ready: its load time is kept for the next start
    later = handlers.page_status(loading, settings)["banner"]
    assert "of about 20 s (the last load)" in later and "<progress" in later


def test_replies_use_the_heads_drafts_by_default_and_the_drafts_control_reaches_the_engine(engine, settings, controls):
    assert not engine.model.has_corpus
    assert Controls.from_settings(settings, engine.model).drafts == "heads" and controls.drafts == "heads"
    assert handlers.page_status(engine, settings)["drafts"].value == "heads"  # once the model is ready
    session = Session()
    send(engine, settings, session, controls)
    assert {r.drafts for r in session.reply_rows(0)} == {"heads"}
    assert " from heads · " in session.turns[0].stats and "n-gram" not in session.turns[0].stats
    send(engine, settings, session, dataclasses.replace(controls, drafts="ngram"), "return")
    assert {r.drafts for r in session.reply_rows(1)} == {"ngram"}
    assert "from n-gram" in session.turns[1].stats
    assert handlers.explain_controls(False, 0.0)["drafts"].interactive is False
    assert handlers.explain_controls(True, 0.0)["drafts"].interactive is True


def test_regenerate_copies_from_the_reply_it_replaces_and_repeats_it_greedily(engine, settings, controls):
    controls = dataclasses.replace(controls, drafts="hybrid")
    session = Session()
    send(engine, settings, session, controls)
    first = session.reply_rows(0)
    assert len(session.reply_tokens) == 1 and session.reply_tokens[0] == [t for r in session.last_records for t in r.token_ids]
    handlers.regenerate(engine, session, controls)
    list(handlers.respond(engine, settings, session, controls))
    second = session.reply_rows(1)
    assert session.reply_tokens[0] == session.reply_tokens[1]  # greedy: the same reply
    assert sum(r.ngram_tokens for r in second) > sum(r.ngram_tokens for r in first)
    assert len(second) < len(first)


def test_the_transcript_message_count_counts_each_user_message_and_each_reply(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls, "def add")
    send(engine, settings, session, controls, "return")
    assert "Saved the transcript (4 messages)" in handlers.export_transcript(engine, settings, session, "", fmt="md")["export_path"]


def test_the_stats_line_names_the_tree_asked_for_even_when_a_step_verified_the_n_gram_chain_alone(engine, settings, controls):
    controls = dataclasses.replace(controls, drafts="hybrid")
    session = Session()
    send(engine, settings, session, controls, "def add")
    turn = session.turns[0]
    # A hybrid step whose copied chain is long verifies the root and the chain alone: its tree_name is "ngram".
    session.rows = [dataclasses.replace(r, tree_name="ngram") if r.step > 0 else r for r in session.rows]
    stats = handlers.views.turn_stats(session, turn)
    assert "tree sparse_16 + n-gram" in stats and "tree ngram" not in stats


def test_a_served_engine_runs_every_step_of_a_reply_on_its_own_thread_and_closes_it_there(engine, settings, controls, monkeypatch):
    # launch.py serves the model's work on the thread that loaded it: torch's OpenMP runtime keeps one team of threads
    # per thread that runs parallel work, and a second team (a reply in one of Gradio's worker threads) makes every
    # team yield its CPUs on each wait: on the demo a reply decoded at ~110 tokens/s in a worker thread against ~400
    # on the loading thread.
    model = engine.model
    generate = model.generate
    seen, closed = [], []

    def watched(*args, **kwargs):
        steps = generate(*args, **kwargs)

        def run():
            try:
                for record in steps:
                    seen.append(threading.current_thread())
                    yield record
            finally:
                closed.append(threading.current_thread())
                steps.close()

        return run()

    monkeypatch.setattr(model, "generate", watched)
    server = threading.Thread(target=engine.serve, name="engine-serve", daemon=True)
    server.start()
    try:
        updates = send(engine, settings, Session(), controls)
        assert reply_html(updates[-2] if "chatbot" not in updates[-1] else updates[-1])
        assert seen and set(seen) == {server} and closed == [server]
        session = Session()  # Stop after the first step: the rest is never made, and the steps close on the server
        handlers.add_user(engine, session, controls, "def add")
        seen.clear(), closed.clear()
        for update in handlers.respond(engine, settings, session, controls):
            if seen:
                session.stop_requested.set()
        assert len(seen) == 1 and closed == [server]
    finally:
        engine.stop_serving()
        server.join(10)
    assert not server.is_alive()
    assert list(engine.steps(iter([1, 2]))) == [1, 2]  # no server: the caller's own thread


def test_a_served_engine_hands_over_steps_that_come_before_it_serves(engine, monkeypatch):
    # launch.py's engine is made ``served``: a message sent while the model loads is answered once it is ready, which
    # may be just before the main thread reaches ``serve``; its steps wait for that thread rather than run in the
    # worker thread (which would start a second team of OpenMP threads for good).
    served = Engine(engine.description, served=True)
    served.model = engine.model
    where = []

    def steps():
        where.append(threading.current_thread())
        yield 1

    result = []
    client = threading.Thread(target=lambda: result.extend(served.steps(steps())))
    client.start()
    client.join(0.3)
    assert client.is_alive() and not where  # waiting for the server
    server = threading.Thread(target=served.serve, daemon=True)
    server.start()
    client.join(10)
    served.stop_serving()
    server.join(10)
    assert result == [1] and where == [server] and not server.is_alive()
