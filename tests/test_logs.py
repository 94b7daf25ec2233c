"""Logs people keep (issue 14, item 7): plain progress lines when stdout is not a terminal (the
trackers of `report_to`, TensorBoard among them: tests/test_trackers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from minitrain.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "demo"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "minitrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True)


def sft(*extra: str, cwd: Path) -> subprocess.CompletedProcess:
    return cli(str(ROOT / "recipes" / "sft_llama.py"), f"model={DEMO / 'model'}", f"data={DEMO / 'sft_train.jsonl'}",
               "max_len=64", "batch_size=2", "grad_accum=1", *extra, cwd=cwd)


def test_piped_run_prints_plain_progress_lines_and_no_bar_frames(tmp_path):
    p = sft("max_steps=20", "out=run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stdout + p.stderr  # tqdm redraws a bar with carriage returns
    lines = [line for line in p.stdout.splitlines() if line.startswith("progress: ")]
    steps = [int(line.split()[2].split("/")[0]) for line in lines]
    assert set(range(2, 21, 2)) <= set(steps) and steps == sorted(steps)  # every tenth of the run
    assert all(" | loss " in line and " tok/s | " in line and "left" in line for line in lines)
    assert "Warning" not in p.stderr


def test_a_terminal_gets_the_bar_and_no_lines():
    said = []
    progress = Progress(10, 0, said.append, tty=True)
    row = {"loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0}
    for step in range(1, 11):
        progress.update(step, row)
    assert progress.bar is not None and progress.bar.n == 10 and not said
    progress.close()
    Progress(10, 0, said.append, tty=False).update(1, row)  # step 1 is the first tenth
    assert said and said[0].startswith("progress: step 1/10 (10%)")


def test_run_files_are_strict_json_and_the_session_check_finds_a_nan(tmp_path):
    """`strict_json` writes NaN / inf as null; the session-wide check (conftest) would catch a file
    written the old way."""
    from conftest import non_strict_json

    from minitrain.progress import strict_json

    line = strict_json({"step": 1, "reward": float("nan"), "kl": [1.0, float("inf")], "x": {"y": -float("inf")}})
    assert json.loads(line) == {"step": 1, "reward": None, "kl": [1.0, None], "x": {"y": None}}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(line + "\n" + json.dumps({"step": 2, "reward": float("nan")}) + "\n")
    assert [b.split(": ", 1)[0] for b in non_strict_json(tmp_path)] == [f"{tmp_path / 'run' / 'metrics.jsonl'}:2"]
    (tmp_path / "run" / "metrics.jsonl").unlink()
