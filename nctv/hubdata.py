"""Image datasets read straight from Hugging Face Hub repositories of parquet or webdataset shards.

``hf-dataset:<org/name>[@split]`` and the named Hub sources (``imagenet-1k``, ``imagenette``, the
Hub copy of ``cifar100``) load here with ``huggingface_hub`` and ``pyarrow`` only: no loading script
runs, and the ``datasets`` package is not needed.

1. **List.** The repository's files and their sizes come from the Hub's metadata (one
   ``dataset_info`` call with ``files_metadata``), pinned to the commit it names; offline (no
   network, or ``HF_HUB_OFFLINE=1``) from the cached snapshot (``refs/<revision>`` →
   ``snapshots/<commit>/``), so only what was downloaded before is there.
2. **Choose.** The split's shards are the ``.parquet`` or ``.tar`` files whose path names the split
   (``validation``, ``val``, ``test``, …), in natural order (``…-0002`` before ``…-0010``). Only the
   first shards that hold the pictures asked for are read: with ``calibration_size`` c and
   ``test_size`` t, 2·max(c, t) pictures, because the pool is split in halves (the paper's protocol,
   :func:`nctv.data.split_in_half`); the number of pictures in the split comes from its dataset card
   (or a named source's), shared out by bytes. Sizes of None (all) read every shard.
3. **Cap.** The chosen shards' total size, from the metadata, must be at most
   ``$NCTV_MAX_DATASET_MB`` megabytes (:data:`DEFAULT_MAX_DATASET_MB`), checked before anything is
   downloaded; a refusal gives the size and the cap.
4. **Read.** Each shard is downloaded through the Hub cache (read from there next time) and checked:
   a damaged file, or one whose footer disagrees with its rows, is refused in words; a picture that
   does not decode is skipped and counted; labels must be whole numbers of the dataset's classes;
   class names the files carry (parquet's ``huggingface`` schema metadata, a named source's list)
   must match the model's. Where shards hold fewer pictures than their card said, the next shards
   are read, still under the cap.
5. **Hold.** Each picture is decoded once and passed through the model's resize and crop, then kept
   as uint8 at the model's input size (ToTensor and Normalize, which need no neighbours, run later,
   vectorised); where the model's preprocessing is not resize + crop + ToTensor + Normalize, the
   encoded bytes are kept and decoded on demand.
"""
from __future__ import annotations

import json
import re
import sys
import tarfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from nctv.checks import shown

__all__ = [
    "DEFAULT_MAX_DATASET_MB", "max_dataset_bytes", "HubSource", "SOURCES", "IMAGENETTE_SYNSETS",
    "EncodedImages", "load_hub_images", "parse_spec",
]

#: Largest dataset download, in MB (10⁶ bytes), for one split. 2,000 MB holds what the menu's models
#: need at the app's default 5,000 calibration + 5,000 test pictures: 13 of ImageNet-1k validation's
#: 64 shards (about 1.3 GB), CIFAR-100's test file (about 23 MB), Imagenette's validation file. The
#: paper's 25,000 + 25,000 ImageNet pictures (all 64 shards, about 6.4 GB) need an operator's
#: ``NCTV_MAX_DATASET_MB=7000``: on a shared Space that is minutes of download, a few GB of disk,
#: and 7.5 GB of decoded 224×224 pictures in memory.
DEFAULT_MAX_DATASET_MB = 2000
SHARD_SUFFIXES = (".parquet", ".tar")
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")
#: Other names the Hub's own split rules give a split in file names.
SPLIT_WORDS = {"validation": ("validation", "valid", "val", "dev"), "test": ("test", "testing", "eval", "evaluation"),
               "train": ("train", "training")}
#: A tar member larger than this is no picture of a calibration set.
MAX_MEMBER_BYTES = 64 * 10**6
#: Imagenette's 10 classes (its label order), as ImageNet-1k synsets (indices 0, 217, 482, 491, 497,
#: 566, 569, 571, 574, 701 of a 1000-class model).
IMAGENETTE_SYNSETS = ("n01440764", "n02102040", "n02979186", "n03000684", "n03028079", "n03394916", "n03417042",
                      "n03425413", "n03445777", "n03888257")
_REPO = re.compile(r"[A-Za-z0-9][\w.\-]{0,95}/[A-Za-z0-9][\w.\-]{0,95}")
_SPLIT = re.compile(r"[A-Za-z0-9][\w.\-]{0,63}")


def max_dataset_bytes() -> int:
    """The largest split downloaded: ``$NCTV_MAX_DATASET_MB`` megabytes."""
    from nctv.checks import env_number

    return int(env_number("NCTV_MAX_DATASET_MB", DEFAULT_MAX_DATASET_MB, 0) * 1e6)


@dataclass(frozen=True)
class HubSource:
    """Where a split lives on the Hub and what its files do not say themselves.

    ``under``: the folder of the split's shards (else every shard whose path names the split);
    ``rows``: pictures in the split (its card's ``num_examples``); ``gated``: the repository needs
    an accepted licence and a token; ``label_names``: the class of each label value where the files
    carry no names (names in the files come first).
    """

    repo: str
    split: str
    revision: str | None = None
    under: str = ""
    rows: int | None = None
    gated: bool = False
    image_column: str | None = None
    label_column: str | None = None
    label_names: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return f"hf-dataset:{self.repo}@{self.split}"


#: The named Hub sources of the models in the menu (docs/datasets.md says how each was checked).
SOURCES = {
    # 50,000 JPEGs in imagenet1k-validation-{0000..0063}.tar (about 100 MB, 781 pictures each), .cls labels
    # in timm's (sorted synset) order; gated: accept ImageNet's terms on the Hub, and give a token.
    "imagenet-1k": HubSource("timm/imagenet-1k-wds", "validation", rows=50_000, gated=True),
    # The Hub's parquet conversion of Imagenette (320 px on the short side), 3,925 validation pictures.
    "imagenette": HubSource("frgfm/imagenette", "validation", revision="refs/convert/parquet",
                            under="320px/validation/", rows=3_925, label_names=IMAGENETTE_SYNSETS),
    # One parquet file (about 23 MB): img {bytes, path}, fine_label (100 classes), coarse_label.
    "cifar100": HubSource("uoft-cs/cifar100", "test", rows=10_000, image_column="img", label_column="fine_label"),
}


def parse_spec(spec: str) -> HubSource:
    """``<org/name>[@split]`` (split: validation by default) as a :class:`HubSource`."""
    repo, _, split = spec.strip().partition("@")
    if not _REPO.fullmatch(repo) or ".." in repo or "--" in repo:
        raise ValueError(f"{shown(repo)} is not a Hub dataset id; write hf-dataset:<org>/<name>[@split].")
    split = split or "validation"
    if not _SPLIT.fullmatch(split):
        raise ValueError(f"{shown(split)} is not a split name; write hf-dataset:<org>/<name>@validation (or @test).")
    return HubSource(repo, split)


# ----------------------------------------------------------------------------- listing

@dataclass(frozen=True)
class _Listing:
    commit: str
    files: dict[str, int]  # path in the repository -> bytes
    card: dict  # the dataset card's YAML front matter ({} if none)
    gated: bool
    offline: bool


def _natural(path: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path)]


def _cache_folder(repo: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ("datasets--" + repo.replace("/", "--"))


def _cached_listing(source: HubSource) -> _Listing:
    """The files of the cached snapshot (what was downloaded before): the listing when offline."""
    folder = _cache_folder(source.repo)
    revision = source.revision or "main"
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit
    if not re.fullmatch(r"[0-9a-f]{40}", commit) or not snapshot.is_dir():
        raise ValueError(f"{source.name} is not in the local Hugging Face cache and the Hub cannot be reached (no "
                         "network, or HF_HUB_OFFLINE=1). Connect once to download what it needs (it is read from the "
                         "cache afterwards), or give a local copy as folder:<path> (one sub-folder per class).")
    files = {p.relative_to(snapshot).as_posix(): p.stat().st_size for p in snapshot.rglob("*") if p.is_file()}
    card = _read_card(snapshot / "README.md") if "README.md" in files else {}
    return _Listing(commit, files, card, source.gated, offline=True)


def _read_card(path: Path) -> dict:
    from huggingface_hub.repocard import metadata_load

    try:
        return metadata_load(path) or {}
    except Exception:  # a card is only a hint of row counts; a broken one costs the hint
        return {}


def _online_listing(source: HubSource, token: str | None) -> _Listing:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi(library_name="nctv").dataset_info(source.repo, revision=source.revision, files_metadata=True,
                                                       token=token or None)
    except GatedRepoError:
        raise ValueError(_gated_message(source)) from None
    except RepositoryNotFoundError:
        raise ValueError(f"{source.name}: the Hub has no dataset {source.repo} (or it is private: give a token, "
                         "HF_TOKEN).") from None
    except RevisionNotFoundError:
        raise ValueError(f"{source.name}: the dataset has no revision {source.revision!r}.") from None
    files = {s.rfilename: int(s.size) for s in info.siblings or () if s.size is not None}
    card = info.card_data.to_dict() if info.card_data is not None else {}
    return _Listing(info.sha, files, card, bool(info.gated) or source.gated, offline=False)


@contextmanager
def _download_errors(source: HubSource) -> Iterator[None]:
    """The Hub's refusals of a shard download as messages: a token without access to a gated
    repository, a repository gone since it was listed."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        yield
    except GatedRepoError:
        raise ValueError(_gated_message(source)) from None
    except RepositoryNotFoundError:
        raise ValueError(f"{source.name}: the Hub refused its files (the dataset is private or gone; a token with "
                         "access, HF_TOKEN, may help).") from None


def _gated_message(source: HubSource) -> str:
    return (f"{source.name} is gated: its files download only with a Hugging Face token of an account that accepted "
            f"the dataset's terms on the Hub. Set HF_TOKEN (on a Space: a secret named HF_TOKEN) and try again"
            + (", or use the public 'imagenette' (10 ImageNet classes, no token needed)."
               if source.repo == SOURCES["imagenet-1k"].repo else "."))


# ----------------------------------------------------------------------------- choosing shards

def _names_split(path: str, split: str) -> bool:
    words = "|".join(re.escape(w) for w in SPLIT_WORDS.get(split.lower(), (split.lower(),)))
    return re.search(rf"(^|[/_.\- ])({words})([/_.\- 0-9]|$)", path.lower()) is not None


def split_shards(source: HubSource, files: dict[str, int]) -> list[tuple[str, int]]:
    """The split's shards, (path, bytes), in natural order: all parquet, or all webdataset tars."""
    shards = [(p, s) for p, s in files.items() if p.endswith(SHARD_SUFFIXES) and p.startswith(source.under)
              and (source.under or _names_split(p, source.split))]
    kinds = {Path(p).suffix for p, _ in shards}
    if len(kinds) > 1:  # a repository with both keeps one as a copy of the other; parquet is the Hub's own
        shards = [(p, s) for p, s in shards if p.endswith(".parquet")]
    return sorted(shards, key=lambda ps: _natural(ps[0]))


def _card_rows(card: dict, split: str) -> int | None:
    infos = card.get("dataset_info")
    for info in infos if isinstance(infos, list) else [infos] if isinstance(infos, dict) else []:
        for s in (info or {}).get("splits") or ():
            if isinstance(s, dict) and s.get("name") == split and isinstance(s.get("num_examples"), int):
                return s["num_examples"]
    return None


def needed_pictures(calibration_size: int | None, test_size: int | None) -> int | None:
    """Pictures a pool split in halves must hold for these sizes (None: all there are)."""
    if calibration_size is None and test_size is None:
        return None
    return 2 * max(calibration_size or 0, test_size or 0)


def plan_shards(shards: Sequence[tuple[str, int]], rows: int | None, need: int | None) -> int:
    """How many of the first ``shards`` to read for ``need`` pictures, when the split holds
    ``rows`` pictures shared out by bytes (None: unknown, start with one)."""
    if need is None or not shards:
        return len(shards)
    if rows is None:
        return 1
    total = sum(s for _, s in shards) or 1
    held = 0.0
    for k, (_, size) in enumerate(shards, 1):
        held += rows * size / total
        if held >= need - 1e-6:
            return k
    return len(shards)


def _megabytes(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 100_000 else f"{n / 1e3:,.1f} kB"


def check_cap(source: HubSource, chosen: Sequence[tuple[str, int]], of: int, cap: int, need: int | None) -> None:
    size = sum(s for _, s in chosen)
    if size > cap:
        asked = "all its pictures" if need is None else f"{need:,} pictures (calibration and test halves)"
        raise ValueError(f"{source.name}: {asked} means {len(chosen)} of its {of} shards, {_megabytes(size)}; this "
                         f"server downloads at most {_megabytes(cap)} for a dataset (NCTV_MAX_DATASET_MB). Ask for "
                         "fewer pictures, or raise the cap.")


# ----------------------------------------------------------------------------- holding pictures

class Prepare:
    """Decoded picture -> what is kept of it: uint8 (H, W[, 3]) at the model's input size after its
    resize and crop, where its preprocessing is resize/crop + ToTensor + Normalize; else None
    (then the encoded bytes are kept). ``data_config`` is the config that finishes the preprocessing
    of a kept array (crop_pct 1: resize and crop are identities at the input size)."""

    def __init__(self, data_config: dict | None):
        self.geometry: Callable | None = None
        self.mode = "RGB"
        self.data_config = data_config
        if data_config is None:
            return
        from timm.data import create_transform
        from torchvision import transforms as T

        from nctv.pictures import image_mode

        self.mode = image_mode(data_config)
        steps = list(getattr(create_transform(**data_config, is_training=False), "transforms", []))
        names = [type(s).__name__ for s in steps]
        cut = next((i for i, n in enumerate(names) if n in ("ToTensor", "MaybeToTensor")), None)
        if cut is None or names[cut + 1:] != ["Normalize"]:
            return
        self.geometry = T.Compose(steps[:cut])
        self.model_config = data_config
        self.data_config = {**data_config, "crop_pct": 1.0, "crop_mode": "center"}
        self.checked = False

    def __call__(self, image: Any) -> np.ndarray | None:
        if self.geometry is None:
            return None
        converted = image if image.mode == self.mode else image.convert(self.mode)
        kept = np.asarray(self.geometry(converted), dtype=np.uint8)
        if not self.checked:
            self.checked = True
            if not self._agrees(image, kept):
                self.geometry, self.data_config = None, self.model_config
                return None
        return kept

    def _agrees(self, image: Any, kept: np.ndarray) -> bool:
        """Whether the kept array, finished with ``data_config``, is bit for bit the model's
        preprocessing of the picture (checked on the first picture, as Split does for arrays)."""
        import torch

        from nctv.pictures import make_preprocess, pil_from_array

        if kept.shape[:2] != tuple(int(v) for v in self.model_config["input_size"][1:]):
            return False
        full = make_preprocess(self.model_config)(image)
        return torch.equal(full, make_preprocess(self.data_config)(pil_from_array(kept)))


class EncodedImages:
    """Pictures kept as their encoded bytes, decoded on demand (where the model's preprocessing is not
    resize/crop + ToTensor + Normalize); the ``ArrayImages`` interface: ``len``, ``pil(i)``, ``digest``."""

    def __init__(self, encoded: list[bytes], description: str):
        self.encoded = encoded
        self.description = description

    def __len__(self) -> int:
        return len(self.encoded)

    def pil(self, i: int):
        from nctv.images import open_checked

        img = open_checked(self.encoded[i], f"Picture {i} of {self.description}")
        img.load()
        return img

    def digest(self, indices: np.ndarray) -> bytes:
        import hashlib

        h = hashlib.sha256()
        for i in indices:
            h.update(hashlib.sha256(self.encoded[int(i)]).digest())
        return h.digest()

    def row_keys(self, indices: np.ndarray) -> np.ndarray:
        """Each picture's identity by its encoded bytes (:func:`nctv.canonical.content_keys`)."""
        from nctv.canonical import content_keys

        return content_keys(self.encoded[int(i)] for i in indices)


# ----------------------------------------------------------------------------- reading shards

def _decode(data: bytes):
    """A decoded picture, or None where the bytes are not one (header checks: nctv.images)."""
    from nctv.images import ImageError, open_checked

    try:
        img = open_checked(data)
        img.load()
        return img
    except (ImageError, OSError, SyntaxError, ValueError):
        return None


def _hf_features(schema) -> dict:
    meta = (schema.metadata or {}).get(b"huggingface")
    try:
        features = json.loads(meta)["info"]["features"] if meta else {}
    except (ValueError, KeyError, TypeError):
        features = {}
    return features if isinstance(features, dict) else {}


def _parquet_columns(source: HubSource, schema, features: dict, shard: str) -> tuple[str, str, list[str] | None]:
    import pyarrow as pa

    names = schema.names

    def is_image(n):
        t = schema.field(n).type
        return (isinstance(features.get(n), dict) and features[n].get("_type") == "Image") or pa.types.is_binary(t) \
            or pa.types.is_large_binary(t) or (pa.types.is_struct(t) and t.get_field_index("bytes") >= 0)

    def is_label(n):
        return pa.types.is_integer(schema.field(n).type)

    image = source.image_column or next((n for n in names if isinstance(features.get(n), dict)
                                         and features[n].get("_type") == "Image"), None) \
        or next((n for n in ("image", "img", "jpg", "png", "webp") if n in names), None)
    labelled = [n for n in names if isinstance(features.get(n), dict) and features[n].get("_type") == "ClassLabel"]
    label = source.label_column or next((n for n in ("label", "labels", "fine_label", "cls") if n in labelled), None) \
        or (labelled[0] if labelled else None) or next((n for n in ("label", "labels", "cls") if n in names), None)
    if image not in names or not is_image(image) or label not in names or not is_label(label):
        raise ValueError(f"{source.name}: {shard} has no picture column and whole-number class column that NCTV "
                         f"recognises (its columns: {', '.join(names[:12])}); it cannot be used for calibration.")
    class_names = features.get(label, {}).get("names") if isinstance(features.get(label), dict) else None
    return image, label, ([str(n) for n in class_names] if isinstance(class_names, list) else None)


class _Reader:
    """Pictures and labels read shard by shard, each picture kept as :class:`Prepare` says."""

    def __init__(self, source: HubSource, prepare: Prepare):
        self.source, self.prepare = source, prepare
        self.arrays: list[np.ndarray] = []
        self.encoded: list[bytes] = []
        self.labels: list[int] = []
        self.skipped: list[str] = []
        self.class_names: list[str] | None = None
        self.max_label = -1

    def add(self, data: bytes, label: int, where: str) -> None:
        img = _decode(data)
        if img is None:
            self.skipped.append(where)
            return
        kept = self.prepare(img)
        if kept is None:
            self.encoded.append(bytes(data))
        else:
            self.arrays.append(kept)
        self.labels.append(int(label))

    def parquet(self, path: Path, shard: str) -> None:
        import contextlib

        import pyarrow as pa
        import pyarrow.parquet as pq

        with contextlib.ExitStack() as stack:
            self._parquet(pa, pq, stack, path, shard)

    def _parquet(self, pa, pq, stack, path: Path, shard: str) -> None:
        try:
            pf = pq.ParquetFile(stack.enter_context(open(path, "rb")))
            image, label, names = _parquet_columns(self.source, pf.schema_arrow, _hf_features(pf.schema_arrow), shard)
            said = pf.metadata.num_rows
            got = 0
            for batch in pf.iter_batches(batch_size=256, columns=[image, label]):
                pics, labs = batch.column(0), batch.column(1)
                if pa.types.is_struct(pics.type):
                    pics = pics.field("bytes")
                for i, (data, lab) in enumerate(zip(pics.to_pylist(), labs.to_pylist())):
                    if lab is None or isinstance(lab, bool) or not isinstance(lab, int) or lab < 0:
                        raise ValueError(f"{self.source.name}: row {got + i} of {shard} has the class {shown(lab)}; "
                                         "a class is a whole number ≥ 0.")
                    if data is None:
                        self.skipped.append(f"{shard} row {got + i}")
                        continue
                    self.add(data, lab, f"{shard} row {got + i}")
                got += batch.num_rows
        except (pa.ArrowException, OSError, EOFError) as e:
            raise ValueError(f"{self.source.name}: the shard {shard} is damaged ({shown(str(e))}); delete it from "
                             "the Hugging Face cache and try again.") from None
        if got != said:
            raise ValueError(f"{self.source.name}: the shard {shard} says it holds {said:,} rows but holds {got:,}; "
                             "it is damaged. Delete it from the Hugging Face cache and try again.")
        self._names(names, shard)

    def tar(self, path: Path, shard: str) -> None:
        sample: dict[str, bytes] = {}
        key = None
        try:
            with tarfile.open(path, mode="r:") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    if member.size > MAX_MEMBER_BYTES:
                        raise ValueError(f"{self.source.name}: {shard} holds {member.name!r} of "
                                         f"{_megabytes(member.size)}, too large for a picture; it is not a dataset "
                                         "NCTV reads.")
                    base, _, ext = member.name.rpartition("/")[2].partition(".")
                    k = member.name.rpartition("/")[0] + "/" + base
                    if k != key:
                        self._sample(key, sample, shard)
                        key, sample = k, {}
                    f = tar.extractfile(member)
                    data = f.read() if f is not None else b""
                    if len(data) != member.size:
                        raise tarfile.ReadError(f"{member.name} is cut short")
                    sample[ext.lower()] = data
                self._sample(key, sample, shard)
        except (tarfile.TarError, OSError, EOFError) as e:
            raise ValueError(f"{self.source.name}: the shard {shard} is damaged ({shown(str(e))}); delete it from "
                             "the Hugging Face cache and try again.") from None
        self._names(None, shard)

    def _sample(self, key: str | None, sample: dict[str, bytes], shard: str) -> None:
        if key is None:
            return
        where = f"{shard} {key.lstrip('/')}"
        image = next((sample[e] for e in IMAGE_SUFFIXES if e in sample), None)
        label = _tar_label(sample, where, self.source.name)
        if label is None:
            if image is not None:
                raise ValueError(f"{self.source.name}: {where} has a picture but no label (.cls or .json); the "
                                 "shard is incomplete.")
            return  # a sample of other data (captions, metadata) is no picture of this split
        if image is None:
            self.skipped.append(f"{where} (no .jpg, .png or .webp)")
            return
        self.add(image, label, where)

    def _names(self, names: list[str] | None, shard: str) -> None:
        if names is None:
            return
        if self.class_names is not None and names != self.class_names:
            raise ValueError(f"{self.source.name}: {shard} names its classes differently from the shards before it.")
        self.class_names = names


def _tar_label(sample: dict[str, bytes], where: str, name: str) -> int | None:
    try:
        if "cls" in sample:
            text = sample["cls"].decode("ascii").strip()
            if not re.fullmatch(r"\d{1,9}", text):
                raise ValueError
            return int(text)
        if "json" in sample:
            value = json.loads(sample["json"])
            value = value.get("label", value.get("cls")) if isinstance(value, dict) else None
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError
            return value
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{name}: {where} has a label that is not a class number ≥ 0.") from None
    return None


# ----------------------------------------------------------------------------- labels to the model's classes

def _placeholder(names: Sequence[str]) -> bool:
    return all(n == f"class {i}" for i, n in enumerate(names))


def _aliases(name: str) -> set[str]:
    base = {name.lower().replace("_", " ").strip()}
    return base | {part.strip() for part in next(iter(base)).split(",") if part.strip()}


def label_mapping(dataset_names: Sequence[str] | None, n_classes: int, model_names: Sequence[str],
                  what: str) -> np.ndarray | None:
    """Model class of each dataset label (None: labels are the model's indices already).

    ImageNet synsets map to a 1000-class model's indices; other names must each name one of the
    model's classes (case, underscores and a description's synonyms aside), unless the model names
    none (``class 0``, …), where the dataset must have as many classes as the model."""
    k = len(model_names)
    if dataset_names is None:
        if n_classes > k:
            raise ValueError(f"{what} has labels up to {n_classes - 1}, but the model predicts {k} classes; pick a "
                             "dataset the model was trained for.")
        return None
    if k == 1000 and all(re.fullmatch(r"n\d{8}", n) for n in dataset_names):
        from timm.data import ImageNetInfo

        index = {s: i for i, s in enumerate(ImageNetInfo().label_names())}
        unknown = [n for n in dataset_names if n not in index]
        if unknown:
            raise ValueError(f"{what} has classes {unknown[:5]} that are not ImageNet-1k synsets.")
        return np.asarray([index[n] for n in dataset_names], dtype=np.int64)
    placeholder = _placeholder(model_names)
    described = [] if placeholder else list(model_names)
    if k == 1000:  # an ImageNet model knows its classes by their descriptions too (its names may be synsets)
        from timm.data import ImageNetInfo

        info = ImageNetInfo()
        described += [info.index_to_description(i) for i in range(k)]
    lookup: dict[str, int] = {}
    for i, n in enumerate(described):
        for a in _aliases(str(n)):
            lookup.setdefault(a, i % k)
    found = [lookup.get(n.lower().replace("_", " ").strip()) for n in dataset_names]
    missing = [n for n, f in zip(dataset_names, found) if f is None]
    if not missing:
        return np.asarray(found, dtype=np.int64)
    if placeholder:
        if len(dataset_names) != k:
            raise ValueError(f"{what} has {len(dataset_names)} classes but the model predicts {k}; pick a dataset "
                             "the model was trained for.")
        return None
    raise ValueError(f"{what} has classes the model does not know: {', '.join(map(repr, missing[:5]))}"
                     f"{' …' if len(missing) > 5 else ''} (the model's are {', '.join(map(repr, model_names[:5]))}"
                     " …); pick a dataset the model was trained for.")


# ----------------------------------------------------------------------------- the whole path

def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    """One array of equal-shaped pictures, each freed from the list once copied (np.stack would
    hold both, twice the pictures' memory)."""
    out = np.empty((len(arrays), *arrays[0].shape), dtype=np.uint8)
    for i in range(len(arrays)):
        out[i], arrays[i] = arrays[i], None
    return out


def _token(token: str | None) -> str | None:
    from huggingface_hub import get_token

    return token or get_token()


def load_hub_images(source: HubSource, model_names: Sequence[str], calibration_size: int | None,
                    test_size: int | None, data_config: dict | None = None, token: str | None = None,
                    say: Callable[[str], None] | None = None) -> tuple[Any, np.ndarray, dict | None]:
    """The pictures (``nctv.data.ArrayImages`` of uint8 at the model's input size, else
    :class:`EncodedImages`), labels (model class indices) and the data config that
    finishes their preprocessing (None: the model's own) of the shards of ``source`` that the sizes
    need. ``say`` gets one line about what is read (default: standard error)."""
    from huggingface_hub import hf_hub_download

    from nctv.hub import hub_file, hub_reachable

    say = say or (lambda line: print(line, file=sys.stderr))
    token = _token(token)
    online = hub_reachable()
    listing = _online_listing(source, token) if online else _cached_listing(source)
    shards = split_shards(source, listing.files)
    if not shards:
        raise ValueError(f"{source.name}: the dataset has no parquet or webdataset (.tar) files for the split "
                         f"'{source.split}'" + (" in the local cache (offline: only what was downloaded before is "
                                                "there)" if listing.offline else "") + ".")
    need = needed_pictures(calibration_size, test_size)
    rows = source.rows or _card_rows(listing.card, source.split)
    k = plan_shards(shards, rows, need)
    cap = max_dataset_bytes()
    check_cap(source, shards[:k], len(shards), cap, need)
    if online and listing.gated and not token:
        raise ValueError(_gated_message(source))
    reader = _Reader(source, Prepare(data_config))
    read = 0
    while True:
        path, size = shards[read]
        with _download_errors(source):
            local = hub_file(lambda offline: hf_hub_download(source.repo, path, repo_type="dataset",
                                                             revision=listing.commit, token=token or None,
                                                             library_name="nctv",
                                                             local_files_only=offline or listing.offline),
                             f"{source.name} ({path})")
        (reader.parquet if path.endswith(".parquet") else reader.tar)(Path(local), path)
        read += 1
        if need is None and read < len(shards):
            continue
        if need is None or len(reader.labels) >= need or read == len(shards):
            break
        check_cap(source, shards[:read + 1], len(shards), cap, need)  # the card said more than the shards hold
    nbytes = sum(s for _, s in shards[:read])
    say(f"{source.name}: read {read} of {len(shards)} shards ({_megabytes(nbytes)}), {len(reader.labels):,} pictures"
        + (f"; {len(reader.skipped)} that do not decode skipped ({', '.join(reader.skipped[:3])}"
           f"{' …' if len(reader.skipped) > 3 else ''})" if reader.skipped else ""))
    if need is not None and len(reader.labels) < need:
        raise ValueError(f"{source.name}: {need:,} pictures (calibration and test halves) were asked for, but its "
                         f"{len(shards)} shards hold {len(reader.labels):,}"
                         + (" in the local cache" if listing.offline else "") + "; ask for at most "
                         f"{len(reader.labels) // 2:,} calibration and test pictures.")
    if not reader.labels:
        raise ValueError(f"{source.name}: none of its pictures could be read.")
    labels = np.asarray(reader.labels, dtype=np.int64)
    names = reader.class_names or (list(source.label_names) if source.label_names else None)
    if names is not None and labels.max() >= len(names):
        raise ValueError(f"{source.name}: a label is {labels.max()}, but the dataset names {len(names)} classes.")
    mapping = label_mapping(names, int(labels.max()) + 1 if names is None else len(names), model_names, source.name)
    if mapping is not None:
        labels = mapping[labels]
    description = f"{source.name} ({read} of {len(shards)} shards, commit {listing.commit[:8]})"
    if reader.arrays:
        from nctv.pictures import ArrayImages

        return ArrayImages(_stack(reader.arrays), description), labels, reader.prepare.data_config
    return EncodedImages(reader.encoded, description), labels, None


__all__ += ["split_shards", "plan_shards", "needed_pictures", "label_mapping", "check_cap", "Prepare"]
