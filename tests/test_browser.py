"""What a person sees, in headless Chromium: the first screen, a live calibration run, an error
that keeps the last result, a picture in "Try your own image", the Learn tab's slider, and the
layouts of a phone and a projector. Screenshots go to test-artifacts/ (gitignored); the tests read
positions, text and colours off the page and its screenshots."""
import io
import os
import re
import time
from pathlib import Path

import pytest
from PIL import Image

from nctv.ui.try_image import example_images
from conftest import PAGE_WAIT_MS

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
def browser():
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def open_app(browser, url: str, width: int, height: int, phone: bool = False):
    """A fresh page of the app at this viewport, once the first screen's diagrams are drawn."""
    context = browser.new_context(viewport={"width": width, "height": height}, is_mobile=phone, has_touch=phone)
    pg = context.new_page()
    pg.set_default_timeout(PAGE_WAIT_MS)
    pg.goto(url)
    pg.locator("#calibrate-diagrams svg").first.wait_for()
    return pg


@pytest.fixture(scope="module")
def page(browser, server):
    start = time.monotonic()
    pg = open_app(browser, server, 1400, 1000)
    print(f"\npage open → default reliability diagrams: {time.monotonic() - start:.1f} s")
    yield pg
    pg.context.close()


def open_panel(page) -> None:
    """Open the shared "Model and data" panel (closed by default) when it is closed."""
    if not page.locator("#calibration-size input").is_visible():
        page.locator("#shared-panel").get_by_role("button").first.click()
        page.locator("#calibration-size input").wait_for(state="visible")


def boxes_overlap(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"]
            and a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"])


def hex_rgb(css: str) -> tuple[int, int, int]:
    if css.startswith("#"):
        return tuple(int(css[i:i + 2], 16) for i in (1, 3, 5))
    return tuple(int(v) for v in re.findall(r"\d+", css)[:3])


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_first_screen_shows_the_shipped_result(page):
    table = page.locator("#results-table")
    assert "pre-computed, shipped with the app" in table.inner_text()
    assert "Neural Clamping (FL)" in table.inner_text()
    assert page.locator("#calibrate-diagrams .nc-card svg").count() == 10  # two diagrams for each of 5 methods
    shot(page, "1-first-screen")


def _status(page) -> str:
    return page.locator("#calibrate-status").inner_text()


def wait_for_status(page, text: str, timeout: float) -> None:
    """Wait until the Calibrate status line contains ``text``; a timeout says what it showed instead."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(f"document.querySelector('#calibrate-status').innerText.includes({text!r})",
                               timeout=timeout)
    except PlaywrightTimeout:
        shot(page, "status-timeout")
        raise AssertionError(f"the status line never said {text!r} within {timeout / 1000:.0f} s; it says: "
                             f"{_status(page)!r}") from None


def test_the_panel_says_which_tabs_it_drives(page):
    panel = page.locator("#shared-panel")
    assert "for Calibrate, γ sweep and Initialisation" in panel.inner_text()
    open_panel(page)
    assert "Learn and Try your own image use the latest calibration" in panel.inner_text()
    page.locator("#calibration-size input").fill("300")
    page.locator("#calibration-size input").press("Tab")
    page.wait_for_function("document.querySelector('#shared-panel').innerText.includes('300 calibration images')")


def test_stop_ends_a_run(page):
    open_panel(page)
    page.locator("#calibration-size input").fill("300")
    page.locator("#test-size input").fill("1000")
    page.get_by_label("paper recipe", exact=True).check()
    page.get_by_role("button", name="Run calibration").click()
    page.wait_for_function("document.querySelector('#calibrate-status').innerText.includes('Running')")
    page.get_by_role("button", name="Stop").first.click()
    wait_for_status(page, "Stopped", PAGE_WAIT_MS)  # a timeout says what the line showed instead
    assert "pre-computed, shipped with the app" in page.locator("#results-table").inner_text()
    page.get_by_label("fast (default)", exact=True).check()


def test_a_cancel_sent_with_this_pages_session_id_ends_its_run_on_the_page(page, server):
    """Gradio's cancel route stops a page's run from its session id and the event's number alone; one
    that names another event (as anyone who learnt the id could send) left the page saying "Running"
    for ever. The page now says "Stopped", as after its own Stop."""
    import json

    import httpx

    joins = []

    def joined(request):
        if "/queue/join" in request.url and request.post_data:
            joins.append(json.loads(request.post_data))

    page.on("request", joined)
    try:
        open_panel(page)
        page.get_by_label("paper recipe", exact=True).check()
        page.get_by_role("button", name="Run calibration").click()
        page.wait_for_function("document.querySelector('#calibrate-status').innerText.includes('Running')")
    finally:
        page.remove_listener("request", joined)
    config = httpx.get(server.rstrip("/") + "/config").json()
    calibrate = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "calibrate")
    run = next(j for j in reversed(joins) if j.get("fn_index") == calibrate)  # the page's run of /calibrate
    r = httpx.post(server.rstrip("/") + "/gradio_api/cancel",
                   json={"session_hash": run["session_hash"], "fn_index": run["fn_index"], "event_id": "another"})
    assert r.status_code == 200
    wait_for_status(page, "Stopped", PAGE_WAIT_MS)
    page.get_by_label("fast (default)", exact=True).check()


def test_a_live_calibration_run(page):
    page.get_by_role("button", name="Run calibration").click()
    wait_for_status(page, "Done", PAGE_WAIT_MS)
    table = page.locator("#results-table").inner_text()
    assert "your run of" in table and "Uncalibrated" in table and "Neural Clamping (FL)" in table
    assert page.locator("#live-plot .js-plotly-plot").count() == 1
    assert page.locator("#calibrate-diagrams .nc-card").count() == 5  # the five methods ticked at first
    shot(page, "2-after-run")


def test_an_error_says_so_in_the_status_line_and_keeps_the_last_result(page):
    open_panel(page)
    before = page.locator("#results-table").inner_text()
    page.locator("#calibration-size input").fill("5")
    page.get_by_role("button", name="Run calibration").click()
    page.wait_for_function("document.querySelector('#calibrate-status').innerText.includes('Error')")
    status = _status(page)
    assert "Calibration size must be at least 10" in status and "Running" not in status
    assert page.locator("#results-table").inner_text() == before  # the last good result stays
    assert "your run of" in before
    shot(page, "2b-error-keeps-result")
    page.locator("#calibration-size input").fill("300")


def test_many_methods_titles_apart_and_live_colours_match_the_legend(page):
    for name in ("Temperature Scaling (FL)", "Matrix Scaling", "MS-ODIR", "Dir-ODIR", "Neural Clamping (CE)",
                 "NC (Eff.)", "NC input only", "NC output only", "NC δ frozen at 0"):
        page.get_by_label(name, exact=True).check()
    page.get_by_role("button", name="Run calibration").click()
    wait_for_status(page, "Done", PAGE_WAIT_MS)
    shot(page, "2c-many-methods")
    for width in (1400, 1280, 390):
        page.set_viewport_size({"width": width, "height": 1000})
        page.wait_for_timeout(800)  # the diagrams redraw at the new size
        boxes = [t.bounding_box() for t in page.locator("#calibrate-diagrams .nc-card h3").all()]
        assert len(boxes) == 14
        for i, a in enumerate(boxes):
            assert not any(boxes_overlap(a, b) for b in boxes[i + 1:]), f"titles collide at {width} px"
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.wait_for_timeout(800)
    # The live plot: each legend entry's swatch is drawn in its lines' colour in both panels, and no two
    # methods share a colour. (Read from the rendered SVG: the swatch is a thin anti-aliased line whose
    # screenshot pixels are tints of its colour, and its label's text is coloured too.)
    legend = page.locator("#live-plot .legend .traces")
    assert legend.count() >= 2  # Neural Clamping (CE), (FL), and the variants that train live
    lines = page.locator("#live-plot .scatterlayer .trace")

    def stroke(locator):
        return hex_rgb(locator.locator("path.js-line").first.evaluate("e => getComputedStyle(e).stroke"))

    swatches = []
    for i in range(legend.count()):
        entry = legend.nth(i)
        name = entry.text_content().strip()
        swatch = stroke(entry)
        strokes = {stroke(lines.nth(j)) for j in range(lines.count()) if j % legend.count() == i}
        assert strokes == {swatch}, f"{name}: legend {swatch} and lines {strokes} differ"
        swatches.append(swatch)
    assert len(set(swatches)) == len(swatches), f"two methods share a colour: {swatches}"
    shot(page, "2d-live-plot")
    for name in ("Temperature Scaling (FL)", "Matrix Scaling", "MS-ODIR", "Dir-ODIR", "Neural Clamping (CE)",
                 "NC (Eff.)", "NC input only", "NC output only", "NC δ frozen at 0"):
        page.get_by_label(name, exact=True).uncheck()


def test_try_your_own_image(page):
    page.get_by_role("tab", name="Try your own image").click()
    page.locator("#try-image input[type=file]").set_input_files(example_images()[2])
    page.wait_for_function(
        "document.querySelector('#try-note') && document.querySelector('#try-note').innerText.includes('your run')",
        timeout=PAGE_WAIT_MS)
    rows = page.locator("#try-chart .nctv-class")
    assert rows.count() >= 5
    for method in ("raw", "ts", "nc"):
        bars = page.locator(f"#try-chart .nctv-bar[data-method={method}]")
        probs = [float(bars.nth(i).get_attribute("data-confidence")) for i in range(bars.count())]
        assert len(probs) == rows.count() and sum(probs) <= 1 + 1e-9
        for i, p in enumerate(probs):  # one decimal, as the probability says
            text = bars.nth(i).locator(".nctv-value").inner_text()
            value = re.search(r"([<>]?)\xa0?(\d+\.\d)\xa0%", text)  # never broken apart
            assert value, text
            sign, number = value.group(1), float(value.group(2))
            if sign == ">":  # "> 99.9 %": not rounded up to a certainty it is not
                assert number == 99.9 and 0.999 <= p < 1
            elif sign == "<":
                assert number == 0.1 and 0 < p < 0.001
            else:
                assert abs(number - 100 * p) <= 0.05 + 1e-9, (text, p)
    note = page.locator("#try-note").inner_text()
    assert "This model knows 10 classes: T-shirt/top, Trouser" in note and "Mahalanobis distance" in note
    assert "looks like the data the model knows" in page.locator("#try-verdict").inner_text()
    assert page.locator("#try-delta canvas").count() == 3
    shot(page, "3-try-image")


def test_the_try_tab_loads_the_downloaded_calibrators(page, tmp_path):
    from urllib.parse import urljoin

    page.get_by_role("tab", name="Calibrate").click()
    link = page.locator("#calibrate-files tr:has(td[aria-label='calibrators.zip']) a").first
    archive = tmp_path / "calibrators.zip"
    archive.write_bytes(page.request.get(urljoin(page.url, link.get_attribute("href"))).body())
    page.get_by_role("tab", name="Try your own image").click()
    page.locator("input[type=file][accept*='.zip']").set_input_files(str(archive))
    page.wait_for_function("document.querySelector('#try-loaded').innerText.includes('Loaded')", timeout=PAGE_WAIT_MS)
    assert "Neural Clamping (FL)" in page.locator("#try-loaded").inner_text()
    page.wait_for_function("document.querySelector('#try-note').innerText.includes('loaded from calibrators.zip')",
                           timeout=PAGE_WAIT_MS)
    shot(page, "3c-try-loaded-calibrators")


def test_a_picture_unlike_the_training_data_is_flagged(page, tmp_path):
    import numpy as np

    yy, xx = np.mgrid[0:240, 0:320] / 240.0  # a colourful photo-like gradient, nothing like clothing on black
    picture = np.stack([np.sin(3 * xx) * 0.5 + 0.5, yy, np.cos(2 * xx * yy) * 0.5 + 0.5], axis=-1)
    path = tmp_path / "sunset.png"
    Image.fromarray((255 * picture).astype("uint8")).save(path)
    page.locator("#try-image input[type=file]").set_input_files(str(path))
    page.wait_for_function("document.querySelector('#try-note').innerText.includes('320 × 240')", timeout=PAGE_WAIT_MS)
    assert "does not look like the data the model knows" in page.locator("#try-verdict").inner_text()
    shot(page, "3b-try-foreign")


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
        timeout=PAGE_WAIT_MS)
    assert "%" in page.locator("#try-chart .nctv-bar[data-method=nc]").first.inner_text()
    shot(page, "4-drawing")


def test_learn_slider_redraws(page):
    page.get_by_role("tab", name="Learn").click()
    box = page.locator("#learn-t-box")
    box.fill("2")
    box.press("Enter")
    assert "T = 2.00" in page.locator("#learn-plot svg").get_attribute("aria-label")  # drawn in the page
    page.wait_for_function("document.body.innerText.includes('T = 2.00 (slider)')", timeout=PAGE_WAIT_MS)
    shot(page, "5-learn")


def test_phone_shows_every_tab_at_the_top(browser, server):
    pg = open_app(browser, server, 390, 844, phone=True)
    try:
        tabs = pg.get_by_role("tab")
        names = [tabs.nth(i).inner_text().strip() for i in range(tabs.count())]
        assert names == ["Calibrate", "γ sweep", "Initialisation", "Try your own image", "Learn", "Shift"]
        for i in range(tabs.count()):
            box = tabs.nth(i).bounding_box()
            assert box["y"] + box["height"] <= 844 / 2 and box["x"] + box["width"] <= 390  # in the first half-screen
        shot(pg, "6-phone")
        pg.get_by_role("tab", name="Learn").click()
        pg.wait_for_selector("#learn-plot svg")
    finally:
        pg.context.close()


def test_projector_shows_the_learn_diagram_without_scrolling(browser, server):
    pg = open_app(browser, server, 1280, 720)
    try:
        pg.get_by_role("tab", name="Learn").click()
        plot = pg.locator("#learn-plot svg")
        plot.wait_for()
        pg.wait_for_timeout(500)
        box = plot.bounding_box()
        assert box["y"] >= 0 and box["y"] + box["height"] <= 720, box
        assert pg.evaluate("window.scrollY") == 0
        # The slider sits beside it, also on screen.
        slider = pg.locator("#learn-t").bounding_box()
        assert slider["y"] + slider["height"] <= 720 and slider["x"] + slider["width"] <= box["x"]
        shot(pg, "7-projector-learn")
        png = Image.open(io.BytesIO(pg.screenshot()))  # the viewport only: what the room sees
        strip = png.convert("RGB").crop((int(box["x"]), int(box["y"]), int(box["x"] + box["width"]),
                                         int(box["y"] + box["height"])))
        blue = sum(1 for px in strip.getdata() if px[2] > 150 and px[0] < 80)  # the accuracy bars
        assert blue > 2000
    finally:
        pg.context.close()


def test_the_gamma_tab_opens_on_the_shipped_sweep(page):
    """The γ sweep tab's first screen is the sweep shipped with the pre-computed result: its figure, and a
    table whose chosen γ and test ECE are those of the shipped file."""
    import json

    from nctv.data import assets_dir
    from nctv.results import GAMMA_SWEEP_FILE

    shipped = json.loads((assets_dir() / "precomputed" / GAMMA_SWEEP_FILE).read_text())
    page.get_by_role("tab", name="γ sweep").click()
    page.locator("#gamma-plot .js-plotly-plot").wait_for()
    assert "pre-computed, shipped with the app" in page.locator("#gamma-status").inner_text()
    chosen = shipped["chosen_gamma"]
    row = page.locator("table tr", has_text=f"{chosen:g} (chosen)").first
    table = row.locator("xpath=ancestor::table[1]")
    header = [c.strip() for c in table.locator("tr").first.inner_text().split("\t")]
    cells = [c.strip() for c in row.inner_text().split("\t")]
    assert cells[0] == f"{chosen:g} (chosen)"
    i = shipped["gammas"].index(chosen)
    column = next(k for k, h in enumerate(header) if h.startswith("ECE test"))
    assert cells[column].startswith(f"{100 * shipped['splits']['test']['ece'][i]:.2f} [")
    # Every row records its δ's size, as a run's Neural Clamping row does.
    assert cells[header.index("‖δ‖₂")] == f"{shipped['delta_l2'][i]:.3f}"
    assert page.locator("#gamma-plot .js-plotly-plot .scatterlayer .trace").count() >= 4
    page.get_by_role("tab", name="Calibrate").click()


def test_the_initialisation_tab_opens_on_the_shipped_study(page):
    """The Initialisation tab's first screen is the study shipped with the pre-computed result: its box
    plots, and a table whose ECE means and intervals are those of the shipped file."""
    import json

    import numpy as np

    from nctv.data import assets_dir
    from nctv.results import INIT_STUDY_FILE

    shipped = json.loads((assets_dir() / "precomputed" / INIT_STUDY_FILE).read_text())
    page.get_by_role("tab", name="Initialisation").click()
    page.locator("#init-plot .js-plotly-plot").wait_for()
    assert "pre-computed, shipped with the app" in page.locator("#init-status").inner_text()
    for init, label in (("random", "Random δ₀"), ("data", "Data-driven δ₀ (Theorem 1)")):
        row = page.locator("table tr", has_text=label).first
        ece = row.inner_text().split("\t")[2].strip()
        ci = shipped["ci"][init]["ece"]
        mean = np.mean([100 * r["ece"] for r in shipped["runs"][init]])
        assert ece == f"{mean:.2f} [{100 * ci['ci_low']:.2f}, {100 * ci['ci_high']:.2f}]"
    page.get_by_role("tab", name="Calibrate").click()
