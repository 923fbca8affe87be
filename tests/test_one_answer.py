"""One setting, one answer: the γ sweep's rows are the runs' fits, on every surface (library, `nctv`,
the app's handlers), and the study shipped in assets/precomputed/ is what today's code makes, on any machine.

Every comparison of two runs on one machine is to 1e-6: a fit from δ₀ = 0 draws nothing random, so the same
settings on the same split give the same δ, T and figures. The shipped files are compared with reruns of the
same functions scripts/make_precomputed.py calls, on parts of each study (each γ of a sweep and each run of
the initialisation study is its own fit, and a shift study's figures of one condition do not depend on the
other conditions), so that a change of behaviour cannot land with a stale shipped result.

They were made on another machine, and the comparison holds on any: the fast Neural Clamping fit runs in
float64 and lands on the same δ to about 1e-15 under every CPU kernel set and thread count
(nctv.calibration.clamping_fit.exact_twin). What still differs from one machine to another is the float32
arithmetic of the model's other passes (the unperturbed logits every logit-space method is fitted on, the
test logits every figure is scored on): about 1e-7, which moves a figure by as much, except where a
picture's confidence sits that close to a bin's edge. The resamples behind the intervals and the calibration
tests' label draws are keyed by the test pictures' content, not by those logits, so they are the same draws on
every machine (keyed by the logits, the intervals moved by 0.07 point across kernel sets). CROSS_MACHINE is
the tolerance of every comparison, far inside the 0.02 point of ECE that the shipped study promises to a rerun.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.test_cli import nctv

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "assets" / "precomputed"
TOL = 1e-6
#: (relative, absolute) tolerance of a rerun of the shipped study on any machine (see the docstring):
#: 1e-4 is 0.01 point of ECE, half the 0.02 point allowed; every verdict and every other value is equal.
CROSS_MACHINE = (1e-5, 1e-4)
NC = "Neural Clamping (FL)"


def _make_precomputed():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_precomputed
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return make_precomputed


def _close(ours, shipped, where: str, skip: frozenset = frozenset(), tol: tuple[float, float] = (TOL, TOL)) -> None:
    """Every number of ``ours`` within ``tol`` (relative, absolute) of ``shipped``, every other value
    equal, keys and lengths alike; ``skip``: keys left out."""
    if isinstance(shipped, dict):
        keys = set(shipped) - skip
        assert set(ours) - skip == keys, f"{where}: keys {sorted(set(ours) ^ set(shipped))} differ"
        for k in keys:
            _close(ours[k], shipped[k], f"{where}.{k}", skip, tol)
    elif isinstance(shipped, list):
        assert isinstance(ours, list) and len(ours) == len(shipped), f"{where}: lengths differ"
        for i, (a, b) in enumerate(zip(ours, shipped)):
            _close(a, b, f"{where}[{i}]", skip, tol)
    elif isinstance(shipped, float) or (isinstance(shipped, int) and isinstance(ours, float)):
        assert ours is not None and math.isclose(ours, shipped, rel_tol=tol[0], abs_tol=tol[1]), \
            f"{where}: {ours!r} here, {shipped!r} shipped"
    else:
        assert ours == shipped, f"{where}: {ours!r} here, {shipped!r} shipped"


def _json(result) -> dict:
    return json.loads(json.dumps(result.to_dict()))


# ------------------------------------------------------------------ the sweep's rows are the runs' fits


@pytest.mark.slow
def test_the_cli_sweep_rows_are_nctv_run_at_each_gamma(tmp_path):
    small = ["--calibration-size", "1500", "--test-size", "2000", "--quiet"]
    nctv("sweep-gamma", "--gammas", "0.5", "1", "--out", str(tmp_path / "sweep"), *small, cwd=tmp_path)
    sweep = json.loads((tmp_path / "sweep" / "results.json").read_text())
    assert sweep["gammas"] == [0.5, 1.0]
    for i, gamma in enumerate(sweep["gammas"]):
        out = tmp_path / f"run-{gamma:g}"
        nctv("run", "--methods", "nc-fl", "--gamma", f"{gamma:g}", "--seeds", "1", "--out", str(out), *small,
             cwd=tmp_path)
        row = json.loads((out / "results.json").read_text())["methods"][NC]
        params, ece = row["params"], row["metrics"]["15"]["ece"]
        assert params["gamma"] == gamma
        for key, ours in (("temperature", sweep["temperature"][i]), ("weight_decay", sweep["weight_decay"][i]),
                          ("delta_l2", sweep["delta_l2"][i])):
            assert ours == pytest.approx(params[key], rel=TOL, abs=TOL), key
        assert sweep["splits"]["test"]["ece"][i] == pytest.approx(ece["mean"], abs=TOL)
    # The two γ give two different fits: the comparison above could tell them apart.
    assert abs(sweep["delta_l2"][0] - sweep["delta_l2"][1]) > 1e-3


@pytest.mark.slow
def test_the_apps_sweep_rows_are_its_calibrate_runs_at_each_gamma():
    from nctv.experiment import RunOptions, run_experiment
    from nctv.ui.calibrate import parse_nc_options
    from nctv.ui.caches import get_model, get_splits
    from nctv.ui.gamma import run_sweep
    from nctv.ui.session import SplitSpec

    spec = SplitSpec("fmnist-resnet-overconfident", calibration_size=1500, test_size=2000)
    # The page's own parsing of its fields, as the two tabs hand them over.
    nc = parse_nc_options("fast", "default", 100, "default", init="random")
    sweep = run_sweep(spec, [0.0, 1.0], 15, nc, lambda _: None).sweep
    loaded, (cal, test) = get_model(spec.model), get_splits(spec)
    for i, gamma in enumerate((0.0, 1.0)):
        options = RunOptions(seeds=[spec.calibration_seed], bins=[15], nc=nc.changed(gamma=gamma), progress=False)
        row = run_experiment(loaded, cal, test, [NC], options).methods[NC]
        assert sweep.temperature[i] == pytest.approx(row.params["temperature"], rel=TOL)
        assert sweep.weight_decay[i] == pytest.approx(row.params["weight_decay"], rel=TOL)
        assert sweep.delta_l2[i] == pytest.approx(row.params["delta_l2"], rel=TOL)
        assert sweep.test["ece"][i] == pytest.approx(row.metrics[15]["ece"].mean, abs=TOL)


# ------------------------------------------------------------------ the shipped study is today's


@pytest.fixture(scope="module")
def shipped_splits():
    mp = _make_precomputed()
    results = json.loads((SHIPPED / "results.json").read_text())
    loaded, cal, test = mp.default_splits(results["calibration"]["size"], results["seeds"][0])
    # The shipped files were drawn from these very splits.
    assert results["calibration"]["fingerprint"] == cal.fingerprint
    assert results["test"]["fingerprint"] == test.fingerprint
    return mp, loaded, cal, test


def test_the_page_builds_the_shipped_options():
    from nctv.ui.calibrate import parse_nc_options

    mp = _make_precomputed()
    # The Calibrate tab's Neural Clamping fields at their page defaults.
    page = parse_nc_options("fast", "default", 100, "default", init="random", gamma="1")
    assert page.to_dict() == mp.APP_NC.to_dict()  # the values read (a field keeps the text as typed)


RUN_VOLATILE = frozenset({"created", "seconds", "fit_seconds", "cache_hits", "nctv_version", "precision"})


@pytest.mark.slow
def test_the_shipped_result_is_todays_default_run(shipped_splits):
    mp, loaded, cal, test = shipped_splits
    result = mp.default_run(loaded, cal, test)
    _close(_json(result), json.loads((SHIPPED / "results.json").read_text()), "results.json", RUN_VOLATILE,
           tol=CROSS_MACHINE)
    # The reliability diagrams' logits and the δ the page draws.
    logits = load_file(SHIPPED / "test_logits.safetensors")
    for name, method in result.methods.items():
        if method.test_logits is not None:
            np.testing.assert_allclose(method.test_logits.numpy(), logits[name], rtol=1e-5, atol=1e-5)
    delta = load_file(SHIPPED / "delta.safetensors")[NC]
    np.testing.assert_allclose(result.methods[NC].delta.numpy(), delta, rtol=0, atol=1e-9 * np.abs(delta).max())


@pytest.mark.slow
def test_the_shipped_sweep_rows_are_todays_fits(shipped_splits):
    mp, loaded, cal, test = shipped_splits
    tol = CROSS_MACHINE
    shipped = json.loads((SHIPPED / "gamma_sweep.json").read_text())
    picks = [0, len(shipped["gammas"]) - 1]  # γ = 0 and γ = 1: each row is its own fit
    ours = _json(mp.default_sweep(loaded, cal, test, gammas=[shipped["gammas"][i] for i in picks]))
    for j, i in enumerate(picks):
        for key in ("gammas", "temperature", "weight_decay", "objective", "delta_l2", "passes"):
            _close(ours[key][j], shipped[key][i], f"{key}[γ={shipped['gammas'][i]}]", tol=tol)
        for split in ("calibration", "test"):
            for metric, values in shipped["splits"][split].items():
                _close(ours["splits"][split][metric][j], values[i], f"{split} {metric}", tol=tol)
        for metric, ends in shipped["test_intervals"].items():
            for end in ("ci_low", "ci_high"):
                _close(ours["test_intervals"][metric][end][j], ends[end][i], f"test {metric} {end}", tol=tol)
    assert ours["settings"]["nc"] == shipped["settings"]["nc"]


@pytest.mark.slow
def test_the_shipped_init_study_runs_are_todays_fits(shipped_splits):
    mp, loaded, cal, test = shipped_splits
    shipped = json.loads((SHIPPED / "init_study.json").read_text())
    ours = _json(mp.default_init_study(loaded, cal, test, runs=1))  # run 0 of each initialisation
    for init in ("random", "data"):
        _close(ours["runs"][init][0], shipped["runs"][init][0], f"{init} run 0", tol=CROSS_MACHINE)
    assert ours["settings"]["nc"] == shipped["settings"]["nc"]


@pytest.mark.slow
def test_the_shipped_shift_study_is_todays(shipped_splits):
    mp, loaded, cal, test = shipped_splits
    shipped = json.loads((SHIPPED / "shift.json").read_text())
    methods = ["Uncalibrated", "TS by Grid Search", NC]  # the verdict's two, and the reference
    ours = _json(mp.default_shift(loaded, cal, test, corruptions=["contrast"], methods=methods))
    conditions = ["clean"] + [f"contrast/{s}" for s in shipped["severities"]]
    for m in methods:
        _close(ours["params"][m], shipped["params"][m], f"params {m}", tol=CROSS_MACHINE)
        for c in conditions:
            _close(ours["figures"][m][c], shipped["figures"][m][c], f"{m} {c}", tol=CROSS_MACHINE)
            _close(ours["reliability"][m][c], shipped["reliability"][m][c], f"{m} {c} diagram", tol=CROSS_MACHINE)
    pairs = {(c["condition"], c["metric"], c["method"], c["other"]): c for c in shipped["comparisons"]}
    checked = 0
    for c in ours["comparisons"]:
        key = (c["condition"], c["metric"], c["method"], c["other"])
        if key in pairs and c["condition"] in conditions:  # an average over corruptions needs them all
            # A comparison's role (leader, reference) depends on which methods a study has; its numbers do not.
            _close({k: c[k] for k in ("difference", "low", "high")},
                   {k: pairs[key][k] for k in ("difference", "low", "high")}, f"comparison {key}", tol=CROSS_MACHINE)
            # ... and its verdict: lower, tied or higher by where the interval lies.
            assert (c["low"] > 0, c["high"] < 0) == (pairs[key]["low"] > 0, pairs[key]["high"] < 0), key
            checked += 1
    assert checked >= len(conditions)  # NC against TS by grid search under every condition, at least


# ------------------------------------------------------------------ the conformal sets: one answer per setting

SETS = ("score", "coverage_target", "randomized", "threshold", "coverage", "mean_size", "worst_class_coverage",
        "worst_class", "empty")


def _sets(results: dict) -> dict:
    """Per row of a results.json: its conformal sets, the figures every surface must agree on."""
    return {name: {k: m["conformal"][k] for k in SETS} for name, m in results["methods"].items()}


def test_aps_at_95_is_one_answer_in_the_app_the_cli_and_the_library_on_a_logits_file(tmp_path):
    """APS at 95 % chosen in the Calibrate tab's logits panel, after `nctv run --logits FILE --conformal aps
    --coverage 0.95`, and in the library's RunOptions: the same sets, whose figures are those of a conformal
    predictor made here on the run's own temperature."""
    import torch

    from nctv.cli import main
    from nctv.conformal import ConformalPredictor, ConformalSettings
    from nctv.experiment import RunOptions
    from nctv.logits_file import read_logits, run_on_logits
    from nctv.ui import calibrate
    from tests.test_logits_file import _data, _write

    z, y = _data(n=800)
    path = _write(tmp_path / "mine.npz", z, y, cut=400)
    methods = ["Uncalibrated", "Temperature Scaling"]
    *_, (status, table, *_, files, _) = calibrate.calibrate_logits(str(path), methods, 15, 0, "aps", 95)
    app = json.loads(Path(next(f for f in files if f.endswith("results.json"))).read_text())
    assert main(["run", "--logits", str(path), "--methods", "uncal", "ts", "--seeds", "1", "--bins", "15",
                 "--conformal", "aps", "--coverage", "0.95", "--out", str(tmp_path / "cli"), "--quiet"]) == 0
    cli = json.loads((tmp_path / "cli" / "results.json").read_text())
    library = _json(run_on_logits(read_logits(path), methods,
                                  RunOptions(seeds=(0,), bins=(15,), progress=False,
                                             conformal=ConformalSettings(score="aps", coverage=0.95))))
    assert _sets(app) == _sets(cli) == _sets(library)
    assert "Conformal prediction sets: APS at 95 % coverage" in table

    # The figures themselves: APS sets at 95 % on temperature scaling's probabilities, made here.
    data = read_logits(path)
    t = cli["methods"]["Temperature Scaling"]["params"]["temperature"]
    zc, zt = (torch.from_numpy(a).float() / t for a in (data.calibration_logits, data.test_logits))  # as a run does
    predictor = ConformalPredictor(ConformalSettings("aps", 0.95)).fit(zc, torch.from_numpy(data.calibration_labels))
    sets = predictor.predict_sets(zt)
    ts = cli["methods"]["Temperature Scaling"]["conformal"]
    assert ts["threshold"] == pytest.approx(predictor.threshold_, abs=1e-6)
    assert ts["coverage"][0] == pytest.approx(float(sets[np.arange(len(zt)), data.test_labels].double().mean()), abs=1e-12)
    assert ts["mean_size"][0] == pytest.approx(float(sets.sum(1).double().mean()), abs=1e-12)
    # ... and not the default's (LAC at 90 %): the setting reached every surface.
    lac = run_on_logits(data, methods, RunOptions(seeds=(0,), bins=(15,), progress=False))
    assert lac.methods["Temperature Scaling"].conformal["mean_size"][0] < ts["mean_size"][0] - 0.5


@pytest.mark.slow
def test_a_calibrate_run_with_aps_at_95_is_nctv_run_with_the_same_sets(tmp_path):
    """The Calibrate tab's run (its handler, as the page calls it) with APS at 95 %, and `nctv run --conformal
    aps --coverage 0.95` on the same split of the embedded default: the same prediction sets on every row."""
    from nctv.ui import calibrate, limits
    from nctv.zoo import DEFAULT_MODEL

    *_, last = calibrate.calibrate(DEFAULT_MODEL, "", limits.DEFAULT_DATASET_CHOICE, 300, 1000, 0, 15,
                                   ["Temperature Scaling"], "1", "default", "random", "fast", 100, "default", "aps", 95)
    status, table, files = last[0], last[3], last[7]
    assert status.startswith("**Done**"), status
    app = json.loads(Path(next(f for f in files if f.endswith("results.json"))).read_text())
    nctv("run", "--methods", "uncal", "ts", "--seeds", "1", "--bins", "15", "--calibration-size", "300",
         "--test-size", "1000", "--conformal", "aps", "--coverage", "0.95", "--out", str(tmp_path / "cli"), "--quiet",
         cwd=tmp_path)
    cli = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert _sets(app) == _sets(cli)
    assert {m["score"] for m in _sets(cli).values()} == {"aps"} and "APS at 95 % coverage" in table
