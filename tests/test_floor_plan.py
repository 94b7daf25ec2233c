"""The engine's floor plan (docs/design.md) holds, and the docs that draw it stay true.

- no import circle between modules of `minitrain/`, nor between its wings (subpackages);
- every import runs down the floors docs/design.md draws, and its tree shows every module;
- the engine never imports `models/`;
- each wing's docstring lists exactly its modules, and holds no code (nothing re-exported);
- the recipes import only what docs/contracts.md lists as public, and each listed name is
  defined in the module it is listed under.

Imports are read from the source (ast), every one of them: at the top of a file, inside a function
(a lazy import is still a dependency) and under `if TYPE_CHECKING:`. One test builds a small
tree with circles and checks that they are found.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WINGS = ("data", "text", "adapters", "objectives", "evaluate", "plan", "export", "commands", "parallel")


def modules(root: Path, pkg: str = "minitrain") -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package under `root`."""
    out = {}
    for p in sorted((root / pkg).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def imported_names(path: Path, name: str) -> list[str]:
    """Every dotted name an import statement of `path` (module `name`) refers to, relative ones resolved."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1] + [node.module or ""]) if node.level else node.module
            base = base.strip(".")
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def import_graph(root: Path, pkg: str = "minitrain") -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (the longest prefix of each name that is one)."""
    mods = modules(root, pkg)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for n in imported_names(path, m):
            parts = n.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            target = ".".join(parts)
            if target and target not in (m, pkg):
                graph[m].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def wing_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same imports between wings only: `minitrain.data.readers -> minitrain.text.tokenizer` is data -> text."""
    def wing(m: str) -> str | None:
        parts = m.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS) else None

    out: dict[str, set[str]] = {w: set() for w in WINGS}
    for m, targets in graph.items():
        a = wing(m)
        for t in targets:
            b = wing(t)
            if a and b and a != b:
                out[a].add(b)
    return out


def test_no_import_circle_in_minitrain():
    graph = import_graph(ROOT)
    assert len(graph) > 40 and graph["minitrain.run"], "the walk found the package"  # the test reads real files
    found = circles(graph)
    assert not found, "import circles (move what both sides need one floor down): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_wings_import_one_another_in_one_direction():
    found = circles(wing_graph(import_graph(ROOT)))
    assert not found, f"wings that import each other: {found}"


def test_the_engine_never_imports_models():
    """(`minitrain/commands/`, the programs a user runs, sit above the engine as the recipes do: they may.)"""
    for m, path in modules(ROOT).items():
        if m.startswith("minitrain.commands"):
            continue
        bad = [n for n in imported_names(path, m) if n == "models" or n.startswith("models.")]
        assert not bad, f"{path}: imports {bad[0]} — the engine asks through the model contract (docs/contracts.md)"


def floors_in_design_doc() -> list[list[str]]:
    """The floors of docs/design.md's "Which way imports go", top first: each a list of top-level
    modules and wings (`plan/` -> `plan`)."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    block = text.split("### Which way imports go", 1)[1].split("```", 2)[1]
    return [[n.strip().rstrip("/") for n in line.split("  ")[0].split(",")] for line in block.strip().splitlines()]


def test_every_import_runs_down_the_floors_the_design_doc_draws():
    floors = floors_in_design_doc()
    level = {name: i for i, floor in enumerate(floors) for name in floor}
    top = {m.split(".")[1] for m in modules(ROOT) if m != "minitrain"}
    assert set(level) == top, f"docs/design.md's floors name {sorted(set(level) ^ top)} wrongly"
    upward = [f"{m} -> {t}" for m, targets in import_graph(ROOT).items() if m != "minitrain" for t in targets
              if t != "minitrain" and m.split(".")[1] != t.split(".")[1]
              and level[t.split(".")[1]] <= level[m.split(".")[1]]]
    assert not upward, f"imports that do not run down docs/design.md's floors: {upward}"


@pytest.mark.parametrize("wing", WINGS)
def test_each_wing_lists_its_modules_in_its_docstring(wing):
    folder = ROOT / "minitrain" / wing
    init = folder / "__init__.py"
    tree = ast.parse(init.read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree)
    assert doc, f"{init}: no docstring — say which question the folder answers and list its modules"
    assert all(isinstance(n, ast.Expr) for n in tree.body), f"{init}: holds code; import from the modules themselves"
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.endswith("in reading order:")), None)
    assert start is not None, f"{init}: no 'Modules, in reading order:' list"
    block = lines[start + 1 : next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))]
    listed = [line.split()[0] for line in block if line[4:5].isalpha()]  # continuation lines are indented deeper
    present = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    assert sorted(listed) == present, f"{init}: lists {listed}, the folder holds {present}"


def test_the_checks_see_a_circle_when_there_is_one(tmp_path):
    pkg = tmp_path / "minitrain"
    (pkg / "data").mkdir(parents=True)
    (pkg / "text").mkdir()
    for init in ("__init__.py", "data/__init__.py", "text/__init__.py"):
        (pkg / init).write_text('"""x"""\n')
    (pkg / "a.py").write_text("def f():\n    from minitrain.b import g\n")  # a lazy import counts
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from minitrain import a\n")
    (pkg / "data" / "readers.py").write_text("from minitrain.text.tokenizer import Tokenizer\n")
    (pkg / "text" / "tokenizer.py").write_text("from ..data import readers\n")  # relative, one module up
    graph = import_graph(tmp_path)
    assert graph["minitrain.a"] == {"minitrain.b"} and graph["minitrain.b"] == {"minitrain.a"}
    assert graph["minitrain.text.tokenizer"] == {"minitrain.data.readers", "minitrain.data"}
    assert sorted(circles(graph)) == [["minitrain.a", "minitrain.b"],
                                      ["minitrain.data.readers", "minitrain.text.tokenizer"]]
    assert circles(wing_graph(graph)) == [["data", "text"]]


def public_imports() -> dict[str, set[str]]:
    """docs/contracts.md's table of the imports a recipe may rely on: module -> names."""
    text = (ROOT / "docs" / "contracts.md").read_text(encoding="utf-8")
    table = text.split("## The imports a recipe may rely on", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`minitrain"):
            out[cells[0].strip("`")] = {w.split("`")[1] for w in cells[1].split(", ") if "`" in w}
    return out


def recipe_imports() -> list[tuple[str, str, str]]:
    """(recipe file, module, name) for every minitrain name a recipe uses, through `from m import n`
    or through a module imported whole (`from minitrain import checkpoint as ckpt` ... `ckpt.read_state`)."""
    found = []
    for path in sorted((ROOT / "recipes").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "minitrain":
                for a in node.names:
                    whole = f"{node.module}.{a.name}"
                    if (ROOT / (whole.replace(".", "/") + ".py")).exists():
                        aliases[a.asname or a.name] = whole
                    else:
                        found.append((path.name, node.module, a.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                found.append((path.name, aliases[node.value.id], node.attr))
    return found


def test_recipes_import_only_what_the_contract_lists_and_the_contract_lists_what_exists():
    import importlib
    import inspect

    public = public_imports()
    assert len(public) > 30, "the table was found"
    used = recipe_imports()
    assert len(used) > 50, "the recipes' imports were found"
    unlisted = sorted({f"{m}.{n} ({f})" for f, m, n in used if n not in public.get(m, set())})
    assert not unlisted, f"recipes use names docs/contracts.md does not list as public: {unlisted}"
    missing = [f"{m}.{n}" for m, names in public.items() for n in sorted(names)
               if not hasattr(importlib.import_module(m), n)]
    assert not missing, f"docs/contracts.md lists names that do not exist: {missing}"
    elsewhere = [f"{m}.{n} (defined in {obj.__module__})" for m, names in public.items() for n in sorted(names)
                 for obj in [getattr(importlib.import_module(m), n)]
                 if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ != m]
    assert not elsewhere, f"docs/contracts.md lists names where they are only imported: {elsewhere}"


def test_the_design_doc_tree_shows_every_module():
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    block = text.split("## The floor plan", 1)[1].split("```", 2)[1]
    shown, wing = set(), None
    for line in block.splitlines():
        name = line.split()[0] if line.strip() else ""
        if line.startswith("  ") and not line.startswith("   ") and name.endswith("/"):
            wing = name.rstrip("/")
        elif line.startswith("    ") and not line.startswith("     ") and name.endswith(".py"):
            shown.add(f"{wing}/{name}")
        elif line.startswith("  ") and not line.startswith("   ") and name.endswith(".py"):
            shown.add(name)
    real = {str(p.relative_to(ROOT / "minitrain")) for p in (ROOT / "minitrain").rglob("*.py") if p.name != "__init__.py"}
    assert shown == real, f"docs/design.md's tree differs from minitrain/: missing {sorted(real - shown)}, " \
                          f"gone {sorted(shown - real)}"


def test_the_top_floor_holds_at_most_18_modules():
    """docs/design.md's floor-plan goal: a new concern joins a wing (or starts one), so the package's
    top level stays small enough to read at a glance."""
    top = sorted(p.name for p in (ROOT / "minitrain").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 18, f"minitrain/ holds {len(top)} top-level modules (at most 18): {top}"
