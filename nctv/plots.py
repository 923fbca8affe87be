"""Figures from data: numbers first (small dataclasses), drawing second.

Every figure exists twice from the same data object: ``backend="matplotlib"`` gives a
``matplotlib.figure.Figure`` for paper export (PNG/PDF; built without pyplot, so it is safe in
threads and under any backend), ``backend="plotly"`` an interactive ``plotly`` figure whose hover
text shows the numbers (for reliability diagrams: bin range, count, accuracy, confidence).
:func:`save_figure` writes either kind by file extension.

Data objects and their units:

* :class:`ReliabilityData` — equal-width bins of top-1 confidence from
  :func:`nctv.metrics.reliability_bins`; fractions; ECE shown in %. Optionally the smoothed reliability
  curve with its bootstrap band (:func:`nctv.intervals.smooth_band`), drawn beside the bins.
* :class:`DeltaImageData` — Neural Clamping's δ **in pixel units**: δ lives in the model's
  normalised input space, so δ_pixel = δ · std (per channel); shown on the 0–255 intensity scale
  with a symmetric diverging colour map (white = 0).
* :class:`GammaCurveData` — ECE, entropy and training loss against γ for the calibration and test
  splits (Figure 2).
* :class:`InitStudyData` — per-run metrics of random vs data-driven δ initialisation (Figure 3).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from nctv import metrics
from nctv.checks import check_whole
from nctv.intervals import IntervalSettings, SmoothBand, smooth_band
from nctv.report import metric_column

BACKENDS = ("matplotlib", "plotly")
BLUE, GREEN, RED, GREY = "#1f77b4", "#2ca02c", "#d62728", "#7f7f7f"
#: Colours of the initialisation study, as in the paper's Figure 3 (random blue, data-driven green).
INIT_COLOURS = {"random": BLUE, "data-driven": GREEN}
_PER_ROW = 5
#: Plotly legend on the title's line, right-aligned, clear of the subplot titles.
_TOP_LEGEND = dict(orientation="h", yref="container", y=0.97, yanchor="top", xanchor="right", x=1)


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"Unknown plotting backend {backend!r}; use 'matplotlib' or 'plotly'.")
    return backend


def _new_figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


# --------------------------------------------------------------------------- reliability


def _from_bins(name: str) -> property:
    """A read-only attribute of :class:`ReliabilityData` taken from its ``bins``."""
    return property(lambda self: getattr(self.bins, name),
                    doc=f"``bins.{name}`` (see :class:`nctv.metrics.ReliabilityBins`).")


@dataclass(frozen=True)
class ReliabilityData:
    """A reliability diagram's numbers for one method (fractions; NaN for empty bins).

    The per-bin numbers are a :class:`nctv.metrics.ReliabilityBins`; its ``edges``, ``counts``,
    ``confidence``, ``accuracy``, ``n`` and ``n_bins`` read through as attributes of this object.
    ``smooth``: the smoothed reliability curve with its bootstrap band (None: not computed).
    """

    method: str
    bins: metrics.ReliabilityBins
    ece: float
    overall_accuracy: float
    mean_confidence: float
    smooth: SmoothBand | None = None

    edges = _from_bins("edges")
    counts = _from_bins("counts")
    confidence = _from_bins("confidence")
    accuracy = _from_bins("accuracy")
    n = _from_bins("n")
    n_bins = _from_bins("n_bins")

    @property
    def accuracy_interval(self) -> tuple[np.ndarray, np.ndarray]:
        """Per bin, the 95 % Wilson interval of the bin's accuracy (low, high; NaN for empty bins)."""
        from nctv.intervals import wilson_interval

        return wilson_interval(np.round(self.accuracy * self.counts), self.counts)


def reliability_data(logits: Any, labels: Any, n_bins: int = 15, method: str = "",
                     smooth: IntervalSettings | None = None) -> ReliabilityData:
    """Bins from :func:`nctv.metrics.reliability_bins` of ``logits`` (N, K) and ``labels`` (N,); with
    ``smooth``, also the smoothed reliability curve and its band at those interval settings."""
    bins = metrics.reliability_bins(logits, labels, n_bins)
    conf, pred = metrics.confidences_and_predictions(logits)
    band = None
    if smooth is not None:
        correct = pred == _to_numpy(labels)  # labels already checked by reliability_bins
        band = smooth_band(conf, correct, level=smooth.level, resamples=smooth.resamples, seed=smooth.seed)
    return ReliabilityData(
        method, bins, metrics.ece(logits, labels, n_bins), metrics.accuracy(logits, labels), float(conf.mean()), band,
    )


def reliability_data_from_result(result: Any, n_bins: int = 15, methods: Sequence[str] | None = None,
                                 smooth: bool = False) -> list[ReliabilityData]:
    """One :class:`ReliabilityData` per method of a ``RunResult`` (first seed's calibrated test logits);
    with ``smooth``, each with its smoothed curve and band at the run's interval settings (the defaults
    for a run without intervals)."""
    names = list(result.methods) if methods is None else list(methods)
    if result.test_labels is None:
        raise ValueError("This result has no test logits (it was read from JSON); re-run it to draw diagrams.")
    settings = None
    if smooth:
        given = result.settings.get("intervals", {})
        settings = IntervalSettings(**{k: given[k] for k in ("level", "resamples", "seed") if k in given})
    out = []
    for name in names:
        if name not in result.methods:
            raise ValueError(f"No method {name!r} in this run; it has {', '.join(result.methods)}.")
        z = result.methods[name].test_logits
        if z is None:
            raise ValueError(f"Method {name!r} kept no test logits; re-run it to draw diagrams.")
        out.append(reliability_data(z, result.test_labels, n_bins, name, settings))
    return out


def reliability_data_from_bins(method: str, counts: Sequence[int], confidence: Sequence[float | None],
                               accuracy: Sequence[float | None], ece: float) -> ReliabilityData:
    """A diagram's numbers from stored bins (a shift study's ``reliability``: equal-width bins, per bin the
    count and the mean confidence and accuracy, None or NaN where empty) and the ECE recorded with them."""
    n = np.asarray(counts, dtype=np.int64)
    conf, acc = (np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)
                 for values in (confidence, accuracy))
    if n.ndim != 1 or n.size < 1 or conf.shape != n.shape or acc.shape != n.shape or (n < 0).any() or not n.sum():
        raise ValueError(f"The bins of {method!r} must be one count, mean confidence and accuracy per bin.")
    filled = n > 0
    bins = metrics.ReliabilityBins(metrics.bin_edges(n.size).numpy(), n, np.where(filled, conf, np.nan),
                                   np.where(filled, acc, np.nan))
    share = n[filled] / n.sum()
    return ReliabilityData(method, bins, float(ece), float(share @ acc[filled]), float(share @ conf[filled]))


def _as_list(data):
    items = [data] if not isinstance(data, (list, tuple)) else list(data)
    if not items:
        raise ValueError("Nothing to draw: pass at least one data object.")
    return items


def _grid(n: int, per_row: int = _PER_ROW) -> tuple[int, int]:
    cols = min(n, per_row)
    return math.ceil(n / cols), cols


def _hover_rows(d: ReliabilityData) -> list[str]:
    rows = []
    low, high = d.accuracy_interval
    for i in range(d.n_bins):
        lo, hi = d.edges[i], d.edges[i + 1]
        opening = "[" if i == 0 else "("
        if d.counts[i]:
            rows.append(f"bin {opening}{lo:.3f}, {hi:.3f}]<br>count {d.counts[i]}<br>"
                        f"accuracy {d.accuracy[i]:.4f} [{low[i]:.4f}, {high[i]:.4f}]<br>confidence {d.confidence[i]:.4f}")
        else:
            rows.append(f"bin {opening}{lo:.3f}, {hi:.3f}]<br>count 0 (empty)")
    return rows


def reliability_figure(data: ReliabilityData | Sequence[ReliabilityData], backend: str = "matplotlib",
                       per_row: int | None = None, panels: Sequence[str] | None = None):
    """Reliability diagrams side by side (``per_row`` per row: five for matplotlib,
    :data:`PLOTLY_PER_ROW` for plotly; 1 stacks them): per bin the accuracy as a bar with its 95 %
    Wilson interval against the diagonal, the gap to the bin's mean confidence shaded, ECE written on
    the panel, and the sample count per bin below. A method with a smoothed curve (``smooth``) gets a
    second panel beside it: the curve with its bootstrap band, smECE, and the confidence density below.

    ``panels`` (matplotlib): the diagrams to draw of each method, in order, from :data:`PANELS`
    ("binned", "smooth"; a method without a smoothed curve has no "smooth" one), each a cell of one
    grid of ``per_row`` cells a row, as a slide wants them (:func:`slide_figure`); None: the binned
    diagram and, under it, the smoothed one where the method has it."""
    items = _as_list(data)
    if per_row is not None:
        check_whole(per_row, "per_row", 1)
    if _check_backend(backend) == "plotly":
        return _reliability_plotly(items, per_row or PLOTLY_PER_ROW)
    if panels is not None:
        return _reliability_cells(items, panels, per_row)
    rows, cols = _grid(len(items), per_row or _PER_ROW)
    # A method's smoothed diagram goes under its binned one, so that a row of methods stays a row.
    panels = 2 if any(d.smooth is not None for d in items) else 1
    fig = _new_figure(3.0 * cols, 4.0 * rows * panels)
    grid = fig.add_gridspec(2 * rows * panels, cols, height_ratios=[3, 1] * rows * panels)
    for k, d in enumerate(items):
        r, c = divmod(k, cols)
        top = 2 * panels * r
        ax = fig.add_subplot(grid[top, c])
        hx = fig.add_subplot(grid[top + 1, c], sharex=ax)
        _binned_panel(ax, hx, d, first=k == 0, left=c == 0)
        if d.smooth is not None:
            ax = fig.add_subplot(grid[top + 2, c])
            hx = fig.add_subplot(grid[top + 3, c], sharex=ax)
            _smooth_panel(ax, hx, d, first=k == 0)
    return fig


#: The diagrams :func:`reliability_figure` draws of a method: binned, and smoothed with its band.
PANELS = ("binned", "smooth")


def _reliability_cells(items: list[ReliabilityData], panels: Sequence[str], per_row: int | None):
    unknown = [p for p in panels if p not in PANELS]
    if unknown or not panels:
        raise ValueError(f"Unknown reliability panel(s) {unknown or list(panels)}; use {' and/or '.join(PANELS)}.")
    cells = [(d, kind) for d in items for kind in panels if kind == "binned" or d.smooth is not None]
    if not cells:
        raise ValueError("No method here has its smoothed curve: draw its binned diagram instead.")
    rows, cols = _grid(len(cells), per_row or _PER_ROW)
    fig = _new_figure(3.0 * cols, 4.0 * rows)
    grid = fig.add_gridspec(2 * rows, cols, height_ratios=[3, 1] * rows)
    for k, (d, kind) in enumerate(cells):
        r, c = divmod(k, cols)
        ax = fig.add_subplot(grid[2 * r, c])
        hx = fig.add_subplot(grid[2 * r + 1, c], sharex=ax)
        if kind == "binned":
            _binned_panel(ax, hx, d, first=False, left=c == 0)
        else:
            _smooth_panel(ax, hx, d, first=False)
    # One key for the figure, under it: inside a panel it would hide bars or the ECE written there.
    keys: dict[str, Any] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            keys.setdefault(label, handle)
    fig.legend(keys.values(), keys.keys(), loc="outside lower center", ncol=len(keys), fontsize="small", frameon=False)
    return fig


def _label_box(ax: Any, text: str) -> None:
    ax.text(0.97, 0.04, text, transform=ax.transAxes, ha="right", va="bottom", fontsize="small",
            bbox=dict(boxstyle="round", facecolor="white", edgecolor=GREY, alpha=0.9))


def _binned_panel(ax: Any, hx: Any, d: ReliabilityData, first: bool, left: bool) -> None:
    edges, width = d.edges[:-1], np.diff(d.edges)
    filled = d.counts > 0
    acc = np.where(filled, d.accuracy, 0.0)
    conf = np.where(filled, d.confidence, 0.0)
    ax.bar(edges, acc, width=width, align="edge", color=BLUE, edgecolor="black", linewidth=0.5, label="Accuracy")
    over = conf >= acc
    ax.bar(edges[over], (conf - acc)[over], bottom=acc[over], width=width[over], align="edge", color=RED, alpha=0.3,
           edgecolor=RED, hatch="//", linewidth=0.5, label="Gap")
    # Where a bin is right more often than it is sure, its gap lies inside the accuracy bar: outlined,
    # since a translucent fill there would mix with the bar into a third colour.
    ax.bar(edges[~over], (conf - acc)[~over], bottom=acc[~over], width=width[~over], align="edge", fill=False,
           edgecolor=RED, linestyle="--", linewidth=1.2, label="Gap (under-confident)" if (~over).any() else None)
    low, high = d.accuracy_interval
    mid = (d.edges[:-1] + d.edges[1:]) / 2
    # The Wilson interval holds the bin's accuracy; clipping at 0 only removes rounding below it.
    below, above = np.clip(acc - low, 0, None), np.clip(high - acc, 0, None)
    ax.errorbar(mid[filled], acc[filled], yerr=[below[filled], above[filled]], fmt="none",
                ecolor="black", elinewidth=0.8, capsize=2, label="95 % interval")
    ax.plot([0, 1], [0, 1], ls="--", color=GREY, lw=1)
    ax.set(xlim=(0, 1), ylim=(0, 1), title=d.method or None)
    ax.set_ylabel("Accuracy" if left else "")
    _label_box(ax, f"ECE = {100 * d.ece:.2f}%")
    if first:
        ax.legend(loc="upper left", fontsize="small", framealpha=0.9)
    ax.tick_params(labelbottom=False)
    hx.bar(edges, d.counts, width=width, align="edge", color=GREY, edgecolor="black", linewidth=0.5)
    hx.set_xlabel("Confidence")
    hx.set_ylabel("Count" if left else "")


#: The smoothed curve and band are drawn where the confidence density is at least this share of its
#: peak: elsewhere they rest on a handful of predictions and the density floor pulls them to the diagonal.
_SPARSE = 0.01


def _dense(b: SmoothBand) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Curve, low and high with NaN where the confidences are too sparse to show them."""
    keep = b.density >= _SPARSE * b.density.max()
    return tuple(np.where(keep, v, np.nan) for v in (b.accuracy, b.low, b.high))


def _smooth_panel(ax: Any, hx: Any, d: ReliabilityData, first: bool) -> None:
    b = d.smooth
    curve, low, high = _dense(b)
    ax.fill_between(b.confidence, low, high, color=BLUE, alpha=0.25, linewidth=0, label=f"{100 * b.level:g} % band")
    ax.plot(b.confidence, curve, color=BLUE, lw=1.5, label="Smoothed accuracy")
    ax.plot([0, 1], [0, 1], ls="--", color=GREY, lw=1)
    # A long name takes a second line rather than run into the next panel's title.
    joint = "\n" if len(d.method or "") > 16 else " "
    ax.set(xlim=(0, 1), ylim=(0, 1), title=f"{d.method}{joint}(smoothed)" if d.method else "Smoothed")
    _label_box(ax, f"smECE = {100 * b.smooth_ece:.2f}%\nσ = {b.bandwidth:.3f}")
    if first:
        ax.legend(loc="upper left", fontsize="small", framealpha=0.9)
    ax.tick_params(labelbottom=False)
    hx.fill_between(b.confidence, b.density, color=GREY, alpha=0.6, linewidth=0)
    hx.set(xlabel="Confidence", ylabel="Density", ylim=(0, None))


#: Plotly reliability grid, as fractions of one row's height (top to bottom): room for a title of
#: up to :data:`_TITLE_LINES` lines, the diagram, a gap, the count histogram, its ticks and axis title.
_BLOCK = dict(title=0.13, diagram=0.55, gap=0.03, counts=0.17, axis=0.12)
_TITLE_CHARS, _TITLE_LINES, _TITLE_SIZE = 14, 3, 12
#: Interactive diagrams per row: at the app's least plot width (:data:`MIN_PLOT_WIDTH`) a panel keeps
#: about 170 px, enough for a wrapped title and the ECE label.
PLOTLY_PER_ROW = 4
MIN_PLOT_WIDTH = 720


def wrap_title(text: str, width: int = _TITLE_CHARS, lines: int = _TITLE_LINES) -> str:
    """``text`` broken at spaces into at most ``lines`` lines of about ``width`` characters, joined by
    ``<br>`` (plotly's line break), so that titles over narrow panels stay apart."""
    words, out = (text or "").split(), [""]
    for w in words:
        if out[-1] and len(out[-1]) + 1 + len(w) > width:
            out.append(w)
        else:
            out[-1] = f"{out[-1]} {w}".strip()
    if len(out) > lines:
        out = out[:lines - 1] + [" ".join(out[lines - 1:])]
    return "<br>".join(out)


def _reliability_plotly(items: list[ReliabilityData], per_row: int):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows, cols = _grid(len(items), per_row)
    panels = 2 if any(d.smooth is not None for d in items) else 1
    # Fewer panels per row leave each title more room (at one per row, a phone's width).
    title_chars = min(_TITLE_CHARS * PLOTLY_PER_ROW // (cols * panels), 3 * _TITLE_CHARS)
    fig = make_subplots(rows=2 * rows, cols=cols * panels, horizontal_spacing=0.07 / panels)
    for k, d in enumerate(items):
        r, c = divmod(k, cols)
        top, bottom = 2 * r + 1, 2 * r + 2
        c *= panels  # the binned panel's grid column (0-based); a smoothed one follows it
        centers = (d.edges[:-1] + d.edges[1:]) / 2
        width = np.diff(d.edges)
        filled = d.counts > 0
        acc = np.where(filled, d.accuracy, 0.0)
        conf = np.where(filled, d.confidence, 0.0)
        hover = _hover_rows(d)
        show = k == 0
        low, high = d.accuracy_interval
        bars = dict(type="data", symmetric=False, array=np.where(filled, np.clip(high - acc, 0, None), 0.0),
                    arrayminus=np.where(filled, np.clip(acc - low, 0, None), 0.0), color="black", thickness=1, width=2)
        fig.add_trace(go.Bar(x=centers, y=acc, width=width, error_y=bars,
                             marker=dict(color=BLUE, line=dict(color="black", width=0.5)),
                             name="Accuracy", legendgroup="acc", showlegend=show, hovertext=hover,
                             hovertemplate="%{hovertext}<extra>" + (d.method or "") + "</extra>"), row=top, col=c + 1)
        fig.add_trace(go.Bar(x=centers, y=conf - acc, base=acc, width=width,
                             marker=dict(color="rgba(214,39,40,0.3)", line=dict(color=RED, width=0.5)),
                             name="Gap", legendgroup="gap", showlegend=show, hovertext=hover,
                             hovertemplate="%{hovertext}<extra>gap</extra>"), row=top, col=c + 1)
        fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", line=dict(dash="dash", color=GREY), showlegend=False,
                                 hoverinfo="skip"), row=top, col=c + 1)
        fig.add_trace(go.Bar(x=centers, y=d.counts, width=width, marker=dict(color=GREY), name="Count", showlegend=False,
                             hovertext=hover, hovertemplate="%{hovertext}<extra>count</extra>"), row=bottom, col=c + 1)
        fig.add_annotation(x=0.97, y=0.05, text=f"ECE = {100 * d.ece:.2f}%", showarrow=False, xanchor="right",
                           bgcolor="white", bordercolor=GREY, font=dict(size=11), row=top, col=c + 1)
        fig.update_xaxes(range=[0, 1], row=top, col=c + 1, showticklabels=False)
        fig.update_xaxes(range=[0, 1], title_text="Confidence", row=bottom, col=c + 1)
        fig.update_yaxes(range=[0, 1], title_text="Accuracy" if c == 0 else None, row=top, col=c + 1)
        fig.update_yaxes(title_text="Count" if c == 0 else None, row=bottom, col=c + 1)
        _place_block(fig, r, rows, c + 1, d.method, title_chars)
        if d.smooth is not None:
            _smooth_plotly(fig, d, r, rows, c + 2, title_chars, k == 0)
    fig.update_layout(barmode="overlay", bargap=0, height=420 * rows + 60, width=max(MIN_PLOT_WIDTH, 250 * cols * panels),
                      template="plotly_white", title="Reliability diagrams",
                      # Stacked for a phone: each panel takes the width the axis titles leave it.
                      margin=dict(t=110 if rows == 1 else 60, **(dict(l=60, r=20, b=30) if cols == 1 else {})),
                      legend=_TOP_LEGEND)
    return fig


def _smooth_plotly(fig: Any, d: ReliabilityData, r: int, rows: int, col: int, title_chars: int, legend: bool) -> None:
    """The smoothed curve, its band and the confidence density of ``d`` in grid column ``col``."""
    import plotly.graph_objects as go

    b = d.smooth
    top, bottom = 2 * r + 1, 2 * r + 2
    curve, low, high = _dense(b)
    hover = [f"confidence {t:.3f}<br>smoothed accuracy {a:.4f} [{lo:.4f}, {hi:.4f}]<br>density {p:.3f}"
             for t, a, lo, hi, p in zip(b.confidence, b.accuracy, b.low, b.high, b.density)]
    band = f"{100 * b.level:g} % band"
    keep = ~np.isnan(curve)
    fig.add_trace(go.Scatter(x=np.concatenate([b.confidence[keep], b.confidence[keep][::-1]]),
                             y=np.concatenate([high[keep], low[keep][::-1]]),
                             fill="toself", fillcolor="rgba(31,119,180,0.25)", line=dict(width=0), hoverinfo="skip",
                             name=band, legendgroup="band", showlegend=legend), row=top, col=col)
    fig.add_trace(go.Scatter(x=b.confidence, y=curve, mode="lines", line=dict(color=BLUE, width=2),
                             name="Smoothed accuracy", legendgroup="smooth", showlegend=legend, hovertext=hover,
                             hovertemplate="%{hovertext}<extra>" + (d.method or "") + "</extra>"), row=top, col=col)
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", line=dict(dash="dash", color=GREY), showlegend=False,
                             hoverinfo="skip"), row=top, col=col)
    fig.add_trace(go.Scatter(x=b.confidence, y=b.density, mode="lines", fill="tozeroy", line=dict(color=GREY, width=1),
                             name="Density", showlegend=False, hovertext=hover,
                             hovertemplate="%{hovertext}<extra>density</extra>"), row=bottom, col=col)
    fig.add_annotation(x=0.97, y=0.05, text=f"smECE = {100 * b.smooth_ece:.2f}% (σ = {b.bandwidth:.3f})", showarrow=False,
                       xanchor="right", bgcolor="white", bordercolor=GREY, font=dict(size=11), row=top, col=col)
    fig.update_xaxes(range=[0, 1], row=top, col=col, showticklabels=False)
    fig.update_xaxes(range=[0, 1], title_text="Confidence", row=bottom, col=col)
    fig.update_yaxes(range=[0, 1], row=top, col=col)
    fig.update_yaxes(title_text="Density", row=bottom, col=col)
    _place_block(fig, r, rows, col, f"{d.method} (smoothed)" if d.method else "Smoothed", title_chars)


def _place_block(fig: Any, r: int, rows: int, col: int, title: str | None, title_chars: int) -> None:
    """Give row ``r``'s diagram and count axes their share of the page (see :data:`_BLOCK`) and
    put the panel's wrapped title in the room above the diagram."""
    height = 1.0 / rows
    y = 1.0 - r * height - _BLOCK["title"] * height
    diagram = [y - _BLOCK["diagram"] * height, y]
    counts_top = diagram[0] - _BLOCK["gap"] * height
    counts = [counts_top - _BLOCK["counts"] * height, counts_top]
    fig.update_yaxes(domain=diagram, row=2 * r + 1, col=col)
    fig.update_yaxes(domain=counts, row=2 * r + 2, col=col)
    x0, x1 = fig.get_subplot(2 * r + 1, col).xaxis.domain
    fig.add_annotation(x=(x0 + x1) / 2, y=diagram[1], xref="paper", yref="paper", yanchor="bottom",
                       text=wrap_title(title or "", title_chars), showarrow=False, font=dict(size=_TITLE_SIZE),
                       name="panel-title")


def confidence_figure(data: ReliabilityData | Sequence[ReliabilityData], backend: str = "matplotlib"):
    """Confidence histograms side by side: share of samples per confidence bin, with the mean
    confidence and the accuracy marked (a gap between the two lines is over/under-confidence)."""
    items = _as_list(data)
    if _check_backend(backend) == "plotly":
        return _confidence_plotly(items)
    rows, cols = _grid(len(items))
    fig = _new_figure(3.0 * cols, 2.8 * rows)
    axes = fig.subplots(rows, cols, squeeze=False)
    for k, d in enumerate(items):
        ax = axes[divmod(k, cols)]
        ax.bar(d.edges[:-1], d.counts / max(d.n, 1), width=np.diff(d.edges), align="edge", color=BLUE,
               edgecolor="black", linewidth=0.5)
        ax.axvline(d.overall_accuracy, color=GREEN, ls="--", lw=1.5, label=f"Accuracy {100 * d.overall_accuracy:.1f}%")
        ax.axvline(d.mean_confidence, color=RED, ls=":", lw=1.5, label=f"Avg. confidence {100 * d.mean_confidence:.1f}%")
        ax.set(xlim=(0, 1), title=d.method or None, xlabel="Confidence")
        ax.set_ylabel("Share of samples" if k % cols == 0 else "")
        ax.legend(fontsize="x-small", loc="upper left", framealpha=0.9)
    for k in range(len(items), rows * cols):
        axes[divmod(k, cols)].set_visible(False)
    return fig


def _confidence_plotly(items: list[ReliabilityData]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows, cols = _grid(len(items))
    titles = [f"{d.method}<br><sup>accuracy {100 * d.overall_accuracy:.1f}%, avg. confidence "
              f"{100 * d.mean_confidence:.1f}%</sup>" for d in items]
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=titles)
    for k, d in enumerate(items):
        r, c = divmod(k, cols)
        centers = (d.edges[:-1] + d.edges[1:]) / 2
        share = d.counts / max(d.n, 1)
        fig.add_trace(go.Bar(x=centers, y=share, width=np.diff(d.edges), marker=dict(color=BLUE),
                             hovertext=_hover_rows(d), hovertemplate="%{hovertext}<br>share %{y:.3f}<extra></extra>",
                             showlegend=False), row=r + 1, col=c + 1)
        top = float(share.max()) if d.n else 1.0
        for value, colour, dash, label in ((d.overall_accuracy, GREEN, "dash", "accuracy"),
                                           (d.mean_confidence, RED, "dot", "avg. confidence")):
            fig.add_trace(go.Scatter(x=[value, value], y=[0, top], mode="lines", line=dict(color=colour, dash=dash),
                                     name=label, legendgroup=label, showlegend=k == 0,
                                     hovertemplate=f"{label} {100 * value:.2f}%<extra></extra>"), row=r + 1, col=c + 1)
        fig.update_xaxes(range=[0, 1], title_text="Confidence", row=r + 1, col=c + 1)
    fig.update_layout(height=340 * rows + 60, width=max(340 * cols, 420), template="plotly_white", bargap=0,
                      title="Confidence histograms", margin=dict(t=110), legend=_TOP_LEGEND)
    return fig


# --------------------------------------------------------------------------- δ image


@dataclass(frozen=True)
class DeltaImageData:
    """δ in pixel units (C, H, W) on the 0–255 intensity scale, optionally beside an example.

    ``example`` is the example input in pixel values (C, H, W) in [0, 1]; ``perturbed`` is
    example + δ in the same units, clipped to [0, 1] for display; ``difference`` = perturbed −
    example on the 0–255 scale (equals δ except where clipping bites).
    """

    delta: np.ndarray
    channel_names: tuple[str, ...]
    example: np.ndarray | None = None
    perturbed: np.ndarray | None = None
    difference: np.ndarray | None = None
    title: str = "Neural Clamping δ"

    @property
    def limit(self) -> float:
        """Half-range of the symmetric colour scale: the largest |δ| (1 if δ is zero)."""
        m = float(np.abs(self.delta).max()) if self.delta.size else 0.0
        return m if m > 0 else 1.0

    @property
    def combined(self) -> np.ndarray:
        """The signed mean of δ over channels (H, W)."""
        return self.delta.mean(axis=0)


def delta_image_data(
    delta: Any,
    mean: Sequence[float],
    std: Sequence[float],
    example: Any | None = None,
    channel_names: Sequence[str] | None = None,
    title: str = "Neural Clamping δ",
) -> DeltaImageData:
    """Convert δ (C, H, W) from normalised input space to pixel units: δ · std per channel.

    ``mean``/``std``: the model's normalisation (as in its data config, on the 0–1 pixel scale).
    ``example``: one *preprocessed* (normalised) model input (C, H, W); its pixels are x · std + mean.
    """
    d = _to_numpy(delta)
    if d.ndim != 3:
        raise ValueError(f"δ has shape {tuple(d.shape)}; an image needs (channels, height, width).")
    c = d.shape[0]
    s = np.asarray(std, dtype=np.float64).reshape(-1)
    mu = np.asarray(mean, dtype=np.float64).reshape(-1)
    if len(s) == 1:
        s, mu = np.repeat(s, c), np.repeat(mu, c)
    if len(s) != c or len(mu) != c:
        raise ValueError(f"δ has {c} channel(s) but the normalisation has {len(s)} std value(s); they must match.")
    if np.any(s <= 0):
        raise ValueError("Normalisation std values must be positive.")
    names = tuple(channel_names) if channel_names is not None else default_channel_names(c)
    if len(names) != c:
        raise ValueError(f"{len(names)} channel names for {c} channels.")
    d_pix = d * s[:, None, None]
    ex = pert = diff = None
    if example is not None:
        x = _to_numpy(example)
        if x.shape != d.shape:
            raise ValueError(f"The example has shape {tuple(x.shape)} but δ has {tuple(d.shape)}; they must match.")
        ex = np.clip(x * s[:, None, None] + mu[:, None, None], 0.0, 1.0)
        pert = np.clip(ex + d_pix, 0.0, 1.0)
        diff = 255.0 * (pert - ex)
    return DeltaImageData(255.0 * d_pix, names, ex, pert, diff, title)


def default_channel_names(channels: int) -> tuple[str, ...]:
    """Channels named in words: one channel is brightness, three are red, green and blue."""
    if channels == 1:
        return ("brightness",)
    if channels == 3:
        return ("red", "green", "blue")
    return tuple(f"channel {i + 1}" for i in range(channels))


def delta_sentence(data: DeltaImageData) -> str:
    """One sentence for a newcomer: what δ is and how large it is beside the images' 0–255 range."""
    size = np.abs(data.delta)
    if not size.size or float(size.max()) == 0.0:
        return "δ is zero here: the model sees every picture unchanged."
    largest = float(size.max())
    where = ("" if len(data.channel_names) == 1
             else f" (in the {data.channel_names[int(np.unravel_index(size.argmax(), size.shape)[0])]} channel)")
    levels = "grey levels" if data.channel_names == ("brightness",) else "levels"
    return (f"δ is one small pattern added to every picture before the model sees it; its largest change is "
            f"{largest:.1f} of 255 {levels}{where}, {100 * largest / 255:.1f} % of the image's range, and on "
            f"average it changes a pixel by {float(size.mean()):.1f} {levels}.")


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def _as_rgb(img: np.ndarray) -> np.ndarray:
    """(C, H, W) in [0, 1] → (H, W, 3) for display (grey repeated; only the first three channels)."""
    if img.shape[0] == 1:
        img = np.repeat(img, 3, axis=0)
    return np.transpose(img[:3], (1, 2, 0))


#: At most three δ panels side by side: with short titles they stay apart in a phone-wide box.
_DELTA_COLUMNS = 3


def _delta_panels(d: DeltaImageData) -> list[tuple[str, np.ndarray, str]]:
    """(title, array, kind) with kind 'image' (H, W, 3 in [0, 1]) or 'signed' (H, W, 0–255 scale)."""
    panels: list[tuple[str, np.ndarray, str]] = []
    several = d.delta.shape[0] > 1
    if d.example is not None:
        panels += [("Input", _as_rgb(d.example), "image"), ("Input + δ", _as_rgb(d.perturbed), "image"),
                   ("Change" + (" (mean)" if several else ""), d.difference.mean(axis=0), "signed")]
    if several:
        panels.append(("δ (mean)", d.combined, "signed"))
    panels += [(f"δ: {name}", d.delta[i], "signed") for i, name in enumerate(d.channel_names)]
    return panels


def delta_figure(data: DeltaImageData, backend: str = "matplotlib"):
    """The δ perturbation as images: the example, example + δ and their difference, δ combined and
    per channel — all signed maps on one symmetric diverging scale (0–255 pixel levels) with a
    colour bar."""
    panels = _delta_panels(data)
    lim = data.limit
    if _check_backend(backend) == "plotly":
        return _delta_plotly(data, panels, lim)
    n = len(panels)
    cols = min(n, _DELTA_COLUMNS)
    rows = math.ceil(n / cols)
    fig = _new_figure(2.6 * cols + 0.6, 2.6 * rows + 0.4)
    axes = fig.subplots(rows, cols, squeeze=False)
    mappable = None
    for k, (title, arr, kind) in enumerate(panels):
        ax = axes[divmod(k, cols)]
        if kind == "image":
            ax.imshow(arr, interpolation="nearest")
        else:
            mappable = ax.imshow(arr, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        ax.set_title(title, fontsize="small")
        ax.set_xticks([]), ax.set_yticks([])
    for k in range(n, rows * cols):
        axes[divmod(k, cols)].set_visible(False)
    if mappable is not None:
        bar = fig.colorbar(mappable, ax=axes.ravel().tolist(), shrink=0.8)
        bar.set_label("pixel change (0–255 scale)")
    fig.suptitle(f"{data.title} — max |δ| = {np.abs(data.delta).max():.2f} of 255")
    return fig


def _delta_plotly(data: DeltaImageData, panels, lim: float):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    n = len(panels)
    cols = min(n, _DELTA_COLUMNS)
    rows = math.ceil(n / cols)
    # The panels take the whole width (colour bar below them, thin margins) and their titles are
    # short lines in a small font: on a phone four panels share about 350 px, and a title wider
    # than its panel would run into the next one's.
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[wrap_title(p[0], 10) for p in panels],
                        horizontal_spacing=0.03, vertical_spacing=0.08)
    fig.update_annotations(font_size=11, yanchor="bottom")
    first_signed = True
    for k, (title, arr, kind) in enumerate(panels):
        r, c = divmod(k, cols)
        if kind == "image":
            fig.add_trace(go.Image(z=np.round(255 * arr).astype(np.uint8), name=title,
                                   hovertemplate="x %{x}, y %{y}<br>RGB %{z}<extra>" + title + "</extra>"),
                          row=r + 1, col=c + 1)
        else:
            fig.add_trace(go.Heatmap(z=arr, zmin=-lim, zmax=lim, zmid=0, colorscale="RdBu", reversescale=True,
                                     showscale=first_signed, name=title,
                                     colorbar=dict(orientation="h", y=-0.04, yanchor="top", len=0.7, thickness=12,
                                                   title=dict(text="pixel change (0–255)", side="top")),
                                     hovertemplate="x %{x}, y %{y}<br>%{z:.3f} of 255<extra>" + title + "</extra>"),
                          row=r + 1, col=c + 1)
            first_signed = False
        fig.update_yaxes(autorange="reversed", scaleanchor=f"x{k + 1 if k else ''}", showticklabels=False,
                         row=r + 1, col=c + 1)
        fig.update_xaxes(showticklabels=False, row=r + 1, col=c + 1)
    fig.update_xaxes(showgrid=False, zeroline=False, constrain="domain")
    fig.update_yaxes(showgrid=False, zeroline=False, constrain="domain")
    # Two short title lines rather than one long one, which would run off a phone's screen.
    fig.update_layout(title=f"{data.title}<br><sup>max |δ| = {np.abs(data.delta).max():.2f} of 255</sup>",
                      template="plotly_white", height=280 * rows + 130, width=260 * cols + 40,
                      margin=dict(l=20, r=20, b=80))
    return fig


# --------------------------------------------------------------------------- γ curves


@dataclass(frozen=True)
class GammaCurveData:
    """Metrics against γ: ``ece[split]``, ``entropy[split]``, ``loss[split]`` arrays aligned with
    ``gammas`` (fractions; loss is the mean focal loss of the fitted δ, T on that split).
    ``chosen`` is the γ with the lowest calibration ECE, if known. ``band[metric]`` ("ece", "entropy"):
    (low, high) arrays of the test split's interval per γ, at coverage ``level`` (None: no band)."""

    gammas: np.ndarray
    ece: dict[str, np.ndarray]
    entropy: dict[str, np.ndarray]
    loss: dict[str, np.ndarray]
    chosen: float | None = None
    n_bins: int = 15
    fitter: str | None = None
    title: str = "Neural Clamping against γ"
    band: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
    level: float | None = None


def gamma_curve_data(
    gammas: Sequence[float],
    ece: Mapping[str, Sequence[float]],
    entropy: Mapping[str, Sequence[float]],
    loss: Mapping[str, Sequence[float]],
    chosen: float | None = None,
    n_bins: int = 15,
    fitter: str | None = None,
    title: str = "Neural Clamping against γ",
    band: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    level: float | None = None,
) -> GammaCurveData:
    """Validate and pack γ-sweep numbers (one value per γ for every split; ``band``: the test split's
    (low, high) per γ for "ece" and/or "entropy", at coverage ``level``)."""
    g = np.asarray(gammas, dtype=np.float64)
    if g.ndim != 1 or g.size == 0:
        raise ValueError("gammas must be a non-empty list of numbers.")
    packed = []
    for name, series in (("ece", ece), ("entropy", entropy), ("loss", loss)):
        out = {}
        for split, values in series.items():
            v = np.asarray(values, dtype=np.float64)
            if v.shape != g.shape:
                raise ValueError(f"{name} for split {split!r} has {v.size} values for {g.size} γ values.")
            out[str(split)] = v
        packed.append(out)
    bands = None
    if band is not None:
        bands = {}
        for name, ends in band.items():
            low, high = (np.asarray(v, dtype=np.float64) for v in ends)
            if low.shape != g.shape or high.shape != g.shape:
                raise ValueError(f"The {name} band has {low.size} and {high.size} values for {g.size} γ values.")
            bands[str(name)] = (low, high)
    return GammaCurveData(g, *packed, chosen=chosen, n_bins=n_bins, fitter=fitter, title=title, band=bands,
                          level=level)


_SPLIT_STYLE = {0: ("-", "o"), 1: ("--", "s"), 2: (":", "^")}


def _gamma_panels(data: GammaCurveData) -> list[tuple[str, dict[str, np.ndarray], tuple[np.ndarray, np.ndarray] | None]]:
    """(axis label, values per split, the test split's band or None) per panel, in shown units."""
    band = data.band or {}
    ece = band.get("ece")
    return [("ECE (%)", {k: 100 * v for k, v in data.ece.items()}, None if ece is None else (100 * ece[0], 100 * ece[1])),
            ("Entropy", data.entropy, band.get("entropy")), ("Loss", data.loss, None)]


def gamma_figure(data: GammaCurveData, backend: str = "matplotlib"):
    """Three panels against γ — ECE (%), entropy and training loss — one line per split, the chosen
    γ marked, and the test split's interval as a band where the data has one."""
    panels = _gamma_panels(data)
    if _check_backend(backend) == "plotly":
        return _gamma_plotly(data, panels)
    fig = _new_figure(10.5, 3.2)
    axes = fig.subplots(1, 3)
    for ax, (ylabel, series, band) in zip(axes, panels):
        for i, (split, values) in enumerate(series.items()):
            ls, marker = _SPLIT_STYLE.get(i, ("-", "."))
            line, = ax.plot(data.gammas, values, ls=ls, marker=marker, ms=3, label=split)
            if split == "test" and band is not None:
                ax.fill_between(data.gammas, band[0], band[1], color=line.get_color(), alpha=0.2, linewidth=0,
                                label=f"test, {100 * data.level:g} % interval")
        if data.chosen is not None:
            ax.axvline(data.chosen, color=GREY, ls=":", lw=1)
        ax.set(xlabel="γ", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small", frameon=False)
    extra = f", chosen γ = {data.chosen:g}" if data.chosen is not None else ""
    fit = f", fitter {data.fitter}" if data.fitter else ""
    fig.suptitle(f"{data.title} ({data.n_bins} bins{extra}{fit})")
    return fig


def _gamma_plotly(data: GammaCurveData, panels):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, subplot_titles=[p[0] for p in panels])
    colours = [BLUE, RED, GREEN]
    fills = ["rgba(31,119,180,0.2)", "rgba(214,39,40,0.2)", "rgba(44,160,44,0.2)"]
    for j, (ylabel, series, band) in enumerate(panels):
        for i, (split, values) in enumerate(series.items()):
            if split == "test" and band is not None:
                name = f"test, {100 * data.level:g} % interval"
                fig.add_trace(go.Scatter(x=np.concatenate([data.gammas, data.gammas[::-1]]),
                                         y=np.concatenate([band[1], band[0][::-1]]), fill="toself",
                                         fillcolor=fills[i % 3], line=dict(width=0), hoverinfo="skip", name=name,
                                         legendgroup=name, showlegend=j == 0), row=1, col=j + 1)
            fig.add_trace(go.Scatter(x=data.gammas, y=values, mode="lines+markers", name=split, legendgroup=split,
                                     showlegend=j == 0, line=dict(color=colours[i % 3], dash="solid" if i == 0 else "dash"),
                                     hovertemplate=f"{split}<br>γ %{{x:.3g}}<br>{ylabel} %{{y:.4f}}<extra></extra>"),
                          row=1, col=j + 1)
        if data.chosen is not None:
            fig.add_vline(x=data.chosen, line=dict(color=GREY, dash="dot"), row=1, col=j + 1)
        fig.update_xaxes(title_text="γ", row=1, col=j + 1)
    extra = f", chosen γ = {data.chosen:g}" if data.chosen is not None else ""
    fig.update_layout(title=f"{data.title} ({data.n_bins} bins{extra})", template="plotly_white", height=380, width=1050)
    return fig


# --------------------------------------------------------------------------- initialisation study


@dataclass(frozen=True)
class InitStudyData:
    """Per-run metric values (fractions) per initialisation: ``values[init][metric]`` arrays;
    ``ci[init][metric]``: (low, high) of the mean over runs from resampling the test split, at
    coverage ``level`` (None: not computed)."""

    values: dict[str, dict[str, np.ndarray]]
    metrics: tuple[str, ...] = ("entropy", "ece", "aece", "sce")
    n_classes: int = 2
    n_bins: int = 15
    fitter: str | None = None
    title: str = "Random vs data-driven initialisation of δ"
    ci: dict[str, dict[str, tuple[float, float]]] | None = None
    level: float | None = None


def init_study_data(
    values: Mapping[str, Mapping[str, Sequence[float]]],
    metrics_shown: Sequence[str] = ("entropy", "ece", "aece", "sce"),
    n_classes: int = 2,
    n_bins: int = 15,
    fitter: str | None = None,
    ci: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
    level: float | None = None,
) -> InitStudyData:
    """Validate and pack per-run metrics, e.g. ``{"random": {"ece": [...]}, "data-driven": {...}}``, and
    optionally each initialisation's interval of the mean, ``ci`` (same keys; (low, high) per metric)."""
    if not values:
        raise ValueError("The initialisation study has no runs.")
    packed = {}
    for init, per in values.items():
        packed[str(init)] = {}
        for m in metrics_shown:
            if m not in per:
                raise ValueError(f"Initialisation {init!r} has no values for metric {m!r}.")
            arr = np.asarray(per[m], dtype=np.float64).reshape(-1)
            if arr.size == 0:
                raise ValueError(f"Initialisation {init!r} has no runs for metric {m!r}.")
            packed[str(init)][m] = arr
    ends = None
    if ci is not None:
        missing = [f"{init}/{m}" for init in packed for m in metrics_shown if m not in ci.get(init, {})]
        if missing:
            raise ValueError(f"No interval for {', '.join(missing)}.")
        ends = {init: {m: (float(ci[init][m][0]), float(ci[init][m][1])) for m in metrics_shown} for init in packed}
    return InitStudyData(packed, tuple(metrics_shown), n_classes, n_bins, fitter, ci=ends, level=level)


def _shown(metric: str, n_classes: int) -> tuple[str, float]:
    col = metric_column(metric, n_classes)
    return col.label(), col.scale


def init_study_figure(data: InitStudyData, backend: str = "matplotlib"):
    """Box plots (quartiles, runs as dots) per metric, one box per initialisation, in table units."""
    inits = list(data.values)
    if _check_backend(backend) == "plotly":
        return _init_plotly(data, inits)
    fig = _new_figure(2.7 * len(data.metrics), 3.2)
    axes = fig.subplots(1, len(data.metrics), squeeze=False)[0]
    rng = np.random.default_rng(0)
    for ax, m in zip(axes, data.metrics):
        label, scale = _shown(m, data.n_classes)
        series = [data.values[i][m] * scale for i in inits]
        box = ax.boxplot(series, patch_artist=True, widths=0.5, showfliers=False)
        ax.set_xticks(range(1, len(inits) + 1), inits)
        for patch, init in zip(box["boxes"], inits):
            patch.set(facecolor=INIT_COLOURS.get(init, GREY), alpha=0.45)
        for j, s in enumerate(series):
            # Small horizontal jitter so that equal runs stay visible as separate dots.
            ax.scatter(j + 1 + rng.uniform(-0.08, 0.08, len(s)), s, s=12, color="black", zorder=3)
        if data.ci is not None:
            # Beside each box: the mean over runs with its interval from resampling the test split.
            for j, init in enumerate(inits):
                low, high = (scale * v for v in data.ci[init][m])
                mean = float(series[j].mean())
                ax.errorbar(j + 1.35, mean, yerr=[[max(mean - low, 0)], [max(high - mean, 0)]], fmt="D", ms=4,
                            color=INIT_COLOURS.get(init, GREY), ecolor="black", capsize=3,
                            label=f"mean, {100 * data.level:g} % interval" if j == 0 else None)
            ax.set_xlim(0.5, len(inits) + 0.6)
        ax.set_title(label, fontsize="medium")
        ax.grid(axis="y", alpha=0.3)
    if data.ci is not None:
        axes[0].legend(fontsize="x-small", loc="best", framealpha=0.9)
    fit = f", fitter {data.fitter}" if data.fitter else ""
    fig.suptitle(f"{data.title} ({data.n_bins} bins{fit})")
    return fig


def _init_plotly(data: InitStudyData, inits: list[str]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    labels = [_shown(m, data.n_classes) for m in data.metrics]
    fig = make_subplots(rows=1, cols=len(data.metrics), subplot_titles=[lab for lab, _ in labels])
    for j, (m, (label, scale)) in enumerate(zip(data.metrics, labels)):
        for init in inits:
            fig.add_trace(go.Box(y=data.values[init][m] * scale, name=init, boxpoints="all", jitter=0.3,
                                 marker_color=INIT_COLOURS.get(init, GREY), legendgroup=init, showlegend=j == 0,
                                 hovertemplate=f"{init}<br>{label} %{{y:.4f}}<extra></extra>"), row=1, col=j + 1)
            if data.ci is not None:
                low, high = (scale * v for v in data.ci[init][m])
                mean = float(data.values[init][m].mean() * scale)
                fig.add_trace(go.Scatter(x=[init], y=[mean], mode="markers", marker=dict(symbol="diamond", size=9,
                                         color=INIT_COLOURS.get(init, GREY), line=dict(color="black", width=1)),
                                         error_y=dict(type="data", symmetric=False, array=[max(high - mean, 0)],
                                                      arrayminus=[max(mean - low, 0)], color="black"),
                                         name=f"mean, {100 * data.level:g} % interval", legendgroup="ci",
                                         showlegend=j == 0 and init == inits[0],
                                         hovertemplate=f"{init} mean %{{y:.4f}} [{low:.4f}, {high:.4f}]<extra></extra>"),
                              row=1, col=j + 1)
    fig.update_layout(title=f"{data.title} ({data.n_bins} bins)", template="plotly_white", height=380,
                      width=280 * len(data.metrics) + 100)
    return fig


# --------------------------------------------------------------------------- saving


# --------------------------------------------------------------------------- distribution shift




@dataclass(frozen=True)
class ShiftCurveData:
    """A metric against severity (0 = clean … 5), per method, for each corruption and for the mean over
    corruptions (Ovadia et al., NeurIPS 2019): ``values[panel][method]`` arrays over ``severities``,
    ``low``/``high`` the same shape (the interval), fractions. Panels: "average" first, then the corruptions."""

    severities: np.ndarray
    panels: tuple[str, ...]
    titles: dict[str, str]
    values: dict[str, dict[str, np.ndarray]]
    low: dict[str, dict[str, np.ndarray]]
    high: dict[str, dict[str, np.ndarray]]
    metric: str = "ece"
    n_classes: int = 10
    n_bins: int = 15
    level: float = 0.95
    title: str = ""
    #: A severity marked on every panel (the one a page shows), or None.
    marked: float | None = None


def shift_curve_data(result: Any, metric: str = "ece", methods: Sequence[str] | None = None) -> ShiftCurveData:
    """Pack a ``nctv.shift.ShiftResult`` for :func:`shift_figure`: ``metric`` with its interval against
    severity, severity 0 being the clean test split."""
    from nctv.corruptions import CORRUPTIONS
    from nctv.shift import AVERAGE, CLEAN, condition_key

    shown = list(methods) if methods is not None else list(result.methods)
    sev = np.asarray([0] + list(result.severities), dtype=np.float64)
    panels = (AVERAGE,) + tuple(result.corruptions)
    titles = {AVERAGE: "mean over corruptions", **{c: CORRUPTIONS[c].title for c in result.corruptions}}
    values, low, high = {}, {}, {}
    for panel in panels:
        keys = [CLEAN] + [f"{AVERAGE}/{s}" if panel == AVERAGE else condition_key(panel, s) for s in result.severities]
        values[panel], low[panel], high[panel] = {}, {}, {}
        for m in shown:
            figs = [result.figure(m, k, metric) for k in keys]
            values[panel][m] = np.asarray([f["value"] for f in figs], dtype=np.float64)
            low[panel][m] = np.asarray([np.nan if f["ci_low"] is None else f["ci_low"] for f in figs], dtype=np.float64)
            high[panel][m] = np.asarray([np.nan if f["ci_high"] is None else f["ci_high"] for f in figs], dtype=np.float64)
    on = "clean calibration split" if not result.calibrate_on else f"calibration split with {result.calibrate_on}"
    col = metric_column(metric, result.n_classes)
    return ShiftCurveData(sev, panels, titles, values, low, high, metric, result.n_classes, result.n_bins,
                          float(result.settings.get("intervals", {}).get("level", 0.95)),
                          f"{col.title} under distribution shift, {result.model.get('name')} (fitted on the {on})")


def _shift_colour(method: str, i: int) -> str:
    """A method's colour in figures (the registry's, :mod:`nctv.methods`; the app's pages use the
    same); a row the registry does not hold takes the ``i``-th of a fixed cycle."""
    from nctv.methods import colour

    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
    return colour(method, palette[i % len(palette)])


def shift_figure(data: ShiftCurveData, backend: str = "matplotlib", per_row: int = 3):
    """One panel per corruption plus the mean over corruptions: the metric against severity, one line per
    method with its interval as a band (Ovadia et al.'s figure, with intervals)."""
    col = metric_column(data.metric, data.n_classes)
    if _check_backend(backend) == "plotly":
        return _shift_plotly(data, col, per_row)
    rows, cols = _grid(len(data.panels), per_row)
    fig = _new_figure(3.4 * cols, 2.7 * rows + 0.4)
    axes = np.atleast_1d(fig.subplots(rows, cols, sharex=True)).ravel()
    for ax, panel in zip(axes, data.panels):
        for i, (m, v) in enumerate(data.values[panel].items()):
            c = _shift_colour(m, i)
            ax.plot(data.severities, v * col.scale, marker="o", ms=3, color=c, label=m, lw=1.8 if i else 1.2)
            ax.fill_between(data.severities, data.low[panel][m] * col.scale, data.high[panel][m] * col.scale, color=c,
                            alpha=0.15, linewidth=0)
        ax.set_title(data.titles[panel], fontsize="medium", fontweight="bold" if panel == data.panels[0] else "normal")
        if ax.get_subplotspec().is_first_col():
            ax.set(ylabel=col.label().replace(" ↓", "").replace(" ↑", ""))
        if ax.get_subplotspec().is_last_row() or panel in data.panels[-cols:]:
            ax.set_xlabel("severity")
            ax.tick_params(labelbottom=True)
        ax.set_xticks(data.severities)
        ax.grid(alpha=0.3)
        if data.marked is not None:
            ax.axvline(data.marked, color="black", ls=":", lw=1)
    for ax in axes[len(data.panels):]:
        ax.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 3), fontsize="small", frameon=False)
    fig.suptitle(f"{data.title}; severity 0 = clean; bands: {100 * data.level:g} % intervals", fontsize="medium")
    return fig


def _shift_plotly(data: ShiftCurveData, col: Any, per_row: int):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows, cols = _grid(len(data.panels), per_row)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[data.titles[p] for p in data.panels],
                        horizontal_spacing=0.07, vertical_spacing=0.12)
    for j, panel in enumerate(data.panels):
        r, c = j // cols + 1, j % cols + 1
        for i, (m, v) in enumerate(data.values[panel].items()):
            colour = _shift_colour(m, i)
            lo, hi = data.low[panel][m] * col.scale, data.high[panel][m] * col.scale
            fig.add_trace(go.Scatter(x=np.concatenate([data.severities, data.severities[::-1]]),
                                     y=np.concatenate([hi, lo[::-1]]), fill="toself", fillcolor=colour, opacity=0.15,
                                     line=dict(width=0), hoverinfo="skip", showlegend=False, legendgroup=m), row=r, col=c)
            fig.add_trace(go.Scatter(
                x=data.severities, y=v * col.scale, mode="lines+markers", name=m, legendgroup=m, showlegend=j == 0,
                line=dict(color=colour), customdata=np.stack([lo, hi], 1),
                hovertemplate=(f"{m}<br>severity %{{x:g}}<br>{col.title} %{{y:.2f}} [%{{customdata[0]:.2f}}, "
                               f"%{{customdata[1]:.2f}}]<extra></extra>")), row=r, col=c)
        fig.update_xaxes(title_text="severity", tickvals=list(data.severities), row=r, col=c)
    fig.update_layout(title=data.title, template="plotly_white", height=300 * rows + 80, width=380 * cols,
                      legend=_TOP_LEGEND)
    return fig


def save_figure(fig: Any, path: str | Path, dpi: int = 200, plotlyjs: str | bool = True) -> Path:
    """Write a figure by extension: matplotlib to .png/.pdf/.svg, plotly to .html.

    ``plotlyjs`` is passed to plotly's ``write_html(include_plotlyjs=...)``: True embeds the
    library (the file works offline), "directory" writes one shared ``plotly.min.js`` beside it.
    """
    p = Path(path)
    ext = p.suffix.lower()
    p.parent.mkdir(parents=True, exist_ok=True)
    if hasattr(fig, "savefig"):
        if ext not in (".png", ".pdf", ".svg"):
            raise ValueError(f"A matplotlib figure is saved as .png, .pdf or .svg, not {ext or 'no extension'}.")
        fig.savefig(p, dpi=dpi, bbox_inches="tight")
        return p
    if hasattr(fig, "write_html"):
        if ext in (".html", ".htm"):
            fig.write_html(str(p), include_plotlyjs=plotlyjs, full_html=True)
            return p
        raise ValueError(f"A plotly figure is saved as .html (static {ext} files need the kaleido package); "
                         "draw it with backend='matplotlib' for PNG/PDF.")
    raise ValueError(f"Cannot save an object of type {type(fig).__name__}; expected a matplotlib or plotly figure.")


# --------------------------------------------------------------------------- one picture's confidences


@dataclass(frozen=True)
class PictureConfidenceData:
    """One picture's probability of each class shown (``classes``) under each way of scoring it
    (``ways``: uncalibrated, temperature scaling, …): ``probabilities`` (ways, classes), fractions;
    ``clean`` the same for the clean picture where this one was corrupted (None: not corrupted)."""

    classes: tuple[str, ...]
    ways: tuple[str, ...]
    colours: tuple[str, ...]
    probabilities: np.ndarray
    clean: np.ndarray | None = None
    title: str = "How sure the model is, per class"


def picture_confidence_data(classes: Sequence[str], probabilities: Mapping[str, Sequence[float]],
                            colours: Mapping[str, str] | None = None,
                            clean: Mapping[str, Sequence[float]] | None = None,
                            title: str = "How sure the model is, per class") -> PictureConfidenceData:
    """Check and pack one picture's probabilities: ``probabilities[way]`` one per class of ``classes``
    (from 0 to 1); ``clean``, where given, the clean picture's for the same ways and classes."""
    names = tuple(str(c) for c in classes)
    ways = tuple(probabilities)
    if not names or not ways:
        raise ValueError("A picture's confidences need at least one class and one way of scoring it.")

    def packed(values: Mapping[str, Sequence[float]]) -> np.ndarray:
        if tuple(values) != ways:
            raise ValueError(f"The clean picture's confidences must be given for {', '.join(ways)}.")
        arr = np.asarray([np.asarray(values[w], dtype=np.float64).reshape(-1) for w in ways])
        if arr.shape != (len(ways), len(names)) or not ((arr >= 0) & (arr <= 1)).all():
            raise ValueError(f"Confidences must be probabilities from 0 to 1, one for each of the {len(names)} classes.")
        return arr

    shown = dict(colours or {})
    palette = (GREY, BLUE, "#ff7f0e", GREEN, RED)
    return PictureConfidenceData(names, ways, tuple(shown.get(w, palette[i % len(palette)]) for i, w in enumerate(ways)),
                                 packed(probabilities), None if clean is None else packed(clean), title)


def picture_confidence_figure(data: PictureConfidenceData):
    """A bar per class and way of scoring, the classes top to bottom as given, each bar's percentage
    at its end and, for a corrupted picture, a black mark where the clean picture's bar ended."""
    k, w = len(data.classes), len(data.ways)
    fig = _new_figure(8.0, 1.0 + 0.45 * k * w)
    ax = fig.add_subplot()
    height = 0.8 / w
    for j, (way, colour) in enumerate(zip(data.ways, data.colours)):
        y = np.arange(k) + (j - (w - 1) / 2) * height
        p = data.probabilities[j]
        ax.barh(y, p, height=height, color=colour, edgecolor="black", linewidth=0.5, label=way)
        # The percentage beyond the bar and beyond the clean picture's mark, which it would otherwise cross.
        ends = p if data.clean is None else np.maximum(p, data.clean[j])
        for yi, pi, end in zip(y, p, ends):
            ax.text(end + 0.015, yi, f"{100 * pi:.1f} %", va="center", fontsize="small")
        if data.clean is not None:
            ax.plot(data.clean[j], y, "|", color="black", ms=12, mew=1.5,
                    label="the clean picture's" if j == 0 else None)
    ax.set_yticks(range(k), data.classes)
    ax.set(xlim=(0, 1.15), ylim=(k - 0.5, -0.5), xlabel="Confidence", title=data.title)
    ax.set_xticks([0, 0.25, 0.5, 0.75, 1], ["0 %", "25 %", "50 %", "75 %", "100 %"])
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small", framealpha=0.9)
    return fig


# --------------------------------------------------------------------------- figures for slides


#: A widescreen slide's own size, 13.33 × 7.5 in (16:9): a figure placed full-slide shows at 1:1, its
#: type at the sizes of :data:`SLIDE_STYLE`.
SLIDE_INCHES = (40 / 3, 7.5)
#: The PNG's resolution: 13.33 × 7.5 in at 144 dpi is 1920 × 1080 pixels, a projector's full HD.
SLIDE_DPI = 144
SLIDE_FORMATS = ("png", "svg", "pdf")
#: Every line, edge and marker of a figure drawn for slides is this many times as thick as in the
#: paper figures (the δ image's pixels and the fills are not lines): a 0.5 pt bar edge becomes 1 pt,
#: a 1.5 pt curve 3 pt, which read from the back of a lecture hall.
SLIDE_LINE_SCALE = 2.0
#: The presenter style (matplotlib rc): 20 pt type (legends and tick labels 16.7 pt, the title 24 pt;
#: about the height of a slide's body text when the figure fills the slide), black ink on white,
#: DejaVu Sans (matplotlib's own font, so the glyphs are the same on every machine). The PDF embeds
#: its fonts as TrueType (``pdf.fonttype`` 42; the default, Type 3, is not a font a slide program
#: can read or search); the SVG draws its text as paths, so it needs no font and holds no reference
#: to anything outside it; ``svg.hashsalt`` makes its ids, and so the file, the same on every save.
SLIDE_STYLE = {
    "font.family": "DejaVu Sans", "font.size": 20, "axes.titlesize": "medium", "axes.labelsize": "medium",
    "xtick.labelsize": "small", "ytick.labelsize": "small", "legend.fontsize": "small",
    "figure.titlesize": "large", "text.color": "black", "axes.labelcolor": "black", "axes.edgecolor": "black",
    "xtick.color": "black", "ytick.color": "black", "axes.linewidth": 1.5, "xtick.major.width": 1.5,
    "ytick.major.width": 1.5, "xtick.major.size": 6, "ytick.major.size": 6, "grid.color": "#8c8c8c",
    "grid.linewidth": 1.0, "figure.facecolor": "white", "axes.facecolor": "white", "savefig.facecolor": "white",
    "legend.edgecolor": "black", "pdf.fonttype": 42, "svg.fonttype": "path", "svg.hashsalt": "nctv-slides",
}


def slide_columns(n: int, most: int = _PER_ROW) -> int:
    """Panels a row for ``n`` panels on a slide: as few rows as hold ``most`` a row, shared out evenly
    (6 panels: two rows of 3, not 5 and 1)."""
    rows = math.ceil(max(n, 1) / most)
    return math.ceil(max(n, 1) / rows)


def slide_figure(draw: Any, *args: Any, **kwargs: Any):
    """``draw(*args, **kwargs)``, a matplotlib figure function of this module, drawn for a slide: in
    :data:`SLIDE_STYLE`, at :data:`SLIDE_INCHES`, its lines :data:`SLIDE_LINE_SCALE` times as thick.
    Write it with :func:`save_slides`."""
    import matplotlib

    with matplotlib.rc_context(SLIDE_STYLE):
        fig = draw(*args, **kwargs)
    if not hasattr(fig, "savefig"):
        raise ValueError("A slide is drawn from a matplotlib figure (backend='matplotlib').")
    fig.set_size_inches(*SLIDE_INCHES)
    _thicken(fig, SLIDE_LINE_SCALE)
    _wrap_titles(fig)
    return fig


def _wrap_titles(fig: Any) -> None:
    """The figure's and its panels' titles broken at spaces into lines that fit their width: at a
    slide's type size a paper figure's one-line titles run off the figure or into each other."""
    import textwrap

    width = fig.get_figwidth() * 72  # points
    titles = [(fig._suptitle, width)] + [(ax.title, ax.get_position().width * width) for ax in fig.axes]
    for title, room in titles:
        if title is None or not title.get_text():
            continue
        # DejaVu Sans averages a little under 0.6 em a character.
        chars = max(8, int(room / (0.6 * title.get_fontsize())))
        title.set_text("\n".join(textwrap.fill(line, chars, break_long_words=False, break_on_hyphens=False)
                                 for line in title.get_text().split("\n")))


def _thicken(fig: Any, k: float) -> None:
    """Lines, edges and markers of the figure's panels and legends ``k`` times as thick (the axes and
    ticks take theirs from the style)."""
    from matplotlib.collections import Collection, PathCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    legends = [ax.get_legend() for ax in fig.axes] + list(fig.legends)
    artists = [a for ax in fig.axes for a in (*ax.lines, *ax.collections, *ax.patches)]
    artists += [h for lg in legends if lg is not None for h in lg.legend_handles if h is not None]
    for a in artists:
        if isinstance(a, Line2D):
            a.set_linewidth(a.get_linewidth() * k)
            a.set_markersize(a.get_markersize() * k)
            a.set_markeredgewidth(a.get_markeredgewidth() * k)
        elif isinstance(a, Collection):
            a.set_linewidths(np.asarray(a.get_linewidths()) * k)
            if isinstance(a, PathCollection):
                a.set_sizes(np.asarray(a.get_sizes()) * k * k)  # sizes are areas
        elif isinstance(a, Patch):
            a.set_linewidth(a.get_linewidth() * k)


def save_slides(fig: Any, stem: str | Path) -> list[Path]:
    """Write a figure drawn by :func:`slide_figure` as ``stem``.png (1920 × 1080), .svg and .pdf, all
    three from the one figure; returns their paths in that order. The files hold no date, so the same
    numbers give the same bytes on every save."""
    import matplotlib

    if not hasattr(fig, "savefig"):
        raise ValueError(f"Cannot save an object of type {type(fig).__name__} for slides; expected a matplotlib figure.")
    base = Path(stem)
    base.parent.mkdir(parents=True, exist_ok=True)
    undated = {"png": None, "svg": {"Date": None}, "pdf": {"CreationDate": None}}
    paths = []
    with matplotlib.rc_context(SLIDE_STYLE):
        for ext in SLIDE_FORMATS:
            path = base.with_name(f"{base.name}.{ext}")
            fig.savefig(path, dpi=SLIDE_DPI, metadata=undated[ext])
            paths.append(path)
    return paths


# --------------------------------------------------------------------------- from experiment results


def gamma_curve_data_from_sweep(sweep: Any, title: str = "Neural Clamping against γ") -> GammaCurveData:
    """Pack a ``studies.GammaSweep`` (or a ``results.GammaSweepResult``) for :func:`gamma_figure`."""
    s = getattr(sweep, "sweep", sweep)
    splits = {"calibration": s.cal, **({"test": s.test} if s.test is not None else {})}
    return gamma_curve_data(
        s.gammas, {k: v["ece"] for k, v in splits.items()}, {k: v["entropy"] for k, v in splits.items()},
        {k: v["loss"] for k, v in splits.items()}, chosen=s.chosen_gamma, n_bins=s.n_bins, fitter=s.fitter, title=title,
        band=None if s.test_low is None else {m: (s.test_low[m], s.test_high[m]) for m in s.test_low},
        level=None if s.intervals is None else s.intervals["level"],
    )


def init_study_data_from_study(study: Any, n_classes: int | None = None,
                               metrics_shown: Sequence[str] = ("entropy", "ece", "aece", "sce")) -> InitStudyData:
    """Pack a ``studies.InitStudy`` (or a ``results.InitStudyResult``, which knows K) for
    :func:`init_study_figure`; the "data" runs are labelled "data-driven"."""
    s = getattr(study, "study", study)
    k = n_classes if n_classes is not None else getattr(study, "n_classes", 2)
    names = {"random": "random", "data": "data-driven"}
    values = {names.get(init, init): {m: s.values(init, m) for m in metrics_shown} for init in s.runs}
    ci = None if s.ci is None else {names.get(init, init): per for init, per in s.ci.items()}
    return init_study_data(values, metrics_shown, k, s.n_bins, s.fitter, ci,
                           None if s.intervals is None else s.intervals["level"])
