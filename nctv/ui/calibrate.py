"""The Calibrate tab: fit the chosen methods on a calibration split of the chosen model, score
them on its test split, and show the table, the reliability diagrams, the learned T and δ.

:func:`run_calibration` is the work itself (no Gradio in it; ``scripts/make_precomputed.py`` uses
it too, so the shipped result is exactly what the app computes). Every method is fitted once, with
the split's seed; logit-space methods reuse the cached unperturbed logits, Neural Clamping
reports its loss and T after every step for the live view.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

import gradio as gr
import torch

from nctv.metrics import evaluate
from nctv.settings import FITTERS
from nctv.ui.common import Worker, export_dir, parse_number_or_auto, parse_whole, user_errors, with_warnings
from nctv.ui.state import (
    NC_METHODS,
    PRECOMPUTED_LABEL,
    TS_METHOD,
    Calibration,
    SplitSpec,
    get_logits,
    get_model,
    get_splits,
    model_hash,
    resolve_dataset,
    resolve_model_name,
    test_metrics,
)

REFERENCE = "Uncalibrated"
#: Methods ticked when the page opens: quick on a CPU. MS-ODIR and Dir-ODIR cross-validate 49
#: regularisation settings (minutes on a CPU), Matrix Scaling takes tens of seconds: offered, not ticked.
DEFAULT_METHODS = ("Uncalibrated", "Temperature Scaling", "TS by Grid Search", "Vector Scaling", "Neural Clamping (FL)")
#: Methods that take the minutes they need without a progress report.
SLOW_METHODS = ("Matrix Scaling", "MS-ODIR", "Dir-ODIR")
#: Rows of the paper's ablation, evaluated from another method's fit; not offered on their own here.
_ABLATION_ONLY = ("NC input only", "NC output only")
FITTER_CHOICES = [("fast (default: L-BFGS, then T by calibration ECE; about 6 passes)", "fast"),
                  ("paper recipe (SGD + momentum, lr 0.001, batch 512, 100 epochs)", "paper"),
                  ("authors' toolkit recipe (SGD + momentum, lr 0.01, batch 1000, 100 epochs)", "toolkit")]
INIT_CHOICES = [("random (Gaussian, std 0.1)", "random"), ("data-driven (Theorem 1)", "data")]
GAMMA_CHOICES = ["auto", "0", "0.5", "1", "2", "3"]
WEIGHT_DECAY_CHOICES = ["auto", "0", "0.001", "0.01", "0.1"]
#: Unit of work of a logit-space method; a Neural Clamping fit counts as this many.
_NC_WEIGHT = 6

Report = Callable[[tuple], None]


@dataclass(frozen=True)
class NCSettings:
    """Neural Clamping's settings as the visitor chose them (γ and λ may be "auto")."""

    gamma: float | str = 1.0
    weight_decay: float | str = "auto"
    init: str = "random"
    fitter: str = "fast"
    epochs: int = 100


def method_choices() -> list[str]:
    from nctv.calibration import METHODS

    return [n for n in METHODS if n not in _ABLATION_ONLY]


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


def _expected_passes(nc: NCSettings) -> float:
    from nctv.calibration.clamping import GAMMA_CANDIDATES

    per = nc.epochs + 1.0 if nc.fitter != "fast" else 20.0
    return per * (len(GAMMA_CANDIDATES) if nc.gamma == "auto" else 1)


def _takes(spec: Any, parameter: str) -> bool:
    import inspect

    import nctv.calibration as calibration

    cls = calibration.Uncalibrated if spec.cls == "Uncalibrated" else getattr(calibration, spec.cls)
    return parameter in inspect.signature(cls).parameters


def _make(name: str, loaded: Any, nc: NCSettings, seed: int, report: Report):
    from nctv.calibration import METHODS

    spec = METHODS[name]
    kw: dict[str, Any] = {}
    if name == "Temperature Scaling (FL)" and nc.gamma != "auto":
        kw["gamma"] = nc.gamma
    if _takes(spec, "progress"):
        kw["progress"] = False  # the page has its own progress bar; keep the server log clean
    if not spec.needs_model:
        return spec.factory(**kw)
    kw["input_range"] = loaded.input_range
    if spec.stochastic:
        kw.update(weight_decay=nc.weight_decay, init=nc.init, fitter=nc.fitter, epochs=nc.epochs, seed=seed,
                  callback=lambda info: report(("nc", name, info)))
        if name == "Neural Clamping (FL)":
            kw["gamma"] = nc.gamma
    return spec.factory(loaded.model, **kw)


def _learned(m: Any) -> tuple[dict[str, float], torch.Tensor | None]:
    params = {}
    for attr in ("temperature_", "gamma_", "weight_decay_", "n_passes_"):
        v = getattr(m, attr, None)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            params[attr[:-1]] = float(v)
    delta = getattr(m, "delta_", None)
    if isinstance(delta, torch.Tensor):
        delta = delta.detach().float().cpu()
        params["delta_l2"] = float(delta.norm())
        params["delta_linf"] = float(delta.abs().max())
    return params, delta if isinstance(delta, torch.Tensor) else None


def run_calibration(spec: SplitSpec, methods: Sequence[str], n_bins: int, nc: NCSettings,
                    report: Report | None = None) -> tuple[Any, Calibration]:
    """Fit ``methods`` on the calibration split of ``spec``, score them on its test split.

    ``report`` receives ``("progress", fraction, message)`` and, during Neural Clamping fits,
    ``("nc", method, info)`` with NC's step info (step, loss, temperature, passes) plus
    ``total_passes``, the passes of this fit so far over all γ candidates. Returns the
    ``RunResult`` (one run per method, seed = the split's seed, calibrated test logits attached)
    and the visitor's :class:`Calibration`.
    """
    from nctv.calibration import METHODS
    from nctv.results import MethodResult, MetricStats, RunResult, welch_tests

    say: Report = report or (lambda item: None)
    names = _ordered_methods(methods)
    t0 = time.perf_counter()
    units = 3 + sum(_NC_WEIGHT if METHODS[n].stochastic else 1 for n in names)
    done = 0.0

    def step(message: str, amount: float = 1.0) -> None:
        nonlocal done
        done += amount
        say(("progress", min(done / units, 0.99), message))

    say(("progress", 0.0, f"loading model {spec.model}"))
    loaded = get_model(spec.model)
    step("loading the calibration and test splits")
    cal, test = get_splits(spec)
    if n_bins > len(test):
        raise ValueError(f"{n_bins} bins are more than the {len(test)} test images; use fewer bins.")
    step(f"model outputs on {len(cal)} calibration and {len(test)} test images")
    cal_z, cal_y = get_logits(spec, "calibration")
    test_z, test_y = get_logits(spec, "test")
    step("fitting the methods")
    results: dict[str, MethodResult] = {}
    for name in names:
        method_spec = METHODS[name]
        weight = _NC_WEIGHT if method_spec.stochastic else 1
        expected = _expected_passes(nc)
        base = done

        count = {"before": 0.0, "last": 0.0}

        def nc_report(item: tuple, name=name, base=base, weight=weight, count=count) -> None:
            info = dict(item[2])
            # The fast fitter restarts its pass count for every γ candidate; keep a running total.
            passes = float(info.get("passes", count["last"]))
            if passes < count["last"]:
                count["before"] += count["last"]
            count["last"] = passes
            info["total_passes"] = total = count["before"] + passes
            frac = min((base + weight * min(total / expected, 1.0)) / units, 0.99)
            say(("progress", frac, f"{name}: pass {total:.1f}, loss {info['loss']:.4f}, T {info['temperature']:.4f}"))
            say(("nc", name, info))

        slow = " (cross-validates its regularisation: this takes minutes on a CPU)" if name in SLOW_METHODS else ""
        say(("progress", done / units, f"fitting {name}{slow}"))
        m = _make(name, loaded, nc, spec.calibration_seed, nc_report)
        torch.manual_seed(spec.calibration_seed)
        t_fit = time.perf_counter()
        if method_spec.needs_model:
            m.fit(cal.loader())
            seconds = time.perf_counter() - t_fit
            z = m.predict_logits(test.loader())
        else:
            m.fit(cal_z, cal_y)
            seconds = time.perf_counter() - t_fit
            z = m.transform(test_z)
        z = z.detach().float().cpu()
        params, delta = _learned(m)
        scores = evaluate(z, test_y, n_bins=n_bins)
        results[name] = MethodResult(
            name, bool(method_spec.stochastic), bool(method_spec.needs_model), [spec.calibration_seed],
            {n_bins: {k: MetricStats.from_runs([v]) for k, v in scores.items()}}, [seconds], params, z, delta)
        done = base
        step(f"{name} done: ECE {100 * scores['ece']:.2f}%", weight)

    module = loaded.model
    result = RunResult(
        kind="run",
        model={"name": loaded.name, "source": loaded.source, "class": type(module).__name__,
               "n_parameters": int(sum(p.numel() for p in module.parameters())), "fingerprint": model_hash(spec.model)},
        calibration={"name": cal.name, "size": len(cal), "fingerprint": cal.fingerprint, "seed": spec.calibration_seed},
        test={"name": test.name, "size": len(test), "fingerprint": test.fingerprint},
        n_classes=int(test_z.shape[1]),
        class_names=list(loaded.class_names),
        bins=[n_bins],
        seeds=[spec.calibration_seed],
        fitter=nc.fitter,
        methods=results,
        welch=welch_tests(results, [n_bins]),
        cache_hits={},
        settings={"methods": names, "gamma": nc.gamma, "weight_decay": nc.weight_decay, "init": nc.init,
                  "epochs": nc.epochs, "dataset": spec.dataset, "device": str(next(module.parameters()).device),
                  "mean": [float(v) for v in loaded.data_config["mean"]],
                  "std": [float(v) for v in loaded.data_config["std"]]},
        seconds=time.perf_counter() - t0,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        test_labels=test_y,
    )
    say(("progress", 1.0, f"done in {result.seconds:.1f} s"))
    return result, _calibration_of(result, spec, cal_z, cal_y, n_bins)


def _calibration_of(result: Any, spec: SplitSpec, cal_z: torch.Tensor, cal_y: torch.Tensor, n_bins: int) -> Calibration:
    from nctv.calibration import METHODS

    if TS_METHOD in result.methods:
        ts_t = result.methods[TS_METHOD].params["temperature"]
    else:
        # The Try tab always compares with temperature scaling; it costs nothing on cached logits.
        ts_t = float(METHODS[TS_METHOD].factory().fit(cal_z, cal_y).temperature_)
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

    table = report.results_table(result, n_bins)
    if len(result.seeds) == 1:
        # One run per method: a spread of "± 0" would only suggest a precision nobody measured.
        for row in table.cells:
            for cell in row:
                cell.std = None
    head = f"*{source}*\n\n" if source else ""
    return head + report.to_markdown(table)


def reliability_plot(result: Any, n_bins: int, backend: str = "plotly"):
    from nctv import plots

    return plots.reliability_figure(plots.reliability_data_from_result(result, n_bins), backend=backend)


def delta_plot(result: Any, calibration: Calibration, backend: str = "plotly", example: torch.Tensor | None = None,
               title: str | None = None):
    from nctv import plots

    if calibration.delta is None:
        return None
    s = result.settings
    data = plots.delta_image_data(calibration.delta, s["mean"], s["std"], example=example,
                                  title=title or f"δ of {calibration.nc_method}")
    return plots.delta_figure(data, backend=backend)


def params_markdown(result: Any, calibration: Calibration) -> str:
    lines = [f"**Learned parameters** ({calibration.source}; model {calibration.model})", ""]
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


def export_files(result: Any, calibration: Calibration, n_bins: int) -> list[str]:
    """Write the run's files for download: results.json, the tables (Markdown, CSV, LaTeX, JSON),
    reliability.png, delta.png and delta.safetensors (δ with its temperature)."""
    from safetensors.torch import save_file

    from nctv import plots, report

    out = export_dir("calibration")
    (out / "results.json").write_text(result.to_json(), encoding="utf-8")
    paths = [out / "results.json"] + report.write_tables(result, out)
    paths.append(plots.save_figure(reliability_plot(result, n_bins, "matplotlib"), out / "reliability.png", dpi=120))
    fig = delta_plot(result, calibration, "matplotlib")
    if fig is not None:
        paths.append(plots.save_figure(fig, out / "delta.png", dpi=120))
        save_file({"delta": calibration.delta.contiguous()}, str(out / "delta.safetensors"),
                  metadata={"temperature": repr(calibration.nc_temperature), "method": str(calibration.nc_method),
                            "space": "normalised model input", "model": calibration.model})
        paths.append(out / "delta.safetensors")
    return [str(p) for p in paths]


def show(result: Any, calibration: Calibration, n_bins: int) -> tuple:
    """(table, reliability diagrams, parameters, δ image) for a result."""
    return (table_markdown(result, n_bins, calibration.source), reliability_plot(result, n_bins),
            params_markdown(result, calibration), delta_plot(result, calibration))


# --------------------------------------------------------------------------- live view


class LiveTrace:
    """Loss and T of the Neural Clamping fits as they run, drawn as two small line plots."""

    def __init__(self):
        self.series: dict[str, dict[str, list[float]]] = {}

    def add(self, method: str, info: dict) -> None:
        s = self.series.setdefault(method, {"x": [], "loss": [], "temperature": []})
        s["x"].append(float(info.get("total_passes", len(s["x"]))))
        s["loss"].append(float(info["loss"]))
        s["temperature"].append(float(info["temperature"]))

    def figure(self):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        fig = make_subplots(rows=1, cols=2, subplot_titles=["Loss (objective)", "Temperature T"])
        for name, s in self.series.items():
            for col, key in ((1, "loss"), (2, "temperature")):
                fig.add_trace(go.Scatter(x=s["x"], y=s[key], mode="lines+markers", marker=dict(size=4), name=name,
                                         legendgroup=name, showlegend=col == 1), row=1, col=col)
        fig.update_xaxes(title_text="passes over the calibration split")
        fig.update_layout(height=280, margin=dict(t=40, b=40, l=50, r=20), template="plotly_white",
                          legend=dict(orientation="h", y=-0.35))
        return fig


# --------------------------------------------------------------------------- the handler


def parse_nc_settings(gamma: Any, weight_decay: Any, init: Any, fitter: Any, epochs: Any) -> NCSettings:
    if init not in ("random", "data"):
        raise ValueError(f"Initialisation must be 'random' or 'data'; got {init!r}.")
    if fitter not in FITTERS:
        raise ValueError(f"The fitter must be one of {', '.join(FITTERS)}; got {fitter!r}.")
    return NCSettings(parse_number_or_auto(gamma, "Focal-loss gamma", "γ"),
                      parse_number_or_auto(weight_decay, "Weight decay", "λ"), init, fitter,
                      parse_whole(epochs, "Epochs", 1, 1000))


def parse_split(model: Any, hub_id: Any, dataset: Any, calibration_size: Any, test_size: Any, seed: Any) -> SplitSpec:
    """The split from the shared panel's fields; an empty (or 0) test size means the whole test split."""
    empty = test_size is None or (isinstance(test_size, str) and not test_size.strip()) or test_size == 0
    return SplitSpec(resolve_model_name(model, hub_id), resolve_dataset(dataset),
                     parse_whole(calibration_size, "Calibration size", 10), parse_whole(seed, "Seed", 0, 2**31 - 1),
                     None if empty else parse_whole(test_size, "Test size", 10))


@user_errors
def calibrate(model, hub_id, dataset, calibration_size, test_size, seed, n_bins, methods, gamma, weight_decay, init,
              fitter, epochs, progress=gr.Progress()):
    """Run the chosen methods; streams (status, live panel visibility, live plot, table, diagrams, parameters,
    δ, files, state)."""
    spec = parse_split(model, hub_id, dataset, calibration_size, test_size, seed)
    n_bins = parse_whole(n_bins, "Number of bins", 2, 100)
    nc = parse_nc_settings(gamma, weight_decay, init, fitter, epochs)
    names = _ordered_methods(methods or [])
    worker = Worker(lambda report: run_calibration(spec, names, n_bins, nc, report))
    live = LiveTrace()
    skip = gr.skip()
    status = "Starting…"
    progress(0.0, desc=status)
    for items in worker.stream():
        if not items:
            # Nothing new; yield anyway, since a Stop can only close the handler between two yields.
            yield (skip,) * 9
            continue
        changed = False
        for item in items:
            if item[0] == "progress":
                status = item[2]
                progress(item[1], desc=status)
            elif item[0] == "nc":
                live.add(item[1], item[2])
                changed = True
        shown = gr.update(visible=True) if changed else skip
        plot = live.figure() if changed else skip
        yield (f"**Running** — {status}", shown, plot, skip, skip, skip, skip, skip, skip)
    result, calibration = worker.result
    files = export_files(result, calibration, n_bins)
    table, diagrams, params, delta = show(result, calibration, n_bins)
    done = f"**Done** in {result.seconds:.1f} s ({len(result.methods)} methods, fitter {nc.fitter})."
    shown = gr.update(visible=bool(live.series))
    yield (with_warnings(done, worker), shown, live.figure() if live.series else None, table, diagrams, params, delta,
           files, calibration)


def precomputed_view() -> tuple:
    """The first screen: the shipped result (status, table, diagrams, parameters, δ, files), clearly
    labelled, or a hint when none is shipped."""
    from nctv.ui.state import load_precomputed

    pre = load_precomputed()
    if pre is None:
        hint = "No pre-computed result is shipped with this copy of the app; press **Run calibration**."
        return hint, None, None, hint, None, None
    n_bins = pre.result.bins[0]
    table, diagrams, params, delta = show(pre.result, pre.calibration, n_bins)
    files = export_files(pre.result, pre.calibration, n_bins)
    status = (f"Showing the result **{PRECOMPUTED_LABEL}** (model {pre.calibration.model}, "
              f"{pre.result.calibration['size']} calibration images, fitter {pre.result.fitter}). "
              "Press **Run calibration** for a live run with your settings.")
    return status, table, diagrams, params, delta, files
