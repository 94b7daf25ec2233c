"""Time the README's first command (the DPO demo) on an idle machine and under load.

    python tools/loaded_demo.py [--load 2] [--repeats 2] [--variants auto,torch] [--max-steps N]

For each repeat, each variant runs `python -m minitrain recipes/dpo_mistral.py` twice, once as
the machine is and once with `--load` busy background processes (`yes > /dev/null`, started
here and stopped here by their process ids), and the wall time from the command to its exit is
printed with the 1-minute load average seen just before. Variants:

- auto:  what a user gets: no OMP_NUM_THREADS, minitrain picks the idle cores (minitrain/cpu.py);
- torch: torch's own default, one thread per core (threads=<cores>), as before that choice.

The figures are for this machine as it is: say whether others were using it when you quote them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_demo(variant: str, out: Path, max_steps: int) -> tuple[float, str]:
    """(wall seconds, the run's `cpu threads:` line) of one demo run; exits if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "minitrain", str(ROOT / "recipes" / "dpo_mistral.py"), f"out={out}", "overwrite=true"]
    if variant == "torch":
        cmd.append(f"threads={os.cpu_count() or 1}")
    if max_steps:
        cmd.append(f"max_steps={max_steps}")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"error: the demo failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    threads = next((line for line in p.stdout.splitlines() if line.startswith("cpu threads:")), "cpu threads: ?")
    return wall, threads


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=int, default=2, help="busy background processes for the loaded runs")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="auto,torch")
    ap.add_argument("--max-steps", type=int, default=0, help="0: the demo's own 100 steps")
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="minitrain_loaded_demo_"))
    print(f"machine: {os.cpu_count()} cores; each line: variant, load, wall seconds, load average before")
    results: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(a.repeats):
            for loaded in (False, True):
                busy = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(a.load if loaded else 0)]
                try:
                    time.sleep(1.0 if busy else 0.0)  # let the busy processes take their cores
                    for v in variants:
                        before = os.getloadavg()[0]
                        wall, threads = run_demo(v, tmp / v, a.max_steps)
                        state = f"{a.load} x yes" if loaded else "as is"
                        results.setdefault((v, state), []).append(wall)
                        print(f"  repeat {r + 1}: {v:<6} {state:<8} {wall:7.1f} s   load avg {before:5.2f}   {threads}",
                              flush=True)
                finally:
                    for p in busy:  # only the processes started here, by their ids
                        p.kill()
                        p.wait()
        print("median wall seconds:")
        for (v, state), walls in results.items():
            walls = sorted(walls)
            print(f"  {v:<6} {state:<8} {walls[len(walls) // 2]:7.1f} s  (all: {', '.join(f'{w:.1f}' for w in walls)})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
