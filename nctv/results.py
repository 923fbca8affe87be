"""What a run produces: per-method statistics, Welch's tests, and the result objects of every run kind.

``RunResult`` (tables 1–4 and 7), ``GammaSweepResult`` (Figure 2) and ``InitStudyResult`` (Figure 3)
share one JSON header (schema in docs/results-schema.md) and are written by ``save``. Metrics are
fractions here; tables convert units (``nctv.report``).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from scipy import stats

from nctv import __version__
from nctv.metrics import HIGHER_IS_BETTER, METRIC_NAMES, better

RESULTS_SCHEMA_VERSION = 1
#: The method Welch's t-test compares with the best baseline (the paper's proposal).
COMPARED_METHOD = "Neural Clamping (FL)"
REFERENCE_METHOD = "Uncalibrated"
#: The baseline Neural Clamping is also compared with, whether or not it is the best one.
GRID_SEARCH_METHOD = "TS by Grid Search"
#: The folder of a saved run that holds its fitted calibrators (``RunResult.save_calibrators``).
CALIBRATORS_FOLDER = "calibrators"
#: A γ sweep's file name beside a run's (the shipped result's sweep, which the γ sweep tab opens on).
GAMMA_SWEEP_FILE = "gamma_sweep.json"
#: An initialisation study's file name beside a run's (the shipped one opens the Initialisation tab).
INIT_STUDY_FILE = "init_study.json"


def method_slug(method: str) -> str:
    """A folder name for a method: "Neural Clamping (FL)" → "neural-clamping-fl"."""
    return re.sub(r"[^a-z0-9]+", "-", method.lower()).strip("-")


def _header(kind: str, created: str, fitter: str, model: dict, calibration: dict, test: dict, settings: dict,
            seconds: float) -> dict[str, Any]:
    """The fields every saved result starts with."""
    return {"schema_version": RESULTS_SCHEMA_VERSION, "nctv_version": __version__, "kind": kind, "created": created,
            "fitter": fitter, "model": _jsonable(model), "calibration": _jsonable(calibration),
            "test": _jsonable(test), "settings": _jsonable(settings), "seconds": seconds}


class _JSON:
    """Results that save as JSON: ``to_dict`` gives the fields, ``to_json`` the text."""

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - interface
        raise NotImplementedError

    def to_json(self, indent: int | None = 2) -> str:
        # allow_nan=False: a NaN in results is a bug worth failing loudly on.
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


@dataclass
class MetricStats:
    """One metric of one method at one bin count over the runs (fractions).

    ``ci_low``/``ci_high``: the interval of the metric on the population the test split was drawn from
    (``nctv.intervals``; the run's ``settings["intervals"]`` say how), None when not computed.
    """

    mean: float
    std: float
    runs: list[float]
    ci_low: float | None = None
    ci_high: float | None = None

    @classmethod
    def from_runs(cls, runs: Sequence[float]) -> "MetricStats":
        values = [float(v) for v in runs]
        arr = np.asarray(values, dtype=np.float64)
        # Sample std (ddof=1), the spread Welch's test uses; a single run has no spread.
        std = float(arr.std(ddof=1)) if len(arr) > 1 else 0.0
        return cls(float(arr.mean()), std, values)


@dataclass(kw_only=True)
class MethodResult:
    """Everything measured for one method (one table row); built with keywords.

    ``metrics[n_bins][metric]`` holds the statistics over ``seeds``; ``fit_seconds`` the wall time of
    each fit (given the cached unperturbed logits; model passes a method needs itself are
    included). ``params`` are the learned values of the first seed (``temperature``; for Neural
    Clamping also ``delta_l2``, ``delta_linf``, ``gamma``, ``weight_decay``). ``test_logits`` (the
    calibrated test logits of the first seed) and ``delta`` (NC's δ of the first seed, in the
    model's normalised input space) are kept in memory and saved beside the JSON, not in it;
    ``calibrator`` is the first seed's fitted calibrator (``save_pretrained`` saves it), in memory only.
    """

    name: str
    stochastic: bool
    uses_model: bool
    seeds: list[int]
    metrics: dict[int, dict[str, MetricStats]]
    fit_seconds: list[float]
    params: dict[str, Any] = field(default_factory=dict)
    test_logits: torch.Tensor | None = field(default=None, repr=False)
    delta: torch.Tensor | None = field(default=None, repr=False)
    calibrator: Any = field(default=None, repr=False, compare=False)
    #: The first seed's conformal prediction sets scored on the test split (``RunOptions.conformal``):
    #: score, target coverage, q̂, and [value, low, high] of coverage, mean set size and the worst
    #: class's coverage; None when the run made none (or for an ablation row).
    conformal: dict[str, Any] | None = None

    @property
    def is_reference(self) -> bool:
        return self.name == REFERENCE_METHOD

    @property
    def is_baseline(self) -> bool:
        """A logit-space calibrator (not the uncalibrated reference, not a Neural Clamping row)."""
        return not self.uses_model and not self.is_reference


@dataclass
class WelchTest:
    """Welch's t-test of ``method`` against ``baseline`` on one metric at one bin count.

    ``t`` is positive when ``method`` has the larger mean. ``better`` says whether ``method`` is
    better by the metric's direction (None on a tie). ``t``/``p``/``df`` are None when the test is
    undefined (fewer than two runs of ``method``); ``note`` says why or how a degenerate case was
    handled.
    """

    metric: str
    n_bins: int
    method: str
    baseline: str
    method_mean: float
    baseline_mean: float
    t: float | None
    p: float | None
    df: float | None
    better: bool | None
    note: str = ""


class PairedDifference:
    """What every paired interval of ``method`` − ``other`` (fields ``difference``, ``low``, ``high``,
    fractions) says: whether it holds 0, where it lies, and its mirror (``other`` − ``method``)."""

    method: str
    other: str
    difference: float
    low: float
    high: float

    @property
    def tied(self) -> bool:
        """The interval holds 0: the data cannot tell the two apart."""
        return self.low <= 0 <= self.high

    @property
    def verdict(self) -> str:
        """"lower", "higher" or "tied": where the interval of the difference lies."""
        return "tied" if self.tied else ("lower" if self.high < 0 else "higher")

    def mirrored(self):
        """The same comparison read the other way round: ``other`` − ``method``."""
        return replace(self, method=self.other, other=self.method, difference=-self.difference, low=-self.high,
                       high=-self.low)


def find_comparison(comparisons: Iterable[PairedDifference], method: str, other: str, **where: Any):
    """The comparison of ``method`` − ``other`` among ``comparisons`` whose fields equal ``where``, or its
    mirror read the right way round; None when there is neither."""
    for c in comparisons:
        if all(getattr(c, k) == v for k, v in where.items()):
            if (c.method, c.other) == (method, other):
                return c
            if (c.method, c.other) == (other, method):
                return c.mirrored()
    return None


@dataclass
class Comparison(PairedDifference):
    """The paired interval of ``method`` − ``other`` on one metric at one bin count (fractions).

    ``role`` says why the pair is compared: "leader" (``other`` has the column's best value),
    "best baseline" (the best logit-space calibrator) or "grid search" (``COMPARED_METHOD`` against
    ``GRID_SEARCH_METHOD``).
    """

    metric: str
    n_bins: int
    method: str
    other: str
    role: str
    difference: float
    low: float
    high: float


@dataclass
class RunResult(_JSON):
    """The outcome of a paper-style run; ``to_json()`` follows docs/results-schema.md."""

    kind: str
    model: dict[str, Any]
    calibration: dict[str, Any]
    test: dict[str, Any]
    n_classes: int
    class_names: list[str] | None
    bins: list[int]
    seeds: list[int]
    fitter: str
    methods: dict[str, MethodResult]
    welch: list[WelchTest]
    cache_hits: dict[str, bool]
    settings: dict[str, Any]
    seconds: float
    created: str
    test_labels: torch.Tensor | None = field(default=None, repr=False)
    comparisons: list[Comparison] = field(default_factory=list)

    def comparison(self, method: str, other: str, metric: str, n_bins: int = 15) -> Comparison | None:
        """The paired interval of ``method`` − ``other`` (or its mirror), None when the run has none."""
        return find_comparison(self.comparisons, method, other, metric=metric, n_bins=n_bins)

    def stats(self, method: str, metric: str, n_bins: int = 15) -> MetricStats:
        if method not in self.methods:
            raise ValueError(f"No method {method!r} in this run; it has {', '.join(self.methods)}.")
        if n_bins not in self.methods[method].metrics:
            raise ValueError(f"This run has no {n_bins}-bin results; it used bins {self.bins}.")
        per_bin = self.methods[method].metrics[n_bins]
        if metric not in per_bin:
            raise ValueError(f"Unknown metric {metric!r}; use one of {', '.join(per_bin)}.")
        return per_bin[metric]

    def welch_for(self, n_bins: int = 15) -> list[WelchTest]:
        return [w for w in self.welch if w.n_bins == n_bins]

    def to_dict(self) -> dict[str, Any]:
        methods = {}
        for name, m in self.methods.items():
            methods[name] = {
                "stochastic": m.stochastic,
                "uses_model": m.uses_model,
                "seeds": list(m.seeds),
                "fit_seconds": list(m.fit_seconds),
                "params": _jsonable(m.params),
                "metrics": {
                    str(b): {k: _stats_dict(s) for k, s in per.items()}
                    for b, per in m.metrics.items()
                },
                "conformal": _jsonable(m.conformal),
            }
        return {
            **_header(self.kind, self.created, self.fitter, self.model, self.calibration, self.test, self.settings,
                      self.seconds),
            "n_classes": self.n_classes,
            "class_names": self.class_names,
            "bins": list(self.bins),
            "seeds": list(self.seeds),
            "cache_hits": dict(self.cache_hits),
            "methods": methods,
            "welch": [_jsonable(vars(w)) for w in self.welch],
            "comparisons": [_jsonable(vars(c)) for c in self.comparisons],
        }


    @classmethod
    def from_dict(cls, data: dict[str, Any], test_logits: dict[str, torch.Tensor] | None = None,
                  deltas: dict[str, torch.Tensor] | None = None) -> "RunResult":
        """Rebuild a result from ``to_dict()`` output. Logits and δ are not part of the JSON:
        ``test_logits`` (per method, and the test split's ``labels``) and ``deltas`` (per method)
        give them, as :meth:`save` wrote them beside it."""
        test_logits, deltas = dict(test_logits or {}), dict(deltas or {})
        if data.get("schema_version") != RESULTS_SCHEMA_VERSION:
            raise ValueError(
                f"results schema version {data.get('schema_version')!r} is not {RESULTS_SCHEMA_VERSION}; "
                "re-run the experiment with this version of nctv."
            )
        methods = {}
        for name, m in data["methods"].items():
            metrics = {
                int(b): {k: MetricStats(s["mean"], s["std"], list(s["runs"]), s.get("ci_low"), s.get("ci_high"))
                         for k, s in per.items()}
                for b, per in m["metrics"].items()
            }
            methods[name] = MethodResult(
                name=name, stochastic=m["stochastic"], uses_model=m["uses_model"], seeds=list(m["seeds"]),
                metrics=metrics, fit_seconds=list(m["fit_seconds"]), params=dict(m["params"]),
                test_logits=test_logits.get(name), delta=deltas.get(name),
                conformal=_checked_conformal(m.get("conformal"), name, int(data["n_classes"])),
            )
        welch = [WelchTest(**w) for w in data["welch"]]
        return cls(
            kind=data["kind"], model=data["model"], calibration=data["calibration"], test=data["test"],
            n_classes=data["n_classes"], class_names=data["class_names"], bins=list(data["bins"]),
            seeds=list(data["seeds"]), fitter=data["fitter"], methods=methods, welch=welch,
            cache_hits=dict(data["cache_hits"]), settings=dict(data["settings"]), seconds=data["seconds"],
            created=data["created"], comparisons=[Comparison(**c) for c in data.get("comparisons", [])],
            test_labels=test_logits.get("labels"),
        )

    @classmethod
    def from_json(cls, text: str) -> "RunResult":
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, directory: str | Path) -> "RunResult":
        """A result as :meth:`save` wrote it: ``results.json`` with the test logits, labels and δ's
        of the files beside it, where they are."""
        from safetensors.torch import load_file

        folder = Path(directory)
        tensors = [load_file(str(f)) if f.is_file() else None
                   for f in (folder / "test_logits.safetensors", folder / "delta.safetensors")]
        return cls.from_dict(json.loads((folder / "results.json").read_text(encoding="utf-8")), *tensors)

    def save(self, directory: str | Path, model: Any = None) -> list[Path]:
        """Write ``results.json`` and, when present, ``test_logits.safetensors`` (calibrated test
        logits of the first seed per method, plus ``labels``) and ``delta.safetensors`` (δ per NC
        method, normalised input space). With ``model`` (the model of the run), the fitted
        calibrators go to ``calibrators/`` as well (:meth:`save_calibrators`). Returns the written paths."""
        from safetensors.torch import save_file

        out = Path(directory)
        written_calibrators = [] if model is None else self.save_calibrators(out / CALIBRATORS_FOLDER, model)
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "results.json"]
        written[0].write_text(self.to_json(), encoding="utf-8")
        # Rows may share one tensor (ablation rows reuse NC's δ); safetensors stores each key's own copy.
        logits = {n: m.test_logits.clone().contiguous() for n, m in self.methods.items() if m.test_logits is not None}
        if logits and self.test_labels is not None:
            logits["labels"] = self.test_labels.contiguous()
            save_file(logits, str(out / "test_logits.safetensors"), metadata={"units": "logits"})
            written.append(out / "test_logits.safetensors")
        deltas = {n: m.delta.clone().contiguous() for n, m in self.methods.items() if m.delta is not None}
        if deltas:
            save_file(deltas, str(out / "delta.safetensors"), metadata={"space": "normalised model input"})
            written.append(out / "delta.safetensors")
        return written + written_calibrators

    def save_calibrators(self, directory: str | Path, model: Any) -> list[Path]:
        """Every fitted calibrator of this run (first seed), each with ``save_pretrained`` in
        ``directory/<method slug>`` (e.g. ``neural-clamping-fl``), ready for ``load_calibrator`` and
        ``nctv apply``. ``model``: the run's model (a zoo ``LoadedModel`` records its name and data
        config). A result read from JSON keeps no calibrators: then nothing is written. Returns
        the written folders."""
        folders = []
        for name, m in self.methods.items():
            if m.calibrator is not None and not m.is_reference:
                folders.append(Path(m.calibrator.save_pretrained(Path(directory) / method_slug(name), model=model)))
        return folders


def _stats_dict(s: MetricStats) -> dict[str, Any]:
    out: dict[str, Any] = {"mean": s.mean, "std": s.std, "runs": list(s.runs)}
    if s.ci_low is not None:
        out.update(ci_low=s.ci_low, ci_high=s.ci_high)
    return out


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        # JSON has no inf/NaN; the schema spells them as strings.
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, Path):
        return str(obj)
    return obj


# --------------------------------------------------------------------------- Welch's t-test


def best_method(methods: dict[str, MethodResult], metric: str, n_bins: int, among: Iterable[str]) -> str | None:
    """The name with the best mean among ``among`` (first listed wins ties)."""
    best = None
    for name in among:
        v = methods[name].metrics[n_bins][metric].mean
        if best is None or better(metric, v, methods[best].metrics[n_bins][metric].mean):
            best = name
    return best


def welch_test(metric: str, n_bins: int, method: MethodResult, baseline: MethodResult) -> WelchTest:
    """Welch's t-test (unequal variances) of ``method``'s runs against ``baseline``'s runs.

    Degenerate cases, decided here: a deterministic baseline (one run, or identical runs) is a
    known constant, and Welch's statistic with zero baseline variance is the one-sample t-test of
    ``method``'s runs against that constant (df = n − 1); if ``method`` has no spread either, the
    difference is exact: t = ±inf, p = 0 (or t = 0, p = 1 when the means are equal). Fewer than
    two runs of ``method`` give no test (t = p = None).
    """
    a = np.asarray(method.metrics[n_bins][metric].runs, dtype=np.float64)
    b = np.asarray(baseline.metrics[n_bins][metric].runs, dtype=np.float64)
    ma, mb = float(a.mean()), float(b.mean())
    base = dict(metric=metric, n_bins=n_bins, method=method.name, baseline=baseline.name,
                method_mean=ma, baseline_mean=mb, better=better(metric, ma, mb))
    if len(a) < 2:
        return WelchTest(**base, t=None, p=None, df=None, note=f"needs at least 2 runs of {method.name}")
    a_flat = bool(np.all(a == a[0]))
    b_flat = len(b) < 2 or bool(np.all(b == b[0]))
    if a_flat and b_flat:
        if ma == mb:
            return WelchTest(**base, t=0.0, p=1.0, df=None, note="identical values, no spread")
        return WelchTest(**base, t=math.copysign(math.inf, ma - mb), p=0.0, df=None,
                         note="no spread in either; the difference is exact")
    if b_flat:
        r = stats.ttest_1samp(a, mb)
        return WelchTest(**base, t=float(r.statistic), p=float(r.pvalue), df=float(len(a) - 1),
                         note="deterministic baseline: one-sample t-test against its value")
    r = stats.ttest_ind(a, b, equal_var=False)
    return WelchTest(**base, t=float(r.statistic), p=float(r.pvalue), df=float(r.df))


def welch_tests(methods: dict[str, MethodResult], bins: Iterable[int], compared: str = COMPARED_METHOD) -> list[WelchTest]:
    """``compared`` against the best baseline (logit-space calibrator) per metric and bin count."""
    if compared not in methods:
        return []
    baselines = [n for n, m in methods.items() if m.is_baseline]
    out = []
    for b in bins:
        for metric in METRIC_NAMES:
            if HIGHER_IS_BETTER[metric] is None:
                continue
            best = best_method(methods, metric, b, baselines)
            if best is not None:
                out.append(welch_test(metric, b, methods[compared], methods[best]))
    return out


def interval_comparisons(methods: dict[str, MethodResult], draws: dict[str, dict[int, dict[str, Any]]],
                         bins: Iterable[int], level: float) -> list[Comparison]:
    """The paired intervals the tables need (``draws[method][n_bins][metric]``: ``nctv.intervals``
    draws): every method against its column's leader and against the best baseline, and
    ``COMPARED_METHOD`` against ``GRID_SEARCH_METHOD``. Metrics with no better direction have none.

    A calibration error's pair is widened where a method's calibration test cannot reject "calibrated"
    (``nctv.intervals.difference_at_boundary``, from each row's p-value and its own interval in
    ``methods``), so two rows both consistent with calibrated are tied."""
    from nctv.intervals import difference

    baselines = [n for n, m in methods.items() if m.is_baseline]
    out = []
    for b in bins:
        for metric in draws[next(iter(draws))][b]:
            if HIGHER_IS_BETTER[metric] is None:
                continue
            pairs = []
            for role, among in (("leader", list(methods)), ("best baseline", baselines)):
                best = best_method(methods, metric, b, among)
                pairs += [(n, best, role) for n in methods if best is not None and n != best]
            if COMPARED_METHOD in methods and GRID_SEARCH_METHOD in methods:
                pairs.append((COMPARED_METHOD, GRID_SEARCH_METHOD, "grid search"))
            for name, other, role in pairs:
                d = difference(draws[name][b][metric], draws[other][b][metric], level)
                d = _at_boundary(d, methods[name].metrics[b], methods[other].metrics[b], metric, level)
                out.append(Comparison(metric, b, name, other, role, d.estimate, d.low, d.high))
    return out


def calibration_p(stats: dict[str, MetricStats], metric: str) -> float | None:
    """A row's calibration test p-value for ``metric`` (``stats``: its metrics at one bin count); None for a
    metric that is not a calibration error, or a row without a test."""
    from nctv.intervals import tested_p

    p = {k: stats[k].mean if k in stats else None for k in ("calibration_p", "classwise_calibration_p")}
    return tested_p(metric, p["calibration_p"], p["classwise_calibration_p"])


def _at_boundary(d: Any, a: dict[str, MetricStats], b: dict[str, MetricStats], metric: str, level: float) -> Any:
    """The paired interval ``d`` of two rows (``a``, ``b``: their metrics at one bin count) after
    ``nctv.intervals.difference_at_boundary``."""
    from nctv.intervals import Interval, difference_at_boundary

    own = lambda s: Interval(s.mean, s.ci_low, s.ci_high)  # noqa: E731
    return difference_at_boundary(d, own(a[metric]), own(b[metric]), calibration_p(a, metric),
                                  calibration_p(b, metric), level)


# --------------------------------------------------------------------------- figures 2 and 3


@dataclass
class _StudyResult(_JSON):
    """What a figure study found (``outcome``) and what was run."""

    outcome: Any
    model: dict[str, Any]
    calibration: dict[str, Any]
    test: dict[str, Any]
    settings: dict[str, Any]
    seconds: float
    created: str

    @property
    def fitter(self) -> str:
        return self.outcome.fitter

    def _header(self, kind: str) -> dict[str, Any]:
        return _header(kind, self.created, self.fitter, self.model, self.calibration, self.test, self.settings,
                       self.seconds)


@dataclass
class GammaSweepResult(_StudyResult):
    """Figure 2's numbers (``sweep``: a ``nctv.calibration.studies.GammaSweep``) and what was run."""

    @property
    def sweep(self) -> Any:
        return self.outcome

    def to_dict(self) -> dict[str, Any]:
        s = self.sweep
        return {
            **self._header("gamma-sweep"), "n_bins": s.n_bins,
            "gammas": _jsonable(s.gammas), "chosen_gamma": s.chosen_gamma, "temperature": _jsonable(s.temperature),
            "weight_decay": _jsonable(s.weight_decay), "objective": _jsonable(s.objective),
            **({"delta_l2": _jsonable(s.delta_l2)} if s.delta_l2 is not None else {}),
            "passes": _jsonable(s.passes), "n_passes": s.n_passes,
            "splits": {"calibration": _jsonable(s.cal), **({"test": _jsonable(s.test)} if s.test is not None else {})},
            **({"intervals": s.intervals, "test_intervals": {m: {"ci_low": _jsonable(s.test_low[m]),
                                                                "ci_high": _jsonable(s.test_high[m])}
                                                            for m in s.test_low}}
               if s.test_low is not None else {}),
        }


@dataclass
class InitStudyResult(_StudyResult):
    """Figure 3's numbers (``study``: a ``nctv.calibration.studies.InitStudy``) and what was run."""

    n_classes: int = 0

    @property
    def study(self) -> Any:
        return self.outcome

    def summary(self, metric: str = "ece") -> dict[str, MetricStats]:
        """Mean ± std of ``metric`` per initialisation ("random", "data")."""
        return {init: MetricStats.from_runs(self.study.values(init, metric)) for init in self.study.runs}

    def to_dict(self) -> dict[str, Any]:
        s = self.study
        return {
            **self._header("init-study"), "n_classes": self.n_classes, "n_bins": s.n_bins,
            "seeds": list(s.seeds), "shared_data_fit": s.shared_data_fit, "n_passes": s.n_passes,
            "runs": _jsonable(s.runs),
            **({"intervals": s.intervals,
                "ci": {init: {m: {"ci_low": low, "ci_high": high} for m, (low, high) in per.items()}
                       for init, per in s.ci.items()},
                "difference": {m: {"difference": d, "low": low, "high": high}
                               for m, (d, low, high) in s.ci_difference.items()}} if s.ci is not None else {}),
        }



def _checked_conformal(data: Any, method: str, n_classes: int) -> dict[str, Any] | None:
    """A saved row's conformal sets (:attr:`MethodResult.conformal`), every value checked (a saved
    file is read as untrusted): None stays None; coverage figures are fractions, set sizes within 0 to
    the class count, each [value, low, high] ordered."""
    import math

    if data is None:
        return None
    where = f"The conformal sets of {method}"
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a table of figures.")
    for key, top in (("coverage", 1.0), ("mean_size", float(n_classes)), ("worst_class_coverage", 1.0)):
        v = data.get(key)
        if (not isinstance(v, list) or len(v) != 3 or
                not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
                or not 0 <= v[1] <= v[0] <= v[2] <= top):
            raise ValueError(f"{where}: {key} must be [value, low, high] with low ≤ value ≤ high within 0 and {top:g}.")
    for key, low, high in (("coverage_target", 0.0, 1.0), ("empty", 0.0, 1.0)):
        v = data.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v <= high:
            raise ValueError(f"{where}: {key} must be a number from {low:g} to {high:g}.")
    w = data.get("worst_class")
    if not isinstance(w, int) or isinstance(w, bool) or not 0 <= w < n_classes:
        raise ValueError(f"{where}: worst_class must be a class index below {n_classes}.")
    _check_raps_values(data, where)
    return dict(data)


def _check_raps_values(data: dict[str, Any], where: str) -> None:
    """The RAPS values a row's sets used (``penalty``, ``k_reg``, ``tuned``, ``n_tune``, ``n_conformal``).
    Files written before they were recorded lack them and pass; where present, each is checked: λ a finite
    number ≥ 0 and k_reg a whole number ≥ 0 for RAPS (null for LAC and APS), ``tuned`` a list of those two
    names (empty unless RAPS), the point counts whole numbers, at least one tuning point when something
    was tuned and none when nothing was."""
    import math

    from nctv.conformal import SCORES

    score = data.get("score")
    if not isinstance(score, str) or score not in SCORES:
        raise ValueError(f"{where}: score must be one of {', '.join(SCORES)}.")
    raps = score == "raps"

    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if "penalty" in data:
        v = data["penalty"]
        ok = (v is None) if not raps else (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)
        if not ok:
            raise ValueError(f"{where}: penalty must be RAPS's λ, a finite number >= 0 (null for {score.upper()}).")
    if "k_reg" in data:
        v = data["k_reg"]
        if not ((v is None) if not raps else whole(v)):
            raise ValueError(f"{where}: k_reg must be RAPS's k_reg, a whole number >= 0 (null for {score.upper()}).")
    tuned = data.get("tuned", [])
    if (not isinstance(tuned, list) or not all(t in ("penalty", "k_reg") for t in tuned) or len(set(tuned)) != len(tuned)
            or (tuned and not raps)):
        raise ValueError(f"{where}: tuned must list which of RAPS's penalty and k_reg were tuned (none for {score.upper()}).")
    for key in ("n_tune", "n_conformal"):
        if key in data and not whole(data[key]):
            raise ValueError(f"{where}: {key} must be a whole number of calibration pictures.")
    if "n_tune" in data and (data["n_tune"] > 0) != bool(tuned):
        raise ValueError(f"{where}: n_tune must be at least 1 when RAPS's values were tuned and 0 when none was.")
