"""One row of data: its keys under the user's names (`fields`), typed access, and the row shapes
people's data comes in, turned into the few that minitrain trains on.

`Row(where, row, fields, expect)` gets a canonical key ("prompt", "messages", ...) through the
`fields` map, and every mistake (missing key, wrong type, empty text) is a `UserError` naming
`where` (`file:line` or `file:row N`). A key holding null (a Parquet / CSV column this row does
not use) counts as absent.

Shapes read as chat messages (`Row.chat()`):

- `messages`: `[{"role", "content"}, ...]` (OpenAI / TRL);
- ShareGPT `conversations`: `[{"from", "value"}, ...]`, `from` one of system / human / gpt (or
  user / assistant), as LLaMA-Factory reads it;
- Alpaca `instruction` / `input` / `output` (optional `system`, and `history` as a list of
  `[user, assistant]` pairs before it): the user turn is `instruction + "\n" + input`, or the
  instruction alone when `input` is empty, the assistant turn is `output` (LLaMA-Factory's rule).

The keys inside messages can be mapped too: `fields={"role": "speaker", "content": "text"}`.
"""

from __future__ import annotations

import json
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
        return self.row.get(self.key(name)) is not None

    def get(self, name: str) -> Any:
        k = self.key(name)
        if k not in self.row:
            hint = (f' (or map fields, e.g. fields={{"{name}": "your_key"}})' if k == name
                    else f' (fields maps "{name}" to "{k}"; {in_force(self.fields)})')
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
        """The message list under `name`, with `fields`' "role" / "content" keys renamed to those."""
        v = self.get(name)
        if not isinstance(v, list):
            raise UserError(f'{self.where}: "{self.key(name)}" must be a list of {{"role", "content"}} '
                            f'objects, got {type_name(v)} — fix the row')
        role, content = self.key("role"), self.key("content")
        if (role, content) == ("role", "content"):
            return v
        out = []
        for m in v:
            if isinstance(m, dict):
                m = {k: x for k, x in m.items() if k not in (role, content)} | {"role": m.get(role),
                                                                                  "content": m.get(content)}
            out.append(m)
        return out

    def sharegpt(self, name: str = "conversations") -> list[dict]:
        """ShareGPT turns `{"from", "value"}` as messages `{"role", "content"}`."""
        turns = self.get(name)
        k = self.key(name)
        if not isinstance(turns, list):
            raise UserError(f'{self.where}: "{k}" must be a list of {{"from", "value"}} objects, got '
                            f'{type_name(turns)} — fix the row')
        out = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict):
                raise UserError(f'{self.where}: {k}[{i}]: expected an object with "from" and "value", got '
                                f'{type_name(t)} — fix the row')
            if "from" not in t and "role" in t:  # already messages
                out.append(t)
                continue
            who = t.get("from")
            if who not in SHAREGPT_ROLES:
                raise UserError(f'{self.where}: {k}[{i}]: "from" is {who!r} — use one of '
                                f'{", ".join(SHAREGPT_ROLES)} (tool turns are not supported)')
            out.append({"role": SHAREGPT_ROLES[who], "content": t.get("value")})
        return out

    def alpaca(self) -> list[dict]:
        """An Alpaca row as messages (see the module doc)."""
        instruction, output = self.text("instruction"), self.text("output")
        extra = self.get("input") if self.has("input") else ""
        if not isinstance(extra, str):
            raise UserError(f'{self.where}: "{self.key("input")}" must be a string, got {type_name(extra)} — fix the row')
        msgs = [{"role": "system", "content": self.text("system")}] if self.has("system") else []
        history = self.get("history") if self.has("history") else []
        if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 for h in history):
            raise UserError(f'{self.where}: "{self.key("history")}" must be a list of [user, assistant] pairs — '
                            f'fix the row')
        for user, answer in history:
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        user = instruction + "\n" + extra if extra else instruction
        return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]

    def chat(self) -> list | None:
        """The row's conversation when it has one of the chat shapes (module doc), else None."""
        if self.has("messages"):
            return self.messages("messages")
        if self.has("conversations"):
            return self.sharegpt("conversations")
        if self.has("instruction") or self.has("output"):
            self.expect = '"instruction" and "output" (Alpaca)'
            return self.alpaca()
        return None


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# the canonical names `fields` may map, per kind of data
CHAT_FIELDS = ("messages", "conversations", "instruction", "input", "output", "system", "history", "role", "content")
SFT_FIELDS = ("prompt", "completion", "text") + CHAT_FIELDS
PREFERENCE_FIELDS = ("prompt", "chosen", "rejected", "conversations", "role", "content", "margin")
SEQ2SEQ_FIELDS = ("prompt", "completion")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def in_force(fields: dict[str, str]) -> str:
    """The `fields` mapping a run reads with, for messages about keys."""
    return f"fields in force: {json.dumps(fields, ensure_ascii=False)}" if fields else "no fields mapping in force"


def check_fields(fields: dict[str, str] | None, valid: tuple[str, ...]) -> dict[str, str]:
    fields = dict(fields or {})
    for k, v in fields.items():
        if k not in valid:
            raise UserError(f"fields: unknown name {k!r} ({in_force(fields)}) — map these names to your keys: "
                            f"{', '.join(valid)}")
        if not isinstance(v, str) or not v:
            raise UserError(f"fields[{k!r}]: {v!r} — give the key name used in your file")
    return fields
