"""The calibration panel and the fidelity check: cases (one per process) and their summaries.

Panel: strongly over-confident Fashion-MNIST models trained by ``scripts/make_assets.py panel``
(uncalibrated test ECE 8–10 %) plus the three mildly over-confident embedded models. On each:
uncalibrated, TS, TS grid and Dir-ODIR (deterministic, once), the default Neural Clamping, both
recipes ("paper", "toolkit") and, when a checkout of the authors' NCToolkit is given, its own
``NCWrapper.train_NC`` with the demo's settings, each over several seeds.

Fidelity: the recipes against NCToolkit. With the same δ₀ and the same batch order the two
implementations must agree to float rounding; with each its own random batch order they must agree
to within the spread that the order alone causes (measured as the seed-to-seed spread of our own
recipe). NCToolkit is imported from the path given, never copied into this repository.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: The over-confident models of the panel (scripts/make_assets.py OVERCONFIDENT), then the mild ones.
OVERCONFIDENT = ("fmnist-resnet-overconfident", "fmnist-resnet-overconfident-s1", "fmnist-resnet-overconfident-s2",
                 "fmnist-vit-overconfident", "fmnist-mixer-overconfident")
MILD = ("fmnist-resnet", "fmnist-vit", "fmnist-mixer")
#: The logit-space baselines of the panel, deterministic.
PANEL_BASELINES = ("Temperature Scaling", "TS by Grid Search", "Dir-ODIR")
#: Targets of the Neural Clamping quality issue.
ECE_MARGIN_PT = 0.1
PASS_FRACTION_MAX = 0.2

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
    """The model, its calibration inputs and labels, and the whole Fashion-MNIST test split."""
    from nctv.data import get_splits
    from nctv.zoo import load_model

    loaded = load_model(model_id(p["model"], p["panel_dir"]), device=device)
    cal, test = get_splits(loaded, "fashion-mnist", calibration_size=p["cal_size"])
    (x, y), (xt, yt) = cal.tensors(), test.tensors()
    return loaded, x.to(device), y.to(device), xt.to(device), yt


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


def case_panel_baselines(p: dict, device: torch.device) -> dict:
    """Uncalibrated, TS, TS grid, Dir-ODIR on one model's logits (test ECE, 15 bins; seconds)."""
    from nctv.calibration import make_method
    from nctv.inference import model_logits
    from nctv.metrics import ece

    loaded, x, y, xt, yt = _splits(p, device)
    zc, zt = model_logits(loaded.model, x).cpu(), model_logits(loaded.model, xt).cpu()
    y = y.cpu()
    rows = {"Uncalibrated": {"test_ece": ece(zt, yt), "accuracy": float((zt.argmax(1) == yt).double().mean()),
                             "seconds": 0.0}}
    for name in PANEL_BASELINES:
        method = make_method(name)
        if hasattr(method, "progress"):
            method.progress = False
        t0 = time.perf_counter()
        method.fit(zc, y)
        seconds = time.perf_counter() - t0
        row = {"test_ece": ece(method.transform(zt), yt), "seconds": seconds}
        if hasattr(method, "temperature_"):
            row["temperature"] = float(method.temperature_)
        rows[name] = row
    return {"model": p["model"], "cal_size": int(x.shape[0]), "test_size": int(xt.shape[0]), "methods": rows}


def case_panel_nc(p: dict, device: torch.device) -> dict:
    """One Neural Clamping fit: ``fitter`` None = the library's default, else a fitter by name."""
    from bench.cases import _memory, _rss_mb, timed, warm_up
    from nctv.calibration.clamping import NeuralClamping
    from nctv.metrics import ece

    loaded, x, y, xt, yt = _splits(p, device)
    warm = warm_up(loaded.model, x, device)
    kwargs = dict(p.get("settings", {}))
    if "gamma" in p:
        kwargs["gamma"] = p["gamma"]
    if p.get("fitter"):
        kwargs["fitter"] = p["fitter"]
    nc = NeuralClamping(loaded.model, input_range=loaded.input_range, seed=p["seed"], progress=False, **kwargs)
    rss_before = _rss_mb()
    out: dict[str, Any] = {}
    with timed(device, out):
        nc.fit(x, y)
    out.update(_memory(device, rss_before))
    z = nc.predict_logits(xt)
    z_t_only = nc.predict_logits(xt, use_delta=False)
    out.update(model=p["model"], row=p.get("row"), fitter=nc.fitter_, seed=p["seed"], passes=float(nc.n_passes_),
               temperature=float(nc.temperature_), delta_norm=float(nc.delta_.norm()), gamma=float(nc.gamma_),
               weight_decay=float(nc.weight_decay_), test_ece=ece(z, yt), test_ece_temperature_only=ece(z_t_only, yt),
               accuracy=float((z.argmax(1) == yt).double().mean()), warmup_seconds=warm)
    if p.get("keep_delta"):
        out["delta"] = nc.delta_.flatten().tolist()
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
    loaded, x, y, xt, yt = _splits(p, device)
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
    if p.get("keep_delta"):
        out["delta"] = delta.flatten().cpu().tolist()
    return out


CASES = {"panel_baselines": case_panel_baselines, "panel_nc": case_panel_nc, "nctoolkit": case_nctoolkit}


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------


def mean_std(values: list[float]) -> tuple[float, float]:
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def welch(sample: list[float], reference: list[float]) -> dict:
    """Welch's t-test of ``sample`` against ``reference``; a deterministic reference (one value)
    makes it the one-sample t-test against that value. Negative t: ``sample`` is lower."""
    from scipy import stats

    a = np.asarray(sample, dtype=np.float64)
    b = np.asarray(reference, dtype=np.float64)
    if len(a) < 2:
        return {"t": None, "p": None}
    if len(b) == 1:
        if a.std(ddof=1) == 0:
            return {"t": None, "p": None}
        t, pv = stats.ttest_1samp(a, b[0])
    else:
        t, pv = stats.ttest_ind(a, b, equal_var=False)
    return {"t": float(t), "p": float(pv)}


def panel_summary(model: str, baselines: dict, nc_runs: dict[str, list[dict]]) -> dict:
    """Per model: every row's mean ± std test ECE, passes and seconds; the default against the best
    baseline (Welch) and the targets: ECE ≤ min(TS grid, either recipe, NCToolkit) + 0.1 point, passes ≤ 1/5
    of the toolkit recipe's."""
    rows: dict[str, dict] = {}
    for name, r in baselines["methods"].items():
        rows[name] = {"ece": [100 * r["test_ece"]], "seconds": [r["seconds"]], "passes": [0.0],
                      "temperature": [r.get("temperature", 1.0)]}
    for label, runs in nc_runs.items():
        ok = [r for r in runs if "test_ece" in r]
        if ok:
            rows[label] = {"ece": [100 * r["test_ece"] for r in ok], "seconds": [r["seconds"] for r in ok],
                           "passes": [r["passes"] for r in ok], "temperature": [r["temperature"] for r in ok],
                           "delta_norm": [r["delta_norm"] for r in ok]}
    best_baseline = min(PANEL_BASELINES, key=lambda n: rows[n]["ece"][0])
    out: dict[str, Any] = {"model": model, "uncalibrated_ece": rows["Uncalibrated"]["ece"][0],
                           "rows": {k: {f: mean_std(v) for f, v in r.items()} for k, r in rows.items()},
                           "n_seeds": {k: len(r["ece"]) for k, r in rows.items()}, "best_baseline": best_baseline}
    default = rows.get("NC default")
    if default:
        out["welch_vs_best_baseline"] = welch(default["ece"], rows[best_baseline]["ece"])
        refs = {k: rows[k]["ece"] for k in ("TS by Grid Search", "NC paper", "NC toolkit", "NCToolkit") if k in rows}
        target = min(float(np.mean(v)) for v in refs.values()) + ECE_MARGIN_PT
        mean_default = float(np.mean(default["ece"]))
        out["ece_target"] = {"value": target, "measured": mean_default, "met": mean_default <= target + 1e-9,
                             "against": {k: float(np.mean(v)) for k, v in refs.items()}}
        if "NC toolkit" in rows:
            ratio = float(np.mean(default["passes"])) / float(np.mean(rows["NC toolkit"]["passes"]))
            out["pass_target"] = {"ratio": ratio, "met": ratio <= PASS_FRACTION_MAX + 1e-9}
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

#: Row labels of the panel, in table order, with the fitter each NC row uses (None: the default).
NC_ROWS = {"NC default": None, "NC paper": "paper", "NC toolkit": "toolkit"}


def plan(args, common: dict) -> list[tuple[str, dict, str]]:
    """(case, params, label) for the fidelity section (first: it is short), then the panel."""
    first: list[tuple[str, dict, str]] = []
    out: list[tuple[str, dict, str]] = []
    base = dict(common, panel_dir=str(args.panel_dir), cal_size=args.cal_size)
    epochs = {"epochs": args.recipe_epochs}
    seeds = list(range(args.panel_seeds))
    rows = getattr(args, "panel_rows", None) or [*NC_ROWS, "NCToolkit"]
    tk_seeds = list(range(getattr(args, "nctoolkit_seeds", None) or args.panel_seeds))
    if "fidelity" in args.sections and args.nctoolkit:
        for model in args.fidelity_models:
            kw = dict(base, model=model, seed=0, keep_delta=True, nctoolkit=str(args.nctoolkit), **epochs)
            if "panel" not in args.sections or model not in args.panel_models:
                first.append(("panel_nc", dict(base, model=model, fitter="toolkit", seed=0, keep_delta=True,
                                               row="NC toolkit", settings=epochs),
                              f"fidelity {model}: toolkit recipe, seed 0"))
            first.append(("nctoolkit", dict(kw, settings="toolkit", order="same"),
                          f"fidelity {model}: NCToolkit toolkit, same batches"))
            if not ("panel" in args.sections and model in args.panel_models and "NCToolkit" in rows):
                for seed in tk_seeds:  # the own-order runs, when the panel does not run them
                    first.append(("nctoolkit", dict(base, model=model, settings="toolkit", order="own", seed=seed,
                                                    nctoolkit=str(args.nctoolkit), **epochs),
                                  f"fidelity {model}: NCToolkit own order, seed {seed}"))
            first.append(("panel_nc", dict(base, model=model, fitter="paper", seed=0, keep_delta=True,
                                           row="NC paper (CE, no penalty)", settings={"weight_decay": 0.0, **epochs},
                                           gamma=0.0),
                          f"fidelity {model}: paper recipe, cross entropy, no penalty"))
            first.append(("nctoolkit", dict(kw, settings="paper-ce-no-penalty", order="same"),
                          f"fidelity {model}: NCToolkit, paper settings with cross entropy, no penalty, same batches"))
    if "panel" in args.sections:
        for model in args.panel_models:
            out.append(("panel_baselines", dict(base, model=model), f"panel {model}: baselines"))
            for label, fitter in NC_ROWS.items():
                if label not in rows:
                    continue
                for seed in seeds:
                    out.append(("panel_nc", dict(base, model=model, fitter=fitter, seed=seed, row=label,
                                                 settings=epochs if fitter else {},
                                                 keep_delta=fitter == "toolkit" and seed == 0),
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
    out: dict[str, Any] = {"panel": [], "fidelity": []}
    for b in results.get("panel_baselines", []):
        if "error" in b:
            continue
        model = b["model"]
        runs = {label: _pick(nc_all, model=model, row=label) for label in NC_ROWS}
        own = _pick(tk_all, model=model, settings="toolkit", order="own")
        if own:
            runs["NCToolkit"] = own
        summary = panel_summary(model, b, runs)
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


def markdown(summary: dict, settings: dict) -> list[str]:
    lines: list[str] = []
    seeds = settings.get("panel_seeds")
    if summary["panel"]:
        lines += ["## Panel: Neural Clamping against the recipes and the baselines", "",
                  f"Each model calibrated on its {settings.get('cal_size')} calibration-pool images, scored on the "
                  f"10,000 test images; test ECE in % (15 bins), mean ± std over {seeds} seeds for the stochastic "
                  "rows (baselines are deterministic). *NC default* is `NeuralClamping()` with every default; "
                  "*NC paper* and *NC toolkit* are the two recipes (`fitter=\"paper\"`, `fitter=\"toolkit\"`); "
                  "*NCToolkit* is the authors' own `NCWrapper.train_NC` with demo.py's settings, its own batch "
                  "shuffling and δ₀. Passes over the calibration split: forward + backward to the input = 1, "
                  "forward only = 0.5. The targets: the default's mean ECE at most 0.1 point above the lowest of "
                  "TS by grid search and the recipes (both of ours and NCToolkit's), with at most a fifth of the toolkit "
                  "recipe's passes.", ""]
        for m in summary["panel"]:
            r = m["rows"]
            lines += [f"### {m['model']} (uncalibrated test ECE {m['uncalibrated_ece']:.2f} %)", "",
                      "| method | test ECE % | T | ‖δ‖₂ | passes | seconds |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
            for name, row in r.items():
                n = m["n_seeds"][name]
                digits = 2 if n > 1 else 2
                ece = _ms(row["ece"], digits) if n > 1 else f"{row['ece'][0]:.2f}"
                temp = _ms(row.get("temperature"), 3) if n > 1 else f"{row['temperature'][0]:.3f}"
                dn = _ms(row.get("delta_norm")) if "delta_norm" in row else "–"
                mark = " †" if name in m.get("referenced_rows", []) else ""
                lines.append(f"| {name}{mark} | {ece} | {temp} | {dn} | {row['passes'][0]:.1f} | {row['seconds'][0]:.1f} |")
            if m.get("referenced_rows"):
                lines += ["", "† not run here: taken from " + "; ".join(f"`{w}`" for w in m["from_reports"]) + "."]
            w = m.get("welch_vs_best_baseline")
            if w and w.get("t") is not None:
                lines.append("")
                lines.append(f"Welch's t-test, NC default against {m['best_baseline']} (best baseline): "
                             f"t = {w['t']:.2f}, p = {w['p']:.3g}.")
            t = m.get("ece_target")
            if t:
                against = ", ".join(f"{k} {v:.2f}" for k, v in t["against"].items())
                verdict = "met" if t["met"] else f"**missed by {t['measured'] - t['value']:.2f} point**"
                lines.append(f"ECE target: {t['measured']:.2f} % ≤ {t['value']:.2f} % (lowest of {against}, + 0.1): {verdict}.")
            pt = m.get("pass_target")
            if pt:
                lines.append(f"Cost target: {pt['ratio']:.3f} of the recipe's passes (≤ 0.2): {'met' if pt['met'] else '**missed**'}.")
            lines.append("")
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
