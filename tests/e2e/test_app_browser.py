"""End-to-end test: the real ``python launch.py`` on the demo model, driven in headless Chromium.

Sends a prompt and watches the reply stream, checks the tree plot and the charts render, moves the
step slider, turns Medusa off and sends again, stops a reply midway, presses Compare, downloads
the CSV and checks its rows. Screenshots go to ``screenshots-tmp/e2e`` (or ``$MEDUSA_CHAT_E2E_SCREENSHOTS``);
``MEDUSA_CHAT_E2E_UPDATE_SCREENSHOT=1`` also refreshes ``assets/screenshots/app.png``.

Uses Debian's ``chromium`` (``/usr/bin/chromium``, or ``$MEDUSA_CHAT_E2E_CHROMIUM``); Playwright never
downloads a browser. ``MEDUSA_CHAT_E2E_MODEL`` overrides the model (``tiny`` builds a tiny random one,
any other value is passed to ``--model``) and ``MEDUSA_CHAT_E2E_QUANTIZATION`` its quantization.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from harness import CHROMIUM, REPO, chromium, download_csv, launched_app, send, tiny_model

pytestmark = pytest.mark.e2e

SCREENSHOTS = Path(os.environ.get("MEDUSA_CHAT_E2E_SCREENSHOTS", REPO / "screenshots-tmp" / "e2e"))
README_SCREENSHOT = REPO / "assets" / "screenshots" / "app.png"
PROMPTS = (
    "Return the sum of two numbers.",
    "Return True if the string is a palindrome.",
    "Parse a configuration file and return a dictionary of its sections and options.",
)
MAX_NEW_TOKENS = 96
REPLY_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    """Launch ``python launch.py`` on the demo (or overridden) model; yield its URL; stop it."""
    model = os.environ.get("MEDUSA_CHAT_E2E_MODEL", "demo")
    quantization = os.environ.get("MEDUSA_CHAT_E2E_QUANTIZATION", "nf4")
    if model == "demo" and not (REPO / "assets" / "demo" / "config.json").exists():
        pytest.skip("the demo model is not built: assets/demo/config.json is missing (python scripts/build_demo.py)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: install Debian's chromium package (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="the e2e test needs the playwright Python package")
    home = tmp_path_factory.mktemp("home")
    if model == "tiny":
        model = tiny_model(home / "tiny")
    with launched_app(model, quantization, home, "--max-new-tokens", str(MAX_NEW_TOKENS)) as url:
        yield url


def _send(page, text: str) -> list[int]:
    return send(page, text, REPLY_TIMEOUT_S, screenshot=SCREENSHOTS / "timeout.png")


def test_chat_live_view_compare_and_csv_export_in_headless_chromium(app_url, tmp_path):
    from playwright.sync_api import expect

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1440, "height": 1300}, accept_downloads=True)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(app_url)
        expect(page.locator("#tree input")).to_have_value(re.compile(r"\(\d+ nodes"), timeout=30_000)  # model ready

        # Pick a 17-node tree from the dropdown (the demo's own default for CPUs is a 5-node chain).
        tree_input = page.locator("#tree input")
        tree_input.click()
        tree_input.fill("sparse_16")
        tree_input.press("Enter")
        expect(tree_input).to_have_value("sparse_16 (17 nodes)")
        page.locator("#highlight input[type=checkbox]").check()

        # A reply streams into the chat: several different partial lengths before the end.
        lengths = _send(page, PROMPTS[0])
        partial = {n for n in lengths if 0 < n < lengths[-1]}
        assert len(partial) >= 2, f"the reply did not stream: text lengths seen {lengths}"
        expect(page.locator("#chat [data-testid=bot]")).to_have_count(1)

        # The tree plot and the speed charts render with plotly, and the summary fills in.
        tree_title = page.locator("#tree-plot .gtitle")
        expect(tree_title).to_contain_text(re.compile(r"^step \d+ · "))
        assert page.locator("#tree-plot .scatterlayer .trace").count() >= 2  # accepted path, nodes
        assert page.locator("#speed-plot .scatterlayer .trace").count() >= 3  # tokens/s, its rolling mean, tokens/step
        expect(page.locator("#summary")).to_contain_text("tokens / step")
        page.screenshot(path=str(SCREENSHOTS / "1-reply.png"), full_page=True)

        # The step slider shows every step of the last reply.
        steps = int(re.search(r"\((\d+) steps\)", page.locator("#step-slider").inner_text()).group(1))
        assert steps >= 2
        assert int(number_value := page.locator("#step-slider input[type=number]").input_value()) <= steps - 1
        assert tree_title.text_content().startswith(f"step {number_value} ")
        number = page.locator("#step-slider input[type=number]")
        number.fill("0")
        number.blur()
        expect(tree_title).to_contain_text(re.compile(r"^step 0 · sparse_16 \(17 nodes\)"))
        assert page.locator("#tree-plot .scatterlayer .trace").count() >= 4  # edges, path, root, head-1 nodes

        # Highlighting marks the tokens accepted from the heads (if this reply accepted any).
        summary = page.locator("#summary").inner_text()
        rate = float(re.search(r"acceleration rate\)\s+([\d.]+)", summary).group(1))
        if rate > 1.0:
            expect(page.locator("#chat mark.medusa-free").first).to_be_visible()
        page.screenshot(path=str(SCREENSHOTS / "2-step-0.png"), full_page=True)

        # Medusa off: the next reply decodes one token per step and is charted as baseline.
        page.locator("#medusa input[type=checkbox]").uncheck()
        _send(page, PROMPTS[1])
        expect(page.locator("#chat [data-testid=bot]")).to_have_count(2)
        expect(page.locator("#speed-plot .legend")).to_contain_text("baseline tokens/s")
        expect(tree_title).to_contain_text("baseline (1 nodes)")
        expect(page.locator("#summary")).to_contain_text(re.compile(r"Speedup vs this session's baseline replies: [\d.]+×"))

        # Stop mid-reply keeps the partial reply (unless the model finished before the click landed).
        page.locator("#medusa input[type=checkbox]").check()
        max_tokens = page.locator("#max-new-tokens input[type=number]")
        max_tokens.fill("1000")
        max_tokens.blur()
        bots = page.locator("#chat [data-testid=bot]")
        page.locator("#message textarea").fill(PROMPTS[2])
        page.locator("#message textarea").press("Enter")
        expect(bots).to_have_count(3, timeout=REPLY_TIMEOUT_S * 1_000)  # the reply has started streaming
        page.locator("#stop").dispatch_event("click")  # at once: no waiting for the button to be "stable"
        status = page.locator("#reply-status")
        expect(status).to_contain_text("Latest reply", timeout=REPLY_TIMEOUT_S * 1_000)
        stopped = status.inner_text().endswith("· stopped")
        print(f"e2e: Stop {'ended the reply midway' if stopped else 'came after the reply had ended'}")
        if stopped:
            expect(bots.last).to_contain_text("(stopped)")
            assert len(bots.last.inner_text().replace("(stopped)", "").strip()) > 0
        else:  # a fast machine can finish the reply before the click lands
            expect(bots.last).not_to_contain_text("(stopped)")
        max_tokens.fill(str(MAX_NEW_TOKENS))
        max_tokens.blur()

        # Compare re-runs the last prompt with Medusa off, then on.
        page.get_by_role("tab", name="Compare").click()
        page.locator("#compare").click()
        result = page.locator("#compare-result")
        expect(result).to_contain_text("Identical replies", timeout=REPLY_TIMEOUT_S * 2_000)
        expect(result).to_contain_text(re.compile(r"Speedup: [\d.]+×"))
        page.screenshot(path=str(SCREENSHOTS / "3-compare.png"), full_page=True)

        # Export downloads one row per step of the session and saves a copy whose path is shown.
        downloaded = tmp_path / "session.csv"
        rows = download_csv(page, downloaded)
        for column in ("session_id", "reply_index", "step", "mode", "tree_name", "tree_nodes", "temperature",
                       "posterior_threshold", "posterior_alpha", "accepted_tokens", "step_latency_ms",
                       "tokens_per_s", "timestamp"):
            assert column in rows[0], column
        replies = {}
        for r in rows:
            replies.setdefault(int(r["reply_index"]), []).append(r)
        assert sorted(replies) == [0, 1, 2, 3, 4]  # three chat replies, then compare's off and on runs
        assert [r["source"] for r in rows if r["step"] == "0"] == ["chat", "chat", "chat", "compare", "compare"]
        assert len(replies[0]) == steps
        assert {r["mode"] for r in replies[1]} == {r["mode"] for r in replies[3]} == {"baseline"}
        assert {r["mode"] for r in replies[2]} == {r["mode"] for r in replies[4]} == {"medusa"}
        assert (replies[2][-1]["stop_reason"] == "stopped") == stopped
        for reply in replies.values():
            assert [int(r["step"]) for r in reply] == list(range(len(reply)))
            assert sum(int(r["accepted_tokens"]) for r in reply) == int(reply[-1]["total_tokens"])
        assert len({r["session_id"] for r in rows}) == 1
        saved = Path(re.search(r"to (/\S+\.csv)", page.locator("#csv-path").inner_text()).group(1))
        assert saved.read_text() == downloaded.read_text()

        page.get_by_role("tab", name="Controls").click()
        page.locator("#step-slider").scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOTS / "4-final.png"), full_page=True)
        assert not errors, errors
    if os.environ.get("MEDUSA_CHAT_E2E_UPDATE_SCREENSHOT") == "1":
        README_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SCREENSHOTS / "1-reply.png", README_SCREENSHOT)
