"""Hand-written chat formats (`chat_format=`): Mistral, Llama-2 and Llama-3 instruct.

`FORMATS[name](tok, messages, add_generation_prompt)` turns a conversation into a list of
items, `(special id, target)` or `(text, target)`; `render(tok, items)` encodes them into ids
and the target mask. Special tokens are inserted by id, so the mask is exact. Text between two
special tokens is encoded the way each model's reference does it:

- sentencepiece files: each text piece is encoded on its own by sentencepiece (Meta's Llama-2
  code, mistral-common), whose dummy prefix stands for the one space the HF chat templates write
  after a special token;
- `tokenizer.json` files: as transformers tokenizes the rendered template, i.e. the text as it
  follows the preceding special token.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from minitrain.errors import UserError
from minitrain.text.backends import HFTokenizers, SentencePiece

Item = tuple[int | str, bool]


class Vocabulary(Protocol):
    """What a format asks of the tokenizer it renders for. `minitrain.text.tokenizer.Tokenizer` is
    one; it passes itself in (it chooses the format), so this module never imports it."""

    source: str  # the folder or file, for messages
    backend: SentencePiece | HFTokenizers

    def special_id(self, token: str) -> int | None: ...

    def need_id(self, name: str) -> int: ...


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """How many leading items (ids, or characters of two strings) `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# A chat is a list of items: (special id, target) or (text, target). Consecutive texts form
# one span, encoded together (see the module doc); the target boundaries inside a span are
# found by encoding its prefixes.

def render(tok: Vocabulary, items: list[Item]) -> tuple[list[int], list[bool]]:
    """The ids of `items` and their target mask."""
    ids: list[int] = []
    mask: list[bool] = []
    span: list[tuple[str, bool]] = []
    prev_special: int | None = None

    def flush() -> None:
        if not span:
            return
        texts = [t for t, _ in span]
        full = _encode_span(tok, "".join(texts), prev_special)
        cuts = [0]
        for k in range(1, len(texts)):
            cuts.append(max(cuts[-1], common_prefix_len(_encode_span(tok, "".join(texts[:k]), prev_special), full)))
        cuts.append(len(full))
        for k, (_, target) in enumerate(span):
            mask.extend([target] * (cuts[k + 1] - cuts[k]))
        ids.extend(full)
        span.clear()

    for item, target in items:
        if isinstance(item, str):
            if item:
                span.append((item, target))
        else:
            flush()
            ids.append(item)
            mask.append(target)
            prev_special = item
    flush()
    return ids, mask


def _encode_span(tok: Vocabulary, text: str, after: int | None) -> list[int]:
    b = tok.backend
    if isinstance(b, HFTokenizers) and after is not None:
        return b.encode_after(after, text)
    if isinstance(b, SentencePiece) and after is not None and b.prefix_space and text.startswith(" "):
        text = text[1:]  # sentencepiece's dummy prefix stands for the template's space
    return b.encode(text)


def mistral(tok: Vocabulary, msgs: list[dict], gen: bool) -> list[Item]:
    """Mistral instruct. With `[INST]` as plain text (tokenizer v1, Mistral-7B-Instruct
    v0.1/v0.2): `<s> [INST] {system}\\n\\n{user} [/INST] {assistant}</s> [INST] ...`, the system
    message joined to the first user message. With `[INST]` as a control token (v2/v3):
    `<s>[INST] {user}[/INST] {assistant}</s>`, the system message joined to the last user
    message, or in `[SYSTEM_PROMPT]...[/SYSTEM_PROMPT]` after bos where the vocabulary has it
    (v7) — as mistral-common does."""
    bos, eos = tok.need_id("bos"), tok.need_id("eos")
    system, turns = split_system(msgs)
    inst, end_inst = tok.special_id("[INST]"), tok.special_id("[/INST]")
    items: list[Item] = [(bos, False)]
    if inst is None or end_inst is None:  # v1: [INST] is text
        for i, m in enumerate(turns):
            if m["role"] == "user":
                content = m["content"]
                if i == 0 and system is not None:
                    content = system + "\n\n" + content
                items.append((" [INST] " + content + " [/INST]", False))
            else:
                items += [(" " + m["content"], True), (eos, True)]
        return items
    sys_open, sys_close = tok.special_id("[SYSTEM_PROMPT]"), tok.special_id("[/SYSTEM_PROMPT]")
    if system is not None and sys_open is not None and sys_close is not None:
        items += [(sys_open, False), (" " + system, False), (sys_close, False)]
        system = None
    last_user = max(i for i, m in enumerate(turns) if m["role"] == "user")
    for i, m in enumerate(turns):
        if m["role"] == "user":
            content = m["content"]
            if i == last_user and system is not None:
                content = system + "\n\n" + content
            items += [(inst, False), (" " + content, False), (end_inst, False)]
        else:
            items += [(" " + m["content"], True), (eos, True)]
    return items


def llama2(tok: Vocabulary, msgs: list[dict], gen: bool) -> list[Item]:
    """Llama-2 chat: `<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} </s>`
    per turn (contents stripped), as meta-llama/Llama-2-*-chat-hf's template and Meta's code."""
    bos, eos = tok.need_id("bos"), tok.need_id("eos")
    system, turns = split_system(msgs)
    items: list[Item] = []
    for i, m in enumerate(turns):
        content = m["content"]
        if i == 0 and system is not None:
            content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content
        if m["role"] == "user":
            items += [(bos, False), ("[INST] " + content.strip() + " [/INST]", False)]
        else:
            items += [(" " + content.strip() + " ", True), (eos, True)]
    return items


def llama3(tok: Vocabulary, msgs: list[dict], gen: bool) -> list[Item]:
    """Llama-3 instruct: `<|begin_of_text|>` then per message
    `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content.strip()}<|eot_id|>`."""
    bos = tok.need_id("bos")
    ids = {t: tok.special_id(t) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise UserError(
            f"{tok.source}: chat_format 'llama3' needs the special tokens {', '.join(missing)} — "
            f"use a Llama-3 tokenizer or another chat_format"
        )
    sh, eh, eot = ids["<|start_header_id|>"], ids["<|end_header_id|>"], ids["<|eot_id|>"]
    items: list[Item] = [(bos, False)]
    for m in msgs:
        t = m["role"] == "assistant"
        items += [(sh, False), (m["role"], False), (eh, False), ("\n\n", False),
                  (m["content"].strip(), t), (eot, t)]
    if gen:
        items += [(sh, False), ("assistant", False), (eh, False), ("\n\n", False)]
    return items


FORMATS = {"mistral": mistral, "llama2": llama2, "llama3": llama3}
CHAT_FORMATS = tuple(FORMATS)


def check_messages(messages, *, alternate: bool, template: bool = False) -> list[dict]:
    """Validate a chat: a non-empty list of {role, content: str}; for [INST] formats an optional
    first system message, then user/assistant turns alternating from user.

    For a chat template (`template=True`) any role is passed on (the template decides what it
    accepts), and so are a message's other keys (e.g. `reasoning_content`), those set to null
    dropped as transformers does."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError("messages: must be a non-empty list of {\"role\", \"content\"} objects — fix the row")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"messages[{i}]: expected an object with \"role\" and \"content\", got {type(m).__name__} — fix the row")
        role, content = m.get("role"), m.get("content")
        if template and (not isinstance(role, str) or not role):
            raise UserError(f"messages[{i}]: role {role!r} — give each message a role such as \"user\" or \"assistant\"")
        if not template and role not in ("system", "user", "assistant"):
            raise UserError(f"messages[{i}]: role {role!r} — use \"system\", \"user\" or \"assistant\"")
        if not isinstance(content, str):
            raise UserError(f"messages[{i}]: content must be a string, got {type(content).__name__} — fix the row")
        if not content.strip():
            raise UserError(f"messages[{i}]: empty content — remove the message or fill it")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"messages[{i}]: content holds a lone surrogate (a broken \\u escape) — fix the text") from None
        if template:
            out.append({k: v for k, v in m.items() if v is not None})
            continue
        if role == "system" and i != 0:
            raise UserError(f"messages[{i}]: a system message may only come first — move or merge it")
        out.append({"role": role, "content": content})
    if alternate:
        turns = out[1:] if out[0]["role"] == "system" else out
        if not turns:
            raise UserError("messages: only a system message — add a user message")
        for j, m in enumerate(turns):
            want = "user" if j % 2 == 0 else "assistant"
            if m["role"] != want:
                k = j + (len(out) - len(turns))
                raise UserError(f"messages[{k}]: expected role {want!r}, got {m['role']!r} — "
                                f"this chat format needs user/assistant turns alternating from user")
    return out


def split_system(msgs: list[dict]) -> tuple[str | None, list[dict]]:
    if msgs[0]["role"] == "system":
        return msgs[0]["content"], msgs[1:]
    return None, msgs
