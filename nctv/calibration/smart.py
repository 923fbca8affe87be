"""SMART: a temperature per sample from the gap between its two largest logits.

Sample-margin-aware recalibration of temperature (arXiv 2506.23492; the authors' code,
``Misakaaaaaz/calibench``, ``bench/utils/cali/smart_calibrator.py`` as its ``bench/main.py`` runs it,
decides what the paper leaves open):

    g = z₍₁₎ − z₍₂₎,  x = (g − mean g) / (std g + 1e-8)   (mean and sample std over the calibration split)
    T(x) = softplus(MLP(x)) + 0.1,  calibrated logits z / T(x)

The MLP has ``hidden_layers`` layers of ``hidden_units`` ReLU units (1 → 16 → 16 → 1 by default),
initialised as torch initialises ``nn.Linear`` after ``torch.manual_seed(seed)``. It is trained on the
whole calibration split at once (full batch) with Adam (lr 0.005) on the authors' smooth soft-binned
ECE (their ``SmoothSoftECE(mode="softabs")``): 15 bin centres (m − ½)/15, Gaussian soft assignment
of each confidence (σ = 0.05, each row's weights normalised to sum 1, + 1e-6), per bin
φ(mean confidence − mean accuracy) with φ(r) = √(r² + 10⁻⁶) − 10⁻³, weighted by the bin's share.
Training stops after ``max_epochs`` (2,000) epochs, or once ``patience`` (200) epochs in a row have
not lowered the loss by ``min_delta`` (1e-4) below its best; the network is the one of the last
epoch. (The authors' code means to restore the best epoch's network, but it keeps a shallow copy of
the state dict, whose tensors Adam updates in place, so it too returns the last one.)

T(x) > 0 keeps every prediction. Reproducible: the fit computes in float64 from a seeded start with no
other randomness, and it takes the calibration rows in an order set by their content
(:func:`nctv.canonical.canonical_order`), so the same rows in any order give the same
network, bit for bit (every sum runs over the same sequence).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from nctv.calibration.base import HeadCalibrator
from nctv.canonical import canonical_order
from nctv.checks import (EPOCHS_MAX, LR_MAX, SEED_MAX, check_at_most, check_logits_labels, check_nonnegative,
                         check_positive, check_whole_range, shown)

#: The authors' loss: bins, kernel width, the smoothing δ of |r| and the guard added to sums.
SOFT_BINS, SIGMA, SMOOTHING, GUARD = 15, 0.05, 1e-3, 1e-6
#: The smallest temperature the network gives (the authors' softplus(·) + 0.1).
T_FLOOR = 0.1
#: Largest network a setting may ask for.
MAX_UNITS, MAX_LAYERS = 1024, 16


def gap(z: torch.Tensor) -> torch.Tensor:
    """z₍₁₎ − z₍₂₎ of each row."""
    top2 = torch.topk(z, 2, dim=1).values
    return top2[:, 0] - top2[:, 1]


def network_size(units: int, layers: int) -> int:
    """Numbers in the flat parameter vector of a 1 → units (× layers) → 1 network."""
    return 2 * units + (layers - 1) * (units * units + units) + units + 1


def _unpack(theta: torch.Tensor, units: int, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, bias) of each layer, in order, from the flat vector (views)."""
    shapes = [(units, 1)] + [(units, units)] * (layers - 1) + [(1, units)]
    out, at = [], 0
    for rows, cols in shapes:
        w = theta[at:at + rows * cols].view(rows, cols)
        at += rows * cols
        out.append((w, theta[at:at + rows]))
        at += rows
    return out


def temperatures(layers: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """T(x) = softplus(MLP(x)) + 0.1 for standardised gaps x (N,)."""
    h = x[:, None]
    for w, b in layers[:-1]:
        h = F.relu(F.linear(h, w, b))
    w, b = layers[-1]
    return (F.softplus(F.linear(h, w, b)) + T_FLOOR).squeeze(1)


def smooth_soft_ece(confidence: torch.Tensor, accuracy: torch.Tensor) -> torch.Tensor:
    """The authors' smooth soft-binned ECE of top-label confidences against correctness (1.0 / 0.0; module
    notes), differentiable."""
    centres = torch.linspace(1 / (2 * SOFT_BINS), 1 - 1 / (2 * SOFT_BINS), SOFT_BINS, dtype=confidence.dtype,
                             device=confidence.device)
    w = torch.exp(-0.5 * (confidence[:, None] - centres) ** 2 / SIGMA ** 2)
    w = w / (w.sum(dim=1, keepdim=True) + GUARD)
    mass = w.sum(dim=0)
    residual = ((w * confidence[:, None]).sum(dim=0) - (w * accuracy[:, None]).sum(dim=0)) / (mass + GUARD)
    phi = torch.sqrt(residual ** 2 + SMOOTHING ** 2) - SMOOTHING
    return (phi * mass / (len(confidence) + GUARD)).sum()


class SMARTHead(torch.nn.Module):
    """z / T(standardised gap) in float64, returned float32."""

    def __init__(self, network: torch.Tensor, units: int, layers: int, gap_mean: float, gap_std: float):
        super().__init__()
        self.units, self.layers = int(units), int(layers)
        self.register_buffer("network", torch.as_tensor(network, dtype=torch.float64).clone())
        self.register_buffer("gap_mean", torch.tensor(float(gap_mean), dtype=torch.float64))
        self.register_buffer("gap_std", torch.tensor(float(gap_std), dtype=torch.float64))

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        z = logits.to(torch.float64)
        x = (gap(z) - self.gap_mean) / (self.gap_std + 1e-8)
        t = temperatures(_unpack(self.network, self.units, self.layers), x)
        return (z / t[:, None]).to(torch.float32)


def initial_network(units: int, layers: int, seed: int) -> torch.Tensor:
    """The flat float64 parameters of torch's ``nn.Linear`` layers made after ``torch.manual_seed(seed)``,
    in float32 as the authors' are; the global random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        sizes = [(1, units)] + [(units, units)] * (layers - 1) + [(units, 1)]
        made = [torch.nn.Linear(a, b, dtype=torch.float32) for a, b in sizes]
    return torch.cat([t.detach().flatten() for m in made for t in (m.weight, m.bias)]).to(torch.float64)


class SMART(HeadCalibrator):
    """SMART: z / T(x), T from a small network of the standardised top-two logit gap x, trained on the
    authors' smooth soft-binned ECE (module notes).

    Learned: ``network_`` (the network's parameters, flat, float64), ``gap_mean_`` and ``gap_std_`` (the
    standardisation), ``n_epochs_`` (epochs run) and ``objective_`` (the loss of the last epoch).
    """

    def __init__(self, hidden_units: int = 16, hidden_layers: int = 2, learning_rate: float = 0.005,
                 max_epochs: int = 2000, patience: int = 200, min_delta: float = 1e-4, seed: int = 0):
        self.hidden_units = hidden_units
        self.hidden_layers = hidden_layers
        self.learning_rate = learning_rate
        self.max_epochs = max_epochs
        self.patience = patience
        self.min_delta = min_delta
        self.seed = seed

    def fit(self, logits: Any, labels: Any) -> "SMART":
        units = check_whole_range(self.hidden_units, "hidden_units", 1, MAX_UNITS)
        layers = check_whole_range(self.hidden_layers, "hidden_layers", 1, MAX_LAYERS)
        lr = check_at_most(check_positive(self.learning_rate, "learning_rate"), "learning_rate", LR_MAX)
        epochs = check_whole_range(self.max_epochs, "max_epochs", 1, EPOCHS_MAX)
        patience = check_whole_range(self.patience, "patience", 1, EPOCHS_MAX)
        min_delta = check_nonnegative(self.min_delta, "min_delta")
        seed = check_whole_range(self.seed, "seed", 0, SEED_MAX)
        z, y = check_logits_labels(logits, labels)
        if len(y) < 2:
            raise ValueError(f"SMART standardises the logit gaps by their spread: it needs at least 2 calibration "
                             f"samples; got {shown(len(y))}.")
        order = torch.from_numpy(canonical_order(z, y)).to(z.device)
        z, y = z.to(torch.float64)[order], y[order]
        # T > 0 keeps every prediction, so correctness is fixed, and the confidence max softmax(z / T) is
        # 1 / Σ_j exp((z_j − max z) / T), softmax's own value at the top (the same float).
        below = z - z.max(dim=1, keepdim=True).values
        accuracy = (torch.argmax(z, dim=1) == y).to(torch.float64)
        g = gap(z)
        mean, std = float(g.mean()), float(g.std())
        x = (g - mean) / (std + 1e-8)
        theta = initial_network(units, layers, seed).to(z.device)
        params = [t.clone().requires_grad_(True) for pair in _unpack(theta, units, layers) for t in pair]
        optimiser = torch.optim.Adam(params, lr=lr)
        best, stale, epoch, loss = math.inf, 0, 0, math.nan
        for epoch in range(1, epochs + 1):
            t = temperatures(list(zip(params[::2], params[1::2])), x)
            objective = smooth_soft_ece(torch.exp(below / t[:, None]).sum(dim=1).reciprocal(), accuracy)
            optimiser.zero_grad()
            objective.backward()
            optimiser.step()
            loss = float(objective.detach())
            if loss < best - min_delta:
                best, stale = loss, 0
            else:
                stale += 1
            if stale >= patience:
                break
        self.network_ = torch.cat([p.detach().flatten() for p in params]).cpu()
        self.gap_mean_, self.gap_std_ = mean, std
        self.n_epochs_, self.objective_ = epoch, loss
        return self

    def as_module(self) -> torch.nn.Module:
        self._check_fitted("network_", "gap_mean_", "gap_std_")
        return SMARTHead(self.network_, self.hidden_units, self.hidden_layers, self.gap_mean_, self.gap_std_)

    @classmethod
    def saved_shapes(cls, params: dict, fitted: dict, classes: int | None) -> dict[str, list[int]]:
        units = check_whole_range(params.get("hidden_units"), "The calibrator's hidden_units", 1, MAX_UNITS)
        layers = check_whole_range(params.get("hidden_layers"), "The calibrator's hidden_layers", 1, MAX_LAYERS)
        return {"network_": [network_size(units, layers)]}

    @classmethod
    def check_saved(cls, fitted: dict) -> None:
        for key in ("gap_mean_", "gap_std_"):
            value = fitted[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"The calibrator's {key} must be a finite number; got {shown(value)}.")
        if fitted["gap_std_"] < 0:
            raise ValueError(f"The calibrator's gap_std_ is a spread, at least 0; got {shown(fitted['gap_std_'])}.")
