"""The one model every browser session shares, its loading state, and the KV caches of the latest
conversations, kept between their turns (``medusa_core.ConversationCache``).

``launch.py`` starts serving first and loads the model afterwards, so the page can show the load
progress; until ``ready`` a sent message waits for it (``handlers.respond``) and the other chat handlers answer
with the loading status. Then its main thread, which loaded the model, runs every reply's steps (``serve``,
``steps``): all of the model's work on one thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterator, TypeVar

from medusa_core import ConversationCache, MedusaModel
from medusa_core.lean import build as lean_build

#: Conversations whose KV cache the engine keeps between turns (the most recently used ones): each
#: within the engine's ``kept_cache_mb`` (without a limit, up to the context window's entries: on the
#: demo 46 kB per token, 0.38 GB at 8,192 tokens).
KEPT_CONVERSATIONS = 2

T = TypeVar("T")


class Engine:
    """A ``MedusaModel`` that may still be loading.

    Args:
        description: what is being loaded, e.g. ``"demo (nf4) on auto"``; shown while loading.
        kept_cache_mb: memory in MB each kept conversation's KV cache may hold between turns
            (``ConversationCache(max_bytes=)``); None: no limit.
        served: a thread will run ``serve`` (``launch.py``'s main thread, once the model is loaded): ``steps`` hands
            work over from the start, and it waits for that thread; otherwise only while one serves.
    """

    def __init__(self, description: str, kept_cache_mb: float | None = None, served: bool = False):
        self.description = description
        self.kept_cache_bytes = None if kept_cache_mb is None else int(kept_cache_mb * 1e6)
        self.model: MedusaModel | None = None
        self.error: str | None = None
        self.load_seconds: float | None = None
        self._started = time.monotonic()
        self._done = threading.Event()
        self._kept: OrderedDict[str, ConversationCache] = OrderedDict()
        self._kept_lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # ``steps``' calls, for ``serve``
        self._server: threading.Thread | None = None  # the thread in ``serve``, if one is
        self._served = served  # whether ``steps`` hands work over (a thread serves, or will)

    @classmethod
    def of(cls, model: MedusaModel, kept_cache_mb: float | None = None) -> "Engine":
        """An engine around an already loaded model (tests, notebooks)."""
        engine = cls(model.name, kept_cache_mb)
        engine.model, engine.load_seconds = model, 0.0
        engine._done.set()
        return engine

    def load(self, loader: Callable[[], MedusaModel]) -> MedusaModel:
        """Run ``loader`` in this thread and keep its model; on failure keep the message and re-raise."""
        self._started = time.monotonic()
        try:
            model = loader()
            if model.tokenizer is None:
                raise ValueError(f"{model.name} has no tokenizer: the chat needs one (pass --base-model with a tokenizer)")
            self.load_seconds = time.monotonic() - self._started  # before the model: other threads read both once it is set
            self.model = model
            return model
        except Exception as e:  # noqa: BLE001 - kept for the page, then re-raised to launch.py
            self.load_seconds = time.monotonic() - self._started
            self.error = str(e)
            raise
        finally:
            self._done.set()

    def serve(self) -> None:
        """Run the model's work that other threads hand over (``steps``) on this thread, until ``stop_serving`` (or
        Ctrl+C, which is raised here). ``launch.py`` serves on the main thread, which loaded the model, instead of
        idling in Gradio's ``block_thread``.

        Why one thread: torch's OpenMP runtime (libgomp) keeps a team of threads for each thread that runs parallel
        work, and while a process has more such threads than CPUs every team waits by sleeping in the kernel instead of
        spinning, at each of a pass's ~200 parallel regions. A reply decoded in one of Gradio's worker threads, after the
        model was loaded on the main thread, ran at ~110 tokens/s against ~400 on the main thread (the demo, 2 cores;
        docs/APP.md, "One thread for the model")."""
        self._server, self._served = threading.current_thread(), True
        try:
            while (job := self._jobs.get()) is not None:
                job.run()
        finally:
            self._server, self._served = None, False

    def stop_serving(self) -> None:
        """Make ``serve`` return after the work it runs now (tests; ``launch.py`` stops on Ctrl+C)."""
        self._jobs.put(None)

    def steps(self, iterator: Iterator[T]) -> Iterator[T]:
        """``iterator``'s items (a reply's ``generate`` records), each made on the thread in ``serve`` while the caller
        waits for it (an engine made ``served`` waits for that thread to start), and closed there when the result is
        closed or ends; ``iterator`` itself where no thread serves (tests, notebooks) or the caller is that thread. Two
        replies at once take turns, one step each."""
        if not self._served or self._server is threading.current_thread():
            return iterator
        return self._on_server(iterator)

    def _on_server(self, iterator: Iterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    item = self._call(next, iterator)
                except StopIteration:
                    return
                yield item
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                self._call(close)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the serving thread, its result or its exception here."""
        job = _Job(fn, args)
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def conversation(self, key: str) -> ConversationCache:
        """The KV cache kept for conversation ``key`` (a session id), made on first use; the least recently
        used one beyond ``KEPT_CONVERSATIONS`` is dropped (its next turn reads the whole prompt again)."""
        with self._kept_lock:
            kept = self._kept.pop(key, None) or ConversationCache(self.kept_cache_bytes)
            self._kept[key] = kept
            while len(self._kept) > KEPT_CONVERSATIONS:
                self._kept.popitem(last=False)[1].clear()
            return kept

    def forget(self, key: str) -> None:
        """Drop the KV cache kept for conversation ``key`` (Clear), freeing its memory."""
        with self._kept_lock:
            kept = self._kept.pop(key, None)
        if kept is not None:
            kept.clear()

    @property
    def ready(self) -> bool:
        return self.model is not None

    @property
    def loading(self) -> bool:
        """True until loading ends (no model yet, and no error)."""
        return self.model is None and self.error is None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until loading ends; True when a model is ready."""
        self._done.wait(timeout)
        return self.ready

    @property
    def elapsed_s(self) -> float:
        """Seconds since loading started (the load time once it ended)."""
        return self.load_seconds if self.load_seconds is not None else time.monotonic() - self._started

    def status(self) -> str:
        """One line for the page: loading (with elapsed time), failed, or ready."""
        if self.error is not None:
            return f"Loading {self.description} failed: {self.error}"
        if self.model is None:
            compiling = " (compiling the lean decoding step: first start only, about a minute)" if lean_build.building() else ""
            return f"Loading {self.description}… {time.monotonic() - self._started:.0f} s{compiling}"
        return f"{self.model.name} ready (loaded in {self.load_seconds:.1f} s)"


class _Job:
    """One call that ``Engine.serve`` runs for another thread: its result or exception, and when it is done."""

    def __init__(self, fn: Callable[..., Any], args: tuple):
        self.fn, self.args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller; Ctrl+C also ends ``serve``
            self.error = e
            if not isinstance(e, Exception):
                raise
        finally:
            self.done.set()
