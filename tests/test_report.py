"""Tables: numbers equal direct metric calls, units as in the paper, marks, formats, Welch's test."""
import csv
import io
import json
import math
import statistics

import numpy as np
import pytest
import torch
from scipy import stats as sps

from nctv import metrics
from nctv.results import MethodResult, MetricStats, RunResult, welch_test, welch_tests
from nctv.report import (
    metric_column,
    results_table,
    sce_exponent,
    summary_line,
    timing_table,
    to_csv,
    to_json,
    to_latex,
    to_markdown,
    welch_table,
    write_tables,
)

BINS = (10, 15)


def _method(name, logits_per_seed, labels, stochastic, uses_model=False, params=None):
    per_bin = {}
    for b in BINS:
        runs = [metrics.evaluate(z, labels, n_bins=b) for z in logits_per_seed]
        per_bin[b] = {k: MetricStats.from_runs([r[k] for r in runs]) for k in metrics.METRIC_NAMES}
    return MethodResult(name, stochastic, uses_model, list(range(len(logits_per_seed))), per_bin,
                        [0.5] * len(logits_per_seed), params or {}, logits_per_seed[0], None)


@pytest.fixture(scope="module")
def case():
    g = torch.Generator().manual_seed(3)
    n, k = 400, 8
    labels = torch.randint(0, k, (n,), generator=g)
    # An over-confident model: right class boosted, then everything scaled up.
    z = torch.randn(n, k, generator=g) + 2.0 * torch.nn.functional.one_hot(labels, k) * (torch.rand(n, 1, generator=g) > 0.3)
    z = 3.0 * z
    logits = {
        "Uncalibrated": [z],
        "Temperature Scaling": [z / 2.5],
        "Matrix Scaling": [z * 1.5],
        "Neural Clamping (FL)": [z / t for t in (2.8, 3.0, 3.3)],
    }
    methods = {
        "Uncalibrated": _method("Uncalibrated", logits["Uncalibrated"], labels, False),
        "Temperature Scaling": _method("Temperature Scaling", logits["Temperature Scaling"], labels, False),
        "Matrix Scaling": _method("Matrix Scaling", logits["Matrix Scaling"], labels, False),
        "Neural Clamping (FL)": _method("Neural Clamping (FL)", logits["Neural Clamping (FL)"], labels, True, True),
    }
    result = RunResult(
        kind="run", model={"name": "toy"}, calibration={"name": "cal", "size": 400, "fingerprint": "a"},
        test={"name": "test", "size": n, "fingerprint": "b"}, n_classes=k, class_names=None, bins=list(BINS),
        seeds=[0, 1, 2], fitter="fast", methods=methods, welch=welch_tests(methods, BINS), cache_hits={},
        settings={"device": "cpu"}, seconds=1.0, created="2024-01-01T00:00:00+00:00", test_labels=labels,
    )
    return result, logits, labels


def test_units_follow_the_paper():
    assert sce_exponent(8) == 2 and sce_exponent(100) == 2 and sce_exponent(1000) == 3
    assert metric_column("ece", 8).scale == 100 and metric_column("ece", 8).unit == "%"
    assert metric_column("accuracy", 8).scale == 100
    assert metric_column("entropy", 8).scale == 1
    assert metric_column("sce", 10).label() == "SCE (×10⁻²) ↓"
    assert metric_column("sce", 1000).scale == 1000
    assert metric_column("entropy", 10).label() == "Entropy ↑"
    with pytest.raises(ValueError, match="Unknown metric"):
        metric_column("f1", 10)


def test_table_numbers_equal_direct_metric_calls(case):
    result, logits, labels = case
    for b in BINS:
        table = results_table(result, n_bins=b)
        assert table.rows == list(logits)
        for i, name in enumerate(table.rows):
            zs = logits[name]
            for j, col in enumerate(table.columns):
                fn = getattr(metrics, col.key)
                values = [fn(z) if col.key == "entropy" else fn(z, labels, n_bins=b) for z in zs]
                cell = table.cells[i][j]
                assert cell.mean == pytest.approx(statistics.fmean(values) * col.scale, rel=1e-12, abs=1e-12)
                if name == "Uncalibrated":
                    assert cell.std is None
                elif len(values) > 1:
                    assert cell.std == pytest.approx(statistics.stdev(values) * col.scale, rel=1e-9, abs=1e-12)
                else:
                    assert cell.std == 0


def test_best_and_second_marks_follow_shown_values(case):
    result, logits, labels = case
    table = results_table(result, n_bins=15)
    for j, col in enumerate(table.columns):
        shown = [round(r[j].mean, col.decimals) for r in table.cells]
        order = sorted(set(shown), reverse=col.higher_is_better)
        for r, v in zip(table.cells, shown):
            expected = 1 if v == order[0] else (2 if len(order) > 1 and v == order[1] else None)
            assert r[j].rank == expected
    # Temperature scaling never changes predictions: equal accuracy everywhere except Matrix Scaling's
    # scaling (which keeps argmax too), so every row shares the best accuracy.
    acc = [r[0].rank for r in table.cells]
    assert acc == [1, 1, 1, 1]


def test_markdown_and_latex_show_marks_units_and_fitter(case):
    result, _, _ = case
    table = results_table(result, n_bins=15)
    md = to_markdown(table)
    ece_col = [c.key for c in table.columns].index("ece")
    best_row = min(range(len(table.rows)), key=lambda i: table.cells[i][ece_col].mean)
    best_text = table.cells[best_row][ece_col].format(2)
    assert f"**{best_text}**" in md
    assert "ECE (%) ↓" in md and "SCE (×10⁻²) ↓" in md and "fitter: fast" in md
    assert "| Uncalibrated |" in md and "± 0 |" in md  # deterministic rows show ± 0
    tex = to_latex(table)
    assert tex.count(r"\toprule") == 1 and r"\bottomrule" in tex and r"\midrule" in tex
    assert r"ECE (\%) $\downarrow$" in tex and r"SCE ($\times10^{-2}$)" in tex
    assert r"\textbf{" + best_text.replace(" ± ", r" $\pm$ ") + "}" in tex
    assert r"\underline{" in tex
    # The Neural Clamping group starts after a rule, as in the paper.
    lines = tex.splitlines()
    nc = next(i for i, line in enumerate(lines) if line.startswith("Neural Clamping"))
    assert lines[nc - 1] == r"\midrule"


def test_csv_and_json_hold_the_unrounded_numbers(case):
    result, logits, labels = case
    tables = [results_table(result, b) for b in BINS]
    rows = list(csv.DictReader(io.StringIO(to_csv(tables))))
    assert len(rows) == len(BINS) * len(logits)
    for row in rows:
        b = int(row["bins"])
        zs = logits[row["method"]]
        ece = statistics.fmean(metrics.ece(z, labels, b) for z in zs)
        sce = statistics.fmean(metrics.sce(z, labels, b) for z in zs)
        assert float(row["ECE (%)"]) == pytest.approx(100 * ece, rel=1e-12)
        assert float(row["SCE (×10⁻²)"]) == pytest.approx(100 * sce, rel=1e-12)
    data = json.loads(to_json(tables[0]))
    first = data["rows"][0]
    assert first["method"] == "Uncalibrated"
    assert first["cells"]["accuracy"]["mean"] == pytest.approx(100 * metrics.accuracy(logits["Uncalibrated"][0], labels))


def test_welch_matches_the_textbook_formula():
    def mres(name, runs):
        return MethodResult(name, True, False, list(range(len(runs))), {15: {"ece": MetricStats.from_runs(runs)}}, [], {})

    a, b = [0.010, 0.012, 0.011, 0.013], [0.020, 0.017, 0.021]
    w = welch_test("ece", 15, mres("NC", a), mres("TS", b))
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    t = (np.mean(a) - np.mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    assert w.t == pytest.approx(t) and w.df == pytest.approx(df)
    assert w.p == pytest.approx(2 * sps.t.sf(abs(t), df))
    assert w.better is True  # lower ECE is better

    # A deterministic baseline is a constant: one-sample t-test, df = n − 1.
    w = welch_test("ece", 15, mres("NC", a), mres("TS", [0.02]))
    t1 = (np.mean(a) - 0.02) / (np.std(a, ddof=1) / math.sqrt(len(a)))
    assert w.t == pytest.approx(t1) and w.df == len(a) - 1 and "one-sample" in w.note
    # No spread anywhere: exact comparison.
    w = welch_test("ece", 15, mres("NC", [0.01, 0.01]), mres("TS", [0.02]))
    assert w.t == -math.inf and w.p == 0.0
    w = welch_test("ece", 15, mres("NC", [0.02, 0.02]), mres("TS", [0.02]))
    assert (w.t, w.p, w.better) == (0.0, 1.0, None)
    w = welch_test("ece", 15, mres("NC", [0.01]), mres("TS", [0.02]))
    assert w.t is None and w.p is None and "2 runs" in w.note


def test_welch_picks_the_best_baseline_per_metric(case):
    result, logits, labels = case
    tests = {w.metric: w for w in result.welch_for(15)}
    baselines = ["Temperature Scaling", "Matrix Scaling"]  # not the reference, not NC
    ece = {n: metrics.ece(logits[n][0], labels, 15) for n in baselines}
    assert tests["ece"].baseline == min(ece, key=ece.get)
    ent = {n: metrics.entropy(logits[n][0]) for n in baselines}
    assert tests["entropy"].baseline == max(ent, key=ent.get)
    md = to_markdown(welch_table(result, 15))
    assert tests["ece"].baseline in md and "Welch" in md


def test_json_round_trip_and_files(case, tmp_path):
    result, _, _ = case
    again = RunResult.from_json(result.to_json())
    assert to_markdown(results_table(again, 15)) == to_markdown(results_table(result, 15))
    assert again.welch == result.welch
    paths = write_tables(result, tmp_path)
    assert sorted(p.name for p in paths) == ["table.csv", "table.json", "table.md", "table.tex"]
    assert all(p.stat().st_size > 0 for p in paths)
    assert "15 bins" in (tmp_path / "table.md").read_text()
    line = summary_line(result)
    assert "\n" not in line and "Neural Clamping (FL) ECE" in line and "fitter fast" in line


def test_timing_table_columns(case):
    result, _, _ = case
    result = RunResult.from_dict(result.to_dict())
    result.kind = "timing"
    result.methods["Temperature Scaling"].params["resolution"] = 0.01
    t = timing_table(result, 15)
    assert [c.title for c in t.columns] == ["Resolution", "Accuracy", "Entropy", "ECE", "Time"]
    md = to_markdown(t)
    assert "| 0.01 |" in md and "N/A" in md


def test_unknown_bins_is_a_clear_error(case):
    with pytest.raises(ValueError, match="no 20-bin results"):
        results_table(case[0], n_bins=20)
