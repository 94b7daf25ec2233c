"""The token store: a split's examples as flat arrays on disk, read through a memory map.

A store is a folder:

    header.json        what made it (`fingerprint`), the example count, the keys, each file's size and
                       SHA-256 (`sums`, written at build), the readers' counts (truncated, skipped, ...)
                       and a checksum of the header itself
    <key>.ids          int32, every example's `<key>` list one after the other (ids, labels: -100 kept)
    <key>.off          int64, n + 1 offsets into `<key>.ids`
    <key>.val          int64, one number per example (KTO's `label`, `prompt_len`; a float, a reward
                       model's `margin`, as its float64 bits)
    <key>.txt          utf-8, every example's `<key>` text one after the other (`TEXTS`: image rows' paths,
                       joined by NUL, and their data row), with its n + 1 offsets in `<key>.off`
    image_files.txt    the image files the rows name (NUL-joined), and in `image_files.stat` (int64) the size
                       and modification time of each when the build read it: `stale_images` compares them

`TokenStore(folder)` is a read-only sequence of example dicts: `store[i]` builds example `i`'s lists
(and texts) from the mapped arrays, so nothing is held per example but what the memory map pages in; `lengths`
/ `batch_lengths` are numpy arrays of the offsets' differences, `column(key)` a per-example number;
`list_max` / `target_counts` per-example figures read from the arrays in blocks. `store.take(indices)` is a view
(`eval_split`, a mixture's weights) holding only the index array.

`open_or_build(...)` finds the store of a fingerprint in the cache folder or builds it: a lock file
makes one process build while the others wait; the build writes into a temporary folder beside the
store, fsyncs, and renames it into place, so a kill or a second run never leaves a half store that
is later read. A store whose header checksum or file sizes do not match is rebuilt, with a note; so
is one whose arrays do not match their checksums (`TokenStore.verify`: a byte flipped on disk), which
a run checks when it opens a store of at most `VERIFY_BYTES`, and always on `resume=true`
(`minitrain cache verify` checks every store of a cache folder), and one whose rows name an image file
that changed since the build (`stale_images`: an image's size sets its token count).
The build itself (workers over row chunks, merged in order) is `minitrain.data.store_build`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

VERSION = 2  # 2: a SHA-256 per array (`sums`)
VERIFY_BYTES = 2 << 30  # a run checks the arrays of a store up to this size at open (about 1 s)
HEADER = "header.json"
ID_DTYPE = np.int32
COUNTS = ("truncated", "skipped", "bos_in_text", "identical")
BLOCK = 1 << 16  # examples per block when a method reads a whole array (list_max, target_counts)
# the text columns of image rows (a vision-language checkpoint's), key -> "list" (strings joined by NUL) or "str":
# the image paths, the videos (SFT's: each the JSON text of its frame paths and fps, `VideoRows.entry`), and the
# data row (`where`) that names a file that cannot be read when a batch decodes it. The readers write them only
# beside images or videos: an example without them is stored empty and read back without the keys
TEXTS = {"images": "list", "videos": "list", "where": "str"}
IMAGE_FILES = "image_files"  # <IMAGE_FILES>.txt / .stat: the image files of the rows, as the build read them


class Damaged(Exception):
    """A store folder that does not read back as written (the message says what differs)."""


class Stale(Damaged):
    """A store whose rows name an image file that changed since the build (rebuilt like a damaged one)."""


def header_checksum(header: dict[str, Any]) -> str:
    body = {k: v for k, v in header.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def file_sum(path: Path) -> str:
    """The SHA-256 of a file's bytes (an array of the store), read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class TokenStore(Sequence):
    """A built store, read through memory maps (see the module doc)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        try:
            header = json.loads((self.folder / HEADER).read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise Damaged(f"{HEADER} unreadable ({e.__class__.__name__})") from None
        if not isinstance(header, dict) or header.get("checksum") != header_checksum(header):
            raise Damaged(f"{HEADER} checksum does not match its content")
        if header.get("version") != VERSION:
            raise Damaged(f"store version {header.get('version')}, this minitrain reads {VERSION}")
        for name, size in header["files"].items():
            path = self.folder / name
            if not path.is_file() or path.stat().st_size != size:
                got = path.stat().st_size if path.is_file() else "missing"
                raise Damaged(f"{name}: {got} bytes, the header says {size}")
        self.header = header
        self.array_bytes = sum(header["files"].values())
        self.n = int(header["n"])
        self.path = header["path"]
        for k in COUNTS:
            setattr(self, k, int(header["counts"].get(k, 0)))
        self.shapes = header.get("shapes")  # SFT: rows per shape, for the run's log
        self.lists = list(header["lists"])  # keys holding token lists, in the example's key order
        self.values = dict(header["values"])  # key -> "bool" | "int" | "float"
        self._ids = {k: _map(self.folder / f"{k}.ids", ID_DTYPE) for k in self.lists}
        self._off = {k: _map(self.folder / f"{k}.off", np.int64) for k in self.lists}
        self._val = {k: _map(self.folder / f"{k}.val", np.float64 if kind == "float" else np.int64)
                     for k, kind in self.values.items()}
        self.texts = dict(header.get("texts") or {})  # key -> "list" | "str" (`TEXTS`)
        self._txt = {k: _map(self.folder / f"{k}.txt", np.uint8) for k in self.texts}
        self._toff = {k: _map(self.folder / f"{k}.off", np.int64) for k in self.texts}
        self.order = list(header["order"])  # the example dict's keys in the readers' order
        self.extra: dict[str, np.ndarray] = {}  # per-example floats added after the build (`set_values`)

    def __len__(self) -> int:
        return self.n

    def verify(self) -> None:
        """Raise `Damaged` when an array's bytes differ from the SHA-256 its build wrote (a byte flipped
        on disk keeps the size, so only this finds it). Reads every array once: about 1 s per 2 GiB."""
        for name, want in self.header["sums"].items():
            if file_sum(self.folder / name) != want:
                raise Damaged(f"{name}: its bytes do not match the checksum written at build")

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        i = int(i)
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        ex: dict[str, Any] = {}
        for k in self.order:
            if k in self._ids:
                off = self._off[k]
                ex[k] = self._ids[k][off[i]:off[i + 1]].tolist()
            else:
                v = self._val[k][i].item()
                ex[k] = bool(v) if self.values[k] == "bool" else v
        for k, kind in self.texts.items():  # after the lists and numbers, as the readers add them
            off = self._toff[k]
            if off[i + 1] > off[i]:  # empty: the example has no such key
                text = self._txt[k][off[i]:off[i + 1]].tobytes().decode("utf-8", "surrogateescape")
                ex[k] = text.split("\0") if kind == "list" else text
        return _with_extra(ex, self.extra, i)

    def carries(self, key: str) -> np.ndarray:
        """Per example, whether it has the text `key` (`images`: a row with images), from the offsets alone."""
        if key not in self.texts:
            return np.zeros(self.n, dtype=bool)
        return np.diff(self._toff[key]) > 0

    def stale_images(self) -> str | None:
        """What changed since the build among the image files the rows name (None: nothing): a file missing, or
        its size or modification time not those the build read (an image's size sets its token count). One
        `stat` per file."""
        for name, (size, mtime) in read_image_files(self.folder).items():
            try:
                st = os.stat(name)
            except OSError:
                return f"image {name} is gone"
            if (st.st_size, st.st_mtime_ns) != (size, mtime):
                return f"image {name} changed since the build"
        return None

    def __iter__(self) -> Iterator[dict]:
        for i in range(self.n):
            yield self[i]

    def list_lengths(self, key: str) -> np.ndarray:
        return np.diff(self._off[key])

    def column(self, key: str) -> np.ndarray:
        """A per-example number (KTO's `label`, `prompt_len`) of every example, read from the mapped
        array without building an example."""
        return np.asarray(self._val[key])

    def list_max(self, key: str) -> np.ndarray:
        """Per example: the largest entry of its `key` list (-1 when empty), from the mapped array in
        blocks of examples (distillation's check that the teacher knows every id)."""
        off, ids, out = self._off[key], self._ids[key], np.full(self.n, -1, dtype=np.int64)
        for a in range(0, self.n, BLOCK):
            b = min(a + BLOCK, self.n)
            starts, full = off[a:b] - off[a], off[a + 1 : b + 1] > off[a:b]
            if full.any():
                out[a:b][full] = np.maximum.reduceat(np.asarray(ids[off[a] : off[b]]), starts[full])
        return out

    def target_counts(self, key: str = "labels") -> np.ndarray:
        """Per example: entries of its `key` list after the first that are not -100 (the targets a
        causal loss counts: ARD's dataset size), from the mapped array in blocks of examples."""
        off, ids, out = self._off[key], self._ids[key], np.zeros(self.n, dtype=np.int64)
        for a in range(0, self.n, BLOCK):
            b = min(a + BLOCK, self.n)
            kept = np.concatenate([[0], np.cumsum(np.asarray(ids[off[a] : off[b]]) != -100)])
            ends = off[a + 1 : b + 1] - off[a]
            out[a:b] = kept[ends] - kept[np.minimum(off[a:b] - off[a] + 1, ends)]
        return out

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """Tokens per example, all its id lists (as `Examples.lengths`)."""
        return sum((self.list_lengths(k) for k in self.lists if k.endswith("ids")), np.zeros(self.n, np.int64))

    @functools.cached_property
    def batch_lengths(self) -> np.ndarray:
        """Tokens per example for length grouping (the loop's `_length`): `input_ids`, else all id lists."""
        return self.list_lengths("input_ids") if "input_ids" in self.lists else self.lengths

    def take(self, indices: Sequence[int] | np.ndarray, path: str | None = None) -> StoreView:
        return StoreView(self, np.asarray(indices, dtype=np.int64), path=path)

    def set_values(self, columns: dict[str, Sequence[float]]) -> None:
        """Give every example a float under each key (DPO's precomputed reference log-probs), held
        in memory as one array per key: what the in-memory path writes into each example dict."""
        self.extra.update(_columns(columns, len(self)))


class StoreView(Sequence):
    """Some examples of a store, by index (held out, or a mixture's weights); reads as the store does."""

    def __init__(self, store: TokenStore, indices: np.ndarray, path: str | None = None, **counts: int):
        self.store, self.indices = store, indices
        self.path = store.path if path is None else path
        for k in COUNTS:
            setattr(self, k, counts.get(k, 0))
        self.shapes = store.shapes  # the file's rows per shape (as `hold_out` keeps them in memory)
        self.extra: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        return _with_extra(self.store[self.indices[i]], self.extra, i if i >= 0 else i + len(self))

    def __iter__(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self[i]

    def set_values(self, columns: dict[str, Sequence[float]]) -> None:
        """As `TokenStore.set_values`, for this view's examples only."""
        self.extra.update(_columns(columns, len(self)))

    @property
    def lists(self) -> list[str]:
        return self.store.lists

    @property
    def lengths(self) -> np.ndarray:
        return self.store.lengths[self.indices]

    @property
    def batch_lengths(self) -> np.ndarray:
        return self.store.batch_lengths[self.indices]

    def column(self, key: str) -> np.ndarray:
        return self.store.column(key)[self.indices]

    def carries(self, key: str) -> np.ndarray:
        return self.store.carries(key)[self.indices]

    def list_max(self, key: str) -> np.ndarray:
        return self.store.list_max(key)[self.indices]

    def target_counts(self, key: str = "labels") -> np.ndarray:
        return self.store.target_counts(key)[self.indices]

    def take(self, indices, path: str | None = None) -> StoreView:
        return StoreView(self.store, self.indices[np.asarray(indices, dtype=np.int64)], path=path)


def carries(examples: Sequence[dict], key: str = "images") -> np.ndarray:
    """Per example, whether it has `key` (`images`: a row with images): a store's from its offsets (no example
    built), else from the examples' dicts."""
    got = getattr(examples, "carries", None)
    if got is not None:
        return got(key)
    return np.array([bool(ex.get(key)) for ex in examples], dtype=bool)


def write_image_files(folder: Path, files: dict[str, tuple[int, int]]) -> None:
    """`image_files.txt` (the paths, NUL-joined, in name order) and `image_files.stat` (int64: size, mtime_ns
    each) in `folder`; nothing when there are none."""
    if not files:
        return
    names = sorted(files)
    (folder / f"{IMAGE_FILES}.txt").write_bytes("\0".join(names).encode("utf-8", "surrogateescape"))
    np.asarray([files[n] for n in names], dtype=np.int64).reshape(-1, 2).tofile(folder / f"{IMAGE_FILES}.stat")


def read_image_files(folder: Path) -> dict[str, tuple[int, int]]:
    """What `write_image_files` wrote in `folder`: path -> (size, mtime_ns) ({} when there are none)."""
    if not (folder / f"{IMAGE_FILES}.txt").is_file():
        return {}
    names = (folder / f"{IMAGE_FILES}.txt").read_bytes().decode("utf-8", "surrogateescape").split("\0")
    stats = np.fromfile(folder / f"{IMAGE_FILES}.stat", dtype=np.int64).reshape(-1, 2).tolist()
    return {n: tuple(st) for n, st in zip(names, stats)}


def _columns(columns: dict[str, Sequence[float]], n: int) -> dict[str, np.ndarray]:
    out = {k: np.asarray(v, dtype=np.float64) for k, v in columns.items()}
    if any(v.shape != (n,) for v in out.values()):
        raise ValueError(f"set_values: every column needs {n} values")
    return out


def _with_extra(ex: dict[str, Any], extra: dict[str, np.ndarray], i: int) -> dict[str, Any]:
    for k, v in extra.items():
        ex[k] = float(v[i])
    return ex


def _map(path: Path, dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # mmap of an empty file fails
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def fsync_folder(folder: Path) -> None:
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
