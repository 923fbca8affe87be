"""Plotly figures follow the page's theme: in the dark theme their background is the page's (not a
white box) and every piece of their text reads at a contrast of at least 4.5:1 against it. Read off
the launched app in headless Chromium."""
import os

import pytest

from test_browser import ARTIFACTS, CHROMIUM, browser  # noqa: F401 - browser: a fixture
from test_learn_browser import _luminance, _rgb, contrast
from conftest import PAGE_WAIT_MS

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}")]

#: The figure's own background, the colour of the block behind it, and the fill of each of its texts.
COLOURS = """sel => {
    const fig = document.querySelector(sel);
    const st = (e) => getComputedStyle(e);
    let block = fig, behind = 'rgba(0, 0, 0, 0)';
    while (block && /rgba\\(0, 0, 0, 0\\)|transparent/.test(behind)) { behind = st(block).backgroundColor; block = block.parentElement; }
    const svg = fig.querySelector('.main-svg');
    return {svg: st(svg).backgroundColor, behind, plotArea: [...fig.querySelectorAll('rect.bg')].map(r => st(r).fill),
            texts: [...fig.querySelectorAll('text')].filter(t => t.textContent.trim()).map(t => [t.textContent, st(t).fill])};
}"""


@pytest.mark.parametrize("theme", ["dark", "light"])
def test_plotly_figures_take_the_theme(browser, server, theme):  # noqa: F811
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    try:
        pg.goto(f"{server}?__theme={theme}")
        pg.get_by_role("tab", name="γ sweep").click()  # the shipped sweep's figure
        pg.locator("#gamma-plot .js-plotly-plot .main-svg").first.wait_for(timeout=PAGE_WAIT_MS)
        assert pg.evaluate("document.body.classList.contains('dark')") == (theme == "dark")
        c = pg.evaluate(COLOURS, "#gamma-plot .js-plotly-plot")
        behind = c["behind"]
        assert len(c["texts"]) >= 3
        if theme == "dark":
            assert _luminance(_rgb(behind)) < 0.05
            for colour in [c["svg"]] + c["plotArea"]:  # no white box: clear, so the dark block shows through
                assert "rgba" in colour and colour.replace(" ", "").endswith(",0)"), colour
        for text, fill in c["texts"]:
            assert contrast(fill, behind) >= 4.5, (text, fill, behind)
        pg.locator("#gamma-plot").screenshot(path=str(ARTIFACTS / f"gamma-plot-{theme}.png"))
    finally:
        context.close()
