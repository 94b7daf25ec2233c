"""The token store against today's in-memory examples and HF `datasets`: build time, cache hit, RSS.

    python tools/bench_data.py [--rows 1000000] [--memory-rows 200000] [--shape pc|chat]
                               [--workers 1,2] [--no-datasets] [--no-memory] [--keep DIR] [--recipe]

Writes everything it measures into a temporary folder (or `--keep DIR`): a byte-level BPE tokenizer
(`tokenizers`, 4000 ids, Llama-3-style specials) with a Llama-3-style Jinja chat template, and
`--rows` JSON lines rows of generated words: prompt / completion (~55 tokens a row, `--shape pc`, the
issue's measurement) or chats of a system, user and assistant message rendered through the
template (`--shape chat`). Each figure comes from a fresh `python` subprocess:

- build, per `--workers` count: `open_or_build` into an empty cache (what the first start pays);
- cache hit: `open_or_build` again (fingerprint + open) and the first collated batch (what the
  second start pays on data), then one epoch of batches through the Batcher and `collate_causal`
  (every page read): peak RSS (VmHWM) and RSS growth beyond the mapped store pages (RssAnon), per token;
- in memory (`data_cache=false`, on the first `--memory-rows` rows): `read_sft` into lists, peak RSS per token;
- HF `datasets` (bench extra): `load_dataset("json")` + `.map(num_proc=2)` whose function is
  minitrain's own reader on one row, so ids and labels are the same work; its own cache folder.

`--no-memory` skips the `data_cache=false` figures (today's lists would need ~29 GB at 10M rows).
`--recipe` times only the whole run to its first step (first start with `data_workers=` the last
`--workers` count, second start, and `data_cache=false` unless `--no-memory`).

Prints a Markdown table. Not a test: at 1M rows it takes several minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TEMPLATE = ("{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
            "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
            "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def words(n: int = 3000) -> list[str]:
    rng = random.Random(1234)
    cons, vows, out, seen = "bcdfghjklmnprstvwz", "aeiou", [], set()
    while len(out) < n:
        w = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 4)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def sentence(rng: random.Random, vocab: list[str], lo: int, hi: int) -> str:
    return " ".join(vocab[min(int(rng.paretovariate(1.1)) - 1, len(vocab) - 1)] for _ in range(rng.randint(lo, hi)))


def make_tokenizer(folder: Path, vocab: list[str]) -> None:
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    trainer = trainers.BpeTrainer(vocab_size=4000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((sentence(rng, vocab, 5, 40) for _ in range(20000)), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    bos = SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": "<|eot_id|>", "tokenizer_class": "PreTrainedTokenizerFast",
         "chat_template": TEMPLATE}))


def write_rows(path: Path, n: int, shape: str, vocab: list[str]) -> None:
    rng = random.Random(1)
    with open(path, "w") as f:
        for _ in range(n):
            if shape == "pc":
                row = {"prompt": sentence(rng, vocab, 14, 42), "completion": " " + sentence(rng, vocab, 8, 34)}
            else:
                row = {"messages": [{"role": "system", "content": "Answer briefly."},
                                    {"role": "user", "content": sentence(rng, vocab, 14, 42)},
                                    {"role": "assistant", "content": sentence(rng, vocab, 8, 34)}]}
            f.write(json.dumps(row) + "\n")


PROBE = r"""
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024

what, data, tok_dir, cache, workers, limit = sys.argv[1:7]
from minitrain.data.readers import read_sft
from minitrain.text.tokenizer import Tokenizer
tok = Tokenizer.from_folder(tok_dir)
opts = {{"max_len": 1024}}
out = {{}}
Path("/proc/self/clear_refs").write_text("5")
base = {{k: status(k) for k in ("VmRSS:", "RssAnon:", "RssFile:")}}
if what in ("build", "hit"):
    import numpy as np
    from minitrain.data.batcher import Batcher
    from minitrain.data.collate import collate_causal
    from minitrain.data.store_build import open_or_build
    t0 = time.perf_counter()
    store = open_or_build(cache, [data], "sft", read_sft, tok, opts, workers=int(workers))
    out.update(open_s=time.perf_counter() - t0, rows=len(store), tokens=int(store.lengths.sum()))
    if what == "hit":
        b = Batcher(store.batch_lengths, 8, seed=0)
        first = None
        for batch in b:
            x = collate_causal([store[i] for i in batch], pad_id=0)
            if first is None:
                first = time.perf_counter() - t0
        out.update(first_batch_s=first, epoch_s=time.perf_counter() - t0)
elif what == "memory":
    from minitrain.data.files import read_rows
    import itertools
    t0 = time.perf_counter()
    ex = read_sft(data, tok, rows=itertools.islice(read_rows(data), int(limit)), **opts)
    out.update(open_s=time.perf_counter() - t0, rows=len(ex), tokens=sum(len(e["input_ids"]) for e in ex))
elif what == "datasets":
    os.environ["HF_DATASETS_CACHE"] = cache
    import datasets
    datasets.disable_progress_bars()
    def one(row):
        r = {{k: v for k, v in row.items()}}
        got = read_sft(data, tok, rows=[("row", r)], **opts)
        return got[0] if len(got) else {{"input_ids": [], "labels": []}}
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=data, split="train", cache_dir=cache)
    t1 = time.perf_counter()
    ds = ds.map(one, num_proc=int(workers), remove_columns=ds.column_names)
    out.update(load_s=t1 - t0, map_s=time.perf_counter() - t1, open_s=time.perf_counter() - t0, rows=len(ds),
               tokens=int(sum(len(x) for x in ds["input_ids"])))
import resource
cpu = sum(getattr(resource.getrusage(w), k) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
          for k in ("ru_utime", "ru_stime"))
out.update(peak=status("VmHWM:") - base["VmRSS:"], anon=status("RssAnon:") - base["RssAnon:"],
           file=status("RssFile:") - base["RssFile:"], cpu_s=cpu)
print(json.dumps(out))
"""


def probe(what: str, data: Path, tok: Path, cache: Path, workers: int = 1, limit: int = 0) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT)), what, str(data), str(tok), str(cache),
                        str(workers), str(limit)], capture_output=True, text=True, env=env, check=False)
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t0
    return out


def make_model(d: Path) -> Path:
    """A tiny LLaMA (2 layers, hidden 64) with the benchmark's tokenizer, saved by transformers."""
    import shutil

    import transformers

    folder = d / "model"
    if (folder / "config.json").exists():
        return folder
    vocab = json.loads((d / "tok" / "tokenizer.json").read_text())
    n = len(vocab["model"]["vocab"]) + len(vocab["added_tokens"])
    cfg = transformers.LlamaConfig(vocab_size=n, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    for f in (d / "tok").iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def time_to_first_step(d: Path, model: Path, data: Path, cache: str, name: str, workers: int) -> dict:
    import shutil

    """`python -m minitrain recipes/sft_llama.py ... max_steps=1`: seconds from the start to the first
    metrics line (step 1 done), and the process's peak RSS."""
    out = d / f"run-{name}"
    cmd = [sys.executable, "-m", "minitrain", str(ROOT / "recipes" / "sft_llama.py"), f"model={model}", f"data={data}",
           f"out={out}", "overwrite=true", "max_steps=1", "batch_size=8", "max_len=1024", f"data_cache={cache}",
           f"data_workers={workers}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    log = open(d / f"run-{name}.log", "w")  # noqa: SIM115 -- closed below
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    metrics, first = out / "metrics.jsonl", None
    shutil.rmtree(out, ignore_errors=True)
    while p.poll() is None:
        if first is None and metrics.exists() and metrics.stat().st_size:
            first = time.perf_counter() - t0
        time.sleep(0.05)
    log.close()
    if p.returncode:
        raise SystemExit(f"{name}: exit {p.returncode}, see {d / f'run-{name}.log'}")
    row = json.loads(metrics.read_text().splitlines()[0])  # peak_mem_mb: the process's peak RSS at step 1
    return {"first_step_s": round(first, 1), "total_s": round(time.perf_counter() - t0, 1),
            "peak_rss_mb": row.get("peak_mem_mb")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--memory-rows", type=int, default=200_000)
    ap.add_argument("--shape", choices=("pc", "chat"), default="pc")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--no-datasets", action="store_true")
    ap.add_argument("--keep", default=None)
    ap.add_argument("--recipe", action="store_true", help="only: time to the first step of recipes/sft_llama.py "
                                                          "(tiny model), first start, second start, data_cache=false")
    ap.add_argument("--no-memory", action="store_true", help="skip data_cache=false (today's lists: ~29 GB "
                                                             "at 10M rows)")
    a = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    d = Path(a.keep or tmp.name)
    d.mkdir(parents=True, exist_ok=True)
    vocab = words()
    make_tokenizer(d / "tok", vocab)
    data = d / f"rows-{a.shape}-{a.rows}.jsonl"
    if not data.exists():
        write_rows(data, a.rows, a.shape, vocab)
    print(f"data: {data} ({a.rows:,} rows, {data.stat().st_size / 2**20:,.0f} MiB), shape {a.shape}; "
          f"cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    res: dict[str, dict] = {}
    if a.recipe:
        import shutil

        model = make_model(d)
        shutil.rmtree(d / "recipe-cache", ignore_errors=True)
        starts = [("first start", d / "recipe-cache"), ("second start", d / "recipe-cache")]
        if not a.no_memory:
            starts.append(("data_cache=false", "false"))
        workers = int(a.workers.split(",")[-1])
        for name, cache in starts:
            row = time_to_first_step(d, model, data, str(cache), name.split()[0], workers)
            print(f"| {name} | {row} | load average {os.getloadavg()[0]:.1f} |", flush=True)
        return 0
    counts = [int(w) for w in a.workers.split(",")]
    for w in counts:
        res[f"build{w}"] = r = probe("build", data, d / "tok", d / f"cache-w{w}", w)
        print(f"build, {w} worker(s): {r}", flush=True)
    res["hit"] = r = probe("hit", data, d / "tok", d / f"cache-w{counts[-1]}", counts[-1])
    print(f"cache hit: {r}", flush=True)
    if not a.no_memory:
        res["memory"] = r = probe("memory", data, d / "tok", d / "none", 1, min(a.rows, a.memory_rows))
        print(f"in memory: {r}", flush=True)
    if not a.no_datasets:
        res["datasets"] = r = probe("datasets", data, d / "tok", d / "hf-cache", 2)
        print(f"datasets.map(num_proc=2): {r}", flush=True)
    tokens = res["hit"]["tokens"]
    print(f"\n{a.rows:,} rows, {tokens:,} tokens ({tokens / a.rows:.1f} a row), shape {a.shape}\n")
    print("| measure | value |\n| --- | --- |")
    for w in counts:
        b = res[f"build{w}"]
        print(f"| first build, {w} worker{'s' if w > 1 else ''} | {b['open_s']:.1f} s ({b['rows'] / b['open_s']:,.0f} "
              f"rows/s; {b['cpu_s']:.1f} CPU-s in the process and its workers) |")
    if len(counts) > 1:
        print(f"| speed-up {counts[-1]} workers / {counts[0]} | "
              f"{res[f'build{counts[0]}']['open_s'] / res[f'build{counts[-1]}']['open_s']:.2f}x |")
    h = res["hit"]
    print(f"| cache hit: open_or_build | {h['open_s']:.2f} s |")
    print(f"| cache hit: to the first collated batch | {h['first_batch_s']:.2f} s |")
    print(f"| one epoch of batches read from the store | {h['epoch_s']:.1f} s |")
    print(f"| peak RSS growth over that epoch (VmHWM) | {h['peak'] / 2**20:,.0f} MiB = {h['peak'] / tokens:.2f} B/token |")
    print(f"| of it beyond the mapped store pages (RssAnon) | {h['anon'] / 2**20:,.0f} MiB = "
          f"{h['anon'] / tokens:.2f} B/token |")
    m = res.get("memory")
    if m:
        print(f"| in memory (data_cache=false), {m['rows']:,} rows | {m['open_s']:.1f} s "
              f"({m['rows'] / m['open_s']:,.0f} rows/s), peak RSS {m['peak'] / 2**20:,.0f} MiB = "
              f"{m['peak'] / m['tokens']:.1f} B/token |")
    if "datasets" in res:
        s = res["datasets"]
        b = res[f"build{counts[-1]}"]
        print(f"| datasets load_dataset + map(num_proc=2) | {s['open_s']:.1f} s (load {s['load_s']:.1f} + map "
              f"{s['map_s']:.1f}; {s['rows'] / s['open_s']:,.0f} rows/s; {s['cpu_s']:.1f} CPU-s) |")
        print(f"| store build {counts[-1]} workers / datasets (rows/s) | {s['open_s'] / b['open_s']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
