"""The two tokenizer backends behind `minitrain.text.tokenizer.Tokenizer`.

- `SentencePiece`: a sentencepiece model (`tokenizer.model`, `spiece.model`) plus a table of
  tokens added after training; special strings are matched in text before sentencepiece runs.
- `HFTokenizers`: a `tokenizers.Tokenizer` read from `tokenizer.json` (added tokens inside it).

Both answer the same small set of calls (vocab_size, add, token_to_id, id_to_token,
is_special, encode(text, continuation), decode(ids, skip_special)); `Tokenizer` holds one.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence


class SentencePiece:
    """sentencepiece model plus a table of added tokens (ids after the sentencepiece vocab).

    sentencepiece never matches its control symbols (`<s>`, `[INST]`, ...) in text, and knows
    nothing of tokens added after training, so `encode` splits the text on those strings first.
    A token marked `rstrip` / `lstrip` in `tokenizer_config.json` (Phi-3's `<|user|>`, `<|end|>`)
    takes the whitespace on that side with it, as transformers' added tokens do.
    """

    def __init__(self, model_proto: bytes, added: Sequence[str] = (), file_name: str = "tokenizer.model"):
        import sentencepiece as spm

        self.proto = model_proto
        self.file_name = file_name
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.base = self.sp.get_piece_size()
        self.added: list[str] = []
        # strings matched in text -> id: control / unknown pieces of the model, and added tokens
        self.specials: dict[str, int] = {
            self.sp.id_to_piece(i): i
            for i in range(self.base)
            if self.sp.is_control(i) or self.sp.is_unknown(i)
        }
        self._pattern: re.Pattern | None = None
        self._keys: list[str] = []
        self.strip: dict[str, tuple[bool, bool]] = {}  # token -> (lstrip, rstrip)
        # transformers' `legacy=True` (tokenizer_config.json): text after a special token gets
        # sentencepiece's dummy prefix like any other text; otherwise it continues the token
        self.legacy = False
        self.add(added)
        first = self.sp.encode("a", out_type=str)
        self.prefix_space = bool(first) and first[0].startswith("▁")

    @property
    def vocab_size(self) -> int:
        return self.base + len(self.added)

    def add(self, tokens: Iterable[str]) -> int:
        n = 0
        for t in tokens:
            if self.token_to_id(t) is not None:
                self.specials.setdefault(t, self.token_to_id(t))
                continue
            self.added.append(t)
            self.specials[t] = self.base + len(self.added) - 1
            n += 1
        self._pattern = None
        self._special_ids = set(self.specials.values())
        return n

    def register(self, token: str, idx: int) -> None:
        """Make an existing id's string (e.g. a pad piece) a special string matched in text."""
        self.specials[token] = idx
        self._special_ids.add(idx)
        self._pattern = None

    def set_strip(self, token: str, lstrip: bool, rstrip: bool) -> None:
        """Whether `token`, matched in text, also takes the whitespace before / after it."""
        self.strip[token] = (lstrip, rstrip)
        self._pattern = None

    def token_to_id(self, token: str) -> int | None:
        if token in self.specials:
            return self.specials[token]
        i = self.sp.piece_to_id(token)
        if i != self.sp.unk_id() or token == self.sp.id_to_piece(i):
            return i
        return None

    def id_to_token(self, idx: int) -> str | None:
        if 0 <= idx < self.base:
            return self.sp.id_to_piece(idx)
        if self.base <= idx < self.vocab_size:
            return self.added[idx - self.base]
        return None

    def is_special(self, idx: int) -> bool:
        return idx >= self.base or self.sp.is_control(idx) or idx in self._special_ids

    def special_strings(self) -> list[str]:
        return [t for t in self.specials if t]

    def split(self, text: str) -> list[str | int]:
        """Text split on special strings: pieces of plain text and special ids, in order."""
        if not self.specials:
            return [text] if text else []
        if self._pattern is None:
            self._keys = [k for k in sorted(self.specials, key=len, reverse=True) if k]
            alts = []
            for i, k in enumerate(self._keys):
                lstrip, rstrip = (r"\s*" if flag else "" for flag in self.strip.get(k, (False, False)))
                alts.append(f"(?P<t{i}>{lstrip}{re.escape(k)}{rstrip})")
            self._pattern = re.compile("|".join(alts))
        out: list[str | int] = []
        pos = 0
        for m in self._pattern.finditer(text):
            if m.start() > pos:
                out.append(text[pos : m.start()])
            out.append(self.specials[self._keys[int(m.lastgroup[1:])]])
            pos = m.end()
        if pos < len(text):
            out.append(text[pos:])
        return out

    def encode(self, text: str, continuation: bool = False) -> list[int]:
        """Ids of `text`; text after a special string (or all of it, with `continuation`) is
        encoded as continuing text, without sentencepiece's dummy prefix."""
        ids: list[int] = []
        for piece in self.split(text):
            if isinstance(piece, int):
                ids.append(piece)
                continuation = not self.legacy
            elif continuation:
                ids.extend(self.encode_continuation(piece))
            else:
                ids.extend(self.sp.encode(piece))
        return ids

    def encode_continuation(self, text: str) -> list[int]:
        """sentencepiece ids of `text` as it continues earlier text: no dummy prefix is added.

        sentencepiece has no switch for its dummy prefix, so `text` is encoded behind an anchor
        string ("<unk>", which sentencepiece spells out as plain pieces) whose pieces are then
        dropped, as transformers' slow Llama tokenizer did. If the anchor's pieces merged with
        the text, the plain encoding is used instead.
        """
        if not self.prefix_space or not text:
            return self.sp.encode(text)
        anchor = self.sp.encode("<unk>")
        ids = self.sp.encode("<unk>" + text)
        if ids[: len(anchor)] != anchor:
            return self.sp.encode(text)
        return ids[len(anchor) :]

    def decode(self, ids: list[int], skip_special: bool) -> str:
        if skip_special:
            return self.sp.decode([i for i in ids if not self.is_special(i)])
        out: list[str] = []
        run: list[int] = []

        def flush() -> None:
            if run:
                text = self.sp.decode(run)
                # sentencepiece drops the space of its dummy prefix when decoding; a model without
                # one (Gemma) keeps it already
                if out and self.prefix_space and self.sp.id_to_piece(run[0]).startswith("▁"):
                    text = " " + text
                out.append(text)
                run.clear()

        for i in ids:
            if self.is_special(i):
                flush()
                out.append(self.id_to_token(i) or "")
            else:
                run.append(i)
        flush()
        return "".join(out)


class HFTokenizers:
    """A `tokenizers.Tokenizer` from `tokenizer.json` (added tokens live inside it)."""

    def __init__(self, tok):
        self.tok = tok
        tok.no_truncation()
        tok.no_padding()
        self.prefix_space = self._adds_prefix_space()
        # a special token to put text behind, so that it is encoded as continuing text
        self.anchor = min((i for i, t in tok.get_added_tokens_decoder().items() if t.special), default=None)

    def _adds_prefix_space(self) -> bool:
        toks = self.tok.encode("a", add_special_tokens=False).tokens
        return bool(toks) and toks[0][:1] in ("▁", "Ġ")

    @property
    def vocab_size(self) -> int:
        return max(self.tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def add(self, tokens: Iterable[str]) -> int:
        from tokenizers import AddedToken

        before = self.vocab_size
        new = [t for t in tokens if self.tok.token_to_id(t) is None]
        self.tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in new])
        return self.vocab_size - before

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self.tok.id_to_token(idx)

    def is_special(self, idx: int) -> bool:
        t = self.tok.get_added_tokens_decoder().get(idx)
        return bool(t is not None and t.special)

    def special_strings(self) -> list[str]:
        return [t.content for t in self.tok.get_added_tokens_decoder().values() if t.special and t.content]

    def encode(self, text: str, continuation: bool = False) -> list[int]:
        if continuation and self.anchor is not None:
            return self.encode_after(self.anchor, text)
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_after(self, anchor_id: int, text: str) -> list[int]:
        """`text` tokenized as it follows the special token `anchor_id` in a longer string."""
        anchor = self.tok.id_to_token(anchor_id)
        ids = self.tok.encode(anchor + text, add_special_tokens=False).ids
        if not ids or ids[0] != anchor_id:  # the anchor did not survive as one id: no context
            return self.tok.encode(text, add_special_tokens=False).ids
        return ids[1:]

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

