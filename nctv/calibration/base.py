"""Shared pieces of every calibrator: the focal loss, the fitted-state guard, the base classes.

Conventions: calibrators take *logits* (N, K), never probabilities; labels are
integers in [0, K); K comes from the logits. Inputs may be numpy arrays or torch tensors on any
device; outputs are torch tensors on the device of the input.
"""
from __future__ import annotations

import copy
import inspect
import os
from typing import Any

import torch

from nctv.canonical import canonical_order
from nctv.checks import NotFittedError, check_logits, check_logits_labels


def focal_loss(logits: torch.Tensor, labels: torch.Tensor, gamma: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """Focal loss FL_γ = −(1 − p_y)^γ log p_y on logits (γ = 0 is cross entropy).

    Differentiable; computed from ``log_softmax`` for stability. ``reduction``: "mean", "sum" or "none".
    """
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.view(-1, 1)).squeeze(-1)
    if gamma == 0:
        loss = -logp
    else:
        # (1 − p)^γ where p_y rounds to 1: the weight is 0 and so is its gradient (the limit). The power is
        # taken of 1 there: torch 2.2 (the oldest admitted) gives 0·∞ = NaN for the gradient of 0^γ, γ < 1.
        rest = (1.0 - logp.exp()).clamp_min(0.0)
        positive = rest > 0
        weight = torch.where(positive, torch.where(positive, rest, torch.ones_like(rest)) ** gamma,
                             torch.zeros_like(rest))
        loss = -weight * logp
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got {reduction!r}.")


def calibration_rows(logits: Any, labels: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A fit's logits and labels, checked, in the canonical order (:mod:`nctv.canonical`): every fit
    sums its loss, draws its folds and sorts its scores in that order, so the same calibration rows in
    any order give the same fit to the last bit."""
    z, y = check_logits_labels(logits, labels)
    rows = torch.from_numpy(canonical_order(z, y)).to(z.device)
    return z[rows], y[rows]


class BaseCalibrator:
    """Base of every calibrator, logit-space or input-space (scikit-learn's estimator contract).

    The constructor only stores each argument under its own name; ``fit`` learns and returns
    ``self``; learned state ends in ``_``. ``get_params`` / ``set_params`` read and change the
    settings by the constructor's argument names, ``clone`` gives a fresh unfitted copy, and
    ``save_pretrained`` writes a fitted calibrator in the Hub's layout (see
    :mod:`nctv.calibration.saving`).
    """

    #: True when repeated fits with different seeds can differ (reported as mean ± std).
    stochastic: bool = False
    #: What ``fit`` takes, for the message of a calibrator used before ``fit``.
    _fit_arguments = "logits, labels"

    @classmethod
    def _param_names(cls) -> tuple[str, ...]:
        """The constructor's argument names: the settings (none when it takes no arguments)."""
        if cls.__init__ is object.__init__:
            return ()
        args = list(inspect.signature(cls.__init__).parameters.values())[1:]
        return tuple(a.name for a in args if a.kind not in (a.VAR_POSITIONAL, a.VAR_KEYWORD))

    def get_params(self, deep: bool = False) -> dict[str, Any]:
        """The settings as ``{argument name: value}``, in the constructor's order.

        ``deep`` is accepted for scikit-learn compatibility; no calibrator holds another estimator.
        """
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params: Any) -> "BaseCalibrator":
        """Change settings by name (takes effect at the next ``fit``); returns ``self``."""
        self._check_param_names(params)
        for name, value in params.items():
            setattr(self, name, value)
        return self

    def _check_param_names(self, params: dict[str, Any]) -> None:
        valid = self._param_names()
        unknown = [name for name in params if name not in valid]
        if unknown:
            raise ValueError(f"{type(self).__name__} has no setting {', '.join(map(repr, unknown))}; "
                             f"its settings are: {', '.join(valid) or 'none'}.")

    def clone(self) -> "BaseCalibrator":
        """A new, unfitted calibrator with the same settings. Settings are copied, except models
        and callbacks: a clone calibrates the same model and reports to the same function."""
        params = {name: value if isinstance(value, torch.nn.Module) or callable(value) else copy.deepcopy(value)
                  for name, value in self.get_params().items()}
        return type(self)(**params)

    def save_pretrained(self, save_directory: str | os.PathLike, model: Any = None, data_config: dict | None = None):
        """Write the fitted calibrator to ``save_directory`` as ``config.json`` + ``calibrator.safetensors``.

        ``model``: the model it was fitted for (an ``nctv.zoo.LoadedModel`` gives its name and data
        config, an ``nn.Module`` its fingerprint; Neural Clamping records its own model).
        ``data_config`` (input_size, mean, std, …) overrides the model's. Returns the folder.
        """
        from nctv.calibration.saving import save_calibrator

        return save_calibrator(self, save_directory, model=model, data_config=data_config)

    @classmethod
    def saved_shapes(cls, params: dict, fitted: dict, classes: int | None) -> dict[str, list[int | None]]:
        """The shape of each fitted tensor a saved calibrator of this class holds, where the loader's own
        rules (δ, ``weight_``, ``bias_``, grids) do not say it: checked against the safetensors header
        before any tensor is read. ``params`` and ``fitted`` are config.json's settings and fitted
        values (tensors not yet read), ``classes`` the model's class count (None: no model given); a
        length of None admits any. Raises ValueError when those values are not a fit's."""
        return {}

    @classmethod
    def check_saved(cls, fitted: dict) -> None:
        """Refuse, with a ValueError, the fitted values of a loaded calibrator (tensors read, shapes and
        finiteness checked) that no fit of this class makes."""

    def _check_fitted(self, *attrs: str) -> None:
        for a in attrs:
            if getattr(self, a, None) is None:
                raise NotFittedError(f"{type(self).__name__} is not fitted yet: call fit({self._fit_arguments}) first.")

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={_short_repr(value)}" for name, value in self.get_params().items())
        return f"{type(self).__name__}({inner})"


def _short_repr(value: Any) -> str:
    # A model or an input range of tensors would fill the screen; their kind is what a reader needs.
    if isinstance(value, torch.nn.Module):
        return type(value).__name__
    if isinstance(value, torch.Tensor) and value.ndim > 0:
        return f"tensor(shape={tuple(value.shape)})"
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        inner = ", ".join(_short_repr(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return repr(value)


class Calibrator(BaseCalibrator):
    """Base of the logit-space calibrators.

    ``fit(logits, labels)`` learns and returns ``self``; ``transform(logits)`` maps logits to
    calibrated logits; ``as_module()`` gives that map as a ``torch.nn.Module`` for deployment.
    """

    def fit(self, logits: Any, labels: Any) -> "Calibrator":  # pragma: no cover - interface
        raise NotImplementedError

    def transform(self, logits: Any) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def as_module(self) -> torch.nn.Module:  # pragma: no cover - interface
        """The fitted map logits → calibrated logits as a module (traceable; see ``CalibratedModel``)."""
        raise NotImplementedError

    def fit_transform(self, logits: Any, labels: Any) -> torch.Tensor:
        return self.fit(logits, labels).transform(logits)


class Uncalibrated(Calibrator):
    """The identity map: the model's own logits (the "Uncalibrated" row of every table)."""

    def fit(self, logits: Any, labels: Any) -> "Uncalibrated":
        check_logits_labels(logits, labels)
        self.fitted_ = True
        return self

    def transform(self, logits: Any) -> torch.Tensor:
        return check_logits(logits)

    def as_module(self) -> torch.nn.Module:
        return torch.nn.Identity()


class HeadCalibrator(Calibrator):
    """A logit calibrator whose map is its module: ``transform`` runs ``as_module()`` on the logits, so the
    two agree bit for bit. A fitted ``n_classes_`` (when the class records one) must match the logits'."""

    def transform(self, logits: Any) -> torch.Tensor:
        """Calibrated logits (float32, on the device of ``logits``)."""
        z = check_logits(logits)
        head = self.as_module().to(z.device)
        k = getattr(self, "n_classes_", None)
        if k is not None and z.shape[1] != k:
            raise ValueError(f"logits have {z.shape[1]} classes; this calibrator was fitted for {k}.")
        return head(z)


def saved_class_count(fitted: dict, classes: int | None) -> int:
    """The class count K a saved calibrator records (``n_classes_`` in config.json), checked: a whole
    number >= 2, and the model's own count when a model is given (``classes``)."""
    k = fitted.get("n_classes_")
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise ValueError(f"The calibrator's n_classes_ must be a whole number >= 2; got {k!r}.")
    if classes is not None and k != classes:
        raise ValueError(f"The calibrator was fitted for {k} classes; the model given has {classes}. Load the "
                         "calibrator saved for this model.")
    return k
