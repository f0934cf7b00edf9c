"""The one model every browser session shares, its loading state, and the KV caches of the latest
conversations, kept between their turns (``medusa_core.ConversationCache``).

``launch.py`` starts serving first and loads the model afterwards, so the page can show the load
progress; until ``ready`` a sent message waits for it (``handlers.respond``) and the other chat handlers answer
with the loading status. Then its main thread, which loaded the model, runs every reply's steps (``serve``,
``steps``): all of the model's work on one thread, a few steps ahead of the page's handler, so that decoding does
not wait while Gradio sends an update to the browser.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, TypeVar

from medusa_core import ConversationCache, MedusaModel
from medusa_core.lean import build as lean_build

#: Conversations whose KV cache the engine keeps between turns (the most recently used ones): each
#: within the engine's ``kept_cache_mb`` (without a limit, up to the context window's entries: on the
#: demo 46 kB per token, 0.38 GB at 8,192 tokens).
KEPT_CONVERSATIONS = 2
#: Steps the serving thread makes ahead of a reply's reader (``Engine.steps``): while the page's handler waits for
#: Gradio to send an update, decoding goes on (on the demo, 2 cores, the app's 1 thread: a step waited for the page
#: ~31 % of a reply's time when each step waited for its reader; docs/APP.md, "Steps made ahead of the page").
AHEAD = 8
#: Python's thread switch interval while the app serves (``sys.setswitchinterval``, launch.py; Python's default
#: 0.005 s). The serving thread releases the GIL in every compiled call of a step and needs it back after each;
#: while the page's handler or Gradio runs Python, it waits up to this long for it. In the app on the demo (2 cores,
#: 1 thread, headless Chromium), with steps made ahead: 0.005 s 115–124 tokens/s with Medusa, 0.0005 s 136–139
#: (docs/APP.md, "Steps made ahead of the page").
SWITCH_INTERVAL_S = 0.0005

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
        self._jobs: queue.SimpleQueue[_Stream | None] = queue.SimpleQueue()  # work for ``serve``
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

    def steps(self, iterator: Iterator[T]) -> Iterator[tuple[T, datetime]]:
        """``iterator``'s items (a reply's ``generate`` records), each with the time it was made (UTC).

        Where a thread serves (``serve``; an engine made ``served`` waits for that thread to start), the items are
        made there, up to ``AHEAD`` of the reader, from the reader's first ``next`` on; closing the result (Stop,
        Gradio's cancel) stops the making after the step in progress and closes ``iterator`` there, and the items
        made but not read are dropped (a kept conversation cache then holds their tokens too, which the next turn's
        prompt does not match: it reads from where they differ). Two replies at once take turns, one step each.
        Where no thread serves (tests, notebooks) or the caller is that thread, the items are made as they are read.
        An exception of ``iterator`` is raised to the reader after the items made before it."""
        if not self._served or self._server is threading.current_thread():
            return _stamped(iterator)
        return self._on_server(iterator)

    def _on_server(self, iterator: Iterator[T]) -> Iterator[tuple[T, datetime]]:
        stream = _Stream(self._jobs, iterator)
        try:
            while (made := stream.take()) is not None:
                yield made
        finally:
            stream.close()

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


def _stamped(iterator: Iterator[T]) -> Iterator[tuple[T, datetime]]:
    """``iterator``'s items with the time each was made, closing ``iterator`` when closed."""
    try:
        for item in iterator:
            yield item, datetime.now(timezone.utc)
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


class _Stream:
    """A reply's steps made on the serving thread ahead of their reader (``Engine.steps``).

    The stream is its own job in the engine's queue: each ``run`` (on the serving thread) makes one item and
    queues the stream again while fewer than ``AHEAD`` wait to be read, so streams and other jobs take turns. The
    reader's ``take`` hands out the items in order and queues a stream that paused; ``close`` asks the next ``run``
    to close the iterator and waits for it.
    """

    def __init__(self, jobs: queue.SimpleQueue, iterator: Iterator[Any]):
        self._jobs, self._iterator = jobs, iterator
        self._lock = threading.Condition()
        self._made: deque[tuple[Any, datetime]] = deque()
        self._queued = False  # a run is in the queue or running
        self._cancelled = False  # the reader closed the stream
        self._ended = False  # the iterator is exhausted, failed or closed
        self._error: BaseException | None = None  # the iterator's, for the reader's ``take``
        self._closing_error: BaseException | None = None  # closing's, for the reader's ``close``

    def _queue(self) -> None:
        """Queue a run unless one is queued or the iterator ended (the lock held)."""
        if not self._queued and not self._ended:
            self._queued = True
            self._jobs.put(self)

    def run(self) -> None:
        """On the serving thread: make the next item, or close the iterator once the reader closed the stream."""
        with self._lock:
            cancelled = self._cancelled
        if cancelled:
            self._end(close=True)
            return
        try:
            item = next(self._iterator)
        except StopIteration:
            self._end()
            return
        except BaseException as e:  # noqa: BLE001 - raised to the reader; Ctrl+C also ends ``serve``
            self._end(error=e)
            if not isinstance(e, Exception):
                raise
            return
        with self._lock:
            self._made.append((item, datetime.now(timezone.utc)))
            self._queued = False
            self._lock.notify_all()
            if self._cancelled or len(self._made) < AHEAD:
                self._queue()

    def _end(self, close: bool = False, error: BaseException | None = None) -> None:
        closing_error = None
        if close and (close_fn := getattr(self._iterator, "close", None)) is not None:
            try:
                close_fn()
            except Exception as e:  # noqa: BLE001 - raised to the reader's close
                closing_error = e
        with self._lock:
            self._ended, self._queued, self._error, self._closing_error = True, False, error, closing_error
            self._lock.notify_all()

    def take(self) -> tuple[Any, datetime] | None:
        """The next item and when it was made, waiting for it; None once the iterator is exhausted. Raises the
        iterator's exception once the items made before it are read."""
        with self._lock:
            while True:
                if self._made:
                    made = self._made.popleft()
                    self._queue()
                    return made
                if self._ended:
                    error, self._error = self._error, None
                    if error is not None:
                        raise error
                    return None
                self._queue()
                self._lock.wait()

    def close(self) -> None:
        """Stop making items and wait until the serving thread has closed the iterator (unless it ended); the items
        made but not read, and an exception the reader did not reach, are dropped. Raises what closing raised."""
        with self._lock:
            if not self._ended:
                self._cancelled = True
                self._queue()
                while not self._ended:
                    self._lock.wait()
            error, self._closing_error, self._error = self._closing_error, None, None
            self._made.clear()
        if error is not None:
            raise error
