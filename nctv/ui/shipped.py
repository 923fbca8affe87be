"""The pre-computed result shipped with the app (``assets/precomputed``, made by
``scripts/make_precomputed.py``): the first result a visitor sees, and the Learn tab's
fallback when the visitor has not run a calibration.

Another model of the menu may have its own pre-computed study (made by the same script with
``--model``): in ``assets/precomputed/models/<name>/``, or in the folder ``<name>/`` of the Hugging
Face dataset repository the operator names in ``NCTV_PRECOMPUTED_REPO`` (``org/name[@revision]``),
downloaded once through the Hub's cache. Those files come from the network, so every value is
checked before use (:func:`check_run`, and each study's own ``from_dict`` checks).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from nctv.data import assets_dir
from nctv.ui.caches import get_logits, get_ood_detector, mark_view_only
from nctv.ui.session import NC_METHODS, TS_METHOD, Calibration, SplitSpec

PRECOMPUTED_LABEL = "pre-computed, shipped with the app"
#: The Hub dataset repository (``org/name[@revision]``) holding the menu models' pre-computed studies.
PRECOMPUTED_REPO_VARIABLE = "NCTV_PRECOMPUTED_REPO"
#: A run's files: the result, with every method's test logits (both needed), and NC's δ.
RUN_FILES = ("results.json", "test_logits.safetensors", "delta.safetensors")
#: The studies beside a run: the γ sweep, the initialisation study, the shift study.
STUDY_FILES = ("gamma_sweep.json", "init_study.json", "shift.json", "ood.safetensors")


def precomputed_dir() -> Path:
    return assets_dir() / "precomputed"


def shipped_study(name: str) -> tuple[dict, Path] | None:
    """The study file ``name`` shipped beside the pre-computed result (its data and path), or None."""
    import json

    path = precomputed_dir() / name
    return (json.loads(path.read_text(encoding="utf-8")), path) if path.is_file() else None


def examples_dir() -> Path:
    return precomputed_dir() / "examples"


@dataclass
class Precomputed:
    """The shipped result for the default model (``scripts/make_precomputed.py``): the run's
    ``RunResult`` with every method's calibrated test logits attached, and NC's δ."""

    result: Any
    calibration: Calibration

    @property
    def split(self) -> SplitSpec:
        """The splits the shipped result was made on (its calibration's split)."""
        return self.calibration.split


@lru_cache(maxsize=8)
def load_precomputed(model: str | None = None) -> Precomputed | None:
    """Read ``assets/precomputed`` (None when it is absent: the app then starts without it), or with
    ``model`` (a menu name) that model's pre-computed study, wherever :func:`study_folder` finds it
    (None when there is none). A study's files are checked before use; a bad one is an error."""
    from nctv.results import RunResult

    folder = precomputed_dir() if model is None else study_folder(model)
    needed = RUN_FILES if model is None else RUN_FILES[:2]
    if folder is None or not all((folder / n).is_file() for n in needed):
        return None
    if model is None:
        result = RunResult.load(folder)
    else:
        try:
            result = RunResult.load(folder)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"The pre-computed study in {folder} cannot be shown: {_why(e)}") from None
        check_run(result, model, folder)
    nc = next((n for n in NC_METHODS if n in result.methods), None)
    cal = Calibration(
        # scripts/make_precomputed.py uses one seed for the calibration draw and the run, and the whole test pool.
        # A menu model's study may use part of the test pool (make_precomputed --test-size): the same draw.
        split=SplitSpec(result.model["name"], result.settings.get("dataset"), int(result.calibration["size"]),
                        int(result.seeds[0]), None if model is None else int(result.test["size"])),
        model=result.model["name"],
        ts_temperature=float(result.methods[TS_METHOD].params["temperature"]),
        nc_temperature=float(result.methods[nc].params["temperature"]) if nc else None,
        delta=result.methods[nc].delta if nc else None,
        nc_method=nc,
        source=PRECOMPUTED_LABEL,
        n_bins=result.bins[0],
        settings=dict(result.settings),
        metrics=test_metrics(result, result.bins[0]),
    )
    if model is not None and _downloaded(cal.split):
        mark_view_only(cal.split)
    return Precomputed(result, cal)


def _downloaded(spec: SplitSpec) -> bool:
    """Whether ``spec``'s pictures come from a download (not the embedded Fashion-MNIST)."""
    from nctv.zoo import ENTRIES

    entry = ENTRIES.get(spec.model)
    dataset = spec.dataset or (entry.datasets[0] if entry is not None and entry.datasets else None)
    return dataset != "fashion-mnist"


def study_folder(model: str) -> Path | None:
    """Where the pre-computed study of menu model ``model`` lies: ``assets/precomputed`` for the
    embedded default, ``assets/precomputed/models/<name>/``, else ``<name>/`` in the Hub dataset
    repository named by ``NCTV_PRECOMPUTED_REPO`` (downloaded once, then read from the cache); None
    when there is none, or when ``model`` is not a menu name (nothing else becomes a path)."""
    import os

    from nctv.zoo import DEFAULT_MODEL, ENTRIES

    if model not in ENTRIES:
        return None
    if model == DEFAULT_MODEL:
        return precomputed_dir()
    local = precomputed_dir() / "models" / model
    if (local / RUN_FILES[0]).is_file():
        return local
    repo = os.environ.get(PRECOMPUTED_REPO_VARIABLE, "").strip()
    return _hub_study(repo, model) if repo else None


def _hub_study(spec: str, model: str) -> Path | None:
    """The folder ``model/`` of Hub dataset repository ``spec`` (``org/name[@revision]``) in the local
    cache, with the files of :data:`RUN_FILES` and :data:`STUDY_FILES` it has (those it lacks are
    skipped); None when it has no ``results.json``. A study once cached is used as it is (no update
    check, as with models); else it is downloaded when the Hub can be reached."""
    from nctv.hub import hub_reachable
    from nctv.zoo import parse_model_id

    source, _ = parse_model_id(f"hf-hub:{spec}")  # the same checks as a model id
    folder = _study_files(source.location, source.revision, model, local_only=True)
    if folder is None and hub_reachable():
        folder = _study_files(source.location, source.revision, model, local_only=False)
    return folder


def _study_files(repo: str, revision: str | None, model: str, local_only: bool) -> Path | None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    from nctv.hub import hub_errors

    folder = None
    for name in RUN_FILES + STUDY_FILES:
        try:
            with hub_errors("The pre-computed studies", repo, revision, name, "lack a file", EntryNotFoundError):
                try:
                    path = hf_hub_download(repo, f"{model}/{name}", repo_type="dataset", revision=revision,
                                           local_files_only=local_only, library_name="nctv")
                except EntryNotFoundError:  # not in the repository, or not cached
                    path = None
        except ValueError as e:  # the repository is missing, gated or has no such revision
            raise ValueError(f"{e} Check {PRECOMPUTED_REPO_VARIABLE}.") from None
        if path is None and name == RUN_FILES[0]:
            return None
        folder = folder if path is None else Path(path).parent
    return folder


def check_run(result: Any, model: str, folder: Path) -> None:
    """Refuse a pre-computed run from ``folder`` that is not ``model``'s, or whose values could not be
    shown as they are: labels outside the classes, test logits of another shape or not finite, a δ
    or a temperature that is not finite, a figure that is not a number."""
    import math

    where = f"The pre-computed study in {folder}"
    if result.model.get("name") != model:
        raise ValueError(f"{where} is of model {result.model.get('name')!r}, not {model!r}.")
    k, labels = int(result.n_classes), result.test_labels
    if k < 2 or len(result.class_names) != k:
        raise ValueError(f"{where} names {len(result.class_names)} classes for {k} outputs.")
    if (labels is None or labels.ndim != 1 or labels.dtype != torch.int64 or len(labels) != int(result.test["size"])
            or (len(labels) and not (0 <= int(labels.min()) and int(labels.max()) < k))):
        raise ValueError(f"{where}: its test labels must be {result.test['size']} class indices below {k}.")
    if TS_METHOD not in result.methods or not result.bins:
        raise ValueError(f"{where} lacks {TS_METHOD} or its bins.")
    for name, m in result.methods.items():
        z = m.test_logits
        if z is None or tuple(z.shape) != (len(labels), k) or not z.is_floating_point() or not torch.isfinite(z).all():
            raise ValueError(f"{where}: the test logits of {name} must be {len(labels)} × {k} finite numbers.")
        if m.delta is not None and (m.delta.ndim != 3 or not m.delta.is_floating_point()
                                    or not torch.isfinite(m.delta).all()):
            raise ValueError(f"{where}: the δ of {name} must be an image of finite numbers.")
        t = m.params.get("temperature")
        if t is not None and not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"{where}: the temperature of {name} must be a positive number.")
        for per in m.metrics.values():
            if any(not (isinstance(v.mean, (int, float)) and math.isfinite(v.mean)) for v in per.values()):
                raise ValueError(f"{where}: a figure of {name} is not a finite number.")


def study_of(model: str | None, name: str) -> tuple[dict, Path] | None:
    """The study file ``name`` (γ sweep, initialisation, shift) beside ``model``'s pre-computed run
    (None: the embedded default's), checked by the study's own reader; None when there is none."""
    import json

    from nctv.calibration.studies import GammaSweep, InitStudy
    from nctv.results import GAMMA_SWEEP_FILE, INIT_STUDY_FILE
    from nctv.shift import SHIFT_FILE, ShiftResult

    folder = precomputed_dir() if model is None else study_folder(model)
    path = None if folder is None else folder / name
    if path is None or not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    reader = {GAMMA_SWEEP_FILE: GammaSweep.from_dict, INIT_STUDY_FILE: InitStudy.from_dict,
              SHIFT_FILE: ShiftResult.from_dict}[name]
    try:
        reader(data)
        if model is not None and (data.get("model") or {}).get("name") != model:
            raise ValueError(f"it is of model {(data.get('model') or {}).get('name')!r}, not {model!r}")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"The pre-computed {name} in {folder} cannot be shown: {_why(e)}") from None
    return data, path


def menu_study_view(view: Any, model: Any, hub_id: Any, outputs: int) -> tuple:
    """What a study tab shows when a menu model is picked: ``view(model)``, that model's pre-computed
    study (None where it has none); else, or with a Hub id typed, ``gr.skip()`` for each of its
    ``outputs`` (the tab stays as it is). A study that fails its checks: the reason in the status."""
    import gradio as gr

    keep = tuple(gr.skip() for _ in range(outputs))
    if (isinstance(hub_id, str) and hub_id.strip()) or not isinstance(model, str):
        return keep
    try:
        shown = view(model)
    except ValueError as e:
        return (f"**No pre-computed study shown:** {e}",) + keep[1:]
    return keep if shown is None else shown


def _why(error: Exception) -> str:
    return f"it lacks {error}" if isinstance(error, KeyError) else str(error)


def test_metrics(result: Any, n_bins: int) -> dict[str, dict[str, float]]:
    """{method: {metric: mean}} (fractions) of a ``RunResult`` at ``n_bins`` bins, and where the run has
    them, each metric's interval as ``<metric>_low`` and ``<metric>_high`` (the Learn tab's lesson)."""
    def of(stats: dict) -> dict[str, float]:
        out = {k: s.mean for k, s in stats.items()}
        out.update({f"{k}_{end}": getattr(s, f"ci_{end}") for k, s in stats.items() if s.ci_low is not None
                    for end in ("low", "high")})
        return out
    return {name: of(m.metrics[n_bins]) for name, m in result.methods.items()}


def test_logits_of(cal: Calibration | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Unperturbed test logits, labels and a description for the Learn tab: the visitor's run,
    else the pre-computed result in use (a menu model's, or the shipped default's), read, not run."""
    if cal is not None and cal.split is not None and cal.source != PRECOMPUTED_LABEL:
        z, y = get_logits(cal.split, "test")
        return z, y, f"{cal.model}, test split of your run"
    pre = load_precomputed(None if cal is None else cal.model)
    if pre is None:
        raise ValueError("No calibration yet: run one in the Calibrate tab first.")
    r = pre.result
    where = f"{r.model['name']}, {r.test['name']} ({PRECOMPUTED_LABEL})"
    return r.methods["Uncalibrated"].test_logits, r.test_labels, where


@lru_cache(maxsize=8)
def shipped_detector(spec: SplitSpec) -> Any:
    """The out-of-distribution detector shipped beside ``spec.model``'s pre-computed study
    (``ood.safetensors``, :func:`nctv.ood.save_detector`) when it was fitted on the very draw ``spec``
    names; None otherwise, or when it fails its checks (logged: the detector is then fitted anew).
    Looked up once per draw and server, as the study itself is (``load_precomputed``): the Try tab
    asks before every picture until a detector is held, and the lookup may reach the Hub's cache."""
    import dataclasses
    import logging

    from nctv.ood import OOD_FILE, load_detector, split_about

    try:
        folder = study_folder(spec.model)
        path = None if folder is None else folder / OOD_FILE
        if path is None or not path.is_file():
            return None
        detector, about = load_detector(path)
    except ValueError as e:
        logging.getLogger(__name__).warning("%s It is fitted on the calibration images instead.", e)
        return None
    return detector if about == split_about(**dataclasses.asdict(spec)) else None


def ood_detector(spec: SplitSpec) -> Any:
    """``spec``'s out-of-distribution detector: the shipped one (:func:`shipped_detector`) when there
    is one for that draw, so that a pre-computed calibration's Try tab needs neither its calibration
    images nor a model pass over them; else fitted on them (``nctv.ui.caches.get_ood_detector``)."""
    return get_ood_detector(spec, lambda: shipped_detector(spec))


NO_STUDY = ("No shift study is shipped with this copy of the app (assets/precomputed/shift.json); "
            "`nctv shift` makes one.")


@lru_cache(maxsize=1)
def shipped_shift() -> ShiftResult | None:
    """The shift study shipped beside the pre-computed result, read and checked once (None when absent)."""
    from nctv.shift import SHIFT_FILE, ShiftResult

    path = precomputed_dir() / SHIFT_FILE
    return ShiftResult.load(path) if path.is_file() else None
