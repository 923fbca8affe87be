"""Vector/matrix scaling, MS-ODIR and Dir-ODIR: optimality checked with autograd and an independent
optimiser, recovery of a known affine distortion, the ODIR regulariser and the CV selection."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nctv.calibration.base import NotFittedError
from nctv.canonical import canonical_order
from nctv.calibration.linear import (
    ODIR_GRID,
    DirichletODIR,
    MatrixScaling,
    MatrixScalingODIR,
    VectorScaling,
    odir_penalty,
    stratified_folds,
)
from nctv.calibration.temperature import TemperatureScaling


pytestmark = pytest.mark.usefixtures("one_thread")


def distorted_sample(n, k, seed=0, mixing=0.3):
    """A calibrated model's logits z0 (labels drawn from softmax(z0)), seen through a known
    affine distortion z = A·z0 + c. The ideal calibrator undoes it: softmax(A⁻¹(z − c))."""
    g = torch.Generator().manual_seed(seed)
    z0 = torch.randn(n, k, dtype=torch.float64, generator=g) * 1.5
    y = torch.multinomial(torch.softmax(z0, 1), 1, generator=g).squeeze(1)
    a = torch.diag(torch.linspace(1.5, 3.0, k, dtype=torch.float64))
    a = a + mixing * torch.randn(k, k, dtype=torch.float64, generator=g)
    c = torch.randn(k, dtype=torch.float64, generator=g)
    return z0 @ a.T + c, y, z0


def nll(logits, y):
    return float(F.cross_entropy(logits.double(), y))


def odir_objective(w, b, x, y, lam, mu):
    k = w.shape[0]
    off = w - torch.diag(torch.diagonal(w))
    return F.cross_entropy(x @ w.T + b, y) + lam / (k * (k - 1)) * (off**2).sum() + mu / k * (b**2).sum()


def autograd_gradient(w, b, x, y, lam=0.0, mu=0.0):
    w = w.clone().requires_grad_(True)
    b = b.clone().requires_grad_(True)
    odir_objective(w, b, x, y, lam, mu).backward()
    return torch.cat([w.grad.flatten(), b.grad])


@pytest.fixture(scope="module")
def distorted():
    return distorted_sample(6000, 4)


def test_nested_models_fit_in_order(distorted):
    z, y, _ = distorted
    ts = TemperatureScaling().fit(z, y)
    vs = VectorScaling().fit(z, y)
    ms = MatrixScaling().fit(z, y)
    nll_id, nll_ts = nll(z, y), nll(ts.transform(z), y)
    nll_vs, nll_ms = nll(vs.transform(z), y), nll(ms.transform(z), y)
    # Each model contains the previous one, and each fit reaches its optimum.
    assert nll_ms <= nll_vs + 1e-9 <= nll_ts + 2e-9 < nll_id
    assert nll_ms < nll_ts - 0.01  # the distortion mixes classes: only a full W undoes it
    assert ms.converged_ and vs.converged_


def test_matrix_scaling_recovers_the_true_calibrated_probabilities(distorted):
    z, y, z0 = distorted
    ms = MatrixScaling().fit(z, y)
    p_true, p_fit = torch.softmax(z0, 1), torch.softmax(ms.transform(z).double(), 1)
    assert float((p_fit - p_true).abs().max(1).values.mean()) < 0.02
    # Zero gradient of the unregularised NLL, by autograd on an independent formula.
    g = autograd_gradient(ms.weight_, ms.bias_, z, y)
    assert float(g.abs().max()) < 1e-7


def test_vector_scaling_is_diagonal_and_stationary(distorted):
    z, y, _ = distorted
    vs = VectorScaling().fit(z, y)
    w = torch.diagonal(vs.weight_).clone().requires_grad_(True)
    b = vs.bias_.clone().requires_grad_(True)
    F.cross_entropy(z * w + b, y).backward()
    assert float(w.grad.abs().max()) < 1e-7 and float(b.grad.abs().max()) < 1e-7
    assert torch.equal(vs.weight_, torch.diag(torch.diagonal(vs.weight_)))
    assert abs(float(vs.bias_.sum())) < 1e-10  # the canonical member of the equivalent solutions


def test_transform_convention(distorted):
    z, y, _ = distorted
    dirichlet = DirichletODIR(lambdas=[1.0], mus=[1.0], n_folds=2, progress=False)
    for model in (VectorScaling().fit(z, y), dirichlet.fit(z, y)):
        out = model.transform(z.numpy().astype(np.float32))
        assert out.dtype == torch.float32 and out.device.type == "cpu" and out.shape == z.shape
        phi = torch.log_softmax(z, 1) if isinstance(model, DirichletODIR) else z
        torch.testing.assert_close(out, (phi @ model.weight_.T + model.bias_).float())
        with pytest.raises(ValueError, match="classes"):
            model.transform(z[:, :3])


def test_odir_penalty_by_hand():
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    b = torch.tensor([1.0, -1.0])
    # λ/(K(K−1)) = 2/2 = 1 on 2² + 3² = 13; μ/K = 4/2 = 2 on 1 + 1 = 2.
    assert odir_penalty(w, b, lam=2.0, mu=4.0) == pytest.approx(13.0 + 4.0)


@pytest.mark.parametrize("cls", [MatrixScalingODIR, DirichletODIR])
def test_odir_fit_is_the_regularised_optimum(cls, distorted):
    z, y, _ = distorted
    z, y = z[:1500], y[:1500]
    model = cls(lambdas=[3.0], mus=[0.5], n_folds=2, progress=False).fit(z, y)
    x = torch.log_softmax(z, 1) if cls is DirichletODIR else z
    g = autograd_gradient(model.weight_, model.bias_, x, y, lam=3.0, mu=0.5)
    assert float(g.abs().max()) < 1e-7
    expected = float(odir_objective(model.weight_, model.bias_, x, y, 3.0, 0.5))
    assert model.objective_ == pytest.approx(expected, rel=1e-12)
    assert model.objective_ == pytest.approx(nll(model.transform(z).double(), y)
                                             + odir_penalty(model.weight_, model.bias_, 3.0, 0.5), rel=1e-6)


@pytest.mark.parametrize("cls", [MatrixScalingODIR, DirichletODIR])
def test_huge_regularisation_leaves_a_diagonal_map_without_intercept(cls, distorted):
    z, y, _ = distorted
    model = cls(lambdas=[1e9], mus=[1e9], n_folds=2, progress=False).fit(z[:1000], y[:1000])
    off = model.weight_ - torch.diag(torch.diagonal(model.weight_))
    assert float(off.abs().max()) < 1e-5 and float(model.bias_.abs().max()) < 1e-5
    assert float(torch.diagonal(model.weight_).min()) > 0.1  # the diagonal stays free


def test_dirichlet_calibration_ignores_per_sample_logit_shifts(distorted):
    z, y, _ = distorted
    z, y = z[:800], y[:800]
    shifted = z + 7.0 * torch.randn(len(z), 1, dtype=torch.float64)
    a = DirichletODIR(lambdas=[1.0, 10.0], mus=[1.0], n_folds=3, progress=False).fit(z, y)
    b = DirichletODIR(lambdas=[1.0, 10.0], mus=[1.0], n_folds=3, progress=False).fit(shifted, y)
    torch.testing.assert_close(a.weight_, b.weight_, rtol=0, atol=1e-7)
    # The folds are dealt over the rows' canonical order, a function of their bytes, which the shift changes:
    # other folds, so cross-validated NLLs close but not equal, and the same (λ, μ) chosen.
    assert (a.lambda_, a.mu_) == (b.lambda_, b.mu_)
    np.testing.assert_allclose(a.cv_nll_, b.cv_nll_, rtol=2e-2)


def test_cross_validation_picks_the_minimum_and_matches_an_independent_solver():
    z, y, _ = distorted_sample(300, 3, seed=5, mixing=0.6)
    model = MatrixScalingODIR(n_folds=3, seed=1, progress=False).fit(z, y)
    assert model.cv_nll_.shape == (7, 7) and np.all(np.isfinite(model.cv_nll_))
    i, j = np.unravel_index(np.argmin(model.cv_nll_), model.cv_nll_.shape)
    assert (model.lambda_, model.mu_) == (ODIR_GRID[i], ODIR_GRID[j])
    assert model.cv_converged_.all()
    # Recompute two entries of the CV table with damped Newton steps on an independent objective. The
    # folds are dealt over the rows in the canonical order (by logits, then label), as every fit takes them.
    rows = torch.from_numpy(canonical_order(z, y))
    z, y = z[rows], y[rows]
    folds = torch.as_tensor(stratified_folds(y, 3, seed=1))
    k = z.shape[1]
    for i, j in [(i, j), (0, 6)]:
        lam, mu = ODIR_GRID[i], ODIR_GRID[j]
        total = 0.0
        for f in range(3):
            tr, te = folds != f, folds == f

            def objective(v):
                return odir_objective(v[: k * k].view(k, k), v[k * k :], z[tr], y[tr], lam, mu)

            v = torch.cat([torch.eye(k, dtype=torch.float64).flatten(), torch.zeros(k, dtype=torch.float64)])
            for _ in range(100):
                g = torch.autograd.functional.jacobian(objective, v)
                if float(g.abs().max()) < 1e-11:
                    break
                step = torch.linalg.solve(torch.autograd.functional.hessian(objective, v), g)
                t = 1.0
                while float(objective(v - t * step)) > float(objective(v)) and t > 1e-8:
                    t /= 2
                v = v - t * step
            assert float(g.abs().max()) < 1e-8
            total += float(F.cross_entropy(z[te] @ v[: k * k].view(k, k).T + v[k * k :], y[te], reduction="sum"))
        assert model.cv_nll_[i, j] == pytest.approx(total / len(y), abs=1e-7)


@pytest.fixture(scope="module")
def thirty_classes():
    """30-class logits (where "auto" screens the ODIR grid) and each ODIR method's exact selection."""
    z, y, _ = distorted_sample(600, 30, seed=3, mixing=0.2)
    exact = {}

    def exact_fit(cls):
        if cls not in exact:
            exact[cls] = cls(progress=False, screen=False).fit(z, y)
        return exact[cls]

    return z, y, exact_fit


@pytest.mark.parametrize("cls", [MatrixScalingODIR, DirichletODIR])
def test_screened_selection_matches_the_exact_one_and_reaches_the_optimum(cls, thirty_classes):
    z, y, exact_fit = thirty_classes
    screened = cls(progress=False).fit(z, y)
    exact = exact_fit(cls)
    assert screened.screened_ and not screened.cv_refined_.all()  # some grid points were ruled out
    assert not exact.screened_ and exact.cv_refined_.all()
    assert (screened.lambda_, screened.mu_) == (exact.lambda_, exact.mu_)
    refined = screened.cv_refined_
    np.testing.assert_allclose(screened.cv_nll_[refined], exact.cv_nll_[refined], rtol=0, atol=1e-6)
    assert screened.cv_nll_[~refined].min() > screened.cv_nll_[refined].min()
    # The final fit is the optimum of the stated objective: zero gradient by autograd on an
    # independent formula, the same objective value, and the same map as the exact selection's.
    lam, mu = screened.lambda_, screened.mu_
    x = torch.log_softmax(z, 1) if cls is DirichletODIR else z
    g = autograd_gradient(screened.weight_, screened.bias_, x, y, lam=lam, mu=mu)
    assert float(g.abs().max()) < 1e-7
    assert screened.objective_ == pytest.approx(float(odir_objective(screened.weight_, screened.bias_, x, y, lam, mu)),
                                                rel=1e-12)
    assert screened.objective_ == pytest.approx(exact.objective_, rel=1e-12)
    torch.testing.assert_close(screened.weight_, exact.weight_, rtol=0, atol=1e-6)
    torch.testing.assert_close(screened.bias_, exact.bias_, rtol=0, atol=1e-6)


def test_untrusted_screening_falls_back_to_the_exact_selection(thirty_classes, monkeypatch):
    import nctv.calibration.linear as linear

    z, y, exact_fit = thirty_classes
    exact = exact_fit(MatrixScalingODIR)
    # Margins far below the screening fits' real errors: the first refined value moves by more
    # than half its margin, and the whole exact selection runs instead.
    monkeypatch.setattr(linear, "_SCREEN_SAFETY", 0.0)
    monkeypatch.setattr(linear, "_SCREEN_FLOOR", 1e-12)
    fallen = MatrixScalingODIR(progress=False, screen=True).fit(z, y)
    assert not fallen.screened_ and fallen.cv_refined_.all()
    np.testing.assert_array_equal(fallen.cv_nll_, exact.cv_nll_)
    assert torch.equal(fallen.weight_, exact.weight_) and torch.equal(fallen.bias_, exact.bias_)


def test_stratified_folds_are_balanced_and_seeded():
    y = np.repeat(np.arange(4), [10, 7, 3, 1])
    folds = stratified_folds(y, 3, seed=0)
    sizes = np.bincount(folds, minlength=3)
    assert sizes.max() - sizes.min() <= 1
    for c in range(4):
        per_fold = np.bincount(folds[y == c], minlength=3)
        assert per_fold.max() - per_fold.min() <= 1
    assert np.array_equal(folds, stratified_folds(y, 3, seed=0))
    assert not np.array_equal(folds, stratified_folds(y, 3, seed=1))


def test_rank_deficient_logits_stay_finite():
    # Logits of a network whose penultimate layer is narrower than the number of classes.
    g = torch.Generator().manual_seed(7)
    h = torch.randn(2000, 3, dtype=torch.float64, generator=g)
    z = h @ torch.randn(3, 6, dtype=torch.float64, generator=g) * 2
    y = torch.multinomial(torch.softmax(z / 2, 1), 1, generator=g).squeeze(1)
    ms = MatrixScaling().fit(z, y)
    assert torch.isfinite(ms.weight_).all() and float(ms.weight_.abs().max()) < 100
    assert nll(ms.transform(z), y) < nll(z, y)


def test_all_are_deterministic_and_refuse_use_before_fit():
    z = torch.zeros(5, 3)
    for cls in (VectorScaling, MatrixScaling, MatrixScalingODIR, DirichletODIR):
        assert cls.stochastic is False
        with pytest.raises(NotFittedError, match="fit"):
            cls().transform(z)


@pytest.mark.parametrize("cls", [VectorScaling, MatrixScaling, MatrixScalingODIR])
def test_bad_inputs_are_refused(cls):
    z, y, _ = distorted_sample(40, 3)
    with pytest.raises(ValueError, match="match"):
        cls().fit(z, y[:-1])
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        cls().fit(z, y - 1)
    bad = z.clone()
    bad[1, 2] = float("inf")
    with pytest.raises(ValueError, match="infinite"):
        cls().fit(bad, y)
    with pytest.raises(ValueError, match="at least 2 classes"):
        cls().fit(z[:, :1], torch.zeros(40, dtype=torch.long))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lambdas": []}, "empty"),
        ({"lambdas": [-1.0]}, "lambdas"),
        ({"mus": "1e-2"}, "mus"),
        ({"mus": [1.0, 1.0]}, "twice"),
        ({"n_folds": 1}, "n_folds"),
        ({"n_folds": 41}, "exceeds"),
        ({"max_iter": 0}, "max_iter"),
        ({"cv_max_iter": 2.5}, "cv_max_iter"),
        ({"screen": "yes"}, "screen"),
    ],
)
def test_bad_odir_settings_are_refused(kwargs, match):
    z, y, _ = distorted_sample(40, 3)
    with pytest.raises(ValueError, match=match):
        MatrixScalingODIR(progress=False, **kwargs).fit(z, y)


def test_separable_data_stop_at_max_iter_with_a_warning():
    z = torch.tensor([[3.0, 0.0], [0.0, 3.0]]).repeat(10, 1)
    y = torch.tensor([0, 1]).repeat(10)
    with pytest.warns(UserWarning, match="stopped after 5 iterations"):
        ms = MatrixScaling(max_iter=5).fit(z, y)
    assert not ms.converged_ and ms.n_iter_ == 5
    assert nll(ms.transform(z), y) < nll(z, y)
