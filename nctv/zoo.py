"""Model registry and loading: embedded models, Hugging Face Hub models, local folders.

Every model, embedded or not, is a folder in the Hub's layout — ``config.json`` (timm's format:
``architecture``, ``num_classes``, ``model_args``, ``pretrained_cfg`` with the preprocessing,
``label_names``) and ``model.safetensors`` — and loads through one path: the folder is found
(``local-dir:<path>`` directly, ``hf-hub:<org>/<name>`` through the Hugging Face cache, downloading
once), then ``timm.create_model("local-dir:<folder>", pretrained=True)`` builds it. Weights are read
from ``model.safetensors``; where a folder or repository has none, from ``pytorch_model.bin`` through
``torch.load(weights_only=True)`` (a pickle that asks to call anything is refused), its tensors checked
against the architecture (names, shapes, all finite) before use. Other pickle checkpoints (``.pth``,
``.pt``, ``.ckpt``) are refused.

A :class:`LoadedModel` carries the frozen model (eval mode, no parameter gradients), its class names,
its timm data config (input_size, mean, std, interpolation, crop_pct), ``preprocess`` (PIL image ->
float32 tensor (C, H, W)), ``input_range`` (α, β: the preprocessed all-black and all-white images, the
feasible input box for Neural Clamping's optional clamp) and its model card. Outputs are **logits**.

The Hub is optional: offline (no network, or ``HF_HUB_OFFLINE=1``) a Hub model loads from the cache
if it was downloaded before, otherwise the error says what is cached; the embedded models never
need the network. A cached snapshot is used as it is (no update check), so results stay
reproducible; delete it from the cache to fetch a newer revision.

Hub access (the reachability probe, downloads through the cache, the weight-size cap) lives in
:mod:`nctv.hub`; training a model for the zoo in :mod:`nctv.training`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from PIL import Image
from timm.models import register_model

from nctv.checks import check_text, shown
from nctv.data import assets_dir, image_mode, make_preprocess
from nctv.hub import (CARD_NAME, CONFIG_NAME, PICKLE_WEIGHTS_NAME, WEIGHT_FILES, WEIGHTS_NAME, HubOfflineError,
                      model_card, model_folder)
from nctv.inference import freeze, resolve_device

__all__ = [
    "DEFAULT_MODEL", "ZooEntry", "LoadedModel", "ENTRIES", "list_models", "get_entry", "load_model",
    "parse_model_id", "count_flops", "read_card", "nctv_mlp_mixer", "read_weights", "check_state_dict",
]

DEFAULT_MODEL = "fmnist-resnet-overconfident"
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
             "ResNet-50 trained on CIFAR-100 (community timm checkpoint, 32×32 CIFAR stem: a 3×3 stride-1 first "
             "convolution and no max-pool; 80.9 % test accuracy on its card).",
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
        f"Unknown model {shown(name)}. Known names: {', '.join(ENTRIES)}. Any timm model on the Hugging Face Hub "
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
    ``model.safetensors`` (or ``pytorch_model.bin``), and may not climb with ``..``.
    """
    if not isinstance(name_or_id, str) or not name_or_id.strip():
        raise ValueError(_unknown_message(name_or_id))
    text = check_text(name_or_id, "The model name").strip()
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
        raise ValueError(f"{shown(repo)} is not a valid Hugging Face model id; it looks like <org>/<name>, e.g. timm/resnet18.a1_in1k.")
    if revision and (not _REVISION.fullmatch(revision) or ".." in revision):
        raise ValueError(f"{shown(revision)} is not a valid revision (a branch, tag or commit hash).")
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


def _check_model_files(folder: Path, what: str) -> Path:
    """The folder's weight file (model.safetensors, else pytorch_model.bin), once config.json is there."""
    if not (folder / CONFIG_NAME).is_file():
        raise ValueError(f"{what} has no config.json; a model folder needs config.json (timm format) and model.safetensors.")
    weights = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if weights is None:
        pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        hint = (f" It has {', '.join(pickles)}: pickle checkpoints can run code when loaded and are refused "
                f"(only {PICKLE_WEIGHTS_NAME} is read, with torch.load(weights_only=True)); convert them to "
                "safetensors first.") if pickles else ""
        raise ValueError(f"{what} has no model.safetensors.{hint}")
    return weights


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
        folder, card_path = _hub_model(source, token, max_weight_bytes)
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


def _hub_model(source: ModelSource, token: str | None, max_weight_bytes: int | None) -> tuple[Path, Path | None]:
    """Snapshot folder and model card (None if there is none) of a Hub model; offline, the error also
    names the models that work without the network."""
    try:
        folder = model_folder(source.location, source.revision, token, max_weight_bytes)
    except HubOfflineError as e:
        embedded = ", ".join(entry.name for entry in _ENTRIES if entry.embedded)
        raise ValueError(f"{e} The embedded models work offline: {embedded}.") from None
    return folder, model_card(source.location, source.revision, token)


def _build(folder: Path, adapt: str | None) -> torch.nn.Module:
    import timm

    weights = _check_model_files(folder, str(folder))
    try:
        if adapt is None and weights.name == WEIGHTS_NAME:
            return timm.create_model(f"local-dir:{folder}", pretrained=True)
        model = timm.create_model(f"local-dir:{folder}", pretrained=False)
        state = read_weights(weights)
        if adapt is not None:
            ADAPTERS[adapt](model, {k: tuple(v.shape) for k, v in state.items()})
        check_state_dict(state, model, f"The weights in {weights}")
        model.load_state_dict(state)
        return model
    except RuntimeError as e:
        msg = str(e)
        if msg.startswith("Unknown model"):
            cfg = json.loads((folder / CONFIG_NAME).read_text())
            raise ValueError(f"Architecture {cfg.get('architecture')!r} is not known to the installed timm "
                             f"({timm.__version__}); upgrading timm may help.") from None
        raise ValueError(f"The weights in {folder} do not fit the architecture in its config.json: {msg[:400]}") from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The state dict in ``model.safetensors``, or in ``pytorch_model.bin`` through
    ``torch.load(weights_only=True)`` (memory-mapped when the file is in torch's zip format): a pickle
    that names any function or class beyond tensors and plain containers is refused unread. What it
    holds must be a mapping of names to tensors; :func:`check_state_dict` checks it against a model."""
    import pickle
    import zipfile

    from safetensors.torch import load_file

    path = Path(path)
    if path.name != PICKLE_WEIGHTS_NAME:
        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        called = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"asks to call {called.group(1)}" if called else "holds more than tensors"
        raise ValueError(f"The weights in {path} were refused: their pickle {what}, which a file of weights "
                         "never needs (it could run code). NCTV reads it with torch.load(weights_only=True) "
                         "only; convert trusted weights to model.safetensors.") from None
    except Exception as e:  # a truncated or corrupt file: torch's own words, shortened
        raise ValueError(f"{path} is not a readable PyTorch checkpoint ({type(e).__name__}: "
                         f"{str(e)[:200]}).") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ValueError(f"{path} does not hold a state dict (parameter names mapped to tensors).")
    return state


def check_state_dict(state: dict[str, torch.Tensor], model: torch.nn.Module, what: str) -> None:
    """Refuse weights that do not fit ``model``: a missing or extra name, a shape or kind (floating or
    integer) that differs, or a value that is NaN or infinite. ``what`` starts the message."""
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        parts = [f"{label} {', '.join(names[:4])}" + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                 for label, names in (("lack", missing), ("have extra", extra)) if names]
        raise ValueError(f"{what} do not fit the architecture in its config.json: they {'; they '.join(parts)}.")
    for name, ref in expected.items():
        tensor = state[name]
        if tuple(tensor.shape) != tuple(ref.shape) or tensor.is_floating_point() != ref.is_floating_point():
            raise ValueError(f"{what} do not fit the architecture in its config.json: {name} is "
                             f"{tuple(tensor.shape)} {tensor.dtype}, the model's {tuple(ref.shape)} {ref.dtype}.")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{what} hold values that are not finite (NaN or infinite) in {name}.")


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
    matrix products and convolutions only, so norms, activations and softmax are not included).

    Attention runs on PyTorch's reference ("math") kernel while counting: it is made of matrix
    products the counter sees in every release, whereas the fused CPU kernels are counted by some
    releases and not by others (torch 2.14 counts nothing for them), which would make the figure
    depend on the installed torch."""
    from torch.utils.flop_counter import FlopCounterMode

    from nctv.precision import eval_mode

    x = torch.zeros(1, *input_shape, device=next(model.parameters()).device)
    with eval_mode(model), torch.no_grad(), _reference_attention(), FlopCounterMode(display=False) as counter:
        model(x)
    return int(counter.get_total_flops())


def _reference_attention():
    """A context in which scaled_dot_product_attention takes the reference kernel."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch 2.2: the older switch, which the CPU kernel choice also reads
        return torch.backends.cuda.sdp_kernel(enable_flash=False, enable_math=True, enable_mem_efficient=False)
    return sdpa_kernel(SDPBackend.MATH)
