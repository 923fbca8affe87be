"""Corrupted images: the test split as a camera in the rain or a scanner out of focus would give it.

Every corruption acts in **pixel space**, on the stored image (uint8, grey or RGB), *before* the
model's own preprocessing (resize, crop, normalise) and before Neural Clamping's δ, so a calibrator
fitted on clean images meets exactly what a deployed model would. Each has five severities (1 mild
… 5 strong); severity 0 is the clean image, unchanged.

Definitions and severities follow ImageNet-C (Hendrycks & Dietterich, ICLR 2019) and, for small
images, its CIFAR-10-C variant with the same authors' milder parameters: images whose shorter side is
at most :data:`SMALL_SIDE` pixels (Fashion-MNIST's 28, CIFAR's 32) take the CIFAR-10-C values, larger
ones the ImageNet-C values. Rotation is not one of ImageNet-C's corruptions (it comes from its
companion set of perturbations); its angles are NCTV's own. ``CORRUPTIONS[name].describe()`` and
docs/method.md ("Calibration under distribution shift") list every parameter.

Where NCTV differs from the published generator, on purpose:

* results are **rounded** to the nearest grey level (the generator truncates), so that noise of
  mean 0 stays of mean 0;
* randomness is **seeded per image**: image ``key`` (its index in its dataset) draws from
  ``numpy.random.default_rng([seed, corruption code, severity, key])``, so the same picture gets
  the same noise whether it is read from an in-memory array, a folder or the Hub, alone or in a
  batch, and a corrupted split is reproducible to the bit;
* the blurs use the same kernels (Gaussian truncated at 4 σ with edge replication, as
  ``skimage.filters.gaussian``; the anti-aliased disk of ImageNet-C's defocus blur with mirrored
  edges, as OpenCV's ``filter2D``), computed here in float64, the disk renormalised to sum 1 (the
  published one sums to about 1.01 from radius 8 on, which brightens the picture).

``corrupt(images, name, severity, seed, keys)`` maps a uint8 batch (N, H, W) or (N, H, W, C) to a
corrupted uint8 batch of the same shape; :func:`corrupt_split` gives a :class:`nctv.data.Split`
whose images are corrupted (its fingerprint, and so its cached logits, differ per corruption,
severity and seed).
"""
from __future__ import annotations

import hashlib
import io
import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image

from nctv.checks import shown
from nctv.data import ArrayImages, Split
from nctv.settings import CORRUPTION_NAMES, SEVERITIES, SHIFT_CORRUPTIONS

#: Images whose shorter side is at most this many pixels take CIFAR-10-C's parameters.
SMALL_SIDE = 64
#: Images corrupted at once (bounds the float64 working memory of a large split).
_CHUNK = 512


#: Adjectives that keep their capital inside a sentence ("under Gaussian noise").
PROPER_WORDS = ("Gaussian",)


def in_words(title: str) -> str:
    """A corruption's title inside a sentence: "contrast", "Gaussian noise", "JPEG compression"."""
    first = title.split(" ", 1)[0]
    keep = first in PROPER_WORDS or any(ch.isupper() for ch in first[1:])
    return title if keep else title[:1].lower() + title[1:]


@dataclass(frozen=True)
class Corruption:
    """One corruption: ``apply(x, value, rngs)`` maps float64 images (N, H, W, C) in [0, 1] (or the
    uint8 batch where ``on_bytes``) to float64 images (clipped and rounded afterwards)."""

    name: str
    title: str
    what: str
    parameter: str
    small: tuple
    large: tuple
    apply: Callable[..., np.ndarray]
    random: bool = False
    on_bytes: bool = False
    source: str = "ImageNet-C"

    def value(self, severity: int, side: int) -> Any:
        """The parameter at ``severity`` (1–5) for images whose shorter side is ``side`` pixels."""
        return (self.small if side <= SMALL_SIDE else self.large)[severity - 1]

    def describe(self) -> str:
        return (f"{self.title}: {self.what} {self.parameter} by severity 1–5: {_values(self.small)} for images of "
                f"at most {SMALL_SIDE} px, {_values(self.large)} above ({self.source}).")


def _values(values: tuple) -> str:
    return ", ".join(str(v) for v in values)


# --------------------------------------------------------------------------- kernels


def _gaussian_taps(sigma: float) -> np.ndarray:
    """1-D Gaussian weights truncated at 4 σ (as scipy's and skimage's default), summing to 1."""
    radius = max(int(4.0 * sigma + 0.5), 1)
    t = np.arange(-radius, radius + 1, dtype=np.float64)
    w = np.exp(-0.5 * (t / sigma) ** 2)
    return w / w.sum()


def _disk(radius: float, alias_sigma: float) -> np.ndarray:
    """ImageNet-C's defocus kernel: the disk x² + y² ≤ r² on a grid of at least ±8, normalised, then
    smoothed by a small Gaussian (3 × 3, or 5 × 5 beyond radius 8; mirrored edges) and trimmed to the
    taps that are not zero."""
    half = max(8, int(math.ceil(radius)))
    t = np.arange(-half, half + 1, dtype=np.float64)
    disk = ((t[:, None] ** 2 + t[None, :] ** 2) <= radius ** 2).astype(np.float64)
    disk /= disk.sum()
    size = 3 if radius <= 8 else 5
    g = np.arange(size, dtype=np.float64) - size // 2
    g = np.exp(-0.5 * (g / alias_sigma) ** 2)
    g /= g.sum()
    kernel = _separable(disk[None, :, :, None], g, "reflect")[0, :, :, 0]
    rows, cols = np.nonzero(kernel)
    kernel = kernel[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    # Where the disk reaches the grid's edge (radius 8 and beyond) the mirrored smoothing adds weight;
    # the published kernel then sums to about 1.01 and brightens the image. Here it sums to 1.
    return kernel / kernel.sum()


def _pad(x: np.ndarray, ph: int, pw: int, mode: str) -> np.ndarray:
    """``x`` (N, H, W, C) padded by ``ph`` rows and ``pw`` columns ("edge": replicate, "reflect": mirror
    without repeating the edge; an image smaller than the reach mirrors with the edge repeated)."""
    if mode == "reflect" and (ph >= x.shape[1] or pw >= x.shape[2]):
        mode = "symmetric"
    return np.pad(x, ((0, 0), (ph, ph), (pw, pw), (0, 0)), mode=mode)


def _filter(x: np.ndarray, kernel: np.ndarray, mode: str) -> np.ndarray:
    """Correlate every channel of ``x`` (N, H, W, C) with a 2-D ``kernel`` (odd sides), edges padded by
    ``mode`` (see :func:`_pad`)."""
    kh, kw = kernel.shape
    h, w = x.shape[1], x.shape[2]
    padded = _pad(x, kh // 2, kw // 2, mode)
    out = np.zeros_like(x)
    for i in range(kh):
        for j in range(kw):
            if kernel[i, j] != 0.0:
                out += kernel[i, j] * padded[:, i:i + h, j:j + w]
    return out


def _separable(x: np.ndarray, taps: np.ndarray, mode: str) -> np.ndarray:
    """The 2-D filter ``outer(taps, taps)`` as two 1-D passes: along the columns, then the rows."""
    k = len(taps)
    h, w = x.shape[1], x.shape[2]
    padded = _pad(x, k // 2, k // 2, mode)
    tmp = np.zeros((x.shape[0], h + 2 * (k // 2), w) + x.shape[3:])
    for j in range(k):
        tmp += taps[j] * padded[:, :, j:j + w]
    out = np.zeros_like(x)
    for i in range(k):
        out += taps[i] * tmp[:, i:i + h]
    return out


# --------------------------------------------------------------------------- the corruptions


def _gaussian_noise(x: np.ndarray, sd: float, rngs: Sequence[np.random.Generator]) -> np.ndarray:
    return x + np.stack([r.normal(0.0, sd, size=x.shape[1:]) for r in rngs])


def _shot_noise(x: np.ndarray, photons: float, rngs: Sequence[np.random.Generator]) -> np.ndarray:
    return np.stack([r.poisson(xi * photons) for r, xi in zip(rngs, x)]).astype(np.float64) / photons


def _gaussian_blur(x: np.ndarray, sigma: float, rngs: Any = None) -> np.ndarray:
    return _separable(x, _gaussian_taps(sigma), "edge")


def _defocus_blur(x: np.ndarray, value: tuple[float, float], rngs: Any = None) -> np.ndarray:
    return _filter(x, _disk(*value), "reflect")


def _contrast(x: np.ndarray, factor: float, rngs: Any = None) -> np.ndarray:
    mean = x.mean(axis=(1, 2), keepdims=True)
    return (x - mean) * factor + mean


def _brightness(x: np.ndarray, step: float, rngs: Any = None) -> np.ndarray:
    # V of HSV is the largest channel; with hue and saturation fixed, every channel scales with V, so
    # raising V by ``step`` scales the pixel by (V + step) / V (a black pixel becomes grey ``step``).
    v = x.max(axis=3, keepdims=True)
    raised = np.clip(v + step, 0.0, 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        scaled = np.where(v > 0, x * (raised / np.where(v > 0, v, 1.0)), raised)
    return scaled


def _per_image(images: np.ndarray, fn: Callable[[Image.Image], Image.Image]) -> np.ndarray:
    out = np.empty(images.shape, dtype=np.float64)
    for i, im in enumerate(images):
        pil = Image.fromarray(im[..., 0] if im.shape[2] == 1 else im)
        res = np.asarray(fn(pil), dtype=np.float64)
        out[i] = res.reshape(im.shape)
    return out / 255.0


def _jpeg(images: np.ndarray, quality: int, rngs: Any = None) -> np.ndarray:
    def once(pil: Image.Image) -> Image.Image:
        buf = io.BytesIO()
        pil.save(buf, format="JPEG", quality=int(quality))
        buf.seek(0)
        with Image.open(buf) as im:
            return im.convert(pil.mode)

    return _per_image(images, once)


def _pixelate(images: np.ndarray, fraction: float, rngs: Any = None) -> np.ndarray:
    def once(pil: Image.Image) -> Image.Image:
        w, h = pil.size
        small = pil.resize((max(int(w * fraction), 1), max(int(h * fraction), 1)), Image.BOX)
        return small.resize((w, h), Image.BOX)

    return _per_image(images, once)


def _rotation(x: np.ndarray, degrees: float, rngs: Sequence[np.random.Generator]) -> np.ndarray:
    # Each image turns by ±degrees (its own generator picks the sign) about its centre, bilinear,
    # with mirrored edges so no black corners appear.
    signs = np.array([1.0 if r.random() < 0.5 else -1.0 for r in rngs])
    theta = np.deg2rad(degrees) * signs
    cos, sin = np.cos(theta), np.sin(theta)
    zeros = np.zeros_like(cos)
    h, w = x.shape[1], x.shape[2]
    # Normalised coordinates run over a non-square image unequally: scale the rotation's off-diagonal.
    mats = np.stack([np.stack([cos, -sin * h / w, zeros], 1), np.stack([sin * w / h, cos, zeros], 1)], 1)
    t = torch.from_numpy(x).permute(0, 3, 1, 2)
    grid = torch.nn.functional.affine_grid(torch.from_numpy(mats), list(t.shape), align_corners=False)
    out = torch.nn.functional.grid_sample(t, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
    return out.permute(0, 2, 3, 1).numpy()


#: Every corruption by name, in the order of tables and menus.
CORRUPTIONS: dict[str, Corruption] = {c.name: c for c in (
    Corruption("gaussian-noise", "Gaussian noise", "x + N(0, sd²) per pixel and channel,", "sd (of the 0–1 range)",
               (0.04, 0.06, 0.08, 0.09, 0.10), (0.08, 0.12, 0.18, 0.26, 0.38), _gaussian_noise, random=True),
    Corruption("shot-noise", "Shot noise", "Poisson(x · photons) / photons per pixel,", "photons",
               (500, 250, 100, 75, 50), (60, 25, 12, 5, 3), _shot_noise, random=True),
    Corruption("gaussian-blur", "Gaussian blur", "a Gaussian filter (edges replicated),", "σ in pixels",
               (0.4, 0.6, 0.7, 0.8, 1.0), (1, 2, 3, 4, 6), _gaussian_blur,
               source="ImageNet-C's extra corruptions"),
    Corruption("defocus-blur", "Defocus blur", "an anti-aliased disk (edges mirrored),", "(radius, anti-alias σ) in pixels",
               ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)),
               ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)), _defocus_blur),
    Corruption("contrast", "Contrast", "(x − m) · factor + m with m each image's mean per channel,", "factor",
               (0.75, 0.5, 0.4, 0.3, 0.15), (0.4, 0.3, 0.2, 0.1, 0.05), _contrast),
    Corruption("brightness", "Brightness", "the value V of HSV raised by a step (clipped),", "step",
               (0.05, 0.1, 0.15, 0.2, 0.3), (0.1, 0.2, 0.3, 0.4, 0.5), _brightness),
    Corruption("jpeg", "JPEG compression", "saved as JPEG and read back,", "quality",
               (80, 65, 58, 50, 40), (25, 18, 15, 10, 7), _jpeg, on_bytes=True),
    Corruption("pixelate", "Pixelation", "shrunk by a fraction and enlarged back (box filter both ways),", "fraction",
               (0.95, 0.9, 0.85, 0.75, 0.65), (0.6, 0.5, 0.4, 0.3, 0.25), _pixelate, on_bytes=True),
    Corruption("rotation", "Rotation", "turned about the centre by ± an angle (sign drawn per image; bilinear, "
               "edges mirrored),", "degrees", (3, 6, 9, 12, 15), (3, 6, 9, 12, 15), _rotation, random=True,
               source="NCTV's own angles; not an ImageNet-C corruption"),
)}
if tuple(CORRUPTIONS) != CORRUPTION_NAMES:  # the settings list the names for code that must not import this
    raise ImportError("nctv.settings.CORRUPTION_NAMES and nctv.corruptions.CORRUPTIONS disagree.")
#: The default shift study: ImageNet-C's kinds (noise, blur, digital), without rotation.
DEFAULT_CORRUPTIONS = SHIFT_CORRUPTIONS


def check_corruption(name: Any) -> str:
    """A known corruption name (its title, any case, or its name with _ or spaces, is accepted too)."""
    if isinstance(name, str):
        key = name.strip().lower().replace("_", "-").replace(" ", "-")
        if key in CORRUPTIONS:
            return key
        for c in CORRUPTIONS.values():
            if c.title.lower().replace(" ", "-") == key:
                return c.name
    raise ValueError(f"Unknown corruption {shown(name)}; use one of: {', '.join(CORRUPTIONS)}.")


def check_severity(severity: Any) -> int:
    """A severity from 0 (clean) to 5."""
    if isinstance(severity, bool) or not isinstance(severity, (int, np.integer)) or not 0 <= int(severity) <= 5:
        raise ValueError(f"A corruption's severity must be a whole number from 0 (clean) to 5; got {shown(severity)}.")
    return int(severity)


def _code(name: str) -> int:
    return zlib.crc32(name.encode())


def generators(name: str, severity: int, seed: int, keys: Sequence[int]) -> list[np.random.Generator]:
    """One generator per image, from (seed, corruption, severity, image key)."""
    code = _code(name)
    return [np.random.default_rng([int(seed) & 0xFFFFFFFF, code, int(severity), int(k)]) for k in keys]


def corrupt(images: np.ndarray, name: str, severity: int, seed: int = 0, keys: Sequence[int] | None = None) -> np.ndarray:
    """``images`` (uint8, (N, H, W) or (N, H, W, C)) with corruption ``name`` at ``severity``.

    ``keys`` name each image for its random draws (default 0…N−1; a split passes each image's index
    in its dataset, so that the same image is corrupted the same way wherever it is read). Severity 0
    returns a copy of the images.
    """
    name, severity = check_corruption(name), check_severity(severity)
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[3] not in (1, 3)):
        raise ValueError(f"Corruptions take uint8 images (N, H, W) or (N, H, W, 1 or 3); got {images.dtype} {images.shape}.")
    if severity == 0 or images.shape[0] == 0:
        return images.copy()
    keys = np.arange(images.shape[0]) if keys is None else np.asarray(keys, dtype=np.int64).reshape(-1)
    if keys.shape[0] != images.shape[0]:
        raise ValueError(f"{keys.shape[0]} keys for {images.shape[0]} images.")
    spec = CORRUPTIONS[name]
    value = spec.value(severity, min(images.shape[1], images.shape[2]))
    x4 = images[..., None] if images.ndim == 3 else images
    out = np.empty_like(x4)
    for start in range(0, x4.shape[0], _CHUNK):
        part = x4[start:start + _CHUNK]
        rngs = generators(name, severity, seed, keys[start:start + _CHUNK]) if spec.random else None
        y = spec.apply(part if spec.on_bytes else part / 255.0, value, rngs)
        out[start:start + _CHUNK] = np.clip(np.rint(np.clip(y, 0.0, 1.0) * 255.0), 0, 255).astype(np.uint8)
    return out[..., 0] if images.ndim == 3 else out


def corrupt_image(image: Image.Image, name: str, severity: int, seed: int = 0, key: int = 0) -> Image.Image:
    """One PIL image corrupted (grey stays grey; any other mode is read as RGB)."""
    mode = image.mode if image.mode in ("L", "RGB") else ("L" if image.mode in ("1", "I", "I;16", "F", "LA") else "RGB")
    arr = np.asarray(image.convert(mode), dtype=np.uint8)
    return Image.fromarray(corrupt(arr[None], name, severity, seed, [key])[0])


# --------------------------------------------------------------------------- corrupted splits


def _tag(name: str, severity: int, seed: int) -> bytes:
    return f"corruption\0{name}\0{severity}\0{seed}\0".encode()


class CorruptedImages:
    """An image source (``pil(i)``, ``digest``) whose images are another source's, corrupted when read."""

    def __init__(self, source: Any, name: str, severity: int, seed: int = 0):
        self.source, self.name, self.severity, self.seed = source, check_corruption(name), check_severity(severity), int(seed)
        self.description = f"{source.description}, {CORRUPTIONS[self.name].title.lower()} {self.severity}"

    def __len__(self) -> int:
        return len(self.source)

    def pil(self, i: int) -> Image.Image:
        return corrupt_image(self.source.pil(i), self.name, self.severity, self.seed, int(i))

    def digest(self, indices: np.ndarray) -> bytes:
        return hashlib.sha256(_tag(self.name, self.severity, self.seed) + self.source.digest(indices)).digest()


def check_corruptible(split: Any) -> None:
    """Refuse a split that holds no pictures (preprocessed tensors cannot be corrupted in pixel space)."""
    if not isinstance(split, Split):
        raise ValueError("Corruptions act on images before the model's preprocessing, and this split holds "
                         "preprocessed tensors; draw the splits with nctv.data.get_splits (embedded, folder: or "
                         "hf-dataset: data).")


def corrupt_split(split: Any, name: str, severity: int, seed: int = 0) -> Any:
    """``split`` with every image corrupted (severity 0: the split itself).

    In-memory images are corrupted at once (the vectorised path, then preprocessed as fast as the clean
    ones); images read from files or the Hub are corrupted as they are read. Both give the same pixels
    for the same image. The fingerprint, and so the cache key of the split's logits, names the
    corruption, its severity and its seed.
    """
    name, severity = check_corruption(name), check_severity(severity)
    if severity == 0:
        return split
    check_corruptible(split)
    title = CORRUPTIONS[name].title.lower()
    label = f"{split.name}, {title} {severity}"
    if isinstance(split.source, ArrayImages):
        images = corrupt(split.source.images[split.indices], name, severity, seed, split.indices)
        source = CorruptedArrayImages(images, f"{split.source.description}, {title} {severity}",
                                 _tag(name, severity, seed) + split.source.digest(split.indices))
        return Split(label, source, np.arange(len(split)), split.labels.numpy(), split.class_names, split.data_config)
    return Split(label, CorruptedImages(split.source, name, severity, seed), split.indices, split.labels.numpy(),
                 split.class_names, split.data_config)


class CorruptedArrayImages(ArrayImages):
    """Corrupted in-memory images: the array path of :func:`corrupt_split`. Fingerprinted by what they
    came from and the corruption (as exact as hashing the pixels, and cheaper)."""

    def __init__(self, images: np.ndarray, description: str, origin: bytes):
        super().__init__(images, description)
        self.origin = origin

    def digest(self, indices: np.ndarray) -> bytes:
        return hashlib.sha256(self.origin + np.asarray(indices, np.int64).tobytes()).digest()
