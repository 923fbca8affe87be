"""Tables of a run as Markdown, CSV, JSON and LaTeX, in the paper's units.

Units (those of the paper's tables): Accuracy in %, Entropy raw (nats), ECE / AECE / MCE in %,
SCE scaled by 10² ("×10⁻²": the number shown times 10⁻² is the SCE) — by 10³ from 1000 classes on,
as the paper's ImageNet tables do — NLL and Brier raw. ↑ marks columns where higher is better
(accuracy, entropy), ↓ the errors.

Every figure of a run carries its interval (``nctv.intervals``: the metric on the population the
test split was drawn from), shown as "value [low, high]" or "value ± half-width" (``style``). Best
per column is decided by the data, not by the digits: the row with the best value is marked best
(**bold**) only where the paired interval of every other row's difference to it excludes 0; rows
whose difference to it holds 0 are tied with it and marked alike, and the legend says so. A table
of three rows or more also marks the best of the remaining rows as second (_italics_). Entropy has
no better direction and no mark. A result without intervals (saved without them) is ranked on the
numbers as shown. LaTeX (booktabs) marks with ``\\textbf`` and ``\\underline``. A table built
from a result states the bin count, seeds, splits, the intervals and the Neural Clamping fitter.

A method measured once (a deterministic method, or any method of a one-seed run) is shown without a
spread: "± 0" would claim a precision nobody measured. The LaTeX needs only booktabs: specials
are escaped and symbols, Greek letters and super/subscripts are written in math mode, so pdflatex
compiles it.
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import math
import unicodedata
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from nctv.intervals import BOTH_CONSISTENT, boundary_note, consistent
from nctv.methods import abbreviation
from nctv.metrics import HIGHER_IS_BETTER, METRIC_NAMES
from nctv.settings import INTERVAL_STYLES
from nctv.results import (COMPARED_METHOD, GRID_SEARCH_METHOD, REFERENCE_METHOD, RunResult, best_method,
                          calibration_p)

#: The columns of the paper's tables, in order, then smooth ECE.
TABLE_METRICS = ("accuracy", "entropy", "ece", "aece", "sce", "smooth_ece")


@dataclass(frozen=True)
class MetricInfo:
    """How a metric is named and shown (the paper's table units)."""

    title: str
    percent: bool  # shown × 100 with "%"
    decimals: int


METRICS: dict[str, MetricInfo] = {
    "accuracy": MetricInfo("Accuracy", True, 2),
    "entropy": MetricInfo("Entropy", False, 4),
    "ece": MetricInfo("ECE", True, 2),
    "aece": MetricInfo("AECE", True, 2),
    "sce": MetricInfo("SCE", False, 4),  # scaled by 10^sce_exponent(K)
    "mce": MetricInfo("MCE", True, 2),
    "nll": MetricInfo("NLL", False, 4),
    "brier": MetricInfo("Brier", False, 4),
    "smooth_ece": MetricInfo("smECE", True, 2),
    "ks": MetricInfo("KS error", True, 2),
    "l2_ce": MetricInfo("ℓ2-CE (debiased)", True, 2),
    "nll_calibration": MetricInfo("NLL calibration", False, 4),
    "nll_refinement": MetricInfo("NLL refinement", False, 4),
    "calibration_p": MetricInfo("p (top-label calibrated)", False, 3),
    "classwise_calibration_p": MetricInfo("p (classwise calibrated)", False, 3),
}

#: The second table of a run: the further calibration errors, NLL split, and the calibration test.
FURTHER_TABLE_METRICS = ("ks", "l2_ce", "nll", "nll_calibration", "nll_refinement", "calibration_p",
                         "classwise_calibration_p")
#: The column whose cell says "consistent with calibrated" where each calibration test does not reject.
_TESTED_BY = {"ece": "calibration_p", "sce": "classwise_calibration_p"}


def sce_exponent(n_classes: int) -> int:
    """The power of ten SCE is shown in: 2 (×10⁻²) below 1000 classes, else 3 (×10⁻³), as in the paper."""
    return 3 if n_classes >= 1000 else 2


@dataclass(frozen=True)
class Column:
    """``key`` is a metric name or "resolution"/"seconds"; shown value = fraction × ``scale``."""

    key: str
    title: str
    unit: str = ""
    scale: float = 1.0
    decimals: int = 4
    higher_is_better: bool | None = None

    def label(self) -> str:
        """Title, unit and direction as a reader sees them, e.g. "SCE (×10⁻²) ↓" (LaTeX: :func:`latex_escape`)."""
        arrow = "" if self.higher_is_better is None else (" ↑" if self.higher_is_better else " ↓")
        return f"{self.title} ({self.unit}){arrow}" if self.unit else f"{self.title}{arrow}"


_SUPERSCRIPTS = "⁰¹²³⁴⁵⁶⁷⁸⁹"


def metric_column(metric: str, n_classes: int) -> Column:
    """The column of ``metric`` in the paper's units for a model with ``n_classes`` classes."""
    info = METRICS.get(metric)
    if info is None:
        raise ValueError(f"Unknown metric {metric!r}; use one of {', '.join(METRIC_NAMES)}.")
    if info.percent:
        unit, scale = "%", 100.0
    elif metric == "sce":
        e = sce_exponent(n_classes)
        unit, scale = "×10⁻" + _SUPERSCRIPTS[e], 10.0**e
    else:
        unit, scale = "", 1.0
    return Column(metric, info.title, unit, scale, info.decimals, HIGHER_IS_BETTER[metric])


@dataclass
class Cell:
    """A shown entry: ``mean``/``std`` in the column's units (``std`` None: no ± shown), or ``text``.

    ``low``/``high``: the interval in the column's units; when present it is shown instead of the
    std. ``rank`` is 1 for best (or tied for best), 2 for second best, else None.
    """

    mean: float | None = None
    std: float | None = None
    rank: int | None = None
    text: str | None = None
    low: float | None = None
    high: float | None = None
    note: str | None = None  # said after the value, e.g. "consistent with calibrated (p = 0.31)"

    def format(self, decimals: int, pm: str = " ± ", style: str = "brackets") -> str:
        if self.text is not None:
            return self.text
        if self.mean is None:
            return "N/A"
        s = _fmt(self.mean, decimals)
        if self.low is not None:
            if style == "pm":
                s += pm + _fmt((self.high - self.low) / 2, decimals)
            else:
                s += f" [{_fmt(self.low, decimals)}, {_fmt(self.high, decimals)}]"
        elif self.std is not None:
            s += pm + ("0" if self.std == 0 else _fmt(self.std, decimals))
        return s if self.note is None else f"{s}, {self.note}"


def _fmt(v: float, decimals: int) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    s = f"{v:.{decimals}f}"
    # A value that rounds to zero is shown without a sign ("-0.00" reads as a finding).
    return s.lstrip("-") if float(s) == 0 else s


@dataclass
class Table:
    """Rows × columns of cells plus what a reader needs to know (``notes``).

    ``rules_before`` lists row indices preceded by a horizontal rule (the Neural Clamping group);
    ``bold_rows`` the rows shown bold throughout (a chosen setting, which no column's ranking shows).
    An empty ``title`` is left out of the Markdown (a page that has its own heading).
    """

    title: str
    columns: list[Column]
    rows: list[str]
    cells: list[list[Cell]]
    notes: list[str] = field(default_factory=list)
    rules_before: list[int] = field(default_factory=list)
    n_bins: int | None = None
    first_column: str = "Method"
    bold_rows: list[int] = field(default_factory=list)
    # Columns whose best is tied (paired intervals hold 0), and whether ranks came from intervals.
    tied_columns: list[str] = field(default_factory=list)
    paired: bool = False
    # What the marks mean where a table ranks otherwise than per column ("{bold}": the renderer's mark).
    legend: str | None = None


def _mark_ranks(cells: list[Cell], col: Column) -> None:
    """Ranks on the numbers as shown (no intervals): equal-looking entries share a mark."""
    if col.higher_is_better is None:
        return
    shown = {}
    for i, c in enumerate(cells):
        if c.mean is not None and math.isfinite(c.mean):
            shown[i] = round(c.mean, col.decimals)
    distinct = sorted(set(shown.values()), reverse=bool(col.higher_is_better))
    for i, v in shown.items():
        if distinct and v == distinct[0]:
            cells[i].rank = 1
        elif len(distinct) > 1 and v == distinct[1] and len(cells) >= 3:
            cells[i].rank = 2


def _mark_paired(cells: list[Cell], col: Column, result: RunResult, names: list[str], n_bins: int) -> bool:
    """Best where the data separate it: the leader and every row tied with it (paired interval of the
    difference holds 0) get rank 1; in a table of three rows or more the best other row gets rank 2.
    Returns whether the best is tied."""
    leader = best_method(result.methods, col.key, n_bins, names)
    if leader is None or col.higher_is_better is None:
        return False
    tops = [leader] + [n for n in names if n != leader and _tied(result, n, leader, col.key, n_bins)]
    for n in tops:
        cells[names.index(n)].rank = 1
    rest = [n for n in names if n not in tops]
    if len(names) >= 3 and rest:
        second = best_method(result.methods, col.key, n_bins, rest)
        for n in rest:
            if result.methods[n].metrics[n_bins][col.key].mean == result.methods[second].metrics[n_bins][col.key].mean:
                cells[names.index(n)].rank = 2
    return len(tops) > 1


def _tied(result: RunResult, name: str, leader: str, metric: str, n_bins: int) -> bool:
    c = result.comparison(name, leader, metric, n_bins)
    return c is not None and c.tied


def has_intervals(result: RunResult) -> bool:
    """Whether the run carries intervals (``settings["intervals"]``) and paired comparisons."""
    return "intervals" in result.settings and bool(result.comparisons)


def _check_bins(result: RunResult, n_bins: int) -> None:
    if n_bins not in result.bins:
        raise ValueError(f"This run has no {n_bins}-bin results; it used bins {result.bins}.")


def _notes(result: RunResult, n_bins: int) -> list[str]:
    runs = len(result.seeds)
    if has_intervals(result):
        # The cells show intervals, not the seeds' std (which results.json and the CSV keep).
        spread = (f"mean over {runs} seeds (deterministic methods run once)" if runs > 1 else "one run per method")
    else:
        spread = (f"mean ± std over {runs} seeds (deterministic methods run once: no spread)" if runs > 1
                  else "one run per method")
    notes = [
        f"Model {result.model.get('name')}; fitted on '{result.calibration['name']}' "
        f"(n={result.calibration['size']}), scored on '{result.test['name']}' (n={result.test['size']}).",
        f"{n_bins} bins; {spread}; Neural Clamping fitter: {result.fitter}.",
    ]
    if has_intervals(result):
        notes.append(interval_note(result))
    return notes


def interval_note(result: RunResult) -> str:
    """How the run's intervals were made, in a reader's words."""
    iv = result.settings["intervals"]
    return (f"Intervals: {_percent(iv['level'])} interval of the value on the population the test split was drawn "
            f"from ({iv['resamples']} resamples of the test split, seed {iv['seed']}, {iv['method']}; seeds redrawn "
            "too). ECE, AECE, SCE and MCE read high on a finite sample, so their intervals are built around a "
            "debiased estimate and may lie below the value shown; smooth ECE keeps the test split's bandwidth. "
            f"Where a row's calibration test does not reject calibration (p ≥ {1 - iv['level']:.2g}), the intervals "
            "of its calibration errors reach 0 and its ECE (SCE) says \"consistent with calibrated\"; the paired "
            "interval of its difference to another row then reaches what the other row's own interval allows, so two "
            "rows both consistent with calibrated are tied.")


def _percent(level: float) -> str:
    return f"{100 * level:g} %"


def metrics_table(rows: Sequence[tuple[str, Mapping[str, float]]], n_classes: int,
                  metrics: Sequence[str] = TABLE_METRICS, notes: Sequence[str] = (), title: str = "",
                  first_column: str = "") -> Table:
    """Named rows of metric values (fractions, as ``nctv.metrics`` returns them) in the paper's units.

    Unranked: the rows are views of one model (say, at several temperatures), not rival methods. A metric
    missing from a row is left out of the table.
    """
    columns = [metric_column(m, n_classes) for m in metrics if all(m in values for _, values in rows)]
    cells = [[Cell(float(values[c.key]) * c.scale) for c in columns] for _, values in rows]
    return Table(title, columns, [name for name, _ in rows], cells, list(notes), first_column=first_column)


def _measured(result: RunResult, metrics: Sequence[str], n_bins: int) -> list[str]:
    """``metrics`` that every method of the run has: a result saved before a metric existed lacks it."""
    return [m for m in metrics if all(m in x.metrics[n_bins] for x in result.methods.values())]


def results_table(result: RunResult, n_bins: int = 15, metrics: Sequence[str] = TABLE_METRICS) -> Table:
    """The paper's comparison table (Tables 1–4) for one bin count, then smooth ECE, with intervals when
    the run has them."""
    _check_bins(result, n_bins)
    paired = has_intervals(result)
    columns = [metric_column(m, result.n_classes) for m in _measured(result, metrics, n_bins)]
    rows, cells, rules = [], [], []
    prev_model = None
    for name, m in result.methods.items():
        if prev_model is False and m.uses_model:
            rules.append(len(rows))
        prev_model = m.uses_model
        row = []
        for col in columns:
            s = m.metrics[n_bins][col.key]
            # Nothing is fitted for the reference row, so it has no spread to show (paper style).
            std = None if m.is_reference or len(s.runs) < 2 else s.std * col.scale
            row.append(_cell(s, col, std))
        rows.append(name)
        cells.append(row)
    tied = _rank_columns(result, columns, rows, cells, n_bins, paired)
    if paired:
        _say_consistent(result, columns, cells, n_bins)
    notes = _notes(result, n_bins)
    title = {"run": "Calibration on the test split", "ablation": "Ablation: input and output calibration"}.get(
        result.kind, f"{result.kind} results") + f" ({n_bins} bins)"
    return Table(title, columns, rows, cells, notes, rules, n_bins, tied_columns=tied, paired=paired)


def further_table(result: RunResult, n_bins: int = 15) -> Table:
    """The run's second table: KS error, debiased ℓ2 error, NLL with its calibration and refinement parts,
    and the calibration test's p-values (docs/method.md, "Metrics" and "Is it calibrated?")."""
    table = results_table(result, n_bins, FURTHER_TABLE_METRICS)
    table.title = f"Further calibration metrics and the calibration test ({n_bins} bins)"
    table.notes.append("NLL = NLL calibration + NLL refinement; refinement: the NLL after temperature scaling "
                       "fitted on the test split itself. p: the calibration test (consistency resampling, "
                       "labels drawn from the row's own probabilities); H₀ top-label: P(correct | confidence) = "
                       "confidence; H₀ classwise: P(y = k | p) = p_k.")
    return table


def conformal_table(result: RunResult) -> Table | None:
    """Every row's conformal prediction sets on the test split (``MethodResult.conformal``): coverage,
    mean set size and the worst class's coverage with their intervals; None when the run made none."""
    rows = [(name, m.conformal) for name, m in result.methods.items() if m.conformal is not None]
    if not rows:
        return None
    first = rows[0][1]
    target = 100 * first["coverage_target"]
    columns = [Column("coverage", "Coverage", "%", 100.0, 1), Column("mean_size", "Mean set size", "", 1.0, 2),
               Column("worst_class_coverage", "Worst class's coverage", "%", 100.0, 1),
               Column("empty", "Empty sets", "%", 100.0, 1)]
    cells = []
    for _, c in rows:
        cells.append([Cell(c[k][0] * col.scale, None, low=c[k][1] * col.scale, high=c[k][2] * col.scale)
                      for k, col in zip(("coverage", "mean_size", "worst_class_coverage"), columns)]
                     + [Cell(c["empty"] * 100.0)])
    # The run's own settings, as every row recorded them: the score (randomised or not) and the coverage.
    kind = first["score"].upper() + (" (randomised)" if first.get("randomized") else "")
    notes = [f"{kind} sets at {target:g} % coverage (nctv.conformal), the threshold from the calibration split as each row "
             "calibrates it, scored on the test split. Each calibrator was fitted on those same calibration "
             f"pictures, so its coverage can fall short of {target:g} % where it fitted them closely (a δ of many "
             "values on few pictures); nctv.conformal.split_calibration keeps the two apart (docs/conformal.md). "
             f"Worst class: the lowest coverage among classes with at least {first.get('min_class_points', 10)} test "
             "pictures."]
    if first["score"] == "raps" and all("penalty" in c for _, c in rows):
        notes.append(_raps_note(rows))
    return Table(f"Conformal prediction sets: {kind} at {target:g} % coverage", columns, [n for n, _ in rows], cells,
                 notes, [], None, "Method")


def _raps_note(rows: list[tuple[str, dict]]) -> str:
    """RAPS's λ and k_reg as each row used them, and where they were tuned, on how many pictures."""
    used = "; ".join(f"{name}: λ = {c['penalty']:g}, k_reg = {c['k_reg']}" for name, c in rows)
    first = rows[0][1]
    if not first.get("tuned"):
        return f"RAPS's λ and k_reg as given: {used}."
    which = " and ".join({"penalty": "λ", "k_reg": "k_reg"}[t] for t in first["tuned"])
    return (f"RAPS's {which} {'were' if len(first['tuned']) > 1 else 'was'} tuned on {first['n_tune']:,} calibration "
            "pictures held out from the threshold, "
            f"which the other {first['n_conformal']:,} set (the smallest mean set size there; docs/conformal.md): "
            f"{used}.")


def _say_consistent(result: RunResult, columns: list[Column], cells: list[list[Cell]], n_bins: int) -> None:
    """Where a row's calibration test does not reject, its ECE (SCE) cell says so: its interval then
    reaches 0 (``nctv.intervals.at_boundary``), and a bootstrap interval alone would claim an error."""
    level = result.settings["intervals"]["level"]
    for j, col in enumerate(columns):
        test = _TESTED_BY.get(col.key)
        for m, row in zip(result.methods.values(), cells):
            stats = m.metrics[n_bins].get(test)
            if stats is not None and consistent(stats.mean, level):
                row[j].note = f"consistent with calibrated (p = {_fmt_p(stats.mean)})"


def _cell(s: Any, col: Column, std: float | None) -> Cell:
    if s.ci_low is None:
        return Cell(s.mean * col.scale, std)
    return Cell(s.mean * col.scale, std, low=s.ci_low * col.scale, high=s.ci_high * col.scale)


def _rank_columns(result: RunResult, columns: list[Column], rows: list[str], cells: list[list[Cell]], n_bins: int,
                  paired: bool) -> list[str]:
    """Mark every ranked column; returns the labels of the columns whose best is tied."""
    tied = []
    for j, col in enumerate(columns):
        if col.higher_is_better is None:
            continue
        column = [r[j] for r in cells]
        if paired and not any(c.metric == col.key and c.n_bins == n_bins for c in result.comparisons):
            continue  # no paired intervals for this metric (NLL's parts): nothing separates the rows
        if paired:
            if _mark_paired(column, col, result, rows, n_bins):
                tied.append(col.label())
        else:
            _mark_ranks(column, col)
    return tied


def timing_table(result: RunResult, n_bins: int = 15) -> Table:
    """Table 7: resolution, accuracy, entropy, ECE and fit time per row of a timing run."""
    _check_bins(result, n_bins)
    metric_cols = [metric_column(m, result.n_classes) for m in ("accuracy", "entropy", "ece")]
    columns = [Column("resolution", "Resolution")] + metric_cols + [Column("seconds", "Time", "s", 1.0, 2)]
    rows, cells = [], []
    for name, m in result.methods.items():
        res = m.params.get("resolution")
        row = [Cell(text="N/A" if res is None else f"{res:g}")]
        row += [_cell(m.metrics[n_bins][c.key], c, None) for c in metric_cols]
        row.append(Cell(text="N/A") if m.is_reference else Cell(sum(m.fit_seconds) / len(m.fit_seconds)))
        rows.append(name)
        cells.append(row)
    paired = has_intervals(result)
    tied = _rank_columns(result, metric_cols, rows, [r[1:1 + len(metric_cols)] for r in cells], n_bins, paired)
    notes = _notes(result, n_bins) + [
        "Time: seconds to fit on the calibration split given the cached model logits "
        f"(device {result.settings.get('device', '?')}).",
    ]
    title = f"Time comparison: TS by grid search, NC (Eff.) and NC (FL) ({n_bins} bins)"
    return Table(title, columns, rows, cells, notes, [], n_bins, tied_columns=tied, paired=paired)


def comparison_table(result: RunResult, n_bins: int = 15, metrics: Sequence[str] = TABLE_METRICS) -> Table:
    """Each method's paired difference to the best baseline per metric, and Neural Clamping's to TS by
    grid search: "difference [low, high]" in the column's units (negative: lower than the other)."""
    _check_bins(result, n_bins)
    if not has_intervals(result):
        raise ValueError("This run has no intervals; run it again with intervals to compare methods.")
    columns = [metric_column(m, result.n_classes) for m in _measured(result, metrics, n_bins)
               if HIGHER_IS_BETTER[m] is not None]
    baseline = {c.key: next((x.other for x in result.comparisons if x.metric == c.key and x.n_bins == n_bins
                             and x.role == "best baseline"), None) for c in columns}
    rows, cells = [], []
    pairs = [(n, None) for n in result.methods]
    if COMPARED_METHOD in result.methods and GRID_SEARCH_METHOD in result.methods:
        pairs.append((COMPARED_METHOD, GRID_SEARCH_METHOD))
    for name, fixed in pairs:
        row = []
        for col in columns:
            other = fixed or baseline[col.key]
            c = None if other is None or other == name else result.comparison(name, other, col.key, n_bins)
            row.append(Cell(text="—") if c is None else
                       Cell(c.difference * col.scale, low=c.low * col.scale, high=c.high * col.scale,
                            note=_boundary_note(result, c, n_bins)))
        rows.append(name if fixed is None else f"{name} − {fixed}")
        cells.append(row)
    named = "; ".join(f"{c.title}: {baseline[c.key]}" for c in columns if baseline[c.key] is not None)
    last = f"; the last row: {COMPARED_METHOD} − {GRID_SEARCH_METHOD}" if len(pairs) > len(result.methods) else ""
    notes = [f"Difference to the best baseline ({named}){last}.",
             f"Paired {_percent(result.settings['intervals']['level'])} intervals on the same resamples of the "
             f"test split; an interval holding 0 is a tie. {n_bins} bins.",
             "Where a row's calibration test cannot reject calibration, its calibration error may be 0, so the "
             "difference's interval also reaches what the other row's own interval allows; the cell says so "
             "(\"both consistent with calibrated\": neither is ranked above the other)."]
    return Table(f"Differences between methods ({n_bins} bins)", columns, rows, cells, notes, [], n_bins,
                 paired=True)


def verdict(result: RunResult, n_bins: int = 15, metric: str = "ece", method: str = COMPARED_METHOD,
            other: str = GRID_SEARCH_METHOD) -> str | None:
    """One sentence on ``method`` against ``other`` from their paired interval, e.g. "Neural Clamping
    (FL) and TS by Grid Search are tied on this model: ECE −0.08 [−0.21, +0.05] point (95 % interval
    of the difference)." Where both rows are consistent with calibrated (tied by
    ``nctv.intervals.difference_at_boundary``) the sentence says so: "… are tied on this model (both
    consistent with calibrated): …". None when the run has no such comparison (a method missing, no
    intervals)."""
    c = result.comparison(method, other, metric, n_bins) if has_intervals(result) else None
    if c is None:
        return None
    col = metric_column(metric, result.n_classes)
    unit = {"%": " point", "": ""}.get(col.unit, f" ({col.unit})")
    numbers = (f"{col.title} {_signed(c.difference * col.scale, col.decimals)} [{_signed(c.low * col.scale, col.decimals)}, "
               f"{_signed(c.high * col.scale, col.decimals)}]{unit}")
    level = _percent(result.settings["intervals"]["level"])
    # Two rows both consistent with calibrated are tied by the boundary rule: the sentence says why.
    both = _boundary_note(result, c, n_bins) == BOTH_CONSISTENT
    if c.tied:
        head = f"{method} and {other} are tied on this model" + (f" ({BOTH_CONSISTENT})" if both else "")
    else:
        lower = c.difference < 0
        head = f"{method} is {'better' if lower != bool(col.higher_is_better) else 'worse'} than {other} on this model"
    return f"{head}: {numbers} ({level} interval of the difference, {n_bins} bins)."


def _boundary_note(result: RunResult, c: Any, n_bins: int) -> str | None:
    """Why the pair ``c`` was widened at the boundary (``nctv.intervals.difference_at_boundary``), e.g.
    "both consistent with calibrated"; None where neither row's calibration test speaks for the metric."""
    level = result.settings["intervals"]["level"]
    calibrated = [consistent(calibration_p(result.methods[n].metrics[n_bins], c.metric), level)
                  for n in (c.method, c.other)]
    return boundary_note(c.method, c.other, *calibrated) or None


def _signed(v: float, decimals: int) -> str:
    s = f"{abs(v):.{decimals}f}"
    return ("−" if v < 0 and float(s) != 0 else "+") + s


def welch_tests_shown(result: RunResult, n_bins: int = 15) -> list:
    """The Welch tests worth a row: those computed (a test needs at least 2 runs of NC (FL))."""
    return [w for w in result.welch_for(n_bins) if w.p is not None]


def welch_table(result: RunResult, n_bins: int = 15, metrics: Sequence[str] = TABLE_METRICS) -> Table:
    """Welch's t-test of NC (FL) against the best baseline per metric (only tests that could be computed)."""
    _check_bins(result, n_bins)
    tests = {w.metric: w for w in welch_tests_shown(result, n_bins)}
    columns = [Column("baseline", "Best baseline"), Column("method", COMPARED_METHOD), Column("baseline_mean", "Baseline"),
               Column("t", "t"), Column("p", "p"), Column("verdict", "NC better?"), Column("note", "Note")]
    rows, cells = [], []
    for metric in metrics:
        if metric not in tests:
            continue
        w = tests[metric]
        col = metric_column(metric, result.n_classes)
        verdict = "tie" if w.better is None else ("yes" if w.better else "no")
        rows.append(col.label())
        cells.append([
            Cell(text=w.baseline),
            Cell(text=_fmt(w.method_mean * col.scale, col.decimals)),
            Cell(text=_fmt(w.baseline_mean * col.scale, col.decimals)),
            Cell(text="—" if w.t is None else _fmt_stat(w.t)),
            Cell(text="—" if w.p is None else _fmt_p(w.p)),
            Cell(text=verdict),
            Cell(text=w.note),
        ])
    notes = [f"Welch's t-test (unequal variances) over seeds, {n_bins} bins; t > 0: {abbreviation(COMPARED_METHOD)} has "
             "the larger mean.",
             f"Neural Clamping fitter: {result.fitter}."]
    title = f"{COMPARED_METHOD} against the best baseline ({n_bins} bins)"
    return Table(title, columns, rows, cells, notes, [], n_bins, "Metric")


def _fmt_stat(t: float) -> str:
    return _fmt(t, 2) if not math.isfinite(t) else f"{t:.2f}"


def _fmt_p(p: float) -> str:
    if p == 0:
        return "0"
    return f"{p:.2g}" if p < 1e-3 else f"{p:.3f}"


# --------------------------------------------------------------------------- renderers


def to_markdown(table: Table, style: str = "brackets") -> str:
    """A GitHub-flavoured Markdown table with the title above and the notes below; ``style``: how
    intervals are shown (``INTERVAL_STYLES``)."""
    _check_style(style)
    head = [table.first_column] + [c.label() for c in table.columns]
    lines = [f"**{table.title}**", ""] if table.title else []
    align = [":--"] + ["--:" if _numeric(table, j) else ":--" for j in range(len(table.columns))]
    lines += ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    for i, (name, row) in enumerate(zip(table.rows, table.cells)):
        bold = i in table.bold_rows
        parts = [_marked(_md_escape(name), None, bold, _MD_MARKS)]
        parts += [_marked(_md_escape(cell.format(col.decimals, style=style)), cell.rank, bold, _MD_MARKS)
                  for cell, col in zip(row, table.columns)]
        lines.append("| " + " | ".join(parts) + " |")
    lines.append("")
    lines += table.notes
    if _has_marks(table):
        lines.append(_legend(table, "**bold**", "_italics_"))
    return "\n".join(lines) + "\n"


def _check_style(style: str) -> None:
    if style not in INTERVAL_STYLES:
        raise ValueError(f"Unknown interval style {style!r}; use {' or '.join(INTERVAL_STYLES)}.")


def _legend(table: Table, bold: str, second: str) -> str:
    """What the marks mean: on intervals, best only where the data separate it."""
    if table.legend is not None:
        return table.legend.format(bold=bold)
    seconds = any(c.rank == 2 for row in table.cells for c in row)
    if not table.paired:
        return f"Best per column in {bold}" + (f", second best in {second}." if seconds else ".")
    out = (f"Best per column in {bold} where the paired interval of its difference to every other row "
           "excludes 0")
    if table.tied_columns:
        out += (f"; tied ({', '.join(table.tied_columns)}): the rows in {bold} cannot be told apart, the "
                "interval of each one's difference to the best holds 0")
    return out + (f"; second best in {second}." if seconds else ".")


_MD_MARKS = ("**{}**", "_{}_")
_LATEX_MARKS = (r"\textbf{{{}}}", r"\underline{{{}}}")


def _marked(s: str, rank: int | None, bold_row: bool, marks: tuple[str, str]) -> str:
    """``s`` marked as best (or in a bold row) and/or second best; bold is applied once even when both."""
    bold, second = marks
    if rank == 2:
        s = second.format(s)
    return bold.format(s) if rank == 1 or bold_row else s


def _numeric(table: Table, j: int) -> bool:
    """Numbers are right-aligned: a column is numeric when any of its cells holds a number."""
    return any(row[j].mean is not None for row in table.cells)


def _has_marks(table: Table) -> bool:
    return any(c.rank is not None for row in table.cells for c in row)


def _md_escape(s: str) -> str:
    return s.replace("|", r"\|")


# Text-mode spellings that need no package beyond LaTeX's defaults (OT1 fonts: "<", ">" and "|" typed
# as such would print other glyphs).
_LATEX_TEXT = {"&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
               "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "\\": r"\textbackslash{}",
               "<": r"\textless{}", ">": r"\textgreater{}", "|": r"\textbar{}", "\u00a0": "~",
               "—": "---", "–": "--", "…": r"\dots{}", "‘": "`", "’": "'", "“": "``", "”": "''"}
_LATEX_MATH = {"±": r"\pm", "×": r"\times", "−": "-", "·": r"\cdot", "↑": r"\uparrow", "↓": r"\downarrow",
               "→": r"\rightarrow", "←": r"\leftarrow", "≤": r"\leq", "≥": r"\geq", "≈": r"\approx",
               "≠": r"\neq", "∞": r"\infty", "‖": r"\|", "µ": r"\mu", "°": r"\circ"}
# Greek letters with a LaTeX command (Unicode spells lambda "LAMDA"); other capitals look like Latin ones.
_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lamda", "mu",
          "nu", "xi", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega"}
_GREEK_CAPITALS = {"gamma", "delta", "theta", "lamda", "xi", "pi", "sigma", "upsilon", "phi", "psi", "omega"}


def latex_escape(s: str) -> str:
    """``s`` as LaTeX text that pdflatex reads: specials escaped, symbols and Greek in math mode.

    Runs of super- or subscript characters become one script (``10⁻²`` → ``10$^{-2}$``) and adjacent
    math pieces share one ``$…$`` (``δ₀`` → ``$\\delta_{0}$``). Accented Latin letters are kept
    (pdflatex reads UTF-8); any other character becomes its closest ASCII, else "?".
    """
    pieces: list[tuple[bool, str]] = []  # (math mode?, text)
    for script, run in itertools.groupby(s, _script):
        if script:
            pieces.append((True, script + "{" + "".join(_latex_char(unicodedata.normalize("NFKC", ch))[1]
                                                        for ch in run) + "}"))
        else:
            pieces += [_latex_char(ch) for ch in run]
    out = []
    for math_mode, group in itertools.groupby(pieces, key=lambda p: p[0]):
        text = "".join(t for _, t in group)
        out.append(f"${text}$" if math_mode else text)
    return "".join(out)


def _script(ch: str) -> str:
    name = unicodedata.name(ch, "")
    return "^" if name.startswith("SUPERSCRIPT") or ch == "°" else "_" if name.startswith("SUBSCRIPT") else ""


def _latex_char(ch: str) -> tuple[bool, str]:
    if ch in _LATEX_TEXT:
        return False, _LATEX_TEXT[ch]
    if ch in _LATEX_MATH:
        return True, _LATEX_MATH[ch]
    if ch.isascii():
        return False, ch
    greek = _greek(unicodedata.name(ch, ""))
    if greek:
        return True, greek
    if unicodedata.category(ch).startswith("L") and ord(ch) < 0x180:
        return False, ch  # Latin-1 and Latin Extended-A letters: defined by LaTeX's UTF-8 input
    plain = unicodedata.normalize("NFKD", ch).encode("ascii", "ignore").decode()
    return False, "".join(_LATEX_TEXT.get(c, c) for c in plain) or "?"


def _greek(name: str) -> str | None:
    """``\\delta`` for "GREEK SMALL LETTER DELTA" (accents dropped), ``\\mathrm{A}`` for a capital alpha."""
    words = name.split()
    if words[:1] != ["GREEK"] or "LETTER" not in words or words[-1] == "LETTER":
        return None
    letter = words[words.index("LETTER") + 1].lower()
    if letter == "final":
        return r"\varsigma"
    command = "\\" + letter.replace("lamda", "lambda")
    if "CAPITAL" in words:
        return command.title() if letter in _GREEK_CAPITALS else r"\mathrm{" + letter[0].upper() + "}"
    return command if letter in _GREEK else ("o" if letter == "omicron" else None)


def to_latex(table: Table, label: str | None = None, style: str = "brackets") -> str:
    """A booktabs ``table`` environment (needs ``\\usepackage{booktabs}``); best bold, second underlined."""
    _check_style(style)
    out = [r"\begin{table}[t]", r"\centering",
           r"\caption{" + latex_escape(" ".join([table.title + "."] * bool(table.title) + table.notes + (
               [_legend(table, "bold", "underlined")] if _has_marks(table) else []))) + "}"]
    if label:
        out.append(r"\label{" + label + "}")
    out += _tabular(table, style) + [r"\end{table}"]
    return "\n".join(out) + "\n"


def _tabular(table: Table, style: str, apart: list[str] | None = None) -> list[str]:
    """The booktabs ``tabular`` of ``table``: one line per row, best bold, second underlined. With
    ``apart`` (a list), a cell's note becomes a numbered mark and its text goes to ``apart`` (a note
    said in several cells is listed once): the column stays as narrow as its numbers."""
    spec = "l" + "".join("c" if c.higher_is_better is not None or c.key in ("seconds",) else "l" for c in table.columns)
    head = " & ".join([latex_escape(table.first_column)] + [latex_escape(c.label()) for c in table.columns])
    out = [r"\begin{tabular}{" + spec + "}", r"\toprule", head + r" \\", r"\midrule"]
    for i, (name, row) in enumerate(zip(table.rows, table.cells)):
        if i in table.rules_before:
            out.append(r"\midrule")
        bold = i in table.bold_rows
        parts = [_marked(latex_escape(name), None, bold, _LATEX_MARKS)]
        for cell, col in zip(row, table.columns):
            if cell.text is not None:
                s = latex_escape(cell.text)
            elif apart is not None and cell.note is not None:
                if cell.note not in apart:
                    apart.append(cell.note)
                s = replace(cell, note=None).format(col.decimals, pm=r" $\pm$ ", style=style)
                s += f"$^{{{apart.index(cell.note) + 1}}}$"
            else:
                s = cell.format(col.decimals, pm=r" $\pm$ ", style=style)
            parts.append(_marked(s, cell.rank, bold, _LATEX_MARKS))
        out.append(" & ".join(parts) + r" \\")
    return out + [r"\bottomrule", r"\end{tabular}"]


#: Of a slide's text height, what a table may take at most (the frame's title and the marks' legend
#: under the table take the rest).
BEAMER_TABLE_HEIGHT = 0.75


def to_beamer(table: Table, style: str = "brackets") -> str:
    """``table`` as one Beamer frame (``\\begin{frame}{title}`` … ``\\end{frame}``): the booktabs
    tabular of :func:`to_latex`, shrunk to the frame's width, and to :data:`BEAMER_TABLE_HEIGHT` of its
    height, where it is larger (never enlarged), with what the marks mean in small type under it; a
    cell's note ("consistent with calibrated (p = 0.31)") is a numbered mark there, said under it. The
    notes, which a slide has no room for, follow as comments. Needs ``\\usepackage{booktabs}`` (Beamer
    loads graphicx, which does the shrinking)."""
    _check_style(style)
    height = f"{BEAMER_TABLE_HEIGHT:g}" + r"\textheight"
    out = [r"\begin{frame}{" + latex_escape(table.title) + "}", r"\centering",
           r"\resizebox*{!}{\ifdim\totalheight>" + height + " " + height + r"\else\totalheight\fi}{%",
           r"\resizebox{\ifdim\width>\linewidth\linewidth\else\width\fi}{!}{%"]
    apart: list[str] = []
    out += _tabular(table, style, apart)
    out[-1] += "}}"
    under = [f"$^{{{i}}}$ {latex_escape(note)}" for i, note in enumerate(apart, 1)]
    if _has_marks(table):
        under.append(latex_escape(_legend(table, "bold", "underlined")))
    if under:
        out += ["", r"\smallskip{\scriptsize " + " ".join(under) + r"\par}"]
    out += ["% " + latex_escape(note) for note in table.notes] + [r"\end{frame}"]
    return "\n".join(out) + "\n"


def beamer_document(tables: Table | Sequence[Table], style: str = "brackets") -> str:
    """A Beamer document (16:9) of one frame per table (:func:`to_beamer`), which pdflatex compiles as it
    is: copy a frame into a talk whose preamble loads booktabs."""
    tables = [tables] if isinstance(tables, Table) else list(tables)
    if not tables:
        raise ValueError("No tables to write.")
    head = ["% NCTV tables for slides: one Beamer frame per table; each frame needs \\usepackage{booktabs}.",
            r"\documentclass[aspectratio=169]{beamer}", r"\usepackage{booktabs}", r"\begin{document}", ""]
    return "\n".join(head) + "\n".join(to_beamer(t, style) for t in tables) + "\n\\end{document}\n"


def table_to_dict(table: Table) -> dict[str, Any]:
    """The table as plain data: columns (key, label, unit, scale, decimals, direction) and shown cells."""
    return {
        "title": table.title,
        "n_bins": table.n_bins,
        "notes": list(table.notes),
        "columns": [{"key": c.key, "label": c.label(), "unit": c.unit, "scale": c.scale, "decimals": c.decimals,
                     "higher_is_better": c.higher_is_better} for c in table.columns],
        "rows": [{"method": name, "cells": {c.key: {"mean": cell.mean, "std": cell.std, "low": cell.low,
                                                    "high": cell.high, "rank": cell.rank, "text": cell.text}
                                            for c, cell in zip(table.columns, row)}}
                 for name, row in zip(table.rows, table.cells)],
    }


def to_json(tables: Table | Sequence[Table], indent: int | None = 2) -> str:
    tables = [tables] if isinstance(tables, Table) else list(tables)
    data = [table_to_dict(t) for t in tables]
    return json.dumps(data[0] if len(data) == 1 else data, indent=indent)


def to_csv(tables: Table | Sequence[Table], style: str = "brackets") -> str:
    """One row per (bins, method): unrounded values in the shown units, a ``std`` column each and, for
    a table with intervals, ``low`` and ``high`` columns (``style="brackets"``) or one ``±`` column of
    half the interval's width (``style="pm"``).

    Header cells carry the units (e.g. ``ECE (%)``); text cells (resolution) are written as shown.
    Several tables (one per bin count) must share their columns.
    """
    _check_style(style)
    tables = [tables] if isinstance(tables, Table) else list(tables)
    if not tables:
        raise ValueError("No tables to write.")
    cols = tables[0].columns
    if any([c.key for c in t.columns] != [c.key for c in cols] for t in tables):
        raise ValueError("Tables written to one CSV must have the same columns.")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    header = ["bins", tables[0].first_column.lower()]
    for c in cols:
        plain = c.label().replace(" ↑", "").replace(" ↓", "")
        if _is_text_column(tables, c.key):
            header.append(plain)
        else:
            header += [plain, plain + " std"]
            if _has_interval(tables, c.key):
                header += [plain + " ±"] if style == "pm" else [plain + " low", plain + " high"]
    w.writerow(header)
    for t in tables:
        for name, row in zip(t.rows, t.cells):
            line: list[Any] = ["" if t.n_bins is None else t.n_bins, name]
            for c, cell in zip(cols, row):
                if _is_text_column(tables, c.key):
                    line.append(cell.text if cell.text is not None else repr_float(cell.mean))
                else:
                    line += [repr_float(cell.mean), repr_float(cell.std)]
                    if _has_interval(tables, c.key):
                        half = None if cell.low is None else (cell.high - cell.low) / 2
                        line += [repr_float(half)] if style == "pm" else [repr_float(cell.low), repr_float(cell.high)]
            w.writerow(line)
    return buf.getvalue()


def _has_interval(tables: Sequence[Table], key: str) -> bool:
    return any(row[[c.key for c in t.columns].index(key)].low is not None for t in tables for row in t.cells)


def _is_text_column(tables: Sequence[Table], key: str) -> bool:
    return any(row[[c.key for c in t.columns].index(key)].text is not None for t in tables for row in t.cells)


def repr_float(v: float | None) -> str:
    return "" if v is None else repr(float(v))


# --------------------------------------------------------------------------- files and summary


def result_tables(result: RunResult) -> list[Table]:
    """One table per bin count (15 first when present: the paper's main setting)."""
    order = sorted(result.bins, key=lambda b: (b != 15, b))
    make = timing_table if result.kind == "timing" else results_table
    return [make(result, b) for b in order]


def write_tables(result: RunResult, directory: str | Path, style: str = "brackets") -> list[Path]:
    """Write ``table.md``, ``table.csv``, ``table.tex``, ``slides.tex`` and ``table.json`` (all bin counts)
    into ``directory``, and ``further.csv``: the further metrics and the calibration test (:func:`further_table`).

    The Markdown and LaTeX files also hold, when the run has them, the differences between methods
    with their verdict and the Welch t-test tables (none with a single run of NC (FL)). ``slides.tex``
    is a Beamer document of the same tables, one frame each (:func:`beamer_document`). ``style``: how
    intervals are shown (``INTERVAL_STYLES``).
    """
    _check_style(style)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tables = result_tables(result)
    welch = [welch_table(result, t.n_bins) for t in tables if welch_tests_shown(result, t.n_bins)]
    compared = [comparison_table(result, t.n_bins) for t in tables] if has_intervals(result) else []
    further = [further_table(result, t.n_bins) for t in tables] if result.kind != "timing" else []
    further = [t for t in further if any(c.key != "nll" for c in t.columns)]  # none in a result saved before them
    sets = conformal_table(result)
    # (table, LaTeX label, the sentence under it in Markdown), in the files' order. The Welch tables hold
    # text only, which the interval style leaves as it is.
    shown = [(t, f"tab:nctv-{result.kind}-{t.n_bins}bins", None) for t in tables]
    shown += [(t, f"tab:nctv-further-{t.n_bins}bins", None) for t in further]
    shown += [(t, f"tab:nctv-differences-{t.n_bins}bins", verdict(result, t.n_bins)) for t in compared]
    shown += [(t, f"tab:nctv-welch-{t.n_bins}bins", None) for t in welch]
    if sets is not None:
        shown.append((sets, f"tab:nctv-conformal-{result.kind}", None))
    md = [f"# NCTV {result.kind}: {result.model.get('name')}", ""]
    md += [to_markdown(t, style) + ("\n" + sentence + "\n" if sentence else "") for t, _, sentence in shown]
    tex = ["% NCTV tables; needs \\usepackage{booktabs}", ""] + [to_latex(t, label, style) for t, label, _ in shown]
    paths = {name: out / name for name in ("table.md", "table.csv", "table.tex", "slides.tex", "table.json")}
    paths["table.md"].write_text("\n".join(md), encoding="utf-8")
    paths["table.csv"].write_text(to_csv(tables, style), encoding="utf-8")
    paths["table.tex"].write_text("\n".join(tex), encoding="utf-8")
    paths["slides.tex"].write_text(beamer_document([t for t, _, _ in shown], style), encoding="utf-8")
    paths["table.json"].write_text(to_json(tables + further + compared + welch), encoding="utf-8")
    if further:
        paths["further.csv"] = out / "further.csv"
        paths["further.csv"].write_text(to_csv(further, style), encoding="utf-8")
    return list(paths.values())


def summary_line(result: RunResult, n_bins: int = 15) -> str:
    """One line for the end of a command: size of the run, the headline ECE and the time taken."""
    b = n_bins if n_bins in result.bins else result.bins[0]
    runs = sum(len(m.seeds) for m in result.methods.values())
    head = (f"{result.kind}: {len(result.methods)} methods, {runs} fits on {result.model.get('name')} "
            f"in {result.seconds:.1f} s")
    col = metric_column("ece", result.n_classes)
    if COMPARED_METHOD in result.methods:
        nc = result.methods[COMPARED_METHOD].metrics[b]["ece"].mean * col.scale
        head += f"; {COMPARED_METHOD} ECE {nc:.2f}%"
        w = next((w for w in result.welch_for(b) if w.metric == "ece"), None)
        if w is not None:
            head += f" vs {w.baseline} {w.baseline_mean * col.scale:.2f}%"
            if w.p is not None:
                head += f" (Welch t={_fmt_stat(w.t)}, p={_fmt_p(w.p)})"
    if REFERENCE_METHOD in result.methods:
        ref = result.methods[REFERENCE_METHOD].metrics[b]["ece"].mean * col.scale
        head += f"; uncalibrated {ref:.2f}%"
    return head + f" ({b} bins, fitter {result.fitter})"


def gamma_table(result: Any) -> Table:
    """Figure 2 as numbers: per γ the temperature, λ and, per split, ECE (%), entropy and loss; the test
    split's ECE and entropy with their intervals when the sweep has them."""
    s = result.sweep
    splits = [("calibration", s.cal)] + ([("test", s.test)] if s.test is not None else [])
    columns = [Column("temperature", "T", decimals=4), Column("weight_decay", "λ", decimals=4)]
    if s.delta_l2 is not None:
        columns.append(Column("delta_l2", "‖δ‖₂", decimals=3))
    for name, _ in splits:
        columns += [Column(f"{name}_ece", f"ECE {name}", "%", 100.0, 2),
                    Column(f"{name}_entropy", f"Entropy {name}", decimals=4),
                    Column(f"{name}_loss", f"Loss {name}", decimals=4)]
    rows, cells = [], []
    for i, g in enumerate(s.gammas):
        row = [Cell(float(s.temperature[i])), Cell(float(s.weight_decay[i]))]
        if s.delta_l2 is not None:
            row.append(Cell(float(s.delta_l2[i])))
        for name, values in splits:
            banded = name == "test" and s.test_low is not None
            for metric, scale in (("ece", 100.0), ("entropy", 1.0)):
                row.append(Cell(scale * float(values[metric][i]), low=scale * float(s.test_low[metric][i]) if banded else None,
                                high=scale * float(s.test_high[metric][i]) if banded else None))
            row.append(Cell(float(values["loss"][i])))
        rows.append(f"{g:g}" + (" (chosen)" if g == s.chosen_gamma else ""))
        cells.append(row)
    notes = [f"Model {result.model.get('name')}; {s.n_bins} bins; chosen γ = {s.chosen_gamma:g} (the one γ = auto "
             f"over this grid keeps; row in bold); Neural Clamping fitter: {s.fitter}. Each row is the Neural "
             f"Clamping (FL) fit of a run at that γ with the same settings."]
    if s.test_low is not None:
        notes.append(_study_interval_note(s.intervals, "each γ's test ECE and entropy"))
    chosen = [i for i, g in enumerate(s.gammas) if g == s.chosen_gamma]
    return Table("Neural Clamping against γ", columns, rows, cells, notes, [], s.n_bins, "γ", chosen)


def _study_interval_note(iv: Mapping[str, Any], what: str) -> str:
    return (f"Intervals: {_percent(iv['level'])} interval of {what} on the population the test split was drawn "
            f"from ({iv['resamples']} resamples of the test split, seed {iv['seed']}, {iv['method']}).")


def init_study_table(result: Any, metrics: Sequence[str] = TABLE_METRICS) -> Table:
    """Figure 3 as numbers per initialisation (random, data-driven): the mean over runs with its interval
    when the study has them (else ± std over runs). With intervals, the better initialisation is marked
    only where the paired interval of random − data excludes 0, else both are marked tied."""
    s = result.study
    shown = [m for m in metrics if all(m in r for runs in s.runs.values() for r in runs)]
    columns = [metric_column(m, result.n_classes) for m in shown]
    names = {"random": "Random δ₀", "data": "Data-driven δ₀ (Theorem 1)"}
    rows, cells = [], []
    for init in s.runs:
        rows.append(names.get(init, init))
        # A fit computed once and repeated per run has no spread to show, however many runs repeat it.
        once = init == "data" and s.shared_data_fit
        row = []
        for col in columns:
            v = np.asarray(s.values(init, col.key), dtype=np.float64) * col.scale
            cell = Cell(float(v.mean()), None if once or len(v) < 2 else float(v.std(ddof=1)))
            if s.ci is not None and col.key in s.ci[init]:
                cell.low, cell.high = (x * col.scale for x in s.ci[init][col.key])
            row.append(cell)
        cells.append(row)
    tied = []
    for j, col in enumerate(columns):
        column = [r[j] for r in cells]
        paired = s.ci_difference is not None and col.key in s.ci_difference and len(column) == 2
        if paired and col.higher_is_better is not None:
            _, low, high = s.ci_difference[col.key]
            if low <= 0 <= high:
                for c in column:
                    c.rank = 1
                tied.append(col.label())
            else:
                random_better = (high < 0) != bool(col.higher_is_better)
                column[list(s.runs).index("random" if random_better else "data")].rank = 1
        else:
            _mark_ranks(column, col)
    shared = " (the fast fitter's data-driven fit is deterministic: computed once)" if s.shared_data_fit else ""
    spread = "mean over" if s.ci is not None else "mean ± std over"
    notes = [f"Model {result.model.get('name')}; scored on '{result.test['name']}' (n={result.test['size']}); "
             f"{s.n_bins} bins; {spread} {len(s.seeds)} runs{shared}; Neural Clamping fitter: {s.fitter}."]
    if s.ci is not None:
        notes.append(_study_interval_note(s.intervals, "the mean over runs (runs redrawn too)"))
    return Table("Random vs data-driven initialisation of δ", columns, rows, cells, notes, [], s.n_bins,
                 "Initialisation", tied_columns=tied, paired=s.ci_difference is not None)
