"""Event handlers of the page, as plain functions of (engine, settings, session, controls, values).

Every handler returns (or yields, for the streaming ones) a dict of named outputs, e.g.
``{"chatbot": [...], "tree_plot": Figure}``; ``app.ui`` maps names to components, so a handler never
depends on the order of an outputs list and tests read results by name.

Streaming replies (``respond``, ``compare``) run the engine in the handler's own generator and hand
an update to the page at most every ``settings.stream_interval_s`` (chat text) and
``settings.redraw_interval_s`` (plots, summary): the engine keeps decoding between updates.
"""

from __future__ import annotations

import dataclasses
import html
import json
import logging
import os
import time
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterator, Sequence

import gradio as gr
import torch
from jinja2 import TemplateError

from medusa_core import MedusaModel, StepRecord

from .charts import empty_figure, speed_figure, tree_figure
from .engine import Engine
from .session import Session, Turn
from .settings import AppSettings
from .stats import StepRow, decode_tokens_per_s, summarize, summary_markdown, write_csv
from .text import ReplyText, StreamingDetokenizer, chat_messages, prompt_ids, token_label

log = logging.getLogger(__name__)

CUSTOM_TREE = "custom"  # the tree dropdown's entry that selects the custom-tree textbox
STOP_WAIT_S = 30.0  # how long Stop and Clear wait for a running reply to finish its current step
Updates = dict[str, Any]


@dataclass(frozen=True)
class Controls:
    """The page's generation controls, read when a reply starts (a change applies to the next reply)."""

    medusa: bool
    temperature: float
    sampling: str  # "typical" or "exact" (medusa_core.SAMPLING_MODES); matters when temperature > 0
    posterior_threshold: float  # ε
    posterior_alpha: float  # δ
    tree: str | None  # a tree name, CUSTOM_TREE, or None for the model's default tree
    custom_tree: str  # JSON list of paths, used when tree == CUSTOM_TREE
    max_new_tokens: int
    seed: int | None  # None: a fresh seed per reply (only matters when temperature > 0)
    system_prompt: str
    highlight: bool  # highlight the tokens accepted from the heads

    @classmethod
    def from_settings(cls, settings: AppSettings) -> "Controls":
        """The controls as the page first shows them."""
        return cls(
            medusa=True,
            temperature=settings.temperature,
            sampling=settings.sampling,
            posterior_threshold=settings.posterior_threshold,
            posterior_alpha=settings.posterior_alpha,
            tree=settings.tree,
            custom_tree="",
            max_new_tokens=settings.max_new_tokens,
            seed=None,
            system_prompt=settings.system_prompt,
            highlight=False,
        )


CONTROL_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Controls))

LIVE_VIEW = ("tree_plot", "step_slider", "speed_plot", "summary")
#: The named outputs each handler may return. Each event updates only these components: every extra
#: output costs the browser work at every streamed update.
OUTPUTS: dict[str, tuple[str, ...]] = {
    "page_status": ("banner", "timer", "tree", "model_panel", "tree_status"),
    "add_user": ("message", "chatbot", "reply_status"),
    "respond": ("chatbot", "tree_status", "reply_status", "model_panel", *LIVE_VIEW),
    "regenerate": ("chatbot", "reply_status"),
    "compare": ("compare_result", "model_panel", *LIVE_VIEW),
    "stop": ("chatbot", "reply_status", "model_panel", *LIVE_VIEW),
    "clear": ("chatbot", "message", "reply_status", *LIVE_VIEW),
    "rerender_chat": ("chatbot",),
    "show_step": ("tree_plot",),
    "check_tree": ("tree_status",),
    "export_csv": ("csv_file", "csv_path"),
}


# ------------------------------------------------------------------------------------------ views
def chat_view(session: Session, highlight: bool) -> list[dict[str, str]]:
    """The Chatbot's messages. Text is shown preformatted (code stays code), free tokens optionally marked."""
    messages = []
    for turn in session.turns:
        messages.append({"role": "user", "content": f'<pre class="medusa-user">\n{html.escape(turn.user)}</pre>'})
        if turn.state == "pending" and not turn.error:
            continue
        content = turn.reply.html(highlight) if turn.reply.runs else ""
        if turn.state == "stopped":
            content += '<p class="medusa-note">(stopped)</p>'
        if turn.error:
            content += f'<p class="medusa-error">⚠ {html.escape(turn.error)}</p>'
        if turn.note:
            content += f'<p class="medusa-note">{html.escape(turn.note)}</p>'
        messages.append({"role": "assistant", "content": content})
    return messages


STOP_REASON_TEXT = {
    "eos": "ended by the model",
    "max_new_tokens": "hit the token limit",
    "context": "filled the context window",
    "stopped": "stopped",
}


def reply_status(session: Session) -> str:
    """One line under the chat about the latest reply: waiting, generating, or its numbers."""
    if not session.turns:
        return ""
    turn = session.turns[-1]
    if turn.state == "pending":
        return "Waiting for the model…"
    if turn.state == "streaming":
        return "Generating…"
    rows = session.reply_rows(turn.reply_index) if turn.reply_index is not None else []
    if not rows:
        return "Latest reply: not generated (see the chat)." if turn.state == "error" else "Latest reply: stopped before it started."
    tokens = sum(r.accepted_tokens for r in rows)
    seconds = sum(r.step_latency_ms for r in rows) / 1e3
    speed = decode_tokens_per_s(rows)
    mode = "Medusa, " + rows[0].tree_name if rows[0].mode == "medusa" else "Medusa off"
    return (
        f"Latest reply: {tokens} tokens in {seconds:.2f} s · {tokens / len(rows):.2f} tokens/step · "
        f"{'–' if speed is None else f'{speed:.1f}'} tokens/s ({mode}) · {STOP_REASON_TEXT.get(rows[-1].stop_reason, turn.state)}"
    )


def live_view(engine: Engine, session: Session, final: bool = False) -> Updates:
    """The tree plot and step slider at the latest step of the latest reply, the session's speed chart
    and the summary. With ``final`` (the reply ended) the slider rests on the last step that verified
    a tree: a reply that hits its token limit ends with a one-token step that has nothing to show."""
    records = session.last_records
    n = len(records)
    if n:
        step = n - 1
        if final:
            step = next((i for i in range(n - 1, -1, -1) if records[i].tree_nodes > 1), step)
        tree = tree_figure(records[step], _labels(engine, session, records[step]))
    else:
        step = 0
        tree = empty_figure("Each step's candidate tree appears here while a reply streams", height=420)
    num_heads = engine.model.num_heads if engine.model is not None else 0
    return {
        "tree_plot": tree,
        "step_slider": gr.Slider(
            minimum=0, maximum=max(n - 1, 1), value=step, step=1, label=f"Step of the latest reply ({n} steps)", interactive=n > 1
        ),
        "speed_plot": speed_figure(session.rows),
        "summary": summary_markdown(summarize(session.rows, num_heads)),
    }


def _labels(engine: Engine, session: Session, record: StepRecord) -> list[str]:
    cache = session.last_labels
    for t in record.node_token_ids:
        if t not in cache:
            cache[t] = token_label(engine.model.tokenizer, t)
    return [cache[t] for t in record.node_token_ids]


def model_panel(engine: Engine, session: Session | None = None) -> str:
    """The model panel as Markdown: names, precision, device, heads, tree in use, memory."""
    if engine.model is None:
        return f"**{html.escape(engine.status())}**"
    model = engine.model
    d = model.describe()
    in_use = session.last_records[0].tree_name if session is not None and session.last_records else None
    backbone = {"nf4": "4-bit NF4", "int8": "8-bit"}.get(d["quantization"], "not quantized")
    rows = [
        ("model", f"`{d['model']}`"),
        ("base model", f"`{d['base_model']}`"),
        ("precision", f"backbone {backbone}, computing in {d['dtype']}; heads {d['dtype']}"),
        ("device", d["device"]),
        ("Medusa heads", f"{d['num_heads']} ({d['head_layers']} residual block{'s' if d['head_layers'] != 1 else ''} each)"),
        ("context window", f"{d['max_context']} tokens"),
        ("tree in use", f"{in_use} (latest reply)" if in_use else f"{d['default_tree']} (the model's default)"),
        ("chat template", "the tokenizer's" if getattr(model.tokenizer, "chat_template", None) else "Vicuna v1.1 (the tokenizer has none)"),
        ("weights", f"{d['parameter_bytes'] / 2**20:.1f} MiB"),
        ("memory used", _memory_used(model)),
        ("loaded in", f"{engine.load_seconds:.1f} s"),
    ]
    (k0, v0), *rest = rows
    return f"| {k0} | {v0} |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rest)


def _memory_used(model: MedusaModel) -> str:
    if model.device.type == "cuda":
        allocated = torch.cuda.memory_allocated(model.device) / 2**20
        peak = torch.cuda.max_memory_allocated(model.device) / 2**20
        return f"{allocated:.0f} MiB on {model.device} (peak {peak:.0f} MiB)"
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource  # not Linux: the peak is what is available

        return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB peak resident (whole app)"
    return f"{rss / 2**20:.0f} MiB resident (whole app process)"


def tree_choices(model: MedusaModel) -> list[tuple[str, str]]:
    """(label, value) pairs for the tree dropdown: the model's own trees, presets that fit, chain and
    dense trees, and the custom tree."""
    k = model.num_heads
    names = model.tree_names()
    names += [f"chain_{d}" for d in range(1, k + 1) if f"chain_{d}" not in names]
    dense = {"dense_4x2": 2, "dense_3x2x2": 3, "dense_2x2x2x2": 4, "dense_3x3x2x2x1": 5}
    names += [n for n, depth in dense.items() if depth <= k]
    choices = []
    for name in names:
        try:
            nodes = len(model.resolve_tree(name)[1]) + 1
        except ValueError:  # a model tree deeper than its heads: not offered
            continue
        own = " · model's own" if name in model.trees else ""
        choices.append((f"{name} ({nodes} nodes{own})", name))
    return choices + [("custom (JSON paths below)", CUSTOM_TREE)]


# ------------------------------------------------------------------------------------------ trees
def tree_argument(model: MedusaModel, tree: str | None, custom_tree: str) -> str | list[list[int]] | None:
    """The ``tree`` for ``model.generate`` from the tree controls; ValueError with the validator's message."""
    if tree != CUSTOM_TREE:
        if tree:
            model.resolve_tree(tree)
        return tree or None
    try:
        paths = json.loads(custom_tree)
    except json.JSONDecodeError as e:
        raise ValueError(f"the custom tree is not valid JSON ({e.msg}); write paths like [[0], [1], [0, 0]]") from e
    if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
        raise ValueError("the custom tree must be a JSON list of paths, e.g. [[0], [1], [0, 0]]")
    model.resolve_tree(paths)
    return paths


def check_tree(engine: Engine, tree: str | None, custom_tree: str) -> Updates:
    """The tree status line: for a custom tree its node count and depth, or the validator's message."""
    if engine.model is None or tree != CUSTOM_TREE:
        return {"tree_status": ""}
    if not custom_tree.strip():
        return {"tree_status": "Write the tree as a JSON list of paths, e.g. `[[0], [1], [0, 0], [0, 0, 0]]`."}
    try:
        name, choices = engine.model.resolve_tree(tree_argument(engine.model, tree, custom_tree))
    except ValueError as e:
        return {"tree_status": f"⚠ {html.escape(str(e))}"}
    return {"tree_status": f"✓ `{name}`: {len(choices) + 1} nodes, depth {max(map(len, choices))}"}


# ------------------------------------------------------------------------------------------- chat
def add_user(engine: Engine, session: Session, message: str, highlight: bool) -> Updates:
    """Append the user's message (Enter or Send). Empty messages are ignored; while the model loads
    or a reply runs, the message stays in the box."""
    text = (message or "").strip()
    if not text:
        return {"message": ""}
    if not engine.ready:
        gr.Warning(engine.status())
        return {}
    if session.busy:
        gr.Warning("A reply is still streaming: wait for it or press Stop.")
        return {}
    session.turns.append(Turn(user=text))
    return {"message": "", "chatbot": chat_view(session, highlight), "reply_status": reply_status(session)}


def respond(engine: Engine, settings: AppSettings, session: Session, controls: Controls) -> Iterator[Updates]:
    """Stream the reply to the pending user message: chat text, live tree, charts, summary."""
    index = next((i for i, t in enumerate(session.turns) if t.state == "pending"), None)
    if index is None or engine.model is None or session.busy:
        yield {}
        return
    model, turn = engine.model, session.turns[index]
    try:
        tree = tree_argument(model, controls.tree, controls.custom_tree) if controls.medusa else None
        ids, dropped = _fit_prompt(model, controls, session.history(index), turn.user)
        steps = model.generate(
            ids,
            max_new_tokens=controls.max_new_tokens,
            tree=tree,
            temperature=controls.temperature,
            posterior_threshold=controls.posterior_threshold,
            posterior_alpha=controls.posterior_alpha,
            medusa=controls.medusa,
            seed=controls.seed,
            sampling=controls.sampling,
        )
    except (ValueError, TemplateError) as e:  # too-long prompt, invalid tree, bad control value, template error
        turn.state, turn.error = "error", f"Not sent: {e}"
        yield {"chatbot": chat_view(session, controls.highlight), "tree_status": f"⚠ {html.escape(str(e))}", "reply_status": reply_status(session)}
        return
    if dropped:
        turn.note = f"{dropped} earlier turn{'s' if dropped > 1 else ''} left out to fit the {model.max_context}-token context"
    turn.state, turn.reply = "streaming", ReplyText()
    session.begin()
    try:
        yield from _stream(engine, settings, session, controls, steps, turn)
    finally:  # also when Stop cancels this generator
        if turn.state == "streaming":
            turn.state = "stopped"
        session.end()
    yield {
        "chatbot": chat_view(session, controls.highlight),
        **live_view(engine, session, final=True),
        "model_panel": model_panel(engine, session),
        "reply_status": reply_status(session),
    }


def _stream(
    engine: Engine, settings: AppSettings, session: Session, controls: Controls, steps: Iterator[StepRecord], turn: Turn
) -> Iterator[Updates]:
    """Record the reply's steps and yield throttled page updates; failures end up in the chat."""
    last_chat = last_plot = 0.0
    try:
        turn.reply_index = session.new_reply()
        with closing(_record_steps(engine, session, steps, controls, "chat", turn.reply_index, turn.reply)) as records:
            for _ in records:
                now = time.monotonic()
                if now - last_plot >= settings.redraw_interval_s:
                    status = {"reply_status": reply_status(session)} if last_plot == 0.0 else {}
                    last_plot = last_chat = now
                    yield {"chatbot": chat_view(session, controls.highlight), **live_view(engine, session), **status}
                elif now - last_chat >= settings.stream_interval_s:
                    last_chat = now
                    yield {"chatbot": chat_view(session, controls.highlight)}
        turn.state = "stopped" if session.rows[-1].stop_reason == "stopped" else "done"
    except Exception as e:  # noqa: BLE001 - any failure inside the model is shown in the chat; the app keeps serving
        log.exception("generation failed")
        turn.state, turn.error = "error", f"Generation failed: {type(e).__name__}: {e}"


def _record_steps(
    engine: Engine,
    session: Session,
    steps: Iterator[StepRecord],
    controls: Controls,
    source: str,
    reply_index: int,
    reply: ReplyText,
) -> Iterator[StepRecord]:
    """Consume the engine's steps: record each in the session's statistics and the reply's text.

    Stops after the current step when Stop is pressed; closing this generator closes the engine's
    iterator, which releases the KV cache.
    """
    session.last_records = []
    detok = StreamingDetokenizer(engine.model.tokenizer)
    try:
        for record in steps:
            session.rows.append(
                StepRow.from_record(
                    record,
                    session_id=session.id,
                    reply_index=reply_index,
                    source=source,
                    temperature=controls.temperature,
                    posterior_threshold=controls.posterior_threshold,
                    posterior_alpha=controls.posterior_alpha,
                )
            )
            session.last_records.append(record)
            for j, token in enumerate(record.token_ids):
                reply.append(detok.push(token), free=j > 0)  # token 0 is the backbone's own
            yield record
            if session.stop_requested.is_set() and record.stop_reason is None:
                session.rows[-1] = dataclasses.replace(session.rows[-1], stop_reason="stopped")
                break
    finally:
        steps.close()
        reply.append(detok.flush(), free=False)


def _fit_prompt(model: MedusaModel, controls: Controls, history: list[tuple[str, str]], user: str) -> tuple[torch.Tensor, int]:
    """Prompt ids [1, T]; the oldest turns are left out while the prompt leaves less than
    min(max_new_tokens, context / 4) tokens for the reply. Returns (ids, turns left out)."""
    room = min(controls.max_new_tokens, model.max_context // 4)
    dropped = 0
    while True:
        ids = prompt_ids(model.tokenizer, chat_messages(controls.system_prompt, history, user))
        if not history or ids.shape[1] + room <= model.max_context:
            return ids, dropped
        history, dropped = history[1:], dropped + 1


def stop(engine: Engine, session: Session, highlight: bool) -> Updates:
    """Stop the running reply after its current step, keeping everything streamed so far."""
    session.stop_requested.set()
    session.idle.wait(STOP_WAIT_S)
    for turn in session.turns:
        if turn.state == "pending":  # cancelled while waiting for the model
            turn.state = "stopped"
    return {
        "chatbot": chat_view(session, highlight),
        **live_view(engine, session, final=True),
        "model_panel": model_panel(engine, session),
        "reply_status": reply_status(session),
    }


def regenerate(engine: Engine, session: Session, highlight: bool) -> Updates:
    """Drop the last reply and mark its user message pending (``respond`` runs next)."""
    if session.busy or not session.turns or not engine.ready:
        return {}
    last = session.turns[-1]
    last.reply, last.state, last.error, last.note = ReplyText(), "pending", "", ""
    return {"chatbot": chat_view(session, highlight), "reply_status": reply_status(session)}


def clear(engine: Engine, session: Session) -> Updates:
    """Stop any running reply and empty the conversation. The session's statistics are kept."""
    session.stop_requested.set()
    session.idle.wait(STOP_WAIT_S)
    session.turns.clear()
    session.last_records = []
    return {"chatbot": [], "message": "", "reply_status": "", **live_view(engine, session)}


def show_step(engine: Engine, session: Session, step: float) -> Updates:
    """The candidate tree of one step of the latest reply (the step slider)."""
    if not session.last_records:
        return {}
    step = min(max(int(step), 0), len(session.last_records) - 1)
    return {"tree_plot": tree_figure(session.last_records[step], _labels(engine, session, session.last_records[step]))}


def rerender_chat(session: Session, highlight: bool) -> Updates:
    """Re-render the chat (the highlight toggle)."""
    return {"chatbot": chat_view(session, highlight)}


# ---------------------------------------------------------------------------------------- compare
def compare(engine: Engine, settings: AppSettings, session: Session, controls: Controls) -> Iterator[Updates]:
    """Re-run the last prompt greedily with Medusa off, then on; report tokens/s, speedup, identity."""
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
        ids, _ = _fit_prompt(model, greedy, session.history(index), session.turns[index].user)
        runs = {mode: model.generate(ids, max_new_tokens=greedy.max_new_tokens, tree=tree, medusa=mode == "Medusa on") for mode in ("Medusa off", "Medusa on")}
    except (ValueError, TemplateError) as e:
        yield {"compare_result": f"⚠ {html.escape(str(e))}"}
        return
    results: dict[str, list[StepRecord]] = {}
    session.begin()
    try:
        for mode, steps in runs.items():
            if session.stop_requested.is_set():
                steps.close()
                continue
            done: list[StepRecord] = []
            last_plot = 0.0
            with closing(_record_steps(engine, session, steps, greedy, "compare", session.new_reply(), ReplyText())) as records:
                for record in records:
                    done.append(record)
                    if time.monotonic() - last_plot >= settings.redraw_interval_s:
                        last_plot = time.monotonic()
                        yield {"compare_result": _compare_table({**results, mode: done}, running=mode), **live_view(engine, session)}
            results[mode] = done
    except Exception as e:  # noqa: BLE001 - shown in the panel; the app keeps serving
        log.exception("compare failed")
        yield {"compare_result": f"⚠ Compare failed: {type(e).__name__}: {html.escape(str(e))}"}
        return
    finally:
        for steps in runs.values():
            steps.close()
        session.end()
    yield {"compare_result": _compare_table(results, running=None), **live_view(engine, session, final=True), "model_panel": model_panel(engine, session)}


def _compare_table(results: dict[str, list[StepRecord]], running: str | None) -> str:
    lines = ["| | tokens | steps | tok/step | time (s) | tok/s |", "|---|---|---|---|---|---|"]
    speed: dict[str, float] = {}
    for mode, records in results.items():
        tokens = sum(len(r.token_ids) for r in records)
        decode_s = sum(r.latency_s - r.prefill_s for r in records)
        total_s = sum(r.latency_s for r in records)
        if decode_s > 0:
            speed[mode] = tokens / decode_s
        per_step = tokens / len(records) if records else 0.0
        suffix = " (running…)" if mode == running else ""
        lines.append(
            f"| {mode}{suffix} | {tokens} | {len(records)} | {per_step:.2f} | {total_s:.2f} | {speed.get(mode, 0.0):.1f} |"
        )
    if running is None and len(results) == 2:
        off, on = results["Medusa off"], results["Medusa on"]
        a = [t for r in off for t in r.token_ids]
        b = [t for r in on for t in r.token_ids]
        same = a == b
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        ratio = speed["Medusa on"] / speed["Medusa off"] if speed.get("Medusa off") and "Medusa on" in speed else None
        lines += [
            "",
            f"**Speedup: {ratio:.2f}×**" if ratio else "**Speedup: –**",
            "Identical replies: **yes** ✓" if same else f"Identical replies: **no**: they differ from token {first}",
            "",
            "Greedy decoding, same prompt, tree and token limit; tokens/s leaves out the prompt's prefill.",
        ]
    elif running is None:
        lines += ["", "Stopped before both runs finished."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- export
def export_csv(settings: AppSettings, session: Session) -> Updates:
    """Write the session's steps so far to CSV under the user data folder; the page downloads it."""
    rows: Sequence[StepRow] = list(session.rows)  # a snapshot: a streaming reply may append meanwhile
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = write_csv(rows, settings.exports_dir / f"medusa-chat-{session.id}-{stamp}.csv")
    return {"csv_file": str(path), "csv_path": f"Saved {len(rows)} steps to `{path}`"}


# ---------------------------------------------------------------------------------------- loading
def page_status(engine: Engine, settings: AppSettings, session: Session) -> Updates:
    """What the page shows about the model: while loading the status line only; once ready (or
    failed) also the tree choices and the model panel, and the polling timer switches off."""
    if engine.model is None and engine.error is None:
        return {"banner": engine.status()}
    updates: Updates = {"banner": "" if engine.ready else f"⚠ {engine.status()}", "timer": gr.Timer(active=False)}
    if engine.ready:
        model = engine.model
        choices = tree_choices(model)
        values = [v for _, v in choices]
        wanted = settings.tree or model.default_tree
        updates |= {
            "tree": gr.Dropdown(choices=choices, value=wanted if wanted in values else model.default_tree),
            "model_panel": model_panel(engine, session),
            "tree_status": "" if wanted in values else f"⚠ unknown tree {settings.tree!r}: using {model.default_tree}",
        }
    return updates
