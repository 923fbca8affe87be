"""Push a run's calibrator to the visitor's own Hub repository, from the Calibrate tab.

Only on a Space with sign-in enabled (``hf_oauth: true`` in the README's front matter: the Hub then sets
``OAUTH_CLIENT_ID`` and the other sign-in variables); elsewhere the panel is not built at all. A visitor
signs in with Gradio's ``gr.LoginButton``; the push uses their own token (``gr.OAuthToken``) and goes to
``<their user name>/<name>``, as ``nctv push`` would (:mod:`nctv.push`): one commit with the calibrator,
its reliability diagram and its model card.

What is pushed is read from the run's downloads (``calibrators.zip``, ``results.json``,
``reliability.png``): they name files in Gradio's cache, which a page sends back, so the zip is unpacked
as the Try tab unpacks an upload (:func:`nctv.ui.upload_calibrator.unpack`: member by member, capped).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gradio as gr

from nctv.ui.common import user_errors

#: The downloads a run's push reads.
ZIP, RESULTS, DIAGRAM = "calibrators.zip", "results.json", "reliability.png"


def sign_in_enabled() -> bool:
    """Whether this server offers sign-in: a Space with ``hf_oauth: true`` (the Hub sets ``OAUTH_CLIENT_ID``)."""
    return bool(os.environ.get("OAUTH_CLIENT_ID"))


@user_errors
def push_run(files: Any, method: str, name: str, private: bool, profile: gr.OAuthProfile | None,
             token: gr.OAuthToken | None) -> str:
    """Push ``method``'s calibrator of the run whose downloads are ``files`` to ``<visitor>/<name>``."""
    from nctv.push import check_repo, push
    from nctv.results import CALIBRATORS_FOLDER
    from nctv.ui.upload_calibrator import unpack

    if profile is None or token is None:
        raise ValueError("Sign in with Hugging Face first (the button above): the calibrator goes to a repository "
                         "of your own.")
    repo = check_repo(f"{profile.username}/{(name or '').strip()}")
    paths = {Path(f).name: Path(f) for f in files or [] if isinstance(f, str)}
    if ZIP not in paths or RESULTS not in paths:
        raise ValueError("Run a calibration first: what is pushed is a calibrator your run fitted (the pre-computed "
                         "result's are the app's own).")
    with tempfile.TemporaryDirectory(prefix="nctv-push-") as tmp:
        run = Path(tmp)
        unpack(paths[ZIP], run / CALIBRATORS_FOLDER)
        for kept in (RESULTS, DIAGRAM):
            if kept in paths:
                shutil.copyfile(paths[kept], run / kept)
        url = push(run, method, repo, private=bool(private), token=token.token)
    return f"**Pushed** {method} to [{repo}](https://huggingface.co/{repo}) in one commit ({url})."


def push_panel(files: gr.File, methods: list[str]) -> None:
    """The sign-in button and the push form, below a run's downloads (``files``); nothing without sign-in."""
    if not sign_in_enabled():
        return
    with gr.Group(elem_id="push-panel"):
        gr.Markdown("**Put a calibrator on the Hub**: sign in, then push one calibrator of your latest run to a "
                    "repository of your own, with its model card and reliability diagram (as `nctv push` does).")
        gr.LoginButton(elem_id="push-login")
        with gr.Row():
            method = gr.Dropdown(methods, value=methods[0], label="Calibrator", elem_id="push-method")
            name = gr.Textbox(label="Repository name (under your user name)", placeholder="fmnist-resnet-ts",
                              max_lines=1, max_length=96, elem_id="push-name")
            private = gr.Checkbox(False, label="Private", elem_id="push-private")
        button = gr.Button("Push to the Hub", elem_id="push-button")
        status = gr.Markdown(elem_id="push-status")
    button.click(push_run, [files, method, name, private], status, api_name="push_calibrator",
                 api_visibility="undocumented", concurrency_limit=1)
