"""The "Try your own image" tab: one picture through the model three ways — as it is, with
temperature scaling (z/T) and with Neural Clamping (f(x + δ)/T) — using the visitor's latest
calibration, or the one shipped with the app before any run.

What the tab shows, top to bottom (one column, so that a phone reads it as well as a projector):

* the verdict of the out-of-distribution check (:mod:`nctv.ood`, fitted once per model and
  calibration split): whether the picture looks like the model's images at all;
* one chart, a row per class with three bars (uncalibrated, temperature scaling, Neural Clamping)
  and one-decimal percentages; dimmed when the check flags the picture;
* δ made visible on the picture by :mod:`nctv.ui.delta`, the viewer the Calibrate tab shows too: the
  picture, picture + δ and the change, drawn in the page from arrays the server sends once, so that
  amplifying δ or blending it in needs no round trip;
* with a corruption chosen (``nctv.corruptions``, severity 1–5), the picture is corrupted before the
  model's preprocessing, as a camera in the rain would give it: the chart then shows the corrupted
  picture and, on every bar, where the clean picture's confidence was;
* the details: the classes the model knows, the calibration in use, how the picture was resized.
"""
from __future__ import annotations

import html
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from nctv.corruptions import CORRUPTIONS, check_corruption, corrupt_image
from nctv.inference import model_logits
from nctv.ui.common import parse_whole, redact, user_errors
from nctv.images import ImageError, match_channels, to_pil
from nctv.conformal import describe_set
from nctv.ui.caches import PICTURES_NOT_HERE, conformal_predictor, get_model, has_ood_detector, remember_detector
from nctv.ui.delta import NO_DELTA, delta_view
from nctv.ui.gpu import gpu_call
from nctv.ui.session import TS_METHOD, Calibration
from nctv.ui.shipped import examples_dir, load_precomputed, ood_detector, shipped_detector

log = logging.getLogger("nctv.ui")

TOP_CLASSES = 5
#: Up to this many classes the note names them all; beyond, it names the first SOME_CLASSES.
MAX_NAMED_CLASSES = 20
SOME_CLASSES = 8
#: The three ways a picture is scored: key, short tag beside each bar, full name, bar colour. The
#: colours read on light and dark themes; the tags say the same without colour.
METHODS = (("raw", "uncal.", "uncalibrated", "#94a3b8"),
           ("ts", "TS", "temperature scaling", "#3b82f6"),
           ("nc", "NC", "Neural Clamping", "#f97316"))
#: What a flagged picture's result is shown under.
MEANS_LITTLE = "This picture does not look like the data the model knows: its answer means little."
HINT = "Upload, paste or take a picture, pick an example, or draw one."
#: The name of the δ view's amplification buttons: its own, apart from the Calibrate tab's view on the page.
DELTA_GROUP = "try-amplify"
#: The corruption the menu opens on (at severity 0: the picture as it is), and the strongest severity.
DEFAULT_CORRUPTION = "gaussian-noise"
MAX_SEVERITY = 5
#: A picture with more pixels is shrunk to this many before it is corrupted: the corruptions work on a
#: float64 copy (8 bytes a value, several copies for a blur), and the model shrinks the picture anyway.
MAX_CORRUPTED_PIXELS = 1024 * 1024
#: The corrupted picture is shown at most this many pixels on its longer side.
SHOWN_PX = 320


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


#: Between a number and its unit (and after "<", ">"): a space that never breaks the line.
NBSP = "\u00a0"


def percent(p: float) -> str:
    """A probability as a percentage with one decimal ("87.3 %", the space a non-breaking one, so
    that the number and its unit stay on one line); a value that is not exactly 0 or 1 never shows
    as "0.0 %" or "100.0 %"."""
    text = f"{100 * p:.1f}"
    if text == "0.0" and p > 0:
        return f"<{NBSP}0.1{NBSP}%"
    if text == "100.0" and p < 1:
        return f">{NBSP}99.9{NBSP}%"
    return f"{text}{NBSP}%"


# --------------------------------------------------------------------------- out-of-distribution verdict


@dataclass(frozen=True)
class Verdict:
    """The out-of-distribution check on one picture: ``flagged`` is None when the check could not
    run; ``headline`` comes first on the page, ``how`` goes with the details."""

    flagged: bool | None
    headline: str
    how: str = ""
    #: The numbers behind the headline ("distance 34.3; pictures above 16.8 are flagged").
    measured: str = ""


def ood_verdict(cal: Calibration, x: torch.Tensor) -> Verdict:
    """Whether the picture (preprocessed ``x``) looks like the model's images, and how that is judged."""
    from nctv.ood import penultimate_features

    spec = cal.split
    if spec is None:
        return Verdict(None, "The out-of-distribution check is unavailable: this calibration came without its images.")
    try:
        detector = ood_detector(spec)
    except ValueError as exc:
        if str(exc) == PICTURES_NOT_HERE:
            return Verdict(None, "The out-of-distribution check is unavailable: this pre-computed study came without "
                                 "its detector, and its calibration pictures are not on this server (they are "
                                 "downloaded only for a run).")
        return Verdict(None, "The out-of-distribution check is unavailable: its images could not be loaded "
                             f"({redact(str(exc))}).")
    except Exception:  # noqa: BLE001 - the check is an extra; the picture's confidences still show
        log.exception("fitting the out-of-distribution check failed")
        return Verdict(None, "The out-of-distribution check is unavailable: its images could not be loaded.")
    score = float(detector.score(penultimate_features(get_model(cal.model).model, x[None]))[0])
    how = (f"How the picture was judged: the Mahalanobis distance of its penultimate-layer features to the nearest "
           f"class mean (Lee et al., 2018), with class means and one shared covariance from "
           f"{detector.n_samples_fit_:,} calibration images; pictures above {detector.threshold_:.1f}, the "
           f"{100 * detector.quantile:g}th percentile on {detector.held_out_scores_.numel():,} test images, are flagged.")
    where = f"distance {score:.1f}; pictures above {detector.threshold_:.1f} are flagged"
    if score > detector.threshold_:
        return Verdict(True, MEANS_LITTLE, how, where)
    return Verdict(False, "This picture looks like the data the model knows, which is no proof that it shows one of "
                          "the model's classes.", how, where)


def verdict_html(verdict: Verdict | None) -> str:
    """The verdict as the first line of the result; None (no picture yet) gives the hint."""
    if verdict is None:
        return f'<div class="nctv-verdict" data-flagged="none">{html.escape(HINT)}</div>'
    state = {True: "true", False: "false", None: "unknown"}[verdict.flagged]
    mark = {True: "⚠ ", False: "✓ ", None: ""}[verdict.flagged]
    measured = f' <span class="nctv-measured">({html.escape(verdict.measured)})</span>' if verdict.measured else ""
    return (f'<div class="nctv-verdict" data-flagged="{state}"><span class="nctv-headline">{mark}'
            f'{html.escape(verdict.headline)}</span>{measured}</div>')


# --------------------------------------------------------------------------- a corrupted picture


def corruption_choices() -> list[tuple[str, str]]:
    """(title, name) of every corruption of the registry: the menu's entries."""
    return [(c.title, c.name) for c in CORRUPTIONS.values()]


def checked_corruption(corruption: Any, severity: Any) -> tuple[str, int]:
    """A corruption of the registry and a severity, a whole number from 0 (the picture as it is) to
    5, or a ValueError in the visitor's words (the values may come through the API: anything goes)."""
    if isinstance(severity, bool):
        raise ValueError(f"The corruption's severity must be a whole number from 0 to {MAX_SEVERITY}; "
                         f"got {severity!r}.")
    severity = parse_whole(severity, "The corruption's severity", 0, MAX_SEVERITY)
    return check_corruption(corruption), severity


def corrupted(img: Image.Image, name: str, severity: int) -> tuple[Image.Image, str]:
    """The picture with corruption ``name`` at ``severity`` (checked; 0: the picture itself), and
    what the details say of it. A picture of more than :data:`MAX_CORRUPTED_PIXELS` is shrunk first."""
    if severity == 0:
        return img, ""
    from nctv.corruptions import in_words

    spec, shrunk = CORRUPTIONS[name], ""
    if img.width * img.height > MAX_CORRUPTED_PIXELS:
        scale = (MAX_CORRUPTED_PIXELS / (img.width * img.height)) ** 0.5
        img = img.resize((max(1, int(img.width * scale)), max(1, int(img.height * scale))), Image.Resampling.BOX)
        shrunk = (f" It was first shrunk to {img.width} × {img.height} pixels: larger pictures are not corrupted "
                  "at their full size.")
    value = spec.value(severity, min(img.size))
    return corrupt_image(img, name, severity), (
        f"Corruption: {in_words(spec.title)} at severity {severity} ({spec.parameter} {value}), applied to your "
        f"picture before the model's own preprocessing, as in the Shift tab's study.{shrunk}")


@dataclass(frozen=True)
class Shift:
    """A corrupted picture's part of the chart: the picture the model got, the corruption, and the
    clean picture's probabilities per method (``clean``)."""

    picture: Image.Image
    name: str
    severity: int
    clean: dict[str, np.ndarray]

    @property
    def words(self) -> str:
        from nctv.corruptions import in_words

        return f"{in_words(CORRUPTIONS[self.name].title)} at severity {self.severity}"

    def figure(self) -> str:
        """The corrupted picture (a PNG, at most :data:`SHOWN_PX` on its longer side; a small one enlarged
        pixel by pixel) with its caption."""
        import base64
        import io

        img = self.picture.copy()
        small = max(img.size) <= SHOWN_PX // 4
        img.thumbnail((SHOWN_PX, SHOWN_PX))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        src = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        crisp = ' class="nctv-pixelated"' if small else ""
        return (f'<figure class="nctv-shifted" data-corruption="{html.escape(self.name)}" data-severity="{self.severity}">'
                f'<img src="{src}" alt="Your picture with {html.escape(self.words)}"{crisp}><figcaption>Your picture with '
                f'{html.escape(self.words)}, as the model got it; the bars below are its confidences.</figcaption></figure>')

    def moves(self, class_names: list[str], probs: dict[str, np.ndarray], methods: list[tuple[str, str, str]]) -> str:
        """How the corruption moved each method's confidence in the clean picture's answer (HTML)."""
        first = int(np.argmax(self.clean["raw"]))
        moved = ", ".join(f"{name} {html.escape(percent(float(self.clean[key][first])))} → "
                          f"{html.escape(percent(float(probs[key][first])))}" for key, _, name in methods)
        now = int(np.argmax(probs["raw"]))
        answer = (f"; the answer becomes <b>{html.escape(str(class_names[now]))}</b>" if now != first
                  else "")
        return (f"With {html.escape(self.words)}, the confidence in the clean picture's answer, "
                f"<b>{html.escape(str(class_names[first]))}</b>, moves: {moved}{answer}.")


# --------------------------------------------------------------------------- the confidence chart


def probabilities(logits: torch.Tensor) -> np.ndarray:
    """softmax of one picture's logits (1, K) in float64, as (K,)."""
    return torch.softmax(logits.double(), dim=-1)[0].numpy()


def shown_classes(probs: dict[str, np.ndarray], k: int = TOP_CLASSES) -> list[int]:
    """The classes worth a row: every class in any method's top ``k``, most likely (uncalibrated) first."""
    keep = set()
    for p in probs.values():
        keep.update(int(i) for i in np.argsort(-p, kind="stable")[:k])
    first = probs["raw"]
    return sorted(keep, key=lambda i: (-first[i], i))


def _bar(key: str, tag: str, name: str, colour: str, p: float, clean: float | None = None) -> str:
    # With a corruption, a mark on the track where the clean picture's confidence was.
    mark = ("" if clean is None else f'<i class="nctv-clean" style="left:{100 * clean:.2f}%" '
                                     f'title="clean picture: {html.escape(percent(clean))}"></i>')
    data = "" if clean is None else f' data-clean="{clean!r}"'
    return (f'<div class="nctv-bar" data-method="{key}" data-confidence="{p!r}"{data} title="{name}">'
            f'<span class="nctv-tag">{tag}</span>'
            f'<span class="nctv-track"><span class="nctv-fill" style="width:{100 * p:.2f}%;background:{colour}">'
            f'</span>{mark}</span><span class="nctv-value">{html.escape(percent(p))}</span></div>')


def _check_probabilities(class_names: list[str], probs: dict[str, np.ndarray]) -> None:
    for p in probs.values():
        if len(p) != len(class_names) or not ((p >= 0) & (p <= 1)).all():
            raise ValueError("Confidences must be probabilities from 0 to 1, one per class.")


def confidence_chart(class_names: list[str], probs: dict[str, np.ndarray], flagged: bool | None = False,
                     shift: "Shift | None" = None, trust: str = "", conformal: str = "") -> str:
    """One chart of the classes' confidences: the model's answer first, then ``trust`` (what a
    calibrated confidence means and which bar to believe, :func:`trust_sentence`), then per class its
    name on a line of its own and a bar per method in ``probs`` ({"raw"|"ts"|"nc": (K,)
    probabilities}), with one-decimal percentages. Each row carries ``data-class``, each bar
    ``data-method`` and ``data-confidence``. A ``flagged`` picture's answer is marked, in words, as
    meaning little; nothing is dimmed, so that every word keeps its contrast. With ``shift`` (a
    corrupted picture) the chart shows that picture and says how the answer's confidences moved from
    the clean picture's (``shift.clean``), each bar marked where the clean one was (``data-clean``).
    ``conformal``: the picture's conformal set in a sentence (:func:`set_sentence`), after ``trust``."""
    if not probs:
        return ""
    _check_probabilities(class_names, probs)
    if shift is not None:
        _check_probabilities(class_names, shift.clean)
    methods = [m for m in METHODS if m[0] in probs]
    legend = "".join(f'<span class="nctv-key"><i style="background:{colour}"></i>{tag} = {name}</span>'
                     for key, tag, name, colour in methods)
    if "nc" not in probs:
        legend += '<span class="nctv-key">Neural Clamping was not part of this run.</span>'
    rows = []
    for i in shown_classes(probs):
        name = html.escape(str(class_names[i]), quote=True)
        bars = "".join(_bar(key, tag, name_, colour, float(probs[key][i]),
                            None if shift is None else float(shift.clean[key][i])) for key, tag, name_, colour in methods)
        rows.append(f'<div class="nctv-class" data-class="{name}"><div class="nctv-class-name">{name}</div>{bars}</div>')
    answer = class_names[int(np.argmax(probs["raw"]))]
    line = f"The model's answer: <b>{html.escape(str(answer))}</b>"
    if "nc" in probs and int(np.argmax(probs["nc"])) != int(np.argmax(probs["raw"])):
        line += f" (with Neural Clamping: <b>{html.escape(str(class_names[int(np.argmax(probs['nc']))]))}</b>)"
    if flagged:
        line += f' <span class="nctv-flag">⚠ {html.escape(FLAGGED_ANSWER)}</span>'
    top = moved = ""
    if shift is not None:
        top = shift.figure()
        moved = f'<p class="nctv-moved">{shift.moves(class_names, probs, [m[:3] for m in methods])}</p>'
        legend += '<span class="nctv-key"><i class="nctv-clean-swatch"></i>the clean picture\'s confidence</span>'
    trust = f'<p class="nctv-trust">{html.escape(trust)}</p>' if trust else ""
    if conformal:
        trust += f'<p class="nctv-set">{html.escape(conformal)}</p>'
    return (f'<div class="nctv-chart" data-flagged="{str(bool(flagged)).lower()}">'
            f'<p class="nctv-answer">{line}</p>{trust}{top}{moved}'
            f'<div class="nctv-title">How sure the model is, per class</div><div class="nctv-legend">{legend}</div>'
            f'<div class="nctv-rows" role="list">{"".join(rows)}</div></div>')


#: Beside a flagged picture's answer (the verdict above says why).
FLAGGED_ANSWER = "unreliable: this picture is unlike the model's data"
#: What a calibrated confidence means, in one plain sentence.
CALIBRATED_MEANS = "A calibrated confidence says how often such answers are right: of the pictures answered with 80 %, about 8 in 10 are right."


def trust_sentence(cal: Calibration, methods: list[str]) -> str:
    """What a calibrated confidence means, and which of the bars (``methods``: the chart's keys) to
    trust: the one whose test ECE was lowest in the calibration in use, with the figures; without
    them, the calibrated bars rather than the uncalibrated one."""
    names = {"raw": "Uncalibrated", "ts": TS_METHOD, "nc": cal.nc_method}
    ece = {key: cal.metrics.get(names[key] or "", {}).get("ece") for key in methods}
    means = CALIBRATED_MEANS.replace(" %", f"{NBSP}%")
    if not all(isinstance(v, float) for v in ece.values()):
        return means + " Trust a calibrated bar (TS or NC) rather than the uncalibrated one, which is often too sure."
    tags, words = {m[0]: m[1] for m in METHODS}, {m[0]: m[2] for m in METHODS}
    best = min(ece, key=ece.get)
    others = [f"{100 * v:.1f} for {words[k]}" for k, v in ece.items() if k != best]
    against = f", against {' and '.join(others)}" if others else ""
    return (f"{means} Trust the {tags[best]} bar: on the test pictures its confidences were off by "
            f"{100 * ece[best]:.1f}{NBSP}points on average (ECE){against}.")


def set_sentence(cal: Calibration, z: torch.Tensor, class_names: list[str], flagged: bool | None,
                 severity: int) -> str:
    """"With 90 % confidence the answer is one of: Sandal, Sneaker.": the picture's conformal set
    (:func:`nctv.ui.caches.conformal_predictor`: LAC on temperature scaling's probabilities, made on the
    calibration split). None for a picture unlike the model's data, whose set would promise nothing;
    a corrupted picture's set is said to promise less."""
    if flagged or cal.split is None:
        return ""
    try:
        predictor = conformal_predictor(cal.split, cal.ts_temperature)
    except ValueError:  # the calibration split could not be loaded: the chart goes on without a set
        return ""
    if predictor is None:
        return ""
    sentence = describe_set(predictor.predict_sets(z.double() / cal.ts_temperature)[0], class_names,
                            predictor.settings.coverage).replace(" %", f"{NBSP}%")
    if severity:
        sentence = sentence[:-1] + ", though a corrupted picture is unlike the calibration pictures, so the promise is weaker."
    return sentence


#: Styles of the chart (scoped by Gradio to its component).
CHART_CSS = """
.nctv-title { font-weight:600; font-size:1.1em; margin-bottom:6px; }
.nctv-legend { display:flex; flex-wrap:wrap; gap:4px 14px; font-size:0.9em; margin-bottom:6px; }
.nctv-key { display:inline-flex; align-items:center; gap:6px; white-space:nowrap; }
.nctv-key i { display:inline-block; width:12px; height:12px; border-radius:3px; }
.nctv-answer { margin:4px 0 8px 0; font-size:1.1em; }
.nctv-class { margin:0 0 10px 0; }
.nctv-class-name { font-weight:600; line-height:1.35; white-space:nowrap; overflow:hidden; text-overflow:ellipsis; }
.nctv-bar { display:grid; grid-template-columns:3.6em minmax(0, 1fr) 5.6em; align-items:center; gap:8px;
            line-height:1.3; font-size:0.92em; }
.nctv-tag { opacity:0.8; }
.nctv-track { position:relative; height:10px; border-radius:4px; overflow:hidden; background:rgba(128,128,128,0.22); }
.nctv-fill { display:block; height:100%; border-radius:4px; }
.nctv-clean { position:absolute; top:0; bottom:0; width:3px; margin-left:-1px; background:var(--body-text-color); }
.nctv-key i.nctv-clean-swatch { width:3px; border-radius:0; background:var(--body-text-color); }
.nctv-shifted { display:flex; flex-wrap:wrap; gap:8px 14px; align-items:center; margin:0 0 10px 0; }
.nctv-shifted img { width:112px; height:auto; max-height:160px; object-fit:contain; background:#000;
                    border:1px solid rgba(128,128,128,0.4); }
.nctv-shifted img.nctv-pixelated { image-rendering:pixelated; }
.nctv-shifted figcaption { flex:1 1 12em; line-height:1.35; }
.nctv-moved { margin:0 0 10px 0; line-height:1.4; }
.nctv-value { text-align:right; white-space:nowrap; font-variant-numeric:tabular-nums; }
.nctv-answer .nctv-flag { display:inline-block; margin-left:6px; padding:0 6px; border:2px solid #d97706;
                          border-radius:6px; font-weight:600; }
.nctv-trust { margin:0 0 10px 0; line-height:1.4; }
"""
VERDICT_CSS = """
.nctv-verdict { padding:8px 12px; border-radius:8px; line-height:1.4; border:1px solid rgba(128,128,128,0.35); }
.nctv-verdict[data-flagged="true"] { font-size:1.05em; border:2px solid #d97706; background:rgba(245,158,11,0.14); }
.nctv-verdict[data-flagged="true"] .nctv-headline { font-weight:600; }
.nctv-measured { font-size:0.9em; opacity:0.85; }
.nctv-verdict[data-flagged="false"] { border-color:rgba(34,197,94,0.6); }
"""


# --------------------------------------------------------------------------- δ made visible


def delta_effect(class_names: list[str], without: np.ndarray, with_delta: np.ndarray) -> str:
    """What δ alone does to one picture: the top class's confidence at Neural Clamping's T, without
    and with δ (a δ that looks like noise may still move it, or may not)."""
    top = int(np.argmax(with_delta))
    return (f"On this picture, δ moves the confidence in {class_names[top]} from {percent(float(without[top]))} "
            f"(Neural Clamping's temperature alone) to {percent(float(with_delta[top]))}.")


# --------------------------------------------------------------------------- details and the handler


def classes_sentence(class_names: list[str]) -> str:
    """What the model can answer: its classes (a few of them when there are many)."""
    k = len(class_names)
    if k <= MAX_NAMED_CLASSES:
        known = f"This model knows {k} classes: {', '.join(class_names)}"
    else:
        known = f"This model knows {k:,} classes, among them {', '.join(class_names[:SOME_CLASSES])}, …"
    return known + " — a picture of anything else still gets one of these labels."


def _calibration_line(cal: Calibration) -> str:
    return (f"Calibration in use: **{cal.source}** — model {cal.model}; temperature scaling T{NBSP}={NBSP}"
            f"{cal.ts_temperature:.3f}"
            + (f"; {cal.nc_method} T{NBSP}={NBSP}{cal.nc_temperature:.3f}." if cal.delta is not None
               else "; Neural Clamping was not part of this run, so it has no bars."))


def _scores(loaded: Any, cal: Calibration, x: torch.Tensor) -> tuple[dict[str, np.ndarray], torch.Tensor]:
    """({"raw", "ts"[, "nc"]: probabilities} of one preprocessed picture, its logits)."""
    z = model_logits(loaded.model, x[None])
    probs = {"raw": probabilities(z), "ts": probabilities(z / cal.ts_temperature)}
    if cal.delta is not None:
        probs["nc"] = probabilities(model_logits(loaded.model, x[None], delta=cal.delta) / cal.nc_temperature)
    return probs, z


def _picture_work(cal: Calibration, x: torch.Tensor, clean: torch.Tensor | None) -> tuple:
    """The model work of one picture (``x`` preprocessed; ``clean``: the uncorrupted one, or None):
    (probabilities, logits, the clean picture's probabilities or None, the out-of-distribution
    verdict, and, inside a ZeroGPU worker, the detector it used, which the server then keeps)."""
    from nctv.ui.gpu import in_worker

    loaded = get_model(cal.model)
    probs, z = _scores(loaded, cal, x)
    clean_probs = None if clean is None else _scores(loaded, cal, clean)[0]
    verdict = ood_verdict(cal, x)
    detector = ood_detector(cal.split) if in_worker() and verdict.flagged is not None else None
    return probs, z, clean_probs, verdict, detector


#: The GPU function of the Try tab (``nctv.ui.gpu``): ``(seconds, calibration, x, clean)`` → :func:`_picture_work`'s answer.
picture_on_gpu = gpu_call(_picture_work)


def _picture_answers(loaded: Any, cal: Calibration, x: torch.Tensor, clean: torch.Tensor | None) -> tuple:
    """:func:`_picture_work`, on the GPU for a large model on ZeroGPU (``nctv.ui.gpu.call``); a detector
    fitted there is kept for the next picture."""
    from nctv.ood import MAX_FIT_IMAGES, MAX_THRESHOLD_IMAGES
    from nctv.ui.gpu import call

    # The pictures through the model: this one (with and without δ), the clean one, and the
    # out-of-distribution check's fit, unless this server holds its detector or a study shipped one.
    spec = cal.split
    if spec is not None and not has_ood_detector(spec) and (found := shipped_detector(spec)) is not None:
        remember_detector(spec, found)
    fit = spec is not None and not has_ood_detector(spec)
    pictures = 4 + (MAX_FIT_IMAGES + MAX_THRESHOLD_IMAGES if fit else 0)
    probs, z, clean_probs, verdict, detector = call(picture_on_gpu, _picture_work, (cal, x, clean),
                                                    loaded, pictures)
    if detector is not None and cal.split is not None:
        remember_detector(cal.split, detector)
    return probs, z, clean_probs, verdict


@dataclass(frozen=True)
class Scored:
    """One picture's numbers, before any rendering: the model and calibration used, the picture as read
    (``img``) and as scored (``picture``, corrupted when ``severity`` > 0), its preprocessed input ``x``,
    the probabilities per way of scoring ({"raw", "ts"[, "nc"]}), its logits, the clean picture's
    probabilities (None at severity 0), the out-of-distribution verdict, and the notes on reading it."""

    loaded: Any
    cal: Calibration
    img: Image.Image
    picture: Image.Image
    x: torch.Tensor
    probs: dict[str, np.ndarray]
    z: torch.Tensor
    clean: dict[str, np.ndarray] | None
    verdict: Verdict
    name: str
    severity: int
    channel_note: str
    corruption_note: str


def score_picture(image: Any, state: Calibration | None, corruption: Any = DEFAULT_CORRUPTION,
                  severity: Any = 0) -> Scored:
    """One picture through the model as it is, with temperature scaling and with Neural Clamping, corrupted
    by ``corruption`` at ``severity`` (0: as it is) before the model's preprocessing."""
    name, severity = checked_corruption(corruption, severity)
    cal = current_calibration(state)
    loaded = get_model(cal.model)
    channels = int(loaded.data_config["input_size"][0])
    img, channel_note = match_channels(to_pil(image), channels)
    picture, corruption_note = corrupted(img, name, severity)
    x = loaded.preprocess(picture)
    if cal.delta is not None and tuple(cal.delta.shape) != tuple(x.shape):
        raise ImageError(f"The calibration's δ has shape {tuple(cal.delta.shape)} but the model input is "
                         f"{tuple(x.shape)}.")
    probs, z, clean, verdict = _picture_answers(loaded, cal, x, loaded.preprocess(img) if severity else None)
    return Scored(loaded, cal, img, picture, x, probs, z, clean, verdict, name, severity, channel_note,
                  corruption_note)


def classify_image(image: Any, state: Calibration | None, corruption: Any = DEFAULT_CORRUPTION,
                   severity: Any = 0) -> tuple[str, str, str, str]:
    """(verdict, confidence chart, δ view, details) for one picture, corrupted by ``corruption`` at
    ``severity`` (0: as it is) before the model's preprocessing."""
    from nctv import plots

    s = score_picture(image, state, corruption, severity)
    loaded, cal, probs = s.loaded, s.cal, s.probs
    shift = Shift(s.picture, s.name, s.severity, s.clean) if s.severity else None
    view = NO_DELTA
    if cal.delta is not None:
        mean, std = loaded.data_config["mean"], loaded.data_config["std"]
        view = delta_view(plots.delta_image_data(cal.delta, mean, std, example=s.x, title=f"δ of {cal.nc_method}"),
                          picture="Your picture", group=DELTA_GROUP,
                          effect=delta_effect(loaded.class_names, probabilities(s.z / cal.nc_temperature), probs["nc"]))
    lines = [s.verdict.how, classes_sentence(loaded.class_names), _calibration_line(cal), s.corruption_note,
             f"Your picture ({s.img.size[0]} × {s.img.size[1]} pixels) was resized and normalised as the model "
             f"expects: {tuple(s.x.shape)} (channels, height, width)."] + ([s.channel_note] if s.channel_note else [])
    chart = confidence_chart(loaded.class_names, probs, s.verdict.flagged, shift, trust_sentence(cal, list(probs)),
                             set_sentence(cal, s.z, loaded.class_names, s.verdict.flagged, s.severity))
    return (verdict_html(s.verdict), chart, view,
            "\n\n".join(line for line in lines if line))


def cleared() -> tuple[str, str, str, str]:
    """The tab with no result: the hint, and nothing of an earlier picture."""
    return verdict_html(None), "", "", ""


@user_errors
def classify(image: Any, state: Calibration | None = None, corruption: Any = DEFAULT_CORRUPTION, severity: Any = 0):
    """An uploaded, pasted, webcam or example picture (a file path), corrupted by ``corruption`` at
    ``severity`` (0: as it is); nothing yet gives the hint."""
    if image is None:
        checked_corruption(corruption, severity)  # a bad value is refused with or without a picture
        return cleared()
    return classify_image(image, state, corruption, severity)


@user_errors
def classify_drawing(drawing: Any, state: Calibration | None = None, corruption: Any = DEFAULT_CORRUPTION,
                     severity: Any = 0):
    """A drawing from the sketchpad (an editor value: background, layers, composite), corrupted as in
    :func:`classify`."""
    if isinstance(drawing, dict) and drawing.get("composite") is not None:
        arr = np.asarray(drawing["composite"])
        if arr.size and (arr == arr.reshape(-1, *arr.shape[2:])[0]).all():
            raise ImageError("The drawing is empty: draw something on the canvas first.")
    return classify_image(drawing, state, corruption, severity)


#: What a change of the corruption applies to: the picture or the drawing, whichever was classified last.
PICTURE, DRAWING = "picture", "drawing"


def reclassify(last: Any, image: Any, drawing: Any, state: Calibration | None, corruption: Any, severity: Any):
    """A new corruption or severity, applied to what was classified last (``last``: PICTURE or DRAWING)."""
    if last == DRAWING:
        return classify_drawing(drawing, state, corruption, severity)
    return classify(image, state, corruption, severity)
