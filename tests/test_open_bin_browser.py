"""Opening a group of the Learn tab's diagram in headless Chromium, against the launched app: the
header's count and accuracy equal numpy's on the shipped logits, wrong predictions come first with
the data's labels, the keyboard opens and Escape closes, and a phone shows the pictures without
sideways scrolling. Screenshots go to test-artifacts/."""
import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file
from test_browser import CHROMIUM, browser, open_app  # noqa: F401 - browser: the shared fixture
from test_learn_browser import open_learn, save_small

from nctv.data import FASHION_MNIST_CLASSES
from nctv.ui import caches, learn, shipped

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"needs Debian's Chromium at {CHROMIUM}"),
]
BINS = 15


@pytest.fixture(scope="module")
def top_group():
    """The top non-empty group at T = 1 and 15 bins, computed with numpy from the shipped file: the
    rows in it, which are right, and the confidences."""
    tensors = load_file(str(shipped.precomputed_dir() / "test_logits.safetensors"))
    z, y = tensors["Uncalibrated"].astype(np.float64), tensors["labels"]
    # The page gets every row when the split fits (it does: 10,000 × 10 logits), so the groups are the split's.
    assert z.size <= learn.PAGE_MAX_VALUES
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    conf, pred = p.max(axis=1), p.argmax(axis=1)
    # Group m holds confidences in ((m-1)/M, m/M], confidence 0 in the first.
    group = np.clip(np.searchsorted(np.linspace(0, 1, BINS + 1), conf, side="left") - 1, 0, BINS - 1)
    top = group.max()
    rows = np.flatnonzero(group == top)
    return {"bin": int(top), "rows": rows, "conf": conf, "pred": pred, "labels": y, "right": pred == y, "group": group}


def items(page) -> list[dict]:
    return page.evaluate("""() => [...document.querySelectorAll('#learn-bin-list li')].map(li => ({
        row: Number(li.dataset.row), wrong: li.classList.contains('nd-pic--wrong'),
        text: [...li.querySelectorAll('dt, dd')].map(e => e.textContent),
        src: li.querySelector('img').src, width: li.querySelector('img').naturalWidth,
        rendering: getComputedStyle(li.querySelector('img')).imageRendering}))""")


def sure(c: float) -> str:
    """A confidence as the panel writes it: two decimals, or ">99.99%" when it only rounds to 100%."""
    return ">99.99%" if c < 1 and 100 * c >= 99.995 else f"{100 * c:.2f}%"


def wait_for_pictures(page) -> None:
    page.wait_for_function("document.querySelectorAll('#learn-bin-list li').length > 0")


def test_top_group_opens_with_its_count_accuracy_and_wrong_pictures_first(browser, server, top_group):  # noqa: F811
    g = top_group
    pg = open_learn(browser, server, 1400, 1000)
    try:
        assert pg.locator(".nl").get_attribute("data-bins") == str(BINS)
        pg.locator(f'#learn-plot .nd-hit[data-bin="{g["bin"]}"]').click()
        wait_for_pictures(pg)
        panel = pg.locator("#learn-bin")
        count, accuracy = len(g["rows"]), float(g["right"][g["rows"]].mean())
        assert int(panel.get_attribute("data-count")) == count
        assert float(panel.get_attribute("data-accuracy")) == pytest.approx(accuracy, abs=1e-12)
        low = f"{100 * g['bin'] / BINS:.1f}".rstrip("0").rstrip(".")
        assert pg.locator("#learn-bin-title").inner_text() == \
            f"Confidence {low}–100%: {count:,} pictures, {100 * accuracy:.1f}% right"
        shown = items(pg)
        assert len(shown) == min(24, count)
        assert pg.locator("#learn-bin-more").inner_text() == f"… and {count - len(shown):,} more in this group."
        # Wrong predictions first, surest first; every one in the group, with the data's labels.
        wrong = g["rows"][~g["right"][g["rows"]]]
        assert len(wrong) >= 1
        first = shown[:min(len(wrong), len(shown))]
        assert all(s["wrong"] for s in first)
        assert {s["row"] for s in shown} <= set(g["rows"].tolist())
        want = np.sort(g["conf"][wrong])[::-1][:len(first)]
        assert np.allclose([g["conf"][s["row"]] for s in first], want, rtol=0, atol=1e-15)
        for s in shown:
            row = s["row"]
            label, pred = FASHION_MNIST_CLASSES[g["labels"][row]], FASHION_MNIST_CLASSES[g["pred"][row]]
            assert s["text"] == ["Wrong" if s["wrong"] else "Right", "True", label, "Model", pred,
                                 "T = 1", sure(g["conf"][row]), "T = 1.00", sure(g["conf"][row])]
            assert s["wrong"] == (label != pred)
            assert s["width"] == 28 and s["rendering"] == "pixelated"
        # The thumbnail is the test picture itself.
        images = caches.get_splits(shipped.load_precomputed().split)[1].arrays()[0]
        png = base64.b64decode(shown[0]["src"].split(",", 1)[1])
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), images[shown[0]["row"]])
        pg.evaluate("document.activeElement.blur()")
        pg.mouse.move(0, 0)
        save_small(pg.locator("#learn-view").screenshot(), "learn-open-bin-1400.png")
        # One click closes it.
        pg.get_by_role("button", name="Close").click()
        assert pg.locator("#learn-bin").is_hidden()
    finally:
        pg.context.close()


def test_keyboard_opens_a_group_and_escape_closes_it(browser, server, top_group):  # noqa: F811
    pg = open_learn(browser, server, 1400, 1000)
    try:
        # The groups are buttons named by their range, count and accuracy.
        bar = pg.get_by_role("button", name="Open the group of confidence 93.3–100%")
        bar.focus()
        bar.press("Enter")
        wait_for_pictures(pg)
        assert int(pg.locator("#learn-bin").get_attribute("data-count")) == len(top_group["rows"])
        pg.keyboard.press("Escape")
        assert pg.locator("#learn-bin").is_hidden()
        # Focus goes back to the bar that opened the group.
        assert pg.evaluate("document.activeElement.dataset.bin") == str(top_group["bin"])
        # Two bars clicked in quick succession: the panel ends with the second's pictures.
        pg.evaluate("""() => { for (const b of [13, 14]) document.querySelector(`#learn-plot .nd-hit[data-bin="${b}"]`)
            .dispatchEvent(new MouseEvent('click', {bubbles: true})); }""")
        wait_for_pictures(pg)
        pg.wait_for_function("document.querySelector('#learn-bin-note').innerText.startsWith('Wrong predictions')")
        assert int(pg.locator("#learn-bin").get_attribute("data-count")) == len(top_group["rows"])
        assert {s["row"] for s in items(pg)} <= set(top_group["rows"].tolist())
        pg.get_by_role("button", name="Close").click()
        # At another T the group is opened at that T: confidences at T = 1 and at T both listed.
        box = pg.locator("#learn-t-box")
        box.fill("2")
        box.press("Enter")
        pg.locator('#learn-plot .nd-hit[data-bin="9"]').click()
        wait_for_pictures(pg)
        s = items(pg)[0]
        assert s["text"][5] == "T = 1" and s["text"][7] == "T = 2.00"
        t1, t2 = (float(v.strip(">%")) for v in (s["text"][6], s["text"][8]))
        assert 60 <= t2 <= 66.7 and t1 > t2  # the group 60–66.7% at T = 2; softer than T = 1
        # Once a new T settles, the opened group follows it (the same bar, at T = 1 now).
        box.fill("1")
        box.press("Enter")
        pg.wait_for_function("document.querySelector('#learn-bin-note').innerText.endsWith('at T = 1.00.')")
        assert int(pg.locator("#learn-bin").get_attribute("data-count")) == int((top_group["group"] == 9).sum())
        assert {s["row"] for s in items(pg)} <= set(np.flatnonzero(top_group["group"] == 9).tolist())
    finally:
        pg.context.close()


def test_phone_panel_stacks_under_the_diagram_without_overflow(browser, server, top_group):  # noqa: F811
    pg = open_app(browser, server, 390, 844, phone=True)
    try:
        pg.get_by_role("tab", name="Learn").click()
        pg.wait_for_selector("#learn-plot svg")
        pg.locator(f'#learn-plot .nd-hit[data-bin="{top_group["bin"]}"]').tap()
        wait_for_pictures(pg)
        boxes = pg.evaluate("""() => {
            const box = (e) => { const r = e.getBoundingClientRect();
                                 return {x: r.x, y: r.y, width: r.width, height: r.height}; };
            return {plot: box(document.querySelector('#learn-plot')), panel: box(document.querySelector('#learn-bin')),
                    title: box(document.querySelector('#learn-bin-title')),
                    pics: [...document.querySelectorAll('#learn-bin-list li')].map(box),
                    scroll: document.documentElement.scrollWidth, width: document.documentElement.clientWidth};
        }""")
        assert boxes["scroll"] <= boxes["width"] == 390
        assert boxes["panel"]["y"] >= boxes["plot"]["y"] + boxes["plot"]["height"] - 0.5
        for b in [boxes["panel"], boxes["title"], *boxes["pics"]]:
            assert b["x"] >= 0 and b["x"] + b["width"] <= 390.5, b
        # The pictures wrap: two to a row, row after row.
        rows = [round(b["y"]) for b in boxes["pics"]]
        assert rows[0] == rows[1] < rows[2] == rows[3]
        # The end of the diagram, with its opened bar, above the panel.
        pg.evaluate("document.querySelector('#learn-bin').scrollIntoView({block: 'start'}); window.scrollBy(0, -140)")
        save_small(pg.screenshot(), "learn-open-bin-390.png")
    finally:
        pg.context.close()


def test_presenter_mode_shows_the_group_in_large_type(browser, server, top_group):  # noqa: F811
    pg = open_learn(browser, server, 1280, 720)
    try:
        pg.click("#learn-presenter")
        pg.wait_for_function("document.querySelector('.nl').dataset.presenter === 'on'")
        pg.locator(f'#learn-plot .nd-hit[data-bin="{top_group["bin"]}"]').click()
        wait_for_pictures(pg)
        sizes = pg.evaluate("""() => [...document.querySelectorAll('#learn-bin-title, #learn-bin-note, #learn-bin dd')]
            .map(e => parseFloat(getComputedStyle(e).fontSize))""")
        assert min(sizes) >= 20, sizes
        # The panel is scrolled into the full-screen view.
        title = pg.locator("#learn-bin-title").bounding_box()
        assert 0 <= title["y"] and title["y"] + title["height"] <= 720
        # Escape closes the group first, then leaves presenter mode.
        pg.keyboard.press("Escape")
        assert pg.locator("#learn-bin").is_hidden() and pg.locator(".nl").get_attribute("data-presenter") == "on"
        pg.keyboard.press("Escape")
        assert pg.locator(".nl").get_attribute("data-presenter") == "off"
    finally:
        pg.context.close()
