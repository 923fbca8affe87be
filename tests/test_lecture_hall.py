"""The lecture hall on the launched app (``python app.py``), on loopback: a room of pages, half of them
behind one address, served while a run holds the heavy slot; runs taking turns between addresses;
made-up session ids that open no session; results nobody collects dropped; pages per address bounded;
no server path in a run's answer. Every wait is for a message of the server (with a deadline that only
a failure reaches); the load bench (``python -m bench.lecture``) measures the times.
"""
import asyncio
import json
import sys
import time
import uuid

import httpx
import pytest

from bench.lecture import App, Visitor, run_values
from conftest import start_app, stop_app

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="binds 127.0.0.N addresses")

#: Limits small enough to reach in a test (the server's environment).
CALLS_OUTSIDE_PAGES = 2
RESULTS_KEPT = 2
PAGES_PER_ADDRESS = 45
#: Longest any wait for the server may take before the test fails.
DEADLINE_S = 300


@pytest.fixture(scope="module")
def hall(tmp_path_factory):
    proc, url = start_app(tmp_path_factory.mktemp("lecture"), NCTV_QUEUE_PER_ADDRESS=str(CALLS_OUTSIDE_PAGES),
                          NCTV_RESULTS_KEPT=str(RESULTS_KEPT), NCTV_SESSIONS_PER_ADDRESS=str(PAGES_PER_ADDRESS))
    try:
        app = App(httpx.get(url + "config", timeout=60).json())
        yield url, app
    finally:
        stop_app(proc)


def _input(app: App, dep: dict, data: list, **changes) -> list:
    """``data`` with the inputs of ``dep`` named by elem_id or label set to the given values."""
    data = list(data)
    for name, value in changes.items():
        at = next(i for i, c in enumerate(dep["inputs"]) if name in (app.by_id[c]["props"].get("elem_id"),
                                                                     app.by_id[c]["props"].get("label")))
        data[at] = value
    return data


def _small_run(app: App) -> list:
    return _input(app, app.calibrate, run_values(app, 20), **{"test-size": 20, "Methods": ["Neural Clamping (FL)"]})


def _long_run(app: App) -> list:
    """A run that holds the heavy slot until it is stopped: the paper's recipe for 1,000 epochs."""
    return _input(app, app.calibrate, run_values(app, 2000), **{"Fitter": "paper", "Epochs (recipes only)": 1000,
                                                              "Methods": ["Neural Clamping (FL)"]})


async def _stop(url: str, app: App, visitor: Visitor, event: str) -> None:
    await visitor.http.post(url.rstrip("/") + "/gradio_api/cancel",
                            json={"session_hash": visitor.session, "fn_index": app.calibrate["id"], "event_id": event})


async def _holding(url: str, app: App, log: list) -> tuple[Visitor, str, asyncio.Task]:
    """A page whose long run has started (its process_starts came): (the page, the run's event id, a
    task that ends with the run's last message)."""
    holder = Visitor(url, "127.0.0.3", log)
    holder.open_heartbeat()
    r = await holder.http.post("/gradio_api/queue/join", json={"data": _long_run(app), "fn_index": app.calibrate["id"],
                                                               "session_hash": holder.session, "event_data": None})
    r.raise_for_status()
    event, started = r.json()["event_id"], asyncio.get_running_loop().create_future()

    async def stream():
        async with holder.http.stream("GET", f"/gradio_api/queue/data?session_hash={holder.session}") as s:
            async for line in s.aiter_lines():
                msg = json.loads(line[6:]) if line.startswith("data: ") else {}
                if msg.get("event_id") == event and msg.get("msg") == "process_starts" and not started.done():
                    started.set_result(True)
                if msg.get("event_id") == event and msg.get("msg") == "process_completed":
                    return msg

    task = asyncio.create_task(stream())
    await asyncio.wait_for(started, DEADLINE_S)
    return holder, event, task


def test_a_room_is_served_while_a_run_holds_the_heavy_slot(hall):
    """40 pages, 20 of them behind one address, load the page (its first picture), open Learn and
    release T while a run holds the heavy slot: every call is served, and all of them before the run
    has ended (the run ends only when it is stopped, after the room is done)."""
    url, app = hall

    async def room():
        log = []
        holder, event, run = await _holding(url, app, log)

        async def student(i: int):
            v = Visitor(url, "127.0.0.5" if i % 2 else f"127.0.4.{i + 1}", log)
            try:
                assert await v.page() == "ok"
                v.open_heartbeat()
                await v.call("page load", app.load, app.values(app.load))
                await v.call("Learn first view", app.first_view, [None], {})
                if app.release is not None:
                    await v.call("release T", app.release, [None], {"temperature": 1.0 + i / 100, "bins": 15})
            finally:
                await v.close()

        await asyncio.wait_for(asyncio.gather(*[student(i) for i in range(40)]), DEADLINE_S)
        running = not run.done()  # the room was served while the run went on
        await _stop(url, app, holder, event)
        last = await asyncio.wait_for(run, DEADLINE_S)
        await holder.close()
        return log, running, last

    log, running, last = asyncio.run(room())
    calls = [r for r in log if r["kind"] != "page HTML"]
    assert len(calls) == 40 * (3 if app.release is not None else 2)
    refused = [r for r in log if r["outcome"] != "ok"]
    assert not refused, "\n".join(f"{r['kind']} from {r['where']} after {r['seconds']:.2f} s: {r['outcome']} "
                                   f"{r.get('detail') or ''}" for r in refused)
    assert running and last["msg"] == "process_completed"  # ended by the stop


def test_runs_take_turns_between_addresses(hall):
    """While a run holds the slot, 127.0.0.11 and .12 queue 3 runs each, then .13 one: they start
    round-robin between the addresses (.11, .12, .13, .11, .12, .11, .12), not in the order sent. A
    fourth waiting run of one address is refused in words."""
    url, app = hall
    quick = _input(app, app.calibrate, run_values(app, 20), **{"Focal-loss γ": "x"})  # refused as soon as it starts

    async def turns():
        log = []
        holder, event, run = await _holding(url, app, log)
        watcher = Visitor(url, "127.0.0.10", log)  # the runs' messages come on its stream, in the server's order
        watcher.open_heartbeat()
        sent = []
        for where, count in (("127.0.0.11", 3), ("127.0.0.12", 3), ("127.0.0.13", 1)):
            v = Visitor(url, where, log)
            body = {"data": quick, "fn_index": app.calibrate["id"], "session_hash": watcher.session, "event_data": None}
            for _ in range(count):
                r = await v.http.post("/gradio_api/queue/join", json=body)
                r.raise_for_status()
                sent.append((r.json()["event_id"], where))
            if where == "127.0.0.11":
                refused = await v.http.post("/gradio_api/queue/join", json=body)
            await v.close()
        order = []

        async def starts():
            async with watcher.http.stream("GET", f"/gradio_api/queue/data?session_hash={watcher.session}") as s:
                async for line in s.aiter_lines():
                    msg = json.loads(line[6:]) if line.startswith("data: ") else {}
                    if msg.get("msg") == "process_starts":
                        order.append(msg["event_id"])
                        if len(order) == len(sent):
                            return

        watching = asyncio.create_task(starts())
        await _stop(url, app, holder, event)
        await asyncio.wait_for(watching, DEADLINE_S)
        await asyncio.wait_for(run, DEADLINE_S)
        await holder.close()
        await watcher.close()
        return sent, order, refused

    sent, order, refused = asyncio.run(turns())
    where = dict(sent)
    assert [where[e] for e in order] == ["127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.11", "127.0.0.12",
                                         "127.0.0.11", "127.0.0.12"]
    assert refused.status_code == 429 and refused.json()["detail"] == (
        "3 runs from this address are already waiting in the queue; please wait until one has started.")


def test_a_made_up_session_id_opens_no_session(hall):
    """A page (its heartbeat open) keeps its run's calibration: Learn's answer then speaks of "your run".
    The same calls under a session id no page opened leave nothing behind: its second call finds the
    shipped calibration. No server path reaches either in a run's answer."""
    url, app = hall
    from gradio.utils import get_upload_folder

    async def both():
        out = {}
        for kind in ("page", "made up"):
            v = Visitor(url, "127.0.0.6", [])
            if kind == "page":
                v.open_heartbeat()
            ran = await v.call("run", app.calibrate, _small_run(app))
            learnt = await v.call("learn", app.explore, [1.0, 15, None])
            out[kind] = ran, learnt
            await v.close()
        return out

    out = asyncio.run(both())
    for kind, (ran, learnt) in out.items():
        assert ran["outcome"] == learnt["outcome"] == "ok", (kind, ran.get("detail"), learnt.get("detail"))
        files = ran["output"]["data"][7]
        assert files and all(f["path"].startswith("gradio-cache/") and "file=gradio-cache/" in f["url"] for f in files)
        assert get_upload_folder() not in ran["text"] and "/tmp/" not in ran["text"]
        download = httpx.get(files[0]["url"], timeout=60)
        assert download.status_code == 200 and len(download.content) > 100
    assert "your run" in out["page"][1]["output"]["data"][2]
    assert "your run" not in out["made up"][1]["output"]["data"][2]
    assert "pre-computed" in out["made up"][1]["output"]["data"][2]


def test_results_nobody_collects_are_dropped(hall):
    """Three API calls whose results nobody collects: the server keeps the latest two (the module's
    NCTV_RESULTS_KEPT) and drops the older; asking for a dropped one gets 404 in words, a kept one its
    result."""
    url, _ = hall
    http = httpx.Client(base_url=url, timeout=60)
    events = []
    for t in (1.11, 1.12, 1.13):
        r = http.post("/gradio_api/call/explore_temperature", json={"data": [t, 15]})
        r.raise_for_status()
        events.append(r.json()["event_id"])
    deadline = time.monotonic() + DEADLINE_S
    while True:  # the server drops one once three have ended: wait for it (HEAD collects nothing)
        held = {e: http.head(f"/gradio_api/call/explore_temperature/{e}").status_code for e in events}
        if 404 in held.values() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(held.values()) == [200, 200, 404], held
    gone = next(e for e, code in held.items() if code == 404)
    r = http.get(f"/gradio_api/call/explore_temperature/{gone}")
    assert r.status_code == 404 and r.json()["detail"].startswith("This server holds no result of the call")
    assert "is kept 60 s after its call ends (the latest 2 at most)" in r.json()["detail"]
    kept = next(e for e, code in held.items() if code == 200)
    assert "event: complete" in http.get(f"/gradio_api/call/explore_temperature/{kept}").text
    http.close()


def test_one_address_holds_a_bounded_number_of_pages(hall):
    """Pages open from one address are counted by their heartbeats: past NCTV_SESSIONS_PER_ADDRESS the
    next is refused in words; once one closes, another opens."""
    url, _ = hall

    async def pages():
        client = httpx.AsyncClient(base_url=url, timeout=60, transport=httpx.AsyncHTTPTransport(local_address="127.0.0.8"),
                                   limits=httpx.Limits(max_connections=PAGES_PER_ADDRESS + 5))
        opened = []

        async def beat(session: str, alive: asyncio.Future):
            async with client.stream("GET", f"/gradio_api/heartbeat/{session}") as r:
                if r.status_code != 200:
                    alive.set_result((r.status_code, json.loads(await r.aread())["detail"]))
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and not alive.done():
                        alive.set_result((200, None))

        async def open_one():
            alive = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(beat(uuid.uuid4().hex[:11], alive))
            return task, await asyncio.wait_for(alive, DEADLINE_S)

        for _ in range(PAGES_PER_ADDRESS):
            opened.append(await open_one())
        past = await open_one()
        opened[0][0].cancel()  # a page closes
        deadline = time.monotonic() + DEADLINE_S
        while (again := await open_one())[1][0] != 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # until the server has seen it close
        for task, _ in opened[1:] + [again]:
            task.cancel()
        await client.aclose()
        return [answer for _, answer in opened], past[1], again[1]

    opened, past, again = asyncio.run(pages())
    assert all(code == 200 for code, _ in opened)
    assert past == (429, f"{PAGES_PER_ADDRESS} pages of this app are open from this address already; please close "
                         "one first.")
    assert again == (200, None)


def test_the_page_from_memory_is_the_one_gradio_makes(hall):
    """The page is made once per root URL and then sent from memory, for the bare address and for a
    lecture's link alike: the same bytes Gradio makes for a request it answers itself (one with a query
    that is no link's), with the cache folder's alias and no server path, compressed as the browser
    asks (brotli, else gzip; as it is to a client that takes neither)."""
    url, _ = hall
    first, again = httpx.get(url, timeout=60), httpx.get(url, timeout=60)
    link = httpx.get(url + "?tab=learn&t=1.5&bins=10&presenter=1", timeout=60)
    made = httpx.get(url + "?fresh=1", timeout=60)
    assert first.status_code == again.status_code == link.status_code == made.status_code == 200
    assert first.content == again.content == link.content == made.content
    assert b"gradio-cache/" in first.content and b"/tmp/" not in first.content
    for asked, encoding in (("br, gzip", "br"), ("gzip", "gzip"), ("identity", None)):
        page = httpx.get(url + "?tab=learn", headers={"accept-encoding": asked}, timeout=60)
        assert page.headers.get("content-encoding") == encoding and page.content == made.content


def test_gradios_files_are_sent_from_memory_as_they_are_on_disk(hall):
    """Gradio's front-end files (scripts, styles, the theme) are compressed once and then sent from
    memory: each decodes to the bytes of the file in Gradio's build folder, in every encoding a browser
    may take; a request for a part of a file still gets that part."""
    import re
    from pathlib import Path

    import gradio

    url, _ = hall
    page = httpx.get(url, timeout=60).text
    names = sorted(set(re.findall(r"assets/([\w\-]+\.(?:js|css))", page)))
    assert names
    build = Path(gradio.__file__).parent / "templates" / "frontend" / "assets"
    for name in names:
        on_disk = (build / name).read_bytes()
        for asked, encoding in (("gzip, deflate, br", "br"), ("gzip", "gzip"), ("identity", None), ("br", "br")):
            r = httpx.get(f"{url}assets/{name}", headers={"accept-encoding": asked}, timeout=60)
            assert r.status_code == 200 and r.headers.get("content-encoding") == encoding
            assert r.content == on_disk
    part = httpx.get(f"{url}assets/{names[0]}", headers={"range": "bytes=0-9", "accept-encoding": "identity"},
                     timeout=60)
    assert part.status_code == 206 and part.content == (build / names[0]).read_bytes()[:10]
    theme = [httpx.get(url + "theme.css", headers={"accept-encoding": "br"}, timeout=60) for _ in range(2)]
    assert theme[0].content == theme[1].content and b"--" in theme[0].content
