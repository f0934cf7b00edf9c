"""Tests of the app's settings sources and of ``launch.py`` as a program (help text, load failure)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from app.settings import AppSettings
from medusa_core import CHAT_PRESET, SAMPLING_MODES, physical_cores
from medusa_core.processors import CHAT_SAMPLING

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
    assert (s.model, s.quantization, s.host, s.port, s.open) == ("demo", "auto", "127.0.0.1", 7860, False)
    assert (s.posterior_threshold, s.posterior_alpha) == (0.09, 0.3)
    assert s.sampling == CHAT_SAMPLING  # the chat preset's rule; the setting offers exactly the engine's modes
    assert typing.get_args(AppSettings.model_fields["sampling"].annotation) == SAMPLING_MODES
    # Sampling values are unset: the model's chat defaults apply, and --help says what they are.
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty) == (None,) * 5
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        assert AppSettings.model_fields[name].description.endswith(f"else {getattr(CHAT_PRESET, name):g}"), name
    # a person's CPU is theirs, but the browser that renders the streaming page runs on it too: every physical core it
    # may use but one for the page (at least one)
    assert s.threads == max(physical_cores() - 1, 1)


@pytest.fixture
def clean_settings(tmp_path, monkeypatch) -> Path:
    """No settings but the test's own: an empty config folder and working folder, no MEDUSA_CHAT_*.
    Returns the folder that holds ``medusa-chat/settings.toml``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for key in list(os.environ):
        if key.startswith("MEDUSA_CHAT_"):
            monkeypatch.delenv(key)
    (tmp_path / "config" / "medusa-chat").mkdir(parents=True)
    return tmp_path / "config" / "medusa-chat"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "99999"], "setting 'port': '99999' is not allowed: input should be less than or equal to 65535"),
        (["--port", "abc"], "setting 'port': 'abc' is not allowed: input should be a valid integer"),
        (["--host", "999.1.1.1"], "setting 'host': '999.1.1.1' is not allowed: it is neither an IP address nor a host name"),
        (["--temperature", "nan"], "setting 'temperature': 'nan' is not allowed: input should be a finite number"),
        (["--posterior-threshold", "0"], "setting 'posterior_threshold': '0' is not allowed: input should be greater than 0"),
        (["--posterior-alpha", "1.5"], "setting 'posterior_alpha': '1.5' is not allowed: input should be less than or equal to 1"),
        (["--max-new-tokens", "2.5"], "setting 'max_new_tokens': '2.5' is not allowed: input should be a valid integer"),
        (["--quantization", "q4"], "setting 'quantization': 'q4' is not allowed: input should be 'auto', 'gguf', 'nf4', 'int8' or 'none'"),
    ],
    ids=["port_too_large", "port_not_a_number", "host", "nan_temperature", "zero_epsilon", "delta_above_one",
         "fractional_max_new_tokens", "quantization"],
)
def test_a_bad_flag_raises_one_line_naming_the_setting_the_value_and_what_is_allowed(argv, message, clean_settings):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        AppSettings.from_cli(argv)
    assert "\n" not in str(err.value) and "MEDUSA_CHAT_" in str(err.value)


def test_bad_values_in_the_environment_dotenv_and_settings_file_are_named_one_line_each(clean_settings, monkeypatch):
    monkeypatch.setenv("MEDUSA_CHAT_THREADS", "0")
    (Path.cwd() / ".env").write_text("MEDUSA_CHAT_STREAM_INTERVAL_S=inf\n")
    (clean_settings / "settings.toml").write_text('port = -1\nhost = "999.1.1.1"\n')
    with pytest.raises(ValueError) as err:
        AppSettings.from_cli([])
    lines = str(err.value).splitlines()
    assert len(lines) == 4
    for name, value in [("host", "'999.1.1.1'"), ("port", "-1"), ("threads", "'0'"), ("stream_interval_s", "'inf'")]:
        assert any(line.startswith(f"setting {name!r}: {value} is not allowed: ") for line in lines), (name, lines)


def test_a_settings_file_that_is_not_valid_toml_is_named_in_the_error(clean_settings):
    (clean_settings / "settings.toml").write_text("port = = 1\n")
    with pytest.raises(ValueError, match=re.escape(f"{clean_settings / 'settings.toml'} is not valid TOML")):
        AppSettings.from_cli([])


def test_host_names_and_ip_addresses_are_accepted(clean_settings):
    for host in ("127.0.0.1", "0.0.0.0", "::1", "::", "localhost", "my-box.local"):
        assert AppSettings.from_cli(["--host", host]).host == host


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
    assert options.count("(default:") + options.count("(default factory:") == len(AppSettings.model_fields)
    assert "(default factory: cores_but_one)" in options  # threads: the description says what it counts
    for default in ("demo", "auto", "127.0.0.1", "7860", "0.09", "0.3", "False"):
        assert f"(default: {default})" in options


def test_a_model_that_fails_to_load_prints_the_loaders_message_and_exits_non_zero(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = run_launch("--model", str(tmp_path / "missing"), "--port", str(port), env={"XDG_DATA_HOME": str(tmp_path)})
    assert out.returncode == 1
    assert f"could not load {tmp_path / 'missing'}: {tmp_path / 'missing'}: no such folder" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "99999"], "error: setting 'port': '99999' is not allowed: input should be less than or equal to 65535"),
        (["--host", "999.1.1.1"], "error: setting 'host': '999.1.1.1' is not allowed: it is neither an IP address nor a host name"),
    ],
    ids=["port", "host"],
)
def test_launch_with_a_bad_setting_prints_one_line_and_exits_with_status_2(args, message, tmp_path):
    out = run_launch(*args, env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and out.stderr.startswith(message)
    assert "Traceback" not in out.stderr + out.stdout


def test_launch_names_a_port_in_use_and_an_address_this_machine_does_not_have(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path)}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run_launch("--port", str(port), env=env)
    assert out.returncode == 1
    assert out.stderr.strip() == f"error: cannot serve on 127.0.0.1:{port}: the port is in use: pass --port with a free one"
    out = run_launch("--host", "192.0.2.1", env=env)  # TEST-NET-1: never a local address
    assert out.returncode == 1
    assert out.stderr.strip().startswith("error: cannot serve on 192.0.2.1:7860: 192.0.2.1 is not an address of this machine")
    assert "Traceback" not in out.stderr + out.stdout
