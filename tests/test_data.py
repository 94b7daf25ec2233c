"""Data tests: readers against the tokenizers' own encodings and transformers' T5Tokenizer,
errors as one-line UserErrors with file:line, hypothesis fuzzing of rows, Batcher order and
resume, collators."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _tok import corpus, make_bpe_tokenizer, make_llama3_tokenizer, make_sp_tokenizer, make_t5_tokenizer
from minitrain.data.batcher import Batcher
from minitrain.data.collate import collate_causal, collate_preference, collate_seq2seq
from minitrain.data.files import read_jsonl
from minitrain.data.readers import read_preference, read_seq2seq, read_sft
from minitrain.errors import UserError
from minitrain.text.tokenizer import Tokenizer

IGNORE = -100
_TOK: dict[str, Tokenizer] = {}


def tok(kind: str) -> Tokenizer:
    """Module-cached tokenizers: bpe / sp (pad 0, bos 1, eos 2), t5, llama3 (chat)."""
    if kind not in _TOK:
        make = {"bpe": make_bpe_tokenizer, "sp": make_sp_tokenizer, "t5": make_t5_tokenizer,
                "llama3": make_llama3_tokenizer}[kind]
        _TOK[kind] = Tokenizer.from_folder(make(Path(tempfile.mkdtemp()) / kind))
    return _TOK[kind]


def write(path: Path, rows) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def assert_user_error(fn, where: str, *words: str) -> str:
    with pytest.raises(UserError) as e:
        fn()
    msg = str(e.value)
    assert msg.startswith(where + ": "), msg
    assert "\n" not in msg and " — " in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


# --------------------------------------------------------------------------- SFT


@pytest.mark.parametrize("kind", ["bpe", "sp"])
def test_sft_prompt_completion(tmp_path, kind):
    t = tok(kind)
    rows = [{"prompt": "Q: what is the time?\nA:", "completion": " the time is 42."},
            {"prompt": "Say two words:", "completion": " hello world"}]
    ex = read_sft(write(tmp_path / "d.jsonl", rows), t, max_len=128)
    assert len(ex) == 2 and ex.skipped == 0 and ex.truncated == 0
    for e, r in zip(ex, rows):
        p = [t.bos_id] + t.encode(r["prompt"])
        c = t.encode(r["completion"], continuation=True) + [t.eos_id]
        assert e["input_ids"] == p + c
        assert e["labels"] == [IGNORE] * len(p) + c
        # the labels decode to the completion, -100 and all (field report 003)
        assert t.decode(e["labels"]) == t.decode(c)
        assert t.decode(e["labels"]).strip() == r["completion"].strip()


def test_sft_completion_tokens_equal_transformers_joined(tmp_path):
    """prompt + completion ids are what transformers gives for the joined string."""
    transformers = pytest.importorskip("transformers")
    folder = make_bpe_tokenizer(tmp_path / "bpe")
    t, ref = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    rows = [{"prompt": "Q: what is it?\nA:", "completion": " a picture."},
            {"prompt": "Two words:\n", "completion": "hello world"}]
    ex = read_sft(write(tmp_path / "d.jsonl", rows), t, max_len=128)
    for e, r in zip(ex, rows):
        joined = ref(r["prompt"] + r["completion"], add_special_tokens=False).input_ids
        assert e["input_ids"] == [t.bos_id] + joined + [t.eos_id]


def test_sft_messages_and_text(tmp_path):
    t = tok("llama3")
    chat = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Name a word."},
            {"role": "assistant", "content": "Picture."}]
    ex = read_sft(write(tmp_path / "d.jsonl", [{"messages": chat}, {"text": "the world is round."}]), t, max_len=256)
    ids, mask = t.encode_chat(chat)
    assert ex[0]["input_ids"] == ids
    assert ex[0]["labels"] == [i if m else IGNORE for i, m in zip(ids, mask)]
    text_ids = [t.bos_id] + t.encode("the world is round.") + [t.eos_id]
    assert ex[1]["input_ids"] == text_ids
    assert ex[1]["labels"] == [IGNORE] + text_ids[1:]


def test_field_mapping(tmp_path):
    t = tok("bpe")
    path = write(tmp_path / "d.jsonl", [{"question": "what is it?", "answer": " a word"}])
    ex = read_sft(path, t, max_len=64, fields={"prompt": "question", "completion": "answer"})
    assert ex[0]["input_ids"] == [1] + t.encode("what is it?") + t.encode(" a word", continuation=True) + [2]
    with pytest.raises(UserError, match="fields: unknown name 'question'"):
        read_sft(path, t, max_len=64, fields={"question": "prompt"})
    assert_user_error(lambda: read_sft(path, t, max_len=64, fields={"prompt": "question"}), f"{path}:1",
                      'missing key "completion"')
    # a mapped key that is missing, and a row of no known shape: the message shows the mapping in force
    mapping = {"prompt": "question", "completion": "reply"}
    assert_user_error(lambda: read_sft(path, t, max_len=64, fields=mapping), f"{path}:1",
                      'missing key "reply"', '(fields maps "completion" to "reply"; fields in force: '
                      '{"prompt": "question", "completion": "reply"})')
    assert_user_error(lambda: read_sft(path, t, max_len=64, fields={"text": "body"}), f"{path}:1",
                      'fields in force: {"text": "body"}')
    with pytest.raises(UserError, match=r"""fields: unknown name 'question' \(fields in force: \{"question": "prompt"\}\)"""):
        read_sft(path, t, max_len=64, fields={"question": "prompt"})


# --------------------------------------------------------------------------- truncation


def test_long_prompt_is_cut_on_the_left_keeping_bos(tmp_path):
    t = tok("bpe")
    prompt = " ".join(corpus(20))  # far longer than max_len
    path = write(tmp_path / "d.jsonl", [{"prompt": prompt, "completion": " the end."}])
    full_p = [t.bos_id] + t.encode(prompt)
    c = t.encode(" the end.", continuation=True) + [t.eos_id]
    ex = read_sft(path, t, max_len=32)
    assert ex.truncated == 1 and ex.skipped == 0
    ids, labels = ex[0]["input_ids"], ex[0]["labels"]
    assert len(ids) == 32
    assert ids == [t.bos_id] + full_p[len(full_p) - (32 - len(c)) + 1 :] + c  # prompt's end kept
    assert labels[-len(c):] == c and set(labels[:-len(c)]) == {IGNORE}
    right = read_sft(path, t, max_len=32, truncation_side="right")[0]["input_ids"]
    assert right == full_p[: 32 - len(c)] + c


def test_long_completion_keeps_max_prompt_len_and_loses_its_end(tmp_path):
    t = tok("bpe")
    prompt, completion = " ".join(corpus(5)), " " + " ".join(corpus(5, seed=1))
    path = write(tmp_path / "d.jsonl", [{"prompt": prompt, "completion": completion}])
    p = [t.bos_id] + t.encode(prompt)
    c = t.encode(completion, continuation=True) + [t.eos_id]
    assert len(p) > 20 and len(c) > 40
    ex = read_sft(path, t, max_len=40)  # default max_prompt_len = 20
    assert ex[0]["input_ids"] == [t.bos_id] + p[len(p) - 19:] + c[:20]
    ex = read_sft(path, t, max_len=40, max_prompt_len=8)
    assert ex[0]["input_ids"] == [t.bos_id] + p[len(p) - 7:] + c[:32]
    assert c[-1] == t.eos_id not in ex[0]["input_ids"]  # a cut completion does not end in eos


def test_rows_without_targets_are_skipped_and_counted(tmp_path):
    t = tok("llama3")
    long_user = " ".join(corpus(10))
    rows = [{"messages": [{"role": "user", "content": long_user}, {"role": "assistant", "content": "Yes."}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Yes."}]}]
    path = write(tmp_path / "d.jsonl", rows)
    n = len(t.encode_chat(rows[1]["messages"])[0]) + 2  # the short chat fits, the long one not
    ex = read_sft(path, t, max_len=n, truncation_side="right")  # the answer falls off the end
    assert (len(ex), ex.skipped, ex.truncated) == (1, 1, 1)
    assert any(x != IGNORE for x in ex[0]["labels"][1:])
    ex = read_sft(path, t, max_len=n, truncation_side="left")  # the answer is kept
    assert (len(ex), ex.skipped, ex.truncated) == (2, 0, 1)
    ids, mask = t.encode_chat(rows[0]["messages"])
    assert ex[0]["input_ids"] == ids[:1] + ids[len(ids) - (n - 1):]
    assert ex[0]["labels"][-3:] == [i if m else IGNORE for i, m in zip(ids[-3:], mask[-3:])]


# --------------------------------------------------------------------------- seq2seq


def test_seq2seq_equals_t5tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = make_t5_tokenizer(tmp_path / "t5", extra_ids=100)
    t, ref = Tokenizer.from_folder(folder), transformers.T5Tokenizer.from_pretrained(str(folder))
    rows = [{"prompt": "question: " + line, "completion": line.split()[0]} for line in corpus(6)]
    path = write(tmp_path / "d.jsonl", rows)
    ex = read_seq2seq(path, t, max_len=256)
    for e, r in zip(ex, rows):
        assert e["input_ids"] == ref(r["prompt"]).input_ids
        assert e["labels"] == ref(text_target=r["completion"]).input_ids
    for side in ("right", "left"):
        ref.truncation_side = side
        ex = read_seq2seq(path, t, max_len=8, max_target_len=3, truncation_side=side)
        assert ex.truncated > 0
        for e, r in zip(ex, rows):
            assert e["input_ids"] == ref(r["prompt"], truncation=True, max_length=8).input_ids
        for e, r in zip(ex, rows):  # a cut target loses its end, eos included (the module's policy)
            assert e["labels"] == ref(text_target=r["completion"]).input_ids[:3]


def test_collate_seq2seq_shifts_labels_right():
    from minitrain.objectives.sft import shift_right

    exs = [{"input_ids": [5, 6, 7, 1], "labels": [8, 9, 1]}, {"input_ids": [5, 1], "labels": [4, 1]}]
    b = collate_seq2seq(exs, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 1], [5, 1, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert b["labels"].tolist() == [[8, 9, 1], [4, 1, IGNORE]]
    assert b["decoder_input_ids"].tolist() == [[0, 8, 9], [0, 4, 1]]
    assert torch.equal(b["decoder_input_ids"], shift_right(b["labels"], 0, 0))
    assert b["decoder_attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


# --------------------------------------------------------------------------- preference


def test_preference_string_prompt(tmp_path):
    t = tok("bpe")
    row = {"prompt": "Pick a word:", "chosen": " picture", "rejected": " the other word"}
    ex = read_preference(write(tmp_path / "d.jsonl", [row]), t, max_len=64)[0]
    p = [t.bos_id] + t.encode(row["prompt"])
    for name in ("chosen", "rejected"):
        a = t.encode(row[name], continuation=True) + [t.eos_id]
        assert ex[f"{name}_ids"] == p + a
        assert ex[f"{name}_labels"] == [IGNORE] * len(p) + a


def test_preference_chat_prompt(tmp_path):
    t = tok("llama3")
    prompt = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Name a word."}]
    rows = [{"prompt": prompt, "chosen": "Picture.", "rejected": "I will not."},
            {"prompt": prompt, "chosen": [{"role": "assistant", "content": "Picture."}],
             "rejected": [{"role": "assistant", "content": "I will not."}]}]
    ex = read_preference(write(tmp_path / "d.jsonl", rows), t, max_len=256)
    assert ex[0] == ex[1]
    p, _ = t.encode_chat(prompt, add_generation_prompt=True)
    for name in ("chosen", "rejected"):
        full, mask = t.encode_chat(prompt + [{"role": "assistant", "content": rows[0][name]}])
        assert ex[0][f"{name}_ids"] == full and full[: len(p)] == p
        assert ex[0][f"{name}_labels"] == [IGNORE] * len(p) + [i if m else IGNORE for i, m in zip(full, mask)][len(p):]


def test_preference_truncation_cuts_the_shared_prompt_once(tmp_path):
    t = tok("bpe")
    row = {"prompt": " ".join(corpus(8)), "chosen": " yes", "rejected": " no, " + " ".join(corpus(3, seed=2))}
    ex = read_preference(write(tmp_path / "d.jsonl", [row]), t, max_len=40)
    assert ex.truncated == 1
    e = ex[0]
    assert len(e["rejected_ids"]) == 40
    n = e["chosen_labels"].index(next(x for x in e["chosen_labels"] if x != IGNORE))
    assert e["chosen_ids"][:n] == e["rejected_ids"][:n]  # the same prompt tokens in both
    assert e["rejected_labels"][:n] == [IGNORE] * n and e["rejected_labels"][n] != IGNORE


def test_collate_preference_stacks_chosen_then_rejected():
    exs = [{"chosen_ids": [1, 5, 6], "chosen_labels": [IGNORE, 5, 6], "rejected_ids": [1, 7], "rejected_labels": [IGNORE, 7]},
           {"chosen_ids": [1, 8], "chosen_labels": [IGNORE, 8], "rejected_ids": [1, 9, 9, 9], "rejected_labels": [IGNORE, 9, 9, 9]}]
    b = collate_preference(exs, pad_id=0)
    assert b["num_pairs"] == 2
    assert b["input_ids"].tolist() == [[1, 5, 6, 0], [1, 8, 0, 0], [1, 7, 0, 0], [1, 9, 9, 9]]
    assert b["labels"].tolist() == [[IGNORE, 5, 6, IGNORE], [IGNORE, 8, IGNORE, IGNORE],
                                    [IGNORE, 7, IGNORE, IGNORE], [IGNORE, 9, 9, 9]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def test_collate_causal_pads_right_to_longest():
    exs = [{"input_ids": [1, 5, 6, 2], "labels": [IGNORE, IGNORE, 6, 2]}, {"input_ids": [1, 7], "labels": [IGNORE, 7]}]
    b = collate_causal(exs, pad_id=0)
    assert b["input_ids"].dtype == torch.long and b["input_ids"].shape == (2, 4)
    assert b["input_ids"].tolist() == [[1, 5, 6, 2], [1, 7, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert b["labels"].tolist() == [[IGNORE, IGNORE, 6, 2], [IGNORE, 7, IGNORE, IGNORE]]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "lines, line_no, words",
    [
        (['{"prompt": "a", "completion": "b"}', '{"prompt": "a", "completion": "b"'], 2, ["malformed JSON"]),
        (['{"prompt": "a"}'], 1, ['missing key "completion"']),
        (['{"prompt": "a", "completion": 3}'], 1, ['"completion" must be a string, got a number']),
        (['{"prompt": "a", "completion": ""}'], 1, ['"completion" is empty']),
        (['{"prompt": "a", "completion": "b"}', '', '[1, 2]'], 3, ["expected a JSON object, got a list"]),
        (['', '', '[1, 2]'], "row 1", ["expected a JSON object, got a number", "row of the array"]),  # a JSON array
        (['{"prompt": "a", "completion": "b"}', '{"other": 1}'], 2, ['no "prompt"/"completion", "messages" or "text" key']),
        (['{"messages": "hi"}'], 1, ['"messages" must be a list']),
        (['{"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]}'], 1,
         ["messages[1]: a system message may only come first"]),
    ],
)
def test_sft_errors_name_file_and_line(tmp_path, lines, line_no, words):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert_user_error(lambda: read_sft(path, tok("llama3"), max_len=64), f"{path}:{line_no}", *words)


def test_file_level_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    assert_user_error(lambda: read_sft(empty, tok("bpe"), max_len=64), str(empty), "empty file")
    missing = tmp_path / "nope.jsonl"
    assert_user_error(lambda: read_sft(missing, tok("bpe"), max_len=64), str(missing), "no such file")
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "caf\xe9"}\n')
    assert_user_error(lambda: list(read_jsonl(bad)), f"{bad}:1", "not UTF-8")
    path = write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": ["x"], "rejected": "b"}])
    assert_user_error(lambda: read_preference(path, tok("bpe"), max_len=64), f"{path}:1", "list of messages")
    path = write(tmp_path / "s.jsonl", [{"prompt": "a", "completion": None}])
    assert_user_error(lambda: read_seq2seq(path, tok("t5"), max_len=64), f"{path}:1", "got null")
    with pytest.raises(UserError, match="truncation_side='middle'"):
        read_sft(path, tok("bpe"), max_len=64, truncation_side="middle")


# --------------------------------------------------------------------------- fuzzing

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=8,
)
# mostly well-formed rows (so that valid examples get checked too), some arbitrary JSON anywhere
text = st.text(st.characters(), min_size=1, max_size=60)


def chance(draw, p: float) -> bool:
    """True with probability about p (hypothesis' integer draws favour edge cases; its random
    floats lean to 0.0, so 0.0 means the well-formed choice)."""
    return draw(st.randoms(use_true_random=False)).random() >= 1 - p


def mostly(draw, good: st.SearchStrategy, bad: st.SearchStrategy = json_values):
    return draw(bad) if chance(draw, 0.1) else draw(good)


@st.composite
def chat(draw, answer_last: bool = True) -> list:
    msgs = [{"role": "system", "content": draw(text)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 2))):
        msgs += [{"role": "user", "content": draw(text)}, {"role": "assistant", "content": draw(text)}]
    if not answer_last:
        msgs.pop()
    if chance(draw, 0.15):  # break one message
        i = draw(st.integers(0, len(msgs) - 1))
        key = draw(st.sampled_from(["role", "content"]))
        msgs[i] = {**msgs[i], key: draw(st.sampled_from(["system", "bot", ""]) | json_values)}
    return msgs


@st.composite
def fuzz_row(draw, kind: str):
    if chance(draw, 0.05):
        return draw(json_values)
    if kind == "sft":
        shape = draw(st.sampled_from([("prompt", "completion"), ("messages",), ("text",)]))
    elif kind == "seq2seq":
        shape = ("prompt", "completion")
    else:
        shape = ("prompt", "chosen", "rejected")
    row = {}
    for key in shape:
        if chance(draw, 0.03):
            continue  # a missing key
        if key == "messages" or (key == "prompt" and kind == "preference" and draw(st.booleans())):
            row[key] = mostly(draw, chat(answer_last=key == "messages"))
        else:
            row[key] = mostly(draw, text)
    if chance(draw, 0.2):
        row[draw(st.text(max_size=8))] = draw(json_values)
    return row


def _valid(ex: dict, vocab: int, max_len: int, kind: str) -> None:
    pairs = [("chosen_ids", "chosen_labels"), ("rejected_ids", "rejected_labels")] if kind == "preference" \
        else [("input_ids", "labels")]
    for ids_k, lab_k in pairs:
        ids, labels = ex[ids_k], ex[lab_k]
        assert all(isinstance(i, int) and 0 <= i < vocab for i in ids)
        assert all(x == IGNORE or 0 <= x < vocab for x in labels)
        assert 0 < len(ids) <= max_len
        if kind == "seq2seq":
            assert labels and labels[-1] != IGNORE or len(labels) == max_len
        else:
            assert len(labels) == len(ids)
            assert any(x != IGNORE for x in labels[1:])  # never an all -100 row


@pytest.mark.parametrize("kind", ["sft", "seq2seq", "preference"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_readers_give_user_errors_or_valid_examples(kind, data):
    rows = data.draw(st.lists(fuzz_row(kind), min_size=0, max_size=3))
    t = tok("t5" if kind == "seq2seq" else "llama3")
    read = {"sft": read_sft, "seq2seq": read_seq2seq, "preference": read_preference}[kind]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
        try:
            ex = read(path, t, max_len=24)
        except UserError as e:
            assert "\n" not in str(e) and str(e).startswith(str(path))
            return
    for e in ex:
        _valid(e, t.vocab_size, 24, kind)


# --------------------------------------------------------------------------- Batcher


def lengths_for(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(4.0, 0.8, n), 4, 2000)]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), bs=st.integers(1, 17), seed=st.integers(0, 2**31), group=st.booleans(),
       drop_last=st.booleans(), epoch=st.integers(0, 3))
def test_batcher_covers_each_index_once_per_epoch(n, bs, seed, group, drop_last, epoch):
    if drop_last and n < bs:
        with pytest.raises(UserError):
            Batcher(lengths_for(n), bs, seed=seed, group_by_length=group, drop_last=drop_last)
        return
    b = Batcher(lengths_for(n), bs, seed=seed, group_by_length=group, drop_last=drop_last)
    batches = b.epoch_batches(epoch)
    flat = [i for x in batches for i in x]
    assert len(batches) == len(b)
    assert len(flat) == len(set(flat))
    assert set(flat) <= set(range(n))
    assert len(flat) == (n - n % bs if drop_last else n)
    assert all(len(x) == bs for x in batches) if drop_last else sum(len(x) < bs for x in batches) <= 1
    assert batches == Batcher(lengths_for(n), bs, seed=seed, group_by_length=group,
                              drop_last=drop_last).epoch_batches(epoch)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 500), size=st.integers(1, 60), seed=st.integers(0, 2**31))
def test_sorting_within_blocks_equals_lexsort_by_block_then_key(n, size, seed):
    from minitrain.data.batcher import _sorted_within

    keys = np.random.default_rng(seed).integers(-20, 0, n)  # many ties: stability counts
    want = np.lexsort((keys, np.arange(n) // size))
    assert np.array_equal(_sorted_within(keys, size), want)


def test_batcher_seeds_and_epochs_change_the_order():
    lengths = lengths_for(200)
    a, b = Batcher(lengths, 8, seed=1), Batcher(lengths, 8, seed=2)
    assert a.epoch_batches(0) != b.epoch_batches(0)
    assert a.epoch_batches(0) != a.epoch_batches(1)
    plain = Batcher(lengths, 8, seed=1, shuffle=False, group_by_length=False)
    assert plain.epoch_batches(0) == [list(range(i, min(i + 8, 200))) for i in range(0, 200, 8)]


@pytest.mark.parametrize("stop", [0, 1, 7, 13, 25, 26, 40])
def test_batcher_resume_sees_exactly_the_remaining_batches(stop):
    lengths = lengths_for(100)
    ref = Batcher(lengths, 8, seed=3)  # 13 batches per epoch
    stream = (b for _ in range(10) for b in ref)
    expected = [next(stream) for _ in range(60)]
    run = Batcher(lengths, 8, seed=3)
    stream = (b for _ in range(10) for b in run)
    seen = [next(stream) for _ in range(stop)]
    state = json.loads(json.dumps(run.state_dict()))  # checkpoints hold JSON
    resumed = Batcher(lengths, 8, seed=3)
    resumed.load_state_dict(state)
    stream = (b for _ in range(10) for b in resumed)
    seen += [next(stream) for _ in range(60 - stop)]
    assert seen == expected


def test_batcher_resume_refuses_other_data_or_settings():
    lengths = lengths_for(50)
    state = Batcher(lengths, 4, seed=0).state_dict()
    with pytest.raises(UserError, match="batch_size=4"):
        Batcher(lengths, 5, seed=0).load_state_dict(state)
    with pytest.raises(UserError, match="seed=0"):
        Batcher(lengths, 4, seed=1).load_state_dict(state)
    with pytest.raises(UserError, match="training data changed"):
        Batcher(lengths[:-1] + [lengths[-1] + 1], 4, seed=0).load_state_dict(state)


def test_length_grouping_reduces_padding():
    lengths = lengths_for(2000, seed=5)

    def waste(batcher: Batcher) -> float:
        pad = sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batcher.epoch_batches(0))
        return pad / sum(lengths)

    grouped, random = waste(Batcher(lengths, 16, seed=0)), waste(Batcher(lengths, 16, seed=0, group_by_length=False))
    assert random > 0.5  # lognormal lengths: random batches waste most of their compute
    assert grouped < random / 5
    # and the batch order stays shuffled: batch lengths are not sorted over the epoch
    firsts = [max(lengths[i] for i in b) for b in Batcher(lengths, 16, seed=0).epoch_batches(0)]
    assert firsts != sorted(firsts) and firsts != sorted(firsts, reverse=True)
    assert math.isclose(len(firsts), 2000 / 16, abs_tol=1)
