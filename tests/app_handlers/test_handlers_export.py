"""Exports: the session's statistics as CSV (while a reply streams too) and the transcripts.

Handler-level tests of the app on a tiny random Llama with Medusa heads: no browser, no server. Handlers are
called as the page calls them; streaming handlers are iterated, and a Stop is either the Stop handler's flag or
closing the generator (what Gradio's ``cancels=`` does).
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from app import handlers
from app.session import Session
from app.stats import CSV_COLUMNS

from .handler_support import send


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


def test_the_transcript_message_count_counts_each_user_message_and_each_reply(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls, "def add")
    send(engine, settings, session, controls, "return")
    assert "Saved the transcript (4 messages)" in handlers.export_transcript(engine, settings, session, "", fmt="md")["export_path"]
