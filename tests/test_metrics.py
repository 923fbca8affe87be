"""Metrics against hand-computed cases and a brute-force pure-Python reading of the definitions."""
import math

import numpy as np
import pytest
import torch

import nctv.metrics as M

# Four samples, K = 2, given as probabilities so confidences are exact.
P4 = np.array([[0.9, 0.1], [0.6, 0.4], [0.5, 0.5], [1.0, 0.0]])
Y4 = np.array([0, 1, 0, 0])


def brute_ece(conf, correct, m):
    total = 0.0
    n = len(conf)
    for b in range(m):
        lo, hi = b / m, (b + 1) / m
        idx = [i for i, c in enumerate(conf) if (lo < c <= hi) or (b == 0 and c == 0)]
        if idx:
            acc = sum(correct[i] for i in idx) / len(idx)
            cf = sum(conf[i] for i in idx) / len(idx)
            total += len(idx) / n * abs(acc - cf)
    return total


def softmax_rows(z):
    out = []
    for row in z:
        mx = max(row)
        e = [math.exp(v - mx) for v in row]
        s = sum(e)
        out.append([v / s for v in e])
    return out


def test_ece_hand_computed_with_tie_boundary_and_one():
    # bin 0 = (0, .5] holds the tie row (conf .5, predicts class 0: correct);
    # bin 1 = (.5, 1] holds .9 (right), .6 (wrong), 1.0 (right).
    expected = 0.25 * 0.5 + 0.75 * abs(2 / 3 - 2.5 / 3)
    assert M.ece(P4, Y4, n_bins=2, from_probabilities=True) == pytest.approx(expected, abs=1e-15)
    rb = M.reliability_bins(P4, Y4, n_bins=2, from_probabilities=True)
    assert rb.counts.tolist() == [1, 3]
    assert rb.confidence == pytest.approx([0.5, 2.5 / 3])
    assert rb.accuracy == pytest.approx([1.0, 2 / 3])
    assert rb.edges.tolist() == [0.0, 0.5, 1.0]
    assert rb.ece == pytest.approx(expected)
    assert M.mce(P4, Y4, n_bins=2, from_probabilities=True) == pytest.approx(0.5)


def test_tie_goes_to_lowest_index_and_accuracy():
    assert M.accuracy(P4, Y4, from_probabilities=True) == pytest.approx(0.75)
    conf, pred = M.confidences_and_predictions(torch.zeros(3, 4))
    assert pred.tolist() == [0, 0, 0] and conf == pytest.approx([0.25] * 3)


def test_empty_bins_add_nothing_and_are_nan():
    rb = M.reliability_bins(P4, Y4, n_bins=4, from_probabilities=True)
    assert rb.counts.tolist() == [0, 1, 1, 2]
    assert np.isnan(rb.confidence[0]) and np.isnan(rb.accuracy[0])
    # (.25,.5]: .5 right; (.5,.75]: .6 wrong; (.75,1]: .9 and 1.0 right
    assert M.ece(P4, Y4, n_bins=4, from_probabilities=True) == pytest.approx((0.5 + 0.6 + 2 * 0.05) / 4)


def test_aece_counts_every_sample_when_n_not_divisible():
    # 5 samples, 2 groups: sizes 3 and 2 (array_split), sorted by confidence.
    p = np.array([[0.55, 0.45], [0.7, 0.3], [0.8, 0.2], [0.95, 0.05], [0.6, 0.4]])
    y = np.array([1, 0, 0, 0, 0])
    # sorted conf: .55 (wrong) .6 (right) .7 (right) | .8 (right) .95 (right)
    g1 = 3 / 5 * abs(2 / 3 - (0.55 + 0.6 + 0.7) / 3)
    g2 = 2 / 5 * abs(1.0 - (0.8 + 0.95) / 2)
    assert M.aece(p, y, n_bins=2, from_probabilities=True) == pytest.approx(g1 + g2, abs=1e-15)
    # With one bin, AECE = |acc − mean conf| over all samples: every sample counted once.
    assert M.aece(p, y, n_bins=1, from_probabilities=True) == pytest.approx(abs(0.8 - 3.6 / 5))


def test_sce_hand_computed_with_zero_probabilities_and_absent_class():
    p = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    y = np.array([0, 1])  # class 2 never appears; it still counts in the mean over K = 3
    # class 0: p = 1.0 (label 0 → acc 1), 0.5 (acc 0); bins (M=2): .5 → bin0, 1.0 → bin1
    #   bin0: |0 − .5| · 1/2, bin1: |1 − 1| · 1/2            → 0.25
    # class 1: p = 0.0 (bin0, acc 0), 0.5 (bin0, acc 1): one bin of 2: |.5 − .25| · 2/2 → 0.25
    # class 2: p = 0, 0 (bin0), acc 0, conf 0                 → 0
    assert M.sce(p, y, n_bins=2, from_probabilities=True) == pytest.approx((0.25 + 0.25 + 0) / 3, abs=1e-15)


def test_entropy_nll_brier_hand_computed():
    p = np.array([[1.0, 0.0], [0.5, 0.5]])
    y = np.array([0, 1])
    assert M.entropy(p, from_probabilities=True) == pytest.approx(math.log(2) / 2)
    assert M.nll(p, y, from_probabilities=True) == pytest.approx(math.log(2) / 2)
    assert M.brier(p, y, from_probabilities=True) == pytest.approx((0 + 0.5) / 2)


@pytest.mark.parametrize("n,k,m", [(97, 3, 15), (200, 10, 10), (31, 5, 20)])
def test_against_brute_force_definitions(n, k, m):
    g = torch.Generator().manual_seed(n + k)
    z = (torch.randn(n, k, generator=g, dtype=torch.float64) * 3).tolist()
    y = torch.randint(0, k, (n,), generator=g).tolist()
    p = softmax_rows(z)
    conf = [max(r) for r in p]
    pred = [r.index(max(r)) for r in p]
    correct = [int(a == b) for a, b in zip(pred, y)]
    assert M.ece(z, y, m) == pytest.approx(brute_ece(conf, correct, m), abs=1e-12)
    # AECE: stable sort, array_split
    order = sorted(range(n), key=lambda i: conf[i])
    groups = np.array_split(np.array(order), m)
    ref = sum(len(gr) / n * abs(np.mean([correct[i] for i in gr]) - np.mean([conf[i] for i in gr])) for gr in groups)
    assert M.aece(z, y, m) == pytest.approx(ref, abs=1e-12)
    # SCE: class-wise ECE with the ECE bins
    ref_sce = 0.0
    for c in range(k):
        pc = [r[c] for r in p]
        hit = [int(t == c) for t in y]
        ref_sce += brute_ece(pc, hit, m)
    assert M.sce(z, y, m) == pytest.approx(ref_sce / k, abs=1e-12)
    assert M.accuracy(z, y) == pytest.approx(sum(correct) / n)
    assert M.nll(z, y) == pytest.approx(-sum(math.log(p[i][y[i]]) for i in range(n)) / n, abs=1e-12)
    ent = -sum(sum(v * math.log(v) for v in r if v > 0) for r in p) / n
    assert M.entropy(z) == pytest.approx(ent, abs=1e-12)
    assert M.brier(z, y) == pytest.approx(
        sum(sum((r[j] - (j == y[i])) ** 2 for j in range(k)) for i, r in enumerate(p)) / n, abs=1e-12
    )


def test_logits_and_probabilities_agree_and_inputs_any_type():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(300, 7, generator=g) * 2
    y = torch.randint(0, 7, (300,), generator=g)
    ref = M.evaluate(z, y)
    assert M.evaluate(z.numpy(), y.numpy()) == ref
    assert M.evaluate(z.double(), y) == M.evaluate(z.double().numpy(), y.tolist())
    probs = torch.softmax(z.double(), 1)
    for name in ("ece", "aece", "sce"):
        assert getattr(M, name)(probs, y, from_probabilities=True) == pytest.approx(ref[name], abs=1e-12)
    assert set(ref) == set(M.METRIC_NAMES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensor_gives_identical_results():
    z = torch.randn(500, 10) * 3
    y = torch.randint(0, 10, (500,))
    assert M.evaluate(z.cuda(), y.cuda()) == M.evaluate(z, y)


def test_repeatable():
    z = torch.randn(400, 10) * 3
    y = torch.randint(0, 10, (400,))
    assert M.evaluate(z, y) == M.evaluate(z.clone(), y.clone())


@pytest.mark.parametrize(
    "logits,labels,match",
    [
        (np.zeros((3, 2)), np.array([0, 1]), "must match"),
        (np.zeros((3, 2)), np.array([0, 1, 2]), r"\[0, 2\)"),
        (np.array([[0.0, np.nan]]), np.array([0]), "NaN"),
        (np.zeros((3, 1)), np.array([0, 0, 0]), "at least 2 classes"),
        (np.zeros((0, 3)), np.array([], dtype=int), "empty"),
        (np.zeros(3), np.array([0, 0, 0]), "2-D"),
    ],
)
def test_bad_inputs_raise_clear_errors(logits, labels, match):
    with pytest.raises(ValueError, match=match):
        M.ece(logits, labels)


def test_fewer_samples_than_bins_hand_computed():
    # 7 samples, 10 bins; confidences off the bin edges. conf / correct:
    # .95 ✓, .92 ✗ (bin 9), .85 ✓ (bin 8), .72 ✓ (bin 7), .65 ✗ (bin 6), .55 ✓, .52 ✓ (bin 5); bins 0–4 empty.
    p = np.array([[0.95, 0.05], [0.92, 0.08], [0.85, 0.15], [0.28, 0.72], [0.65, 0.35], [0.55, 0.45], [0.52, 0.48]])
    y = np.array([0, 1, 0, 1, 1, 0, 0])
    gaps = [abs(1 - 1.87), abs(1 - 0.85), abs(1 - 0.72), abs(0 - 0.65), abs(2 - 1.07)]  # |Σacc − Σconf| per bin
    assert M.ece(p, y, n_bins=10, from_probabilities=True) == pytest.approx(sum(gaps) / 7, abs=1e-14)
    assert M.mce(p, y, n_bins=10, from_probabilities=True) == pytest.approx(max(0.87 / 2, 0.15, 0.28, 0.65, 0.93 / 2))
    # AECE: array_split of 7 sorted samples into 10 groups: 7 groups of one, 3 empty ones.
    per_sample = [1 - 0.52, 1 - 0.55, 0.65, 1 - 0.72, 1 - 0.85, 0.92, 1 - 0.95]
    assert M.aece(p, y, n_bins=10, from_probabilities=True) == pytest.approx(sum(per_sample) / 7, abs=1e-14)
    rb = M.reliability_bins(p, y, n_bins=10, from_probabilities=True)
    assert rb.counts.tolist() == [0, 0, 0, 0, 0, 2, 1, 1, 1, 2] and np.isnan(rb.accuracy[:5]).all()
    assert M.evaluate(p, y, n_bins=10, from_probabilities=True)["ece"] == pytest.approx(sum(gaps) / 7, abs=1e-14)
    # SCE, K = 3, 2 samples: class k's p_ik in 10 bins against 1[y = k].
    p3 = np.array([[0.72, 0.17, 0.11], [0.14, 0.25, 0.61]])
    per_class = [(1 - 0.72) + 0.14, 0.17 + (1 - 0.25), 0.11 + 0.61]  # every value alone in its bin
    assert M.sce(p3, np.array([0, 1]), n_bins=10, from_probabilities=True) == pytest.approx(sum(per_class) / 6)
    # One sample, 15 bins: every binned metric is its own |correct − confidence|.
    for fn in (M.ece, M.aece, M.mce):
        assert fn(np.array([[0.8, 0.2]]), np.array([1]), n_bins=15, from_probabilities=True) == pytest.approx(0.8)


def test_bad_bins():
    with pytest.raises(ValueError, match="positive whole number"):
        M.ece(np.zeros((4, 2)), np.zeros(4, dtype=int), n_bins=0)
    with pytest.raises(ValueError, match="sum to 1"):
        M.ece(np.full((4, 2), 0.2), np.zeros(4, dtype=int), n_bins=2, from_probabilities=True)
