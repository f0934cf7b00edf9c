"""Where the app keeps its files: the repository's assets and the user's config and data folders.

Folders come from platformdirs (on Linux ``~/.config/medusa-chat`` and ``~/.local/share/medusa-chat``,
which follow ``XDG_CONFIG_HOME`` / ``XDG_DATA_HOME``). Nothing is created at import time.
"""

from __future__ import annotations

from pathlib import Path

import platformdirs

APP_NAME = "medusa-chat"
REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS_DIR = REPO_ROOT / "assets"
CSS_FILE = ASSETS_DIR / "app.css"
JS_FILE = ASSETS_DIR / "app.js"  # run in the browser on page load (keys, plain-text copy)


def user_config_dir() -> Path:
    """The user's config folder for the app (holds ``settings.toml``)."""
    return Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))


def settings_file() -> Path:
    """The optional settings file, lowest-priority source after CLI flags, environment and ``.env``."""
    return user_config_dir() / "settings.toml"


def user_data_dir() -> Path:
    """The user's data folder for the app (CSV exports go to ``exports/`` inside it)."""
    return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
