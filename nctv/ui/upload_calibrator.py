"""Loading a saved calibrator into the Try tab: a ``calibrators.zip`` from the Calibrate tab's
download (or any zip of folders written by ``save_pretrained``) becomes the visitor's calibration.

A visitor's zip is untrusted: it is read member by member (no ``extractall``), only the two files
of a saved calibrator are accepted, names may not leave the folder, and sizes are capped before
anything is written. The model a calibrator names must be one of the app's own (its model menu) or
the model of the visitor's current calibration, so that a zip cannot make the server download one.
"""
from __future__ import annotations

import tempfile
import warnings
import zipfile
import zlib
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any

import gradio as gr

from nctv.calibration.saving import (CONFIG_NAME, FILE_CAPS, TENSORS_NAME, ModelMismatchWarning, load_calibrator,
                                     read_config)
from nctv.checks import env_limit, shown
from nctv.settings import DEFAULT_CALIBRATION_SIZE
from nctv.ui.common import user_errors
from nctv.ui.caches import get_model, ts_temperature_of
from nctv.ui.session import NC_METHODS, TS_METHOD, Calibration, SplitSpec

#: Caps on a visitor's zip: its size, its unpacked size (bytes really decompressed, whatever the
#: zip claims) and its number of files. Each file is also held to its own cap (saving.FILE_CAPS).
MAX_ZIP_BYTES = env_limit("NCTV_MAX_ZIP_BYTES", 50 * 2**20)
MAX_UNPACKED_BYTES = env_limit("NCTV_MAX_UNPACKED_BYTES", 200 * 2**20)
MAX_MEMBERS = env_limit("NCTV_MAX_ZIP_MEMBERS", 64)
# Stored and deflate are what Python's zipfile writes (the Calibrate tab's download is deflate). A
# bzip2 or LZMA member can only be read by decompressing whole blocks at once, so a few hundred bytes
# of them can expand to gigabytes before any count could stop them.
#: Seconds a visitor's calibration (run or loaded) stays in the session after its last change; an open
#: tab is never closed by itself, so without it every idle session would hold its δ for good. Its size
#: is bounded too: load_calibrator holds δ to the model's input shape (3×224×224 float32: 0.6 MB).
CALIBRATION_TTL_S = env_limit("NCTV_CALIBRATION_TTL_S", 3600)
_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}
_CHUNK = 2**20
_NAMES = (CONFIG_NAME, TENSORS_NAME)
#: Longest member name, in bytes (UTF-8): the Calibrate tab's are a method's folder and a file name
#: (under 60); a longer one could pass the server's own limit on a file name (255 bytes).
MAX_NAME_BYTES = 200


def unpack(path: str | Path, into: Path) -> list[Path]:
    """The calibrator folders of a zip, written under ``into``; ValueError for anything else.

    Members are streamed in chunks and their real bytes counted, so a member that claims fewer bytes
    than it holds is stopped at its cap: memory never holds more than one chunk of it."""
    path = Path(path)
    if path.stat().st_size > MAX_ZIP_BYTES:
        raise ValueError(f"The zip is larger than {_mb(MAX_ZIP_BYTES)}; a saved calibrator is far smaller.")
    if not zipfile.is_zipfile(path):
        raise ValueError("That file is not a zip. Load the calibrators.zip that the Calibrate tab offers for "
                         "download (or a zip of folders written by save_pretrained).")
    try:
        with zipfile.ZipFile(path) as archive:
            members = [m for m in archive.infolist() if not m.is_dir()]
            _check_members(members)
            left = MAX_UNPACKED_BYTES
            for m in members:
                target = into.joinpath(*PurePosixPath(m.filename).parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                left -= _copy(archive, m, target, left)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise ValueError(f"The zip is damaged ({e}); download calibrators.zip from the Calibrate tab again.") from None
    except OSError as e:  # the server's own refusal to write a name; the checks above leave none expected
        raise ValueError(f"The zip's files could not be unpacked ({e.strerror or type(e).__name__}); download "
                         "calibrators.zip from the Calibrate tab again.") from None
    folders = sorted({into.joinpath(*PurePosixPath(m.filename).parts).parent for m in members
                      if PurePosixPath(m.filename).name == CONFIG_NAME})
    if not folders:
        raise ValueError(f"The zip holds no saved calibrator (a folder with {CONFIG_NAME} and {TENSORS_NAME}).")
    return folders


def _copy(archive: zipfile.ZipFile, member: zipfile.ZipInfo, target: Path, left: int) -> int:
    """Write one member to ``target`` chunk by chunk; its real size, refused past its cap or ``left``."""
    name = PurePosixPath(member.filename).name
    cap = min(FILE_CAPS[name], left)
    written = 0
    with archive.open(member) as source, target.open("wb") as sink:
        while chunk := source.read(min(_CHUNK, cap - written + 1)):
            written += len(chunk)
            if written > cap:
                what = f"{member.filename} unpacks" if cap == FILE_CAPS[name] else "The zip unpacks"
                raise ValueError(f"{what} to more than {_mb(cap)}; that is no saved calibrator.")
            sink.write(chunk)
    return written


def _mb(n: int) -> str:
    return f"{n / 2**20:g} MB"


def _check_members(members: list[zipfile.ZipInfo]) -> None:
    if len(members) > MAX_MEMBERS:
        raise ValueError(f"The zip holds {len(members)} files; a zip of saved calibrators holds at most "
                         f"{MAX_MEMBERS}.")
    if sum(m.file_size for m in members) > MAX_UNPACKED_BYTES:
        raise ValueError(f"The zip unpacks to more than {_mb(MAX_UNPACKED_BYTES)}; that is no saved calibrator.")
    files = [m.filename for m in members]
    folders = {str(parent) for f in files for parent in PurePosixPath(f).parents}
    for m in members:
        if (size := len(m.filename.encode("utf-8", "surrogatepass"))) > MAX_NAME_BYTES:
            raise ValueError(f"The zip holds a file whose name is {size:,} bytes long; a saved calibrator's names "
                             f"are far shorter (at most {MAX_NAME_BYTES}), so it was not made by NCTV.")
        if files.count(m.filename) > 1 or m.filename in folders:
            what = "twice" if files.count(m.filename) > 1 else "both as a file and as a folder"
            raise ValueError(f"The zip holds {shown(m.filename)} {what}; it was not made by NCTV.")
        name = PurePosixPath(m.filename)
        if name.is_absolute() or ".." in name.parts or "\\" in m.filename or len(name.parts) > 3:
            raise ValueError(f"The zip holds a file outside its folders ({m.filename!r}); it was not made by NCTV.")
        if name.name not in _NAMES:
            raise ValueError(f"The zip holds {name.name!r}; a saved calibrator has only {CONFIG_NAME} and "
                             f"{TENSORS_NAME}.")
        if m.compress_type not in _METHODS:
            raise ValueError(f"{m.filename} is compressed with a method NCTV does not read (only "
                             f"{' or '.join(_METHODS.values())}); zip the calibrator folders again with an "
                             "ordinary zip tool, or use the Calibrate tab's download.")
        # Stored data is as large as it says and deflate at most a little larger (5 bytes per 64 KB block of
        # incompressible data): more compressed bytes than that hide more than the entry admits to.
        if m.compress_size > m.file_size + m.file_size // 1000 + 64:
            raise ValueError(f"{m.filename} holds more data than it claims ({m.file_size:,} bytes); the zip's sizes "
                             "are false, so it was not made by NCTV or a zip tool.")


def _model_of(names: set, state: Calibration | None) -> str:
    from nctv.zoo import ENTRIES

    if len(names) != 1 or not isinstance(name := next(iter(names)), str):
        raise ValueError("The calibrators in the zip must all name the one model they were fitted for.")
    if name not in ENTRIES and (state is None or name != state.model):
        raise ValueError(f"The calibrators were fitted for {shown(name)}, which this app does not offer; calibrate "
                         "that model in the Calibrate tab first, or use `nctv apply` on your own machine.")
    return name


def _survey(folders: list[Path]) -> tuple[set, dict[str, Path]]:
    """(the model names, method -> folder) of the zip's calibrators, reading one config.json at a time and
    keeping only those two words of each: a config may be megabytes of JSON, and several held at once
    cost several times that (4 × 15 MB of JSON: +558 MB)."""
    names, by_method = set(), {}
    for folder in folders:
        config = read_config(folder)
        name, method = (config.get("model") or {}).get("name"), config.get("method")
        del config
        names.add(name if isinstance(name, str) else None)
        if isinstance(method, str):
            by_method[method] = folder
    return names, by_method


def _load(folder: Path, loaded: Any) -> Any:
    """``load_calibrator``, refusing (as ``nctv apply`` does) a calibrator saved for other weights."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelMismatchWarning)
        try:
            return load_calibrator(folder, model=loaded)
        except ModelMismatchWarning as w:
            raise ValueError(str(w)) from None


def _in_zip(message: str, folder: Path) -> str:
    """``message`` with the folder the zip was unpacked into left out, so that it names a file as the zip
    does ("neural-clamping-fl/config.json"), not by the server's temporary path."""
    for name in {str(folder.resolve()), str(folder)}:
        message = message.replace(name + "/", "").replace(name, "the zip")
    return message


def _read_zip(path: str | Path, tmp: Path, state: Calibration | None):
    """(model, Neural Clamping's method name, its T, δ, the split, temperature scaling's T) from the zip,
    unpacked into ``tmp``."""
    names, by_method = _survey(unpack(path, tmp))
    model = _model_of(names, state)
    loaded = get_model(model)
    nc_name = next((n for n in NC_METHODS if n in by_method), None)
    if nc_name is None:
        raise ValueError(f"The zip holds no Neural Clamping calibrator (it has: "
                         f"{', '.join(shown(m) for m in sorted(by_method)) or 'none'}); tick Neural Clamping in "
                         "the Calibrate tab, run, and download again.")
    nc = _load(by_method[nc_name], loaded)
    # Only T and δ are kept: the calibrator (and its fit's history) goes before the next one is read.
    nc_t, delta = float(nc.temperature_), nc.delta_.detach().float().cpu()
    del nc
    split = SplitSpec(model, None, DEFAULT_CALIBRATION_SIZE, 0)
    ts_t = (float(_load(by_method[TS_METHOD], loaded).temperature_) if TS_METHOD in by_method
            else ts_temperature_of(split))
    return model, nc_name, nc_t, delta, split, ts_t


def calibration_from_zip(path: str | Path, state: Calibration | None) -> Calibration:
    """The visitor's new calibration from a zip: Neural Clamping's δ and T from its Neural Clamping
    calibrator, and the temperature-scaling T from its Temperature Scaling one (fitted on the
    model's default calibration split when the zip has none)."""
    with tempfile.TemporaryDirectory(prefix="nctv-upload-") as tmp:
        try:
            model, nc_name, nc_t, delta, split, ts_t = _read_zip(path, Path(tmp), state)
        except ValueError as e:
            raise ValueError(_in_zip(str(e), Path(tmp))) from None
    when = datetime.now().strftime("%H:%M:%S")
    return Calibration(split=split, model=model, ts_temperature=ts_t, nc_temperature=nc_t,
                       delta=delta, nc_method=nc_name,
                       source=f"loaded from {Path(path).name} at {when}")


@user_errors
def load_calibrators(file: Any, state: Calibration | None = None):
    """(the visitor's new calibration, a line saying what was loaded) from an uploaded zip."""
    if file is None:
        return gr.skip(), "Choose the calibrators.zip that the Calibrate tab's download offers."
    path = file if isinstance(file, (str, Path)) else getattr(file, "name", None)
    cal = calibration_from_zip(path, state)
    return cal, (f"Loaded **{cal.nc_method}** (T = {cal.nc_temperature:.3f}) and temperature scaling "
                 f"(T = {cal.ts_temperature:.3f}) for model {cal.model}; the Try and Learn tabs use them now.")
