"""``python -m bench.lecture``: a lecture hall against the launched app, on loopback, as counts,
refusals and latencies (p50, p95), with a backlog of runs and a newcomer who wants one.

Each room launches ``python app.py`` from ``--repo`` (default: this checkout; give another checkout to
measure it the same way) with its own caches, warms it with one call, then plays, within about a
minute:

* **the students** (``--students``, default 200): each arrives at a random moment of the first
  ``--arrive-s`` seconds and does what the page does (read from the app's ``/config``, as a browser
  sends it): loads the page (``GET /``, its heartbeat stream, the page-load picture of the Try tab),
  opens the Learn tab (its first data), moves T (computed in the page: no request) and releases it
  (the table and text of the settled T, where the page still asks the server for them), a few
  seconds apart. Each student has an address of its own (127.0.N.M: Linux routes all of 127/8 to the
  loopback) or, in the one-address room, all share 127.0.0.2;
* **the API clients** (the ``api`` rooms): the same number of visitors each make 3 calls of
  ``/explore_temperature`` at T on the slider's grid (0.5 to 3.0 in steps of 0.01), from an address
  each (one-off calls, ``/gradio_api/call``), or all from one address through one session each (as
  ``gradio_client`` does: a heartbeat, then ``/queue/join``);
* **the backlog**: 4 other addresses each send ``--runs`` Calibrate runs (the app's default settings)
  at the start and another whenever one of theirs ends; the refusals past the per-address cap are
  counted apart;
* **the newcomer**: ``--newcomer-s`` seconds in, a fifth address presses Run once: the bench records
  how long it waits for its run to start.

Latency is from a call's join to its last message (the page's event stream); a page load counts from
``GET /`` to the Try tab's first picture. Refused: an HTTP error on joining or loading, or a call that
ends in an error. Writes ``bench/results/lecture.md`` and ``.json`` (``--out``), naming the commit, the
torch version and the machine's load; timings taken on a shared machine are noisy: compare rooms of
one run, not runs. Not a test: nothing here asserts a time.

    python -m bench.lecture                                   # this checkout, 4 rooms, about 10 minutes
    python -m bench.lecture --repo /path/to/main --out bench/results/lecture-before   # another checkout
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

from bench.hostile_session import Server

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("pages", "pages-one-address", "api", "api-one-address")
#: The flooding addresses and the newcomer's.
BACKLOG = [f"127.0.1.{i}" for i in range(1, 5)]
NEWCOMER = "127.0.2.1"
ONE_ADDRESS = "127.0.0.2"


def address(i: int) -> str:
    """The i-th student's own loopback address (127.0.3.1 onwards)."""
    return f"127.0.{3 + (i // 250)}.{1 + i % 250}"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * len(v) + 0.5) - 1))]


class App:
    """What the bench needs of the launched app's /config: the page's events by what triggers them."""

    def __init__(self, config: dict):
        self.config = config
        by_id = {c["id"]: c for c in config["components"]}
        self.deps = config["dependencies"]

        def find(test) -> dict | None:
            return next((d for d in self.deps if d.get("backend_fn") and test(d)), None)

        def elem(d, name, trigger):
            return any(t[1] == trigger and by_id.get(t[0], {}).get("props", {}).get("elem_id") == name
                       for t in d["targets"])

        self.load = find(lambda d: any(t[1] == "load" for t in d["targets"]))
        self.first_view = find(lambda d: elem(d, "learn-view", "first_view"))
        self.release = find(lambda d: elem(d, "learn-view", "release"))
        self.explore = find(lambda d: d.get("api_name") == "explore_temperature")
        self.calibrate = find(lambda d: d.get("api_name") == "calibrate")
        self.by_id = by_id

    def values(self, dep: dict) -> list:
        """The inputs' values as the page sends them on load: each component's value, a state null."""
        return [None if self.by_id[i]["type"] == "state" else self.by_id[i].get("props", {}).get("value")
                for i in dep["inputs"]]


class Visitor:
    """One browser page (or gradio_client) from one address: a session, its heartbeat, its calls."""

    def __init__(self, url: str, where: str, log: list):
        self.http = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=60),
                                      transport=httpx.AsyncHTTPTransport(local_address=where),
                                      limits=httpx.Limits(max_connections=8, max_keepalive_connections=4,
                                                          keepalive_expiry=1.0))  # under the server's 5 s
        self.where, self.log = where, log
        self.session = uuid.uuid4().hex[:11]
        self.heartbeat: asyncio.Task | None = None

    async def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.cancel()
        await self.http.aclose()

    def open_heartbeat(self) -> None:
        async def beat():
            try:
                async with self.http.stream("GET", f"/gradio_api/heartbeat/{self.session}") as r:
                    async for _ in r.aiter_lines():
                        pass
            except (httpx.HTTPError, asyncio.CancelledError):
                pass
        self.heartbeat = asyncio.create_task(beat())

    def record(self, kind: str, started: float, outcome: str, **more) -> dict:
        row = {"kind": kind, "where": self.where, "start": started, "seconds": time.monotonic() - started,
               "outcome": outcome, **more}
        self.log.append(row)
        return row

    async def page(self) -> str:
        """``GET /``: the page with the app's configuration."""
        started = time.monotonic()
        try:
            r = await self.http.get("/")
        except httpx.HTTPError as e:
            return self.record("page HTML", started, f"failed: {type(e).__name__}")["outcome"]
        return self.record("page HTML", started, "ok" if r.status_code == 200 else f"HTTP {r.status_code}")["outcome"]

    async def call(self, kind: str, dep: dict, data: list, event_data: dict | None = None,
                   started: float | None = None, until: str = "process_completed") -> dict:
        """Join the queue as the page does and read the session's stream until the call's last message
        (``until="process_starts"``: until it starts); the row logged, with the last message's output
        and text (not logged) when it completed."""
        started = time.monotonic() if started is None else started
        body = {"data": data, "event_data": event_data, "fn_index": dep["id"], "trigger_id": None,
                "session_hash": self.session}
        try:
            r = await self.http.post("/gradio_api/queue/join", json=body)
            if r.status_code != 200:
                return self.record(kind, started, f"HTTP {r.status_code}", detail=r.text[:200])
            event = r.json()["event_id"]
            async with self.http.stream("GET", f"/gradio_api/queue/data?session_hash={self.session}") as s:
                async for line in s.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    msg = json.loads(line[6:])
                    if msg.get("event_id") != event:
                        continue
                    if msg.get("msg") == until == "process_starts":
                        return self.record(kind, started, "ok")
                    if msg.get("msg") == "process_completed":
                        ok = msg.get("success")
                        row = self.record(kind, started, "ok" if ok else "error",
                                          detail=None if ok else str(msg.get("output", {}).get("error"))[:200])
                        return dict(row, output=msg.get("output"), text=line)
            return self.record(kind, started, "no answer")
        except httpx.HTTPError as e:
            return self.record(kind, started, f"failed: {type(e).__name__}")

    async def one_off(self, kind: str, api: str, data: list) -> dict:
        """An API call without a session: ``POST /gradio_api/call/<api>``, then its result."""
        started = time.monotonic()
        try:
            r = await self.http.post(f"/gradio_api/call/{api}", json={"data": data})
            if r.status_code != 200:
                return self.record(kind, started, f"HTTP {r.status_code}", detail=r.text[:200])
            event = None
            async with self.http.stream("GET", f"/gradio_api/call/{api}/{r.json()['event_id']}") as s:
                async for line in s.aiter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: ") and event in ("complete", "error"):
                        return self.record(kind, started, "ok" if event == "complete" else "error",
                                           detail=None if event == "complete" else line[6:200])
            return self.record(kind, started, "no answer")
        except httpx.HTTPError as e:
            return self.record(kind, started, f"failed: {type(e).__name__}")


# --------------------------------------------------------------------------- the people in the room


async def student(app: App, url: str, where: str, log: list, rng: random.Random, arrive_s: float) -> None:
    await asyncio.sleep(rng.uniform(0, arrive_s))
    v = Visitor(url, where, log)
    try:
        started = time.monotonic()
        if await v.page() != "ok":
            return
        v.open_heartbeat()
        await v.call("page load (to the first picture)", app.load, app.values(app.load), started=started)
        await asyncio.sleep(rng.uniform(2, 6))  # reads, then opens the Learn tab
        await v.call("Learn first view", app.first_view, [None], {})
        await asyncio.sleep(rng.uniform(2, 6))  # moves T: drawn in the page, no request
        if app.release is not None:
            t = round(rng.uniform(0.5, 3.0), 2)
            await v.call("release T", app.release, [None], {"temperature": t, "bins": 15})
    finally:
        await v.close()


async def api_client(app: App, url: str, where: str, log: list, rng: random.Random, arrive_s: float,
                     session: bool) -> None:
    await asyncio.sleep(rng.uniform(0, arrive_s))
    v = Visitor(url, where, log)
    try:
        if session:
            v.open_heartbeat()
        for _ in range(3):
            data = [round(rng.uniform(0.5, 3.0), 2), 15]
            if session:
                await v.call("explore_temperature", app.explore, data + [None])
            else:
                await v.one_off("explore_temperature", "explore_temperature", data)
            await asyncio.sleep(rng.uniform(2, 6))
    finally:
        await v.close()


async def flooder(app: App, url: str, where: str, log: list, runs: int, stop: asyncio.Event, data: list) -> None:
    """Sends ``runs`` runs at once, then one more whenever one of its own ends, until ``stop``."""
    v = Visitor(url, where, log)

    async def one():
        while not stop.is_set():
            row = await v.one_off("backlog run", "calibrate", data)
            if row["outcome"].startswith("HTTP"):
                await asyncio.sleep(5)  # refused past the cap: try again a little later

    try:
        await asyncio.gather(*[one() for _ in range(runs)])
    finally:
        await v.close()


async def newcomer(app: App, url: str, log: list, after_s: float, data: list, wait_s: float) -> None:
    await asyncio.sleep(after_s)
    v = Visitor(url, NEWCOMER, log)
    try:
        v.open_heartbeat()
        await asyncio.wait_for(v.call("newcomer's run starts", app.calibrate, data, until="process_starts"), wait_s)
    except asyncio.TimeoutError:
        v.record("newcomer's run starts", time.monotonic() - wait_s, f"not started within {wait_s:g} s")
    finally:
        await v.close()


def run_values(app: App, size: int) -> list:
    """A Calibrate run as the page sends it with its default settings, at ``size`` calibration images."""
    data = app.values(app.calibrate)
    at = next(i for i, c in enumerate(app.calibrate["inputs"])
              if app.by_id[c].get("props", {}).get("elem_id") == "calibration-size")
    data[at] = size
    return data


async def room(kind: str, url: str, args: argparse.Namespace) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        app = App((await http.get("/config")).json())
    log: list[dict] = []
    rng = random.Random(args.seed)
    stop = asyncio.Event()
    run = run_values(app, args.run_size)
    backlog = [asyncio.create_task(flooder(app, url, where, log, args.runs, stop, run)) for where in BACKLOG]
    await asyncio.sleep(2)  # the backlog is queued before the room arrives
    one = kind.endswith("one-address")
    people = []
    for i in range(args.students):
        where = ONE_ADDRESS if one else address(i)
        seeded = random.Random(rng.random())
        if kind.startswith("pages"):
            people.append(student(app, url, where, log, seeded, args.arrive_s))
        else:
            people.append(api_client(app, url, where, log, seeded, args.arrive_s, session=one))
    people.append(newcomer(app, url, log, args.newcomer_s, run, args.newcomer_wait_s))
    await asyncio.gather(*people)
    stop.set()
    for task in backlog:
        task.cancel()
    await asyncio.gather(*backlog, return_exceptions=True)
    return log


# --------------------------------------------------------------------------- figures


def summary(log: list[dict], wall_s: float) -> dict:
    light = [r for r in log if r["kind"] not in ("backlog run", "newcomer's run starts")]
    served = [r["seconds"] for r in light if r["outcome"] == "ok"]
    kinds = {}
    for kind in dict.fromkeys(r["kind"] for r in light):
        rows = [r for r in light if r["kind"] == kind]
        ok = [r["seconds"] for r in rows if r["outcome"] == "ok"]
        kinds[kind] = {"calls": len(rows), "served": len(ok), "p50_s": percentile(ok, 50), "p95_s": percentile(ok, 95),
                       "max_s": max(ok, default=None)}
    backlog = [r for r in log if r["kind"] == "backlog run"]
    done = sorted(r["seconds"] for r in backlog if r["outcome"] in ("ok", "error"))
    new = [r for r in log if r["kind"] == "newcomer's run starts"]
    # The runs that ended while the newcomer waited: how many it waited for, whatever their length.
    ahead = None if not new else sum(new[0]["start"] < r["start"] + r["seconds"] < new[0]["start"] + new[0]["seconds"]
                                     for r in backlog if r["outcome"] in ("ok", "error"))
    return {
        "wall_s": wall_s,
        "light_calls": len(light), "served": len(served),
        "refused": dict(Counter(r["outcome"] for r in light if r["outcome"] != "ok")),
        "refusals": sorted({r["detail"] for r in light if r["outcome"] != "ok" and r.get("detail")})[:5],
        "p50_s": percentile(served, 50), "p95_s": percentile(served, 95), "max_s": max(served, default=None),
        "by_kind": kinds,
        "backlog": {"runs_done": len(done), "run_p50_s": percentile(done, 50),
                    "refused": sum(r["outcome"].startswith("HTTP") for r in backlog),
                    "refusal": next((r.get("detail") for r in backlog if r["outcome"].startswith("HTTP")), None)},
        "newcomer_wait_s": new[0]["seconds"] if new and new[0]["outcome"] == "ok" else None,
        "newcomer_outcome": new[0]["outcome"] if new else "not measured",
        "newcomer_waited_for_runs": ahead,
    }


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def markdown(report: dict) -> str:
    run = report["run"]
    lines = [f"# Lecture hall on loopback ({run['repo_name']} at {run['commit']}{' (changed)' if run['dirty'] else ''})",
             "",
             f"torch {run['torch']}, gradio {run['gradio']}, {run['cpus']} CPUs, Python {run['python']}; load average "
             f"{run['load_start']:.1f} at the start, {run['load_end']:.1f} at the end. {run['students']} visitors per "
             f"room arriving within {run['arrive_s']:g} s, 4 addresses × {run['runs']} Calibrate runs (the page's "
             f"defaults at {run['run_size']:,} calibration images) kept queued, a newcomer from a fifth address at {run['newcomer_s']:g} s. "
             f"`python -m bench.lecture {' '.join(run['argv'])}`.",
             "",
             "| room | light calls | served | refused | p50 s | p95 s | max s | newcomer waits s (runs ended meanwhile) | "
             "backlog runs done (p50 s each) | backlog refusals (re-sent every 5 s) | server CPU s | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["rooms"].items():
        s = r["summary"]
        refused = ", ".join(f"{k}: {v}" for k, v in s["refused"].items()) or "0"
        wait = _fmt(s["newcomer_wait_s"]) if s["newcomer_wait_s"] is not None else s["newcomer_outcome"]
        lines.append(f"| {name} | {s['light_calls']} | {s['served']} | {refused} | {_fmt(s['p50_s'])} | "
                     f"{_fmt(s['p95_s'])} | {_fmt(s['max_s'])} | {wait} ({s['newcomer_waited_for_runs']}) | "
                     f"{s['backlog']['runs_done']} ({_fmt(s['backlog']['run_p50_s'])}) | "
                     f"{s['backlog']['refused']} | {r['server']['cpu_s']:.0f} | {r['server']['hwm_mb']} |")
    lines += ["", "Refused: an HTTP refusal, or (failed: …) a connection the client saw dropped without an answer."]
    lines += _machine(report)
    lines += ["", "Per kind of call (p50 / p95 / max in seconds, served of calls):", ""]
    for name, r in report["rooms"].items():
        parts = [f"{k} {_fmt(v['p50_s'])} / {_fmt(v['p95_s'])} / {_fmt(v['max_s'])} ({v['served']} of {v['calls']})"
                 for k, v in r["summary"]["by_kind"].items()]
        lines.append(f"- **{name}**: " + "; ".join(parts))
    refusals = {name: [t for t in r["summary"]["refusals"] if t] for name, r in report["rooms"].items()}
    refusals = {name: texts for name, texts in refusals.items() if texts}
    if refusals:
        lines += ["", "What the refused calls were told (first of each room):", ""]
        lines += [f"- {name}: {texts[0]}" for name, texts in refusals.items()]
    backlog = next((r["summary"]["backlog"]["refusal"] for r in report["rooms"].values()
                    if r["summary"]["backlog"]["refusal"]), None)
    if backlog:
        lines += ["", f"A backlog run past the cap was told: {backlog}"]
    return "\n".join(lines) + "\n"


def _machine(report: dict) -> list[str]:
    """The machine during each room: its load, the CPU seconds the server, the bench and every other
    process took, and the room's p95 scaled by the share of the busy cores the room had (the server
    and its clients): an estimate of the p95 on cores the room had to itself."""
    rooms = {n: r for n, r in report["rooms"].items() if "machine" in r}
    if not rooms:
        return []
    lines = ["", "The machine during each room (CPU seconds; the cores offered 2 × the room's seconds):", "",
             "| room | load average start → end | room s | cores busy s | server s | bench s | other processes s | "
             "room's share of the busy cores | p95 × share s (estimate, cores to itself) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rooms.items():
        m, p95 = r["machine"], r["summary"]["p95_s"]
        share = (r["server"]["cpu_s"] + m["bench_s"]) / m["busy_s"] if m["busy_s"] > 0 else None
        scaled = "—" if share is None or p95 is None else f"{p95 * share:.2f}"
        lines.append(f"| {name} | {m['load_start']:.1f} → {m['load_end']:.1f} | {m['wall_s']:.0f} | {m['busy_s']:.0f} | "
                     f"{r['server']['cpu_s']:.0f} | {m['bench_s']:.0f} | {m['others_s']:.0f} | "
                     f"{'—' if share is None else f'{100 * share:.0f} %'} | {scaled} |")
    return lines


def machine_cpu_s() -> dict[str, float]:
    """CPU seconds so far: the whole machine's busy time (every core, /proc/stat) and this process's own."""
    import resource

    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait
    me = resource.getrusage(resource.RUSAGE_SELF)
    return {"busy": busy / os.sysconf("SC_CLK_TCK"), "bench": me.ru_utime + me.ru_stime}


def _git(repo: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if len(argv) == 2 and argv[0] == "--render":  # report.md again from its .json (after a change of layout)
        path = Path(argv[1])
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose app.py is measured")
    p.add_argument("--rooms", nargs="+", choices=ROOMS, default=list(ROOMS))
    p.add_argument("--students", type=int, default=200)
    p.add_argument("--arrive-s", type=float, default=30.0, help="the students arrive within this many seconds")
    p.add_argument("--runs", type=int, default=8, help="Calibrate runs each backlog address keeps sending")
    p.add_argument("--run-size", type=int, default=5000,
                   help="calibration images of each run (the app's default 5000; the rest as the page's defaults)")
    p.add_argument("--newcomer-wait-s", type=float, default=300.0, help="longest the bench waits for the newcomer")
    p.add_argument("--newcomer-s", type=float, default=20.0, help="when the newcomer presses Run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lecture")
    a = p.parse_args(argv)
    import gradio
    import torch

    repo = a.repo.resolve()
    report = {"run": {"repo_name": repo.name, "commit": _git(repo, "rev-parse", "--short", "HEAD"),
                      "dirty": bool(_git(repo, "status", "--porcelain")), "torch": torch.__version__,
                      "gradio": gradio.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                      "load_start": os.getloadavg()[0], "students": a.students, "arrive_s": a.arrive_s, "runs": a.runs,
                      "run_size": a.run_size,
                      "newcomer_s": a.newcomer_s, "argv": argv},
              "rooms": {}}
    for kind in a.rooms:
        with tempfile.TemporaryDirectory() as tmp:
            server = Server(repo, Path(tmp))
            try:
                warm = httpx.post(server.url + "/gradio_api/call/explore_temperature", json={"data": [1.0, 15]},
                                  timeout=120)
                httpx.get(server.url + f"/gradio_api/call/explore_temperature/{warm.json()['event_id']}", timeout=120)
                before, machine, load = server.reading(), machine_cpu_s(), os.getloadavg()[0]
                started = time.monotonic()
                log = asyncio.run(room(kind, server.url, a))
                wall = time.monotonic() - started
                after, machine = server.reading(), {k: v2 - machine[k] for k, v2 in machine_cpu_s().items()}
            finally:
                server.stop()
        s = summary(log, wall)
        cpu = after["cpu_s"] - before["cpu_s"]
        report["rooms"][kind] = {"summary": s, "server": {"cpu_s": cpu, "hwm_mb": after["hwm_mb"]},
                                 "machine": {"load_start": load, "load_end": os.getloadavg()[0], "wall_s": wall,
                                             "busy_s": machine["busy"], "bench_s": machine["bench"],
                                             "others_s": machine["busy"] - machine["bench"] - cpu}}
        print(f"{kind}: {json.dumps(s)}", flush=True)
    report["run"]["load_end"] = os.getloadavg()[0]
    write(a.out, report, markdown)


def write(out: Path, report: dict, render) -> None:
    """``report`` as ``out``.json and, as ``render`` writes it, ``out``.md (printed too)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(report))
    print(render(report))


if __name__ == "__main__":
    main()
