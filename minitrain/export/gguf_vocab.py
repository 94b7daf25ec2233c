"""A checkpoint's tokenizer written into a GGUF file, in the two shapes llama.cpp tokenizes.

- `tokenizer.model` (sentencepiece: LLaMA 1/2, Mistral, Gemma, Phi-3): llama.cpp's `llama` model.
  Every piece with its score and type (normal, unknown, control, unused, byte) as the model file
  holds them; the added tokens of tokenizer_config.json (`added_tokens_decoder`) over them, control
  when special, user-defined otherwise, score -1000; ids up to config.json's vocab_size filled
  with unused `[PADn]`. Whether a space is put before the text is the model's own dummy prefix.
- `tokenizer.json` with a byte-level BPE (Llama 3, Qwen2 / 2.5 / 3): llama.cpp's `gpt2` model.
  The vocabulary by id, the merges, the types (added special tokens control, other added tokens
  user-defined) and the pre-tokenizer's name, which llama.cpp knows by its split regex: ours are
  compared with Llama 3's (`llama-bpe`) and Qwen2's (`qwen2`) exactly; another is refused.

Then, for both, what `gguf.SpecialVocab` reads from the folder (the merges, the pad id, whether eos
is added, the chat template), with bos / eos / unk and whether bos is added as our `Tokenizer` reads
them (the rule transformers follows). This is what llama.cpp's converter writes for these
shapes (convert_hf_to_gguf.py: `_set_vocab_sentencepiece`, `_set_vocab_gpt2`), without transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from minitrain.errors import UserError

# the pre-tokenizer split regexes of the checkpoints' own tokenizer.json -> llama.cpp's name for it
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def add_vocab(writer: Any, folder: str | Path, vocab_size: int, arch: str = "") -> str:
    """Write the tokenizer of `folder` into `writer` (a `gguf.GGUFWriter`); returns which shape it
    was ("sentencepiece", "bpe" or "gemma4"). `vocab_size`: the model's embedding rows (config.json);
    `arch`: llama.cpp's architecture (Gemma 4's tokenizer.json is written as its own `gemma4` model)."""
    folder = Path(folder)
    if arch == "gemma4" and (folder / "tokenizer.json").is_file():
        tokens, scores, types = _gemma4(folder, vocab_size)
        writer.add_tokenizer_model("gemma4")  # llama.cpp names its pre-tokenizer itself
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_add_space_prefix(False)
        _specials(_special_vocab(folder, len(tokens), load_merges=True), folder).add_to_gguf(writer, quiet=True)
        return "gemma4"
    metaspace = (folder / "tokenizer.json").is_file() and _metaspace(_read(folder / "tokenizer.json"))
    if (folder / "tokenizer.model").is_file() or metaspace:  # llama.cpp's sentencepiece (`llama`) vocabulary
        read = _sentencepiece if (folder / "tokenizer.model").is_file() else _metaspace_bpe
        tokens, scores, types, space = read(folder, vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_add_space_prefix(space)
        _specials(_special_vocab(folder, len(tokens)), folder).add_to_gguf(writer, quiet=True)
        return "sentencepiece" if read is _sentencepiece else "sentencepiece-style bpe"
    if (folder / "tokenizer.json").is_file():
        tokens, types, pre = _byte_level_bpe(folder, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        _specials(_special_vocab(folder, len(tokens), load_merges=True), folder).add_to_gguf(writer, quiet=True)
        return "bpe"
    raise UserError(f"{folder}: no tokenizer.model or tokenizer.json — the GGUF file needs the tokenizer saved "
                    f"with the model")


def _special_vocab(folder: Path, n_vocab: int, load_merges: bool = False) -> Any:
    """`gguf.SpecialVocab` of `folder`, its logger held at ERROR meanwhile: it warns "Unknown separator
    token ... in TemplateProcessing<pair>" for a post-processor's pair template (BERT-style separators),
    which says nothing about this file: whether bos / eos are added is set by `_specials` from our own
    `Tokenizer`, and a pair of sequences is never encoded for a causal model."""
    import logging

    import gguf

    logger = logging.getLogger("gguf.vocab")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return gguf.SpecialVocab(folder, load_merges=load_merges, n_vocab=n_vocab)
    finally:
        logger.setLevel(level)


def _specials(special: Any, folder: Path) -> Any:
    """`gguf.SpecialVocab`'s reading (merges, chat template, pad) with bos / eos / unk and whether bos is
    added as our `Tokenizer` decides them (transformers' rule: tokenizer_config.json, the post-processor,
    no bos at all for Qwen), not config.json's ids."""
    from minitrain.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(folder)
    for name, i in (("bos", tok.bos_id), ("eos", tok.eos_id), ("unk", tok.unk_id)):
        special.special_token_ids.pop(name, None)
        if i is not None:
            special.special_token_ids[name] = i
    special.add_special_token["bos"] = tok.add_bos
    return special


def _sentencepiece(folder: Path, vocab_size: int) -> tuple[list[bytes], list[float], list[int], bool]:
    """Pieces, scores and types of tokenizer.model (+ tokenizer_config.json's added tokens), and
    whether the model puts a space before the text (its dummy prefix)."""
    from gguf import TokenType
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(folder / "tokenizer.model"))
    n = max(vocab_size, sp.vocab_size())
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores, types = [-10000.0] * n, [int(TokenType.UNUSED)] * n
    for i in range(sp.vocab_size()):
        kind = (TokenType.UNKNOWN if sp.IsUnknown(i) else TokenType.CONTROL if sp.IsControl(i)
                else TokenType.UNUSED if sp.IsUnused(i) else TokenType.BYTE if sp.IsByte(i) else TokenType.NORMAL)
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i), int(kind)
    if not any(sp.IsByte(i) for i in range(sp.vocab_size())):
        raise UserError(f"{folder / 'tokenizer.model'}: has no byte-fallback pieces (<0x00> ... <0xFF>) — llama.cpp's "
                        f"sentencepiece tokenizer needs them for characters outside the vocabulary; not exported")
    for key, entry in _read(folder / "tokenizer_config.json").get("added_tokens_decoder", {}).items():
        i, text = int(key), entry["content"]
        if i >= n:
            raise UserError(f"{folder / 'tokenizer_config.json'}: added token {text!r} has id {i}, beyond the "
                            f"model's {vocab_size} rows — resize the model's embeddings and save it again")
        special = entry.get("special") or (text.startswith("<|") and text.endswith("|>"))
        types[i] = int(TokenType.CONTROL if special else TokenType.USER_DEFINED)
        tokens[i], scores[i] = (text if special else text.replace("\u2581", " ")).encode("utf-8"), -1000.0
    space = sp.EncodeAsPieces("a")[:1] == ["\u2581a"] or sp.EncodeAsPieces("a")[:1] == ["\u2581"]
    return tokens, scores, types, space


# Gemma 4's tokens that llama.cpp's converter types user-defined (always rendered: the chat parser reads them)
GEMMA4_VISIBLE = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
                  '<|"|>')


def _gemma4(folder: Path, vocab_size: int) -> tuple[list[bytes], list[float], list[int]]:
    """Gemma 4's tokenizer.json (a BPE over "▁"-spaced text with byte fallback) as llama.cpp's `gemma4`
    vocabulary, as its converter writes it (`LlamaHfVocab`): the pieces by id as they are, every score -1000
    (the merges rank the pairs), types: byte pieces <0xNN>, added special tokens control (GEMMA4_VISIBLE
    user-defined), other added tokens user-defined; ids up to vocab_size filled with unused `[PADn]`."""
    import re

    from gguf import TokenType

    path = folder / "tokenizer.json"
    data = _read(path)
    model = data.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        what = f"a {model.get('type')} tokenizer" + ("" if model.get("byte_fallback") else " without byte fallback")
        raise UserError(f"{path}: {what} — llama.cpp's gemma4 tokenizer is a BPE with byte fallback (Gemma's); "
                        f"not exported")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    n = max([vocab_size, *(i + 1 for i in vocab.values()), *(i + 1 for i in added)])
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores, types = [-1000.0] * n, [int(TokenType.UNUSED)] * n
    for text, i in vocab.items():
        byte = re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text)
        tokens[i], types[i] = text.encode("utf-8"), int(TokenType.BYTE if byte else TokenType.NORMAL)
    for i, t in added.items():
        tokens[i] = t["content"].encode("utf-8")
        special = t.get("special") and t["content"] not in GEMMA4_VISIBLE
        types[i] = int(TokenType.CONTROL if special else TokenType.USER_DEFINED)
    return tokens, scores, types


def _metaspace(data: dict[str, Any]) -> bool:
    """A BPE tokenizer.json in sentencepiece's manner: spaces as U+2581 by a Metaspace pre-tokenizer,
    not byte-level (the built-in demo's; LLaMA / Mistral converted without their tokenizer.model)."""
    pre = data.get("pre_tokenizer") or {}
    kinds = [p.get("type") for p in (pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre])]
    return (data.get("model") or {}).get("type") == "BPE" and "Metaspace" in kinds and "ByteLevel" not in kinds


def _metaspace_bpe(folder: Path, vocab_size: int) -> tuple[list[bytes], list[float], list[int], bool]:
    """A Metaspace BPE tokenizer.json as llama.cpp's sentencepiece (`llama`) vocabulary: pieces by id,
    each piece's score minus the rank of the merge that makes it (sentencepiece's BPE merges the
    adjacent pair whose union scores highest, which is BPE's lowest-rank-first), token types, and
    whether a space is put before the text (Metaspace's prepend scheme). Without byte pieces
    (<0x00> ... <0xFF>) llama.cpp cannot encode a character outside the vocabulary: said in a note."""
    import sys

    from gguf import TokenType

    path = folder / "tokenizer.json"
    data = _read(path)
    model = data["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    n = max([vocab_size, *(i + 1 for i in vocab.values()), *(i + 1 for i in added)])
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores, types = [-10000.0] * n, [int(TokenType.UNUSED)] * n
    for text, i in vocab.items():
        tokens[i], scores[i], types[i] = text.encode("utf-8"), 0.0, int(TokenType.NORMAL)
    made: set[str] = set()
    for rank, merge in enumerate(model.get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        if left + right in vocab and left + right not in made:  # the first (lowest-rank) merge that makes it
            made.add(left + right)
            scores[vocab[left + right]] = -float(rank + 1)
    unk = model.get("unk_token")
    for i, t in added.items():
        tokens[i], scores[i] = t["content"].encode("utf-8"), -1000.0
        types[i] = int(TokenType.UNKNOWN if t["content"] == unk else TokenType.CONTROL if t.get("special")
                       else TokenType.USER_DEFINED)
    pre = data.get("pre_tokenizer") or {}
    meta = next(p for p in (pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre])
                if p.get("type") == "Metaspace")
    if not any(t.startswith(b"<0x") and len(t) == 6 for t in tokens):
        print(f"note: {path}: no byte pieces (<0x00> ... <0xFF>): llama.cpp stops on a character outside its "
              f"{len(vocab)} pieces", file=sys.stderr)
    return tokens, scores, types, meta.get("prepend_scheme", "always") != "never" and meta.get("add_prefix_space", True)


def _byte_level_bpe(folder: Path, vocab_size: int) -> tuple[list[str], list[int], str]:
    """The token strings by id, their types, and llama.cpp's name for the pre-tokenizer."""
    from gguf import TokenType

    path = folder / "tokenizer.json"
    data = _read(path)
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"{path}: a {model.get('type')} tokenizer — GGUF export takes sentencepiece "
                        f"(tokenizer.model) or byte-level BPE tokenizers")
    pre = data.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if "ByteLevel" not in kinds:
        raise UserError(f"{path}: a BPE tokenizer without a byte-level pre-tokenizer (kinds {kinds}) — GGUF "
                        f"export takes it with the sentencepiece tokenizer.model it was converted from; put "
                        f"tokenizer.model beside it")
    splits = [p.get("pattern", {}).get("Regex") for p in parts if p.get("type") == "Split"]
    if not splits:
        name = "gpt-2"  # ByteLevel with its own (GPT-2) regex
    elif len(splits) == 1 and splits[0] in PRE_TOKENIZERS:
        name = PRE_TOKENIZERS[splits[0]]
    else:
        raise UserError(f"{path}: its pre-tokenizer split is not one llama.cpp is known to apply here (Llama 3's or "
                        f"Qwen2's) — the GGUF file would tokenize differently; not exported")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    n = max([vocab_size, *(i + 1 for i in vocab.values()), *(i + 1 for i in added)])
    tokens, types = [f"[PAD{i}]" for i in range(n)], [int(TokenType.UNUSED)] * n
    for text, i in vocab.items():
        tokens[i], types[i] = text, int(TokenType.NORMAL)
    for i, t in added.items():
        tokens[i] = t["content"]
        types[i] = int(TokenType.CONTROL if t.get("special") else TokenType.USER_DEFINED)
    return tokens, types, name
