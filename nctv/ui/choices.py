"""The app's menus (``gr.Dropdown``, ``gr.Radio``, ``gr.CheckboxGroup``) with the refusal of a value
outside their choices in the app's own words.

Gradio checks a menu's value while preprocessing, before any handler runs, and refuses with its own
message, which repeats the whole value and the Python type of what was sent. A visitor of a public
copy may send anything through the API; the refusal should read like every other message of the app
and repeat only the start of the value.
"""
from __future__ import annotations

from typing import Any

import gradio as gr

from nctv.checks import shown


def _choice_names(component: Any) -> str:
    names = [str(value) for _, value in (component.choices or [])]
    text = ", ".join(names)
    return text if len(text) <= 300 else text[:300] + "…"


class _OwnRefusal:
    """Re-words Gradio's "not in the list of choices" refusal; every other behaviour is unchanged."""

    is_template = True  # drawn by the browser exactly as the Gradio component

    def preprocess(self, payload: Any) -> Any:  # noqa: D401 - Gradio hook
        try:
            return super().preprocess(payload)
        except gr.Error:
            what = self.label or "This setting"
            raise gr.Error(f"{what} must be one of: {_choice_names(self)}; got {shown(payload)}.",
                           print_exception=False) from None


class CheckedDropdown(_OwnRefusal, gr.Dropdown):
    """``gr.Dropdown`` whose refusal of an unknown value is the app's own sentence."""


class CheckedRadio(_OwnRefusal, gr.Radio):
    """``gr.Radio`` whose refusal of an unknown value is the app's own sentence."""


class CheckedCheckboxGroup(_OwnRefusal, gr.CheckboxGroup):
    """``gr.CheckboxGroup`` whose refusal of an unknown value is the app's own sentence."""
