"""The one-dimensional temperature solve shared by temperature scaling, TS (FL), Neural Clamping's
temperature step and the NLL's refinement part (``nctv.metrics.nll_split``): s = log T minimising
the mean focal loss (γ = 0: the NLL). It imports no metric and no calibrator, so that both can use it."""
from __future__ import annotations

import math

import numpy as np
import torch

from nctv.checks import T_MAX, T_MIN

# --------------------------------------------------------------------------------------------
# The temperature solve: TS, TS (FL) and Neural Clamping's temperature step
# --------------------------------------------------------------------------------------------

#: The search range of TS and TS (FL) in s = log T.
LOG_T_BOUNDS = (math.log(T_MIN), math.log(T_MAX))
# For γ > 0 the loss is scanned at this many points per decade of T before the Newton solve.
_SCAN_PER_DECADE = 4


def _focal_in_log_t(d: torch.Tensor, d_y: torch.Tensor, label: torch.Tensor, gamma: float,
                    s: float) -> tuple[float, float, float]:
    """Mean FL_γ of softmax(z·e^{−s}) and its first two derivatives in s, from one exp per logit.

    ``d`` = z − rowmax(z) and ``d_y`` its label column. With u = d·e^{−s}, p_y the label's
    probability, q = 1 − p_y summed over the other classes (so that it stays exact when p_y is
    near 1), L = log p_y, r = L/q, and π the other classes' probabilities renormalised:

        dL/ds = q·w,  w = E_π[u] − u_y;       d²L/ds² = −q·(Var_π[u] + (1 − q)·w² + w)
        FL = −q^γ·L;  dFL/ds = q^{γ+1}·c·w,  c = γ·p_y·r − 1
        d²FL/ds² = q^{γ+1}·(γ·p_y·w²·(2 + r·(q − (γ − 1)·p_y)) − c·(Var_π[u] + (1 − q)·w² + w))

    Every derivative carries q^{γ+1}: a sample whose p_y rounds to 1 adds exactly 0, and nothing
    overflows for γ < 2, where (1 − p_y)^{γ−2} alone would.
    """
    a = math.exp(-s)
    u = d * a
    e = torch.exp(u).scatter_(1, label, 0.0)
    rest = e.sum(1)
    u_y = d_y * a
    e_y = torch.exp(u_y)
    total = rest + e_y
    q, p_y = rest / total, e_y / total
    eu = e.mul_(u)
    mean_u = eu.sum(1) / rest
    others = q > 0
    zero = torch.zeros((), dtype=d.dtype, device=d.device)
    w = torch.where(others, mean_u - u_y, zero)
    var = torch.where(others, (eu.mul_(u).sum(1) / rest - mean_u * mean_u).clamp_min(0.0), zero)
    log_p = torch.where(q < 0.5, torch.log1p(-q), u_y - torch.log(total))
    spread = var + (1.0 - q) * w * w + w
    if gamma == 0:
        f, g, h = -log_p, -q * w, q * spread
    else:
        r = torch.where(others, log_p / q, -torch.ones_like(q))
        c = gamma * p_y * r - 1.0
        weight = q ** (gamma + 1.0)
        f = -(q**gamma) * log_p
        g = weight * c * w
        h = weight * (gamma * p_y * w * w * (2.0 + r * (q - (gamma - 1.0) * p_y)) - c * spread)
    f, g, h = torch.stack([f.mean(), g.mean(), h.mean()]).tolist()
    return f, g, h


def solve_log_temperature(logits: torch.Tensor, labels: torch.Tensor, gamma: float = 0.0,
                          bounds: tuple[float, float] = LOG_T_BOUNDS) -> tuple[float, bool]:
    """s = log T minimising the mean focal loss FL_γ of softmax(z·e^{−s}) over s in ``bounds``.

    Returns ``(s, at_bound)``: ``at_bound`` is True when the loss still decreases at the end of
    the range, and s is then that end. When all logits tie within every row the loss ignores T and
    s = 0 (T = 1). ``logits`` (N, K) and ``labels`` (N,) are checked tensors on one device; the
    solve runs in the logits' dtype (float64, or float32 where a device has no float64) and
    stops at that dtype's resolution in s, i.e. in relative T.

    Where to look (docs/method.md, "Baselines"): the NLL (γ = 0) is convex in 1/T, so it has one
    minimum and the bounds and T = 1 suffice as starting points; FL_γ with γ > 0 need not be,
    so the loss is scanned at 4 points per decade of T and the lowest point taken. From there,
    Newton's method in s: a bracket [a, b] always holds a local minimum (the slope at a points
    towards b, and the slope at b towards a or the loss at b is above the loss at a), a trial
    point replaces a when its loss is no higher and its slope points the same way, b otherwise;
    a Newton step that leaves the bracket or shrinks too slowly is replaced by bisection.
    """
    lo, hi = float(bounds[0]), float(bounds[1])
    if not lo < hi:
        raise ValueError(f"bounds must be (low, high) with low < high; got {bounds!r}.")
    d = logits - logits.amax(1, keepdim=True)
    if not bool((d != 0).any()):
        return min(max(0.0, lo), hi), False
    label = labels.view(-1, 1)
    d_y = d.gather(1, label).squeeze(1)
    eps = torch.finfo(d.dtype).eps

    def at(s: float) -> tuple[float, float, float, float]:
        return (s, *_focal_in_log_t(d, d_y, label, gamma, s))

    if gamma == 0:
        starts = sorted({lo, min(max(0.0, lo), hi), hi})
    else:
        count = math.ceil((hi - lo) / (math.log(10) / _SCAN_PER_DECADE)) + 1
        starts = np.linspace(lo, hi, count).tolist()
    scan = [at(s) for s in starts]
    i = min(range(len(scan)), key=lambda j: scan[j][1])
    a = scan[i]
    if a[2] == 0:  # flat at float resolution; at an end, the loss has saturated on its way there
        return a[0], i in (0, len(scan) - 1)
    j = i + 1 if a[2] < 0 else i - 1  # the neighbour the loss descends towards
    if not 0 <= j < len(scan):
        return a[0], True
    b = scan[j]

    def newton_step(p: tuple[float, float, float, float]) -> float:
        return -p[2] / p[3] if p[3] > 0 else math.inf

    x = min((a, b), key=lambda p: abs(newton_step(p)))  # Newton starts from the end nearer its root
    steps = [abs(b[0] - a[0])] * 2
    for _ in range(200):
        left, right = min(a[0], b[0]), max(a[0], b[0])
        tol = 4 * eps * max(1.0, abs(x[0]))
        if right - left <= tol:
            break
        step = newton_step(x)
        if abs(step) <= tol:  # the Newton step is below the resolution of s: x is the root
            return x[0], False
        if left < x[0] + step < right and abs(step) <= 0.5 * steps[-2]:
            m = x[0] + step
        else:
            m = 0.5 * (left + right)
        steps.append(abs(m - x[0]))
        x = at(m)
        if x[2] == 0:
            return m, False
        if x[1] <= a[1] + 1024 * eps * abs(a[1]) and x[2] * (b[0] - a[0]) < 0:
            a = x
        else:
            b = x
    return a[0], False
