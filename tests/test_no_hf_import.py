"""The runtime never imports the HF stack: it is only ever the reference our tests compare against.

Each check runs in a fresh interpreter, so modules imported by other tests (or by pytest plugins)
cannot hide or fake an import.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import minitrain

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("transformers", "peft", "trl", "accelerate", "datasets")

IMPORT_ALL = f"""
import importlib, pkgutil, sys
import minitrain, models
names = []
for pkg in (minitrain, models):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(info.name)
        names.append(info.name)
print("imported", len(names), "modules:", " ".join(names))
bad = sorted(m for m in sys.modules if m.split(".")[0] in {FORBIDDEN!r})
print("forbidden:", " ".join(bad))
"""


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_importing_every_runtime_module_pulls_in_no_hf_library():
    r = run("-c", IMPORT_ALL)
    assert r.returncode == 0, r.stderr
    imported, forbidden = r.stdout.splitlines()[-2:]
    assert "minitrain.weights" in imported and "minitrain.adapters.quant" in imported, imported  # the walk really ran
    assert forbidden.split(":", 1)[1].split() == [], f"runtime imported {forbidden}"


def test_version_flag():
    r = run("-m", "minitrain", "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"minitrain {minitrain.__version__}"


# A whole single-process run: load the demo checkpoint, attach LoRA, audit, train, evaluate, save.
# torch._dynamo, sympy and DTensor each cost about a CPU-second on first import, before step 1
# (BENCHMARKS.md, "What stands in the way"); nothing in a plain run needs them.
WHOLE_RUN = """
import sys
from minitrain.cli import run_cli
rc = run_cli(["recipes/dpo_mistral.py", "max_steps=2", "eval_every=0", "out=" + sys.argv[1]])
heavy = sorted(m for m in ("torch._dynamo", "sympy", "torch.distributed.tensor") if m in sys.modules)
print("rc", rc, "heavy:", " ".join(heavy))
"""


def test_a_plain_training_run_imports_neither_dynamo_nor_sympy(tmp_path):
    r = run("-c", WHOLE_RUN, str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.splitlines()[-1]
    assert last.startswith("rc 0 "), r.stdout[-3000:] + r.stderr[-3000:]
    assert last.split(":", 1)[1].split() == [], last
