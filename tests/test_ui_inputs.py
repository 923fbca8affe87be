"""The app's inputs refuse what they cannot take in the app's words, and pass every good value on
exactly as Gradio's own components do."""
import gradio as gr
import pytest

from nctv.ui.inputs import (CheckedCheckboxGroup, CheckedDropdown, CheckedNumber, CheckedRadio, CheckedSlider,
                             CheckedTextbox, CheckedTypedDropdown)


@pytest.fixture(scope="module")
def inputs():
    with gr.Blocks():
        checked = dict(size=CheckedNumber(5000, precision=0, label="Calibration size"),
                       step=CheckedNumber(0.1, label="γ step"),
                       bins=CheckedSlider(5, 50, 15, step=1, label="Bins"),
                       fitter=CheckedRadio(["fast", "paper"], value="fast", label="Fitter"),
                       model=CheckedDropdown(["m1", "m2"], value="m1", label="Model"),
                       methods=CheckedCheckboxGroup(["TS", "NC"], value=["TS"], label="Methods"),
                       hub_id=CheckedTextbox(label="Hub id"),
                       dataset=CheckedTypedDropdown(["d1"], value="d1", allow_custom_value=True, label="Dataset"))
        plain = dict(size=gr.Number(5000, precision=0), step=gr.Number(0.1), bins=gr.Slider(5, 50, 15, step=1),
                     fitter=gr.Radio(["fast", "paper"], value="fast"), model=gr.Dropdown(["m1", "m2"], value="m1"),
                     methods=gr.CheckboxGroup(["TS", "NC"], value=["TS"]), hub_id=gr.Textbox(),
                     dataset=gr.Dropdown(["d1"], value="d1", allow_custom_value=True))
    return checked, plain


def test_the_browser_draws_them_as_gradio_components(inputs):
    checked, plain = inputs
    for name in checked:
        assert checked[name].get_block_name() == plain[name].get_block_name() == type(plain[name]).__name__.lower()
        assert checked[name].get_block_class() == plain[name].get_block_class()


@pytest.mark.parametrize("name, good", [("size", 1234.0), ("step", 0.25), ("bins", 20), ("fitter", "paper"),
                                        ("model", "m2"), ("methods", ["NC", "TS"]), ("size", 20.0),
                                        ("hub_id", "timm/x"), ("hub_id", 5), ("dataset", "hf-dataset:a/b")])
def test_good_values_pass_as_gradio_passes_them(inputs, name, good):
    checked, plain = inputs
    assert checked[name].preprocess(good) == plain[name].preprocess(good)


@pytest.mark.parametrize("name, bad, message", [
    ("size", "abc", "Calibration size must be a whole number; got 'abc'."),
    ("step", [1], "γ step must be a number; got [1]."),
    ("bins", "zz", "Bins must be a whole number from 5 to 50; got 'zz'."),
    ("bins", 1e9, "Bins must be a whole number from 5 to 50; got 1000000000.0."),
    ("fitter", "slow", "Fitter must be one of: fast, paper; got 'slow'."),
    ("model", "m" * 5000, "Model must be one of: m1, m2; got '" + "m" * 80 + "'…."),
    ("methods", ["XX"], "Methods must be one of: TS, NC; got ['XX']."),
    ("size", 1.5, "Calibration size must be a whole number; got 1.5."),  # Gradio's rounds it to 2
    ("bins", 7.5, "Bins must be a whole number from 5 to 50; got 7.5."),
    ("hub_id", ["a"], "Hub id must be text; got ['a']."),  # Gradio's passes on "['a']"
    ("dataset", {"a": 1}, "Dataset must be text; got {'a': 1}."),  # Gradio's passes on the dict
])
def test_bad_values_get_the_apps_sentence(inputs, name, bad, message):
    """(Gradio's own components refuse these in their words, or, a number without a precision given
    a list, pass it on to the handler.)"""
    checked, plain = inputs
    with pytest.raises(gr.Error) as e:
        checked[name].preprocess(bad)
    assert e.value.message == message
