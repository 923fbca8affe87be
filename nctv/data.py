"""Datasets, preprocessing and calibration/test splits.

Every model is calibrated on a *calibration split* and judged on a disjoint *test split*; both are
drawn here, reproducibly, from a named dataset:

* ``"fashion-mnist"`` (embedded, offline): the calibration pool is the last 5,000 images of the
  official training set (never used to train the embedded models), the test split is the official
  10,000 test images. Both ship in ``assets/data/fashion-mnist/`` as compressed ``.npz`` of uint8.
* ``"bloodmnist"`` (MedMNIST v2, downloaded once from the Hugging Face Hub): calibration pool = the
  official validation split (1,712 images), test = the official test split (3,421 images), as in
  the paper.
* ``"cifar100"``: a public pretrained classifier has usually seen all 50,000 training images, so the
  official 10,000 test images are split in two halves, calibration and test (the paper's ImageNet
  protocol). Read from torchvision's copy where one is in the cache folder, else from the Hub's
  ``uoft-cs/cifar100`` (one parquet file, about 23 MB, downloaded once). ``"cifar100-train-tail"``
  follows the paper's CIFAR-100 protocol instead (calibration = training images 45,000–49,999, test = the official test set) and
  suits models trained on the first 45,000 training images only.
* ``"folder:<path>"``: any labelled image folder in the ImageFolder layout (one sub-folder per
  class), split in halves. ImageNet's validation set in synset folders is the paper's ImageNet
  protocol (25,000 calibration + 25,000 test images).
* ``"imagenet"``: ImageNet-1k validation from the Hub (``"imagenet-1k"``: ``timm/imagenet-1k-wds``,
  gated, needs a token) where a Hugging Face token is set, else ``"imagenette"`` (its public 10-class
  subset, labels mapped to ImageNet's indices), split in halves; only the shards the sizes need are
  downloaded (:mod:`nctv.hubdata`).
* ``"hf-dataset:<org/name>[@split]"``: a Hub repository of parquet or webdataset shards (no loading
  script; gated sets need a token), split in halves, reading only the shards the sizes need.

Conventions: labels are int64 class indices of the *model's* output; sizes are numbers of images;
a calibration subsample is drawn from its pool by ``numpy.random.default_rng(calibration_seed)``
and kept in pool order, so asking for the whole pool gives the pool whatever the seed. The test
split depends only on ``split_seed`` and ``test_size``: changing ``calibration_seed`` never changes
the test split. Preprocessing is the model's own (timm data config); inputs are float32 tensors
(C, H, W).
"""
from __future__ import annotations

import gzip
import hashlib
import os
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from nctv.checks import check_text, shown
from nctv.hub import hub_file
from nctv.inference import DEFAULT_BATCH_SIZE
from nctv.pictures import (ArrayImages, _keeps_geometry, image_mode, make_preprocess,  # noqa: F401 (nctv.data's API)
                           pil_from_array, preprocess_arrays)
from nctv.settings import DEFAULT_CALIBRATION_SIZE, hub_datasets_available

FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
BLOODMNIST_CLASSES = (
    "basophil", "eosinophil", "erythroblast", "immature granulocyte",
    "lymphocyte", "monocyte", "neutrophil", "platelet",
)
FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
BLOODMNIST_HUB = ("albertvillanova/medmnist-v2", "data/bloodmnist.npz")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
# tensors() materialises a whole split; beyond this it would exhaust a laptop's memory.
MAX_TENSOR_BYTES = 2 * 1024**3


def assets_dir() -> Path:
    """The shipped assets folder (``$NCTV_ASSETS_DIR`` overrides the repository's ``assets/``)."""
    env = os.environ.get("NCTV_ASSETS_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "assets"


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """Where downloaded datasets go: ``path``, else ``$NCTV_CACHE_DIR``, else ``~/.cache/nctv``."""
    if path is not None:
        return Path(path)
    env = os.environ.get("NCTV_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "nctv"


# ----------------------------------------------------------------------------- image sources

class FileImages:
    """Images read from files on demand (a folder in the ImageFolder layout)."""

    def __init__(self, root: Path, paths: Sequence[Path], description: str):
        self.root = root
        self.paths = list(paths)
        self.description = description

    def __len__(self) -> int:
        return len(self.paths)

    def pil(self, i: int) -> Image.Image:
        with Image.open(self.paths[i]) as im:
            im.load()
            return im

    def digest(self, indices: np.ndarray) -> bytes:
        # Relative paths and sizes identify a folder's content without reading every image.
        h = hashlib.sha256()
        for i in indices:
            p = self.paths[int(i)]
            h.update(f"{p.relative_to(self.root).as_posix()}\0{p.stat().st_size}\n".encode())
        return h.digest()

    def row_keys(self, indices: np.ndarray) -> np.ndarray:
        """Each picture's identity as the fingerprint reads it: its relative path and size
        (:func:`nctv.canonical.content_keys`)."""
        from nctv.canonical import content_keys

        def row(i: int) -> bytes:
            p = self.paths[i]
            return f"{p.relative_to(self.root).as_posix()}\0{p.stat().st_size}".encode()

        return content_keys(row(int(i)) for i in indices)


# ----------------------------------------------------------------------------- Split

class _PILDataset(torch.utils.data.Dataset):
    def __init__(self, split: "Split"):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int):
        return self.split.preprocess(self.split.image(i)), self.split.labels[i]


class _ArrayBatches(torch.utils.data.IterableDataset):
    """Batches of an in-memory split preprocessed one batch at a time (vectorised), in split order."""

    def __init__(self, split: "Split", batch_size: int):
        self.split, self.batch_size = split, batch_size

    def __len__(self) -> int:
        return -(-len(self.split) // self.batch_size)

    def __iter__(self):
        s = self.split
        for start in range(0, len(s), self.batch_size):
            rows = s.indices[start:start + self.batch_size]
            yield preprocess_arrays(s.source.images[rows], s.data_config), s.labels[start:start + self.batch_size]


class Split:
    """A labelled set of images, preprocessed for one model.

    ``labels`` (N,) int64 are class indices of the model's output; ``class_names`` their names.
    ``tensors()`` gives all preprocessed inputs at once (small splits); ``loader()`` streams them;
    ``image(i)`` is the raw image as a PIL image. ``fingerprint`` is a SHA-256 (hex) of the labels and
    the image content (pixel bytes for in-memory images; relative paths and file sizes for folders),
    so two splits with the same fingerprint hold the same data in the same order.
    """

    def __init__(self, name: str, images: Any, indices: np.ndarray, labels: np.ndarray,
                 class_names: Sequence[str], data_config: dict):
        indices = np.asarray(indices, dtype=np.int64)
        labels = np.asarray(labels, dtype=np.int64)
        if indices.shape != labels.shape or indices.ndim != 1:
            raise ValueError("indices and labels must be 1-D and of equal length.")
        self.name = name
        self.source = images
        self.indices = indices
        self.labels = torch.from_numpy(labels.copy())
        self.class_names = list(class_names)
        self.data_config = dict(data_config)
        self.preprocess = make_preprocess(self.data_config)
        self._tensors: torch.Tensor | None = None
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def __repr__(self) -> str:
        return f"Split({self.name!r}, n={len(self)}, classes={len(self.class_names)}, source={self.source.description!r})"

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(self.source.digest(self.indices))
            h.update(self.labels.numpy().astype("<i8").tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def row_keys(self) -> np.ndarray | None:
        """(N, 2) uint64: each picture's identity by its content (``source.row_keys``), or None where the
        source cannot tell it. The same on every machine, unlike the logits a model computes from it."""
        keys = getattr(self.source, "row_keys", None)
        return None if keys is None else keys(self.indices)

    def image(self, i: int) -> Image.Image:
        """Raw image ``i`` of the split (before any preprocessing)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"image index {i} out of range for a split of {len(self)} images.")
        return self.source.pil(int(self.indices[i]))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Raw uint8 images and int64 labels of an in-memory split (for training)."""
        if not isinstance(self.source, ArrayImages):
            raise ValueError(f"Split {self.name!r} is read from files; raw arrays exist only for in-memory datasets.")
        return self.source.images[self.indices], self.labels.numpy()

    def _fast_tensors(self) -> torch.Tensor | None:
        if not isinstance(self.source, ArrayImages) or len(self) == 0:
            return None
        x = preprocess_arrays(self.source.images[self.indices], self.data_config)
        # The vectorised path must agree with the PIL path; one image confirms the arithmetic.
        if x is not None and not torch.equal(x[0], self.preprocess(self.image(0))):
            return None
        return x

    def tensors(self, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """All preprocessed inputs (N, C, H, W) float32 and labels (N,) int64, cached."""
        if self._tensors is None:
            need = self._tensor_bytes()
            if need > MAX_TENSOR_BYTES:
                raise ValueError(
                    f"Split {self.name!r} would take {need / 1024**3:.1f} GiB as one tensor; use split.loader() instead."
                )
            x = self._fast_tensors()
            if x is None:
                from tqdm.auto import tqdm

                items = (self.preprocess(self.image(i)) for i in range(len(self)))
                x = torch.stack(list(tqdm(items, total=len(self), desc=f"preprocessing {self.name}", disable=not progress)))
            self._tensors = x
        return self._tensors, self.labels

    def loader(self, batch_size: int = 512, num_workers: int = 0) -> torch.utils.data.DataLoader:
        """DataLoader of ``(inputs, labels)`` batches in split order (no shuffling). In-memory images
        too many for one tensor (:data:`MAX_TENSOR_BYTES`) are preprocessed batch by batch."""
        if self._tensors is not None or (self._fast_tensors_possible() and self._tensor_bytes() <= MAX_TENSOR_BYTES):
            x, y = self.tensors()
            ds: torch.utils.data.Dataset = torch.utils.data.TensorDataset(x, y)
        elif self._fast_tensors_possible() and self._fast_tensors_agree():
            return torch.utils.data.DataLoader(
                _ArrayBatches(self, batch_size), batch_size=None, shuffle=False, num_workers=num_workers)
        else:
            ds = _PILDataset(self)
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False, num_workers=num_workers)

    def _tensor_bytes(self) -> int:
        c, h, w = (int(v) for v in self.data_config["input_size"])
        return len(self) * c * h * w * 4

    def _fast_tensors_agree(self) -> bool:
        """Whether the vectorised preprocessing equals the PIL path (checked on the first image)."""
        x = preprocess_arrays(self.source.images[self.indices[:1]], self.data_config)
        return x is not None and torch.equal(x[0], self.preprocess(self.image(0)))

    def _fast_tensors_possible(self) -> bool:
        if not isinstance(self.source, ArrayImages):
            return False
        imgs = self.source.images
        return _keeps_geometry(self.data_config, imgs.shape[1], imgs.shape[2])

    def subset(self, positions: np.ndarray, name: str | None = None) -> "Split":
        """The split restricted to ``positions`` (indices into this split, kept in the given order)."""
        positions = np.asarray(positions, dtype=np.int64)
        return Split(name or self.name, self.source, self.indices[positions], self.labels.numpy()[positions],
                     self.class_names, self.data_config)


class TensorSplit:
    """A split given as preprocessed inputs (N, ...) and labels (N,): the minimal split interface
    (``name``, ``labels``, ``fingerprint`` of the content, ``loader(batch_size)`` in order)."""

    def __init__(self, inputs: Any, labels: Any, name: str = "split"):
        x = torch.as_tensor(inputs)
        y = torch.as_tensor(np.asarray(labels)).long().reshape(-1)
        if x.ndim < 2 or x.shape[0] != y.shape[0]:
            raise ValueError(f"A split needs inputs (N, ...) and N labels; got inputs {tuple(x.shape)} and "
                             f"{y.shape[0]} labels.")
        self.name, self.inputs, self.labels = name, x, y
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            h = hashlib.sha256(f"{tuple(self.inputs.shape)}|{self.inputs.dtype}".encode())
            h.update(self.inputs.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            h.update(self.labels.numpy().astype("<i8").tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def row_keys(self) -> np.ndarray:
        """(N, 2) uint64: each row's identity by the bytes of its inputs."""
        from nctv.canonical import content_keys

        rows = self.inputs.detach().cpu().contiguous().reshape(len(self), -1)
        return content_keys(r.view(torch.uint8).numpy().tobytes() for r in rows)

    def loader(self, batch_size: int = DEFAULT_BATCH_SIZE) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.inputs, self.labels),
                                           batch_size=batch_size, shuffle=False)


def row_keys(split: Any) -> np.ndarray | None:
    """(N, 2) uint64: the identity of each row of ``split`` by its content (a picture's pixels, file or
    encoded bytes, a row of given inputs), or None for a split that cannot tell it. A run draws its
    resamples of the test split in the order of these keys (nctv.intervals.resample_counts_for)."""
    keys = getattr(split, "row_keys", None)
    if keys is None:
        return None
    out = keys()
    if out is not None and (out.ndim != 2 or len(out) != len(split.labels)):
        raise ValueError(f"row_keys of a split must be one row per sample; got {out.shape}.")
    return out


def as_split(split: Any, name: str) -> Any:
    """A split object as given (anything with ``labels``, ``fingerprint``, ``loader``), or a
    :class:`TensorSplit` from an ``(inputs, labels)`` pair."""
    if all(hasattr(split, a) for a in ("labels", "fingerprint", "loader")):
        return split
    if isinstance(split, (tuple, list)) and len(split) == 2:
        return TensorSplit(split[0], split[1], name)
    raise ValueError(f"The {name} split must be a Split from nctv.data.get_splits or a pair (inputs, labels).")


def subsample(split: Split, size: int | None, seed: int, name: str | None = None) -> Split:
    """``size`` images of ``split`` chosen by ``default_rng(seed)``, kept in split order.

    ``size=None`` or the split's length returns all of it.
    """
    n = len(split)
    if size is None or size == n:
        return split.subset(np.arange(n), name)
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"A split size must be a positive whole number or None (all); got {size!r}.")
    if size > n:
        raise ValueError(f"Asked for {size} images but the pool {split.name!r} holds only {n}; ask for at most {n}.")
    chosen = np.sort(np.random.default_rng(seed).permutation(n)[:size])
    return split.subset(chosen, name)


def split_in_half(dataset: Split, seed: int = 0) -> tuple[Split, Split]:
    """The paper's ImageNet protocol: one labelled set → (calibration half, test half).

    A permutation from ``default_rng(seed)`` decides the halves; each half keeps the original order.
    With an odd count the test half gets the extra image.
    """
    n = len(dataset)
    if n < 2:
        raise ValueError(f"Cannot split {n} image(s) in half; the dataset needs at least 2 labelled images.")
    perm = np.random.default_rng(seed).permutation(n)
    first, second = np.sort(perm[: n // 2]), np.sort(perm[n // 2:])
    return (dataset.subset(first, f"{dataset.name} (calibration half)"),
            dataset.subset(second, f"{dataset.name} (test half)"))


# ----------------------------------------------------------------------------- raw datasets

@dataclass
class Pools:
    """Where a dataset's calibration and test images come from.

    Either ``calibration`` and ``test`` are separate pools, or ``whole`` is one labelled set that
    :func:`split_in_half` divides.
    """

    name: str
    class_names: tuple[str, ...]
    calibration: tuple[Any, np.ndarray] | None = None
    test: tuple[Any, np.ndarray] | None = None
    whole: tuple[Any, np.ndarray] | None = None
    #: The config that finishes the images' preprocessing where it differs from the model's (Hub
    #: pictures kept already resized and cropped: nctv.hubdata.Prepare).
    data_config: dict | None = None


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (the MNIST format, optionally gzipped) into a numpy array."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file.")
    shape = struct.unpack(f">{ndim}I", raw[4: 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path} is truncated: expected {int(np.prod(shape))} values, found {data.size}.")
    return data.reshape(shape)


def load_fashion_mnist_idx(root: str | os.PathLike = FASHION_MNIST_SYSTEM_DIR) -> dict[str, np.ndarray]:
    """The full Fashion-MNIST from its IDX files: train/test images (N, 28, 28) and labels (uint8)."""
    root = Path(root)
    out = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        for kind, suffix in (("images", "images-idx3-ubyte"), ("labels", "labels-idx1-ubyte")):
            candidates = [root / f"{prefix}-{suffix}.gz", root / f"{prefix}-{suffix}"]
            found = next((p for p in candidates if p.exists()), None)
            if found is None:
                raise ValueError(f"Fashion-MNIST file {prefix}-{suffix}[.gz] not found in {root}.")
            out[f"{split}_{kind}"] = read_idx(found)
    return out


def _load_npz(path: Path, keys: Sequence[str]) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        missing = [k for k in keys if k not in z.files]
        if missing:
            raise ValueError(f"{path} lacks the arrays {missing}; it is not the expected dataset file.")
        return {k: z[k] for k in keys}


def _fashion_mnist_pools() -> Pools:
    root = assets_dir() / "data" / "fashion-mnist"
    parts = {}
    for part in ("calibration", "test"):
        path = root / f"{part}.npz"
        if not path.exists():
            raise ValueError(f"The embedded Fashion-MNIST file {path} is missing; run scripts/make_assets.py data.")
        z = _load_npz(path, ("images", "labels"))
        parts[part] = (ArrayImages(z["images"], f"fashion-mnist/{part}.npz"), z["labels"])
    return Pools("fashion-mnist", FASHION_MNIST_CLASSES, calibration=parts["calibration"], test=parts["test"])


def _bloodmnist_pools(token: str | None) -> Pools:
    from huggingface_hub import hf_hub_download

    repo, filename = BLOODMNIST_HUB
    path = hub_file(lambda offline: hf_hub_download(repo, filename, repo_type="dataset", token=token,
                                                    local_files_only=offline),
                    f"BloodMNIST ({repo}, {filename})")
    z = _load_npz(Path(path), ["val_images", "val_labels", "test_images", "test_labels"])
    return Pools(
        "bloodmnist", BLOODMNIST_CLASSES,
        calibration=(ArrayImages(z["val_images"], "bloodmnist/val"), z["val_labels"].reshape(-1)),
        test=(ArrayImages(z["test_images"], "bloodmnist/test"), z["test_labels"].reshape(-1)),
    )


def _cifar100(root: Path, train: bool):
    from torchvision.datasets import CIFAR100

    try:
        return CIFAR100(str(root / "cifar100"), train=train, download=not _cifar_present(root))
    except (OSError, RuntimeError) as e:  # urllib errors are OSError
        raise ValueError(
            f"CIFAR-100 could not be downloaded to {root / 'cifar100'} ({e}). It needs the network once; "
            "afterwards it is read from that folder."
        ) from None


def _cifar_present(root: Path) -> bool:
    return (root / "cifar100" / "cifar-100-python" / "test").exists()


def _cifar100_pools(root: Path, paper_protocol: bool) -> Pools:
    test = _cifar100(root, train=False)
    names = tuple(test.classes)
    test_pool = (ArrayImages(np.asarray(test.data), "cifar100/test"), np.asarray(test.targets))
    if not paper_protocol:
        return Pools("cifar100", names, whole=test_pool)
    train = _cifar100(root, train=True)
    tail = slice(45000, 50000)
    return Pools("cifar100-train-tail", names,
                 calibration=(ArrayImages(np.asarray(train.data)[tail], "cifar100/train[45000:50000]"),
                              np.asarray(train.targets)[tail]),
                 test=test_pool)


FOLDERS_REFUSED = ("This server reads image folders only inside the data folders its operator allows "
                   "(NCTV_DATA_ROOTS; none by default), and this one is not among them.")


def allowed_folder(text: str, roots: Sequence[str | os.PathLike] | None) -> Path:
    """The image folder ``text`` names, if it may be read.

    ``roots=None`` (the command line: a local user's own machine) allows any folder. Otherwise the
    folder, with symlinks and ``..`` resolved, must lie inside one of ``roots``; a refusal is the
    same sentence whether the folder exists or not, so it tells a visitor nothing about the server.
    """
    if roots is None:
        return Path(text).expanduser()
    # No "~" expansion: a visitor has no business with the server's home folder.
    folder = Path(text).resolve()
    if not _inside(folder, roots):
        raise ValueError(FOLDERS_REFUSED)
    return folder


def _inside(path: Path, roots: Sequence[str | os.PathLike]) -> bool:
    """Whether ``path``, its symlinks resolved, lies inside one of ``roots``."""
    resolved = path.resolve()
    return any(resolved.is_relative_to(Path(r).expanduser().resolve()) for r in roots)



def _folder_pools(text: str, model_class_names: Sequence[str], num_classes: int,
                  roots: Sequence[str | os.PathLike] | None) -> Pools:
    root = allowed_folder(text, roots)
    if not root.is_dir():
        raise ValueError(f"Image folder {text} does not exist; give a folder with one sub-folder per class.")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise ValueError(f"{text} has no class sub-folders; the ImageFolder layout is <root>/<class>/<image>.")
    mapping = folder_label_mapping(classes, model_class_names, num_classes)
    paths, labels = [], []
    for name in classes:
        files = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        paths += files
        labels += [mapping[name]] * len(files)
    if not paths:
        raise ValueError(f"No images ({', '.join(IMAGE_EXTENSIONS)}) found under {text}.")
    # The folder itself is inside a root; a class folder or an image may still be a link out of it.
    if roots is not None and not all(_inside(p, roots) for p in [*(root / name for name in classes), *paths]):
        raise ValueError(f"{text} links to files outside the data folders this server allows (NCTV_DATA_ROOTS); "
                         "put the images themselves in the folder, not links to them.")
    # Named as the person typed it: results and messages never show where the server keeps it.
    return Pools(f"folder:{text}", tuple(model_class_names),
                 whole=(FileImages(root, paths, f"folder:{text}"), np.asarray(labels, dtype=np.int64)))


def folder_label_mapping(folders: Sequence[str], model_class_names: Sequence[str], num_classes: int) -> dict[str, int]:
    """Class index of the model for each class folder name.

    Tried in order: ImageNet synset ids (``n01440764``) for 1000-class models; the model's class
    names; integer folder names; and, when there are exactly as many folders as classes, sorted
    order (torchvision's ImageFolder convention).
    """
    if num_classes == 1000 and all(re.fullmatch(r"n\d{8}", f) for f in folders):
        from timm.data import ImageNetInfo

        synsets = ImageNetInfo().label_names()
        index = {s: i for i, s in enumerate(synsets)}
        unknown = [f for f in folders if f not in index]
        if unknown:
            raise ValueError(f"Folders {unknown[:5]} are not ImageNet-1k synsets.")
        return {f: index[f] for f in folders}
    lowered = {n.lower(): i for i, n in enumerate(model_class_names)}
    if all(f.lower() in lowered for f in folders):
        return {f: lowered[f.lower()] for f in folders}
    if all(f.isascii() and f.isdigit() for f in folders):  # "٣" is a digit to isdigit() and int()
        bad = [f for f in folders if int(f) >= num_classes]
        if bad:
            raise ValueError(f"Folders {bad[:5]} name classes beyond the model's {num_classes}.")
        return {f: int(f) for f in folders}
    if len(folders) == num_classes:
        return {f: i for i, f in enumerate(folders)}
    raise ValueError(
        f"Cannot match the {len(folders)} class folders to the model's {num_classes} classes: name the "
        "folders by the model's class names, by class index (0, 1, …) or by ImageNet synset."
    )


def _hub_dataset_pools(dataset: str, source: Any, token: str | None, model_class_names: Sequence[str],
                       sizes: tuple[int | None, int | None], data_config: dict | None) -> Pools:
    """A Hub repository's split (nctv.hubdata), as one labelled set to split in halves."""
    from nctv import hubdata

    images, labels, config = hubdata.load_hub_images(source, model_class_names, *sizes, data_config=data_config,
                                                     token=token)
    return Pools(dataset, tuple(model_class_names), whole=(images, labels), data_config=config)


def _imagenet_source(token: str | None) -> str:
    """``imagenet``: ImageNet-1k validation where a Hub token is known, else the public Imagenette."""
    from huggingface_hub import get_token

    if token or get_token():
        return "imagenet-1k"
    print("imagenet: no Hugging Face token (HF_TOKEN), and ImageNet-1k (timm/imagenet-1k-wds) is gated; using the "
          "public Imagenette instead (10 ImageNet classes). Set HF_TOKEN for the 1000-class validation set.",
          file=sys.stderr)
    return "imagenette"


DATASETS = {
    "fashion-mnist": "Fashion-MNIST (embedded, offline): 5,000 calibration images, 10,000 test images.",
    "bloodmnist": "BloodMNIST (MedMNIST v2, 28×28 RGB, 8 classes): validation split → calibration, test split → test. Downloaded once.",
    "cifar100": "CIFAR-100 test set (10,000) split in calibration and test halves. Downloaded once (torchvision's copy, "
                "else the Hub's uoft-cs/cifar100, 23 MB).",
    "cifar100-train-tail": "CIFAR-100, paper protocol: training images 45,000–49,999 → calibration, test set → test.",
    "folder:<path>": "An image folder, one sub-folder per class (e.g. ImageNet val in synset folders), split in halves.",
    "imagenet": "ImageNet-1k validation (50,000) split in halves, from the Hub: imagenet-1k with a token, else imagenette.",
    "imagenet-1k": "ImageNet-1k validation from timm/imagenet-1k-wds (gated: HF_TOKEN), only the shards needed.",
    "imagenette": "Imagenette validation (3,925 pictures of 10 ImageNet classes, public), split in halves.",
    "hf-dataset:<org/name>[@split]": "A Hugging Face dataset of parquet or webdataset shards (gated sets need a token), "
                                     "split in halves; only the shards needed are downloaded.",
}


def dataset_names() -> list[str]:
    """The names of :data:`DATASETS` this installation can open (``hf-dataset:`` needs ``pyarrow``)."""
    return [k for k in DATASETS if not k.startswith("hf-dataset:") or hub_datasets_available()]


def load_pools(dataset: str, class_names: Sequence[str] = (), num_classes: int = 0,
               cache: str | os.PathLike | None = None, token: str | None = None,
               folder_roots: Sequence[str | os.PathLike] | None = None,
               sizes: tuple[int | None, int | None] = (None, None), data_config: dict | None = None) -> Pools:
    """Open a dataset by name (see :data:`DATASETS`); ``folder:`` datasets only inside
    ``folder_roots`` unless it is None (see :func:`allowed_folder`). Hub datasets read only the
    shards that ``sizes`` (calibration, test; None: all) need, and keep their pictures resized for
    ``data_config`` (the model's) where given."""
    if not isinstance(dataset, str) or not dataset.strip():
        raise ValueError(f"A dataset is named by a string; known: {', '.join(dataset_names())}.")
    name = check_text(dataset, "The dataset name").strip()
    if name == "fashion-mnist":
        return _fashion_mnist_pools()
    if name == "bloodmnist":
        return _bloodmnist_pools(token)
    if name == "cifar100-train-tail" or (name == "cifar100" and _cifar_present(cache_dir(cache))):
        return _cifar100_pools(cache_dir(cache), name == "cifar100-train-tail")
    if name.startswith("folder:"):
        return _folder_pools(name[len("folder:"):], class_names, num_classes, folder_roots)
    if name == "imagenet":
        name = _imagenet_source(token)
    if name in ("cifar100", "imagenet-1k", "imagenette") or name.startswith("hf-dataset:"):
        if not hub_datasets_available():
            raise ValueError(f"{name} needs the 'pyarrow' package, which is not installed here: pip install pyarrow.")
        from nctv import hubdata

        source = hubdata.SOURCES.get(name) or hubdata.parse_spec(name[len("hf-dataset:"):])
        return _hub_dataset_pools(name, source, token, class_names, sizes, data_config)
    raise ValueError(f"Unknown dataset {shown(name)}; known: {', '.join(dataset_names())}.")


# ----------------------------------------------------------------------------- get_splits

def get_splits(loaded_model: Any, dataset: str | None = None, calibration_size: int | None = DEFAULT_CALIBRATION_SIZE,
               calibration_seed: int = 0, test_size: int | None = None, split_seed: int = 0,
               cache: str | os.PathLike | None = None, token: str | None = None,
               folder_roots: Sequence[str | os.PathLike] | None = None) -> tuple[Split, Split]:
    """Calibration and test splits of ``dataset`` for ``loaded_model`` (an ``nctv.zoo.LoadedModel``).

    ``dataset=None`` uses the model's default dataset (the first its zoo entry lists).
    ``calibration_size`` images are drawn from the calibration pool with ``calibration_seed``
    (``None`` = the whole pool); ``test_size`` from the test pool with ``split_seed`` (``None`` =
    all). Datasets without separate pools are first split in halves by ``split_seed``. Asking for
    more images than a pool holds is an error, never silently fewer. ``folder_roots`` restricts
    ``folder:`` datasets to those folders (the web app's setting); None allows any folder. Hub
    datasets (``imagenet``, ``hf-dataset:``…) read only the first shards that hold 2 × max(sizes)
    pictures, and keep them resized and cropped for the model (nctv.hubdata, docs/datasets.md).
    """
    if dataset is None:
        dataset = getattr(loaded_model, "default_dataset", None)
        if dataset is None:
            raise ValueError(
                f"Model {loaded_model.name!r} has no default dataset; pass dataset='folder:/path' "
                "(one sub-folder per class) or dataset='hf-dataset:org/name@split'."
            )
    num_classes = len(loaded_model.class_names)
    pools = load_pools(dataset, loaded_model.class_names, num_classes, cache=cache, token=token,
                       folder_roots=folder_roots, sizes=(calibration_size, test_size),
                       data_config=loaded_model.data_config)
    if len(pools.class_names) != num_classes:
        raise ValueError(
            f"Dataset {pools.name!r} has {len(pools.class_names)} classes but model {loaded_model.name!r} predicts "
            f"{num_classes}; pick a dataset the model was trained for."
        )
    cfg = pools.data_config or loaded_model.data_config

    def make(part, role):
        images, labels = part
        labels = np.asarray(labels).astype(np.int64).reshape(-1)
        if labels.shape[0] != len(images):
            raise ValueError(f"{pools.name}: {len(images)} images but {labels.shape[0]} labels.")
        return Split(f"{pools.name} {role}", images, np.arange(len(images)), labels, loaded_model.class_names, cfg)

    if pools.whole is not None:
        cal_pool, test_pool = split_in_half(make(pools.whole, "pool"), split_seed)
    else:
        cal_pool, test_pool = make(pools.calibration, "calibration pool"), make(pools.test, "test pool")
    cal = subsample(cal_pool, calibration_size, calibration_seed, f"{pools.name} calibration")
    test = subsample(test_pool, test_size, split_seed, f"{pools.name} test")
    return cal, test
