"""What a person sees, in headless Chromium: the first screen, a live calibration run, a picture
in "Try your own image", the Learn tab's slider. Screenshots go to test-artifacts/ (gitignored)."""
import os
import time
from pathlib import Path

import pytest

from nctv.ui.try_image import example_images

CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"needs Debian's Chromium at {CHROMIUM} (apt-get install chromium)"),
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_app_client import start_app, stop_app

    proc, url = start_app(tmp_path_factory.mktemp("browser-app"))
    yield url
    stop_app(proc)


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.set_default_timeout(60_000)
        start = time.monotonic()
        pg.goto(server)
        pg.wait_for_selector("#reliability-plot .js-plotly-plot")
        print(f"\npage open → default reliability diagrams: {time.monotonic() - start:.1f} s")
        yield pg
        browser.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_first_screen_shows_the_shipped_result(page):
    table = page.locator("#results-table")
    assert "pre-computed, shipped with the app" in table.inner_text()
    assert "Neural Clamping (FL)" in table.inner_text()
    assert page.locator("#reliability-plot .js-plotly-plot .main-svg").count() > 0
    shot(page, "1-first-screen")


def _status(page) -> str:
    return page.locator("#calibrate-status").inner_text()


def test_stop_ends_a_run(page):
    page.locator("#calibration-size input").fill("300")
    page.locator("#test-size input").fill("1000")
    page.get_by_label("paper recipe (SGD + momentum").check()
    page.get_by_role("button", name="Run calibration").click()
    page.wait_for_function("document.querySelector('#calibrate-status').innerText.includes('Running')")
    page.get_by_role("button", name="Stop").first.click()
    page.wait_for_function("document.querySelector('#calibrate-status').innerText.includes('Stopped')")
    assert "pre-computed, shipped with the app" in page.locator("#results-table").inner_text()
    page.get_by_label("fast (default").check()


def test_a_live_calibration_run(page):
    page.get_by_role("button", name="Run calibration").click()
    page.wait_for_function("document.querySelector('#calibrate-status').innerText.includes('Done')", timeout=240_000)
    table = page.locator("#results-table").inner_text()
    assert "your run of" in table and "Uncalibrated" in table and "Neural Clamping (FL)" in table
    assert page.locator("#live-plot .js-plotly-plot").count() == 1
    assert page.locator("#reliability-plot .js-plotly-plot").count() == 1
    shot(page, "2-after-run")


def test_try_your_own_image(page):
    page.get_by_role("tab", name="Try your own image").click()
    page.locator("#try-image input[type=file]").set_input_files(example_images()[2])
    page.wait_for_function(
        "document.querySelector('#try-note') && document.querySelector('#try-note').innerText.includes('your run')",
        timeout=60_000)
    for label in ("#label-raw", "#label-ts", "#label-nc"):
        assert "%" in page.locator(label).inner_text()
    assert page.locator("#try-delta .js-plotly-plot").count() == 1
    shot(page, "3-try-image")


def test_draw_and_classify(page):
    page.get_by_role("tab", name="Draw").click()
    box = page.locator("#try-sketch canvas").first.bounding_box()
    x, y = box["x"] + box["width"] * 0.4, box["y"] + box["height"] * 0.2
    page.mouse.move(x, y)
    page.mouse.down()
    # A zig-zag filled shape, top to bottom; few mouse events, as the canvas renders slowly without a GPU.
    for i in range(6):
        page.mouse.move(x + (i % 2) * box["width"] * 0.25, y + i * box["height"] * 0.1, steps=2)
    page.mouse.up()
    page.get_by_role("button", name="Classify the drawing").click()
    page.wait_for_function(
        "document.querySelector('#try-note') && document.querySelector('#try-note').innerText.includes('280 × 280')",
        timeout=60_000)
    assert "%" in page.locator("#label-nc").inner_text()
    shot(page, "4-drawing")


def test_learn_slider_redraws(page):
    page.get_by_role("tab", name="Learn").click()
    box = page.locator("#learn-temperature input[type=number]")
    box.fill("2")
    box.press("Enter")
    page.wait_for_function("document.body.innerText.includes('T = 2.00 (slider)')", timeout=30_000)
    assert page.locator("#learn-plot .js-plotly-plot").count() == 1
    shot(page, "5-learn")
