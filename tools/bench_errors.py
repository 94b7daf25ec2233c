"""How fast a mistake on the command line is answered: the wall time from starting the command to its
exit, for the mistakes a user makes first, against the time to import torch.

    python tools/bench_errors.py [--repeats 7] [--recipe dpo_mistral] [--write BENCHMARKS.md]

Each case is `python -m minitrain RECIPE ...` run as a fresh subprocess from an empty folder
(`--repeats` times; the median and the fastest reported): a mistyped key, a value of the wrong type,
a model folder and a data file that do not exist, a run file with an unknown key, and `--help`. The
command reads the recipe's config without its heavy imports (`minitrain.cli.early_check`), so these
answer before torch is imported; the last row is `python -c "import torch"` alone, what each of them
would cost otherwise. Run it on an idle machine: the figures are wall-clock.
`--write` puts the table between `<!-- bench:begin errors -->` markers.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(argv: list[str], cwd: Path, repeats: int) -> tuple[float, float, int]:
    """(median, fastest) seconds of `argv` over `repeats` runs, and its exit code."""
    times, code = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        code = subprocess.run(argv, cwd=cwd, capture_output=True).returncode
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--recipe", default="dpo_mistral")
    ap.add_argument("--write", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        here = Path(tmp)
        (here / "model").mkdir()
        (here / "run.yaml").write_text("lr: 1e-4\nlerning_rate: 3\n")
        py = [sys.executable, "-m", "minitrain", a.recipe]
        cases = [
            ("a mistyped key: `lerning_rate=1e-4`", py + ["lerning_rate=1e-4"]),
            ("a value of the wrong type: `lr=fast`", py + ["lr=fast"]),
            ("no such model folder: `model=nowhere data=x.jsonl`", py + ["model=nowhere", "data=x.jsonl"]),
            ("no such data file: `model=model data=missing.jsonl`", py + ["model=model", "data=missing.jsonl"]),
            ("a run file with an unknown key: `config=run.yaml`", py + ["config=run.yaml"]),
            ("`--help`", py + ["--help"]),
            ("`python -c \"import torch\"` (for scale)", [sys.executable, "-c", "import torch"]),
        ]
        rows = []
        for what, argv in cases:
            median, fastest, code = timed(argv, here, a.repeats)
            rows.append(f"| {what} | {median:.2f} s | {fastest:.2f} s | {code} |")
            print(rows[-1], flush=True)
    text = "\n".join([f"`python tools/bench_errors.py --recipe {a.recipe} --repeats {a.repeats}` (wall time of the "
                      f"whole command, a fresh process each run, from an empty folder):", "",
                      "| the command | median | fastest | exit code |", "| --- | --- | --- | --- |", *rows])
    if a.write:
        sys.path.insert(0, str(ROOT / "tools"))
        from bench import markers, write_benchmarks

        begin, end = markers("errors")
        write_benchmarks(a.write, f"{begin}\n{text}\n{end}", "errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
