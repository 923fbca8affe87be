"""Bounds on what a request may hand the launched app, whatever its route or transport: the size of
its body (declared or streamed), the length of every string in a JSON body (the values of a form's
fields; inline pictures have their own cap, see ``nctv.ui.images``), and the bytes one address may
upload within the time uploads are kept.

It runs before Gradio reads a body, so an oversized value is refused in milliseconds, before it
joins the queue or takes the heavy slot; the refusal is a short JSON ``{"detail": …}``.
"""
from __future__ import annotations

import itertools
import json
import threading
import time
from collections import deque
from typing import Any

from nctv.checks import MAX_TEXT_CHARS, env_limit, env_number
from nctv.ui.images import MAX_UPLOAD_BYTES

#: Largest request body, in bytes: one upload at the file cap and its envelope;
#: ``$NCTV_MAX_REQUEST_BYTES``.
MAX_REQUEST_BYTES = env_limit("NCTV_MAX_REQUEST_BYTES", MAX_UPLOAD_BYTES + 2**20)
#: Seconds an uploaded file is kept before the app deletes it; ``$NCTV_UPLOAD_KEEP_S``.
UPLOAD_KEEP_S = int(env_number("NCTV_UPLOAD_KEEP_S", 1800, 60, whole=True))
#: Bytes one address may upload within :data:`UPLOAD_KEEP_S` (what it can hold on the disk at
#: once); ``$NCTV_UPLOAD_BUDGET_BYTES``.
UPLOAD_BUDGET_BYTES = env_limit("NCTV_UPLOAD_BUDGET_BYTES", 8 * MAX_UPLOAD_BYTES)
#: Routes that store what they receive (files, a drawing's parts).
UPLOAD_ROUTES = ("/upload", "/component_server")
#: Inline pictures (``data:`` URLs) are capped by the image input, not as text.
_INLINE = "data:"


class _TooLarge(Exception):
    """The body grew past the cap while the app was reading it."""


def _too_long_text(value: Any) -> int:
    """Length of the first string in a JSON value longer than the text cap (0 if none)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if len(v) > MAX_TEXT_CHARS and not v.startswith(_INLINE):
                return len(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return 0


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
            return await _refuse(send, 413, self._too_large())
        who = (scope.get("client") or ("unknown",))[0]
        uploads = scope["path"].rstrip("/").endswith(UPLOAD_ROUTES)
        if uploads and self.budget.used(who) + (declared or 0) > self.budget.budget:
            return await _refuse(send, 429, f"This address uploaded more than {self.budget.budget / 1e6:,.0f} MB in "
                                            f"the last {self.budget.window_s / 60:.0f} minutes; please wait a while.")
        if headers.get("content-type", "").startswith("application/json"):
            return await self._json(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise _TooLarge
            return message

        status = None

        async def watched(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except _TooLarge:
            if status is not None:
                raise
            return await _refuse(send, 413, self._too_large())
        if uploads and status is not None and status < 400:  # what was stored
            self.budget.add(who, received)

    async def _json(self, scope, receive, send):
        """A JSON body is read whole (it is small), checked, then handed on."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _refuse(send, 413, self._too_large())
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            longest = _too_long_text(json.loads(body))
        except (ValueError, RecursionError):
            longest = 0  # not this guard's business: the app answers malformed JSON itself
        if longest:
            return await _refuse(send, 413, f"A value of {longest:,} characters was sent; this app accepts at most "
                                            f"{MAX_TEXT_CHARS:,} characters in a field.")
        await self.app(scope, replaying(body, receive), send)

    def _too_large(self) -> str:
        return f"The request is larger than this app accepts ({self.max_bytes / 1e6:,.0f} MB)."


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


async def _refuse(send, status: int, message: str) -> None:
    body = json.dumps({"detail": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
