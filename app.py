"""Start the NCTV web app: python app.py  (host $GRADIO_SERVER_NAME, default 0.0.0.0; port $PORT, default 7860)."""
import faulthandler
import os

# A crash in native code (a signal, not a Python exception) leaves every thread's stack in the server's log.
faulthandler.enable()

if os.environ.get("SPACES_ZERO_GPU"):
    from nctv.settings import fork_safe_environment

    fork_safe_environment()  # before torch loads: the server forks a worker for every GPU call
    # On a ZeroGPU Space the `spaces` package is imported before torch (it prepares CUDA for its workers).
    try:
        import spaces  # noqa: F401
    except ImportError:
        pass

from nctv.ui import launch  # noqa: E402

if __name__ == "__main__":
    launch()
