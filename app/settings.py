"""The app's settings: one pydantic-settings model, read from (highest priority first)
CLI flags, ``MEDUSA_CHAT_*`` environment variables, a ``.env`` file in the working folder, and
``settings.toml`` in the user's config folder (see ``app.paths``).

``python launch.py --help`` prints every setting with its default, generated from this class.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Literal, Sequence

from pydantic import AfterValidator, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from . import paths

_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _host(value: str) -> str:
    """``value`` if it is an IP address or a host name (RFC 1123; the last label not all digits)."""
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        labels = value.removesuffix(".").split(".")
        if len(value) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit():
            return value
    raise ValueError(
        "it is neither an IP address nor a host name: use e.g. 127.0.0.1 (this machine only), "
        "0.0.0.0 (every interface), ::1 or localhost"
    )


def cores_but_one() -> int:
    """The default of ``threads``: the physical cores this process may use (``medusa_core.cpu.physical_cores()``,
    imported when called so that ``--help`` does not wait for torch to import) but one, at least one. The browser that
    renders the page runs on the same machine while a reply streams; decoding threads that share their cores with it
    wait for each other at every parallel step: on this project's 2-core machine a reply in the app decoded at
    ~150 tokens/s with 2 threads and ~275 with 1 (docs/APP.md, "Threads")."""
    from medusa_core.cpu import physical_cores

    return max(physical_cores() - 1, 1)


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
    quantization: Literal["auto", "gguf", "nf4", "int8", "none"] = Field(
        "auto", description="backbone weights: auto (a GGUF file's own 4-bit blocks on a CPU, else NF4), gguf, "
                            "4-bit NF4, 8-bit, or none")
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda', 'cuda:1', ...")
    threads: int = Field(
        default_factory=cores_but_one, ge=1,
        description="CPU threads for torch; default: the physical cores this process may run on (hyper-threads not counted) "
                    "but one, which the browser showing the page takes while a reply streams; use 1 when other busy "
                    "jobs share the CPU, where waiting threads stall each other",
    )
    # ---- server
    host: Annotated[str, AfterValidator(_host)] = Field("127.0.0.1", description="address to bind; the default serves this machine only")
    port: int = Field(7860, ge=1, le=65535, description="port to serve on")
    open: bool = Field(False, description="open the page in a browser once serving")
    # ---- defaults of the page's controls (each reply can change them)
    system_prompt: str = Field("", description="initial system prompt; empty: the model's own, which its chat template writes (shown in the Model tab)")
    max_new_tokens: int = Field(256, ge=1, description="initial limit on tokens per reply")
    # Sampling (HF generate semantics); unset: the model's generation config when it sets sampling values,
    # else medusa_core.CHAT_PRESET (T 0.2, top-p 0.9, repetition penalty 1.1, exact verification).
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False, description="initial temperature (0 = greedy); default: the model's, else 0.2")
    top_k: int | None = Field(None, ge=0, description="initial top-k (0 = off); default: the model's, else 0")
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False, description="initial top-p in (0, 1] (1 = off); default: the model's, else 0.9")
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False, description="initial min-p in [0, 1] (0 = off); default: the model's, else 0")
    repetition_penalty: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="initial repetition penalty (1 = off, > 1 discourages repeats); default: the model's, else 1.1"
    )
    posterior_threshold: float = Field(0.09, gt=0.0, le=1.0, allow_inf_nan=False, description="initial epsilon of typical acceptance, in (0, 1] (paper 2.3.1)")
    posterior_alpha: float = Field(0.3, gt=0.0, le=1.0, allow_inf_nan=False, description="initial delta of typical acceptance, in (0, 1] (paper 2.3.1)")
    sampling: Literal["typical", "exact"] = Field(
        "exact", description="initial verification at temperature > 0: exact rejection sampling (replies follow the model's "
                             "sampling distribution) or typical acceptance (paper 2.3.1)"
    )
    tree: str | None = Field(None, description="initial tree name; default: the model's own default tree")
    drafts: Literal["heads", "hybrid", "ngram", "corpus", "eagle"] | None = Field(
        None, description="initial source of each step's candidates; default: eagle for a model with an EAGLE-style "
                          "drafter (the demo: the fastest at the chat preset and at greedy; README Speed), else corpus for a model with a "
                          "corpus of its own replies, else heads. heads (the paper's Medusa), hybrid (the heads' tree plus "
                          "a chain copied from the conversation by prompt lookup), ngram (prompt lookup only), corpus (the "
                          "heads' tree, or a chain from the model's corpus of its own replies where that is confident) or "
                          "eagle (the corpus's chain, else the drafter's)"
    )
    # ---- live view and files
    redraw_interval_s: float = Field(0.25, ge=0.0, allow_inf_nan=False, description="seconds between redraws of the plots while a reply streams")
    stream_interval_s: float = Field(0.05, ge=0.0, allow_inf_nan=False, description="seconds between chat updates while a reply streams")
    save_interval_s: float = Field(
        1.0, ge=0.0, allow_inf_nan=False,
        description="seconds between writes of a streaming reply to the browser's storage (a reload keeps it, marked stopped)")
    prefill_chunk: int = Field(256, ge=1, description="prompt tokens read per pass: Stop and Clear wait at most one pass, and "
                                                     "the status shows the reading's progress after each")
    kept_cache_mb: float = Field(
        160.0, ge=0.0, allow_inf_nan=False,
        description="memory in MB (10^6 bytes) each kept conversation's KV cache may hold between turns (the app keeps the "
                    "latest two): a longer conversation keeps its first part and reads the rest again each turn; on the "
                    "demo a token takes 46 kB, so 160 MB keeps about 3,400 tokens")
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
        try:
            toml = TomlConfigSettingsSource(settings_cls, toml_file=paths.settings_file())
        except ValueError as e:  # tomllib.TOMLDecodeError
            raise ValueError(f"{paths.settings_file()} is not valid TOML: {e}") from None
        return init_settings, env_settings, dotenv_settings, toml

    @classmethod
    def from_cli(cls, argv: Sequence[str]) -> "AppSettings":
        """Settings with ``argv`` (without the program name) as the highest-priority source.

        Raises ``ValueError`` with one line per bad value, naming the setting, the value, what is
        allowed and where it can be set; an unknown flag exits with argparse's usage message.
        """
        try:
            return cls(_cli_parse_args=list(argv))
        except ValidationError as e:
            raise ValueError("\n".join(_describe(error) for error in e.errors())) from None
        except SettingsError as e:  # a value no source could parse, e.g. malformed JSON
            raise ValueError(str(e)) from None

    @property
    def exports_dir(self) -> Path:
        """Where CSV exports are saved."""
        return self.data_dir / "exports"


def _describe(error: dict) -> str:
    """One line for one pydantic error: the setting, its value, what is allowed and where it is set."""
    name = ".".join(map(str, error["loc"]))
    reason = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
    reason = reason[:1].lower() + reason[1:]
    where = f"--{name.replace('_', '-')}, MEDUSA_CHAT_{name.upper()}, .env or {paths.settings_file()}"
    return f"setting {name!r}: {error['input']!r} is not allowed: {reason} (set by {where})"
