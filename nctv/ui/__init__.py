"""The Gradio web app: ``build_app()`` assembles it, ``launch()`` serves it (see ``app.py``)."""
from nctv.ui.app import build_app, launch

__all__ = ["build_app", "launch"]
