"""Figure data objects against hand-computed numbers; every figure renders to PNG / PDF / HTML."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from nctv import metrics, plots
from nctv.calibration.studies import GammaSweep, InitStudy

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _hand_case():
    # Confidences 0.35, 0.5, 0.9, 0.9, 0.7 with correctness T, F, T, F, T; with 5 bins they fall in
    # bins (0.2, 0.4], (0.4, 0.6], (0.8, 1.0], (0.8, 1.0], (0.6, 0.8].
    p = torch.tensor([[0.35, 0.33, 0.32], [0.5, 0.3, 0.2], [0.9, 0.05, 0.05], [0.9, 0.06, 0.04], [0.1, 0.7, 0.2]],
                     dtype=torch.float64)
    return p.log(), torch.tensor([0, 1, 0, 2, 1])


def test_reliability_data_by_hand():
    z, y = _hand_case()
    d = plots.reliability_data(z, y, n_bins=5, method="hand")
    assert d.method == "hand" and d.n == 5 and d.n_bins == 5
    np.testing.assert_allclose(d.edges, [0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert d.counts.tolist() == [0, 1, 1, 1, 2]
    np.testing.assert_allclose(d.confidence[1:], [0.35, 0.5, 0.7, 0.9], atol=1e-12)
    np.testing.assert_allclose(d.accuracy[1:], [1.0, 0.0, 1.0, 0.5])
    assert np.isnan(d.accuracy[0]) and np.isnan(d.confidence[0])
    ece = (0.65 + 0.5 + 0.3 + 2 * 0.4) / 5
    assert d.ece == pytest.approx(ece, abs=1e-12)
    assert d.overall_accuracy == pytest.approx(0.6)
    assert d.mean_confidence == pytest.approx((0.35 + 0.5 + 0.9 + 0.9 + 0.7) / 5)


def test_reliability_data_agrees_with_metrics():
    g = torch.Generator().manual_seed(0)
    z, y = 3 * torch.randn(300, 6, generator=g), torch.randint(0, 6, (300,), generator=g)
    for b in (10, 15, 20):
        d = plots.reliability_data(z, y, b)
        ref = metrics.reliability_bins(z, y, b)
        assert d.ece == pytest.approx(metrics.ece(z, y, b)) and d.ece == pytest.approx(ref.ece)
        np.testing.assert_array_equal(d.counts, ref.counts)
        assert d.counts.sum() == 300


def test_delta_image_data_in_pixel_units():
    g = torch.Generator().manual_seed(1)
    delta = 0.05 * torch.randn(3, 4, 5, generator=g)
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    x = 0.5 * torch.randn(3, 4, 5, generator=g)
    x[0, 0, 0] = (1.0 - mean[0]) / std[0]  # a white pixel: a positive δ there is clipped for display
    delta[0, 0, 0] = 0.3
    d = plots.delta_image_data(delta, mean, std, example=x)
    s = np.array(std)[:, None, None]
    m = np.array(mean)[:, None, None]
    np.testing.assert_allclose(d.delta, 255 * delta.double().numpy() * s, rtol=1e-12)
    ex = np.clip(x.double().numpy() * s + m, 0, 1)
    np.testing.assert_allclose(d.example, ex, rtol=1e-12)
    np.testing.assert_allclose(d.perturbed, np.clip(ex + d.delta / 255, 0, 1), rtol=1e-12)
    np.testing.assert_allclose(d.difference, 255 * (d.perturbed - d.example), atol=1e-9)
    inside = (ex + d.delta / 255 > 0) & (ex + d.delta / 255 < 1)
    np.testing.assert_allclose(d.difference[inside], d.delta[inside], atol=1e-9)
    assert d.difference[0, 0, 0] == pytest.approx(0.0)  # clipped: already white
    np.testing.assert_allclose(d.combined, d.delta.mean(0))
    assert d.limit == pytest.approx(np.abs(d.delta).max())
    assert d.channel_names == ("red", "green", "blue")


def test_delta_sentence_says_how_large_delta_is_in_pixel_levels():
    grey = plots.delta_image_data(torch.tensor([[[0.1, -0.2], [0.0, 0.0]]]), (0.5,), (0.5,))
    assert grey.channel_names == ("brightness",)
    # δ · std · 255: 12.75 and −25.5 grey levels; the mean size over four pixels is 38.25 / 4.
    assert plots.delta_sentence(grey) == (
        "δ is one small pattern added to every picture before the model sees it; its largest change is 25.5 of 255 "
        "grey levels, 10.0 % of the image's range, and on average it changes a pixel by 9.6 grey levels.")
    colour = torch.zeros(3, 2, 2)
    colour[2, 1, 0] = -0.04
    text = plots.delta_sentence(plots.delta_image_data(colour, (0.5,) * 3, (0.25,) * 3))
    assert "largest change is 2.5 of 255 levels (in the blue channel), 1.0 % of the image's range" in text
    assert plots.delta_sentence(plots.delta_image_data(torch.zeros(1, 2, 2), (0.5,), (0.5,))).startswith("δ is zero")


def test_delta_image_data_errors():
    with pytest.raises(ValueError, match="3 channel"):
        plots.delta_image_data(torch.zeros(3, 4, 4), (0.5,) * 2, (0.2,) * 2)
    with pytest.raises(ValueError, match="channels, height, width"):
        plots.delta_image_data(torch.zeros(16), (0.5,), (0.2,))
    with pytest.raises(ValueError, match="example has shape"):
        plots.delta_image_data(torch.zeros(1, 4, 4), (0.5,), (0.2,), example=torch.zeros(1, 5, 5))
    zero = plots.delta_image_data(torch.zeros(1, 2, 2), (0.5,), (0.2,))
    assert zero.limit == 1.0  # a zero δ still gets a valid colour scale


def _sweep():
    g = np.array([0.0, 0.5, 1.0])
    rows = {"ece": np.array([0.03, 0.01, 0.02]), "entropy": np.array([0.2, 0.3, 0.4]), "loss": np.array([0.5, 0.4, 0.3])}
    return GammaSweep(gammas=g, temperature=np.ones(3), weight_decay=np.ones(3), objective=np.ones(3), passes=np.ones(3),
                      cal=rows, test={k: v + 0.01 for k, v in rows.items()}, chosen_gamma=0.5, n_passes=3.0,
                      test_passes=1.5, fitter="fast", n_bins=15)


def _study():
    runs = {"random": [{"entropy": 0.3 + i / 100, "ece": 0.02 + i / 1000, "aece": 0.021, "sce": 0.004} for i in range(3)],
            "data": [{"entropy": 0.31, "ece": 0.015, "aece": 0.016, "sce": 0.0035}] * 3}
    return InitStudy(runs=runs, seeds=[0, 1, 2], fitter="fast", n_passes=10.0, shared_data_fit=True, n_bins=15)


def test_gamma_and_init_data_from_experiment_objects():
    gd = plots.gamma_curve_data_from_sweep(_sweep())
    assert list(gd.ece) == ["calibration", "test"] and gd.chosen == 0.5 and gd.fitter == "fast"
    np.testing.assert_allclose(gd.ece["test"], [0.04, 0.02, 0.03])
    idata = plots.init_study_data_from_study(_study(), n_classes=10)
    assert list(idata.values) == ["random", "data-driven"]
    np.testing.assert_allclose(idata.values["random"]["ece"], [0.02, 0.021, 0.022])
    with pytest.raises(ValueError, match="2 values for 3"):
        plots.gamma_curve_data([0, 0.5, 1], {"cal": [1, 2]}, {}, {})
    with pytest.raises(ValueError, match="no values for metric 'sce'"):
        plots.init_study_data({"random": {"ece": [0.1]}}, metrics_shown=("ece", "sce"))


def _figures():
    z, y = _hand_case()
    g = torch.Generator().manual_seed(0)
    zz, yy = 2 * torch.randn(200, 4, generator=g), torch.randint(0, 4, (200,), generator=g)
    rel = [plots.reliability_data(zz, yy, 15, "A"), plots.reliability_data(zz / 2, yy, 15, "B")]
    delta = plots.delta_image_data(0.1 * torch.randn(3, 6, 6, generator=g), (0.5,) * 3, (0.25,) * 3,
                                   example=torch.randn(3, 6, 6, generator=g))
    return {
        "reliability": (plots.reliability_figure, rel),
        "confidence": (plots.confidence_figure, rel),
        "delta": (plots.delta_figure, delta),
        "delta-grey": (plots.delta_figure, plots.delta_image_data(torch.randn(1, 5, 5), (0.5,), (0.25,))),
        "gamma": (plots.gamma_figure, plots.gamma_curve_data_from_sweep(_sweep())),
        "init": (plots.init_study_figure, plots.init_study_data_from_study(_study(), n_classes=10)),
    }


@pytest.mark.parametrize("name", ["reliability", "confidence", "delta", "delta-grey", "gamma", "init"])
def test_figures_render_png_pdf_html(name, tmp_path):
    fn, data = _figures()[name]
    fig = fn(data, backend="matplotlib")
    png = plots.save_figure(fig, tmp_path / f"{name}.png", dpi=40)
    raw = png.read_bytes()
    assert raw.startswith(PNG_MAGIC)
    with Image.open(io.BytesIO(raw)) as im:
        im.load()
        assert im.width > 50 and im.height > 50
    pdf = plots.save_figure(fig, tmp_path / f"{name}.pdf")
    assert pdf.read_bytes().startswith(b"%PDF") and pdf.stat().st_size > 1000
    html = plots.save_figure(fn(data, backend="plotly"), tmp_path / f"{name}.html", plotlyjs="directory")
    text = html.read_text()
    assert "<html>" in text and "Plotly.newPlot" in text and (tmp_path / "plotly.min.js").exists()


def test_reliability_hover_shows_bin_numbers():
    z, y = _hand_case()
    d = plots.reliability_data(z, y, 5, "hand")
    fig = plots.reliability_figure(d, backend="plotly")
    hover = fig.data[0].hovertext
    # 1 right of 2: the 95 % Wilson interval of the bin's accuracy is [0.0945, 0.9055].
    assert hover[4] == "bin (0.800, 1.000]<br>count 2<br>accuracy 0.5000 [0.0945, 0.9055]<br>confidence 0.9000"
    assert hover[0] == "bin [0.000, 0.200]<br>count 0 (empty)"
    assert any("ECE = 45.00%" in a.text for a in fig.layout.annotations)


def test_wrap_title_breaks_at_spaces_within_the_width():
    assert plots.wrap_title("Neural Clamping (FL)", 14) == "Neural<br>Clamping (FL)"
    assert plots.wrap_title("Dir-ODIR", 14) == "Dir-ODIR"
    assert plots.wrap_title("a b c d e f", 1, lines=3) == "a<br>b<br>c d e f"  # the last line takes the rest
    assert plots.wrap_title("", 14) == ""


def test_interactive_panel_titles_sit_over_their_own_panels():
    z, y = _hand_case()
    names = ["Uncalibrated", "Temperature Scaling", "TS by Grid Search", "Vector Scaling", "Matrix Scaling",
             "MS-ODIR", "Dir-ODIR", "Neural Clamping (FL)", "NC δ frozen at 0"]
    fig = plots.reliability_figure([plots.reliability_data(z, y, 5, n) for n in names], backend="plotly")
    titles = [a for a in fig.layout.annotations if a.name == "panel-title"]
    assert [t.text.replace("<br>", " ") for t in titles] == names
    assert all(len(line) <= 14 for t in titles for line in t.text.split("<br>") if " " in line)
    per_row = plots.PLOTLY_PER_ROW
    for k, t in enumerate(titles):
        r, c = divmod(k, per_row)
        diagram = fig.get_subplot(2 * r + 1, c + 1)
        x0, x1 = diagram.xaxis.domain
        assert x0 < t.x < x1 and t.y == pytest.approx(diagram.yaxis.domain[1])  # centred on, and just above, it
        counts = fig.get_subplot(2 * r + 2, c + 1).yaxis.domain
        assert counts[1] < diagram.yaxis.domain[0]  # the count histogram below, apart
        if r:  # clear of the row above: its counts end well below this title's room
            above = fig.get_subplot(2 * r, c + 1).yaxis.domain
            assert above[0] - diagram.yaxis.domain[1] > 0.15 / 3


def test_save_figure_errors(tmp_path):
    z, y = _hand_case()
    d = plots.reliability_data(z, y, 5)
    with pytest.raises(ValueError, match="kaleido"):
        plots.save_figure(plots.reliability_figure(d, backend="plotly"), tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"\.png, \.pdf or \.svg"):
        plots.save_figure(plots.reliability_figure(d), tmp_path / "x.html")
    with pytest.raises(ValueError, match="backend"):
        plots.reliability_figure(d, backend="bokeh")
    with pytest.raises(ValueError, match="Nothing to draw"):
        plots.reliability_figure([])


def _peaked(n=1500, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    return 3 * torch.randn(n, 4, generator=g) + 4 * torch.nn.functional.one_hot(y, 4), y


def test_smoothed_diagram_with_its_band_beside_the_binned_one():
    from nctv.intervals import IntervalSettings, smooth_band

    z, y = _peaked()
    d = plots.reliability_data(z, y, 15, "A", smooth=IntervalSettings(level=0.9, resamples=200, seed=2))
    conf, pred = metrics.confidences_and_predictions(z)
    band = smooth_band(conf, pred == y.numpy(), level=0.9, resamples=200, seed=2)
    assert np.array_equal(d.smooth.low, band.low) and np.array_equal(d.smooth.high, band.high)
    assert d.smooth.smooth_ece == pytest.approx(metrics.smooth_ece(z, y), abs=1e-12)
    assert plots.reliability_data(z, y, 15).smooth is None  # only when asked for

    fig = plots.reliability_figure([d, plots.reliability_data(z / 2, y, 15, "B")])
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[:5] == ["A", "", "A (smoothed)", "", "B"] and len(fig.axes) == 6  # B has no smoothed panel
    smoothed = fig.axes[2]
    curve = smoothed.lines[0].get_ydata()
    dense = d.smooth.density >= 0.01 * d.smooth.density.max()
    assert np.array_equal(curve[dense], d.smooth.accuracy[dense]) and np.isnan(curve[~dense]).all()
    assert any(f"smECE = {100 * d.smooth.smooth_ece:.2f}%" in t.get_text() for t in smoothed.texts)

    ply = plots.reliability_figure(d, backend="plotly")
    named = {t.name: t for t in ply.data if t.name}
    assert set(named) >= {"Accuracy", "90 % band", "Smoothed accuracy", "Density"}
    y_band = named["90 % band"].y
    assert np.allclose(y_band[:dense.sum()], d.smooth.high[dense]) and np.allclose(y_band[dense.sum():], d.smooth.low[dense][::-1])
    titles = [a.text.replace("<br>", " ") for a in ply.layout.annotations if a.name == "panel-title"]
    assert titles == ["A", "A (smoothed)"]


def test_smoothed_diagrams_of_a_run_use_its_interval_settings():
    from types import SimpleNamespace

    from nctv.intervals import smooth_band

    z, y = _peaked(800, 3)
    run = SimpleNamespace(methods={"TS": SimpleNamespace(test_logits=z)}, test_labels=y,
                          settings={"intervals": {"level": 0.8, "resamples": 150, "seed": 7, "method": "m"}})
    (d,) = plots.reliability_data_from_result(run, 15, smooth=True)
    conf, pred = metrics.confidences_and_predictions(z)
    assert np.array_equal(d.smooth.low, smooth_band(conf, pred == y.numpy(), level=0.8, resamples=150, seed=7).low)
    assert (d.smooth.level, d.smooth.resamples) == (0.8, 150)
    assert plots.reliability_data_from_result(run, 15)[0].smooth is None


def test_study_figures_draw_the_test_split_intervals():
    sweep = _sweep()
    sweep.test_low = {"ece": np.array([0.03, 0.01, 0.02]), "entropy": np.array([0.2, 0.3, 0.4])}
    sweep.test_high = {"ece": np.array([0.05, 0.03, 0.04]), "entropy": np.array([0.3, 0.4, 0.5])}
    sweep.intervals = {"level": 0.95, "resamples": 100, "seed": 0, "method": "m"}
    data = plots.gamma_curve_data_from_sweep(sweep)
    fig = plots.gamma_figure(data, backend="plotly")
    bands = [t for t in fig.data if t.name == "test, 95 % interval"]
    assert len(bands) == 2  # ECE and entropy; the loss has none
    np.testing.assert_allclose(bands[0].y, [5, 3, 4, 2, 1, 3])  # high along γ, then low back, in %
    mpl = plots.gamma_figure(data)
    assert len(mpl.axes[0].collections) == 1 and len(mpl.axes[2].collections) == 0
    with pytest.raises(ValueError, match="band has 2 and 2 values for 3"):
        plots.gamma_curve_data([0, 0.5, 1], {}, {}, {}, band={"ece": ([0, 1], [1, 2])})

    study = _study()
    study.ci = {init: {m: [0.5 * r[0][m], 2 * r[0][m]] for m in r[0]} for init, r in study.runs.items()}
    study.intervals = {"level": 0.9, "resamples": 100, "seed": 0, "method": "m"}
    idata = plots.init_study_data_from_study(study, n_classes=10)
    assert idata.ci["data-driven"]["ece"] == (0.0075, 0.03)
    fig = plots.init_study_figure(idata, backend="plotly")
    means = [t for t in fig.data if t.name == "mean, 90 % interval"]
    ece = means[2]  # entropy's two, then ECE's: random first
    assert ece.y[0] == pytest.approx(2.1) and ece.error_y.array[0] == pytest.approx(4.0 - 2.1)
    assert ece.error_y.arrayminus[0] == pytest.approx(2.1 - 1.0)
    with pytest.raises(ValueError, match="No interval for random/sce"):
        plots.init_study_data({"random": {"ece": [0.1], "sce": [0.2]}}, ("ece", "sce"), ci={"random": {"ece": [0, 1]}})
