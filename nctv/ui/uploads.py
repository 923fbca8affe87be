"""The files a call may name: only those uploaded to this app (Gradio's upload folder, where the page's
own values lie too: a shipped example, a run's downloads, a drawing's canvas).

Before a handler runs, Gradio moves every file a call's values name into its cache, whatever the input
(a text box given a file object too): it downloads an http(s) address, of any size, and copies a path
on the server after a check that it lies in the upload folder, a check it skips outside a request it
serves itself. :func:`uploads_only` is the app's own check, made first, for every event, whatever its
route (the page, ``gradio_client``, a raw ``/gradio_api/call`` or ``queue/join`` body, the agents'
tools): a web address or a path elsewhere is refused in words, before anything is fetched or read.
"""
from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any, Callable

import gradio as gr
from gradio_client.utils import is_file_obj_with_meta, is_http_url_like, traverse

from nctv.checks import shown
from nctv.ui.common import redact

#: Where the app serves its files; the one kind of web address a call may name, for an upload.
FILE_ROUTE = "/gradio_api/file="
UPLOAD_FIRST = ("Upload the file to this app first (POST it to /gradio_api/upload: gradio_client's handle_file "
                "does so for a file on your computer, Gradio's upload_file_to_gradio tool for an agent) and pass "
                "the path or the address …/gradio_api/file=<path> it gives: this app fetches no web address and "
                "reads no other file of its server.")


def uploaded(path: Any, label: str = "The file") -> str:
    """The server path of a file uploaded to this app, named by its path or by the address the app serves
    it at (an agent's upload tool gives that); anything else is refused with a :class:`gradio.Error`."""
    from gradio.utils import get_upload_folder

    named, inside = path, False
    if is_http_url_like(path):
        route = urllib.parse.urlsplit(path).path
        path = urllib.parse.unquote(route.split(FILE_ROUTE, 1)[1]) if FILE_ROUTE in route else None
    if path is not None:
        try:
            # Resolved, so that neither "..", nor a link, nor Gradio's other served folders lead out of it.
            local = Path(path).resolve()
            inside = local.is_relative_to(Path(get_upload_folder()).resolve()) and local.is_file()
        except (OSError, ValueError, TypeError):  # a NUL byte, a name too long, not text
            pass
    if not inside:
        what = "the web address " if path is None else ""
        raise gr.Error(redact(f"{label} names {what}{shown(named)}, which is not a file uploaded to this app. "
                              + UPLOAD_FIRST), print_exception=False)
    return path


def uploads_only(blocks: list, values: list, label: Callable[[Any], str]) -> list:
    """``values`` of a call to the input ``blocks``, with every file they name checked by :func:`uploaded`
    (an address of the app's own file route replaced by its path), each refusal naming its input by
    ``label(block)``. Each value is walked as Gradio walks it to move its files, whatever its input; the
    path is what Gradio reads (a file's ``url`` only says where the page shows it, and an inline ``data:``
    picture is read by the picture input's own checks)."""
    checked = []
    for block, value in zip(blocks, values):
        if not getattr(block, "stateful", False):  # the server's own state, not what the call sent
            name = label(block)
            value = traverse(value, lambda file, name=name: dict(file, path=uploaded(file["path"], name)),
                             is_file_obj_with_meta)
        checked.append(value)
    return checked + list(values[len(checked):])
