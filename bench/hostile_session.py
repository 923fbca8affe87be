"""``python -m bench.hostile_session``: a long hostile session against the launched app, replayed
the same way on any checkout, with the server's memory and CPU read from /proc after each step.

It launches ``python app.py`` offline from ``--repo`` (default: this checkout) on a free port, with
its own Gradio cache folder, warms it with one ordinary picture, then plays, from one address
(127.0.0.1) unless said otherwise:

1. ``explore_temperature``: ``--calls`` calls (default 100) whose temperature is a list of numbers
   of ``--mb`` MB (default 12) of JSON; then waits ``--settle`` seconds and reads the memory again;
   then as many whose temperature is a list of 9,990 distinct strings of 1,000 characters (10 MB,
   within the app's caps on text and values), and waits again;
2. inline pictures: ``--pictures`` calls of ``classify`` with a ``data:`` PNG of about ``--mb`` MB
   (noise, so that it does not compress);
3. ``data:`` strings and odd JSON spellings: a 5,000,000-character model name that begins with
   ``data:``, and a 100,000-character γ sent as ``Application/JSON``, ``application/vnd.x+json``
   and with no content type;
4. a drawing of 20,000 layers that all point at one small upload;
5. queue flooding: a run holds the heavy slot (from 127.0.0.3), 40 runs are sent from 127.0.0.1,
   then one from 127.0.0.2.

Each step records the server's resident memory (VmRSS) and its peak (VmHWM) in MB, its own CPU
seconds (user + system), the bytes in Gradio's cache folder, the wall time and the answers' status
codes. Writes a JSON report (``--out``) and prints a Markdown table. Linux only (reads /proc).

    python -m bench.hostile_session                       # this checkout
    python -m bench.hostile_session --repo /tmp/base --out bench/results/hostile-base.json
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- the server


class Server:
    """``python app.py`` from ``repo``, and what /proc says about it."""

    def __init__(self, repo: Path, tmp: Path, extra_env: dict | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.cache = tmp / "gradio"
        env = dict(os.environ, PORT=str(port), GRADIO_SERVER_NAME="127.0.0.1", NCTV_CACHE_DIR=str(tmp / "cache"),
                   HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", MPLCONFIGDIR=str(tmp / "mpl"),
                   GRADIO_TEMP_DIR=str(self.cache), PYTHONPATH=str(repo), **(extra_env or {}))
        self.log = tmp / "server.log"
        self.proc = subprocess.Popen([sys.executable, "app.py"], cwd=repo, env=env, stdout=self.log.open("wb"),
                                     stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("app.py did not start:\n" + self.log.read_text()[-3000:])
            try:
                if httpx.get(self.url + "/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        self.clients = {}

    def client(self, address: str = "127.0.0.1") -> httpx.Client:
        """A client whose connections leave from ``address`` (Linux routes all of 127/8 to lo)."""
        if address not in self.clients:
            self.clients[address] = httpx.Client(base_url=self.url, timeout=600,
                                                 transport=httpx.HTTPTransport(local_address=address))
        return self.clients[address]

    def stop(self) -> None:
        for c in self.clients.values():
            c.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def status(self, field: str) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise KeyError(field)

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def cache_mb(self) -> float:
        return sum(p.stat().st_size for p in self.cache.rglob("*") if p.is_file()) / 2**20 if self.cache.exists() else 0

    def reading(self) -> dict:
        return {"rss_mb": round(self.status("VmRSS")), "hwm_mb": round(self.status("VmHWM")),
                "cpu_s": round(self.cpu_seconds(), 1), "cache_mb": round(self.cache_mb(), 1)}

    # ----------------------------------------------------------------------- calls

    def join(self, api: str, body: bytes | dict, address: str = "127.0.0.1", content_type: str | None = "json"):
        """POST /gradio_api/call/<api>: (status code, event id or the refusal's text)."""
        headers = {}
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        if content_type == "json":
            headers["content-type"] = "application/json"
        elif content_type is not None:
            headers["content-type"] = content_type
        r = self.client(address).post(f"/gradio_api/call/{api}", content=body, headers=headers)
        if r.status_code == 200:
            return 200, r.json()["event_id"]
        return r.status_code, r.text[:200]

    def result(self, api: str, event_id: str, address: str = "127.0.0.1") -> str:
        """The kind of the call's last event: complete or error."""
        kind = "none"
        with self.client(address).stream("GET", f"/gradio_api/call/{api}/{event_id}") as s:
            for line in s.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                    if kind in ("complete", "error"):
                        break
        return kind

    def call(self, api: str, body: bytes | dict, address: str = "127.0.0.1") -> str:
        code, out = self.join(api, body, address)
        return self.result(api, out, address) if code == 200 else f"HTTP {code}"

    def upload(self, name: str, data: bytes) -> str:
        r = self.client().post("/gradio_api/upload", files=[("files", (name, data, "image/png"))])
        r.raise_for_status()
        return r.json()[0]


def _available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


# --------------------------------------------------------------------------- crafted requests


def numbers_json(mb: float, seed: int) -> bytes:
    """A JSON list of distinct floats, ``mb`` MB long (each a separate object once parsed)."""
    rng = random.Random(seed)
    n = int(mb * 1e6 / 20)
    return ("[" + ",".join(f"{rng.random():.17f}" for _ in range(n)) + "]").encode()


def png(width: int, height: int, seed: int = 0) -> bytes:
    """An RGB PNG of noise (it does not compress: about 3 bytes a pixel)."""
    rng = random.Random(seed)
    raw = b"".join(b"\0" + rng.randbytes(width * 3) for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b""))


def file_data(path: str) -> dict:
    return {"path": path, "orig_name": "p.png", "meta": {"_type": "gradio.FileData"}}


def calibrate_data(gamma: str = "1", model: str | None = None, fitter: str = "fast", epochs: int = 10,
                   size: int = 20) -> list:
    from nctv.zoo import DEFAULT_MODEL

    return [model or DEFAULT_MODEL, "", "model's own dataset", size, size, 0, 5, ["Neural Clamping (FL)"], gamma,
            "default", "random", fitter, epochs, "default"]


# --------------------------------------------------------------------------- the session


def session(repo: Path, calls: int, mb: float, pictures: int, settle: float, flood: int) -> dict:
    steps = []
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(repo, Path(tmp))
        try:
            def step(name: str, started: float, answers, reading_before: dict):
                row = {"step": name, "wall_s": round(time.monotonic() - started, 1), **server.reading(),
                       "cpu_step_s": round(server.cpu_seconds() - reading_before["cpu_s"], 1),
                       "answers": dict(Counter(answers))}
                steps.append(row)
                print(json.dumps(row), flush=True)

            small = png(28, 28)
            kind = server.call("classify", {"data": [{"url": "data:image/png;base64," + base64.b64encode(small).decode(),
                                                      "meta": {"_type": "gradio.FileData"}}, "gaussian-noise", 0]})
            kind2 = server.call("explore_temperature", {"data": [1.5, 10]})
            time.sleep(settle)
            t, r0 = time.monotonic(), server.reading()
            step("warm (one picture, one explore_temperature)", t, [kind, kind2], r0)

            t, r0 = time.monotonic(), server.reading()
            answers = []
            for i in range(calls):
                if _available_mb() < 3000:  # the server would take this machine's last memory
                    answers.append("stopped: under 3 GB of memory left")
                    break
                body = b'{"data": [' + numbers_json(mb, i) + b", 10]}"
                answers.append(server.call("explore_temperature", body))
            step(f"explore_temperature × {calls}, {mb:g} MB lists", t, answers, r0)
            t, r0 = time.monotonic(), server.reading()
            time.sleep(settle)
            step(f"… {settle:g} s later", t, [], r0)

            t, r0 = time.monotonic(), server.reading()
            answers = []
            for i in range(calls):
                if _available_mb() < 3000:
                    answers.append("stopped: under 3 GB of memory left")
                    break
                strings = ",".join(f'"{i:05d}{j:05d}' + "x" * 990 + '"' for j in range(9_990))
                answers.append(server.call("explore_temperature", ('{"data": [[' + strings + '], 10]}').encode()))
            step(f"explore_temperature × {calls}, 9,990 strings of 1,000 characters (10 MB)", t, answers, r0)
            t, r0 = time.monotonic(), server.reading()
            time.sleep(settle)
            step(f"… {settle:g} s later", t, [], r0)

            side = int((mb * 1e6 / 3) ** 0.5)
            t, r0 = time.monotonic(), server.reading()
            answers = []
            for i in range(pictures):
                url = "data:image/png;base64," + base64.b64encode(png(side, side, seed=i)).decode()
                answers.append(server.call("classify", {"data": [{"url": url, "meta": {"_type": "gradio.FileData"}},
                                                                 "gaussian-noise", 0]}))
            time.sleep(settle)
            step(f"inline pictures × {pictures}, {side}×{side} noise PNG", t, answers, r0)

            t, r0 = time.monotonic(), server.reading()
            answers = [f"data: name {server.join('calibrate', {'data': calibrate_data(model='data:' + 'x' * 5_000_000)})[0]}"]
            long_gamma = {"data": calibrate_data(gamma="2" * 100_000)}
            for spelling in ("Application/JSON", "application/vnd.x+json", "application/json; charset=utf-8", None):
                answers.append(f"{spelling} {server.join('calibrate', long_gamma, content_type=spelling)[0]}")
            time.sleep(settle)
            step("data: string of 5,000,000 characters; 100,000-character γ in 4 spellings", t, answers, r0)

            t, r0 = time.monotonic(), server.reading()
            path = server.upload("layer.png", png(64, 64))
            drawing = {"background": None, "layers": [file_data(path)] * 20_000, "composite": file_data(path),
                       "id": None}
            answers = [server.call("classify_drawing", {"data": [drawing, "gaussian-noise", 0]})]
            step("drawing of 20,000 layers on one upload", t, answers, r0)

            t, r0 = time.monotonic(), server.reading()
            holder = server.join("calibrate", {"data": calibrate_data(fitter="paper", epochs=100, size=2000)},
                                 address="127.0.0.3")
            time.sleep(1)
            answers = [f"flooder {server.join('calibrate', {'data': calibrate_data(gamma='x')})[0]}"
                       for _ in range(flood)]
            answers.append(f"other address {server.join('calibrate', {'data': calibrate_data(gamma='x')}, '127.0.0.2')[0]}")
            step(f"queue: one run holds the slot, {flood} runs from one address, then one from another", t,
                 answers + [f"holder {holder[0]}"], r0)
        finally:
            server.stop()
    return {"repo": str(repo), "calls": calls, "mb": mb, "pictures": pictures, "steps": steps}


def markdown(report: dict) -> str:
    lines = ["| step | RSS MB | peak MB | CPU s (step) | cache MB | wall s | answers |", "|---|---|---|---|---|---|---|"]
    for s in report["steps"]:
        answers = ", ".join(f"{k}: {v}" for k, v in s["answers"].items())
        lines.append(f"| {s['step']} | {s['rss_mb']} | {s['hwm_mb']} | {s['cpu_step_s']} | {s['cache_mb']} | "
                     f"{s['wall_s']} | {answers} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose app.py is attacked")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--mb", type=float, default=12.0, help="size of each list and picture, in MB")
    p.add_argument("--pictures", type=int, default=30)
    p.add_argument("--settle", type=float, default=30.0, help="seconds to wait before reading the memory again")
    p.add_argument("--flood", type=int, default=40)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hostile-session.json")
    a = p.parse_args(argv)
    report = session(a.repo.resolve(), a.calls, a.mb, a.pictures, a.settle, a.flood)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
