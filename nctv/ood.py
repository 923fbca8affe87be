"""Out-of-distribution check: does a picture look like the images a classifier was made for?

A classifier gives every picture one of its classes, however foreign the picture. This module
scores how unlike the in-distribution images a picture is, by the class-conditional Gaussian model
of Lee et al. (NeurIPS 2018, "A simple unified framework for detecting out-of-distribution samples
and adversarial attacks"): on the model's penultimate features, one mean per class and one shared
covariance; a picture's score is its smallest Mahalanobis distance to a class mean. The covariance
is shrunk towards a multiple of the identity (Ledoit-Wolf, or a fixed amount) so that it is
invertible even with fewer images than feature dimensions. The threshold is a high quantile of the
same score on held-out in-distribution images, so that about ``1 - quantile`` of them are flagged.

:class:`MahalanobisDetector` works on feature tensors (scikit-learn shape: the constructor stores
settings, ``fit`` learns, learned state ends in ``_``); :func:`penultimate_features` and
:func:`fit_on_splits` connect it to a model and its calibration / test splits.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nctv.calibration.base import NotFittedError
from nctv.checks import check_whole
from nctv.data import as_split, subsample
from nctv.inference import model_logits

DEFAULT_QUANTILE = 0.99
#: Images used to fit the class means and covariance, and to set the threshold: enough for a
#: stable estimate, few enough for a few seconds on a CPU.
MAX_FIT_IMAGES = 2000
MAX_THRESHOLD_IMAGES = 1000
LEDOIT_WOLF = "ledoit-wolf"


def _features(values: Any, what: str) -> torch.Tensor:
    f = torch.as_tensor(np.asarray(values) if not isinstance(values, torch.Tensor) else values)
    if f.ndim != 2 or f.shape[0] == 0 or f.shape[1] == 0:
        raise ValueError(f"The {what} must be a non-empty table of shape (images, features); got shape {tuple(f.shape)}.")
    if not f.is_floating_point() or not torch.isfinite(f).all():
        raise ValueError(f"The {what} must be finite real numbers (no NaN or infinity).")
    return f.detach().double().cpu()


def _labels(values: Any, n: int) -> torch.Tensor:
    y = torch.as_tensor(np.asarray(values) if not isinstance(values, torch.Tensor) else values)
    if y.ndim != 1 or y.shape[0] != n:
        raise ValueError(f"Give one class label per image: {n} images but labels of shape {tuple(y.shape)}.")
    if y.is_floating_point() or y.dtype == torch.bool or (y < 0).any():
        raise ValueError("Class labels must be whole numbers ≥ 0 (class indices).")
    return y.long().cpu()


def ledoit_wolf_shrinkage(centred: torch.Tensor) -> float:
    """The Ledoit-Wolf (2004) weight of the scaled identity in the shrunk covariance of ``centred``
    (N, D) rows: min(1, b̄² / d²) with d² = ‖S − mI‖²_F and b̄² = Σₖ ‖xₖxₖᵀ − S‖²_F / N²."""
    n = centred.shape[0]
    s = centred.T @ centred / n
    m = torch.trace(s) / s.shape[0]
    d2 = ((s - m * torch.eye(s.shape[0], dtype=s.dtype)) ** 2).sum()
    if d2 <= 0:
        return 0.0  # already a multiple of the identity
    b2 = ((centred ** 2).sum(1) ** 2).sum() / n**2 - (s ** 2).sum() / n
    return float((b2.clamp_min(0) / d2).clamp_max(1.0))


class MahalanobisDetector:
    """Class-conditional Gaussian out-of-distribution score on features (Lee et al., 2018).

    ``quantile``: the threshold is this quantile of the score on held-out in-distribution features
    (0.99 flags about 1 % of them). ``shrinkage``: ``"ledoit-wolf"`` or a weight in [0, 1] of the
    scaled identity in the shared covariance, (1 − w)·S + w·(tr S / D)·I.

    Learned: ``classes_`` (K,) the labels seen, ``means_`` (K, D), ``covariance_`` and
    ``precision_`` (D, D), ``shrinkage_`` (the weight used), ``n_samples_fit_`` (N),
    ``n_features_in_`` (D), ``held_out_scores_`` (M,) and ``threshold_``.
    """

    def __init__(self, quantile: float = DEFAULT_QUANTILE, shrinkage: float | str = LEDOIT_WOLF):
        self.quantile = quantile
        self.shrinkage = shrinkage

    def _check_settings(self) -> None:
        q = self.quantile
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q < 1:
            raise ValueError(f"quantile must be a fraction between 0 and 1 (e.g. 0.99); got {q!r}.")
        w = self.shrinkage
        if w != LEDOIT_WOLF and (isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1):
            raise ValueError(f"shrinkage must be {LEDOIT_WOLF!r} or a weight from 0 to 1; got {w!r}.")

    def fit(self, features: Any, labels: Any, held_out: Any) -> "MahalanobisDetector":
        """Class means and shared covariance from ``features`` (N, D) with ``labels`` (N,); the
        threshold from ``held_out`` (M, D): features of other in-distribution images."""
        self._check_settings()
        f = _features(features, "features")
        y = _labels(labels, f.shape[0])
        h = _features(held_out, "held-out features")
        if h.shape[1] != f.shape[1]:
            raise ValueError(f"The held-out features have {h.shape[1]} dimensions but the features {f.shape[1]}.")
        self.classes_, index = torch.unique(y, return_inverse=True)
        counts = torch.bincount(index, minlength=len(self.classes_)).double()
        self.means_ = torch.zeros(len(self.classes_), f.shape[1], dtype=f.dtype).index_add_(0, index, f) / counts[:, None]
        self._fit_covariance(f - self.means_[index])
        self.n_features_in_, self.n_samples_fit_ = f.shape[1], f.shape[0]
        self.held_out_scores_ = self.score(h)
        self.threshold_ = float(torch.quantile(self.held_out_scores_, float(self.quantile)))
        return self

    def _fit_covariance(self, centred: torch.Tensor) -> None:
        s = centred.T @ centred / centred.shape[0]
        scale = float(torch.trace(s)) / s.shape[0]
        if scale <= 0:
            raise ValueError("The features do not vary within any class, so no covariance can be estimated; "
                             "fit on more, and more varied, images.")
        w = ledoit_wolf_shrinkage(centred) if self.shrinkage == LEDOIT_WOLF else float(self.shrinkage)
        self.shrinkage_ = w
        self.covariance_ = (1 - w) * s + w * scale * torch.eye(s.shape[0], dtype=s.dtype)
        chol, info = torch.linalg.cholesky_ex(self.covariance_)
        if int(info) != 0:
            raise ValueError("The covariance of the features is singular (fewer varied images than feature "
                             "dimensions); use shrinkage above 0 or 'ledoit-wolf'.")
        self._chol = chol
        self.precision_ = torch.cholesky_inverse(chol)

    def _check_fitted(self, attr: str = "threshold_") -> None:
        if getattr(self, attr, None) is None:
            raise NotFittedError("MahalanobisDetector is not fitted yet: call fit(features, labels, held_out) first.")

    def _whiten(self, f: torch.Tensor) -> torch.Tensor:
        return torch.linalg.solve_triangular(self._chol, f.T, upper=False).T

    def score(self, features: Any) -> torch.Tensor:
        """Smallest Mahalanobis distance (N,) float64 of each row of ``features`` to a class mean."""
        self._check_fitted("_chol")
        f = _features(features, "features")
        if f.shape[1] != self.means_.shape[1]:
            raise ValueError(f"These features have {f.shape[1]} dimensions but the detector was fitted on "
                             f"{self.means_.shape[1]}; use features of the same model.")
        a, b = self._whiten(f), self._whiten(self.means_)
        # ‖a − b‖² expanded: no (N, K, D) intermediate, which ImageNet's 1,000 classes would make huge.
        d2 = (a ** 2).sum(1, keepdim=True) + (b ** 2).sum(1)[None, :] - 2 * a @ b.T
        return d2.clamp_min(0).min(dim=1).values.sqrt()

    def is_outlier(self, features: Any) -> torch.Tensor:
        """True (N,) where the score is above the threshold: out of distribution."""
        self._check_fitted()
        return self.score(features) > self.threshold_

    def __repr__(self) -> str:
        return f"MahalanobisDetector(quantile={self.quantile!r}, shrinkage={self.shrinkage!r})"


class _Penultimate(torch.nn.Module):
    """A timm model's features before its classifier (its logits when it has no such split)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.split = all(hasattr(model, a) for a in ("forward_features", "forward_head"))
        # model_logits restores the mode it finds on the module it is given: that must be the
        # model's, or a new wrapper (training=True) leaves the shared model training afterwards.
        self.train(model.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return self.model(x)
        return self.model.forward_head(self.model.forward_features(x), pre_logits=True).flatten(1)


def penultimate_features(model: torch.nn.Module, inputs: Any, labels: Any = None,
                         return_labels: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Penultimate features (N, D) float32 on the CPU of preprocessed ``inputs`` (a tensor or an
    iterable of batches, as for :func:`nctv.inference.model_logits`): timm's
    ``forward_head(forward_features(x), pre_logits=True)``, else the logits."""
    return model_logits(_Penultimate(model), inputs, labels, return_labels=return_labels)


def _sample(split: Any, size: int, seed: int, what: str) -> tuple[Any, Any]:
    """At most ``size`` images of ``split`` (a ``nctv.data.Split`` or a pair (inputs, labels)),
    chosen at random by ``seed``: (a loader, None) or (inputs, labels)."""
    split = as_split(split, what)
    if hasattr(split, "subset"):
        return subsample(split, min(size, len(split)), seed).loader(), None
    if not hasattr(split, "inputs"):
        raise ValueError(f"The {what} split must be a Split from nctv.data.get_splits or a pair (inputs, labels).")
    keep = torch.from_numpy(np.sort(np.random.default_rng(seed).permutation(len(split))[:size]))
    return split.inputs[keep], split.labels[keep]


def fit_on_splits(model: torch.nn.Module, calibration: Any, held_out: Any, *,
                  detector: MahalanobisDetector | None = None, max_fit_images: int = MAX_FIT_IMAGES,
                  max_threshold_images: int = MAX_THRESHOLD_IMAGES, seed: int = 0) -> MahalanobisDetector:
    """``detector`` (default settings if None) fitted on the penultimate features of at most
    ``max_fit_images`` images of the ``calibration`` split, its threshold set on at most
    ``max_threshold_images`` images of ``held_out`` (e.g. the test split), drawn at random by ``seed``."""
    for name, n in (("max_fit_images", max_fit_images), ("max_threshold_images", max_threshold_images)):
        check_whole(n, name, 2)
    f, y = penultimate_features(model, *_sample(calibration, max_fit_images, seed, "calibration"), return_labels=True)
    h = penultimate_features(model, _sample(held_out, max_threshold_images, seed, "held-out")[0])
    return (detector or MahalanobisDetector()).fit(f, y, h)


# --------------------------------------------------------------------------- saving and loading

#: A fitted detector beside a pre-computed study (``scripts/make_precomputed.py``), so that the Try tab
#: of a pre-computed calibration needs neither the model's calibration images nor a pass over them.
OOD_FILE = "ood.safetensors"
#: Largest detector file read: ImageNet's 1,000 class means and a 2,048-wide covariance take 50 MB.
MAX_DETECTOR_BYTES = 256 * 2**20
#: Largest safetensors header read (a detector's has four tensors and a few metadata strings).
MAX_DETECTOR_HEADER_BYTES = 64 * 2**10
_TENSORS = ("classes", "means", "covariance", "held_out_scores")


def split_about(model: str, dataset: str | None, calibration_size: int, calibration_seed: int,
                test_size: int | None) -> dict[str, str]:
    """What a detector was fitted on, as the strings :func:`save_detector` stores: the model and the
    calibration / test draw (a detector is reused only for the same draw)."""
    return {"model": model, "dataset": dataset or "", "calibration_size": str(int(calibration_size)),
            "calibration_seed": str(int(calibration_seed)), "test_size": "" if test_size is None else str(int(test_size))}


def save_detector(detector: MahalanobisDetector, path: Any, about: dict[str, str] | None = None) -> None:
    """Write a fitted ``detector`` as safetensors: its class labels, class means, shared covariance
    and held-out scores, with its quantile, shrinkage and image count (and ``about``, strings that
    say what it was fitted on) as metadata. :func:`load_detector` reads it back."""
    from safetensors.torch import save_file

    detector._check_fitted()
    tensors = {"classes": detector.classes_.to(torch.int64).contiguous(), "means": detector.means_.contiguous(),
               "covariance": detector.covariance_.contiguous(),
               "held_out_scores": detector.held_out_scores_.contiguous()}
    meta = {"kind": "nctv-ood-detector", "quantile": repr(float(detector.quantile)),
            "shrinkage": repr(float(detector.shrinkage_)), "n_samples_fit": str(int(detector.n_samples_fit_))}
    save_file(tensors, str(path), metadata={**(about or {}), **meta})


def _number(meta: dict[str, str], key: str, low: float, high: float, whole: bool = False) -> float:
    import math

    text = meta.get(key, "")
    try:
        value = float(text) if not whole else int(text) if text.isascii() and text.isdigit() else None
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"its {key} must be a {'whole ' if whole else ''}number from {low:g} to {high:g}")
    return value


def load_detector(path: Any, n_classes: int | None = None) -> tuple[MahalanobisDetector, dict[str, str]]:
    """A detector written by :func:`save_detector` and the strings it was saved with. Every value is
    checked before use (sizes from the header before any tensor is read; finite numbers; class labels
    distinct and below ``n_classes``; a covariance that is symmetric and positive definite; the
    threshold recomputed from the held-out scores, not trusted); a file that fails raises
    ``ValueError`` saying why."""
    from pathlib import Path

    from safetensors import SafetensorError, safe_open

    p = Path(path)
    where = f"The out-of-distribution detector {p.name}"
    size = p.stat().st_size
    with p.open("rb") as f:
        head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if size > MAX_DETECTOR_BYTES or not 2 <= n <= min(size - 8, MAX_DETECTOR_HEADER_BYTES):
        raise ValueError(f"{where} is not a detector file nctv wrote (its size or header length is wrong).")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = dict(f.metadata() or {})
            keys = set(f.keys())
            if meta.get("kind") != "nctv-ood-detector" or keys != set(_TENSORS):
                raise ValueError("it is not a detector file nctv wrote")
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in _TENSORS}
            (k, d), m = shapes["means"], shapes["held_out_scores"]
            if shapes["classes"] != (k,) or shapes["covariance"] != (d, d) or len(m) != 1 or min(k, d, m[0]) < 1:
                raise ValueError("its tensors' shapes do not fit together")
            tensors = {name: f.get_tensor(name) for name in _TENSORS}
    except SafetensorError:
        raise ValueError(f"{where} cannot be read as safetensors.") from None
    except ValueError as e:
        raise ValueError(f"{where} cannot be used: {e}.") from None
    try:
        classes = tensors["classes"]
        if classes.dtype != torch.int64 or len(torch.unique(classes)) != len(classes) or int(classes.min()) < 0 or (
                n_classes is not None and int(classes.max()) >= n_classes):
            raise ValueError(f"its class labels must be distinct class indices{'' if n_classes is None else f' below {n_classes}'}")
        floats = {name: tensors[name] for name in _TENSORS[1:]}
        if any(t.dtype != torch.float64 or not torch.isfinite(t).all() for t in floats.values()):
            raise ValueError("its means, covariance and scores must be finite 64-bit numbers")
        cov = floats["covariance"]
        if not torch.allclose(cov, cov.T, rtol=0, atol=1e-9 * float(cov.abs().max())):
            raise ValueError("its covariance is not symmetric")
        detector = MahalanobisDetector(quantile=_number(meta, "quantile", 1e-6, 1 - 1e-6),
                                       shrinkage=_number(meta, "shrinkage", 0, 1))
        detector.shrinkage_ = detector.shrinkage
        detector.classes_, detector.means_, detector.covariance_ = classes, floats["means"], cov
        chol, info = torch.linalg.cholesky_ex(cov)
        if int(info) != 0:
            raise ValueError("its covariance is not positive definite")
        detector._chol, detector.precision_ = chol, torch.cholesky_inverse(chol)
        detector.n_features_in_ = cov.shape[0]
        detector.n_samples_fit_ = int(_number(meta, "n_samples_fit", 2, 10**9, whole=True))
        detector.held_out_scores_ = floats["held_out_scores"]
        if bool((detector.held_out_scores_ < 0).any()):
            raise ValueError("its held-out scores must be distances, at least 0")
        detector.threshold_ = float(torch.quantile(detector.held_out_scores_, float(detector.quantile)))
    except ValueError as e:
        raise ValueError(f"{where} cannot be used: {e}.") from None
    about = {key: value for key, value in meta.items() if key not in ("kind", "quantile", "shrinkage", "n_samples_fit")}
    return detector, about
