"""The out-of-distribution check (nctv.ood).

Known answers: on Gaussian features with known means and covariance, the score is the Mahalanobis
distance computed here by hand with numpy, the threshold is numpy's quantile of the held-out scores,
and (classes far apart) the score follows the χ distribution with D degrees of freedom, so the 99th
percentile is sqrt(χ²₀.₉₉(D)) from scipy. On the embedded default model, Fashion-MNIST test images
not used for the threshold are flagged at about the stated 1 %, and foreign pictures made here
(colour gradients, noise, checkerboards, a page of text, a drawn face) nearly always.
"""
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from scipy import stats

from nctv.calibration.base import NotFittedError
from nctv.data import get_splits
from nctv.inference import model_logits
from nctv.ood import (LEDOIT_WOLF, MahalanobisDetector, fit_on_splits, ledoit_wolf_shrinkage,
                      penultimate_features)

MEANS = np.array([[0.0, 0.0, 0.0], [40.0, 0.0, 0.0], [0.0, 40.0, 10.0]])
COV = np.array([[4.0, 1.0, 0.5], [1.0, 2.0, 0.3], [0.5, 0.3, 1.0]])


def gaussian(n, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, len(MEANS), n)
    return MEANS[y] + rng.multivariate_normal(np.zeros(3), COV, n), y


def by_hand(f, y, queries, weight=0.0):
    """Smallest Mahalanobis distance of each query to a class mean: class means, the pooled
    within-class covariance (divided by N), shrunk by ``weight`` towards (tr S / D)·I."""
    means = np.stack([f[y == k].mean(0) for k in np.unique(y)])
    centred = f - means[np.searchsorted(np.unique(y), y)]
    s = centred.T @ centred / len(f)
    s = (1 - weight) * s + weight * np.trace(s) / s.shape[0] * np.eye(s.shape[0])
    p = np.linalg.inv(s)
    d = [[np.sqrt((q - m) @ p @ (q - m)) for m in means] for q in queries]
    return np.min(d, axis=1)


@pytest.mark.parametrize("weight", [0.0, 0.3])
def test_score_is_the_hand_computed_mahalanobis_distance(weight):
    f, y = gaussian(500, 0)
    queries = np.random.default_rng(1).normal(0, 30, (50, 3))
    det = MahalanobisDetector(shrinkage=weight).fit(f, y, gaussian(200, 2)[0])
    assert det.score(queries).numpy() == pytest.approx(by_hand(f, y, queries, weight), rel=1e-9)
    assert det.shrinkage_ == weight and det.n_samples_fit_ == 500 and det.n_features_in_ == 3
    assert det.precision_.numpy() @ det.covariance_.numpy() == pytest.approx(np.eye(3), abs=1e-9)


def test_threshold_is_the_stated_quantile_of_held_out_scores():
    f, y = gaussian(3000, 0)
    held_out, _ = gaussian(4000, 1)
    det = MahalanobisDetector(quantile=0.95, shrinkage=0.0).fit(f, y, held_out)
    assert det.threshold_ == pytest.approx(np.quantile(by_hand(f, y, held_out), 0.95), rel=1e-9)
    assert det.is_outlier(held_out).double().mean().item() == pytest.approx(0.05, abs=0.002)


def test_in_distribution_flag_rate_and_threshold_match_the_chi_distribution():
    f, y = gaussian(20000, 0)
    det = MahalanobisDetector().fit(f, y, gaussian(20000, 1)[0])
    # Classes ≥ 10 standard deviations apart: the nearest mean is the own class's, so the score
    # is χ-distributed with 3 degrees of freedom.
    assert det.threshold_ == pytest.approx(np.sqrt(stats.chi2.ppf(0.99, 3)), rel=0.03)
    fresh, _ = gaussian(20000, 3)
    assert det.is_outlier(fresh).double().mean().item() == pytest.approx(0.01, abs=0.003)
    assert det.is_outlier(MEANS + 30.0).all()


def _ledoit_wolf_by_definition(x: np.ndarray) -> float:
    """Ledoit & Wolf's weight for centred rows ``x``, written out from the paper's formulas."""
    s = x.T @ x / len(x)
    m = np.trace(s) / x.shape[1]
    d2 = ((s - m * np.eye(x.shape[1])) ** 2).sum()
    b2 = sum(((np.outer(r, r) - s) ** 2).sum() for r in x) / len(x) ** 2
    return min(b2, d2) / d2


def test_ledoit_wolf_weight_by_its_definition():
    x = np.random.default_rng(0).normal(0, 1, (40, 6)) * np.array([1, 2, 3, 1, 1, 5])
    x -= x.mean(0)
    assert ledoit_wolf_shrinkage(torch.from_numpy(x)) == pytest.approx(_ledoit_wolf_by_definition(x), rel=1e-9)


def test_fewer_images_than_dimensions_need_shrinkage():
    rng = np.random.default_rng(0)
    f, y = rng.normal(0, 1, (20, 50)), np.arange(20) % 2
    det = MahalanobisDetector().fit(f, y, rng.normal(0, 1, (30, 50)))
    # The weight is Ledoit-Wolf's on the features centred within their classes (strictly inside (0, 1) here).
    centred = f - np.stack([f[y == c].mean(0) for c in (0, 1)])[y]
    assert det.shrinkage_ == pytest.approx(_ledoit_wolf_by_definition(centred), rel=1e-9) and det.shrinkage_ < 1
    assert torch.isfinite(det.score(rng.normal(0, 1, (5, 50)))).all()
    with pytest.raises(ValueError, match="singular"):
        MahalanobisDetector(shrinkage=0.0).fit(f, y, f)


def test_clear_errors():
    f, y = gaussian(100, 0)
    with pytest.raises(NotFittedError, match="call fit"):
        MahalanobisDetector().score(f)
    with pytest.raises(NotFittedError, match="call fit"):
        MahalanobisDetector().is_outlier(f)
    bad = [(dict(quantile=1.0), (f, y, f), "quantile"), (dict(shrinkage=2), (f, y, f), "shrinkage"),
           (dict(shrinkage="lw"), (f, y, f), "shrinkage"), ({}, (f[:, 0], y, f), "shape"),
           ({}, (f, y[:50], f), "one class label per image"), ({}, (f, y + 0.5, f), "whole numbers"),
           ({}, (f, y, f[:, :2]), "2 dimensions"), ({}, (np.where(f > 1, np.nan, f), y, f), "finite"),
           ({}, (np.ones_like(f), y, f), "do not vary"), ({}, (f, y, f[:0]), "non-empty")]
    for settings, args, words in bad:
        with pytest.raises(ValueError, match=words):
            MahalanobisDetector(**settings).fit(*args)
    det = MahalanobisDetector().fit(f, y, f)
    with pytest.raises(ValueError, match="same model"):
        det.score(np.zeros((1, 4)))
    assert repr(det) == f"MahalanobisDetector(quantile=0.99, shrinkage={LEDOIT_WOLF!r})"


# --------------------------------------------------------------------------- on a real model


def test_penultimate_features_are_what_the_classifier_reads(default_model):
    x = torch.randn(7, *default_model.input_shape)
    f = penultimate_features(default_model.model, x)
    assert f.shape == (7, default_model.model.num_features)
    # Left in eval mode as found: a model left training would move its BatchNorm statistics on every
    # later forward (the app's shared model, computing its check beside a live run, did).
    assert not default_model.model.training
    # The classifier of the model applied to these features gives the model's logits.
    logits = default_model.model.get_classifier()(f)
    assert torch.allclose(logits, model_logits(default_model.model, x), atol=1e-4)
    plain = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 4))
    assert torch.equal(penultimate_features(plain, x), model_logits(plain, x))


def test_fit_on_splits_caps_the_images_and_refuses_bad_splits():
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5))
    x, y = torch.randn(60, 3, 2, 2), torch.arange(60) % 5
    det = fit_on_splits(plain, (x, y), (x[:40], y[:40]), max_fit_images=30, max_threshold_images=25)
    assert det.n_samples_fit_ == 30 and det.held_out_scores_.numel() == 25 and det.n_features_in_ == 5
    for args, kwargs, words in [(((x, y[:3]), (x, y)), {}, "3 labels"), ((x, (x, y)), {}, "calibration split"),
                                (((x, y), "images"), {}, "held-out split"),
                                (((x, y), (x, y)), dict(max_fit_images=1), "max_fit_images")]:
        with pytest.raises(ValueError, match=words):
            fit_on_splits(plain, *args, **kwargs)


def _gradient(rng):
    yy, xx = np.mgrid[0:200, 0:300] / 300
    channels = [np.sin(rng.uniform(1, 6) * xx + rng.uniform(1, 6) * yy + rng.uniform(0, 6)) / 2 + 0.5 for _ in range(3)]
    a = np.clip(np.stack(channels, -1) + rng.normal(0, 0.05, (200, 300, 3)), 0, 1)
    return Image.fromarray((a * 255).astype(np.uint8))


def _noise(rng):
    return Image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8))


def _checkerboard(rng):
    square = int(rng.integers(4, 57))  # 4 to 56 squares across
    return Image.fromarray(((np.indices((224, 224)) // square).sum(0) % 2 * 255).astype(np.uint8))


def _text_page(rng):
    page = Image.new("L", (300, 400), 255)
    draw = ImageDraw.Draw(page)
    for y in range(20, 380, 30):
        x = 20
        while x < 270:
            word = int(rng.integers(10, 50))
            draw.line([(x, y), (x + word, y + int(rng.integers(-3, 4)))], fill=int(rng.integers(0, 60)),
                      width=int(rng.integers(2, 5)))
            x += word + int(rng.integers(5, 15))
    return page


def _face(rng):
    picture = Image.new("RGB", (256, 256), tuple(int(v) for v in rng.integers(150, 256, 3)))
    draw = ImageDraw.Draw(picture)
    draw.ellipse([50, 30, 206, 226], fill=tuple(int(v) for v in rng.integers(120, 240, 3)), outline=(60, 40, 30), width=3)
    for eye in (95, 160):
        draw.ellipse([eye - 14, 100, eye + 14, 120], fill=(255, 255, 255))
        draw.ellipse([eye - 6, 104, eye + 6, 116], fill=(30, 30, 30))
    draw.line([(128, 120), (120, 160), (135, 160)], fill=(90, 60, 50), width=3)
    draw.arc([90, 160, 166, 200], 20, 160, fill=(150, 30, 30), width=5)
    draw.rectangle([50, 20, 206, 60], fill=(40, 25, 15))
    return picture


FOREIGN = {"colour gradient": _gradient, "colour noise": _noise, "checkerboard": _checkerboard,
           "page of text": _text_page, "drawn face": _face}


@pytest.fixture(scope="module")
def fitted(default_model):
    cal, test = get_splits(default_model)
    half = len(test) // 2
    # The threshold comes from the first half of the test split; the second half stays unseen.
    det = fit_on_splits(default_model.model, cal, test.subset(np.arange(half)), seed=0)
    return det, test.subset(np.arange(half, len(test)))


def test_default_model_flags_about_one_percent_of_unseen_test_images(default_model, fitted):
    det, unseen = fitted
    assert det.n_samples_fit_ == 2000 and det.held_out_scores_.numel() == 1000
    x, _ = unseen.tensors()
    rate = det.is_outlier(penultimate_features(default_model.model, x)).double().mean().item()
    assert 0.003 <= rate <= 0.025, f"{rate:.2%} of unseen test images flagged; the threshold promises about 1 %"


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_default_model_flags_foreign_pictures(default_model, fitted, kind):
    det, _ = fitted
    rng = np.random.default_rng(0)
    # As the app does: a colour picture becomes grey for the grey model, then the model's preprocessing.
    x = torch.stack([default_model.preprocess(FOREIGN[kind](rng).convert("L")) for _ in range(10)])
    flagged = det.is_outlier(penultimate_features(default_model.model, x))
    assert flagged.double().mean().item() >= 0.8, f"only {int(flagged.sum())} of 10 {kind} pictures flagged"


# --------------------------------------------------------------------------- saved detectors

def _saved(tmp_path, weight=0.3):
    from nctv.ood import save_detector

    f, y = gaussian(400, 0)
    h, _ = gaussian(200, 1)
    det = MahalanobisDetector(quantile=0.95, shrinkage=weight).fit(f, y, h)
    path = tmp_path / "ood.safetensors"
    save_detector(det, path, {"model": "m", "dataset": ""})
    return det, path, (f, y, h)


def test_a_saved_detector_scores_as_the_fitted_one_and_by_hand(tmp_path):
    from nctv.ood import load_detector

    det, path, (f, y, h) = _saved(tmp_path)
    back, about = load_detector(path, n_classes=3)
    assert about == {"model": "m", "dataset": ""}
    queries, _ = gaussian(50, 2)
    assert np.allclose(back.score(queries).numpy(), by_hand(f, y, queries, back.shrinkage_), rtol=1e-9)
    assert back.threshold_ == pytest.approx(np.quantile(by_hand(f, y, h, back.shrinkage_), 0.95), rel=1e-9)
    assert torch.equal(back.is_outlier(queries), det.is_outlier(queries))
    assert (back.n_samples_fit_, back.quantile, back.shrinkage_) == (400, 0.95, det.shrinkage_)


def _rewrite(path, change):
    """The saved detector at ``path`` written again after ``change(tensors, metadata)``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    change(tensors, meta)
    save_file(tensors, str(path), metadata=meta)


def _set_meta(key, value):
    return lambda t, m: m.update({key: value})


def _set_tensor(key, fn):
    return lambda t, m: t.update({key: fn(t[key])})


def _asymmetric(c):
    c = c.clone()
    c[0, 1] += 1.0
    return c


CRAFTED = [
    (_set_meta("kind", "other"), "it is not a detector file nctv wrote"),
    (lambda t, m: t.update(extra=torch.zeros(1)), "it is not a detector file nctv wrote"),
    (_set_tensor("means", lambda v: v[:, :2].contiguous()), "shapes do not fit together"),
    (_set_tensor("means", lambda v: v.index_fill(0, torch.tensor([1]), float("nan"))), "must be finite 64-bit"),
    (_set_tensor("covariance", lambda c: c.float()), "must be finite 64-bit"),
    (_set_tensor("covariance", _asymmetric), "covariance is not symmetric"),
    (_set_tensor("covariance", lambda c: -c), "covariance is not positive definite"),
    (_set_tensor("classes", lambda c: torch.tensor([0, 0, 2])), "class labels must be distinct class indices below 3"),
    (_set_tensor("classes", lambda c: torch.tensor([0, 1, 7])), "class labels must be distinct class indices below 3"),
    (_set_tensor("held_out_scores", lambda s: -s), "held-out scores must be distances"),
    (_set_meta("quantile", "nan"), "quantile must be a number from"),
    (_set_meta("quantile", "1.5"), "quantile must be a number from"),
    (_set_meta("shrinkage", "-0.1"), "shrinkage must be a number from 0 to 1"),
    (_set_meta("n_samples_fit", "1.5"), "n_samples_fit must be a whole number"),
    (_set_meta("n_samples_fit", "٣٠"), "n_samples_fit must be a whole number"),
]


@pytest.mark.parametrize("change, words", CRAFTED)
def test_a_crafted_detector_file_is_refused_in_words(tmp_path, change, words):
    from nctv.ood import load_detector

    _, path, _ = _saved(tmp_path)
    _rewrite(path, change)
    with pytest.raises(ValueError, match=r"^The out-of-distribution detector ood\.safetensors cannot be used: .*"
                                         + words):
        load_detector(path, n_classes=3)


def test_a_detector_file_with_a_huge_header_or_no_header_is_refused_unread(tmp_path):
    from nctv.ood import MAX_DETECTOR_HEADER_BYTES, load_detector

    path = tmp_path / "ood.safetensors"
    for head in ((MAX_DETECTOR_HEADER_BYTES + 1).to_bytes(8, "little") + b"{" * 100,  # header past the cap
                 (2**62).to_bytes(8, "little"), b"\x01", b""):
        path.write_bytes(head)
        with pytest.raises(ValueError, match=r"is not a detector file nctv wrote \(its size or header length"):
            load_detector(path)
    path.write_bytes((10).to_bytes(8, "little") + b"not json!!")
    with pytest.raises(ValueError, match="cannot be read as safetensors"):
        load_detector(path)
