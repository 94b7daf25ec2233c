"""Data files -> rows: which file formats minitrain reads, and where each row came from.

`read_rows(path)` yields `(where, row)` pairs, `row` a dict and `where` the place a message
about it names: `file:LINE` for line-based text (JSONL, CSV / TSV: the line the record starts
on, as an editor shows it), `file:row N` (1-based) for JSON arrays, Parquet and Arrow.

The format is read from the content, not the name (a `.jsonl` that is really Parquet is read as
Parquet): Parquet and Arrow by their magic bytes; text by its first character (`[` a JSON array,
`{` JSON lines or one JSON object holding the rows in a list); other text is CSV, or TSV when its
header line has tabs and no commas (or the file is named `.tsv`). A CSV cell holding a JSON list
or object (a message list) is parsed as JSON.

A folder is a HF `datasets` `save_to_disk` folder (`dataset_dict.json` with one sub-folder per
split: `train` is read unless `split` names another; or a single split with `state.json`), or a
folder of data files of one format, read in name order.

Parquet and Arrow need `pyarrow` (the optional `data` extra). Rows are read a batch at a time
(`BATCH` rows), so the file's own size in memory never adds up: only the examples made from it
are kept.
"""

from __future__ import annotations

import csv
import glob
import json
from pathlib import Path
from typing import Any, Callable, Iterator

from minitrain.data.rows import type_name
from minitrain.errors import UserError

BATCH = 1024  # rows per Arrow record batch read from Parquet / Arrow files
PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"
DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet", ".arrow")


class Pick:
    """Which rows one reader of several takes: `keep(i)` on the 0-based row index across everything
    read with this `Pick` (the token store's workers each take every K-th chunk of rows). Rows not
    taken are counted but not parsed where the format allows (JSON lines), so a bad row is named
    by the reader that takes it."""

    def __init__(self, keep: Callable[[int], bool]):
        self.keep, self.i, self.taken = keep, 0, 0  # rows seen, rows taken

    def take(self) -> bool:
        self.i += 1
        mine = self.keep(self.i - 1)
        self.taken += mine
        return mine


def read_rows(path: str | Path, split: str | None = None, pick: Pick | None = None) -> Iterator[tuple[str, dict]]:
    """Yield `(where, row)` for each row of the data file or folder `path` (see the module doc);
    with `pick`, only the rows it takes."""
    p = Path(path)
    if p.is_dir():
        yield from _read_folder(p, split, pick)
        return
    if not p.exists():
        raise UserError(missing_data(p))
    if split is not None:
        raise UserError(f"{p}: a file has no splits (split={split!r}) — pass the datasets folder, or drop the split")
    fmt = sniff(p)
    if fmt == "json-or-jsonl":  # a first line that is not a whole object: one object over many lines?
        fmt = "json" if _load_json(p, quiet=True) is not None else "jsonl"
    read = {"jsonl": _read_jsonl, "json": _read_json, "csv": _read_csv, "tsv": _read_csv,
            "parquet": _read_parquet, "arrow": _read_arrow, "arrow-stream": _read_arrow}[fmt]
    any_row, start = False, pick.i if pick is not None else 0
    for item in read(p, fmt, pick) if fmt == "jsonl" else read(p, fmt):
        any_row = True
        if pick is None or fmt == "jsonl" or pick.take():
            yield item
    any_row = any_row or (pick is not None and pick.i > start)
    if not any_row and fmt == "jsonl":
        raise UserError(f"{p}: empty file (no JSON rows) — add one JSON object per line")
    if not any_row:
        raise UserError(f"{p}: no rows ({describe(fmt)} file) — add rows, or check the path")


def missing_data(path: str | Path) -> str:
    return f"{path}: no such file — check the data path"


def data_sources(data: str) -> list[str]:
    """The sources a `data=` value names: paths separated by commas, each a file, a folder or a glob
    (`shards/*.parquet`, expanded in name order); a glob that matches nothing is one clear line."""
    out: list[str] = []
    for part in (p.strip() for p in str(data).split(",")):
        if not part:
            raise UserError(f"data={data}: an empty entry between commas — list paths as a.jsonl,b.parquet")
        if glob.has_magic(part):
            found = sorted(glob.glob(part))
            if not found:
                raise UserError(f"{part}: matches no file — check the pattern (data={data})")
            out += found
        else:
            out.append(part)
    return out


def read_jsonl(path: str | Path) -> Iterator[tuple[str, dict]]:
    """Rows of any data file (the name is kept for existing callers); see `read_rows`."""
    return read_rows(path)


def describe(fmt: str) -> str:
    return {"jsonl": "JSON lines", "json": "JSON", "csv": "CSV", "tsv": "TSV", "parquet": "Parquet",
            "arrow": "Arrow", "arrow-stream": "Arrow stream"}[fmt]


def sniff(p: Path) -> str:
    """The format of file `p`, from its first bytes (see the module doc)."""
    try:
        with open(p, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise UserError(f"{p}: cannot read ({e.strerror or e}) — check the path and its permissions") from None
    if head.startswith(PARQUET_MAGIC):
        return "parquet"
    if head.startswith(ARROW_FILE_MAGIC):
        return "arrow"
    if head.startswith(ARROW_STREAM_MAGIC):
        return "arrow-stream"
    text = head.decode("utf-8", errors="ignore").lstrip("\ufeff \t\r\n")
    if not text:
        return "jsonl"  # empty, or blank lines: said as such by the JSON lines reader
    if text.startswith("["):
        return "json"
    if text.startswith("{"):
        first = head.lstrip(b"\xef\xbb\xbf \t\r\n").split(b"\n", 1)[0]
        try:
            json.loads(first)
            return "jsonl"
        except (ValueError, UnicodeDecodeError):
            return "json-or-jsonl"
    if _is_binary(head):
        raise UserError(f"{p}: not a data file minitrain reads (binary, not Parquet or Arrow) — use JSON lines, JSON, "
                        f"CSV/TSV, Parquet, Arrow or a datasets save_to_disk folder")
    header = text.split("\n", 1)[0]
    if p.suffix.lower() == ".tsv" or ("\t" in header and "," not in header):
        return "tsv"
    return "csv"


def _is_binary(head: bytes) -> bool:
    if b"\x00" in head:
        return True
    try:
        head.decode("utf-8")
        return False
    except UnicodeDecodeError as e:
        return e.start < len(head) - 4  # a character cut at the end of the 4 KiB read is not binary


# --------------------------------------------------------------------------- text formats


def _read_jsonl(p: Path, fmt: str, pick: Pick | None = None) -> Iterator[tuple[str, dict]]:
    with open(p, "rb") as f:
        for n, raw in enumerate(f, 1):
            if pick is not None and raw.strip() and not pick.take():
                continue  # another reader's row: not parsed here
            where = f"{p}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{where}: not UTF-8 ({e.reason} at byte {e.start}) — save the file as UTF-8") from None
            if n == 1:
                line = line.lstrip("\ufeff")  # a byte-order mark some editors write
            if not line.strip():
                continue
            line = line.rstrip("\r\n")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where}: malformed JSON ({e.msg} at column {e.colno}) — "
                                f"each line must be one JSON object") from None
            except RecursionError:
                raise UserError(f"{where}: JSON nested too deeply — each line must be one flat JSON object") from None
            yield where, _object(row, where, "each line must be one JSON object")


def _object(row: Any, where: str, rule: str) -> dict:
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type_name(row)} — "
                        f"{rule} like {{\"prompt\": ..., \"completion\": ...}}")
    return row


def _load_json(p: Path, quiet: bool = False) -> Any:
    """The whole file as one JSON value (None with `quiet` when it is not one)."""
    try:
        return json.loads(p.read_bytes().decode("utf-8").lstrip("\ufeff"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        if quiet:
            return None
        raise


def _read_json(p: Path, fmt: str) -> Iterator[tuple[str, dict]]:
    """A JSON array of row objects, or an object holding one such array (e.g. {"data": [...]})."""
    try:
        data = _load_json(p)
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: not UTF-8 ({e.reason} at byte {e.start}) — save the file as UTF-8") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{p}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno}) — the file must be one JSON "
                        f"array of row objects (or JSON lines: one object per line)") from None
    except RecursionError:
        raise UserError(f"{p}: JSON nested too deeply — use an array of flat row objects") from None
    key = None
    if isinstance(data, dict):
        lists = [k for k, v in data.items() if isinstance(v, list)]
        if len(lists) != 1:
            raise UserError(f"{p}: a JSON object holding {len(lists)} lists "
                            f"({', '.join(map(repr, lists[:4])) or 'none'}) — give the rows as a JSON array, or an "
                            f"object holding exactly one array of rows")
        key = lists[0]
        data = data[key]
    for n, row in enumerate(data, 1):
        where = f"{p}:row {n}" if key is None else f"{p}:{key}[{n - 1}]"
        yield where, _object(row, where, "each row of the array must be a JSON object")


def _read_csv(p: Path, fmt: str) -> Iterator[tuple[str, dict]]:
    delimiter = "\t" if fmt == "tsv" else ","
    try:
        f = open(p, encoding="utf-8-sig", newline="")
        with f:
            reader = csv.reader(f, delimiter=delimiter)
            try:
                header = next(reader)
            except StopIteration:
                return
            header = [h.strip() for h in header]
            if not any(header) or len(set(header)) != len(header):
                raise UserError(f"{p}:1: the header row must name each column once (got {header[:6]}) — the first "
                                f"line of a {describe(fmt)} file names the columns, e.g. prompt{delimiter}completion")
            start = reader.line_num + 1
            for cells in reader:
                where = f"{p}:{start}"
                start = reader.line_num + 1
                if not cells or (len(cells) == 1 and not cells[0].strip()):
                    continue  # a blank line
                if len(cells) != len(header):
                    raise UserError(f"{where}: {len(cells)} cells, the header names {len(header)} columns — quote cells "
                                    f"holding {'tabs' if fmt == 'tsv' else 'commas'} or newlines with \"...\"")
                yield where, {h: _cell(c) for h, c in zip(header, cells)}
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: not UTF-8 ({e.reason} at byte {e.start}) — save the file as UTF-8") from None
    except csv.Error as e:
        raise UserError(f"{p}: malformed {describe(fmt)} ({e}) — check the quoting") from None


def _cell(text: str) -> Any:
    """A CSV cell: a JSON list / object (message lists) is parsed; anything else stays text."""
    s = text.strip()
    if s[:1] in ("[", "{") and s[-1:] in ("]", "}"):
        try:
            return json.loads(s)
        except (ValueError, RecursionError):
            return text
    return text


# --------------------------------------------------------------------------- Arrow formats


def pyarrow():
    """The `pyarrow` module, or one clear line naming the extra that installs it."""
    try:
        import pyarrow as pa  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise UserError("reading Parquet / Arrow data needs pyarrow — pip install 'minitrain[data]' "
                        "(or pip install pyarrow), or convert the data to JSON lines") from None
    return pa


def _batches_rows(p: Path, batches) -> Iterator[tuple[str, dict]]:
    n = 0
    for batch in batches:
        for row in batch.to_pylist():
            n += 1
            yield f"{p}:row {n}", row


def _read_parquet(p: Path, fmt: str) -> Iterator[tuple[str, dict]]:
    pa = pyarrow()
    try:
        # pre_buffer=False: pyarrow's default (True) buffers every column chunk it will read, i.e.
        # the whole file by the end of the iteration (measured: 1.0x the file in RSS)
        f = pa.parquet.ParquetFile(p, pre_buffer=False, buffer_size=1 << 20)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{p}: cannot read as Parquet ({e}) — the file is damaged or not Parquet") from None
    try:
        yield from _batches_rows(p, f.iter_batches(batch_size=BATCH))
    except pa.ArrowException as e:
        raise UserError(f"{p}: cannot read as Parquet ({e}) — the file is damaged") from None


def _read_arrow(p: Path, fmt: str) -> Iterator[tuple[str, dict]]:
    """An Arrow IPC file, or an Arrow stream (what `datasets` writes in its folders), memory-mapped."""
    pa = pyarrow()
    try:
        source = pa.memory_map(str(p), "r")
        if fmt == "arrow":
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = pa.ipc.open_stream(source)
        yield from _batches_rows(p, batches)
    except pa.ArrowException as e:
        raise UserError(f"{p}: cannot read as Arrow ({e}) — the file is damaged or not Arrow") from None


# --------------------------------------------------------------------------- folders


def _read_folder(p: Path, split: str | None, pick: Pick | None = None) -> Iterator[tuple[str, dict]]:
    if (p / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: one folder per split
        try:
            splits = json.loads((p / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            raise UserError(f"{p}/dataset_dict.json: unreadable — re-save the dataset with save_to_disk") from None
        name = split or "train"
        if name not in splits:
            raise UserError(f"{p}: the dataset has no split {name!r} (splits: {', '.join(splits)}) — pass "
                            f"the split's folder, e.g. {p / splits[0]}" if splits else f"{p}: the dataset has no splits")
        yield from _read_folder(p / name, None, pick)
        return
    if split is not None:
        raise UserError(f"{p}: not a datasets folder with splits (no dataset_dict.json) — drop the split")
    if (p / "state.json").is_file():  # Dataset.save_to_disk: data-*.arrow in order
        try:
            files = [f["filename"] for f in json.loads((p / "state.json").read_text(encoding="utf-8"))["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError):
            raise UserError(f"{p}/state.json: unreadable — re-save the dataset with save_to_disk") from None
        for name in files:
            yield from read_rows(p / name, pick=pick)
        return
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in DATA_SUFFIXES)
    if not files:
        raise UserError(f"{p}: is a folder with no data files ({', '.join(DATA_SUFFIXES)}) and not a datasets "
                        f"save_to_disk folder — pass the data file itself")
    for f in files:
        yield from read_rows(f, pick=pick)
