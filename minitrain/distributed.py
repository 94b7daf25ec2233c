"""Data parallel training under `torchrun`: the process group, and the few collectives the loop uses.

    torchrun --nproc_per_node N -m minitrain RECIPE.py key=value ...

`torchrun` starts N copies of the command and gives each one `RANK`, `LOCAL_RANK`, `WORLD_SIZE`
and a rendezvous in its environment. The CLI calls `init(cfg)` once, before the recipe runs:
it joins the process group (gloo for CPU tensors, plus nccl for CUDA tensors where there is a
GPU) and pins the process to `cuda:LOCAL_RANK`. Nothing else in minitrain starts processes or
reads those variables: a plain `python -m minitrain ...` is a world of one.

Two ways to split the work (`parallel=` key), both exact (the result equals one process with
the whole batch, up to float summation order):

- `ddp` (default): every rank holds the whole model; each global micro-batch of `batch_size`
  examples is split across ranks (`indices[rank::world]`); at the optimizer step the loop sums
  gradients, loss and target counts over ranks (`all_reduce_sum`, one call per ~64 MB bucket)
  and divides by the global count. That is DDP's data parallelism without its wrapper: one
  gradient all-reduce per optimizer step rather than per micro-batch, and no 1/world averaging
  to undo, since the loss is a sum normalised by the global target count (docs/design.md rule 2).
- `fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) on each block of `model.block_types`,
  then on the root (`minitrain.fsdp`). Parameters, gradients and optimizer state are sharded;
  gradients are reduce-scattered as sums (divide factor 1) and divided by the same global count.
  For full fine-tuning or bases too big for one device. The model is built on meta and each rank
  reads only its rows of each weight; it stays sharded to the end, where what is saved is
  gathered (the adapter) or written one shard file at a time (a full fine-tune).

Rank 0 alone writes logs, metrics.jsonl, config.json and the adapter or model; a write that
fails there is raised on every rank (`main_only`), so no rank is left waiting in a collective.
A checkpoint is written by every rank (its RNG state; under fsdp its rows of each tensor) into one
folder that rank 0 completes and swaps in (`minitrain.checkpoint`).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from minitrain.errors import UserError

T = TypeVar("T")
BUCKET_BYTES = 64 * 2**20  # gradients are all-reduced in flat buckets of about this size


# ----------------------------------------------------------------------------- where am I


def launched() -> bool:
    """Whether this process was started by torchrun (its environment names a rank and a world)."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def launch_hint(world: int) -> str:
    """How to start a run of `world` processes, for messages."""
    return f"torchrun --nproc_per_node {world} -m minitrain" if world > 1 else "python -m minitrain"


# ----------------------------------------------------------------------------- the process group


def check(cfg: Any, world: int, under_torchrun: bool) -> None:
    """Refuse settings that cannot run at this world size (before anything is loaded or written)."""
    parallel = getattr(cfg, "parallel", "ddp")
    if parallel == "fsdp":
        if not under_torchrun:
            raise UserError("parallel=fsdp: needs processes started by torchrun — run torchrun --nproc_per_node N "
                            "-m minitrain RECIPE.py ... (or use parallel=ddp in one process)")
        if getattr(cfg, "precision", "") == "fp16":
            raise UserError("parallel=fsdp with precision=fp16: the loss scaler's overflow check would see only "
                            "each rank's shard — use precision=bf16 (or fp32), or parallel=ddp")
        if getattr(cfg, "quantize", "none") == "ternary":
            raise UserError("parallel=fsdp with quantize=ternary: ternary base layers are not sharded — use "
                            "parallel=ddp (each rank holds the ternary base), or quantize=nf4 / int8")
    batch_size = getattr(cfg, "batch_size", world)
    if batch_size < world:
        raise UserError(f"batch_size={batch_size}: smaller than the {world} processes — batch_size is the global "
                        f"micro-batch, split across ranks; use batch_size >= {world} (e.g. {world}) or fewer processes")


def init(cfg: Any) -> None:
    """Join torchrun's process group (when launched by it) and pin this process to its GPU.

    Called once by the CLI before the recipe runs. Without torchrun it only checks `cfg`.
    Backend: gloo for CPU tensors and nccl for CUDA tensors (both when there is a GPU), so the
    same run works with device=cpu on a GPU machine.
    """
    under = launched()
    world = int(os.environ["WORLD_SIZE"]) if under else 1
    check(cfg, world, under)
    if not under or active():
        return
    device = str(getattr(cfg, "device", "auto"))
    use_cuda = torch.cuda.is_available() and device != "cpu"
    if use_cuda:
        # every rank checks the whole machine, so every rank refuses (rank 0 says it) before any joins:
        # a rank refusing alone would leave the others waiting to join, with nothing printed
        procs, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank() + 1)), torch.cuda.device_count()
        if procs > gpus:
            raise UserError(f"torchrun: {procs} processes on this machine, {gpus} GPU{'s' if gpus != 1 else ''} — "
                            f"use --nproc_per_node {gpus} or fewer (or device=cpu)")
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if use_cuda else "gloo")


def shutdown(finished: bool = False) -> None:
    """Leave the process group. `finished`: every rank ended normally, so they meet at a barrier
    first and none starts tearing down while another is still running. Without it a two-rank CPU
    run aborted at exit in about 1 of 50 runs under load ("terminate called without an active
    exception" in rank 1; the exact cause inside gloo was not pinned down); 0 of 60 with it."""
    if active():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- collectives the loop uses


def main_only(fn: Callable[[], T]) -> T | None:
    """Run `fn` on rank 0 only (a write); a `UserError` there is raised on every rank.

    Returns fn's result on rank 0 and None elsewhere. Other exceptions (our bugs) stay on rank
    0, whose exit makes torchrun stop the others.
    """
    if world_size() == 1:
        return fn()
    result, message = None, None
    if rank() == 0:
        try:
            result = fn()
        except UserError as e:
            message = e.message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        err = UserError(box[0])
        err.shared = True  # every rank raises it: the CLI prints it once (rank 0)
        raise err
    return result


def gather_objects(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order (one process: `[obj]`)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def check_agree(what: str, value: str, hint: str) -> None:
    """Refuse, on every rank and before step 1, ranks whose `value` for `what` differs (each machine
    reading another model or data file): one line naming the ranks that differ from rank 0."""
    values = gather_objects(value)
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        err = UserError(f"{what}: rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} "
                        f"{'read' if len(differ) > 1 else 'reads'} other {what} than rank 0 ({values[differ[0]]} "
                        f"vs {values[0]}) — {hint}")
        err.shared = True  # every rank raises it: the CLI prints it once (rank 0)
        raise err


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is true on any rank."""
    if world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_tensors(tensors: list[torch.Tensor]) -> None:
    """Copy rank 0's values into every rank's `tensors` (same start everywhere, as DDP does)."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=0)


def all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    """Sum each tensor over ranks in place, flattened into buckets of one dtype (fewer, larger messages)."""
    if world_size() == 1 or not tensors:
        return
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        if bucket:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        bucket.clear()

    for t in sorted(tensors, key=lambda t: (str(t.dtype), str(t.device))):
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device or size >= BUCKET_BYTES):
            flush()
            size = 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    flush()


# ----------------------------------------------------------------------------- FSDP2's tensors (minitrain.fsdp shards)


def is_sharded(t: Any) -> bool:
    """A DTensor (FSDP2 shard)? Without importing torch.distributed.tensor when nothing sharded
    anything (that import costs most of a second at step 1 of every single-process run)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every rank for a sharded one (a collective), else `t` itself."""
    return t.full_tensor() if is_sharded(t) else t


def like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `ref` (this rank's shard of it when `ref` is sharded; no communication)."""
    if not is_sharded(ref):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(ref.device), ref.device_mesh, ref.placements, src_data_rank=None)
