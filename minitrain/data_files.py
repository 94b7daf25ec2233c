"""Data files -> rows: which file formats minitrain reads, and where each row came from.

`read_jsonl(path)` yields `("file:line", row)` for each JSON object of a JSONL file; anything
that is not one object per line is a `UserError` naming the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from minitrain.errors import UserError
from minitrain.data_rows import type_name


def read_jsonl(path: str | Path) -> Iterator[tuple[str, dict]]:
    """Yield `("file:line", row)` for each non-blank line; UserError for anything not an object."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such file — check the data path")
    any_row = False
    with open(p, "rb") as f:
        for n, raw in enumerate(f, 1):
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
            if not isinstance(row, dict):
                raise UserError(f"{where}: expected a JSON object, got {type_name(row)} — "
                                f"each line must be one JSON object like {{\"prompt\": ..., \"completion\": ...}}")
            any_row = True
            yield where, row
    if not any_row:
        raise UserError(f"{p}: empty file (no JSON rows) — add one JSON object per line")
