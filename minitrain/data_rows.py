"""One row of data: its keys under the user's names (`fields`) and typed access to them.

`Row(where, row, fields, expect)` gets a canonical key ("prompt", "messages", ...) through the
`fields` map, and every mistake (missing key, wrong type, empty text) is a `UserError` naming
`where` (`file:line`).
"""

from __future__ import annotations

from typing import Any

from minitrain.errors import UserError


def type_name(v: Any) -> str:
    """How a JSON value's type reads in an error: "an object", "a list", "a number", ..."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


class Row:
    """One row with the canonical key names mapped to the file's (`fields`)."""

    def __init__(self, where: str, row: dict, fields: dict[str, str], expect: str):
        self.where, self.row, self.fields, self.expect = where, row, fields, expect

    def key(self, name: str) -> str:
        return self.fields.get(name, name)

    def has(self, name: str) -> bool:
        return self.key(name) in self.row

    def get(self, name: str) -> Any:
        k = self.key(name)
        if k not in self.row:
            hint = f' (or map fields, e.g. fields={{"{name}": "your_key"}})' if k == name else ""
            raise UserError(f'{self.where}: missing key "{k}" — every row needs {self.expect}{hint}')
        return self.row[k]

    def text(self, name: str) -> str:
        v = self.get(name)
        k = self.key(name)
        if not isinstance(v, str):
            raise UserError(f'{self.where}: "{k}" must be a string, got {type_name(v)} — fix the row')
        if not v.strip():
            raise UserError(f'{self.where}: "{k}" is empty — fill it or remove the row')
        if not _utf8(v):
            raise UserError(f'{self.where}: "{k}" holds a lone surrogate (a broken \\u escape) — fix the text')
        return v

    def messages(self, name: str) -> list:
        v = self.get(name)
        if not isinstance(v, list):
            raise UserError(f'{self.where}: "{self.key(name)}" must be a list of {{"role", "content"}} '
                            f'objects, got {type_name(v)} — fix the row')
        return v


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def check_fields(fields: dict[str, str] | None, valid: tuple[str, ...]) -> dict[str, str]:
    fields = dict(fields or {})
    for k, v in fields.items():
        if k not in valid:
            raise UserError(f"fields: unknown name {k!r} — map these names to your keys: {', '.join(valid)}")
        if not isinstance(v, str) or not v:
            raise UserError(f"fields[{k!r}]: {v!r} — give the key name used in your file")
    return fields
