"""The tensors of a checkpoint on disk: whole files, or one part per rank (FSDP), read back by rows.

A run whose trained tensors are FSDP2 shards (DTensors, `Shard(0)`: each rank holds a block of
rows, `torch.chunk`'s split, the last ranks fewer or none) saves each kind of tensors as one
part per rank, written by that rank alone (no gather):

    weights.rank<R>.safetensors  optimizer.rank<R>.safetensors  ema.rank<R>.safetensors

Each part holds that rank's rows under the tensor's name; its safetensors header's
`__metadata__` says where they go: `{"minitrain": "part", "rank": R, "parts": N, "rows":
"{name: [first row, *whole shape]}"}` (strings, JSON inside). A tensor that is not sharded that
way (a plain tensor, another DTensor layout) is written whole, by rank 0, at row 0. An empty
shard is not written. Other runs (one process, ddp) write `weights.safetensors` etc. whole.

`Tensors` reads either layout by rows (`safe_open(...).get_slice`), so a rank reads only the
rows it owns now, at whatever world size and mode the run resumes with; `restore` and `laid_out`
put them into a parameter (its shard) or a new optimizer state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minitrain.parallel import distributed
from minitrain.errors import UserError

STEMS = ("weights", "optimizer", "ema")


def whole_file(stem: str) -> str:
    return f"{stem}.safetensors"


def part_file(stem: str, rank: int) -> str:
    return f"{stem}.rank{rank}.safetensors"


def chunk_rows(n: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of chunk `index` when `n` rows are cut into `parts` as `torch.chunk` cuts
    them (FSDP2's and DTensor's `Shard(0)`): ceil(n / parts) each, the last ones fewer or none."""
    size = -(-n // parts) if n else 0
    return min(index * size, n), min((index + 1) * size, n)


def span(t: torch.Tensor) -> tuple[int, int] | None:
    """The rows [start, stop) of the whole tensor that this rank's shard of `t` holds, for a DTensor
    sharded on dim 0 over a 1-D mesh (FSDP2); None for any other tensor."""
    if not distributed.is_sharded(t) or t.dim() == 0:
        return None
    from torch.distributed.tensor import Shard

    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        return None
    start, stop = chunk_rows(t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank())
    return (start, stop) if t.to_local().shape[0] == stop - start else None


def local_part(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """This rank's part of `tensors` (by name): its rows of each sharded tensor, and, on rank 0, the
    whole of every other one; with `{name: [first row, *whole shape]}`. Every rank calls it with the
    same names in the same order (a tensor of another DTensor layout is gathered: a collective)."""
    part: dict[str, torch.Tensor] = {}
    rows: dict[str, list[int]] = {}
    for name, t in tensors.items():
        where = span(t)
        if where is not None:
            if where[1] > where[0]:
                part[name] = t.to_local().detach().contiguous().cpu()
                rows[name] = [where[0], *t.shape]
            continue
        whole = distributed.full_tensor(t.detach())  # (gathered on every rank: a collective)
        if distributed.rank() == 0:
            part[name] = whole.contiguous().cpu()
            rows[name] = [0, *whole.shape]
    return part, rows


def write_part(path: Path, part: dict[str, torch.Tensor], rows: dict[str, list[int]], rank: int, parts: int) -> None:
    save_file(part, path, metadata={"minitrain": "part", "rank": str(rank), "parts": str(parts),
                                    "rows": json.dumps(rows)})


class Tensors:
    """One kind of tensors (`stem`: weights, optimizer, ema) of the checkpoint in `folder`, read by rows
    from the whole file (`parts` None) or from the `parts` per-rank files. Files open on first use."""

    def __init__(self, folder: Path, stem: str, parts: int | None):
        self.folder, self.stem, self.parts = Path(folder), stem, parts
        self.files = [whole_file(stem)] if parts is None else [part_file(stem, r) for r in range(parts)]
        self._open: dict[str, Any] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}  # whole shapes by name
        self.pieces: dict[str, list[tuple[int, int, str]]] = {}  # name -> [(start, stop, file)]
        for f in self.files:
            handle = self._handle(f)
            if parts is None:
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    shape = tuple(handle.get_slice(name).get_shape())
                    self.shapes[name] = shape
                    self.pieces[name] = [(0, shape[0] if shape else 1, f)]
                continue
            try:
                rows = json.loads((handle.metadata() or {})["rows"])
            except (KeyError, ValueError):
                raise UserError(f"{self.folder / f}: not a checkpoint part (no rows in its header) — the checkpoint "
                                f"is damaged: restore it, or start again without resume=true (overwrite=true)") from None
            for name, (start, *shape) in rows.items():
                self.shapes[name] = tuple(shape)
                n = handle.get_slice(name).get_shape()
                self.pieces.setdefault(name, []).append((start, start + (n[0] if n else 1), f))

    def _handle(self, f: str) -> Any:
        if f not in self._open:
            self._open[f] = safe_open(str(self.folder / f), framework="pt")
        return self._open[f]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (the whole of a 0-d one), read from the files that hold them."""
        shape = self.shapes[name]
        if not shape:
            return self._handle(self.pieces[name][0][2]).get_tensor(name)
        got = []
        for a, b, f in sorted(self.pieces[name]):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                got.append(self._handle(f).get_slice(name)[lo - a : hi - a])
        if sum(g.shape[0] for g in got) != stop - start:
            raise UserError(f"{self.folder}: {self.stem} {name}: rows {start}..{stop} are not all in "
                            f"{', '.join(self.files)} — the checkpoint is damaged: restore it, or start again "
                            f"without resume=true (overwrite=true)")
        if not got:  # an empty shard: no rows to read
            return self._handle(self.pieces[name][0][2]).get_slice(name)[0:0]
        return got[0] if len(got) == 1 else torch.cat(got)

    def whole(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        return self.rows(name, 0, shape[0]) if shape else self.rows(name, 0, 1)


def restore(src: Tensors, name: str, target: torch.Tensor) -> None:
    """Copy tensor `name` into `target` in place: only its rows when `target` is a `Shard(0)` shard."""
    where = span(target)
    with torch.no_grad():
        if where is not None:
            target.to_local().copy_(src.rows(name, *where))
        else:
            target.copy_(distributed.like(src.whole(name), target))


def laid_out(src: Tensors, name: str, ref: torch.Tensor) -> torch.Tensor:
    """Tensor `name` laid out as `ref` (a DTensor of this rank's rows when `ref` is a `Shard(0)` shard;
    for an optimizer state that does not exist yet), read without the rows other ranks own."""
    where = span(ref) if src.shapes[name] == tuple(ref.shape) else None
    if where is None:
        t = src.whole(name)
        return distributed.like(t, ref) if tuple(t.shape) == tuple(ref.shape) else t
    from torch.distributed.tensor import DTensor

    local = src.rows(name, *where).to(ref.device)
    return DTensor.from_local(local, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                              stride=ref.stride())
