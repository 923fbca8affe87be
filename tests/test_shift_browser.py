"""The Shift tab in headless Chromium, against the launched app, at a phone's (390 × 844), a
projector's (1280 × 720) and a desk's (1400 × 1000) size: every ECE read-out and every verdict read off
the page equals the shipped study's file (assets/precomputed/shift.json, read here as JSON, not through
the app) to the shown rounding; moving the severity or changing the corruption redraws in the page
with no request; the example pictures follow the severity; nothing overlaps and no number breaks
over two lines on a phone; presenter mode fits a projector; the dark theme darkens the figures.
Screenshots go to test-artifacts/."""
import json
import os
import re
import statistics

import pytest
from test_browser import ARTIFACTS, CHROMIUM, boxes_overlap, browser, open_app  # noqa: F401 - browser: a fixture
from test_learn_browser import _luminance, _rgb, contrast, set_range

from nctv.ui.shipped import precomputed_dir

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}")]
SIZES = [(390, 844), (1280, 720), (1400, 1000)]
NC, REFERENCE, OTHER = "Neural Clamping (FL)", "TS by Grid Search", "Temperature Scaling"
#: (corruption, severity) pairs read off the page; severity 0 is the clean test split whatever the corruption.
PAIRS = [("contrast", 3), ("gaussian-noise", 5), ("jpeg", 1), ("defocus-blur", 4), ("brightness", 2), ("pixelate", 0),
         ("contrast", 1)]


@pytest.fixture(scope="module")
def study():
    """The shipped study, straight from its file."""
    return json.loads((precomputed_dir() / "shift.json").read_text(encoding="utf-8"))


def key(corruption: str, severity: int) -> str:
    return "clean" if severity == 0 else f"{corruption}/{severity}"


def shown(f: dict) -> str:
    """A figure as the page writes it: percent with two decimals and the interval in brackets."""
    return f"{100 * f['value']:.2f}% [{100 * f['ci_low']:.2f}, {100 * f['ci_high']:.2f}]"


def signed(v: float) -> str:
    s = f"{abs(100 * v):.2f}"
    return ("−" if v < 0 and float(s) != 0 else "+") + s


def difference(study: dict, condition: str, other: str) -> tuple[float, float, float]:
    """Neural Clamping − ``other`` on ECE under ``condition``, from the file's paired comparisons."""
    for c in study["comparisons"]:
        if c["condition"] == condition and c["metric"] == "ece":
            if (c["method"], c["other"]) == (NC, other):
                return c["difference"], c["low"], c["high"]
            if (c["method"], c["other"]) == (other, NC):
                return -c["difference"], -c["high"], -c["low"]
    raise AssertionError(f"no comparison of {NC} and {other} under {condition}")


def open_shift(browser, url, width, height, theme=""):  # noqa: F811 - the fixture's value
    pg = open_app(browser, url + (f"?__theme={theme}" if theme else ""), width, height, phone=width < 500)
    pg.get_by_role("tab", name="Shift").click()
    pg.wait_for_selector("#shift-diagrams .ns-card svg")
    pg.wait_for_selector("#shift-curve svg")
    return pg


def choose(pg, corruption: str, severity: int) -> None:
    pg.select_option("#shift-corruption", corruption)
    set_range(pg, "#shift-severity", severity)
    assert pg.locator(".ns").get_attribute("data-condition") == key(corruption, severity)


@pytest.fixture(scope="module")
def page(browser, server):  # noqa: F811
    pg = open_shift(browser, server, 1400, 1000)
    yield pg
    pg.context.close()


def check_condition(pg, study: dict, corruption: str, severity: int) -> None:
    """Every method's ECE and accuracy, the verdict against TS by Grid Search, the line against
    Temperature Scaling, and the curves' marks at the current severity, read off the page."""
    k = key(corruption, severity)
    figures = study["figures"]
    cards = pg.evaluate("""() => [...document.querySelectorAll('#shift-diagrams .ns-card')].map(c => [c.dataset.method,
        c.querySelector('dd[data-metric=ece]').textContent, c.querySelector('dd[data-metric=accuracy]').textContent])""")
    assert [c[0] for c in cards] == study["methods"]
    for method, ece, accuracy in cards:
        assert ece == shown(figures[method][k]["ece"]), (method, k)
        assert accuracy == shown(figures[method][k]["accuracy"]), (method, k)
    check_headline(pg, study, k)
    verdict = pg.locator("#shift-verdict").inner_text()
    d, low, high = difference(study, k, REFERENCE)
    place = "On the clean test pictures" if severity == 0 else f"Under {corruption_words(corruption)}, severity {severity}"
    numbers = f"ECE {signed(d)} [{signed(low)}, {signed(high)}] point"
    if low <= 0 <= high:
        assert verdict == f"{place}, {NC} and {REFERENCE} are tied: {numbers}.", verdict
    else:
        word = "better" if d < 0 else "worse"
        assert verdict == f"{place}, {NC} is {word} calibrated than {REFERENCE}: {numbers}.", verdict
    d, low, high = difference(study, k, OTHER)
    word = "tied" if low <= 0 <= high else "better" if d < 0 else "worse"
    assert f"Against {OTHER}: {signed(d)} [{signed(low)}, {signed(high)}] point, {word}." in \
        pg.locator("#shift-also").inner_text()
    # The curves' marks at this severity: the corruption's own, and the mean over corruptions.
    mean = "clean" if severity == 0 else f"average/{severity}"
    for plot, condition, table in (("#shift-curve", k, figures), ("#shift-mean", mean, study["average"])):
        label = pg.locator(f"{plot} svg").get_attribute("aria-label")
        source = figures if condition == "clean" else table
        for method in study["methods"]:
            assert f"{method} {100 * source[method][condition]['ece']['value']:.2f}%" in label, (plot, method)


#: Far from the clean figure: 10 percentage points (docs/method.md, "The Shift tab's headline").
FAR = 0.10


def span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{100 * lo:.1f}" + ("" if f"{lo:.3f}" == f"{hi:.3f}" else f"\u2060–\u2060{100 * hi:.1f}") + "\u00a0%"


def check_headline(pg, study: dict, k: str) -> None:
    """The whole picture first: where every method's ECE is at least FAR above its clean ECE, the first
    line says that every calibration breaks; where instead every accuracy is FAR below the clean one,
    that the model breaks; else there is no such line. The comparison follows it."""
    figures, methods = study["figures"], study["methods"]
    ece = [figures[m][k]["ece"]["value"] for m in methods]
    ece0 = [figures[m]["clean"]["ece"]["value"] for m in methods]
    acc = [figures[m][k]["accuracy"]["value"] for m in methods]
    acc0 = [figures[m]["clean"]["accuracy"]["value"] for m in methods]
    head = pg.locator("#shift-headline")
    if k != "clean" and all(e - e0 >= FAR for e, e0 in zip(ece, ece0)):
        assert head.inner_text() == (f"Every calibration breaks at this severity: every method's ECE is {span(ece)} "
                                     f"(clean: {span(ece0)}), accuracy {span(acc)} (clean: {span(acc0)}). "
                                     "The comparison below is between broken calibrations.")
    elif k != "clean" and all(a0 - a >= FAR for a, a0 in zip(acc, acc0)):
        assert head.inner_text().startswith(f"The model breaks at this severity: every method's accuracy {span(acc)}")
    else:
        assert not head.is_visible() and head.inner_text() == ""
        return
    assert head.bounding_box()["y"] + head.bounding_box()["height"] <= pg.locator("#shift-verdict").bounding_box()["y"]


def corruption_words(name: str) -> str:
    return {"contrast": "contrast", "gaussian-noise": "Gaussian noise", "jpeg": "JPEG compression",
            "defocus-blur": "defocus blur", "brightness": "brightness", "pixelate": "pixelation"}[name]


def test_the_tab_opens_on_contrast_at_severity_3(page, study):
    assert page.locator("#shift-corruption").input_value() == "contrast"
    assert page.locator("#shift-severity").input_value() == "3"
    check_condition(page, study, "contrast", 3)


@pytest.mark.parametrize("width,height", SIZES)
def test_read_outs_and_verdicts_equal_the_shipped_study(browser, server, study, width, height):  # noqa: F811
    pg = open_shift(browser, server, width, height)
    try:
        for corruption, severity in PAIRS:
            choose(pg, corruption, severity)
            check_condition(pg, study, corruption, severity)
    finally:
        pg.context.close()


class Requests:
    """The page's requests to a server (not its data: URLs)."""

    def __init__(self):
        self.urls = []

    def count(self, request) -> None:
        if request.url.startswith("http"):
            self.urls.append(request.url)


def thumb_positions(box: dict, thumb: float = 16) -> tuple[list[float], float]:
    """Where the slider's thumb sits at each severity 0–5 (the track runs from half a thumb in to half a
    thumb short of its ends), and the slider's middle height."""
    return [box["x"] + thumb / 2 + s * (box["width"] - thumb) / 5 for s in range(6)], box["y"] + box["height"] / 2


def test_moving_the_severity_redraws_in_the_page_without_a_request(page, study):
    """20 moves of a mouse drag over the slider, each to another severity: each redraws the pictures,
    the verdict, the curves and the diagrams, and none sends a request; the median time from the
    input event to the updated page is recorded."""
    page.select_option("#shift-corruption", "gaussian-noise")
    set_range(page, "#shift-severity", 0)
    # Requests to the server only: the pictures are data: URLs, drawn from the numbers sent once.
    requests = Requests()
    page.on("request", requests.count)
    page.locator("#shift-severity").scroll_into_view_if_needed()
    at, y = thumb_positions(page.locator("#shift-severity").bounding_box())
    page.mouse.move(at[0], y)
    page.mouse.down()
    path = [1, 2, 3, 4, 5, 4, 3, 2, 1, 0] * 2
    times, conditions, pictures, labels = [], [], {}, []
    for s in path:
        page.mouse.move(at[s], y, steps=2)
        state = page.evaluate("""() => { const r = document.querySelector('.ns');
            return [r.dataset.condition, Number(r.dataset.redrawMs),
                    [...document.querySelectorAll('#shift-examples img')].map(i => i.src),
                    document.querySelector('#shift-curve svg').getAttribute('aria-label')]; }""")
        conditions.append(state[0])
        times.append(state[1])
        pictures.setdefault(s, state[2])
        assert pictures[s] == state[2], s  # the same severity shows the same pictures
        labels.append(state[3])
    page.mouse.up()
    set_range(page, "#shift-severity", 2)
    page.select_option("#shift-corruption", "contrast")  # the menu redraws in the page too
    assert page.locator(".ns").get_attribute("data-condition") == "contrast/2"
    page.remove_listener("request", requests.count)
    assert not requests.urls, requests.urls
    assert conditions == [key("gaussian-noise", s) for s in path]
    assert all(f"severity {s if s else '0 (clean)'} marked" in label for s, label in zip(path, labels))
    # Every severity its own pictures, each the study's own PNG of that condition.
    assert len({tuple(p) for p in pictures.values()}) == 6
    for s, srcs in pictures.items():
        assert [src.split(",", 1)[1] for src in srcs] == study["examples"]["png"][key("gaussian-noise", s)]
    median = statistics.median(times)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "shift-redraw.json").write_text(json.dumps({"median_ms": median, "ms": times}))
    print(f"\nShift redraw, median of 20 drag moves: {median:.1f} ms")


#: Every visible piece of HTML text in the view as the boxes of its lines, and each number's boxes.
TEXTS = """root => {
  const out = [], numbers = [], walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  let node, i = 0;
  while ((node = walker.nextNode())) {
    const text = node.textContent, parent = node.parentElement;
    if (!text.trim() || parent.closest('svg') || !parent.checkVisibility()) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    for (const b of range.getClientRects())
      if (b.width > 0.5 && b.height > 0.5) out.push({node: i, text: text.trim().slice(0, 40), x: b.x, y: b.y, width: b.width, height: b.height});
    for (const m of text.matchAll(/[−+-]?\\d[\\d.,]*%?/g)) {
      const r = document.createRange();
      r.setStart(node, m.index);
      r.setEnd(node, m.index + m[0].length);
      const tops = new Set([...r.getClientRects()].filter(b => b.width > 0).map(b => Math.round(b.top)));
      numbers.push({text: m[0], lines: tops.size, in: text.trim().slice(0, 60)});
    }
    i++;
  }
  return {texts: out, numbers};
}"""
BOX = "e => { const r = e.getBoundingClientRect(); return {x: r.x, y: r.y, width: r.width, height: r.height}; }"


def rgb(css: str) -> str:
    """A computed colour as rgb(…): Chromium writes a color-mix() result as color(srgb r g b) in 0–1."""
    found = re.match(r"color\(srgb ([\d.]+) ([\d.]+) ([\d.]+)", css)
    return f"rgb({', '.join(str(255 * float(v)) for v in found.groups())})" if found else css


def shrink(box, by=1.0):
    return dict(x=box["x"] + by, y=box["y"] + by, width=box["width"] - 2 * by, height=box["height"] - 2 * by)


@pytest.mark.parametrize("width,height", SIZES)
def test_the_tab_reads_at_every_size(browser, server, width, height):  # noqa: F811
    pg = open_shift(browser, server, width, height)
    try:
        found = pg.locator("#shift-view").evaluate(TEXTS)
        texts = found["texts"]
        assert len(texts) > 40
        for i, a in enumerate(texts):  # no two pieces of text drawn over each other
            for b in texts[i + 1:]:
                if a["node"] != b["node"]:
                    assert not boxes_overlap(shrink(a), shrink(b)), f"{a} overlaps {b} at {width} px"
        # No number broken over two lines (read-outs, verdict, intervals, the note).
        assert len(found["numbers"]) > 30
        assert [n for n in found["numbers"] if n["lines"] > 1] == []
        # Nothing sticks out sideways; each figure's text stays inside it and apart.
        view = pg.locator("#shift-view").evaluate(BOX)
        assert view["x"] >= 0 and view["x"] + view["width"] <= width + 0.5
        plots = pg.locator("#shift-view .ns-curve, #shift-view .ns-binned").all()
        assert len(plots) == 2 + 6
        for plot in plots:
            p = plot.evaluate(BOX)
            assert p["x"] >= 0 and p["x"] + p["width"] <= width + 0.5 and p["width"] >= 150
            labels = plot.evaluate(f"e => [...e.querySelectorAll('svg text')].map({BOX})")
            assert len(labels) > 10
            for i, a in enumerate(labels):
                assert a["x"] >= p["x"] - 0.5 and a["x"] + a["width"] <= p["x"] + p["width"] + 0.5
        for plot in ("#shift-curve", "#shift-mean"):
            labels = pg.locator(plot).evaluate(f"e => [...e.querySelectorAll('svg text')].map({BOX})")
            for i, a in enumerate(labels):
                for b in labels[i + 1:]:
                    assert not boxes_overlap(shrink(a, 0.5), shrink(b, 0.5)), (plot, a, b)
        curve, mean = (pg.locator(s).evaluate(BOX) for s in ("#shift-curve", "#shift-mean"))
        cards = [c.evaluate(BOX) for c in pg.locator("#shift-diagrams .ns-card").all()]
        pictures = [i.evaluate(BOX) for i in pg.locator("#shift-examples img").all()]
        assert len(pictures) == 6 and all(p["width"] >= 60 and abs(p["width"] - p["height"]) < 1 for p in pictures)
        verdict = pg.locator("#shift-verdict").evaluate(BOX)
        if width < 500:  # a phone: one column, in reading order, the figures one under the other
            assert verdict["y"] + verdict["height"] <= pictures[0]["y"] < curve["y"]
            assert curve["y"] + curve["height"] <= mean["y"] and abs(curve["x"] - mean["x"]) < 1
            for a, b in zip(cards, cards[1:]):
                assert a["y"] + a["height"] <= b["y"] and abs(a["x"] - b["x"]) < 1
        else:  # side by side: the controls beside the pictures and the curves; three diagrams a row
            assert verdict["x"] + verdict["width"] <= curve["x"] and curve["x"] + curve["width"] <= mean["x"]
            assert abs(curve["y"] - mean["y"]) < 1
            assert abs(cards[0]["y"] - cards[2]["y"]) < 1 and cards[3]["y"] >= cards[0]["y"] + cards[0]["height"]
        pg.screenshot(path=str(ARTIFACTS / f"shift-{width}.png"), full_page=True)
    finally:
        pg.context.close()


STYLES = """() => {
    const st = (e) => getComputedStyle(e);
    const bg = st(document.querySelector('.ns')).backgroundColor;
    const texts = [...document.querySelectorAll('.ns-curve svg text, .ns-binned svg text:not(.nd-on-bar)')]
        .map(e => [st(e).fontSize, st(e).fill]);
    const lines = [...document.querySelectorAll('#shift-curve .ns-line')].map(e => st(e).stroke);
    const words = ['#shift-verdict', '#shift-also', '#shift-lead', '.ns-read dd', '.ns-label']
        .map(s => document.querySelector(s)).map(e => [st(e).fontSize, st(e).color]);
    return {bg, texts, lines, words};
}"""


def test_presenter_mode_fits_a_projector(browser, server):  # noqa: F811
    pg = open_shift(browser, server, 1280, 720)
    try:
        pg.get_by_role("button", name="Presenter mode").click()
        pg.locator(".ns[data-presenter=on] #shift-curve svg").wait_for()
        s = pg.evaluate(STYLES)
        for size, fill in s["texts"]:
            assert float(size[:-2]) >= 17 and contrast(fill, s["bg"]) >= 4.5, (size, fill)
        for size, colour in s["words"]:
            assert float(size[:-2]) >= 17 and contrast(colour, s["bg"]) >= 4.5, (size, colour)
        # The controls, the verdict, the pictures and both curves on the screen at once, none scrolled away.
        for part in ("#shift-corruption", "#shift-severity", "#shift-verdict", "#shift-examples", "#shift-curve",
                     "#shift-mean"):
            box = pg.locator(part).bounding_box()
            assert box["y"] >= 0 and box["y"] + box["height"] <= 720 and box["x"] + box["width"] <= 1280, part
        assert pg.locator("#shift-curve").bounding_box()["height"] >= 300
        pg.screenshot(path=str(ARTIFACTS / "shift-presenter-1280x720.png"))
        pg.keyboard.press("Escape")
        assert pg.locator(".ns").get_attribute("data-presenter") == "off"
    finally:
        pg.context.close()


@pytest.mark.parametrize("theme", ["dark", "light"])
def test_the_figures_take_the_theme(browser, server, theme):  # noqa: F811
    pg = open_shift(browser, server, 1400, 1000, theme=theme)
    try:
        assert pg.evaluate("document.body.classList.contains('dark')") == (theme == "dark")
        s = pg.evaluate(STYLES)
        assert (_luminance(_rgb(s["bg"])) < 0.05) == (theme == "dark")
        for _, fill in s["texts"]:
            assert contrast(fill, s["bg"]) >= 4.5
        for _, colour in s["words"]:
            assert contrast(colour, s["bg"]) >= 4.5
        assert len(s["lines"]) == 6
        for stroke in s["lines"]:  # each method's line stands out from the page
            assert contrast(rgb(stroke), s["bg"]) >= 3, stroke
        pg.locator("#shift-view").screenshot(path=str(ARTIFACTS / f"shift-{theme}-1400.png"))
    finally:
        pg.context.close()
