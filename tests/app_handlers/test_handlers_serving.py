"""How handlers share the model: the session state, one model queue, each reply's steps on one thread, the
outputs each event declares.

Handler-level tests of the app on a tiny random Llama with Medusa heads: no browser, no server. Handlers are
called as the page calls them; streaming handlers are iterated, and a Stop is either the Stop handler's flag or
closing the generator (what Gradio's ``cancels=`` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import time
from datetime import datetime, timezone

import pytest
import torch

from app import handlers
from app.engine import AHEAD, Engine
from app.handlers import CUSTOM_TREE
from app.handlers.generation import fit_prompt
from app.session import Session, Turn
from app.ui import build_ui

from .handler_support import reply_html, send


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
    following = [f for f in fns if f.name == "follow_reply"]  # beside each reply, on a queue of their own
    assert len(following) == 3 and {(f.concurrency_id, f.concurrency_limit, f.queue) for f in following} == {("beside", None, True)}
    cancelled = {i for i, f in enumerate(fns) if f in generating + following}
    cancellers = [f for f in fns if f.cancels]
    assert len(cancellers) == 3 and all(set(f.cancels) == cancelled for f in cancellers)  # Stop, Clear, trash icon
    finishing = [f for f in fns if f.name == "finish_reply"]  # after each reply, even one that failed
    assert {fns[f.trigger_after].name for f in finishing} == {"respond"} and len(finishing) == 3
    assert not any(f.trigger_only_on_success for f in finishing)
    streaming = [f for f in fns if inspect.isgeneratorfunction(f.fn)]  # outside the queue Gradio sends only the first update
    assert {f.name for f in streaming} >= {"respond", "follow_reply", "finish_reply", "compare"} and all(f.queue for f in streaming)
    assert all(not f.queue for f in fns if f.name in ("stop", "export_csv", "show_step"))  # run beside a reply
    asking = [f for f in fns if f.name in ("add_user", "regenerate", "edit_user")]  # queued, so their warnings reach the page
    assert len(asking) == 3 and {(f.concurrency_id, f.concurrency_limit, f.queue) for f in asking} == {("ask", None, True)}


def test_every_handler_returns_only_the_outputs_its_event_declares(engine, settings, controls):
    session = Session()
    returned: dict[str, set[str]] = {}

    def note(name, updates):
        returned.setdefault(name, set()).update(updates)

    note("page_status", handlers.page_status(engine, settings))
    note("add_user", handlers.add_user(engine, session, controls, "def add"))
    for u in handlers.respond(engine, settings, session, controls):
        note("respond", u)
    for u in handlers.finish_reply(engine, session, False):
        note("finish_reply", u)
    note("regenerate", handlers.regenerate(engine, session, controls))
    for u in handlers.respond(engine, settings, session, dataclasses.replace(controls, tree=CUSTOM_TREE, custom_tree="[[")):
        note("respond", u)
    for u in handlers.finish_reply(engine, session, False):
        note("finish_reply", u)
    handlers.regenerate(engine, session, controls)
    following = threading.Thread(target=lambda: [note("follow_reply", u) for u in handlers.follow_reply(engine, settings, session)])
    following.start()
    for u in handlers.respond(engine, settings, session, controls):
        note("respond", u)
    following.join(30)
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
        session = Session()  # Stop after the first step: at most AHEAD more are made, the reply keeps the first
        handlers.add_user(engine, session, controls, "def add")
        seen.clear(), closed.clear()
        for update in handlers.respond(engine, settings, session, controls):
            if seen:
                session.stop_requested.set()
        assert 1 <= len(seen) <= 1 + AHEAD and closed == [server]
        assert [r.stop_reason for r in session.rows] == ["stopped"]
    finally:
        engine.stop_serving()
        server.join(10)
    assert not server.is_alive()
    assert [item for item, _ in engine.steps(iter([1, 2]))] == [1, 2]  # no server: the caller's own thread


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
    assert [item for item, _ in result] == [1] and where == [server] and not server.is_alive()


@contextlib.contextmanager
def served(engine):
    """``engine`` served by a thread of its own, as ``launch.py``'s main thread serves it."""
    server = threading.Thread(target=engine.serve, name="engine-serve", daemon=True)
    server.start()
    try:
        yield server
    finally:
        engine.stop_serving()
        server.join(10)


def test_steps_are_made_ahead_while_their_reader_is_busy_and_stamped_when_made():
    # Gradio sends each update to the browser before it asks the handler for the next: in that time the serving
    # thread makes the next steps (at most AHEAD unread), so decoding does not wait for the page.
    engine, made = Engine("counting"), []

    def count():
        for i in range(3 * AHEAD):
            made.append(i)
            yield i

    with served(engine):
        steps = engine.steps(count())
        first, first_at = next(steps)
        deadline = time.monotonic() + 10
        while len(made) < 1 + AHEAD and time.monotonic() < deadline:  # the reader is busy
            time.sleep(0.01)
        time.sleep(0.1)
        assert first == 0 and len(made) == 1 + AHEAD  # made ahead, but no further
        reading = datetime.now(timezone.utc)
        rest = list(steps)
    assert [i for i, _ in rest] == list(range(1, 3 * AHEAD))
    stamps = [first_at] + [at for _, at in rest]
    assert stamps == sorted(stamps) and stamps[AHEAD] < reading  # stamped when made, not when read


def test_closing_steps_stops_the_making_on_the_server_and_errors_reach_the_reader():
    engine, where = Engine("closing"), {}

    def endless():
        try:
            i = 0
            while True:
                i += 1
                yield i
        finally:
            where["closed"] = threading.current_thread()

    def failing():
        yield 1
        raise ValueError("the step failed")

    with served(engine) as server:
        steps = engine.steps(endless())
        assert [next(steps)[0] for _ in range(3)] == [1, 2, 3]
        steps.close()
        assert where["closed"] is server
        failed = engine.steps(failing())
        assert next(failed)[0] == 1
        with pytest.raises(ValueError, match="the step failed"):
            next(failed)
        plain = engine.steps(iter([1, 2, 3]))  # an iterator without close()
        assert next(plain)[0] == 1
        plain.close()
        first, second = engine.steps(endless()), engine.steps(iter([10, 20]))  # two readers: both are served
        assert [next(first)[0], next(second)[0], next(first)[0], next(second)[0]] == [1, 10, 2, 20]
        first.close()
        assert list(second) == []
