"""The content-keyed cache of unperturbed logits, and the fingerprints that key it.

A model's logits on a split are computed once per (weights, split content) and kept as safetensors
files (tensors only, never pickle) under ``<cache dir>/logits/``; logit-space calibrators never touch
the model again. The folder is kept under a size cap, least recently used files first.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nctv.inference import DEFAULT_BATCH_SIZE, model_logits


def default_cache_dir() -> Path:
    """NCTV's cache folder (``$NCTV_CACHE_DIR``, else ``~/.cache/nctv``), shared with the datasets."""
    from nctv.data import cache_dir

    return cache_dir()


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of the model's class, parameter/buffer names, shapes, dtypes and values."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        # Raw bytes of any dtype (bfloat16 has no numpy equivalent); 0-d tensors need a 1-d view.
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


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
    """
    from safetensors.torch import load_file, save_file

    labels = torch.as_tensor(np.asarray(split.labels)).long()
    path = None
    if cache_dir is not False:
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        mh = model_hash or model_fingerprint(model)
        key = hashlib.sha256(f"{mh}|{split.fingerprint}|logits-v1".encode()).hexdigest()[:32]
        path = root / "logits" / f"{key}.safetensors"
        if path.is_file():
            try:
                stored = load_file(str(path))
                z, y = stored["logits"], stored["labels"]
                if z.ndim == 2 and z.shape[0] == len(labels) and torch.equal(y, labels):
                    return CachedLogits(z, y, True, path)
            except Exception:  # noqa: BLE001 - a damaged cache entry is simply recomputed
                pass
    z, seen = model_logits(model, split.loader(batch_size=batch_size), device=device, return_labels=True)
    if not torch.equal(seen, labels):
        raise ValueError(
            f"The loader of split {getattr(split, 'name', '?')!r} yields its samples in a different order than "
            "split.labels; a split's loader must not shuffle."
        )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({"logits": z.contiguous(), "labels": labels.contiguous()}, str(tmp),
                  metadata={"split": str(getattr(split, "name", "")), "fingerprint": str(split.fingerprint)})
        os.replace(tmp, path)
    return CachedLogits(z, labels, False, path)
