"""Top-label calibrators: Top-versus-All (TvA) and spline calibration.

Both calibrate the *top-label confidence* c = max_k softmax(z)_k of each prediction against whether
that prediction is right, a binary problem whatever the number of classes K:

* **Top-versus-All** (Le Coz, Herbin & Adjed, NeurIPS 2024; the authors' code, ``allglc/tva-calibration``,
  decides what the paper leaves open):

  - ``TopVersusAllTemperature`` (``ts-tva``): z / T with T minimising the binary cross-entropy of c(T) =
    max softmax(z / T) against correctness. The authors run Adam (lr 1e-3, T₀ = 1.5, 200 epochs of
    batches of 512); this objective has one variable, so NCTV solves it exactly instead (a scan of 64
    temperatures in [1e-3, 1e3], then Brent's method in log T to 1e-12), and the fit depends on the
    calibration rows, not on their order.
  - ``TopVersusAllVector`` (``vs-tva``): z ⊙ v (no intercept), v₀ = 1 / T with T that of ``ts-tva``,
    fitted by that binary cross-entropy + 0.1 · mean((v − 1)²), Adam (lr 1e-3), 200 epochs of batches
    of 512, as the authors' ``VS_reg_tva``. Scaling each class's logit can change a prediction, as in
    their code (and as vector scaling does). The batches take the rows in an order set by their content
    (:func:`nctv.canonical.canonical_order`), so the fit is the same for the rows in any order.
  - ``TopVersusAllBinning`` (``hb-tva``) and ``TopVersusAllIsotonic`` (``iso-tva``): histogram binning
    (15 equal-mass bins; ``edges`` and ``on_edge`` as :class:`~nctv.calibration.nonparametric.HistogramBinning`)
    and isotonic regression fitted to (c, correct): the authors' netcal ``HistogramBinning(15,
    equal_intervals=False)`` and ``IsotonicRegression`` on the same pairs.

* **Spline calibration** (Gupta et al., ICLR 2021; the authors' ``recalibrate.py``, as ``SplineCalibrator``
  of ``Misakaaaaaz/calibench`` applies it to all classes): sort the calibration confidences s₁ ≤ … ≤ sₙ,
  fit a natural cubic spline S with 6 equally spaced knots on [0, 1], by least squares, to the
  cumulative difference (Σ_{j≤i} correct_j − Σ_{j≤i} s_j) / n against i's position (i − 1)/(n − 1); the
  recalibrated confidence of sᵢ is S'((i − 1)/(n − 1)) + sᵢ, interpolated linearly between the sorted
  calibration confidences, held beyond them and clipped to [0, 1]. Ties (the authors' code leaves them to
  numpy's sort): a run of equal confidences takes its mean correctness before the sums, and the mean of
  its recalibrated values, so that the fit depends on the rows, not on their order.

The binning, isotonic and spline maps change only c; the other classes keep their proportions and share
1 − c', so the vector sums to 1 (:class:`TopLabelHead`). A map can give the top class less than the
runner-up would then get; c' is held at least where the two tie, p₂ / (1 − c + p₂), so that the
prediction stays the model's (TvA's promise; the authors score c' and the original prediction only).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from nctv.calibration.base import HeadCalibrator, saved_class_count
from nctv.canonical import canonical_order
from nctv.calibration.nonparametric import (EDGE_RULES, MAX_BINS, ON_EDGE, PROBABILITY_FLOOR, _check_choice, _knots,
                                            histogram_edges, isotonic_fit)
from nctv.calibration.temperature import _Temperature
from nctv.metrics import bin_index
from nctv.checks import (EPOCHS_MAX, LR_MAX, T_MAX, T_MIN, check_at_most, check_logits, check_logits_labels,
                         check_nonnegative, check_positive, check_whole_range)

#: Most knots a spline takes: its least-squares fit has one unknown per knot.
MAX_KNOTS = 1000


def top_label(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For float64 logits (N, K): the predicted class (lowest index on ties), its confidence c (torch's
    softmax), log Σ_{j≠top} exp z_j and the runner-up's logit."""
    top = torch.argmax(z, dim=1)
    c = torch.softmax(z, dim=1).gather(1, top[:, None]).squeeze(1)
    others = z.scatter(1, top[:, None], -math.inf)
    return top, c, torch.logsumexp(others, dim=1), others.max(dim=1).values


def top_label_data(logits: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """The binary problem every top-label calibrator fits: each row's confidence c and whether its
    prediction is right (1.0 / 0.0), float64 numpy arrays."""
    z, y = check_logits_labels(logits, labels)
    top, c, _, _ = top_label(z.to(torch.float64))
    return c.cpu().numpy(), (top == y).to(torch.float64).cpu().numpy()


class StepCurve(torch.nn.Module):
    """A confidence mapped to its bin's value: bins (e_{m−1}, e_m] (``above``: [e_{m−1}, e_m))."""

    def __init__(self, edges: torch.Tensor, values: torch.Tensor, on_edge: str = "below"):
        super().__init__()
        self.above = on_edge == "above"
        self.register_buffer("edges", torch.as_tensor(edges, dtype=torch.float64).clone())
        self.register_buffer("values", torch.as_tensor(values, dtype=torch.float64).clone())

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        idx = (torch.searchsorted(self.edges, c, right=self.above) - 1).clamp(0, self.values.shape[0] - 1)
        return self.values[idx]


class LinearCurve(torch.nn.Module):
    """A confidence mapped by linear interpolation between knots (x, y), held constant beyond them."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        super().__init__()
        self.register_buffer("x", torch.as_tensor(x, dtype=torch.float64).clone())
        self.register_buffer("y", torch.as_tensor(y, dtype=torch.float64).clone())

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        j = torch.searchsorted(self.x, c, right=True).clamp(1, self.x.shape[0] - 1)
        x0, x1, y0, y1 = self.x[j - 1], self.x[j], self.y[j - 1], self.y[j]
        width = x1 - x0
        share = torch.where(width > 0, (c - x0) / torch.where(width > 0, width, torch.ones_like(width)),
                            torch.zeros_like(c)).clamp(0.0, 1.0)
        return y0 + share * (y1 - y0)


class TopLabelHead(torch.nn.Module):
    """Logits whose softmax gives the top class c' = ``curve``(c) (clipped to [0, 1]) and every other class
    its share of 1 − c' in its original proportion (float64, returned float32; module notes).

    c' is held at least at p₂ / (1 − c + p₂) = sigmoid(z₂ − log Σ_{j≠top} exp z_j), where the runner-up
    would tie it, and within [1e-12, 1 − 1e-12] (every log finite). At that floor the two tie before
    rounding, and every argmax (NCTV's metrics, torch) gives a tie to the lowest index: the top class's
    log-probability is then put one float32 step above the runner-up's."""

    def __init__(self, curve: torch.nn.Module):
        super().__init__()
        self.curve = curve

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        z = logits.to(torch.float64)
        top, c, rest, runner = top_label(z)
        q = torch.maximum(self.curve(c).clamp(0.0, 1.0), torch.sigmoid(runner - rest))
        q = q.clamp(PROBABILITY_FLOOR, 1.0 - PROBABILITY_FLOOR)
        at = top[:, None]
        out = (torch.log1p(-q)[:, None] + (z - rest[:, None])).scatter(1, at, torch.log(q)[:, None])
        out = out.to(torch.float32)
        others = out.scatter(1, at, -math.inf).max(dim=1).values
        lead = torch.maximum(out.gather(1, at).squeeze(1), torch.nextafter(others, torch.full_like(others, math.inf)))
        return out.scatter(1, at, lead[:, None])


def _check_curve(name: str, x: Any, y: Any, unit_values: bool) -> None:
    """Knots of a saved map: x non-decreasing within [0, 1], y within [0, 1] where ``unit_values``."""
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if bool(((x < 0) | (x > 1)).any()) or (x.shape[0] > 1 and bool((x[1:] < x[:-1]).any())):
        raise ValueError(f"The calibrator's {name} must be non-decreasing confidences within [0, 1]; they are not. "
                         "Fit and save it again.")
    if unit_values and bool(((y < 0) | (y > 1)).any()):
        raise ValueError("The calibrator's values_ hold numbers outside [0, 1]; no fit makes them. Fit and save it "
                         "again.")


# --------------------------------------------------------------------------------------------
# Top-versus-All: temperature and vector scaling
# --------------------------------------------------------------------------------------------


def binary_cross_entropy_of_temperature(z: torch.Tensor, correct: torch.Tensor, temperature: float) -> float:
    """mean −[r log c + (1 − r) log(1 − c)] of c = max softmax(z / T) against correctness r, from
    ρ = log Σ_{j≠top} exp((z_j − z_top) / T): log c = −softplus(ρ), log(1 − c) = −softplus(−ρ) (z float64)."""
    top = torch.argmax(z, dim=1, keepdim=True)
    rho = torch.logsumexp(((z - z.gather(1, top)) / temperature).scatter(1, top, -math.inf), dim=1)
    sp = torch.nn.functional.softplus
    return float((correct * sp(rho) + (1.0 - correct) * sp(-rho)).mean())


def fit_tva_temperature(logits: Any, labels: Any) -> float:
    """The T within [1e-3, 1e3] minimising the top-label binary cross-entropy (module notes): the best of 64
    log-spaced temperatures, then Brent's method in log T between its neighbours."""
    from scipy.optimize import minimize_scalar

    z, y = check_logits_labels(logits, labels)
    order = torch.from_numpy(canonical_order(z, y)).to(z.device)  # the same sums for the rows in any order
    z, y = z.to(torch.float64)[order], y[order]
    correct = (torch.argmax(z, dim=1) == y).to(torch.float64)

    def loss(log_t: float) -> float:
        return binary_cross_entropy_of_temperature(z, correct, math.exp(log_t))

    grid = np.linspace(math.log(T_MIN), math.log(T_MAX), 64)
    values = [loss(s) for s in grid]
    best = int(np.argmin(values))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    res = minimize_scalar(loss, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12})
    return math.exp(float(res.x) if res.fun <= values[best] else float(grid[best]))


class TopVersusAllTemperature(_Temperature):
    """TS + TvA: z / T with T minimising the binary cross-entropy of the top-label confidence against
    correctness, solved exactly (module notes). Learned: ``temperature_`` (float)."""

    def fit(self, logits: Any, labels: Any) -> "TopVersusAllTemperature":
        self.temperature_ = fit_tva_temperature(logits, labels)
        return self


class ScaleHead(torch.nn.Module):
    """z ⊙ v in float64, returned float32."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", torch.as_tensor(scale, dtype=torch.float64).clone())

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return (logits.to(torch.float64) * self.scale).to(torch.float32)


class TopVersusAllVector(HeadCalibrator):
    """VS + TvA: z ⊙ v, v fitted by the top-label binary cross-entropy + ``regularization`` · mean((v − 1)²)
    with Adam from v₀ = 1 / T of TS + TvA, as the authors' code (module notes).

    Learned: ``scale_`` (v, float64, length K), ``initial_temperature_`` (that T) and ``n_classes_``.
    """

    def __init__(self, regularization: float = 0.1, learning_rate: float = 1e-3, epochs: int = 200,
                 batch_size: int = 512):
        self.regularization = regularization
        self.learning_rate = learning_rate
        self.epochs = epochs
        self.batch_size = batch_size

    def fit(self, logits: Any, labels: Any) -> "TopVersusAllVector":
        reg = check_nonnegative(self.regularization, "regularization")
        lr = check_at_most(check_positive(self.learning_rate, "learning_rate"), "learning_rate", LR_MAX)
        epochs = check_whole_range(self.epochs, "epochs", 1, EPOCHS_MAX)
        batch = check_whole_range(self.batch_size, "batch_size", 1, 2**31 - 1)
        z, y = check_logits_labels(logits, labels)
        t0 = fit_tva_temperature(z, y)
        order = torch.from_numpy(canonical_order(z, y)).to(z.device)
        z, y = z.to(torch.float64)[order], y[order]
        scale = torch.full((z.shape[1],), 1.0 / t0, dtype=torch.float64, device=z.device, requires_grad=True)
        optimiser = torch.optim.Adam([scale], lr=lr)
        bce = torch.nn.functional.binary_cross_entropy
        for _ in range(epochs):
            for b0 in range(0, len(y), batch):
                optimiser.zero_grad()
                confidence, predicted = torch.softmax(z[b0:b0 + batch] * scale, dim=1).max(dim=1)
                loss = bce(confidence, (predicted == y[b0:b0 + batch]).to(torch.float64))
                (loss + reg * (scale - 1.0).square().mean()).backward()
                optimiser.step()
        self.scale_ = scale.detach().cpu()
        self.initial_temperature_ = float(t0)
        self.n_classes_ = int(z.shape[1])
        return self

    def as_module(self) -> torch.nn.Module:
        self._check_fitted("scale_", "n_classes_")
        return ScaleHead(self.scale_)

    @classmethod
    def saved_shapes(cls, params: dict, fitted: dict, classes: int | None) -> dict[str, list[int]]:
        return {"scale_": [saved_class_count(fitted, classes)]}


# --------------------------------------------------------------------------------------------
# Top-versus-All: histogram binning and isotonic regression
# --------------------------------------------------------------------------------------------


class _TopLabelMap(HeadCalibrator):
    """A calibrator that maps the top-label confidence only (:class:`TopLabelHead`): a subclass fits the map
    (``_fit_map``) and builds it (``_curve``)."""

    def fit(self, logits: Any, labels: Any) -> "_TopLabelMap":
        self._fit_map(*top_label_data(logits, labels))
        return self

    def as_module(self) -> torch.nn.Module:
        return TopLabelHead(self._curve())

    def calibrated_confidence(self, logits: Any) -> torch.Tensor:
        """The map's c' of each row's top-label confidence, before the floor that keeps the prediction: what
        the authors' code reports (float64)."""
        return self._curve()(top_label(check_logits(logits).to(torch.float64))[1]).clamp(0.0, 1.0)


class TopVersusAllBinning(_TopLabelMap):
    """HB + TvA: the top-label confidence replaced by its bin's accuracy, ``n_bins`` equal-mass bins of the
    calibration confidences; ``edges`` and ``on_edge`` as :class:`~nctv.calibration.nonparametric.HistogramBinning`.

    Learned: ``bin_edges_`` (n_bins + 1) and ``bin_values_`` (n_bins), float64 tensors.
    """

    def __init__(self, n_bins: int = 15, edges: str = "quantile", on_edge: str = "below"):
        self.n_bins = n_bins
        self.edges = edges
        self.on_edge = on_edge

    def _fit_map(self, c: np.ndarray, correct: np.ndarray) -> None:
        n_bins = check_whole_range(self.n_bins, "n_bins", 1, MAX_BINS)
        e = histogram_edges(c, n_bins, _check_choice(self.edges, "edges", EDGE_RULES))
        idx = bin_index(e, c, _check_choice(self.on_edge, "on_edge", ON_EDGE))
        count = np.bincount(idx, minlength=n_bins)
        hits = np.bincount(idx, weights=correct, minlength=n_bins)
        self.bin_edges_ = torch.from_numpy(e)
        self.bin_values_ = torch.from_numpy(np.where(count > 0, hits / np.maximum(count, 1), 0.5 * (e[:-1] + e[1:])))

    def _curve(self) -> torch.nn.Module:
        self._check_fitted("bin_edges_", "bin_values_")
        return StepCurve(self.bin_edges_, self.bin_values_, _check_choice(self.on_edge, "on_edge", ON_EDGE))

    @classmethod
    def saved_shapes(cls, params: dict, fitted: dict, classes: int | None) -> dict[str, list[int]]:
        n_bins = check_whole_range(params.get("n_bins"), "The calibrator's n_bins", 1, MAX_BINS)
        _check_choice(params.get("edges"), "The calibrator's edges", EDGE_RULES)
        _check_choice(params.get("on_edge"), "The calibrator's on_edge", ON_EDGE)
        return {"bin_edges_": [n_bins + 1], "bin_values_": [n_bins]}

    @classmethod
    def check_saved(cls, fitted: dict) -> None:
        _check_curve("bin_edges_", fitted["bin_edges_"], fitted["bin_values_"], unit_values=True)


class TopVersusAllIsotonic(_TopLabelMap):
    """Isotonic + TvA: the least-squares non-decreasing map of the top-label confidence to correctness
    (:func:`~nctv.calibration.nonparametric.isotonic_fit`, equal confidences pooled first), interpolated
    linearly and held beyond the ends, as scikit-learn's ``IsotonicRegression(out_of_bounds="clip")``.

    Learned: ``thresholds_`` and ``values_`` (M ≥ 2 knots), float64 tensors.
    """

    def _fit_map(self, c: np.ndarray, correct: np.ndarray) -> None:
        x, v = _knots(*isotonic_fit(c, correct))
        self.thresholds_, self.values_ = _at_least_two(x, v)

    def _curve(self) -> torch.nn.Module:
        self._check_fitted("thresholds_", "values_")
        return LinearCurve(self.thresholds_, self.values_)

    @classmethod
    def saved_shapes(cls, params: dict, fitted: dict, classes: int | None) -> dict[str, list[int | None]]:
        return {"thresholds_": [None], "values_": [None]}

    @classmethod
    def check_saved(cls, fitted: dict) -> None:
        _check_knots(fitted)
        _check_curve("thresholds_", fitted["thresholds_"], fitted["values_"], unit_values=True)
        if bool((torch.diff(torch.as_tensor(fitted["values_"])) < 0).any()):
            raise ValueError("The calibrator's values_ must be non-decreasing (an isotonic map); they are not. Fit "
                             "and save it again.")


def _at_least_two(x: np.ndarray, v: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Knots as tensors, the only one repeated where every calibration confidence was the same."""
    if len(x) == 1:
        x, v = np.repeat(x, 2), np.repeat(v, 2)
    return torch.from_numpy(np.asarray(x, dtype=np.float64)), torch.from_numpy(np.asarray(v, dtype=np.float64))


def _check_knots(fitted: dict) -> None:
    if fitted["thresholds_"].shape != fitted["values_"].shape or fitted["thresholds_"].shape[0] < 2:
        raise ValueError("The calibrator's thresholds_ and values_ must have the same length, at least 2; save "
                         "the calibrator again.")


# --------------------------------------------------------------------------------------------
# Spline calibration
# --------------------------------------------------------------------------------------------


def natural_spline_maps(x: np.ndarray, n_knots: int) -> tuple[np.ndarray, np.ndarray]:
    """Two (len(x), n_knots) matrices that give a natural cubic spline's value and first derivative at
    ``x`` from its values at ``n_knots`` equally spaced knots on [0, 1] (second derivatives 0 at both
    ends), with the authors' formulas (``utilities/spline.py``: a point in [k_j, k_{j+1}], the last
    interval closed; u its distance from k_j)."""
    kx = np.linspace(0.0, 1.0, n_knots)
    delta = kx[1] - kx[0]
    j = np.clip(np.floor((x - kx[0]) / delta).astype(np.int64), 0, n_knots - 2)
    u = x - j * delta
    rows = np.arange(len(x))
    m_value, m_slope = np.zeros((len(x), n_knots)), np.zeros((len(x), n_knots))
    y_value, y_slope = np.zeros((len(x), n_knots)), np.zeros((len(x), n_knots))
    m_value[rows, j] = -u ** 3 / (6.0 * delta) + u ** 2 / 2.0 - 2.0 * delta * u / 6.0
    m_value[rows, j + 1] = u ** 3 / (6.0 * delta) - delta * u / 6.0
    y_value[rows, j], y_value[rows, j + 1] = -u / delta + 1.0, u / delta
    m_slope[rows, j] = -u ** 2 / (2.0 * delta) + u - 2.0 * delta / 6.0
    m_slope[rows, j + 1] = u ** 2 / (2.0 * delta) - delta / 6.0
    y_slope[rows, j], y_slope[rows, j + 1] = -1.0 / delta, 1.0 / delta
    # The inner knots' second derivatives from the knot values (the tridiagonal system of a cubic spline).
    inner = n_knots - 2
    a = 4.0 * np.eye(inner) + np.eye(inner, k=1) + np.eye(inner, k=-1)
    b = np.zeros((inner, n_knots))
    for i in range(inner):
        b[i, i:i + 3] = (1.0, -2.0, 1.0)
    second = np.concatenate([np.zeros((1, n_knots)), np.linalg.inv(a) @ (b * (6 / delta ** 2)),
                             np.zeros((1, n_knots))])
    return m_value @ second + y_value, m_slope @ second + y_slope


def spline_recalibration(c: np.ndarray, correct: np.ndarray, n_knots: int) -> tuple[np.ndarray, np.ndarray]:
    """The spline's recalibration map of confidences (module notes): (the distinct calibration
    confidences, sorted; the recalibrated value of each, before clipping)."""
    xs, inverse, count = np.unique(c, return_inverse=True, return_counts=True)
    s, runs = np.repeat(xs, count), np.repeat(np.arange(len(xs)), count)  # sorted, and each one's run
    hit = (np.bincount(inverse, weights=correct, minlength=len(xs)) / count)[runs]  # a run's mean correctness
    n = len(s)
    position = np.linspace(0.0, 1.0, n)
    value, slope = natural_spline_maps(position, n_knots)
    knots = np.linalg.lstsq(value, np.cumsum(hit) / n - np.cumsum(s) / n, rcond=-1)[0]
    recalibrated = slope @ knots + s
    return xs, np.bincount(runs, weights=recalibrated, minlength=len(xs)) / count


class SplineCalibration(_TopLabelMap):
    """Spline calibration of the top-label confidence (Gupta et al. 2021; module notes): a natural cubic
    spline with ``n_knots`` knots fitted to the cumulative accuracy minus the cumulative confidence.

    Learned: ``thresholds_`` (the distinct calibration confidences) and ``values_`` (their recalibrated
    values, clipped to [0, 1] when applied), float64 tensors.
    """

    def __init__(self, n_knots: int = 6):
        self.n_knots = n_knots

    def _fit_map(self, c: np.ndarray, correct: np.ndarray) -> None:
        n_knots = check_whole_range(self.n_knots, "n_knots", 3, MAX_KNOTS)
        self.thresholds_, self.values_ = _at_least_two(*spline_recalibration(c, correct, n_knots))

    def _curve(self) -> torch.nn.Module:
        self._check_fitted("thresholds_", "values_")
        return LinearCurve(self.thresholds_, self.values_)

    @classmethod
    def saved_shapes(cls, params: dict, fitted: dict, classes: int | None) -> dict[str, list[int | None]]:
        check_whole_range(params.get("n_knots"), "The calibrator's n_knots", 3, MAX_KNOTS)
        return {"thresholds_": [None], "values_": [None]}

    @classmethod
    def check_saved(cls, fitted: dict) -> None:
        _check_knots(fitted)
        # A spline's values may leave [0, 1] (they are clipped when applied); every one is finite (the loader).
        _check_curve("thresholds_", fitted["thresholds_"], fitted["values_"], unit_values=False)
