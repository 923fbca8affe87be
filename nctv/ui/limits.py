"""The operator's limits (read from the environment) and what a visitor may pick under them: the model and dataset menus, and the
checks that turn a visitor's choice into a model and dataset name this server allows.
"""
from __future__ import annotations

import os
from pathlib import Path

from nctv.checks import shown
from nctv.data import DATASETS, allowed_folder
from nctv.settings import hub_datasets_available

DEFAULT_DATASET_CHOICE = "model's own dataset"

# Safe by default on a public server: no server folders, Hub models of bounded size, few in memory.
# docs/app.md, "Running a public copy", lists every variable.

#: Models held in memory at once unless ``$NCTV_MAX_MODELS`` says otherwise.
DEFAULT_MAX_MODELS = 3


def data_roots() -> list[Path]:
    """Folders inside which visitors may name image folders as datasets: ``$NCTV_DATA_ROOTS``
    (separated by ``os.pathsep``); none when unset."""
    return [Path(p) for p in os.environ.get("NCTV_DATA_ROOTS", "").split(os.pathsep) if p.strip()]


def hub_datasets_allowed() -> bool:
    """Whether visitors may name Hugging Face datasets (``$NCTV_HUB_DATASETS=1``); off by default:
    the menu's datasets serve the menu's models, and a typed repository is anyone's data (its
    download is capped all the same: nctv.hubdata)."""
    return os.environ.get("NCTV_HUB_DATASETS", "").strip().lower() in ("1", "true", "yes")


def model_choices() -> list[tuple[str, str]]:
    """(label, name) pairs for the model menu: embedded models first, then the Hub entries."""
    from nctv.zoo import list_models

    out = []
    for e in list_models():
        where = "embedded, offline" if e.embedded else "Hugging Face Hub, needs the network once"
        out.append((f"{e.name} ({where})", e.name))
    return out


def dataset_choices() -> list[str]:
    return [DEFAULT_DATASET_CHOICE] + named_datasets()


def named_datasets() -> list[str]:
    """The datasets of :data:`nctv.data.DATASETS` named by a word (not a pattern such as ``folder:<path>``)."""
    return [k for k in DATASETS if "<" not in k]


def accepted_datasets() -> str:
    """What the dataset box takes on this server, in words: the listed names, and the patterns its
    operator allows (see :func:`dataset_hint`)."""
    names = [f"the {DEFAULT_DATASET_CHOICE}"] + named_datasets()
    if data_roots():
        names.append("folder:/path inside " + " or ".join(str(r) for r in data_roots()))
    if hub_datasets_allowed() and hub_datasets_available():
        names.append("hf-dataset:org/name@split")
    return f"{', '.join(names[:-1])} or {names[-1]}"


def dataset_hint() -> str | None:
    """What else the dataset box takes on this server (None: only the listed datasets): folders
    where the operator allows some, ``hf-dataset:`` where allowed and ``datasets`` is installed."""
    ways = (["folder:/path (one sub-folder per class)"] * bool(data_roots())
            + ["hf-dataset:org/name@split"] * (hub_datasets_allowed() and hub_datasets_available()))
    return f"Or type {' or '.join(ways)}" if ways else None


def resolve_model_name(choice: str | None, hub_id: str | None) -> str:
    """The model to use: the typed Hub id when there is one, else the menu choice."""
    typed = (hub_id or "").strip()
    if typed:
        if typed.lower().startswith("local-dir:"):
            raise ValueError("This box takes a Hugging Face Hub model id such as timm/resnet18.a1_in1k; "
                             "local folders are used through the nctv command instead.")
        # An <org>/<name> is said to be a Hub id, so that no server folder of that name is looked at.
        return f"hf-hub:{typed}" if "/" in typed and ":" not in typed else typed
    if not choice:
        raise ValueError("Pick a model from the list (or type a Hugging Face Hub id).")
    return str(choice)


def resolve_dataset(choice: str | None) -> str | None:
    """The dataset to use (None: the model's own), refused at once when this server does not
    allow it (see :func:`data_roots`, :func:`hub_datasets_allowed`)."""
    text = (choice or "").strip()
    if text in ("", DEFAULT_DATASET_CHOICE):
        return None
    if text.startswith("hf-dataset:") and not hub_datasets_allowed():
        raise ValueError("This server does not download Hugging Face datasets (its operator has not allowed them: "
                         "NCTV_HUB_DATASETS); pick a dataset from the list.")
    if text.startswith("folder:"):
        # Refused in one sentence that names no folder, the same whether it exists or not.
        allowed_folder(text[len("folder:"):], data_roots())  # before any model loads
    elif not text.startswith("hf-dataset:") and text not in named_datasets():
        raise ValueError(unaccepted(text))
    return text


def unaccepted(text: str) -> str:
    """The one sentence that refuses a typed dataset: what this server accepts instead."""
    return f"This server accepts {accepted_datasets()} as the dataset, not {shown(text)}."


def dataset_refusal(choice: str | None) -> str:
    """The dataset box's note: empty for a dataset this server takes, else why not (said before Run)."""
    try:
        resolve_dataset(choice)
    except ValueError as e:
        return f"**Not accepted** — {e}"
    return ""
