"""JSONL rows -> token-id examples, a resumable batch order, and padding collators.

Readers (`read_sft`, `read_seq2seq`, `read_preference`, `read_unpaired`) turn one JSON object per line into
examples of token ids; a user's mistake in the file is one `UserError` naming `file:line`.
They return an `Examples` list that also says how many rows were truncated or skipped.

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
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from minitrain.errors import UserError
from minitrain.tokenizer import Tokenizer, common_prefix_len

IGNORE = -100
SIDES = ("left", "right")


class Examples(list):
    """A list of examples, with what reading cost: `truncated` and `skipped` row counts."""

    def __init__(self, items: Sequence[dict] = (), *, path: str = "", truncated: int = 0, skipped: int = 0):
        super().__init__(items)
        self.path = path
        self.truncated = truncated
        self.skipped = skipped

    @property
    def lengths(self) -> list[int]:
        """Tokens per example (all its id lists), for `Batcher` length grouping."""
        return [sum(len(v) for k, v in ex.items() if k.endswith("ids")) for ex in self]


# --------------------------------------------------------------------------- reading rows


def read_jsonl(path: str | Path) -> Iterator[tuple[str, dict]]:
    """Yield `("file:line", row)` for each non-blank line; UserError for anything not an object."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such file — check the data path")
    any_row = False
    with open(p, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{p}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{where}: not UTF-8 ({e.reason} at byte {e.start}) — save the file as UTF-8") from None
            if n == 1:
                line = line.lstrip("\ufeff")  # a byte-order mark some editors write
            if not line.strip():
                continue
            line = line.rstrip("\r\n")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where}: malformed JSON ({e.msg} at column {e.colno}) — "
                                f"each line must be one JSON object") from None
            except RecursionError:
                raise UserError(f"{where}: JSON nested too deeply — each line must be one flat JSON object") from None
            if not isinstance(row, dict):
                raise UserError(f"{where}: expected a JSON object, got {_type(row)} — "
                                f"each line must be one JSON object like {{\"prompt\": ..., \"completion\": ...}}")
            any_row = True
            yield where, row
    if not any_row:
        raise UserError(f"{p}: empty file (no JSON rows) — add one JSON object per line")


def _type(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


class _Row:
    """One row with the canonical key names mapped to the file's (`fields`)."""

    def __init__(self, where: str, row: dict, fields: dict[str, str], expect: str):
        self.where, self.row, self.fields, self.expect = where, row, fields, expect

    def key(self, name: str) -> str:
        return self.fields.get(name, name)

    def has(self, name: str) -> bool:
        return self.key(name) in self.row

    def get(self, name: str) -> Any:
        k = self.key(name)
        if k not in self.row:
            hint = f' (or map fields, e.g. fields={{"{name}": "your_key"}})' if k == name else ""
            raise UserError(f'{self.where}: missing key "{k}" — every row needs {self.expect}{hint}')
        return self.row[k]

    def text(self, name: str) -> str:
        v = self.get(name)
        k = self.key(name)
        if not isinstance(v, str):
            raise UserError(f'{self.where}: "{k}" must be a string, got {_type(v)} — fix the row')
        if not v.strip():
            raise UserError(f'{self.where}: "{k}" is empty — fill it or remove the row')
        if not _utf8(v):
            raise UserError(f'{self.where}: "{k}" holds a lone surrogate (a broken \\u escape) — fix the text')
        return v

    def messages(self, name: str) -> list:
        v = self.get(name)
        if not isinstance(v, list):
            raise UserError(f'{self.where}: "{self.key(name)}" must be a list of {{"role", "content"}} '
                            f'objects, got {_type(v)} — fix the row')
        return v


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _check_fields(fields: dict[str, str] | None, valid: tuple[str, ...]) -> dict[str, str]:
    fields = dict(fields or {})
    for k, v in fields.items():
        if k not in valid:
            raise UserError(f"fields: unknown name {k!r} — map these names to your keys: {', '.join(valid)}")
        if not isinstance(v, str) or not v:
            raise UserError(f"fields[{k!r}]: {v!r} — give the key name used in your file")
    return fields


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
    return sum(1 for x in labels[1:] if x != IGNORE)


# --------------------------------------------------------------------------- readers


def read_sft(path: str | Path, tok: Tokenizer, *, max_len: int, truncation_side: str = "left",
             max_prompt_len: int | None = None, fields: dict[str, str] | None = None) -> Examples:
    """Causal-LM examples `{"input_ids", "labels"}` from rows of one of three shapes:

    - `{"prompt", "completion"}`: `[bos] prompt completion [eos]`, loss on completion + eos;
      the completion is encoded as continuing the prompt (its leading space kept as written);
    - `{"messages": [{"role", "content"}, ...]}`: `tok.encode_chat`, loss on assistant turns;
    - `{"text"}`: `[bos] text [eos]`, loss on every token.

    `fields` maps these names to the file's keys (`{"prompt": "question"}`).
    """
    max_prompt_len = _check_options(max_len, truncation_side, max_prompt_len)
    fields = _check_fields(fields, ("prompt", "completion", "messages", "text"))
    bos = [tok.bos_id] if tok.bos_id is not None else []
    eos = [tok.eos_id] if tok.eos_id is not None else []
    out = Examples(path=str(path))
    for where, raw in read_jsonl(path):
        row = _Row(where, raw, fields, '"prompt" and "completion", "messages" or "text"')
        if row.has("messages"):
            ids, mask = _chat(tok, where, row.messages("messages"))
            labels = [i if m else IGNORE for i, m in zip(ids, mask)]
            if len(ids) > max_len:
                out.truncated += 1
                keep = _cut(list(range(len(ids))), max_len, truncation_side, 0)  # positions kept
                ids, labels = [ids[k] for k in keep], [labels[k] for k in keep]
        elif row.has("prompt") or row.has("completion"):
            row.expect = '"prompt" and "completion"'
            p = bos + tok.encode(row.text("prompt"))
            c = tok.encode(row.text("completion"), continuation=True) + eos
            p, (c,), cut = _fit(p, [c], max_len, max_prompt_len, truncation_side, tok.bos_id)
            out.truncated += cut
            ids, labels = p + c, [IGNORE] * len(p) + c
        elif row.has("text"):
            ids = (bos + tok.encode(row.text("text")) + eos)
            if len(ids) > max_len:
                out.truncated += 1
                ids = ids[:max_len]
            labels = ([IGNORE] + ids[1:]) if bos else list(ids)
        else:
            keys = ", ".join(f'"{k}"' for k in list(raw)[:5]) or "none"
            raise UserError(f'{where}: no "prompt"/"completion", "messages" or "text" key (keys: {keys}) — '
                            f'use one of these row shapes, or map your keys with fields={{...}}')
        if _targets(labels) == 0:
            out.skipped += 1
            continue
        out.append({"input_ids": ids, "labels": labels})
    return out


def read_seq2seq(path: str | Path, tok: Tokenizer, *, max_len: int, truncation_side: str = "left",
                 max_target_len: int | None = None, fields: dict[str, str] | None = None,
                 max_prompt_len: int | None = None) -> Examples:
    """Encoder-decoder examples from `{"prompt", "completion"}` rows.

    `input_ids` = prompt + eos (cut to `max_len` on `truncation_side`, the eos kept),
    `labels` = completion + eos (cut on the right to `max_target_len`, default `max_len`), as
    transformers' T5Tokenizer does for inputs and `text_target`. Decoder inputs are made by
    the collator (labels shifted right behind the decoder start token).
    """
    _check_options(max_len, truncation_side, max_prompt_len)
    max_target_len = max_len if max_target_len is None else max_target_len
    if not isinstance(max_target_len, int) or max_target_len < 1:
        raise UserError(f"max_target_len={max_target_len!r}: must be an integer >= 1")
    fields = _check_fields(fields, ("prompt", "completion"))
    out = Examples(path=str(path))
    for where, raw in read_jsonl(path):
        row = _Row(where, raw, fields, '"prompt" and "completion"')
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
                    max_prompt_len: int | None = None, fields: dict[str, str] | None = None) -> Examples:
    """Preference pairs `{"chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"}`.

    Rows: `{"prompt", "chosen", "rejected"}`. The prompt is a string (`[bos] prompt`, the answers
    continuing it, + eos) or a list of chat messages (then each answer is the next assistant
    turn, via `tok.encode_chat`). The answers may also be lists of assistant messages. Prompt
    tokens are labelled -100 in both sequences; truncation cuts the shared prompt once.
    """
    max_prompt_len = _check_options(max_len, truncation_side, max_prompt_len)
    fields = _check_fields(fields, ("prompt", "chosen", "rejected"))
    bos = [tok.bos_id] if tok.bos_id is not None else []
    eos = [tok.eos_id] if tok.eos_id is not None else []
    out = Examples(path=str(path))
    for where, raw in read_jsonl(path):
        row = _Row(where, raw, fields, '"prompt", "chosen" and "rejected"')
        prompt = row.get("prompt")
        # each answer as (id, label) pairs after the shared prompt
        answers: list[list[tuple[int, int]]] = []
        if isinstance(prompt, list):
            p, _ = _chat(tok, where, prompt, add_generation_prompt=True)
            fulls = []
            for name in ("chosen", "rejected"):
                a = row.get(name)
                if isinstance(a, list) and not (a and isinstance(a[-1], dict) and a[-1].get("role") == "assistant"):
                    raise UserError(f'{where}: "{row.key(name)}" is a list of messages that does not end with an '
                                    f'assistant message — give the answer as a string or as assistant message(s)')
                turn = a if isinstance(a, list) else [{"role": "assistant", "content": row.text(name)}]
                fulls.append(_chat(tok, where, prompt + turn))
            n = min(common_prefix_len(p, ids) for ids, _ in fulls)  # where the answers start
            p = p[:n]
            for ids, mask in fulls:
                answers.append([(t, t if m else IGNORE) for t, m in zip(ids[n:], mask[n:])])
        else:
            p = bos + tok.encode(row.text("prompt"))
            for name in ("chosen", "rejected"):
                if isinstance(row.get(name), list):
                    raise UserError(f'{where}: "{row.key(name)}" is a list of messages but "{row.key("prompt")}" '
                                    f'is a string — give both as messages or both as strings')
                ids = tok.encode(row.text(name), continuation=True) + eos
                answers.append([(t, t) for t in ids])
        p, answers, cut = _fit(p, answers, max_len, max_prompt_len, truncation_side, tok.bos_id)
        out.truncated += cut
        ex: dict[str, list[int]] = {}
        for name, a in zip(("chosen", "rejected"), answers):
            ex[f"{name}_ids"] = p + [t for t, _ in a]
            ex[f"{name}_labels"] = [IGNORE] * len(p) + [lab for _, lab in a]
        if _targets(ex["chosen_labels"]) == 0 or _targets(ex["rejected_labels"]) == 0:
            out.skipped += 1
            continue
        out.append(ex)
    return out


def read_unpaired(path: str | Path, tok: Tokenizer, *, max_len: int, truncation_side: str = "left",
                  max_prompt_len: int | None = None, fields: dict[str, str] | None = None) -> Examples:
    """Unpaired feedback (KTO) `{"input_ids", "labels", "label", "prompt_len"}`.

    Rows: `{"prompt", "completion", "label": true|false}` (a thumbs-up or thumbs-down on one
    answer). The prompt is a string (`[bos] prompt`, the completion continuing it, + eos) or a
    list of chat messages (the completion is then the next assistant turn, or assistant
    message(s)), encoded as `read_preference` encodes an answer; prompt tokens are labelled -100.
    """
    max_prompt_len = _check_options(max_len, truncation_side, max_prompt_len)
    fields = _check_fields(fields, ("prompt", "completion", "label"))
    bos = [tok.bos_id] if tok.bos_id is not None else []
    eos = [tok.eos_id] if tok.eos_id is not None else []
    out = Examples(path=str(path))
    for where, raw in read_jsonl(path):
        row = _Row(where, raw, fields, '"prompt", "completion" and "label"')
        label = row.get("label")
        if not isinstance(label, bool):
            raise UserError(f'{where}: "{row.key("label")}" must be true or false (desirable or not), got '
                            f'{_type(label)} — fix the row')
        prompt, answer = row.get("prompt"), row.get("completion")
        if isinstance(prompt, list):
            p, _ = _chat(tok, where, prompt, add_generation_prompt=True)
            if isinstance(answer, list) and not (answer and isinstance(answer[-1], dict)
                                                 and answer[-1].get("role") == "assistant"):
                raise UserError(f'{where}: "{row.key("completion")}" is a list of messages that does not end with '
                                f'an assistant message — give the answer as a string or as assistant message(s)')
            turn = answer if isinstance(answer, list) else [{"role": "assistant", "content": row.text("completion")}]
            ids, mask = _chat(tok, where, prompt + turn)
            n = common_prefix_len(p, ids)
            p, a = p[:n], [(t, t if m else IGNORE) for t, m in zip(ids[n:], mask[n:])]
        else:
            if isinstance(answer, list):
                raise UserError(f'{where}: "{row.key("completion")}" is a list of messages but '
                                f'"{row.key("prompt")}" is a string — give both as messages or both as strings')
            p = bos + tok.encode(row.text("prompt"))
            a = [(t, t) for t in tok.encode(row.text("completion"), continuation=True) + eos]
        p, (a,), cut = _fit(p, [a], max_len, max_prompt_len, truncation_side, tok.bos_id)
        out.truncated += cut
        ex = {"input_ids": p + [t for t, _ in a], "labels": [IGNORE] * len(p) + [lab for _, lab in a],
              "label": label, "prompt_len": len(p)}
        if _targets(ex["labels"]) == 0:
            out.skipped += 1
            continue
        out.append(ex)
    return out


# --------------------------------------------------------------------------- batch order


class Batcher:
    """Deterministic batches of example indices, epoch after epoch, resumable exactly.

    The order of epoch `e` is a pure function of `(seed, e)`: indices are shuffled, then (with
    `group_by_length`) cut into mega-batches of `mega_batch` batches, each sorted by length and
    cut into batches, and the batch order is shuffled again — so batches hold similar lengths
    (little padding) while their order stays random. Iterating yields the remaining batches of
    the current epoch; the next iteration starts the next epoch. `state_dict()` records the
    epoch and how many batches were handed out, so a resumed run sees exactly the rest.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, *, seed: int, shuffle: bool = True,
                 group_by_length: bool = True, drop_last: bool = False, mega_batch: int = 50):
        if batch_size < 1:
            raise UserError(f"batch_size={batch_size}: must be >= 1")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.group_by_length = group_by_length
        self.drop_last = drop_last
        self.mega_batch = mega_batch
        if len(self) == 0:
            raise UserError(f"data: {len(self.lengths)} examples make no batch of {batch_size} with drop_last — "
                            f"lower batch_size or add data")
        self.epoch = 0
        self.position = 0  # batches of `epoch` already handed out

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All batches of `epoch`, in order."""
        n, bs = len(self.lengths), self.batch_size
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        if not self.group_by_length:
            batches = [order[i : i + bs] for i in range(0, n, bs)]
        else:
            chunk = bs * self.mega_batch
            batches = []
            for s in range(0, n, chunk):
                part = order[s : s + chunk]
                part = part[np.argsort(-self.lengths[part], kind="stable")]  # longest first
                batches += [part[i : i + bs] for i in range(0, len(part), bs)]
        if self.drop_last and batches and len(batches[-1]) < bs:
            batches.pop()
        if self.group_by_length and self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return [[int(i) for i in b] for b in batches]

    def __iter__(self) -> Iterator[list[int]]:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        batches = self.epoch_batches(self.epoch)
        while self.position < len(batches):
            b = batches[self.position]
            self.position += 1
            yield b

    def _fingerprint(self) -> str:
        """Which data the order belongs to: count and a checksum of the lengths."""
        return f"{len(self.lengths)}:{int(np.sum(self.lengths * (np.arange(len(self.lengths)) % 9973 + 1)))}"

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position in the data order (the order itself follows from seed and epoch)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "batch_size": self.batch_size, "shuffle": self.shuffle,
                "group_by_length": self.group_by_length, "drop_last": self.drop_last,
                "mega_batch": self.mega_batch, "data": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` was taken; the data and order settings must be the same."""
        for k in ("seed", "batch_size", "shuffle", "group_by_length", "drop_last", "mega_batch"):
            if k in state and state[k] != getattr(self, k):
                raise UserError(f"resume: the data order was saved with {k}={state[k]}, this run has "
                                f"{k}={getattr(self, k)} — resume with the same settings")
        if "data" in state and state["data"] != self._fingerprint():
            raise UserError("resume: the training data changed since the checkpoint (example count or "
                            "lengths differ) — resume with the same data and tokenizer, or start a new run")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# --------------------------------------------------------------------------- collators


def _pad(rows: Sequence[Sequence[int]], value: int, length: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return out


def _mask(rows: Sequence[Sequence[int]], length: int) -> torch.Tensor:
    out = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = 1
    return out


def collate_causal(examples: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """`input_ids`, `attention_mask`, `labels` (B, T), right-padded to the longest example
    (pads: `pad_id` in inputs, 0 in the mask, -100 in labels)."""
    ids = [ex["input_ids"] for ex in examples]
    T = max(len(r) for r in ids)
    return {"input_ids": _pad(ids, pad_id, T), "attention_mask": _mask(ids, T),
            "labels": _pad([ex["labels"] for ex in examples], IGNORE, T)}


def collate_seq2seq(examples: Sequence[dict], pad_id: int, decoder_start_id: int | None = None) -> dict[str, torch.Tensor]:
    """Encoder `input_ids` / `attention_mask` (B, S), decoder `labels` (B, T) padded with -100,
    and `decoder_input_ids` = labels shifted right behind `decoder_start_id` (default: pad, as
    T5) with `decoder_attention_mask`."""
    start = pad_id if decoder_start_id is None else decoder_start_id
    src = [ex["input_ids"] for ex in examples]
    tgt = [ex["labels"] for ex in examples]
    S, T = max(len(r) for r in src), max(len(r) for r in tgt)
    labels = _pad(tgt, IGNORE, T)
    dec = torch.cat([torch.full((len(tgt), 1), start, dtype=torch.long), labels[:, :-1]], dim=1)
    return {"input_ids": _pad(src, pad_id, S), "attention_mask": _mask(src, S),
            "labels": labels, "decoder_input_ids": dec.masked_fill(dec == IGNORE, pad_id),
            "decoder_attention_mask": _mask(tgt, T)}


def collate_preference(examples: Sequence[dict], pad_id: int) -> dict[str, Any]:
    """One batch of 2B rows, `[chosen_0..chosen_{B-1}; rejected_0..rejected_{B-1}]`, padded to a
    common length (one forward computes both), plus `num_pairs` = B."""
    rows = [ex["chosen_ids"] for ex in examples] + [ex["rejected_ids"] for ex in examples]
    labels = [ex["chosen_labels"] for ex in examples] + [ex["rejected_labels"] for ex in examples]
    T = max(len(r) for r in rows)
    return {"input_ids": _pad(rows, pad_id, T), "attention_mask": _mask(rows, T),
            "labels": _pad(labels, IGNORE, T), "num_pairs": len(examples)}
