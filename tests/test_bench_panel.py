"""The bench's panel summaries: which rows an earlier report lends, and how the targets are derived."""
import json
import math

import pytest

from bench import panel


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


def test_ece_target_is_the_lowest_reference_plus_a_tenth_of_a_point():
    default = [_nc("m", "NC default", s, e, passes=10.0) for s, e in enumerate((0.80, 0.90, 1.00))]
    runs = {"NC default": default,
            "NC paper": [_nc("m", "NC paper", s, e) for s, e in enumerate((0.70, 0.80))],     # mean 0.75
            "NC toolkit": [_nc("m", "NC toolkit", s, e) for s, e in enumerate((0.86, 0.88))]}  # mean 0.87
    out = panel.panel_summary("m", _baselines(), runs)
    t = out["ece_target"]
    assert t["value"] == pytest.approx(0.85)            # the paper recipe's 0.75 is the lowest reference
    assert t["measured"] == pytest.approx(0.90) and t["met"] is False
    assert set(t["against"]) == {"TS by Grid Search", "NC paper", "NC toolkit"}
    assert out["pass_target"]["ratio"] == pytest.approx(10.0 / 100.5) and out["pass_target"]["met"]

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
