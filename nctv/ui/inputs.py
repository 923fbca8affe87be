"""The app's inputs (menus, numbers, sliders) with the refusal of a value they cannot take in the
app's own words.

Gradio checks an input's value while preprocessing, before any handler runs. A value outside a
menu gets Gradio's own message, which repeats the whole value and its Python type; a number or a
slider sent text through the API fails inside Gradio with a Python error ("type str doesn't define
__round__ method"); a text box passes a list on as its Python text ("['a']"), and a menu that takes
typed values passes it on as a list (a handler then failed on it: "'list' object has no attribute
'strip'"); a whole-number box rounds 1.5 to 2. A visitor of a public copy may send anything; every refusal should read like
the app's other messages, name the setting, and repeat only the start of the value.
"""
from __future__ import annotations

from typing import Any

import gradio as gr

from nctv.checks import shown


class _OwnRefusal:
    """Re-words whatever the Gradio component refuses while preprocessing; every accepted value and
    every other behaviour is unchanged."""

    # Drawn by the browser exactly as the Gradio component it extends. (Gradio's own template
    # mechanism names a component after its first base class, which is this mixin here.)
    def get_block_name(self) -> str:
        return next(c for c in type(self).__mro__ if c.__module__.startswith("gradio.")).__name__.lower()

    get_block_class = get_block_name

    def expected(self) -> str:
        raise NotImplementedError

    def refusal(self, payload: Any) -> gr.Error:
        return gr.Error(f"{self.label or 'This setting'} must be {self.expected()}; got {shown(payload)}.",
                        print_exception=False)

    def preprocess(self, payload: Any) -> Any:  # noqa: D401 - Gradio hook
        try:
            return super().preprocess(payload)
        except (gr.Error, TypeError, ValueError, OverflowError):
            raise self.refusal(payload) from None


class _Menu(_OwnRefusal):
    def expected(self) -> str:
        names = ", ".join(str(value) for _, value in (self.choices or []))
        return "one of: " + (names if len(names) <= 300 else names[:300] + "…")


class CheckedDropdown(_Menu, gr.Dropdown):
    """``gr.Dropdown`` whose refusal of an unknown value is the app's own sentence."""


class CheckedRadio(_Menu, gr.Radio):
    """``gr.Radio`` whose refusal of an unknown value is the app's own sentence."""


class CheckedCheckboxGroup(_Menu, gr.CheckboxGroup):
    """``gr.CheckboxGroup`` whose refusal of an unknown value is the app's own sentence."""


class _Text(_OwnRefusal):
    """Takes text; a number is taken as its text (as Gradio's text box does), anything else is refused."""

    def expected(self) -> str:
        return "text"

    def preprocess(self, payload: Any) -> Any:  # noqa: D401 - Gradio hook
        if isinstance(payload, bool) or not isinstance(payload, (str, int, float, type(None))):
            raise self.refusal(payload)
        return super().preprocess(None if payload is None else str(payload))


class CheckedTextbox(_Text, gr.Textbox):
    """``gr.Textbox`` that refuses a list or an object in the app's words (Gradio's passes its Python text on)."""


class CheckedTypedDropdown(_Text, gr.Dropdown):
    """``gr.Dropdown`` with ``allow_custom_value``: its choices or typed text, refusing anything else
    in the app's words."""


def _whole(payload: Any) -> bool:
    return isinstance(payload, (int, float)) and not isinstance(payload, bool) and float(payload).is_integer()


class CheckedNumber(_OwnRefusal, gr.Number):
    """``gr.Number`` whose refusal of text or an out-of-range number is the app's own sentence.

    Without a precision Gradio passes any JSON value on unchanged (a list, a string); this one
    passes only numbers. With precision 0 it takes only whole numbers: Gradio's rounds 1.5 to 2."""

    def preprocess(self, payload: Any) -> Any:  # noqa: D401 - Gradio hook
        if self.precision == 0 and payload is not None and not _whole(payload):
            raise self.refusal(payload)
        value = super().preprocess(payload)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise self.refusal(payload)
        return value

    def expected(self) -> str:
        whole = "a whole number" if self.precision == 0 else "a number"
        if self.minimum is not None and self.maximum is not None:
            return f"{whole} from {self.minimum:g} to {self.maximum:g}"
        return whole


class CheckedSlider(_OwnRefusal, gr.Slider):
    """``gr.Slider`` whose refusal of text or a number outside its range is the app's own sentence; a
    slider in whole steps takes only whole numbers."""

    def preprocess(self, payload: Any) -> Any:  # noqa: D401 - Gradio hook
        if self._whole_steps() and payload is not None and not _whole(payload):
            raise self.refusal(payload)
        return super().preprocess(payload)

    def _whole_steps(self) -> bool:
        return all(float(v).is_integer() for v in (self.minimum, self.step))

    def expected(self) -> str:
        whole = "a whole number" if self._whole_steps() else "a number"
        return f"{whole} from {self.minimum:g} to {self.maximum:g}"
