"""The registry of NCTV's calibration methods: the paper's method names, each with the class that
implements it and its default settings. Classes are looked up by name in a fixed table and imported
on first use, so that reading the registry (the app's menus, the CLI's help) loads no fitter."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

CLASSES = {
    "Uncalibrated": "base",
    "TemperatureScaling": "temperature",
    "GridSearchTemperature": "temperature",
    "FocalTemperatureScaling": "temperature",
    "grid_search_temperature": "temperature",
    "VectorScaling": "linear",
    "MatrixScaling": "linear",
    "MatrixScalingODIR": "linear",
    "DirichletODIR": "linear",
    "NeuralClamping": "clamping",
    "EfficientNeuralClamping": "clamping",
    "data_driven_delta": "clamping",
    "gamma_sweep": "studies",
    "init_study": "studies",
    "load_calibrator": "saving",
    "ModelMismatchWarning": "saving",
    "CalibratedModel": "deploy",
}


def calibration_class(name: str) -> Any:
    """The class (or function) ``name`` of :data:`CLASSES`, imported from its module on first use."""
    module = CLASSES.get(name)
    if module is None:
        raise AttributeError(f"module 'nctv.calibration' has no attribute {name!r}")
    return getattr(importlib.import_module(f"nctv.calibration.{module}"), name)


@dataclass(frozen=True)
class MethodSpec:
    """One named method: how to build it, whether it needs the model, whether seeds change it."""

    name: str
    cls: str
    needs_model: bool
    stochastic: bool
    defaults: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def factory(self, model: Any = None, **overrides: Any) -> Any:
        """A fresh, unfitted object; ``overrides`` replace the method's default settings."""
        kwargs = {**self.defaults, **overrides}
        cls: Callable[..., Any] = calibration_class(self.cls)
        if self.needs_model:
            if model is None:
                raise ValueError(f"{self.name} works on the model's inputs: pass the model (model=...).")
            return cls(model, **kwargs)
        return cls(**kwargs)


def _spec(name, cls, needs_model=False, stochastic=False, description="", **defaults) -> MethodSpec:
    return MethodSpec(name, cls, needs_model, stochastic, defaults, description)


METHODS: dict[str, MethodSpec] = {
    s.name: s
    for s in (
        _spec("Uncalibrated", "Uncalibrated", description="the model's own logits"),
        _spec("Temperature Scaling", "TemperatureScaling", description="z/T, T minimising NLL"),
        _spec("TS by Grid Search", "GridSearchTemperature",
              description="z/T, T on 0.001…5.000 with the lowest calibration ECE"),
        _spec("Temperature Scaling (FL)", "FocalTemperatureScaling", gamma=1.0,
              description="z/T, T minimising the focal loss (γ = 1)"),
        _spec("Vector Scaling", "VectorScaling", description="diag(w)·z + b, NLL"),
        _spec("Matrix Scaling", "MatrixScaling", description="W·z + b, NLL, no regulariser"),
        _spec("MS-ODIR", "MatrixScalingODIR", description="W·z + b with off-diagonal and intercept regularisation"),
        _spec("Dir-ODIR", "DirichletODIR", description="W·log softmax(z) + b with ODIR"),
        _spec("Neural Clamping (CE)", "NeuralClamping", True, True, gamma=0.0,
              description="f(x + δ)/T, cross entropy"),
        _spec("Neural Clamping (FL)", "NeuralClamping", True, True, gamma=1.0,
              description="f(x + δ)/T, focal loss (γ = 1)"),
        _spec("NC (Eff.)", "EfficientNeuralClamping", True, False,
              description="Theorem 1's δ̃, then T by grid search; no training"),
    )
}


def make_method(name: str, model: Any = None, **overrides: Any) -> Any:
    """Build the method called ``name`` (a key of ``METHODS``, case-insensitive)."""
    lookup = {k.lower(): k for k in METHODS}
    key = lookup.get(str(name).strip().lower())
    if key is None:
        raise ValueError(f"Unknown calibration method {name!r}; choose from: {', '.join(METHODS)}.")
    return METHODS[key].factory(model, **overrides)
