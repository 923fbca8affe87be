"""The content-keyed cache of unperturbed logits, and the fingerprints that key it.

A model's logits on a split are computed once per (weights, split content) and kept as safetensors
files (tensors only, never pickle) under ``<cache dir>/logits/``; logit-space calibrators never touch
the model again. The folder is kept under a size cap (``$NCTV_CACHE_MAX_MB``, default
:data:`DEFAULT_CACHE_MAX_MB`): after each write the least recently used files go first. A file's
modification time marks its last use: every cache hit touches it. Each file records the SHA-256 of
its tensors' bytes; a file whose bytes no longer match (a flipped bit leaves the logits finite and
plausible) is recomputed, as is a truncated one.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nctv import distributed, precision
from nctv.inference import DEFAULT_BATCH_SIZE, model_logits

#: Size cap of ``<cache dir>/logits/`` in MB (2²⁰ bytes) when ``$NCTV_CACHE_MAX_MB`` is not set.
DEFAULT_CACHE_MAX_MB = 2048


def default_cache_dir() -> Path:
    """NCTV's cache folder (``$NCTV_CACHE_DIR``, else ``~/.cache/nctv``), shared with the datasets."""
    from nctv.data import cache_dir

    return cache_dir()


def cache_max_bytes() -> int | None:
    """The logit cache's cap in bytes from ``$NCTV_CACHE_MAX_MB`` (MB, may be fractional; 0: no cap)."""
    raw = os.environ.get("NCTV_CACHE_MAX_MB", "").strip()
    if not raw:
        return DEFAULT_CACHE_MAX_MB * 2**20
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not (0 <= mb < float("inf")):
        raise ValueError(f"NCTV_CACHE_MAX_MB must be a number of megabytes >= 0 (0: no cap); got {raw!r}.")
    return None if mb == 0 else int(mb * 2**20)


def prune_cache(folder: str | Path, max_bytes: int | None, keep: Path | None = None) -> list[Path]:
    """Delete the least recently used ``*.safetensors`` files of ``folder`` until they fit in ``max_bytes``.

    ``keep`` (the file in use) is never deleted, even alone over the cap. Returns the deleted paths.
    Files that vanish meanwhile (another process pruning the same folder) are skipped.
    """
    if max_bytes is None:
        return []
    files = []
    for path in Path(folder).glob("*.safetensors"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        files.append((st.st_mtime_ns, st.st_size, path))
    total = sum(size for _, size, _ in files)
    deleted = []
    for _, size, path in sorted(files):
        if total <= max_bytes:
            break
        if keep is not None and path == keep:
            continue
        path.unlink(missing_ok=True)
        total -= size
        deleted.append(path)
    return deleted


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of the model's class, parameter/buffer names, shapes, dtypes and values."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, t in sorted(model.state_dict().items()):
        _hash_tensor(h, t, name)
    return h.hexdigest()


def _hash_tensor(h: Any, t: torch.Tensor, name: str = "") -> None:
    """Feed a tensor's name, shape, dtype and raw bytes to the hash ``h``."""
    t = t.detach().to("cpu").contiguous()
    h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
    # Raw bytes of any dtype (bfloat16 has no numpy equivalent); 0-d tensors need a 1-d view.
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


@dataclass
class CachedLogits:
    logits: torch.Tensor
    labels: torch.Tensor
    hit: bool
    path: Path | None


def split_logits(
    model: torch.nn.Module,
    split: Any,
    cache_dir: str | Path | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: Any = None,
    model_hash: str | None = None,
) -> CachedLogits:
    """Unperturbed logits (N, K) float32 of ``model`` on ``split``, read from or written to a cache.

    The cache file is ``<cache_dir>/logits/<key>.safetensors`` (default ``cache_dir``:
    :func:`default_cache_dir`) with key = SHA-256 of the model's
    :func:`model_fingerprint` and ``split.fingerprint``; a different split or changed weights give
    a different key. ``cache_dir=False`` disables the cache. Files hold tensors only (no pickle).
    A hit marks the file as used (its modification time); a write prunes the folder to
    :func:`cache_max_bytes`, least recently used files first.

    In a process group (``nctv.distributed``) only rank 0 reads and writes the cache and every
    process gets its logits; on a miss each process runs its block of the split through the model
    and the blocks are gathered, so every process holds all N rows.
    """
    labels = torch.as_tensor(np.asarray(split.labels)).long()
    path = max_bytes = None
    if cache_dir is not False:
        max_bytes = cache_max_bytes()  # a mistyped cap fails before the model pass, not after
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        mh = model_hash or model_fingerprint(model)
        if precision.current() != precision.FP32:  # mixed-precision logits are not fp32's
            mh += "|" + precision.current().label
        key = hashlib.sha256(f"{mh}|{split.fingerprint}|logits-v1".encode()).hexdigest()[:32]
        path = root / "logits" / f"{key}.safetensors"
    cached = _read(path, labels) if path is not None and distributed.is_main() else None
    cached = distributed.from_main(cached)
    if cached is not None:
        return CachedLogits(cached, labels, True, path)
    z = _compute(model, split, labels, batch_size, device)
    if path is not None and distributed.is_main():
        _write(path, z, labels, split, max_bytes)
    return CachedLogits(z, labels, False, path)


def _read(path: Path, labels: torch.Tensor) -> torch.Tensor | None:
    """The cached logits at ``path`` if the file is there, whole, unaltered and for these labels (marked used)."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            checksum = (f.metadata() or {}).get("sha256")
            z, y = f.get_tensor("logits"), f.get_tensor("labels")
    except Exception:  # noqa: BLE001 - a damaged cache entry is simply recomputed
        return None
    if checksum != _checksum(z, y):
        return None
    if z.ndim == 2 and z.shape[0] == len(labels) and torch.equal(y, labels):
        _touch(path)
        return z
    return None


def _checksum(z: torch.Tensor, labels: torch.Tensor) -> str:
    """SHA-256 of the logits' and labels' raw bytes, with their shapes and dtypes."""
    h = hashlib.sha256()
    _hash_tensor(h, z, "logits")
    _hash_tensor(h, labels, "labels")
    return h.hexdigest()


def _compute(model: torch.nn.Module, split: Any, labels: torch.Tensor, batch_size: int, device: Any) -> torch.Tensor:
    """The logits of the whole split: this process's rows through the model, then all rows gathered."""
    n = len(labels)
    loader = distributed.shard_loader(split.loader(batch_size=batch_size), n)
    z, seen = model_logits(model, loader, device=device, return_labels=True)
    z, seen = distributed.all_gather_rows(z, n), distributed.all_gather_rows(seen, n)
    if not torch.equal(seen, labels):
        raise ValueError(
            f"The loader of split {getattr(split, 'name', '?')!r} yields its samples in a different order than "
            "split.labels; a split's loader must not shuffle."
        )
    return z


def _write(path: Path, z: torch.Tensor, labels: torch.Tensor, split: Any, max_bytes: int | None) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file({"logits": z.contiguous(), "labels": labels.contiguous()}, str(tmp),
              metadata={"split": str(getattr(split, "name", "")), "fingerprint": str(split.fingerprint),
                        "sha256": _checksum(z, labels)})
    os.replace(tmp, path)
    prune_cache(path.parent, max_bytes, keep=path)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:  # a read-only cache still serves hits; it just cannot record them
        pass
