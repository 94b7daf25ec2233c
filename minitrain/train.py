"""The training loop: one function, top to bottom (nanoGPT `train.py`, llm.c's training section).

    micro-batches (rows with images: the next one collated in a background thread while one trains,
    `minitrain.data.prefetch`) -> forward under autocast -> objective's loss SUM + target count -> backward
    -> at the optimizer step: grads / total count of the window, clip (log the pre-clip norm),
       AdamW step with the LR of this optimizer step, zero grads
    -> metrics.jsonl (one line per step, flushed; + tensorboard with report_to) + progress (a tqdm bar
       on a terminal, plain lines in a log: minitrain.progress) -> eval -> atomic checkpoint

The loop knows nothing about objectives beyond `(model, batch) -> (loss_sum, count, metrics)`
and nothing about model families beyond the contract (`block_types` for checkpointing and
compile). See docs/design.md rules 1, 2, 6, 7, 8 for why each piece is here.

Under torchrun (`minitrain.parallel.distributed`) the same function runs on every rank: each global
micro-batch of `batch_size` examples is split across ranks, loss sums, target counts and
gradients are summed over ranks at the optimizer step (or FSDP2 shards the model with
`parallel=fsdp`), and rank 0 alone writes. SIGINT / SIGTERM finish the step in progress, save a
checkpoint and raise `Interrupted` (exit 130 / 143 from the CLI).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import random
import resource
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from minitrain import checkpoint as ckpt
from minitrain.parallel import distributed, fsdp
from minitrain.adapters.lora import quant_kind
from minitrain.audit import preflight
from minitrain.config import checkpointed_blocks, to_dict
from minitrain.data.batcher import Batcher
from minitrain.data.collate import IGNORE_INDEX
from minitrain.data.prefetch import Prefetch
from minitrain.data.store import carries
from minitrain.device import resolve_precision, set_attention
from minitrain.kernels import use_kernels
from minitrain.ema import EMA, attach
from minitrain.errors import UserError
from minitrain.optim import AdamW
from minitrain.plan.fit import planned_peak_mb
from minitrain.plan.flops import FlopCounter, device_peak_flops
from minitrain.progress import Progress, strict_json
from minitrain.trackers import Trackers
from minitrain.schedule import lr_at, resolve_steps

Objective = Callable[[nn.Module, dict], tuple[torch.Tensor, Any, dict]]

# Settings that must match between a checkpoint and the run resuming it for the continuation
# to be the same run (the schedule, data order and loss normalisation depend on them).
RESUME_KEYS = ("batch_size", "grad_accum", "seed", "lr", "schedule", "min_lr_ratio", "warmup",
               "epochs", "max_steps", "weight_decay", "max_grad_norm", "precision", "finetune", "ema_decay")


class Interrupted(KeyboardInterrupt):
    """Training stopped before its end with a checkpoint saved: by SIGINT / SIGTERM (the step in
    progress finished), or after `stop_after` steps of this launch (`signum` None).

    A KeyboardInterrupt, so it passes through `except Exception` like Ctrl-C does; the CLI prints
    it with the command to resume and exits with `exit_code` (130 for SIGINT, 143 for SIGTERM, 0
    for stop_after: the launch did what it was asked).
    """

    def __init__(self, signum: int | None, step: int, folder: Path, total: int = 0):
        self.signum, self.step, self.folder = signum, step, folder
        self.exit_code = 128 + signum if signum is not None else 0
        self.signal_name = signal.Signals(signum).name if signum is not None else "stop_after"
        self.why = (f"by {self.signal_name}" if signum is not None
                    else f"of {total} (stop_after)")
        super().__init__(f"stopped at step {step} {self.why}; checkpoint saved in {folder} — resume with resume=true")

    def resume_line(self, command: str) -> str:
        """The message with the whole command to resume (`command` ends in `resume=true`)."""
        return f"stopped at step {self.step} {self.why}; checkpoint saved in {self.folder} — resume with: {command}"


def train(
    model: nn.Module,
    objective: Objective,
    train_examples: list[dict],
    collate: Callable[[list[dict]], dict[str, torch.Tensor]],
    cfg: Any,
    *,
    eval_examples: list[dict] | None = None,
    out_dir: str | os.PathLike | None = None,
    save_adapter: Callable[[nn.Module, Path], None] | None = None,
    optimizer: torch.optim.Optimizer | AdamW | None = None,
    trainable: Iterable[str] | None = None,
    log: Callable[[str], None] | None = None,
    eval_fn: Callable[[nn.Module, int, dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Train `model` in place and return a summary dict; everything else goes to `out_dir`.

    model: on its device, adapters applied and everything else frozen; follows the model
        contract (`forward -> hidden`, `output_projection`, `block_types`).
    objective: `(model, batch) -> (loss_sum, count, metrics)` (see `minitrain.objectives.sft`).
    train_examples / eval_examples: lists of example dicts (`minitrain.data.readers` readers); micro-
        batches are `collate([examples...])` moved to the model's device.
    cfg: a `TrainConfig` (or subclass); uses batch_size, grad_accum, epochs, max_steps, lr,
        weight_decay, max_grad_norm, warmup, schedule, min_lr_ratio, seed, precision,
        checkpointing, compile, save_every, eval_every, log_every, resume, overwrite, max_bad_steps.
    out_dir: default `cfg.out`. Receives `metrics.jsonl` (one JSON object per logged optimizer
        step), `checkpoint/` (resumable) and, via `save_adapter(model, out_dir / "adapter")`
        called once at the end of a finished run, the adapter.
    optimizer: default `minitrain.optim.AdamW` over exactly the trainable tensors (weight decay
        on >= 2-D only); a `torch.optim.Optimizer` works too. Its learning rate is overwritten
        every step from the schedule.
    trainable: parameter names to train (default: every parameter with `requires_grad`).
    log: one-line messages (default: print, flushed).
    eval_fn: called at each evaluation (needs eval_examples), after the held-out pass below, as
        `eval_fn(model, step, row)` with the metrics row so far; the dict it returns is merged into
        the row (e.g. `eval/rougeL` from generation). A returned `"stop": True` ends the run after
        this step (early stopping): checkpoint and adapter are saved, the summary has `stopped_early`.

    Evaluation (every `cfg.eval_every` steps and at the end, with eval_examples): one held-out
    pass, logged as one line. If the objective has an `evaluate(model, examples, collate,
    batch_size, amp_dtype) -> dict` method, that is the pass (DPO: `eval/loss` and TRL's metrics
    in one pass over the pairs); it must return `eval/loss` and the same values on every rank.
    Otherwise the generic `evaluate()`: `eval/loss`, plus `eval/ppl` for token-level objectives.

    Before step 1 the gradient-path audit (`minitrain.audit.preflight`) runs on one real
    example (a 32-token window around the first target of the shortest row, `audit_slice`) and
    stops the run if a trainable tensor is unreachable from the loss (rule 5); `cfg.skip_audit`
    skips it, and the skip is logged.

    Each metrics.jsonl row: step, loss (window loss sum / window count), lr, grad_norm (before
    clipping), tokens (input tokens in the window), target_tokens, tokens_per_s, flops_per_s (model
    FLOPs per second, all ranks: `minitrain.plan.flops`), mfu (per device, on CUDA devices of known
    peak), peak_mem_mb (and planned_peak_mb, the plan's figure, on CUDA or with `gpu_mem`:
    `minitrain.plan.fit`),
    epoch, tokens_seen, skipped_steps, data_wait (rows with images, when `collate` is marked `decodes_images`,
    as `minitrain.run.with_images` marks it: while a micro-batch trains, the next one, or the next step's
    first, is collated in one background thread; data_wait is the share of the step's time the loop waited
    for its batches, rank 0's), the objective's metrics averaged over the window, and
    on evaluation steps the held-out pass's metrics (`eval/loss`, `eval/ppl` when token-level, ...)
    and eval_fn's.

    `cfg.ema_decay` = d > 0 (`minitrain.ema`): after each optimizer step, ema = d * ema + (1 - d) * w
    for every trained tensor (from the weights before step 1); each evaluation (and eval_fn) runs
    with the EMA swapped in (its log line says so), the checkpoint keeps it (`ema.safetensors`),
    and it is left on the model (`minitrain.ema.whole(model)`) for the recipe's `finish` to save.

    Returns `{"step", "total_steps", "warmup_steps", "loss", "skipped_steps", "out_dir"}` and the
    last evaluation's `eval/...` metrics (when evaluated). Raises `UserError` for bad settings and when
    `cfg.max_bad_steps` non-finite steps in a row stop the run (after saving a checkpoint).

    SIGINT / SIGTERM while the loop runs (handlers installed here, the previous ones restored on
    return): the step in progress is finished, a checkpoint saved, and `Interrupted` raised. A
    repeat of the signal a second or more later acts as if these handlers were not there.

    Distributed (a process group is initialised, e.g. by the CLI under torchrun): every rank calls
    `train` with the same arguments. `cfg.batch_size` is the global micro-batch: rank r trains on
    `indices[r::world]` of each (a rank left with none by a short last batch runs one example at
    weight 0, so collectives stay in step). Trainable tensors start from rank 0's values. Loss
    sums, target counts, input tokens and gradients are summed over ranks at the optimizer step,
    so the update equals one process with the whole batch. `cfg.parallel` = "ddp" (every rank
    holds the model; one bucketed gradient all-reduce per optimizer step) or "fsdp" (FSDP2
    `fully_shard` per block then the root, before the audit; a model loaded on meta reads each rank's
    rows then (`minitrain.parallel.fsdp`); sharded gradients reduce-scattered as sums; the model stays sharded
    at the end: `run.finish` gathers what it saves). Rank 0 alone logs and writes, but each rank
    writes its own checkpoint files (its RNG state; under fsdp its rows of every tensor) and a
    checkpoint resumes at another world size or mode; the objective's metrics in metrics.jsonl are rank 0's.
    """
    log = log or functools.partial(print, flush=True)
    out = Path(out_dir if out_dir is not None else cfg.out)
    device = fsdp.device_of(model)
    world, rank = distributed.world_size(), distributed.rank()
    if rank != 0:
        log = _quiet  # rank 0 alone logs
    parallel = getattr(cfg, "parallel", "ddp")
    distributed.check(cfg, world, under_torchrun=distributed.active())
    if parallel == "fsdp" and optimizer is not None:
        raise UserError("optimizer: parallel=fsdp replaces the parameters with sharded ones — let train() build "
                        "the optimizer (optimizer=None), or use parallel=ddp")
    named = _trainable(model, trainable)
    params = [p for _, p in named]
    amp_dtype, scaler = resolve_precision(cfg.precision, device)
    set_attention(cfg, model, device, log)  # rows of several sequences: sdpa or flex (`attention=`)
    use_kernels(model, getattr(cfg, "kernels", "auto"), device, log)  # Qwen3.5's DeltaNet on CUDA: fla's kernels

    # ---- size the run in optimizer steps (rule 1) and say so before step 1
    total_steps, warmup_steps, micro_per_epoch = resolve_steps(
        len(train_examples), cfg.batch_size, cfg.grad_accum, cfg.epochs, cfg.max_steps, cfg.warmup
    )
    n_train = sum(p.numel() for p in params)
    log(
        f"examples: {len(train_examples)} | micro-batches/epoch: {micro_per_epoch} (batch_size "
        f"{cfg.batch_size}) | grad_accum: {cfg.grad_accum} | optimizer steps: {total_steps} "
        f"(~{total_steps * cfg.grad_accum / micro_per_epoch:.2f} epochs) | warmup steps: {warmup_steps} | "
        f"schedule: {cfg.schedule} | trainable: {n_train:,} in {len(params)} tensors | "
        f"precision: {amp_dtype or torch.float32}{' + GradScaler' if scaler else ''} | world: {world}"
        + (f" ({parallel}, {cfg.batch_size / world:g} examples per rank per micro-batch)" if world > 1 else "")
    )
    if any(p.dtype != torch.float32 for p in params):
        log("notice: some trainable tensors are not fp32; AdamW updates them in their own dtype")

    distributed.main_only(lambda: _prepare_out(out, cfg))
    planned_mb = planned_peak_mb(cfg, device)  # logged beside the measured peak_mem_mb (CUDA)
    torch.manual_seed(cfg.seed + rank)  # each rank draws its own dropout masks (rank 0: the seed)
    random.seed(cfg.seed + rank)
    _seed_numpy(cfg.seed + rank)

    # the data order is the same on every rank (seeded); each rank takes its share of each batch
    batcher = Batcher(_lengths(train_examples), cfg.batch_size, seed=cfg.seed,
                      shuffle=True, group_by_length=getattr(cfg, "group_by_length", True))
    if parallel == "fsdp" and save_adapter is not None:
        raise UserError("save_adapter: under parallel=fsdp the adapter stays sharded after training — leave "
                        "save_adapter=None and save it with run.finish (it gathers the adapter for rank 0)")
    if not any(p.is_meta or distributed.is_sharded(p) for p in params):  # (a sharded model: FSDP2 cut rank 0's)
        distributed.broadcast_tensors(params)  # every rank starts from rank 0's trainable values
    if optimizer is not None:
        ours = {id(p) for p in params}
        if any(id(p) not in ours for g in optimizer.param_groups for p in g["params"]):
            raise UserError("optimizer: holds tensors that are not among the trainable ones — build it over "
                            "exactly the parameters that require grad (or pass them as trainable=)")
    if cfg.checkpointing:
        enable_checkpointing(model, cfg.checkpointing)  # the preflight audit may have wrapped them: count them all
        n = sum(getattr(m, "_minitrain_checkpointed", False) for m in model.modules())
        total = sum(isinstance(m, tuple(model.block_types)) for m in model.modules())
        log(f"activation checkpointing (non-reentrant) on {f'the first {n} of {total}' if n < total else n} blocks")
    if cfg.compile:
        if device.type == "cuda" or (device.type == "cpu" and cpu_compiler()):
            n = compile_blocks(model)
            built = " (inductor's C++ kernels, built in the first steps)" if device.type == "cpu" else ""
            log(f"torch.compile on {n} blocks{built}")
        elif device.type == "cpu":
            log("notice: compile=true ignored on cpu: torch.compile's CPU backend needs a C++ compiler and none "
                "was found (install g++ or set CXX)")
        else:
            log(f"notice: compile=true ignored on {device.type} (torch.compile is used on CUDA and CPU)")

    if parallel == "fsdp":  # from here on the trainable tensors are this rank's shards (DTensors)
        fsdp.prepare(model, device, log)  # (already done by run.prepare_out_dir for a recipe)
        fsdp.reshard(model)  # (an evaluation before step 1 left the root's gathered tensors in its place)
        named = _trainable(model, [n for n, _ in named])
        params = [p for _, p in named]

    # ---- rule 5: every trainable tensor must be reachable from the loss, checked before step 1
    # (before a checkpoint is restored into the model; every rank audits the same batch)
    if getattr(cfg, "skip_audit", False):
        log("notice: gradient-path audit skipped (skip_audit=true)")
    elif getattr(model, _AUDITED, None) == id(objective) and optimizer is None:
        pass  # run.prepare_out_dir audited this model and objective before writing out/
    else:
        preflight(model, objective, audit_batch(train_examples, collate, cfg, device),
                  optimizer=optimizer, amp_dtype=amp_dtype, log=log)

    optimizer = optimizer or build_optimizer(named, cfg.weight_decay, cfg.lr)

    ema_decay = getattr(cfg, "ema_decay", 0.0)
    ema = EMA(named, ema_decay) if ema_decay else None  # the weights before step 1 (a resume loads its own)
    if ema is not None:
        log(f"ema: ema = {ema_decay:g} * ema + {1 - ema_decay:.6g} * w after each optimizer step, from the weights "
            f"before step 1; evaluations use the EMA weights")
    run_info = {k: getattr(cfg, k) for k in RESUME_KEYS if hasattr(cfg, k)}
    run_info.update(num_examples=len(train_examples), total_steps=total_steps, warmup_steps=warmup_steps)
    counters = {"skipped_steps": 0, "bad_in_row": 0, "micro_batches": 0, "tokens_seen": 0}
    step = 0
    made_from = ckpt.made_from(model)  # base model, tokenizer, adapter: a resume must match them
    tracker_ids: dict[str, str] = {}  # report_to's run ids: a resume continues those runs
    if cfg.resume:
        saved = ckpt.read_state(out)
        ckpt.check_made_from(saved.get("made_from"), made_from, ckpt.find(out))
        missing = [k for k in ("run", "counters", "batcher") if k not in saved]
        if missing:
            raise UserError(f"{ckpt.find(out) / 'state.json'}: holds no {', '.join(missing)} — it was not written by "
                            f"this training loop; start again without resume=true (overwrite=true)")
        extend = getattr(cfg, "extend", False)
        ckpt.check_run(saved["run"], run_info, extend)  # before touching the model
        if extend and total_steps <= saved["step"]:
            raise UserError(f"extend=true: the checkpoint is at step {saved['step']} and this run has {total_steps} "
                            f"optimizer steps — raise max_steps (or epochs) past {saved['step']}")
        state = ckpt.load(out, named, optimizer)  # weights, optimizer state and RNG, in place
        if ema is not None:
            ckpt.load_ema(out, list(zip(ema.names, ema.tensors)))  # (each rank its own rows)
        step, counters, tracker_ids = state["step"], state["counters"], state.get("trackers", {})
        batcher.load_state_dict(state["batcher"])
        distributed.main_only(lambda: ckpt.truncate_log(out / "metrics.jsonl", step))
        log(f"resumed from {ckpt.find(out)} at step {step}/{total_steps}")
        if ckpt.world_note(saved, world):  # another number of processes: exact but for random draws
            log(ckpt.world_note(saved, world))
        if extend and total_steps != saved["run"].get("total_steps"):
            log(extension_rule(step, saved["run"].get("total_steps"), total_steps, warmup_steps, cfg))

    def lr_of(s: int) -> float:  # the LR of optimizer step s (1-based): a pure function of s
        return lr_at(s, total_steps=total_steps, warmup_steps=warmup_steps, peak_lr=cfg.lr,
                     kind=cfg.schedule, min_lr_ratio=cfg.min_lr_ratio)

    saved_at = step if cfg.resume else -1
    started_at = step  # stop_after counts the steps of this launch

    def save_checkpoint() -> None:  # every rank calls it and writes its own files (its part under fsdp)
        nonlocal saved_at
        ckpt.save(out, named, optimizer, {"step": step, "run": run_info, "made_from": made_from,
                                           "counters": counters, "batcher": batcher.state_dict(),
                                           "trackers": sink.ids() if sink else {},
                                           "schedule": {"next_step": step + 1, "total_steps": total_steps,
                                                        "warmup_steps": warmup_steps}},
                  ema=ema.state_dict() if ema is not None else None)
        saved_at = step

    metrics_f = open(out / "metrics.jsonl", "a", buffering=1) if rank == 0 else None  # line-buffered
    sink = (Trackers(getattr(cfg, "report_to", []), out, to_dict(cfg), step, tracker_ids, log)  # wandb, mlflow, ...
            if rank == 0 else None)
    progress = Progress(total_steps, step, log, enabled=rank == 0)  # a bar on a terminal, plain lines in a log
    stream = _micro_batches(batcher)
    # rows with images: the next micro-batch is collated (its images decoded) in a background thread while one
    # trains (`minitrain.data.prefetch`); the batches after the window's come from a copy of the batcher, so
    # the one saved in checkpoints never runs ahead of the batches used. Text rows: collated in the loop.
    prefetch = (Prefetch(collate, train_examples)
                if getattr(collate, "decodes_images", False) and carries_media(train_examples).any() else None)
    following = _following(batcher) if prefetch is not None else None
    summary: dict[str, Any] = {"loss": None}
    model.train()
    flop_counter = FlopCounter.of(model)  # model FLOPs per token (minitrain.plan.flops: the formula)
    peak_flops = device_peak_flops(device)  # dense bf16 peak of a known CUDA device, for MFU
    stop = _SignalStop()  # SIGINT / SIGTERM: finish this step, save, raise Interrupted
    stop.install()
    try:
        window: list[list[int]] | None = None  # the micro-batches (example indices) of this step
        while step < total_steps:
            t0 = time.perf_counter()
            if window is None:  # (kept when an fp16 overflow makes us redo the same window)
                window = [next(stream) for _ in range(cfg.grad_accum)]
                nexts = [next(following) for _ in window] if following is not None else None  # each one's next
                first_mb = counters["micro_batches"]
                counters["micro_batches"] += len(window)
            # ---- one accumulation window: grad_accum micro-batches, loss SUMs backpropagated
            window_loss = torch.zeros((), device=device)  # fp32, summed over the window
            window_count = torch.zeros((), device=device)
            finite, metric_sums, metric_counts, tokens, flops = [], {}, {}, 0, 0.0
            waited = prefetch.wait if prefetch is not None else 0.0
            for j, idx in enumerate(window):
                mine = idx[rank::world]  # this rank's share of the global micro-batch
                empty = not mine  # a short last batch left this rank nothing: one example at weight 0
                if prefetch is None:
                    cpu_batch = collate([train_examples[i] for i in (mine or idx[:1])])
                else:  # the worker's batch when it made this one (its error raised here), else collated now
                    cpu_batch = prefetch.get(mine or idx[:1])
                    if j + 1 < len(window) or step + 1 < total_steps:  # the next one, decoded while this trains
                        ahead = nexts[j]
                        prefetch.ahead(ahead[rank::world] or ahead[:1])
                if empty:
                    cpu_batch["placeholder"] = True  # for objectives that gather across ranks (GRPO's batch std)
                else:
                    tokens += _input_tokens(cpu_batch)  # counted on the host copy: no device sync
                    flops += flop_counter.batch(cpu_batch)
                batch = _to_device(cpu_batch, device)
                with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                    loss_sum, count, metrics = objective(model, batch)
                loss_sum = loss_sum.float()
                if empty:
                    loss_sum, count = loss_sum * 0.0, 0
                if loss_sum.requires_grad:
                    (scaler.scale(loss_sum) if scaler else loss_sum).backward()
                # the graph goes now, not at the next micro-batch's loss: tensors an autograd node holds outside
                # its saved tensors (bitsandbytes' int8 matmul keeps its input) would live through the optimizer
                # step and the next forward (the memory plan counts them to the end of the backward)
                loss_sum = loss_sum.detach()
                window_loss += loss_sum
                window_count += count
                finite.append(torch.isfinite(loss_sum))
                for k, v in ({} if empty else metrics).items():
                    metric_sums[k] = metric_sums.get(k, 0.0) + float(v)
                    metric_counts[k] = metric_counts.get(k, 0) + 1  # a key a micro-batch lacks (KTO: no
                    # undesirable row in it) is averaged over the micro-batches that have it

            # ---- the optimizer step: normalise by the window's (and ranks') total count (rule 2)
            # summed over ranks in one call: loss, target count, non-finite micro-batches, input
            # tokens, and the SIGINT / SIGTERM seen so far (so every rank stops after the same step)
            stats = torch.cat([torch.stack([window_loss, window_count, (~torch.stack(finite)).sum().float()]),
                               torch.tensor([tokens, flops, *stop.seen()], dtype=torch.float32, device=device)])
            distributed.all_reduce_sum([stats])
            loss_total, total, nonfinite, tokens_f, flops, sigint, sigterm = stats.tolist()  # the one host sync per step
            tokens = int(tokens_f)
            grad_norm = float("nan")
            ok = nonfinite == 0 and total > 0
            unscaled = False
            if ok:
                _reduce_and_scale_grads(params, 1.0 / total, world, model)  # sum over ranks, / count
                if scaler:  # after the all-reduce, so every rank sees the same overflow
                    scaler.unscale_(optimizer)  # grads / loss scale, records overflow
                    unscaled = True
                max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # pre-clip norm
                grad_norm = distributed.full_tensor(norm).item()
                ok = math.isfinite(grad_norm)
            if not ok:
                optimizer.zero_grad(set_to_none=True)
                if unscaled:  # fp16 overflow with a finite loss: halve the scale and redo the window,
                    redo = scaler.get_scale() >= 1.0  # unless even unscaled gradients overflow
                    scaler.update()
                    if redo:
                        log(f"step {step + 1}: fp16 gradient overflow, loss scale now {scaler.get_scale():g}; "
                            f"redoing the window")
                        continue
                counters["skipped_steps"] += 1
                counters["bad_in_row"] += 1
                where = [(first_mb + j, idx) for j, idx in enumerate(window)]
                window = None
                bad = [w for w, f in zip(where, finite) if not bool(f)] or where
                what = "no target tokens" if total == 0 else ("non-finite loss" if nonfinite else "non-finite gradient")
                log(f"step {step + 1}: {what} in micro-batch(es) "
                    + ", ".join(f"#{mb} (examples {ex})" for mb, ex in bad)
                    + f" — step skipped ({counters['bad_in_row']} in a row, {counters['skipped_steps']} in all)")
                if counters["bad_in_row"] >= cfg.max_bad_steps:
                    save_checkpoint()
                    raise UserError(
                        f"training: {counters['bad_in_row']} bad steps in a row (last: {what} at step {step + 1}) "
                        f"— checkpoint saved in {out / ckpt.NAME}; check the examples listed above, lower lr "
                        f"or use precision=fp32, then rerun with resume=true"
                    )
                continue
            lr = lr_of(step + 1)
            for g in optimizer.param_groups:
                g["lr"] = lr
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:  # after the step, so a step the scaler skipped changes nothing either
                ema.update()
            step += 1
            window = None
            counters["bad_in_row"] = 0
            counters["tokens_seen"] += tokens

            # ---- log, evaluate, save
            evaluating = bool(eval_examples) and ((cfg.eval_every and step % cfg.eval_every == 0) or step == total_steps)
            written = step % cfg.log_every == 0 or step == total_steps or evaluating  # the row leaves the process
            if world > 1 and written:  # the objective's metrics over every rank's micro-batches, not rank 0's share
                metric_sums, metric_counts = _merge_metrics(distributed.gather_objects((metric_sums, metric_counts)))
            dt = time.perf_counter() - t0
            row = {"step": step, "loss": loss_total / total, "lr": lr, "grad_norm": grad_norm,
                   "tokens": tokens, "target_tokens": int(total), "tokens_per_s": tokens / dt,
                   "peak_mem_mb": _peak_mem_mb(device), **({"planned_peak_mb": planned_mb} if planned_mb else {}),
                   "epoch": counters["micro_batches"] / micro_per_epoch,
                   "tokens_seen": counters["tokens_seen"], "skipped_steps": counters["skipped_steps"],
                   "flops_per_s": flops / dt,
                   **({"mfu": flops / dt / world / peak_flops} if peak_flops else {}),
                   **{k: v / metric_counts[k] for k, v in metric_sums.items()}}
            if prefetch is not None:  # the share of the step spent waiting for its batches (rank 0's)
                row["data_wait"] = (prefetch.wait - waited) / dt
            summary["loss"] = row["loss"]
            stop_early = False
            if evaluating:  # one held-out pass: the objective's own when it has one (DPO), else the generic
                with ema.applied() if ema is not None else contextlib.nullcontext():  # the EMA is what is evaluated
                    if hasattr(objective, "evaluate"):
                        held_out = objective.evaluate(model, eval_examples, collate, cfg.batch_size, amp_dtype)
                    else:
                        held_out = evaluate(model, objective, eval_examples, collate, cfg.batch_size, amp_dtype)
                    row.update(held_out)
                    log(f"step {step}{' (EMA weights)' if ema is not None else ''}: "
                        + " | ".join(f"{k} {v:.4f}" for k, v in held_out.items()))
                    if eval_fn is not None:
                        extra = dict(eval_fn(model, step, dict(row)))
                        stop_early = distributed.any_rank(bool(extra.pop("stop", False)), device)
                        row.update(extra)
                fsdp.reshard(model)  # the shards back in the model's place: the checkpoint and the save read them
                summary.update({k: v for k, v in row.items() if k.startswith("eval/")})
            if metrics_f and written:
                metrics_f.write(strict_json(row) + "\n")
                metrics_f.flush()
                if sink:
                    sink.write(row)
            progress.update(step, row)
            if (cfg.save_every and step % cfg.save_every == 0) or step == total_steps or stop_early:
                save_checkpoint()
            if world == 1:  # no other rank to agree with: stop after the step the signal came in
                sigint, sigterm = stop.seen()
            if sigint or sigterm:  # (ranks: seen by one before this step's sum) every rank stops here
                if saved_at != step:
                    save_checkpoint()
                raise Interrupted(signal.SIGINT if sigint else signal.SIGTERM, step, out / ckpt.NAME)
            if getattr(cfg, "stop_after", 0) and step - started_at >= cfg.stop_after and step < total_steps:
                if saved_at != step:
                    save_checkpoint()
                raise Interrupted(None, step, out / ckpt.NAME, total_steps)
            if stop_early:
                summary["stopped_early"] = step
                log(f"step {step}: stopping early (eval_fn asked to), {total_steps - step} steps not run")
                break
    finally:
        if prefetch is not None:
            prefetch.close()  # nothing left running, whatever ended the loop
        stop.restore()
        progress.close()
        if metrics_f:
            metrics_f.close()
        if sink:
            sink.close()

    attach(model, ema)  # for the recipe's finish(), which saves it beside the adapter / model
    if save_adapter is not None:
        distributed.main_only(lambda: save_adapter(model, out / "adapter"))
    summary.update(step=step, total_steps=total_steps, warmup_steps=warmup_steps,
                   skipped_steps=counters["skipped_steps"], out_dir=str(out))
    return summary


# ----------------------------------------------------------------------------- building blocks


AUDIT_SLICE = 16  # tokens kept on each side of the first target by `audit_slice`


def carries_media(examples) -> np.ndarray:
    """Per example, whether it has images or videos (a token store's from its offsets, without building them)."""
    return carries(examples, "images") | carries(examples, "videos")


def audit_slice(ex: dict, keep: int = AUDIT_SLICE) -> dict:
    """A short window of one example for the audit: `keep` tokens before its first target and
    `keep` from it, cut from `input_ids` and `labels`, and from every `<name>_ids` list and its
    `<name>_labels` partner (DPO's chosen and rejected rows), alike.

    The window is taken in each id list with the same offsets as in its labels, so a causal
    example stays aligned (position t still predicts token t + 1) and at least one target stays
    in it; seq2seq's encoder ids are cut with the decoder's window, which keeps both non-empty.
    Other keys (a precomputed reference log-prob) are kept as they are. An example with images or videos is
    kept whole: each one's placeholder tokens must all stay with it.
    """
    out = dict(ex)
    if out.get("images") or out.get("videos"):
        return out
    for key, ids in ex.items():
        if not key.endswith("ids") or not isinstance(ids, (list, tuple)):
            continue
        lab_key = "labels" if key == "input_ids" else key[: -len("ids")] + "labels"
        labels = ex.get(lab_key)
        if not isinstance(labels, (list, tuple)):
            continue
        first = next((t for t in range(1, len(labels)) if labels[t] != IGNORE_INDEX), 1)
        start, stop = max(0, first - keep), first + keep
        out[key], out[lab_key] = list(ids[start:stop]), list(labels[start:stop])
    return out


def extension_rule(step: int, old_total: int | None, total: int, warmup: int, cfg: Any) -> str:
    """The line that states how an extended run (`extend=true`) schedules its remaining steps.

    The rule: steps `step + 1 .. total` take the LR that a run planned for `total` steps from the
    start (same lr, warmup, schedule, min_lr_ratio) gives them; the steps already taken keep the
    LR they had. A pure function of the step again from here on (rule 1), so a resume inside the
    extension continues it exactly."""
    def lr(s: int) -> float:
        return lr_at(s, total_steps=total, warmup_steps=warmup, peak_lr=cfg.lr, kind=cfg.schedule,
                     min_lr_ratio=cfg.min_lr_ratio)

    return (f"extend: the run of {old_total} steps continues from step {step} to {total}; steps {step + 1}..{total} "
            f"take the LR a {total}-step {cfg.schedule} schedule (warmup {warmup}) gives them: "
            f"{lr(step + 1):.3g} at step {step + 1} -> {lr(total):.3g} at step {total}")


def audit_batch(examples: list[dict], collate: Callable[[list[dict]], dict], cfg: Any,
                device: torch.device) -> dict[str, Any]:
    """The audit's real batch: a short slice (`audit_slice`) of the shortest example, collated and
    on `device`.

    Whether a tensor is reachable from the loss does not depend on the batch's size or length,
    so the preflight costs a fraction of a step instead of two full micro-batches; on long-row
    data (an 890-token shortest row) even one full example was a third of the time to step 1. With image (or
    video) rows, the shortest of them, so that the path from the images (a trained tower or projector) is audited.
    """
    lengths = np.asarray(_lengths(examples), dtype=np.float64)
    marks = carries_media(examples)
    if marks.any():
        lengths[~marks] = np.inf
    return _to_device(collate([audit_slice(examples[int(np.argmin(lengths))])]), device)


def audit_inputs(model: nn.Module, examples: list[dict], collate: Callable[[list[dict]], dict],
                 cfg: Any, log: Callable[[str], None] = print) -> tuple[dict[str, Any], AdamW, torch.dtype | None]:
    """What `train()` would audit before step 1, for `minitrain audit`: the audit batch, the
    optimizer `train()` would build, the autocast dtype; checkpointing applied and FSDP2 sharding done
    as the run would (`parallel=fsdp`: the audit runs on the shards)."""
    device = fsdp.device_of(model)
    amp_dtype, _ = resolve_precision(cfg.precision, device)
    if cfg.checkpointing:
        enable_checkpointing(model, cfg.checkpointing)
    if fsdp.wanted(cfg):
        fsdp.prepare(model, device, log)
    named = _trainable(model, None)
    optimizer = build_optimizer(named, cfg.weight_decay, cfg.lr)
    return audit_batch(examples, collate, cfg, device), optimizer, amp_dtype


_AUDITED = "_minitrain_audited_objective"


def mark_audited(model: nn.Module, objective: Objective) -> None:
    """Note that the preflight passed for `model` with `objective` (run.prepare_out_dir runs it before
    writing anything), so `train()` does not run it again. An id, not the objective: an objective
    that is an nn.Module must not become a submodule of the model."""
    setattr(model, _AUDITED, id(objective))


def build_optimizer(
    named: list[tuple[str, torch.Tensor]], weight_decay: float, lr: float, device: torch.device | None = None
) -> AdamW:
    """AdamW over exactly these tensors; decay on matrices only (not norms, biases).

    `minitrain.optim.AdamW`, not torch's (whose construction imports torch._dynamo: about a
    CPU-second before step 1), with the same foreach update on every device; `device` is
    accepted for callers written when CUDA took the fused kernel, and changes nothing.
    """
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return AdamW(groups, lr=lr)


def enable_checkpointing(model: nn.Module, setting: int | bool = True) -> int:
    """Run blocks of `model.block_types` under non-reentrant activation checkpointing: every block
    (`setting=True`), or the first N (`setting=N`, in module order: the first blocks' activations
    live longest, so each one checkpointed frees the most; the rest keep theirs and recompute nothing).

    Non-reentrant: with frozen embeddings the block inputs do not require grad, and reentrant
    checkpointing then returns outputs without a graph, so the adapters inside get no gradient
    (field report 004). The non-reentrant form records the graph normally and recomputes only
    the saved activations. Applied only while grad is enabled (not in eval / generation).
    Returns the number of blocks wrapped now; wrapping twice is a no-op. An N beyond the model's
    blocks is a UserError naming `checkpointing`.
    """
    blocks = [m for m in model.modules() if isinstance(m, tuple(model.block_types))]
    n = 0
    for m in blocks[:checkpointed_blocks(setting, len(blocks))]:
        if not getattr(m, "_minitrain_checkpointed", False):
            m._minitrain_block_forward = m.forward  # what the checkpoint runs (compile_blocks may compile it)

            def forward(*args, _m=m, **kwargs):
                inner = _m._minitrain_block_forward
                if torch.is_grad_enabled():
                    return checkpoint(inner, *args, use_reentrant=False, **kwargs)
                return inner(*args, **kwargs)

            m.forward = forward  # instance attribute: nn.Module.__call__ dispatches to it
            m._minitrain_checkpointed = True
            n += 1
    return n


RECOMPILE_LIMIT = 64  # compile_blocks: dynamo's per-function limit, raised to at least this


def cpu_compiler() -> str | None:
    """The C++ compiler that torch.compile's CPU backend (inductor) builds its kernels with, None
    when there is none (`CXX`, else g++ on PATH)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # no compiler (or a torch whose inductor has moved it): run eagerly
        return None


def compile_blocks(model: nn.Module, **options) -> int:
    """`torch.compile` each block in place (one graph per block type, reused across layers).

    Every block runs the same Python function, and dynamo's recompile limit (8 by default) counts
    the graphs of a function across all of them: grad on or off (the policy, the reference, eval),
    whether the block's input requires grad (the first block's does not), the adapters enabled or
    disabled, the first shapes static and the next dynamic. A DPO run reaches 8 in its first
    steps (seen on an H200, BENCHMARKS.md), after which dynamo quietly runs every new variant
    eagerly; the limit is raised to `RECOMPILE_LIMIT` (never lowered). `options` go to
    `torch.compile` (the tests use `backend="eager"`).

    A checkpointed block (`enable_checkpointing`, called first) is compiled with its checkpoint
    inside the graph, except one with a quantized base (bitsandbytes nf4 / int8, ternary): its
    products run in autograd Functions, whose outputs torch 2.11's compiled checkpointing does not
    recompute but saves (QLoRA 8B at 2.05x the plan's peak on an H200, BENCHMARKS.md). There the
    checkpoint stays outside, in eager, and only the block's own forward is compiled.
    """
    import torch._dynamo

    config = torch._dynamo.config
    key = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, key, max(getattr(config, key), RECOMPILE_LIMIT))
    blocks = [m for m in model.modules() if isinstance(m, tuple(model.block_types))]
    for m in blocks:
        if getattr(m, "_minitrain_checkpointed", False) and any(quant_kind(p) for p in m.parameters()):
            m._minitrain_block_forward = torch.compile(m._minitrain_block_forward, **options)
        else:
            m.compile(**options)
    return len(blocks)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    objective: Objective,
    examples: list[dict],
    collate: Callable[[list[dict]], dict[str, torch.Tensor]],
    batch_size: int,
    amp_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """The generic held-out pass: `eval/loss` = total loss / total count over `examples`.

    That is the mean loss per unit of the objective (`minitrain.objectives.sft`): the mean token CE
    for SFT, seq2seq, and distillation and ARD in eval mode. `eval/ppl` = exp(`eval/loss`) is
    added only for an objective whose unit is the target token, i.e. unless it says
    `token_level = False` (DPO: the pair, where exp of the loss is no perplexity). Runs in eval
    mode (objectives may switch on `model.training`); each global batch is split across ranks
    and the sums all-reduced, so every rank returns the same values.
    """
    device = next(model.parameters()).device
    world, rank = distributed.world_size(), distributed.rank()
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, device=device)  # (loss sum, count)
    for i in range(0, len(examples), batch_size):  # global batches, each split across ranks (as in training)
        mine = examples[i : i + batch_size][rank::world]
        batch = _to_device(collate(mine or examples[i : i + 1]), device)  # none left: one at weight 0
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss_sum, count, _ = objective(model, batch)
        if mine:
            sums += torch.stack([loss_sum.float(), torch.as_tensor(count, device=device, dtype=torch.float32)])
    distributed.all_reduce_sum([sums])
    model.train(was_training)
    loss_sum, count = sums.tolist()
    mean = loss_sum / max(count, 1.0)
    if not getattr(objective, "token_level", True):
        return {"eval/loss": mean}
    return {"eval/loss": mean, "eval/ppl": math.exp(mean) if mean < 700 else float("inf")}


def evaluate_once(
    model: nn.Module,
    objective: Objective,
    examples: list[dict],
    collate: Callable[[list[dict]], dict[str, torch.Tensor]],
    cfg: Any,
    eval_fn: Callable[[nn.Module, int, dict[str, Any]], dict[str, Any]] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """The loop's held-out evaluation run once outside it, as step 0: before step 1, or as the whole
    run with `eval_only=true`. The objective's own `evaluate` when it has one (DPO, KTO), else the
    generic `evaluate`; then `eval_fn(model, 0, row)` (ROUGE, ...), its values merged (a "stop" it
    returns is dropped: nothing runs after). Logged as the loop logs an evaluation; returns the row."""
    log = log or functools.partial(print, flush=True)
    device = fsdp.device_of(model)
    if fsdp.wanted(cfg):
        fsdp.prepare(model, device, log)  # a model still on meta is sharded and read first
    amp_dtype, _ = resolve_precision(cfg.precision, device)
    if hasattr(objective, "evaluate"):
        row = dict(objective.evaluate(model, examples, collate, cfg.batch_size, amp_dtype))
    else:
        row = evaluate(model, objective, examples, collate, cfg.batch_size, amp_dtype)
    if eval_fn is not None:
        extra = dict(eval_fn(model, 0, dict(row)))
        extra.pop("stop", None)
        row.update(extra)
    log("step 0: " + " | ".join(f"{k} {v:.4f}" for k, v in row.items() if isinstance(v, int | float)))
    return row


# ----------------------------------------------------------------------------- small helpers


def _trainable(model: nn.Module, names: Iterable[str] | None) -> list[tuple[str, torch.Tensor]]:
    """(name, param) to train, checked: floating point only (rule 3), at least one."""
    all_named = dict(model.named_parameters())
    if names is None:
        named = [(n, p) for n, p in all_named.items() if p.requires_grad]
    else:
        named = []
        for n in names:
            if n not in all_named:
                raise UserError(f"trainable: no parameter named {n!r} — use names from model.named_parameters()")
            named.append((n, all_named[n]))
    if not named:
        frozen_adapter = next((n for n in all_named if ".lora_" in n), None)
        if frozen_adapter:
            raise UserError(f"model: no trainable parameters: the adapter is frozen (e.g. {frozen_adapter}) — it was "
                            f"loaded without trainable=True; load it with load_adapter(..., trainable=True) / "
                            f"init_adapter=")
        raise UserError("model: no trainable parameters — apply adapters or unfreeze the tensors to train")
    for n, p in named:
        if not p.dtype.is_floating_point:
            raise UserError(f"{n}: {p.dtype} tensors cannot be trained — freeze it and train an adapter on it instead")
        if not p.requires_grad:
            raise UserError(f"trainable: {n} does not require grad — unfreeze it (requires_grad_) first")
    return named


def _prepare_out(out: Path, cfg: Any) -> None:
    """Refuse to mix two runs in one folder; with overwrite, clear the old run's log and checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    old_run = (out / "metrics.jsonl").exists() or ckpt.find(out) is not None
    if cfg.resume or not old_run:
        return
    if not cfg.overwrite:
        raise UserError(f"{out}: holds a previous run (metrics.jsonl / checkpoint) — pass resume=true to "
                        f"continue it, overwrite=true to replace it, or choose another out")
    (out / "metrics.jsonl").unlink(missing_ok=True)
    for d in [out / ckpt.NAME, *out.glob(f"{ckpt.NAME}.old-*"), *out.glob(f"{ckpt.NAME}.tmp-*")]:
        shutil.rmtree(d, ignore_errors=True)


def _micro_batches(batcher: Any) -> Iterator[list[int]]:
    """An endless stream of micro-batches (lists of example indices), epoch after epoch."""
    while True:
        yield from batcher


def _following(batcher: Batcher) -> Iterator[list[int]]:
    """The stream of `_micro_batches(batcher)` one micro-batch ahead, from a copy of the batcher: its n-th
    item is the micro-batch after the real stream's n-th. The real batcher's position, which checkpoints save,
    is left as it is."""
    ahead = _micro_batches(copy.copy(batcher))  # (its own epoch and position; the lengths shared, read only)
    next(ahead)
    return ahead


def _reduce_and_scale_grads(params: list[torch.Tensor], scale: float, world: int, model: nn.Module) -> None:
    """Sum gradients across ranks and multiply by `scale` (1 / the global target count).

    FSDP2 has already reduce-scattered them as sums (sharded grads); a DDP-wrapped model has
    averaged them (undo its 1/world); otherwise one bucketed all-reduce here, once per optimizer
    step. A tensor that got no gradient on this rank takes part as zeros, so every rank sends the
    same buffers."""
    if world > 1 and not any(distributed.is_sharded(p) for p in params):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            scale *= world
        else:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            distributed.all_reduce_sum([p.grad for p in params])
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale)


def _quiet(*_: Any, **__: Any) -> None:
    """The log of ranks other than 0."""


class _SignalStop:
    """SIGINT / SIGTERM while the loop runs: remember it; the loop finishes the step, saves, and
    raises `Interrupted`. Nothing is printed here: a handler that prints while the main thread is
    printing can fail ("reentrant call"). A repeat a second or more after the first restores the
    previous handlers and re-raises the signal (Ctrl-C twice: stop now; the last complete
    checkpoint stays valid); a repeat within the second is ignored (torchrun forwards the signal
    a terminal already sent to every process of the group)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.got: set[int] = set()
        self.first_at = 0.0
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; leave the defaults
        for s in self.SIGNALS:
            self.previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.got:
            self.first_at = time.monotonic()
        elif time.monotonic() - self.first_at >= 1.0:
            self.restore()
            signal.raise_signal(signum)
            return
        self.got.add(signum)

    def seen(self) -> tuple[int, int]:
        """(SIGINT seen, SIGTERM seen) as 0 / 1."""
        return int(signal.SIGINT in self.got), int(signal.SIGTERM in self.got)

    def restore(self) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self.previous.clear()


def _length(ex: dict) -> int:
    """Tokens in an example (for length grouping): its `input_ids`, else all its id lists."""
    if "input_ids" in ex:
        return len(ex["input_ids"])
    return sum(len(v) for k, v in ex.items() if k.endswith("_ids") and isinstance(v, (list, tuple)))


def _lengths(examples: Sequence[dict]) -> Sequence[int]:
    """`_length` of every example; a token store has them as an array (no example is built)."""
    lengths = getattr(examples, "batch_lengths", None)
    return lengths if lengths is not None else [_length(ex) for ex in examples]


def _input_tokens(batch: dict[str, Any]) -> int:
    """Non-padding tokens fed to the model: sum of every `*attention_mask`, else `input_ids.numel()`."""
    masks = [v for k, v in batch.items() if k.endswith("attention_mask") and isinstance(v, torch.Tensor)]
    if masks:
        return int(sum(int(m.sum()) for m in masks))
    ids = batch.get("input_ids")
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else 0


def _merge_metrics(parts: list[tuple[dict[str, float], dict[str, int]]]) -> tuple[dict[str, float], dict[str, int]]:
    """Every rank's (metric sums, micro-batch counts) summed key by key: a logged metric is then the mean
    of every micro-batch's value on every rank (a rank's share of a micro-batch counting as one; a
    placeholder batch adds nothing)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for rank_sums, rank_counts in parts:
        for k, v in rank_sums.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + rank_counts[k]
    return sums, counts


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _peak_mem_mb(device: torch.device) -> float:
    """Peak memory so far: CUDA allocator peak on GPU, process peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _seed_numpy(seed: int) -> None:
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
