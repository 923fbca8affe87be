"""The L-BFGS two-loop recursion, shared by the fast Neural Clamping fitter and the affine fits.

Each caller keeps its own curvature pairs and initial inverse Hessian H₀ (block-diagonal scales
for (δ, log T); a preconditioner and a projection for the affine maps); the product with the
inverse Hessian they define is computed here once.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def two_loop(g: torch.Tensor, pairs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | float]],
             apply_h0: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """−H·g for the L-BFGS inverse Hessian H of ``pairs`` (Nocedal & Wright, Algorithm 7.4).

    ``g`` is a flat vector; ``pairs`` are (s, y, ρ = 1/sᵀy), oldest first, flat like ``g``;
    ``apply_h0(q)`` returns H₀·q as a new tensor (it is updated in place). The scalars stay
    tensors, so on an accelerator no pair waits for the host.
    """
    q = g.clone()
    alphas = []
    for s, y, rho in reversed(pairs):
        a = rho * torch.dot(s, q)
        alphas.append(a)
        q.addcmul_(y, a, value=-1.0)
    r = apply_h0(q)
    for (s, y, rho), a in zip(pairs, reversed(alphas)):
        r.addcmul_(s, a - rho * torch.dot(y, r))
    return r.neg_()
