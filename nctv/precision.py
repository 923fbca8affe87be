"""The precision the frozen model runs in: float32, or mixed precision where it measures faster and
keeps the result.

Only the model's own layers change precision. δ, T, the objective, the gradients the fitters
accumulate and every sum stay in float32/float64: the model runs under ``torch.autocast`` and its
logits come back as float32 before anything else touches them.

Settings (``precision=`` of :func:`nctv.experiment.run_experiment` and ``nctv run --precision``):

* ``"fp32"``: no autocast. What every CPU and MPS run uses, and the setting that forces it anywhere.
* ``"bf16"``, ``"fp16"``: the model under autocast in that type (fp16 for GPUs without bf16).
* ``"auto"`` (the default): fp32 on the CPU and MPS. On CUDA, :func:`choose` measures the model once
  per run on one piece of the calibration split: a forward and backward pass to the input, the pass
  Neural Clamping repeats, in fp32 and in the reduced type (bf16 where the GPU has it, else fp16),
  each with and without channels_last for a convolutional model. It keeps the fastest setting that
  is at least ``MIN_SPEEDUP`` times faster than fp32 *and* agrees with fp32 on that piece: top-1
  classes agree on at least ``MIN_TOP1_AGREEMENT`` of the images and the mean absolute change of
  the top-1 confidence is at most ``MAX_CONFIDENCE_CHANGE`` (0.05 point of ECE: a change of every
  confidence by less than that moves ECE by less than that). Otherwise fp32.

The measurement exists because the gain depends on the model: mixed precision sped up a
Mixer-B/16 pass 4.4 times on an H100 but slowed ResNet-101 and ViT-S/16 down in a quick test.

channels_last changes how the model's convolution weights are laid out in memory during a run
(:func:`running`), never their values (``nctv.cache.model_fingerprint`` is unchanged); the
contiguous layout comes back when the run ends.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from nctv.settings import PRECISIONS


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """``model`` in eval mode for the duration; afterwards every module has its own training flag back.

    ``model.train(flag)`` afterwards would set the flag of every submodule to the top's: a wrapper in
    training mode (a new ``nn.Module`` is) around a model in eval mode would leave that model training,
    and its next forward pass would update its batch-norm statistics."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, flag in flags:
            m.training = flag


#: A reduced precision is kept only when at least this much faster than fp32 (timing noise aside).
MIN_SPEEDUP = 1.10
#: ... and only when its top-1 classes agree with fp32's on at least this share of the measured images,
MIN_TOP1_AGREEMENT = 0.995
#: ... and its top-1 confidences differ from fp32's by at most this much on average (0.05 point).
MAX_CONFIDENCE_CHANGE = 5e-4
#: Images in the measured piece, and timed repetitions per setting (after one warm-up).
MEASURE_IMAGES = 64
MEASURE_REPEATS = 3

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """How the model runs: ``dtype`` None is fp32; ``channels_last`` for 4-D inputs."""

    name: str = "fp32"
    channels_last: bool = False

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES.get(self.name)

    @property
    def label(self) -> str:
        return self.name + ("+channels_last" if self.channels_last else "")


FP32 = Precision()


@dataclass
class Choice:
    """What :func:`choose` decided and what it measured: ``seconds`` and ``agreement`` per label."""

    precision: Precision
    reason: str
    seconds: dict[str, float] = field(default_factory=dict)
    agreement: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision.label, "reason": self.reason, "seconds": self.seconds,
                "agreement": self.agreement}


_local = threading.local()


def current() -> Precision:
    """The precision of the model passes of this thread (fp32 outside :func:`use`)."""
    return getattr(_local, "precision", FP32)


@contextlib.contextmanager
def use(precision: Precision) -> Iterator[Precision]:
    """Within the block, every model pass of this thread runs in ``precision``."""
    previous = current()
    _local.precision = precision
    try:
        yield precision
    finally:
        _local.precision = previous


def run_model(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model(x)`` in the current precision, float32 logits back (the callers' sums never see a
    reduced type). Autocast covers the forward call only; a backward pass runs outside it."""
    p = current()
    if p.channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    if p.dtype is None:
        return model(x)
    with torch.autocast(x.device.type, dtype=p.dtype):
        z = model(x)
    return z.float()


def check_precision(name: Any) -> str:
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {name!r}.")
    return name


def _reduced_type(device: torch.device) -> str:
    return "bf16" if device.type != "cuda" or torch.cuda.is_bf16_supported() else "fp16"


def _has_convolutions(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


def _set_layout(model: torch.nn.Module, channels_last: bool) -> None:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.weight.data = m.weight.data.contiguous(memory_format=fmt)


def _time_pass(model: torch.nn.Module, x: torch.Tensor, precision: Precision) -> tuple[float, torch.Tensor]:
    """Seconds of one forward + backward to the input (best of the repeats) and the logits."""
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda *a: None)
    best, z = float("inf"), None
    with use(precision):
        for i in range(1 + MEASURE_REPEATS):
            xi = x.detach().clone().requires_grad_(True)
            sync()
            t0 = time.perf_counter()
            z = run_model(model, xi)
            torch.autograd.grad(z.logsumexp(1).sum(), xi)
            sync()
            if i > 0:
                best = min(best, time.perf_counter() - t0)
    return best, z.detach().float()


def agreement(reference: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and mean |Δ top-1 confidence| of ``logits`` against ``reference``."""
    p_ref, p = reference.softmax(1), logits.softmax(1)
    top = p_ref.argmax(1)
    return {"top1": float((p.argmax(1) == top).float().mean()),
            "confidence": float((p_ref.max(1).values - p.max(1).values).abs().mean())}


def pick(seconds: dict[str, float], agree: dict[str, dict[str, float]], candidates: dict[str, Precision]) -> Choice:
    """The rule of the module docstring on measured numbers (``seconds["fp32"]`` is the reference)."""
    base = seconds["fp32"]
    ok = {label: s for label, s in seconds.items() if label != "fp32"
          and agree[label]["top1"] >= MIN_TOP1_AGREEMENT and agree[label]["confidence"] <= MAX_CONFIDENCE_CHANGE}
    fast = {label: s for label, s in ok.items() if base / s >= MIN_SPEEDUP}
    if not fast:
        why = "no reduced precision agreed with fp32" if not ok else f"none was {MIN_SPEEDUP:.2f}× faster than fp32"
        return Choice(FP32, why, seconds, agree)
    label = min(fast, key=fast.get)
    return Choice(candidates[label], f"{base / fast[label]:.2f}× faster than fp32 and agrees with it", seconds, agree)


def choose(setting: str, model: torch.nn.Module, device: torch.device,
           sample: Callable[[], torch.Tensor] | None = None) -> Choice:
    """The precision for ``setting`` on ``model`` (on ``device``); ``sample()`` gives a batch of its
    inputs on that device when "auto" needs to measure (see the module docstring)."""
    setting = check_precision(setting)
    device = torch.device(device)
    if setting == "fp32":
        return Choice(FP32, "asked for")
    if setting != "auto":
        if setting == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("This GPU has no bfloat16; use precision='fp16' or 'auto'.")
        return Choice(Precision(setting), "asked for")
    if device.type != "cuda" or sample is None:
        return Choice(FP32, f"{device.type}: mixed precision is measured on CUDA GPUs only")
    return measure(model, sample()[:MEASURE_IMAGES])


def measure(model: torch.nn.Module, x: torch.Tensor, reduced: str | None = None) -> Choice:
    """Time fp32 and the reduced type (with and without channels_last for a convolutional model)
    on ``x`` and :func:`pick`. Runs on any device (the CPU too, for tests and the bench)."""
    reduced = reduced or _reduced_type(x.device)
    candidates = {"fp32": FP32, reduced: Precision(reduced)}
    if _has_convolutions(model) and x.dim() == 4:
        candidates.update({"fp32+channels_last": Precision("fp32", True),
                           f"{reduced}+channels_last": Precision(reduced, True)})
    seconds, logits = {}, {}
    with eval_mode(model):  # a batch-norm layer in training mode would update its statistics
        try:
            for label, p in candidates.items():
                _set_layout(model, p.channels_last)
                seconds[label], logits[label] = _time_pass(model, x, p)
        finally:
            _set_layout(model, False)
    agree = {label: agreement(logits["fp32"], z) for label, z in logits.items()}
    return pick(seconds, agree, candidates)


@contextlib.contextmanager
def running(model: torch.nn.Module, precision: Precision) -> Iterator[Precision]:
    """Within the block, ``model`` runs in ``precision`` in this thread (with channels_last, its
    convolution weights are laid out so, and the contiguous layout comes back afterwards; otherwise
    the model is not touched, so that other threads using it see no change)."""
    if precision.channels_last:
        _set_layout(model, True)
    try:
        with use(precision):
            yield precision
    finally:
        if precision.channels_last:
            _set_layout(model, False)
