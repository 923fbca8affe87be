"""The Learn tab in headless Chromium, against the launched app: the page's own read-outs equal
``nctv.metrics`` on the shipped logits file, a move of T redraws without a request, a typed T out of
range is clamped with a message (these three on a phone, a projector and a desktop), presenter mode is large and legible on a 1280 × 720 projector, the
dark theme darkens the plot, and nothing overlaps on a phone. Screenshots go to test-artifacts/."""
import io
import json
import re
import statistics
from pathlib import Path

import pytest
from PIL import Image
from safetensors.torch import load_file
from test_browser import ARTIFACTS, CHROMIUM, browser, open_app, open_panel, wait_for_status  # noqa: F401 - browser: the shared fixture
from test_try_browser import by_size, page_per_size

from nctv import metrics
from nctv.ui import learn
from nctv.ui.shipped import load_precomputed, precomputed_dir

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"needs Debian's Chromium at {CHROMIUM}"),
]
SHOTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def save_small(png: bytes, name: str) -> None:
    """A screenshot to look at, as a small palette PNG (scripts/screenshots.py makes the docs' own)."""
    SHOTS.mkdir(exist_ok=True)
    Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=96).save(SHOTS / name, optimize=True)


@pytest.fixture(scope="module")
def shipped():
    """The shipped test logits and labels, read from the file itself (not through the app)."""
    tensors = load_file(str(precomputed_dir() / "test_logits.safetensors"))
    return tensors["Uncalibrated"].double(), tensors["labels"]


def open_learn(browser, url, width, height, theme="", phone=False):  # noqa: F811 - the fixture's value
    pg = open_app(browser, url + (f"?__theme={theme}" if theme else ""), width, height, phone=phone)
    pg.get_by_role("tab", name="Learn").click()
    pg.wait_for_selector("#learn-plot svg")
    return pg


#: A phone, a projector, a desktop: (width, height).
SIZES = [(390, 844), (1280, 720), (1400, 1000)]


# The Learn tab at one size, shared by the tests of that size in their order in this file.
page = page_per_size("page", lambda browser, url, width, height: open_learn(browser, url, width, height,
                                                                           phone=width < 500))
EVERY_SIZE, DESKTOP = by_size("page", SIZES), by_size("page", SIZES[-1:])


def set_range(page, selector: str, value) -> None:
    """Move a range input as a drag does: one input event, no change event."""
    page.evaluate("""([sel, v]) => { const r = document.querySelector(sel); r.value = String(v);
                     r.dispatchEvent(new Event('input', {bubbles: true})); }""", [selector, value])


def readouts(page) -> dict:
    return page.evaluate("""() => Object.fromEntries(['ece', 'accuracy', 'confidence'].map(k => {
        const e = document.querySelector('#learn-' + k); return [k, [Number(e.dataset.value), e.textContent]]; }))""")


def expected(z, y, t: float, bins: int) -> dict:
    conf, _ = metrics.confidences_and_predictions(z / t)
    return {"ece": metrics.ece(z / t, y, bins), "accuracy": metrics.accuracy(z / t, y), "confidence": float(conf.mean())}


def check_readouts(page, z, y, t, bins) -> None:
    got, want = readouts(page), expected(z, y, t, bins)
    for key, value in want.items():
        assert got[key][0] == pytest.approx(value, abs=1e-6), (key, t, bins)
        assert got[key][1] == f"{100 * value:.2f}%", (key, t, bins)


@EVERY_SIZE
def test_readouts_equal_the_library_metrics(page, shipped):
    z, y = shipped
    for bins in (15, 10, 37):
        set_range(page, "#learn-bins", bins)
        for t in (0.3, 1.0, 1.75, 3.61, 5.0):
            set_range(page, "#learn-t", t)
            assert float(page.locator(".nl").get_attribute("data-temperature")) == t
            check_readouts(page, z, y, t, bins)
    # A typed T inside the range is used as typed, not rounded to the slider's step.
    set_range(page, "#learn-bins", 15)
    box = page.locator("#learn-t-box")
    box.fill("2.345")
    box.press("Enter")
    check_readouts(page, z, y, 2.345, 15)
    # The page's own table and explanations follow (tests/test_lesson_browser.py compares them with Python's).
    page.wait_for_function("document.querySelector('#learn-table').innerText.includes('T = 2.35 (slider)')")
    assert f"{100 * metrics.ece(z / 2.345, y, 15):.2f}%" in page.locator("#learn-text").inner_text()


@DESKTOP
def test_aps_set_size_in_the_page_equals_the_library(page, shipped):
    """The page's APS set size at 90 % follows T as nctv.conformal.aps_mean_set_size computes it on the
    same logits (as the page gets them, float32): the threshold from the even rows, sizes on the odd."""
    from nctv.conformal import aps_mean_set_size

    z, y = shipped
    z = z.float().double()
    sizes = []
    for t in (0.5, 1.0, 2.0, 3.61):
        set_range(page, "#learn-t", t)
        got = page.evaluate("() => document.querySelector('#learn-aps').dataset.value")
        want = aps_mean_set_size(z[0::2], y[0::2], z[1::2], t)
        # At small T many probabilities round to 1 and the running sums tie with q̂ = 1: there the page's
        # Math.exp and torch's exp, a last bit apart, may put a few sets one class apart (< 0.1 % of them).
        assert float(got) == pytest.approx(want, abs=5e-3), t
        assert page.locator("#learn-aps").inner_text() == f"{float(got):.2f} classes"
        sizes.append(want)
    assert len(set(sizes)) > 1  # T changes the set size


@DESKTOP
def test_smooth_ece_equals_the_library(page, shipped):
    """The page's smooth ECE, its bandwidth and, once T settles, its band of resamples: the read-out
    equals nctv.metrics.smooth_ece to 1e-6 at several T, the bandwidth that of smooth_reliability."""
    z, y = shipped
    for t in (0.3, 1.0, 1.75, 3.61, 5.0):
        set_range(page, "#learn-t", t)
        page.wait_for_function(f"Number(document.querySelector('.nl').dataset.smoothTemperature) === {t}")
        read = page.locator("#learn-smooth-ece")
        want = metrics.smooth_ece(z / t, y)
        assert float(read.get_attribute("data-value")) == pytest.approx(want, abs=1e-6), t
        assert read.inner_text() == f"{100 * want:.2f}%"
        label = page.locator("#learn-smooth svg").get_attribute("aria-label")
        assert f"T = {t:.2f}" in label and f"bandwidth {metrics.smooth_reliability(z / t, y).bandwidth:.3f}" in label
    # Released at T = 5: the band of the page's resamples follows, drawn around the curve.
    page.locator("#learn-t").dispatch_event("change")
    page.wait_for_function("Number(document.querySelector('.nl').dataset.bandTemperature) === 5")
    assert "95% band of 100 resamples" in page.locator("#learn-smooth svg").get_attribute("aria-label")
    assert page.locator("#learn-smooth svg path.nd-band").count() == 1


@EVERY_SIZE
def test_dragging_redraws_in_the_page_without_a_request(page):
    """20 moves of a mouse drag: each redraws the diagram, none sends a request; the median time from
    the input event to the updated page is recorded per size (bench/browser.py reports it too)."""
    requests = []

    def sent(request):
        requests.append(request.url)
    page.on("request", sent)
    slider = page.locator("#learn-t")
    slider.scroll_into_view_if_needed()
    box = slider.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + 8, y)
    page.mouse.down()
    temperatures, times, labels = [], [], []
    for i in range(1, 21):
        page.mouse.move(box["x"] + 8 + i * (box["width"] - 16) / 21, y)
        state_ = page.evaluate("""() => { const r = document.querySelector('.nl');
            return [Number(r.dataset.temperature), Number(r.dataset.redrawMs),
                    document.querySelector('#learn-plot svg').getAttribute('aria-label')]; }""")
        temperatures.append(state_[0])
        times.append(state_[1])
        labels.append(state_[2])
    moved = requests[:]
    page.mouse.up()
    page.remove_listener("request", sent)
    assert not moved, moved
    assert len(set(temperatures)) == 20 and temperatures == sorted(temperatures)
    assert all(f"T = {learn_t(t)}" in label for t, label in zip(temperatures, labels))
    ARTIFACTS.mkdir(exist_ok=True)
    size = "{width}x{height}".format(**page.viewport_size)
    (ARTIFACTS / f"learn-redraw-{size}.json").write_text(json.dumps({"median_ms": statistics.median(times), "ms": times}))
    print(f"\nLearn redraw at {size}, median of 20 drag moves: {statistics.median(times):.1f} ms")
    # The table follows in the page too, without a request.
    page.wait_for_function(f"document.querySelector('#learn-table').innerText.includes('T = {temperatures[-1]:.2f} (slider)')")


def learn_t(t: float) -> str:
    return f"{t:.2f}"


@EVERY_SIZE
def test_typed_temperature_out_of_range_is_clamped_with_a_message(page, shipped):
    z, y = shipped
    errors = []

    def failed(response):
        if response.status >= 500:
            errors.append(response.url)
    page.on("response", failed)
    box = page.locator("#learn-t-box")
    for typed, used, word in (("7", 5.0, "above"), ("0.01", 0.05, "below")):
        box.fill(typed)
        box.press("Enter")
        message = page.locator("#learn-message").inner_text()
        assert f"T = {typed} is {word}" in message and f"using T = {used:.2f}" in message
        assert box.input_value() == f"{used:.2f}"
        assert float(page.locator("#learn-t").input_value()) == used
        check_readouts(page, z, y, used, 15)
        page.wait_for_function(f"document.querySelector('#learn-table').innerText.includes('T = {used:.2f} (slider)')")
    page.remove_listener("response", failed)
    assert not errors


@DESKTOP
def test_fit_button_and_bins_follow_in_the_page(page, shipped):
    z, y = shipped
    fitted = load_precomputed().calibration.ts_temperature
    page.get_by_role("button", name="Set T to the temperature-scaling fit").click()
    assert float(page.locator(".nl").get_attribute("data-temperature")) == pytest.approx(fitted, abs=1e-12)
    check_readouts(page, z, y, fitted, 15)
    slider = page.locator("#learn-bins")
    slider.focus()
    for _ in range(5):
        slider.press("ArrowLeft")
    assert page.locator("#learn-bins-value").inner_text() == "10"
    check_readouts(page, z, y, fitted, 10)
    page.wait_for_function("document.querySelector('#learn-table').innerText.includes('10 bins')")


def _luminance(rgb) -> float:
    def lin(c):
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (lin(float(c)) for c in rgb[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _rgb(css: str) -> tuple:
    return tuple(float(v) for v in re.findall(r"[\d.]+", css)[:3])


def contrast(a: str, b: str) -> float:
    la, lb = sorted((_luminance(_rgb(a)), _luminance(_rgb(b))), reverse=True)
    return (la + 0.05) / (lb + 0.05)


STYLES = """() => {
    const st = (e) => getComputedStyle(e);
    const bg = st(document.querySelector('.nl')).backgroundColor;
    const plotBg = st(document.querySelector('#learn-plot')).backgroundColor;
    const texts = [...document.querySelectorAll('.nl-figs svg text:not(.nd-on-bar)')]
        .map(e => [st(e).fontSize, st(e).fill]);
    const onBar = [...document.querySelectorAll('#learn-plot svg text.nd-on-bar')]
        .map(e => [st(e).fontSize, st(e).fill, st(document.querySelector('#learn-plot .nd-hist')).fill]);
    const labels = ['.nl-ends span', '#learn-ece', '#learn-lead', '#learn-message', '.nl-read dt']
        .map(s => document.querySelector(s)).map(e => [st(e).fontSize, st(e).color]);
    return {bg, plotBg, texts, onBar, labels, ece: st(document.querySelector('#learn-ece')).fontSize};
}"""


def test_presenter_mode_fills_a_projector_in_large_type(browser, server):  # noqa: F811
    pg = open_learn(browser, server, 1280, 720)
    try:
        pg.click("#learn-presenter")
        pg.wait_for_function("document.querySelector('.nl').dataset.presenter === 'on'")
        pg.wait_for_timeout(300)  # the diagram redraws at its new size
        s = pg.evaluate(STYLES)
        assert len(s["texts"]) > 30  # both diagrams
        for size, fill in s["texts"]:
            assert float(size[:-2]) >= 20 and contrast(fill, s["plotBg"]) >= 4.5, (size, fill, s["plotBg"])
        for size, fill, bar in s["onBar"]:
            assert float(size[:-2]) >= 20 and contrast(fill, bar) >= 4.5, (size, fill, bar)
        assert float(s["ece"][:-2]) >= 28
        for size, color in s["labels"]:
            assert float(size[:-2]) >= 20 and contrast(color, s["bg"]) >= 4.5, (size, color)
        # The two diagrams side by side fill the screen beside the controls.
        plot, controls = pg.locator(".nl-figs").bounding_box(), pg.locator(".nl-controls").bounding_box()
        assert plot["width"] >= 0.6 * 1280 and controls["x"] + controls["width"] <= plot["x"]
        assert plot["y"] >= 0 and plot["y"] + plot["height"] <= 720 and plot["x"] + plot["width"] <= 1280
        binned, smooth = (pg.locator(f"{sel} svg").bounding_box() for sel in ("#learn-plot", "#learn-smooth"))
        assert binned["x"] + binned["width"] <= smooth["x"] and abs(binned["y"] - smooth["y"]) < 1
        svg = pg.locator("#learn-plot svg").bounding_box()
        assert svg["height"] >= 0.85 * 720
        for read_out in ("#learn-ece", "#learn-smooth-ece", "#learn-accuracy", "#learn-confidence"):
            box = pg.locator(read_out).bounding_box()  # every read-out on the screen, none scrolled away
            assert box["y"] >= 0 and box["y"] + box["height"] <= 720, read_out
        save_small(pg.screenshot(), "learn-presenter-1280x720.png")
        # Escape leaves presenter mode.
        pg.keyboard.press("Escape")
        assert pg.locator(".nl").get_attribute("data-presenter") == "off"
    finally:
        pg.context.close()


def test_projector_without_presenter_mode_shows_diagram_and_controls(browser, server):  # noqa: F811
    pg = open_learn(browser, server, 1280, 720)
    try:
        plot, controls = pg.locator(".nl-figs").bounding_box(), pg.locator(".nl-controls").bounding_box()
        assert plot["y"] + plot["height"] <= 720 and pg.evaluate("window.scrollY") == 0
        assert controls["x"] + controls["width"] <= plot["x"]
        s = pg.evaluate(STYLES)
        for size, fill in s["texts"]:
            assert float(size[:-2]) >= 14 and contrast(fill, s["plotBg"]) >= 4.5
        for size, color in s["labels"]:
            assert contrast(color, s["bg"]) >= 4.5
    finally:
        pg.context.close()


def test_dark_theme_darkens_the_plot(browser, server):  # noqa: F811
    pg = open_learn(browser, server, 1400, 1000, theme="dark")
    try:
        assert pg.evaluate("document.body.classList.contains('dark')")
        s = pg.evaluate(STYLES)
        assert _luminance(_rgb(s["plotBg"])) < 0.05 and _luminance(_rgb(s["bg"])) < 0.05
        for _, fill in s["texts"]:
            assert contrast(fill, s["plotBg"]) >= 4.5
        for _, fill, bar in s["onBar"]:
            assert contrast(fill, bar) >= 4.5
        bar = pg.evaluate("getComputedStyle(document.querySelector('#learn-plot .nd-acc')).fill")
        assert contrast(bar, s["plotBg"]) >= 3  # the bars stand out from the dark background
        pg.screenshot(path=str(ARTIFACTS / "learn-dark-1400x1000.png"), full_page=True)
    finally:
        pg.context.close()


def _overlaps(a, b) -> bool:
    return (a["x"] < b["x"] + b["width"] - 0.5 and b["x"] < a["x"] + a["width"] - 0.5
            and a["y"] < b["y"] + b["height"] - 0.5 and b["y"] < a["y"] + a["height"] - 0.5)


def test_phone_layout_has_nothing_overlapping(browser, server):  # noqa: F811
    pg = open_app(browser, server, 390, 844, phone=True)
    try:
        pg.get_by_role("tab", name="Learn").click()
        pg.wait_for_selector("#learn-plot svg")
        boxes = pg.evaluate("""() => {
            const box = (e) => { const r = e.getBoundingClientRect(); return {x: r.x, y: r.y, width: r.width, height: r.height}; };
            const controls = [...document.querySelectorAll('.nl-controls > *')].map(box);
            const texts = (sel) => [...document.querySelectorAll(sel + ' svg text')].map(box);
            return {controls, texts: [texts('#learn-plot'), texts('#learn-smooth')],
                    plots: ['#learn-plot', '#learn-smooth'].map(s => box(document.querySelector(s))),
                    width: document.documentElement.clientWidth};
        }""")
        parts = boxes["controls"] + boxes["plots"]
        for i, a in enumerate(parts):
            assert a["x"] >= 0 and a["x"] + a["width"] <= boxes["width"] + 0.5, a
            for b in parts[i + 1:]:
                assert not _overlaps(a, b), (a, b)
        for plot, texts in zip(boxes["plots"], boxes["texts"], strict=True):
            assert len(texts) > 10
            for i, a in enumerate(texts):
                assert a["x"] >= plot["x"] - 0.5 and a["x"] + a["width"] <= plot["x"] + plot["width"] + 0.5
                for b in texts[i + 1:]:
                    assert not _overlaps(a, b), (a, b)
        # The table of the settled T scrolls sideways rather than break a number over two lines.
        pg.wait_for_function("document.querySelectorAll('#learn-table td').length > 0")
        wrapped = pg.evaluate("""() => [...document.querySelectorAll('#learn-table td, #learn-table th')].filter(c => {
            const r = document.createRange(); r.selectNodeContents(c);
            return new Set([...r.getClientRects()].filter(b => b.width > 0).map(b => Math.round(b.top))).size > 1;
        }).map(c => c.innerText)""")
        assert wrapped == []
        save_small(pg.locator("#learn-view").screenshot(), "learn-phone-390x844.png")
    finally:
        pg.context.close()


@DESKTOP
def test_wide_screen_labels_stay_apart(page):
    set_range(page, "#learn-bins", learn.APP_BINS)
    set_range(page, "#learn-t", 1.0)
    for plot in ("#learn-plot", "#learn-smooth"):
        texts = page.evaluate("""sel => [...document.querySelectorAll(sel + ' svg text')].map(e => {
            const r = e.getBoundingClientRect(); return {x: r.x, y: r.y, width: r.width, height: r.height}; })""", plot)
        assert len(texts) > 10
        for i, a in enumerate(texts):
            for b in texts[i + 1:]:
                assert not _overlaps(a, b), (a, b)
    page.evaluate("document.activeElement.blur()")
    save_small(page.locator("#learn-view").screenshot(), "learn-1400x1000.png")


def _column(table_text: str, row: str, header: str) -> float:
    lines = [ln.split("\t") for ln in table_text.splitlines() if "\t" in ln]
    head = next(cells for cells in lines if header in [c.strip() for c in cells])
    cells = next(cells for cells in lines if cells[0].strip().startswith(row))
    # A cell may carry its interval after the value: "8.80 [6.15, 11.33]".
    return float(cells[[c.strip() for c in head].index(header)].split()[0])


@pytest.mark.parametrize("learn_seen_first", [False, True], ids=["learn-unseen", "learn-seen"])
def test_a_calibration_run_becomes_the_pages_data(browser, server, learn_seen_first):  # noqa: F811
    """After a run in the Calibrate tab, the page holds that run's test logits: at T = 1 its read-outs
    equal the run's own uncalibrated row (computed by the server). The Learn tab may have been shown
    before the run (the page receives the logits) or not (the page starts with them)."""
    pg = open_app(browser, server, 1400, 1000)
    try:
        if learn_seen_first:
            pg.get_by_role("tab", name="Learn").click()
            pg.wait_for_selector("#learn-plot svg")
            pg.get_by_role("tab", name="Calibrate").click()
        open_panel(pg)
        pg.locator("#calibration-size input").fill("300")
        pg.locator("#test-size input").fill("500")
        pg.locator("#test-size input").press("Tab")
        pg.get_by_role("button", name="Run calibration").click()
        wait_for_status(pg, "Done", 240_000)
        table = pg.locator("#results-table").inner_text()
        pg.get_by_role("tab", name="Learn").click()
        pg.wait_for_function("document.querySelector('#learn-note').innerText.includes('its 500 test pictures')")
        assert "test split of your run" in pg.locator("#learn-note").inner_text()
        got = readouts(pg)
        assert f"{100 * got['ece'][0]:.2f}" == f"{_column(table, 'Uncalibrated', 'ECE (%) ↓'):.2f}"
        assert f"{100 * got['accuracy'][0]:.2f}" == f"{_column(table, 'Uncalibrated', 'Accuracy (%) ↑'):.2f}"
        # The page's explanations follow the new calibration too.
        pg.wait_for_function("document.querySelector('#learn-text').innerText.includes('your run')")
    finally:
        pg.context.close()
