"""The app's picture inputs: ``gr.Image`` and ``gr.Sketchpad`` with one check of every picture they
receive — an uploaded file, an inline ``data:`` URL, a shipped example, each part of a drawing — made
from the file header (:func:`nctv.images.open_checked`) before Gradio decodes a single pixel, with
refusals in the person's words instead of a decoder's traceback.

Gradio decodes an inline picture and writes it out again while preprocessing, and decodes every
part of a drawing (background, layers, composite) into arrays: without a check first, a small
file of many pixels costs gigabytes there, before any handler could look at it.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import math
from typing import Any

import gradio as gr
import PIL.Image
from gradio import processing_utils
from gradio.components.base import server
from gradio.data_classes import FileData, ImageData

from nctv.checks import env_limit
from nctv.images import ALLOWED, MAX_IMAGE_BYTES, ImageError, decoded_bytes, open_checked

#: Largest uploaded file, in bytes (Gradio's ``max_file_size``), and largest picture sent inline as a
#: ``data:`` URL once decoded; ``$NCTV_MAX_UPLOAD_BYTES``.
MAX_UPLOAD_BYTES = env_limit("NCTV_MAX_UPLOAD_BYTES", 25 * 2**20)
#: Bytes of drawings held between the browser sending them and the event that reads them (for all
#: visitors together); past it the oldest are dropped.
PENDING_DRAWING_BYTES = 2 * MAX_UPLOAD_BYTES
#: Most layers a drawing may have (the sketchpad draws on one; each layer is a picture to check and
#: decode, and a crafted drawing can name one small file 20,000 times); ``$NCTV_MAX_DRAWING_LAYERS``.
MAX_DRAWING_LAYERS = env_limit("NCTV_MAX_DRAWING_LAYERS", 16)


def inline_bytes(url: str) -> bytes:
    """The file inside a ``data:…;base64,…`` URL, its length checked before it is decoded."""
    header, _, encoded = url.partition(",")
    if len(encoded) > 4 * math.ceil(MAX_UPLOAD_BYTES / 3):
        raise ImageError(f"The picture sent inline is about {len(encoded) * 3 / 4 / 1e6:,.1f} MB; this app accepts "
                         f"at most {MAX_UPLOAD_BYTES / 1e6:,.1f} MB.")
    if not header.endswith(";base64"):
        raise ImageError("A picture sent inline must be base64-encoded: data:image/png;base64,…")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("The picture sent inline is not valid base64.") from None


@contextlib.contextmanager
def _refusals():
    """Any error while reading a picture becomes a refusal for the page: Gradio's own message would
    show the upload's path on the server."""
    try:
        yield
    except gr.Error:
        raise
    except ImageError as e:
        raise gr.Error(str(e), print_exception=False) from None
    except PIL.Image.DecompressionBombError:
        raise gr.Error("The image is too large for this app. Please shrink it.", print_exception=False) from None
    except PIL.UnidentifiedImageError:
        raise gr.Error(f"That file is not an image this app can read. Please upload a {ALLOWED} picture.",
                       print_exception=False) from None
    except Exception:  # noqa: BLE001 - whatever the decoder met, the person gets one sentence
        raise gr.Error("The image could not be read. It may be damaged.", print_exception=False) from None


class CheckedImage(gr.Image):
    """``gr.Image`` whose uploads and inline pictures are checked from their header first; an
    inline picture is saved as sent (Gradio would decode and re-encode it)."""

    is_template = True  # drawn by the browser exactly as gr.Image

    def preprocess(self, payload: ImageData | None) -> Any:  # noqa: D401 - Gradio hook
        if payload is None:
            return None
        with _refusals():
            if payload.url and payload.url.startswith("data:"):
                data = inline_bytes(payload.url)
                with open_checked(data, "The picture sent inline") as img:
                    kind = (img.format or "png").lower()
                path = processing_utils.save_bytes_to_cache(data, f"image.{kind}", self.GRADIO_CACHE)
                self.temp_files.add(path)  # removed with the other uploads (the app's delete_cache)
                payload = ImageData(path=path, orig_name=f"image.{kind}")
            elif payload.path:
                open_checked(payload.path, "The uploaded file").close()
            else:
                raise ImageError("No picture was sent: give a file uploaded to this app (/gradio_api/upload) or a "
                                 "data: URL.")
            return super().preprocess(payload)


class CheckedSketchpad(gr.Sketchpad):
    """``gr.Sketchpad`` whose drawings are checked from their headers, all parts together, before
    Gradio decodes them; the drawings waiting to be read are bounded in bytes."""

    def get_block_name(self) -> str:
        return "imageeditor"  # the browser's component (the name of a template's parent otherwise)

    @server
    def accept_blobs(self, data: Any) -> None:
        """Where the browser sends a drawing's parts before the event that reads them."""
        blob = data.files[0][1] if data.files else b""
        with _refusals():
            if len(blob) > MAX_UPLOAD_BYTES:
                raise ImageError(f"The drawing is {len(blob) / 1e6:,.1f} MB; this app accepts at most "
                                 f"{MAX_UPLOAD_BYTES / 1e6:,.1f} MB.")
            open_checked(blob, "The drawing").close()
        super().accept_blobs(data)
        while len(self.blob_storage) > 1 and _stored_bytes(self.blob_storage) > PENDING_DRAWING_BYTES:
            self.blob_storage.pop(next(iter(self.blob_storage)))

    def preprocess(self, payload: Any) -> Any:  # noqa: D401 - Gradio hook
        if payload is None:
            return None
        with _refusals():
            total = sum(_header_bytes(part) for part in self._parts(payload))
            if total > MAX_IMAGE_BYTES:
                raise ImageError(f"The drawing's layers would take {total / 1e6:,.0f} MB once decoded; this app "
                                 f"accepts at most {MAX_IMAGE_BYTES / 1e6:,.0f} MB.")
            return super().preprocess(payload)

    def _parts(self, payload: Any) -> list:
        """Every picture of a drawing, as a path or bytes (what Gradio's own preprocessing decodes)."""
        if payload.id is not None:
            cached = self.blob_storage.get(payload.id)
            layers = cached.layers if cached else []
            parts = [cached.background, *layers, cached.composite] if cached else []
        else:
            layers = payload.layers
            parts = [payload.background, *layers, payload.composite]
        if len(layers) > MAX_DRAWING_LAYERS:
            raise ImageError(f"The drawing has {len(layers):,} layers; this app accepts at most {MAX_DRAWING_LAYERS}. "
                             f"Please merge its layers.")
        if any(isinstance(p, FileData) and not p.path for p in parts):
            raise ImageError("Part of the drawing did not reach the server; please draw it again.")
        return [p.path if isinstance(p, FileData) else p for p in parts if p is not None]


def _header_bytes(part: str | bytes) -> int:
    with open_checked(part, "The drawing") as img:
        return decoded_bytes(img)


def _stored_bytes(storage: dict) -> int:
    return sum(len(b) for v in storage.values() for b in (v.background, *v.layers, v.composite) if b is not None)
