"""Intervals: exact on the full sample, paired, seeded, and covering a population value known exactly."""
import math

import numpy as np
import pytest
import torch
from scipy.special import beta as beta_fn
from scipy.special import betainc

from nctv import intervals as iv
from nctv import metrics
from nctv.canonical import canonical_order

# --------------------------------------------------------------------------- the population
#
# Confidence c ~ Beta(A, B); the prediction is right with probability c**POWER (over-confident for
# POWER > 1). Method "raw" reports c, method "shrunk" reports c**SHRINK (a partial recalibration).
# The interval targets the population ECE with the same 15 equal-width bins:
#     ECE = Σ_b | E[(1[right] − reported) · 1[reported ∈ bin b]] |,
# and E[c**q · 1[lo < c <= hi]] = B(A + q, B) / B(A, B) · (I_hi(A + q, B) − I_lo(A + q, B)) exactly
# (I: the regularised incomplete beta function), so each bin term is closed-form.
A, B, POWER, SHRINK, BINS, CLASSES = 8.0, 1.5, 1.1, 1.06, 15, 10


def _moment(q, lo, hi):
    return beta_fn(A + q, B) / beta_fn(A, B) * (betainc(A + q, B, hi) - betainc(A + q, B, lo))


def population_ece(exponent: float) -> float:
    """ECE of a method reporting c**exponent: its bin (lo, hi] holds c in (lo**(1/e), hi**(1/e)]."""
    edges = (np.arange(BINS + 1) / BINS) ** (1.0 / exponent)
    return float(np.abs(_moment(POWER, edges[:-1], edges[1:]) - _moment(exponent, edges[:-1], edges[1:])).sum())


def _logits(conf: torch.Tensor) -> torch.Tensor:
    """10-class logits whose top-1 confidence is ``conf`` (class 0; the rest share 1 − conf)."""
    rest = ((1 - conf) / (CLASSES - 1)).clamp(min=1e-300)
    z = rest.log()[:, None].repeat(1, CLASSES)
    z[:, 0] = conf.log()
    return z


def _draw(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    dist = torch.distributions.Beta(torch.tensor(A, dtype=torch.float64), torch.tensor(B, dtype=torch.float64))
    # Beta sampling reads the global generator: seed it from g so each repetition is reproducible.
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=g)))
    conf = dist.sample((n,))
    right = torch.rand(n, dtype=torch.float64, generator=g) < conf**POWER
    labels = torch.where(right, 0, 1)
    return conf, labels


def coverage(n: int, repetitions: int = 400, resamples: int = 500) -> dict[str, float]:
    """Share of repetitions whose interval holds the population value: raw ECE, and raw − shrunk.

    One resample count matrix serves every repetition: it is drawn independently of the data, and
    the samples of a repetition are i.i.d., so fixing it changes no repetition's distribution (and
    saves drawing 400 of them). 500 resamples: the 2.5 % and 97.5 % quantiles rest on 12 draws each.
    """
    counts = iv.resample_counts(n, resamples, seed=1)
    truth = {"ece": population_ece(1.0), "difference": population_ece(1.0) - population_ece(SHRINK)}
    g = torch.Generator().manual_seed(n)
    hits = {"ece": 0, "difference": 0}
    for _ in range(repetitions):
        conf, labels = _draw(n, g)
        raw = iv.method_draws([_logits(conf)], labels, counts, BINS, ["ece"])["ece"]
        shrunk = iv.method_draws([_logits(conf**SHRINK)], labels, counts, BINS, ["ece"])["ece"]
        ci = iv.interval(raw, "ece")
        hits["ece"] += ci.low <= truth["ece"] <= ci.high
        d = iv.difference(raw, shrunk)
        hits["difference"] += d.low <= truth["difference"] <= d.high
    return {k: v / repetitions for k, v in hits.items()}


@pytest.fixture(scope="module")
def measured():
    return {n: coverage(n) for n in (1000, 10000)}


def test_population_values_are_what_the_bins_say():
    # Independent check of the closed form: a large Monte Carlo sample of the same population.
    g = torch.Generator().manual_seed(0)
    conf, labels = _draw(2_000_000, g)
    mc = metrics.ece(_logits(conf), labels, n_bins=BINS)
    # The plug-in on 2 million samples is within a few 1e-4 of the population value.
    assert mc == pytest.approx(population_ece(1.0), abs=6e-4)
    assert 0.012 < population_ece(1.0) < 0.015 and 0.004 < population_ece(SHRINK) < 0.007


@pytest.mark.slow
@pytest.mark.parametrize("n", [1000, 10000])
def test_ece_interval_covers_the_population_ece(measured, n):
    assert 0.92 <= measured[n]["ece"] <= 0.98, measured


@pytest.mark.slow
@pytest.mark.parametrize("n", [1000, 10000])
def test_paired_difference_covers_the_population_difference(measured, n):
    assert 0.92 <= measured[n]["difference"] <= 0.98, measured


# --------------------------------------------------------------------------- exactness and pairing


@pytest.fixture(scope="module")
def toy():
    g = torch.Generator().manual_seed(5)
    n, k = 600, 6
    labels = torch.randint(0, k, (n,), generator=g)
    z = 3 * (torch.randn(n, k, generator=g) + 2.0 * torch.nn.functional.one_hot(labels, k))
    return z, labels


def test_full_sample_values_equal_the_metrics(toy):
    z, labels = toy
    counts = iv.resample_counts(len(labels), 200, seed=0)
    draws = iv.method_draws([z], labels, counts, 15, list(iv.RESAMPLED))
    expected = {**metrics.evaluate(z, labels, n_bins=15), **metrics.further(z, labels, n_bins=15)}
    for k, d in draws.items():
        assert d.point == pytest.approx(expected[k], rel=1e-9, abs=1e-12), k


def test_each_resample_equals_the_metric_of_its_drawn_samples(toy):
    """The count trick against the direct way: index the drawn samples and call nctv.metrics. Smooth ECE
    keeps the test split's bandwidth on every resample."""
    z, labels = toy
    n = len(labels)
    sigma = metrics.smooth_reliability(z, labels).bandwidth
    counts = iv.resample_counts(n, 100, seed=3)
    g = torch.Generator().manual_seed(3)
    index = torch.randint(n, (100, n), generator=g)
    for r in (0, 57):
        assert torch.equal(torch.bincount(index[r], minlength=n).float(), counts[r])
        rows = index[r]  # in the order drawn: a resample's order does not matter
        zr, yr = z[rows], labels[rows]
        one = counts[r:r + 1]
        direct = {**metrics.evaluate(zr, yr, n_bins=15), **metrics.further(zr, yr, n_bins=15)}
        direct["smooth_ece"] = metrics.smooth_ece(zr, yr, bandwidth=sigma)
        for k, spec in iv.RESAMPLED.items():
            sample = iv._Sample(z.double(), labels, 15)
            plug = float(spec.value(sample, sample.canonical_counts(one))[0][0])
            assert plug == pytest.approx(direct[k], rel=1e-5, abs=1e-6), k


def test_debiased_estimate_is_below_the_plug_in_for_binned_metrics(toy):
    z, labels = toy
    counts = iv.resample_counts(len(labels), 200, seed=0)
    d = iv.method_draws([z], labels, counts, 15, list(iv.RESAMPLED))
    for k in ("ece", "aece", "sce", "mce"):
        assert d[k].estimate <= d[k].point + 1e-12
    for k in ("accuracy", "entropy", "nll", "brier"):
        assert d[k].estimate == d[k].point


def test_difference_of_a_method_with_itself_is_exactly_zero(toy):
    z, labels = toy
    counts = iv.resample_counts(len(labels), 200, seed=0)
    a = iv.method_draws([z], labels, counts, 15, ["ece"])["ece"]
    b = iv.method_draws([z.clone()], labels, counts, 15, ["ece"])["ece"]
    d = iv.difference(a, b)
    assert (d.estimate, d.low, d.high) == (0.0, 0.0, 0.0)


def test_paired_interval_is_narrower_than_unpaired(toy):
    """Two close methods on the same resamples: their noise cancels; on independent resamples it adds."""
    z, labels = toy
    counts = iv.resample_counts(len(labels), 400, seed=0)
    other = iv.resample_counts(len(labels), 400, seed=9)
    a = iv.method_draws([z / 2.0], labels, counts, 15, ["nll"])["nll"]
    b = iv.method_draws([z / 2.2], labels, counts, 15, ["nll"])["nll"]
    b_unpaired = iv.method_draws([z / 2.2], labels, other, 15, ["nll"])["nll"]
    paired, unpaired = iv.difference(a, b), iv.difference(a, b_unpaired)
    assert paired.high - paired.low < 0.5 * (unpaired.high - unpaired.low)


def test_same_seed_same_intervals_and_level_widens(toy):
    z, labels = toy
    d1 = iv.method_draws([z], labels, iv.resample_counts(len(labels), 300, 4), 15, ["accuracy"])["accuracy"]
    d2 = iv.method_draws([z], labels, iv.resample_counts(len(labels), 300, 4), 15, ["accuracy"])["accuracy"]
    assert iv.interval(d1, "accuracy") == iv.interval(d2, "accuracy")
    narrow, wide = iv.interval(d1, "accuracy", 0.8), iv.interval(d1, "accuracy", 0.99)
    assert wide.low < narrow.low < narrow.high < wide.high


def test_accuracy_interval_matches_the_binomial_spread(toy):
    """For accuracy the interval is the basic bootstrap of a proportion: about ±1.96·√(p(1−p)/n)."""
    z, labels = toy
    d = iv.method_draws([z], labels, iv.resample_counts(len(labels), 2000, 0), 15, ["accuracy"])["accuracy"]
    ci = iv.interval(d, "accuracy")
    p, n = d.point, len(labels)
    half = 1.96 * math.sqrt(p * (1 - p) / n)
    assert (ci.high - ci.low) / 2 == pytest.approx(half, rel=0.12)


def test_seeds_add_their_own_spread(toy):
    """Several seeds: the interval of the seed mean is wider when the seeds disagree."""
    z, labels = toy
    counts = iv.resample_counts(len(labels), 400, 0)
    g = torch.Generator().manual_seed(2)
    alike = [z / 2.0] * 4
    apart = [z / t for t in (1.2, 1.8, 2.6, 3.6)]
    w_alike = iv.interval(iv.method_draws(alike, labels, counts, 15, ["nll"], iv.seed_counts(4, 400, g))["nll"], "nll")
    w_apart = iv.interval(iv.method_draws(apart, labels, counts, 15, ["nll"], iv.seed_counts(4, 400, g))["nll"], "nll")
    assert (w_apart.high - w_apart.low) > 1.5 * (w_alike.high - w_alike.low)


def test_bad_settings_are_clear_errors(toy):
    with pytest.raises(ValueError, match="level"):
        iv.IntervalSettings(level=95)
    with pytest.raises(ValueError, match="at least 100 resamples"):
        iv.IntervalSettings(resamples=10)
    z, labels = toy
    with pytest.raises(ValueError, match="No interval for metric"):
        iv.method_draws([z], labels, iv.resample_counts(len(labels), 100, 0), 15, ["speed"])
    with pytest.raises(ValueError, match="seed_draws"):
        iv.method_draws([z, z], labels, iv.resample_counts(len(labels), 100, 0), 15, ["ece"])


def test_wilson_interval_known_values_and_reliability_bins(toy):
    # Textbook Wilson score intervals at 95 %: 0 of 10 → [0, 0.2775]; 5 of 10 → [0.2366, 0.7634].
    low, high = iv.wilson_interval([0, 5, 0], [10, 10, 0])
    assert low[:2] == pytest.approx([0.0, 0.2366], abs=1e-4) and high[:2] == pytest.approx([0.2775, 0.7634], abs=1e-4)
    assert np.isnan(low[2]) and np.isnan(high[2])
    from nctv.plots import reliability_data

    z, labels = toy
    d = reliability_data(z, labels, 15)
    low, high = d.accuracy_interval
    filled = d.counts > 0
    assert np.all(low[filled] <= d.accuracy[filled]) and np.all(d.accuracy[filled] <= high[filled])
    assert np.all(np.isnan(low[~filled]))


# --------------------------------------------------------------------------- paired differences at the boundary


def test_the_difference_at_the_boundary_reaches_what_each_method_allows():
    """The rule on hand-made intervals, each answer worked out by hand (fractions)."""
    I = iv.Interval
    d = I(0.02, 0.01, 0.03)  # the paired interval of a − b: a looks worse by 1 to 3 points
    a, b = I(0.025, 0.0, 0.04), I(0.005, 0.001, 0.015)
    # Neither test can say "calibrated" (p below 1 − level, or no test): the interval stays as it is.
    assert iv.difference_at_boundary(d, a, b, 0.049, 0.0) == d
    assert iv.difference_at_boundary(d, a, b, None, None) == d
    # A consistent: a may be 0, and then a − b = −b, from −0.015 to −0.001.
    assert iv.difference_at_boundary(d, a, b, 0.3, 0.01) == I(0.02, -0.015, 0.03)
    # B consistent (p = 0.05 exactly does not reject at 95 %): b may be 0, and then a − b = a ∈ [0, 0.04].
    assert iv.difference_at_boundary(d, a, b, 0.01, 0.05) == I(0.02, 0.0, 0.04)
    # Both: from −b's lowest to a's highest, and 0 inside: tied.
    both = iv.difference_at_boundary(d, a, b, 0.5, 0.5)
    assert both == I(0.02, -0.015, 0.04) and both.low <= 0 <= both.high
    # Both, with intervals that do not reach 0 (as a caller might pass them): 0 is still held.
    assert iv.difference_at_boundary(I(0.01, 0.005, 0.02), I(0.012, 0.004, 0.03), I(0.002, 0.001, 0.002),
                                     0.2, 0.2) == I(0.01, -0.002, 0.03)
    # Two rows scored alike on every resample (the same predictions): their difference is 0 exactly, at
    # the boundary or not, so the pair stays [0, 0]; a difference only touching 0 is still widened.
    zero = I(0.0, 0.0, 0.0)
    assert iv.difference_at_boundary(zero, a, a, 0.5, 0.5) == zero
    assert iv.difference_at_boundary(I(0.0, 0.0, 0.01), a, b, 0.5, 0.5) == I(0.0, -0.015, 0.04)
    # The level decides what "cannot reject" means: p = 0.07 rejects at 90 %.
    assert iv.difference_at_boundary(d, a, b, 0.07, 0.07, level=0.9) == d
    assert iv.tested_p("ece", 0.3, 0.01) == 0.3 and iv.tested_p("sce", 0.3, 0.01) == 0.01
    assert iv.tested_p("accuracy", 0.3, 0.01) is None
    assert iv.boundary_note("A", "B", True, True) == "both consistent with calibrated"
    assert iv.boundary_note("A", "B", False, True) == "B consistent with calibrated"
    assert iv.boundary_note("A", "B", False, False) == ""


def test_two_calibrated_models_are_not_separated_and_miscalibrated_ones_keep_their_interval():
    """Two models both calibrated exactly: softmax(z) with labels drawn from it, and the uniform model
    (every logit 0: it says 1/K and predicts class 0, right with probability 1/K as the classes are
    exchangeable). The population difference of their ECEs is 0, yet on this test set the plain paired
    interval excludes 0 (the calibrated model's ECE reads high by its noise, the uniform one's hardly at
    all). Both calibration tests cannot reject, so the rule's interval holds 0. Two clearly
    miscalibrated models (T = 1.25 and 1.5, both rejected) keep their paired interval exactly."""
    from nctv.consistency import consistency_test

    n, k, resamples, seed = 2000, 10, 200, 0
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, k, generator=g, dtype=torch.float64) * 2
    y = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
    counts = iv.resample_counts(n, resamples, seed)

    def scored(logits):
        d = iv.method_draws([logits], y, counts, 15, ["ece"])["ece"]
        p = consistency_test([logits], y, 15, resamples, seed).p_top_label
        return d, iv.at_boundary(iv.interval(d, "ece"), p), p

    (da, a, pa), (db, b, pb) = scored(z), scored(torch.zeros_like(z))
    plain = iv.difference(da, db)
    assert pa >= 0.05 and pb >= 0.05
    assert plain.excludes_zero()  # the failure the rule mends: a difference where there is none
    ruled = iv.difference_at_boundary(plain, a, b, pa, pb)
    assert ruled.low <= 0 <= ruled.high and ruled.estimate == plain.estimate
    assert (ruled.low, ruled.high) == (min(plain.low, -b.high), max(plain.high, a.high))

    (dc, c, pc), (dd, e, pe) = scored(z / 1.25), scored(z / 1.5)
    assert pc < 0.05 and pe < 0.05
    plain = iv.difference(dc, dd)
    assert iv.difference_at_boundary(plain, c, e, pc, pe) == plain


# --------------------------------------------------------------------------- the studies' bands


def test_gamma_sweep_and_init_study_carry_test_split_intervals():
    """Each γ and each initialisation gets the interval of its own test logits, from the studies' own
    resamples; entropy is a mean, so its interval is about ±1.96 standard errors of the per-sample
    entropies (a known answer, computed here by hand)."""
    from test_clamping import RANGE, make_data, make_model

    from nctv.calibration.clamping import NeuralClamping
    from nctv.calibration.studies import gamma_sweep, init_study
    from nctv.consistency import consistency_test

    model = make_model()
    x, y = make_data(model, 600)
    xt, yt = make_data(model, 800, seed=2)
    settings = iv.IntervalSettings(resamples=400, seed=3)
    sw = gamma_sweep(model, x, y, xt, yt, gammas=[0.0, 1.0], intervals=settings, progress=False)
    first = NeuralClamping(model, gamma=0.0, progress=False).fit(x, y)  # the sweep's row at γ = 0 is this fit
    zt = first.predict_logits(xt).double()
    # The studies' resamples: seed 3's draws over the test rows' places in the canonical order of the
    # unperturbed model's logits and the labels.
    with torch.no_grad():
        order = torch.from_numpy(canonical_order(model(xt), yt))
    counts = torch.empty(400, len(yt))
    counts[:, order] = iv.resample_counts(len(yt), 400, 3)
    direct = iv.method_draws([zt], yt, counts, 15, ["ece", "entropy"])
    # As in a run's table: where the calibration test cannot reject "calibrated", ECE's interval reaches 0.
    tested = consistency_test([zt], yt, 15, 400, 3)
    for m in ("ece", "entropy"):
        ci = iv.interval(direct[m], m)
        ci = iv.at_boundary(ci, tested.p_top_label) if m == "ece" else ci
        assert (sw.test_low[m][0], sw.test_high[m][0]) == pytest.approx((ci.low, ci.high), abs=1e-5)
        assert np.all(sw.test_low[m] <= sw.test_high[m]) and sw.test_low[m].shape == (2,)
    p = torch.softmax(zt, 1)
    per_sample = -(p * p.log()).sum(1)
    half = 1.96 * float(per_sample.std()) / math.sqrt(len(yt))
    assert (sw.test_high["entropy"][0] - sw.test_low["entropy"][0]) / 2 == pytest.approx(half, rel=0.15)
    assert sw.intervals == settings.to_dict()
    assert gamma_sweep(model, x, y, xt, yt, gammas=[0.0], intervals=None, progress=False).test_low is None

    st = init_study(model, (x, y), (xt, yt), n_runs=2, input_range=RANGE, intervals=settings, progress=False)
    one = NeuralClamping(model, init="data", input_range=RANGE, progress=False).fit(x, y)
    zd = one.predict_logits(xt).double()
    data = iv.method_draws([zd], yt, counts, 15, ["ece"])["ece"]
    ci = iv.at_boundary(iv.interval(data, "ece"), consistency_test([zd], yt, 15, 400, 3).p_top_label)
    assert st.ci["data"]["ece"] == pytest.approx([ci.low, ci.high], abs=1e-5)
    assert set(st.ci["random"]) == {m for m in metrics.METRIC_NAMES if m in iv.RESAMPLED}
    for init in ("random", "data"):
        for m, (low, high) in st.ci[init].items():
            assert low <= high, (init, m)
    # random − data, paired on the same resamples: the difference of the two debiased estimates.
    d = st.ci_difference["ece"]
    assert d[1] <= d[2] and set(st.ci_difference) == set(st.ci["data"])
    random_z = [z.double() for z in _random_logits(model, x, y, xt, 2)]
    random = iv.method_draws(random_z, yt, counts, 15, ["ece"], iv.seed_counts(2, 400, torch.Generator().manual_seed(4)))
    assert d[0] == pytest.approx(random["ece"].estimate - data.estimate, abs=1e-6)
    # As a run's pairs: where an initialisation's calibration test cannot reject, its ECE may be 0, and the
    # difference's interval reaches what the other's own interval allows (nctv.intervals.difference_at_boundary).
    p = {"random": consistency_test(random_z, yt, 15, 400, 3).p_top_label,
         "data": consistency_test([zd], yt, 15, 400, 3).p_top_label}
    assert max(p.values()) >= 0.05  # the rule has something to do here
    own = {init: iv.Interval(0.0, *st.ci[init]["ece"]) for init in p}
    expected = iv.difference_at_boundary(iv.difference(random["ece"], data), own["random"], own["data"], p["random"],
                                         p["data"])
    assert d[1:] == pytest.approx([expected.low, expected.high], abs=1e-5)


def _random_logits(model, x, y, xt, runs):
    """The init study's random runs fitted one by one (seeds 0, 1, …), from the paper's random start
    (σ = 0.1, the study's random arm; the fast fitter's own start is δ₀ = 0)."""
    from nctv.calibration.clamping import NeuralClamping
    from nctv.settings import STUDY_RANDOM_INIT_STD

    return [NeuralClamping(model, init="random", init_std=STUDY_RANDOM_INIT_STD, seed=s, progress=False).fit(x, y)
            .predict_logits(xt) for s in range(runs)]
