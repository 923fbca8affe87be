"""Conformal prediction sets (nctv.conformal): hand-computed cases, the finite-sample guarantee by simulation,
binary problems, the evaluation and its intervals, and the Learn tab's APS-size curve."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import nctv.conformal as C
from nctv.canonical import canonical_order
from nctv.checks import NotFittedError
from nctv.intervals import IntervalSettings


def _p(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_quantile_index_is_the_finite_sample_rank():
    # ⌈(n + 1)(1 − α)⌉ by hand, at α = 0.1: 0.9 read as 9/10 exactly (10 · 0.9 and 100 · 0.9 are whole).
    assert C.quantile_index(9, 0.9) == 9
    assert C.quantile_index(19, 0.9) == 18
    assert C.quantile_index(99, 0.9) == 90
    assert C.quantile_index(22, 0.9) == 21   # 20.7 rounds up
    assert C.quantile_index(5000, 0.9) == 4501
    # Too few points for the level: every class.
    assert C.conformal_threshold(torch.tensor([0.1, 0.2, 0.3, 0.4]), 0.9) == math.inf
    assert C.conformal_threshold(torch.tensor([0.4, 0.1, 0.3, 0.2], dtype=torch.float64), 0.6) == 0.3   # k = ⌈5 · 0.6⌉ = 3


def test_scores_by_hand():
    p = _p([[0.1, 0.6, 0.3]])
    assert torch.allclose(C.class_scores(p, "lac"), _p([[0.9, 0.4, 0.7]]))
    # Ranked: class 1 (0.6), class 2 (0.3), class 0 (0.1); APS adds the mass ranked above.
    assert torch.allclose(C.class_scores(p, "aps"), _p([[1.0, 0.6, 0.9]]))
    # v = 0.5 takes half of the class's own probability off: above + (1 − v) p_y.
    assert torch.allclose(C.class_scores(p, "aps", torch.tensor([0.5])), _p([[0.95, 0.3, 0.75]]))
    # RAPS: + λ · max(0, rank − k_reg) with λ = 0.1, k_reg = 1: ranks 1, 2, 3 add 0, 0.1, 0.2.
    assert torch.allclose(C.class_scores(p, "raps", None, 0.1, 1), _p([[1.2, 0.6, 1.0]]))
    # Ties rank the lower class index first.
    assert torch.allclose(C.class_scores(_p([[0.4, 0.4, 0.2]]), "aps"), _p([[0.4, 0.8, 1.0]]))
    # A per-class v (N, K) applies to each class's own probability.
    v = torch.tensor([[0.0, 1.0, 0.5]])
    assert torch.allclose(C.class_scores(p, "aps", v), _p([[1.0, 0.0, 0.75]]))


def test_lac_sets_by_hand():
    cal = _p([[0.7, 0.2, 0.1], [0.5, 0.4, 0.1], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    y = torch.tensor([0, 1, 2, 1])          # LAC scores 0.3, 0.6, 0.5, 0.7
    cp = C.ConformalPredictor(C.ConformalSettings("lac", coverage=0.6)).fit(cal, y, from_probabilities=True)
    assert cp.threshold_ == pytest.approx(0.6)   # k = 3: the third smallest of 0.3, 0.5, 0.6, 0.7
    sets = cp.predict_sets(_p([[0.45, 0.4, 0.15], [0.9, 0.05, 0.05], [0.3, 0.3, 0.4]]), from_probabilities=True)
    assert sets.tolist() == [[True, True, False], [True, False, False], [False, False, True]]
    # Logits give the same sets as their softmax.
    z = torch.log(cal)
    assert C.ConformalPredictor(C.ConformalSettings("lac", coverage=0.6)).fit(z, y).threshold_ == pytest.approx(0.6)


def test_aps_and_raps_sets_by_hand():
    cal = _p([[0.7, 0.2, 0.1], [0.5, 0.4, 0.1], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    y = torch.tensor([0, 1, 2, 1])          # APS scores 0.7, 0.9, 0.5, 0.9
    cp = C.ConformalPredictor(C.ConformalSettings("aps", coverage=0.6)).fit(cal, y, from_probabilities=True)
    assert cp.threshold_ == pytest.approx(0.9)
    # Test row ranked 0 (0.5), 2 (0.35), 1 (0.15): cumulative 0.5, 0.85, 1.0 → {0, 2}.
    assert cp.predict_sets(_p([[0.5, 0.15, 0.35]]), True).tolist() == [[True, False, True]]
    # RAPS, λ = 0.2, k_reg = 1: scores 0.7, 0.9 + 0.2, 0.5 + 0.2, 0.9 + 0.2 → q̂ = 1.1 (k = 3);
    # the test row's cumulative + penalties: 0.5, 1.05, 1.4 → {0, 2}.
    st = C.ConformalSettings("raps", coverage=0.6, penalty=0.2, k_reg=1)
    cp = C.ConformalPredictor(st).fit(cal, y, True)
    assert cp.threshold_ == pytest.approx(1.1)
    assert cp.predict_sets(_p([[0.5, 0.15, 0.35]]), True).tolist() == [[True, False, True]]


def test_class_conditional_thresholds_by_hand():
    cal = _p([[0.9, 0.1], [0.6, 0.4], [0.7, 0.3], [0.2, 0.8]])
    y = torch.tensor([0, 0, 0, 1])           # class 0's LAC scores 0.1, 0.4, 0.3; class 1's: 0.2
    st = C.ConformalSettings("lac", coverage=0.5, class_conditional=True)
    cp = C.ConformalPredictor(st).fit(cal, y, True)
    # Class 0: n = 3, k = ⌈4 · 0.5⌉ = 2 → 0.3. Class 1: n = 1, k = ⌈2 · 0.5⌉ = 1 → 0.2.
    assert cp.thresholds_.tolist() == pytest.approx([0.3, 0.2])
    assert cp.predict_sets(_p([[0.75, 0.25], [0.5, 0.5]]), True).tolist() == [[True, False], [False, False]]
    # A class without calibration points keeps every set open to it (q̂ = +∞).
    cp = C.ConformalPredictor(st).fit(cal[:3], y[:3], True)
    assert cp.thresholds_[1] == math.inf and bool(cp.predict_sets(_p([[0.99, 0.01]]), True)[0, 1])


def _exchangeable(trials, n, m, k, scale, seed):
    """Logits of ``trials`` exchangeable draws of n + m points and labels drawn from their softmax."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(trials, n + m, k, generator=g, dtype=torch.float64) * scale
    y = torch.multinomial(torch.softmax(z, -1).reshape(-1, k), 1, generator=g).reshape(trials, n + m)
    return z, y


def _simulated_coverage(scores_of, y, n, coverage):
    """Coverage of the test points of every trial: q̂ from each trial's first n points (the k-th smallest of
    their scores at their labels), a test point covered when its label's score is ≤ q̂."""
    own = scores_of.gather(2, y[..., None]).squeeze(2)
    k = C.quantile_index(n, coverage)
    q = torch.sort(own[:, :n], dim=1).values[:, k - 1]
    return (own[:, n:] <= q[:, None]).double().mean(1)


@pytest.mark.parametrize("score,k", [("lac", 4), ("lac", 2), ("aps", 4), ("raps", 4)])
def test_finite_sample_coverage_guarantee(score, k):
    # n = 22 at 90 %: k = 21, so over exchangeable draws the coverage is exactly 21/23 = 0.913 for scores
    # without ties: at least 1 − α and below 1 − α + 1/(n + 1) = 0.943.
    trials, n, m = 3000, 22, 40
    z, y = _exchangeable(trials, n, m, k, 2.0, seed=1)
    s = C.class_scores(C.probabilities(z.reshape(-1, k)), score, None, 0.05, 1).reshape(trials, n + m, k)
    mean = float(_simulated_coverage(s, y, n, 0.9).mean())
    # The spread of one draw's coverage is that of a Beta(21, 2) (sd 0.057): over 3000 draws, sd 0.001.
    assert abs(mean - 21 / 23) < 0.005
    assert 0.9 <= mean < 0.9 + 1 / (n + 1)


def test_randomised_aps_reaches_the_level_exactly_where_ties_make_the_plain_sets_overcover():
    # A model that gives every point the same probabilities (0.5, 0.3, 0.2), labels drawn from them: the plain
    # APS scores take three values, so its sets jump from {0, 1} (80 %) to every class (100 %). Randomised,
    # the coverage is exactly k/(n + 1) = 18/20 = 0.9 on average (n = 19).
    trials, n, m = 4000, 19, 40
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).expand(trials * (n + m), 3)
    y = torch.multinomial(p[0], trials * (n + m), replacement=True, generator=g).reshape(trials, n + m)
    v = torch.rand(trials * (n + m), generator=g, dtype=torch.float64)
    plain = _simulated_coverage(C.class_scores(p, "aps").reshape(trials, n + m, 3), y, n, 0.9)
    randomised = _simulated_coverage(C.class_scores(p, "aps", v).reshape(trials, n + m, 3), y, n, 0.9)
    assert abs(float(randomised.mean()) - 0.9) < 0.005
    assert float(plain.mean()) > 0.95
    # The predictor draws its own v per point from its seed: the same exactness through fit and predict_sets.
    probs = p[: n + m]
    got = []
    for t in range(300):
        cp = C.ConformalPredictor(C.ConformalSettings("aps", 0.9, randomized=True, seed=t)).fit(probs[:n], y[t, :n], True)
        got.append(cp.predict_sets(probs[n:], True).gather(1, y[t, n:, None]).double().mean())
    assert abs(float(torch.stack(got).mean()) - 0.9) < 0.02


def test_randomised_sets_are_reproducible_from_the_seed():
    z, y = _exchangeable(1, 300, 300, 5, 2.0, seed=3)
    z, y = z[0], y[0]

    def sets(seed):
        st = C.ConformalSettings("raps", randomized=True, seed=seed, k_reg=1)
        return C.ConformalPredictor(st).fit(z[:300], y[:300]).predict_sets(z[300:])

    assert torch.equal(sets(7), sets(7))
    assert not torch.equal(sets(7), sets(8))
    # Not randomised, the seed plays no part.
    plain = [C.ConformalPredictor(C.ConformalSettings("aps", seed=s)).fit(z[:300], y[:300]).predict_sets(z[300:])
             for s in (7, 8)]
    assert torch.equal(*plain)


def test_binary_problems():
    # K = 2 by hand: LAC scores of the labels 0.2, 0.4, 0.1, 0.3, 0.35; at 50 %, k = ⌈6 · 0.5⌉ = 3 → q̂ = 0.3.
    cal = _p([[0.8, 0.2], [0.4, 0.6], [0.1, 0.9], [0.7, 0.3], [0.35, 0.65]])
    y = torch.tensor([0, 1, 1, 0, 1])
    cp = C.ConformalPredictor(C.ConformalSettings("lac", 0.5)).fit(cal, y, True)
    assert cp.threshold_ == pytest.approx(0.3)
    sets = cp.predict_sets(_p([[0.75, 0.25], [0.5, 0.5], [0.2, 0.8]]), True)
    assert sets.tolist() == [[True, False], [False, False], [False, True]]
    # APS and RAPS on binary logits: a valid evaluation and a worst class among the two.
    z, yy = _exchangeable(1, 500, 2000, 2, 2.0, seed=4)
    for score in C.SCORES:
        for rnd in (False, True):
            st = C.ConformalSettings(score, randomized=rnd)
            ev = C.ConformalPredictor(st).fit(z[0, :500], yy[0, :500]).evaluate(z[0, 500:], yy[0, 500:])
            assert ev.worst_class in (0, 1) and len(ev.classes) == 2 and 0 < ev.mean_size.estimate <= 2
            if score == "lac" or rnd:
                assert 0.87 < ev.coverage.estimate < 0.93
            else:
                # Plain APS with two classes: the second class's score is p_1 + p_2 = 1 (up to rounding), so once
                # more than α of the calibration labels are ranked second, q̂ ≈ 1 and nearly every set holds both.
                assert ev.coverage.estimate > 0.98 and ev.mean_size.estimate > 1.9


def test_evaluation_by_hand():
    # 30 points of class 0 (all covered, sets of 2), 20 of class 1 (10 covered, sets of 1), 5 of class 2
    # (none covered, empty sets): fewer than 10, so class 2 is listed but not the worst class.
    sets = torch.zeros(55, 3, dtype=torch.bool)
    sets[:30, :2] = True
    sets[30:40, 1] = True
    sets[40:50, 0] = True
    labels = torch.tensor([0] * 30 + [1] * 20 + [2] * 5)
    ev = C.evaluate_sets(sets, labels, IntervalSettings(0.95, 1000, 0))
    assert ev.coverage.estimate == pytest.approx(40 / 55)
    assert ev.mean_size.estimate == pytest.approx((30 * 2 + 20) / 55)
    assert ev.empty == pytest.approx(5 / 55)
    assert ev.worst_class == 1 and ev.worst_class_coverage.estimate == pytest.approx(0.5)
    assert [(c.label, c.n, c.coverage, c.mean_size) for c in ev.classes] == [(0, 30, 1.0, 2.0), (1, 20, 0.5, 1.0), (2, 5, 0.0, 0.0)]
    with_small = C.evaluate_sets(sets, labels, IntervalSettings(0.95, 1000, 0), min_class_points=5)
    assert with_small.worst_class == 2 and with_small.worst_class_coverage.estimate == 0.0
    # A class with no test point is listed without figures (no NaN in the JSON).
    four = C.evaluate_sets(torch.cat([sets, torch.zeros(55, 1, dtype=torch.bool)], 1), labels)
    assert four.classes[3] == C.ClassCoverage(3, 0, None, None, None, None)
    d = ev.to_dict()
    assert d["coverage"]["estimate"] == pytest.approx(40 / 55) and d["settings"]["resamples"] == 1000


def test_coverage_interval_matches_the_binomial_spread():
    # 4000 points, 3600 covered: the 95 % interval of a proportion is 0.9 ± 1.96 · √(0.9 · 0.1 / 4000) = ± 0.0093.
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, 4, (4000,), generator=g)
    hit = torch.zeros(4000, dtype=torch.bool)
    hit[torch.randperm(4000, generator=g)[:3600]] = True
    sets = torch.zeros(4000, 4, dtype=torch.bool)
    sets[torch.arange(4000), labels] = hit
    sets[~hit, (labels[~hit] + 1) % 4] = True
    ev = C.evaluate_sets(sets, labels, IntervalSettings(0.95, 2000, 1))
    half = 1.96 * math.sqrt(0.9 * 0.1 / 4000)
    assert ev.coverage.low == pytest.approx(0.9 - half, abs=0.0025)
    assert ev.coverage.high == pytest.approx(0.9 + half, abs=0.0025)
    assert ev.mean_size.low == ev.mean_size.high == 1.0   # every set holds one class
    # The worst class's interval holds its estimate and lies below the overall coverage's upper end.
    assert ev.worst_class_coverage.low <= ev.worst_class_coverage.estimate <= ev.worst_class_coverage.high


def test_split_calibration():
    z, y = _overconfident(101, 4, seed=5)
    fit, conf = C.split_calibration(z, y, 0.5, seed=3)
    assert len(conf) == 50 and len(fit) == 51
    assert sorted(torch.cat([fit, conf]).tolist()) == list(range(101))
    # The documented draw: torch's seeded permutation of the rows' places in the canonical order.
    perm = canonical_order(z, y)[torch.randperm(101, generator=torch.Generator().manual_seed(3)).numpy()]
    assert conf.tolist() == sorted(perm[:50].tolist()) and fit.tolist() == sorted(perm[50:].tolist())
    assert not torch.equal(conf, C.split_calibration(z, y, 0.5, seed=4)[1])
    # The same rows in another order are cut alike: each row lands in the same part.
    shuffle = torch.from_numpy(np.random.default_rng(1).permutation(101))
    fit2, conf2 = C.split_calibration(z[shuffle], y[shuffle], 0.5, seed=3)
    assert sorted(shuffle[conf2].tolist()) == conf.tolist() and sorted(shuffle[fit2].tolist()) == fit.tolist()
    with pytest.raises(ValueError, match="at least 2 points"):
        C.split_calibration(z[:1], y[:1])


def test_describe_set():
    names = ["T-shirt", "Trouser", "Sandal", "Sneaker"]
    assert C.describe_set([False, False, True, True], names) == "With 90 % confidence the answer is one of: Sandal, Sneaker."
    assert C.describe_set([False, True, False, False], names, 0.95) == "With 95 % confidence the answer is Trouser."
    assert "empty" in C.describe_set([False] * 4, names)


def test_aps_mean_set_size_by_hand():
    # T = 1. Calibration: p = (0.6, 0.3, 0.1), label 1 → 0.9; p = (0.2, 0.7, 0.1), label 1 (ranked first) → 0.7.
    # Coverage 0.5, n = 2: k = ⌈1.5⌉ = 2 → q̂ = 0.9. Test rows: cumulative (0.6, 0.9, 1.0) → 2 classes;
    # (0.95, 0.99, 1.0) → none (0.95 > 0.9); mean 1.0.
    cal = torch.log(_p([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1]]))
    test = torch.log(_p([[0.6, 0.3, 0.1], [0.95, 0.04, 0.01]]))
    assert C.aps_mean_set_size(cal, [1, 1], test, 1.0, 0.5) == pytest.approx(1.0)
    # T = 2 on logits log p: p ∝ √p. Calibration row 1: (.4727, .3343, .1930) → label 1: .8070;
    # row 2: (.2795, .5229, .1976), label 1 ranked first: .5229 → q̂ = .8070.
    # Test row 1 (= calibration row 1): cumulative .4727, .8070, 1 → 2 classes; row 2: (.7646, .1569, .0784)
    # → cumulative .7646, .9216 → 1 class. Mean 1.5.
    assert C.aps_mean_set_size(cal, [1, 1], test, 2.0, 0.5) == pytest.approx(1.5)
    # Float32 input (the page's) gives the same answer as float64 here.
    assert C.aps_mean_set_size(cal.float().numpy(), np.array([1, 1]), test.float(), 2.0, 0.5) == pytest.approx(1.5)


def test_aps_mean_set_size_agrees_with_the_predictor():
    z, y = _exchangeable(1, 400, 600, 6, 3.0, seed=6)
    z, y = z[0], y[0]
    for t in (0.5, 1.0, 3.0):
        sets = C.ConformalPredictor(C.ConformalSettings("aps")).fit(z[:400] / t, y[:400]).predict_sets(z[400:] / t)
        assert C.aps_mean_set_size(z[:400], y[:400], z[400:], t) == pytest.approx(float(sets.sum(1).double().mean()), abs=2e-3)


@pytest.mark.parametrize("kwargs,match", [
    ({"score": "thr"}, "Unknown conformal score"),
    ({"coverage": 1.0}, "coverage must be a fraction"),
    ({"coverage": float("nan")}, "coverage must be a fraction"),
    ({"penalty": -1.0}, "penalty"),
    ({"k_reg": -1}, "k_reg"),
    ({"randomized": "yes"}, "True or False"),
])
def test_bad_settings_say_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        C.ConformalSettings(**kwargs)


def test_bad_inputs_say_what_is_wrong():
    cp = C.ConformalPredictor()
    with pytest.raises(NotFittedError, match="Fit the conformal predictor"):
        cp.predict_sets(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="labels must lie in"):
        cp.fit(torch.zeros(2, 3), [0, 3])
    cp.fit(torch.randn(20, 3), torch.arange(20) % 3)
    with pytest.raises(ValueError, match="fitted on 3 classes"):
        cp.predict_sets(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="sum to 1"):
        C.ConformalPredictor().fit(torch.full((2, 3), 0.5), [0, 1], from_probabilities=True)
    with pytest.raises(ValueError, match="temperature T must be a number > 0"):
        C.aps_mean_set_size(torch.zeros(2, 3), [0, 1], torch.zeros(1, 3), 0.0)
    with pytest.raises(ValueError, match="must match"):
        C.aps_mean_set_size(torch.zeros(2, 3), [0, 1], torch.zeros(1, 4), 1.0)


def test_class_conditional_sets_cover_every_class():
    # A calibrated model whose class 0 is favoured (logit + 1.5): one q̂ for all leaves the rarer classes below
    # 90 %; one q̂ per class (Mondrian) gives each class its own guarantee, coverage ≥ 90 % on average.
    trials, n, m, k = 60, 90, 300, 3
    z, y = _exchangeable(trials, n, m, k, 1.5, seed=7)
    z = z + torch.tensor([1.5, 0.0, 0.0], dtype=torch.float64)
    y = torch.multinomial(torch.softmax(z, -1).reshape(-1, k), 1, generator=torch.Generator().manual_seed(8)).reshape(trials, -1)
    per_class = {False: torch.zeros(k), True: torch.zeros(k)}
    for t in range(trials):
        for cc in (False, True):
            sets = C.ConformalPredictor(C.ConformalSettings("lac", 0.9, class_conditional=cc)).fit(z[t, :n], y[t, :n]).predict_sets(z[t, n:])
            hit = sets.gather(1, y[t, n:, None]).squeeze(1).double()
            per_class[cc] += torch.stack([hit[y[t, n:] == c].mean() for c in range(k)]).float() / trials
    assert float(per_class[True].min()) > 0.9 - 0.015   # measured 0.91–0.92 (sd over 60 draws about 0.005)
    assert float(per_class[False].min()) < 0.85          # measured 0.80


# --------------------------------------------------------------------------- RAPS's λ and k_reg tuned


def _ranks_by_numpy(p, y):
    """1-based rank of each label, largest probability first, ties to the lower class index."""
    p, y = np.asarray(p), np.asarray(y)
    order = np.argsort(-p, axis=1, kind="stable")
    return np.array([int(np.nonzero(order[i] == y[i])[0][0]) + 1 for i in range(len(y))])


def _raps_sizes_by_numpy(p, y, lam, k_reg, coverage):
    """Mean size of the tuning points' own plain RAPS sets, q̂ from those same points, in numpy."""
    p, y = np.asarray(p, dtype=np.float64), np.asarray(y)
    n, k = p.shape
    order = np.argsort(-p, axis=1, kind="stable")
    ranked = np.take_along_axis(p, order, 1)
    s_ranked = np.cumsum(ranked, 1) + lam * np.maximum(0, np.arange(1, k + 1) - k_reg)
    s = np.empty_like(s_ranked)
    np.put_along_axis(s, order, s_ranked, 1)
    own = np.sort(s[np.arange(n), y])
    j = math.ceil((n + 1) * coverage - 1e-9)
    q = own[j - 1] if j <= n else np.inf
    return float((s <= q).sum(1).mean())


def _overconfident(n, k, seed, sharpen=3.0):
    """Logits whose softmax is sharper than the labels' law (labels from softmax(z / sharpen))."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, k, generator=g, dtype=torch.float64) * 2.0
    y = torch.multinomial(torch.softmax(z / sharpen, 1), 1, generator=g).squeeze(1)
    return z, y


def test_tuned_k_reg_is_the_higher_rank_quantile_by_hand():
    # Ten tuning points whose labels rank 1, 1, 1, 1, 1, 2, 2, 3, 4, 6 (K = 6). 0-based: 0 ×5, 1, 1, 2, 3, 5;
    # at 90 % the 'higher' quantile takes index ⌈0.9 · 9⌉ = 9 → 5, so k_reg = 6; at 80 %, ⌈7.2⌉ = 8 → 3 → 4.
    ranks = [1, 1, 1, 1, 1, 2, 2, 3, 4, 6]
    rows, labels = [], []
    for r in ranks:
        row = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
        rows.append(row)
        labels.append(r - 1)                     # class j holds rank j + 1 in every row
    p, y = _p(rows), torch.tensor(labels)
    assert C.label_ranks(p, y).tolist() == ranks
    assert C.tuned_k_reg(p, y, 0.9) == 6
    assert C.tuned_k_reg(p, y, 0.8) == 4
    # Ties rank the lower class index first: with p = (0.3, 0.3, 0.4), class 1 is third.
    assert C.label_ranks(_p([[0.3, 0.3, 0.4]]), torch.tensor([1])).tolist() == [3]


@pytest.mark.parametrize("coverage", [0.9, 0.8, 0.95])
def test_fitted_k_reg_is_numpys_rank_quantile_on_the_tuning_part(coverage):
    z, y = _overconfident(1000, 10, seed=11)
    st = C.ConformalSettings("raps", coverage, penalty=0.01)      # k_reg alone is tuned
    cp = C.ConformalPredictor(st).fit(z, y)
    t = cp.tuning_indices_.numpy()
    ranks0 = _ranks_by_numpy(torch.softmax(z, 1).numpy()[t], y.numpy()[t]) - 1
    expected = int(np.quantile(ranks0, coverage, method="higher")) + 1
    assert cp.k_reg_ == expected and cp.penalty_ == 0.01 and cp.tuning_sizes_ == {}
    assert 1 < expected < 10                                        # the quantile is not at an end


@pytest.mark.parametrize("seed,sharpen", [(12, 3.0), (13, 1.0), (14, 0.6)])
def test_tuned_penalty_is_the_grid_value_of_the_smallest_sets(seed, sharpen):
    z, y = _overconfident(1200, 10, seed=seed, sharpen=sharpen)
    cp = C.ConformalPredictor(C.ConformalSettings("raps", 0.9, seed=seed)).fit(z, y)
    t = cp.tuning_indices_.numpy()
    p, yt = torch.softmax(z, 1).numpy()[t], y.numpy()[t]
    k_reg = int(np.quantile(_ranks_by_numpy(p, yt) - 1, 0.9, method="higher")) + 1
    sizes = [_raps_sizes_by_numpy(p, yt, lam, k_reg, 0.9) for lam in C.RAPS_PENALTY_GRID]
    assert cp.k_reg_ == k_reg
    assert cp.penalty_ == C.RAPS_PENALTY_GRID[int(np.argmin(sizes))]   # argmin: the first, smallest λ, on ties
    assert [cp.tuning_sizes_[lam] for lam in C.RAPS_PENALTY_GRID] == pytest.approx(sizes, abs=1e-12)
    assert C.ConformalPredictor(C.ConformalSettings("raps", 0.9, seed=seed)).fit(z, y).penalty_ == cp.penalty_


def test_tuned_penalty_takes_the_smallest_value_on_ties():
    # With k_reg = K = 4 no rank is penalised: every λ gives the same sets, and the smallest λ is taken.
    z, y = _overconfident(300, 4, seed=15)
    cp = C.ConformalPredictor(C.ConformalSettings("raps", k_reg=4)).fit(z, y)
    assert len(set(cp.tuning_sizes_.values())) == 1 and cp.penalty_ == min(C.RAPS_PENALTY_GRID) == 0.001
    # A grid where a later value ties exactly with the best keeps the earlier (smaller) one.
    p = C.probabilities(z[:90])
    lam, sizes = C.tuned_penalty(p, y[:90], 4, C.ConformalSettings("raps"), grid=(0.5, 0.2))
    assert lam == 0.2 and sizes[0.2] == sizes[0.5]


def test_tuning_and_conformal_parts_are_disjoint_and_make_the_whole_split():
    z, y = _overconfident(1001, 10, seed=16)
    cp = C.ConformalPredictor(C.ConformalSettings("raps", 0.9, seed=3)).fit(z, y)
    tune, conf = cp.tuning_indices_, cp.conformal_indices_
    assert len(tune) == math.ceil(0.3 * 1001) == 301 and len(conf) == 700 and cp.n_calibration_ == 700
    assert sorted(torch.cat([tune, conf]).tolist()) == list(range(1001))
    assert not set(tune.tolist()) & set(conf.tolist())
    # The documented draw: the first ⌈0.3 n⌉ of numpy's permutation from stream 2 of the seed, of the rows'
    # places in the canonical order of their probabilities (no two rows tie here, so the labels order none).
    perm = canonical_order(C.probabilities(z))[np.random.default_rng(np.random.SeedSequence(3).spawn(3)[2]).permutation(1001)]
    assert tune.tolist() == sorted(perm[:301].tolist()) and conf.tolist() == sorted(perm[301:].tolist())
    # q̂ comes from the conformal part alone, with the tuned λ and k_reg.
    s = C.class_scores(C.probabilities(z[conf]), "raps", None, cp.penalty_, cp.k_reg_)
    own = np.sort(s.gather(1, y[conf, None]).squeeze(1).numpy())
    assert cp.threshold_ == own[math.ceil(701 * 0.9) - 1]
    # Another seed, another split; a share of 0.5 holds half out; the sets follow the fitted values.
    assert not torch.equal(C.ConformalPredictor(C.ConformalSettings("raps", seed=4)).fit(z, y).tuning_indices_, tune)
    assert len(C.ConformalPredictor(C.ConformalSettings("raps", tune_share=0.5)).fit(z, y).tuning_indices_) == 501
    sets = cp.predict_sets(z[:50])
    assert torch.equal(sets, C.class_scores(C.probabilities(z[:50]), "raps", None, cp.penalty_, cp.k_reg_) <= cp.threshold_)
    # The smallest split: one point each.
    assert [len(i) for i in C.tuning_split(2, 0.3)] == [1, 1]


def test_tuned_raps_keeps_the_coverage_guarantee():
    # 400 exchangeable draws of 100 calibration and 100 test points (K = 10, an over-confident model):
    # λ and k_reg tuned on 30 points, q̂ from the other 70 (k = ⌈71 · 0.9⌉ = 64), so each draw's
    # coverage has mean 64/71 = 0.901 (sd about 0.034). Over 400 draws the sd of the mean is about 0.002:
    # the mean must stay ≥ 0.9 − 3 · 0.002 and below 64/71 + 3 · 0.002.
    trials, n, m, k = 400, 100, 100, 10
    g = torch.Generator().manual_seed(17)
    z = torch.randn(trials, n + m, k, generator=g, dtype=torch.float64) * 2.0
    y = torch.multinomial(torch.softmax(z / 3.0, -1).reshape(-1, k), 1, generator=g).reshape(trials, n + m)
    hits, chosen = [], set()
    for t in range(trials):
        cp = C.ConformalPredictor(C.ConformalSettings("raps", 0.9, seed=t)).fit(z[t, :n], y[t, :n])
        hits.append(cp.predict_sets(z[t, n:]).gather(1, y[t, n:, None]).double().mean())
        chosen.add((cp.penalty_, cp.k_reg_))
    mean = float(torch.stack(hits).mean())
    assert 0.9 - 0.006 <= mean <= 64 / 71 + 0.006
    assert len(chosen) > 1                       # the tuned values do change from draw to draw


def test_given_penalty_and_k_reg_are_used_as_given_on_the_whole_split():
    # The fixed values of earlier versions: no point held out, q̂ from every point, the sets unchanged.
    z, y = _overconfident(500, 10, seed=18)
    st = C.ConformalSettings("raps", 0.9, penalty=C.RAPS_PENALTY, k_reg=C.RAPS_K_REG)
    cp = C.ConformalPredictor(st).fit(z, y)
    assert cp.penalty_ == 0.01 and cp.k_reg_ == 5 and len(cp.tuning_indices_) == 0 and cp.n_calibration_ == 500
    s = C.class_scores(C.probabilities(z), "raps", None, 0.01, 5)
    assert cp.threshold_ == C.conformal_threshold(s.gather(1, y[:, None]).squeeze(1), 0.9)
    d = cp.to_dict()
    assert (d["penalty"], d["k_reg"], d["tuned"], d["n_tune"], d["n_conformal"]) == (0.01, 5, [], 0, 500)
    # The settings record what was asked (None: tuned); the fitted predictor what was used.
    tuned = C.ConformalPredictor(C.ConformalSettings("raps")).fit(z, y)
    assert C.ConformalSettings("raps").to_dict()["penalty"] is None
    d = tuned.to_dict()
    assert d["penalty"] == tuned.penalty_ in C.RAPS_PENALTY_GRID and d["k_reg"] == tuned.k_reg_
    assert d["tuned"] == ["penalty", "k_reg"] and d["n_tune"] == 150 and d["n_conformal"] == 350
    # LAC and APS hold nothing out and use no λ.
    for score in ("lac", "aps"):
        d = C.ConformalPredictor(C.ConformalSettings(score)).fit(z, y).to_dict()
        assert (d["penalty"], d["k_reg"], d["tuned"], d["n_tune"], d["n_conformal"]) == (None, None, [], 0, 500)


@pytest.mark.parametrize("kwargs,match", [
    ({"tune_share": 0.0}, "tuning share .* between 0 and 1"),
    ({"tune_share": 1.0}, "tuning share .* between 0 and 1"),
    ({"tune_share": float("nan")}, "tuning share"),
    ({"tune_share": True}, "tuning share"),
    ({"tune_share": "0.3"}, "tuning share"),
    ({"penalty": float("inf")}, "penalty λ must be a finite number >= 0, or None to tune it"),
    ({"k_reg": 2.5}, "k_reg must be a whole number >= 0, or None to tune it"),
])
def test_bad_tuning_settings_say_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        C.ConformalSettings("raps", **kwargs)


def test_tuning_needs_two_calibration_points():
    with pytest.raises(ValueError, match="needs at least 2 calibration points"):
        C.ConformalPredictor(C.ConformalSettings("raps")).fit(torch.zeros(1, 3), [0])
    # Given values need no held-out part.
    C.ConformalPredictor(C.ConformalSettings("raps", penalty=0.1, k_reg=1)).fit(torch.zeros(1, 3), [0])


# --------------------------------------------------------------------------- the values in a run and its results.json


SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "precomputed" / "results.json"


def test_a_run_records_the_raps_values_its_sets_used(tmp_path):
    from nctv.experiment import RunOptions
    from nctv.logits_file import LogitsData, run_on_logits
    from nctv.results import RunResult

    z, y = _overconfident(1600, 5, seed=19)
    data = LogitsData(z[:600].numpy(), y[:600].numpy(), z[600:].numpy(), y[600:].numpy(),
                      tuple(f"c{i}" for i in range(5)), "toy.npz", "file")
    options = RunOptions(seeds=1, bins=(15,), progress=False, cache_dir=False, intervals=IntervalSettings(0.95, 200, 0),
                         conformal=C.ConformalSettings("raps", 0.9))
    r = run_on_logits(data, ["Uncalibrated"], options)
    got = r.methods["Uncalibrated"].conformal
    # The uncalibrated row's sets are the predictor's on the raw logits (as the run holds them, float32).
    cp = C.ConformalPredictor(C.ConformalSettings("raps", 0.9)).fit(z[:600].float(), y[:600])
    assert (got["penalty"], got["k_reg"], got["tuned"], got["n_tune"], got["n_conformal"]) == \
        (cp.penalty_, cp.k_reg_, ["penalty", "k_reg"], 180, 420)
    assert got["threshold"] == cp.threshold_
    r.save(tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())["methods"]["Uncalibrated"]["conformal"]
    assert saved["penalty"] == cp.penalty_ and saved["k_reg"] == cp.k_reg_
    assert RunResult.load(tmp_path).methods["Uncalibrated"].conformal == got


#: What a run records of its sets' RAPS values; files written before these were recorded lack them.
RAPS_FIELDS = ("penalty", "k_reg", "tuned", "n_tune", "n_conformal")


def _shipped_with(tmp_path, without=(), **changes):
    data = json.loads(SHIPPED.read_text())
    row = data["methods"]["Temperature Scaling"]["conformal"]
    for key in without:
        del row[key]
    row.update(changes)
    (tmp_path / "results.json").write_text(json.dumps(data))
    from nctv.results import RunResult

    return RunResult.load(tmp_path)


RAPS_ROW = {"score": "raps", "penalty": 0.1, "k_reg": 3, "tuned": ["penalty", "k_reg"], "n_tune": 1500, "n_conformal": 3500}


BAD_ROWS = [
    ({**RAPS_ROW, "penalty": float("nan")}, "penalty must be RAPS's λ, a finite number >= 0"),
    ({**RAPS_ROW, "penalty": -0.1}, "penalty must be"),
    ({**RAPS_ROW, "penalty": "0.1"}, "penalty must be"),
    ({**RAPS_ROW, "k_reg": 2.5}, "k_reg must be RAPS's k_reg, a whole number"),
    ({**RAPS_ROW, "k_reg": -1}, "k_reg must be"),
    ({**RAPS_ROW, "k_reg": True}, "k_reg must be"),
    ({**RAPS_ROW, "tuned": ["lambda"]}, "tuned must list"),
    ({**RAPS_ROW, "tuned": "penalty"}, "tuned must list"),
    ({**RAPS_ROW, "n_tune": 0}, "n_tune must be at least 1"),
    ({**RAPS_ROW, "n_tune": -3}, "n_tune must be a whole number"),
    ({**RAPS_ROW, "n_conformal": 1.5}, "n_conformal must be a whole number"),
    ({"penalty": 0.01}, r"penalty .*null for LAC"),
    ({"k_reg": 5}, r"k_reg .*null for LAC"),
    ({"tuned": ["k_reg"], "n_tune": 10}, "tuned must list"),
    ({"score": "thr"}, "score must be one of lac, aps, raps"),
]


def test_results_files_with_and_without_the_raps_values_load_and_crafted_bad_ones_are_refused(tmp_path):
    # A results.json written before the fields were recorded (the shipped one without them) loads as it is.
    old = _shipped_with(tmp_path, without=RAPS_FIELDS)
    assert not set(RAPS_FIELDS) & set(old.methods["Temperature Scaling"].conformal)
    assert _shipped_with(tmp_path).methods["Temperature Scaling"].conformal["n_conformal"] == 5000
    assert old.methods["Temperature Scaling"].conformal["score"] == "lac"
    assert _shipped_with(tmp_path, **RAPS_ROW).methods["Temperature Scaling"].conformal["k_reg"] == 3
    assert _shipped_with(tmp_path, penalty=None, k_reg=None, tuned=[], n_tune=0, n_conformal=5000)
    assert _shipped_with(tmp_path, **{**RAPS_ROW, "tuned": [], "n_tune": 0, "n_conformal": 5000})
    for changes, match in BAD_ROWS:
        with pytest.raises(ValueError, match=f"The conformal sets of Temperature Scaling: {match}"):
            _shipped_with(tmp_path, **changes)
