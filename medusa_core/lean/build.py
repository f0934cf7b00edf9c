"""Building and loading the lean step's C++ extension (``lean_step.cpp``) with ``torch.utils.cpp_extension``.

The extension is compiled once per source, torch version, torch install folder and CPU (about a minute on two cores) into
``<cache>/lean/<hash>/``, beside the converted GGUF backbones (``gguf.cache_dir``); later starts load the
built module in well under a second. Where no C++ compiler (or ``ninja``) is found, or the build fails,
``load_extension`` returns None with the reason, and the engine keeps transformers' forward. Processes build one
at a time under an operating-system lock (``filelock``), which a killed process releases; torch's own build
lock is a plain file that a build killed midway (Ctrl+C during a first start) leaves behind, and torch would wait
for it to go for ever, so whoever holds the OS lock removes it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from filelock import FileLock

from ..gguf import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("lean_step.cpp")
#: Everything the build reads: the source and the headers it includes.
FILES = tuple(SOURCE.with_name(name) for name in ("lean_step.cpp", "decoder.h", "decoder_ops.h", "eagle_chain.h", "row_attention.h", "corpus_chain.h", "draft_heads.h", "refine_top.h", "top_columns.h", "int4_matmul.h", "int4_dots.h", "int4_amx.h", "sampling.h"))
#: Environment variable that turns the lean step off (``0``): transformers' forward then runs every pass.
ENV = "MEDUSA_LEAN_STEP"
#: Environment variable that keeps the 4-bit product off the AMX tiles (``0``) on a CPU that has them: it then runs on
#: AVX512-BF16 dot products (int4_matmul.h; read at the process's first product).
AMX_ENV = "MEDUSA_LEAN_AMX"

_lock = threading.Lock()
_building = threading.Event()
_loaded: dict[str, ModuleType | str] = {}  # source hash -> module, or the reason it could not be built
_background: dict[str, threading.Thread] = {}  # source hash -> the thread ``build_in_background`` started


def enabled() -> bool:
    """False when ``$MEDUSA_LEAN_STEP`` is ``0`` (or ``false``, ``off``, ``no``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


#: Compiler flags: optimised for this CPU (the row attention's vector types then use its widest registers; every
#: lane operation is one IEEE operation, so the bits do not depend on it), no fused multiply-add, and OpenMP, the
#: runtime torch's own ``at::parallel_for`` runs on (the heads' products split their rows over torch's threads).
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
#: Linker flags: OpenMP's runtime, as the compiler flags ask for.
LDFLAGS = ["-fopenmp"]


def _cpu() -> bytes:
    """This CPU's model and feature flags (Linux), so that a build for one CPU is not loaded on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))})).encode()


def _digest() -> str:
    # torch's install folder too: the build compiles against its headers there, and torch rebuilds (unannounced) when
    # another environment's torch points the same folder at other headers
    where = str(Path(torch.__file__).resolve().parent).encode()
    payload = b"".join(f.read_bytes() for f in FILES) + torch.__version__.encode() + where + " ".join(CFLAGS).encode() + _cpu()
    return hashlib.sha256(payload).hexdigest()[:16]


def build_folder() -> Path:
    """``<cache>/lean/<hash of the sources, torch's version and install folder, the flags and the CPU>``: any change
    builds anew (and says so)."""
    return cache_dir().parent / "lean" / _digest()


def building() -> bool:
    """True while the extension is being compiled (a first start): a loading page can say so."""
    return _building.is_set()


def is_built() -> bool:
    """True when the extension of this source and torch is already compiled (loading it is then quick)."""
    return any(build_folder().glob("medusa_lean*.so"))


def build_in_background(report: Callable[[str], None] | None = None) -> None:
    """Start ``load_extension`` in a thread of its own, so that a first start compiles the extension (~30 s) while the
    caller reads its model (the demo's GGUF backbone: ~13 s at a first start); the next ``load_extension`` waits for
    that thread. Nothing when the lean step is off (``enabled``) or the extension is already loaded or under way."""
    if not enabled():
        return
    digest = _digest()
    with _lock:
        if digest in _loaded or digest in _background:
            return
        thread = _background[digest] = threading.Thread(target=load_extension, args=(report,), name="lean-build", daemon=True)
        thread.start()  # under the lock: a caller that finds it in _background may join it at once


def load_extension(report: Callable[[str], None] | None = None) -> tuple[ModuleType | None, str]:
    """The compiled extension, building it first if needed: ``(module, "")``, or ``(None, reason)`` when it cannot
    be built here (no compiler, no ninja, a failed build). ``report`` gets a line before a build starts (a first
    start: about a minute) and when it ends. Thread-safe; a result is kept for the process (one build of a
    source per process, wherever the cache folder points later); a build ``build_in_background`` started is waited
    for."""
    digest = _digest()
    started = _background.get(digest)
    if started is not None and started is not threading.current_thread():
        started.join()
    with _lock:
        if digest not in _loaded:
            _loaded[digest] = _build(build_folder(), report or (lambda line: None))
        found = _loaded[digest]
    return (found, "") if isinstance(found, ModuleType) else (None, found)


def _build(folder: Path, report: Callable[[str], None]) -> ModuleType | str:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r}) found: install one (Debian: apt install g++) for the lean step"
    try:
        import ninja  # the PyPI wheel's binary, for environments whose PATH lacks the venv's bin folder

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja): the lean step cannot be built"
    folder.mkdir(parents=True, exist_ok=True)
    fresh = not is_built()
    if fresh:
        report("Compiling the lean decoding step (first start only, about a minute)…")
    start = time.perf_counter()
    _building.set()
    try:
        with FileLock(folder / "build.lock"):  # no other process builds here now
            (folder / "lock").unlink(missing_ok=True)  # torch's baton, left by a build killed midway
            module = cpp_extension.load(
                name="medusa_lean", sources=[str(SOURCE)], build_directory=str(folder), extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS, verbose=False
            )
    except (RuntimeError, OSError, ImportError) as e:  # a compiler error, a broken toolchain
        log.warning("the lean step could not be built: %s", e)
        return f"the lean step could not be built ({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})"
    finally:
        _building.clear()
    if fresh:
        report(f"Compiled the lean decoding step in {time.perf_counter() - start:.0f} s.")
    return module
