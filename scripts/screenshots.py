"""Take the screenshots of docs/app.md: every tab of the launched app at a phone's, a projector's and a
desktop's size, the Calibrate tab's diagrams, a group opened in Calibrate and in Learn, the Learn and
Shift tabs in presenter mode, Learn's lesson, the Try tab with a corrupted picture, and the dark theme, with Debian's
Chromium (never a downloaded one).

    python scripts/screenshots.py                # into docs/img/
    python scripts/screenshots.py --out /tmp/s   # elsewhere

It starts ``python app.py`` offline on a free port (as the browser tests do) and stops it at the end.
"""
from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from conftest import start_app, stop_app  # noqa: E402

SIZES = {"390": (390, 844), "1280": (1280, 720), "1400": (1400, 1000)}
TABS = {"calibrate": "Calibrate", "gamma": "γ sweep", "init": "Initialisation", "try": "Try your own image", "learn": "Learn"}


def small_png(png: bytes, path: Path) -> None:
    """Save as an 8-bit palette PNG: a screenshot of flat colours loses nothing visible and shrinks."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=128)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, optimize=True)


def shift_shots(page, size: str, save) -> None:
    """The Shift tab as it opens (contrast, severity 3): the view alone on a phone (the table below it is
    long), the screen elsewhere; its diagrams at a desk; presenter mode on a projector."""
    page.get_by_role("tab", name="Shift").click()
    page.wait_for_selector("#shift-diagrams .ns-card svg", timeout=60_000)
    page.wait_for_timeout(500)
    save(page.locator("#shift-view").screenshot() if size == "390" else page.screenshot(), f"shift-{size}.png")
    if size == "1400":
        page.locator("#shift-diagrams-title").scroll_into_view_if_needed()
        save(page.locator("#shift-diagrams").screenshot(), "shift-diagrams-1400.png")
    if size == "1280":
        page.click("#shift-presenter")
        page.wait_for_timeout(500)
        save(page.screenshot(), "shift-presenter-1280.png")
        page.keyboard.press("Escape")


def try_corrupted(page, size: str, save) -> None:
    """The Try tab's first example with contrast at severity 3."""
    page.get_by_role("tab", name="Try your own image").click()
    page.locator("#try-corruption input").click()
    page.get_by_role("option", name="Contrast").click()
    slider = page.locator("#try-severity input[type=range]")
    slider.focus()
    for _ in range(3):
        slider.press("ArrowRight")
    page.wait_for_selector('#try-chart .nctv-shifted[data-severity="3"]', timeout=60_000)
    page.wait_for_timeout(500)
    page.evaluate("document.activeElement.blur()")
    if size == "390":
        save(page.locator("#try-results").screenshot(), "try-corrupt-390.png")
    else:
        page.evaluate("document.querySelector('#try-row').scrollIntoView({block: 'start'})")
        save(page.screenshot(), f"try-corrupt-{size}.png")


def lesson_shots(browser, url: str, save) -> None:
    """Learn's lesson opened by its links: step 3 (a group opened) in presenter mode on a projector, step 2
    on a phone."""
    for query, (w, h), name in (("?step=3&presenter=1", (1280, 720), "learn-lesson-presenter-1280.png"),
                                ("?step=2", (390, 844), "learn-lesson-390.png")):
        page = browser.new_page(viewport={"width": w, "height": h})
        page.goto(url + query)
        page.wait_for_function("document.querySelector('.nl') && document.querySelector('.nl').dataset.wordsMs",
                               timeout=120_000)
        if "step=3" in query:
            page.wait_for_selector("#learn-bin-list li", timeout=60_000)
        page.wait_for_timeout(1500)  # the band of the settled T follows the first drawing
        save(page.screenshot(), name)
        page.close()


def shoot(url: str, out: Path) -> list[Path]:
    from playwright.sync_api import sync_playwright

    written = []

    def save(png: bytes, name: str) -> None:
        small_png(png, out / name)
        written.append(out / name)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        for size, (w, h) in SIZES.items():
            page = browser.new_page(viewport={"width": w, "height": h})
            page.goto(url)
            page.wait_for_selector("#calibrate-diagrams .nc-smooth svg", timeout=120_000)
            for key, tab in TABS.items():
                page.get_by_role("tab", name=tab).click()
                page.wait_for_timeout(2500)
                save(page.screenshot(full_page=size == "390"), f"{key}-{size}.png")
                if key == "calibrate":  # the diagrams, below the table
                    save(page.locator("#calibrate-view").screenshot(), f"calibrate-diagrams-{size}.png")
            if size != "1280":  # a group opened, in Learn and in Calibrate
                page.locator("#learn-plot .nd-hit").last.click()
                page.wait_for_selector("#learn-bin-list li", timeout=60_000)
                page.evaluate("document.activeElement.blur()")
                save(page.locator("#learn-view").screenshot(), f"learn-open-bin-{size}.png")
                page.get_by_role("tab", name="Calibrate").click()
                page.locator('.nc-card[data-method="Temperature Scaling"] .nd-hit[data-bin="12"]').click()
                page.wait_for_selector("#calibrate-bin-list li", timeout=60_000)
                page.evaluate("document.activeElement.blur()")
                save(page.locator("#calibrate-bin").screenshot(), f"calibrate-open-bin-{size}.png")
            if size == "1280":
                page.get_by_role("tab", name="Learn").click()
                page.click("#learn-presenter")
                page.wait_for_timeout(1500)  # the band of the settled T follows the first drawing
                save(page.screenshot(), "learn-presenter-1280.png")
                page.keyboard.press("Escape")
            shift_shots(page, size, save)
            try_corrupted(page, size, save)
            page.close()
        # The dark theme, where the diagrams follow it.
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(url + "?__theme=dark")
        page.wait_for_selector("#calibrate-diagrams .nc-smooth svg", timeout=120_000)
        page.wait_for_timeout(1000)
        save(page.locator("#calibrate-view").screenshot(), "calibrate-diagrams-dark-1280.png")
        page.get_by_role("tab", name="Learn").click()
        page.wait_for_timeout(2500)
        save(page.screenshot(), "learn-dark-1280.png")
        page.get_by_role("tab", name="Shift").click()
        page.wait_for_selector("#shift-diagrams .ns-card svg", timeout=60_000)
        page.wait_for_timeout(500)
        save(page.screenshot(), "shift-dark-1280.png")
        page.close()
        lesson_shots(browser, url, save)
        browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nctv-shots-") as tmp:
        proc, url = start_app(Path(tmp))
        try:
            for path in shoot(url, args.out):
                print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
        finally:
            stop_app(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
