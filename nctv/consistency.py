"""Is this model calibrated? A test with a p-value, by consistency resampling (Bröcker & Smith 2007).

H₀ (top-label): the top-label confidence is calibrated, P(ŷ = y | c) = c. H₀ (classwise): the
probabilities are calibrated, P(y = k | p) = p_k, which makes every class's calibration error 0.

Under H₀ a label drawn from the model's own probabilities, y* ~ Categorical(p_i), has the same
conditional law as the real one, given the logits. So the test draws ``resamples`` label vectors that
way, computes the statistic on each (the binned ECE of the top-label confidence; the classwise ECE,
:func:`nctv.metrics.sce`, for the classwise H₀) and gives p = (1 + #{T* ≥ T}) / (1 + resamples), T the
statistic on the real labels. Given the logits this p-value is exact for a model with one set of
logits (P(p ≤ a) ≤ a under H₀, for every a), whatever N, K or the bins: no asymptotics. A large p says
the data cannot tell the model from a calibrated one; it does not say the model is calibrated.

Several seeds (a stochastic method's row): the statistic is the mean over seeds, and each resample
draws one uniform number per sample, shared by the seeds (inverse CDF of each seed's probabilities),
as the seeds share one real label. That is exact for identical seeds and an approximation otherwise.

The rows are first put in the canonical order (:mod:`nctv.canonical`, keyed by every seed's logits and
the label), and the resamples' uniforms are drawn in that order: a sample gets the same draws wherever
it stands in the input, so the same rows shuffled give the same statistics and p-values to the last bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from nctv.canonical import canonical_order
from nctv.checks import check_bins, check_labels, check_logits
from nctv.settings import DEFAULT_RESAMPLES

# A block of resamples keeps its (samples × resamples) arrays below this many entries.
_BLOCK_ENTRIES = 2**23


@dataclass(frozen=True)
class CalibrationTest:
    """The two tests' statistics on the real labels (fractions) and their p-values."""

    ece: float
    p_top_label: float
    classwise_ece: float
    p_classwise: float
    resamples: int
    n_bins: int


def _bins(values: torch.Tensor, n_bins: int) -> torch.Tensor:
    # nctv.metrics' equal-width bins ((m−1)/M, m/M], 0 in the first bin.
    edges = torch.arange(n_bins + 1, dtype=torch.float64) / n_bins
    return (torch.searchsorted(edges, values.contiguous(), right=False) - 1).clamp_(0, n_bins - 1)


class _Seed:
    """One set of logits: what the statistics need, computed once."""

    def __init__(self, logits: torch.Tensor, n_bins: int):
        p = torch.softmax(logits.detach().to("cpu", torch.float64), dim=1)
        self.p, self.n_bins = p, n_bins
        self.n, self.k = p.shape
        self.cum = torch.cumsum(p, 1)
        self.pred = torch.argmax(p, 1)
        conf = p.gather(1, self.pred[:, None]).squeeze(1)
        self.bin = _bins(conf, n_bins)
        self.conf_sums = torch.bincount(self.bin, weights=conf, minlength=n_bins)
        self.bin_matrix = torch.nn.functional.one_hot(self.bin, n_bins).T.double()
        # Σ_i p_ik over the samples whose p_ik falls in bin b, per cell k·M + b (classwise ECE's fixed part).
        cells = (torch.arange(self.k)[None, :] * n_bins + _bins(p.reshape(-1), n_bins).view(self.n, self.k)).reshape(-1)
        self.cell_sums = torch.bincount(cells, weights=p.reshape(-1), minlength=self.k * n_bins)

    def labels(self, u: torch.Tensor) -> torch.Tensor:
        """Labels drawn by inverse CDF from uniforms ``u`` (samples × resamples)."""
        if self.k <= 32:  # a comparison per class is faster than a search for few classes
            return (u[:, :, None] >= self.cum[:, None, :]).sum(-1).clamp_(max=self.k - 1)
        return torch.searchsorted(self.cum, u.contiguous(), right=True).clamp_(max=self.k - 1)

    def statistics(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-label ECE and classwise ECE for every column of ``labels`` (samples × columns)."""
        cols = labels.shape[1]
        correct = (labels == self.pred[:, None]).double()
        acc = self.bin_matrix @ correct  # bins × columns: Σ correctness per bin
        ece = (acc - self.conf_sums[:, None]).abs().sum(0) / self.n
        p_label = self.p.gather(1, labels)
        cells = labels * self.n_bins + _bins(p_label.reshape(-1), self.n_bins).view_as(labels)
        keys = (cells + torch.arange(cols)[None, :] * (self.k * self.n_bins)).reshape(-1)
        counts = torch.bincount(keys, minlength=cols * self.k * self.n_bins).view(cols, -1).double()
        classwise = (counts - self.cell_sums[None, :]).abs().sum(1) / (self.n * self.k)
        return ece, classwise


def consistency_test(per_seed_logits: Any | Sequence[Any], labels: Any, n_bins: int = 15,
                     resamples: int = DEFAULT_RESAMPLES, seed: int = 0, key: Any = None) -> CalibrationTest:
    """Test H₀ "calibrated" for one set of logits, or the mean over a method's seeds (a list of them).

    ``resamples`` label vectors are drawn from the model's probabilities with ``seed`` (a torch
    generator on the CPU: the same p-values on every device). See the module docstring.

    Each sample's uniforms follow its place in the canonical order of ``key`` and the labels (``key``: one
    row per sample, e.g. each test picture's identity, ``nctv.data.row_keys``, as a run gives it), or of
    the logits and the labels without one. Keyed by the pictures, the draws stay with their pictures when
    another CPU rounds the logits' last bits differently, so the p-value is the same on every machine.
    """
    n_bins = check_bins(n_bins)
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be a whole number of at least 1; got {resamples!r}.")
    many = isinstance(per_seed_logits, (list, tuple))
    logits = [check_logits(z) for z in (per_seed_logits if many else [per_seed_logits])]
    if any(z.shape != logits[0].shape for z in logits):
        raise ValueError("Every seed's logits must have the same shape.")
    y = check_labels(labels, *logits[0].shape).cpu()
    if key is not None and len(key) != len(y):
        raise ValueError(f"key has {len(key)} rows; the logits have {len(y)}.")
    rows = torch.from_numpy(canonical_order(*logits, y) if key is None else canonical_order(key, y))
    seeds = [_Seed(z.cpu()[rows], n_bins) for z in logits]
    y = y[rows]
    observed = [torch.stack(s.statistics(y[:, None])).mean(1) for s in seeds]
    ece, classwise = (float(v) for v in torch.stack(observed).mean(0))
    g = torch.Generator().manual_seed(int(seed))
    n = seeds[0].n
    block = max(1, _BLOCK_ENTRIES // (n * max(1, seeds[0].k * n_bins // 64)))
    above = torch.zeros(2, dtype=torch.long)
    done = 0
    while done < resamples:
        cols = min(block, resamples - done)
        u = torch.rand(n, cols, generator=g, dtype=torch.float64)
        stats = torch.stack([torch.stack(s.statistics(s.labels(u))) for s in seeds]).mean(0)  # 2 × cols
        # A resample ties the observed value up to rounding: counted as at least as large.
        above += (stats >= torch.tensor([ece, classwise], dtype=torch.float64)[:, None] - 1e-12).sum(1)
        done += cols
    p_top, p_cls = ((1 + above.double()) / (1 + resamples)).tolist()
    return CalibrationTest(ece, p_top, classwise, p_cls, resamples, n_bins)
