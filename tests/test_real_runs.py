"""A real run never inherits the demo (issue 14, item 2).

`recipes/dpo_mistral.py` and `recipes/sft_mistral.py` train the built-in demo when the command names
no model, data or eval_data. A command that names one of them is a real run: it gets the recipe's own
defaults (TRL's `sft_weight` 0, no eval data), is asked for what it lacks, and the Stage B command
that Stage A prints carries the run's model, data, out and quantize.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minitrain.cli import load_recipe, resolve_config
from minitrain.config import validate

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "demo"
RECIPES = ("dpo_mistral.py", "sft_mistral.py")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "minitrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True)


def _values(cfg) -> list[str]:
    return [str(v) for v in vars(cfg).values()]


@pytest.mark.parametrize("name", RECIPES)
def test_demo_settings_only_when_no_model_data_or_eval_data_is_named(name):
    recipe = load_recipe(str(ROOT / "recipes" / name))
    demo_cfg, demo = resolve_config(recipe, ["max_steps=3"])
    assert demo and demo_cfg.model == str(DEMO / "model") and demo_cfg.max_steps == 3
    for key in ("model=/ckpt/Mistral-7B", "data=mine.jsonl", "eval_data=mine_eval.jsonl"):
        cfg, used = resolve_config(recipe, [key])
        assert not used
        assert not any(str(DEMO) in v for v in _values(cfg)), f"{name} {key}: a demo file leaks into {cfg}"
        assert cfg.max_len >= 1024 and cfg.max_steps == -1 and cfg.epochs == 1.0  # a real run's size
        assert cfg.eval_data == ("mine_eval.jsonl" if key.startswith("eval_data") else "")


def test_real_dpo_defaults_are_trls():
    trl = pytest.importorskip("trl")
    recipe = load_recipe(str(ROOT / "recipes" / "dpo_mistral.py"))
    cfg, _ = resolve_config(recipe, ["model=/ckpt"])
    validate(cfg)  # resolves the method's own NLL weight
    ref = {f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default)
           for f in dataclasses.fields(trl.DPOConfig) if f.name in ("beta", "label_smoothing", "loss_type")}
    losses = ref["loss_type"] if isinstance(ref["loss_type"], list) else [ref["loss_type"]]
    assert cfg.sft_weight == 0 and "sft" not in losses  # TRL adds no NLL term by default
    assert cfg.beta == ref["beta"] and cfg.label_smoothing == ref["label_smoothing"]
    assert cfg.loss_type == "sigmoid" and losses == ["sigmoid"]


@pytest.mark.parametrize("loss_type", ["sigmoid", "orpo", "cpo", "simpo"])
def test_real_run_nll_weight_is_each_methods_own(loss_type):
    """Unset, `sft_weight` takes the method's weight (TRL's defaults: ORPO always adds the NLL, CPOConfig's
    cpo_alpha 1.0, SimPO none), so a real `loss_type=orpo` run starts instead of being refused."""
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOConfig

    recipe = load_recipe(str(ROOT / "recipes" / "dpo_mistral.py"))
    cfg, _ = resolve_config(recipe, ["model=/ckpt", "data=d.jsonl", f"loss_type={loss_type}"])
    validate(cfg)
    expected = {"sigmoid": 0.0, "orpo": 1.0, "cpo": _default(CPOConfig, "cpo_alpha"), "simpo": 0.0}
    assert cfg.sft_weight == expected[loss_type]
    cfg, _ = resolve_config(recipe, ["model=/ckpt", "data=d.jsonl", f"loss_type={loss_type}", "sft_weight=0.5"])
    validate(cfg)
    assert cfg.sft_weight == 0.5  # a weight the user names is kept


def _default(cls, name: str):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _user_pairs(tmp_path: Path, n: int) -> tuple[Path, Path]:
    lines = (DEMO / "prefs_train.jsonl").read_text().splitlines()
    train, held = tmp_path / "my_pairs.jsonl", tmp_path / "my_pairs_eval.jsonl"
    train.write_text("\n".join(lines[:n]) + "\n")
    held.write_text("\n".join(lines[n:n + 6]) + "\n")
    return train, held


def test_real_dpo_run_asks_for_data_before_loading_and_writes_nothing(tmp_path):
    shutil.copytree(DEMO / "model", tmp_path / "ckpt")
    p = cli(str(ROOT / "recipes" / "dpo_mistral.py"), "model=ckpt", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == "error: data: not set — pass data=path/to/train.jsonl"
    assert "model:" not in p.stdout  # refused before the model loaded
    assert not (tmp_path / "runs").exists()
    p = cli(str(ROOT / "recipes" / "dpo_mistral.py"), "data=pairs.jsonl", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.startswith("error: model: not set — pass model=")


def test_real_dpo_run_evaluates_nothing_without_eval_data_and_pure_dpo_at_step0_is_ln2(tmp_path):
    shutil.copytree(DEMO / "model", tmp_path / "ckpt")
    train, held = _user_pairs(tmp_path, 8)
    small = ["max_len=128", "max_steps=2", "batch_size=2", "grad_accum=1"]
    p = cli(str(ROOT / "recipes" / "dpo_mistral.py"), "model=ckpt", f"data={train.name}", *small, "out=a",
            cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "no held-out evaluation" in p.stdout and str(DEMO) not in p.stdout + p.stderr
    assert "to train a real checkpoint" not in p.stdout  # the demo's hint is for the demo
    assert not (tmp_path / "a" / "eval.jsonl").exists()
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("eval/") for r in rows for k in r)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["sft_weight"] == 0 and config["eval_data"] == "" and str(DEMO) not in json.dumps(config)

    p = cli(str(ROOT / "recipes" / "dpo_mistral.py"), "model=ckpt", f"data={train.name}", f"eval_data={held.name}",
            *small, "out=b", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    step0 = json.loads((tmp_path / "b" / "eval.jsonl").read_text().splitlines()[0])
    assert step0["step"] == 0 and step0["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference


def test_stage_a_prints_a_stage_b_command_with_the_runs_model_data_out_and_quantize(tmp_path):
    shutil.copytree(DEMO / "model", tmp_path / "ckpt")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join((DEMO / "sft_train.jsonl").read_text().splitlines()[:8]) + "\n")
    p = cli(str(ROOT / "recipes" / "sft_mistral.py"), "model=ckpt", "data=chats.jsonl", "max_len=128",
            "max_steps=2", "batch_size=2", "grad_accum=1", "out=runs/sft", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    line = p.stdout.splitlines()[p.stdout.splitlines().index("Stage B (DPO) continuing this adapter:") + 1]
    args = dict(a.split("=", 1) for a in shlex.split(line)[4:])
    assert shlex.split(line)[:4] == ["python", "-m", "minitrain", "recipes/dpo_mistral.py"]
    assert args["model"] == "ckpt" and args["init_adapter"] == str(Path("runs/sft/adapter"))
    assert args["quantize"] == "none" and args["max_len"] == "128" and args["out"] == str(Path("runs/sft_dpo"))
    assert "data" in args and str(DEMO) not in line

    # run as printed, with the user's pairs filled in: trains on them, against this Stage A
    train, held = _user_pairs(tmp_path, 6)
    args.update(data=train.name, eval_data=held.name)
    p = cli(str(ROOT / "recipes" / "dpo_mistral.py"), *[f"{k}={v}" for k, v in args.items()], "max_steps=1",
            "batch_size=2", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert f"data (train): 6 examples from {train.name}" in p.stdout and "Stage A adapter" in p.stdout


def test_with_an_sft_term_the_pure_dpo_loss_is_logged_too(tmp_path):
    """The demo keeps sft_weight=1: `eval/loss` is then DPO + NLL, and the pure DPO term is logged beside it."""
    shutil.copytree(DEMO / "model", tmp_path / "ckpt")
    train, held = _user_pairs(tmp_path, 4)
    p = cli(str(ROOT / "recipes" / "dpo_mistral.py"), "model=ckpt", f"data={train.name}", f"eval_data={held.name}",
            "sft_weight=1.0", "max_len=128", "max_steps=1", "batch_size=2", "out=c", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    step0 = json.loads((tmp_path / "c" / "eval.jsonl").read_text().splitlines()[0])
    assert step0["eval/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert step0["eval/loss"] == pytest.approx(math.log(2) + step0["eval/sft_nll"], abs=1e-5)
    row = json.loads((tmp_path / "c" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["loss"] == pytest.approx(row["dpo_loss"] + row["sft_nll"], rel=1e-5)
