"""The order of batches: seeded, length-grouped, resumable exactly (`Batcher`)."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from minitrain.errors import UserError


class Batcher:
    """Deterministic batches of example indices, epoch after epoch, resumable exactly.

    The order of epoch `e` is a pure function of `(seed, e)`: indices are shuffled, then (with
    `group_by_length`) cut into mega-batches of `mega_batch` batches, each sorted by length and
    cut into batches, and the batch order is shuffled again — so batches hold similar lengths
    (little padding) while their order stays random. Iterating yields the remaining batches of
    the current epoch; the next iteration starts the next epoch. `state_dict()` records the
    epoch and how many batches were handed out, so a resumed run sees exactly the rest.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, *, seed: int, shuffle: bool = True,
                 group_by_length: bool = True, drop_last: bool = False, mega_batch: int = 50):
        if batch_size < 1:
            raise UserError(f"batch_size={batch_size}: must be >= 1")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.group_by_length = group_by_length
        self.drop_last = drop_last
        self.mega_batch = mega_batch
        if len(self) == 0:
            raise UserError(f"data: {len(self.lengths)} examples make no batch of {batch_size} with drop_last — "
                            f"lower batch_size or add data")
        self.epoch = 0
        self.position = 0  # batches of `epoch` already handed out

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, starts): epoch `epoch`'s example indices laid out batch after batch, and where each
        batch starts in `order`, in the order the batches are handed out (batch `j` is
        `order[starts[j] : starts[j] + batch_size]`). Two arrays, not a list per batch: 8 bytes an
        example, whatever the data's size."""
        n, bs = len(self.lengths), self.batch_size
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        if self.group_by_length:  # each mega-batch sorted longest first, stably: its batches hold similar lengths
            order = order[_sorted_within(-self.lengths[order], bs * self.mega_batch)]
        starts = np.arange(0, n, bs)  # mega-batches are whole batches, so batches are every bs positions
        if self.drop_last and n % bs:
            starts = starts[:-1]
        if self.group_by_length and self.shuffle:
            starts = starts[rng.permutation(len(starts))]
        return order, starts

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All batches of `epoch`, in order."""
        order, starts = self.epoch_layout(epoch)
        return [order[s : s + self.batch_size].tolist() for s in starts]

    def __iter__(self) -> Iterator[list[int]]:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        order, starts = self.epoch_layout(self.epoch)
        while self.position < len(starts):
            s = starts[self.position]
            self.position += 1
            yield order[s : s + self.batch_size].tolist()

    def _fingerprint(self) -> str:
        """Which data the order belongs to: count and a checksum of the lengths."""
        return f"{len(self.lengths)}:{int(np.sum(self.lengths * (np.arange(len(self.lengths)) % 9973 + 1)))}"

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position in the data order (the order itself follows from seed and epoch)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "batch_size": self.batch_size, "shuffle": self.shuffle,
                "group_by_length": self.group_by_length, "drop_last": self.drop_last,
                "mega_batch": self.mega_batch, "data": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` was taken; the data and order settings must be the same."""
        for k in ("seed", "batch_size", "shuffle", "group_by_length", "drop_last", "mega_batch"):
            if k in state and state[k] != getattr(self, k):
                raise UserError(f"resume: the data order was saved with {k}={state[k]}, this run has "
                                f"{k}={getattr(self, k)} — resume with the same settings")
        if "data" in state and state["data"] != self._fingerprint():
            raise UserError("resume: the training data changed since the checkpoint (example count or "
                            "lengths differ) — resume with the same data and tokenizer, or start a new run")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def _sorted_within(keys: np.ndarray, size: int) -> np.ndarray:
    """Positions that sort each consecutive block of `size` keys ascending, stably, blocks kept in
    place: `np.lexsort((keys, np.arange(n) // size))`, as one sort per row of a (blocks, size) view
    (2.6x faster at 10M examples: 0.75 s against 2.0 s)."""
    n = len(keys)
    full = n - n % size
    idx = np.empty(n, dtype=np.int64)
    if full:
        rows = np.argsort(keys[:full].reshape(-1, size), axis=1, kind="stable")
        idx[:full] = (rows + np.arange(0, full, size)[:, None]).reshape(-1)
    if full < n:
        idx[full:] = full + np.argsort(keys[full:], kind="stable")
    return idx
