"""`python -m minitrain RECIPE.py key=value ...` (and `--version`, `--help`), and `minitrain COMMAND ...`: the
programs of `minitrain/commands/` (merge, generate, plan, audit, export, evaluate, plot)."""

from __future__ import annotations

import os
import sys


def _unshadow() -> None:
    """Keep the user's working directory from shadowing our packages.

    `python -m` puts the working directory first on `sys.path`. People keep checkpoints in a
    `models/` folder (and may have `minitrain/` or `recipes/` folders too): Python would take such a
    folder for our `models` package (a namespace package wins over an editable install's finder),
    and the first `models.from_hf_config` would fail. Recipes are loaded from their path, so the
    working directory is never needed on the import path; drop it unless it is our own checkout,
    and forget a namespace `minitrain` / `models` that it already produced.
    """
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cwd = os.getcwd()
    if os.path.abspath(cwd) == ours:
        return
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != cwd]
    for name in ("minitrain", "models"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None) is None:  # a namespace from a folder
            del sys.modules[name]


def main(argv: list[str] | None = None) -> int:
    _unshadow()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--version":
        from minitrain import __version__

        print(f"minitrain {__version__}")
        return 0
    from minitrain.cli import ENGINE_COMMANDS, run_cli

    if argv and argv[0] in ENGINE_COMMANDS and not os.path.isfile(argv[0]):  # `minitrain merge ...`
        import importlib

        return importlib.import_module(f"minitrain.commands.{argv[0]}").main(argv[1:]) or 0
    return run_cli(argv)


if __name__ == "__main__":
    _unshadow()
    from minitrain.cli import main_quietly  # `--version | head`: a closed pipe ends it quietly

    sys.exit(main_quietly(main))
