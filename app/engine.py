"""The one model every browser session shares, its loading state, and the KV caches of the latest
conversations, kept between their turns (``medusa_core.ConversationCache``).

``launch.py`` starts serving first and loads the model afterwards, so the page can show the load
progress; until ``ready`` a sent message waits for it (``handlers.respond``) and the other chat handlers answer
with the loading status.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable

from medusa_core import ConversationCache, MedusaModel
from medusa_core.lean import build as lean_build

#: Conversations whose KV cache the engine keeps between turns (the most recently used ones): each
#: within the engine's ``kept_cache_mb`` (without a limit, up to the context window's entries: on the
#: demo 46 kB per token, 0.38 GB at 8,192 tokens).
KEPT_CONVERSATIONS = 2


class Engine:
    """A ``MedusaModel`` that may still be loading.

    Args:
        description: what is being loaded, e.g. ``"demo (nf4) on auto"``; shown while loading.
        kept_cache_mb: memory in MB each kept conversation's KV cache may hold between turns
            (``ConversationCache(max_bytes=)``); None: no limit.
    """

    def __init__(self, description: str, kept_cache_mb: float | None = None):
        self.description = description
        self.kept_cache_bytes = None if kept_cache_mb is None else int(kept_cache_mb * 1e6)
        self.model: MedusaModel | None = None
        self.error: str | None = None
        self.load_seconds: float | None = None
        self._started = time.monotonic()
        self._done = threading.Event()
        self._kept: OrderedDict[str, ConversationCache] = OrderedDict()
        self._kept_lock = threading.Lock()

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
