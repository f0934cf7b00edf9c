"""The page while the model loads: the status banner, then (once ready) the tree choices and the
model panel; the polling timer switches off."""

from __future__ import annotations

import gradio as gr

from ..engine import Engine
from ..session import Session
from ..settings import AppSettings
from .controls import tree_choices
from .views import Updates, model_panel


def page_status(engine: Engine, settings: AppSettings, session: Session) -> Updates:
    """What the page shows about the model: while loading the status line only; once ready (or
    failed) also the tree choices and the model panel, and the polling timer switches off."""
    if engine.model is None and engine.error is None:
        return {"banner": engine.status()}
    updates: Updates = {"banner": "" if engine.ready else f"⚠ {engine.status()}", "timer": gr.Timer(active=False)}
    if engine.ready:
        model = engine.model
        choices = tree_choices(model)
        values = [v for _, v in choices]
        wanted = settings.tree or model.default_tree
        updates |= {
            "tree": gr.Dropdown(choices=choices, value=wanted if wanted in values else model.default_tree),
            "model_panel": model_panel(engine, session),
            "tree_status": "" if wanted in values else f"⚠ unknown tree {settings.tree!r}: using {model.default_tree}",
        }
    return updates
