"""Calibration metrics: pure functions of ``(logits, labels)``.

Conventions, shared by every caller (tables, figures, γ selection, tests):

* Inputs are **logits** ``(N, K)`` (numpy array or torch tensor on any device) and integer labels
  ``(N,)``. Probabilities are accepted only with ``from_probabilities=True``.
* p = softmax(logits); confidence c_i = max_k p_ik; prediction = argmax_k p_ik, ties to the lowest
  index.
* Results are fractions (0.0–1.0) returned as Python floats; tables convert to %.
* ECE uses ``n_bins`` equal-width bins, bin m = ((m−1)/M, m/M]; the first bin also takes c = 0 and
  c = 1.0 falls in the last bin. Empty bins add 0, so more bins than samples is allowed.
* AECE bins the confidences into M equal-mass bins (:func:`equal_mass_bins`): the sorted confidences
  split into M runs whose sizes differ by at most one (as ``numpy.array_split``), each inner edge
  halfway between the last confidence of one run and the first of the next, a confidence on an edge in
  the bin below (Kumar, Liang & Ma's ``get_equal_bins``). Where equal confidences straddle a run
  boundary the edge is their value and all of them join the lower bin: equal confidences share a bin,
  whatever order the rows come in. Every sample is counted exactly once; with fewer samples than bins
  one bin a sample, the rest empty (they add 0).
* SCE bins p_ik of every class k with the ECE bins; K comes from the logits, never from the labels.
* Smooth ECE (``smooth_ece``) smooths the residuals c_i − [ŷ_i = y_i] of the top-label confidence with
  a Gaussian kernel reflected at 0 and 1, its bandwidth chosen automatically as in
  ``relplot.smECE`` (Błasiok & Nakkiran, ICLR 2024), whose discretisation it follows exactly.
  The ``*_batch`` / ``*_curves`` forms take (resamples, samples) rows of confidence and 0/1
  correctness, for bootstrap intervals and bands.
* Beside them (``further``, FURTHER_NAMES, in a run's tables but not in ``evaluate``, whose keys the
  studies save): the KS calibration error (no bins; it steps once per distinct confidence), the
  debiased ℓ2 calibration error (AECE's equal-mass bins), and NLL split into calibration + refinement, refinement being the NLL after
  temperature scaling fitted on the same logits. ``classwise_ece`` is ``sce`` (one formula, two names).
* Everything is computed on the CPU in float64, so a tensor on a GPU and the same values on the CPU
  give bit-identical results.
* Every metric is a function of the rows, not of their order: the rows are first put in the canonical
  order (:mod:`nctv.canonical`) and every sum runs in it, so the same rows shuffled give the same
  figure to the last bit, ties included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy import sparse

from nctv.canonical import canonical_order, same_as_previous, sorted_within_duplicates
from nctv.checks import check_bins, check_labels, check_logits

METRIC_NAMES = ("accuracy", "entropy", "ece", "aece", "sce", "mce", "nll", "brier", "smooth_ece")


#: Which way is better: True for accuracy, False for the errors, None for entropy, a description of
#: the model with no better direction (a calibrated model is neither as sure nor as unsure as possible).
HIGHER_IS_BETTER: dict[str, bool | None] = {
    "accuracy": True, "entropy": None, "ece": False, "aece": False, "sce": False, "mce": False, "nll": False,
    "brier": False, "smooth_ece": False, "ks": False, "l2_ce": False, "nll_calibration": False,
    "nll_refinement": False, "calibration_p": None, "classwise_calibration_p": None,
}


def better(metric: str, a: float, b: float) -> bool | None:
    """Is value ``a`` better than ``b`` for ``metric``? None when equal or the metric has no direction."""
    if a == b or HIGHER_IS_BETTER[metric] is None:
        return None
    return (a > b) if HIGHER_IS_BETTER[metric] else (a < b)


def _prepare(logits: Any, labels: Any | None, from_probabilities: bool, canonical: bool = True):
    """(log-probabilities, probabilities, labels) as CPU float64 / int64 tensors, validated; the rows in
    the canonical order (:mod:`nctv.canonical`) unless ``canonical`` is False (per-row outputs)."""
    z = check_logits(logits, "probabilities" if from_probabilities else "logits")
    z = z.detach().to("cpu", torch.float64)
    y = None if labels is None else check_labels(labels, z.shape[0], z.shape[1]).cpu()
    if canonical:
        order = torch.from_numpy(canonical_order(z) if y is None else canonical_order(z, y))
        z, y = z[order], (None if y is None else y[order])
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
    return logp, p, y


def confidences_and_predictions(logits: Any, from_probabilities: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 confidence (float64) and prediction (ties: lowest index) per sample, as numpy arrays."""
    _, p, _ = _prepare(logits, None, from_probabilities, canonical=False)
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


def _equal_mass_sums(p, y, n_bins):
    """Per equal-mass bin (:func:`equal_mass_bins`) of the top-label confidence: counts, Σ confidence,
    Σ correctness (float64 tensors), summed in the rows' (canonical) order."""
    conf, pred = _top1(p)
    idx = torch.from_numpy(equal_mass_bins(conf.numpy(), n_bins))
    counts = torch.bincount(idx, minlength=n_bins).double()
    return counts, torch.bincount(idx, weights=conf, minlength=n_bins), \
        torch.bincount(idx, weights=(pred == y).double(), minlength=n_bins)


def _aece(p, y, n_bins):
    return _weighted_gap(*_equal_mass_sums(p, y, n_bins), p.shape[0])


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
    """Adaptive ECE: the ECE formula over M equal-mass bins of the confidences (:func:`equal_mass_bins`:
    sizes differ by at most 1 but where equal confidences straddle a boundary, then all in the lower bin)."""
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


def classwise_ece(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> float:
    """Classwise ECE (Kull et al. 2019): the mean over the K classes of the binned ECE of p_k against
    1[y = k], each with the equal-width ECE bins. It is the same number as :func:`sce` (Nixon et al.'s
    static calibration error is this definition under another name); both names are kept so that a
    reader of either paper finds it."""
    return sce(logits, labels, n_bins, from_probabilities)


def run_starts(n: int, n_bins: int) -> np.ndarray:
    """Where runs 1 … R − 1 of ``n`` sorted values start, R = min(``n_bins``, n) runs whose lengths differ
    by at most one, the longer ones first (``numpy.array_split``)."""
    runs = min(n_bins, n)
    size, longer = divmod(n, runs)
    i = np.arange(1, runs)
    return i * size + np.minimum(i, longer)


def equal_mass_edges(scores: np.ndarray, n_bins: int) -> np.ndarray:
    """``n_bins`` + 1 non-decreasing edges of equal-mass bins of ``scores``, the outer ones 0 and 1: the
    sorted scores split into runs (:func:`run_starts`), each inner edge halfway between the last score
    of one run and the first of the next; with fewer scores than bins, the edges left over at 1. A
    function of the scores as a set with repeats: their order does not enter."""
    x = np.sort(np.asarray(scores, dtype=np.float64))
    starts = run_starts(len(x), n_bins)
    edges = np.concatenate([[0.0], (x[starts - 1] + x[starts]) / 2.0, np.ones(n_bins - len(starts))])
    edges[0], edges[-1] = 0.0, 1.0
    return np.maximum.accumulate(edges)


def bin_index(edges: np.ndarray, scores: np.ndarray, on_edge: str = "below") -> np.ndarray:
    """The bin of each score (0 … len(edges) − 2), a score on an edge in the bin below or above it."""
    side = "right" if on_edge == "above" else "left"
    return np.clip(np.searchsorted(edges, scores, side=side) - 1, 0, len(edges) - 2)


def equal_mass_bins(conf: np.ndarray, n_bins: int) -> np.ndarray:
    """AECE's (and the debiased ℓ2 error's) bin of each confidence: :func:`equal_mass_edges`, a
    confidence on an edge in the bin below. Equal confidences straddling a run boundary make the edge
    their value, so all of them join the lower bin (that bin then holds more than N/M, the next fewer)."""
    return bin_index(equal_mass_edges(conf, n_bins), conf, "below")


def _ks(p, y):
    """Partial sums of the confidence-sorted residuals, read once per distinct confidence (after the
    last of a run of equal ones): equal confidences are one step, in whatever order they come."""
    conf, pred = _top1(p)
    order = torch.sort(conf, stable=True).indices
    c = conf[order]
    partial = torch.cumsum(c - (pred == y)[order].double(), 0)
    last = torch.ones_like(c, dtype=torch.bool)
    last[:-1] = c[1:] != c[:-1]
    return float(partial[last].abs().max() / p.shape[0])


def _l2_ce(p, y, n_bins):
    n_b, sum_conf, sum_acc = _equal_mass_sums(p, y, n_bins)
    mean_conf = sum_conf / n_b.clamp(min=1)
    mean_acc = sum_acc / n_b.clamp(min=1)
    # Per bin (c̄ − ȳ)² − ȳ(1 − ȳ)/(n_b − 1): the plug-in square minus its noise; bins of one add 0.
    square = (mean_conf - mean_acc) ** 2 - mean_acc * (1 - mean_acc) / (n_b - 1).clamp(min=1)
    square = torch.where(n_b > 1, square, torch.zeros_like(square))
    return math.sqrt(max(float((n_b / p.shape[0] * square).sum()), 0.0))


def ks_error(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> float:
    """KS calibration error of the top-label confidence (Gupta, Rahimi, Ajanthan, Mensink, Sminchisescu &
    Hartley, ICLR 2021): max over the distinct confidences t of |Σ_{c_j ≤ t} (c_j − [ŷ_j = y_j])| / N,
    the samples sorted by confidence c, a run of equal confidences one step of the cumulative sum (the
    empirical cumulative is a function of the confidences, not of how ties are ordered). Nothing is
    binned; ``n_bins`` is ignored."""
    _, p, y = _prepare(logits, labels, from_probabilities)
    return _ks(p, y)


def l2_calibration_error(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> float:
    """Debiased ℓ2 calibration error of the top-label confidence (Kumar, Liang & Ma, NeurIPS 2019):
    √max(0, Σ_b n_b/N · [(c̄_b − ȳ_b)² − ȳ_b(1 − ȳ_b)/(n_b − 1)]) over ``n_bins`` equal-mass bins of
    the confidences (AECE's, :func:`equal_mass_bins`: their own ``get_equal_bins``), ȳ_b the bin's
    accuracy; a bin of one sample adds 0.
    The subtracted term is the plug-in square's noise, so the square is unbiased bin by bin."""
    _, p, y = _prepare(logits, labels, from_probabilities)
    return _l2_ce(p, y, check_bins(n_bins))


@dataclass(frozen=True)
class NLLSplit:
    """NLL = ``calibration`` + ``refinement``: ``refinement`` is the NLL after temperature scaling fitted
    on the same logits and labels (the best T of the family, ``temperature``), ``calibration`` what
    that re-calibration removes (≥ 0: T = 1 is in the family)."""

    nll: float
    calibration: float
    refinement: float
    temperature: float


def _nll_split(logp, y) -> NLLSplit:
    from nctv.temperature_solve import solve_log_temperature

    s, _ = solve_log_temperature(logp, y)
    nll = _nll(logp, y)
    refined = min(_nll(torch.log_softmax(logp * math.exp(-s), dim=1), y), nll)
    return NLLSplit(nll, nll - refined, refined, math.exp(s))


def nll_split(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> NLLSplit:
    """NLL split into its calibration and refinement parts, the family being temperature scaling
    (docs/method.md, "Metrics"). ``n_bins`` is ignored."""
    logp, _, y = _prepare(logits, labels, from_probabilities)
    return _nll_split(logp, y)


#: Metrics a run reports beside METRIC_NAMES (``further``): not part of :func:`evaluate`, whose keys the
#: studies save.
FURTHER_NAMES = ("ks", "l2_ce", "nll_calibration", "nll_refinement")


def further(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False) -> dict[str, float]:
    """The FURTHER_NAMES metrics of one set of logits, as fractions (NLL's parts in nats)."""
    logp, p, y = _prepare(logits, labels, from_probabilities)
    n_bins = check_bins(n_bins)
    split = _nll_split(logp, y)
    return {"ks": _ks(p, y), "l2_ce": _l2_ce(p, y, n_bins), "nll_calibration": split.calibration,
            "nll_refinement": split.refinement}


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
        "smooth_ece": _smooth_ece(p, y),
    }


# --- Smooth ECE (Błasiok & Nakkiran, "Smooth ECE: Principled Reliability Diagrams via Kernel Smoothing",
# ICLR 2024). The reference implementation is the ``relplot`` package (``relplot.smECE``); NCTV follows
# its discretisation step for step so that the two agree to 1e-6, which is what makes figures
# comparable with papers that report smECE.

SMOOTH_ECE_MIN_BANDWIDTH = 1e-3  # the search treats any narrower bandwidth as "too narrow"
_SEARCH_STEPS = 10  # bisection halvings of [0, 1]: the bandwidth is a multiple of 2⁻¹⁰
_DENSITY_FLOOR = 1e-4  # added to the kernel density at every mesh point (keeps r̂ finite where no data)
_ROWS_PER_CHUNK = 64  # rows of a batch smoothed together (bounds memory at about 64·N floats per array)


def smooth_grid_size(bandwidth: float) -> int:
    """Points of the grid on [0, 1] the samples are spread onto: 1001 down to σ = 0.01, then ≈ 10/σ."""
    return max(2000, round(20 / bandwidth)) // 2 + 1


def smooth_mesh(bandwidth: float) -> np.ndarray:
    """The confidences at which the smoothed curves are evaluated and integrated: max(200, ≈10/σ) points."""
    return np.linspace(0.0, 1.0, max(200, round(10 / bandwidth)))


def _kernel_transfer(bandwidth: float, grid: int) -> np.ndarray:
    """Fourier transform of the Gaussian kernel on the reflected grid (period 2·(grid − 1)).

    Reflecting the grid's values at 0 and at 1 makes them one period of an even periodic sequence, so
    reflected-kernel smoothing is a circular convolution, done here by FFT. The kernel is the Gaussian
    density (not multiplied by the grid step, so kernel sums are counts × density) evaluated at the
    ``grid`` points j/(grid − 1) − 1/2: it reaches at most half of [0, 1] on either side. When ``grid`` is
    even those points straddle 0, and the reference then weighs a source d steps away as if it were
    d + 1/2 steps away; NCTV does the same so the two agree.
    """
    period = 2 * (grid - 1)
    half = grid // 2
    offsets = np.arange(grid) - half  # target index − source index
    x = np.linspace(0.0, 1.0, grid) - 0.5
    weights = np.exp(-x * x / (2 * bandwidth**2)) / (np.sqrt(2 * np.pi) * bandwidth)
    kernel = np.zeros(period)
    kernel[offsets % period] = weights
    return np.fft.rfft(kernel)


def _linear_weights(x: np.ndarray, grid: int) -> tuple[np.ndarray, np.ndarray]:
    """Left grid index and the weight of the right neighbour, for linear interpolation on ``grid`` points."""
    pos = x * (grid - 1)
    left = np.clip(pos.astype(np.int64), 0, grid - 2)  # x = 1.0 sits at the right end of the last cell
    return left, pos - left


def _spread(conf: np.ndarray, weights: np.ndarray, grid: int, counts: np.ndarray | None = None) -> np.ndarray:
    """Each sample's weight split between its two neighbouring grid points (linear interpolation).

    ``conf`` (B, N), ``weights`` (W, B, N) -> (W, B, grid). With ``counts`` (B, N), ``conf`` (N,) and
    ``weights`` (W, N) are one sample and row b weighs sample i ``counts[b, i]`` times (a resample,
    without copying its samples): one sparse product for all weights. Depends on σ only through the grid
    size, so the bandwidth search spreads once per grid size and smooths many times.
    """
    left, frac = _linear_weights(conf, grid)
    if counts is not None:
        # One sparse (N, W·grid) matrix: sample i puts w·(1 − frac) on its left and w·frac on its right
        # grid point, in weight k's block of columns.
        n, n_weights = conf.shape[0], len(weights)
        rows = np.tile(np.arange(n), 2 * n_weights)
        cols = np.concatenate([k * grid + left + side for k in range(n_weights) for side in (0, 1)])
        vals = np.concatenate([w * share for w in weights for share in (1.0 - frac, frac)])
        to_grid = sparse.csr_matrix((vals, (rows, cols)), shape=(n, n_weights * grid))
        return (to_grid.T @ counts.T).T.reshape(counts.shape[0], n_weights, grid).transpose(1, 0, 2)
    n_rows = conf.shape[0]
    index = (np.arange(n_rows)[:, None] * grid + left).ravel()
    out = np.empty((len(weights), n_rows, grid))
    for k, w in enumerate(weights):
        to_left = np.bincount(index, weights=(w * (1.0 - frac)).ravel(), minlength=n_rows * grid)
        to_right = np.bincount(index, weights=(w * frac).ravel(), minlength=n_rows * grid)
        out[k] = to_left.reshape(n_rows, grid)
        out[k, :, 1:] += to_right.reshape(n_rows, grid)[:, :-1]  # left <= grid - 2: nothing falls off
    return out


def _smooth_on_mesh(values: np.ndarray, bandwidth: float) -> np.ndarray:
    """Reflected-kernel smoothing of spread values (..., grid), read off at the mesh (..., T).

    The result at mesh point t is Σ_i w_i K_σ(t − c_i) in the reference's discretisation.
    """
    grid = values.shape[-1]
    periodic = np.concatenate([values, values[..., grid - 2:0:-1]], axis=-1)
    smoothed = np.fft.irfft(np.fft.rfft(periodic) * _kernel_transfer(bandwidth, grid), n=periodic.shape[-1])
    at, w = _linear_weights(smooth_mesh(bandwidth), grid)
    return smoothed[..., at] * (1.0 - w) + smoothed[..., at + 1] * w


class _RowsSmoother:
    """Kernel sums of (c − y) and of 1 for a block of rows, spread once per grid size.

    Rows are (B, N) arrays, or one sample (N,) weighed by the (B, N) ``counts`` of B resamples.
    """

    def __init__(self, conf: np.ndarray, correct: np.ndarray, counts: np.ndarray | None = None):
        self.conf, self.counts = conf, counts
        self.n_rows = conf.shape[0] if counts is None else counts.shape[0]
        self.weights = np.stack([conf - correct, np.ones_like(conf)])
        self.spread: dict[int, np.ndarray] = {}

    def sums(self, bandwidth: float, rows: np.ndarray | slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        grid = smooth_grid_size(bandwidth)
        if grid not in self.spread:
            self.spread[grid] = _spread(self.conf, self.weights, grid, self.counts)
        residual, density = _smooth_on_mesh(self.spread[grid][:, rows], bandwidth)
        return residual, density

    def smooth_ece(self, bandwidth: float, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """smECE_σ per row: Σ|r̂_σ|·ρ̂_σ / Σρ̂_σ over the mesh, r̂ = smoothed (c − y), ρ̂ = kernel density."""
        residual, density = self.sums(bandwidth, rows)
        # r̂ = residual / (ρ̂ + floor) weighted by (ρ̂ + floor): the floor cancels in the numerator.
        return np.abs(residual).sum(-1) / (density.sum(-1) + _DENSITY_FLOOR * residual.shape[-1])


def _smooth_ece_search(rows: _RowsSmoother) -> tuple[np.ndarray, np.ndarray]:
    """The automatic bandwidth per row and smECE at it.

    σ* is the fixed point smECE_σ = σ (smECE_σ falls as σ grows). Bisection on [0, 1] keeps ``low``
    where σ < smECE_σ (or σ is below SMOOTH_ECE_MIN_BANDWIDTH) and ``high`` where σ ≥ smECE_σ; after
    10 halvings σ* = ``high``. Rows share each evaluation at the bandwidths they have in common.
    """
    low, high = np.zeros(rows.n_rows), np.ones(rows.n_rows)
    value = rows.smooth_ece(1.0)
    for _ in range(_SEARCH_STEPS):
        mid = (low + high) / 2
        for sigma in np.unique(mid):
            at = np.flatnonzero(mid == sigma)
            if sigma < SMOOTH_ECE_MIN_BANDWIDTH:
                low[at] = sigma
                continue
            v = rows.smooth_ece(float(sigma), at)
            too_narrow = sigma < v
            low[at[too_narrow]] = sigma
            high[at[~too_narrow]] = sigma
            value[at[~too_narrow]] = v[~too_narrow]
    return value, high


def _check_bandwidth(bandwidth: float | None) -> float | None:
    if bandwidth is None:
        return None
    try:
        sigma = float(bandwidth)
    except (TypeError, ValueError):
        raise ValueError(f"bandwidth must be a number in (0, 1] or None (automatic); got {bandwidth!r}.") from None
    if not 0 < sigma <= 1:
        raise ValueError(f"bandwidth must lie in (0, 1] (or be None for the automatic choice); got {bandwidth!r}.")
    return sigma


def _as_rows(values: Any, name: str) -> np.ndarray:
    a = (values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values))
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array or a 2-D array (resamples, samples); got shape {a.shape}.")
    return a.astype(np.float64)


def _check_batch(confidence: Any, correct: Any) -> tuple[np.ndarray, np.ndarray]:
    c = _as_rows(confidence, "confidence")
    y = _as_rows(correct, "correct")
    if c.shape != y.shape:
        raise ValueError(f"confidence has shape {c.shape} but correct has {y.shape}; they must match.")
    if not np.isfinite(c).all() or c.min() < 0 or c.max() > 1:
        raise ValueError("confidence must lie in [0, 1]; top-label confidences are probabilities.")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("correct must hold only 0/1 (or False/True): whether each prediction was right.")
    return c, y


def _check_counts(counts: Any, n: int) -> np.ndarray:
    a = (counts.detach().cpu().numpy() if isinstance(counts, torch.Tensor) else np.asarray(counts))
    if a.ndim != 2 or a.shape[1] != n:
        raise ValueError(f"counts must be (resamples, {n}): how often each sample is drawn; got shape {a.shape}.")
    if not np.isfinite(a).all() or a.min() < 0 or (a.sum(1) <= 0).any():
        raise ValueError("counts must be non-negative with at least one drawn sample per resample.")
    return a


def _by_confidence(c: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each row's samples sorted by (confidence, correctness): the smoothing's sums then run in an order
    of the values alone (rows of a batch, or the one sample that ``counts`` resamples)."""
    return np.lexsort((y, c), axis=-1)


def _smooth_blocks(confidence: Any, correct: Any, counts: Any | None):
    """(rows, smoother) per block of at most _ROWS_PER_CHUNK rows (resamples when ``counts`` is given)."""
    c, y = _check_batch(confidence, correct)
    order = _by_confidence(c, y)
    c, y = np.take_along_axis(c, order, -1), np.take_along_axis(y, order, -1)
    if counts is None:
        for start in range(0, c.shape[0], _ROWS_PER_CHUNK):
            block = slice(start, start + _ROWS_PER_CHUNK)
            yield block, _RowsSmoother(c[block], y[block]), c.shape[1]
        return
    if c.shape[0] != 1:
        raise ValueError("With counts, confidence and correct are one sample (1-D); counts gives the resamples.")
    w = _check_counts(counts, c.shape[1])[:, order[0]]
    # Copies of one (confidence, correctness) pair: their counts in ascending order (nctv.canonical).
    w = sorted_within_duplicates(torch.from_numpy(w), same_as_previous(c[0], y[0])).numpy()
    for start in range(0, w.shape[0], _ROWS_PER_CHUNK):
        block = slice(start, start + _ROWS_PER_CHUNK)
        yield block, _RowsSmoother(c[0], y[0], w[block]), w[block].sum(1, keepdims=True)


def _batch_rows(confidence: Any, counts: Any | None) -> int:
    return _as_rows(confidence, "confidence").shape[0] if counts is None else len(counts)


def smooth_ece_batch(confidence: Any, correct: Any, bandwidth: float | None = None,
                     counts: Any | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Smooth ECE of every row of a (B, N) batch of top-label confidences and 0/1 correctness.

    A 1-D pair is one row. With ``counts`` (B, N), the pair is one sample of N and row b is the
    resample that draws sample i ``counts[b, i]`` times (exactly the smECE of that resample, without
    materialising it). ``bandwidth`` None picks σ* per row (the paper's automatic choice); a number
    fixes σ for every row. Returns (smECE per row, σ per row) as float64 arrays of length B.
    """
    sigma = _check_bandwidth(bandwidth)
    n_rows = _batch_rows(confidence, counts)
    value, width = np.empty(n_rows), np.full(n_rows, sigma or 0.0)
    for block, rows, _ in _smooth_blocks(confidence, correct, counts):
        if sigma is None:
            value[block], width[block] = _smooth_ece_search(rows)
        else:
            value[block] = rows.smooth_ece(sigma)
    return value, width


def _conf_correct(p: torch.Tensor, y: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    conf, pred = _top1(p)
    return conf.numpy(), (pred == y).double().numpy()


def _top1_correct(logits: Any, labels: Any, from_probabilities: bool) -> tuple[np.ndarray, np.ndarray]:
    _, p, y = _prepare(logits, labels, from_probabilities)
    return _conf_correct(p, y)


def _smooth_ece(p, y):
    return float(smooth_ece_batch(*_conf_correct(p, y))[0][0])


def smooth_ece(logits: Any, labels: Any, n_bins: int = 15, from_probabilities: bool = False,
               bandwidth: float | None = None) -> float:
    """Smooth ECE of the top-label confidence: kernel-smoothed calibration error (see the section comment).

    smECE_σ = Σ_t |r̂_σ(t)| ρ̂_σ(t) / Σ_t ρ̂_σ(t) over a mesh of [0, 1], where r̂_σ is the
    Nadaraya–Watson smoothing of the residuals c_i − [ŷ_i = y_i] and ρ̂_σ the kernel density of the
    confidences, both with a Gaussian kernel of width σ reflected at 0 and 1. ``bandwidth`` None (the
    default) takes σ* with smECE_σ* = σ*, found by bisection to a multiple of 2⁻¹⁰, as ``relplot.smECE``.
    ``n_bins`` is ignored (nothing is binned); it keeps the arguments of every metric the same.
    """
    conf, correct = _top1_correct(logits, labels, from_probabilities)
    return float(smooth_ece_batch(conf, correct, bandwidth)[0][0])


def smooth_reliability_curves(confidence: Any, correct: Any, bandwidth: float,
                               counts: Any | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The smoothed reliability curve and confidence density of every row of a batch, at one bandwidth.

    Returns (mesh (T,), accuracy (B, T), density (B, T)). accuracy(t) = t − r̂_σ(t), so the gap to the
    diagonal is the smoothed residual that smECE integrates; density is ρ̂_σ / N, a density on
    [0, 1] (its mean over the mesh is about 1). One σ for all rows (e.g. the point estimate's σ*)
    puts every row on the same mesh, as a band over resamples needs. ``counts`` (B, N): rows are
    resamples of one sample, as in :func:`smooth_ece_batch`.
    """
    sigma = _check_bandwidth(bandwidth)
    if sigma is None:
        raise ValueError("smooth_reliability_curves needs a bandwidth; take it from smooth_ece_batch.")
    mesh = smooth_mesh(sigma)
    accuracy, density = np.empty((2, _batch_rows(confidence, counts), len(mesh)))
    for block, rows, n in _smooth_blocks(confidence, correct, counts):
        residual, dens = rows.sums(sigma)
        accuracy[block] = mesh - residual / (dens + _DENSITY_FLOOR)
        density[block] = dens / n
    return mesh, accuracy, density


@dataclass(frozen=True)
class SmoothReliability:
    """The numbers behind a smoothed reliability diagram (top-label confidence).

    ``smooth_ece`` is the density-weighted mean of |accuracy − confidence| over the mesh, so the
    picture and the number agree. To draw it: the diagonal; the curve (``confidence``, ``accuracy``),
    its width or opacity growing with ``density`` so that stretches with few predictions fade; the
    density as a filled profile along the confidence axis (scaled to a strip at the bottom); the
    title "smECE = x % (σ = ``bandwidth``)". A band from bootstrap resamples comes from
    ``smooth_reliability_curves`` at this ``bandwidth`` (same mesh), as pointwise quantiles.
    Unlike relplot's own diagram, which kernel-regresses correctness on confidence, the curve is
    t − r̂(t), the smoothed residual that smECE integrates.
    """

    confidence: np.ndarray  # mesh on [0, 1]
    accuracy: np.ndarray  # smoothed accuracy at each mesh point
    density: np.ndarray  # kernel density of the confidences at each mesh point
    bandwidth: float
    smooth_ece: float

    @property
    def gaps(self) -> np.ndarray:
        """accuracy − confidence at each mesh point."""
        return self.accuracy - self.confidence


def smooth_reliability(logits: Any, labels: Any, from_probabilities: bool = False,
                       bandwidth: float | None = None) -> SmoothReliability:
    """Smoothed reliability diagram at the smooth ECE's bandwidth (σ* unless ``bandwidth`` is given)."""
    conf, correct = _top1_correct(logits, labels, from_probabilities)
    value, sigma = smooth_ece_batch(conf, correct, bandwidth)
    mesh, acc, dens = smooth_reliability_curves(conf, correct, float(sigma[0]))
    return SmoothReliability(mesh, acc[0], dens[0], float(sigma[0]), float(value[0]))
