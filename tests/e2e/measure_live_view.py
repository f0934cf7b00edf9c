"""Measure what the live view costs: replies at the app's first settings (its chat defaults, its default drafts)
through ``medusa_core`` alone and through the real app in headless Chromium (chat streaming, tree plot and charts
redrawing). The replies are sampled, each side with fresh seeds, so speeds are compared as medians.

    python tests/e2e/measure_live_view.py                    # the demo model, its default backbone
    python tests/e2e/measure_live_view.py --model tiny --quantization none

Speed is wall-clock decoding speed: tokens after the first step / time from the end of the first
step to the end of the last (the first step holds the prefill). The app's steps are timed from the
timestamps of its CSV export, the engine's from the same moments in this process. Runs alternate
(engine, app, engine, app, ...) so slow drifts of a shared machine hit both; each prompt runs
``--rounds`` times per side and the table shows medians. Prints a table and writes it as CSV to
``out/live_view_cost.csv``.

Then one long reply (``--stall-tokens``, 600 by default) measures what the page's main thread
goes through while it streams: the longest task (PerformanceObserver 'longtask') and the longest gap
between animation frames (what a user sees as a frozen page; target ≤ 200 ms), and the browser's
main-thread time per streamed update (Chrome's TaskDuration over the reply / chat renders).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, WATCH_STALLS_JS, chromium, download_csv, launched_app, send, stalls, tiny_model  # noqa: E402

sys.path.insert(0, str(REPO))
PROMPTS = (
    "Return the sum of two numbers.",
    "Return True if the string is a palindrome.",
    "Split a path into its directory and file name.",
    "Return the n-th Fibonacci number.",
    "Read a JSON file and return its content.",
    "Remove duplicate items from a list, keeping their order.",
)


def engine_run(model, controls, prompt: str) -> tuple[int, float]:
    """(tokens after step 0, seconds from the end of step 0 to the end of the last step) of one reply generated as
    the app generates it with ``controls`` (``app.handlers.Controls``), without the page."""
    from app.handlers.controls import sampling_config
    from app.handlers.generation import fit_prompt

    ids, _ = fit_prompt(model, controls, [], prompt)
    ends, tokens = [], []
    for record in model.generate(ids, max_new_tokens=controls.max_new_tokens, config=sampling_config(controls),
                                 posterior_threshold=controls.posterior_threshold, posterior_alpha=controls.posterior_alpha,
                                 drafts=controls.drafts, sampling=controls.sampling, seed=controls.seed):
        ends.append(time.time())
        tokens.append(len(record.token_ids))
    return sum(tokens[1:]), ends[-1] - ends[0]


def app_runs(rows: list[dict[str, str]]) -> dict[int, tuple[int, float]]:
    """The same measure per reply of the app's CSV export."""
    out: dict[int, tuple[int, float]] = {}
    for reply in sorted({int(r["reply_index"]) for r in rows}):
        steps = [r for r in rows if int(r["reply_index"]) == reply]
        ends = [datetime.fromisoformat(r["timestamp"]).timestamp() for r in steps]
        out[reply] = (sum(int(r["accepted_tokens"]) for r in steps[1:]), ends[-1] - ends[0])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="'demo', 'tiny' (a random tiny model) or a Medusa folder")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--rounds", type=int, default=3, help="times each prompt runs on each side")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads on both sides (default 1: the app's default on a 2-core machine, the physical cores but one)")
    parser.add_argument("--app-arg", action="append", default=[], help="extra flag for launch.py, e.g. --app-arg=--redraw-interval-s=1 (repeatable)")
    parser.add_argument("--stall-tokens", type=int, default=600, help="length of the reply whose page stalls are measured (0: skip)")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "live_view_cost.csv")
    args = parser.parse_args()

    import torch

    from app.handlers import Controls
    from app.settings import AppSettings
    from medusa_core import load_medusa_model

    torch.set_num_threads(args.threads)
    app_args = ["--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads), *args.app_arg]

    home = Path(tempfile.mkdtemp(prefix="medusa-live-cost-"))
    model_path = tiny_model(home / "tiny") if args.model == "tiny" else args.model
    model = load_medusa_model(model_path, quantization=args.quantization)
    controls = dataclasses.replace(Controls.from_settings(AppSettings(_env_file=None), model), max_new_tokens=args.max_new_tokens)
    if model.has_corpus and model.corpus is None:  # ``corpus`` indexes it now, before timing, as the app has it
        raise RuntimeError(f"{model_path} has a corpus that could not be indexed")
    prompts = PROMPTS[: args.prompts]
    engine: list[tuple[int, float]] = []
    with launched_app(model_path, args.quantization, home, *app_args) as url, chromium() as browser:
        page = browser.new_page(viewport={"width": 1440, "height": 1300}, accept_downloads=True)
        page.goto(url)
        page.locator("#tree input").wait_for()
        page.wait_for_function("() => /nodes/.test(document.querySelector('#tree input')?.value)", timeout=60_000)
        engine_run(model, dataclasses.replace(controls, max_new_tokens=8), prompts[0])  # warm-up, both sides
        send(page, prompts[0], watch=False)
        page.locator("#clear").click()
        for _ in range(args.rounds):
            for prompt in prompts:
                engine.append(engine_run(model, controls, prompt))
                send(page, prompt, watch=False)  # the page only renders, as in a user's browser
                page.locator("#clear").click()  # same prompt as the engine's: no history
                page.wait_for_timeout(300)
        app = app_runs(download_csv(page, home / "session.csv"))
        if args.stall_tokens:
            stall = stall_run(page, args.stall_tokens)
            print(
                f"page while {stall['tokens']} tokens streamed ({stall['replies']} replies, {stall['updates']} chat renders, "
                f"{stall['seconds']:.1f} s): "
                f"longest main-thread task {stall['longest_task_ms']:.0f} ms ({stall['tasks']} tasks over 50 ms; "
                f"it changed {', '.join(stall['longest_task_parts']) or 'nothing watched'}), "
                f"longest gap between frames {stall['longest_frame_gap_ms']:.0f} ms, "
                f"main-thread time per update {stall['ms_per_update']:.1f} ms"
            )
    if not args.rounds:
        return 0
    table = []
    for i, prompt in enumerate(prompts):
        runs = range(i, len(engine), len(prompts))
        e_tokens, a_tokens = engine[i][0], app[i + 1][0]  # app reply 0 was the warm-up
        e_speed = statistics.median(engine[j][0] / engine[j][1] for j in runs)
        a_speed = statistics.median(app[j + 1][0] / app[j + 1][1] for j in runs)
        table.append(dict(prompt=prompt, engine_tokens=e_tokens, app_tokens=a_tokens, engine_tokens_per_s=round(e_speed, 1),
                          app_tokens_per_s=round(a_speed, 1), app_over_engine=round(a_speed / e_speed, 3)))
    print(f"{'prompt':<58} {'tokens':>6} {'engine tok/s':>12} {'app tok/s':>10} {'app/engine':>10}")
    for r in table:
        same = "" if r["engine_tokens"] == r["app_tokens"] else f"  (app: {r['app_tokens']} tokens)"
        print(f"{r['prompt']:<58} {r['engine_tokens']:>6} {r['engine_tokens_per_s']:>12} {r['app_tokens_per_s']:>10} {r['app_over_engine']:>10}{same}")
    ratio = statistics.median(r["app_over_engine"] for r in table)
    print(f"median app/engine: {ratio:.3f}  (live view cost: {(1 - ratio) * 100:.1f} % of decoding speed)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {args.out}")
    return 0


STALL_PROMPTS = (
    "Write a long Python module with several classes, each with docstrings and methods.",
    "Write a command-line tool that parses arguments, reads files and prints a report.",
    "Write a class for a bank account with deposit, withdraw and transfer, and its tests.",
    "Write a tokenizer for arithmetic expressions and an evaluator for them.",
)


def stall_run(page, tokens: int) -> dict[str, float]:
    """Replies of up to ``tokens`` tokens on a fresh chat, watched for main-thread stalls (see the
    module docstring), until ``tokens`` tokens have streamed (a small model may end a reply early;
    the chat keeps the earlier replies, so later renders carry more text). Returns the figures,
    with the tokens, replies and seconds."""
    page.locator("#clear").click()
    page.get_by_role("tab", name="Controls").click()
    limit = page.locator("#max-new-tokens input[type=number]")
    limit.fill(str(tokens))
    limit.blur()
    page.wait_for_timeout(300)
    cdp = page.context.new_cdp_session(page)
    cdp.send("Performance.enable")

    def busy_s() -> float:
        return next(m["value"] for m in cdp.send("Performance.getMetrics")["metrics"] if m["name"] == "TaskDuration")

    page.evaluate(WATCH_STALLS_JS)
    before, start = busy_s(), time.monotonic()
    streamed = renders = replies = 0
    while streamed < tokens:
        renders += len(send(page, STALL_PROMPTS[replies % len(STALL_PROMPTS)], timeout_s=600))
        status = page.locator("#reply-status").inner_text()
        streamed += int(status.split("Latest reply: ")[1].split(" tokens")[0])
        replies += 1
    seconds, busy = time.monotonic() - start, busy_s() - before
    figures = stalls(page)
    figures.update(tokens=streamed, replies=replies, seconds=seconds, updates=renders, ms_per_update=busy * 1e3 / max(renders, 1))
    return figures


if __name__ == "__main__":
    sys.exit(main())
