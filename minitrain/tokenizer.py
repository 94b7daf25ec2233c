"""One tokenizer interface over `tokenizer.json` (HF `tokenizers`) and sentencepiece models.

`Tokenizer.from_folder(path)` reads a model folder as `save_pretrained` leaves it:

- the vocabulary: `tokenizer.model` / `spiece.model` (sentencepiece) or `tokenizer.json`
  (`tokenizers`). When both exist the sentencepiece file wins: it is what the model was trained
  with, and HF's converted `tokenizer.json` can differ from it (e.g. on runs of spaces).
- special tokens from `tokenizer_config.json` / `special_tokens_map.json` (bos/eos/pad/unk and
  `added_tokens_decoder` / `added_tokens.json`), falling back to the ids stored in the
  sentencepiece model.

Conventions that matter for training:

- `encode(text)` never adds bos/eos unless asked; special and added tokens written in the text
  (e.g. `"</s>"`, `"<extra_id_0>"`) become their single ids, as in transformers.
- `decode(ids)` drops ids `< 0` (e.g. the `-100` of masked labels) and ids outside the
  vocabulary (e.g. the padded rows of a model's embedding), so decoding labels never crashes.
- `pad_id`: the tokenizer's pad token; when it defines none, `eos_id` (or 0 when there is no eos
  either), with a warning once. Padding is always masked (attention mask 0, label -100), so the
  value only needs to be a valid id.
- T5 (`spiece.model`): `<extra_id_N>` sentinels follow the sentencepiece vocabulary with
  `id = sp_vocab + extra_ids - 1 - N` (`extra_ids` from `tokenizer_config.json`, default 100 as
  in transformers' T5Tokenizer); T5 has no bos; pad 0 doubles as the decoder start token.

Chat formats (`chat_format`): `"mistral"`, `"llama2"`, `"llama3"`; `encode_chat(messages)` builds
ids turn by turn, with special tokens inserted by id, so the target mask is exact. Text between
two special tokens is encoded the way each model's reference does it:

- sentencepiece files: each text piece is encoded on its own by sentencepiece (Meta's Llama-2
  code, mistral-common), whose dummy prefix stands for the one space the HF chat templates write
  after a special token;
- `tokenizer.json` files: as transformers tokenizes the rendered template, i.e. the text as it
  follows the preceding special token.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

from minitrain.errors import UserError

CHAT_FORMATS = ("mistral", "llama2", "llama3")
_SP_FILES = ("tokenizer.model", "spiece.model")
_HF_FILE = "tokenizer.json"
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


# --------------------------------------------------------------------------- backends


class _SentencePiece:
    """sentencepiece model plus a table of added tokens (ids after the sentencepiece vocab).

    sentencepiece never matches its control symbols (`<s>`, `[INST]`, ...) in text, and knows
    nothing of tokens added after training, so `encode` splits the text on those strings first.
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

    def split(self, text: str) -> list[str | int]:
        """Text split on special strings: pieces of plain text and special ids, in order."""
        if not self.specials:
            return [text] if text else []
        if self._pattern is None:
            keys = sorted(self.specials, key=len, reverse=True)
            self._pattern = re.compile("|".join(re.escape(k) for k in keys if k))
        out: list[str | int] = []
        pos = 0
        for m in self._pattern.finditer(text):
            if m.start() > pos:
                out.append(text[pos : m.start()])
            out.append(self.specials[m.group()])
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
                continuation = True
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
                if out and self.sp.id_to_piece(run[0]).startswith("▁"):
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


class _HFTokenizers:
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


# --------------------------------------------------------------------------- helpers


def _token_str(value) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, `{"content": ...}` or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read JSON ({e}) — fix or remove the file") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object — fix or remove the file")
    return data


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------------- Tokenizer


class Tokenizer:
    """Encode / decode / chat-format text for training, over either backend (see module doc)."""

    def __init__(
        self,
        backend: _SentencePiece | _HFTokenizers,
        *,
        bos: str | None = None,
        eos: str | None = None,
        pad: str | None = None,
        unk: str | None = None,
        chat_format: str | None = None,
        chat_template: str | None = None,
        extra_ids: int = 0,
        source: str = "tokenizer",
        config: dict | None = None,
    ):
        self._b = backend
        self._config = dict(config or {})  # tokenizer_config.json as read, kept by save()
        self.source = source
        self.extra_ids = extra_ids
        self.chat_template = chat_template
        self._pad_warned = False
        ids = {}
        for name, tok in (("bos", bos), ("eos", eos), ("pad", pad), ("unk", unk)):
            if tok is None:
                ids[name] = None
                continue
            idx = backend.token_to_id(tok)
            if idx is None:
                raise UserError(
                    f"{source}: {name}_token {tok!r} is not in the vocabulary — fix "
                    f"{name}_token in tokenizer_config.json or add the token"
                )
            if isinstance(backend, _SentencePiece):
                backend.register(tok, idx)
            ids[name] = idx
        self._bos, self._eos, self._pad, self._unk = ids["bos"], ids["eos"], ids["pad"], ids["unk"]
        self._chat_format: str | None = None
        self.chat_format = chat_format if chat_format is not None else self._detect_chat_format()

    # ------------------------------------------------------------------ loading / saving

    @classmethod
    def from_folder(
        cls, path: str | Path, *, chat_format: str | None = None, backend: str | None = None
    ) -> "Tokenizer":
        """Load the tokenizer files of a model folder (see the module doc for what is read).

        `chat_format` overrides detection; `backend` ("sentencepiece" or "tokenizers") picks a
        file when a folder has both.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise UserError(f"{folder}: not a folder — pass the model folder holding the tokenizer files")
        config: dict = {}
        for name in reversed(_CONFIG_FILES):  # tokenizer_config.json wins over the map
            if (folder / name).is_file():
                config.update(_read_json(folder / name))
        sp_file = next((folder / n for n in _SP_FILES if (folder / n).is_file()), None)
        hf_file = folder / _HF_FILE if (folder / _HF_FILE).is_file() else None
        if backend not in (None, "sentencepiece", "tokenizers"):
            raise UserError(f"backend={backend!r}: unknown — use 'sentencepiece' or 'tokenizers'")
        if backend == "tokenizers" or (backend is None and sp_file is None):
            sp_file = None
        if backend == "sentencepiece":
            hf_file = None
        if sp_file is None and hf_file is None:
            looked = ", ".join(_SP_FILES + (_HF_FILE,)) if backend is None else (
                _HF_FILE if backend == "tokenizers" else ", ".join(_SP_FILES))
            raise UserError(
                f"{folder}: no tokenizer file (looked for {looked}) — copy the tokenizer files "
                f"of the base model into this folder"
            )
        extra_ids = 0
        if sp_file is not None:
            b, extra_ids = cls._load_sentencepiece(sp_file, folder, config)
        else:
            import tokenizers

            try:
                tok = tokenizers.Tokenizer.from_file(str(hf_file))
            except Exception as e:  # the library's own parse error: the file is bad
                raise UserError(f"{hf_file}: cannot load ({e}) — the file is not a valid tokenizer.json") from None
            b = _HFTokenizers(tok)
        sp_ids = b.sp if isinstance(b, _SentencePiece) else None

        def special(key: str, sp_default: int) -> str | None:
            if key in config:
                return _token_str(config[key])
            if sp_ids is not None and sp_default >= 0:
                return sp_ids.id_to_piece(sp_default)
            return None

        return cls(
            b,
            bos=special("bos_token", sp_ids.bos_id() if sp_ids else -1),
            eos=special("eos_token", sp_ids.eos_id() if sp_ids else -1),
            pad=special("pad_token", sp_ids.pad_id() if sp_ids else -1),
            unk=special("unk_token", sp_ids.unk_id() if sp_ids else -1),
            chat_format=chat_format or config.get("minitrain_chat_format"),
            chat_template=config.get("chat_template") if isinstance(config.get("chat_template"), str) else None,
            extra_ids=extra_ids,
            source=str(folder),
            config=config,
        )

    @staticmethod
    def _load_sentencepiece(sp_file: Path, folder: Path, config: dict) -> tuple[_SentencePiece, int]:
        try:
            b = _SentencePiece(sp_file.read_bytes(), file_name=sp_file.name)
        except (RuntimeError, OSError) as e:
            raise UserError(f"{sp_file}: cannot load ({e}) — the file is not a sentencepiece model") from None
        # added tokens, by id: tokenizer_config.json's added_tokens_decoder, added_tokens.json
        by_id: dict[int, str] = {}
        for k, v in (config.get("added_tokens_decoder") or {}).items():
            content = _token_str(v)
            if content is not None and str(k).isdigit():
                by_id[int(k)] = content
        if (folder / "added_tokens.json").is_file():
            for content, i in _read_json(folder / "added_tokens.json").items():
                if isinstance(i, int):
                    by_id.setdefault(i, content)
        for i, content in by_id.items():
            if i < b.base:
                b.register(content, i)
        extra = sorted(i for i in by_id if i >= b.base)
        if extra and extra != list(range(b.base, b.base + len(extra))):
            raise UserError(
                f"{folder}: added token ids {extra[:3]}... do not follow the sentencepiece vocabulary "
                f"({b.base} pieces) without gaps — re-save the tokenizer"
            )
        b.add(by_id[i] for i in extra)
        default_extra = 100 if sp_file.name == "spiece.model" else 0  # HF's T5 vocab file
        extra_ids = config.get("extra_ids", default_extra)
        if not isinstance(extra_ids, int) or extra_ids < 0:
            raise UserError(f"{folder}/tokenizer_config.json: extra_ids={extra_ids!r} — must be an integer >= 0")
        if extra_ids and not extra:  # T5 sentinels: <extra_id_99> first, <extra_id_0> last
            b.add(f"<extra_id_{extra_ids - 1 - i}>" for i in range(extra_ids))
        # special tokens listed without ids (transformers v5 `extra_special_tokens`, v4
        # `additional_special_tokens`) follow, in their order, unless already in the vocabulary
        for key in ("additional_special_tokens", "extra_special_tokens"):
            listed = config.get(key)
            if isinstance(listed, list):
                b.add(t for t in map(_token_str, listed) if t is not None)
        return b, extra_ids

    def save(self, folder: str | Path) -> None:
        """Write the vocabulary file and `tokenizer_config.json` (loadable by `from_folder`)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        b = self._b
        added: dict[str, dict] = {}
        if isinstance(b, _SentencePiece):
            (folder / b.file_name).write_bytes(b.proto)
            for tok, i in sorted(b.specials.items(), key=lambda kv: kv[1]):
                added[str(i)] = {"content": tok, "special": True, "lstrip": False, "rstrip": False,
                                 "normalized": False, "single_word": False}
        else:
            b.tok.save(str(folder / _HF_FILE))
            for i, t in sorted(b.tok.get_added_tokens_decoder().items()):
                added[str(i)] = {"content": t.content, "special": t.special, "lstrip": t.lstrip,
                                 "rstrip": t.rstrip, "normalized": t.normalized,
                                 "single_word": t.single_word}
        config = {k: v for k, v in self._config.items() if k not in ("backend", "tokenizer_file", "vocab_file")}
        config.update({
            "bos_token": self.id_to_token(self._bos) if self._bos is not None else None,
            "eos_token": self.id_to_token(self._eos) if self._eos is not None else None,
            "pad_token": self.id_to_token(self._pad) if self._pad is not None else None,
            "unk_token": self.id_to_token(self._unk) if self._unk is not None else None,
            "added_tokens_decoder": added,
            "add_bos_token": False,
            "add_eos_token": False,
            "minitrain_chat_format": self.chat_format,
        })
        for key in ("additional_special_tokens", "extra_special_tokens"):
            config.pop(key, None)  # all added tokens are in added_tokens_decoder, with their ids
        if isinstance(b, _SentencePiece):
            config["extra_ids"] = self.extra_ids
            default_class = "T5Tokenizer" if b.file_name == "spiece.model" else "LlamaTokenizer"
            config.setdefault("tokenizer_class", default_class)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        tmp = folder / "tokenizer_config.json.tmp"
        tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
        tmp.replace(folder / "tokenizer_config.json")

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (what the model's embedding must cover)."""
        return self._b.vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def unk_id(self) -> int | None:
        return self._unk

    @property
    def pad_id(self) -> int:
        """The pad token; without one, eos (or 0 without eos), said once in a `note:` line."""
        if self._pad is not None:
            return self._pad
        fallback = self._eos if self._eos is not None else 0
        if not self._pad_warned:  # one log line (under torchrun: rank 0's), not a warning with its source line
            self._pad_warned = True
            what = "eos" if self._eos is not None else "0"
            if os.environ.get("RANK", "0") == "0":
                print(f"note: {self.source}: the tokenizer defines no pad token; padding with {what} (id {fallback}); "
                      f"padded positions are masked, so this is safe", flush=True)
        return fallback

    @property
    def decoder_start_id(self) -> int:
        """Encoder-decoder (T5) decoder start token: the pad id."""
        return self.pad_id

    def token_to_id(self, token: str) -> int | None:
        return self._b.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self._b.id_to_token(idx)

    def add_special_tokens(self, tokens: Sequence[str]) -> int:
        """Add tokens as single, unsplittable special ids after the vocabulary.

        Returns how many were new (tokens already in the vocabulary keep their id). Resize the
        model's embeddings to `vocab_size` afterwards.
        """
        if isinstance(tokens, str):
            tokens = [tokens]
        for t in tokens:
            if not isinstance(t, str) or not t:
                raise UserError(f"add_special_tokens: {t!r} — tokens must be non-empty strings")
        return self._b.add(tokens)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, *, bos: bool = False, eos: bool = False, continuation: bool = False) -> list[int]:
        """Token ids of `text`; bos / eos only when asked (and a UserError if there is none).

        `continuation=True` encodes `text` as it follows earlier text (a completion after its
        prompt): no sentencepiece dummy prefix / Metaspace "▁" is invented, so `"Paris"` after
        `"...\n"` is `Paris`, not `▁Paris`; a leading space in `text` is kept as written.
        """
        ids = self._b.encode(text, continuation)
        if bos:
            ids.insert(0, self._need("bos"))
        if eos:
            ids.append(self._need("eos"))
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        """Text of `ids` (list, tuple, tensor or array); ids < 0 (e.g. -100) are padding: dropped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        n = self.vocab_size
        return self._b.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special)

    def _need(self, name: str) -> int:
        idx = getattr(self, f"_{name}")
        if idx is None:
            raise UserError(
                f"{self.source}: the tokenizer has no {name} token — set {name}_token in tokenizer_config.json"
            )
        return idx

    # ------------------------------------------------------------------ chat

    @property
    def chat_format(self) -> str | None:
        return self._chat_format

    @chat_format.setter
    def chat_format(self, value: str | None) -> None:
        if value is not None and value not in CHAT_FORMATS:
            raise UserError(f"chat_format={value!r}: unknown — use one of {', '.join(CHAT_FORMATS)}")
        self._chat_format = value

    def _detect_chat_format(self) -> str | None:
        """From the vocabulary (llama3 header tokens, mistral [INST]) or the chat template."""
        if self.token_to_id("<|start_header_id|>") is not None and self.token_to_id("<|eot_id|>") is not None:
            return "llama3"
        t = self.chat_template or ""
        if "<|start_header_id|>" in t:
            return "llama3"
        if "<<SYS>>" in t:
            return "llama2"
        if "[INST]" in t or self._special("[INST]") is not None:
            return "mistral"
        return None

    def _special(self, token: str) -> int | None:
        """Id of `token` when it is one special token of the vocabulary (not plain text)."""
        idx = self.token_to_id(token)
        return idx if idx is not None and self._b.is_special(idx) else None

    def encode_chat(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = False
    ) -> tuple[list[int], list[bool]]:
        """Ids of a conversation in `chat_format`, and the target mask.

        `target_mask[i]` is True on assistant content tokens and on the token ending each
        assistant turn (eos / `<|eot_id|>`), False elsewhere. Messages are dicts with `role`
        (system / user / assistant) and string `content`; errors are UserErrors naming the message.
        `add_generation_prompt` appends the assistant header (llama3); the [INST] formats need
        nothing, their prompt already ends with `[/INST]`.
        """
        if self.chat_format is None:
            raise UserError(
                f"{self.source}: the tokenizer has no chat format — set chat_format to one of "
                f"{', '.join(CHAT_FORMATS)}"
            )
        msgs = _check_messages(messages, alternate=self.chat_format != "llama3")
        build = {"mistral": self._mistral, "llama2": self._llama2, "llama3": self._llama3}
        items = build[self.chat_format](msgs, add_generation_prompt)
        return self._render(items)

    # A chat is a list of items: (special id, target) or (text, target). Consecutive texts form
    # one span, encoded together (see the module doc); the target boundaries inside a span are
    # found by encoding its prefixes.

    def _render(self, items: list[tuple[int | str, bool]]) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        mask: list[bool] = []
        span: list[tuple[str, bool]] = []
        prev_special: int | None = None

        def flush() -> None:
            if not span:
                return
            texts = [t for t, _ in span]
            full = self._encode_span("".join(texts), prev_special)
            cuts = [0]
            for k in range(1, len(texts)):
                cuts.append(max(cuts[-1], common_prefix_len(self._encode_span("".join(texts[:k]), prev_special), full)))
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

    def _encode_span(self, text: str, after: int | None) -> list[int]:
        b = self._b
        if isinstance(b, _HFTokenizers) and after is not None:
            return b.encode_after(after, text)
        if isinstance(b, _SentencePiece) and after is not None and b.prefix_space and text.startswith(" "):
            text = text[1:]  # sentencepiece's dummy prefix stands for the template's space
        return b.encode(text)

    def _mistral(self, msgs: list[dict], gen: bool) -> list[tuple[int | str, bool]]:
        """Mistral instruct. With `[INST]` as plain text (tokenizer v1, Mistral-7B-Instruct
        v0.1/v0.2): `<s> [INST] {system}\\n\\n{user} [/INST] {assistant}</s> [INST] ...`, the system
        message joined to the first user message. With `[INST]` as a control token (v2/v3):
        `<s>[INST] {user}[/INST] {assistant}</s>`, the system message joined to the last user
        message, or in `[SYSTEM_PROMPT]...[/SYSTEM_PROMPT]` after bos where the vocabulary has it
        (v7) — as mistral-common does."""
        bos, eos = self._need("bos"), self._need("eos")
        system, turns = _split_system(msgs)
        inst, end_inst = self._special("[INST]"), self._special("[/INST]")
        items: list[tuple[int | str, bool]] = [(bos, False)]
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
        sys_open, sys_close = self._special("[SYSTEM_PROMPT]"), self._special("[/SYSTEM_PROMPT]")
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

    def _llama2(self, msgs: list[dict], gen: bool) -> list[tuple[int | str, bool]]:
        """Llama-2 chat: `<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} </s>`
        per turn (contents stripped), as meta-llama/Llama-2-*-chat-hf's template and Meta's code."""
        bos, eos = self._need("bos"), self._need("eos")
        system, turns = _split_system(msgs)
        items: list[tuple[int | str, bool]] = []
        for i, m in enumerate(turns):
            content = m["content"]
            if i == 0 and system is not None:
                content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content
            if m["role"] == "user":
                items += [(bos, False), ("[INST] " + content.strip() + " [/INST]", False)]
            else:
                items += [(" " + content.strip() + " ", True), (eos, True)]
        return items

    def _llama3(self, msgs: list[dict], gen: bool) -> list[tuple[int | str, bool]]:
        """Llama-3 instruct: `<|begin_of_text|>` then per message
        `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content.strip()}<|eot_id|>`."""
        bos = self._need("bos")
        ids = {t: self._special(t) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise UserError(
                f"{self.source}: chat_format 'llama3' needs the special tokens {', '.join(missing)} — "
                f"use a Llama-3 tokenizer or another chat_format"
            )
        sh, eh, eot = ids["<|start_header_id|>"], ids["<|end_header_id|>"], ids["<|eot_id|>"]
        items: list[tuple[int | str, bool]] = [(bos, False)]
        for m in msgs:
            t = m["role"] == "assistant"
            items += [(sh, False), (m["role"], False), (eh, False), ("\n\n", False),
                      (m["content"].strip(), t), (eot, t)]
        if gen:
            items += [(sh, False), ("assistant", False), (eh, False), ("\n\n", False)]
        return items

    def __repr__(self) -> str:
        kind = "sentencepiece" if isinstance(self._b, _SentencePiece) else "tokenizers"
        return (f"Tokenizer({self.source!r}, {kind}, vocab_size={self.vocab_size}, bos={self._bos}, "
                f"eos={self._eos}, pad={self._pad}, chat_format={self.chat_format!r})")


def _check_messages(messages, *, alternate: bool) -> list[dict]:
    """Validate a chat: a non-empty list of {role, content: str}; for [INST] formats an optional
    first system message, then user/assistant turns alternating from user."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError("messages: must be a non-empty list of {\"role\", \"content\"} objects — fix the row")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"messages[{i}]: expected an object with \"role\" and \"content\", got {type(m).__name__} — fix the row")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant"):
            raise UserError(f"messages[{i}]: role {role!r} — use \"system\", \"user\" or \"assistant\"")
        if not isinstance(content, str):
            raise UserError(f"messages[{i}]: content must be a string, got {type(content).__name__} — fix the row")
        if not content.strip():
            raise UserError(f"messages[{i}]: empty content — remove the message or fill it")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"messages[{i}]: content holds a lone surrogate (a broken \\u escape) — fix the text") from None
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


def _split_system(msgs: list[dict]) -> tuple[str | None, list[dict]]:
    if msgs[0]["role"] == "system":
        return msgs[0]["content"], msgs[1:]
    return None, msgs
