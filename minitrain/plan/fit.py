"""Plan a run's peak GPU memory before any weight is read, and stop (or fit) when it cannot fit.

    check(cfg) -> cfg     the CLI calls it after the config is resolved, before the recipe runs

On CUDA, the run's peak is planned from the model's `config.json` and the run's keys with
`minitrain.plan` (the model `minitrain plan` prints; a CUDA context and allocator slack on top) and
compared with the device's free memory. When it does not fit:

- `memory_check=true` (default): stop with one `error: memory: ...` line and the plan's
  suggestions (checkpointing, quantize, micro-batch, precompute_ref), each with its new figure;
- `auto_fit=true`: choose activation checkpointing on the fewest blocks that fit (the first N:
  the least recompute), else on every block and the largest micro-batch that fits, keeping the
  global batch (`batch_size x grad_accum`) through accumulation, and say what was chosen; stop as
  above if nothing fits;
- `memory_check=false`: no check.

`gpu_mem=12GiB` plans against that size instead of the free memory the GPU reports, and makes the
check run on a machine without a GPU as well (planned as on CUDA), to try a config before renting
one. Under torchrun every rank checks its own device against the plan of one rank
(`minitrain.plan.sharded`: its share of the batch; with `parallel=fsdp` the 1/N shards and the
gathered blocks). A model family the plan does not model (or T5 under fsdp) is not checked (said so).
`planned_peak_mb(cfg, device)` gives the loop the figure it logs beside the measured `peak_mem_mb`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

from minitrain.config import checkpointed_blocks, parse_bytes
from minitrain.errors import UserError
from minitrain.plan.predict import predict, run_shape, shape_from_hf, suggestions
from minitrain.plan.run_shape import RESERVE_CONTEXT, RESERVE_SLACK, Plan, RunShape, fmt_bytes


def _plan(cfg: Any) -> tuple[Any, RunShape, Plan] | None:
    """(model shape, run shape, plan) for `cfg` on CUDA; None if the model is not one the plan models."""
    path = Path(cfg.model) / "config.json"
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
        model = shape_from_hf(hf, where=str(path))
    except (OSError, ValueError, UserError, TypeError, KeyError):
        return None  # unreadable or not modelled: loading reports a bad folder with its own message
    from minitrain.parallel import distributed

    checkpointed_blocks(cfg.checkpointing, model.blocks)  # checkpointing=N beyond the model: said, not skipped
    run = run_shape(cfg, device="cuda", world=distributed.world_size())  # under torchrun: this rank's share
    try:
        return model, run, predict(model, run)
    except UserError:
        return None  # a run the plan does not model (T5 under fsdp)


def needed(peak: int) -> int:
    """Device bytes a run of planned allocator peak `peak` needs: + CUDA context + allocator slack."""
    return int(peak * (1 + RESERVE_SLACK) + RESERVE_CONTEXT)


def device_budget(cfg: Any) -> tuple[int, str] | None:
    """(bytes to plan against, where they come from), or None when there is nothing to check:
    `gpu_mem` when given, else the free memory of the CUDA device the run will use."""
    if getattr(cfg, "gpu_mem", ""):
        return parse_bytes(cfg.gpu_mem), f"gpu_mem={cfg.gpu_mem} gives"
    import torch

    if cfg.device == "cpu" or cfg.device == "mps" or not torch.cuda.is_available():
        return None
    from minitrain.device import pick_device

    device = pick_device(cfg.device)
    free, _ = torch.cuda.mem_get_info(device)
    return free, f"{device} ({torch.cuda.get_device_name(device)}) has free"


def check(cfg: Any, log: Callable[[str], None] = print) -> Any:
    """The config to run: `cfg` when it fits (or is not checked), a fitted copy with `auto_fit`;
    UserError when it does not fit. Reads only `config.json`; writes nothing."""
    if not getattr(cfg, "memory_check", True) or not getattr(cfg, "model", ""):
        return cfg
    budget = device_budget(cfg)
    if budget is None:
        return cfg
    free, where = budget
    planned = _plan(cfg)
    if planned is None:
        fsdp = " (under parallel=fsdp: the decoder-only families)" if getattr(cfg, "parallel", "ddp") == "fsdp" else ""
        log(f"note: memory plan skipped: {cfg.model}/config.json is not a model minitrain.plan models{fsdp}")
        return cfg
    model, run, plan = planned
    if needed(plan.peak) <= free:
        log(f"memory: planned peak {fmt_bytes(plan.peak)} ({fmt_bytes(needed(plan.peak))} with CUDA context and "
            f"slack) fits: {where} {fmt_bytes(free)}")
        return cfg
    if getattr(cfg, "auto_fit", False):
        found = _first_that_fits(_fits_in_order(cfg, model.blocks), free)
        if found:
            candidate, fitted = found
            changed = " ".join(f"{k}={str(getattr(candidate, k)).lower()}"
                               for k in ("checkpointing", "batch_size", "grad_accum")
                               if getattr(candidate, k) != getattr(cfg, k))
            if not isinstance(candidate.checkpointing, bool):
                changed += f" (the first {candidate.checkpointing} of {model.blocks} blocks)"
            log(f"auto_fit: {changed} (global batch {candidate.batch_size * candidate.grad_accum} kept): planned "
                f"peak {fmt_bytes(fitted.peak)}, {fmt_bytes(needed(fitted.peak))} needed of {where} "
                f"{fmt_bytes(free)} (was {fmt_bytes(needed(plan.peak))})")
            return candidate
    tips = sorted(suggestions(model, run, cfg.batch_size, cfg.grad_accum), key=lambda t: t[2])
    fewest = None if getattr(cfg, "auto_fit", False) else _first_that_fits(_partial(cfg, model.blocks), free)
    if fewest:  # the least recompute that fits, first
        n = fewest[0].checkpointing
        tips.insert(0, (f"checkpointing={n} (the first {n} of {model.blocks} blocks)", 0, fewest[1].peak))
    shown = "; ".join(f"{keys} -> {fmt_bytes(needed(peak))}{' (fits)' if needed(peak) <= free else ''}"
                      for keys, _, peak in tips)
    tried = "auto_fit found no checkpointing / micro-batch that fits; " if getattr(cfg, "auto_fit", False) else ""
    raise UserError(f"memory: the plan needs {fmt_bytes(needed(plan.peak))} (peak {fmt_bytes(plan.peak)} + CUDA "
                    f"context and slack) but {where} {fmt_bytes(free)} — {tried}try {shown or 'a smaller model'}"
                    f"{'' if tried else '; or auto_fit=true to choose checkpointing and the micro-batch'}; "
                    f"memory_check=false skips this check (minitrain plan shows the plan)")


def _first_that_fits(candidates, free: int) -> tuple[Any, Plan] | None:
    """The first config of `candidates` whose planned needs fit in `free`, with its plan; else None."""
    for candidate in candidates:
        got = _plan(candidate)
        if got and needed(got[2].peak) <= free:
            return candidate, got[2]
    return None


def _partial(cfg: Any, blocks: int):
    """`cfg` with checkpointing on the first N of the model's `blocks` blocks, N from one more than
    the run has up to all but one (fewest first: the least recompute)."""
    for n in range(checkpointed_blocks(cfg.checkpointing, blocks) + 1, blocks):
        yield dataclasses.replace(cfg, checkpointing=n)


def _fits_in_order(cfg: Any, blocks: int):
    """auto_fit's candidates, least change first: checkpointing on the first N of the model's `blocks`
    blocks, N from one more than the run has up (the fewest that fit: the least recompute), then on
    every block, then ever smaller micro-batches (divisors of batch_size, at least one row per rank)
    with grad_accum raised so batch_size x grad_accum stays the same."""
    from minitrain.parallel import distributed

    yield from _partial(cfg, blocks)
    ck = dataclasses.replace(cfg, checkpointing=True)
    if checkpointed_blocks(cfg.checkpointing, blocks) < blocks:
        yield ck
    for b in range(cfg.batch_size - 1, distributed.world_size() - 1, -1):
        if cfg.batch_size % b == 0:
            yield dataclasses.replace(ck, batch_size=b, grad_accum=cfg.grad_accum * cfg.batch_size // b)


def planned_peak_mb(cfg: Any, device: Any) -> float | None:
    """The planned allocator peak in MiB, for the loop to log beside `peak_mem_mb`: on CUDA, or
    wherever `gpu_mem` asked for the plan; None when the model is not planned."""
    if not getattr(cfg, "model", "") or not (getattr(device, "type", "") == "cuda" or getattr(cfg, "gpu_mem", "")):
        return None
    planned = _plan(cfg)
    return planned[2].peak / 2**20 if planned else None
