"""Exact resume: a run killed mid-way and resumed ends bitwise equal to an uninterrupted one.

The killed run dies inside a step after its last checkpoint and after logging a later step,
so the resume must also cut metrics.jsonl back to the checkpoint and log the rest once.
Dropout is on, so the torch RNG state must come back too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from minitrain import checkpoint as ckpt
from minitrain.errors import UserError
from minitrain.objectives.sft import sft
from minitrain.train import train
from test_train import TinyLM, cfg_for, collate, freeze_embeddings, make_examples, quiet, rows


class Killed(Exception):
    pass


def killing(objective, after_calls: int):
    """The objective, dying on training call number `after_calls + 1` (a crash mid-window)."""
    calls = 0

    def obj(model, batch):
        nonlocal calls
        calls += model.training  # eval calls do not count
        if calls > after_calls:
            raise Killed
        return objective(model, batch)

    return obj


def model_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


TIMINGS = ("tokens_per_s", "flops_per_s", "mfu", "peak_mem_mb")  # wall-clock and process figures differ by nature


def steady(metric_rows: list[dict], also: tuple[str, ...] = ()) -> list[dict]:
    """metrics.jsonl rows without the figures that differ between two runs of the same steps."""
    return [{k: v for k, v in r.items() if k not in TIMINGS + also} for r in metric_rows]


def assert_same_weights(resumed, straight) -> None:
    want, got = model_state(straight), model_state(resumed)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.fixture(scope="module")
def setting():
    examples = make_examples(20, seed=21)
    evals = make_examples(5, seed=22)
    # 20 examples / batch 2 = 10 micro-batches per epoch, accum 2 -> 5 steps per epoch, 1.4 epochs -> 7
    kw = dict(batch_size=2, grad_accum=2, epochs=1.4, save_every=3, eval_every=2, lr=5e-3, warmup=2,
              schedule="cosine", weight_decay=0.1, max_grad_norm=1.0)
    return examples, evals, kw


def fresh_model():
    return freeze_embeddings(TinyLM(dropout=0.2, seed=3))


@pytest.mark.parametrize("checkpointing", [False, 1])  # 1: the first of TinyLM's two blocks checkpointed
def test_killed_and_resumed_run_is_bitwise_equal_to_an_uninterrupted_one(tmp_path, setting, checkpointing):
    examples, evals, kw = setting
    kw = {**kw, "checkpointing": checkpointing}
    cfg = cfg_for(tmp_path / "straight", **kw)
    straight = fresh_model()
    train(straight, sft, examples, collate, cfg, eval_examples=evals, log=quiet)
    after_straight = torch.rand(4)  # where the global RNG stands after the run
    want = rows(Path(cfg.out))
    assert [r["step"] for r in want] == list(range(1, 8))

    # killed during step 5's window: checkpoint at step 3, steps 1..4 already logged
    cfg_b = cfg_for(tmp_path / "killed", **kw)
    with pytest.raises(Killed):
        train(fresh_model(), killing(sft, 9), examples, collate, cfg_b, eval_examples=evals, log=quiet)
    assert json.loads((Path(cfg_b.out) / "checkpoint" / "state.json").read_text())["step"] == 3
    assert [r["step"] for r in rows(Path(cfg_b.out))] == [1, 2, 3, 4]

    torch.manual_seed(1234)  # a different RNG state before resuming: the checkpoint must restore it
    msgs: list[str] = []
    resumed = fresh_model()
    train(resumed, sft, examples, collate, dataclasses.replace(cfg_b, resume=True), eval_examples=evals,
          log=msgs.append)
    assert any("resumed" in m and "step 3/7" in m for m in msgs)
    got = rows(Path(cfg_b.out))
    assert [r["step"] for r in got] == list(range(1, 8))  # none missing, none twice
    assert steady(got) == steady(want)
    assert_same_weights(resumed, straight)
    assert torch.equal(torch.rand(4), after_straight)


@pytest.mark.parametrize("checkpointing", [False, 1])  # the same files whichever blocks are checkpointed
def test_checkpoint_is_safetensors_and_json_only(tmp_path, setting, checkpointing):
    examples, _, kw = setting
    cfg = cfg_for(tmp_path, **{**kw, "epochs": 0.4, "checkpointing": checkpointing})  # 2 steps
    model = fresh_model()
    train(model, sft, examples, collate, cfg, log=quiet)
    folder = Path(cfg.out) / "checkpoint"
    assert sorted(os.listdir(folder)) == ["optimizer.safetensors", "rng.safetensors", "state.json",
                                          "weights.safetensors"]
    assert not list(Path(cfg.out).glob("checkpoint.*"))  # no temporary or old folder left behind
    from safetensors.torch import load_file

    w, opt = load_file(folder / "weights.safetensors"), load_file(folder / "optimizer.safetensors")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(w) == trainable
    assert set(opt) == {f"{n}/{k}" for n in trainable for k in ("exp_avg", "exp_avg_sq")}
    state = json.loads((folder / "state.json").read_text())
    assert state["step"] == 2 and state["batcher"]["position"] == 4
    assert all(v["step"] == {"tensor": 2.0, "dtype": "float32"} for v in state["optimizer_scalars"].values())


def test_a_crash_between_the_renames_falls_back_to_the_old_checkpoint(tmp_path, setting):
    examples, _, kw = setting
    cfg = cfg_for(tmp_path, **{**kw, "epochs": 0.4})
    train(fresh_model(), sft, examples, collate, cfg, log=quiet)
    out = Path(cfg.out)
    os.replace(out / "checkpoint", out / "checkpoint.old-999")  # the new one never got renamed in
    (out / "checkpoint.tmp-999").mkdir()  # and a half-written temporary lies around
    assert ckpt.find(out) == out / "checkpoint.old-999"
    model = fresh_model()
    summary = train(model, sft, examples, collate, dataclasses.replace(cfg, resume=True), log=quiet)
    assert summary["step"] == 2


def test_resuming_with_other_settings_is_refused(tmp_path, setting):
    examples, _, kw = setting
    cfg = cfg_for(tmp_path, **{**kw, "epochs": 0.4})
    train(fresh_model(), sft, examples, collate, cfg, log=quiet)
    with pytest.raises(UserError, match="^resume: checkpoint was made with grad_accum=2"):
        train(fresh_model(), sft, examples, collate, dataclasses.replace(cfg, resume=True, grad_accum=1),
              log=quiet)
    with pytest.raises(UserError, match="different trainable tensors"):
        model = fresh_model()
        model.lm_head.weight.requires_grad_(False)
        train(model, sft, examples, collate, dataclasses.replace(cfg, resume=True), log=quiet)


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    cfg = cfg_for(tmp_path, resume=True, max_steps=1, batch_size=2)
    with pytest.raises(UserError, match="no checkpoint to resume from"):
        train(fresh_model(), sft, make_examples(4), collate, cfg, log=quiet)
    shutil.rmtree(tmp_path, ignore_errors=True)
