"""Paper-style runs: every method fitted on the calibration split, scored on the test split.

A run takes a frozen model, a calibration split and a test split and

* computes the unperturbed logits of each split once and caches them on disk (safetensors, keyed
  by the model's weights and the split's content), so logit-space methods never touch the model;
* fits every method on the calibration split; stochastic methods once per seed, deterministic ones
  once (std 0 in the results; tables show no spread for them);
* scores the calibrated *test* logits with :func:`nctv.metrics.evaluate` and
  :func:`nctv.metrics.further` (KS, debiased ℓ2 error, NLL's calibration and refinement parts) for
  every bin count;
* aggregates mean and sample standard deviation (ddof = 1) over the seeds;
* scores every method on one shared set of resamples of the test split (``nctv.intervals``): an
  interval for every figure and paired intervals of the differences the tables rank by; with them, the
  calibration test of every row (``nctv.consistency``: p-values ``calibration_p``,
  ``classwise_calibration_p``), and where it does not reject, the calibration errors' intervals reach 0;
* compares "Neural Clamping (FL)" with the best baseline per metric by Welch's t-test.

Conventions: metrics are fractions here (tables convert to % etc.); "better" means higher for
accuracy and lower for every error (ECE, AECE, SCE, MCE, NLL, Brier); entropy has no better
direction. Every result records which Neural Clamping
fitter produced its NC rows ("fast" by default, "paper" for the exact paper recipe).

The same engine runs the ablation of Table 4 (:func:`run_ablation`) and the timing comparison of
Table 7 (:func:`run_timing`); :func:`run_gamma_sweep` and :func:`run_init_study` wrap the γ sweep
of Figure 2 and the initialisation study of Figure 3. The shift study (:func:`nctv.shift.run_shift`)
runs on the same skeleton (:func:`_prepared_run`): its methods are fitted as a run fits them.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from nctv import distributed
from nctv import precision as prec
from nctv.cache import model_fingerprint, split_logits
from nctv.checks import check_whole
from nctv.data import as_split, row_keys
from nctv.inference import DEFAULT_BATCH_SIZE, model_device, model_logits, resolve_device
from nctv.conformal import ConformalPredictor, ConformalSettings
from nctv.consistency import consistency_test
from nctv.intervals import (RESAMPLED, IntervalSettings, at_boundary, interval, method_draws,
                            resample_counts_for, seed_counts, tested_p)
from nctv.metrics import FURTHER_NAMES, METRIC_NAMES, evaluate, further
from nctv.results import (
    COMPARED_METHOD,
    REFERENCE_METHOD,
    GammaSweepResult,
    InitStudyResult,
    MethodResult,
    MetricStats,
    RunResult,
    interval_comparisons,
    welch_tests,
)
from nctv.settings import (
    ABLATION_METHODS,
    DEFAULT_BINS,
    DEFAULT_METHODS,
    DEFAULT_SEEDS,
    STUDY_BINS,
    SWEEP_GAMMAS,
    TIMING_RESOLUTIONS,
    NCOptions,
)

#: Ablation rows evaluated from the jointly fitted NC (FL) parameters of the same seed.
NC_VARIANTS = {"NC input only": "input", "NC output only": "output"}
#: Ablation rows fitted on their own: NC (FL)'s fitter and settings with these changes.
NC_REFITS = {"NC δ frozen at 0": (("learn_delta", False),)}

ProgressCallback = Callable[[float, str], None]
#: Called with (row label, info) at every step of a Neural Clamping fit: step, loss, temperature, passes.
FitStepCallback = Callable[[str, dict], None]


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class MethodPlan:
    """One table row: ``label`` shown, registry ``name`` fitted with ``overrides``.

    ``variant`` ("input"/"output") marks an ablation row evaluated from the NC (FL) fit of the same
    seed instead of a fit of its own. ``recorded_as`` renames settings in the row's params (the
    timing table records a grid step as its "resolution").
    """

    label: str
    name: str
    overrides: tuple[tuple[str, Any], ...] = ()
    variant: str | None = None
    recorded_as: tuple[tuple[str, str], ...] = ()


def _registry():
    from nctv import calibration

    return calibration.METHODS


def check_methods(methods: Iterable[str]) -> list[str]:
    """Validate method names against the registry (plus the ablation rows); returns a list."""
    names = list(methods)
    if not names:
        raise ValueError("No methods given; name at least one, e.g. 'Temperature Scaling'.")
    known = list(_registry()) + [n for n in (*NC_VARIANTS, *NC_REFITS) if n not in _registry()]
    lower = {k.lower(): k for k in known}
    out = []
    for n in names:
        canon = lower.get(str(n).strip().lower())
        if canon is None:
            raise ValueError(f"Unknown method {n!r}; choose from: {', '.join(known)}.")
        if canon in out:
            raise ValueError(f"Method {canon!r} is listed twice.")
        out.append(canon)
    return out


def _plans(methods: Sequence[str]) -> list[MethodPlan]:
    return [MethodPlan(n, COMPARED_METHOD, NC_REFITS[n]) if n in NC_REFITS else
            MethodPlan(n, COMPARED_METHOD if n in NC_VARIANTS else n, variant=NC_VARIANTS.get(n)) for n in methods]


def _check_bins_list(bins: Iterable[int]) -> list[int]:
    out = []
    for b in bins:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
            raise ValueError(f"Bin counts must be positive whole numbers; got {b!r}.")
        if int(b) not in out:
            out.append(int(b))
    if not out:
        raise ValueError("No bin counts given; use e.g. 10 15 20.")
    return out


def _check_seeds(seeds: int | Sequence[int]) -> list[int]:
    if isinstance(seeds, (int, np.integer)) and not isinstance(seeds, bool):
        if seeds < 1:
            raise ValueError(f"seeds must be at least 1; got {seeds}.")
        return list(range(int(seeds)))
    out = [int(s) for s in seeds]
    if not out:
        raise ValueError("No seeds given; use a count such as 5.")
    if len(set(out)) != len(out):
        raise ValueError(f"Seeds must differ; got {out}.")
    return out


@dataclass(frozen=True)
class RunOptions:
    """A run's settings, checked once when made (before any model pass), then handed whole to the engine.

    ``seeds``: a count (seeds 0..n−1) or explicit seeds; deterministic methods run once. ``bins``:
    the bin counts every table reports. ``nc``: the Neural Clamping options of every Neural
    Clamping row (``NCOptions``; NC (CE) keeps γ = 0; TS (FL) takes a numeric γ). ``input_range`` =
    (α, β), the preprocessed images of pixel values 0 and 1 (NC (Eff.) and init="data" need it; a
    zoo model brings its own). ``cache_dir=False`` turns the logit cache off. ``progress``: tqdm
    bars. ``callback(fraction, message)`` is called as the run advances (it may raise to cancel
    it); ``on_fit_step(label, info)`` at every step of a Neural Clamping fit. ``precision``: "auto",
    "fp32", "bf16" or "fp16" (``nctv.precision``). ``intervals``: how every figure's interval and
    the paired comparisons are computed (``nctv.intervals``); None: none. ``dataset``: the name the
    caller drew the splits by, recorded in the result's settings (None: the model's own).
    ``conformal``: the prediction sets every method's row is scored with (``nctv.conformal``; LAC at 90 %
    by default), conformalised on the calibration split; None: none.

    ``RunOptions.make(**keywords)`` takes these names and ``NCOptions``' names (gamma, fitter,
    epochs, weight_decay, …) beside them, for callers that pass keywords.
    """

    seeds: tuple[int, ...] | int = DEFAULT_SEEDS
    bins: tuple[int, ...] = DEFAULT_BINS
    nc: NCOptions = NCOptions()
    device: Any = None
    batch_size: int = DEFAULT_BATCH_SIZE
    cache_dir: Any = None
    input_range: Any = None
    progress: bool = True
    callback: ProgressCallback | None = None
    on_fit_step: FitStepCallback | None = None
    precision: str = "auto"
    intervals: IntervalSettings | None = IntervalSettings()
    dataset: str | None = None
    conformal: ConformalSettings | None = ConformalSettings()

    def __post_init__(self) -> None:
        # Seeds and bins are kept as the lists they stand for, so that every reader sees one form.
        object.__setattr__(self, "seeds", tuple(_check_seeds(self.seeds)))
        object.__setattr__(self, "bins", tuple(_check_bins_list(self.bins)))
        if not isinstance(self.nc, NCOptions):
            raise ValueError(f"nc must be Neural Clamping's options (nctv.settings.NCOptions); got {type(self.nc).__name__}.")
        check_whole(self.batch_size, "batch_size")
        prec.check_precision(self.precision)
        if self.conformal is not None and not isinstance(self.conformal, ConformalSettings):
            raise ValueError("conformal must be nctv.conformal.ConformalSettings or None; got "
                             f"{type(self.conformal).__name__}.")

    @classmethod
    def make(cls, options: "RunOptions | None" = None, **keywords: Any) -> "RunOptions":
        """``options`` (default: every default) with ``keywords`` changed: a run's settings by their
        names, Neural Clamping's by ``NCOptions``' names."""
        base = cls() if options is None else options
        nc = {k: keywords.pop(k) for k in list(keywords) if k in NCOptions.names()}
        unknown = [k for k in keywords if k not in {f.name for f in fields(cls)}]
        if unknown:
            raise TypeError(f"Unknown run setting(s) {', '.join(map(repr, unknown))}; use those of RunOptions "
                            f"or of NCOptions ({', '.join(NCOptions.names())}).")
        if nc:
            keywords["nc"] = keywords.get("nc", base.nc).changed(**nc)
        return replace(base, **keywords) if keywords else base


# --------------------------------------------------------------------------- engine


class _Progress:
    """tqdm bar plus the optional ``callback(fraction, message)`` of the app."""

    def __init__(self, total: int, desc: str, enabled: bool, callback: ProgressCallback | None):
        self.total = max(total, 1)
        self.done = 0
        self.callback = callback
        self.bar = tqdm(total=total, desc=desc, disable=not enabled, unit="fit", leave=False)

    def message(self, msg: str) -> None:
        self.bar.set_postfix_str(msg, refresh=True)
        if self.callback is not None:
            self.callback(self.done / self.total, msg)

    def within(self, fraction: float, msg: str) -> None:
        """Progress inside the current unit of work (``fraction`` of it done)."""
        self.bar.set_postfix_str(msg, refresh=True)
        if self.callback is not None:
            self.callback(min((self.done + min(max(fraction, 0.0), 1.0)) / self.total, 1.0), msg)

    def step(self, msg: str) -> None:
        self.done += 1
        self.bar.update(1)
        if self.callback is not None:
            self.callback(min(self.done / self.total, 1.0), msg)

    def close(self) -> None:
        self.bar.close()


def _unwrap_model(model: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(module, info) for an ``nn.Module`` or a zoo ``LoadedModel``."""
    module = getattr(model, "model", model)
    if not isinstance(module, torch.nn.Module):
        raise ValueError("model must be a torch.nn.Module or a model loaded with nctv.zoo.load_model.")
    name = getattr(model, "name", None) or type(module).__name__
    info = {"name": name, "class": type(module).__name__, "n_parameters": int(sum(p.numel() for p in module.parameters()))}
    if getattr(model, "source", None):
        info["source"] = str(model.source)
    return module, info


def _prepare_model_run(model: Any, device: Any) -> tuple[torch.nn.Module, dict[str, Any], torch.device]:
    """(module, info, device) for a run: the unwrapped model moved to ``device`` (default: where it
    already is), with its :func:`model_fingerprint` in ``info["fingerprint"]``."""
    module, info = _unwrap_model(model)
    dev = resolve_device(device) if device is not None else model_device(module)
    module.to(dev)
    info["fingerprint"] = model_fingerprint(module)
    return module, info, dev


@contextmanager
def _run_precision(setting: str, module: torch.nn.Module, split: Any, dev: torch.device) -> Iterator[prec.Choice]:
    """Run the block in the run's precision (``nctv.precision``), yielding the choice: measured by
    the first process when "auto" asks for it, on a piece of ``split``, and the same on every process."""
    prec.check_precision(setting)

    def sample() -> torch.Tensor:
        x, _ = next(iter(split.loader(batch_size=prec.MEASURE_IMAGES)))
        return torch.as_tensor(x).to(dev, torch.float32)

    choice = distributed.from_main(prec.choose(setting, module, dev, sample) if distributed.is_main() else None)
    with prec.running(module, choice.precision):
        yield choice


def _input_range(model: Any, input_range: Any) -> Any:
    """The feasible input range (α, β): given, else the zoo model's own, else None."""
    return input_range if input_range is not None else getattr(model, "input_range", None)


def _split_info(split: Any) -> dict[str, Any]:
    return {"name": str(getattr(split, "name", "split")), "size": int(len(split.labels)),
            "fingerprint": str(split.fingerprint)}


@dataclass
class _Context:
    model: torch.nn.Module
    cal: Any
    test: Any
    cal_z: torch.Tensor
    cal_y: torch.Tensor
    test_z: torch.Tensor
    test_y: torch.Tensor
    options: RunOptions
    device: torch.device
    input_range: Any
    progress: _Progress
    nc_fits: dict = field(default_factory=dict)
    # The resamples every method is scored on (one count matrix: paired comparisons), the generator
    # that redraws each stochastic method's seeds, and every method's draws per bin count and metric.
    counts: torch.Tensor | None = None
    rows_key: tuple | None = None  # what the resamples and calibration tests are keyed by (resample_key)
    seed_generator: torch.Generator | None = None
    draws: dict = field(default_factory=dict)


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))


def _make(ctx: _Context, plan: MethodPlan, seed: int):
    spec = _registry()[plan.name]
    kw: dict[str, Any] = dict(plan.overrides)
    nc = ctx.options.nc
    # The run's settings the registry says the method takes. The run's own progress reports every
    # method, so a method's own bar stays off.
    if "progress" in spec.run_options:
        kw.setdefault("progress", False)
    gamma = nc.setting("gamma")
    if not spec.needs_model:
        if "gamma" in spec.run_options and gamma != "auto":  # "auto" is Neural Clamping's own choice of γ
            kw.setdefault("gamma", gamma)
        if "callback" in spec.run_options:  # the affine fits report their folds
            kw.setdefault("callback", _fit_callback(ctx, plan.label))
        return spec.factory(**kw)
    kw.setdefault("device", ctx.device)
    if ctx.input_range is not None:
        kw.setdefault("input_range", ctx.input_range)
    if not spec.stochastic:
        kw.setdefault("batch_size", ctx.options.batch_size)
        return spec.factory(ctx.model, **kw)
    # Trained input calibrators (Neural Clamping), seeded. Built from the class, not the registry's
    # factory: the options replace its defaults whole.
    kw = {k: v for k, v in kw.items() if k not in NCOptions.names()}
    return _class(spec)(ctx.model, _method_options(plan, ctx.options), seed=seed,
                        callback=_nc_callback(ctx, plan.label, seed), **kw)


def _method_options(plan: MethodPlan, options: RunOptions) -> NCOptions:
    """A trained input calibrator's options in this run: the run's, with the registry's defaults of its
    row (NC (CE) keeps its γ = 0) and the plan's overrides; the fast fitter's chunk is the run's batch."""
    nc = options.nc
    own = {} if plan.name == COMPARED_METHOD else dict(_registry()[plan.name].defaults)
    if nc.fitter == "fast" and nc.batch_size is None:
        own["batch_size"] = options.batch_size  # only the chunk size; a recipe keeps its own batch
    return nc.changed(**{**own, **{k: v for k, v in plan.overrides if k in NCOptions.names()}})


def _seeded(plan: MethodPlan, options: RunOptions) -> bool:
    """Whether ``plan``'s fit depends on its seed, so that the run fits it once per seed: a stochastic
    method whose options draw something random (the default Neural Clamping, from δ₀ = 0, does not)."""
    return bool(_registry()[plan.name].stochastic) and _method_options(plan, options).seeded


def _class(spec: Any) -> Any:
    from nctv.calibration.registry import calibration_class

    return calibration_class(spec.cls)


def _nc_callback(ctx: _Context, label: str, seed: int):
    """Progress inside a fit (passes so far over the fit's ``expected_passes``) and the live step."""
    def report(info: dict) -> None:
        loss, temp = info.get("loss"), info.get("temperature")
        tail = f", loss {loss:.4f}" if isinstance(loss, (int, float)) else ""
        tail += f", T {temp:.4f}" if isinstance(temp, (int, float)) else ""
        passes = float(info["passes"])
        msg = f"{label} (seed {seed}): pass {passes:.1f}{tail}"
        # The last step of a "selected" fit comes after the fit's steps and carries no plan: it is done.
        ctx.progress.within(passes / float(info.get("expected_passes", passes)), msg)
        if ctx.options.on_fit_step is not None:
            ctx.options.on_fit_step(label, {k: v for k, v in info.items() if k != "expected_passes"})

    return report


def _fit_callback(ctx: _Context, label: str):
    """Progress inside a logit-space fit from its progress dicts (``nctv.calibration.linear``):
    the fold and grid point of a cross-validation, or the iteration of a single fit, with the time
    the fit expects to need still."""
    def report(info: dict) -> None:
        stage = info["stage"]
        if "fold" in info:
            where = (f"{stage}, fold {info['fold']} of {info['folds']}, "
                     f"candidate {info['candidate']} of {info['candidates']}")
        elif stage == "done":
            where = "done"
        else:
            where = f"{stage}, iteration {info['iteration']} (at most {info['max_iter']})"
        left = info["seconds_left"]
        tail = f", about {max(1, round(left))} s left" if left is not None and stage != "done" else ""
        ctx.progress.within(info["fraction"], f"{label}: {where}{tail}")

    return report


def _learned_params(method: Any) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for attr in ("temperature_", "gamma_", "weight_decay_", "n_passes_"):
        v = getattr(method, attr, None)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (int, float, np.generic)):
            params[attr.rstrip("_")] = float(v) if not isinstance(v, (int, np.integer)) else int(v)
    delta = getattr(method, "delta_", None)
    if isinstance(delta, torch.Tensor):
        d = delta.detach().float().cpu()
        params["delta_l2"] = float(d.norm())
        params["delta_linf"] = float(d.abs().max())
        params["delta_shape"] = list(d.shape)
    return params


def _fit_predict(ctx: _Context, plan: MethodPlan, seed: int) -> tuple[torch.Tensor, float, dict, torch.Tensor | None,
                                                                      Any]:
    """Calibrated test logits, fit seconds, learned params, δ (or None) and the fitted calibrator
    (None for an ablation row, which is not a method of its own) of one method and seed."""
    if plan.variant is not None:
        nc, seconds = _nc_fit(ctx, plan, seed)
        if plan.variant == "input":
            z = nc.predict_logits(ctx.test.loader(batch_size=ctx.options.batch_size), use_delta=True, use_temperature=False)
        else:
            # f(x)/T*: the cached unperturbed logits are exactly f(x).
            z = ctx.test_z / float(nc.temperature_)
        params = _learned_params(nc)
        params["shares_fit_with"] = plan.name
        if plan.variant == "output":
            params.pop("delta_l2", None), params.pop("delta_linf", None), params.pop("delta_shape", None)
            return z, seconds, params, None, None
        params["temperature"] = 1.0
        return z, seconds, params, nc.delta_.detach().float().cpu(), None
    m, seconds = _fit_method(ctx, plan, seed)
    z = _calibrated(ctx, plan, m, ctx.test, ctx.test_z)
    delta = getattr(m, "delta_", None) if _registry()[plan.name].needs_model else None
    return z, seconds, _learned_params(m), (None if delta is None else delta.detach().float().cpu()), m


def _fit_method(ctx: _Context, plan: MethodPlan, seed: int) -> tuple[Any, float]:
    """One method of the run fitted on the calibration split for ``seed``, and its fit seconds."""
    if _registry()[plan.name].needs_model:
        return _nc_fit(ctx, plan, seed)
    _seed_everything(seed)
    m = _make(ctx, plan, seed)
    t0 = time.perf_counter()
    m.fit(ctx.cal_z, ctx.cal_y)
    return m, time.perf_counter() - t0


def _calibrated(ctx: _Context, plan: MethodPlan, fitted: Any, split: Any, logits: torch.Tensor) -> torch.Tensor:
    """Calibrated logits of ``split`` (whose unperturbed logits are ``logits``) by a fitted method: a
    model-based one passes the split's inputs through the model again, a logit-space one maps ``logits``."""
    if _registry()[plan.name].needs_model:
        return fitted.predict_logits(split.loader(batch_size=ctx.options.batch_size))
    return fitted.transform(logits)


def _nc_fit(ctx: _Context, plan: MethodPlan, seed: int):
    """Fit (or reuse within this run) a model-based method for ``seed``; ablation rows share it."""
    key = (plan.name, plan.overrides, seed)
    if key not in ctx.nc_fits:
        _seed_everything(seed)
        m = _make(ctx, plan, seed)
        t0 = time.perf_counter()
        m.fit(ctx.cal.loader(batch_size=ctx.options.batch_size))
        ctx.nc_fits[key] = (m, time.perf_counter() - t0)
    return ctx.nc_fits[key]


def _run_method(ctx: _Context, plan: MethodPlan, seeds: list[int], bins: list[int]) -> MethodResult:
    """One table row: fit and score ``plan`` for every seed; keep the first seed's logits and δ."""
    per_bin: dict[int, dict[str, list[float]]] = {b: {k: [] for k in METRIC_NAMES + FURTHER_NAMES} for b in bins}
    seconds, first, per_seed = [], None, []
    for s in seeds:
        ctx.progress.message(f"{plan.label} (seed {s})")
        z, sec, params, delta, fitted = _fit_predict(ctx, plan, s)
        z = z.detach().float().cpu()
        seconds.append(sec)
        for b in bins:
            for k, v in {**evaluate(z, ctx.test_y, n_bins=b), **further(z, ctx.test_y, n_bins=b)}.items():
                per_bin[b][k].append(v)
        if first is None:
            conformal = _conformal(ctx, plan, fitted, z)
            recorded = dict(params, **dict(plan.overrides))
            for name, shown_as in plan.recorded_as:
                recorded[shown_as] = recorded.pop(name)
            first = (z, recorded, delta, fitted)
        if ctx.options.intervals is not None:
            per_seed.append(z)
        ctx.progress.step(f"{plan.label} (seed {s}) done")
    spec = _registry()[plan.name]
    stats = {b: {k: MetricStats.from_runs(v) for k, v in per.items()} for b, per in per_bin.items()}
    seeded = _seeded(plan, ctx.options)
    if ctx.options.intervals is not None:
        _add_intervals(ctx, plan.label, per_seed, stats)
    return MethodResult(
        name=plan.label, stochastic=seeded, uses_model=bool(spec.needs_model), seeds=list(seeds), metrics=stats,
        fit_seconds=seconds, params=first[1], test_logits=first[0], delta=first[2], calibrator=first[3],
        conformal=conformal,
    )


def _conformal(ctx: _Context, plan: MethodPlan, fitted: Any, test_logits: torch.Tensor) -> dict[str, Any] | None:
    """The first seed's prediction sets (``options.conformal``), conformalised on the calibration split's
    logits as this method calibrates them (a model-based method passes the split through the model once
    more) and scored on the test split with the run's intervals; None for an ablation row (no method of
    its own) or with sets turned off. The calibrator was fitted on those same calibration pictures; the
    result says so (docs/conformal.md: the guarantee wants the two kept apart). RAPS records the λ and
    k_reg its sets used, which of them were tuned and on how many of the calibration pictures (held out
    of q̂: ``n_tune``; q̂ from the other ``n_conformal``)."""
    settings = ctx.options.conformal
    if settings is None or fitted is None:
        return None
    cal_logits = _calibrated(ctx, plan, fitted, ctx.cal, ctx.cal_z).detach().float().cpu()
    predictor = ConformalPredictor(settings).fit(cal_logits, ctx.cal_y)
    # The worst class counts classes of at least 10 test pictures; a test split too small for any counts all.
    fewest = 10 if int(torch.bincount(ctx.test_y).max()) >= 10 else 1
    how = ctx.options.intervals
    ev = predictor.evaluate(test_logits, ctx.test_y, intervals=how, min_class_points=fewest,
                            counts=None if how is None else _resamples(ctx))
    used = predictor.to_dict()
    triple = lambda i: [i.estimate, i.low, i.high]  # noqa: E731
    return {"score": settings.score, "coverage_target": float(settings.coverage), "randomized": settings.randomized,
            "threshold": float(predictor.threshold_), "coverage": triple(ev.coverage), "mean_size": triple(ev.mean_size),
            "worst_class_coverage": triple(ev.worst_class_coverage), "worst_class": ev.worst_class,
            "empty": ev.empty, "min_class_points": fewest,
            "calibrator_fitted_on_the_same_pictures": plan.name != REFERENCE_METHOD,
            **{key: used[key] for key in ("penalty", "k_reg", "tuned", "n_tune", "n_conformal")}}


def resample_key(split: Any, logits: torch.Tensor, labels: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """What a run's resamples of ``split`` are keyed by (``nctv.intervals.resample_counts_for``): each
    picture's content and its label (``nctv.data.row_keys``), the same on every machine; for a split
    that cannot tell its pictures' content, the unperturbed model's ``logits`` and the labels."""
    keys = row_keys(split)
    return (logits if keys is None else keys), labels


def _rows_key(ctx: _Context) -> tuple[Any, torch.Tensor]:
    """The run's ``resample_key`` of its test split (computed once)."""
    if ctx.rows_key is None:
        ctx.rows_key = resample_key(ctx.test, ctx.test_z, ctx.test_y)
    return ctx.rows_key


def _resamples(ctx: _Context) -> torch.Tensor:
    """The run's resamples of the test split (made on first use, with the generator that redraws seeds),
    keyed by the test pictures' content and labels (``resample_key``), which every method shares: the same
    resamples for the test rows in any order and on any machine (``nctv.intervals.resample_counts_for``),
    and every method's paired."""
    if ctx.counts is None:
        settings = ctx.options.intervals
        ctx.counts = resample_counts_for(_rows_key(ctx), settings.resamples, settings.seed)
        ctx.seed_generator = torch.Generator().manual_seed(settings.seed + 1)
    return ctx.counts


def _add_intervals(ctx: _Context, label: str, per_seed: list[torch.Tensor], stats: dict) -> None:
    """Score one method's logits (every seed) on the run's resamples: its intervals go into ``stats``,
    its draws into ``ctx.draws`` for the comparisons. The logits of later seeds are then dropped."""
    settings = ctx.options.intervals
    counts = _resamples(ctx)
    seeds = seed_counts(len(per_seed), settings.resamples, ctx.seed_generator) if len(per_seed) > 1 else None
    metrics = [k for k in METRIC_NAMES + FURTHER_NAMES if k in RESAMPLED]
    ctx.draws[label] = {}
    for b, per in stats.items():
        ctx.draws[label][b] = method_draws(per_seed, ctx.test_y, counts, b, metrics, seeds)
        # Is the row calibrated? Where the data cannot say no, its errors' intervals reach 0.
        test = consistency_test(per_seed, ctx.test_y, b, settings.resamples, settings.seed,
                                key=_rows_key(ctx)[0])
        per["calibration_p"] = MetricStats.from_runs([test.p_top_label])
        per["classwise_calibration_p"] = MetricStats.from_runs([test.p_classwise])
        for k, d in ctx.draws[label][b].items():
            ci = interval(d, k, settings.level)
            ci = at_boundary(ci, tested_p(k, test.p_top_label, test.p_classwise), settings.level)
            per[k].ci_low, per[k].ci_high = ci.low, ci.high


def _input_scale(model: Any, split: Any) -> dict[str, list[float]]:
    """The normalisation (mean, std) of the model's inputs, which the δ image undoes: the split's
    preprocessing, else the zoo model's; empty for a split of ready-made tensors."""
    for config in (getattr(split, "data_config", None), getattr(model, "data_config", None)):
        if config and "mean" in config and "std" in config:
            return {"mean": [float(v) for v in config["mean"]], "std": [float(v) for v in config["std"]]}
    return {}


def _split_pair_logits(module: torch.nn.Module, calibration: Any, test: Any, options: RunOptions, dev: torch.device,
                       fingerprint: str, bar: _Progress):
    """The unperturbed logits of both splits (cached), one progress step each."""
    bar.message("logits of the calibration split")
    cal = split_logits(module, calibration, options.cache_dir, options.batch_size, dev, fingerprint)
    bar.step("calibration logits " + ("from cache" if cal.hit else "computed"))
    tst = split_logits(module, test, options.cache_dir, options.batch_size, dev, fingerprint)
    bar.step("test logits " + ("from cache" if tst.hit else "computed"))
    if tst.logits.shape[1] != cal.logits.shape[1]:
        raise ValueError("The calibration and test splits give different numbers of classes.")
    return cal, tst


@dataclass
class _Run:
    """A run prepared by :func:`_prepared_run`: the context its methods are fitted in, the seeds each row is
    fitted for, and what its result records (the model, the cache hits of both splits' logits, the precision)."""

    ctx: _Context
    model_info: dict[str, Any]
    seeds: dict[str, list[int]]
    cache_hits: dict[str, bool]
    precision: prec.Choice


@contextmanager
def _prepared_run(kind: str, model: Any, calibration: Any, test: Any, plans: Sequence[MethodPlan],
                  options: RunOptions, n_bins: int, later_steps: int = 0) -> Iterator[_Run]:
    """The skeleton of every run (a paper-style table, a shift study: ``nctv.shift.run_shift``): the most
    bins it reports (``n_bins``) checked against the test split, the model on the run's device, each row's
    seeds (one where its fit draws nothing random), a progress bar of the two logit passes, every fit
    and ``later_steps`` more, the run's precision, the unperturbed logits of both splits (cached), and
    the context every method is fitted in. ``calibration`` and ``test`` are splits (``as_split``)."""
    n_test = len(test.labels)
    if n_bins > n_test:
        raise ValueError(f"{n_bins} bins are more than the {n_test} test samples; use fewer bins.")
    module, model_info, dev = _prepare_model_run(model, options.device)
    seed_list = list(options.seeds)
    seeds = {p.label: seed_list if _seeded(p, options) else seed_list[:1] for p in plans}
    bar = _Progress(2 + sum(map(len, seeds.values())) + later_steps, kind, options.progress, options.callback)
    with _run_precision(options.precision, module, calibration, dev) as chosen:
        try:
            cal, tst = _split_pair_logits(module, calibration, test, options, dev, model_info["fingerprint"], bar)
            ctx = _Context(module, calibration, test, cal.logits, cal.labels, tst.logits, tst.labels, options, dev,
                           _input_range(model, options.input_range), bar)
            yield _Run(ctx, model_info, seeds, {"calibration": cal.hit, "test": tst.hit}, chosen)
        finally:
            bar.close()


def _run_settings(options: RunOptions, run: _Run, model: Any, intervals: IntervalSettings | None) -> dict[str, Any]:
    """What every run's result records of how it ran: the batch size, device and precision, Neural
    Clamping's options (as read), the intervals, the dataset asked for, and the input normalisation
    (mean, std) that the δ image undoes."""
    return {"batch_size": options.batch_size, "device": str(run.ctx.device), "precision": run.precision.to_dict(),
            "nc": options.nc.to_dict(), **({"intervals": intervals.to_dict()} if intervals is not None else {}),
            **({"dataset": options.dataset} if options.dataset is not None else {}),
            **_input_scale(model, run.ctx.cal)}


def _run_plans(kind: str, model: Any, calibration: Any, test: Any, plans: Sequence[MethodPlan], options: RunOptions,
               recorded: dict[str, Any]) -> RunResult:
    """The engine: ``plans`` fitted on ``calibration`` and scored on ``test`` with ``options``;
    ``recorded``: what the caller adds to the result's settings (the methods, the resolutions)."""
    t_start = time.perf_counter()
    calibration, test = as_split(calibration, "calibration"), as_split(test, "test")
    bins = list(options.bins)
    with _prepared_run(kind, model, calibration, test, plans, options, max(bins)) as run:
        ctx = run.ctx
        results = {p.label: _run_method(ctx, p, run.seeds[p.label], bins) for p in plans}
    info = getattr(model, "class_names", None)
    nc, intervals = options.nc, options.intervals
    return RunResult(
        kind=kind,
        model=run.model_info,
        calibration=_split_info(calibration),
        test=_split_info(test),
        n_classes=int(ctx.cal_z.shape[1]),
        class_names=list(info) if info is not None else None,
        bins=bins,
        seeds=list(options.seeds),
        fitter=nc.fitter,
        methods=results,
        welch=welch_tests(results, bins),
        comparisons=[] if intervals is None else interval_comparisons(results, ctx.draws, bins, intervals.level),
        cache_hits=run.cache_hits,
        settings={"gamma": nc.setting("gamma"), "epochs": nc.epochs, **_run_settings(options, run, model, intervals),
                  **recorded},
        seconds=time.perf_counter() - t_start,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        test_labels=ctx.test_y,
    )


def run_experiment(model: Any, calibration: Any, test: Any, methods: Sequence[str] = DEFAULT_METHODS,
                   options: RunOptions | None = None, **keywords: Any) -> RunResult:
    """The comparison of Tables 1–3: fit ``methods`` on ``calibration``, score on ``test``.

    ``model``: a zoo ``LoadedModel`` or any frozen ``nn.Module`` mapping preprocessed inputs to
    logits. ``calibration``/``test``: splits (``.labels``, ``.fingerprint``, ``.loader(batch_size)``
    yielding ``(x, y)`` in a fixed order), e.g. from :func:`nctv.data.get_splits`, or
    ``(inputs, labels)`` pairs of preprocessed tensors. ``options``: the run's settings
    (:class:`RunOptions`: seeds, bins, Neural Clamping's options, device, cache, callbacks,
    precision, intervals); ``keywords`` build the same object (``RunOptions.make``: ``seeds=2,
    gamma=0.5, fitter="paper"``). The result's settings record them, and the input normalisation
    (mean, std) that the δ image undoes.
    """
    names = check_methods(methods)
    return _run_plans("run", model, calibration, test, _plans(names), RunOptions.make(options, **keywords),
                      {"methods": names})


def run_ablation(model: Any, calibration: Any, test: Any, options: RunOptions | None = None,
                 **keywords: Any) -> RunResult:
    """Table 4: NC (FL) against its parts. "NC input only" is f(x + δ*) and "NC output only"
    f(x)/T*, both from the δ*, T* that NC (FL) learned jointly for the same seed (no separate fit);
    "Temperature Scaling (FL)" fits T alone with NC's focal loss γ. ``options``, ``keywords``: as
    in :func:`run_experiment`."""
    names = check_methods(ABLATION_METHODS)
    return _run_plans("ablation", model, calibration, test, _plans(names), RunOptions.make(options, **keywords),
                      {"methods": names})


def run_timing(model: Any, calibration: Any, test: Any, resolutions: Sequence[float] = TIMING_RESOLUTIONS,
               options: RunOptions | None = None, **keywords: Any) -> RunResult:
    """Table 7: TS by grid search and NC (Eff.) at each grid ``resolution``, and NC (FL), one run each.

    Rows are labelled "TS-Grid (0.01)", "NC (Eff.) (0.01)", …; ``params["resolution"]`` holds the
    step. ``fit_seconds`` is the time to fit given the cached unperturbed logits (NC (Eff.)'s
    gradient pass and perturbed forward pass are included). ``options``, ``keywords``: as in
    :func:`run_experiment` (one seed: the first of ``options.seeds``; bins default to 15).
    """
    steps = []
    for r in resolutions:
        try:
            step = float(r)
        except (TypeError, ValueError):
            raise ValueError(f"Grid resolutions must be numbers such as 0.01; got {r!r}.") from None
        if not 0 < step < 5:
            raise ValueError(f"Grid resolution {r!r} must lie between 0 and 5 (the grid spans T in (0, 5]).")
        steps.append(step)
    base = RunOptions(bins=(STUDY_BINS,)) if options is None else options
    options = RunOptions.make(base, **keywords)
    options = replace(options, seeds=options.seeds[:1])
    grid = (("grid_step", "resolution"),)
    plans = [MethodPlan("Uncalibrated", "Uncalibrated")]
    plans += [MethodPlan(f"TS-Grid ({r:g})", "TS by Grid Search", (("grid_step", r),), recorded_as=grid) for r in steps]
    plans += [MethodPlan(f"NC (Eff.) ({r:g})", "NC (Eff.)", (("grid_step", r),), recorded_as=grid) for r in steps]
    plans.append(MethodPlan(COMPARED_METHOD, COMPARED_METHOD))
    return _run_plans("timing", model, calibration, test, plans, options, {"resolutions": steps})


# --------------------------------------------------------------------------- γ sweep and init study


def _passes_callback(total: float, what: str, bar: Any, callback: ProgressCallback | None):
    """Turn Neural Clamping's per-step ``info`` into a fraction of about ``total`` passes.

    A sweep or study fits on one calibration split whose pass count both fitters only add to, so
    ``info["passes"]`` is already the running total of the whole sweep or study.
    """

    shown = [0.0]

    def report(info: dict) -> None:
        now = float(info["passes"])
        # A study's own re-estimate, or the fit's re-planned total (a sweep's later γ values), when made.
        planned = float(info.get("planned_passes", info.get("expected_passes", total)))
        bar.n = round(min(now, total), 2)
        bar.refresh()
        if callback is not None:
            loss = info.get("loss")
            tail = f", loss {loss:.4f}" if isinstance(loss, (int, float)) else ""
            # A plan that grows (a fit longer than the mean of those before) holds the bar; it never goes back.
            shown[0] = max(shown[0], min(now / planned, 0.99))
            callback(shown[0], f"{what}: about {now:.0f} of {planned:.0f} passes{tail}")

    return report


@contextmanager
def _passes_bar(
    total: float, desc: str, what: str, progress: bool, callback: ProgressCallback | None
) -> Iterator[Callable[[dict], None]]:
    """A tqdm bar of about ``total`` passes, closed on leaving; yields :func:`_passes_callback`'s
    ``report`` for Neural Clamping's per-step ``info``."""
    bar = tqdm(total=total, desc=desc, unit="pass", disable=not progress, leave=False)
    try:
        yield _passes_callback(total, what, bar, callback)
    finally:
        bar.close()


def _study_settings(options: RunOptions, nc: NCOptions, sets: str, dev: torch.device, chosen: prec.Choice,
                    **own: Any) -> dict[str, Any]:
    """What a study's result records of its settings: its own, the run's, and the Neural Clamping
    options its fits were built with, but the one the study ``sets`` itself (γ, or the initialisation)."""
    return {**own, "batch_size": options.batch_size, "device": str(dev), "precision": chosen.to_dict(),
            "nc": {k: v for k, v in nc.to_dict().items() if k != sets},
            **({"dataset": options.dataset} if options.dataset is not None else {})}


def run_gamma_sweep(model: Any, calibration: Any, test: Any | None = None, gammas: Sequence[float] = SWEEP_GAMMAS,
                    n_bins: int = STUDY_BINS, seed: int = 0, options: RunOptions | None = None,
                    **keywords: Any) -> GammaSweepResult:
    """Figure 2: Neural Clamping fitted for every γ (default 0, 0.05, …, 1), with ECE, entropy and
    training loss on the calibration and test splits (``studies.gamma_sweep``), from ``seed``. Each γ's
    row is this run's Neural Clamping (FL) row at that γ: its options are built as a run builds them.
    ``options``, ``keywords``: as in :func:`run_experiment` (Neural Clamping's options but γ, the
    device, batch size, progress, callback, precision; a zoo model's ``input_range`` is passed when
    init="data" or clamp asks for it)."""
    from nctv.calibration import studies

    t0 = time.perf_counter()
    options = RunOptions.make(options, **keywords)
    calibration = as_split(calibration, "calibration")
    test = None if test is None else as_split(test, "test")
    module, info, dev = _prepare_model_run(model, options.device)
    gammas = list(gammas)
    nc = _method_options(MethodPlan(COMPARED_METHOD, COMPARED_METHOD), options)
    wiring: dict[str, Any] = {"seed": seed, "device": dev, "progress": False}
    if nc.init == "data" or nc.clamp:
        wiring["input_range"] = _input_range(model, options.input_range)
    total = studies.gamma_sweep_passes(module, len(gammas), nc)
    with _passes_bar(total, "gamma sweep", "γ sweep", options.progress, options.callback) as report, \
            _run_precision(options.precision, module, calibration, dev) as chosen:
        sweep = studies.gamma_sweep(
            module, calibration.loader(batch_size=options.batch_size), None,
            None if test is None else test.loader(batch_size=options.batch_size), None,
            gammas=gammas, n_bins=n_bins, options=nc, callback=report,
            test_key=None if test is None else row_keys(test), **wiring)
    if options.callback is not None:
        options.callback(1.0, f"γ sweep done; chosen γ = {sweep.chosen_gamma:g}")
    return GammaSweepResult(
        sweep, info, _split_info(calibration), _split_info(test) if test is not None else {},
        _study_settings(options, nc, "gamma", dev, chosen, seed=seed),
        time.perf_counter() - t0, datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def run_init_study(model: Any, calibration: Any, test: Any, runs: int = DEFAULT_SEEDS, n_bins: int = STUDY_BINS,
                   seed: int = 0, options: RunOptions | None = None, **keywords: Any) -> InitStudyResult:
    """Figure 3: Neural Clamping from random and from data-driven δ₀ (Theorem 1), ``runs`` runs each
    (seeds ``seed``…), scored on the test split (``studies.init_study``). Needs the input range
    (``options.input_range``; a zoo model brings its own). ``options``, ``keywords``: as in
    :func:`run_experiment` (Neural Clamping's options but init)."""
    from nctv.calibration import studies

    t0 = time.perf_counter()
    options = RunOptions.make(options, **keywords)
    calibration, test = as_split(calibration, "calibration"), as_split(test, "test")
    check_whole(runs, "runs")
    module, info, dev = _prepare_model_run(model, options.device)
    rng = _input_range(model, options.input_range)
    if rng is None:
        raise ValueError("The initialisation study needs input_range=(alpha, beta), the preprocessed images of "
                         "pixel values 0 and 1 (a model from nctv.zoo brings its own).")
    nc = _method_options(MethodPlan(COMPARED_METHOD, COMPARED_METHOD), options)
    total = studies.init_study_passes(module, runs, nc)
    with _passes_bar(total, "init study", "initialisation study", options.progress, options.callback) as report, \
            _run_precision(options.precision, module, calibration, dev) as chosen:
        study = studies.init_study(
            module, calibration.loader(batch_size=options.batch_size), test.loader(batch_size=options.batch_size),
            n_runs=runs, seed=seed, n_bins=n_bins, options=nc, input_range=rng, device=dev, progress=False,
            callback=report, test_key=row_keys(test))
    if options.callback is not None:
        options.callback(1.0, "initialisation study done")
    n_classes = _n_classes(model, module, test, options.batch_size)
    return InitStudyResult(
        study, info, _split_info(calibration), _split_info(test),
        _study_settings(options, nc, "init", dev, chosen, runs=runs, seed=seed),
        time.perf_counter() - t0, datetime.now(timezone.utc).isoformat(timespec="seconds"), n_classes=n_classes,
    )


def _n_classes(model: Any, module: torch.nn.Module, split: Any, batch_size: int) -> int:
    """K: the zoo model's or the split's class names, else the width of one batch of logits."""
    for names in (getattr(model, "class_names", None), getattr(split, "class_names", None)):
        if names:
            return len(names)
    x, _ = next(iter(split.loader(batch_size=min(batch_size, 8))))
    return int(model_logits(module, x).shape[1])
