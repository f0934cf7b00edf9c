"""Helpers of the handler tests: send a message as the page does, read a reply's HTML, the engine's own greedy reply,
the tiny model with a drafter, a corpus index held back, a message waiting for a model that loads."""

from __future__ import annotations

import threading

from app import handlers
from app.engine import Engine
from app.handlers.generation import fit_prompt
from app.session import Session


def send(engine, settings, session, controls, message="def add"):
    """Send ``message`` as the page does: ``add_user``, ``respond``, then ``finish_reply`` (``follow_reply``, which
    runs beside ``respond`` in the page, has tests of its own); the updates of both, in order."""
    handlers.add_user(engine, session, controls, message)
    return reply(engine, settings, session, controls)


def reply(engine, settings, session, controls):
    """The updates of ``respond`` and then ``finish_reply`` (the page chains it after ``respond``)."""
    return [*handlers.respond(engine, settings, session, controls), *handlers.finish_reply(engine, session, controls.highlight)]


def reply_html(update) -> str:
    return update["chatbot"][-1]["content"]


def greedy_reference(engine, session, controls, index=-1) -> str:
    """The reply plain medusa_core gives for the same prompt, decoded in one go."""
    model = engine.model
    ids, _ = fit_prompt(model, controls, session.history(len(session.turns) + index), session.turns[index].user)
    tokens = [t for r in model.generate(ids, max_new_tokens=controls.max_new_tokens, tree=controls.tree) for t in r.token_ids]
    return model.tokenizer.decode(tokens, skip_special_tokens=True)


def with_drafter(engine, tmp_path, **corpus) -> Engine:
    """The tiny model (its weights shared) with a random EAGLE-style drafter, and ``corpus`` if given."""
    from tiny_models import random_drafter

    from medusa_core import MedusaModel

    model = engine.model
    drafted = MedusaModel(model.backbone, model.heads, model.tokenizer, name="tiny with a drafter", trees=model.trees, **corpus)
    drafted.load_drafter(random_drafter(tmp_path / "drafter.safetensors", drafted.config))
    return Engine.of(drafted)


class HeldIndex:
    """A corpus (``MedusaModel(corpus=...)``'s callable) whose index is "being built" until ``finish``."""

    def __init__(self):
        self.built, self._release = [], threading.Event()

    def __call__(self):
        from medusa_core.datastore import Datastore

        self._release.wait(30)
        self.built.append(1)
        return Datastore.build([([1, 2, 3, 4], 1)] * 2)

    def finish(self, model) -> None:
        """Let the build end, and wait (up to 3 s) until ``model`` has its corpus."""
        self._release.set()
        for _ in range(300):
            if model.corpus_ready:
                break
            threading.Event().wait(0.01)


def waiting_reply(settings, controls):
    """A message sent while a model loads, its reply waiting for it: (engine, session, the reply's updates)."""
    loading = Engine("demo (nf4)")
    session = Session()
    handlers.add_user(loading, session, controls, "def add")
    replying = handlers.respond(loading, settings, session, controls)
    assert "Loading" in next(replying)["reply_status"]
    return loading, session, replying
