"""Turning whatever a person hands NCTV (a file, a paste, a webcam frame, a drawing) into one PIL
image the model's preprocessing accepts, with a clear message for anything that is not. Used by
the app's Try tab and by ``nctv apply``; it needs no Gradio.

Limit, chosen for a small shared server: at most :data:`MAX_PIXELS` pixels, checked from the file
header before the pixels are decoded (the app also caps uploads, see ``nctv.ui.images``).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageOps

#: Largest image accepted, in pixels (40 megapixels, e.g. 8000 × 5000).
MAX_PIXELS = 40_000_000
#: Longest side over shortest side: beyond this, resizing the short side to the model's input size
#: would blow the long side up to an absurd size.
MAX_ASPECT = 20

# PIL refuses images over twice this many pixels while reading the header and warns above it.
# The app checks MAX_PIXELS itself first, so PIL's own guard only backs it up.
PIL.Image.MAX_IMAGE_PIXELS = MAX_PIXELS


class ImageError(ValueError):
    """An input that cannot be used as an image; the message is meant for the person."""


def _check_size(width: int, height: int) -> None:
    if width < 1 or height < 1:
        raise ImageError("The image is empty (0 pixels wide or high). Please use a real picture.")
    if width * height > MAX_PIXELS:
        raise ImageError(
            f"The image is {width} × {height} pixels ({width * height / 1e6:.0f} megapixels); this app accepts "
            f"at most {MAX_PIXELS / 1e6:.0f} megapixels. Please shrink it (any size from 28 × 28 up works) and try "
            "again."
        )
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise ImageError(
            f"The image is {width} × {height} pixels: one side is more than {MAX_ASPECT} times the other. "
            "Please crop it to roughly the shape of the object."
        )


def open_image_file(path: str | Path) -> PIL.Image.Image:
    """Open and fully decode an image file, checking its size from the header first."""
    path = Path(path)
    if not path.is_file():
        raise ImageError("The uploaded file could not be found on the server; please upload it again.")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
            img = PIL.Image.open(path)
            _check_size(*img.size)
            img.load()
            # Phone pictures are often stored sideways with an orientation tag.
            img = PIL.ImageOps.exif_transpose(img)
    except ImageError:
        raise
    except (PIL.Image.DecompressionBombError, PIL.Image.DecompressionBombWarning):
        raise ImageError(
            f"The image is too large; this app accepts at most {MAX_PIXELS / 1e6:.0f} megapixels. Please shrink it."
        ) from None
    except PIL.UnidentifiedImageError:
        raise ImageError(
            f"{path.name!r} is not an image this app can read. Please upload a PNG, JPEG, WebP, BMP or GIF picture."
        ) from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"{path.name!r} looks like an image but could not be decoded ({e}). It may be damaged.") \
            from None
    return img


def _from_array(arr: np.ndarray) -> PIL.Image.Image:
    arr = np.asarray(arr)
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)):
        raise ImageError(
            f"An image array must be height × width (grey), × 3 (RGB) or × 4 (RGBA); got shape {tuple(arr.shape)}."
        )
    _check_size(arr.shape[1], arr.shape[0])
    if arr.dtype != np.uint8:
        if np.issubdtype(arr.dtype, np.floating) and arr.size and np.nanmax(arr) <= 1.0:
            arr = arr * 255.0
        arr = np.clip(np.nan_to_num(arr), 0, 255).astype(np.uint8)
    return PIL.Image.fromarray(arr)


def to_pil(value: Any) -> PIL.Image.Image:
    """A PIL image from a file path, a PIL image, a numpy array or a Gradio editor value (its composite).

    Raises :class:`ImageError` (a ``ValueError``) with a message for the person when there is nothing
    usable.
    """
    if isinstance(value, dict):
        # gr.Sketchpad / gr.ImageEditor: the flattened drawing is the "composite".
        value = value.get("composite") if value.get("composite") is not None else value.get("background")
    if value is None:
        raise ImageError("No image yet: upload, paste, take or draw one, or pick an example.")
    if isinstance(value, PIL.Image.Image):
        _check_size(*value.size)
        return value
    if isinstance(value, np.ndarray):
        return _from_array(value)
    if isinstance(value, (str, Path)):
        return open_image_file(value)
    raise ImageError(f"Cannot read an image from a {type(value).__name__}.")


def flatten(img: PIL.Image.Image, background: tuple[int, int, int] = (0, 0, 0)) -> PIL.Image.Image:
    """8-bit pixels without transparency: 16-bit grey is scaled to 0–255, transparency is painted
    over ``background`` (black: Fashion-MNIST's backdrop)."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        arr = np.asarray(img, dtype=np.int64)
        # 16-bit files (PNG opens some as mode "I"); plain 8-bit values pass unchanged.
        img = PIL.Image.fromarray((arr >> 8 if arr.max(initial=0) > 255 else arr).clip(0, 255).astype(np.uint8))
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        base = PIL.Image.new("RGBA", rgba.size, background + (255,))
        return PIL.Image.alpha_composite(base, rgba).convert("RGB")
    return img


def is_grey(img: PIL.Image.Image) -> bool:
    """True for single-channel images and for colour images whose three channels are equal."""
    if img.mode in ("1", "L", "I", "I;16", "F", "LA"):
        return True
    rgb = np.asarray(img.convert("RGB"), dtype=np.int16)
    return bool((rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all())


def match_channels(img: PIL.Image.Image, channels: int) -> tuple[PIL.Image.Image, str]:
    """Convert to the model's channel count; returns the image and a note on what was changed ('' if nothing)."""
    img = flatten(img)
    grey = is_grey(img)
    if channels == 1:
        note = "" if grey else "The model reads grey images, so your colour image was converted to grey."
        return img.convert("L"), note
    if channels == 3:
        copied = grey and img.mode != "RGB"
        note = "The model reads colour images; your grey image was copied into all three colour channels."
        return img.convert("RGB"), note if copied else ""
    raise ImageError(f"Models with {channels} input channels cannot take pictures; this tab needs 1 (grey) or 3 (RGB).")
