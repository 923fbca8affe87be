"""The machinery under Neural Clamping: the split, full passes of a frozen model, and the fitters.

Objective, for a perturbation δ (the shape of one model input) and s = log T:

    F(δ, s) = mean_i FL_γ(f(x_i + δ) · e^{−s}, y_i) + λ‖δ‖²₂

Cost is counted in *passes* over the calibration split: a forward pass with a backward pass to the
input counts 1, a forward pass alone counts 0.5 (the backward to the input costs about one forward;
no weight gradients are ever computed). Partial passes count in proportion to their size.

Everything here keeps the model in eval mode with its parameters' ``requires_grad`` off for the
duration of a fit (both restored afterwards), and asks autograd only for gradients of δ and s, so
no parameter ever receives a ``.grad`` and the weights are never written.
"""
from __future__ import annotations

import contextlib
import copy
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from nctv import distributed
from nctv.calibration.base import focal_loss
from nctv.calibration.lbfgs import two_loop
from nctv.calibration.temperature import solve_log_temperature
from nctv.inference import iter_batches
from nctv.memory import ChunkSizer, check_cancelled
from nctv.precision import eval_mode, run_model

#: Splits up to this many bytes (float32 inputs) are gathered once and kept on the compute device;
#: larger ones are streamed chunk by chunk on every pass.
DEVICE_CACHE_BYTES = 1 << 30

#: Temperatures searched by the exact 1-D solve on cached logits: T in [1e-2, 1e2].
_LOG_T_BOUNDS = (math.log(1e-2), math.log(1e2))


class StopFitting(Exception):
    """Raise from a fitting callback to end the fit early.

    The fit then ends cleanly: the fast fitter keeps the best point it has evaluated, the paper
    fitter keeps δ and T as they are after the last SGD step; ``objective_`` is computed for that
    state and ``stopped_early_`` is True.
    """


# --------------------------------------------------------------------------------------------
# The split's inputs as the fitters stream them
# --------------------------------------------------------------------------------------------


class InputStream:
    """A labelled (or unlabelled) split as the fitters see it: its inputs streamed to the device in batches.

    A tensor of inputs, or anything that yields ``(inputs, labels)`` batches. The inputs are held
    on ``device`` when they fit in ``DEVICE_CACHE_BYTES``. A ``DataLoader`` over a map-style dataset
    that is larger than that is streamed: each pass builds a loader over its dataset (same workers
    and collate function) in the order asked for, so passes are repeatable even when the given
    loader shuffles. Any other iterable of batches is gathered into memory once.

    In a process group (``nctv.distributed``) every process is given the whole split and keeps its
    block of rows (``rows``); ``n`` and ``labels`` stay those of the whole split. Passes then run
    over this process's rows only; ``gather`` joins their per-row results (logits) across processes,
    and the fitters add their sums across processes (``nctv.distributed.all_reduce_sum``).
    """

    def __init__(self, inputs: Any, labels: Any, device: torch.device, batch_size: int, need_labels: bool = True):
        self.device = device
        self.batch_size = batch_size
        self._passes = 0.0
        self._loader = None
        self.piece_threads = False  # see use_piece_threads
        # One sizer for forward passes, one for passes that also go backward (more memory per image).
        self._sizers = {False: ChunkSizer(device, batch_size), True: ChunkSizer(device, batch_size)}
        if isinstance(inputs, torch.Tensor):
            x = inputs.detach()
            y = None if labels is None else _as_label_tensor(labels, x.shape[0])
        else:
            if labels is not None:
                raise ValueError("labels are given separately only with a tensor of inputs; a loader yields (inputs, labels).")
            x, y = self._gather_or_stream(inputs)
        if x is not None:
            if x.ndim < 2 or x.shape[0] == 0:
                raise ValueError(f"inputs must be a batch (N, ...) with N >= 1; got shape {tuple(x.shape)}.")
            if not x.is_floating_point():
                x = x.float()
            self.n = int(x.shape[0])
            self.input_shape = tuple(x.shape[1:])
        self.rows = distributed.shard(self.n)
        if x is not None:
            x = x[self.rows]
            if x.numel() * 4 <= DEVICE_CACHE_BYTES:
                x = x.to(device, torch.float32)
        self.x = x
        self.labels = None if y is None else y.to(device)
        if need_labels and self.labels is None and self._loader is None:
            raise ValueError("labels are needed: pass labels=... with a tensor of inputs, or a loader of (inputs, labels).")
        self.need_labels = need_labels

    @property
    def passes(self) -> float:
        """Passes over the split so far (forward + backward = 1, forward only = 0.5); only ``count`` adds."""
        return self._passes

    def limit_pieces(self, size: int) -> None:
        """Call the model on pieces of at most ``size`` images (the pieces' sums are the same to rounding)."""
        for sizer in self._sizers.values():
            sizer.size = max(1, min(sizer.size, int(size)))

    def use_piece_threads(self) -> None:
        """On the CPU, compute the pieces of a held batch side by side, one thread each, as many threads
        as torch's intra-op count at the time of the pass (``ChunkSizer.map_threaded``); one thread: as before."""
        self.piece_threads = self.device.type == "cpu"

    def count(self, passes: float) -> None:
        """Add ``passes`` to the split's pass count, the one count every fit on the split reports."""
        self._passes += passes

    def _gather_or_stream(self, inputs: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        dataset = getattr(inputs, "dataset", None)
        if isinstance(inputs, torch.utils.data.DataLoader) and _is_map_style(dataset):
            first = dataset[0]
            item = first[0] if isinstance(first, (tuple, list)) else first
            if torch.as_tensor(item).numel() * 4 * len(dataset) > DEVICE_CACHE_BYTES:
                self._loader = inputs
                self.n = len(dataset)
                self.input_shape = tuple(torch.as_tensor(item).shape)
                return None, None
        xs, ys = [], []
        for xb, yb in iter_batches(inputs):
            check_cancelled()  # reading a large split from its loader takes a while, with no model pass yet
            xs.append(torch.as_tensor(xb).detach().cpu())
            if yb is not None:
                ys.append(yb.long().cpu())
        if not xs:
            raise ValueError("The split is empty: the loader yielded no batches.")
        x = torch.cat(xs)
        if ys and (len(ys) != len(xs) or sum(len(y) for y in ys) != len(x)):
            raise ValueError("Every batch must be (inputs, labels) with one label per input.")
        return x, (torch.cat(ys) if ys else None)

    def batches(self, order: torch.Tensor | None = None, batch_size: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Yield ``(x, y)`` batches in natural order or in ``order``.

        ``batch_size`` images per batch (a recipe's batch); None: as large as the split allows (all
        of a held split, the configured ``batch_size`` of a streamed one), for passes whose batches
        mean nothing. A held split's batches stay where it holds them; ``pieces`` moves them to the
        device piece by piece. A streamed split's batches arrive on the device.

        In a process group, natural order walks this process's rows; ``order`` (a permutation of the
        whole split) is cut into the whole split's batches and each batch yields its part in this
        process's rows, possibly none, so that every process walks the same batches.
        """
        if self._loader is not None:
            yield from self._stream(order, batch_size or self.batch_size)
            return
        y_all = self.local_labels()
        if order is None:
            bs = batch_size or len(self.x)
            for s in range(0, len(self.x), bs):
                yield self.x[s : s + bs], (None if y_all is None else y_all[s : s + bs])
            return
        bs = batch_size or self.n
        for s in range(0, self.n, bs):
            idx = self._local(order[s : s + bs])
            yield self.x[idx.to(self.x.device)], (None if y_all is None else y_all[idx.to(y_all.device)])

    def local_labels(self) -> torch.Tensor | None:
        """The labels of this process's rows (all of them with one process)."""
        return self.labels if self.labels is None or self._whole() else self.labels[self.rows]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Rows computed on this process's rows, joined into the whole split's in split order."""
        return distributed.all_gather_rows(local, self.n)

    def _whole(self) -> bool:
        return self.rows == slice(0, self.n)

    def _local(self, idx: torch.Tensor) -> torch.Tensor:
        """Of the split positions ``idx``, those in this process's rows, as positions within them."""
        if self._whole():
            return idx
        keep = (idx >= self.rows.start) & (idx < self.rows.stop)
        return idx[keep] - self.rows.start

    def pieces(self, batch: tuple[torch.Tensor, torch.Tensor | None], fn: Callable[[torch.Tensor, Any], Any],
               backward: bool = False) -> Iterator[Any]:
        """``fn(x, y)`` on consecutive pieces of one batch, as large as the device's memory allows
        (float32 inputs on the device), results in order. ``backward``: ``fn`` differentiates
        through the model, which needs more memory per image than a forward pass alone."""
        x, y = batch
        sizer = self._sizers[backward]

        def run(xb: torch.Tensor, start: int, stop: int):
            return fn(xb, None if y is None else y[start:stop])

        workers = torch.get_num_threads() if self.piece_threads else 1
        if workers > 1:
            return sizer.map_threaded(x, run, workers)
        return sizer.map_inputs(x, run)

    def map(self, fn: Callable[[torch.Tensor, Any], Any], backward: bool = False) -> Iterator[Any]:
        """``fn(x, y)`` over the whole split in natural order, piece by piece (see ``pieces``)."""
        for batch in self.batches():
            yield from self.pieces(batch, fn, backward)

    def _stream(self, order: torch.Tensor | None, bs: int):
        src = self._loader
        start, stop = self.rows.start, self.rows.stop
        if order is None:
            groups = [list(range(s, min(s + bs, stop))) for s in range(start, stop, bs)]
        else:
            groups = [(self._local(order[s : s + bs]) + start).tolist() for s in range(0, self.n, bs)]
        loader = torch.utils.data.DataLoader(
            src.dataset, batch_sampler=[g for g in groups if g], num_workers=src.num_workers,
            collate_fn=src.collate_fn, pin_memory=src.pin_memory or self.device.type == "cuda",
        )
        collect = order is None and self.labels is None
        seen = []
        batches = iter_batches(loader)
        for group in groups:
            if not group:  # none of this batch's rows are this process's
                yield (torch.empty((0, *self.input_shape), device=self.device),
                       torch.empty(0, dtype=torch.long, device=self.device))
                continue
            xb, yb = next(batches)
            if yb is not None:
                yb = yb.long().to(self.device)
                if collect:
                    seen.append(yb)
            elif self.need_labels:
                raise ValueError("The loader yields inputs without labels; it must yield (inputs, labels).")
            yield torch.as_tensor(xb).to(self.device, torch.float32, non_blocking=True), yb
        if collect and seen:
            self.labels = self.gather(torch.cat(seen))


def _is_map_style(dataset: Any) -> bool:
    return (
        dataset is not None
        and not isinstance(dataset, torch.utils.data.IterableDataset)
        and hasattr(dataset, "__getitem__")
        and hasattr(dataset, "__len__")
        and len(dataset) > 0
    )


def _as_label_tensor(labels: Any, n: int) -> torch.Tensor:
    y = torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels)
    if y.ndim != 1 or y.shape[0] != n:
        raise ValueError(f"{n} inputs need {n} labels in a 1-D array; got labels of shape {tuple(y.shape)}.")
    if y.is_floating_point() and not bool((y == y.round()).all()):
        raise ValueError("labels must be whole numbers (class indices).")
    return y.long()


def check_label_range(labels: torch.Tensor, k: int) -> None:
    if int(labels.min()) < 0 or int(labels.max()) >= k:
        raise ValueError(
            f"labels must lie in [0, {k}) for a model with {k} outputs; found values from "
            f"{int(labels.min())} to {int(labels.max())}."
        )


@contextlib.contextmanager
def frozen(model: torch.nn.Module):
    """Eval mode and no parameter gradients for the duration; the caller's flags come back after (each
    module's and each parameter's own: ``nctv.precision.eval_mode``)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    with eval_mode(model):
        for p, _ in flags:
            p.requires_grad_(False)
        try:
            yield model
        finally:
            for p, flag in flags:
                p.requires_grad_(flag)


# --------------------------------------------------------------------------------------------
# Passes of the model
# --------------------------------------------------------------------------------------------


def checked_logits(z: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if not isinstance(z, torch.Tensor) or z.ndim != 2 or z.shape[1] < 2:
        raise ValueError(
            "the model must return logits of shape (batch, classes) with at least 2 classes; "
            f"got {type(z).__name__} of shape {tuple(getattr(z, 'shape', ()))}."
        )
    return z.to(dtype)


#: The arithmetic of the fast fitter's passes (see ``exact_twin``).
EXACT_DTYPE = torch.float64


#: Images per piece of a float64 pass on the CPU, at most: small pieces keep a small model's
#: activations in the cache (on one thread a pass of the embedded default takes the same time with
#: pieces of 128 as of 256, and 11 % less than with 512), and the pieces run side by side, one thread
#: each (``use_piece_threads``: on 2 cores 15 % faster than pieces of 256 on two threads each, measured).
EXACT_CPU_PIECE = 128


def exact_twin(model: torch.nn.Module, device: torch.device,
               input_shape: tuple[int, ...] | None = None) -> torch.nn.Module | None:
    """A float64 copy of ``model`` for the fast fitter's passes, or None where the device has no float64 (MPS).

    Why float64: a ReLU network's loss is piecewise smooth in δ. In float32 the rounding of one CPU's
    kernels differs from another's by about 1e-7, enough to put a few of the split's millions of
    ReLU and max-pooling decisions on the other side, and each one moves the summed gradient by
    about 1/N of one image's gradient (1e-5 to 1e-4 of it). L-BFGS scales such a change by the
    inverse curvature of the flat directions λ holds weakly, and the next passes see δ's that differ
    more, so more decisions change: on the embedded default ‖δ‖₂ moved by 1 % and δ by 7 % across
    ATEN_CPU_CAPABILITY settings after 9 passes. In float64 the kernels' results differ by about
    1e-16, no decision changes, and the path is the same to about 1e-15 on every kernel set (measured).
    The copy is the caller's model untouched (its weights are read once; the model is never changed).

    Given ``input_shape`` (one input's), every batch normalisation that directly follows a
    convolution is folded into it (``fold_batch_norms``): the same function to about 1e-15, one
    operation less, forward and backward (a float64 pass of the embedded default 15–20 % cheaper, measured).
    """
    if device.type == "mps":
        return None
    twin = copy.deepcopy(model).to(EXACT_DTYPE)
    for p in twin.parameters():
        p.requires_grad_(False)
    twin.eval()
    if input_shape is not None:
        twin = fold_batch_norms(twin, input_shape)
    if device.type == "cpu":  # float64 convolutions run about 1.5 times faster channels-last there (measured)
        twin = twin.to(memory_format=torch.channels_last)
        if input_shape is not None:
            twin = densify_small_convs(twin, input_shape)
    return twin


def fold_batch_norms(model: torch.nn.Module, input_shape: tuple[int, ...]) -> torch.nn.Module:
    """``model`` (eval mode) with each convolution + batch normalisation pair folded into one convolution.

    Folded by ``torch.fx`` (the pattern conv → BN where the BN alone reads the conv's output). The
    folded model is kept only when it can be traced and, on a fixed probe of two inputs of
    ``input_shape``, gives the model's logits to 1e-9 relative; otherwise, or when nothing was folded,
    ``model`` is returned as it is (a model fx cannot trace, or a BN on batch statistics, keeps its layers).
    """
    def norms(m: torch.nn.Module) -> int:
        return sum(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in m.modules())

    if not norms(model):
        return model
    try:
        from torch.fx.experimental.optimization import fuse

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            folded = fuse(model, inplace=False)
        if norms(folded) == norms(model):  # nothing folded (e.g. every BN on batch statistics)
            return model
        probe = _probe(model, input_shape)
        with torch.no_grad():
            want, got = model(probe), folded(probe)
        if not _same_logits(want, got):
            return model
    except Exception:  # noqa: BLE001 - any model fx cannot trace or fold keeps its own layers
        return model
    for p in folded.parameters():
        p.requires_grad_(False)
    return folded.eval()


def _probe(model: torch.nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor:
    """Two fixed inputs of ``input_shape`` (``golden_pattern``) on the device and in the type of ``model``'s weights."""
    weight = next(model.parameters())
    return golden_pattern(2 * math.prod(input_shape)).view(2, *input_shape).to(weight.device, weight.dtype)


def _same_logits(want: Any, got: Any) -> bool:
    """Whether a rewritten model's logits ``got`` are the model's ``want`` to 1e-9 relative (and finite)."""
    return (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape == want.shape
            and bool(torch.isfinite(got).all())
            and float((got - want).abs().max()) <= 1e-9 * max(float(want.abs().max()), 1.0))


#: A convolution becomes a dense linear map when that map has at most this many times its
#: multiply-adds per image (see ``densify_small_convs``) ...
DENSE_CONV_RATIO = 2.0
#: ... and at most this many entries (float64: 32 MiB).
DENSE_CONV_MAX_ENTRIES = 1 << 22


class DenseConv(torch.nn.Module):
    """A convolution on inputs of one fixed shape, run as the dense matrix of its linear map.

    ``matrix[(h, w, c), (h', w', c')]`` is the weight joining input element (c, h, w) to output
    element (c', h', w') (0 where the kernel does not join them), so ``x @ matrix`` is the
    convolution of a channels-last ``x`` flattened: the same products summed in another order, in
    one matrix product. Inputs of another shape go through the original convolution.
    """

    def __init__(self, conv: torch.nn.Conv2d, in_shape: tuple[int, int, int]):
        super().__init__()
        c, h, w = in_shape
        n_in = c * h * w
        with torch.no_grad():
            # One image per input element, holding 1 there: each output is then one weight times 1
            # plus zeros, so the matrix's entries are the weights themselves, exactly.
            basis = torch.eye(n_in, dtype=conv.weight.dtype, device=conv.weight.device)
            basis = basis.view(n_in, h, w, c).permute(0, 3, 1, 2)
            out = torch.nn.functional.conv2d(basis, conv.weight, None, conv.stride, conv.padding,
                                             conv.dilation, conv.groups)
        self.conv = conv
        self.in_shape = (c, h, w)
        self.out_shape = tuple(out.shape[1:])
        self.register_buffer("matrix", out.permute(0, 2, 3, 1).reshape(n_in, -1).contiguous())
        bias = None
        if conv.bias is not None:
            bias = conv.bias.detach().view(1, 1, -1).expand(*self.out_shape[1:], -1).reshape(-1).clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or tuple(x.shape[1:]) != self.in_shape or x.dtype != self.matrix.dtype:
            return self.conv(x)
        n = x.shape[0]
        flat = x.permute(0, 2, 3, 1).reshape(n, -1)  # a view when x is channels-last
        y = flat @ self.matrix if self.bias is None else torch.addmm(self.bias, flat, self.matrix)
        c, h, w = self.out_shape
        return y.view(n, h, w, c).permute(0, 3, 1, 2)  # channels-last in memory


def densify_small_convs(model: torch.nn.Module, input_shape: tuple[int, ...]) -> torch.nn.Module:
    """``model`` with each convolution on small pictures replaced by its dense linear map (``DenseConv``).

    On the CPU a float64 convolution (torch's ``_slow_conv2d``) is slow on pictures of a few pixels:
    on the embedded default a 3×3 convolution on 2×2 or 1×1 pictures took 6–20 times as long as the
    matrix product of its dense map, forward and backward (measured). A convolution is replaced when
    it is called once per forward pass, with zero padding, on inputs of one shape, and its dense map
    has at most ``DENSE_CONV_RATIO`` times its multiply-adds and ``DENSE_CONV_MAX_ENTRIES`` entries.
    The result is kept only when a fixed probe of two inputs of ``input_shape`` gives the model's
    logits to 1e-9 relative; otherwise ``model`` is returned as it is. The model is changed in place.
    """
    seen: dict[str, list[tuple]] = {}  # conv's name -> (input shape, output shape) of each call
    hooks = []
    for name, mod in model.named_modules():
        if type(mod) is torch.nn.Conv2d and mod.padding_mode == "zeros":
            hooks.append(mod.register_forward_hook(
                lambda m, inp, out, name=name: seen.setdefault(name, []).append(
                    (tuple(inp[0].shape[1:]), tuple(out.shape[1:])) if inp[0].dim() == 4 else ())))
    if not hooks:
        return model
    probe = _probe(model, input_shape).contiguous(memory_format=torch.channels_last)
    try:
        with torch.no_grad():
            want = model(probe)
    except Exception:  # noqa: BLE001 - a model that cannot run the probe keeps its layers
        return model
    finally:
        for h in hooks:
            h.remove()
    chosen = {}
    for name, calls in seen.items():
        if len(calls) != 1 or not calls[0]:
            continue
        (in_shape, out_shape) = calls[0]
        conv = model.get_submodule(name)
        n_in, n_out = math.prod(in_shape), math.prod(out_shape)
        macs = n_out * (conv.in_channels // conv.groups) * math.prod(conv.kernel_size)
        if n_in * n_out <= min(DENSE_CONV_RATIO * macs, DENSE_CONV_MAX_ENTRIES):
            chosen[name] = DenseConv(conv, in_shape)
    if not chosen:
        return model
    originals = {name: model.get_submodule(name) for name in chosen}

    def put(modules: dict[str, torch.nn.Module]) -> None:
        for name, mod in modules.items():
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, mod)

    put(chosen)
    try:
        with torch.no_grad():
            ok = _same_logits(want, model(probe))
    except Exception:  # noqa: BLE001 - anything the dense maps break keeps the convolutions
        ok = False
    if not ok:
        put(originals)
    return model


@dataclass(frozen=True)
class Problem:
    """One calibration problem: model, split, loss settings and the optional input clamp.

    ``penalty`` is the regulariser's form: "squared" = λ‖δ‖²₂ (the paper's text), "norm" = λ‖δ‖₂
    (the authors' released code). ``prob_floor`` > 0 clamps p_y to [floor, 1 − floor] inside the
    focal loss (γ > 0 only), as the authors' ``FocalLoss`` does with 1e-7.
    """

    model: torch.nn.Module
    split: InputStream
    gamma: float
    weight_decay: float
    clamp_range: tuple[torch.Tensor, torch.Tensor] | None = None
    penalty: str = "squared"
    prob_floor: float = 0.0
    exact: torch.nn.Module | None = None  # the float64 twin every pass uses when given (exact_twin)

    @property
    def dtype(self) -> torch.dtype:
        """The type of the inputs, δ and logits of this problem's passes."""
        return torch.float32 if self.exact is None else EXACT_DTYPE

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        x = x.to(self.dtype)
        if delta is not None:
            x = x + delta.to(self.dtype)
            if self.clamp_range is not None:
                x = torch.clamp(x, self.clamp_range[0].to(self.dtype), self.clamp_range[1].to(self.dtype))
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The model's logits of inputs ``x`` in this problem's arithmetic (``dtype``)."""
        if self.exact is not None:
            if x.dim() == 4 and x.device.type == "cpu":
                x = x.contiguous(memory_format=torch.channels_last)
            return checked_logits(self.exact(x), self.dtype)
        return checked_logits(run_model(self.model, x))

    def logits(self, delta: torch.Tensor | None) -> torch.Tensor:
        """Logits f(x + δ) over the split in natural order, on the device (0.5 pass)."""
        with torch.no_grad():
            out = list(self.split.map(lambda x, _: self.forward(x, delta)))
        self.split.count(0.5)
        return self.split.gather(torch.cat(out))

    def loss(self, z: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """FL_γ of already tempered logits (with the optional probability clamp)."""
        if self.prob_floor > 0 and self.gamma > 0:
            return clamped_focal_loss(z, y, self.gamma, self.prob_floor, reduction)
        return focal_loss(z, y, self.gamma, reduction=reduction)

    def penalty_term(self, delta: torch.Tensor) -> torch.Tensor:
        """λ‖δ‖²₂ or λ‖δ‖₂ as a differentiable tensor."""
        if self.penalty == "norm":
            return self.weight_decay * torch.linalg.vector_norm(delta)
        return self.weight_decay * (delta**2).sum()

    def value_and_grad(self, delta: torch.Tensor, log_t: float) -> tuple[float, torch.Tensor, float, torch.Tensor]:
        """F, ∂F/∂δ, ∂F/∂s and the logits f(x + δ), exactly over the split (1 pass).

        In a process group each process sums over its rows and the sums are added across processes."""
        d = delta.detach().to(self.dtype).requires_grad_(True)
        s = torch.tensor(float(log_t), dtype=self.dtype, device=d.device, requires_grad=True)
        n = self.split.n
        total = torch.zeros((), dtype=accumulation_dtype(d.device), device=d.device)
        g_d = torch.zeros_like(d)
        g_s = torch.zeros((), dtype=self.dtype, device=d.device)
        out = []

        def piece(x: torch.Tensor, y: torch.Tensor):
            z = self.forward(x, d)
            loss = self.loss(z * torch.exp(-s), y, reduction="sum") / n
            return (loss.detach(), *torch.autograd.grad(loss, (d, s)), z.detach())

        for loss, gd, gs, z in self.split.map(piece, backward=True):
            g_d += gd
            g_s += gs
            total += loss
            out.append(z)
        self.split.count(1.0)
        total, g_d, g_s = distributed.all_reduce_sum(total, g_d, g_s)
        d64 = d.detach().to(accumulation_dtype(d.device)).requires_grad_(True)
        reg = self.penalty_term(d64)
        (g_reg,) = torch.autograd.grad(reg, d64)
        g_d += g_reg.to(g_d.dtype)
        return float(total) + float(reg.detach()), g_d, float(g_s), self.split.gather(torch.cat(out))

    def objective_from_logits(self, z: torch.Tensor, delta: torch.Tensor, log_t: float) -> float:
        """F at (δ, log T) from the logits f(x + δ) already computed over the split."""
        zz = z.to(accumulation_dtype(z.device)) * math.exp(-log_t)
        with torch.no_grad():
            data = self.loss(zz, self.split.labels.to(z.device), reduction="mean")
            reg = self.penalty_term(delta.to(accumulation_dtype(delta.device)))
        return float(data) + float(reg)

    def check_labels(self) -> None:
        """Labels within the model's classes, checked on one sample's logits before any fitting."""
        if self.split.labels is None:  # a streamed split: checked once its first pass has read them
            return
        one = next(self.split.batches(batch_size=1))
        with torch.no_grad():
            (z,) = self.split.pieces(one, lambda x, _: self.forward(x, None))
        check_label_range(self.split.labels, z.shape[1])


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 for long sums, except on MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def mean_focal(z: torch.Tensor, y: torch.Tensor, gamma: float, log_t: float) -> float:
    zz = z.to(accumulation_dtype(z.device))
    return float(focal_loss(zz * math.exp(-log_t), y.to(z.device), gamma, reduction="mean"))


def clamped_focal_loss(z: torch.Tensor, y: torch.Tensor, gamma: float, floor: float,
                       reduction: str = "mean") -> torch.Tensor:
    """−(1 − p)^γ log p with p = softmax(z)_y clamped to [floor, 1 − floor].

    The authors' released ``FocalLoss`` computes it this way (floor 1e-7). The clamp matters: a sample
    with p_y above 1 − floor (every very confident correct one) contributes a constant, so no gradient.
    """
    p = torch.softmax(z, dim=-1).gather(-1, y.view(-1, 1)).squeeze(-1).clamp(floor, 1.0 - floor)
    loss = -((1.0 - p) ** gamma) * torch.log(p)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss


def best_log_temperature(z: torch.Tensor, y: torch.Tensor, gamma: float) -> float:
    """s = log T minimising mean FL_γ(z e^{−s}, y) on fixed logits (no pass of the model).

    The exact 1-D solve of temperature scaling (``solve_log_temperature``) over T in [1e-2, 1e2], in
    ``accumulation_dtype``; a bound is returned as it is, without a warning. The fast fitter's loss
    has no probability clamp (only the toolkit recipe sets ``prob_floor``, and it never calls this).
    """
    return solve_log_temperature(z.to(accumulation_dtype(z.device)), y.to(z.device), gamma, _LOG_T_BOUNDS)[0]


def entropy_gradient(problem: Problem):
    """Theorem 1's ingredients in one pass at δ = 0, T = 1.

    Returns g = Σ_i ∇_x H(softmax(f(x_i))) (shape of one input), the element-wise minimum ℓ and
    maximum μ of the inputs, and the logits f(x) (N, K) on the device (1 pass), in the problem's
    arithmetic. The gradient is taken at ``tie_breaking_start`` rather than at 0 itself, where a flat
    picture's tied max-pooling values would leave its sign to the kernel's choice.
    """
    split = problem.split
    g = lo = hi = None
    out = []

    def piece(x: torch.Tensor, _):
        d = tie_breaking_start(x.shape[1:], x.device).to(problem.dtype).requires_grad_(True)
        # No clamp here: at δ ≈ 0 the inputs are where the data put them.
        z = problem.run(x.to(problem.dtype) + d)
        logp = torch.log_softmax(z, dim=1)
        ent = -(logp.exp() * logp).sum()
        (gd,) = torch.autograd.grad(ent, d)
        return gd, x.amin(0), x.amax(0), z.detach()

    for gd, lo_x, hi_x, z in split.map(piece, backward=True):
        if g is None:
            g, lo, hi = gd, lo_x, hi_x
        else:
            g, lo, hi = g + gd, torch.minimum(lo, lo_x), torch.maximum(hi, hi_x)
        out.append(z)
    split.count(1.0)
    (g,) = distributed.all_reduce_sum(g)
    lo, hi = distributed.all_reduce_extreme(lo, largest=False), distributed.all_reduce_extreme(hi, largest=True)
    return g, lo, hi, split.gather(torch.cat(out))


def theorem1_delta(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """δ̃ = sign(g) ⊙ η with η_j = ℓ_j − α_j (g_j < 0), β_j − μ_j (g_j > 0), 0 otherwise.

    An element whose data already reach beyond [α, β] (bicubic resizing can overshoot) gets η = 0.
    """
    eta = torch.where(g < 0, lo - alpha, torch.where(g > 0, beta - hi, torch.zeros_like(g))).clamp_min(0.0)
    return (torch.sign(g) * eta).float()


# --------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------

#: Size of the fixed pattern a start at δ₀ = 0 is moved by (``tie_breaking_start``).
TIE_BREAK = 1e-6
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def tie_breaking_start(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """δ₀ for a start "at 0": a fixed pattern of size ``TIE_BREAK``, the same on every machine.

    At δ = 0 the loss is not differentiable wherever a picture is flat: its equal pixels give equal
    values in a max-pooling window, and which of them receives the gradient is the kernel's choice
    (on the embedded default the gradient at 0 differs by 1 % between torch's vector and scalar CPU
    kernels, in float64 too). Any δ whose elements differ breaks those ties; this one is
    (frac(j·φ) − 0.5)·1e−6 for element j (φ the golden ratio), made of exactly rounded operations,
    so its bits do not depend on the machine, and far too small to change the fit otherwise.
    """
    return (TIE_BREAK * golden_pattern(math.prod(shape))).view(shape).to(device, torch.float32)


def golden_pattern(n: int) -> torch.Tensor:
    """frac(j·φ) − 0.5 for j = 1 … n (float64, in [−0.5, 0.5), no two alike), of exactly rounded
    operations: the same bits on every machine."""
    j = torch.arange(1, n + 1, dtype=torch.float64)
    return torch.remainder(j * _GOLDEN, 1.0) - 0.5


@dataclass
class FitResult:
    delta: torch.Tensor
    log_t: float
    objective: float
    logits: torch.Tensor  # f(x + δ) over the split at the final state, natural order, on the device
    history: list[dict] = field(default_factory=list)
    passes: float = 0.0
    stopped: bool = False


class Reporter:
    """Feeds the history, the user's callback and the progress bar; StopFitting passes through."""

    def __init__(self, callback: Callable[[dict], Any] | None = None, bar=None, expected_passes: float | None = None):
        self.callback = callback
        self.bar = bar
        self.expected_passes = expected_passes
        self.history: list[dict] = []

    def notify(self, info: dict) -> None:
        if self.bar is not None:
            self.bar.n = round(min(info["passes"], self.bar.total or math.inf), 2)
            self.bar.set_postfix(loss=f"{info['loss']:.5g}", T=f"{info['temperature']:.4f}", refresh=False)
            self.bar.refresh()
        if self.callback is not None:
            # The fit's plan travels with each step, so a caller's progress needs nothing but the step.
            self.callback(dict(info) if self.expected_passes is None else {**info, "expected_passes": self.expected_passes})


@dataclass(frozen=True)
class SGDSettings:
    """One SGD recipe for (δ, T): what ``fit_sgd`` runs."""

    epochs: int
    lr: float
    momentum: float
    batch_size: int
    learn_delta: bool = True  # False: δ stays where it starts and only T moves (the ablation)


def fit_sgd(problem: Problem, delta0: torch.Tensor, generator: torch.Generator, sgd: SGDSettings,
            report: Reporter) -> FitResult:
    """Mini-batch SGD on δ and T together, step for step as ``torch.optim.SGD`` takes it.

    T starts at 1. Every epoch draws ``torch.randperm(N, generator=generator)`` and walks it in
    batches of ``sgd.batch_size`` (the last one may be smaller). Each batch's loss is
    mean_batch FL_γ(f(x + δ)/T, y) + the problem's penalty on δ; both parameters are updated from
    the gradients at the same point, with heavy-ball momentum as PyTorch defines it (no dampening,
    no Nesterov): b ← g on the first step, b ← μ·b + g after, p ← p − lr·b. ``momentum`` 0 is plain SGD.
    With ``learn_delta`` False, δ keeps its start and T alone follows the same steps.
    ``history`` gets one entry per epoch (its loss: the sample-weighted mean of the batch losses).
    """
    split, n = problem.split, problem.split.n
    start = split.passes
    delta = delta0.detach().clone()
    temp = torch.ones((), device=delta.device)
    buf_d = buf_t = None
    per_sample = 1.0 if sgd.learn_delta else 0.5  # no backward through the model when δ is frozen
    step = 0
    stopped = False
    try:
        for epoch in range(1, sgd.epochs + 1):
            order = torch.randperm(n, generator=generator)
            epoch_loss = 0.0
            for k, batch in enumerate(split.batches(order, sgd.batch_size)):
                m = min(sgd.batch_size, n - k * sgd.batch_size)  # the whole batch, across processes
                d = delta.requires_grad_(sgd.learn_delta)
                t = temp.requires_grad_(True)
                loss, gd, gt = _batch_loss_and_grad(problem, batch, m, d, t, sgd.learn_delta)
                with torch.no_grad():
                    if sgd.momentum and buf_d is not None:
                        buf_d, buf_t = sgd.momentum * buf_d + gd, sgd.momentum * buf_t + gt
                    else:
                        buf_d, buf_t = gd, gt
                    delta = d.detach() - sgd.lr * buf_d
                    temp = t.detach() - sgd.lr * buf_t
                step += 1
                split.count(per_sample * m / n)
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise ValueError(f"The loss became {value} at SGD step {step}; try a smaller learning rate.")
                epoch_loss += value * m / n
                report.notify({"step": step, "epoch": epoch, "loss": value, "temperature": float(temp),
                               "passes": split.passes})
            report.history.append({"step": step, "epoch": epoch, "loss": epoch_loss,
                                   "temperature": float(temp), "passes": split.passes})
    except StopFitting:
        stopped = True
    t_final = float(temp)
    if not t_final > 0:
        raise ValueError(f"SGD drove the temperature to {t_final:.4g} (it must stay > 0); try a smaller learning rate.")
    z = problem.logits(delta)
    log_t = math.log(t_final)
    return FitResult(delta, log_t, problem.objective_from_logits(z, delta, log_t), z, report.history,
                     split.passes - start, stopped)


def _batch_loss_and_grad(problem: Problem, batch: tuple[torch.Tensor, torch.Tensor], m: int, d: torch.Tensor,
                         t: torch.Tensor, learn_delta: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One SGD batch's loss mean_batch FL_γ(f(x + δ)/T, y) + penalty(δ) and its gradients in δ and T.

    The batch may be cut into pieces to fit the device's memory: each piece contributes its mean
    loss weighted by its share of the batch (``m`` images in all), and the pieces' gradients are
    summed, so the step is the batch's own. (A batch in one piece is computed exactly as a single
    graph would be.) In a process group ``batch`` is this process's part of it, possibly empty, and
    the sums are added across processes.
    """
    wrt = (d, t) if learn_delta else (t,)

    def piece(x: torch.Tensor, y: torch.Tensor):
        part = problem.loss(problem.forward(x, d) / t, y) * (x.shape[0] / m)
        return part.detach(), torch.autograd.grad(part, wrt)

    loss, grads = None, None
    for part, g in problem.split.pieces(batch, piece, backward=learn_delta):
        loss = part if loss is None else loss + part
        grads = list(g) if grads is None else [a + b for a, b in zip(grads, g)]
    if loss is None:  # no image of this batch is this process's
        loss, grads = torch.zeros((), device=t.device), [torch.zeros_like(w) for w in wrt]
    loss, *grads = distributed.all_reduce_sum(loss, *grads)
    penalty = problem.penalty_term(d)
    if learn_delta:
        (g_pen,) = torch.autograd.grad(penalty, d)
        return loss + penalty.detach(), grads[0] + g_pen, grads[1]
    return loss + penalty.detach(), torch.zeros_like(d), grads[0]


class LBFGSMemory:
    """Curvature pairs of L-BFGS with a block-diagonal initial inverse Hessian.

    The blocks are δ and s = log T: their curvatures differ by orders of magnitude, so each block
    gets its own scale sᵀy / yᵀy from the latest pair (a single scalar would let the stiffer
    block dictate the step of the other).
    """

    def __init__(self, size: int = 10):
        self.size = size
        self.pairs: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        self.scale: torch.Tensor | None = None  # diagonal of the initial inverse Hessian

    def direction(self, g: torch.Tensor) -> torch.Tensor:
        """−H·g, H the inverse Hessian of the pairs with H₀ = diag(scale)."""
        return two_loop(g, self.pairs, lambda q: q * self.scale)

    def update(self, step: torch.Tensor, y: torch.Tensor) -> None:
        sy = float(torch.dot(step, y))
        if not sy > 1e-10 * float(torch.dot(y, y)):
            return
        self.pairs = (self.pairs + [(step, y, 1.0 / sy)])[-self.size :]
        scale = self.scale.clone()
        for block in (slice(0, -1), slice(-1, None)):
            sb, yb = step[block], y[block]
            syb, yyb = float(torch.dot(sb, yb)), float(torch.dot(yb, yb))
            if syb > 0 and yyb > 0:
                scale[block] = syb / yyb
        self.scale = scale


def _cubic_step(t1: float, f1: float, d1: float, t2: float, f2: float, d2: float, lo: float, hi: float) -> float:
    """Minimiser of the cubic through two points with slopes, kept inside [lo, hi]."""
    if math.isfinite(f1) and math.isfinite(f2) and t1 != t2:
        e1 = d1 + d2 - 3.0 * (f1 - f2) / (t1 - t2)
        rad = e1 * e1 - d1 * d2
        if rad >= 0:
            e2 = math.copysign(math.sqrt(rad), t2 - t1)
            den = d2 - d1 + 2.0 * e2
            if den != 0:
                t = t2 - (t2 - t1) * (d2 + e2 - e1) / den
                if math.isfinite(t):
                    return min(max(t, lo), hi)
    return 0.5 * (lo + hi)


def _line_search(phi, f0: float, d0: float, t: float, max_evals: int, c1: float = 1e-4, c2: float = 0.9):
    """Strong-Wolfe line search (bracket, then zoom by safeguarded cubic interpolation).

    ``phi(t) -> (f, slope, payload)``. Returns ``((t, f, slope, payload), evals)`` for a point that
    satisfies both conditions, else the lowest point with sufficient decrease found within
    ``max_evals`` evaluations, else ``(None, evals)``.
    """
    best = None
    evals = 0

    def armijo(tt: float, ff: float) -> bool:
        return math.isfinite(ff) and ff <= f0 + c1 * tt * d0

    prev = (0.0, f0, d0)
    bracket = None
    while evals < max_evals:
        f, slope, payload = phi(t)
        evals += 1
        if armijo(t, f) and (best is None or f < best[1]):
            best = (t, f, slope, payload)
        if not armijo(t, f) or (evals > 1 and f >= prev[1]):
            bracket = (prev, (t, f, slope))
            break
        if abs(slope) <= -c2 * d0:
            return (t, f, slope, payload), evals
        if slope >= 0:
            bracket = ((t, f, slope), prev)
            break
        t_next = _cubic_step(prev[0], prev[1], prev[2], t, f, slope, 2.0 * t, 10.0 * t)
        prev, t = (t, f, slope), t_next
    while bracket is not None and evals < max_evals:
        (tl, fl, dl), (th, fh, dh) = bracket
        width = abs(th - tl)
        if width <= 1e-10 * max(abs(tl), abs(th)):
            break
        a, b = min(tl, th), max(tl, th)
        t = _cubic_step(tl, fl, dl, th, fh, dh, a + 0.1 * width, b - 0.1 * width)
        f, slope, payload = phi(t)
        evals += 1
        if armijo(t, f) and (best is None or f < best[1]):
            best = (t, f, slope, payload)
        if not armijo(t, f) or f >= fl:
            bracket = ((tl, fl, dl), (t, f, slope))
        else:
            if abs(slope) <= -c2 * d0:
                return (t, f, slope, payload), evals
            if slope * (th - tl) >= 0:
                bracket = ((t, f, slope), (tl, fl, dl))
            else:
                bracket = ((t, f, slope), (th, fh, dh))
    return best, evals


def fit_fast(problem: Problem, delta0: torch.Tensor, log_t0: float, max_passes: float, tol: float,
             report: Reporter, fixed_t: bool = False) -> FitResult:
    """Full-batch L-BFGS on (δ, log T) with a strong-Wolfe line search; every evaluation is 1 pass.
    ``fixed_t``: T stays at ``log_t0`` and δ alone moves (its gradient in log T is taken as 0).

    Stops when an iteration lowers F by less than ``tol`` relative to |F|, when the gradient
    vanishes, or before an evaluation would take the split's pass count past ``max_passes``.
    Returns the best point evaluated.
    """
    split = problem.split
    start = split.passes
    shape = delta0.shape
    state = accumulation_dtype(delta0.device)  # δ, log T and the curvature pairs
    best: dict[str, Any] = {}
    evals = 0

    def evaluate(x: torch.Tensor):
        nonlocal evals
        d = x[:-1].view(shape)
        f, gd, gs, z = problem.value_and_grad(d, float(x[-1]))
        if fixed_t:
            gs = 0.0
        evals += 1
        if not best or f < best["f"]:
            best.update(f=f, x=x.detach().clone(), z=z)
        info = {"step": evals, "loss": f, "temperature": math.exp(float(x[-1])), "passes": split.passes}
        report.history.append(info)
        report.notify(info)
        return f, torch.cat([gd.reshape(-1), gd.new_tensor([gs])]), z

    x = torch.cat([delta0.detach().reshape(-1).to(state), torch.tensor([log_t0], dtype=state, device=delta0.device)])
    stopped = False
    try:
        f, g, z = evaluate(x)
        if not math.isfinite(f):
            raise ValueError(f"The objective is {f} at the starting point; check the model's logits and the inputs.")
        memory = LBFGSMemory()
        memory.scale = _initial_scale(problem, g, z, float(x[-1]))
        while True:
            budget = int(math.floor(max_passes - (split.passes - start) + 1e-9))
            if budget < 1 or float(g.abs().max()) <= 1e-9:
                break
            d = memory.direction(g)
            d0 = float(torch.dot(g, d))
            if not d0 < 0:  # curvature pairs that no longer describe the problem: fall back to steepest descent
                memory.pairs = []
                d = -g * memory.scale
                d0 = float(torch.dot(g, d))

            def phi(t: float, x=x, d=d):
                fx, gx, zx = evaluate(x + t * d)
                return fx, float(torch.dot(gx, d)), (gx, zx)

            found, _ = _line_search(phi, f, d0, 1.0, budget)
            if found is None:
                break
            t, f_new, _, (g_new, z_new) = found
            memory.update(t * d, g_new - g)
            decrease = f - f_new
            x, f, g, z = x + t * d, f_new, g_new, z_new
            if decrease <= tol * max(abs(f), 1e-12):
                break
    except StopFitting:
        stopped = True
    xb = best["x"]
    log_t = float(log_t0) if fixed_t else float(xb[-1])
    # δ as every prediction uses it: float32, as the model's inputs are.
    return FitResult(xb[:-1].view(shape).float(), log_t, best["f"], best["z"], report.history,
                     split.passes - start, stopped)


def _initial_scale(problem: Problem, g: torch.Tensor, z: torch.Tensor, log_t: float) -> torch.Tensor:
    """Diagonal first guess of the inverse Hessian, from what is known without another pass.

    δ block: the regulariser's exact curvature 2λ, capped so the first step is at most unit length;
    s block: the exact ∂²F/∂s² on the cached logits.
    """
    scale = torch.empty_like(g)
    g_norm = float(g[:-1].norm())
    scale[:-1] = 1.0 / max(2.0 * problem.weight_decay, g_norm, 1e-12)
    zz = z.to(accumulation_dtype(z.device))
    st = torch.tensor(log_t, dtype=zz.dtype, device=zz.device, requires_grad=True)
    val = focal_loss(zz * torch.exp(-st), problem.split.labels, problem.gamma, reduction="mean")
    (d1,) = torch.autograd.grad(val, st, create_graph=True)
    (d2,) = torch.autograd.grad(d1, st)
    curv = float(d2)
    scale[-1] = 1.0 / curv if curv > 1e-8 else 1.0
    return scale
