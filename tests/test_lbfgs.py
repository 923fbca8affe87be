"""The shared L-BFGS two-loop recursion against the dense BFGS update it stands for."""
import torch

from nctv.calibration.lbfgs import two_loop


def dense_inverse_hessian(h0, pairs):
    """H after the BFGS updates H ← Vᵀ H V + ρ s sᵀ, V = I − ρ y sᵀ, oldest pair first."""
    h = h0.clone()
    eye = torch.eye(len(h0), dtype=h0.dtype)
    for s, y, rho in pairs:
        v = eye - rho * torch.outer(y, s)
        h = v.T @ h @ v + rho * torch.outer(s, s)
    return h


def curvature_pairs(n, count, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, dtype=torch.float64, generator=g)
    hessian = m @ m.T + n * torch.eye(n, dtype=torch.float64)
    pairs = []
    for _ in range(count):
        s = torch.randn(n, dtype=torch.float64, generator=g)
        y = hessian @ s
        pairs.append((s, y, 1.0 / torch.dot(s, y)))
    return pairs, g


def test_two_loop_is_the_dense_bfgs_update():
    n = 12
    pairs, gen = curvature_pairs(n, 5, seed=0)
    scale = torch.rand(n, dtype=torch.float64, generator=gen) + 0.5
    grad = torch.randn(n, dtype=torch.float64, generator=gen)
    expected = -dense_inverse_hessian(torch.diag(scale), pairs) @ grad
    got = two_loop(grad, pairs, lambda q: q * scale)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    # ρ as Python floats (the Neural Clamping memory) gives the same product.
    as_floats = [(s, y, float(rho)) for s, y, rho in pairs]
    torch.testing.assert_close(two_loop(grad, as_floats, lambda q: q * scale), expected, rtol=1e-12, atol=1e-14)
    # No pairs: −H₀·g.
    torch.testing.assert_close(two_loop(grad, [], lambda q: q * scale), -scale * grad)


def test_two_loop_satisfies_the_latest_secant_equation():
    pairs, _ = curvature_pairs(8, 4, seed=1)
    s, y, _ = pairs[-1]
    torch.testing.assert_close(two_loop(y, pairs, lambda q: 3.0 * q), -s, rtol=1e-12, atol=1e-12)


def test_two_loop_leaves_its_inputs_alone():
    pairs, gen = curvature_pairs(6, 3, seed=2)
    grad = torch.randn(6, dtype=torch.float64, generator=gen)
    before = [t.clone() for pair in pairs for t in pair[:2]] + [grad.clone()]
    two_loop(grad, pairs, lambda q: q.clone())
    after = [t for pair in pairs for t in pair[:2]] + [grad]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
