"""The Calibrate tab as a person sees it at a desktop (1400 × 1000), a projector (1280 × 720) and a
phone (390 × 844), in headless Chromium on the launched app: Run where one looks, figures and tables
that stay readable, every download in view, one error message that the next run clears, and the live
plot counting passes. Positions and sizes are read off the page; screenshots go to test-artifacts/."""
import re

import pytest

from test_browser import ARTIFACTS, CHROMIUM, boxes_overlap, browser, open_panel, wait_for_status  # noqa: F401

pytestmark = pytest.mark.browser
SIZES = [(1400, 1000, False), (1280, 720, False), (390, 844, True)]

#: The text of every table cell whose lines (the distinct tops of its text's boxes) number more than one.
WRAPPED_CELLS = """sel => [...document.querySelectorAll(sel + ' td, ' + sel + ' th')].filter(cell => {
    const range = document.createRange(); range.selectNodeContents(cell);
    const tops = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
    return tops.size > 1; }).map(cell => cell.innerText)"""


def open_at(browser, url: str, width: int, height: int, phone: bool):
    context = browser.new_context(viewport={"width": width, "height": height}, is_mobile=phone, has_touch=phone)
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    pg.goto(url)
    pg.locator("#reliability-plot .js-plotly-plot:visible").first.wait_for()
    pg.wait_for_timeout(500)  # plotly sizes the figure to its box
    return pg


def visible_titles(page, box: str) -> list[dict]:
    """Bounding boxes of the panel titles of the figure in ``box`` that is shown (the ECE labels aside)."""
    titles = page.locator(f"{box} .js-plotly-plot:visible .annotation-text").all()
    return [t.bounding_box() for t in titles if not (t.text_content() or "").startswith("ECE")]


def assert_apart(boxes: list[dict], what: str) -> None:
    for i, a in enumerate(boxes):
        assert not any(boxes_overlap(a, b) for b in boxes[i + 1:]), f"{what} overlap"


@pytest.mark.parametrize("width,height,phone", SIZES, ids=[f"{w}x{h}" for w, h, _ in SIZES])
def test_first_screen_reads_at_every_size(browser, server, width, height, phone):  # noqa: F811
    page = open_at(browser, server, width, height, phone)
    try:
        # Run, Stop and the status line within the first screen, above the method boxes.
        run = page.get_by_role("button", name="Run calibration").bounding_box()
        status = page.locator("#calibrate-status").bounding_box()
        print(f"\n{width} × {height}: Run at y = {run['y']:.0f} px")
        assert run["y"] + run["height"] <= height and status["y"] < height
        assert run["y"] < page.get_by_text("Methods", exact=True).bounding_box()["y"]
        # One reliability figure shown: a row on a wide screen, a stack on a phone; titles apart.
        shown = page.locator("#reliability-plot .js-plotly-plot:visible")
        assert shown.count() == 1
        wanted = "#reliability-stack" if phone else "#reliability-row"
        assert page.locator(f"{wanted} .js-plotly-plot").is_visible()
        titles = visible_titles(page, "#reliability-plot")
        assert len(titles) == 5
        assert_apart(titles, f"reliability titles at {width} px")
        ends = sorted(t["y"] + t["height"] for t in titles)  # titles of one row end on one line
        rows = 1 + sum(b - a > 20 for a, b in zip(ends, ends[1:]))
        assert rows == (5 if phone else 1)  # one panel per row when stacked, one row otherwise
        # The results table: no number broken over two lines; it scrolls sideways instead.
        assert page.evaluate(WRAPPED_CELLS, "#results-table") == []
        cells = [c.bounding_box() for c in page.locator("#results-table td").all()]
        assert_apart(cells, f"table cells at {width} px")
        # Every download in view, calibrators.zip first.
        files = page.locator("#calibrate-files")
        overflow = files.evaluate("""box => [...box.querySelectorAll('*')].filter(e =>
            e.scrollHeight > e.clientHeight + 1 && getComputedStyle(e).overflowY !== 'visible').length""")
        assert overflow == 0, "the download box hides files behind a scroll bar"
        box = files.bounding_box()
        names = files.locator("tr, .file").all()
        assert len(names) >= 9
        for row in names:
            r = row.bounding_box()
            assert box["y"] <= r["y"] and r["y"] + r["height"] <= box["y"] + box["height"]
        assert "calibrators" in names[0].inner_text()
        print(f"{width} × {height}: download box {box['height']:.0f} px for {len(names)} files")
        page.screenshot(path=str(ARTIFACTS / f"calibrate-{width}.png"), full_page=width == 1400)
        if phone:
            page.locator("#reliability-stack").screenshot(path=str(ARTIFACTS / "calibrate-390-diagrams.png"))
        # The study tabs: their Run button too within the first screen, above their settings.
        for tab, button in (("γ sweep", "Run γ sweep"), ("Initialisation", "Run initialisation study")):
            page.get_by_role("tab", name=tab).click()
            run = page.get_by_role("button", name=button).bounding_box()
            assert run["y"] + run["height"] <= height, f"{button} at y = {run['y']:.0f} px"
    finally:
        page.context.close()


def errors_shown(page, words: str) -> int:
    """How many visible elements of the page carry ``words`` (the innermost ones)."""
    return page.evaluate("""words => [...document.querySelectorAll('body *')].filter(e =>
        e.offsetParent !== null && e.innerText && e.innerText.includes(words)
        && ![...e.children].some(c => c.innerText && c.innerText.includes(words))).length""", words)


def test_one_error_beside_run_then_cleared_and_the_live_plot_counts_passes(browser, server):  # noqa: F811
    page = open_at(browser, server, 1400, 1000, False)
    try:
        open_panel(page)
        words = "Calibration size must be at least 10"
        for attempt in range(2):  # a second failure replaces the first: no pile of old errors
            page.locator("#calibration-size input").fill("3")
            page.get_by_role("button", name="Run calibration").click()
            wait_for_status(page, words, 60_000)
            page.wait_for_timeout(1000)  # time for a toast or an error mark to appear, were there one
            assert errors_shown(page, words) == 1
            assert page.locator(".toast-body:visible").count() == 0  # no toast, so no "Error (2)" pile
            # Gradio's own "Error" mark over the status text, were it shown.
            assert page.locator("[data-testid=status-tracker] .error:visible").count() == 0
        status = page.locator("#calibrate-status").bounding_box()
        run = page.get_by_role("button", name="Run calibration").bounding_box()
        assert 0 <= status["y"] - (run["y"] + run["height"]) < 60  # right under the button pressed
        page.screenshot(path=str(ARTIFACTS / "calibrate-error.png"))
        page.locator("#calibration-size input").fill("300")
        page.locator("#test-size input").fill("1000")
        page.get_by_role("button", name="Run calibration").click()
        wait_for_status(page, " left", 120_000)  # "… left" from the first step on
        page.screenshot(path=str(ARTIFACTS / "calibrate-running.png"))
        wait_for_status(page, "Done", 240_000)
        assert errors_shown(page, words) == 0 and "Error" not in page.locator("#calibrate-status").inner_text()
        # The live plot's x values are passes: its last point is the fit's pass count, as the parameters say.
        xs = page.evaluate("document.querySelector('#live-plot .js-plotly-plot').data[0].x")
        passes = float(re.search(r"Neural Clamping \(FL\):.*?([\d.]+) passes over the calibration split",
                                 page.locator("body").inner_text()).group(1))
        assert xs == sorted(xs) and xs[-1] == pytest.approx(passes, abs=0.05)
        assert len(xs) > 3 and xs != list(range(len(xs)))  # passes, not a count of points
        page.screenshot(path=str(ARTIFACTS / "calibrate-after-run.png"), full_page=True)
    finally:
        page.context.close()
