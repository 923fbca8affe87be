"""Argument checks shared by every layer of NCTV (the bottom of the import graph: numpy and torch only;
torch is imported by the tensor checks when they run, so that the command line checks its settings
before torch loads).

Each check returns the cleaned value or raises ``ValueError`` with a message that says what was wrong
and what to do, in the user's words.
"""
from __future__ import annotations

import math
import os
import re
import reprlib
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


class NotFittedError(RuntimeError):
    """Raised when a calibrator is used before ``fit``."""


#: Temperatures every fitter searches within (a model worse than chance, or separable data, would
#: otherwise send T to infinity or zero), and so the range a loaded calibrator's T must lie in.
T_MIN, T_MAX = 1e-3, 1e3


def as_tensor(x: Any, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Turn a numpy array, list or tensor into a tensor without copying when it can."""
    import torch

    if isinstance(x, torch.Tensor):
        t = x
    else:
        t = torch.as_tensor(np.asarray(x))
    if dtype is not None or device is not None:
        t = t.to(dtype=dtype or t.dtype, device=device or t.device)
    return t


def check_logits(logits: Any, name: str = "logits") -> torch.Tensor:
    """Validate a (N, K) logit matrix: 2-D, K >= 2, N >= 1, all finite."""
    t = as_tensor(logits)
    if t.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array of shape (samples, classes); got shape {tuple(t.shape)}.")
    if t.shape[0] == 0:
        raise ValueError(f"{name} is empty: the split has no samples.")
    if t.shape[1] < 2:
        raise ValueError(f"{name} has {t.shape[1]} class(es); calibration needs at least 2 classes.")
    if not t.is_floating_point():
        t = t.double()
    if not bool(t.isfinite().all()):
        raise ValueError(f"{name} contains NaN or infinite values; check the model's outputs.")
    return t


def check_labels(labels: Any, n: int, k: int, device: torch.device | None = None) -> torch.Tensor:
    """Validate integer labels of length ``n`` with values in [0, k)."""
    y = as_tensor(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-D array; got shape {tuple(y.shape)}.")
    if y.shape[0] != n:
        raise ValueError(f"logits have {n} samples but labels have {y.shape[0]}; they must match.")
    if y.is_floating_point():
        if not bool((y == y.round()).all()):
            raise ValueError("labels must be whole numbers (class indices).")
    y = y.long()
    if n and (int(y.min()) < 0 or int(y.max()) >= k):
        raise ValueError(f"labels must lie in [0, {k}) for {k} classes; found values from {int(y.min())} to {int(y.max())}.")
    return y.to(device) if device is not None else y


def check_logits_labels(logits: Any, labels: Any) -> tuple[torch.Tensor, torch.Tensor]:
    z = check_logits(logits)
    y = check_labels(labels, z.shape[0], z.shape[1], device=z.device)
    return z, y


def check_bins(n_bins: int) -> int:
    """A bin count >= 1. More bins than samples is allowed: the metrics define empty bins (they add 0)."""
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive whole number; got {shown(n_bins)}.")
    return int(n_bins)


#: A number as a person types it: ASCII digits, an optional sign, point and exponent ("inf" and "nan"
#: too, for the callers to name as not finite). Python's float() also reads other scripts' digits ("٣"
#: is 3), full-width ones ("１e-3") and underscores ("1_0").
_NUMBER = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?|inf|infinity|nan)", re.I | re.A)


def read_number(value: Any) -> float | None:
    """A number (not a bool), or text that writes one in ASCII (surrounding spaces allowed), as a
    float; None for anything else. Infinite and NaN pass: each caller says what range it takes."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        return float(text) if _NUMBER.fullmatch(text) else None
    if isinstance(value, (int, float, np.integer, np.floating)):
        try:
            return float(value)
        except OverflowError:  # an int beyond a float's range
            return math.inf if value > 0 else -math.inf
    return None


def check_nonnegative(value: float, name: str) -> float:
    v = read_number(value)
    if v is None:
        raise ValueError(f"{name} must be a number; got {shown(value)}.")
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0; got {shown(value)}.")
    return v


def check_positive(value: float, name: str) -> float:
    v = check_nonnegative(value, name)
    if v == 0:
        raise ValueError(f"{name} must be greater than 0; got {shown(value)}.")
    return v


def check_whole(value: Any, name: str, minimum: int = 1) -> int:
    """A whole number (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}; got {shown(value)}.")
    return int(value)


def number_or_word(text: Any, words: tuple[str, ...] = ()) -> float | str | None:
    """A typed setting: one of ``words`` (compared stripped and lower-cased), or a finite number
    ≥ 0; None when it is neither (the caller says what it expected, in its own words)."""
    word = str(text).strip().lower()
    if word in words:
        return word
    value = read_number(word)
    return value if value is not None and math.isfinite(value) and value >= 0 else None


#: Largest focal-loss γ accepted anywhere (the paper's appendix sweeps 0.01–5). Far above that the
#: loss of every confident prediction is ~0, the fit learns nothing, and the result only looks calibrated.
GAMMA_MAX = 10.0
#: Largest numeric weight decay λ (the paper's appendix sweeps 0.001–10). Far smaller values already
#: hold δ at 0 (Neural Clamping becomes temperature scaling); the bound only refuses typing slips.
WEIGHT_DECAY_MAX = 1e6
#: Largest SGD learning rate of the recipes (theirs are 0.001 and 0.01).
LR_MAX = 10.0
#: Most epochs of a recipe (theirs: 100).
EPOCHS_MAX = 10_000


def check_at_most(value: Any, name: str, maximum: float, why: str = "") -> float:
    """A finite number in [0, ``maximum``]; ``why`` (a clause) says where the bound comes from."""
    v = check_nonnegative(value, name)
    if v > maximum:
        bound = f"{maximum:,.0f}" if maximum == int(maximum) else f"{maximum:g}"
        raise ValueError(f"{name} must be at most {bound}{f' ({why})' if why else ''}; got {shown(value)}.")
    return v


def check_gamma(value: Any, name: str = "gamma") -> float:
    """A focal-loss γ in [0, :data:`GAMMA_MAX`] (not a bool: True is no exponent anyone typed)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number; got {value!r}.")
    return check_at_most(value, name, GAMMA_MAX, "the paper uses 0 to 5")


def env_number(name: str, default: float, minimum: float, whole: bool = False) -> float:
    """A setting from environment variable ``name`` (``default`` when unset): a finite number >=
    ``minimum``, whole if ``whole``. Anything else stops the program at start, in words: falling back
    to the default could quietly allow more than the operator meant to."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    value = read_number(text)
    if value is None:
        value = math.nan
    if not math.isfinite(value) or value < minimum or (whole and value != int(value)):
        kind = "a whole number" if whole else "a number"
        raise ValueError(f"The environment variable {name} must be {kind} ≥ {minimum:g}; it is {shown(text)}.")
    return value


def env_limit(name: str, default: int) -> int:
    """A size or count cap: the whole number >= 1 in environment variable ``name``, else ``default``."""
    return int(env_number(name, default, 1, whole=True))


#: Largest count (runs, bins, images, batch size) a command-line option accepts: far beyond any real
#: use, and still a machine integer for every library it reaches.
COUNT_MAX = 2**31 - 1
#: Seeds lie in [0, SEED_MAX]: numpy's generators refuse larger ones.
SEED_MAX = 2**32 - 1


def check_finite(value: Any, name: str) -> float:
    """A real number (not a bool) that is finite: neither NaN nor ±infinity, nor too large for a float."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number; got {shown(value)}.")
    v = read_number(value)
    if v is None or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number; got {shown(value)}.")
    return v


def check_whole_range(value: Any, name: str, minimum: int, maximum: int) -> int:
    """A whole number in [``minimum``, ``maximum``]."""
    v = check_whole(value, name, minimum)
    if v > maximum:
        raise ValueError(f"{name} must be at most {maximum:,}; got {shown(value)}.")
    return v


#: Finest temperature grid step a command accepts (the paper's finest is 0.001): T = step … 5 then
#: has 5 million points; finer grids only cost memory and time.
GRID_STEP_MIN = 1e-6


#: Characters of a person's value that a message repeats; the rest becomes "…".
ECHO_CHARS = 80
#: Longest typed value (a model id, a dataset name, a setting) accepted; longer ones are refused
#: before any work is done on them. ``$NCTV_MAX_TEXT_CHARS``.
MAX_TEXT_CHARS = env_limit("NCTV_MAX_TEXT_CHARS", 1000)


def shown(value: Any, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` for a message, cut to about ``limit`` characters with "…": a value sent to a
    public server may be megabytes long, and a message repeats only enough of it to recognise."""
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + "…"
    text = _short_repr(limit).repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _short_repr(limit: int) -> reprlib.Repr:
    """A ``repr`` that stops early: a container shows its first items and nesting only a few levels deep,
    so a list of ten thousand numbers costs what twenty do (``repr`` of the whole would be built and then
    cut)."""
    r = reprlib.Repr()
    r.maxlevel = 3
    r.maxlist = r.maxtuple = r.maxarray = r.maxdeque = 20
    r.maxdict = r.maxset = r.maxfrozenset = 10
    r.maxstring = r.maxother = r.maxlong = max(limit, 8)
    return r


def check_text(value: Any, name: str) -> Any:
    """``value`` unchanged unless it is a string longer than :data:`MAX_TEXT_CHARS`."""
    if isinstance(value, str) and len(value) > MAX_TEXT_CHARS:
        raise ValueError(f"{name} is {len(value):,} characters long; at most {MAX_TEXT_CHARS:,} are accepted.")
    return value
