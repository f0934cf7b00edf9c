"""The conversation: a reply streams, Stop, Regenerate, edits, Clear, bad input and errors, the step slider,
the conversation kept across a reload.

Handler-level tests of the app on a tiny random Llama with Medusa heads: no browser, no server. Handlers are
called as the page calls them; streaming handlers are iterated, and a Stop is either the Stop handler's flag or
closing the generator (what Gradio's ``cancels=`` does).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import gradio as gr
import pytest

from app import handlers
from app.handlers.views import speed_view
from app.session import Session

from .handler_support import greedy_reference, reply, reply_html, send


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
    rest = [*stream, *handlers.finish_reply(engine, session, False)]
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


def test_clear_empties_the_chat_but_keeps_the_statistics(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls)
    steps = len(session.rows)
    updates = handlers.clear(engine, session)
    assert updates["chatbot"] == [] and session.turns == []
    assert len(session.rows) == steps


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


def test_the_step_slider_shows_any_step_of_the_latest_reply(engine, settings, controls):
    session = Session()
    updates = send(engine, settings, session, controls)
    slider = [u["step_slider"] for u in updates if "step_slider" in u][-1]
    assert slider.maximum == len(session.last_records) - 1
    shown = handlers.show_step(engine, session, 1)["tree_plot"]
    assert shown.layout["title"]["text"].startswith("step 1 ")
    assert handlers.show_step(engine, session, 999)["tree_plot"].layout["title"]["text"].startswith(f"step {slider.maximum} ")


def test_a_stop_pressed_after_a_reply_ended_does_not_stop_the_next_one(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls)
    handlers.stop(engine, session, False)  # nothing running: only the flag is left behind
    send(engine, settings, session, controls, "return")
    assert session.turns[1].state == "done"
    table = list(handlers.compare(engine, settings, session, controls))[-1]["compare_result"]
    assert "identical reply" in table


def test_send_is_disabled_while_a_reply_streams_and_enabled_when_it_ends_or_is_stopped(engine, settings, controls):
    session = Session()
    assert handlers.add_user(engine, session, controls, "def add")["send"].interactive is False
    assert reply(engine, settings, session, controls)[-1]["send"].interactive is True
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


def test_beside_the_reply_its_follower_draws_the_tree_and_speed_chart_and_keeps_the_partial_reply_then_the_final_one(
    engine, settings, controls
):
    session = Session()
    handlers.add_user(engine, session, controls, "def add")
    followed: list = []
    follower = threading.Thread(target=lambda: followed.extend(handlers.follow_reply(engine, settings, session)))
    follower.start()  # the page starts it with respond, after the send
    stream = handlers.respond(engine, settings, session, controls)
    next(stream), next(stream)  # the reply streams; it waits here while the follower looks
    deadline = time.monotonic() + 10
    while not any(u.get("saved") and u["saved"][0]["runs"] for u in followed) and time.monotonic() < deadline:
        time.sleep(0.01)
    partial = next(u["saved"] for u in followed if u.get("saved") and u["saved"][0]["runs"])
    assert partial[0]["state"] == "streaming"  # a reload now shows it, marked stopped
    assert any("speed_plot" in u and "summary" in u for u in followed)
    trees = [u["tree_plot"].layout["title"]["text"] for u in followed if "tree_plot" in u]  # the live tree is drawn here
    assert trees and all(t.startswith("step ") for t in trees)
    assert list(handlers.follow_reply(engine, settings, session)) == [{"saved": gr.skip()}]  # a refused send's: nothing
    list(stream)
    follower.join(10)
    assert not follower.is_alive()
    last = followed[-1]  # drawn after the reply ended
    assert last["saved"] == session.saved() and last["saved"][0]["state"] == "done"
    assert last["summary"] == speed_view(engine, session)["summary"]
    (final,) = handlers.finish_reply(engine, session, False)  # after respond: the final view, in one update (see its docstring)
    assert final["send"].interactive and final["step_slider"].interactive and {"tree_plot", "chatbot", "saved"} <= set(final)
    assert list(handlers.finish_reply(engine, session, False)) == [{"send": gr.skip()}]  # once: respond took up nothing
