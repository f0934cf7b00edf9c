"""Drafts and trees: custom trees, the corpus and the drafter (defaults, a corpus still being indexed), the tree
choices, the tuned tree and τ of the reply's settings, the Medusa toggle's note.

Handler-level tests of the app on a tiny random Llama with Medusa heads: no browser, no server. Handlers are
called as the page calls them; streaming handlers are iterated, and a Stop is either the Stop handler's flag or
closing the generator (what Gradio's ``cancels=`` does).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from app import handlers
from app.handlers import CUSTOM_TREE, Controls
from app.handlers.controls import drafts_default
from app.session import Session
from medusa_core import CHAT_PRESET, TunedSettings

from .handler_support import HeldIndex, reply_html, send, with_drafter


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


def test_a_model_with_a_corpus_of_its_replies_starts_with_heads_plus_corpus_drafts_unless_the_settings_say_otherwise(
    engine, settings
):
    from app.engine import Engine
    from medusa_core import MedusaModel
    from medusa_core.datastore import Datastore

    model = engine.model
    with_corpus = Engine.of(MedusaModel(model.backbone, model.heads, model.tokenizer, name="tiny with a corpus",
                                        trees=model.trees, corpus=Datastore.build([([1, 2, 3, 4], 1)] * 2)))
    assert Controls.from_settings(settings).drafts == "heads"  # while no model is loaded
    assert Controls.from_settings(settings, with_corpus.model).drafts == "corpus"
    assert handlers.page_status(with_corpus, settings)["drafts"].value == "corpus"  # the page once the model is ready
    chosen = settings.model_copy(update={"drafts": "hybrid"})
    assert Controls.from_settings(chosen, with_corpus.model).drafts == "hybrid"
    assert handlers.page_status(with_corpus, chosen)["drafts"].value == "hybrid"


def test_a_model_with_a_drafter_starts_with_drafter_plus_corpus_drafts_and_compare_runs_them(engine, settings, controls,
                                                                                              tmp_path):
    from medusa_core.datastore import Datastore

    session = Session()
    send(engine, settings, session, controls)
    reply = [t for r in session.last_records for t in r.token_ids]
    drafted = with_drafter(engine, tmp_path, corpus=Datastore.build([(list(range(1, 5)) + reply, 4)] * 2))
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


def test_a_reply_sent_before_the_corpus_index_is_built_drafts_with_the_heads_and_says_so(engine, settings, controls):
    # A first start indexes the model's own replies after ``ready`` (~9 s on the demo): a reply sent meanwhile does
    # not wait for the index (its time to the first token was those seconds); it drafts with the heads alone, its
    # note says why, the index is built in the background, and a later reply drafts from the corpus too.
    from app.engine import Engine
    from medusa_core import MedusaModel

    model = engine.model
    index = HeldIndex()

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
    index = HeldIndex()

    lazy = with_drafter(engine, tmp_path, corpus=index)
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
