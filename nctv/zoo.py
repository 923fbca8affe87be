"""Model registry and loading: embedded models, Hugging Face Hub models, local folders.

Every model, embedded or not, is a folder in the Hub's layout — ``config.json`` (timm's format:
``architecture``, ``num_classes``, ``model_args``, ``pretrained_cfg`` with the preprocessing,
``label_names``) and ``model.safetensors`` — and loads through one path: the folder is found
(``local-dir:<path>`` directly, ``hf-hub:<org>/<name>`` through the Hugging Face cache, downloading
once), then ``timm.create_model("local-dir:<folder>", pretrained=True)`` builds it. Weights are read
from safetensors only; pickle checkpoints (``.bin``, ``.pth``) are refused.

A :class:`LoadedModel` carries the frozen model (eval mode, no parameter gradients), its class names,
its timm data config (input_size, mean, std, interpolation, crop_pct), ``preprocess`` (PIL image ->
float32 tensor (C, H, W)), ``input_range`` (α, β: the preprocessed all-black and all-white images, the
feasible input box for Neural Clamping's optional clamp) and its model card. Outputs are **logits**.

The Hub is optional: offline (no network, or ``HF_HUB_OFFLINE=1``) a Hub model loads from the cache
if it was downloaded before, otherwise the error says what is cached; the embedded models never
need the network. A cached snapshot is used as it is (no update check), so results stay
reproducible; delete it from the cache to fetch a newer revision.

``train_classifier`` trains a timm architecture on an in-memory image set with a plain recipe and
saves it in the same layout, with a model card; ``scripts/make_assets.py`` uses it for the embedded
models.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image
from timm.models import register_model

from nctv.data import assets_dir, hub_reachable, image_mode, make_preprocess, preprocess_arrays
from nctv.inference import freeze, resolve_device

__all__ = [
    "DEFAULT_MODEL", "ZooEntry", "LoadedModel", "TrainingResult", "ENTRIES", "list_models", "get_entry",
    "load_model", "parse_model_id", "check_weight_size", "train_classifier", "count_flops", "read_card",
    "nctv_mlp_mixer",
]

DEFAULT_MODEL = "fmnist-resnet-overconfident"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
CARD_NAME = "README.md"
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".pkl", ".ckpt", ".pth.tar")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,99}")


# ----------------------------------------------------------------------------- registry

@dataclass(frozen=True)
class ZooEntry:
    """A named model: where its weights come from and which datasets fit it.

    ``source`` is ``local-dir:<folder>`` (relative folders are inside the shipped assets) or
    ``hf-hub:<org>/<name>``. ``verified_offline`` / ``verified_online`` record honestly what was
    checked: loading offline from the shipped assets, and loading from the Hub with a network.
    ``adapt`` names a documented architecture change needed before the weights fit (see
    :data:`ADAPTERS`).
    """

    name: str
    source: str
    family: str
    datasets: tuple[str, ...]
    description: str
    verified_offline: bool
    verified_online: bool
    adapt: str | None = None

    @property
    def embedded(self) -> bool:
        return self.source.startswith("local-dir:")


_ENTRIES = (
    ZooEntry("fmnist-resnet-overconfident", "local-dir:models/fmnist-resnet-overconfident", "ResNet", ("fashion-mnist",),
             "The small ResNet trained 40 epochs without augmentation or weight decay: strongly over-confident "
             "(test ECE 8 %), like the paper's models; embedded, the default.",
             verified_offline=True, verified_online=False),
    ZooEntry("fmnist-resnet", "local-dir:models/fmnist-resnet", "ResNet", ("fashion-mnist",),
             "Small ResNet (timm resnet10t, reduced widths) trained on Fashion-MNIST; embedded, runs offline.",
             verified_offline=True, verified_online=False),
    ZooEntry("fmnist-vit", "local-dir:models/fmnist-vit", "ViT", ("fashion-mnist",),
             "Small Vision Transformer (timm VisionTransformer, 28×28 input) trained on Fashion-MNIST; embedded.",
             verified_offline=True, verified_online=False),
    ZooEntry("fmnist-mixer", "local-dir:models/fmnist-mixer", "MLP-Mixer", ("fashion-mnist",),
             "Small MLP-Mixer (timm MlpMixer, 28×28 input) trained on Fashion-MNIST; embedded.",
             verified_offline=True, verified_online=False),
    ZooEntry("resnet101-imagenet", "hf-hub:timm/resnet101.tv_in1k", "ResNet", ("imagenet",),
             "ResNet-101 (torchvision weights via timm), ImageNet-1k — the paper's ResNet-101.",
             verified_offline=False, verified_online=False),
    ZooEntry("vit-s16-imagenet", "hf-hub:timm/vit_small_patch16_224.augreg_in21k_ft_in1k", "ViT", ("imagenet",),
             "ViT-S/16 (AugReg, ImageNet-21k → 1k), 224×224 — the paper's ViT-S/16.",
             verified_offline=False, verified_online=False),
    ZooEntry("mixer-b16-imagenet", "hf-hub:timm/mixer_b16_224.goog_in21k_ft_in1k", "MLP-Mixer", ("imagenet",),
             "MLP-Mixer B/16 (Google, ImageNet-21k → 1k), 224×224 — the paper's MLP-Mixer B/16.",
             verified_offline=False, verified_online=False),
    ZooEntry("cifar100-resnet50", "hf-hub:edadaltocg/resnet50_cifar100", "ResNet", ("cifar100",),
             "ResNet-50 trained on CIFAR-100 (community timm checkpoint, 32×32 CIFAR stem).",
             verified_offline=False, verified_online=False, adapt="cifar-stem"),
)
ENTRIES: dict[str, ZooEntry] = {e.name: e for e in _ENTRIES}


def list_models() -> list[ZooEntry]:
    """All registered entries, embedded ones first."""
    return list(_ENTRIES)


def get_entry(name: str) -> ZooEntry:
    try:
        return ENTRIES[name]
    except KeyError:
        raise ValueError(_unknown_message(name)) from None


def _unknown_message(name: Any) -> str:
    return (
        f"Unknown model {name!r}. Known names: {', '.join(ENTRIES)}. Any timm model on the Hugging Face Hub "
        "also works as 'hf-hub:<org>/<name>', and a folder with config.json + model.safetensors as "
        "'local-dir:<path>'."
    )


# ----------------------------------------------------------------------------- timm architecture

# timm's own mixer entrypoints fix patch size, width and depth, so a small 28×28 mixer needs one
# that takes them all from model_args.
default_cfgs = {
    "nctv_mlp_mixer": {
        "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None, "crop_pct": 0.875,
        "interpolation": "bilinear", "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5),
        "first_conv": "stem.proj", "classifier": "head",
    }
}


@register_model
def nctv_mlp_mixer(pretrained: bool = False, **kwargs):
    """timm ``MlpMixer`` with every size from keyword arguments (img_size, patch_size, embed_dim,
    num_blocks, mlp_ratio, in_chans, num_classes). Registered in timm when ``nctv.zoo`` is imported."""
    from timm.models import build_model_with_cfg
    from timm.models.mlp_mixer import MlpMixer, checkpoint_filter_fn

    return build_model_with_cfg(MlpMixer, "nctv_mlp_mixer", pretrained, pretrained_filter_fn=checkpoint_filter_fn,
                                feature_cfg=dict(out_indices=3, feature_cls="getter"), **kwargs)


def _adapt_cifar_stem(model: torch.nn.Module, state_dict_shapes: dict[str, tuple]) -> None:
    """CIFAR-style ResNet stem: conv1 3×3 stride 1 and no max-pool, when the checkpoint has one."""
    shape = state_dict_shapes.get("conv1.weight")
    conv = getattr(model, "conv1", None)
    if shape is None or not isinstance(conv, torch.nn.Conv2d):
        raise ValueError("The 'cifar-stem' adaptation applies to timm ResNets with a single conv1; this model has none.")
    if tuple(shape[2:]) == tuple(conv.weight.shape[2:]):
        return  # the checkpoint already matches the standard stem
    model.conv1 = torch.nn.Conv2d(shape[1], shape[0], kernel_size=shape[2:], stride=1,
                                  padding=shape[2] // 2, bias=False)
    model.maxpool = torch.nn.Identity()


ADAPTERS: dict[str, Callable[[torch.nn.Module, dict], None]] = {"cifar-stem": _adapt_cifar_stem}


# ----------------------------------------------------------------------------- resolving sources

@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf-hub" or "local-dir"
    location: str  # repo id or folder path
    revision: str | None = None


def parse_model_id(name_or_id: str) -> tuple[ModelSource, ZooEntry | None]:
    """Validate a model name or id as a user typed it.

    Accepts a registry name, ``hf-hub:<org>/<name>[@revision]``, a bare ``<org>/<name>`` (taken as a
    Hub id) or ``local-dir:<folder>``. Folders must exist, contain ``config.json`` and
    ``model.safetensors``, and may not climb with ``..``.
    """
    if not isinstance(name_or_id, str) or not name_or_id.strip():
        raise ValueError(_unknown_message(name_or_id))
    text = name_or_id.strip()
    entry = ENTRIES.get(text)
    if entry is not None:
        text = entry.source
    prefix, sep, rest = text.partition(":")
    if sep and prefix.lower() in ("hf-hub", "hf_hub"):
        return _hub_source(rest), entry
    if sep and prefix.lower() == "local-dir":
        return ModelSource("local-dir", str(_local_folder(rest, embedded=entry is not None))), entry
    if _REPO_ID.fullmatch(text.split("@")[0]) and not Path(text).exists():
        return _hub_source(text), entry
    raise ValueError(_unknown_message(name_or_id))


def _hub_source(text: str) -> ModelSource:
    repo, _, revision = text.strip().partition("@")
    if not _REPO_ID.fullmatch(repo) or ".." in repo or "--" in repo:
        raise ValueError(f"'{repo}' is not a valid Hugging Face model id; it looks like <org>/<name>, e.g. timm/resnet18.a1_in1k.")
    if revision and (not _REVISION.fullmatch(revision) or ".." in revision):
        raise ValueError(f"'{revision}' is not a valid revision (a branch, tag or commit hash).")
    return ModelSource("hf-hub", repo, revision or None)


def _local_folder(text: str, embedded: bool) -> Path:
    raw = Path(text.strip()).expanduser()
    if ".." in raw.parts:
        raise ValueError(f"Model folder '{text}' climbs out with '..'; give the folder's full path instead.")
    folder = (assets_dir() / raw) if (embedded and not raw.is_absolute()) else raw
    if not folder.is_dir():
        raise ValueError(f"Model folder {folder} does not exist; it must hold config.json and model.safetensors.")
    _check_model_files(folder, str(folder))
    return folder.resolve()


def _check_model_files(folder: Path, what: str) -> None:
    if not (folder / CONFIG_NAME).is_file():
        raise ValueError(f"{what} has no config.json; a model folder needs config.json (timm format) and model.safetensors.")
    if not (folder / WEIGHTS_NAME).is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        hint = (f" It has {', '.join(pickles)}: pickle checkpoints can run code when loaded and are refused; "
                "convert them to safetensors first.") if pickles else ""
        raise ValueError(f"{what} has no model.safetensors.{hint}")


def _cached_hub_models() -> list[str]:
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir()
    except Exception:  # no cache folder yet, or unreadable: nothing is cached
        return []
    return sorted(r.repo_id for r in info.repos if r.repo_type == "model")


def _offline_message(source: ModelSource, missing: str) -> str:
    from huggingface_hub import constants

    cached = _cached_hub_models()
    embedded = ", ".join(e.name for e in _ENTRIES if e.embedded)
    return (
        f"Model 'hf-hub:{source.location}' needs the network: {missing} is not in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}) and the Hub cannot be reached (no connection, or HF_HUB_OFFLINE=1). "
        f"Cached Hub models: {', '.join(cached) if cached else 'none'}. "
        f"The embedded models work offline: {embedded}."
    )


@contextmanager
def _hub_errors(source: ModelSource, filename: str) -> Iterator[None]:
    """Hub client errors about ``filename`` of ``source`` as messages that say what to do."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        yield
    except LocalEntryNotFoundError:
        raise ValueError(_offline_message(source, filename)) from None
    except GatedRepoError:
        raise ValueError(f"hf-hub:{source.location} is gated: accept its terms on the Hub and pass your token.") from None
    except RepositoryNotFoundError:
        raise ValueError(f"hf-hub:{source.location} does not exist on the Hub (or is private: pass a token).") from None
    except RevisionNotFoundError:
        raise ValueError(f"hf-hub:{source.location} has no revision '{source.revision}'.") from None
    except EntryNotFoundError:
        hint = (" NCTV reads weights from safetensors only; pickle checkpoints are refused."
                if filename == WEIGHTS_NAME else " It is not a timm model.")
        raise ValueError(f"hf-hub:{source.location} has no {filename}.{hint}") from None


def check_weight_size(what: str, size: int | None, limit: int | None) -> None:
    """Refuse a model whose ``size`` bytes of weights exceed ``limit`` (None: no limit); an unknown
    size is refused too when there is a limit."""
    if limit is None:
        return
    cap = f"this server loads Hub models with at most {limit / 1e6:,.1f} MB of weights"
    if size is None:
        raise ValueError(f"{what}: the Hub did not say how large its weights are, and {cap}.")
    if size > limit:
        raise ValueError(f"{what} has {size / 1e6:,.1f} MB of weights; {cap}. Pick a smaller model.")


def _hub_weight_size(source: ModelSource, cached: str | Any, token: str | None) -> int | None:
    """Bytes of the model's weights: the cached file's size, else the Hub's metadata (nothing is downloaded)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    if isinstance(cached, str):
        return Path(cached).stat().st_size
    with _hub_errors(source, WEIGHTS_NAME):
        url = hf_hub_url(source.location, WEIGHTS_NAME, revision=source.revision)
        return get_hf_file_metadata(url, token=token, library_name="nctv").size


def _hub_folder(source: ModelSource, token: str | None = None, max_weight_bytes: int | None = None) -> Path:
    """Snapshot folder of a Hub model holding config.json and model.safetensors (downloads once,
    after checking that the weights are at most ``max_weight_bytes``)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = {f: try_to_load_from_cache(source.location, f, revision=source.revision) for f in (CONFIG_NAME, WEIGHTS_NAME)}
    what = f"hf-hub:{source.location}"
    complete = all(isinstance(p, str) for p in cached.values())
    if not complete and not hub_reachable():
        missing = next(f for f in (CONFIG_NAME, WEIGHTS_NAME) if not isinstance(cached[f], str))
        raise ValueError(_offline_message(source, missing))
    if max_weight_bytes is not None:
        check_weight_size(what, _hub_weight_size(source, cached[WEIGHTS_NAME], token), max_weight_bytes)
    if complete:
        return Path(cached[CONFIG_NAME]).parent
    paths = {}
    # Fetch both files together so that they come from the same snapshot.
    for filename in (CONFIG_NAME, WEIGHTS_NAME):
        with _hub_errors(source, filename):
            paths[filename] = Path(hf_hub_download(source.location, filename, revision=source.revision,
                                                   token=token, library_name="nctv"))
    folder = paths[CONFIG_NAME].parent
    if paths[WEIGHTS_NAME].parent != folder:
        raise ValueError(f"{what}: config.json and model.safetensors come from different snapshots; "
                         "clear this model from the Hugging Face cache and load it again.")
    return folder


def _hub_card(source: ModelSource, token: str | None) -> Path | None:
    """The Hub model card if cached, else fetched when online; a card is never required."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(source.location, CARD_NAME, revision=source.revision)
    if isinstance(cached, str):
        return Path(cached)
    if not hub_reachable():  # also False with HF_HUB_OFFLINE=1
        return None
    try:
        return Path(hf_hub_download(source.location, CARD_NAME, revision=source.revision, token=token,
                                    library_name="nctv", etag_timeout=5))
    except Exception:  # a missing or unreachable card only costs the card text
        return None


# ----------------------------------------------------------------------------- loading

@dataclass
class LoadedModel:
    """A frozen classifier with everything needed to feed it and name its outputs.

    ``model`` returns logits (N, K); ``input_range`` = (α, β) tensors (C, H, W): the preprocessed
    images of pixel value 0 and of pixel value 1 (255 in 8 bits).
    """

    model: torch.nn.Module
    name: str
    source: str
    class_names: list[str]
    data_config: dict
    input_range: tuple[torch.Tensor, torch.Tensor]
    preprocess: Callable[[Image.Image], torch.Tensor]
    card: dict
    folder: Path
    entry: ZooEntry | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def default_dataset(self) -> str | None:
        return self.entry.datasets[0] if self.entry and self.entry.datasets else None

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(int(v) for v in self.data_config["input_size"])


def load_model(name_or_id: str, device: Any = "cpu", token: str | None = None,
               max_weight_bytes: int | None = None) -> LoadedModel:
    """Load a zoo name, ``hf-hub:<org>/<name>[@rev]``, ``<org>/<name>`` or ``local-dir:<folder>``.

    The model is returned frozen (eval mode, no parameter gradients) on ``device``. ``token`` is a
    Hugging Face token for gated or private repositories (else the usual HF_TOKEN / login applies).
    ``max_weight_bytes`` refuses Hub models with larger weights, before anything is downloaded
    (the size comes from the Hub's metadata, or from the cached file); None: no limit.
    ``source`` records an embedded model by its entry (``local-dir:models/…``, inside the shipped
    assets), so results do not hold where the assets lie.
    """
    source, entry = parse_model_id(name_or_id)
    if source.kind == "hf-hub":
        folder = _hub_folder(source, token, max_weight_bytes)
        card_path = _hub_card(source, token)
        source_text = f"hf-hub:{source.location}" + (f"@{source.revision}" if source.revision else "")
    else:
        folder = Path(source.location)
        card_path = folder / CARD_NAME if (folder / CARD_NAME).is_file() else None
        source_text = entry.source if entry else f"local-dir:{folder}"
    model = _build(folder, entry.adapt if entry else None)
    model = freeze(model).to(resolve_device(device))
    data_config = _data_config(model)
    preprocess = make_preprocess(data_config)
    c, h, w = (int(v) for v in data_config["input_size"])
    mode = image_mode(data_config)
    alpha = preprocess(Image.new(mode, (w, h), 0))
    beta = preprocess(Image.new(mode, (w, h), 255 if mode == "L" else (255, 255, 255)))
    class_names = _class_names(model)
    name = entry.name if entry else source_text
    card = {
        "name": name,
        "source": source_text,
        "family": entry.family if entry else None,
        "description": entry.description if entry else None,
        "datasets": list(entry.datasets) if entry else [],
        "verified_offline": entry.verified_offline if entry else None,
        "verified_online": entry.verified_online if entry else None,
        "architecture": model.pretrained_cfg.get("architecture"),
        "num_classes": len(class_names),
        "parameters": sum(p.numel() for p in model.parameters()),
        **read_card(card_path),
    }
    return LoadedModel(model, name, source_text, class_names, data_config, (alpha, beta), preprocess, card, folder, entry)


def _build(folder: Path, adapt: str | None) -> torch.nn.Module:
    import timm
    from safetensors import safe_open
    from safetensors.torch import load_file

    _check_model_files(folder, str(folder))
    try:
        if adapt is None:
            return timm.create_model(f"local-dir:{folder}", pretrained=True)
        model = timm.create_model(f"local-dir:{folder}", pretrained=False)
        with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        ADAPTERS[adapt](model, shapes)
        model.load_state_dict(load_file(str(folder / WEIGHTS_NAME)))
        return model
    except RuntimeError as e:
        msg = str(e)
        if msg.startswith("Unknown model"):
            cfg = json.loads((folder / CONFIG_NAME).read_text())
            raise ValueError(f"Architecture {cfg.get('architecture')!r} is not known to the installed timm "
                             f"({timm.__version__}); upgrading timm may help.") from None
        raise ValueError(f"The weights in {folder} do not fit the architecture in its config.json: {msg[:400]}") from None


def _data_config(model: torch.nn.Module) -> dict:
    from timm.data import resolve_data_config

    cfg = resolve_data_config(model=model)
    return {"input_size": tuple(int(v) for v in cfg["input_size"]), "interpolation": cfg["interpolation"],
            "mean": tuple(float(v) for v in cfg["mean"]), "std": tuple(float(v) for v in cfg["std"]),
            "crop_pct": float(cfg["crop_pct"]), "crop_mode": cfg.get("crop_mode", "center")}


def _class_names(model: torch.nn.Module) -> list[str]:
    """Human-readable class names: the config's labels, else ImageNet's, else "class i"."""
    cfg = model.pretrained_cfg
    k = int(model.num_classes)
    names = cfg.get("label_names")
    if isinstance(names, dict):
        names = [names.get(str(i), names.get(i, f"class {i}")) for i in range(k)]
    descriptions = cfg.get("label_descriptions")
    if names and len(names) == k:
        if isinstance(descriptions, dict):
            return [str(descriptions.get(n, n)) for n in names]
        return [str(n) for n in names]
    from timm.data import ImageNetInfo, infer_imagenet_subset

    subset = infer_imagenet_subset(model)
    if subset:
        info = ImageNetInfo(subset)
        return [info.index_to_description(i) for i in range(k)]
    return [f"class {i}" for i in range(k)]


def read_card(path: Path | None) -> dict:
    """``{"text": markdown or None, "metadata": YAML front matter (dict)}`` of a model card file."""
    if path is None or not Path(path).is_file():
        return {"text": None, "metadata": {}}
    from huggingface_hub.repocard import metadata_load

    return {"text": Path(path).read_text(encoding="utf-8"), "metadata": metadata_load(path) or {}}


# ----------------------------------------------------------------------------- FLOPs

def count_flops(model: torch.nn.Module, input_shape: Sequence[int]) -> int:
    """Forward FLOPs for one input, counted by ``torch.utils.flop_counter`` (2 FLOPs per multiply-add;
    matrix products and convolutions only, so norms, activations and softmax are not included)."""
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    x = torch.zeros(1, *input_shape, device=next(model.parameters()).device)
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        model.train(was_training)
    return int(counter.get_total_flops())


# ----------------------------------------------------------------------------- training

@dataclass
class TrainingResult:
    model: torch.nn.Module
    folder: Path
    seconds: float
    history: list[dict] = field(default_factory=list)
    test_metrics: dict | None = None


def _augment(x: torch.Tensor, background: torch.Tensor, shift: int, flip: bool, gen: torch.Generator) -> torch.Tensor:
    """Random translation by up to ``shift`` pixels (filled with the background value) and
    horizontal flips, on a preprocessed batch (B, C, H, W)."""
    b, c, h, w = x.shape
    if shift:
        padded = background.view(1, c, 1, 1).expand(b, c, h + 2 * shift, w + 2 * shift).clone()
        padded[:, :, shift:shift + h, shift:shift + w] = x
        oy = torch.randint(0, 2 * shift + 1, (b,), generator=gen)
        ox = torch.randint(0, 2 * shift + 1, (b,), generator=gen)
        rows = (oy[:, None] + torch.arange(h))[:, :, None]
        cols = (ox[:, None] + torch.arange(w))[:, None, :]
        x = padded.permute(0, 2, 3, 1)[torch.arange(b)[:, None, None], rows, cols].permute(0, 3, 1, 2)
    if flip:
        mask = torch.rand(b, generator=gen) < 0.5
        x = torch.where(mask[:, None, None, None], x.flip(-1), x)
    return x.contiguous()


def train_classifier(architecture: str, model_args: dict, train_split: Any, *, out_dir: str | os.PathLike,
                     class_names: Sequence[str] | None = None, test_split: Any = None, epochs: int = 5,
                     batch_size: int = 128, lr: float = 2e-3, weight_decay: float = 0.05, warmup_fraction: float = 0.05,
                     shift: int = 2, flip: bool = True, seed: int = 0, device: Any = "cpu",
                     mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                     card: dict | None = None, progress: bool = True) -> TrainingResult:
    """Train a timm classifier from scratch and save it in the Hub's layout in ``out_dir``.

    ``train_split`` / ``test_split``: an in-memory :class:`nctv.data.Split` or a tuple
    ``(images uint8 (N, H, W[, C]), labels (N,))``. ``architecture`` is a timm model name and
    ``model_args`` its size arguments (e.g. ``img_size=28, patch_size=4``); ``in_chans`` and
    ``num_classes`` follow the data.

    Recipe (deliberately plain, so the model is as over-confident as usual): cross entropy without
    label smoothing or mixup; AdamW (timm's parameter groups: no weight decay on biases and norms);
    learning rate warmed up linearly over ``warmup_fraction`` of the steps, then cosine to 0;
    augmentation = random translation by up to ``shift`` pixels and random horizontal flips (set
    ``shift=0, flip=False`` for none). Preprocessing: per-channel mean/std of the training images
    unless given, no resize (crop_pct 1). Writes ``config.json`` + ``model.safetensors`` (timm's
    ``save_for_hf``) and a ``README.md`` card with the recipe, timing, FLOPs and, with a test split,
    test accuracy and uncalibrated ECE (15 bins). Deterministic for a given seed, thread count and
    machine.
    """
    import timm
    from timm.models import save_for_hf
    from timm.optim import create_optimizer_v2
    from tqdm.auto import tqdm

    images, labels = _arrays(train_split, "train_split")
    if images.ndim == 3:
        images = images[..., None]
    n, h, w, c = images.shape
    k = int(labels.max()) + 1 if class_names is None else len(class_names)
    class_names = list(class_names) if class_names is not None else [f"class {i}" for i in range(k)]
    if labels.min() < 0 or labels.max() >= k:
        raise ValueError(f"Labels must lie in 0..{k - 1} for {k} classes.")
    if mean is None or std is None:
        pixels = images.reshape(-1, c).astype(np.float64) / 255.0
        mean = tuple(round(float(v), 4) for v in pixels.mean(0)) if mean is None else mean
        std = tuple(round(float(v), 4) for v in pixels.std(0)) if std is None else std
    data_config = {"input_size": (c, h, w), "interpolation": "bilinear", "mean": tuple(mean), "std": tuple(std),
                   "crop_pct": 1.0, "crop_mode": "center"}
    dev = resolve_device(device)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    overlay = {"tag": "nctv", "hf_hub_id": None, "url": None, "license": None, "origin_url": None,
               "paper_ids": None, "paper_name": None, "notes": None, "test_input_size": None, "test_crop_pct": None}
    model = timm.create_model(architecture, pretrained=False, num_classes=k, in_chans=c,
                              pretrained_cfg_overlay=overlay, **model_args).to(dev)
    x_all = preprocess_arrays(images, data_config)
    y_all = torch.as_tensor(labels, dtype=torch.long)
    background = ((0.0 - torch.tensor(mean)) / torch.tensor(std)).float()
    steps_per_epoch = math.ceil(n / batch_size)
    total = epochs * steps_per_epoch
    warmup = min(max(1, int(warmup_fraction * total)), total)
    optimizer = create_optimizer_v2(model, "adamw", lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(total - warmup, 1))))
    history = []
    start = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(n, generator=gen)
        loss_sum, correct = 0.0, 0
        bar = tqdm(range(steps_per_epoch), desc=f"{architecture} epoch {epoch + 1}/{epochs}", disable=not progress)
        for step in bar:
            idx = order[step * batch_size:(step + 1) * batch_size]
            xb = _augment(x_all[idx], background, shift, flip, gen).to(dev)
            yb = y_all[idx].to(dev)
            logits = model(xb)
            loss = torch.nn.functional.cross_entropy(logits, yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            loss_sum += loss.item() * len(idx)
            correct += int((logits.argmax(1) == yb).sum())
        history.append({"epoch": epoch + 1, "train_loss": loss_sum / n, "train_accuracy": correct / n,
                        "seconds": time.perf_counter() - start})
    seconds = time.perf_counter() - start
    model.eval()
    test_metrics = None
    if test_split is not None:
        test_metrics = _evaluate(model, test_split, data_config)
    out = Path(out_dir)
    # The preprocessing goes in through pretrained_cfg: save_for_hf's data_config argument is recent in timm.
    model.pretrained_cfg = {**model.pretrained_cfg, **data_config}
    save_for_hf(model.cpu(), str(out), model_config={"label_names": class_names}, model_args=dict(model_args),
                safe_serialization=True)
    recipe = {"architecture": architecture, "model_args": dict(model_args), "epochs": epochs, "batch_size": batch_size,
              "optimizer": "AdamW", "lr": lr, "weight_decay": weight_decay, "warmup_fraction": warmup_fraction,
              "loss": "cross entropy (no label smoothing, no mixup)",
              "augmentation": ", ".join([f"random translation ≤ {shift} px"] * bool(shift) + ["horizontal flip"] * flip) or "none",
              "seed": seed, "threads": torch.get_num_threads(), "device": str(dev), "torch": torch.__version__,
              "timm": timm.__version__, "train_images": n}
    info = {"recipe": recipe, "history": history, "train_seconds": round(seconds, 1),
            "flops": count_flops(model, (c, h, w)), "parameters": sum(p.numel() for p in model.parameters()),
            "weights_bytes": (out / WEIGHTS_NAME).stat().st_size, "test": test_metrics}
    _write_card(out, info, class_names, card or {})
    return TrainingResult(model, out, seconds, history, test_metrics)


def _arrays(split: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    if hasattr(split, "arrays"):
        images, labels = split.arrays()
    elif isinstance(split, (tuple, list)) and len(split) == 2:
        images, labels = np.asarray(split[0]), np.asarray(split[1])
    else:
        raise ValueError(f"{what} must be an in-memory Split or a tuple (images uint8 (N, H, W[, C]), labels (N,)).")
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    if images.dtype != np.uint8 or images.ndim not in (3, 4) or images.shape[0] != labels.shape[0]:
        raise ValueError(f"{what}: images must be uint8 (N, H, W[, C]) with one label each; got {images.dtype} "
                         f"{images.shape} and {labels.shape[0]} labels.")
    return images, labels


@torch.no_grad()
def _evaluate(model: torch.nn.Module, split: Any, data_config: dict) -> dict:
    from nctv import metrics
    from nctv.inference import model_logits

    images, labels = _arrays(split, "test_split")
    x = preprocess_arrays(images, data_config)
    if x is None:
        raise ValueError(f"Test images {images.shape[1:]} must have the training images' size and channels.")
    logits = model_logits(model, x, batch_size=1000)
    y = torch.as_tensor(labels)
    return {"n": int(y.shape[0]), "accuracy": metrics.accuracy(logits, y), "ece_15": metrics.ece(logits, y, n_bins=15),
            "nll": metrics.nll(logits, y)}


def _write_card(folder: Path, info: dict, class_names: Sequence[str], card: dict) -> None:
    """README.md with YAML front matter (``nctv:`` block holds the numbers) and a readable body."""
    import yaml

    r = info["recipe"]
    test = info["test"]
    meta = {
        "library_name": "timm",
        "license": card.get("license", "apache-2.0"),
        "tags": ["image-classification", "timm", "nctv"],
        "datasets": card.get("datasets", []),
        "pipeline_tag": "image-classification",
        "nctv": {
            "name": card.get("name", folder.name), "family": card.get("family"), "seed": r["seed"],
            "train_seconds": info["train_seconds"], "flops_per_image": info["flops"],
            "flops_convention": "torch.utils.flop_counter, 2 per multiply-add, matmul/conv only",
            "parameters": info["parameters"], "weights_bytes": info["weights_bytes"],
            "test_split": card.get("test_split"), "test_images": test["n"] if test else None,
            "test_accuracy": round(test["accuracy"], 6) if test else None,
            "test_ece_15_bins": round(test["ece_15"], 6) if test else None,
            "test_nll": round(test["nll"], 6) if test else None,
        },
    }
    title = card.get("title", card.get("name", folder.name))
    lines = [f"# {title}", "", card.get("summary", ""), ""]
    if test:
        lines += ["## Results (uncalibrated)", "",
                  "| test images | accuracy | ECE (15 bins) | NLL |", "| --- | --- | --- | --- |",
                  f"| {test['n']} | {100 * test['accuracy']:.2f} % | {100 * test['ece_15']:.2f} % | {test['nll']:.4f} |", ""]
    lines += ["## Model", "",
              f"- architecture: timm `{r['architecture']}` with model_args `{json.dumps(r['model_args'])}`",
              f"- parameters: {info['parameters']:,}; weights: {info['weights_bytes'] / 1024:.0f} KiB (safetensors, float32)",
              f"- forward cost: {info['flops'] / 1e6:.2f} MFLOPs per image (torch.utils.flop_counter; 2 FLOPs per "
              "multiply-add; matrix products and convolutions only)",
              f"- classes: {', '.join(class_names)}", "",
              "## Training recipe", "",
              f"- data: {card.get('train_data', str(r['train_images']) + ' training images')}",
              f"- {r['epochs']} epochs, batch {r['batch_size']}, {r['optimizer']} (lr {r['lr']}, weight decay "
              f"{r['weight_decay']}, none on biases and norms), linear warmup over {r['warmup_fraction']:.0%} of "
              "the steps, then cosine to 0 (per step)",
              f"- loss: {r['loss']}; augmentation: {r['augmentation']}",
              f"- seed {r['seed']}, {r['threads']} CPU thread{'' if r['threads'] == 1 else 's'} on {r['device']}; "
              f"torch {r['torch']}, timm {r['timm']}; "
              f"training took {info['train_seconds']:.0f} s (wall clock)",
              "", "Per-epoch training loss / accuracy:", "",
              "| epoch | loss | accuracy | elapsed s |", "| --- | --- | --- | --- |"]
    lines += [f"| {h['epoch']} | {h['train_loss']:.4f} | {100 * h['train_accuracy']:.2f} % | {h['seconds']:.0f} |"
              for h in info["history"]]
    lines += ["", *card.get("extra", [])]
    text = "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n" + "\n".join(lines).rstrip() + "\n"
    (folder / CARD_NAME).write_text(text, encoding="utf-8")
