"""What the app keeps: server-wide caches (models, splits, unperturbed logits: read-only and
shared, so a second visitor does not pay again), the pre-computed result shipped with the app,
and the per-visitor :class:`Calibration` that lives in a ``gr.State`` (no visitor sees another's).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from nctv.checks import env_limit
from nctv.data import DATASETS, allowed_folder, assets_dir
from nctv.hub import max_model_bytes

from nctv.settings import APP_BINS, DEFAULT_CALIBRATION_SIZE, hub_datasets_available  # noqa: E402 - the app's defaults are the library's

PRECOMPUTED_LABEL = "pre-computed, shipped with the app"
#: Method names (paper names) of the two calibrations the Try tab compares with the raw model.
TS_METHOD = "Temperature Scaling"
NC_METHODS = ("Neural Clamping (FL)", "Neural Clamping (CE)")
DEFAULT_DATASET_CHOICE = "model's own dataset"


def precomputed_dir() -> Path:
    return assets_dir() / "precomputed"


def examples_dir() -> Path:
    return precomputed_dir() / "examples"


# --------------------------------------------------------------------------- the operator's settings
# Safe by default on a public server: no server folders, Hub models of bounded size, few in memory.
# docs/app.md, "Running a public copy", lists every variable.

DEFAULT_MAX_MODELS = 3


def data_roots() -> list[Path]:
    """Folders inside which visitors may name image folders as datasets: ``$NCTV_DATA_ROOTS``
    (separated by ``os.pathsep``); none when unset."""
    return [Path(p) for p in os.environ.get("NCTV_DATA_ROOTS", "").split(os.pathsep) if p.strip()]


def hub_datasets_allowed() -> bool:
    """Whether visitors may name Hugging Face datasets (``$NCTV_HUB_DATASETS=1``); a dataset's
    size is not known before it downloads, so they are off by default."""
    return os.environ.get("NCTV_HUB_DATASETS", "").strip().lower() in ("1", "true", "yes")


# --------------------------------------------------------------------------- shared caches


class Memo:
    """A small thread-safe LRU memo: one computation per key even when visitors ask at once."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()
        self._locks: dict[Any, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, key: Any, compute: Callable[[], Any]) -> Any:
        with self._guard:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            with self._guard:
                if key in self._data:
                    return self._data[key]
            value = compute()
            with self._guard:
                self._data[key] = value
                self._data.move_to_end(key)
                while len(self._data) > self.maxsize:
                    self._data.popitem(last=False)
                self._locks.pop(key, None)
            return value


#: Models held in memory at once (``$NCTV_MAX_MODELS``, read at start); the least recently used goes first.
_models = Memo(env_limit("NCTV_MAX_MODELS", DEFAULT_MAX_MODELS))
_splits = Memo(6)
_logits = Memo(8)
_hashes = Memo(8)
_detectors = Memo(4)


@dataclass(frozen=True)
class SplitSpec:
    """Which model and which calibration/test splits (enough to rebuild them after eviction)."""

    model: str
    dataset: str | None = None
    calibration_size: int = DEFAULT_CALIBRATION_SIZE
    calibration_seed: int = 0
    #: Test images drawn from the test pool; None = all of it.
    test_size: int | None = None


def get_model(name: str):
    """The zoo's ``LoadedModel`` for ``name`` on the best device here (loaded once per server)."""
    from nctv.inference import resolve_device
    from nctv.zoo import load_model

    return _models.get(name, lambda: load_model(name, device=resolve_device(None), max_weight_bytes=max_model_bytes()))


def model_hash(name: str) -> str:
    """The model's weight fingerprint (keys the on-disk logit cache), computed once per model."""
    from nctv.cache import model_fingerprint

    return _hashes.get(name, lambda: model_fingerprint(get_model(name).model))


def get_splits(spec: SplitSpec):
    """(calibration, test) splits of ``spec`` (see :func:`nctv.data.get_splits`)."""
    from nctv.data import get_splits as data_splits

    def make():
        return data_splits(get_model(spec.model), dataset=spec.dataset, calibration_size=spec.calibration_size,
                           calibration_seed=spec.calibration_seed, test_size=spec.test_size,
                           folder_roots=data_roots())

    return _splits.get(spec, make)


def get_logits(spec: SplitSpec, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Unperturbed logits (N, K) and labels (N,) of the model on its ``which`` ("calibration"/"test")
    split, from memory, else from the on-disk logit cache of :func:`nctv.cache.split_logits`."""
    from nctv.cache import split_logits

    cal, test = get_splits(spec)
    split = cal if which == "calibration" else test
    key = (spec.model, split.fingerprint)

    def make():
        cached = split_logits(get_model(spec.model).model, split, model_hash=model_hash(spec.model))
        return cached.logits, cached.labels

    return _logits.get(key, make)


def ts_temperature_of(spec: SplitSpec) -> float:
    """Temperature scaling fitted on ``spec``'s cached calibration logits (the Try tab always
    compares with it; on cached logits it costs nothing)."""
    from nctv.calibration import METHODS

    return float(METHODS[TS_METHOD].factory().fit(*get_logits(spec, "calibration")).temperature_)


def get_ood_detector(spec: SplitSpec):
    """The out-of-distribution detector (:mod:`nctv.ood`) of ``spec``'s model: fitted on its
    calibration split, threshold set on its test split, once per server."""
    from nctv.ood import fit_on_splits

    def make():
        cal, test = get_splits(spec)
        return fit_on_splits(get_model(spec.model).model, cal, test)

    return _detectors.get(spec, make)


def model_choices() -> list[tuple[str, str]]:
    """(label, name) pairs for the model menu: embedded models first, then the Hub entries."""
    from nctv.zoo import list_models

    out = []
    for e in list_models():
        where = "embedded, offline" if e.embedded else "Hugging Face Hub, needs the network once"
        out.append((f"{e.name} ({where})", e.name))
    return out


def dataset_choices() -> list[str]:
    return [DEFAULT_DATASET_CHOICE] + [k for k in DATASETS if "<" not in k]


def dataset_hint() -> str | None:
    """What else the dataset box takes on this server (None: only the listed datasets): folders
    where the operator allows some, ``hf-dataset:`` where allowed and ``datasets`` is installed."""
    ways = (["folder:/path (one sub-folder per class)"] * bool(data_roots())
            + ["hf-dataset:org/name@split"] * (hub_datasets_allowed() and hub_datasets_available()))
    return f"Or type {' or '.join(ways)}" if ways else None


def resolve_model_name(choice: str | None, hub_id: str | None) -> str:
    """The model to use: the typed Hub id when there is one, else the menu choice."""
    typed = (hub_id or "").strip()
    if typed:
        if typed.lower().startswith("local-dir:"):
            raise ValueError("This box takes a Hugging Face Hub model id such as timm/resnet18.a1_in1k; "
                             "local folders are used through the nctv command instead.")
        # An <org>/<name> is said to be a Hub id, so that no server folder of that name is looked at.
        return f"hf-hub:{typed}" if "/" in typed and ":" not in typed else typed
    if not choice:
        raise ValueError("Pick a model from the list (or type a Hugging Face Hub id).")
    return str(choice)


def resolve_dataset(choice: str | None) -> str | None:
    """The dataset to use (None: the model's own), refused at once when this server does not
    allow it (see :func:`data_roots`, :func:`hub_datasets_allowed`)."""
    text = (choice or "").strip()
    if text in ("", DEFAULT_DATASET_CHOICE):
        return None
    if text.startswith("hf-dataset:") and not hub_datasets_allowed():
        raise ValueError("This server does not download Hugging Face datasets (its operator has not allowed them: "
                         "NCTV_HUB_DATASETS); pick a dataset from the list.")
    if text.startswith("folder:"):
        allowed_folder(text[len("folder:"):], data_roots())  # before any model loads
    return text


# --------------------------------------------------------------------------- per-visitor state


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


# --------------------------------------------------------------------------- shipped result


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
