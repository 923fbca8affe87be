"""Links that open a view (nctv.ui.links) and the Learn page's words and lesson (nctv.ui.learn.page_words,
nctv.ui.lesson): each value of a link is read with the readers of a typed value, a bad one is named and
ignored, and the page gets the words of the table, the explanations and the lesson with the
calibration's own numbers written in. The browser side is tests/test_lesson_browser.py."""
import gradio as gr
import pytest
from starlette.requests import Request

from nctv.checks import read_number
from nctv.ui import learn, lesson, links
from nctv.ui.shipped import load_precomputed


def read(query: str) -> links.Link:
    """The link of a page address's query string, read as the server reads a real request's."""
    return links.read_link(links._query(gr.Request(request=Request({"type": "http", "query_string": query.encode()}))))


def test_the_lecture_link_opens_learn_in_presenter_mode():
    link = read("tab=learn&t=1.5&bins=10&presenter=1")
    assert (link.tab, link.t, link.bins, link.presenter, link.problems) == ("learn", 1.5, 10, True, ())
    assert link.view() == {"t": 1.5, "bins": 10, "presenter": True}
    # Learn's parameters alone open Learn; Gradio's own theme parameter is left to Gradio.
    assert read("step=3&bin=15&__theme=dark") == links.Link(tab="learn", step=3, bin=15)
    assert read("tab=gamma&model=fmnist-resnet") == links.Link(tab="gamma", model="fmnist-resnet")
    assert read("") == links.Link()


@pytest.mark.parametrize("typed", ["1.5", " 1.5 ", "1.50", "15e-1", "+1.5"])
def test_t_is_read_as_a_typed_number_is(typed):
    assert read_number(typed) == 1.5 and read(f"t={typed.replace('+', '%2B')}").t == 1.5


@pytest.mark.parametrize("query, words", [
    ("t=abc", "t = 'abc' is not a temperature from 0.05 to 5"),
    ("t=9", "t = '9' is not a temperature from 0.05 to 5"),
    ("t=0.01", "t = '0.01' is not a temperature"),
    ("t=nan", "t = 'nan' is not a temperature"),
    ("bins=99", "bins must be at least 5 and at most 50; got 99"),
    ("bins=10.5", "bins must be a whole number; got '10.5'"),
    ("step=9", "step must be at least 1 and at most 7; got 9"),
    ("step=0", "step must be at least 1"),
    ("bin=16", "bin must be at least 1 and at most 15; got 16"),
    ("bins=10&bin=11", "bin must be at least 1 and at most 10; got 11"),
    ("presenter=maybe", "presenter = 'maybe' is not 1 or 0"),
    ("tab=results", "tab = 'results' is not a tab (they are calibrate, gamma, init, try, learn, shift)"),
    ("model=resnet9000", "model = 'resnet9000' is not a model of the menu (fmnist-resnet-overconfident"),
    ("foo=1", "'foo' is not a part of a link (they are tab, model, t, bins, presenter, step, bin)"),
    ("t=1&t=2", "t is given 2 times"),
    ("tab=calibrate&presenter=1", "presenter mode is the Learn tab's; this link opens calibrate"),
])
def test_a_bad_value_is_named_and_ignored(query, words):
    link = read(query)
    assert len(link.problems) == 1 and words in link.problems[0], link.problems
    assert link.view() == {} or link.view().keys() <= {"bins"}  # only a good bins of the same link stays
    assert words in links.note(link) and links.note(link).startswith("**Part of this link was ignored**")


def test_the_good_values_of_a_half_bad_link_are_kept():
    link = read("tab=learn&t=2&bins=abc&presenter=yes&step=4&x=1")
    assert (link.tab, link.t, link.bins, link.presenter, link.step) == ("learn", 2.0, None, True, 4)
    assert len(link.problems) == 2 and links.note(read("tab=learn")) == ""


def test_the_load_event_and_learns_data_follow_the_address():
    request = gr.Request(request=Request({"type": "http", "query_string": b"tab=learn&t=2.5&model=fmnist-vit&q=1"}))
    tabs, model, note = links.open_link(request)
    assert tabs["selected"] == "learn" and model["value"] == "fmnist-vit" and "'q' is not a part" in note["value"]
    data = links.learn_data(None, request)
    assert data["link"] == {"t": 2.5} and data["n"] == 10_000
    plain = gr.Request(request=Request({"type": "http", "query_string": b""}))
    assert all(isinstance(o, type(gr.skip())) for o in links.open_link(plain))


def test_the_pages_words_carry_the_calibrations_numbers():
    pre = load_precomputed()
    cal, k = pre.calibration, 10
    words = learn.page_words(cal, 10_000, 10_000, k)
    assert [c[1] for c in words["columns"]] == ["Accuracy (%) ↑", "Entropy", "ECE (%) ↓", "AECE (%) ↓", "SCE (×10⁻²) ↓"]
    assert words["rows"] == [["one", "T = 1 (uncalibrated)"], ["now", "T = {t} (slider)"],
                             ["fit", f"T = {cal.ts_temperature:.3f} (temperature scaling)"]]
    assert words["note"] == "{bins} bins; test split." and words["formats"]["now.sce"] == (100.0, 4)
    assert "<h3>What the numbers mean</h3>" in words["text"] and "<strong>{now.ece}%</strong>" in words["text"]
    assert "the 10,000 test predictions" in words["text"] and "**" not in words["text"]
    sampled = learn.page_words(cal, 2_500, 10_000, k)
    assert sampled["note"] == "{bins} bins; a seeded sample of 2,500 of the test split's 10,000 pictures."
    steps = words["lesson"]
    assert [s["title"] for s in steps] == [s.title for s in lesson.STEPS] and 6 <= len(steps) <= 8
    assert [s["t"] for s in steps] == ["fit", "one", "one", 2.0, "one", "fit", "fit"]
    assert steps[2]["group"] == "fullest" and all(s["bins"] == cal.n_bins for s in steps)
    # The run's own figures: its interval of the uncalibrated ECE, Neural Clamping's T and ECE.
    u, nc = pre.result.methods["Uncalibrated"].metrics[15]["ece"], pre.result.methods[cal.nc_method].metrics[15]["ece"]
    assert f"[{100 * u.ci_low:.2f}, {100 * u.ci_high:.2f}]%" in steps[4]["text"]
    assert f"learned T = {cal.nc_temperature:.3f}" in steps[5]["text"] and f"{100 * nc.mean:.2f}%" in steps[5]["text"]
    assert f"T = {cal.ts_temperature:.3f}" in steps[0]["text"] and "{now.ece}" in steps[0]["text"]


def test_text_reaches_the_page_escaped():
    html = learn.blocks_html([("h", "a <b> & c"), ("p", "**bold <i>** and *it*")])
    assert html == "<h3>a &lt;b&gt; &amp; c</h3><p><strong>bold &lt;i&gt;</strong> and <em>it</em></p>"


def test_numbers_are_written_as_the_tables_write_them():
    assert learn.number(312.5, 0) == "312" and learn.number(313.5, 0) == "314"  # halves to even, as the page
    assert learn.number(0.125, 2) == "0.12" and learn.number(1234.5678, 2) == "1,234.57"
    assert learn.number(-0.001, 2) == "0.00" and learn.number(-1.5, 1) == "-1.5"
    assert learn.fill("{t} and {now.ece}", {"t": "1.50"}, partial=True) == "1.50 and {now.ece}"
    with pytest.raises(KeyError):
        learn.fill("{t} and {now.ece}", {"t": "1.50"})
