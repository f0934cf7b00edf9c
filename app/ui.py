"""The page: ``build_ui(engine, settings) -> gr.Blocks``. Layout and event wiring only; the behaviour
lives in the ``app.handlers`` package, whose named outputs are mapped to components here.

Generation events (the reply after Send, Regenerate or an edit; Compare) share one concurrency
group of size 1: one generation at a time on the model, the others queue. Everything else (Stop,
exports, the slider) runs beside it, so Stop and Export work while a reply streams. What runs in
the browser (keys, plain-text copy) is ``assets/app.js``, started on page load.
"""

from __future__ import annotations

import functools
import html
import inspect
from contextlib import closing
from typing import Any, Callable, Sequence

import gradio as gr

from medusa_core import SAMPLING_MODES

from . import handlers, paths
from .charts import EMPTY_TREE, empty_figure, speed_figure
from .engine import Engine
from .handlers import CONTROL_NAMES, CUSTOM_TREE, Controls
from .handlers.controls import CONTROL_RANGES, DRAFTS_INFO, FILTER_INFO, TREE_INFO, read_controls
from .session import Session
from .settings import AppSettings
from .stats import DRAFT_CHOICES, summarize, summary_markdown

# The status line under the chat says what a reply is doing, so no spinners: each costs the browser work per update.
MODEL_QUEUE = dict(concurrency_id="model", concurrency_limit=1, show_progress="hidden")
QUICK = dict(queue=False, show_progress="hidden")
# Events that can refuse with a warning (send, Regenerate, edit) run on the queue: outside it Gradio
# cannot deliver a gr.Warning to the page (it falls back to Python's warnings, the server log only).
ASK = dict(queue=True, concurrency_id="ask", concurrency_limit=None, show_progress="hidden")
# A reply's own events beside the model's queue: the live tree and speed chart beside it, the final view after it
# (``handlers.follow_reply``, ``handlers.finish_reply``). Queued: outside the queue Gradio sends a generator's first update only.
BESIDE = dict(queue=True, concurrency_id="beside", concurrency_limit=None, show_progress="hidden")

# Runs in the browser after Export: download the file the handler just wrote (one click for the user).
DOWNLOAD_JS = """
(file) => {
  if (file && file.url) {
    const a = document.createElement("a");
    a.href = file.url;
    a.download = file.orig_name || "medusa-chat-export";
    document.body.appendChild(a);
    a.click();
    a.remove();
  }
  return [];
}
"""


def _named(fn: Callable[..., Any], outputs: dict[str, gr.components.Component]) -> Callable[..., Any]:
    """Adapt a handler that returns (or yields) ``{name: value}`` to Gradio's ``{component: value}``.

    ``outputs`` maps the names the handler may return (``handlers.OUTPUTS``) to components. The
    adapter shows Gradio the handler's own signature, which is how Gradio finds a parameter
    annotated ``gr.EditData`` (or other event data) to fill in.
    """

    def to_components(update: dict[str, Any]) -> dict[Any, Any]:
        return {outputs[name]: value for name, value in update.items()}

    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def stream(*args: Any) -> Any:
            with closing(fn(*args)) as updates:  # Stop closes this generator, which closes the handler's
                for update in updates:
                    yield to_components(update)

        stream.__name__ = _name(fn)
        return stream

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        return to_components(fn(*args))

    call.__name__ = _name(fn)
    return call


def _name(fn: Callable[..., Any]) -> str:
    """The handler's name (API names and logs), also through ``functools.partial``."""
    return getattr(getattr(fn, "func", fn), "__name__", "handler")


def _controls_of(values: Sequence[Any], refused_in: str | None) -> Controls | dict[str, Any]:
    """``Controls`` from the control components' raw values, in ``CONTROL_NAMES`` order.

    A rejected value (``read_controls``'s message names the control and what it allows) is shown as a
    warning and written to the output ``refused_in``, whose update is returned instead; with
    ``refused_in`` None (the events only API clients call with values the page has not checked) it is
    raised as a ``gr.Error`` with that message and no traceback in the log.
    """
    try:
        return read_controls(dict(zip(CONTROL_NAMES, values)))
    except ValueError as e:
        if refused_in is None:
            raise gr.Error(str(e), print_exception=False) from None
        gr.Warning(str(e))
        return {refused_in: f"⚠ Not sent: {html.escape(str(e), quote=False)}"}


def _bounds(name: str) -> tuple[float, float]:
    """(minimum, maximum) of a slider control, from ``CONTROL_RANGES`` (what ``read_controls`` checks)."""
    limits = CONTROL_RANGES[name]
    assert limits.maximum is not None, name
    return limits.minimum, limits.maximum


def build_ui(engine: Engine, settings: AppSettings) -> gr.Blocks:
    """The whole page for one engine and one set of settings. Loads nothing; safe to call in tests.

    Three columns at desktop widths: the chat; the live view beside it (the tree being verified and
    the speed chart, visible while the reply streams); the controls in tabs. Each column has a
    minimum width, so on a narrow window they stack.
    """
    defaults = Controls.from_settings(settings)
    with gr.Blocks(title="Medusa chat", analytics_enabled=False, fill_width=True) as demo:
        session = gr.State(Session)
        saved = gr.BrowserState([], storage_key="medusa-chat-conversation")
        with gr.Row(elem_id="header"):
            gr.Markdown("## Medusa chat: one backbone, several heads, a tree of guesses per step")
        banner = gr.Markdown(elem_id="banner")
        timer = gr.Timer(0.5, active=True)
        with gr.Row(equal_height=False):
            with gr.Column(scale=5, min_width=460, elem_id="chat-column"):
                chatbot = gr.Chatbot(
                    elem_id="chat", height=560, label="Chat", autoscroll=True, feedback_options=None,
                    buttons=["copy"],  # copies plain text: assets/app.js turns the rendered HTML back into text
                    editable="user",  # edit and resend a message of yours
                    # Messages are ready HTML (app.text): no Markdown or LaTeX pass in the browser at every update.
                    render_markdown=False, latex_delimiters=[],
                )
                with gr.Row():
                    message = gr.Textbox(
                        elem_id="message", show_label=False, placeholder="Message (Enter sends, Esc stops)",
                        lines=1, max_lines=8, scale=5, min_width=260, autofocus=True,
                    )
                    send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="send")
                    stop = gr.Button("Stop", variant="stop", scale=1, min_width=80, elem_id="stop")
                with gr.Row():
                    regenerate = gr.Button("Regenerate (Ctrl+Enter)", size="sm", elem_id="regenerate")
                    clear = gr.Button("Clear", size="sm", elem_id="clear")
                    highlight = gr.Checkbox(defaults.highlight, label="Highlight drafted tokens", elem_id="highlight")
                status_line = gr.Markdown(elem_id="reply-status")
            with gr.Column(scale=4, min_width=400, elem_id="live-column"):
                tree_plot = gr.Plot(empty_figure(EMPTY_TREE, 380), elem_id="tree-plot", show_label=False)
                step_slider = gr.Slider(0, 1, 0, step=1, label="Step of the latest reply", interactive=False, elem_id="step-slider")
                speed_plot = gr.Plot(speed_figure([]), elem_id="speed-plot", show_label=False)
                summary = gr.Markdown(summary_markdown(summarize([], 0)), elem_id="summary")
            with gr.Column(scale=3, min_width=300, elem_id="side-column"):
                with gr.Tab("Controls"):
                    medusa = gr.Checkbox(defaults.medusa, label="Medusa (off = plain decoding, one token per step)", elem_id="medusa")
                    drafts = gr.Radio(DRAFT_CHOICES, value=defaults.drafts, label="Drafts", info=DRAFTS_INFO, elem_id="drafts")
                    tree = gr.Dropdown([], value=None, label="Tree", info=TREE_INFO, elem_id="tree")
                    custom_tree = gr.Textbox(
                        defaults.custom_tree, label="Custom tree (JSON paths of head ranks)", placeholder="[[0], [1], [0, 0], [0, 0, 0]]",
                        visible=False, elem_id="custom-tree",
                    )
                    tree_status = gr.Markdown(elem_id="tree-status")
                    with gr.Row():
                        greedy_button = gr.Button("Greedy (exactness demo)", size="sm", elem_id="greedy-preset", min_width=120)
                        chat_button = gr.Button("Chat defaults", size="sm", elem_id="chat-preset", min_width=120)
                    temperature = gr.Slider(*_bounds("temperature"), defaults.temperature, step=0.05, label="Temperature (0 = greedy)", elem_id="temperature")
                    top_p = gr.Slider(*_bounds("top_p"), defaults.top_p, step=0.01, label="Top-p (1 = off)", info=FILTER_INFO["top_p"], elem_id="top-p")
                    top_k = gr.Number(defaults.top_k, label="Top-k (0 = off)", info=FILTER_INFO["top_k"], precision=0,
                                      minimum=CONTROL_RANGES["top_k"].minimum, elem_id="top-k")
                    min_p = gr.Slider(*_bounds("min_p"), defaults.min_p, step=0.01, label="Min-p (0 = off)", info=FILTER_INFO["min_p"], elem_id="min-p")
                    repetition_penalty = gr.Slider(
                        *_bounds("repetition_penalty"), defaults.repetition_penalty, step=0.01, label="Repetition penalty (1 = off)",
                        elem_id="repetition-penalty",
                        info="divides the score of every token already in the conversation (HF generate); applies at temperature 0 too",
                    )
                    sampling = gr.Radio(
                        list(SAMPLING_MODES), value=defaults.sampling, label="Sampling (temperature > 0)",
                        info="typical: paper's typical acceptance, fast, drifts from the model's distribution (uses ε, δ); "
                        "exact: rejection sampling, replies follow the model's own sampling distribution (ε, δ unused)",
                        elem_id="sampling",
                    )
                    posterior_threshold = gr.Slider(*_bounds("posterior_threshold"), defaults.posterior_threshold, step=0.01, label="ε posterior threshold (typical sampling only)", elem_id="epsilon")
                    posterior_alpha = gr.Slider(*_bounds("posterior_alpha"), defaults.posterior_alpha, step=0.01, label="δ posterior alpha: threshold min(ε, δ·exp(−entropy)) (typical only)", elem_id="delta")
                    max_new_tokens = gr.Slider(*_bounds("max_new_tokens"), defaults.max_new_tokens, step=1, label="Max new tokens", elem_id="max-new-tokens")
                    seed = gr.Number(
                        -1 if defaults.seed is None else defaults.seed, label="Seed (−1 = a fresh one per reply; matters when temperature > 0)",
                        precision=0, minimum=CONTROL_RANGES["seed"].minimum, elem_id="seed",
                    )
                    system_prompt = gr.Textbox(
                        defaults.system_prompt, label="System prompt", lines=2, elem_id="system-prompt",
                        placeholder="empty: the model's own default system prompt (its chat template's; see the Model tab)",
                    )
                with gr.Tab("Compare"):
                    gr.Markdown("Re-runs the last prompt greedily with Medusa off, then with each source of drafts (heads only, "
                                "n-gram only, hybrid, heads + corpus, drafter + corpus), with the tree and token limit of Controls.")
                    compare = gr.Button("Compare Medusa off / heads / n-gram / hybrid / corpus / drafter", variant="primary", elem_id="compare")
                    compare_result = gr.Markdown(elem_id="compare-result")
                with gr.Tab("Model"):
                    model_info = gr.Markdown(handlers.model_panel(engine), elem_id="model-panel")
                with gr.Tab("Export"):
                    gr.Markdown("Statistics: one row per decoding step of this session (so far, if a reply is streaming). "
                                "Transcript: the conversation as plain text, with each reply's stats.")
                    export = gr.Button("Statistics (CSV)", elem_id="export")
                    with gr.Row():
                        export_md = gr.Button("Transcript (Markdown)", elem_id="export-md", min_width=120)
                        export_json = gr.Button("Transcript (JSON)", elem_id="export-json", min_width=120)
                    export_file = gr.File(label="Exported file", interactive=False, elem_id="export-file")
                    export_path = gr.Markdown(elem_id="export-path")

        outputs = dict(
            banner=banner, timer=timer, chatbot=chatbot, message=message, send=send, saved=saved, tree=tree, tree_status=tree_status,
            model_panel=model_info, compare_result=compare_result, export_file=export_file, export_path=export_path,
            tree_plot=tree_plot, step_slider=step_slider, speed_plot=speed_plot, summary=summary, reply_status=status_line,
            posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha, temperature=temperature, top_k=top_k,
            top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, sampling=sampling, drafts=drafts, medusa=medusa,
        )
        controls = dict(
            medusa=medusa, drafts=drafts, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
            sampling=sampling, posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha,
            tree=tree, custom_tree=custom_tree, max_new_tokens=max_new_tokens, seed=seed, system_prompt=system_prompt,
            highlight=highlight,
        )
        assert tuple(controls) == CONTROL_NAMES

        def event(handler: Callable[..., Any]) -> tuple[Callable[..., Any], list[Any]]:
            """``handler`` adapted to Gradio, and the components it may update (``handlers.OUTPUTS``)."""
            targets = {n: outputs[n] for n in handlers.OUTPUTS[_name(handler)]}
            return _named(handler, targets), list(targets.values())

        def adopting(fn: Callable[..., Any]) -> Callable[..., Any]:
            """``fn(session, *values)`` as a function of (session, the browser's saved conversation,
            *values) that first lets the session adopt it (``Session.adopt``)."""
            if inspect.isgeneratorfunction(fn):

                def run(state: Session, kept: Any, *values: Any) -> Any:
                    state.adopt(kept)
                    yield from fn(state, *values)

            else:

                def run(state: Session, kept: Any, *values: Any) -> Any:
                    state.adopt(kept)
                    return fn(state, *values)

            run.__name__ = _name(fn)
            return run

        def with_controls(
            fn: Callable[..., Any], *extra: Any, refused_in: str | None = None, wanted: Callable[[Session], Any] | None = None
        ) -> tuple[Callable[..., Any], list[Any], list[Any]]:
            """``fn(session, controls, *extra values)`` adapted to Gradio, its outputs and its inputs
            (the session, the saved conversation, every control, then ``extra``). The event must run
            with ``preprocess=False``: ``read_controls`` checks the raw values, so a rejected one is
            named with what its control allows (``_controls_of``; ``refused_in``: where the page shows it)
            and ``fn`` does not run. With ``wanted`` (a generator ``fn`` whose outputs include the status
            line), a session for which ``wanted(session)`` is falsy (nothing to do) gets no update and its
            controls are not read."""
            n = len(CONTROL_NAMES)
            if inspect.isgeneratorfunction(fn):

                def run(state: Session, *values: Any) -> Any:
                    if wanted is not None and not wanted(state):
                        yield {"reply_status": gr.skip()}
                        return
                    controls = _controls_of(values[:n], refused_in)
                    if isinstance(controls, dict):
                        yield controls
                        return
                    yield from fn(state, controls, *values[n:])

            else:

                def run(state: Session, *values: Any) -> Any:
                    controls = _controls_of(values[:n], refused_in)
                    return controls if isinstance(controls, dict) else fn(state, controls, *values[n:])

            run.__name__ = _name(fn)
            adapted, targets = event(adopting(run))
            return adapted, targets, [session, saved, *controls.values(), *extra]

        status_fn, status_out = event(functools.partial(handlers.page_status, engine, settings))
        demo.load(status_fn, None, status_out, **QUICK)
        timer.tick(status_fn, None, status_out, **QUICK)
        restore_fn, restore_out = event(handlers.restore_chat)
        demo.load(restore_fn, [session, saved, highlight], restore_out, **QUICK)
        demo.load(None, js=paths.JS_FILE.read_text(encoding="utf-8"))  # keys, plain-text copy and edit

        # A reply runs only after its send (or Regenerate, or an edit) succeeded: a refused one leaves no pending turn.
        # Events that read the controls skip Gradio's preprocessing: read_controls checks the raw values and
        # names a rejected one (Gradio's own check names no control and shows a bare "Error" over the chat).
        raw = dict(preprocess=False)
        add_fn, add_out, add_in = with_controls(functools.partial(handlers.add_user, engine), message, refused_in="reply_status")
        # The reply reads the controls only when a message waits for it: after a refused send it does nothing.
        reply_fn, reply_out, reply_in = with_controls(
            functools.partial(handlers.respond, engine, settings), wanted=lambda s: handlers.waiting_turn(s) is not None
        )
        follow_fn, follow_out = event(adopting(functools.partial(handlers.follow_reply, engine, settings)))
        finish_fn, finish_out = event(adopting(functools.partial(handlers.finish_reply, engine)))

        def reply_after(asked: Any) -> list[Any]:
            """A reply once ``asked`` (a send, Regenerate, an edit) succeeded: ``respond`` on the model's queue, the
            live tree and speed chart beside it, the final view after it (``app.handlers.chat``); the events Stop and
            Clear cancel."""
            replying = asked.success(reply_fn, reply_in, reply_out, **MODEL_QUEUE, **raw)
            following = asked.success(follow_fn, [session, saved], follow_out, **BESIDE)
            replying.then(finish_fn, [session, saved, highlight], finish_out, **BESIDE)
            return [replying, following]

        sent = gr.on([message.submit, send.click], add_fn, add_in, add_out, **ASK, **raw)
        regenerate_fn, regenerate_out, regenerate_in = with_controls(
            functools.partial(handlers.regenerate, engine), refused_in="reply_status"
        )
        regenerated = regenerate.click(regenerate_fn, regenerate_in, regenerate_out, **ASK, **raw)
        edit_handler = functools.partial(handlers.edit_user, engine)

        def edit_user(state: Session, evt: gr.EditData, kept: Any, *values: Any) -> Any:
            state.adopt(kept)
            read = _controls_of(values, "reply_status")
            return read if isinstance(read, dict) else edit_handler(state, read, evt.index, evt.value)

        edit_fn, edit_out = event(edit_user)
        edited = chatbot.edit(edit_fn, [session, saved, *controls.values()], edit_out, **ASK, **raw)
        compare_fn, compare_out, compare_in = with_controls(
            functools.partial(handlers.compare, engine, settings), refused_in="compare_result"
        )
        comparing = compare.click(compare_fn, compare_in, compare_out, **MODEL_QUEUE, **raw)
        running = [*reply_after(sent), *reply_after(regenerated), *reply_after(edited), comparing]
        stop_fn, stop_out = event(adopting(functools.partial(handlers.stop, engine)))
        stop.click(stop_fn, [session, saved, highlight], stop_out, cancels=running, **QUICK)
        clear_fn, clear_out = event(functools.partial(handlers.clear, engine))
        clear.click(clear_fn, [session], clear_out, cancels=running, **QUICK)
        chatbot.clear(clear_fn, [session], clear_out, cancels=running, **QUICK)  # the chat's own trash icon

        rerender_fn, rerender_out = event(adopting(handlers.rerender_chat))
        highlight.change(rerender_fn, [session, saved, highlight], rerender_out, **QUICK)
        step_fn, step_out = event(functools.partial(handlers.show_step, engine))
        # Arrow keys and typed digits fire `input`, a drag or a typed number's blur `release`. The value
        # is passed unchecked (preprocess=False): show_step clamps an out-of-range number instead of
        # Gradio rejecting it with an error.
        gr.on([step_slider.input, step_slider.release], step_fn, [session, step_slider], step_out,
              preprocess=False, trigger_mode="always_last", **QUICK)
        tree.change(lambda t: gr.Textbox(visible=t == CUSTOM_TREE), [tree], [custom_tree], **QUICK, **raw)
        check_fn, check_out = event(functools.partial(handlers.check_tree, engine))
        gr.on([tree.change, custom_tree.blur, custom_tree.submit], check_fn, [tree, custom_tree], check_out, **QUICK, **raw)
        greedy_fn, greedy_out = event(handlers.greedy_preset)
        greedy_button.click(greedy_fn, None, greedy_out, **QUICK)
        chat_fn, chat_out = event(functools.partial(handlers.chat_preset, engine, settings))
        chat_button.click(chat_fn, None, chat_out, **QUICK)
        notice_fn, notice_out = event(functools.partial(handlers.medusa_notice, engine))
        gr.on([temperature.change, drafts.change], notice_fn, [temperature, drafts], notice_out, **QUICK, **raw)  # the tuned verdict
        explain_fn, explain_out = event(handlers.explain_controls)
        gr.on([demo.load, medusa.change, temperature.change, sampling.change, drafts.change], explain_fn,
              [medusa, temperature, sampling, drafts], explain_out, **QUICK, **raw)
        for button, handler in (
            (export, functools.partial(handlers.export_csv, settings)),
            (export_md, functools.partial(handlers.export_transcript, engine, settings, fmt="md")),
            (export_json, functools.partial(handlers.export_transcript, engine, settings, fmt="json")),
        ):
            export_fn, export_out = event(handler)
            inputs = [session] if button is export else [session, system_prompt]
            button.click(export_fn, inputs, export_out, **QUICK).then(None, [export_file], None, js=DOWNLOAD_JS)
    return demo
