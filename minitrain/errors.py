"""User mistakes: one clear line and exit code 2, never a traceback.

Raise `UserError("data.jsonl:17: missing key \"completion\" — add it or map another field")`
anywhere; the CLI prints `error: <message>` on stderr and exits with code 2.
Tracebacks are kept for our own bugs.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input (file, key, value), reported as one line.

    The message should name where (file / line / key) and what to do, in the form
    `<where>: <what is wrong> — <what to do>`.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
