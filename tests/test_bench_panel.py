"""The bench's panel: rows fitted and scored by the engine, the target judged by the paired interval of
(NC default − best alternative) with seeds pooled, the δ₀ = 0 row, which rows an earlier report lends."""
import json
import math
import warnings

import pytest
import torch

from bench import panel
from bench.cases import synthetic_logits
from nctv.metrics import ece


def _nc(model, row, seed, ece, passes=100.5, **extra):
    return dict(model=model, row=row, seed=seed, test_ece=ece / 100, passes=passes, seconds=1.0,
                temperature=3.0, delta_norm=1.0, **extra)


def _report(path, commit, panel_nc, nctoolkit=()):
    path.write_text(json.dumps({"run": {"commit": commit, "dirty": False, "started": "x"},
                                "results": {"panel_nc": list(panel_nc), "nctoolkit": list(nctoolkit)}}))
    return path


def test_reference_rows_fill_only_what_the_run_lacks(tmp_path):
    older = _report(tmp_path / "old.json", "aaa", [
        _nc("m", "NC default", 0, 9.0), _nc("m", "NC toolkit", 0, 0.7),
        _nc("m", "NC paper", 0, 3.0, error="boom"),          # failed: never lent
        _nc("m", "NC paper", 1, 3.0, capped=True)],          # stopped at its cap: never lent
        [dict(model="m", settings="toolkit", order="own", seed=0, test_ece=0.008)])
    # A newer report that already lent the toolkit row from a third one: that origin is kept.
    newer = _report(tmp_path / "new.json", "bbb", [
        _nc("m", "NC default", 0, 0.8), _nc("m", "NC toolkit", 0, 0.6, from_report="third.json (commit ccc)")])
    results = {"panel_nc": [_nc("m", "NC default", 0, 0.5)]}
    panel.add_reference_rows(results, [newer, older])

    rows = {r["row"]: r for r in results["panel_nc"]}
    assert sorted(rows) == ["NC default", "NC toolkit"]
    assert rows["NC default"]["test_ece"] == 0.005 and "from_report" not in rows["NC default"]   # this run's own
    assert rows["NC toolkit"]["test_ece"] == 0.006                                             # first report wins
    assert rows["NC toolkit"]["from_report"] == "third.json (commit ccc)"
    assert results["nctoolkit"][0]["from_report"] == f"{older} (commit aaa)"
    assert [r["commit"] for r in results["panel_references"]] == ["bbb", "aaa"]


def test_the_report_with_more_finished_runs_of_a_row_lends_it(tmp_path):
    one = _report(tmp_path / "one.json", "aaa", [_nc("m", "NC toolkit", 0, 2.6)])
    three = _report(tmp_path / "three.json", "bbb", [_nc("m", "NC toolkit", s, 2.5 + s / 100) for s in range(3)]
                    + [_nc("m", "NC toolkit", 3, 9.9, capped=True)])
    results = {"panel_nc": []}
    panel.add_reference_rows(results, [one, three])
    assert sorted(r["seed"] for r in results["panel_nc"]) == [0, 1, 2]
    assert {r["from_report"] for r in results["panel_nc"]} == {f"{three} (commit bbb)"}
    # On a tie the first report listed wins.
    results = {"panel_nc": []}
    panel.add_reference_rows(results, [one, _report(tmp_path / "other.json", "ccc", [_nc("m", "NC toolkit", 0, 2.7)])])
    assert [r["test_ece"] for r in results["panel_nc"]] == [pytest.approx(0.026)]


def _baselines(ts=1.2, grid=1.1, odir=0.9):
    methods = {"Uncalibrated": {"test_ece": 0.08, "seconds": 0.0}}
    for name, e in (("Temperature Scaling", ts), ("TS by Grid Search", grid), ("Dir-ODIR", odir)):
        methods[name] = {"test_ece": e / 100, "seconds": 0.1, "temperature": 3.0}
    return {"methods": methods}


def test_without_logits_the_target_falls_back_to_means_and_says_so():
    default = [_nc("m", "NC default", s, e, passes=10.0) for s, e in enumerate((0.80, 0.90, 1.00))]
    runs = {"NC default": default,
            "NC paper": [_nc("m", "NC paper", s, e, from_report="old.json") for s, e in enumerate((0.70, 0.80))],
            "NC toolkit": [_nc("m", "NC toolkit", s, e) for s, e in enumerate((0.86, 0.88))]}  # mean 0.87
    out = panel.panel_summary("m", _baselines(), runs)
    t = out["ece_target"]
    assert t["rule"] == "means" and t["best_alternative"] == "NC paper"   # the lowest mean, 0.75
    assert t["value"] == pytest.approx(0.85)
    assert t["measured"] == pytest.approx(0.90) and t["met"] is False
    assert set(t["against"]) == {"TS by Grid Search", "NC paper", "NC toolkit"} and t["lent"] == ["NC paper"]
    assert t["paired"] == {} and sorted(t["not_paired"]) == ["NC paper", "NC toolkit", "TS by Grid Search"]
    assert out["pass_target"]["ratio"] == pytest.approx(10.0 / 100.5) and out["pass_target"]["met"]
    text = " ".join(panel.target_lines("NC default", t, "95 %"))
    assert "(NC paper †)" in text and "earlier rule on means" in text and "missed by 0.05 point" in text

    # The best baseline is Dir-ODIR (0.9 %), one deterministic value: the one-sample t statistic by hand.
    assert out["best_baseline"] == "Dir-ODIR"
    mean, sd = 0.90, math.sqrt(((0.8 - 0.9) ** 2 + (1.0 - 0.9) ** 2) / 2)
    assert out["welch_vs_best_baseline"]["t"] == pytest.approx((mean - 0.9) / (sd / math.sqrt(3)), abs=1e-9)

    # Without the paper row, the toolkit recipe sets the target and the default meets it.
    del runs["NC paper"]
    t = panel.panel_summary("m", _baselines(), runs)["ece_target"]
    assert t["value"] == pytest.approx(0.97) and t["met"] is True


def test_welch_matches_the_formula():
    a, b = [1.0, 1.2, 0.9], [0.7, 0.75, 0.9, 0.8]
    ma, mb = sum(a) / 3, sum(b) / 4
    va = sum((x - ma) ** 2 for x in a) / 2
    vb = sum((x - mb) ** 2 for x in b) / 3
    t = (ma - mb) / math.sqrt(va / 3 + vb / 4)
    assert panel.welch(a, b)["t"] == pytest.approx(t, rel=1e-12)
    assert 0 < panel.welch(a, b)["p"] < 0.1


def _runs(values):
    return [dict(temperature=t, delta_norm=d, test_ece=e) for t, d, e in values]


def test_own_order_fidelity_flags_only_differences_beyond_chance():
    ours = _runs([(3.70, 1.20, 0.007), (3.71, 1.21, 0.008), (3.72, 1.22, 0.009)])
    same = panel.fidelity_summary("m", ours, _runs([(3.71, 1.21, 0.008), (3.72, 1.20, 0.007), (3.70, 1.22, 0.009)]),
                                  None, None)
    t = same["own_order"]["temperature"]
    assert t["difference"] == pytest.approx(0.0, abs=1e-12) and t["within"] and t["welch_p"] == pytest.approx(1.0)
    assert t["tolerance"] == pytest.approx(0.02)                       # twice the seed-to-seed std (0.01)
    far = panel.fidelity_summary("n", ours, _runs([(4.70, 1.20, 0.007), (4.71, 1.21, 0.008), (4.72, 1.22, 0.009)]),
                                 None, None)
    assert not far["own_order"]["temperature"]["within"]
    verdict = " ".join(panel._own_order_verdict([same, far]))
    assert "5 of 6 comparisons lie within the tolerance" in verdict   # only the far model's T is out
    assert "below 0.0083" in verdict                                     # 5 % over 6 comparisons
    assert verdict.strip().endswith("does not explain: n T.")


# ---------------------------------------------------------------------------------------------
# The paired rule on logits whose verdict is known


def _kept(tmp_path, label, seed, logits, labels):
    """A run of ``label`` whose calibrated test logits lie where a case keeps them."""
    p = {"logits_dir": str(tmp_path), "model": "m", "seed": seed}
    return {"model": "m", "row": label, "seed": seed, "test_ece": ece(logits, labels), "passes": 10.0, "seconds": 1.0,
            "temperature": 1.0, "delta_norm": 0.0, "logits": panel._keep_logits(p, label, logits, labels)}


def _panel_of(tmp_path, default_logits, alternative_logits, labels):
    """A panel of one model: TS by grid search (the only alternative) and two seeds of the default."""
    grid = _kept(tmp_path, "TS by Grid Search", 0, alternative_logits, labels)
    baselines = _baselines()
    baselines["methods"]["TS by Grid Search"] = dict(grid, seconds=0.1)
    results = {"panel_baselines": [dict(baselines, model="m")],
               "panel_nc": [_kept(tmp_path, "NC default", s, z, labels) for s, z in enumerate(default_logits)]}
    return panel.summarise(results)["panel"][0]


@pytest.fixture(scope="module")
def synthetic():
    """Over-confident logits 2.5·u whose labels are drawn from softmax(u): u is calibrated exactly."""
    z, y = synthetic_logits(4000, 10, 3, torch.device("cpu"))
    return z, y


def test_the_same_predictions_are_tied_with_an_interval_of_zero(tmp_path, synthetic):
    z, y = synthetic
    t = _panel_of(tmp_path, [z / 2.5, z / 2.5], z / 2.5, y)["ece_target"]
    c = t["paired"]["TS by Grid Search"]
    assert t["rule"] == "paired" and t["met"]
    assert (c["difference"], c["low"], c["high"]) == (0.0, 0.0, 0.0) and c["relation"] == "tied"


def test_an_over_confident_default_misses_and_a_calibrated_one_meets(tmp_path, synthetic):
    z, y = synthetic
    # The plain ECE difference, the default's two seeds averaged: about 24 points, far beyond margin and noise.
    plug_in = 100 * ((ece(z, y) + ece(z * 1.01, y)) / 2 - ece(z / 2.5, y))
    m = _panel_of(tmp_path / "worse", [z, z * 1.01], z / 2.5, y)
    t = m["ece_target"]
    c = t["paired"]["TS by Grid Search"]
    assert t["met"] is False and c["relation"] == "higher" and c["low"] > panel.ECE_MARGIN_PT
    # The interval's estimate is debiased: the calibrated alternative's plain ECE (about 0.9 point) is mostly
    # the noise of its bins, which the debiased estimate removes, so it lies a little above the plain difference.
    assert c["low"] < plug_in < c["high"] and 0 < c["difference"] - plug_in < 100 * ece(z / 2.5, y)
    line = panel.target_lines("NC default", t, "95 %")[0]
    assert f"[{panel._pt(c['low'])}, {panel._pt(c['high'])}] point, higher" in line and line.endswith("**missed**.")

    t = _panel_of(tmp_path / "better", [z / 2.5, z / 2.45], z, y)["ece_target"]
    c = t["paired"]["TS by Grid Search"]
    assert t["met"] is True and c["relation"] == "lower" and c["high"] < 0

    # A little over-confident: an interval that holds both 0 and the limit cannot tell, and says so.
    t = _panel_of(tmp_path / "close", [z / 2.4, z / 2.41], z / 2.5, y)["ece_target"]
    c = t["paired"]["TS by Grid Search"]
    assert c["low"] < 0 < panel.ECE_MARGIN_PT < c["high"] and c["relation"] == "tied" and t["met"] is None
    assert panel.target_lines("NC default", t, "95 %")[0].endswith("too wide to tell: not shown.")


# ---------------------------------------------------------------------------------------------
# A tiny real panel: one embedded model, two seeds, a few hundred images, every row by the engine

MODEL = "fmnist-resnet"
SIZES = dict(cal_size=200, test_size=400)


@pytest.fixture(scope="module")
def tiny_panel(tmp_path_factory):
    folder = tmp_path_factory.mktemp("panel")
    base = dict(model=MODEL, panel_dir=str(folder), logits_dir=str(folder / "logits"), **SIZES)
    cpu = torch.device("cpu")
    # Without Dir-ODIR, whose cross-validated selection takes most of a minute and is not what is tested here.
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(panel, "PANEL_BASELINES", ("Temperature Scaling", "TS by Grid Search"))
        warnings.simplefilter("ignore")  # 200 images for a δ of 784 values: the library warns, rightly
        nc = [panel.case_panel_nc(dict(base, row=label, seed=seed, **panel.NC_ROWS[label].params(3)), cpu)
              for label in ("NC default", panel.RANDOM_INIT_ROW) for seed in (0, 1)]
        return {"panel_baselines": [panel.case_panel_baselines(base, cpu)], "panel_nc": nc}


def test_the_panel_verdict_is_the_engines_paired_interval_with_seeds_pooled(tiny_panel):
    from nctv.data import get_splits
    from nctv.experiment import run_experiment
    from nctv.results import COMPARED_METHOD
    from nctv.zoo import load_model

    m = panel.summarise(tiny_panel)["panel"][0]
    t = m["ece_target"]
    assert t["rule"] == "paired" and t["best_alternative"] == "TS by Grid Search"
    c = t["paired"]["TS by Grid Search"]
    assert t["met"] == (True if c["high"] <= panel.ECE_MARGIN_PT else False if c["low"] > panel.ECE_MARGIN_PT
                        else None)

    # The engine itself, both rows and both seeds in one run: it pools the seeds and pairs the rows.
    loaded = load_model(MODEL)
    cal, test = get_splits(loaded, "fashion-mnist", calibration_size=SIZES["cal_size"], test_size=SIZES["test_size"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = run_experiment(loaded, cal, test, methods=["TS by Grid Search", COMPARED_METHOD], seeds=[0, 1], bins=[15],
                             progress=False, precision="fp32")
    ref = run.comparison(COMPARED_METHOD, "TS by Grid Search", "ece", 15)
    assert [c["difference"], c["low"], c["high"]] == pytest.approx([100 * ref.difference, 100 * ref.low, 100 * ref.high],
                                                                   abs=1e-9)
    for row, method in (("NC default", COMPARED_METHOD), ("TS by Grid Search", "TS by Grid Search")):
        stats = run.stats(method, "ece", 15)
        assert m["rows"][row]["ece"][0] == pytest.approx(100 * stats.mean, abs=1e-9)
        assert m["intervals"][row] == pytest.approx([100 * stats.ci_low, 100 * stats.ci_high], abs=1e-9)


def test_the_default_starts_at_zero_and_is_paired_against_a_random_start(tiny_panel):
    from safetensors.torch import load_file

    runs = [r for r in tiny_panel["panel_nc"] if r["row"] == "NC default"]
    first, second = (load_file(str(panel._resolve(r["logits"])))["logits"] for r in runs)
    assert torch.equal(first, second)                      # δ₀ = 0, the default: the seed draws nothing
    random = [r for r in tiny_panel["panel_nc"] if r["row"] == panel.RANDOM_INIT_ROW]
    assert random[0]["delta_norm"] != random[1]["delta_norm"]   # while a random δ₀ is the seed's draw
    assert random[0]["settings"] == {"init_std": 0.1} and runs[0]["settings"] == {}
    assert panel.NC_ROWS["NC default"].deterministic and not panel.NC_ROWS[panel.RANDOM_INIT_ROW].deterministic

    m = panel.summarise(tiny_panel)["panel"][0]
    z = m["zero_init"]
    assert z["rows"] == ["NC default", panel.RANDOM_INIT_ROW]
    assert z["means"] == pytest.approx([50 * (runs[0]["test_ece"] + runs[1]["test_ece"]),
                                        50 * (random[0]["test_ece"] + random[1]["test_ece"])])
    c = z["against_default"]
    assert c["low"] <= c["difference"] <= c["high"]
    assert z["ece_target"]["rule"] == "paired"
    table = "\n".join(panel._zero_init_table([m], "95 %"))
    assert f"{panel._pt(c['difference'])} [{panel._pt(c['low'])}, {panel._pt(c['high'])}], {c['relation']}" in table
