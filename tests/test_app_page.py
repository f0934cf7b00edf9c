"""Page-level tests: user actions fired through Gradio's own event processing (``tests/page.py``), on
the built page with a tiny random model. They catch what handler tests cannot: results Gradio
rejects, control values a component rejects, and chained events that run after a failure."""

from __future__ import annotations

import html

import pytest
from page import Page

from app.engine import Engine
from app.settings import AppSettings
from app.ui import build_ui


#: The seed the page tests reply with (the tiny model's reply to every test prompt is several tokens long).
SEED = 7


@pytest.fixture
def settings(tmp_path) -> AppSettings:
    return AppSettings(data_dir=tmp_path / "data", max_new_tokens=12, tree="sparse_16")


@pytest.fixture
def page(engine, settings) -> Page:
    """The page with a fixed seed: the chat preset samples, and a fresh seed per reply could make the tiny
    model's reply end at its first token (CI saw an empty reply once)."""
    page = Page(build_ui(engine, settings))
    page.set(seed=SEED)
    return page


def send(page: Page, text: str):
    page.set(message=text)
    return page.fire("message", "submit")


def test_enter_on_an_empty_box_changes_nothing_and_shows_no_error(page):
    fired = send(page, "   ")
    assert fired.errors == [] and page.session.turns == []


def test_regenerate_on_an_empty_chat_says_there_is_nothing_to_regenerate(page):
    fired = page.fire("regenerate", "click")
    assert fired.errors == []
    assert any("Nothing to regenerate" in w for w in fired.warnings)
    assert page.session.turns == []


def test_sending_after_the_model_failed_to_load_says_why_and_keeps_the_message(settings):
    engine = Engine("demo (nf4 backbone)")
    with pytest.raises(ValueError):
        engine.load(lambda: (_ for _ in ()).throw(ValueError("no such folder")))
    page = Page(build_ui(engine, settings))
    fired = send(page, "hello")
    assert fired.errors == []
    assert any("no such folder" in w for w in fired.warnings)
    assert page.session.turns == []
    assert all(o.get("message") != "" for o in fired.outputs)  # the message stays in the box


def test_a_message_sent_while_the_model_loads_is_answered_through_the_page_once_it_is_ready(engine, settings):
    import threading

    loading = Engine(engine.description)
    page = Page(build_ui(loading, settings))
    page.set(seed=SEED)
    threading.Timer(0.6, loading.load, args=(lambda: engine.model,)).start()
    fired = send(page, "def add")
    assert fired.errors == [] and fired.warnings == []
    assert any("Waiting for the model to load" in str(o.get("reply-status", "")) for o in fired.outputs)
    turn = page.session.turns[0]
    assert turn.user == "def add" and turn.state == "done" and turn.reply.text


def test_sending_while_a_reply_streams_says_so_and_keeps_the_message(page):
    send(page, "def add")
    page.session.begin()  # as if the reply were still streaming
    fired = send(page, "def sub")
    page.session.end()
    assert fired.errors == []
    assert any("still streaming" in w for w in fired.warnings)
    assert [t.user for t in page.session.turns] == ["def add"]


def test_a_send_with_a_rejected_control_value_leaves_no_trace_and_the_next_send_answers_itself(page):
    page.set(seed=-5)
    fired = send(page, "first")
    assert fired.errors == [] and any("Seed: -5" in w for w in fired.warnings)
    assert page.session.turns == []
    page.set(seed=SEED)
    send(page, "second")
    assert [t.user for t in page.session.turns] == ["second"]
    assert page.session.turns[0].state == "done" and page.session.turns[0].reply.text


def shown_step(fired) -> int:
    """The step number in the title of the last tree plot the page received."""
    import json
    import re

    plot = [o["tree-plot"] for o in fired.outputs if isinstance(o.get("tree-plot"), dict) and "plot" in o["tree-plot"]][-1]
    return int(re.match(r"step (\d+) ", json.loads(plot["plot"])["layout"]["title"]["text"]).group(1))


def test_the_step_slider_redraws_the_tree_on_arrow_keys_typed_numbers_and_clamps_out_of_range_ones(page):
    send(page, "def add")
    last = len(page.session.last_records) - 1
    assert last >= 2
    page.set(step_slider=1)
    assert shown_step(page.fire("step-slider", "input")) == 1  # an arrow key or a typed digit
    page.set(step_slider=last + 50)
    fired = page.fire("step-slider", "release")  # a typed number, on blur
    assert fired.errors == [] and shown_step(fired) == last
    page.set(step_slider=-3)
    assert shown_step(page.fire("step-slider", "release")) == 0


def test_editing_a_message_in_the_chat_resends_it_with_the_edited_text(page):
    send(page, "def add")
    send(page, "return")
    fired = page.fire("chat", "edit", {"index": 0, "value": "class", "previous_value": "def add"})
    assert fired.errors == [] and fired.ran == ["edit_user", "respond", "finish_reply", "follow_reply"]
    assert [t.user for t in page.session.turns] == ["class"] and page.session.turns[0].state == "done"


def test_after_a_reload_the_next_send_continues_the_kept_conversation_even_without_the_restore_event(page):
    send(page, "def add")
    reloaded = page.reload()
    # Gradio may run the page-load restore on a state of its own: the first send must still see the chat.
    send(reloaded, "return")
    assert [t.user for t in reloaded.session.turns] == ["def add", "return"]
    assert reloaded.session.turns[1].state == "done"
    assert [t["user"] for t in reloaded.saved] == ["def add", "return"]


def test_highlighting_or_stopping_right_after_a_reload_keeps_the_chat_on_screen(page):
    send(page, "def add")
    for action in ("highlight", "stop"):
        reloaded = page.reload()
        fired = reloaded.fire(action, "change" if action == "highlight" else "click")
        chats = [o["chat"] for o in fired.outputs if isinstance(o.get("chat"), list)]
        assert chats and len(chats[-1]) == 2, action  # the user message and its reply


def test_the_greedy_button_makes_the_next_reply_greedy_and_chat_defaults_bring_the_preset_back(page):
    from medusa_core import CHAT_PRESET

    fired = page.fire("greedy-preset", "click")
    assert fired.errors == [] and page.values[page.by_id["temperature"]._id] == 0.0
    assert page.values[page.by_id["repetition-penalty"]._id] == 1.0
    send(page, "def add")
    turn = page.session.turns[-1]
    assert turn.state == "done" and "greedy" in turn.stats and "rep." not in turn.stats
    assert {r.sampling for r in page.session.rows} == {"greedy"}
    fired = page.fire("chat-preset", "click")
    assert fired.errors == [] and page.values[page.by_id["top-p"]._id] == CHAT_PRESET.top_p
    assert page.values[page.by_id["temperature"]._id] == CHAT_PRESET.temperature
    send(page, "def sub")
    assert f"T {CHAT_PRESET.temperature:g}" in page.session.turns[-1].stats


# ---- faults found by the clumsy-user probe (issue 26)


def saved_updates(page: Page, fired) -> list:
    """The conversation the page wrote to the browser's storage, at each update that wrote it."""
    return [o[page.saved_block._id] for o in fired.outputs if isinstance(o.get(page.saved_block._id), list)]


@pytest.mark.parametrize("control, value, named", [
    ("seed", -5, "Seed: -5 is out of range; allowed: a whole number ≥ -1"),
    ("temperature", -1, "Temperature: -1 is out of range; allowed: a number from 0 to 2"),
    ("top_p", 0.0, "Top-p: 0.0 is out of range; allowed: a number from 0.01 to 1"),
    ("max_new_tokens", 2.5, "Max new tokens: 2.5 is not a whole number; allowed: a whole number from 1 to 2048"),
])
def test_a_rejected_control_value_is_named_with_its_range_and_the_message_stays_in_the_box(page, control, value, named):
    page.set(**{control: value})
    fired = send(page, "hello")
    assert fired.errors == []  # no bare "Error" over the chat: a warning and the status line say why
    assert any(named in w for w in fired.warnings), fired.warnings
    assert any(named in str(o.get("reply-status")) for o in fired.outputs)
    assert page.session.turns == [] and all(o.get("message") != "" for o in fired.outputs)  # the text stays in the box
    assert not any(isinstance(o.get("chat"), list) for o in fired.outputs)  # the chat is left as it was


def test_events_that_can_refuse_run_on_the_queue_so_their_warning_reaches_the_page(page):
    # Outside the queue Gradio turns gr.Warning into Python's warnings.warn: the server log, never the page.
    for name in ("add_user", "regenerate", "edit_user"):
        assert page._fn(name).queue, name


def test_a_temperature_typed_below_zero_is_no_error_for_the_controls_explanation(page):
    page.set(temperature=-1)
    fired = page.fire("temperature", "change")
    assert fired.errors == [] and "explain_controls" in fired.ran


@pytest.mark.parametrize("control, value, named", [
    ("max_new_tokens", float("nan"), "Max new tokens: nan is not a finite number; allowed: a whole number from 1 to 2048"),
    ("epsilon", "abc", "ε posterior threshold: 'abc' is not a number; allowed: a number from 0.01 to 0.5"),
    ("top_p", 0.0, "Top-p: 0.0 is out of range; allowed: a number from 0.01 to 1"),
    ("drafts", "both", "Drafts: 'both' is not a choice; allowed: hybrid, heads, ngram"),
])
def test_api_calls_with_bad_values_get_the_control_named_with_its_range_and_no_traceback(page, control, value, named):
    import gradio as gr

    page.set(**{control: value}, message="def add")
    fired = page.call("add_user")  # an API client's /add_user: refused, and its status output says why
    assert fired.errors == [] and named in fired.outputs[-1]["reply-status"]
    assert page.session.turns == []
    page.set(max_new_tokens=4, top_p=0.9, epsilon=0.09, drafts="hybrid")  # good values: the message is sent
    page.call("add_user")
    page.set(**{control: value})
    fired = page.call("respond")  # /respond called with other values than its /add_user: an error
    assert [type(e) for e in fired.raised] == [gr.Error], fired.errors
    assert named in fired.errors[0] and fired.raised[0].print_exception is False  # no traceback in the log


def test_an_api_message_that_is_not_text_is_refused_with_the_reason(page):
    page.set(message=5)
    fired = page.call("add_user")
    assert fired.errors == [] and any("Message: 5 is not text" in w for w in fired.warnings)
    assert page.session.turns == []


def test_the_step_api_names_a_value_that_is_not_a_number(page):
    import gradio as gr

    send(page, "def add")
    page.set(step_slider="abc")
    fired = page.call("show_step")
    assert [type(e) for e in fired.raised] == [gr.Error], fired.errors
    assert "Step of the latest reply: 'abc' is not a number" in fired.errors[0] and fired.raised[0].print_exception is False


def test_an_api_client_can_choose_a_tree_before_the_page_has_filled_the_tree_choices(page):
    page.set(tree="sparse_16")  # the dropdown has no choices until page_status runs
    fired = send(page, "def add")
    assert fired.errors == [] and page.session.turns[0].state == "done"
    assert "tree sparse_16" in page.session.turns[0].stats


def test_the_users_message_is_in_the_browsers_storage_before_its_reply_starts(page):
    page.set(message="def add")
    fired = page.call("add_user")  # the send's first event: the reply is queued after it
    stored = saved_updates(page, fired)
    assert stored and [t["user"] for t in stored[-1]] == ["def add"]


def test_a_reload_mid_reply_keeps_the_message_and_the_partial_reply_marked_stopped(engine, tmp_path):
    settings = AppSettings(data_dir=tmp_path / "data", max_new_tokens=40, tree="sparse_16", save_interval_s=0.0)
    page = Page(build_ui(engine, settings))
    page.set(seed=SEED, message="def add")
    page.call("add_user")
    updates = page.stream("respond")
    for _ in updates:
        if page.session.turns[0].reply.runs:
            break  # part of the reply has streamed
    following = page.stream("follow_reply")  # the event beside respond that keeps the conversation in the browser
    stored = next(u[page.saved_block._id] for u in following if isinstance(u.get(page.saved_block._id), list))
    following.close()
    updates.close()  # the page reloads here, mid-reply: the browser has what it stored so far
    assert stored[0]["user"] == "def add" and stored[0]["runs"]
    reloaded = page.reload()
    user, reply = (m["content"][0]["text"] for m in reloaded.call("restore_chat").outputs[-1]["chat"])
    assert "def add" in user and "(stopped)" in reply
    assert html.escape("".join(t for t, _ in stored[0]["runs"])) in reply


def test_a_message_too_long_for_the_context_is_refused_with_the_reason_and_never_stored(page, engine):
    text = "def add " * engine.model.max_context
    fired = send(page, text)
    assert fired.errors == []
    assert any("too long" in w and f"{engine.model.max_context}-token context" in w for w in fired.warnings), fired.warnings
    assert page.session.turns == [] and page.saved == []
    assert all(o.get("message") != "" for o in fired.outputs)  # kept in the box, to shorten


def test_a_message_of_only_zero_width_and_white_space_is_ignored_like_an_empty_one(page):
    fired = send(page, "\u200b\u200c \u2060\ufeff\n")
    assert fired.errors == [] and page.session.turns == []


def test_a_reply_that_ends_in_its_first_step_is_labelled_with_medusa_and_its_tree(page):
    page.set(max_new_tokens=1, tree="sparse_16")
    send(page, "def add")
    stats = page.session.turns[0].stats
    assert stats.startswith("1 token · ") and "Medusa off" not in stats and "tree sparse_16" in stats
