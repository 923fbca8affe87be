"""The paper's two studies of Neural Clamping: the γ sweep (Figure 2) and random against
data-driven initialisation of δ (Figure 3).

Both drive :class:`~nctv.calibration.clamping.NeuralClamping` through its public steps
(``prepare``, ``fit_prepared``, ``choose``, ``perturbed_logits``), so that the first pass over the
calibration split is shared by every fit and the test split is read once for all fitted δ's.
docs/method.md describes what each figure measures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from nctv.calibration.clamping import NeuralClamping
from nctv.calibration.clamping_fit import mean_focal
from nctv.checks import check_gamma, check_positive, check_whole
from nctv.intervals import (RESAMPLED, Interval, IntervalSettings, at_boundary,
                            difference, difference_at_boundary, interval, method_draws, resample_counts_for,
                            seed_counts, tested_p)
from nctv.settings import STUDY_RANDOM_INIT_STD, SWEEP_GAMMAS, NCOptions

__all__ = ["GammaSweep", "gamma_sweep", "gamma_sweep_passes", "InitStudy", "init_study",
           "init_study_passes"]

_CURVES = ("ece", "entropy", "loss")


def _split_metrics(logits: torch.Tensor, labels: torch.Tensor, gamma: float, n_bins: int) -> dict[str, float]:
    from nctv.metrics import ece, entropy

    return {"ece": ece(logits, labels, n_bins=n_bins), "entropy": entropy(logits),
            "loss": mean_focal(logits, labels.to(logits.device), gamma, 0.0)}


def _curves(rows: list[dict[str, float]]) -> dict[str, np.ndarray]:
    return {k: np.array([r[k] for r in rows]) for k in _CURVES}


def _test_draws(per_point: list[list[torch.Tensor]], labels: torch.Tensor, unperturbed: torch.Tensor, n_bins: int,
                metrics: Sequence[str], settings: IntervalSettings, test_key: Any = None) -> list[dict[str, Any]]:
    """Per point (a γ, an initialisation: the test logits of each of its runs), ``metrics`` on every
    resample of the test split (``nctv.intervals``). One count matrix serves every point, so points
    compare paired; a point with several runs redraws them in each resample (the mean's interval). The
    resamples are keyed as a run's are (``nctv.experiment.resample_key``): by ``test_key``, each test
    picture's identity by its content (``nctv.data.row_keys``), and the labels, the same for the test
    pictures in any order and on any machine; without it, by the ``unperturbed`` model's test logits."""
    key = unperturbed if test_key is None else test_key
    counts = resample_counts_for((key, labels), settings.resamples, settings.seed)
    runs = torch.Generator().manual_seed(settings.seed + 1)
    out = []
    for logits in per_point:
        redrawn = seed_counts(len(logits), settings.resamples, runs) if len(logits) > 1 else None
        out.append(method_draws(logits, labels, counts, n_bins, metrics, redrawn))
    return out


def _ends(draws: dict[str, Any], level: float, tested: Any = None) -> dict[str, list[float]]:
    """metric → [low, high] of its interval. With ``tested`` (the point's calibration test,
    ``nctv.consistency``), a calibration error's interval reaches 0 where the test cannot reject
    "calibrated", as a run's table does (``nctv.intervals.at_boundary``)."""
    out = {}
    for m, d in draws.items():
        ci = interval(d, m, level)
        if tested is not None:
            ci = at_boundary(ci, tested_p(m, tested.p_top_label, tested.p_classwise), level)
        out[m] = [ci.low, ci.high]
    return out


def _tested(logits: list[torch.Tensor], labels: torch.Tensor, n_bins: int, settings: IntervalSettings,
            test_key: Any = None) -> Any:
    """The calibration test of one point (its runs' logits) with the run's resamples, seed and key."""
    from nctv.consistency import consistency_test

    return consistency_test(logits, labels, n_bins, settings.resamples, settings.seed, key=test_key)


@dataclass
class GammaSweep:
    """ECE, entropy and loss of Neural Clamping as functions of γ (the paper's Figure 2).

    ``cal`` and ``test`` map "ece", "entropy", "loss" to arrays over ``gammas`` ("loss": mean
    FL_γ of the calibrated logits, without the λ term; ECE with ``n_bins`` bins, as fractions).
    ``test`` is None without a test split. ``chosen_gamma``: the γ that ``gamma="auto"`` over these γ values
    keeps (the temperature rule's calibration criterion: by default the mean ECE over 10, 15 and 20 bins).
    ``delta_l2``: ‖δ‖₂ of each γ's δ. ``n_passes``: passes over the calibration split for the whole sweep;
    ``test_passes``: forward passes over the test split (0.5 each: one per γ, and the unperturbed model's,
    the resamples' key, where intervals are computed). ``test_low``/``test_high``: per γ, the interval of
    the test split's "ece" and "entropy" from resampling it (``intervals``: how; None: not computed).
    """

    gammas: np.ndarray
    temperature: np.ndarray
    weight_decay: np.ndarray
    objective: np.ndarray
    passes: np.ndarray
    cal: dict[str, np.ndarray]
    test: dict[str, np.ndarray] | None
    chosen_gamma: float
    n_passes: float
    test_passes: float
    fitter: str
    n_bins: int = 15
    delta_l2: np.ndarray | None = None
    test_low: dict[str, np.ndarray] | None = None
    test_high: dict[str, np.ndarray] | None = None
    intervals: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GammaSweep":
        """The sweep a saved ``GammaSweepResult.to_dict()`` holds; every curve finite and one value per γ."""
        gammas = _finite(data["gammas"], "gammas", None)
        n = len(gammas)
        splits = data["splits"]
        curves = {split: {m: _finite(v, f"{split} {m}", n) for m, v in splits[split].items()} for split in splits}
        ends = data.get("test_intervals")
        return cls(gammas=gammas, temperature=_finite(data["temperature"], "temperature", n),
                   weight_decay=_finite(data["weight_decay"], "weight_decay", n),
                   objective=_finite(data["objective"], "objective", n), passes=_finite(data["passes"], "passes", n),
                   cal=curves["calibration"], test=curves.get("test"), chosen_gamma=float(data["chosen_gamma"]),
                   n_passes=float(data["n_passes"]),
                   test_passes=0.5 * (n + (ends is not None)) if "test" in curves else 0.0,
                   fitter=str(data["fitter"]), n_bins=int(data["n_bins"]),
                   delta_l2=None if "delta_l2" not in data else _finite(data["delta_l2"], "delta_l2", n),
                   test_low=None if ends is None else {m: _finite(e["ci_low"], f"{m} low", n) for m, e in ends.items()},
                   test_high=None if ends is None else {m: _finite(e["ci_high"], f"{m} high", n) for m, e in ends.items()},
                   intervals=data.get("intervals"))


def _finite(values: Any, name: str, n: int | None) -> np.ndarray:
    a = np.asarray(values, dtype=float)
    if a.ndim != 1 or (n is not None and len(a) != n) or not np.isfinite(a).all():
        raise ValueError(f"The saved study's {name} must be {n or 'some'} finite numbers.")
    return a


def _options(options: NCOptions | None, settings: dict[str, Any]) -> tuple[NCOptions, dict[str, Any]]:
    """The study's Neural Clamping options (``options`` with the options among ``settings``), and
    the rest of ``settings`` (seed, device, input_range, callback, …)."""
    own = {k: v for k, v in settings.items() if k in NCOptions.names()}
    options = NCOptions() if options is None else options
    return (options.changed(**own) if own else options), {k: v for k, v in settings.items() if k not in own}


def gamma_sweep(model: torch.nn.Module, cal_inputs: Any, cal_labels: Any = None, test_inputs: Any = None,
                test_labels: Any = None, gammas: Sequence[float] = SWEEP_GAMMAS, n_bins: int = 15,
                options: NCOptions | None = None, intervals: IntervalSettings | None = IntervalSettings(),
                test_key: Any = None, **settings: Any) -> GammaSweep:
    """Fit Neural Clamping for every γ in ``gammas`` and measure both splits (``options`` and
    ``settings`` go to ``NeuralClamping``: init, seed, weight_decay, fitter, max_passes, …; its γ is
    not used). With a test split and ``intervals``, each γ's test ECE and entropy get an interval
    from resampling the test split, drawn as a run draws them: keyed by ``test_key`` (each test picture's
    identity, ``nctv.data.row_keys``) where given, else by the unperturbed model's test logits.

    Each γ's row is the fit that Neural Clamping with the same options gives at that γ alone (a run's
    row, the app's Calibrate): the same start, budget and temperature rule (by default the fast
    fitter's anchored T). The first pass over the calibration split is shared by every γ and the test
    split is read once for all of them.
    """
    options, rest = _sweep_options(options, settings)
    gammas = [check_gamma(g, "each of gammas") for g in gammas]
    if not gammas:
        raise ValueError("gammas is empty; give at least one γ >= 0.")
    nc = NeuralClamping(model, options, **rest)
    prepared = nc.prepare(cal_inputs, cal_labels)
    fits = nc.fit_prepared(prepared, gammas)
    n_passes = prepared.passes
    best, candidates = nc.choose(fits, prepared)
    temps = np.array([c["temperature"] for c in candidates])
    cal_rows = [_split_metrics(f.result.logits / t, prepared.labels, f.gamma, n_bins) for f, t in zip(fits, temps)]
    test_rows, bands = None, None
    if test_inputs is not None:
        # With intervals, f(x) too (the resamples' key): half a pass more over the test split.
        test_z, test_y = nc.perturbed_logits(test_inputs, test_labels, [f.result.delta for f in fits]
                                             + ([None] if intervals is not None else []), prepared)
        test_rows = [_split_metrics(z / t, test_y, f.gamma, n_bins) for z, f, t in zip(test_z, fits, temps)]
        if intervals is not None:
            points = [[z / t] for z, t in zip(test_z, temps)]
            draws = _test_draws(points, test_y, test_z[-1], n_bins, ("ece", "entropy"), intervals, test_key)
            bands = _curves_of([_ends(d, intervals.level, _tested(pt, test_y, n_bins, intervals, test_key))
                                for d, pt in zip(draws, points)])
    return GammaSweep(
        gammas=np.array([f.gamma for f in fits]),
        temperature=temps,
        weight_decay=np.array([f.weight_decay for f in fits]),
        objective=np.array([f.result.objective for f in fits]),
        passes=np.array([f.result.passes for f in fits]),
        cal=_curves(cal_rows),
        test=None if test_rows is None else _curves(test_rows),
        chosen_gamma=float(best.gamma),
        n_passes=n_passes,
        test_passes=0.0 if test_rows is None else 0.5 * len(test_z),
        fitter=nc.fitter,
        n_bins=n_bins,
        delta_l2=np.array([float(f.result.delta.norm()) for f in fits]),
        test_low=None if bands is None else bands[0],
        test_high=None if bands is None else bands[1],
        intervals=None if bands is None else intervals.to_dict(),
    )


def _curves_of(per_point: list[dict[str, list[float]]]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per-point intervals as (lows, highs), each a metric → array over the points."""
    return tuple({m: np.array([p[m][end] for p in per_point]) for m in per_point[0]} for end in (0, 1))


def gamma_sweep_passes(model: torch.nn.Module | None, n_gammas: int, options: NCOptions | None = None,
                       **settings: Any) -> float:
    """Passes over the calibration split that :func:`gamma_sweep` plans (the fast fitter may stop sooner):
    the fits, then the test split read once for all of them."""
    options, rest = _sweep_options(options, settings)
    nc = NeuralClamping(model, options, **rest)
    return 0.5 + nc.expected_passes(n_gammas)


def _sweep_options(options: NCOptions | None, settings: dict[str, Any]) -> tuple[NCOptions, dict[str, Any]]:
    if "gamma" in settings:
        raise ValueError("gamma_sweep takes the γ values in gammas=..., not gamma=.")
    return _options(options, settings)


@dataclass
class InitStudy:
    """Random vs data-driven initialisation of δ over several runs (the paper's Figure 3).

    ``runs[init]`` (init in "random", "data") is a list, one per run, of test-split metric dicts
    (keys of ``nctv.metrics.METRIC_NAMES``: entropy, ece, aece, sce, …; fractions). Runs differ by
    seed (``seeds``). With the fast fitter the data-driven fit is deterministic, so it is computed
    once and its metrics repeated for every run (``shared_data_fit`` True). ``ci[init][metric]``: the
    interval [low, high] of the mean over runs from resampling the test split, the runs redrawn in each
    resample; ``ci_difference[metric]``: [difference, low, high] of random − data, paired on the same
    resamples (``intervals``: how; both None when not computed).
    """

    runs: dict[str, list[dict[str, float]]]
    seeds: list[int]
    fitter: str
    n_passes: float
    shared_data_fit: bool
    n_bins: int = 15
    ci: dict[str, dict[str, list[float]]] | None = None
    ci_difference: dict[str, list[float]] | None = None
    intervals: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "InitStudy":
        """The study a saved ``InitStudyResult.to_dict()`` holds; every figure finite, both initialisations
        with one metric dict per seed."""
        seeds = [int(v) for v in data["seeds"]]
        runs = {}
        for init in ("random", "data"):
            per = data["runs"][init]
            if len(per) != len(seeds):
                raise ValueError(f"The saved study has {len(per)} {init} runs for {len(seeds)} seeds.")
            runs[init] = [{m: float(v) for m, v in zip(r, _finite(list(r.values()), f"{init} run", len(r)))}
                          for r in per]
        ci = data.get("ci")
        ci = None if ci is None else {
            init: {m: list(_finite([e["ci_low"], e["ci_high"]], f"{init} {m} interval", 2)) for m, e in per.items()}
            for init, per in ci.items()}
        diff = data.get("difference")
        diff = None if diff is None else {
            m: list(_finite([e["difference"], e["low"], e["high"]], f"{m} difference", 3)) for m, e in diff.items()}
        return cls(runs=runs, seeds=seeds, fitter=str(data["fitter"]), n_passes=float(data["n_passes"]),
                   shared_data_fit=bool(data["shared_data_fit"]), n_bins=int(data["n_bins"]), ci=ci,
                   ci_difference=diff, intervals=data.get("intervals"))

    def values(self, init: str, metric: str) -> np.ndarray:
        """One metric over the runs of one initialisation, for box plots."""
        return np.array([r[metric] for r in self.runs[init]])


def _pair(split_arg: Any, name: str) -> tuple[Any, Any]:
    """(inputs, labels) from a pair of tensors/arrays, or (loader, None)."""
    if isinstance(split_arg, (tuple, list)) and len(split_arg) == 2 and not isinstance(split_arg[0], (tuple, list)):
        return split_arg[0], split_arg[1]
    if isinstance(split_arg, (tuple, list)):
        raise ValueError(f"{name} must be a pair (inputs, labels) or a loader of (inputs, labels) batches.")
    return split_arg, None


def init_study_passes(model: torch.nn.Module | None, n_runs: int, options: NCOptions | None = None,
                      **settings: Any) -> float:
    """Passes over the calibration split that :func:`init_study` plans: the shared pass for δ̃, then
    ``n_runs`` random fits and one data-driven fit (the fast fitter) or ``n_runs`` of them (a recipe)."""
    options, rest = _options(options, settings)
    nc = NeuralClamping(model, options.changed(init="data"), **rest)
    return 1.0 + _init_fits(n_runs, nc.fitter) * nc.expected_passes(1)


def _study_start(options: NCOptions, init: str) -> NCOptions:
    """The options of one arm of the study: a random start is a random one even where the fitter's own
    δ₀ is 0 (the fast fitter's default): then the paper's σ (``STUDY_RANDOM_INIT_STD``)."""
    if init == "random" and options.init_std is None and options.init_spread() == 0:
        return options.changed(init="random", init_std=STUDY_RANDOM_INIT_STD)
    return options.changed(init=init)


def _init_fits(n_runs: int, fitter: str) -> int:
    """Fits of an initialisation study: ``n_runs`` random ones, and one data-driven fit (the fast
    fitter from δ̃ draws nothing random) or ``n_runs`` of them (a recipe)."""
    return n_runs + (1 if fitter == "fast" else n_runs)


class _FitPlan:
    """The passes a run of several fits still plans, re-estimated as its fits end.

    A fit's budget is an upper bound (the fast fitter usually stops at about half of it), so a
    progress total from budgets stops short and then jumps to done. Here every fit not yet ended
    is planned at the mean length of those that ended (its budget while none has), and the step
    info that reaches ``callback`` carries the total so planned as ``planned_passes``."""

    def __init__(self, fits: int, budget: float, callback: Any):
        self.left, self.budget, self.callback = fits, budget, callback
        self.lengths: list[float] = []
        self.start = 0.0

    def begin(self, passes: float) -> None:
        self.start = passes

    def end(self, passes: float) -> None:
        self.lengths.append(passes - self.start)
        self.left -= 1

    def report(self, info: dict) -> None:
        now = float(info["passes"])
        per_fit = float(np.mean(self.lengths)) if self.lengths else self.budget
        current = max(per_fit - (now - self.start), 0.0) if self.left else 0.0
        self.callback({**info, "planned_passes": now + current + per_fit * max(self.left - 1, 0)})


def init_study(model: torch.nn.Module, cal: Any, test: Any, n_runs: int = 5, seed: int = 0, n_bins: int = 15,
               options: NCOptions | None = None, intervals: IntervalSettings | None = IntervalSettings(),
               test_key: Any = None, **settings: Any) -> InitStudy:
    """Fit Neural Clamping ``n_runs`` times from random and from data-driven δ₀ and measure the test split
    (with ``intervals``: each initialisation's interval of every metric, from resampling the test split).

    ``cal``, ``test``: (inputs, labels) pairs or loaders of (x, y). ``options`` and ``settings`` go to
    ``NeuralClamping`` (``input_range`` is required for the data-driven runs; ``init`` is set here).
    Run r uses seed ``seed + r``. Work shared: one pass gives δ̃ and the unperturbed logits for
    all runs; the test split is read once for all fitted δ's. ``test_key``: as in :func:`gamma_sweep`.
    """
    from nctv.metrics import METRIC_NAMES, evaluate

    for key in ("init", "seed"):
        if key in settings:
            raise ValueError(f"init_study sets {key} itself; leave it out.")
    n_runs = check_whole(n_runs, "n_runs")
    options, rest = _options(options, settings)
    plan = None
    if rest.get("callback") is not None:
        budget = NeuralClamping(model, options).expected_passes(1)
        plan = _FitPlan(_init_fits(n_runs, options.fitter), budget, rest["callback"])
        rest = {**rest, "callback": plan.report}
    ncs = {init: NeuralClamping(model, _study_start(options, init), seed=seed, **rest) for init in ("random", "data")}
    nc = ncs["data"]
    prepared = nc.prepare(*_pair(cal, "cal"))  # init="data": this pass also gives δ̃, and every fit shares it
    seeds = [int(seed) + r for r in range(n_runs)]
    shared = nc.fitter == "fast"  # the fast fitter from δ̃ draws nothing random
    chosen: dict[str, list[tuple[torch.Tensor, float]]] = {"random": [], "data": []}
    for init in ("random", "data"):
        for r, s in enumerate(seeds):
            if init == "data" and shared and r > 0:
                chosen[init].append(chosen[init][0])
                continue
            if plan is not None:
                plan.begin(prepared.passes)
            fits = ncs[init].fit_prepared(prepared, seed=s)
            if plan is not None:
                plan.end(prepared.passes)
            best, candidates = nc.choose(fits, prepared)
            chosen[init].append((best.result.delta, candidates[fits.index(best)]["temperature"]))
    n_passes = prepared.passes
    unique = {id(d): d for runs in chosen.values() for d, _ in runs}
    # With intervals, f(x) too (the resamples' key): half a pass more over the test split.
    test_z, test_y = nc.perturbed_logits(*_pair(test, "test"), list(unique.values())
                                         + ([None] if intervals is not None else []), prepared)
    zs = dict(zip(unique, test_z))
    runs = {init: [evaluate(zs[id(d)] / t, test_y, n_bins=n_bins) for d, t in chosen[init]] for init in chosen}
    ci = compared = None
    if intervals is not None:
        # A fit repeated for every run (the shared data-driven one) is one run of the mean.
        per_init = [[zs[id(d)] / t for d, t in dict((id(d), (d, t)) for d, t in chosen[init]).values()] for init in chosen]
        metrics = [m for m in METRIC_NAMES if m in RESAMPLED]
        draws = dict(zip(chosen, _test_draws(per_init, test_y, test_z[-1], n_bins, metrics, intervals, test_key)))
        tests = {init: _tested(logits, test_y, n_bins, intervals, test_key) for init, logits in zip(chosen, per_init)}
        ci = {init: _ends(d, intervals.level, tests[init]) for init, d in draws.items()}
        compared = {}
        for m in metrics:
            d = difference(draws["random"][m], draws["data"][m], intervals.level)
            # As a run's pairs (nctv.intervals.difference_at_boundary): where an initialisation's test
            # cannot reject "calibrated", its error may be 0, and the difference's interval says so.
            own = {init: Interval(float("nan"), *ci[init][m]) for init in ci}  # only the ends are read
            p = {init: tested_p(m, t.p_top_label, t.p_classwise) for init, t in tests.items()}
            d = difference_at_boundary(d, own["random"], own["data"], p["random"], p["data"], intervals.level)
            compared[m] = [d.estimate, d.low, d.high]
    return InitStudy(runs=runs, seeds=seeds, fitter=nc.fitter, n_passes=n_passes, shared_data_fit=shared, n_bins=n_bins,
                     ci=ci, ci_difference=compared, intervals=None if ci is None else intervals.to_dict())
