"""Per-visitor state: the splits a visitor picked and the :class:`Calibration` that lives in a
``gr.State`` (no visitor sees another's), and the server's table of sessions, which keeps that state
and nothing a request merely sent (:class:`SessionHolder`).

A session is opened by its page: the page (and ``gradio_client``) holds a heartbeat stream
(``/gradio_api/heartbeat/<session id>``) open while it is there, before its first call. A call that
names a session id no heartbeat opened, or none (``/gradio_api/call/<fn>``), is a one-off: whatever it
leaves in the table of sessions goes when it ends, and its result, if nobody collects it, soon after.
"""
from __future__ import annotations

import asyncio
import copy
import ctypes
import datetime
import gc
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from gradio.state_holder import SessionState, StateHolder

from nctv.checks import env_limit, env_number
from nctv.methods import trained_input_methods
from nctv.results import COMPARED_METHOD
from nctv.settings import APP_BINS, DEFAULT_CALIBRATION_SIZE

#: Method names (paper names) of the two calibrations the Try tab compares with the raw model.
TS_METHOD = "Temperature Scaling"
NC_METHODS = tuple(sorted(trained_input_methods(), key=lambda name: name != COMPARED_METHOD))


@dataclass(frozen=True)
class SplitSpec:
    """Which model and which calibration/test splits (enough to rebuild them after eviction)."""

    model: str
    dataset: str | None = None
    calibration_size: int = DEFAULT_CALIBRATION_SIZE
    calibration_seed: int = 0
    #: Test images drawn from the test pool; None = all of it.
    test_size: int | None = None


@dataclass
class Calibration:
    """One visitor's current calibration, as the Try and Learn tabs need it.

    ``delta`` is Neural Clamping's δ in the model's normalised input space (C, H, W), None when NC
    was not run; temperatures are positive floats; ``source`` says where it came from.
    """

    split: SplitSpec | None
    model: str
    ts_temperature: float
    nc_temperature: float | None
    delta: torch.Tensor | None
    nc_method: str | None
    source: str
    n_bins: int = APP_BINS
    settings: dict = field(default_factory=dict)
    #: Test-split metrics (fractions) per method at ``n_bins`` bins, for the Learn tab's text.
    metrics: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- what the server keeps


#: Most sessions the server keeps (pages, each opened by its heartbeat); past it the one used longest
#: ago is dropped (Gradio's ``state_session_capacity``). ``$NCTV_MAX_SESSIONS``.
MAX_SESSIONS = env_limit("NCTV_MAX_SESSIONS", 10_000)
#: Most pages one address may hold open at once (their heartbeat streams): a lecture hall behind one
#: address opens one per phone or laptop, several with more tabs. ``$NCTV_SESSIONS_PER_ADDRESS``.
SESSIONS_PER_ADDRESS = env_limit("NCTV_SESSIONS_PER_ADDRESS", 1000)
#: Seconds a one-off call's result is kept after the call ends, for its caller to collect
#: (``GET /gradio_api/call/<fn>/<event id>``). ``$NCTV_RESULT_KEEP_S``.
RESULT_KEEP_S = env_number("NCTV_RESULT_KEEP_S", 60, 1)
#: Most ended one-off calls whose results are kept at once; past it the oldest goes. ``$NCTV_RESULTS_KEPT``.
RESULTS_KEPT = env_limit("NCTV_RESULTS_KEPT", 256)
#: Longest a session id may be: Gradio's pages make 11 characters, gradio_client 32.
SESSION_ID_CHARS = 64


#: A JSON body at least this large leaves freed memory that the allocator keeps unless asked.
LARGE_BODY_BYTES = 2**20
#: Seconds without a running call, after a large body, before its memory is handed back.
QUIET_S = 15
_large_bodies = 0


def large_body_received() -> None:
    """Called by the request guard for every JSON body of :data:`LARGE_BODY_BYTES` or more."""
    global _large_bodies
    _large_bodies += 1


def _trimmer():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; elsewhere there is nothing to call
    except (OSError, AttributeError):
        return None


class _Session(SessionState):
    """A session that keeps what is the visitor's own (``gr.State`` values, components a handler
    updated) and no copy of what a request sent.

    Gradio's session also keeps a copy of every component's configuration (245 KB and 83 ms of CPU
    per session for this app) and the latest value each input received, whole: a 12 MB list sent as a
    temperature stayed in memory until 10,000 sessions existed. Those copies serve Gradio's deep links
    only, which this app has none of."""

    def __init__(self, blocks):  # noqa: D107 - Gradio's, without the configuration copies
        self.blocks_config = copy.copy(blocks.default_config)
        self.config_values = {}
        self.state_data = {}
        self._state_ttl = {}
        self.is_closed = False
        self.STATE_TTL_WHEN_CLOSED = 3600  # as Gradio: a closed page's state waits an hour for its return

    def __setitem__(self, key: int, value: Any) -> None:
        super().__setitem__(key, value)
        self.config_values.pop(key, None)

    def _update_config(self, key: int) -> None:
        pass

    def _update_value_in_config(self, key: int, value: Any) -> None:
        pass


#: Seconds a page's session is still known after its heartbeat closed: its state waits as long for
#: the page's return (Gradio's own rule for a closed page).
CLOSED_SESSION_S = 3600


class SessionHolder(StateHolder):
    """Gradio's table of sessions, holding :class:`_Session` s, at most :data:`MAX_SESSIONS` of them, and
    which sessions pages opened (:meth:`open`, :meth:`close`: the request guard calls them as a
    heartbeat stream starts and ends).

    Only a session a heartbeat opened is kept. A one-off call (no session id, or one that no heartbeat
    opened: anyone can make one up) is told with :meth:`one_off_call`; what it left in the table goes
    as soon as it has ended, and its result (Gradio's pending messages for its session) after
    :data:`RESULT_KEEP_S`, or sooner once more than :data:`RESULTS_KEPT` ended calls hold one."""

    def __init__(self, capacity: int = MAX_SESSIONS):
        super().__init__()
        #: Sessions opened by a heartbeat -> None while one is open, else when the last one closed.
        self.opened: OrderedDict[str, float | None] = OrderedDict()
        self._streams: Counter[str] = Counter()  # open heartbeats per session
        self._pages: Counter[str] = Counter()  # open heartbeats per address
        self._awaited: dict[str, asyncio.Event] = {}  # sessions a call waits to see opened
        #: Running one-off calls: event id -> session id.
        self.one_off: dict[str, str] = {}
        #: Ended one-off calls' sessions -> when the last of their calls ended (oldest first).
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._capacity = capacity
        self._trim, self._seen, self._quiet_s = _trimmer(), 0, 0

    def set_blocks(self, blocks) -> None:
        super().set_blocks(blocks)
        self.capacity = self._capacity

    def __getitem__(self, session_id: str) -> SessionState:
        if session_id not in self.session_data:
            self.session_data[session_id] = _Session(self.blocks)
        self.update(session_id)
        self.time_last_used[session_id] = datetime.datetime.now()
        return self.session_data[session_id]

    # ----------------------------------------------------------------------- pages

    def open(self, session_id: str, address: str) -> bool:
        """A heartbeat of ``session_id`` from ``address`` starts: the session is a page's. False (and
        nothing opened) when ``address`` holds :data:`SESSIONS_PER_ADDRESS` pages open already."""
        if self._pages[address] >= SESSIONS_PER_ADDRESS:
            return False
        self._pages[address] += 1
        self._streams[session_id] += 1
        self.opened[session_id] = None
        self.opened.move_to_end(session_id)
        while len(self.opened) > self._capacity:
            self._forget(next(iter(self.opened)))
        self._ended.pop(session_id, None)  # its calls' results are a page's now: collected by it
        if (awaited := self._awaited.pop(session_id, None)) is not None:
            awaited.set()
        return True

    def close(self, session_id: str, address: str) -> None:
        """A heartbeat that :meth:`open` accepted has ended (the page went away, or its connection)."""
        self._pages[address] -= 1
        if self._pages[address] <= 0:
            del self._pages[address]
        self._streams[session_id] -= 1
        if self._streams[session_id] <= 0:
            del self._streams[session_id]
            if session_id in self.opened:
                self.opened[session_id] = time.monotonic()

    def is_page(self, session_id: str | None) -> bool:
        """Whether ``session_id`` is a session a heartbeat opened (open, or closed under an hour ago)."""
        return session_id is not None and session_id in self.opened

    async def opens_within(self, session_id: str, seconds: float) -> bool:
        """Whether a heartbeat opens ``session_id`` within ``seconds`` (at once if it is open already).
        A page starts its heartbeat before its first call, but the two requests may arrive in either
        order."""
        if self.is_page(session_id):
            return True
        awaited = self._awaited.setdefault(session_id, asyncio.Event())
        try:
            await asyncio.wait_for(awaited.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        if not awaited.is_set() and self._awaited.get(session_id) is awaited:
            del self._awaited[session_id]
        return self.is_page(session_id)

    def one_off_call(self, event_id: str, session_id: str) -> None:
        """Event ``event_id``, just queued, runs outside any page's session (its own id, or a made-up one).
        It starts with nothing: what an earlier call under that id left goes now, not at the next clean-up."""
        queue = self.blocks._queue
        # Waiting, or running in a job: a finished call leaves its job before its page is told, but stays
        # among Gradio's events a moment longer, while a next call may already come.
        others = [e for q in queue.event_queue_per_concurrency_id.values() for e in q.queue]
        others += [e for job in queue.active_jobs if job for e in job]
        if not any(e.session_hash == session_id and e._id != event_id for e in others):
            self._drop(session_id)
        self.one_off[event_id] = session_id

    def _forget(self, session_id: str) -> None:
        self.opened.pop(session_id, None)
        self._drop(session_id)

    def _drop(self, session_id: str) -> None:
        with self.lock:
            self.session_data.pop(session_id, None)
            self.time_last_used.pop(session_id, None)

    # ----------------------------------------------------------------------- clean-up

    def delete_all_expired_state(self) -> None:
        """Gradio calls this every second: expired ``gr.State`` values go, and so do the sessions of
        ended one-off calls, their uncollected results once too old or too many, and pages closed for
        :data:`CLOSED_SESSION_S`; after large bodies, the memory they took goes back to the system."""
        super().delete_all_expired_state()
        queue = self.blocks._queue
        running = queue.event_ids_to_events
        now = time.monotonic()
        ended = dict.fromkeys(self.one_off.pop(e) for e in [e for e in self.one_off if e not in running])
        busy = set(self.one_off.values())
        for session_id in ended:
            if session_id not in busy and not self.is_page(session_id):  # nobody can come back to it; its result waits a while
                self._drop(session_id)
                self._ended[session_id] = now
                self._ended.move_to_end(session_id)
        for session_id, at in list(self._ended.items()):
            if len(self._ended) <= RESULTS_KEPT and now - at < RESULT_KEEP_S:
                break  # the rest ended later
            del self._ended[session_id]
            if session_id not in busy:  # not used again meanwhile
                queue.pending_messages_per_session.pop(session_id, None)
                queue.pending_event_ids_session.pop(session_id, None)
        for session_id in [s for s, gone in self.opened.items() if gone is not None and now - gone > CLOSED_SESSION_S]:
            self._forget(session_id)
        # A 10 MB body is thousands of objects, parsed twice; once freed, most of their pages stayed with
        # the process (100 calls of 12 MB left +440 MB). Once no call has run for 15 s after a large body
        # (the worker threads that read it, idle, end after 10 s), a full collection and malloc_trim
        # hand them back: the collection (under a second) empties the interpreter's own pools first.
        if self._seen != _large_bodies:
            self._seen, self._quiet_s = _large_bodies, QUIET_S
        if self._quiet_s and not running:
            self._quiet_s -= 1
            if not self._quiet_s:
                gc.collect()
                if self._trim is not None:
                    self._trim(0)
