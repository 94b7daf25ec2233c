"""The tokenizers of Qwen2 / Qwen3, Gemma 2 / 3 and Phi-3 through minitrain's `Tokenizer`.

Each folder is built in its family's shape (tests/_tok.py: Qwen's byte-level BPE with its split
regex and `<|im_start|>`, no bos; Gemma's sentencepiece with byte fallback, no dummy prefix,
`<start_of_turn>`, bos added; Phi-3's Llama sentencepiece with `<|user|>` ... added tokens that
strip the whitespace after them, no bos added) and saved as the family ships it
(tokenizer.json + tokenizer_config.json; Gemma and Phi-3 also tokenizer.model). Ids are compared
with transformers' `AutoTokenizer` on the same folder, the `tokenizers` library on the same
tokenizer.json and sentencepiece on the same model, special tokens in the text included.
"""

from __future__ import annotations

import pytest
import sentencepiece as spm
import tokenizers
import transformers
from _tok import corpus, make_gemma_tokenizer, make_phi3_tokenizer, make_qwen_tokenizer

from minitrain.text.tokenizer import Tokenizer

PLAIN = corpus(30, seed=5) + ["naïve café 日本語 🙂 ½", "a\n\nb\tc  d", "x ", "tabs\t\tand 12345 digits", ""]
CHATS = {
    "qwen": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi  there 42?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n<|endoftext|>",
    "gemma": "<start_of_turn>user\nHi  there 42?<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n<eos>",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi  there 42?<|end|>\n<|assistant|>\nHello<|end|>\n"
            "<|endoftext|>",
}
MAKE = {"qwen": make_qwen_tokenizer, "gemma": make_gemma_tokenizer, "phi3": make_phi3_tokenizer}
# (default backend, whether the checkpoint's tokenizer adds bos, the bos id)
EXPECT = {"qwen": ("tokenizers", False, None), "gemma": ("sentencepiece", True, 2), "phi3": ("sentencepiece", False, 1)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_tok")
    return {name: make(root / name) for name, make in MAKE.items()}


def backends(folder) -> list[Tokenizer]:
    """Ours over every file the folder has: the default pick, and tokenizer.json when both exist."""
    toks = [Tokenizer.from_folder(folder)]
    if (folder / "tokenizer.model").is_file():
        toks.append(Tokenizer.from_folder(folder, backend="tokenizers"))
    return toks


@pytest.mark.parametrize("name", list(MAKE))
def test_ids_equal_transformers_and_tokenizers(folders, name):
    folder = folders[name]
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    for tok in backends(folder):
        assert tok.vocab_size == len(ref)
        for text in PLAIN + [CHATS[name]]:
            want = ref(text, add_special_tokens=False).input_ids
            assert want == raw.encode(text, add_special_tokens=False).ids
            ids = tok.encode(text)
            assert ids == want, (tok, text)
            assert tok.decode(ids, skip_special=False) == ref.decode(want, skip_special_tokens=False), (tok, text)
            if "</s>" not in text:  # Phi-3 lists </s> as not special; ours never decodes control pieces
                assert tok.decode(ids) == ref.decode(want, skip_special_tokens=True), (tok, text)


@pytest.mark.parametrize("name", list(MAKE))
def test_bos_and_special_ids_as_transformers(folders, name):
    """bos where the checkpoint adds one (Gemma), none for Qwen (no bos token) and Phi-3
    (`add_bos_token: false`); the chat markers are single special ids; eos / pad as configured."""
    folder = folders[name]
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    backend, add_bos, bos = EXPECT[name]
    for tok in backends(folder):
        assert (tok.add_bos, tok.bos_id) == (add_bos, bos)
        assert (tok.eos_id, tok.pad_id) == (ref.eos_token_id, ref.pad_token_id)
        for text in PLAIN[:5] + [CHATS[name]]:
            assert tok.encode(text, bos=tok.add_bos) == ref(text).input_ids
        markers = [t.content for t in ref.added_tokens_decoder.values() if t.special and t.content in CHATS[name]]
        assert len(markers) >= 3
        for t in markers:
            assert tok.encode(t) == [ref.convert_tokens_to_ids(t)] and tok.special_id(t) is not None
    assert Tokenizer.from_folder(folder).backend.__class__.__name__ == {
        "tokenizers": "HFTokenizers", "sentencepiece": "SentencePiece"}[backend]


def test_phi3_markers_take_the_whitespace_after_them(folders):
    """`rstrip` on Phi-3's added tokens: "<|user|>\\nHi" is [<|user|>, Hi], in either backend."""
    for tok in backends(folders["phi3"]):
        user, end = tok.token_to_id("<|user|>"), tok.token_to_id("<|end|>")
        assert tok.encode("<|user|>\n  Hi<|end|>\n") == [user] + tok.encode("Hi", continuation=True) + [end]
        assert tok.encode("<|endoftext|> Hi")[1:] != tok.encode("Hi", continuation=True)  # not stripped


@pytest.mark.parametrize("name", ["gemma", "phi3"])
def test_sentencepiece_backend_equals_sentencepiece(folders, name):
    """On plain text (leading spaces included, where transformers' converted tokenizer.json differs
    from the model it came from) the sentencepiece backend gives sentencepiece's ids."""
    folder = folders[name]
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tok = Tokenizer.from_folder(folder)
    for text in PLAIN + ["  two leading spaces", " one"]:
        assert tok.encode(text) == sp.encode(text), text


@pytest.mark.parametrize("name", list(MAKE))
def test_saved_folder_tokenizes_the_same(folders, tmp_path, name):
    """`Tokenizer.save` keeps the family's bos behaviour and special tokens: ours and transformers'
    read the saved folder as they read the original."""
    tok = Tokenizer.from_folder(folders[name])
    tok.save(tmp_path / "saved")
    again = Tokenizer.from_folder(tmp_path / "saved")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    assert again.add_bos == tok.add_bos
    for text in PLAIN[:5] + [CHATS[name]]:
        want = tok.encode(text, bos=tok.add_bos)
        assert again.encode(text, bos=again.add_bos) == want == ref(text).input_ids, text


@pytest.mark.parametrize("name", list(MAKE))
def test_data_rows_begin_as_transformers_tokenizes(folders, name, tmp_path):
    """A text row and a prompt row get bos only where the checkpoint's tokenizer puts one
    (Gemma; not Qwen, not Phi-3 with `add_bos_token: false`): `read_sft`'s ids begin as
    transformers' `tokenizer(text)` does, the row's own bos never doubled."""
    import json

    from minitrain.data.readers import read_sft

    ref = transformers.AutoTokenizer.from_pretrained(str(folders[name]))
    text, prompt = PLAIN[0], PLAIN[1]
    rows = [{"text": text}, {"prompt": prompt, "completion": " yes"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for tok in backends(folders[name]):
        ex = read_sft(path, tok, max_len=512)
        want = ref(text).input_ids
        assert ex[0]["input_ids"][: len(want)] == want
        assert ex[0]["input_ids"][len(want):] == [tok.eos_id]
        assert ex[1]["input_ids"][: len(ref(prompt).input_ids)] == ref(prompt).input_ids
        assert (ex[0]["input_ids"][0] == tok.bos_id) == EXPECT[name][1]


def test_add_bos_token_and_a_post_processor_that_disagree_are_said(folders, tmp_path, capsys):
    """Phi-3's `add_bos_token: false` beside a tokenizer.json whose post-processor adds `<s>`: minitrain
    follows the flag (as transformers 4 did) and says so in one `note:` line, naming both files; the
    family folders as built, where the two agree, print nothing. transformers 5.24 follows the
    post-processor here (its ids begin with bos), which is why the line is needed."""
    import json
    import shutil

    for name in MAKE:
        for tok in backends(folders[name]):
            tok.add_bos
    assert "add_bos_token" not in capsys.readouterr().out
    folder = tmp_path / "phi3"
    shutil.copytree(folders["phi3"], folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}},
                                       bos, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_folder(folder, backend="tokenizers")
    assert tok.add_bos is False and tok.add_bos is False  # decided once
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("note: ") and str(folder) in out[0]
    assert ("tokenizer_config.json says add_bos_token=false but tokenizer.json's post-processor adds bos; "
            "minitrain follows add_bos_token") in out[0]
    assert transformers.AutoTokenizer.from_pretrained(str(folder))("hello").input_ids[0] == 1
