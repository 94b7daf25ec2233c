"""SIGINT / SIGTERM during training: the step in progress is finished, a checkpoint saved, and the
run stops with `Interrupted` (CLI: one line with the command that resumes, exit 130 / 143).

The signal is sent by the objective itself at a chosen micro-batch, so where it lands is exact;
the reference is the same run left alone. `tests/test_kill_resume.py` sends real signals to a
`python -m minitrain` process from outside; `tests/test_distributed.py` sends one to one rank.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import textwrap
from pathlib import Path

import pytest
import torch
from test_train import TinyLM, cfg_for, collate, freeze_embeddings, make_examples, quiet, rows, trainable_state
from test_resume import steady

from minitrain import checkpoint as ckpt
from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.cli import run_cli
from minitrain.objectives.sft import sft
from minitrain.schedule import resolve_steps
from minitrain.train import Interrupted, _SignalStop, train

EXAMPLES = make_examples(20, seed=5)


def lora_model() -> torch.nn.Module:
    model = freeze_embeddings(TinyLM())
    torch.manual_seed(1)
    cfg = LoRAConfig(r=4, alpha=8.0, dropout=0.2, targets=["q_proj", "v_proj", "up_proj"])  # dropout: RNG matters
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    return model


def signalling(sig: int, at_call: int):
    """`sft` that sends `sig` to this process at its `at_call`-th call (runs skip the audit, which
    calls the objective once or twice, so calls count micro-batches: 1, 2 are step 1's here)."""
    calls = [0]

    def objective(model, batch):
        calls[0] += 1
        if calls[0] == at_call:
            os.kill(os.getpid(), sig)
        return sft(model, batch)

    return objective


def config(tmp_path: Path, name: str, **kw):
    return cfg_for(tmp_path / name, batch_size=4, grad_accum=2, epochs=2.0, lr=1e-2, max_grad_norm=1.0,
                   skip_audit=True, **kw)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_mid_step_finishes_it_saves_and_resume_equals_the_run_left_alone(tmp_path, sig, code):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    ref = lora_model()
    ref_cfg = config(tmp_path, "ref")
    train(ref, sft, EXAMPLES, collate, ref_cfg, log=quiet)

    model, cfg = lora_model(), config(tmp_path, "cut")
    with pytest.raises(Interrupted) as e:  # calls 1, 2: step 1; 3 (signal), 4: step 2
        train(model, signalling(sig, at_call=3), EXAMPLES, collate, cfg, log=quiet)
    assert (e.value.step, e.value.exit_code, e.value.signum) == (2, code, sig)
    assert {s: signal.getsignal(s) for s in before} == before  # our handlers are gone again
    assert [r["step"] for r in rows(Path(cfg.out))] == [1, 2]
    assert ckpt.read_state(cfg.out)["step"] == 2 and not list(Path(cfg.out).glob("checkpoint.*"))
    assert "resume=true" in str(e.value) and str(Path(cfg.out) / "checkpoint") in str(e.value)

    resumed = lora_model()
    summary = train(resumed, sft, EXAMPLES, collate, dataclasses.replace(cfg, resume=True), log=quiet)
    assert summary["step"] == rows(Path(ref_cfg.out))[-1]["step"] > 2
    want, got = trainable_state(ref), trainable_state(resumed)
    assert all(torch.equal(got[k], want[k]) for k in want)  # bitwise: dropout RNG resumed too
    assert steady(rows(Path(cfg.out))) == steady(rows(Path(ref_cfg.out)))


def test_a_signal_in_the_last_step_still_stops_with_the_final_checkpoint(tmp_path):
    cfg = config(tmp_path, "last", max_steps=2)
    with pytest.raises(Interrupted) as e:
        train(lora_model(), signalling(signal.SIGTERM, at_call=4), EXAMPLES, collate, cfg, log=quiet)  # step 2
    assert e.value.step == 2 and ckpt.read_state(cfg.out)["step"] == 2
    summary = train(lora_model(), sft, EXAMPLES, collate, dataclasses.replace(cfg, resume=True), log=quiet)
    assert summary["step"] == 2 and [r["step"] for r in rows(Path(cfg.out))] == [1, 2]


def test_a_second_signal_a_second_later_stops_at_once_with_the_previous_handler():
    # Python's own handler before, as in a terminal: a suite started with `&` from a script
    # inherits SIGINT ignored, and the restored handler would then (rightly) ignore the repeat
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    stop = _SignalStop()
    stop.install()
    try:
        signal.raise_signal(signal.SIGINT)  # the first: remembered, nothing raised
        assert stop.seen() == (1, 0)
        signal.raise_signal(signal.SIGINT)  # a repeat within the second (torchrun forwarding): ignored
        stop.first_at -= 1.0  # as if a second had passed
        with pytest.raises(KeyboardInterrupt) as e:
            signal.raise_signal(signal.SIGINT)  # Python's own handler again: KeyboardInterrupt now
        assert not isinstance(e.value, Interrupted)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        stop.restore()
        signal.signal(signal.SIGINT, original)


RECIPE = """
import sys
sys.path[:0] = [{tests!r}]
from minitrain.config import TrainConfig
from minitrain.objectives.sft import sft
from minitrain.schedule import resolve_steps
from minitrain.train import train
from test_signals import EXAMPLES, collate, lora_model, signalling
import signal

config = TrainConfig(out={out!r}, batch_size=4, grad_accum=2, epochs=2.0, lr=1e-2, precision="fp32",
                     group_by_length=False, schedule="constant", skip_audit=True)

def run(config):
    objective = sft if config.resume else signalling(signal.SIGTERM, at_call=3)
    train(lora_model(), objective, EXAMPLES, collate, config)
"""


def test_cli_prints_the_command_that_resumes_and_exits_143(tmp_path, capsys):
    recipe = tmp_path / "r.py"
    out = tmp_path / "out"
    recipe.write_text(textwrap.dedent(RECIPE.format(tests=str(Path(__file__).parent), out=str(out))))
    assert run_cli([str(recipe), "seed=0", "overwrite=true"]) == 143
    err = capsys.readouterr().err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.startswith("stopped")]
    assert "Traceback" not in err and len(lines) == 1, err
    command = f"python -m minitrain {recipe} seed=0 resume=true"
    saved = out / "checkpoint"
    assert lines[0] == f"stopped at step 2 by SIGTERM; checkpoint saved in {saved} — resume with: {command}"
    assert run_cli(shlex.split(command)[3:]) == 0  # the printed command works
    total = resolve_steps(len(EXAMPLES), 4, 2, 2.0, -1, 0.0)[0]
    assert total > 2 and [r["step"] for r in rows(out)] == list(range(1, total + 1))
