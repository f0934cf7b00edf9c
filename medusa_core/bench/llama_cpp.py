"""The anchor: llama.cpp's own plain decoding of the same GGUF file (``llama-cpp-python``).

What a CPU user would run instead of this project. Optional (``pip install -e ".[anchors]"``: the
package builds llama.cpp from source); without it the method is skipped with one line saying so.
Greedy (top-k 1, no repetition penalty), the prompt's token ids from the Hugging Face tokenizer, the
same token limit and stop tokens as the other methods, ``n_threads`` = torch's thread count.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any

#: How a backbone that is not a GGUF file is reported (the method is skipped).
NOT_GGUF = "llama_cpp skipped: the backbone is not a GGUF file (use the demo, or --base-model FILE.gguf)"
#: How a missing package is reported (the method is skipped).
MISSING = "llama_cpp skipped: llama-cpp-python is not installed (pip install -e \".[anchors]\")"


def available() -> bool:
    """Whether ``llama_cpp`` can be imported."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


@lru_cache(maxsize=4)
def _llama(path: str, threads: int, n_ctx: int) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)


def generate(path: str, input_ids: list[int], *, max_new_tokens: int, eos: set[int], threads: int,
             n_ctx: int = 2048) -> tuple[list[int], float, float]:
    """Greedy llama.cpp decoding of ``input_ids`` with the GGUF file ``path``.

    Returns (new token ids, seconds to the first token, seconds in all), wall clock.
    Raises ``ImportError`` when llama-cpp-python is not installed.
    """
    llama = _llama(path, threads, n_ctx)
    out: list[int] = []
    start = time.perf_counter()
    first = None
    for token in llama.generate(input_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        first = first or time.perf_counter()
        out.append(int(token))
        if token in eos or len(out) >= max_new_tokens:
            break
    end = time.perf_counter()
    return out, (first or end) - start, end - start
