"""Per-visitor state: the splits a visitor picked and the :class:`Calibration` that lives in a
``gr.State`` (no visitor sees another's).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nctv.methods import trained_input_methods
from nctv.results import COMPARED_METHOD
from nctv.settings import APP_BINS, DEFAULT_CALIBRATION_SIZE

#: Method names (paper names) of the two calibrations the Try tab compares with the raw model.
TS_METHOD = "Temperature Scaling"
NC_METHODS = tuple(sorted(trained_input_methods(), key=lambda name: name != COMPARED_METHOD))


@dataclass(frozen=True)
class SplitSpec:
    """Which model and which calibration/test splits (enough to rebuild them after eviction)."""

    model: str
    dataset: str | None = None
    calibration_size: int = DEFAULT_CALIBRATION_SIZE
    calibration_seed: int = 0
    #: Test images drawn from the test pool; None = all of it.
    test_size: int | None = None


@dataclass
class Calibration:
    """One visitor's current calibration, as the Try and Learn tabs need it.

    ``delta`` is Neural Clamping's δ in the model's normalised input space (C, H, W), None when NC
    was not run; temperatures are positive floats; ``source`` says where it came from.
    """

    split: SplitSpec | None
    model: str
    ts_temperature: float
    nc_temperature: float | None
    delta: torch.Tensor | None
    nc_method: str | None
    source: str
    n_bins: int = APP_BINS
    settings: dict = field(default_factory=dict)
    #: Test-split metrics (fractions) per method at ``n_bins`` bins, for the Learn tab's text.
    metrics: dict = field(default_factory=dict)
