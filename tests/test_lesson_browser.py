"""Learn asks the server nothing while it moves, links open a view, and the lesson steps through, in
headless Chromium against the launched app (a phone, a projector and a desktop; light and dark):

- the page's own table and explanations equal Python's ``learn.explain`` (itself nctv.metrics) at several
  T and bin counts, T = 0.05 included, where most confidences tie at exactly 1; no request is sent;
- ``/?tab=learn&t=1.5&bins=10&presenter=1`` opens Learn in presenter mode at T = 1.5 and 10 bins, its ECE
  that of nctv.metrics; bad values are named in the note above the tabs and otherwise ignored;
- "Copy link to this view" gives a link that opens the same view (T, bins, step, opened group);
- every step of the lesson, by Back and Next and by ``step=``, sets its view and says its paragraph
  with the model's numbers (computed here with nctv.metrics), readable: nothing cut off, every text at
  4.5:1 or more.

Screenshots go to test-artifacts/ (lesson-*.png)."""
import re
from pathlib import Path

import pytest
from test_browser import CHROMIUM, browser  # noqa: F401 - browser: the shared fixture
from test_learn_browser import SHOTS, save_small, set_range, shipped  # noqa: F401 - shipped: a fixture
from test_readable_browser import LOW_CONTRAST

from nctv import metrics
from nctv.conformal import aps_mean_set_size
from nctv.ui import learn, lesson
from nctv.ui.shipped import load_precomputed
from conftest import PAGE_WAIT_MS

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"needs Debian's Chromium at {CHROMIUM}"),
]
SIZES = [(390, 844), (1280, 720), (1400, 1000)]
THEMES = ("light", "dark")
BAR_LINK = "?tab=learn&t=1.5&bins=10&presenter=1"


def open_link(browser, server, query: str, width: int, height: int, theme: str = "light", **context):  # noqa: F811
    """A fresh page at ``server`` + ``query`` once Learn has its data and has written its words."""
    ctx = browser.new_context(viewport={"width": width, "height": height}, is_mobile=width < 500,
                              has_touch=width < 500, **context)
    pg = ctx.new_page()
    pg.set_default_timeout(PAGE_WAIT_MS)
    sep = "&" if "?" in query else "?"
    pg.goto(server.rstrip("/") + "/" + query + (f"{sep}__theme=dark" if theme == "dark" else ""))
    pg.wait_for_selector("#learn-plot svg")
    pg.wait_for_function("document.querySelector('.nl').dataset.wordsTemperature !== undefined")
    return pg


def view_state(pg) -> dict:
    return pg.evaluate("""() => { const r = document.querySelector('.nl');
        return {t: Number(r.dataset.temperature), bins: Number(r.dataset.bins), presenter: r.dataset.presenter,
                step: Number(r.dataset.step), box: document.querySelector('#learn-t-box').value,
                range: Number(document.querySelector('#learn-t').value),
                binsShown: document.querySelector('#learn-bins-value').textContent,
                ece: Number(document.querySelector('#learn-ece').dataset.value),
                tab: document.querySelector('[role=tab][aria-selected=true]').textContent.trim(),
                opened: document.querySelector('#learn-bin').hidden ? null : document.querySelector('#learn-bin-title').innerText,
                note: document.querySelector('#link-note') ? document.querySelector('#link-note').innerText : ''}; }""")


def words_at(pg, t: float, bins: int) -> None:
    """Wait until the page's table and explanations are written for T = ``t`` and ``bins`` bins."""
    pg.wait_for_function(f"""() => {{ const d = document.querySelector('.nl').dataset;
        return Number(d.wordsTemperature) === {t} && Number(d.wordsBins) === {bins}; }}""")


def markdown_table(md: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
            if line.startswith("|") and not line.startswith("| :--")]


def plain(text: str) -> str:
    """Markdown or a page's text as words: marks, headings' hashes and line breaks gone."""
    return " ".join(re.sub(r"\*\*|(?<!\w)\*|\*(?!\w)|^### ", "", text, flags=re.M).split())


# ----------------------------------------------------------------------------- the page's own words

@pytest.fixture(scope="module")
def desk(browser, server):  # noqa: F811
    pg = open_link(browser, server, "?tab=learn", 1400, 1000)
    yield pg
    pg.context.close()


def test_the_pages_table_and_words_equal_pythons_without_a_request(desk, shipped):
    """At each T and bin count the page's table (every cell) and explanations (every word and number)
    equal learn.explain's, whose figures are nctv.metrics'; T = 0.05 puts 9,551 of the 10,000
    confidences at exactly 1 (ties, in AECE's sort too); 32 bins make "about 312.5" pictures a bin, a
    half that both round to even. The page sends nothing meanwhile."""
    z, y = shipped
    conf, _ = metrics.confidences_and_predictions(z / 0.05)
    assert (conf == 1).sum() == 9_551  # the ties are there
    sent = []
    desk.on("request", lambda r: sent.append(r.url) if "/gradio_api/" in r.url else None)
    for bins in (15, 5, 32, 50):
        set_range(desk, "#learn-bins", bins)
        for t in (0.05, 0.3, 1.0, 1.5, 3.61, 5.0):
            set_range(desk, "#learn-t", t)
            words_at(desk, t, bins)
            table, text = learn.explain(t, bins, None)
            got = [row.split("\t") for row in desk.locator("#learn-table table").inner_text().splitlines()]
            assert [[c.strip() for c in row] for row in got] == markdown_table(table), (t, bins)
            assert desk.locator("#learn-table p").inner_text() == f"{bins} bins; test split."
            assert plain(desk.locator("#learn-text").inner_text()) == plain(text), (t, bins)
    assert sent == []
    save_small(desk.locator("#learn-view").screenshot(), "lesson-words-1400.png")


# ----------------------------------------------------------------------------- links

@pytest.mark.parametrize("theme", THEMES)
def test_the_lecture_link_opens_learn_in_presenter_mode(browser, server, shipped, theme):  # noqa: F811
    z, y = shipped
    pg = open_link(browser, server, BAR_LINK, 1280, 720, theme)
    try:
        pg.wait_for_function("document.querySelector('.nl').dataset.presenter === 'on'")
        words_at(pg, 1.5, 10)
        s = view_state(pg)
        assert (s["tab"], s["presenter"], s["t"], s["range"], s["box"], s["bins"], s["binsShown"]) == \
            ("Learn", "on", 1.5, 1.5, "1.50", 10, "10")
        assert s["ece"] == pytest.approx(metrics.ece(z / 1.5, y, 10), abs=1e-9)
        assert pg.locator("#learn-ece").inner_text() == f"{100 * metrics.ece(z / 1.5, y, 10):.2f}%"
        assert s["note"].strip() == ""  # nothing ignored
        for sel in ("#learn-ece", "#learn-accuracy", "#learn-aps", "#learn-plot svg", "#learn-smooth svg", "#learn-copy"):
            pg.locator(sel).first.wait_for()  # drawn (a busy machine draws the last of them later)
            box = pg.locator(sel).bounding_box()  # all on the projector's screen
            assert box["y"] >= 0 and box["y"] + box["height"] <= 720 and box["x"] + box["width"] <= 1280, sel
        assert pg.evaluate(LOW_CONTRAST, ["#learn-lesson", 4.5]) == []
        save_small(pg.screenshot(), f"lesson-link-1280x720-{theme}.png")
    finally:
        pg.context.close()


def test_bad_values_are_named_in_a_note_and_ignored(browser, server):  # noqa: F811
    pg = open_link(browser, server, "?tab=learn&t=abc&bins=99&step=9&presenter=2&foo=1&model=nope", 1400, 1000)
    try:
        pg.wait_for_function("(document.querySelector('#link-note') || {innerText: ''}).innerText.includes('ignored')")
        s = view_state(pg)
        assert (s["tab"], s["t"], s["bins"], s["presenter"], s["step"]) == ("Learn", 1.0, 15, "off", 0)
        for words in ("t = 'abc' is not a temperature from 0.05 to 5", "bins must be at least 5 and at most 50; got 99",
                      "step must be at least 1 and at most 7; got 9", "presenter = '2' is not 1 or 0",
                      "'foo' is not a part of a link", "model = 'nope' is not a model of the menu"):
            assert words in s["note"], words
        assert pg.locator(".toast-body").count() == 0  # no error, only the note
    finally:
        pg.context.close()
    # A tab and a menu model by name: the γ sweep tab, fmnist-resnet in the shared panel.
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = ctx.new_page()
    try:
        pg.goto(server.rstrip("/") + "/?tab=gamma&model=fmnist-resnet")
        pg.wait_for_function("(document.querySelector('#shared-panel') || {innerText: ''}).innerText.includes('fmnist-resnet ·')")
        assert pg.locator("[role=tab][aria-selected=true]").inner_text().strip() == "γ sweep"
        assert pg.locator("#link-note").is_hidden()
    finally:
        ctx.close()


def test_copy_link_gives_a_link_back_to_the_same_view(browser, server):  # noqa: F811
    pg = open_link(browser, server, "?step=3&presenter=1", 1280, 720,
                   permissions=["clipboard-read", "clipboard-write"])
    try:
        pg.wait_for_function("document.querySelector('#learn-bin-note').innerText.startsWith('Wrong predictions')")
        box = pg.locator("#learn-t-box")
        box.fill("2.345")
        box.press("Enter")
        set_range(pg, "#learn-bins", 20)
        words_at(pg, 2.345, 20)
        pg.locator('#learn-plot .nd-hit[data-bin="18"]').click()
        pg.wait_for_function("document.querySelector('#learn-bin-title').innerText.startsWith('Confidence 90–95%')")
        before = view_state(pg)
        pg.click("#learn-copy")
        pg.wait_for_function("document.querySelector('#learn-link-url').value !== ''")
        link = pg.locator("#learn-link-url").input_value()
        assert pg.evaluate("navigator.clipboard.readText()") == link
        assert pg.locator("#learn-link-said").inner_text() == "Link copied:"
        assert link.endswith("?tab=learn&t=2.345&bins=20&presenter=1&step=3&bin=19"), link
    finally:
        pg.context.close()
    again = open_link(browser, server, link[link.index("?"):], 1280, 720)
    try:
        again.wait_for_function("document.querySelector('.nl').dataset.presenter === 'on'")
        words_at(again, 2.345, 20)
        again.wait_for_function("!document.querySelector('#learn-bin').hidden")
        after = view_state(again)
        for key in ("tab", "t", "bins", "presenter", "step", "box", "ece", "opened"):
            assert after[key] == before[key], key
    finally:
        again.context.close()


# ----------------------------------------------------------------------------- the lesson

def expected_paragraphs(z, y) -> list[str]:
    """Each step's paragraph as the page must say it, its numbers computed here with nctv.metrics."""
    cal = load_precomputed().calibration
    n, k = (int(s) for s in z.shape)
    out = []
    for step, text in zip(lesson.STEPS, lesson.paragraphs(cal, n), strict=True):
        t = {"one": 1.0, "fit": cal.ts_temperature}.get(step.t, step.t)
        bins = step.bins or cal.n_bins
        rows = {key: learn._scores(z / temperature, y, bins)
                for key, temperature in (("one", 1.0), ("now", t), ("fit", cal.ts_temperature))}
        values = learn.view_values(t, n, k, bins, rows)
        conf, _ = metrics.confidences_and_predictions(z / t)
        groups = metrics.reliability_bins(z / t, y, bins)
        b = int(groups.counts.argmax())  # the first of the fullest
        edge = lambda i: f"{float(f'{100 * i / bins:.1f}'):g}"  # noqa: E731 - as the page writes an edge
        values.update({"fit": f"{cal.ts_temperature:.3f}", "n": f"{n:,}", "confidence": f"{100 * conf.mean():.2f}",
                       "aps": f"{aps_mean_set_size(z[0::2], y[0::2], z[1::2], t):.2f}",
                       "aps.one": f"{aps_mean_set_size(z[0::2], y[0::2], z[1::2], 1.0):.2f}",
                       "group.count": f"{groups.counts[b]:,}", "group.range": f"{edge(b)}–{edge(b + 1)}%",
                       "group.share": f"{100 * groups.counts[b] / n:.1f}",
                       "group.conf": f"{100 * groups.confidence[b]:.2f}", "group.acc": f"{100 * groups.accuracy[b]:.2f}"})
        out.append(plain(learn.fill(text, values)))
    return out


READABLE = """() => {
  const box = document.querySelector('#learn-lesson'), r = box.getBoundingClientRect();
  const texts = [...box.querySelectorAll('h3, p, button:not([hidden])')].filter(e => e.checkVisibility());
  return {box: {x: r.x, right: r.right, width: r.width}, page: document.documentElement.clientWidth,
          scrolls: document.documentElement.scrollWidth > document.documentElement.clientWidth,
          cut: texts.filter(e => e.scrollWidth > e.clientWidth + 1 || e.getBoundingClientRect().right > r.right + 0.5
                                  || e.getBoundingClientRect().x < r.x - 0.5).map(e => e.textContent.slice(0, 40)),
          font: parseFloat(getComputedStyle(document.querySelector('#learn-lesson-text')).fontSize)};
}"""


@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_every_lesson_step_by_next_and_back(browser, server, shipped, size, theme):  # noqa: F811
    z, y = shipped
    width, height = size
    presenter = width == 1280  # the projector: in presenter mode
    pg = open_link(browser, server, "?tab=learn" + ("&presenter=1" if presenter else ""), width, height, theme)
    fitted = load_precomputed().calibration.ts_temperature
    want = expected_paragraphs(z, y)
    try:
        pg.click("#learn-start")
        for i, step in enumerate(lesson.STEPS):
            if i:
                pg.click("#learn-next")
            t = {"one": 1.0, "fit": fitted}.get(step.t, step.t)
            pg.wait_for_function(f"Number(document.querySelector('.nl').dataset.step) === {i + 1}")
            words_at(pg, t, 15)
            assert pg.locator("#learn-lesson-title").inner_text() == f"Step {i + 1} of {len(lesson.STEPS)}: {step.title}"
            assert plain(pg.locator("#learn-lesson-text").inner_text()) == want[i], step.title
            if step.group:
                pg.wait_for_function("document.querySelector('#learn-bin-note').innerText.startsWith('Wrong predictions')")
            assert pg.locator("#learn-bin").is_hidden() == (step.group is None)
            r = pg.evaluate(READABLE)
            assert not r["scrolls"] and r["cut"] == [] and r["box"]["right"] <= r["page"] + 0.5, r
            assert r["font"] >= (20 if presenter else 14)
            assert pg.evaluate(LOW_CONTRAST, ["#learn-lesson", 4.5]) == []
            assert pg.locator("#learn-back").is_disabled() == (i == 0)
            pg.locator("#learn-lesson").scroll_into_view_if_needed()
            save_small(pg.screenshot(), f"lesson-step{i + 1}-{width}x{height}-{theme}.png")
        assert pg.locator("#learn-next").is_disabled()
        pg.click("#learn-back")
        pg.wait_for_function(f"Number(document.querySelector('.nl').dataset.step) === {len(lesson.STEPS) - 1}")
        assert plain(pg.locator("#learn-lesson-text").inner_text()) == want[-2]
        pg.click("#learn-lesson-close")
        assert pg.locator("#learn-lesson-text").is_hidden() and pg.locator("#learn-start").is_visible()
    finally:
        pg.context.close()


def test_each_step_opens_by_its_link(browser, server, shipped):  # noqa: F811
    z, y = shipped
    want = expected_paragraphs(z, y)
    fitted = load_precomputed().calibration.ts_temperature
    for i, step in enumerate(lesson.STEPS):
        pg = open_link(browser, server, f"?step={i + 1}&presenter=1", 1280, 720)
        try:
            t = {"one": 1.0, "fit": fitted}.get(step.t, step.t)
            words_at(pg, t, 15)
            s = view_state(pg)
            assert (s["tab"], s["step"], s["presenter"], s["t"], s["bins"]) == ("Learn", i + 1, "on", t, 15)
            assert plain(pg.locator("#learn-lesson-text").inner_text()) == want[i], step.title
        finally:
            pg.context.close()
