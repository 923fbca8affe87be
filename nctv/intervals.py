"""Confidence intervals for every metric of a run, from resampling the test split.

The test split is a sample; a metric measured on it would come out differently on another draw of the
same size. Each resample is drawn with replacement from the test split and represented by a **count
vector** c_r (how often each test sample was drawn; Σ c_r = N), so every metric becomes a weighted sum
and all resamples are scored at once: one matrix product ``counts @ columns`` (the per-sample columns
of a metric: correctness, per-bin gaps, …), no loop over resamples. All methods of a run share one
count matrix, drawn from one seeded index matrix, so differences between methods are *paired*.

What the interval targets (docs/method.md, "Uncertainty of a result"): the method's metric on the
population the test split was drawn from, with the same bins: for ECE, Σ_b |E[(1[correct] − c) 1[c ∈
b]]|. Binned metrics (ECE, AECE, SCE, MCE) are biased upwards on a finite sample (noise in a bin's
gap adds to its absolute value), so the interval is built around a **debiased estimate**: per bin,
|gap| is replaced by √max(gap² − var(gap), 0) (the square root of the unbiased estimate of gap²).
Its interval is the union of the basic bootstrap interval (debiased value of a resample − plug-in value
of the test split, the resampled world's truth, as the estimator's error) and the percentile interval
of the resamples' debiased values: where a bin's gap is about its noise the first reads low, where it
is a few times its noise the second does, and simulation shows the union at the nominal level in both
(docs/method.md). Means (accuracy, entropy, NLL, Brier) are unbiased and near-symmetric: there the two
intervals nearly coincide.

At the boundary (a population error of 0) no bootstrap interval of a calibration error holds its level:
every estimate of a bin's |gap| is positive. There the calibration test (``nctv.consistency``) decides:
where it does not reject "calibrated", :func:`at_boundary` widens the interval down to 0.

The same bias reaches a paired difference a − b of two methods' calibration errors: a (nearly)
calibrated method's estimate reads high by about its noise, the other's hardly at all, so the
difference's interval is pushed away from the truth, and two methods that are both consistent with
calibrated can come out "separated". :func:`difference_at_boundary` is the rule for the difference:
where A's test cannot reject, a = 0 is consistent with the data, and then a − b = −b, which B's own
interval [b_lo, b_hi] (itself widened by :func:`at_boundary`) bounds: the difference's interval becomes
the smallest interval holding both the paired one and [−b_hi, −b_lo]. Where B's test cannot reject,
likewise with [a_lo, a_hi]; where both cannot, it holds 0 as well, so neither is ranked above the
other. Where neither test can say "calibrated" the paired interval is left as it is (bench/boundary.py
measures both sides: docs/method.md, "Paired differences at the boundary").

Stochastic methods (several seeds): each resample also redraws the seeds with replacement and takes
the mean over the drawn seeds, so the interval covers the test sample's randomness and the method's own.

A resample is a multiset of test rows, and each draw is a function of it alone: the rows are put in the
canonical order (:mod:`nctv.canonical`) with their counts, identical rows' counts sorted among them,
before anything is summed; AECE and the debiased ℓ2 error bin each resample's confidences as
``nctv.metrics.equal_mass_bins`` does, and the KS error steps once per distinct confidence. The same
rows with the same counts, in any order, give the same draws to the last bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from scipy.stats import norm

from nctv.canonical import canonical_order, same_as_previous, sorted_within_duplicates
from nctv.checks import check_bins, check_labels, check_logits
from nctv.metrics import SmoothReliability, equal_mass_bins, run_starts, smooth_ece_batch, smooth_reliability_curves
from nctv.settings import DEFAULT_LEVEL, DEFAULT_RESAMPLES

#: The interval construction, recorded with every result.
INTERVAL_METHOD = "debiased bootstrap, basic and percentile united"
# The SCE columns of one block stay below this many entries (a 1000-class split is chunked by class).
_BLOCK_ENTRIES = 2**24


@dataclass(frozen=True)
class IntervalSettings:
    """How intervals are computed: coverage ``level``, number of ``resamples``, the ``seed`` of the draws."""

    level: float = DEFAULT_LEVEL
    resamples: int = DEFAULT_RESAMPLES
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.level, bool) or not isinstance(self.level, (int, float)) or not 0.5 <= self.level < 1:
            raise ValueError(f"The interval level must be a fraction from 0.5 to below 1, e.g. 0.95; got {self.level!r}.")
        if isinstance(self.resamples, bool) or not isinstance(self.resamples, int) or self.resamples < 100:
            raise ValueError(f"Use at least 100 resamples for an interval (1000 is the default); got {self.resamples!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"The resampling seed must be a whole number; got {self.seed!r}.")

    def to_dict(self) -> dict[str, Any]:
        return {"level": float(self.level), "resamples": self.resamples, "seed": self.seed, "method": INTERVAL_METHOD}


@dataclass(frozen=True)
class Interval:
    """An ``estimate`` (debiased for binned metrics) with its interval ``[low, high]`` (fractions)."""

    estimate: float
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def resample_counts(n: int, resamples: int, seed: int) -> torch.Tensor:
    """(resamples, n) float32 counts: row r counts how often each sample is in resample r.

    Drawn on the CPU from one seeded (resamples, n) index matrix, so a seed gives the same resamples on
    every device. Counts are small whole numbers: float32 holds them exactly.
    """
    g = torch.Generator().manual_seed(int(seed))
    index = torch.randint(n, (resamples, n), generator=g)
    return torch.zeros(resamples, n).scatter_add_(1, index, torch.ones(resamples, n))


def resample_counts_for(rows: Sequence[Any], resamples: int, seed: int) -> torch.Tensor:
    """(resamples, N) counts of :func:`resample_counts` for the N rows of ``rows`` (arrays or tensors read
    together, one row per sample: a test split's logits and labels), drawn over the rows in the canonical
    order (:func:`nctv.canonical.canonical_order`) and given back in the order the rows came: column i
    holds the counts of row i's place in the canonical order.

    A row's counts so follow its contents, not where it stands: the same rows in any order get the same
    resamples, and every figure scored on them (each a function of the rows and their counts) is the
    same to the last bit. A run keys them by its test pictures' content and labels
    (``nctv.experiment.resample_key``), which every method shares, so its comparisons stay paired and its
    draws are the same on every machine."""
    order = torch.from_numpy(canonical_order(*rows))
    drawn = resample_counts(len(order), resamples, seed)
    counts = torch.empty_like(drawn)
    counts[:, order] = drawn
    return counts


# --------------------------------------------------------------------------- one set of logits


class _Sample:
    """Per-sample quantities of one set of logits, and their sums over every resample at once.

    Linear blocks (means, per-bin gaps and counts, SCE cells) are summed by one matrix product per
    call of :meth:`sums`; the full sample is the resample whose counts are all 1.
    """

    def __init__(self, logits: torch.Tensor, labels: torch.Tensor, n_bins: int):
        # The rows in the canonical order; resample counts follow them (canonical_counts).
        rows = canonical_order(logits, labels)
        self.rows = torch.from_numpy(rows)
        z = logits.detach().double()[self.rows.to(logits.device)]
        y = labels.to(z.device)[self.rows.to(z.device)]
        self.same = same_as_previous(z, y)
        logp = torch.log_softmax(z, dim=1)
        p = logp.exp()
        self.n, self.k = p.shape
        self.n_bins = n_bins
        self.p, self.y = p, y
        pred = torch.argmax(p, dim=1)
        self.conf = p.gather(1, pred[:, None]).squeeze(1)
        self.correct = (pred == y).double()
        self.gap = self.correct - self.conf
        onehot = torch.nn.functional.one_hot(y, self.k).double()
        self.means = torch.stack([self.correct, -torch.special.xlogy(p, p).sum(1), -logp.gather(1, y[:, None]).squeeze(1),
                                  ((p - onehot) ** 2).sum(1)], dim=1)
        self.bin = _bin_index(self.conf, n_bins)
        self.order = torch.sort(self.conf, stable=True).indices
        self.sorted_conf = self.conf[self.order]
        # The last of each run of equal confidences (sorted): where the KS error's steps end.
        self.step_end = torch.ones_like(self.sorted_conf, dtype=torch.bool)
        self.step_end[:-1] = self.sorted_conf[1:] != self.sorted_conf[:-1]
        group = torch.from_numpy(equal_mass_bins(self.conf.cpu().numpy(), n_bins)).to(p.device)
        # Within-group spreads come from the full sample and serve every resample (see _debiased_abs).
        self.ece_spread = _spread(self.bin, self.gap, n_bins)
        self.aece_spread = _spread(group, self.gap, n_bins)
        self._cache: dict[int, dict[str, torch.Tensor]] = {}
        self._sce: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._smooth_bandwidth: float | None = None

    def canonical_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Resample ``counts`` given in the caller's row order, in this sample's canonical order (the
        counts of identical rows sorted among them: nctv.canonical.sorted_within_duplicates)."""
        return sorted_within_duplicates(torch.index_select(counts, 1, self.rows.to(counts.device)), self.same)

    def smooth_inputs(self) -> tuple[np.ndarray, np.ndarray, float]:
        """Confidence and correctness (CPU float64) and smooth ECE's automatic bandwidth on the full sample."""
        conf, correct = self.conf.cpu().numpy(), self.correct.cpu().numpy()
        if self._smooth_bandwidth is None:
            self._smooth_bandwidth = float(smooth_ece_batch(conf, correct)[1][0])
        return conf, correct, self._smooth_bandwidth

    def _design(self) -> torch.Tensor:
        """Columns: 4 means, M gap sums, M counts (ECE, MCE)."""
        m = self.n_bins
        rows = torch.arange(self.n, device=self.p.device)
        cols = torch.zeros(self.n, 4 + 2 * m, dtype=torch.float64, device=self.p.device)
        cols[:, :4] = self.means
        cols[rows, 4 + self.bin] = self.gap
        cols[rows, 4 + m + self.bin] = 1.0
        return cols

    def sums(self, counts: torch.Tensor) -> dict[str, torch.Tensor]:
        """Σ_i counts_ri · column_i of every linear block, for every resample r (cached per count matrix)."""
        key = id(counts)
        if key not in self._cache:
            dtype = counts.dtype
            s = counts @ self._design().to(dtype)
            m = self.n_bins
            self._cache[key] = {"means": s[:, :4], "gap": s[:, 4:4 + m], "count": s[:, 4 + m:]}
        return self._cache[key]

    def sce_blocks(self):
        """Per block of classes: the (N, classes·M) columns holding each sample's gap 1[y = k] − p_ik in
        its class-bin cell, and the cells' spread. Kept when all classes fit in one block."""
        if self._sce is not None:
            return self._sce
        blocks = _sce_blocks(self)
        if self.n * self.k * self.n_bins > _BLOCK_ENTRIES:
            return blocks  # rebuilt per call: a thousand classes' columns would not fit in memory
        self._sce = list(blocks)
        return self._sce


def _spread(groups: torch.Tensor, values: torch.Tensor, n_groups: int) -> torch.Tensor:
    """n_b · s²_b per group: count times the within-group variance of ``values``."""
    cnt = torch.bincount(groups, minlength=n_groups).double()
    s1 = torch.bincount(groups, weights=values, minlength=n_groups)
    s2 = torch.bincount(groups, weights=values * values, minlength=n_groups)
    # n·s² = (Σv² − (Σv)²/n) · n/(n − 1); a group of one has no spread to estimate.
    ss = (s2 - s1 * s1 / cnt.clamp(min=1)) * cnt / (cnt - 1).clamp(min=1)
    return torch.where(cnt > 1, ss, torch.zeros_like(ss)).clamp(min=0)


def _sce_blocks(sample: "_Sample"):
    n, k, m = sample.n, sample.k, sample.n_bins
    per_block = max(1, _BLOCK_ENTRIES // (n * m))
    rows = torch.arange(n, device=sample.p.device)
    for start in range(0, k, per_block):
        cls = torch.arange(start, min(k, start + per_block), device=sample.p.device)
        p = sample.p[:, cls]
        g = (sample.y[:, None] == cls[None, :]).double() - p
        cell = torch.arange(len(cls), device=p.device)[None, :] * m + _bin_index(p.reshape(-1), m).view(n, -1)
        cols = torch.zeros(n, len(cls) * m, dtype=torch.float64, device=p.device)
        cols[rows[:, None].expand_as(cell), cell] = g
        yield cols, _spread(cell.reshape(-1), g.reshape(-1), len(cls) * m)


def _bin_index(values: torch.Tensor, n_bins: int) -> torch.Tensor:
    # nctv.metrics' bins: ((m−1)/M, m/M], 0 in the first bin.
    edges = torch.arange(n_bins + 1, dtype=torch.float64, device=values.device) / n_bins
    return (torch.searchsorted(edges, values.contiguous(), right=False) - 1).clamp_(0, n_bins - 1)


def _debiased_abs(s: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """n·|gap| estimated without the noise's upward bias: √max(S² − n·s², 0), S = Σ gap (per group).

    S² − n·s² is unbiased for (n·gap)²: E[S²] = (n·gap)² + n·σ².
    """
    return torch.sqrt((s * s - spread.to(s.dtype)).clamp(min=0))


Draws = tuple[torch.Tensor, torch.Tensor]  # (plug-in, debiased) value per resample


def _mean_metric(column: int) -> Callable[[_Sample, torch.Tensor], Draws]:
    def value(sample: _Sample, counts: torch.Tensor) -> Draws:
        v = sample.sums(counts)["means"][:, column] / sample.n
        return v, v

    return value


def _ece(sample: _Sample, counts: torch.Tensor) -> Draws:
    s = sample.sums(counts)["gap"]
    return s.abs().sum(1) / sample.n, _debiased_abs(s, sample.ece_spread).sum(1) / sample.n


def _mce(sample: _Sample, counts: torch.Tensor) -> Draws:
    sums = sample.sums(counts)
    s, cnt = sums["gap"], sums["count"]
    spread = sample.ece_spread
    filled = cnt > 0
    low = torch.tensor(-1.0, dtype=s.dtype, device=s.device)
    plug = torch.where(filled, s.abs() / cnt.clamp(min=1), low).amax(1)
    deb = torch.where(filled, _debiased_abs(s, spread) / cnt.clamp(min=1), low).amax(1)
    return plug, deb


def _aece(sample: _Sample, counts: torch.Tensor) -> Draws:
    """The equal-mass bins of each resample's confidences (a sample drawn twice is two equal
    confidences), exactly AECE on the full sample."""
    (s,) = _group_sums(sample, counts, sample.gap)
    return s.abs().sum(1) / sample.n, _debiased_abs(s, sample.aece_spread.to(s.device)).sum(1) / sample.n


def _l2_ce(sample: _Sample, counts: torch.Tensor) -> Draws:
    """The debiased ℓ2 calibration error (``nctv.metrics.l2_calibration_error``) of every resample, on
    AECE's equal-mass bins of the resample; already debiased, so both values are the same."""
    s_gap, s_acc, n_b = _group_sums(sample, counts, sample.gap, sample.correct, torch.ones_like(sample.gap))
    acc = s_acc / n_b.clamp(min=1)
    square = (s_gap / n_b.clamp(min=1)) ** 2 - acc * (1 - acc) / (n_b - 1).clamp(min=1)
    square = torch.where(n_b > 1, square, torch.zeros_like(square))
    v = torch.sqrt((n_b / sample.n * square).sum(1).clamp(min=0))
    return v, v


def _ks(sample: _Sample, counts: torch.Tensor) -> Draws:
    """The KS calibration error of every resample: the largest |partial sum| of the confidence-sorted
    residuals c − [correct], each sample counted as often as it is drawn, read after each run of equal
    confidences (the resample's runs end where the full sample's do; blocks of rows in float64)."""
    residual = (-sample.gap[sample.order]).to(counts.device)
    order = sample.order.to(counts.device)
    ends = sample.step_end.to(counts.device)
    out = torch.empty(len(counts), dtype=torch.float64, device=counts.device)
    for start in range(0, len(counts), 64):
        w = torch.index_select(counts[start:start + 64], 1, order).double()
        out[start:start + 64] = torch.cumsum(w * residual, 1)[:, ends].abs().amax(1) / sample.n
    return out, out


def _group_sums(sample: _Sample, counts: torch.Tensor, *values: torch.Tensor) -> list[torch.Tensor]:
    """Σ of each of ``values`` over the equal-mass bins of every resample (resamples × bins each): the
    bins ``nctv.metrics.equal_mass_bins`` gives the resample's confidences, each sample drawn c times
    being c equal confidences."""
    n, m = sample.n, sample.n_bins
    device = counts.device
    order = sample.order.to(device)
    conf = sample.sorted_conf.to(device)
    w = torch.index_select(counts, 1, order)
    # Float32 cumulative sums: place counts are exact below 2**24, value sums err by about 1e-7 of N.
    cum_w = torch.cumsum(w, 1)
    starts = torch.from_numpy(run_starts(n, m)).to(device, counts.dtype)  # places opening runs 1 … R − 1
    # The samples holding the last place of each run and the first of the next; the edge halfway.
    last = torch.searchsorted(cum_w, (starts - 1).expand(len(w), -1).contiguous(), right=True).clamp_(max=n - 1)
    first = torch.searchsorted(cum_w, starts.expand(len(w), -1).contiguous(), right=True).clamp_(max=n - 1)
    edge = (conf[last] + conf[first]) / 2.0
    # A confidence on an edge joins the bin below: the bin ends after the last sample <= edge.
    below = torch.searchsorted(conf, edge.contiguous(), right=True)
    out = []
    for v in values:
        cum_v = torch.cumsum(w * v[sample.order].to(device, counts.dtype), 1)
        upto = torch.cat([torch.zeros(len(w), 1, dtype=cum_v.dtype, device=device),
                          cum_v.gather(1, (below - 1).clamp_(min=0)), cum_v[:, -1:]], dim=1).double()
        sums = torch.diff(upto, dim=1)
        out.append(torch.nn.functional.pad(sums, (0, m - sums.shape[1])))
    return out


def _sce(sample: _Sample, counts: torch.Tensor) -> Draws:
    """Class-wise bins of p_ik; classes in blocks so the cell columns stay small for 1000 classes."""
    plug = torch.zeros(len(counts), dtype=torch.float64, device=counts.device)
    deb = torch.zeros_like(plug)
    for cols, spread in sample.sce_blocks():
        s = (counts @ cols.to(counts.dtype)).double()
        plug += s.abs().sum(1)
        deb += _debiased_abs(s, spread.to(s.device)).sum(1)
    return plug / (sample.n * sample.k), deb / (sample.n * sample.k)


def _smooth_ece(sample: _Sample, counts: torch.Tensor) -> Draws:
    """Smooth ECE of every resample at the full sample's bandwidth σ* (as binned ECE keeps its bins),
    so the interval is that of smECE_σ* on the population; not debiased."""
    conf, correct, sigma = sample.smooth_inputs()
    v = torch.from_numpy(smooth_ece_batch(conf, correct, sigma, counts=counts)[0]).to(counts.device)
    return v, v


@dataclass(frozen=True)
class ResampledMetric:
    """A metric scored on every resample at once: ``value(sample, counts)`` → (plug-in, debiased)
    per resample; the metric's values lie in [``low``, ``high``] (None: unbounded)."""

    value: Callable[[_Sample, torch.Tensor], Draws]
    low: float | None = 0.0
    high: float | None = None


#: Every metric with an interval. A new metric is one line here.
RESAMPLED: dict[str, ResampledMetric] = {
    "accuracy": ResampledMetric(_mean_metric(0), 0.0, 1.0),
    "entropy": ResampledMetric(_mean_metric(1)),
    "ece": ResampledMetric(_ece, 0.0, 1.0),
    "aece": ResampledMetric(_aece, 0.0, 1.0),
    "sce": ResampledMetric(_sce, 0.0, 1.0),
    "mce": ResampledMetric(_mce, 0.0, 1.0),
    "nll": ResampledMetric(_mean_metric(2)),
    "brier": ResampledMetric(_mean_metric(3), 0.0, 2.0),
    "smooth_ece": ResampledMetric(_smooth_ece, 0.0, 1.0),
    "ks": ResampledMetric(_ks, 0.0, 1.0),
    "l2_ce": ResampledMetric(_l2_ce, 0.0, 1.0),
}

#: Metrics that are 0 on the population when the top-label confidence is calibrated, and those that
#: are 0 when the probabilities are (classwise): the calibration test's two null hypotheses
#: (``nctv.consistency``) decide whether their intervals reach 0 (:func:`at_boundary`).
TOP_LABEL_ERRORS = ("ece", "aece", "mce", "smooth_ece", "ks", "l2_ce")
CLASSWISE_ERRORS = ("sce",)


def tested_p(metric: str, p_top_label: float | None, p_classwise: float | None) -> float | None:
    """The p-value of the calibration test that speaks for ``metric``: the top-label test for
    :data:`TOP_LABEL_ERRORS`, the classwise one for :data:`CLASSWISE_ERRORS`, None for any other metric."""
    if metric in TOP_LABEL_ERRORS:
        return p_top_label
    if metric in CLASSWISE_ERRORS:
        return p_classwise
    return None


def consistent(p_value: float | None, level: float = DEFAULT_LEVEL) -> bool:
    """Whether the calibration test's ``p_value`` leaves "calibrated" standing at 1 − ``level``
    (p ≥ 1 − level, with 1 − level rounded to 12 places: 1 − 0.95 is 0.05000000000000004 in floating
    point, and a p of exactly 0.05 does not reject at 5 %); None (no test) is not."""
    return p_value is not None and p_value >= round(1.0 - level, 12)


def at_boundary(iv: Interval, p_value: float, level: float = DEFAULT_LEVEL) -> Interval:
    """The interval of a calibration error given the calibration test's p-value: where the test does
    not reject "calibrated" at 1 − ``level`` (p ≥ 1 − level), a population value of 0 is consistent with
    the data, so the interval is widened down to 0. Near that boundary no bootstrap interval of a
    binned error holds its level (docs/method.md, "At the boundary"); the test does, by construction."""
    if consistent(p_value, level):
        return Interval(iv.estimate, 0.0, iv.high)
    return iv


def difference_at_boundary(diff: Interval, a: Interval, b: Interval, p_a: float | None, p_b: float | None,
                           level: float = DEFAULT_LEVEL) -> Interval:
    """The paired interval ``diff`` of a − b (two methods' calibration errors, :func:`difference`) made
    honest where a method's calibration test cannot reject "calibrated" (``p_a``, ``p_b``: each method's
    p-value for the metric, :func:`tested_p`; None: no test). ``a``, ``b``: each method's own interval,
    as the table shows it (after :func:`at_boundary`).

    * A consistent (:func:`consistent`): a may be 0, and then a − b = −b ∈ [−b.high, −b.low]; the
      interval is widened to hold that range too (the smallest interval holding both).
    * B consistent: b may be 0, and then a − b = a ∈ [a.low, a.high]; likewise.
    * Both: a = b = 0 is consistent with the data, so the interval holds 0: the two are tied.

    Neither: ``diff`` unchanged. The estimate is never moved. A pair whose every resample scores the two
    methods alike (``diff`` exactly [0, 0]: the same predictions on this test split) is unchanged too:
    their errors are equal whatever they are, so their difference is 0 with no boundary to reach."""
    if diff.estimate == diff.low == diff.high == 0.0:
        return diff
    a_calibrated, b_calibrated = consistent(p_a, level), consistent(p_b, level)
    low, high = diff.low, diff.high
    if a_calibrated:
        low, high = min(low, -b.high), max(high, -b.low)
    if b_calibrated:
        low, high = min(low, a.low), max(high, a.high)
    if a_calibrated and b_calibrated:
        low, high = min(low, 0.0), max(high, 0.0)
    return Interval(diff.estimate, low, high)


#: What a table says of a pair whose paired interval the rule widened (:func:`boundary_note`).
BOTH_CONSISTENT = "both consistent with calibrated"


def boundary_note(method: str, other: str, method_calibrated: bool, other_calibrated: bool) -> str:
    """Why a pair's interval was widened at the boundary, in a reader's words ("" where it was not)."""
    if method_calibrated and other_calibrated:
        return BOTH_CONSISTENT
    if method_calibrated or other_calibrated:
        return f"{method if method_calibrated else other} consistent with calibrated"
    return ""


# --------------------------------------------------------------------------- a method's draws


@dataclass
class MethodDraws:
    """One method's metric on the test split and on every resample (seeds combined).

    ``point``: plug-in value (mean over seeds; what tables show); ``estimate``: debiased value (mean
    over seeds); ``draws``: debiased value per resample, seeds redrawn with replacement.
    """

    point: float
    estimate: float
    draws: torch.Tensor


def method_draws(per_seed_logits: Sequence[Any], labels: Any, counts: torch.Tensor, n_bins: int,
                 metrics: Sequence[str], seed_draws: torch.Tensor | None = None) -> dict[str, MethodDraws]:
    """Draws of ``metrics`` for one method whose test logits are ``per_seed_logits`` (one per seed).

    ``seed_draws`` (resamples × seeds counts of seeds redrawn per resample, rows summing to the seed
    count) is needed with several seeds; :func:`seed_counts` makes it.
    """
    n_bins = check_bins(n_bins)
    unknown = [m for m in metrics if m not in RESAMPLED]
    if unknown:
        raise ValueError(f"No interval for metric(s) {', '.join(unknown)}; use {', '.join(RESAMPLED)}.")
    if len(per_seed_logits) > 1 and seed_draws is None:
        raise ValueError("Several seeds need seed_draws (nctv.intervals.seed_counts) to combine them.")
    samples = []
    for z in per_seed_logits:
        z = check_logits(z)
        samples.append(_Sample(z, check_labels(labels, z.shape[0], z.shape[1]).to(z.device), n_bins))
    n = samples[0].n
    if counts.shape[1] != n:
        raise ValueError(f"The resample counts are for {counts.shape[1]} samples, the logits have {n}.")
    device = samples[0].p.device
    counts = counts.to(device)
    ones = torch.ones(1, n, dtype=torch.float64, device=device)
    per_sample = [s.canonical_counts(counts) for s in samples]  # each seed's rows in its canonical order
    out = {}
    for name in metrics:
        spec = RESAMPLED[name]
        point = torch.stack([torch.cat(spec.value(s, ones)) for s in samples])  # seeds × (plug, debiased)
        draws = torch.stack([spec.value(s, c)[1].double() for s, c in zip(samples, per_sample)])  # seeds × resamples
        if len(samples) > 1:
            draws = (seed_draws.to(device, torch.float64) * draws.T).sum(1) / len(samples)
        else:
            draws = draws[0]
        out[name] = MethodDraws(float(point[:, 0].mean()), float(point[:, 1].mean()), draws.cpu())
    return out


def seed_counts(n_seeds: int, resamples: int, generator: torch.Generator) -> torch.Tensor:
    """(resamples, n_seeds) counts of seeds redrawn with replacement for each resample."""
    index = torch.randint(n_seeds, (resamples, n_seeds), generator=generator)
    return torch.nn.functional.one_hot(index, n_seeds).sum(1).double()


# --------------------------------------------------------------------------- intervals


def _bounds(estimate: float, truth: float, draws: torch.Tensor, level: float) -> tuple[float, float]:
    """The union of two bootstrap intervals of the estimator whose value on each resample is ``draws``:

    * basic (pivotal): [estimate − q_hi, estimate − q_lo], q the quantiles of (draw − truth), the
      resampled world's error (truth: the plug-in value of the test split) standing for the real one;
    * percentile: [quantile_lo(draws), quantile_hi(draws)].

    For a mean the two coincide up to skew. For a binned metric each fails on one side of the gap-to-noise
    ratio (docs/method.md, "Uncertainty of a result"), and their union holds the nominal level in both.
    """
    alpha = (1.0 - level) / 2
    q = torch.quantile(draws.double(), torch.tensor([alpha, 1 - alpha], dtype=torch.float64))
    basic = (estimate - (float(q[1]) - truth), estimate - (float(q[0]) - truth))
    return min(basic[0], float(q[0])), max(basic[1], float(q[1]))


def interval(d: MethodDraws, metric: str, level: float = DEFAULT_LEVEL) -> Interval:
    """The ``level`` interval of one method's ``metric``, clipped to the metric's possible values."""
    low, high = _bounds(d.estimate, d.point, d.draws, level)
    spec = RESAMPLED[metric]
    if spec.low is not None:
        low, high = max(low, spec.low), max(high, spec.low)
    if spec.high is not None:
        low, high = min(low, spec.high), min(high, spec.high)
    return Interval(d.estimate, low, high)


def difference(a: MethodDraws, b: MethodDraws, level: float = DEFAULT_LEVEL) -> Interval:
    """The paired ``level`` interval of (a − b): both scored on the same resamples."""
    low, high = _bounds(a.estimate - b.estimate, a.point - b.point, a.draws - b.draws, level)
    return Interval(a.estimate - b.estimate, low, high)


def wilson_interval(successes: Any, trials: Any, level: float = DEFAULT_LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval of a proportion per entry (NaN where there are no trials).

    Chosen for a reliability diagram's bins: it stays inside [0, 1] and keeps its coverage for bins of
    a few samples or with accuracy near 0 or 1, where the normal approximation does not.
    """
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    z = float(norm.ppf(0.5 + level / 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    empty = n <= 0
    return np.where(empty, np.nan, np.clip(centre - half, 0, 1)), np.where(empty, np.nan, np.clip(centre + half, 0, 1))


@dataclass(frozen=True)
class SmoothBand(SmoothReliability):
    """A smoothed reliability diagram with its pointwise ``level`` band over ``resamples`` resamples.

    ``low`` and ``high`` bound the smoothed accuracy at each mesh point (``confidence``): the bootstrap
    interval of the curve at the test split's bandwidth (:func:`smooth_band`), clipped to [0, 1].
    """

    low: np.ndarray
    high: np.ndarray
    level: float
    resamples: int


def smooth_band(confidence: Any, correct: Any, *, level: float = DEFAULT_LEVEL,
                resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> SmoothBand:
    """The smoothed reliability curve of top-label ``confidence`` and 0/1 ``correct`` (1-D, one per
    sample), with its bootstrap band.

    Every resample is smoothed at the test split's automatic bandwidth σ*, so all curves share one mesh;
    at each mesh point the band is the union of the basic interval [2·curve − q_hi, 2·curve − q_lo] and
    the percentile interval [q_lo, q_hi] (q: quantiles of the resampled curves), the construction of
    every other interval of a run. All resamples are
    smoothed at once from one count matrix (:func:`resample_counts_for` the pairs (confidence, correctness)
    with ``seed``), so the band is the same for the pairs in any order.
    """
    settings = IntervalSettings(level, resamples, seed)
    c = np.asarray(confidence.detach().cpu() if isinstance(confidence, torch.Tensor) else confidence, dtype=np.float64)
    y = np.asarray(correct.detach().cpu() if isinstance(correct, torch.Tensor) else correct, dtype=np.float64)
    if c.ndim != 1 or y.ndim != 1:
        raise ValueError("smooth_band takes one value of confidence and of correctness per sample (1-D arrays).")
    value, sigma = smooth_ece_batch(c, y)
    bandwidth = float(sigma[0])
    mesh, curve, density = smooth_reliability_curves(c, y, bandwidth)
    counts = resample_counts_for((c, y), settings.resamples, settings.seed)
    _, draws, _ = smooth_reliability_curves(c, y, bandwidth, counts=counts)
    alpha = (1.0 - settings.level) / 2
    q_low, q_high = np.quantile(draws, [alpha, 1 - alpha], axis=0)
    low = np.clip(np.minimum(2 * curve[0] - q_high, q_low), 0.0, 1.0)
    high = np.clip(np.maximum(2 * curve[0] - q_low, q_high), 0.0, 1.0)
    return SmoothBand(mesh, curve[0], density[0], bandwidth, float(value[0]), low, high,
                      float(settings.level), settings.resamples)
