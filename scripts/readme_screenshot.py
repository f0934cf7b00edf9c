"""Retake the README's screenshot (``assets/screenshots/app.png``): the app on the demo at its defaults (drafter +
corpus drafts, the chat settings, exact sampling), 1440×900, drafted tokens highlighted, after one reply to a prompt
long enough to fill the tree plot's step slider and the speed chart.

Runs ``python launch.py`` with a fresh config folder and drives headless Chromium (Debian's ``chromium``, as the e2e
test does: ``tests/e2e/harness.py``). The reply is sampled, so each run's picture differs.

    python scripts/readme_screenshot.py [--prompt "Give me three tips to sleep better."] [--out assets/screenshots/app.png]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="Give me three tips to sleep better.")
    parser.add_argument("--out", type=Path, default=REPO / "assets" / "screenshots" / "app.png")
    args = parser.parse_args()
    from harness import chromium, launched_app, send
    from playwright.sync_api import expect

    with launched_app("demo", "auto", Path(tempfile.mkdtemp())) as url, chromium() as browser:
        page = browser.new_context(viewport={"width": 1440, "height": 900}).new_page()
        page.goto(url)
        expect(page.locator("#tree input")).to_have_value(re.compile(r"\(\d+ nodes"), timeout=90_000)
        page.wait_for_timeout(15_000)  # a first start indexes the corpus meanwhile: its replies then draft from it
        page.locator("#highlight input[type=checkbox]").check()
        send(page, args.prompt, timeout_s=120)
        page.wait_for_timeout(1_500)  # the last redraw of the plots
        args.out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.out))
        print(page.locator("#chat [data-testid=bot] .medusa-stats").last.inner_text())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
