"""Corruptions in pixel space (nctv.corruptions), each checked against an independent formula or library:
the noise's measured spread, contrast as a linear map about the mean, brightness against the standard
library's HSV conversion, the Gaussian blur against scipy, JPEG and pixelation against Pillow, the
rotation's angle from the image moments; severity 0 is the clean image, and a corrupted split's
fingerprint (its logits' cache key) names the corruption, severity and seed."""
import colorsys
import io

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import ndimage

from nctv import corruptions as C
from nctv.data import ArrayImages, FileImages, Split, TensorSplit
from nctv.settings import CORRUPTION_NAMES, SHIFT_CORRUPTIONS

CONFIG = {"input_size": (1, 28, 28), "mean": (0.5,), "std": (0.5,), "interpolation": "bilinear", "crop_pct": 1.0}


def grey(n=1, side=28, value=128):
    return np.full((n, side, side), value, dtype=np.uint8)


def rng_images(n, side, channels=None, seed=0):
    shape = (n, side, side) if channels is None else (n, side, side, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_the_registry_is_the_settings_list_and_every_corruption_is_described():
    assert tuple(C.CORRUPTIONS) == CORRUPTION_NAMES
    assert set(SHIFT_CORRUPTIONS) == set(CORRUPTION_NAMES) - {"rotation"}
    for c in C.CORRUPTIONS.values():
        assert len(c.small) == len(c.large) == 5
        text = c.describe()
        assert c.title in text and str(c.small[0]) in text and str(c.large[-1]) in text


@pytest.mark.parametrize("side, severity", [(28, 1), (28, 5), (224, 3)])
def test_gaussian_noise_has_the_spread_it_is_set_to(side, severity):
    # Mid-grey images: clipping at 0 and 255 never bites, so the measured spread is the setting's
    # (plus the rounding to grey levels, whose variance is 1/12 of a level²).
    n = 4000 if side == 28 else 20
    images = grey(n, side)
    out = C.corrupt(images, "gaussian-noise", severity, seed=1)
    sd = C.CORRUPTIONS["gaussian-noise"].value(severity, side)
    measured = (out.astype(np.float64) - images).std() / 255
    expected = np.sqrt(sd**2 + (1 / 255) ** 2 / 12)
    assert abs(measured - expected) < 0.01 * expected
    assert abs((out.astype(np.float64) - images).mean()) / 255 < 0.002  # rounding keeps the mean


def test_shot_noise_is_poisson_with_its_photon_count():
    images = grey(20, 224)
    out = C.corrupt(images, "shot-noise", 2, seed=0)
    photons = C.CORRUPTIONS["shot-noise"].value(2, 224)
    x = 128 / 255
    measured = (out.astype(np.float64) / 255).std()
    assert abs(measured - np.sqrt(x / photons)) < 0.02 * np.sqrt(x / photons)


def test_contrast_is_a_linear_map_about_each_images_mean():
    images = rng_images(50, 28, seed=3)
    for severity in range(1, 6):
        out = C.corrupt(images, "contrast", severity).astype(np.float64)
        factor = C.CORRUPTIONS["contrast"].value(severity, 28)
        mean = images.reshape(50, -1).mean(1)[:, None, None]
        assert np.abs(out - ((images - mean) * factor + mean)).max() <= 0.5 + 1e-9
        # Fitted per image: slope = the factor, and the mean stays where it was.
        x, y = images[0].ravel().astype(np.float64), out[0].ravel()
        slope, intercept = np.polyfit(x, y, 1)
        assert abs(slope - factor) < 0.01
        assert abs(intercept / (1 - slope) - mean[0, 0, 0]) < 0.5


def test_brightness_raises_hsv_value_as_the_standard_library_does():
    images = rng_images(3, 70, channels=3, seed=4)
    step = C.CORRUPTIONS["brightness"].value(2, 70)
    out = C.corrupt(images, "brightness", 2)
    expected = np.empty(images.shape)
    for idx in np.ndindex(images.shape[:3]):
        h, s, v = colorsys.rgb_to_hsv(*(images[idx] / 255.0))
        expected[idx] = colorsys.hsv_to_rgb(h, s, min(v + step, 1.0))
    assert np.abs(out - np.rint(expected * 255)).max() <= 1
    g = grey(1, 28, 100)
    assert C.corrupt(g, "brightness", 5)[0, 0, 0] == round(100 + 0.3 * 255)


def test_gaussian_blur_equals_scipys_filter():
    images = rng_images(4, 80, seed=5)
    for severity in (1, 4):
        sigma = C.CORRUPTIONS["gaussian-blur"].value(severity, 80)
        expected = np.stack([ndimage.gaussian_filter(im / 255.0, sigma, mode="nearest", truncate=4.0) for im in images])
        out = C.corrupt(images, "gaussian-blur", severity)
        assert np.abs(out.astype(np.float64) - np.clip(expected, 0, 1) * 255).max() <= 0.5 + 1e-6


def test_defocus_blur_keeps_flat_images_flat_and_spreads_a_point_over_its_disk():
    flat = grey(2, 100, 77)
    assert np.array_equal(C.corrupt(flat, "defocus-blur", 5), flat)
    point = np.zeros((1, 101, 101), dtype=np.uint8)
    point[0, 50, 50] = 255
    out = C.corrupt(point, "defocus-blur", 3).astype(np.float64)  # radius 6 on images above 64 px
    ys, xs = np.nonzero(out[0] > 0)
    assert 5 <= (xs.max() - xs.min()) / 2 <= 8 and 5 <= (ys.max() - ys.min()) / 2 <= 8
    kernel = C._disk(6, 0.5)
    assert abs(kernel.sum() - 1) < 1e-12 and np.allclose(kernel, kernel.T) and np.allclose(kernel, kernel[::-1])


def test_jpeg_and_pixelation_are_pillows_own_codecs():
    images = rng_images(3, 32, channels=3, seed=6)
    out = C.corrupt(images, "jpeg", 4)
    for im, got in zip(images, out):
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="JPEG", quality=50)
        assert np.array_equal(got, np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB")))
    out = C.corrupt(images, "pixelate", 5)
    for im, got in zip(images, out):
        small = Image.fromarray(im).resize((int(32 * 0.65), int(32 * 0.65)), Image.BOX)
        assert np.array_equal(got, np.asarray(small.resize((32, 32), Image.BOX)))


def test_rotation_turns_a_bar_by_its_angle():
    bar = np.zeros((1, 101, 101), dtype=np.uint8)
    bar[0, 47:54, 15:86] = 255

    def angle(img):
        ys, xs = np.nonzero(img > 127)
        cov = np.cov(np.stack([xs, -ys]).astype(np.float64))
        w, v = np.linalg.eigh(cov)
        return np.degrees(np.arctan2(v[1, -1], v[0, -1])) % 180

    for severity in (2, 5):
        deg = C.CORRUPTIONS["rotation"].value(severity, 101)
        got = angle(C.corrupt(bar, "rotation", severity, seed=0)[0])
        turned = min(abs(got - deg), abs(got - (180 - deg)))
        assert turned < 1.0, (got, deg)


def test_severity_zero_is_the_clean_image_and_every_corruption_is_seeded():
    images = rng_images(6, 28, seed=7)
    for name in CORRUPTION_NAMES:
        assert np.array_equal(C.corrupt(images, name, 0), images)
        a = C.corrupt(images, name, 3, seed=11, keys=[5, 6, 7, 8, 9, 10])
        assert np.array_equal(a, C.corrupt(images, name, 3, seed=11, keys=[5, 6, 7, 8, 9, 10]))
        assert a.shape == images.shape and a.dtype == np.uint8
        # One image alone gets the pixels it gets in a batch: the draws follow its key, not its place.
        assert np.array_equal(a[2:3], C.corrupt(images[2:3], name, 3, seed=11, keys=[7]))
        if C.CORRUPTIONS[name].random:
            assert not np.array_equal(a, C.corrupt(images, name, 3, seed=12, keys=[5, 6, 7, 8, 9, 10]))


def test_bad_names_severities_and_images_are_refused_in_words():
    with pytest.raises(ValueError, match="Unknown corruption"):
        C.corrupt(grey(), "fog", 1)
    for bad in (6, -1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="severity"):
            C.corrupt(grey(), "contrast", bad)
    with pytest.raises(ValueError, match="uint8"):
        C.corrupt(np.zeros((1, 8, 8), np.float32), "contrast", 1)
    assert C.check_corruption("Gaussian noise") == "gaussian-noise"
    assert C.check_corruption("shot_noise") == "shot-noise"


def test_a_corrupted_split_names_its_corruption_in_its_fingerprint_and_reads_the_same_from_a_folder(tmp_path):
    images = rng_images(12, 28, seed=8)
    labels = np.arange(12) % 2
    split = Split("toy", ArrayImages(images, "toy"), np.arange(12), labels, ["a", "b"], CONFIG)
    prints = {split.fingerprint}
    for name in ("gaussian-noise", "contrast"):
        for severity in (1, 2):
            for seed in (0, 1):
                prints.add(C.corrupt_split(split, name, severity, seed).fingerprint)
    assert len(prints) == 1 + 2 * 2 * 2
    assert C.corrupt_split(split, "contrast", 0) is split
    # The same pictures as files: the same corrupted pixels, image by image (keys are dataset indices).
    paths = []
    for i, im in enumerate(images):
        folder = tmp_path / ("a" if labels[i] == 0 else "b")
        folder.mkdir(exist_ok=True)
        paths.append(folder / f"{i:03d}.png")
        Image.fromarray(im).save(paths[-1])
    files = Split("toy files", FileImages(tmp_path, paths, "folder"), np.arange(12), labels, ["a", "b"], CONFIG)
    part = C.corrupt_split(split.subset(np.array([3, 7, 9])), "gaussian-noise", 4, 2)
    from_files = C.corrupt_split(files.subset(np.array([3, 7, 9])), "gaussian-noise", 4, 2)
    for i in range(3):
        assert np.array_equal(np.asarray(part.image(i)), np.asarray(from_files.image(i)))
    x_mem, _ = part.tensors()
    x_file = torch.stack([from_files.preprocess(from_files.image(i)) for i in range(3)])
    assert torch.equal(x_mem, x_file)
    with pytest.raises(ValueError, match="preprocessed tensors"):
        C.corrupt_split(TensorSplit(torch.zeros(4, 1, 8, 8), [0, 1, 0, 1]), "contrast", 1)
