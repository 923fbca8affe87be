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

import torch

from nctv.inference import model_device

__all__ = ["CalibratedModel", "TemperatureHead", "AffineHead"]


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
        from nctv.calibration.clamping import _range_tensors

        calibrator._check_fitted("delta_")
        # On the model's device, so that a model already on a GPU needs no further .to().
        delta = calibrator.delta_.detach().to(model_device(self.model)).clone()
        self.register_buffer("delta", delta)
        bounds = _range_tensors(calibrator.input_range, tuple(delta.shape), delta.device) if calibrator.clamp else None
        self.register_buffer("lower", None if bounds is None else bounds[0])
        self.register_buffer("upper", None if bounds is None else bounds[1])
        self.head = TemperatureHead(calibrator.temperature_, in_float64=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delta is not None:
            x = x + self.delta
            if self.lower is not None:
                x = torch.clamp(x, self.lower, self.upper)
        return self.head(self.model(x))
