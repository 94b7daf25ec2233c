"""Chat templates from the checkpoint: ids and masks against transformers' `apply_chat_template`.

References (never our own output):
- ids: transformers' `apply_chat_template(..., tokenize=True)` on the same folder and template;
- masks: for templates with `{% generation %}` markers, transformers' `return_assistant_tokens_mask`;
  otherwise, written out per family from the template's known shape: the characters after the
  assistant header up to and including the family's end-of-turn token (found by string search
  in transformers' rendering), mapped to transformers' tokens through their offsets.

The templates are in tests/fixtures/chat_templates (see the README there for their origin). The
tokenizers are tiny, trained here, with each family's special tokens; the Mistral and Llama-2
ones use Mistral's real tokenizer.model files shipped with mistral-common.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest

from _tok import corpus, make_bpe_tokenizer, make_llama3_tokenizer
from minitrain.errors import UserError
from minitrain.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

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
        {"role": "assistant", "content": " 4 5 6 "},
        {"role": "user", "content": "Next?"},
        {"role": "assistant", "content": "7"},
    ],
]
NO_SYSTEM = [0, 2]

# --------------------------------------------------------------------------- tokenizer folders

MISTRAL_FILES = {
    "v1": "tokenizer.model.v1",
    "v3": "mistral_instruct_tokenizer_240323.model.v3",
    "v7": "mistral_instruct_tokenizer_241114.model.v7",
}


def _mistral_model(version: str) -> Path:
    mc = pytest.importorskip("mistral_common")
    return Path(mc.__file__).parent / "data" / MISTRAL_FILES[version]


def _bytelevel(d: Path, specials: list[str], added: list[str], config: dict) -> None:
    """A byte-level BPE like Qwen2 / SmolLM2's, with `specials` (special) and `added` (not special)."""
    from tokenizers import AddedToken, Regex, Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    from _tok import LLAMA3_SPLIT

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))


def _metaspace(d: Path, specials: list[str], config: dict) -> None:
    """A sentencepiece-like BPE (Metaspace) `tokenizer.json` like Gemma / Phi-3's, with `specials`."""
    from tokenizers import AddedToken, Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))


QWEN = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"])
GEMMA4 = ["<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|tool_call>",
          "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|image|>", "<|audio|>", "<|video|>"]
HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
           "<|message|>", "<|call|>"]  # gpt-oss's special tokens (o200k_harmony)


def _family_folder(d: Path, family: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    if family in ("llama2", "mistral_v0.1", "mistral_v0.2", "mistral_v0.3", "mistral_v7", "llama2_legacy"):
        version = {"mistral_v0.3": "v3", "mistral_v7": "v7"}.get(family, "v1")
        shutil.copy(_mistral_model(version), d / "tokenizer.model")
        config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizer"}
        if family == "llama2_legacy":
            config["legacy"] = True
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    elif family.startswith("llama3"):
        make_llama3_tokenizer(d)
    elif family.startswith("qwen"):
        _bytelevel(d, *QWEN, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None})
    elif family == "gptoss":
        _bytelevel(d, HARMONY, [], {"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                                    "pad_token": "<|endoftext|>"})
    elif family == "smollm2":
        _bytelevel(d, QWEN[0], [], {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                    "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"})
    elif family == "gemma4":
        _metaspace(d, ["<pad>", "<eos>", "<bos>", *GEMMA4], {"bos_token": "<bos>", "eos_token": "<eos>",
                                                           "pad_token": "<pad>", "unk_token": "<unk>"})
    elif family.startswith("gemma"):
        _metaspace(d, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
                   {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"})
    elif family.startswith("phi3"):
        _metaspace(d, ["<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"],
                   {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                    "unk_token": "<unk>"})
    elif family == "zephyr":  # <|user|> etc. are plain text in Zephyr's vocabulary
        _metaspace(d, ["<s>", "</s>"], {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    else:
        raise KeyError(family)
    return d


_FOLDERS: dict[str, Path] = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """`folder(family, template)`: a tokenizer folder of that family with `chat_template.jinja`."""

    def get(family: str, template: str) -> Path:
        key = f"{family}-{template}"
        if key not in _FOLDERS:
            d = _family_folder(tmp_path_factory.mktemp(key.replace(".", "_")), family)
            shutil.copy(TEMPLATES / f"{template}.jinja", d / "chat_template.jinja")
            _FOLDERS[key] = d
        return _FOLDERS[key]

    return get


def hf(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


# --------------------------------------------------------------------------- the reference mask

# per family: the text that opens an assistant turn, and the token that ends it
SHAPES = {
    "llama2": (r"\[/INST\]", "</s>"),
    "mistral": (r"\[/INST\]", "</s>"),
    "llama3": (r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n", "<|eot_id|>"),
    "chatml": (r"<\|im_start\|>assistant\n", "<|im_end|>"),
    "gemma": (r"<start_of_turn>model\n", "<end_of_turn>"),
    "gemma4": (r"<\|turn>model\n", "<turn|>"),
    "phi3": (r"<\|assistant\|>\n", "<|end|>"),
    "zephyr": (r"<\|assistant\|>\n", "</s>"),
    # gpt-oss's harmony: a turn that more messages follow ends with <|end|>, the last one with <|return|>
    "harmony": (r"<\|start\|>assistant", ("<|end|>", "<|return|>")),
}


def reference_mask(ref, text: str, header: str, eot: str) -> list[bool]:
    """Targets: from the end of each assistant header through the next `eot`, in characters of
    transformers' rendering, then every token (transformers' offsets) overlapping those spans."""
    spans = []
    ends = re.compile("|".join(re.escape(e) for e in ((eot,) if isinstance(eot, str) else eot)))
    for m in re.finditer(header, text):
        spans.append((m.end(), ends.search(text, m.end()).end()))
    enc = ref(text, add_special_tokens=False, return_offsets_mapping=True)
    return [any(s < b and e > a for a, b in spans) for s, e in enc["offset_mapping"]]


CASES = [  # (family folder, template fixture, mask shape, chats, template kwargs)
    ("llama2", "llama2", "llama2", [0, 1, 2], {}),
    ("llama2_legacy", "llama2", "llama2", [0, 1, 2], {}),
    ("mistral_v0.1", "mistral_v0.1", "mistral", NO_SYSTEM, {}),
    ("mistral_v0.2", "mistral_v0.2", "mistral", [0, 1, 2], {}),
    ("mistral_v0.3", "mistral_v0.3", "mistral", [0, 1, 2], {}),  # 1: the system message moves to the last turn
    ("mistral_v7", "mistral_v7", "mistral", [0, 1, 2], {}),
    ("llama3", "llama3", "llama3", [0, 1, 2], {}),
    ("llama3", "llama3_1", "llama3", [0, 1, 2], {"date_string": "26 Jul 2024"}),
    ("llama3", "llama3_2", "llama3", [0, 1, 2], {"date_string": "24 Nov 2026"}),
    ("qwen", "qwen2_5", "chatml", [0, 1, 2], {}),
    ("qwen", "qwen3", "chatml", [0, 1, 2], {"enable_thinking": True}),
    ("qwen", "qwen3", "chatml", [0, 1, 2], {"enable_thinking": False}),
    ("qwen", "qwen3_5_think", "chatml", [0, 1, 2], {}),  # Qwen3.5-4B and larger: thinking by default
    ("qwen", "qwen3_5_think", "chatml", [0, 1, 2], {"enable_thinking": False}),
    ("qwen", "qwen3_5_nothink", "chatml", [0, 1, 2], {}),  # Qwen3.5-2B and smaller: no thinking by default
    ("qwen", "qwen3_5_nothink", "chatml", [0, 1, 2], {"enable_thinking": True}),
    ("gemma", "gemma2", "gemma", NO_SYSTEM, {}),
    ("gemma", "gemma3", "gemma", [0, 1, 2], {}),
    ("gemma4", "gemma4", "gemma4", [0, 1, 2], {}),
    ("gemma4", "gemma4", "gemma4", [0, 1, 2], {"enable_thinking": True}),
    ("phi3", "phi3", "phi3", [0, 1, 2], {}),
    ("smollm2", "smollm2", "chatml", [0, 1, 2], {}),
    ("zephyr", "zephyr", "zephyr", [0, 1, 2], {}),
    ("gptoss", "gptoss", "harmony", [0, 1, 2], {}),  # 1: the system message becomes harmony's developer message
]


@pytest.mark.parametrize("family, template, shape, chats, kwargs", CASES,
                         ids=[f"{c[1]}-{c[0]}" + ("-nothink" if c[4].get("enable_thinking") is False else "")
                              + ("-think" if c[1] in ("gemma4", "qwen3_5_nothink") and c[4].get("enable_thinking")
                                 else "")
                              for c in CASES])
def test_template_ids_and_mask_equal_transformers(folder, family, template, shape, chats, kwargs):
    d = folder(family, template)
    tok = Tokenizer.from_folder(d)
    assert tok.chat_format is None and tok.chat_template == (TEMPLATES / f"{template}.jinja").read_text()
    tok.chat_template_kwargs = dict(kwargs)
    ref = hf(d)
    header, eot = SHAPES[shape]
    for k in chats:
        messages = CHATS[k]
        ids, mask = tok.encode_chat(messages)
        assert ids == ref.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs), (template, k)
        text = ref.apply_chat_template(messages, tokenize=False, **kwargs)
        if shape == "chatml":  # what the generation prompt adds after the header (Qwen3 / 3.5's think block) is
            # prompt on the last turn: the target is what a model given that prompt generates
            prompt = ref.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True, **kwargs)
            tail = prompt[prompt.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
            header = r"(?s)<\|im_start\|>assistant\n" + (f"(?:{re.escape(tail)}(?!.*<\\|im_start\\|>))?" if tail else "")
        assert mask == reference_mask(ref, text, header, eot), (template, k)
        # the prompt alone, as DPO renders it: the generation prompt and no target
        prompt = messages[:-1]
        p_ids, p_mask = tok.encode_chat(prompt, add_generation_prompt=True)
        assert p_ids == ref.apply_chat_template(prompt, tokenize=True, return_dict=False, add_generation_prompt=True,
                                                **kwargs)


@pytest.mark.parametrize("family, template", [("qwen", "qwen3_generation"), ("qwen", "qwen3_5_think_training"),
                                              ("qwen", "qwen3_5_nothink_training"), ("llama3", "llama3_generation"),
                                              ("gemma", "gemma2_generation"), ("qwen", "qwen2_5_generation"),
                                              ("phi3", "phi3_generation"), ("gptoss", "gptoss_training")])
def test_generation_markers_give_transformers_assistant_mask(folder, family, template):
    d = folder(family, template)
    tok = Tokenizer.from_folder(d)
    ref = hf(d)
    for k in NO_SYSTEM if family == "gemma" else range(len(CHATS)):
        ids, mask = tok.encode_chat(CHATS[k])
        out = ref.apply_chat_template(CHATS[k], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == out["input_ids"]
        assert [int(m) for m in mask] == out["assistant_masks"]


def test_qwen3_reasoning_and_thinking_switch(folder):
    """Reasoning in the data (`reasoning_content` or inline <think>): Qwen3 shows it on the last
    turn only, as a target; enable_thinking=false puts the empty think block of the generation
    prompt in the prompt, not the targets (multi-turn without reasoning: CASES above)."""
    d = folder("qwen", "qwen3")
    tok, ref = Tokenizer.from_folder(d), hf(d)
    chats = [
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add them"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nb"},
         {"role": "user", "content": "c"}, {"role": "assistant", "content": "<think>x</think>d"}],
    ]
    for messages in chats:
        ids, mask = tok.encode_chat(messages)
        assert ids == ref.apply_chat_template(messages, tokenize=True, return_dict=False)
        text = ref.apply_chat_template(messages, tokenize=False)
        assert mask == reference_mask(ref, text, *SHAPES["chatml"])
    tok.chat_template_kwargs = {"enable_thinking": False}
    ids, _ = tok.encode_chat(CHATS[0][:1], add_generation_prompt=True)
    assert tok.decode(ids, skip_special=False).endswith("<think>\n\n</think>\n\n")


def test_qwen3_5_reasoning_is_a_target_after_the_generation_prompt(folder):
    """Qwen3.5 renders a think block on the turns after the last user query (the reasoning of the data,
    or empty). With thinking on, the generation prompt ends in `<think>\n` and the target is the
    reasoning, `</think>` and the answer; with it off, the empty block is prompt and the answer the target."""
    chats = [
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add them"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nb"},
         {"role": "user", "content": "c"}, {"role": "assistant", "content": "<think>x</think>d"}],
    ]
    for template, kwargs, target in [("qwen3_5_think", {}, "add them\n</think>\n\n4<|im_end|>"),
                                     ("qwen3_5_nothink", {"enable_thinking": True}, "add them\n</think>\n\n4<|im_end|>")]:
        d = folder("qwen", template)
        tok, ref = Tokenizer.from_folder(d), hf(d)
        tok.chat_template_kwargs = dict(kwargs)
        for messages in chats:
            ids, mask = tok.encode_chat(messages)
            assert ids == ref.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        ids, mask = tok.encode_chat(chats[0])
        assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special=False) == target
    tok.chat_template_kwargs = {}  # qwen3_5_nothink's default: the empty block in the prompt
    ids, _ = tok.encode_chat(chats[0][:1], add_generation_prompt=True)
    assert tok.decode(ids, skip_special=False).endswith("<think>\n\n</think>\n\n")


def test_mistral_v7_template_equals_mistral_common(folder):
    """The v7 template on Mistral's v7 tokenizer.model gives mistral-common's own ids."""
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tok = Tokenizer.from_folder(folder("mistral_v7", "mistral_v7"))
    mt = MistralTokenizer.from_file(str(_mistral_model("v7")))
    cls = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    messages = CHATS[1][:-1]
    ids, _ = tok.encode_chat(messages)
    ref = mt.encode_chat_completion(ChatCompletionRequest(messages=[cls[m["role"]](content=m["content"])
                                                                    for m in messages])).tokens
    assert ids == ref


# --------------------------------------------------------------------------- refusals and fixes


def test_template_refusal_is_one_line_with_the_templates_message(folder):
    tok = Tokenizer.from_folder(folder("gemma", "gemma2"))
    with pytest.raises(UserError, match="the chat template refuses this conversation: System role not supported"):
        tok.encode_chat(CHATS[1])
    tok = Tokenizer.from_folder(folder("mistral_v0.2", "mistral_v0.2"))
    with pytest.raises(UserError, match="conversation roles must alternate"):
        tok.encode_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_moved_system_message_is_located_in_the_full_text(folder):
    """Mistral v0.3's template joins the system message to the last user message: the conversation
    before an answer renders differently once the conversation goes on, so each answer is found in
    the one full rendering (ids and mask against transformers: test_template_ids_and_mask_equal_transformers,
    chat 1); the explicit chat_format override still renders mistral-common's way."""
    d = folder("mistral_v0.3", "mistral_v0.3")
    ids, mask = Tokenizer.from_folder(d).encode_chat(CHATS[1][:3])
    assert sum(mask) > 0
    tok = Tokenizer.from_folder(d, chat_format="mistral")  # the explicit override ignores the template
    ids, mask = tok.encode_chat(CHATS[1][:3])
    assert tok.decode(ids, skip_special=False).count("You are terse.") == 1 and any(mask)


def test_unlocatable_spans_are_refused(tmp_path):
    """A template that reorders the conversation (prefixes fail) and rewrites the answer's text (it
    cannot be found): refused, naming the message and what to do."""
    d = make_bpe_tokenizer(tmp_path / "odd")
    (d / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages|reverse %}{{ m['role'] }}: "
                                           "{{ m['content']|upper }}{{ eos_token }}{% endfor %}")
    tok = Tokenizer.from_folder(d)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and"}, {"role": "assistant", "content": "bye"}]
    with pytest.raises(UserError, match=r"cannot locate assistant message 1 .* its text is nowhere followed by "
                                        r"'</s>' — use a template with \{% generation %\} markers, or set chat_format"):
        tok.encode_chat(chat)


def test_double_bos_is_refused(tmp_path):
    """The template writes bos and the data begins with one too (text copied from a rendered chat)."""
    d = make_bpe_tokenizer(tmp_path / "bos")
    (d / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}"
                                           "{% endfor %}")
    tok = Tokenizer.from_folder(d)
    assert tok.encode_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])[0][:2] != [1, 1]
    with pytest.raises(UserError, match="begins with two bos tokens"):
        tok.encode_chat([{"role": "user", "content": "<s>hi"}, {"role": "assistant", "content": "yo"}])


def test_template_without_end_token_gets_eos_as_target(tmp_path):
    """A template that writes no token after the assistant's reply would never teach the model to
    stop: eos is appended to each assistant turn as a target, with a warning."""
    d = make_bpe_tokenizer(tmp_path / "plain")
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                           "{% if add_generation_prompt %}assistant:{% endif %}")
    tok = Tokenizer.from_folder(d)
    ref = hf(d)
    messages = CHATS[2]
    with pytest.warns(UserWarning, match="no end token"):
        ids, mask = tok.encode_chat(messages)
    plain = ref.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert [i for i in ids if i != tok.eos_id] == plain
    assert ids.count(tok.eos_id) == 2 and all(mask[k] for k, i in enumerate(ids) if i == tok.eos_id)
    # each eos closes an assistant turn: the token before it is a target too
    assert all(mask[k - 1] for k, i in enumerate(ids) if i == tok.eos_id)


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused(folder):
    tok = Tokenizer.from_folder(folder("llama3", "llama3_1"))
    tok.chat_template_kwargs = {"date_string": "01 Jan 2030"}
    ids, _ = tok.encode_chat(CHATS[0])
    assert "Today Date: 01 Jan 2030" in tok.decode(ids, skip_special=False)
    tok.chat_template_kwargs = {"messages": []}
    with pytest.raises(UserError, match="chat_template_kwargs: 'messages'"):
        tok.encode_chat(CHATS[0])


def test_named_templates_and_tokenizer_config_entry(tmp_path, folder):
    """A list of named templates in tokenizer_config.json: "default" is used; save() keeps them."""
    d = make_llama3_tokenizer(tmp_path / "named")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": (TEMPLATES / "llama3.jinja").read_text()},
                            {"name": "tool_use", "template": "{{ 'tools' }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_folder(d)
    ref = hf(d)
    assert set(tok.chat_templates) == {"default", "tool_use"}
    assert tok.encode_chat(CHATS[0])[0] == ref.apply_chat_template(CHATS[0], tokenize=True, return_dict=False)
    tok.save(tmp_path / "saved")
    again = Tokenizer.from_folder(tmp_path / "saved")
    assert again.chat_templates == tok.chat_templates


def test_bad_template_is_one_line(tmp_path):
    d = make_bpe_tokenizer(tmp_path / "bad")
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    tok = Tokenizer.from_folder(d)
    with pytest.raises(UserError, match=r"chat template 'default' does not parse"):
        tok.encode_chat(CHATS[0])


def test_sandbox_blocks_python_internals(tmp_path):
    d = make_bpe_tokenizer(tmp_path / "evil")
    (d / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    tok = Tokenizer.from_folder(d)
    with pytest.raises(UserError, match="chat template failed"):
        tok.encode_chat(CHATS[0])


# --------------------------------------------------------------------------- no template of its own


def _untemplated(tmp_path: Path, family: str) -> Path:
    """A tokenizer folder of `family`'s vocabulary with no chat template."""
    return _family_folder(tmp_path / family, family)


def test_advice_for_a_chatml_vocabulary_without_template(tmp_path):
    """A Qwen-shaped vocabulary (no bos) without a template: the error names chatml and a .jinja file,
    and no hand-written format (each needs tokens this vocabulary lacks)."""
    tok = Tokenizer.from_folder(_untemplated(tmp_path, "qwen"))
    with pytest.raises(UserError) as e:
        tok.encode_chat(CHATS[0])
    message = e.value.message
    assert "no chat template" in message and "chat_template=chatml" in message and ".jinja" in message
    assert "chat_format" not in message
    for name in ("mistral", "llama2", "llama3"):  # indeed none of them renders with this vocabulary
        tok.chat_format = name
        with pytest.raises(UserError):
            tok.encode_chat(CHATS[0])


def test_advice_for_a_sentencepiece_vocabulary_names_only_formats_that_render(tmp_path):
    tok = Tokenizer.from_folder(_untemplated(tmp_path, "zephyr"))  # <s>, </s>; no [INST], no Llama-3 headers
    with pytest.raises(UserError) as e:
        tok.encode_chat(CHATS[0])
    message = e.value.message
    assert "chat_format=mistral" in message and "chat_format=llama2" in message
    assert "llama3" not in message and "chatml" not in message


@pytest.mark.parametrize("family", ["qwen", "smollm2"])
def test_carried_chatml_equals_the_checkpoints_chatml(tmp_path, family):
    """`chat_template=chatml` on a ChatML vocabulary gives transformers' ids under the family's own ChatML
    template (on conversations with a system message, where those templates add nothing of their own),
    and the ChatML mask."""
    from minitrain.text.chat_template import resolve_template

    ours = _untemplated(tmp_path / "ours", family)
    tok = Tokenizer.from_folder(ours)
    tok.chat_template = resolve_template("chatml", str(ours), tok.special_id)
    theirs = _family_folder(tmp_path / "theirs", family)
    template = {"qwen": "qwen2_5", "smollm2": "smollm2"}[family]
    shutil.copy(TEMPLATES / f"{template}.jinja", theirs / "chat_template.jinja")
    ref = hf(theirs)
    chats = [CHATS[1], [{"role": "system", "content": "Be brief."}, *CHATS[2]]]
    for messages in chats:
        ids, mask = tok.encode_chat(messages)
        assert ids == ref.apply_chat_template(messages, tokenize=True, return_dict=False)
        text = ref.apply_chat_template(messages, tokenize=False)
        assert mask == reference_mask(ref, text, *SHAPES["chatml"])


def test_chat_template_key_refusals(tmp_path):
    from minitrain.text.chat_template import resolve_template

    d = _untemplated(tmp_path, "zephyr")
    tok = Tokenizer.from_folder(d)
    with pytest.raises(UserError, match=r"chat_template=chatml: .* has no <\|im_start\|> / <\|im_end\|> special "
                                        r"token — this is not a chatml vocabulary"):
        resolve_template("chatml", str(d), tok.special_id)
    with pytest.raises(UserError, match="chat_template=nope.jinja: no such file, and minitrain carries no "
                                        "template of that name — give a .jinja file, or one of chatml"):
        resolve_template("nope.jinja", str(d), tok.special_id)
    (tmp_path / "mine.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert resolve_template(str(tmp_path / "mine.jinja"), str(d), tok.special_id).startswith("{% for m")


def test_prompt_completion_as_chat_equals_transformers(folder, tmp_path):
    """`prompt_completion="chat"`: a {prompt, completion} row is the chat [user: prompt, assistant:
    completion], with transformers' ids and the ChatML mask; "raw" (the default) keeps plain text."""
    from minitrain.data.readers import read_sft

    d = folder("qwen", "qwen2_5")
    tok, ref = Tokenizer.from_folder(d), hf(d)
    rows = tmp_path / "rows.jsonl"
    pairs = [("What is 2+2?", "It is 4."), ("Name a colour.\nJust one.", "Blue 🙂")]
    rows.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
    chat = read_sft(rows, tok, max_len=512, prompt_completion="chat")
    assert chat.shapes == {"chat": 0, "pair": 0, "pair_chat": 2, "text": 0}
    for ex, (p, c) in zip(chat, pairs):
        messages = [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
        assert ex["input_ids"] == ref.apply_chat_template(messages, tokenize=True, return_dict=False)
        text = ref.apply_chat_template(messages, tokenize=False)
        assert [label != -100 for label in ex["labels"]] == reference_mask(ref, text, *SHAPES["chatml"])
    raw = read_sft(rows, tok, max_len=512)
    assert raw.shapes["pair"] == 2 and raw[0]["input_ids"] == tok.encode(pairs[0][0]) + tok.encode(
        pairs[0][1], continuation=True) + [tok.eos_id]


THINKING = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "thinking": "Add them."},
            {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6", "thinking": "Add again."}]


def test_gptoss_harmony_with_its_reasoning_channel(folder):
    """gpt-oss's own template drops the reasoning of earlier turns and writes the last turn's on the
    analysis channel before the final one: ids as transformers'; the whole last turn (both channels)
    and each earlier answer are targets. With TRL's training variant of the template (generation
    markers) the mask is transformers' `return_assistant_tokens_mask`."""
    d = folder("gptoss", "gptoss")
    tok, ref = Tokenizer.from_folder(d), hf(d)
    ids, mask = tok.encode_chat(THINKING)
    assert ids == ref.apply_chat_template(THINKING, tokenize=True, return_dict=False)
    text = ref.apply_chat_template(THINKING, tokenize=False)
    assert "Add them." not in text and "<|channel|>analysis<|message|>Add again.<|end|>" in text
    targets = "".join(ref.decode([i]) for i, m in zip(ids, mask) if m)
    assert targets == ("<|channel|>final<|message|>4<|end|><|channel|>analysis<|message|>Add again.<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>6<|return|>")
    d = folder("gptoss", "gptoss_training")
    tok, ref = Tokenizer.from_folder(d), hf(d)
    ids, mask = tok.encode_chat(THINKING)
    out = ref.apply_chat_template(THINKING, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == out["input_ids"] and [int(m) for m in mask] == out["assistant_masks"]
