"""Any classifier's logits, calibrated: a file of logits and labels (text, audio, tabular, any model)
read safely, and the run of every logit method on it.

Layouts (docs/logits.md):

* ``.npz`` (numpy, read with ``allow_pickle=False``) or ``.safetensors``: the arrays
  ``calibration_logits``, ``calibration_labels``, ``test_logits``, ``test_labels`` (already split), or
  ``logits`` and ``labels`` (one set, split in halves at random by the seed, over the rows' canonical
  order: the same halves for the rows in any order). Class names, optional:
  an array ``class_names`` of strings in a ``.npz``, the metadata key ``class_names`` (a JSON list) in a
  ``.safetensors``.
* ``.csv``: a header row, then one row per example: a column ``label`` (class index), an optional
  column ``split`` (``calibration`` or ``test``; without it the rows are split in halves), and one
  column per class holding its logit; those columns' headers are the class names.

Everything is bounded before it is read: the file's size, each array's shape and type from its header
(a ``.npz`` member's size from the zip's directory), the number of values. Logits must be finite real
numbers, two or more classes, the same classes in both splits; labels whole numbers below the class
count. Every refusal is a ``ValueError`` in words.
"""
from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nctv.canonical import canonical_order
from nctv.checks import env_limit

#: Largest logits file read, in bytes; ``$NCTV_MAX_LOGITS_BYTES``.
MAX_LOGITS_BYTES = env_limit("NCTV_MAX_LOGITS_BYTES", 512 * 2**20)
#: Most logit values (examples × classes, both splits) read; ``$NCTV_MAX_LOGITS_VALUES``.
MAX_LOGITS_VALUES = env_limit("NCTV_MAX_LOGITS_VALUES", 50_000_000)
#: Fewest examples per split: an ECE of 15 bins, an interval, a fit, all need some.
MIN_EXAMPLES = 20
#: Largest safetensors header read (four arrays and a list of class names).
MAX_HEADER_BYTES = 4 * 2**20
SPLIT_KEYS = ("calibration_logits", "calibration_labels", "test_logits", "test_labels")
WHOLE_KEYS = ("logits", "labels")
FORMATS = (".npz", ".safetensors", ".csv")


@dataclass(frozen=True)
class LogitsData:
    """Checked logits (float64) and labels (int64) of both splits, the class names, and where they
    came from (``name``: the file's name; ``split``: "file" when the file held both splits, else the
    seeded halves it was split into)."""

    calibration_logits: np.ndarray
    calibration_labels: np.ndarray
    test_logits: np.ndarray
    test_labels: np.ndarray
    class_names: tuple[str, ...]
    name: str
    split: str

    @property
    def n_classes(self) -> int:
        return int(self.calibration_logits.shape[1])


def read_logits(path: str | Path, seed: int = 0, name: str | None = None) -> LogitsData:
    """The logits file at ``path`` (a layout of this module's text), checked; ``seed`` draws the halves
    when the file holds one set. ``name`` (default: the file's name) is what tables call it."""
    p = Path(path)
    shown = name or p.name
    if not p.is_file():
        raise ValueError(f"There is no logits file {shown}.")
    size = p.stat().st_size
    if size > MAX_LOGITS_BYTES:
        raise ValueError(f"{shown} is {size:,} bytes; logits files of at most {MAX_LOGITS_BYTES:,} bytes are read "
                         "(NCTV_MAX_LOGITS_BYTES).")
    kind = p.suffix.lower()
    readers = {".npz": _read_npz, ".safetensors": _read_safetensors, ".csv": _read_csv}
    if kind not in readers:
        raise ValueError(f"{shown} is not a logits file NCTV reads: give a .npz, .safetensors or .csv file "
                         "(docs/logits.md).")
    arrays, names = readers[kind](p, shown)
    return _checked(arrays, names, shown, seed)


# --------------------------------------------------------------------------- readers


def _layout(keys: set[str], shown: str) -> tuple[str, ...]:
    if set(SPLIT_KEYS) <= keys:
        return SPLIT_KEYS
    if set(WHOLE_KEYS) <= keys:
        return WHOLE_KEYS
    raise ValueError(f"{shown} holds {', '.join(sorted(keys)) or 'no arrays'}; a logits file holds "
                     f"{', '.join(SPLIT_KEYS)} (already split), or logits and labels.")


def _check_shape(shape: tuple, key: str, shown: str) -> None:
    want = 2 if key.endswith("logits") else 1
    if len(shape) != want or any(n < 1 for n in shape):
        raise ValueError(f"{shown}: {key} must be a table of shape (examples, classes)" if want == 2 else
                         f"{shown}: {key} must be a list of class indices, one per example")


def _count(shapes: dict[str, tuple], shown: str) -> None:
    values = sum(math.prod(s) for s in shapes.values())
    if values > MAX_LOGITS_VALUES:
        raise ValueError(f"{shown} holds {values:,} values; at most {MAX_LOGITS_VALUES:,} are read "
                         "(NCTV_MAX_LOGITS_VALUES).")


def _read_npz(p: Path, shown: str) -> tuple[dict[str, np.ndarray], list[str] | None]:
    try:
        with zipfile.ZipFile(p) as z:
            members = {info.filename: info for info in z.infolist()}
            keys = {m[:-4] for m in members if m.endswith(".npy")}
            wanted = _layout(keys, shown)
            shapes = {}
            for key in wanted + (("class_names",) if "class_names" in keys else ()):
                info = members[key + ".npy"]
                if info.file_size > MAX_LOGITS_BYTES:
                    raise ValueError(f"{shown}: {key} unpacks to {info.file_size:,} bytes; at most "
                                     f"{MAX_LOGITS_BYTES:,} are read (NCTV_MAX_LOGITS_BYTES).")
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                                   np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read_header(f)
                if dtype.hasobject:
                    raise ValueError(f"{shown}: {key} holds Python objects, which are never read; save plain "
                                     "numbers (and class names as a string array).")
                if key != "class_names":
                    _check_shape(tuple(shape), key, shown)
                shapes[key] = tuple(shape)
            _count({k: v for k, v in shapes.items() if k != "class_names"}, shown)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ValueError(f"{shown} is not a .npz file numpy wrote ({type(e).__name__}).") from None
    try:
        with np.load(p, allow_pickle=False) as data:
            arrays = {k: data[k] for k in wanted}
            names = [str(v) for v in data["class_names"].ravel()] if "class_names" in shapes else None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{shown} cannot be read as a .npz file ({type(e).__name__}).") from None
    return arrays, names


def _read_safetensors(p: Path, shown: str) -> tuple[dict[str, np.ndarray], list[str] | None]:
    from safetensors import SafetensorError, safe_open

    with p.open("rb") as f:
        head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 2 <= n <= min(p.stat().st_size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"{shown} is not a safetensors file NCTV reads (its header length is wrong or over "
                         f"{MAX_HEADER_BYTES:,} bytes).")
    try:
        with safe_open(str(p), framework="numpy") as f:
            wanted = _layout(set(f.keys()), shown)
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in wanted}
            for k, s in shapes.items():
                _check_shape(s, k, shown)
            _count(shapes, shown)
            arrays = {k: f.get_tensor(k) for k in wanted}
            meta = f.metadata() or {}
    except SafetensorError as e:
        raise ValueError(f"{shown} cannot be read as a safetensors file ({str(e)[:80]}).") from None
    except TypeError:  # a dtype numpy has no form for (bfloat16): said below as "not real numbers"
        raise ValueError(f"{shown}: its logits must be 16-, 32- or 64-bit floating-point numbers.") from None
    names = None
    if "class_names" in meta:
        try:
            names = json.loads(meta["class_names"])
        except ValueError:
            names = None
        if not isinstance(names, list) or not all(isinstance(v, str) for v in names):
            raise ValueError(f"{shown}: its metadata class_names must be a JSON list of strings.")
    return arrays, names


def _read_csv(p: Path, shown: str) -> tuple[dict[str, np.ndarray], list[str] | None]:
    import csv
    import io

    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise ValueError(f"{shown} is not UTF-8 text; save the table as CSV in UTF-8.") from None
    rows = csv.reader(io.StringIO(text))
    header = next(rows, None)
    if not header:
        raise ValueError(f"{shown} is empty; it needs a header row: label, [split,] one column per class.")
    header = [h.strip() for h in header]
    if "label" not in header:
        raise ValueError(f"{shown}: its header has no column 'label' (the class index of each example).")
    label_at, split_at = header.index("label"), header.index("split") if "split" in header else None
    classes = [i for i in range(len(header)) if i not in (label_at, split_at)]
    if len(classes) < 2:
        raise ValueError(f"{shown}: its header names {len(classes)} logit column(s); a classifier has at least 2.")
    names = [header[i] for i in classes]
    logits, labels, splits = [], [], []
    for line, row in enumerate(rows, start=2):
        if not row:
            continue
        if len(row) != len(header):
            raise ValueError(f"{shown}, line {line}: {len(row)} values for {len(header)} columns.")
        if (len(logits) + 1) * len(classes) > MAX_LOGITS_VALUES:
            _count({"logits": (len(logits) + 1, len(classes))}, shown)
        logits.append([_csv_number(row[i], shown, line, header[i]) for i in classes])
        labels.append(_csv_whole(row[label_at], shown, line))
        if split_at is not None:
            which = row[split_at].strip().lower()
            if which not in ("calibration", "test"):
                raise ValueError(f"{shown}, line {line}: split must be 'calibration' or 'test'; got {row[split_at]!r}.")
            splits.append(which)
    if not logits:
        raise ValueError(f"{shown} has a header but no rows.")
    z, y = np.asarray(logits, dtype=np.float64), np.asarray(labels, dtype=np.int64)
    if split_at is None:
        return {"logits": z, "labels": y}, names
    mask = np.asarray(splits) == "calibration"
    return {"calibration_logits": z[mask], "calibration_labels": y[mask], "test_logits": z[~mask],
            "test_labels": y[~mask]}, names


def _csv_number(text: str, shown: str, line: int, column: str) -> float:
    t = text.strip()
    try:
        if not t.isascii():
            raise ValueError
        return float(t)
    except ValueError:
        raise ValueError(f"{shown}, line {line}, column {column!r}: {text[:20]!r} is not a number.") from None


def _csv_whole(text: str, shown: str, line: int) -> int:
    t = text.strip()
    if not (t.isascii() and t.isdigit()):
        raise ValueError(f"{shown}, line {line}: the label {text[:20]!r} is not a class index (a whole number from 0).")
    return int(t)


# --------------------------------------------------------------------------- checks


def _logits(a: np.ndarray, key: str, shown: str) -> np.ndarray:
    if a.dtype.kind != "f":
        raise ValueError(f"{shown}: {key} must be floating-point numbers (logits); got {a.dtype}.")
    if not np.isfinite(a).all():
        raise ValueError(f"{shown}: {key} holds NaN or infinite values; logits must be finite.")
    return a.astype(np.float64)


def _labels(a: np.ndarray, key: str, shown: str, k: int) -> np.ndarray:
    if a.dtype.kind not in "iu":
        if a.dtype.kind == "f" and np.isfinite(a).all() and (a == np.round(a)).all():
            a = a.astype(np.int64)
        else:
            raise ValueError(f"{shown}: {key} must be whole class indices; got {a.dtype}.")
    if len(a) and (a.min() < 0 or a.max() >= k):
        raise ValueError(f"{shown}: {key} holds {int(a.min() if a.min() < 0 else a.max())}; labels are class indices "
                         f"from 0 to {k - 1}.")
    return a.astype(np.int64)


def _checked(arrays: dict[str, np.ndarray], names: list[str] | None, shown: str, seed: int) -> LogitsData:
    if "logits" in arrays:
        z = _logits(arrays["logits"], "logits", shown)
        y = _labels(arrays["labels"], "labels", shown, z.shape[1])
        if len(z) != len(y):
            raise ValueError(f"{shown}: {len(z):,} rows of logits but {len(y):,} labels.")
        # The seeded permutation is of the rows' canonical places: the same halves for the rows in any order.
        order = canonical_order(z, y)[np.random.default_rng(seed).permutation(len(z))]
        half = len(z) // 2
        cal, test = order[:half], order[half:]
        parts = (z[cal], y[cal], z[test], y[test])
        split = f"halves drawn with seed {seed}"
    else:
        zc = _logits(arrays["calibration_logits"], "calibration_logits", shown)
        zt = _logits(arrays["test_logits"], "test_logits", shown)
        if zc.shape[1] != zt.shape[1]:
            raise ValueError(f"{shown}: the calibration logits have {zc.shape[1]} classes, the test logits "
                             f"{zt.shape[1]}; both splits must have the same classes.")
        yc = _labels(arrays["calibration_labels"], "calibration_labels", shown, zc.shape[1])
        yt = _labels(arrays["test_labels"], "test_labels", shown, zc.shape[1])
        for what, a, b in (("calibration", zc, yc), ("test", zt, yt)):
            if len(a) != len(b):
                raise ValueError(f"{shown}: {len(a):,} rows of {what} logits but {len(b):,} {what} labels.")
        parts = (zc, yc, zt, yt)
        split = "file"
    k = parts[0].shape[1]
    if k < 2:
        raise ValueError(f"{shown}: the logits have 1 column; a classifier has at least 2 classes.")
    for what, part in (("calibration", parts[1]), ("test", parts[3])):
        if len(part) < MIN_EXAMPLES:
            raise ValueError(f"{shown}: the {what} split has {len(part)} examples; at least {MIN_EXAMPLES} are needed.")
    if names is None:
        names = [f"class {i}" for i in range(k)]
    elif len(names) != k or any(not n.strip() or len(n) > 200 for n in names):
        raise ValueError(f"{shown}: {len(names)} class names for {k} classes (each a non-empty name of at most "
                         "200 characters).")
    return LogitsData(*parts, class_names=tuple(names), name=shown, split=split)


# --------------------------------------------------------------------------- the run


def logit_methods(methods: Any) -> list[str]:
    """``methods`` with those that need the model refused in words (logits alone cannot feed them)."""
    from nctv.methods import METHODS

    needs = [m for m in methods if m in METHODS and METHODS[m].needs_model]
    if needs:
        raise ValueError(f"{', '.join(needs)} work{'s' if len(needs) == 1 else ''} on the model's inputs (δ is "
                         "added to the pictures), so a file of logits cannot feed "
                         f"{'it' if len(needs) == 1 else 'them'}; the logit methods can: "
                         f"{', '.join(n for n, s in METHODS.items() if not s.needs_model)}.")
    return list(methods)


def default_logit_methods() -> list[str]:
    """The paper's default methods that work on logits alone."""
    from nctv.experiment import DEFAULT_METHODS
    from nctv.methods import METHODS

    return [m for m in DEFAULT_METHODS if not METHODS[m].needs_model]


class _Logits:
    """The "model" of a logits run: its inputs are the logits (an identity), with the file's class names."""

    def __init__(self, data: LogitsData):
        import torch

        self.model = torch.nn.Identity()
        self.class_names = list(data.class_names)
        self.name = data.name
        self.source = f"logits:{data.name}"


def run_on_logits(data: LogitsData, methods: Any = None, options: Any = None) -> Any:
    """Every method of ``methods`` (default: the paper's logit methods) fitted on the file's
    calibration logits and scored on its test logits, with the run's metrics, intervals and tables:
    a ``RunResult`` as :func:`nctv.experiment.run_experiment` makes, its model recorded as the file."""
    import torch

    from nctv.experiment import RunOptions, run_experiment

    chosen = logit_methods(default_logit_methods() if methods is None else methods)
    cal = (torch.from_numpy(data.calibration_logits), torch.from_numpy(data.calibration_labels))
    test = (torch.from_numpy(data.test_logits), torch.from_numpy(data.test_labels))
    where = "its calibration and test splits" if data.split == "file" else data.split
    options = RunOptions.make(options, dataset=f"logits file {data.name} ({where})")
    return run_experiment(_Logits(data), cal, test, chosen, options)
