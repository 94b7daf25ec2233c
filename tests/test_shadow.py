"""A user's working folder never shadows our code (issue: `models/` beside the checkpoints).

People keep checkpoints in a `models/` folder and may have `minitrain/` or `recipes/` folders of
their own. `python -m` puts the working directory first on the import path, so before the fix
`python -m minitrain recipes/sft_llama.py model=models/llama ...` took the user's folder for our
`models` package. Here `models/` and `recipes/` are real packages that raise on import (so the test
fails whichever way minitrain is installed: editable finder, path entry or site-packages), and
`minitrain/` is a plain folder (e.g. a clone of this repository, or run outputs). A `minitrain/`
folder holding an `__init__.py` would be run by `python -m minitrain` itself before any of our code;
the `minitrain` console script has no such exposure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from minitrain.cli import ENGINE_COMMANDS

REPO = Path(__file__).resolve().parents[1]
TOOLS = sorted(p.stem for p in (REPO / "tools").glob("*.py"))


def _shadow_folder(tmp_path: Path) -> Path:
    for name in ("models", "minitrain", "recipes"):
        (tmp_path / name).mkdir()
        if name != "minitrain":
            (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user package {name}/ was imported')\n")
    (tmp_path / "minitrain" / "cli.py").write_text("raise ImportError('the user folder minitrain/ was imported')\n")
    shutil.copytree(REPO / "demo" / "model", tmp_path / "models" / "tiny")  # a checkpoint where users keep them
    return tmp_path


def _run(argv, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, env=env, capture_output=True, text=True)


def test_cli_runs_from_a_folder_with_models_minitrain_recipes(tmp_path):
    cwd = _shadow_folder(tmp_path)
    p = _run(["-m", "minitrain", "--version"], cwd)
    assert p.returncode == 0 and p.stdout.startswith("minitrain "), p.stderr
    p = _run(["-m", "minitrain", REPO / "recipes" / "sft_llama.py", "model=models/tiny",
              f"data={REPO / 'demo' / 'sft_train.jsonl'}", "max_steps=2", "out=out/run"], cwd)
    assert p.returncode == 0, p.stderr
    assert (cwd / "out" / "run" / "adapter" / "adapter_model.safetensors").exists()


def test_every_tool_starts_from_a_folder_with_models_minitrain_recipes(tmp_path):
    cwd = _shadow_folder(tmp_path)
    assert TOOLS, "no tools found"
    for tool in TOOLS:
        p = _run([REPO / "tools" / f"{tool}.py", "--help"], cwd)
        assert p.returncode == 0, f"tools/{tool}.py --help from a shadowing folder:\n{p.stderr}"
    for name in ENGINE_COMMANDS:
        p = _run(["-m", "minitrain", name, "--help"], cwd)
        assert p.returncode == 0, f"minitrain {name} --help from a shadowing folder:\n{p.stderr}"
    p = _run(["-m", "minitrain", "plan", REPO / "recipes" / "sft_llama.py", "model=models/tiny",
              "--device", "cpu"], cwd)
    assert p.returncode == 0, p.stderr
