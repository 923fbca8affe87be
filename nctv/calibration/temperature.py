# NOTE for helper-1: the lead wrote this file because others were blocked on it. Extend it and add tests, do not replace it. (The lead removes this line.)
"""Temperature scaling in its three forms (SPEC §2): z/T with one T > 0 for all classes.

* :class:`TemperatureScaling` — T minimising the mean NLL. The NLL is convex in β = 1/T, so it is
  solved exactly (safeguarded Newton on β in float64) rather than by gradient descent.
* :class:`GridSearchTemperature` — T on the grid 0.001, 0.002, …, 5.000 with the lowest
  calibration-set ECE (15 equal-width bins, SPEC §1). Exhaustive, vectorised over temperatures in
  chunks of bounded memory; gives exactly the choice of a loop calling :func:`nctv.metrics.ece`.
* :class:`FocalTemperatureScaling` — T minimising the mean focal loss FL_γ ("TS (FL)" of Table 4).

All take logits (N, K), never probabilities, and ``transform`` returns ``logits / T`` as float32 on
the input's device. Temperature scaling never changes the prediction.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from nctv.calibration.base import Calibrator, as_tensor, check_bins, check_logits, check_logits_labels, check_nonnegative, check_positive, focal_loss
from nctv.metrics import _bin_index

#: Temperatures are kept within these bounds (a model worse than chance, or separable data,
#: would otherwise send T to infinity or zero).
T_MIN, T_MAX = 1e-3, 1e3
#: Memory budget (bytes) of one chunk of the grid search: temperatures × N × K float64 values.
GRID_CHUNK_BYTES = 256 * 2**20


def _scaled(logits: Any, temperature: float) -> torch.Tensor:
    z = check_logits(logits)
    return (z.double() / temperature).float()


def _nll_derivatives(z: torch.Tensor, y: torch.Tensor, beta: float) -> tuple[float, float, float]:
    """Mean NLL of softmax(β z) and its first two derivatives in β."""
    s = beta * z
    logp = torch.log_softmax(s, dim=1)
    p = logp.exp()
    ez = (p * z).sum(1)
    f = float(-(logp.gather(1, y[:, None]).squeeze(1)).mean())
    d1 = float((ez - z.gather(1, y[:, None]).squeeze(1)).mean())
    d2 = float(((p * z * z).sum(1) - ez**2).mean())
    return f, d1, d2


def fit_nll_temperature(logits: Any, labels: Any, tol: float = 1e-12, max_iter: int = 200) -> float:
    """The temperature minimising mean NLL of softmax(z/T), within [T_MIN, T_MAX]."""
    z, y = check_logits_labels(logits, labels)
    z = z.detach().to(torch.float64)
    lo, hi = 1.0 / T_MAX, 1.0 / T_MIN
    if _nll_derivatives(z, y, lo)[1] >= 0:
        return T_MAX
    if _nll_derivatives(z, y, hi)[1] <= 0:
        return T_MIN
    beta = 1.0
    for _ in range(max_iter):
        _, d1, d2 = _nll_derivatives(z, y, beta)
        if d1 == 0.0:
            break
        if d1 > 0:
            hi = beta
        else:
            lo = beta
        step = beta - d1 / d2 if d2 > 0 else math.nan
        # Newton inside the bracket, bisection otherwise: convexity makes the bracket shrink to β*.
        new = step if lo < step < hi else 0.5 * (lo + hi)
        done = abs(new - beta) <= tol * beta
        beta = new
        if done:
            break
    return 1.0 / beta


class TemperatureScaling(Calibrator):
    """z/T with T minimising the mean NLL on the calibration split (solved exactly)."""

    def __init__(self, tol: float = 1e-12):
        self.tol = tol

    def fit(self, logits: Any, labels: Any) -> "TemperatureScaling":
        self.temperature_ = fit_nll_temperature(logits, labels, tol=self.tol)
        return self

    def transform(self, logits: Any) -> torch.Tensor:
        self._check_fitted("temperature_")
        return _scaled(logits, self.temperature_)


def temperature_grid(step: float = 0.001, t_max: float = 5.0) -> np.ndarray:
    """step, 2·step, …, t_max built from integers so that 0.001·k has no accumulated drift."""
    step = check_positive(step, "grid_step")
    n = int(round(check_positive(t_max, "t_max") / step))
    if n < 1:
        raise ValueError(f"t_max ({t_max}) must be at least one grid step ({step}).")
    return np.arange(1, n + 1, dtype=np.float64) * step


def grid_search_temperature(
    logits: Any, labels: Any, grid: Any = None, n_bins: int = 15, chunk_bytes: int = GRID_CHUNK_BYTES
) -> tuple[float, np.ndarray]:
    """Exhaustive search of the temperature with the lowest ECE; returns (best T, ECE per grid T).

    Ties go to the lowest temperature. The ECE of each T is the one :func:`nctv.metrics.ece` gives
    on ``logits / T`` (same float64 bins and sums; confidences agree to the last few bits), computed
    for many temperatures at a time with at most ``chunk_bytes`` of intermediate values.
    """
    z, y = check_logits_labels(logits, labels)
    z = z.detach().to("cpu", torch.float64)
    y = y.cpu()
    n, k = z.shape
    n_bins = check_bins(n_bins, n)
    temps = torch.as_tensor(temperature_grid() if grid is None else np.asarray(grid, dtype=np.float64))
    if temps.ndim != 1 or temps.numel() == 0 or bool((temps <= 0).any()):
        raise ValueError("grid must be a non-empty 1-D list of temperatures > 0.")
    # The prediction does not depend on T > 0, so correctness is computed once; the top-1
    # confidence at T is 1 / Σ_k exp((z_k − z_max) / T), summed class-major for long vector ops.
    correct = (torch.argmax(z, dim=1) == y).double()
    gaps_t = (z - z.amax(dim=1, keepdim=True)).T.contiguous()  # (K, N), all <= 0
    chunk = max(1, int(chunk_bytes // (8 * n * k)))
    eces = np.empty(temps.numel())
    for s in range(0, temps.numel(), chunk):
        inv = 1.0 / temps[s : s + chunk]
        c = inv.numel()
        conf = 1.0 / torch.exp(gaps_t[None] * inv[:, None, None]).sum(dim=1)  # (C, N)
        key = (torch.arange(c)[:, None] * n_bins + _bin_index(conf.reshape(-1), n_bins).view(c, n)).reshape(-1)
        sc = torch.bincount(key, weights=conf.reshape(-1), minlength=c * n_bins).view(c, n_bins)
        sa = torch.bincount(key, weights=correct.repeat(c), minlength=c * n_bins).view(c, n_bins)
        eces[s : s + c] = ((sa - sc).abs().sum(1) / n).numpy()
    best = int(np.argmin(eces))  # first minimum: the lowest temperature among ties
    return float(temps[best]), eces


class GridSearchTemperature(Calibrator):
    """z/T with T on the grid grid_step·{1, …, t_max/grid_step} minimising calibration-set ECE."""

    def __init__(self, grid_step: float = 0.001, t_max: float = 5.0, n_bins: int = 15):
        self.grid_step = grid_step
        self.t_max = t_max
        self.n_bins = n_bins

    def fit(self, logits: Any, labels: Any) -> "GridSearchTemperature":
        grid = temperature_grid(self.grid_step, self.t_max)
        self.temperature_, self.ece_grid_ = grid_search_temperature(logits, labels, grid, self.n_bins)
        self.grid_ = grid
        return self

    def transform(self, logits: Any) -> torch.Tensor:
        self._check_fitted("temperature_")
        return _scaled(logits, self.temperature_)


def fit_focal_temperature(logits: Any, labels: Any, gamma: float) -> float:
    """T minimising the mean focal loss of z/T: a log-spaced scan, then golden-section refinement."""
    from scipy.optimize import minimize_scalar

    z, y = check_logits_labels(logits, labels)
    z = z.detach().to(torch.float64)
    gamma = check_nonnegative(gamma, "gamma")

    def loss(log_t: float) -> float:
        return float(focal_loss(z / math.exp(log_t), y, gamma))

    grid = np.linspace(math.log(T_MIN), math.log(T_MAX), 241)
    values = [loss(v) for v in grid]
    i = int(np.argmin(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    res = minimize_scalar(loss, bounds=(lo, hi), method="bounded", options={"xatol": 1e-10})
    best = float(res.x) if res.fun <= values[i] else float(grid[i])
    return math.exp(best)


class FocalTemperatureScaling(Calibrator):
    """z/T with T minimising the mean focal loss FL_γ (γ = 0 is temperature scaling)."""

    def __init__(self, gamma: float = 1.0):
        self.gamma = gamma

    def fit(self, logits: Any, labels: Any) -> "FocalTemperatureScaling":
        self.temperature_ = fit_focal_temperature(logits, labels, self.gamma)
        return self

    def transform(self, logits: Any) -> torch.Tensor:
        self._check_fitted("temperature_")
        return _scaled(logits, self.temperature_)
