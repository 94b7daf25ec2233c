"""What the training loop shows while it runs (trackers, where else its metrics go: `minitrain.trackers`).

`Progress`: on a terminal a tqdm bar; when stdout or stderr is not a terminal (a log file, nohup,
a cluster job) no bar frames, which would fill the log with carriage-return redraws, but one plain
line at every tenth of the run and at least every `every_s` seconds:

    progress: step 20/100 (20%) | loss 0.6512 | lr 1.80e-03 | 1,234 tok/s | 3s elapsed, ~12s left

`log(...)`: a line every run prints (print, flushed; under torchrun rank 0 alone).

`strict_json(row)`: one line of a run's JSON files (metrics.jsonl, eval.jsonl, completions.jsonl,
predictions): strict JSON, a NaN or an infinity written as null, so any JSON reader takes it.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Callable

from tqdm import tqdm

from minitrain.parallel import distributed


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


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def strict_json(row: Any, **kw: Any) -> str:
    """`json.dumps` of `row` as strict JSON: NaN and infinities (never valid JSON) become null."""
    return json.dumps(_finite(row), allow_nan=False, **kw)
