"""Batched passes of a frozen model over a split: the one place that turns inputs into logits.

A split can be given as a tensor of preprocessed inputs (N, ...) with labels, or as any iterable
of ``(inputs, labels)`` batches (a ``DataLoader``). Everything here runs under ``torch.no_grad``
unless a caller asks for gradients, keeps the model in eval mode and never touches its weights.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from nctv.memory import ChunkSizer
from nctv.precision import eval_mode, run_model
from nctv.settings import DEFAULT_BATCH_SIZE


def resolve_device(device: Any = None) -> torch.device:
    """``None``/"auto" → CUDA if present, then MPS, else CPU; otherwise ``torch.device(device)``."""
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Unknown device {device!r}; use 'cpu', 'cuda', 'cuda:0', 'mps' or 'auto'.") from None


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode and no parameter gradients: the model is never trained by calibration."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def iter_batches(
    inputs: Any, labels: Any = None, batch_size: int = DEFAULT_BATCH_SIZE
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Yield ``(x, y)`` batches from a tensor (+ labels) or from an iterable of batches.

    ``y`` is ``None`` when no labels are known.
    """
    if isinstance(inputs, torch.Tensor):
        n = inputs.shape[0]
        y_all = None if labels is None else torch.as_tensor(labels)
        if y_all is not None and y_all.shape[0] != n:
            raise ValueError(f"{n} inputs but {y_all.shape[0]} labels; they must match.")
        for s in range(0, n, batch_size):
            yield inputs[s : s + batch_size], (None if y_all is None else y_all[s : s + batch_size])
        return
    if labels is not None:
        raise ValueError("labels are given separately only with a tensor of inputs; a loader yields (inputs, labels).")
    for batch in inputs:
        if isinstance(batch, (list, tuple)):
            x = batch[0]
            y = batch[1] if len(batch) > 1 else None
        else:
            x, y = batch, None
        yield x, (None if y is None else torch.as_tensor(y))


@torch.no_grad()
def model_logits(
    model: torch.nn.Module,
    inputs: Any,
    labels: Any = None,
    delta: torch.Tensor | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: Any = None,
    return_labels: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Logits (N, K) of ``model`` on ``inputs`` (+ ``delta`` if given), float32 on the CPU.

    The model sees pieces of ``batch_size`` inputs on the CPU, and on CUDA as many as its free
    memory allows, halved whenever it runs out (``nctv.memory``); a loader's batches are cut, never
    joined. With ``return_labels=True`` also returns the labels (N,) int64 seen on the way.
    """
    dev = model_device(model) if device is None else resolve_device(device)
    outs, ys, batches = [], [], 0
    d = None if delta is None else delta.to(dev)
    sizer = ChunkSizer(dev, batch_size)
    # A tensor is one batch: the sizer alone decides how many of its inputs go to the device at once.
    whole = max(int(inputs.shape[0]), 1) if isinstance(inputs, torch.Tensor) else batch_size
    with eval_mode(model):
        for x, y in iter_batches(inputs, labels, whole):
            def piece(xb: torch.Tensor, start: int, stop: int) -> torch.Tensor:
                return run_model(model, xb if d is None else xb + d).float().cpu()

            outs.extend(sizer.map_inputs(torch.as_tensor(x), piece))
            batches += 1
            if y is not None:
                ys.append(y.long().cpu())
    if not outs:
        raise ValueError("The split is empty: no inputs to run the model on.")
    z = torch.cat(outs)
    if return_labels:
        if len(ys) != batches:
            raise ValueError("Labels are needed but the inputs came without them.")
        return z, torch.cat(ys)
    return z
