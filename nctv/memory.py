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

Inputs held in host memory reach a CUDA device through :class:`HostStager`: two pinned blocks and
a copy stream, the next piece copied while the current one computes (``ChunkSizer.map_inputs``).

A sizer lives as long as its split (or one ``model_logits`` call): what it learned about the
device holds for every later pass over the same split.
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, TypeVar

import torch

from nctv import forkgate

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
    """Within the block, this thread's long loops call ``check()`` (:func:`check_cancelled`); it
    raises to cancel (the app's Stop). They are every model pass (before each piece), reading a
    split from its loader, every iteration of the logit-space fits (matrix and vector scaling, the
    ODIR cross-validation) and every chunk of the temperature grid search, so a cancelled job ends
    within one piece of work or one iteration, logits included."""
    previous = getattr(_local, "check", None)
    _local.check = check
    try:
        yield
    finally:
        _local.check = previous


def check_cancelled() -> None:
    """Calls the check of the enclosing :func:`cancellation` block, if any (it raises to cancel). It
    is also where a long computation gives way to a ZeroGPU server's fork (:func:`nctv.forkgate.checkpoint`)."""
    forkgate.checkpoint()
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
        self._staging: Staging | None = None  # pinned blocks for host-held inputs (map_inputs)

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

    def map_inputs(self, x: torch.Tensor, fn: Callable[[torch.Tensor, int, int], T],
                   overlap: bool | None = None) -> Iterator[T]:
        """``fn(piece, start, stop)`` on consecutive pieces of the batch ``x``, as :meth:`map`, with
        ``piece`` = rows ``start:stop`` of ``x`` on the sizer's device as float32. A host-held batch
        on CUDA is staged through pinned memory, the next piece's copy overlapping this piece's
        compute (:class:`HostStager`; ``overlap`` forces it on or off)."""
        with HostStager(x, self.device, overlap, self._staging) as stager:
            self._staging = stager.staging or self._staging  # its pinned blocks serve the next batch too
            yield from self.map(lambda start, stop: fn(stager.take(start, stop), start, stop), int(x.shape[0]))

    def map_threaded(self, x: torch.Tensor, fn: Callable[[torch.Tensor, int, int], T], workers: int) -> Iterator[T]:
        """``fn(piece, start, stop)`` on consecutive pieces of the CPU-held batch ``x``, results yielded in
        order as :meth:`map_inputs` yields them, the pieces computed side by side on ``workers`` threads
        that each run torch on one intra-op thread (:func:`piece_pool`).

        On a CPU a small model's operations on one piece split poorly over several cores; whole pieces
        side by side keep every core busy (a float64 pass of the embedded default about 15 % faster on 2
        cores, measured). Each piece is computed on one thread whatever ``workers`` is, so its result
        does not depend on the number of threads. At most ``2 × workers`` pieces are under way; a piece
        that runs out of memory is retried, with the rest of the batch, one piece at a time at half the
        size (:meth:`map`). ``fn`` must be safe to call from several threads at once.
        """
        n = int(x.shape[0])
        pool = piece_pool(workers)
        pending: collections.deque = collections.deque()

        def run(start: int, stop: int) -> T:
            return fn(x[start:stop].to(self.device, torch.float32), start, stop)

        start = 0
        try:
            while start < n or pending:
                while start < n and len(pending) < 2 * workers:
                    check_cancelled()
                    stop = min(n, start + self.size)
                    pending.append((start, stop, pool.submit(run, start, stop)))
                    start = stop
                first, last, future = pending.popleft()
                try:
                    result = future.result()
                except Exception as exc:  # noqa: BLE001 - only out-of-memory errors are handled, the rest re-raised
                    if not is_out_of_memory(exc):
                        raise
                    if last - first == 1:
                        raise DeviceOutOfMemoryError(self._message(exc)) from exc
                    _settle(pending)
                    self._back_off(last - first)
                    yield from self.map(lambda a, b: run(first + a, first + b), n - first)
                    return
                yield result
        finally:
            _settle(pending)

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


def _settle(pending: collections.deque) -> None:
    """Pieces still queued are dropped, those already running are waited for (their errors ignored)."""
    for *_, future in pending:
        future.cancel()
    for *_, future in pending:
        if not future.cancelled():
            with contextlib.suppress(Exception):
                future.result()
    pending.clear()


_POOLS: dict[tuple[int, int, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _niceness() -> int:
    """The calling thread's own niceness on Linux (a thread's threads inherit it); 0 elsewhere."""
    if not hasattr(os, "getpriority") or not sys.platform.startswith("linux"):
        return 0
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except OSError:
        return 0


def piece_pool(workers: int) -> ThreadPoolExecutor:
    """This process's ``workers`` threads for :meth:`ChunkSizer.map_threaded`, each running torch on one
    intra-op thread (made once per process and count, and kept).

    ``torch.set_num_threads(1)`` in a thread sets that thread's own OpenMP and MKL thread counts, and
    also the process-wide count that threads starting torch later copy. So the pool's threads are all
    started and set together, and the caller's count is put back at once: a thread that starts
    afterwards (a web app's request handler) gets the process's count, not 1. Keyed by process id
    too: a forked process has none of its parent's threads and makes its own pool. And by the calling
    thread's niceness, which the pool's threads inherit when it starts them: a web app's run, which
    computes below the server (``nctv.ui.common.yield_to_light_work``), has its pieces computed below
    the server too, and a caller at the server's priority is never given threads that cannot get it
    back."""
    key = (os.getpid(), int(workers), _niceness())
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is not None:
            return pool
        threads = torch.get_num_threads()
        ready = threading.Barrier(int(workers) + 1)

        def one_thread() -> None:
            torch.get_num_threads()  # torch's own first setting of this thread happens now, not later
            torch.set_num_threads(1)
            ready.wait()

        pool = ThreadPoolExecutor(max_workers=int(workers), thread_name_prefix="nctv-piece")
        for _ in range(int(workers)):
            pool.submit(one_thread)
        ready.wait()
        torch.set_num_threads(threads)
        _POOLS[key] = pool
        return pool


#: Host bytes of one pinned staging block. A piece larger than this is copied block by block, two
#: blocks alternating, so pinned memory stays at two blocks however large the pieces grow.
PINNED_BLOCK_BYTES = 64 << 20


class Staging:
    """A copy stream and two pinned host blocks of ``PINNED_BLOCK_BYTES`` for rows of one shape,
    on one CUDA device. A sizer keeps its staging for every later batch and pass over its split, so
    pinned memory is allocated once per split, not once per batch (a recipe's SGD step is a batch)."""

    def __init__(self, device: torch.device, row_shape: tuple[int, ...]):
        self.row_shape = row_shape
        self.stream = torch.cuda.Stream(device)
        self.rows = max(1, PINNED_BLOCK_BYTES // (4 * max(1, math.prod(row_shape))))
        self.blocks = [torch.empty((self.rows, *row_shape), dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)]
        for event in self.events:
            event.record(self.stream)


class HostStager:
    """Pieces of a host-held batch, moved to the device with the next piece's copy running while the
    current piece computes.

    On CUDA, for a batch held in (pageable) host memory: :meth:`take` hands out one piece on the
    device as float32 and at once starts copying the following piece of the same size, in a worker
    thread, through the two pinned blocks of a :class:`Staging` (``staging``, reused when its rows
    have the batch's shape) into a device tensor on its copy stream; the compute stream waits for
    that copy only when the piece is taken. The host-side copy into pinned memory and the transfer
    both run while the model computes. A request for another range than the one prefetched (the
    first piece after the sizer has measured the device, or a piece after a back-off) discards the
    prefetched one and copies synchronously; a prefetch that runs out of device memory is dropped
    likewise, never raised.

    Elsewhere (a batch already on the device, the CPU, MPS) pieces are plain slices, converted to
    float32 on the device, unless ``overlap=True`` asks for the worker thread anyway (the
    bookkeeping is then the same, without pinned memory or streams).
    """

    def __init__(self, x: torch.Tensor, device: Any, overlap: bool | None = None, staging: Staging | None = None):
        self.x = x
        self.device = torch.device(device)
        cuda = self.device.type == "cuda" and x.device.type == "cpu"
        self.overlap = cuda if overlap is None else bool(overlap)
        self.staging: Staging | None = None
        if cuda and self.overlap:
            row_shape = tuple(x.shape[1:])
            self.staging = staging if staging is not None and staging.row_shape == row_shape else Staging(self.device, row_shape)
        self._pending: tuple[int, int, Any] | None = None
        self._pool = None
        #: Pieces served from a prefetch, and pieces copied on request (for tests and the bench).
        self.prefetched = 0
        self.copied = 0

    def __enter__(self) -> "HostStager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def take(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the batch on the device, float32; starts the next piece's copy."""
        if not self.overlap:
            return self.x[start:stop].to(self.device, torch.float32, non_blocking=True)
        piece = self._claim(start, stop)
        if piece is None:
            piece = self._wait(self._copy(start, stop))
            self.copied += 1
        else:
            self.prefetched += 1
        n = int(self.x.shape[0])
        if stop < n:
            self._prefetch(stop, min(n, stop + (stop - start)))
        return piece

    def close(self) -> None:
        """Waits for a copy still running and releases the worker (the staging stays with its owner)."""
        self._drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- internals -----------------------------------------------------------------------

    def _claim(self, start: int, stop: int) -> torch.Tensor | None:
        """The prefetched piece if it is rows ``start:stop`` and arrived; None otherwise."""
        if self._pending is None:
            return None
        a, b, future = self._pending
        self._pending = None
        try:
            copied = future.result()
        except Exception as exc:  # noqa: BLE001 - a prefetch that ran out of memory is dropped
            if not is_out_of_memory(exc):
                raise
            return None
        if (a, b) != (start, stop):
            return None  # dropped: its device memory returns to the allocator here
        return self._wait(copied)

    def _drop(self) -> None:
        if self._pending is not None:
            _, _, future = self._pending
            self._pending = None
            with contextlib.suppress(Exception):
                future.result()

    def _prefetch(self, start: int, stop: int) -> None:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nctv-stage")
        self._pending = (start, stop, self._pool.submit(self._copy, start, stop))

    def _copy(self, start: int, stop: int) -> tuple[torch.Tensor, Any]:
        """Rows ``start:stop`` copied to the device; returns (tensor, event marking the end of the copy)."""
        st = self.staging
        if st is None:
            return self.x[start:stop].to(self.device, torch.float32, copy=True), None
        with torch.cuda.device(self.device), torch.cuda.stream(st.stream):
            out = torch.empty((stop - start, *st.row_shape), dtype=torch.float32, device=self.device)
            for k, a in enumerate(range(start, stop, st.rows)):
                b = min(stop, a + st.rows)
                block, event = st.blocks[k % 2], st.events[k % 2]
                event.synchronize()  # the block's previous transfer has left it
                block[: b - a].copy_(self.x[a:b])
                out[a - start : b - start].copy_(block[: b - a], non_blocking=True)
                event.record(st.stream)
            done = torch.cuda.Event()
            done.record(st.stream)
        return out, done

    def _wait(self, copied: tuple[torch.Tensor, Any]) -> torch.Tensor:
        out, done = copied
        if done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            out.record_stream(compute)  # its memory is not reused before the compute stream is done with it
        return out
