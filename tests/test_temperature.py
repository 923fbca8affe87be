"""Temperature scaling, TS by grid search, TS (FL): against known temperatures, brute force and
independent optimisers."""
import math
import warnings

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar

import nctv.calibration.temperature as T
import nctv.metrics as M
from nctv.calibration.base import NotFittedError, focal_loss
from nctv.calibration.temperature import (
    FocalTemperatureScaling,
    GridSearchTemperature,
    TemperatureScaling,
    grid_search_temperature,
    temperature_grid,
)


pytestmark = pytest.mark.usefixtures("one_thread")


def calibrated_sample(n, k, scale=2.0, seed=0):
    """Logits of a perfectly calibrated model: labels are drawn from softmax(z)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, k, dtype=torch.float64, generator=g) * scale
    y = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
    return z, y


def mean_loss(z, y, t, gamma=0.0):
    return float(focal_loss(z / t, y, gamma))


def loss_slope_in_t(z, y, t, gamma=0.0):
    tt = torch.tensor(t, dtype=torch.float64, requires_grad=True)
    focal_loss(z / tt, y, gamma).backward()
    return float(tt.grad)


@pytest.fixture(scope="module")
def sharpened():
    z, y = calibrated_sample(20000, 10)
    return z * 2.5, y  # an overconfident model whose true temperature is 2.5


def test_ts_recovers_the_sharpening_factor(sharpened):
    z, y = sharpened
    ts = TemperatureScaling().fit(z, y)
    # 20000 samples pin the NLL-optimal temperature to about ±0.02 around 2.5.
    assert ts.temperature_ == pytest.approx(2.5, abs=0.05)
    # Exactly optimal on the sample: zero derivative, and no nearby temperature does better.
    assert abs(loss_slope_in_t(z, y, ts.temperature_)) < 1e-12
    best = mean_loss(z, y, ts.temperature_)
    for factor in (1 - 1e-6, 1 + 1e-6, 0.9, 1.1):
        assert best <= mean_loss(z, y, ts.temperature_ * factor)


def test_ts_agrees_with_an_independent_optimiser():
    z, y = calibrated_sample(3000, 7, seed=3)
    z = 0.4 * z + 1.0  # underconfident: T < 1
    res = minimize_scalar(lambda u: mean_loss(z, y, math.exp(u)), bounds=(-5, 5), method="bounded",
                          options={"xatol": 1e-10})
    t = TemperatureScaling().fit(z, y).temperature_
    assert t == pytest.approx(0.4, abs=0.05)
    assert t == pytest.approx(math.exp(res.x), rel=1e-6)


def test_ts_transform_divides_logits_and_keeps_device_and_float32():
    z, y = calibrated_sample(500, 4, seed=1)
    ts = TemperatureScaling().fit(z * 3, y)
    out = ts.transform(z.numpy())
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    torch.testing.assert_close(out, (z / ts.temperature_).float())
    assert torch.equal(out.argmax(1), z.argmax(1))  # temperature never changes the prediction


def test_focal_ts_with_gamma_zero_is_temperature_scaling(sharpened):
    z, y = sharpened
    t_ts = TemperatureScaling().fit(z, y).temperature_
    t_fl = FocalTemperatureScaling(gamma=0.0).fit(z, y).temperature_
    assert t_fl == pytest.approx(t_ts, rel=1e-10)


def test_focal_ts_minimises_the_focal_loss(sharpened):
    z, y = sharpened[0][:4000], sharpened[1][:4000]
    t = FocalTemperatureScaling(gamma=1.0).fit(z, y).temperature_
    assert abs(loss_slope_in_t(z, y, t, gamma=1.0)) < 1e-10
    # Brute force over a dense grid: nothing beats the fitted temperature.
    grid = np.linspace(2.0, 4.0, 401)
    losses = [mean_loss(z, y, g, gamma=1.0) for g in grid]
    assert mean_loss(z, y, t, gamma=1.0) <= min(losses) + 1e-15
    assert abs(grid[int(np.argmin(losses))] - t) <= 0.005
    # Focal loss puts less weight on confident samples, so it prefers a hotter temperature than NLL.
    assert t > TemperatureScaling().fit(z, y).temperature_


def test_grid_is_whole_multiples_of_the_step():
    g = temperature_grid()
    assert len(g) == 5000 and g[0] == 0.001 and g[-1] == 5.0
    assert np.array_equal(g, np.arange(1, 5001) * 0.001)
    assert np.array_equal(temperature_grid(0.1, 1.0), np.arange(1, 11) * 0.1)


def test_grid_search_equals_a_loop_over_every_temperature():
    z, y = calibrated_sample(300, 5, seed=2)
    z = z * 1.8
    grid = temperature_grid()
    loop = np.array([M.ece(z / t, y, n_bins=15) for t in grid])
    best_full, full = grid_search_temperature(z, y, full_curve=True)
    np.testing.assert_allclose(full, loop, rtol=0, atol=1e-12)
    assert best_full == grid[int(np.argmin(loop))]  # np.argmin: first minimum = lowest T
    # The default branch and bound gives the same temperature, evaluating only part of the grid;
    # what it did evaluate agrees with the loop, what it skipped is provably above the minimum.
    best, eces = grid_search_temperature(z, y)
    assert best == best_full
    done = ~np.isnan(eces)
    assert done.sum() < 0.2 * len(grid)
    np.testing.assert_allclose(eces[done], loop[done], rtol=0, atol=1e-12)
    assert loop[~done].min() > loop.min()
    assert 0.5 < best < 5.0  # an interior optimum, not an edge of the grid


@pytest.mark.parametrize("seed", range(40))
def test_branch_and_bound_matches_the_full_search(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(20, 400)), int(rng.integers(2, 9))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, k, generator=g) * float(rng.uniform(0.5, 5.0))
    # Labels partly follow the argmax, partly random: from badly to well calibrated.
    y = torch.where(torch.rand(n, generator=g) < rng.uniform(0.2, 0.9), z.argmax(1), torch.randint(0, k, (n,), generator=g))
    grid = np.arange(1, int(rng.integers(3, 900)) + 1) * float(rng.choice([0.001, 0.005, 0.01]))
    n_bins = int(rng.choice([5, 10, 15]))
    chunk = int(rng.choice([1, 3, 64]))
    full_t, full = grid_search_temperature(z, y, grid=grid, n_bins=n_bins, full_curve=True)
    t, eces = grid_search_temperature(z, y, grid=grid, n_bins=n_bins, chunk_size=chunk)
    assert t == full_t
    done = ~np.isnan(eces)
    np.testing.assert_allclose(eces[done], full[done], rtol=0, atol=1e-12)
    if (~done).any():
        assert full[~done].min() > np.nanmin(eces)


def test_grid_search_chunking_does_not_change_the_result(monkeypatch):
    z, y = calibrated_sample(200, 6, seed=4)
    grid = np.arange(1, 401) * 0.01
    ref_t, ref = grid_search_temperature(z * 2, y, grid=grid, n_bins=10, full_curve=True)
    for chunk in (1, 7, 400):
        t, e = grid_search_temperature(z * 2, y, grid=grid, n_bins=10, chunk_size=chunk, full_curve=True)
        assert t == ref_t
        np.testing.assert_allclose(e, ref, rtol=0, atol=1e-14)
    monkeypatch.setattr(T, "_CHUNK_ELEMENTS", {"cpu": 500})  # forces the samples to be split as well
    t, e = grid_search_temperature(z * 2, y, grid=grid, n_bins=10, full_curve=True)
    assert t == ref_t
    np.testing.assert_allclose(e, ref, rtol=0, atol=1e-14)


def test_grid_search_ties_go_to_the_lowest_temperature():
    # Every prediction is right with a wide margin: at small T all confidences are exactly 1.0 in
    # float64, so ECE is exactly 0 for a whole range of temperatures.
    z = torch.tensor([[40.0, 0.0, 0.0], [0.0, 40.0, 0.0], [0.0, 0.0, 40.0]]).repeat(10, 1)
    y = torch.tensor([0, 1, 2]).repeat(10)
    best, eces = grid_search_temperature(z, y)
    assert eces[0] == 0.0 and eces[1] == 0.0
    assert best == 0.001


def test_grid_search_class_exposes_curve():
    z, y = calibrated_sample(400, 4, seed=5)
    gs = GridSearchTemperature(progress=False, full_curve=True).fit(z * 2, y)
    assert gs.grid_.shape == gs.ece_grid_.shape == (5000,)
    assert not np.isnan(gs.ece_grid_).any()
    assert GridSearchTemperature(progress=False).fit(z * 2, y).temperature_ == gs.temperature_
    i = int(np.argmin(gs.ece_grid_))
    assert gs.temperature_ == gs.grid_[i]
    assert gs.ece_grid_[i] == pytest.approx(M.ece(gs.transform(z * 2).double(), y), abs=1e-6)
    coarse = GridSearchTemperature(grid_step=0.01, t_max=3.0, n_bins=10, progress=False).fit(z * 2, y)
    assert len(coarse.grid_) == 300 and coarse.grid_[-1] == 3.0


def test_all_are_deterministic_and_refuse_use_before_fit():
    z, y = calibrated_sample(100, 3)
    for cls in (TemperatureScaling, GridSearchTemperature, FocalTemperatureScaling):
        assert cls.stochastic is False
        with pytest.raises(NotFittedError, match="fit"):
            cls().transform(z)


@pytest.mark.parametrize("cls", [TemperatureScaling, GridSearchTemperature, FocalTemperatureScaling])
def test_bad_inputs_are_refused(cls):
    z, y = calibrated_sample(60, 3)
    with pytest.raises(ValueError, match="match"):
        cls().fit(z, y[:-1])
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        cls().fit(z, y + 3)
    bad = z.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        cls().fit(bad, y)
    with pytest.raises(ValueError, match="at least 2 classes"):
        cls().fit(z[:, :1], torch.zeros(60, dtype=torch.long))


def test_bad_hyperparameters_are_refused():
    z, y = calibrated_sample(60, 3)
    for kwargs in ({"grid_step": 0}, {"grid_step": -0.1}, {"t_max": 0.0001}, {"n_bins": 0}, {"n_bins": 1.5}):
        with pytest.raises(ValueError):
            GridSearchTemperature(**kwargs).fit(z, y)
    with pytest.raises(ValueError, match="gamma"):
        FocalTemperatureScaling(gamma=-1).fit(z, y)
    with pytest.raises(ValueError, match="grid"):
        grid_search_temperature(z, y, grid=[0.5, -1.0])
    with pytest.raises(ValueError, match="chunk_size"):
        grid_search_temperature(z, y, chunk_size=0)
    # Fewer samples than bins is allowed (empty bins add 0): the answer is still the loop's.
    grid = np.arange(1, 101) * 0.05
    best, eces = grid_search_temperature(z[:10], y[:10], grid=grid, n_bins=15, full_curve=True)
    loop = np.array([M.ece(z[:10] / t, y[:10], n_bins=15) for t in grid])
    np.testing.assert_allclose(eces, loop, rtol=0, atol=1e-12)
    assert best == grid[int(np.argmin(loop))]


def test_separable_calibration_data_hits_the_bound_with_a_warning():
    z = torch.tensor([[5.0, 0.0], [0.0, 5.0]]).repeat(5, 1)
    y = torch.tensor([0, 1]).repeat(5)
    with pytest.warns(UserWarning, match="separate the labels"):
        ts = TemperatureScaling().fit(z, y)
    assert ts.temperature_ == T.T_MIN
    with pytest.warns(UserWarning, match="separate the labels"):
        assert FocalTemperatureScaling(gamma=0.5).fit(z, y).temperature_ == T.T_MIN


# ---- the one temperature solver ---------------------------------------------------------------


def focal_numpy(z, y, log_t, gamma):
    """Mean FL_γ of softmax(z / T) written out in numpy, independent of the package's code."""
    zz = z.numpy() / math.exp(log_t)
    zz = zz - zz.max(1, keepdims=True)
    log_p = zz[np.arange(len(zz)), y.numpy()] - np.log(np.exp(zz).sum(1))
    return float(np.mean(-((-np.expm1(log_p)) ** gamma) * log_p))


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("scale", [0.3, 1.0, 4.0, 15.0])
def test_solver_agrees_with_a_dense_grid_and_scipy(gamma, scale):
    # scale 0.3: under-confident logits (T ≈ 0.3); 1: calibrated; 4 and 15: over-confident, at 15
    # with many samples whose probabilities round to 0 or 1.
    z, y = calibrated_sample(1500, 8, seed=int(10 * scale) + 1)
    z = z * scale
    grid = np.linspace(math.log(T.T_MIN), math.log(T.T_MAX), 2401)
    values = [focal_numpy(z, y, s, gamma) for s in grid]
    i = int(np.argmin(values))
    assert 0 < i < len(grid) - 1
    ref = minimize_scalar(lambda s: focal_numpy(z, y, s, gamma), bounds=(grid[i - 1], grid[i + 1]),
                          method="bounded", options={"xatol": 1e-10}).x
    ts = TemperatureScaling() if gamma == 0 else FocalTemperatureScaling(gamma=gamma)
    t = ts.fit(z, y).temperature_
    assert t == pytest.approx(math.exp(ref), rel=1e-6)
    # Sharper than any value-based search: the loss's slope (by autograd) changes sign within
    # 1e-9 of T in relative terms, and nothing on the dense grid is lower.
    assert loss_slope_in_t(z, y, t * (1 - 1e-9), gamma) < 0 < loss_slope_in_t(z, y, t * (1 + 1e-9), gamma)
    assert focal_numpy(z, y, math.log(t), gamma) <= min(values) + 1e-15
    s, at_bound = T.solve_log_temperature(z, y, gamma)
    assert not at_bound and s == pytest.approx(math.log(t), abs=1e-15)


@pytest.mark.parametrize("scale", [0.3, 4.0, 15.0])
def test_nll_optimum_satisfies_the_first_order_condition(scale):
    z, y = calibrated_sample(3000, 10, seed=5)
    z = (z * scale).numpy()
    a = 1.0 / TemperatureScaling().fit(z, y).temperature_
    u = a * z
    p = np.exp(u - u.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    mean_z = (p * z).sum(1)
    residual = np.mean(mean_z - z[np.arange(len(z)), y.numpy()])  # d NLL / d(1/T)
    curvature = np.mean((p * z * z).sum(1) - mean_z**2)  # d² NLL / d(1/T)²
    # The Newton correction to 1/T that the residual asks for is at float64 resolution.
    assert abs(residual / curvature) <= 1e-14 * a


def test_solver_runs_in_the_logits_dtype():
    z, y = calibrated_sample(2000, 10, seed=6)
    for gamma in (0.0, 2.0):
        s64, _ = T.solve_log_temperature(z * 3, y, gamma)
        s32, _ = T.solve_log_temperature((z * 3).float(), y, gamma)
        assert s32 == pytest.approx(s64, abs=1e-5)  # float32 resolution, not float64's
        assert s32 != s64


def test_tied_logits_leave_the_temperature_at_one_without_a_warning():
    z = torch.tensor([[0.0, 0.0, 0.0], [2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]]).repeat(4, 1)
    y = torch.tensor([0, 1, 2]).repeat(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TemperatureScaling().fit(z, y).temperature_ == 1.0
        assert FocalTemperatureScaling(gamma=1.0).fit(z, y).temperature_ == 1.0
    assert T.solve_log_temperature(z.double(), y, 1.0, bounds=(0.5, 2.0)) == (0.5, False)


def test_uninformative_logits_hit_the_upper_bound():
    # Every label is its row's least likely class: the loss falls all the way to T → ∞.
    z, _ = calibrated_sample(200, 4, seed=7)
    y = z.argmin(1)
    with pytest.warns(UserWarning, match="no information"):
        assert TemperatureScaling().fit(z, y).temperature_ == T.T_MAX
    with pytest.warns(UserWarning, match="no information"):
        assert FocalTemperatureScaling(gamma=2.0).fit(z, y).temperature_ == T.T_MAX
    assert T.solve_log_temperature(z, y, 2.0, bounds=(-1.0, 1.0)) == (1.0, True)
