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

Chat formats (`chat_format`): `"mistral"`, `"llama2"`, `"llama3"`, written by hand in
`minitrain.text.chat_formats`; `encode_chat(messages)` builds ids turn by turn, with special tokens
inserted by id, so the target mask is exact. The backends live in `minitrain.text.backends`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from minitrain.errors import UserError
from minitrain.text import chat_formats
from minitrain.text.backends import HFTokenizers, SentencePiece
from minitrain.text.chat_formats import CHAT_FORMATS, FORMATS
from minitrain.text.chat_template import (CARRIED, RESERVED, ChatTemplate, carried_fits, has_generation_markers,
                                          read_templates)

_SP_FILES = ("tokenizer.model", "spiece.model")
_HF_FILE = "tokenizer.json"
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


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



# --------------------------------------------------------------------------- Tokenizer


class Tokenizer:
    """Encode / decode / chat-format text for training, over either backend (see module doc)."""

    def __init__(
        self,
        backend: SentencePiece | HFTokenizers,
        *,
        bos: str | None = None,
        eos: str | None = None,
        pad: str | None = None,
        unk: str | None = None,
        chat_format: str | None = None,
        chat_template: str | None = None,
        chat_templates: dict[str, str] | None = None,
        extra_ids: int = 0,
        source: str = "tokenizer",
        config: dict | None = None,
    ):
        self._b = backend
        self._config = dict(config or {})  # tokenizer_config.json as read, kept by save()
        self.source = source
        self.extra_ids = extra_ids
        self.chat_templates = dict(chat_templates or {})
        if chat_template is not None:
            self.chat_templates["default"] = chat_template
        self.chat_template_kwargs: dict = {}
        self.template_origin = "the checkpoint's chat template"  # or the run's chat_template= (for its log)
        self._template = None
        self._pad_warned = False
        self._add_bos: bool | None = None  # `add_bos`, decided on first use
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
            if isinstance(backend, SentencePiece):
                backend.register(tok, idx)
            ids[name] = idx
        self._bos, self._eos, self._pad, self._unk = ids["bos"], ids["eos"], ids["pad"], ids["unk"]
        self._chat_format: str | None = None
        self.chat_format = chat_format if chat_format is not None or self.chat_template else self._detect_chat_format()

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's chat template ("default" of `chat_templates`), rendered by `encode_chat`
        unless `chat_format` names a hand-written format."""
        return self.chat_templates.get("default")

    @chat_template.setter
    def chat_template(self, value: str | None) -> None:
        if value is None:
            self.chat_templates.pop("default", None)
        else:
            self.chat_templates["default"] = value

    def special_tokens_map(self) -> dict[str, str]:
        """`bos_token`, `eos_token`, ... -> their strings, as transformers passes them to a chat template
        (bos / eos / unk / pad from the ids in use; sep / cls / mask as tokenizer_config.json names them)."""
        out = {}
        for name in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
            idx = getattr(self, f"_{name}", None)
            token = self.id_to_token(idx) if idx is not None else _token_str(self._config.get(f"{name}_token"))
            if token is not None and (idx is not None or self.token_to_id(token) is not None):
                out[f"{name}_token"] = token
        return out

    def special_strings(self) -> list[str]:
        """The strings of the special tokens (control and added special tokens, eos included)."""
        return self._b.special_strings() + ([self.id_to_token(self._eos)] if self._eos is not None else [])

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
            b = HFTokenizers(tok)
        sp_ids = b.sp if isinstance(b, SentencePiece) else None

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
            chat_templates=read_templates(folder, config),
            extra_ids=extra_ids,
            source=str(folder),
            config=config,
        )

    @staticmethod
    def _load_sentencepiece(sp_file: Path, folder: Path, config: dict) -> tuple[SentencePiece, int]:
        try:
            b = SentencePiece(sp_file.read_bytes(), file_name=sp_file.name)
        except (RuntimeError, OSError) as e:
            raise UserError(f"{sp_file}: cannot load ({e}) — the file is not a sentencepiece model") from None
        # added tokens, by id: tokenizer_config.json's added_tokens_decoder, added_tokens.json
        by_id: dict[int, str] = {}
        for k, v in (config.get("added_tokens_decoder") or {}).items():
            content = _token_str(v)
            if content is not None and str(k).isdigit():
                by_id[int(k)] = content
                if isinstance(v, dict) and (v.get("lstrip") or v.get("rstrip")):
                    b.set_strip(content, bool(v.get("lstrip")), bool(v.get("rstrip")))
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
        b.legacy = config.get("legacy") is True
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
        if isinstance(b, SentencePiece):
            (folder / b.file_name).write_bytes(b.proto)
            for tok, i in sorted(b.specials.items(), key=lambda kv: kv[1]):
                lstrip, rstrip = b.strip.get(tok, (False, False))
                added[str(i)] = {"content": tok, "special": True, "lstrip": lstrip, "rstrip": rstrip,
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
            "add_bos_token": self.add_bos,  # what the checkpoint's tokenizer did (Gemma: true, Phi-3: false)
            "add_eos_token": False,
            "minitrain_chat_format": self.chat_format,
        })
        for key in ("additional_special_tokens", "extra_special_tokens"):
            config.pop(key, None)  # all added tokens are in added_tokens_decoder, with their ids
        if isinstance(b, SentencePiece):
            config["extra_ids"] = self.extra_ids
            default_class = "T5Tokenizer" if b.file_name == "spiece.model" else "LlamaTokenizer"
            config.setdefault("tokenizer_class", default_class)
        if set(self.chat_templates) == {"default"}:
            config["chat_template"] = self.chat_template
        elif self.chat_templates:
            config["chat_template"] = [{"name": k, "template": v} for k, v in self.chat_templates.items()]
        tmp = folder / "tokenizer_config.json.tmp"
        tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
        tmp.replace(folder / "tokenizer_config.json")

    # ------------------------------------------------------------------ vocabulary

    @property
    def backend(self) -> SentencePiece | HFTokenizers:
        """The backend that encodes and decodes (see `minitrain.text.backends`)."""
        return self._b

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (what the model's embedding must cover)."""
        return self._b.vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def add_bos(self) -> bool:
        """Whether the checkpoint's own tokenizer puts bos before a text (transformers'
        `add_special_tokens=True`): `add_bos_token` of tokenizer_config.json, else what
        tokenizer.json's post-processor does, else True for a sentencepiece model with a bos
        (LlamaTokenizer's default). Qwen (no bos) and Phi-3 (`add_bos_token: false`) say False,
        Gemma and LLaMA True; `encode(text, bos=tok.add_bos)` gives transformers' ids."""
        if self._add_bos is None:
            self._add_bos = self._decide_add_bos()
        return self._add_bos

    def _decide_add_bos(self) -> bool:
        """`add_bos` from the files; a `note:` line when tokenizer_config.json's flag and tokenizer.json's
        post-processor disagree (transformers 5.24 then follows the post-processor, 4.x the flag)."""
        if self._bos is None:
            return False
        flag = self._config.get("add_bos_token")
        post = None  # what tokenizer.json's post-processor does
        if isinstance(self._b, HFTokenizers):
            post = self._b.tok.encode("a", add_special_tokens=True).ids[:1] == [self._bos]
        if isinstance(flag, bool):
            if post is not None and post != flag and os.environ.get("RANK", "0") == "0":
                # the two files disagree: say which one is followed (once: the answer is kept)
                print(f"note: {self.source}: tokenizer_config.json says add_bos_token={str(flag).lower()} but "
                      f"tokenizer.json's post-processor {'adds' if post else 'does not add'} bos; minitrain "
                      f"follows add_bos_token, as transformers 4 did (transformers 5 follows the post-processor): "
                      f"if the model was trained the other way, correct the file that is wrong", flush=True)
            return flag
        return True if post is None else post

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
            ids.insert(0, self.need_id("bos"))
        if eos:
            ids.append(self.need_id("eos"))
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        """Text of `ids` (list, tuple, tensor or array); ids < 0 (e.g. -100) are padding: dropped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        n = self.vocab_size
        return self._b.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special)

    def need_id(self, name: str) -> int:
        """The id of the bos / eos / pad / unk token; a UserError when the tokenizer has none."""
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
            carried = f" (minitrain carries {value} as a template: chat_template={value})" if value in CARRIED else ""
            raise UserError(f"chat_format={value!r}: unknown — use one of {', '.join(CHAT_FORMATS)}{carried}")
        self._chat_format = value

    def _detect_chat_format(self) -> str | None:
        """For a tokenizer without a chat template: from the vocabulary (llama3 header tokens,
        mistral [INST] control token)."""
        if self.token_to_id("<|start_header_id|>") is not None and self.token_to_id("<|eot_id|>") is not None:
            return "llama3"
        if self.special_id("[INST]") is not None:
            return "mistral"
        return None

    def chat_renderer(self) -> str:
        """How `encode_chat` renders, in words (for the run's log)."""
        if self.chat_format is not None:
            return f"chat_format {self.chat_format}"
        if self.chat_template is not None:
            return self.template_origin + (" (with generation markers)" if has_generation_markers(
                self.chat_template) else "")
        return "no chat template"

    def template(self) -> ChatTemplate:
        """The chat template, compiled, with `chat_template_kwargs` (rebuilt when either changes)."""
        if self.chat_template is None:
            raise UserError(f"{self.source}: the tokenizer has no chat template — {self._template_advice()}")
        t = self._template
        if t is None or t.source != self.chat_template or t.kwargs != self.chat_template_kwargs:
            for k in self.chat_template_kwargs:
                if k in RESERVED:
                    raise UserError(f"chat_template_kwargs: {k!r} is set by minitrain itself — remove it")
            t = self._template = ChatTemplate(self, self.chat_template, kwargs=self.chat_template_kwargs)
        return t

    def _template_advice(self) -> str:
        """What to do about a missing chat template, suggesting only what this vocabulary can render:
        a template minitrain carries whose special tokens it holds, else the hand-written formats
        that render a probe conversation with it."""
        carried = [n for n in CARRIED if carried_fits(n, self.special_id)]
        if carried:
            ways = [f"chat_template={n} (its {' / '.join(CARRIED[n][1])} tokens are in this vocabulary)" for n in carried]
        else:
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
            fits = []
            for name, fmt in FORMATS.items():
                try:
                    fmt(self, probe, False)
                    fits.append(name)
                except UserError:
                    pass
            ways = [f"chat_format={n}" for n in fits]
        return ("give the template the model was trained with: chat_template=path/to/template.jinja"
                + "".join(f", or {w}" for w in ways) + "; or train on prompt / completion or text rows")

    def special_id(self, token: str) -> int | None:
        """Id of `token` when it is one special token of the vocabulary (not plain text)."""
        idx = self.token_to_id(token)
        return idx if idx is not None and self._b.is_special(idx) else None

    def encode_chat(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = False, tools: list[dict] | None = None
    ) -> tuple[list[int], list[bool]]:
        """Ids of a conversation and the target mask: rendered by the checkpoint's chat template
        (`minitrain.text.chat_template`, with `chat_template_kwargs`), or by the hand-written
        `chat_format` when one is set (it overrides the template) or the tokenizer has no template.

        `target_mask[i]` is True on assistant content tokens and on the token ending each
        assistant turn (eos / `<|eot_id|>` / `<|im_end|>` ...), False elsewhere. Messages are dicts
        with `role` and string `content`; errors are UserErrors naming the message.
        `add_generation_prompt` appends the assistant header (llama3, templates); the [INST]
        formats need nothing, their prompt already ends with `[/INST]`. `tools`: JSON schemas of the
        functions offered to the model, rendered by the chat template (the hand-written formats take none).
        """
        if self.chat_format is None and self.chat_template is not None:
            msgs = chat_formats.check_messages(messages, alternate=False, template=True)
            return self.template().encode(msgs, add_generation_prompt, tools=tools)
        if tools:
            raise UserError(f"tools: chat_format={self.chat_format} renders no tools — use the checkpoint's chat "
                            f"template (unset chat_format), or chat_template=path/to/template.jinja with tools")
        if self.chat_format is None:
            raise UserError(f"{self.source}: the tokenizer has no chat template — {self._template_advice()}")
        msgs = chat_formats.check_messages(messages, alternate=self.chat_format != "llama3")
        items = chat_formats.FORMATS[self.chat_format](self, msgs, add_generation_prompt)
        return chat_formats.render(self, items)

    def __repr__(self) -> str:
        kind = "sentencepiece" if isinstance(self._b, SentencePiece) else "tokenizers"
        return (f"Tokenizer({self.source!r}, {kind}, vocab_size={self.vocab_size}, bos={self._bos}, "
                f"eos={self._eos}, pad={self._pad}, chat_format={self.chat_format!r})")

