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
  then on the root; the embeddings and the head cut by rows of the vocabulary beside it, computed
  with by rows (`minitrain.parallel.fsdp`). Parameters, gradients and optimizer state are sharded;
  gradients are reduce-scattered as sums (divide factor 1) and divided by the same global count.
  For full fine-tuning or bases too big for one device. The model is built on meta and each rank
  reads only its rows of each weight; it stays sharded to the end, where what is saved is
  gathered (the adapter) or written one shard file at a time (a full fine-tune).

Rank 0 alone writes logs, metrics.jsonl, config.json and the adapter or model; a write that
fails there is raised on every rank (`main_only`), so no rank is left waiting in a collective.
A checkpoint is written by every rank (its RNG state; under fsdp its rows of each tensor) into one
folder that rank 0 completes and swaps in (`minitrain.checkpoint`).

Every rank makes the same collectives in the same order. Inside `main_only` rank 0 runs alone, so
a collective there (one of this module's, or torch's under `MINITRAIN_TRACE_COLLECTIVES`) is refused
as a bug, and a nested `main_only` is a plain call. A dead, stuck or drifted peer ends the run
within `dist_timeout` seconds (the process group's timeout): each rank that sees a collective fail
leaves a word in torchrun's store, and the lowest of them prints one line naming the rank that
stopped answering and where each was (`report_failure`).

`MINITRAIN_TRACE_COLLECTIVES=DIR` (a debugging aid, read by `init`): each rank writes every
collective it makes, torch's own included (FSDP2's all-gathers, DTensor's), one line each with the
minitrain line that made it, to `DIR/collectives.rank<R>.txt`; the files of a run's ranks must be
equal (`tests/test_collectives.py`).
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from minitrain.errors import UserError

T = TypeVar("T")
BUCKET_BYTES = 64 * 2**20  # gradients are all-reduced in flat buckets of about this size
TRACE_ENV = "MINITRAIN_TRACE_COLLECTIVES"
FAILED_KEY = "minitrain/failed/"  # + rank: where that rank saw a collective fail (torchrun's store)
_alone = False  # True on rank 0 while `main_only` runs its function: no collective may start there


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
    timeout = datetime.timedelta(seconds=float(getattr(cfg, "dist_timeout", 600)))
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if use_cuda else "gloo", timeout=timeout)
    if os.environ.get(TRACE_ENV):
        trace_collectives(Path(os.environ[TRACE_ENV]))


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
    global _alone
    if world_size() == 1 or _alone:  # nested: rank 0 is alone already, the outer call shares the error
        return fn()
    result, message = None, None
    if rank() == 0:
        _alone = True
        try:
            result = fn()
        except UserError as e:
            message = e.message
        finally:
            _alone = False
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
    _collective("gather_objects")
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
    _collective("any_rank")
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_tensors(tensors: list[torch.Tensor]) -> None:
    """Copy rank 0's values into every rank's `tensors` (same start everywhere, as DDP does)."""
    if world_size() == 1:
        return
    _collective("broadcast_tensors")
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=0)


def all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    """Sum each tensor over ranks in place, flattened into buckets of one dtype (fewer, larger messages)."""
    if world_size() == 1 or not tensors:
        return
    _collective("all_reduce_sum")
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


class CollectiveInMainOnly(RuntimeError):
    """A collective started inside `main_only`, where rank 0 runs alone: the other ranks would wait
    for it forever (or pair it with their next one). A bug in minitrain, never a user's mistake."""


def _collective(name: str) -> None:
    if _alone:
        raise CollectiveInMainOnly(f"{name} inside distributed.main_only (at {_caller()}): rank 0 alone would make "
                                   f"this collective and every other rank would wait for it")


def _ours(filename: str) -> str | None:
    """How a line of ours is named: `minitrain/train.py`, `objectives/grpo.py`, `recipes/sft_llama.py`,
    or a user's recipe file (`my_sft.py`: code outside Python's and the packages' folders); None for
    Python's, torch's and other libraries' files."""
    path = Path(filename)
    if path.parent.name in ("minitrain", "models", "recipes") or path.parent.parent.name == "minitrain":
        return f"{path.parent.name}/{path.name}"
    if not path.is_absolute() or "site-packages" in path.parts or "dist-packages" in path.parts:
        return None
    if any(path.is_relative_to(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}):
        return None
    return path.name


def _site(frames: Iterable[tuple[Any, int]], function: bool = False) -> str:
    """The innermost line of ours among `frames` ((code, line), outermost first), outside this
    module where there is one: `minitrain/train.py:352` (`function`: with ` (train)`)."""
    site = "?"
    for code, line in frames:
        name = _ours(code.co_filename)
        if name and (name != _ours(__file__) or site == "?"):
            site = f"{name}:{line}" + (f" ({code.co_name})" if function else "")
    return site


def _caller() -> str:
    """The innermost line of ours on the stack, outside this module."""
    return _site(reversed([(f.f_code, line) for f, line in traceback.walk_stack(sys._getframe(1))]))


# ----------------------------------------------------------------------------- tracing and failures


_TRACED = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
           "gather", "gather_object", "scatter", "scatter_object_list", "reduce_scatter", "reduce_scatter_tensor",
           "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "broadcast_object_list",
           "all_gather_single", "reduce_scatter_single", "send", "recv", "isend", "irecv")
_FUNCTIONAL = ("all_gather_tensor", "all_reduce", "reduce_scatter_tensor", "broadcast", "all_to_all_single",
               "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "all_reduce_coalesced")


def trace_collectives(folder: Path) -> Path:
    """Wrap torch.distributed's collectives (and its functional ones, which DTensor uses) so that each
    call writes `NAME  minitrain/file.py:line` to `folder/collectives.rank<R>.txt` (a collective's own
    inner collectives are not written again), and so that one started inside `main_only` raises
    `CollectiveInMainOnly`. A debugging aid (`MINITRAIN_TRACE_COLLECTIVES=DIR`): it rebinds torch's
    functions for the life of the process."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"collectives.rank{rank()}.txt"
    sink = open(path, "w", buffering=1, encoding="utf-8")
    depth = [0]

    def wrap(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                _collective(name)
                sink.write(f"{name}  {_caller()}\n")
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        traced._minitrain_traced = True  # type: ignore[attr-defined]
        return traced

    for modules, names, prefix in (((dist, c10d), _TRACED, ""), ((funcol,), _FUNCTIONAL, "functional.")):
        for name in names:
            original = getattr(modules[0], name, None)
            if original is None or getattr(original, "_minitrain_traced", False):
                continue
            traced = wrap(prefix + name, original)
            for module in modules:
                if getattr(module, name, None) is original:
                    setattr(module, name, traced)
    return path


def is_peer_failure(e: BaseException) -> bool:
    """Whether `e` is a collective that failed because another rank died, stopped answering (the
    process group's timeout) or made another collective: gloo's and NCCL's errors."""
    if not active() or world_size() == 1:
        return False
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "gloo", "Gloo", "NCCL", "Connection closed by peer", "Connection reset by peer", "Timed out waiting"))


def report_failure(e: BaseException, grace: float = 5.0) -> str | None:
    """After a failed collective (`is_peer_failure`): leave this rank's word in torchrun's store, wait
    up to `grace` seconds for the other ranks' words, and return the one line to print if this rank
    is the lowest that saw the failure (else None): the ranks that stopped answering (no word: dead
    or stuck) and where each rank that answered was."""
    where = _failure_site(e)
    me, world = rank(), world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{FAILED_KEY}{me}", where)
        keys = [f"{FAILED_KEY}{r}" for r in range(world)]
        end = time.monotonic() + grace
        while not store.check(keys) and time.monotonic() < end:
            time.sleep(0.1)
        words = {r: store.get(k).decode() for r, k in enumerate(keys) if store.check([k])}
    except Exception:  # noqa: BLE001 - the store went with a dead launcher: say what this rank knows
        words = {me: where}
    if min(words) != me:
        return None
    silent = [r for r in range(world) if r not in words]
    seen = "; ".join(f"rank {r} in {w}" for r, w in sorted(words.items()))
    reason = " ".join(str(e).split())[:160]
    if silent:
        who = ", ".join(map(str, silent))
        return (f"rank{'s' if len(silent) > 1 else ''} {who} stopped answering (dead, killed or stuck: no word from "
                f"{'them' if len(silent) > 1 else 'it'}); {seen} ({reason}) — see rank {silent[0]}'s own output "
                f"above; a run with a checkpoint continues with resume=true")
    return (f"the ranks' collectives failed: {seen} ({reason}) — if they stopped in different places the "
            f"ranks drifted apart, a bug in minitrain: please report this line")


def _failure_site(e: BaseException) -> str:
    """The innermost line of ours in `e`'s traceback, with its function."""
    return _site(((f.f_code, line) for f, line in traceback.walk_tb(e.__traceback__)), function=True)


# ----------------------------------------------------------------------------- FSDP2's tensors (minitrain.parallel.fsdp shards)


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


def local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's rows of a tensor sharded on dim 0 (a DTensor), the first row's index in the whole)."""
    chunk = -(-t.shape[0] // world_size())
    return t.to_local(), min(rank() * chunk, t.shape[0])


def gather_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every rank's `t` (n_r, ...) in rank order, each padded with zeros to the largest n_r = m:
    ((N * m, ...), m); rank r's rows are [r * m, r * m + n_r). Two collectives."""
    _collective("gather_rows")
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.empty_like(n) for _ in range(world_size())]
    dist.all_gather(sizes, n)
    m = max(int(s) for s in sizes)
    padded = t.new_zeros((m, *t.shape[1:]))
    padded[: t.shape[0]] = t
    out = t.new_empty((world_size() * m, *t.shape[1:]))
    dist.all_gather_single(out, padded)
    return out, m


def all_reduce_(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`t` summed (or its max taken, op="max") over ranks, in place; returned."""
    _collective("all_reduce")
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t


def gathered(t: torch.Tensor) -> torch.Tensor:
    """The whole of `t` (itself if not sharded): gathered on every rank, a collective. Its gradient
    (each rank's, from its own rows of data) is summed over ranks into this rank's shard, as FSDP2's
    reduce-scatter does (`Partial`)."""
    if not is_sharded(t):
        return t
    from torch.distributed.tensor import Partial

    return t.full_tensor(grad_placements=[Partial()]) if t.requires_grad else t.full_tensor()


def gathered_call(module: Any) -> Callable[..., Any]:
    """`module`'s forward with its sharded parameters gathered once, here (every rank calls this: a
    collective), and used by every later call, which makes none: for a loop of calls whose length
    differs between ranks (chunks of each rank's own targets). `module` itself when nothing is sharded."""
    whole = {n: gathered(p) for n, p in module.named_parameters() if is_sharded(p)}
    if not whole:
        return module
    return lambda *args: torch.func.functional_call(module, whole, args)
