"""Pictures whose cost is not in their header, each crafted here (Pillow writes the ordinary ones; the
EXIF, TIFF and JPEG-scan bombs are written byte by byte): each is refused in the app's words before it
is decoded, or decoded within the budget. Cost is what the Try tab's path takes — reading the file
(``to_pil``), converting it for a colour and for a grey model (``match_channels``) and resizing it for
the model — measured in a fresh process: the rise of its peak resident size (VmHWM) and its CPU seconds."""
import io
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from test_hostile_files import run_measuring

from nctv.images import ImageError, open_checked, to_pil

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak memory from /proc")

#: The Try tab's reading of any file within the upload cap may raise the server's peak by at most this,
MEMORY = 300 * 2**20
#: and take at most this many seconds of CPU.
CPU_S = 3.0


# --------------------------------------------------------------------------- crafting


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _ifd_entries(entries) -> bytes:
    """An EXIF block (a little-endian TIFF header and one IFD) of (tag, type, count, value) entries."""
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) + struct.pack("<I", 0)
    return b"II*\0" + struct.pack("<I", 8) + ifd


def aliased_exif(entries: int, size: int, orientation: int | None = None) -> bytes:
    """``entries`` EXIF values of ``size`` bytes (type UNDEFINED), all pointing at the same bytes."""
    at = 8 + 2 + 12 * (entries + (orientation is not None)) + 4
    rows = [(0x0112, 3, 1, orientation)] if orientation is not None else []
    rows += [(1000 + i, 7, size, at) for i in range(entries)]
    return _ifd_entries(rows) + bytes(range(256)) * (size // 256 + 1)


def many_entries_exif(entries: int, orientation: int = 6) -> bytes:
    """An EXIF block of ``entries`` small values (one SHORT each, kept in the entry) and an orientation."""
    return _ifd_entries([(0x0112, 3, 1, orientation)] + [(1000 + i, 3, 1, i & 0xFFFF) for i in range(entries)])


def png_with(chunks: bytes, width: int = 64, height: int = 48) -> bytes:
    """A grey PNG with ``chunks`` before its pixels."""
    raw = (b"\0" + bytes(width)) * height
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)) + chunks
            + _chunk(b"IDAT", zlib.compress(raw)) + _chunk(b"IEND", b""))


def jpeg_with_exif(exif: bytes, size=(64, 48)) -> bytes:
    """A JPEG whose APP1 segment holds ``exif`` (up to 64 KB)."""
    out = io.BytesIO()
    PIL.Image.new("RGB", size, (90, 30, 200)).save(out, "JPEG")
    plain = out.getvalue()
    segment = b"Exif\0\0" + exif
    assert len(segment) + 2 <= 0xFFFF
    return plain[:2] + b"\xff\xe1" + struct.pack(">H", len(segment) + 2) + segment + plain[2:]


def tiff_aliased(entries: int, size: int) -> bytes:
    """A TIFF whose tags (``entries`` of ``size`` bytes) all point at the same bytes: Pillow reads each
    while opening the file."""
    return aliased_exif(entries, size)


def progressive_with_empty_scans(extra_scans: int, size=(2000, 2000)) -> bytes:
    """A progressive JPEG followed by ``extra_scans`` copies of its last scan's header with no data."""
    rng = np.random.default_rng(0)
    small = PIL.Image.fromarray(rng.integers(0, 256, (size[1] // 50, size[0] // 50, 3), dtype=np.uint8))
    out = io.BytesIO()
    small.resize(size).save(out, "JPEG", progressive=True, quality=80)
    data = out.getvalue()
    last = data.rindex(b"\xff\xda")
    (length,) = struct.unpack(">H", data[last + 2:last + 4])
    header = data[last:last + 2 + length]
    return data[:-2] + header * extra_scans + b"\xff\xd9"


def phone_jpeg(width: int, height: int, orientation: int, **options) -> bytes:
    """A flat-colour JPEG of ``width`` × ``height`` stored with an EXIF orientation."""
    img = PIL.Image.new("RGB", (width, height), (120, 60, 30))
    exif = img.getexif()
    exif[0x0112] = orientation
    return _saved(img, "JPEG", exif=exif, quality=85, **options)


def _saved(img: PIL.Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **options)
    return out.getvalue()


def palette_with_transparency(width: int = 8000, height: int = 5000) -> bytes:
    img = PIL.Image.new("P", (width, height), 3)
    img.putpalette([i % 256 for i in range(768)])
    return _saved(img, "PNG", transparency=0)


def animated_webp(width: int, height: int, frames: int = 3) -> bytes:
    pictures = [PIL.Image.new("RGB", (width, height), (40 * i, 90, 200 - 40 * i)) for i in range(frames)]
    return _saved(pictures[0], "WEBP", save_all=True, append_images=pictures[1:], quality=30, method=0)


# --------------------------------------------------------------------------- measuring

_MEASURE = """
import PIL.Image
from nctv.images import match_channels, to_pil

def classify(path):
    for channels in (3, 1):
        img, _ = match_channels(to_pil(path), channels)
        img.resize((224, 224))
        del img

PIL.Image.new("RGB", (64, 64)).save(sys.argv[1] + "/warm.png")
classify(sys.argv[1] + "/warm.png")  # the modules loaded, as in a running server
costs(sys.argv[2:], classify, "decoded")
"""


def measure(folder: Path, files: dict[str, bytes], code_root: Path = ROOT) -> dict:
    """For each file, the rise of peak memory and the CPU seconds of reading and converting it, in one
    fresh process."""
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return run_measuring(_MEASURE, [folder, *(folder / n for n in files)], code_root)


def hostile_files() -> dict[str, bytes]:
    return {
        # 4,000 TIFF tags of 100 kB, all the same bytes: 400 MB inside PIL.Image.open.
        "aliased.tif": tiff_aliased(4000, 100_000),
        # A PNG eXIf chunk of 2,000 values of 200 kB, all the same bytes: 400 MB once Pillow reads them.
        "aliased-exif.png": png_with(_chunk(b"eXIf", aliased_exif(2000, 200_000))),
        # A 42 kB JPEG EXIF of 1,000 values of 30 kB, all the same bytes, and an orientation: PIL's
        # exif_transpose rewrites them, in time quadratic in their bytes.
        "aliased-exif.jpg": jpeg_with_exif(aliased_exif(1000, 30_000, orientation=6)),
        # A 4000 × 4000 progressive JPEG with 2,000 empty scans: each is a pass over the whole picture.
        "scans.jpg": progressive_with_empty_scans(2000, size=(4000, 4000)),
        # Within every cap: 8000 × 5000 RGB stored sideways (turned upright, then converted), and a
        # progressive 6000 × 5000 JPEG with 50 empty scans more (its coefficients are held whole).
        "phone.jpg": phone_jpeg(8000, 5000, orientation=6),
        "sideways-progressive.jpg": phone_jpeg(6000, 5000, orientation=8, progressive=True),
        # 8000 × 5000, palette with transparency: converted to RGBA, composited, converted again.
        "palette.png": palette_with_transparency(),
        # 8000 × 5000 grey with transparency (Pillow holds LA in 4 bytes a pixel).
        "grey-alpha.png": _saved(PIL.Image.new("LA", (8000, 5000), (200, 90)), "PNG"),
        # 8000 × 5000 animated WebP: libwebp's canvas, its previous frame, the frame handed over, the picture.
        "animated.webp": animated_webp(8000, 5000),
    }


@pytest.fixture(scope="module")
def costs(tmp_path_factory):
    files = hostile_files()
    assert all(len(data) < 25 * 2**20 for data in files.values())  # within the upload cap
    return measure(tmp_path_factory.mktemp("pictures"), files)


EXPECTED = {
    "aliased.tif": "'aliased.tif' is not an image this app can read. Please upload a PNG, JPEG, WebP, GIF or BMP",
    "aliased-exif.png": "'aliased-exif.png' carries EXIF entries that claim 400.0 MB in 224.2 kB, more than this "
                        "app reads; please save the picture again without its metadata",
    "aliased-exif.jpg": "'aliased-exif.jpg' carries EXIF entries that claim 30.0 MB in 42.",
    "scans.jpg": "'scans.jpg' is a progressive JPEG of more than 64 scans (cameras and editors write about 10)",
    "phone.jpg": "'phone.jpg' (8000 × 5000 pixels) would take about 320 MB to decode (it is turned upright and "
                 "converted); this app allows 240 MB",
    "sideways-progressive.jpg": "decoded",
    "palette.png": "decoded",
    "grey-alpha.png": "decoded",
    "animated.webp": "'animated.webp' (8000 × 5000 pixels) would take about 640 MB to decode (WebP's decoder holds "
                     "three more copies of it); this app allows 240 MB",
}


@pytest.mark.parametrize("name", EXPECTED)
def test_a_picture_is_refused_in_words_or_decoded_within_budget(costs, name):
    used = costs[name]
    assert used["outcome"].startswith(EXPECTED[name]), used
    assert used["memory"] < MEMORY, used
    assert used["cpu"] < CPU_S, used


def test_the_crafted_files_are_what_they_claim(tmp_path):
    """The bombs hold what their comments say, read by Pillow itself (on small sizes)."""
    with PIL.Image.open(io.BytesIO(png_with(_chunk(b"eXIf", aliased_exif(3, 1000, orientation=6))))) as img:
        exif = img.getexif()
        assert exif[0x0112] == 6 and [len(exif[1000 + i]) for i in range(3)] == [1000] * 3
    with PIL.Image.open(io.BytesIO(jpeg_with_exif(many_entries_exif(50)))) as img:
        assert img.getexif()[0x0112] == 6 and img.getexif()[1049] == 49
    scans = progressive_with_empty_scans(5, size=(100, 100))
    assert scans.count(b"\xff\xda") == progressive_with_empty_scans(0, size=(100, 100)).count(b"\xff\xda") + 5
    with PIL.Image.open(io.BytesIO(scans)) as img:
        img.load()
        assert img.size == (100, 100)
    with PIL.Image.open(io.BytesIO(animated_webp(40, 30))) as img:
        assert img.n_frames == 3 and img.size == (40, 30)


# --------------------------------------------------------------------------- formats and metadata


def test_only_the_formats_the_app_names_are_opened(tmp_path):
    """Every other format Pillow reads is refused from its first bytes, in the app's words."""
    img = PIL.Image.new("RGB", (40, 30), (10, 120, 240))
    for fmt in ("TIFF", "PPM", "SGI", "PCX", "ICO", "TGA", "IM", "DDS", "QOI"):
        path = tmp_path / f"picture.{fmt.lower()}"
        img.save(path, fmt)
        assert PIL.Image.open(path).format == fmt  # Pillow would read it
        with pytest.raises(ImageError, match=rf"^'picture.{fmt.lower()}' is not an image this app can read. Please "
                                             r"upload a PNG, JPEG, WebP, GIF or BMP picture.$"):
            to_pil(str(path))
    (tmp_path / "page.eps").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")
    (tmp_path / "sky.fits").write_bytes(b"SIMPLE  =                    T" + b" " * 49)
    (tmp_path / "layers.psd").write_bytes(b"8BPS\0\1" + bytes(20))
    for name in ("page.eps", "sky.fits", "layers.psd"):
        with pytest.raises(ImageError, match="is not an image this app can read"):
            to_pil(str(tmp_path / name))
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):
        data = _saved(img, fmt)
        with open_checked(data) as opened:
            assert opened.format == fmt and opened.size == (40, 30)


def test_a_phone_picture_is_turned_upright_by_its_own_orientation(tmp_path):
    """Each EXIF orientation, in JPEG, PNG and WebP, gives the picture Pillow's own exif_transpose gives."""
    from PIL import ImageOps

    rng = np.random.default_rng(1)
    img = PIL.Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8))
    for orientation in range(1, 9):
        exif = img.getexif()
        exif[0x0112] = orientation
        for fmt, options in (("PNG", {}), ("WEBP", {"lossless": True}), ("JPEG", {"quality": 95})):
            path = tmp_path / f"o{orientation}.{fmt.lower()}"
            img.save(path, fmt, exif=exif, **options)
            with PIL.Image.open(path) as reference:
                expected = np.asarray(ImageOps.exif_transpose(reference))
            assert np.array_equal(np.asarray(to_pil(str(path))), expected), (fmt, orientation)


def test_metadata_within_bounds_is_read_and_damage_is_named(tmp_path):
    ok = png_with(_chunk(b"eXIf", aliased_exif(20, 1000, orientation=3)))  # 20 kB claimed in 1.3 kB: fine
    (tmp_path / "ok.png").write_bytes(ok)
    assert to_pil(str(tmp_path / "ok.png")).size == (64, 48)
    big = png_with(_chunk(b"eXIf", aliased_exif(1, 2 * 2**20)))
    with pytest.raises(ImageError, match="carries 2.1 MB of EXIF metadata, more than this app reads"):
        open_checked(big, "The picture")
    with pytest.raises(ImageError, match="^The picture carries more than 2,048 EXIF entries, more than this app "):
        open_checked(png_with(_chunk(b"eXIf", many_entries_exif(30_000))), "The picture")  # 1.3 s of Pillow's parse
    cut = png_with(b"")[:40]
    with pytest.raises(ImageError, match="^The picture begins as a PNG picture but could not be read; it may be damaged or cut short.$"):
        open_checked(cut, "The picture")


def test_bytes_between_segments_hide_nothing(tmp_path):
    """Pillow skips stray bytes between a JPEG's segments; the walk before it skips them too, so a
    byte after the first segment does not hide the scans or the EXIF behind it."""
    scans = progressive_with_empty_scans(100, size=(64, 64))
    hidden = scans[:20] + b"\0" + scans[20:]  # after SOI and the 18-byte APP0 segment
    with PIL.Image.open(io.BytesIO(hidden)) as img:
        img.load()  # Pillow reads it
    with pytest.raises(ImageError, match="is a progressive JPEG of more than 64 scans"):
        open_checked(hidden)
    exif = jpeg_with_exif(aliased_exif(1000, 30_000, orientation=6))
    with pytest.raises(ImageError, match="EXIF entries that claim 30.0 MB"):
        open_checked(exif[:2] + b"\xff\xfe\x00\x04ab" + b"junk" + exif[2:])  # a comment, then stray bytes
    with pytest.raises(ImageError, match="is split into more than 32,768 segments"):
        open_checked(scans[:20] + bytes(40_000) + scans[20:])
