"""Turning whatever a person hands NCTV (a file, a paste, a webcam frame, a drawing) into one PIL
image the model's preprocessing accepts, with a clear message for anything that is not. Used by
the app's Try tab and by ``nctv apply``; it needs no Gradio.

Limits, chosen for a small shared server: at most :data:`MAX_PIXELS` pixels and :data:`MAX_IMAGE_BYTES`
bytes once decoded, both checked from the file header before any pixel is decoded (the app also caps
uploads and requests, see ``nctv.ui.images`` and ``nctv.ui.guard``).
"""
from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import PIL.Image
import PIL.ImageChops
import PIL.ImageOps
import PIL.PngImagePlugin

from nctv.checks import env_limit, shown

#: Largest image accepted, in pixels (40 megapixels, e.g. 8000 × 5000); ``$NCTV_MAX_PIXELS``.
MAX_PIXELS = env_limit("NCTV_MAX_PIXELS", 40_000_000)
#: Largest image accepted once decoded, in bytes (pixels × channels × bytes per channel: an 8-bit RGB
#: picture at :data:`MAX_PIXELS`); ``$NCTV_MAX_IMAGE_BYTES``. Pixel count alone lets a 16-bit RGBA
#: file take 8 bytes a pixel, and every later step (channels, transparency) copies it.
MAX_IMAGE_BYTES = env_limit("NCTV_MAX_IMAGE_BYTES", 120_000_000)
#: Longest side over shortest side: beyond this, resizing the short side to the model's input size
#: would blow the long side up to an absurd size.
MAX_ASPECT = 20

# PIL refuses images over twice this many pixels while reading the header and warns above it.
# The app checks MAX_PIXELS itself first, so PIL's own guard only backs it up.
PIL.Image.MAX_IMAGE_PIXELS = MAX_PIXELS
# Text chunks (zTXt, iTXt) are never used here, and PIL inflates them while reading the header: a
# few hundred kilobytes can hold gigabytes. PIL's defaults allow 1 MB a chunk and 64 MB in all.
PIL.PngImagePlugin.MAX_TEXT_CHUNK = 256 * 1024
PIL.PngImagePlugin.MAX_TEXT_MEMORY = 1024 * 1024


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


def decoded_bytes(img: PIL.Image.Image) -> int:
    """Bytes the pixels of an opened (not yet decoded) image take once decoded: pixels × channels ×
    bytes per channel, the larger of the file's (2 for a 16-bit PNG) and PIL's (4 for modes I and F)."""
    tile_args = img.tile[0][3] if img.tile else ""
    rawmode = str(tile_args if isinstance(tile_args, str) else (tile_args or ("",))[0])
    per_channel = 4 if img.mode in ("I", "F") or "32" in rawmode else 2 if "16" in img.mode + rawmode else 1
    return img.size[0] * img.size[1] * len(img.getbands()) * per_channel


def check_header(img: PIL.Image.Image) -> None:
    """Refuse an opened image whose pixels would be too many or too large, before they are decoded."""
    _check_size(*img.size)
    need = decoded_bytes(img)
    if need > MAX_IMAGE_BYTES:
        raise ImageError(
            f"The image would take {need / 1e6:,.0f} MB once decoded ({img.size[0]} × {img.size[1]} pixels, "
            f"{len(img.getbands())} channels of {need // (img.size[0] * img.size[1] * len(img.getbands())) * 8} bits); "
            f"this app accepts at most {MAX_IMAGE_BYTES / 1e6:,.0f} MB. Please shrink it or save it with 8 bits per "
            "channel."
        )


def open_checked(source: str | Path | bytes | BinaryIO, name: str = "The file") -> PIL.Image.Image:
    """Open an image (a path, bytes or a binary file) reading only its header, and check it
    (:func:`check_header`); the pixels are decoded later, by ``load()``. ``name`` names the
    source in messages."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    try:
        with warnings.catch_warnings():
            # check_header says more than PIL's warning (PIL still refuses twice MAX_PIXELS itself).
            warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
            img = PIL.Image.open(source)
    except PIL.Image.DecompressionBombError:
        raise ImageError(
            f"The image is too large; this app accepts at most {MAX_PIXELS / 1e6:.0f} megapixels. Please shrink it."
        ) from None
    except PIL.UnidentifiedImageError:
        raise ImageError(
            f"{name} is not an image this app can read. Please upload a PNG, JPEG, WebP, BMP or GIF picture."
        ) from None
    except (OSError, SyntaxError, ValueError) as e:
        raise _damaged(name, e) from None
    check_header(img)
    return img


def _damaged(name: str, e: BaseException) -> ImageError:
    if "MAX_TEXT" in str(e):  # PIL's refusal of an oversized text chunk
        return ImageError(f"{name} carries more embedded text (metadata) than this app reads; please save the picture "
                          "again without its metadata.")
    return ImageError(f"{name} looks like an image but could not be decoded ({shown(str(e))}). It may be damaged.")


def open_image_file(path: str | Path) -> PIL.Image.Image:
    """Open and fully decode an image file, checking its size from the header first."""
    path = Path(path)
    if not path.is_file():
        raise ImageError("The uploaded file could not be found on the server; please upload it again.")
    name = shown(path.name)
    img = open_checked(path, name)
    try:
        img.load()
        # Phone pictures are often stored sideways with an orientation tag.
        return PIL.ImageOps.exif_transpose(img)
    except (OSError, SyntaxError, ValueError) as e:
        raise _damaged(name, e) from None


def _from_array(arr: np.ndarray) -> PIL.Image.Image:
    arr = np.asarray(arr)
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)):
        raise ImageError(
            f"An image array must be height × width (grey), × 3 (RGB) or × 4 (RGBA); got shape {tuple(arr.shape)}."
        )
    _check_size(arr.shape[1], arr.shape[0])
    if arr.nbytes > MAX_IMAGE_BYTES:
        raise ImageError(f"The image array takes {arr.nbytes / 1e6:,.0f} MB; this app accepts at most "
                         f"{MAX_IMAGE_BYTES / 1e6:,.0f} MB.")
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
        rgba = img if img.mode == "RGBA" else img.convert("RGBA")  # convert() copies even to the same mode
        base = PIL.Image.new("RGBA", rgba.size, background + (255,))
        return PIL.Image.alpha_composite(base, rgba).convert("RGB")
    return img


def is_grey(img: PIL.Image.Image) -> bool:
    """True for single-channel images and for colour images whose three channels are equal."""
    if img.mode in ("1", "L", "I", "I;16", "F", "LA"):
        return True
    # Band by band: a large picture is compared at one byte a pixel, not copied into wide arrays.
    r, g, b = (img if img.mode == "RGB" else img.convert("RGB")).split()
    return PIL.ImageChops.difference(r, g).getbbox() is None and PIL.ImageChops.difference(g, b).getbbox() is None


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
