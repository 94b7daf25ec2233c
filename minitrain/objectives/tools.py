"""Tools in the rollout: Python functions the model calls while it generates (TRL's GRPOTrainer `tools=`).

    load_tools("calc.py:add,mul", recipe_functions) -> [(name, fn), ...]
    json_schema(fn)                  -> the function's JSON schema (transformers' `get_json_schema`)
    ToolKit(tok, tools, ...).run(prompts, completions, toolsets, generate) -> Turns

Each function is offered to the model through the checkpoint's chat template (`tools=` of the
template, a schema built from the signature and the Google-style docstring as transformers builds
it). A completion's tool calls are parsed in the format its chat template renders them (`tool_format`:
Qwen / Hermes `<tool_call>{json}</tool_call>`, LLaMA 3's bare `{"name", "parameters"}` JSON,
Mistral's `[TOOL_CALLS]`, gpt-oss's harmony `to=functions.NAME ... <|message|>{json}<|call|>`), run,
and their results appended as tool messages; generation then resumes after them, up to
`max_tool_calls` rounds. TRL's contract, step for step (`GRPOTrainer._tool_call_loop`): the ids of a
tool turn are the template's rendering of the tool messages after a dummy assistant call, cut after
the last eos (`suffix_ids`); a round whose tool turn would push the completion past
`max_completion_length` (or the model's context) is dropped and the completion ends as it is; the
text generated after a tool turn is cut to the completion's budget. `tool_mask` is 0 on the tool
turns' tokens: they are context, never trained, and not counted in the length metrics.

The model's output is untrusted input. A call names one of the functions the user offered and
nothing else, and its arguments are parsed as JSON and passed as keyword arguments: nothing is
evaluated. A call to an unknown name, arguments that are not a JSON object or do not fit the
signature, a function that raises, returns something `str()` cannot print, or runs past
`tool_timeout` seconds (stopped by SIGALRM in the main thread: pure Python and sleeps stop at once,
a long C call when it returns) all become a tool message `{'error': '...'}` (TRL's text) and count
as failures (`tools/failure_frequency`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import signal
import threading
import types
import typing
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence, Union

from minitrain.errors import UserError
from minitrain.objectives.rewards import _import_file

Tool = Callable[..., Any]


# ----------------------------------------------------------------------------- loading


def load_tools(spec: str, own: dict[str, Tool] | None = None) -> list[tuple[str, Tool]]:
    """`path/to/file.py:fn[,fn2...]` -> the named functions of that file; a bare `fn[,fn2]` names the
    recipe's own (`own`); empty: none. Each must have a schema (`json_schema`), checked here."""
    own = own or {}
    if not spec:
        return []
    path, sep, names = spec.rpartition(":")
    if not sep:
        path, names = "", spec
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if not wanted:
        raise UserError(f"tools={spec}: no function named — write tools=file.py:fn[,fn2]")
    if path:
        module = _import_file(Path(path), "tools")
        found = {k: v for k, v in vars(module).items() if not k.startswith("_")}
        where, have = path, [k for k, v in found.items() if inspect.isfunction(v) and v.__module__ == module.__name__]
    else:
        found, where, have = own, "the recipe", list(own)
    out = []
    for n in wanted:
        if n not in found:
            raise UserError(f"tools={spec}: {where} defines no function {n!r} (functions there: "
                            f"{', '.join(have) or 'none'}) — fix tools=")
        fn = found[n]
        if not callable(fn) or isinstance(fn, type):
            raise UserError(f"tools={spec}: {n} in {where} is not a function (its type: {type(fn).__name__}) — "
                            f"name a function (an environment class goes in environment=file.py:Class)")
        json_schema(fn, key="tools")  # a function the template cannot describe fails now, not mid-run
        out.append((n, fn))
    if len({n for n, _ in out}) != len(out):
        raise UserError(f"tools={spec}: a function is named twice — name each once")
    return out


# ----------------------------------------------------------------------------- schemas (transformers' rules)

_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG = re.compile(r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*"
                  r"(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)", re.DOTALL)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_PLAIN = {**{t: {"type": n} for t, n in _SCALARS.items()}, list: {"type": "array"}, tuple: {"type": "array"},
          dict: {"type": "object"}, Any: {}}


class _Unsupported(Exception):
    pass


def _enum(values: list) -> dict:
    kinds = list(dict.fromkeys(_SCALARS.get(type(v)) for v in values))
    if None in kinds:
        raise _Unsupported(f"enum values {values!r} are not JSON scalars")
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _type_schema(hint: Any) -> dict:
    """The JSON schema of one type hint (transformers' `_parse_type_hint`)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, Enum):
            return _enum([m.value for m in hint])
        if hint in _PLAIN:
            return dict(_PLAIN[hint])
        raise _Unsupported(f"type {hint!r} has no JSON schema (use int, float, str, bool, list, dict, Literal, Enum)")
    if origin is Union or origin is types.UnionType:
        subs = [_type_schema(t) for t in args if t is not type(None)]
        if len(subs) == 1:
            out = subs[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subs):
            names = sorted({s["type"] for s in subs})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subs}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal and args:
        return _enum(list(args))
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise _Unsupported(f"{hint} is not a fixed tuple of several types (use list[...])")
        return {"type": "array", "prefixItems": [_type_schema(t) for t in args]}
    if origin is dict:
        return {"type": "object", **({"additionalProperties": _type_schema(args[1])} if len(args) == 2 else {})}
    raise _Unsupported(f"type {hint!r} has no JSON schema")


def json_schema(fn: Tool, key: str = "tools") -> dict:
    """`{"type": "function", "function": {name, description, parameters[, return]}}` from `fn`'s type
    hints and Google-style docstring (an `Args:` line per argument; `(choices: [...])` at the end of one
    becomes an enum), equal to `transformers.utils.get_json_schema(fn)`. A function it cannot describe
    (no docstring, an argument without a hint or a description, a hint with no JSON type) is a UserError."""
    name = getattr(fn, "__name__", "operation")
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
    where = f"{code.co_filename}:{code.co_firstlineno}: " if code else ""

    def refuse(what: str) -> UserError:
        return UserError(f"{where}{key}: {name} {what} — the model is shown each tool's schema, built from its type "
                         f"hints and its docstring (a description, then Args: with one 'name: description' line each)")

    doc = inspect.getdoc(fn)
    if not doc:
        raise refuse("has no docstring")
    doc = doc.strip()
    m = _DESCRIPTION.search(doc)
    description = m.group(1).strip() if m else None
    m = _ARGS.search(doc)
    arg_docs = {}
    if m:
        block = "\n".join(line for line in m.group(1).split("\n") if line.strip())
        arg_docs = {a[1]: re.sub(r"\s*\n+\s*", " ", a[2].strip()) for a in _ARG.findall(block)}
    m = _RETURNS.search(doc)
    returns = m.group(1).strip() if m else None
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty:
        params = params[1:]
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise refuse(f"has type hints that do not resolve ({e})") from None
    required = []
    for p in params:
        if p.annotation is inspect.Parameter.empty:
            raise refuse(f"argument {p.name!r} has no type hint")
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    properties: dict[str, dict] = {}
    ret = None
    for arg, hint in hints.items():
        if arg in ("self", "cls") and arg not in [p.name for p in params]:
            continue
        if arg == "return":
            try:
                ret = _type_schema(hint)
            except _Unsupported:
                pass
            continue
        try:
            properties[arg] = _type_schema(hint)
        except _Unsupported as e:
            raise refuse(f"argument {arg!r}: {e}") from None
    for arg, schema in properties.items():
        if arg not in arg_docs:
            raise refuse(f"argument {arg!r} has no description in the docstring's Args:")
        desc = arg_docs[arg]
        choices = re.search(r"\(choices:\s*(.*?)\)\s*$", desc, flags=re.IGNORECASE)
        if choices:
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            desc = choices.string[: choices.start()].strip()
        schema["description"] = desc
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if ret is not None:
        if returns is not None:
            ret["description"] = returns
        out["return"] = ret
    return {"type": "function", "function": out}


# ----------------------------------------------------------------------------- parsing calls


@dataclass
class Call:
    """One tool call parsed from the model's text: a name and its arguments, or why it could not be read."""

    name: str
    arguments: Any = None
    error: str | None = None


# the special tokens that end an assistant's turn on a tool call in a format (sampling stops there too)
CALL_ENDS = {"harmony": ("<|call|>",), "llama3": ("<|eom_id|>",)}


def tool_format(template: str | None) -> str | None:
    """How the chat template writes an assistant's tool calls (from the template's text), or None."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "to=functions." in template or "<|call|>" in template:
        return "harmony"
    if '"parameters"' in template or "<|python_tag|>" in template:
        return "llama3"
    return None


def _json_call(text: str, args_key: str = "arguments") -> Call:
    """`{"name": ..., "arguments": {...}}` -> Call (an error Call when it is not such JSON)."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        return Call("unknown", error=f"the tool call is not valid JSON ({e})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call("unknown", error='the tool call is not a JSON object with a "name"')
    args = obj.get(args_key, obj.get("arguments", {}))
    return Call(obj["name"], args)


def _json_args(name: str, text: str) -> Call:
    try:
        return Call(name, json.loads(text) if text.strip() else {})
    except ValueError as e:
        return Call(name, error=f"the arguments of {name} are not valid JSON ({e})")


def parse_calls(text: str, fmt: str) -> list[Call]:
    """The tool calls in one assistant turn (decoded with its special tokens), in order."""
    if fmt == "hermes":
        return [_json_call(body) for body in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL)]
    if fmt == "llama3":
        body = re.sub(r"(<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>)+\s*$", "", text).strip()
        body = body.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return []
        if not re.match(r'^\{\s*"name"\s*:', body):
            return []  # JSON-looking prose, not a call
        return [_json_call(body, "parameters")]
    if fmt == "mistral":
        calls: list[Call] = []
        for part in text.split("[TOOL_CALLS]")[1:]:
            part = re.sub(r"</s>\s*$", "", part).strip()
            if "[ARGS]" in part:  # v11+: name[ARGS]{json}
                name, _, args = part.partition("[ARGS]")
                calls.append(_json_args(name.strip(), args))
                continue
            try:
                items = json.loads(part)
            except ValueError as e:
                calls.append(Call("unknown", error=f"the tool calls are not valid JSON ({e})"))
                continue
            for item in items if isinstance(items, list) else [items]:
                calls.append(_json_call(json.dumps(item)) if isinstance(item, dict)
                             else Call("unknown", error="a tool call is not a JSON object"))
        return calls
    if fmt == "harmony":
        pattern = r"to=functions\.([^\s<]+)[^\n]*?<\|message\|>(.*?)<\|call\|>"
        return [_json_args(name, body) for name, body in re.findall(pattern, text, re.DOTALL)]
    raise ValueError(f"parse_calls: unknown format {fmt!r}")


# ----------------------------------------------------------------------------- running calls


class ToolTimeout(BaseException):
    """Raised inside a tool that ran past its time (a BaseException: the tool's own `except Exception`
    does not swallow it)."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Stop the code in the block after `seconds` (SIGALRM; the main thread only, elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def stop(signum, frame):
        raise ToolTimeout()

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_call(call: Call, tools: dict[str, Tool], timeout: float) -> tuple[str, str, bool]:
    """(name, content, failed) of one call: the tool's result as text, or `{'error': ...}` (TRL's form)."""
    def error(msg: str) -> tuple[str, str, bool]:
        return call.name, str({"error": msg}), True

    if call.error is not None:
        return error(call.error)
    fn = tools.get(call.name)
    if fn is None:
        return error(f"Tool {call.name} not found.")
    if not isinstance(call.arguments, dict):
        return error(f"the arguments of {call.name} must be a JSON object, got {type(call.arguments).__name__}")
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
        return error(f"wrong arguments for {call.name}: {e}")
    try:
        with deadline(timeout):
            result = fn(**call.arguments)
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
    except ToolTimeout:
        return error(f"Tool {call.name} ran past {timeout:g} s and was stopped.")
    except (Exception, SystemExit) as e:
        return error(str(e))
    try:
        return call.name, str(result), False
    except Exception as e:
        return error(f"Tool {call.name} returned a {type(result).__name__} that cannot be printed: {e}")


async def _awaited(x: Any) -> Any:
    return await x


# ----------------------------------------------------------------------------- the rollout's tool loop


@dataclass
class Turns:
    """Each row's completion after its tool rounds: ids (the model's tokens and the tool turns'),
    tool_mask (0 on the tool turns' tokens), the calls made and those that failed, and each row's tool
    messages, a list per round."""

    ids: list[list[int]]
    tool_mask: list[list[int]]
    calls: int = 0
    failures: int = 0
    messages: list[list[dict]] = field(default_factory=list)


class ToolKit:
    """The tools offered to the model and how its calls are read and answered.

    tok: the run's tokenizer (its chat template renders the tool turns); tools: [(name, fn)] offered
    to every rollout (an environment's methods are added per rollout by `run`'s `toolsets`); parse:
    False when no tool is offered at all (an environment with no public method): nothing is parsed."""

    def __init__(self, tok: Any, tools: Sequence[tuple[str, Tool]], *, max_rounds: int, timeout: float,
                 max_completion_length: int, max_positions: int | None = None, schemas: list[dict] | None = None,
                 parse: bool = True):
        self.tok, self.tools = tok, dict(tools)
        self.max_rounds, self.timeout = max_rounds, timeout
        self.max_completion_length, self.max_positions = max_completion_length, max_positions
        self.schemas = schemas if schemas is not None else [json_schema(fn) for _, fn in tools]
        template = getattr(tok, "chat_template", None) if getattr(tok, "chat_format", None) is None else None
        self.format = tool_format(template) if parse else None
        if parse and self.format is None:
            raise UserError(f"tools: the chat template of {getattr(tok, 'source', 'the tokenizer')} "
                            + ("is not set (chat_format=" + str(tok.chat_format) + " renders no tools)"
                               if template is None else "renders no tool calls minitrain can read (Qwen <tool_call>, "
                                                        "LLaMA 3 JSON, Mistral [TOOL_CALLS], harmony)")
                            + " — give the template the model was trained with tools: "
                              "chat_template=path/to/template.jinja")
        self._prefix: dict[str, list[int]] = {}

    def stop_ids(self) -> list[int]:
        """Ids that end a turn on a tool call in this format (gpt-oss's `<|call|>`, LLaMA 3's `<|eom_id|>`),
        which the vocabulary holds: the sampler stops there as at eos."""
        found = (self.tok.special_id(t) for t in CALL_ENDS.get(self.format or "", ()))
        return [i for i in found if i is not None]

    def suffix_ids(self, messages: list[dict]) -> list[int]:
        """The ids of a tool turn: the template's rendering of `messages` (role tool) and the next
        generation prompt, as they follow an assistant turn that called a tool (TRL's `_get_tool_suffix_ids`:
        a dummy conversation rendered with and without them, the shorter cut after its last eos)."""
        tok, template = self.tok, self.tok.template()
        name = messages[0]["name"]
        dummy = [{"role": "user", "content": "dummy"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}]
        if name not in self._prefix:
            prefix = tok.encode(template.render(dummy)[0])
            ends = [i for i, t in enumerate(prefix) if t == tok.eos_id]
            self._prefix[name] = prefix[: ends[-1] + 1] if ends else prefix
        prefix = self._prefix[name]
        full = tok.encode(template.render(dummy + messages, add_generation_prompt=True)[0])
        if full[: len(prefix)] == prefix:
            return full[len(prefix):]
        # a template that writes the last assistant turn otherwise than an earlier one (Qwen3's empty
        # <think> block on the last turn only; TRL swaps in a training template for it): the tool turn
        # starts after the assistant turn's eos, the same count of eos tokens into the full rendering
        k = prefix.count(tok.eos_id) if tok.eos_id is not None else 0
        ends = [i for i, t in enumerate(full) if t == tok.eos_id]
        if not k or len(ends) < k:
            raise UserError(f"tools: the chat template renders a tool turn that changes the text before it — give a "
                            f"template that renders each turn after the previous ones (chat_template=...)")
        return full[ends[k - 1] + 1:]

    def calls_in(self, ids: list[int]) -> list[Call]:
        if not ids or self.format is None:  # (no tool offered at all: nothing to parse)
            return []
        return parse_calls(self.tok.decode(ids, skip_special=False), self.format)

    def run(self, prompts: list[list[int]], completions: list[list[int]],
            generate: Callable[[list[list[int]], list[int]], list[list[int]]],
            toolsets: list[dict[str, Tool]] | None = None) -> Turns:
        """Answer the calls of each completion and let the model go on, round after round (TRL's loop).

        prompts / completions: each row's ids (completion: up to and including its eos); generate(rows'
        ids, budgets) -> each row's continuation of at most its budget of new tokens (stopping at eos);
        toolsets: each row's tools by name (default: the kit's)."""
        ids = [list(c) for c in completions]
        mask = [[1] * len(c) for c in ids]
        tools = toolsets or [self.tools] * len(ids)
        out = Turns(ids, mask, messages=[[] for _ in ids])
        pending = {i: calls for i, c in enumerate(ids) if (calls := self.calls_in(c))}
        for _ in range(self.max_rounds):
            if not pending:
                break
            rows, contexts, budgets, suffixes = [], [], [], []
            for i, calls in pending.items():
                messages = []
                for call in calls:
                    name, content, failed = run_call(call, tools[i], self.timeout)
                    out.calls += 1
                    out.failures += failed
                    messages.append({"role": "tool", "name": name, "content": content})
                suffix = self.suffix_ids(messages)
                grown = len(ids[i]) + len(suffix)
                if grown > self.max_completion_length or (
                        self.max_positions and len(prompts[i]) + grown >= self.max_positions):
                    continue  # no room for the tool turn: the completion ends as it is (TRL drops the round)
                out.messages[i].append(messages)
                rows.append(i)
                suffixes.append(suffix)
                contexts.append(prompts[i] + ids[i] + suffix)
                budgets.append(self.max_completion_length - grown)
            if not rows:
                break
            more = generate(contexts, budgets)
            pending = {}
            for i, suffix, new, budget in zip(rows, suffixes, more, budgets):
                new = list(new)[:budget]
                ids[i] += suffix + new
                mask[i] += [0] * len(suffix) + [1] * len(new)
                if calls := self.calls_in(new):
                    pending[i] = calls
        return out
