"""How many images one call of the model takes, chosen from the device's memory, and what happens
when the device runs out of it.

Every pass of a model over a split (logits, the cached logits, the Neural Clamping fitters,
Theorem 1's gradient, NC (Eff.), the γ sweep, the initialisation study) hands its batches to a
:class:`ChunkSizer`. The sizer cuts each batch into consecutive pieces, runs the pass's function on
every piece and yields the results in order; the caller sums them (a batch's loss and gradient are
the sums of its pieces'). What a pass computes therefore does not depend on the pieces, only its
rounding does, and a recipe's SGD batch keeps its meaning however it is cut.

Size of a piece:

* CPU and MPS: the configured chunk (``batch_size``).
* CUDA: the configured chunk for the first piece, whose peak memory per image is measured
  (``torch.cuda.max_memory_allocated`` after a reset of the peak); from then on as many images as
  fit in ``FREE_MEMORY_SHARE`` of the free memory (``torch.cuda.mem_get_info`` plus the blocks
  PyTorch holds but does not use), at most ``MAX_CHUNK``. It may be larger or smaller than the
  configured chunk.
* Any device: a piece that runs out of memory (``torch.cuda.OutOfMemoryError``, or a
  ``RuntimeError`` that says so) is retried at half its size, and the sizer keeps the smaller
  size from then on. A pass fails, with :class:`DeviceOutOfMemoryError`, only when a single image
  does not fit.

A sizer lives as long as its split (or one ``model_logits`` call): what it learned about the
device holds for every later pass over the same split.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, TypeVar

import torch

#: Share of the device's free memory that one piece may take; the rest absorbs what the measured
#: piece did not show (fragmentation, kernels choosing larger workspaces for larger batches).
FREE_MEMORY_SHARE = 0.6
#: Most images in one call of the model, however much memory is free (beyond this, larger calls
#: gain no speed and the logits of a pass would grow for nothing).
MAX_CHUNK = 8192

T = TypeVar("T")


_local = threading.local()


@contextlib.contextmanager
def cancellation(check: Callable[[], None]):
    """Within the block, every model pass of this thread calls ``check()`` before each piece; it
    raises to cancel (the app's Stop). Passes are the only long loops, so a cancelled job ends
    within one piece of work, logits included."""
    previous = getattr(_local, "check", None)
    _local.check = check
    try:
        yield
    finally:
        _local.check = previous


def check_cancelled() -> None:
    check = getattr(_local, "check", None)
    if check is not None:
        check()


class DeviceOutOfMemoryError(MemoryError):
    """The device ran out of memory with a single image per call of the model."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for the device's out-of-memory errors (CUDA, MPS, and CPU allocations that fail)."""
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can still get on a CUDA device (None on other devices)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


class ChunkSizer:
    """Runs a function on pieces of a batch, as many images per piece as the device's memory allows.

    ``size`` is the current number of images per piece (see the module docstring for how it is
    chosen and how it backs off).
    """

    def __init__(self, device: Any, chunk: int):
        self.device = torch.device(device)
        if int(chunk) < 1:
            raise ValueError(f"batch_size must be a whole number >= 1; got {chunk!r}.")
        self.size = int(chunk)
        # Only CUDA reports free memory; elsewhere the configured chunk stands until it fails.
        self._measure = self.device.type == "cuda"

    def map(self, fn: Callable[[int, int], T], n: int) -> Iterator[T]:
        """``fn(start, stop)`` on consecutive pieces of ``range(n)``, results yielded in order.

        A piece that runs out of memory is retried at half its size; ``fn`` must leave no trace of
        a failed call (the caller accumulates only what is yielded).
        """
        start = 0
        while start < n:
            check_cancelled()
            stop = min(n, start + self.size)
            measure = self._measure
            base = self._start_measuring() if measure else 0
            failed = False
            try:
                result = fn(start, stop)
            except Exception as exc:  # noqa: BLE001 - only out-of-memory errors are handled, the rest re-raised
                if not is_out_of_memory(exc):
                    raise
                if stop - start == 1:
                    raise DeviceOutOfMemoryError(self._message(exc)) from exc
                failed = True
            if failed:
                # Outside the except block, so the failed piece's tensors are already released.
                self._back_off(stop - start)
                continue
            if measure:
                self._learn(base, stop - start)
            yield result
            start = stop

    def _start_measuring(self) -> int:
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def _learn(self, base: int, images: int) -> None:
        per_image = max(torch.cuda.max_memory_allocated(self.device) - base, 1) / images
        room = free_bytes(self.device) or 0
        self.size = max(1, min(MAX_CHUNK, int(FREE_MEMORY_SHARE * room / per_image)))
        self._measure = False

    def _back_off(self, failed: int) -> None:
        self.size = max(1, failed // 2)
        self._measure = False  # a size that failed is never grown back to
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _message(self, exc: BaseException) -> str:
        room = free_bytes(self.device) if self.device.type == "cuda" else None
        free = "" if room is None else f" ({room / 2**30:.2f} GiB free)"
        detail = " ".join(str(exc).split())[:300]
        return (f"The device {self.device}{free} ran out of memory even with a single image per call of the "
                "model: the model, its inputs and whatever else is on the device leave no room for one more "
                "image. Free memory on the device (other programs or models using it), use a smaller model or "
                f"input size, or run on the CPU (device='cpu'). The device said: {detail}")
