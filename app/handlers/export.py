"""Export: the session's step statistics as CSV, saved under the user data folder and downloaded."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Sequence

from ..session import Session
from ..settings import AppSettings
from ..stats import StepRow, write_csv
from .views import Updates


def export_csv(settings: AppSettings, session: Session) -> Updates:
    """Write the session's steps so far to CSV under the user data folder; the page downloads it."""
    rows: Sequence[StepRow] = list(session.rows)  # a snapshot: a streaming reply may append meanwhile
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = write_csv(rows, settings.exports_dir / f"medusa-chat-{session.id}-{stamp}.csv")
    return {"csv_file": str(path), "csv_path": f"Saved {len(rows)} steps to `{path}`"}

