"""Tables of a run as Markdown, CSV, JSON and LaTeX, in the paper's units.

Units (those of the paper's tables): Accuracy in %, Entropy raw (nats), ECE / AECE / MCE in %,
SCE scaled by 10² ("×10⁻²": the number shown times 10⁻² is the SCE) — by 10³ from 1000 classes on,
as the paper's ImageNet tables do — NLL and Brier raw. ↑ marks columns where higher is better
(accuracy, entropy), ↓ the errors.

Best and second-best per column are decided on the numbers *as shown* (rounded to the column's
decimals), so equal-looking entries share a mark, as in the paper: every method with the best
shown value is "best", every method with the next value "second". Markdown shows best in
**bold** and second in _italics_; LaTeX (booktabs) in ``\\textbf`` and ``\\underline``. A table
built from a result states the bin count, seeds, splits and the Neural Clamping fitter.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from nctv.metrics import Column, metric_column
from nctv.results import COMPARED_METHOD, REFERENCE_METHOD, RunResult

#: The columns of the paper's tables, in order.
TABLE_METRICS = ("accuracy", "entropy", "ece", "aece", "sce")


@dataclass
class Cell:
    """A shown entry: ``mean``/``std`` in the column's units (``std`` None: no ± shown), or ``text``.

    ``rank`` is 1 for best, 2 for second best, else None.
    """

    mean: float | None = None
    std: float | None = None
    rank: int | None = None
    text: str | None = None

    def format(self, decimals: int, pm: str = " ± ") -> str:
        if self.text is not None:
            return self.text
        if self.mean is None:
            return "N/A"
        s = _fmt(self.mean, decimals)
        if self.std is not None:
            s += pm + ("0" if self.std == 0 else _fmt(self.std, decimals))
        return s


def _fmt(v: float, decimals: int) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return f"{v:.{decimals}f}"


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


def _mark_ranks(cells: list[Cell], col: Column) -> None:
    shown = {}
    for i, c in enumerate(cells):
        if c.mean is not None and math.isfinite(c.mean):
            shown[i] = round(c.mean, col.decimals)
    distinct = sorted(set(shown.values()), reverse=bool(col.higher_is_better))
    for i, v in shown.items():
        if distinct and v == distinct[0]:
            cells[i].rank = 1
        elif len(distinct) > 1 and v == distinct[1]:
            cells[i].rank = 2


def _check_bins(result: RunResult, n_bins: int) -> None:
    if n_bins not in result.bins:
        raise ValueError(f"This run has no {n_bins}-bin results; it used bins {result.bins}.")


def _notes(result: RunResult, n_bins: int) -> list[str]:
    runs = len(result.seeds)
    spread = (f"mean ± std over {runs} seeds (deterministic methods run once: no spread)" if runs > 1
              else "one run per method")
    return [
        f"Model {result.model.get('name')}; fitted on '{result.calibration['name']}' "
        f"(n={result.calibration['size']}), scored on '{result.test['name']}' (n={result.test['size']}).",
        f"{n_bins} bins; {spread}; Neural Clamping fitter: {result.fitter}.",
    ]


def metrics_table(rows: Sequence[tuple[str, Mapping[str, float]]], n_classes: int,
                  metrics: Sequence[str] = TABLE_METRICS, notes: Sequence[str] = (), title: str = "",
                  first_column: str = "") -> Table:
    """Named rows of metric values (fractions, as ``nctv.metrics`` returns them) in the paper's units.

    Unranked: the rows are views of one model (say, at several temperatures), not rival methods.
    """
    columns = [metric_column(m, n_classes) for m in metrics]
    cells = [[Cell(float(values[c.key]) * c.scale) for c in columns] for _, values in rows]
    return Table(title, columns, [name for name, _ in rows], cells, list(notes), first_column=first_column)


def results_table(result: RunResult, n_bins: int = 15, metrics: Sequence[str] = TABLE_METRICS) -> Table:
    """The paper's comparison table (Tables 1–4) for one bin count."""
    _check_bins(result, n_bins)
    columns = [metric_column(m, result.n_classes) for m in metrics]
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
            row.append(Cell(s.mean * col.scale, std))
        rows.append(name)
        cells.append(row)
    for j, col in enumerate(columns):
        _mark_ranks([r[j] for r in cells], col)
    notes = _notes(result, n_bins)
    title = {"run": "Calibration on the test split", "ablation": "Ablation: input and output calibration"}.get(
        result.kind, f"{result.kind} results") + f" ({n_bins} bins)"
    return Table(title, columns, rows, cells, notes, rules, n_bins)


def timing_table(result: RunResult, n_bins: int = 15) -> Table:
    """Table 7: resolution, accuracy, entropy, ECE and fit time per row of a timing run."""
    _check_bins(result, n_bins)
    metric_cols = [metric_column(m, result.n_classes) for m in ("accuracy", "entropy", "ece")]
    columns = [Column("resolution", "Resolution")] + metric_cols + [Column("seconds", "Time", "s", 1.0, 2)]
    rows, cells = [], []
    for name, m in result.methods.items():
        res = m.params.get("resolution")
        row = [Cell(text="N/A" if res is None else f"{res:g}")]
        row += [Cell(m.metrics[n_bins][c.key].mean * c.scale) for c in metric_cols]
        row.append(Cell(text="N/A") if m.is_reference else Cell(sum(m.fit_seconds) / len(m.fit_seconds)))
        rows.append(name)
        cells.append(row)
    for j, col in enumerate(columns):
        if col.higher_is_better is not None:
            _mark_ranks([r[j] for r in cells], col)
    notes = _notes(result, n_bins) + [
        "Time: seconds to fit on the calibration split given the cached model logits "
        f"(device {result.settings.get('device', '?')}).",
    ]
    title = f"Time comparison: TS by grid search, NC (Eff.) and NC (FL) ({n_bins} bins)"
    return Table(title, columns, rows, cells, notes, [], n_bins)


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
    notes = [f"Welch's t-test (unequal variances) over seeds, {n_bins} bins; t > 0: NC (FL) has the larger mean.",
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


def to_markdown(table: Table) -> str:
    """A GitHub-flavoured Markdown table with the title above and the notes below."""
    head = [table.first_column] + [c.label() for c in table.columns]
    lines = [f"**{table.title}**", ""] if table.title else []
    align = [":--"] + ["--:" if _numeric(table, j) else ":--" for j in range(len(table.columns))]
    lines += ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    for i, (name, row) in enumerate(zip(table.rows, table.cells)):
        bold = i in table.bold_rows
        parts = [_marked(_md_escape(name), None, bold, _MD_MARKS)]
        parts += [_marked(_md_escape(cell.format(col.decimals)), cell.rank, bold, _MD_MARKS)
                  for cell, col in zip(row, table.columns)]
        lines.append("| " + " | ".join(parts) + " |")
    lines.append("")
    lines += table.notes
    if _has_marks(table):
        lines.append("Best per column in **bold**, second best in _italics_.")
    return "\n".join(lines) + "\n"


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


def to_latex(table: Table, label: str | None = None) -> str:
    """A booktabs ``table`` environment (needs ``\\usepackage{booktabs}``); best bold, second underlined."""
    spec = "l" + "".join("c" if c.higher_is_better is not None or c.key in ("seconds",) else "l" for c in table.columns)
    head = " & ".join([latex_escape(table.first_column)] + [latex_escape(c.label()) for c in table.columns])
    out = [r"\begin{table}[t]", r"\centering",
           r"\caption{" + latex_escape(" ".join([table.title + "."] * bool(table.title) + table.notes + (
               ["Best per column in bold, second best underlined."] if _has_marks(table) else []))) + "}"]
    if label:
        out.append(r"\label{" + label + "}")
    out += [r"\begin{tabular}{" + spec + "}", r"\toprule", head + r" \\", r"\midrule"]
    for i, (name, row) in enumerate(zip(table.rows, table.cells)):
        if i in table.rules_before:
            out.append(r"\midrule")
        bold = i in table.bold_rows
        parts = [_marked(latex_escape(name), None, bold, _LATEX_MARKS)]
        for cell, col in zip(row, table.columns):
            s = cell.format(col.decimals, pm=r" $\pm$ ") if cell.text is None else latex_escape(cell.text)
            parts.append(_marked(s, cell.rank, bold, _LATEX_MARKS))
        out.append(" & ".join(parts) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(out) + "\n"


def table_to_dict(table: Table) -> dict[str, Any]:
    """The table as plain data: columns (key, label, unit, scale, decimals, direction) and shown cells."""
    return {
        "title": table.title,
        "n_bins": table.n_bins,
        "notes": list(table.notes),
        "columns": [{"key": c.key, "label": c.label(), "unit": c.unit, "scale": c.scale, "decimals": c.decimals,
                     "higher_is_better": c.higher_is_better} for c in table.columns],
        "rows": [{"method": name, "cells": {c.key: {"mean": cell.mean, "std": cell.std, "rank": cell.rank, "text": cell.text}
                                            for c, cell in zip(table.columns, row)}}
                 for name, row in zip(table.rows, table.cells)],
    }


def to_json(tables: Table | Sequence[Table], indent: int | None = 2) -> str:
    tables = [tables] if isinstance(tables, Table) else list(tables)
    data = [table_to_dict(t) for t in tables]
    return json.dumps(data[0] if len(data) == 1 else data, indent=indent)


def to_csv(tables: Table | Sequence[Table]) -> str:
    """One row per (bins, method): unrounded values in the shown units, a ``± std`` column each.

    Header cells carry the units (e.g. ``ECE (%)``); text cells (resolution) are written as shown.
    Several tables (one per bin count) must share their columns.
    """
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
        header += [plain] if _is_text_column(tables, c.key) else [plain, plain + " std"]
    w.writerow(header)
    for t in tables:
        for name, row in zip(t.rows, t.cells):
            line: list[Any] = ["" if t.n_bins is None else t.n_bins, name]
            for c, cell in zip(cols, row):
                if _is_text_column(tables, c.key):
                    line.append(cell.text if cell.text is not None else repr_float(cell.mean))
                else:
                    line += [repr_float(cell.mean), repr_float(cell.std)]
            w.writerow(line)
    return buf.getvalue()


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


def write_tables(result: RunResult, directory: str | Path) -> list[Path]:
    """Write ``table.md``, ``table.csv``, ``table.tex`` and ``table.json`` (all bin counts) into ``directory``.

    The Markdown and LaTeX files also hold the Welch t-test tables when the run has computed tests
    (none with a single run of NC (FL)).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tables = result_tables(result)
    welch = [welch_table(result, t.n_bins) for t in tables if welch_tests_shown(result, t.n_bins)]
    md = [f"# NCTV {result.kind}: {result.model.get('name')}", ""]
    tex = ["% NCTV tables; needs \\usepackage{booktabs}", ""]
    for t in tables:
        md.append(to_markdown(t))
        tex.append(to_latex(t, label=f"tab:nctv-{result.kind}-{t.n_bins}bins"))
    for t in welch:
        md.append(to_markdown(t))
        tex.append(to_latex(t, label=f"tab:nctv-welch-{t.n_bins}bins"))
    paths = {name: out / name for name in ("table.md", "table.csv", "table.tex", "table.json")}
    paths["table.md"].write_text("\n".join(md), encoding="utf-8")
    paths["table.csv"].write_text(to_csv(tables), encoding="utf-8")
    paths["table.tex"].write_text("\n".join(tex), encoding="utf-8")
    paths["table.json"].write_text(to_json(tables + welch), encoding="utf-8")
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
    """Figure 2 as numbers: per γ the temperature, λ and, per split, ECE (%), entropy and loss."""
    s = result.sweep
    splits = [("calibration", s.cal)] + ([("test", s.test)] if s.test is not None else [])
    columns = [Column("temperature", "T", decimals=4), Column("weight_decay", "λ", decimals=4)]
    for name, _ in splits:
        columns += [Column(f"{name}_ece", f"ECE {name}", "%", 100.0, 2),
                    Column(f"{name}_entropy", f"Entropy {name}", decimals=4),
                    Column(f"{name}_loss", f"Loss {name}", decimals=4)]
    rows, cells = [], []
    for i, g in enumerate(s.gammas):
        row = [Cell(float(s.temperature[i])), Cell(float(s.weight_decay[i]))]
        for _, values in splits:
            row += [Cell(100.0 * float(values["ece"][i])), Cell(float(values["entropy"][i])), Cell(float(values["loss"][i]))]
        rows.append(f"{g:g}" + (" (chosen)" if g == s.chosen_gamma else ""))
        cells.append(row)
    notes = [f"Model {result.model.get('name')}; {s.n_bins} bins; chosen γ = {s.chosen_gamma:g} (lowest calibration "
             f"ECE; row in bold); Neural Clamping fitter: {s.fitter}."]
    chosen = [i for i, g in enumerate(s.gammas) if g == s.chosen_gamma]
    return Table("Neural Clamping against γ", columns, rows, cells, notes, [], s.n_bins, "γ", chosen)


def init_study_table(result: Any, metrics: Sequence[str] = TABLE_METRICS) -> Table:
    """Figure 3 as numbers: mean ± std over runs per initialisation (random, data-driven)."""
    s = result.study
    columns = [metric_column(m, result.n_classes) for m in metrics]
    names = {"random": "Random δ₀", "data": "Data-driven δ₀ (Theorem 1)"}
    rows, cells = [], []
    for init in s.runs:
        rows.append(names.get(init, init))
        # A fit computed once and repeated per run has no spread to show, however many runs repeat it.
        once = init == "data" and s.shared_data_fit
        row = []
        for col in columns:
            v = np.asarray(s.values(init, col.key), dtype=np.float64) * col.scale
            row.append(Cell(float(v.mean()), None if once or len(v) < 2 else float(v.std(ddof=1))))
        cells.append(row)
    for j, col in enumerate(columns):
        _mark_ranks([r[j] for r in cells], col)
    shared = " (the fast fitter's data-driven fit is deterministic: computed once)" if s.shared_data_fit else ""
    notes = [f"Model {result.model.get('name')}; scored on '{result.test['name']}' (n={result.test['size']}); "
             f"{s.n_bins} bins; mean ± std over {len(s.seeds)} runs{shared}; Neural Clamping fitter: {s.fitter}."]
    return Table("Random vs data-driven initialisation of δ", columns, rows, cells, notes, [], s.n_bins, "Initialisation")
