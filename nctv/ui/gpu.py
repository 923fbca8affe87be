"""The web app's GPU boundary: where a heavy handler's model work runs, what it may cost, and how
its progress, result and Stop cross to the server.

Every heavy handler (Calibrate, γ sweep, Initialisation, and the Try tab's picture on a large model)
hands its model work to ONE function made here by :func:`gpu_generator` (or :func:`gpu_call`). On a
laptop, a CPU Space or a dedicated GPU that function runs in the server process, as before. On a
ZeroGPU Space (``SPACES_ZERO_GPU`` set and the ``spaces`` package importable) it is wrapped by
``spaces.GPU``, which runs each call in a worker process forked from the server, with a GPU. That
contract shapes the code:

* arguments and results cross as pickles (a generator's items one by one): the work takes a split's
  description, never the split, and returns CPU tensors only (:func:`portable`); calibrators, which
  hold the model, are written to disk inside the call and left out of the result;
* nothing the worker changes in memory comes back: the model and the splits are made in the server
  before the call (:class:`GpuRun`'s ``prepare``, on the CPU), so the worker inherits them through
  the fork instead of decoding them again, and whatever the server needs afterwards (the test logits
  the Learn tab reads, the Try tab's out-of-distribution check) travels back in the result;
* each call has a ``duration``: :func:`estimate_seconds` computes it from the work (forward FLOPs ×
  pictures × passes at :func:`gpu_flops` a second, plus :data:`OVERHEAD_SECONDS`), and a run that
  cannot fit the Space's per-call limit or a visitor's daily quota is refused before it starts
  (:func:`check_fits`), in words, with what to lower;
* Stop closes the handler's generator, which closes the wrapped generator: the worker is ended.

The fork hazard (:func:`prepare_server`): torch's OpenMP pool, once used by the server, is inherited
by a forked child in a state it cannot use, and the child's first parallel operation waits for ever
(measured: Calibrate hung 10 minutes in ``torch.log_softmax``). On ZeroGPU the server therefore runs
its own torch work on one thread, so that it never starts that pool; the worker sets its own thread
count (:data:`WORKER_THREADS`) and starts a fresh pool.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from nctv import forkgate
from nctv.checks import env_number

log = logging.getLogger("nctv.ui")

# --------------------------------------------------------------------------- where the work runs

#: The process that serves the app (set by :func:`prepare_server`): a ZeroGPU worker is any other.
_SERVER_PID: int | None = None


def zero_gpu() -> bool:
    """True on a ZeroGPU Space: ``SPACES_ZERO_GPU`` is set and the ``spaces`` package imports."""
    if not os.environ.get("SPACES_ZERO_GPU"):
        return False
    try:
        import spaces  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


def in_worker() -> bool:
    """True inside a ZeroGPU worker: a process forked from the server for one GPU call."""
    return _SERVER_PID is not None and os.getpid() != _SERVER_PID


def prepare_server() -> None:
    """Make the server safe to fork, before it does any torch work (called by ``launch``).

    On ZeroGPU the server process runs torch on one intra-op thread. With more, its first parallel
    operation starts an OpenMP pool; a worker forked afterwards inherits the pool's bookkeeping but
    not its threads, and its own first parallel operation waits for them for ever. One thread costs
    the server little (its torch work is small: tables, diagrams, one picture) and the worker, which
    does the heavy part, starts a pool of its own (:func:`_enter_worker`). Elsewhere nothing forks
    and nothing changes."""
    global _SERVER_PID
    _SERVER_PID = os.getpid()
    if zero_gpu():
        forkgate.enable()  # and no fork while another thread computes (nctv.forkgate)
        torch.set_num_threads(1)
        log.info("ZeroGPU: the server computes on one thread; heavy work runs in spaces.GPU workers")
        if os.environ.get("MKL_DISABLE_FAST_MM") != "1":
            log.warning("ZeroGPU: MKL_DISABLE_FAST_MM is not 1, so a worker forked while a server thread is in "
                        "MKL may hang; start the server with app.py, or call nctv.settings.fork_safe_environment() "
                        "before importing torch")


def gate_handlers(blocks: Any) -> None:
    """On ZeroGPU, every handler of the app ``blocks`` computes inside a section of
    :mod:`nctv.forkgate`, so that no visitor's fork copies it half-way through a library call: a plain
    handler for its whole call, a streaming one for each step (not between steps, and not while it
    waits for a GPU worker: :class:`GpuRun`). Elsewhere, and for coroutine handlers (which compute
    nothing), nothing changes."""
    if not zero_gpu():
        return
    for block_fn in blocks.fns.values():
        fn = block_fn.fn
        if fn is None or getattr(fn, "_nctv_gated", False) or inspect.iscoroutinefunction(fn) \
                or inspect.isasyncgenfunction(fn):
            continue
        block_fn.fn = _gated(fn)


def _gated(fn: Callable) -> Callable:
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def steps(*args: Any, **kwargs: Any) -> Iterator[Any]:
            inner = fn(*args, **kwargs)
            try:
                while True:
                    with forkgate.computing():
                        try:
                            item = next(inner)
                        except StopIteration:
                            return
                    yield item
            finally:
                with forkgate.computing():
                    inner.close()

        steps._nctv_gated = True  # type: ignore[attr-defined]
        return steps

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with forkgate.computing():
            return fn(*args, **kwargs)

    call._nctv_gated = True  # type: ignore[attr-defined]
    return call


#: Intra-op threads of a ZeroGPU worker ($NCTV_WORKER_THREADS; default: every core).
WORKER_THREADS = "NCTV_WORKER_THREADS"


def _enter_worker() -> None:
    """In a freshly forked worker: a thread pool of its own, and a free one-worker gate (a lock the
    server held at the fork would be held for ever here)."""
    from nctv.ui import common

    if not in_worker():
        return
    common._ONE_WORKER = threading.Lock()
    threads = os.environ.get(WORKER_THREADS, "")
    torch.set_num_threads(int(threads) if threads.isascii() and threads.isdigit() and int(threads) > 0
                          else (os.cpu_count() or 1))


def model_device() -> torch.device:
    """Where the server keeps a loaded model: on the CPU on ZeroGPU (CUDA exists only inside a
    worker), else the best device here."""
    from nctv.inference import resolve_device

    return torch.device("cpu") if zero_gpu() and not in_worker() else resolve_device(None)


def placed(loaded: Any) -> Any:
    """``loaded`` (a zoo ``LoadedModel``) on the worker's device inside a ZeroGPU worker (the model
    it inherited from the server is on the CPU); unchanged elsewhere."""
    if in_worker():
        from nctv.inference import model_device as device_of, resolve_device

        target = resolve_device(None)
        if device_of(loaded.model) != target:
            loaded.model.to(target)
    return loaded


def portable(value: Any) -> Any:
    """``value`` with every tensor on the CPU, ready to cross to the server as a pickle (a CUDA
    tensor cannot: the server has no CUDA on ZeroGPU). Without CUDA in use, ``value`` itself."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return value
    import io

    class _ToCpu(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
                return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            return NotImplemented

    buf = io.BytesIO()
    _ToCpu(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return pickle.loads(buf.getvalue())


# --------------------------------------------------------------------------- what a run costs

#: Effective FLOP/s of a model pass on a ZeroGPU GPU (an H200 slice), fp32, FLOPs as
#: ``nctv.zoo.count_flops`` counts them (2 per multiply-add, matrix products and convolutions):
#: about 40 % of the card's fp32 peak, e.g. ResNet-101 (15.7 GFLOPs a picture) at ~1,900 pictures/s.
#: $NCTV_GPU_TFLOPS replaces it (a dedicated card, or a CPU standing in for one).
ZEROGPU_FLOPS = 30e12
#: A training pass (Neural Clamping's δ: forward plus the gradient to the input) costs this many forward passes.
BACKWARD_FACTOR = 3.0
#: Seconds of every call besides the model passes: the fork, CUDA's start, the model to the GPU.
OVERHEAD_SECONDS = 10.0
#: Passes over the calibration split of one fast Neural Clamping fit (measured: 7 to 12 on the panel models).
FAST_PASSES = 10
#: A fast fit's passes run the model in float64 (nctv.calibration.clamping_fit.exact_twin): counted as this
#: many fp32 passes. Measured 2.2 on a CPU; a data-centre GPU runs float64 at about half its fp32 rate and
#: without the tensor cores fp32 convolutions use, so 3 until a GPU measures it.
FLOAT64_PASS_FACTOR = 3.0
#: The longest one GPU call may run ($NCTV_GPU_MAX_SECONDS): ZeroGPU's default duration.
DEFAULT_MAX_SECONDS = 60
#: A visitor's daily ZeroGPU time with a free account ($NCTV_GPU_QUOTA_SECONDS): no run may need more.
DEFAULT_QUOTA_SECONDS = 300
#: Seconds of the logit-space fits that grow with the classes: (seconds, at calibration pictures, classes),
#: measured on one CPU thread (tests/test_stop.py); they scale with N × K².
LOGIT_FIT_SECONDS = {"Matrix Scaling": (5.0, 2000, 100), "MS-ODIR": (15.0, 2000, 100),
                     "Dir-ODIR": (15.0, 2000, 100)}
#: On ZeroGPU the Try tab runs a picture in the server when its model's forward pass is below this
#: many FLOPs ($NCTV_SERVER_MAX_FLOPS; the embedded models need 2.5 to 5 MFLOPs): a GPU call would cost more.
DEFAULT_SERVER_MAX_FLOPS = 1e9


def gpu_flops() -> float:
    """FLOP/s assumed for the GPU's model passes ($NCTV_GPU_TFLOPS × 10¹², else :data:`ZEROGPU_FLOPS`)."""
    tflops = env_number("NCTV_GPU_TFLOPS", ZEROGPU_FLOPS / 1e12, 0)
    return max(tflops, 1e-6) * 1e12


def max_seconds() -> float:
    """The longest one GPU call may run: $NCTV_GPU_MAX_SECONDS, else :data:`DEFAULT_MAX_SECONDS`."""
    return env_number("NCTV_GPU_MAX_SECONDS", DEFAULT_MAX_SECONDS, 1)


def quota_seconds() -> float:
    """A visitor's daily GPU time: $NCTV_GPU_QUOTA_SECONDS, else :data:`DEFAULT_QUOTA_SECONDS`."""
    return env_number("NCTV_GPU_QUOTA_SECONDS", DEFAULT_QUOTA_SECONDS, 1)


_FLOPS: dict[str, int] = {}
_FLOPS_LOCK = threading.Lock()


def forward_flops(loaded: Any) -> int:
    """Forward FLOPs of one picture through ``loaded`` (counted once per model)."""
    from nctv.zoo import count_flops

    with _FLOPS_LOCK:
        if loaded.name not in _FLOPS:
            _FLOPS[loaded.name] = count_flops(loaded.model, tuple(loaded.data_config["input_size"]))
        return _FLOPS[loaded.name]


@dataclass(frozen=True)
class Work:
    """The model passes of a run, in pictures: ``forward`` pictures through the model, ``trained``
    through it and back to the input, and ``extra_seconds`` of fits that do not pass through the model."""

    forward: float = 0.0
    trained: float = 0.0
    extra_seconds: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.forward + other.forward, self.trained + other.trained,
                    self.extra_seconds + other.extra_seconds)


def fit_work(nc: Any, n_cal: int, n_test: int) -> Work:
    """One Neural Clamping fit with options ``nc`` (every γ it tries) and its calibrated test pass."""
    passes = FAST_PASSES * FLOAT64_PASS_FACTOR if nc.fitter == "fast" else (nc.epochs or 100)
    return Work(forward=n_test, trained=passes * n_cal * len(nc.gamma_values))


def calibration_work(methods: list[str], nc: Any, n_cal: int, n_test: int, n_classes: int) -> Work:
    """A Calibrate run: the unperturbed logits of both splits, one fit per model-based method, and
    the logit-space fits that grow with the classes."""
    from nctv.experiment import NC_REFITS, NC_VARIANTS
    from nctv.methods import METHODS

    work = Work(forward=n_cal + n_test)
    for name in methods:
        spec = METHODS.get(name)
        # A method on the model's inputs, or an ablation row of Neural Clamping (counted as a fit of its own).
        if spec.needs_model if spec is not None else name in {**NC_VARIANTS, **NC_REFITS}:
            work += fit_work(nc, n_cal, n_test)
            if spec is not None:  # the calibration split once more, for the row's conformal sets
                work += Work(forward=n_cal)
        elif name in LOGIT_FIT_SECONDS:
            s, n0, k0 = LOGIT_FIT_SECONDS[name]
            work += Work(extra_seconds=s * (n_cal / n0) * (n_classes / k0) ** 2)
    return work


def sweep_work(nc: Any, gammas: list[float], n_cal: int, n_test: int) -> Work:
    """A γ sweep: the unperturbed logits, then per γ one fit (scored on both splits)."""
    return Work(forward=n_cal + n_test) + Work(forward=n_cal * len(gammas)) + Work(
        forward=fit_work(nc, n_cal, n_test).forward * len(gammas), trained=fit_work(nc, n_cal, n_test).trained * len(gammas))


def init_work(nc: Any, runs: int, n_cal: int, n_test: int) -> Work:
    """An initialisation study: the unperturbed logits, Theorem 1's δ̃ (one pass), then ``runs``
    fits from each of the two starts."""
    one = fit_work(nc, n_cal, n_test)
    return Work(forward=2 * n_cal + n_test) + Work(forward=one.forward * 2 * runs, trained=one.trained * 2 * runs)


def estimate_seconds(flops: float, work: Work) -> float:
    """Seconds of a GPU call: :data:`OVERHEAD_SECONDS` + FLOPs × (forward + BACKWARD_FACTOR × trained
    pictures) / :func:`gpu_flops` + the other fits' seconds."""
    return OVERHEAD_SECONDS + flops * (work.forward + BACKWARD_FACTOR * work.trained) / gpu_flops() + work.extra_seconds


def _nice_floor(n: float) -> int:
    """``n`` rounded down to two significant figures (at least 10): 10,734 → 10,000; 2,468 → 2,400."""
    if n < 10:
        return 10
    step = 10 ** max(0, int(math.floor(math.log10(n))) - 1)
    return int(n // step * step)


def check_fits(seconds: float, n_cal: int, n_test: int) -> int:
    """The duration to ask for (whole seconds), or a ValueError in words when ``seconds`` exceeds
    this Space's per-call limit or a visitor's daily quota: the estimate and the sizes that fit."""
    limit = min(max_seconds(), quota_seconds())
    if seconds <= limit:
        return max(1, math.ceil(seconds))
    which = ("this Space allows " + f"{limit:.0f} s a run" if max_seconds() <= quota_seconds()
             else f"a visitor's daily GPU quota is {limit:.0f} s")
    total = n_cal + n_test
    if total == 0:
        raise ValueError(f"This needs about {seconds:.0f} s of this Space's GPU; {which} — use a smaller model.")
    fraction = (limit - OVERHEAD_SECONDS) / max(seconds - OVERHEAD_SECONDS, 1e-9)
    if fraction * n_cal < 10:
        hint = "use fewer methods, the fast fitter or a smaller model"
    else:
        hint = (f"use {_nice_floor(fraction * n_cal):,} calibration and {_nice_floor(fraction * n_test):,} test "
                "pictures or fewer")
    raise ValueError(f"{total:,} pictures ({n_cal:,} calibration, {n_test:,} test): about {seconds:.0f} s on this "
                     f"Space's GPU; {which} — {hint}.")


def aborted_message(exc: BaseException, seconds: int) -> str | None:
    """The visitor's words for a GPU call that ZeroGPU ended (past its duration, or out of quota), or
    None for any other error."""
    text = str(getattr(exc, "message", exc))
    if "aborted" in text.lower() or isinstance(exc, TimeoutError):
        return (f"The GPU run was ended after the {seconds} s it was given (the estimate for this work). Try a "
                "smaller calibration or test size, or fewer methods.")
    if "quota" in text.lower():
        return f"{text} A smaller run needs less GPU time."
    return None


# --------------------------------------------------------------------------- the GPU functions


def _spaces_gpu(fn: Callable) -> Callable:
    """``spaces.GPU`` around ``fn`` on ZeroGPU, its duration the call's first argument; else ``fn``."""
    if not zero_gpu():
        return fn
    import spaces  # type: ignore[import-not-found]

    return spaces.GPU(duration=lambda seconds, *args, **kwargs: seconds)(fn)


def failed(exc: BaseException) -> tuple[str, str, str]:
    """An error in a GPU worker, as a value: ``("failed", kind, message)``. ZeroGPU hands a worker's
    exception back as ``gr.Error`` only when it is one; any other comes back as its class name alone
    ("ValueError"), its words lost. So the worker sends every error as an item, and the server raises
    it again (:func:`raise_failed`) with the visitor's words intact."""
    kind = "value" if isinstance(exc, ValueError) else type(exc).__name__
    if "OutOfMemory" in kind:
        return ("failed", "value", "The GPU ran out of memory for this run: try a smaller calibration or test size, "
                                   "or fewer methods.")
    return ("failed", kind, str(exc))


def _from_zerogpu(exc: BaseException) -> bool:
    """Whether ``exc`` is ZeroGPU's own (a ``gr.Error``: aborted, out of quota), not a worker's error
    that :func:`raise_failed` raised again in the server."""
    import gradio as gr

    return isinstance(exc, (gr.Error, TimeoutError))


def raise_failed(kind: str, message: str) -> None:
    """Raise the error a GPU worker sent (:func:`failed`): a ``ValueError`` in the visitor's words as it
    was, anything else as a ``RuntimeError`` naming its kind (the app reports it as a server fault)."""
    if kind == "value":
        raise ValueError(message)
    raise RuntimeError(f"{kind} in the GPU worker: {message}")


def gpu_generator(work: Callable[..., Any]) -> Callable[..., Iterator[tuple]]:
    """The GPU function of a streaming handler: called as ``fn(seconds, *args)``, it runs
    ``work(*args, report)`` in a :class:`nctv.ui.common.Worker` (``report`` hands progress items on,
    Stop ends it) and yields ``("items", [reported items])`` as they come, then once
    ``("done", portable result, warnings)``. ``seconds`` is the duration asked of ZeroGPU."""
    from nctv.ui.common import Worker

    def run(seconds: int, *args: Any) -> Iterator[tuple]:
        _enter_worker()
        worker = Worker(lambda report: work(*args, report))
        try:
            for items in worker.stream():
                yield ("items", items)
        except Exception as exc:  # noqa: BLE001 - sent back as a value: see failed()
            yield failed(exc)
            return
        yield ("done", portable(worker.result), list(worker.warnings))

    functools.update_wrapper(run, work)
    return _spaces_gpu(run)


def gpu_call(work: Callable[..., Any]) -> Callable[..., Any]:
    """The GPU function of a handler with one answer: ``fn(seconds, *args)`` = ``("done", portable
    work(*args))``, or :func:`failed`'s value when it raises (:func:`call` unpacks both)."""
    def run(seconds: int, *args: Any) -> Any:
        _enter_worker()
        try:
            return ("done", portable(work(*args)))
        except Exception as exc:  # noqa: BLE001 - sent back as a value: see failed()
            return failed(exc)

    functools.update_wrapper(run, work)
    return _spaces_gpu(run)


def server_max_flops() -> float:
    """Forward FLOPs below which the Try tab runs a picture in the server on ZeroGPU ($NCTV_SERVER_MAX_FLOPS)."""
    return env_number("NCTV_SERVER_MAX_FLOPS", DEFAULT_SERVER_MAX_FLOPS, 0)


def call(fn: Callable[..., Any], work: Callable[..., Any], args: tuple, loaded: Any, pictures: float) -> Any:
    """One answer of ``work(*args)``: on ZeroGPU through ``fn`` (made by :func:`gpu_call`) when a
    picture of the model ``loaded`` costs at least :func:`server_max_flops` — ``pictures`` forward
    passes, checked against the Space's limits — else in the server."""
    if not zero_gpu():
        return work(*args)
    flops = forward_flops(loaded)
    if flops < server_max_flops():
        return work(*args)
    seconds = check_fits(estimate_seconds(flops, Work(forward=pictures)), 0, 0)
    try:
        with forkgate.paused():  # waiting for the worker, not computing
            kind, *answer = fn(seconds, *args)
    except Exception as exc:  # noqa: BLE001 - ZeroGPU's own errors (gr.Error), said in words
        words = aborted_message(exc, seconds) if _from_zerogpu(exc) else None
        if words is None:
            raise
        raise ValueError(words) from None
    if kind == "failed":
        raise_failed(*answer)
    return answer[0]


class GpuRun:
    """A heavy handler's run, with :class:`nctv.ui.common.Worker`'s interface (``stream()`` yields
    lists of reported items; then ``result`` and ``warnings``).

    ``fn`` is made by :func:`gpu_generator`; ``args`` its picklable arguments. ``prepare(report)``,
    given, runs in the server first (in a Worker, so that its progress shows and Stop ends it): it
    loads what the worker should inherit (model, splits) and returns the call's estimated seconds; on
    ZeroGPU :func:`check_fits` then refuses a run that cannot fit, before any GPU time is spent.
    Elsewhere the estimate is not needed and ``prepare`` is not run (``fn`` loads the same itself)."""

    def __init__(self, fn: Callable[..., Iterator[tuple]], args: tuple,
                 prepare: Callable[[Callable], tuple[float, int, int]] | None = None):
        self._fn, self._args, self._prepare = fn, args, prepare
        self.result: Any = None
        self.warnings: list[str] = []
        self.seconds = 0

    def stream(self) -> Iterator[list]:
        from nctv.ui.common import Worker, _session, _streaming

        ended = _streaming(_session())
        try:
            self.seconds = DEFAULT_MAX_SECONDS
            if zero_gpu() and self._prepare is not None:
                first = Worker(self._prepare)
                yield from first.stream()
                seconds, n_cal, n_test = first.result
                self.seconds = check_fits(seconds, n_cal, n_test)
            yield from self._call()
        finally:
            ended()

    def _call(self) -> Iterator[list]:
        gen = self._fn(self.seconds, *self._args)
        try:
            while True:
                with forkgate.paused():  # waiting for the worker's next item, not computing
                    step = next(gen, None)
                if step is None:
                    break
                kind, *payload = step
                if kind == "items":
                    yield payload[0]
                elif kind == "failed":
                    raise_failed(*payload)
                else:
                    self.result, self.warnings = payload
        except Exception as exc:  # noqa: BLE001 - ZeroGPU's own errors (gr.Error), said in words
            words = aborted_message(exc, self.seconds) if zero_gpu() and _from_zerogpu(exc) else None
            if words is None:
                raise
            raise ValueError(words) from None
        finally:
            gen.close()  # Stop: the worker ends (in-process: its thread; on ZeroGPU: its process)
