"""The token store (`minitrain.data.store`): bit-identical to the in-memory readers in every file
format and row shape, built by one worker or several, reused, rebuilt when damaged, and safe
when two processes build it at once or the disk fills.

The reference is today's path: the readers' own `Examples` lists (themselves checked against
transformers and the JSON lines baseline in tests/test_data*.py).
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import multiprocessing as mp
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from _tok import corpus, make_bpe_tokenizer, make_llama3_tokenizer, make_t5_tokenizer
from test_data_formats import FORMATS, PREF_ROWS, SFT_ROWS, TEMPLATES, write_jsonl

from minitrain.data import store_build
from minitrain.data.batcher import Batcher
from minitrain.data.readers import (
    Examples,
    hold_out,
    read_preference,
    read_seq2seq,
    read_sft,
    read_unpaired,
)
from minitrain.data.store import StoreView
from minitrain.data.store_build import open_or_build
from minitrain.errors import UserError
from minitrain.objectives.sft import sft
from minitrain.text.tokenizer import Tokenizer
from minitrain.train import train

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


def build(cache, data, tok, kind="sft", workers=2, keep_days=0, verify=False, **options):
    options.setdefault("max_len", 40)
    sources = data if isinstance(data, list) else [str(data)]
    return open_or_build(cache, sources, kind, READERS[kind], tok, options, workers=workers, keep_days=keep_days,
                         verify=verify)


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


# --------------------------------------------------------------------------- downstream: the loop reads the store


def old_epoch_batches(lengths, bs, seed, epoch, shuffle=True, group=True, drop_last=False, mega=50):
    """The Batcher's order as it was written before the store (a list per batch): the new layout of
    two arrays must give the same order, so checkpoints made before it resume alike."""
    lengths = np.asarray(lengths)
    n = len(lengths)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n) if shuffle else np.arange(n)
    if not group:
        batches = [order[i : i + bs] for i in range(0, n, bs)]
    else:
        batches = []
        for s in range(0, n, bs * mega):
            part = order[s : s + bs * mega]
            part = part[np.argsort(-lengths[part], kind="stable")]
            batches += [part[i : i + bs] for i in range(0, len(part), bs)]
    if drop_last and batches and len(batches[-1]) < bs:
        batches.pop()
    if group and shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return [[int(i) for i in b] for b in batches]


@pytest.mark.parametrize("n,bs,group,shuffle,drop_last", [(1000, 4, True, True, False), (997, 3, True, True, True),
                                                          (50, 4, False, True, True), (31, 2, True, False, False)])
def test_batcher_layout_keeps_the_order_it_had(n, bs, group, shuffle, drop_last):
    lengths = np.random.default_rng(n).integers(1, 40, n)  # many ties: the stable sort matters
    b = Batcher(lengths, bs, seed=7, shuffle=shuffle, group_by_length=group, drop_last=drop_last, mega_batch=3)
    for epoch in (0, 1):
        assert b.epoch_batches(epoch) == old_epoch_batches(lengths, bs, 7, epoch, shuffle, group, drop_last, 3)


def test_resumed_run_on_the_store_is_bitwise_the_in_memory_run(tmp_path):
    """A run killed mid-way and resumed, reading the store (2 workers, eval_split views), ends bitwise
    equal to an uninterrupted run on today's in-memory lists: metrics, weights and RNG."""
    from test_resume import Killed, assert_same_weights, killing, steady
    from test_train import TinyLM, cfg_for, collate, freeze_embeddings, quiet, rows

    bpe = Tokenizer.from_folder(make_bpe_tokenizer(tmp_path / "bpe"))  # vocab 128
    lines = corpus(30)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": a, "completion": " " + b} for a, b in itertools.pairwise(lines)])
    ref_train, ref_eval = hold_out(read_sft(data, bpe, max_len=24), 0.2, 0)
    train_s, eval_s = hold_out(build(tmp_path / "cache", data, bpe, max_len=24), 0.2, 0)
    assert isinstance(train_s, StoreView) and list(train_s) == list(ref_train) and list(eval_s) == list(ref_eval)

    def model():
        return freeze_embeddings(TinyLM(vocab=128, dropout=0.2, seed=3))

    kw = {"batch_size": 2, "grad_accum": 2, "epochs": 1.5, "save_every": 3, "eval_every": 2, "lr": 5e-3, "warmup": 2,
          "schedule": "cosine", "group_by_length": True}
    cfg = cfg_for(tmp_path / "lists", **kw)
    straight = model()
    train(straight, sft, ref_train, collate, cfg, eval_examples=ref_eval, log=quiet)
    after = torch.rand(4)
    cfg_b = cfg_for(tmp_path / "store", **kw)
    with pytest.raises(Killed):
        train(model(), killing(sft, 9), train_s, collate, cfg_b, eval_examples=eval_s, log=quiet)
    torch.manual_seed(1234)
    resumed = model()
    train(resumed, sft, train_s, collate, dataclasses.replace(cfg_b, resume=True), eval_examples=eval_s, log=quiet)
    assert steady(rows(Path(cfg_b.out))) == steady(rows(Path(cfg.out)))
    assert_same_weights(resumed, straight)
    assert torch.equal(torch.rand(4), after)


# --------------------------------------------------------------------------- several sources, a mixture


def test_several_files_and_a_glob_with_weights(tmp_path, tok):
    """`a.jsonl,shards/*.parquet`: the store holds the sources in order, as reading each does; weights
    take each source's examples that many times (a seeded fraction), the same in memory and on disk,
    and a change of weights is another store."""
    from minitrain.data.files import data_sources
    from minitrain.data.readers import mixture

    rows = SFT_ROWS["prompt_completion"]
    a = write_jsonl(tmp_path / "a.jsonl", rows[:4])
    (tmp_path / "shards").mkdir()
    for i in range(2):
        FORMATS["parquet"](tmp_path, rows[i::2]).rename(tmp_path / "shards" / f"{i}.parquet")
    sources = data_sources(f"{a},{tmp_path / 'shards' / '*.parquet'}")
    assert sources == [str(a), str(tmp_path / "shards" / "0.parquet"), str(tmp_path / "shards" / "1.parquet")]
    parts = [read_sft(s, tok, max_len=40) for s in sources]
    store = build(tmp_path / "c", sources, tok)
    assert list(store) == [ex for p in parts for ex in p]
    assert store.header["per_source"] == [4, 3, 3]
    weights = [2.0, 0.5, 0.0]
    mixed = mixture(store, store.header["per_source"], weights, seed=3)
    ref = mixture(Examples([ex for p in parts for ex in p]), [4, 3, 3], weights, seed=3)
    assert list(mixed) == list(ref) and len(ref) == 8 + 2 + 0  # round(0.5 * 3) = 2 of the second source
    assert [ex for ex in ref[:8]] == [ex for ex in parts[0] for _ in range(2)]  # each of a.jsonl twice
    other = open_or_build(tmp_path / "c", sources, "sft", read_sft, tok, {"max_len": 40}, workers=1, weights=weights)
    assert other.folder != store.folder  # the weights are in the fingerprint
    with pytest.raises(UserError, match=r"^nothing\*\.parquet: matches no file"):
        data_sources("nothing*.parquet")
    with pytest.raises(UserError, match="2 weights for 3 data sources"):
        mixture(store, [4, 3, 3], [1.0, 1.0], seed=0)


# --------------------------------------------------------------------------- reuse, damage, full disk, two builders


def test_reused_until_something_that_made_it_changes(tmp_path, tok, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS["prompt_completion"])
    first = build(tmp_path / "c", path, tok)
    assert "token store built" in capsys.readouterr().out
    assert build(tmp_path / "c", path, tok).folder == first.folder
    assert "token store built" not in capsys.readouterr().out  # a cache hit builds nothing
    assert build(tmp_path / "c", path, tok, max_len=30).folder != first.folder
    tok.chat_template_kwargs = {"x": 1}
    try:
        assert build(tmp_path / "c", path, tok).folder != first.folder
    finally:
        tok.chat_template_kwargs = {}
    write_jsonl(path, SFT_ROWS["prompt_completion"][:-1])  # the data changes
    assert len(build(tmp_path / "c", path, tok)) == len(SFT_ROWS["prompt_completion"]) - 1


@pytest.mark.parametrize("damage", ["truncate", "header", "missing", "flipped"])
def test_damaged_store_is_detected_and_rebuilt_with_a_note(tmp_path, tok, capsys, damage):
    path = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS["messages"])
    ref = read_sft(path, tok, max_len=40)
    folder = build(tmp_path / "c", path, tok).folder
    ids = folder / "input_ids.ids"
    if damage == "truncate":  # a kill or a copy cut short
        ids.write_bytes(ids.read_bytes()[:-4])
    elif damage == "header":
        header = json.loads((folder / "header.json").read_text())
        header["n"] -= 1
        (folder / "header.json").write_text(json.dumps(header))
    elif damage == "missing":
        (folder / "labels.off").unlink()
    else:  # one byte flipped inside the ids (a bad disk, a bad copy): the size and the header stay right
        flip_byte(ids, 5)
    capsys.readouterr()
    store = build(tmp_path / "c", path, tok)
    out = capsys.readouterr().out
    assert f"note: data_cache: {folder}: damaged" in out and "rebuilding" in out, out
    assert store.folder == folder and list(store) == list(ref)


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_store_past_the_size_checked_at_open_is_checked_on_resume(tmp_path, tok, capsys, monkeypatch):
    """Above `VERIFY_BYTES` a plain open skips the arrays' checksums (and says so); `verify=True`
    (what `resume=true` passes) reads them, finds the flipped byte and rebuilds."""
    monkeypatch.setattr(store_build, "VERIFY_BYTES", 0)
    path = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS["messages"])
    ref = list(read_sft(path, tok, max_len=40))
    folder = build(tmp_path / "c", path, tok).folder
    flip_byte(folder / "labels.ids", 9)
    capsys.readouterr()
    assert list(build(tmp_path / "c", path, tok)) != ref  # unchecked: the damage reads through
    assert "are not checked at start (resume=true checks them" in capsys.readouterr().out
    assert list(build(tmp_path / "c", path, tok, verify=True)) == ref
    out = capsys.readouterr().out
    assert f"{folder}: damaged (labels.ids: its bytes do not match the checksum written at build)" in out, out


def test_resume_passes_verify_to_the_store(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from minitrain import run

    seen = []
    monkeypatch.setattr(run, "open_or_build", lambda *a, **kw: seen.append(kw["verify"]) or SimpleNamespace(
        header={"per_source": [1]}))
    for resume in (False, True):
        cfg = SimpleNamespace(data_cache=str(tmp_path), resume=resume)
        run.read_data(cfg, str(tmp_path / "d.jsonl"), "sft", None, {})
    assert seen == [False, True]


@pytest.mark.parametrize("workers", [1, 2])
def test_full_disk_leaves_nothing_and_says_so_in_one_line(tmp_path, tok, monkeypatch, workers):
    path = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS["messages"] + SFT_ROWS["text"])
    real = store_build.PartWriter.flush

    def flush(self):  # the disk fills after the first write
        if any(f.tell() for f in self._files.values()):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self)

    monkeypatch.setattr(store_build.PartWriter, "flush", flush)
    with pytest.raises(UserError) as e:
        build(tmp_path / "c", path, tok, workers=workers)
    msg = str(e.value)
    assert "\n" not in msg and "disk full" in msg and "nothing kept" in msg and " — " in msg, msg
    assert not [p for p in (tmp_path / "c").iterdir() if p.is_dir()]


def _build_in_child(cache, path, tok_dir, barrier, marks, results):
    def slow_read(*args, **kw):  # a build long enough for the other process to arrive meanwhile
        with open(marks, "a") as f:
            f.write("built\n")
        import time

        time.sleep(1.0)
        return read_sft(*args, **kw)

    tok = Tokenizer.from_folder(tok_dir)
    barrier.wait()
    store = open_or_build(cache, [str(path)], "sft", slow_read, tok, {"max_len": 40}, workers=1)
    results.put((str(store.folder), list(store)))


def test_two_processes_building_the_same_store_at_once(tmp_path, tok):
    """Both get the same store; one built it while the other waited; nothing half-made is left."""
    path = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS["prompt_completion"])
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    marks = tmp_path / "marks"
    procs = [ctx.Process(target=_build_in_child, args=(tmp_path / "c", path, tok.source, barrier, marks, results))
             for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert marks.read_text() == "built\n"  # one build
    assert got[0] == got[1] and got[0][1] == list(read_sft(path, tok, max_len=40))
    assert [p.name for p in (tmp_path / "c").iterdir() if p.is_dir()] == [Path(got[0][0]).name]


def test_progress_line_counts_rows_once_with_rate_and_eta(tmp_path, tok, capsys, monkeypatch):
    monkeypatch.setattr(store_build, "PROGRESS_EVERY", 0.0)  # a line at every report
    rows = SFT_ROWS["prompt_completion"] * 3  # 18 rows, 9 chunks of 2 over 2 workers
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    build(tmp_path / "c", path, tok, workers=2)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "building the token store" in ln]
    assert lines and "rows/s" in lines[-1] and "ETA" in lines[-1], lines
    assert lines[-1].split(": ")[-1].startswith("18 rows ("), lines[-1]  # every row once, whichever worker


def test_load_examples_same_with_and_without_the_store(tmp_path, tok):
    """The run's data step: two sources, weights and eval_split give the same train and eval examples
    from the store as in memory; eval_split is taken before the weights, so no example is on both sides."""
    from minitrain.config import TrainConfig
    from minitrain.run import load_examples

    rows = [{"prompt": f"Question {i}: {w}?", "completion": f" {w} {i}."} for i, w in enumerate(corpus(20))]
    a, b = write_jsonl(tmp_path / "a.jsonl", rows[:12]), write_jsonl(tmp_path / "b.jsonl", rows[12:])
    got = {}
    for cache in (str(tmp_path / "c"), "false"):
        cfg = TrainConfig(data=f"{a},{b}", data_weights=[2.0, 0.5], eval_split=0.2, seed=3, max_len=64,
                          data_cache=cache, data_workers=2, batch_size=2)
        got[cache] = load_examples(cfg, tok)
    (train_s, eval_s), (train_m, eval_m) = got.values()
    assert isinstance(train_s, StoreView) and not isinstance(train_m, StoreView)
    assert list(train_s) == list(train_m) and list(eval_s) == list(eval_m) and len(eval_m) == 4
    assert train_s.shapes == train_m.shapes == {"chat": 0, "pair": 20, "pair_chat": 0, "text": 0}  # the run's log
    held = {tuple(ex["input_ids"]) for ex in eval_m}
    assert not held & {tuple(ex["input_ids"]) for ex in train_m}
    kept_a = 12 - sum(tuple(ex["input_ids"]) in held for ex in read_sft(a, tok, max_len=64))
    kept_b = 8 - (4 - (12 - kept_a))
    assert len(train_m) == 2 * kept_a + round(0.5 * kept_b)  # a.jsonl's examples twice, a seeded half of b's


def _killed_build(cache, path, tok_dir):
    def stuck(*args, **kw):  # writes part of the store, then hangs until killed
        read_sft(*args, **kw)
        import time

        time.sleep(60)

    open_or_build(cache, [str(path)], "sft", stuck, Tokenizer.from_folder(tok_dir), {"max_len": 40}, workers=1)


def test_a_build_killed_midway_leaves_no_store_and_the_next_run_builds_it(tmp_path, tok):
    import os
    import signal
    import time

    path = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS["prompt_completion"])
    p = mp.get_context("fork").Process(target=_killed_build, args=(tmp_path / "c", path, tok.source))
    p.start()
    while not list((tmp_path / "c").glob(".tmp-*/part-0/*.ids")) and p.is_alive():
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert [d.name.startswith(".tmp-") for d in (tmp_path / "c").iterdir() if d.is_dir()] == [True]  # only the temporary
    store = build(tmp_path / "c", path, tok, workers=1)
    assert list(store) == list(read_sft(path, tok, max_len=40))
    assert [d for d in (tmp_path / "c").iterdir() if d.is_dir()] == [store.folder]  # the killed build's folder is gone


def test_values_set_beside_the_store_read_as_the_in_memory_write(tmp_path, tok):
    """DPO's precomputed reference log-probs: `set_values` on a store view gives each example the float the
    in-memory path writes into its dict (fp32 tensor -> Python float), and nothing to the other view."""
    path = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS["prompt_completion"])
    train, evals = hold_out(build(tmp_path / "c", path, tok), 0.34, 0)
    ref_train, _ = hold_out(read_sft(path, tok, max_len=40), 0.34, 0)
    logps = -torch.rand(len(train), dtype=torch.float32) * 50
    train.set_values({"ref_chosen_logp": logps.double().numpy()})
    for ex, v in zip(ref_train, logps.tolist()):
        ex["ref_chosen_logp"] = v
    assert list(train) == list(ref_train) and train[1:3] == ref_train[1:3]
    assert "ref_chosen_logp" not in evals[0]


def test_default_cache_that_cannot_be_made_falls_back_to_memory_with_a_note(tmp_path, tok, monkeypatch, capsys):
    from minitrain.config import TrainConfig
    from minitrain.run import load_examples

    (tmp_path / "file").write_text("")  # XDG_CACHE_HOME under a file: no folder can be made there
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "cache"))
    path = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS["prompt_completion"])
    train, _ = load_examples(TrainConfig(data=str(path), max_len=40), tok)
    assert not isinstance(train, StoreView) and list(train) == list(read_sft(path, tok, max_len=40))
    assert "note: data_cache=auto: cannot create" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"^data_cache=.*: cannot write there .* — pass data_cache="):
        load_examples(TrainConfig(data=str(path), max_len=40, data_cache=str(tmp_path / "file" / "c")), tok)


# --------------------------------------------------------------------------- KTO: KL rows read from the store


def _kl_rows_as_before(examples, block):
    """The reference: each example's KL row written into a copy of its dict, TRL's rotation (row i: its
    prompt + the completion of row i - 1 in its block of `block` rows, the block's first takes its last)."""
    out = [dict(ex) for ex in examples]
    for start in range(0, len(out), block):
        rows = out[start:start + block]
        for i, ex in enumerate(rows):
            other = rows[i - 1]
            p, q = ex["prompt_len"], other["prompt_len"]
            ex["kl_ids"] = ex["input_ids"][:p] + other["input_ids"][q:]
            ex["kl_labels"] = [-100] * p + other["labels"][q:]
    return out


def test_kto_kl_rows_from_the_store_equal_in_memory(tmp_path, tok):
    """KTO reads the store through `add_kl_rows` (each KL row made when its example is read): train and
    eval examples, KL rows (a short last block and a block of one included), labels and collated
    batches equal today's in-memory lists; nothing is copied out of the store."""
    from functools import partial

    from minitrain.config import TrainConfig
    from minitrain.objectives.kto import add_kl_rows, collate_kto
    from minitrain.run import load_examples

    rows = [{"prompt": f"Question {i}: {w}?", "completion": f" {w} {i}.", "label": i % 3 != 0}
            for i, w in enumerate(corpus(12))]
    path = write_jsonl(tmp_path / "u.jsonl", rows)
    got = {}
    for cache in (str(tmp_path / "c"), "false"):
        cfg = TrainConfig(data=str(path), eval_split=0.25, seed=3, max_len=64, data_cache=cache, data_workers=2,
                          batch_size=2)
        got[cache] = [add_kl_rows(ex, 4) for ex in load_examples(cfg, tok, "unpaired")]
    (train_s, eval_s), (train_m, eval_m) = got.values()
    assert isinstance(train_s.examples, StoreView) and isinstance(train_m.examples, Examples)
    assert len(train_s) == 9 and len(eval_s) == 3  # blocks of 4, 4, 1 and one of 3
    for store, memory in ((train_s, train_m), (eval_s, eval_m)):
        expected = _kl_rows_as_before(list(memory.examples), 4)
        assert list(store) == expected == list(memory)
        assert store[1:6] == expected[1:6] and store[-1] == expected[-1]
        assert list(store.column("label")) == [ex["label"] for ex in expected]
        assert list(store.batch_lengths) == [len(ex["input_ids"]) for ex in expected]
        a, b = partial(collate_kto, pad_id=0)(store[:4]), partial(collate_kto, pad_id=0)(expected[:4])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    assert train_s[8]["kl_ids"] == train_s[8]["input_ids"]  # a block of one pairs the row with itself
    assert train_s.path == train_m.path and train_s.truncated == train_m.truncated


def test_kto_resumed_run_on_the_store_is_bitwise_the_in_memory_run(tmp_path):
    """KTO (precomputed reference log-probs held beside the store) killed mid-way and resumed on the store
    ends bitwise equal to an uninterrupted run on the in-memory lists: metrics, eval rows, weights and RNG."""
    from functools import partial

    from test_resume import Killed, assert_same_weights, steady
    from test_train import TinyLM, cfg_for, freeze_embeddings, quiet, rows

    from minitrain.objectives.kto import KTOObjective, add_kl_rows, collate_kto

    class Dying(KTOObjective):
        calls = 0

        def __call__(self, model, batch):
            self.calls += model.training  # eval calls do not count
            if self.calls > 7:
                raise Killed
            return super().__call__(model, batch)

    bpe = Tokenizer.from_folder(make_bpe_tokenizer(tmp_path / "bpe"))  # vocab 128
    lines = corpus(26)
    data = write_jsonl(tmp_path / "u.jsonl", [{"prompt": a, "completion": " " + b, "label": len(b) % 2 == 0}
                                              for a, b in itertools.pairwise(lines)])
    bs = 3
    ref = [add_kl_rows(x, bs) for x in hold_out(read_unpaired(data, bpe, max_len=24), 0.2, 0)]
    ours = [add_kl_rows(x, bs) for x in hold_out(build(tmp_path / "cache", data, bpe, "unpaired", max_len=24), 0.2, 0)]
    assert isinstance(ours[0].examples, StoreView) and list(ours[0]) == list(ref[0])
    g = torch.Generator().manual_seed(5)
    for r, o in zip(ref, ours):  # the reference's log-probs, as `precompute_kto_reference` sets them
        values = {"ref_logp": (-40 * torch.rand(len(r), generator=g)).double().numpy(),
                  "ref_kl_logp": (-40 * torch.rand(len(r), generator=g)).double().numpy()}
        r.set_values(values)
        o.set_values(values)

    def model():
        return freeze_embeddings(TinyLM(vocab=128, dropout=0.2, seed=3))

    collate = partial(collate_kto, pad_id=0)
    kw = {"batch_size": bs, "grad_accum": 2, "epochs": 1.5, "save_every": 2, "eval_every": 2, "lr": 5e-3,
          "warmup": 1, "schedule": "cosine", "group_by_length": True}
    cfg = cfg_for(tmp_path / "lists", **kw)
    straight = model()
    train(straight, KTOObjective(0.1), ref[0], collate, cfg, eval_examples=ref[1], log=quiet)
    after = torch.rand(4)
    cfg_b = cfg_for(tmp_path / "store", **kw)
    with pytest.raises(Killed):
        train(model(), Dying(0.1), ours[0], collate, cfg_b, eval_examples=ours[1], log=quiet)
    torch.manual_seed(1234)
    resumed = model()
    train(resumed, KTOObjective(0.1), ours[0], collate, dataclasses.replace(cfg_b, resume=True),
          eval_examples=ours[1], log=quiet)
    got, want = rows(Path(cfg_b.out)), rows(Path(cfg.out))
    assert len(want) >= 5 and any("eval/loss" in r for r in want) and any("kl" in r for r in want)
    assert steady(got) == steady(want)
    assert_same_weights(resumed, straight)
    assert torch.equal(torch.rand(4), after)


# --------------------------------------------------------------------------- old stores removed (store_cache)


def _age(store_folder, days):
    t = __import__("time").time() - days * 86400
    __import__("os").utime(store_folder / "last_used", (t, t))


def test_opening_records_use_and_a_build_removes_stores_unused_for_days(tmp_path, tok, capsys):
    """Each open touches the store's `last_used`; a build removes the folder's stores no run opened for
    `keep_days` days (and killed builds' temporary folders as old), never a store being built, never
    the one just built; a store used since is kept."""
    import fcntl
    import os
    import time

    rows = SFT_ROWS["prompt_completion"]
    paths = [write_jsonl(tmp_path / f"{n}.jsonl", rows[:k]) for n, k in (("old", 2), ("busy", 3), ("recent", 4))]
    cache = tmp_path / "c"
    old, busy, recent = (build(cache, p, tok) for p in paths)
    for s, days in ((old, 40), (busy, 40), (recent, 10)):
        _age(s.folder, days)
    killed = cache / f".tmp-{old.folder.name}-99999"
    killed.mkdir()
    os.utime(killed, (time.time() - 40 * 86400,) * 2)
    build(cache, paths[0], tok, keep_days=30)  # a cache hit: no build, so nothing removed, but used now
    assert time.time() - (old.folder / "last_used").stat().st_mtime < 60
    _age(old.folder, 40)
    with open(cache / f".{busy.folder.name}.lock", "a+") as lock:  # another process building it now
        fcntl.flock(lock, fcntl.LOCK_EX)
        new = build(cache, write_jsonl(tmp_path / "new.jsonl", rows), tok, keep_days=30)
    left = sorted(d.name for d in cache.iterdir() if d.is_dir())
    assert left == sorted([busy.folder.name, recent.folder.name, new.folder.name])
    assert f".{old.folder.name}.lock" in os.listdir(cache)  # lock files stay (empty)
    assert "data_cache: removed 1 token store unused for 30 days" in capsys.readouterr().out
    assert list(busy) == list(read_sft(paths[1], tok, max_len=40))  # what stays reads as before
    assert list(build(cache, paths[0], tok)) == list(read_sft(paths[0], tok, max_len=40))  # rebuilt when asked again


def test_minitrain_cache_lists_and_clears(tmp_path, tok, capsys):
    from minitrain.cli import run_cli

    rows = SFT_ROWS["prompt_completion"]
    cache = tmp_path / "c"
    a = build(cache, write_jsonl(tmp_path / "a.jsonl", rows[:2]), tok)
    b = build(cache, write_jsonl(tmp_path / "b.jsonl", rows), tok, "sft")
    _age(a.folder, 40)
    capsys.readouterr()
    assert run_cli(["cache", "--dir", str(cache)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"2 token stores in {cache}")
    assert a.folder.name in out[1] and "2 examples (sft)" in out[1] and "(40 days ago)" in out[1]  # oldest first
    assert b.folder.name in out[2] and f"{len(b)} examples" in out[2] and str(tmp_path / "b.jsonl") in out[2]
    assert run_cli(["cache", "verify", "--dir", str(cache)]) == 0
    assert capsys.readouterr().out.endswith(f"2 of 2 token stores in {cache} read back as built\n")
    flip_byte(b.folder / "input_ids.ids", 3)
    assert run_cli(["cache", "verify", "--dir", str(cache)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"DAMAGED  {b.folder.name}: input_ids.ids: its bytes do not match" in "\n".join(out), out
    assert out[-1] == f"1 of 2 token stores in {cache} read back as built; 1 damaged: the next run that uses one rebuilds it"
    assert run_cli(["cache", "clear", "--days", "30", "--dir", str(cache)]) == 0
    assert "removed 1 token store" in capsys.readouterr().out
    assert not a.folder.exists() and b.folder.exists()
    assert run_cli(["cache", "clear", "--dir", str(cache)]) == 0
    assert "removed 1 token store" in capsys.readouterr().out and not b.folder.exists()
    assert run_cli(["cache", "--dir", str(cache)]) == 0
    assert capsys.readouterr().out.startswith("no token stores in")
    for bad in (["cache", "rm"], ["cache", "clear", "--days", "-1"], ["cache", "--days", "3"], ["cache", "--dir"]):
        assert run_cli(bad) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cache ") and len(err.strip().splitlines()) == 1, err


def test_whole_data_passes_read_the_arrays_as_the_lists_say(tmp_path, tok, monkeypatch):
    """ARD's target-token count and distillation's largest-id check read a store's arrays in blocks of
    examples (no example built): the same figures, and the same error naming the same example, as the
    in-memory lists, on the store and on eval_split views of it."""
    from minitrain.data import store as store_module
    from minitrain.objectives.ard import dataset_target_tokens
    from minitrain.objectives.distill import check_ids_shared

    monkeypatch.setattr(store_module, "BLOCK", 3)  # several blocks, one cut short
    path = write_jsonl(tmp_path / "m.jsonl", MIXED)
    store, ref = build(tmp_path / "c", path, tok), read_sft(path, tok, max_len=40)
    views, lists = hold_out(store, 0.3, 0), hold_out(ref, 0.3, 0)
    for got, want in ((store, ref), *zip(views, lists)):
        assert list(got.list_max("input_ids")) == [max(ex["input_ids"]) for ex in want]
        assert list(got.target_counts()) == [dataset_target_tokens([ex]) for ex in want]
        assert dataset_target_tokens(got) == dataset_target_tokens(list(want)) > 0
    top = check_ids_shared([ref], 10**6, "t")
    assert check_ids_shared([*views], 10**6, "t") == check_ids_shared([*lists], 10**6, "t") == top
    for shared in (top, int(np.median([max(ex["input_ids"]) for ex in ref]))):
        errors = []
        for parts in (views, lists):
            with pytest.raises(UserError) as e:
                check_ids_shared([*parts], shared, "t")
            errors.append(str(e.value))
        assert errors[0] == errors[1] and "example" in errors[0]
