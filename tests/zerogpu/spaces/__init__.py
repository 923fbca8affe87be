"""A stand-in for the ``spaces`` package on a CPU, keeping the ZeroGPU contract that the app must
live with (tests/test_zerogpu.py puts this folder on PYTHONPATH and sets SPACES_ZERO_GPU=1):

* every call of a ``@GPU`` function runs in a worker forked from the caller (multiprocessing's
  "fork" context), so the worker inherits the server's memory, including any OpenMP pool it used;
* arguments cross to the worker as a pickle, results come back as pickles (a generator's items one
  by one, as it yields them), and nothing the worker changes in memory comes back;
* ``duration`` (seconds, or a function of the call's arguments that gives them) is honoured: a
  worker still running past it is killed, and the call raises ``gr.Error("GPU task aborted")``.
  The app asks for the seconds its work takes on the Space's GPU; this machine's CPU is slower, by a
  factor that the test measures and hands over as ``SPACES_STANDIN_SLOWDOWN`` (default 1): the
  worker may run that many times its duration, at most ``SPACES_STANDIN_MAX_SECONDS``;
* closing a streaming call's generator (Gradio does on Stop) kills its worker;
* an exception in the worker comes back as the real package (0.51) hands it: a ``gr.Error`` as it
  is, any other as ``gr.Error`` whose message is only the exception's class name ("ValueError").

When ``SPACES_STANDIN_LOG`` names a file, each call appends a line there: the function's name, the
duration asked for, the worker's process id, how the call ended (done, error, aborted, closed) and
whether the caller was inside a Gradio request (``request`` or ``none``): the real package reads the
visitor's request from Gradio's context when the call is made, to charge the visitor's own quota.
"""
from __future__ import annotations

import functools
import inspect
import multiprocessing
import os
import pickle
import time
from typing import Any, Callable, Iterator

_FORK = multiprocessing.get_context("fork")


def _log(name: str, seconds: float, pid: int | None, how: str, request: bool) -> None:
    path = os.environ.get("SPACES_STANDIN_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{name}\t{seconds:g}\t{pid}\t{how}\t{'request' if request else 'none'}\n")


def _in_request() -> bool:
    """Whether this call sees the visitor's Gradio request, where the real package looks for it."""
    from gradio.context import LocalContext

    return LocalContext.request.get(None) is not None


def _as_real_package_hands_it(exc: BaseException) -> Exception:
    import gradio as gr

    if isinstance(exc, gr.Error):
        return exc
    return gr.Error(type(exc).__name__, title="ZeroGPU worker error")


def _aborted() -> Exception:
    import gradio as gr

    return gr.Error("GPU task aborted")


def _worker(conn: Any, fn: Callable, payload: bytes, stream: bool, seconds: float) -> None:
    """The forked worker: unpickle the arguments, run, send every item (or the result) pickled. One
    second before its duration ends it writes every thread's stack to stderr (why it is late)."""
    import faulthandler

    faulthandler.dump_traceback_later(min(max(seconds - 1, 0.5), 86_400), exit=False)
    try:
        args, kwargs = pickle.loads(payload)
        if stream:
            for item in fn(*args, **kwargs):
                conn.send_bytes(pickle.dumps(("item", item)))
        else:
            conn.send_bytes(pickle.dumps(("item", fn(*args, **kwargs))))
        conn.send_bytes(pickle.dumps(("end", None)))
    except BaseException as exc:  # noqa: BLE001 - handed to the caller, as the real package does
        conn.send_bytes(pickle.dumps(("error", _as_real_package_hands_it(exc))))
    finally:
        conn.close()
        os._exit(0)  # none of the server's exit handlers run in the worker


def _slowdown() -> float:
    return float(os.environ.get("SPACES_STANDIN_SLOWDOWN", "1"))


def _longest() -> float:
    """``SPACES_STANDIN_MAX_SECONDS``: no worker runs longer, whatever the slowdown (a test that would
    otherwise wait for ever on a hung worker fails instead, with the worker's stacks in the log)."""
    return float(os.environ.get("SPACES_STANDIN_MAX_SECONDS", "inf"))


def _call(fn: Callable, args: tuple, kwargs: dict, seconds: float, stream: bool) -> Iterator[Any]:
    request = _in_request()
    allowed = min(seconds * _slowdown(), _longest())  # the GPU's seconds, as this CPU takes them
    payload = pickle.dumps((args, kwargs))  # arguments cross as a pickle
    receive, send = _FORK.Pipe(duplex=False)
    proc = _FORK.Process(target=_worker, args=(send, fn, payload, stream, allowed), daemon=True)
    proc.start()
    send.close()
    how = "closed"
    deadline = time.monotonic() + allowed
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                how = "aborted"
                raise _aborted()
            if not receive.poll(min(left, 60)):  # a slow machine's allowance can exceed poll's longest wait
                continue
            try:
                kind, value = pickle.loads(receive.recv_bytes())
            except EOFError:  # the worker died without a word
                how = "aborted"
                raise _aborted() from None
            if kind == "item":
                yield value
            elif kind == "end":
                how = "done"
                return
            else:
                how = "error"
                raise value
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        receive.close()
        _log(getattr(fn, "__name__", "?"), seconds, proc.pid, how, request)


def GPU(fn: Callable | None = None, *, duration: float | Callable[..., float] = 60) -> Callable:  # noqa: N802
    """``@GPU`` or ``@GPU(duration=…)``: run each call in a forked worker (see the module's text)."""
    if fn is None:
        return lambda f: GPU(f, duration=duration)

    def seconds_of(args: tuple, kwargs: dict) -> float:
        return float(duration(*args, **kwargs) if callable(duration) else duration)

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def streaming(*args: Any, **kwargs: Any) -> Iterator[Any]:
            yield from _call(fn, args, kwargs, seconds_of(args, kwargs), stream=True)

        return streaming

    @functools.wraps(fn)
    def plain(*args: Any, **kwargs: Any) -> Any:
        (result,) = _call(fn, args, kwargs, seconds_of(args, kwargs), stream=False)
        return result

    return plain
