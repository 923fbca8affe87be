"""Vector scaling, matrix scaling, MS-ODIR and Dir-ODIR: one affine core.

Every method here maps logits ``z`` (N, K) to calibrated logits ``W·φ(z) + b``:

* φ(z) = z for the matrix-scaling family, φ(z) = log softmax(z) for Dirichlet calibration
  (Kull et al. 2019);
* ``W`` is a full K×K matrix, or diagonal for vector scaling.

The fitted objective is the mean negative log-likelihood (natural log) of the labels plus, for the
ODIR methods, the Off-Diagonal and Intercept Regulariser

    λ/(K(K−1)) · Σ_{j≠k} w_jk²  +  μ/K · Σ_j b_j².

How the fit runs, and why:

* Full batch, float64, on the device of the logits; nothing of size N×K×K is ever formed, so
  memory stays O(N·K + K²).
* Start at the identity map (W = I, b = 0). Adding one vector to every row of [W | b] shifts all
  logits of a sample by the same amount and leaves the NLL unchanged; the fit runs in the subspace
  where the off-diagonal column sums of W and Σ_j b_j are zero, which holds exactly one member of
  each such family (the one with the smallest regulariser). For λ, μ > 0 the regularised optimum
  lies there anyway; without a regulariser (matrix and vector scaling) this picks one canonical
  minimiser among equivalent ones.
* Limited-memory BFGS with an exact line search: calibrated logits are linear in (W, b), so one
  matrix product per iteration gives them along the whole search line and each trial step costs
  only a softmax. The initial inverse-curvature guess is block-wise per row of W, built from the
  feature covariance and the exact curvature of the regulariser.
* The ODIR hyperparameters come from a k-fold (default 3) cross-validated NLL over a (λ, μ) grid
  (default {1e−2, …, 1e4} each, as in the paper). The objective is strictly convex for λ, μ > 0, so where a
  fit starts changes only its speed: the search walks the grid from the strongest regularisation
  to the weakest, carrying the solution and the curvature memory from one grid point to the next
  (the regulariser's curvature is known exactly, so stored curvature pairs are re-targeted to each
  new (λ, μ)). The chosen (λ, μ) is then refitted on the whole calibration split, starting from
  the last fold's solution there.
* With many classes most of that sweep is spent on grid points that are nowhere near the best
  (weak regularisation overfits, and its fits converge slowly). Screening sweeps the grid with
  loose fits instead, each with a predicted error of its held-out NLL, and fits to the full CV
  tolerance only the points whose screened value minus a safety margin could still beat the best;
  the chosen point's value and the final refit are those of the exact sweep. Where the margins
  prove unreliable on the problem (a refined value moved by more than half its margin) or a
  refinement fit hits its iteration cap, the exact sweep runs instead.

Cancellation and progress:

* Every iteration of every fit checks for cancellation (:func:`nctv.memory.check_cancelled`, the
  app's Stop), so a cancelled fit ends within one iteration (milliseconds on 100 classes).
* A ``callback`` (a setting of every calibrator here) gets one dict per report. Work is counted
  in fits: one per (fold, grid point) of the ODIR cross-validation and one for the final fit.

  - After each cross-validation fit (ODIR): ``stage`` ("screening", "refining" or
    "cross-validation" for the exact sweep), ``fold`` and ``folds`` (from 1), ``candidate`` and
    ``candidates`` (the grid point within this fold's sweep, from 1), ``lambda``, ``mu`` and
    ``held_out_nll`` (of this fold).
  - At the start and after each iteration of a single fit: ``stage`` ("fit" for matrix and vector
    scaling, "refit" for the final ODIR fit, which also carries ``lambda`` and ``mu``),
    ``iteration``, ``max_iter``, ``loss`` (the objective) and ``gradient`` (its largest entry).
  - Last, once the calibrator is fitted: ``stage`` "done".
  - Always: ``fits`` (done), ``total_fits`` (the current estimate of all the fit needs; it may
    grow: screening's refinement counts as a share ``_EXPECTED_REFINED`` of the grid until its real
    size is known, and a selection that falls back to the exact sweep adds that sweep),
    ``fraction`` (estimated share of the work done, never decreasing; within a single fit the
    larger of its iterations over ``max_iter`` and its gradient's way down to the tolerance on a
    log scale), ``seconds`` (since the fit began) and ``seconds_left`` (the elapsed time scaled by
    the share left; None until ``_ESTIMATE_AFTER`` of the work is done, as earlier estimates swing
    widely).
"""
from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from nctv.calibration.base import Calibrator, calibration_rows
from nctv.calibration.lbfgs import two_loop
from nctv.checks import as_tensor, check_logits, check_nonnegative, check_whole
from nctv.calibration.deploy import AffineHead
from nctv.memory import check_cancelled

#: The ODIR grid of the paper and of Kull et al. (2019): 1e-2, 1e-1, …, 1e4.
ODIR_GRID = (1e-2, 1e-1, 1e0, 1e1, 1e2, 1e3, 1e4)

# Largest gradient entry at which a fit counts as converged: the final refit, and the
# cross-validation fits (at well-regularised grid points their held-out NLL is then within
# ~1e-6 of the exact optimum's, ample for ranking; 1e-5 would save a third of the iterations but
# leaves errors comparable to the gaps between neighbouring grid points).
_GTOL = 1e-8
_CV_GTOL = 1e-6

# Screening of the (λ, μ) grid (_GridSearch.screened): the gradient tolerance of its fits; a point's
# margin is _SCREEN_SAFETY × the predicted change of its held-out NLL, clipped to
# [_SCREEN_FLOOR, _SCREEN_CAP]; a fit may stop at a gradient of _FAR_GTOL when its held-out NLL
# lies _FAR_GAP above the fold's best so far (its margin is then at least _FAR_GAP). "auto" screens
# from _SCREEN_MIN_CLASSES classes on: below, the fits are cheap and screening saved nothing in
# measurements on 10- and 20-class logits.
_SCREEN_GTOL = 1e-4
_SCREEN_SAFETY = 10.0
_SCREEN_FLOOR = 1e-3
_SCREEN_CAP = 0.1
_FAR_GTOL = 1e-3
_FAR_GAP = 0.02
_SCREEN_MIN_CLASSES = 30
# Share of the grid points that screening is expected to refine (5–6 of 49 in the measurements
# above), counted in the progress estimate before the refinement's real number is known.
_EXPECTED_REFINED = 0.12
# Share of the work done before the progress reports estimate the time left.
_ESTIMATE_AFTER = 0.02


# --------------------------------------------------------------------------------------------
# The affine problem
# --------------------------------------------------------------------------------------------


class _AffineProblem:
    """Mean NLL + Σ C∘Θ² for calibrated logits that are linear in the parameters Θ.

    ``diagonal=False``: Θ = [W | b] of shape (K, K+1), logits = [φ(z), 1]·Θᵀ.
    ``diagonal=True``:  Θ = [w; b] of shape (2, K),  logits = φ(z)·diag(w) + b.
    """

    def __init__(self, features: torch.Tensor, labels: torch.Tensor, diagonal: bool):
        self.n, self.k = features.shape
        self.diagonal = diagonal
        self.labels = labels
        self.x = features if diagonal else torch.cat([features, features.new_ones(self.n, 1)], dim=1)
        self._rows = torch.arange(self.n, device=features.device)
        self._eigh = None

    def identity(self) -> torch.Tensor:
        k, x = self.k, self.x
        if self.diagonal:
            return torch.stack([x.new_ones(k), x.new_zeros(k)])
        return torch.cat([torch.eye(k, dtype=x.dtype, device=x.device), x.new_zeros(k, 1)], dim=1)

    def penalty(self, c_off: float, c_bias: float) -> torch.Tensor:
        """C with Σ C∘Θ² = c_off·Σ_{j≠k} w_jk² + c_bias·Σ_j b_j²."""
        c = torch.zeros_like(self.identity())
        if not self.diagonal:
            c[:, : self.k] = c_off
            c[:, : self.k].fill_diagonal_(0.0)
            c[:, self.k] = c_bias
        return c

    def logits(self, theta: torch.Tensor) -> torch.Tensor:
        if self.diagonal:
            return torch.addcmul(theta[1], self.x, theta[0])
        return self.x @ theta.T

    def label_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.gather(1, self.labels[:, None]).squeeze(1)

    def nll_and_probs(self, logits: torch.Tensor, overwrite: bool = False) -> tuple[float, torch.Tensor]:
        """Mean NLL and softmax probabilities of calibrated logits (one exp pass).

        With ``overwrite`` the probabilities are computed in the memory of ``logits``.
        """
        label = self.label_logits(logits)
        m = logits.amax(1, keepdim=True)
        p = (logits if overwrite else logits.clone()).sub_(m).exp_()
        s = p.sum(1, keepdim=True)
        p.div_(s)
        return float((m.squeeze(1) + s.squeeze(1).log_() - label).mean()), p

    def nll_gradient(self, p: torch.Tensor) -> torch.Tensor:
        """Gradient of the mean NLL w.r.t. Θ; overwrites ``p`` (the softmax probabilities)."""
        p[self._rows, self.labels] -= 1.0
        if self.diagonal:
            return torch.stack([(p * self.x).sum(0), p.sum(0)]) / self.n
        return (p.T @ self.x) / self.n

    def project(self, g: torch.Tensor) -> torch.Tensor:
        """Orthogonal projection onto S = {off-diagonal column sums of W = 0, Σ_j b_j = 0}."""
        g = g.clone()
        if self.diagonal:
            g[1] -= g[1].mean()
            return g
        k = self.k
        w = g[:, :k]
        diag = w.diagonal().clone()
        w -= ((w.sum(0) - diag) / (k - 1))[None, :]
        w.diagonal().copy_(diag)
        g[:, k] -= g[:, k].mean()
        return g

    def curvature(self, p: torch.Tensor) -> torch.Tensor:
        """The data part of :meth:`preconditioner` at probabilities ``p`` (one product of size N·K²)."""
        curv = p * (1.0 - p)
        if self.diagonal:
            return torch.stack([(curv * self.x * self.x).sum(0), curv.sum(0)]) / self.n
        if self._eigh is None:
            self._eigh = torch.linalg.eigh((self.x.T @ self.x) / self.n)
            self._x_rot_sq = (self.x @ self._eigh[1]) ** 2
        return (curv.T @ self._x_rot_sq) / self.n

    def preconditioner(self, h: torch.Tensor, c_off: float, c_bias: float):
        """An approximate inverse Hessian, as a function q ↦ H₀q, from :meth:`curvature` ``h``.

        Vector scaling: the inverse of the exact Hessian diagonal. Full W: each row k of [W | b]
        gets its own block, the NLL curvature E[p_k(1 − p_k)·x xᵀ] (x = [φ(z), 1]) taken diagonal
        in the eigenbasis of E[x xᵀ] (so correlated features, e.g. log-probabilities, are
        decorrelated), plus the exact curvature 2·diag(C_k) of the regulariser; the block is
        inverted in that basis with a rank-2 correction (the unpenalised diagonal entry w_kk and
        the intercept). Directions without any curvature (features that never vary, no
        regulariser) are left alone.
        """
        if self.diagonal:
            inv = _safe_reciprocal(h, 0.0)
            return lambda q: q * inv
        k = self.k
        u = self._eigh[1]
        c = 2.0 * c_off
        inv = _safe_reciprocal(h + c, c)
        # G_k⁻¹ e_k and G_k⁻¹ e_bias for every row k, where G_k = U diag(h_k + c) Uᵀ.
        e_diag = (u[:k, :] * inv) @ u.T
        e_bias = (u[k, :][None, :] * inv) @ u.T
        rows = torch.arange(k, device=h.device)
        gm = torch.stack(
            [torch.stack([e_diag[rows, rows], e_diag[:, k]], 1), torch.stack([e_bias[rows, rows], e_bias[:, k]], 1)], 1
        )
        # Woodbury for G_k + E S Eᵀ, E = [e_k, e_bias], S = diag(−c, 2c_bias − c): the block's
        # true penalty is 0 on w_kk and 2c_bias on b_k instead of c.
        s = torch.tensor([-c, 2.0 * c_bias - c], dtype=h.dtype, device=h.device)
        eye = torch.eye(2, dtype=h.dtype, device=h.device)
        small = torch.linalg.solve(eye + s[None, :, None] * gm, torch.diag(s).expand(k, 2, 2))

        def apply(q: torch.Tensor) -> torch.Tensor:
            r = ((q @ u) * inv) @ u.T
            z = (small @ torch.stack([r[rows, rows], r[:, k]], 1)[:, :, None]).squeeze(2)
            return r - z[:, :1] * e_diag - z[:, 1:] * e_bias

        return apply


def _safe_reciprocal(h: torch.Tensor, floor: float) -> torch.Tensor:
    """1/h, with 0 where h is negligible (only possible when no regulariser sets a ``floor``)."""
    if floor > 0:
        return 1.0 / h
    return torch.where(h > 1e-12 * float(h.max()), 1.0 / h, torch.zeros_like(h))


class _Point:
    """A parameter Θ with its calibrated logits, mean NLL and projected NLL gradient, so that a
    fit starting from the end of another on the same problem needs no product to begin."""

    __slots__ = ("theta", "logits", "nll", "g_nll", "curv", "updates")

    def __init__(self, theta, logits, nll, g_nll, curv=None, updates=0):
        self.theta, self.logits, self.nll, self.g_nll, self.curv, self.updates = theta, logits, nll, g_nll, curv, updates

    @classmethod
    def at(cls, problem: _AffineProblem, theta: torch.Tensor) -> "_Point":
        logits = problem.logits(theta)
        nll, p = problem.nll_and_probs(logits)
        curv = problem.curvature(p)
        return cls(theta, logits, nll, problem.project(problem.nll_gradient(p)), curv)


# Logits carried from fit to fit are refreshed from Θ after this many updates (rounding drift).
_REFRESH = 500


# --------------------------------------------------------------------------------------------
# L-BFGS with an exact line search, reusable across regularisers
# --------------------------------------------------------------------------------------------


class _Memory:
    """L-BFGS curvature pairs that survive a change of the quadratic regulariser.

    Pairs are stored as (s, y_nll), the gradient change of the NLL part only; the regulariser's
    curvature is exactly 2C, so for the current C the pair is (s, y_nll + 2C∘s).
    """

    def __init__(self, size: int = 20):
        self.size = size
        self.s: list[torch.Tensor] = []
        self.y_nll: list[torch.Tensor] = []
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def retarget(self, coef: torch.Tensor) -> None:
        self._coef = coef.flatten()
        self._pairs = []
        for s, yn in zip(self.s, self.y_nll):
            self._add(s, yn)

    def _add(self, s: torch.Tensor, y_nll: torch.Tensor) -> None:
        y = torch.addcmul(y_nll, self._coef, s, value=2.0)
        sy = torch.dot(s, y)
        if float(sy) > 0:
            self._pairs.append((s, y, 1.0 / sy))

    def push(self, s: torch.Tensor, y_nll: torch.Tensor) -> None:
        s, y_nll = s.flatten(), y_nll.flatten()
        self.s.append(s)
        self.y_nll.append(y_nll)
        self._add(s, y_nll)
        if len(self.s) > self.size:
            drop = self.s.pop(0)
            self.y_nll.pop(0)
            if self._pairs and self._pairs[0][0] is drop:
                self._pairs.pop(0)

    def snapshot(self) -> "_Memory":
        """An independent copy (pairs are never modified in place, so sharing them is safe)."""
        copy = _Memory(self.size)
        copy.s, copy.y_nll = list(self.s), list(self.y_nll)
        return copy

    def clear(self) -> None:
        self.s, self.y_nll, self._pairs = [], [], []

    def direction(self, g: torch.Tensor, precond, project) -> torch.Tensor:
        """−H·g for the current pairs, with H₀ = P·precond·P (P: projection onto S)."""
        return two_loop(g.flatten(), self._pairs, lambda q: project(precond(q.view_as(g))).flatten()).view_as(g)


class _FitResult:
    def __init__(self, theta, objective, n_iter, converged, point=None, step=None, stopped_early=False):
        self.theta, self.objective, self.n_iter, self.converged = theta, objective, n_iter, converged
        #: Whether ``early_stop`` ended the fit (converged only at its looser tolerance).
        self.stopped_early = stopped_early
        #: The end of the fit with its logits and gradient, to start another fit from.
        self.point = point
        #: The quasi-Newton step −H·g at the end (the predicted remaining way to the optimum), if asked.
        self.step = step


def _minimise(
    problem: _AffineProblem,
    start: torch.Tensor | _Point,
    c_off: float = 0.0,
    c_bias: float = 0.0,
    memory: _Memory | None = None,
    max_iter: int = 1000,
    gtol: float = _GTOL,
    exact: bool = True,
    predict: bool = False,
    early_stop: tuple[float, Callable[[torch.Tensor], bool]] | None = None,
    on_iteration: Callable[[int, float, float], None] | None = None,
) -> _FitResult:
    """Minimise mean NLL + c_off·Σ_{j≠k} w_jk² + c_bias·Σ b_j² starting from ``start``.

    ``start`` is a Θ in S (the identity is, and so is every result of this function) or the
    ``point`` of an earlier result on the same problem (then the fit begins without any product
    of size N·K²). With ``exact`` the reported objective is recomputed from fresh logits;
    otherwise it is the running value. With ``predict`` the result carries the quasi-Newton step
    at the end. ``early_stop = (tol, stop)``: the first time the gradient is ≤ tol, ``stop(Θ)`` is
    asked whether that is close enough (then the fit ends there, converged at that tolerance).
    ``on_iteration(n_iter, objective, largest gradient entry)`` hears of the start and of every
    iteration. Each iteration first checks for cancellation.

    Converged means the largest entry of the (projected) gradient is ≤ ``gtol``, or that an exact
    line search can no longer lower the objective in float64.
    """
    memory = memory if memory is not None else _Memory()
    if not isinstance(start, _Point) or start.updates > _REFRESH:
        start = _Point.at(problem, start.theta if isinstance(start, _Point) else start)
    elif start.curv is None:
        # Curvature for the preconditioner at the start (one product; the logits are known).
        start.curv = problem.curvature(problem.nll_and_probs(start.logits)[1])
    theta, logits, nll, g_nll, updates = start.theta, start.logits.clone(), start.nll, start.g_nll, start.updates
    coef = problem.penalty(c_off, c_bias)
    precond = problem.preconditioner(start.curv, c_off, c_bias)
    memory.retarget(coef)
    g = g_nll + 2.0 * coef * theta
    f = nll + float((coef * theta * theta).sum())
    converged = stopped_early = False
    n_iter = 0
    while True:
        check_cancelled()
        gmax = float(g.abs().max())
        if on_iteration is not None:
            on_iteration(n_iter, f, gmax)
        if gmax <= gtol:
            converged = True
            break
        if early_stop is not None and gmax <= early_stop[0]:
            if early_stop[1](theta):
                converged = stopped_early = True
                break
            early_stop = None
        if n_iter >= max_iter:
            break
        n_iter += 1
        d = memory.direction(g, precond, problem.project)
        slope = float((g * d).sum())
        if not slope < 0:  # curvature memory gone stale: restart from the preconditioned gradient
            memory.clear()
            d = -problem.project(precond(g))
            slope = float((g * d).sum())
        dlogits = problem.logits(d)
        step = _line_search(problem, logits, dlogits, theta, d, coef, f, slope)
        if step is None:
            converged = True  # no representable decrease left along a descent direction
            break
        alpha, f, nll, p = step
        theta = theta + alpha * d
        logits.add_(dlogits, alpha=alpha)
        updates += 1
        g_nll_new = problem.project(problem.nll_gradient(p))
        memory.push(alpha * d, g_nll_new - g_nll)
        g_nll = g_nll_new
        g = g_nll + 2.0 * coef * theta
    point = _Point(theta, logits, nll, g_nll, start.curv if n_iter == 0 else None, updates)
    objective = f
    if exact:  # the objective from freshly computed logits, free of accumulated updates
        objective = problem.nll_and_probs(problem.logits(theta), overwrite=True)[0] + float((coef * theta * theta).sum())
    step = None
    if predict:
        step = memory.direction(g, precond, problem.project) if float(g.abs().max()) > 0 else torch.zeros_like(g)
    return _FitResult(theta, objective, n_iter, converged, point, step, stopped_early)


def _line_search(problem, logits, dlogits, theta, d, coef, f0, slope, c1=1e-4, c2=0.1, max_trials=40):
    """Strong-Wolfe step along d by safeguarded Newton on φ(α) = objective(Θ + α·d).

    φ is convex and smooth; φ' and φ'' come from one softmax per trial, far cheaper than the
    matrix products of an iteration, so the search is nearly exact (c2 = 0.1), which saves
    iterations. Returns (α, φ(α), mean NLL at α, probabilities at α), or None when no step lowers
    the objective.
    """
    dy = problem.label_logits(dlogits)
    reg0 = float((coef * theta * theta).sum())
    reg1 = 2.0 * float((coef * theta * d).sum())
    reg2 = float((coef * d * d).sum())
    lo, hi, alpha = 0.0, math.inf, 1.0
    best = None
    for _ in range(max_trials):
        nll, p = problem.nll_and_probs(torch.add(logits, dlogits, alpha=alpha), overwrite=True)
        pd_terms = p * dlogits
        pd = pd_terms.sum(1)
        dphi = float((pd - dy).mean()) + reg1 + 2.0 * alpha * reg2
        phi = nll + reg0 + alpha * reg1 + alpha * alpha * reg2
        armijo = phi <= f0 + c1 * alpha * slope
        if armijo and phi < f0 and (best is None or phi < best[1]):
            best = (alpha, phi, nll, p)
            if abs(dphi) <= c2 * abs(slope):
                return best
        d2phi = float((pd_terms.mul_(dlogits).sum(1) - pd * pd).mean()) + 2.0 * reg2
        if dphi > 0 or not armijo:
            hi = alpha
        else:
            lo = alpha
        nxt = alpha - dphi / d2phi if d2phi > 0 else math.nan
        if math.isfinite(hi):
            if not lo < nxt < hi:
                nxt = 0.5 * (lo + hi)
            if hi - lo <= 1e-15 * hi:
                break
        elif not (math.isfinite(nxt) and nxt > alpha):
            nxt = 2.0 * alpha
        else:
            nxt = min(nxt, 10.0 * alpha)
        alpha = nxt
    return best


# --------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------


class _Progress:
    """Progress of one calibrator's fit: the dicts of its ``callback`` (see the module notes) and
    its tqdm bar, one step per fit."""

    def __init__(self, callback: Callable[[dict], Any] | None, desc: str, enabled: bool):
        self.callback = callback
        self.bar = tqdm(total=1, desc=desc, disable=not enabled)
        self.start = time.perf_counter()
        self.fits = 0
        self.planned = 1  # the final fit
        self.expected = 0  # fits foreseen but not planned yet
        self.fraction = 0.0

    def plan(self, fits: int, expected: int = 0) -> None:
        """``fits`` more fits to run; ``expected`` replaces the count of foreseen ones."""
        self.planned += fits
        self.expected = expected
        self.bar.total += fits

    def fitted(self, **info: Any) -> None:
        """One fit of the plan is done."""
        self.fits += 1
        self.bar.update()
        self._send(info, 0.0)

    def iterations(self, max_iter: int, gtol: float, **info: Any) -> Callable[[int, float, float], None] | None:
        """An ``on_iteration`` for :func:`_minimise` that reports each iteration of one fit (None
        without a callback)."""
        if self.callback is None:
            return None
        first: list[float] = []

        def report(n_iter: int, objective: float, gmax: float) -> None:
            if not first:
                first.append(gmax)
            g0 = first[0]
            by_gradient = math.log(g0 / gmax) / math.log(g0 / gtol) if gtol < gmax < g0 else 0.0
            within = min(max(n_iter / max_iter, by_gradient), 1.0)
            self._send({**info, "iteration": n_iter, "max_iter": max_iter, "loss": objective, "gradient": gmax},
                       within)

        return report

    def _send(self, info: dict, within: float) -> None:
        if self.callback is None:
            return
        total = self.planned + self.expected
        self.fraction = max(self.fraction, min((self.fits + within) / total, 1.0))
        seconds = time.perf_counter() - self.start
        left = seconds * (1.0 - self.fraction) / self.fraction if self.fraction >= _ESTIMATE_AFTER else None
        self.callback({**info, "fits": self.fits, "total_fits": total, "fraction": self.fraction,
                       "seconds": seconds, "seconds_left": left})

    def done(self) -> None:
        """The final fit is done: the last report (stage "done"), and the bar closes."""
        self.fitted(stage="done")
        self.bar.close()


# --------------------------------------------------------------------------------------------
# Calibrators
# --------------------------------------------------------------------------------------------


def odir_penalty(weight: Any, bias: Any, lam: float, mu: float) -> float:
    """The ODIR regulariser λ/(K(K−1))·Σ_{j≠k} w_jk² + μ/K·Σ_j b_j² of a K×K weight and K-vector bias."""
    w = as_tensor(weight, dtype=torch.float64)
    b = as_tensor(bias, dtype=torch.float64, device=w.device)
    k = w.shape[0]
    off = w - torch.diag(torch.diagonal(w))
    return float(lam / (k * (k - 1)) * (off * off).sum() + mu / k * (b * b).sum())


def _check_grid(values: Any, name: str) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray, torch.Tensor)):
        raise ValueError(f"{name} must be a sequence of numbers >= 0, such as {ODIR_GRID}; got {values!r}.")
    grid = tuple(check_nonnegative(v, name) for v in values)
    if not grid:
        raise ValueError(f"{name} is empty; give at least one value, such as {ODIR_GRID}.")
    if len(set(grid)) != len(grid):
        raise ValueError(f"{name} lists a value twice; give distinct values.")
    return grid


def stratified_folds(labels: Any, n_folds: int, seed: int = 0) -> np.ndarray:
    """Fold index (0..n_folds−1) per sample: each class is shuffled (seeded) and dealt round-robin.

    Fold sizes differ by at most one, and every class is spread as evenly as its size allows.
    """
    y = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels).astype(np.int64)
    n_folds = check_whole(n_folds, "n_folds", 2)
    if n_folds > len(y):
        raise ValueError(f"n_folds = {n_folds} exceeds the {len(y)} samples; use fewer folds.")
    perm = np.random.default_rng(seed).permutation(len(y))
    order = perm[np.argsort(y[perm], kind="stable")]
    folds = np.empty(len(y), dtype=np.int64)
    folds[order] = np.arange(len(y)) % n_folds
    return folds


class _AffineCalibrator(Calibrator):
    """Shared fit/transform of ``W·φ(z) + b``; subclasses set the structure and the regulariser."""

    _diagonal = False
    _dirichlet = False

    def _features(self, z: torch.Tensor) -> torch.Tensor:
        z = z.to(torch.float64)
        return torch.log_softmax(z, dim=1) if self._dirichlet else z

    def _store(self, problem: _AffineProblem, result: _FitResult) -> None:
        theta, k = result.theta, problem.k
        if problem.diagonal:
            self.weight_, self.bias_ = torch.diag(theta[0]), theta[1].clone()
        else:
            self.weight_, self.bias_ = theta[:, :k].clone(), theta[:, k].clone()
        self.objective_ = result.objective
        self.n_iter_ = result.n_iter
        self.converged_ = result.converged
        if not result.converged:
            warnings.warn(
                f"{type(self).__name__}: the fit stopped after {result.n_iter} iterations before converging "
                "(separable calibration data have no finite unregularised optimum); the result is usable but "
                "not the exact optimum. The regularised MS-ODIR and Dir-ODIR avoid this; in Python, max_iter "
                "sets the limit.",
                stacklevel=3,
            )

    def transform(self, logits: Any) -> torch.Tensor:
        """Calibrated logits W·φ(z) + b (float32, on the device of ``logits``)."""
        self._check_fitted("weight_", "bias_")
        z = check_logits(logits)
        k = self.weight_.shape[0]
        if z.shape[1] != k:
            raise ValueError(f"logits have {z.shape[1]} classes but the calibrator was fitted on {k}; they must match.")
        w, b = self.weight_.to(z.device), self.bias_.to(z.device)
        return torch.addmm(b, self._features(z), w.T).to(torch.float32)

    def as_module(self) -> torch.nn.Module:
        self._check_fitted("weight_", "bias_")
        return AffineHead(self.weight_, self.bias_, dirichlet=self._dirichlet)


class _UnregularisedAffine(_AffineCalibrator):
    def __init__(self, max_iter: int = 1000, callback: Callable[[dict], Any] | None = None):
        self.max_iter = max_iter
        self.callback = callback

    def fit(self, logits: Any, labels: Any) -> "_UnregularisedAffine":
        max_iter = check_whole(self.max_iter, "max_iter", 1)
        z, y = calibration_rows(logits, labels)
        problem = _AffineProblem(self._features(z), y, self._diagonal)
        progress = _Progress(self.callback, type(self).__name__, False)
        fit = _minimise(problem, problem.identity(), max_iter=max_iter,
                        on_iteration=progress.iterations(max_iter, _GTOL, stage="fit"))
        self._store(problem, fit)
        progress.done()
        return self


class VectorScaling(_UnregularisedAffine):
    """Vector scaling (Guo et al. 2017): diag(w)·z + b, fitted by mean NLL without a regulariser.

    ``weight_`` is the K×K diagonal matrix diag(w), ``bias_`` the K-vector b (float64), normalised
    so that Σ_j b_j = 0 (adding one constant to every logit changes no probability).
    ``converged_`` and ``n_iter_`` describe the fit; it stops after ``max_iter`` iterations.
    ``callback`` (optional) gets a dict per iteration (stage "fit"; see the module notes).
    """

    _diagonal = True


class MatrixScaling(_UnregularisedAffine):
    """Matrix scaling (Guo et al. 2017): W·z + b, fitted by mean NLL without a regulariser.

    With K² + K parameters it overfits small calibration sets (the paper's point). When the
    calibration data are separable the unregularised NLL has no finite minimiser and the fit
    stops after ``max_iter`` iterations (``converged_`` is then False). Of the equivalent
    minimisers the one whose off-diagonal column sums of W and Σ_j b_j are zero is returned.
    ``callback`` (optional) gets a dict per iteration (stage "fit"; see the module notes).
    """


class _ODIR(_AffineCalibrator):
    def __init__(
        self,
        lambdas: Sequence[float] = ODIR_GRID,
        mus: Sequence[float] = ODIR_GRID,
        n_folds: int = 3,
        seed: int = 0,
        max_iter: int = 1000,
        cv_max_iter: int = 100,
        progress: bool = False,
        screen: bool | str = "auto",
        callback: Callable[[dict], Any] | None = None,
    ):
        self.lambdas = lambdas
        self.mus = mus
        self.n_folds = n_folds
        self.seed = seed
        self.max_iter = max_iter
        self.cv_max_iter = cv_max_iter
        self.progress = progress
        self.screen = screen
        self.callback = callback

    def fit(self, logits: Any, labels: Any) -> "_ODIR":
        lambdas = _check_grid(self.lambdas, "lambdas")
        mus = _check_grid(self.mus, "mus")
        max_iter = check_whole(self.max_iter, "max_iter", 1)
        cv_max_iter = check_whole(self.cv_max_iter, "cv_max_iter", 1)
        if not (self.screen is True or self.screen is False or self.screen == "auto"):
            raise ValueError(f"screen must be True, False or 'auto'; got {self.screen!r}.")
        z, y = calibration_rows(logits, labels)
        k = z.shape[1]
        folds = torch.as_tensor(stratified_folds(y, self.n_folds, self.seed), device=z.device)
        x = self._features(z)
        progress = _Progress(self.callback, type(self).__name__, self.progress)
        search = _GridSearch(x, y, folds, int(self.n_folds), lambdas, mus, cv_max_iter, progress)
        screen = self.screen if self.screen != "auto" else k >= _SCREEN_MIN_CLASSES
        selection = search.screened() if screen else None
        self.screened_ = selection is not None
        if selection is None:
            selection = search.exact()
        self.cv_nll_, self.cv_converged_, self.cv_refined_, best, (start, start_memory) = selection
        self.lambda_, self.mu_ = lambdas[best[0]], mus[best[1]]
        if not self.cv_converged_[best]:
            warnings.warn(
                f"{type(self).__name__}: some cross-validation fits at the chosen lambda={self.lambda_:g}, "
                f"mu={self.mu_:g} stopped after {cv_max_iter} iterations before converging, so the selection "
                "may be slightly off (in Python, cv_max_iter sets the limit).",
                stacklevel=2,
            )
        problem = _AffineProblem(x, y, diagonal=False)
        report = progress.iterations(max_iter, _GTOL, stage="refit", **{"lambda": self.lambda_, "mu": self.mu_})
        self._store(problem, _minimise(problem, start, *search.coefs[best], memory=start_memory, max_iter=max_iter,
                                       on_iteration=report))
        progress.done()
        return self


class _GridSearch:
    """The k-fold cross-validated held-out NLL of the ODIR fits over the (λ, μ) grid.

    Both selections return (cv NLL, converged, refined, chosen (i, j), (Θ, memory) to start the
    final refit from); see :meth:`exact` and :meth:`screened`.
    """

    def __init__(self, x, y, folds, n_folds, lambdas, mus, cv_max_iter, progress: _Progress):
        self.x, self.y, self.folds, self.n_folds = x, y, folds, n_folds
        self.n, k = x.shape
        self.lambdas, self.mus, self.cv_max_iter, self.progress = lambdas, mus, cv_max_iter, progress
        self.shape = (len(lambdas), len(mus))
        self.coefs = {(i, j): (lam / (k * (k - 1)), mu / k) for i, lam in enumerate(lambdas) for j, mu in enumerate(mus)}
        # Strongest regularisation first (closest to the identity start), then a serpentine walk
        # so that consecutive grid points differ in one hyperparameter by one step.
        li = sorted(range(len(lambdas)), key=lambda i: -lambdas[i])
        mj = sorted(range(len(mus)), key=lambda j: -mus[j])
        self.path = [(i, j) for r, i in enumerate(li) for j in (mj if r % 2 == 0 else mj[::-1])]
        # Grid coordinates of each point in sorted order, for "nearest kept solution" look-ups.
        self.rank = {ij: (li.index(ij[0]), mj.index(ij[1])) for ij in self.path}

    def fold(self, fold: int) -> tuple[_AffineProblem, _AffineProblem]:
        held = self.folds == fold
        return (_AffineProblem(self.x[~held], self.y[~held], diagonal=False),
                _AffineProblem(self.x[held], self.y[held], diagonal=False))

    def fitted(self, stage: str, fold: int, candidate: int, candidates: int, ij: tuple[int, int],
               held_nll: float) -> None:
        self.progress.fitted(stage=stage, fold=fold + 1, folds=self.n_folds, candidate=candidate + 1,
                             candidates=candidates, held_out_nll=held_nll,
                             **{"lambda": self.lambdas[ij[0]], "mu": self.mus[ij[1]]})

    def choose(self, cv_nll: np.ndarray, refined: np.ndarray) -> tuple[int, int]:
        """The refined grid point of least CV NLL; ties go to the larger λ, then the larger μ."""
        return min((ij for ij in self.path if refined[ij]),
                   key=lambda ij: (cv_nll[ij], -self.lambdas[ij[0]], -self.mus[ij[1]]))

    def exact(self):
        """Every grid point on every fold to the CV tolerance, warm-started along the path (with the
        curvature memory carried over)."""
        self.progress.plan(self.n_folds * len(self.path))
        cv_sum = np.zeros(self.shape)
        converged = np.ones(self.shape, dtype=bool)
        best_sum = math.inf
        for fold in range(self.n_folds):
            train, test = self.fold(fold)
            point, memory = train.identity(), _Memory()
            for c, ij in enumerate(self.path):
                fit = _minimise(train, point, *self.coefs[ij], memory=memory, max_iter=self.cv_max_iter,
                                gtol=_CV_GTOL, exact=False)
                point = fit.point
                held_nll = _held_out(test, fit.theta)[0]
                cv_sum[ij] += held_nll * test.n
                converged[ij] &= fit.converged
                if fold == self.n_folds - 1 and cv_sum[ij] < best_sum:
                    # The best complete grid point so far: this fold's state there is a close
                    # start for the final refit (only speed depends on the start).
                    best_sum, start = cv_sum[ij], (fit.theta, memory.snapshot())
                self.fitted("cross-validation", fold, c, len(self.path), ij, held_nll)
        cv_nll, refined = cv_sum / self.n, np.ones(self.shape, dtype=bool)
        return cv_nll, converged, refined, self.choose(cv_nll, refined), start

    def screened(self):
        """The selection of :meth:`exact` with most of its work skipped, or None where the shortcut
        cannot be trusted (then the caller runs :meth:`exact`).

        1. Sweep: the path of :meth:`exact`, but each fit stops at a loose tolerance, and records
           how far its held-out NLL is predicted to move on the way to the optimum (held-out
           gradient · quasi-Newton step); a fit whose held-out NLL lies far above the fold's best
           so far stops at a looser one still. The margin of a point is a multiple of that
           prediction (clipped), and at least the far gap for a point that stopped as far off
           (such a fit stops on its way from a stronger regularisation towards its own optimum,
           where the held-out NLL usually keeps rising: its screened value is then an
           underestimate, the safe side for ruling it out); a point whose fit stopped at
           ``cv_max_iter`` gets the widest margin.
        2. Refinement: every point whose screened value minus its margin does not exceed the best
           upper bound (a refined value, or a screened value plus its margin) is fitted on every
           fold to the CV tolerance, from the nearest kept screening solution, until none is left.

        Gives up (None) when a refinement fit stops at ``cv_max_iter`` (its value then depends on
        where it started) or a refined value moved by more than half its margin (the margins are
        then not trusted on this problem).
        """
        self.progress.plan(self.n_folds * len(self.path),
                           expected=self.n_folds * math.ceil(_EXPECTED_REFINED * len(self.path)))
        cv_sum, error_sum = np.zeros(self.shape), np.zeros(self.shape)
        far_off = np.zeros(self.shape, dtype=bool)
        converged = np.ones(self.shape, dtype=bool)
        kept: list[list[tuple[float, tuple[int, int], torch.Tensor]]] = []
        for fold in range(self.n_folds):
            train, test = self.fold(fold)
            point, memory, store, fold_best = train.identity(), _Memory(), [], math.inf

            def far(theta: torch.Tensor) -> bool:
                return _held_out(test, theta)[0] > fold_best + _FAR_GAP

            for c, ij in enumerate(self.path):
                fit = _minimise(train, point, *self.coefs[ij], memory=memory, max_iter=self.cv_max_iter,
                                gtol=_SCREEN_GTOL, exact=False, predict=True, early_stop=(_FAR_GTOL, far))
                point = fit.point
                held_nll, held_grad = _held_out(test, fit.theta, gradient=True)
                cv_sum[ij] += held_nll * test.n
                error_sum[ij] += abs(float((held_grad * fit.step).sum())) * test.n
                far_off[ij] |= fit.stopped_early
                converged[ij] &= fit.converged
                fold_best = min(fold_best, held_nll)
                _keep_best(store, (held_nll, ij, fit.theta))
                self.fitted("screening", fold, c, len(self.path), ij, held_nll)
            kept.append(store)
            del train, test, point, memory

        screened = cv_sum / self.n
        margin = np.clip(_SCREEN_SAFETY * error_sum / self.n, _SCREEN_FLOOR, _SCREEN_CAP)
        margin[far_off] = np.maximum(margin[far_off], _FAR_GAP)
        margin[~converged] = _SCREEN_CAP
        cv_nll = screened.copy()
        refined = np.zeros(self.shape, dtype=bool)
        starts: dict[tuple[int, int], tuple[torch.Tensor, _Memory]] = {}
        while True:
            bound = np.where(refined, cv_nll, screened + margin).min()
            todo = [ij for ij in self.path if not refined[ij] and screened[ij] - margin[ij] <= bound]
            if not todo:
                break
            self.progress.plan(self.n_folds * len(todo))
            sums = dict.fromkeys(todo, 0.0)
            for fold in range(self.n_folds):
                train, test = self.fold(fold)
                for c, ij in enumerate(todo):
                    near = min(kept[fold], key=lambda item: _grid_distance(self.rank[item[1]], self.rank[ij]))
                    memory = _Memory()
                    fit = _minimise(train, near[2], *self.coefs[ij], memory=memory, max_iter=self.cv_max_iter,
                                    gtol=_CV_GTOL, exact=False)
                    if not fit.converged:
                        return None
                    held_nll = _held_out(test, fit.theta)[0]
                    sums[ij] += held_nll * test.n
                    if fold == self.n_folds - 1:
                        starts[ij] = (fit.theta, memory)
                    self.fitted("refining", fold, c, len(todo), ij, held_nll)
                del train, test
            for ij in todo:
                cv_nll[ij], refined[ij], converged[ij] = sums[ij] / self.n, True, True
                if abs(cv_nll[ij] - screened[ij]) > 0.5 * margin[ij]:
                    return None
        best = self.choose(cv_nll, refined)
        return cv_nll, converged, refined, best, starts[best]


def _held_out(problem: _AffineProblem, theta: torch.Tensor, gradient: bool = False):
    """Mean NLL of a held-out fold at Θ, and its projected gradient w.r.t. Θ if asked."""
    nll, p = problem.nll_and_probs(problem.logits(theta), overwrite=True)
    return nll, problem.project(problem.nll_gradient(p)) if gradient else None


def _keep_best(store: list, item: tuple, size: int = 8) -> None:
    """Keep the ``size`` items with the lowest first entry (the held-out NLL)."""
    store.append(item)
    if len(store) > size:
        store.remove(max(store, key=lambda it: it[0]))


def _grid_distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


_ODIR_DOC = """

    Objective: mean NLL + λ/(K(K−1))·Σ_{j≠k} w_jk² + μ/K·Σ_j b_j² (Kull et al. 2019; see
    :func:`odir_penalty`). λ and μ are chosen from ``lambdas`` × ``mus`` (default {1e−2, 1e−1, …,
    1e4} each) by the pooled held-out mean NLL of ``n_folds``-fold cross-validation on the
    calibration split (folds stratified by label, shuffled with ``seed``; ties go to the larger λ,
    then the larger μ), then the model is refitted on the whole split. the paper leaves k open; the
    default is 3 folds: on 5,000 × 100 synthetic logits it chose the same λ and test NLL as 5 folds
    (to five digits) in about a third of the time (fold count × fold size of the fits, plus slower
    convergence on the larger folds); ``n_folds=5`` is one argument away.

    Cross-validation fits stop when the largest gradient entry is ≤ 1e-6 or after ``cv_max_iter``
    iterations; the final refit stops at ≤ 1e-8 or after ``max_iter``. Weakly regularised grid
    points can need many iterations (they overfit and are rarely chosen); if the chosen point had a
    capped cross-validation fit, a warning says so.

    ``screen`` (default "auto": from 30 classes on) first sweeps the grid with loose fits and then
    fits to the CV tolerance only the grid points that could still hold the minimum (see the
    module notes); it gives up and runs the exact selection when its error margins prove
    unreliable or a refinement fit reaches ``cv_max_iter``. On 5,000 × 100 synthetic logits it
    refitted 5–6 of the 49 points and chose the same (λ, μ) with the same final fit, in about a
    quarter of the time. ``screen=False`` always runs the exact selection.
    Cost grows like N·K² per iteration: K = 100 runs on a CPU, K = 1000 wants the logits on a GPU.
    ``progress`` shows a progress bar over the fits; ``callback`` (optional) gets a dict after
    every cross-validation fit and every iteration of the final fit (see the module notes).

    Learned: ``weight_`` (K×K) and ``bias_`` (K,) as float64 tensors on the logits' device;
    ``lambda_``, ``mu_``; ``cv_nll_`` (len(lambdas) × len(mus) numpy array; rows follow ``lambdas``
    and columns ``mus`` in the order given) and ``cv_converged_`` (same shape, bool: every fold's fit
    converged); ``cv_refined_`` (same shape, bool: the entry comes from fits to the CV tolerance;
    False only for points that screening ruled out, whose entry and convergence are those of the
    loose screening fits) and ``screened_`` (whether the selection was the screened one); ``objective_``, ``n_iter_`` and ``converged_`` of the final fit.
    """


class MatrixScalingODIR(_ODIR):
    __doc__ = "MS-ODIR: matrix scaling W·z + b with the ODIR regulariser." + _ODIR_DOC


class DirichletODIR(_ODIR):
    __doc__ = "Dir-ODIR: Dirichlet calibration W·log softmax(z) + b with the ODIR regulariser." + _ODIR_DOC

    _dirichlet = True
