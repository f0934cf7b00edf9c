"""Page-level tests: user actions fired through Gradio's own event processing (``tests/page.py``), on
the built page with a tiny random model. They catch what handler tests cannot: results Gradio
rejects, control values a component rejects, and chained events that run after a failure."""

from __future__ import annotations

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


def test_sending_while_the_model_loads_says_so_and_keeps_the_message(settings):
    page = Page(build_ui(Engine("demo (nf4 backbone)"), settings))
    fired = send(page, "hello")
    assert fired.errors == []
    assert any("Loading demo" in w for w in fired.warnings)
    assert page.session.turns == []
    assert all(o.get("message") != "" for o in fired.outputs)  # the message stays in the box


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
    assert fired.errors and "-5" in fired.errors[0]
    assert page.session.turns == [] and "respond" not in fired.ran
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
    assert fired.errors == [] and fired.ran == ["edit_user", "respond"]
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
