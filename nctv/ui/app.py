"""The Gradio app: a shared "model and data" panel above six tabs, wired to the handlers of the
tab modules, and the launch settings (queue, upload limits, host and port from the environment).

Public API endpoints (``gradio_client``): ``/calibrate``, ``/gamma_sweep``, ``/init_study``,
``/classify``, ``/classify_drawing`` and ``/explore_temperature``, and the agents' tools
(``nctv.ui.mcp_tools``, also served over MCP); everything else is private.
The queue has two lanes (:class:`nctv.ui.guard.Lanes`): the runs share one heavy slot
(:data:`nctv.ui.common.HEAVY`), and every other call that needs the server takes the light lane
(:data:`LIGHT_LANE`), never behind a run.
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import gradio as gr
from starlette.middleware import Middleware

from nctv import forkgate
from nctv.checks import GAMMA_MAX, MAX_TEXT_CHARS, WEIGHT_DECAY_MAX, env_limit
from nctv.ui import calibrate as cal_tab
from nctv.ui import gamma as gamma_tab
from nctv.ui import hub_push
from nctv.ui import initialisation as init_tab
from nctv.ui import learn as learn_tab
from nctv.ui import links
from nctv.ui import mcp_tools
from nctv.ui import shift as shift_tab
from nctv.ui import slides as slides_tab
from nctv.ui import try_image as try_tab
from nctv.plots import MIN_PLOT_WIDTH
from nctv.hub import max_model_bytes
from nctv.settings import APP_BINS, APP_INIT_RUNS, APP_METHODS, DEFAULT_CALIBRATION_SIZE
from nctv.ui.common import HEAVY, LIGHT, stopped_status
from nctv.ui.delta import delta_widget
from nctv.ui.inputs import (CheckedCheckboxGroup, CheckedDropdown, CheckedNumber, CheckedRadio,
                             CheckedSlider, CheckedTextbox, CheckedTypedDropdown)
from nctv.ui.guard import UPLOAD_KEEP_S, PageSessions, RequestGuard, bounded_server
from nctv.ui.wire import (AppBlocks, CancelEndsStreams, GoneResults, KeptAnswers, NoServerPaths, QuietDisconnects,
                          stoppable)
from nctv.ui.images import MAX_UPLOAD_BYTES, CheckedImage, CheckedSketchpad
from nctv.ui.upload_calibrator import CALIBRATION_TTL_S, load_calibrators
from nctv.ui.caches import get_logits
from nctv.ui.limits import DEFAULT_DATASET_CHOICE, dataset_choices, dataset_hint, dataset_refusal, model_choices
from nctv.ui.session import SplitSpec
from nctv.ui.shipped import examples_dir, load_precomputed, ood_detector

log = logging.getLogger("nctv.ui")

TITLE = "NCTV — Neural Clamping Toolkit & Visualizer"
INTRO = f"""## {TITLE}
**Calibration** makes a classifier's confidence match how often it is right. Compare **Neural Clamping**
(Tang, Chen & Ho, TMLR 2024: a learned input perturbation δ plus a temperature T on a frozen model) with
temperature scaling and the other post-hoc methods. The first tab opens on a pre-computed result."""
#: Width below which the page is laid out for a phone (one column).
PHONE_WIDTH = 640
#: What a table too wide for its box says above it (page.js marks such a table), and once scrolled to its end.
SCROLL_CUE = "More columns: scroll sideways →"
SCROLL_CUE_BACK = "← Scroll back for the first columns"
#: Page styles. The Run bar (Run, Stop, status) stays in view on a wide screen while the settings
#: below it scroll. The study figures keep a readable width and scroll sideways where they do not
#: fit. Result tables scroll sideways rather than break a number over two lines.
APP_CSS = f"""
#gamma-plot, #init-plot {{ overflow-x: auto; }}
#gamma-plot .js-plotly-plot, #init-plot .js-plotly-plot {{ min-width: {MIN_PLOT_WIDTH}px; }}
@media (min-width: {PHONE_WIDTH + 1}px) {{
  .run-bar {{ position: sticky; top: 0; z-index: 20; background: var(--background-fill-primary); }}
}}
.run-bar .prose {{ min-height: 0; }}
/* A failed run's status line says what went wrong; Gradio's "Error" mark (shown even with its
   progress hidden) would cover that text. */
.run-bar [data-testid="status-tracker"] .error {{ display: none; }}
/* On a phone the tab bar stays in the first half-screen: the title, the lead and the closed panel's
   title a little smaller than on a wide screen. */
@media (max-width: {PHONE_WIDTH}px) {{
  #intro h2 {{ font-size: 1.35em; }}
  #intro p {{ font-size: 15px; line-height: 1.35; }}
  #shared-panel > .label-wrap, #shared-panel > .label-wrap span {{ font-size: 14px; line-height: 1.35; }}
}}
/* The Try tab on a phone: the picture, right under it its answer, then the corruption, the examples and
   the calibrators' loader. */
@media (max-width: {PHONE_WIDTH}px) {{
  #try-row {{ flex-direction: column; }}
  #try-inputs {{ display: contents; }}
  #try-sources {{ order: 0; }}
  #try-results {{ order: 1; }}
  #try-corrupt {{ order: 2; }}
  #try-more {{ order: 3; }}
}}
/* Plotly draws its figures white with dark ink (inline styles). In the dark theme they take the page's
   colours instead: a clear background, light text and axes, dim grid lines. */
.dark .js-plotly-plot .main-svg {{ background: transparent !important; }}
.dark .js-plotly-plot rect.bg {{ fill: transparent !important; }}
.dark .js-plotly-plot .legend rect.bg {{ fill: transparent !important; stroke: #6b7280 !important; }}
.dark .js-plotly-plot text {{ fill: #e5e7eb !important; }}
.dark .js-plotly-plot .gridlayer path, .dark .js-plotly-plot .zerolinelayer path {{ stroke: #4b5563 !important; }}
.dark .js-plotly-plot path.xline, .dark .js-plotly-plot path.yline,
.dark .js-plotly-plot .xtick, .dark .js-plotly-plot .ytick {{ stroke: #9ca3af !important; }}
.dark .js-plotly-plot .modebar-btn path {{ fill: #9ca3af !important; }}
.result-table {{ overflow-x: auto; }}
.result-table table {{ width: max-content; max-width: none; }}
.result-table th, .result-table td {{ white-space: nowrap; }}
/* A table wider than its box says so above it, in view however far it is scrolled (page.js marks it). */
.result-table[data-overflow="true"]::before {{ content: "{SCROLL_CUE}"; display: block; position: sticky; left: 0;
  width: max-content; font-size: var(--text-sm); color: var(--body-text-color); margin-bottom: 2px; }}
.result-table[data-overflow="true"][data-scrolled="end"]::before {{ content: "{SCROLL_CUE_BACK}"; }}
/* The selected tab, checked boxes and sliders: orange-700 in the light theme (orange-500 on white is 2.8:1). */
body:not(.dark) {{ --color-accent: var(--primary-700); }}
/* Download lists are read-only: Gradio's File still offers each file a "Remove this file" button. */
.download-list td:has(> button[aria-label="Remove this file"]) {{ display: none; }}
"""
#: The page's type: the system's own fonts (San Francisco on Apple's systems, Segoe UI on Windows,
#: Roboto on Android, Arial or its metric twin Liberation Sans elsewhere). Gradio's default theme loads
#: Source Sans Pro from files it bundles, whose semibold face holds the glyphs "A" and "B" only, so that
#: every semibold label mixed two fonts.
SYSTEM_FONTS = ("-apple-system", "BlinkMacSystemFont", "Segoe UI", "Roboto", "Helvetica Neue", "Arial",
                "Liberation Sans", "Noto Sans", "sans-serif")
MONO_FONTS = ("ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "Liberation Mono", "monospace")


def app_theme() -> gr.themes.Base:
    """Gradio's default theme with the system's fonts and colours that read at 4.5:1 or more in the
    light and the dark theme (tests/test_readable_browser.py measures them): help text, placeholders
    and the footer one step darker than Gradio's neutral-400 (1.9:1 on white); white on orange-700
    and red-700 for Run and Stop (white on orange-500 was 2.8:1, on red-500 3.8:1); links in the dark
    theme in blue-400 (blue-500 was 4.1:1). APP_CSS sets the accent (the selected tab) of the light theme."""
    return gr.themes.Default(font=list(SYSTEM_FONTS), font_mono=list(MONO_FONTS)).set(
        body_text_color_subdued="*neutral_600",
        input_placeholder_color="*neutral_500", input_placeholder_color_dark="*neutral_400",
        button_primary_background_fill="*primary_700", button_primary_background_fill_dark="*primary_700",
        button_primary_background_fill_hover="*primary_800", button_primary_background_fill_hover_dark="*primary_800",
        button_cancel_background_fill="#b91c1c", button_cancel_background_fill_dark="#b91c1c",
        button_cancel_background_fill_hover="#991b1b", button_cancel_background_fill_hover_dark="#991b1b",
        link_text_color_dark="*secondary_400", link_text_color_hover_dark="*secondary_300",
    )


#: Light calls (a picture, a bin's pictures, a tab's first data) running at once; runs take turns on
#: the heavy slot. ``$NCTV_LIGHT_WORKERS``.
LIGHT_CONCURRENCY = env_limit("NCTV_LIGHT_WORKERS", 4)
#: The light lane: every queued event that is not a run.
LIGHT_LANE = dict(concurrency_id=LIGHT, concurrency_limit=LIGHT_CONCURRENCY)


@dataclass
class Shared:
    """The model-and-data inputs every heavy tab reads, in handler order."""

    model: gr.Dropdown
    hub_id: gr.Textbox
    dataset: gr.Dropdown
    calibration_size: gr.Number
    test_size: gr.Number
    seed: gr.Number
    bins: gr.Slider

    @property
    def inputs(self) -> list:
        return [self.model, self.hub_id, self.dataset, self.calibration_size, self.test_size, self.seed, self.bins]


def fit_width(fig: Any) -> Any:
    """Let a plotly figure take the width of its box on the page (the library sets a print width)."""
    if fig is not None and hasattr(fig, "update_layout"):
        fig.layout.width = None
        fig.update_layout(autosize=True)
    return fig


def _plots_fit(fn):
    """Wrap a handler so that every plotly figure it returns or yields fills its box."""
    import functools
    import inspect

    def fix(out):
        return tuple(fit_width(o) for o in out) if isinstance(out, tuple) else fit_width(out)

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen(*args, **kwargs):
            inner = fn(*args, **kwargs)
            try:
                for out in inner:
                    yield fix(out)
            finally:
                inner.close()  # on Stop, reach the handler's own clean-up at once
        return gen

    @functools.wraps(fn)
    def plain(*args, **kwargs):
        return fix(fn(*args, **kwargs))
    return plain


def describe_model(choice: str | None, hub_id: str | None) -> str:
    from nctv.zoo import ENTRIES

    typed = (hub_id or "").strip()
    if typed:
        return (f"Hub model **{typed}**: downloaded on the first run (needs the network once, then cached). It must "
                f"be a timm model with config.json and model.safetensors of at most {max_model_bytes() / 1e6:,.0f} MB; "
                "pick a dataset it was trained for.")
    entry = ENTRIES.get(choice or "")
    if entry is None:
        return ""
    where = "embedded: works offline" if entry.embedded else f"from the Hugging Face Hub ({entry.source[7:]})"
    return f"**{entry.name}** — {entry.description} ({where}; dataset: {', '.join(entry.datasets)})"


#: The tabs the shared panel drives; Learn and Try follow the latest calibration instead.
PANEL_TABS = "Calibrate, γ sweep and Initialisation"


def panel_label(model: str | None, hub_id: str | None, dataset: str | None, size: Any) -> str:
    """The shared panel's title: what is chosen, and which tabs use it (shown while it is closed)."""
    name = (hub_id or "").strip() or model or "no model"
    try:
        images = f"{int(size):,} calibration images"
    except (TypeError, ValueError):
        images = "calibration size not set"
    return f"Model and data: {name} · {dataset or DEFAULT_DATASET_CHOICE} · {images} (for {PANEL_TABS})"


def _shared_panel() -> Shared:
    from nctv.zoo import DEFAULT_MODEL

    label = panel_label(DEFAULT_MODEL, "", DEFAULT_DATASET_CHOICE, DEFAULT_CALIBRATION_SIZE)
    # Closed by default, so that the tabs come first on a phone and the Learn diagram fits a projector.
    with gr.Accordion(label, open=False, elem_id="shared-panel") as panel:
        gr.Markdown(f"These settings drive the {PANEL_TABS} tabs. **Learn** and **Try your own image** use "
                    "the latest calibration you ran (at first, the pre-computed one).")
        with gr.Row():
            model = CheckedDropdown(model_choices(), value=DEFAULT_MODEL, label="Model", scale=2)
            hub_id = CheckedTextbox(label="…or your own Hugging Face Hub model id",
                                placeholder="e.g. timm/resnet18.a1_in1k", scale=2, max_length=MAX_TEXT_CHARS)
            dataset = CheckedTypedDropdown(dataset_choices(), value=DEFAULT_DATASET_CHOICE, allow_custom_value=True,
                                  label="Calibration pool (dataset)", scale=2, info=dataset_hint(),
                                  elem_id="dataset-box")
        with gr.Row():
            size = CheckedNumber(DEFAULT_CALIBRATION_SIZE, precision=0, label="Calibration size (images)",
                             elem_id="calibration-size",
                             info=f"10 up to the pool's size; {DEFAULT_CALIBRATION_SIZE} keeps a live run under a "
                                  "minute on a CPU")
            test_size = CheckedNumber(0, precision=0, label="Test size (images)", elem_id="test-size",
                                  info="0: the whole test split (10,000 images for Fashion-MNIST); else at least 10")
            seed = CheckedNumber(0, precision=0, label="Seed", info="0 to 2³¹ − 1; draws the calibration split and seeds δ")
            bins = CheckedSlider(5, 50, APP_BINS, step=1, label="Bins (ECE, AECE, SCE)")
        # A typed dataset this server does not take is refused here, before Run (page.js keeps it as typed).
        dataset_note = gr.Markdown("", elem_id="dataset-note")
        info = gr.Markdown(describe_model(DEFAULT_MODEL, ""))
    dataset.change(dataset_refusal, dataset, dataset_note, queue=False, show_progress="hidden",
                   api_visibility="private")
    for box in (model, hub_id):
        box.change(describe_model, [model, hub_id], info, queue=False, show_progress="hidden", api_visibility="private")
    for box in (model, hub_id, dataset, size):
        box.change(lambda *v: gr.update(label=panel_label(*v)), [model, hub_id, dataset, size], panel, queue=False,
                   show_progress="hidden", api_visibility="private")
    return Shared(model, hub_id, dataset, size, test_size, seed, bins)


#: The Fitter's least width (px): on a phone's screen it then takes a row of its own, where each choice
#: fits on one line (beside another setting, they wrapped word by word).
FITTER_MIN_WIDTH = 280


def _nc_controls(gamma: bool = True, init: bool = True):
    """γ, λ, initialisation, fitter and epochs inputs (some tabs fix γ or the initialisation)."""
    out = {}
    with gr.Row():
        if gamma:
            out["gamma"] = CheckedTypedDropdown(cal_tab.GAMMA_CHOICES, value="1", allow_custom_value=True, label="Focal-loss γ",
                                       info=f"0 to {GAMMA_MAX:g}; 0 = cross entropy; auto tries 0, 0.5, 1, 2, 3 (lowest "
                                            "calibration ECE)")
        out["weight_decay"] = CheckedTypedDropdown(cal_tab.WEIGHT_DECAY_CHOICES, value="default", allow_custom_value=True,
                                          label="Weight decay λ",
                                          info=f"0 to {WEIGHT_DECAY_MAX:,.0f}; default = the fitter's own (fast and "
                                               "paper: auto = 0.1 × the unperturbed model's loss, the paper's rule; "
                                               "toolkit: 0.01 on ‖δ‖); strong = 1 × that loss")
    with gr.Row():
        if init:
            out["init"] = CheckedRadio(cal_tab.INIT_CHOICES, value="random", label="δ initialisation",
                                       info=cal_tab.INIT_INFO)
        out["fitter"] = CheckedRadio(cal_tab.FITTER_CHOICES, value="fast", label="Fitter", info=cal_tab.FITTER_INFO,
                                     min_width=FITTER_MIN_WIDTH)
        out["epochs"] = CheckedNumber(100, precision=0, label="Epochs (recipes only)", info="1 to 1000; theirs: 100")
        out["lr"] = CheckedTextbox("default", label="Learning rate (recipes only)", max_length=MAX_TEXT_CHARS,
                               info=cal_tab.LR_INFO)
    return out


def conformal_label(score: Any, coverage: Any) -> str:
    """The prediction sets' panel title: the score and coverage chosen (shown while it is closed)."""
    name = dict((value, label) for label, value in cal_tab.CONFORMAL_CHOICES).get(score, "?")
    level = f" at {coverage:g} % coverage" if isinstance(coverage, (int, float)) else ""
    return f"Prediction sets: {name}{level}"


def _conformal_controls() -> tuple:
    """The score and the coverage (per cent) of every row's conformal prediction sets: (score, coverage)."""
    low, high = cal_tab.COVERAGE_PERCENT
    with gr.Accordion(conformal_label(cal_tab.DEFAULT_SCORE, cal_tab.DEFAULT_COVERAGE_PERCENT), open=False,
                      elem_id="conformal-panel") as panel:
        gr.Markdown("Each method's row also gets a **set** of classes that should hold the right answer as often "
                    "as the coverage says (split conformal prediction, on the calibration split). The table "
                    "under the results gives each set's coverage and size on the test split.")
        score = CheckedRadio(cal_tab.CONFORMAL_CHOICES, value=cal_tab.DEFAULT_SCORE, label="Score",
                             elem_id="conformal-score")
        gr.Markdown(cal_tab.CONFORMAL_INFO, elem_id="conformal-info")
        coverage = CheckedSlider(low, high, cal_tab.DEFAULT_COVERAGE_PERCENT, step=1, label="Coverage (%)",
                                 info="how often a set should hold the right answer", elem_id="conformal-coverage")
    # One event for both, its last trigger answered last: two events could answer out of order, and the
    # title then named the values before the last change.
    gr.on([score.change, coverage.change], lambda *v: gr.update(label=conformal_label(*v)), [score, coverage], panel,
          queue=False, show_progress="hidden", trigger_mode="always_last", api_visibility="private")
    return score, coverage


def _run_bar(label: str, status_id: str, status: str = ""):
    """Run and Stop, and below them the status line: progress, the time left, the result or what
    went wrong, where the person who pressed Run is looking."""
    with gr.Column(elem_classes="run-bar"):
        with gr.Row():
            run = gr.Button(label, variant="primary", min_width=120)
            stop = gr.Button("Stop", variant="stop", min_width=80)
        status = gr.Markdown(status, elem_id=status_id)
    # Said in the page at the click, before the server answers: runs take turns on the server, and
    # the status line is where a run shows how it goes (Gradio's own progress marks are hidden). On a
    # phone the button may sit at the screen's bottom edge, the status line below it out of sight: it
    # is scrolled just into view (no further, so the button stays in sight too).
    run.click(None, None, status, js=f"""() => {{
        const line = document.getElementById("{status_id}");
        if (line) requestAnimationFrame(() => line.scrollIntoView({{block: "nearest"}}));
        return "**Starting** — a run begins when the one before it (anyone's) has finished.";
    }}""", queue=False, api_visibility="private")
    return run, stop, status


#: Run buttons accept a click even while the page believes a run is pending. With Gradio's default
#: ("once") a Stop that raced the run's last message left the page waiting for a run the server had
#: already ended, and every later click on Run was ignored (seen in about one browser-test session in
#: three). Runs share one slot on the server (``HEAVY``), so a second click queues behind the first.
RUN_TRIGGER = "multiple"


def _stop(button: gr.Button, event, status: gr.Markdown) -> None:
    """Stop cancels the running event (every fitter notices within one iteration, and the next run
    starts only once this one's worker has ended), then says so.

    The status is written once the stopped run no longer streams (:func:`stopped_status`), so that
    no update the run sent before the cancellation reached the server can overwrite it."""
    button.click(None, None, None, cancels=[event], queue=False, api_visibility="private").then(
        stopped_status, None, status, show_progress="hidden", concurrency_limit=None, api_visibility="private")
    stoppable(event, status)  # a cancel the page did not send ends its run with the same status


def _study_run(bar: tuple, plot_label: str, plot_id: str, handler, inputs: list, api_name: str,
               first: tuple = (None, "", None), menu: tuple | None = None) -> None:
    """Figure, table and downloads of a study tab (γ sweep, initialisation) below its settings, with
    ``handler`` streaming into the status of its Run bar (``bar``: run, stop, status) and those three
    on the heavy queue; ``first``: the figure, table and files shown before any run; ``menu``: (the
    shared panel, the tab's view of a menu model's study), to show a picked model's study at once."""
    run, stop, status = bar
    fig = gr.Plot(fit_width(first[0]), label=plot_label, elem_id=plot_id)
    table = gr.Markdown(first[1], elem_classes="result-table")
    files = gr.File(first[2] or None, label="Download (JSON; for slides: PNG, SVG, PDF, slides.tex)",
                    file_count="multiple", interactive=False,
                    elem_classes="download-list")
    event = run.click(_plots_fit(handler), inputs, [status, fig, table, files],
                      api_name=api_name, concurrency_limit=1, concurrency_id=HEAVY, show_progress_on=[status],
                      show_progress="hidden", trigger_mode=RUN_TRIGGER)
    _stop(stop, event, status)
    if menu is not None:  # a menu model's pre-computed study, shown at once (no model pass)
        import functools

        from nctv.ui.shipped import menu_study_view

        shared, view = menu
        shared.model.change(_plots_fit(functools.partial(menu_study_view, view, outputs=4)),
                            [shared.model, shared.hub_id], [status, fig, table, files], show_progress="hidden",
                            api_visibility="private", **LIGHT_LANE)


def _calibrate_tab(shared: Shared, state: gr.State):
    status0, table0, diagrams0, params0, delta0, files0 = cal_tab.precomputed_view()
    # What an opened group of the diagrams needs of this visitor's latest run (None: the shipped one).
    shown = gr.State(None, time_to_live=CALIBRATION_TTL_S)
    with gr.Row():
        with gr.Column(scale=1, min_width=300):
            run, stop, status = _run_bar("Run calibration", "calibrate-status", status0)
            methods = CheckedCheckboxGroup(cal_tab.method_choices(), value=list(APP_METHODS), label="Methods",
                                       info="The uncalibrated model is always the reference row. Matrix Scaling, "
                                            "MS-ODIR and Dir-ODIR are slow on a CPU (up to minutes).")
            with gr.Accordion("Neural Clamping settings", open=True):
                nc = _nc_controls()
            sets = _conformal_controls()
            # Any classifier's logits (text, audio, tables…): the ticked logit methods, the same tables.
            with gr.Accordion("Your own logits (any classifier)", open=False, elem_id="logits-panel"):
                gr.Markdown("A `.npz`, `.safetensors` or `.csv` file of calibration and test logits and labels, or of "
                            "one set that is split in halves by the seed (docs/logits.md). The ticked methods that "
                            "work on logits run on it, with the prediction sets chosen above; Neural Clamping "
                            "needs the model's pictures.")
                logits_upload = gr.File(label="Logits and labels", file_types=[".npz", ".safetensors", ".csv"],
                                        elem_id="logits-file")
                logits_run = gr.Button("Calibrate these logits", elem_id="logits-run")
        with gr.Column(scale=3):
            with gr.Column(visible=False) as live_panel:
                live = gr.Plot(label="Neural Clamping as it trains: loss and T", elem_id="live-plot")
            table = gr.Markdown(table0, elem_id="results-table", elem_classes="result-table")
            # Drawn in the page from the numbers the server computes once per result.
            diagrams = cal_tab.diagram_view(diagrams0)
            # The learned parameters, then δ made visible on a test picture: amplified and blended in the page.
            params = gr.Markdown(params0, elem_id="calibrate-params")
            delta = cal_tab.delta_viewer(delta0)
            # No height cap: every file in view, calibrators.zip (the one to reuse) first.
            files = gr.File(files0, label="Download this result (calibrators.zip, JSON, CSV, Markdown, LaTeX, "
                                          "figures and tables for slides, δ)", file_count="multiple", interactive=False,
                            elem_id="calibrate-files", elem_classes="download-list")
            # On a Space with sign-in: push one of the run's calibrators to the visitor's own repository.
            hub_push.push_panel(files, [m for m in cal_tab.method_choices() if m != cal_tab.REFERENCE])
    inputs = shared.inputs + [methods, nc["gamma"], nc["weight_decay"], nc["init"], nc["fitter"], nc["epochs"], nc["lr"],
                              *sets]
    outputs = [status, live_panel, live, table, diagrams, params, delta, files, state, shown]
    # The status line's own text is the progress (step, time left) and, after a failure, the error:
    # Gradio's progress and error marks go on it alone and are hidden there (APP_CSS), since they
    # would cover that text. The result below stays in view until the new one replaces it.
    event = run.click(_plots_fit(cal_tab.calibrate), inputs, outputs, api_name="calibrate",
                      concurrency_limit=1, concurrency_id=HEAVY, show_progress_on=[status],
                      show_progress="hidden", trigger_mode=RUN_TRIGGER)
    _stop(stop, event, status)
    logits_event = logits_run.click(cal_tab.calibrate_logits, [logits_upload, methods, shared.bins, shared.seed, *sets],
                                    [status, table, diagrams, params, delta, files, shown], api_name="calibrate_logits",
                                    concurrency_limit=1, concurrency_id=HEAVY, show_progress_on=[status],
                                    show_progress="hidden")
    _stop(stop, logits_event, status)
    # A menu model with a pre-computed study (in assets/ or the operator's Hub repository): shown at
    # once, labelled as the default's is, and Learn and Try use it; no model pass, no GPU.
    shared.model.change(cal_tab.menu_model_view, [shared.model, shared.hub_id],
                        [status, table, diagrams, params, delta, files, state, shown], show_progress="hidden",
                        api_visibility="private", **LIGHT_LANE)
    # A clicked bar: the pictures of that group go to the view's "bin" property. Every click counts;
    # the page keeps the answer to its latest request only.
    diagrams.open_bin(cal_tab.open_group, [shown], [diagrams], show_progress="hidden", trigger_mode="multiple",
                      api_visibility="private", **LIGHT_LANE)
    return event


def _gamma_tab(shared: Shared):
    gr.Markdown("Neural Clamping fitted for each γ of the grid: each row is the fit **Run calibration** gives at that "
                "γ with the same settings. The chosen γ is the one γ = auto would keep (lowest calibration ECE).")
    status0, *first = gamma_tab.shipped_view()
    bar = _run_bar("Run γ sweep", "gamma-status", status0)
    with gr.Row():
        # Range checks live in the handler, whose messages name γ.
        g_from = CheckedNumber(0.0, label="γ from", info=f"0 to {GAMMA_MAX:g}")
        g_to = CheckedNumber(1.0, label="γ to", info=f"up to {GAMMA_MAX:g}")
        g_step = CheckedNumber(0.1, label="γ step", info=f"> 0; at most {gamma_tab.MAX_GAMMAS} values")
    nc = _nc_controls(gamma=False)
    inputs = shared.inputs + [g_from, g_to, g_step, nc["weight_decay"], nc["init"], nc["fitter"], nc["epochs"],
                              nc["lr"]]
    _study_run(bar, "ECE, entropy and loss against γ", "gamma-plot", gamma_tab.gamma_sweep, inputs,
               "gamma_sweep", tuple(first), menu=(shared, gamma_tab.shipped_view))


def _init_tab(shared: Shared):
    gr.Markdown("Neural Clamping started from a random δ and from the data-driven δ̃ of Theorem 1, several runs "
                "each, scored on the test split.")
    status0, *first = init_tab.shipped_view()
    bar = _run_bar("Run initialisation study", "init-status", status0)
    runs = CheckedSlider(2, init_tab.MAX_RUNS, APP_INIT_RUNS, step=1, label="Runs per initialisation")
    nc = _nc_controls(init=False)
    inputs = shared.inputs + [runs, nc["gamma"], nc["weight_decay"], nc["fitter"], nc["epochs"], nc["lr"]]
    _study_run(bar, "Random vs data-driven δ", "init-plot", init_tab.init_study, inputs,
               "init_study", tuple(first), menu=(shared, init_tab.shipped_view))


def _try_tab(state: gr.State):
    gr.Markdown("One picture through the model as it is, with temperature scaling and with Neural Clamping, using "
                "your latest calibration from the first tab (or the pre-computed one). The embedded models know "
                "Fashion-MNIST: clothing, light on a dark background.")
    # Two columns on a wide screen. On a phone they stack in reading order: the picture, then its result,
    # then the shipped examples and the calibrators' loader (APP_CSS reorders the column's parts).
    with gr.Row(elem_id="try-row"):
        with gr.Column(scale=1, min_width=300, elem_id="try-inputs"):
            examples = try_tab.example_images()
            with gr.Tabs(elem_id="try-sources"):
                with gr.Tab("Picture"):
                    image = CheckedImage(examples[0] if examples else None, type="filepath", image_mode=None,
                                         sources=["upload", "clipboard", "webcam"],
                                         label="Upload, paste or take a picture", height=300, elem_id="try-image")
                with gr.Tab("Draw"):
                    sketch = CheckedSketchpad(label="Draw a piece of clothing (white on black)", type="numpy",
                                              image_mode="RGB", canvas_size=(280, 280), value=_black_canvas(),
                                              brush=gr.Brush(colors=["#ffffff", "#bbbbbb", "#777777"],
                                                             default_color="#ffffff", default_size=14),
                                              height=320, elem_id="try-sketch")
                    draw_btn = gr.Button("Classify the drawing", variant="primary")
            with gr.Group(elem_id="try-corrupt"):
                corruption = CheckedDropdown(try_tab.corruption_choices(), value=try_tab.DEFAULT_CORRUPTION,
                                             label="Corrupt the picture", elem_id="try-corruption",
                                             info="as a camera in the rain or a scanner out of focus would give it; "
                                                  "the Shift tab shows how each method holds on the test split")
                severity = CheckedSlider(0, try_tab.MAX_SEVERITY, 0, step=1, label="Severity",
                                         info="0: the picture as it is; 1 mild … 5 strong", elem_id="try-severity")
            with gr.Column(elem_id="try-more"):
                shipped = gr.Examples([[p] for p in examples], inputs=[image], label="Or pick a shipped example",
                                      examples_per_page=12, cache_examples=False,
                                      api_visibility="private") if examples else None
                upload = gr.UploadButton("Load saved calibrators (.zip)", file_types=[".zip"], file_count="single",
                                         size="sm", elem_id="try-load-calibrator")
                loaded_note = gr.Markdown("Or load the calibrators.zip that the Calibrate tab offers for download.",
                                          elem_id="try-loaded")
        with gr.Column(scale=2, min_width=300, elem_id="try-results"):
            # The verdict first: a foreign picture's confidences below it are dimmed.
            verdict = gr.HTML(try_tab.verdict_html(None), css_template=try_tab.VERDICT_CSS, js_on_load=None,
                              elem_id="try-verdict")
            # HTML bars, not gr.Label, which rounds to whole percent and so hides calibration's effect.
            chart = gr.HTML(css_template=try_tab.CHART_CSS, js_on_load=None, elem_id="try-chart")
            delta = delta_widget(elem_id="try-delta")
            note = gr.Markdown(elem_id="try-note")
            slides_tab.figure_control("try", slides_tab.TRY_READ, slides_tab.try_download, [],
                                      **LIGHT_LANE)
    outputs = [verdict, chart, delta, note]
    light = dict(LIGHT_LANE, show_progress="minimal")
    shift = [corruption, severity]
    # Which of the picture and the drawing a new corruption applies to: the one classified last.
    last = gr.State(try_tab.PICTURE, time_to_live=CALIBRATION_TTL_S)
    # "input", not "change": the picture's change event fires twice per upload, which doubled both the
    # work and the error message. A failed picture leaves no earlier result behind, nor a broken preview.
    image.input(try_tab.classify, [image, state] + shift, outputs, api_name="classify", **light).failure(
        lambda: (None,) + try_tab.cleared(), None, [image] + outputs, queue=False, api_visibility="private")
    if shipped is not None:
        shipped.load_input_event.then(try_tab.classify, [image, state] + shift, outputs, api_visibility="private",
                                      **light)
    draw_btn.click(try_tab.classify_drawing, [sketch, state] + shift, outputs, api_name="classify_drawing",
                   **light).failure(try_tab.cleared, None, outputs, queue=False, api_visibility="private")
    for done, source in [(image.input, try_tab.PICTURE), (draw_btn.click, try_tab.DRAWING)] + (
            [(shipped.load_input_event.then, try_tab.PICTURE)] if shipped is not None else []):
        done(lambda source=source: source, None, last, queue=False, api_visibility="private")
    # A new corruption or severity: the latest one counts (a drag sends several).
    gr.on([corruption.input, severity.input], try_tab.reclassify, [last, image, sketch, state] + shift, outputs,
          trigger_mode="always_last", api_visibility="private", **light)
    loaded = upload.upload(load_calibrators, [upload, state], [state, loaded_note], api_visibility="private",
                           **LIGHT_LANE)
    loaded.success(try_tab.classify, [image, state] + shift, outputs, api_visibility="private", **light)
    return image, outputs, loaded


def _black_canvas():
    import numpy as np

    return {"background": np.zeros((280, 280, 3), dtype=np.uint8), "layers": [], "composite": None}


def _learn_tab(state: gr.State, *new_calibrations) -> None:
    # Controls, read-outs, diagrams, the table, the explanations and the lesson live in the page, which
    # computes them from the test logits it holds: a move of T costs no request. The logits go to the
    # page on its first view of the tab (with the view a link asks for) and after each calibration run,
    # never with a move.
    view = learn_tab.page_view()
    slides_tab.figure_control("learn", slides_tab.LEARN_READ, slides_tab.learn_download, [state],
                              **LIGHT_LANE)
    with gr.Accordion("The paper's headline results (ECE %, for reference)", open=False):
        gr.Markdown(learn_tab.PAPER_TABLE)
    view.first_view(links.learn_data, [state], [view], show_progress="hidden", api_visibility="private",
                    **LIGHT_LANE)
    # A clicked bar: the pictures of the rows the page asks for go to the view's "bin" property. Every
    # click counts (with "once" a second bar clicked while the first loads would be dropped); the page
    # keeps the answer to its latest request only.
    view.open_bin(learn_tab.open_bin, [state], [view], show_progress="hidden", trigger_mode="multiple",
                  api_visibility="private", **LIGHT_LANE)
    # A finished run, or loaded calibrators, become the Learn tab's model: its logits go to the page once.
    for event in new_calibrations:
        event.success(learn_tab.page_data, [state], [view], show_progress="hidden", api_visibility="private",
                      **LIGHT_LANE)
    # The API's own inputs and outputs (hidden): /explore_temperature answers clients with a diagram, the
    # table and the explanations, as the page computes them.
    api_t = CheckedNumber(1.0, label="Temperature T", visible=False)
    api_bins = CheckedNumber(APP_BINS, precision=0, label="Bins", visible=False)
    api_fig = gr.Plot(visible=False)
    api_table, api_text = gr.Markdown(visible=False), gr.Markdown(visible=False)
    gr.on([], _plots_fit(learn_tab.explore_temperature), [api_t, api_bins, state], [api_fig, api_table, api_text],
          api_name="explore_temperature", **LIGHT_LANE)


def _shift_tab(shared: Shared) -> None:
    import functools

    from nctv.ui.shipped import menu_study_view

    status0, table0, versus0, files0 = shift_tab.shipped_view()
    # Controls, pictures, verdict, curves and diagrams live in the page, which draws every condition from
    # the study's numbers: they go to the page on its first view of the tab, or when a menu model with a
    # study of its own is picked, never with a move.
    view = shift_tab.page_view()
    slides_tab.figure_control("shift", slides_tab.SHIFT_READ, slides_tab.shift_download, [shared.model, shared.hub_id],
                              **LIGHT_LANE)
    status = gr.Markdown(status0, elem_id="shift-status")
    table = gr.Markdown(table0, elem_id="shift-table", elem_classes="result-table")
    with gr.Accordion("Neural Clamping against temperature scaling, every condition", open=False):
        versus = gr.Markdown(versus0, elem_id="shift-versus", elem_classes="result-table")
    files = gr.File(files0 or None, label="Download this study (shift.json, table.csv; for slides: PNG, SVG, PDF, "
                    "slides.tex)", file_count="multiple",
                    interactive=False, elem_id="shift-files", elem_classes="download-list")
    view.first_view(shift_tab.first_view, [shared.model, shared.hub_id], [view], show_progress="hidden",
                    api_visibility="private", **LIGHT_LANE)
    # A picked menu model's own shift study, shown at once like the other tabs' (no model pass).
    shared.model.change(functools.partial(menu_study_view, shift_tab.menu_view, outputs=5),
                        [shared.model, shared.hub_id], [status, table, versus, files, view], show_progress="hidden",
                        api_visibility="private", **LIGHT_LANE)


def build_app() -> gr.Blocks:
    """The whole app (not launched). Initial values come from the shipped pre-computed result."""
    # Uploads are deleted once UPLOAD_KEEP_S old, looked for every third of that.
    with AppBlocks(title=TITLE, analytics_enabled=False, delete_cache=(UPLOAD_KEEP_S // 3, UPLOAD_KEEP_S)) as demo:
        state = gr.State(None, time_to_live=CALIBRATION_TTL_S)  # this visitor's latest Calibration
        gr.Markdown(INTRO, elem_id="intro")
        shared = _shared_panel()
        # What a link asked for and could not be given (links.open_link).
        link_note = gr.Markdown(visible=False, elem_id="link-note")
        with gr.Tabs(overflow_behavior="wrap") as tabs:
            with gr.Tab("Calibrate", id="calibrate"):
                run_event = _calibrate_tab(shared, state)
            with gr.Tab("γ sweep", id="gamma"):
                _gamma_tab(shared)
            with gr.Tab("Initialisation", id="init"):
                _init_tab(shared)
            with gr.Tab("Try your own image", id="try"):
                try_image, try_outputs, loaded = _try_tab(state)
            with gr.Tab("Learn", id="learn"):
                _learn_tab(state, run_event, loaded)
            with gr.Tab("Shift", id="shift"):
                _shift_tab(shared)
        # A link's view (?tab=learn&t=1.5&bins=10&presenter=1, docs/app.md): read from the page's address
        # with the app's own readers, outside the queue (it loads nothing).
        demo.load(links.open_link, None, [tabs, shared.model, link_note], queue=False,
                  show_progress="hidden", api_visibility="private")
        # The Try tab opens with its first example already classified.
        demo.load(_plots_fit(try_tab.classify), [try_image, state], try_outputs, api_visibility="private",
                  show_progress="hidden", **LIGHT_LANE)
        # The agents' tools (MCP), each in the lane of the page's work of its kind.
        mcp_tools.register(heavy=dict(concurrency_limit=1, concurrency_id=HEAVY), light=dict(LIGHT_LANE))
    # No bound on the whole queue: the lanes bound what each page, address and the runs may keep waiting.
    demo.queue(default_concurrency_limit=1, max_size=None)
    return demo


def warm_up() -> None:
    """Load the default model, its default splits' logits and the shipped calibration's
    out-of-distribution check, so the first live run and the first picture start at once."""
    from nctv.zoo import DEFAULT_MODEL

    try:
        with forkgate.computing():  # on ZeroGPU a visitor's fork waits for it (or its next piece)
            spec = SplitSpec(DEFAULT_MODEL, None, DEFAULT_CALIBRATION_SIZE, 0)
            get_logits(spec, "calibration")
            get_logits(spec, "test")
            pre = load_precomputed()
            if pre is not None:
                ood_detector(pre.split)  # the Try tab's first picture then pays nothing for its check
    except Exception:  # noqa: BLE001 - a failed warm-up only costs time later, where errors are shown
        log.exception("warming up the default model failed")


def page_script() -> str:
    """``static/page.js``: what the whole page does in the browser (the dataset box keeps what is typed;
    a table too wide for its box says so)."""
    from pathlib import Path

    return (Path(__file__).parent / "static" / "page.js").read_text(encoding="utf-8")


def launch(demo: gr.Blocks | None = None, **overrides: Any):
    """Launch on ``$GRADIO_SERVER_NAME`` (default 0.0.0.0) and ``$PORT`` / ``$GRADIO_SERVER_PORT``
    (default 7860), with the upload and request caps and error display the app relies on, and the
    agents' tools served over MCP at ``/gradio_api/mcp`` (docs/agents.md)."""
    from nctv.ui.gpu import gate_handlers, prepare_server

    prepare_server()  # before any torch work: on ZeroGPU the server must stay safe to fork
    # Gradio warns of endpoints with a gr.State input before tools_only drops the page's endpoints (which
    # have them) from the tools; none of the tools has one.
    warnings.filterwarnings("ignore", message="This MCP server includes a tool that has a gr.State input")
    demo = demo or build_app()
    gate_handlers(demo)  # on ZeroGPU: no fork while a handler computes (nctv.forkgate)
    threading.Thread(target=warm_up, name="nctv-warm-up", daemon=True).start()
    port = os.environ.get("PORT") or os.environ.get("GRADIO_SERVER_PORT") or "7860"
    settings = dict(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"),
        server_port=int(port),
        show_error=True,
        max_file_size=MAX_UPLOAD_BYTES,
        app_kwargs={"middleware": [Middleware(QuietDisconnects), Middleware(mcp_tools.CallerAddress),
                                   Middleware(RequestGuard), Middleware(PageSessions), Middleware(CancelEndsStreams),
                                   Middleware(GoneResults), Middleware(KeptAnswers), Middleware(NoServerPaths)],
                    "lifespan": mcp_tools.tools_only(bounded_server)},
        mcp_server=True,
        allowed_paths=[str(examples_dir())],
        footer_links=["api", "gradio"],
        css=APP_CSS,
        theme=app_theme(),
        js=page_script(),
    )
    settings.update(overrides)
    return demo.launch(**settings)
