"""What the app adds to Gradio's own handling of a request, so that every answer of the launched app
is in its words and every run a page waits for ends:

- :class:`AppBlocks`: a call with too few values, or a value no input can read (a list where a
  picture goes), is refused naming the input and what it takes. Gradio's own message listed its
  components with their memory addresses, or quoted a validation error of its data classes. A file
  not uploaded to this app (a web address, another path of the server) is refused before Gradio
  fetches or reads it (:mod:`nctv.ui.uploads`).
- :class:`CancelEndsStreams`: Gradio's cancel route stops every run of a page's event (the page's
  session and the event's number), but ends the event stream of the one event it names only. A
  cancel that named another, or none, left the stopped run's page waiting for ever; each stopped
  run now gets a last message, and a Run button's status says "Stopped".
- :class:`QuietDisconnects`: a client that goes away while it sends a body (an aborted upload) is
  one line in the log, not a traceback.
- :class:`NoServerPaths`: the page, ``/config``, ``/gradio_api/info`` and every call's answer (the
  page's event stream, ``/gradio_api/call/<fn>/<event id>``) name the files Gradio serves from its
  cache (the shipped examples, a run's downloads) by :data:`CACHE_ALIAS` instead of the cache's
  folder on the server (``/tmp/gradio/<hash>/…``); a file address or a value sent back with the
  alias is read with the folder again.
- :class:`KeptAnswers`: the page (``GET /``, or a link's) is made once per root URL, and Gradio's
  front-end files are compressed once; both are then sent from memory.
- :class:`GoneResults`: asking for the result of a call that is no longer kept (see
  :data:`nctv.ui.session.RESULT_KEEP_S`) is answered in words, not with Gradio's "404: Not Found"
  inside an event stream.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import OrderedDict
from typing import Any

import gradio as gr
from starlette.requests import ClientDisconnect

from nctv.checks import shown
from nctv.ui.common import STOPPED
from nctv.ui.guard import refuse, replaying
from nctv.ui.links import GRADIO_PARAMETERS, PARAMETERS
from nctv.ui.session import RESULT_KEEP_S, RESULTS_KEPT
from nctv.ui.uploads import uploads_only

log = logging.getLogger("nctv.ui")

#: Gradio's "leave this output as it is" in a message to the page.
_UNCHANGED = {"__type__": "update"}
#: Stoppable events (by their number) -> the position of their status line among their outputs.
_STATUS_OUTPUT: dict[int, int] = {}


def stoppable(event: Any, status: gr.components.Component) -> None:
    """Record that ``event`` (an event listener's result) shows how its run goes in ``status``,
    one of its outputs: a run of it stopped by a cancel ends with :data:`STOPPED` there."""
    _STATUS_OUTPUT[event["id"]] = list(event["outputs"]).index(status._id)  # a Dependency is its config


# --------------------------------------------------------------------------- values a call sends


def _label(block: Any) -> str:
    return getattr(block, "label", None) or f"The {type(block).__name__} input"


def _takes(block: Any) -> str:
    """What an input reads, in a visitor's words."""
    if isinstance(block, gr.ImageEditor):
        return "a drawing (its background, layers and composite, each a picture uploaded to this app)"
    if isinstance(block, gr.Image):
        return "a picture: a file uploaded to this app (/gradio_api/upload) or a data: URL"
    if isinstance(block, (gr.File, gr.UploadButton)):
        return "a file uploaded to this app (/gradio_api/upload)"
    if isinstance(block, gr.Dataset):
        return "the number of one of its examples"
    return "a value of the kind the app's API page shows for it"


class AppBlocks(gr.Blocks):
    """``gr.Blocks`` whose refusal of a call's values, before any handler runs, is the app's sentence."""

    def validate_inputs(self, block_fn: Any, inputs: list[Any]) -> None:
        if len(inputs) < len(block_fn.inputs):
            labels = ", ".join(_label(b) for b in block_fn.inputs if not getattr(b, "stateful", False))
            raise gr.Error(f"{_endpoint(block_fn)} takes these values, in this order: {labels}; this call sent too "
                           "few.", print_exception=False)

    async def preprocess_data(self, block_fn: Any, inputs: list[Any], state: Any, explicit_call: bool = False):
        try:
            inputs = uploads_only(block_fn.inputs, inputs, _label)  # before Gradio fetches or copies any file
            return await super().preprocess_data(block_fn, inputs, state, explicit_call)
        except gr.Error:
            raise
        except Exception as e:  # noqa: BLE001 - Gradio's own words on a value it could not read
            log.info("refused a value sent to %s (%s)", _endpoint(block_fn), type(e).__name__)
            raise gr.Error(_unreadable(block_fn, inputs), print_exception=False) from None


def _endpoint(block_fn: Any) -> str:
    name = getattr(block_fn, "api_name", None)
    return f"/{name}" if isinstance(name, str) and name else "This event"


def _fits(block: Any, value: Any) -> bool:
    if isinstance(block, gr.Dataset):
        return isinstance(value, int) and not isinstance(value, bool)
    model = getattr(block, "data_model", None)
    if model is None:
        return True
    try:
        model.model_validate(value, context={"validate_meta": True})
    except Exception:  # noqa: BLE001 - the value does not fit its input
        return False
    return True


def _unreadable(block_fn: Any, inputs: list[Any]) -> str:
    """The sentence for values Gradio could not read: the first input whose value does not fit it."""
    for block, value in zip(block_fn.inputs, inputs):
        if not getattr(block, "stateful", False) and value is not None and not _fits(block, value):
            return f"{_label(block)} must be {_takes(block)}; got {shown(value)}."
    return (f"The values sent to {_endpoint(block_fn)} could not be read; send them as the app's API page "
            "(“Use via API”) shows.")


# --------------------------------------------------------------------------- cancel


async def _body(receive) -> tuple[bytes, Any]:
    """The whole body of a request, and a ``receive`` that hands it on again."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(chunks)
    return body, replaying(body, receive)


def _running(task_id: str) -> list[str]:
    """The events whose runs Gradio's cancel of ``task_id`` ("<session>_<event number>") stops: it
    names each run's task "<task id><gradio-sep><event id>"."""
    found = []
    for task in asyncio.all_tasks():
        name = task.get_name()
        if "<gradio-sep>" in name:
            tid, event_id = name.split("<gradio-sep>", 1)
            if tid == task_id:
                found.append(event_id)
    return found


def _last_message(event: Any) -> Any:
    """The message that ends a stopped run's stream: every output as it is, the status (where the
    event has one) saying that the run stopped."""
    from gradio.server_messages import ProcessCompletedMessage

    data: list[Any] = [_UNCHANGED] * len(event.fn.outputs)
    where = _STATUS_OUTPUT.get(event.fn._id)
    if where is not None:
        data[where] = STOPPED
    return ProcessCompletedMessage(output={"data": data}, success=True)


class CancelEndsStreams:
    """ASGI middleware: after Gradio's cancel route, each run it stopped that the cancel did not name
    (Gradio ends the named one's stream itself) gets a last message, so that its page stops waiting."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].rstrip("/").endswith("/cancel"):
            return await self.app(scope, receive, send)
        body, receive = await _body(receive)
        try:
            asked = json.loads(body)
            session, number, named = asked["session_hash"], asked["fn_index"], asked["event_id"]
        except (ValueError, TypeError, KeyError):
            return await self.app(scope, receive, send)  # Gradio refuses it
        if not isinstance(session, str) or isinstance(number, bool) or not isinstance(number, int):
            return await self.app(scope, receive, send)
        queue = scope["app"].get_blocks()._queue
        events = [e for eid in _running(f"{session}_{number}") if eid != named
                  and (e := queue.event_ids_to_events.get(eid)) is not None]
        await self.app(scope, receive, send)
        for event in events:
            try:
                queue.send_message(event, _last_message(event))
            except KeyError:  # its page's stream is already gone: nobody waits
                pass
            log.info("a cancel stopped %s's run; its page was told", _endpoint(event.fn))


# --------------------------------------------------------------------------- disconnects


class QuietDisconnects:
    """ASGI middleware: a client gone before its request was read is logged in one line."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            log.info("a client went away before its request to %s was read", scope.get("path", "?"))


# --------------------------------------------------------------------------- server paths

#: What the page and the API descriptions call Gradio's cache folder.
CACHE_ALIAS = "gradio-cache"
#: Routes whose answers describe the app (its components' values among them).
_DESCRIPTIONS = ("/config", "/info")
#: The route of an API call's answer, ``/call/<fn>/<event id>``.
_CALL_RESULT = re.compile(r"/call/(v2/)?[^/]+/[^/]+$")


def _cache_folder() -> bytes:
    from gradio.utils import get_upload_folder

    return get_upload_folder().rstrip("/").encode()


class NoServerPaths:
    """ASGI middleware: the alias for Gradio's cache folder out (the page and the descriptions of the
    app), the folder for the alias in (file addresses, JSON bodies)."""

    def __init__(self, app):
        self.app = app
        self.folder = _cache_folder()
        self.alias = CACHE_ALIAS.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        marker = "file=" + CACHE_ALIAS + "/"
        if marker in path:  # a file the page found under the alias
            scope = dict(scope, path=path.replace(marker, "file=" + self.folder.decode() + "/"))
            scope["raw_path"] = scope["path"].encode()
        if scope["method"] == "POST":
            headers = dict(scope["headers"])
            if headers.get(b"content-type", b"").lower().startswith(b"application/json"):
                body, _ = await _body(receive)
                back = body.replace(b'"' + self.alias + b"/", b'"' + self.folder + b"/").replace(
                    b"file=" + self.alias + b"/", b"file=" + self.folder + b"/")
                if back != body:
                    scope = dict(scope, headers=[(k, str(len(back)).encode() if k == b"content-length" else v)
                                                 for k, v in scope["headers"]])
                return await self.app(scope, replaying(back, receive), send)
        if scope["method"] in ("GET", "HEAD") and (path.rstrip("/") == "" or path.endswith(_DESCRIPTIONS)
                                                   or path.endswith("/queue/data")
                                                   or _CALL_RESULT.search(path.rstrip("/"))):
            return await self.app(scope, receive, self._aliasing(send))
        return await self.app(scope, receive, send)

    def _aliasing(self, send):
        """A ``send`` that holds the answer back until it is whole, then sends it with the alias; a
        stream (no declared length: one message of an event stream per part) goes part by part."""
        start, chunks = None, []

        async def aliased(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                if not any(k.lower() == b"content-length" for k, _ in start["headers"]):
                    await send(start)
                return
            if message["type"] != "http.response.body":
                return await send(message)
            if not any(k.lower() == b"content-length" for k, _ in start["headers"]):
                return await send(dict(message, body=message.get("body", b"").replace(self.folder + b"/",
                                                                                     self.alias + b"/")))
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks).replace(self.folder + b"/", self.alias + b"/")
            headers = [(k, str(len(body)).encode() if k.lower() == b"content-length" else v)
                       for k, v in start["headers"]]
            await send(dict(start, headers=headers))
            await send({"type": "http.response.body", "body": body, "more_body": False})

        return aliased


# --------------------------------------------------------------------------- results no longer kept


class GoneResults:
    """ASGI middleware: ``GET /gradio_api/call/<fn>/<event id>`` for an event the server holds nothing
    of (never made, or its result no longer kept) gets HTTP 404 and a sentence saying how long results
    are kept, instead of an event stream whose only message is Gradio's "404: Not Found". ``HEAD`` on
    that address says whether the call's result is still held (200) or not (404), collecting nothing."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "").rstrip("/")
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD") or not _CALL_RESULT.search(path):
            return await self.app(scope, receive, send)
        event_id = path.rsplit("/", 1)[1]
        queue = scope["app"].get_blocks()._queue
        if (event_id in queue.event_ids_to_events or event_id in queue.pending_messages_per_session
                or any(event_id in ids for ids in queue.pending_event_ids_session.values())):
            if scope["method"] == "HEAD":  # held: a GET collects it
                await send({"type": "http.response.start", "status": 200, "headers": []})
                return await send({"type": "http.response.body", "body": b""})
            return await self.app(scope, receive, send)
        await refuse(send, 404, f"This server holds no result of the call {shown(event_id)}: a result is kept "
                                f"{RESULT_KEEP_S:g} s after its call ends (the latest {RESULTS_KEPT:,} at most), "
                                "then dropped. Call again, and collect the result sooner.")


# --------------------------------------------------------------------------- the page and its files

#: Gradio's front-end files (its scripts, styles, the theme and the icon), the same for every visitor.
_FRONT_END = ("/assets/", "/static/")
_FRONT_END_FILES = ("/theme.css", "/favicon.ico")
#: A page's query parameters that leave the page Gradio makes as it is: a link's (the page sends them
#: with its calls, which read them) and Gradio's own that its script reads.
_PAGE_QUERY = frozenset(PARAMETERS + GRADIO_PARAMETERS)
#: Requests that ask for a part of a file or a fresh copy only if it changed: left to Gradio.
_CONDITIONAL = (b"range", b"if-none-match", b"if-modified-since", b"if-range")


def _encoding(headers: dict) -> str | None:
    """How an answer goes to this client: brotli where it takes it, else gzip, else as it is (the
    choice of Gradio's own compression, which answers the page's other requests)."""
    accepted = headers.get(b"accept-encoding", b"").decode("latin-1").lower()
    return "br" if "br" in accepted else "gzip" if "gzip" in accepted else None


def _compressed(body: bytes, encoding: str | None) -> bytes:
    import gzip

    import brotli

    if encoding == "br":
        return brotli.compress(body, quality=KeptAnswers.QUALITY, lgwin=22)
    return gzip.compress(body, compresslevel=6, mtime=0) if encoding == "gzip" else body


class KeptAnswers:
    """ASGI middleware: the answers that are the same for every visitor are made once, compressed
    once, and then sent from memory:

    - the page (``GET /``, with no query or a link's, :data:`_PAGE_QUERY`: the page is the same bytes
      for both), per root URL (host and proxy headers: Gradio writes that root into it);
    - Gradio's front-end files (``/assets/…``, ``/static/…``, the theme, the icon), about 100 files a
      first visit fetches.

    Gradio makes the page anew for every request (its configuration copied and walked for the root, its
    API description built, 700 KB written; 61 ms of the server's CPU for a lecture's link) and sends it
    uncompressed; it compresses every script and style again for every visitor (brotli, about 6 ms a
    file, 85 ms for the largest). Kept, a page costs the server 3 ms and a file about 1 ms.
    Each answer is kept per encoding the client takes (brotli, gzip or none), at most
    :data:`MAX_BYTES` in all (the least recently sent go first); a request for a part of a file or a
    conditional one, and any answer but 200, goes to Gradio as before."""

    #: Bytes of kept answers, all together.
    MAX_BYTES = 64 * 2**20
    #: Brotli's quality for a kept answer: made once, so one step above Gradio's per-request 4.
    QUALITY = 5

    def __init__(self, app):
        self.app = app
        self.kept: OrderedDict[tuple, tuple[dict, bytes]] = OrderedDict()
        self.size = 0
        self._making: dict[tuple, asyncio.Future] = {}

    def _key(self, scope) -> tuple | None:
        """What the answer to ``scope`` depends on, or None where it is not kept."""
        if scope["type"] != "http" or scope["method"] != "GET":
            return None
        headers = dict(scope["headers"])
        if any(h in headers for h in _CONDITIONAL):
            return None
        path, query = scope["path"], scope.get("query_string", b"").decode("latin-1")
        if path == "/":
            names = {part.split("=", 1)[0] for part in query.split("&") if part}
            if not names <= _PAGE_QUERY:
                return None
            return ("page", scope.get("scheme"), scope.get("root_path", ""), scope.get("server"),
                    *(headers.get(h) for h in (b"host", b"x-forwarded-host", b"x-forwarded-proto",
                                               b"x-forwarded-port")), _encoding(headers))
        if path.startswith(_FRONT_END) or path in _FRONT_END_FILES:
            return ("file", path, query, _encoding(headers))
        return None

    async def __call__(self, scope, receive, send):
        key = self._key(scope)
        if key is None:
            return await self.app(scope, receive, send)
        while key not in self.kept and key in self._making:  # another visitor's request is making it
            await asyncio.shield(self._making[key])
        if key in self.kept:
            self.kept.move_to_end(key)
            start, body = self.kept[key]
            await send(start)
            return await send({"type": "http.response.body", "body": body, "more_body": False})
        made = self._making[key] = asyncio.get_running_loop().create_future()
        try:
            await self._make(key, scope, receive, send)
        finally:
            self._making.pop(key, None)
            made.set_result(None)

    async def _make(self, key: tuple, scope, receive, send) -> None:
        """Gradio's answer, kept compressed when it is whole and 200, sent either way."""
        start, chunks = {}, []

        async def held(message):
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
            else:
                await send(message)

        await self.app(scope, receive, held)
        body = b"".join(chunks)
        encoding = key[-1]
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-encoding")]
        if start.get("status") == 200 and not any(k.lower() == b"content-encoding" for k, _ in start["headers"]):
            body = await asyncio.to_thread(_compressed, body, encoding)
            if encoding is not None:
                headers += [(b"content-encoding", encoding.encode()), (b"vary", b"Accept-Encoding")]
            start = dict(start, headers=headers + [(b"content-length", str(len(body)).encode())])
            self._keep(key, start, body)
        elif start:
            start = dict(start, headers=headers + [(b"content-length", str(len(body)).encode())])
        if start:
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})

    def _keep(self, key: tuple, start: dict, body: bytes) -> None:
        if len(body) > self.MAX_BYTES // 4:
            return
        self.kept[key] = (start, body)
        self.size += len(body)
        while self.size > self.MAX_BYTES:
            _, (_, dropped) = self.kept.popitem(last=False)
            self.size -= len(dropped)
