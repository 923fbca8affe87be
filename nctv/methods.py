"""The registry of NCTV's calibration methods: one entry per method holds all that is known of it
(:class:`MethodSpec`: its names, colour, class, whether it needs the model, its defaults). Classes
are looked up by name in a fixed table and imported on first use, so that reading the registry (the
app's menus, the CLI's help) loads no fitter and no torch. ``nctv.calibration.registry`` is the
same registry under the calibration package's name."""
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
    "StructuredVectorScaling": "structured",
    "StructuredMatrixScaling": "structured",
    "EnsembleTemperatureScaling": "structured",
    "HistogramBinning": "nonparametric",
    "IsotonicRegression": "nonparametric",
    "SMART": "smart",
    "SplineCalibration": "toplabel",
    "TopVersusAllTemperature": "toplabel",
    "TopVersusAllVector": "toplabel",
    "TopVersusAllBinning": "toplabel",
    "TopVersusAllIsotonic": "toplabel",
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


#: The settings of a run that a method may take (``MethodSpec.run_options``): ``"gamma"`` the run's
#: focal-loss γ (unless "auto"), ``"progress"`` its own progress bar (a run turns it off: the run
#: reports every method), ``"callback"`` the run's progress function (folds, passes).
RUN_OPTIONS = ("gamma", "progress", "callback")


@dataclass(frozen=True, kw_only=True)
class MethodSpec:
    """One named method, and everything the toolkit knows of it: the paper's name, the CLI's short
    name, the abbreviation of tables and figures, its colour in figures, the class that implements
    it (whose ``save_pretrained`` saves it and ``nctv.calibration.load_calibrator`` loads it, by that
    class's name, checking the fitted values it names), whether it needs the model or only logits, whether seeds change it, its default
    settings and which of a run's settings it takes. The CLI, the app, the report, the plots, the
    saving code and the bench read these; adding a calibrator is one class and one entry here."""

    name: str
    cls: str
    short: str
    abbreviation: str
    colour: str
    needs_model: bool = False
    stochastic: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)
    run_options: tuple[str, ...] = ()
    #: The fitted values (attributes ending in "_") it maps logits or inputs with: saved with it, and
    #: a saved calibrator without them is refused when it is loaded (not when it is first used).
    fitted: tuple[str, ...] = ()
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


_NC = ("gamma", "progress", "callback")
_T, _WB, _DT = ("temperature_",), ("weight_", "bias_"), ("delta_", "temperature_")

METHODS: dict[str, MethodSpec] = {
    s.name: s
    for s in (
        MethodSpec(name="Uncalibrated", short="uncal", abbreviation="uncal.", colour="#7f7f7f",
                   cls="Uncalibrated", description="the model's own logits"),
        MethodSpec(name="Temperature Scaling", short="ts", abbreviation="TS", colour="#ff7f0e",
                   cls="TemperatureScaling", fitted=_T, description="z/T, T minimising NLL"),
        MethodSpec(name="TS by Grid Search", short="ts-grid", abbreviation="TS grid", colour="#1f77b4",
                   cls="GridSearchTemperature", fitted=_T, run_options=("progress",),
                   description="z/T, T on 0.001…5.000 with the lowest calibration ECE"),
        MethodSpec(name="Temperature Scaling (FL)", short="ts-fl", abbreviation="TS (FL)", colour="#ffbb78",
                   cls="FocalTemperatureScaling", fitted=_T, defaults={"gamma": 1.0}, run_options=("gamma",),
                   description="z/T, T minimising the focal loss (γ = 1)"),
        MethodSpec(name="Vector Scaling", short="vs", abbreviation="VS", colour="#8c564b",
                   cls="VectorScaling", fitted=_WB, run_options=("callback",), description="diag(w)·z + b, NLL"),
        MethodSpec(name="Matrix Scaling", short="ms", abbreviation="MS", colour="#e377c2",
                   cls="MatrixScaling", fitted=_WB, run_options=("callback",),
                   description="W·z + b, NLL, no regulariser"),
        MethodSpec(name="MS-ODIR", short="ms-odir", abbreviation="MS-ODIR", colour="#bcbd22",
                   cls="MatrixScalingODIR", fitted=_WB, run_options=("progress", "callback"),
                   description="W·z + b with off-diagonal and intercept regularisation"),
        MethodSpec(name="Dir-ODIR", short="dir-odir", abbreviation="Dir-ODIR", colour="#9467bd",
                   cls="DirichletODIR", fitted=_WB, run_options=("progress", "callback"),
                   description="W·log softmax(z) + b with ODIR"),
        MethodSpec(name="Structured Vector Scaling", short="svs", abbreviation="SVS", colour="#2ca02c",
                   cls="StructuredVectorScaling", fitted=("temperature_", "uniform_weight_", "scale_", "bias_",
                                                          "n_classes_"),
                   description="v ⊙ log p_TS + b, ridge towards the identity (Berta et al. 2025)"),
        MethodSpec(name="Structured Matrix Scaling", short="sms", abbreviation="SMS", colour="#98df8a",
                   cls="StructuredMatrixScaling", fitted=("temperature_", "uniform_weight_", "weight_", "bias_",
                                                          "n_classes_"),
                   description="W·log p_TS + b, ridge on intercept, diagonal and off-diagonal (Berta et al. 2025)"),
        MethodSpec(name="Ensemble Temperature Scaling", short="ets", abbreviation="ETS", colour="#aec7e8",
                   cls="EnsembleTemperatureScaling", fitted=("temperature_", "weights_"),
                   description="w₁·softmax(z/T) + w₂·softmax(z) + w₃/K, fitted by squared error (Zhang et al. 2020)"),
        MethodSpec(name="Histogram Binning", short="hb", abbreviation="HB", colour="#c5b0d5",
                   cls="HistogramBinning", fitted=("bin_edges_", "bin_values_", "n_classes_"),
                   description="each class's probability replaced by its bin's frequency, 15 equal-mass bins, "
                               "one-vs-rest, renormalised"),
        MethodSpec(name="Isotonic Regression", short="iso", abbreviation="Isotonic", colour="#dbdb8d",
                   cls="IsotonicRegression", fitted=("thresholds_", "values_", "n_classes_"),
                   description="each class's probability through a fitted non-decreasing map, one-vs-rest, "
                               "renormalised"),
        MethodSpec(name="SMART", short="smart", abbreviation="SMART", colour="#393b79", cls="SMART",
                   fitted=("network_", "gap_mean_", "gap_std_"),
                   description="z/T(x), T from a small network of the top-two logit gap, trained on a soft ECE "
                               "(arXiv 2506.23492)"),
        MethodSpec(name="Spline Calibration", short="spline", abbreviation="Spline", colour="#637939",
                   cls="SplineCalibration", fitted=("thresholds_", "values_"),
                   description="top-label confidence through a natural cubic spline of cumulative accuracy, "
                               "6 knots (Gupta et al. 2021)"),
        MethodSpec(name="TS + TvA", short="ts-tva", abbreviation="TS+TvA", colour="#8c6d31",
                   cls="TopVersusAllTemperature", fitted=_T,
                   description="z/T, T minimising the top-label binary cross-entropy (Top-versus-All, 2024)"),
        MethodSpec(name="VS + TvA", short="vs-tva", abbreviation="VS+TvA", colour="#843c39",
                   cls="TopVersusAllVector", fitted=("scale_", "n_classes_"),
                   description="z⊙v, v by the top-label binary cross-entropy + 0.1·mean((v−1)²), Adam "
                               "(Top-versus-All, 2024)"),
        MethodSpec(name="HB + TvA", short="hb-tva", abbreviation="HB+TvA", colour="#7b4173",
                   cls="TopVersusAllBinning", fitted=("bin_edges_", "bin_values_"),
                   description="top-label confidence replaced by its bin's accuracy, 15 equal-mass bins "
                               "(Top-versus-All, 2024)"),
        MethodSpec(name="Isotonic + TvA", short="iso-tva", abbreviation="Iso+TvA", colour="#e7969c",
                   cls="TopVersusAllIsotonic", fitted=("thresholds_", "values_"),
                   description="top-label confidence through a fitted non-decreasing map (Top-versus-All, 2024)"),
        MethodSpec(name="Neural Clamping (CE)", short="nc-ce", abbreviation="NC (CE)", colour="#ff9896",
                   cls="NeuralClamping", fitted=_DT, needs_model=True, stochastic=True, defaults={"gamma": 0.0},
                   run_options=_NC, description="f(x + δ)/T, cross entropy"),
        MethodSpec(name="Neural Clamping (FL)", short="nc-fl", abbreviation="NC (FL)", colour="#d62728",
                   cls="NeuralClamping", fitted=_DT, needs_model=True, stochastic=True, defaults={"gamma": 1.0},
                   run_options=_NC, description="f(x + δ)/T, focal loss (γ = 1)"),
        MethodSpec(name="NC (Eff.)", short="nc-eff", abbreviation="NC (Eff.)", colour="#17becf",
                   cls="EfficientNeuralClamping", fitted=_DT, needs_model=True,
                   description="Theorem 1's δ̃, then T by grid search; no training"),
    )
}


def method_spec(name: str) -> MethodSpec | None:
    """The registry's entry for ``name``: a method's name or its short name, case-insensitive (None
    when there is none)."""
    key = str(name).strip().lower()
    return next((s for s in METHODS.values() if key in (s.name.lower(), s.short)), None)


def abbreviation(name: str) -> str:
    """The abbreviation of method ``name`` in tables and figures ("TS", "NC (FL)"); a name the registry
    does not hold (an ablation row) is its own."""
    spec = METHODS.get(name)
    return spec.abbreviation if spec is not None else name


def colour(name: str, fallback: str = "#7f7f7f") -> str:
    """The colour of method ``name`` in figures (``fallback`` for a name the registry does not hold)."""
    spec = METHODS.get(name)
    return spec.colour if spec is not None else fallback


def short_names() -> dict[str, str]:
    """The CLI's short names: {short name: method name}."""
    return {s.short: s.name for s in METHODS.values()}


def trained_input_methods() -> tuple[str, ...]:
    """The methods that train an input perturbation on the model (Neural Clamping's rows)."""
    return tuple(n for n, s in METHODS.items() if s.needs_model and s.stochastic)


def make_method(name: str, model: Any = None, **overrides: Any) -> Any:
    """Build the method called ``name`` (a key of ``METHODS`` or its short name, case-insensitive)."""
    spec = method_spec(name)
    if spec is None:
        raise ValueError(f"Unknown calibration method {name!r}; choose from: {', '.join(METHODS)}.")
    return spec.factory(model, **overrides)
