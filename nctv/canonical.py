"""One order for the rows of a data set, the order its figures are summed in.

A float sum depends on the order of its terms, and a stable sort keeps tied keys in the order they
came, so a figure computed in the order rows arrive would change when the same rows are shuffled: in
its last bits, or by more where a tie decides a bin. A calibration figure is a function of the rows,
not of their order. So every metric, interval, calibration test and calibrator fit first puts its rows
in :func:`canonical_order`, a function of the rows' contents alone, and sums in that order: the same
rows in any order give the same figure to the last bit.

The order is by a 64-bit key of each row's bytes (its logits in float64 and its label), rows whose keys
collide ordered by their bytes, so two rows tie only when they are the same row, and then which comes
first changes nothing. It is not a numeric order; a metric that needs one (by confidence) sorts the
canonical rows again, and equal confidences then meet in the canonical order.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable

import numpy as np
import torch

# One odd 64-bit multiplier per column (a fixed draw: the key must be the same on every machine).
_MULTIPLIERS = np.random.default_rng(20240141).integers(1, 2**63, size=4096, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def _words(a: Any) -> np.ndarray:
    """A 2-D array's or tensor's (or a 1-D one's, as one column) values as 64-bit words, float64 bits for
    floats (−0 as 0: equal values, the same row)."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        a = a.double() if a.is_floating_point() else a.long()
        a = a.numpy()
    a = np.asarray(a)
    a = a.astype(np.float64) + 0.0 if a.dtype.kind == "f" else a.astype(np.int64, copy=False)  # −0 reads as 0
    a = np.ascontiguousarray(a.reshape(len(a), -1))
    return a.view(np.uint64)


def _row_keys(words: np.ndarray) -> np.ndarray:
    """A 64-bit key per row: Σ_j word_j · m_j (mod 2⁶⁴), m_j the column's odd multiplier."""
    keys = np.zeros(len(words), dtype=np.uint64)
    for start in range(0, words.shape[1], len(_MULTIPLIERS)):
        block = words[:, start:start + len(_MULTIPLIERS)]
        with np.errstate(over="ignore"):
            keys += (block * _MULTIPLIERS[:block.shape[1]]).sum(axis=1, dtype=np.uint64)
    return keys


def canonical_order(*arrays: Any) -> np.ndarray:
    """The permutation that puts rows in the canonical order: ``arrays`` (2-D or 1-D, numpy or torch,
    one row per sample, e.g. logits and labels) are read together as one row per sample."""
    words = np.concatenate([_words(a) for a in arrays], axis=1)
    keys = _row_keys(words)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    collide = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
    if len(collide):
        # Equal keys: the same row (nothing to order) or, rarely, a collision, ordered by the rows' bytes.
        for key in np.unique(sorted_keys[collide]):
            at = np.flatnonzero(sorted_keys == key)
            rows = words[order[at]]
            if (rows != rows[0]).any():
                as_bytes = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.shape[1] * 8))).ravel()
                order[at] = order[at][np.argsort(as_bytes, kind="stable")]
    return order


def same_as_previous(*arrays: Any) -> np.ndarray:
    """Per row of ``arrays`` (already in canonical order): whether it is the same row as the one before."""
    words = np.concatenate([_words(a) for a in arrays], axis=1)
    same = np.zeros(len(words), dtype=bool)
    same[1:] = (words[1:] == words[:-1]).all(axis=1)
    return same


def sorted_within_duplicates(counts: torch.Tensor, same: np.ndarray) -> torch.Tensor:
    """Resample ``counts`` (resamples × rows, rows in canonical order) with each run of identical rows
    (``same``: :func:`same_as_previous`) given its counts in ascending order, in every resample.

    Identical rows are one sample drawn several times: which copy a count goes to changes no figure in
    exact arithmetic, but it changes the order of a float sum. Sorting the counts within the run makes
    the resamples a function of the rows and their counts, not of the order the copies came in."""
    if not same.any():
        return counts
    run = np.cumsum(~same) - 1
    in_run = np.flatnonzero(same | np.r_[same[1:], False])  # every row of a run of two or more
    cols = torch.from_numpy(in_run).to(counts.device)
    sub = counts.index_select(1, cols).double()
    # Runs stay where they are (their columns are in run order), counts sort within each.
    offset = torch.from_numpy(run[in_run].astype(np.float64)).to(counts.device) * (float(sub.max()) + 1.0)
    ordered = torch.sort(sub + offset, dim=1).values - offset
    out = counts.clone()
    out[:, cols] = ordered.to(counts.dtype)
    return out


def content_keys(rows: Iterable[bytes]) -> np.ndarray:
    """A 128-bit digest (BLAKE2b) of each row's bytes, as an (N, 2) uint64 array: the identity of a sample
    by its content (a picture's pixels or file, a row of given inputs), for :func:`canonical_order`.

    Unlike the logits a model computes from a picture, which another CPU's kernels round differently in
    their last bits, a picture's bytes are the same on every machine: rows keyed by them are put in the
    same order everywhere (nctv.intervals draws a run's resamples in that order)."""
    digests = [hashlib.blake2b(bytes(row), digest_size=16).digest() for row in rows]
    if not digests:
        return np.zeros((0, 2), dtype=np.uint64)
    return np.frombuffer(b"".join(digests), dtype="<u8").reshape(-1, 2).copy()
