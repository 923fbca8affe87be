"""Training a classifier for the zoo: a plain recipe, saved in the Hub's layout with a model card.

``train_classifier`` trains a timm architecture on an in-memory image set and writes ``config.json``
+ ``model.safetensors`` and a ``README.md`` card, so that :func:`nctv.zoo.load_model` reads the
result as ``local-dir:<folder>``; ``scripts/make_assets.py`` and ``nctv train`` use it for the
embedded models and for your own.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from nctv.data import preprocess_arrays
from nctv.hub import CARD_NAME, WEIGHTS_NAME
from nctv.inference import resolve_device
# Importing nctv.zoo also registers its timm architectures (nctv_mlp_mixer) for timm.create_model.
from nctv.zoo import count_flops

__all__ = ["TrainingResult", "train_classifier"]


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
    data_config = _training_data_config(images, mean, std)
    dev = resolve_device(device)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    overlay = {"tag": "nctv", "hf_hub_id": None, "url": None, "license": None, "origin_url": None,
               "paper_ids": None, "paper_name": None, "notes": None, "test_input_size": None, "test_crop_pct": None}
    model = timm.create_model(architecture, pretrained=False, num_classes=k, in_chans=c,
                              pretrained_cfg_overlay=overlay, **model_args).to(dev)
    x_all = preprocess_arrays(images, data_config)
    y_all = torch.as_tensor(labels, dtype=torch.long)
    background = ((0.0 - torch.tensor(data_config["mean"])) / torch.tensor(data_config["std"])).float()
    steps_per_epoch = math.ceil(n / batch_size)
    optimizer = create_optimizer_v2(model, "adamw", lr=lr, weight_decay=weight_decay)
    schedule = _warmup_cosine(optimizer, epochs * steps_per_epoch, warmup_fraction)
    history = []
    start = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(n, generator=gen)
        bar = tqdm(range(steps_per_epoch), desc=f"{architecture} epoch {epoch + 1}/{epochs}", disable=not progress)
        batches = (order[step * batch_size:(step + 1) * batch_size] for step in bar)
        loss_sum, correct = _train_epoch(model, optimizer, schedule, x_all, y_all, batches,
                                         lambda x: _augment(x, background, shift, flip, gen).to(dev))
        history.append({"epoch": epoch + 1, "train_loss": loss_sum / n, "train_accuracy": correct / n,
                        "seconds": time.perf_counter() - start})
    seconds = time.perf_counter() - start
    model.eval()
    test_metrics = _evaluate(model, test_split, data_config) if test_split is not None else None
    out = _save(model, Path(out_dir), data_config, class_names, model_args)
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


def _training_data_config(images: np.ndarray, mean: Sequence[float] | None, std: Sequence[float] | None) -> dict:
    """timm data config of uint8 images (N, H, W, C) at native size; mean/std measured unless given."""
    n, h, w, c = images.shape
    if mean is None or std is None:
        pixels = images.reshape(-1, c).astype(np.float64) / 255.0
        mean = tuple(round(float(v), 4) for v in pixels.mean(0)) if mean is None else mean
        std = tuple(round(float(v), 4) for v in pixels.std(0)) if std is None else std
    return {"input_size": (c, h, w), "interpolation": "bilinear", "mean": tuple(mean), "std": tuple(std),
            "crop_pct": 1.0, "crop_mode": "center"}


def _warmup_cosine(optimizer: torch.optim.Optimizer, total: int, warmup_fraction: float) -> Any:
    """Per-step schedule: linear warmup over ``warmup_fraction`` of ``total`` steps, then cosine to 0."""
    warmup = min(max(1, int(warmup_fraction * total)), total)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _train_epoch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: Any, x_all: torch.Tensor,
                 y_all: torch.Tensor, batches: Iterable[torch.Tensor],
                 augment: Callable[[torch.Tensor], torch.Tensor]) -> tuple[float, int]:
    """One step per batch of indices into (``x_all``, ``y_all``); ``augment`` also moves the inputs to the
    model's device. Returns the summed cross-entropy loss and the number of correct predictions."""
    loss_sum, correct = 0.0, 0
    for idx in batches:
        xb = augment(x_all[idx])
        yb = y_all[idx].to(xb.device)
        logits = model(xb)
        loss = torch.nn.functional.cross_entropy(logits, yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        loss_sum += loss.item() * len(idx)
        correct += int((logits.argmax(1) == yb).sum())
    return loss_sum, correct


def _save(model: torch.nn.Module, out: Path, data_config: dict, class_names: Sequence[str], model_args: dict) -> Path:
    """``config.json`` + ``model.safetensors`` of ``model`` (moved to the CPU) in ``out``."""
    from timm.models import save_for_hf

    # The preprocessing goes in through pretrained_cfg: save_for_hf's data_config argument is recent in timm.
    model.pretrained_cfg = {**model.pretrained_cfg, **data_config}
    save_for_hf(model.cpu(), str(out), model_config={"label_names": class_names}, model_args=dict(model_args),
                safe_serialization=True)
    return out


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
