"""Structured vector and matrix scaling (SVS, SMS) and ensemble temperature scaling (ETS).

SVS and SMS (Berta, Holzmüller, Jordan & Bach 2025), with the model and defaults of probmetrics
1.3 (``get_calibrator("svs" / "sms")``), the reference implementation:

1. temperature scaling first: T minimising the calibration NLL (``fit_nll_temperature``);
2. its probabilities mixed with the uniform distribution, weight ε = 1/(n + 1) for n calibration
   samples, and their logs taken: x = log((1 − ε)·softmax(z/T) + ε/K);
3. an affine map of x fitted by NLL with ridge penalties, shrinking towards the identity:

   SVS  calibrated logits = v ⊙ x + b,
        mean NLL + λ_b·Σ b_k² + λ_d·Σ (v_k − 1)²;
   SMS  calibrated logits = W·x + b,
        mean NLL + λ_b·Σ b_k² + λ_d·Σ (W_kk − 1)² + λ_o·Σ_{j≠k} W_jk²,

   with λ_b = λ_intercept·K/n, λ_d = λ_diagonal·K/n, λ_o = λ_off_diagonal·K(K − 1)/n and every λ
   setting 1 by default (the reference's ρ = τ = 1). The objective is strictly convex: it is solved
   to a gradient of 1e−10 by L-BFGS (scipy) in float64, from the identity map.

ETS (Zhang, Kailkhura & Han 2020, "Mix-n-Match"), with the authors' published formulas
(``ets_calibrate`` of their code, loss "mse"):

   p = w₁·softmax(z/T) + w₂·softmax(z) + w₃·(1/K),  w ≥ 0, w₁ + w₂ + w₃ = 1;

T minimises the mean squared error mean_{i,k} (softmax(z_i/T)_k − 1[y_i = k])² within [0.05, 5]
(their bounds), then w minimises the same error of p on the simplex: a quadratic in w, solved
exactly (every face of the simplex is tried and the best feasible stationary point kept).

Every ``transform`` returns float32 logits: SVS and SMS their calibrated logits, ETS the log of p.
"""
from __future__ import annotations

import math
import warnings
from itertools import combinations
from typing import Any

import numpy as np
import torch

from nctv.calibration.base import HeadCalibrator, calibration_rows, saved_class_count
from nctv.calibration.temperature import fit_nll_temperature
from nctv.checks import check_finite, check_nonnegative, check_whole

#: The gradient (largest entry) at which the SVS and SMS fits count as converged.
GTOL = 1e-10
#: The temperature bounds of ensemble temperature scaling (the authors').
ETS_T_BOUNDS = (0.05, 5.0)


def _log_mixture(z: torch.Tensor, temperature: torch.Tensor, log_weights: torch.Tensor) -> torch.Tensor:
    """log(Σ_j w_j·q_j) for q = (softmax(z/T), softmax(z), uniform), from log w (−inf for w = 0), float64."""
    k = z.shape[1]
    terms = torch.stack([torch.log_softmax(z / temperature, dim=1) + log_weights[0],
                         torch.log_softmax(z, dim=1) + log_weights[1],
                         torch.full_like(z, -math.log(k)) + log_weights[2]], dim=2)
    return torch.logsumexp(terms, dim=2)


def _log_weights(weights: Any) -> torch.Tensor:
    w = torch.as_tensor(weights, dtype=torch.float64)
    return torch.where(w > 0, torch.log(w.clamp_min(1e-300)), torch.full_like(w, -math.inf))


class StructuredHead(torch.nn.Module):
    """SVS / SMS: x = log((1 − ε)·softmax(z/T) + ε/K), then v ⊙ x + b or W·x + b (float64, returned float32)."""

    def __init__(self, temperature: float, uniform_weight: float, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.register_buffer("temperature", torch.tensor(float(temperature), dtype=torch.float64))
        self.register_buffer("log_weights", _log_weights([1.0 - float(uniform_weight), 0.0, float(uniform_weight)]))
        self.register_buffer("weight", torch.as_tensor(weight, dtype=torch.float64).clone())
        self.register_buffer("bias", torch.as_tensor(bias, dtype=torch.float64).clone())
        self.vector = self.weight.ndim == 1

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        x = _log_mixture(logits.to(torch.float64), self.temperature, self.log_weights)
        out = torch.addcmul(self.bias, x, self.weight) if self.vector else torch.addmm(self.bias, x, self.weight.T)
        return out.to(torch.float32)


class EnsembleHead(torch.nn.Module):
    """ETS: log(w₁·softmax(z/T) + w₂·softmax(z) + w₃/K) in float64, returned float32."""

    def __init__(self, temperature: float, weights: torch.Tensor):
        super().__init__()
        self.register_buffer("temperature", torch.tensor(float(temperature), dtype=torch.float64))
        self.register_buffer("log_weights", _log_weights(weights))

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return _log_mixture(logits.to(torch.float64), self.temperature, self.log_weights).to(torch.float32)


def _saved_number(fitted: dict, key: str) -> float:
    value = fitted.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"The calibrator's {key} must be a number; got {value!r}.")
    return check_finite(value, f"The calibrator's {key}")


# --------------------------------------------------------------------------------------------
# SVS and SMS
# --------------------------------------------------------------------------------------------


class _Structured(HeadCalibrator):
    """The shared part of SVS and SMS: the temperature-scaled, mixed log-probabilities and the ridge fit."""

    _vector: bool

    def fit(self, logits: Any, labels: Any) -> "_Structured":
        from scipy.optimize import minimize

        lambdas = self._lambdas()
        max_iter = check_whole(self.max_iter, "max_iter")
        z, y = calibration_rows(logits, labels)
        z = z.to(torch.float64)
        n, k = z.shape
        temperature = fit_nll_temperature(z, y)
        eps = 1.0 / (n + 1)
        head = StructuredHead(temperature, eps, torch.ones(k) if self._vector else torch.eye(k), torch.zeros(k))
        x = _log_mixture(z, head.temperature, head.log_weights)
        reg_b, reg_d = lambdas[0] * k / n, lambdas[1] * k / n
        reg_o = lambdas[2] * k * (k - 1) / n if not self._vector else 0.0
        shape = (k,) if self._vector else (k, k)
        size = math.prod(shape)
        # The penalty's weight on each entry of (change, b): λ_d on v − 1 or W's diagonal, λ_o off it, λ_b on b.
        penalty = torch.full(shape, reg_d, dtype=torch.float64, device=z.device)
        if not self._vector:
            penalty.fill_(reg_o).fill_diagonal_(reg_d)
        penalty = torch.cat([penalty.flatten(), torch.full((k,), reg_b, dtype=torch.float64, device=z.device)])
        onehot = torch.nn.functional.one_hot(y, k).to(torch.float64)

        def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
            t = torch.from_numpy(theta).to(z.device)
            change, b = t[:size].view(shape), t[size:]
            out = torch.addcmul(b, x, 1.0 + change) if self._vector else torch.addmm(b, x, change.T).add_(x)
            log_p = torch.log_softmax(out, dim=1)
            residual = (log_p.exp() - onehot) / n  # d(mean NLL)/d(calibrated logits)
            g = (residual * x).sum(0) if self._vector else (residual.T @ x).flatten()
            grad = torch.cat([g, residual.sum(0)]) + 2.0 * penalty * t
            loss = -float((log_p * onehot).sum()) / n + float((penalty * t * t).sum())
            return loss, grad.cpu().numpy()

        res = minimize(objective, np.zeros(size + k), jac=True, method="L-BFGS-B",
                       options={"maxiter": max_iter, "gtol": GTOL, "ftol": 0.0, "maxcor": 20})
        theta = torch.from_numpy(res.x).to(z.device)
        change, bias = theta[:size].view(shape), theta[size:]
        gradient = float(np.abs(res.jac).max())
        if gradient > 1e-6:
            warnings.warn(f"{type(self).__name__}: the fit stopped after {res.nit} iterations with a gradient of "
                          f"{gradient:.1e}; raise max_iter.", stacklevel=2)
        self.temperature_ = float(temperature)
        self.uniform_weight_ = eps
        self._store(change + (1.0 if self._vector else torch.eye(k, dtype=torch.float64, device=z.device)), bias)
        self.n_classes_ = int(k)
        self.n_iter_ = int(res.nit)
        self.objective_ = float(res.fun)
        return self

    def _lambdas(self) -> tuple[float, float, float]:
        off = check_nonnegative(getattr(self, "lambda_off_diagonal", 0.0), "lambda_off_diagonal")
        return (check_nonnegative(self.lambda_intercept, "lambda_intercept"),
                check_nonnegative(self.lambda_diagonal, "lambda_diagonal"), off)

    @classmethod
    def check_saved(cls, fitted: dict) -> None:
        eps = _saved_number(fitted, "uniform_weight_")
        if not 0 < eps < 1:
            raise ValueError(f"The calibrator's uniform_weight_ must lie strictly between 0 and 1; got {eps!r}.")


class StructuredVectorScaling(_Structured):
    """SVS: v ⊙ log((1 − ε)·softmax(z/T) + ε/K) + b with ridge penalties (module notes).

    Learned: ``temperature_``, ``uniform_weight_`` (ε), ``scale_`` (v) and ``bias_`` (b), ``n_classes_``.
    """

    _vector = True

    def __init__(self, lambda_intercept: float = 1.0, lambda_diagonal: float = 1.0, max_iter: int = 1000):
        self.lambda_intercept = lambda_intercept
        self.lambda_diagonal = lambda_diagonal
        self.max_iter = max_iter

    def _store(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        self.scale_, self.bias_ = weight.detach().cpu(), bias.detach().cpu()

    def as_module(self) -> torch.nn.Module:
        self._check_fitted("temperature_", "uniform_weight_", "scale_", "bias_")
        return StructuredHead(self.temperature_, self.uniform_weight_, self.scale_, self.bias_)

    @classmethod
    def saved_shapes(cls, params: dict, fitted: dict, classes: int | None) -> dict[str, list[int]]:
        k = saved_class_count(fitted, classes)
        return {"scale_": [k], "bias_": [k]}


class StructuredMatrixScaling(_Structured):
    """SMS: W·log((1 − ε)·softmax(z/T) + ε/K) + b with ridge penalties (module notes).

    Learned: ``temperature_``, ``uniform_weight_`` (ε), ``weight_`` (W) and ``bias_`` (b), ``n_classes_``.
    """

    _vector = False

    def __init__(self, lambda_intercept: float = 1.0, lambda_diagonal: float = 1.0, lambda_off_diagonal: float = 1.0,
                 max_iter: int = 1000):
        self.lambda_intercept = lambda_intercept
        self.lambda_diagonal = lambda_diagonal
        self.lambda_off_diagonal = lambda_off_diagonal
        self.max_iter = max_iter

    def _store(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        self.weight_, self.bias_ = weight.detach().cpu(), bias.detach().cpu()

    def as_module(self) -> torch.nn.Module:
        self._check_fitted("temperature_", "uniform_weight_", "weight_", "bias_")
        return StructuredHead(self.temperature_, self.uniform_weight_, self.weight_, self.bias_)

    @classmethod
    def saved_shapes(cls, params: dict, fitted: dict, classes: int | None) -> dict[str, list[int]]:
        k = saved_class_count(fitted, classes)
        return {"weight_": [k, k], "bias_": [k]}


# --------------------------------------------------------------------------------------------
# Ensemble temperature scaling
# --------------------------------------------------------------------------------------------


def _brier_temperature(z: torch.Tensor, onehot: torch.Tensor) -> float:
    """T in ETS_T_BOUNDS minimising mean (softmax(z/T) − onehot)²: a scan of 64 points (log-spaced), then
    Brent's method between the best one's neighbours."""
    from scipy.optimize import minimize_scalar

    def error(t: float) -> float:
        return float(((torch.softmax(z / t, dim=1) - onehot) ** 2).mean())

    grid = np.geomspace(*ETS_T_BOUNDS, 64)
    best = int(np.argmin([error(t) for t in grid]))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    res = minimize_scalar(error, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12})
    return float(res.x) if res.fun <= error(grid[best]) else float(grid[best])


def simplex_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin wᵀAw − 2bᵀw over the simplex {w ≥ 0, Σw = 1} (A positive semi-definite), exactly: the
    stationary point of every face (KKT with the sum constraint), the feasible one of least value."""
    best, best_value = None, math.inf
    m = len(b)
    for size in range(1, m + 1):
        for face in combinations(range(m), size):
            f = list(face)
            kkt = np.zeros((size + 1, size + 1))
            kkt[:size, :size], kkt[:size, size], kkt[size, :size] = 2 * a[np.ix_(f, f)], 1.0, 1.0
            rhs = np.concatenate([2 * b[f], [1.0]])
            sol = np.linalg.lstsq(kkt, rhs, rcond=None)[0][:size]
            if np.any(sol < -1e-12) or abs(sol.sum() - 1.0) > 1e-9:
                continue
            w = np.zeros(m)
            w[f] = np.clip(sol, 0.0, None)
            w /= w.sum()
            value = float(w @ a @ w - 2 * b @ w)
            if value < best_value - 1e-15:
                best, best_value = w, value
    return best


class EnsembleTemperatureScaling(HeadCalibrator):
    """ETS: log(w₁·softmax(z/T) + w₂·softmax(z) + w₃/K), T and w by mean squared error (module notes).

    Learned: ``temperature_`` (T) and ``weights_`` (w₁, w₂, w₃), a float64 tensor.
    """

    def fit(self, logits: Any, labels: Any) -> "EnsembleTemperatureScaling":
        z, y = calibration_rows(logits, labels)
        z = z.to(torch.float64)
        onehot = torch.nn.functional.one_hot(y, z.shape[1]).to(torch.float64)
        t = _brier_temperature(z, onehot)
        parts = torch.stack([torch.softmax(z / t, dim=1), torch.softmax(z, dim=1),
                             torch.full_like(z, 1.0 / z.shape[1])]).flatten(1)  # (3, N·K)
        count = parts.shape[1]
        a = (parts @ parts.T / count).cpu().numpy()
        b = (parts @ onehot.flatten() / count).cpu().numpy()
        self.temperature_ = t
        self.weights_ = torch.from_numpy(simplex_least_squares(a, b))
        return self

    def as_module(self) -> torch.nn.Module:
        self._check_fitted("temperature_", "weights_")
        return EnsembleHead(self.temperature_, self.weights_)

    @classmethod
    def saved_shapes(cls, params: dict, fitted: dict, classes: int | None) -> dict[str, list[int]]:
        return {"weights_": [3]}

    @classmethod
    def check_saved(cls, fitted: dict) -> None:
        t = _saved_number(fitted, "temperature_")
        if not ETS_T_BOUNDS[0] <= t <= ETS_T_BOUNDS[1]:
            raise ValueError(f"The calibrator's temperature T = {t:g} is outside [{ETS_T_BOUNDS[0]:g}, "
                             f"{ETS_T_BOUNDS[1]:g}], where ensemble temperature scaling searches. Fit it again.")
        w = torch.as_tensor(fitted["weights_"], dtype=torch.float64)
        if bool((w < 0).any()) or abs(float(w.sum()) - 1.0) > 1e-6:
            raise ValueError(f"The calibrator's weights_ {w.tolist()} must be >= 0 and sum to 1 (a mixture). Fit "
                             "and save it again.")
