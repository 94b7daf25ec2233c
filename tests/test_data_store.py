"""The token store (`minitrain.data.store`): bit-identical to the in-memory readers in every file
format and row shape, built by one worker or several, reused, rebuilt when damaged, and safe
when two processes build it at once or the disk fills.

The reference is today's path: the readers' own `Examples` lists (themselves checked against
transformers and the JSON lines baseline in tests/test_data*.py).
"""

from __future__ import annotations

import json
import shutil

import pytest

from _tok import corpus, make_llama3_tokenizer, make_t5_tokenizer
from minitrain.data import store_build
from minitrain.data.readers import read_preference, read_seq2seq, read_sft, read_unpaired
from minitrain.data.store_build import open_or_build
from minitrain.errors import UserError
from minitrain.text.tokenizer import Tokenizer
from test_data_formats import FORMATS, PREF_ROWS, SFT_ROWS, TEMPLATES, write_jsonl

READERS = {"sft": read_sft, "seq2seq": read_seq2seq, "preference": read_preference, "unpaired": read_unpaired}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = make_llama3_tokenizer(tmp_path_factory.mktemp("l3"))
    shutil.copy(TEMPLATES / "llama3.jinja", d / "chat_template.jinja")
    return Tokenizer.from_folder(d)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(store_build, "CHUNK", 2)  # a few rows already span several chunks and workers
    monkeypatch.setattr(store_build, "FLUSH", 7)  # and several writes


def build(cache, data, tok, kind="sft", workers=2, **options):
    options.setdefault("max_len", 40)
    sources = data if isinstance(data, list) else [str(data)]
    return open_or_build(cache, sources, kind, READERS[kind], tok, options, workers=workers)


def assert_same(store, ref):
    assert len(store) == len(ref)
    assert list(store) == list(ref)  # every key, every id: the lists the readers make
    assert store[1:3] == list(ref)[1:3] and store[-1] == ref[-1]
    for c in ("truncated", "skipped", "bos_in_text", "shapes"):
        assert getattr(store, c) == getattr(ref, c), c
    assert list(store.lengths) == ref.lengths


MIXED = (SFT_ROWS["prompt_completion"] + SFT_ROWS["messages"] + SFT_ROWS["text"]
         + [{"messages": [{"role": "user", "content": " ".join(corpus(8))}, {"role": "assistant", "content": "No."}]}])


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f not in ("csv", "tsv")])
def test_sft_store_equals_in_memory_in_every_format(tmp_path, tok, fmt):
    """Every format, every SFT shape in one file (truncated and skipped rows too), 2 workers.
    CSV has no null, so its shapes come one file each (next test)."""
    rows = MIXED
    if fmt.startswith(("parquet", "arrow", "datasets")):  # one table: a column per key, null where unused
        keys = list(dict.fromkeys(k for r in rows for k in r))
        rows = [{k: r.get(k) for k in keys} for r in rows]
    path = FORMATS[fmt](tmp_path, rows)
    ref = read_sft(path, tok, max_len=40, truncation_side="right")
    assert ref.truncated and ref.skipped  # the counts are exercised
    assert_same(build(tmp_path / "cache", path, tok, truncation_side="right"), ref)


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
@pytest.mark.parametrize("shape", list(SFT_ROWS))
def test_sft_store_equals_in_memory_csv(tmp_path, tok, fmt, shape):
    path = FORMATS[fmt](tmp_path, SFT_ROWS[shape])
    assert_same(build(tmp_path / "cache", path, tok, workers=3), read_sft(path, tok, max_len=40))


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("shape", list(PREF_ROWS))
def test_preference_store_equals_in_memory(tmp_path, tok, workers, shape):
    rows = PREF_ROWS[shape] * 3
    path = FORMATS["parquet"](tmp_path, rows)
    assert_same(build(tmp_path / "c", path, tok, "preference", workers), read_preference(path, tok, max_len=40))


def test_seq2seq_and_unpaired_stores_equal_in_memory(tmp_path, tok):
    t5 = Tokenizer.from_folder(make_t5_tokenizer(tmp_path / "t5"))
    rows = [{"prompt": "question: " + line, "completion": line} for line in corpus(7)]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    ref = read_seq2seq(path, t5, max_len=12, max_target_len=5)
    assert ref.truncated
    got = build(tmp_path / "c", path, t5, "seq2seq", max_len=12, max_target_len=5)
    assert_same(got, ref)
    assert list(got.batch_lengths) == [len(ex["input_ids"]) for ex in ref]  # what the loop groups by
    rows = [{"prompt": f"Say {w}", "completion": f" {w}!", "label": i % 2 == 0} for i, w in enumerate(corpus(5))]
    path = write_jsonl(tmp_path / "u.jsonl", rows)
    got = build(tmp_path / "c", path, tok, "unpaired")
    assert_same(got, read_unpaired(path, tok, max_len=40))
    assert [type(ex["label"]) for ex in got] == [bool] * 5


def test_bad_row_is_named_by_file_line_whichever_worker_meets_it(tmp_path, tok):
    lines = [json.dumps(r) for r in SFT_ROWS["prompt_completion"]]
    lines.insert(5, '{"prompt": "x", "completion": 3}')  # row 6: chunk 2, worker 0 of 2, worker 2 of 3
    lines.insert(3, "{not json")  # line 4: chunk 1 (worker 1): the first bad row in file order
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError) as ref:
        read_sft(path, tok, max_len=40)
    for workers in (1, 2, 3):
        with pytest.raises(UserError) as e:
            build(tmp_path / "c", path, tok, workers=workers)
        assert str(e.value) == str(ref.value) and str(e.value).startswith(f"{path}:4: ")
    assert not [p for p in (tmp_path / "c").iterdir() if p.is_dir()]  # no store, no temporary folder
