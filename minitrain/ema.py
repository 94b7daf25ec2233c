"""An exponential moving average of the trained tensors (`ema_decay=d`): the weights evaluated and
saved beside the trained ones (`adapter_ema/` or `model_ema/`).

After every optimizer step that updates the weights (a skipped step does not count), for each
trained tensor `w` (the adapter's, or every weight with `finetune=full`):

    ema <- d * ema + (1 - d) * w        computed as torch.lerp(ema, w, 1 - d), in w's dtype (fp32)

starting from `ema = w` before step 1: no warm-up or bias correction, so with d = 0.999 the average
still leans on the starting weights for the first few thousand steps (its weight on them after t
steps is d**t). The EMA lives beside the weights (one more copy of the trained tensors), goes into
the checkpoint (`ema.safetensors`), so a resumed run continues it bitwise, and is swapped into the
model for each evaluation (`applied`), whose metrics are then the EMA's; the trained values wait in
a temporary copy meanwhile (a third copy of the trained tensors, during evaluation only).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from minitrain.parallel import distributed

_ATTR = "_minitrain_ema"  # where train() leaves the EMA on the model for the recipe's `finish`


class EMA:
    """The moving average of `named` (name, trained tensor) pairs, with decay `decay` in [0, 1)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], decay: float):
        self.decay = decay
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.tensors = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """One step of the average, after an optimizer step: ema <- lerp(ema, w, 1 - decay)."""
        for e, p in zip(self.tensors, self.params):  # per tensor: FSDP2 shards (DTensors) too
            e.lerp_(p.detach(), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA by parameter name (this rank's shards under FSDP)."""
        return dict(zip(self.names, self.tensors))

    @torch.no_grad()
    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore whole tensors (a checkpoint's), each laid out as its parameter (its shard under FSDP)."""
        for name, e, p in zip(self.names, self.tensors, self.params):
            e.copy_(distributed.like(tensors[name], p))

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The EMA in the trained tensors for the duration (an evaluation); the trained values come
        back exactly afterwards, also on error."""
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            for p, e in zip(self.params, self.tensors):
                p.copy_(e)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, k in zip(self.params, kept):
                    p.copy_(k)


def attach(model: nn.Module, ema: EMA | None) -> None:
    """Leave `ema` on `model` (train() does, at the end) for `finish` to save beside the adapter / model."""
    setattr(model, _ATTR, ema)


def of(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The EMA train() left on `model` by parameter name, as it is kept (sharded under FSDP), or None."""
    ema: EMA | None = getattr(model, _ATTR, None)
    return None if ema is None else ema.state_dict()


def whole(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The EMA train() left on `model`, as whole CPU tensors by parameter name (a collective under
    FSDP: every rank calls it), or None when the run kept none."""
    ema: EMA | None = getattr(model, _ATTR, None)
    if ema is None:
        return None
    return {n: distributed.full_tensor(t).contiguous().cpu() for n, t in ema.state_dict().items()}


@contextlib.contextmanager
def swapped_in(model: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """`tensors` (whole, by parameter name) copied into `model`'s parameters for the duration; the
    previous values come back afterwards. For saving the EMA with the model's own save functions.
    A name the model no longer has (a module taken off it before saving, e.g. distillation's
    feature projections) is left to whoever took it."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        kept = {n: params[n].detach().clone() for n in tensors if n in params}
        for n in kept:
            params[n].copy_(tensors[n])
    try:
        yield
    finally:
        with torch.no_grad():
            for n, t in kept.items():
                params[n].copy_(t)
