"""Pictures as a model sees them: the model's preprocessing (timm's data config) and uint8 arrays of
pictures held in memory. ``nctv.data`` (datasets and splits) and ``nctv.hubdata`` (Hub shards) both
build on these; neither imports the other's internals through here.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable

import numpy as np
import torch
from PIL import Image


# ----------------------------------------------------------------------------- preprocessing

def image_mode(data_config: dict) -> str:
    """PIL mode a model reads: "L" for one input channel, "RGB" for three."""
    channels = int(data_config["input_size"][0])
    if channels == 1:
        return "L"
    if channels == 3:
        return "RGB"
    raise ValueError(f"Models with {channels} input channels are not supported; use 1 (grey) or 3 (RGB).")


def make_preprocess(data_config: dict) -> Callable[[Image.Image], torch.Tensor]:
    """PIL image -> float32 tensor (C, H, W): colour mode of the model, then timm's eval transform."""
    from timm.data import create_transform

    mode = image_mode(data_config)
    transform = create_transform(**data_config, is_training=False)

    def preprocess(image: Image.Image) -> torch.Tensor:
        if not isinstance(image, Image.Image):
            raise ValueError(f"preprocess expects a PIL image, got {type(image).__name__}.")
        return transform(image if image.mode == mode else image.convert(mode))

    return preprocess


def _keeps_geometry(data_config: dict, height: int, width: int) -> bool:
    """True when timm's eval transform leaves an (height, width) image's pixels where they are.

    That is the case when the resize target equals the image size (crop_pct = 1 at native size),
    so resize and centre crop are identities and only ToTensor + Normalize act.
    """
    size = tuple(int(s) for s in data_config["input_size"][1:])
    if size != (height, width):
        return False
    mode = data_config.get("crop_mode") or "center"
    if mode not in ("center", "squash") or data_config.get("crop_border_pixels"):
        return False
    crop_pct = data_config.get("crop_pct") or 1.0
    return tuple(math.floor(s / crop_pct) for s in size) == size


def preprocess_arrays(images: np.ndarray, data_config: dict) -> torch.Tensor | None:
    """Vectorised eval preprocessing of uint8 images (N, H, W) or (N, H, W, C).

    Computes (x / 255 − mean) / std exactly as ``ToTensor`` + ``Normalize`` do, so the result is
    bit-identical to :func:`make_preprocess` on each image. Returns ``None`` where that equality
    does not hold (a resize or crop would move pixels, or a colour conversion other than grey → RGB
    is needed); callers then use the PIL path.
    """
    if images.dtype != np.uint8 or images.ndim not in (3, 4):
        return None
    if images.ndim == 4 and images.shape[3] == 1:
        images = images[..., 0]
    if not _keeps_geometry(data_config, images.shape[1], images.shape[2]):
        return None
    channels = int(data_config["input_size"][0])
    # torch.from_numpy needs writable memory; arrays read from bytes are not.
    x = torch.from_numpy(images.copy() if not images.flags.writeable else np.ascontiguousarray(images))
    if x.ndim == 3:
        x = x[:, None]
    else:
        if x.shape[3] != 3:
            return None
        x = x.permute(0, 3, 1, 2)
    if x.shape[1] != channels:
        if x.shape[1] != 1 or channels != 3:
            return None  # RGB -> L uses PIL's integer luma rounding; leave it to PIL
        x = x.expand(-1, 3, -1, -1)
    mean = torch.tensor(data_config["mean"], dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(data_config["std"], dtype=torch.float32).view(1, -1, 1, 1)
    return x.float().div(255).sub(mean).div(std).contiguous()


# ----------------------------------------------------------------------------- image sources

def pil_from_array(image: np.ndarray) -> Image.Image:
    """uint8 (H, W), (H, W, 1) or (H, W, 3) -> PIL image in mode L or RGB."""
    if image.ndim == 3 and image.shape[2] == 1:
        image = image[..., 0]
    return Image.fromarray(np.ascontiguousarray(image))


class ArrayImages:
    """Images held in memory as one uint8 array (N, H, W[, C])."""

    def __init__(self, images: np.ndarray, description: str):
        if images.dtype != np.uint8 or images.ndim not in (3, 4):
            raise ValueError(f"Images must be a uint8 array (N, H, W) or (N, H, W, C); got {images.dtype} {images.shape}.")
        self.images = images
        self.description = description

    def __len__(self) -> int:
        return self.images.shape[0]

    def pil(self, i: int) -> Image.Image:
        return pil_from_array(self.images[i])

    def digest(self, indices: np.ndarray) -> bytes:
        return hashlib.sha256(np.ascontiguousarray(self.images[indices]).tobytes()).digest()

    def row_keys(self, indices: np.ndarray) -> np.ndarray:
        """Each image's identity by its pixels (:func:`nctv.canonical.content_keys`)."""
        from nctv.canonical import content_keys

        return content_keys(np.ascontiguousarray(self.images[int(i)]).tobytes() for i in indices)
