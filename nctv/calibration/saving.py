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
import os
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from nctv import __version__
from nctv.calibration.base import BaseCalibrator, NotFittedError

__all__ = ["FORMAT_VERSION", "CONFIG_NAME", "TENSORS_NAME", "ModelMismatchWarning", "save_calibrator",
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
    from nctv.calibration import METHODS

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
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = calibrator_folder(source)
    config = read_config(folder)
    cls, spec = _registry_class(config)
    try:
        tensors = load_file(str(folder / TENSORS_NAME))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{folder / TENSORS_NAME} could not be read as safetensors ({e}); save the calibrator "
                         "again.") from None
    # Settings come back as tuples (the constructors' own defaults are tuples); fitted lists stay lists.
    params = _decode(config.get("params", {}), tensors, folder, tuple)
    unknown = [k for k in params if k not in cls._param_names()]
    if unknown:
        raise ValueError(f"{folder / CONFIG_NAME} has settings this NCTV does not know ({', '.join(unknown)}); "
                         "it may come from a newer version: upgrade nctv.")
    module = _module(model)
    _check_model(config, module, spec)
    calibrator = cls(module, **params) if spec.needs_model else cls(**params)
    for key, value in _decode(config.get("fitted", {}), tensors, folder).items():
        if not _FITTED_NAME.fullmatch(key):
            raise ValueError(f"{folder / CONFIG_NAME}: {key!r} is not a fitted value's name (they end in '_').")
        setattr(calibrator, key, value)
    return calibrator


def read_config(folder: Path) -> dict:
    """The checked ``config.json`` of a saved calibrator folder."""
    path = Path(folder) / CONFIG_NAME
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); save the calibrator again.") from None
    version = config.get("nctv_format") if isinstance(config, dict) else None
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"{path} is not a saved NCTV calibrator (it has no nctv_format); a model's own "
                         "config.json cannot be loaded as a calibrator.")
    if version > FORMAT_VERSION:
        raise ValueError(f"{path} was written by a newer NCTV (format {version}; this one reads up to "
                         f"{FORMAT_VERSION}): upgrade nctv.")
    return config


def _registry_class(config: dict):
    """The class and registry entry named in a config, from the registry only (never an import by name)."""
    from nctv.calibration import METHODS, __getattr__ as calibration_class

    spec = METHODS.get(config.get("method"))
    if spec is None or spec.cls != config.get("class"):
        raise ValueError(f"The saved method {config.get('method')!r} (class {config.get('class')!r}) is not one of "
                         f"NCTV's methods: {', '.join(METHODS)}.")
    return calibration_class(spec.cls), spec


def _decode(value: Any, tensors: dict[str, torch.Tensor], folder: Path, sequence: type = list) -> Any:
    """A value from its JSON form: tensor references resolved, arrays as ``sequence``."""
    if isinstance(value, list):
        return sequence(_decode(v, tensors, folder, sequence) for v in value)
    if isinstance(value, dict) and _TENSOR in value:
        t = tensors.get(value[_TENSOR])
        if t is None:
            raise ValueError(f"{folder / TENSORS_NAME} lacks the tensor {value[_TENSOR]!r} that config.json names; "
                             "the two files do not belong together. Save the calibrator again.")
        return t.numpy() if value.get("numpy") else t
    if isinstance(value, dict):
        return {k: _decode(v, tensors, folder, sequence) for k, v in value.items()}
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
    if module is None:
        if spec.needs_model:
            raise ValueError(f"{spec.name} works on the model's inputs: pass the model it was fitted for "
                             f"(load_calibrator(..., model=...)); it was saved for {saved_for(config)}.")
        return
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

    from nctv.hub import snapshot_folder
    from nctv.zoo import parse_model_id

    source, _ = parse_model_id(f"hf-hub:{text}")  # checks the id and revision
    repo, revision = source.location, source.revision
    offline = ValueError(f"Calibrator 'hf-hub:{repo}' is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                         "and the Hub cannot be reached (no connection, or HF_HUB_OFFLINE=1); connect once to "
                         "download it, or load a saved folder instead.")
    return snapshot_folder(repo, (CONFIG_NAME, TENSORS_NAME), revision, errors=lambda _: _hub_errors(repo, revision),
                           offline_error=lambda _: offline)


@contextmanager
def _hub_errors(repo: str, revision: str | None) -> Iterator[None]:
    """What a Hub client error means for the person loading a calibrator; other errors pass unchanged."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    reasons = ((LocalEntryNotFoundError, "is not fully in the Hugging Face cache and could not be downloaded; "
                                         "check the connection and try again"),
               (GatedRepoError, "is gated: accept its terms on the Hub and log in (HF_TOKEN)"),
               (RepositoryNotFoundError, "does not exist on the Hub (or is private: log in with HF_TOKEN)"),
               (RevisionNotFoundError, f"has no revision '{revision}'"),
               (EntryNotFoundError, f"is not a saved NCTV calibrator: it lacks {CONFIG_NAME} or {TENSORS_NAME}"))
    try:
        yield
    except tuple(kind for kind, _ in reasons) as error:
        why = next(why for kind, why in reasons if isinstance(error, kind))
        raise ValueError(f"Calibrator 'hf-hub:{repo}' {why}.") from None
