"""One benchmark case per process: ``python -m bench.cases CASE PARAMS_JSON RESULT_PATH``.

``bench.run`` starts every case in a fresh interpreter so that the process's peak resident set
size (``ru_maxrss``) belongs to that case alone; torch allocates outside Python's allocator, so
``tracemalloc`` would miss most of it. On a CUDA device the peak of
``torch.cuda.max_memory_allocated`` is recorded as well.

Conventions: seconds are wall-clock (``time.perf_counter``) around the measured call only (model
loading, data preparation and test-split evaluation are outside it); CPU seconds are this
process's user + system time over the same call. ECE uses 15 equal-width bins and is a fraction.
Costs of Neural Clamping are in passes over the calibration split, as ``NeuralClamping.n_passes_``
counts them (forward + backward to the input = 1, forward only = 0.5).
"""
from __future__ import annotations

import importlib
import json
import math
import os
import resource
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np
import torch

#: Logit-space baselines of the paper, in table order.
BASELINES = (
    "Temperature Scaling",
    "TS by Grid Search",
    "Temperature Scaling (FL)",
    "Vector Scaling",
    "Matrix Scaling",
    "MS-ODIR",
    "Dir-ODIR",
)
#: The baselines with a (λ, μ) selection that can screen the grid (``screen``).
ODIR_METHODS = ("MS-ODIR", "Dir-ODIR")


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def _rss_mb() -> float:
    """Current resident set size of this process, MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device: torch.device, into: dict):
    """Wall and CPU seconds of the block, stored in ``into`` as "seconds" and "cpu_seconds"."""
    _sync(device)
    w0, c0 = time.perf_counter(), time.process_time()
    yield
    _sync(device)
    into["seconds"] = time.perf_counter() - w0
    into["cpu_seconds"] = time.process_time() - c0


def _memory(device: torch.device, rss_before: float) -> dict:
    out = {"peak_rss_mb": _peak_rss_mb(), "rss_before_mb": rss_before}
    if device.type == "cuda":
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def _model_and_splits(name: str, cal_size: int, test_size: int | None, device: torch.device):
    from nctv.data import get_splits
    from nctv.zoo import load_model

    loaded = load_model(name, device=device)
    cal, test = get_splits(loaded, calibration_size=cal_size, test_size=test_size)
    x, y = cal.tensors()
    return loaded, (x.to(device), y.to(device)), test


def warm_up(model: torch.nn.Module, x: torch.Tensor, device: torch.device) -> float:
    """One untimed forward + backward to the input on a batch, so that one-off start-up costs of
    the process (kernel selection, allocator growth) do not land in the first measured fit.
    Returns its seconds."""
    t0 = time.perf_counter()
    xb = x[:512].clone().requires_grad_(True)
    torch.autograd.grad(model(xb).logsumexp(1).sum(), xb)
    _sync(device)
    return time.perf_counter() - t0


def synthetic_logits(n: int, k: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Overconfident synthetic logits (n, k) float32 and labels (n,), reproducible from ``seed``.

    True logits u: N(0, 1) per class plus a margin m on one uniformly drawn class, m chosen so that
    this class is the label about 70 % of the time; the label is drawn from softmax(u), so u is
    exactly calibrated. The returned logits are 2.5 · u: overconfident, and temperature scaling
    with T = 2.5 recovers calibrated probabilities.
    """
    g = torch.Generator().manual_seed(int(seed))
    # E[Σ_{j≠c} e^{u_j}] = (k − 1)·e^{1/2}; solve e^m / (e^m + that) = 0.7 for m.
    margin = math.log(0.7 / 0.3 * (k - 1) * math.exp(0.5))
    u = torch.randn(n, k, generator=g, dtype=torch.float64)
    u[torch.arange(n), torch.randint(0, k, (n,), generator=g)] += margin
    y = torch.multinomial(torch.softmax(u, dim=1), 1, generator=g).squeeze(1)
    return (2.5 * u).float().to(device), y.to(device)


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


def case_sweep(p: dict, device: torch.device) -> dict:
    """The 21-point γ sweep (0, 0.05, …, 1) with the fast fitter: each γ its own fit, the first pass shared."""
    from nctv.calibration.clamping import SWEEP_GAMMAS
    from nctv.calibration.studies import gamma_sweep

    loaded, (x, y), _ = _model_and_splits(p["model"], p["cal_size"], None, device)
    warm = warm_up(loaded.model, x, device)
    rss_before = _rss_mb()
    out: dict[str, Any] = {"warmup_seconds": warm}
    with timed(device, out):
        sweep = gamma_sweep(loaded.model, x, y, gammas=SWEEP_GAMMAS, seed=p.get("seed", 0), progress=False)
    out.update(
        model=p["model"], cal_size=int(x.shape[0]), n_gammas=len(sweep.gammas), passes=float(sweep.n_passes),
        passes_by_gamma=[float(v) for v in sweep.passes], gammas=[float(g) for g in sweep.gammas],
        objective=[float(v) for v in sweep.objective], cal_ece=[float(v) for v in sweep.cal["ece"]],
        chosen_gamma=float(sweep.chosen_gamma), **_memory(device, rss_before),
    )
    return out


def case_sequential(p: dict, device: torch.device) -> dict:
    """Independent fast fits, one per γ in ``gammas``, each from scratch (same seed as the sweep)."""
    from nctv.calibration.clamping import NeuralClamping

    loaded, (x, y), _ = _model_and_splits(p["model"], p["cal_size"], None, device)
    warm = warm_up(loaded.model, x, device)
    rss_before = _rss_mb()
    fits = []
    for gamma in p["gammas"]:
        row: dict[str, Any] = {"gamma": float(gamma)}
        nc = NeuralClamping(loaded.model, gamma=float(gamma), seed=p.get("seed", 0), progress=False)
        with timed(device, row):
            nc.fit(x, y)
        row.update(passes=float(nc.n_passes_), objective=float(nc.objective_), cal_ece=float(nc.candidates_[0]["ece"]))
        fits.append(row)
    return {"model": p["model"], "cal_size": int(x.shape[0]), "fits": fits, "warmup_seconds": warm,
            **_memory(device, rss_before)}


def case_grid(p: dict, device: torch.device) -> dict:
    """TS grid search: the library's search against a loop calling ``nctv.metrics.ece`` per T.

    All use the same grid (``grid_step``, 2·``grid_step``, …, ``t_max``) on the calibration
    logits of an embedded model. The library's default search (vectorised branch and bound) and
    its full-curve variant (every T evaluated, vectorised) are each timed ``repeats`` times (the
    median is reported). The loop runs over the whole grid unless its projected time passes ``loop_cap_s``;
    then it stops there and its full time is extrapolated linearly from the temperatures done.
    """
    from nctv.calibration.temperature import grid_search_temperature
    from nctv.inference import model_logits
    from nctv.metrics import ece

    loaded, (x, y), _ = _model_and_splits(p["model"], p["cal_size"], None, device)
    z = model_logits(loaded.model, x, device=device).to(device)
    n_grid = int(round(p["t_max"] / p["grid_step"]))
    grid = np.arange(1, n_grid + 1) * p["grid_step"]
    rss_before = _rss_mb()
    runs, full_runs = [], []
    for _ in range(p["repeats"]):
        row: dict[str, Any] = {}
        with timed(device, row):
            best_t, bounded = grid_search_temperature(z, y, grid=grid, n_bins=15)
        runs.append(row)
        row = {}
        with timed(device, row):
            full_t, eces = grid_search_temperature(z, y, grid=grid, n_bins=15, full_curve=True)
        full_runs.append(row)
    eces = np.asarray(eces, dtype=np.float64)
    evaluated = ~np.isnan(bounded)
    vec_memory = _memory(device, rss_before)

    loop: dict[str, Any] = {}
    loop_eces = []
    w0, c0 = time.perf_counter(), time.process_time()
    for i, t in enumerate(grid):
        loop_eces.append(ece(z / float(t), y, n_bins=15))
        elapsed = time.perf_counter() - w0
        if i + 1 < n_grid and i >= 49 and elapsed * n_grid / (i + 1) > p["loop_cap_s"]:
            break
    loop.update(seconds=time.perf_counter() - w0, cpu_seconds=time.process_time() - c0, n_done=len(loop_eces))
    done = loop["n_done"]
    loop["complete"] = done == n_grid
    loop["seconds_full"] = loop["seconds"] * n_grid / done
    loop_eces = np.asarray(loop_eces)
    # First minimum: ties go to the smallest temperature, as in the vectorised search.
    loop_best = float(grid[int(np.argmin(loop_eces))]) if loop["complete"] else None
    return {
        "model": p["model"], "cal_size": int(x.shape[0]), "n_grid": n_grid, "grid_step": p["grid_step"],
        "t_max": p["t_max"], "vectorised_seconds": float(np.median([r["seconds"] for r in runs])),
        "vectorised_runs": runs, "full_curve_seconds": float(np.median([r["seconds"] for r in full_runs])),
        "full_curve_runs": full_runs, "full_curve_best_t": float(full_t), "n_evaluated": int(evaluated.sum()),
        "bounded_matches_full": bool(np.array_equal(bounded[evaluated], eces[evaluated])),
        "best_t": float(best_t), "best_ece": float(eces.min()), "loop": loop,
        "loop_best_t": loop_best, "max_abs_ece_difference": float(np.abs(loop_eces - eces[:done]).max()),
        **vec_memory,
    }


def _fitted_summary(method: Any) -> dict:
    keep = {}
    for name in ("temperature_", "lambda_", "mu_", "n_iter_", "converged_", "objective_", "screened_"):
        v = getattr(method, name, None)
        if isinstance(v, (bool, np.bool_)):
            keep[name.rstrip("_")] = bool(v)
        elif isinstance(v, (int, float, np.integer, np.floating)):
            keep[name.rstrip("_")] = float(v)
    return keep


def case_baseline(p: dict, device: torch.device) -> dict:
    """One logit-space baseline fitted on synthetic logits (n × k), including any hyperparameter
    selection its ``fit`` does (ODIR's cross-validated λ, μ); test ECE and NLL on a second synthetic
    set. ``screen`` (ODIR only) is passed to the method when given."""
    import inspect

    from nctv.calibration import METHODS, make_method
    from nctv.metrics import ece, nll

    n, k = int(p["n"]), int(p["k"])
    z, y = synthetic_logits(n, k, p.get("seed", 0), device)
    z_test, y_test = synthetic_logits(n, k, p.get("seed", 0) + 1, device)
    cls = getattr(importlib.import_module("nctv.calibration"), METHODS[p["method"]].cls)
    kwargs = {"progress": False} if "progress" in inspect.signature(cls.__init__).parameters else {}
    if "screen" in p:
        kwargs["screen"] = p["screen"]
    method = make_method(p["method"], **kwargs)
    rss_before = _rss_mb()
    out: dict[str, Any] = {}
    with timed(device, out):
        method.fit(z, y)
    memory = _memory(device, rss_before)
    calibrated = method.transform(z_test)
    out.update(method=p["method"], n=n, k=k, uncalibrated_test_ece=ece(z_test, y_test, n_bins=15),
               test_ece=ece(calibrated, y_test, n_bins=15), test_nll=nll(calibrated, y_test),
               **_fitted_summary(method), **memory)
    if "screen" in p:
        out["screen"] = p["screen"]
    if hasattr(method, "cv_refined_"):
        out["refined_points"], out["grid_points"] = int(method.cv_refined_.sum()), int(method.cv_refined_.size)
    return out


def case_distributed(p: dict, device: torch.device) -> dict:
    """One Neural Clamping fit (``fitter``, seed 0) on this process or on every process torchrun
    started: each holds its block of the calibration split and the sums are added across processes
    (``nctv.distributed``). Seconds: the fit, started together (a barrier) and ended together (its
    last collective); then the test split's calibrated logits, also sharded."""
    from nctv import distributed
    from nctv.calibration.clamping import NeuralClamping
    from nctv.metrics import ece

    loaded, (x, y), test = _model_and_splits(p["model"], p["cal_size"], p.get("test_size"), device)
    x_test, y_test = test.tensors()
    warm = warm_up(loaded.model, x, device)
    nc = NeuralClamping(loaded.model, fitter=p["fitter"], epochs=p.get("epochs"), seed=0, progress=False)
    rss_before = _rss_mb()
    out: dict[str, Any] = {"warmup_seconds": warm}
    if distributed.is_distributed():
        torch.distributed.barrier()
    with timed(device, out):
        nc.fit(x, y)
    predict: dict[str, Any] = {}
    with timed(device, predict):
        z_test = nc.predict_logits(x_test)
    out.update(model=p["model"], fitter=p["fitter"], epochs=p.get("epochs"), cal_size=int(x.shape[0]),
               test_size=int(x_test.shape[0]), processes=distributed.world_size(), temperature=float(nc.temperature_),
               fitted_temperature=float(nc.fitted_temperature_), passes=float(nc.n_passes_),
               test_ece=ece(z_test, y_test.to(z_test.device), n_bins=15), predict_seconds=predict["seconds"],
               delta=nc.delta_.reshape(-1).tolist(), **_memory(device, rss_before))
    return out


def cifar_resnet110(num_classes: int = 100) -> torch.nn.Module:
    """The CIFAR ResNet-110 of the paper's 227 s workload: 3 stages of 18 basic blocks (16, 32, 64
    channels), a 3 × 3 stem, global average pooling. Random weights: only its cost is measured."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                      nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Identity() if stride == 1 and cin == cout else
                         nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    cin = 16
    for cout, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(18):
            layers.append(Block(cin, cout, stride if i == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)]
    return nn.Sequential(*layers)


#: The GPU section's workloads: (model, input side, classes).
GPU_WORKLOADS = {
    "resnet101": ("resnet101", 224, 1000),
    "vit-s16": ("vit_small_patch16_224", 224, 1000),
    "mixer-b16": ("mixer_b16_224", 224, 1000),
    "cifar-resnet110": ("cifar-resnet110", 32, 100),
}


def case_gpu(p: dict, device: torch.device) -> dict:
    """Fast Neural Clamping on a large workload with random weights and inputs (its cost only),
    under an optional cap on the process's GPU memory, in the precision ``auto`` chooses."""
    from nctv import precision as prec
    from nctv.calibration.clamping import NeuralClamping

    arch, side, classes = GPU_WORKLOADS[p["workload"]]
    if device.type == "cuda" and p.get("cap_gb"):
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, p["cap_gb"] * 2**30 / total), device)
    if arch == "cifar-resnet110":
        model = cifar_resnet110(classes)
    else:
        import timm

        model = timm.create_model(arch, pretrained=False, num_classes=classes)
    model = model.to(device).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(p["images"], 3, side, side, generator=g)
    y = torch.randint(0, classes, (p["images"],), generator=g)
    choice = prec.choose(p.get("precision", "auto"), model, device, lambda: x[:prec.MEASURE_IMAGES].to(device))
    nc = NeuralClamping(model, seed=0, max_passes=p.get("max_passes", 20))
    rss_before = _rss_mb()
    out: dict[str, Any] = {}
    with prec.running(model, choice.precision), timed(device, out):
        nc.fit(x, y)
    out.update(workload=p["workload"], images=p["images"], side=side, classes=classes, cap_gb=p.get("cap_gb"),
               passes=float(nc.n_passes_), seconds_per_pass=out["seconds"] / max(float(nc.n_passes_), 1e-9),
               precision=choice.to_dict(), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               **_memory(device, rss_before))
    return out


def case_intervals(p: dict, device: torch.device) -> dict:
    """Intervals of every metric of ``methods`` sets of n×k logits (one shared count matrix of
    ``resamples`` resamples, plus the paired ECE difference of each set to the first) against one
    evaluation of the same metrics of every set."""
    from nctv import intervals as iv
    from nctv.metrics import evaluate

    z, y = synthetic_logits(p["n"], p["k"], p["seed"], device)
    sets = [z / t for t in torch.linspace(1.0, 3.5, p["methods"]).tolist()]
    evaluation, full = {}, {}
    with timed(device, evaluation):
        for s in sets:
            evaluate(s, y, n_bins=15)
    with timed(device, full):
        counts = iv.resample_counts_for((z, y), p["resamples"], p["seed"])  # as a run draws them
        draws = [iv.method_draws([s], y, counts, 15, list(iv.RESAMPLED)) for s in sets]
        for d in draws:
            for k in d:
                iv.interval(d[k], k)
        for d in draws[1:]:
            iv.difference(d["ece"], draws[0]["ece"])
    return dict(n=p["n"], k=p["k"], methods=p["methods"], resamples=p["resamples"], metrics=len(iv.RESAMPLED),
                evaluation=evaluation, intervals=full, ratio=full["seconds"] / evaluation["seconds"])


CASES: dict[str, Callable[[dict, torch.device], dict]] = {
    "intervals": case_intervals,
    "gpu": case_gpu,
    "distributed": case_distributed,
    "sweep": case_sweep,
    "sequential": case_sequential,
    "grid": case_grid,
    "baseline": case_baseline,
}


def _panel_cases() -> dict:
    from bench.panel import CASES as panel_cases

    return panel_cases


def main(argv: list[str]) -> int:
    CASES.update(_panel_cases())
    if len(argv) != 3 or argv[0] not in CASES:
        print(f"usage: python -m bench.cases {{{','.join(CASES)}}} PARAMS_JSON RESULT_PATH", file=sys.stderr)
        return 2
    name, params, path = argv[0], json.loads(argv[1]), argv[2]
    torch.set_num_threads(int(params.get("threads", 2)))
    from nctv import distributed
    from nctv.inference import resolve_device

    distributed.init_from_env()  # started by torchrun: every process runs the case, rank 0 reports it
    try:
        device = resolve_device(params.get("device", "cpu"))
        result = CASES[name](params, device)
        result["threads"] = torch.get_num_threads()
        if distributed.is_main():
            with open(path, "w") as f:
                json.dump(result, f, allow_nan=True)
    finally:
        distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
