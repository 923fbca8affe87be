"""Every piece of text on the app's screens reads, in headless Chromium on the launched app, at a
phone's (390 × 844), a projector's (1280 × 720) and a desktop's (1400 × 1000) size, in the light and
the dark theme: its contrast (the WCAG 2 formula, from the computed colours of the text and of what
lies behind it) is at least 4.5:1, its font has the glyphs it draws, and a table that does not fit
says that it scrolls. The Try tab on a phone puts the answer right under the picture. One page per
size is shared by the tests of that size; the theme is switched in the page."""
import os

import numpy as np
import pytest

from test_browser import ARTIFACTS, CHROMIUM, browser, open_app  # noqa: F401 - browser: a fixture
from test_try_browser import by_size, page_per_size
from nctv.ui.shipped import load_precomputed
from conftest import PAGE_WAIT_MS

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}")]
SIZES = [(390, 844), (1280, 720), (1400, 1000)]
THEMES = ("light", "dark")
#: The tabs whose screens are read, by their names in the tab bar.
TABS = ("Calibrate", "γ sweep", "Initialisation", "Try your own image", "Learn", "Shift")

#: Every visible piece of text under ``root`` whose contrast with what lies behind it is below ``least``
#: ({text, colour, background, ratio}). The colours are the computed ones: the text's (an SVG text's
#: fill), each see-through layer behind it composed over the next down to the first opaque one (the
#: page's background colour at the end), and the opacity of the text and of every element around it
#: mixing the text into that background. Text over a picture or a canvas, and text scrolled out of its
#: box, is left out. The ratio is WCAG 2's: (L1 + 0.05) / (L2 + 0.05) of the relative luminances.
LOW_CONTRAST = """([sel, least]) => {
  const rgba = (css) => { const m = css.match(/[\\d.]+/g); if (!m) return [0, 0, 0, 0];
    return [+m[0], +m[1], +m[2], m.length > 3 ? +m[3] : 1]; };
  const over = (top, under) => { const a = top[3] + under[3] * (1 - top[3]);
    if (a === 0) return [0, 0, 0, 0];
    return [0, 1, 2].map(i => (top[i] * top[3] + under[i] * under[3] * (1 - top[3])) / a).concat([a]); };
  const lum = (c) => { const [r, g, b] = c.slice(0, 3).map(v => { v /= 255;
    return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; }); return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  const ratio = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
  const page = rgba(getComputedStyle(document.body).backgroundColor);
  const base = page[3] === 1 ? page : over(page, document.body.classList.contains('dark') ? [11, 15, 25, 1] : [255, 255, 255, 1]);
  const behind = (el) => { const layers = [];
    for (let e = el; e && e !== document.documentElement; e = e.parentElement) {
      const st = getComputedStyle(e);
      if (e.tagName === 'IMG' || e.tagName === 'CANVAS' || e.tagName === 'VIDEO') return null;
      const c = rgba(st.backgroundColor);
      if (c[3] > 0) { layers.push(c); if (c[3] === 1) break; }
    }
    return layers.reduceRight((acc, c) => over(c, acc), base); };
  const out = [], root = document.querySelector(sel), walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  let node;
  while ((node = walker.nextNode())) {
    const text = node.textContent.trim(), el = node.parentElement;
    if (!text || !el.checkVisibility({ opacityProperty: true, visibilityProperty: true })) continue;
    const range = document.createRange(); range.selectNodeContents(node);
    const box = [...range.getClientRects()].find(b => b.width > 0.5 && b.height > 0.5);
    if (!box) continue;
    const inSvg = el.closest('svg') !== null;
    const st = getComputedStyle(el);
    let fg = rgba(inSvg ? st.fill : st.color);
    if (inSvg && st.fill === 'none') continue;
    const bg = behind(el);
    if (!bg) continue;
    let opacity = 1;
    for (let e = el; e; e = e.parentElement) opacity *= +getComputedStyle(e).opacity;
    if (inSvg) opacity *= +(st.fillOpacity || 1);
    fg = over([fg[0], fg[1], fg[2], fg[3] * opacity], bg);
    const r = ratio(fg, bg);
    if (r < least) out.push({ text: text.slice(0, 50), colour: st.color, fill: inSvg ? st.fill : '', tag: el.tagName,
      cls: String(el.className && el.className.baseVal !== undefined ? el.className.baseVal : el.className).slice(0, 60),
      background: `rgb(${bg.slice(0, 3).map(Math.round).join(', ')})`, ratio: Math.round(r * 100) / 100 });
  }
  return out;
}"""


def set_theme(pg, theme: str) -> None:
    """Switch the page to ``theme`` as Gradio's own ``?__theme=`` does: the class ``dark`` on the body."""
    pg.evaluate("dark => document.body.classList.toggle('dark', dark)", theme == "dark")
    # The colours change through CSS transitions: measure once every one has ended.
    pg.wait_for_function("document.getAnimations().every(a => a.playState !== 'running' || a.effect?.getTiming().iterations === Infinity)",
                         timeout=PAGE_WAIT_MS)

#: The pieces of the text under ``root`` that pair a number with its unit (or "T =" with its value),
#: each with the number of lines it is drawn on.
UNIT_LINES = """root => {
  const out = [], walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const pattern = /(?:[<>][\\s\\u00a0])?\\d[\\d,.]*[\\s\\u00a0]%|T[\\s\\u00a0]=[\\s\\u00a0]\\d[\\d.]*/g;
  let node;
  while ((node = walker.nextNode())) {
    if (!node.parentElement.checkVisibility()) continue;
    for (const m of node.textContent.matchAll(pattern)) {
      const range = document.createRange();
      range.setStart(node, m.index);
      range.setEnd(node, m.index + m[0].length);
      const tops = new Set([...range.getClientRects()].filter(b => b.width > 0.5).map(b => Math.round(b.top)));
      out.push({ text: m[0], lines: tops.size });
    }
  }
  return out;
}"""


def open_page(browser, url, width, height):  # noqa: F811 - browser: the fixture's value
    pg = open_app(browser, url, width, height, phone=width < 500)
    # The shared panel's help texts are part of the page, and so are the prediction sets' (their scores
    # explained in a line each): open both once.
    pg.locator("#shared-panel").get_by_role("button").first.click()
    pg.locator("#calibration-size input").wait_for(state="visible")
    pg.locator("#conformal-panel").get_by_role("button").first.click()
    pg.locator("#conformal-info").wait_for(state="visible")
    return pg


page = page_per_size("page", open_page)

#: What shows that a tab's screen is drawn (its slowest part).
DRAWN = {"Calibrate": "#calibrate-diagrams svg", "γ sweep": "#gamma-plot .main-svg", "Initialisation": "#init-plot .main-svg",
         "Try your own image": "#try-chart .nctv-class", "Learn": "#learn-plot svg", "Shift": "#shift-diagrams .ns-card svg"}


def show_tab(pg, tab: str) -> None:
    pg.get_by_role("tab", name=tab).click()
    pg.locator(DRAWN[tab]).first.wait_for(state="visible")
    pg.wait_for_timeout(300)


def low_contrast(pg, root: str = "body") -> list[dict]:
    return pg.evaluate(LOW_CONTRAST, [root, 4.5])


def least_contrast(pg, root: str = "body") -> float:
    """The lowest contrast of any text under ``root`` (for the record: printed by the tests)."""
    return min(r["ratio"] for r in pg.evaluate(LOW_CONTRAST, [root, 1e9]))


@by_size("page", SIZES)
def test_every_text_reads_at_4_5_to_1_in_both_themes(page):
    pg, width = page, page.viewport_size["width"]
    failures, least = [], {}
    try:
        for theme in THEMES:
            set_theme(pg, theme)
            for tab in TABS:
                show_tab(pg, tab)
                failures += [(theme, tab, r["text"], r["ratio"], r["colour"] or r["fill"], r["background"])
                             for r in low_contrast(pg)]
                least[theme, tab] = least_contrast(pg)
                # Download lists are read-only: no "Remove this file" button on any of them.
                assert pg.locator('.download-list button[aria-label="Remove this file"]:visible').count() == 0, tab
            pg.screenshot(path=str(ARTIFACTS / f"readable-{width}-{theme}.png"))
    finally:
        set_theme(pg, "light")
    print(f"\nleast contrast at {width} px:", {f"{t}/{tab}": r for (t, tab), r in least.items()})
    assert failures == [], f"text under 4.5:1 at {width} px: {failures[:12]}"


def _checkered(path):
    """A colourful checkerboard: nothing like clothing, light on dark; the model's check flags it."""
    from PIL import Image

    y, x = np.mgrid[0:200, 0:300]
    picture = np.stack([(x // 25 % 2) * 230, (y // 25 % 2) * 200, ((x + y) // 40 % 2) * 180], axis=-1)
    Image.fromarray(picture.astype("uint8")).save(path)
    return path


@by_size("page", SIZES)
def test_a_flagged_answer_is_marked_in_words_in_view_under_the_picture(page, tmp_path):
    from nctv.ui import try_image

    pg, (width, height) = page, (page.viewport_size["width"], page.viewport_size["height"])
    show_tab(pg, "Try your own image")
    pg.locator("#try-chart .nctv-chart").evaluate("e => { e.dataset.old = 'yes'; }")
    pg.locator("#try-image input[type=file]").set_input_files(str(_checkered(tmp_path / "tiles.png")))
    pg.wait_for_function("document.querySelector('#try-chart .nctv-chart:not([data-old])') !== null", timeout=PAGE_WAIT_MS)
    assert pg.locator("#try-verdict .nctv-verdict").get_attribute("data-flagged") == "true"
    assert try_image.MEANS_LITTLE in pg.locator("#try-verdict").inner_text()
    answer = pg.locator("#try-chart .nctv-answer")
    # Nothing is greyed out: every text of the result reads at 4.5:1 in both themes.
    try:
        for theme in THEMES:
            set_theme(pg, theme)
            print(f"\nleast contrast of a flagged result at {width} px, {theme}: {least_contrast(pg, '#try-results')}")
            assert low_contrast(pg, "#try-results") == [], theme
    finally:
        set_theme(pg, "light")
    assert try_image.FLAGGED_ANSWER in answer.inner_text()  # the answer itself is marked, in words
    # What a calibrated confidence means, and which bar to trust: the lowest test ECE of the calibration in use.
    trust = pg.locator("#try-chart .nctv-trust").inner_text().replace("\xa0", " ")
    assert "of the pictures answered with 80 %, about 8 in 10 are right" in trust
    ece = load_precomputed().calibration.metrics
    best = min((ece["Uncalibrated"]["ece"], "uncal."), (ece["Temperature Scaling"]["ece"], "TS"),
               (ece[load_precomputed().calibration.nc_method]["ece"], "NC"))
    assert f"Trust the {best[1]} bar" in trust and f"{100 * best[0]:.1f} points" in trust
    # Numbers stay with their units.
    pairs = pg.locator("#try-results").evaluate(UNIT_LINES)
    assert len(pairs) > 10 and all(p["lines"] == 1 for p in pairs), [p for p in pairs if p["lines"] != 1]
    # With the picture at the top of the screen, its answer is in view: right under it on a phone.
    pg.locator("#try-image").evaluate("e => e.scrollIntoView({block: 'start'})")
    picture, box = pg.locator("#try-image").bounding_box(), answer.bounding_box()
    assert box["y"] + box["height"] <= height, (box, height)
    if width < 500:
        assert picture["y"] + picture["height"] <= box["y"] <= picture["y"] + picture["height"] + 0.4 * height
    pg.screenshot(path=str(ARTIFACTS / f"try-flagged-{width}.png"))


@by_size("page", [(1400, 1000)])
def test_the_page_draws_in_the_systems_fonts(page):
    """No font file is fetched (Gradio's bundled Source Sans Pro semibold holds "A" and "B" only, so
    every semibold label mixed two fonts): every text is in a font the system has whole."""
    from nctv.ui.app import SYSTEM_FONTS

    pg = page
    show_tab(pg, "Calibrate")
    files = pg.evaluate("performance.getEntriesByType('resource').map(e => e.name).filter(n => /\\.(woff2?|ttf|otf)(\\?|$)/.test(n))")
    assert files == []
    faces = pg.evaluate("[...document.fonts].filter(f => f.status === 'loaded').map(f => f.family)")
    assert faces == []
    for selector in ("#results-table th", "#shared-panel label span", "button[role=tab]", "h2"):
        family = pg.locator(selector).first.evaluate("e => getComputedStyle(e).fontFamily")
        assert [f.strip().strip("'\"") for f in family.split(",")] == list(SYSTEM_FONTS), (selector, family)


@by_size("page", SIZES)
def test_a_table_fits_or_says_that_it_scrolls(page):
    pg, width = page, page.viewport_size["width"]
    seen = 0
    for tab in ("Calibrate", "γ sweep", "Initialisation", "Shift"):
        show_tab(pg, tab)
        for table in pg.locator(".result-table:visible").all():
            seen += 1
            wide = table.evaluate("e => e.scrollWidth > e.clientWidth + 1")
            cue = lambda: table.evaluate("e => getComputedStyle(e, '::before').content")  # noqa: E731
            if not wide:
                assert table.get_attribute("data-overflow") != "true" and cue() in ("none", "normal"), tab
                continue
            pg.wait_for_function("e => e.dataset.overflow === 'true'", arg=table.element_handle())
            assert "scroll sideways" in cue(), (tab, width)
            table.evaluate("e => { e.scrollLeft = e.scrollWidth; }")
            pg.wait_for_function("e => e.dataset.scrolled === 'end'", arg=table.element_handle())
            assert "Scroll back" in cue()
            table.evaluate("e => { e.scrollLeft = 0; }")
            if width < 500:
                table.screenshot(path=str(ARTIFACTS / f"table-cue-{tab[:5]}-{width}.png"))
    assert seen >= 4


@by_size("page", [(1400, 1000)])
def test_a_typed_dataset_is_kept_and_refused_before_run(page):
    """Typing "mnist" and pressing Enter keeps "mnist" (Gradio's box picked "fashion-mnist", the first
    entry containing the text), and the panel says at once, in one sentence, what this server takes."""
    from nctv.ui.limits import unaccepted

    pg = page
    show_tab(pg, "Calibrate")
    box = pg.locator("#dataset-box input")
    box.click()
    box.fill("mnist")
    box.press("Enter")
    pg.wait_for_function("document.querySelector('#dataset-note').innerText.includes('mnist')", timeout=PAGE_WAIT_MS)
    assert box.input_value() == "mnist"
    note = pg.locator("#dataset-note").inner_text()
    assert note == f"Not accepted — {unaccepted('mnist')}"
    assert "folder:" not in note and "<" not in note  # this server takes no folders
    assert "mnist" in pg.locator("#shared-panel").get_by_role("button").first.inner_text()
    # A listed name, typed whole, is taken as it is; the note goes.
    box.click()
    box.fill("fashion-mnist")
    box.press("Enter")
    pg.wait_for_function("document.querySelector('#dataset-note').innerText.trim() === ''", timeout=PAGE_WAIT_MS)
    assert box.input_value() == "fashion-mnist"
    box.click()
    box.fill("model's own dataset")
    box.press("Enter")
    pg.wait_for_function("document.querySelector('#shared-panel').innerText.includes(\"model's own dataset\")")
