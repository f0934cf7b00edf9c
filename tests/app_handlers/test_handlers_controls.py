"""The controls a reply reads: sampling settings and presets, the sampling rule, controls greyed out with the reason,
values out of range.

Handler-level tests of the app on a tiny random Llama with Medusa heads: no browser, no server. Handlers are
called as the page calls them; streaming handlers are iterated, and a Stop is either the Stop handler's flag or
closing the generator (what Gradio's ``cancels=`` does).
"""

from __future__ import annotations

import csv
import dataclasses

from transformers import GenerationConfig

from app import handlers
from app.handlers import Controls
from app.session import Session
from app.settings import AppSettings
from medusa_core import CHAT_PRESET
from medusa_core.processors import CHAT_SAMPLING

from .handler_support import greedy_reference, send


def test_the_sampling_control_reaches_the_engine_and_the_page_marks_rejected_nodes_and_acceptance_per_mode(
    engine, settings, controls
):
    session = Session()
    sampled = dataclasses.replace(controls, temperature=1.0, seed=3, sampling="typical")
    send(engine, settings, session, sampled)
    typical = [r for r in session.last_records if r.tree_nodes > 1]
    updates = send(engine, settings, session, dataclasses.replace(sampled, sampling="exact"))
    final = {k: v for u in updates for k, v in u.items()}  # each component as the page shows it at the end
    exact = [r for r in session.last_records if r.tree_nodes > 1]
    assert {r.sampling for r in typical} == {"typical"} and {r.sampling for r in exact} == {"exact"}
    assert all(len(r.node_status) == r.tree_nodes for r in exact) and not any(r.node_status for r in typical)
    assert {r.sampling for r in session.rows} == {"typical", "exact"}  # the CSV's column
    assert "**typical**" in final["summary"] and "**exact**" in final["summary"]
    symbols = [s for t in final["tree_plot"].data if t.get("mode") == "markers+text" for s in t["marker"]["symbol"]]
    assert symbols.count("x") == exact[-1].node_status.count("rejected") > 0  # the last step with a tree
    assert "exact" in final["tree_plot"].layout["title"]["text"]


def test_epsilon_and_delta_are_inactive_with_the_reason_at_temperature_0_and_tree_too_with_medusa_off():
    greedy = handlers.explain_controls(True, 0.0)
    assert greedy["tree"].interactive is True
    assert greedy["posterior_threshold"].interactive is False and "temperature 0" in greedy["posterior_threshold"].info
    sampled = handlers.explain_controls(True, 0.7)
    assert sampled["posterior_alpha"].interactive is True
    exact = handlers.explain_controls(True, 0.7, "exact")
    assert exact["posterior_threshold"].interactive is False and "exact sampling" in exact["posterior_alpha"].info
    off = handlers.explain_controls(False, 0.7)
    assert all(off[k].interactive is False and "Medusa is off" in off[k].info for k in ("tree", "posterior_threshold", "posterior_alpha"))


def test_the_tree_is_inactive_with_the_reason_where_the_drafts_are_a_chain_the_tree_does_not_shape():
    for drafts in ("eagle", "ngram"):
        for temperature, sampling in ((0.0, "typical"), (0.2, "exact")):
            chain = handlers.explain_controls(True, temperature, sampling, drafts)
            assert chain["tree"].interactive is False and "verifies a chain" in chain["tree"].info
            assert chain["drafts"].interactive is True
    for drafts in ("heads", "corpus", "hybrid"):
        assert handlers.explain_controls(True, 0.2, "exact", drafts)["tree"].interactive is True
    assert "Medusa is off" in handlers.explain_controls(False, 0.2, "exact", "eagle")["tree"].info


def test_top_k_top_p_and_min_p_are_inactive_at_temperature_0_where_greedy_ignores_them():
    greedy, sampled = handlers.explain_controls(True, 0.0), handlers.explain_controls(True, 0.2, "exact")
    for name in ("top_k", "top_p", "min_p"):
        assert greedy[name].interactive is False and "temperature 0" in greedy[name].info
        assert sampled[name].interactive is True and "temperature 0" not in sampled[name].info


def test_the_controls_start_at_the_chat_preset_and_the_settings_override_it(tmp_path):
    controls = Controls.from_settings(AppSettings(data_dir=tmp_path))
    assert (controls.temperature, controls.top_k, controls.top_p, controls.min_p, controls.repetition_penalty) == (
        CHAT_PRESET.temperature, CHAT_PRESET.top_k, CHAT_PRESET.top_p, CHAT_PRESET.min_p, CHAT_PRESET.repetition_penalty)
    assert controls.sampling == CHAT_SAMPLING
    mine = Controls.from_settings(AppSettings(data_dir=tmp_path, top_p=0.5, repetition_penalty=1.0, temperature=0.0))
    assert (mine.temperature, mine.top_p, mine.repetition_penalty) == (0.0, 0.5, 1.0) and mine.top_k == CHAT_PRESET.top_k


def test_once_ready_the_page_shows_the_models_own_sampling_defaults_from_its_generation_config(engine, settings, monkeypatch):
    shown = {k: v.value for k, v in handlers.page_status(engine, settings).items() if k in ("temperature", "top_p", "repetition_penalty")}
    assert shown == {"temperature": CHAT_PRESET.temperature, "top_p": CHAT_PRESET.top_p,
                     "repetition_penalty": CHAT_PRESET.repetition_penalty}  # the tiny model's config sets none
    generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    monkeypatch.setattr(engine.model.backbone, "generation_config", generation_config)
    updates = handlers.page_status(engine, settings)
    assert (updates["temperature"].value, updates["top_p"].value, updates["top_k"].value, updates["repetition_penalty"].value) == (
        0.6, 0.95, 20, 1.0)
    assert handlers.chat_preset(engine, settings)["top_k"].value == 20  # "Chat defaults" restores them too


def test_the_greedy_preset_turns_sampling_and_the_penalty_off_so_medusa_equals_plain_greedy(engine, settings, controls):
    preset = {name: update.value for name, update in handlers.greedy_preset().items()}
    assert preset == handlers.GREEDY_PRESET == {"temperature": 0.0, "repetition_penalty": 1.0}
    session = Session()
    chat = dataclasses.replace(controls, **{n: getattr(CHAT_PRESET, n) for n in ("temperature", "top_p", "repetition_penalty")})
    send(engine, settings, session, dataclasses.replace(chat, **preset))
    assert session.turns[-1].reply.text == greedy_reference(engine, session, controls)


def test_each_reply_records_its_sampling_settings_in_its_stats_line_and_the_csv(engine, settings, controls):
    session = Session()
    chat = dataclasses.replace(controls, temperature=0.2, top_p=0.9, top_k=0, min_p=0.05, repetition_penalty=1.1,
                               sampling="exact", seed=1)
    send(engine, settings, session, chat)
    send(engine, settings, session, controls)  # then greedy
    assert "T 0.2 · top-p 0.9 · min-p 0.05 · rep. 1.1 · exact" in session.turns[0].stats
    assert "greedy" in session.turns[1].stats and "rep." not in session.turns[1].stats
    with open(handlers.export_csv(settings, session)["export_file"]) as f:
        rows = list(csv.DictReader(f))
    first = {(r["temperature"], r["top_k"], r["top_p"], r["min_p"], r["repetition_penalty"]) for r in rows if r["reply_index"] == "0"}
    assert first == {("0.2", "0", "0.9", "0.05", "1.1")}
    assert {r["repetition_penalty"] for r in rows if r["reply_index"] == "1"} == {"1.0"}


def test_a_sampling_value_out_of_range_is_not_sent_and_says_why(engine, settings, controls):
    session = Session()
    updates = send(engine, settings, session, dataclasses.replace(controls, top_k=-2))
    assert session.turns[-1].state == "error" and "top_k must be an integer >= 0" in session.turns[-1].error
    assert "top_k" in updates[-1]["tree_status"]
