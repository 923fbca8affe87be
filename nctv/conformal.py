"""Split conformal prediction sets on top of any calibrator's probabilities (SPEC §7, docs/conformal.md).

A calibrator gives probabilities p(x); a conformal predictor turns them into a *set* of classes that holds
the true class with probability at least 1 − α over the draw of the calibration and test points, whatever
the model, as long as they are exchangeable:

1. a score s(x, y) ≥ 0 (large: y looks unlikely) is computed for every calibration point at its label;
2. q̂ is the k-th smallest of these n scores, k = ⌈(n + 1)(1 − α)⌉ (q̂ = +∞, every class, when k > n);
3. the set of a test point is {y : s(x, y) ≤ q̂}.

Scores (``SCORES``), with classes ranked by p, largest first, ties to the lower class index, and
v ∈ [0, 1) the randomisation of APS and RAPS (v = 0 when not randomised):

* ``"lac"`` (Sadinle, Lei & Wasserman 2019; "THR" in some papers): s = 1 − p_y.
* ``"aps"`` (Romano, Sesia & Candès 2020): s = Σ p over the classes ranked at or above y − v · p_y, i.e. the
  mass ranked above y plus u · p_y with u = 1 − v ~ U(0, 1]; not randomised: u = 1.
* ``"raps"`` (Angelopoulos, Bates, Malik & Jordan 2021): APS + λ · max(0, rank(y) − k_reg), rank 1 for the
  most probable class.

RAPS's λ (``penalty``) and ``k_reg``: a number given is used as it is; None (the default) means tuned, as
the RAPS paper does, on a held-out part of the calibration split (:func:`tune_raps`):

1. the tuning part: ⌈share · n⌉ of the n calibration points (``tune_share``, 0.3 by default as in the
   authors' code; at least 1 and at most n − 1), drawn by a seeded permutation (:func:`tuning_split`);
   the other points are the conformal part;
2. k_reg = the rank of the true label (1 for the most probable class, ties to the lower class index)
   that covers a 1 − α share of the tuning part: with r the tuning points' ranks sorted ascending,
   k_reg = r[⌈(1 − α)(n_t − 1)⌉] (0-based index; numpy's ``quantile(ranks − 1, 1 − α, method="higher") + 1``);
3. λ = the value of ``RAPS_PENALTY_GRID`` (0.001, 0.01, 0.1, 0.2, 0.5) whose sets on the tuning part,
   conformalised on the tuning part itself with that λ and k_reg (randomised and class-conditional as the
   final sets are), are smallest on average; ties go to the smallest λ;
4. q̂ is then computed from the conformal part only. The tuning part, which chose λ and k_reg, is kept
   out of q̂, so the conformal part and a test point stay exchangeable given λ and k_reg and the
   guarantee holds.

``v`` is drawn per sample from a seeded generator, one stream for the calibration scores and another for
the test sets (a third stream of the same seed draws the tuning split), so a seed reproduces every set.
All arithmetic is float64 on the CPU.

Every seeded draw over rows (v, the tuning split, :func:`split_calibration`, the test split's resamples)
is made over the rows in their canonical order (:func:`rows_order`: by the probabilities, then, among rows
of equal probabilities, by the label), so a row gets the same draw wherever it stands: the same rows in
any order give the same q̂, λ, k_reg, sets and figures, to the last bit.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Sequence

import numpy as np
import torch

from nctv.canonical import canonical_order, same_as_previous
from nctv.checks import NotFittedError, check_labels, check_logits, shown
from nctv.intervals import Interval, IntervalSettings, _bounds, resample_counts_for, wilson_interval
from nctv.metrics import _prepare

SCORES = ("lac", "aps", "raps")
#: The coverage 1 − α a set aims at by default.
DEFAULT_COVERAGE = 0.9
#: RAPS's λ and k_reg that the RAPS authors' code documents as working for many models (``kreg=5,
#: lamda=0.01``); pass them to ``ConformalSettings`` for those fixed values. By default both are tuned.
RAPS_PENALTY = 0.01
RAPS_K_REG = 5
#: The λ values tried when λ is tuned, smallest first: the RAPS authors' grid.
RAPS_PENALTY_GRID = (0.001, 0.01, 0.1, 0.2, 0.5)
#: The share of the calibration split held out to tune RAPS's λ and k_reg (the authors' default).
RAPS_TUNE_SHARE = 0.3
#: A class enters the worst-class coverage only with at least this many test points.
MIN_CLASS_POINTS = 10


@dataclass(frozen=True)
class ConformalSettings:
    """How sets are made: the ``score`` (``SCORES``), the target ``coverage`` 1 − α, whether APS / RAPS are
    ``randomized`` (and the ``seed`` of their draws and of the tuning split), RAPS's ``penalty`` λ and
    ``k_reg``, and whether each class gets its own threshold (``class_conditional``, Mondrian: q̂_y from the
    calibration points of class y).

    RAPS's ``penalty`` and ``k_reg``: None (the default) tunes that value on ``tune_share`` of the
    calibration split, held out from q̂, as the RAPS paper does (module docstring); a number is used as
    given (``penalty=RAPS_PENALTY, k_reg=RAPS_K_REG`` for the authors' fixed defaults). With both given,
    nothing is held out. LAC and APS ignore all three.

    LAC by default: the smallest sets of the three on the embedded default (about one class at 90 %).
    Not randomised by default: the same picture then always gets the same set, and coverage is still
    at least 1 − α (the randomised sets reach 1 − α exactly on average and, for APS, are far smaller
    on an over-confident model; docs/conformal.md has the figures).
    """

    score: str = "lac"
    coverage: float = DEFAULT_COVERAGE
    randomized: bool = False
    penalty: float | None = None
    k_reg: int | None = None
    class_conditional: bool = False
    seed: int = 0
    tune_share: float = RAPS_TUNE_SHARE

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"Unknown conformal score {shown(self.score)}; use one of {', '.join(SCORES)}.")
        c = self.coverage
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or not 0 < c < 1:
            raise ValueError(f"The coverage must be a fraction between 0 and 1, e.g. 0.9 for 90 %; got {shown(c)}.")
        if not isinstance(self.randomized, bool) or not isinstance(self.class_conditional, bool):
            raise ValueError("randomized and class_conditional must be True or False.")
        p = self.penalty
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p < 0):
            raise ValueError(f"The RAPS penalty λ must be a finite number >= 0, or None to tune it; got {shown(p)}.")
        for name, tunable in (("k_reg", True), ("seed", False)):
            v = getattr(self, name)
            if tunable and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name} must be a whole number >= 0{', or None to tune it' if tunable else ''}; "
                                 f"got {shown(v)}.")
        t = self.tune_share
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t < 1:
            raise ValueError("The tuning share (the part of the calibration split held out to tune RAPS's λ and "
                             f"k_reg) must be a fraction between 0 and 1, e.g. 0.3; got {shown(t)}.")

    @property
    def tunes(self) -> bool:
        """True when fitting holds part of the calibration split out to tune RAPS's λ or k_reg."""
        return self.score == "raps" and (self.penalty is None or self.k_reg is None)

    @property
    def alpha(self) -> float:
        return 1.0 - float(self.coverage)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- scores and threshold


def probabilities(logits: Any, from_probabilities: bool = False) -> torch.Tensor:
    """(N, K) CPU float64 probabilities from logits (or, with ``from_probabilities=True``, checked
    probabilities), as every NCTV metric reads them."""
    return _prepare(logits, None, from_probabilities, canonical=False)[1]


def _stream(seed: int, stream: int) -> np.random.Generator:
    """Stream ``stream`` of one seed: numpy's PCG64 from child ``stream`` of ``SeedSequence(seed)`` (a child
    depends only on the seed and its number). 0: calibration v, 1: test v, 2: the tuning split."""
    return np.random.default_rng(np.random.SeedSequence(int(seed)).spawn(stream + 1)[stream])


def noise(n: int, seed: int, stream: int) -> torch.Tensor:
    """v ~ U[0, 1) for ``n`` samples: stream 0 for calibration scores, 1 for test sets (independent
    streams of one seed, numpy's PCG64 from ``SeedSequence(seed).spawn``)."""
    return torch.from_numpy(_stream(seed, stream).random(n))


def rows_order(p: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """The permutation that puts rows of probabilities ``p`` in the canonical order (nctv.canonical), rows of
    equal probabilities ordered by their ``labels`` (when given): the order the seeded draws over rows
    follow. The labels only break ties, so a test row keeps its place whether its sets are made alone
    (:meth:`ConformalPredictor.predict_sets`) or scored with its label (:meth:`ConformalPredictor.evaluate`)."""
    order = canonical_order(p)
    if labels is not None and len(order) > 1:
        same = same_as_previous(p[torch.from_numpy(order)])
        if same.any():
            runs = np.cumsum(~same)
            order = order[np.lexsort((labels.numpy()[order], runs))]
    return torch.from_numpy(order)


def _in_rows(drawn: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Values drawn for the places of the canonical order (``drawn[j]`` for place j), put back on the rows
    given: row ``order[j]`` gets ``drawn[j]``."""
    out = torch.empty_like(drawn)
    out[order] = drawn
    return out


def class_scores(p: torch.Tensor, score: str, v: torch.Tensor | None = None, penalty: float = RAPS_PENALTY,
                 k_reg: int = RAPS_K_REG) -> torch.Tensor:
    """s(x, y) of every class: (N, K) from (N, K) probabilities ``p`` (float64).

    ``v``: the APS / RAPS randomisation, (N,) per sample or (N, K) per class; None: not randomised (v = 0).
    """
    if score == "lac":
        return 1.0 - p
    order = torch.sort(p, dim=1, descending=True, stable=True).indices
    ranked = p.gather(1, order)
    s = torch.cumsum(ranked, dim=1)
    if v is not None:
        v = v.to(p.dtype)
        s = s - (v[:, None] if v.ndim == 1 else v.gather(1, order)) * ranked
    if score == "raps":
        rank = torch.arange(1, p.shape[1] + 1, dtype=p.dtype)
        s = s + penalty * torch.clamp(rank - k_reg, min=0)
    return torch.empty_like(s).scatter_(1, order, s)


def quantile_index(n: int, coverage: float) -> int:
    """k = ⌈(n + 1)(1 − α)⌉, computed exactly from the decimal ``coverage`` (0.9 is 9/10, not the float
    just above it): q̂ is the k-th smallest of n scores."""
    return math.ceil((n + 1) * Fraction(str(float(coverage))))


def conformal_threshold(scores: torch.Tensor, coverage: float) -> float:
    """q̂: the ⌈(n + 1)(1 − α)⌉-th smallest of the 1-D ``scores``; +∞ when that index exceeds n (or n = 0)."""
    n = int(scores.numel())
    k = quantile_index(n, coverage)
    if n == 0 or k > n:
        return math.inf
    return float(torch.sort(scores.reshape(-1).double()).values[k - 1])


def _thresholds(own: torch.Tensor, y: torch.Tensor, n_classes: int, coverage: float,
                class_conditional: bool) -> torch.Tensor:
    """(K,) q̂ per class: one q̂ from every score at its label, or (class-conditional) q̂_y from class y's."""
    if class_conditional:
        return torch.tensor([conformal_threshold(own[y == c], coverage) for c in range(n_classes)], dtype=torch.float64)
    return torch.full((n_classes,), conformal_threshold(own, coverage), dtype=torch.float64)


# --------------------------------------------------------------------------- tuning RAPS


def tuning_split(n: int, share: float = RAPS_TUNE_SHARE, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Places (tuning, conformal), each ascending, in a calibration split of ``n`` points: a permutation
    of 0..n−1 from stream 2 of ``seed`` (:func:`_stream`, numpy's ``Generator.permutation``); its first
    ⌈share · n⌉ entries (share read as the decimal it is written as; at least 1, at most n − 1) tune RAPS,
    the rest make q̂. Disjoint, and together every point. :meth:`ConformalPredictor.fit` reads them as
    places in the rows' canonical order (:func:`rows_order`)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise ValueError("Tuning RAPS's λ and k_reg holds out part of the calibration split, so it needs at least "
                         f"2 calibration points; got {shown(n)}. Give penalty and k_reg as numbers instead.")
    ConformalSettings(tune_share=share)  # checks the share
    m = min(max(1, math.ceil(int(n) * Fraction(str(float(share))))), int(n) - 1)
    perm = torch.from_numpy(_stream(seed, 2).permutation(int(n)))
    return perm[:m].sort().values, perm[m:].sort().values


def label_ranks(p: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N,) the rank of each row's label among its classes by ``p``: 1 for the most probable, ties to the
    lower class index (the order of :func:`class_scores`)."""
    order = torch.sort(p, dim=1, descending=True, stable=True).indices
    return (order == labels[:, None]).int().argmax(1) + 1


def tuned_k_reg(p: torch.Tensor, labels: torch.Tensor, coverage: float) -> int:
    """RAPS's k_reg from tuning points: with r their label ranks (:func:`label_ranks`) sorted ascending,
    r[⌈coverage · (n − 1)⌉] (0-based; the 'higher' quantile at 1 − α, computed exactly from the decimal
    ``coverage``): the smallest rank that holds the true label of a 1 − α share of them."""
    r = torch.sort(label_ranks(p, labels)).values
    if r.numel() == 0:
        raise ValueError("Tuning k_reg needs at least one tuning point.")
    return int(r[math.ceil((r.numel() - 1) * Fraction(str(float(coverage))))])


def tuned_penalty(p: torch.Tensor, labels: torch.Tensor, k_reg: int, settings: "ConformalSettings",
                  v: torch.Tensor | None = None, grid: Sequence[float] = RAPS_PENALTY_GRID) -> tuple[float, dict[float, float]]:
    """RAPS's λ from tuning points (λ, {λ: mean set size}): for each λ of ``grid``, q̂ (or q̂_y when
    ``settings.class_conditional``) from the tuning points' own scores at ``settings.coverage``, then their
    own sets {y : s ≤ q̂} counted; the λ of the fewest classes in all, the smallest λ on ties (sizes are
    compared as whole-number totals, so a tie is exact). ``v``: the tuning points' randomisation (None: v = 0)."""
    n, k = p.shape
    best, sizes, fewest = None, {}, None
    for lam in sorted(float(x) for x in grid):
        s = class_scores(p, "raps", v, lam, k_reg)
        q = _thresholds(s.gather(1, labels[:, None]).squeeze(1), labels, k, settings.coverage, settings.class_conditional)
        total = int((s <= q[None, :]).sum())
        sizes[lam] = total / n
        if fewest is None or total < fewest:
            best, fewest = lam, total
    return best, sizes


def tune_raps(p: torch.Tensor, labels: torch.Tensor, settings: "ConformalSettings",
              v: torch.Tensor | None = None) -> tuple[float, int, dict[float, float]]:
    """RAPS's (λ, k_reg, {λ: mean set size on the tuning points}) from the tuning points ``p``, ``labels``:
    a value the settings give is kept; k_reg is tuned first (:func:`tuned_k_reg`), then λ with it
    (:func:`tuned_penalty`). The sizes are empty when λ is given."""
    k_reg = settings.k_reg if settings.k_reg is not None else tuned_k_reg(p, labels, settings.coverage)
    if settings.penalty is not None:
        return float(settings.penalty), int(k_reg), {}
    lam, sizes = tuned_penalty(p, labels, k_reg, settings, v)
    return lam, int(k_reg), sizes


# --------------------------------------------------------------------------- the predictor


class ConformalPredictor:
    """Split conformal sets: ``fit`` on the conformal calibration split, then ``predict_sets``.

    Example::

        cp = ConformalPredictor(ConformalSettings("aps", coverage=0.9)).fit(cal_logits, cal_labels)
        sets = cp.predict_sets(test_logits)            # (N, K) bool
        report = cp.evaluate(test_logits, test_labels)  # coverage, mean size, worst class, with intervals

    Logits by default; probabilities with ``from_probabilities=True`` (as every NCTV metric).
    """

    def __init__(self, settings: ConformalSettings | None = None):
        self.settings = settings if settings is not None else ConformalSettings()

    def _randomized(self) -> bool:
        return self.settings.randomized and self.settings.score != "lac"

    def _draws(self, order: torch.Tensor | None, stream: int, draws: Any) -> torch.Tensor | None:
        """v per row: ``draws`` as given, else the seed's stream drawn over the rows' canonical places
        (``order``: :func:`rows_order`); None when the sets are not randomised."""
        if not self._randomized():
            return None
        if draws is not None:
            return torch.as_tensor(draws).to(torch.float64)
        return _in_rows(noise(len(order), self.settings.seed, stream), order)

    def fit(self, logits: Any, labels: Any, from_probabilities: bool = False, draws: Any = None) -> "ConformalPredictor":
        """Compute q̂ (``threshold_``; per class in ``thresholds_``) from the calibration split.

        RAPS with λ or k_reg left to tuning (the default) first holds ``tune_share`` of the points out
        (``tuning_indices_``), tunes on them (``tuning_sizes_``: the mean set size of each λ tried) and
        computes q̂ from the rest (``conformal_indices_``; ``n_calibration_`` counts them); otherwise every
        point makes q̂. ``penalty_`` and ``k_reg_`` are the values used (None for LAC and APS).

        ``draws``: the randomisation v (N,) to use instead of the seeded one (to replay another library's).
        The seeded draws (v, the tuning part) follow the rows' canonical order (:func:`rows_order`), so the
        same rows in any order give the same q̂, λ and k_reg."""
        st = self.settings
        p = probabilities(logits, from_probabilities)
        n, k = p.shape
        y = check_labels(labels, n, k).cpu()
        order = rows_order(p, y) if st.tunes or (self._randomized() and draws is None) else None
        v = self._draws(order, 0, draws)
        every = torch.arange(n)
        if st.tunes:
            tune, conf = (order[at].sort().values for at in tuning_split(n, st.tune_share, st.seed))
        else:
            tune, conf = every[:0], every
        self.penalty_, self.k_reg_, self.tuning_sizes_ = None, None, {}
        if st.score == "raps":
            self.penalty_, self.k_reg_, self.tuning_sizes_ = tune_raps(p[tune], y[tune], st, None if v is None else v[tune])
        self.tuning_indices_, self.conformal_indices_ = tune, conf
        s = self._class_scores(p[conf], None if v is None else v[conf])
        own = s.gather(1, y[conf, None]).squeeze(1)
        self.n_classes_ = k
        self.n_calibration_ = int(conf.numel())
        self.threshold_ = conformal_threshold(own, st.coverage)
        self.thresholds_ = _thresholds(own, y[conf], k, st.coverage, st.class_conditional)
        return self

    def _class_scores(self, p: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        if self.settings.score == "raps":
            return class_scores(p, "raps", v, self.penalty_, self.k_reg_)
        return class_scores(p, self.settings.score, v)

    def predict_sets(self, logits: Any, from_probabilities: bool = False, draws: Any = None) -> torch.Tensor:
        """(N, K) bool: class y is in the set of row i when s(x_i, y) ≤ q̂ (q̂_y when class-conditional).

        ``draws``: the randomisation v, (N,) or (N, K) per class, instead of the seeded one, which follows
        the rows' canonical order (:func:`rows_order`): a row's set does not depend on where it stands."""
        return self._sets(probabilities(logits, from_probabilities), None, draws)

    def _sets(self, p: torch.Tensor, labels: torch.Tensor | None, draws: Any) -> torch.Tensor:
        """The sets of probabilities ``p``; ``labels`` (None: unknown) order rows of equal ``p`` for v."""
        if not hasattr(self, "thresholds_"):
            raise NotFittedError("Fit the conformal predictor on the calibration split first (ConformalPredictor.fit).")
        order = rows_order(p, labels) if self._randomized() and draws is None else None
        s = self._class_scores(p, self._draws(order, 1, draws))
        if s.shape[1] != self.n_classes_:
            raise ValueError(f"The predictor was fitted on {self.n_classes_} classes; these logits have {s.shape[1]}.")
        return s <= self.thresholds_[None, :]

    def to_dict(self) -> dict[str, Any]:
        """The settings with the values the fitted sets use: ``penalty`` and ``k_reg`` as used (None for
        LAC and APS), ``tuned`` (which of the two were tuned), ``n_tune`` (points held out to tune them) and
        ``n_conformal`` (points q̂ came from)."""
        if not hasattr(self, "thresholds_"):
            raise NotFittedError("Fit the conformal predictor on the calibration split first (ConformalPredictor.fit).")
        st = self.settings
        tuned = [name for name in ("penalty", "k_reg") if st.tunes and getattr(st, name) is None]
        return {**st.to_dict(), "penalty": self.penalty_, "k_reg": self.k_reg_, "tuned": tuned,
                "n_tune": int(self.tuning_indices_.numel()), "n_conformal": int(self.conformal_indices_.numel())}

    def evaluate(self, logits: Any, labels: Any, from_probabilities: bool = False,
                 intervals: IntervalSettings | None = None, min_class_points: int = MIN_CLASS_POINTS,
                 counts: torch.Tensor | None = None) -> "SetEvaluation":
        """The sets of the test split scored with intervals (:func:`evaluate_sets`; ``counts`` as there).
        Rows of equal probabilities take the seeded v in the order of their labels (:func:`rows_order`)."""
        p = probabilities(logits, from_probabilities)
        y = check_labels(labels, *p.shape).cpu()
        return evaluate_sets(self._sets(p, y, None), y, intervals, min_class_points, counts)


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class ClassCoverage:
    """One class's row: its test points ``n``, the share of them whose set holds the class (``coverage``,
    with its Wilson interval ``low``–``high``) and their mean set size; None where the class has no test point."""

    label: int
    n: int
    coverage: float | None
    low: float | None
    high: float | None
    mean_size: float | None


@dataclass(frozen=True)
class SetEvaluation:
    """Coverage, mean set size and the worst class's coverage on the test split, each with its bootstrap
    interval (nctv.intervals: the test split resampled, ``settings``); ``empty`` is the share of empty sets,
    ``worst_class`` the class of lowest coverage among those with at least ``min_class_points`` test points."""

    coverage: Interval
    mean_size: Interval
    worst_class_coverage: Interval
    worst_class: int
    empty: float
    n: int
    min_class_points: int
    classes: tuple[ClassCoverage, ...]
    settings: IntervalSettings

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["settings"] = self.settings.to_dict()
        d["classes"] = [asdict(c) for c in self.classes]
        return d


def _interval(point: float, draws: torch.Tensor, level: float, low: float, high: float) -> Interval:
    lo, hi = _bounds(point, point, draws, level)
    return Interval(point, min(max(lo, low), high), min(max(hi, low), high))


def evaluate_sets(sets: Any, labels: Any, intervals: IntervalSettings | None = None,
                  min_class_points: int = MIN_CLASS_POINTS, counts: torch.Tensor | None = None) -> SetEvaluation:
    """Score (N, K) boolean ``sets`` against the true ``labels``.

    Intervals: every figure is recomputed on each resample of the test split and the interval is the
    project's union of the basic and percentile bootstrap intervals. They cover the test split's randomness
    with the calibration split (so q̂) and the randomisation held fixed. The resamples: ``counts``
    (resamples × N, in the rows' order) where given, e.g. a run's, drawn over its test pictures
    and labels (:func:`nctv.intervals.resample_counts_for`) so that its methods' figures are paired; else
    drawn with ``intervals``' seed over the rows (set, label) in their canonical order, the same for the
    rows in any order.

    Worst class: the minimum over the classes that have at least ``min_class_points`` test points of their
    coverage (classes with fewer are listed per class but left out of the minimum, whose noise they would
    dominate); in a resample, a listed class that drew no point is skipped.
    """
    st = intervals if intervals is not None else IntervalSettings()
    m = torch.as_tensor(sets)
    if m.ndim != 2 or m.dtype != torch.bool:
        raise ValueError("sets must be an (N, K) array of True/False, as ConformalPredictor.predict_sets gives.")
    n, k = m.shape
    y = check_labels(labels, n, k)
    covered = m.gather(1, y[:, None]).squeeze(1).double()
    size = m.sum(1).double()
    onehot = torch.nn.functional.one_hot(y, k).double()
    # Float32 counts as nctv.intervals keeps them: sums of whole numbers, exact below 2**24, in any order.
    if counts is None:
        counts = resample_counts_for((m, y), st.resamples, st.seed)
    elif counts.shape != (st.resamples, n):
        raise ValueError(f"The resample counts are {tuple(counts.shape)}; these sets need ({st.resamples}, {n}).")
    counts = counts.to("cpu", torch.float32)
    eligible = onehot.sum(0) >= min_class_points
    if not bool(eligible.any()):
        raise ValueError(f"No class has {min_class_points} test points; the worst class's coverage needs more test data.")

    per_class_n = onehot.sum(0)
    per_class_cov = (onehot * covered[:, None]).sum(0) / per_class_n.clamp(min=1)
    worst_point = float(torch.where(eligible, per_class_cov, torch.inf).min())
    worst_class = int(torch.where(eligible, per_class_cov, torch.inf).argmin())
    hit = (counts @ (onehot * covered[:, None]).float()).double()
    drawn = (counts @ onehot.float()).double()
    ratio = torch.where((drawn > 0) & eligible[None, :], hit / drawn.clamp(min=1), torch.inf)
    worst_draws = ratio.min(1).values

    lo, hi = wilson_interval((onehot * covered[:, None]).sum(0).numpy(), per_class_n.numpy(), st.level)
    size_sum = (onehot * size[:, None]).sum(0)
    rows = tuple(ClassCoverage(c, int(per_class_n[c]), float(per_class_cov[c]), float(lo[c]), float(hi[c]),
                               float(size_sum[c] / per_class_n[c])) if per_class_n[c] > 0
                 else ClassCoverage(c, 0, None, None, None, None) for c in range(k))
    return SetEvaluation(
        coverage=_interval(float(covered.mean()), (counts @ covered.float()).double() / n, st.level, 0.0, 1.0),
        mean_size=_interval(float(size.mean()), (counts @ size.float()).double() / n, st.level, 0.0, float(k)),
        worst_class_coverage=_interval(worst_point, worst_draws, st.level, 0.0, 1.0),
        worst_class=worst_class, empty=float((size == 0).double().mean()), n=n, min_class_points=min_class_points,
        classes=rows, settings=st)


# --------------------------------------------------------------------------- helpers for callers


def split_calibration(logits: Any, labels: Any, conformal_share: float = 0.5,
                      seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (fit, conformal), each ascending, of the calibration split whose (unperturbed) ``logits`` and
    ``labels`` are given, cut in two at random (seeded).

    A calibrator fitted on the same points that q̂ is computed from makes their scores lower than a new
    point's, and the guarantee no longer holds; fit the calibrator on the first part and :meth:`ConformalPredictor.fit`
    on the second. ``conformal_share`` of the points (rounded down, at least 1) go to the second part. The
    seeded permutation is drawn over the rows' canonical places (:func:`nctv.canonical.canonical_order`), so
    the same rows in any order are cut alike.
    """
    z = check_logits(logits, "calibration logits")
    n = int(z.shape[0])
    y = check_labels(labels, n, int(z.shape[1])).cpu()
    if n < 2:
        raise ValueError(f"Splitting the calibration split needs at least 2 points; got {n}.")
    if isinstance(conformal_share, bool) or not isinstance(conformal_share, (int, float)) or not 0 < conformal_share < 1:
        raise ValueError(f"The conformal share must be a fraction between 0 and 1; got {shown(conformal_share)}.")
    perm = torch.from_numpy(canonical_order(z, y))[torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))]
    m = min(max(1, int(n * conformal_share)), n - 1)
    return perm[m:].sort().values, perm[:m].sort().values


def describe_set(row: Any, class_names: Sequence[str], coverage: float = DEFAULT_COVERAGE) -> str:
    """One sentence for a person: 'With 90 % confidence the answer is one of: Sandal, Sneaker.'"""
    mask = torch.as_tensor(row).reshape(-1)
    names = [str(class_names[i]) for i in torch.nonzero(mask).reshape(-1).tolist()]
    level = f"{100 * coverage:g} %"
    if not names:
        return f"At {level} confidence no class is likely enough to name: the set is empty."
    if len(names) == 1:
        return f"With {level} confidence the answer is {names[0]}."
    return f"With {level} confidence the answer is one of: {', '.join(names)}."


# --------------------------------------------------------------------------- the Learn tab's curve


def aps_mean_set_size(cal_logits: Any, cal_labels: Any, test_logits: Any, temperature: float,
                      coverage: float = DEFAULT_COVERAGE) -> float:
    """Mean size of non-randomised APS sets at ``coverage`` on ``test_logits`` after dividing every logit
    by ``temperature`` (q̂ recomputed at that T from ``cal_logits``).

    The exact steps, so that the page's script can repeat them (docs/conformal.md, "APS set size against T"),
    all in float64 with sums taken left to right:

    1. p_ij = exp(z_ij / T − max_j z_ij / T) / Σ_j exp(z_ij / T − max_j z_ij / T);
    2. rank each row's classes by p, largest first, ties to the lower class index; c_ir = p of ranks 1..r summed;
    3. calibration score s_i = c_ir at the rank r of the label y_i;
    4. k = ⌈(n + 1) · coverage⌉ (coverage as a decimal fraction); q̂ = the k-th smallest s_i, or +∞ if k > n;
    5. a test row's set size is the number of ranks r with c_ir ≤ q̂; return the mean over test rows.
    """
    ConformalSettings(coverage=coverage)  # checks the coverage
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        t = math.nan
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"The temperature T must be a number > 0; got {shown(temperature)}.")
    zc = check_logits(cal_logits, "calibration logits").detach().to("cpu", torch.float64)
    zt = check_logits(test_logits, "test logits").detach().to("cpu", torch.float64)
    if zt.shape[1] != zc.shape[1]:
        raise ValueError(f"The calibration logits have {zc.shape[1]} classes and the test logits {zt.shape[1]}; they must match.")
    y = check_labels(cal_labels, zc.shape[0], zc.shape[1])
    q = conformal_threshold(class_scores(_softmax_sequential(zc / t), "aps").gather(1, y[:, None]).squeeze(1), coverage)
    return float((class_scores(_softmax_sequential(zt / t), "aps") <= q).sum(1).double().mean())


def _softmax_sequential(z: torch.Tensor) -> torch.Tensor:
    # Σ_j taken left to right (cumsum's last column), as a plain loop in the page's script sums.
    e = torch.exp(z - z.max(1, keepdim=True).values)
    return e / torch.cumsum(e, dim=1)[:, -1:]

