"""A checkpoint's own chat template: rendered with jinja2 as transformers renders it, and the
loss mask that follows from it.

Where the template comes from (as transformers reads a model folder): `chat_template.jinja`,
else `chat_template` in tokenizer_config.json (a string, or a list of `{"name", "template"}`
of which "default" is used), plus named templates in `additional_chat_templates/*.jinja`.

Rendering: `jinja2`'s `ImmutableSandboxedEnvironment` (a template is data from the internet:
the sandbox keeps it from reaching Python internals) with `trim_blocks` / `lstrip_blocks`, the
`loopcontrols` extension and the names transformers' `apply_chat_template` provides: `messages`,
`add_generation_prompt`, `tools` / `documents` (None), the special tokens (`bos_token`,
`eos_token`, `unk_token`, `pad_token`, ...), `raise_exception(msg)`, `strftime_now(fmt)`, a
`tojson` filter that leaves non-ASCII alone, `namespace`, and the `{% generation %}` block.
`chat_template_kwargs` (e.g. `{"enable_thinking": false}`) are passed in as variables. The
rendered text is then encoded as one string with no special tokens added, which is what
`apply_chat_template(..., tokenize=True)` does, so the ids are the model's own.

The target mask: the assistant's content and the end-of-turn token the template puts after it
are targets, everything else is not.

- Templates with `{% generation %}` ... `{% endgeneration %}` mark the targets themselves; the
  marked characters are the targets (transformers' `return_assistant_tokens_mask`).
- Otherwise each assistant message `i` starts where the conversation before it, rendered with
  `add_generation_prompt=True`, ends (that text must be a prefix of the whole rendering), and
  ends with the template's end-of-turn token (found once by rendering a probe conversation:
  the first special token after the assistant's text). A template for which either cannot be
  found is refused; the message says what to do instead of guessing.

Characters map to tokens by encoding prefixes of the text: the tokens of `text[:k]` that agree
with the tokens of `text` lie before character `k`; a token that straddles the start of a span
is a target (transformers counts every token overlapping a span).

Caught rather than trained on silently:

- double bos: a rendering that begins with two bos tokens is refused;
- no end token: a template that ends the assistant's turn without any special token would
  teach the model never to stop; eos is appended to each assistant turn as a target, and a
  warning says so once.
"""

from __future__ import annotations

import json
import re
import warnings
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Protocol, Sequence

from minitrain.errors import UserError
from minitrain.text.chat_formats import common_prefix_len


class Vocabulary(Protocol):
    """What a template asks of the tokenizer it renders for. `minitrain.text.tokenizer.Tokenizer` is
    one; it passes itself in (it holds the template), so this module never imports it."""

    source: str  # the folder or file, for messages
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def id_to_token(self, idx: int) -> str | None: ...

    def need_id(self, name: str) -> int: ...

    def special_tokens_map(self) -> dict[str, str]: ...

    def special_strings(self) -> list[str]: ...

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
# names transformers passes to every template; a chat_template_kwargs key may not replace them
RESERVED = ("messages", "add_generation_prompt", "tools", "documents")
_PROBE = "\ue000\ue001"  # private-use characters: assistant content that no template changes
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateRefused(Exception):
    """The template's own `raise_exception(message)`."""


# --------------------------------------------------------------------------- finding the template


def read_templates(folder: Path, config: dict) -> dict[str, str]:
    """Named chat templates of a model folder, as transformers finds them (see the module doc).

    Returns {} when there is none; a malformed entry is a UserError naming the file.
    """
    templates: dict[str, str] = {}
    entry = config.get("chat_template")
    where = folder / "tokenizer_config.json"
    if isinstance(entry, str):
        templates["default"] = entry
    elif isinstance(entry, list):
        for k, item in enumerate(entry):
            if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)):
                raise UserError(f"{where}: chat_template[{k}] is not a {{\"name\", \"template\"}} object — fix or "
                                f"remove the entry")
            templates[item["name"]] = item["template"]
    elif entry is not None:
        raise UserError(f"{where}: chat_template must be a string or a list of named templates — fix or remove it")
    files = [folder / TEMPLATE_FILE] if (folder / TEMPLATE_FILE).is_file() else []
    if (folder / TEMPLATE_DIR).is_dir():
        files += sorted((folder / TEMPLATE_DIR).glob("*.jinja"))
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{f}: cannot read the chat template ({e}) — fix or remove the file") from None
        templates["default" if f.name == TEMPLATE_FILE else f.stem] = text
    return templates


# Templates minitrain carries, for a checkpoint that has none (`chat_template=chatml`): name ->
# (template, the special tokens it writes, which the vocabulary must hold).
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}")
CARRIED = {"chatml": (CHATML, ("<|im_start|>", "<|im_end|>"))}


def carried_fits(name: str, special_id) -> bool:
    """Does the vocabulary (its `special_id(token)`) hold every special token template `name` writes?"""
    return all(special_id(t) is not None for t in CARRIED[name][1])


def resolve_template(value: str, source: str, special_id) -> str:
    """The text of `chat_template=value`: the name of a template minitrain carries (checked against the
    vocabulary of `source`, through its `special_id`), or a template file (.jinja)."""
    if value in CARRIED:
        text, tokens = CARRIED[value]
        missing = [t for t in tokens if special_id(t) is None]
        if missing:
            raise UserError(f"chat_template={value}: {source} has no {' / '.join(missing)} special token — "
                            f"this is not a {value} vocabulary; give the template the model was trained with "
                            f"(chat_template=path/to/template.jinja)")
        return text
    path = Path(value)
    if not path.is_file():
        raise UserError(f"chat_template={value}: no such file, and minitrain carries no template of that name — "
                        f"give a .jinja file, or one of {', '.join(CARRIED)}")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"chat_template={value}: cannot read it ({e}) — give a UTF-8 .jinja file") from None


def has_generation_markers(template: str) -> bool:
    """Whether the template marks its targets with `{% generation %}` blocks."""
    return bool(_GENERATION_TAG.search(template))


# --------------------------------------------------------------------------- the jinja environment


@lru_cache(maxsize=16)
def compile_template(source: str):
    """The template compiled in the sandbox transformers uses (cached per template text)."""
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - a runtime dependency
        raise UserError("chat templates need jinja2 — pip install 'jinja2>=3.1.6'") from None

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: records the character span it renders."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            blocks, spans = self.environment.tracking
            if blocks is not None:
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise TemplateRefused(str(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        def __setitem__(self, name, value):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")
            super().__setitem__(name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.tracking = (None, None)
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=Namespace, dict=lambda *a, **k: dict(*a, **k))
    return env.from_string(source)


# --------------------------------------------------------------------------- rendering


class ChatTemplate:
    """One template with the tokenizer it renders for: `render` (text) and `encode` (ids, mask)."""

    def __init__(self, tok: Vocabulary, source: str, name: str = "default", kwargs: dict | None = None):
        self.tok = tok
        self.source = source
        self.name = name
        self.kwargs = dict(kwargs or {})
        try:
            self.compiled = compile_template(source)
        except UserError:
            raise
        except Exception as e:  # jinja2.TemplateSyntaxError and friends: the file is bad
            line = getattr(e, "lineno", None)
            raise UserError(f"{tok.source}: chat template '{name}' does not parse "
                            f"({type(e).__name__}{f' at line {line}' if line else ''}: {getattr(e, 'message', e)}) — "
                            f"fix the template, or set chat_format") from None
        self.marked = has_generation_markers(source)
        self.variables = tok.special_tokens_map()
        self._end: tuple[str | None] | None = None  # the end-of-turn string, found on first use
        self._end_before_more: tuple[str | None] | None = None  # ... of a turn that more messages follow
        self._warned = False

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False,
               track: bool = False, tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The template's text for `messages`, and (with `track`) the `{% generation %}` spans; `tools`:
        the JSON schemas of the functions offered to the model (transformers' `tools=`)."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        env = self.compiled.environment
        args = {**self.variables, **self.kwargs, "messages": [dict(m) for m in messages],
                "add_generation_prompt": add_generation_prompt, "tools": tools or None, "documents": None}
        env.tracking = (blocks, spans) if track else (None, None)
        try:
            for block in self.compiled.generate(**args):
                blocks.append(block)
        except TemplateRefused as e:
            raise UserError(f"the chat template refuses this conversation: {e} — fix the row "
                            f"(or set chat_format)") from None
        except UserError:
            raise
        except Exception as e:  # an error inside the template (undefined name, bad type, ...)
            raise UserError(f"the chat template failed on this conversation ({type(e).__name__}: {e}) — fix the "
                            f"row, pass what the template needs in chat_template_kwargs, or set chat_format") from None
        finally:
            env.tracking = (None, None)
        return "".join(blocks), spans

    def encode(self, messages: Sequence[dict], add_generation_prompt: bool = False,
               tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
        """Ids of the rendered conversation (equal to transformers' `apply_chat_template(...,
        tokenize=True)`) and the target mask (see the module doc)."""
        tok = self.tok
        text, spans = self.render(messages, add_generation_prompt, track=self.marked, tools=tools)
        ids = tok.encode(text)
        bos = tok.bos_id
        if bos is not None and ids[:2] == [bos, bos]:
            raise UserError(f"the chat template's text begins with two bos tokens ({tok.id_to_token(bos)!r}) — "
                            f"remove the bos written in the data (the template adds one)")
        if not self.marked:
            spans = self._locate(messages, text, add_generation_prompt)
        mask = [False] * len(ids)
        cuts: dict[int, int] = {}

        def before(k: int) -> int:  # tokens that lie wholly before character k
            if k not in cuts:
                cuts[k] = 0 if k <= 0 else len(ids) if k >= len(text) else common_prefix_len(tok.encode(text[:k]), ids)
            return cuts[k]

        ends: list[int] = []
        for a, b in spans:
            s, e = before(a), before(b)
            for k in range(s, e):
                mask[k] = True
            if e > s:
                ends.append(e)
        if self._end == (None,) and ends:  # the template ends turns with no token at all: add eos
            eos = tok.need_id("eos")
            for e in reversed(ends):
                ids.insert(e, eos)
                mask.insert(e, True)
        return ids, mask

    # ------------------------------------------------------------------ spans without markers

    def end_of_turn(self) -> str | None:
        """The text that ends an assistant turn: the first special token the template writes after
        the assistant's content (None: it writes none; then eos is appended, with a warning)."""
        if self._end is None:
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
            try:
                text, _ = self.render(probe)
            except UserError as e:
                raise UserError(f"{self.tok.source}: chat template '{self.name}' fails on a plain user/assistant "
                                f"exchange ({e.message}) — set chat_format, or fix the template") from None
            at = text.find(_PROBE)
            if at < 0:
                raise UserError(f"{self.tok.source}: chat template '{self.name}' does not write the assistant's "
                                f"message — set chat_format, or use a template that does")
            after = text[at + len(_PROBE):]
            found = [(after.find(s), s) for s in self.tok.special_strings() if s and s in after]
            self._end = (min(found)[1] if found else None,)
            if self._end == (None,) and not self._warned:
                self._warned = True
                warnings.warn(f"{self.tok.source}: the chat template ends the assistant's turn with no end token; "
                              f"eos is appended to each assistant turn as a target so the model learns to stop",
                              stacklevel=3)
        return self._end[0]

    def end_before_more(self) -> str | None:
        """The text that ends an assistant turn that more messages follow: the first special token the
        template writes after its content in a user / assistant / user exchange. Most templates end
        every turn alike; gpt-oss's harmony ends the last one with `<|return|>`, the others with
        `<|end|>`. The last turn's (`end_of_turn`) when the template writes no special token there."""
        if self._end_before_more is None:
            final = self.end_of_turn()
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE},
                     {"role": "user", "content": "hi"}]
            try:
                text, _ = self.render(probe)
            except UserError:
                text = ""
            after = text[text.find(_PROBE) + len(_PROBE):] if _PROBE in text else ""
            found = [(after.find(s), s) for s in self.tok.special_strings() if s and s in after]
            self._end_before_more = (min(found)[1] if found and final is not None else final,)
        return self._end_before_more[0]

    def _locate(self, messages: Sequence[dict], text: str, gen: bool) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        done = 0
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            end_token = self.end_of_turn() if i == len(messages) - 1 else self.end_before_more()
            # the conversation before message i (what its rendering shares with the rendering
            # that adds the generation prompt: Phi-3 ends a finished conversation with eos), then
            # as much of the generation prompt as the text goes on with (Qwen3 with
            # enable_thinking=false writes an empty think block in the prompt, not in earlier answers)
            if i:
                alone, prompt = self.render(messages[:i])[0], self.render(messages[:i], add_generation_prompt=True)[0]
                base = prompt[: common_prefix_len(alone, prompt)]
            else:
                base = prompt = ""
            if not text.startswith(base) or len(base) < done:
                # the template renders the conversation before it differently once it goes on (Mistral v0.3
                # moves the system message into the last user turn): find the message in the full text
                start, end = self._find(m, i, text, done, end_token)
                spans.append((start, end))
                done = end
                continue
            start = len(base) + common_prefix_len(prompt[len(base):], text[len(base):])
            if end_token is None:
                nxt = len(text)
                if i + 1 < len(messages):
                    after, _ = self.render(messages[: i + 1])
                    nxt = len(after) if text.startswith(after) else nxt
                end = nxt
                while end > start and text[end - 1].isspace():
                    end -= 1
            else:
                content = m.get("content")
                if isinstance(content, str) and end_token in content:
                    raise UserError(f"messages[{i}]: the content holds the end-of-turn token {end_token!r} as text — "
                                    f"remove it from the data")
                at = text.find(end_token, start)
                if at < 0:
                    raise UserError(f"cannot locate the end of assistant message {i}: the chat template writes no "
                                    f"{end_token!r} after it — use a template with {{% generation %}} markers, or "
                                    f"set chat_format")
                end = at + len(end_token)
            spans.append((start, end))
            done = end
        return spans

    def _find(self, message: dict, i: int, text: str, done: int, end_token: str | None) -> tuple[int, int]:
        """The span of assistant message `i` in the full rendering, searched from character `done` (where
        the previous assistant message ended): the first place its content (as written, or stripped)
        is followed, after at most some whitespace, by the end-of-turn token. The span opens after the
        whitespace before the content (as the prefix rule opens it after the header) and closes after
        the end token."""
        content = message.get("content")
        where = ("cannot locate assistant message {i} in the chat template's text: the template renders the "
                 "conversation before it differently once the conversation goes on (e.g. it moves the system "
                 "message), and {why} — use a template with {{% generation %}} markers, or set chat_format")
        if end_token is None or not isinstance(content, str) or not content.strip():
            why = "it writes no end-of-turn token" if end_token is None else "the message has no text to find"
            raise UserError(where.format(i=i, why=why))
        for piece in dict.fromkeys((content, content.strip())):
            at = text.find(piece, done)
            while at >= 0:
                after = at + len(piece)
                tail = len(text[after:]) - len(text[after:].lstrip())
                if text.startswith(end_token, after + tail):
                    start = at
                    while start > done and text[start - 1] in " \t":
                        start -= 1
                    return start, after + tail + len(end_token)
                at = text.find(piece, at + 1)
        raise UserError(where.format(i=i, why=f"its text is nowhere followed by {end_token!r}"))
