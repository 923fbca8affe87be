"""The pre-computed result shipped with the app (``assets/precomputed``, made by
``scripts/make_precomputed.py``): the first result a visitor sees, and the Learn tab's
fallback when the visitor has not run a calibration.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from nctv.data import assets_dir
from nctv.ui.caches import get_logits
from nctv.ui.session import NC_METHODS, TS_METHOD, Calibration, SplitSpec

PRECOMPUTED_LABEL = "pre-computed, shipped with the app"


def precomputed_dir() -> Path:
    return assets_dir() / "precomputed"


def shipped_study(name: str) -> tuple[dict, Path] | None:
    """The study file ``name`` shipped beside the pre-computed result (its data and path), or None."""
    import json

    path = precomputed_dir() / name
    return (json.loads(path.read_text(encoding="utf-8")), path) if path.is_file() else None


def examples_dir() -> Path:
    return precomputed_dir() / "examples"


@dataclass
class Precomputed:
    """The shipped result for the default model (``scripts/make_precomputed.py``): the run's
    ``RunResult`` with every method's calibrated test logits attached, and NC's δ."""

    result: Any
    calibration: Calibration

    @property
    def split(self) -> SplitSpec:
        """The splits the shipped result was made on (its calibration's split)."""
        return self.calibration.split


@lru_cache(maxsize=1)
def load_precomputed() -> Precomputed | None:
    """Read ``assets/precomputed`` (None when it is absent: the app then starts without it)."""
    from nctv.results import RunResult

    folder = precomputed_dir()
    if not all((folder / n).is_file() for n in ("results.json", "test_logits.safetensors", "delta.safetensors")):
        return None
    result = RunResult.load(folder)
    nc = next((n for n in NC_METHODS if n in result.methods), None)
    cal = Calibration(
        # scripts/make_precomputed.py uses one seed for the calibration draw and the run, and the whole test pool.
        split=SplitSpec(result.model["name"], result.settings.get("dataset"), int(result.calibration["size"]),
                        int(result.seeds[0])),
        model=result.model["name"],
        ts_temperature=float(result.methods[TS_METHOD].params["temperature"]),
        nc_temperature=float(result.methods[nc].params["temperature"]) if nc else None,
        delta=result.methods[nc].delta if nc else None,
        nc_method=nc,
        source=PRECOMPUTED_LABEL,
        n_bins=result.bins[0],
        settings=dict(result.settings),
        metrics=test_metrics(result, result.bins[0]),
    )
    return Precomputed(result, cal)


def test_metrics(result: Any, n_bins: int) -> dict[str, dict[str, float]]:
    """{method: {metric: mean}} (fractions) of a ``RunResult`` at ``n_bins`` bins."""
    return {name: {k: s.mean for k, s in m.metrics[n_bins].items()} for name, m in result.methods.items()}


def test_logits_of(cal: Calibration | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Unperturbed test logits, labels and a description for the Learn tab: the visitor's run,
    else the shipped result."""
    if cal is not None and cal.split is not None:
        z, y = get_logits(cal.split, "test")
        return z, y, f"{cal.model}, test split of your run"
    pre = load_precomputed()
    if pre is None:
        raise ValueError("No calibration yet: run one in the Calibrate tab first.")
    r = pre.result
    where = f"{r.model['name']}, {r.test['name']} ({PRECOMPUTED_LABEL})"
    return r.methods["Uncalibrated"].test_logits, r.test_labels, where
