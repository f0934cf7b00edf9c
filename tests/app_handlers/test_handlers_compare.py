"""Compare: Medusa off, then each source of drafts on the last message; Stop during a run.

Handler-level tests of the app on a tiny random Llama with Medusa heads: no browser, no server. Handlers are
called as the page calls them; streaming handlers are iterated, and a Stop is either the Stop handler's flag or
closing the generator (what Gradio's ``cancels=`` does).
"""

from __future__ import annotations

import dataclasses

from app import handlers
from app.session import Session
from app.stats import summarize, summary_markdown

from .handler_support import send


def test_compare_runs_medusa_off_then_heads_n_gram_and_hybrid_drafts_and_reports_identical_greedy_replies(
    engine, settings, controls
):
    session = Session()
    send(engine, settings, session, dataclasses.replace(controls, temperature=0.7))
    updates = list(handlers.compare(engine, settings, session, controls))
    table = updates[-1]["compare_result"]
    for variant in ("Medusa off", "heads", "n-gram", "hybrid"):
        assert f"| {variant} |" in table
    assert table.count("**yes** ✓") == 3 and "speedup" in table
    assert "| from heads | from chains |" in table and "chains: n-gram, corpus or drafter" in table
    assert table.startswith("| | tok/s | tok/step |")  # the speed first: a side panel too narrow for the table scrolls
    compare_rows = [r for r in session.rows if r.source == "compare"]
    assert {r.mode for r in compare_rows} == {"baseline", "medusa"}
    assert {r.drafts for r in compare_rows} == {"", "heads", "ngram", "hybrid"}
    assert {r.temperature for r in compare_rows} == {0.0}
    assert updates[-1]["summary"].count("–") < summary_markdown(summarize([], 4)).count("–")


def test_compare_also_runs_corpus_drafts_for_a_model_with_a_corpus_of_its_replies(engine, settings, controls):
    from app.engine import Engine
    from medusa_core import MedusaModel
    from medusa_core.datastore import Datastore

    session = Session()
    send(engine, settings, session, controls)
    reply = [t for r in session.last_records for t in r.token_ids]
    prompt_ids = list(range(1, 5))
    model = engine.model
    with_corpus = MedusaModel(model.backbone, model.heads, model.tokenizer, name="tiny with a corpus", trees=model.trees,
                              corpus=Datastore.build([(prompt_ids + reply, len(prompt_ids))] * 2))
    updates = list(handlers.compare(Engine.of(with_corpus), settings, session, controls))
    table = updates[-1]["compare_result"]
    assert "| corpus |" in table and table.count("**yes** ✓") == 4  # heads, n-gram, hybrid, corpus: identical to Medusa off
    assert {r.drafts for r in session.rows if r.source == "compare"} == {"", "heads", "ngram", "hybrid", "corpus"}


def test_compare_without_a_message_says_what_to_do(engine, settings, controls):
    (update,) = handlers.compare(engine, settings, Session(), controls)
    assert "Send a message first" in update["compare_result"]


def test_stop_during_compare_ends_it_and_says_so(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls)
    stream = handlers.compare(engine, settings, session, controls)
    next(stream)
    session.stop_requested.set()
    final = list(stream)[-1]["compare_result"]
    assert "Stopped before every run finished" in final and "| hybrid |" not in final
    assert not session.busy


def test_stop_during_compares_medusa_on_run_says_stopped_and_draws_no_verdict(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls)
    stream = handlers.compare(engine, settings, session, controls)
    for update in stream:
        if any(r.source == "compare" and r.mode == "medusa" for r in session.rows):
            break
    session.stop_requested.set()
    final = list(stream)[-1]["compare_result"]
    assert "Stopped" in final
    assert "identical reply" not in final and "×" not in final
    assert "Stopped" in handlers.stop(engine, session, False)["compare_result"]  # also when Stop cancelled the stream


def test_compare_parks_the_step_slider_until_it_ends_and_a_cancel_at_its_first_update_frees_the_session(engine, settings, controls):
    session = Session()
    send(engine, settings, session, controls)
    updates = list(handlers.compare(engine, settings, session, controls))
    sliders = [u["step_slider"] for u in updates if "step_slider" in u]
    assert len(sliders) == 2 and sliders[0].interactive is False and sliders[-1].interactive  # parked, then the last run's
    assert sum("tree_plot" in u for u in updates) > sum("speed_plot" in u for u in updates) >= 2
    stream = handlers.compare(engine, settings, session, controls)
    next(stream)
    stream.close()  # Stop cancels it at its first update
    assert not session.busy
