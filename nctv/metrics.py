"""Calibration metrics: pure functions of ``(logits, labels)``.

Conventions, shared by every caller (tables, figures, γ selection, tests):

* Inputs are **logits** ``(N, K)`` (numpy array or torch tensor on any device) and integer labels
  ``(N,)``. Probabilities are accepted only with ``from_probabilities=True``.
* p = softmax(logits); confidence c_i = max_k p_ik; prediction = argmax_k p_ik, ties to the lowest
  index.
* Results are fractions (0.0–1.0) returned as Python floats; tables convert to %.
* ECE uses ``n_bins`` equal-width bins, bin m = ((m−1)/M, m/M]; the first bin also takes c = 0 and
  c = 1.0 falls in the last bin. Empty bins add 0, so more bins than samples is allowed.
* AECE sorts by confidence (stable sort) and splits into M contiguous groups whose sizes differ by at
  most one (as ``numpy.array_split``); every sample is counted exactly once, and with fewer samples
  than groups the last groups are empty and add 0.
* SCE bins p_ik of every class k with the ECE bins; K comes from the logits, never from the labels.
* Everything is computed on the CPU in float64, so a tensor on a GPU and the same values on the CPU
  give bit-identical results.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nctv.checks import check_bins, check_labels, check_logits

METRIC_NAMES = ("accuracy", "entropy", "ece", "aece", "sce", "mce", "nll", "brier")


@dataclass(frozen=True)
class MetricInfo:
    """How a metric is named, compared and shown (the paper's table units)."""

    title: str
    # True for accuracy; None for entropy, a description with no better direction (a calibrated model
    # is neither as sure as possible nor as unsure as possible).
    higher_is_better: bool | None
    percent: bool  # shown × 100 with "%"
    decimals: int


METRICS: dict[str, MetricInfo] = {
    "accuracy": MetricInfo("Accuracy", True, True, 2),
    "entropy": MetricInfo("Entropy", None, False, 4),
    "ece": MetricInfo("ECE", False, True, 2),
    "aece": MetricInfo("AECE", False, True, 2),
    "sce": MetricInfo("SCE", False, False, 4),  # scaled by 10^sce_exponent(K)
    "mce": MetricInfo("MCE", False, True, 2),
    "nll": MetricInfo("NLL", False, False, 4),
    "brier": MetricInfo("Brier", False, False, 4),
}


def sce_exponent(n_classes: int) -> int:
    """The power of ten SCE is shown in: 2 (×10⁻²) below 1000 classes, else 3 (×10⁻³), as in the paper."""
    return 3 if n_classes >= 1000 else 2


@dataclass(frozen=True)
class Column:
    """``key`` is a metric name or "resolution"/"seconds"; shown value = fraction × ``scale``."""

    key: str
    title: str
    unit: str = ""
    scale: float = 1.0
    decimals: int = 4
    higher_is_better: bool | None = None

    def label(self) -> str:
        """Title, unit and direction as a reader sees them, e.g. "SCE (×10⁻²) ↓" (LaTeX: ``nctv.report``)."""
        arrow = "" if self.higher_is_better is None else (" ↑" if self.higher_is_better else " ↓")
        return f"{self.title} ({self.unit}){arrow}" if self.unit else f"{self.title}{arrow}"


_SUPERSCRIPTS = "⁰¹²³⁴⁵⁶⁷⁸⁹"


def metric_column(metric: str, n_classes: int) -> Column:
    info = METRICS.get(metric)
    if info is None:
        raise ValueError(f"Unknown metric {metric!r}; use one of {', '.join(METRIC_NAMES)}.")
    if info.percent:
        unit, scale = "%", 100.0
    elif metric == "sce":
        e = sce_exponent(n_classes)
        unit, scale = "×10⁻" + _SUPERSCRIPTS[e], 10.0**e
    else:
        unit, scale = "", 1.0
    return Column(metric, info.title, unit, scale, info.decimals, info.higher_is_better)


def better(metric: str, a: float, b: float) -> bool | None:
    """Is value ``a`` better than ``b`` for ``metric``? None when equal or the metric has no direction."""
    if a == b or METRICS[metric].higher_is_better is None:
        return None
    return (a > b) if METRICS[metric].higher_is_better else (a < b)


def _prepare(logits: Any, labels: Any | None, from_probabilities: bool):
    """(log-probabilities, probabilities, labels) as CPU float64 / int64 tensors, validated."""
    z = check_logits(logits, "probabilities" if from_probabilities else "logits")
    z = z.detach().to("cpu", torch.float64)
    if from_probabilities:
        if bool((z < 0).any()) or bool((z > 1).any()):
            raise ValueError("probabilities must lie in [0, 1]; pass logits without from_probabilities=True.")
        if not torch.allclose(z.sum(1), torch.ones(z.shape[0], dtype=torch.float64), atol=1e-4):
            raise ValueError("each row of probabilities must sum to 1; pass logits without from_probabilities=True.")
        p = z
        logp = torch.log(z)
    else:
        logp = torch.log_softmax(z, dim=1)
        p = torch.softmax(z, dim=1)
    y = None if labels is None else check_labels(labels, z.shape[0], z.shape[1]).cpu()
    return logp, p, y


def confidences_and_predictions(logits: Any, from_probabilities: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 confidence (float64) and prediction (ties: lowest index) per sample, as numpy arrays."""
    _, p, _ = _prepare(logits, None, from_probabilities)
    conf, pred = _top1(p)
    return conf.numpy(), pred.numpy()


def _top1(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # torch.max returns the first maximal index; spelled out with argmax to make the tie rule explicit.
    pred = torch.argmax(p, dim=1)
    return p.gather(1, pred[:, None]).squeeze(1), pred


def bin_edges(n_bins: int) -> torch.Tensor:
    """The M+1 equal-width edges m/M, m = 0..M, in float64."""
    return torch.arange(n_bins + 1, dtype=torch.float64) / n_bins


def _bin_index(values: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Bin m (0-based) such that edges[m] < v <= edges[m+1]; v = 0 goes to bin 0."""
    edges = bin_edges(n_bins)
    idx = torch.searchsorted(edges, values.contiguous(), right=False) - 1
    return idx.clamp_(0, n_bins - 1)


def _weighted_gap(counts: torch.Tensor, sum_conf: torch.Tensor, sum_acc: torch.Tensor, n: int) -> float:
    # Σ |B|/N · |acc − conf| = Σ |Σacc − Σconf| / N; empty bins contribute 0 exactly.
    return float((sum_acc - sum_conf).abs().sum() / n)


def reliability_counts(conf: torch.Tensor, correct: torch.Tensor, n_bins: int):
    """Per equal-width bin: counts, Σ confidence, Σ correctness (float64 tensors)."""
    idx = _bin_index(conf, n_bins)
    counts = torch.bincount(idx, minlength=n_bins).double()
    sum_conf = torch.bincount(idx, weights=conf, minlength=n_bins)
    sum_acc = torch.bincount(idx, weights=correct.double(), minlength=n_bins)
    return counts, sum_conf, sum_acc


@dataclass(frozen=True)
class ReliabilityBins:
    """The numbers behind a reliability diagram (equal-width bins of top-1 confidence).

    ``confidence`` and ``accuracy`` are per-bin means, NaN where a bin is empty.
    """

    edges: np.ndarray
    counts: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    @property
    def n_bins(self) -> int:
        return len(self.counts)

    @property
    def gaps(self) -> np.ndarray:
        """accuracy − confidence per bin (NaN for empty bins)."""
        return self.accuracy - self.confidence

    @property
    def ece(self) -> float:
        filled = self.counts > 0
        return float(np.sum(self.counts[filled] / self.n * np.abs(self.gaps[filled])))

    @property
    def mce(self) -> float:
        filled = self.counts > 0
        return float(np.max(np.abs(self.gaps[filled])))


def _accuracy(p, y):
    return float((_top1(p)[1] == y).double().mean())


def _entropy(p):
    return float((-torch.special.xlogy(p, p).sum(1)).mean())


def _reliability(p, y, n_bins):
    conf, pred = _top1(p)
    return reliability_counts(conf, pred == y, n_bins)


def _ece(p, y, n_bins):
    counts, sc, sa = _reliability(p, y, n_bins)
    return _weighted_gap(counts, sc, sa, p.shape[0])


def _mce(p, y, n_bins):
    counts, sc, sa = _reliability(p, y, n_bins)
    filled = counts > 0
    return float(((sa[filled] - sc[filled]) / counts[filled]).abs().max())


def _aece(p, y, n_bins):
    n = p.shape[0]
    conf, pred = _top1(p)
    order = torch.sort(conf, stable=True).indices
    conf, correct = conf[order], (pred == y)[order].double()
    # numpy.array_split: the first N mod M groups get one extra sample.
    base, extra = divmod(n, n_bins)
    sizes = torch.full((n_bins,), base, dtype=torch.long)
    sizes[:extra] += 1
    group = torch.repeat_interleave(torch.arange(n_bins), sizes)
    sc = torch.bincount(group, weights=conf, minlength=n_bins)
    sa = torch.bincount(group, weights=correct, minlength=n_bins)
    return _weighted_gap(sizes.double(), sc, sa, n)


def _sce(p, y, n_bins):
    n, k = p.shape
    idx = _bin_index(p.reshape(-1), n_bins).view(n, k)
    key = (torch.arange(k)[None, :] * n_bins + idx).reshape(-1)
    onehot = torch.nn.functional.one_hot(y, k).double().reshape(-1)
    sc = torch.bincount(key, weights=p.reshape(-1), minlength=k * n_bins)
    sa = torch.bincount(key, weights=onehot, minlength=k * n_bins)
    return float((sa - sc).abs().sum() / n / k)


def _nll(logp, y):
    return float(-logp.gather(1, y[:, None]).mean())


def _brier(p, y):
    onehot = torch.nn.functional.one_hot(y, p.shape[1]).double()
    return float(((p - onehot) ** 2).sum(1).mean())


def accuracy(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> float:
    """Fraction of samples whose top-1 prediction equals the label. ``n_bins`` is ignored."""
    _, p, y = _prepare(logits, labels, from_probabilities)
    return _accuracy(p, y)


def entropy(logits: Any, from_probabilities: bool = False) -> float:
    """Mean over samples of −Σ_k p_ik log p_ik (natural log, 0·log 0 = 0)."""
    return _entropy(_prepare(logits, None, from_probabilities)[1])


def ece(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> float:
    """Expected Calibration Error with equal-width bins (see the module docstring)."""
    _, p, y = _prepare(logits, labels, from_probabilities)
    return _ece(p, y, check_bins(n_bins))


def aece(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> float:
    """Adaptive ECE: M equal-count groups of the confidence-sorted samples (sizes differ by at most 1)."""
    _, p, y = _prepare(logits, labels, from_probabilities)
    return _aece(p, y, check_bins(n_bins))


def sce(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> float:
    """Static Calibration Error: class-wise ECE of p_ik over all samples, averaged over the K classes."""
    _, p, y = _prepare(logits, labels, from_probabilities)
    return _sce(p, y, check_bins(n_bins))


def mce(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> float:
    """Maximum Calibration Error: the largest |accuracy − confidence| over non-empty ECE bins."""
    _, p, y = _prepare(logits, labels, from_probabilities)
    return _mce(p, y, check_bins(n_bins))


def nll(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> float:
    """Mean negative log-likelihood −log p_iy (natural log). ``n_bins`` is ignored."""
    logp, _, y = _prepare(logits, labels, from_probabilities)
    return _nll(logp, y)


def brier(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> float:
    """Mean over samples of Σ_k (p_ik − 1[y_i = k])². ``n_bins`` is ignored."""
    _, p, y = _prepare(logits, labels, from_probabilities)
    return _brier(p, y)


def reliability_bins(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> ReliabilityBins:
    """Per ECE bin: edges, count, mean confidence and accuracy."""
    _, p, y = _prepare(logits, labels, from_probabilities)
    n_bins = check_bins(n_bins)
    counts, sc, sa = (t.numpy() for t in _reliability(p, y, n_bins))
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.where(counts > 0, sc / counts, np.nan)
        mean_acc = np.where(counts > 0, sa / counts, np.nan)
    return ReliabilityBins(bin_edges(n_bins).numpy(), counts.astype(np.int64), mean_conf, mean_acc)


def evaluate(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> dict[str, float]:
    """All metrics of METRIC_NAMES for one set of logits, as fractions (inputs prepared once)."""
    logp, p, y = _prepare(logits, labels, from_probabilities)
    n_bins = check_bins(n_bins)
    return {
        "accuracy": _accuracy(p, y),
        "entropy": _entropy(p),
        "ece": _ece(p, y, n_bins),
        "aece": _aece(p, y, n_bins),
        "sce": _sce(p, y, n_bins),
        "mce": _mce(p, y, n_bins),
        "nll": _nll(logp, y),
        "brier": _brier(p, y),
    }
