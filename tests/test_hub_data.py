"""nctv.hubdata: Hub datasets of parquet and webdataset shards, read through the Hugging Face cache.

Every repository here is made of real files in the real formats (parquet written by pyarrow with the
``huggingface`` schema metadata that the Hub's files carry; webdataset tars of ``.jpg`` + ``.cls``),
laid out as the Hub's client caches a download (blobs, snapshots/<commit>, refs), and read offline
through the path a visitor uses (``get_splits``, ``nctv run``). Which shard files are opened is
counted by an audit hook, not by asking the code under test.
"""
import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import timm
import torch
from PIL import Image

import nctv.data as d
import nctv.hubdata as hd
import nctv.zoo as z
from test_zoo import REPO_ROOT, _put_in_hub_cache

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ("cat", "dog", "bird", "fish")
TINY = {"channels": [8, 16, 16, 16], "stem_width": 8}
COMMIT = "e" * 40

# Files opened by this process while _OPENED is a list (an audit hook cannot be removed, so it idles).
_OPENED: list | None = None


def _audit(event, args):
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, os.PathLike)):
        _OPENED.append(os.fspath(args[0]))


sys.addaudithook(_audit)


# ----------------------------------------------------------------------------- real files

def _picture(row: int, label: int) -> bytes:
    """A 48 × 40 JPEG of one flat colour that encodes its row (red and blue, in steps that JPEG's
    rounding cannot blur) and its label (green)."""
    buf = io.BytesIO()
    Image.new("RGB", (48, 40), (20 * (row // 12), 60 * label, 20 * (row % 12))).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _row_of(image: np.ndarray) -> int:
    return 12 * int(round(float(image[..., 0].mean()) / 20)) + int(round(float(image[..., 2].mean()) / 20))


def _parquet(rows: range, labels, names=NAMES, damaged_row: int | None = None) -> bytes:
    pictures = [b"\xff\xd8 not a picture" if r == damaged_row else _picture(r, lab) for r, lab in zip(rows, labels)]
    table = pa.table({"image": pa.array([{"bytes": p, "path": f"{r}.jpg"} for r, p in zip(rows, pictures)]),
                      "label": pa.array(list(labels), pa.int64())})
    if names is not None:  # the Hub's parquet files carry their features; a file written by hand may not
        features = {"image": {"_type": "Image"}, "label": {"names": list(names), "_type": "ClassLabel"}}
        table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=16)
    return buf.getvalue()


def _tar(rows: range, labels, damaged_row: int | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for r, lab in zip(rows, labels):
            for ext, data in (("jpg", b"garbage" if r == damaged_row else _picture(r, lab)), ("cls", str(lab).encode())):
                info = tarfile.TarInfo(f"sample{r:05d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _card(split: str, rows: int) -> bytes:
    return (f"---\ndataset_info:\n  splits:\n  - name: {split}\n    num_examples: {rows}\n---\n# test set\n").encode()


def _put_dataset(hub_cache: Path, repo: str, files: dict[str, bytes], revision: str = "main") -> Path:
    """Write ``files`` as the Hub client caches a downloaded snapshot: content in blobs/<sha256>,
    snapshots/<commit>/<path> linking to it, refs/<revision> naming the commit."""
    folder = hub_cache / ("datasets--" + repo.replace("/", "--"))
    for path, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = folder / "snapshots" / COMMIT / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    ref = folder / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(COMMIT)
    return folder / "snapshots" / COMMIT


def _shards_opened(opened: list, snapshot: Path) -> list[str]:
    return sorted({Path(p).name for p in opened if Path(p).suffix in (".parquet", ".tar") and str(snapshot) in p})


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache under tmp_path, read offline (HF_HUB_OFFLINE), with no token."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("NCTV_MAX_DATASET_MB", raising=False)
    return cache


def _model(hub_cache: Path, repo: str, names=NAMES, input_size=32, crop_pct=0.875):
    """A tiny timm ResNet saved with save_for_hf into the cache, with class names and preprocessing."""
    model = timm.create_model("resnet10t", num_classes=len(names), **TINY).eval()
    model.pretrained_cfg = {**model.pretrained_cfg, "input_size": (3, input_size, input_size), "crop_pct": crop_pct,
                            "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25), "interpolation": "bilinear",
                            "label_names": list(names), "num_classes": len(names)}
    _put_in_hub_cache(hub_cache.parent, repo, model, "a" * 40, TINY)
    return z.load_model(f"hf-hub:{repo}")


def _parquet_repo(hub_cache: Path, card_rows: int = 120, **kw) -> Path:
    labels = [(r * 7) % 4 for r in range(120)]
    files = {f"data/test-{i:05d}-of-00003.parquet": _parquet(range(40 * i, 40 * i + 40), labels[40 * i:40 * i + 40], **kw)
             for i in range(3)}
    files["data/train-00000-of-00001.parquet"] = _parquet(range(40), labels[:40])  # never read for @test
    files["README.md"] = _card("test", card_rows)
    return _put_dataset(hub_cache, "nctv-test/pq", files)


# ----------------------------------------------------------------------------- parquet

def test_parquet_split_reads_only_the_shards_the_sizes_need(hub_cache, capsys):
    global _OPENED
    loaded = _model(hub_cache, "nctv-test/tiny4")
    snapshot = _parquet_repo(hub_cache)
    labels = np.asarray([(r * 7) % 4 for r in range(120)])
    read = {}
    for size, shards in ((20, 1), (30, 2), (60, 3)):
        _OPENED = []
        cal, test = d.get_splits(loaded, dataset="hf-dataset:nctv-test/pq@test", calibration_size=size, test_size=size)
        opened, _OPENED = _shards_opened(_OPENED, snapshot), None
        assert opened == [f"test-{i:05d}-of-00003.parquet" for i in range(shards)]
        read[size] = sum((snapshot / "data" / f).stat().st_size for f in opened)
        assert f"read {shards} of 3 shards" in capsys.readouterr().err
        assert len(cal) == len(test) == size
        for split in (cal, test):
            # each kept picture is the model's size, and its colour says which row it was: its label is that row's
            x = split.source.images[split.indices]
            assert x.shape[1:] == (32, 32, 3) and x.dtype == np.uint8
            rows = np.asarray([_row_of(im) for im in x])
            assert (split.labels.numpy() == labels[rows]).all() and (rows < 40 * shards).all()
        assert not set(cal.indices.tolist()) & set(test.indices.tolist())
        # kept already resized and cropped, the vectorised preprocessing equals the model's own on the picture
        x, _ = cal.tensors()
        row = _row_of(cal.source.images[cal.indices[0]])
        picture = Image.open(io.BytesIO(_picture(row, labels[row])))
        assert torch.equal(x[0], loaded.preprocess(picture))
    print("bytes read per calibration size (parquet):", read)
    assert read[20] < read[30] < read[60]


def test_a_split_too_large_for_one_tensor_streams_the_same_inputs(hub_cache, monkeypatch):
    """5,000 ImageNet pictures at 224 × 224 are 3 GB as one float tensor: such a split is preprocessed
    batch by batch, and every batch equals the model's own preprocessing of the pictures."""
    loaded = _model(hub_cache, "nctv-test/tiny4")
    _parquet_repo(hub_cache)
    cal, _ = d.get_splits(loaded, dataset="hf-dataset:nctv-test/pq@test", calibration_size=20, test_size=20)
    monkeypatch.setattr(d, "MAX_TENSOR_BYTES", 10 * 3 * 32 * 32 * 4)  # room for 10 pictures
    with pytest.raises(ValueError, match="use split.loader"):
        cal.tensors()
    batches = list(cal.loader(batch_size=8))
    assert [len(x) for x, _ in batches] == [8, 8, 4]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert torch.equal(y, cal.labels)
    for i in range(len(cal)):
        row = _row_of(cal.source.images[cal.indices[i]])
        assert torch.equal(x[i], loaded.preprocess(Image.open(io.BytesIO(_picture(row, (row * 7) % 4)))))


def test_parquet_class_names_are_mapped_to_the_model_and_refused_when_foreign(hub_cache):
    loaded = _model(hub_cache, "nctv-test/tiny4")
    # the dataset lists the same classes in another order (and another case): labels follow the names
    order = ("Dog", "fish", "cat", "bird")
    _put_dataset(hub_cache, "nctv-test/reordered", {"test.parquet": _parquet(range(10), [0, 1, 2, 3] * 2 + [0, 1],
                                                                             names=order)})
    cal, test = d.get_splits(loaded, dataset="hf-dataset:nctv-test/reordered@test", calibration_size=None)
    got = {_row_of(cal.source.images[i]): int(y) for i, y in zip(np.r_[cal.indices, test.indices],
                                                                  np.r_[cal.labels.numpy(), test.labels.numpy()])}
    want = {r: NAMES.index(order[lab].lower()) for r, lab in enumerate([0, 1, 2, 3] * 2 + [0, 1])}
    assert got == want
    _put_dataset(hub_cache, "nctv-test/fruit", {"test.parquet": _parquet(range(8), [0, 1, 2, 3] * 2,
                                                                         names=("apple", "pear", "cat", "plum"))})
    with pytest.raises(ValueError, match=r"hf-dataset:nctv-test/fruit@test has classes the model does not know: "
                                         r"'apple', 'pear', 'plum' \(the model's are 'cat', 'dog'"):
        d.get_splits(loaded, dataset="hf-dataset:nctv-test/fruit@test", calibration_size=None)


def _patch_footer_rows(data: bytes, said: int, claim: int) -> bytes:
    """The parquet file with its footer's total row count (FileMetaData field 3, a zigzag varint of the
    thrift compact protocol) changed from ``said`` to ``claim``; the row groups keep their own counts."""
    def varint(n):
        n, out = n << 1, bytearray()  # zigzag of a non-negative number
        while True:
            b = n & 0x7F
            n >>= 7
            out.append(b | (0x80 if n else 0))
            if not n:
                return bytes(out)
    footer_len = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - footer_len
    footer = data[start:-8]
    old, new = b"\x16" + varint(said), b"\x16" + varint(claim)  # field delta 1 after field 2 (i64)
    assert len(old) == len(new) and old in footer
    i = footer.index(old)
    return data[:start] + footer[:i] + new + footer[i + len(old):] + data[-8:]


def test_shards_that_disagree_about_their_rows(hub_cache, capsys):
    loaded = _model(hub_cache, "nctv-test/tiny4")
    # the card says 300 pictures, the shards hold 120: the first shard is too few, so the next one is read
    _parquet_repo(hub_cache, card_rows=300)
    cal, test = d.get_splits(loaded, dataset="hf-dataset:nctv-test/pq@test", calibration_size=30, test_size=30)
    assert len(cal) == len(test) == 30 and "read 2 of 3 shards" in capsys.readouterr().err
    # a footer that claims more rows than the file holds: refused by name
    good = _parquet(range(40), [0, 1, 2, 3] * 10)
    assert pq.ParquetFile(io.BytesIO(good)).metadata.num_rows == 40
    lying = _patch_footer_rows(good, 40, 60)
    assert pq.ParquetFile(io.BytesIO(lying)).metadata.num_rows == 60
    _put_dataset(hub_cache, "nctv-test/lying", {"data/test-0.parquet": lying})
    with pytest.raises(ValueError, match=r"hf-dataset:nctv-test/lying@test: the shard data/test-0\.parquet says it "
                                         r"holds 60 rows but holds 40; it is damaged"):
        d.get_splits(loaded, dataset="hf-dataset:nctv-test/lying@test", calibration_size=10, test_size=10)
    # asking for more than all the shards hold says how much there is
    with pytest.raises(ValueError, match=r"140 pictures .* its 3 shards hold 120 in the local cache; ask for at most 60 calibration"):
        d.get_splits(loaded, dataset="hf-dataset:nctv-test/pq@test", calibration_size=70, test_size=70)


# ----------------------------------------------------------------------------- webdataset

def _wds_repo(hub_cache: Path, damaged_row: int | None = None, cut: bool = False) -> Path:
    files = {f"wds-validation-{i:04d}.tar": _tar(range(30 * i, 30 * i + 30), [r % 4 for r in range(30 * i, 30 * i + 30)],
                                                 damaged_row=damaged_row) for i in range(3)}
    if cut:
        files["wds-validation-0000.tar"] = files["wds-validation-0000.tar"][:5000]
    files["README.md"] = _card("validation", 90)
    return _put_dataset(hub_cache, "nctv-test/wds", files)


def test_webdataset_reads_only_the_shards_needed_and_skips_a_corrupt_picture(hub_cache, capsys):
    global _OPENED
    loaded = _model(hub_cache, "nctv-test/tiny4")
    snapshot = _wds_repo(hub_cache, damaged_row=7)
    read = {}
    for size, shards in ((14, 1), (20, 2)):
        _OPENED = []
        cal, test = d.get_splits(loaded, dataset="hf-dataset:nctv-test/wds", calibration_size=size, test_size=size)
        opened, _OPENED = _shards_opened(_OPENED, snapshot), None
        assert opened == [f"wds-validation-{i:04d}.tar" for i in range(shards)]
        read[size] = sum((snapshot / f).stat().st_size for f in opened)
        err = capsys.readouterr().err
        assert f"read {shards} of 3 shards" in err and f"{30 * shards - 1} pictures" in err
        assert "1 that do not decode skipped (wds-validation-0000.tar sample00007)" in err
        rows = [_row_of(im) for s in (cal, test) for im in s.source.images[s.indices]]
        assert 7 not in rows and sorted(set(rows)) == sorted(rows)
        assert all(int(y) == r % 4 for s in (cal, test) for r, y in zip([_row_of(im) for im in s.source.images[s.indices]],
                                                                         s.labels.numpy()))
    print("bytes read per calibration size (webdataset):", read)


def test_damaged_tar_and_labels_beyond_the_model(hub_cache):
    loaded = _model(hub_cache, "nctv-test/tiny4")
    _wds_repo(hub_cache, cut=True)
    with pytest.raises(ValueError, match=r"the shard wds-validation-0000\.tar is damaged .* delete it from the Hugging "
                                         "Face cache"):
        d.get_splits(loaded, dataset="hf-dataset:nctv-test/wds@validation", calibration_size=10, test_size=10)
    _put_dataset(hub_cache, "nctv-test/wide", {"val.tar": _tar(range(10), [0, 1, 2, 3, 9] * 2)})
    with pytest.raises(ValueError, match=r"hf-dataset:nctv-test/wide@validation has labels up to 9, but the model "
                                         "predicts 4 classes"):
        d.get_splits(loaded, dataset="hf-dataset:nctv-test/wide@validation", calibration_size=None)


def test_cap_is_checked_from_the_sizes_before_any_shard_is_read(hub_cache, monkeypatch):
    global _OPENED
    loaded = _model(hub_cache, "nctv-test/tiny4")
    snapshot = _wds_repo(hub_cache)
    one = (snapshot / "wds-validation-0000.tar").stat().st_size
    monkeypatch.setenv("NCTV_MAX_DATASET_MB", str(1.5 * one / 1e6))
    _OPENED = []
    try:
        with pytest.raises(ValueError, match=rf"hf-dataset:nctv-test/wds@validation: 40 pictures \(calibration and "
                                             rf"test halves\) means 2 of its 3 shards, [\d.]+ [kM]B; this server downloads "
                                             rf"at most [\d.]+ [kM]B for a dataset \(NCTV_MAX_DATASET_MB\)"):
            d.get_splits(loaded, dataset="hf-dataset:nctv-test/wds", calibration_size=20, test_size=20)
        assert _shards_opened(_OPENED, snapshot) == []
    finally:
        _OPENED = None
    cal, _ = d.get_splits(loaded, dataset="hf-dataset:nctv-test/wds", calibration_size=10, test_size=10)
    assert len(cal) == 10


def test_plan_and_cap_arithmetic():
    shards = [(f"s{i}", 100) for i in range(64)]
    assert hd.needed_pictures(5000, 5000) == 10_000 and hd.needed_pictures(5000, None) == 10_000
    assert hd.needed_pictures(None, None) is None
    # ImageNet-1k validation: 50,000 pictures in 64 equal shards, 781.25 each
    assert hd.plan_shards(shards, 50_000, 10_000) == 13 and hd.plan_shards(shards, 50_000, 50_000) == 64
    assert hd.plan_shards(shards, None, 10) == 1 and hd.plan_shards(shards, 50_000, None) == 64
    assert hd.split_shards(hd.SOURCES["imagenet-1k"], {"imagenet1k-validation-0010.tar": 1, "imagenet1k-validation-0002.tar": 2,
                                                       "imagenet1k-train-0000.tar": 3, "README.md": 4}) == [
        ("imagenet1k-validation-0002.tar", 2), ("imagenet1k-validation-0010.tar", 1)]
    assert [p for p, _ in hd.split_shards(hd.parse_spec("a/b@validation"), {"val/0.parquet": 1, "interval-0.parquet": 1,
                                                                            "data/validation-0.parquet": 1})] == [
        "data/validation-0.parquet", "val/0.parquet"]
    with pytest.raises(ValueError, match="not a Hub dataset id"):
        hd.parse_spec("no-org")


def test_imagenette_labels_are_imagenet_indices():
    from timm.data import ImageNetInfo

    synsets = ImageNetInfo().label_names()
    model_names = [f"class {i}" for i in range(1000)]
    mapping = hd.label_mapping(hd.IMAGENETTE_SYNSETS, 10, model_names, "imagenette")
    assert mapping.tolist() == [0, 217, 482, 491, 497, 566, 569, 571, 574, 701]
    assert [synsets[i] for i in mapping] == list(hd.IMAGENETTE_SYNSETS)


# ----------------------------------------------------------------------------- tokens and the Hub's answers

class _GatedHub(http.server.BaseHTTPRequestHandler):
    """The Hub's answers for a gated dataset: its metadata (public), and 401 GatedRepo for its files."""

    seen: list = []
    size = 100_000

    def do_GET(self):
        self.seen.append(self.path)
        if self.path.startswith("/api/datasets/"):
            repo = self.path[len("/api/datasets/"):].split("?")[0].split("/revision/")[0]
            body = json.dumps({"id": repo, "sha": "f" * 40, "gated": "manual", "private": False,
                               "siblings": [{"rfilename": f"x-validation-{i}.tar", "size": self.size} for i in range(4)]
                               }).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(401)
        self.send_header("X-Error-Code", "GatedRepo")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_gated_repository_without_a_token_and_over_the_cap_download_nothing(local_hub, monkeypatch, tmp_path):
    from huggingface_hub import constants

    local_hub(_GatedHub)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("NCTV_MAX_DATASET_MB", raising=False)
    names = [f"class {i}" for i in range(10)]
    _GatedHub.seen.clear()
    with pytest.raises(ValueError, match=r"hf-dataset:nctv-test/gated@validation is gated: .* Set HF_TOKEN \(on a "
                                         "Space: a secret named HF_TOKEN\)"):
        hd.load_hub_images(hd.parse_spec("nctv-test/gated"), names, 10, 10)
    # the named ImageNet-1k source says where the public alternative is
    with pytest.raises(ValueError, match="is gated: .* or use the public 'imagenette'"):
        hd.load_hub_images(hd.SOURCES["imagenet-1k"], [f"class {i}" for i in range(1000)], 10, 10)
    assert _GatedHub.seen and not [p for p in _GatedHub.seen if "/resolve/" in p]
    # over the cap: refused from the metadata's sizes, before a token is even asked for
    monkeypatch.setattr(_GatedHub, "size", 900 * 10**6)
    with pytest.raises(ValueError, match=r"all its pictures means 4 of its 4 shards, 3,600\.0 MB; this server "
                                         r"downloads at most 2,000\.0 MB"):
        hd.load_hub_images(hd.parse_spec("nctv-test/gated@validation"), names, None, None, token="hf_x")
    assert not [p for p in _GatedHub.seen if "/resolve/" in p]
    assert not [p for p in (tmp_path / "hf").rglob("*.tar")]
    # a token whose account has not accepted the terms: the Hub refuses the shard, in the same words
    with pytest.raises(ValueError, match=r"hf-dataset:nctv-test/gated@validation is gated: .* Set HF_TOKEN"):
        hd.load_hub_images(hd.parse_spec("nctv-test/gated"), names, 10, 10, token="hf_without_access")
    assert [p for p in _GatedHub.seen if "/resolve/" in p] and not [p for p in (tmp_path / "hf").rglob("*.tar")]


def test_imagenet_without_a_token_falls_back_to_imagenette(hub_cache, capsys):
    """``imagenet`` (the paper's models' own dataset) without a token: the public Imagenette, said so,
    its labels as a 1000-class model's indices."""
    model_names = [f"class {i}" for i in range(1000)]
    imagenette = [0, 217, 482, 491, 497, 566, 569, 571, 574, 701]
    # a file without class names: the named source's synsets say which ImageNet class each label is
    _put_dataset(hub_cache, "frgfm/imagenette",
                 {"320px/validation/0000.parquet": _parquet(range(20), [r % 10 for r in range(20)], names=None)},
                 revision="refs/convert/parquet")
    pools = d.load_pools("imagenet", model_names, 1000, sizes=(5, 5))
    assert "no Hugging Face token (HF_TOKEN)" in capsys.readouterr().err
    images, labels = pools.whole
    assert pools.name == "imagenette" and len(images) == 20
    assert labels.tolist() == [imagenette[r % 10] for r in range(20)]
    # a file that names its classes in words, in its own order: mapped by ImageNet's descriptions
    words = ["cassette player", "chain saw", "church", "English springer", "French horn", "garbage truck", "gas pump",
             "golf ball", "parachute", "tench"]
    _put_dataset(hub_cache, "nctv-test/nette", {"validation.parquet": _parquet(range(10), range(10), names=words)})
    _, labels = d.load_pools("hf-dataset:nctv-test/nette", model_names, 1000).whole
    assert labels.tolist() == [482, 491, 497, 217, 566, 569, 571, 574, 701, 0]


# ----------------------------------------------------------------------------- the command line

def test_nctv_run_on_parquet_and_webdataset_repositories_offline(tmp_path):
    hub_cache = tmp_path / "hf" / "hub"
    hub_cache.mkdir(parents=True)
    model = timm.create_model("resnet10t", num_classes=4, **TINY).eval()
    model.pretrained_cfg = {**model.pretrained_cfg, "input_size": (3, 32, 32), "crop_pct": 0.875,
                            "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25), "label_names": list(NAMES),
                            "num_classes": 4}
    _put_in_hub_cache(hub_cache.parent, "nctv-test/tiny4", model, "a" * 40, TINY)
    _parquet_repo(hub_cache)
    _wds_repo(hub_cache)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1",
               NCTV_CACHE_DIR=str(tmp_path / "cache"))
    for dataset, shards in (("hf-dataset:nctv-test/pq@test", "1 of 3"), ("hf-dataset:nctv-test/wds@validation", "2 of 3")):
        out = tmp_path / dataset.replace("/", "_").replace(":", "_")
        proc = subprocess.run([sys.executable, "-m", "nctv.cli", "run", "--model", "hf-hub:nctv-test/tiny4", "--dataset",
                               dataset, "--calibration-size", "20", "--test-size", "20", "--methods", "uncal", "ts",
                               "--seeds", "1", "--bins", "10", "--resamples", "100", "--out", str(out), "--quiet"],
                              env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"{dataset}: read {shards} shards" in proc.stderr
        result = json.loads((out / "results.json").read_text())
        text = json.dumps(result)
        assert dataset in text and "Temperature Scaling" in text
