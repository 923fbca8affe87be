"""Paper-style runs on a small synthetic model: logit cache, aggregation, seeds, ablation, timing,
γ sweep and initialisation study wrappers, and the saved results."""
import json
import os
import statistics
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from nctv import cache, data, experiment, metrics, results
from nctv.data import ArrayImages, Split
from nctv.inference import model_logits

K = 4
CONFIG = {"input_size": (1, 8, 8), "mean": (0.5,), "std": (0.25,), "interpolation": "bilinear", "crop_pct": 1.0}
TEMPLATES = np.random.default_rng(123).uniform(0, 1, (K, 8, 8))
RANGE = (torch.full((1, 8, 8), -2.0), torch.full((1, 8, 8), 2.0))  # images of pixel 0 and 1 under CONFIG


def toy_split(n, seed, name):
    """Noisy copies of K grey 8×8 templates, as uint8 images (a real Split, preprocessed by timm)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, K, n)
    images = np.clip(TEMPLATES[labels] + rng.normal(0, 0.9, (n, 8, 8)), 0, 1)
    return Split(name, ArrayImages((images * 255).round().astype(np.uint8), name), np.arange(n), labels,
                 [f"class {i}" for i in range(K)], CONFIG)


class CountingMatchedFilter(torch.nn.Module):
    """A linear classifier matched to the templates (over-confident), counting its forward calls."""

    def __init__(self, scale=0.25):
        super().__init__()
        self.fc = torch.nn.Linear(64, K)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor((TEMPLATES.reshape(K, 64) - 0.5) / 0.25 * scale, dtype=torch.float32))
            self.fc.bias.zero_()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x.flatten(1))


@pytest.fixture(scope="module")
def splits():
    return toy_split(400, 1, "toy calibration"), toy_split(500, 2, "toy test")


def test_logit_cache_hits_and_invalidates(splits, tmp_path):
    cal, test = splits
    model = CountingMatchedFilter()
    first = cache.split_logits(model, test, tmp_path, batch_size=128)
    assert not first.hit and model.calls == 4  # 500 samples in batches of 128
    second = cache.split_logits(model, test, tmp_path, batch_size=128)
    assert second.hit and model.calls == 4 and torch.equal(second.logits, first.logits)
    torch.testing.assert_close(first.logits, model_logits(model, test.tensors()[0]))
    assert torch.equal(first.labels, test.labels)
    # Another split (different content) misses; so do changed weights.
    other = cache.split_logits(model, toy_split(500, 3, "toy test"), tmp_path)
    assert not other.hit
    with torch.no_grad():
        model.fc.bias.add_(0.1)
    changed = cache.split_logits(model, test, tmp_path)
    assert not changed.hit and not torch.equal(changed.logits, first.logits)
    assert len(list((tmp_path / "logits").glob("*.safetensors"))) == 3
    assert not cache.split_logits(model, test, False).hit  # cache off


def test_logit_cache_cap_deletes_least_recently_used_first(splits, tmp_path, monkeypatch):
    cal, test = splits
    model = CountingMatchedFilter()
    monkeypatch.delenv("NCTV_CACHE_MAX_MB", raising=False)
    a = cache.split_logits(model, test, tmp_path)  # 500 samples
    b = cache.split_logits(model, cal, tmp_path)  # 400 samples, written after a
    os.utime(a.path, ns=(10**18,) * 2)
    os.utime(b.path, ns=(10**18 + 10**9,) * 2)  # both in the past, b used last
    again = cache.split_logits(model, test, tmp_path)
    assert again.hit and a.path.stat().st_mtime_ns > b.path.stat().st_mtime_ns  # a hit marks a as used
    size_a, size_b = a.path.stat().st_size, b.path.stat().st_size
    # Room for a and b only; writing c (300 samples, smaller than b) must evict b, now the least recently used.
    monkeypatch.setenv("NCTV_CACHE_MAX_MB", str((size_a + size_b) / 2**20))
    c = cache.split_logits(model, toy_split(300, 4, "toy third"), tmp_path)
    assert not b.path.exists() and a.path.exists() and c.path.exists()
    # A file larger than the cap on its own is still kept: it is the one in use.
    monkeypatch.setenv("NCTV_CACHE_MAX_MB", "0.000001")
    d = cache.split_logits(model, toy_split(200, 5, "toy fourth"), tmp_path)
    assert [p.name for p in (tmp_path / "logits").iterdir()] == [d.path.name]
    assert cache.split_logits(model, toy_split(200, 5, "toy fourth"), tmp_path).hit


def test_logit_cache_cap_setting(tmp_path, monkeypatch):
    monkeypatch.delenv("NCTV_CACHE_MAX_MB", raising=False)
    assert cache.cache_max_bytes() == cache.DEFAULT_CACHE_MAX_MB * 2**20
    monkeypatch.setenv("NCTV_CACHE_MAX_MB", "0")
    assert cache.cache_max_bytes() is None
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv("NCTV_CACHE_MAX_MB", bad)
        with pytest.raises(ValueError, match="NCTV_CACHE_MAX_MB must be a number of megabytes"):
            cache.cache_max_bytes()
    # No cap: nothing is deleted; a cap deletes the oldest files (by last use) until the rest fit.
    for i, size in enumerate((300, 200, 100)):
        (tmp_path / f"{i}.safetensors").write_bytes(b"x" * size)
        os.utime(tmp_path / f"{i}.safetensors", ns=(10**18 + i * 10**9,) * 2)
    (tmp_path / "other.tmp123").write_bytes(b"x" * 1000)  # a half-written file is not the cache's to delete
    assert cache.prune_cache(tmp_path, None) == []
    assert cache.prune_cache(tmp_path, 350) == [tmp_path / "0.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.safetensors", "2.safetensors", "other.tmp123"]


def test_run_aggregates_seeds_and_matches_direct_metrics(splits, tmp_path):
    cal, test = splits
    model = CountingMatchedFilter()
    seen = []
    r = experiment.run_experiment(model, cal, test, methods=["Uncalibrated", "Temperature Scaling", "Neural Clamping (FL)"],
                                  seeds=2, bins=(10, 15), cache_dir=tmp_path, progress=False,
                                  callback=lambda f, m: seen.append((f, m)), init_std=0.1)
    assert r.fitter == "fast" and r.bins == [10, 15] and r.seeds == [0, 1]
    assert r.cache_hits == {"calibration": False, "test": False}
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and all(isinstance(m, str) for _, m in seen)

    x_test, y_test = test.tensors()
    z = model_logits(model, x_test)
    unc = r.methods["Uncalibrated"]
    assert unc.seeds == [0] and not unc.stochastic
    for b in (10, 15):
        assert unc.metrics[b]["ece"].runs == [metrics.ece(z, y_test, b)]
        assert unc.metrics[b]["ece"].std == 0.0

    ts = r.methods["Temperature Scaling"]
    t = ts.params["temperature"]
    torch.testing.assert_close(ts.test_logits, z / t)
    assert ts.metrics[15]["nll"].mean == pytest.approx(metrics.nll(z / t, y_test), rel=1e-6)

    nc = r.methods["Neural Clamping (FL)"]
    assert nc.stochastic and nc.uses_model and nc.seeds == [0, 1] and len(nc.fit_seconds) == 2
    # The kept logits are f(x + δ)/T of the first seed's learned parameters.
    torch.testing.assert_close(nc.test_logits, model_logits(model, x_test, delta=nc.delta) / nc.params["temperature"],
                               rtol=1e-5, atol=1e-5)
    first = metrics.evaluate(nc.test_logits, y_test, 15)
    assert nc.metrics[15]["ece"].runs[0] == pytest.approx(first["ece"], abs=1e-7)
    runs = nc.metrics[15]["entropy"].runs
    assert nc.metrics[15]["entropy"].mean == pytest.approx(statistics.fmean(runs))
    assert nc.metrics[15]["entropy"].std == pytest.approx(statistics.stdev(runs))

    # Welch: NC (FL) against the only baseline (TS), for every metric with a direction and bin count.
    directed = [m for m in metrics.METRIC_NAMES if m != "entropy"]
    assert {(w.metric, w.n_bins) for w in r.welch} == {(m, b) for m in directed for b in (10, 15)}
    assert {w.baseline for w in r.welch} == {"Temperature Scaling"}

    # Intervals: the settings are recorded, and a deterministic row's interval is that of its logits on
    # the resamples the settings name.
    from nctv import intervals as iv

    assert r.settings["intervals"] == iv.IntervalSettings().to_dict()
    from nctv.data import row_keys

    key = row_keys(test)  # the test pictures' identities: what a run keys its resamples and tests by
    assert key.shape == (len(y_test), 2) and len({tuple(k) for k in key.tolist()}) == len(np.unique(x_test.numpy().reshape(len(x_test), -1), axis=0))
    counts = iv.resample_counts_for((key, y_test), 1000, 0)
    d = iv.method_draws([ts.test_logits], y_test, counts, 15, ["ece", "accuracy"])
    from nctv.consistency import consistency_test

    # ECE's interval reaches 0 where the calibration test does not reject (nctv.intervals.at_boundary).
    p_ts = consistency_test(ts.test_logits, y_test, 15, key=key).p_top_label
    assert ts.metrics[15]["calibration_p"].mean == p_ts
    for k in ("ece", "accuracy"):
        ci = iv.interval(d[k], k)
        ci = iv.at_boundary(ci, p_ts) if k == "ece" else ci
        assert (ts.metrics[15][k].ci_low, ts.metrics[15][k].ci_high) == pytest.approx((ci.low, ci.high), abs=1e-9)
    c = r.comparison("Neural Clamping (FL)", "Temperature Scaling", "ece", 15)
    assert c is not None and c.low <= c.difference <= c.high
    assert all(c.metric != "entropy" for c in r.comparisons)

    again = experiment.run_experiment(model, cal, test, methods=["Uncalibrated"], seeds=1, bins=(15,), cache_dir=tmp_path,
                                      progress=False)
    assert again.cache_hits == {"calibration": True, "test": True}

    # The default Neural Clamping starts at δ₀ = 0 and draws nothing: one fit, whatever the seed count,
    # no seed spread, and its interval is the test split's alone.
    default = experiment.run_experiment(model, cal, test, methods=["Neural Clamping (FL)"], seeds=3, bins=(15,),
                                        cache_dir=tmp_path, progress=False)
    one = default.methods["Neural Clamping (FL)"]
    assert not one.stochastic and one.seeds == [0] and len(one.fit_seconds) == 1 and one.metrics[15]["ece"].std == 0
    d = iv.method_draws([one.test_logits], y_test, counts, 15, ["ece"])
    ci = iv.at_boundary(iv.interval(d["ece"], "ece"), consistency_test(one.test_logits, y_test, 15, key=key).p_top_label)
    assert (one.metrics[15]["ece"].ci_low, one.metrics[15]["ece"].ci_high) == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_saved_results(splits, tmp_path):
    cal, test = splits
    model = CountingMatchedFilter()
    r = experiment.run_experiment(model, cal, test, methods=["Uncalibrated", "Neural Clamping (CE)"], seeds=2, bins=(15,),
                                  cache_dir=False, progress=False)
    paths = r.save(tmp_path)
    assert sorted(p.name for p in paths) == ["delta.safetensors", "results.json", "test_logits.safetensors"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["schema_version"] == results.RESULTS_SCHEMA_VERSION and data["fitter"] == "fast"
    nc = r.methods["Neural Clamping (CE)"]
    assert data["methods"]["Neural Clamping (CE)"]["metrics"]["15"]["ece"]["runs"] == nc.metrics[15]["ece"].runs
    assert data["model"]["fingerprint"] == cache.model_fingerprint(model)
    logits = load_file(str(tmp_path / "test_logits.safetensors"))
    assert torch.equal(logits["labels"], test.labels)
    assert torch.equal(logits["Neural Clamping (CE)"], r.methods["Neural Clamping (CE)"].test_logits)
    assert load_file(str(tmp_path / "delta.safetensors"))["Neural Clamping (CE)"].shape == (1, 8, 8)
    back = results.RunResult.from_json((tmp_path / "results.json").read_text())
    assert back.methods["Neural Clamping (CE)"].metrics[15]["ece"] == r.methods["Neural Clamping (CE)"].metrics[15]["ece"]


def test_ablation_rows_share_the_nc_fit(splits, tmp_path):
    cal, test = splits
    model = CountingMatchedFilter()
    r = experiment.run_ablation(model, cal, test, seeds=2, bins=(15,), cache_dir=False, progress=False)
    assert list(r.methods) == list(experiment.ABLATION_METHODS)
    nc, inp, out = (r.methods[n] for n in ("Neural Clamping (FL)", "NC input only", "NC output only"))
    x_test, _ = test.tensors()
    z = model_logits(model, x_test)
    assert torch.equal(inp.delta, nc.delta) and out.delta is None
    torch.testing.assert_close(inp.test_logits, model_logits(model, x_test, delta=nc.delta), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.test_logits, z / nc.params["temperature"])
    assert inp.params["temperature"] == 1.0 and inp.params["shares_fit_with"] == "Neural Clamping (FL)"
    assert inp.fit_seconds == nc.fit_seconds  # one fit per seed, shared
    ts_fl = r.methods["Temperature Scaling (FL)"]
    assert not ts_fl.stochastic and ts_fl.seeds == [0]
    r.save(tmp_path)  # rows sharing one δ are stored as separate tensors
    assert torch.equal(load_file(str(tmp_path / "delta.safetensors"))["NC input only"], nc.delta)


def test_timing_rows(splits):
    cal, test = splits
    start = time.perf_counter()
    r = experiment.run_timing(CountingMatchedFilter(), cal, test, resolutions=(0.1, 0.01), input_range=RANGE,
                              cache_dir=False, progress=False)
    wall = time.perf_counter() - start
    assert list(r.methods) == ["Uncalibrated", "TS-Grid (0.1)", "TS-Grid (0.01)", "NC (Eff.) (0.1)", "NC (Eff.) (0.01)",
                               "Neural Clamping (FL)"]
    assert r.methods["TS-Grid (0.01)"].params["resolution"] == 0.01
    # A grid temperature is a multiple of its step.
    t = r.methods["TS-Grid (0.1)"].params["temperature"]
    assert abs(t / 0.1 - round(t / 0.1)) < 1e-6
    # Every fit is timed once, and the fits are parts of the run: together no longer than the wall time
    # this test measured around it.
    seconds = [m.fit_seconds for m in r.methods.values()]
    assert all(len(s) == 1 and s[0] > 0 for s in seconds) and sum(s[0] for s in seconds) <= r.seconds <= wall
    with pytest.raises(ValueError, match="between 0 and 5"):
        experiment.run_timing(CountingMatchedFilter(), cal, test, resolutions=(0,), progress=False)


def test_gamma_sweep_and_init_study(splits):
    cal, test = splits
    model = CountingMatchedFilter()
    seen = []
    g = experiment.run_gamma_sweep(model, cal, test, gammas=[0.0, 1.0], progress=False, callback=lambda f, m: seen.append(f))
    s = g.sweep
    assert list(s.gammas) == [0.0, 1.0] and g.fitter == "fast"
    # The chosen γ is the one with the lowest calibration ECE (ties: the smaller).
    assert s.chosen_gamma == s.gammas[int(np.argmin(s.cal["ece"]))]
    assert seen[-1] == 1.0 and seen == sorted(seen)  # the sweep's pass count only grows: progress never goes back
    data = json.loads(g.to_json())
    assert data["kind"] == "gamma-sweep" and data["splits"]["test"]["ece"] == list(s.test["ece"])
    i = experiment.run_init_study(model, cal, test, runs=2, input_range=RANGE, progress=False)
    assert set(i.study.runs) == {"random", "data"} and len(i.study.runs["random"]) == 2
    assert i.n_classes == K
    summary = i.summary("ece")
    assert summary["random"].mean == pytest.approx(np.mean(i.study.values("random", "ece")))
    assert json.loads(i.to_json())["kind"] == "init-study"
    with pytest.raises(ValueError, match="input_range"):
        experiment.run_init_study(model, cal, test, runs=1, progress=False)


def test_a_saved_gamma_sweep_reads_back_whole_and_refuses_bad_values(splits):
    from nctv.calibration.studies import GammaSweep

    cal, test = splits
    g = experiment.run_gamma_sweep(CountingMatchedFilter(), cal, test, gammas=[0.0, 0.5, 1.0], progress=False)
    data = json.loads(g.to_json())
    back = type(g)(GammaSweep.from_dict(data), data["model"], data["calibration"], data["test"], data["settings"],
                   data["seconds"], data["created"])
    assert json.loads(back.to_json()) == data
    data["splits"]["test"]["ece"][1] = float("nan")
    with pytest.raises(ValueError, match="study's test ece must be 3 finite numbers"):
        GammaSweep.from_dict(data)
    data["splits"]["test"]["ece"] = [0.01, 0.02]
    with pytest.raises(ValueError, match="study's test ece must be 3 finite numbers"):
        GammaSweep.from_dict(data)


def test_a_saved_init_study_reads_back_whole_and_refuses_bad_values(splits):
    from nctv.calibration.studies import InitStudy

    cal, test = splits
    i = experiment.run_init_study(CountingMatchedFilter(), cal, test, runs=2, input_range=RANGE, progress=False)
    data = json.loads(i.to_json())
    back = type(i)(InitStudy.from_dict(data), data["model"], data["calibration"], data["test"], data["settings"],
                   data["seconds"], data["created"], data["n_classes"])
    assert json.loads(back.to_json()) == data
    data["runs"]["random"] = data["runs"]["random"][:1]
    with pytest.raises(ValueError, match="1 random runs for 2 seeds"):
        InitStudy.from_dict(data)
    data = json.loads(i.to_json())
    data["ci"]["data"]["ece"]["ci_high"] = float("inf")
    with pytest.raises(ValueError, match="data ece interval must be 2 finite numbers"):
        InitStudy.from_dict(data)


def test_study_progress_reaches_its_end_before_done(splits):
    """The fast fitter stops most γ values and runs well before their caps: the progress a sweep or an
    initialisation study reports comes close to its end before "done", instead of stopping short."""
    cal, test = splits
    model = CountingMatchedFilter()
    for run in (lambda cb: experiment.run_gamma_sweep(model, cal, test, gammas=[0.0, 0.5, 1.0, 1.5, 2.0, 3.0],
                                                      progress=False, callback=cb),
                lambda cb: experiment.run_init_study(model, cal, test, runs=3, input_range=RANGE, progress=False,
                                                     callback=cb)):
        seen = []
        run(lambda f, m: seen.append((f, m)))
        fractions = [f for f, _ in seen]
        assert fractions[-1] == 1.0 and fractions == sorted(fractions)
        assert fractions[-2] >= 0.85, seen[-4:]  # the last step before "done"


def test_bad_input_is_explained(splits):
    cal, test = splits
    model = CountingMatchedFilter()
    with pytest.raises(ValueError, match="Unknown method 'Platt'"):
        experiment.run_experiment(model, cal, test, methods=["Platt"], progress=False)
    with pytest.raises(ValueError, match="seeds must be at least 1"):
        experiment.run_experiment(model, cal, test, methods=["Uncalibrated"], seeds=0, progress=False)
    with pytest.raises(ValueError, match="fitter"):
        experiment.run_experiment(model, cal, test, methods=["Uncalibrated"], fitter="adam", progress=False)
    with pytest.raises(ValueError, match="more than the 500 test samples"):
        experiment.run_experiment(model, cal, test, methods=["Uncalibrated"], bins=(1000,), cache_dir=False, progress=False)
    assert experiment.check_methods(["temperature scaling", "NC (EFF.)"]) == ["Temperature Scaling", "NC (Eff.)"]


def test_tensor_pairs_work_as_splits(splits, tmp_path):
    cal, test = splits
    model = CountingMatchedFilter()
    kw = dict(methods=["Uncalibrated", "Temperature Scaling"], seeds=1, bins=(15,), cache_dir=tmp_path, progress=False)
    from_splits = experiment.run_experiment(model, cal, test, **kw)
    from_pairs = experiment.run_experiment(model, cal.tensors(), test.tensors(), **kw)
    for name in kw["methods"]:
        assert from_pairs.methods[name].metrics[15]["ece"].runs == from_splits.methods[name].metrics[15]["ece"].runs
    x, y = test.tensors()
    changed = x.clone()
    changed[0, 0, 0, 0] += 1.0
    assert data.TensorSplit(x, y).fingerprint == data.TensorSplit(x.clone(), y).fingerprint
    assert data.TensorSplit(x, y).fingerprint != data.TensorSplit(changed, y).fingerprint
    with pytest.raises(ValueError, match="pair"):
        experiment.run_experiment(model, "cal.npz", test, **kw)


def test_run_options_reach_every_fitted_neural_clamping(splits):
    """Non-default γ, λ, fitter, epochs and initialisation travel whole to each fitted object: NC (FL)
    and the frozen-δ row get the run's options, NC (CE) the same with γ = 0, TS (FL) the run's γ."""
    from nctv.settings import NCOptions

    cal, test = splits
    nc = NCOptions(gamma=0.5, weight_decay=0.02, fitter="paper", epochs=1, init="data")
    options = experiment.RunOptions(seeds=1, bins=(15,), nc=nc, input_range=RANGE, cache_dir=False, progress=False)
    methods = ["Uncalibrated", "Temperature Scaling (FL)", "Neural Clamping (CE)", "Neural Clamping (FL)",
               "NC δ frozen at 0"]
    r = experiment.run_experiment(CountingMatchedFilter(), cal, test, methods, options)
    fl = r.methods["Neural Clamping (FL)"].calibrator
    assert fl.options == nc and (fl.gamma_, fl.weight_decay_, fl.fitter_) == (0.5, 0.02, "paper")
    assert r.methods["Neural Clamping (CE)"].calibrator.options == nc.changed(gamma=0.0)
    assert r.methods["NC δ frozen at 0"].calibrator.options == nc.changed(learn_delta=False)
    assert r.methods["Temperature Scaling (FL)"].calibrator.gamma == 0.5
    assert r.settings["nc"] == nc.to_dict() and r.fitter == "paper"
    # The engine records the normalisation the δ image undoes, the same for every caller.
    assert (r.settings["mean"], r.settings["std"]) == ([0.5], [0.25])
    # Keywords build the same options, so the same run.
    again = experiment.run_experiment(CountingMatchedFilter(), cal, test, methods, seeds=1, bins=(15,), gamma=0.5,
                                      weight_decay=0.02, fitter="paper", epochs=1, init="data", input_range=RANGE,
                                      cache_dir=False, progress=False)
    assert experiment.RunOptions.make(seeds=1, bins=(15,), gamma=0.5, weight_decay=0.02, fitter="paper", epochs=1,
                                      init="data", input_range=RANGE, cache_dir=False, progress=False) == options
    for name in methods:
        assert again.methods[name].params == r.methods[name].params


def test_a_bad_setting_is_refused_before_any_model_pass(splits):
    cal, test = splits
    model = CountingMatchedFilter()
    with pytest.raises(ValueError, match=r"gamma must be at most 10 \(the paper uses 0 to 5\); got 50"):
        experiment.run_experiment(model, cal, test, ["Uncalibrated", "Neural Clamping (FL)"], gamma=50, progress=False)
    with pytest.raises(ValueError, match="Bin counts must be positive whole numbers"):
        experiment.run_ablation(model, cal, test, bins=(0,), progress=False)
    with pytest.raises(ValueError, match="init must be one of"):
        experiment.run_init_study(model, cal, test, runs=1, init="theorem", progress=False)
    with pytest.raises(TypeError, match="Unknown run setting"):
        experiment.run_gamma_sweep(model, cal, test, gammas=[0.0], nc_settings={"init": "data"})
    assert model.calls == 0


def test_a_saved_run_loads_whole(splits, tmp_path):
    """``RunResult.load`` reads back what ``save`` wrote, logits, labels and δ included."""
    cal, test = splits
    r = experiment.run_experiment(CountingMatchedFilter(), cal, test, ["Uncalibrated", "Neural Clamping (FL)"],
                                  seeds=1, bins=(15,), cache_dir=False, progress=False)
    r.save(tmp_path)
    back = results.RunResult.load(tmp_path)
    assert torch.equal(back.test_labels, test.labels) and back.settings == json.loads(r.to_json())["settings"]
    for name, m in r.methods.items():
        assert torch.equal(back.methods[name].test_logits, m.test_logits)
    assert torch.equal(back.methods["Neural Clamping (FL)"].delta, r.methods["Neural Clamping (FL)"].delta)
    assert back.methods["Uncalibrated"].delta is None
