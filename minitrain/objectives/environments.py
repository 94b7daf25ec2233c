"""Environments in the rollout: TRL's `environment_factory` contract, from `environment=path/file.py:Class`.

    env = Environments(load_environment("game.py:Game"))
    instances = env.draw(n)                   one per rollout, from a pool (constructed once, reset often)
    env.reset(instances, rows)                -> each row's `reset(**row)` text (None: nothing to add)
    env.toolset(instance)                     -> its public methods by name: the rollout's tools
    env.reward                                -> (class name, reward function) when the class has get_reward

A user's TRL environment class runs unchanged: `Class()` takes no argument; `reset(**row)` gets the
data row (its prompt and every other column) and may return text, appended to the prompt's last
message before the chat template renders it; every public method (not `reset`, `get_reward`, nor a
`_name`) is a tool offered to the model, its schema from its signature and docstring
(`minitrain.objectives.tools.json_schema`); `get_reward()`, when defined, scores the finished rollout
from the instance's state and is logged under the class's name (`rewards/<Class>/mean`), weight 1,
beside any `rewards=` functions, which also receive the rollouts' instances as `environments=`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable

from minitrain.errors import UserError
from minitrain.objectives.rewards import _import_file, _user_line
from minitrain.objectives.tools import json_schema

SPECIAL = ("reset", "get_reward")


def load_environment(spec: str) -> type:
    """`path/to/file.py:Class` -> the class (checked: it builds with no argument and has `reset`)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.strip():
        raise UserError(f"environment={spec}: name the file and the class — environment=path/to/file.py:Class")
    module = _import_file(Path(path), "environment")
    cls = getattr(module, name.strip(), None)
    if cls is None:
        have = [k for k, v in vars(module).items()
                if isinstance(v, type) and v.__module__ == module.__name__ and not k.startswith("_")]
        raise UserError(f"environment={spec}: {path} defines no class {name!r} (classes there: "
                        f"{', '.join(have) or 'none'}) — fix environment=")
    if not isinstance(cls, type):
        raise UserError(f"environment={spec}: {name} is a {type(cls).__name__}, not a class — name the environment "
                        f"class (tools go in tools=file.py:fn)")
    if not callable(getattr(cls, "reset", None)):
        raise UserError(f"environment={spec}: {name} has no reset method — define reset(self, **row) (it may return "
                        f"text to append to the prompt, or None), as TRL's environment_factory requires")
    return cls


def tool_methods(cls: type) -> list[str]:
    """The names of the public methods of `cls` that are tools (listed on the class, as TRL lists them)."""
    return [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if n not in SPECIAL and not n.startswith("_")]


class Environments:
    """The instances of one environment class, pooled: `draw(n)` hands out n of them for a batch's rollouts."""

    def __init__(self, cls: type):
        self.cls, self.name = cls, cls.__name__
        self.pool = [self._new()]
        self.methods = tool_methods(cls)
        self.schemas = [json_schema(getattr(self.pool[0], n), key="environment") for n in self.methods]
        self.has_reward = callable(getattr(cls, "get_reward", None))

    def _new(self) -> Any:
        try:
            return self.cls()
        except Exception as e:
            raise UserError(f"{_user_line(e, inspect.getsourcefile(self.cls))}: environment {self.name}() raised "
                            f"{type(e).__name__}: {e} — it must build with no argument (TRL calls the factory "
                            f"so)") from None

    def draw(self, n: int) -> list[Any]:
        while len(self.pool) < n:
            self.pool.append(self._new())
        return self.pool[:n]

    def toolset(self, instance: Any) -> dict[str, Callable]:
        return {n: getattr(instance, n) for n in self.methods}

    def reset(self, instances: list[Any], rows: list[dict]) -> list[str | None]:
        """Each instance's `reset(**row)`: the text to append to its prompt, or None."""
        out = []
        for env, row in zip(instances, rows):
            try:
                text = env.reset(**row)
            except Exception as e:
                raise UserError(f"{_user_line(e, inspect.getsourcefile(self.cls))}: {self.name}.reset raised "
                                f"{type(e).__name__}: {e} — fix it (it gets the row's columns as keywords)") from None
            if text is not None and not isinstance(text, str):
                raise UserError(f"{inspect.getsourcefile(self.cls)}: {self.name}.reset returned a "
                                f"{type(text).__name__} — return the text to append to the prompt, or None")
            out.append(text)
        return out

    def reward(self) -> tuple[str, Callable] | None:
        """(the class name, a reward function of TRL's signature calling each rollout's `get_reward()`)."""
        if not self.has_reward:
            return None
        cls, name, source = self.cls, self.name, inspect.getsourcefile(self.cls)

        def get_reward(environments=None, **_):
            try:
                return [e.get_reward() if type(e) is cls else None for e in environments]
            except Exception as e:
                raise UserError(f"{_user_line(e, source)}: {name}.get_reward raised {type(e).__name__}: {e} — fix it "
                                f"(return a float, or None where it does not apply)") from None

        get_reward.__name__ = name
        return name, get_reward
