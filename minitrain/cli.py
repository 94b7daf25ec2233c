"""The command line: `python -m minitrain RECIPE key=value ... [--help]`, `minitrain ls`, `minitrain cp`.

1. load the recipe file as a module from its path (or, for a name such as `sft_llama`, the recipe
   minitrain ships: `minitrain.bundled`) and take its `config` (a dataclass instance) and
   `run(config)`;
2. apply `key=value` overrides, each parsed by the type of the dataclass field it names;
3. `validate` the result (bounds, choices, cross-field rules) and call `run(config)`.

`minitrain ls` lists the recipes minitrain ships, `minitrain cp NAME [DEST]` copies one to edit.
`minitrain cache [clear [--days N]] [--dir DIR]` lists (or removes) the token stores of `data_cache`.

A recipe may also define `demo`, a dict of settings for its built-in demo: they apply only when
the command names none of `model`, `data`, `eval_data` (`resolve_config`), so a real run gets
the recipe's own defaults and is asked for what it lacks, never the demo's files or settings.

A warning raised while a recipe runs (ours or a library's) prints as one `note:` line, once.

Every user mistake is a `UserError`, printed as one `error: ...` line on stderr with exit code 2;
Ctrl-C exits 130. Training stopped by SIGINT / SIGTERM (`minitrain.train.Interrupted`) prints the
command that resumes it and exits 130 / 143. Anything else is our bug and keeps its traceback.

Under `torchrun --nproc_per_node N -m minitrain ...` the process group is joined here, once,
before the recipe runs (`minitrain.parallel.distributed.init`); rank 0 alone prints these lines. A rank
whose collective fails because another rank died or stopped answering (within `dist_timeout`)
exits 1 after one `error:` line from the lowest such rank (`minitrain.parallel.distributed.report_failure`).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import importlib.util
import inspect
import io
import json
import math
import os
import re
import shlex
import sys
import textwrap
import traceback
import typing
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, NamedTuple

from minitrain import bundled
from minitrain.config import (check_paths, conforms, example, field_types, format_value, shown, type_name,
                              union_members, unwrap_optional, validate)
from minitrain.errors import UserError

USAGE = ("usage: minitrain RECIPE [key=value ...] [--help] — RECIPE is a recipe file (my_sft.py) "
         "or the name of one minitrain ships (`minitrain ls` lists them); `minitrain cp NAME my_recipe.py` copies one; "
         "`minitrain --help` lists the other commands")
# the subcommands: name -> what it does; those of `minitrain/commands/` are run by `minitrain.__main__`
COMMANDS = {
    "ls": "list the recipes minitrain ships, with their purpose",
    "cp": "cp NAME [DEST]: copy a shipped recipe to edit",
    "config": "config RECIPE > run.yaml: every key of a recipe with its default and help (a run file)",
    "cache": "cache [list|clear [--days N]|verify] [--dir DIR]: the token stores of data_cache",
    "merge": "merge --model DIR --adapter DIR --out DIR: fold a LoRA adapter into its base (an HF folder)",
    "generate": "generate --model DIR [--adapter DIR] [--prompt TEXT]: try a model on a prompt",
    "plan": "plan RECIPE [key=value ...] [--gpu-mem 24GiB]: predicted peak GPU memory, and what makes it fit",
    "audit": "audit RECIPE [key=value ...]: does every trainable tensor get gradient from the loss?",
    "export": "export --model DIR [--adapter DIR] --out F.gguf: one GGUF file for llama.cpp (the export extra)",
    "evaluate": "evaluate --model minitrain --model_args pretrained=DIR,adapter=DIR --tasks T: lm-eval (the eval extra)",
    "plot": "plot RUN [RUN ...] --metric loss --out curves.png: training curves (the plot extra)",
}
ENGINE_COMMANDS = ("merge", "generate", "plan", "audit", "export", "evaluate", "plot")  # minitrain/commands/


def help_text() -> str:
    """`minitrain --help`: how to run a recipe, and every subcommand."""
    lines = [USAGE, "", "commands (each takes --help):"]
    lines += [f"  minitrain {text}" if text.startswith(name) else f"  minitrain {name}: {text}"
              for name, text in COMMANDS.items()]
    lines += ["", "Run `minitrain RECIPE --help` to list a recipe's keys."]
    return "\n".join(lines)
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


class Recipe(NamedTuple):
    """A loaded recipe file: its module, its `config` and its `run(config)`."""

    path: str
    module: ModuleType
    config: Any
    run: Callable[[Any], Any]


def run_cli(argv: list[str]) -> int:
    """Run `RECIPE.py key=value ...`; return the exit code (0 ok, 2 user error, 130 interrupted)."""
    _line_buffered()
    code = None
    together = False  # every rank ends the same way: they meet at a barrier before leaving the group
    shown_before = warnings.showwarning
    warnings.showwarning = _note
    try:
        code = _main(list(argv))
        together = code == 0
        return code
    except UserError as e:
        if _rank() == 0:  # under torchrun every rank raises the same error: say it once
            print(f"error: {e}", file=sys.stderr, flush=True)
        # an error every rank raised (`distributed.main_only`, `check_agree`): the others wait until rank 0
        # has said it, so that none exits first and has torchrun stop rank 0 before it prints
        together = getattr(e, "shared", False)
        return UserError.exit_code
    except KeyboardInterrupt as e:
        if _rank() == 0:
            resume = getattr(e, "resume_line", None)  # minitrain.train.Interrupted: a checkpoint was saved
            print(resume(_resume_command(argv)) if resume else "interrupted", file=sys.stderr)
        together = getattr(e, "exit_code", 130) == 0  # stop_after: every rank stopped after the same step
        return getattr(e, "exit_code", 130)
    except BrokenPipeError:  # `... --help | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # under torchrun: a collective that another rank left unanswered
        distributed = sys.modules.get("minitrain.parallel.distributed")
        if distributed is None or not distributed.is_peer_failure(e):
            raise
        line = distributed.report_failure(e)  # the lowest rank that saw it says it, once
        if line:
            print(f"error: {line}", file=sys.stderr, flush=True)
        return 1
    finally:
        warnings.showwarning = shown_before
        if "minitrain.parallel.distributed" in sys.modules:  # (imported, with torch, only once a recipe runs)
            sys.modules["minitrain.parallel.distributed"].shutdown(finished=together)


_NOTED: set[str] = set()


def _note(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
          line: str | None = None) -> None:
    """A warning during a run (ours or a library's) as one `note:` line on stderr, rank 0, each message
    once: no source path, no code line. One raised inside a library (the frame it names is in
    site-packages) says whose it is."""
    text = " ".join(str(message).split())
    if _rank() != 0 or text in _NOTED:
        return
    _NOTED.add(text)
    parts = Path(filename).parts
    owner = parts[parts.index("site-packages") + 1] if "site-packages" in parts[:-1] else None
    if owner and owner.split(".")[0] not in ("minitrain", "models"):
        text = f"{owner.removesuffix('.py')}: {text}"
    print(f"note: {text}", file=sys.stderr, flush=True)


def main_quietly(main: Callable[..., int | None], *args: Any) -> int:
    """Run a command-line entry point (`tools/*.py`); a reader that closed the pipe (`... | head`)
    ends it quietly with exit code 0 instead of a BrokenPipeError traceback.

    stdout is flushed inside the guard (a closed pipe shows up here, not at interpreter exit, also
    after argparse's `--help` exits), then pointed at /dev/null so the exit flush has nowhere to fail."""
    try:
        try:
            code = main(*args)
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code or 0


def _main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(help_text())
        return 0
    if not argv:
        raise UserError(f"no recipe given — {USAGE}")
    if argv[0] in ("ls", "cp") and not Path(argv[0]).is_file():
        return _ls_cp(argv)
    if argv[0] == "cache" and not Path(argv[0]).is_file():  # the token stores of data_cache
        from minitrain.data import store_cache
        from minitrain.data.store_build import default_cache

        return store_cache.main(argv[1:], default_cache())
    if argv[0] == "config" and not Path(argv[0]).is_file():  # a run file of a recipe's keys
        return _config_template(argv[1:])
    path, args = argv[0], argv[1:]
    if not path.endswith(".py") and ("=" in path or path.startswith("-")):
        raise UserError(f"{path}: the first argument must be the recipe file — "
                        f"e.g. python -m minitrain recipes/sft_llama.py {path}")
    if "--version" in args:
        from minitrain import __version__

        print(f"minitrain {__version__}")
        return 0
    path = recipe_path(path)
    if any(a in ("-h", "--help") for a in args):
        light = _light_module(path)  # the help from the recipe's config alone, when it can be read so
        if light is not None:
            print(recipe_help(Recipe(path, light, light.config, lambda c: None)))
            sys.modules.pop(light.__name__, None)
            return 0
    else:
        early_check(path, args)  # a mistyped key, a bad value or a missing file: answered before torch loads
    recipe = load_recipe(path)
    if any(a in ("-h", "--help") for a in args):
        print(recipe_help(recipe))
        return 0
    config, demo = resolve_config(recipe, args)
    validate(config)
    if demo and _rank() == 0:
        print("demo: no model, data or eval_data given, so this trains the built-in demo with the recipe's demo "
              "settings (--help lists them); for your own checkpoint pass model=... data=...", flush=True)
    from minitrain.parallel import distributed

    distributed.init(config)  # under torchrun: join the process group (else only checks parallel=)
    from minitrain.plan import fit

    config = fit.check(config, log=_log)  # on CUDA: plan the peak before any weight is read
    if _on_cpu(config):
        from minitrain.cpu import set_threads

        set_threads(getattr(config, "threads", 0), _log)  # busy cores: fewer threads (minitrain.cpu)
    recipe.run(config)
    return 0


def _ls_cp(argv: list[str]) -> int:
    """`minitrain ls` and `minitrain cp NAME [DEST]`."""
    command, args = argv[0], argv[1:]
    if command == "ls":
        if args:
            raise UserError(f"ls {' '.join(args)}: `minitrain ls` takes no arguments")
        print(bundled.listing())
        return 0
    if not 1 <= len(args) <= 2 or any(a.startswith("-") for a in args):
        raise UserError("usage: minitrain cp NAME [DEST] — e.g. minitrain cp sft_llama my_sft.py (`minitrain ls` lists the names)")
    target = bundled.copy(args[0], args[1] if len(args) == 2 else None)
    print(f"copied {bundled.find(args[0]).stem} to {target} — edit it, then run: minitrain {target}")
    return 0


def recipe_path(given: str) -> str:
    """The recipe file a command names: a path that exists, else the recipe minitrain ships under
    that name (`sft_llama`, `sft_llama.py`, or `recipes/sft_llama.py` typed outside our clone)."""
    p = Path(given)
    if p.exists() or p.suffix not in ("", ".py"):
        return given  # load_recipe says what is wrong with it, if anything
    if len(p.parts) == 1 and not p.suffix:  # a name
        return str(bundled.find(given))
    shipped = bundled.recipes().get(p.stem)
    if shipped and (len(p.parts) == 1 or p.parent.name == "recipes"):
        _log(f"note: no {given} here: running minitrain's own {p.stem} ({shipped})")
        return str(shipped)
    return given


def _on_cpu(config: Any) -> bool:
    device = str(getattr(config, "device", "auto"))
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device == "cpu"


def _log(line: str) -> None:
    if _rank() == 0:
        print(line, flush=True)


def _rank() -> int:
    """This process's rank under torchrun (which sets RANK and LOCAL_RANK), else 0."""
    return int(os.environ.get("RANK", "0")) if "LOCAL_RANK" in os.environ else 0


def _resume_command(argv: list[str]) -> str:
    """The command line that continues this run: the same settings plus resume=true."""
    args = [a for a in argv if not a.startswith(("resume=", "overwrite="))]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launch = f"torchrun --nproc_per_node {world} -m minitrain" if world > 1 else "python -m minitrain"
    return f"{launch} {shlex.join(args)} resume=true"


def _line_buffered() -> None:
    """Flush each log line as it is printed (logs show up live under nohup, clusters, pipes)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(line_buffering=True)
            except (ValueError, io.UnsupportedOperation):
                pass


# ----------------------------------------------------------------------------- recipe files


def load_recipe(path: str) -> Recipe:
    """Import the recipe file at `path` and check that it defines `config` and `run(config)`."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{path}: is a folder, not a recipe file — {_recipes_in(p)}")
    if not p.is_file():
        raise UserError(f"{path}: no such recipe file — {_recipes_in(p.parent)}")
    if p.suffix != ".py":
        raise UserError(f"{path}: a recipe is a Python file (.py) — {_recipes_in(p.parent)}")
    name = "minitrain_recipe_" + re.sub(r"\W", "_", p.stem)
    spec = importlib.util.spec_from_file_location(name, p)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and type hints in the recipe resolve through it
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(name, None)
        where = f"{path}:{e.lineno}" if e.lineno else path
        raise UserError(f"{where}: does not parse: {e.msg} — fix the recipe") from None
    except ImportError as e:
        sys.modules.pop(name, None)
        moved = _moved_import(p, e)
        if moved:
            raise UserError(moved) from None
        if not isinstance(e, ModuleNotFoundError):
            raise
        raise UserError(f"{path}: cannot import {e.name!r} — install minitrain with `pip install -e .` "
                        f"(or run from the repository root)") from None
    config = getattr(module, "config", None)
    if config is None:
        raise UserError(f"{path}: defines no `config` — add `config = TrainConfig(...)` at the top level")
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise UserError(f"{path}: `config` is a {type(config).__name__}, not a dataclass instance — "
                        f"write `config = TrainConfig(...)` (or an instance of your dataclass)")
    run = getattr(module, "run", None)
    if not callable(run):
        raise UserError(f"{path}: defines no `run(config)` function — add `def run(config): ...`")
    return Recipe(path, module, config, run)


def _moved_import(path: Path, e: ImportError) -> str | None:
    """For a recipe that imports from minitrain's layout before its subpackages (`from minitrain.lora
    import apply_lora`): the one-line error naming the recipe's line and where each name lives now.
    None when the failed import is not of minitrain's own names."""
    if not (e.name or "").startswith("minitrain"):
        return None
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    line = frames[-1].lineno if frames else None
    statements = [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                  if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno == line]
    if not statements:
        return None
    node = statements[0]
    if isinstance(node, ast.Import):
        wanted = [a.name.rpartition(".")[2] for a in node.names if a.name.startswith("minitrain.")]
    elif node.module and node.module.split(".")[0] == "minitrain":
        wanted = [a.name for a in node.names]
    else:
        return None
    homes = _minitrain_names()
    found = {w: homes.get(w, []) for w in wanted}
    hints = [f"{w} is in {' and '.join(found[w])}" if found[w] else f"minitrain has no {w}" for w in wanted]
    return (f"{path}:{line}: cannot import from {e.name} — minitrain's modules live in subpackages now: "
            f"{'; '.join(hints)} (docs/contracts.md lists the imports a recipe may rely on)")


def _minitrain_names() -> dict[str, list[str]]:
    """Every module of minitrain and every name one defines at its top level -> where (read as text:
    nothing is imported)."""
    root = Path(__file__).resolve().parent
    homes: dict[str, list[str]] = {}
    for f in sorted(root.rglob("*.py")):
        if f.relative_to(root).parts[0] in ("recipes", "demo"):  # what a wheel carries besides the engine
            continue
        parts = ["minitrain", *f.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join(parts)
        homes.setdefault(parts[-1], []).append(module)
        for n in ast.parse(f.read_text(encoding="utf-8")).body:
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                targets = [n.name]
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = [t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                           if isinstance(t, ast.Name)]
            else:
                continue
            for name in targets:
                homes.setdefault(name, []).append(module)
    return homes


# a command that names one of these is a real run: the recipe's `demo` settings do not apply
REAL_RUN_KEYS = ("model", "data", "eval_data")


def resolve_config(recipe: Recipe, args: list[str]) -> tuple[Any, dict[str, Any]]:
    """(the run's config, the demo settings it took or {}): the recipe's `config`, its `demo`
    settings when neither the run file nor the command names one of `REAL_RUN_KEYS`, then the run
    file's keys (`config=run.yaml`), then the command's `key=value`s."""
    files = [a for a in args if a.partition("=")[0].strip() == RUN_FILE_KEY]
    args = [a for a in args if a not in files]
    if len(files) > 1:
        raise UserError(f"{RUN_FILE_KEY}: given {len(files)} times — pass one run file (keys on the command line "
                        f"override it)")
    from_file = read_run_file(files[0].partition("=")[2], recipe.config, recipe.path) if files else {}
    demo = getattr(recipe.module, "demo", None) or {}
    named = {a.partition("=")[0].strip() for a in args} | set(from_file)
    if named & set(REAL_RUN_KEYS):
        demo = {}
    base = dataclasses.replace(copy.deepcopy(recipe.config), **demo) if demo else recipe.config
    given = {a.partition("=")[0].strip() for a in args}
    base = dataclasses.replace(base, **{k: v for k, v in from_file.items() if k not in given})
    config = apply_overrides(base, args, where=recipe.path)
    model = getattr(config, "model", None)
    if isinstance(model, str) and model.endswith("config.json") and Path(model).is_file():  # .../config.json: its folder
        config = dataclasses.replace(config, model=str(Path(model).parent))
    elif model == "demo" and not (Path(model) / "config.json").is_file():  # the built-in demo model
        config = dataclasses.replace(config, model=str(bundled.demo_dir() / "model"))
    return config, demo


# ----------------------------------------------------------------------------- before the heavy imports

# modules a recipe's config may come from that import no torch: `early_check` runs only these imports
LIGHT_MODULES = ("__future__", "dataclasses", "typing", "pathlib", "functools", "json", "re", "shlex",
                 "minitrain.config", "minitrain.objectives.configs", "minitrain.errors", "minitrain.bundled")


def early_check(path: str, args: list[str]) -> None:
    """Check the command's keys and values (and the run file's), then the files and folders they name,
    against the recipe's config read without the recipe's heavy imports: its imports from
    `LIGHT_MODULES`, its classes, functions and assignments only. A recipe whose config needs more
    (a config class from a module that imports torch) is checked after its full import instead."""
    module = _light_module(path)
    if module is None:
        return
    try:
        config, _ = resolve_config(Recipe(path, module, module.config, lambda c: None), args)
        validate(config)
        check_paths(config)
    except UserError:
        raise
    except Exception:  # noqa: BLE001 -- what the light read lacks: the full import checks the same again
        return
    finally:
        sys.modules.pop(module.__name__, None)


def _light_module(path: str) -> ModuleType | None:
    p = Path(path)
    try:
        tree = ast.parse(p.read_text(encoding="utf-8"), str(p))
    except (OSError, SyntaxError, ValueError):
        return None  # load_recipe says what is wrong with it
    module = ModuleType("minitrain_recipe_early_" + re.sub(r"\W", "_", p.stem), ast.get_docstring(tree))
    module.__file__ = str(p)
    sys.modules[module.__name__] = module  # the config dataclass's string annotations resolve through it
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            keep = node.level == 0 and node.module in LIGHT_MODULES
        elif isinstance(node, ast.Import):
            keep = all(a.name in LIGHT_MODULES for a in node.names)
        else:
            keep = isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.Assign, ast.AnnAssign))
        if keep:
            try:
                exec(compile(ast.Module(body=[node], type_ignores=[]), str(p), "exec"), module.__dict__)  # noqa: S102
            except Exception:  # noqa: BLE001 -- a name from a heavy import: whatever needs it is not read early
                pass
    config = getattr(module, "config", None)
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        sys.modules.pop(module.__name__, None)
        return None
    return module


# ----------------------------------------------------------------------------- run files

RUN_FILE_KEY = "config"


def read_run_file(path: str, config: Any, where: str) -> dict[str, Any]:
    """The keys of run file `path` (YAML or JSON: a mapping of the recipe's keys), each typed as the
    field it names; UserError naming the file and line of a bad one."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{RUN_FILE_KEY}={path}: no such run file — write one with: minitrain config "
                        f"{where} > run.yaml")
    text = p.read_text(encoding="utf-8")
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise UserError(f"{RUN_FILE_KEY}={path}: reading YAML needs PyYAML — pip install 'minitrain[yaml]', "
                            f"or write the run file as JSON (run.json)") from None
        try:
            root = yaml.compose(text)
            values = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            raise UserError(f"{path}:{mark.line + 1 if mark else 1}: not YAML ({getattr(e, 'problem', e)}) — "
                            f"fix the file") from None
        lines = {k.value: k.start_mark.line + 1 for k, _ in root.value} if isinstance(root, yaml.MappingNode) else {}
    elif p.suffix == ".json":
        try:
            values = json.loads(text)
        except ValueError as e:
            raise UserError(f"{path}:{getattr(e, 'lineno', 1)}: not JSON ({getattr(e, 'msg', e)}) — fix the file") \
                from None
        lines = {k: text[:m.start()].count("\n") + 1 for k in (values if isinstance(values, dict) else {})
                 for m in [re.search(rf'"{re.escape(k)}"\s*:', text)] if m}
    else:
        raise UserError(f"{RUN_FILE_KEY}={path}: a run file is YAML (.yaml, .yml) or JSON (.json)")
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise UserError(f"{path}: holds a {type(values).__name__}, not key: value lines — e.g. lr: 2e-4")
    types_ = field_types(type(config))
    out: dict[str, Any] = {}
    for key, value in values.items():
        at = f"{path}:{lines.get(key, 1)}"
        key = str(key)
        if key not in types_:
            raise UserError(f"{at}: unknown key {_quoted(key)} for {where} — {_did_you_mean(key, str(value), types_)}"
                            f"valid keys: {', '.join(types_)}")
        out[key] = _file_value(value, types_[key], config, key, at)
    return out


def _file_value(value: Any, tp: Any, config: Any, key: str, at: str) -> Any:
    """A run file's value as field type `tp`: text parsed as on the command line, numbers and lists
    taken as they are (an int where a float goes widened)."""
    try:
        if isinstance(value, str):
            return parse_value(value, tp)
        if unwrap_optional(tp)[0] is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if unwrap_optional(tp)[0] in (tuple,) or typing.get_origin(unwrap_optional(tp)[0]) is tuple:
            value = tuple(value) if isinstance(value, list) else value
        if not conforms(value, tp) and isinstance(value, (int, float)):  # `weights: 1` as `weights=1`: [1.0]
            return parse_value(format_value(value), tp)
        if not conforms(value, tp):
            raise _Bad(type_name(tp))
        return value
    except _Bad as e:
        raise UserError(f"{at}: {key}: expected {e} — e.g. {key}: {_example(config, key)}") from None


def _config_template(args: list[str]) -> int:
    """`minitrain config RECIPE`: every key of the recipe with its value, its help as a comment above it
    (YAML; each value written as JSON, which YAML reads)."""
    if len(args) != 1 or args[0].startswith("-"):
        raise UserError("usage: minitrain config RECIPE > run.yaml — writes every key of the recipe with its "
                        "default; run it with: minitrain RECIPE config=run.yaml [key=value ...]")
    recipe = load_recipe(recipe_path(args[0]))
    print(f"# run file for {recipe.path}: minitrain {recipe.path} config=run.yaml [key=value ...]")
    print("# (keys given on the command line override these; delete the keys you keep at their default)")
    for f in dataclasses.fields(recipe.config):
        text = f.metadata.get("help", "")
        limits = _limits(f)
        text = f"{text} [{limits}]" if limits and text else text or (f"[{limits}]" if limits else "")
        for line in textwrap.wrap(text, width=96):
            print(f"# {line}")
        print(f"{f.name}: {json.dumps(getattr(recipe.config, f.name))}")
    return 0


def _recipes_in(folder: Path) -> str:
    """The recipe files in `folder` (Python files defining `config` and `run`, nothing else), or how
    to name one."""
    found = sorted(f for f in folder.glob("*.py") if not f.name.startswith("_")) if folder.is_dir() else []
    found = [str(f) for f in found if bundled.is_recipe(f)]
    if found:
        return "recipes there: " + ", ".join(found)
    return "give the path of a recipe .py file, or the name of one minitrain ships (`minitrain ls` lists them)"


def recipe_help(recipe: Recipe) -> str:
    """The recipe's docstring and each key: type, current value and help (with its bounds)."""
    lines = [f"usage: python -m minitrain {recipe.path} [key=value ...]", ""]
    docstring = inspect.getdoc(recipe.module)
    if docstring:
        lines += [docstring, ""]
    lines.append(f"keys ({type(recipe.config).__name__}; values as the recipe sets them):")
    types_ = field_types(type(recipe.config))
    for f in dataclasses.fields(recipe.config):
        value = getattr(recipe.config, f.name)
        text = '""' if value == "" else format_value(value)
        lines.append(f"  {f.name}: {type_name(types_[f.name])} = {text}")
        text = f.metadata.get("help", "")
        limits = _limits(f)
        if limits:
            text = f"{text} [{limits}]" if text else f"[{limits}]"
        if text:
            lines += textwrap.wrap(text, width=96, initial_indent=" " * 6, subsequent_indent=" " * 6)
    demo = getattr(recipe.module, "demo", None)
    if demo:
        lines += ["", f"demo settings (used only when the command names none of {', '.join(REAL_RUN_KEYS)}):"]
        lines += textwrap.wrap(" ".join(f"{k}={format_value(v)}" for k, v in demo.items()), width=96,
                               initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)


def _limits(f: dataclasses.Field) -> str:
    parts = []
    if "choices" in f.metadata:
        parts.append("one of " + " | ".join(map(str, f.metadata["choices"])))
    for key, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if key in f.metadata:
            parts.append(f"{sign} {f.metadata[key]}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------- overrides


def apply_overrides(config: Any, args: list[str], where: str = "the recipe") -> Any:
    """A copy of `config` with each `key=value` in `args` applied (typed by the field); UserError on a bad one."""
    types_ = field_types(type(config))
    given: dict[str, str] = {}
    changes: dict[str, Any] = {}
    for arg in args:
        key, value = parse_override(arg, config, types_, where)
        if key in given:
            raise UserError(f"{key}: given twice ({shown(given[key])} and {shown(arg)}) — pass it once")
        given[key] = arg
        changes[key] = value
    return dataclasses.replace(copy.deepcopy(config), **changes)


def parse_override(arg: str, config: Any, types_: dict[str, Any], where: str) -> tuple[str, Any]:
    """`"lr=1e-4"` -> `("lr", 0.0001)`, checked against the fields of `config`."""
    key, eq, text = arg.partition("=")
    key = key.strip()
    if arg.startswith("-"):
        bare = key.lstrip("-").replace("-", "_")
        if bare in types_:
            raise UserError(f"{shown(arg)}: keys take no dashes — write {bare}={shown(text) or '...'}")
        ours = hf_name(bare, text, types_)
        if ours:
            raise UserError(f"{shown(arg)}: keys take no dashes, and {bare} is the Hugging Face name — write {ours}")
        raise UserError(f"{shown(arg)}: unknown option — options are --help and --version; settings are key=value")
    if not eq:
        example = f"{key}={_example(config, key)}" if key in types_ else "lr=1e-4"
        raise UserError(f"{arg!r}: expected key=value (no spaces around =) — e.g. {example}")
    if key not in types_:
        raise UserError(f"unknown key {_quoted(key)} for {where} — {_did_you_mean(key, text, types_)}valid keys: "
                        f"{', '.join(types_)}")
    try:
        return key, parse_value(text, types_[key])
    except _Bad as e:
        raise UserError(f"{key}={shown(text)}: expected {e} — e.g. {key}={_example(config, key)}") from None


# Hugging Face names people arrive with (transformers TrainingArguments, PEFT LoraConfig, TRL,
# from_pretrained flags) -> ours; a value in the pair is the setting that means the same
HF_NAMES: dict[str, tuple[str, str | None]] = {
    "learning_rate": ("lr", None),
    "per_device_train_batch_size": ("batch_size", None),
    "train_batch_size": ("batch_size", None),
    "gradient_accumulation_steps": ("grad_accum", None),
    "num_train_epochs": ("epochs", None),
    "warmup_ratio": ("warmup", None),  # warmup < 1 is a ratio of the optimizer steps
    "warmup_steps": ("warmup", None),  # warmup >= 1 is a step count
    "lr_scheduler_type": ("schedule", None),
    "max_seq_length": ("max_len", None),
    "max_length": ("max_len", None),
    "model_max_length": ("max_len", None),
    "output_dir": ("out", None),
    "model_name_or_path": ("model", None),
    "pretrained_model_name_or_path": ("model", None),
    "train_file": ("data", None),
    "dataset": ("data", None),
    "validation_file": ("eval_data", None),
    "eval_dataset": ("eval_data", None),
    "logging_steps": ("log_every", None),
    "eval_steps": ("eval_every", None),
    "save_steps": ("save_every", None),
    "gradient_checkpointing": ("checkpointing", None),
    "resume_from_checkpoint": ("resume", "true"),
    "overwrite_output_dir": ("overwrite", None),
    "bf16": ("precision", "bf16"),
    "fp16": ("precision", "fp16"),
    "load_in_4bit": ("quantize", "nf4"),
    "load_in_8bit": ("quantize", "int8"),
    "r": ("lora_r", None),
    "rank": ("lora_r", None),
    "alpha": ("lora_alpha", None),
    "dropout": ("lora_dropout", None),
    "target_modules": ("lora_targets", None),
    "use_rslora": ("rslora", None),
    "teacher_model": ("teacher", None),
    "teacher_model_name_or_path": ("teacher", None),
}


def _did_you_mean(key: str, text: str, types_: dict[str, Any]) -> str:
    """`did you mean lr=2e-4? (...)` for a Hugging Face name we know (also misspelt) where this recipe has
    the key, else the closest key by spelling, else ""."""
    hf = key.lower().lstrip("-").replace("-", "_")
    if hf not in HF_NAMES:
        close = difflib.get_close_matches(hf, list(HF_NAMES), n=1, cutoff=0.85)
        hf = close[0] if close else hf
    ours = hf_name(hf, text, types_)
    if ours:
        return f"did you mean {ours}? ({hf} is the Hugging Face name); "
    close = difflib.get_close_matches(key, list(types_), n=1)
    return f"did you mean '{close[0]}'? " if close else ""


def hf_name(key: str, text: str, types_: dict[str, Any]) -> str | None:
    """`learning_rate`, "2e-4" -> `lr=2e-4` where this recipe has `lr`; None for a name we do not map."""
    ours, value = HF_NAMES.get(key.lower().lstrip("-").replace("-", "_"), (None, None))
    if ours not in types_:
        return None
    if value is not None and text.strip().lower() in _FALSE:
        value = None  # bf16=false, load_in_4bit=false: the default already
    return f"{ours}={value or shown(text).strip() or '...'}"


def _quoted(key: str) -> str:
    return f"'{key}'" if key.isprintable() else repr(key)


def _example(config: Any, key: str) -> str:
    (f,) = [f for f in dataclasses.fields(config) if f.name == key]
    value = example(f, getattr(config, key))
    if isinstance(value, list) and not value:
        return "a,b"
    if value == "":
        return "..."
    return format_value(value)


class _Bad(ValueError):
    """A value that does not parse as the field's type; the message says what was expected."""


def parse_value(text: str, tp: Any) -> Any:
    """Parse command-line text as field type `tp`; raises `_Bad("a float")` etc. when it does not fit.

    int, float (finite), bool (true/false/1/0/yes/no), str, list / list[T] (comma-separated or a
    JSON list), tuple[T, ...], dict (JSON object), Literal[...], Optional[X] (`none` / `null`), a union
    `X | Y` (the first member, in the order written, that takes the text: `int | bool` reads 1 as an int).
    """
    inner, optional = unwrap_optional(tp)
    s = text.strip()
    if optional and s.lower() in ("none", "null"):
        return None
    if union_members(inner):
        wanted = []
        for member in union_members(inner):
            try:
                return parse_value(text, member)
            except _Bad as e:
                wanted.append(str(e))
        raise _Bad(" or ".join(wanted))
    origin = typing.get_origin(inner)
    if inner is bool:
        if s.lower() in _TRUE:
            return True
        if s.lower() in _FALSE:
            return False
        raise _Bad("true or false")
    if inner is int:
        try:
            return int(s, 10)
        except ValueError:
            raise _Bad("an int") from None
    if inner is float:
        try:
            value = float(s)
        except ValueError:
            raise _Bad("a float") from None
        if not math.isfinite(value):
            raise _Bad("a finite float")
        return value
    if inner is str:
        return text
    if inner in (list, tuple) or origin in (list, tuple):
        return _parse_list(s, inner)
    if inner is dict or origin is dict:
        value = _json(s, "a JSON object")
        if not isinstance(value, dict):
            raise _Bad('a JSON object, e.g. {"k": 1}')
        return value
    if origin is typing.Literal:
        for choice in typing.get_args(inner):
            if s == format_value(choice):
                return choice
        raise _Bad("one of " + " | ".join(format_value(c) for c in typing.get_args(inner)))
    if isinstance(inner, type):  # e.g. pathlib.Path: construct from the text
        try:
            return inner(text)
        except (TypeError, ValueError):
            raise _Bad(f"a {inner.__name__}") from None
    raise TypeError(f"field type {tp!r} cannot be set from the command line")


def _parse_list(s: str, tp: Any) -> Any:
    container = typing.get_origin(tp) or tp
    args = [a for a in typing.get_args(tp) if a is not Ellipsis]
    elem = args[0] if args else None
    what = f"a list of {type_name(elem)}" if elem is not None else "a list"
    as_json = s.startswith("[")
    if as_json and unwrap_optional(elem)[0] is str:
        try:  # `added_tokens=[Question]` is a plain string that merely starts with "["
            json.loads(s)
        except (ValueError, RecursionError):
            as_json = False
    if as_json:
        items = _json(s, f'{what} (a,b or ["a","b"])')
        if not isinstance(items, list):
            raise _Bad(what)
        if elem is not None:
            items = [_json_item(v, elem, what) for v in items]
    else:
        parts = [p.strip() for p in s.split(",") if p.strip()]
        try:
            items = [parse_value(p, elem) if elem is not None else p for p in parts]
        except _Bad:
            raise _Bad(what) from None
    return container(items)


def _json(s: str, what: str) -> Any:
    try:
        return json.loads(s)
    except (ValueError, RecursionError):
        raise _Bad(what) from None


def _json_item(value: Any, elem: Any, what: str) -> Any:
    """A JSON list element checked against the element type (an int widened to a float)."""
    if unwrap_optional(elem)[0] is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not conforms(value, elem) or (isinstance(value, float) and not math.isfinite(value)):
        raise _Bad(what)
    return value
