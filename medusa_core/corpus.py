"""A model's corpus of its own replies, made once: at the first reply that drafts from it, or in a thread beforehand.

``MedusaModel(corpus=...)`` takes a ``datastore.Datastore``, a function that makes one (a head folder's replies:
``loading.CorpusIndex``, ~9 s for the demo at a first start), or None; ``LazyCorpus`` holds it for the model, makes
it at most once however many callers ask at once, and lets the app start the making early
(``MedusaModel.index_corpus_in_background``) so that the first reply with corpus drafts does not wait for it.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Callable

from .datastore import Datastore


class LazyCorpus:
    """The corpus of a model (``MedusaModel.corpus``), made on first use, thread-safe.

    Args:
        source: a ``Datastore``; a function that makes one (called at most once), optionally with a
            ``prepare_apart()`` that makes its index file in a low-priority process of its own first
            (``loading.CorpusIndex``); or None: the model has no corpus.
    """

    def __init__(self, source: Datastore | Callable[[], Datastore] | None):
        self.source = source
        self._lock = threading.Lock()  # one build when a warm-up thread and a reply ask at once
        self.thread: threading.Thread | None = None  # index_in_background's

    @property
    def present(self) -> bool:
        """Whether there is a corpus (made or still to make)."""
        return self.source is not None

    @property
    def ready(self) -> bool:
        """Whether the corpus is made (``get`` then returns at once)."""
        return self.source is not None and not callable(self.source)

    @property
    def indexing(self) -> bool:
        """Whether a thread ``index_in_background`` started is still making the corpus."""
        return self.thread is not None and self.thread.is_alive()

    def get(self, extension: ModuleType | None) -> Datastore | None:
        """The corpus, made now if it is not yet (blocking while another thread makes it); None without one.
        ``extension``: the lean step's compiled extension, if loaded: the corpus then drafts its chains in one
        compiled call (``Datastore.use_kernel``). Raises what the source's function raises (a head folder's replies:
        ``OSError`` or ``ValueError`` for an unreadable file, ``Datastore.cached``); a later call tries again."""
        with self._lock:
            if callable(self.source):
                self.source = self.source()
            if self.source is not None and self.source.kernel is None and extension is not None:
                self.source.use_kernel(extension)
            return self.source

    def index_in_background(self, extension: ModuleType | None) -> None:
        """Start making the corpus in a daemon thread (``get(extension)``; a source with ``prepare_apart`` first makes
        its index file in a process of its own, so that replies decoded meanwhile keep the CPU and the GIL). Nothing
        without a corpus, once it is made, or while a thread this started runs (two callers at once start at most two
        threads; the lock makes one build)."""
        if not self.present or self.ready or self.indexing:
            return
        source = self.source

        def index() -> None:
            if hasattr(source, "prepare_apart"):
                source.prepare_apart()
            self.get(extension)

        self.thread = threading.Thread(target=index, name="corpus-index", daemon=True)
        self.thread.start()
