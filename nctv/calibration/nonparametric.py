"""Histogram binning and isotonic regression: calibrators of probabilities, one class at a time.

Both calibrate the softmax probabilities p = softmax(z) one-vs-rest: for each class k the scores
p_k(x) are mapped through a non-decreasing step (binning) or piecewise-linear (isotonic) function
fitted to the indicator 1[y = k] on the calibration split, and each row is then renormalised to
sum to 1. A binary problem (K = 2) fits one function, to the positive class (k = 1), and gives the
other class the complement, as the reference implementations do.

* :class:`HistogramBinning` (Zadrozny & Elkan 2001): ``n_bins`` equal-mass bins per class, edges
  e_0 = 0 < … ≤ e_B = 1 (B = ``n_bins``); a bin's value is the share of its calibration samples whose
  label is the class (an empty bin: its midpoint, (e_{m−1} + e_m) / 2). Two conventions, where the
  implementations in use differ (both are settings; the defaults are NCTV's own):

  - ``edges``, where the inner edges lie: ``"quantile"`` (default; netcal's) the linearly
    interpolated quantiles of the class's calibration scores at m / B (``np.quantile``'s default);
    ``"midpoint"`` (Kumar, Liang & Ma's ``calibration`` package) the sorted scores split into B
    runs of consecutive ones whose lengths differ by at most one, the longer runs first
    (``np.array_split``), each inner edge halfway between the last score of one run and the first
    of the next (with fewer scores than bins, one run a score and the edges left over at 1).
  - ``on_edge``, which bin a score equal to an edge joins: ``"below"`` (default; Kumar et al.'s, and
    the ECE's bins) bins (e_{m−1}, e_m], a score of 0 in the first; ``"above"`` (netcal's fit, by
    scipy's ``binned_statistic_dd``) bins [e_{m−1}, e_m), a score of 1 in the last. Quantile edges
    at whole positions, (N − 1)·m / B, are calibration scores themselves, so the two differ there.
* :class:`IsotonicRegression` (Zadrozny & Elkan 2002): the least-squares non-decreasing fit
  (pool-adjacent-violators), interpolated linearly between the fitted scores and held constant beyond
  them, as scikit-learn's ``IsotonicRegression(out_of_bounds="clip")``. Scores closer than float64's
  resolution (10⁻¹⁵) are pooled first into one, at the group's first score, as scikit-learn pools
  them: a group opens at a score 10⁻¹⁵ or more above the first score of the group before. Such scores
  are the same probability computed with round-off (a row of logits and the same values in another
  order give probabilities one unit in the last place apart), not two probabilities; fitted apart,
  two knots 10⁻¹⁶ apart can hold different values and the map jumps between them.

As logit calibrators, ``transform`` returns the log of the calibrated probabilities (log-softmax of
them is themselves). A class may be given probability 0 (a bin or a stretch of scores with no
sample of it), and a row may be all zeros: each calibrated value is first raised to
``PROBABILITY_FLOOR`` (1e-12), then the row renormalised (for K = 2: the positive class's value is
held within [1e-12, 1 − 1e-12]). The floor moves no probability by more than K·1e-12 and keeps
every log finite: a label given probability 0 costs −log(1e-12) ≈ 27.6 nats in the NLL.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nctv.calibration.base import HeadCalibrator, calibration_rows, saved_class_count
from nctv.checks import check_whole_range, shown
from nctv.metrics import bin_index, equal_mass_edges

#: The least calibrated probability a class is given before renormalising (see the module notes).
PROBABILITY_FLOOR = 1e-12
#: Most bins a histogram binning takes: far beyond any calibration split's use.
MAX_BINS = 100_000
#: Where histogram binning's inner edges lie, and which bin a score on an edge joins (module notes).
EDGE_RULES = ("quantile", "midpoint")
ON_EDGE = ("below", "above")


def _scores(z: torch.Tensor) -> torch.Tensor:
    """The scores calibrated one-vs-rest, (N, R): every class's probability, or the positive class's for K = 2."""
    p = torch.softmax(z.to(torch.float64), dim=1)
    return p[:, 1:] if p.shape[1] == 2 else p


def _calibrated_log_probabilities(values: torch.Tensor, classes: int) -> torch.Tensor:
    """Log of the renormalised probabilities from the per-class calibrated values (N, R), floored."""
    if classes == 2:
        q1 = values[:, 0].clamp(PROBABILITY_FLOOR, 1.0 - PROBABILITY_FLOOR)
        return torch.stack([torch.log1p(-q1), torch.log(q1)], dim=1)
    q = values.clamp_min(PROBABILITY_FLOOR)
    return torch.log(q) - torch.log(q.sum(dim=1, keepdim=True))


def _rows(classes: int) -> int:
    return 1 if classes == 2 else classes


def _check_unit_rows(name: str, t: Any, increasing: bool) -> None:
    """Values within [0, 1], and non-decreasing along each row when ``increasing``."""
    t = torch.as_tensor(t)
    if bool(((t < 0) | (t > 1)).any()):
        raise ValueError(f"The calibrator's {name} holds values outside [0, 1]; no fit makes them. Fit and save "
                         "it again.")
    if increasing and t.shape[-1] > 1 and bool((t[..., 1:] < t[..., :-1]).any()):
        raise ValueError(f"The calibrator's {name} must be non-decreasing along each class; it is not. Fit and "
                         "save it again.")


# --------------------------------------------------------------------------------------------
# Histogram binning
# --------------------------------------------------------------------------------------------


class BinningHead(torch.nn.Module):
    """Log of the renormalised bin values of each class's softmax probability (float64, returned float32)."""

    def __init__(self, edges: torch.Tensor, values: torch.Tensor, classes: int, on_edge: str = "below"):
        super().__init__()
        self.classes = int(classes)
        self.above = on_edge == "above"
        self.register_buffer("edges", torch.as_tensor(edges, dtype=torch.float64).clone())
        self.register_buffer("values", torch.as_tensor(values, dtype=torch.float64).clone())

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        s = _scores(logits).T.contiguous()  # (R, N)
        n_bins = self.values.shape[1]
        # below, (e_{m−1}, e_m]: the first edge >= s closes s's bin; above, [e_{m−1}, e_m): the last edge
        # <= s opens it. Clamped: a score of 0 (below) goes to the first bin, a score of 1 (above) to the last.
        idx = (torch.searchsorted(self.edges.contiguous(), s, right=self.above) - 1).clamp(0, n_bins - 1)
        return _calibrated_log_probabilities(self.values.gather(1, idx).T, self.classes).to(torch.float32)


def histogram_edges(scores: np.ndarray, n_bins: int, rule: str = "quantile") -> np.ndarray:
    """``n_bins`` + 1 non-decreasing edges of equal-mass bins of ``scores``, the outer ones 0 and 1:
    at the linearly interpolated quantiles (``rule="quantile"``) or halfway between runs of sorted
    scores (``"midpoint"``, AECE's bins: :func:`nctv.metrics.equal_mass_edges`; module notes)."""
    if rule == "midpoint":
        return equal_mass_edges(scores, n_bins)
    edges = np.quantile(scores, np.linspace(0.0, 1.0, n_bins + 1))
    edges[0], edges[-1] = 0.0, 1.0
    return np.maximum.accumulate(edges)


def _check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {shown(value)}.")
    return value


class HistogramBinning(HeadCalibrator):
    """Histogram binning, one-vs-rest, ``n_bins`` equal-mass bins per class (module notes).

    ``edges``: ``"quantile"`` (default) or ``"midpoint"``, where the inner edges lie; ``on_edge``:
    ``"below"`` (default) or ``"above"``, which bin a score equal to an edge joins. netcal's
    ``HistogramBinning(equal_intervals=False)`` fits ``edges="quantile", on_edge="above"``; Kumar et
    al.'s ``HistogramMarginalCalibrator`` ``edges="midpoint", on_edge="below"``.

    Learned: ``bin_edges_`` (R, n_bins + 1) and ``bin_values_`` (R, n_bins), float64 tensors, one row
    per calibrated class (R = K, or 1 for K = 2: the positive class), and ``n_classes_`` (K).
    """

    def __init__(self, n_bins: int = 15, edges: str = "quantile", on_edge: str = "below"):
        self.n_bins = n_bins
        self.edges = edges
        self.on_edge = on_edge

    def fit(self, logits: Any, labels: Any) -> "HistogramBinning":
        n_bins = check_whole_range(self.n_bins, "n_bins", 1, MAX_BINS)
        rule = _check_choice(self.edges, "edges", EDGE_RULES)
        on_edge = _check_choice(self.on_edge, "on_edge", ON_EDGE)
        z, y = calibration_rows(logits, labels)
        k = z.shape[1]
        scores = _scores(z).cpu().numpy()
        targets = _targets(y.cpu().numpy(), k)
        edges, values = np.empty((scores.shape[1], n_bins + 1)), np.empty((scores.shape[1], n_bins))
        for r in range(scores.shape[1]):
            e = histogram_edges(scores[:, r], n_bins, rule)
            idx = bin_index(e, scores[:, r], on_edge)
            count = np.bincount(idx, minlength=n_bins)
            hits = np.bincount(idx, weights=targets[:, r], minlength=n_bins)
            middle = 0.5 * (e[:-1] + e[1:])
            edges[r], values[r] = e, np.where(count > 0, hits / np.maximum(count, 1), middle)
        self.bin_edges_ = torch.from_numpy(edges)
        self.bin_values_ = torch.from_numpy(values)
        self.n_classes_ = int(k)
        return self

    def as_module(self) -> torch.nn.Module:
        self._check_fitted("bin_edges_", "bin_values_", "n_classes_")
        on_edge = _check_choice(self.on_edge, "on_edge", ON_EDGE)
        return BinningHead(self.bin_edges_, self.bin_values_, self.n_classes_, on_edge)

    @classmethod
    def saved_shapes(cls, params: dict, fitted: dict, classes: int | None) -> dict[str, list[int]]:
        rows = _rows(saved_class_count(fitted, classes))
        n_bins = check_whole_range(params.get("n_bins"), "The calibrator's n_bins", 1, MAX_BINS)
        # A file saved before these settings existed has neither: it was fitted with the defaults.
        _check_choice(params.get("edges", "quantile"), "The calibrator's edges", EDGE_RULES)
        _check_choice(params.get("on_edge", "below"), "The calibrator's on_edge", ON_EDGE)
        return {"bin_edges_": [rows, n_bins + 1], "bin_values_": [rows, n_bins]}

    @classmethod
    def check_saved(cls, fitted: dict) -> None:
        _check_unit_rows("bin_edges_", fitted["bin_edges_"], increasing=True)
        _check_unit_rows("bin_values_", fitted["bin_values_"], increasing=False)


def _targets(y: np.ndarray, k: int) -> np.ndarray:
    """1[y = k] for each calibrated class, (N, R)."""
    onehot = np.zeros((len(y), k))
    onehot[np.arange(len(y)), y] = 1.0
    return onehot[:, 1:] if k == 2 else onehot


# --------------------------------------------------------------------------------------------
# Isotonic regression
# --------------------------------------------------------------------------------------------


#: Scores less than this above the first score of their group are one score: float64's resolution
#: (10⁻¹⁵), the rule of scikit-learn's ``IsotonicRegression`` (module notes).
RESOLUTION = float(np.finfo(np.float64).resolution)


def resolution_groups(xs: np.ndarray) -> np.ndarray:
    """Whether each of the sorted distinct scores ``xs`` opens a group: the first does, and so does each
    score ``RESOLUTION`` or more above the first score of the group before it (the rest join that group).

    Only a score within ``RESOLUTION`` of its neighbour can join a group, so the walk visits those alone."""
    opens = np.ones(len(xs), dtype=bool)
    first = 0
    for j in np.flatnonzero(np.diff(xs) < RESOLUTION) + 1:
        if opens[j - 1]:
            first = j - 1
        opens[j] = xs[j] - xs[first] >= RESOLUTION
    return opens


def isotonic_fit(x: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The least-squares non-decreasing fit of targets ``t`` on scores ``x``: (pooled scores, fitted values).

    Scores closer than float64's resolution are pooled first (:func:`resolution_groups`; the group is
    at its first score), equal ones among them, their targets averaged, weighted by count; then
    pool-adjacent-violators merges neighbouring blocks while a block's mean exceeds the next one's.
    """
    xs, inverse, count = np.unique(x, return_inverse=True, return_counts=True)
    opens = resolution_groups(xs)
    group = np.cumsum(opens) - 1
    xs, inverse = xs[opens], group[inverse]
    count = np.bincount(inverse, minlength=len(xs))
    sums = np.bincount(inverse, weights=t, minlength=len(xs))
    # Blocks on a stack: (sum of targets, weight, index of the block's first unique score).
    b_sum, b_weight, b_start = [], [], []
    for i in range(len(xs)):
        s, w, start = float(sums[i]), float(count[i]), i
        while b_sum and b_sum[-1] * w >= s * b_weight[-1]:  # previous mean >= this mean: pool
            s, w, start = s + b_sum.pop(), w + b_weight.pop(), b_start.pop()
        b_sum.append(s)
        b_weight.append(w)
        b_start.append(start)
    fitted = np.empty(len(xs))
    ends = b_start[1:] + [len(xs)]
    for s, w, a, b in zip(b_sum, b_weight, b_start, ends):
        fitted[a:b] = s / w
    return xs, fitted


def _knots(xs: np.ndarray, fitted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first and last point of every run of equal fitted values: the same linear interpolation."""
    keep = np.ones(len(xs), dtype=bool)
    if len(xs) > 2:
        same_before = fitted[1:-1] == fitted[:-2]
        same_after = fitted[1:-1] == fitted[2:]
        keep[1:-1] = ~(same_before & same_after)
    return xs[keep], fitted[keep]


class InterpolationHead(torch.nn.Module):
    """Log of the renormalised piecewise-linear maps of each class's softmax probability (float64 in, float32 out)."""

    def __init__(self, thresholds: torch.Tensor, values: torch.Tensor, classes: int):
        super().__init__()
        self.classes = int(classes)
        self.register_buffer("thresholds", torch.as_tensor(thresholds, dtype=torch.float64).clone())
        self.register_buffer("values", torch.as_tensor(values, dtype=torch.float64).clone())

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        s = _scores(logits).T.contiguous()  # (R, N)
        x, v = self.thresholds, self.values
        j = torch.searchsorted(x.contiguous(), s, side="right").clamp(1, x.shape[1] - 1)
        x0, x1, v0, v1 = x.gather(1, j - 1), x.gather(1, j), v.gather(1, j - 1), v.gather(1, j)
        width = x1 - x0
        share = torch.where(width > 0, (s - x0) / torch.where(width > 0, width, torch.ones_like(width)),
                            torch.zeros_like(s)).clamp(0.0, 1.0)
        return _calibrated_log_probabilities((v0 + share * (v1 - v0)).T, self.classes).to(torch.float32)


class IsotonicRegression(HeadCalibrator):
    """Isotonic regression, one-vs-rest, renormalised (module notes).

    Learned: ``thresholds_`` and ``values_`` (R, M) float64 tensors, the knots of each calibrated
    class's piecewise-linear map (R = K, or 1 for K = 2; a class with fewer than M knots repeats its
    last one), and ``n_classes_`` (K).
    """

    def fit(self, logits: Any, labels: Any) -> "IsotonicRegression":
        z, y = calibration_rows(logits, labels)
        k = z.shape[1]
        scores = _scores(z).cpu().numpy()
        targets = _targets(y.cpu().numpy(), k)
        knots = [_knots(*isotonic_fit(scores[:, r], targets[:, r])) for r in range(scores.shape[1])]
        m = max(2, max(len(x) for x, _ in knots))
        thresholds, values = np.empty((len(knots), m)), np.empty((len(knots), m))
        for r, (x, v) in enumerate(knots):
            thresholds[r] = np.concatenate([x, np.full(m - len(x), x[-1])])
            values[r] = np.concatenate([v, np.full(m - len(v), v[-1])])
        self.thresholds_ = torch.from_numpy(thresholds)
        self.values_ = torch.from_numpy(values)
        self.n_classes_ = int(k)
        return self

    def as_module(self) -> torch.nn.Module:
        self._check_fitted("thresholds_", "values_", "n_classes_")
        return InterpolationHead(self.thresholds_, self.values_, self.n_classes_)

    @classmethod
    def saved_shapes(cls, params: dict, fitted: dict, classes: int | None) -> dict[str, list[int]]:
        rows = _rows(saved_class_count(fitted, classes))
        # M, the knots a class has: any count >= 2, the same for both tensors (the header gives it).
        return {"thresholds_": [rows, None], "values_": [rows, None]}

    @classmethod
    def check_saved(cls, fitted: dict) -> None:
        if fitted["thresholds_"].shape != fitted["values_"].shape or fitted["thresholds_"].shape[1] < 2:
            raise ValueError("The calibrator's thresholds_ and values_ must have the same shape, with at least 2 "
                             "knots a class; save the calibrator again.")
        _check_unit_rows("thresholds_", fitted["thresholds_"], increasing=True)
        _check_unit_rows("values_", fitted["values_"], increasing=True)
