"""Figures and tables for slides, from every tab: each figure as PNG, SVG and PDF at a widescreen slide's
size and in the presenter style (:func:`nctv.plots.slide_figure`, :func:`nctv.plots.save_slides`), each
table as a frame of a Beamer document, ``slides.tex`` (:func:`nctv.report.beamer_document`).

The Calibrate, γ sweep and Initialisation tabs and the Shift tab's study write theirs beside their other
downloads (:func:`figure_files`, :func:`tables_file`; a shipped study's once per server,
:func:`shipped_files`). The views the page draws as a visitor moves them (Learn at the T and bins on
screen, Shift at the condition on screen, Try's confidences) each have a small "Download this figure"
control (:func:`figure_control`): the page says what it shows, and a light handler draws that from the
numbers the server holds (Learn's test logits, the shift study) or, for Try, checks and draws the numbers
the page sent (the confidences the model gave). None of them passes a picture through a model.
"""
from __future__ import annotations

import hashlib
import math
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from nctv import metrics, plots, report
from nctv.ui.common import export_dir, user_errors
from nctv.ui.session import Calibration

#: The Beamer document of a download's tables.
SLIDES_TEX = "slides.tex"
#: Where shipped studies' slide files live, one folder per study, as long as the server.
SHIPPED_ROOT = Path(tempfile.gettempdir()) / "nctv-app-shipped"
#: The label of every "Download this figure" control's file list.
FILES_LABEL = "This figure for slides (PNG, SVG, PDF)"


def figure_files(stem: Path, draw: Callable[..., Any], *args: Any, **kwargs: Any) -> list[str]:
    """``draw(*args, **kwargs)`` (a figure function of :mod:`nctv.plots`) drawn for a slide and written
    as ``stem``.png, .svg and .pdf."""
    return [str(p) for p in plots.save_slides(plots.slide_figure(draw, *args, **kwargs), stem)]


def tables_file(folder: Path, tables: Sequence[report.Table]) -> str:
    """``slides.tex`` in ``folder``: one Beamer frame per table."""
    path = folder / SLIDES_TEX
    path.write_text(report.beamer_document(tables), encoding="utf-8")
    return str(path)


def reliability_files(result: Any, n_bins: int, folder: Path) -> list[str]:
    """A run's reliability diagrams for slides: every method's binned diagram on one slide
    (``reliability``), their smoothed diagrams with the bands at the run's interval settings on another
    (``smooth_reliability``), both from one computation of the numbers."""
    data = plots.reliability_data_from_result(result, n_bins, smooth=True)
    per_row = plots.slide_columns(len(data))
    return (figure_files(folder / "reliability", plots.reliability_figure, data, panels=("binned",), per_row=per_row)
            + figure_files(folder / "smooth_reliability", plots.reliability_figure, data, panels=("smooth",),
                           per_row=per_row))


_shipped: dict[str, list[str]] = {}
_shipped_lock = threading.Lock()


def shipped_files(study: Path, make: Callable[[Path], list[str]], variant: Any = "") -> list[str]:
    """The files ``make(folder)`` writes for the shipped study read from ``study`` (and ``variant``, say
    its bin count), made once per server in a folder of that study's own (menu models' studies never
    share one)."""
    key = f"{Path(study).resolve()}\n{variant}"
    folder = SHIPPED_ROOT / hashlib.sha256(key.encode()).hexdigest()[:16]
    with _shipped_lock:
        if str(folder) not in _shipped:
            folder.mkdir(parents=True, exist_ok=True)
            _shipped[str(folder)] = make(folder)
        return list(_shipped[str(folder)])


# --------------------------------------------------------------------------- the controls


def figure_control(name: str, read: str, handler: Callable[..., Any], inputs: Sequence[Any], **light: Any) -> None:
    """A "Download this figure" button and, once pressed, the files: the page reads what it shows with
    ``read`` (a JavaScript expression), then ``handler(that value, *inputs)`` draws it. ``light``: the
    app's settings of a light handler (never the heavy lane)."""
    import gradio as gr

    button = gr.Button("Download this figure for slides", size="sm", elem_id=f"{name}-slides-button")
    shown = gr.JSON(visible=False)
    files = gr.File(label=FILES_LABEL, file_count="multiple", interactive=False, visible=False,
                    elem_id=f"{name}-slides-files", elem_classes="download-list")
    # A list of the outputs' values: a bare list (Try's rows) would be read as one value per output.
    button.click(None, None, shown, js=f"() => {{ try {{ return [{read}]; }} catch (e) {{ return [null]; }} }}",
                 queue=False, api_visibility="private").then(
        handler, [shown, *inputs], files, show_progress="minimal", api_visibility="private", **light)


def _files(paths: list[str]) -> Any:
    import gradio as gr

    return gr.update(value=paths, visible=True)


def _field(view: Any, key: str) -> Any:
    if not isinstance(view, dict):
        raise ValueError("The page did not say what it shows; reload it and try again.")
    return view.get(key)


#: What the Learn control reads: the T and bins on screen (the view's data attributes).
LEARN_READ = ("(({temperature, bins}) => ({temperature, bins}))"
              "(document.querySelector('#learn-view [data-temperature]').dataset)")
#: Resamples behind the band of Learn's smoothed diagram, as the page's own band once T settles.
LEARN_RESAMPLES = 100


def learn_figure(view: Any, state: Calibration | None) -> list[str]:
    """The Learn view at the T and bins on screen (``view``: {"temperature", "bins"}): its binned and
    smoothed diagrams, and its table at T = 1, at that T and at temperature scaling's T as a Beamer
    frame, from the test logits the page holds (the visitor's run, else the pre-computed one)."""
    from nctv.intervals import IntervalSettings
    from nctv.ui.learn import _checked
    from nctv.ui.shipped import load_precomputed, test_logits_of

    t, n_bins = _checked(_field(view, "temperature"), _field(view, "bins"))
    z, y, where = test_logits_of(state)
    z = z.double()  # as the page and the Learn table divide
    fitted = (state if state is not None else load_precomputed().calibration).ts_temperature
    shown = plots.reliability_data(z / t, y, n_bins, f"T = {t:.2f}", smooth=IntervalSettings(resamples=LEARN_RESAMPLES))
    rows = [("T = 1 (uncalibrated)", metrics.evaluate(z, y, n_bins)), (f"T = {t:.2f} (on screen)",
            metrics.evaluate(z / t, y, n_bins)), (f"T = {fitted:.3f} (temperature scaling)",
                                                  metrics.evaluate(z / fitted, y, n_bins))]
    table = report.metrics_table(rows, int(z.shape[1]), notes=[f"{n_bins} bins; {where}."],
                                 title=f"The model at T = {t:.2f}")
    out = export_dir("slides-learn")
    stem = f"learn_T{t:.2f}_{n_bins}bins"
    return figure_files(out / stem, plots.reliability_figure, shown, panels=plots.PANELS, per_row=2) + [
        tables_file(out, [table])]


@user_errors
def learn_download(view: Any, state: Calibration | None = None):
    """The Learn control's handler: :func:`learn_figure`, shown as the control's files."""
    return _files(learn_figure(view, state))


#: What the Shift control reads: the condition on screen and the corruption picked.
SHIFT_READ = ("({condition: document.querySelector('#shift-view [data-condition]').dataset.condition, "
              "corruption: document.querySelector('#shift-corruption').value})")


def shift_figure(view: Any, model: Any = None, hub_id: Any = None) -> list[str]:
    """The Shift view at the condition on screen (``view``: {"condition", "corruption"}) from the study the
    page shows (``model``'s own, else the shipped one): the ECE curves of the corruption picked and of
    the mean over corruptions with the severity on screen marked, and every method's reliability
    diagram under that condition."""
    import dataclasses

    from nctv.shift import AVERAGE, CLEAN

    result = _shown_study(model, hub_id)
    condition, corruption = _field(view, "condition"), _field(view, "corruption")
    if condition not in result.conditions or corruption not in result.corruptions:
        raise ValueError("This study has no such condition: pick a corruption and a severity on the page.")
    severity = 0 if condition == CLEAN else int(condition.rsplit("/", 1)[1])
    curves = dataclasses.replace(plots.shift_curve_data(result), panels=(corruption, AVERAGE), marked=severity)
    diagrams = [plots.reliability_data_from_bins(m, b["count"], b["confidence"], b["accuracy"],
                                                 result.figure(m, condition, "ece")["value"])
                for m, per in result.reliability.items() for b in [per[condition]]]
    out = export_dir("slides-shift")
    stem = condition.replace("/", "-")
    return (figure_files(out / f"shift_{stem}_curves", plots.shift_figure, curves, per_row=2)
            + figure_files(out / f"shift_{stem}_diagrams", plots.reliability_figure, diagrams, panels=("binned",),
                           per_row=plots.slide_columns(len(diagrams))))


def _shown_study(model: Any, hub_id: Any) -> Any:
    """The shift study the page shows: the picked menu model's own, else the shipped one
    (as :func:`nctv.ui.shift.first_view` picks it)."""
    from nctv.shift import SHIFT_FILE, ShiftResult
    from nctv.ui.shipped import NO_STUDY, shipped_shift, study_of

    if isinstance(model, str) and not (isinstance(hub_id, str) and hub_id.strip()):
        try:
            found = study_of(model, SHIFT_FILE)
        except ValueError:  # the page shows the shipped study then
            found = None
        if found is not None:
            return ShiftResult.from_dict(found[0])
    result = shipped_shift()
    if result is None:
        raise ValueError(NO_STUDY)
    return result


@user_errors
def shift_download(view: Any, model: Any = None, hub_id: Any = None):
    """The Shift control's handler: :func:`shift_figure`, shown as the control's files."""
    return _files(shift_figure(view, model, hub_id))


#: What the Try control reads: per class row of the chart, its name and each bar's method and
#: confidence (and where the clean picture's was, for a corrupted one).
TRY_READ = ("[...document.querySelectorAll('#try-chart .nctv-class')].map((row) => ({name: row.dataset.class, "
            "bars: [...row.querySelectorAll('.nctv-bar')].map((b) => ({method: b.dataset.method, "
            "confidence: Number(b.dataset.confidence), "
            "clean: b.dataset.clean === undefined ? null : Number(b.dataset.clean)}))}))")
#: The most class rows a chart holds: every method's top five (``nctv.ui.try_image.shown_classes``).
TRY_MAX_ROWS = 15
TRY_MAX_NAME = 200


def try_figure(rows: Any) -> list[str]:
    """Try's chart as a figure: the confidence per class row the page shows, before calibration and
    after (``rows``: [{"name", "bars": [{"method", "confidence", "clean"}]}], as the page's chart holds
    them; checked here, since a page may send anything)."""
    from nctv.ui.try_image import METHODS

    known = {key: (name, colour) for key, _, name, colour in METHODS}
    if not isinstance(rows, list) or not rows:
        raise ValueError("No picture has been classified yet: pick or draw one first.")
    if len(rows) > TRY_MAX_ROWS:
        raise ValueError(f"A chart holds at most {TRY_MAX_ROWS} classes; {len(rows)} were sent.")
    names, probs, clean = [], {}, {}
    for row in rows:
        name = _field(row, "name")
        bars = _field(row, "bars")
        if not isinstance(name, str) or not 0 < len(name) <= TRY_MAX_NAME or not isinstance(bars, list):
            raise ValueError(f"Each class needs a name of 1 to {TRY_MAX_NAME} characters and its bars.")
        ways = [_field(b, "method") for b in bars]
        if not ways or len(set(ways)) != len(ways) or not set(ways) <= set(known) or (probs and ways != list(probs)):
            raise ValueError(f"Each class needs one bar for each of {', '.join(known)}, in the same order.")
        names.append(name)
        for b in bars:
            probs.setdefault(b["method"], []).append(_probability(b.get("confidence")))
            clean.setdefault(b["method"], []).append(None if b.get("clean") is None else _probability(b["clean"]))
    corrupted = all(v is not None for values in clean.values() for v in values)
    data = plots.picture_confidence_data(
        names, {known[k][0]: v for k, v in probs.items()}, {known[k][0]: known[k][1] for k in probs},
        {known[k][0]: v for k, v in clean.items()} if corrupted else None)
    return figure_files(export_dir("slides-try") / "confidence", plots.picture_confidence_figure, data)


def _probability(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= 1:
        raise ValueError("Confidences must be numbers from 0 to 1.")
    return float(value)


@user_errors
def try_download(rows: Any):
    """The Try control's handler: :func:`try_figure`, shown as the control's files."""
    return _files(try_figure(rows))
