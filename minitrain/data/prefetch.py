"""The next micro-batch collated (its images decoded) in one background thread while this one trains.

A cache of one batch keyed by its example indices, so that correctness never depends on it: the loop
asks for the batch of `indices` (`get`); if the worker made exactly that one, it is used, else the batch
is collated now, in the loop's thread, as without the worker. What the worker collates is what the loop
would: the same `collate` on the same examples (no random draws in it), so a run logs the same losses,
bit for bit, with or without it.

A thread, not a process: Pillow's decoding and numpy's resizing release the GIL, a thread reads the
memory-mapped token store as it is, and nothing is pickled. An exception in the worker (a missing image:
one line naming the file and the data row) is raised by `get` when, and only if, the loop asks for that
batch; a batch never asked for is dropped silently. `close` leaves nothing running.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence


class Prefetch:
    """`collate` of the examples at `indices`, made ahead (`ahead`) in one worker thread, taken by `get`.

    `wait` sums the seconds `get` kept its caller waiting: blocked on the worker's batch, or collating it
    itself when the worker had not made that one."""

    def __init__(self, collate: Callable[[list[dict]], dict], examples: Sequence[dict]):
        self.collate, self.examples = collate, examples
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minitrain-prefetch")
        self.made: tuple[tuple[int, ...], Future] | None = None  # (indices, the worker's batch of them)
        self.wait = 0.0

    def _collate(self, indices: Sequence[int]) -> dict[str, Any]:
        return self.collate([self.examples[i] for i in indices])

    def ahead(self, indices: Sequence[int]) -> None:
        """Start collating the batch of `indices` in the worker; one not yet taken is dropped."""
        key = tuple(int(i) for i in indices)
        if self.made is not None:
            if self.made[0] == key:
                return
            self.made[1].cancel()  # (one already running finishes; its batch or error is ignored)
        self.made = (key, self.pool.submit(self._collate, key))

    def get(self, indices: Sequence[int]) -> dict[str, Any]:
        """The batch of `indices`: the worker's when it made exactly that one (its exception raised here), else
        collated now."""
        t0 = time.perf_counter()
        key = tuple(int(i) for i in indices)
        made, self.made = self.made, None
        try:
            if made is not None and made[0] == key:
                return made[1].result()
            if made is not None:
                made[1].cancel()
            return self._collate(key)
        finally:
            self.wait += time.perf_counter() - t0

    def close(self) -> None:
        """Drop what was made ahead and stop the worker (a batch in progress is finished first)."""
        if self.made is not None:
            self.made[1].cancel()
            self.made = None
        self.pool.shutdown(wait=True, cancel_futures=True)
