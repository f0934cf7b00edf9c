"""Running the methods: one timed generation (``run_once``) and the interleaved benchmark (``run_benchmark``).

Every method runs on the same loaded weights, in one process, after a warm-up, interleaved prompt by
prompt (with the method order rotated) so that machine drift hits all of them alike. Given several torch
thread counts, every (thread count, method) pair runs on a prompt before the next prompt, both orders
rotated, and each ``Run`` records its thread count, so the accounting keeps one row per method and count.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..drafts import DraftConfig
from ..processors import SamplingConfig
from . import llama_cpp
from .methods import Method
from .prompts import Prompt, encode_prompt

LOOP_NGRAM = 6  # a reply "loops" when some LOOP_NGRAM-token sequence occurs ...
LOOP_TIMES = 4  # ... at least this many times (issue 21's measure of degenerate replies)


def loops(tokens: Sequence[int], n: int = LOOP_NGRAM, times: int = LOOP_TIMES) -> bool:
    """True when some ``n``-token sequence occurs at least ``times`` times in ``tokens`` (overlaps count)."""
    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        counts[gram] = counts.get(gram, 0) + 1
        if counts[gram] >= times:
            return True
    return False


@dataclass(frozen=True)
class Run:
    """One generation of one prompt by one method. Times are wall-clock seconds.

    Attributes:
        method, prompt (index in the prompt set), category, repeat: what was run.
        tokens: new tokens produced.
        steps: decoding steps (backbone forward passes) that produced them. For HF methods the
            prefill pass counts, since it yields the first token; for this project's loop the prefill is
            step 0, which emits the first token, so steps = records.
        wall_s: the whole call, prefill included.
        ttft_s: until the first new token is in the caller's hands.
        step_time_s: time of the ``timed_steps`` decoding steps, prefill excluded.
        timed_steps: steps that ``step_time_s`` covers.
        tree_nodes: N of the heads' tree verified per Medusa step (1 for other methods).
        head_tokens / ngram_tokens: this project's loop: accepted tokens the heads / the n-gram lookup proposed.
        output: the new token ids (compared with the reference method's when greedy).
        sampling: the rule the tokens were chosen by: ``StepRecord.sampling`` for this project's loop
            (greedy, sample, typical, exact); greedy or sample for HF methods.
        ended: the reply ended with an EOS token within the token limit.
        loops: the reply loops (``loops(output)``: some 6-token sequence occurs at least 4 times).
        cpu_s: CPU time this process used during the call (all threads); well below
            ``wall_s × threads`` when other processes took the cores.
        threads: torch's intra-op CPU threads during the call (``torch.get_num_threads()``).
    """

    method: str
    prompt: int
    category: str
    repeat: int
    tokens: int
    steps: int
    wall_s: float
    ttft_s: float
    step_time_s: float
    timed_steps: int
    tree_nodes: int = 1
    output: tuple[int, ...] = field(default=(), repr=False)
    cpu_s: float = 0.0
    sampling: str = "greedy"
    threads: int = 1
    ended: bool = False
    loops: bool = False
    head_tokens: int = 0
    ngram_tokens: int = 0


class _HFClock:
    """A streamer for HF ``generate`` that timestamps the first new token (the first ``put`` is the
    prompt) and a forward pre-hook that counts backbone passes; remove with ``close``."""

    def __init__(self, backbone: torch.nn.Module, device: torch.device):
        self.device = device
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.forwards = 0
        self._puts = 0
        self._hook = backbone.register_forward_pre_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.forwards += 1

    def put(self, value: torch.Tensor) -> None:  # called by generate; value is already on the host
        self._puts += 1
        if self._puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass

    def close(self) -> None:
        self._hook.remove()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # wall-clock timing must wait for queued kernels


def run_once(
    model: Any, method: Method, input_ids: torch.Tensor, *, max_new_tokens: int, pld_tokens: int = 10,
    prompt: int = 0, category: str = "", repeat: int = 0, config: SamplingConfig = SamplingConfig(),
    sampling: str = "typical", draft_config: DraftConfig = DraftConfig(),
) -> Run:
    """Generate one reply to ``input_ids`` [1, T] with ``method`` and time it, every method with the same
    ``config`` (HF ``generate`` gets the same processors): greedy at temperature 0, else sampled (Medusa
    verifies by ``sampling``, see ``MedusaModel.generate``) with seed ``1000 * repeat + prompt``; this project's
    loop takes its n-gram chains and per-step tree shaping from ``draft_config``."""
    input_ids = input_ids.to(model.device)
    prompt_len = input_ids.shape[1]
    seed = 1000 * repeat + prompt
    meta = dict(method=method.name, prompt=prompt, category=category, repeat=repeat, tree_nodes=method.tree_nodes,
                threads=torch.get_num_threads())
    if method.kind == "llama_cpp":
        if config.temperature > 0 or config.repetition_penalty != 1.0:  # llama.cpp's penalty has other semantics
            raise ValueError("method llama_cpp runs plain greedy decoding only: drop it, or use greedy settings")
        output, ttft, wall = llama_cpp.generate(method.source, input_ids[0].tolist(), max_new_tokens=max_new_tokens,
                                                eos=set(model.eos_token_ids), threads=torch.get_num_threads())
        return Run(**meta, tokens=len(output), steps=len(output), wall_s=wall, ttft_s=ttft, step_time_s=wall - ttft,
                   timed_steps=max(len(output) - 1, 0), output=tuple(output), cpu_s=0.0, sampling="greedy",
                   ended=bool(output) and output[-1] in model.eos_token_ids, loops=loops(tuple(output)))
    if method.kind in ("hf", "hf_pld"):
        eos = sorted(model.eos_token_ids)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos or None,  # the same stopping rule as the engine's
            pad_token_id=eos[0] if eos else getattr(model.tokenizer, "pad_token_id", None) or 0,
            attention_mask=torch.ones_like(input_ids),
        )
        if method.kind == "hf_pld":
            kwargs["prompt_lookup_num_tokens"] = pld_tokens
        kwargs["repetition_penalty"] = float(config.repetition_penalty)
        if not config.greedy:  # every value explicit: HF's own default top-k is 50, ours 0 (off)
            kwargs.update(do_sample=True, temperature=float(config.temperature), top_k=int(config.top_k),
                          top_p=float(config.top_p), min_p=float(config.min_p) if config.min_p > 0 else None)
            torch.manual_seed(seed)  # HF samples from the global generator
        _sync(model.device)
        cpu0 = time.process_time()
        clock = _HFClock(model.backbone, model.device)
        try:
            with torch.inference_mode():
                out = model.backbone.generate(input_ids, streamer=clock, **kwargs)
            _sync(model.device)
            end = time.perf_counter()
        finally:
            clock.close()
        output = tuple(out[0, prompt_len:].tolist())
        ttft = (clock.first_token_at or end) - clock.start
        return Run(
            **meta, tokens=len(output), steps=clock.forwards, wall_s=end - clock.start, ttft_s=ttft,
            step_time_s=end - clock.start - ttft, timed_steps=max(clock.forwards - 1, 0), output=output,
            cpu_s=time.process_time() - cpu0, sampling="greedy" if config.greedy else "sample",
            ended=bool(output) and output[-1] in model.eos_token_ids, loops=loops(output),
        )
    if method.kind not in ("baseline", "medusa"):
        raise ValueError(f"unknown method kind {method.kind!r}")
    _sync(model.device)
    cpu0 = time.process_time()
    start = time.perf_counter()
    records = []
    first_at = None
    with contextlib.nullcontext() if method.lean else model._steps.transformers_pass():  # "...@transformers"
        for record in model.generate(
            input_ids, max_new_tokens=max_new_tokens, medusa=method.kind == "medusa",
            tree=[list(p) for p in method.choices] if method.choices else None, drafts=method.drafts,
            config=config, sampling=sampling, seed=seed, draft_config=draft_config,
        ):
            first_at = first_at or time.perf_counter()
            records.append(record)
    end = time.perf_counter()
    output = tuple(t for r in records for t in r.token_ids)
    return Run(
        **meta, tokens=len(output), steps=len(records), wall_s=end - start, ttft_s=(first_at or end) - start,
        step_time_s=sum(r.latency_s for r in records[1:]), timed_steps=len(records) - 1,  # records[0]: the prefill
        output=output, cpu_s=time.process_time() - cpu0, sampling=records[0].sampling,
        ended=records[-1].stop_reason == "eos", loops=loops(output),
        head_tokens=sum(r.head_tokens for r in records), ngram_tokens=sum(r.ngram_tokens for r in records),
    )


def run_benchmark(
    model: Any,
    prompts: Sequence[Prompt],
    methods: Sequence[Method],
    *,
    max_new_tokens: int = 128,
    repeats: int = 3,
    pld_tokens: int = 10,
    warmup_tokens: int = 16,
    system: str | None = None,
    progress: bool = True,
    config: SamplingConfig = SamplingConfig(),
    sampling: str = "typical",
    threads: Sequence[int] = (),
    draft_config: DraftConfig = DraftConfig(),
) -> tuple[list[Run], list[str]]:
    """Run every method on every prompt ``repeats`` times at each torch thread count of ``threads``
    (none: torch's current setting), interleaved prompt by prompt; torch's setting is restored after.

    Prompts that do not leave room for ``max_new_tokens`` in the context window are skipped.
    Returns (runs, notes): notes name each skipped prompt.
    """
    from tqdm.auto import tqdm

    encoded, notes = [], []
    for i, p in enumerate(prompts):
        ids = encode_prompt(model.tokenizer, p, system)
        if ids.shape[1] + max_new_tokens > model.max_context:
            notes.append(f"prompt {i} skipped: {ids.shape[1]} tokens + {max_new_tokens} new > context {model.max_context}")
            continue
        encoded.append((i, p, ids))
    if not encoded:
        raise ValueError("no prompt fits the context window: lower --max-new-tokens")
    torch_threads = torch.get_num_threads()
    counts = list(dict.fromkeys(threads)) or [torch_threads]
    runs: list[Run] = []
    try:
        for t in counts:
            torch.set_num_threads(t)
            for m in methods:  # warm-up: allocator, kernels, tree buffers, this many threads
                run_once(model, m, encoded[0][2], max_new_tokens=min(warmup_tokens, max_new_tokens),
                         pld_tokens=pld_tokens, config=config, sampling=sampling, draft_config=draft_config)
        bar = tqdm(total=repeats * len(encoded) * len(counts) * len(methods), desc="bench", unit="run",
                   disable=not progress)
        for r in range(repeats):
            for j, (i, p, ids) in enumerate(encoded):
                for t in _rotated(counts, j + r):
                    torch.set_num_threads(t)
                    for m in _rotated(methods, j + r):
                        bar.set_postfix_str(f"{m.name}, {t} threads", refresh=False)
                        runs.append(run_once(
                            model, m, ids, max_new_tokens=max_new_tokens, pld_tokens=pld_tokens,
                            prompt=i, category=p.category, repeat=r, config=config, sampling=sampling, draft_config=draft_config,
                        ))
                        bar.update()
        bar.close()
    finally:
        torch.set_num_threads(torch_threads)
    return runs, notes


def _rotated(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` starting at index ``k`` (mod its length), wrapping round."""
    k %= len(items)
    return list(items[k:]) + list(items[:k])

