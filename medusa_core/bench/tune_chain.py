"""The EAGLE-style drafter's chain tuned per machine and settings preset (``python -m medusa_core.bench tune``).

A chain of drafts is verified alone (``drafts="eagle"``), so its "tree" is two numbers: the most drafts a step
(``chain_depth``) and the chain probability a draft needs (``chain_threshold``, EAGLE-2's confidence). Each draft
costs a verification row and a pass of the drafter's layer, whose prices differ between machines (a tree row costs a
few percent of a pass on AMX tiles, up to a third on AVX512-BF16 dot products: ``medusa_core.tuned``), so the best
pair does too. The tuner times each pair against the plain loop, interleaved prompt by prompt at the preset's
settings (decoding tokens/s, the prompt's reading left out), and writes the fastest into the preset's entry of
``medusa_tuned.json``, where ``generate`` reads it (``TunedSettings.chain_depth``) unless ``DraftConfig`` sets one.
At greedy every reply must equal the plain loop's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import eagle
from ..drafts import DraftConfig
from ..tuned import machine_class, tuned_key
from .prompts import encode_prompt, load_prompts
from .report import _fmt, environment, markdown_table

#: (depth, threshold) pairs the tuner times by default: eagle's defaults and their neighbours.
CHAIN_VALUES = ((3, 0.3), (5, 0.2), (5, 0.3), (5, 0.4), (8, 0.3))

Chain = tuple[int, float]


def parse_chains(text: str) -> list[Chain]:
    """``"3:0.3,5:0.2"`` -> [(3, 0.3), (5, 0.2)]. Raises ``argparse.ArgumentTypeError`` naming a pair that is not
    depth:threshold with an integer depth >= 1 and a threshold in [0, 1]."""
    chains = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            depth, threshold = part.split(":")
            DraftConfig(chain_depth=int(depth), chain_threshold=float(threshold))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: chains are depth:threshold pairs, an integer depth >= 1 and a "
                                             "threshold in [0, 1], e.g. 5:0.3") from None
        chains.append((int(depth), float(threshold)))
    if not chains:
        raise argparse.ArgumentTypeError(f"{text!r}: no depth:threshold pair")
    return chains


def choose_chain(tok_s: Mapping[Chain, float], default: Chain, tolerance: float) -> Chain:
    """The chain to keep from measured tokens/s per (depth, threshold): the fastest, but ``default`` (when measured)
    unless the fastest ran more than ``tolerance`` (a fraction) faster, as a tree's confirmation keeps the predicted
    pick (``tune.confirm_choice``). Raises ``ValueError`` when nothing was measured."""
    if not tok_s:
        raise ValueError("no chain was measured")
    best = max(tok_s, key=lambda c: tok_s[c])
    if default in tok_s and tok_s[best] <= tok_s[default] * (1 + tolerance):
        return default
    return best


def measure_chains(model: Any, prompts: Sequence[Any], chains: Sequence[Chain], max_new_tokens: int, config: Any,
                   sampling: str, repeats: int = 1, progress: bool = True) -> dict[Chain | None, tuple[int, int, float]]:
    """(tokens after the first, decoding steps, their seconds) of the plain loop (key None) and of ``drafts="eagle"``
    at each chain over ``repeats`` rounds of the prompts, interleaved prompt by prompt (seed 1000 · round + the
    prompt's index, as the benchmark's). Raises ``SystemExit`` when a greedy reply differs from the plain loop's."""
    from tqdm.auto import tqdm

    totals: dict[Chain | None, list[float]] = {c: [0, 0, 0.0] for c in [None, *chains]}
    bar = tqdm(total=repeats * len(prompts) * len(totals), desc="chains", unit="run", disable=not progress)
    for seed, ids in ((1000 * r + i, ids) for r in range(repeats) for i, ids in enumerate(prompts)):
        plain = None
        for chain in totals:
            kwargs = dict(medusa=False) if chain is None else dict(
                drafts="eagle", draft_config=DraftConfig(chain_depth=chain[0], chain_threshold=chain[1]))
            records = list(model.generate(ids, max_new_tokens=max_new_tokens, config=config, sampling=sampling, seed=seed, **kwargs))
            reply = [t for r in records for t in r.token_ids]
            plain = plain or reply
            if config.greedy and reply != plain:
                raise SystemExit(f"chain {chain}: the greedy reply to prompt {seed % 1000} differs from the plain loop's")
            t = totals[chain]
            t[0] += len(reply) - 1  # records[0]: the prompt's reading and its token
            t[1] += len(records) - 1
            t[2] += sum(r.latency_s for r in records[1:])
            bar.update()
    bar.close()
    return {c: (int(t[0]), int(t[1]), t[2]) for c, t in totals.items()}


def tune_chain_at(model: Any, args: argparse.Namespace, command: str, preset: str, target: Path,
                  entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """One preset's chain tuning (``tune.cmd_tune``): time ``args.chains`` against the plain loop on
    ``--confirm-prompts`` prompts × ``--repeats`` seeds, print and write the report under ``--out``/<preset>
    (chains.md, chains.csv), and merge ``chain_depth``, ``chain_threshold``, ``chain_measured_speedup`` and
    ``chain_measured_acceleration`` into the preset's entry: ``entry`` (the tree stage's, which a ``--dry-run`` did
    not write), else the one in ``target``; written to ``target`` unless ``--dry-run``. Returns the entry. Raises
    ``SystemExit`` when there is neither (the tree stage writes it: run ``bench tune`` without ``--chains-only``
    first)."""
    from .tune import preset_settings, write_tune_report, write_tuned

    key = tuned_key(model.device, model.quantization, preset, machine_class(model.device, model.quantization))
    if entry is None:
        entry = (json.loads(target.read_text(encoding="utf-8")) if target.exists() else {}).get(key)
    if not isinstance(entry, dict):
        raise SystemExit(f"{target} has no entry {key!r} for the chain: run bench tune --presets {preset} first")
    config, sampling = preset_settings(model, preset)
    prompts = [encode_prompt(model.tokenizer, p, args.system)
               for p in load_prompts(args.prompts, args.limit or args.confirm_prompts, args.categories)]
    totals = measure_chains(model, prompts, args.chains, args.max_new_tokens, config, sampling, args.repeats,
                            not args.no_progress)
    base = totals[None][0] / totals[None][2]
    tok_s = {c: t[0] / t[2] for c, t in totals.items() if c is not None}
    best = choose_chain(tok_s, (eagle.DEPTH, eagle.THRESHOLD), args.tolerance)
    rows = [[f"{c[0]}:{c[1]:g}" if c else "plain loop", _fmt(t[0] / t[1]), _fmt(1e3 * t[2] / t[1]),
             _fmt(t[0] / t[2]), _fmt(t[0] / t[2] / base) + "×", "**chosen**" if c == best else ""]
            for c, t in totals.items()]
    env = environment(model)
    label = config.describe() + ("" if config.greedy else f", {sampling}")
    text = "\n".join([
        f"# Drafter chain tuning at {preset}: {label}", "", f"`{command}`", "", ", ".join(f"{k}: {v}" for k, v in env.items()), "",
        markdown_table(rows, ["chain depth:threshold", "tokens/step", "step ms", "tokens/s", "vs plain", ""]), "",
        f"{len(prompts)} prompts × {args.repeats} seeds × {args.max_new_tokens} tokens, interleaved prompt by prompt; "
        f"decoding only (the prompt's reading left out). The default ({eagle.DEPTH}:{eagle.THRESHOLD:g}) is kept unless "
        f"another ran more than {args.tolerance:.0%} faster.", "",
    ])
    write_tune_report(args, preset, "chains", text,
                      ["chain_depth", "chain_threshold", "tokens", "steps", "seconds", "tokens_per_s", "vs_plain"],
                      [[c[0] if c else 0, c[1] if c else "", t[0], t[1], t[2], t[0] / t[2], t[0] / t[2] / base]
                       for c, t in totals.items()])
    chosen = totals[best]
    entry = entry | {"chain_depth": best[0], "chain_threshold": best[1],
                     "chain_measured_speedup": round(tok_s[best] / base, 4),
                     "chain_measured_acceleration": round(chosen[0] / chosen[1], 4), "chain_command": command}
    if args.dry_run:
        print(f"--dry-run: not writing {target} [{key}]")
    else:
        write_tuned(target, key, entry)
        print(f"wrote the chain tuned at {preset} (depth {best[0]}, threshold {best[1]:g}) to {target} [{key}]")
    return entry
