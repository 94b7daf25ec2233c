"""Learning-rate schedules as pure functions of the optimizer step (rule 1).

A step is one optimizer update, never a micro-batch: with gradient accumulation the schedule
is sized by `resolve_steps`, which divides micro-batches by `grad_accum` (field report 001: a
schedule sized in micro-batches but stepped per update left the LR near zero for the whole run).

Convention: `step` is the 1-based index of the update about to be taken (the first update is
step 1, the last is `total_steps`). With `W = warmup_steps` and `N = total_steps`:

- warmup, `step <= W`: `peak * step / W` (a linear ramp from 0 at step 0 to peak at step W);
- after warmup, with `p = (step - W - 1) / (N - W)` in `[0, 1)`:
    constant: `peak`;
    linear:   `min + (peak - min) * (1 - p)`;
    cosine:   `min + (peak - min) * (1 + cos(pi * p)) / 2`  (a half cosine from peak down to min),
  where `min = peak * min_lr_ratio`. The decay starts at peak on the first update after warmup
  and would reach `min` one update after the last, so no update is wasted at LR 0.
"""

from __future__ import annotations

import math

from minitrain.errors import UserError

KINDS = ("constant", "linear", "cosine")


def lr_at(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    peak_lr: float,
    kind: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> float:
    """The learning rate for optimizer update number `step` (1-based); see the module doc."""
    if kind not in KINDS:
        raise UserError(f"schedule: unknown schedule {kind!r} — use one of {', '.join(KINDS)}")
    if not 1 <= step <= total_steps:
        raise ValueError(f"lr_at: step {step} outside 1..{total_steps}")
    if step <= warmup_steps:
        return peak_lr * step / warmup_steps
    if kind == "constant":
        return peak_lr
    min_lr = peak_lr * min_lr_ratio
    progress = (step - warmup_steps - 1) / (total_steps - warmup_steps)  # in [0, 1)
    if kind == "linear":
        return min_lr + (peak_lr - min_lr) * (1.0 - progress)
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def resolve_steps(
    num_examples: int,
    batch_size: int,
    grad_accum: int,
    epochs: float,
    max_steps: int,
    warmup: float,
) -> tuple[int, int, int]:
    """Size a run in optimizer steps: `(total_steps, warmup_steps, micro_batches_per_epoch)`.

    The loop draws micro-batches as one stream across epochs and takes an optimizer step every
    `grad_accum` of them, so `total_steps = floor(epochs * micro_batches_per_epoch / grad_accum)`
    (at least 1) unless `max_steps > 0` sets it directly. A partial epoch's trailing micro-batches
    that do not fill a window are not used. `warmup >= 1` is a number of steps, `0 < warmup < 1`
    a ratio of `total_steps` (rounded up).
    """
    if num_examples < 1:
        raise UserError("data: no training examples — check the data file and max_len")
    if batch_size < 1:
        raise UserError(f"batch_size: {batch_size} is not a positive integer — set batch_size >= 1")
    if grad_accum < 1:
        raise UserError(f"grad_accum: {grad_accum} is not a positive integer — set grad_accum >= 1")
    if warmup < 0:
        raise UserError(f"warmup: {warmup} is negative — use steps (>= 1) or a ratio (< 1)")
    micro_per_epoch = math.ceil(num_examples / batch_size)
    if max_steps > 0:
        total = int(max_steps)
    else:
        if epochs <= 0:
            raise UserError(f"epochs: {epochs} is not positive — set epochs > 0 or max_steps > 0")
        total = max(1, math.floor(epochs * micro_per_epoch / grad_accum))
    if warmup >= 1:
        if warmup != int(warmup):
            raise UserError(f"warmup: {warmup} steps is not a whole number — use an integer or a ratio < 1")
        warm = int(warmup)
    else:
        warm = math.ceil(warmup * total)
    if warm > total:
        raise UserError(
            f"warmup: {warm} warmup steps is longer than the run ({total} optimizer steps = "
            f"{micro_per_epoch} micro-batches/epoch x {epochs:g} epochs / grad_accum {grad_accum}) "
            f"— lower warmup or use a ratio < 1"
        )
    return total, warm, micro_per_epoch
