"""The "Try your own image" tab: one picture through the model three ways — as it is, with
temperature scaling (z/T) and with Neural Clamping (f(x + δ)/T) — using the visitor's latest
calibration, or the one shipped with the app before any run."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nctv.inference import model_logits
from nctv.ui.common import user_errors
from nctv.ui.images import ImageError, match_channels, to_pil
from nctv.ui.state import Calibration, examples_dir, get_model, load_precomputed

TOP_CLASSES = 5


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


def classify_image(image: Any, state: Calibration | None) -> tuple:
    """(note, figure of input / δ / input + δ, raw, TS and NC confidences) for one picture."""
    from nctv import plots

    cal = current_calibration(state)
    loaded = get_model(cal.model)
    channels = int(loaded.data_config["input_size"][0])
    img, note = match_channels(to_pil(image), channels)
    x = loaded.preprocess(img)
    if cal.delta is not None and tuple(cal.delta.shape) != tuple(x.shape):
        raise ImageError(f"The calibration's δ has shape {tuple(cal.delta.shape)} but the model input is "
                         f"{tuple(x.shape)}.")
    z = model_logits(loaded.model, x[None])
    raw = _confidences(z, loaded.class_names)
    ts = _confidences(z / cal.ts_temperature, loaded.class_names)
    mean, std = loaded.data_config["mean"], loaded.data_config["std"]
    if cal.delta is not None:
        z_nc = model_logits(loaded.model, x[None], delta=cal.delta) / cal.nc_temperature
        nc = _confidences(z_nc, loaded.class_names)
        data = plots.delta_image_data(cal.delta, mean, std, example=x, title=f"δ of {cal.nc_method}")
        figure = plots.delta_figure(data, backend="plotly")
    else:
        nc = {}
        figure = None
    h, w = img.size[1], img.size[0]
    lines = [f"Calibration in use: **{cal.source}** — model {cal.model}; "
             f"temperature scaling T = {cal.ts_temperature:.3f}"
             + (f"; {cal.nc_method} T = {cal.nc_temperature:.3f}." if cal.delta is not None
                else "; Neural Clamping was not part of this run, so its column stays empty."),
             f"Your picture ({w} × {h} pixels) was resized and normalised as the model expects: "
             f"{tuple(x.shape)} (channels, height, width)."]
    if note:
        lines.append(note)
    top = next(iter(raw))
    lines.append(f"Prediction: **{top}** — {100 * raw[top]:.1f}% before calibration, "
                 f"{100 * ts.get(top, 0.0):.1f}% with temperature scaling"
                 + (f", {100 * nc[next(iter(nc))]:.1f}% for **{next(iter(nc))}** with Neural Clamping." if nc else "."))
    return "\n\n".join(lines), figure, raw, ts, nc


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
