"""Crash safety: a run killed anywhere resumes to the same result (tools/kill_resume.py), and
SIGINT / SIGTERM stop a run cleanly with a checkpoint and a line saying how to resume.

The harness kills `python -m minitrain recipes/sft_llama.py` with SIGKILL at seeded random
moments (3 kills here; `python tools/kill_resume.py --kills 20` for the full check), loads every
checkpoint after every kill, and compares the finished run's adapter and metrics with an
uninterrupted run's, bitwise. Its own checks are also tested on planted damage, so a harness
that could not fail would show here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kill_resume", REPO / "tools" / "kill_resume.py")
kr = importlib.util.module_from_spec(_spec)
sys.modules["kill_resume"] = kr  # dataclasses resolve their module through sys.modules
_spec.loader.exec_module(kr)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kill_resume")
    model = kr.make_model(root / "model")
    return {"root": root, "model": model, "data": kr.make_data(root / "train.jsonl"),
            "adapter": kr.make_start_adapter(model, root / "start_adapter")}


@pytest.fixture(scope="module")
def killed(tiny, tmp_path_factory):
    """The harness with 3 kills (steps=4); its work folder keeps the uninterrupted reference run."""
    work = tmp_path_factory.mktemp("harness")
    summary = kr.harness(kills=3, seed=1, steps=4, work=work, model=tiny["model"], data=tiny["data"])
    return summary, work


# ----------------------------------------------------------------------------- kill anywhere, resume, same result


def test_killed_three_times_resumes_to_the_uninterrupted_result(killed):
    summary = killed[0]
    print(summary.text())
    assert summary.ok, summary.text()
    assert summary.kills == 3 and summary.rounds >= 1
    assert summary.checkpoints_loaded + summary.no_checkpoint_yet >= 1


# ----------------------------------------------------------------------------- the harness's checks can fail


def test_harness_checks_catch_planted_damage(killed, tmp_path):
    finished = killed[1] / "reference"  # an uninterrupted 4-step run
    assert kr.compare_final(finished, finished, 4) == []
    assert kr.load_checkpoint(finished / "checkpoint") == 4

    dup = tmp_path / "dup"
    shutil.copytree(finished, dup)
    lines = (dup / "metrics.jsonl").read_text().splitlines()
    (dup / "metrics.jsonl").write_text("\n".join(lines[:2] + lines[1:]) + "\n")  # step 2 twice
    assert any("duplicated [2]" in p for p in kr.compare_final(dup, finished, 4))
    summary = kr.Summary()
    kr.check_after_kill(dup, summary, "planted")
    assert summary.problems and "are not 1..n" in summary.problems[0]

    moved = tmp_path / "moved"
    shutil.copytree(finished, moved)
    path = moved / "adapter" / "adapter_model.safetensors"
    tensors = load_file(path)
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = torch.nextafter(tensors[key].view(-1)[0], torch.tensor(1e9))  # one ulp
    save_file(tensors, path)
    assert any("adapter differs" in p for p in kr.compare_final(moved, finished, 4))

    cut = tmp_path / "cut"
    shutil.copytree(finished, cut)
    data = (cut / "checkpoint" / "optimizer.safetensors").read_bytes()
    (cut / "checkpoint" / "optimizer.safetensors").write_bytes(data[: len(data) // 2])
    summary = kr.Summary()
    kr.check_after_kill(cut, summary, "planted")
    assert summary.checkpoints_loaded == 0 and "checkpoint does not load" in summary.problems[0]


# ----------------------------------------------------------------------------- SIGINT / SIGTERM


def _interrupted_run(tiny, out: Path, sig: int) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Start a 50-step run saving only at the end, send `sig` once step 1 is logged."""
    argv = kr.command(tiny["model"], tiny["data"], tiny["adapter"], out, 50, "save_every=0")
    proc = subprocess.Popen(argv, cwd=REPO, env=kr.environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=600)  # a hang guard, not a speed requirement
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr), rows


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_finishes_the_step_saves_and_says_how_to_resume(tiny, tmp_path, sig, code):
    out = tmp_path / "out"
    p, rows = _interrupted_run(tiny, out, sig)
    assert p.returncode == code, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert any("resume=true" in line for line in p.stderr.splitlines() + p.stdout.splitlines()), p.stderr[-2000:]
    # the step in progress was finished and saved: the checkpoint holds every logged step
    assert 0 < len(rows) < 50 and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert kr.load_checkpoint(out / "checkpoint") == rows[-1]["step"]
    assert not list(out.glob("checkpoint.tmp-*")) and not (out / "adapter").exists()


# ----------------------------------------------------------------------------- same seed, same start


def test_same_seed_gives_the_same_adapter_init(tiny):
    import models
    from minitrain.config import TrainConfig
    from minitrain.run import attach_adapters
    from minitrain.weights import load_pretrained

    cfg = TrainConfig(model=str(tiny["model"]), seed=0, lora_r=4)
    inits = []
    for other in (1, 2):  # whatever ran before in the process
        torch.manual_seed(other)
        model = load_pretrained(tiny["model"], models.from_hf_config)
        attach_adapters(model, cfg)
        inits.append({n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n})
    assert all(torch.equal(inits[0][n], inits[1][n]) for n in inits[0])
