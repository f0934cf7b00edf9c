"""Chat handlers: send (add the user's message, then stream the reply), Stop, Regenerate, Clear,
the step slider and the highlight toggle.

A reply is three events of the page, so that each streamed update names few outputs: Gradio rebuilds every
output an update leaves out (``gr.skip()``: the component constructed again and its config recomputed, with the
GIL held; ~3 ms for the chat, less for the others), and with all of the reply's outputs in one event that took a
sixth of decoding's speed in the page (docs/APP.md, "One reply, three events"):

- ``respond`` runs the engine and streams the chat text every ``settings.stream_interval_s``: outputs ``chatbot``
  and ``reply_status``;
- ``follow_reply`` runs beside it: the tree every ``settings.redraw_interval_s``, the speed chart and summary
  every ``SPEED_REDRAWS`` tree redraws, the conversation into the browser's storage every ``settings.save_interval_s``;
- ``finish_reply`` runs after it: the final tree and step slider, the model panel, the stats line, Send.

The engine keeps decoding between updates.
"""

from __future__ import annotations

import dataclasses
import html
import logging
import math
import time
from contextlib import closing
from datetime import datetime
from typing import Any, Generator, Iterator

import gradio as gr
from jinja2 import TemplateError

from medusa_core import ReadProgress, StepRecord

from ..charts import tree_figure
from ..engine import Engine
from ..session import Session, Turn
from ..settings import AppSettings
from ..text import ReplyText, is_blank, plain_text
from .compare import compare_table
from .controls import Controls, ready_controls, sampling_config, tree_argument
from .generation import fit_prompt, record_steps, too_long
from .views import (
    SPEED_REDRAWS, STREAMING_SLIDER, WAITING_FOR_LOAD, Updates, chat_view, labels, live_view, message_turn, model_panel,
    reading_status, reply_status, speed_view, tree_view, turn_stats,
)

log = logging.getLogger(__name__)

STOP_WAIT_S = 30.0  # how long Stop and Clear wait for a running reply to finish its current step
LOAD_POLL_S = 0.5  # how often a message sent while the model loads updates its status line


FOLLOW_POLL_S = 0.05  # the shortest wait of follow_reply between two looks at the reply
SEND_OFF = gr.Button(interactive=False)  # Send while a reply is pending or streaming
SEND_ON = gr.Button(interactive=True)
#: Why a send or Regenerate is refused; shown as a warning, and nothing else changes.
STILL_STREAMING = "A reply is still streaming: your message stays in the box; send it when the reply ends, or press Stop (Esc)."
STILL_LOADING = ("Your last message is still waiting for the model to load: this one stays in the box; send it once "
                 "that reply ends, or press Stop (Esc).")
NOTHING_TO_REGENERATE = "Nothing to regenerate: send a message first."


def add_user(engine: Engine, session: Session, controls: Controls, message: str) -> Updates:
    """Append the user's message (Enter or Send) and keep it in the browser's storage before the
    reply starts. Empty messages (white space and invisible characters only) are ignored; while a reply
    runs, after the model failed to load, or for a message too long for the context, the message stays in
    the box and a warning says why. While the model loads the message joins the conversation and waits:
    ``respond`` answers it once the model is ready.

    The send event reads the controls too, so a value a control rejects (e.g. seed −5) rejects the
    whole send before the message joins the conversation.
    """
    if message is not None and not isinstance(message, str):  # an API call: the page sends text
        gr.Warning(f"Message: {message!r} is not text; send a string")
        return {"message": gr.skip()}
    text = (message or "").strip()
    if is_blank(text):
        return {"message": ""}
    loading = engine.loading  # read once: the load may end meanwhile
    refused = _refusal(engine, session, loading_ok=True) or ("" if loading else too_long(engine.model, controls, text))
    if refused:
        gr.Warning(refused)
        return {"message": gr.skip()}
    session.turns.append(Turn(user=text, sent_at=time.monotonic(), waits_for_model=loading))
    return {"message": "", "chatbot": chat_view(session, controls.highlight), "reply_status": reply_status(session), "send": SEND_OFF,
            "saved": session.saved(), "step_slider": STREAMING_SLIDER}


def _refusal(engine: Engine, session: Session, loading_ok: bool = False) -> str:
    """Why a new reply cannot start now ("" when it can); with ``loading_ok`` a model still loading is no reason."""
    if not engine.ready and not (loading_ok and engine.loading):
        return engine.status()
    if any(t.state == "pending" and t.waits_for_model for t in session.turns):
        return STILL_LOADING
    if session.busy or any(t.state == "pending" for t in session.turns):
        return STILL_STREAMING
    return ""


#: The note under a reply that asked for corpus drafts before the model's own replies were indexed (a first start
#: indexes them in the background after ``ready``, ~12 s on the demo in a process of its own: the reply does not
#: wait for them).
CORPUS_PENDING = ("Drafted by the heads alone: the model's own replies are still being indexed for corpus drafts (a first "
                  "start, a few seconds); later replies use them.")


def waiting_turn(session: Session) -> int | None:
    """The index of the user message waiting for its reply (None: nothing to answer, e.g. the send was refused)."""
    return next((i for i, t in enumerate(session.turns) if t.state == "pending"), None)


def respond(engine: Engine, settings: AppSettings, session: Session, controls: Controls) -> Iterator[Updates]:
    """Stream the reply to the pending user message: the chat text and the status line (the live tree and speed
    chart beside it are ``follow_reply``'s, the final view ``finish_reply``'s).

    A message sent while the model loaded first waits for it (the status line says so, Stop ends the wait), then
    is answered at the controls the page shows once the model is ready (``ready_controls``), its TTFT counted from
    then; a load that fails leaves the message in the chat with the reason. A reply that asks for corpus drafts before the
    model's own replies are indexed (a first start) drafts with the heads alone, with a note (``CORPUS_PENDING``); one
    that asks for drafter + corpus drafts with the drafter alone until then."""
    index = waiting_turn(session)
    if index is None or session.busy:  # the send was refused: nothing to answer
        yield {"reply_status": gr.skip()}
        return
    turn = session.answered = session.turns[index]
    if turn.waits_for_model:
        if not (yield from _wait_for_model(engine, session, turn)):
            return  # finish_reply shows why
        controls = ready_controls(controls, settings, engine.model)
        turn.waits_for_model, turn.sent_at = False, time.monotonic()
    elif engine.model is None:  # no model (and the send was not queued): nothing to answer
        yield {"reply_status": gr.skip()}
        return
    model = engine.model
    notes = []
    if controls.medusa and controls.drafts in ("corpus", "eagle") and model.has_corpus and not model.corpus_ready:
        model.index_corpus_in_background()  # under way since ready (launch.py), or from here
        if controls.drafts == "corpus":  # (the drafter drafts alone meanwhile: generate does not wait for the index)
            controls = dataclasses.replace(controls, drafts="heads")  # not a wait of seconds for the first token
            notes.append(CORPUS_PENDING)
    try:
        tree = tree_argument(model, controls.tree, controls.custom_tree) if controls.medusa else None
        turn.tree = model.resolve_tree(tree or model.default_tree)[0] if controls.medusa else ""
        ids, dropped = fit_prompt(model, controls, session.history(index), turn.user)
        steps = engine.steps(model.generate(
            ids,
            max_new_tokens=controls.max_new_tokens,
            tree=tree,
            config=sampling_config(controls),
            posterior_threshold=controls.posterior_threshold,
            posterior_alpha=controls.posterior_alpha,
            medusa=controls.medusa,
            drafts=controls.drafts,
            earlier_replies=session.reply_tokens,
            seed=controls.seed,
            sampling=controls.sampling,
            kept=engine.conversation(session.id),
            progress=True,
            prefill_chunk=settings.prefill_chunk,
        ))  # its steps on the thread that serves the model's work (Engine.serve)
    except (ValueError, TemplateError) as e:  # too-long prompt, invalid tree, bad control value, template error
        turn.state, turn.error, turn.refused = "error", f"Not sent: {e}", str(e)
        return  # finish_reply shows why, in the chat and beside the tree
    if dropped:
        notes.append(f"{dropped} earlier turn{'s' if dropped > 1 else ''} left out to fit the {model.max_context}-token context")
    turn.note = " ".join(notes)
    turn.state, turn.reply = "streaming", ReplyText()
    session.begin()
    try:
        yield from _stream(engine, settings, session, controls, steps, turn)
    finally:  # also when Stop cancels this generator
        if turn.state == "streaming":
            turn.state = "stopped"
        turn.stats = turn_stats(session, turn)
        session.end()


def finish_reply(engine: Engine, session: Session, highlight: bool) -> Iterator[Updates]:
    """After ``respond`` ended (the page chains it with ``.then``): the final view of the reply in one update: the
    tree at its last tree step, the step slider over the reply's steps, the speed chart, the model panel, the chat
    with the stats line, Send enabled and the conversation in the browser's storage; a reply that could not start
    names the reason beside the tree too. One update, not several shorter ones: when this event's updates came
    three in a row, Chromium at times kept the step slider as the send had parked it (4 of 15 short replies; none
    of 45 with one update; scratch ``slider.py``). Changes nothing while a
    reply still runs, and nothing when ``respond`` took up no message (a refused send, a rejected control value).
    The speed chart and summary are drawn here too: ``follow_reply`` may have started after a short reply ended."""
    answered, session.answered = session.answered, None
    if answered is None or session.busy:
        yield {"send": gr.skip()}
        return
    refused = {"tree_status": f"⚠ {html.escape(answered.refused)}"} if answered.refused else {}
    yield {**live_view(engine, session, final=True), "model_panel": model_panel(engine, session), "chatbot": chat_view(session, highlight),
           "reply_status": reply_status(session), "send": SEND_ON, "saved": session.saved(), **refused}


def follow_reply(engine: Engine, settings: AppSettings, session: Session) -> Iterator[Updates]:
    """Beside ``respond`` (the page starts both after a send), the live view of the reply to the waiting message:
    the tree of its latest step every ``settings.redraw_interval_s`` (when a step was added), the session's speed
    chart and summary once every ``SPEED_REDRAWS`` of those, and the conversation in the browser's storage every
    ``settings.save_interval_s`` (the partial reply survives a reload or a lost connection); the speed chart and the
    conversation once more when the reply ends, so the last of these updates the page receives is the final one.
    Tree and speed chart go out as separate updates: the browser renders each as its own, shorter task (one update
    with all of them stalled the page 2-3× longer). Follows the latest reply that waits or streams (``respond`` may
    have started it first), once: a send refused while a reply streams does not follow that reply a second time.
    Waits with the reply (for the model to load, too); ends when the reply ends, Stop stops it or Clear empties the
    chat."""
    turn = next((t for t in reversed(session.turns) if t.state in ("pending", "streaming")), None)
    if turn is None or turn is session.followed:  # nothing to follow (a short reply may have ended: finish_reply draws it)
        yield {"saved": gr.skip()}
        return
    session.followed = turn

    def running() -> bool:
        return turn.state in ("pending", "streaming") and any(t is turn for t in session.turns)

    def latest_step() -> StepRecord | None:
        """The reply's latest step (None before its first: ``session.last_records`` may still be the previous reply's)."""
        rows, records = session.rows, session.last_records
        return records[-1] if records and rows and rows[-1].reply_index == turn.reply_index else None

    tree_due = speed_due = save_due = time.monotonic()
    drawn, drawn_rows = None, len(session.rows)
    while running():
        now = time.monotonic()
        step = latest_step()
        if now >= tree_due and step is not None and step is not drawn:
            drawn, tree_due = step, now + settings.redraw_interval_s
            yield {"tree_plot": tree_view(engine, session)}
        update = {}
        if now >= speed_due and step is not None and len(session.rows) != drawn_rows:
            drawn_rows, speed_due = len(session.rows), now + SPEED_REDRAWS * settings.redraw_interval_s
            update |= speed_view(engine, session)
        if now >= save_due and turn.state == "streaming":
            save_due = now + settings.save_interval_s
            update["saved"] = session.saved()
        if update:
            yield update
        wait = max(min(tree_due, speed_due, save_due) - time.monotonic(), FOLLOW_POLL_S)
        if session.busy:  # the reply runs: wake when it ends
            session.idle.wait(wait)
        else:  # not started yet (the model may be loading)
            time.sleep(min(wait, LOAD_POLL_S))
    yield speed_view(engine, session) | {"saved": session.saved()}


def _wait_for_model(engine: Engine, session: Session, turn: Turn) -> Generator[Updates, None, bool]:
    """Yield the status line while the model loads; return True once it is ready with ``turn`` still waiting, False
    when the load failed (the turn then shows why) or Stop or Clear ended the wait."""
    def waiting() -> bool:
        return turn.state == "pending" and any(t is turn for t in session.turns)

    while engine.loading and waiting():
        yield {"reply_status": f"{WAITING_FOR_LOAD} {engine.status()}"}
        engine.wait(LOAD_POLL_S)
    if engine.model is None and waiting():
        turn.state, turn.error = "error", f"Not sent: {engine.status()}"
    return engine.model is not None and waiting()


def _stream(
    engine: Engine,
    settings: AppSettings,
    session: Session,
    controls: Controls,
    steps: Iterator[tuple[StepRecord | ReadProgress, datetime]],
    turn: Turn,
) -> Iterator[Updates]:
    """Record the reply's steps and yield throttled page updates; failures end up in the chat."""
    last_chat = 0.0
    try:
        turn.reply_index = session.new_reply()
        with closing(record_steps(engine, session, steps, controls, "chat", turn.reply_index, turn.reply)) as records:
            for record in records:
                if isinstance(record, ReadProgress):  # a long prompt is being read: no token yet
                    yield {"reply_status": reading_status(record)}
                    continue
                now = turn.last_token_at = time.monotonic()
                if turn.first_token_at is None:
                    turn.first_token_at = now
                if now - last_chat >= settings.stream_interval_s:
                    first = {"reply_status": reply_status(session)} if last_chat == 0.0 else {}  # "Generating…"
                    last_chat = now
                    yield {"chatbot": chat_view(session, controls.highlight), **first}
        rows = session.reply_rows(turn.reply_index)  # none when Stop came while the prompt was read
        turn.state = "stopped" if not rows or rows[-1].stop_reason == "stopped" else "done"
    except Exception as e:  # noqa: BLE001 - any failure inside the model is shown in the chat; the app keeps serving
        log.exception("generation failed")
        turn.state, turn.error = "error", f"Generation failed: {type(e).__name__}: {e}"


def stop(engine: Engine, session: Session, highlight: bool) -> Updates:
    """Stop the running reply after its current step, keeping everything streamed so far."""
    session.stop_requested.set()
    session.idle.wait(STOP_WAIT_S)
    for turn in session.turns:
        if turn.state == "pending":  # cancelled while waiting for the model
            turn.state = "stopped"
    compare = {} if session.compare_runs is None else {"compare_result": compare_table(session.compare_runs, running=None)}
    return {
        **compare,
        "send": SEND_ON,
        "saved": session.saved(),
        "chatbot": chat_view(session, highlight),
        **live_view(engine, session, final=True),
        "model_panel": model_panel(engine, session),
        "reply_status": reply_status(session),
    }


def regenerate(engine: Engine, session: Session, controls: Controls) -> Updates:
    """Drop the last reply and mark its user message pending (``respond`` runs next). Like a send,
    the event reads the controls, so a rejected control value leaves the reply in place."""
    refused = _refusal(engine, session) or ("" if session.turns else NOTHING_TO_REGENERATE)
    if refused:
        gr.Warning(refused)
        return {"reply_status": gr.skip()}
    session.turns[-1] = Turn(user=session.turns[-1].user, sent_at=time.monotonic())
    return {"chatbot": chat_view(session, controls.highlight), "reply_status": reply_status(session), "send": SEND_OFF,
            "saved": session.saved(), "step_slider": STREAMING_SLIDER}


def edit_user(engine: Engine, session: Session, controls: Controls, index: int, value: str) -> Updates:
    """Edit and resend a user message (the chat's pencil): the conversation from that message on is
    replaced by the edited message, and ``respond`` answers it next. Refused (with the reason) while
    a reply runs or the model loads, or for an empty or too long message; the chat then shows the old text again."""
    turn_index = message_turn(session, index)
    text = plain_text(value).strip()
    refused = _refusal(engine, session) or ("An empty message cannot be sent." if is_blank(text) else too_long(engine.model, controls, text))
    if turn_index is None:
        refused = refused or "Only your own messages can be edited."
    if refused:
        gr.Warning(refused)
        return {"chatbot": chat_view(session, controls.highlight)}
    del session.turns[turn_index:]
    session.turns.append(Turn(user=text, sent_at=time.monotonic()))
    return {"chatbot": chat_view(session, controls.highlight), "reply_status": reply_status(session), "send": SEND_OFF,
            "saved": session.saved(), "step_slider": STREAMING_SLIDER}


def restore_chat(session: Session, saved: Any, highlight: bool) -> Updates:
    """On page load: the conversation kept in the browser (``gr.BrowserState``), e.g. after a reload."""
    session.adopt(saved)
    if not session.turns:
        return {"chatbot": gr.skip()}
    return {"chatbot": chat_view(session, highlight), "reply_status": reply_status(session)}


def clear(engine: Engine, session: Session) -> Updates:
    """Stop any running reply and empty the conversation. The session's statistics are kept."""
    session.stop_requested.set()
    session.idle.wait(STOP_WAIT_S)
    engine.forget(session.id)
    session.turns.clear()
    session.adopted = True  # a cleared chat stays empty: nothing to take from the browser any more
    session.last_records = []
    return {"chatbot": [], "message": "", "reply_status": "", **live_view(engine, session), "send": SEND_ON, "saved": []}


def show_step(engine: Engine, session: Session, step: float | None) -> Updates:
    """The candidate tree of one step of the latest reply (the step slider: drag, arrow keys or a typed
    number). The value arrives unchecked: one out of range shows the nearest step, and the slider
    moves there too. Raises ``gr.Error`` naming the control for a value that is not a number (an API
    call)."""
    records = session.last_records
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step)):
        last = f"0 to {len(records) - 1}" if records else "0 (no reply yet)"
        raise gr.Error(f"Step of the latest reply: {step!r} is not a number; allowed: a whole number from {last}", print_exception=False)
    if not records or step is None:
        return {"tree_plot": gr.skip()}
    shown = min(max(int(step), 0), len(records) - 1)
    updates: Updates = {"tree_plot": tree_figure(records[shown], labels(engine, session, records[shown]))}
    if shown != step:
        updates["step_slider"] = shown
    return updates


def rerender_chat(session: Session, highlight: bool) -> Updates:
    """Re-render the chat (the highlight toggle)."""
    return {"chatbot": chat_view(session, highlight)}

