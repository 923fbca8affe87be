"""The launched app (``python app.py``) attacked through its HTTP API, as anyone on the internet can:
crafted pictures (many pixels in a small file, 16-bit channels, a compressed-text bomb, inline data
URLs), bodies over the cap (declared and streamed), and a huge text value. Each is refused with the
app's own short message and no server path, and the server's memory stays near where it was
(measured from /proc: the peak resident size during the request against the size before it).

The pictures are written chunk by chunk (zlib over rows of zeros), so the test itself stays small.
"""
import base64
import json
import os
import random
import struct
import sys
import time
import zlib
from pathlib import Path

import httpx
import pytest

from conftest import start_app, stop_app

from nctv.ui.try_image import DEFAULT_CORRUPTION

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's memory from /proc")

#: The server may grow by at most this much while refusing a crafted request.
MEMORY_SLACK = 300 * 2**20
#: A per-visitor upload budget small enough to reach in a test.
BUDGET = 6 * 2**20
#: Runs one address may keep waiting in the queue (``NCTV_RUNS_PER_ADDRESS``'s default).
RUNS = 3


# --------------------------------------------------------------------------- crafted files


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width: int, height: int, bit_depth: int = 8, colour: int = 2, before_pixels: bytes = b"") -> bytes:
    """A valid black PNG (colour type 0 grey, 2 RGB, 6 RGBA), compressed a row at a time."""
    channels = {0: 1, 2: 3, 6: 4}[colour]
    row = b"\0" + bytes(width * channels * bit_depth // 8)
    z = zlib.compressobj(9)
    pixels = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, bit_depth, colour, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + before_pixels + _chunk(b"IDAT", pixels)
            + _chunk(b"IEND", b""))


def noise_png(width: int, height: int) -> bytes:
    """An RGB PNG of noise: about 3 bytes a pixel, as compression cannot shrink it."""
    rng = random.Random(width)
    z = zlib.compressobj(1)
    pixels = b"".join(z.compress(b"\0" + rng.randbytes(width * 3)) for _ in range(height)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", pixels) + _chunk(b"IEND", b"")


def ztxt_bomb(inflated: int = 256 * 2**20) -> bytes:
    """A zTXt chunk whose text inflates to ``inflated`` bytes (of zeros)."""
    z = zlib.compressobj(9)
    block = bytes(2**20)
    text = b"".join(z.compress(block) for _ in range(inflated // len(block))) + z.flush()
    return _chunk(b"zTXt", b"Comment\0\0" + text)


@pytest.fixture(scope="module")
def files():
    return {
        "79 MP": png(8900, 8900, 8, 2),  # 79.2 megapixels, RGB, under PIL's own refusal (80 MP)
        "16-bit RGBA": png(6300, 6300, 16, 6),  # 39.7 megapixels, 8 bytes a pixel
        "text bomb": png(28, 28, 8, 0, before_pixels=ztxt_bomb()),
        "small": png(28, 28, 8, 0),
    }


# --------------------------------------------------------------------------- the server and its memory


class Server:
    def __init__(self, proc, url: str):
        self.proc, self.url = proc, url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=300)
        self.clients = {"127.0.0.1": self.http}

    def client(self, address: str) -> httpx.Client:
        """A client whose connections leave from ``address``: Linux routes all of 127/8 to lo, so the
        server sees another visitor."""
        if address not in self.clients:
            self.clients[address] = httpx.Client(base_url=self.url, timeout=300,
                                                 transport=httpx.HTTPTransport(local_address=address))
        return self.clients[address]

    def _status(self, field: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def growth(self, attack):
        """(what ``attack()`` returned, peak resident bytes during it above the resident size before)."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")  # the peak starts again from now
        before = self._status("VmRSS")
        out = attack()
        return out, self._status("VmHWM") - before

    def upload(self, name: str, data: bytes) -> str:
        r = self.http.post("/gradio_api/upload", files=[("files", (name, data, "image/png"))])
        assert r.status_code == 200, r.text
        return r.json()[0]

    def call(self, api: str, data: list | bytes, address: str = "127.0.0.1") -> tuple[str, object]:
        """("complete", outputs) or ("error", message) of one API call (``data``: the inputs, or the
        body's bytes); an HTTP refusal raises. A picture alone is sent with the Try tab's other two
        inputs at their defaults (no corruption: severity 0)."""
        if api in ("classify", "classify_drawing") and len(data) == 1:
            data = data + [DEFAULT_CORRUPTION, 0]
        http = self.client(address)
        body = data if isinstance(data, bytes) else json.dumps({"data": data}).encode()
        r = http.post(f"/gradio_api/call/{api}", content=body, headers={"content-type": "application/json"})
        r.raise_for_status()
        with http.stream("GET", f"/gradio_api/call/{api}/{r.json()['event_id']}") as s:
            event = None
            for line in s.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event in ("complete", "error"):
                    payload = json.loads(line[6:])
                    return event, payload["error"] if event == "error" else payload
        raise AssertionError("the call ended without a result")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    saved = os.environ.get("NCTV_UPLOAD_BUDGET_BYTES")
    os.environ["NCTV_UPLOAD_BUDGET_BYTES"] = str(BUDGET)
    try:
        proc, url = start_app(tmp)
    finally:
        os.environ.pop("NCTV_UPLOAD_BUDGET_BYTES")
        if saved is not None:
            os.environ["NCTV_UPLOAD_BUDGET_BYTES"] = saved
    server = Server(proc, url)
    try:
        # A picture that works first: the model, its logits and the out-of-distribution check are then
        # loaded, so what follows measures only the attack.
        kind, out = server.call("classify", [_file(server.upload("ok.png", png(28, 28, 8, 0)))])
        assert kind == "complete" and "nctv-verdict" in out[0] and "The model's answer" in out[1], out
        yield server
    finally:  # the server stops even when the first picture fails
        for http in server.clients.values():
            http.close()
        stop_app(proc)


def _file(path: str, name: str = "picture.png") -> dict:
    return {"path": path, "orig_name": name, "meta": {"_type": "gradio.FileData"}}


def _inline(data: bytes) -> dict:
    return {"url": "data:image/png;base64," + base64.b64encode(data).decode(), "meta": {"_type": "gradio.FileData"}}


def _drawing(path: str) -> dict:
    return {"background": _file(path), "layers": [], "composite": _file(path), "id": None}


def _clean(message: str) -> None:
    """A short message of the app's, naming no server folder."""
    assert len(message) <= 300, message
    for folder in ("/tmp", "/home", "/root", "/work", "gradio", str(Path.home())):
        assert folder not in message, message


# --------------------------------------------------------------------------- pictures


@pytest.mark.parametrize("route", ["upload", "inline", "drawing"])
def test_many_pixels_in_a_small_file_are_refused_from_the_header(app, files, route):
    data = files["79 MP"]
    assert len(data) < 1_000_000  # a small file …
    if route == "drawing":
        (kind, message), grew = app.growth(lambda: app.call("classify_drawing", [_drawing(app.upload("d.png", data))]))
    else:
        value = _file(app.upload("big.png", data)) if route == "upload" else _inline(data)
        (kind, message), grew = app.growth(lambda: app.call("classify", [value]))
    assert kind == "error" and "8900 × 8900 pixels (79 megapixels)" in message and "at most 40" in message
    _clean(message)
    assert grew < MEMORY_SLACK  # … that decodes to 238 MB, and Gradio's decoding cost a gigabyte


def test_a_16_bit_rgba_picture_is_measured_in_bytes_not_pixels(app, files):
    data = files["16-bit RGBA"]
    path = app.upload("deep.png", data)
    (kind, message), grew = app.growth(lambda: app.call("classify", [_file(path)]))
    # 39.7 megapixels pass the pixel cap; 8 bytes a pixel make 318 MB.
    assert kind == "error" and "318 MB once decoded" in message and "4 channels of 16 bits" in message
    _clean(message)
    assert grew < MEMORY_SLACK


@pytest.mark.parametrize("route", ["upload", "inline"])
def test_a_compressed_text_bomb_gets_the_apps_message(app, files, route):
    data = files["text bomb"]
    assert len(data) < 1_000_000  # 256 MB of text inside
    value = _file(app.upload("bomb.png", data)) if route == "upload" else _inline(data)
    (kind, message), grew = app.growth(lambda: app.call("classify", [value]))
    assert kind == "error" and "more embedded text (metadata) than this app reads" in message
    _clean(message)
    assert grew < MEMORY_SLACK


def test_an_ordinary_inline_picture_still_works(app, files):
    kind, out = app.call("classify", [_inline(files["small"])])
    assert kind == "complete" and "The model's answer" in out[1] and "(28 × 28 pixels)" in out[3]


def test_a_drawing_of_many_layers_is_refused_before_its_files_are_read(app):
    """20,000 layers naming one small upload cost 20 s of the server's CPU (each layer a file to move,
    check and decode); such a request is refused from its body (its values, or its files), and a
    drawing past the layer cap by the drawing input."""
    path = app.upload("layer.png", noise_png(28, 28))

    def drawing(layers: int) -> dict:
        return {"background": None, "layers": [_file(path)] * layers, "composite": _file(path), "id": None}

    cpu = app.cpu_seconds()
    r = app.http.post("/gradio_api/call/classify_drawing", json={"data": [drawing(20_000), DEFAULT_CORRUPTION, 0]})
    assert r.status_code == 413 and r.json()["detail"].endswith("values; this app accepts at most 10,000 in one call.")
    r = app.http.post("/gradio_api/call/classify_drawing", json={"data": [drawing(100), DEFAULT_CORRUPTION, 0]})
    assert r.status_code == 413 and r.json()["detail"] == (
        "The request names 101 files; this app takes at most 18 in one call (a drawing of 16 layers).")
    assert app.cpu_seconds() - cpu < 2
    kind, message = app.call("classify_drawing", [drawing(17)])
    assert kind == "error" and message == "The drawing has 17 layers; this app accepts at most 16. Please merge its layers."
    kind, out = app.call("classify_drawing", [drawing(16)])
    assert kind == "complete" and "The model's answer" in out[1], out


# --------------------------------------------------------------------------- request bodies


def test_an_inline_picture_over_the_request_cap_is_refused_before_it_is_read(app):
    big = "data:image/png;base64," + "A" * (150 * 10**6)  # the audit's 150 MB payload
    body = json.dumps({"data": [{"url": big, "meta": {"_type": "gradio.FileData"}}]}).encode()
    r, grew = app.growth(lambda: app.http.post("/gradio_api/call/classify", content=body,
                                               headers={"content-type": "application/json"}))
    assert r.status_code == 413 and "larger than this app accepts" in r.json()["detail"]
    _clean(r.json()["detail"])
    assert grew < MEMORY_SLACK


def test_a_streamed_body_over_the_cap_is_refused(app):
    """No Content-Length (chunked): the body is counted as it arrives. Two files, each under the
    file cap (Gradio's own), over the request cap together."""
    def chunks():
        for name in ("a.png", "b.png"):
            yield f'--x\r\nContent-Disposition: form-data; name="files"; filename="{name}"\r\n\r\n'.encode()
            for _ in range(15):
                yield bytes(2**20)
            yield b"\r\n"
        yield b"--x--\r\n"

    r, grew = app.growth(lambda: app.http.post(
        "/gradio_api/upload", content=chunks(), headers={"content-type": "multipart/form-data; boundary=x"}))
    assert r.status_code == 413 and "larger than this app accepts" in r.json()["detail"]
    assert grew < MEMORY_SLACK


def test_several_files_in_one_upload_count_together(app):
    parts = [("files", (f"{i}.png", bytes(10 * 2**20), "image/png")) for i in range(3)]
    r = app.http.post("/gradio_api/upload", files=parts)
    assert r.status_code == 413, r.text[:300]


def test_each_address_has_an_upload_budget(app):
    """After BUDGET bytes within the keeping time, uploads are refused (the module's earlier uploads
    count too), and the app still answers everything else."""
    answers = [app.http.post("/gradio_api/upload", files=[("files", ("f.png", bytes(2**20), "image/png"))])
               for _ in range(BUDGET // 2**20 + 1)]
    codes = [r.status_code for r in answers]
    assert codes[0] == 200 and codes[-1] == 429 and codes == sorted(codes)  # accepted, then refused
    assert "please wait" in answers[-1].json()["detail"]
    kind, out = app.call("explore_temperature", [1.5, 10])
    assert kind == "complete"


# --------------------------------------------------------------------------- text values


def test_inline_pictures_count_against_the_addresss_disk_budget(app):
    """A picture sent inline is saved to the server's disk like an upload: it counts against the same
    budget (it did not: the cache grew past the budget), and an upload after them is refused too. A
    fresh address (127.0.0.4), as the module's own address has spent its budget."""
    picture = noise_png(700, 700)
    assert 1.4e6 < len(picture) < 1.5e6
    http = app.client("127.0.0.4")
    answers = [http.post("/gradio_api/call/classify", json={"data": [_inline(picture), DEFAULT_CORRUPTION, 0]})
               for _ in range(BUDGET // len(picture) + 1)]
    codes = [r.status_code for r in answers]
    assert codes == [200] * (BUDGET // len(picture)) + [429]
    assert answers[-1].json()["detail"] == (
        "This address sent more than 6 MB of files and pictures in the last 30 minutes; please wait a while.")
    r = http.post("/gradio_api/upload", files=[("files", ("f.png", bytes(2**20), "image/png"))])
    assert r.status_code == 429
    # Another address still sends its picture.
    kind, out = app.call("classify", [_inline(picture)], address="127.0.0.5")
    assert kind == "complete" and "(700 × 700 pixels)" in out[3]


def test_a_long_data_string_is_text_unless_it_is_a_picture(app):
    """Only a base64 picture in a Gradio file's ``url`` is exempt from the text cap (it has the picture
    cap and the budget); any other string beginning with ``data:`` is text (a 5,000,000-character
    model name was queued)."""
    from nctv.zoo import DEFAULT_MODEL

    r = app.http.post("/gradio_api/call/calibrate", json={"data": ["data:" + "x" * 5_000_000]})
    assert r.status_code == 413 and "5,000,005 characters" in r.json()["detail"]
    not_a_picture = {"url": "data:text/plain;base64," + "QUFB" * 10_000, "meta": {"_type": "gradio.FileData"}}
    r = app.http.post("/gradio_api/call/classify", json={"data": [not_a_picture, DEFAULT_CORRUPTION, 0]})
    assert r.status_code == 413 and "40,023 characters" in r.json()["detail"]
    r = app.http.post("/gradio_api/call/calibrate", json={"data": [DEFAULT_MODEL, {"note": "data:image/png;base64,"
                                                                                    + "A" * 2000}]})
    assert r.status_code == 413 and "2,022 characters" in r.json()["detail"]


@pytest.mark.parametrize("content_type", ["Application/JSON", "application/vnd.x+json", "text/plain", None])
def test_the_text_cap_holds_whatever_the_content_type_says(app, content_type):
    """FastAPI reads ``+json`` types in any capitalisation, and a body without a content type, as JSON;
    the cap checked only bodies whose type began with ``application/json``."""
    from nctv.zoo import DEFAULT_MODEL

    body = json.dumps({"data": [DEFAULT_MODEL, "", "x" * 100_000]}).encode()
    headers = {"content-type": content_type} if content_type else {}
    r = app.http.post("/gradio_api/call/calibrate", content=body, headers=headers)
    assert r.status_code == 413 and "100,000 characters" in r.json()["detail"]


def test_a_long_list_of_numbers_is_refused_before_it_is_parsed(app):
    """A 12 MB list of 600,000 numbers as a temperature cost the server a second of CPU to parse, twice,
    and left its memory fragmented; a form sends a few dozen values."""
    rng = random.Random(0)
    body = ('{"data": [[' + ",".join(f"{rng.random():.17f}" for _ in range(600_000)) + '], 10]}').encode()
    assert 11.9e6 < len(body) < 12.1e6
    cpu = app.cpu_seconds()
    r, grew = app.growth(lambda: app.http.post("/gradio_api/call/explore_temperature", content=body,
                                               headers={"content-type": "application/json"}))
    assert r.status_code == 413 and r.json()["detail"] == (
        "The request holds about 600,001 values; this app accepts at most 10,000 in one call.")
    assert app.cpu_seconds() - cpu < 0.5 and grew < 50 * 2**20


def test_anonymous_api_calls_leave_nothing_behind(app):
    """Each call of /gradio_api/call/<fn> opens a session, and Gradio kept the call's inputs in it, whole,
    until 10,000 sessions existed (and a copy of every component's configuration, 245 KB): 25 calls
    with 9,990 distinct strings of 1,000 characters as the temperature (within the caps on text and
    values) kept about 250 MB. The server's memory comes back to where it was (within half a minute:
    the threads that read a body end 10 s after their last job)."""
    def body(i: int) -> bytes:
        strings = ",".join(f'"{i:05d}{j:05d}' + "x" * 990 + '"' for j in range(9_990))
        return ('{"data": [[' + strings + '], 10]}').encode()

    before = app._status("VmRSS")
    for i in range(25):
        kind, message = app.call("explore_temperature", body(i))
        assert kind == "error" and "must be a number" in message
    deadline = time.monotonic() + 30
    while app._status("VmRSS") - before > 100 * 2**20 and time.monotonic() < deadline:
        time.sleep(1)
    assert app._status("VmRSS") - before < 100 * 2**20


def test_a_50_mb_gamma_is_refused_at_once_and_briefly(app):
    from nctv.zoo import DEFAULT_MODEL

    def calibrate(gamma: str):
        data = [DEFAULT_MODEL, "", "model's own dataset", 20, 20, 0, 5, ["Neural Clamping (FL)"], gamma,
                "default", "random", "fast", 10, "default", "lac", 90]
        return app.http.post("/gradio_api/call/calibrate", json={"data": data})

    cpu = app.cpu_seconds()
    r, grew = app.growth(lambda: calibrate("1" * 50 * 10**6))
    # Refused from its declared length: the server never parses it (it took 10 s of CPU to echo it whole).
    assert r.status_code == 413 and len(r.json()["detail"]) < 200
    assert grew < MEMORY_SLACK and app.cpu_seconds() - cpu < 5
    # Under the request cap but over the text cap: refused by length, before the queue.
    r = calibrate("2" * 100_000)
    assert r.status_code == 413 and r.json()["detail"] == (
        "A value of 100,000 characters was sent; this app accepts at most 1,000 characters in a field.")
    # Within the text cap: the handler refuses it, quoting only its start.
    r = calibrate("9" * 900)
    r.raise_for_status()
    with app.http.stream("GET", f"/gradio_api/call/calibrate/{r.json()['event_id']}") as s:
        text = s.read().decode()
    message = json.loads(text.split("event: error\ndata: ", 1)[1].split("\n", 1)[0])["error"]
    assert message.startswith("Focal-loss gamma (γ) must be a number from 0 to 10") and "9" * 80 + "'…" in message
    assert "9" * 81 not in message and len(message) < 250


def test_a_huge_model_name_is_refused_by_its_length(app):
    r = app.http.post("/gradio_api/call/calibrate", json={"data": ["x" * 5_000_000]})
    assert r.status_code == 413 and "5,000,000 characters" in r.json()["detail"]


# --------------------------------------------------------------------------- the queue


def test_one_address_cannot_fill_the_queue(app):
    """33 calls from one address filled Gradio's queue and every other visitor got "Queue is full". Now
    each address may keep only its share waiting: while a run (from 127.0.0.3) holds the heavy slot,
    127.0.0.1's fourth waiting run is refused in words, and 127.0.0.2 still gets in."""
    from nctv.zoo import DEFAULT_MODEL

    def run(address: str, gamma: str = "x", fitter: str = "fast", epochs: int = 10, size: int = 20):
        data = [DEFAULT_MODEL, "", "model's own dataset", size, size, 0, 5, ["Neural Clamping (FL)"], gamma,
                "default", "random", fitter, epochs, "default", "lac", 90]
        return app.client(address).post("/gradio_api/call/calibrate", json={"data": data})

    holder = run("127.0.0.3", gamma="1", fitter="paper", epochs=100, size=2000)  # takes the heavy slot
    holder.raise_for_status()
    event = holder.json()["event_id"]
    try:
        time.sleep(1)
        answers = [run("127.0.0.1") for _ in range(RUNS + 2)]
        assert [r.status_code for r in answers] == [200] * RUNS + [429, 429]
        assert answers[-1].json()["detail"] == (
            "3 runs from this address are already waiting in the queue; please wait until one has started.")
        assert run("127.0.0.2").status_code == 200
    finally:  # the holder stops; the waiting runs end at once (γ = "x" is refused)
        fn = next(d["id"] for d in app.http.get("/config").json()["dependencies"] if d["api_name"] == "calibrate")
        app.http.post("/gradio_api/cancel", json={"session_hash": event, "fn_index": fn, "event_id": event})
