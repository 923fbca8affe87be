"""``python -m bench.browser``: the app as a visitor's browser sees it, on this machine's CPUs.

Launches ``python app.py`` offline on a free port and opens it in headless Chromium (Debian's, at
/usr/bin/chromium), then reports, as medians:

* first paint and first contentful paint of the app (the browser's paint timings, from navigation
  start), and the time until the first tab's reliability diagrams are drawn;
* the time from the first click on the Learn tab to its diagram (the test logits' one trip);
* the Learn tab's redraw: 20 moves of a mouse drag on the temperature slider, each timed in the page
  from the input event's time stamp to the updated diagram and read-outs (``data-redraw-ms``),
  with the number of requests the drag sent (0: it is computed in the page);
* the Learn tab's smoothed diagram and smooth ECE, computed in the page after a move, at most once
  a frame (``data-smooth-ms``), at 5 temperatures; and its table and explanations (accuracy, entropy,
  ECE, AECE, SCE at the moved T), written in the page in the frame after the move (``data-words-ms``);
* beside it, one round trip of the ``/explore_temperature`` endpoint (what every move of T cost when
  the server drew the diagram), so that the two read as a ratio.

Writes bench/results/browser.json and prints a Markdown summary.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic"]
MOVES = 20


def first_screen(browser, url: str) -> dict:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    start = time.perf_counter()
    page.goto(url)
    page.wait_for_selector("#calibrate-diagrams svg", timeout=120_000)
    diagrams = time.perf_counter() - start
    paints = page.evaluate("Object.fromEntries(performance.getEntriesByType('paint').map(e => [e.name, e.startTime]))")
    page.close()
    return {"first_paint_ms": paints.get("first-paint"), "first_contentful_paint_ms": paints.get("first-contentful-paint"),
            "first_diagrams_s": diagrams}


def learn_drag(browser, url: str) -> dict:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    page.wait_for_selector("#calibrate-diagrams svg", timeout=120_000)
    start = time.perf_counter()
    page.get_by_role("tab", name="Learn").click()
    page.wait_for_selector("#learn-plot svg")
    first_view = time.perf_counter() - start  # the logits' one trip to the page, then the first drawing
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    box = page.locator("#learn-t").bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + 8, y)
    page.mouse.down()
    times = []
    for i in range(1, MOVES + 1):
        page.mouse.move(box["x"] + 8 + i * (box["width"] - 16) / (MOVES + 1), y)
        times.append(float(page.locator(".nl").get_attribute("data-redraw-ms")))
    sent = len(requests)
    page.mouse.up()
    # The smoothed diagram and its smooth ECE, computed in the page after a move (data-smooth-ms).
    smooth, words = [], []
    for t in (0.5, 1.0, 1.5, 2.0, 3.0):
        page.evaluate("""t => { const r = document.querySelector('#learn-t'); r.value = String(t);
                         r.dispatchEvent(new Event('input', {bubbles: true})); }""", t)
        page.wait_for_function(f"Number(document.querySelector('.nl').dataset.smoothTemperature) === {t}")
        page.wait_for_function(f"Number(document.querySelector('.nl').dataset.wordsTemperature) === {t}")
        smooth.append(float(page.locator(".nl").get_attribute("data-smooth-ms")))
        words.append(float(page.locator(".nl").get_attribute("data-words-ms")))
    page.close()
    return {"learn_first_view_s": first_view, "redraw_ms": times, "redraw_median_ms": statistics.median(times),
            "requests_during_drag": sent, "smooth_ms": smooth, "smooth_median_ms": statistics.median(smooth),
            "words_ms": words, "words_median_ms": statistics.median(words)}


def server_round_trip(url: str, repeats: int = 5) -> dict:
    from gradio_client import Client

    client = Client(url, verbose=False)
    client.predict(1.0, 15, api_name="/explore_temperature")  # the first call pays for imports
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        client.predict(1.0 + 0.25 * (i + 1), 15, api_name="/explore_temperature")
        times.append(1000 * (time.perf_counter() - start))
    return {"explore_temperature_ms": times, "explore_temperature_median_ms": statistics.median(times)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "browser.json")
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        # The test suite's launcher: the same offline settings as the browser tests.
        from tests.conftest import start_app, stop_app

        proc, url = start_app(Path(tmp))
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                # The server warms up its caches at start; the first visit is timed after one untimed visit.
                first_screen(browser, url)
                screen = first_screen(browser, url)
                drag = learn_drag(browser, url)
                browser.close()
            trip = server_round_trip(url)
        finally:
            stop_app(proc)
    report = {"cpus": os.cpu_count(), "load_average": os.getloadavg()[0], **screen, **drag, **trip,
              "round_trip_over_redraw": trip["explore_temperature_median_ms"] / drag["redraw_median_ms"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"""| measure (headless Chromium, {report['cpus']} CPUs, load {report['load_average']:.2f}) | value |
| :-- | --: |
| first paint | {screen['first_paint_ms']:.0f} ms |
| first contentful paint | {screen['first_contentful_paint_ms']:.0f} ms |
| first tab's diagrams drawn | {screen['first_diagrams_s']:.2f} s |
| Learn tab's first diagram after its first click (logits sent once) | {drag['learn_first_view_s']:.2f} s |
| Learn redraw, median of {MOVES} drag moves (in the page) | {drag['redraw_median_ms']:.1f} ms |
| requests sent during the drag | {drag['requests_during_drag']} |
| Learn smoothed diagram and smooth ECE after a move, median of 5 T (in the page) | {drag['smooth_median_ms']:.0f} ms |
| Learn table and explanations after a move, median of 5 T (in the page) | {drag['words_median_ms']:.0f} ms |
| `/explore_temperature` round trip (server-drawn diagram), median of 5 | {trip['explore_temperature_median_ms']:.0f} ms |
| round trip / in-page redraw | {report['round_trip_over_redraw']:.0f}× |""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
