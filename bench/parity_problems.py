"""Logits beyond the shipped ones, for the parity benches and the order tests: problems a user's own
logits could be, from seeded draws.

* :func:`synthetic`: a K-class model that is right with a margin and over-confident, from one seed;
  ``decimals`` rounds its logits (as a file written with few digits would), which leaves many
  probabilities one unit in the last place apart (softmax round-off of rows that differ only in the
  order of their values);
* :func:`pooled`: every row one of a few dozen distinct rounded rows (half of them the other half with
  their values reordered), its label drawn from that row's
  own (sharpened) probabilities: a model that sees few distinct inputs, or a quantised one. Its
  confidences tie in large runs, right and wrong answers mixed in each, which is what the order of the
  rows could decide before: equal-mass bin boundaries inside a run of ties, the KS error's steps.

:data:`PARITY_PROBLEMS` are the problems every parity bench adds to the shipped logits: 2, 7, 20 and
100 classes, and 7 and 20 classes rounded to one decimal, and the tied 7-class one.
"""
from __future__ import annotations

import numpy as np


def synthetic(classes: int, n: int, seed: int, decimals: int | None = None, scale: float = 3.0,
              margin: float = 1.5) -> tuple[np.ndarray, np.ndarray]:
    """(logits (n, classes) float64, labels (n,)): z = scale · (ε + margin · e_y), ε standard normal."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    z = scale * (rng.normal(size=(n, classes)) + margin * np.eye(classes)[y])
    return (z if decimals is None else np.round(z, decimals)), y


def pooled(classes: int, n: int, seed: int, rows: int = 40, decimals: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(logits, labels): ``n`` rows drawn from ``rows`` distinct rounded rows, labels from each row's
    softmax at temperature 1/2 (so the logits are under-confident where they are right)."""
    rng = np.random.default_rng(seed)
    base = np.round(2.0 * rng.normal(size=(rows // 2, classes)), decimals)
    # Each base row again with its values in another order: the same probabilities, but summed in
    # another order by the softmax, so some come out one unit in the last place apart.
    shuffled = np.array([row[rng.permutation(classes)] for row in base])
    pool = np.concatenate([base, shuffled])
    z = pool[rng.integers(0, rows, n)]
    p = np.exp(2 * (z - z.max(1, keepdims=True)))
    p /= p.sum(1, keepdims=True)
    y = (rng.random(n)[:, None] > np.cumsum(p, 1)).sum(1).clip(max=classes - 1)
    return z, y


#: name -> (logits, labels), each split in half by the benches (calibration, test).
def parity_problems(n: int = 4000) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {
        "2 classes": synthetic(2, n, 2),
        "7 classes": synthetic(7, n, 7),
        "20 classes": synthetic(20, n, 20),
        "100 classes": synthetic(100, n, 100, scale=4.0, margin=2.0),
        "7 classes, rounded": synthetic(7, n, 71, decimals=1),
        "20 classes, rounded": synthetic(20, n, 201, decimals=1),
        "7 classes, tied": pooled(7, n, 72),
    }
