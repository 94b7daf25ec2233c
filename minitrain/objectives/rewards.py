"""Reward functions: plain Python with TRL's signature, loaded from a file or given by a recipe.

    load_rewards("checks.py:correct,short", recipe_functions) -> [(name, fn), ...]
    load_rewards("model:runs/rm/model", build=models.from_hf_config) -> [("model", ModelReward)]
    score(rewards, prompts, completions, completion_ids, columns, rows) -> (N, F) float tensor, NaN = None

A reward function is `fn(prompts, completions, completion_ids, **columns) -> list[float | None]`:
one value per completion (prompts repeated G times, each completion a string, or an assistant
message list when the prompt was a conversation, as TRL gives them; every other column of the
data row as a keyword list). None means the function does not apply to that completion (TRL's
convention: left out of the weighted sum; a completion no function scores gets advantage 0).

Every mistake in a user's reward is one line (docs/design.md rule 9): a missing file or function,
an exception (the user's `file:line` where it was raised, and the data row), a string (or another
non-list) where a list of values belongs, a wrong number of values, a value that is not a number,
NaN / infinity, or None for every completion of a batch from every function (nothing to learn).
"""

from __future__ import annotations

import importlib.util
import math
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from minitrain.errors import UserError

Reward = Callable[..., Sequence[Any]]


MODEL = "model:"  # rewards=model:DIR: a reward model's folder (recipes/reward_model.py finetune=full)


def load_rewards(spec: str, own: dict[str, Reward] | None = None, build: Callable | None = None,
                 device: str = "auto", precision: str = "auto") -> list[tuple[str, Reward]]:
    """`path/to/file.py:fn[,fn2...]` -> the named functions of that file; a bare `fn[,fn2]` names
    functions of the recipe (`own`); empty: every function of `own`, in order. `model:DIR`: the reward
    model in folder DIR as one function (`minitrain.objectives.reward_model.ModelReward`: batched, no
    graph, on `device` in `precision`'s base dtype; `build` is the recipe's model builder), named by the
    folder; its folder is checked now, its weights load at the first call."""
    own = own or {}
    if spec.startswith(MODEL):
        from minitrain.objectives.reward_model import ModelReward

        if build is None:
            raise UserError(f"rewards={spec}: this recipe passes no model builder to load_rewards — use "
                            f"recipes/grpo_qwen.py, or pass build=models.from_hf_config in your recipe")
        reward = ModelReward(spec[len(MODEL):], build, device=device, precision=precision)
        return [(reward.folder.name, reward)]
    if not spec:
        if not own:
            raise UserError("rewards: not set — pass rewards=path/to/file.py:fn (a function "
                            "fn(prompts, completions, **columns) -> list of floats)")
        return list(own.items())
    path, sep, names = spec.rpartition(":")
    if not sep:  # no file: names of the recipe's own functions
        path, names = "", spec
    names_list = [n.strip() for n in names.split(",") if n.strip()]
    if not names_list:
        raise UserError(f"rewards={spec}: no function named — write rewards=file.py:fn[,fn2]")
    if not path:
        missing = [n for n in names_list if n not in own]
        if missing:
            have = ", ".join(own) or "none"
            raise UserError(f"rewards={spec}: the recipe defines no reward function {missing[0]!r} (it has: {have}) "
                            f"— name a file: rewards=path/to/file.py:{missing[0]}")
        return [(n, own[n]) for n in names_list]
    module = _import_file(Path(path))
    out = []
    for n in names_list:
        fn = getattr(module, n, None)
        if fn is None:
            have = ", ".join(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                             and getattr(v, "__module__", None) == module.__name__) or "none"
            raise UserError(f"{path}: defines no function {n!r} (functions there: {have}) — fix rewards=")
        if not callable(fn):
            raise UserError(f"{path}: {n} is a {type(fn).__name__}, not a function — fix rewards=")
        out.append((n, fn))
    return out


def _import_file(path: Path, key: str = "rewards") -> Any:
    """The Python file named by the key `key` (rewards=, tools=, environment=), as a module."""
    if not path.is_file():
        raise UserError(f"{key}: {path}: no such file — check the path in {key}=file.py:name")
    name = f"minitrain_{key}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"{key}: {path}: cannot be imported as Python — give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise UserError(f"{path}:{e.lineno}: syntax error in the {key} file: {e.msg} — fix it") from None
    except Exception as e:  # the user's import-time error, at the user's line
        raise UserError(f"{_user_line(e, path)}: {type(e).__name__}: {e} (importing the {key} file) "
                        f"— fix it") from None
    return module


def _user_line(e: BaseException, path: Path | str | None) -> str:
    """`file:line` of the deepest frame of `e`'s traceback in the user's file (else the deepest frame)."""
    frames = traceback.extract_tb(e.__traceback__)
    if path is not None:
        mine = [f for f in frames if Path(f.filename).resolve() == Path(path).resolve()]
        frames = mine or frames
    f = frames[-1] if frames else None
    return f"{f.filename}:{f.lineno}" if f else str(path)


def score(rewards: list[tuple[str, Reward]], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], rows: list[str]) -> torch.Tensor:
    """(N, F) fp32: reward function f's value for completion n, NaN where it returned None.

    `rows[n]`: where completion n's prompt came from (`data.jsonl:17`), for the error lines."""
    N = len(completions)
    out = torch.full((N, len(rewards)), float("nan"))
    for j, (name, fn) in enumerate(rewards):
        where = _source(fn)
        try:
            values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:
            row = _failing_row(fn, prompts, completions, completion_ids, columns)
            at = f" on the completion of {rows[row]}" if row is not None else ""
            raise UserError(f"{_user_line(e, _file(fn))}: reward {name} raised {type(e).__name__}: {e}{at} — fix the "
                            f"function (or return None for rows it does not apply to)") from None
        if isinstance(values, (str, bytes, dict)):  # (list() of these would count characters or keys)
            raise UserError(f"{where}: reward {name} returned a {type(values).__name__}, not a list — return one "
                            f"float (or None) per completion")
        try:
            values = list(values)
        except TypeError:
            raise UserError(f"{where}: reward {name} returned {type(values).__name__}, not a list — return one "
                            f"float (or None) per completion") from None
        if len(values) != N:
            raise UserError(f"{where}: reward {name} returned {len(values)} values for {N} completions — return "
                            f"one float (or None) per completion")
        for n, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) and not (
                    isinstance(v, torch.Tensor) and v.numel() == 1):
                raise UserError(f"{where}: reward {name} returned {type(v).__name__} {v!r} for the completion of "
                                f"{rows[n]} — return a float (or None)")
            v = float(v)
            if not math.isfinite(v):
                raise UserError(f"{where}: reward {name} returned {v} for the completion of {rows[n]} — return a "
                                f"finite float (or None where it does not apply)")
            out[n, j] = v
    if N and out.isnan().all():  # nothing scored: every advantage 0, a step that learns nothing
        names = ", ".join(name for name, _ in rewards)
        raise UserError(f"rewards: {names} returned None for all {N} completions of the batch of {rows[0]}"
                        f"{' ...' if len(set(rows)) > 1 else ''} — nothing to learn from; return a float for the "
                        f"completions a reward applies to (None only where it does not)")
    return out


def _file(fn: Reward) -> str | None:
    code = getattr(fn, "__code__", None)
    return code.co_filename if code else None


def _source(fn: Reward) -> str:
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else repr(fn)


def _failing_row(fn: Reward, prompts: list, completions: list, completion_ids: list, columns: dict) -> int | None:
    """The first completion on which `fn` alone raises (to name the data row), or None."""
    for n in range(len(completions)):
        try:
            fn(prompts=prompts[n : n + 1], completions=completions[n : n + 1],
               completion_ids=completion_ids[n : n + 1], **{k: v[n : n + 1] for k, v in columns.items()})
        except Exception:
            return n
    return None
