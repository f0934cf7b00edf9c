"""The model's load: progress, a failed load, messages sent before the model is ready, the page once ready.

Handler-level tests of the app on a tiny random Llama with Medusa heads: no browser, no server. Handlers are
called as the page calls them; streaming handlers are iterated, and a Stop is either the Stop handler's flag or
closing the generator (what Gradio's ``cancels=`` does).
"""

from __future__ import annotations

import dataclasses
import random
import threading

import gradio as gr
import pytest

import medusa_core.model
from app import handlers
from app.engine import Engine
from app.session import Session
from app.ui import build_ui

from .handler_support import waiting_reply


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


def test_a_message_waiting_for_a_load_that_fails_stays_in_the_chat_with_the_reason(settings, controls):
    loading, session, replying = waiting_reply(settings, controls)
    threading.Thread(target=lambda: pytest.raises(ValueError, loading.load, lambda: (_ for _ in ()).throw(ValueError("no such folder")))).start()
    final = [*replying, *handlers.finish_reply(loading, session, False)][-1]
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


def test_page_status_fills_the_tree_choices_once_ready(engine, settings):
    updates = handlers.page_status(engine, settings)
    assert updates["banner"] == "" and updates["tree"].value == engine.model.default_tree


def test_the_ui_builds_without_a_model_and_with_one(engine, settings):
    assert isinstance(build_ui(Engine("not loaded"), settings), gr.Blocks)
    assert isinstance(build_ui(engine, settings), gr.Blocks)


def test_while_loading_the_page_shows_a_progress_bar_against_the_last_load_time(settings, engine, monkeypatch):
    loading = Engine(engine.description)
    first = handlers.page_status(loading, settings)["banner"]
    assert first.startswith("**Loading ") and "no estimate yet" in first
    monkeypatch.setattr(engine, "load_seconds", 20.0)
    handlers.page_status(engine, settings)  # ready: its load time is kept for the next start
    later = handlers.page_status(loading, settings)["banner"]
    assert "of about 20 s (the last load)" in later and "<progress" in later
