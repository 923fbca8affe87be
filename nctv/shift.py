"""Calibration under distribution shift: the result of a shift study, its tables and its verdicts.

A shift study (:func:`run_shift`) fits every method once per seed on the calibration
split (clean, or corrupted as the model will meet its inputs) and scores each fitted method on the
clean test split and on every corrupted copy of it (``nctv.corruptions``). Every figure carries the
interval of ``nctv.intervals`` from one set of resamples of the test images, shared by every method
*and every condition* (a corrupted copy holds the same images), so differences between methods are
paired, and the mean over corruptions at one severity has an interval of its own.

A **condition** is the clean test split (key ``"clean"``, severity 0) or one corruption at one
severity (key ``"contrast/3"``); ``"average/3"`` is the mean over the study's corruptions at
severity 3. Metrics are fractions here; tables convert units (``nctv.report``).
"""
from __future__ import annotations

import base64
import io
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from nctv.canonical import canonical_order
from nctv.corruptions import CORRUPTIONS
from nctv.metrics import HIGHER_IS_BETTER
from nctv.results import (COMPARED_METHOD, GRID_SEARCH_METHOD, RESULTS_SCHEMA_VERSION, PairedDifference, _header, _JSON,
                          _jsonable, find_comparison)
from nctv.settings import SEVERITIES, SHIFT_CORRUPTIONS, SHIFT_METHODS, SHIFT_SEEDS, STUDY_BINS

#: Metrics every condition reports with an interval (the others of ``nctv.metrics.evaluate`` as points).
SHIFT_METRICS = ("accuracy", "ece", "nll", "smooth_ece")
#: What Neural Clamping is compared with under every condition (paired intervals).
SHIFT_REFERENCES = (GRID_SEARCH_METHOD, "Temperature Scaling")
CLEAN = "clean"
AVERAGE = "average"
#: Example pictures a saved study may hold per condition, and the size of each (base64 PNG text).
MAX_EXAMPLES = 32
MAX_EXAMPLE_CHARS = 200_000
#: The file of a shift study in a saved folder (and beside the app's shipped result).
SHIFT_FILE = "shift.json"


def condition_key(corruption: str, severity: int) -> str:
    """``"clean"`` for severity 0, else ``"<corruption>/<severity>"``."""
    return CLEAN if int(severity) == 0 else f"{corruption}/{int(severity)}"


def condition_title(key: str) -> str:
    """A condition in words: "clean", "Contrast, severity 3", "mean over corruptions, severity 3"."""
    if key == CLEAN:
        return "clean"
    name, severity = key.rsplit("/", 1)
    what = "mean over corruptions" if name == AVERAGE else CORRUPTIONS[name].title if name in CORRUPTIONS else name
    return f"{what}, severity {severity}"


@dataclass
class ShiftComparison(PairedDifference):
    """The paired interval of ``method`` − ``other`` on ``metric`` under one condition (fractions);
    ``role``: "leader" (``other`` has the condition's lowest value) or "reference" (Neural
    Clamping against temperature scaling, by grid search or by NLL)."""

    condition: str
    metric: str
    method: str
    other: str
    role: str
    difference: float
    low: float
    high: float


@dataclass
class ShiftResult(_JSON):
    """A shift study: ``figures[method][condition][metric]`` = {"value", "ci_low", "ci_high"}
    (intervals for ``SHIFT_METRICS``), ``average[method]["average/<s>"]`` the same for the mean over
    corruptions, ``reliability[method][condition]`` the binned diagram's numbers ("count",
    "confidence", "accuracy" per bin: means, None where a bin is empty), ``params[method]`` what
    the first seed learned (T, ‖δ‖), ``comparisons`` the paired differences."""

    model: dict[str, Any]
    calibration: dict[str, Any]
    test: dict[str, Any]
    n_classes: int
    class_names: list[str] | None
    n_bins: int
    seeds: list[int]
    fitter: str
    methods: list[str]
    corruptions: list[str]
    severities: list[int]
    figures: dict[str, dict[str, dict[str, dict[str, float | None]]]]
    average: dict[str, dict[str, dict[str, dict[str, float | None]]]]
    reliability: dict[str, dict[str, dict[str, list]]]
    params: dict[str, dict[str, Any]]
    fit_seconds: dict[str, list[float]]
    comparisons: list[ShiftComparison]
    cache_hits: dict[str, bool]
    settings: dict[str, Any]
    seconds: float
    created: str
    calibrate_on: str | None = None
    examples: dict[str, Any] = field(default_factory=dict)
    #: Seconds by part of the study: fitting, corrupting, unperturbed logits, model-based methods, scoring.
    timing: dict[str, float] = field(default_factory=dict)

    # ----------------------------------------------------------------- reading

    @property
    def conditions(self) -> list[str]:
        """Every condition scored: clean first, then each corruption by severity."""
        return [CLEAN] + [condition_key(c, s) for c in self.corruptions for s in self.severities]

    def figure(self, method: str, condition: str, metric: str = "ece") -> dict[str, float | None]:
        """{"value", "ci_low", "ci_high"} of one method under one condition (``"average/<s>"`` too)."""
        if method not in self.methods:
            raise ValueError(f"No method {method!r} in this study; it has {', '.join(self.methods)}.")
        table = self.average[method] if condition.startswith(AVERAGE + "/") else self.figures[method]
        if condition not in table:
            raise ValueError(f"No condition {condition!r} in this study; use 'clean', '<corruption>/<severity>' "
                             f"or 'average/<severity>'.")
        if metric not in table[condition]:
            raise ValueError(f"No metric {metric!r}; this study has {', '.join(table[condition])}.")
        return table[condition][metric]

    def value(self, method: str, condition: str, metric: str = "ece") -> float:
        return float(self.figure(method, condition, metric)["value"])

    def comparison(self, method: str, other: str, condition: str, metric: str = "ece") -> ShiftComparison | None:
        """The paired interval of ``method`` − ``other`` (or its mirror) under ``condition``."""
        return find_comparison(self.comparisons, method, other, condition=condition, metric=metric)

    def leaders(self, condition: str, metric: str = "ece") -> list[str]:
        """The methods with the lowest ``metric`` under ``condition`` (highest for accuracy): the leader
        and every method whose paired interval against it holds 0 (tied)."""
        sign = -1.0 if HIGHER_IS_BETTER[metric] else 1.0
        best = min(self.methods, key=lambda m: sign * self.value(m, condition, metric))
        tied = [m for m in self.methods if m != best and (c := self.comparison(m, best, condition, metric)) is not None
                and c.tied]
        return [best] + tied

    # ----------------------------------------------------------------- saving

    def to_dict(self) -> dict[str, Any]:
        return {
            **_header("shift", self.created, self.fitter, self.model, self.calibration, self.test, self.settings,
                      self.seconds),
            "n_classes": self.n_classes, "class_names": self.class_names, "n_bins": self.n_bins,
            "seeds": list(self.seeds), "methods": list(self.methods), "corruptions": list(self.corruptions),
            "severities": list(self.severities), "calibrate_on": self.calibrate_on,
            "figures": _jsonable(self.figures), "average": _jsonable(self.average),
            "reliability": _jsonable(self.reliability), "params": _jsonable(self.params),
            "fit_seconds": _jsonable(self.fit_seconds),
            "comparisons": [_jsonable(vars(c)) for c in self.comparisons],
            "cache_hits": dict(self.cache_hits), "examples": _jsonable(self.examples),
            "timing": _jsonable(self.timing),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ShiftResult":
        """A study from :meth:`to_dict`'s output, every figure checked (a saved file is read as untrusted)."""
        if not isinstance(data, dict) or data.get("kind") != "shift":
            raise ValueError("This is not a saved shift study (its 'kind' is not 'shift').")
        if data.get("schema_version") != RESULTS_SCHEMA_VERSION:
            raise ValueError(f"Shift study schema version {data.get('schema_version')!r} is not "
                             f"{RESULTS_SCHEMA_VERSION}; run the study again with this version of nctv.")
        try:
            result = cls(
                model=dict(data["model"]), calibration=dict(data["calibration"]), test=dict(data["test"]),
                n_classes=int(data["n_classes"]), class_names=data.get("class_names"), n_bins=int(data["n_bins"]),
                seeds=[int(s) for s in data["seeds"]], fitter=str(data["fitter"]),
                methods=[str(m) for m in data["methods"]], corruptions=[str(c) for c in data["corruptions"]],
                severities=[int(s) for s in data["severities"]], figures=data["figures"], average=data["average"],
                reliability=data["reliability"], params=dict(data["params"]), fit_seconds=dict(data["fit_seconds"]),
                comparisons=[ShiftComparison(**c) for c in data["comparisons"]],
                cache_hits=dict(data["cache_hits"]), settings=dict(data["settings"]), seconds=float(data["seconds"]),
                created=str(data["created"]), calibrate_on=data.get("calibrate_on"),
                examples=dict(data.get("examples") or {}),
                timing={str(k): float(v) for k, v in (data.get("timing") or {}).items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"The shift study is incomplete or malformed ({type(e).__name__}: {e}).") from None
        result._check()
        return result

    def _check(self) -> None:
        unknown = [c for c in self.corruptions if c not in CORRUPTIONS]
        if unknown:
            raise ValueError(f"The shift study names unknown corruptions: {', '.join(map(repr, unknown[:3]))}.")
        if not self.severities or any(not 1 <= s <= 5 for s in self.severities):
            raise ValueError("A shift study's severities must lie from 1 to 5.")
        for m in self.methods:
            for key in self.conditions:
                _check_figures(self.figures.get(m, {}).get(key), f"{m} under {key}")
            for s in self.severities:
                _check_figures(self.average.get(m, {}).get(f"{AVERAGE}/{s}"), f"{m}, mean at severity {s}")
        for c in self.comparisons:
            if not all(isinstance(v, (int, float)) and v == v for v in (c.difference, c.low, c.high)):
                raise ValueError("A comparison of the shift study is not a number.")
        if self.examples:
            png = self.examples.get("png")
            if not isinstance(png, dict) or any(
                    not isinstance(v, list) or len(v) > MAX_EXAMPLES or
                    any(not isinstance(t, str) or len(t) > MAX_EXAMPLE_CHARS for t in v) for v in png.values()):
                raise ValueError(f"The shift study's example pictures are malformed (at most {MAX_EXAMPLES} per "
                                 f"condition, each at most {MAX_EXAMPLE_CHARS:,} characters of base64 PNG).")

    @classmethod
    def load(cls, path: str | Path) -> "ShiftResult":
        """A study saved by :meth:`save` (its folder or its ``shift.json``)."""
        p = Path(path)
        p = p / SHIFT_FILE if p.is_dir() else p
        return cls.from_dict(json.loads(p.read_text(encoding="utf-8")))

    def save(self, directory: str | Path, indent: int | None = 2) -> Path:
        """Write ``shift.json`` into ``directory`` (``indent=None``: compact, as the app's shipped copy)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = out / SHIFT_FILE
        path.write_text(self.to_json(indent), encoding="utf-8")
        return path


def _check_figures(per_metric: Any, where: str) -> None:
    if not isinstance(per_metric, dict) or "ece" not in per_metric or "accuracy" not in per_metric:
        raise ValueError(f"The shift study lacks the figures of {where}.")
    for metric, f in per_metric.items():
        v = f.get("value") if isinstance(f, dict) else None
        if not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"The shift study's {metric} of {where} is not a finite number.")
        low, high = f.get("ci_low"), f.get("ci_high")
        if (low is None) != (high is None) or (low is not None and not (isinstance(low, (int, float))
                                                                       and isinstance(high, (int, float)) and low <= high)):
            raise ValueError(f"The shift study's interval of {metric} of {where} is malformed.")


# --------------------------------------------------------------------------- the study


def check_shift_plan(corruptions: Sequence[str], severities: Sequence[int], calibrate_on: Any) -> tuple[
        list[str], list[int], str | None]:
    """The study's corruptions (known, each once), severities (1 to 5, sorted) and the condition to
    calibrate on ("name/severity" or (name, severity); None for the clean split), checked before any
    model or data loads: a typo fails at once."""
    from nctv.corruptions import check_corruption, check_severity

    names = []
    for c in corruptions:
        c = check_corruption(c)
        if c not in names:
            names.append(c)
    if not names:
        raise ValueError("No corruptions given; name at least one, e.g. 'gaussian-noise'.")
    levels = sorted({check_severity(s) for s in severities} - {0})
    if not levels:
        raise ValueError("No severities given; use some of 1 to 5 (the clean test split is always scored).")
    on = None
    if calibrate_on is not None:
        if isinstance(calibrate_on, str):
            name, _, level = calibrate_on.partition("/")
            try:
                level = int(level)
            except ValueError:
                raise ValueError(f"Calibrate on a corruption as 'name/severity', e.g. 'contrast/3'; got "
                                 f"{calibrate_on[:80]!r}.") from None
        else:
            name, level = calibrate_on
        on = condition_key(check_corruption(name), check_severity(level))
        on = None if on == CLEAN else on
    return names, levels, on


def run_shift(model: Any, calibration: Any, test: Any, corruptions: Sequence[str] | None = None,
              severities: Sequence[int] = SEVERITIES, methods: Sequence[str] | None = None,
              options: Any = None, *, corruption_seed: int = 0, calibrate_on: Any = None,
              n_bins: int = STUDY_BINS, examples: int = 0, **keywords: Any) -> ShiftResult:
    """Calibration under distribution shift: every method fitted once per seed on ``calibration``
    (clean, or corrupted by ``calibrate_on`` = "contrast/3" or ("contrast", 3): "calibrate for the
    conditions you deploy in"), then scored on the clean ``test`` split and on every corruption of it
    (``nctv.corruptions``; default ``DEFAULT_CORRUPTIONS``) at every severity.

    The study runs on the skeleton of a paper-style run (``nctv.experiment``: the model prepared, the
    unperturbed logits of both splits cached, every method fitted as a run fits it); it scores each
    fitted method under every condition where a run scores the test split once. Each corrupted test
    split's unperturbed logits are computed once and cached (the cache key names the corruption,
    severity and seed); logit-space methods map them, Neural Clamping passes the corrupted inputs + its
    δ through the model. Every figure gets the interval of ``options.intervals`` from one set of
    resamples of the test images, shared by every method and condition (paired). ``examples``: how
    many test images to keep, per condition, as uint8 pixels (the app's examples). ``options``,
    ``keywords``: as in :func:`nctv.experiment.run_experiment`; seeds default to 1 here.
    """
    from nctv import experiment as ex
    from nctv.checks import check_whole
    from nctv.corruptions import check_corruptible, corrupt_split
    from nctv.data import as_split
    from nctv.intervals import IntervalSettings

    t_start = time.perf_counter()
    names = ex.check_methods(SHIFT_METHODS if methods is None else methods)
    corruptions, severities, calibrate_on = check_shift_plan(
        SHIFT_CORRUPTIONS if corruptions is None else corruptions, severities, calibrate_on)
    check_whole(examples, "examples", minimum=0)
    if options is None and "seeds" not in keywords:
        keywords["seeds"] = SHIFT_SEEDS
    options = ex.RunOptions.make(options, **keywords)
    n_bins = ex._check_bins_list([n_bins])[0]
    calibration, test = as_split(calibration, "calibration"), as_split(test, "test")
    check_corruptible(test)  # a split of tensors is refused here, before any model pass
    if calibrate_on is not None:
        name, level = calibrate_on.rsplit("/", 1)
        calibration = corrupt_split(calibration, name, int(level), corruption_seed + 1)
    plans = ex._plans(names)
    conditions = [(CLEAN, 0)] + [(c, s) for c in corruptions for s in severities]
    intervals = options.intervals or IntervalSettings()
    with ex._prepared_run("shift", model, calibration, test, plans, options, n_bins,
                         later_steps=len(conditions)) as run:
        fitted, fit_seconds, params = _fit_every_method(run, plans)
        scored = _score_shift(run, plans, fitted, conditions, corruption_seed, n_bins, intervals, examples)
    figures, reliability, draws, cache_hits, example_pixels, timing, tested = scored
    average, comparisons = _shift_summaries(plans, draws, conditions, corruptions, severities, intervals.level,
                                            figures, tested)
    info = getattr(model, "class_names", None)
    return ShiftResult(
        model=run.model_info, calibration=ex._split_info(calibration), test=ex._split_info(test),
        n_classes=int(run.ctx.test_z.shape[1]), class_names=list(info) if info is not None else None,
        n_bins=n_bins, seeds=list(options.seeds), fitter=options.nc.fitter, methods=[p.label for p in plans],
        corruptions=corruptions, severities=severities, figures=figures, average=average, reliability=reliability,
        params=params, fit_seconds=fit_seconds, comparisons=comparisons, cache_hits=cache_hits,
        settings={**ex._run_settings(options, run, model, intervals), "corruption_seed": corruption_seed},
        seconds=time.perf_counter() - t_start, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        calibrate_on=calibrate_on, examples=example_pixels,
        timing={"fitting": sum(map(sum, fit_seconds.values())), **timing},
    )


def _fit_every_method(run: Any, plans: Sequence[Any]) -> tuple[dict[str, list[Any]], dict[str, list[float]], dict]:
    """Every method fitted for each of its seeds, as a run fits it: the fitted calibrators, their fit
    seconds, and what the first seed learned (T, ‖δ‖), by row label."""
    from nctv import experiment as ex

    bar = run.ctx.progress
    fitted: dict[str, list[Any]] = {}
    fit_seconds: dict[str, list[float]] = {}
    params: dict[str, dict] = {}
    for p in plans:
        fitted[p.label], fit_seconds[p.label] = [], []
        for s in run.seeds[p.label]:
            bar.message(f"fitting {p.label} (seed {s})")
            m, sec = ex._fit_method(run.ctx, p, s)
            fitted[p.label].append(m)
            fit_seconds[p.label].append(sec)
            bar.step(f"{p.label} (seed {s}) fitted")
        params[p.label] = ex._learned_params(fitted[p.label][0])
    return fitted, fit_seconds, params


def _score_shift(run: Any, plans: Sequence[Any], fitted: dict[str, list[Any]], conditions: list,
                 corruption_seed: int, n_bins: int, intervals: Any, examples: int):
    """Every fitted method scored under every condition: points, intervals, the diagram's bins, and each
    method's calibration test per condition (``tested[method][condition]``)."""
    from nctv import experiment as ex
    from nctv.cache import split_logits
    from nctv.corruptions import corrupt_split
    from nctv.consistency import consistency_test
    from nctv.intervals import at_boundary, interval, method_draws, resample_counts_for, seed_counts, tested_p
    from nctv.metrics import evaluate, reliability_bins

    ctx = run.ctx
    opts = ctx.options
    # A run's resamples (nctv.experiment): keyed by the clean test pictures, the same under every condition.
    rows_key = ex._rows_key(ctx)
    counts = resample_counts_for(rows_key, intervals.resamples, intervals.seed)
    generator = torch.Generator().manual_seed(intervals.seed + 1)
    seed_draws = {p.label: seed_counts(len(fitted[p.label]), intervals.resamples, generator)
                  for p in plans if len(fitted[p.label]) > 1}
    figures: dict = {p.label: {} for p in plans}
    reliability: dict = {p.label: {} for p in plans}
    draws: dict = {p.label: {} for p in plans}
    tested: dict = {p.label: {} for p in plans}
    cache_hits, pixels = {}, {}
    # Where the time goes: corrupting the pictures, the model's passes (the unperturbed logits of each
    # corrupted split, and Neural Clamping's f(x + δ)), and the rest (logit-space maps, metrics, intervals).
    timing = dict.fromkeys(("corrupting", "unperturbed logits", "model-based methods", "scoring"), 0.0)
    model_based = {p.label for p in plans if ex._registry()[p.name].needs_model}
    # Example pictures spread over the test rows in their canonical order: the same pictures, shown in the
    # same order, for the test split in any order and on any machine.
    picked = (canonical_order(*rows_key)[np.linspace(0, len(ctx.test_y) - 1, examples).round().astype(int)]
              if examples else None)
    for corruption, severity in conditions:
        key = condition_key(corruption, severity)
        ctx.progress.message(f"scoring {key}")
        t0 = time.perf_counter()
        split = ctx.test if severity == 0 else corrupt_split(ctx.test, corruption, severity, corruption_seed)
        t1 = time.perf_counter()
        if severity == 0:
            z, cache_hits[key] = ctx.test_z, True
        else:
            got = split_logits(ctx.model, split, opts.cache_dir, opts.batch_size, ctx.device,
                               run.model_info["fingerprint"])
            z, cache_hits[key] = got.logits, got.hit
        timing["corrupting"] += t1 - t0
        timing["unperturbed logits"] += time.perf_counter() - t1
        if picked is not None:
            pixels[key] = [_png(split.image(int(i))) for i in picked]
        for p in plans:
            t0 = time.perf_counter()
            per_seed = [ex._calibrated(ctx, p, m, split, z).detach().float().cpu() for m in fitted[p.label]]
            timing["model-based methods" if p.label in model_based else "scoring"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            points = [evaluate(zz, ctx.test_y, n_bins=n_bins) for zz in per_seed]
            d = method_draws(per_seed, ctx.test_y, counts, n_bins, SHIFT_METRICS, seed_draws.get(p.label))
            draws[p.label][key] = d
            # As a run does (nctv.experiment): where the calibration test cannot reject "calibrated", the
            # errors' intervals reach 0, so that the clean row is the run's row exactly.
            test = tested[p.label][key] = consistency_test(per_seed, ctx.test_y, n_bins, intervals.resamples,
                                                           intervals.seed, key=rows_key[0])
            cell = {}
            for metric in points[0]:
                cell[metric] = {"value": float(np.mean([pt[metric] for pt in points])), "ci_low": None, "ci_high": None}
                if metric in d:
                    ci = interval(d[metric], metric, intervals.level)
                    ci = at_boundary(ci, tested_p(metric, test.p_top_label, test.p_classwise), intervals.level)
                    cell[metric]["ci_low"], cell[metric]["ci_high"] = ci.low, ci.high
            figures[p.label][key] = cell
            rb = reliability_bins(per_seed[0], ctx.test_y, n_bins)
            reliability[p.label][key] = {
                "count": rb.counts.astype(int).tolist(),
                "confidence": [None if c != c else float(c) for c in rb.confidence],
                "accuracy": [None if a != a else float(a) for a in rb.accuracy],
            }
            timing["scoring"] += time.perf_counter() - t0
        ctx.progress.step(f"{key} scored")
    examples_out = {"indices": picked.tolist(), "png": pixels} if examples else {}
    return figures, reliability, draws, cache_hits, examples_out, timing, tested


def _png(image: Any) -> str:
    """A picture as base64 PNG text (the app's examples of a corrupted split)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _shift_summaries(plans: Sequence[Any], draws: dict, conditions: list, corruptions: list[str],
                     severities: list[int], level: float, figures: dict, tested: dict):
    """The mean over corruptions per severity (its draws: the mean of the conditions' draws, which share
    their resamples) and the paired comparisons: every method against the condition's leader, and
    Neural Clamping against temperature scaling (grid search and NLL). Under a condition, a calibration
    error's pair is widened where a method's calibration test (``tested``) cannot reject "calibrated",
    as a run's is (``nctv.intervals.difference_at_boundary``, with each method's interval in ``figures``);
    a mean over corruptions has no test, and its pairs are left as they are."""
    from nctv.intervals import MethodDraws, difference, interval

    labels = [p.label for p in plans]
    average: dict = {m: {} for m in labels}
    for s in severities:
        key = f"{AVERAGE}/{s}"
        for m in labels:
            parts = [draws[m][condition_key(c, s)] for c in corruptions]
            draws[m][key] = {metric: MethodDraws(float(np.mean([p[metric].point for p in parts])),
                                                 float(np.mean([p[metric].estimate for p in parts])),
                                                 torch.stack([p[metric].draws for p in parts]).mean(0))
                             for metric in SHIFT_METRICS}
            average[m][key] = {}
            for metric, d in draws[m][key].items():
                ci = interval(d, metric, level)
                average[m][key][metric] = {"value": d.point, "ci_low": ci.low, "ci_high": ci.high}
    keys = [condition_key(c, s) for c, s in conditions] + [f"{AVERAGE}/{s}" for s in severities]
    comparisons = []
    for key in keys:
        for metric in SHIFT_METRICS:
            sign = -1.0 if HIGHER_IS_BETTER[metric] else 1.0
            leader = min(labels, key=lambda m: sign * draws[m][key][metric].point)
            pairs = [(m, leader, "leader") for m in labels if m != leader]
            if COMPARED_METHOD in labels:
                pairs += [(COMPARED_METHOD, r, "reference") for r in SHIFT_REFERENCES if r in labels]
            for a, b, role in pairs:
                dd = difference(draws[a][key][metric], draws[b][key][metric], level)
                if key in tested[a]:
                    dd = _at_boundary(dd, figures[a][key][metric], figures[b][key][metric], tested[a][key],
                                      tested[b][key], metric, level)
                comparisons.append(ShiftComparison(key, metric, a, b, role, dd.estimate, dd.low, dd.high))
    return average, comparisons


def _at_boundary(d: Any, a: dict, b: dict, test_a: Any, test_b: Any, metric: str, level: float) -> Any:
    """``d`` (the paired interval of a − b) after ``nctv.intervals.difference_at_boundary`` from the two
    methods' calibration tests and their cells ({"value", "ci_low", "ci_high"})."""
    from nctv.intervals import Interval, difference_at_boundary, tested_p

    own = lambda c: Interval(c["value"], c["ci_low"], c["ci_high"])  # noqa: E731
    return difference_at_boundary(d, own(a), own(b), tested_p(metric, test_a.p_top_label, test_a.p_classwise),
                                  tested_p(metric, test_b.p_top_label, test_b.p_classwise), level)


# --------------------------------------------------------------------------- verdicts


def signed_points(v: float) -> str:
    """A difference of fractions in signed percentage points, with a real minus sign: "−0.31"."""
    s = f"{v * 100:+.2f}"
    return "0.00" if s in ("+0.00", "-0.00") else s.replace("-", "−")


def verdict_text(c: ShiftComparison) -> str:
    """"Neural Clamping (FL) − TS by Grid Search: −0.31 [−0.75, +0.20] point, tied"."""
    return (f"{c.method} − {c.other}: {signed_points(c.difference)} [{signed_points(c.low)}, "
            f"{signed_points(c.high)}] point, {c.verdict}")


def summary_sentences(result: ShiftResult, method: str = COMPARED_METHOD,
                      references: Sequence[str] = SHIFT_REFERENCES) -> list[str]:
    """In words, per reference: under how many corrupted conditions ``method``'s ECE is lower, higher
    or tied (paired intervals), and the mean over corruptions at the strongest severity."""
    if method not in result.methods:
        return []
    out = []
    top = max(result.severities)
    keys = result.conditions[1:]
    for other in references:
        if other not in result.methods:
            continue
        found = [result.comparison(method, other, k) for k in keys]
        found = [c for c in found if c is not None]
        counts = {v: sum(c.verdict == v for c in found) for v in ("lower", "tied", "higher")}
        avg = result.comparison(method, other, f"{AVERAGE}/{top}")
        line = (f"{method} against {other}, test ECE under {len(found)} corrupted conditions: lower in "
                f"{counts['lower']}, tied in {counts['tied']}, higher in {counts['higher']} (95 % paired intervals)")
        if avg is not None:
            line += f"; mean over corruptions at severity {top}: {verdict_text(avg)}"
        out.append(line + ".")
    return out


# --------------------------------------------------------------------------- tables


def shift_table(result: ShiftResult, metric: str = "ece", include_average: bool = True):
    """One row per condition (clean, each corruption by severity, then the mean over corruptions per
    severity), one column per method: ``metric`` with its interval, and the uncalibrated accuracy.
    Bold: the condition's lowest value, or every leader tied with it (paired interval holds 0)."""
    from nctv.report import Cell, Column, Table, metric_column

    col = metric_column(metric, result.n_classes)
    acc = metric_column("accuracy", result.n_classes)
    reference = result.methods[0]
    columns = [Column("accuracy", f"Accuracy, {_short(reference)}", acc.unit, acc.scale, acc.decimals)]
    columns += [Column(m, f"{col.title}, {_short(m)}", col.unit, col.scale, col.decimals, col.higher_is_better)
                for m in result.methods]
    keys = result.conditions + ([f"{AVERAGE}/{s}" for s in result.severities] if include_average else [])
    rows, cells, rules = [], [], []
    for i, key in enumerate(keys):
        if key.endswith("/" + str(result.severities[0])) or key == CLEAN:
            rules.append(i)
        a = result.figure(reference, key, "accuracy")
        row = [_cell(a, acc.scale)]
        leaders = set(result.leaders(key, metric)) if col.higher_is_better is not None else set()
        for m in result.methods:
            cell = _cell(result.figure(m, key, metric), col.scale)
            cell.rank = 1 if m in leaders else None
            row.append(cell)
        rows.append(condition_title(key))
        cells.append(row)
    level = result.settings.get("intervals", {}).get("level", 0.95)
    notes = [
        f"Model {result.model.get('name')}; {result.n_bins} bins; calibrated on "
        f"{'the clean calibration split' if not result.calibrate_on else condition_title(result.calibrate_on)}; "
        f"{len(result.seeds)} seed(s); Neural Clamping fitter: {result.fitter}.",
        f"Brackets: {round(level * 100)} % interval from {result.settings.get('intervals', {}).get('resamples', '?')} "
        "resamples of the test images, shared by every method and condition (paired).",
    ]
    best = "highest" if col.higher_is_better else "lowest"
    legend = (f"Per row, the {best} {col.title} in {{bold}}, and every method tied with it (the paired interval of "
              "its difference to that one holds 0).")
    return Table(f"{col.title} under distribution shift", columns, rows, cells, notes, rules, result.n_bins,
                 "Condition", legend=legend)


def comparison_table(result: ShiftResult, method: str = COMPARED_METHOD, references: Sequence[str] = SHIFT_REFERENCES,
                     metric: str = "ece"):
    """Per condition, ``method`` − each reference: the paired difference with its interval, and the verdict."""
    from nctv.report import Cell, Column, Table, metric_column

    col = metric_column(metric, result.n_classes)
    refs = [r for r in references if r in result.methods]
    columns = []
    for r in refs:
        columns += [Column(f"diff:{r}", f"{col.title}, {_short(method)} − {_short(r)}", "pt" if col.unit == "%" else col.unit,
                           col.scale, col.decimals),
                    Column(f"verdict:{r}", "verdict")]
    keys = result.conditions + [f"{AVERAGE}/{s}" for s in result.severities]
    rows, cells = [], []
    for key in keys:
        row = []
        for r in refs:
            c = result.comparison(method, r, key, metric)
            if c is None:
                row += [Cell(text="–"), Cell(text="–")]
            else:
                row += [Cell(c.difference * col.scale, low=c.low * col.scale, high=c.high * col.scale),
                        Cell(text=c.verdict)]
        rows.append(condition_title(key))
        cells.append(row)
    notes = [f"Paired {col.title} differences of {method} against each reference; lower: the interval lies below 0, "
             "higher: above 0, tied: it holds 0.",
             "Under a condition where a method's calibration test cannot reject calibration, its error may be 0, so "
             "the difference's interval also reaches what the other's own interval allows (both consistent with "
             "calibrated: tied), as in a run's table."] + summary_sentences(result, method, refs)
    return Table(f"{method} against temperature scaling under shift", columns, rows, cells, notes, [], result.n_bins,
                 "Condition")


def _short(method: str) -> str:
    from nctv.methods import abbreviation

    return abbreviation(method)


def _cell(f: dict[str, float | None], scale: float):
    from nctv.report import Cell

    low, high = f.get("ci_low"), f.get("ci_high")
    return Cell(float(f["value"]) * scale, low=None if low is None else low * scale,
                high=None if high is None else high * scale)


def to_csv(result: ShiftResult) -> str:
    """One row per (condition, method), tidy: corruption ("none" when clean, "mean" for the mean over
    corruptions), severity, method, then every metric as a fraction with its interval where it has one."""
    import csv
    import io

    from nctv.report import repr_float

    metrics = list(next(iter(result.figures[result.methods[0]].values())))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    header = ["corruption", "severity", "method"]
    for m in metrics:
        header += [m] + ([f"{m} low", f"{m} high"] if m in SHIFT_METRICS else [])
    w.writerow(header)
    keys = result.conditions + [f"{AVERAGE}/{s}" for s in result.severities]
    for key in keys:
        corruption, severity = ("none", 0) if key == CLEAN else (key.rsplit("/", 1)[0], int(key.rsplit("/", 1)[1]))
        for method in result.methods:
            line = ["mean" if corruption == AVERAGE else corruption, severity, method]
            for m in metrics:
                if m not in SHIFT_METRICS and key.startswith(AVERAGE + "/"):
                    line.append("")
                    continue
                f = result.figure(method, key, m)
                line.append(repr_float(f["value"]))
                if m in SHIFT_METRICS:
                    line += [repr_float(f["ci_low"]), repr_float(f["ci_high"])]
            w.writerow(line)
    return buf.getvalue()


def write_tables(result: ShiftResult, directory: str | Path, style: str = "brackets") -> list[Path]:
    """``table.md``, ``table.tex`` and ``table.json``: ECE and accuracy under every condition, and Neural
    Clamping against temperature scaling; ``table.csv``: every figure, one row per condition and method."""
    from nctv.report import to_json, to_latex, to_markdown

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tables = [shift_table(result, "ece"), shift_table(result, "accuracy")]
    if COMPARED_METHOD in result.methods:
        tables.append(comparison_table(result))
    md = [f"# NCTV shift study: {result.model.get('name')}", ""] + [to_markdown(t, style) for t in tables]
    tex = ["% NCTV shift tables; needs \\usepackage{booktabs}", ""]
    tex += [to_latex(t, label=f"tab:nctv-shift-{i}", style=style) for i, t in enumerate(tables)]
    paths = {name: out / name for name in ("table.md", "table.csv", "table.tex", "table.json")}
    paths["table.md"].write_text("\n".join(md), encoding="utf-8")
    paths["table.csv"].write_text(to_csv(result), encoding="utf-8")
    paths["table.tex"].write_text("\n".join(tex), encoding="utf-8")
    paths["table.json"].write_text(to_json(tables), encoding="utf-8")
    return list(paths.values())
