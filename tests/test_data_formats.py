"""Data in the files and row shapes people have: each reads into exactly the ids and masks of
the JSON lines baseline.

References: the JSONL reader (the baseline every other format must equal, ids and labels);
files written by pyarrow and by HF `datasets` (`save_to_disk`); Alpaca's conversion rule as
LLaMA-Factory documents it (user = instruction + "\\n" + input, or the instruction alone);
TRL's implicit-prompt preference format (the shared leading messages are the prompt).
"""

from __future__ import annotations

import csv
import json
import shutil
import warnings
from pathlib import Path

import pytest

from _tok import make_llama3_tokenizer
from minitrain.data.readers import hold_out, read_preference, read_sft
from minitrain.errors import UserError
from minitrain.text.tokenizer import Tokenizer

pa = pytest.importorskip("pyarrow")
import pyarrow.ipc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

SFT_ROWS = {
    "prompt_completion": [{"prompt": f"Question {i}: what is {i}+{i}?", "completion": f" It is {2 * i}."}
                          for i in range(6)],
    "messages": [{"messages": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": f"Count to {i}, please"},
                               {"role": "assistant", "content": " ".join(str(k) for k in range(i + 1))}]}
                 for i in range(5)],
    "text": [{"text": f"Line {i}, with a comma, and\na newline \"quoted\"."} for i in range(4)],
}
PREF_ROWS = {
    "strings": [{"prompt": f"Say {w}", "chosen": f" {w}!", "rejected": " no"} for w in ("hot", "cold", "word")],
    "chat": [{"prompt": [{"role": "user", "content": f"Say {w}"}],
              "chosen": [{"role": "assistant", "content": f"{w}!"}],
              "rejected": [{"role": "assistant", "content": "no"}]} for w in ("hot", "cold", "word")],
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = make_llama3_tokenizer(tmp_path_factory.mktemp("l3"))
    shutil.copy(TEMPLATES / "llama3.jinja", d / "chat_template.jinja")
    return Tokenizer.from_folder(d)


# --------------------------------------------------------------------------- writers


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def write_json(path: Path, rows):
    path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return path


def write_csv(path: Path, rows: list[dict], delimiter: str = ",") -> Path:
    keys = list(rows[0])
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(keys)
        for r in rows:
            w.writerow([json.dumps(r[k]) if isinstance(r[k], (list, dict)) else r[k] for k in keys])
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)  # several row groups
    return path


def write_arrow(path: Path, rows: list[dict], stream: bool = False) -> Path:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink:
        opener = pa.ipc.new_stream if stream else pa.ipc.new_file
        with opener(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=2):
                w.write_batch(batch)
    return path


def write_datasets(path: Path, rows: list[dict], splits: bool = False) -> Path:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(rows)
    if splits:
        ds = datasets.DatasetDict({"train": ds, "validation": datasets.Dataset.from_list(rows[:2])})
    ds.save_to_disk(str(path))
    return path


FORMATS = {
    "json_array": lambda d, rows: write_json(d / "data.json", rows),
    "json_object": lambda d, rows: write_json(d / "data.json", {"version": 1, "data": rows}),
    "csv": lambda d, rows: write_csv(d / "data.csv", rows),
    "tsv": lambda d, rows: write_csv(d / "data.tsv", rows, "\t"),
    "parquet": lambda d, rows: write_parquet(d / "data.parquet", rows),
    "parquet_named_jsonl": lambda d, rows: write_parquet(d / "data.jsonl", rows),  # read by content
    "arrow": lambda d, rows: write_arrow(d / "data.arrow", rows),
    "arrow_stream": lambda d, rows: write_arrow(d / "data.arrow", rows, stream=True),
    "datasets": lambda d, rows: write_datasets(d / "ds", rows),
    "datasets_splits": lambda d, rows: write_datasets(d / "dsd", rows, splits=True),
    "folder_of_files": lambda d, rows: (write_jsonl((d / "parts").mkdir() or d / "parts" / "a.jsonl", rows[:2]),
                                        write_jsonl(d / "parts" / "b.jsonl", rows[2:]), d / "parts")[-1],
}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", list(SFT_ROWS))
def test_sft_formats_equal_jsonl(tmp_path, tok, fmt, shape):
    rows = SFT_ROWS[shape]
    base = read_sft(write_jsonl(tmp_path / "base.jsonl", rows), tok, max_len=128)
    got = read_sft(FORMATS[fmt](tmp_path, rows), tok, max_len=128)
    assert list(got) == list(base) and len(base) == len(rows)


@pytest.mark.parametrize("fmt", ["json_array", "csv", "parquet", "arrow_stream", "datasets_splits"])
@pytest.mark.parametrize("shape", list(PREF_ROWS))
def test_preference_formats_equal_jsonl(tmp_path, tok, fmt, shape):
    rows = PREF_ROWS[shape]
    base = read_preference(write_jsonl(tmp_path / "base.jsonl", rows), tok, max_len=128)
    got = read_preference(FORMATS[fmt](tmp_path, rows), tok, max_len=128)
    assert list(got) == list(base) and len(base) == len(rows)


def test_mixed_shapes_in_parquet_read_nulls_as_absent(tmp_path, tok):
    """Rows of several shapes in one table: the columns a row does not use hold null."""
    rows = SFT_ROWS["prompt_completion"][:2] + SFT_ROWS["messages"][:2] + SFT_ROWS["text"][:2]
    base = read_sft(write_jsonl(tmp_path / "base.jsonl", rows), tok, max_len=128)
    keys = {k for r in rows for k in r}
    table = [{k: r.get(k) for k in sorted(keys)} for r in rows]  # one schema: unused columns null
    assert list(read_sft(write_parquet(tmp_path / "mixed.parquet", table), tok, max_len=128)) == list(base)


def test_datasets_folder_reads_train_split_and_named_split(tmp_path, tok):
    rows = SFT_ROWS["prompt_completion"]
    folder = write_datasets(tmp_path / "dsd", rows, splits=True)
    assert len(read_sft(folder, tok, max_len=128)) == len(rows)  # train
    assert list(read_sft(folder / "validation", tok, max_len=128)) == list(read_sft(
        write_jsonl(tmp_path / "v.jsonl", rows[:2]), tok, max_len=128))
    with pytest.raises(UserError, match=r"no split 'test' \(splits: train, validation\)"):
        read_sft(folder, tok, max_len=128, split="test")


# --------------------------------------------------------------------------- row shapes


def test_sharegpt_equals_messages(tmp_path, tok):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    share = [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in r["messages"]]}
             for r in SFT_ROWS["messages"]]
    base = read_sft(write_jsonl(tmp_path / "m.jsonl", SFT_ROWS["messages"]), tok, max_len=128)
    assert list(read_sft(write_jsonl(tmp_path / "s.jsonl", share), tok, max_len=128)) == list(base)
    assert list(read_sft(write_parquet(tmp_path / "s.parquet", share), tok, max_len=128)) == list(base)


def test_alpaca_follows_llama_factory(tmp_path, tok):
    alpaca = [{"instruction": "Translate to French.", "input": "cat", "output": "chat"},
              {"instruction": "Name a colour.", "input": "", "output": "Blue"},
              {"instruction": "And now?", "output": "Red", "system": "Be brief.",
               "history": [["Hi", "Hello"]]}]
    chats = [[{"role": "user", "content": "Translate to French.\ncat"}, {"role": "assistant", "content": "chat"}],
             [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "And now?"},
              {"role": "assistant", "content": "Red"}]]
    base = read_sft(write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in chats]), tok, max_len=256)
    assert list(read_sft(write_jsonl(tmp_path / "a.jsonl", alpaca), tok, max_len=256)) == list(base)


def test_trl_implicit_prompt_and_sharegpt_preferences_equal_explicit(tmp_path, tok):
    rows = PREF_ROWS["chat"]
    base = read_preference(write_jsonl(tmp_path / "e.jsonl", rows), tok, max_len=128)
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]
    assert list(read_preference(write_jsonl(tmp_path / "i.jsonl", implicit), tok, max_len=128)) == list(base)
    share = [{"conversations": [{"from": "human", "value": r["prompt"][0]["content"]}],
              "chosen": {"from": "gpt", "value": r["chosen"][0]["content"]},
              "rejected": {"from": "gpt", "value": r["rejected"][0]["content"]}} for r in rows]
    assert list(read_preference(write_jsonl(tmp_path / "s.jsonl", share), tok, max_len=128)) == list(base)


def test_fields_map_user_columns_for_every_shape(tmp_path, tok):
    rows = SFT_ROWS["prompt_completion"]
    base = read_sft(write_jsonl(tmp_path / "b.jsonl", rows), tok, max_len=128)
    renamed = [{"question": r["prompt"], "answer": r["completion"]} for r in rows]
    assert list(read_sft(write_parquet(tmp_path / "r.parquet", renamed), tok, max_len=128,
                         fields={"prompt": "question", "completion": "answer"})) == list(base)
    chats = [{"dialog": [{"speaker": m["role"], "text": m["content"]} for m in r["messages"]]}
             for r in SFT_ROWS["messages"]]
    base = read_sft(write_jsonl(tmp_path / "m.jsonl", SFT_ROWS["messages"]), tok, max_len=128)
    assert list(read_sft(write_jsonl(tmp_path / "c.jsonl", chats), tok, max_len=128,
                         fields={"messages": "dialog", "role": "speaker", "content": "text"})) == list(base)
    prefs = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in PREF_ROWS["strings"]]
    base = read_preference(write_jsonl(tmp_path / "p.jsonl", PREF_ROWS["strings"]), tok, max_len=128)
    assert list(read_preference(write_csv(tmp_path / "p.csv", prefs), tok, max_len=128,
                                fields={"prompt": "q", "chosen": "good", "rejected": "bad"})) == list(base)
    with pytest.raises(UserError, match="fields: unknown name 'answer'"):
        read_sft(tmp_path / "b.jsonl", tok, max_len=128, fields={"answer": "x"})


# --------------------------------------------------------------------------- errors name the place


@pytest.mark.parametrize("fmt, where", [("parquet", ":row 4"), ("csv", ":5"), ("json_array", ":row 4"),
                                        ("arrow", ":row 4"), ("json_object", ":data[3]")])
def test_errors_name_the_row_in_every_format(tmp_path, tok, fmt, where):
    rows = [dict(r) for r in SFT_ROWS["prompt_completion"]]
    rows[3]["completion"] = ""
    path = FORMATS[fmt](tmp_path, rows)
    with pytest.raises(UserError) as e:
        read_sft(path, tok, max_len=128)
    assert e.value.message.startswith(f"{path}{where}: \"completion\" is empty"), e.value.message


def test_folder_without_data_and_binary_files_say_what_was_found(tmp_path, tok):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="is a folder with no data files"):
        read_sft(tmp_path / "empty", tok, max_len=64)
    junk = tmp_path / "model.bin"
    junk.write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(UserError, match="binary, not Parquet or Arrow"):
        read_sft(junk, tok, max_len=64)


def test_without_pyarrow_one_line_names_the_extra(tmp_path, tok, monkeypatch):
    import builtins

    path = write_parquet(tmp_path / "d.parquet", SFT_ROWS["text"])
    real = builtins.__import__

    def no_pyarrow(name, *a, **k):
        if name == "pyarrow" or name.startswith("pyarrow."):
            raise ImportError("no pyarrow")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(UserError, match=r"needs pyarrow — pip install 'minitrain\[data\]'"):
        read_sft(path, tok, max_len=64)


# --------------------------------------------------------------------------- eval_split


def test_hold_out_is_seeded_disjoint_and_stable(tmp_path, tok):
    rows = [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(40)]
    ex = read_sft(write_jsonl(tmp_path / "d.jsonl", rows), tok, max_len=64)
    train, evals = hold_out(ex, 0.1, seed=3)
    again_train, again_evals = hold_out(read_sft(tmp_path / "d.jsonl", tok, max_len=64), 0.1, seed=3)
    assert len(evals) == 4 and len(train) == 36
    assert list(evals) == list(again_evals) and list(train) == list(again_train)  # the same on a resume
    key = lambda e: tuple(e["input_ids"])  # noqa: E731
    assert not {key(e) for e in evals} & {key(e) for e in train}
    assert sorted(map(key, list(train) + list(evals))) == sorted(map(key, ex))
    assert [key(e) for e in hold_out(ex, 0.1, seed=4)[1]] != [key(e) for e in evals]
    with pytest.raises(UserError, match="leave none to train on"):
        hold_out(type(ex)(ex[:1]), 0.5, seed=0)


# --------------------------------------------------------------------------- bos / eos


def test_text_that_begins_with_bos_gets_no_second_bos(tmp_path, tok):
    """Rows copied from a rendered chat already start with <|begin_of_text|>: adding the
    tokenizer's bos again (TRL's double-BOS with Llama-3) is avoided, and counted."""
    plain = [{"text": "Hello there."}, {"prompt": "Hi", "completion": " yes"}]
    doubled = [{"text": "<|begin_of_text|>Hello there."}, {"prompt": "<|begin_of_text|>Hi", "completion": " yes"}]
    base = read_sft(write_jsonl(tmp_path / "p.jsonl", plain), tok, max_len=64)
    got = read_sft(write_jsonl(tmp_path / "d.jsonl", doubled), tok, max_len=64)
    assert list(got) == list(base) and got.bos_in_text == 2 and base.bos_in_text == 0
    assert all(ex["input_ids"].count(tok.bos_id) == 1 for ex in got)


def test_eos_stays_a_target_when_pad_is_eos(tmp_path, tok):
    """pad == eos (this tokenizer has no pad): padding is masked by length, never by id, so the
    final eos keeps its label (TRL issue: EOS never learned when pad == eos)."""
    from minitrain.data.collate import collate_causal

    ex = read_sft(write_jsonl(tmp_path / "d.jsonl", SFT_ROWS["prompt_completion"][:2] + SFT_ROWS["messages"][:1]),
                  tok, max_len=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no pad token; padding with eos", once per tokenizer
        pad = tok.pad_id
    assert pad == tok.eos_id
    batch = collate_causal(list(ex), pad)
    for row, e in zip(batch["labels"].tolist(), ex):
        n = len(e["input_ids"])
        assert row[n - 1] == e["input_ids"][-1] and e["input_ids"][-1] in (tok.eos_id, tok.token_to_id("<|eot_id|>"))
        assert all(x == -100 for x in row[n:])
