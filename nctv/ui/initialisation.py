"""The initialisation tab (the paper's Figure 3): Neural Clamping started from a random δ and from
the data-driven δ̃ of Theorem 1, several runs each, scored on the test split and drawn as box plots."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import gradio as gr

from nctv.report import init_study_table, to_markdown
from nctv.settings import NCOptions
from nctv.ui.calibrate import parse_nc_options, parse_split
from nctv.ui.common import export_dir, parse_whole, stream_progress, user_errors, with_warnings
from nctv.ui.caches import prepare_run
from nctv.ui.gpu import GpuRun, gpu_generator, init_work
from nctv.ui.caches import get_model, get_splits
from nctv.ui.session import SplitSpec
from nctv.ui.shipped import shipped_study
from nctv.ui.slides import figure_files, shipped_files, tables_file

METRICS_SHOWN = ("entropy", "ece", "aece", "sce")
MAX_RUNS = 20


def run_study(spec: SplitSpec, runs: int, n_bins: int, nc: NCOptions, report: Callable[[Any], None]):
    """``nctv.experiment.run_init_study`` on the spec's splits with Neural Clamping's options ``nc``;
    ``report`` gets ("progress", f, msg)."""
    from nctv.experiment import RunOptions, run_init_study

    report(("progress", 0.0, f"loading {spec.model} and its splits"))
    loaded = get_model(spec.model)
    cal, test = get_splits(spec)
    options = RunOptions(nc=nc, progress=False, callback=lambda f, m: report(("progress", f, m)), dataset=spec.dataset)
    return run_init_study(loaded, cal, test, runs, n_bins, spec.calibration_seed, options=options)


#: The GPU function of the study (``nctv.ui.gpu``): ``(seconds, spec, runs, n_bins, nc)`` → items, then the result.
study_on_gpu = gpu_generator(run_study)


def shipped_view(model: str | None = None) -> tuple[str, Any, str, list[str]] | None:
    """(status, box plots, table, files) of the initialisation study shipped beside the pre-computed
    result, which the tab opens on; with none shipped, a status line saying what Run does. With
    ``model``, the study beside that menu model's pre-computed result (:func:`nctv.ui.shipped.study_of`),
    or None."""
    from nctv import plots
    from nctv.calibration.studies import InitStudy
    from nctv.results import INIT_STUDY_FILE, InitStudyResult
    from nctv.ui.shipped import study_of

    shipped = shipped_study(INIT_STUDY_FILE) if model is None else study_of(model, INIT_STUDY_FILE)
    if shipped is None and model is not None:
        return None
    if shipped is None:
        return "Press **Run initialisation study** to fit Neural Clamping from both starts.", None, "", []
    data, path = shipped
    result = InitStudyResult(InitStudy.from_dict(data), data["model"], data["calibration"], data["test"],
                             data["settings"], float(data["seconds"]), data["created"], int(data["n_classes"]))
    boxes = plots.init_study_data_from_study(result, metrics_shown=METRICS_SHOWN)
    figure = plots.init_study_figure(boxes, backend="plotly")
    status = (f"Showing the study *pre-computed, shipped with the app* (model {data['model'].get('name', '?')}, "
              f"{len(result.study.seeds)} runs per initialisation). Press **Run initialisation study** for a live "
              "run with your settings.")
    return status, figure, study_table(result), [str(path), *shipped_files(path, lambda to: study_slides(result, to))]


def study_slides(result: Any, out: Path) -> list[str]:
    """The study's box plots (PNG, SVG, PDF) and table (a Beamer frame) for slides, in ``out``."""
    from nctv import plots

    boxes = plots.init_study_data_from_study(result, metrics_shown=METRICS_SHOWN)
    return (figure_files(out / "init_study", plots.init_study_figure, boxes)
            + [tables_file(out, [init_study_table(result, METRICS_SHOWN)])])


def study_table(result: Any) -> str:
    """The CLI's initialisation table (mean ± std, paper units), plus the seeds and time of the run."""
    s = result.study
    return (to_markdown(init_study_table(result, METRICS_SHOWN))
            + f"Seeds {s.seeds[0]}–{s.seeds[-1]}; {result.seconds:.1f} s.")


@user_errors(status_of=4)
def init_study(model, hub_id, dataset, calibration_size, test_size, seed, n_bins, runs, gamma, weight_decay, fitter,
               epochs, lr="default", progress=gr.Progress()):
    """Random vs data-driven δ; streams (status, box plots, table, files)."""
    from nctv import plots

    spec = parse_split(model, hub_id, dataset, calibration_size, test_size, seed)
    n_bins = parse_whole(n_bins, "Number of bins", 2, 100)
    runs = parse_whole(runs, "Runs", 1, MAX_RUNS)
    nc = parse_nc_options(fitter, weight_decay, epochs, lr, gamma=gamma)
    worker = GpuRun(study_on_gpu, (spec, runs, n_bins, nc), prepare=lambda report: prepare_run(
        spec, lambda loaded, n_cal, n_test: init_work(nc, runs, n_cal, n_test), report))
    result = yield from stream_progress(worker, progress, 4)
    data = plots.init_study_data_from_study(result, metrics_shown=METRICS_SHOWN)
    out = export_dir("init-study")
    (out / "init_study.json").write_text(json.dumps(result.to_dict(), indent=2), encoding="utf-8")
    status = f"**Done**: {runs} runs per initialisation in {result.seconds:.1f} s."
    files = [str(out / "init_study.json"), *study_slides(result, out)]
    yield with_warnings(status, worker), plots.init_study_figure(data, backend="plotly"), study_table(result), files
