"""What the training loop shows while it runs, and where else its metrics go.

`Progress`: on a terminal a tqdm bar; when stdout or stderr is not a terminal (a log file, nohup,
a cluster job) no bar frames, which would fill the log with carriage-return redraws, but one plain
line at every tenth of the run and at least every `every_s` seconds:

    progress: step 20/100 (20%) | loss 0.6512 | lr 1.80e-03 | 1,234 tok/s | 3s elapsed, ~12s left

`log(...)`: a line every run prints (print, flushed; under torchrun rank 0 alone).

`TensorBoard`: `report_to=tensorboard` writes every metrics.jsonl row as scalars into
`out/tensorboard/` (the `tensorboard` extra: `pip install -e ".[tensorboard]"`), readable by
`tensorboard --logdir out/tensorboard`. metrics.jsonl stays the record; this is a second sink.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from minitrain import distributed
from minitrain.errors import UserError


def log(*args: Any, **kwargs: Any) -> None:
    """print, flushed; under torchrun only rank 0 prints."""
    if distributed.rank() == 0:
        print(*args, **kwargs, flush=True)


def interactive() -> bool:
    """Whether both stdout and stderr are terminals (tqdm draws on stderr; logs often take both)."""
    return all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr))


class Progress:
    """The loop's progress display from step `initial` to `total` (see the module doc)."""

    def __init__(self, total: int, initial: int, log: Callable[[str], None], *, enabled: bool = True,
                 tty: bool | None = None, every_s: float = 60.0):
        self.total, self.log, self.every_s = total, log, every_s
        tty = interactive() if tty is None else tty
        self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True) if enabled and tty else None
        self.lines = enabled and not tty
        self.marks = {math.ceil(total * k / 10) for k in range(1, 11)}  # every tenth of the run
        self.t0 = self.last = time.monotonic()
        self.initial = initial

    def update(self, step: int, row: dict[str, Any]) -> None:
        """After optimizer step `step` with its metrics `row` (loss, lr, tokens_per_s)."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_s']:.0f}")
            return
        now = time.monotonic()
        if not self.lines or (step not in self.marks and now - self.last < self.every_s):
            return
        self.last = now
        elapsed = now - self.t0
        done = step - self.initial
        left = elapsed / done * (self.total - step) if done else 0.0
        self.log(f"progress: step {step}/{self.total} ({100 * step / self.total:.0f}%) | loss {row['loss']:.4f} | "
                 f"lr {row['lr']:.2e} | {row['tokens_per_s']:,.0f} tok/s | {elapsed:.0f}s elapsed, ~{left:.0f}s left")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------- metric sinks

SINKS = ("none", "tensorboard")


def check_sink(report_to: str) -> None:
    """Refuse a sink whose package is missing, before anything loads."""
    if report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise UserError("report_to=tensorboard: the tensorboard package is not installed — "
                        "pip install -e \".[tensorboard]\", or report_to=none (metrics.jsonl is always written)")


class TensorBoard:
    """Scalars of each metrics row into `folder` (TensorBoard event files), from `start_step` on.

    On a resume, events after the checkpoint's step are purged (as metrics.jsonl is truncated),
    so the curves hold each step once."""

    def __init__(self, folder: Path, start_step: int):
        check_sink("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder), purge_step=start_step + 1 if start_step else None)

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


def open_sink(report_to: str, out: Path, start_step: int) -> TensorBoard | None:
    """The sink `report_to` names, writing under `out` (None for `none`)."""
    return TensorBoard(out / "tensorboard", start_step) if report_to == "tensorboard" else None
