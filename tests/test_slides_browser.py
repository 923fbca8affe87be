"""The "Download this figure for slides" controls in headless Chromium, against the launched app at a
projector's size (1280 × 720): Learn's at the T and bins on screen, Shift's at the condition on screen,
Try's of the picture's confidences. Each gives a PNG of 1920 × 1080, an SVG and a PDF of what is on
screen: Learn's slides.tex holds the ECE that nctv.metrics gives on the shipped logits file at the T
and bins set, Shift's figures are those of the condition shown (tests/test_slides.py checks the
handlers' numbers)."""
import io
import os
from urllib.parse import urljoin

import pytest
from PIL import Image
from safetensors.torch import load_file
from test_browser import CHROMIUM, browser, open_app  # noqa: F401 - browser: a fixture
from test_learn_browser import set_range

from nctv import metrics
from nctv.ui.shipped import precomputed_dir
from conftest import PAGE_WAIT_MS

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}")]


@pytest.fixture(scope="module")
def page(browser, server):  # noqa: F811 - the fixture's value
    pg = open_app(browser, server, 1280, 720)
    yield pg
    pg.context.close()


def download(pg, name: str) -> dict[str, bytes]:
    """Press the ``name`` tab's control; the files it lists, by name, fetched as a visitor would."""
    files = pg.locator(f"#{name}-slides-files")
    pg.locator(f"#{name}-slides-button").click()
    files.locator("a").first.wait_for(timeout=PAGE_WAIT_MS)
    out = {}
    for link in files.locator("a").all():
        href = link.get_attribute("href")
        out[href.rsplit("/", 1)[-1].split("?")[0]] = pg.request.get(urljoin(pg.url, href)).body()
    return out


def assert_slide_files(got: dict[str, bytes], stem: str) -> None:
    assert {f"{stem}.png", f"{stem}.svg", f"{stem}.pdf"} <= set(got), sorted(got)
    assert Image.open(io.BytesIO(got[f"{stem}.png"])).size == (1920, 1080)
    assert got[f"{stem}.pdf"].startswith(b"%PDF") and b"<svg" in got[f"{stem}.svg"][:2000]


def test_learn_gives_the_view_on_screen(page):
    page.get_by_role("tab", name="Learn").click()
    page.wait_for_selector("#learn-plot svg")
    page.fill("#learn-t-box", "1.5")
    page.press("#learn-t-box", "Enter")
    set_range(page, "#learn-bins", 10)
    page.wait_for_function("document.querySelector('#learn-view [data-temperature]').dataset.bins === '10'")
    got = download(page, "learn")
    assert_slide_files(got, "learn_T1.50_10bins")
    tensors = load_file(str(precomputed_dir() / "test_logits.safetensors"))
    z, y = tensors["Uncalibrated"].double(), tensors["labels"]
    tex = got["slides.tex"].decode()
    row = next(line for line in tex.splitlines() if line.startswith("T = 1.50 (on screen)"))
    cells = [c.strip() for c in row.rstrip("\\ ").split("&")]
    assert cells[3] == f"{100 * metrics.ece(z / 1.5, y, 10):.2f}"  # Accuracy, Entropy, then ECE (%)


def test_shift_gives_the_condition_on_screen(page):
    page.get_by_role("tab", name="Shift").click()
    page.wait_for_selector("#shift-diagrams .ns-card svg")
    page.select_option("#shift-corruption", "contrast")
    set_range(page, "#shift-severity", 3)
    page.wait_for_function("document.querySelector('.ns').dataset.condition === 'contrast/3'")
    got = download(page, "shift")
    assert_slide_files(got, "shift_contrast-3_curves")
    assert_slide_files(got, "shift_contrast-3_diagrams")


def test_try_gives_the_pictures_confidences(page):
    page.get_by_role("tab", name="Try your own image").click()
    page.wait_for_selector("#try-chart .nctv-bar")
    shown = page.eval_on_selector_all("#try-chart .nctv-bar", "bars => bars.map(b => Number(b.dataset.confidence))")
    got = download(page, "try")
    assert len(shown) >= 3  # a row per class, a bar per way of scoring
    assert_slide_files(got, "confidence")
