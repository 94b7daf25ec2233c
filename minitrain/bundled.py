"""What ships with minitrain besides the engine: its recipes and the built-in demo's files.

A clone (or an editable install) keeps them at the repository root, beside `minitrain/`: `recipes/`
and `demo/`. A wheel carries the same files inside the package, as `minitrain/recipes/` and
`minitrain/demo/` (pyproject.toml maps the folders there), so that an installed minitrain runs its
recipes by name from any folder: `minitrain dpo_mistral`, `minitrain ls`, `minitrain cp sft_llama
my_sft.py`. A recipe finds the demo through `demo_dir()`, so a copy of it in the user's folder
still trains the demo.
"""

from __future__ import annotations

import ast
import difflib
import shutil
from pathlib import Path

from minitrain.errors import UserError

_PACKAGE = Path(__file__).resolve().parent


def _home(name: str) -> Path:
    """`name`'s folder: inside the installed package (a wheel), else beside it (a clone)."""
    inside = _PACKAGE / name
    if inside.is_dir():
        return inside
    return _PACKAGE.parent / name


def recipes_dir() -> Path:
    """The folder of minitrain's own recipes."""
    return _home("recipes")


def demo_dir() -> Path:
    """The folder of the built-in demo: the tiny committed model and its data files."""
    return _home("demo")


def is_recipe(path: Path) -> bool:
    """Does this Python file define `config` and `run` at its top level? (read, not imported)"""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Expr) and "globals().update" in ast.unparse(node):
            names |= {"config", "run"}  # a recipe that runs another one's code (recipes/sft.py)
    return {"config", "run"} <= names


def recipes() -> dict[str, Path]:
    """minitrain's own recipes: name -> file, in name order."""
    folder = recipes_dir()
    files = sorted(folder.glob("*.py")) if folder.is_dir() else []
    return {f.stem: f for f in files if not f.name.startswith("_")}


def purpose(path: Path, width: int = 100) -> str:
    """The first sentence of a recipe's docstring, cut to `width` characters."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except (OSError, SyntaxError):
        return ""
    sentence = " ".join(doc.strip().split("\n\n")[0].split()).split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= width else sentence[:width - 1].rstrip() + "…"


def find(name: str) -> Path:
    """The recipe minitrain ships under `name` (`sft_llama` or `sft_llama.py`), or a UserError that
    lists the names there are."""
    known = recipes()
    stem = name.removesuffix(".py")
    if stem in known:
        return known[stem]
    close = difflib.get_close_matches(stem, list(known), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UserError(f"{name}: no such recipe file, and minitrain has no recipe of that name — {hint}"
                    f"`minitrain ls` lists them ({', '.join(known) or 'none found'}); "
                    f"a recipe of your own is given by its path, e.g. ./my_sft.py")


def listing() -> str:
    """`minitrain ls`: each recipe's name and purpose, and how to run or copy one."""
    known = recipes()
    width = max((len(n) for n in known), default=0)
    lines = [f"{n:<{width}}  {purpose(p)}" for n, p in known.items()]
    lines += ["", "run one:   minitrain NAME [key=value ...]   (NAME --help lists its keys)",
              "copy one:  minitrain cp NAME my_recipe.py   (then: minitrain my_recipe.py)"]
    return "\n".join(lines)


def copy(name: str, dest: str | None) -> Path:
    """`minitrain cp NAME [DEST]`: copy a recipe to edit; never overwrite a file."""
    source = find(name)
    target = Path(dest) if dest else Path(source.name)
    if target.is_dir():
        target = target / source.name
    if target.suffix != ".py":
        raise UserError(f"{target}: a recipe copy must end in .py — e.g. minitrain cp {source.stem} my_{source.stem}.py")
    if target.exists():
        raise UserError(f"{target}: already exists — choose another name, or delete it first")
    if not target.parent.is_dir():
        raise UserError(f"{target.parent}: no such folder — create it first, or copy to the current folder")
    shutil.copyfile(source, target)
    return target
