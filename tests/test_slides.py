"""Figures and tables for slides: the files themselves (PNG, SVG, PDF; Beamer frames through pdflatex)."""
from __future__ import annotations

import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from nctv import plots, report

SVG = "{http://www.w3.org/2000/svg}"
HEIGHT = 0.6  # the red bar's height, as a share of the blue one's


def _two_bars():
    """A red bar HEIGHT as tall as a blue one beside it (and a title in Greek: text that needs a font)."""
    from matplotlib.figure import Figure

    fig = Figure(layout="constrained")
    ax = fig.add_subplot()
    ax.bar([0, 1], [HEIGHT, 1.0], color=["#ff0000", "#0000ff"], width=0.8)
    ax.set(ylim=(0, 1.2), title="γ = 0.6, δ ± 1", xlabel="Confidence")
    return fig


def _png_spans(path: Path) -> dict[str, tuple[float, float]]:
    """Per colour, the (top, bottom) of its pure pixels as shares of the picture's height, from the top."""
    rgb = np.asarray(Image.open(path).convert("RGB")).astype(int)
    out = {}
    for name, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
        rows = np.flatnonzero((np.abs(rgb - colour).sum(axis=2) == 0).any(axis=1))
        out[name] = (rows[0] / rgb.shape[0], (rows[-1] + 1) / rgb.shape[0])
    return out


def _svg_spans(path: Path) -> dict[str, tuple[float, float]]:
    root = ET.parse(path).getroot()
    height = float(root.get("height").removesuffix("pt"))
    out = {}
    for el in root.iter(SVG + "path"):
        for name, colour in (("red", "#ff0000"), ("blue", "#0000ff")):
            if f"fill: {colour}" in (el.get("style") or ""):
                ys = [float(y) for y in re.findall(r"[ML] [-\d.]+ ([-\d.]+)", el.get("d"))]
                out[name] = (min(ys) / height, max(ys) / height)
    return out


def _pdf_streams(path: Path) -> list[bytes]:
    data = path.read_bytes()
    out = []
    for m in re.finditer(rb"stream\r?\n(.*?)\r?\nendstream", data, re.S):
        try:
            out.append(zlib.decompress(m.group(1)))
        except zlib.error:
            out.append(m.group(1))
    return out


def _pdf_spans(path: Path) -> dict[str, tuple[float, float]]:
    """The rectangles filled after each colour is set, in the page's points (origin at the bottom)."""
    page = next(s for s in _pdf_streams(path) if b" rg" in s).decode("latin-1")
    height = float(re.search(rb"/MediaBox \[ *0 0 [\d.]+ ([\d.]+)", path.read_bytes()).group(1))
    out = {}
    for name, colour in (("red", "1 0 0 rg"), ("blue", "0 0 1 rg")):
        after = page[page.index(colour):]
        path_ops = after[:after.index("\nf")]
        ys = [float(y) for y in re.findall(r"[-\d.]+ ([-\d.]+) [ml]\n", path_ops)]
        out[name] = ((height - max(ys)) / height, (height - min(ys)) / height)
    return out


def test_a_slide_is_written_as_png_svg_and_pdf_drawn_from_the_same_numbers(tmp_path):
    paths = plots.save_slides(plots.slide_figure(_two_bars), tmp_path / "bars")
    assert [p.name for p in paths] == ["bars.png", "bars.svg", "bars.pdf"]
    with Image.open(paths[0]) as png:
        assert png.size == (1920, 1080)  # 16:9, full HD
    spans = {"png": _png_spans(paths[0]), "svg": _svg_spans(paths[1]), "pdf": _pdf_spans(paths[2])}
    for kind, s in spans.items():
        red, blue = s["red"][1] - s["red"][0], s["blue"][1] - s["blue"][0]
        assert red / blue == pytest.approx(HEIGHT, abs=3e-3), kind
        assert s["red"][1] == pytest.approx(s["blue"][1], abs=1e-3), kind  # both stand on the axis
    # The three place the bars alike on the page (a PNG pixel is 1/1080 of its height).
    for name in ("red", "blue"):
        for kind in ("svg", "pdf"):
            assert np.allclose(spans[kind][name], spans["png"][name], atol=2 / 1080), (kind, name)


def test_the_pdf_embeds_its_fonts_and_the_svg_needs_nothing_outside_it(tmp_path):
    png, svg, pdf = plots.save_slides(plots.slide_figure(_two_bars), tmp_path / "bars")
    objects = re.findall(rb"\d+ 0 obj(.*?)endobj", pdf.read_bytes(), re.S)
    fonts = [o for o in objects if re.search(rb"/Type */Font\b", o)]
    descriptors = [o for o in objects if b"/FontDescriptor" in o and b"/Type /FontDescriptor" in o]
    assert fonts and descriptors
    assert not any(b"/Type3" in f for f in fonts)  # TrueType (fonttype 42), not Type 3 glyph procedures
    assert all(b"/FontFile2" in d for d in descriptors)  # every font's program is in the file
    root = ET.parse(svg).getroot()  # valid XML
    assert root.tag == SVG + "svg" and not list(root.iter(SVG + "text"))  # text drawn as paths
    refs = [v for el in root.iter() for k, v in el.attrib.items() if k.endswith("href")]
    assert refs and all(v.startswith(("#", "data:")) for v in refs)
    styles = " ".join(el.get("style") or "" for el in root.iter()) + " ".join(
        el.text or "" for el in root.iter(SVG + "style"))
    assert "@import" not in styles and all(u.startswith("#") for u in re.findall(r"url\(([^)]*)\)", styles))


def test_a_slide_file_depends_on_the_figure_alone(tmp_path):
    first = plots.save_slides(plots.slide_figure(_two_bars), tmp_path / "a")
    again = plots.save_slides(plots.slide_figure(_two_bars), tmp_path / "b")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in again]


def _shipped_reliability():
    from nctv.ui.shipped import load_precomputed

    return plots.reliability_data_from_result(load_precomputed().result, 15)


def test_a_slide_has_presenter_type_and_lines():
    from matplotlib.lines import Line2D
    from matplotlib.text import Text

    data = _shipped_reliability()
    fig = plots.slide_figure(plots.reliability_figure, data, panels=("binned",),
                             per_row=plots.slide_columns(len(data)))
    assert tuple(fig.get_size_inches()) == pytest.approx(plots.SLIDE_INCHES)
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_text().strip()]
    assert min(sizes) >= 13.5 and max(sizes) >= 20  # the paper figure's smallest type is 7 pt
    widths = [a.get_linewidth() for ax in fig.axes for a in (*ax.lines, *ax.patches, *ax.collections)
              if isinstance(a, Line2D) and a.get_linestyle() != "None"]
    assert widths and min(widths) >= 2.0
    paper = plots.reliability_figure(data, panels=("binned",))
    assert [a.get_linewidth() for ax in fig.axes for a in ax.lines] == [
        2 * a.get_linewidth() for ax in paper.axes for a in ax.lines]


def test_slide_columns_share_panels_out_evenly():
    assert [plots.slide_columns(n) for n in (1, 2, 4, 5, 6, 7, 10, 11)] == [1, 2, 4, 5, 3, 4, 5, 4]


def test_reliability_cells_draw_the_panels_asked_for():
    data = _shipped_reliability()
    from nctv.intervals import IntervalSettings

    rng = np.random.default_rng(0)
    one = plots.reliability_data(rng.normal(size=(200, 3)), rng.integers(0, 3, 200), 5, "x",
                                 smooth=IntervalSettings(resamples=100))
    both = plots.reliability_figure([one], panels=("binned", "smooth"), per_row=2)
    assert [ax.get_title() for ax in both.axes if ax.get_title()] == ["x", "x (smoothed)"]
    assert len(plots.reliability_figure(data, panels=("binned",)).axes) == 2 * len(data)
    with pytest.raises(ValueError, match="Unknown reliability panel"):
        plots.reliability_figure(data, panels=("bars",))
    with pytest.raises(ValueError, match="smoothed curve"):
        plots.reliability_figure(data, panels=("smooth",))


# --------------------------------------------------------------------------- tables as Beamer frames


def _tex_ready() -> str | None:
    """Why Beamer documents cannot be compiled here, or None."""
    if shutil.which("pdflatex") is None:
        return ("pdflatex is not installed (Debian: apt-get install texlive-latex-recommended texlive-latex-extra "
                "lmodern)")
    for sty in ("beamer.cls", "booktabs.sty"):
        if not subprocess.run(["kpsewhich", sty], capture_output=True, text=True).stdout.strip():
            return f"{sty} is not installed (Debian: apt-get install texlive-latex-recommended)"
    return None


def compile_beamer(tex: str, folder: Path) -> int:
    """``tex`` compiled by pdflatex in ``folder``: the pages of the PDF made; fails the test with the
    log's end on any error."""
    why = _tex_ready()
    if why is not None:
        pytest.skip(why)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "slides.tex").write_text(tex, encoding="utf-8")
    run = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "slides.tex"], cwd=folder,
                         capture_output=True, text=True, timeout=180)
    log = (folder / "slides.log").read_text(errors="replace")
    assert run.returncode == 0, run.stdout[-3000:]
    assert "Missing character" not in log and not re.search(r"^! ", log, re.M)
    assert (folder / "slides.pdf").stat().st_size > 0
    return int(re.search(r"Output written on slides\.pdf \((\d+) pages?", log).group(1))


def test_a_table_becomes_a_beamer_frame_with_its_notes_under_it():
    t = report.Table("ECE & γ₁ #2_x", [report.metric_column("ece", 10), report.metric_column("sce", 10)],
                     ["Neural Clamping (FL)", "TS 50%"],
                     [[report.Cell(0.74, low=0.0, high=1.04, rank=1, note="consistent with calibrated (p = 0.315)"),
                       report.Cell(0.8108, low=0.6431, high=0.8326)],
                      [report.Cell(1.14, low=0.43, high=1.5, note="consistent with calibrated (p = 0.315)"),
                       report.Cell(0.7621, low=0.5945, high=0.7856, rank=1)]],
                     ["A note: ± 1 %."])
    frame = report.to_beamer(t)
    assert frame.startswith(r"\begin{frame}{ECE \& $\gamma_{1}$ \#2\_x}") and frame.endswith("\\end{frame}\n")
    assert r"\textbf{0.74 [0.00, 1.04]$^{1}$}" in frame and "1.14 [0.43, 1.50]$^{1}$" in frame
    assert frame.count("consistent with calibrated") == 1  # said once, under the table
    assert r"SCE ($\times$10$^{-2}$) $\downarrow$" in frame and "TS 50\\%" in frame
    assert "% A note: $\\pm$ 1 \\%." in frame and all(ch.isascii() for ch in frame)


def test_every_table_of_a_run_compiles_as_a_beamer_frame(tmp_path):
    """slides.tex of the shipped run (written by report.write_tables, as nctv run and the Calibrate tab write
    it): one frame per table of table.tex, and pdflatex makes one page of each."""
    from nctv.ui.shipped import load_precomputed

    paths = report.write_tables(load_precomputed().result, tmp_path / "run")
    tex = (tmp_path / "run" / "slides.tex").read_text(encoding="utf-8")
    frames = tex.count(r"\begin{frame}")
    assert frames == (tmp_path / "run" / "table.tex").read_text().count(r"\begin{table}") >= 4
    assert tmp_path / "run" / "slides.tex" in paths
    assert compile_beamer(tex, tmp_path / "tex") == frames


def test_every_tab_s_tables_compile_as_beamer_frames(tmp_path):
    """slides.tex of the γ sweep, the initialisation study and the shift study as the tabs offer them, and
    of the Learn view at T = 1.5: every frame of all four in one document, one page each."""
    from nctv.ui import gamma, initialisation, shift, slides

    texts = [Path(next(f for f in tab.shipped_view()[3] if f.endswith("slides.tex"))).read_text(encoding="utf-8")
             for tab in (gamma, initialisation, shift)]
    texts.append(Path(slides.learn_figure({"temperature": "1.5", "bins": "10"}, None)[-1]).read_text(encoding="utf-8"))
    frames = [re.search(r"\\begin\{document\}\n(.*)\\end\{document\}", t, re.S).group(1) for t in texts]
    count = sum(f.count(r"\begin{frame}") for f in frames)
    assert count == 1 + 1 + 2 + 1
    doc = texts[0].split(r"\begin{document}")[0] + "\\begin{document}\n" + "".join(frames) + "\\end{document}\n"
    assert compile_beamer(doc, tmp_path) == count


def test_learn_s_figure_is_the_view_at_its_t_and_bins():
    """The Learn control's files: the diagrams and the table at the T and bins sent, from the shipped test
    logits (read from their file here): the table's row at that T holds nctv.metrics' ECE."""
    from safetensors.torch import load_file

    from nctv import metrics
    from nctv.ui import slides
    from nctv.ui.shipped import precomputed_dir

    files = slides.learn_figure({"temperature": "0.8", "bins": "12"}, None)
    assert [Path(f).name for f in files] == ["learn_T0.80_12bins.png", "learn_T0.80_12bins.svg",
                                             "learn_T0.80_12bins.pdf", "slides.tex"]
    tensors = load_file(str(precomputed_dir() / "test_logits.safetensors"))
    z, y = tensors["Uncalibrated"].double(), tensors["labels"]
    row = next(r for r in Path(files[-1]).read_text().splitlines() if r.startswith("T = 0.80 (on screen)"))
    assert [c.strip() for c in row.rstrip("\\ ").split("&")][3] == f"{100 * metrics.ece(z / 0.8, y, 12):.2f}"
    with pytest.raises(ValueError, match="temperature must lie between"):
        slides.learn_figure({"temperature": "9", "bins": "12"}, None)
    with pytest.raises(ValueError, match="did not say what it shows"):
        slides.learn_figure(None, None)


def test_a_shift_condition_s_diagrams_are_the_study_s_bins(tmp_path):
    """Every method's diagram under a condition: the shift study's stored bins and ECE, read from
    shift.json itself; its accuracy and mean confidence the count-weighted means of the bins."""
    import json

    from nctv.ui import slides
    from nctv.ui.shipped import precomputed_dir

    study = json.loads((precomputed_dir() / "shift.json").read_text(encoding="utf-8"))
    method = next(iter(study["reliability"]))
    b = study["reliability"][method]["contrast/3"]
    d = plots.reliability_data_from_bins(method, b["count"], b["confidence"], b["accuracy"], 0.1)
    counts = np.asarray(b["count"])
    np.testing.assert_array_equal(d.counts, counts)
    filled = counts > 0
    acc = np.asarray([np.nan if v is None else v for v in b["accuracy"]], dtype=float)
    assert d.overall_accuracy == pytest.approx((counts[filled] * acc[filled]).sum() / counts.sum())
    assert np.isnan(d.accuracy[~filled]).all() and d.ece == 0.1
    names = [Path(f).name for f in slides.shift_figure({"condition": "contrast/3", "corruption": "contrast"})]
    assert names == [f"shift_contrast-3_{k}.{e}" for k in ("curves", "diagrams") for e in ("png", "svg", "pdf")]
    for bad in ({"condition": "contrast/9", "corruption": "contrast"}, {"condition": "clean", "corruption": "rain"}):
        with pytest.raises(ValueError, match="no such condition"):
            slides.shift_figure(bad)
    with pytest.raises(ValueError, match="one count, mean confidence and accuracy per bin"):
        plots.reliability_data_from_bins("x", [1, 2], [0.5], [0.5, 0.5], 0.0)


def _chart(p_raw=0.9, clean=None):
    bars = [{"method": m, "confidence": p, "clean": clean} for m, p in (("raw", p_raw), ("ts", 0.7), ("nc", 0.6))]
    return [{"name": "Sandal", "bars": bars},
            {"name": "Sneaker", "bars": [dict(b, confidence=round(1 - b["confidence"], 6)) for b in bars]}]


def test_try_s_figure_draws_the_confidences_sent():
    from nctv.ui import slides

    data = plots.picture_confidence_data(["Sandal", "Sneaker"], {"a": [0.9, 0.1], "b": [0.7, 0.3]})
    fig = plots.picture_confidence_figure(data)
    bars = [p for p in fig.axes[0].patches if p.get_height() < 1]  # the bars, not the axes' background
    assert sorted(round(p.get_width(), 9) for p in bars) == [0.1, 0.3, 0.7, 0.9]
    files = slides.try_figure(_chart(clean=0.5))
    assert [Path(f).name for f in files] == ["confidence.png", "confidence.svg", "confidence.pdf"]
    for bad, words in [(None, "No picture"), ([], "No picture"), (_chart() * 8, "at most 15 classes"),
                       (_chart(p_raw=1.5), "from 0 to 1"), (_chart(p_raw=float("nan")), "from 0 to 1"),
                       (_chart(p_raw=True), "from 0 to 1"),
                       ([{"name": "x", "bars": [{"method": "evil", "confidence": 0.5}]}], "one bar for each"),
                       ([{"name": "", "bars": []}], "a name of 1 to"), (["Sandal"], "did not say")]:
        with pytest.raises(ValueError, match=words):
            slides.try_figure(bad)
