"""Every setting that more than one part of NCTV uses, defined once (no heavy imports here).

The library, the command line, the web app, the bench and the scripts read these names; docs/method.md
explains the choices and docs/glossary.md the names.
"""
from __future__ import annotations

import importlib.util

#: Neural Clamping fitters: "fast" (the default: T chosen by calibration ECE, then δ by L-BFGS), and the
#: two published SGD recipes run exactly, "paper" (the paper's text with the authors' momentum) and
#: "toolkit" (the authors' released demo).
FITTERS = ("fast", "paper", "toolkit")
#: How Neural Clamping sets T (nctv.calibration.clamping: "anchored" is the fast fitter's default and
#: its only, "fitted" the recipes' default).
TEMPERATURE_RULES = ("anchored", "fitted", "selected")
#: Precisions of the model's passes (nctv.precision): "auto" measures on a GPU; "fp32" forces full precision.
PRECISIONS = ("auto", "fp32", "bf16", "fp16")

#: The rows of a paper-style table (Tables 1–3), in order.
DEFAULT_METHODS = (
    "Uncalibrated",
    "Temperature Scaling",
    "TS by Grid Search",
    "Vector Scaling",
    "Matrix Scaling",
    "MS-ODIR",
    "Dir-ODIR",
    "Neural Clamping (CE)",
    "Neural Clamping (FL)",
    "NC (Eff.)",
)
#: The rows of the ablation (Table 4), with δ frozen at 0 beside the input-only and output-only parts.
ABLATION_METHODS = (
    "Uncalibrated",
    "Temperature Scaling",
    "Temperature Scaling (FL)",
    "NC input only",
    "NC output only",
    "NC δ frozen at 0",
    "Neural Clamping (FL)",
)
#: Calibration images drawn from the calibration pool (the paper's 5,000 for Fashion-MNIST/CIFAR),
#: by the library, the command line and the web app alike.
DEFAULT_CALIBRATION_SIZE = 5000
#: Bin counts every table reports, and the runs (seeds) of every stochastic method.
DEFAULT_BINS = (10, 15, 20)
DEFAULT_SEEDS = 5
#: Grid resolutions of the timing table (Table 7).
TIMING_RESOLUTIONS = (0.01, 0.001)
#: Intervals of a run's figures (nctv.intervals): coverage, resamples of the test split, and how a
#: table shows them ("value [low, high]" or "value ± half-width").
DEFAULT_LEVEL = 0.95
DEFAULT_RESAMPLES = 1000
INTERVAL_STYLES = ("brackets", "pm")


def hub_datasets_available() -> bool:
    """Whether ``hf-dataset:<org/name>`` can be offered: the optional ``datasets`` package is installed."""
    return importlib.util.find_spec("datasets") is not None
