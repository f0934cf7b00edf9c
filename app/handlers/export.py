"""Export: the session's step statistics as CSV, and the conversation as a Markdown or JSON
transcript; each is saved under the user data folder, and the page downloads it."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from ..engine import Engine
from ..session import Session
from ..settings import AppSettings
from ..stats import StepRow, write_csv
from ..text import template_system_prompt
from .views import Updates


def export_csv(settings: AppSettings, session: Session) -> Updates:
    """Write the session's steps so far to CSV under the user data folder; the page downloads it."""
    rows: Sequence[StepRow] = list(session.rows)  # a snapshot: a streaming reply may append meanwhile
    path = write_csv(rows, _export_path(settings, session, "csv"))
    return {"export_file": str(path), "export_path": f"Saved {len(rows)} steps to `{path}`"}


def export_transcript(engine: Engine, settings: AppSettings, session: Session, system_prompt: str, fmt: str) -> Updates:
    """Write the conversation so far as ``fmt`` ("md" or "json"): the system prompt the model saw (an
    empty box: the chat template's own), messages as plain text, each reply's stats line, the model's
    name; the page downloads it."""
    model = engine.model.name if engine.model is not None else engine.description
    if not system_prompt.strip() and engine.model is not None:
        system_prompt = template_system_prompt(engine.model.tokenizer) or ""
    exported = datetime.now(timezone.utc).isoformat(timespec="seconds")
    turns = list(session.turns)  # a snapshot: a streaming reply keeps growing
    if fmt == "json":
        messages = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
        for t in turns:
            messages.append({"role": "user", "content": t.user})
            if t.state != "pending":
                messages.append({"role": "assistant", "content": t.reply.text, "state": t.state, "stats": t.stats, "error": t.error, "note": t.note})
        text = json.dumps({"model": model, "session_id": session.id, "exported": exported, "messages": messages}, ensure_ascii=False, indent=2)
    else:
        lines = ["# medusa-chat transcript", "", f"Model `{model}` · session {session.id} · exported {exported}", ""]
        if system_prompt.strip():
            lines += ["## System", "", system_prompt.strip(), ""]
        for t in turns:
            lines += ["## User", "", _fenced(t.user), ""]
            if t.state != "pending":
                lines += ["## Assistant", "", _fenced(t.reply.text)]
                lines += [f"*{note}*" for note in (t.stats, "(stopped)" if t.state == "stopped" else "", t.error, t.note) if note]
                lines.append("")
        text = "\n".join(lines)
    path = _export_path(settings, session, fmt)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    messages = sum(2 if t.state != "pending" else 1 for t in turns)  # each user message and each reply
    return {"export_file": str(path), "export_path": f"Saved the transcript ({messages} message{'' if messages == 1 else 's'}) to `{path}`"}


def _fenced(text: str) -> str:
    """``text`` as a Markdown code block whose fence no line of the text can close."""
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}\n{text}\n{fence}"


def _export_path(settings: AppSettings, session: Session, suffix: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return settings.exports_dir / f"medusa-chat-{session.id}-{stamp}.{suffix}"
