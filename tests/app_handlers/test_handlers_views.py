"""What the page shows of a reply and the model: the stats line, the status line, the Model panel.

Handler-level tests of the app on a tiny random Llama with Medusa heads: no browser, no server. Handlers are
called as the page calls them; streaming handlers are iterated, and a Stop is either the Stop handler's flag or
closing the generator (what Gradio's ``cancels=`` does).
"""

from __future__ import annotations

import dataclasses

from app import handlers
from app.handlers import CUSTOM_TREE
from app.session import Session
from app.text import ReplyText
from medusa_core.invariant import ATTENTION_KERNEL

from .handler_support import reply, send


def test_the_model_panel_shows_names_precision_device_heads_and_memory(engine):
    panel = handlers.model_panel(engine, Session())
    for needle in ("base model", "not quantized", "float32", "cpu", "| Medusa heads | 4", "sparse_16 (the model's default)", "MiB",
                   "| decoding pass | transformers' forward (layer 0's self_attn.q_proj is not a 4-bit Int4Linear"):
        assert needle in panel
    assert f"heads {str(engine.model.heads[0][0].linear.weight.dtype).removeprefix('torch.')}" in panel
    kernel = engine.model.backbone.config._attn_implementation == ATTENTION_KERNEL
    assert ("attention of decoding rows: the compiled row kernel" if kernel else "attention of decoding rows: SDPA, one call per row group") in panel
    assert f"drafting among all {engine.model.vocab_size:,} tokens" in panel  # a vocabulary this small is not cut
    d = engine.model.describe()  # bfloat16 heads on a CPU with bfloat16 dot products propose through the kernels
    assert ("; proposals by the compiled kernels" if d["proposal"] == "compiled" else f"; proposals by ATen ops ({d['proposal_note']})") in panel
    assert d["int4_product"] is None and "int4 product" not in panel  # a float backbone has no 4-bit layer


def test_the_model_panel_names_the_tree_of_the_latest_reply(engine, settings, controls):
    session = Session()
    send(engine, settings, session, dataclasses.replace(controls, tree="chain_3"))
    assert "chain_3 (latest reply)" in handlers.model_panel(engine, session)
    # drafts that verify a chain at every step (drafter + corpus, n-gram only) use no tree: the panel says so, not
    # the internal name of a chain's step ("ngram")
    send(engine, settings, session, dataclasses.replace(controls, drafts="ngram"), "def add(a, b): return a + b\ndef add")
    panel = handlers.model_panel(engine, session)
    assert "| tree in use | none: each step of the latest reply verified a chain (n-gram only drafts) |" in panel, panel


def test_the_status_line_follows_the_latest_reply(engine, settings, controls):
    session = Session()
    assert handlers.add_user(engine, session, controls, "def add")["reply_status"] == "Waiting for the model…"
    stream = handlers.respond(engine, settings, session, controls)
    assert next(stream)["reply_status"] == "Generating…"
    final = [*stream, *handlers.finish_reply(engine, session, False)][-1]["reply_status"]
    tokens = sum(r.accepted_tokens for r in session.rows)
    assert final.startswith(f"Latest reply: {tokens} tokens · ") and "tree sparse_16" in final
    handlers.add_user(engine, session, controls, "def add")
    bad_tree = dataclasses.replace(controls, tree=CUSTOM_TREE, custom_tree="[[0], [")
    assert reply(engine, settings, session, bad_tree)[-1]["reply_status"] == "Latest reply: not generated (see the chat)."
    handlers.add_user(engine, session, controls, "return")
    stream = handlers.respond(engine, settings, session, dataclasses.replace(controls, medusa=False))
    next(stream)
    session.stop_requested.set()  # the Stop handler's first act; the reply ends after this step
    list(stream)
    shown = handlers.stop(engine, session, False)["reply_status"]
    assert "Medusa off" in shown and shown.endswith(" · stopped")


def test_each_reply_shows_its_stats_with_ttft_and_wall_time_from_send_to_last_token(engine, settings, controls):
    session = Session()
    handlers.add_user(engine, session, controls, "def add")
    live = [u["chatbot"][-1]["content"] for u in reply(engine, settings, session, controls) if "chatbot" in u]
    assert any("generating…" in c and "tokens/s" in c for c in live[:-1])  # live tokens/s while it streams
    turn = session.turns[0]
    tokens = sum(r.accepted_tokens for r in session.rows)
    assert turn.stats.startswith(f"{tokens} tokens · ") and "TTFT" in turn.stats and "s total" in turn.stats
    assert 0 <= turn.first_token_at - turn.sent_at <= turn.last_token_at - turn.sent_at
    assert f'<p class="medusa-stats">{turn.stats}</p>' in live[-1]
    send(engine, settings, session, controls, "return")
    first = handlers.rerender_chat(session, False)["chatbot"][1]["content"]
    assert turn.stats in first  # kept per message


def test_the_stats_line_names_the_tree_asked_for_even_when_a_step_verified_the_n_gram_chain_alone(engine, settings, controls):
    controls = dataclasses.replace(controls, drafts="hybrid")
    session = Session()
    send(engine, settings, session, controls, "def add")
    turn = session.turns[0]
    # A hybrid step whose copied chain is long verifies the root and the chain alone: its tree_name is "ngram".
    session.rows = [dataclasses.replace(r, tree_name="ngram") if r.step > 0 else r for r in session.rows]
    stats = handlers.views.turn_stats(session, turn)
    assert "tree sparse_16 + n-gram" in stats and "tree ngram" not in stats


def test_a_finished_reply_is_rendered_once_per_highlight_setting_while_later_replies_stream(engine, settings, controls, monkeypatch):
    session = Session()
    send(engine, settings, session, controls, "def add")
    first = session.turns[0]
    shown = handlers.rerender_chat(session, False)["chatbot"][1]["content"]
    rendered = []
    real = ReplyText.html
    monkeypatch.setattr(ReplyText, "html", lambda self, highlight: rendered.append((self is first.reply, highlight)) or real(self, highlight))
    updates = send(engine, settings, session, controls, "return")
    assert sum(1 for u in updates if "chatbot" in u) > 3 and (True, False) not in rendered  # not at each chat update
    assert all(u["chatbot"][1]["content"] == shown for u in updates if "chatbot" in u)
    marked = [handlers.rerender_chat(session, True)["chatbot"][1]["content"] for _ in range(3)]  # the highlight toggle
    assert rendered.count((True, True)) == 1 and marked[0] == marked[2]
    assert marked[0].startswith(real(first.reply, True)) and marked[0] != shown or not any(free for _, free in first.reply.runs)
