"""Take the screenshots of docs/app.md: every tab of the launched app at a phone's, a projector's and a
desktop's size, and the Learn tab in presenter mode, with Debian's Chromium (never a downloaded one).

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
TABS = {"calibrate": "Calibrate", "try": "Try your own image", "learn": "Learn"}


def small_png(png: bytes, path: Path) -> None:
    """Save as an 8-bit palette PNG: a screenshot of flat colours loses nothing visible and shrinks."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=128)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, optimize=True)


def shoot(url: str, out: Path) -> list[Path]:
    from playwright.sync_api import sync_playwright

    written = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        for size, (w, h) in SIZES.items():
            page = browser.new_page(viewport={"width": w, "height": h})
            page.goto(url)
            page.wait_for_selector("#results-table table", timeout=120_000)
            for key, tab in TABS.items():
                page.get_by_role("tab", name=tab).click()
                page.wait_for_timeout(2500)
                path = out / f"{key}-{size}.png"
                small_png(page.screenshot(full_page=size == "390"), path)
                written.append(path)
            if size == "1280":
                page.click("#learn-presenter")
                page.wait_for_timeout(800)
                path = out / "learn-presenter-1280.png"
                small_png(page.screenshot(), path)
                written.append(path)
            page.close()
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
