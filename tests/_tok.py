"""Tiny tokenizer folders for tests (imported by tests only: `from _tok import ...`).

- `make_bpe_tokenizer(folder)`: a BPE `tokenizer.json` trained with `tokenizers` on generated
  text, vocab 128 (fits tiny models with `vocab_size=128`); `<pad>`=0, `<s>`=1, `</s>`=2,
  `<unk>`=3; Metaspace pre-tokenizer (sentencepiece-like). Writes `tokenizer_config.json` and
  `special_tokens_map.json` as `save_pretrained` would.
- `make_sp_tokenizer(folder)`: a Llama-style sentencepiece `tokenizer.model` (BPE, spaces kept)
  with the same special ids.
- `make_llama3_tokenizer(folder)`: a byte-level BPE with Llama-3's specials (vocab 325).
- `make_t5_tokenizer(folder, extra_ids=...)`: a T5-style `spiece.model` (pad 0, eos 1, unk 2,
  no bos) plus `<extra_id_N>` sentinels as T5 does.
- `make_qwen_tokenizer(folder)`, `make_gemma_tokenizer(folder)`, `make_phi3_tokenizer(folder)`: the
  tokenizer files of those families, in their shapes (see each builder), as the checkpoints ship them.
- `corpus(n)`: the generated text, deterministic.

Files are cached per process keyed on arguments and copied into `folder`, so calling these in
many tests costs one training run each.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import tempfile
from pathlib import Path

WORDS = (
    "the a an of to in and is it that was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said "
    "each she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most people "
    "my over know water than call first who may down side been now find any new work part take "
    "get place made live where after back little only round man year came show every good me give "
    "our under name very through just form sentence great think say help low line differ turn cause "
    "much mean before move right boy old too same tell does set three want air well also play small "
    "end put home read hand port large spell add even land here must big high such follow act why "
    "ask men change went light kind off need house picture try us again animal point mother world"
).split()


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    """`n` rows of generated English-like text (words, punctuation, digits, some newlines)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99)))
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice([".", ".", "?", "!", ","])
        if rng.random() < 0.2:  # some two-line rows, so "\n" is in every vocabulary
            line = "Q: " + line + "\nA: " + rng.choice(WORDS)
        lines.append(line)
    return lines


_CACHE: dict[tuple, Path] = {}


def _cached(key: tuple, build) -> Path:
    if key not in _CACHE:
        d = Path(tempfile.mkdtemp(prefix="minitrain_tok_"))
        build(d)
        _CACHE[key] = d
    return _CACHE[key]


def _copy(src: Path, folder: Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False))


def _build_bpe(d: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    # bos before each text, as add_bos_token says (transformers 5 follows this post-processor, not the flag)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(d / "tokenizer.json"))
    _write_json(
        d / "tokenizer_config.json",
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
         "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True,
         "add_eos_token": False, "model_max_length": 256},
    )
    _write_json(
        d / "special_tokens_map.json",
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"},
    )


# the pre-tokenizer split of Meta-Llama-3's tokenizer.json (tiktoken's cl100k pattern, digits 1-3)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _build_llama3(d: Path, vocab_size: int) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    # as in Llama-3, the special tokens follow the BPE vocabulary
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
    bos = "<|begin_of_text|>"  # as in Llama-3's tokenizer.json: the post-processor puts bos before a text
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(d / "tokenizer.json"))
    _write_json(
        d / "tokenizer_config.json",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "tokenizer_class": "PreTrainedTokenizerFast",
         "model_max_length": 8192},
    )


def _train_sp(d: Path, name: str, vocab_size: int, **kw) -> None:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()),
        model_writer=buf,
        vocab_size=vocab_size,
        character_coverage=1.0,
        minloglevel=2,
        num_threads=1,
        **kw,
    )
    (d / name).write_bytes(buf.getvalue())


def _build_sp(d: Path, vocab_size: int, byte_fallback: bool = False) -> None:
    # Llama-style: BPE, no normalization, spaces kept as written (Llama / Mistral tokenizer.model)
    _train_sp(d, "tokenizer.model", vocab_size, model_type="bpe", normalization_rule_name="identity",
              remove_extra_whitespaces=False, split_digits=True, pad_id=0, bos_id=1, eos_id=2, unk_id=3,
              byte_fallback=byte_fallback,
              pad_piece="<pad>", bos_piece="<s>", eos_piece="</s>", unk_piece="<unk>")
    _write_json(
        d / "tokenizer_config.json",
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
         "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False},
    )


def _build_t5(d: Path, vocab_size: int, extra_ids: int) -> None:
    # T5-style: unigram, NFKC, extra whitespace removed
    _train_sp(d, "spiece.model", vocab_size, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
              pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>")
    _write_json(
        d / "tokenizer_config.json",
        {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
         "extra_ids": extra_ids, "tokenizer_class": "T5Tokenizer"},
    )


# the pre-tokenizer split of Qwen2 / Qwen2.5 / Qwen3's tokenizer.json (Llama 3's, with single digits)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_PLAIN = ["<think>", "</think>"]  # Qwen3's added tokens that are not special
PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
              "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]


def _added(content: str, *, special: bool = True, rstrip: bool = False) -> dict:
    """One `added_tokens_decoder` entry of tokenizer_config.json."""
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": rstrip, "single_word": False,
            "special": special}


def _build_qwen(d: Path, vocab_size: int) -> None:
    """Qwen's shape: byte-level BPE, NFC, Qwen's split regex; no bos, no unk; `<|endoftext|>`,
    `<|im_start|>`, `<|im_end|>` special tokens after the BPE vocabulary, then Qwen3's `<think>`
    tokens (added, not special); `Qwen2Tokenizer` config with `bos_token: null`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_PLAIN])
    tok.save(str(d / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): _added(t, special=t in QWEN_SPECIALS) for t in QWEN_SPECIALS + QWEN_PLAIN}
    _write_json(d / "tokenizer_config.json", {
        "add_prefix_space": False, "added_tokens_decoder": added, "additional_special_tokens": QWEN_SPECIALS[1:],
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "clean_up_tokenization_spaces": False, "errors": "replace", "model_max_length": 32768,
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer"})


def _tokenizer_json_by_transformers(d: Path) -> None:
    """Add the `tokenizer.json` transformers converts from `d`'s sentencepiece model (how the Gemma
    and Phi-3 checkpoints' own were made); `d`'s tokenizer_config.json is kept as written."""
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        transformers.AutoTokenizer.from_pretrained(str(d)).save_pretrained(tmp)
        shutil.copy(Path(tmp) / "tokenizer.json", d / "tokenizer.json")


def _build_gemma(d: Path, vocab_size: int) -> None:
    """Gemma's shape: sentencepiece BPE with byte fallback and no dummy prefix; pad 0, eos 1, bos 2,
    unk 3, then `<mask>`, `<start_of_turn>`, `<end_of_turn>`; `add_bos_token: true`; both
    tokenizer.model and the tokenizer.json transformers converts from it."""
    _train_sp(d, "tokenizer.model", vocab_size, model_type="bpe", normalization_rule_name="identity",
              remove_extra_whitespaces=False, add_dummy_prefix=False, byte_fallback=True, split_digits=True,
              pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
              unk_piece="<unk>", user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"])
    names = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    _write_json(d / "tokenizer_config.json", {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": {str(i): _added(t) for i, t in
                                                                                 enumerate(names)},
        "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"], "bos_token": "<bos>",
        "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "clean_up_tokenization_spaces": False,
        "sp_model_kwargs": {}, "spaces_between_special_tokens": False, "tokenizer_class": "GemmaTokenizer"})
    _tokenizer_json_by_transformers(d)


def _build_phi3(d: Path, vocab_size: int) -> None:
    """Phi-3's shape: Llama's sentencepiece (BPE, byte fallback, dummy prefix; unk 0, bos 1, eos 2)
    plus `<|endoftext|>`, `<|assistant|>`, ..., `<|user|>` after it, all but `<|endoftext|>` with
    `rstrip` (they take the whitespace after them), `</s>` not special; `add_bos_token: false`,
    `legacy: false`; both tokenizer.model and the tokenizer.json transformers converts from it."""
    _train_sp(d, "tokenizer.model", vocab_size, model_type="bpe", normalization_rule_name="identity",
              remove_extra_whitespaces=False, byte_fallback=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2,
              pad_id=-1)
    added = {"0": _added("<unk>"), "1": _added("<s>"), "2": _added("</s>", special=False, rstrip=True)}
    for i, t in enumerate(PHI3_ADDED):
        added[str(vocab_size + i)] = _added(t, rstrip=t != "<|endoftext|>")
    _write_json(d / "tokenizer_config.json", {
        "add_bos_token": False, "add_eos_token": False, "added_tokens_decoder": added, "bos_token": "<s>",
        "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "legacy": False,
        "model_max_length": 4096, "pad_token": "<|endoftext|>", "padding_side": "left", "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>", "use_default_system_prompt": False})
    _tokenizer_json_by_transformers(d)


def add_special_tokens(d: Path, tokens: list[str]) -> dict[str, int]:
    """Add `tokens` as special tokens to the tokenizer.json folder `d` (and its tokenizer_config.json's
    `added_tokens_decoder`), as a vision-language checkpoint's image tokens; their ids."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(d / "tokenizer.json"))
    t.add_special_tokens([AddedToken(x, special=True, normalized=False) for x in tokens])
    t.save(str(d / "tokenizer.json"))
    ids = {x: t.token_to_id(x) for x in tokens}
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["added_tokens_decoder"].update({str(i): _added(x) for x, i in ids.items()})
    _write_json(d / "tokenizer_config.json", tc)
    return ids


def make_qwen_tokenizer(folder: Path, vocab_size: int = 300) -> Path:
    """A Qwen-shaped `tokenizer.json` folder (ids: BPE vocab, then the 3 specials, then <think>, </think>)."""
    return _copy(_cached(("qwen", vocab_size), lambda d: _build_qwen(d, vocab_size)), folder)


def make_gemma_tokenizer(folder: Path, vocab_size: int = 420) -> Path:
    """A Gemma-shaped folder: tokenizer.model + tokenizer.json (pad 0, eos 1, bos 2, unk 3)."""
    return _copy(_cached(("gemma", vocab_size), lambda d: _build_gemma(d, vocab_size)), folder)


def make_phi3_tokenizer(folder: Path, vocab_size: int = 400) -> Path:
    """A Phi-3-shaped folder: tokenizer.model + tokenizer.json (unk 0, bos 1, eos 2; the 11 added
    tokens from `vocab_size` on)."""
    return _copy(_cached(("phi3", vocab_size), lambda d: _build_phi3(d, vocab_size)), folder)


def make_bpe_tokenizer(folder: Path, vocab_size: int = 128) -> Path:
    """Write a tiny BPE `tokenizer.json` folder (ids: pad 0, bos 1, eos 2, unk 3) and return it."""
    return _copy(_cached(("bpe", vocab_size), lambda d: _build_bpe(d, vocab_size)), folder)


def make_llama3_tokenizer(folder: Path, vocab_size: int = 320) -> Path:
    """Write a Llama-3-style folder: byte-level BPE `tokenizer.json` (Llama-3's split pattern),
    `<|begin_of_text|>` (bos), `<|eot_id|>` (eos) and the header tokens after the BPE vocab, no pad.
    """
    return _copy(_cached(("llama3", vocab_size), lambda d: _build_llama3(d, vocab_size)), folder)


def make_sp_tokenizer(folder: Path, vocab_size: int = 128, byte_fallback: bool = False) -> Path:
    """Write a tiny sentencepiece `tokenizer.model` folder (pad 0, bos 1, eos 2, unk 3); `byte_fallback`:
    with the 256 `<0xNN>` pieces, as the Llama 2 / Mistral models have them (vocab_size over 300)."""
    key = ("sp", vocab_size) + (("bytes",) if byte_fallback else ())
    return _copy(_cached(key, lambda d: _build_sp(d, vocab_size, byte_fallback)), folder)


def make_t5_tokenizer(folder: Path, vocab_size: int = 128, extra_ids: int = 0) -> Path:
    """Write a tiny T5-style `spiece.model` folder (pad 0 = decoder start, eos 1, unk 2, no bos).

    The tokenizer's vocab is `vocab_size + extra_ids` (`<extra_id_N>` sentinels at the end).
    """
    key = ("t5", vocab_size, extra_ids)
    return _copy(_cached(key, lambda d: _build_t5(d, vocab_size, extra_ids)), folder)
