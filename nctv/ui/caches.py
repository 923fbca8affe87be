"""Server-wide caches: models, splits, unperturbed logits, weight fingerprints and
out-of-distribution detectors, read-only and shared, so a second visitor does not pay again.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

import torch

from nctv import forkgate
from nctv.checks import env_limit
from nctv.hub import max_model_bytes
from nctv.ui.limits import DEFAULT_MAX_MODELS, data_roots
from nctv.ui.session import TS_METHOD, SplitSpec


class Memo:
    """A small thread-safe LRU memo: one computation per key even when visitors ask at once."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()
        self._locks: dict[Any, threading.Lock] = {}
        self._guard = threading.Lock()

    def holds(self, key: Any) -> bool:
        with self._guard:
            return key in self._data

    def get(self, key: Any, compute: Callable[[], Any]) -> Any:
        with self._guard:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
            lock = self._locks.setdefault(key, threading.Lock())
        with forkgate.paused():  # waiting for another visitor's computation of the same key
            lock.acquire()
        try:
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
        finally:
            lock.release()


#: Models held in memory at once (``$NCTV_MAX_MODELS``, read at start); the least recently used goes first.
_models = Memo(env_limit("NCTV_MAX_MODELS", DEFAULT_MAX_MODELS))
_splits = Memo(6)
_logits = Memo(8)
_hashes = Memo(8)
_detectors = Memo(4)


def get_model(name: str):
    """The zoo's ``LoadedModel`` for ``name`` on the best device here (loaded once per server; on
    ZeroGPU the server keeps it on the CPU and a GPU worker moves its inherited copy: ``nctv.ui.gpu``)."""
    from nctv.ui.gpu import model_device, placed
    from nctv.zoo import load_model

    return placed(_models.get(name, lambda: load_model(name, device=model_device(),
                                                       max_weight_bytes=max_model_bytes())))


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


#: Splits of pre-computed studies whose pictures are not on this server (a downloaded dataset): a view
#: of the study never fetches them, only a run does (:func:`mark_view_only`, :func:`test_pictures`).
_view_only: set[SplitSpec] = set()


def mark_view_only(spec: SplitSpec) -> None:
    """Say that ``spec`` is a pre-computed study's draw whose pictures are downloaded, not embedded:
    showing the study must not fetch them (ImageNet's would be a gigabyte on the server, for one
    picture; or, without a token, Imagenette's pictures in place of the study's)."""
    _view_only.add(spec)


def pictures_here(spec: SplitSpec) -> bool:
    """Whether a view may use ``spec``'s splits: not for a pre-computed study's downloaded dataset
    that this server has not loaded for a run (:func:`mark_view_only`)."""
    return spec not in _view_only or _splits.holds(spec)


def test_pictures(spec: SplitSpec):
    """``spec``'s test split, for showing its pictures: refused in words (``ValueError``) where
    :func:`pictures_here` says no."""
    if not pictures_here(spec):
        raise ValueError(PICTURES_NOT_HERE)
    return get_splits(spec)[1]


PICTURES_NOT_HERE = ("The pictures of this pre-computed study are not on this server: its dataset is downloaded "
                     "only for a run. Press Run calibration to see them.")


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


def remember_logits(spec: SplitSpec, which: str, logits: torch.Tensor, labels: torch.Tensor) -> None:
    """Keep logits a GPU worker computed (and returned) as ``spec``'s ``which`` split's, so that the
    server does not compute them again: a ZeroGPU worker's memory does not come back."""
    cal, test = get_splits(spec)
    split = cal if which == "calibration" else test
    _logits.get((spec.model, split.fingerprint), lambda: (logits, labels))


def remember_detector(spec: SplitSpec, detector: Any) -> None:
    """Keep an out-of-distribution detector a GPU worker fitted (and returned) for ``spec``."""
    _detectors.get(spec, lambda: detector)


def has_ood_detector(spec: SplitSpec) -> bool:
    """Whether this server already holds ``spec``'s out-of-distribution detector."""
    return _detectors.holds(spec)


def ts_temperature_of(spec: SplitSpec) -> float:
    """Temperature scaling fitted on ``spec``'s cached calibration logits (the Try tab always
    compares with it; on cached logits it costs nothing)."""
    from nctv.calibration import METHODS

    return float(METHODS[TS_METHOD].factory().fit(*get_logits(spec, "calibration")).temperature_)


def get_ood_detector(spec: SplitSpec, saved: Callable[[], Any] | None = None):
    """The out-of-distribution detector (:mod:`nctv.ood`) of ``spec``'s model: ``saved()`` when it
    gives one (a detector shipped with a pre-computed study: ``nctv.ui.shipped.ood_detector``), else
    fitted on its calibration split, threshold set on its test split; once per server."""
    from nctv.ood import fit_on_splits

    def make():
        found = saved() if saved is not None else None
        if found is not None:
            return found
        test_pictures(spec)  # a pre-computed study's downloaded pictures are not fetched for a view
        cal, test = get_splits(spec)
        return fit_on_splits(get_model(spec.model).model, cal, test)

    return _detectors.get(spec, make)


_conformal = Memo(8)


def conformal_predictor(spec: SplitSpec, temperature: float):
    """The Try tab's conformal sets: LAC at 90 % (:mod:`nctv.conformal`'s defaults) on temperature
    scaling's probabilities (``temperature``), made on ``spec``'s calibration split, once per server;
    None where that split's pictures are not on this server (a pre-computed study of a downloaded
    dataset: its logits would need them)."""
    from nctv.conformal import ConformalPredictor

    if not pictures_here(spec):
        return None

    def make():
        z, y = get_logits(spec, "calibration")
        return ConformalPredictor().fit(z.double() / temperature, y)

    return _conformal.get((spec, float(temperature)), make)


def prepare_run(spec: Any, work_of: Callable[[Any, int, int], Work], report: Callable[[Any], None],
                item: Callable[[float, str], tuple] = lambda f, m: ("progress", f, m)) -> tuple[float, int, int]:
    """A heavy run's part in the server before its GPU call: the model and the splits of ``spec``
    (which the GPU worker then inherits through the fork instead of decoding them again), and the
    call's estimated seconds for ``work_of(model, calibration size, test size)``. ``item(fraction,
    message)`` makes the progress items ``report`` gets. Returns (seconds, calibration size, test size)."""
    from nctv.ui.gpu import estimate_seconds, forward_flops

    report(item(0.0, f"loading model {spec.model}"))
    loaded = get_model(spec.model)
    report(item(0.01, "loading the calibration and test splits"))
    cal, test = get_splits(spec)
    return estimate_seconds(forward_flops(loaded), work_of(loaded, len(cal), len(test))), len(cal), len(test)
