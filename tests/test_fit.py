"""Plan before loading (issue 14, item 4), tested on the CPU by giving the check a device size.

The checkpoint folders here hold only the real `config.json` of Mistral-7B (no weights): a run
that got as far as reading weights would fail on the missing safetensors instead, so the memory
error proves the plan came first. The figures are `minitrain plan`'s (the reference planner).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minitrain.cli import load_recipe, resolve_config
from minitrain.errors import UserError
from minitrain.plan import fit

ROOT = Path(__file__).resolve().parents[1]
MISTRAL = ROOT / "tests" / "fixtures" / "configs" / "Mistral-7B-Instruct-v0.2"
DEMO = ROOT / "demo"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    (cwd / "pairs.jsonl").touch()  # data= must exist (the command checks paths first); it is never read here
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "minitrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True)


def plan_tool_fits(cfg, budget: str) -> bool:
    tool = importlib.import_module("minitrain.commands.plan")
    return tool.render(cfg, "r", [], {"--gpu-mem": budget, "--device": "cuda", "--all": False})[1]


def dpo_config(*args: str):
    return resolve_config(load_recipe(str(ROOT / "recipes" / "dpo_mistral.py")),
                          [f"model={MISTRAL}", "data=pairs.jsonl", *args])[0]


def test_a_run_that_does_not_fit_stops_before_loading_with_the_plans_suggestions(tmp_path):
    p = cli(str(ROOT / "recipes" / "dpo_mistral.py"), f"model={MISTRAL}", "data=pairs.jsonl", "quantize=nf4",
            "checkpointing=false", "gpu_mem=12GiB", cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    line = p.stderr.strip()
    assert "\n" not in line and line.startswith("error: memory: the plan needs ")
    assert "but gpu_mem=12GiB gives 12.00 GiB" in line
    assert "checkpointing=true -> 7." in line and "(fits)" in line and "batch_size=1 grad_accum=16" in line
    assert "auto_fit=true" in line and "memory_check=false" in line
    assert not (tmp_path / "runs").exists()


def test_memory_check_false_goes_on_to_load(tmp_path):
    p = cli(str(ROOT / "recipes" / "dpo_mistral.py"), f"model={MISTRAL}", "data=pairs.jsonl", "quantize=nf4",
            "checkpointing=false", "gpu_mem=12GiB", "memory_check=false", "device=cpu", cwd=tmp_path)
    assert p.returncode == 2 and "memory:" not in p.stderr  # it went on, to the missing tokenizer / weights


def test_auto_fit_chooses_checkpointing_then_the_micro_batch_keeping_the_global_batch():
    said: list[str] = []
    cfg = dpo_config("checkpointing=false", "batch_size=8", "grad_accum=2", "max_len=2048", "gpu_mem=12GiB",
                     "auto_fit=true", "quantize=nf4")
    assert not plan_tool_fits(cfg, "12GiB") and not plan_tool_fits(dataclasses.replace(cfg, checkpointing=True),
                                                                   "12GiB")
    got = fit.check(cfg, log=said.append)
    assert got.checkpointing and got.batch_size * got.grad_accum == 16 and got.batch_size < 8
    assert plan_tool_fits(got, "12GiB")  # the reference planner agrees it fits
    bigger = dataclasses.replace(got, batch_size=got.batch_size * 2, grad_accum=got.grad_accum // 2)
    assert not plan_tool_fits(bigger, "12GiB")  # and it is the largest micro-batch that does
    assert len(said) == 1 and said[0].startswith(f"auto_fit: checkpointing=true batch_size={got.batch_size} "
                                                 f"grad_accum={got.grad_accum} (global batch 16 kept)")


def test_auto_fit_checkpoints_the_fewest_blocks_that_fit_before_all_or_a_smaller_micro_batch():
    """A budget between no checkpointing and every block: auto_fit picks checkpointing=N, the smallest N
    the reference planner says fits (N - 1 does not), and keeps the micro-batch."""
    cfg = dpo_config("checkpointing=false", "quantize=nf4", "gpu_mem=12GiB", "auto_fit=true")
    blocks = json.loads((MISTRAL / "config.json").read_text())["num_hidden_layers"]
    none, every = (fit._plan(dataclasses.replace(cfg, checkpointing=k))[2].peak for k in (False, True))
    budget = f"{(fit.needed(none) + fit.needed(every)) // 2 // 2**20}MiB"  # halfway between the two
    cfg = dataclasses.replace(cfg, gpu_mem=budget)
    assert not plan_tool_fits(cfg, budget) and plan_tool_fits(dataclasses.replace(cfg, checkpointing=True), budget)
    said: list[str] = []
    got = fit.check(cfg, log=said.append)
    n = got.checkpointing
    assert type(n) is int and 0 < n < blocks, n
    assert (got.batch_size, got.grad_accum) == (cfg.batch_size, cfg.grad_accum)
    assert plan_tool_fits(got, budget) and not plan_tool_fits(dataclasses.replace(cfg, checkpointing=n - 1), budget)
    assert len(said) == 1 and said[0].startswith(f"auto_fit: checkpointing={n} (the first {n} of {blocks} blocks) "
                                                 f"(global batch {cfg.batch_size * cfg.grad_accum} kept)"), said
    with pytest.raises(UserError) as e:  # without auto_fit: the same N is the first thing the error suggests
        fit.check(dataclasses.replace(cfg, auto_fit=False), log=lambda _: None)
    assert f"— try checkpointing={n} (the first {n} of {blocks} blocks) -> " in str(e.value)
    assert str(e.value).split("— try ")[1].split(";")[0].endswith("(fits)")


def test_checkpointing_beyond_the_models_blocks_is_one_error_naming_the_key(tmp_path):
    with pytest.raises(UserError, match="^checkpointing=33: the model has 32 blocks — give 0 to 32"):
        fit.check(dpo_config("checkpointing=33", "quantize=nf4", "gpu_mem=12GiB"), log=lambda _: None)
    p = cli(str(ROOT / "recipes" / "dpo_mistral.py"), f"model={MISTRAL}", "data=pairs.jsonl", "quantize=nf4",
            "checkpointing=33", "gpu_mem=12GiB", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: checkpointing=33: the model has 32 blocks")
    assert "\n" not in p.stderr.strip()


def test_auto_fit_that_cannot_fit_says_so_and_what_else_to_try():
    cfg = dpo_config("gpu_mem=4GiB", "auto_fit=true")  # bf16 7B weights alone are 13.5 GiB
    with pytest.raises(UserError) as e:
        fit.check(cfg, log=lambda _: None)
    assert "auto_fit found no checkpointing / micro-batch that fits" in str(e.value)
    assert "try quantize=nf4 -> 7." in str(e.value)


def test_a_run_that_fits_says_so_and_unplanned_runs_are_not_checked():
    said: list[str] = []
    cfg = dpo_config("quantize=nf4", "gpu_mem=12GiB")
    assert fit.check(cfg, log=said.append) is cfg and said[0].startswith("memory: planned peak ")
    cpu = dataclasses.replace(cfg, gpu_mem="")
    assert fit.check(cpu, log=said.append) is cpu and len(said) == 1  # CPU and no size given: no check
    with pytest.raises(UserError, match="^gpu_mem=lots: not a size"):
        from minitrain.config import validate

        validate(dataclasses.replace(cfg, gpu_mem="lots"))


def test_the_planned_peak_is_logged_beside_the_measured_one(tmp_path):
    p = cli(str(ROOT / "recipes" / "sft_llama.py"), f"model={DEMO / 'model'}", f"data={DEMO / 'sft_train.jsonl'}",
            "max_len=64", "batch_size=2", "max_steps=2", "gpu_mem=1GiB", "out=run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    cfg = resolve_config(load_recipe(str(ROOT / "recipes" / "sft_llama.py")),
                         [f"model={DEMO / 'model'}", "data=x", "max_len=64", "batch_size=2"])[0]
    from minitrain.plan.predict import predict, run_shape, shape_from_hf

    want = predict(shape_from_hf(json.loads((DEMO / "model" / "config.json").read_text())),
                     run_shape(cfg, device="cuda")).peak / 2**20
    assert all(r["planned_peak_mb"] == pytest.approx(want) and "peak_mem_mb" in r for r in rows)
