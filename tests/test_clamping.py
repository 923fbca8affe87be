"""Neural Clamping against independent answers: closed forms, hand-rolled loops, brute force."""
import copy
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from scipy.optimize import minimize

import nctv.calibration.clamping_fit as clamping_fit
from nctv.calibration.base import NotFittedError, focal_loss
from nctv.calibration.clamping import (
    EfficientNeuralClamping,
    NeuralClamping,
    StopFitting,
    data_driven_delta,
)
from nctv.calibration.studies import gamma_sweep, init_study
from nctv.metrics import ece

SHAPE = (1, 4, 4)


pytestmark = pytest.mark.usefixtures("one_thread")


RANGE = (-3.0, 3.0)


def make_model(seed=0, hidden=12, k=3, width=16):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, k))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        model[3].weight.mul_(2.0)  # confident logits
    return model.eval()


def make_data(model, n, seed=1, shape=SHAPE, t_true=2.0):
    """Inputs in RANGE and labels drawn from softmax(f(x)/t_true): the model is overconfident."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g).clamp(-2.5, 2.5)
    with torch.no_grad():
        p = torch.softmax(model(x) / t_true, dim=1)
    y = torch.multinomial(p, 1, generator=g).squeeze(1)
    return x, y


def focal_by_hand(logits, y, gamma):
    logp = torch.log_softmax(logits, dim=1)[torch.arange(len(y)), y]
    return (-((1 - logp.exp()) ** gamma) * logp).mean()


@pytest.fixture(scope="module")
def problem():
    model = make_model()
    x, y = make_data(model, 600)
    xt, yt = make_data(model, 400, seed=2)
    return model, x, y, xt, yt


def quiet(**kw):
    return dict(progress=False, **kw)


# ---- δ = 0 is temperature scaling -----------------------------------------------------------


def brute_force_temperature(z, y, gamma):
    """Golden-section search on log T of the focal loss, in float64 numpy (independent code)."""
    z = z.double().numpy()

    def loss(s):
        zz = z * math.exp(-s)
        zz = zz - zz.max(1, keepdims=True)
        logp = zz - np.log(np.exp(zz).sum(1, keepdims=True))
        lp = logp[np.arange(len(y)), y.numpy()]
        return float(np.mean(-((1 - np.exp(lp)) ** gamma) * lp))

    a, b = math.log(0.05), math.log(20.0)
    r = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        c, d = b - r * (b - a), a + r * (b - a)
        if loss(c) < loss(d):
            b = d
        else:
            a = c
    return math.exp((a + b) / 2)


@pytest.mark.parametrize("gamma", [0.0, 1.0])
def test_zero_delta_is_temperature_scaling(problem, gamma):
    model, x, y, *_ = problem
    with torch.no_grad():
        z = model(x)
    t_ref = brute_force_temperature(z, y, gamma)
    # The T step of the fast fitter on fixed logits.
    t_solve = math.exp(clamping_fit.best_log_temperature(z, y, gamma))
    assert t_solve == pytest.approx(t_ref, rel=1e-5)
    # A huge λ pins δ at ~0: the whole fit then reduces to temperature scaling with the same loss.
    nc = NeuralClamping(model, gamma=gamma, weight_decay=1e5, temperature="fitted", **quiet()).fit(x, y)
    assert float(nc.delta_.abs().max()) < 1e-5
    # The loss is flat in T at its minimum and the fitter stops on a relative change of the loss
    # (tol), so the fit is held to temperature scaling's minimum loss; T itself to 1e-3.
    zd = z.double()
    fitted, best = (float(focal_loss(zd / t, y, gamma)) for t in (nc.temperature_, t_ref))
    assert fitted == pytest.approx(best, rel=1e-6)
    assert nc.temperature_ == pytest.approx(t_ref, rel=1e-3)
    from nctv.calibration.temperature import FocalTemperatureScaling, TemperatureScaling

    ts = TemperatureScaling() if gamma == 0 else FocalTemperatureScaling(gamma=gamma)
    assert nc.temperature_ == pytest.approx(ts.fit(z, y).temperature_, rel=1e-3)


# ---- Theorem 1 --------------------------------------------------------------------------------


def test_data_driven_delta_matches_closed_form_on_linear_model():
    rng = np.random.default_rng(0)
    d, k, n = 6, 4, 50
    W = rng.normal(size=(k, d))
    W[:, 2] = 0.0  # an input the model ignores: g_2 = 0 exactly, so δ̃_2 = 0
    b = rng.normal(size=k)
    x = rng.uniform(0.1, 0.9, size=(n, 2, 3))
    model = nn.Sequential(nn.Flatten(), nn.Linear(d, k)).double()
    with torch.no_grad():
        model[1].weight.copy_(torch.from_numpy(W))
        model[1].bias.copy_(torch.from_numpy(b))
    # ∂H/∂z_j = −p_j (log p_j + H), so ∇_x H = Wᵀ[−p ⊙ (log p + H)].
    g = np.zeros(d)
    for xi in x.reshape(n, d):
        zi = W @ xi + b
        p = np.exp(zi - zi.max())
        p /= p.sum()
        h = -(p * np.log(p)).sum()
        g += W.T @ (-p * (np.log(p) + h))
    lo, hi = x.reshape(n, d).min(0), x.reshape(n, d).max(0)
    alpha, beta = 0.0, 1.0
    expected = np.zeros(d)
    for j in range(d):
        if g[j] < 0:
            expected[j] = -(lo[j] - alpha)
        elif g[j] > 0:
            expected[j] = beta - hi[j]
    assert (g > 0).any() and (g < 0).any()
    got = data_driven_delta(model.float(), torch.tensor(x, dtype=torch.float32), (alpha, beta))
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got.reshape(-1).numpy(), expected, atol=1e-6)
    assert float(got.reshape(-1)[2]) == 0.0
    # x + δ̃ stays feasible for every calibration input.
    xs = torch.tensor(x, dtype=torch.float32) + got
    assert float(xs.min()) >= alpha - 1e-6 and float(xs.max()) <= beta + 1e-6


def test_data_driven_delta_needs_a_range(problem):
    model, x, y, *_ = problem
    with pytest.raises(ValueError, match="input_range"):
        NeuralClamping(model, init="data", **quiet()).fit(x, y)
    with pytest.raises(ValueError, match="alpha <= beta"):
        data_driven_delta(model, x, (1.0, 0.0))


# ---- the model is never touched ---------------------------------------------------------------


@pytest.mark.parametrize("fitter", ["fast", "paper", "toolkit"])
def test_model_weights_untouched(fitter):
    model = make_model()
    for p in model.parameters():
        p.requires_grad_(True)  # a model the user did not freeze
    x, y = make_data(model, 300)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    nc = NeuralClamping(model, fitter=fitter, epochs=2, **quiet()).fit(x, y)
    nc.predict_logits(x)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())
    assert not model.training


# ---- repeatability ------------------------------------------------------------------------------


@pytest.mark.parametrize("fitter, start", [("fast", {"init_std": 0.1}), ("paper", {})])
def test_seeded_runs_repeat_and_seeds_differ(problem, fitter, start):
    model, x, y, *_ = problem
    fit = lambda seed: NeuralClamping(model, fitter=fitter, epochs=3, seed=seed, **start, **quiet()).fit(x, y)
    a, b, c = fit(3), fit(3), fit(4)
    assert torch.equal(a.delta_, b.delta_) and a.temperature_ == b.temperature_
    assert not torch.equal(a.delta_, c.delta_)
    assert NeuralClamping(model, fitter=fitter, **start).options.seeded


def test_the_default_starts_at_zero_and_is_the_same_on_every_seed(problem):
    model, x, y, *_ = problem
    fits = [NeuralClamping(model, seed=s, **quiet()).fit(x, y) for s in (0, 1, 7)]
    assert all(torch.equal(f.delta_, fits[0].delta_) and f.temperature_ == fits[0].temperature_ for f in fits)
    assert not fits[0].options.seeded
    # Started from δ₀ = 0 exactly: a frozen δ stays 0, and a fit of no steps gives δ₀ itself.
    frozen = NeuralClamping(model, learn_delta=False, **quiet()).fit(x, y)
    assert torch.count_nonzero(frozen.delta_) == 0
    assert NeuralClamping(model, init="data").options.seeded is False
    assert NeuralClamping(model, fitter="toolkit").options.seeded is True


# ---- the paper recipe ---------------------------------------------------------------------------


def reference_sgd(model, x, y, gamma, lam, seed, epochs, lr=0.001, bs=512, momentum=0.9):
    """The paper recipe written with torch.optim.SGD, the optimiser the authors' code uses."""
    gen = torch.Generator().manual_seed(seed)
    delta = (0.1 * torch.randn(x.shape[1:], generator=gen)).requires_grad_()
    temp = torch.ones((), requires_grad=True)
    opt = torch.optim.SGD([delta, temp], lr=lr, momentum=momentum)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), bs):
            idx = perm[i : i + bs]
            loss = focal_by_hand(model(x[idx] + delta) / temp, y[idx], gamma) + lam * (delta**2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return delta.detach(), float(temp.detach())


@pytest.mark.parametrize("gamma", [0.0, 1.0])
def test_paper_fitter_matches_sgd_with_momentum(problem, gamma):
    model, x, y, *_ = problem
    model = make_model()
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        lam = 0.1 * float(focal_by_hand(model(x), y, gamma))
    calls = []
    nc = NeuralClamping(model, gamma=gamma, fitter="paper", epochs=3, seed=7, callback=calls.append, **quiet()).fit(x, y)
    delta, temp = reference_sgd(model, x, y, gamma, lam, seed=7, epochs=3)
    steps = 3 * math.ceil(len(x) / 512)
    assert len(calls) == steps and calls[-1]["step"] == steps
    assert [h["epoch"] for h in nc.history_] == [1, 2, 3]
    assert nc.weight_decay_ == pytest.approx(lam, rel=1e-6)
    torch.testing.assert_close(nc.delta_, delta, atol=1e-6, rtol=0)
    assert nc.temperature_ == pytest.approx(temp, abs=1e-6)
    assert nc.n_passes_ == pytest.approx(3 + 0.5 + 0.5)
    with torch.no_grad():
        objective = focal_by_hand(model(x + delta) / temp, y, gamma) + lam * (delta**2).sum()
    assert nc.objective_ == pytest.approx(float(objective), rel=1e-5)
    # Momentum changes the path: plain SGD from the same start ends elsewhere.
    plain_delta, plain_temp = reference_sgd(model, x, y, gamma, lam, seed=7, epochs=3, momentum=0.0)
    assert abs(plain_temp - nc.temperature_) > 1e-4
    plain = NeuralClamping(model, gamma=gamma, fitter="paper", epochs=3, seed=7, momentum=0.0, **quiet()).fit(x, y)
    torch.testing.assert_close(plain.delta_, plain_delta, atol=1e-6, rtol=0)
    assert plain.temperature_ == pytest.approx(plain_temp, abs=1e-6)


def toolkit_by_hand(model, x, y, seed, epochs, gamma=1.0, lam1=0.01, lr=0.01, bs=1000):
    """The released NCWrapper.train_NC loop with demo.py's settings, restated independently:
    a perturbation and a (1,)-shaped temperature as parameters, FocalLoss on p_y clamped to
    [1e-7, 1 − 1e-7], loss = focal + λ₁·‖δ‖₂ per batch, torch.optim.SGD(lr, momentum=0.9)."""
    gen = torch.Generator().manual_seed(seed)
    delta = nn.Parameter(0.001 * torch.randn(x.shape[1:], generator=gen))
    temp = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([delta, temp], lr=lr, momentum=0.9)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), bs):
            idx = perm[i : i + bs]
            p = torch.softmax(model(x[idx] + delta) / temp, dim=1)
            py = (p * nn.functional.one_hot(y[idx], p.shape[1])).sum(1).clamp(1e-7, 1 - 1e-7)
            loss = (-((1 - py) ** gamma) * py.log()).mean() + lam1 * torch.norm(delta)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return delta.detach(), float(temp.detach())


def test_toolkit_fitter_matches_the_released_training_loop():
    model = make_model(k=4)
    with torch.no_grad():
        model[3].weight.mul_(6.0)  # so confident that the 1e-7 clamp is active for some samples
    x, y = make_data(model, 2300, t_true=4.0)
    with torch.no_grad():
        p_y = torch.softmax(model(x), 1)[torch.arange(len(y)), y]
    assert int((p_y > 1 - 1e-7).sum()) > 20  # the clamp matters in this problem
    nc = NeuralClamping(model, fitter="toolkit", epochs=4, seed=3, **quiet()).fit(x, y)
    delta, temp = toolkit_by_hand(model, x, y, seed=3, epochs=4)
    assert nc.weight_decay_ == 0.01
    assert nc.n_passes_ == pytest.approx(4 + 0.5)  # 3 batches an epoch (1000, 1000, 300), then the final logits
    torch.testing.assert_close(nc.delta_, delta, atol=2e-6, rtol=0)
    assert nc.temperature_ == pytest.approx(temp, abs=2e-6)
    with torch.no_grad():
        pf = torch.softmax(model(x + delta) / temp, 1)[torch.arange(len(y)), y].clamp(1e-7, 1 - 1e-7)
        objective = (-(1 - pf) * pf.log()).mean() + 0.01 * torch.norm(delta)
    assert nc.objective_ == pytest.approx(float(objective), rel=1e-5)
    # Without the clamp (or with the squared penalty) the path differs measurably.
    unclamped = toolkit_by_hand(model, x, y, seed=3, epochs=4, lam1=0.0)
    assert abs(unclamped[1] - nc.temperature_) > 1e-5


def test_fast_fitter_beats_paper_recipe_with_a_fifth_of_the_passes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 36, 4)).eval()
    with torch.no_grad():
        model[3].weight.mul_(8.0)
    x, y = make_data(model, 1024, shape=(1, 6, 6), t_true=2.5)
    paper = NeuralClamping(model, fitter="paper", momentum=0.0, **quiet()).fit(x, y)
    fast = NeuralClamping(model, fitter="fast", weight_decay="auto", temperature="fitted", **quiet()).fit(x, y)
    assert paper.n_passes_ == pytest.approx(101)
    # It converged before its budget of 20 passes: at most a fifth of the recipe's 101.
    assert fast.n_passes_ < fast.max_passes and fast.n_passes_ <= paper.n_passes_ / 5
    assert fast.objective_ <= paper.objective_ * 1.01
    # objective_ is the exact objective at the returned state.
    with torch.no_grad():
        exact = focal_by_hand(model(x + fast.delta_) / fast.temperature_, y, 1.0) + fast.weight_decay_ * (fast.delta_**2).sum()
    assert fast.objective_ == pytest.approx(float(exact), rel=1e-5)


# ---- prediction and its ablations -------------------------------------------------------------


def test_predict_logits_and_ablations(problem):
    model, x, y, xt, _ = problem
    nc = NeuralClamping(model, **quiet()).fit(x, y)
    d, t = nc.delta_, nc.temperature_
    with torch.no_grad():
        torch.testing.assert_close(nc.predict_logits(xt), model(xt + d) / t)
        torch.testing.assert_close(nc.predict_logits(xt, use_delta=False), model(xt) / t)
        torch.testing.assert_close(nc.predict_logits(xt, use_temperature=False), model(xt + d))
    out = nc.predict_logits(xt, batch_size=7)
    assert out.dtype == torch.float32 and out.device.type == "cpu" and out.shape == (len(xt), 3)
    with pytest.raises(ValueError, match="per sample"):
        nc.predict_logits(torch.zeros(5, 16))
    with pytest.raises(NotFittedError):
        NeuralClamping(model).predict_logits(xt)


def test_clamp_keeps_perturbed_inputs_in_range(problem):
    model, x, y, xt, _ = problem
    nc = NeuralClamping(model, clamp=True, input_range=(-0.5, 0.5), weight_decay=0.0, **quiet()).fit(x, y)
    with torch.no_grad():
        expected = model(torch.clamp(xt + nc.delta_, -0.5, 0.5)) / nc.temperature_
    torch.testing.assert_close(nc.predict_logits(xt), expected)


# ---- γ selection, sweep, initialisation study ---------------------------------------------------


def test_gamma_auto_picks_lowest_calibration_ece(problem):
    model, x, y, *_ = problem
    nc = NeuralClamping(model, gamma="auto", gamma_candidates=(0.0, 1.0, 3.0), weight_decay="auto",
                        temperature="fitted", **quiet()).fit(x, y)
    eces = [c["ece"] for c in nc.candidates_]
    assert [c["gamma"] for c in nc.candidates_] == [0.0, 1.0, 3.0]
    assert nc.gamma_ == nc.candidates_[int(np.argmin(eces))]["gamma"]
    assert ece(nc.predict_logits(x), y) == pytest.approx(min(eces), abs=1e-6)
    with torch.no_grad():
        lam = 0.1 * float(focal_by_hand(model(x), y, nc.gamma_))
    assert nc.weight_decay_ == pytest.approx(lam, rel=1e-6)


def multibin_ece_by_hand(z, y, temps, bins=(10, 15, 20)):
    """Mean over bin counts of the 15-bin-style ECE, in numpy, one temperature at a time (independent code)."""
    z = z.double().numpy()
    y = y.numpy()
    out = []
    for t in temps:
        p = np.exp((z - z.max(1, keepdims=True)) / t)
        p /= p.sum(1, keepdims=True)
        conf, correct = p.max(1), (p.argmax(1) == y)
        values = []
        for m in bins:
            idx = np.clip(np.ceil(conf * m).astype(int) - 1, 0, m - 1)
            values.append(sum(abs((conf[idx == b] - correct[idx == b]).sum()) for b in range(m)) / len(y))
        out.append(np.mean(values))
    return np.array(out)


def assert_lowest_multibin_ece(z, y, t):
    """``t`` minimises the mean ECE over 10, 15, 20 bins of z / t: no temperature nearby or anywhere on
    a 0.01 grid does better, and ties go to the smaller T."""
    grid = np.round(np.arange(1, 10001) * 0.001, 3)
    near = grid[np.abs(grid - t) <= 0.05]
    by_hand_near, by_hand_coarse = multibin_ece_by_hand(z, y, near), multibin_ece_by_hand(z, y, grid[9::10])
    chosen = multibin_ece_by_hand(z, y, [t])[0]
    assert chosen <= by_hand_near.min() + 1e-12 and chosen <= by_hand_coarse.min() + 1e-12
    assert t == pytest.approx(near[np.flatnonzero(by_hand_near <= chosen + 1e-12)[0]], rel=1e-12)


def test_selected_rule_picks_the_temperature_with_the_lowest_multibin_ece(problem):
    model, x, y, *_ = problem
    nc = NeuralClamping(model, seed=2, temperature="selected", **quiet()).fit(x, y)
    z = nc.predict_logits(x, use_temperature=False)
    assert nc.fitted_temperature_ != nc.temperature_
    assert_lowest_multibin_ece(z, y, nc.temperature_)
    with torch.no_grad():
        lam = 1.0 * float(focal_by_hand(model(x), y, 1.0))  # "strong": the unperturbed mean loss
    assert nc.weight_decay_ == pytest.approx(lam, rel=1e-6)


def test_default_anchors_t_on_the_unperturbed_logits_and_fits_delta_at_it(problem):
    model, x, y, *_ = problem
    nc = NeuralClamping(model, seed=2, tol=1e-10, max_passes=150, **quiet()).fit(x, y)
    with torch.no_grad():
        z0 = model(x)
    # T: the lowest mean ECE of the unperturbed logits, held while δ was fitted and kept.
    assert_lowest_multibin_ece(z0, y, nc.temperature_)
    assert nc.fitted_temperature_ == nc.temperature_
    assert all(h["temperature"] == pytest.approx(nc.temperature_, rel=1e-6) for h in nc.history_)
    t = nc.temperature_
    # λ: "auto", a tenth of the unperturbed mean focal loss at that T.
    lam = 0.1 * float(focal_by_hand(z0.double() / t, y, 1.0))
    assert nc.weight_decay_ == pytest.approx(lam, rel=1e-6)

    # δ: the minimiser of F(δ) = mean FL_1(f(x + δ) / T) + λ‖δ‖² at that T, found here by scipy.
    model64 = copy.deepcopy(model).double()

    def objective(v):
        d = torch.tensor(v, dtype=torch.float64, requires_grad=True)
        f = focal_by_hand(model64(x.double() + d.view(x.shape[1:])) / t, y, 1.0) + lam * (d**2).sum()
        (g,) = torch.autograd.grad(f, d)
        return float(f.detach()), g.numpy()

    ref = minimize(objective, np.zeros(x[0].numel()), jac=True, method="BFGS", options={"gtol": 1e-10})
    ours, _ = objective(nc.delta_.double().reshape(-1).numpy())
    assert ours == pytest.approx(ref.fun, rel=1e-6)
    np.testing.assert_allclose(nc.delta_.reshape(-1).numpy(), ref.x, atol=2e-3)
    assert np.abs(ref.x).max() > 0.05  # δ does move: the test is not about a δ that stays at 0


def test_anchored_temperature_is_a_rule_of_the_fast_fitter(problem):
    model, x, y, *_ = problem
    with pytest.raises(ValueError, match="anchored.*fast fitter.*'fitted' or 'selected'"):
        NeuralClamping(model, fitter="toolkit", temperature="anchored", **quiet()).fit(x, y)
    # T alone under the anchored rule is the anchored T with δ = 0: the calibration-ECE choice of TS.
    frozen = NeuralClamping(model, learn_delta=False, **quiet()).fit(x, y)
    with torch.no_grad():
        assert_lowest_multibin_ece(model(x), y, frozen.temperature_)
    assert float(frozen.delta_.abs().max()) == 0.0 and frozen.n_passes_ == 0.5


def test_gamma_sweep_rows_are_the_fits_at_each_gamma(problem):
    model, x, y, xt, yt = problem
    gammas = [0.0, 0.25, 0.5, 0.75, 1.0]
    sw = gamma_sweep(model, x, y, xt, yt, gammas=gammas, progress=False)
    for split in (sw.cal, sw.test):
        assert set(split) == {"ece", "entropy", "loss"}
        assert all(v.shape == (5,) for v in split.values())
    # One shared first pass, then each γ's own fit.
    assert sw.n_passes == pytest.approx(0.5 + sw.passes.sum())
    # Every row is the fit that Neural Clamping gives at that γ alone, with the same default options.
    for i in (1, 4):
        alone = NeuralClamping(model, gamma=gammas[i], **quiet()).fit(x, y)
        assert sw.temperature[i] == pytest.approx(alone.temperature_, rel=1e-6)
        assert sw.weight_decay[i] == pytest.approx(alone.weight_decay_, rel=1e-6)
        assert sw.objective[i] == pytest.approx(alone.objective_, rel=1e-6)
        zt = alone.predict_logits(xt)
        assert sw.test["ece"][i] == pytest.approx(ece(zt, yt), abs=1e-6)
        assert sw.test["loss"][i] == pytest.approx(float(focal_by_hand(zt, yt, gammas[i])), rel=1e-5)
    # The γ the sweep marks is the one gamma="auto" over the same values keeps.
    auto = NeuralClamping(model, gamma="auto", gamma_candidates=tuple(gammas), **quiet()).fit(x, y)
    assert sw.chosen_gamma == auto.gamma_
    assert auto.temperature_ == pytest.approx(sw.temperature[gammas.index(auto.gamma_)], rel=1e-6)


def test_init_study_runs(problem):
    model, x, y, xt, yt = problem
    st = init_study(model, (x, y), (xt, yt), n_runs=2, input_range=RANGE, progress=False)
    assert len(st.runs["random"]) == len(st.runs["data"]) == 2
    assert st.runs["random"][0]["ece"] != st.runs["random"][1]["ece"]
    assert st.runs["data"][0] == st.runs["data"][1] and st.shared_data_fit
    one = NeuralClamping(model, init="data", input_range=RANGE, **quiet()).fit(x, y)
    assert st.runs["data"][0]["ece"] == pytest.approx(ece(one.predict_logits(xt), yt), abs=1e-6)
    assert st.values("random", "ece").shape == (2,)


def test_efficient_nc(problem):
    model, x, y, *_ = problem
    eff = EfficientNeuralClamping(model, input_range=RANGE, grid_step=0.01).fit(x, y)
    torch.testing.assert_close(eff.delta_, data_driven_delta(model, x, RANGE))
    assert eff.n_passes_ == 1.5
    with torch.no_grad():
        z = model(x + eff.delta_)
    grid = np.arange(1, 501) * 0.01
    eces = [ece(z / t, y) for t in grid]
    assert eff.temperature_ == pytest.approx(grid[int(np.argmin(eces))])
    assert not EfficientNeuralClamping.stochastic and NeuralClamping.stochastic


# ---- inputs, stopping, errors ----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_loader_gives_the_same_fit_as_tensors(problem, monkeypatch, stream):
    model, x, y, *_ = problem
    ref = NeuralClamping(model, init="data", input_range=RANGE, batch_size=128, **quiet()).fit(x, y)
    if stream:
        monkeypatch.setattr(clamping_fit, "DEVICE_CACHE_BYTES", 0)
    ds = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(ds, batch_size=100, shuffle=True, generator=torch.Generator().manual_seed(0))
    got = NeuralClamping(model, init="data", input_range=RANGE, batch_size=128, **quiet()).fit(loader)
    torch.testing.assert_close(got.delta_, ref.delta_, atol=1e-5, rtol=1e-4)
    assert got.temperature_ == pytest.approx(ref.temperature_, rel=1e-4)


def test_callback_can_stop_the_fit(problem):
    model, x, y, *_ = problem
    seen = []

    def stop_after_three(info):
        seen.append(info)
        if len(seen) == 3:
            raise StopFitting

    nc = NeuralClamping(model, callback=stop_after_three, **quiet()).fit(x, y)
    assert nc.stopped_early_ and len(nc.history_) == 3
    assert {"step", "loss", "temperature", "passes"} <= set(seen[0])
    assert all(i["expected_passes"] == nc.expected_passes() for i in seen)  # the plan comes with every step
    assert nc.objective_ == pytest.approx(min(h["loss"] for h in nc.history_))
    assert nc.n_passes_ == pytest.approx(3.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gamma": -1}, "gamma"),
        ({"gamma": "best"}, "gamma"),
        ({"gamma": 1e308}, "gamma must be at most 10"),
        ({"gamma": "auto", "gamma_candidates": [1, 11]}, "gamma_candidates must be at most 10"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"weight_decay": 1e7}, "weight_decay must be at most 1,000,000"),
        ({"lr": 0}, "lr"),
        ({"fitter": "paper", "lr": 100}, "lr must be at most 10"),
        ({"epochs": 0}, "epochs"),
        ({"fitter": "paper", "epochs": 10**6}, "epochs must be at most 10,000"),
        ({"fitter": "paper", "momentum": 1.0}, "momentum"),
        ({"fitter": "toolkit", "init_std": -1}, "init_std"),
        ({"fitter": "adam"}, "fitter"),
        ({"init": "zeros"}, "init"),
        ({"batch_size": 0}, "batch_size"),
        ({"clamp": True}, "input_range"),
        ({"gamma": "auto", "gamma_candidates": []}, "gamma_candidates"),
    ],
)
def test_bad_settings_are_clear_errors(problem, kwargs, message):
    model, x, y, *_ = problem
    with pytest.raises(ValueError, match=message):
        NeuralClamping(model, **quiet(), **kwargs).fit(x, y)


def test_bad_data_are_clear_errors(problem):
    model, x, y, *_ = problem
    with pytest.raises(ValueError, match="labels"):
        NeuralClamping(model, **quiet()).fit(x, y[:-1])
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        NeuralClamping(model, **quiet()).fit(x, y + 5)
    with pytest.raises(ValueError, match="labels are needed"):
        NeuralClamping(model, **quiet()).fit(x)


def test_fast_fitter_warns_on_a_split_too_small_for_delta():
    model = make_model()
    x, y = make_data(model, 24)  # 24 images for a δ of 16 values: fewer than 2 per value
    with pytest.warns(UserWarning, match=r"24 calibration images for a δ of 16 values"):
        NeuralClamping(model, progress=False, max_passes=2).fit(x, y)
    x, y = make_data(model, 40)  # 40 >= 2 × 16: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NeuralClamping(model, progress=False, max_passes=2).fit(x, y)
        NeuralClamping(model, progress=False, fitter="paper", epochs=1).fit(*make_data(model, 24))  # the paper recipe barely moves δ


def test_options_keep_what_they_were_given_and_read_it_in_one_place(problem):
    """γ, λ and the learning rate typed as text stay in their fields as typed; ``setting``, ``gamma_values``,
    ``to_dict`` and the estimator's attributes give the values read, and the fit is the fit of those numbers."""
    from nctv.settings import NCOptions

    model, x, y, *_ = problem
    typed = NCOptions(gamma=" 0.5 ", weight_decay="0.01", fitter="paper", epochs=2, lr=" 0.005")
    numbers = NCOptions(gamma=0.5, weight_decay=0.01, fitter="paper", epochs=2, lr=0.005)
    assert (typed.gamma, typed.weight_decay, typed.lr) == (" 0.5 ", "0.01", " 0.005")
    assert typed.gamma_values == (0.5,) and typed.to_dict() == numbers.to_dict()
    assert typed.changed(epochs=3).gamma == " 0.5 "
    a, b = NeuralClamping(model, typed, **quiet()), NeuralClamping(model, numbers, **quiet())
    assert a.get_params() == b.get_params() and (a.gamma, a.weight_decay, a.lr) == (0.5, 0.01, 0.005)
    fa, fb = a.fit(x, y), b.fit(x, y)
    assert torch.equal(fa.delta_, fb.delta_) and fa.temperature_ == fb.temperature_
    auto = NCOptions(gamma=" Auto ", gamma_candidates=(2, 0.5), weight_decay="default")
    assert (auto.gamma, auto.setting("gamma"), auto.gamma_values) == (" Auto ", "auto", (0.5, 2.0))
    assert auto.weight_decay == "default" and auto.setting("weight_decay") is None


def test_options_object_and_keywords_build_the_same_estimator(problem):
    """``NeuralClamping(model, options)`` and keyword settings build one checked ``NCOptions``;
    scikit-learn's contract holds: ``get_params`` rebuilds it, ``clone`` copies it, ``set_params``
    gives a new checked object and leaves the given one as it was."""
    import dataclasses

    from nctv.settings import NCOptions

    model, x, y, *_ = problem
    options = NCOptions(gamma=0.5, weight_decay=0.01, fitter="paper", epochs=2, lr=0.005)
    a = NeuralClamping(model, options, seed=3, **quiet())
    b = NeuralClamping(model, gamma=0.5, weight_decay=0.01, fitter="paper", epochs=2, lr=0.005, seed=3, **quiet())
    assert a.options == b.options == options and a.get_params() == b.get_params()
    assert (a.gamma, a.fitter, a.epochs) == (0.5, "paper", 2)  # each option reads as a setting
    assert NeuralClamping(**a.get_params()).options == options
    c = a.clone()
    assert c is not a and c.options == options and c.seed == 3
    fa, fc = a.fit(x, y), c.fit(x, y)
    assert torch.equal(fa.delta_, fc.delta_) and (fa.gamma_, fa.weight_decay_, fa.fitter_) == (0.5, 0.01, "paper")
    a.set_params(gamma=2.0, seed=4)
    assert (a.options.gamma, a.seed, options.gamma) == (2.0, 4, 0.5)
    with pytest.raises(ValueError, match="gamma must be at most 10"):
        a.set_params(gamma=11)
    with pytest.raises(ValueError, match="has no setting 'speed'"):
        a.set_params(speed=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.gamma = 1.0


def test_each_fit_gets_a_problem_built_with_its_loss(problem):
    """The shared problem of a prepared split is never changed: each γ of a path is fitted on a
    problem built with its own γ and λ, and the split alone counts the passes of all of them."""
    import dataclasses

    model, x, y, *_ = problem
    nc = NeuralClamping(model, weight_decay=0.01, temperature="fitted", **quiet())
    prepared = nc.prepare(x, y)
    shared = dict(vars(prepared.problem))
    fits = nc.fit_prepared(prepared, [0.0, 2.0])
    assert vars(prepared.problem) == shared and prepared.problem.gamma == 0.0
    assert [f.gamma for f in fits] == [0.0, 2.0] and [f.weight_decay for f in fits] == [0.01, 0.01]
    assert prepared.passes == pytest.approx(0.5 + sum(f.result.passes for f in fits))
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.problem.gamma = 1.0
    with pytest.raises(AttributeError):
        prepared.problem.split.passes = 0.0


@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
def test_focal_loss_of_a_saturated_sample_has_a_zero_gradient_on_every_torch(gamma):
    """A correct sample whose p_y rounds to 1 in float32 adds nothing, and its gradient is the limit, 0:
    torch 2.2's power rule gave NaN for γ < 1 (0^(γ−1) · 0), which stopped a recipe's SGD."""
    from nctv.calibration.base import focal_loss

    z = torch.tensor([[40.0, 0.0, -3.0], [0.5, 0.2, 0.1]], requires_grad=True)
    y = torch.tensor([0, 1])
    loss = focal_loss(z, y, gamma, reduction="sum")
    (g,) = torch.autograd.grad(loss, z)
    assert torch.isfinite(g).all() and torch.count_nonzero(g[0]) == 0
    # The unsaturated row: the value and gradient of −(1 − p)^γ log p, computed independently.
    zz = z[1].detach().double().requires_grad_(True)
    p = torch.softmax(zz, 0)[1]
    ref = -((1 - p) ** gamma) * torch.log(p)
    (g_ref,) = torch.autograd.grad(ref, zz)
    torch.testing.assert_close(g[1].double(), g_ref, rtol=1e-5, atol=1e-7)
    assert float(loss) == pytest.approx(float(ref), rel=1e-6)


_KERNEL_FIT = """
import sys, torch
from nctv.calibration.clamping import NeuralClamping
from nctv.data import get_splits
from nctv.zoo import DEFAULT_MODEL, load_model

torch.set_num_threads(int(sys.argv[2]))
loaded = load_model(DEFAULT_MODEL)
cal, _ = get_splits(loaded, calibration_size=1000, test_size=10)
x, y = cal.tensors()
nc = NeuralClamping(loaded.model, gamma=1.0, input_range=loaded.input_range).fit(x, y)
# A random start, one pass: torch's scalar and vector kernels draw float32 normals differently.
start = NeuralClamping(loaded.model, gamma=1.0, init_std=0.1, max_passes=1.5).fit(x, y)
# Theorem 1's start: δ̃ is flat where the data's range is, so it keeps a flat picture's max-pooling ties.
data = NeuralClamping(loaded.model, gamma=1.0, init="data", input_range=loaded.input_range, max_passes=8).fit(x, y)
torch.save({"capability": torch.backends.cpu.get_cpu_capability(), "delta": nc.delta_, "random_start": start.delta_,
            "data_start": data.delta_, "data_objective": data.objective_,
            "temperature": nc.temperature_, "weight_decay": nc.weight_decay_, "passes": nc.n_passes_}, sys.argv[1])
"""


@pytest.mark.slow
def test_the_default_fit_is_the_same_on_every_cpu_kernel_set_and_thread_count(tmp_path):
    """The default fast fit of the embedded model on 1,000 calibration images under torch's scalar CPU
    kernels and this CPU's vector ones (ATEN_CPU_CAPABILITY), with 1 and 2 threads: the same T, λ,
    passes and δ to 1e-9; and the first step from a random start (init_std=0.1) and a fit from Theorem 1's
    δ̃ (init="data": δ̃ is flat where the data's range is and kept max-pooling ties until the tie-breaking
    pattern was added to it too) the same too. In float32 the same fits parted by about 1 % of ‖δ‖ (the
    float64 twin and the tie-breaking start are why they no longer do: clamping_fit.exact_twin)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    best = torch.backends.cpu.get_cpu_capability().lower()
    # ATEN_CPU_CAPABILITY sets torch's own kernels; the float64 convolutions' matrix products are MKL's,
    # which picks its code by the CPU: MKL_CBWR=COMPATIBLE takes its baseline code, as an older CPU would
    # (its products differ from this CPU's by about 1e-16 relative).
    settings = [("default", 1, "AUTO"), (best, 1, "AUTO"), (best, 2, "AUTO"), (best, 2, "COMPATIBLE")]
    settings += [("avx2", 1, "AUTO")] if best == "avx512" else []
    root = str(Path(__file__).resolve().parent.parent)
    fits = []
    for capability, threads, blas in settings:
        out = tmp_path / f"{capability}-{threads}-{blas}.pt"
        env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, OMP_NUM_THREADS=str(threads), PYTHONPATH=root,
                   HF_HUB_OFFLINE="1", MKL_CBWR=blas)
        subprocess.run([sys.executable, "-c", _KERNEL_FIT, str(out), str(threads)], env=env, check=True,
                       capture_output=True, timeout=900)
        fits.append(torch.load(out, weights_only=True))
    assert fits[0]["capability"] == "DEFAULT" and fits[1]["capability"] == best.upper()  # the settings took
    ref = fits[0]
    assert float(ref["delta"].norm()) > 0.1  # δ moved: the comparison below can tell fits apart
    for fit in fits[1:]:
        assert fit["temperature"] == ref["temperature"] and fit["passes"] == ref["passes"]
        assert fit["weight_decay"] == pytest.approx(ref["weight_decay"], rel=1e-12)
        torch.testing.assert_close(fit["delta"], ref["delta"], rtol=0, atol=1e-9 * float(ref["delta"].abs().max()))
        torch.testing.assert_close(fit["random_start"], ref["random_start"], rtol=0,
                                   atol=1e-9 * float(ref["random_start"].abs().max()))
        torch.testing.assert_close(fit["data_start"], ref["data_start"], rtol=0,
                                   atol=1e-9 * float(ref["data_start"].abs().max()))
        assert fit["data_objective"] == pytest.approx(ref["data_objective"], rel=1e-12)
