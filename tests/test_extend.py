"""Extending a finished run (issue 14, item 8): `resume=true extend=true max_steps=N`.

The rule: steps after the checkpoint take the LR that a schedule planned for the new total gives
them (checked against the cosine formula written out here), the rule is printed before they run,
and a crash + resume inside the extension ends bitwise equal to running the extension through.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import pytest
import torch

from minitrain.config import TrainConfig, validate
from minitrain.errors import UserError
from minitrain.objectives.sft import sft
from minitrain.train import train
from test_resume import Killed, assert_same_weights, fresh_model, killing, steady
from test_train import cfg_for, collate, make_examples, quiet, rows

KW = dict(batch_size=2, grad_accum=2, max_steps=6, lr=5e-3, warmup=0.5, schedule="cosine", min_lr_ratio=0.1,
          weight_decay=0.1, max_grad_norm=1.0, save_every=1)


def cosine(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """Linear warmup to `peak`, then a half cosine from peak towards `floor * peak` (schedule.py's doc)."""
    if step <= warmup:
        return peak * step / warmup
    p = (step - warmup - 1) / (total - warmup)
    return peak * floor + (peak - peak * floor) * (1 + math.cos(math.pi * p)) / 2


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 6-step run (warmup 0.5 -> 3 steps) with its checkpoint at step 6."""
    examples = make_examples(16, seed=5)
    cfg = cfg_for(tmp_path_factory.mktemp("finished"), **KW)
    model = fresh_model()
    train(model, sft, examples, collate, cfg, log=quiet)
    return examples, cfg


def copy_run(cfg: TrainConfig, to: Path) -> TrainConfig:
    shutil.copytree(cfg.out, to)
    return dataclasses.replace(cfg, out=str(to))


def test_a_finished_run_is_refused_a_new_length_without_extend(finished, tmp_path):
    examples, cfg = finished
    cfg = copy_run(cfg, tmp_path / "run")
    with pytest.raises(UserError) as e:
        train(fresh_model(), sft, examples, collate, dataclasses.replace(cfg, resume=True, max_steps=10), log=quiet)
    assert str(e.value).startswith("resume: checkpoint was made with max_steps=6, this run has max_steps=10")
    assert "extend=true" in str(e.value)
    with pytest.raises(UserError, match=r"^extend=true: the checkpoint is at step 6 and this run has 6"):
        train(fresh_model(), sft, examples, collate, dataclasses.replace(cfg, resume=True, extend=True), log=quiet)
    with pytest.raises(UserError, match="^extend=true: extends a saved run — pass resume=true"):
        validate(dataclasses.replace(cfg, extend=True))
    with pytest.raises(UserError, match="^resume: checkpoint was made with grad_accum=2"):  # only the length may change
        train(fresh_model(), sft, examples, collate,
              dataclasses.replace(cfg, resume=True, extend=True, max_steps=10, grad_accum=1), log=quiet)


def test_extension_steps_take_the_lr_of_the_new_totals_schedule_and_the_rule_is_printed(finished, tmp_path):
    examples, cfg = finished
    cfg = copy_run(cfg, tmp_path / "run")
    before = rows(Path(cfg.out))
    said: list[str] = []
    summary = train(fresh_model(), sft, examples, collate, dataclasses.replace(cfg, resume=True, extend=True,
                                                                               max_steps=10), log=said.append)
    assert summary["step"] == 10 and summary["total_steps"] == 10
    rule = [m for m in said if m.startswith("extend: ")]
    assert rule == ["extend: the run of 6 steps continues from step 6 to 10; steps 7..10 take the LR a 10-step "
                    f"cosine schedule (warmup 5) gives them: {cosine(7, 10, 5, 5e-3, 0.1):.3g} at step 7 -> "
                    f"{cosine(10, 10, 5, 5e-3, 0.1):.3g} at step 10"]
    assert said.index(rule[0]) < len(said)  # printed before the steps (the loop logs nothing per step here)
    after = rows(Path(cfg.out))
    assert after[:6] == before  # the finished run's steps are untouched
    assert [r["step"] for r in after] == list(range(1, 11))
    for r in after[6:]:
        assert r["lr"] == pytest.approx(cosine(r["step"], 10, 5, 5e-3, 0.1), rel=1e-12), r["step"]


def test_a_crash_and_resume_inside_the_extension_is_bitwise_equal_to_running_it_through(finished, tmp_path):
    examples, cfg = finished
    through_cfg = dataclasses.replace(copy_run(cfg, tmp_path / "through"), resume=True, extend=True, max_steps=12)
    through = fresh_model()
    train(through, sft, examples, collate, through_cfg, log=quiet)
    after_through = torch.rand(4)
    want = rows(Path(through_cfg.out))

    crash_cfg = dataclasses.replace(copy_run(cfg, tmp_path / "crash"), resume=True, extend=True, max_steps=12)
    with pytest.raises(Killed):  # dies in step 10's window: checkpoint at step 9 (save_every=1)
        train(fresh_model(), killing(sft, 3 * 2 + 1), examples, collate, crash_cfg, log=quiet)
    torch.manual_seed(99)  # the resume must restore the RNG itself
    resumed = fresh_model()
    said: list[str] = []
    train(resumed, sft, examples, collate, crash_cfg, log=said.append)  # the same command again
    assert any("at step 9/12" in m for m in said)
    got = rows(Path(crash_cfg.out))
    assert steady(got, also=("planned_peak_mb",)) == steady(want, also=("planned_peak_mb",))  # (memory varies)
    assert_same_weights(resumed, through)
    assert torch.equal(torch.rand(4), after_through)
