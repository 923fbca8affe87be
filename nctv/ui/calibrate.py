"""The Calibrate tab: fit the chosen methods on a calibration split of the chosen model, score
them on its test split, and show the table, the reliability diagrams, the learned T and δ.

:func:`run_calibration` is the work itself (no Gradio in it): one call of the library's
:func:`nctv.experiment.run_experiment`, whose result records everything the tab draws. Every method is fitted once, with
the split's seed; logit-space methods reuse the cached unperturbed logits, Neural Clamping
reports its loss and T after every step for the live view.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

import gradio as gr
import numpy as np

from nctv.results import CALIBRATORS_FOLDER
from nctv.calibration.clamping import RECIPES
from nctv.checks import LR_MAX, read_number, shown
from nctv.conformal import DEFAULT_COVERAGE, SCORES, ConformalSettings
from nctv.settings import INIT_STDS, RECIPE_LR, NCOptions
from nctv.ui.common import (SAME_TASK, ProgressLine, duration, export_dir, parse_whole,
                             user_errors, with_warnings)
from nctv.ui.caches import get_model, get_splits, remember_logits, test_pictures, ts_temperature_of
from nctv.ui.caches import prepare_run
from nctv.ui.gpu import GpuRun, calibration_work, gpu_generator
from nctv.ui.limits import resolve_dataset, resolve_model_name
from nctv.ui.session import NC_METHODS, TS_METHOD, Calibration, SplitSpec
from nctv.ui import slides
from nctv.ui.shipped import PRECOMPUTED_LABEL, study_folder, test_metrics

REFERENCE = "Uncalibrated"
#: The fitters by short names, each on one line even on a phone; what each does is said below them (FITTER_INFO).
FITTER_CHOICES = [("fast (default)", "fast"), ("paper recipe", "paper"), ("authors' toolkit recipe", "toolkit")]
FITTER_INFO = "fast: T by calibration ECE, then δ by L-BFGS at that T, about 10 passes; " + "; ".join(
    f"{name}: SGD + momentum, lr {r.sgd.lr:g}, batch {r.sgd.batch_size}, {r.sgd.epochs} epochs" for name, r in RECIPES.items())
#: What the learning-rate field takes (NCOptions reads it).
LR_INFO = ("default = the recipe's own (" + ", ".join(f"{name} {lr:g}" for name, lr in RECIPE_LR.items())
           + f"); or above 0, at most {LR_MAX:g}")
#: "random" is a random δ₀ of the fitter's own spread (INIT_STDS): none for the fast fitter, which starts at 0.
INIT_CHOICES = [("the fitter's own", "random"), ("data-driven (Theorem 1)", "data")]
INIT_INFO = (f"the fitter's own: the fast fitter starts at δ₀ = 0, the recipes at a Gaussian draw "
             f"(σ {INIT_STDS['paper']:g} and {INIT_STDS['toolkit']:g})")
GAMMA_CHOICES = ["auto", "0", "0.5", "1", "2", "3"]
WEIGHT_DECAY_CHOICES = ["default", "strong", "auto", "0", "0.001", "0.01", "0.1", "1"]

#: The conformal scores by the names the table gives them.
CONFORMAL_CHOICES = [(score.upper(), score) for score in SCORES]
#: What each score puts in a set, in a line a lecturer can read out.
CONFORMAL_INFO = ("- **LAC**: every class whose probability clears one bar; the smallest sets.\n"
                  "- **APS**: the likeliest classes, added until their probabilities sum to enough; sets grow where "
                  "the model is unsure.\n"
                  "- **RAPS**: APS that charges extra for each unlikely class; shorter sets where there are many "
                  "classes.")
#: The coverage the page offers, in per cent (the library takes any fraction between 0 and 1).
COVERAGE_PERCENT = (50, 99)
DEFAULT_SCORE, DEFAULT_COVERAGE_PERCENT = ConformalSettings().score, round(100 * DEFAULT_COVERAGE)

Report = Callable[[tuple], None]


def method_choices() -> list[str]:
    """Every method of the registry, then the ablation rows of Neural Clamping (FL) (Table 4)."""
    from nctv.calibration import METHODS
    from nctv.experiment import NC_REFITS, NC_VARIANTS

    return [*METHODS, *NC_VARIANTS, *NC_REFITS]


def _ordered_methods(methods: Sequence[str]) -> list[str]:
    known = method_choices()
    chosen = [m for m in methods if m]
    unknown = [m for m in chosen if m not in known]
    if unknown:
        raise ValueError(f"Unknown method(s) {', '.join(map(repr, unknown))}; choose from: {', '.join(known)}.")
    if not [m for m in chosen if m != REFERENCE]:
        raise ValueError("Tick at least one calibration method (the uncalibrated model is always shown for reference).")
    # The uncalibrated reference row first, then the registry's order (baselines, then NC).
    return [REFERENCE] + [m for m in known if m in chosen and m != REFERENCE]


def run_calibration(spec: SplitSpec, methods: Sequence[str], n_bins: int, nc: NCOptions,
                    report: Report | None = None,
                    conformal: ConformalSettings | None = ConformalSettings()) -> tuple[Any, Calibration]:
    """Fit ``methods`` on the calibration split of ``spec``, score them on its test split, through
    the library's :func:`nctv.experiment.run_experiment` (one run, seed = the split's seed), with
    Neural Clamping's options ``nc`` and every row's prediction sets made as ``conformal`` says.

    ``report`` receives ``("progress", fraction, message, unit, unit_fraction)`` (``unit``: the
    running step, numbered: the two logit passes, then each method; ``unit_fraction``: how far into
    it; together they time what is left of the step) and, during Neural Clamping fits,
    ``("nc", row, info)`` with the fit's step info (step, loss, temperature, passes; the last one,
    step "selected", carries the T it keeps). It may raise to cancel the run. Returns the
    ``RunResult`` (calibrated test logits attached) and the visitor's :class:`Calibration`.
    """
    from nctv.experiment import RunOptions, run_experiment

    say: Report = report or (lambda item: None)
    names = _ordered_methods(methods)
    say(("progress", 0.0, f"loading model {spec.model}", "model", 0.0))
    loaded = get_model(spec.model)
    say(("progress", 0.01, "loading the calibration and test splits", "splits", 0.0))
    cal, test = get_splits(spec)
    if n_bins > len(test):
        raise ValueError(f"{n_bins} bins are more than the {len(test)} test images; use fewer bins.")

    # The engine's progress runs over equal units: the two logit passes, then one per method (one
    # seed each); the time left is that of the running unit, from how far into it the run is.
    units = 2 + len(names)

    def progress(fraction: float, message: str) -> None:
        unit = min(int(fraction * units), units - 1)
        say(("progress", min(0.02 + 0.97 * fraction, 0.99), message, unit, fraction * units - unit))

    options = RunOptions(seeds=[spec.calibration_seed], bins=[n_bins], nc=nc, progress=False, callback=progress,
                         on_fit_step=lambda row, info: say(("nc", row, info)), dataset=spec.dataset,
                         conformal=conformal)
    result = run_experiment(loaded, cal, test, names, options)
    say(("progress", 1.0, f"done in {result.seconds:.1f} s", "done", 1.0))
    return result, _calibration_of(result, spec, n_bins)


def _calibration_work(spec: SplitSpec, methods: Sequence[str], n_bins: int, nc: NCOptions,
                      conformal: ConformalSettings, report: Report) -> tuple[Any, Calibration, str]:
    """The GPU part of a Calibrate run (see ``nctv.ui.gpu``): :func:`run_calibration`, its fitted
    calibrators written to a fresh download folder (they hold the model, which stays where it is),
    and the result without them. Returns (result, calibration, that folder), all CPU values."""
    import dataclasses

    result, calibration = run_calibration(spec, methods, n_bins, nc, report, conformal)
    out = export_dir("calibration")
    result.save_calibrators(out / CALIBRATORS_FOLDER, get_model(spec.model))
    methods_kept = {k: dataclasses.replace(m, calibrator=None) for k, m in result.methods.items()}
    return dataclasses.replace(result, methods=methods_kept), calibration, str(out)


#: The GPU function of the Calibrate tab: ``(seconds, spec, methods, n_bins, nc, conformal)`` → streamed items, then
#: the result.
calibration_on_gpu = gpu_generator(_calibration_work)


def prepare_calibration(spec: SplitSpec, methods: Sequence[str], nc: NCOptions,
                        report: Report) -> tuple[float, int, int]:
    """The server's part before the GPU call (``nctv.ui.caches.prepare_run``): the model, the splits and
    the call's estimated seconds. Returns (seconds, calibration size, test size)."""
    return prepare_run(spec, lambda loaded, n_cal, n_test: calibration_work(list(methods), nc, n_cal, n_test,
                                                                           loaded.num_classes),
                       report, lambda f, m: ("progress", f, m, "model" if f == 0 else "splits", 0.0))


def _calibration_of(result: Any, spec: SplitSpec, n_bins: int) -> Calibration:
    if TS_METHOD in result.methods:
        ts_t = result.methods[TS_METHOD].params["temperature"]
    else:
        ts_t = ts_temperature_of(spec)  # the run has just written these logits to the cache
    nc = next((n for n in NC_METHODS if n in result.methods), None)
    if nc is None:
        nc = next((n for n, m in result.methods.items() if m.delta is not None), None)
    when = datetime.now().strftime("%H:%M:%S")
    return Calibration(
        split=spec, model=spec.model, ts_temperature=float(ts_t),
        nc_temperature=None if nc is None else float(result.methods[nc].params["temperature"]),
        delta=None if nc is None else result.methods[nc].delta, nc_method=nc,
        source=f"your run of {when}", n_bins=n_bins, settings=dict(result.settings),
        metrics=test_metrics(result, n_bins))


# --------------------------------------------------------------------------- showing a result


def table_markdown(result: Any, n_bins: int, source: str) -> str:
    from nctv import report

    head = f"*{source}*\n\n" if source else ""
    # The run's own verdict on Neural Clamping against TS by grid search, from the paired interval of
    # their difference: a difference inside its noise is called a tie.
    verdicts = [report.verdict(result, n_bins, method=name) for name, m in result.methods.items()
                if m.uses_model and m.delta is not None]
    note = next((f"\n\n**{v}**" for v in verdicts if v), "")
    sets = report.conformal_table(result)
    return (head + report.to_markdown(report.results_table(result, n_bins)) + note
            + ("\n\n" + report.to_markdown(sets) if sets is not None else ""))


def _numbers(values: Any, digits: int | None = None) -> list[float | None]:
    """A list for the page: floats (rounded to ``digits`` where a figure needs no more), None for NaN."""
    return [None if not math.isfinite(v) else (round(float(v), digits) if digits else float(v))
            for v in np.asarray(values, dtype=np.float64).tolist()]


#: Decimals of the smoothed curves sent to the page: far below a pixel of any diagram.
CURVE_DIGITS = 5
#: Resamples behind the band of each smoothed diagram in the app: a band is read to a pixel, and 200
#: resamples place its 2.5 % and 97.5 % quantiles that well at a fifth of the cost of the tables' 1,000
#: (about 0.3 s a method on 10,000 pictures and 2 cores, instead of 2 s).
BAND_RESAMPLES = 200


def diagram_data(result: Any, n_bins: int) -> dict:
    """The numbers of the Calibrate tab's diagrams, computed once per result and drawn by the page
    (``static/calibrate.js``). Per method: ECE, accuracy, mean confidence; per bin the count, mean
    confidence, accuracy and its 95 % Wilson interval; the smoothed diagram (mesh, smoothed accuracy,
    its band at the run's interval level and seed over :data:`BAND_RESAMPLES` resamples, density of
    the confidences), its smooth ECE and bandwidth."""
    from nctv import metrics, plots
    from nctv.intervals import IntervalSettings, smooth_band

    how = IntervalSettings(**{k: v for k, v in result.settings.get("intervals", {}).items() if k in ("level", "seed")})
    labels = result.test_labels.numpy()
    methods = []
    for d in plots.reliability_data_from_result(result, n_bins):
        conf, pred = metrics.confidences_and_predictions(result.methods[d.method].test_logits)
        band = smooth_band(conf, pred == labels, level=how.level, resamples=BAND_RESAMPLES, seed=how.seed)
        low, high = d.accuracy_interval
        methods.append({
            "name": d.method, "ece": d.ece, "accuracy": d.overall_accuracy, "confidence": d.mean_confidence,
            "counts": [int(c) for c in d.counts], "bin_confidence": _numbers(d.confidence),
            "bin_accuracy": _numbers(d.accuracy), "low": _numbers(low), "high": _numbers(high),
            "smooth": {"ece": band.smooth_ece, "bandwidth": band.bandwidth, "level": band.level,
                       "resamples": band.resamples, "mesh": _numbers(band.confidence, CURVE_DIGITS),
                       **{k: _numbers(getattr(band, k), CURVE_DIGITS) for k in ("accuracy", "density", "low", "high")}},
        })
    return {"bins": n_bins, "n": int(labels.shape[0]), "methods": methods}


@dataclass(frozen=True)
class ShownRun:
    """What an opened group of the Calibrate diagrams needs of the result on screen: its splits (the
    test split's pictures), its bins, the test labels and, per method, each test picture's top-label
    confidence and predicted class (not the logits, which may be large)."""

    split: SplitSpec | None  # None: a file of logits, which has no pictures
    n_bins: int
    labels: np.ndarray
    confidence: dict[str, np.ndarray]
    prediction: dict[str, np.ndarray]


def shown_run(result: Any, split: SplitSpec | None, n_bins: int) -> ShownRun:
    from nctv import metrics

    tops = {name: metrics.confidences_and_predictions(m.test_logits) for name, m in result.methods.items()}
    return ShownRun(split, n_bins, result.test_labels.numpy(), {k: c for k, (c, _) in tops.items()},
                    {k: p for k, (_, p) in tops.items()})


@lru_cache(maxsize=1)
def _shipped_run() -> ShownRun:
    from nctv.ui.shipped import load_precomputed

    pre = load_precomputed()
    if pre is None:
        raise ValueError("No result is shown yet: press Run calibration.")
    return shown_run(pre.result, pre.split, pre.result.bins[0])


#: Pictures an opened group lists: the wrong predictions first, then the surest.
GROUP_SHOWN = 24


def group_pictures(shown: ShownRun, method: Any, group: Any) -> dict:
    """The first :data:`GROUP_SHOWN` pictures of group ``group`` of ``method``'s diagram (wrong
    predictions first, then the surest), before and after calibration, with the group's size and
    how many in it are right; a ValueError in the visitor's words for a method or group not shown."""
    from nctv import metrics
    from nctv.ui.learn import pictures

    if not isinstance(method, str) or method not in shown.confidence:
        raise ValueError(f"The result shown has no method {method!r}; click a bar of one of its diagrams.")
    if shown.split is None:
        raise ValueError(NO_PICTURES)
    m = shown.n_bins
    if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group < m:
        raise ValueError(f"Groups are numbered 0 to {m - 1}; got {group!r}.")
    conf, pred = shown.confidence[method], shown.prediction[method]
    # The diagram's bins: ((b − 1)/M, b/M], confidence 0 in the first (the rule of nctv.metrics).
    where = np.clip(np.searchsorted(metrics.bin_edges(m).numpy(), conf, side="left") - 1, 0, m - 1)
    members = np.flatnonzero(where == group)
    right = pred[members] == shown.labels[members]
    rows = members[np.lexsort((-conf[members], right))][:GROUP_SHOWN].tolist()
    before = (shown.confidence[REFERENCE][rows], shown.prediction[REFERENCE][rows])
    return {"items": pictures(shown.split, rows, shown.labels, before, (conf[rows], pred[rows])),
            "count": len(members), "right": int(right.sum())}


@user_errors
def open_group(shown: ShownRun | None, evt: gr.EventData) -> dict:
    """The page's "open_bin" event: the pictures of the clicked group (``method``, ``bin``) for the
    view's ``bin`` property, with the page's request number (an older request's answer is then
    ignored), or a message."""
    data = evt._data if isinstance(evt._data, dict) else {}
    request = data.get("request")
    answer = {"request": request if isinstance(request, int) else 0}
    try:
        answer.update(group_pictures(shown or _shipped_run(), data.get("method"), data.get("bin")))
    except (ValueError, IndexError) as e:
        answer["message"] = str(e)
    return gr.update(bin=answer)


def diagram_view(value: dict | None) -> gr.HTML:
    """The reliability diagrams of the result shown (``static/calibrate.{html,css,js}``), drawn by the
    page from :func:`diagram_data`; a click on a bar asks for that group's pictures ("open_bin")."""
    from nctv.ui.learn import diagram_widget

    return diagram_widget("calibrate", value, elem_id="calibrate-view", bin=None)


def delta_plot(result: Any, calibration: Calibration):
    """δ as a matplotlib figure (the input, input + δ, the change, δ per channel), for ``delta.png``,
    ``.svg`` and ``.pdf``."""
    from nctv import plots

    if calibration.delta is None:
        return None
    s = result.settings
    data = plots.delta_image_data(calibration.delta, s["mean"], s["std"], title=f"δ of {calibration.nc_method}")
    return plots.delta_figure(data, backend="matplotlib")


#: The test picture the Learned-parameters panel shows δ on: the split's first.
EXAMPLE_ROW = 0


def delta_panel(result: Any, calibration: Calibration) -> str:
    """The learned δ made visible in the page (:mod:`nctv.ui.delta`, amplified and blended there) on the
    first test picture, with what δ does to that picture's answer, read off the run's own test logits
    (no model pass). The Learned-parameters text above it says what δ is and how large."""
    import torch

    from nctv import plots
    from nctv.ui.delta import NO_DELTA, delta_view
    from nctv.ui.try_image import delta_effect, probabilities

    if calibration.delta is None:
        return NO_DELTA
    s = result.settings
    try:
        test = test_pictures(calibration.split)
    except ValueError:  # a pre-computed study of a downloaded dataset: δ on a mid-grey picture instead
        grey = [(0.5 - m) / d for m, d in zip(s["mean"], s["std"])]
        example = torch.tensor(grey, dtype=calibration.delta.dtype)[:, None, None].expand_as(calibration.delta)
        data = plots.delta_image_data(calibration.delta, s["mean"], s["std"], example=example)
        return delta_view(data, picture="A mid-grey picture (this study's test pictures are not on this server)",
                          group="calibrate-amplify", sentence=False)
    row = slice(EXAMPLE_ROW, EXAMPLE_ROW + 1)
    data = plots.delta_image_data(calibration.delta, s["mean"], s["std"],
                                  example=test.preprocess(test.image(EXAMPLE_ROW)))
    effect = delta_effect(test.class_names,
                          probabilities(result.methods[REFERENCE].test_logits[row] / calibration.nc_temperature),
                          probabilities(result.methods[calibration.nc_method].test_logits[row]))
    return delta_view(data, picture="A test picture", effect=effect, group="calibrate-amplify",
                      sentence=False)


def delta_viewer(value: str | None) -> gr.HTML:
    """The view of :func:`delta_panel`'s δ, repainted in the page as it is amplified or blended."""
    from nctv.ui.delta import delta_widget

    return delta_widget(value, elem_id="calibrate-delta")


def params_markdown(result: Any, calibration: Calibration) -> str:
    from nctv import plots

    lines = [f"**Learned parameters** ({calibration.source}; model {calibration.model})", ""]
    if calibration.delta is not None:
        s = result.settings
        lines += [plots.delta_sentence(plots.delta_image_data(calibration.delta, s["mean"], s["std"])), ""]
    for name, m in result.methods.items():
        p = m.params
        if "temperature" not in p:
            continue
        parts = [f"T = {p['temperature']:.4f}"]
        if "gamma" in p and m.uses_model:
            parts.append(f"γ = {p['gamma']:g}")
        if "weight_decay" in p:
            parts.append(f"λ = {p['weight_decay']:.3g}")
        if "delta_l2" in p:
            parts.append(f"‖δ‖₂ = {p['delta_l2']:.3f}, max |δ| = {p['delta_linf']:.3f} "
                         "(normalised input units)")
        if "n_passes" in p:
            parts.append(f"{p['n_passes']:.1f} passes over the calibration split")
        lines.append(f"- {name}: " + "; ".join(parts))
    lines.append(f"\nNeural Clamping fitter: {result.fitter}. Calibration split: {result.calibration['name']} "
                 f"(n = {result.calibration['size']}); test split: {result.test['name']} (n = {result.test['size']}).")
    return "\n".join(lines)


def calibrators_zip(result: Any, model: str, out: Path, shipped: Path | None = None) -> Path | None:
    """``calibrators.zip``: every fitted calibrator of a live run in a folder named after its
    method (``RunResult.save_calibrators``), or, for a result read from disk, the ``shipped``
    folders saved with it. The Try tab, ``load_calibrator`` and ``nctv apply`` read the folders.
    None when there is nothing to zip."""
    import shutil

    if shipped is not None:
        folder = shipped
    else:
        folder = out / CALIBRATORS_FOLDER
        result.save_calibrators(folder, get_model(model))
    if not folder.is_dir():  # nothing fitted, or nothing shipped
        return None
    return Path(shutil.make_archive(str(out / "calibrators"), "zip", root_dir=folder))


def figures_for_slides(result: Any, calibration: Calibration, n_bins: int, out: Path) -> list[str]:
    """The run's figures as PNG, SVG and PDF for slides (``nctv.ui.slides``) in ``out``: the binned and the
    smoothed reliability diagrams and, where the run learned one, δ."""
    paths = slides.reliability_files(result, n_bins, out)
    if calibration.delta is not None:
        paths += slides.figure_files(out / "delta", delta_plot, result, calibration)
    return paths


def export_files(result: Any, calibration: Calibration, n_bins: int, out: Path | None = None) -> list[str]:
    """Write the run's files for download: results.json, the tables (Markdown, CSV, LaTeX, JSON, and
    slides.tex: a Beamer frame each), the figures for slides (:func:`figures_for_slides`; a shipped
    result's drawn once per server), delta.safetensors (δ with its temperature) and calibrators.zip
    (every fitted calibrator in the Hub's layout), into ``out`` (where a live run's GPU part wrote its
    calibrators) or a fresh folder."""
    from safetensors.torch import save_file

    from nctv import report

    out = out if out is not None else export_dir("calibration")
    (out / "results.json").write_text(result.to_json(), encoding="utf-8")
    paths = [out / "results.json"] + report.write_tables(result, out)
    folder = study_folder(calibration.model) if calibration.source == PRECOMPUTED_LABEL else None
    if folder is not None:  # a shipped result's figures are the same for every visitor: drawn once
        paths += slides.shipped_files(folder / "results.json", lambda to: figures_for_slides(result, calibration,
                                                                                            n_bins, to), n_bins)
    else:
        paths += figures_for_slides(result, calibration, n_bins, out)
    if calibration.delta is not None:
        save_file({"delta": calibration.delta.contiguous()}, str(out / "delta.safetensors"),
                  metadata={"temperature": repr(calibration.nc_temperature), "method": str(calibration.nc_method),
                            "space": "normalised model input", "model": calibration.model})
        paths.append(out / "delta.safetensors")
    shipped = folder / CALIBRATORS_FOLDER if folder is not None else None
    archive = calibrators_zip(result, calibration.model, out, shipped)
    if archive is not None:
        paths.insert(0, archive)  # the file to reuse (Try tab, ``nctv apply``) comes first
    return [str(p) for p in paths]


def show(result: Any, calibration: Calibration, n_bins: int) -> tuple:
    """(table, the diagrams' numbers, parameters, δ made visible, what an opened group needs) for a result."""
    return (table_markdown(result, n_bins, calibration.source), diagram_data(result, n_bins),
            params_markdown(result, calibration), delta_panel(result, calibration),
            shown_run(result, calibration.split, n_bins))


# --------------------------------------------------------------------------- live view


#: Line colours of the live plot, one per Neural Clamping method (plotly's default cycle).
LIVE_COLOURS = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3")


class LiveTrace:
    """Loss and T of the Neural Clamping fits as they run, drawn as two small line plots."""

    def __init__(self):
        self.series: dict[str, dict[str, list[float]]] = {}

    def add(self, method: str, info: dict) -> None:
        """One step of ``method``'s fit: the library's step info (passes so far, loss, T)."""
        s = self.series.setdefault(method, {"x": [], "loss": [], "temperature": []})
        s["x"].append(float(info["passes"]))
        s["loss"].append(float(info["loss"]))
        s["temperature"].append(float(info["temperature"]))

    def figure(self):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        fig = make_subplots(rows=1, cols=2, subplot_titles=["Loss (objective)", "Temperature T"])
        for i, (name, s) in enumerate(self.series.items()):
            # One colour per method in both panels, the one its legend entry shows (plotly would
            # otherwise give every trace the next colour of its cycle).
            colour = LIVE_COLOURS[i % len(LIVE_COLOURS)]
            for col, key in ((1, "loss"), (2, "temperature")):
                fig.add_trace(go.Scatter(x=s["x"], y=s[key], mode="lines+markers", name=name, legendgroup=name,
                                         line=dict(color=colour), marker=dict(size=4, color=colour),
                                         showlegend=col == 1), row=1, col=col)
        fig.update_xaxes(title_text="passes over the calibration split")
        fig.update_layout(height=280, margin=dict(t=40, b=40, l=50, r=20), template="plotly_white",
                          legend=dict(orientation="h", y=-0.35))
        return fig


# --------------------------------------------------------------------------- the handler


def parse_nc_options(fitter: Any, weight_decay: Any, epochs: Any, lr: Any, **fields: Any) -> NCOptions:
    """Neural Clamping's options from the form's fields, checked once: ``fields`` are the tab's
    ``gamma`` and ``init`` where it has them (the γ sweep sets γ itself, the initialisation study
    the initialisation); γ, λ and the learning rate go as typed, and NCOptions reads them (one reading, one
    message each, as for ``nctv --gamma``, ``--weight-decay`` and ``--lr``). The recipes' epochs go only to a
    recipe (the fast fitter stops on convergence); "default" λ and learning rate leave the fitter's own."""
    epochs = parse_whole(epochs, "Epochs", 1, 1000)
    given = {"weight_decay": weight_decay, "epochs": None if fitter == "fast" else epochs, "lr": lr, **fields}
    return NCOptions(fitter=fitter, **{k: v for k, v in given.items() if v is not None})


def parse_conformal(score: Any, coverage: Any) -> ConformalSettings:
    """The run's prediction sets from the form: a score's name (``CONFORMAL_CHOICES``) and the coverage in
    per cent (``COVERAGE_PERCENT``), as ``nctv run --conformal SCORE --coverage C`` gives them with C = the
    per cent / 100."""
    low, high = COVERAGE_PERCENT
    percent = read_number(coverage)
    if percent is None or not low <= percent <= high:  # NaN fails both
        raise ValueError(f"Coverage must be a number from {low} to {high} (per cent); got {shown(coverage)}.")
    return ConformalSettings(score=score, coverage=percent / 100)


def parse_split(model: Any, hub_id: Any, dataset: Any, calibration_size: Any, test_size: Any, seed: Any) -> SplitSpec:
    """The split from the shared panel's fields; an empty (or 0) test size means the whole test split."""
    empty = test_size is None or (isinstance(test_size, str) and not test_size.strip()) or test_size == 0
    return SplitSpec(resolve_model_name(model, hub_id), resolve_dataset(dataset),
                     parse_whole(calibration_size, "Calibration size", 10), parse_whole(seed, "Seed", 0, 2**31 - 1),
                     None if empty else parse_whole(test_size, "Test size", 10))


#: Outputs of :func:`calibrate`, in order.
OUTPUTS = ("status", "live panel", "live plot", "table", "diagrams", "parameters", "δ", "files", "state", "shown run")


def fold_message(method: str, info: dict) -> tuple[str, float] | None:
    """("fold i of n", fraction done) from a cross-validating method's step info, which names the
    fold running and the count (``fold``, ``folds``); None for any other step info."""
    fold, folds = info.get("fold"), info.get("folds")
    if not isinstance(fold, (int, float)) or not isinstance(folds, (int, float)) or folds < 1:
        return None
    return f"{method}: fold {int(fold)} of {int(folds)}", min(max((fold - 1) / folds, 0.0), 1.0)


@user_errors(status_of=len(OUTPUTS))
def calibrate(model, hub_id, dataset, calibration_size, test_size, seed, n_bins, methods, gamma, weight_decay, init,
              fitter, epochs, lr="default", conformal_score=DEFAULT_SCORE, coverage=DEFAULT_COVERAGE_PERCENT,
              progress=gr.Progress()):
    """Run the chosen methods, their prediction sets made with ``conformal_score`` at ``coverage`` per cent;
    streams (status, live panel visibility, live plot, table, diagrams, parameters, δ, files, state, shown run)."""
    spec = parse_split(model, hub_id, dataset, calibration_size, test_size, seed)
    n_bins = parse_whole(n_bins, "Number of bins", 2, 100)
    nc = parse_nc_options(fitter, weight_decay, epochs, lr, gamma=gamma, init=init)
    sets = parse_conformal(conformal_score, coverage)
    names = _ordered_methods(methods or [])
    # The model work runs in one GPU call (nctv.ui.gpu); on ZeroGPU the server loads the model and the
    # splits first, and refuses a run that cannot fit the Space's GPU time.
    worker = GpuRun(calibration_on_gpu, (spec, names, n_bins, nc, sets),
                    prepare=lambda report: prepare_calibration(spec, names, nc, report))
    live = LiveTrace()
    line = ProgressLine()
    skip = gr.skip()
    rest = (skip,) * (len(OUTPUTS) - 3)
    progress(0.0, desc="Starting…")
    for items in worker.stream():
        changed = False
        for item in items:
            if item[0] == "progress":
                _, fraction, message, unit, within = item
                progress(fraction, desc=message)
                line.report(message, unit, within)
            elif "passes" in item[2]:
                live.add(item[1], item[2])
                changed = True
            elif (fold := fold_message(item[1], item[2])) is not None:
                line.report(fold[0], SAME_TASK, fold[1])
        status = line.line()
        # Yield even when nothing is new: a Stop can only close the handler between two yields.
        yield ((skip if status is None else status), gr.update(visible=True) if changed else skip,
               live.figure() if changed else skip) + rest
    result, calibration, folder = worker.result
    # The test logits the Learn tab reads came back with the result: the server keeps them.
    remember_logits(spec, "test", result.methods[REFERENCE].test_logits, result.test_labels)
    files = export_files(result, calibration, n_bins, Path(folder))
    table, diagrams, params, delta, shown_result = show(result, calibration, n_bins)
    done = (f"**Done** in {duration(result.seconds)} ({len(result.methods)} methods, fitter {nc.fitter}); "
            "the results below are this run's.")
    shown = gr.update(visible=bool(live.series))
    yield (with_warnings(done, worker), shown, live.figure() if live.series else None, table, diagrams, params, delta,
           files, calibration, shown_result)


def precomputed_view(model: str | None = None) -> tuple:
    """The first screen: the shipped result (status, table, the diagrams' numbers, parameters, δ,
    files), clearly labelled, or a hint when none is shipped; with ``model``, that menu model's
    pre-computed study."""
    from nctv.ui.shipped import load_precomputed

    pre = load_precomputed(model)
    if pre is None:
        hint = "No pre-computed result is shipped with this copy of the app; press **Run calibration**."
        return hint, None, None, hint, None, None
    n_bins = pre.result.bins[0]
    table, diagrams, params, delta, _ = show(pre.result, pre.calibration, n_bins)
    files = export_files(pre.result, pre.calibration, n_bins)
    status = (f"Showing the result **{PRECOMPUTED_LABEL}** (model {pre.calibration.model}, "
              f"{pre.result.calibration['size']} calibration images, fitter {pre.result.fitter}). "
              "Press **Run calibration** for a live run with your settings.")
    return status, table, diagrams, params, delta, files


def menu_model_view(model: Any, hub_id: Any) -> tuple:
    """A menu model picked: its pre-computed study at once, where it has one (status, table, diagrams,
    parameters, δ, files, and the calibration that Learn and Try then use), as the default's is shown
    at first; otherwise, or with a Hub id typed, the page stays as it is until Run."""
    from nctv.ui.shipped import load_precomputed

    keep = tuple(gr.skip() for _ in range(8))
    if (isinstance(hub_id, str) and hub_id.strip()) or not isinstance(model, str):
        return keep
    try:
        pre = load_precomputed(model)
    except ValueError as e:  # a study that does not pass its checks
        return (f"**No pre-computed result shown:** {e}",) + keep[1:]
    if pre is None:
        return keep
    # What an opened group of its diagrams needs: this study's test split, not the default's.
    return precomputed_view(model) + (pre.calibration, shown_run(pre.result, pre.split, pre.result.bins[0]))


# --------------------------------------------------------------------------- your own logits

#: What a logits upload's group of a diagram says when clicked: a logits file has no pictures.
NO_PICTURES = "These results come from a file of logits: there are no pictures to show."
LOGITS_OUTPUTS = ("status", "table", "diagrams", "parameters", "δ", "files", "shown run")


@user_errors(status_of=len(LOGITS_OUTPUTS))
def calibrate_logits(file: Any, methods: Any, n_bins: Any, seed: Any, conformal_score: Any = DEFAULT_SCORE,
                     coverage: Any = DEFAULT_COVERAGE_PERCENT, progress=gr.Progress()):
    """Any classifier's logits (a .npz, .safetensors or .csv upload, ``nctv.logits_file``) calibrated by
    the ticked logit methods, their prediction sets made with ``conformal_score`` at ``coverage`` per cent:
    streams (status, table, diagrams, parameters, δ, files, shown run). The Learn and Try tabs keep their
    calibration: they need a model's pictures."""
    from nctv import logits_file, report
    from nctv.experiment import RunOptions
    from nctv.methods import METHODS

    if file is None:
        raise ValueError("Upload a file of logits first: .npz, .safetensors or .csv (docs/logits.md).")
    path = Path(file if isinstance(file, str) else getattr(file, "path", "") or "")
    n_bins = parse_whole(n_bins, "Number of bins", 2, 100)
    seed = parse_whole(seed, "Seed", 0, 2**31 - 1)
    sets = parse_conformal(conformal_score, coverage)
    ticked = _ordered_methods(methods or [])
    names = [m for m in ticked if m in METHODS and not METHODS[m].needs_model]
    if not [m for m in names if m != REFERENCE]:
        raise ValueError("Tick at least one method that works on logits (Neural Clamping needs the model's pictures): "
                         f"{', '.join(n for n, s in METHODS.items() if not s.needs_model and n != REFERENCE)}.")
    skipped = [m for m in ticked if m not in names]
    skip = gr.skip()
    yield ("**Running** — reading the logits file",) + (skip,) * (len(LOGITS_OUTPUTS) - 1)
    data = logits_file.read_logits(path, seed=seed, name=path.name)
    progress(0.1, desc=f"{len(names)} methods on {len(data.calibration_labels):,} + {len(data.test_labels):,} rows")
    result = logits_file.run_on_logits(data, [REFERENCE, *[m for m in names if m != REFERENCE]],
                                       RunOptions(seeds=(seed,), bins=(n_bins,), progress=False, conformal=sets))
    out = export_dir("logits")
    (out / "results.json").write_text(result.to_json(), encoding="utf-8")
    files = [out / "results.json", *report.write_tables(result, out), *slides.reliability_files(result, n_bins, out)]
    shown = shown_run(result, None, n_bins)  # no split: a clicked group says there are no pictures
    note = (f" Not run: {', '.join(skipped)} ({'it needs' if len(skipped) == 1 else 'they need'} the model's "
            "pictures)." if skipped else "")
    status = (f"**Done** in {duration(result.seconds)}: {len(result.methods)} methods on {data.name} "
              f"({data.n_classes} classes; {len(data.calibration_labels):,} calibration and "
              f"{len(data.test_labels):,} test rows).{note} The Learn and Try tabs keep their calibration.")
    yield (status, table_markdown(result, n_bins, f"your logits: {data.name}"), diagram_data(result, n_bins),
           "", NO_DELTA_LOGITS, [str(f) for f in files], shown)


#: The δ panel of a logits run: Neural Clamping needs the model's pictures.
NO_DELTA_LOGITS = "<p>A file of logits has no pictures, so Neural Clamping (and its δ) cannot run on it.</p>"

