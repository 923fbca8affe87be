"""nctv.data: IDX reading, the embedded Fashion-MNIST splits, preprocessing, split selection."""
import gzip
import importlib.metadata
import struct

import numpy as np
import pytest
import torch
from PIL import Image

import nctv.data as d
import nctv.settings as settings

FMNIST_CFG = {"input_size": (1, 28, 28), "interpolation": "bilinear", "mean": (0.2861,), "std": (0.3544,),
              "crop_pct": 1.0, "crop_mode": "center"}


def _array_split(images, labels, cfg=FMNIST_CFG, name="toy"):
    return d.Split(name, d.ArrayImages(images, name), np.arange(len(labels)), labels,
                   [f"c{i}" for i in range(int(max(labels)) + 1)], cfg)


def _write_idx(path, array):
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_read_idx_round_trip(tmp_path, suffix):
    a = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    p = tmp_path / f"x-idx3-ubyte{suffix}"
    _write_idx(p, a)
    np.testing.assert_array_equal(d.read_idx(p), a)


def test_read_idx_rejects_truncated(tmp_path):
    p = tmp_path / "bad"
    p.write_bytes(struct.pack(">HBB", 0, 8, 1) + struct.pack(">I", 10) + b"\x01\x02")
    with pytest.raises(ValueError, match="truncated"):
        d.read_idx(p)


def test_embedded_files_are_the_official_images():
    pools = d.load_pools("fashion-mnist")
    cal_imgs, cal_y = pools.calibration
    test_imgs, test_y = pools.test
    assert cal_imgs.images.shape == (5000, 28, 28) and test_imgs.images.shape == (10000, 28, 28)
    assert cal_imgs.images.dtype == np.uint8 and cal_y.shape == (5000,) and test_y.shape == (10000,)
    assert sorted(np.unique(test_y)) == list(range(10)) and np.bincount(test_y).tolist() == [1000] * 10
    with np.load(d.assets_dir() / "data/fashion-mnist/calibration.npz", allow_pickle=False) as f:
        assert f["source_index"].tolist() == list(range(55000, 60000))
    if not d.FASHION_MNIST_SYSTEM_DIR.exists():
        pytest.skip("the system copy of Fashion-MNIST is not installed")
    full = d.load_fashion_mnist_idx()
    np.testing.assert_array_equal(cal_imgs.images, full["train_images"][55000:])
    np.testing.assert_array_equal(cal_y, full["train_labels"][55000:])
    np.testing.assert_array_equal(test_imgs.images, full["test_images"])
    np.testing.assert_array_equal(test_y, full["test_labels"])


def test_licence_and_attribution_ship_with_the_data():
    folder = d.assets_dir() / "data/fashion-mnist"
    assert "MIT" in (folder / "LICENSE").read_text() and "Zalando" in (folder / "LICENSE").read_text()
    readme = (folder / "README.md").read_text()
    assert "Xiao" in readme and "1708.07747" in readme


def test_vectorised_preprocessing_equals_pil_path_grey():
    imgs = np.random.default_rng(1).integers(0, 256, (20, 28, 28), dtype=np.uint8)
    fast = d.preprocess_arrays(imgs, FMNIST_CFG)
    pil = d.make_preprocess(FMNIST_CFG)
    slow = torch.stack([pil(Image.fromarray(im)) for im in imgs])
    assert torch.equal(fast, slow)
    # closed form for one pixel
    assert fast[3, 0, 4, 5].item() == pytest.approx((imgs[3, 4, 5] / 255 - 0.2861) / 0.3544, abs=1e-6)


def test_vectorised_preprocessing_equals_pil_path_rgb_and_grey_to_rgb():
    cfg = dict(FMNIST_CFG, input_size=(3, 28, 28), mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    rng = np.random.default_rng(2)
    rgb = rng.integers(0, 256, (6, 28, 28, 3), dtype=np.uint8)
    grey = rng.integers(0, 256, (6, 28, 28), dtype=np.uint8)
    pil = d.make_preprocess(cfg)
    for imgs in (rgb, grey):
        slow = torch.stack([pil(Image.fromarray(im)) for im in imgs])
        assert torch.equal(d.preprocess_arrays(imgs, cfg), slow)


def test_vectorised_preprocessing_declines_when_pixels_move():
    imgs = np.zeros((2, 28, 28), np.uint8)
    assert d.preprocess_arrays(imgs, dict(FMNIST_CFG, crop_pct=0.875)) is None
    assert d.preprocess_arrays(imgs, dict(FMNIST_CFG, input_size=(1, 32, 32))) is None
    rgb = np.zeros((2, 28, 28, 3), np.uint8)
    assert d.preprocess_arrays(rgb, FMNIST_CFG) is None  # RGB -> L is PIL's business


def test_split_falls_back_to_pil_when_resizing():
    cfg = dict(FMNIST_CFG, input_size=(1, 32, 32))
    imgs = np.random.default_rng(3).integers(0, 256, (5, 28, 28), dtype=np.uint8)
    s = _array_split(imgs, np.arange(5) % 2, cfg)
    x, _ = s.tensors()
    assert x.shape == (5, 1, 32, 32)
    assert torch.equal(x[2], s.preprocess(Image.fromarray(imgs[2])))
    batches = list(s.loader(batch_size=2))
    assert torch.equal(torch.cat([b[0] for b in batches]), x)


def test_split_basics():
    rng = np.random.default_rng(4)
    imgs = rng.integers(0, 256, (30, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 3, 30)
    s = _array_split(imgs, y)
    assert len(s) == 30 and s.labels.dtype == torch.int64
    np.testing.assert_array_equal(np.asarray(s.image(7)), imgs[7])
    x, yy = s.tensors()
    assert x.shape == (30, 1, 28, 28) and torch.equal(yy, torch.as_tensor(y))
    got = list(s.loader(batch_size=8))
    assert [len(b[1]) for b in got] == [8, 8, 8, 6]
    assert torch.equal(torch.cat([b[0] for b in got]), x)
    with pytest.raises(IndexError):
        s.image(30)


def test_fingerprint_tracks_content():
    rng = np.random.default_rng(5)
    imgs = rng.integers(0, 256, (10, 28, 28), dtype=np.uint8)
    y = np.arange(10) % 3
    a, b = _array_split(imgs, y), _array_split(imgs.copy(), y.copy(), name="other name")
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 64
    y2 = y.copy()
    y2[0] = 2
    assert _array_split(imgs, y2).fingerprint != a.fingerprint
    imgs2 = imgs.copy()
    imgs2[9, 27, 27] ^= 1
    assert _array_split(imgs2, y).fingerprint != a.fingerprint
    assert a.subset(np.arange(5)).fingerprint != a.fingerprint


def test_subsample_sizes_order_and_seeds():
    s = _array_split(np.zeros((100, 28, 28), np.uint8), np.arange(100) % 10)
    a = d.subsample(s, 30, seed=1)
    assert len(a) == 30 and np.all(np.diff(a.indices) > 0)
    assert np.array_equal(d.subsample(s, 30, seed=1).indices, a.indices)
    assert not np.array_equal(d.subsample(s, 30, seed=2).indices, a.indices)
    assert np.array_equal(d.subsample(s, None, seed=5).indices, np.arange(100))
    assert np.array_equal(d.subsample(s, 100, seed=5).indices, np.arange(100))
    with pytest.raises(ValueError, match="holds only 100"):
        d.subsample(s, 101, seed=0)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError):
            d.subsample(s, bad, seed=0)


def test_split_in_half_is_a_seeded_partition():
    s = _array_split(np.zeros((101, 28, 28), np.uint8), np.arange(101) % 10)
    cal, test = d.split_in_half(s, seed=0)
    assert (len(cal), len(test)) == (50, 51)
    assert set(cal.indices).isdisjoint(test.indices)
    assert sorted(set(cal.indices) | set(test.indices)) == list(range(101))
    again = d.split_in_half(s, seed=0)
    assert np.array_equal(again[0].indices, cal.indices)
    assert not np.array_equal(d.split_in_half(s, seed=1)[0].indices, cal.indices)
    with pytest.raises(ValueError):
        d.split_in_half(s.subset(np.arange(1)))


def test_get_splits_embedded_defaults(default_model):
    cal, test = d.get_splits(default_model)
    assert (len(cal), len(test)) == (5000, 10000)
    assert cal.class_names == list(d.FASHION_MNIST_CLASSES)
    # the calibration split comes from the training-set tail, the test split from the test set
    assert cal.source.description.endswith("calibration.npz") and test.source.description.endswith("test.npz")
    assert cal.fingerprint != test.fingerprint


def test_get_splits_sizes_and_seeds(default_model):
    cal, test = d.get_splits(default_model, calibration_size=1000, calibration_seed=3, test_size=2000)
    assert (len(cal), len(test)) == (1000, 2000)
    cal2, test2 = d.get_splits(default_model, calibration_size=1000, calibration_seed=3, test_size=2000)
    assert cal.fingerprint == cal2.fingerprint and test.fingerprint == test2.fingerprint
    cal3, test3 = d.get_splits(default_model, calibration_size=1000, calibration_seed=4, test_size=2000)
    assert cal3.fingerprint != cal.fingerprint
    assert test3.fingerprint == test.fingerprint  # the calibration seed never moves the test split
    with pytest.raises(ValueError, match="holds only 5000"):
        d.get_splits(default_model, calibration_size=6000)


def test_get_splits_rejects_unknown_and_unfit_datasets(default_model):
    with pytest.raises(ValueError, match="Unknown dataset"):
        d.get_splits(default_model, dataset="mnist-ish")
    with pytest.raises(ValueError, match="folder:"):
        d.get_splits(default_model, dataset="imagenet")
    with pytest.raises(ValueError, match="does not exist"):
        d.get_splits(default_model, dataset="folder:/no/such/folder")


def test_hf_dataset_is_offered_only_with_pyarrow(monkeypatch):
    # Installed means a distribution's metadata is there (found independently of the import system).
    try:
        importlib.metadata.distribution("pyarrow")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    assert settings.hub_datasets_available() is installed
    monkeypatch.setattr(d, "hub_datasets_available", lambda: False)
    assert "folder:<path>" in d.dataset_names() and not any(n.startswith("hf-dataset:") for n in d.dataset_names())
    with pytest.raises(ValueError, match="needs the 'pyarrow' package.*pip install pyarrow"):
        d.load_pools("hf-dataset:timm/imagenet-1k-wds@validation")
    with pytest.raises(ValueError, match="Unknown dataset") as unknown:
        d.load_pools("mnist-ish")
    assert "hf-dataset" not in str(unknown.value)
    monkeypatch.setattr(d, "hub_datasets_available", lambda: True)
    assert "hf-dataset:<org/name>[@split]" in d.dataset_names()
    with pytest.raises(ValueError, match="not a Hub dataset id"):
        d.load_pools("hf-dataset:no-org")


def test_folder_label_mapping_rules():
    assert d.folder_label_mapping(["Trouser", "bag"], d.FASHION_MNIST_CLASSES, 10) == {"Trouser": 1, "bag": 8}
    assert d.folder_label_mapping(["0", "7"], d.FASHION_MNIST_CLASSES, 10) == {"0": 0, "7": 7}
    assert d.folder_label_mapping(["b", "a"], ["x", "y"], 2) == {"b": 0, "a": 1}  # given sorted by the caller
    assert d.folder_label_mapping(["n01440764", "n15075141"], [], 1000) == {"n01440764": 0, "n15075141": 999}
    with pytest.raises(ValueError, match="Cannot match"):
        d.folder_label_mapping(["cat", "dog", "eel"], d.FASHION_MNIST_CLASSES, 10)
    with pytest.raises(ValueError, match="beyond"):
        d.folder_label_mapping(["3", "12"], d.FASHION_MNIST_CLASSES, 10)


def test_image_folder_dataset_split_in_halves(tmp_path, default_model):
    rng = np.random.default_rng(6)
    expected = {}
    for cls in ("Sneaker", "Bag", "Trouser"):
        (tmp_path / cls).mkdir()
        for i in range(5):
            arr = rng.integers(0, 256, (28, 28), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / cls / f"{i}.png")
            expected[f"{cls}/{i}.png"] = (arr, d.FASHION_MNIST_CLASSES.index(cls))
    cal, test = d.get_splits(default_model, dataset=f"folder:{tmp_path}", calibration_size=None)
    assert (len(cal), len(test)) == (7, 8)
    seen = set()
    for split in (cal, test):
        x, y = split.tensors()
        for j in range(len(split)):
            path = split.source.paths[split.indices[j]]
            arr, label = expected[f"{path.parent.name}/{path.name}"]
            assert int(y[j]) == label
            assert torch.equal(x[j], default_model.preprocess(Image.fromarray(arr)))
            seen.add(path)
    assert len(seen) == 15
    again = d.get_splits(default_model, dataset=f"folder:{tmp_path}", calibration_size=None)
    assert again[0].fingerprint == cal.fingerprint


def test_folder_roots_allow_only_folders_inside_them(tmp_path, default_model):
    root, outside = tmp_path / "data", tmp_path / "private"
    for cls in ("Bag", "Trouser"):
        (root / "set" / cls).mkdir(parents=True)
        (outside / cls).mkdir(parents=True)
        for i in range(2):
            Image.new("L", (28, 28), 40 * i).save(root / "set" / cls / f"{i}.png")
            Image.new("L", (28, 28), 40 * i).save(outside / cls / f"{i}.png")
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "alias").symlink_to(root / "set", target_is_directory=True)
    roots = [str(root)]
    assert d.allowed_folder(f"{root}/set", roots) == (root / "set").resolve()
    assert d.allowed_folder(f"{root}/alias", roots) == (root / "set").resolve()  # a link that stays inside
    answers = set()
    for refused in (str(outside), f"{root}/link", f"{root}/set/../../private", "/etc", "/no/such/folder",
                    f"{root}/../no-such", "~"):
        with pytest.raises(ValueError) as e:
            d.allowed_folder(refused, roots)
        answers.add(str(e.value))
    assert answers == {d.FOLDERS_REFUSED}  # one sentence, whether the folder exists or not
    with pytest.raises(ValueError, match="NCTV_DATA_ROOTS"):
        d.allowed_folder(f"{root}/set", [])
    # The library and the command line (no roots) read any folder, as before.
    assert d.allowed_folder(str(outside), None) == outside
    cal, test = d.get_splits(default_model, dataset=f"folder:{root}/set", calibration_size=None, folder_roots=roots)
    assert len(cal) + len(test) == 4 and cal.name == f"folder:{root}/set calibration"
    with pytest.raises(ValueError, match="not among them"):
        d.get_splits(default_model, dataset=f"folder:{root}/link", folder_roots=roots)


def test_links_out_of_the_data_roots_inside_an_allowed_folder_are_refused(tmp_path, default_model):
    root, outside = tmp_path / "data", tmp_path / "private"
    for cls in ("Bag", "Trouser"):
        (outside / cls).mkdir(parents=True)
        for i in range(2):
            Image.new("L", (28, 28), 40 * i).save(outside / cls / f"{i}.png")
    (root / "classes").mkdir(parents=True)
    (root / "classes" / "Bag").symlink_to(outside / "Bag", target_is_directory=True)  # a class folder
    (root / "images" / "Bag").mkdir(parents=True)
    (root / "images" / "Bag" / "0.png").symlink_to(outside / "Bag" / "0.png")  # one image
    (root / "inner" / "Bag").mkdir(parents=True)
    Image.new("L", (28, 28), 0).save(root / "inner" / "Bag" / "0.png")
    (root / "inner" / "Trouser").symlink_to(root / "inner" / "Bag", target_is_directory=True)
    roots = [str(root)]
    for name in ("classes", "images"):
        with pytest.raises(ValueError, match="links to files outside the data folders this server allows") as e:
            d.get_splits(default_model, dataset=f"folder:{root}/{name}", calibration_size=None, folder_roots=roots)
        assert str(outside) not in str(e.value)  # the server's layout beyond the typed folder stays unsaid
    # A link that stays inside the roots reads as before, and the command line (no roots) reads links out.
    cal, test = d.get_splits(default_model, dataset=f"folder:{root}/inner", calibration_size=None, folder_roots=roots)
    assert len(cal) + len(test) == 2
    cal, test = d.get_splits(default_model, dataset=f"folder:{root}/classes", calibration_size=None)
    assert len(cal) + len(test) == 2


def test_row_keys_name_each_picture_by_its_content_wherever_it_stands(tmp_path):
    """nctv.data.row_keys: one 128-bit key per row from the picture's own bytes (pixels, a folder file's
    path and size, a row of given inputs), so the same picture has the same key in any split, at any place,
    and two different pictures have different keys; BLAKE2b of the bytes, checked independently."""
    import hashlib

    from nctv.hubdata import EncodedImages
    from nctv.pictures import ArrayImages

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(6, 5, 4), dtype=np.uint8)
    images[4] = images[1]  # one picture twice
    split = d.Split("s", ArrayImages(images, "array"), np.array([0, 1, 2, 3, 4, 5]), np.arange(6) % 3, ["a", "b", "c"],
                    {"input_size": (1, 5, 4), "mean": (0.5,), "std": (0.5,)})
    keys = d.row_keys(split)
    want = np.frombuffer(hashlib.blake2b(images[2].tobytes(), digest_size=16).digest(), dtype="<u8")
    assert keys.shape == (6, 2) and keys.dtype == np.uint64 and np.array_equal(keys[2], want)
    assert np.array_equal(keys[1], keys[4]) and len({tuple(k) for k in keys.tolist()}) == 5
    # Another order of the same pictures: each keeps its key.
    shuffled = split.subset(np.array([5, 3, 1, 0, 2, 4]))
    assert np.array_equal(d.row_keys(shuffled), keys[[5, 3, 1, 0, 2, 4]])
    # Encoded pictures: by their bytes.
    encoded = EncodedImages([b"one", b"two", b"one"], "hub")
    assert np.array_equal(encoded.row_keys(np.array([0, 2]))[0], encoded.row_keys(np.array([0, 2]))[1])
    assert not np.array_equal(*encoded.row_keys(np.array([0, 1])))
    # A folder: by relative path and size (what its fingerprint reads).
    for name, size in (("a/x.png", 3), ("b/x.png", 3), ("a/y.png", 4)):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"\0" * size)
    files = d.FileImages(tmp_path, [tmp_path / "a/x.png", tmp_path / "b/x.png", tmp_path / "a/y.png"], "folder")
    fk = files.row_keys(np.array([0, 1, 2]))
    assert len({tuple(k) for k in fk.tolist()}) == 3
    assert np.array_equal(fk[0], np.frombuffer(hashlib.blake2b(b"a/x.png\0" + b"3", digest_size=16).digest(), dtype="<u8"))
    # Given inputs: by the bytes of each row; a split without content keys has none.
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    tk = d.row_keys(d.TensorSplit(torch.cat([x, x[:1]]), [0, 1, 2, 0]))
    assert np.array_equal(tk[0], tk[3]) and not np.array_equal(tk[0], tk[1])
    assert np.array_equal(tk[1], np.frombuffer(hashlib.blake2b(x[1].numpy().tobytes(), digest_size=16).digest(), dtype="<u8"))
    assert d.row_keys(object()) is None
