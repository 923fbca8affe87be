"""The app's tools for agents (Model Context Protocol): four endpoints an agent can use without the page,
served by Gradio's MCP server at ``/gradio_api/mcp`` (docs/agents.md).

* ``calibrate_logits``: a logits file in; every logit method's table, as Markdown and as JSON.
* ``calibration_test``: a logits file in; the top-label and classwise calibration tests' p-values and
  the ECE with its interval.
* ``classify``: a picture in; the model's answer before and after calibration.
* ``explain_temperature``: a temperature and bins in; the metrics of the shipped test logits at that T.

Each tool's description and parameters come from its docstring and signature (Gradio reads the
``Args:`` lines). The tools go through the page's bounds: files reach them through this app's own upload
route (the request and upload caps, the address's disk budget; any other address or path is refused, as
on every input of the app: :mod:`nctv.ui.uploads`), logits files are read by
:mod:`nctv.logits_file` with its caps, pictures by the Try tab's checks, and each tool joins the lane of
the page's work of its kind (:func:`register`). The page's own endpoints stay in the API for
``gradio_client`` but are not tools: Gradio lists every public endpoint as one, and
:func:`tools_only` keeps these four.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np

from nctv.settings import APP_BINS
from nctv.ui.common import parse_whole, user_errors
from nctv.ui.uploads import UPLOAD_FIRST



# --------------------------------------------------------------------------- the tools


@user_errors
def calibrate_logits(logits_file: str, bins: int = APP_BINS, seed: int = 0) -> str:
    """Calibrate any classifier's logits with every post-hoc calibration method that works on logits alone
    (temperature scaling, TS by grid search, vector, matrix and structured scaling, MS-ODIR, Dir-ODIR,
    ensemble temperature scaling, histogram binning, isotonic regression, ...): each is fitted on the
    file's calibration split and scored on its test split. The table gives accuracy, ECE, AECE, classwise
    ECE and smooth ECE with 95 % intervals from resampling the test split; a best is
    marked only where the paired interval of its difference excludes 0. Slow methods (Matrix Scaling,
    MS-ODIR, Dir-ODIR) can take minutes on tens of thousands of rows.

    Args:
        logits_file: A .npz, .safetensors or .csv file of logits and labels: arrays calibration_logits, calibration_labels, test_logits, test_labels, or logits and labels (one set, split in halves by the seed); a .csv has a label column, an optional split column and one column per class.
        bins: Number of equal-width confidence bins of ECE, AECE and classwise ECE (2 to 100; 15 is usual).
        seed: Seed (0 to 2**31 - 1) of the split into halves, when the file holds one set, and of the resampling.

    Returns:
        The table in Markdown (methods as rows, metrics in per cent with their intervals), then the same table as JSON in a fenced block (every cell with its value, interval and rank).
    """
    from nctv import logits_file as lf
    from nctv import report
    from nctv.experiment import RunOptions
    from nctv.methods import METHODS

    data, bins, seed = _logits(logits_file, bins, seed)
    methods = [name for name, spec in METHODS.items() if not spec.needs_model]
    result = lf.run_on_logits(data, methods, RunOptions(seeds=(seed,), bins=(bins,), progress=False))
    table = report.results_table(result, bins)
    return answer(report.to_markdown(table), report.table_to_dict(table))


@user_errors
def calibration_test(logits_file: str, bins: int = APP_BINS, seed: int = 0) -> str:
    """Test whether a classifier is calibrated, from a file of its logits and labels: the p-values of the
    top-label test (is the confidence of the predicted class calibrated?) and the classwise test (is every
    class's probability calibrated?), by consistency resampling (labels drawn from the model's own
    probabilities, Bröcker & Smith 2007), and the ECE with its 95 % interval from resampling the rows.
    Nothing is fitted, so every row of the file is used, both splits together. A small p-value (below 0.05)
    says the model is not calibrated; a large one says the data cannot tell it from a calibrated model.

    Args:
        logits_file: A .npz, .safetensors or .csv file of logits and labels: arrays logits and labels, or calibration_logits, calibration_labels, test_logits and test_labels; a .csv has a label column and one column per class.
        bins: Number of equal-width confidence bins of the ECE and of the tests' statistics (2 to 100; 15 is usual).
        seed: Seed (0 to 2**31 - 1) of the resampling.

    Returns:
        The tests' results in a sentence and a Markdown table, then the same figures as JSON in a fenced block (fractions: ece, ece_low, ece_high, classwise_ece, p_top_label, p_classwise; and rows, classes, bins).
    """
    from nctv import logits_file as lf
    from nctv.experiment import RunOptions
    from nctv.intervals import consistent

    data, bins, seed = _logits(logits_file, bins, seed)
    rows = dataclasses.replace(data, test_logits=np.concatenate([data.calibration_logits, data.test_logits]),
                               test_labels=np.concatenate([data.calibration_labels, data.test_labels]))
    result = lf.run_on_logits(rows, [REFERENCE], RunOptions(seeds=(seed,), bins=(bins,), progress=False))
    stats = result.methods[REFERENCE].metrics[bins]
    ece = stats["ece"]
    figures = {"ece": ece.mean, "ece_low": ece.ci_low, "ece_high": ece.ci_high, "classwise_ece": stats["sce"].mean,
               "p_top_label": stats["calibration_p"].mean, "p_classwise": stats["classwise_calibration_p"].mean,
               "rows": len(rows.test_labels), "classes": data.n_classes, "bins": bins}
    level = result.settings["intervals"]["level"]

    def verdict(p: float, what: str) -> str:
        return (f"the {what} test cannot tell the model from a calibrated one (p = {p:.3g})" if consistent(p, level)
                else f"the {what} test says it is not calibrated (p = {p:.3g})")

    text = (f"On {figures['rows']:,} rows of {data.name} ({data.n_classes} classes, {bins} bins): "
            f"{verdict(figures['p_top_label'], 'top-label')}; {verdict(figures['p_classwise'], 'classwise')}.\n\n"
            f"| figure | value |\n| --- | --- |\n"
            f"| ECE | {100 * ece.mean:.2f} % [{100 * ece.ci_low:.2f}, {100 * ece.ci_high:.2f}] ({100 * level:g} % "
            f"interval) |\n| classwise ECE | {100 * figures['classwise_ece']:.2f} % |\n"
            f"| p, top-label test | {figures['p_top_label']:.4g} |\n| p, classwise test | {figures['p_classwise']:.4g} |")
    return answer(text, figures)


@user_errors
def classify(picture: str) -> str:
    """Classify one picture with the app's model (the shipped Fashion-MNIST classifier unless the Space
    chose another) as it is, with temperature scaling and with Neural Clamping, calibrated on its
    calibration split: the model's answer and its confidence before and after calibration, and whether the
    picture looks like the model's data at all (an out-of-distribution check). The embedded models know
    Fashion-MNIST clothing: a light garment on a dark background.

    Args:
        picture: A PNG, JPEG, WebP, BMP or GIF picture.

    Returns:
        The answer in Markdown (the class and its confidence uncalibrated, with temperature scaling and with Neural Clamping), then as JSON in a fenced block: the answer of each way of scoring ("uncalibrated", "temperature scaling", "Neural Clamping"), the classes' probabilities per way, and the out-of-distribution verdict (true: flagged).
    """
    from nctv.ui.try_image import METHODS, score_picture

    s = score_picture(_local(picture), None)
    names = s.loaded.class_names
    ways = {key: name for key, _, name, _ in METHODS if key in s.probs}
    answers = {ways[key]: {"class": names[int(np.argmax(p))], "confidence": float(np.max(p))}
               for key, p in s.probs.items()}
    lines = [f"- {way}: **{a['class']}** at {100 * a['confidence']:.1f} %" for way, a in answers.items()]
    flagged = {True: "flagged: the picture is unlike the model's data, so its answer means little",
               False: "not flagged", None: "unavailable"}[s.verdict.flagged]
    text = (f"The model ({s.cal.model}; calibration: {s.cal.source}) answers:\n" + "\n".join(lines)
            + f"\n\nOut-of-distribution check: {flagged}" + (f" ({s.verdict.measured})." if s.verdict.measured else "."))
    return answer(text, {"model": s.cal.model, "classes": list(names), "answers": answers,
                             "probabilities": {ways[key]: [float(v) for v in p] for key, p in s.probs.items()},
                             "out_of_distribution": s.verdict.flagged})


@user_errors
def explain_temperature(temperature: float = 1.0, bins: int = APP_BINS) -> str:
    """What dividing a classifier's logits by a temperature T does to its calibration, on the app's shipped
    test split (the embedded Fashion-MNIST model's 10,000 test pictures unless the Space chose another):
    accuracy, ECE, AECE, classwise ECE, NLL, Brier score and mean confidence at T = 1 (uncalibrated), at the
    given T and at the T that temperature scaling fitted, with a few sentences on what moved. T above 1
    softens over-confident answers; T below 1 sharpens them; accuracy never changes.

    Args:
        temperature: The temperature T that divides the logits (from 0.001 to 1000).
        bins: Number of equal-width confidence bins of ECE, AECE and classwise ECE (2 to 100; 15 is usual).

    Returns:
        The metrics table and the explanation in Markdown, then the metrics as JSON in a fenced block (fractions), keyed "T = 1", "T = <the given T>" and "T = <temperature scaling's T>".
    """
    from nctv.metrics import evaluate
    from nctv.ui import learn
    from nctv.ui.shipped import load_precomputed, test_logits_of

    table, text = learn.explain(temperature, bins, None)
    t, bins = float(temperature), int(bins)  # checked by explain
    z, y, where = test_logits_of(None)
    ts = load_precomputed().calibration.ts_temperature
    figures = {f"T = {k:g}": evaluate(z.double() / k, y, bins) for k in (1.0, t, ts)}
    return answer(f"{where}\n\n{table}\n\n{text}", figures)


def answer(markdown: str, figures: dict) -> str:
    """A tool's one answer: Markdown for reading, then its figures as JSON in a fenced block for a program
    (one text, which every MCP client shows whole)."""
    return f"{markdown}\n\n```json\n{json.dumps(figures, indent=1)}\n```"


#: The reference row of a run: the model as it is.
REFERENCE = "Uncalibrated"
#: The tools, in the order the tool list gives them.
TOOLS = (calibrate_logits, calibration_test, classify, explain_temperature)


def _logits(logits_file: Any, bins: Any, seed: Any):
    """(the checked logits of a file a tool was given, bins, seed)."""
    from nctv.logits_file import read_logits

    bins = parse_whole(bins, "Number of bins", 2, 100)
    seed = parse_whole(seed, "Seed", 0, 2**31 - 1)
    path = Path(_local(logits_file))
    return read_logits(path, seed=seed, name=path.name), bins, seed


def _local(file: Any) -> str:
    if not file:
        raise ValueError("No file was given: " + UPLOAD_FIRST)
    return str(file)


# --------------------------------------------------------------------------- the endpoints


def _endpoint(tool) -> str:
    return "mcp_" + tool.__name__


def register(heavy: dict, light: dict) -> None:
    """Add the tools to the Blocks being built, as hidden endpoints ``/mcp_<tool>``: ``heavy`` and
    ``light`` are the event settings of the page's two lanes. A logits run or test is heavy work, as the
    Calibrate tab's logits upload is; a picture and a temperature are light, as the Try and Learn tabs'
    are (a picture of a large model then takes the same GPU call as the Try tab's)."""
    def number(label: str, value: float, whole: bool = True) -> gr.Number:
        return gr.Number(value, label=label, precision=0 if whole else None, visible=False)

    lanes = {calibrate_logits: heavy, calibration_test: heavy, classify: light, explain_temperature: light}
    inputs = {
        calibrate_logits: lambda: [gr.File(label="logits_file", visible=False), number("bins", APP_BINS),
                                   number("seed", 0)],
        calibration_test: lambda: [gr.File(label="logits_file", visible=False), number("bins", APP_BINS),
                                   number("seed", 0)],
        classify: lambda: [gr.File(label="picture", file_types=["image"], visible=False)],
        explain_temperature: lambda: [number("temperature", 1.0, whole=False), number("bins", APP_BINS)],
    }
    for tool in TOOLS:
        gr.on([], tool, inputs[tool](), gr.Textbox(label="answer", visible=False), api_name=_endpoint(tool),
              show_progress="hidden", **lanes[tool])


def tools_only(lifespan):
    """``lifespan`` with the MCP server's tools narrowed to :data:`TOOLS` before the app serves anyone.

    Gradio makes a tool of every public endpoint, named after its function; the page's endpoints
    (``/calibrate``, ``/classify``, …) stay public for ``gradio_client`` and so are dropped here."""
    @contextlib.asynccontextmanager
    async def narrowed(app):
        server = app.get_blocks().mcp_server_obj
        if server is not None:
            server.tool_to_endpoint = {server.tool_prefix + tool.__name__: "/" + _endpoint(tool) for tool in TOOLS}
        async with lifespan(app):
            yield

    return narrowed


class CallerAddress:
    """ASGI middleware: a tool call names its caller's address to the queue.

    Gradio's MCP server runs a tool by calling the app's own queue from the server itself, with the tool
    request's headers. Without this, every agent's calls would come from the server's own address and
    share one share of the queue; and an ``X-Forwarded-For`` header an agent wrote itself would reach the
    queue from an address uvicorn trusts, so that any agent could claim any address. The header a tool
    request carries on is therefore the address uvicorn read for it (behind the Space's proxy, the
    visitor's, when ``FORWARDED_ALLOW_IPS`` names the proxy)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and "/gradio_api/mcp" in scope["path"]:
            who = (scope.get("client") or ("unknown",))[0]
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"x-forwarded-for"]
            scope = dict(scope, headers=headers + [(b"x-forwarded-for", who.encode("latin-1"))])
        return await self.app(scope, receive, send)
