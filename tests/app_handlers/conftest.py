"""Fixtures of the handler tests: the app's settings (a redraw on every step) and the page's controls at greedy."""

from __future__ import annotations

import dataclasses

import pytest

from app import handlers
from app.handlers import Controls
from app.settings import AppSettings


@pytest.fixture
def settings(tmp_path) -> AppSettings:
    # Redraw on every step so the tests see every intermediate update.
    return AppSettings(data_dir=tmp_path / "data", stream_interval_s=0.0, redraw_interval_s=0.0, max_new_tokens=24)


@pytest.fixture
def controls(settings) -> Controls:
    """The page's controls after a click on "Greedy (exactness demo)": replies equal the engine's greedy output."""
    return dataclasses.replace(Controls.from_settings(settings), tree="sparse_16", system_prompt="be brief", **handlers.GREEDY_PRESET)
