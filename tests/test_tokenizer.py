"""Tokenizer tests: ids against sentencepiece / tokenizers / transformers / mistral-common.

References used (never numbers copied from our own output):
- plain `sentencepiece` and `tokenizers` on the same files;
- transformers' tokenizers and `apply_chat_template` with the official chat templates below;
- mistral-common (Mistral's own tokenization) on its shipped tokenizer.model files;
- Meta's Llama-2 chat tokenization, written out from Meta's `llama/generation.py` formula.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from _tok import make_bpe_tokenizer, make_llama3_tokenizer, make_sp_tokenizer, make_t5_tokenizer
from minitrain.errors import UserError
from minitrain.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

# --------------------------------------------------------------------------- official templates

# mistralai/Mistral-7B-Instruct-v0.2 tokenizer_config.json "chat_template" (the same template is
# served for v0.1): system message joined to the first user message, spaces around [INST].
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n\n{{- bos_token }}\n{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}\n    {%- endif %}\n    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an "
    "initial optional system message!') }}\n    {%- endif %}\n{%- endfor %}\n"
)

# meta-llama/Llama-2-7b-chat-hf tokenizer_config.json "chat_template".
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json "chat_template".
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

TEXTS = [
    "Hello world, the 42 picture!",
    "What is 2+2? It is 4.",
    "Q: how are you?\nA: fine",
    "two  spaces and   three",
    " leading space",
    "trailing space ",
    "tabs\tand\nnewlines\n\n",
    "unicode: café, naïve, 東京, emoji 🙂",
    "[INST] not special in v1 [/INST]",
    "",
]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour.\nJust one."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in French?"},
        {"role": "assistant", "content": "Rouge, 42 times 🙂"},
    ],
    [
        {"role": "user", "content": "Count: 1 2 3"},
        {"role": "assistant", "content": "4 5 6"},
        {"role": "user", "content": "Next?"},
    ],
]

# --------------------------------------------------------------------------- fixtures

MISTRAL_DATA = None
try:
    import mistral_common

    MISTRAL_DATA = Path(mistral_common.__file__).parent / "data"
except ImportError:  # pragma: no cover
    pass

MISTRAL_FILES = {
    "v1": "tokenizer.model.v1",
    "v2": "mistral_instruct_tokenizer_240216.model.v2",
    "v3": "mistral_instruct_tokenizer_240323.model.v3",
    "v7": "mistral_instruct_tokenizer_241114.model.v7",
}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """folder with Mistral's real `tokenizer.model` (+ a minimal tokenizer_config for HF)."""
    if MISTRAL_DATA is None:
        pytest.skip("mistral-common not installed")
    cache = {}

    def get(version: str) -> Path:
        if version not in cache:
            d = tmp_path_factory.mktemp(f"mistral_{version}")
            shutil.copy(MISTRAL_DATA / MISTRAL_FILES[version], d / "tokenizer.model")
            (d / "tokenizer_config.json").write_text(json.dumps(
                {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizer"}))
            cache[version] = d
        return cache[version]

    return get


def hf(folder: Path, **kw):
    return transformers.AutoTokenizer.from_pretrained(str(folder), **kw)


# --------------------------------------------------------------------------- plain encoding


@pytest.mark.parametrize("version", ["v1", "v3", "v7"])
def test_sentencepiece_ids_equal_sentencepiece(mistral, version):
    folder = mistral(version)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tok = Tokenizer.from_folder(folder)
    assert tok.vocab_size == sp.vocab_size()
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (sp.bos_id(), sp.eos_id(), sp.unk_id())
    for text in TEXTS:
        if version != "v1" and "[INST]" in text:
            continue  # a control token there: one id (tested below), sentencepiece spells it out
        ids = tok.encode(text, bos=True, eos=True)
        assert ids == [sp.bos_id()] + sp.encode(text) + [sp.eos_id()], text
        assert tok.decode(ids) == sp.decode(sp.encode(text)), text


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_sentencepiece_ids_equal_transformers(mistral, version):
    """transformers converts tokenizer.model to a BPE tokenizer; on ordinary text it agrees with
    sentencepiece (it differs on runs of spaces and leading spaces, where sentencepiece is the
    reference, tested above)."""
    folder = mistral(version)
    tok, ref = Tokenizer.from_folder(folder), hf(folder)
    for text in TEXTS:
        if "  " in text or text.startswith(" ") or "\t" in text or "[INST]" in text:
            continue
        assert tok.encode(text) == ref(text, add_special_tokens=False).input_ids, text
        assert tok.decode(tok.encode(text)) == ref.decode(ref(text, add_special_tokens=False).input_ids), text


def test_control_tokens_in_text_are_single_ids(mistral):
    """[INST] is a control token of the v3 model: in text it becomes its id (as transformers
    does); in v1 it is plain text."""
    v3, v1 = Tokenizer.from_folder(mistral("v3")), Tokenizer.from_folder(mistral("v1"))
    ref = hf(mistral("v3"))
    text = "[INST] What is 2+2?[/INST] Four</s>"
    assert v3.encode(text) == ref(text, add_special_tokens=False).input_ids
    assert v3.token_to_id("[INST]") in v3.encode(text)
    sp = spm.SentencePieceProcessor(model_file=str(mistral("v1") / "tokenizer.model"))
    assert v1.encode("[INST] x [/INST]") == sp.encode("[INST] x [/INST]")


def test_tokenizers_backend_equals_tokenizers_and_transformers(tmp_path):
    import tokenizers

    folder = make_bpe_tokenizer(tmp_path / "bpe")
    tok = Tokenizer.from_folder(folder)
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    ref = hf(folder)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size == raw.get_vocab_size() == len(ref) == 128
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == raw.encode(text, add_special_tokens=False).ids == ref(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_tiny_sentencepiece_fixture_equals_references(tmp_path):
    folder = make_sp_tokenizer(tmp_path / "sp")
    tok = Tokenizer.from_folder(folder)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 128
    for text in TEXTS:
        assert tok.encode(text) == sp.encode(text)


def test_continuation_has_no_dummy_prefix(mistral, tmp_path):
    """A completion continues its prompt: sentencepiece's dummy prefix (or Metaspace's "▁") is
    not invented; transformers' tokenization of the joined string is the reference."""
    for folder in (mistral("v1"), make_bpe_tokenizer(tmp_path / "bpe")):
        tok, ref = Tokenizer.from_folder(folder), hf(folder)
        for prompt, completion in [("Question: 2+2?\nAnswer:", " Four"), ("Say it:\n", "Four."), ("x =", "42")]:
            joined = ref(prompt + completion, add_special_tokens=False).input_ids
            p = tok.encode(prompt)
            assert p + tok.encode(completion, continuation=True) == joined, (prompt, completion)


# --------------------------------------------------------------------------- decode


def test_decode_drops_ignore_index_and_accepts_tensors(mistral, tmp_path):
    for folder in (mistral("v1"), make_bpe_tokenizer(tmp_path / "bpe"), make_t5_tokenizer(tmp_path / "t5")):
        tok = Tokenizer.from_folder(folder)
        ids = tok.encode("What is 2+2? It is 4.", eos=True)
        labels = [-100] * 3 + ids[3:] + [-100, -100]
        expected = tok.decode(ids[3:])
        assert tok.decode(labels) == expected
        assert tok.decode(torch.tensor(labels)) == expected
        assert tok.decode([-100, -100]) == ""
        assert tok.decode(ids + [tok.vocab_size + 5]) == tok.decode(ids)  # beyond the vocab: dropped
        # the special tokens are kept on request
        assert tok.id_to_token(tok.eos_id) in tok.decode(ids, skip_special=False)


# --------------------------------------------------------------------------- T5


def test_t5_conventions_match_transformers_t5tokenizer(tmp_path):
    folder = make_t5_tokenizer(tmp_path / "t5", extra_ids=100)
    # a folder with only spiece.model gets transformers' defaults too (extra_ids=100)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(folder / "spiece.model", bare / "spiece.model")
    for f in (folder, bare):
        ref = transformers.T5Tokenizer.from_pretrained(str(f))
        tok = Tokenizer.from_folder(f)
        assert tok.vocab_size == len(ref) == 128 + 100
        assert (tok.pad_id, tok.eos_id, tok.bos_id) == (ref.pad_token_id, ref.eos_token_id, None) == (0, 1, None)
        assert tok.decoder_start_id == 0
        for n in (0, 1, 57, 99):
            assert tok.token_to_id(f"<extra_id_{n}>") == ref.convert_tokens_to_ids(f"<extra_id_{n}>") == 128 + 99 - n
        for text in TEXTS[:4] + ["fill <extra_id_0> the <extra_id_1> gaps"]:
            assert tok.encode(text, eos=True) == ref(text).input_ids, text
            assert tok.encode(text, eos=True) == ref(text_target=text).input_ids
        ids = ref("the <extra_id_0> word").input_ids
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


# --------------------------------------------------------------------------- added tokens


@pytest.mark.parametrize("make", [make_bpe_tokenizer, make_sp_tokenizer, make_t5_tokenizer])
def test_added_tokens_single_ids_and_round_trip(tmp_path, make):
    folder = make(tmp_path / "src")
    tok = Tokenizer.from_folder(folder)
    n0 = tok.vocab_size
    assert tok.add_special_tokens(["[Question]", "<|tool|>", "[Question]"]) == 2
    assert tok.add_special_tokens(["[Question]"]) == 0  # already there
    assert tok.vocab_size == n0 + 2
    q, t = tok.token_to_id("[Question]"), tok.token_to_id("<|tool|>")
    assert (q, t) == (n0, n0 + 1)
    text = "[Question] what is the <|tool|> word?"
    ids = tok.encode(text)
    assert ids.count(q) == 1 and ids.count(t) == 1
    assert ids[0] == q
    assert tok.decode(ids, skip_special=False).replace(" ", "") == text.replace(" ", "")
    assert "[Question]" not in tok.decode(ids)
    tok.save(tmp_path / "saved")
    again = Tokenizer.from_folder(tmp_path / "saved")
    assert again.vocab_size == n0 + 2
    assert again.encode(text) == ids
    assert (again.bos_id, again.eos_id, again.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    # transformers reads what we saved: same ids for the added tokens and the text
    ref = hf(tmp_path / "saved")
    assert len(ref) == n0 + 2
    assert ref.convert_tokens_to_ids(["[Question]", "<|tool|>"]) == [q, t]
    if make is not make_sp_tokenizer:  # HF's BPE conversion of the tiny sp model differs on " w"
        assert ref(text, add_special_tokens=False).input_ids == ids


def test_added_tokens_from_transformers_save(tmp_path):
    """A tokenizer extended and saved by transformers loads with the same ids (sentencepiece
    folders keep added tokens in tokenizer_config.json's added_tokens_decoder)."""
    src = make_t5_tokenizer(tmp_path / "t5", extra_ids=100)
    ref = transformers.T5Tokenizer.from_pretrained(str(src))
    ref.add_special_tokens({"additional_special_tokens": ["[Question]"]})
    saved = tmp_path / "hf_saved"
    ref.save_pretrained(str(saved))
    text = "[Question] the <extra_id_3> word"
    if not (saved / "spiece.model").exists():  # transformers 5 saves only tokenizer.json
        tok = Tokenizer.from_folder(saved)
        assert tok.vocab_size == len(ref)
        assert tok.encode(text, eos=True) == ref(text).input_ids
        shutil.copy(src / "spiece.model", saved / "spiece.model")  # and with the sentencepiece file
    tok = Tokenizer.from_folder(saved)
    assert tok.token_to_id("[Question]") == ref.convert_tokens_to_ids("[Question]")
    assert tok.vocab_size == len(ref)
    assert tok.encode(text, eos=True) == ref(text).input_ids


# --------------------------------------------------------------------------- special ids, errors


def test_pad_fallback_is_eos_and_says_so_in_one_line_once(mistral, capsys):
    tok = Tokenizer.from_folder(mistral("v1"))  # Mistral defines no pad token
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert tok.pad_id == tok.eos_id == 2
        assert tok.pad_id == 2
    assert not w  # a UserWarning printed its source line on every run
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("note: ") and "no pad token" in lines[0] and "(id 2)" in lines[0]


def test_missing_files_name_folder_and_files(tmp_path):
    with pytest.raises(UserError) as e:
        Tokenizer.from_folder(tmp_path)
    msg = str(e.value)
    assert str(tmp_path) in msg and "tokenizer.json" in msg and "tokenizer.model" in msg and "spiece.model" in msg
    assert "\n" not in msg
    with pytest.raises(UserError, match="not a folder"):
        Tokenizer.from_folder(tmp_path / "nope")


def test_bad_config_is_a_user_error(tmp_path):
    folder = make_bpe_tokenizer(tmp_path / "bpe")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<|nope|>"}))
    with pytest.raises(UserError, match="eos_token '<\\|nope\\|>' is not in the vocabulary"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match="tokenizer_config.json: cannot read JSON"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer_config.json").unlink()
    (folder / "special_tokens_map.json").unlink()
    tok = Tokenizer.from_folder(folder)  # no config: no special ids known, and encode says so
    assert tok.bos_id is None
    with pytest.raises(UserError, match="no bos token"):
        tok.encode("hi", bos=True)


def test_chat_format_detection_and_override(mistral, tmp_path):
    assert Tokenizer.from_folder(make_llama3_tokenizer(tmp_path / "l3")).chat_format == "llama3"
    assert Tokenizer.from_folder(mistral("v3")).chat_format == "mistral"  # [INST] is a token
    assert Tokenizer.from_folder(make_bpe_tokenizer(tmp_path / "bpe")).chat_format is None
    assert Tokenizer.from_folder(mistral("v1"), chat_format="llama2").chat_format == "llama2"
    folder = make_sp_tokenizer(tmp_path / "sp")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": LLAMA2_TEMPLATE}))
    tok = Tokenizer.from_folder(folder)  # a chat template: rendered as it is, no hand-written format
    assert tok.chat_format is None and tok.chat_template == LLAMA2_TEMPLATE
    tok.save(tmp_path / "saved")
    again = Tokenizer.from_folder(tmp_path / "saved")
    assert again.chat_format is None and again.chat_template == LLAMA2_TEMPLATE
    assert Tokenizer.from_folder(folder, chat_format="llama2").chat_format == "llama2"  # the override wins
    with pytest.raises(UserError, match="chat_format='chatml': unknown — .* chat_template=chatml"):
        Tokenizer.from_folder(folder, chat_format="chatml")
    bare = Tokenizer.from_folder(make_bpe_tokenizer(tmp_path / "bpe2"))
    with pytest.raises(UserError, match="no chat template — give the template the model was trained with"):
        bare.encode_chat(CHATS[0])


# --------------------------------------------------------------------------- chat formats


def reference_mask(render, messages) -> list[bool]:
    """Target positions from a reference renderer: the tokens an assistant turn adds to the
    conversation before it (its content and end token)."""
    ids = render(messages, False)
    mask = [False] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(render(messages[:k], True))
            end = len(render(messages[: k + 1], False))
            assert ids[:end] == render(messages[: k + 1], False)
            mask[start:end] = [True] * (end - start)
    return mask


def hf_renderer(folder: Path, template: str, **kw):
    ref = hf(folder, **kw)
    return lambda msgs, gen: ref.apply_chat_template(
        msgs, chat_template=template, tokenize=True, return_dict=False, add_generation_prompt=gen)


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_mistral_v1_chat_equals_transformers_template_and_mistral_common(mistral, chat):
    messages = CHATS[chat]
    tok = Tokenizer.from_folder(mistral("v1"))
    assert tok.chat_format == "mistral" or tok.chat_format is None
    tok.chat_format = "mistral"
    ids, mask = tok.encode_chat(messages)
    render = hf_renderer(mistral("v1"), MISTRAL_TEMPLATE)
    assert ids == render(messages, False)
    assert mask == reference_mask(render, messages)
    assert ids == mistral_common_ids("v1", messages)


@pytest.mark.parametrize("version", ["v2", "v3", "v7"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_mistral_control_token_chats_equal_mistral_common(mistral, version, chat):
    messages = CHATS[chat]
    tok = Tokenizer.from_folder(mistral(version))
    assert tok.chat_format == "mistral"
    ids, mask = tok.encode_chat(messages)
    assert ids == mistral_common_ids(version, messages)
    # the mask, from mistral-common's ids: what follows each [/INST] up to and including eos
    ref = mistral_common_ids(version, messages)
    end_inst, eos = tok.token_to_id("[/INST]"), tok.eos_id
    expected, inside = [], False
    for t in ref:
        expected.append(inside)
        inside = (inside and t != eos) or t == end_inst
    assert mask == expected


def mistral_common_ids(version: str, messages: list[dict]) -> list[int]:
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    mt = MistralTokenizer.from_file(str(MISTRAL_DATA / MISTRAL_FILES[version]))
    cls = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    msgs = [cls[m["role"]](content=m["content"]) for m in messages]
    if messages[-1]["role"] == "assistant":
        # mistral-common encodes a request (ending with a user turn); the final answer is
        # encode(answer) + eos, as its encode_assistant_message does
        prefix = mt.encode_chat_completion(ChatCompletionRequest(messages=msgs[:-1])).tokens
        inner = mt.instruct_tokenizer.tokenizer
        return prefix + inner.encode(messages[-1]["content"], bos=False, eos=True)
    return mt.encode_chat_completion(ChatCompletionRequest(messages=msgs)).tokens


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_llama2_chat_equals_meta_reference_and_transformers(mistral, chat):
    """Llama-2 on a Llama-vocabulary sentencepiece model (Mistral v1's, same format).

    Meta's reference (llama/generation.py) encodes each turn with sentencepiece, bos and eos
    around `[INST] {user} [/INST] {answer} `. transformers reproduces that with legacy=True;
    its legacy=False default drops the "▁" sentencepiece puts before "[INST]" after <s>.
    """
    messages = CHATS[chat]
    folder = mistral("v1")
    tok = Tokenizer.from_folder(folder, chat_format="llama2")
    ids, mask = tok.encode_chat(messages)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    system, turns = (messages[0]["content"], messages[1:]) if messages[0]["role"] == "system" else (None, messages)
    meta = []
    for i in range(0, len(turns), 2):
        user = turns[i]["content"]
        if i == 0 and system is not None:
            user = f"<<SYS>>\n{system}\n<</SYS>>\n\n{user}"
        if i + 1 < len(turns):
            meta += [1] + sp.encode(f"[INST] {user.strip()} [/INST] {turns[i + 1]['content'].strip()} ") + [2]
        else:
            meta += [1] + sp.encode(f"[INST] {user.strip()} [/INST]")
    assert ids == meta
    render = hf_renderer(folder, LLAMA2_TEMPLATE, legacy=True)
    assert ids == render(messages, False)
    assert mask == reference_mask(render, messages)


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("gen", [False, True])
def test_llama3_chat_equals_transformers_template(tmp_path, chat, gen):
    folder = make_llama3_tokenizer(tmp_path / "l3")
    messages = CHATS[chat]
    if gen and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    tok = Tokenizer.from_folder(folder)
    ids, mask = tok.encode_chat(messages, add_generation_prompt=gen)
    render = hf_renderer(folder, LLAMA3_TEMPLATE)
    assert ids == render(messages, gen)
    if not gen:
        assert mask == reference_mask(render, messages)
    eot = tok.token_to_id("<|eot_id|>")
    ends = [i for i, t in enumerate(ids) if t == eot]
    assert [mask[i] for i in ends] == [m["role"] == "assistant" for m in messages]


def test_chat_on_tokenizer_json_mistral_template(tmp_path):
    """tokenizer.json backend with the Mistral template: ids as transformers renders them."""
    folder = make_bpe_tokenizer(tmp_path / "bpe")
    tok = Tokenizer.from_folder(folder, chat_format="mistral")
    render = hf_renderer(folder, MISTRAL_TEMPLATE)
    for messages in CHATS:
        ids, mask = tok.encode_chat(messages)
        assert ids == render(messages, False)
        assert mask == reference_mask(render, messages)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ([{"role": "user"}], r"messages\[0\]: content must be a string"),
        ([{"role": "bot", "content": "x"}], r"messages\[0\]: role 'bot'"),
        ([{"role": "assistant", "content": "x"}], r"messages\[0\]: expected role 'user'"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "system message may only come first"),
        ([{"role": "user", "content": "  "}], "empty content"),
        ([{"role": "system", "content": "s"}], "only a system message"),
        (["hi"], r"messages\[0\]: expected an object"),
    ],
)
def test_bad_messages_are_user_errors(mistral, messages, match):
    tok = Tokenizer.from_folder(mistral("v1"), chat_format="mistral")
    with pytest.raises(UserError, match=match):
        tok.encode_chat(messages)
