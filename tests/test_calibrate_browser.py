"""The Calibrate tab, and the γ sweep and Initialisation tabs beside it, as a person sees them at a
desktop (1400 × 1000), a projector (1280 × 720) and a phone (390 × 844), in headless Chromium on the
launched app: Run where one looks, reliability diagrams drawn in the page (a row, or a stack on a phone)
whose read-outs are the library's, whose whiskers are the bins' Wilson intervals and whose colours
follow the theme, a clicked bar that shows its pictures, δ made visible (amplified and blended in the
page), tables that stay readable and mark no "best" entropy, every download in view, one error message
that the next run clears, and the live plot counting passes. Positions, sizes, colours and numbers are
read off the page; screenshots go to test-artifacts/.

One page per size is shared by the tests of that size, in this file's order (the last one runs a
calibration, which replaces the shipped result on that page)."""
import json
import re
from urllib.parse import urljoin

import numpy as np
import pytest
import torch
from safetensors.torch import load, load_file
from test_browser import ARTIFACTS, CHROMIUM, boxes_overlap, browser, open_panel, wait_for_status  # noqa: F401
from test_learn_browser import _luminance as luminance
from test_learn_browser import _rgb as rgb
from test_learn_browser import contrast
from test_open_bin_browser import sure
from test_try_browser import TEXT_BOXES, assert_delta_painted, by_size, delta_sent, page_per_size, text_overlaps

from nctv import metrics
from nctv.data import FASHION_MNIST_CLASSES, assets_dir
from nctv.intervals import wilson_interval
from nctv.ui.calibrate import FITTER_CHOICES
from nctv.ui.shipped import precomputed_dir
from nctv.ui.try_image import percent
from conftest import PAGE_WAIT_MS

pytestmark = pytest.mark.browser
SIZES = [(1400, 1000, False), (1280, 720, False), (390, 844, True)]

#: The text of every table cell whose lines (the distinct tops of its text's boxes) number more than one.
WRAPPED_CELLS = """sel => [...document.querySelectorAll(sel + ' td, ' + sel + ' th')].filter(cell => {
    const range = document.createRange(); range.selectNodeContents(cell);
    const tops = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
    return tops.size > 1; }).map(cell => cell.innerText)"""


#: Every number (digits with their separators and superscripts) whose characters stand on more than one
#: line, with the text it is in: a number broken mid-line.
NUMBER_BREAKS = r"""root => {
    const out = [], walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    const number = /[−-]?\d(?:[\d.,⁰¹²³⁴⁵⁶⁷⁸⁹⁻]*[\d⁰¹²³⁴⁵⁶⁷⁸⁹])?/g;
    let node;
    while ((node = walker.nextNode())) {
        if (!node.parentElement.checkVisibility()) continue;
        for (const m of node.textContent.matchAll(number)) {
            const range = document.createRange();
            range.setStart(node, m.index); range.setEnd(node, m.index + m[0].length);
            const tops = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
            if (tops.size > 1) out.push(`${m[0]} in "${node.textContent.trim().slice(0, 60)}"`);
        }
    }
    return out;
}"""


def open_at(browser, url: str, width: int, height: int, phone: bool, theme: str = ""):
    context = browser.new_context(viewport={"width": width, "height": height}, is_mobile=phone, has_touch=phone)
    pg = context.new_page()
    pg.set_default_timeout(PAGE_WAIT_MS)
    pg.goto(url + (f"?__theme={theme}" if theme else ""))
    pg.locator("#calibrate-diagrams .nc-smooth svg").first.wait_for()
    return pg


# The page at one size (width, height, phone), shared by the tests of that size in their order in this file.
page = page_per_size("page", open_at)
EVERY_SIZE, DESKTOP = by_size("page", SIZES), by_size("page", SIZES[:1])


def calibrate_tab(page) -> tuple[int, int, bool]:
    """Back on the Calibrate tab, no group open, scrolled to the top; the page's (width, height, phone)."""
    page.get_by_role("tab", name="Calibrate").click()
    if page.locator("#calibrate-bin").is_visible():
        page.keyboard.press("Escape")
    page.evaluate("window.scrollTo(0, 0)")
    page.locator("#calibrate-diagrams .nc-smooth svg").first.wait_for()
    width, height = page.viewport_size["width"], page.viewport_size["height"]
    return width, height, width < 500


def assert_apart(boxes: list[dict], what: str) -> None:
    for i, a in enumerate(boxes):
        assert not any(boxes_overlap(a, b) for b in boxes[i + 1:]), f"{what} overlap"


@pytest.fixture(scope="module")
def shipped():
    """Per method of the shipped result: its test logits, read from the file itself (not through the app)."""
    tensors = load_file(str(precomputed_dir() / "test_logits.safetensors"))
    labels = tensors.pop("labels")
    return {name: z.double() for name, z in tensors.items()}, labels


#: Per card: the title's box, the boxes of its two diagrams and of every text in them, its read-outs.
CARDS = """() => [...document.querySelectorAll('#calibrate-diagrams .nc-card')].map(card => {
    const box = (e) => { const r = e.getBoundingClientRect(); return {x: r.x, y: r.y, width: r.width, height: r.height}; };
    return {method: card.dataset.method, title: box(card.querySelector('h3')), titleText: card.querySelector('h3').innerText,
            binned: box(card.querySelector('.nc-binned svg')), smooth: box(card.querySelector('.nc-smooth svg')),
            texts: [...card.querySelectorAll('svg')].map(svg => [...svg.querySelectorAll('text')].map(box)),
            reads: Object.fromEntries([...card.querySelectorAll('dd')].map(d => [d.dataset.metric, [Number(d.dataset.value), d.innerText]]))};
})"""


@EVERY_SIZE
def test_first_screen_reads_at_every_size(page, shipped):
    width, height, phone = calibrate_tab(page)
    # Run, Stop and the status line within the first screen, above the method boxes.
    run = page.get_by_role("button", name="Run calibration").bounding_box()
    status = page.locator("#calibrate-status").bounding_box()
    print(f"\n{width} × {height}: Run at y = {run['y']:.0f} px")
    assert run["y"] + run["height"] <= height and status["y"] < height
    assert run["y"] < page.get_by_text("Methods", exact=True).bounding_box()["y"]
    # One card per method: a row on a wide screen, one above the other on a phone; titles on their
    # own panels, nothing overlapping, every text inside its diagram.
    cards = page.evaluate(CARDS)
    logits, labels = shipped
    assert [c["method"] for c in cards] == [c["titleText"] for c in cards]
    assert sorted(c["method"] for c in cards) == sorted(logits)
    tops = [c["title"]["y"] for c in cards]
    if phone:
        assert tops == sorted(tops) and len({round(c["title"]["x"]) for c in cards}) == 1
    else:
        assert max(tops) - min(tops) < 1 and [c["title"]["x"] for c in cards] == sorted(c["title"]["x"] for c in cards)
    boxes = [b for c in cards for b in (c["title"], c["binned"], c["smooth"])]
    assert_apart(boxes, f"titles and diagrams at {width} px")
    for c in cards:
        assert c["title"]["y"] + c["title"]["height"] <= c["binned"]["y"] <= c["smooth"]["y"]
        assert c["binned"]["width"] >= (300 if phone else 120)
        for svg, texts in zip((c["binned"], c["smooth"]), c["texts"], strict=True):
            assert len(texts) >= 10
            assert_apart(texts, f"texts of {c['method']} at {width} px")
            for t in texts:
                assert svg["x"] - 0.5 <= t["x"] and t["x"] + t["width"] <= svg["x"] + svg["width"] + 0.5
        # The read-outs are the library's, computed here from the shipped logits file.
        z = logits[c["method"]]
        for metric, want in (("ece", metrics.ece(z, labels, 15)), ("smooth_ece", metrics.smooth_ece(z, labels)),
                             ("accuracy", metrics.accuracy(z, labels))):
            got, text = c["reads"][metric]
            assert got == pytest.approx(want, abs=1e-9) and text == f"{100 * want:.2f}%", (c["method"], metric)
    # On a wide screen the row fits: no sideways scrolling of the diagrams.
    assert page.evaluate("(e => e.scrollWidth <= e.clientWidth)(document.querySelector('#calibrate-diagrams'))")
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
    page.locator("#calibrate-view").screenshot(path=str(ARTIFACTS / f"calibrate-{width}-diagrams.png"))


#: {text: its number of lines} of every radio button's choice in ``root`` (the distinct tops of its text's boxes).
CHOICE_LINES = """root => Object.fromEntries([...root.querySelectorAll('label:has(input[type=radio])')].map(label => {
    const tops = new Set(), walker = document.createTreeWalker(label, NodeFilter.SHOW_TEXT);
    let node;
    while ((node = walker.nextNode())) {
        const range = document.createRange(); range.selectNodeContents(node);
        for (const r of range.getClientRects()) if (r.width > 0) tops.add(Math.round(r.top));
    }
    return [label.innerText.trim(), tops.size];
}))"""


#: The study tabs: name, Run button, status line, figure.
STUDY_TABS = (("γ sweep", "Run γ sweep", "#gamma-status", "#gamma-plot"),
              ("Initialisation", "Run initialisation study", "#init-status", "#init-plot"))


@EVERY_SIZE
def test_study_tabs_read_at_every_size(page):
    """The γ sweep and Initialisation tabs on their shipped studies: Run and the status line on the first
    screen, above the settings; every choice of a setting on one line; no two pieces of text drawn over each
    other, no number broken over two lines (in text or table), nothing wider than the screen; the figure, once scrolled to, fits the screen's
    height and, where it is wider than a phone, scrolls sideways in its own box."""
    width, height, phone = calibrate_tab(page)
    for tab, button, status, plot in STUDY_TABS:
        page.get_by_role("tab", name=tab).click()
        page.locator(f"{plot} .js-plotly-plot .main-svg").first.wait_for()
        page.evaluate("window.scrollTo(0, 0)")
        panel = f"[role=tabpanel]:has({plot})"
        run = page.get_by_role("button", name=button).bounding_box()
        print(f"\n{width} × {height}: {button} at y = {run['y']:.0f} px")
        assert run["y"] + run["height"] <= height and page.locator(status).bounding_box()["y"] < height
        assert run["y"] < page.locator(panel).get_by_text("Fitter", exact=True).bounding_box()["y"]
        # Every choice (the Fitter's, and the δ initialisation's where the tab has it) on one line: beside
        # another setting on a phone, the Fitter's choices once wrapped word by word.
        choices = page.locator(panel).evaluate(CHOICE_LINES)
        assert {name for name, _ in FITTER_CHOICES} <= set(choices), choices
        assert all(n == 1 for n in choices.values()), f"choices of {tab} wrap at {width} px: {choices}"
        assert page.evaluate("document.documentElement.scrollWidth") <= width, f"{tab} is wider than the screen"
        boxes = page.locator(panel).evaluate(TEXT_BOXES)
        assert len(boxes) > 60
        assert text_overlaps(boxes) == [], f"texts of {tab} drawn over each other at {width} px"
        assert page.locator(panel).evaluate(NUMBER_BREAKS) == [], f"numbers of {tab} broken at {width} px"
        assert page.locator(f"{panel} .result-table td").count() >= 4
        assert page.evaluate(WRAPPED_CELLS, f"{panel} .result-table") == []
        # Scrolled down to, the figure is on the screen whole, below the Run bar (which stays in view on a
        # wide screen).
        figure = page.locator(plot)
        figure.evaluate("e => e.scrollIntoView({block: 'end'})")
        box, svg = figure.bounding_box(), page.locator(f"{plot} .js-plotly-plot .main-svg").first.bounding_box()
        assert 0 <= box["y"] and box["y"] + box["height"] <= height + 0.5 and svg["height"] >= 300
        assert box["x"] >= 0 and box["x"] + box["width"] <= width + 0.5
        assert not boxes_overlap(page.locator(f"{panel} .run-bar").bounding_box(), box)
        scrolls = figure.evaluate("e => e.scrollWidth > e.clientWidth")
        assert scrolls == (svg["width"] > box["width"] + 1) and (phone or not scrolls)
        page.screenshot(path=str(ARTIFACTS / f"{tab[:4].strip()}-{width}.png"), full_page=True)


#: Per binned diagram: its frame (the first .nd-frame: the [0, 1] square) and every whisker line.
WHISKERS = """() => [...document.querySelectorAll('#calibrate-diagrams .nc-binned svg')].map(svg => {
    const frame = svg.querySelector('.nd-frame');
    return {method: svg.closest('.nc-card').dataset.method, top: Number(frame.getAttribute('y')), height: Number(frame.getAttribute('height')),
            lines: [...svg.querySelectorAll('line.nd-whisker')].map(l => ['x1', 'y1', 'x2', 'y2'].map(a => Number(l.getAttribute(a))))};
})"""


@DESKTOP
def test_whiskers_are_the_wilson_intervals_of_the_bins(page, shipped):
    """Each non-empty bin carries a whisker from the low to the high end of the 95 % Wilson interval of
    its accuracy, computed here from the shipped logits (read back in the diagram's own units)."""
    calibrate_tab(page)
    logits, labels = shipped
    drawn = {d["method"]: d for d in page.evaluate(WHISKERS)}
    assert sorted(drawn) == sorted(logits)
    for name, z in logits.items():
        d = drawn[name]
        bins = metrics.reliability_bins(z, labels, 15)
        low, high = wilson_interval(np.round(bins.accuracy * bins.counts), bins.counts)
        filled = np.flatnonzero(bins.counts > 0)
        stems = [ln for ln in d["lines"] if ln[0] == ln[2]]  # vertical: the whiskers' stems
        assert len(stems) == len(filled) and len(d["lines"]) == 3 * len(filled), name
        share = lambda py: 1 - (py - d["top"]) / d["height"]  # noqa: E731
        for (_, y1, _, y2), k in zip(sorted(stems), filled, strict=True):
            # Coordinates are written to 0.1 px (the frame too).
            assert share(y1) == pytest.approx(low[k], abs=0.15 / d["height"]), (name, k)
            assert share(y2) == pytest.approx(high[k], abs=0.15 / d["height"]), (name, k)
    # Each smoothed diagram carries its band from the server's resamples.
    labels = page.locator("#calibrate-diagrams .nc-smooth svg").evaluate_all(
        "svgs => svgs.map(s => [s.getAttribute('aria-label'), s.querySelectorAll('path.nd-band').length])")
    assert len(labels) == len(logits)
    assert all("95% band of 200 resamples" in label and bands == 1 for label, bands in labels)


STYLE = """() => {
    const st = (e) => getComputedStyle(e);
    const bg = st(document.querySelector('.nc')).backgroundColor;
    const plotBg = st(document.querySelector('#calibrate-diagrams .nd-plot')).backgroundColor;
    const texts = [...document.querySelectorAll('#calibrate-diagrams svg text:not(.nd-on-bar), #calibrate-diagrams h3, #calibrate-diagrams dd, #calibrate-diagrams dt, .nc-lead, .nc-legend span')]
        .map(e => e.tagName.toLowerCase() === 'text' ? st(e).fill : st(e).color);
    const bars = st(document.querySelector('#calibrate-diagrams .nd-acc')).fill;
    const curve = st(document.querySelector('#calibrate-diagrams .nd-curve')).stroke;
    return {bg, plotBg, texts, bars, curve};
}"""


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_diagrams_follow_the_theme(browser, server, theme):  # noqa: F811
    page = open_at(browser, server, 1280, 720, False, theme)
    try:
        assert page.evaluate("document.body.classList.contains('dark')") == (theme == "dark")
        s = page.evaluate(STYLE)
        lum = luminance(rgb(s["plotBg"]))
        assert (lum < 0.05) if theme == "dark" else (lum > 0.9)
        assert luminance(rgb(s["bg"])) == pytest.approx(lum, abs=0.02)
        assert len(s["texts"]) > 100
        for fill in s["texts"]:
            assert contrast(fill, s["plotBg"]) >= 4.5, (fill, s["plotBg"])
        assert contrast(s["bars"], s["plotBg"]) >= 3 and contrast(s["curve"], s["plotBg"]) >= 3
        page.locator("#calibrate-view").screenshot(path=str(ARTIFACTS / f"calibrate-{theme}-1280.png"))
    finally:
        page.context.close()


def group_items(page) -> list[dict]:
    return page.evaluate("""() => [...document.querySelectorAll('#calibrate-bin-list li')].map(li => ({
        row: Number(li.dataset.row), wrong: li.classList.contains('nd-pic--wrong'),
        text: [...li.querySelectorAll('dt, dd')].map(e => e.textContent)}))""")


@EVERY_SIZE
def test_a_clicked_bar_shows_the_pictures_of_its_group(page, shipped):
    """Group 12 of 15 of temperature scaling (confidence 80–86.7 %): the panel says how many pictures
    (numpy's count on the shipped logits) and lists them with a confidence after calibration inside
    the group's range and the uncalibrated one beside it."""
    logits, labels = shipped
    z, z0 = logits["Temperature Scaling"], logits["Uncalibrated"]
    conf = torch.softmax(z, 1).max(1).values.numpy()
    conf0 = torch.softmax(z0, 1).max(1).values.numpy()
    members = np.flatnonzero((conf > 12 / 15) & (conf <= 13 / 15))
    width, _, phone = calibrate_tab(page)
    bar = page.locator('.nc-card[data-method="Temperature Scaling"] .nd-hit[data-bin="12"]')
    bar.scroll_into_view_if_needed()
    bar.tap() if phone else bar.click()
    page.wait_for_function("document.querySelectorAll('#calibrate-bin-list li').length > 0")
    assert int(page.locator("#calibrate-bin").get_attribute("data-count")) == len(members)
    assert page.locator("#calibrate-bin-title").inner_text().startswith(
        f"Temperature Scaling, confidence 80–86.7%: {len(members):,} pictures")
    items = group_items(page)
    assert len(items) == min(24, len(members))
    assert [i["wrong"] for i in items] == sorted((i["wrong"] for i in items), reverse=True)
    for item in items:
        assert item["row"] in set(members.tolist())
        words = dict(zip(item["text"][1::2], item["text"][2::2]))
        after = float(words["Temperature Scaling"].rstrip("%"))
        assert 80 - 0.005 <= after <= 100 * 13 / 15 + 0.005
        assert after == pytest.approx(100 * conf[item["row"]], abs=0.006)
        assert words["Uncalibrated"] == sure(conf0[item["row"]]) and conf0[item["row"]] > conf[item["row"]]
        assert words["True"] == FASHION_MNIST_CLASSES[int(labels[item["row"]])]
    if phone:
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.locator("#calibrate-bin").screenshot(path=str(ARTIFACTS / f"calibrate-open-bin-{width}.png"))
    # Escape closes the group; another method's bar opens its own.
    page.keyboard.press("Escape")
    assert page.locator("#calibrate-bin").is_hidden()
    other = page.locator('.nc-card[data-method="Neural Clamping (FL)"] .nd-hit[data-bin="14"]')
    other.focus()
    other.press("Enter")
    page.wait_for_function("document.querySelector('#calibrate-bin-note').innerText.startsWith('Wrong')")
    assert page.locator("#calibrate-bin").get_attribute("data-method") == "Neural Clamping (FL)"


def shipped_delta() -> np.ndarray:
    """The shipped δ in 0–255 levels (255 · std · δ, std of the shipped run's settings), read from its files."""
    delta = load_file(str(precomputed_dir() / "delta.safetensors"))["Neural Clamping (FL)"].double().numpy()
    std = json.loads((precomputed_dir() / "results.json").read_text())["settings"]["std"]
    return 255 * np.asarray(std, dtype=np.float64).reshape(-1, 1, 1) * delta


@EVERY_SIZE
def test_delta_is_made_visible_in_the_page(page, shipped):
    """The Learned-parameters panel shows the shipped δ on the first test picture, amplified (×1, ×10, ×50)
    and blended in the page: the arrays the page got are the shipped δ and that picture (read from their
    files here), its canvases hold what they say, the channel is named in words, one sentence beside it
    says how large δ is, and one what it does to the picture's answer (from the shipped logits)."""
    width, _, phone = calibrate_tab(page)
    # Once the Try tab has drawn its own δ, the two views' buttons stay apart (one name per view).
    page.get_by_role("tab", name="Try your own image").click()
    page.locator("#try-delta canvas").first.wait_for()
    calibrate_tab(page)
    root = "#calibrate-delta"
    page.locator(root).scroll_into_view_if_needed()
    own = shipped_delta()
    x, d, h, w = delta_sent(page, root)
    np.testing.assert_allclose(d, own.ravel(), atol=1e-4)
    first = np.load(assets_dir() / "data" / "fashion-mnist" / "test.npz")["images"][0]
    np.testing.assert_allclose(x, first.ravel(), atol=1e-3)
    assert (h, w) == first.shape
    assert_delta_painted(page, root, f"calibrate-delta-x50-{width}")
    page.locator(f"{root} .nctv-amplify input[value='10']").check()
    assert page.locator("#try-delta .nctv-amplify input:checked").get_attribute("value") == "1"
    # Words: each picture under its caption, the channel named, δ's size beside it, its effect.
    captions = [c.replace("\xa0", " ") for c in page.locator(f"{root} figcaption").all_inner_texts()]
    assert captions == [f"A test picture as the model gets it ({w} × {h})", "Picture + δ × 10",
                        "Brightness change δ × 10"]
    assert page.locator(f"{root} .nctv-delta-reading").inner_text() == \
        "Brightness change: mid-grey = no change; lighter = brighter, darker = dimmer."
    largest = np.abs(own).max()
    assert page.locator(f"{root} .nctv-delta-scale").inner_text() == \
        f"At ×10 the largest change is {10 * largest:.1f} of 255 levels."
    params = page.locator("#calibrate-params").inner_text()
    assert (f"its largest change is {largest:.1f} of 255 grey levels, {100 * largest / 255:.1f} % of the "
            "image's range") in params
    logits, _ = shipped
    t = json.loads((precomputed_dir() / "results.json").read_text())["methods"]["Neural Clamping (FL)"]["params"]
    without, with_delta = (torch.softmax(z[0], 0).numpy()
                           for z in (logits["Uncalibrated"] / t["temperature"], logits["Neural Clamping (FL)"]))
    top = int(with_delta.argmax())
    assert page.locator(f"{root} .nctv-delta-effect").inner_text() == (
        f"On this picture, δ moves the confidence in {FASHION_MNIST_CLASSES[top]} from {percent(without[top])} "
        f"(Neural Clamping's temperature alone) to {percent(with_delta[top])}.")
    # Laid out: inside the screen's width, each picture under its own caption, the pictures of a row in
    # line (three in a row, or two and one on a phone), nothing drawn over anything else, no number broken.
    view = page.locator(root).bounding_box()
    assert view["x"] >= 0 and view["x"] + view["width"] <= width + 0.5
    pictures = [c.bounding_box() for c in page.locator(f"{root} canvas").all()]
    for caption, picture in zip(page.locator(f"{root} figcaption").all(), pictures, strict=True):
        c = caption.bounding_box()
        assert c["y"] + c["height"] <= picture["y"] + 0.5 and abs(c["x"] - picture["x"]) < 1
        assert picture["width"] >= 120 and picture["x"] + picture["width"] <= view["x"] + view["width"] + 0.5
    tops = sorted(round(b["y"], 1) for b in pictures)
    assert len(set(tops)) == (2 if phone else 1) and (not phone or tops[0] == tops[1])
    assert_apart(pictures, f"δ pictures at {width} px")
    assert text_overlaps(page.locator(root).evaluate(TEXT_BOXES)) == []
    assert page.locator(root).evaluate(NUMBER_BREAKS) == []
    page.locator(root).screenshot(path=str(ARTIFACTS / f"calibrate-delta-{width}.png"))


#: A table's headers, and per row each cell's text and marks (bold, italics), read off the page.
TABLE_MARKS = """sel => { const t = document.querySelector(sel + ' table');
    return {head: [...t.querySelectorAll('thead th')].map(c => c.innerText.trim()),
            rows: [...t.querySelectorAll('tbody tr')].map(r => [...r.querySelectorAll('td')].map(c => ({
                text: c.innerText.trim(), bold: c.querySelector('strong, b') !== null,
                italic: c.querySelector('em, i') !== null})))}; }"""


@DESKTOP
def test_entropy_has_no_best_and_italics_need_three_rows(page):
    """Read off the rendered tables: entropy's header has no direction (↑/↓) and none of its cells is
    marked; in the Calibrate table (five rows) italics mark a second only in columns with a direction, and
    the note says so; the Initialisation table (two rows) has no italics, and its note speaks of none."""
    calibrate_tab(page)
    for sel, n_rows in (("#results-table", 5), ("[role=tabpanel]:has(#init-plot) .result-table", 2)):
        if "init-plot" in sel:
            page.get_by_role("tab", name="Initialisation").click()
            page.locator("#init-plot .js-plotly-plot").wait_for()
        table = page.evaluate(TABLE_MARKS, sel)
        head, rows = table["head"], table["rows"]
        assert len(rows) == n_rows
        entropy = head.index("Entropy")  # the word alone: no ↑ or ↓
        directed = [i for i, h in enumerate(head) if h.endswith(("↑", "↓"))]
        assert directed and set(directed) | {0, entropy} == set(range(len(head))), head
        assert not any(r[entropy]["bold"] or r[entropy]["italic"] for r in rows), sel
        assert all(any(r[i]["bold"] for r in rows) for i in directed), sel  # every directed column has a best
        italic = {i for r in rows for i, c in enumerate(r) if c["italic"]}
        note = page.locator(sel).first.inner_text()
        if n_rows >= 3:
            assert italic and italic <= set(directed) and "second best in italics" in note
        else:
            assert not italic and "second" not in note and "italics" not in note
    page.get_by_role("tab", name="Calibrate").click()


def errors_shown(page, words: str) -> int:
    """How many visible elements of the page carry ``words`` (the innermost ones)."""
    return page.evaluate("""words => [...document.querySelectorAll('body *')].filter(e =>
        e.offsetParent !== null && e.innerText && e.innerText.includes(words)
        && ![...e.children].some(c => c.innerText && c.innerText.includes(words))).length""", words)


@EVERY_SIZE
def test_one_error_beside_run_then_cleared_and_the_live_plot_counts_passes(page):
    """The last test of each size: its run replaces the shipped result on that page."""
    width, height, phone = calibrate_tab(page)
    open_panel(page)
    words = "Calibration size must be at least 10"
    for attempt in range(2):  # a second failure replaces the first: no pile of old errors
        page.locator("#calibration-size input").fill("3")
        # The button at the screen's bottom edge, the status line below it out of sight (as on a phone
        # after scrolling through the settings): the click brings the status line into view.
        page.get_by_role("button", name="Run calibration").evaluate("b => b.scrollIntoView({block: 'end'})")
        page.get_by_role("button", name="Run calibration").click()
        wait_for_status(page, words, PAGE_WAIT_MS)
        page.wait_for_timeout(1000)  # time for a toast or an error mark to appear, were there one
        assert errors_shown(page, words) == 1
        assert page.locator(".toast-body:visible").count() == 0  # no toast, so no "Error (2)" pile
        # Gradio's own "Error" mark over the status text, were it shown.
        assert page.locator("[data-testid=status-tracker] .error:visible").count() == 0
    status = page.locator("#calibrate-status").bounding_box()
    run = page.get_by_role("button", name="Run calibration").bounding_box()
    assert 0 <= status["y"] - (run["y"] + run["height"]) < 60  # right under the button pressed
    assert 0 <= status["y"] and status["y"] + 24 <= height  # its first line on the screen
    page.screenshot(path=str(ARTIFACTS / f"calibrate-error-{width}.png"))
    page.locator("#calibration-size input").fill("300")
    page.locator("#test-size input").fill("1000")
    page.get_by_role("button", name="Run calibration").click()
    wait_for_status(page, " left", PAGE_WAIT_MS)  # "… left" from the first step on
    page.screenshot(path=str(ARTIFACTS / f"calibrate-running-{width}.png"))
    wait_for_status(page, "Done", PAGE_WAIT_MS)
    assert errors_shown(page, words) == 0 and "Error" not in page.locator("#calibrate-status").inner_text()
    # The live plot's x values are passes: its last point is the fit's pass count, as the parameters say.
    xs = page.evaluate("document.querySelector('#live-plot .js-plotly-plot').data[0].x")
    passes = float(re.search(r"Neural Clamping \(FL\):.*?([\d.]+) passes over the calibration split",
                             page.locator("#calibrate-params").inner_text()).group(1))
    assert xs == sorted(xs) and xs[-1] == pytest.approx(passes, abs=0.05)
    assert len(xs) > 3 and xs != list(range(len(xs)))  # passes, not a count of points
    live = page.locator("#live-plot").bounding_box()
    assert live["x"] >= 0 and live["x"] + live["width"] <= width + 0.5
    page.screenshot(path=str(ARTIFACTS / f"calibrate-after-run-{width}.png"), full_page=True)
    # The δ shown is the run's, as its delta.safetensors download holds it, and the page paints it.
    link = page.locator("#calibrate-files tr:has(td[aria-label='delta.safetensors']) a").first
    saved = load(page.request.get(urljoin(page.url, link.get_attribute("href"))).body())["delta"]
    std = json.loads((precomputed_dir() / "results.json").read_text())["settings"]["std"]
    ran = 255 * np.asarray(std, dtype=np.float64).reshape(-1, 1, 1) * saved.double().numpy()
    _, d, _, _ = delta_sent(page, "#calibrate-delta")
    np.testing.assert_allclose(d, ran.ravel(), atol=1e-4)
    assert np.abs(ran - shipped_delta()).max() > 0.1  # a δ of its own, not the shipped one
    assert_delta_painted(page, "#calibrate-delta")
    # The run's own diagrams open groups of the run's own 1,000 test pictures.
    bar = page.locator('.nc-card[data-method="Temperature Scaling"] .nd-hit').last
    bar.scroll_into_view_if_needed()
    bar.tap() if phone else bar.click()
    page.wait_for_function("document.querySelector('#calibrate-bin-note').innerText.startsWith('Wrong')")
    count = int(page.locator("#calibrate-bin").get_attribute("data-count"))
    rows = page.locator("#calibrate-bin-list li").evaluate_all("items => items.map(li => Number(li.dataset.row))")
    assert len(rows) == min(24, count) and all(0 <= r < 1000 for r in rows)


#: The conformal table of the results: its heading (the bold line above it) and, per row, its cells' text.
CONFORMAL_TABLE = """() => {
    const head = [...document.querySelectorAll('#results-table strong')].find(s => s.innerText.startsWith('Conformal'));
    if (!head) return null;
    let table = head.closest('p');
    while (table && table.tagName !== 'TABLE') table = table.nextElementSibling;
    return {heading: head.innerText, rows: Object.fromEntries([...table.querySelectorAll('tbody tr')].map(r =>
        [r.cells[0].innerText.trim(), [...r.cells].slice(1).map(c => c.innerText.trim())]))};
}"""


def test_aps_at_95_chosen_in_the_page_makes_the_table_say_aps_with_the_librarys_figures(browser, server,  # noqa: F811
                                                                                      tmp_path):
    """A person opens the prediction sets' panel, picks APS and 95 %, and calibrates a file of logits: the
    table under the results turns from the shipped LAC at 90 % to APS at 95 %, with the coverage and set
    sizes of the library's run of APS at 95 % on that file (not those of LAC at 90 %)."""
    from nctv.conformal import ConformalSettings
    from nctv.experiment import RunOptions
    from nctv.logits_file import read_logits, run_on_logits
    from nctv.settings import APP_BINS
    from test_logits_file import _data, _write

    path = _write(tmp_path / "mine.npz", *_data(n=800), cut=400)
    page = open_at(browser, server, 1400, 1000, False)
    try:
        assert page.evaluate(CONFORMAL_TABLE)["heading"] == "Conformal prediction sets: LAC at 90 % coverage"
        panel = page.locator("#conformal-panel")
        panel.get_by_role("button").first.click()
        page.locator("#conformal-score").get_by_text("APS", exact=True).click()
        box = page.locator("#conformal-coverage input[type=number]")
        box.fill("95")
        box.press("Tab")
        # The panel's title says what is chosen, so that it can stay closed.
        page.wait_for_function("document.querySelector('#conformal-panel').innerText"
                               ".includes('Prediction sets: APS at 95 % coverage')")
        page.locator("#logits-panel").get_by_role("button").first.click()
        page.locator("#logits-file input[type=file]").set_input_files(str(path))
        # The file's name in the upload box (its text: the box may draw the name over two lines).
        page.wait_for_function("document.querySelector('#logits-file').textContent.includes('mine.npz')", polling=250)
        page.locator("#logits-run").click()
        wait_for_status(page, "Done", PAGE_WAIT_MS)
        shown = page.evaluate(CONFORMAL_TABLE)
        page.screenshot(path=str(ARTIFACTS / "calibrate-conformal-aps.png"), full_page=True)
    finally:
        page.context.close()
    assert shown["heading"] == "Conformal prediction sets: APS at 95 % coverage"
    # The rows the page ran: the ticked methods that work on logits (the uncalibrated reference first).
    data, methods = read_logits(path), list(shown["rows"])
    assert methods[0] == "Uncalibrated" and "Temperature Scaling" in methods
    runs = {score: run_on_logits(data, methods, RunOptions(seeds=(0,), bins=(APP_BINS,), progress=False,
                                                           conformal=ConformalSettings(score, coverage)))
            for score, coverage in (("aps", 0.95), ("lac", 0.9))}
    for name in methods:
        cells = [c.split(" [")[0] for c in shown["rows"][name]]  # coverage %, mean set size, worst class %, empty %
        for run, same in ((runs["aps"], True), (runs["lac"], False)):
            c = run.methods[name].conformal
            figures = [f"{100 * c['coverage'][0]:.1f}", f"{c['mean_size'][0]:.2f}"]
            assert (cells[:2] == figures) is same, (name, cells, figures)
