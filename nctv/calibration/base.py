"""Shared pieces of every calibrator: the focal loss, the fitted-state guard, the base class.

Conventions: calibrators take *logits* (N, K), never probabilities; labels are
integers in [0, K); K comes from the logits. Inputs may be numpy arrays or torch tensors on any
device; outputs are torch tensors on the device of the input.
"""
from __future__ import annotations

from typing import Any

import torch

from nctv.checks import as_tensor, check_logits, check_logits_labels, check_nonnegative  # noqa: F401 (linear.py)


class NotFittedError(RuntimeError):
    """Raised when a calibrator is used before ``fit``."""


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
