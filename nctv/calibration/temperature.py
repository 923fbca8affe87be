"""Temperature scaling in three flavours: NLL-optimal, ECE grid search, focal loss.

Each maps logits ``z`` (N, K) to ``z / T`` with one scalar temperature T > 0, learned on the
calibration split; predictions never change, only confidences. Inputs are logits, never
probabilities; every fit computes in float64; ``transform`` returns float32 logits on the input's
device. Losses are means over samples, in nats.

* :class:`TemperatureScaling` minimises the mean NLL and :class:`FocalTemperatureScaling` the mean
  focal loss FL_γ = −(1 − p_y)^γ·log p_y (γ = 0 is the NLL). Both, and Neural Clamping's temperature
  step on fixed logits, call one solver, :func:`solve_log_temperature`: safeguarded Newton in
  s = log T inside a bracket, to float64 precision (docs/method.md, "Baselines").
* :class:`GridSearchTemperature` takes T from the grid 0.001, 0.002, …, 5.000 with the lowest
  calibration-set ECE (15 equal-width bins), ties to the lowest T. The answer is exactly
  that of a loop calling :func:`nctv.metrics.ece` on ``z / T`` for every T (z in float64); the work
  is not: temperatures are evaluated vectorised in chunks, and a branch and bound (confidences fall
  monotonically with T, which bounds the ECE between two evaluated temperatures) skips the
  intervals of the grid that provably cannot hold the minimum.

TS and TS (FL) search T within [1e-3, 1e3]; if the loss still decreases at a bound (the
calibration logits separate the labels perfectly, or carry no information about them), that bound
is returned with a warning.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

import nctv.metrics as metrics
from nctv.calibration.base import Calibrator, calibration_rows
from nctv.calibration.deploy import TemperatureHead
from nctv.checks import T_MAX, T_MIN, check_bins, check_logits, check_gamma, check_positive
from nctv.memory import check_cancelled
# The temperature solve (TS, TS (FL), Neural Clamping's T step), shared with the metrics' NLL split.
from nctv.temperature_solve import LOG_T_BOUNDS, _focal_in_log_t, solve_log_temperature  # noqa: F401

# Working-set size of one grid-search block, in float64 elements: 4 MiB stays in a CPU's cache
# (larger blocks run several times slower there); accelerators prefer fewer, larger launches.
_CHUNK_ELEMENTS = {"cpu": 1 << 19}
_CHUNK_ELEMENTS_ACCELERATOR = 1 << 24
# Grid points whose vectorised ECE lies this close to the minimum are re-evaluated with
# nctv.metrics.ece itself, so that float rounding cannot change which T wins.
_RECHECK_TOL = 1e-9
_MAX_RECHECK = 32


def _scaled(logits: Any, temperature: float) -> torch.Tensor:
    z = check_logits(logits)
    return (z.to(torch.float64) / temperature).to(torch.float32)


def _warn_bound(name: str, temperature: float) -> None:
    warnings.warn(
        f"{name}: the loss keeps decreasing towards T = {temperature:g}, the end of the search range "
        f"[{T_MIN:g}, {T_MAX:g}]; the calibration logits separate the labels perfectly (T → 0) or carry "
        "no information about them (T → ∞). Check the calibration split.",
        stacklevel=4,
    )


def _fit_temperature(logits: Any, labels: Any, gamma: float, name: str) -> float:
    z, y = calibration_rows(logits, labels)
    s, at_bound = solve_log_temperature(z.to(torch.float64), y, gamma)
    if at_bound:
        t = T_MIN if s < 0 else T_MAX
        _warn_bound(name, t)
        return t
    return math.exp(s)


def fit_nll_temperature(logits: Any, labels: Any) -> float:
    """The temperature minimising the mean NLL of softmax(z / T), to float64 precision."""
    return _fit_temperature(logits, labels, 0.0, "TemperatureScaling")


def fit_focal_temperature(logits: Any, labels: Any, gamma: float = 1.0) -> float:
    """The temperature minimising the mean focal loss FL_γ of softmax(z / T), to float64 precision."""
    return _fit_temperature(logits, labels, check_gamma(gamma), "FocalTemperatureScaling")


# --------------------------------------------------------------------------------------------
# NLL
# --------------------------------------------------------------------------------------------


class _Temperature(Calibrator):
    """The map shared by the three flavours: z / T with the fitted ``temperature_``."""

    def transform(self, logits: Any) -> torch.Tensor:
        """Calibrated logits z / T (float32, on the device of ``logits``)."""
        self._check_fitted("temperature_")
        return _scaled(logits, self.temperature_)

    def as_module(self) -> torch.nn.Module:
        self._check_fitted("temperature_")
        return TemperatureHead(self.temperature_)


class TemperatureScaling(_Temperature):
    """Temperature scaling (Guo et al. 2017): z / T with T minimising the calibration-set mean NLL.

    Learned: ``temperature_`` (float).
    """

    def fit(self, logits: Any, labels: Any) -> "TemperatureScaling":
        self.temperature_ = fit_nll_temperature(logits, labels)
        return self


# --------------------------------------------------------------------------------------------
# ECE grid search
# --------------------------------------------------------------------------------------------


def temperature_grid(step: float = 0.001, t_max: float = 5.0) -> np.ndarray:
    """The grid step, 2·step, …, up to t_max, built as whole multiples of the step (no drift)."""
    step = check_positive(step, "grid_step")
    t_max = check_positive(t_max, "t_max")
    count = int(math.floor(t_max / step * (1 + 1e-12)))
    if count < 1:
        raise ValueError(f"t_max = {t_max:g} is below grid_step = {step:g}; the grid would be empty.")
    return np.arange(1, count + 1, dtype=np.float64) * step


def _bin_counts(n_bins: Any) -> tuple[int, ...]:
    """One bin count or several, each checked; duplicates are kept out."""
    counts = list(n_bins) if isinstance(n_bins, (list, tuple, np.ndarray)) else [n_bins]
    if not counts:
        raise ValueError("n_bins is empty; give a bin count such as 15, or several such as (10, 15, 20).")
    return tuple(dict.fromkeys(check_bins(m) for m in counts))


def _check_grid(grid: Any) -> np.ndarray:
    g = np.asarray(grid.cpu() if isinstance(grid, torch.Tensor) else grid, dtype=np.float64)
    if g.ndim != 1 or g.size == 0:
        raise ValueError(f"grid must be a non-empty 1-D list of temperatures; got shape {g.shape}.")
    if not np.all(np.isfinite(g)) or not np.all(g > 0):
        raise ValueError("grid temperatures must be finite and greater than 0.")
    return g


class _GridProblem:
    """Calibration error of softmax(z / T) at chosen temperatures, for the grid search (float64).

    The criterion is the ECE with ``n_bins`` equal-width bins, or, for several bin counts, the mean of
    their ECEs (a multi-resolution ECE, less sensitive to where one set of bin edges happens to fall).
    """

    def __init__(self, z: torch.Tensor, y: torch.Tensor, n_bins: tuple[int, ...], chunk_size: int | None):
        n, k = z.shape
        self.n, self.device = n, z.device
        budget = _CHUNK_ELEMENTS.get(z.device.type, _CHUNK_ELEMENTS_ACCELERATOR)
        if chunk_size is None:
            chunk_size = max(1, budget // (n * k))
        elif isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a whole number >= 1; got {chunk_size!r}.")
        self.chunk_size = int(chunk_size)
        self.rows = n if n * k * chunk_size <= budget else max(1, budget // (k * chunk_size))
        self.z64 = z.to(torch.float64)
        self.d = self.z64 - self.z64.max(1, keepdim=True)[0]
        self.correct = (torch.argmax(self.z64, dim=1) == y).to(torch.float64)
        self.binnings = [(m, metrics.bin_edges(m).to(z.device)) for m in n_bins]

    def confidences(self, t: torch.Tensor) -> torch.Tensor:
        """(len(t), N) confidences 1 / Σ_k exp((z_k − max z)/T); one chunk of temperatures."""
        conf = torch.empty(len(t), self.n, dtype=torch.float64, device=self.device)
        for r0 in range(0, self.n, self.rows):
            e = torch.div(self.d[None, r0 : r0 + self.rows], t[:, None, None]).exp_()
            conf[:, r0 : r0 + self.rows] = e.sum(2).reciprocal_()
        return conf

    @staticmethod
    def bins(conf: torch.Tensor, n_bins: int, edges: torch.Tensor) -> torch.Tensor:
        # Same bin rule as nctv.metrics: edges[m] < c <= edges[m+1], c = 0 in the first bin.
        return (torch.searchsorted(edges, conf) - 1).clamp_(0, n_bins - 1)

    def _bin_sums(self, idx: torch.Tensor, values: torch.Tensor, n_bins: int) -> torch.Tensor:
        rows = idx.shape[0]
        key = (idx + n_bins * torch.arange(rows, device=self.device)[:, None]).flatten()
        return torch.bincount(key, weights=values.flatten(), minlength=rows * n_bins).view(rows, n_bins)

    def eces(self, conf: torch.Tensor) -> torch.Tensor:
        """The criterion for every row of confidences: mean over the binnings of Σ_m |Σ_{i∈B_m} (c_i − acc_i)| / N."""
        gap = conf - self.correct
        total = sum(self._bin_sums(self.bins(conf, m, e), gap, m).abs_().sum(1) for m, e in self.binnings)
        return total / (self.n * len(self.binnings))

    def lower_bounds(self, hot: torch.Tensor, cold: torch.Tensor) -> torch.Tensor:
        """A lower bound on the criterion at every T between two temperatures T_lo < T_hi.

        ``hot`` holds the confidences at T_lo and ``cold`` those at T_hi, one interval per row.
        A sample's confidence falls as T rises, so between the two it stays within [cold, hot] and
        its bin between their bins. Samples in the same bin at both ends stay in that bin: the bin's
        sum of (c − acc) over them lies between its values at the two ends, and is at least the
        distance of that range from 0. Each other sample sits in some bin and can move that bin's
        |sum| by at most max |c − acc| over the range, which is subtracted. A mean over binnings is
        bounded by the mean of their bounds.
        """
        gap_hot, gap_cold = hot - self.correct, cold - self.correct
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        total = 0
        for m, edges in self.binnings:
            b_hot, b_cold = self.bins(hot, m, edges), self.bins(cold, m, edges)
            fixed = b_hot == b_cold
            upper = self._bin_sums(b_hot, torch.where(fixed, gap_hot, zero), m)
            lower = self._bin_sums(b_hot, torch.where(fixed, gap_cold, zero), m)
            distance = torch.where(lower > 0, lower, torch.where(upper < 0, -upper, zero)).sum(1)
            slack = torch.where(fixed, zero, torch.maximum(gap_hot.abs(), gap_cold.abs())).sum(1)
            total = total + (distance - slack)
        return total / (self.n * len(self.binnings))


def _evaluate(problem: _GridProblem, t_all: torch.Tensor, points: list[int], eces: np.ndarray,
              keep: dict[int, torch.Tensor] | None = None, bar=None) -> None:
    """ECE at the grid ``points`` into ``eces``, a chunk of temperatures at a time; the confidences
    go into ``keep`` (by grid index) when given. Each chunk first checks for cancellation (the
    app's Stop): with many classes the whole grid takes seconds."""
    step = problem.chunk_size
    for c0 in range(0, len(points), step):
        check_cancelled()
        chunk = points[c0 : c0 + step]
        conf = problem.confidences(t_all[chunk])
        eces[chunk] = problem.eces(conf).cpu().numpy()
        if keep is not None:
            keep.update(zip(chunk, conf))
        if bar is not None:
            bar.update(len(chunk))


def _all_eces(problem: _GridProblem, temps: np.ndarray, progress: bool) -> np.ndarray:
    eces = np.empty(len(temps))
    with tqdm(total=len(temps), desc="TS grid search", disable=not progress) as bar:
        _evaluate(problem, torch.as_tensor(temps, device=problem.device), list(range(len(temps))), eces, bar=bar)
    return eces


def _bounded_eces(problem: _GridProblem, temps: np.ndarray, progress: bool, first_step: int = 128) -> np.ndarray:
    """ECE at the grid points that can hold the minimum; NaN at those proven not to (see below).

    Branch and bound over intervals of the (increasing) grid: evaluate a coarse subset, bound the
    ECE inside every interval between two evaluated neighbours (:meth:`_GridProblem.lower_bounds`),
    drop intervals whose bound exceeds the best ECE found so far (with a margin of 1e-9 against
    rounding), bisect the rest, and repeat until no interval has an unevaluated point left. A
    dropped point's ECE is provably above the minimum, so the winner is that of the full search.
    """
    n_grid = len(temps)
    t_all = torch.as_tensor(temps, device=problem.device)
    eces = np.full(n_grid, np.nan)
    conf: dict[int, torch.Tensor] = {}

    points = sorted(set(range(0, n_grid, first_step)) | {n_grid - 1})
    bar = tqdm(total=n_grid, desc="TS grid search", disable=not progress)
    _evaluate(problem, t_all, points, eces, conf, bar)
    intervals = [(a, c) for a, c in zip(points[:-1], points[1:]) if c - a > 1]
    while intervals:
        best = float(np.nanmin(eces))
        bounds = []
        for i0 in range(0, len(intervals), problem.chunk_size):
            part = intervals[i0 : i0 + problem.chunk_size]
            hot = torch.stack([conf[a] for a, _ in part])
            cold = torch.stack([conf[c] for _, c in part])
            bounds.append(problem.lower_bounds(hot, cold).cpu().numpy())
        keep = [iv for iv, lb in zip(intervals, np.concatenate(bounds)) if lb <= best + _RECHECK_TOL]
        bar.update(sum(c - a - 1 for a, c in intervals) - sum(c - a - 1 for a, c in keep))
        mids = [(a + c) // 2 for a, c in keep]
        _evaluate(problem, t_all, mids, eces, conf, bar)
        intervals = [iv for (a, c), m in zip(keep, mids) for iv in ((a, m), (m, c)) if iv[1] - iv[0] > 1]
        live = {i for iv in intervals for i in iv}
        for i in [i for i in conf if i not in live]:
            del conf[i]
    bar.close()
    return eces


def grid_search_temperature(
    logits: Any,
    labels: Any,
    grid: Any = None,
    n_bins: int | Sequence[int] = 15,
    chunk_size: int | None = None,
    progress: bool = False,
    full_curve: bool = False,
) -> tuple[float, np.ndarray]:
    """The T of ``grid`` with the lowest ECE of softmax(z / T), and the ECE per grid point.

    ``grid`` defaults to 0.001, 0.002, …, 5.000. ECE uses ``n_bins`` equal-width bins exactly as
    :func:`nctv.metrics.ece`, with z in float64; several bin counts (e.g. ``(10, 15, 20)``) make the
    criterion the mean of their ECEs. Ties go to the lowest T. Returns ``(best_T, eces)`` with
    ``eces`` a float64 numpy array (the criterion) aligned with ``grid``.

    The confidence of a sample is 1 / Σ_k exp((z_k − max z)/T) and its correctness does not depend
    on T, so a temperature costs one exp per logit and two bin counts; temperatures are evaluated
    together in chunks of ``chunk_size`` (default: as many as fit a 4 MiB working set on a CPU; the
    samples are split too when one temperature alone exceeds it).

    The search is exhaustive in its answer but not in its work: with ``full_curve=False`` (the
    default) and an increasing grid, a branch and bound evaluates a coarse subset of the grid and
    then only the intervals whose lower bound on the ECE (confidences fall monotonically with T)
    does not exceed the best ECE found; ``eces`` is NaN at the points it proved cannot win. With
    ``full_curve=True`` (or a grid that is not increasing) every grid point is evaluated.
    Either way, grid points within 1e-9 of the smallest ECE are re-evaluated with
    :func:`nctv.metrics.ece` (their entries in ``eces`` become those values), so float rounding cannot
    change the winner: the answer is that of a loop calling :func:`nctv.metrics.ece` on ``z / T``
    for every T.
    """
    z, y = calibration_rows(logits, labels)
    bin_counts = _bin_counts(n_bins)
    temps = temperature_grid() if grid is None else _check_grid(grid)
    problem = _GridProblem(z, y, bin_counts, chunk_size)
    if full_curve or len(temps) < 3 or not np.all(np.diff(temps) > 0):
        eces = _all_eces(problem, temps, progress)
    else:
        eces = _bounded_eces(problem, temps, progress)

    done = np.flatnonzero(~np.isnan(eces))
    order = done[np.lexsort((temps[done], eces[done]))]  # by ECE, then by T
    near = order[eces[order] <= eces[order[0]] + _RECHECK_TOL][:_MAX_RECHECK]
    z_cpu, y_cpu = problem.z64.cpu(), y.cpu()
    for i in near:
        eces[i] = float(np.mean([metrics.ece(z_cpu / temps[i], y_cpu, m) for m in bin_counts]))
    best = min(near, key=lambda i: (eces[i], temps[i]))
    return float(temps[best]), eces


class GridSearchTemperature(_Temperature):
    """TS by grid search: z / T with T in {step, 2·step, …, t_max} minimising calibration-set ECE.

    Defaults follow the paper: step 0.001, t_max 5.0 (5000 temperatures), 15 bins. Learned:
    ``temperature_`` (float), ``grid_`` (the temperatures) and ``ece_grid_`` (calibration ECE per
    temperature, fractions; NaN where the branch and bound proved a temperature cannot win, unless
    ``full_curve=True`` asks for every value), both numpy float64 arrays. The chosen T is the same
    either way. See :func:`grid_search_temperature`.
    """

    def __init__(self, grid_step: float = 0.001, t_max: float = 5.0, n_bins: int = 15, progress: bool = False,
                 full_curve: bool = False):
        self.grid_step = grid_step
        self.t_max = t_max
        self.n_bins = n_bins
        self.progress = progress
        self.full_curve = full_curve

    def fit(self, logits: Any, labels: Any) -> "GridSearchTemperature":
        grid = temperature_grid(self.grid_step, self.t_max)
        t, eces = grid_search_temperature(logits, labels, grid, self.n_bins, progress=self.progress,
                                          full_curve=bool(self.full_curve))
        self.temperature_, self.grid_, self.ece_grid_ = t, grid, eces
        return self


# --------------------------------------------------------------------------------------------
# Focal loss
# --------------------------------------------------------------------------------------------


class FocalTemperatureScaling(_Temperature):
    """TS (FL): z / T with T minimising the calibration-set mean focal loss with parameter γ.

    γ = 0 is the cross entropy, i.e. plain temperature scaling. Learned: ``temperature_`` (float).
    """

    def __init__(self, gamma: float = 1.0):
        self.gamma = gamma

    def fit(self, logits: Any, labels: Any) -> "FocalTemperatureScaling":
        self.temperature_ = fit_focal_temperature(logits, labels, self.gamma)
        return self
