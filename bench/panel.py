"""The calibration panel and the fidelity check: cases (one per process) and their summaries.

Panel: strongly over-confident Fashion-MNIST models trained by ``scripts/make_assets.py panel``
(uncalibrated test ECE 8–10 %) plus the three mildly over-confident embedded models. On each:
uncalibrated, TS, TS grid and Dir-ODIR (deterministic, once), the default Neural Clamping, the
default started at δ₀ = 0, both recipes ("paper", "toolkit") and, when a checkout of the authors'
NCToolkit is given, its own ``NCWrapper.train_NC`` with the demo's settings, each over several seeds.
Every NCTV row is fitted and scored by the library's engine (``nctv.experiment.run_experiment``), one
seed per process; each case keeps the calibrated test logits of the rows the target compares, so that
the summary scores every row on one shared set of resamples of the test split (``nctv.intervals``,
seeds pooled) and judges the default by the paired interval of its difference to the best alternative.

Fidelity: the recipes against NCToolkit. With the same δ₀ and the same batch order the two
implementations must agree to float rounding; with each its own random batch order they must agree
to within the spread that the order alone causes (measured as the seed-to-seed spread of our own
recipe). NCToolkit is imported from the path given, never copied into this repository.
"""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from nctv.intervals import IntervalSettings
from nctv.settings import NCOptions
from nctv.results import COMPARED_METHOD, GRID_SEARCH_METHOD, MethodResult, MetricStats, method_slug, welch_test

ROOT = Path(__file__).resolve().parent.parent
#: The over-confident models of the panel (scripts/make_assets.py OVERCONFIDENT), then the mild ones.
OVERCONFIDENT = ("fmnist-resnet-overconfident", "fmnist-resnet-overconfident-s1", "fmnist-resnet-overconfident-s2",
                 "fmnist-vit-overconfident", "fmnist-mixer-overconfident")
MILD = ("fmnist-resnet", "fmnist-vit", "fmnist-mixer")
#: The logit-space baselines of the panel, deterministic.
PANEL_BASELINES = ("Temperature Scaling", "TS by Grid Search", "Dir-ODIR")
#: Today's best post-hoc methods (docs/method.md, "Neural Clamping against today's best"), deterministic: each
#: against the default Neural Clamping by the paired interval of their difference in test ECE.
NEWEST = ("SMART", "Spline Calibration", "TS + TvA", "VS + TvA", "HB + TvA", "Isotonic + TvA")
#: The registry method every Neural Clamping row of the panel is (with the row's fitter and settings).
NC_METHOD = COMPARED_METHOD
#: Bins of every panel figure.
N_BINS = 15
#: Intervals of the panel: the engine's defaults (95 %, 1,000 resamples of the test split, seed 0).
PANEL_INTERVALS = IntervalSettings()
#: The target: the upper end of the paired interval of (NC − best alternative) in test ECE, in points.
ECE_MARGIN_PT = 0.1
PASS_FRACTION_MAX = 0.2


@dataclass(frozen=True)
class PanelRow:
    """A Neural Clamping row: its fitter, further ``NeuralClamping`` settings, and whether the seed
    changes it (a deterministic row runs once, on the first seed)."""

    fitter: str = "fast"
    settings: tuple[tuple[str, Any], ...] = ()
    deterministic: bool = False

    def params(self, recipe_epochs: int) -> dict:
        """The case parameters of this row (the recipes get the run's epochs)."""
        return {"fitter": self.fitter, "settings": dict(self.settings),
                "epochs": None if self.fitter == "fast" else recipe_epochs}


#: Row labels of the panel, in table order. The default Neural Clamping starts at δ₀ = 0 and draws nothing,
#: so it is fitted once. "NC δ₀ random" is the default started at δ₀ ~ 0.1·N(0, 1) instead (the default's
#: start up to panel-13), one fit per seed. "NC δ₀=0" is the row by which panel-12 and panel-13 compared
#: δ₀ = 0 with the then random default; it is the default now, and kept for reading those reports.
ZERO_INIT_ROW = "NC δ₀=0"
RANDOM_INIT_ROW = "NC δ₀ random"
NC_ROWS = {"NC default": PanelRow(deterministic=not NCOptions().seeded),
           RANDOM_INIT_ROW: PanelRow(settings=(("init_std", 0.1),)),
           ZERO_INIT_ROW: PanelRow(settings=(("init_std", 0.0),), deterministic=True),
           "NC paper": PanelRow("paper"), "NC toolkit": PanelRow("toolkit")}
#: Why a comparison is by means: its rows' per-sample test logits were not kept (a report made before they were).
NO_LOGITS = "no per-sample logits kept for both rows"
#: The rows the default must not be worse than (those a panel has).
ALTERNATIVES = (GRID_SEARCH_METHOD, "NC paper", "NC toolkit", "NCToolkit")

#: NCWrapper settings: demo.py's (the "toolkit" recipe), and the paper recipe's optimiser, batch and δ₀
#: with cross entropy and no regulariser. NCToolkit offers only the unsquared λ₁‖δ‖₂, and its FocalLoss
#: clamps p_y to [1e-7, 1 − 1e-7] (which also silences confidently wrong samples), so λ = 0 with
#: γ = 0 (its unclamped nn.CrossEntropyLoss) is the one paper-recipe setting both can run exactly.
NCTOOLKIT_SETTINGS = {
    "toolkit": dict(lambda_1=0.01, lr=0.01, batch_size=1000, init_scale=0.001, gamma=1.0, epochs=100),
    "paper-ce-no-penalty": dict(lambda_1=0.0, lr=0.001, batch_size=512, init_scale=0.1, gamma=0.0, epochs=100),
}


def model_id(name: str, panel_dir: str | Path) -> str:
    """A zoo name for the embedded models, a local folder for the others."""
    from nctv.zoo import list_models

    if name in {e.name for e in list_models()}:
        return name
    return f"local-dir:{Path(panel_dir) / name}"


def _splits(p: dict, device: torch.device):
    """The model, its calibration split and the Fashion-MNIST test split (all of it, or ``test_size`` images)."""
    from nctv.data import get_splits
    from nctv.zoo import load_model

    loaded = load_model(model_id(p["model"], p["panel_dir"]), device=device)
    cal, test = get_splits(loaded, "fashion-mnist", calibration_size=p["cal_size"], test_size=p.get("test_size"))
    return loaded, cal, test


def _run(loaded: Any, cal: Any, test: Any, methods: list[str], p: dict, device: torch.device):
    """The engine's run of ``methods`` for the case's seed, with the case's fitter, γ, epochs and
    settings for the Neural Clamping rows: the panel's one call of ``run_experiment``. In fp32 on every
    device, so that a GPU run compares with a CPU one and with NCToolkit; intervals are made by the
    summary, over the seeds of a row and across rows."""
    from nctv.experiment import RunOptions, run_experiment
    from nctv.settings import NCOptions

    given = {"gamma": p.get("gamma"), "epochs": p.get("epochs"), **(p.get("settings") or {})}
    nc = NCOptions(fitter=p.get("fitter") or "fast", **{k: v for k, v in given.items() if v is not None})
    options = RunOptions(seeds=[p.get("seed", 0)], bins=[N_BINS], nc=nc, device=device, progress=False,
                         precision="fp32", intervals=None)
    return run_experiment(loaded, cal, test, methods, options)


def _keep_logits(p: dict, label: str, logits: torch.Tensor, labels: Any, test: Any = None) -> str:
    """Write one row's calibrated test logits (and the labels, and the test pictures' content keys that a
    run keys its resamples by, ``nctv.data.row_keys``, where ``test`` gives them) under ``p["logits_dir"]``;
    returns the path as the report records it (relative to the repository when inside it)."""
    from safetensors.torch import save_file

    from nctv.data import row_keys

    path = Path(p["logits_dir"]) / p["model"] / f"{method_slug(label)}-seed{p.get('seed', 0)}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"logits": logits.detach().float().cpu().contiguous(),
               "labels": torch.as_tensor(np.asarray(labels)).to(torch.int32).contiguous()}
    keys = None if test is None else row_keys(test)
    if keys is not None:
        tensors["keys"] = torch.from_numpy(keys.view(np.int64).copy())  # the 64-bit words, as int64
    save_file(tensors, str(path))
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


def case_panel_baselines(p: dict, device: torch.device) -> dict:
    """Uncalibrated, TS, TS grid, Dir-ODIR and today's best (``NEWEST``) on one model (test ECE, 15 bins; fit
    seconds); the calibrated test logits of TS grid and of today's best are kept for the paired comparisons,
    and the uncalibrated ones, which key the resamples."""
    loaded, cal, test = _splits(p, device)
    result = _run(loaded, cal, test, ["Uncalibrated", *PANEL_BASELINES, *NEWEST], p, device)
    rows = {}
    for name, m in result.methods.items():
        row = {"test_ece": result.stats(name, "ece", N_BINS).mean, "accuracy": result.stats(name, "accuracy", N_BINS).mean,
               "seconds": 0.0 if m.is_reference else m.fit_seconds[0]}
        if "temperature" in m.params:
            row["temperature"] = float(m.params["temperature"])
        # The uncalibrated logits too: the key of the run's resamples (row_draws).
        if (name in ALTERNATIVES or name in NEWEST or name == "Uncalibrated") and p.get("logits_dir"):
            row["logits"] = _keep_logits(p, name, m.test_logits, result.test_labels, test)
        rows[name] = row
    return {"model": p["model"], "cal_size": result.calibration["size"], "test_size": result.test["size"],
            "methods": rows}


def case_panel_nc(p: dict, device: torch.device) -> dict:
    """One Neural Clamping fit by the engine: ``fitter`` ("fast" is the library's default), ``epochs``
    and ``gamma`` (None: the method's own), further ``settings``, one ``seed``."""
    from bench.cases import _memory, _rss_mb

    loaded, cal, test = _splits(p, device)
    rss_before = _rss_mb()
    result = _run(loaded, cal, test, [NC_METHOD], p, device)
    m = result.methods[NC_METHOD]
    out: dict[str, Any] = dict(_memory(device, rss_before))
    out.update(model=p["model"], row=p.get("row"), fitter=result.fitter, seed=p.get("seed", 0),
               settings=p.get("settings") or {}, passes=float(m.params["n_passes"]), seconds=m.fit_seconds[0],
               temperature=float(m.params["temperature"]), delta_norm=float(m.params["delta_l2"]),
               gamma=float(m.params["gamma"]), weight_decay=float(m.params["weight_decay"]),
               test_ece=result.stats(NC_METHOD, "ece", N_BINS).mean,
               accuracy=result.stats(NC_METHOD, "accuracy", N_BINS).mean,
               cal_size=result.calibration["size"], test_size=result.test["size"])
    if p.get("logits_dir"):
        out["logits"] = _keep_logits(p, p.get("row") or NC_METHOD, m.test_logits, result.test_labels, test)
    if p.get("keep_delta"):
        out["delta"] = m.delta.flatten().tolist()
    return out


@contextlib.contextmanager
def _cuda_calls_as_no_ops(device: torch.device):
    """NCWrapper calls ``.cuda()`` on the model, itself, its losses and every batch. On a CPU those
    calls are made no-ops for the duration (in this bench process only); on a GPU they run as written."""
    if device.type == "cuda":
        yield
        return
    saved = torch.nn.Module.cuda, torch.Tensor.cuda
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.nn.Module.cuda, torch.Tensor.cuda = saved


class EpochPermutations(torch.utils.data.Sampler):
    """Batches of a fresh ``torch.randperm(n, generator)`` every epoch: the batch order of our SGD
    recipes, so NCWrapper can be fed exactly the batches our fitter sees."""

    def __init__(self, n: int, batch_size: int, generator: torch.Generator):
        self.n, self.batch_size, self.generator = n, batch_size, generator

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.generator)
        for s in range(0, self.n, self.batch_size):
            yield order[s:s + self.batch_size].tolist()

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)


def case_nctoolkit(p: dict, device: torch.device) -> dict:
    """NCToolkit's own ``NCWrapper.train_NC`` on a panel model.

    ``order`` "own": δ₀ from NCWrapper's constructor under ``torch.manual_seed(seed)`` and a shuffled
    DataLoader, as a user runs it. ``order`` "same": δ₀ and the batch order drawn exactly as our SGD
    recipes draw them from ``torch.Generator().manual_seed(seed)``, for a like-for-like comparison.
    """
    from bench.cases import timed, warm_up
    from nctv.metrics import ece

    s = dict(NCTOOLKIT_SETTINGS[p["settings"]])
    s["epochs"] = int(p.get("epochs", s["epochs"]))
    loaded, cal, test = _splits(p, device)
    (x, y), (xt, yt) = cal.tensors(), test.tensors()
    x, y, xt = x.to(device), y.to(device), xt.to(device)
    warm = warm_up(loaded.model, x, device)
    sys.path.insert(0, str(Path(p["nctoolkit"]).resolve()))
    from neural_clamping.nc_wrapper import NCWrapper  # the authors' code, from the path given

    dataset = torch.utils.data.TensorDataset(x, y)
    shape = tuple(x.shape[1:])
    k = int(loaded.num_classes)
    out: dict[str, Any] = {}
    with _cuda_calls_as_no_ops(device):
        torch.manual_seed(p["seed"])
        nc = NCWrapper(loaded.model, num_classes=k, lambda_0=1, lambda_1=s["lambda_1"], image_size=shape,
                       init_scale=s["init_scale"], dropout_p=0.0, init_temp=1.0)
        nc.to(device)
        if p["order"] == "same":
            gen = torch.Generator().manual_seed(p["seed"])
            nc.perturbation.data = (s["init_scale"] * torch.randn(shape, generator=gen)).to(device)
            loader = torch.utils.data.DataLoader(dataset, batch_sampler=EpochPermutations(len(y), s["batch_size"], gen))
        else:
            loader = torch.utils.data.DataLoader(dataset, batch_size=s["batch_size"], shuffle=True,
                                                 generator=torch.Generator().manual_seed(p["seed"]))
        with timed(device, out):
            nc.train_NC(loader, epoch=s["epochs"], lr=s["lr"], momentum=0.9, verbose=None,
                        focal_loss=s["gamma"] > 0, gamma=s["gamma"])
    delta = nc.perturbation.detach()
    temp = float(nc.temperature.detach())
    with torch.no_grad():
        z = torch.cat([loaded.model(xt[i:i + 512] + delta) for i in range(0, len(xt), 512)]).cpu() / temp
    out.update(model=p["model"], settings=p["settings"], order=p["order"], seed=p["seed"], temperature=temp,
               delta_norm=float(delta.norm()), passes=float(s["epochs"]), epochs=s["epochs"], test_ece=ece(z, yt),
               accuracy=float((z.argmax(1) == yt).double().mean()), warmup_seconds=warm)
    if p.get("logits_dir") and p["order"] == "own" and p["settings"] == "toolkit":
        out["logits"] = _keep_logits(p, "NCToolkit", z, yt)
    if p.get("keep_delta"):
        out["delta"] = delta.flatten().cpu().tolist()
    return out


CASES = {"panel_baselines": case_panel_baselines, "panel_nc": case_panel_nc, "nctoolkit": case_nctoolkit}


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for one value), as the engine's ``MetricStats``."""
    stats = MetricStats.from_runs(values)
    return stats.mean, stats.std


def welch(sample: list[float], reference: list[float], name: str = "sample", other: str = "reference") -> dict:
    """The engine's Welch's t-test (``nctv.results.welch_test``) of the ``sample`` values against the
    ``reference`` values (a deterministic reference, one value, gives the one-sample test). Negative t:
    ``sample`` is lower."""
    def runs(label: str, values: list[float]) -> MethodResult:
        stats = MetricStats.from_runs(values)
        return MethodResult(name=label, stochastic=len(values) > 1, uses_model=False, seeds=list(range(len(values))),
                            metrics={N_BINS: {"ece": stats}}, fit_seconds=[])

    w = welch_test("ece", N_BINS, runs(name, sample), runs(other, reference))
    return {"t": w.t, "p": w.p, "df": w.df, "note": w.note}


def _resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else ROOT / p


class Row(NamedTuple):
    """A row's test ECE on the shared resamples (``draws``), and its calibration test's p-value, as the
    engine scores a method: the p-value decides whether its interval, and its pairs, reach the boundary."""

    draws: Any
    p: float


def row_draws(runs_by_row: dict[str, list[dict]], settings: IntervalSettings = PANEL_INTERVALS) -> dict[str, Row]:
    """Every row's test ECE on one shared set of resamples of the test split, and its calibration test
    (``Row``) (``nctv.intervals``: one
    count matrix for all rows, so differences are paired; a row's seeds are redrawn with each resample
    and pooled, as the engine pools a stochastic method's seeds, row after row in the order given).
    Rows whose runs did not all keep their logits (rows lent by reports made before logits were kept)
    or whose labels differ from the first row's (another test split) are left out."""
    from safetensors.torch import load_file

    from nctv.consistency import consistency_test
    from nctv.intervals import method_draws, resample_counts_for, seed_counts

    loaded: dict[str, tuple[list[torch.Tensor], torch.Tensor]] = {}
    pictures = None  # the test pictures' content keys, where a kept file holds them
    for label, runs in runs_by_row.items():
        if runs and all(r.get("logits") and _resolve(r["logits"]).is_file() for r in runs):
            files = [load_file(str(_resolve(r["logits"]))) for r in runs]
            loaded[label] = ([f["logits"] for f in files], files[0]["labels"].long())
            if pictures is None and "keys" in files[0]:
                pictures = files[0]["keys"].numpy().view(np.uint64)
    if not loaded:
        return {}
    labels = next(iter(loaded.values()))[1]
    # As a run keys them (nctv.experiment.resample_key): by the test pictures' content and the labels, the
    # same for the test rows in any order and on any machine. Rows kept before the files held the pictures'
    # keys: by the unperturbed model's test logits (the first row's where no uncalibrated row was kept).
    key = pictures
    if key is None or len(key) != len(labels):
        key = loaded["Uncalibrated"][0][0] if "Uncalibrated" in loaded else next(iter(loaded.values()))[0][0]
        pictures = None
    counts = resample_counts_for((key, labels), settings.resamples, settings.seed)
    # One generator redraws the seeds of every row in turn, as the engine does over a run's methods: rows
    # whose seeds are independent fits get independent redraws.
    generator = torch.Generator().manual_seed(settings.seed + 1)
    out = {}
    for label, (logits, y) in loaded.items():
        if not torch.equal(y, labels):
            continue
        seeds = seed_counts(len(logits), settings.resamples, generator) if len(logits) > 1 else None
        test = consistency_test(logits, labels, N_BINS, settings.resamples, settings.seed, key=pictures)
        out[label] = Row(method_draws(logits, labels, counts, N_BINS, ["ece"], seeds)["ece"], test.p_top_label)
    return out


def row_interval(row: Row, level: float = PANEL_INTERVALS.level) -> Any:
    """The row's ECE interval as a run gives it (``nctv.intervals.interval``, then ``at_boundary``)."""
    from nctv.intervals import at_boundary, interval

    return at_boundary(interval(row.draws, "ece", level), row.p, level)


def paired(a: Row, b: Row, level: float = PANEL_INTERVALS.level) -> dict:
    """The paired interval of (a − b) in test ECE points, as a run's comparisons give it (widened where a
    row's calibration test cannot reject, ``nctv.intervals.difference_at_boundary``), and whether it lies
    below, around or above 0."""
    from nctv.intervals import difference, difference_at_boundary

    d = difference_at_boundary(difference(a.draws, b.draws, level), row_interval(a, level), row_interval(b, level),
                               a.p, b.p, level)
    relation = "lower" if d.high < 0 else "higher" if d.low > 0 else "tied"
    return {"difference": 100 * d.estimate, "low": 100 * d.low, "high": 100 * d.high, "relation": relation}


def ece_target(label: str, means: dict[str, float], draws: dict[str, Any], lent: set[str]) -> dict | None:
    """The target of row ``label``: not worse than the best alternative (lowest mean test ECE among
    ``ALTERNATIVES`` present in ``means``). With both rows' logits: the upper end of the paired interval
    of (row − best alternative), seeds pooled, at most +0.1 point. Without (a row lent by a report that
    kept no logits): the earlier rule, the row's mean at most 0.1 point above the alternative's, and the
    target says so. The paired intervals against every other alternative with logits are given too."""
    present = [k for k in ALTERNATIVES if k in means]
    if label not in means or not present:
        return None
    best = min(present, key=lambda k: means[k])
    out: dict[str, Any] = {"best_alternative": best, "measured": means[label],
                           "against": {k: means[k] for k in present},
                           "paired": {k: paired(draws[label], draws[k]) for k in present if label in draws and k in draws},
                           "not_paired": [k for k in present if k not in draws or label not in draws],
                           "lent": sorted(k for k in present if k in lent)}
    if best in out["paired"]:
        # Met where the whole interval lies at or below the limit, missed where it lies above it; an
        # interval across the limit cannot tell, and the verdict says so instead of calling it missed.
        c = out["paired"][best]
        out.update(rule="paired", met=True if c["high"] <= ECE_MARGIN_PT + 1e-9 else False if c["low"] > ECE_MARGIN_PT
                   else None)
    else:
        out.update(rule="means", value=means[best] + ECE_MARGIN_PT, met=means[label] <= means[best] + ECE_MARGIN_PT + 1e-9)
    return out


def panel_summary(model: str, baselines: dict, nc_runs: dict[str, list[dict]], draws: dict[str, Any] | None = None) -> dict:
    """Per model: every row's mean ± std test ECE, passes and seconds, and its 95 % interval where its
    logits are in ``draws`` (see ``row_draws``); the default against the best baseline (Welch); the
    targets: the default not worse than the best alternative (``ece_target``), with at most 1/5 of the
    toolkit recipe's passes; the δ₀ = 0 row paired against the default, with its own ECE target."""
    draws = draws or {}
    rows: dict[str, dict] = {}
    for name, r in baselines["methods"].items():
        rows[name] = {"ece": [100 * r["test_ece"]], "seconds": [r["seconds"]], "passes": [0.0],
                      "temperature": [r.get("temperature", 1.0)]}
    lent = set()
    for label, runs in nc_runs.items():
        ok = [r for r in runs if "test_ece" in r]
        if ok:
            rows[label] = {"ece": [100 * r["test_ece"] for r in ok], "seconds": [r["seconds"] for r in ok],
                           "passes": [r["passes"] for r in ok], "temperature": [r["temperature"] for r in ok],
                           "delta_norm": [r["delta_norm"] for r in ok]}
            if all(r.get("from_report") for r in ok):
                lent.add(label)
    best_baseline = min((n for n in PANEL_BASELINES if n in rows), key=lambda n: rows[n]["ece"][0])
    out: dict[str, Any] = {"model": model, "uncalibrated_ece": rows["Uncalibrated"]["ece"][0],
                           "rows": {k: {f: mean_std(v) for f, v in r.items()} for k, r in rows.items()},
                           "n_seeds": {k: len(r["ece"]) for k, r in rows.items()}, "best_baseline": best_baseline,
                           "intervals": {}}
    if "NC default" in draws:  # the default against each of today's best, paired
        out["newest"] = {k: paired(draws["NC default"], draws[k]) for k in NEWEST if k in draws}
    for k, row in draws.items():
        ci = row_interval(row)
        out["intervals"][k] = [100 * ci.low, 100 * ci.high]
    means = {k: float(np.mean(r["ece"])) for k, r in rows.items()}
    default = rows.get("NC default")
    if default:
        out["welch_vs_best_baseline"] = welch(default["ece"], rows[best_baseline]["ece"], "NC default", best_baseline)
        out["ece_target"] = ece_target("NC default", means, draws, lent)
        if "NC toolkit" in rows:
            ratio = float(np.mean(default["passes"])) / float(np.mean(rows["NC toolkit"]["passes"]))
            out["pass_target"] = {"ratio": ratio, "met": ratio <= PASS_FRACTION_MAX + 1e-9}
    # δ₀ = 0 against a random δ₀: before the switch the zero row against the (random) default, after it
    # the (zero) default against the random row.
    pair = (ZERO_INIT_ROW, "NC default") if ZERO_INIT_ROW in rows else ("NC default", RANDOM_INIT_ROW)
    if all(p in rows for p in pair):
        zero, random = pair
        out["zero_init"] = {"rows": list(pair),
                            "against_default": paired(draws[zero], draws[random]) if zero in draws and random in draws
                            else None,
                            "means": [means[zero], means[random]],
                            "passes": [float(np.mean(rows[zero]["passes"])), float(np.mean(rows[random]["passes"]))],
                            "ece_target": ece_target(zero, means, draws, lent)}
    return out


def same_order_comparison(ours: dict, theirs: dict) -> dict:
    """T, the largest |δ| difference and test ECE (%) of two fits that saw the same batches."""
    return {
        "temperature": [ours["temperature"], theirs["temperature"]],
        "max_abs_delta_difference": float(np.abs(np.asarray(ours["delta"]) - np.asarray(theirs["delta"])).max()),
        "test_ece_pt": [100 * ours["test_ece"], 100 * theirs["test_ece"]],
    }


def fidelity_summary(model: str, ours: list[dict], theirs_own: list[dict], same: dict | None,
                     ours_same: dict | None) -> dict:
    """Our toolkit recipe against NCToolkit: same-order differences (float rounding) and own-order
    means (tolerance: 2 × the larger seed-to-seed standard deviation, at least the same-order gap)."""
    out: dict[str, Any] = {"model": model}
    if same is not None and ours_same is not None:
        out["same_order"] = same_order_comparison(ours_same, same)
    if ours and theirs_own:
        fields = {"temperature": 1.0, "delta_norm": 1.0, "test_ece": 100.0}
        comp = {}
        for f, scale in fields.items():
            a = [scale * r[f] for r in ours]
            b = [scale * r[f] for r in theirs_own]
            (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
            tol = 2.0 * max(sa, sb)
            comp[f] = {"ours": (ma, sa), "nctoolkit": (mb, sb), "difference": ma - mb, "tolerance": tol,
                       "within": abs(ma - mb) <= tol + 1e-12, "welch_p": welch(a, b)["p"]}
        out["own_order"] = comp
    return out


# --------------------------------------------------------------------------------------------
# Plan and report
# --------------------------------------------------------------------------------------------

def plan(args, common: dict) -> list[tuple[str, dict, str]]:
    """(case, params, label) for the fidelity section (first: it is short), then the panel."""
    first: list[tuple[str, dict, str]] = []
    out: list[tuple[str, dict, str]] = []
    base = dict(common, panel_dir=str(args.panel_dir), cal_size=args.cal_size, test_size=args.test_size,
                logits_dir=str(Path(args.out).resolve() / "logits"))
    epochs = {"epochs": args.recipe_epochs}
    seeds = list(range(args.panel_seeds))
    rows = getattr(args, "panel_rows", None) or [*NC_ROWS, "NCToolkit"]
    tk_seeds = list(range(getattr(args, "nctoolkit_seeds", None) or args.panel_seeds))
    if "fidelity" in args.sections and args.nctoolkit:
        for model in args.fidelity_models:
            kw = dict(base, model=model, seed=0, keep_delta=True, nctoolkit=str(args.nctoolkit), **epochs)
            if "panel" not in args.sections or model not in args.panel_models:
                first.append(("panel_nc", dict(base, model=model, seed=0, keep_delta=True, row="NC toolkit",
                                               **NC_ROWS["NC toolkit"].params(args.recipe_epochs)),
                              f"fidelity {model}: toolkit recipe, seed 0"))
            first.append(("nctoolkit", dict(kw, settings="toolkit", order="same"),
                          f"fidelity {model}: NCToolkit toolkit, same batches"))
            if not ("panel" in args.sections and model in args.panel_models and "NCToolkit" in rows):
                for seed in tk_seeds:  # the own-order runs, when the panel does not run them
                    first.append(("nctoolkit", dict(base, model=model, settings="toolkit", order="own", seed=seed,
                                                    nctoolkit=str(args.nctoolkit), **epochs),
                                  f"fidelity {model}: NCToolkit own order, seed {seed}"))
            first.append(("panel_nc", dict(base, model=model, fitter="paper", seed=0, keep_delta=True,
                                           row="NC paper (CE, no penalty)", settings={"weight_decay": 0.0},
                                           gamma=0.0, **epochs),
                          f"fidelity {model}: paper recipe, cross entropy, no penalty"))
            first.append(("nctoolkit", dict(kw, settings="paper-ce-no-penalty", order="same"),
                          f"fidelity {model}: NCToolkit, paper settings with cross entropy, no penalty, same batches"))
    if "panel" in args.sections:
        for model in args.panel_models:
            out.append(("panel_baselines", dict(base, model=model), f"panel {model}: baselines"))
            for label, row in NC_ROWS.items():
                if label not in rows:
                    continue
                for seed in seeds[:1] if row.deterministic else seeds:
                    out.append(("panel_nc", dict(base, model=model, seed=seed, row=label,
                                                 keep_delta=row.fitter == "toolkit" and seed == 0,
                                                 **row.params(args.recipe_epochs)),
                                f"panel {model}: {label} seed {seed}"))
            if args.nctoolkit and "NCToolkit" in rows:
                for seed in tk_seeds:
                    out.append(("nctoolkit", dict(base, model=model, settings="toolkit", order="own", seed=seed,
                                                  nctoolkit=str(args.nctoolkit), **epochs),
                                f"panel {model}: NCToolkit seed {seed}"))
    return first + out


def _pick(results: list[dict], **match) -> list[dict]:
    return [r for r in results if all(r.get(k) == v for k, v in match.items()) and "error" not in r
            and not r.get("capped")]


def add_reference_rows(results: dict, reports: list[Path]) -> None:
    """Neural Clamping and NCToolkit rows of earlier reports that ``results`` lacks, added in place.

    A row (model and row name; for NCToolkit, model, settings and batch order) this run made is kept
    as it is; one it did not make is taken whole from the report that has the most finished runs of
    it (the first listed on a tie), each run marked ``from_report`` (the report's path and commit; a
    row that report itself carried over keeps the report it came from). ``results["panel_references"]``
    lists the reports."""
    import json

    def key(kind: str, r: dict) -> tuple:
        return (r.get("model"), r.get("row")) if kind == "panel_nc" else (r.get("model"), r.get("settings"), r.get("order"))

    listed = results.setdefault("panel_references", [])
    have = {kind: {key(kind, r) for r in results.get(kind, [])} for kind in ("panel_nc", "nctoolkit")}
    offers: dict[tuple, list[dict]] = {}
    for path in reports:
        report = json.loads(Path(path).read_text())
        run = report.get("run", {})
        where = f"{path} (commit {run.get('commit')}{', with local changes' if run.get('dirty') else ''})"
        listed.append({"report": str(path), "commit": run.get("commit"), "dirty": run.get("dirty"),
                       "started": run.get("started")})
        for kind in ("panel_nc", "nctoolkit"):
            rows: dict[tuple, list[dict]] = {}
            for r in report.get("results", {}).get(kind, []):
                if key(kind, r) not in have[kind] and "error" not in r and not r.get("capped"):
                    rows.setdefault((kind, *key(kind, r)), []).append(dict(r, from_report=r.get("from_report") or where))
            for k, runs in rows.items():
                if len(runs) > len(offers.get(k, [])):
                    offers[k] = runs
    for (kind, *_), runs in offers.items():
        results.setdefault(kind, []).extend(runs)


def summarise(results: dict) -> dict:
    """Panel and fidelity summaries from the raw case results."""
    nc_all = results.get("panel_nc", [])
    tk_all = results.get("nctoolkit", [])
    out: dict[str, Any] = {"panel": [], "fidelity": [], "intervals": PANEL_INTERVALS.to_dict()}
    for b in results.get("panel_baselines", []):
        if "error" in b or b.get("capped"):
            continue
        model = b["model"]
        runs = {label: _pick(nc_all, model=model, row=label) for label in NC_ROWS}
        own = _pick(tk_all, model=model, settings="toolkit", order="own")
        if own:
            runs["NCToolkit"] = own
        kept = {name: [r] for name, r in b["methods"].items()
                if name in ALTERNATIVES or name in NEWEST or name == "Uncalibrated"}
        summary = panel_summary(model, b, runs, row_draws({**kept, **{k: v for k, v in runs.items() if v}}))
        summary["from_reports"] = sorted({r["from_report"] for rs in runs.values() for r in rs if r.get("from_report")})
        summary["referenced_rows"] = [label for label, rs in runs.items() if rs and all(r.get("from_report") for r in rs)]
        out["panel"].append(summary)
    compared = {r["model"] for r in tk_all if r.get("order") == "same"}
    compared |= {r["model"] for r in tk_all if r.get("order") == "own" and r.get("settings") == "toolkit"
                 and _pick(nc_all, model=r["model"], row="NC toolkit")}
    for model in sorted(compared):
        same = _pick(tk_all, model=model, settings="toolkit", order="same")
        ours_same = _pick(nc_all, model=model, row="NC toolkit", seed=0)
        ours = _pick(nc_all, model=model, row="NC toolkit")
        own = _pick(tk_all, model=model, settings="toolkit", order="own")
        f = fidelity_summary(model, ours, own, same[0] if same else None,
                             next((r for r in ours_same if "delta" in r), None))
        p_same = _pick(tk_all, model=model, settings="paper-ce-no-penalty", order="same")
        p_ours = _pick(nc_all, model=model, row="NC paper (CE, no penalty)")
        if p_same and p_ours:
            f["paper_no_penalty_same_order"] = same_order_comparison(p_ours[0], p_same[0])
        out["fidelity"].append(f)
    return out


def _ms(v: tuple[float, float] | None, digits: int = 2) -> str:
    if v is None:
        return "–"
    mean, std = v
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _same_order_rows(model: str, what: str, c: dict, with_ece: bool = False) -> list[str]:
    """Fidelity table rows of one same-batches comparison (see ``same_order_comparison``)."""
    (t_ours, t_theirs), (e_ours, e_theirs) = c["temperature"], c["test_ece_pt"]
    rows = [f"| {model} | {what}, same batches: T | {t_ours:.6f} | {t_theirs:.6f} | {t_ours - t_theirs:.2e} | – | – | – |",
            f"| {model} | {what}, same batches: max abs δ difference | | | {c['max_abs_delta_difference']:.2e} | – | – | – |"]
    if with_ece:
        rows.append(f"| {model} | {what}, same batches: test ECE % | {e_ours:.3f} | {e_theirs:.3f} | "
                    f"{e_ours - e_theirs:+.3f} | – | – | – |")
    return rows


def _pt(v: float) -> str:
    """A signed figure in points, with a real minus sign."""
    text = f"{abs(v):.2f}"
    return ("−" if v < 0 and float(text) != 0 else "+") + text


def _paired_text(first: str, second: str, c: dict) -> str:
    """"NC default − TS by Grid Search: −0.08 [−0.21, +0.05] point, tied"."""
    return (f"{first} − {second}: {_pt(c['difference'])} [{_pt(c['low'])}, {_pt(c['high'])}] point, "
            f"{c['relation']}")


def target_verdict(t: dict) -> str:
    """"met", "**missed**", or, for a paired interval across the limit, "not shown"."""
    return {True: "met", False: "**missed**", None: "not shown"}[t["met"]]


def target_lines(label: str, t: dict, level: str) -> list[str]:
    """The ECE target of row ``label`` in words, with the interval it was judged by."""
    best = t["best_alternative"] + (" †" if t["best_alternative"] in t["lent"] else "")
    if t["rule"] == "paired":
        c = t["paired"][t["best_alternative"]]
        limit = _pt(ECE_MARGIN_PT)
        why = {True: f"upper end {_pt(c['high'])} ≤ {limit}", False: f"lower end {_pt(c['low'])} > {limit}",
               None: f"the interval holds {limit}: too wide to tell"}[t["met"]]
        line = (f"ECE target, {label} not worse than the best alternative ({best}): "
                f"{_paired_text(label, t['best_alternative'], c)} ({level} interval, paired, seeds pooled); "
                f"{why}: {target_verdict(t)}.")
    else:
        verdict = "met" if t["met"] else f"**missed by {t['measured'] - t['value']:.2f} point**"
        line = (f"ECE target, {label} not worse than the best alternative ({best}): judged by the earlier rule on "
                f"means, not by a paired interval ({NO_LOGITS}): {t['measured']:.2f} % ≤ {t['value']:.2f} % "
                f"(its mean + 0.1): {verdict}.")
    others = [k for k in t["paired"] if k != t["best_alternative"]]
    if others:
        line += " Against the others: " + "; ".join(_paired_text(label, k, t["paired"][k]) for k in others) + "."
    unjudged = [k for k in t["not_paired"] if k != t["best_alternative"]]
    if unjudged:
        line += (f" Not paired ({NO_LOGITS}), means: "
                 + ", ".join(f"{k} {t['against'][k]:.2f} %" for k in unjudged) + ".")
    return [line]


def newest_table(panel: list[dict], level: str) -> list[str]:
    """Neural Clamping against today's best: per model, the default's test ECE, each method's, and the paired
    interval of (NC default − method) in points: *NC better* where it lies below 0, *worse* above, else *tied*."""
    models = [m for m in panel if m.get("newest")]
    if not models:
        return []
    names = [n for n in NEWEST if any(n in m["newest"] for m in models)]
    lines = ["## Neural Clamping against today's best", "",
             f"Test ECE in % (15 bins) of the default Neural Clamping (*NC*) and of each method; below it the {level} "
             "paired interval of (NC − method) in points on the shared resamples: **NC better** where it lies below 0, "
             "**NC worse** where above, *tied* where it holds 0.", "",
             "| model | NC | " + " | ".join(names) + " |", "| --- | ---: | " + " | ".join("---:" for _ in names) + " |"]
    verdict = {"lower": "**NC better**", "higher": "**NC worse**", "tied": "tied"}
    for m in models:
        cells = []
        for n in names:
            c = m["newest"].get(n)
            cells.append("–" if c is None else f"{m['rows'][n]['ece'][0]:.2f}<br>{c['difference']:+.2f} "
                                               f"[{c['low']:+.2f}, {c['high']:+.2f}] {verdict[c['relation']]}")
        lines.append(f"| {m['model']} | {m['rows']['NC default']['ece'][0]:.2f} | " + " | ".join(cells) + " |")
    counts = {r: sum(m["newest"][n]["relation"] == r for m in models for n in m["newest"]) for r in verdict}
    lines += ["", f"Over {sum(counts.values())} pairs: NC better in {counts['lower']}, worse in {counts['higher']}, "
                  f"tied in {counts['tied']}.", ""]
    return lines


def _zero_init_table(panel: list[dict], level: str) -> list[str]:
    """Across the models: the default started at δ₀ = 0 against the default, paired."""
    rows = [m for m in panel if m.get("zero_init")]
    if not rows:
        return []
    zero, random = rows[0]["zero_init"].get("rows", [ZERO_INIT_ROW, "NC default"])
    lines = ["### δ₀ = 0 against a random δ₀", "",
             f"*{zero}* starts at δ₀ = 0, *{random}* at δ₀ ~ 0.1·N(0, 1) (`NeuralClamping(init_std=0.1)`), every "
             "other setting the default's. From δ₀ = 0 the seed draws nothing, so that row is fitted once. The "
             f"difference is paired ({level} interval; the random row's seeds pooled). *Its target*: the ECE target "
             "above, for the δ₀ = 0 row.", "",
             f"| model | {zero} ECE % | {random} ECE % | difference, point | passes {zero} / {random} | "
             "its target |", "| --- | ---: | ---: | --- | ---: | --- |"]
    for m in rows:
        z = m["zero_init"]
        c = z["against_default"]
        diff = "not paired (no logits)" if c is None else \
            f"{_pt(c['difference'])} [{_pt(c['low'])}, {_pt(c['high'])}], {c['relation']}"
        t = z["ece_target"]
        target = "–" if t is None else target_verdict(t) + ("" if t["rule"] == "paired" else " (means)")
        lines.append(f"| {m['model']} | {z['means'][0]:.2f} | {z['means'][1]:.2f} | {diff} | "
                     f"{z['passes'][0]:.1f} / {z['passes'][1]:.1f} | {target} |")
    return lines + [""]


def markdown(summary: dict, settings: dict) -> list[str]:
    lines: list[str] = []
    seeds = settings.get("panel_seeds")
    iv = summary.get("intervals") or PANEL_INTERVALS.to_dict()
    level = f"{100 * iv['level']:g} %"
    if summary["panel"]:
        lines += ["## Panel: Neural Clamping against the recipes and the baselines", "",
                  f"Each model calibrated on its {settings.get('cal_size')} calibration-pool images, scored on the "
                  f"{'10,000' if settings.get('test_size') is None else settings.get('test_size')} test images; test ECE "
                  f"in % (15 bins), mean ± std over {seeds} seeds for the stochastic rows (baselines are deterministic), "
                  "fitted and scored by the engine (`run_experiment`). *NC default* is `NeuralClamping()` with every "
                  f"default; *{ZERO_INIT_ROW}* the default started at δ₀ = 0 (`init_std=0`, fitted once); *NC paper* and "
                  "*NC toolkit* are the two recipes (`fitter=\"paper\"`, `fitter=\"toolkit\"`); *NCToolkit* is the "
                  "authors' own `NCWrapper.train_NC` with demo.py's settings, its own batch shuffling and δ₀. Passes "
                  "over the calibration split: forward + backward to the input = 1, forward only = 0.5. "
                  f"*{level} interval*: of the row's test ECE, from {iv['resamples']:,} resamples of the test split "
                  f"(seed {iv['seed']}, {iv['method']}) shared by every row, a row's seeds redrawn with each resample. "
                  "The targets: the default not worse than the best alternative (the lowest mean ECE of TS by grid "
                  f"search, the recipes and NCToolkit), i.e. the upper end of the {level} paired interval of "
                  f"(NC default − best alternative), seeds pooled, at most {_pt(ECE_MARGIN_PT)} point; *tied* when that "
                  "interval holds 0. The target is *met* when the whole interval lies at or below the limit, *missed* "
                  "when it lies above it, and *not shown* when it holds the limit: the test split cannot tell. A row "
                  "lent by an earlier report that kept no per-sample logits cannot be paired: "
                  "against it the earlier rule on means applies (the default's mean ECE at most 0.1 point above its "
                  "mean), and the verdict says so. The cost target: at most a fifth of the toolkit recipe's passes.", ""]
        for m in summary["panel"]:
            r = m["rows"]
            intervals = m.get("intervals", {})
            lines += [f"### {m['model']} (uncalibrated test ECE {m['uncalibrated_ece']:.2f} %)", "",
                      f"| method | test ECE % | {level} interval | T | ‖δ‖₂ | passes | seconds |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for name, row in r.items():
                n = m["n_seeds"][name]
                ece = _ms(row["ece"]) if n > 1 else f"{row['ece'][0]:.2f}"
                temp = _ms(row.get("temperature"), 3) if n > 1 else f"{row['temperature'][0]:.3f}"
                dn = "–" if "delta_norm" not in row else _ms(row["delta_norm"]) if n > 1 else f"{row['delta_norm'][0]:.2f}"
                ci = f"[{intervals[name][0]:.2f}, {intervals[name][1]:.2f}]" if name in intervals else "–"
                mark = " †" if name in m.get("referenced_rows", []) else ""
                lines.append(f"| {name}{mark} | {ece} | {ci} | {temp} | {dn} | {row['passes'][0]:.1f} | "
                             f"{row['seconds'][0]:.1f} |")
            if m.get("referenced_rows"):
                lines += ["", "† not run here: taken from " + "; ".join(f"`{w}`" for w in m["from_reports"]) + "."]
            w = m.get("welch_vs_best_baseline")
            if w and w.get("t") is not None:
                lines.append("")
                lines.append(f"Welch's t-test, NC default against {m['best_baseline']} (best baseline): "
                             f"t = {w['t']:.2f}, p = {w['p']:.3g}.")
            t = m.get("ece_target")
            if t:
                lines += target_lines("NC default", t, level)
            pt = m.get("pass_target")
            if pt:
                lines.append(f"Cost target: {pt['ratio']:.3f} of the recipe's passes (≤ 0.2): {'met' if pt['met'] else '**missed**'}.")
            lines.append("")
        lines += _zero_init_table(summary["panel"], level)
        lines += newest_table(summary["panel"], level)
    if summary["fidelity"]:
        lines += ["## Fidelity: the recipes against NCToolkit", "",
                  "*Same batches*: our fitter and NCWrapper start from the same δ₀ and see the same batches in the "
                  "same order (seed 0): the computations agree in every step but their order of operations (how "
                  "the loss is summed, where the clamp sits), so the difference is rounding, which 500 momentum "
                  "steps amplify; it must stay well inside the own-order tolerance. *Own order*: each with its "
                  f"own shuffling over {seeds} seeds; the tolerance is twice the larger seed-to-seed standard "
                  "deviation, i.e. what the random order of batches alone explains. The paper recipe's λ‖δ‖²₂ "
                  "cannot be expressed in NCToolkit (it offers λ₁‖δ‖₂ only) and its focal loss clamps p_y, so the "
                  "paper recipe's optimiser, batches and δ₀ are compared with cross entropy and the penalty off on "
                  "both sides.", "",
                  "| model | comparison | ours | NCToolkit | difference | tolerance | within | Welch p |",
                  "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
        for f in summary["fidelity"]:
            if f.get("same_order"):
                lines += _same_order_rows(f["model"], "toolkit", f["same_order"], with_ece=True)
            if f.get("paper_no_penalty_same_order"):
                lines += _same_order_rows(f["model"], "paper, CE, no penalty", f["paper_no_penalty_same_order"])
            for field, c in (f.get("own_order") or {}).items():
                label = FIDELITY_LABELS[field]
                lines.append(f"| {f['model']} | toolkit, own order: {label} | {_ms(c['ours'], 3)} | "
                             f"{_ms(c['nctoolkit'], 3)} | {c['difference']:+.3f} | {c['tolerance']:.3f} | "
                             f"{'yes' if c['within'] else '**no**'} | {_p(c.get('welch_p'))} |")
        lines += [""] + _own_order_verdict(summary["fidelity"])
    return lines


FIDELITY_LABELS = {"temperature": "T", "delta_norm": "‖δ‖₂", "test_ece": "test ECE %"}


def _p(p: float | None) -> str:
    return "–" if p is None else f"{p:.3f}"


def _own_order_verdict(fidelity: list[dict]) -> list[str]:
    """One paragraph over every own-order comparison: how many lie within the tolerance, and whether any
    difference is beyond chance once the number of comparisons is counted (Bonferroni at 5 %)."""
    comps = [(f["model"], field, c) for f in fidelity for field, c in (f.get("own_order") or {}).items()]
    if not comps:
        return []
    within = sum(c["within"] for _, _, c in comps)
    tested = [(m, field, c["welch_p"]) for m, field, c in comps if c.get("welch_p") is not None]
    line = f"Own order: {within} of {len(comps)} comparisons lie within the tolerance."
    if tested:
        bound = 0.05 / len(tested)
        m, field, p = min(tested, key=lambda t: t[2])
        beyond = [f"{m} {FIDELITY_LABELS[fd]}" for m, fd, q in tested if q < bound]
        line += (f" Welch's t-test, {len(tested)} comparisons: the smallest p is {p:.3f} ({m}, {FIDELITY_LABELS[field]}); a p below "
                 f"{bound:.4f} (5 % over {len(tested)} comparisons, Bonferroni) would be a difference that the order "
                 "of batches does not explain: " + (", ".join(beyond) if beyond else "none") + ".")
    return [line, ""]
