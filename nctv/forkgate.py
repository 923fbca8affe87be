"""Forks that never copy another thread half-way through a library call.

A ZeroGPU server forks a worker for every GPU call while its other threads keep serving: a visitor's
picture, a table, the warm-up, another visitor's run being prepared. A thread caught by the fork
inside MKL leaves MKL's bookkeeping locked in the child, and the child's first matrix product then
spins for ever (seen in ``mkl_serv_malloc`` → ``mm_account_ptr_by_tid``, even with MKL's fast memory
manager off: a launched server hung this way at its first run, once in six starts, while its warm-up
computed).
No setting of the library removes the hazard, so the server makes sure no other thread is computing
when it forks:

* a thread's torch work runs inside :func:`computing` (the app wraps every handler, each step of a
  streaming handler, a run's worker thread and the warm-up);
* a thread that waits for something (a GPU call's next item, a worker's progress, a Hub download,
  another visitor's computation of a cached value) does so inside :func:`paused`, which sets its
  sections aside for the time of the wait;
* before each fork (``os.register_at_fork``), the forking thread waits until no other thread is
  inside a section, and no new section starts until the fork is made. A long run in a section
  gives way at its next cancellation check (:func:`checkpoint`, called by
  ``nctv.memory.check_cancelled``: every piece of a model pass, every iteration of a fit), and
  carries on once the fork is made;
* each thread's first section sets its torch and MKL work to one thread, as the server's own (the
  OpenMP threads MKL would otherwise start for it end when it ends, outside any section: 3 to 5
  forks in 16 hung without this); and, as a precaution, a fork waits for a thread that computed and
  whose system thread is still ending (its libraries' per-thread clean-up runs after Python's part);
* a fork never waits longer than :func:`wait_seconds` (``$NCTV_FORK_WAIT_SECONDS``, default 20 s):
  past that it is made anyway, with a warning in the log, so that a section that cannot end (a
  thread waiting for a lock that a paused thread holds) delays a run, never stops it.

Only a ZeroGPU server turns the gate on (:func:`enable`, from ``nctv.ui.gpu.prepare_server``); a
forked worker turns it off in itself. Elsewhere every function here returns at once. Threads of a
piece pool (``nctv.memory.piece_pool``) are not counted: a ZeroGPU server computes on one thread and
makes none.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Iterator

log = logging.getLogger("nctv.ui")

#: Longest a fork waits for the other threads' sections to end ($NCTV_FORK_WAIT_SECONDS).
DEFAULT_WAIT_SECONDS = 20.0
#: How often a waiting fork looks whether an ending thread is gone.
ENDING_POLL_SECONDS = 0.002


class _State:
    """The gate: the sections under way by thread, and the thread now forking (if any)."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.depth: dict[int, int] = {}  # thread ident -> sections it is inside
        self.set_aside: dict[int, int] = {}  # a forking thread's own sections, until its fork is made
        self.forker: int | None = None
        self.threads: dict[int, threading.Thread] = {}  # threads that have computed, until they are gone
        self.enabled = False
        self.forks_waited = 0  # forks that found another thread computing or ending (tests read it)


_STATE = _State()
_REGISTERED = False
_REGISTER_LOCK = threading.Lock()


def wait_seconds() -> float:
    """The longest a fork waits for other threads' sections ($NCTV_FORK_WAIT_SECONDS, default 20)."""
    from nctv.checks import env_number

    return env_number("NCTV_FORK_WAIT_SECONDS", DEFAULT_WAIT_SECONDS, 0)


def enable() -> None:
    """Turn the gate on in this process (a ZeroGPU server, before it serves anything)."""
    global _REGISTERED
    with _REGISTER_LOCK:
        if not _REGISTERED:
            os.register_at_fork(before=_before_fork, after_in_parent=_after_in_parent,
                                 after_in_child=_after_in_child)
            _REGISTERED = True
    _STATE.enabled = True


def enabled() -> bool:
    return _STATE.enabled


def forks_waited() -> int:
    """How many forks of this process so far found another thread computing (or ending) and waited."""
    return _STATE.forks_waited


def _wait_for_fork(state: _State, me: int) -> None:
    """Wait (holding ``state.cond``) while another thread is forking."""
    while state.forker is not None and state.forker != me:
        state.cond.wait()


def _step_out(state: _State, me: int) -> int:
    """Set this thread's sections aside (holding ``state.cond``); returns how many there were."""
    held = state.depth.pop(me, 0)
    if held:
        state.cond.notify_all()
    return held


def _step_in(state: _State, me: int, held: int) -> None:
    """Take back ``held`` sections set aside (holding ``state.cond``), once no other thread forks."""
    _wait_for_fork(state, me)
    if held:
        state.depth[me] = state.depth.get(me, 0) + held


def _one_thread() -> None:
    """A thread's first section: its torch and MKL work on this one thread. A thread of its own would
    otherwise take OpenMP's count from the environment (every core by default), and the OpenMP threads
    MKL then starts for it end when it ends, each freeing its MKL buffers outside any section (measured:
    3 to 5 hung forks in 16 with 2 OpenMP threads, none with 1)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


@contextlib.contextmanager
def computing() -> Iterator[None]:
    """This thread computes within the block: no fork is made meanwhile. Sections nest; a new one
    (not nested) waits while a fork is being made."""
    state = _STATE
    if not state.enabled:
        yield
        return
    me = threading.get_ident()
    thread = threading.current_thread()
    if state.threads.get(me) is not thread:  # (an ended thread's ident is soon another's)
        _one_thread()
    with state.cond:
        if state.depth.get(me):
            state.depth[me] += 1  # nested: this thread is counted already, a fork waits for it
        else:
            _step_in(state, me, 1)
            state.threads[me] = thread
    try:
        yield
    finally:
        with state.cond:
            if state.enabled:  # off in a forked worker, after the fork
                left = state.depth.get(me, 1) - 1
                if left > 0:
                    state.depth[me] = left
                else:
                    state.depth.pop(me, None)
                state.cond.notify_all()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """This thread waits within the block (for a GPU call's next item, a worker's progress): its
    sections are set aside meanwhile, so that a fork need not wait for the wait to end."""
    state = _STATE
    if not state.enabled:
        yield
        return
    me = threading.get_ident()
    with state.cond:
        held = _step_out(state, me)
    try:
        yield
    finally:
        if held:
            with state.cond:
                if state.enabled:
                    _step_in(state, me, held)


def checkpoint() -> None:
    """A point of a long computation where no library call is under way: if a fork is waiting, this
    thread's sections are set aside until it is made."""
    state = _STATE
    if not state.enabled or state.forker is None:
        return
    me = threading.get_ident()
    with state.cond:
        if state.forker is None or state.forker == me:
            return
        _step_in(state, me, _step_out(state, me))


def _before_fork() -> None:
    state = _STATE
    if not state.enabled:
        return
    me = threading.get_ident()
    with state.cond:
        # The forking thread's own sections do not count (it is in the fork, not in a library), and
        # must not: two threads forking at once would otherwise each wait for the other.
        held = _step_out(state, me)
        _wait_for_fork(state, me)
        state.forker = me
        state.set_aside[me] = held
        state.cond.notify_all()
        deadline = time.monotonic() + wait_seconds()
        waited = False
        while True:
            ending = _ending_threads(state)
            if not state.depth and not ending:
                break  # and the fork is made now, this thread holding the GIL: no thread can start ending
            waited = True
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("forking while %d other thread(s) still compute after %.0f s: the worker may hang "
                            "until its duration ends", len(state.depth) + len(ending), wait_seconds())
                break
            # A section's end is notified; a thread's end is not (it happens outside Python): looked for often.
            state.cond.wait(min(left, ENDING_POLL_SECONDS) if ending else left)
        state.forks_waited += waited


def _ending_threads(state: _State) -> list[threading.Thread]:
    """Threads that have computed and whose Python part has ended, while the system thread still runs
    (its libraries' per-thread clean-up, MKL's included); those fully gone are forgotten."""
    ending = []
    for ident, thread in list(state.threads.items()):
        if thread.is_alive():
            continue
        if _system_thread_runs(thread.native_id):
            ending.append(thread)
        else:
            del state.threads[ident]
    return ending


def _system_thread_runs(native_id: int | None) -> bool:
    """Whether this process still has the system thread ``native_id`` (Linux: /proc; elsewhere, where
    nothing forks, False)."""
    return native_id is not None and os.path.exists(f"/proc/self/task/{native_id}")


def _after_in_parent() -> None:
    state = _STATE
    if not state.enabled:
        return
    me = threading.get_ident()
    with state.cond:
        if state.forker == me:
            state.forker = None
        _step_in(state, me, state.set_aside.pop(me, 0))
        state.cond.notify_all()


def _after_in_child() -> None:
    """A forked worker has only the forking thread: the gate is made afresh, off (the worker forks
    nothing), in place, so that no lock another thread held at the fork is ever waited for here."""
    state = _STATE
    state.cond = threading.Condition(threading.Lock())
    state.depth.clear()
    state.set_aside.clear()
    state.threads.clear()
    state.forker = None
    state.enabled = False
