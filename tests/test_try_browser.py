"""The "Try your own image" tab as a person sees it, in headless Chromium on the launched app, at a
phone's (390 × 844), a projector's (1280 × 720) and a desktop's (1400 × 1000) size: what is read off
the page (positions, computed styles, text, canvas pixels) is checked against what the handler and
the shipped calibration say. One page per size is shared by the tests of that size, in this file's
order, so that each picture shown follows others, as it does for a visitor. Screenshots go to
test-artifacts/."""
import html
import json
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image

from test_browser import ARTIFACTS, CHROMIUM, boxes_overlap, browser, open_app  # noqa: F401 - browser: a fixture
from nctv.ui import caches, try_image
from nctv.ui.shipped import load_precomputed
from conftest import PAGE_WAIT_MS

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}")]
SIZES = [(390, 844), (1280, 720), (1400, 1000)]

#: Every visible piece of text in ``root`` as the boxes of its lines ({node, text, x, y, width, height}).
TEXT_BOXES = """root => {
  const out = [], walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  let node, i = 0;
  while ((node = walker.nextNode())) {
    const text = node.textContent.trim();
    const parent = node.parentElement;
    if (!text || parent.closest('[aria-hidden=true]')
        || !parent.checkVisibility({ opacityProperty: true, visibilityProperty: true })) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    for (const b of range.getClientRects())
      if (b.width > 0.5 && b.height > 0.5) out.push({ node: i, text: text.slice(0, 40), x: b.x, y: b.y, width: b.width, height: b.height });
    i++;
  }
  return out;
}"""
CANVAS = "c => Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data)"


def open_try(browser, url, width, height):
    pg = open_app(browser, url, width, height, phone=width < 500)
    pg.get_by_role("tab", name="Try your own image").click()
    pg.wait_for_selector("#try-chart .nctv-class")
    pg.wait_for_selector("#try-delta canvas")
    return pg


def shot(pg, name):
    pg.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def upload(pg, path, wait_for: str):
    pg.locator("#try-image input[type=file]").set_input_files(str(path))
    pg.wait_for_function(wait_for, timeout=PAGE_WAIT_MS)


def shown_chart(pg) -> dict[str, dict[str, str]]:
    """{class: {method: the percentage shown}} read off the chart."""
    out = {}
    for row in pg.locator("#try-chart .nctv-class").all():
        bars = row.locator(".nctv-bar").all()
        out[row.locator(".nctv-class-name").inner_text()] = {
            b.get_attribute("data-method"): b.locator(".nctv-value").inner_text() for b in bars}
    return out


def shrink(box, by=1.0):
    return dict(x=box["x"] + by, y=box["y"] + by, width=box["width"] - 2 * by, height=box["height"] - 2 * by)


def text_overlaps(boxes: list[dict]) -> list[tuple[str, str]]:
    """The pairs of pieces of text (of :data:`TEXT_BOXES`) drawn over each other, beyond a pixel's slack."""
    return [(a["text"], b["text"]) for i, a in enumerate(boxes) for b in boxes[i + 1:]
            if a["node"] != b["node"] and boxes_overlap(shrink(a), shrink(b))]


def page_per_size(name: str, open_page):
    """A module fixture ``name``: one page per size (its parameter: width, height, …), opened by
    ``open_page(browser, url, *size)`` and shared by the tests of that size, in their order in the module.
    Tests take it with :func:`by_size`."""
    @pytest.fixture(scope="module", name=name)
    def shared(browser, server, request):  # noqa: F811 - browser: the module's fixture
        pg = open_page(browser, server, *request.param)
        yield pg
        pg.context.close()
    return shared


def by_size(name: str, sizes):
    """Parametrise a test by the shared page ``name`` (:func:`page_per_size`) at each of ``sizes``."""
    return pytest.mark.parametrize(name, sizes, indirect=True, ids=[f"{s[0]}x{s[1]}" for s in sizes])


try_page = page_per_size("try_page", open_try)


@by_size("try_page", SIZES)
def test_the_tab_reads_at_every_size(try_page):
    pg, width = try_page, try_page.viewport_size["width"]
    panel = pg.locator("#try-chart").locator("xpath=ancestor::*[@role='tabpanel'][1]")
    boxes = panel.evaluate(TEXT_BOXES)
    assert len(boxes) > 50
    assert text_overlaps(boxes) == [], f"texts drawn over each other at {width} px"
    names = pg.locator("#try-chart .nctv-class-name").all()
    assert len(names) >= 5
    for name in names:  # each class name whole, on one line
        line = float(name.evaluate("e => parseFloat(getComputedStyle(e).lineHeight)"))
        assert name.bounding_box()["height"] < 1.5 * line, name.inner_text()
        assert name.evaluate("e => e.scrollWidth <= e.clientWidth"), f"{name.inner_text()} is cut off"
    verdict = pg.locator("#try-verdict .nctv-verdict").bounding_box()
    first_class = pg.locator("#try-chart .nctv-class").first.bounding_box()
    assert verdict["y"] + verdict["height"] <= first_class["y"]
    picture = pg.locator("#try-image").bounding_box()
    examples = pg.get_by_text("Or pick a shipped example").bounding_box()
    if width < 500:  # stacked in reading order: the picture, its verdict, and only then the examples
        assert picture["y"] + picture["height"] <= verdict["y"] < examples["y"]
    else:  # side by side: the verdict beside the picture, at its height
        assert verdict["x"] >= picture["x"] + picture["width"] and verdict["y"] < picture["y"] + picture["height"]
    for element in ("#try-verdict", "#try-chart", "#try-delta", "#try-note"):  # nothing sticks out sideways
        box = pg.locator(element).bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= width + 0.5, element
    captions = pg.locator("#try-delta figcaption").all()
    canvases = pg.locator("#try-delta canvas").all()
    assert len(captions) == len(canvases) == 3
    for caption, canvas in zip(captions, canvases):  # each picture under its own title
        c, v = caption.bounding_box(), canvas.bounding_box()
        assert c["y"] + c["height"] <= v["y"] + 0.5 and abs(c["x"] - v["x"]) < 1 and v["width"] >= 100
    shot(pg, f"try-{width}")


@by_size("try_page", [(1400, 1000)])
def test_percentages_are_the_handlers_to_one_decimal(try_page):
    example = try_image.example_images()[5]
    _, chart, _, _ = try_image.classify(example, None)  # the handler, run here on the same picture
    expected = {html.unescape(part.split('"', 1)[0]): dict(re.findall(r'data-method="(\w+)" data-confidence="([^"]+)"', part))
                for part in chart.split('<div class="nctv-class" data-class="')[1:]}
    assert len(expected) >= 5 and all(len(v) == 3 for v in expected.values())
    pg = try_page
    pg.locator("#try-chart .nctv-chart").evaluate("e => { e.dataset.old = 'yes'; }")
    upload(pg, example, "document.querySelector('#try-chart .nctv-chart:not([data-old])') !== null")
    shown = shown_chart(pg)
    assert set(shown) == set(expected), shown
    for cls, methods in expected.items():
        for method, p in methods.items():
            assert shown[cls][method] == try_image.percent(float(p)), (cls, method)
            number = re.search(r"\d+\.\d", shown[cls][method]).group()
            assert abs(float(number) - 100 * float(p)) <= 0.05 + 1e-9 or shown[cls][method][0] in "<>"


def _gradient(path):
    yy, xx = np.mgrid[0:240, 0:320] / 240.0  # a colourful photo-like gradient, nothing like clothing on black
    picture = np.stack([np.sin(3 * xx) * 0.5 + 0.5, yy, np.cos(2 * xx * yy) * 0.5 + 0.5], axis=-1)
    Image.fromarray((255 * picture).astype("uint8")).save(path)
    return path


#: The elements of the chart drawn faded (opacity under 0.8, a bar's tag is at 0.8) or greyed (a filter),
#: with ``root`` and what holds it.
FADED = """root => { const out = [];
  for (let e = root.querySelector('.nctv-chart'); e; e = e.parentElement) out.push(e);
  return [...out, ...root.querySelectorAll('.nctv-chart *')].map(e => [e.className, getComputedStyle(e).opacity,
    getComputedStyle(e).filter]).filter(([, o, f]) => Number(o) < 0.8 || f !== 'none'); }"""


@by_size("try_page", [(390, 844), (1280, 720)])
def test_a_foreign_picture_marks_its_answer_under_the_warning(try_page, tmp_path):
    pg, width = try_page, try_page.viewport_size["width"]
    assert pg.locator("#try-verdict [data-flagged]").get_attribute("data-flagged") == "false"
    assert pg.locator("#try-chart .nctv-flag").count() == 0
    upload(pg, _gradient(tmp_path / "sunset.png"),
           "document.querySelector('#try-note').innerText.includes('320 × 240')")
    verdict = pg.locator("#try-verdict .nctv-verdict")
    assert verdict.get_attribute("data-flagged") == "true"
    assert try_image.MEANS_LITTLE in verdict.inner_text()
    # The answer is marked in words, not greyed out (tests/test_readable_browser.py measures its contrast).
    answer = pg.locator("#try-chart .nctv-answer")
    assert try_image.FLAGGED_ANSWER in answer.inner_text()
    pg.wait_for_timeout(1000)  # Gradio's fade of an updating output is over
    assert pg.locator("#try-chart").evaluate(FADED) == []
    assert verdict.bounding_box()["y"] + verdict.bounding_box()["height"] <= answer.bounding_box()["y"]
    shot(pg, f"try-foreign-{width}")


def delta_sent(pg, root: str) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The pixels (0–255) and δ (0–255 levels) the server sent to the δ view ``root``, and its height and width."""
    view = pg.locator(f"{root} .nctv-delta")
    return (np.array(json.loads(view.get_attribute("data-input"))), np.array(json.loads(view.get_attribute("data-delta"))),
            int(view.get_attribute("data-height")), int(view.get_attribute("data-width")))


def assert_delta_painted(pg, root: str, shots: str = "") -> None:
    """The δ view ``root`` of a grey model: at each amplification k and blend t its three canvases hold the
    picture, picture + t · k · δ and mid-grey + k · δ, rounded and clipped to 0–255, as computed here from
    the arrays the server sent; ``shots``: a name for the screenshot at ×50."""
    x, d, h, w = delta_sent(pg, root)

    def grey(panel):  # a canvas's pixels; the model is grey, so red = green = blue
        rgba = np.array(pg.locator(f"{root} canvas[data-panel={panel}]").evaluate(CANVAS)).reshape(h * w, 4)
        assert (rgba[:, 0] == rgba[:, 1]).all() and (rgba[:, 1] == rgba[:, 2]).all() and (rgba[:, 3] == 255).all()
        return rgba[:, 0].astype(float)

    assert np.abs(grey("input") - np.clip(np.round(x), 0, 255)).max() <= 1
    for k in (10, 50, 1):
        pg.locator(f"{root} .nctv-amplify input[value='{k}']").check()
        pg.wait_for_function(f"document.querySelector('{root} [data-caption=blend]').textContent.endsWith('× {k}')")
        assert np.abs(grey("blend") - np.clip(np.round(x + k * d), 0, 255)).max() <= 1, k
        assert np.abs(grey("change") - np.clip(np.round(128 + k * d), 0, 255)).max() <= 1, k
        inside = (x + k * d > 1) & (x + k * d < 254)
        assert np.abs((grey("blend") - grey("input"))[inside] - k * d[inside]).max() <= 1.5  # the factor k
        if k == 50 and shots:
            pg.locator(root).screenshot(path=str(ARTIFACTS / f"{shots}.png"))
    pg.locator(f"{root} .nctv-amplify input[value='50']").check()
    slider = pg.locator(f"{root} .nctv-blend input")
    slider.evaluate("e => { e.value = '0.5'; e.dispatchEvent(new Event('input', { bubbles: true })); }")
    assert np.abs(grey("blend") - np.clip(np.round(x + 0.5 * 50 * d), 0, 255)).max() <= 1
    assert pg.locator(f"{root} [data-caption=blend]").inner_text() == "Picture + 0.5 × δ × 50"
    slider.evaluate("e => { e.value = '0'; e.dispatchEvent(new Event('input', { bubbles: true })); }")
    assert np.abs(grey("blend") - grey("input")).max() == 0
    # Back to δ's true size, fully blended in.
    slider.evaluate("e => { e.value = '1'; e.dispatchEvent(new Event('input', { bubbles: true })); }")
    pg.locator(f"{root} .nctv-amplify input[value='1']").check()


@by_size("try_page", SIZES)
def test_amplifying_and_blending_delta_redraws_the_canvases_exactly(try_page):
    pg = try_page
    cal = load_precomputed().calibration
    loaded = caches.get_model(cal.model)
    std = torch.tensor(loaded.data_config["std"], dtype=torch.float64).reshape(-1, 1, 1)
    own = (255 * cal.delta.double() * std).numpy().ravel()  # δ in 0–255 levels, from the shipped file
    view = pg.locator("#try-delta .nctv-delta")
    _, d, _, _ = delta_sent(pg, "#try-delta")
    np.testing.assert_allclose(d, own, atol=1e-4)  # the page got the calibration's δ
    assert float(view.get_attribute("data-largest")) == pytest.approx(np.abs(own).max())
    assert_delta_painted(pg, "#try-delta", f"try-delta-x50-{pg.viewport_size['width']}")
    assert "δ" in pg.locator("#try-delta .nctv-delta-sentence").inner_text()
    assert "grey levels" in pg.locator("#try-delta .nctv-delta-sentence").inner_text()
    # The shared viewer (nctv.ui.delta) names the visitor's picture, and its buttons form a group of their own.
    h, w = (view.get_attribute(f"data-{a}") for a in ("height", "width"))
    assert pg.locator("#try-delta figcaption").first.inner_text().replace("\xa0", " ") == \
        f"Your picture as the model gets it ({w} × {h})"
    names = pg.locator("#try-delta .nctv-amplify input").evaluate_all("rs => rs.map(r => r.name)")
    assert names == [try_image.DELTA_GROUP] * 3


@by_size("try_page", SIZES)
def test_a_file_that_is_no_picture_clears_the_result_with_one_message(try_page, tmp_path):
    pg = try_page
    assert pg.locator("#try-chart .nctv-class").count() > 0 and pg.locator("#try-delta canvas").count() == 3
    fake = tmp_path / "holiday.png"
    fake.write_text("this is a text file with a picture's name")
    pg.locator("#try-image input[type=file]").set_input_files(str(fake))
    pg.wait_for_selector(".toast-body")
    pg.wait_for_function("document.querySelector('#try-chart .nctv-class') === null", timeout=PAGE_WAIT_MS)
    pg.wait_for_timeout(1500)  # a second message, if one came, would be here by now
    toasts = pg.locator(".toast-body")
    assert toasts.count() == 1
    message = "is not an image this app can read"
    assert toasts.first.inner_text().count(message) == 1
    assert message not in pg.locator("#try-verdict").inner_text()  # said once, in the toast
    assert pg.locator("#try-verdict").inner_text().strip() == try_image.HINT
    assert pg.locator("#try-delta canvas").count() == 0 and pg.locator("#try-note").inner_text().strip() == ""
    assert pg.locator("#try-image img").count() == 0  # no broken preview of the file
    shot(pg, f"try-not-a-picture-{pg.viewport_size['width']}")
    # The tab still works: the next picture is classified as usual.
    upload(pg, try_image.example_images()[1], "document.querySelector('#try-chart .nctv-class') !== null")


def test_loaded_calibrators_reach_the_learn_tab(browser, server, tmp_path):
    """A calibrators.zip whose temperature-scaling T differs from the shipped one: once loaded in the Try
    tab, the Learn tab's "temperature-scaling fit" is that T, without a new run."""
    import shutil
    import zipfile

    from nctv.data import assets_dir

    shipped = assets_dir() / "precomputed" / "calibrators"
    folder = tmp_path / "calibrators"
    for name in ("neural-clamping-fl", "temperature-scaling"):
        shutil.copytree(shipped / name, folder / name)
    config_path = folder / "temperature-scaling" / "config.json"
    config = json.loads(config_path.read_text())
    assert abs(config["fitted"]["temperature_"] - 2.5) > 0.1  # so that the check below can tell them apart
    config["fitted"]["temperature_"] = 2.5
    config_path.write_text(json.dumps(config))
    archive = tmp_path / "calibrators.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                z.write(f, f.relative_to(folder))
    pg = open_try(browser, server, 1280, 720)
    try:
        pg.get_by_role("tab", name="Learn").click()  # the page has the shipped calibration first
        pg.wait_for_function("document.querySelector('#learn-ece').textContent.includes('%')", timeout=PAGE_WAIT_MS)
        pg.get_by_role("tab", name="Try your own image").click()
        pg.locator("#try-load-calibrator input[type=file], input[type=file][accept*='.zip']").first.set_input_files(
            str(archive))
        pg.wait_for_function("document.querySelector('#try-loaded').innerText.includes('T = 2.500')", timeout=PAGE_WAIT_MS)
        pg.get_by_role("tab", name="Learn").click()
        pg.wait_for_timeout(500)
        pg.click("#learn-fit")
        pg.wait_for_function("document.querySelector('#learn-message').textContent.includes('2.50')", timeout=PAGE_WAIT_MS)
        assert float(pg.locator("#learn-t-box").input_value()) == pytest.approx(2.5, abs=0.005)
    finally:
        pg.context.close()
