"""A fitted calibrator and its model as one ``torch.nn.Module``: raw model inputs in, calibrated logits out.

    CalibratedModel(model, ts)   x ↦ ts's map of model(x)                     (logit-space calibrators)
    CalibratedModel(model, nc)   x ↦ model(clamp(x + δ)) / T                  (Neural Clamping; clamped
                                                                             only when nc.clamp is set)

The calibrator's fitted numbers become buffers, so ``.to(device)``, ``state_dict``,
``torch.jit.trace`` and ``torch.export`` treat them like the model's own; ``forward`` has no
Python-side checks that a trace would freeze. Its outputs equal the calibrator's ``transform`` /
``predict_logits`` on the same inputs (same operations in the same precision).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nctv.calibration.base import NotFittedError
from nctv.inference import model_device

__all__ = ["CalibratedModel", "TemperatureHead", "AffineHead", "input_bounds"]


class TemperatureHead(torch.nn.Module):
    """z / T. ``in_float64``: divide in float64 and return float32, as the temperature-scaling
    calibrators do; otherwise divide in the logits' own precision, as Neural Clamping does."""

    def __init__(self, temperature: float, in_float64: bool = True):
        super().__init__()
        dtype = torch.float64 if in_float64 else torch.float32
        self.register_buffer("temperature", torch.tensor(float(temperature), dtype=dtype))

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return (logits.to(self.temperature.dtype) / self.temperature).to(torch.float32)


class AffineHead(torch.nn.Module):
    """W·φ(z) + b in float64, returned as float32; φ = log softmax for Dirichlet calibration, else the identity."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, dirichlet: bool = False):
        super().__init__()
        self.dirichlet = bool(dirichlet)
        self.register_buffer("weight", weight.detach().to(torch.float64).clone())
        self.register_buffer("bias", bias.detach().to(torch.float64).clone())

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.to(torch.float64)
        if self.dirichlet:
            x = torch.log_softmax(x, dim=1)
        return torch.addmm(self.bias, x, self.weight.T).to(torch.float32)


class CalibratedModel(torch.nn.Module):
    """``model`` followed (or, for Neural Clamping, surrounded) by a fitted ``calibrator``.

    ``model``: an ``nn.Module`` or an ``nctv.zoo.LoadedModel``; it becomes a submodule (shared, not
    copied), so moving this module moves the model. Inputs are what the model takes: preprocessed
    images (N, C, H, W) for the zoo's models. The module starts in eval mode, since a calibrator is
    fitted to the model's eval-mode logits.
    """

    def __init__(self, model: Any, calibrator: Any):
        super().__init__()
        from nctv.calibration.base import Calibrator

        self.model = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
        if not isinstance(self.model, torch.nn.Module):
            raise ValueError("CalibratedModel needs a torch model (nn.Module or LoadedModel); "
                             f"got {type(model).__name__}.")
        if isinstance(calibrator, Calibrator):
            self.register_buffer("delta", None)
            self.register_buffer("lower", None)
            self.register_buffer("upper", None)
            self.head = calibrator.as_module()
        elif hasattr(calibrator, "predict_logits"):
            self._input_part(calibrator)
        else:
            raise ValueError(f"{type(calibrator).__name__} is not an NCTV calibrator; fit one from nctv.calibration.")
        self.eval()

    def _input_part(self, calibrator: Any) -> None:
        if getattr(calibrator, "delta_", None) is None:
            raise NotFittedError(f"{type(calibrator).__name__} is not fitted yet: fit it before CalibratedModel.")
        # On the model's device, so that a model already on a GPU needs no further .to().
        delta = calibrator.delta_.detach().to(model_device(self.model)).clone()
        self.register_buffer("delta", delta)
        bounds = calibrator.clamp_bounds(tuple(delta.shape), delta.device)
        self.register_buffer("lower", None if bounds is None else bounds[0])
        self.register_buffer("upper", None if bounds is None else bounds[1])
        self.head = TemperatureHead(calibrator.temperature_, in_float64=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delta is not None:
            x = x + self.delta
            if self.lower is not None:
                x = torch.clamp(x, self.lower, self.upper)
        return self.head(self.model(x))


def input_bounds(input_range: Any, shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(α, β) as float32 tensors of one input's shape on ``device``; α <= β everywhere.

    ``input_range`` is the pair of preprocessed images of pixel values 0 and 1 (numbers, arrays or
    tensors that broadcast to ``shape``): the box Neural Clamping keeps x + δ in."""
    if not isinstance(input_range, (tuple, list)) or len(input_range) != 2:
        raise ValueError("input_range must be a pair (alpha, beta): the preprocessed images of pixel values 0 and 1.")
    out = []
    for name, v in zip(("alpha", "beta"), input_range):
        t = torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v).to(device, torch.float32)
        try:
            t = torch.broadcast_to(t, shape).contiguous()
        except RuntimeError:
            raise ValueError(f"input_range {name} of shape {tuple(t.shape)} does not fit an input of shape {shape}.") from None
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"input_range {name} contains NaN or infinite values.")
        out.append(t)
    if bool((out[0] > out[1]).any()):
        raise ValueError("input_range must have alpha <= beta everywhere (alpha: image of pixel 0, beta: of pixel 1).")
    return out[0], out[1]
