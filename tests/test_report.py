"""Tables: numbers equal direct metric calls, units as in the paper, marks, formats, Welch's test."""
import csv
import dataclasses
import io
import json
import math
import shutil
import statistics
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats as sps

from nctv import metrics
from nctv.calibration.studies import GammaSweep, InitStudy
from nctv.intervals import interval
from nctv.results import MethodResult, MetricStats, RunResult, WelchTest, welch_test, welch_tests
from nctv.report import (
    comparison_table,
    gamma_table,
    init_study_table,
    latex_escape,
    metric_column,
    metrics_table,
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
    return MethodResult(name=name, stochastic=stochastic, uses_model=uses_model, seeds=list(range(len(logits_per_seed))),
                        metrics=per_bin, fit_seconds=[0.5] * len(logits_per_seed), params=params or {},
                        test_logits=logits_per_seed[0])


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
    assert metric_column("entropy", 10).label() == "Entropy"  # no better direction: no arrow, no mark
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
                if len(values) > 1:
                    assert cell.std == pytest.approx(statistics.stdev(values) * col.scale, rel=1e-9, abs=1e-12)
                else:  # measured once (the reference, deterministic methods): no spread to show
                    assert cell.std is None


def test_best_and_second_marks_follow_shown_values(case):
    result, logits, labels = case
    table = results_table(result, n_bins=15)
    for j, col in enumerate(table.columns):
        if col.key == "entropy":  # no better direction: never marked
            assert all(r[j].rank is None for r in table.cells)
            continue
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
    lines = {line.split(" | ")[0]: line for line in md.splitlines() if line.startswith("| ")}
    # Methods run once (the reference, deterministic methods) show no spread; NC (3 seeds) does, even a
    # measured spread of 0 (its temperature-scaled runs share one accuracy).
    assert all("±" not in lines["| " + n] for n in ("Uncalibrated", "Temperature Scaling", "Matrix Scaling"))
    assert lines["| Neural Clamping (FL)"].count(" ± ") == len(table.columns)
    tex = to_latex(table)
    assert tex.count(r"\toprule") == 1 and r"\bottomrule" in tex and r"\midrule" in tex
    assert r"ECE (\%) $\downarrow$" in tex and r"SCE ($\times$10$^{-2}$) $\downarrow$" in tex
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
        return MethodResult(name=name, stochastic=True, uses_model=False, seeds=list(range(len(runs))),
                            metrics={15: {"ece": MetricStats.from_runs(runs)}}, fit_seconds=[])

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
    assert "entropy" not in tests  # entropy has no better direction, so no best baseline to test against
    md = to_markdown(welch_table(result, 15))
    assert tests["ece"].baseline in md and "Welch" in md


def test_json_round_trip_and_files(case, tmp_path):
    result, _, _ = case
    again = RunResult.from_json(result.to_json())
    assert to_markdown(results_table(again, 15)) == to_markdown(results_table(result, 15))
    assert again.welch == result.welch
    paths = write_tables(result, tmp_path)
    assert sorted(p.name for p in paths) == ["slides.tex", "table.csv", "table.json", "table.md", "table.tex"]
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


@pytest.fixture(scope="module")
def one_seed(case):
    """The same run with one seed: every method measured once, so no spread and no Welch test."""
    result, logits, labels = case
    methods = {n: _method(n, zs[:1], labels, m.stochastic, m.uses_model)
               for (n, zs), m in zip(logits.items(), result.methods.values())}
    return dataclasses.replace(result, seeds=[0], methods=methods, welch=welch_tests(methods, BINS))


def test_one_run_per_method_shows_no_spread_and_no_welch_table(one_seed, tmp_path):
    assert one_seed.welch and all(w.p is None for w in one_seed.welch)  # tests exist but cannot be computed
    table = results_table(one_seed, 15)
    assert all(c.std is None for row in table.cells for c in row)
    assert welch_table(one_seed, 15).rows == []
    write_tables(one_seed, tmp_path)
    md, tex = (tmp_path / "table.md").read_text(), (tmp_path / "table.tex").read_text()
    assert "±" not in md and r"\pm" not in tex and "one run per method" in md
    assert "Welch" not in md and "Welch" not in tex and "needs at least 2 runs" not in md
    assert len(json.loads((tmp_path / "table.json").read_text())) == len(BINS)  # the result tables only
    rows = list(csv.DictReader(io.StringIO((tmp_path / "table.csv").read_text())))
    assert rows[0]["ECE (%)"] and rows[0]["ECE (%) std"] == ""


def test_welch_table_keeps_only_computed_tests(case):
    result, _, _ = case
    undefined = WelchTest("aece", 15, "Neural Clamping (FL)", "Matrix Scaling", 0.1, 0.2, None, None, None,
                                  True, "needs at least 2 runs of Neural Clamping (FL)")
    mixed = dataclasses.replace(result, welch=[w for w in result.welch if w.metric != "aece"] + [undefined])
    table = welch_table(mixed, 15)
    assert "AECE (%) ↓" not in table.rows and "ECE (%) ↓" in table.rows
    assert "needs at least" not in to_markdown(table)


def test_latex_escape_writes_symbols_in_math_mode():
    assert latex_escape("SCE (×10⁻²) ↓") == r"SCE ($\times$10$^{-2}$) $\downarrow$"
    assert latex_escape("Random δ₀ ± γ, λ ↑") == r"Random $\delta_{0}$ $\pm$ $\gamma$, $\lambda$ $\uparrow$"
    assert latex_escape("50% & a_b #1 $2 {x} ~^\\") == (r"50\% \& a\_b \#1 \$2 \{x\} \textasciitilde{}"
                                                         r"\textasciicircum{}\textbackslash{}")
    assert latex_escape("t > 0 | p < 1 — ok") == r"t \textgreater{} 0 \textbar{} p \textless{} 1 --- ok"
    assert latex_escape("Ω Α ά ς") == r"$\Omega$ $\mathrm{A}$ $\alpha$ $\varsigma$"
    assert latex_escape("café ﬁ 日") == "café fi ?"  # accented Latin kept (pdflatex reads UTF-8)


def _figure_results(case):
    gamma, init = _figure_results_objects(case)
    return gamma_table(gamma), init_study_table(init)


def test_gamma_table_shows_the_chosen_row_in_bold(case):
    gamma, _ = _figure_results(case)
    md, tex = to_markdown(gamma).splitlines(), to_latex(gamma)
    assert "| **0.5 (chosen)** | **1.0000** | **1.0000** | **1.00** |" in "\n".join(md)
    assert "| 0 | 1.0000 | 1.0000 | 3.00 |" in "\n".join(md) and "Best per column" not in "\n".join(md)
    assert r"\textbf{0.5 (chosen)} & \textbf{1.0000}" in tex and r"\textbf{0 " not in tex


def test_metrics_table_shows_named_rows_in_the_paper_units():
    values = {"accuracy": 0.91234, "entropy": 0.25, "ece": 0.0345, "aece": 0.04, "sce": 0.00612}
    md = to_markdown(metrics_table([("T = 2.00", values)], n_classes=10, notes=["15 bins."]))
    # No title line; percentages for accuracy and the ECEs, SCE in units of 10⁻² for 10 classes; no marks.
    assert md.splitlines()[0] == "|  | Accuracy (%) ↑ | Entropy | ECE (%) ↓ | AECE (%) ↓ | SCE (×10⁻²) ↓ |"
    assert "| T = 2.00 | 91.23 | 0.2500 | 3.45 | 4.00 | 0.6120 |" in md and "**" not in md
    assert md.endswith("\n15 bins.\n")


def test_init_study_shows_no_spread_for_a_fit_computed_once(case):
    _, init = _figure_results(case)
    data_row = init.rows.index("Data-driven δ₀ (Theorem 1)")
    assert all(c.std is None for c in init.cells[data_row])
    assert all(c.std is not None for c in init.cells[1 - data_row])


def test_latex_exports_are_ascii(case, tmp_path):
    write_tables(case[0], tmp_path)
    texts = [(tmp_path / "table.tex").read_text()] + [to_latex(t) for t in _figure_results(case)]
    assert all(ch.isascii() for text in texts for ch in text)


@pytest.mark.skipif(shutil.which("pdflatex") is None,
                    reason="pdflatex is not installed (Debian: apt-get install texlive-latex-base "
                           "texlive-latex-recommended)")
def test_latex_compiles_with_pdflatex(case, one_seed, tmp_path):
    """Every LaTeX export, wrapped in a minimal document, compiles without errors."""
    if subprocess.run(["kpsewhich", "booktabs.sty"], capture_output=True, text=True).stdout.strip() == "":
        pytest.skip("booktabs.sty is not installed (Debian: apt-get install texlive-latex-recommended)")
    parts = []
    for i, result in enumerate((case[0], one_seed)):
        write_tables(result, tmp_path / str(i))
        parts.append((tmp_path / str(i) / "table.tex").read_text())
    timing = RunResult.from_dict(case[0].to_dict())
    timing.kind = "timing"
    parts += [to_latex(timing_table(timing, 15))] + [to_latex(t) for t in _figure_results(case)]
    doc = tmp_path / "doc.tex"
    doc.write_text("\\documentclass{article}\n\\usepackage{booktabs}\n\\begin{document}\n" + "\n".join(parts)
                   + "\n\\end{document}\n", encoding="utf-8")
    run = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", doc.name], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:]
    log = (tmp_path / "doc.log").read_text(errors="replace")
    assert "Missing character" not in log and (tmp_path / "doc.pdf").stat().st_size > 0


# --------------------------------------------------------------------------- intervals and fair marks


def _run_with_intervals(logits, labels, resamples=400):
    """A run built the way the engine builds it: every method on one shared count matrix."""
    from nctv import intervals as iv
    from nctv.results import interval_comparisons

    settings = iv.IntervalSettings(resamples=resamples, seed=0)
    counts = iv.resample_counts(len(labels), resamples, settings.seed)
    gen = torch.Generator().manual_seed(1)
    methods, draws = {}, {}
    for name, zs in logits.items():
        m = _method(name, zs, labels, len(zs) > 1, name.startswith("Neural"))
        seeds = iv.seed_counts(len(zs), resamples, gen) if len(zs) > 1 else None
        draws[name] = {}
        for b in BINS:
            draws[name][b] = iv.method_draws(zs, labels, counts, b, [k for k in iv.RESAMPLED if k in metrics.METRIC_NAMES],
                                             seeds)
            for k, d in draws[name][b].items():
                ci = iv.interval(d, k, settings.level)
                m.metrics[b][k].ci_low, m.metrics[b][k].ci_high = ci.low, ci.high
        methods[name] = m
    return RunResult(
        kind="run", model={"name": "toy"}, calibration={"name": "cal", "size": 400, "fingerprint": "a"},
        test={"name": "test", "size": len(labels), "fingerprint": "b"}, n_classes=int(labels.max()) + 1,
        class_names=None, bins=list(BINS), seeds=[0, 1, 2], fitter="fast", methods=methods,
        welch=welch_tests(methods, BINS), cache_hits={}, settings={"device": "cpu", "intervals": settings.to_dict()},
        seconds=1.0, created="2024-01-01T00:00:00+00:00", test_labels=labels,
        comparisons=interval_comparisons(methods, draws, BINS, settings.level),
    ), draws


@pytest.fixture(scope="module")
def paired_case(case):
    _, logits, labels = case
    # "TS by Grid Search" differs from temperature scaling by one part in 10⁴ of T: the data cannot tell
    # them apart, whichever is ahead by a hair. Matrix scaling (×1.5) is far worse on every error.
    logits = {"Uncalibrated": logits["Uncalibrated"], "Temperature Scaling": logits["Temperature Scaling"],
              "TS by Grid Search": [logits["Uncalibrated"][0] / 2.50025], "Matrix Scaling": logits["Matrix Scaling"],
              "Neural Clamping (FL)": logits["Neural Clamping (FL)"]}
    result, draws = _run_with_intervals(logits, labels)
    return result, draws, logits, labels


def test_intervals_are_those_of_the_draws_and_hold_the_value_for_means(paired_case):
    from nctv import intervals as iv

    result, draws, _, _ = paired_case
    table = results_table(result, 15)
    nll_free = [c.key for c in table.columns]
    for i, name in enumerate(table.rows):
        for j, key in enumerate(nll_free):
            ci = iv.interval(draws[name][15][key], key)
            cell, scale = table.cells[i][j], table.columns[j].scale
            assert (cell.low, cell.high) == pytest.approx((ci.low * scale, ci.high * scale))
            if key in ("accuracy", "entropy"):  # unbiased means: the shown value lies inside
                assert cell.low <= cell.mean <= cell.high


def test_best_is_bold_only_where_the_paired_interval_excludes_zero(paired_case):
    result, _, _, _ = paired_case
    table = results_table(result, 15)
    names = table.rows
    ece = [c.key for c in table.columns].index("ece")
    ranks = {n: table.cells[i][ece].rank for i, n in enumerate(names)}
    # TS and its near-copy are tied for the lead; the over-confident rows are not best.
    assert ranks["Temperature Scaling"] == 1 and ranks["TS by Grid Search"] == 1
    assert ranks["Uncalibrated"] != 1 and ranks["Matrix Scaling"] != 1
    for i, n in enumerate(names):
        c = table.cells[i][ece]
        leader = min(names, key=lambda m: result.methods[m].metrics[15]["ece"].mean)
        if n != leader:
            cmp = result.comparison(n, leader, "ece", 15)
            assert (c.rank == 1) == (cmp.low <= 0 <= cmp.high)
    assert "ECE (%) ↓" in table.tied_columns
    md = to_markdown(table)
    assert "tied (" in md and "cannot be told apart" in md
    # Entropy: no direction, no marks.
    ent = [c.key for c in table.columns].index("entropy")
    assert all(r[ent].rank is None for r in table.cells)


def test_a_separated_best_is_bold_alone_and_two_rows_have_no_second(case):
    _, logits, labels = case
    three, _ = _run_with_intervals({n: logits[n] for n in ("Uncalibrated", "Temperature Scaling", "Matrix Scaling")},
                                   labels)
    table = results_table(three, 15)
    ece = [c.key for c in table.columns].index("ece")
    assert [r[ece].rank for r in table.cells] == [2, 1, None]
    assert "ECE (%) ↓" not in table.tied_columns
    two, _ = _run_with_intervals({n: logits[n] for n in ("Uncalibrated", "Temperature Scaling")}, labels)
    table = results_table(two, 15)
    assert all(c.rank != 2 for row in table.cells for c in row)
    assert [r[ece].rank for r in table.cells] == [None, 1]


def test_interval_styles_in_markdown_csv_and_latex(paired_case):
    result, _, _, _ = paired_case
    table = results_table(result, 15)
    ece = [c.key for c in table.columns].index("ece")
    cell = table.cells[1][ece]
    assert f"{cell.mean:.2f} [{cell.low:.2f}, {cell.high:.2f}]" in to_markdown(table)
    assert f"{cell.mean:.2f} ± {(cell.high - cell.low) / 2:.2f}" in to_markdown(table, "pm")
    assert f"{cell.mean:.2f} $\\pm$ {(cell.high - cell.low) / 2:.2f}" in to_latex(table, style="pm")
    assert f"{cell.mean:.2f} [{cell.low:.2f}, {cell.high:.2f}]" in to_latex(table)
    rows = list(csv.DictReader(io.StringIO(to_csv(table))))
    assert float(rows[1]["ECE (%) low"]) == pytest.approx(cell.low) and float(rows[1]["ECE (%) high"]) == pytest.approx(cell.high)
    rows = list(csv.DictReader(io.StringIO(to_csv(table, style="pm"))))
    assert float(rows[1]["ECE (%) ±"]) == pytest.approx((cell.high - cell.low) / 2)
    with pytest.raises(ValueError, match="interval style"):
        to_markdown(table, "stars")


def test_verdict_sentence_gives_the_paired_difference(paired_case):
    from nctv import intervals as iv
    from nctv.report import verdict

    result, draws, _, _ = paired_case
    d = iv.difference(draws["Neural Clamping (FL)"][15]["ece"], draws["TS by Grid Search"][15]["ece"])
    sentence = verdict(result, 15)

    def signed(v):
        return ("−" if v < 0 else "+") + f"{abs(v):.2f}"

    numbers = f"ECE {signed(100 * d.estimate)} [{signed(100 * d.low)}, {signed(100 * d.high)}] point"
    assert numbers in sentence
    if d.low <= 0 <= d.high:
        assert sentence.startswith("Neural Clamping (FL) and TS by Grid Search are tied on this model: ")
    else:
        assert (" is better than " in sentence) == (d.estimate < 0)
    leader = min(result.methods, key=lambda m: result.methods[m].metrics[15]["ece"].mean)
    worse = verdict(result, 15, method="Matrix Scaling", other=leader)
    assert worse.startswith(f"Matrix Scaling is worse than {leader} on this model: ECE +")
    assert verdict(result, 15, method="NC (Eff.)") is None


def test_intervals_and_comparisons_survive_json(paired_case, tmp_path):
    result, _, _, _ = paired_case
    data = json.loads(result.to_json())
    ece = data["methods"]["Temperature Scaling"]["metrics"]["15"]["ece"]
    assert ece["ci_low"] < ece["ci_high"] and data["settings"]["intervals"]["resamples"] == 400
    again = RunResult.from_json(result.to_json())
    assert to_markdown(results_table(again, 15)) == to_markdown(results_table(result, 15))
    assert again.comparison("Neural Clamping (FL)", "TS by Grid Search", "ece", 15) == \
        result.comparison("Neural Clamping (FL)", "TS by Grid Search", "ece", 15)
    write_tables(result, tmp_path)
    md = (tmp_path / "table.md").read_text(encoding="utf-8")
    assert "Differences between methods (15 bins)" in md and "interval of the difference" in md


def _with_intervals(case, difference):
    """Figure studies with crafted intervals: random − data = ``difference`` for ECE and entropy, a tie
    for accuracy."""
    gamma, init = _figure_results_objects(case)
    settings = {"level": 0.9, "resamples": 200, "seed": 1, "method": "m"}
    gamma.sweep.test_low = {"ece": np.array([0.02, 0.005, 0.01]), "entropy": np.array([0.1, 0.2, 0.3])}
    gamma.sweep.test_high = {"ece": np.array([0.04, 0.02, 0.03]), "entropy": np.array([0.3, 0.4, 0.5])}
    gamma.sweep.intervals = settings
    s = init.study
    s.ci = {init_: {m: [0.5 * v, 2.0 * v] for m, v in s.runs[init_][0].items()} for init_ in s.runs}
    s.ci_difference = {m: list(difference) for m in s.ci["random"]}
    s.ci_difference["accuracy"] = [0.0, -0.01, 0.01]
    s.intervals = settings
    return gamma_table(gamma), init_study_table(init)


def _figure_results_objects(case):
    """A γ sweep and an initialisation study, as results of the run in ``case`` (no intervals)."""
    result, _, _ = case
    rows = {"ece": np.array([0.03, 0.01, 0.02]), "entropy": np.array([0.2, 0.3, 0.4]), "loss": np.array([0.5, 0.4, 0.3])}
    sweep = GammaSweep(gammas=np.array([0.0, 0.5, 1.0]), temperature=np.ones(3), weight_decay=np.ones(3),
                       objective=np.ones(3), passes=np.ones(3), cal=rows, test=rows, chosen_gamma=0.5, n_passes=3.0,
                       test_passes=1.5, fitter="fast", n_bins=15)
    runs = {"random": [{"accuracy": 0.9, "entropy": 0.3 + i / 100, "ece": 0.02 + i / 1000, "aece": 0.021,
                        "sce": 0.004} for i in range(3)],
            "data": [{"accuracy": 0.9, "entropy": 0.31, "ece": 0.015, "aece": 0.016, "sce": 0.0035}] * 3}
    study = InitStudy(runs=runs, seeds=[0, 1, 2], fitter="fast", n_passes=10.0, shared_data_fit=True, n_bins=15)
    return (SimpleNamespace(sweep=sweep, model=result.model),
            SimpleNamespace(study=study, model=result.model, test=result.test, n_classes=result.n_classes))


def test_study_tables_show_the_test_split_intervals(case):
    gamma, init = _with_intervals(case, (0.006, 0.001, 0.011))
    md = to_markdown(gamma)
    # The test split's ECE and entropy carry their interval; the calibration split's do not.
    assert "| 0 | 1.0000 | 1.0000 | 3.00 | 0.2000 | 0.5000 | 3.00 [2.00, 4.00] | 0.2000 [0.1000, 0.3000] | 0.5000 |" in md
    assert "90 % interval of each γ's test ECE and entropy" in md and "200 resamples" in md
    md = to_markdown(init)
    # Random − data ECE excludes 0 (above it): data-driven is better there, alone in bold; accuracy is tied.
    data_row = next(line for line in md.splitlines() if line.startswith("| Data"))
    random_row = next(line for line in md.splitlines() if line.startswith("| Random"))
    assert "**1.50 [0.75, 3.00]**" in data_row and "**2.10" not in random_row
    assert "**90.00 [45.00, 180.00]**" in data_row and "**90.00 [45.00, 180.00]**" in random_row
    assert "tied (Accuracy (%) ↑" in md and "mean over 3 runs" in md
    _, init = _with_intervals(case, (-0.006, -0.011, -0.001))
    random_row = next(line for line in to_markdown(init).splitlines() if line.startswith("| Random"))
    assert "**2.10 [1.00, 4.00]**" in random_row


def test_smooth_ece_is_the_last_column_with_its_interval_and_old_runs_leave_it_out(paired_case):
    result, draws, logits, labels = paired_case
    table = results_table(result, 15)
    assert [c.key for c in table.columns][-1] == "smooth_ece" and table.columns[-1].label() == "smECE (%) ↓"
    row = table.rows.index("Temperature Scaling")
    cell = table.cells[row][-1]
    assert cell.mean == pytest.approx(100 * metrics.smooth_ece(logits["Temperature Scaling"][0], labels), abs=1e-9)
    ci = interval(draws["Temperature Scaling"][15]["smooth_ece"], "smooth_ece")
    assert (cell.low, cell.high) == pytest.approx((100 * ci.low, 100 * ci.high))
    # A run saved before smooth ECE existed: the table leaves the column out instead of failing.
    old = dataclasses.replace(result, methods={
        n: dataclasses.replace(m, metrics={b: {k: v for k, v in per.items() if k != "smooth_ece"}
                                           for b, per in m.metrics.items()}) for n, m in result.methods.items()})
    assert "smooth_ece" not in [c.key for c in results_table(old, 15).columns]
    assert "smooth_ece" not in [c.key for c in comparison_table(old, 15).columns]


def test_a_run_of_two_rows_both_consistent_with_calibrated_ranks_them_tied():
    """A run on logits that are calibrated (labels drawn from their softmax): temperature scaling keeps
    T near 1, and neither row's calibration test can reject. Their ECEs' paired interval then reaches what
    each row's own interval allows (either may be 0: nctv.intervals.difference_at_boundary), holds 0, and
    the tables say why: both rows bold, the difference's cell and the verdict name the reason."""
    from nctv import intervals as iv
    from nctv.experiment import IntervalSettings, run_experiment
    from nctv.report import verdict

    n, k, resamples = 2000, 10, 200
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2 * n, k, generator=g, dtype=torch.float64) * 2
    y = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
    names = ["Uncalibrated", "Temperature Scaling"]
    result = run_experiment(torch.nn.Identity(), (z[:n].float(), y[:n]), (z[n:].float(), y[n:]), names, seeds=1,
                            bins=[15], cache_dir=False, progress=False, conformal=None,
                            intervals=IntervalSettings(resamples=resamples))
    rows = {m: result.methods[m].metrics[15] for m in names}
    assert all(r["calibration_p"].mean >= 0.05 for r in rows.values())
    # The plain paired interval, computed here from the rows' test logits on the run's resamples.
    from nctv.data import TensorSplit, row_keys

    # The run's resamples: keyed by its test rows' content (here the rows are the given logits).
    counts = iv.resample_counts_for((row_keys(TensorSplit(z[n:].float(), y[n:])), y[n:]), resamples, 0)
    draws = {m: iv.method_draws([result.methods[m].test_logits], y[n:], counts, 15, ["ece"])["ece"] for m in names}
    plain = iv.difference(draws["Temperature Scaling"], draws["Uncalibrated"])
    a, b = rows["Temperature Scaling"]["ece"], rows["Uncalibrated"]["ece"]
    c = result.comparison("Temperature Scaling", "Uncalibrated", "ece", 15)
    assert c.low == pytest.approx(min(plain.low, -b.ci_high, a.ci_low, 0.0), abs=1e-9)
    assert c.high == pytest.approx(max(plain.high, -b.ci_low, a.ci_high, 0.0), abs=1e-9)
    assert c.low < plain.low and c.tied  # widened by the rule, and tied
    table = results_table(result, 15)
    ece = [col.key for col in table.columns].index("ece")
    assert [r[ece].rank for r in table.cells] == [1, 1]
    cells = comparison_table(result, 15).cells
    assert any((cell.note or "") == "both consistent with calibrated" for row in cells for cell in row)
    assert verdict(result, 15, method="Temperature Scaling", other="Uncalibrated").startswith(
        "Temperature Scaling and Uncalibrated are tied on this model (both consistent with calibrated): ECE ")
    # Accuracy has no calibration test: its pair is the plain paired interval.
    acc = {m: iv.method_draws([result.methods[m].test_logits], y[n:], counts, 15, ["accuracy"])["accuracy"]
           for m in names}
    plain_acc = iv.difference(acc["Temperature Scaling"], acc["Uncalibrated"])
    got = result.comparison("Temperature Scaling", "Uncalibrated", "accuracy", 15)
    assert (got.low, got.high) == pytest.approx((plain_acc.low, plain_acc.high), abs=1e-9)
