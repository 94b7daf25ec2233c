"""`python -m minitrain RECIPE.py key=value ...` (and `--version`, `--help`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--version":
        from minitrain import __version__

        print(f"minitrain {__version__}")
        return 0
    from minitrain.cli import run_cli

    return run_cli(argv)


if __name__ == "__main__":
    sys.exit(main())
