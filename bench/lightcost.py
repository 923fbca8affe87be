"""``python -m bench.lightcost``: what one visitor's requests cost the launched app, for this checkout
and another (``--against``), measured in one run, as ratios; and how long the light calls take while
a Calibrate run computes, with the run's priority lowered (the default) and not.

For each server (this checkout; the other checkout; this checkout with ``NCTV_RUN_NICENESS=0``), each
launched fresh with ``python app.py`` and warmed with one call, the bench makes, one after the other,
``--calls`` requests of each kind a first visit makes and reads the server's own CPU seconds from
/proc before and after: CPU ms per request (what a room of visitors costs the cores, and what another
process's load barely changes), and the median wall ms. The kinds:

* the page (``GET /``) and a lecture's link (``GET /?tab=learn&t=1.5&bins=10&presenter=1``);
* Gradio's front-end files of a first visit (the ~100 scripts and styles a browser fetches after the
  page; their list is read once from headless Chromium loading the link, ``/usr/bin/chromium``), with
  the encodings Chromium asks for: CPU ms per whole visit and per file;
* the link's view (the load event outside the queue), the Try tab's page-load picture, Learn's first
  data, and ``/explore_temperature`` at a T not asked before and at one asked before.

Then, with a long Calibrate run computing (the paper's recipe, stopped at the end), the page-load
picture, Learn's first data and ``/explore_temperature`` again: their median wall ms during the run
against the same calls before it, on the same server. Writes ``bench/results/lightcost.md`` and
``.json`` (``--out``). Timings on a shared machine are noisy: the CPU ms and the ratios of one run are
the figures to read. Not a test: nothing here asserts a time.

    python -m bench.lightcost --against /path/to/checkout/before     # about 10 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from bench.hostile_session import Server
from bench.lecture import App, _git, run_values, write

ROOT = Path(__file__).resolve().parent.parent
LINK = "/?tab=learn&t=1.5&bins=10&presenter=1"
#: What Chromium sends with every request.
BROWSER = {"accept-encoding": "gzip, deflate, br, zstd"}
#: The kinds of light call measured again while a run computes.
DURING_RUN = ("page-load picture", "Learn first data", "explore_temperature, T asked before")


def first_visit_files(url: str) -> list[str]:
    """The front-end files (``/assets/…``, ``/static/…``, the theme) Chromium fetches on a first visit
    to the link, in the order it asked for them."""
    from playwright.sync_api import sync_playwright

    seen: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium")
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.on("request", lambda r: seen.append(r.url[len(url):]) if r.url.startswith(url) else None)
        page.goto(url + LINK)
        # Learn's diagram drawn: its data came, after every component of the page was loaded.
        page.wait_for_selector("#learn-plot svg", timeout=600_000)
        browser.close()
    return list(dict.fromkeys(p for p in seen if p.startswith(("/assets/", "/static/", "/theme.css"))))


class Client:
    """Calls of the launched app as its page makes them, one at a time."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url, timeout=600, headers=BROWSER)
        self.app = App(self.http.get("/config").json())
        self.link = next(d for d in self.app.deps if d.get("backend_fn") and d.get("queue") is False
                         and any(t[1] == "load" for t in d["targets"]))
        self.t = 0

    def close(self) -> None:
        self.http.close()

    def queued(self, dep: dict, data: list, event_data: dict | None = None, until: str = "process_completed",
               session: str | None = None) -> str:
        session = session or uuid.uuid4().hex[:11]
        r = self.http.post("/gradio_api/queue/join", json={"data": data, "event_data": event_data, "fn_index": dep["id"],
                                                          "trigger_id": None, "session_hash": session})
        r.raise_for_status()
        event = r.json()["event_id"]
        with self.http.stream("GET", f"/gradio_api/queue/data?session_hash={session}") as s:
            for line in s.iter_lines():
                msg = json.loads(line[6:]) if line.startswith("data: ") else {}
                if msg.get("event_id") == event and msg.get("msg") == until:
                    if until == "process_completed" and not msg.get("success"):
                        raise RuntimeError(f"{dep.get('api_name') or dep['id']} failed: {msg.get('output')}")
                    return event
        raise RuntimeError("the stream ended before the call did")

    def explore(self, t: float) -> None:
        r = self.http.post("/gradio_api/call/explore_temperature", json={"data": [t, 15]})
        r.raise_for_status()
        with self.http.stream("GET", f"/gradio_api/call/explore_temperature/{r.json()['event_id']}") as s:
            for line in s.iter_lines():
                if line.startswith("event: error"):
                    raise RuntimeError("explore_temperature failed")

    def kinds(self, files: list[str]) -> dict:
        """{kind: (one request of that kind, how many requests one call of it makes)}."""
        def new_t():
            self.t += 1
            self.explore(round(0.5 + (self.t * 37 % 251) / 100, 2))  # each T of the slider's grid once

        return {
            "page": (lambda: self.http.get("/").raise_for_status(), 1),
            "page of the lecture's link": (lambda: self.http.get(LINK).raise_for_status(), 1),
            "a first visit's front-end files": (lambda: [self.http.get(f).raise_for_status() for f in files],
                                                len(files)),
            "the link's view (load event)": (lambda: self.http.post(
                "/gradio_api/run/predict" + LINK[1:], json={"data": [], "event_data": None, "fn_index": self.link["id"],
                                                            "trigger_id": 0, "session_hash": uuid.uuid4().hex[:11]}
            ).raise_for_status(), 1),
            "page-load picture": (lambda: self.queued(self.app.load, self.app.values(self.app.load)), 1),
            "Learn first data": (lambda: self.queued(self.app.first_view, [None], {}), 1),
            "explore_temperature, new T": (new_t, 1),
            "explore_temperature, T asked before": (lambda: self.explore(1.5), 1),
        }


def measure(server: Server, fn, calls: int) -> dict:
    fn()  # the first call makes what later ones reuse
    walls, cpu = [], server.cpu_seconds()
    for _ in range(calls):
        t = time.monotonic()
        fn()
        walls.append(time.monotonic() - t)
    return {"cpu_ms": 1000 * (server.cpu_seconds() - cpu) / calls, "wall_ms": 1000 * statistics.median(walls)}


def during_run(server: Server, client: Client, calls: int) -> dict:
    """The light calls' median wall ms before a long run and while it computes, on one server."""
    kinds = {k: v[0] for k, v in client.kinds([]).items() if k in DURING_RUN}
    before = {k: measure(server, fn, calls)["wall_ms"] for k, fn in kinds.items()}
    app = client.app
    data = run_values(app, 2000)
    for name, value in (("Fitter", "paper"), ("Epochs (recipes only)", 1000), ("Methods", ["Neural Clamping (FL)"])):
        at = next(i for i, c in enumerate(app.calibrate["inputs"]) if app.by_id[c]["props"].get("label") == name)
        data[at] = value
    session = uuid.uuid4().hex[:11]
    event = client.queued(app.calibrate, data, until="process_starts", session=session)
    try:
        time.sleep(5)  # past the run's loading: the fit computes
        during = {k: measure(server, fn, calls)["wall_ms"] for k, fn in kinds.items()}
    finally:
        client.http.post("/gradio_api/cancel", json={"session_hash": session, "fn_index": app.calibrate["id"],
                                                     "event_id": event})
    return {k: {"idle_ms": before[k], "during_run_ms": during[k]} for k in kinds}


def one_server(repo: Path, files: list[str], calls: int, env: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(repo, Path(tmp), extra_env=env)
        client = None
        try:
            client = Client(server.url)
            load = os.getloadavg()[0]
            out = {"load_start": load, "kinds": {}}
            for kind, (fn, requests) in client.kinds(files).items():
                got = measure(server, fn, calls)
                out["kinds"][kind] = dict(got, requests=requests)
                print(f"  {kind}: {got['cpu_ms']:.1f} ms CPU, {got['wall_ms']:.1f} ms", flush=True)
            out["during_run"] = during_run(server, client, calls)
            out["load_end"] = os.getloadavg()[0]
            return out
        finally:
            if client is not None:
                client.close()
            server.stop()


def markdown(report: dict) -> str:
    run, servers = report["run"], report["servers"]
    names = list(servers)
    now, before = names[0], names[1] if len(names) > 1 else None
    lines = [f"# What a visitor's requests cost the app ({run['repo_name']} at {run['commit']}"
             f"{' (changed)' if run['dirty'] else ''})", "",
             f"torch {run['torch']}, Python {run['python']}, {run['cpus']} CPUs. `python -m bench.lightcost "
             f"{' '.join(run['argv'])}`; {run['calls']} requests of each kind one after the other on each server; "
             f"a first visit fetches {run['files']} front-end files. Load average at each server's start: "
             + ", ".join(f"{n} {s['load_start']:.1f}" for n, s in servers.items()) + ".", "",
             "CPU ms of the server per request (median wall ms):", "",
             "| request | " + " | ".join(names) + (f" | {before} ÷ {now} (CPU) |" if before else " |"),
             "|---|" + "---|" * (len(names) + (1 if before else 0))]
    for kind in servers[now]["kinds"]:
        cells = [f"{s['kinds'][kind]['cpu_ms']:.1f} ({s['kinds'][kind]['wall_ms']:.0f})" for s in servers.values()]
        ratio = ""
        if before:
            a, b = servers[now]["kinds"][kind]["cpu_ms"], servers[before]["kinds"][kind]["cpu_ms"]
            ratio = f" {b / a:.1f} |" if a > 0 else " — |"
        lines.append(f"| {kind} | " + " | ".join(cells) + " |" + ratio)
    visit = "a first visit's front-end files"
    files = servers[now]["kinds"].get(visit, {}).get("requests") or 0
    if files:
        lines += ["", "Per front-end file: " + ", ".join(
            f"{n} {s['kinds'][visit]['cpu_ms'] / files:.2f} ms CPU" for n, s in servers.items()) + "."]
    lines += ["", "Light calls while a Calibrate run computes (median wall ms before the run → during it, and "
                  "their ratio):", "", "| call | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for kind in servers[now]["during_run"]:
        cells = []
        for s in servers.values():
            d = s["during_run"][kind]
            cells.append(f"{d['idle_ms']:.0f} → {d['during_run_ms']:.0f} (× {d['during_run_ms'] / d['idle_ms']:.1f})")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--render":
        path = Path(argv[1])
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=ROOT, help="the checkout measured")
    p.add_argument("--against", type=Path, help="another checkout, measured the same way in the same run")
    p.add_argument("--calls", type=int, default=20, help="requests of each kind")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lightcost")
    a = p.parse_args(argv)
    import torch

    repo = a.repo.resolve()
    warm = Server(repo, Path(tempfile.mkdtemp()))
    try:
        files = first_visit_files(warm.url)
    finally:
        warm.stop()
    print(f"a first visit fetches {len(files)} front-end files", flush=True)
    runs = [(repo.name, repo, None)]
    if a.against is not None:
        runs.append((a.against.resolve().name, a.against.resolve(), None))
    runs.append((f"{repo.name}, NCTV_RUN_NICENESS=0", repo, {"NCTV_RUN_NICENESS": "0"}))
    report = {"run": {"repo_name": repo.name, "commit": _git(repo, "rev-parse", "--short", "HEAD"),
                      "dirty": bool(_git(repo, "status", "--porcelain")), "torch": torch.__version__,
                      "python": platform.python_version(), "cpus": os.cpu_count(), "calls": a.calls,
                      "files": len(files), "argv": argv},
              "servers": {}}
    for name, path, env in runs:
        print(name, flush=True)
        report["servers"][name] = one_server(path, files, a.calls, env)
    write(a.out, report, markdown)


if __name__ == "__main__":
    main()
