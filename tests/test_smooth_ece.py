"""Smooth ECE against the reference implementation (relplot), the continuous definition, and known answers."""
from pathlib import Path

import numpy as np
import pytest
import relplot
import torch
from safetensors.numpy import load_file
from scipy.stats import norm

import nctv.metrics as M
from nctv.canonical import canonical_order

SHIPPED_LOGITS = Path(__file__).resolve().parent.parent / "assets" / "precomputed" / "test_logits.safetensors"


def random_predictions(rng, n, ones=0):
    """Over- or under-confident top-label confidences; ``ones`` of them exactly 1.0."""
    conf = rng.beta(rng.uniform(0.5, 20), 1, size=n)
    conf[:ones] = 1.0
    correct = (rng.uniform(size=n) < np.clip(conf + rng.uniform(-0.2, 0.2), 0, 1)).astype(float)
    return conf, correct


@pytest.mark.parametrize("n, ones", [(1, 0), (1, 1), (2, 0), (7, 3), (300, 0), (4000, 1000), (20000, 0)])
def test_matches_relplot_value_and_bandwidth_on_random_predictions(n, ones):
    rng = np.random.default_rng(n + ones)
    for _ in range(3):
        conf, correct = random_predictions(rng, n, ones)
        ref, ref_sigma = relplot.smECE(conf, correct, return_width=True)
        value, sigma = M.smooth_ece_batch(conf, correct)
        assert value[0] == pytest.approx(ref, abs=1e-6)
        assert sigma[0] == ref_sigma


@pytest.mark.parametrize("sigma", [1.0, 0.3, 0.05, 0.01, 5 / 1024, 3 / 1024, 0.0049])
def test_matches_relplot_at_fixed_bandwidths(sigma):
    # Below σ = 0.01 the grid grows with 1/σ and has an even number of points for some σ (3/1024: 3414).
    rng = np.random.default_rng(1)
    conf, correct = random_predictions(rng, 5000, ones=200)
    assert M.smooth_ece_batch(conf, correct, sigma)[0][0] == pytest.approx(relplot.smECE_sigma(conf, correct, sigma), abs=1e-6)


def test_well_calibrated_large_sample_takes_a_narrow_bandwidth_as_relplot():
    rng = np.random.default_rng(2)
    conf = rng.beta(8, 1, size=200_000)
    correct = (rng.uniform(size=conf.size) < conf).astype(float)
    ref, ref_sigma = relplot.smECE(conf, correct, return_width=True)
    value, sigma = M.smooth_ece_batch(conf, correct)
    assert sigma[0] == ref_sigma < 0.01
    assert value[0] == pytest.approx(ref, abs=1e-6)


@pytest.mark.parametrize("method", ["Uncalibrated", "Temperature Scaling", "TS by Grid Search", "Vector Scaling",
                                    "Neural Clamping (FL)"])
def test_matches_relplot_on_the_shipped_test_logits(method):
    tensors = load_file(SHIPPED_LOGITS)
    logits, labels = tensors[method], tensors["labels"]
    # relplot's own logits-to-confidences path, in float64 (in float32 its softmax rounds confidences).
    conf, correct = relplot.multiclass_logits_to_confidences(logits.astype(np.float64), labels)
    assert M.smooth_ece(logits, labels) == pytest.approx(relplot.smECE(conf, correct), abs=1e-6)
    assert M.smooth_ece(logits, labels, bandwidth=0.03) == pytest.approx(relplot.smECE_sigma(conf, correct, 0.03),
                                                                         abs=1e-6)


def continuous_smooth_ece(conf, correct, sigma):
    """smECE_σ with the exact reflected Gaussian (three images of every sample), no grid."""
    t = M.smooth_mesh(sigma)[:, None]
    kernel = sum(norm.pdf((t - c) / sigma) / sigma for c in (conf, -conf, 2 - conf))
    residual, density = kernel @ (conf - correct), kernel.sum(1)
    return np.abs(residual).sum() / (density.sum() + 1e-4 * len(t))


@pytest.mark.parametrize("sigma", [0.02, 0.05, 0.2])
def test_grid_discretisation_is_close_to_the_continuous_definition(sigma):
    rng = np.random.default_rng(3)
    conf, correct = random_predictions(rng, 2000)
    assert M.smooth_ece_batch(conf, correct, sigma)[0][0] == pytest.approx(continuous_smooth_ece(conf, correct, sigma),
                                                                           abs=1e-4)


def test_calibrated_data_gives_a_small_value_shrinking_with_n():
    rng = np.random.default_rng(4)

    def mean_smece(n):
        values = []
        for _ in range(3):
            conf = rng.beta(5, 1, size=n)
            values.append(M.smooth_ece_batch(conf, (rng.uniform(size=n) < conf).astype(float))[0][0])
        return np.mean(values)

    small, large = mean_smece(1000), mean_smece(100_000)
    assert large < 0.01
    assert large < small / 2


@pytest.mark.parametrize("offset", [0.05, 0.1, 0.2])
def test_constant_offset_gives_about_that_offset(offset):
    rng = np.random.default_rng(5)
    conf = rng.uniform(0.3, 0.9, size=100_000)
    correct = (rng.uniform(size=conf.size) < conf - offset).astype(float)
    assert M.smooth_ece_batch(conf, correct)[0][0] == pytest.approx(offset, abs=0.005)


def test_single_sample_and_perfect_predictions():
    # One sample: the smoothed residual is c − y wherever the kernel outweighs the density floor.
    assert M.smooth_ece_batch([0.7], [1])[0][0] == pytest.approx(0.3, abs=1e-3)
    assert M.smooth_ece_batch([1.0], [0])[0][0] == pytest.approx(1.0, abs=1e-3)
    # Confidence exactly 1.0 and always right: no residual at any bandwidth; the search ends at its floor.
    value, sigma = M.smooth_ece_batch(np.ones(50), np.ones(50))
    assert value[0] == 0.0 and sigma[0] == 2 / 1024


def test_logits_probabilities_float32_and_tensors_agree():
    tensors = load_file(SHIPPED_LOGITS)
    logits, labels = tensors["Temperature Scaling"][:3000], tensors["labels"][:3000]
    expected = M.smooth_ece(logits.astype(np.float64), labels)
    assert M.smooth_ece(logits, labels) == expected  # float32 input is widened before anything is summed
    assert M.smooth_ece(torch.from_numpy(logits), torch.from_numpy(labels)) == expected
    probs = torch.softmax(torch.from_numpy(logits).double(), 1)
    assert M.smooth_ece(probs, labels, from_probabilities=True) == pytest.approx(expected, abs=1e-12)


def test_batch_rows_equal_one_at_a_time():
    rng = np.random.default_rng(6)
    conf, correct = random_predictions(rng, 1500, ones=100)
    idx = rng.integers(0, conf.size, size=(130, conf.size))  # more rows than one block of the batch
    values, sigmas = M.smooth_ece_batch(conf[idx], torch.from_numpy(correct[idx] == 1))
    for r in (0, 63, 64, 129):
        v, s = M.smooth_ece_batch(conf[idx[r]], correct[idx[r]])
        assert values[r] == pytest.approx(v[0], abs=1e-12) and sigmas[r] == s[0]
    assert len(np.unique(sigmas)) > 1  # rows really took different bandwidths
    fixed, widths = M.smooth_ece_batch(conf[idx[:5]], correct[idx[:5]], bandwidth=0.05)
    assert np.all(widths == 0.05)
    assert fixed[2] == pytest.approx(relplot.smECE_sigma(conf[idx[2]], correct[idx[2]], 0.05), abs=1e-12)


def test_smoothed_diagram_numbers():
    rng = np.random.default_rng(7)
    n = 50_000
    conf = rng.uniform(0.55, 0.95, size=n)
    correct = rng.uniform(size=n) < conf - 0.1
    probs = np.stack([conf, 1 - conf], 1)  # class 0 is always the prediction
    labels = np.where(correct, 0, 1)
    d = M.smooth_reliability(probs, labels, from_probabilities=True)
    value, sigma = M.smooth_ece_batch(conf, correct)
    assert d.smooth_ece == value[0] and d.bandwidth == sigma[0]
    assert np.array_equal(d.confidence, M.smooth_mesh(d.bandwidth))
    # The density-weighted mean gap is the smooth ECE; the density integrates to 1 over [0, 1].
    assert np.sum(np.abs(d.gaps) * d.density) / np.sum(d.density) == pytest.approx(d.smooth_ece, abs=1e-8)
    area = np.sum((d.density[1:] + d.density[:-1]) / 2 * np.diff(d.confidence))  # trapezoid rule
    assert area == pytest.approx(1.0, abs=1e-3)
    inside = (d.confidence > 0.65) & (d.confidence < 0.85)
    assert d.gaps[inside] == pytest.approx(-0.1, abs=0.01)  # accuracy sits 0.1 below confidence
    assert d.density[d.confidence < 0.2].max() < 0.01 * d.density[inside].min()  # no confidences there


def test_curves_of_a_batch_share_the_mesh_and_equal_single_rows():
    rng = np.random.default_rng(8)
    conf, correct = random_predictions(rng, 800)
    idx = rng.integers(0, conf.size, size=(70, conf.size))
    mesh, acc, dens = M.smooth_reliability_curves(conf[idx], correct[idx], 0.05)
    assert acc.shape == dens.shape == (70, mesh.size)
    _, acc1, dens1 = M.smooth_reliability_curves(conf[idx[66]], correct[idx[66]], 0.05)
    assert np.allclose(acc[66], acc1[0], atol=1e-12) and np.allclose(dens[66], dens1[0], atol=1e-12)


def test_resample_counts_give_exactly_the_materialised_resamples():
    """Rows given as counts of one sample equal the same resamples written out sample by sample."""
    rng = np.random.default_rng(9)
    conf, correct = random_predictions(rng, 1200, ones=50)
    counts = rng.multinomial(conf.size, np.full(conf.size, 1 / conf.size), size=70)  # more than one block
    rows = [np.repeat(np.arange(conf.size), c) for c in counts]
    values, sigmas = M.smooth_ece_batch(conf, correct, counts=counts)
    direct, direct_sigmas = M.smooth_ece_batch(np.stack([conf[r] for r in rows]), np.stack([correct[r] for r in rows]))
    assert values == pytest.approx(direct, abs=1e-12) and np.array_equal(sigmas, direct_sigmas)
    assert values[3] == pytest.approx(relplot.smECE(conf[rows[3]], correct[rows[3]]), abs=1e-6)
    mesh, acc, dens = M.smooth_reliability_curves(conf, correct, 0.04, counts=counts[60:])
    _, acc1, dens1 = M.smooth_reliability_curves(conf[rows[65]], correct[rows[65]], 0.04)
    assert np.allclose(acc[5], acc1[0], atol=1e-9) and np.allclose(dens[5], dens1[0], atol=1e-12)
    with pytest.raises(ValueError, match="one sample"):
        M.smooth_ece_batch(np.stack([conf, conf]), np.stack([correct, correct]), counts=counts)
    with pytest.raises(ValueError, match="counts must be"):
        M.smooth_ece_batch(conf, correct, counts=counts[:, :10])


def test_band_is_the_bootstrap_of_the_curve_on_the_seeded_resamples():
    """smooth_band against the direct way: the seeded resamples written out, their curves at σ*, and
    the union of the basic and percentile bootstrap intervals at every mesh point."""
    from nctv import intervals as iv

    rng = np.random.default_rng(10)
    conf, correct = random_predictions(rng, 900)
    band = iv.smooth_band(conf, correct, level=0.9, resamples=200, seed=4)
    reference = M.smooth_reliability(np.stack([conf, 1 - conf], 1), np.where(correct == 1, 0, 1),
                                     from_probabilities=True)
    assert band.bandwidth == reference.bandwidth and band.smooth_ece == pytest.approx(reference.smooth_ece, abs=1e-12)
    assert np.array_equal(band.confidence, reference.confidence)
    assert np.allclose(band.accuracy, reference.accuracy, atol=1e-12)
    # The seeded draws are of places in the canonical order of the pairs (confidence, correctness).
    index = torch.randint(conf.size, (200, conf.size), generator=torch.Generator().manual_seed(4)).numpy()
    index = canonical_order(conf, correct)[index]
    _, curves, _ = M.smooth_reliability_curves(conf[index], correct[index], band.bandwidth)
    q05, q95 = np.quantile(curves, [0.05, 0.95], axis=0)
    assert band.low == pytest.approx(np.clip(np.minimum(2 * band.accuracy - q95, q05), 0, 1), abs=1e-9)
    assert band.high == pytest.approx(np.clip(np.maximum(2 * band.accuracy - q05, q95), 0, 1), abs=1e-9)
    assert (band.level, band.resamples) == (0.9, 200)


def test_band_holds_a_calibrated_curve_with_the_kernel_regression_width():
    """Calibrated predictions: the smoothed population curve is the diagonal, so where confidences are
    dense the 95 % band holds it in most seeded draws. Its width is that of a kernel regression with a
    Gaussian kernel of width σ: 2 · 1.96 · √(t(1 − t) / (2√π · n σ f(t))), f the density of confidences."""
    from scipy.stats import beta

    from nctv import intervals as iv

    rng = np.random.default_rng(11)
    held, ratios = [], []
    for n in (1000, 16000):
        for rep in range(10 if n == 1000 else 2):
            conf = rng.beta(6, 1.5, size=n)
            correct = rng.uniform(size=n) < conf
            band = iv.smooth_band(conf, correct, resamples=300, seed=rep)
            at = np.argmin(np.abs(band.confidence - 0.85))
            t = band.confidence[at]
            if n == 1000:
                held.append(band.low[at] <= t <= band.high[at])
            theory = 2 * 1.96 * np.sqrt(t * (1 - t) / (2 * np.sqrt(np.pi) * n * band.bandwidth * beta.pdf(t, 6, 1.5)))
            ratios.append((band.high[at] - band.low[at]) / theory)
    assert sum(held) >= 8
    assert np.mean(ratios) == pytest.approx(1.0, abs=0.15) and min(ratios) > 0.6 and max(ratios) < 1.4, ratios
    with pytest.raises(ValueError, match="1-D"):
        iv.smooth_band(np.ones((2, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="at least 100 resamples"):
        iv.smooth_band(conf, correct, resamples=5)


@pytest.mark.parametrize("args, message", [
    (([0.5, 1.2], [1, 0]), "confidence must lie in"),
    (([0.5, 0.6], [1, 2]), "correct must hold only 0/1"),
    (([0.5, 0.6], [1]), "must match"),
    (([], []), "non-empty"),
    (([0.5], [1], 0.0), "bandwidth must lie in"),
    (([0.5], [1], 1.5), "bandwidth must lie in"),
    (([0.5], [1], "wide"), "bandwidth must be a number"),
])
def test_bad_input_is_explained(args, message):
    with pytest.raises(ValueError, match=message):
        M.smooth_ece_batch(*args)
    with pytest.raises(ValueError, match="needs a bandwidth"):
        M.smooth_reliability_curves([0.5], [1], None)
