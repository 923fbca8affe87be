"""Bounds on what a request may hand the launched app, whatever its route or transport: the size of
its body (declared or streamed), the length of every string in a JSON body (the values of a form's
fields, whatever the body's content type says), the bytes one address may bring to the server's disk
within the time uploads are kept (uploads, a drawing's parts and pictures sent inline as ``data:``
URLs alike), how many pages one address may hold open, and the queue's two lanes (:class:`Lanes`):
how many calls a page, an address and the whole server may keep waiting, and in which order they run.

The body checks run before Gradio reads a body, so an oversized value is refused in milliseconds,
before it joins the queue or takes the heavy slot; the refusal is a short JSON ``{"detail": …}``.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import re
import threading
import time
from collections import Counter, deque
from typing import Any

from fastapi import HTTPException

from nctv.checks import MAX_TEXT_CHARS, env_limit, env_number
from nctv.ui.common import HEAVY, LIGHT
from nctv.ui.images import MAX_DRAWING_LAYERS, MAX_UPLOAD_BYTES
from nctv.ui.session import (LARGE_BODY_BYTES, SESSION_ID_CHARS, SESSIONS_PER_ADDRESS, SessionHolder,
                              large_body_received)

#: Largest request body, in bytes: one upload at the file cap and its envelope;
#: ``$NCTV_MAX_REQUEST_BYTES``.
MAX_REQUEST_BYTES = env_limit("NCTV_MAX_REQUEST_BYTES", MAX_UPLOAD_BYTES + 2**20)
#: Seconds an uploaded file is kept before the app deletes it; ``$NCTV_UPLOAD_KEEP_S``.
UPLOAD_KEEP_S = int(env_number("NCTV_UPLOAD_KEEP_S", 1800, 60, whole=True))
#: Bytes one address may bring to the disk within :data:`UPLOAD_KEEP_S` (what it can hold there at
#: once): uploads and inline pictures; ``$NCTV_UPLOAD_BUDGET_BYTES``.
UPLOAD_BUDGET_BYTES = env_limit("NCTV_UPLOAD_BUDGET_BYTES", 8 * MAX_UPLOAD_BYTES)
#: Most values (items of lists and objects) in one JSON body, counted from its commas before it is
#: parsed: a form sends a few dozen, and a 12 MB list of 600,000 numbers cost a second of CPU to parse
#: and left the memory fragmented; ``$NCTV_MAX_JSON_VALUES``.
MAX_JSON_VALUES = env_limit("NCTV_MAX_JSON_VALUES", 10_000)
#: Most calls of one page (its session) waiting in the queue at once, runs aside: a page sends one or two
#: at a time; ``$NCTV_CALLS_PER_SESSION``.
CALLS_PER_SESSION = env_limit("NCTV_CALLS_PER_SESSION", 8)
#: Most calls of one address waiting at once outside any page's session (API calls without a session
#: id, or with one no page opened), runs aside; ``$NCTV_QUEUE_PER_ADDRESS``.
QUEUE_PER_ADDRESS = env_limit("NCTV_QUEUE_PER_ADDRESS", 8)
#: Most runs (calibrations, studies: the heavy lane's calls) of one address waiting at once, pages and
#: API calls together; ``$NCTV_RUNS_PER_ADDRESS``.
RUNS_PER_ADDRESS = env_limit("NCTV_RUNS_PER_ADDRESS", 3)
#: Most runs waiting at once, all addresses together; ``$NCTV_RUNS_WAITING``.
RUNS_WAITING = env_limit("NCTV_RUNS_WAITING", 32)
#: Longest a call past its address's share outside sessions waits for its session's heartbeat (a page
#: starts it before its first call, but the two may arrive in either order).
HEARTBEAT_WAIT_S = 2.0
#: Most files one call may name: a drawing's background, layers and composite.
MAX_FILES = MAX_DRAWING_LAYERS + 2
#: Routes that store what they receive (files, a drawing's parts).
UPLOAD_ROUTES = ("/upload", "/component_server")
#: Bodies the guard streams instead of reading whole (file uploads); every other body is read as JSON
#: if it is JSON, whatever its content type says (FastAPI reads ``+json`` types, any capitalisation,
#: and a body with no content type, as JSON).
_FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")
#: A picture sent inline: the one ``data:`` string exempt from the text cap, counted against the
#: picture cap and the address's disk budget instead.
_INLINE_PICTURE = re.compile(r"data:image/(png|jpeg|webp|gif|bmp);base64,", re.IGNORECASE)


class _TooLarge(Exception):
    """The body grew past the cap while the app was reading it."""


def _read_fields(value: Any) -> tuple[int, list[int], int]:
    """(length of the first string in a JSON value longer than the text cap, or 0; the sizes in bytes
    of the inline pictures it holds; how many Gradio files it names). A long string is exempt only as
    the ``url`` of a Gradio file whose ``data:`` URL is a base64 picture."""
    stack, pictures, files = [value], [], 0
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if len(v) > MAX_TEXT_CHARS:
                return len(v), pictures, files
        elif isinstance(v, dict):
            meta = v.get("meta")
            if isinstance(meta, dict) and meta.get("_type") == "gradio.FileData":
                files += 1
                url = v.get("url")
                if isinstance(url, str) and (head := _INLINE_PICTURE.match(url)):
                    pictures.append((len(url) - head.end()) * 3 // 4)
                    v = {k: x for k, x in v.items() if k != "url"}
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return 0, pictures, files


class UploadBudget:
    """Bytes uploaded per address over a sliding window; thread-safe."""

    def __init__(self, budget: int, window_s: float):
        self.budget, self.window_s = budget, window_s
        self._sent: dict[str, deque] = {}
        self._lock = threading.Lock()

    def used(self, who: str) -> int:
        with self._lock:
            return self._prune(who)

    def add(self, who: str, n: int) -> None:
        with self._lock:
            self._prune(who)
            self._sent.setdefault(who, deque()).append((time.monotonic(), n))

    def _prune(self, who: str) -> int:
        cutoff = time.monotonic() - self.window_s
        # ``who`` and the first few other addresses (moved to the back when still active, so that
        # every address comes round) lose their old uploads; the table never keeps a quiet address.
        for key in [who, *itertools.islice(self._sent, 4)]:
            sent = self._sent.pop(key, None)
            while sent and sent[0][0] < cutoff:
                sent.popleft()
            if sent:
                self._sent[key] = sent
        return sum(n for _, n in self._sent.get(who, ()))


class RequestGuard:
    """ASGI middleware applying :data:`MAX_REQUEST_BYTES`, :data:`~nctv.checks.MAX_TEXT_CHARS` and
    :data:`UPLOAD_BUDGET_BYTES` to every request with a body."""

    def __init__(self, app, max_bytes: int = MAX_REQUEST_BYTES, budget: UploadBudget | None = None):
        self.app, self.max_bytes = app, max_bytes
        self.budget = budget or UploadBudget(UPLOAD_BUDGET_BYTES, UPLOAD_KEEP_S)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        length = headers.get("content-length", "")
        declared = int(length) if length.isascii() and length.isdigit() else None  # "²" is a digit to isdigit()
        if declared is not None and declared > self.max_bytes:
            return await refuse(send, 413, self._too_large())
        who = (scope.get("client") or ("unknown",))[0]
        uploads = scope["path"].rstrip("/").endswith(UPLOAD_ROUTES)
        if uploads and self.budget.used(who) + (declared or 0) > self.budget.budget:
            return await refuse(send, 429, self._budget_spent())
        if not headers.get("content-type", "").split(";")[0].strip().lower().startswith(_FORMS):
            return await self._json(scope, receive, send, who)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise _TooLarge
            return message

        watched, status = _watched(send)
        try:
            await self.app(scope, counted, watched)
        except _TooLarge:
            if status() is not None:
                raise
            return await refuse(send, 413, self._too_large())
        if uploads and status() is not None and status() < 400:  # what was stored
            self.budget.add(who, received)

    async def _json(self, scope, receive, send, who: str):
        """A body that is not a form is read whole (it is small), checked as JSON if it is JSON, then
        handed on; its inline pictures count against the address's budget once the app accepts it."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await refuse(send, 413, self._too_large())
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if len(body) >= LARGE_BODY_BYTES:
            large_body_received()
        if (values := body.count(b",") + 1) > MAX_JSON_VALUES:  # commas inside strings count too: a bound
            return await refuse(send, 413, f"The request holds about {values:,} values; this app accepts at most "
                                            f"{MAX_JSON_VALUES:,} in one call.")
        try:
            longest, pictures, files = _read_fields(json.loads(body)) if body else (0, [], 0)
        except (ValueError, RecursionError):
            longest, pictures, files = 0, [], 0  # not this guard's business: the app answers malformed JSON
        if longest:
            return await refuse(send, 413, f"A value of {longest:,} characters was sent; this app accepts at most "
                                            f"{MAX_TEXT_CHARS:,} characters in a field.")
        if files > MAX_FILES:
            return await refuse(send, 413, f"The request names {files:,} files; this app takes at most {MAX_FILES} "
                                            f"in one call (a drawing of {MAX_DRAWING_LAYERS} layers).")
        if pictures and max(pictures) > MAX_UPLOAD_BYTES:
            return await refuse(send, 413, f"The picture sent inline is about {max(pictures) / 1e6:,.1f} MB; this app "
                                            f"accepts at most {MAX_UPLOAD_BYTES / 1e6:,.1f} MB.")
        if pictures and self.budget.used(who) + sum(pictures) > self.budget.budget:
            return await refuse(send, 429, self._budget_spent())
        watched, status = _watched(send)
        await self.app(scope, replaying(body, receive), watched)
        if pictures and status() is not None and status() < 400:  # the pictures the app will save
            self.budget.add(who, sum(pictures))

    def _too_large(self) -> str:
        return f"The request is larger than this app accepts ({self.max_bytes / 1e6:,.0f} MB)."

    def _budget_spent(self) -> str:
        return (f"This address sent more than {self.budget.budget / 1e6:,.0f} MB of files and pictures in the last "
                f"{self.budget.window_s / 60:.0f} minutes; please wait a while.")


def _watched(send):
    """(``send`` noting the response's status, a function returning that status or None)."""
    seen = {}

    async def watched(message):
        if message["type"] == "http.response.start":
            seen["status"] = message["status"]
        await send(message)

    return watched, lambda: seen.get("status")


class Lanes:
    """The queue's two lanes and its limits, installed on the queue of ``blocks`` (Gradio's
    ``Queue.push`` and ``Queue.get_events``).

    - **Light** (:data:`~nctv.ui.common.LIGHT`): a few at once, each page's calls one at a time and in
      order (the next waiting call of a page with none running goes first); never behind a run, and
      never refused because the queue is long: only a page past :data:`CALLS_PER_SESSION` waiting calls,
      or an address past :data:`QUEUE_PER_ADDRESS` outside pages' sessions, is refused.
    - **Heavy** (:data:`~nctv.ui.common.HEAVY`): one run at a time, round-robin between addresses: the
      address whose last run started longest ago (or never) goes next, so that a newcomer waits for
      the running run and at most one of every other waiting address. Each address keeps at most
      :data:`RUNS_PER_ADDRESS` runs waiting, the server :data:`RUNS_WAITING`.

    Past a limit a call is refused (HTTP 429) in words; Gradio's own bound is the whole queue's
    (``max_size``), which 200 students' light calls filled, so the app sets none. A call outside
    pages' sessions is told to ``sessions`` (:meth:`~nctv.ui.session.SessionHolder.one_off_call`)."""

    def __init__(self, blocks, sessions: SessionHolder):
        if any(fn.batch for fn in blocks.fns.values()):
            raise ValueError("the lanes take one event at a time; this app has no batched events")
        self.blocks, self.queue, self.sessions = blocks, blocks._queue, sessions
        self._push, self._lock = self.queue.push, asyncio.Lock()
        self._turns: dict[str, int] = {}  # address -> number of the turn its latest run started in
        self._turn = itertools.count()
        self.queue.push, self.queue.get_events = self.push, self.get_events

    def _waiting(self) -> list:
        return [e for q in self.queue.event_queue_per_concurrency_id.values() for e in q.queue]

    def _outside(self, who: str) -> int:
        """Calls of address ``who`` waiting outside pages' sessions, runs aside."""
        return sum(e.concurrency_id != HEAVY and _address(e.request) == who and not self.sessions.is_page(e.session_hash)
                   for e in self._waiting())

    async def push(self, body, request, username):
        who = _address(request)
        fn = self.blocks.fns.get(body.fn_index)
        heavy = fn is not None and fn.concurrency_id == HEAVY
        waited = False
        while True:
            async with self._lock:  # counted and joined at once: a burst of calls cannot slip past the count
                page = self.sessions.is_page(body.session_hash)
                early = (not waited and not page and not heavy and body.session_hash is not None
                         and self._outside(who) >= QUEUE_PER_ADDRESS)
                if not early:
                    ok, event_id, kind = await self._join(body, request, username, who, heavy, page)
                    break
            # Past the address's share outside pages, from a session no heartbeat has opened yet: a page
            # starts its heartbeat before its first call, but the two may arrive in either order (and a
            # room behind one address sends many at once), so the call waits a moment for it, then counts.
            await self.sessions.opens_within(body.session_hash, HEARTBEAT_WAIT_S)
            waited = True
        if ok and not page:
            self.sessions.one_off_call(event_id, body.session_hash)
        return ok, event_id, kind

    async def _join(self, body, request, username, who: str, heavy: bool, page: bool):
        """Refuse past a limit, else join Gradio's queue (under ``_lock``)."""
        if heavy:
            runs = self.queue.event_queue_per_concurrency_id.get(HEAVY)
            runs = runs.queue if runs is not None else []
            if sum(_address(e.request) == who for e in runs) >= RUNS_PER_ADDRESS:
                raise HTTPException(429, f"{RUNS_PER_ADDRESS} runs from this address are already waiting in "
                                         f"the queue; please wait until one has started.")
            if len(runs) >= RUNS_WAITING:
                raise HTTPException(429, f"{RUNS_WAITING} runs are already waiting in the queue; please try "
                                         f"again in a few minutes.")
        elif page:
            if sum(e.session_hash == body.session_hash and e.concurrency_id != HEAVY
                   for e in self._waiting()) >= CALLS_PER_SESSION:
                raise HTTPException(429, f"{CALLS_PER_SESSION} calls from this page are already waiting in the "
                                         f"queue; please wait until they have started.")
        elif self._outside(who) >= QUEUE_PER_ADDRESS:
            raise HTTPException(429, f"{QUEUE_PER_ADDRESS} calls from this address are already waiting in the "
                                     f"queue outside a page; please wait until they have started, or open the "
                                     f"app's page (or a gradio_client session), whose calls are counted "
                                     f"per page.")
        ok, event_id, kind = await self._push(body, request, username)
        if ok and heavy:
            self._fair(self.queue.event_queue_per_concurrency_id[HEAVY].queue)
            self.queue.broadcast_estimations(HEAVY)
        return ok, event_id, kind

    def get_events(self):
        """Gradio's choice of the next event (a lane with a free slot, the lanes in random order so that
        none waits on another), with the lanes' own order within them."""
        lanes = list(self.queue.event_queue_per_concurrency_id.items())
        random.shuffle(lanes)
        for lane, waiting in lanes:
            if not waiting.queue or (waiting.concurrency_limit is not None
                                     and waiting.current_concurrency >= waiting.concurrency_limit):
                continue
            event = self._next_light(waiting.queue) if lane == LIGHT else waiting.queue[0]
            if event is None:
                continue
            waiting.queue.remove(event)
            if lane == HEAVY:
                self._started(_address(event.request), waiting.queue)
            return [event], False, lane
        return None

    def _next_light(self, waiting: list):
        """The first waiting light call of a page with no light call running (None: every such page has one)."""
        busy = {e.session_hash for job in self.queue.active_jobs if job for e in job if e.concurrency_id == LIGHT}
        return next((e for e in waiting if e.session_hash not in busy), None)

    def _started(self, who: str, runs: list) -> None:
        self._turns[who] = next(self._turn)
        if len(self._turns) > 4 * RUNS_WAITING:  # an address with nothing waiting comes back as a newcomer
            keep = {_address(e.request) for e in runs}
            self._turns = {a: t for a, t in self._turns.items() if a in keep}
        self._fair(runs)

    def _fair(self, runs: list) -> None:
        """Order the waiting runs in place, round by round: each address's first waiting run, then its
        second, …; within a round, the address whose latest run started longest ago (or never) first,
        then by arrival."""
        rank, key = Counter(), {}
        for e in sorted(runs, key=lambda e: e.enqueue_time):
            who = _address(e.request)
            key[e._id] = (rank[who], self._turns.get(who, -1), e.enqueue_time)
            rank[who] += 1
        runs.sort(key=lambda e: key[e._id])


class PageSessions:
    """ASGI middleware: a heartbeat stream (``/gradio_api/heartbeat/<session id>``, which a page and
    ``gradio_client`` hold open while they are there) opens its session for the
    :class:`~nctv.ui.session.SessionHolder`, at most :data:`~nctv.ui.session.SESSIONS_PER_ADDRESS` per
    address at once; past that, or with an overlong id, it is refused in words."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] != "GET" or "/heartbeat/" not in path:
            return await self.app(scope, receive, send)
        sessions = getattr(scope["app"], "state_holder", None)
        if not isinstance(sessions, SessionHolder):
            return await self.app(scope, receive, send)
        session = path.rsplit("/heartbeat/", 1)[1].strip("/")
        if not 0 < len(session) <= SESSION_ID_CHARS:
            return await refuse(send, 400, f"A session id has 1 to {SESSION_ID_CHARS} characters; this one has "
                                            f"{len(session):,}.")
        who = (scope.get("client") or ("unknown",))[0]
        if not sessions.open(session, who):
            return await refuse(send, 429, f"{SESSIONS_PER_ADDRESS:,} pages of this app are open from this address "
                                            f"already; please close one first.")
        try:
            await self.app(scope, receive, send)
        finally:
            sessions.close(session, who)


def _address(request) -> str:
    client = getattr(request, "client", None)
    return client.host if client else "unknown"


@contextlib.asynccontextmanager
async def bounded_server(app):
    """The launched app's lifespan: its sessions keep only the visitors' own state
    (:class:`~nctv.ui.session.SessionHolder`), and its queue has two lanes (:class:`Lanes`)."""
    blocks = app.get_blocks()
    app.state_holder = SessionHolder()
    app.state_holder.set_blocks(blocks)
    Lanes(blocks, app.state_holder)
    yield


def replaying(body: bytes, receive):
    """An ASGI ``receive`` that hands on ``body``, read whole already, then what ``receive`` brings."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def refuse(send, status: int, message: str) -> None:
    """Answer with HTTP ``status`` and ``{"detail": message}``."""
    body = json.dumps({"detail": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
