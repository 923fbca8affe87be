"""Files a hostile person could hand to NCTV, each crafted for real: zips that lie about their sizes,
calibrators with impossible numbers or tensors, a logit cache with flipped bits. Each is refused (or
recomputed) in words; the zips' memory and time are measured in a separate process."""
import bz2
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nctv import cli, data, metrics, zoo
from nctv.cache import split_logits
from nctv.calibration import load_calibrator
from nctv.calibration.saving import CONFIG_NAME, FILE_CAPS, TENSORS_NAME
from nctv.ui import upload_calibrator
from nctv.ui.upload_calibrator import calibration_from_zip, unpack

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "assets" / "precomputed" / "calibrators"
EXAMPLE = ROOT / "assets" / "precomputed" / "examples" / "0000-ankle-boot.png"
GB = 2**30


# ---- crafting ----------------------------------------------------------------------------------

def _zip_bytes(entries) -> bytes:
    """A zip of (name, method, compressed data, claimed size, claimed CRC) entries: the sizes written are
    the claimed ones, true or not (zipfile itself cannot write a lie)."""
    local = central = b""
    for name, method, payload, size, crc in entries:
        n = name.encode()
        version = 46 if method == zipfile.ZIP_BZIP2 else 20
        head = struct.pack("<HHHHHIIIHH", version, 0, method, 0, 0x21, crc, len(payload), size, len(n), 0)
        central += b"PK\x01\x02" + struct.pack("<H", version) + head + struct.pack("<HHHII", 0, 0, 0, 0, len(local)) + n
        local += b"PK\x03\x04" + head + n + payload
    return local + central + b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, len(entries), len(entries), len(central),
                                                          len(local), 0)


def _deflate(parts) -> tuple[bytes, int, int]:
    """Raw deflate of the concatenation of ``data`` repeated ``n`` times for each (data, n), with its size and
    CRC. Each piece ends in a full flush (byte-aligned, no reference back), so a piece compressed once can
    be repeated: a gigabyte of zeros is built in milliseconds."""
    out, size, crc = [], 0, 0
    for chunk, n in parts:
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        out.append((c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)) * n)
        size += len(chunk) * n
        for _ in range(n):
            crc = zlib.crc32(chunk, crc)
    return b"".join(out) + b"\x03\x00", size, crc  # 0x03 0x00: an empty final block


def _bzip2_zeros(blocks: int, block_zeros: int = 4 * 2**20) -> bytes:
    """A bzip2 stream of ``blocks`` × ``block_zeros`` zero bytes. bzip2 blocks are bit-aligned: the block of
    one compressed run is cut out of its stream by its bits and repeated, and the stream's CRC (each
    block's CRC folded in after a 1-bit rotation) is recomputed."""
    one = bz2.compress(bytes(block_zeros), 9)
    bits = format(int.from_bytes(one, "big"), f"0{8 * len(one)}b")
    end_marker = format(0x177245385090, "048b")
    block = bits[32:bits.rindex(end_marker)]
    block_crc, combined = int(block[48:80], 2), 0
    for _ in range(blocks):
        combined = (((combined << 1) | (combined >> 31)) & 0xFFFFFFFF) ^ block_crc
    stream = bits[:32] + block * blocks + end_marker + format(combined, "032b")
    stream += "0" * (-len(stream) % 8)
    return int(stream, 2).to_bytes(len(stream) // 8, "big")


def test_the_crafted_streams_hold_what_they_claim():
    """The crafting itself, checked against Python's own decompressors (on small sizes)."""
    d = bz2.BZ2Decompressor()
    assert d.decompress(_bzip2_zeros(3, 2**16)) == bytes(3 * 2**16) and d.eof
    payload, size, crc = _deflate([(b"head", 1), (bytes(1000), 5)])
    assert zlib.decompress(payload, -15) == b"head" + bytes(5000) and size == 5004
    assert crc == zlib.crc32(b"head" + bytes(5000))


@pytest.fixture(scope="module")
def good_zip_files():
    """The shipped Neural Clamping calibrator, as a zip from the Calibrate tab holds it."""
    folder = SHIPPED / "neural-clamping-fl"
    return {f"neural-clamping-fl/{n}": (folder / n).read_bytes() for n in (CONFIG_NAME, TENSORS_NAME)}


def _bombs(good) -> dict[str, bytes]:
    config = good["neural-clamping-fl/config.json"]
    stored = ("neural-clamping-fl/config.json", zipfile.ZIP_STORED, config, len(config), zlib.crc32(config))
    zeros16 = zlib.crc32(bytes(16))  # the CRC of what the entry claims to be: 16 zero bytes
    deflated, _, _ = _deflate([(bytes(2**20), 1024)])
    return {
        # 1 GiB of zeros in bzip2, in an entry that claims 16 bytes.
        "bzip2": [stored, ("neural-clamping-fl/calibrator.safetensors", zipfile.ZIP_BZIP2, _bzip2_zeros(256), 16,
                           zeros16)],
        # 1 GiB of zeros in deflate, in an entry that claims 16 bytes.
        "deflate": [stored, ("neural-clamping-fl/calibrator.safetensors", zipfile.ZIP_DEFLATED, deflated, 16,
                             zeros16)],
        # The same gigabyte claiming 150 MB: within the caps, so it is streamed until the lie shows.
        "deflate-150mb": [stored, ("neural-clamping-fl/calibrator.safetensors", zipfile.ZIP_DEFLATED, deflated,
                                   150 * 2**20, zeros16)],
    }


_MEASURE = """
import json, resource, sys, tempfile
from pathlib import Path
from nctv.ui.upload_calibrator import unpack

def used():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_maxrss * 1024, r.ru_utime + r.ru_stime  # Linux: the peak resident size, in KiB

results = {}
for path in sys.argv[1:]:
    rss0, cpu0 = used()
    try:
        with tempfile.TemporaryDirectory() as into:
            unpack(path, Path(into))
        outcome = "accepted"
    except ValueError as e:
        outcome = str(e)
    rss1, cpu1 = used()
    results[Path(path).stem] = {"memory": rss1 - rss0, "cpu": cpu1 - cpu0, "outcome": outcome}
print(json.dumps(results))
"""


def measure_unpack(paths, code_root: Path = ROOT) -> dict:
    """For each zip, the growth of peak memory and the CPU seconds of ``unpack``, in one fresh process
    (peaks only grow, so a zip that cost memory shows it in its own line whatever came before)."""
    env = dict(os.environ, PYTHONPATH=str(code_root), OMP_NUM_THREADS="1")
    # Run from code_root: `python -c` puts the working folder first on the path.
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *map(str, paths)], env=env, cwd=code_root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bomb_costs(good_zip_files, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bombs")
    paths = []
    for kind, entries in _bombs(good_zip_files).items():
        paths.append(folder / f"{kind}.zip")
        paths[-1].write_bytes(_zip_bytes(entries))
        assert paths[-1].stat().st_size < 2**21  # a small upload, a gigabyte inside
    return measure_unpack(paths)


@pytest.mark.parametrize("kind, words", [
    ("bzip2", "compressed with a method NCTV does not read"),
    ("deflate", "holds more data than it claims"),
    ("deflate-150mb", "damaged"),
])
def test_zip_bombs_that_lie_about_their_sizes_cost_nothing(bomb_costs, kind, words):
    used = bomb_costs[kind]
    assert words in used["outcome"], used
    assert used["memory"] < 300 * 2**20, used
    assert used["cpu"] < 1.5, used


def test_a_member_past_its_own_cap_is_stopped_while_it_streams(good_zip_files, tmp_path, monkeypatch):
    """A config.json that honestly claims 3 MB passes the claimed-size checks; its real bytes stop it."""
    monkeypatch.setitem(FILE_CAPS, CONFIG_NAME, 2**20)
    big = b"{" + b" " * (3 * 2**20) + b"}"
    path = tmp_path / "big.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("nc/config.json", big)
        z.writestr("nc/calibrator.safetensors", good_zip_files["neural-clamping-fl/calibrator.safetensors"])
    with pytest.raises(ValueError, match=r"nc/config.json unpacks to more than 1 MB"):
        unpack(path, tmp_path / "out")
    assert (tmp_path / "out" / "nc" / "config.json").stat().st_size <= 2**20  # never more than the cap
    monkeypatch.setattr(upload_calibrator, "MAX_UNPACKED_BYTES", 2**21)
    with pytest.raises(ValueError, match=r"zip unpacks to more than 2 MB"):  # the claim passes, the total not
        with zipfile.ZipFile(path := tmp_path / "two.zip", "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("nc/config.json", good_zip_files["neural-clamping-fl/config.json"])
            z.writestr("nc/calibrator.safetensors", bytes(2**21 + 1))
        unpack(path, tmp_path / "out2")


# ---- calibrators with impossible contents --------------------------------------------------------

@pytest.fixture(scope="module")
def loaded():
    return zoo.load_model(zoo.DEFAULT_MODEL)


def _copy(name: str, tmp_path: Path, config=None, tensors=None) -> Path:
    """A copy of a shipped calibrator with ``config(dict)`` / ``tensors(dict)`` changing it in place."""
    folder = tmp_path / name
    shutil.copytree(SHIPPED / name, folder)
    if config is not None:
        c = json.loads((folder / CONFIG_NAME).read_text())
        config(c)
        (folder / CONFIG_NAME).write_text(json.dumps(c))  # NaN and Infinity written as JSON allows
    if tensors is not None:
        t = {k: v.clone() for k, v in load_file(str(SHIPPED / name / TENSORS_NAME)).items()}  # no view of the file
        tensors(t)
        save_file(t, str(folder / TENSORS_NAME))
    return folder


def _fitted(key, value):
    return lambda c: c["fitted"].__setitem__(key, value)


def _tensor(key, value):
    return lambda t: t.__setitem__(key, value)


def _in_file(key, value):
    """The tensor ``key`` replaced in calibrator.safetensors; config.json names it as before."""
    return {"tensors": _tensor(key, value)}


NC_CASES = {
    "T=-1": ({"config": _fitted("temperature_", -1.0)}, r"temperature T = -1 is outside \[0.001, 1000\]"),
    "T=0": ({"config": _fitted("temperature_", 0.0)}, r"temperature T = 0 is outside"),
    "T=nan": ({"config": _fitted("temperature_", math.nan)}, "temperature T must be a finite number; got nan"),
    "T=inf": ({"config": _fitted("temperature_", math.inf)}, "temperature T must be a finite number; got inf"),
    "T=1e308": ({"config": _fitted("temperature_", 1e308)}, r"temperature T = 1e\+308 is outside"),
    "T=text": ({"config": _fitted("temperature_", "3.9")}, "temperature T must be a number; got '3.9'"),
    "T=missing": ({"config": lambda c: c["fitted"].pop("temperature_")}, "lacks temperature_"),
    "delta nan": (_in_file("fitted.delta_", torch.full((1, 28, 28), math.nan)), "delta_ holds NaN or infinite"),
    "delta inf": (_in_file("fitted.delta_", torch.zeros(1, 28, 28).index_fill_(2, torch.tensor([3]), math.inf)),
                  "delta_ holds NaN or infinite"),
    "delta 1e30": (_in_file("fitted.delta_", torch.full((1, 28, 28), 1e30)),
                   "more than twice the model's whole input range"),
    "delta shape": (_in_file("fitted.delta_", torch.zeros(1, 28, 27)), r"delta_ has shape \[1, 28, 27\]; it must have "
                                                                    r"the model's input shape \[1, 28, 28\]"),
    "delta scalar tensor": (_in_file("fitted.delta_", torch.tensor(0.5)), r"delta_ has shape \[\]"),
    "delta scalar number": ({"config": _fitted("delta_", 0.5), "tensors": lambda t: t.pop("fitted.delta_")},
                            "delta_ must be a tensor in calibrator.safetensors"),
    "delta integers": (_in_file("fitted.delta_", torch.zeros(1, 28, 28, dtype=torch.uint8)),
                       "delta_ is stored as U8; it must hold floating-point numbers"),
    "fingerprint null": ({"config": lambda c: c["model"].__setitem__("fingerprint", None)},
                         "does not record the fingerprint of the model"),
    "no model record": ({"config": lambda c: c.__setitem__("model", None)},
                        "does not record the fingerprint of the model"),
    "extra tensor": ({"tensors": _tensor("hidden", torch.zeros(4))}, "holds tensors that config.json does not name"),
    "input_range shape": (_in_file("params.input_range.0", torch.zeros(3, 28, 28)),
                          "input_range.0 has shape .* broadcasts to one model input"),
    "gamma": ({"config": _fitted("gamma_", 1e9)}, "gamma_ must be at most 10"),
    "weight decay": ({"config": _fitted("weight_decay_", -1)}, "weight_decay_ must be a finite number >= 0"),
}


@pytest.mark.parametrize("case", NC_CASES)
def test_impossible_neural_clamping_calibrators_are_refused(case, loaded, tmp_path):
    changes, words = NC_CASES[case]
    folder = _copy("neural-clamping-fl", tmp_path, **changes)
    with pytest.raises(ValueError, match=words):
        load_calibrator(folder, model=loaded)


def test_a_delta_a_little_past_the_input_range_loads(loaded, tmp_path):
    """An SGD fit from Theorem 1's δ̃ (entries up to the range's width) may step slightly past that
    width: such a calibrator is real and loads; only one past twice the width is refused."""
    alpha, beta = loaded.input_range
    width = float((beta - alpha).abs().max())
    near = torch.zeros(1, 28, 28)
    near[0, 0, 0] = 1.01 * width
    calibrator = load_calibrator(_copy("neural-clamping-fl", tmp_path / "near", **_in_file("fitted.delta_", near)),
                                 model=loaded)
    assert float(calibrator.delta_.abs().max()) == pytest.approx(1.01 * width)
    far = near * 2
    with pytest.raises(ValueError, match="more than twice the model's whole input range"):
        load_calibrator(_copy("neural-clamping-fl", tmp_path / "far", **_in_file("fitted.delta_", far)), model=loaded)


def _delta_file(tmp_path, dtype, shape, nbytes, real_bytes=None) -> Path:
    """The shipped Neural Clamping calibrator with a δ of this dtype and shape whose header claims
    ``nbytes`` of data; the file holds ``real_bytes`` of it (default: all, as sparse zeros)."""
    folder = _copy("neural-clamping-fl", tmp_path)
    ranges = load_file(str(SHIPPED / "neural-clamping-fl" / TENSORS_NAME))
    header = {k: {"dtype": "F32", "shape": [1, 28, 28], "data_offsets": [3136 * i, 3136 * (i + 1)]}
              for i, k in enumerate(("params.input_range.0", "params.input_range.1"))}
    header["fitted.delta_"] = {"dtype": dtype, "shape": shape, "data_offsets": [6272, 6272 + nbytes]}
    text = json.dumps(header).encode()
    with (folder / TENSORS_NAME).open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.write(b"".join(ranges[k].numpy().tobytes() for k in ("params.input_range.0", "params.input_range.1")))
        f.truncate(8 + len(text) + 6272 + (nbytes if real_bytes is None else real_bytes))
    return folder


@pytest.mark.parametrize("dtype, shape, nbytes, real_bytes, words", [
    ("U8", [190_000_000], 190_000_000, None, "is stored as U8"),  # the 190 MB δ of uint8 values
    ("F32", [47_500_000], 190_000_000, None, r"has shape \[47500000\]; it must have the model's input shape"),
    ("F32", [1, 28, 28], 10**9, 3136, "could not be read as safetensors"),  # offsets claim more than it holds
    ("F32", [1, 28, 28], 3136, 10**8, "could not be read as safetensors"),  # it holds more than it names
])
def test_a_huge_or_lying_delta_is_refused_from_its_header(loaded, tmp_path, dtype, shape, nbytes, real_bytes, words):
    folder = _delta_file(tmp_path, dtype, shape, nbytes, real_bytes)
    with pytest.raises(ValueError, match=words):
        load_calibrator(folder, model=loaded)


def test_a_header_that_claims_an_endless_length_is_refused(loaded, tmp_path):
    folder = _copy("neural-clamping-fl", tmp_path)
    (folder / TENSORS_NAME).write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        load_calibrator(folder, model=loaded)


LOGIT_CASES = {
    "vs weight nan": ("vector-scaling", _in_file("fitted.weight_", torch.full((10, 10), math.nan, dtype=torch.float64)),
                      "weight_ holds NaN or infinite"),
    "vs bias inf": ("vector-scaling", _in_file("fitted.bias_", torch.full((10,), math.inf, dtype=torch.float64)),
                    "bias_ holds NaN or infinite"),
    "vs weight shape": ("vector-scaling", _in_file("fitted.weight_", torch.eye(9, dtype=torch.float64)),
                        r"weight_ has shape \[9, 9\]; it must have \[10, 10\] \(10 classes\)"),
    "vs weight number": ("vector-scaling", {"config": _fitted("weight_", 2.0), "tensors": lambda t: t.pop("fitted.weight_")},
                         "weight_ must be a tensor"),
    "grid length": ("ts-by-grid-search", _in_file("fitted.grid_", torch.ones(6000, dtype=torch.float64)),
                    r"grid_ has shape \[6000\]; it must have \[5000\]"),
    "grid T": ("ts-by-grid-search", {"config": _fitted("temperature_", 1e308)}, "is outside"),
    "ts T": ("temperature-scaling", {"config": _fitted("temperature_", -1.0)}, "is outside"),
    "odir lambda": ("vector-scaling", {"config": lambda c: c.update(
        method="MS-ODIR", **{"class": "MatrixScalingODIR"}, params={}, fitted={**c["fitted"], "lambda_": math.nan})},
        "lambda_ must be a finite number"),
}


@pytest.mark.parametrize("case", LOGIT_CASES)
def test_impossible_logit_calibrators_are_refused(case, loaded, tmp_path):
    name, changes, words = LOGIT_CASES[case]
    folder = _copy(name, tmp_path, **changes)
    with pytest.raises(ValueError, match=words):
        load_calibrator(folder, model=loaded)
    if case == "vs weight shape":  # without a model, K comes from bias_ (10): the 9×9 weight is still refused
        with pytest.raises(ValueError, match=words):
            load_calibrator(folder)


def test_every_shipped_calibrator_still_loads(loaded):
    for folder in sorted(SHIPPED.iterdir()):
        assert load_calibrator(folder, model=loaded) is not None
    assert load_calibrator(SHIPPED / "neural-clamping-fl", model=loaded.model).delta_.shape == (1, 28, 28)


def test_a_huge_delta_in_a_small_zip_never_reaches_the_visitors_state(tmp_path):
    """A 190 MB δ of uint8 zeros deflates to ~190 KB: the zip passes its own caps, the calibrator does not."""
    config = (SHIPPED / "neural-clamping-fl" / CONFIG_NAME).read_bytes()
    tensors = load_file(str(SHIPPED / "neural-clamping-fl" / TENSORS_NAME))
    header, offset = {}, 0
    for key in ("params.input_range.0", "params.input_range.1"):
        header[key] = {"dtype": "F32", "shape": [1, 28, 28], "data_offsets": [offset, offset + 3136]}
        offset += 3136
    header["fitted.delta_"] = {"dtype": "U8", "shape": [190_000_000], "data_offsets": [offset, offset + 190_000_000]}
    text = json.dumps(header).encode()
    head = struct.pack("<Q", len(text)) + text + b"".join(tensors[k].numpy().tobytes() for k in list(header)[:2])
    payload, size, crc = _deflate([(head, 1), (bytes(2**20), 181), (bytes(190_000_000 - 181 * 2**20), 1)])
    path = tmp_path / "calibrators.zip"
    path.write_bytes(_zip_bytes([
        ("nc/config.json", zipfile.ZIP_STORED, config, len(config), zlib.crc32(config)),
        ("nc/calibrator.safetensors", zipfile.ZIP_DEFLATED, payload, size, crc)]))
    assert path.stat().st_size < 300_000
    with pytest.raises(ValueError, match="delta_ is stored as U8"):
        calibration_from_zip(path, None)


# ---- nctv apply, the logit cache -----------------------------------------------------------------

def test_apply_exits_non_zero_on_confidences_that_are_not_numbers(tmp_path, capsys):
    # Finite, well-shaped weights so large that the calibrated logits overflow to ±inf and softmax to NaN.
    folder = _copy("vector-scaling", tmp_path, **_in_file("fitted.weight_", torch.eye(10, dtype=torch.float64) * 1e300))
    status = cli.main(["apply", "--calibrator", str(folder), "--device", "cpu", str(EXAMPLE)])
    out, err = capsys.readouterr()
    assert status == 2 and "nan" not in out.lower()
    assert err.startswith("nctv apply: error: The calibrated confidences of") and "not numbers" in err
    assert len(err.strip().splitlines()) == 1


def test_apply_caps_the_weights_of_a_model_the_calibrator_names(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    # The default model's own files, in the Hugging Face cache as a Hub model (offline: nothing downloads).
    hub = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo = hub / "models--someone--big-model"
    shutil.copytree(data.assets_dir() / "models" / zoo.DEFAULT_MODEL, repo / "snapshots" / ("c" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c" * 40)
    weights_mb = (repo / "snapshots" / ("c" * 40) / "model.safetensors").stat().st_size / 1e6
    folder = _copy("temperature-scaling", tmp_path, config=lambda c: c["model"].update(name="hf-hub:someone/big-model"))
    monkeypatch.setenv("NCTV_MAX_MODEL_MB", f"{weights_mb / 2}")
    assert cli.main(["apply", "--calibrator", str(folder), str(EXAMPLE)]) == 2
    err = capsys.readouterr().err
    assert f"hf-hub:someone/big-model has {weights_mb:,.1f} MB of weights" in err and "Pick a smaller model" in err
    # A model the user names is the user's own choice; one within the cap loads as before.
    assert cli.main(["apply", "--calibrator", str(folder), "--model", "hf-hub:someone/big-model", str(EXAMPLE)]) == 0
    monkeypatch.setenv("NCTV_MAX_MODEL_MB", f"{weights_mb * 2}")
    assert cli.main(["apply", "--calibrator", str(folder), str(EXAMPLE)]) == 0
    capsys.readouterr()


def _flip_bits(path: Path, positions) -> None:
    """Flip the top mantissa bit of some float32 logits in a cache file: they stay finite."""
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    start = 8 + n + json.loads(raw[8:8 + n])["logits"]["data_offsets"][0]
    for i in positions:
        raw[start + 4 * i + 2] ^= 0x40
    path.write_bytes(bytes(raw))


def test_a_cache_file_with_flipped_bits_is_recomputed(loaded, tmp_path):
    cal, _ = data.get_splits(loaded, calibration_size=300, test_size=100)
    first = split_logits(loaded.model, cal, cache_dir=tmp_path)
    assert not first.hit and split_logits(loaded.model, cal, cache_dir=tmp_path).hit
    _flip_bits(first.path, range(0, 3000, 7))
    corrupted = load_file(str(first.path))["logits"]
    assert bool(torch.isfinite(corrupted).all()) and not torch.equal(corrupted, first.logits)
    assert metrics.ece(corrupted, first.labels) != metrics.ece(first.logits, first.labels)
    again = split_logits(loaded.model, cal, cache_dir=tmp_path)
    assert not again.hit and torch.equal(again.logits, first.logits)
    assert split_logits(loaded.model, cal, cache_dir=tmp_path).hit  # rewritten whole


def test_a_cap_set_to_nonsense_stops_at_start_in_words():
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCTV_MAX_CALIBRATOR_BYTES="lots")
    proc = subprocess.run([sys.executable, "-c", "import nctv.calibration.saving"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "The environment variable NCTV_MAX_CALIBRATOR_BYTES must be a whole number ≥ 1; it is 'lots'" in proc.stderr


# ---- zips read lazily: one config.json at a time, the safetensors header capped before it is read -------

#: The start of a measuring child process: ``costs(paths, run)`` prints, as JSON, for each file the rise
#: of the peak resident size (VmHWM, reset before each) and the CPU seconds of ``run(path)``, and its
#: outcome (``done``, or the message of the ValueError it raised).
PEAK_PRELUDE = """
import json, resource, sys
from pathlib import Path

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def costs(paths, run, done):
    results = {}
    for path in paths:
        Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
        rss0, cpu0 = status("VmRSS"), cpu()
        try:
            run(path)
            outcome = done
        except ValueError as e:
            outcome = str(e)
        results[Path(path).name] = {"memory": status("VmHWM") - rss0, "cpu": cpu() - cpu0, "outcome": outcome}
    print(json.dumps(results))
"""


def run_measuring(script: str, args, code_root: Path = ROOT) -> dict:
    """What a :data:`PEAK_PRELUDE` script printed, run in a fresh process on the code under ``code_root``."""
    env = dict(os.environ, PYTHONPATH=str(code_root), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PEAK_PRELUDE + script, *map(str, args)], env=env, cwd=code_root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_MEASURE_LOAD = """
from nctv.ui.upload_calibrator import calibration_from_zip

calibration_from_zip(sys.argv[1], None)  # the model loaded and the modules imported: what a server has already
costs(sys.argv[2:], lambda path: calibration_from_zip(path, None), "accepted")
"""


def measure_loads(good: Path, paths) -> dict:
    """For each zip, the rise of peak memory (VmHWM) and the CPU seconds of ``calibration_from_zip`` in one
    fresh process, after a first load of ``good`` (as a running server has done)."""
    return run_measuring(_MEASURE_LOAD, [good, *paths])


def _json_floats(megabytes: float) -> str:
    """A JSON list of ``megabytes`` MB of the number 1.5: about 11 bytes of Python per byte once parsed."""
    n = int(megabytes * 2**20) // 4
    return "[" + "1.5," * (n - 1) + "1.5]"


@pytest.fixture(scope="module")
def lazy_zip_costs(good_zip_files, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lazy")
    nc_config = json.loads(good_zip_files["neural-clamping-fl/config.json"])
    tensors = good_zip_files["neural-clamping-fl/calibrator.safetensors"]
    zips = {"good": dict(good_zip_files)}
    # Four folders of 8 MB config.json each, each naming a model of its own: refused once all are read.
    many = {}
    for i in range(4):
        config = dict(nc_config, model={**nc_config["model"], "name": f"model-{i}"}, padding=None)
        text = json.dumps(config)
        many[f"c{i}/config.json"] = text.replace('"padding": null', '"padding": ' + _json_floats(8)).encode()
        many[f"c{i}/calibrator.safetensors"] = tensors
    zips["four-configs"] = many
    # 8 MB of empty lists: 60 bytes of Python each, for their 3 characters.
    zips["nested"] = {"c/config.json": ("[" + "[]," * (8 * 2**20 // 3) + "[]]").encode(),
                      "c/calibrator.safetensors": tensors}
    # The shipped calibrator (its model's fingerprint is public) with a 24 MB safetensors header.
    header = ('{"__metadata__": {"padding": ' + _json_floats(24) + "}}").encode()
    zips["long-header"] = {"nc/config.json": good_zip_files["neural-clamping-fl/config.json"],
                           "nc/calibrator.safetensors": struct.pack("<Q", len(header)) + header}
    paths = {}
    for name, files in zips.items():
        paths[name] = folder / f"{name}.zip"
        with zipfile.ZipFile(paths[name], "w", zipfile.ZIP_DEFLATED) as z:
            for member, data_ in files.items():
                z.writestr(member, data_)
        assert paths[name].stat().st_size < 4 * 2**20  # small uploads
    return measure_loads(paths.pop("good"), paths.values())


@pytest.mark.parametrize("kind, words, most_mb", [
    ("four-configs", "must all name the one model", 160),  # was +390 MB: all four held at once
    ("nested", "holds more than 262,144 lists and objects", 40),  # was +200 MB
    ("long-header", "has a header of 25,165,8.. bytes; a saved calibrator's takes a few hundred", 40),  # +270 MB
])
def test_a_zips_calibrators_are_read_one_at_a_time_and_headers_capped_before_reading(lazy_zip_costs, kind, words,
                                                                                       most_mb):
    used = lazy_zip_costs[f"{kind}.zip"]
    assert re.search(words, used["outcome"]), used
    assert used["memory"] < most_mb * 2**20, used
    assert used["cpu"] < 3, used


def test_apply_reads_only_the_formats_the_app_reads(tmp_path, capsys):
    # A TIFF's header is where tag aliasing costs memory (inside PIL.Image.open): nctv apply refuses it
    # from its first bytes, as the app refuses an upload, before PIL opens it.
    from PIL import Image

    tiff = tmp_path / "picture.tiff"
    Image.open(EXAMPLE).save(tiff)
    status = cli.main(["apply", "--calibrator", str(SHIPPED / "temperature-scaling"), "--device", "cpu",
                       str(tiff)])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("nctv apply: error: picture.tiff") and "Traceback" not in err
    assert "is not an image nctv can read" in err and "PNG, JPEG" in err and len(err.strip().splitlines()) == 1
