"""Per-browser-session state, kept in ``gr.State``: the conversation, the session's step statistics,
the last reply's step records (for the step slider), and the flags that let Stop end a reply cleanly.

Handlers mutate the ``Session`` in place, so a reply that Stop cancels keeps every step it finished.
"""

from __future__ import annotations

import copy
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from medusa_core import StepRecord

from .stats import StepRow
from .text import ReplyText

#: Turn states: waiting for the model, streaming, finished, stopped by the user, or failed.
TURN_STATES = ("pending", "streaming", "done", "stopped", "error")


@dataclass
class Turn:
    """One user message and the model's reply to it."""

    user: str
    reply: ReplyText = field(default_factory=ReplyText)
    state: str = "pending"
    error: str = ""  # shown under the reply when state == "error"
    refused: str = ""  # why the reply could not start (a control value, the tree, the prompt's length): shown beside the tree too
    note: str = ""  # shown under the reply, e.g. that earlier turns were left out of the prompt
    reply_index: int | None = None  # the reply's index in the session statistics
    tree: str = ""  # the tree the reply was asked to use (its name); "" with Medusa off
    sent_at: float | None = None  # time.monotonic() of the send (or Regenerate / edit) that asked for this reply
    first_token_at: float | None = None  # when the reply's first token was decoded (TTFT = first_token_at - sent_at)
    last_token_at: float | None = None  # when its latest token was decoded (wall time = last_token_at - sent_at)
    stats: str = ""  # the finished reply's stats line, kept with the conversation (it survives a page reload)
    waits_for_model: bool = False  # sent while the model loaded: answered once it is ready, at the controls it then shows
    #: The finished reply's chat message as last rendered, with what it was rendered from (``handlers.views.chat_view``).
    shown: tuple[tuple[Any, ...], str] | None = field(default=None, repr=False, compare=False)

    def saved(self) -> dict[str, Any]:
        """The turn as JSON-able data for the browser's storage (timings are this process's clock: left out)."""
        return {"user": self.user, "runs": [list(r) for r in self.reply.runs], "state": self.state, "error": self.error,
                "note": self.note, "stats": self.stats}

    @classmethod
    def restored(cls, data: dict[str, Any]) -> "Turn":
        """A turn from ``saved()`` data; a reply that was still running when saved counts as stopped."""
        state = data.get("state", "done")
        return cls(
            user=str(data["user"]), reply=ReplyText([(str(t), bool(f)) for t, f in data.get("runs", [])]),
            state=state if state in ("done", "stopped", "error") else "stopped",
            error=str(data.get("error", "")), note=str(data.get("note", "")), stats=str(data.get("stats", "")),
        )


class Session:
    """One browser session: conversation, statistics and the stop/idle flags of its running reply.

    ``gr.State`` deep-copies its initial value per session; ``__deepcopy__`` gives the copy fresh
    threading primitives (they cannot be copied).
    """

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:8]
        self.turns: list[Turn] = []
        self.rows: list[StepRow] = []  # every step of every reply, in order
        self.replies = 0  # replies started so far (chat and compare), numbering StepRow.reply_index
        self.last_records: list[StepRecord] = []  # steps of the latest reply, for the step slider
        self.reply_tokens: list[list[int]] = []  # token ids of the latest chat replies: the n-gram drafts' session index
        self.last_labels: dict[int, str] = {}  # token id -> label, for the latest reply's trees
        self.compare_runs: dict[str, list[StepRecord]] | None = None  # the latest Compare's runs so far, by mode
        self.answered: Turn | None = None  # the turn ``respond`` took up, until ``finish_reply`` shows how it ended
        self.followed: Turn | None = None  # the turn whose reply ``follow_reply`` follows (or followed)
        self.adopted = False  # whether this session has taken the conversation kept in the browser
        self.stop_requested = threading.Event()
        self.idle = threading.Event()
        self.idle.set()

    def __deepcopy__(self, memo: dict) -> "Session":
        new = Session()
        for name in ("turns", "rows", "replies", "last_records", "last_labels", "compare_runs", "reply_tokens"):
            setattr(new, name, copy.deepcopy(getattr(self, name), memo))
        return new

    @property
    def busy(self) -> bool:
        """True while a reply or a comparison runs for this session."""
        return not self.idle.is_set()

    def new_reply(self) -> int:
        """The index of a new reply in the statistics (``StepRow.reply_index``)."""
        self.replies += 1
        return self.replies - 1

    def reply_rows(self, reply_index: int) -> list[StepRow]:
        """The steps of one reply."""
        return [r for r in self.rows if r.reply_index == reply_index]

    def begin(self) -> None:
        """A reply or comparison starts: the session is busy and an earlier Stop no longer applies."""
        self.stop_requested.clear()
        self.idle.clear()

    def end(self) -> None:
        """The reply or comparison ended (finished, stopped, cancelled or failed)."""
        self.idle.set()

    def saved(self) -> list[dict[str, Any]]:
        """The conversation as JSON-able data, for ``gr.BrowserState`` (it survives a page reload). A
        message waiting for its reply and a reply still streaming are kept too: after a reload they
        show as stopped (``Turn.restored``)."""
        return [t.saved() for t in self.turns]

    def adopt(self, saved: Any) -> None:
        """Take the conversation kept in the browser (``saved()`` data), once, if this session has none.

        Every event of a page that reads the session adopts first: Gradio can run a page's first
        events on a state of their own (the page-load event that shows the restored chat, in
        Gradio 6.31), so the session that later events see may not be the one that showed it.
        """
        if not self.adopted:
            self.adopted = True
            if not self.turns:
                self.restore(saved)

    def restore(self, saved: Any) -> None:
        """Replace the conversation with ``saved()`` data from the browser; anything unreadable is ignored."""
        try:
            self.turns = [Turn.restored(t) for t in saved] if isinstance(saved, list) else []
        except (TypeError, KeyError, ValueError, AttributeError):  # not what saved() writes: start afresh
            self.turns = []

    def history(self, before: int) -> list[tuple[str, str]]:
        """(user, reply) pairs of the turns before index ``before`` that reached the model (not failed ones)."""
        return [(t.user, t.reply.text) for t in self.turns[:before] if t.state in ("done", "stopped")]

