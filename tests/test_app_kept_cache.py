"""The chat keeps each conversation's KV cache between turns (``Engine.conversation``): a later turn
reads only its new tokens and answers as a fresh chat would; a long message shows its reading's
progress, and Stop or Clear end the reading within one chunk. Handler-level, on the tiny model."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from app import handlers
from app.engine import KEPT_CONVERSATIONS, Engine
from app.handlers.generation import fit_prompt
from app.session import Session
from medusa_core.prefill import common_prefix
from app.settings import AppSettings


@pytest.fixture
def settings(tmp_path) -> AppSettings:
    return AppSettings(data_dir=tmp_path / "data", stream_interval_s=0.0, redraw_interval_s=0.0, max_new_tokens=16, prefill_chunk=8)


@pytest.fixture
def controls(settings) -> handlers.Controls:
    return dataclasses.replace(handlers.Controls.from_settings(settings), tree="sparse_16", system_prompt="be brief",
                               **handlers.GREEDY_PRESET)


@pytest.fixture
def reads(engine):
    """Tokens of every decoder pass while the test runs (prefill chunks and tree passes)."""
    passes: list[int] = []
    embed = engine.model.backbone.get_input_embeddings()
    hook = embed.register_forward_pre_hook(lambda _, args: passes.append(args[0].shape[1]))
    yield passes
    hook.remove()


def fresh_reply(engine, session, controls, index) -> str:
    ids, _ = fit_prompt(engine.model, controls, session.history(index), session.turns[index].user)
    tokens = [t for r in engine.model.generate(ids, max_new_tokens=controls.max_new_tokens, tree=controls.tree) for t in r.token_ids]
    return engine.model.tokenizer.decode(tokens, skip_special_tokens=True)


def send(engine, settings, session, controls, message) -> list[dict]:
    handlers.add_user(engine, session, controls, message)
    return list(handlers.respond(engine, settings, session, controls))


def test_a_later_turn_reads_only_its_new_tokens_and_answers_as_a_fresh_chat(engine, settings, controls, reads):
    session = Session()
    send(engine, settings, session, controls, "def add(a, b): return a + b")
    held = list(engine.conversation(session.id).token_ids)  # the first prompt and reply
    reads.clear()
    handlers.add_user(engine, session, controls, "add")
    stream = handlers.respond(engine, settings, session, controls)
    read = next(sum(reads) for update in stream if "chatbot" in update)  # the first token is out
    list(stream)
    ids = fit_prompt(engine.model, controls, session.history(1), "add")[0][0].tolist()
    assert read == len(ids) - min(common_prefix(held, ids), len(ids) - 1) < len(ids) // 2
    assert session.turns[1].reply.text == fresh_reply(engine, session, controls, 1)


def test_after_a_reply_stopped_while_steps_were_made_ahead_the_next_turn_answers_as_a_fresh_chat(engine, settings, controls):
    # launch.py's engine makes a reply's steps ahead of the page (Engine.steps): a Stop leaves tokens in the kept cache
    # that the chat never showed; the next turn's prompt does not match them and reads from where they differ.
    server = threading.Thread(target=engine.serve, name="engine-serve", daemon=True)
    server.start()
    try:
        session = Session()
        handlers.add_user(engine, session, controls, "def add(a, b): return a + b")
        ids = fit_prompt(engine.model, controls, [], session.turns[0].user)[0][0].tolist()
        kept = engine.conversation(session.id)
        for _ in handlers.respond(engine, settings, session, controls):
            if session.rows and not session.stop_requested.is_set():
                shown = sum(r.accepted_tokens for r in session.rows)
                deadline = time.monotonic() + 10
                while len(kept.token_ids) <= len(ids) + shown and time.monotonic() < deadline:
                    time.sleep(0.01)  # the serving thread makes the next steps meanwhile
                session.stop_requested.set()
        shown = sum(r.accepted_tokens for r in session.rows)
        assert session.turns[0].state == "stopped" and shown < controls.max_new_tokens
        assert len(kept.token_ids) > len(ids) + shown - 1  # steps made ahead, not shown
        send(engine, settings, session, controls, "add")
    finally:
        engine.stop_serving()
        server.join(10)
    assert session.turns[1].state == "done"
    assert session.turns[1].reply.text == fresh_reply(engine, session, controls, 1)


def test_a_long_message_shows_reading_progress_and_stop_ends_the_reading_within_a_chunk(engine, settings, controls, reads):
    session = Session()
    handlers.add_user(engine, session, controls, "def add(a, b): return a + b " * 6)
    stream = handlers.respond(engine, settings, session, controls)
    statuses = [next(stream)["reply_status"], next(stream)["reply_status"]]
    assert statuses[0] == "Reading your message… 0 %" and statuses[1].startswith("Reading your message… ")
    assert 0 < int(statuses[1].split()[-2]) < 100
    read_before_stop = sum(reads)
    session.stop_requested.set()  # what Stop (and Clear) do first
    rest = [*stream, *handlers.finish_reply(engine, session, False)]
    assert sum(reads) == read_before_stop  # not one more pass
    turn = session.turns[0]
    assert turn.state == "stopped" and not session.busy and not session.reply_rows(turn.reply_index)
    assert rest[-1]["reply_status"] == "Latest reply: stopped before it started."
    assert len(engine.conversation(session.id).token_ids) == read_before_stop  # kept for the next turn


def test_clear_frees_the_conversations_cache_and_only_the_latest_conversations_keep_one(engine, settings, controls):
    sessions = [Session() for _ in range(KEPT_CONVERSATIONS + 1)]
    for session in sessions:
        send(engine, settings, session, controls, "def add")
    kept = engine.conversation(sessions[-1].id)
    assert kept.nbytes > 0
    handlers.clear(engine, sessions[-1])
    assert kept.nbytes == 0 and engine.conversation(sessions[-1].id).token_ids == []
    assert engine.conversation(sessions[0].id).token_ids == []  # the oldest conversation's cache was dropped


def test_each_kept_conversation_stays_within_the_memory_setting_and_still_answers_as_a_fresh_chat(engine, settings, controls):
    config = engine.model.config
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4  # float32 K and V
    budget = AppSettings(kept_cache_mb=40 * per_token / 1e6).kept_cache_mb
    small = Engine.of(engine.model, kept_cache_mb=budget)
    session = Session()
    for message in ("def add(a, b): return a + b " * 4, "add", "and sub?"):
        send(small, settings, session, controls, message)
        assert small.conversation(session.id).nbytes <= budget * 1e6
        assert len(small.conversation(session.id).token_ids) == 40
    assert session.turns[-1].reply.text == fresh_reply(small, session, controls, len(session.turns) - 1)


def test_the_memory_setting_refuses_a_negative_value_naming_it():
    with pytest.raises(ValueError, match="kept_cache_mb.*-1"):
        AppSettings.from_cli(["--kept-cache-mb", "-1"])


def test_compare_shows_each_runs_prompt_reading_and_stop_ends_it_within_a_chunk(engine, settings, controls, reads):
    session = Session()
    send(engine, settings, session, controls, "def add(a, b): return a + b " * 6)
    reads.clear()
    stream = handlers.compare(engine, settings, session, controls)
    first = next(stream)["compare_result"]
    assert "| Medusa off (reading the prompt… 0 %) |" in first
    second = next(stream)["compare_result"]
    assert "| Medusa off (reading the prompt… " in second and sum(reads) == settings.prefill_chunk
    session.stop_requested.set()
    final = list(stream)[-1]["compare_result"]
    assert sum(reads) == settings.prefill_chunk  # not one more pass
    assert "Stopped before every run finished" in final and not session.busy
