"""The Gradio web app: ``build_app()`` assembles it, ``launch()`` serves it (see ``app.py``).

Both are imported on first use, so that importing one tab's module does not build the whole app."""
from typing import Any

__all__ = ["build_app", "launch"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from nctv.ui import app

        return getattr(app, name)
    raise AttributeError(f"module 'nctv.ui' has no attribute {name!r}")
