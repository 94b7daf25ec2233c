"""Building the token store (`minitrain.data.store`): once, in parallel, atomically, with a lock.

`open_or_build(cache, sources, read, tok, options, workers)` returns the store of this fingerprint
from `cache`, building it when it is missing or damaged.

The fingerprint is everything that made the examples: each data file (resolved path, size, mtime and
a hash of its first and last MiB), the tokenizer (its files, special ids, bos rule, chat format,
templates and `chat_template_kwargs`), the reader and its options (`fields`, `max_len`, truncation,
..., and for a vision-language checkpoint how it reads images: `ImageRows`, its processor spec), the
source weights, and the source code of the readers, the image rows and the text package (a change in
how rows become ids rebuilds). The image files the rows name are only known once the rows are read:
each worker records every image file's size and mtime as it reads its row (`image_files.*` in the
store), and a run that opens the store compares them (`TokenStore.stale_images`), rebuilding on a change.

The build: rows are cut into chunks of `CHUNK` rows; worker `w` of `K` reads every row but parses and
tokenizes only chunks `c` with `c % K == w` (`files.Pick`), through the reader itself (`into=`: a
writer of flat arrays), so ids and labels are those of the in-memory path and a bad row is named
by `file:line` by whichever worker took it (the first in file order is reported). The parts are then
merged chunk by chunk in row order. Workers are forked (`data_workers=1`: in this process). A
progress line (rows, rows/s, ETA when the row count can be known cheaply) is logged every few
seconds. Everything is written into `.tmp-*` beside the store, fsynced and renamed: a kill, a full
disk or an error leaves nothing that is later read (and a full disk removes what it wrote).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from minitrain.data import store_cache
from minitrain.data.files import Pick, read_rows
from minitrain.data.store import (
    COUNTS,
    HEADER,
    ID_DTYPE,
    TEXTS,
    VERIFY_BYTES,
    VERSION,
    Damaged,
    Stale,
    TokenStore,
    file_sum,
    fsync_folder,
    header_checksum,
    read_image_files,
    write_image_files,
)
from minitrain.data.videos import VideoRows
from minitrain.errors import UserError
from minitrain.progress import log

CHUNK = 1024  # rows per chunk handed to one worker
FLUSH = 1 << 20  # buffered tokens per key before a write
SAMPLE = 1 << 20  # bytes hashed at each end of a data file
PROGRESS_EVERY = 5.0  # seconds between progress lines
CODE = ("data/files.py", "data/rows.py", "data/readers.py", "data/images.py", "data/videos.py", "data/store.py",
        "data/store_build.py",
        "text/tokenizer.py", "text/backends.py", "text/chat_template.py", "text/chat_formats.py")


def default_cache() -> Path:
    """`$XDG_CACHE_HOME/minitrain/data`, else `~/.cache/minitrain/data`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "minitrain" / "data"


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


# --------------------------------------------------------------------------- fingerprint


def _files_under(p: Path) -> list[Path]:
    return sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]


def file_fingerprint(f: Path) -> dict[str, Any]:
    if not f.exists():  # said by the reader, with its own message, when the build reads it
        return {"file": str(f), "missing": True}
    st = f.stat()
    h = hashlib.blake2b(digest_size=16)
    with open(f, "rb") as fh:
        h.update(fh.read(SAMPLE))
        if st.st_size > 2 * SAMPLE:
            fh.seek(st.st_size - SAMPLE)
        h.update(fh.read(SAMPLE))
    return {"file": str(f.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sample": h.hexdigest()}


def tokenizer_fingerprint(tok: Any) -> dict[str, Any]:
    h = hashlib.blake2b(digest_size=16)
    folder = Path(getattr(tok, "source", ""))
    if folder.is_dir():
        for f in sorted(folder.iterdir()):
            if f.is_file() and ("token" in f.name or "chat_template" in f.name or f.suffix == ".model"
                                or f.name == "special_tokens_map.json"):
                h.update(f.name.encode() + b"\0" + f.read_bytes())
    return {"files": h.hexdigest(), "bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id, "add_bos": tok.add_bos,
            "vocab": tok.vocab_size, "chat_format": tok.chat_format, "templates": tok.chat_templates,
            "template_kwargs": tok.chat_template_kwargs}


def code_fingerprint() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.blake2b(digest_size=16)
    for name in CODE:
        h.update(name.encode() + b"\0" + (root / name).read_bytes())
    return h.hexdigest()


def described(value: Any) -> Any:
    """A reader option as plain JSON values: a dataclass (`ImageRows` and its processor spec: the image token,
    the placeholder text, patch and merge sizes, min / max pixels, mean and std, ...) as its class and fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"class": type(value).__name__,
                **{f.name: described(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, (list, tuple)):
        return [described(v) for v in value]
    return value


def fingerprint(sources: list[str], kind: str, tok: Any, options: dict[str, Any],
                weights: list[float] | None = None) -> dict[str, Any]:
    try:
        files = [[file_fingerprint(f) for f in _files_under(Path(s))] for s in sources]
    except OSError as e:
        raise UserError(f"{e.filename}: cannot read ({e.strerror or e}) — check the data path") from None
    return {"version": VERSION, "kind": kind, "sources": list(sources), "files": files, "weights": weights,
            "options": {k: described(v) for k, v in options.items()}, "tokenizer": tokenizer_fingerprint(tok),
            "code": code_fingerprint()}


def store_name(sources: list[str], kind: str, fp: dict[str, Any]) -> str:
    key = hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:16]
    stem = Path(sources[0].rstrip("/")).stem or "data"
    return f"{stem}{'+' if len(sources) > 1 else ''}-{kind}-{key}"


# --------------------------------------------------------------------------- the writer a reader fills


class PartWriter:
    """What a reader appends examples to (`into=`): flat arrays in `folder`, plus the readers'
    counts, examples per chunk (for the merge) and per source. `texts`: the text columns to keep
    (`store.TEXTS`, image rows), and then each image file's size and mtime as its row was read."""

    def __init__(self, folder: Path, pick: Pick, texts: dict[str, str] | None = None):
        self.folder, self.pick = folder, pick
        self.texts = dict(texts or {})
        self.image_files: dict[str, tuple[int, int]] = {}  # path -> (size, mtime_ns) when its row was read
        folder.mkdir(parents=True)
        for k in COUNTS:
            setattr(self, k, 0)
        self.shapes: dict[str, int] | None = None  # SFT: rows per shape (`read_sft` fills it)
        self.order: list[str] | None = None
        self.values: dict[str, str] = {}
        self.n = 0
        self.per_chunk: dict[int, int] = {}
        self.per_source: dict[int, int] = {}
        self.source = 0
        self._buf: dict[str, list[int]] = {}
        self._files: dict[str, Any] = {}
        self._pending = 0

    def append(self, ex: dict[str, Any]) -> None:
        if self.order is None:
            self.order = [k for k in ex if k not in self.texts]
            self.values = {k: "bool" if isinstance(v, bool) else "float" if isinstance(v, float) else "int"
                           for k, v in ex.items() if k in self.order and not isinstance(v, list)}
            for k in self.order:
                if k in self.values:
                    self._open(f"{k}.val")
                else:
                    self._open(f"{k}.ids"), self._open(f"{k}.len")
            for k in self.texts:
                self._open(f"{k}.txt"), self._open(f"{k}.len")
        for k in self.order:
            v = ex[k]
            if k in self.values:
                # a float (a reward model's margin) keeps its 64 bits in the int64 array
                self._buf.setdefault(f"{k}.val", []).append(
                    int(np.float64(v).view(np.int64)) if self.values[k] == "float" else int(v))
            else:
                self._buf.setdefault(f"{k}.ids", []).extend(v)
                self._buf.setdefault(f"{k}.len", []).append(len(v))
                self._pending += len(v)
        for k, kind in self.texts.items():  # absent: stored empty (the store reads it back absent)
            v = ex.get(k)
            data = (("\0".join(v) if kind == "list" else v) if v else "").encode("utf-8", "surrogateescape")
            self._buf.setdefault(f"{k}.txt", bytearray()).extend(data)
            self._buf.setdefault(f"{k}.len", []).append(len(data))
            self._pending += len(data)
        for path in ex.get("images", ()) if "images" in self.texts else ():
            if path not in self.image_files:  # just read by the reader (its header: the token count)
                self.image_files[path] = _stat(path)
        for entry in ex.get("videos", ()) if "videos" in self.texts else ():  # the frames' files: their count and size
            files = VideoRows.files(entry)[0]
            for path in map(str, [files] if isinstance(files, Path) else files):
                if path not in self.image_files:
                    self.image_files[path] = _stat(path)
        self.n += 1
        chunk = (self.pick.i - 1) // CHUNK
        self.per_chunk[chunk] = self.per_chunk.get(chunk, 0) + 1
        self.per_source[self.source] = self.per_source.get(self.source, 0) + 1
        if self._pending >= FLUSH:
            self.flush()

    def _open(self, name: str) -> None:
        self._files[name] = open(self.folder / name, "wb")  # noqa: SIM115 -- open while rows arrive; close()

    def flush(self) -> None:
        for name, buf in self._buf.items():
            if buf:
                if name.endswith(".txt"):
                    self._files[name].write(buf)
                else:
                    dtype = ID_DTYPE if name.endswith(".ids") else np.int64
                    self._files[name].write(np.asarray(buf, dtype=dtype).tobytes())
                buf.clear()
        self._pending = 0

    def close(self) -> dict[str, Any]:
        self.flush()
        for f in self._files.values():
            f.close()
        write_image_files(self.folder, self.image_files)
        return {"n": self.n, "order": self.order, "values": self.values, "texts": self.texts,
                "per_chunk": self.per_chunk,
                "per_source": self.per_source, "counts": {k: getattr(self, k) for k in COUNTS}, "shapes": self.shapes}


def _stat(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:  # gone already: the next open finds it gone and rebuilds (the reader then names it)
        return -1, -1
    return st.st_size, st.st_mtime_ns


def _rows(sources: list[str], split: str | None, pick: Pick, writer: PartWriter,
          tick: Callable[[int], None]) -> Iterator[tuple[str, dict]]:
    """Every source's rows in order, through one `Pick`; tells `writer` which source a row is from."""
    done = 0  # rows of this worker's share already counted by `tick`
    for s, src in enumerate(sources):
        writer.source = s
        for item in read_rows(src, split, pick):
            yield item
            if pick.taken - done >= CHUNK:
                tick(pick.taken - done)
                done = pick.taken
    tick(pick.taken - done)


def _part(w: int, k: int, folder: Path, sources: list[str], split: str | None, read: Callable, tok: Any,
          options: dict[str, Any], tick: Callable[[int], None]) -> dict[str, Any]:
    """Worker `w` of `k`: its chunks of rows into `folder` (see the module doc)."""
    pick = Pick(lambda i: (i // CHUNK) % k == w)
    # a vision-language checkpoint's reader (`images=`: how it reads them) makes image rows: their texts kept too
    writer = PartWriter(folder, pick, TEXTS if options.get("images") is not None else None)
    try:
        read(sources[0], tok, rows=_rows(sources, split, pick, writer, tick), into=writer, **options)
    except UserError as e:
        writer.close()
        return {"error": e.message, "chunk": (pick.i - 1) // CHUNK}
    out = writer.close()
    out["rows"] = pick.i
    return out


def _worker(w: int, k: int, folder: Path, args: tuple, done: Any, results: Any) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    def tick(n: int) -> None:
        with done.get_lock():
            done.value += n

    try:
        results.put((w, _part(w, k, folder, *args, tick=tick)))
    except OSError as e:
        results.put((w, {"oserror": e.errno, "reason": e.strerror or str(e)}))
    except Exception as e:  # noqa: BLE001 -- a bug of ours: the main process raises it
        results.put((w, {"crash": f"{type(e).__name__}: {e}"}))


# --------------------------------------------------------------------------- build


def expected_rows(sources: list[str]) -> int | None:
    """The row count when it is cheap to know (JSON lines: non-blank lines; Parquet: its metadata)."""
    try:
        return _count_rows(sources)
    except OSError:
        return None


def _count_rows(sources: list[str]) -> int | None:
    total = 0
    for s in sources:
        for f in _files_under(Path(s)):
            with open(f, "rb") as fh:
                head = fh.read(4)
                if head == b"PAR1":
                    try:
                        import pyarrow.parquet as pq
                        total += pq.ParquetFile(f).metadata.num_rows
                        continue
                    except Exception:  # noqa: BLE001 -- no count: no ETA
                        return None
                if head.lstrip()[:1] != b"{":
                    return None
                fh.seek(0)
                total += sum(block.count(b"\n") for block in iter(lambda: fh.read(1 << 24), b""))
    return total or None


class Progress:
    def __init__(self, what: str, expected: int | None):
        self.what, self.expected, self.t0 = what, expected, time.perf_counter()
        self.last, self.rows = self.t0, 0

    def __call__(self, n: int, force: bool = False) -> None:
        self.rows += n
        now = time.perf_counter()
        if now - self.last < PROGRESS_EVERY and not force:
            return
        self.last = now
        rate = self.rows / max(now - self.t0, 1e-9)
        eta = ""
        if self.expected and rate > 0:
            eta = f", ETA {max(0.0, (self.expected - self.rows) / rate):.0f} s"
        log(f"data: building the token store of {self.what}: {self.rows:,} rows ({rate:,.0f} rows/s{eta})")


def build(tmp: Path, sources: list[str], split: str | None, read: Callable, tok: Any, options: dict[str, Any],
          workers: int, fp: dict[str, Any]) -> None:
    """Write the store of `sources` into the new folder `tmp` (see the module doc)."""
    tmp.mkdir(parents=True)
    progress = Progress(",".join(sources), expected_rows(sources))
    args = (sources, split, read, tok, options)
    if workers == 1:
        try:
            parts = [_part(0, 1, tmp / "part-0", *args, tick=progress)]
        except OSError as e:
            parts = [{"oserror": e.errno, "reason": e.strerror or str(e)}]
    else:
        parts = _run_workers(tmp, workers, args, progress)
    for p in parts:
        if "oserror" in p:
            raise OSError(p["oserror"], p["reason"])
        if "crash" in p:
            raise RuntimeError(f"token store worker failed: {p['crash']}")
    errors = sorted((p["chunk"], p["error"]) for p in parts if "error" in p)
    if errors:
        raise UserError(errors[0][1])
    progress(0, force=True) if progress.rows >= CHUNK else None
    _merge(tmp, parts, sources, fp)


def _run_workers(tmp: Path, k: int, args: tuple, progress: Progress) -> list[dict[str, Any]]:
    ctx = mp.get_context("fork")
    done, results = ctx.Value("q", 0), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(w, k, tmp / f"part-{w}", args, done, results), daemon=True)
             for w in range(k)]
    for p in procs:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    reported = 0
    try:
        while len(got) < k:
            try:
                w, res = results.get(timeout=0.5)
                got[w] = res
            except queue.Empty:
                dead = [p for w, p in enumerate(procs) if w not in got and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"token store worker died (exit code {dead[0].exitcode})") from None
            with done.get_lock():
                now = done.value
            progress(now - reported)
            reported = now
    finally:
        for p in procs:
            if p.is_alive() and len(got) < k:
                p.terminate()
            p.join()
    return [got[w] for w in range(k)]


def _merge(tmp: Path, parts: list[dict[str, Any]], sources: list[str], fp: dict[str, Any]) -> None:
    """The parts' examples in row order (chunk `c` is part `c % K`'s) as the store's files in `tmp`."""
    k = len(parts)
    first = next((p for p in parts if p["order"] is not None), None)
    order = first["order"] if first else []
    values = first["values"] if first else {}
    lists = [key for key in order if key not in values]
    texts = parts[0]["texts"]  # (every part's)
    n = sum(p["n"] for p in parts)
    # the examples of each chunk, in row order: (part, start, count)
    cursor = [0] * k
    pieces = []
    for c in range(max((max(p["per_chunk"], default=-1) for p in parts), default=-1) + 1):
        w = c % k
        cnt = parts[w]["per_chunk"].get(c, 0)
        if cnt:
            pieces.append((w, cursor[w], cnt))
            cursor[w] += cnt
    # the ragged columns: token-id lists (int32 `.ids`) and texts (utf-8 `.txt`), each with its offsets
    for key, suffix, dtype in [(key, "ids", ID_DTYPE) for key in lists] + [(key, "txt", np.uint8) for key in texts]:
        lens = [_read(tmp / f"part-{w}" / f"{key}.len", np.int64) for w in range(k)]
        starts = [np.concatenate([[0], np.cumsum(x)]) for x in lens]
        # each part's ids are copied piece by piece as bytes (read, not mapped: a 10M-row merge would
        # otherwise count every page it copied in the process's RSS)
        paths = [tmp / f"part-{w}" / f"{key}.{suffix}" for w in range(k)]
        ids = [open(p, "rb") if p.exists() else None for p in paths]  # noqa: SIM115 -- closed below (a part
        # without examples wrote no file and gives no piece)
        width = np.dtype(dtype).itemsize
        off = np.zeros(n + 1, dtype=np.int64)
        at = 0
        try:
            with open(tmp / f"{key}.{suffix}", "wb") as out:
                for w, s, cnt in pieces:
                    a, b = starts[w][s], starts[w][s + cnt]
                    ids[w].seek(int(a) * width)
                    out.write(ids[w].read(int(b - a) * width))
                    off[at + 1 : at + cnt + 1] = off[at] + (starts[w][s + 1 : s + cnt + 1] - a)
                    at += cnt
        finally:
            for f in ids:
                if f is not None:
                    f.close()
        off.tofile(tmp / f"{key}.off")
    for key in values:
        vals = [_read(tmp / f"part-{w}" / f"{key}.val", np.int64) for w in range(k)]
        np.concatenate([vals[w][s : s + cnt] for w, s, cnt in pieces] or [np.zeros(0, np.int64)]).tofile(
            tmp / f"{key}.val")
    image_files: dict[str, tuple[int, int]] = {}
    for w in range(k):
        for name, st in read_image_files(tmp / f"part-{w}").items():
            # two workers that read one file at two sizes (edited mid-build): out of date at the next open
            image_files[name] = st if image_files.get(name, st) == st else (-1, -1)
    write_image_files(tmp, image_files)
    for w in range(k):
        shutil.rmtree(tmp / f"part-{w}")
    per_source = [sum(p["per_source"].get(s, 0) for p in parts) for s in range(len(sources))]
    counts = {c: sum(p["counts"][c] for p in parts) for c in COUNTS}
    shapes = None
    for p in parts:
        for k, v in (p.get("shapes") or {}).items():
            shapes = shapes or {}
            shapes[k] = shapes.get(k, 0) + v
    files = {f.name: f.stat().st_size for f in tmp.iterdir()}
    sums = {name: file_sum(tmp / name) for name in files}
    header = {"version": VERSION, "n": n, "path": ",".join(sources), "lists": lists, "values": values, "order": order,
              "texts": texts,
              "files": files, "sums": sums, "counts": counts, "shapes": shapes, "per_source": per_source, "fingerprint": fp}
    header["checksum"] = header_checksum(header)
    (tmp / HEADER).write_text(json.dumps(header, indent=1, default=str), encoding="utf-8")
    fsync_folder(tmp)


def _read(path: Path, dtype) -> np.ndarray:
    if not path.exists() or path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.fromfile(path, dtype=dtype)


# --------------------------------------------------------------------------- open or build


def open_or_build(cache: str | Path, sources: list[str], kind: str, read: Callable, tok: Any,
                  options: dict[str, Any], *, split: str | None = None, workers: int = 0,
                  weights: list[float] | None = None, keep_days: float = 0, verify: bool = False) -> TokenStore:
    """The token store of these sources and settings, from `cache` or built into it (module doc).
    A store found in the cache has its arrays checked against their checksums when `verify` is true or
    they hold at most `VERIFY_BYTES` (a larger one unchecked is said in a note). Opening it records its
    use; after a build, the stores of `cache` unused for `keep_days` days are removed
    (`minitrain.data.store_cache`; 0: none)."""
    cache = Path(cache)
    fp = fingerprint(sources, kind, tok, {**options, "split": split}, weights)
    folder = cache / store_name(sources, kind, fp)
    try:
        return _opened(folder, verify)
    except (Damaged, FileNotFoundError):
        pass
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / f".{folder.name}.lock", "a+")  # noqa: SIM115 -- held by the with block below
    except OSError as e:
        raise UserError(f"data_cache={cache}: cannot write there ({e.strerror or e}) — pass data_cache=<a writable "
                        f"folder>, or data_cache=false to keep the examples in memory") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"data: another process is building {folder}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if folder.exists():
            try:
                return _opened(folder, verify)
            except Damaged as e:
                log(f"note: data_cache: {folder}: {'out of date' if isinstance(e, Stale) else 'damaged'} ({e}) — "
                    f"rebuilding it")
                shutil.rmtree(folder, ignore_errors=True)
        for stale in cache.glob(f".tmp-{folder.name}-*"):  # a build killed before its rename: ours to remove now
            shutil.rmtree(stale, ignore_errors=True)
        tmp = cache / f".tmp-{folder.name}-{os.getpid()}"
        t0 = time.perf_counter()
        workers = workers or usable_cores()
        try:
            build(tmp, sources, split, read, tok, options, workers, fp)
            os.rename(tmp, folder)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UserError(f"data_cache={cache}: disk full while building the token store of "
                                f"{','.join(sources)} (nothing kept) — free space, pass data_cache=<a folder on a "
                                f"larger disk>, or data_cache=false") from None
            raise UserError(f"data_cache={cache}: cannot write the token store ({e.strerror or e}; nothing kept) — "
                            f"pass data_cache=<a writable folder>, or data_cache=false") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        store = _opened(folder, None)  # just built and fsynced: its sums were computed from these bytes
        log(f"data: token store built in {time.perf_counter() - t0:.1f} s with {workers} worker"
            f"{'s' if workers > 1 else ''}: {folder}")
    gone = store_cache.evict(cache, keep_days, keep=folder)  # after the lock: evict takes each store's own
    if gone:
        log(f"data_cache: removed {len(gone)} token store{'s' if len(gone) > 1 else ''} unused for {keep_days:g} "
            f"days ({sum(s.size for s in gone) / 2**20:,.1f} MiB): {', '.join(s.folder.name for s in gone)}")
    return store


def _opened(folder: Path, verify: bool | None = False) -> TokenStore:
    """The store in `folder`, its use recorded; its arrays checked as `open_or_build` says, and its rows' image
    files against the build's (`Stale`) (None: neither, a store just built)."""
    store = TokenStore(folder)
    stale = store.stale_images() if verify is not None else None
    if stale:
        raise Stale(stale)
    if verify or (verify is not None and store.array_bytes <= VERIFY_BYTES):
        store.verify()
    elif verify is not None:
        log(f"note: data_cache: {folder}: its arrays ({store.array_bytes / 2**30:,.1f} GiB) are not checked at "
            f"start (resume=true checks them; `minitrain cache verify` checks every store)")
    store_cache.touch(folder)
    return store
