"""Per-visitor state: the splits a visitor picked and the :class:`Calibration` that lives in a
``gr.State`` (no visitor sees another's), and the server's table of sessions, which keeps that state
and nothing a request merely sent (:class:`SessionHolder`).
"""
from __future__ import annotations

import copy
import ctypes
import datetime
import gc
from dataclasses import dataclass, field
from typing import Any

import torch
from gradio.state_holder import SessionState, StateHolder

from nctv.checks import env_limit
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


#: Most sessions the server keeps (a page, or a made-up session id sent through the API); past it the
#: one used longest ago is dropped (Gradio's ``state_session_capacity``). ``$NCTV_MAX_SESSIONS``.
MAX_SESSIONS = env_limit("NCTV_MAX_SESSIONS", 10_000)


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


class SessionHolder(StateHolder):
    """Gradio's table of sessions, holding :class:`_Session` s, at most :data:`MAX_SESSIONS` of them;
    the session of an API call made without a session id (``/gradio_api/call/<fn>``) is dropped as soon
    as its call has ended: nobody can come back to it."""

    def __init__(self, capacity: int = MAX_SESSIONS):
        super().__init__()
        self.one_off: set[str] = set()
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

    def delete_all_expired_state(self) -> None:
        """Gradio calls this every second: expired ``gr.State`` values go, and so do the sessions of
        finished one-off calls; after large bodies, the memory they took goes back to the system."""
        super().delete_all_expired_state()
        running = self.blocks._queue.event_ids_to_events
        for session_id in [s for s in self.one_off if s not in running]:
            self.one_off.discard(session_id)
            with self.lock:
                self.session_data.pop(session_id, None)
                self.time_last_used.pop(session_id, None)
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
