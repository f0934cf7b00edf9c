"""The app's settings: one pydantic-settings model, read from (highest priority first)
CLI flags, ``MEDUSA_CHAT_*`` environment variables, a ``.env`` file in the working folder, and
``settings.toml`` in the user's config folder (see ``app.paths``).

``python launch.py --help`` prints every setting with its default, generated from this class.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Sequence

from pydantic import Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from . import paths


class AppSettings(BaseSettings):
    """Serve a local chat UI on a Medusa model: live candidate trees, speed charts, CSV export.

    Each setting can also be set by a MEDUSA_CHAT_<NAME> environment variable, a .env file in the
    working folder, or settings.toml in the user config folder (~/.config/medusa-chat on Linux);
    flags win over the environment, which wins over .env, which wins over the file.
    """

    model_config = SettingsConfigDict(
        env_prefix="MEDUSA_CHAT_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        cli_prog_name="python launch.py",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        cli_exit_on_error=True,
        protected_namespaces=(),
    )

    # ---- model (loaded once at start)
    model: str = Field("demo", description="'demo' (the shipped model), a local Medusa folder or a Hub id")
    base_model: str | None = Field(None, description="backbone to use instead of the checkpoint's base_model_name_or_path")
    quantization: Literal["nf4", "int8", "none"] = Field("nf4", description="backbone weights: 4-bit NF4, 8-bit, or none")
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda', 'cuda:1', ...")
    threads: int = Field(1, ge=1, description="CPU threads for torch; small models decode fastest on one, and more stall when the CPU is shared (e.g. with the browser)")
    # ---- server
    host: str = Field("127.0.0.1", description="address to bind; the default serves this machine only")
    port: int = Field(7860, description="port to serve on")
    open: bool = Field(False, description="open the page in a browser once serving")
    # ---- defaults of the page's controls (each reply can change them)
    system_prompt: str = Field("You are a helpful Python coding assistant.", description="initial system prompt")
    max_new_tokens: int = Field(256, ge=1, description="initial limit on tokens per reply")
    temperature: float = Field(0.0, ge=0.0, description="initial temperature (0 = greedy)")
    posterior_threshold: float = Field(0.09, gt=0.0, description="initial epsilon of typical acceptance (paper 2.3.1)")
    posterior_alpha: float = Field(0.3, ge=0.0, description="initial delta of typical acceptance (paper 2.3.1)")
    sampling: Literal["typical", "exact"] = Field(
        "typical", description="initial verification at temperature > 0: typical acceptance (paper 2.3.1) or exact rejection sampling"
    )
    tree: str | None = Field(None, description="initial tree name; default: the model's own default tree")
    # ---- live view and files
    redraw_interval_s: float = Field(0.25, ge=0.0, description="seconds between redraws of the plots while a reply streams")
    stream_interval_s: float = Field(0.05, ge=0.0, description="seconds between chat updates while a reply streams")
    data_dir: Path = Field(paths.user_data_dir(), description="folder for CSV exports (under exports/)")
    verbose: bool = Field(False, description="print tracebacks and debug logs")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The CLI source (when parsing args) is put in front of these by pydantic-settings.
        toml = TomlConfigSettingsSource(settings_cls, toml_file=paths.settings_file())
        return init_settings, env_settings, dotenv_settings, toml

    @classmethod
    def from_cli(cls, argv: Sequence[str]) -> "AppSettings":
        """Settings with ``argv`` (without the program name) as the highest-priority source."""
        return cls(_cli_parse_args=list(argv))

    @property
    def exports_dir(self) -> Path:
        """Where CSV exports are saved."""
        return self.data_dir / "exports"
