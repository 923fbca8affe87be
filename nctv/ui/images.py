"""The app's picture input: ``gr.Image`` with the checks of :mod:`nctv.images` (which the Try tab
and ``nctv apply`` share), and the server's upload cap."""
from __future__ import annotations

import gradio as gr
import PIL.Image

from nctv.images import MAX_PIXELS

#: Largest upload accepted by the server (Gradio's size syntax).
MAX_FILE_SIZE = "25mb"


class CheckedImage(gr.Image):
    """``gr.Image`` handing the handler a file path, with unreadable or oversized uploads refused in
    the person's words instead of a decoder's traceback (Gradio opens the file while preprocessing)."""

    is_template = True  # drawn by the browser exactly as gr.Image

    def preprocess(self, payload):  # noqa: D401 - Gradio hook
        try:
            return super().preprocess(payload)
        except (PIL.Image.DecompressionBombError, PIL.Image.DecompressionBombWarning):
            raise gr.Error(f"The image is too large; this app accepts at most {MAX_PIXELS / 1e6:.0f} megapixels.") \
                from None
        except PIL.UnidentifiedImageError:
            raise gr.Error("That file is not an image this app can read. Please upload a PNG, JPEG, WebP, BMP or GIF "
                           "picture.") from None
        except (OSError, SyntaxError) as e:
            raise gr.Error(f"The image could not be read ({e}). It may be damaged.") from None
