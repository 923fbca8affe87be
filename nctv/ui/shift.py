"""The Shift tab: does a calibration fitted on clean pictures hold when the test pictures are noisy,
blurred or faded? A visitor picks a corruption and drags its severity; the page
(``static/shift.{html,css,js}``) shows the corrupted example pictures, every method's reliability
diagram and ECE with its interval, the curves of ECE against severity with the current severity
marked, and the verdict of Neural Clamping against temperature scaling from their paired interval.

Every number comes from the shift study shipped beside the pre-computed result
(``assets/precomputed/shift.json``, a :class:`nctv.shift.ShiftResult` of the embedded default), or,
when a visitor picks a menu model that has a pre-computed study of its own (``nctv.ui.shipped``), from
that model's ``shift.json`` (:func:`menu_view`). It travels to the page once, when the tab is first
shown or the model is picked (:func:`page_data`); moving the severity or changing the corruption costs
no request.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import gradio as gr

from nctv.corruptions import CORRUPTIONS, in_words
from nctv.plots import _shift_colour
from nctv.report import to_markdown
from nctv.results import COMPARED_METHOD
from nctv.shift import (AVERAGE, SHIFT_FILE, SHIFT_REFERENCES, ShiftResult, comparison_table, condition_title,
                        shift_table, summary_sentences, to_csv)
from nctv.ui.common import user_errors
from nctv.ui.shipped import NO_STUDY, PRECOMPUTED_LABEL, precomputed_dir, shipped_shift
from nctv.ui.slides import figure_files, shipped_files, tables_file

#: The metrics each method's card shows, with their interval.
CARD_METRICS = ("ece", "accuracy")
#: Digits kept of the diagrams' bin means (drawn only; the read-outs keep every digit).
BIN_DIGITS = 6


def _triple(f: dict[str, Any]) -> list[float | None]:
    return [float(f["value"]), f.get("ci_low"), f.get("ci_high")]


def _bins(rel: dict[str, list]) -> dict[str, list]:
    def kept(values: list) -> list:
        return [None if v is None else round(float(v), BIN_DIGITS) for v in values]
    return {"count": [int(c) for c in rel["count"]], "confidence": kept(rel["confidence"]),
            "accuracy": kept(rel["accuracy"])}


def page_data(result: ShiftResult) -> dict[str, Any]:
    """What the page needs to draw every condition on its own, sent once: per condition (``clean``,
    ``<corruption>/<severity>``, ``average/<severity>``) each method's ECE and accuracy as [value, low,
    high] (fractions), its reliability bins (not for the means), Neural Clamping − each reference as
    [difference, low, high], the leaders of ECE, the condition's title, and its example pictures
    (base64 PNG)."""
    methods = list(result.methods)
    keys = result.conditions + [f"{AVERAGE}/{s}" for s in result.severities]
    intervals = result.settings.get("intervals", {})
    refs = [r for r in SHIFT_REFERENCES if r in methods] if COMPARED_METHOD in methods else []
    conditions = {}
    for key in keys:
        entry = {"title": condition_title(key),
                 "figures": {m: {k: _triple(result.figure(m, key, k)) for k in CARD_METRICS} for m in methods},
                 "leaders": result.leaders(key, "ece")}
        if not key.startswith(AVERAGE + "/"):
            entry["bins"] = {m: _bins(result.reliability[m][key]) for m in methods}
        found = {r: result.comparison(COMPARED_METHOD, r, key, "ece") for r in refs}
        entry["versus"] = {r: [c.difference, c.low, c.high] for r, c in found.items() if c is not None}
        conditions[key] = entry
    examples = result.examples.get("png", {}) if result.examples else {}
    return {
        "model": result.model.get("name"), "n_test": int(result.test.get("size", 0)), "n_bins": result.n_bins,
        "level": float(intervals.get("level", 0.95)), "resamples": intervals.get("resamples"),
        "seeds": len(result.seeds), "fitter": result.fitter, "compared": COMPARED_METHOD if refs else None,
        "methods": [{"name": m, "colour": _shift_colour(m, i)} for i, m in enumerate(methods)],
        "corruptions": [{"name": c, "title": CORRUPTIONS[c].title, "words": in_words(CORRUPTIONS[c].title),
                         "what": CORRUPTIONS[c].describe()} for c in result.corruptions],
        "severities": list(result.severities), "conditions": conditions,
        "examples": {k: v for k, v in examples.items() if k in conditions},
    }


@lru_cache(maxsize=1)
def _shipped_page() -> dict[str, Any]:
    result = shipped_shift()
    return page_data(result) if result is not None else {"message": NO_STUDY}


@user_errors
def first_view(model: Any = None, hub_id: Any = None) -> dict[str, Any]:
    """The page's "first_view" event: the numbers of the picked menu model's own study when it has
    one (:func:`menu_view`), else the shipped study's (computed once per server)."""
    if isinstance(model, str) and not (isinstance(hub_id, str) and hub_id.strip()):
        try:
            found = menu_view(model)
        except ValueError:  # the status line says why; the page shows the shipped study
            found = None
        if found is not None:
            return found[-1]
    return _shipped_page()


def _table_csv(path: str) -> str:
    """table.csv of the study in ``path``, written once per server in the study's own folder (which
    no later download removes, as the rotated download folders' would be)."""
    def write(folder: Path) -> list[str]:
        out = folder / "table.csv"
        out.write_text(to_csv(ShiftResult.load(path)), encoding="utf-8")
        return [str(out)]

    return shipped_files(Path(path), write, variant="table.csv")[0]


def study_view(result: ShiftResult, path: Path) -> tuple[str, str, str, list[str]]:
    """(what is shown, the ECE table, Neural Clamping against temperature scaling, files) of the
    pre-computed study ``result``, read from ``path``."""
    calibrated = "the clean calibration split" if not result.calibrate_on else condition_title(result.calibrate_on)
    status = (f"Showing the study *{PRECOMPUTED_LABEL}*: model {result.model.get('name')}, every method fitted once "
              f"on {calibrated} ({result.calibration.get('size', '?'):,} pictures), then scored on the "
              f"{result.test.get('size', 0):,} test pictures, clean and under {len(result.corruptions)} corruptions at "
              f"severities {result.severities[0]}–{result.severities[-1]}. `nctv shift` runs the same study on "
              "your model.")
    lines = "\n".join(f"- {s}" for s in summary_sentences(result))
    table = to_markdown(shift_table(result, "ece"))
    versus = to_markdown(comparison_table(result)) if COMPARED_METHOD in result.methods else ""
    files = [str(path), _table_csv(str(path)), *shipped_files(path, lambda to: study_slides(result, to))]
    return status + ("\n\n" + lines if lines else ""), table, versus, files


def study_slides(result: ShiftResult, out: Path) -> list[str]:
    """The study for slides, in ``out``: ECE against severity under every corruption and their mean (PNG,
    SVG, PDF), and its two tables as Beamer frames. The page's view at one condition has a control of
    its own (:func:`nctv.ui.slides.shift_download`)."""
    from nctv import plots

    tables = [shift_table(result, "ece")] + ([comparison_table(result)] if COMPARED_METHOD in result.methods else [])
    return (figure_files(out / "shift_curves", plots.shift_figure, plots.shift_curve_data(result),
                         per_row=plots.slide_columns(1 + len(result.corruptions), most=4))
            + [tables_file(out, tables)])


def shipped_view() -> tuple[str, str, str, list[str]]:
    """:func:`study_view` of the shipped study; with none shipped, a sentence saying so."""
    result = shipped_shift()
    if result is None:
        return NO_STUDY, "", "", []
    return study_view(result, precomputed_dir() / SHIFT_FILE)


def menu_view(model: str) -> tuple[str, str, str, list[str], dict[str, Any]] | None:
    """:func:`study_view` and :func:`page_data` of the shift study beside menu model ``model``'s
    pre-computed result (the embedded default's for the default model), or None where it has none.
    Read and checked by :func:`nctv.ui.shipped.study_of`; a study that fails its checks raises
    ``ValueError`` saying why."""
    from nctv.ui.shipped import study_of

    found = study_of(model, SHIFT_FILE)
    if found is None:
        return None
    data, path = found
    result = ShiftResult.from_dict(data)
    return (*study_view(result, path), page_data(result))


def page_view() -> gr.HTML:
    """The page's controls and figures (``static/shift.{html,css,js}``, after the shared diagram
    drawing); its value, empty at first, becomes :func:`page_data` when the tab is first shown."""
    from nctv.ui.learn import diagram_widget

    return diagram_widget("shift", elem_id="shift-view")
