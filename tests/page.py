"""A browser-less driver of the built page: fires an event as the browser does and runs it through
Gradio's own processing (pre-processing that validates input values, the handler, post-processing
that maps its outputs), then the events chained after it with ``.then`` / ``.success``.

This is what the handler tests cannot see: a handler result Gradio rejects ("didn't return enough
output values"), a control value a component rejects before any handler runs, and which chained
events still run after a failure.
"""

from __future__ import annotations

import asyncio
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import gradio as gr
from gradio.state_holder import SessionState

from app.session import Session


@dataclass
class Fired:
    """What one user action did: the handlers that ran, the errors and warnings the page showed."""

    ran: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # red "Error" toasts
    raised: list[Exception] = field(default_factory=list)  # the exceptions behind them
    warnings: list[str] = field(default_factory=list)  # yellow gr.Warning toasts
    outputs: list[dict[str, Any]] = field(default_factory=list)  # elem_id -> value, per update


class Page:
    """One browser tab on ``demo``: component values by ``elem_id`` and the tab's session state."""

    def __init__(self, demo: gr.Blocks):
        self.demo = demo
        self.state = SessionState(demo)
        self.by_id = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
        self.values: dict[int, Any] = {}
        self.session_block = next(b for b in demo.blocks.values() if isinstance(b, gr.State))
        self.saved_block = next(b for b in demo.blocks.values() if isinstance(b, gr.BrowserState))

    @property
    def session(self) -> Session:
        return self.state[self.session_block._id]

    @property
    def saved(self) -> Any:
        """The conversation the browser keeps (``gr.BrowserState``), as the page last received it."""
        return self.values.get(self.saved_block._id, [])

    def reload(self) -> "Page":
        """A new tab on the same page with this tab's browser storage (a reload), before any event."""
        page = Page(self.demo)
        page.values[self.saved_block._id] = self.saved
        return page

    def set(self, **values: Any) -> None:
        """Type or pick values, by elem_id with '-' written as '_' (e.g. ``max_new_tokens=5``)."""
        for name, value in values.items():
            self.values[self.by_id[name.replace("_", "-")]._id] = value

    def fire(self, elem_id: str, event: str, data: dict[str, Any] | None = None) -> Fired:
        """Trigger ``event`` ("click", "submit", ...) of the component ``elem_id``, with the event's
        ``data`` as the browser sends it (e.g. an edit's index and value), and every event chained
        after it; returns what happened."""
        block = self.by_id[elem_id]
        fired = Fired()
        first = [f for f in self.demo.fns.values() if (block._id, event) in [tuple(t) for t in f.targets] and f.fn]
        for fn in first:
            self._run(fn, fired, gr.EventData(block, data or {}))
        return fired

    def call(self, name: str) -> Fired:
        """Run only the event function ``name`` (e.g. ``"respond"``) with the current values, as an API
        client calling ``/name`` does: no event is chained after it."""
        fired = Fired()
        self._run(self._fn(name), fired, chain=False)
        return fired

    def stream(self, name: str) -> Iterator[dict[Any, Any]]:
        """The updates of the event function ``name`` one at a time, as the browser receives them while
        it streams (output elem_id or block id -> value); closing the iterator is a disconnect."""
        fn = self._fn(name)
        inputs = [self.values.get(b._id, self._payload(b)) for b in fn.inputs]
        iterator = None
        while True:
            out = asyncio.run(self.demo.process_api(fn, list(inputs), state=self.state, iterator=iterator))
            if iterator is not None and not out.get("is_generating"):
                return
            yield self._take(fn, out)
            iterator = out.get("iterator")
            if not out.get("is_generating"):
                return

    def _fn(self, name: str) -> Any:
        return next(f for f in self.demo.fns.values() if f.name == name and f.fn)

    def _run(self, fn: Any, fired: Fired, event_data: Any = None, chain: bool = True) -> None:
        inputs = [self.values.get(b._id, self._payload(b)) for b in fn.inputs]
        ok = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                asyncio.run(self._process(fn, inputs, fired, event_data))
                fired.ran.append(fn.name)
            except Exception as e:  # noqa: BLE001 - what the page shows as an error toast
                ok = False
                fired.errors.append(str(e))
                fired.raised.append(e)
        fired.warnings += [str(w.message) for w in caught if w.category is UserWarning]  # gr.Warning outside a server
        for after in self.demo.fns.values():
            if chain and after.trigger_after == fn._id and (ok or not after.trigger_only_on_success) and after.fn:
                self._run(after, fired)

    async def _process(self, fn: Any, inputs: list[Any], fired: Fired, event_data: Any) -> None:
        iterator = None
        while True:
            out = await self.demo.process_api(fn, list(inputs), state=self.state, iterator=iterator, event_data=event_data)
            if iterator is not None and not out.get("is_generating"):
                return  # the generator ended: this call carries no values
            fired.outputs.append(self._take(fn, out))
            iterator = out.get("iterator")
            if not out.get("is_generating"):
                return

    def _take(self, fn: Any, out: dict[str, Any]) -> dict[Any, Any]:
        """Apply one processed update to the page's values; returns it keyed by elem_id (else block id)."""
        for b, v in zip(fn.outputs, out["data"]):
            if not (isinstance(v, dict) and "__type__" in v):
                self.values[b._id] = v
            elif "value" in v:  # a property update that sets the value
                self.values[b._id] = v["value"]
        return {getattr(b, "elem_id", None) or b._id: v for b, v in zip(fn.outputs, out["data"])}

    def _payload(self, block: Any) -> Any:
        """A component's current value as the browser would send it."""
        value = getattr(self.state[block._id], "value", None)
        return None if callable(value) else value
