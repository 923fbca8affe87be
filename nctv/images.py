"""Turning whatever a person hands NCTV (a file, a paste, a webcam frame, a drawing) into one PIL
image the model's preprocessing accepts, with a clear message for anything that is not. Used by
the app's Try tab and by ``nctv apply``; it needs no Gradio.

Only PNG, JPEG, WebP, GIF and BMP are read, known from their first bytes before PIL sees the file;
each file's structure is walked first (chunks, segments, scans, frames counted and capped, EXIF
bounded: :func:`survey`). Limits, chosen for a small shared server: at most :data:`MAX_PIXELS` pixels
and :data:`MAX_IMAGE_BYTES` bytes once decoded, and at most :data:`MAX_DECODE_BYTES` at the peak of
decoding and converting (:func:`peak_bytes`), all checked from the header before any pixel is decoded
(the app also caps uploads and requests, see ``nctv.ui.images`` and ``nctv.ui.guard``).
"""
from __future__ import annotations

import io
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import PIL.Image
import PIL.ImageChops
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
#: Most bytes decoding and converting one picture may take at its peak, counted per format and mode
#: from the header before any pixel is decoded: Pillow holds RGB and LA in 4 bytes a pixel, WebP's
#: decoder three more copies, a progressive JPEG all its coefficients, and conversion, transparency
#: and turning a phone picture upright each a copy (``$NCTV_MAX_DECODE_BYTES``; 240 MB: an 8-bit RGB
#: picture at :data:`MAX_PIXELS` takes 200 MB).
MAX_DECODE_BYTES = env_limit("NCTV_MAX_DECODE_BYTES", 2 * MAX_IMAGE_BYTES)
#: The formats read, as messages name them.
ALLOWED = "PNG, JPEG, WebP, GIF or BMP"
#: Pixels converted at once (transparency, 16-bit grey, the grey test): a strip, not a whole copy.
_STRIP_PIXELS = 2**20

# PIL refuses images over twice this many pixels while reading the header and warns above it.
# The app checks MAX_PIXELS itself first, so PIL's own guard only backs it up.
PIL.Image.MAX_IMAGE_PIXELS = MAX_PIXELS
# Text chunks (zTXt, iTXt) are never used here, and PIL inflates them while reading the header: a
# few hundred kilobytes can hold gigabytes. PIL's defaults allow 1 MB a chunk and 64 MB in all.
PIL.PngImagePlugin.MAX_TEXT_CHUNK = 256 * 1024
PIL.PngImagePlugin.MAX_TEXT_MEMORY = 1024 * 1024


class ImageError(ValueError):
    """An input that cannot be used as an image; the message is meant for the person."""


# ----------------------------------------------------------------------------- before PIL sees a file
#
# The formats read, by their first bytes: what browsers, phones and the app's own pictures are (PNG,
# JPEG, WebP, GIF) and BMP, whose decoders are Pillow's own C code and whose headers give the size.
# Every other format Pillow knows is refused before it parses a byte: TIFF (its tags are read, and
# aliased tags copied, inside PIL.Image.open; its tiles may be far larger than the image), FITS (a
# pure-Python decoder), EPS (Ghostscript), PSD, ICO, SGI, PCX and the rest. Each file is then walked
# (its chunks, segments or blocks, counted and capped) and its metadata bounded before PIL opens it.

#: Most EXIF entries in all of a file's IFDs (a camera writes one to three hundred), and most bytes
#: their values may claim together: a value is copied once per entry that points at it, so a small
#: block whose thousands of entries all point at the same bytes takes hundreds of megabytes.
MAX_EXIF_ENTRIES = 2048
MAX_EXIF_BYTES = 2**20
#: Most scans in a progressive JPEG (encoders write 6 to 12; each scan is a pass over the whole image).
MAX_JPEG_SCANS = 64
#: Most chunks, segments or blocks walked in one file (a PNG's IDAT chunks of 8 to 64 KB, a JPEG's
#: segments, a WebP's frames, a GIF's extensions before its first picture); each costs Pillow a step
#: of Python.
MAX_PARTS = 2**15
#: Bytes per pixel Pillow's WebP decoder holds besides the picture: libwebp's canvas and its copy of
#: the previous frame, and the frame handed to Python, each 4 bytes a pixel.
WEBP_DECODER_BYTES = 12
_ORIENTATION = 0x0112
_SUB_IFDS = (0x8769, 0x8825, 0xA005)  # Exif, GPS, Interoperability
_TYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8, 17: 8, 18: 8}


@dataclass
class Survey:
    """What a walk through a file found before decoding: its format, its EXIF orientation (1: upright),
    and the bytes its decoder holds besides the picture (``per_pixel`` a pixel, plus ``extra``)."""

    format: str
    orientation: int = 1
    per_pixel: int = 0
    extra: int = 0


def format_of(head: bytes) -> str | None:
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head[:2] == b"BM":
        return "BMP"
    return None


def _too_much(what: str) -> ImageError:
    return ImageError(f"{{name}} carries {what}, more than this app reads; please save the picture again without its "
                     "metadata (or export it from any image editor).")


def _exif(block: bytes | memoryview) -> int:
    """Check an EXIF block (a TIFF header and its IFDs) from its entries' counts and sizes, before Pillow
    parses it; its orientation (1 if none or unreadable)."""
    block = bytes(block)
    if len(block) > MAX_EXIF_BYTES:
        raise _too_much(f"{len(block) / 1e6:,.1f} MB of EXIF metadata")
    order = {b"II": "<", b"MM": ">"}.get(block[:2])
    if order is None or len(block) < 8:
        return 1  # not parsed as EXIF by Pillow either
    todo, seen, entries, claimed, orientation = [struct.unpack_from(order + "I", block, 4)[0]], set(), 0, 0, 1
    while todo:
        offset = todo.pop()
        if offset in seen or not 8 <= offset <= len(block) - 2:
            continue
        seen.add(offset)
        (n,) = struct.unpack_from(order + "H", block, offset)
        entries += n
        if entries > MAX_EXIF_ENTRIES:
            raise _too_much(f"more than {MAX_EXIF_ENTRIES:,} EXIF entries")
        for i in range(min(n, (len(block) - offset - 2) // 12)):
            tag, kind, count, value = struct.unpack_from(order + "HHII", block, offset + 2 + 12 * i)
            size = _TYPE_SIZES.get(kind, 0) * count
            if size > 4:
                claimed += size
            if tag == _ORIENTATION and kind == 3 and count == 1:
                orientation = struct.unpack_from(order + "H", block, offset + 10 + 12 * i)[0]
            elif tag in _SUB_IFDS and kind in (4, 13) and count == 1:
                todo.append(value)
        if claimed > max(2 * len(block), 2**16):
            raise _too_much(f"EXIF entries that claim {claimed / 1e6:,.1f} MB in {len(block) / 1e3:,.1f} kB")
        if len(seen) < 8 and offset + 2 + 12 * n + 4 <= len(block):  # the next IFD (IFD1: the thumbnail's)
            todo.append(struct.unpack_from(order + "I", block, offset + 2 + 12 * n)[0])
    return orientation if 1 <= orientation <= 8 else 1


def _png(data) -> Survey:
    survey, pos, parts = Survey("PNG"), 8, 0
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        parts += 1
        if parts > MAX_PARTS:
            raise ImageError(f"{{name}} is split into more than {MAX_PARTS:,} chunks; please save the picture again.")
        if kind == b"eXIf":
            survey.orientation = _exif(data[pos + 8:pos + 8 + length])
        elif kind == b"IEND":
            break
        pos += 12 + length
    return survey


def _jpeg(data) -> Survey:
    survey, pos, parts, exif = Survey("JPEG"), 2, 0, False
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:  # Pillow skips bytes between segments, one by one
            at = data.find(b"\xff", pos)
            parts, pos = parts + ((at if at >= 0 else len(data)) - pos), (at if at >= 0 else len(data))
        else:
            parts += 1
        if parts > MAX_PARTS:
            raise ImageError(f"{{name}} is split into more than {MAX_PARTS:,} segments; please save the picture again.")
        if pos + 4 > len(data):
            break
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
            continue
        if marker == 0xD9:  # the end of the picture
            break
        (length,) = struct.unpack_from(">H", data, pos + 2)
        body = data[pos + 4:pos + 2 + length]
        if marker == 0xE1 and bytes(body[:6]) == b"Exif\0\0":  # Pillow reads the first
            orientation = _exif(body[6:])
            survey.orientation, exif = (survey.orientation, True) if exif else (orientation, True)
        elif marker == 0xE2 and bytes(body[:4]) == b"MPF\0":
            _exif(body[4:])  # a multi-picture index, parsed by Pillow as EXIF is
        elif marker in (0xC2, 0xC6, 0xCA, 0xCE) and len(body) >= 6:  # progressive: all coefficients held
            survey.extra = _coefficient_bytes(body)
        elif marker == 0xDA:
            scans, at = 1, pos + 2 + length
            while scans <= MAX_JPEG_SCANS and (at := data.find(b"\xff\xda", at)) >= 0:
                scans, at = scans + 1, at + 2  # 0xFF in coded data is always followed by 0x00
            if scans > MAX_JPEG_SCANS:
                raise ImageError(f"{{name}} is a progressive JPEG of more than {MAX_JPEG_SCANS} scans (cameras and "
                                 "editors write about 10); each costs a pass over the whole picture. Please save it "
                                 "again as an ordinary JPEG or PNG.")
            break
        pos += 2 + length
    return survey


def _coefficient_bytes(sof) -> int:
    """Bytes libjpeg holds for a progressive JPEG's coefficients: 2 per sample, of every component."""
    height, width, n = struct.unpack_from(">HHB", sof, 1)
    factors = [(sof[6 + 3 * i + 1] >> 4, sof[6 + 3 * i + 1] & 15) for i in range(n) if 6 + 3 * i + 2 < len(sof)]
    if not factors:
        return 0
    h_max, v_max = max(max(h for h, _ in factors), 1), max(max(v for _, v in factors), 1)
    return sum(2 * (-(-width * h // (8 * h_max)) * 8) * (-(-height * v // (8 * v_max)) * 8) for h, v in factors)


def _webp(data) -> Survey:
    survey, pos, frames = Survey("WEBP", per_pixel=WEBP_DECODER_BYTES), 12, 0
    while pos + 8 <= len(data):
        kind, length = struct.unpack_from("<4sI", data, pos)
        frames += kind == b"ANMF"
        if frames > MAX_PARTS:
            raise ImageError(f"{{name}} is an animation of more than {MAX_PARTS:,} frames; please upload one picture.")
        if kind == b"EXIF":
            body = data[pos + 8:pos + 8 + length]
            survey.orientation = _exif(body[6:] if bytes(body[:6]) == b"Exif\0\0" else body)
        pos += 8 + length + (length & 1)
    return survey


def _gif(data) -> Survey:
    """A GIF's blocks up to its first picture (Pillow walks them one by one in Python)."""
    pos, parts = 13, 0
    flags = data[10] if len(data) > 10 else 0
    if flags & 0x80:
        pos += 3 << ((flags & 7) + 1)
    while pos < len(data) and data[pos] == 0x21:  # extensions: their sub-blocks
        pos += 2
        while pos < len(data) and data[pos]:
            parts += 1
            if parts > MAX_PARTS:
                raise ImageError(f"{{name}} holds more than {MAX_PARTS:,} blocks before its picture; please save it "
                                 "again.")
            pos += 1 + data[pos]
        pos += 1
    return Survey("GIF")


_WALKS = {"PNG": _png, "JPEG": _jpeg, "WEBP": _webp, "GIF": _gif, "BMP": lambda data: Survey("BMP")}


def survey(data) -> Survey:
    """Check a file's bytes (``bytes`` or an mmap) before PIL sees them: its format from its first bytes
    (PNG, JPEG, WebP, GIF or BMP), its parts counted and its metadata bounded. Messages hold ``{name}``."""
    kind = format_of(bytes(data[:12]))
    if kind is None:
        raise ImageError(f"{{name}} is not an image this app can read. Please upload a {ALLOWED} picture.")
    try:
        return _WALKS[kind](data)
    except (struct.error, IndexError):
        raise ImageError(f"{{name}} ends in the middle of its {kind} structure; it may be damaged.") from None


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
    """Open an image (a path, bytes or a binary file) reading only its header, and check it: its format
    and structure before PIL sees it (:func:`survey`), then its size and the peak its decoding takes
    (:func:`check_header`, :func:`peak_bytes`); the pixels are decoded later, by ``load()``. ``name``
    names the source in messages."""
    return _opened(source, name)[0]


def _opened(source: str | Path | bytes | BinaryIO, name: str) -> tuple[PIL.Image.Image, Survey]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = bytes(source)
        found = _surveyed(source, name)
        source = io.BytesIO(source)
    elif isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            try:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                data = b""
            try:
                found = _surveyed(data, name)
            finally:
                if isinstance(data, mmap.mmap):
                    data.close()
    else:
        source = io.BytesIO(source.read())
        found = _surveyed(source.getvalue(), name)
    try:
        with warnings.catch_warnings():
            # check_header says more than PIL's warning (PIL still refuses twice MAX_PIXELS itself).
            warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
            img = PIL.Image.open(source, formats=[found.format])
    except PIL.Image.DecompressionBombError:
        raise ImageError(
            f"The image is too large; this app accepts at most {MAX_PIXELS / 1e6:.0f} megapixels. Please shrink it."
        ) from None
    except PIL.UnidentifiedImageError:  # its first bytes are those of the format: the rest is not
        raise ImageError(f"{name} begins as a {found.format} picture but could not be read; it may be damaged or "
                         "cut short.") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise _damaged(name, e) from None
    check_header(img)
    need = peak_bytes(img, found)
    if need > MAX_DECODE_BYTES:
        img.close()
        how = ("WebP's decoder holds three more copies of it" if found.format == "WEBP"
               else "a progressive JPEG is held whole while it is decoded" if found.extra
               else "it is turned upright and converted" if found.orientation != 1 else "it is converted")
        raise ImageError(f"{name} ({img.size[0]} × {img.size[1]} pixels) would take about {need / 1e6:,.0f} MB to "
                         f"decode ({how}); this app allows {MAX_DECODE_BYTES / 1e6:,.0f} MB. Please shrink it or save "
                         "it as a PNG or an ordinary JPEG.")
    return img, found


def _surveyed(data, name: str) -> Survey:
    try:
        return survey(data)
    except ImageError as e:
        raise ImageError(str(e).replace("{name}", name, 1)) from None


def _held(mode: str) -> int:
    """Bytes a pixel of ``mode`` takes in Pillow: 1 for 1, L and P, 2 for 16-bit grey, else 4 (RGB too)."""
    return 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4


def peak_bytes(img: PIL.Image.Image, found: Survey) -> int:
    """The most bytes decoding an opened image and converting it for a model take at once: the picture
    in Pillow with its decoder's own buffers, then with its upright copy (if its EXIF says it is
    turned), then with its conversion (to grey from RGB or LA, 1 byte a pixel; to RGB from anything
    else, 4; transparency and 16-bit grey are converted a strip at a time)."""
    pixels = img.size[0] * img.size[1]
    held = pixels * _held(img.mode)
    decoding = held + pixels * found.per_pixel + found.extra
    turning = 2 * held if found.orientation != 1 else 0
    converting = held + pixels * (1 if img.mode in ("RGB", "LA") else 4)  # LA: grey (then 1 + 4 to RGB)
    return max(decoding, turning, converting)


def _damaged(name: str, e: BaseException) -> ImageError:
    if "MAX_TEXT" in str(e):  # PIL's refusal of an oversized text chunk
        return ImageError(f"{name} carries more embedded text (metadata) than this app reads; please save the picture "
                          "again without its metadata.")
    # The decoder's own words are left out: they name its internals ("could not create decoder object"), or a path.
    return ImageError(f"{name} looks like an image but could not be decoded; it may be damaged or cut short. Please "
                      "save it again as a PNG or JPEG.")


def open_image_file(path: str | Path) -> PIL.Image.Image:
    """Open and fully decode an image file, checking its size from the header first."""
    path = Path(path)
    if not path.is_file():
        raise ImageError("The uploaded file could not be found on the server; please upload it again.")
    name = shown(path.name)
    img, found = _opened(path, name)
    try:
        img.load()
        # Phone pictures are often stored sideways with an orientation tag (read by survey: PIL's
        # exif_transpose would parse the whole EXIF again, rewrite it, and copy an upright picture).
        turn = _TURNS.get(found.orientation)
        return img if turn is None else img.transpose(turn)
    except (OSError, SyntaxError, ValueError) as e:
        raise _damaged(name, e) from None


# EXIF orientation -> the turn that makes the picture upright.
_TURNS = {2: PIL.Image.Transpose.FLIP_LEFT_RIGHT, 3: PIL.Image.Transpose.ROTATE_180,
          4: PIL.Image.Transpose.FLIP_TOP_BOTTOM, 5: PIL.Image.Transpose.TRANSPOSE, 6: PIL.Image.Transpose.ROTATE_270,
          7: PIL.Image.Transpose.TRANSVERSE, 8: PIL.Image.Transpose.ROTATE_90}


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


def _strips(img: PIL.Image.Image):
    """The boxes of horizontal strips of about :data:`_STRIP_PIXELS` pixels covering ``img``."""
    rows = max(1, _STRIP_PIXELS // max(img.width, 1))
    for top in range(0, img.height, rows):
        yield 0, top, img.width, min(img.height, top + rows)


def flatten(img: PIL.Image.Image, background: tuple[int, int, int] = (0, 0, 0)) -> PIL.Image.Image:
    """8-bit pixels without transparency: 16-bit grey is scaled to 0–255, transparency is painted
    over ``background`` (black: Fashion-MNIST's backdrop); grey with transparency stays grey. Done a
    strip at a time, so the peak is the picture and its result, not three whole copies."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit files (PNG opens some as mode "I"); plain 8-bit values pass unchanged.
        shift = 8 if img.getextrema()[1] > 255 else 0
        out = PIL.Image.new("L", img.size)
        for box in _strips(img):
            arr = np.asarray(img.crop(box), dtype=np.int64)
            out.paste(PIL.Image.fromarray((arr >> shift).clip(0, 255).astype(np.uint8)), box[:2])
        return out
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        out = PIL.Image.new("L" if img.mode == "LA" else "RGB", img.size)
        for box in _strips(img):
            part = img.crop(box).convert("RGBA")  # crop keeps the palette and its transparency
            base = PIL.Image.new("RGBA", part.size, background + (255,))
            out.paste(PIL.Image.alpha_composite(base, part).convert(out.mode), box[:2])
        return out
    return img


def is_grey(img: PIL.Image.Image) -> bool:
    """True for single-channel images and for colour images whose three channels are equal."""
    if img.mode in ("1", "L", "I", "I;16", "F", "LA"):
        return True
    # Strip by strip, band by band: a large picture is compared at one byte a pixel of one strip.
    for box in _strips(img):
        part = img.crop(box)
        r, g, b = (part if part.mode == "RGB" else part.convert("RGB")).split()
        if PIL.ImageChops.difference(r, g).getbbox() is not None or PIL.ImageChops.difference(g, b).getbbox():
            return False
    return True


def match_channels(img: PIL.Image.Image, channels: int) -> tuple[PIL.Image.Image, str]:
    """Convert to the model's channel count; returns the image and a note on what was changed ('' if nothing)."""
    img = flatten(img)
    grey = is_grey(img)
    if channels == 1:
        note = "" if grey else "The model reads grey images, so your colour image was converted to grey."
        return (img if img.mode == "L" else img.convert("L")), note  # convert() copies even to the same mode
    if channels == 3:
        copied = grey and img.mode != "RGB"
        note = "The model reads colour images; your grey image was copied into all three colour channels."
        return (img if img.mode == "RGB" else img.convert("RGB")), note if copied else ""
    raise ImageError(f"Models with {channels} input channels cannot take pictures; this tab needs 1 (grey) or 3 (RGB).")
