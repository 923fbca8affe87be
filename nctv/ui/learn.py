"""The Learn tab: move a temperature and watch the reliability diagram, its smoothed twin, ECE, smooth
ECE, accuracy and mean confidence follow. The page computes those itself (``static/learn.js``) from the test logits that
:func:`page_data` sends once per calibration; the server writes the table and the explanations, with
the numbers of the model in use, once T settles; the paper's headline results for reference.

A lecture hall asks the same questions of the same calibration (the shipped one, or a menu model's
pre-computed one): the server's answers for those are kept per (calibration, T, bins), and the rows at
T = 1 and at temperature scaling's T per (calibration, bins)."""
from __future__ import annotations

import base64
import functools
import html
import io
import math
import re
from importlib import resources
from typing import Any

import gradio as gr
import numpy as np
import torch

from nctv import metrics, report
from nctv.checks import read_number, shown
from nctv.settings import APP_BINS
from nctv.ui.common import parse_whole, user_errors
from nctv.ui.caches import test_pictures
from nctv.ui.session import Calibration, SplitSpec
from nctv.ui import lesson
from nctv.ui.shipped import PRECOMPUTED_LABEL, load_precomputed, test_logits_of

T_MIN, T_MAX, T_STEP = 0.05, 5.0, 0.01
BINS_MIN, BINS_MAX = 5, 50
#: At most this many logits go to the page (3 MB as float32); a larger test split goes as a seeded sample.
PAGE_MAX_VALUES = 750_000
PAGE_SAMPLE_SEED = 0
#: An opened group shows at most this many pictures; a request for more rows is refused.
BIN_MAX_ROWS = 200
#: Thumbnails are at most this many pixels on their longer side (small images are sent as they are).
THUMB_PX = 96
#: Answers kept for the calibrations every visitor may hold (see :func:`_shared`): about 30 KB each.
ANSWERS_KEPT = 2048

#: the paper's ECE (%) on the test split, 15 bins, mean over 5 runs.
PAPER_TABLE = """| setup | uncalibrated | TS | TS grid | Dir-ODIR | NC (FL) |
| :-- | --: | --: | --: | --: | --: |
| ResNet-50, BloodMNIST | 5.77 | 1.77 | 2.13 | 1.55 | **1.05** |
| ResNet-110, CIFAR-100 | 10.74 | 1.71 | 1.35 | 1.36 | **0.89** |
| Wide-ResNet-40-10, CIFAR-100 | 7.63 | 2.30 | 1.75 | 1.81 | **1.67** |
| ResNet-101, ImageNet | 5.88 | 1.88 | 2.02 | 3.47 | **1.68** |
| ViT-S/16, ImageNet | 1.28 | 1.08 | 0.82 | 0.93 | **0.77** |
| MLP-Mixer B/16, ImageNet | 11.55 | 4.94 | 2.60 | 4.68 | **2.27** |

ECE in % on the test split (15 bins, mean over 5 runs), as reported by Tang, Chen & Ho,
"Neural Clamping: Joint Input Perturbation and Temperature Scaling for Neural Network
Calibration" (TMLR 2024). Lowest per row in bold."""


#: The Learn table's columns and rows (``learn.explain``'s, and the page's, which computes them itself): each
#: row's key in the page and its label, where ``{t}`` is the view's T and ``{fit}`` the temperature-scaling fit.
TABLE_METRICS = ("accuracy", "entropy", "ece", "aece", "sce")
TABLE_ROWS = (("one", "T = 1 (uncalibrated)"), ("now", "T = {t} (slider)"), ("fit", "T = {fit} (temperature scaling)"))
TABLE_NOTE = "{bins} bins; {split}."
#: Numbers of the view (T, the bins and the table's figures, "now.ece" …) in the table and the explanations,
#: written with this many decimals (``number``); the page writes them alike (learn.js ``fixed``).
VIEW_DECIMALS = {"t": 2, "bins": 0, "width": 3, "last": 3, "perbin": 0}
_PLACEHOLDER = re.compile(r"\{([a-z]+(?:\.[a-z]+)?)\}")


def _scores(z: torch.Tensor, y: torch.Tensor, n_bins: int) -> dict[str, float]:
    return {"accuracy": metrics.accuracy(z, y), "entropy": metrics.entropy(z), "ece": metrics.ece(z, y, n_bins),
            "aece": metrics.aece(z, y, n_bins), "sce": metrics.sce(z, y, n_bins)}


def number(x: float, decimals: int) -> str:
    """``x`` with ``decimals`` decimals and thousands separators, as the Learn page writes it; a value
    that rounds to 0 has no sign ("-0.00" reads as a finding), as in the tables."""
    s = f"{x:,.{decimals}f}"
    return s.lstrip("-") if float(s.replace(",", "")) == 0 else s


def fill(template: str, values: dict[str, str], partial: bool = False) -> str:
    """``template`` with each ``{name}`` replaced by ``values[name]``; with ``partial``, names not in
    ``values`` stay for the page to fill (learn.js fills the view's numbers the same way)."""
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)) if partial else values[m.group(1)], template)


def view_formats(k: int) -> dict[str, tuple[float, int]]:
    """{name: (scale, decimals)} of every number of the view: T, the bins, and each table row's figures
    in the table's units (``report.metric_column``)."""
    out = {name: (1.0, d) for name, d in VIEW_DECIMALS.items()}
    for row, _ in TABLE_ROWS:
        for c in (report.metric_column(m, k) for m in TABLE_METRICS):
            out[f"{row}.{c.key}"] = (c.scale, c.decimals)
    return out


def view_values(t: float, n: int, k: int, n_bins: int, rows: dict[str, dict[str, float]]) -> dict[str, str]:
    """The view's numbers as the table and the explanations write them (``rows``: the scores of
    "one", "now" and "fit")."""
    raw = {"t": t, "bins": n_bins, "width": 1 / n_bins, "last": 1 - 1 / n_bins, "perbin": n / n_bins}
    raw.update({f"{row}.{m}": v for row, scores in rows.items() for m, v in scores.items()})
    return {name: number(scale * raw[name], d) for name, (scale, d) in view_formats(k).items()}


def explanation_blocks(n: int, k: int, cal: Calibration) -> list[tuple[str, str]]:
    """Short explanations of ECE, AECE, SCE, temperature scaling and Neural Clamping with the numbers of
    the model in use, as ("h", heading) and ("p", paragraph) blocks with **bold** and *italics*; the
    view's numbers are placeholders ({t}, {now.ece}, …; :func:`view_values`)."""
    sce = report.metric_column("sce", k)
    text = [
        ("h", "What the numbers mean"),
        ("p", "**Confidence** is the probability of the predicted (top) class. A model is *calibrated* when, among "
              "predictions made with confidence 80%, about 80% are right."),
        ("p", f"**ECE** (expected calibration error): the {n:,} test predictions are sorted into {{bins}} bins of "
              "equal width by confidence (0–{width}, …, {last}–1). In each bin the accuracy (share "
              "correct) is compared with the mean confidence; ECE is the average gap, each bin weighted by its share of "
              "the predictions. In the diagram the blue bars are the accuracies, the shaded bars reach from there to "
              "each bin's mean confidence: the gaps. At T = {t} it is **{now.ece}%** (0% is perfect)."),
        ("p", "**Smooth ECE** needs no bins: each prediction's gap (confidence minus right or wrong) is averaged with "
              "those of its neighbours in confidence through a Gaussian kernel whose width the data choose, and the "
              "average size of the smoothed gap is the smooth ECE (Błasiok & Nakkiran, 2024). The curve beside the "
              "bars is that smoothed share correct; once T settles, the shaded band around it is its 95% interval "
              "from 100 resamples of the test pictures."),
        ("p", "**AECE** (adaptive ECE): the same formula, but every bin holds the same number of predictions (about "
              "{perbin} here), so the crowded high-confidence range is examined in more detail. At T = {t}: "
              "**{now.aece}%**."),
        ("p", f"**SCE** (static calibration error) checks every class, not only the top one: for each of the {k} "
              "classes the probabilities given to that class are binned and compared with how often that class is "
              "the true one; SCE is the average over the classes. At T = {t}: "
              f"**{{now.sce}} {sce.unit}**."),
        ("p", "**Entropy** is the average uncertainty of the predicted distribution, in nats: 0 for one-hot "
              f"predictions, at most ln {k} = {math.log(k):.3f} for uniform ones. At T = {{t}}: **{{now.entropy}}**."),
        ("h", "The two methods"),
        ("p", "**Temperature scaling** divides the logits by one number T > 0 before the softmax. T > 1 softens the "
              "probabilities (lower confidence, higher entropy), T < 1 sharpens them; the predicted class never "
              "changes, so the accuracy stays {now.accuracy}% whatever the slider says. T is fitted by minimising "
              "the negative log-likelihood on the calibration split; for this model that gives "
              f"**T = {cal.ts_temperature:.3f}**."),
    ]
    nc = cal.nc_method
    nc_text = ("**Neural Clamping** adds one learned perturbation δ, the shape of one preprocessed input, to "
               "every input and divides the logits by a temperature: f(x + δ)/T. δ and T are learned together on "
               "the calibration split by minimising the focal loss plus λ‖δ‖². Temperature scaling is the "
               "special case δ = 0; because δ changes the input, Neural Clamping can also change predictions, "
               "usually keeping accuracy about the same.")
    if nc is not None and cal.nc_temperature is not None and nc in cal.metrics and "Uncalibrated" in cal.metrics:
        m, u = cal.metrics[nc], cal.metrics["Uncalibrated"]
        nc_text += (f" In the calibration in use ({cal.source}), {nc} learned T = {cal.nc_temperature:.3f}; its "
                    f"test ECE is {100 * m['ece']:.2f}% against {100 * u['ece']:.2f}% uncalibrated"
                    + (f" and {100 * cal.metrics['Temperature Scaling']['ece']:.2f}% with temperature scaling"
                       if "Temperature Scaling" in cal.metrics else "")
                    + f" ({cal.n_bins} bins), accuracy {100 * m['accuracy']:.2f}%.")
    text.append(("p", nc_text))
    return text


def blocks_markdown(blocks: list[tuple[str, str]]) -> str:
    return "\n\n".join(f"### {s}" if kind == "h" else s for kind, s in blocks)


def blocks_html(blocks: list[tuple[str, str]]) -> str:
    """The blocks as HTML for the page: every character escaped, then **bold** and *italics* marked."""
    def inline(s: str) -> str:
        s = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", html.escape(s, quote=False))
        return re.sub(r"\*(.+?)\*", r"<em>\1</em>", s)
    return "".join(f"<h3>{inline(s)}</h3>" if kind == "h" else f"<p>{inline(s)}</p>" for kind, s in blocks)


def explanations(t: float, n: int, k: int, n_bins: int, rows: dict[str, dict[str, float]], cal: Calibration) -> str:
    """The explanations (Markdown) at T with the scores ``rows`` ("one", "now", "fit")."""
    return fill(blocks_markdown(explanation_blocks(n, k, cal)), view_values(t, n, k, n_bins, rows))


def _calibration(state: Calibration | None) -> Calibration:
    # test_logits_of answered from the visitor's run or from the shipped result: either has a calibration.
    return state if state is not None else load_precomputed().calibration


def _checked(temperature: Any, n_bins: Any) -> tuple[float, int]:
    t = read_number(temperature)
    if t is None:
        raise ValueError(f"The temperature must be a number; got {shown(temperature)}.")
    if not math.isfinite(t) or not T_MIN <= t <= T_MAX:
        raise ValueError(f"The temperature must lie between {T_MIN:g} and {T_MAX:g}; got {shown(temperature)}.")
    return t, parse_whole(n_bins, "Number of bins", 2, 100)


def _shared(state: Calibration | None) -> tuple[bool, str | None]:
    """(whether ``state`` is a calibration every visitor may hold, under which name): the shipped
    default's (no state: None) or a menu model's pre-computed one (its model), whose logits and numbers
    :func:`~nctv.ui.shipped.test_logits_of` and :func:`_calibration` read from the pre-computed study."""
    if state is None:
        return True, None
    return state.source == PRECOMPUTED_LABEL, state.model


def _shared_state(name: str | None) -> Calibration | None:
    return None if name is None else load_precomputed(name).calibration


def _kept(compute):
    """``compute(t, n_bins, state)``, its answers kept per (calibration, T, bins) for the shared
    calibrations (:func:`_shared`), computed each time for a visitor's own."""
    @functools.lru_cache(maxsize=ANSWERS_KEPT)
    def shared(t: float, n_bins: int, name: str | None):
        return compute(t, n_bins, _shared_state(name))

    @functools.wraps(compute)
    def kept(t: float, n_bins: int, state: Calibration | None):
        common, name = _shared(state)
        return shared(t, n_bins, name) if common else compute(t, n_bins, state)

    return kept


def _references(z: torch.Tensor, y: torch.Tensor, n_bins: int, cal: Calibration) -> dict:
    """The rows at T = 1 and at temperature scaling's T, and the diagram's data at T = 1."""
    from nctv import plots

    return {"one": _scores(z, y, n_bins), "fit": _scores(z / cal.ts_temperature, y, n_bins),
            "diagram": plots.reliability_data(z, y, n_bins, "T = 1 (uncalibrated)")}


@functools.lru_cache(maxsize=64)
def _shared_references(n_bins: int, name: str | None) -> dict:
    state = _shared_state(name)
    z, y, _ = _logits(state)
    return _references(z, y, n_bins, _calibration(state))


def _logits(state: Calibration | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    z, y, where = test_logits_of(state)
    # float64 before dividing: the page divides in float64 too, so its figures match these.
    return z.double(), y, where


def _explain(t: float, n_bins: int, state: Calibration | None) -> tuple[str, str, torch.Tensor, torch.Tensor, str, dict]:
    """(metrics table, explanations, test logits in float64, labels, where they come from, the
    references of :func:`_references`) at T."""
    z, y, where = _logits(state)
    cal = _calibration(state)
    common, name = _shared(state)
    refs = _shared_references(n_bins, name) if common else _references(z, y, n_bins, cal)
    n, k = (int(s) for s in z.shape)
    scores = {"one": refs["one"], "now": _scores(z / t, y, n_bins), "fit": refs["fit"]}
    names = {"t": f"{t:.2f}", "fit": f"{cal.ts_temperature:.3f}"}
    rows = [(fill(label, names), scores[key]) for key, label in TABLE_ROWS]
    note = fill(TABLE_NOTE, {"bins": str(n_bins), "split": "test split"})
    table = report.to_markdown(report.metrics_table(rows, k, TABLE_METRICS, notes=[note]))
    return table, explanations(t, n, k, n_bins, scores, cal), z, y, where, refs


@_kept
def _explained(t: float, n_bins: int, state: Calibration | None) -> tuple[str, str]:
    return _explain(t, n_bins, state)[:2]


@_kept
def _explored(t: float, n_bins: int, state: Calibration | None) -> tuple:
    from nctv import plots

    table, text, z, y, where, refs = _explain(t, n_bins, state)
    fig = plots.reliability_figure([refs["diagram"], plots.reliability_data(z / t, y, n_bins, f"T = {t:.2f}")],
                                   backend="plotly")
    # Sized by its box on the page already: a kept figure is shared, and nothing changes it afterwards.
    fig.update_layout(title=f"Reliability diagrams — {where}", height=440, margin=dict(t=90, b=50), width=None,
                      autosize=True)
    return fig, table, text


def explore(temperature: Any, n_bins: Any, state: Calibration | None) -> tuple:
    """(reliability diagrams at T = 1 and at ``temperature``, metrics table, explanations): the
    ``/explore_temperature`` endpoint's answer. The figure may be shared with other callers: read it,
    do not change it."""
    return _explored(*_checked(temperature, n_bins), state)


@user_errors
def explore_temperature(temperature: float, n_bins: int, state: Calibration | None = None):
    return explore(temperature, n_bins, state)


def explain(temperature: Any, n_bins: Any, state: Calibration | None) -> tuple[str, str]:
    """(metrics table, explanations) at ``temperature``."""
    return _explained(*_checked(temperature, n_bins), state)


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def page_data(state: Calibration | None) -> dict:
    """What the page needs to draw and write on its own, sent once per calibration: the test logits
    (float32, little-endian, base64; a seeded sample of rows when the split has more than
    :data:`PAGE_MAX_VALUES` logits), the labels (int32), the temperature-scaling T, the table's and
    the explanations' words with the view's numbers left to fill (:func:`page_words`) and the lesson;
    or, with no calibration at all, a message."""
    try:
        z, y, where = test_logits_of(state)
    except ValueError as e:
        return {"message": str(e)}
    n, k = (int(s) for s in z.shape)
    rows = min(n, max(1, PAGE_MAX_VALUES // k))
    if rows < n:
        keep = torch.randperm(n, generator=torch.Generator().manual_seed(PAGE_SAMPLE_SEED))[:rows].sort().values
        z, y = z[keep], y[keep]
        # The sample's rows in the split, so that the page can ask for the pictures of a group.
        sampled = {"rows": _b64(keep.numpy().astype("<i4"))}
    else:
        sampled = {}
    cal = _calibration(state)
    return {"logits": _b64(z.detach().cpu().numpy().astype("<f4")), "labels": _b64(y.cpu().numpy().astype("<i4")),
            "n": rows, "k": k, "n_total": n, "where": where, "ts_temperature": cal.ts_temperature,
            "words": page_words(cal, rows, n, k), "link_model": _link_model(state), **sampled}


def page_words(cal: Calibration, n: int, n_total: int, k: int) -> dict:
    """The table's and the explanations' words for a page holding ``n`` of the ``n_total`` test pictures,
    the calibration's own numbers written in, the view's left as placeholders (:func:`view_formats` says
    how to write each), and the lesson's steps (:mod:`nctv.ui.lesson`), their paragraphs as HTML."""
    fitted = {"fit": f"{cal.ts_temperature:.3f}", "n": f"{n:,}"}
    split = "test split" if n == n_total else f"a seeded sample of {n:,} of the test split's {n_total:,} pictures"
    return {
        "columns": [[c.key, c.label()] for c in (report.metric_column(m, k) for m in TABLE_METRICS)],
        "rows": [[key, fill(label, fitted, partial=True)] for key, label in TABLE_ROWS],
        "note": fill(TABLE_NOTE, {"split": split}, partial=True),
        "formats": view_formats(k),
        "text": blocks_html(explanation_blocks(n, k, cal)),
        "lesson": [{"title": s.title, "t": s.t, "bins": s.bins or cal.n_bins, "group": s.group,
                    "text": fill(blocks_html([("p", text)]), fitted, partial=True)}
                   for s, text in zip(lesson.STEPS, lesson.paragraphs(cal, n), strict=True)],
    }


def _link_model(state: Calibration | None) -> str | None:
    """The menu model whose pre-computed study the page shows (so that a link naming it shows the same
    logits to whoever opens it); None for the shipped default and for a visitor's own run."""
    from nctv.zoo import DEFAULT_MODEL

    if state is None or state.source != PRECOMPUTED_LABEL or state.model == DEFAULT_MODEL:
        return None
    return state.model


def checked_rows(rows: Any, n: int) -> list[int]:
    """The row numbers a page asked for: a list of at most :data:`BIN_MAX_ROWS` whole numbers in
    [0, n), or a ValueError in the visitor's words (the request comes from the page, so anything goes)."""
    if not isinstance(rows, list | tuple):
        raise ValueError("The pictures to show must be a list of row numbers.")
    if len(rows) > BIN_MAX_ROWS:
        raise ValueError(f"At most {BIN_MAX_ROWS} pictures can be shown at once; {len(rows)} were asked for.")
    # bool is an int in Python, a float may carry a fraction: only true integers are row numbers.
    if not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < n for r in rows):
        raise ValueError(f"Row numbers must be whole numbers from 0 to {n - 1}.")
    return list(rows)


def _thumbnail(image) -> tuple[str, bool]:
    """(PNG data URL, whether it is small enough to be enlarged pixel by pixel) of a split's image."""
    image = image.convert("RGB") if image.mode not in ("L", "RGB") else image
    small = max(image.size) <= THUMB_PX // 2
    if max(image.size) > THUMB_PX:
        image = image.copy()
        image.thumbnail((THUMB_PX, THUMB_PX))
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii"), small


def pictures(spec: SplitSpec, rows: list[int], labels: Any, before: tuple[Any, Any], after: tuple[Any, Any]) -> list[dict]:
    """The pictures of the test rows ``rows`` of ``spec``'s test split with their true label (``labels``
    of the whole split), the model's prediction (class names) and its confidence before and after
    calibration: ``before`` and ``after`` are (top-label confidence, predicted class) of the asked rows,
    in their order. A picture is right when the calibrated prediction is."""
    split = test_pictures(spec)
    names = split.class_names
    out = []
    for i, row in enumerate(rows):
        src, small = _thumbnail(split.image(row))
        label, first, then = int(labels[row]), int(before[1][i]), int(after[1][i])
        out.append({"row": row, "src": src, "small": small, "label": names[label], "prediction": names[first],
                    "prediction_after": names[then], "right": label == then,
                    "confidence_before": float(before[0][i]), "confidence_after": float(after[0][i])})
    return out


def bin_pictures(rows: Any, temperature: Any, state: Calibration | None) -> list[dict]:
    """The pictures of the test rows ``rows`` (see :func:`pictures`), before calibration (T = 1) and
    at ``temperature``, in the order asked."""
    t, _ = _checked(temperature, APP_BINS)
    z, y, _ = test_logits_of(state)
    rows = checked_rows(rows, int(z.shape[0]))
    spec = state.split if state is not None and state.split is not None else load_precomputed().split
    z = z[rows].double()
    conf1, pred = torch.softmax(z, dim=1).max(dim=1)
    # Dividing by T never changes the predicted class.
    return pictures(spec, rows, y, (conf1.numpy(), pred.numpy()),
                    (torch.softmax(z / t, dim=1).max(dim=1).values.numpy(), pred.numpy()))


@user_errors
def open_bin(state: Calibration | None, evt: gr.EventData) -> dict:
    """The page's "open_bin" event: the asked rows' pictures for the view's ``bin`` property, with the
    page's request number (an answer to an older request is then ignored), or a message."""
    data = evt._data if isinstance(evt._data, dict) else {}
    request = data.get("request")
    answer = {"request": request if isinstance(request, int) else 0}
    try:
        answer["items"] = bin_pictures(data.get("rows"), data.get("temperature"), state)
    except (ValueError, IndexError) as e:
        answer["message"] = str(e)
    return gr.update(bin=answer)


def _static(name: str) -> str:
    return (resources.files("nctv.ui") / "static" / name).read_text(encoding="utf-8")


def diagram_widget(widget: str, value: Any = None, **props: Any) -> gr.HTML:
    """A widget of ``static/<widget>.{html,css,js}`` that draws reliability diagrams in the page: its
    style and script follow the shared ``static/diagram.{css,js}`` (the drawing, the smooth ECE, the
    opened group's pictures)."""
    return gr.HTML(value, html_template=_static(f"{widget}.html"),
                   css_template=_static("diagram.css") + _static(f"{widget}.css"),
                   js_on_load=_static("diagram.js") + _static(f"{widget}.js"), **props)


def page_view() -> gr.HTML:
    """The page's controls and diagrams (``static/learn.{html,css,js}``); its value, empty at first,
    becomes :func:`page_data` when the tab is first shown (its "first_view" event)."""
    return diagram_widget("learn", elem_id="learn-view", t_min=T_MIN, t_max=T_MAX, t_step=T_STEP, bins_min=BINS_MIN,
                          bins_max=BINS_MAX, bins=APP_BINS, bin=None, steps=len(lesson.STEPS))
