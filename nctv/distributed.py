"""Data-parallel runs on ``torch.distributed``: which rows of a split this process holds, and the
few collectives that make every process reach the same result.

Started with ``torchrun`` (docs/distributed.md), every process runs the same program: it reads the
whole split, keeps one contiguous block of its rows (:func:`shard`) and runs only those through
the model. Logits are small (N × K), so they are gathered (:func:`all_gather_rows`) and everything
computed from them runs identically on every process; the Neural Clamping objective's sums and
gradients are all-reduced (:func:`all_reduce_sum`), so δ and T take the same steps everywhere.

With one process (no process group, or a group of one) every function here returns its input
unchanged or does nothing, so a single-process run is exactly what it was without this module.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True inside a process group of two or more processes."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """The process that reads and writes files and prints (rank 0; the only one without a group)."""
    return rank() == 0


def init_from_env() -> bool:
    """Join the process group that ``torchrun`` describes in the environment (WORLD_SIZE > 1).

    With a GPU for every process of this machine, each process uses the GPU ``LOCAL_RANK`` and CUDA
    tensors go through NCCL, CPU tensors through gloo; otherwise everything goes through gloo.
    Returns whether this process is now one of several.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or dist.is_initialized():
        return is_distributed()
    on_this_machine = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if torch.cuda.is_available() and on_this_machine <= torch.cuda.device_count():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    return is_distributed()


def shutdown() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard_sizes(n: int) -> list[int]:
    """Rows per process of a split of ``n`` rows: contiguous blocks, the first ``n % world`` one larger."""
    w = world_size()
    if n < w:
        raise ValueError(f"A split of {n} images cannot be shared by {w} processes; use at least {w} images "
                         "or fewer processes.")
    base, extra = divmod(n, w)
    return [base + (r < extra) for r in range(w)]


def shard(n: int) -> slice:
    """This process's block of rows of a split of ``n`` rows (all of them with one process)."""
    sizes = shard_sizes(n)
    start = sum(sizes[: rank()])
    return slice(start, start + sizes[rank()])


def all_reduce_sum(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The sums over processes of ``tensors`` (one collective for all, added in float64), each in its
    own dtype and shape; the tensors themselves with one process."""
    if not is_distributed():
        return list(tensors)
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    dist.all_reduce(flat)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()].view(t.shape).to(t.dtype))
        at += t.numel()
    return out


def all_reduce_extreme(tensor: torch.Tensor, largest: bool) -> torch.Tensor:
    """Element-wise maximum (``largest``) or minimum over processes."""
    if not is_distributed():
        return tensor
    out = tensor.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX if largest else dist.ReduceOp.MIN)
    return out


def all_gather_rows(local: torch.Tensor, n: int) -> torch.Tensor:
    """All ``n`` rows in split order, from this process's rows ``local`` (its :func:`shard` of them).

    Blocks are padded to the largest one for the collective and trimmed after it.
    """
    if not is_distributed():
        return local
    sizes = shard_sizes(n)
    if local.shape[0] != sizes[rank()]:
        raise ValueError(f"process {rank()} holds {local.shape[0]} rows of a split of {n}; its shard has {sizes[rank()]}.")
    padded = local.new_zeros((max(sizes), *local.shape[1:]))
    padded[: local.shape[0]] = local
    blocks = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(blocks, padded.contiguous())
    return torch.cat([b[:s] for b, s in zip(blocks, sizes)])


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first and the other processes after it, so that what the block
    downloads or writes once (a dataset, a model's weights) is fetched by one process only."""
    if not is_main():
        dist.barrier()
    yield
    if is_main() and is_distributed():
        dist.barrier()


def from_main(obj: Any) -> Any:
    """Rank 0's ``obj`` on every process (a picklable object or tensor; None allowed)."""
    if not is_distributed():
        return obj
    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard_loader(loader: Any, n: int) -> Any:
    """This process's rows of a split of ``n`` rows given as a loader of ``(inputs, labels)`` batches.

    A ``DataLoader`` over a map-style dataset of ``n`` items reads only those rows; any other iterable
    is read whole and cut. The loader itself with one process.
    """
    if not is_distributed():
        return loader
    rows = shard(n)
    dataset = getattr(loader, "dataset", None)
    if (isinstance(loader, torch.utils.data.DataLoader) and not isinstance(dataset, torch.utils.data.IterableDataset)
            and hasattr(dataset, "__len__") and len(dataset) == n):
        return torch.utils.data.DataLoader(
            torch.utils.data.Subset(dataset, range(rows.start, rows.stop)), batch_size=loader.batch_size,
            num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory)
    return _rows_of(loader, rows)


def _rows_of(batches: Any, rows: slice) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    from nctv.inference import iter_batches

    seen = 0
    for x, y in iter_batches(batches):
        size = int(x.shape[0])
        lo, hi = max(rows.start - seen, 0), min(rows.stop - seen, size)
        if lo < hi:
            yield x[lo:hi], (None if y is None else y[lo:hi])
        seen += size
