"""What the page shows, as pure functions of (engine, session): the chat messages, the status line
under the chat, the live view (tree, step slider, speed chart, summary) and the model panel.
"""

from __future__ import annotations

import html
import os
from typing import Any, Sequence

import gradio as gr
import torch

from medusa_core import MedusaModel, ReadProgress, SamplingConfig, StepRecord, eagle

from ..charts import EMPTY_TREE, empty_figure, speed_figure, tree_figure
from ..engine import Engine
from ..session import Session, Turn
from ..stats import (DRAFT_LABELS, StepRow, decode_tokens_per_s, drafted_from, summarize, summary_markdown,
                     verified_heads_tree)
from ..text import template_system_prompt, token_label

#: A handler's result: component name -> new value (``app.handlers.OUTPUTS`` lists the names per handler).
Updates = dict[str, Any]
#: The step slider while a reply (or a Compare) is asked for and streams: it browses a reply's steps once the reply
#: has ended (its re-render is costly).
STREAMING_SLIDER = gr.Slider(interactive=False, label="Step of the latest reply (browse its steps once it ends)")
#: The speed chart and summary redraw once every SPEED_REDRAWS tree redraws while a reply or a Compare streams: a
#: plotly redraw costs the browser tens of ms, and the tree is what changes at every step.
SPEED_REDRAWS = 4


def chat_view(session: Session, highlight: bool) -> list[dict[str, str]]:
    """The Chatbot's messages. Text is shown preformatted (code stays code), free tokens optionally
    marked, and each reply ends with its stats line (live while it streams). A finished reply's HTML is
    kept on its turn (``Turn.shown``) per highlight setting: the chat is rendered every 0.05 s while a reply
    streams, and a long conversation's earlier replies took most of that (2.7 ms at 50 replies of ~250 tokens)."""
    messages = []
    for turn in session.turns:
        messages.append({"role": "user", "content": f'<pre class="medusa-user">\n{html.escape(turn.user)}</pre>'})
        if turn.state == "pending" and not turn.error:
            continue
        if turn.state not in ("done", "stopped", "error"):
            content = _reply_html(session, turn, highlight)
        else:  # nothing of it changes any more but these
            key = (highlight, turn.state, turn.error, turn.note, turn.stats)
            if turn.shown is None or turn.shown[0] != key:
                turn.shown = (key, _reply_html(session, turn, highlight))
            content = turn.shown[1]
        messages.append({"role": "assistant", "content": content})
    return messages


def _reply_html(session: Session, turn: Turn, highlight: bool) -> str:
    """One reply's chat message: its text, then whether it stopped, its error, its note and its stats line."""
    content = turn.reply.html(highlight) if turn.reply.runs else ""
    if turn.state == "stopped":
        content += '<p class="medusa-note">(stopped)</p>'
    if turn.error:
        content += f'<p class="medusa-error">⚠ {html.escape(turn.error)}</p>'
    if turn.note:
        content += f'<p class="medusa-note">{html.escape(turn.note)}</p>'
    stats = turn.stats or turn_stats(session, turn)
    if stats:
        content += f'<p class="medusa-stats">{html.escape(stats)}</p>'
    return content


def message_turn(session: Session, index: int) -> int | None:
    """The index in ``session.turns`` of the user message at ``index`` in ``chat_view``'s list."""
    position = 0
    for i, turn in enumerate(session.turns):
        if position == index:
            return i
        position += 1 if turn.state == "pending" and not turn.error else 2
    return None


STOP_REASON_TEXT = {
    "eos": "ended by the model",
    "max_new_tokens": "hit the token limit",
    "context": "filled the context window",
    "stopped": "stopped",
}


def settings_label(row: StepRow) -> str:
    """The sampling settings a step used, e.g. ``"T 0.2 · top-p 0.9 · rep. 1.1 · exact"`` or ``"greedy"``."""
    config = SamplingConfig(temperature=row.temperature, top_k=row.top_k, top_p=row.top_p, min_p=row.min_p,
                            repetition_penalty=row.repetition_penalty)
    return config.describe() + (f" · {row.sampling}" if row.sampling in ("typical", "exact") else "")


def turn_stats(session: Session, turn: Turn) -> str:
    """A reply's stats line, as LM Studio shows under each message: tokens, decoding tokens/s (live
    while it streams), time to first token and wall time from send to last token (both include any
    wait in the queue and the prompt's prefill), tokens per step, tree and draft source with the accepted
    tokens each source proposed, sampling settings and how it ended."""
    rows = session.reply_rows(turn.reply_index) if turn.reply_index is not None else []
    if not rows:
        return ""
    tokens = sum(r.accepted_tokens for r in rows)
    speed = decode_tokens_per_s(rows)
    parts = [f"{tokens} token{'' if tokens == 1 else 's'}", f"{'–' if speed is None else f'{speed:.1f}'} tokens/s"]
    if turn.sent_at is not None and turn.first_token_at is not None:
        parts.append(f"TTFT {turn.first_token_at - turn.sent_at:.2f} s")
    if turn.state == "streaming":
        return " · ".join(parts + ["generating…"])
    if turn.sent_at is not None and turn.last_token_at is not None:
        parts.append(f"{turn.last_token_at - turn.sent_at:.2f} s total")
    decode = [r for r in rows if r.step > 0]  # step 0 is the prefill and its first token
    if decode:
        parts.append(f"{sum(r.accepted_tokens for r in decode) / len(decode):.2f} tokens/step")
    if rows[0].mode == "medusa":  # also a reply that ended in its first step (the prefill's token)
        # The tree asked for, not a step's: a hybrid step may verify the n-gram chain alone ("ngram").
        drafts = rows[0].drafts
        extra = {"hybrid": " + n-gram", "corpus": " + corpus"}.get(drafts, "")
        tree = {"ngram": "n-gram drafts", "eagle": "drafter + corpus chains"}.get(drafts, f"tree {turn.tree}{extra}")
        parts += [tree, drafted_from(drafts, sum(r.head_tokens for r in rows), sum(r.ngram_tokens for r in rows))]
    else:
        parts.append("Medusa off")
    parts.append(settings_label(rows[-1]))
    parts.append(STOP_REASON_TEXT.get(rows[-1].stop_reason, turn.state))
    return " · ".join(parts)


def reading_status(progress: ReadProgress) -> str:
    """The line under the chat while a long prompt is read: the share of its new tokens read so far."""
    return f"Reading your message… {progress.fraction * 100:.0f} %"


#: The status line under a message sent while the model loads.
WAITING_FOR_LOAD = "Waiting for the model to load: your message is answered once it is ready (Stop or Esc cancels)."


def reply_status(session: Session) -> str:
    """One line under the chat about the latest reply: waiting, generating, or its stats line."""
    if not session.turns:
        return ""
    turn = session.turns[-1]
    if turn.state == "pending":
        return WAITING_FOR_LOAD if turn.waits_for_model else "Waiting for the model…"
    if turn.state == "streaming":
        return "Generating…"
    stats = turn.stats or turn_stats(session, turn)
    if not stats:
        return "Latest reply: not generated (see the chat)." if turn.state == "error" else "Latest reply: stopped before it started."
    return f"Latest reply: {stats}"


def _shown_step(records: Sequence[StepRecord], final: bool) -> int:
    """The step the live view shows: the latest, or with ``final`` (the reply ended) the last one that verified a
    tree: a reply that hits its token limit ends with a one-token step that has nothing to show."""
    last = len(records) - 1
    return next((i for i in range(last, -1, -1) if records[i].tree_nodes > 1), last) if final else last


def tree_view(engine: Engine, session: Session, final: bool = False) -> Any:
    """The tree plot (a plotly Figure) at the latest step of the latest reply (``final``: see ``live_view``), or an
    empty one before any reply."""
    records = session.last_records
    if not records:
        return empty_figure(EMPTY_TREE, height=380)
    step = _shown_step(records, final)
    return tree_figure(records[step], labels(engine, session, records[step]))


def live_view(engine: Engine, session: Session, final: bool = False) -> Updates:
    """The tree plot and step slider at the latest step of the latest reply, the session's speed chart and the
    summary. With ``final`` (the reply ended) tree and slider rest on the last step that verified a tree."""
    n = len(session.last_records)
    updates: Updates = {
        "tree_plot": tree_view(engine, session, final),
        "step_slider": gr.Slider(
            minimum=0, maximum=max(n - 1, 1), value=_shown_step(session.last_records, final) if n else 0, step=1,
            label=f"Step of the latest reply ({n} steps)", interactive=n > 1,
        ),
    }
    return updates | speed_view(engine, session)


def speed_view(engine: Engine, session: Session) -> Updates:
    """The session's speed chart and summary."""
    num_heads = engine.model.num_heads if engine.model is not None else 0
    return {"speed_plot": speed_figure(session.rows), "summary": summary_markdown(summarize(session.rows, num_heads))}


def labels(engine: Engine, session: Session, record: StepRecord) -> list[str]:
    """Display labels [N] of a step's tree nodes, cached per token id for the session's latest reply."""
    cache = session.last_labels
    for t in record.node_token_ids:
        if t not in cache:
            cache[t] = token_label(engine.model.tokenizer, t)
    return [cache[t] for t in record.node_token_ids]


def _tree_in_use(records: Sequence[StepRecord]) -> str | None:
    """The model panel's "tree in use" for the latest reply's steps: the tree of its first step that verified the
    heads' tree (``stats.verified_heads_tree``), what it verified instead where none did, None before any reply."""
    steps = [r for r in records if r.step > 0]
    tree = next((r.tree_name for r in steps if verified_heads_tree(r.tree_name)), None)
    if tree:
        return f"{tree} (latest reply)"
    if not steps:
        return None
    if steps[0].mode != "medusa":
        return "none: Medusa was off for the latest reply"
    return f"none: each step of the latest reply verified a chain ({DRAFT_LABELS.get(steps[0].drafts, steps[0].drafts)} drafts)"


def model_panel(engine: Engine, session: Session | None = None) -> str:
    """The model panel as Markdown: names, precision, device, heads, tree in use and its shaping, memory."""
    if engine.model is None:
        return f"**{html.escape(engine.status())}**"
    model = engine.model
    d = model.describe()
    in_use = _tree_in_use(session.last_records) if session is not None else None
    backbone = {"gguf": "4-bit, the GGUF file's own blocks", "nf4": "4-bit NF4", "int8": "8-bit"}.get(
        d["quantization"], "not quantized")
    rows = [
        ("model", f"`{d['model']}`"),
        ("base model", f"`{d['base_model']}`"),
        ("precision", f"backbone {backbone}, computing in {d['dtype']}; heads {d['head_dtype']}" + _int4_product(d)),
        ("device", d["device"]),
        ("decoding pass", ("lean: compiled, the same bits as transformers' forward" if d["step"] == "lean"
                           else f"transformers' forward ({html.escape(d['step_note'], quote=False)})") + _attention(d)),
        ("Medusa heads", f"{d['num_heads']} ({d['head_layers']} residual block{'s' if d['head_layers'] != 1 else ''} each); "
                         + _drafting(d, model.vocab_size)),
        ("EAGLE drafter", _drafter_chain(model.tuned) if model.has_drafter else "none"),
        ("context window", f"{d['max_context']} tokens"),
        ("tree in use", in_use or f"{d['default_tree']} (the model's default)"),
        ("tree shaping", _shaping(d, model.tuned)),
        ("chat template", "the tokenizer's" if getattr(model.tokenizer, "chat_template", None) else "Vicuna v1.1 (the tokenizer has none)"),
        ("default system prompt", html.escape(template_system_prompt(model.tokenizer) or "none (the template writes none)")),
        ("weights", f"{d['parameter_bytes'] / 2**20:.1f} MiB"),
        ("memory used", _memory_used(model)),
        ("loaded in", f"{engine.load_seconds:.1f} s"),
    ]
    (k0, v0), *rest = rows
    return f"| {k0} | {v0} |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rest)


def _int4_product(d: dict) -> str:
    """Which product the 4-bit layers run, as a clause of the precision row (``MedusaModel.describe()["int4_product"]``)."""
    kinds = {"amx": "the compiled kernel on AMX tiles", "avx512-bf16": "the compiled AVX512-BF16 kernel", "torch": "torch's int4-pack kernel"}
    return f"; int4 product: {kinds[d['int4_product']]}" if d.get("int4_product") in kinds else ""


def _attention(d: dict) -> str:
    """How decoding rows attend, as a clause of the decoding pass row (``MedusaModel.describe()["attention"]``)."""
    kinds = {"row kernel": "the compiled row kernel", "SDPA rows": "SDPA, one call per row group"}
    return f"; attention of decoding rows: {kinds.get(d['attention'], html.escape(str(d['attention']), quote=False))}"


def _drafting(d: dict, vocab_size: int) -> str:
    """The heads' draft vocabulary in words (FR-Spec: ``MedusaHeads.restrict_drafts``)."""
    size = d["draft_vocabulary"]
    if size >= vocab_size:
        return f"drafting among all {vocab_size:,} tokens" + _proposal(d)
    which = "most frequent in their training replies" if d["draft_ranked"] else "first token ids"
    return f"drafting among the {size:,} {which} (of {vocab_size:,})" + _proposal(d)


def _proposal(d: dict) -> str:
    """How the heads' proposal runs, as a clause (``MedusaModel.describe()["proposal"]``)."""
    if d["proposal"] == "compiled":
        return "; proposals by the compiled kernels"
    return f"; proposals by ATen ops ({html.escape(d['proposal_note'], quote=False)})"


def _shaping(d: dict, tuned: dict) -> str:
    """The model's tuned tree shaping in words: τ per settings preset where ``bench tune`` measured one
    (``MedusaModel.tuned``: a reply uses its settings' τ), else ``MedusaModel.min_head_probability``; and the heads'
    temperatures."""
    per_preset = {p: t.min_head_probability for p, t in tuned.items() if t.min_head_probability}
    if not per_preset and not d["min_head_probability"]:
        return "off: every node of the tree is verified (no tuned τ)"
    tau = (", ".join(f"τ = {v:g} at {'greedy' if p == 'greedy' else 'the chat defaults'}" for p, v in per_preset.items())
           if per_preset else f"τ = {d['min_head_probability']:g}")
    return (f"{tau}: a head node is verified when its calibrated path probability reaches it "
            f"(`bench tune`; head temperatures {', '.join(f'{t:g}' for t in d['head_temperatures'])})")


def _drafter_chain(tuned: dict) -> str:
    """The drafter's chains in words: the depth and threshold ``bench tune`` chose per settings preset
    (``TunedSettings.chain_depth``: a reply uses its settings'), else ``eagle.DEPTH`` and ``eagle.THRESHOLD``."""
    per_preset = {p: (t.chain_depth, t.chain_threshold) for p, t in tuned.items() if t.chain_depth is not None}
    chains = (", ".join(f"up to {d} drafts while their probability stays ≥ {t:g} at "
                        f"{'greedy' if p == 'greedy' else 'the chat defaults'}" for p, (d, t) in per_preset.items())
              + " (`bench tune`)") if per_preset else f"up to {eagle.DEPTH} drafts while their probability stays ≥ {eagle.THRESHOLD}"
    return f"one decoder layer in 4 bits, chains of {chains} (Drafts: drafter + corpus)"


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
