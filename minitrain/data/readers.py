"""Rows -> token-id examples: what the readers make of each row shape, and truncation.

Readers (`read_sft`, `read_seq2seq`, `read_preference`, `read_unpaired`, `read_prompts`) turn the rows of a data file
(`minitrain.data.files`, typed access through `minitrain.data.rows`) into examples of token
ids; a user's mistake in the file is one `UserError` naming `file:line`. They return an
`Examples` list that also says how many rows were truncated or skipped. The batch order is
`minitrain.data.batcher`, the padding collators `minitrain.data.collate`.

Labels are aligned with `input_ids` (as in transformers): `labels[i]` is the token at position
`i`, or -100 where no loss is taken (prompt, bos, padding); causal objectives shift them.

Truncation (`max_len` tokens per sequence), explicit and counted:

- prompt + completion too long: the prompt loses tokens first, on `truncation_side` ("left",
  the default, drops its beginning and keeps the end next to the completion; a leading bos is
  kept), but not below `max_prompt_len` (default `max_len // 2`); then the completion loses
  its end (and its eos). A prompt longer than `max_len` is thus cut to `max_prompt_len`.
- chats (`{"messages"}`) lose tokens on `truncation_side`; `{"text"}` rows lose their end.
- a row left with no target token is skipped and counted (`Examples.skipped`), so no batch
  is ever all -100 (a 0/0 NaN loss).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from minitrain.data.collate import IGNORE_INDEX
from minitrain.data.files import read_rows
from minitrain.data.images import ImageRows, image_messages
from minitrain.data.rows import PREFERENCE_FIELDS, SEQ2SEQ_FIELDS, SFT_FIELDS, Row, check_fields, in_force
from minitrain.data.videos import video_messages
from minitrain.errors import UserError
from minitrain.text.chat_formats import common_prefix_len
from minitrain.text.tokenizer import Tokenizer

SIDES = ("left", "right")


class Examples(list):
    """A list of examples, with what reading cost: `truncated` and `skipped` row counts, and
    `bos_in_text`: rows whose text began with the bos token already (text copied from a
    rendered chat), which get no second bos; `identical`: preference pairs whose two answers were
    the same tokens, dropped on request."""

    def __init__(self, items: Sequence[dict] = (), *, path: str = "", truncated: int = 0, skipped: int = 0,
                 bos_in_text: int = 0, identical: int = 0, shapes: dict[str, int] | None = None):
        super().__init__(items)
        self.shapes = shapes  # SFT: rows read per shape (chat, pair, pair_chat, text), for the run's log
        self.path = path
        self.truncated = truncated
        self.skipped = skipped
        self.bos_in_text = bos_in_text  # rows whose text already began with bos: not given a second one
        self.identical = identical

    @property
    def lengths(self) -> list[int]:
        """Tokens per example (all its id lists), for `Batcher` length grouping."""
        return [sum(len(v) for k, v in ex.items() if k.endswith("ids")) for ex in self]


def _check_options(max_len: int, truncation_side: str, max_prompt_len: int | None) -> int:
    if not isinstance(max_len, int) or max_len < 2:
        raise UserError(f"max_len={max_len!r}: must be an integer >= 2")
    if truncation_side not in SIDES:
        raise UserError(f"truncation_side={truncation_side!r}: use 'left' or 'right'")
    if max_prompt_len is None:
        return max_len // 2
    if not isinstance(max_prompt_len, int) or not 0 <= max_prompt_len < max_len:
        raise UserError(f"max_prompt_len={max_prompt_len!r}: must be an integer in [0, max_len)")
    return max_prompt_len


def _chat(tok: Tokenizer, where: str, messages: list, **kw) -> tuple[list[int], list[bool]]:
    try:
        return tok.encode_chat(messages, **kw)
    except UserError as e:  # name the line as well as the message
        raise UserError(f"{where}: {e.message}") from None


# --------------------------------------------------------------------------- truncation


def _cut(ids: list[int], keep: int, side: str, bos: int | None) -> list[int]:
    """`ids` shortened to `keep` tokens on `side`; a leading bos survives left truncation."""
    if len(ids) <= keep:
        return ids
    if keep <= 0:
        return []
    if side == "right":
        return ids[:keep]
    if bos is not None and ids[0] == bos:
        return ids[:1] + ids[len(ids) - keep + 1 :]
    return ids[len(ids) - keep :]


def _fit(prompt: list[int], completions: list[list[int]], max_len: int, max_prompt_len: int,
         side: str, bos: int | None) -> tuple[list[int], list[list[int]], bool]:
    """Apply the module's truncation policy to a prompt shared by one or more completions."""
    longest = max(len(c) for c in completions)
    if len(prompt) + longest <= max_len:
        return prompt, completions, False
    keep = min(len(prompt), max(max_len - longest, max_prompt_len))
    prompt = _cut(prompt, keep, side, bos)
    room = max_len - len(prompt)
    return prompt, [c[:room] for c in completions], True


def _targets(labels: list[int]) -> int:
    """Tokens the causal loss trains on (position 0 is never predicted)."""
    return sum(1 for x in labels[1:] if x != IGNORE_INDEX)


# --------------------------------------------------------------------------- readers


def _answer(row: Row, name: str) -> str | list:
    """A preference answer: text, a list of messages, or a ShareGPT turn `{"from", "value"}`."""
    v = row.get(name)
    if isinstance(v, list):
        return row.messages(name)
    if isinstance(v, dict) and "value" in v:
        v = v["value"]
        if not isinstance(v, str) or not v.strip():
            raise UserError(f'{row.where}: "{row.key(name)}" value must be non-empty text — fix the row')
        return v
    return row.text(name)


def _preference_parts(row: Row) -> tuple[str | list, tuple[str | list, str | list]]:
    """(prompt, (chosen, rejected)) of a preference row in any of `read_preference`'s shapes."""
    if row.has("conversations") and not row.has("prompt"):
        return row.sharegpt("conversations"), (_answer(row, "chosen"), _answer(row, "rejected"))
    if not row.has("prompt") and row.has("chosen") and isinstance(row.get("chosen"), list):
        chosen, rejected = row.messages("chosen"), row.messages("rejected") if row.has("rejected") else None
        if not isinstance(rejected, list):
            raise UserError(f'{row.where}: "{row.key("chosen")}" is a conversation, so "{row.key("rejected")}" must be '
                            f'one too (TRL\'s format with an implicit prompt) — fix the row')
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise UserError(f'{row.where}: "{row.key("chosen")}" and "{row.key("rejected")}" share no first message, so '
                            f'there is no prompt — give a "prompt" key, or conversations that begin alike')
        return chosen[:n], (chosen[n:], rejected[n:])
    prompt = row.get("prompt")
    prompt = row.messages("prompt") if isinstance(prompt, list) else row.text("prompt")
    return prompt, (_answer(row, "chosen"), _answer(row, "rejected"))


def read_sft(path: str | Path, tok: Tokenizer, *, max_len: int, truncation_side: str = "left",
             max_prompt_len: int | None = None, fields: dict[str, str] | None = None,
             split: str | None = None, prompt_completion: str = "raw",
             rows: Iterable[tuple[str, dict]] | None = None, into: Examples | None = None,
             images: ImageRows | None = None) -> Examples:
    """Causal-LM examples `{"input_ids", "labels"}` from the rows of a data file (any format of
    `minitrain.data.files`; `split` picks a split of a datasets folder), in these shapes:

    - chats: `{"messages"}`, ShareGPT `{"conversations"}` or Alpaca `{"instruction", "input",
      "output"}` (`minitrain.data.rows`): `tok.encode_chat`, loss on the assistant turns;
    - `{"prompt", "completion"}`: `[bos] prompt completion [eos]`, loss on completion + eos;
      the completion is encoded as continuing the prompt (its leading space kept as written);
      with `prompt_completion="chat"`, a chat of one user turn (the prompt) and one assistant
      turn (the completion) instead;
    - `{"text"}`: `[bos] text [eos]`, loss on every token.

    `fields` maps these names to the file's keys (`{"prompt": "question"}`). `[bos]` is there
    when the checkpoint's tokenizer adds it to a text (`Tokenizer.add_bos`, as transformers'
    tokenizer call: not for Qwen or Phi-3); a prompt or text that already begins with the bos
    token gets no second one (counted in `bos_in_text`).

    Chats may carry images (`minitrain.data.images.image_messages`: content parts `{"type": "image",
    "image": path}`, or an `images` column), read for a vision-language checkpoint (`images`: how it reads
    them; None: a text-only one, and a row with images is an error). Each image's placeholder is expanded
    to its token count (from the file's header; the pixels are decoded per batch, `collate_images`); the
    example keeps the image paths (`images`) and its `where`; image tokens take no loss.
    """
    max_prompt_len = _check_options(max_len, truncation_side, max_prompt_len)
    fields = check_fields(fields, SFT_FIELDS)
    eos = [tok.eos_id] if tok.eos_id is not None else []
    if prompt_completion not in ("raw", "chat"):
        raise UserError(f"prompt_completion={prompt_completion!r}: use 'raw' or 'chat'")
    out = Examples(path=str(path)) if into is None else into
    if out.shapes is None:
        out.shapes = dict.fromkeys(("chat", "pair", "pair_chat", "text"), 0)
    for where, raw in read_rows(path, split) if rows is None else rows:
        row = Row(where, raw, fields, '"prompt" and "completion", "messages" or "text"')
        chat = row.chat()
        shape = "chat"
        if chat is None and prompt_completion == "chat" and (row.has("prompt") or row.has("completion")):
            row.expect = '"prompt" and "completion"'
            chat = [{"role": "user", "content": row.text("prompt")},
                    {"role": "assistant", "content": row.text("completion")}]
            shape = "pair_chat"
        paths: list = []
        clips: list[str] = []  # the videos (`VideoRows.entry`)
        if chat is not None and _has_parts(row, chat):
            chat, clips = _video_chat(row, chat, path, images)
            chat, paths = _image_chat(row, chat, path, images)
        if chat is not None:
            ids, mask = _chat(tok, where, chat)
            labels = [i if m else IGNORE_INDEX for i, m in zip(ids, mask)]
            if paths:
                ids, labels = images.expand(ids, labels, [images.tokens(p, where) for p in paths], tok, where)
            if clips:
                ids, labels = images.videos.expand(ids, labels, clips, tok, where)
            if (paths or clips) and len(ids) > max_len:
                raise UserError(f"{where}: {len(ids)} tokens with its images and videos, over max_len={max_len} — a "
                                "row with images or videos is never cut; raise max_len or lower their max_pixels")
            if len(ids) > max_len:
                out.truncated += 1
                keep = _cut(list(range(len(ids))), max_len, truncation_side, 0)  # positions kept
                ids, labels = [ids[k] for k in keep], [labels[k] for k in keep]
        elif row.has("prompt") or row.has("completion"):
            row.expect = '"prompt" and "completion"'
            p = _with_bos(tok, tok.encode(row.text("prompt")), out)
            c = tok.encode(row.text("completion"), continuation=True) + eos
            p, (c,), cut = _fit(p, [c], max_len, max_prompt_len, truncation_side, tok.bos_id)
            out.truncated += cut
            ids, labels = p + c, [IGNORE_INDEX] * len(p) + c
            shape = "pair"
        elif row.has("text"):
            shape = "text"
            ids = _with_bos(tok, tok.encode(row.text("text")), out) + eos
            if len(ids) > max_len:
                out.truncated += 1
                ids = ids[:max_len]
            labels = ([IGNORE_INDEX] + ids[1:]) if ids[:1] == [tok.bos_id] else list(ids)
        else:
            keys = ", ".join(json.dumps(k) for k, v in list(raw.items())[:5] if v is not None) or "none"
            raise UserError(f'{where}: no "prompt"/"completion", "messages" or "text" key (keys: {keys}'
                            f'{"; " + in_force(fields) if fields else ""}) — use one of these row shapes (or ShareGPT "conversations", '
                            f'Alpaca "instruction"/"output"), or map your keys with fields={{"prompt": "your_key", ...}}')
        if _targets(labels) == 0:
            out.skipped += 1
            continue
        out.shapes[shape] += 1
        ex = {"input_ids": ids, "labels": labels}
        if paths:
            ex["images"] = [str(p) for p in paths]
        if clips:
            ex["videos"] = clips
        out.append({**ex, "where": where} if paths or clips else ex)
    return out


def _video_chat(row: Row, chat: list, path: str | Path, images: ImageRows | None) -> tuple[list, list[str]]:
    """A chat's video parts (or a `videos` column) read out (`video_messages`): (its messages, each video part a
    text part of the checkpoint's placeholder; the videos as `VideoRows.entry`). Videos need a checkpoint that
    reads them (`images.videos`)."""
    column = row.get("videos") if row.has("videos") else None
    if column is not None and not isinstance(column, list):
        raise UserError(f'{row.where}: "videos" must be a list of videos, each a list of frame paths — fix the row')
    base = Path(path).parent if Path(path).is_file() else Path(path)
    videos = images.videos if images is not None else None
    return video_messages(chat, column, base, videos.placeholder if videos else None, row.where)


def _image_chat(row: Row, chat: list, path: str | Path, images: ImageRows | None) -> tuple[list, list]:
    """A chat whose contents are lists of parts, or with an `images` column -> (its messages with string
    contents, the image paths); `path` the data file, against whose folder relative image paths are read.
    Text parts alone suit any checkpoint; images need a vision-language one (`images`)."""
    column = row.get("images") if row.has("images") else None
    if column is not None and not (isinstance(column, list) and all(isinstance(p, str) for p in column)):
        raise UserError(f'{row.where}: "images" must be a list of paths — fix the row')
    base = Path(path).parent if Path(path).is_file() else Path(path)
    chat, paths = image_messages(chat, column, base, images.placeholder if images else "", row.where)
    if paths and images is None:
        raise UserError(f"{row.where}: the row has images, which are not read here: the checkpoint is text-only (its "
                        "config.json has no image_token_id), or this recipe takes no images yet (SFT, DPO, KTO and GRPO "
                        "do) — use a vision-language checkpoint with one of those, or drop the images")
    return chat, paths


def _with_bos(tok: Tokenizer, ids: list[int], out: Examples) -> list[int]:
    """`[bos] + ids` where the checkpoint's tokenizer puts bos before a text (`tok.add_bos`:
    LLaMA, Mistral, Gemma; not Qwen or Phi-3), unless `ids` begin with bos already (counted: a
    second one is never added)."""
    if tok.bos_id is None:
        return ids
    if ids[:1] == [tok.bos_id]:
        out.bos_in_text += 1
        return ids
    return [tok.bos_id] + ids if tok.add_bos else ids


def read_seq2seq(path: str | Path, tok: Tokenizer, *, max_len: int, truncation_side: str = "left",
                 max_target_len: int | None = None, fields: dict[str, str] | None = None,
                 max_prompt_len: int | None = None, split: str | None = None, rows: Iterable[tuple[str, dict]] | None = None,
             into: Examples | None = None) -> Examples:
    """Encoder-decoder examples from `{"prompt", "completion"}` rows (any file format, as `read_sft`).

    `input_ids` = prompt + eos (cut to `max_len` on `truncation_side`, the eos kept),
    `labels` = completion + eos (cut on the right to `max_target_len`, default `max_len`), as
    transformers' T5Tokenizer does for inputs and `text_target`. Decoder inputs are made by
    the collator (labels shifted right behind the decoder start token).
    """
    _check_options(max_len, truncation_side, max_prompt_len)
    max_target_len = max_len if max_target_len is None else max_target_len
    if not isinstance(max_target_len, int) or max_target_len < 1:
        raise UserError(f"max_target_len={max_target_len!r}: must be an integer >= 1")
    fields = check_fields(fields, SEQ2SEQ_FIELDS)
    out = Examples(path=str(path)) if into is None else into
    for where, raw in read_rows(path, split) if rows is None else rows:
        row = Row(where, raw, fields, '"prompt" and "completion"')
        src = tok.encode(row.text("prompt"), eos=True)
        tgt = tok.encode(row.text("completion"), eos=True)
        if len(src) > max_len or len(tgt) > max_target_len:
            out.truncated += 1
        if len(src) > max_len:
            body = _cut(src[:-1], max_len - 1, truncation_side, None)
            src = body + src[-1:]
        out.append({"input_ids": src, "labels": tgt[:max_target_len]})
    return out


def read_preference(path: str | Path, tok: Tokenizer, *, max_len: int, truncation_side: str = "left",
                    max_prompt_len: int | None = None, fields: dict[str, str] | None = None,
                    split: str | None = None, drop_identical: bool = False, margin: bool = False,
                    rows: Iterable[tuple[str, dict]] | None = None, into: Examples | None = None,
                    images: ImageRows | None = None) -> Examples:
    """Preference pairs `{"chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"}` (with
    `margin`, also each row's `"margin"` as a float: a reward model's optional column, 0 where absent).

    Rows (any file format, as `read_sft`):

    - `{"prompt", "chosen", "rejected"}`. The prompt is a string (`[bos] prompt`, the answers
      continuing it, + eos) or a list of chat messages (then each answer is the next assistant
      turn, via `tok.encode_chat`); the answers may also be lists of assistant messages.
    - `{"chosen", "rejected"}` as two whole conversations (TRL's conversational format with an
      implicit prompt): the messages both begin with are the prompt.
    - ShareGPT `{"conversations", "chosen", "rejected"}` (LLaMA-Factory): the conversation is the
      prompt, the answers `{"from": "gpt", "value"}` objects or strings.

    Prompt tokens are labelled -100 in both sequences; truncation cuts the shared prompt once.

    A chat prompt may carry images (TRL's vision shape: content parts `{"type": "image", "image": path}`, or
    an `images` column beside the messages; `images`: how the vision-language checkpoint reads them, as in
    `read_sft`): both answers follow the same images, which the pair keeps (`images`, its `where`); a pair
    with images is never cut (longer than `max_len`: one error). Images in an answer are refused.
    """
    max_prompt_len = _check_options(max_len, truncation_side, max_prompt_len)
    fields = check_fields(fields, PREFERENCE_FIELDS)
    eos = [tok.eos_id] if tok.eos_id is not None else []
    out = Examples(path=str(path)) if into is None else into
    for where, raw in read_rows(path, split) if rows is None else rows:
        row = Row(where, raw, fields, '"prompt", "chosen" and "rejected"')
        prompt, answers_in = _preference_parts(row)
        prompt, paths = _prompt_images(row, prompt, path, images)
        answers_in = tuple(_answer_text(row, name, a, path) for name, a in zip(("chosen", "rejected"), answers_in))
        # each answer as (id, label) pairs after the shared prompt
        answers: list[list[tuple[int, int]]] = []
        if isinstance(prompt, list):
            p, _ = _chat(tok, where, prompt, add_generation_prompt=True)
            counts = [images.tokens(q, where) for q in paths]
            if paths:
                p = images.expand(p, [IGNORE_INDEX] * len(p), counts, tok, where)[0]
            fulls = []
            for name, a in zip(("chosen", "rejected"), answers_in):
                if isinstance(a, list) and not (a and isinstance(a[-1], dict) and a[-1].get("role") == "assistant"):
                    raise UserError(f'{where}: "{row.key(name)}" is a list of messages that does not end with an '
                                    f'assistant message — give the answer as a string or as assistant message(s)')
                turn = a if isinstance(a, list) else [{"role": "assistant", "content": a}]
                ids, mask = _chat(tok, where, prompt + turn)
                labels = [i if m else IGNORE_INDEX for i, m in zip(ids, mask)]
                fulls.append(images.expand(ids, labels, counts, tok, where) if paths else (ids, labels))
            n = min(common_prefix_len(p, ids) for ids, _ in fulls)  # where the answers start
            p = p[:n]
            for ids, labels in fulls:
                answers.append(list(zip(ids[n:], labels[n:])))
            if paths and len(p) + max(len(a) for a in answers) > max_len:
                raise UserError(f"{where}: {len(p) + max(len(a) for a in answers)} tokens with its images, over "
                                f"max_len={max_len} — a pair with images is never cut; raise max_len or lower the "
                                "images' max_pixels")
        else:
            p = _with_bos(tok, tok.encode(prompt), out)
            for name, a in zip(("chosen", "rejected"), answers_in):
                if isinstance(a, list):
                    raise UserError(f'{where}: "{row.key(name)}" is a list of messages but "{row.key("prompt")}" '
                                    f'is a string — give both as messages or both as strings')
                ids = tok.encode(a, continuation=True) + eos
                answers.append([(t, t) for t in ids])
        same_rows = answers[0] == answers[1]
        p, answers, cut = _fit(p, answers, max_len, max_prompt_len, truncation_side, tok.bos_id)
        out.truncated += cut
        ex: dict[str, list[int]] = {}
        for name, a in zip(("chosen", "rejected"), answers):
            ex[f"{name}_ids"] = p + [t for t, _ in a]
            ex[f"{name}_labels"] = [IGNORE_INDEX] * len(p) + [lab for _, lab in a]
        if ex["chosen_ids"] == ex["rejected_ids"] and ex["chosen_labels"] == ex["rejected_labels"]:
            # a pair that teaches nothing: its DPO loss sits at ln 2 with a zero gradient
            if drop_identical:
                out.identical += 1
                continue
            why = ("are the same tokens" if same_rows else
                   f"are the same tokens once cut to max_len={max_len} (they differ only past it)")
            todo = "fix the row" if same_rows else "raise max_len or fix the row"
            raise UserError(f'{where}: "{row.key("chosen")}" and "{row.key("rejected")}" {why}: the pair teaches '
                            f'nothing (DPO loss ln 2, zero gradient) — {todo}, or pass drop_identical_pairs=true to '
                            f'drop such pairs (counted)')
        if _targets(ex["chosen_labels"]) == 0 or _targets(ex["rejected_labels"]) == 0:
            out.skipped += 1
            continue
        if margin:
            ex["margin"] = _margin(row)
        if paths:
            ex.update(images=[str(q) for q in paths], where=where)
        out.append(ex)
    return out


def _has_parts(row: Row, messages: list) -> bool:
    """Whether a chat has content lists (parts) or the row an `images` column: `_image_chat` reads it."""
    return row.has("images") or row.has("videos") or any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                                         for m in messages)


def _prompt_images(row: Row, prompt: str | list, path: str | Path, images: ImageRows | None) -> tuple[str | list, list]:
    """A preference / unpaired / GRPO prompt with its images read out (`_image_chat`): (the prompt, image paths).
    A string prompt beside an `images` column is refused: the images need a chat to sit in. Videos are SFT's only."""
    if row.has("videos"):
        raise UserError(f'{row.where}: the row has "videos", which this recipe does not read yet (SFT does) — drop '
                        "them or train with SFT")
    if isinstance(prompt, list):
        return _image_chat(row, prompt, path, images) if _has_parts(row, prompt) else (prompt, [])
    if row.has("images"):
        raise UserError(f'{row.where}: the row has "images" but "{row.key("prompt")}" is a string — give the prompt '
                        f'as chat messages (the images go before the first user turn, or as {{"type": "image"}} parts)')
    return prompt, []


def _answer_text(row: Row, name: str, answer: str | list, path: str | Path) -> str | list:
    """An answer whose messages are lists of text parts, as string messages; an image in an answer is refused."""
    if not isinstance(answer, list) or not any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                               for m in answer):
        return answer
    messages, paths = image_messages(answer, None, Path(path).parent, "", row.where)
    if paths:
        raise UserError(f'{row.where}: "{row.key(name)}" has an image — images go in the prompt, which both answers '
                        'share')
    return messages


def _margin(row: Row) -> float:
    """A pair's `margin` column as a float (TRL's RewardTrainer: subtracted from the reward gap); 0 when absent."""
    if not row.has("margin"):
        return 0.0
    v = row.get("margin")
    try:
        number = float(v) if isinstance(v, (int, float, str)) and not isinstance(v, bool) else None
    except ValueError:
        number = None
    if number is None or not math.isfinite(number):
        raise UserError(f'{row.where}: "{row.key("margin")}" is {v!r}, not a finite number — give the margin as a '
                        f'number (how much more the chosen answer is preferred), or leave the key out (0)')
    return number


def read_unpaired(path: str | Path, tok: Tokenizer, *, max_len: int, truncation_side: str = "left",
                  max_prompt_len: int | None = None, fields: dict[str, str] | None = None,
                  split: str | None = None, rows: Iterable[tuple[str, dict]] | None = None,
             into: Examples | None = None, images: ImageRows | None = None) -> Examples:
    """Unpaired feedback (KTO) `{"input_ids", "labels", "label", "prompt_len"}`.

    Rows: `{"prompt", "completion", "label": true|false}` (a thumbs-up or thumbs-down on one
    answer). The prompt is a string (`[bos] prompt`, the completion continuing it, + eos) or a
    list of chat messages (the completion is then the next assistant turn, or assistant
    message(s)), encoded as `read_preference` encodes an answer; prompt tokens are labelled -100.
    A chat prompt may carry images, as `read_preference`'s (`images`, `where` kept; never cut).
    """
    max_prompt_len = _check_options(max_len, truncation_side, max_prompt_len)
    fields = check_fields(fields, ("prompt", "completion", "label", "role", "content"))
    eos = [tok.eos_id] if tok.eos_id is not None else []
    out = Examples(path=str(path)) if into is None else into
    for where, raw in read_rows(path, split) if rows is None else rows:
        row = Row(where, raw, fields, '"prompt", "completion" and "label"')
        label = row.get("label")
        if not isinstance(label, bool):
            raise UserError(f'{where}: "{row.key("label")}" must be true or false (desirable or not), got '
                            f'{type(label).__name__} — fix the row')
        prompt, answer = row.get("prompt"), _answer(row, "completion")
        prompt, paths = _prompt_images(row, row.messages("prompt") if isinstance(prompt, list) else prompt, path,
                                       images)
        answer = _answer_text(row, "completion", answer, path)
        if isinstance(prompt, list):
            p, _ = _chat(tok, where, prompt, add_generation_prompt=True)
            if isinstance(answer, list) and not (answer and isinstance(answer[-1], dict)
                                                 and answer[-1].get("role") == "assistant"):
                raise UserError(f'{where}: "{row.key("completion")}" is a list of messages that does not end with '
                                f'an assistant message — give the answer as a string or as assistant message(s)')
            turn = answer if isinstance(answer, list) else [{"role": "assistant", "content": answer}]
            ids, mask = _chat(tok, where, prompt + turn)
            labels = [i if m else IGNORE_INDEX for i, m in zip(ids, mask)]
            if paths:
                counts = [images.tokens(q, where) for q in paths]
                p = images.expand(p, [IGNORE_INDEX] * len(p), counts, tok, where)[0]
                ids, labels = images.expand(ids, labels, counts, tok, where)
                if len(ids) > max_len:
                    raise UserError(f"{where}: {len(ids)} tokens with its images, over max_len={max_len} — a row "
                                    "with images is never cut; raise max_len or lower the images' max_pixels")
            n = common_prefix_len(p, ids)
            p, a = p[:n], list(zip(ids[n:], labels[n:]))
        else:
            if isinstance(answer, list):
                raise UserError(f'{where}: "{row.key("completion")}" is a list of messages but '
                                f'"{row.key("prompt")}" is a string — give both as messages or both as strings')
            p = _with_bos(tok, tok.encode(row.text("prompt")), out)
            a = [(t, t) for t in tok.encode(answer, continuation=True) + eos]
        p, (a,), cut = _fit(p, [a], max_len, max_prompt_len, truncation_side, tok.bos_id)
        out.truncated += cut
        ex = {"input_ids": p + [t for t, _ in a], "labels": [IGNORE_INDEX] * len(p) + [lab for _, lab in a],
              "label": label, "prompt_len": len(p)}
        if _targets(ex["labels"]) == 0:
            out.skipped += 1
            continue
        out.append({**ex, "images": [str(q) for q in paths], "where": where} if paths else ex)
    return out


def read_prompts(path: str | Path, tok: Tokenizer, *, max_len: int, truncation_side: str = "left",
                 max_prompt_len: int | None = None, fields: dict[str, str] | None = None,
                 split: str | None = None, tools: list[dict] | None = None, images: ImageRows | None = None
                 ) -> Examples:
    """Prompts to generate from (GRPO) `{"prompt_ids", "prompt", "columns", "row"}`.

    Rows: `{"prompt": str | [messages]}` plus any other columns, which are kept as they are in
    `columns` (the reward functions get them). A string prompt is `[bos] prompt`; a conversation is
    rendered with the chat template (or format) and the assistant's generation prompt. A prompt
    longer than `max_prompt_len` (default `max_len // 2`: the rest is room for the completion)
    loses tokens on `truncation_side` (a leading bos is kept), counted in `Examples.truncated`.
    `prompt` is the row's prompt (messages with their keys renamed by `fields`), `row` its `file:line`.
    `tools`: the JSON schemas of the functions offered to the model, rendered into a conversation's prompt.
    A conversation may carry images (as `read_preference`'s prompts; `images`: how the vision-language checkpoint
    reads them): each placeholder expanded to its token count, the paths kept (`images`, with `where`); such a
    prompt is never cut (longer than `max_prompt_len`: one error).
    """
    max_prompt_len = _check_options(max_len, truncation_side, max_prompt_len) or max_len // 2
    fields = check_fields(fields, ("prompt", "role", "content"))
    out = Examples(path=str(path))
    for where, raw in read_rows(path, split):
        row = Row(where, raw, fields, '"prompt"')
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            prompt = row.messages("prompt")
        chat, paths = _prompt_images(row, prompt, path, images)
        if isinstance(chat, list):
            ids, _ = _chat(tok, where, chat, add_generation_prompt=True, tools=tools)
        else:
            ids = _with_bos(tok, tok.encode(row.text("prompt")), out)
        if paths:
            ids = images.expand(ids, [IGNORE_INDEX] * len(ids), [images.tokens(q, where) for q in paths], tok, where)[0]
            if len(ids) > max_prompt_len:
                raise UserError(f"{where}: the prompt is {len(ids)} tokens with its images, over {max_prompt_len} (max_len "
                                f"less the completion's room) — a prompt with images is never cut; raise max_len or "
                                f"lower the images' max_pixels")
        if len(ids) > max_prompt_len:
            ids = _cut(ids, max_prompt_len, truncation_side, tok.bos_id)
            out.truncated += 1
        columns = {k: v for k, v in raw.items() if k != row.key("prompt")}
        ex = {"prompt_ids": ids, "prompt": prompt, "columns": columns, "row": where}
        out.append({**ex, "images": [str(q) for q in paths], "where": where} if paths else ex)
    return out


def held_out(n: int, share: float, seed: int) -> np.ndarray:
    """Which of `n` examples `hold_out` holds out (a seeded choice of `round(share n)`, at least one)."""
    k = max(1, round(n * share))
    if k >= n:
        raise UserError(f"eval_split={share}: {n} examples leave none to train on — lower eval_split or add data")
    return np.random.default_rng([seed, 0xE7A1]).permutation(n)[:k]


def kept_per_source(counts: Sequence[int], held: np.ndarray) -> list[int]:
    """Examples per source left for training once the indices `held` are held out (sources in order)."""
    source = np.searchsorted(np.cumsum(counts), held, side="right")
    return [int(c - h) for c, h in zip(counts, np.bincount(source, minlength=len(counts)))]


def hold_out(examples: Examples, share: float, seed: int) -> tuple[Examples, Examples]:
    """(train, eval): a seeded `share` of `examples` held out for evaluation (at least one example,
    never all). The choice is a pure function of the example count and `seed`, so a resumed run
    holds out the same examples; train keeps the file's order, eval is disjoint from it."""
    n = len(examples)
    chosen = held_out(n, share, seed)
    k = len(chosen)
    if hasattr(examples, "take"):  # a token store: two views by index, no lists
        mask = np.zeros(n, dtype=bool)
        mask[chosen] = True
        train = examples.take(np.flatnonzero(~mask))
        for c in ("truncated", "skipped", "bos_in_text", "shapes"):
            setattr(train, c, getattr(examples, c))
        return train, examples.take(np.flatnonzero(mask), path=f"{examples.path} (eval_split={share}: {k} held out, "
                                                                f"seed {seed})")
    held = set(chosen.tolist())
    train = Examples([ex for i, ex in enumerate(examples) if i not in held], path=examples.path,
                     truncated=examples.truncated, skipped=examples.skipped, bos_in_text=examples.bos_in_text,
                     shapes=examples.shapes)
    evals = Examples([ex for i, ex in enumerate(examples) if i in held],
                     path=f"{examples.path} (eval_split={share}: {k} held out, seed {seed})")
    return train, evals


def mixture(examples: Sequence[dict], counts: Sequence[int], weights: Sequence[float], seed: int) -> Sequence[dict]:
    """The examples of a mixture (`data_weights`): `counts[s]` examples of source `s` (in order) taken
    `weights[s]` times each, a fraction by a seeded choice (2.5: every example twice and half of them a
    third time; 0.5: a seeded half; 0: none). Each source's share is its own, in file order; the
    Batcher shuffles them together. A token store gives a view by index, a list a list."""
    if len(counts) != len(weights):
        raise UserError(f"data_weights: {len(weights)} weights for {len(counts)} data sources — give one weight per "
                        f"source named in data=")
    rng = np.random.default_rng([seed, 0x5EED])
    parts, start = [], 0
    for n, w in zip(counts, weights):
        k = round(w * n)
        if k:
            parts.append(start + np.sort(np.resize(rng.permutation(n), k)))
        start += n
    if not parts:
        raise UserError(f"data_weights={list(weights)}: every source weighs 0 — give a weight above 0")
    idx = np.concatenate(parts)
    if hasattr(examples, "take"):
        view = examples.take(idx)
        for c in ("truncated", "skipped", "bos_in_text", "identical", "shapes"):
            setattr(view, c, getattr(examples, c, None))
        return view
    return Examples([examples[i] for i in idx], path=examples.path, truncated=examples.truncated,
                    skipped=examples.skipped, bos_in_text=examples.bos_in_text, identical=examples.identical,
                    shapes=examples.shapes)
