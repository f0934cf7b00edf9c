"""Where a decoding step's time goes, by stage: ``python -m medusa_core.bench profile`` (its split table).

Stages are timed with ``time.perf_counter`` around the engine's own calls while a reply is generated
(a CPU runs them synchronously; the timers add well under a microsecond per call, so the step is not
slowed the way ``torch.profiler`` slows it). On a machine that other processes load, pass
``clock=time.thread_time`` with one torch thread: the CPU time of the step's own thread, which
contention inflates far less than wall time. Time is *exclusive*: a stage nested in another (the
LM head's int4 pass inside the LM head) counts for the outer one only. Stages:

- ``int4 linears``: the decoder's ``Int4Linear`` calls (q/k/v/o, gate/up/down; casts included);
- ``attention``: the registered attention function (``invariant.rowwise_attention``);
- ``LM head``: the backbone's logits (``StepRunner.logits``, its int4 pass and float32 refinement);
- ``heads``: the Medusa heads' proposals (``StepRunner.candidates``, their LM-head pass included);
- ``drafter``: the EAGLE-style drafter's calls (``eagle.EagleDrafts``: reading the accepted rows, ``observe``, and
  proposing a chain, ``propose``, the corpus's chain included where it has one);
- ``sampling``: the logits processors and acceptance (``NodeProcessors``, ``verify_tree``);
- ``KV cache``: cache writes and compaction (``GrowingLayer.update``, ``compact_cache``);
- ``lean pass``: the compiled decoder pass (``medusa_core.lean``: its int4 linears, attention and cache
  writes in one call, which the three stages above then do not see);
- ``rest``: the step's wall time minus the above (norms, RoPE, residuals, masks, module calls, Python).
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator
from unittest import mock

import torch
from transformers import AttentionInterface

from .. import invariant, kvcache
from .. import decoding
from ..eagle import EagleDrafts
from ..processors import NodeProcessors
from ..quant.layers import Int4Linear

#: Stages of a step, in table order (``rest`` is what none of them covers).
STAGES = ("int4 linears", "attention", "LM head", "heads", "drafter", "sampling", "KV cache", "lean pass", "rest")


class _Clock:
    """Exclusive time per stage: a stack of open stages, each charged its time minus its children's."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.calls = dict.fromkeys(STAGES, 0)
        self._stack: list[list] = []  # [stage, start, time of nested stages]

    def wrap(self, stage: str, fn: Callable, *, inside_only_itself: bool = False) -> Callable:
        """``fn`` timed as ``stage``; with ``inside_only_itself`` calls nested in another stage are left to it."""

        def timed(*args, **kwargs):
            if inside_only_itself and self._stack:
                return fn(*args, **kwargs)
            self._stack.append([stage, self.clock(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                name, start, nested = self._stack.pop()
                spent = self.clock() - start
                self.seconds[name] += spent - nested
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][2] += spent

        return timed


@contextmanager
def _timed_stages(model: Any, clock: _Clock) -> Iterator[None]:
    invariant.register()  # idempotent: the names exist even for a model that does not use them (the stage stays 0)
    attentions = {name: AttentionInterface()[name] for name in invariant.ROWWISE}
    with ExitStack() as stack:
        patch = lambda target, name, stage, **kw: stack.enter_context(  # noqa: E731
            mock.patch.object(target, name, clock.wrap(stage, getattr(target, name), **kw)))
        patch(Int4Linear, "forward", "int4 linears", inside_only_itself=True)
        patch(kvcache.GrowingLayer, "update", "KV cache")
        patch(decoding, "compact_cache", "KV cache")
        patch(decoding, "verify_tree", "sampling")
        patch(NodeProcessors, "__call__", "sampling")
        patch(model._steps, "logits", "LM head")
        patch(model._steps, "candidates", "heads")
        patch(EagleDrafts, "observe", "drafter")
        patch(EagleDrafts, "propose", "drafter")
        if model._steps.lean is not None:  # the class's call: the step object keeps its other methods (``read``)
            patch(type(model._steps.lean), "__call__", "lean pass")
        for name, attention in attentions.items():
            AttentionInterface.register(name, clock.wrap("attention", attention))
        try:
            yield
        finally:
            for name, attention in attentions.items():
                AttentionInterface.register(name, attention)


def step_split(
    model: Any, prompts: list[torch.Tensor], *, max_new_tokens: int, clock: Callable[[], float] = time.perf_counter,
    **generate_kwargs,
) -> dict[str, Any]:
    """Per-stage wall time of the decoding steps (the prefill left out) of one reply per prompt.

    Args:
        model: a ``MedusaModel`` on the CPU (stage timers assume synchronous ops).
        prompts: [1, T] token ids each.
        clock: seconds as a float (``time.perf_counter``: wall; ``time.thread_time``: this thread's CPU time).
        generate_kwargs: passed to ``generate`` (``medusa=False`` for plain steps, ``tree=...``).

    Returns ``{"steps", "tokens", "step_ms", "ms": {stage: ms per step}, "calls": {stage: calls per step}}``.
    """
    timer, steps, tokens, wall = _Clock(clock), 0, 0, 0.0
    seconds, calls = dict.fromkeys(STAGES, 0.0), dict.fromkeys(STAGES, 0)
    with _timed_stages(model, timer):
        for ids in prompts:
            replies = model.generate(ids, max_new_tokens=max_new_tokens, **generate_kwargs)
            next(replies)  # the prefill: only decoding steps count
            timer.seconds, timer.calls = dict.fromkeys(STAGES, 0.0), dict.fromkeys(STAGES, 0)
            while True:
                start = clock()
                record = next(replies, None)
                if record is None:
                    break
                steps, tokens, wall = steps + 1, tokens + len(record.token_ids), wall + clock() - start
            for stage in STAGES:
                seconds[stage] += timer.seconds[stage]
                calls[stage] += timer.calls[stage]
    ms = {s: 1e3 * seconds[s] / steps for s in STAGES}
    ms["rest"] = 1e3 * wall / steps - sum(ms.values())
    return {"steps": steps, "tokens": tokens, "step_ms": 1e3 * wall / steps, "ms": ms,
            "calls": {s: calls[s] / steps for s in STAGES}}
