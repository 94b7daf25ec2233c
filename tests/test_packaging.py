"""minitrain as a user installs it: a wheel in a fresh virtual environment, run from an empty folder.

The wheel is built from this checkout (setuptools, no network) and installed without its
dependencies into a new venv that sees this interpreter's site-packages through a `.pth` line (so
torch and friends need no download) but not our editable install: `import minitrain` must come from
the wheel. From an empty folder, `minitrain ls` lists the recipes it carries, `minitrain cp` copies
one, and both the shipped recipe and the copy train the built-in demo by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_wheel_lists_every_package():
    """pyproject.toml names its packages one by one (two are mapped from recipes/ and demo/): a new
    wing of minitrain must be added there, or the wheel would lack it."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(REPO).parts)
               for root in ("minitrain", "models") for p in (REPO / root).rglob("__init__.py")}
    assert set(setuptools["packages"]) == on_disk | {"minitrain.recipes", "minitrain.demo"}
    assert setuptools["package-dir"] == {"minitrain.recipes": "recipes", "minitrain.demo": "demo"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding only the wheel of this checkout; its python."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(root / "dist"), str(REPO)], check=True, capture_output=True)
    wheel = next((root / "dist").glob("minitrain-*.whl"))
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}  # this interpreter's packages
    Path(site, "_deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_recipes_by_name_from_an_installed_wheel(installed, tmp_path):
    where = _run(installed, "-c", "import minitrain, models; print(minitrain.__file__); print(models.__file__)",
                 cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert all(Path(line).is_relative_to(installed.parent.parent) for line in where.stdout.split()), where.stdout

    minitrain = installed.parent / "minitrain"  # the console script pip wrote
    listing = subprocess.run([str(minitrain), "ls"], cwd=tmp_path, capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    names = [line.split()[0] for line in listing.stdout.splitlines() if line and not line.startswith(("run", "copy"))]
    assert names == sorted(p.stem for p in (REPO / "recipes").glob("*.py") if not p.name.startswith("_"))

    copied = subprocess.run([str(minitrain), "cp", "sft_mistral", "my_sft.py"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert copied.returncode == 0, copied.stderr
    assert (tmp_path / "my_sft.py").read_text() == (REPO / "recipes" / "sft_mistral.py").read_text()
    again = subprocess.run([str(minitrain), "cp", "sft_mistral", "my_sft.py"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert again.returncode == 2 and again.stderr.startswith("error: my_sft.py: already exists")

    # the shipped recipe by name, and the user's copy by path: both find the demo inside the wheel
    for recipe, out in (("dpo_mistral", "dpo"), ("my_sft.py", "sft")):
        run = _run(installed, "-m", "minitrain", recipe, "max_steps=2", "eval_every=0", f"out={out}", cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert "done: step 2/2" in run.stdout
        steps = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        assert steps[-1]["step"] == 2 and "loss" in steps[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dpo", "my_sft.py", "sft"]  # nothing else written
    # every file of every recipe's demo is in the wheel (GRPO's in demo/grpo/ too)
    shipped = installed.parent.parent / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages" / "minitrain" / "demo"
    def files(root: Path) -> list[str]:  # pip byte-compiles the demo's .py files (the tool demo's) as it installs
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)

    assert files(shipped) == files(REPO / "demo")


def test_a_recipe_path_typed_outside_the_clone(installed, tmp_path):
    """`python -m minitrain recipes/sft_llama.py` in a folder without one: the shipped recipe, said so."""
    p = _run(installed, "-m", "minitrain", "recipes/sft_llama.py", "--help", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("note: no recipes/sft_llama.py here: running minitrain's own sft_llama")
    p = _run(installed, "-m", "minitrain", "sft_lama", cwd=tmp_path)
    assert p.returncode == 2 and "did you mean sft_llama?" in p.stderr and p.stderr.count("\n") == 1


def test_every_command_from_an_installed_wheel(installed, tmp_path):
    """Each command of `minitrain --help`, run from the wheel in an empty folder on what a DPO demo run
    leaves there: no tools/ folder is needed for any of them."""
    from minitrain.cli import COMMANDS

    minitrain = str(installed.parent / "minitrain")

    def run(*args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        p = subprocess.run([minitrain, *args], cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"minitrain {' '.join(args)}:\n{p.stdout[-1500:]}{p.stderr[-1500:]}"
        return p

    listed = run("--help").stdout
    assert all(f"  minitrain {name}" in listed for name in COMMANDS), listed
    demo = Path(_run(installed, "-c", "from minitrain.bundled import demo_dir; print(demo_dir())",
                     cwd=tmp_path).stdout.strip())
    assert "\nbeta: 0.1\n" in run("config", "dpo_mistral").stdout
    (tmp_path / "run.yaml").write_text("max_steps: 2\neval_every: 0\n")  # a run file of the demo's settings
    run("dpo_mistral", "config=run.yaml", "out=dpo", f"data_cache={tmp_path / 'cache'}")
    assert json.loads((tmp_path / "dpo" / "config.json").read_text())["max_steps"] == 2
    run("merge", "--model", str(demo / "model"), "--adapter", "dpo/adapter", "--out", "merged")
    assert (tmp_path / "merged" / "config.json").is_file()
    assert run("generate", "--model", "merged", "--prompt", "Hello", "--max-new-tokens", "4").stdout.strip()
    assert "plan: dpo_mistral" in run("plan", "dpo_mistral", "--device", "cpu").stdout
    assert "audit: healthy" in run("audit", "dpo_mistral", "max_steps=1").stdout
    run("plot", "dpo", "--out", "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "read back as built" in run("cache", "verify", "--dir", "cache").stdout
    assert "usage: minitrain evaluate" in run("evaluate", "--help").stdout
    run("export", "--model", str(demo / "model"), "--adapter", "dpo/adapter", "--out", "dpo.gguf")
    assert (tmp_path / "dpo.gguf").read_bytes()[:4] == b"GGUF"
