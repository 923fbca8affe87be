"""The "Try your own image" tab: one picture through the model three ways — as it is, with
temperature scaling (z/T) and with Neural Clamping (f(x + δ)/T) — using the visitor's latest
calibration, or the one shipped with the app before any run.

The note says which classes the model knows (any picture gets one of them) and whether the picture
looks like the model's images at all (:mod:`nctv.ood`, fitted once per model and calibration split);
confidences are drawn as HTML bars with one decimal (``gr.Label`` rounds to whole percent)."""
from __future__ import annotations

import html
import logging
from typing import Any

import numpy as np
import torch

from nctv.inference import model_logits
from nctv.ui.common import redact, user_errors
from nctv.images import ImageError, match_channels, to_pil
from nctv.ui.state import Calibration, examples_dir, get_model, get_ood_detector, load_precomputed

log = logging.getLogger("nctv.ui")

TOP_CLASSES = 5
#: Up to this many classes the note names them all; beyond, it names the first SOME_CLASSES.
MAX_NAMED_CLASSES = 20
SOME_CLASSES = 8


def example_images() -> list[str]:
    """The shipped example pictures (PNG), sorted by name."""
    folder = examples_dir()
    return sorted(str(p) for p in folder.glob("*.png")) if folder.is_dir() else []


def current_calibration(state: Calibration | None) -> Calibration:
    if state is not None:
        return state
    pre = load_precomputed()
    if pre is None:
        raise ValueError("No calibration yet: run one in the Calibrate tab first.")
    return pre.calibration


def _confidences(logits: torch.Tensor, class_names: list[str]) -> dict[str, float]:
    p = torch.softmax(logits.double(), dim=-1)[0]
    top = torch.topk(p, min(TOP_CLASSES, p.numel()))
    return {class_names[int(i)]: float(v) for v, i in zip(top.values, top.indices)}


def percent(p: float) -> str:
    """A probability as a percentage with one decimal ("87.3 %"); a value that is not exactly 0 or 1
    never shows as "0.0 %" or "100.0 %"."""
    text = f"{100 * p:.1f}"
    if text == "0.0" and p > 0:
        return "< 0.1 %"
    if text == "100.0" and p < 1:
        return "> 99.9 %"
    return f"{text} %"


_ROW = ('<div class="nctv-confidence" data-class="{name}" data-confidence="{p!r}" style="margin:0 0 10px 0">'
        '<div style="display:flex;justify-content:space-between;gap:12px;line-height:1.35">'
        '<span style="overflow-wrap:anywhere;font-weight:{weight}">{name}</span>'
        '<span style="white-space:nowrap;font-variant-numeric:tabular-nums;font-weight:{weight}">{shown}</span></div>'
        '<div aria-hidden="true" style="height:8px;margin-top:3px;border-radius:4px;overflow:hidden;'
        'background:rgba(128,128,128,0.25)"><div style="height:100%;width:{width:.2f}%;border-radius:4px;'
        'background:{colour}"></div></div></div>')
#: The top class in Gradio's orange, the others in a mid blue: both read on light and dark themes.
_TOP_COLOUR, _OTHER_COLOUR = "#f97316", "#60a5fa"


def confidence_html(confidences: dict[str, float], empty: str = "No confidences to show.") -> str:
    """The classes' confidences as horizontal bars, highest first, with one-decimal percentages;
    each row carries ``data-class`` and ``data-confidence`` (the probability). Inline styles only,
    text in the page's own colour. ``empty`` is said when there are none."""
    if not confidences:
        return (f'<div class="nctv-confidences nctv-empty" style="opacity:0.75;font-style:italic">'
                f'{html.escape(empty)}</div>')
    if not all(0.0 <= float(p) <= 1.0 for p in confidences.values()):
        raise ValueError("Confidences must be probabilities from 0 to 1.")
    ranked = sorted(confidences.items(), key=lambda kv: -float(kv[1]))
    rows = [_ROW.format(name=html.escape(str(name), quote=True), p=float(p), shown=html.escape(percent(float(p))),
                        width=100 * float(p), weight=600 if i == 0 else 400,
                        colour=_TOP_COLOUR if i == 0 else _OTHER_COLOUR)
            for i, (name, p) in enumerate(ranked)]
    return '<div class="nctv-confidences" role="list">' + "".join(rows) + "</div>"


def classes_sentence(class_names: list[str]) -> str:
    """What the model can answer: its classes (a few of them when there are many)."""
    k = len(class_names)
    if k <= MAX_NAMED_CLASSES:
        known = f"This model knows {k} classes: {', '.join(class_names)}"
    else:
        known = f"This model knows {k:,} classes, among them {', '.join(class_names[:SOME_CLASSES])}, …"
    return known + " — a picture of anything else still gets one of these labels."


def ood_note(cal: Calibration, x: torch.Tensor) -> str:
    """Whether the picture (preprocessed ``x``) looks like the model's images, and how that is judged."""
    from nctv.ood import penultimate_features

    spec = cal.split
    if spec is None:
        return "The out-of-distribution check is unavailable: this calibration came without its images."
    try:
        detector = get_ood_detector(spec)
    except ValueError as exc:
        return f"The out-of-distribution check is unavailable: its images could not be loaded ({redact(str(exc))})."
    except Exception:  # noqa: BLE001 - the check is an extra; the picture's confidences still show
        log.exception("fitting the out-of-distribution check failed")
        return "The out-of-distribution check is unavailable: its images could not be loaded."
    score = float(detector.score(penultimate_features(get_model(cal.model).model, x[None]))[0])
    where = (f"flagged above {detector.threshold_:.1f}: the {100 * detector.quantile:g}th percentile on "
             f"{detector.held_out_scores_.numel():,} test images")
    how = (f"How: the Mahalanobis distance of the picture's penultimate-layer features to the nearest class mean, "
           f"with class means and one shared covariance from {detector.n_samples_fit_:,} calibration images "
           f"(Lee et al., 2018).")
    if score > detector.threshold_:
        return (f"⚠ **This picture looks unlike the images the model was made for** (distance {score:.1f}, {where}); "
                f"treat every confidence below with suspicion. {how}")
    return (f"The picture passes the out-of-distribution check (distance {score:.1f}, {where}), which is no "
            f"proof that it shows one of the model's classes. {how}")


def _calibration_line(cal: Calibration) -> str:
    return (f"Calibration in use: **{cal.source}** — model {cal.model}; temperature scaling T = {cal.ts_temperature:.3f}"
            + (f"; {cal.nc_method} T = {cal.nc_temperature:.3f}." if cal.delta is not None
               else "; Neural Clamping was not part of this run, so its column stays empty."))


def _prediction_line(raw: dict, ts: dict, nc: dict) -> str:
    top = next(iter(raw))
    line = f"Prediction: **{top}** — {percent(raw[top])} before calibration, {percent(ts.get(top, 0.0))} with temperature scaling"
    if not nc:
        return line + "."
    nc_top = next(iter(nc))
    return line + f", {percent(nc[nc_top])} for **{nc_top}** with Neural Clamping."


def classify_image(image: Any, state: Calibration | None) -> tuple:
    """(note, figure of input / δ / input + δ, raw, TS and NC confidences as HTML) for one picture."""
    from nctv import plots

    cal = current_calibration(state)
    loaded = get_model(cal.model)
    channels = int(loaded.data_config["input_size"][0])
    img, channel_note = match_channels(to_pil(image), channels)
    x = loaded.preprocess(img)
    if cal.delta is not None and tuple(cal.delta.shape) != tuple(x.shape):
        raise ImageError(f"The calibration's δ has shape {tuple(cal.delta.shape)} but the model input is "
                         f"{tuple(x.shape)}.")
    z = model_logits(loaded.model, x[None])
    raw = _confidences(z, loaded.class_names)
    ts = _confidences(z / cal.ts_temperature, loaded.class_names)
    nc, figure = {}, None
    if cal.delta is not None:
        z_nc = model_logits(loaded.model, x[None], delta=cal.delta) / cal.nc_temperature
        nc = _confidences(z_nc, loaded.class_names)
        mean, std = loaded.data_config["mean"], loaded.data_config["std"]
        data = plots.delta_image_data(cal.delta, mean, std, example=x, title=f"δ of {cal.nc_method}")
        figure = plots.delta_figure(data, backend="plotly")
    lines = [_prediction_line(raw, ts, nc), ood_note(cal, x), classes_sentence(loaded.class_names),
             _calibration_line(cal),
             f"Your picture ({img.size[0]} × {img.size[1]} pixels) was resized and normalised as the model expects: "
             f"{tuple(x.shape)} (channels, height, width)."] + ([channel_note] if channel_note else [])
    return ("\n\n".join(lines), figure, confidence_html(raw), confidence_html(ts),
            confidence_html(nc, empty="Neural Clamping was not part of this run."))


@user_errors
def classify(image: Any, state: Calibration | None = None):
    """An uploaded, pasted, webcam or example picture (a file path); nothing yet gives a hint."""
    if image is None:
        return "Upload, paste or take a picture, pick an example, or draw one.", None, None, None, None
    return classify_image(image, state)


@user_errors
def classify_drawing(drawing: Any, state: Calibration | None = None):
    """A drawing from the sketchpad (an editor value: background, layers, composite)."""
    if isinstance(drawing, dict) and drawing.get("composite") is not None:
        arr = np.asarray(drawing["composite"])
        if arr.size and (arr == arr.reshape(-1, *arr.shape[2:])[0]).all():
            raise ImageError("The drawing is empty: draw something on the canvas first.")
    return classify_image(drawing, state)
