"""Calibrators you can save, share and deploy, in the Hugging Face Hub's layout.

A saved calibrator is a folder, or a Hub repository, with two files:

* ``config.json``: the method's registry name and class, its settings (``get_params``), its fitted
  numbers (``temperature_``, ``lambda_``, ``gamma_``, …), the model it was fitted for (name, source
  and fingerprint) and that model's data config; docs/calibrators.md lists the fields.
* ``calibrator.safetensors``: its tensors (δ, weight matrices, biases, grids, input ranges). In
  ``config.json`` a tensor appears as ``{"__tensor__": "<name in the file>", "numpy": <bool>}``.

Loading builds only the classes of the method registry (``nctv.calibration.METHODS``) from JSON
values and safetensors tensors: nothing is unpickled, nothing named in the files is imported.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nctv import __version__
from nctv.checks import NotFittedError, T_MAX, T_MIN, check_finite, check_gamma, check_nonnegative, env_limit

if TYPE_CHECKING:
    from nctv.calibration.base import BaseCalibrator

__all__ = ["FORMAT_VERSION", "CONFIG_NAME", "TENSORS_NAME", "MAX_CONFIG_BYTES", "MAX_TENSORS_BYTES", "MAX_INPUT_VALUES",
           "FILE_CAPS", "ModelMismatchWarning", "save_calibrator",
           "load_calibrator", "read_config", "calibrator_folder", "method_name", "saved_for"]

#: Version of the layout below; a loader refuses files of a later version.
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
TENSORS_NAME = "calibrator.safetensors"
# The model travels on its own (its name and fingerprint are recorded instead); the device and the
# progress callback belong to the session that fitted, not to the calibrator.
_NOT_SAVED = ("model", "device", "callback")
_TENSOR = "__tensor__"
_FITTED_NAME = re.compile(r"[a-z][a-z0-9_]*_")

#: Caps on a saved calibrator's files, checked before either is read. config.json holds settings and
#: fitted numbers (kilobytes; a long SGD history a few MB); calibrator.safetensors holds δ (one input
#: of the model) or a K×K matrix (8 MB for 1,000 classes).
MAX_CONFIG_BYTES = env_limit("NCTV_MAX_CONFIG_BYTES", 16 * 2**20)
MAX_TENSORS_BYTES = env_limit("NCTV_MAX_CALIBRATOR_BYTES", 512 * 2**20)
FILE_CAPS = {CONFIG_NAME: MAX_CONFIG_BYTES, TENSORS_NAME: MAX_TENSORS_BYTES}
#: Most JSON objects and arrays in one config.json, counted from its bytes before it is parsed. A
#: container costs Python 56 to 200 bytes for its 2 or 3 characters: 15 MB of ``[[],[],…]`` would
#: take 390 MB once parsed. A long SGD history is one object a step (a 16 MB config holds ~120,000).
MAX_CONFIG_CONTAINERS = 2**18
#: Largest safetensors header (the JSON that lists the tensors), checked from its 8-byte length before
#: it is read: a calibrator's few tensors take a few hundred bytes each; ``$NCTV_MAX_HEADER_BYTES``.
MAX_HEADER_BYTES = env_limit("NCTV_MAX_HEADER_BYTES", 2**20)
#: Most values in one model input (δ's size) when the model given does not say its input shape (a
#: bare nn.Module) and the calibrator records none: 16 Mi values is a 3×2048×2048 image and more.
MAX_INPUT_VALUES = env_limit("NCTV_MAX_INPUT_VALUES", 16 * 2**20)


class ModelMismatchWarning(UserWarning):
    """A calibrator was loaded with a model other than the one it was fitted for."""


class _NotSavable(TypeError):
    pass


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def save_calibrator(calibrator: BaseCalibrator, save_directory: str | os.PathLike, model: Any = None,
                    data_config: dict | None = None) -> Path:
    """Write a fitted calibrator as ``config.json`` + ``calibrator.safetensors``; returns the folder.

    See :meth:`BaseCalibrator.save_pretrained` for ``model`` and ``data_config``.
    """
    from safetensors.torch import save_file

    name = method_name(calibrator)
    fitted = {k: v for k, v in vars(calibrator).items() if _FITTED_NAME.fullmatch(k)}
    if not fitted:
        raise NotFittedError(f"{type(calibrator).__name__} is not fitted yet: fit it before save_pretrained.")
    tensors: dict[str, torch.Tensor] = {}
    params, skipped = _encode_all({k: v for k, v in calibrator.get_params().items() if k not in _NOT_SAVED},
                                  "params", tensors)
    fitted, skipped_fitted = _encode_all(fitted, "fitted", tensors)
    config = {
        "nctv_format": FORMAT_VERSION,
        "nctv_version": __version__,
        "method": name,
        "class": type(calibrator).__name__,
        "params": params,
        "fitted": fitted,
        "not_saved": [k for k in _NOT_SAVED if k in calibrator.get_params()] + skipped + skipped_fitted,
        "model": _model_record(calibrator, model),
        "data_config": _data_config(model, data_config),
    }
    folder = Path(save_directory).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / TENSORS_NAME), metadata={"format": "pt", "nctv_format": str(FORMAT_VERSION)})
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return folder


def method_name(calibrator: BaseCalibrator) -> str:
    """The registry name (a key of ``METHODS``) of a calibrator, from its class and settings."""
    from nctv.calibration.registry import METHODS

    cls = type(calibrator).__name__
    specs = [s for s in METHODS.values() if s.cls == cls]
    if not specs:
        raise ValueError(f"{cls} is not one of NCTV's calibration methods ({', '.join(METHODS)}); only those "
                         "can be saved and loaded.")

    def setting(key: str) -> Any:  # the fitted value where there is one: gamma="auto" settles on gamma_
        return getattr(calibrator, key + "_", getattr(calibrator, key, None))

    for spec in specs:
        if all(setting(k) == v for k, v in spec.defaults.items()):
            return spec.name
    # Only Neural Clamping has two entries, CE (γ = 0) and FL (γ = 1): any other γ is a focal loss.
    return specs[-1].name


def _encode_all(values: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    """JSON for each value (tensors into ``tensors``), and the names of those that have no such form."""
    out, skipped = {}, []
    for key, value in values.items():
        found: dict[str, torch.Tensor] = {}
        try:
            out[key] = _encode(value, f"{prefix}.{key}", found)
        except _NotSavable:
            skipped.append(key)
            continue
        tensors.update(found)
    return out, skipped


def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (torch.Tensor, np.ndarray)):
        is_numpy = isinstance(value, np.ndarray)
        try:
            t = torch.from_numpy(np.ascontiguousarray(value)) if is_numpy else value.detach()
        except TypeError:  # an object array
            raise _NotSavable(key) from None
        # Own, contiguous CPU memory: safetensors refuses views that share storage.
        tensors[key] = t.cpu().contiguous().clone()
        return {_TENSOR: key, "numpy": is_numpy}
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _encode(v, f"{key}.{k}", tensors) for k, v in value.items()}
    raise _NotSavable(key)


def _module(model: Any) -> torch.nn.Module | None:
    """The ``nn.Module`` of a model given as a module or as an ``nctv.zoo.LoadedModel``."""
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
    if model is not None and not isinstance(module, torch.nn.Module):
        raise ValueError(f"model must be a torch model (nn.Module) or an nctv LoadedModel; got {type(model).__name__}.")
    return module


def _model_record(calibrator: BaseCalibrator, model: Any) -> dict | None:
    """Name, source, class and fingerprint of the model the calibrator was fitted for (None: unknown)."""
    from nctv.cache import model_fingerprint

    own = getattr(calibrator, "model", None)
    module = _module(model) if model is not None else own
    if module is None:
        return None
    fingerprint = model_fingerprint(module)
    if own is not None and module is not own and fingerprint != model_fingerprint(own):
        raise ValueError(f"{type(calibrator).__name__} was fitted with another model than the one given to "
                         "save_pretrained; pass that model (or its LoadedModel), or none.")
    return {"name": getattr(model, "name", None), "source": getattr(model, "source", None),
            "class": type(module).__name__, "fingerprint": fingerprint}


def _data_config(model: Any, data_config: dict | None) -> dict | None:
    cfg = data_config if data_config is not None else getattr(model, "data_config", None)
    if cfg is None:
        return None
    try:
        return json.loads(json.dumps(dict(cfg)))
    except (TypeError, ValueError):
        raise ValueError("data_config must hold plain numbers, strings and lists (input_size, mean, std, …).") \
            from None


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_calibrator(source: str | os.PathLike, model: Any = None) -> BaseCalibrator:
    """A fitted calibrator from a folder written by ``save_pretrained`` or a Hub repository.

    ``source``: a folder path (``local-dir:<path>`` also works) or ``hf-hub:<org>/<name>[@revision]``,
    read through the Hugging Face cache (offline, or with ``HF_HUB_OFFLINE=1``, from the cache only).
    ``model`` (an ``nn.Module`` or ``nctv.zoo.LoadedModel``) is required for Neural Clamping, which
    works on the model's inputs. When its fingerprint differs from the one saved, a
    :class:`ModelMismatchWarning` says so and the calibrator is still returned: a model converted or
    moved between formats keeps its behaviour but not its fingerprint, so refusing would be wrong as
    often as right. ``nctv apply`` refuses instead.

    The files may come from anyone, so everything is checked before it is used: each file's size;
    each tensor's dtype and shape, from the file's header, before its data is read (δ: the model's
    input shape; weights: K×K and K; grids: the length their settings give); the fitted numbers
    (T finite and within [T_MIN, T_MAX] of the temperature fitters, γ, λ, δ and weights finite).
    A Neural Clamping calibrator must record its model's fingerprint. Anything else: ValueError.
    """
    folder = calibrator_folder(source)
    config = read_config(folder)
    cls, spec = _registry_class(config)
    module = _module(model)
    _check_model(config, module, spec)
    try:
        references = _references(config, folder)
        expected = _Expected(config, model, cls)
        tensors = _read_tensors(folder / TENSORS_NAME, references, expected)
        # Settings come back as tuples (the constructors' own defaults are tuples); fitted lists stay lists.
        params = _decode(config.get("params", {}), tensors, tuple)
        fitted = _decode(config.get("fitted", {}), tensors)
    except RecursionError:
        raise ValueError(f"{folder / CONFIG_NAME} nests its values too deeply; it was not written by "
                         "save_pretrained.") from None
    unknown = [k for k in params if k not in cls._param_names()]
    if unknown:
        raise ValueError(f"{folder / CONFIG_NAME} has settings this NCTV does not know ({', '.join(unknown)}); "
                         "it may come from a newer version: upgrade nctv.")
    _check_fitted(fitted, spec, folder, expected.delta_bound, tuple(expected.declared))
    cls.check_saved(fitted)
    calibrator = cls(module, **params) if spec.needs_model else cls(**params)
    for key, value in fitted.items():
        setattr(calibrator, key, value)
    return calibrator


def read_config(folder: Path) -> dict:
    """The checked ``config.json`` of a saved calibrator folder."""
    path = Path(folder) / CONFIG_NAME
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path} is larger than {MAX_CONFIG_BYTES:,} bytes (NCTV_MAX_CONFIG_BYTES); a saved "
                         "calibrator's config.json is far smaller.")
    raw = path.read_bytes()
    if raw.count(b"[") + raw.count(b"{") > MAX_CONFIG_CONTAINERS:  # brackets in strings count too: an upper bound
        raise ValueError(f"{path} holds more than {MAX_CONFIG_CONTAINERS:,} lists and objects; a saved calibrator's "
                         "config.json holds far fewer.")
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON, or a 5,000-digit number
        raise ValueError(f"{path} is not valid JSON ({e}); save the calibrator again.") from None
    version = config.get("nctv_format") if isinstance(config, dict) else None
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"{path} is not a saved NCTV calibrator (it has no nctv_format); a model's own "
                         "config.json cannot be loaded as a calibrator.")
    if version > FORMAT_VERSION:
        raise ValueError(f"{path} was written by a newer NCTV (format {version}; this one reads up to "
                         f"{FORMAT_VERSION}): upgrade nctv.")
    for key in ("params", "fitted", "model", "data_config"):
        if not isinstance(config.get(key) or {}, dict):
            raise ValueError(f"{path}: {key!r} must be a JSON object; it was not written by save_pretrained.")
    for key, value in (config.get("fitted") or {}).items():
        if not _FITTED_NAME.fullmatch(key):
            raise ValueError(f"{path}: {key!r} is not a fitted value's name (they end in '_').")
    return config


def _registry_class(config: dict):
    """The class and registry entry named in a config, from the registry only (never an import by name)."""
    from nctv.calibration.registry import METHODS, calibration_class

    spec = METHODS.get(config.get("method"))
    if spec is None or spec.cls != config.get("class"):
        raise ValueError(f"The saved method {config.get('method')!r} (class {config.get('class')!r}) is not one of "
                         f"NCTV's methods: {', '.join(METHODS)}.")
    return calibration_class(spec.cls), spec


def _references(config: dict, folder: Path) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Tensor name in the file -> (where config.json names it, whether it comes back as a numpy array)."""
    found: dict[str, tuple[tuple[str, ...], bool]] = {}

    def walk(value: Any, path: tuple[str, ...]) -> None:
        if isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, (*path, str(i)))
        elif isinstance(value, dict) and _TENSOR in value:
            if not isinstance(value[_TENSOR], str):
                raise ValueError(f"{folder / CONFIG_NAME}: {'.'.join(path)} names a tensor by {value[_TENSOR]!r}, "
                                 "not by a name; it was not written by save_pretrained.")
            found[value[_TENSOR]] = (path, bool(value.get("numpy")))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, (*path, k))

    for section in ("params", "fitted"):
        walk(config.get(section) or {}, (section,))
    return found


# safetensors' dtype names of floating-point tensors; those numpy holds too (no bfloat16).
_FLOATS = ("F16", "BF16", "F32", "F64")
_NUMPY_FLOATS = ("F16", "F32", "F64")
# ODIR's tables of which cross-validation fits converged and were refined: booleans.
_FLAGS = ("cv_converged_", "cv_refined_")
# Settings saved as tensors other than input_range: lists of numbers (a grid of λ, of γ).
_MAX_SETTING_VALUES = 2**16


class _Expected:
    """The shape each tensor of a calibrator must have, from the model given or the config."""

    def __init__(self, config: dict, model: Any, cls: Any):
        self.input_shape = self._input_shape(config, model)
        self.classes = getattr(model, "num_classes", None)  # a LoadedModel knows its class count
        # The shapes the class itself declares for its fitted tensors (from config.json's numbers).
        self.declared = cls.saved_shapes(config.get("params") or {}, config.get("fitted") or {}, self.classes)
        # and its input range (α, β). An unclamped SGD fit from Theorem 1's δ̃ (whose entries reach β − α)
        # can step a little past β − α; twice that would move an input off every image, which no fit does.
        bounds = getattr(model, "input_range", None)
        self.delta_bound = 2 * float((bounds[1] - bounds[0]).abs().max()) if bounds is not None else None
        params = config.get("params") or {}
        self.grid = self._grid_length(params) if {"grid_step", "t_max"} <= params.keys() else None
        # ODIR's cross-validation tables: one row per λ, one column per μ.
        self.cv = [len(params.get(k)) if isinstance(params.get(k), list) else None for k in ("lambdas", "mus")]

    @staticmethod
    def _input_shape(config: dict, model: Any) -> tuple[int, ...] | None:
        shape = getattr(model, "input_shape", None)  # a LoadedModel's own; else what the config records
        if shape is not None:
            return tuple(shape)
        size = (config.get("data_config") or {}).get("input_size")
        if size is None:
            return None
        if (not isinstance(size, list) or not 1 <= len(size) <= 4
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in size)
                or math.prod(size) > MAX_INPUT_VALUES):
            raise ValueError(f"The calibrator's data_config.input_size {size!r} is not an input shape (1 to 4 whole "
                             f"numbers, at most {MAX_INPUT_VALUES:,} values in all).")
        return tuple(size)

    @staticmethod
    def _grid_length(params: dict) -> int:
        step, t_max = check_finite(params["grid_step"], "grid_step"), check_finite(params["t_max"], "t_max")
        ratio = t_max / step if step > 0 else -1.0  # a tiny step makes it inf, not an error
        if not (math.isfinite(ratio) and ratio >= 1):
            raise ValueError(f"The calibrator's temperature grid (grid_step {step!r}, t_max {t_max!r}) is not a grid "
                             "of positive temperatures a computer can hold.")
        return int(math.floor(ratio * (1 + 1e-12)))  # as temperature_grid counts it

    def problem(self, path: tuple[str, ...], shape: list[int], shapes: dict[tuple[str, ...], list]) -> str | None:
        """What is wrong with a tensor of ``shape`` named at ``path`` (None: nothing); ``shapes``: those of
        all the calibrator's tensors, by path."""
        key = path[1] if len(path) > 1 else ""
        if path[0] == "fitted" and key in self.declared and len(path) == 2:
            want = self.declared[key]
            fits = len(shape) == len(want) and all(w is None or s == w for s, w in zip(shape, want))
            return None if fits else f"{['any' if w is None else w for w in want]}"
        if path[0] == "fitted" and key == "delta_":
            if self.input_shape is not None:
                return None if tuple(shape) == self.input_shape else f"the model's input shape {list(self.input_shape)}"
            return None if 1 <= len(shape) <= 4 and math.prod(shape) <= MAX_INPUT_VALUES else \
                f"one model input (1 to 4 dimensions, at most {MAX_INPUT_VALUES:,} values)"
        if path[0] == "params" and key == "input_range":
            target = self.input_shape or (1,) * len(shape)
            fits = len(shape) <= len(target) and all(a in (1, b) for a, b in zip(shape[::-1], target[::-1]))
            return None if fits and math.prod(shape) <= MAX_INPUT_VALUES else \
                f"a shape that broadcasts to one model input{f' {list(self.input_shape)}' if self.input_shape else ''}"
        if path[0] == "fitted" and key in ("weight_", "bias_"):
            bias = shapes.get(("fitted", "bias_"))  # K, when no model says it (logit calibrators need none)
            known = isinstance(bias, list) and len(bias) == 1 and isinstance(bias[0], int) and bias[0] >= 2
            k = self.classes or (bias[0] if known else None)
            if k is None:
                return "[K] with K >= 2 classes" if key == "bias_" else "[K, K], K the length of bias_"
            want = [k, k] if key == "weight_" else [k]
            return None if shape == want else f"{want} ({k} classes)"
        if path[0] == "fitted" and key in ("grid_", "ece_grid_"):
            if self.grid is None:
                return "none: it has no grid_step and t_max"
            return None if shape == [self.grid] else f"[{self.grid}] (the grid its grid_step and t_max give)"
        if path[0] == "fitted" and key in ("cv_nll_",) + _FLAGS:
            return None if shape == self.cv else f"{self.cv} (one row per lambda, one column per mu)"
        if path[0] == "params":
            return None if len(shape) <= 1 and math.prod(shape) <= _MAX_SETTING_VALUES else \
                f"a list of at most {_MAX_SETTING_VALUES:,} numbers"
        return "none: NCTV saves no such tensor"


def _read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (the tensors' dtypes, shapes and offsets), its size capped."""
    size = path.stat().st_size
    if size > MAX_TENSORS_BYTES:
        raise ValueError(f"{path} is larger than {MAX_TENSORS_BYTES:,} bytes (NCTV_MAX_CALIBRATOR_BYTES); a saved "
                         "calibrator's tensors are far smaller.")
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= size - 8:
            raise ValueError(f"{path} is not a safetensors file (its header length is wrong); save the calibrator "
                             "again.")
        if n > MAX_HEADER_BYTES:  # checked before the header is read, let alone parsed
            raise ValueError(f"{path} has a header of {n:,} bytes; a saved calibrator's takes a few hundred "
                             f"(at most {MAX_HEADER_BYTES:,}, NCTV_MAX_HEADER_BYTES). It was not written by "
                             "save_pretrained.")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError, RecursionError):
            header = None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        raise ValueError(f"{path} is not a safetensors file (its header is not valid); save the calibrator again.")
    header.pop("__metadata__", None)
    return header


def _read_tensors(path: Path, references: dict[str, tuple], expected: _Expected) -> dict[str, torch.Tensor]:
    """The tensors config.json names, each checked from the file's header before any data is read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    header = _read_header(path)
    missing = [name for name in references if name not in header]
    if missing:
        raise ValueError(f"{path} lacks the tensor {missing[0]!r} that config.json names; the two files do not "
                         "belong together. Save the calibrator again.")
    extra = [name for name in header if name not in references]
    if extra:
        raise ValueError(f"{path} holds tensors that config.json does not name ({', '.join(map(repr, extra[:3]))}); "
                         "it was not written by save_pretrained.")
    shapes = {where: header[name].get("shape") for name, (where, _) in references.items()}
    for name, (where, is_numpy) in references.items():
        dtype, shape = header[name].get("dtype"), shapes[where]
        if not isinstance(shape, list) or not all(isinstance(v, int) and v >= 0 for v in shape):
            raise ValueError(f"{path}: the tensor {name!r} has no valid shape; save the calibrator again.")
        kinds = ("BOOL",) if where[-1] in _FLAGS else _NUMPY_FLOATS if is_numpy else _FLOATS
        if dtype not in kinds:
            raise ValueError(f"The calibrator's {'.'.join(where)} is stored as {dtype}; it must hold "
                             f"{'true/false values' if kinds == ('BOOL',) else 'floating-point numbers'}. It was not "
                             "written by save_pretrained.")
        wrong = expected.problem(where, shape, shapes)
        if wrong:
            raise ValueError(f"The calibrator's {'.'.join(where)} has shape {shape}; it must have {wrong}. It does "
                             "not belong to this model: load the calibrator saved for it.")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} could not be read as safetensors ({e}); save the calibrator again.") from None


def _decode(value: Any, tensors: dict[str, torch.Tensor], sequence: type = list) -> Any:
    """A value from its JSON form: tensor references resolved (all are known present), arrays as ``sequence``."""
    if isinstance(value, list):
        return sequence(_decode(v, tensors, sequence) for v in value)
    if isinstance(value, dict) and _TENSOR in value:
        t = tensors[value[_TENSOR]]
        return t.numpy() if value.get("numpy") else t
    if isinstance(value, dict):
        return {k: _decode(v, tensors, sequence) for k, v in value.items()}
    return value


# Fitted values that are tensors in every saved calibrator; a number there would broadcast silently.
_TENSORS = ("delta_", "weight_", "bias_", "grid_", "ece_grid_")


def _check_fitted(fitted: dict, spec: Any, folder: Path, delta_bound: float | None,
                  declared: tuple[str, ...] = ()) -> None:
    """Refuse fitted numbers no fitter produces: non-finite, out of range, or of the wrong kind.
    ``delta_bound``: twice the width of the model's input range, which no entry of δ may exceed;
    ``declared``: the tensors the class declares (``saved_shapes``), which must be finite too."""

    path = folder / CONFIG_NAME
    missing = [k for k in spec.fitted if k not in fitted]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}, which {spec.name} needs; save the calibrator again.")
    for key in (k for k in dict.fromkeys((*_TENSORS, *declared)) if k in fitted):
        if not isinstance(fitted[key], (torch.Tensor, np.ndarray)):
            raise ValueError(f"{path}: {key} must be a tensor in {TENSORS_NAME}; got {fitted[key]!r}.")
        t = torch.as_tensor(fitted[key])
        # ece_grid_ is NaN where the grid search proved a temperature cannot win; never infinite.
        if bool((t.isinf() if key == "ece_grid_" else ~t.isfinite()).any()):
            raise ValueError(f"The calibrator's {key} holds NaN or infinite values; no fit produces them. Fit and "
                             "save the calibrator again.")
    if delta_bound is not None and "delta_" in fitted:
        largest = float(torch.as_tensor(fitted["delta_"]).abs().max())
        if largest > delta_bound:
            raise ValueError(f"The calibrator's δ moves inputs by up to {largest:.3g}, more than twice the model's "
                             f"whole input range ({delta_bound / 2:.3g}); no fit produces that. Fit and save it again.")
    if "temperature_" in fitted:
        t = _number(fitted["temperature_"], "temperature T", path)
        if not T_MIN <= t <= T_MAX:
            raise ValueError(f"The calibrator's temperature T = {t:g} is outside [{T_MIN:g}, {T_MAX:g}], where every "
                             "NCTV fitter searches (T <= 0 would flip or void the confidences). Fit it again.")
    for key, check in (("fitted_temperature_", _positive), ("gamma_", check_gamma),
                       ("weight_decay_", check_nonnegative), ("lambda_", check_nonnegative),
                       ("mu_", check_nonnegative)):
        if key in fitted:
            check(_number(fitted[key], key, path), f"The calibrator's {key}")


def _number(value: Any, name: str, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}: {name} must be a number; got {value!r}.")
    return check_finite(value, f"The calibrator's {name}")


def _positive(value: float, name: str) -> float:
    if value <= 0:
        raise ValueError(f"{name} must be greater than 0; got {value!r}.")
    return value


def saved_for(config: dict) -> str:
    """How a config names the model its calibrator was fitted for, in words."""
    saved = config.get("model") or {}
    if saved.get("name"):
        return repr(saved["name"])
    return f"a {saved['class']} model" if saved.get("class") else "an unrecorded model"


def _check_model(config: dict, module: torch.nn.Module | None, spec: Any) -> None:
    from nctv.cache import model_fingerprint

    fingerprint = (config.get("model") or {}).get("fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise ValueError(f"The calibrator's model fingerprint {fingerprint!r} is not a fingerprint; it was not "
                         "written by save_pretrained.")
    if module is None:
        if spec.needs_model:
            raise ValueError(f"{spec.name} works on the model's inputs: pass the model it was fitted for "
                             f"(load_calibrator(..., model=...)); it was saved for {saved_for(config)}.")
        return
    if spec.needs_model and not fingerprint:
        # save_pretrained always records it for Neural Clamping (δ belongs to one model's inputs).
        raise ValueError(f"This {spec.name} calibrator does not record the fingerprint of the model it was fitted "
                         "for, so nothing shows that its δ suits the model given; save it again with "
                         "save_pretrained.")
    if fingerprint and model_fingerprint(module) != fingerprint:
        warnings.warn(f"This {spec.name} calibrator was fitted for {saved_for(config)} (fingerprint "
                      f"{fingerprint[:12]}…), but the model given ({type(module).__name__}) has other weights; its "
                      "calibration may not suit it. Load the model it was saved for.", ModelMismatchWarning,
                      stacklevel=3)


def calibrator_folder(source: str | os.PathLike) -> Path:
    """The local folder of a saved calibrator: a path, ``local-dir:<path>`` or ``hf-hub:<org>/<name>[@rev]``."""
    text = os.fspath(source).strip() if isinstance(source, (str, os.PathLike)) else None
    if not text:
        raise ValueError("Give a calibrator folder written by save_pretrained, or a Hub repository as "
                         "hf-hub:<org>/<name>.")
    prefix, sep, rest = text.partition(":")
    if sep and prefix.lower() in ("hf-hub", "hf_hub"):
        return _hub_folder(rest)
    folder = Path(rest if sep and prefix.lower() == "local-dir" else text).expanduser()
    if not folder.is_dir():
        raise ValueError(f"Calibrator folder {folder} does not exist; give a folder written by save_pretrained, "
                         "or a Hub repository as hf-hub:<org>/<name>.")
    for name in (CONFIG_NAME, TENSORS_NAME):
        if not (folder / name).is_file():
            raise ValueError(f"{folder} has no {name}, so it is not a saved calibrator; a calibrator folder holds "
                             f"{CONFIG_NAME} and {TENSORS_NAME} (written by save_pretrained).")
    return folder


def _hub_folder(text: str) -> Path:
    """The cached snapshot folder of a calibrator on the Hub, downloading its two files once."""
    from huggingface_hub import constants

    from nctv.hub import hub_errors, snapshot_folder
    from nctv.zoo import parse_model_id

    source, _ = parse_model_id(f"hf-hub:{text}")  # checks the id and revision
    repo, revision = source.location, source.revision
    offline = ValueError(f"Calibrator 'hf-hub:{repo}' is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                         "and the Hub cannot be reached (no connection, or HF_HUB_OFFLINE=1); connect once to "
                         "download it, or load a saved folder instead.")
    missing = f"is not a saved NCTV calibrator: it lacks {CONFIG_NAME} or {TENSORS_NAME}"

    def errors(filename: str):
        return hub_errors("Calibrator", repo, revision, filename, missing, lambda _: offline)

    return snapshot_folder(repo, (CONFIG_NAME, TENSORS_NAME), revision, errors=errors, offline_error=lambda _: offline)
