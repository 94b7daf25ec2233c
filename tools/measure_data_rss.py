"""Peak memory of reading a large Parquet file: minitrain's row reader against loading it whole.

    python tools/measure_data_rss.py [--gib 1.0] [--tokenize-mib 32] [--keep FILE]

Writes a Parquet file of `--gib` GiB (uncompressed, so its size on disk is the text it holds:
rows of ~1 KiB of words in a "text" column, written with pyarrow), then in a fresh interpreter
per reader reports

    peak RSS during the read - RSS just before it (after imports), and its ratio to the file size,

for (1) `minitrain.data.files.read_rows` iterating every row, (2) `pyarrow.parquet.read_table`
+ `to_pylist` (the whole file as Python rows, what a naive reader does), and (3) `read_sft` on
the first `--tokenize-mib` MiB of rows (token-id examples kept in memory: bytes per token).
Peak RSS is VmHWM, reset after the imports. Needs pyarrow (the data extra). Not a test: it
writes `--gib` GiB to a temporary folder and takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
import pyarrow.parquet as pq
from minitrain.data.files import read_rows
from minitrain.data.readers import read_sft
from minitrain.text.tokenizer import Tokenizer

def rss(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024

what, path, extra = sys.argv[1], sys.argv[2], sys.argv[3]
Path("/proc/self/clear_refs").write_text("5")
before = rss("VmRSS:")
out = {{}}
if what == "rows":
    n = chars = 0
    for _, row in read_rows(path):
        n += 1
        chars += len(row["text"])
    out.update(rows=n, chars=chars)
elif what == "read_table":
    rows = pq.read_table(path).to_pylist()
    out.update(rows=len(rows))
else:
    ex = read_sft(path, Tokenizer.from_folder(extra), max_len=100000)
    out.update(rows=len(ex), tokens=sum(len(e["input_ids"]) for e in ex))
out.update(peak=rss("VmHWM:") - before)
print(json.dumps(out))
"""


def write_parquet(path: Path, gib: float, seed: int = 0) -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    words = np.array("the a of to in and is it that was for on are with as his they be at one have this from or "
                     "had by hot word but what some we can out other were all there when up use your how said "
                     "each she which do their time if will way about many then them write would".split())
    target, written = int(gib * 2**30), 0
    with pq.ParquetWriter(str(path), pa.schema([("text", pa.string())]), compression="NONE") as w:
        while written < target:
            texts = [" ".join(rng.choice(words, 200)) for _ in range(4096)]  # ~1 KiB each
            w.write_table(pa.table({"text": texts}), row_group_size=4096)
            written += sum(map(len, texts))
    return path.stat().st_size


def probe(what: str, path: Path, extra: str = "") -> dict:
    p = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT)), what, str(path), extra],
                       capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tokenize-mib", type=float, default=32.0)
    ap.add_argument("--keep", default=None, help="write the Parquet file here (and keep it)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.keep) if args.keep else Path(tmp) / "big.parquet"
        size = write_parquet(path, args.gib)
        print(f"file: {path} ({size / 2**30:.2f} GiB on disk, uncompressed text)")
        r = probe("rows", path)
        print(f"read_rows (minitrain, streamed): {r['rows']:,} rows, peak RSS +{r['peak'] / 2**20:.0f} MiB "
              f"= {r['peak'] / size:.3f}x the file")
        t = probe("read_table", path)
        print(f"pyarrow read_table().to_pylist(): peak RSS +{t['peak'] / 2**20:.0f} MiB = {t['peak'] / size:.2f}x")
        small = Path(tmp) / "small.parquet"
        small_size = write_parquet(small, args.tokenize_mib / 1024, seed=1)
        sys.path.insert(0, str(ROOT / "tests"))
        from _tok import make_llama3_tokenizer

        tok_dir = make_llama3_tokenizer(Path(tmp) / "tok")
        s = probe("read_sft", small, str(tok_dir))
        print(f"read_sft examples ({small_size / 2**20:.0f} MiB file, {s['tokens']:,} tokens): peak RSS "
              f"+{s['peak'] / 2**20:.0f} MiB = {s['peak'] / s['tokens']:.0f} bytes per token kept")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
