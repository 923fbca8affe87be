"""Shared pieces of every calibrator: input checks, the focal loss, the fitted-state guard.

Conventions (SPEC §1–3): calibrators take *logits* (N, K), never probabilities; labels are
integers in [0, K); K comes from the logits. Inputs may be numpy arrays or torch tensors on any
device; outputs are torch tensors on the device of the input.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


class NotFittedError(RuntimeError):
    """Raised when a calibrator is used before ``fit``."""


def as_tensor(x: Any, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Turn a numpy array, list or tensor into a tensor without copying when it can."""
    if isinstance(x, torch.Tensor):
        t = x
    else:
        t = torch.as_tensor(np.asarray(x))
    if dtype is not None or device is not None:
        t = t.to(dtype=dtype or t.dtype, device=device or t.device)
    return t


def check_logits(logits: Any, name: str = "logits") -> torch.Tensor:
    """Validate a (N, K) logit matrix: 2-D, K >= 2, N >= 1, all finite."""
    t = as_tensor(logits)
    if t.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array of shape (samples, classes); got shape {tuple(t.shape)}.")
    if t.shape[0] == 0:
        raise ValueError(f"{name} is empty: the split has no samples.")
    if t.shape[1] < 2:
        raise ValueError(f"{name} has {t.shape[1]} class(es); calibration needs at least 2 classes.")
    if not t.is_floating_point():
        t = t.double()
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or infinite values; check the model's outputs.")
    return t


def check_labels(labels: Any, n: int, k: int, device: torch.device | None = None) -> torch.Tensor:
    """Validate integer labels of length ``n`` with values in [0, k)."""
    y = as_tensor(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-D array; got shape {tuple(y.shape)}.")
    if y.shape[0] != n:
        raise ValueError(f"logits have {n} samples but labels have {y.shape[0]}; they must match.")
    if y.is_floating_point():
        if not bool((y == y.round()).all()):
            raise ValueError("labels must be whole numbers (class indices).")
    y = y.long()
    if n and (int(y.min()) < 0 or int(y.max()) >= k):
        raise ValueError(f"labels must lie in [0, {k}) for {k} classes; found values from {int(y.min())} to {int(y.max())}.")
    return y.to(device) if device is not None else y


def check_logits_labels(logits: Any, labels: Any) -> tuple[torch.Tensor, torch.Tensor]:
    z = check_logits(logits)
    y = check_labels(labels, z.shape[0], z.shape[1], device=z.device)
    return z, y


def check_bins(n_bins: int, n: int | None = None) -> int:
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive whole number; got {n_bins!r}.")
    if n is not None and n < n_bins:
        raise ValueError(f"{n} samples are fewer than the {n_bins} bins; use fewer bins or more samples.")
    return int(n_bins)


def check_nonnegative(value: float, name: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number; got {value!r}.") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0; got {value!r}.")
    return v


def check_positive(value: float, name: str) -> float:
    v = check_nonnegative(value, name)
    if v == 0:
        raise ValueError(f"{name} must be greater than 0; got {value!r}.")
    return v


def focal_loss(logits: torch.Tensor, labels: torch.Tensor, gamma: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """Focal loss FL_γ = −(1 − p_y)^γ log p_y on logits (γ = 0 is cross entropy).

    Differentiable; computed from ``log_softmax`` for stability. ``reduction``: "mean", "sum" or "none".
    """
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.view(-1, 1)).squeeze(-1)
    loss = -logp if gamma == 0 else -((1.0 - logp.exp()).clamp_min(0.0) ** gamma) * logp
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got {reduction!r}.")


class Calibrator:
    """Base of the logit-space calibrators (scikit-learn shape).

    The constructor only stores settings; ``fit(logits, labels)`` learns and returns ``self``;
    learned state ends in ``_``; ``transform(logits)`` maps logits to calibrated logits.
    """

    #: True when repeated fits with different seeds can differ (reported as mean ± std).
    stochastic: bool = False

    def fit(self, logits: Any, labels: Any) -> "Calibrator":  # pragma: no cover - interface
        raise NotImplementedError

    def transform(self, logits: Any) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def fit_transform(self, logits: Any, labels: Any) -> torch.Tensor:
        return self.fit(logits, labels).transform(logits)

    def _check_fitted(self, *attrs: str) -> None:
        for a in attrs:
            if getattr(self, a, None) is None:
                raise NotFittedError(f"{type(self).__name__} is not fitted yet: call fit(logits, labels) first.")

    def __repr__(self) -> str:
        params = {k: v for k, v in vars(self).items() if not k.endswith("_") and not k.startswith("_")}
        inner = ", ".join(f"{k}={v!r}" for k, v in params.items())
        return f"{type(self).__name__}({inner})"


class Uncalibrated(Calibrator):
    """The identity map: the model's own logits (the "Uncalibrated" row of every table)."""

    def fit(self, logits: Any, labels: Any) -> "Uncalibrated":
        check_logits_labels(logits, labels)
        self.fitted_ = True
        return self

    def transform(self, logits: Any) -> torch.Tensor:
        return check_logits(logits)
