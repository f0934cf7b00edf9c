"""Compare: re-run the last prompt greedily with Medusa off, then with each source of drafts (the
heads only, n-gram prompt lookup only, both in one tree), and report tokens/s, each variant's speedup
and whether its reply is identical to the plain one (greedy Medusa must reproduce plain greedy
decoding, paper 2.3.1, whatever proposes the candidates).
"""

from __future__ import annotations

import dataclasses
import html
import logging
import time
from contextlib import closing
from typing import Iterator

from jinja2 import TemplateError

from medusa_core import ReadProgress, StepRecord

from ..engine import Engine
from ..session import Session
from ..settings import AppSettings
from ..text import ReplyText
from .controls import Controls, sampling_config, tree_argument
from .generation import fit_prompt, record_steps
from .views import SPEED_REDRAWS, STREAMING_SLIDER, Updates, live_view, model_panel, speed_view, tree_view

log = logging.getLogger(__name__)

OFF = "Medusa off"
#: The runs of a Compare: its label, and ``generate``'s ``drafts`` (None: Medusa off), in the order they run.
VARIANTS = {OFF: None, "heads": "heads", "n-gram": "ngram", "hybrid": "hybrid", "corpus": "corpus", "drafter": "eagle"}


def compare(engine: Engine, settings: AppSettings, session: Session, controls: Controls) -> Iterator[Updates]:
    """Re-run the last prompt greedily (with the controls' repetition penalty) with Medusa off, then with
    heads, n-gram, hybrid, (for a model with a corpus of its replies) corpus and (for one with an EAGLE-style drafter)
    drafter drafts; report tokens/s, speedup and identity of each."""
    index = next((i for i in range(len(session.turns) - 1, -1, -1) if session.turns[i].state != "pending"), None)
    if engine.model is None or index is None:
        yield {"compare_result": "Send a message first: Compare re-runs the last prompt."}
        return
    if session.busy:
        yield {"compare_result": "A reply is streaming: Compare runs once it ends."}
        return
    model = engine.model
    greedy = dataclasses.replace(controls, temperature=0.0)
    try:
        tree = tree_argument(model, greedy.tree, greedy.custom_tree)
        ids, _ = fit_prompt(model, greedy, session.history(index), session.turns[index].user)
        config = sampling_config(greedy)
        runs = {mode: engine.steps(model.generate(ids, max_new_tokens=greedy.max_new_tokens, tree=tree, config=config,
                                                  medusa=drafts is not None, drafts=drafts or "heads", progress=True,
                                                  prefill_chunk=settings.prefill_chunk))
                for mode, drafts in VARIANTS.items()
                if (drafts != "corpus" or model.has_corpus) and (drafts != "eagle" or model.has_drafter)}
    except (ValueError, TemplateError) as e:
        yield {"compare_result": f"⚠ {html.escape(str(e))}"}
        return
    results: dict[str, list[StepRecord]] = {}
    session.compare_runs = results  # what Stop reports if it cancels this generator
    session.begin()
    redraws, parked = 0, {"step_slider": STREAMING_SLIDER}  # with the first update
    try:
        for mode, steps in runs.items():
            if session.stop_requested.is_set():
                steps.close()
                continue
            done = results[mode] = []
            last_plot = 0.0
            with closing(record_steps(engine, session, steps, greedy, "compare", session.new_reply(), ReplyText())) as records:
                for record in records:
                    if isinstance(record, ReadProgress):  # a long prompt is being read: Stop ends it after this chunk
                        yield {"compare_result": compare_table(results, running=mode, reading=record, planned=len(runs)), **parked}
                        parked = {}
                        continue
                    done.append(record)
                    if time.monotonic() - last_plot >= settings.redraw_interval_s:
                        last_plot, redraws = time.monotonic(), redraws + 1
                        # The table and the tree at every redraw, the speed chart at every SPEED_REDRAWS-th, the
                        # slider parked until the end: as a reply streams (``app.handlers.chat``).
                        speed = speed_view(engine, session) if redraws % SPEED_REDRAWS == 1 else {}
                        yield {"compare_result": compare_table(results, running=mode, planned=len(runs)),
                               "tree_plot": tree_view(engine, session), **speed, **parked}
                        parked = {}
    except Exception as e:  # noqa: BLE001 - shown in the panel; the app keeps serving
        log.exception("compare failed")
        yield {"compare_result": f"⚠ Compare failed: {type(e).__name__}: {html.escape(str(e))}"}
        return
    finally:
        for steps in runs.values():
            steps.close()
        session.end()
    yield {"compare_result": compare_table(results, running=None, planned=len(runs)), **live_view(engine, session, final=True), "model_panel": model_panel(engine, session)}


def compare_table(
    results: dict[str, list[StepRecord]], running: str | None, reading: ReadProgress | None = None, planned: int | None = None
) -> str:
    """The Compare panel: a row per run so far (tokens/s and tokens/step first, then the tokens the heads and the
    chains -- n-gram, corpus or drafter -- proposed; ``reading``: how far the running one has read its prompt); once all ``planned`` runs ended by themselves
    (EOS, token limit, context), each variant's speedup over Medusa off and whether its reply is identical. A stopped
    Compare (``planned`` None: Stop's report) draws no verdict: a partial run's speed and text say nothing about the
    whole reply."""
    lines = ["| | tok/s | tok/step | tokens | steps | from heads | from chains | time (s) |", "|---|---|---|---|---|---|---|---|"]
    speed: dict[str, float] = {}
    for mode, records in results.items():
        tokens = sum(len(r.token_ids) for r in records)
        decode = [r for r in records if r.step > 0]  # step 0 is the prefill and its first token
        decode_tokens, decode_s = sum(len(r.token_ids) for r in decode), sum(r.latency_s for r in decode)
        total_s = sum(r.latency_s for r in records)
        if decode_s > 0:
            speed[mode] = decode_tokens / decode_s
        per_step = decode_tokens / len(decode) if decode else 0.0
        suffix = "" if mode != running else f" (reading the prompt… {reading.fraction * 100:.0f} %)" if reading else " (running…)"
        heads, ngram = sum(r.head_tokens for r in records), sum(r.ngram_tokens for r in records)
        lines.append(
            f"| {mode}{suffix} | {speed.get(mode, 0.0):.1f} | {per_step:.2f} | {tokens} | {len(decode)} | {heads} | {ngram} "
            f"| {total_s:.2f} |"
        )
    finished = len(results) == planned and all(records and records[-1].stop_reason for records in results.values())
    if running is None and finished:
        plain = [t for r in results[OFF] for t in r.token_ids]
        lines += ["", "| vs Medusa off | speedup | identical reply |", "|---|---|---|"]
        for mode, records in results.items():
            if mode == OFF:
                continue
            reply = [t for r in records for t in r.token_ids]
            first = next((i for i, (x, y) in enumerate(zip(plain, reply)) if x != y), min(len(plain), len(reply)))
            ratio = speed[mode] / speed[OFF] if speed.get(OFF) and mode in speed else None
            same = "**yes** ✓" if reply == plain else f"**no**: differs from token {first}"
            lines.append(f"| {mode} | **{ratio:.2f}×** | {same} |" if ratio else f"| {mode} | – | {same} |")
        lines += [
            "",
            "Greedy decoding, same prompt, tree and token limit; tokens/s leaves out the prompt's prefill; "
            "from heads / chains: accepted tokens each source proposed (chains: n-gram, corpus or drafter).",
        ]
    elif running is None:
        lines += ["", "Stopped before every run finished: no speedup or identity verdict."]
    return "\n".join(lines)

