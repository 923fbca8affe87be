"""SMART, spline calibration and Top-versus-All against their authors' code, on the same logits.

    PYTHONPATH=/path/to/netcal python -m bench.newest_parity --calibench DIR --tva DIR --spline DIR [--out FILE]

The references are the authors' repositories, checked out beside NCTV (never copied into it) and
imported from the folders given:

* ``--calibench``: ``Misakaaaaaz/calibench``. SMART: ``bench/utils/cali/smart_calibrator.py``'s ``SMART``
  as its ``bench/main.py`` runs it (``epochs=2000, patience=200, min_delta=1e-4,
  loss_fn="smooth_soft_ece"``), fitted and applied in a child process (its package ``bench`` has this
  bench's name; its ``Component`` package is imported without its ``__init__``, which needs faiss);
  spline: ``Component/model/spline.py``'s ``SplineCalibrator()`` (the whole probability vector);
* ``--spline``: ``kartikgupta-at-anu/spline-calibration`` (the paper's): ``recalibrate.py``'s
  ``get_top_results`` and ``get_recalibration_function(scores, labels, "natural", 6)``, clipped to
  [0, 1] as its ``do_plots`` does (the top-label confidence; its results logger, which needs bokeh, is
  left out);
* ``--tva``: ``allglc/tva-calibration``: ``calibrators.py``'s ``fit_scaling_model`` (``TS_tva``:
  ``"temperature"``, binary loss; ``VS_reg_tva``: ``"vector"``, binary loss, regularised,
  ``temperature_ref`` the T of TS + TvA, here NCTV's) on batches of 512, and ``fit_binary_method``
  (``"HB_tva_eqmass"``, ``"Iso_tva"``) with its ``transform`` of the confidences (netcal 1.4.0, on
  ``PYTHONPATH``). Its ``.cuda()`` calls are made no-ops (this bench runs on a CPU).

Every reference gets the rows in the order NCTV's fits take them (:func:`nctv.canonical.canonical_order`:
their batches and sums then run over the same rows in the same order) and, where it takes probabilities,
torch's float64 softmax, the confidences NCTV calibrates.

Problems: the embedded default model's shipped test logits (10,000 images, 10 classes; the first 5,000
fit, the other 5,000 compared: many top-label confidences are exactly 1 in float64); the same logits / 4;
a binary problem of many ties (the images of classes 0 and 6, their two logits rounded to whole numbers:
1,000 to fit, 1,000 compared, a few dozen distinct confidences); and
:func:`margin_problem`, where over-confidence depends on the margin z₍₁₎ − z₍₂₎ (one T cannot fix it).
Shown: the largest absolute difference of what the reference returns (probabilities, or the calibrated
top-label confidence where the reference returns only that) on the compared half.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import types
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
from safetensors.numpy import load_file

from nctv.calibration import make_method
from nctv.calibration.toplabel import binary_cross_entropy_of_temperature
from nctv.canonical import canonical_order

from bench.panel import _cuda_calls_as_no_ops
from bench.parity import LOGITS

#: Where the table is written: a section of the calibrator parity results.
RESULTS = Path(__file__).resolve().parent / "results" / "calibrator_parity.md"
HEADING = "## SMART, spline calibration and Top-versus-All against their authors' code"


def margin_problem(n: int, classes: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (n, classes) and labels whose over-confidence depends on the margin m = z₍₁₎ − z₍₂₎: labels
    are drawn from softmax(z / τ(m)) with τ(m) = 0.8 + 3·exp(−m / 1.5): rows with a small margin are far
    over-confident (τ near 3.8), rows with a large one a little under-confident (τ near 0.8), so no single
    temperature calibrates them all. Row scales vary (z = N(0, 1)·s, s uniform in [1, 5]) to spread the
    margins. float64, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 + 4.0 * torch.rand(n, 1, generator=g, dtype=torch.float64)
    z = torch.randn(n, classes, generator=g, dtype=torch.float64) * scale
    top2 = torch.topk(z, 2, dim=1).values
    tau = 0.8 + 3.0 * torch.exp(-(top2[:, 0] - top2[:, 1]) / 1.5)
    y = torch.multinomial(torch.softmax(z / tau[:, None], dim=1), 1, generator=g).squeeze(1)
    return z, y


def problems() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    t = load_file(LOGITS)
    z, y = t["Uncalibrated"].astype(np.float64), t["labels"].astype(np.int64)
    half = len(y) // 2
    keep = np.isin(y, (0, 6))
    zb, yb = np.round(z[keep][:, [0, 6]]), (y[keep] == 6).astype(np.int64)
    hb = len(yb) // 2
    zm, ym = (a.numpy() for a in margin_problem(10_000))
    return {"10 classes": (z[:half], y[:half], z[half:], y[half:]),
            "10 classes, z / 4": (z[:half] / 4, y[:half], z[half:] / 4, y[half:]),
            "2 classes, rounded (ties)": (zb[:hb], yb[:hb], zb[hb:], yb[hb:]),
            "margin-dependent": (zm[:5000], ym[:5000], zm[5000:], ym[5000:])}


def ordered(zc: np.ndarray, yc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The calibration rows in the order NCTV's fits take them."""
    order = canonical_order(torch.from_numpy(zc), torch.from_numpy(yc))
    return zc[order], yc[order]


def softmax(z: np.ndarray) -> np.ndarray:
    return torch.softmax(torch.from_numpy(np.asarray(z, dtype=np.float64)), dim=1).numpy()


def top(z: np.ndarray, y: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Top-label confidence (torch's float64 softmax) and, with labels, correctness (1.0 / 0.0)."""
    p = softmax(z)
    pred = p.argmax(1)
    return p[np.arange(len(p)), pred], None if y is None else (pred == y).astype(np.float64)


# --------------------------------------------------------------------------------------------
# NCTV's side
# --------------------------------------------------------------------------------------------


def ours(name: str, zc, yc, zt, **settings):
    cal = make_method(name, **settings).fit(torch.from_numpy(zc), torch.from_numpy(yc))
    return torch.softmax(cal.transform(torch.from_numpy(zt)).double(), dim=1).numpy(), cal


def ours_confidence(name: str, zc, yc, zt, **settings):
    cal = make_method(name, **settings).fit(torch.from_numpy(zc), torch.from_numpy(yc))
    return cal.calibrated_confidence(torch.from_numpy(zt)).numpy(), cal


# --------------------------------------------------------------------------------------------
# The references
# --------------------------------------------------------------------------------------------

REFS: dict[str, Path] = {}

_SMART_CHILD = r"""
import sys, types, json, numpy as np, torch
root = sys.argv[1]
sys.path.insert(0, root)
for name, where in (("bench", "bench"), ("bench.utils", "bench/utils"), ("Component", "Component")):
    module = types.ModuleType(name)
    module.__path__ = [root + "/" + where]
    sys.modules[name] = module
from bench.utils.cali.smart_calibrator import SMART
data = np.load(sys.argv[2])
smart = SMART(epochs=2000, seed_value=int(sys.argv[4]), loss_fn="smooth_soft_ece", patience=200, min_delta=0.0001,
              dataset_name="parity", model_name="nctv")
smart.fit(data["zc"], data["yc"])
np.save(sys.argv[3], smart.calibrate(data["zt"]))
"""


def smart_reference(zc, yc, zt, seed: int = 0) -> np.ndarray:
    zc, yc = ordered(zc, yc)
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(f"{tmp}/in.npz", zc=zc.astype(np.float32), yc=yc, zt=zt.astype(np.float32))
        subprocess.run([sys.executable, "-c", _SMART_CHILD, str(REFS["calibench"]), f"{tmp}/in.npz",
                        f"{tmp}/out.npy", str(seed)], cwd=tmp, check=True, capture_output=True)
        return np.load(f"{tmp}/out.npy").astype(np.float64)


def _calibench_spline_module():
    """calibench's ``Component.model.spline``, its packages made bare (their ``__init__`` needs faiss)."""
    root = str(REFS["calibench"])
    for name, where in (("Component", "Component"), ("Component.model", "Component/model")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [f"{root}/{where}"]
            sys.modules[name] = module
    import importlib

    return importlib.import_module("Component.model.spline")


def calibench_spline(zc, yc, zt) -> np.ndarray:
    cal = _calibench_spline_module().SplineCalibrator()
    cal.fit(*ordered(zc, yc))
    return cal.calibrate(zt)


def _authors_recalibrate():
    """The paper's ``recalibrate`` module; its results logger (``log_utils``, which needs bokeh to write HTML
    reports) stands in as an empty module: nothing here writes reports."""
    sys.path.insert(0, str(REFS["spline"]))
    sys.modules.setdefault("log_utils", types.SimpleNamespace(ResultsLog=None))
    import recalibrate

    return recalibrate


def gupta_spline(zc, yc, zt) -> np.ndarray:
    """The paper's code: the top-label confidence recalibrated by its spline, clipped to [0, 1]."""
    rc = _authors_recalibrate()
    zc, yc = ordered(zc, yc)
    scores, labels = rc.get_top_results(softmax(zc), yc, -1)
    frecal = rc.get_recalibration_function(scores, labels, "natural", 6)
    return np.clip([frecal(float(s)) for s in top(zt)[0]], 0.0, 1.0)


def gupta_spline_interpolated(zc, yc, zt) -> np.ndarray:
    """The paper's fitted points (its sorted calibration confidences and their recalibrated values) joined by
    linear interpolation, held beyond the ends and clipped: its ``interpolated_function`` weighs each end
    of an interval by the distance to that end, not to the other one (a value just above x_{i−1} takes
    nearly y_i), which is the one difference from NCTV where no confidences tie."""
    rc = _authors_recalibrate()
    zc, yc = ordered(zc, yc)
    frecal = rc.get_recalibration_function(*rc.get_top_results(softmax(zc), yc, -1), "natural", 6)
    return np.clip(np.interp(top(zt)[0], frecal.x, frecal.y), 0.0, 1.0)


def nctv_ties_in_authors_spline(zc, yc, zt) -> np.ndarray:
    """NCTV's handling of tied confidences replayed around the paper's own ``Spline``: a run of equal
    confidences takes its mean correctness before the cumulative sums, and the mean of its recalibrated
    values; between distinct confidences, linear interpolation held beyond the ends, clipped."""
    rc = _authors_recalibrate()
    c, r = top(zc, yc)
    xs, inverse, count = np.unique(c, return_inverse=True, return_counts=True)
    runs = np.repeat(np.arange(len(xs)), count)
    s, hit = np.repeat(xs, count), (np.bincount(inverse, weights=r) / count)[runs]
    n = len(s)
    spline = rc.utils.Spline(np.linspace(0.0, 1.0, n), np.cumsum(hit) / n - np.cumsum(s) / n,
                             np.linspace(0.0, 1.0, 6), runout="natural")
    values = np.bincount(runs, weights=spline.evaluate_deriv(np.linspace(0.0, 1.0, n)) + s) / count
    return np.clip(np.interp(top(zt)[0], xs, values), 0.0, 1.0)


def hb_tva_as_netcal_applies_it(zc, yc, zt) -> np.ndarray:
    """NCTV's HB + TvA bins fitted with a confidence on an edge in the bin above (``on_edge="above"``, as
    netcal's fit), then applied with it in the bin below (as netcal's ``transform``, ``np.digitize(right=True)``)."""
    from nctv.calibration.toplabel import StepCurve

    cal = make_method("hb-tva", on_edge="above").fit(torch.from_numpy(zc), torch.from_numpy(yc))
    c = torch.from_numpy(top(zt)[0])
    return StepCurve(cal.bin_edges_, cal.bin_values_, "below")(c).numpy()


def _tva_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tva_calibrators", REFS["tva"] / "calibrators.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tva_scaling(method: str, zc, yc, zt, temperature_ref: float = 1.0) -> tuple[np.ndarray, object]:
    """``fit_scaling_model(method, …, binary_loss=True)`` (``"vector"`` regularised, from ``temperature_ref``)
    on batches of 512 of the rows in NCTV's order; the probabilities of its scaled test logits."""
    from torch.utils.data import DataLoader, TensorDataset

    zc, yc = ordered(zc, yc)
    loader = DataLoader(TensorDataset(torch.from_numpy(zc).float(), torch.from_numpy(yc)), batch_size=512)
    with _cuda_calls_as_no_ops(torch.device("cpu")):
        model = _tva_module().fit_scaling_model(method, loader, zc.shape[1], binary_loss=True,
                                                regularization=method == "vector", temperature_ref=temperature_ref)
    with torch.no_grad():
        return torch.softmax(model(torch.from_numpy(zt).float()).double(), dim=1).numpy(), model


def tva_binary(method: str, zc, yc, zt) -> np.ndarray:
    """``fit_binary_method(method, …)`` and its ``transform`` of the test rows' top-label confidences, as
    the authors' ``eval_binary_method`` applies it; its fit given torch's float64 softmax."""
    zc, yc = ordered(zc, yc)
    model = _tva_module().fit_binary_method(method, torch.from_numpy(zc), torch.from_numpy(yc), zc.shape[1])
    return np.asarray(model.transform(top(zt)[0]), dtype=np.float64)


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


class Comparison(NamedTuple):
    method: str
    reference: str
    what: str
    mine: Callable
    theirs: Callable
    #: The largest absolute difference it is held to; None: a convention apart, shown only.
    tolerance: float | None
    settings: str = "defaults"


def _vs_tva_pair(zc, yc, zt):
    mine, cal = ours("vs-tva", zc, yc, zt)
    return mine, tva_scaling("vector", zc, yc, zt, temperature_ref=cal.initial_temperature_)[0]


def _ts_tva_objective(zc, yc, t: float) -> float:
    z = torch.from_numpy(zc)
    return binary_cross_entropy_of_temperature(z, (z.argmax(1) == torch.from_numpy(yc)).double(), t)


def _ts_tva_pair(zc, yc, zt):
    mine, cal = ours("ts-tva", zc, yc, zt)
    theirs, model = tva_scaling("temperature", zc, yc, zt)
    t = float(model.temp.detach())
    note = f"T {cal.temperature_:.4f} / {t:.4f}; BCE {_ts_tva_objective(zc, yc, cal.temperature_):.6f} / " \
           f"{_ts_tva_objective(zc, yc, t):.6f}"
    return mine, theirs, note


SMART_REF = "calibench SMART (smooth_soft_ece, 2,000 epochs, patience 200), seed 0"
GUPTA = "spline-calibration recalibrate.get_recalibration_function('natural', 6)"
CALIBENCH_SPLINE = "calibench SplineCalibrator()"
TVA_SCALING = "tva-calibration fit_scaling_model('{}', binary_loss=True{})"
TVA_BINARY = "tva-calibration fit_binary_method('{}') (netcal 1.4.0)"
PROBS, CONF = "probabilities", "top-label confidence"

COMPARISONS = [
    Comparison("SMART", SMART_REF, PROBS, lambda *a: ours("smart", *a)[0], smart_reference, 1e-2),
    Comparison("Spline Calibration", GUPTA, CONF, lambda *a: ours_confidence("spline", *a)[0], gupta_spline, None),
    Comparison("Spline Calibration", f"{GUPTA}, its points interpolated linearly", CONF,
               lambda *a: ours_confidence("spline", *a)[0], gupta_spline_interpolated, None),
    Comparison("Spline Calibration", f"{GUPTA} with NCTV's ties", CONF, lambda *a: ours_confidence("spline", *a)[0],
               nctv_ties_in_authors_spline, 1e-9),
    Comparison("Spline Calibration", CALIBENCH_SPLINE, PROBS, lambda *a: ours("spline", *a)[0], calibench_spline, None),
    Comparison("TS + TvA", TVA_SCALING.format("temperature", ""), PROBS, None, None, None),
    Comparison("VS + TvA", TVA_SCALING.format("vector", ", regularization=True"), PROBS, None, None, 1e-5),
    Comparison("HB + TvA", TVA_BINARY.format("HB_tva_eqmass"), CONF, lambda *a: ours_confidence("hb-tva", *a)[0],
               lambda *a: tva_binary("HB_tva_eqmass", *a), None),
    Comparison("HB + TvA", TVA_BINARY.format("HB_tva_eqmass"), CONF,
               lambda *a: ours_confidence("hb-tva", *a, on_edge="above")[0],
               lambda *a: tva_binary("HB_tva_eqmass", *a), None, "on_edge='above'"),
    Comparison("HB + TvA", TVA_BINARY.format("HB_tva_eqmass"), CONF, hb_tva_as_netcal_applies_it,
               lambda *a: tva_binary("HB_tva_eqmass", *a), 1e-12, "on_edge='above', applied as netcal applies it"),
    Comparison("Isotonic + TvA", TVA_BINARY.format("Iso_tva"), CONF, lambda *a: ours_confidence("iso-tva", *a)[0],
               lambda *a: tva_binary("Iso_tva", *a), 1e-12),
]


def compare(c: Comparison, zc, yc, zt) -> tuple[float, str]:
    """max |NCTV − reference| on the compared half, and a note (TS + TvA: T and the objective at each)."""
    note = ""
    if c.method == "TS + TvA":
        mine, theirs, note = _ts_tva_pair(zc, yc, zt)
    elif c.method == "VS + TvA":
        mine, theirs = _vs_tva_pair(zc, yc, zt)
    else:
        mine, theirs = c.mine(zc, yc, zt), c.theirs(zc, yc, zt)
    return float(np.abs(np.asarray(mine) - np.asarray(theirs)).max()), note


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


def run(methods: list[str] | None = None) -> list[str]:
    """The table's lines (printed as they come)."""
    lines = ["| method | reference | compared | NCTV settings | problem | largest difference | tolerance | note |",
             "| --- | --- | --- | --- | --- | ---: | ---: | --- |"]
    print("\n".join(lines), flush=True)
    for c in COMPARISONS:
        if methods and c.method not in methods:
            continue
        for problem, (zc, yc, zt, _) in problems().items():
            try:
                diff, note = compare(c, zc, yc, zt)
            except (ValueError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", b"") or str(e).encode()
                cells = [f"the reference refuses: {detail.decode(errors='replace').strip().splitlines()[-1]}", "", ""]
            else:
                verdict = " (convention)" if c.tolerance is None else "" if diff <= c.tolerance else " (over)"
                cells = [f"{diff:.1e}{verdict}", "" if c.tolerance is None else f"{c.tolerance:.0e}", note]
            line = "| " + " | ".join([c.method, c.reference, c.what, c.settings, problem, *cells]) + " |"
            lines.append(line)
            print(line, flush=True)
    return lines


def _split(text: str) -> tuple[str, str]:
    """``text`` without this bench's section, and that section ("" when it holds none)."""
    start = text.find(HEADING)
    if start < 0:
        return text, ""
    after = text.find("\n## ", start + len(HEADING))
    end = len(text) if after < 0 else after + 1
    return text[:start].rstrip("\n") + ("\n\n" + text[end:] if end < len(text) else "\n"), text[start:end]


def section_text(lines: list[str]) -> str:
    return (f"{HEADING}\n\nMade by `python -m bench.newest_parity` (docs/calibrators.md says what each row compares; "
            f"netcal {_version('netcal')}).\n\n" + "\n".join(lines) + "\n")


def write_section(lines: list[str], out: Path) -> None:
    """Put the table into ``out`` as its own section, replacing an earlier one (the rest of the file kept)."""
    rest = _split(out.read_text())[0].rstrip("\n") if out.exists() else ""
    out.write_text((rest + "\n\n" if rest.strip() else "") + section_text(lines))


def section(argv: list[str], out: Path | None) -> str:
    """This bench's section for ``bench.calibrator_parity``'s file ``out``, with a blank line before it: made
    now when ``argv`` names the authors' checkouts (``--calibench``, ``--tva``, ``--spline``), else the one
    ``out`` holds already, so that remaking the other sections keeps it ("" when there is none)."""
    if argv:
        args = _parser().parse_args(argv)
        REFS.update(calibench=args.calibench.resolve(), tva=args.tva.resolve(), spline=args.spline.resolve())
        return "\n" + section_text(run(args.methods))
    kept = _split(out.read_text())[1] if out is not None and out.exists() else ""
    return "\n" + kept.rstrip("\n") + "\n" if kept else ""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibench", type=Path, required=True, help="a checkout of Misakaaaaaz/calibench")
    ap.add_argument("--tva", type=Path, required=True, help="a checkout of allglc/tva-calibration")
    ap.add_argument("--spline", type=Path, required=True, help="a checkout of kartikgupta-at-anu/spline-calibration")
    ap.add_argument("--out", type=Path, help=f"where the section is written (default: {RESULTS}, unless --methods)")
    ap.add_argument("--methods", nargs="*", help="only these methods (registry names); nothing written without --out")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    REFS.update(calibench=args.calibench.resolve(), tva=args.tva.resolve(), spline=args.spline.resolve())
    lines = run(args.methods)
    out = args.out or (None if args.methods else RESULTS)
    if out is not None:
        write_section(lines, out)
        print(f"written: {out}")


if __name__ == "__main__":
    main()
