"""Tests of the app's settings sources and of ``launch.py`` as a program (help text, load failure)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import typing
from pathlib import Path

from app.settings import AppSettings
from medusa_core import SAMPLING_MODES

REPO = Path(__file__).resolve().parent.parent


def test_settings_priority_is_cli_then_environment_then_dotenv_then_the_settings_file(tmp_path, monkeypatch):
    config = tmp_path / "config"
    (config / "medusa-chat").mkdir(parents=True)
    (config / "medusa-chat" / "settings.toml").write_text('port = 1111\nhost = "0.0.0.0"\ntree = "file"\nmodel = "file"\n')
    (tmp_path / ".env").write_text("MEDUSA_CHAT_PORT=2222\nMEDUSA_CHAT_HOST=dotenv\nMEDUSA_CHAT_TREE=dotenv\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEDUSA_CHAT_PORT", "3333")
    monkeypatch.setenv("MEDUSA_CHAT_HOST", "env")
    s = AppSettings.from_cli(["--port", "4444"])
    assert (s.port, s.host, s.tree, s.model) == (4444, "env", "dotenv", "file")
    monkeypatch.delenv("MEDUSA_CHAT_HOST")
    assert AppSettings.from_cli([]).host == "dotenv"


def test_defaults_serve_the_demo_model_in_nf4_on_localhost(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for key in list(os.environ):
        if key.startswith("MEDUSA_CHAT_"):
            monkeypatch.delenv(key)
    s = AppSettings.from_cli([])
    assert (s.model, s.quantization, s.host, s.port, s.open) == ("demo", "nf4", "127.0.0.1", 7860, False)
    assert (s.posterior_threshold, s.posterior_alpha) == (0.09, 0.3)
    assert s.sampling == "typical"  # the paper's rule; the setting offers exactly the engine's modes
    assert typing.get_args(AppSettings.model_fields["sampling"].annotation) == SAMPLING_MODES


def run_launch(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "launch.py", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )


def test_help_lists_every_setting_with_its_default():
    out = run_launch("--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    options = text.split("options:")[1]
    for name in AppSettings.model_fields:
        flag = "--" + name.replace("_", "-")
        assert flag in options, flag
    assert options.count("(default:") == len(AppSettings.model_fields)
    for default in ("demo", "nf4", "127.0.0.1", "7860", "0.09", "0.3", "False"):
        assert f"(default: {default})" in options


def test_a_model_that_fails_to_load_prints_the_loaders_message_and_exits_non_zero(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = run_launch("--model", str(tmp_path / "missing"), "--port", str(port), env={"XDG_DATA_HOME": str(tmp_path)})
    assert out.returncode == 1
    assert f"could not load {tmp_path / 'missing'}: {tmp_path / 'missing'}: no such folder" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
