"""The cache folder of token stores (`data_cache=`): what is in it, when each store was last used, and
removing the old ones.

Every run that opens a store touches its `last_used` file (`touch`). A store whose settings are no
longer used (another `max_len`, a changed file, a new tokenizer) would otherwise stay forever, so after
each build the stores of the same folder that no run opened for `data_cache_days` days are removed
(`evict`); so are the temporary folders of builds killed that long ago. `minitrain cache` lists a
folder's stores with their sizes and last use, `minitrain cache clear [--days N]` removes them by hand,
`minitrain cache verify` reads every store's arrays against the checksums written at their build
(`main`).

A store is removed under its build lock (`.<name>.lock`; one being built is skipped) and first renamed
out of the way, so a run never opens half of it: a run that looks for it at that moment finds none and
builds it again. A run that already has the store open keeps reading it (its files stay until it
closes them). The lock files stay: they are empty, and removing one could let two builds of one store
run at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from minitrain.errors import UserError

LAST_USED = "last_used"
DAY = 86400.0


@dataclass
class StoreInfo:
    """One store of a cache folder, as `minitrain cache` lists it."""

    folder: Path
    size: int  # bytes, every file in the folder
    last_used: float  # seconds since the epoch: its `last_used` file, else when it was built
    examples: int
    kind: str
    sources: list[str]


def touch(folder: Path) -> None:
    """Record that a run opened the store now (a read-only cache is left as it is)."""
    try:
        (folder / LAST_USED).touch()
    except OSError:
        pass


def _info(folder: Path) -> StoreInfo | None:
    try:
        header = json.loads((folder / "header.json").read_text(encoding="utf-8"))
        files = [f for f in folder.iterdir() if f.is_file()]
        size = sum(f.stat().st_size for f in files)
        used = folder / LAST_USED
        last = (used if used.is_file() else folder / "header.json").stat().st_mtime
    except (OSError, ValueError, UnicodeDecodeError):  # not a store, or one being removed: not listed
        return None
    fp = header.get("fingerprint", {}) if isinstance(header, dict) else {}
    return StoreInfo(folder, size, last, int(header.get("n", 0)), str(fp.get("kind", "?")),
                     [str(s) for s in fp.get("sources", [])])


def stores(cache: str | Path) -> list[StoreInfo]:
    """The stores in `cache`, least recently used first."""
    cache = Path(cache)
    if not cache.is_dir():
        return []
    found = (_info(d) for d in cache.iterdir() if d.is_dir() and not d.name.startswith("."))
    return sorted((s for s in found if s is not None), key=lambda s: s.last_used)


def remove(folder: Path) -> bool:
    """Remove one store (or a killed build's temporary folder, `.tmp-<name>-<pid>`) under its build
    lock; False when a build holds the lock now (nothing is touched)."""
    name = folder.name
    if name.startswith(".tmp-"):
        name = name[len(".tmp-"):].rsplit("-", 1)[0]
    try:
        lock = open(folder.parent / f".{name}.lock", "a+")  # noqa: SIM115 -- closed by the with block below
    except OSError:
        return False
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        gone = folder.parent / f".tmp-{name}-{os.getpid()}-removed"
        try:
            os.rename(folder, gone)  # at once: no run opens half of it
        except OSError:
            return False
        shutil.rmtree(gone, ignore_errors=True)
        return True


def evict(cache: str | Path, days: float, keep: Path | None = None, now: float | None = None) -> list[StoreInfo]:
    """Remove the stores of `cache` (not `keep`) that no run opened for `days` days, and temporary
    build folders as old; returns the stores removed. `days` 0: nothing is removed."""
    if days <= 0:
        return []
    return _remove_older(Path(cache), (time.time() if now is None else now) - days * DAY, keep)


def _remove_older(cache: Path, cutoff: float, keep: Path | None = None) -> list[StoreInfo]:
    removed = [s for s in stores(cache) if s.last_used < cutoff and s.folder != keep and remove(s.folder)]
    for tmp in cache.glob(".tmp-*"):
        try:
            old = tmp.is_dir() and tmp.stat().st_mtime < cutoff
        except OSError:
            continue
        if old:
            remove(tmp)
    return removed


# --------------------------------------------------------------------------- `minitrain cache`

USAGE = ("usage: minitrain cache [--dir DIR]  |  minitrain cache clear [--days N] [--dir DIR]  |  minitrain cache "
         "verify [--dir DIR] — list the token stores of data_cache (default ~/.cache/minitrain/data), remove them "
         "(with --days: only those unused for N days), or check their arrays against their checksums")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"


def _verify(found: list[StoreInfo], cache: Path) -> int:
    from minitrain.data.store import Damaged, TokenStore

    bad = 0
    for s in found:
        try:
            TokenStore(s.folder).verify()
            print(f"  ok       {s.folder.name}  {_size(s.size)}", flush=True)
        except Damaged as e:
            bad += 1
            print(f"  DAMAGED  {s.folder.name}: {e}", flush=True)
    print(f"{len(found) - bad} of {len(found)} token store{'' if len(found) == 1 else 's'} in {cache} read back as "
          f"built" + (f"; {bad} damaged: the next run that uses one rebuilds it" if bad else ""))
    return 1 if bad else 0


def _parse(args: list[str], default: Path) -> tuple[str, Path, float | None]:
    command = "list"
    if args and not args[0].startswith("-"):
        command, args = args[0], args[1:]
    if command not in ("list", "clear", "verify"):
        raise UserError(f"cache {command}: not a cache command — {USAGE}")
    opts: dict[str, str] = {}
    while args:
        key = args.pop(0)
        if key not in ("--dir", "--days") or not args or (key == "--days" and command != "clear"):
            raise UserError(f"cache {command}: {key} is not understood here — {USAGE}")
        opts[key] = args.pop(0)
    days = None
    if "--days" in opts:
        try:
            days = float(opts["--days"])
        except ValueError:
            days = -1.0
        if not days >= 0:
            raise UserError(f"cache clear --days {opts['--days']}: give a number of days >= 0, e.g. --days 30")
    return command, Path(opts.get("--dir", default)).expanduser(), days


def main(args: list[str], default: Path) -> int:
    """`minitrain cache [list] [--dir DIR]`, `minitrain cache clear [--days N] [--dir DIR]` and
    `minitrain cache verify [--dir DIR]` (exit 1 when a store is damaged)."""
    command, cache, days = _parse(list(args), default)
    found = stores(cache)
    now = time.time()
    if command == "verify":
        return _verify(found, cache)
    if command == "list":
        if not found:
            print(f"no token stores in {cache}")
            return 0
        print(f"{len(found)} token store{'s' if len(found) > 1 else ''} in {cache}, "
              f"{_size(sum(s.size for s in found))} (least recently used first):")
        for s in found:
            ago = (now - s.last_used) / DAY
            print(f"  {s.folder.name}  {_size(s.size)}  {s.examples:,} examples ({s.kind})  last used "
                  f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(s.last_used))} ({ago:.0f} days ago)  "
                  f"{','.join(s.sources)}")
        print("remove them with: minitrain cache clear [--days N]" + (f" --dir {cache}" if cache != default else ""))
        return 0
    gone = _remove_older(cache, float("inf") if days is None else now - days * DAY)
    left = stores(cache)
    print(f"removed {len(gone)} token store{'' if len(gone) == 1 else 's'} ({_size(sum(s.size for s in gone))}) "
          f"from {cache}" + (f", unused for {days:g} days" if days is not None else "") + f"; {len(left)} left"
          + (" (being built, or used since)" if left and days is None else ""))
    return 0
