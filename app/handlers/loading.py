"""The page while the model loads: the status banner with a progress bar, then (once ready) the tree
choices, the model panel and the model's chat defaults in the sampling controls; the polling timer
switches off.

The bar's estimate is how long the same model took to load last time on this machine, kept in the
data folder (``load_times.json``); the first load shows the elapsed time only.
"""

from __future__ import annotations

import html
import json

import gradio as gr

from ..engine import Engine
from ..settings import AppSettings
from .controls import Controls, chat_defaults, chat_preset, drafts_default, medusa_notice, tree_choices, tree_state
from .views import Updates, model_panel


LOAD_TIMES = "load_times.json"


def page_status(engine: Engine, settings: AppSettings) -> Updates:
    """What the page shows about the model: while loading the status line and a progress bar; once
    ready (or failed) also the tree choices (greyed out as ``explain_controls`` has them: ``tree_state``), the
    model panel, the Drafts control at the model's default
    (``drafts_default``), the sampling controls at the model's chat defaults (``chat_preset``) and the Medusa
    toggle's note at them (``medusa_notice``), and the polling timer switches off.

    It reads no session state: it runs at page load and on every timer tick, and needs none."""
    if engine.loading:
        return {"banner": loading_banner(engine, _load_times(settings).get(engine.description))}
    updates: Updates = {"banner": "" if engine.ready else f"⚠ {engine.status()}", "timer": gr.Timer(active=False)}
    if engine.ready:
        _remember_load_time(settings, engine)
        model = engine.model
        choices = tree_choices(model)
        values = [v for _, v in choices]
        wanted = settings.tree or model.default_tree
        drafts = drafts_default(settings, model)
        updates |= {  # the tree greyed out or not as explain_controls has it, whichever update reaches the page last
            "tree": gr.Dropdown(choices=choices, value=wanted if wanted in values else model.default_tree,
                                **tree_state(Controls.from_settings(settings).medusa, drafts)),
            "model_panel": model_panel(engine),
            "tree_status": "" if wanted in values else f"⚠ unknown tree {settings.tree!r}: using {model.default_tree}",
            "drafts": gr.Radio(value=drafts),
        } | chat_preset(engine, settings) | medusa_notice(engine, chat_defaults(settings, model).temperature, drafts)
    return updates


def loading_banner(engine: Engine, expected_s: float | None) -> str:
    """The banner while the model loads: what, for how long so far, and a bar against the last load's time."""
    elapsed = engine.elapsed_s
    if not expected_s:
        return f"**{html.escape(engine.status())}** (the first load of this model here: no estimate yet)"
    share = min(elapsed / expected_s, 0.99)
    return (
        f"**{html.escape(engine.status())}** of about {expected_s:.0f} s (the last load) "
        f'<progress value="{share:.2f}" max="1">{share:.0%}</progress>'
    )


def _load_times(settings: AppSettings) -> dict[str, float]:
    try:
        times = json.loads((settings.data_dir / LOAD_TIMES).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: no estimate
        return {}
    return times if isinstance(times, dict) else {}


def _remember_load_time(settings: AppSettings, engine: Engine) -> None:
    """Keep this load's time for the next start's progress bar (once per load)."""
    times = _load_times(settings)
    if engine.load_seconds and times.get(engine.description) != round(engine.load_seconds, 1):
        times[engine.description] = round(engine.load_seconds, 1)
        try:
            settings.data_dir.mkdir(parents=True, exist_ok=True)
            (settings.data_dir / LOAD_TIMES).write_text(json.dumps(times, indent=1), encoding="utf-8")
        except OSError:  # a read-only data folder only costs the estimate
            pass
