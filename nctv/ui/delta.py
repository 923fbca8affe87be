"""δ made visible in the page, for every tab that shows a learned δ (Calibrate on a test picture, Try
on the visitor's): a picture as the model gets it, picture + δ × k blended in by a slider, and the
change δ × k around mid-grey, each on a canvas of the model's input size. The pixel arrays travel
once, in the view's HTML; ``static/delta.js`` paints them and repaints in the page when the
amplification k (:data:`AMPLIFICATIONS`) or the blend moves.
"""
from __future__ import annotations

import html
import json
from importlib import resources
from typing import Any

import gradio as gr
import numpy as np

#: The amplifications of δ the page offers (×1 is δ's true size).
AMPLIFICATIONS = (1, 10, 50)
#: What the view says where the calibration in use has no δ.
NO_DELTA = "<p>Neural Clamping was not part of this run, so there is no δ to show.</p>"


def _static(name: str) -> str:
    return (resources.files("nctv.ui") / "static" / name).read_text(encoding="utf-8")


#: The view's script (``js_on_load`` of its ``gr.HTML``) and styles (its ``css_template``).
DELTA_JS = _static("delta.js")
DELTA_CSS = _static("delta.css")


def delta_widget(value: str | None = None, **props: Any) -> gr.HTML:
    """The ``gr.HTML`` that shows a :func:`delta_view` (its value) and repaints it in the page."""
    return gr.HTML(value, css_template=DELTA_CSS, js_on_load=DELTA_JS, **props)


def delta_view(data: Any, *, picture: str, group: str, effect: str = "", sentence: bool = True) -> str:
    """The view of ``data``, a :class:`nctv.plots.DeltaImageData` with an example: its pixels as JSON in
    ``data-input`` (0–255) and δ in ``data-delta`` (0–255 levels), channel-major. ``picture`` names the
    example in its caption; ``effect`` says what δ does to the example's answer; ``group`` names the
    amplification's radio buttons (one name per view on a page, since a page's radio buttons of one
    name are one group); ``sentence``: open with :func:`nctv.plots.delta_sentence` (what δ is and how
    large), unless the page says it beside the view already. Channels are named in words."""
    from nctv.plots import delta_sentence

    c, h, w = data.delta.shape
    names = data.channel_names
    what, reading = (("Brightness", "lighter = brighter, darker = dimmer") if names == ("brightness",) else
                     ("Colour", "lighter = brighter, a tint = more of that colour"))
    channels = "" if len(names) == 1 else f" Channels: {', '.join(names)}."
    lead = (delta_sentence(data) if sentence else "") + channels
    radios = "".join(f'<label><input type="radio" name="{html.escape(group, quote=True)}" value="{k}"'
                     f'{" checked" if k == 1 else ""}>×{k}{" (true size)" if k == 1 else ""}</label>'
                     for k in AMPLIFICATIONS)
    pixels = json.dumps(np.round(255 * data.example, 3).ravel().tolist())
    delta = json.dumps(np.round(data.delta, 4).ravel().tolist())
    largest = float(np.abs(data.delta).max())
    return (f'<div class="nctv-delta" data-channels="{c}" data-height="{h}" data-width="{w}" data-largest="{largest!r}" '
            f'data-input="{pixels}" data-delta="{delta}">'
            f'<div class="nctv-title">δ, the change Neural Clamping learned, made visible</div>'
            + (f'<p class="nctv-delta-sentence">{html.escape(lead.strip())}</p>' if lead else "") +
            f'<div class="nctv-controls"><fieldset class="nctv-amplify"><legend>Make δ larger to see it</legend>'
            f'{radios}</fieldset><label class="nctv-blend">Blend from the picture (0) to picture + δ (1) '
            f'<input type="range" min="0" max="1" step="0.05" value="1"></label></div>'
            f'<div class="nctv-panels">'
            f'<figure><figcaption>{html.escape(picture)} as the model gets it ({w}\u00a0×\u00a0{h})</figcaption>'
            f'<canvas data-panel="input" width="{w}" height="{h}"></canvas></figure>'
            f'<figure><figcaption data-caption="blend">Picture + δ × 1</figcaption>'
            f'<canvas data-panel="blend" width="{w}" height="{h}"></canvas></figure>'
            f'<figure><figcaption data-caption="change">{what} change δ × 1</figcaption>'
            f'<canvas data-panel="change" width="{w}" height="{h}"></canvas></figure></div>'
            f'<p class="nctv-delta-reading">{what} change: mid-grey = no change; {reading}.</p>'
            f'<p class="nctv-delta-scale">At ×1 the largest change is {largest:.1f} of 255 levels.</p>'
            + (f'<p class="nctv-delta-effect">{html.escape(effect)}</p>' if effect else "") + '</div>')
