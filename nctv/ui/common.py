"""Plumbing every tab shares: library errors turned into messages, long work in a worker thread
that a Gradio generator streams from (and that Stop ends), and input parsing (where that work
runs, on ZeroGPU in a forked worker: ``nctv.ui.gpu``).

Handlers never show a traceback: a ``ValueError`` from the library already speaks the person's
words and becomes ``gr.Error(message)``; anything else is logged on the server with its traceback
and shown as a short message. Every message (and warning) a visitor sees has the server's own
folders (home, caches, the installation) replaced by :data:`SERVER_PATH`: the library's messages
name them for a person on their own machine, which a visitor is not.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import queue
import re
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import gradio as gr

from nctv import forkgate
from nctv.calibration.base import NotFittedError
from nctv.checks import check_text, env_number, read_number, shown
from nctv.memory import DeviceOutOfMemoryError, cancellation

log = logging.getLogger("nctv.ui")

#: Concurrency group of every long-running event: on a small server one heavy job runs at a time
#: and the others wait in Gradio's queue (with their place shown).
HEAVY = "nctv-heavy"
#: Concurrency group of the light events (a picture, a clicked bin's pictures, a tab's first data, the
#: shared panel's views): their own lane, never behind a run; a few run at once, a page's one at a time.
LIGHT = "nctv-light"
#: Seconds between two looks at a running worker (and the longest a Stop waits to be noticed).
POLL_SECONDS = 0.25
#: Seconds that closing a handler (Stop, or the page going away) waits for its worker to end. The
#: library checks for a Stop within every iteration and piece of work, so a worker ends in well under
#: this; a worker stuck in one long operation is left running (logged), and the next run waits for
#: it at its start instead (the wait happens on Gradio's event loop, so it must stay short).
STOP_JOIN_SECONDS = 3.0
#: Shortest time between two updates of a running run's status and live plot.
UPDATE_SECONDS = 0.25
#: Longest Stop's status waits for the stopped run's stream to end (see :func:`stopped_status`).
STOPPED_WAIT_SECONDS = 10.0
#: Longest a new run waits for the worker of an earlier one to end before starting anyway (logged):
#: a worker stuck for good must not keep every later run waiting for ever.
WAIT_FOR_PREVIOUS_SECONDS = 300.0
#: Held by a worker's thread while it computes: one worker of the heavy jobs at a time, even after a
#: Stop has freed Gradio's slot (``HEAVY``) before the stopped worker ended.
_ONE_WORKER = threading.Lock()
#: Steps of Linux's niceness (0 to 19) by which a run's worker thread, and the threads its torch work
#: starts, run below the server's: the light calls (a page's first data, a picture, the answers of
#: ``/explore_temperature``) then take the cores first while a run computes, and the run takes what they
#: leave. A run computes the same numbers at any priority. 0: runs at the server's priority;
#: ``$NCTV_RUN_NICENESS``.
RUN_NICENESS = int(env_number("NCTV_RUN_NICENESS", 10, 0, whole=True))


def yield_to_light_work() -> None:
    """Lower the calling thread's priority by :data:`RUN_NICENESS` (Linux, where a thread has a
    niceness of its own, which the threads it starts inherit; elsewhere nothing changes). A thread
    cannot raise its priority again: call it in a thread that ends with its run."""
    if not RUN_NICENESS or not sys.platform.startswith("linux"):
        return
    me = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + RUN_NICENESS))
    except OSError as e:  # a sandbox that forbids it: the run keeps the server's priority
        log.warning("a run could not lower its priority (%s); light calls then share the cores with it evenly", e)


SERVER_PATH = "[server folder]"
#: Longest message a visitor sees: a library message quoting a visitor's value, or a framework's,
#: is cut there (the values themselves are cut shorter where they are quoted, see ``nctv.checks.shown``).
MAX_MESSAGE_CHARS = 600


def _server_folders() -> list[str]:
    """Folders of this server that messages may name, longest first (so a cache inside the home
    folder goes as a whole)."""
    from gradio.utils import get_upload_folder
    from huggingface_hub import constants

    from nctv.data import assets_dir, cache_dir

    folders = [Path.home(), cache_dir(), Path(constants.HF_HOME), Path(constants.HF_HUB_CACHE), assets_dir(),
               Path(__file__).resolve().parents[2], Path(sys.prefix), Path(tempfile.gettempdir()),
               Path(get_upload_folder())]
    names = {str(f) for f in folders} | {str(f.resolve()) for f in folders}
    return sorted((n for n in names if len(Path(n).parts) > 1), key=len, reverse=True)  # "/" names nothing


def redact(text: str) -> str:
    """``text`` with every server folder (see :func:`_server_folders`) replaced by :data:`SERVER_PATH`,
    cut to :data:`MAX_MESSAGE_CHARS`."""
    # Cut before the search too (a quoted value of megabytes costs seconds there), with room for a
    # folder that straddles the cut to be found whole.
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: 2 * MAX_MESSAGE_CHARS]
    for folder in _server_folders():
        # Whole path components only: "/app" is hidden in "/app/x", not in "org/app" or "/apple".
        text = re.sub(r"(?<![\w.\-])" + re.escape(folder) + r"(?![\w\-]|\.[\w\-])", SERVER_PATH, text)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "…"


def _message(exc: BaseException) -> gr.Error:
    if isinstance(exc, gr.Error):
        return gr.Error(redact(str(exc.message)), duration=exc.duration, visible=exc.visible, title=exc.title,
                        print_exception=exc.print_exception)
    if isinstance(exc, (ValueError, NotFittedError, DeviceOutOfMemoryError)) and str(exc):
        return gr.Error(redact(str(exc)), print_exception=False)
    if isinstance(exc, MemoryError):
        return gr.Error("The server ran out of memory. Try a smaller calibration split or a smaller model.")
    log.exception("unexpected error in an app handler")
    return gr.Error(redact(f"Something went wrong on the server ({type(exc).__name__}: {exc}). "
                           "Please try other settings."))


def user_errors(fn: Callable | None = None, *, status_of: int | None = None) -> Callable:
    """Wrap a handler (plain function or generator) so that errors reach the page as messages.

    ``status_of=n`` is for a streaming handler with ``n`` outputs, the first a status line: an error
    is first written there in plain words (the other outputs are left as they were, so the last good
    result stays on screen), then raised without a toast, so that an API caller gets it."""
    if fn is None:
        return functools.partial(user_errors, status_of=status_of)
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen_wrapper(*args, **kwargs):
            # A Stop closes the generator with GeneratorExit, a BaseException: it passes through.
            try:
                yield from fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - every error becomes a message
                error = _message(e)
                if status_of:
                    yield (error_status(str(error.message)),) + (gr.skip(),) * (status_of - 1)
                    # The status line, beside the Run button, says it once; a toast would say it a
                    # second time and pile up with the earlier ones.
                    error.visible = False
                raise error from None

        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - every error becomes a message
            raise _message(e) from None

    return wrapper


def error_status(message: str) -> str:
    """The status line after a failed run: the message, and that what is shown below is older."""
    return f"**Error** — {message}\n\nNothing below changed: it is still the last result that finished."


class Cancelled(Exception):
    """Raised inside a worker's report call once the person pressed Stop (or left the page)."""


class Worker:
    """Runs ``work(report)`` in a daemon thread; ``report(item)`` hands items to :meth:`stream`.

    The generator that iterates :meth:`stream` sees lists of new items as they arrive. When that
    generator is closed (Gradio closes it on Stop or when the page goes away) the worker's next
    ``report``, and the library's next cancellation check (every iteration of a fit, every piece of
    a model pass: :func:`nctv.memory.cancellation`), raises :class:`Cancelled`; closing waits for
    the thread to end (at most ``STOP_JOIN_SECONDS``). A worker's thread starts only once the
    worker of an earlier stream has ended (at most ``WAIT_FOR_PREVIOUS_SECONDS``), so a stopped run
    that still computes never shares the machine with the next one.
    """

    def __init__(self, work: Callable[[Callable[[Any], None]], Any]):
        self._work = work
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._done = object()
        self.result: Any = None
        self.error: BaseException | None = None
        self.warnings: list[str] = []
        self._thread = threading.Thread(target=self._run, name="nctv-worker", daemon=True)
        self._holds_gate = False

    def report(self, item: Any) -> None:
        self._check()
        self._queue.put(item)

    def _check(self) -> None:
        if self._stop.is_set():
            raise Cancelled()

    def _run(self) -> None:
        yield_to_light_work()
        try:
            # Warnings of the work (a split too small for δ, a capped ODIR fit, …) are kept for the
            # final status: a server log is not where a visitor looks.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with forkgate.computing(), cancellation(self._check):
                        self.result = self._work(self.report)
                finally:
                    for w in caught:
                        if issubclass(w.category, UserWarning) and str(w.message) not in self.warnings:
                            self.warnings.append(str(w.message))
        except Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the streaming side
            self.error = e
        finally:
            self._queue.put(self._done)
            if self._holds_gate:
                _ONE_WORKER.release()

    @staticmethod
    def _acquire_gate() -> bool:
        with forkgate.paused():
            return _ONE_WORKER.acquire(timeout=POLL_SECONDS)

    def _wait_for_previous(self) -> Iterator[list]:
        """Takes the one-worker gate, yielding (so that a Stop can end the wait) until it is free;
        the first yield says why the run has not started."""
        deadline = time.monotonic() + WAIT_FOR_PREVIOUS_SECONDS
        said = False
        while not self._acquire_gate():
            if time.monotonic() >= deadline:
                log.error("the worker of an earlier run is still busy after %.0f s; starting the next run anyway",
                          WAIT_FOR_PREVIOUS_SECONDS)
                return
            yield [] if said else [("progress", 0.0, "waiting for the previous run to stop")]
            said = True
        self._holds_gate = True

    def stream(self) -> Iterator[list]:
        """Yield lists of reported items until the work ends; then raise its error, if any."""
        finished = False
        ended = _streaming(_session())
        try:
            yield from self._wait_for_previous()
            self._thread.start()
            last = 0.0
            while not finished:
                items = []
                try:
                    with forkgate.paused():  # waiting for the worker (which computes in a section of its own)
                        items.append(self._queue.get(timeout=POLL_SECONDS))
                        # Items that follow within UPDATE_SECONDS of the last update go out with it: a
                        # page sent one update per fast pass (20 a second) fell behind, and showed a
                        # stopped run's progress for a second after its "Stopped".
                        until = last + UPDATE_SECONDS
                        while items[-1] is not self._done:
                            items.append(self._queue.get(timeout=max(0.0, until - time.monotonic())))
                except queue.Empty:
                    pass
                if any(i is self._done for i in items):
                    finished = True
                    items = [i for i in items if i is not self._done]
                if items or not finished:
                    last = time.monotonic()
                    yield items
        finally:
            self._stop.set()
            self._join()
            ended()
        if self.error is not None:
            raise self.error

    def _join(self) -> None:
        if self._thread.ident is None:  # closed while waiting to start: nothing runs
            return
        with forkgate.paused():
            self._thread.join(STOP_JOIN_SECONDS)
        if self._thread.is_alive():
            log.warning("a stopped run's worker is still busy after %.0f s; the next run waits for it",
                        STOP_JOIN_SECONDS)


#: The runs streaming now, by the visitor's session: Stop's status waits for that session's to end.
_STREAMS: dict[str, set[threading.Event]] = {}
_STREAMS_LOCK = threading.Lock()


def _session() -> str | None:
    """The session of the Gradio event being handled in this thread (None outside one)."""
    from gradio.context import LocalContext

    return getattr(LocalContext.request.get(None), "session_hash", None)


def _streaming(session: str | None) -> Callable[[], None]:
    """Record that ``session`` has a run streaming; returns what to call once it no longer does."""
    if session is None:
        return lambda: None
    event = threading.Event()
    with _STREAMS_LOCK:
        _STREAMS.setdefault(session, set()).add(event)

    def ended() -> None:
        event.set()
        with _STREAMS_LOCK:
            events = _STREAMS.get(session, set())
            events.discard(event)
            if not events:
                _STREAMS.pop(session, None)
    return ended


#: The status line of a run that was stopped (by its page's Stop, or by a cancel sent for it: nctv.ui.wire).
STOPPED = "**Stopped.** Press the button again for a new run."


def stopped_status(request: gr.Request) -> str:
    """The status line after Stop, sent once this visitor's stopped run no longer streams.

    The page still shows the updates a run sent before Gradio's cancel reached the server. Written
    at once, "Stopped" could be overwritten by them, and the line then said "Running" for good (one
    browser test in a few, on a busy machine). It waits for the stream to end (at most
    ``STOPPED_WAIT_SECONDS``) and for its last updates to go out (``POLL_SECONDS``); it is sent on the
    queue, behind them."""
    with _STREAMS_LOCK:
        events = list(_STREAMS.get(getattr(request, "session_hash", None), ()))
    if events:
        deadline = time.monotonic() + STOPPED_WAIT_SECONDS
        with forkgate.paused():
            for event in events:
                event.wait(max(0.0, deadline - time.monotonic()))
            time.sleep(POLL_SECONDS)
    return STOPPED


def with_warnings(status: str, worker: Worker) -> str:
    """A final status with the work's warnings (if any) below it, one per line."""
    return status + "".join(f"\n\n⚠ {redact(w)}" for w in worker.warnings)


def duration(seconds: float) -> str:
    """A duration as a person says it: "8 s", "2 min 05 s", "1 h 02 min"."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class TimeLeft:
    """The time a task still needs, from how far it got and how long that took.

    ``update(task, fraction)`` takes the running task's name and the fraction of it done (0 to 1);
    a new name restarts the clock. The rate is measured from the task's first report, so the time
    spent before it (loading, other tasks) does not count. An estimate is made only when the task
    moves (its fraction grows), and from then on it only counts down: a task stuck at one pass
    keeps counting down the time told (once made from a rate measured over a longer time, an
    estimate that would grow is not told), until the time told has run out (:meth:`overdue`); the
    next move then tells a fresh estimate. ``clock`` is for tests to pass their own."""

    #: No estimate before the task has run this long and moved this far: early rates are noise.
    MIN_SECONDS, MIN_FRACTION = 1.0, 0.02

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._task: Any = None
        self._start = self._start_fraction = 0.0
        self._fraction = 0.0
        self._deadline: float | None = None  # when the time told runs out

    def update(self, task: Any, fraction: float) -> float | None:
        """Seconds left of ``task`` (None while too early to say)."""
        now = self._clock()
        if task != self._task:
            self._task, self._start, self._start_fraction = task, now, fraction
            self._fraction, self._deadline = fraction, None
            return None
        if fraction > self._fraction:  # moved: a new estimate, from the rate since the task began
            self._fraction = fraction
            elapsed, moved = now - self._start, fraction - self._start_fraction
            if elapsed >= self.MIN_SECONDS and moved >= self.MIN_FRACTION:
                fresh = now + max(0.0, 1.0 - fraction) * elapsed / moved
                told = self._deadline is not None and self._deadline > now
                self._deadline = min(self._deadline, fresh) if told else fresh
        return None if self._deadline is None else max(0.0, self._deadline - now)

    def overdue(self) -> bool:
        """Whether the time told has run out while the task still runs."""
        return self._deadline is not None and self._clock() >= self._deadline

    def elapsed(self) -> float:
        """Seconds since the running task's first report."""
        return self._clock() - self._start


#: ``ProgressLine.report``'s task for a report from inside the running task.
SAME_TASK = object()
#: ``ProgressLine.report``'s task for the report that the work is done (what is left: drawing the result).
DONE = "done"


class ProgressLine:
    """The status line of a running job: its latest message, then the time the running task still
    needs (or, before that can be told, how long it has run); once the work reports :data:`DONE`,
    "Finished" and the message. :meth:`line` gives the text when it differs from the one shown last, so
    an idle poll redraws only when the clock's words change."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.pace = TimeLeft(clock)
        self._message: str | None = None
        self._task: Any = None
        self._fraction = 0.0
        self._shown: str | None = None

    def report(self, message: str, task: Any, fraction: float) -> None:
        """A new message from ``task`` (:data:`SAME_TASK`: the one running), ``fraction`` of which is done."""
        if task is not SAME_TASK:
            self._task = task
        self._message, self._fraction = message, fraction
        self.pace.update(self._task, fraction)

    def text(self) -> str | None:
        if self._message is None:
            return None
        if self._task == DONE:
            return done_line(self._message)
        left = self.pace.update(self._task, self._fraction)
        if self.pace.overdue():
            tail = f"longer than estimated: running for {duration(self.pace.elapsed())}"
        elif left is not None:
            tail = f"about {duration(left)} left"
        elif self.pace.elapsed() >= 5:
            tail = f"running for {duration(self.pace.elapsed())}, no estimate yet"
        else:
            tail = "estimating the time left"
        return f"**Running** — {self._message} · {tail}"

    def line(self) -> str | None:
        """:meth:`text` when it changed since the last call, else None."""
        text = self.text()
        if text == self._shown:
            return None
        self._shown = text
        return text


def done_line(message: str = "") -> str:
    """The status line once the work is done, while its result is being drawn: "Finished", then
    ``message`` ("done in 34.9 s" reads "Finished in 34.9 s"). The handler's last status, with the
    result, says "Done" (a page waiting for "Done" then has the result)."""
    rest = message[len("done"):] if message.lower().startswith("done ") else (f" — {message}" if message else "")
    return f"**Finished**{rest} · drawing the result…"


def stream_progress(worker: Worker, progress: Any, outputs: int) -> Iterator[tuple]:
    """Stream a worker whose items are ``("progress", fraction, message)`` into a handler with
    ``outputs`` outputs, the first a status text: the status shows the latest message and the time
    the run still needs (:class:`ProgressLine`); every other output is skipped. Returns the work's
    result, so a handler writes ``result = yield from stream_progress(worker, progress, n)``."""
    skip = gr.skip()
    status = ProgressLine()
    for items in worker.stream():
        msgs = [i for i in items if i[0] == "progress"]
        if msgs:
            _, fraction, message = msgs[-1]
            progress(fraction, desc=message)
            status.report(message, "run", fraction)
        line = status.line()
        # Yield even when idle: a Stop can only close the handler between two yields.
        yield (skip if line is None else line,) + (skip,) * (outputs - 1)
    yield (done_line(),) + (skip,) * (outputs - 1)  # the figure and files are made next
    return worker.result


_EXPORT_ROOT = Path(tempfile.gettempdir()) / "nctv-app-exports"
#: Download folders kept at once; older ones are removed (the files live as long as the server).
KEEP_EXPORTS = 30


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


@functools.lru_cache(maxsize=1)
def _exports_root() -> Path:
    """This server's own folder of downloads (its forked workers inherit it): two servers on one
    machine (a test's, a second copy) never remove each other's files; the folders of servers that
    have ended go when it is made."""
    pid = os.getpid()
    _EXPORT_ROOT.mkdir(parents=True, exist_ok=True)
    for p in _EXPORT_ROOT.iterdir():
        if p.is_dir() and p.name.isdigit() and int(p.name) != pid and not _process_alive(int(p.name)):
            shutil.rmtree(p, ignore_errors=True)
    root = _EXPORT_ROOT / str(pid)
    root.mkdir(exist_ok=True)
    return root


def export_dir(prefix: str) -> Path:
    """A fresh folder for one result's downloadable files (in the temp folder Gradio serves from)."""
    root = _exports_root()
    old = sorted(root.iterdir(), key=lambda p: p.stat().st_mtime)
    for p in old[: max(0, len(old) - KEEP_EXPORTS + 1)]:
        shutil.rmtree(p, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=root))


# --------------------------------------------------------------------------- parsing inputs


def parse_whole(value: Any, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """A whole number from a form field, or a ValueError naming the field."""
    check_text(value, name)
    f = read_number(value)
    if f is None or not math.isfinite(f) or f != int(f):
        raise ValueError(f"{name} must be a whole number; got {shown(value)}.")
    n = int(f)
    if n < minimum or (maximum is not None and n > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise ValueError(f"{name} must be at least {minimum}{upper}; got {n}.")
    return n
