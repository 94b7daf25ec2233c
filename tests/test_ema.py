"""`ema_decay`: the moving average of the trained tensors (minitrain.ema).

- After each optimizer step ema = d * ema + (1 - d) * w from the weights before step 1: checked in
  float64 by hand against the weights each step left (recorded by an optimizer post-hook);
- evaluations use it (eval/loss is the generic held-out pass of the EMA weights, computed here
  on a copy) and the trained weights come back exactly after each evaluation;
- a run killed mid-way and resumed equals the uninterrupted one bitwise, the EMA included;
- the recipes save it beside the adapter (`adapter_ema/`, PEFT format) or the model
  (`model_ema/`, HF format), holding the checkpoint's average.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from _tok import make_bpe_tokenizer
from safetensors.torch import load_file
from test_resume import Killed, assert_same_weights, killing, model_state, steady
from test_train import TinyLM, cfg_for, collate, make_examples, quiet, rows

from minitrain.cli import run_cli
from minitrain.objectives.sft import sft
from minitrain.train import build_optimizer, evaluate, train

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "bad_inputs" / "data" / "good.jsonl"
TRAIN, EVAL = make_examples(20, seed=31), make_examples(5, seed=32)
KW = dict(batch_size=2, grad_accum=2, epochs=1.4, save_every=3, eval_every=2, lr=5e-3, warmup=2,
          schedule="cosine", weight_decay=0.1, max_grad_norm=1.0, ema_decay=0.7)  # 7 steps


def test_ema_is_the_formula_and_evaluations_use_it(tmp_path):
    model = TinyLM(dropout=0.0, seed=5)  # every tensor trains (full fine-tuning)
    start = model_state(model)
    named = list(model.named_parameters())
    optimizer = build_optimizer(named, KW["weight_decay"], KW["lr"])
    after: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_post_hook(lambda *_: after.append(model_state(model)))
    cfg = cfg_for(tmp_path, **KW)
    msgs: list[str] = []
    summary = train(model, sft, TRAIN, collate, cfg, eval_examples=EVAL, optimizer=optimizer, log=msgs.append)
    assert len(after) == 7 and any("(EMA weights)" in m for m in msgs)

    d = KW["ema_decay"]
    want = {k: v.double() for k, v in start.items()}
    for w in after:
        want = {k: d * want[k] + (1 - d) * w[k].double() for k in want}
    got = load_file(Path(cfg.out) / "checkpoint" / "ema.safetensors")
    assert set(got) == set(want)
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-6
    assert max(float((want[k] - after[-1][k]).abs().max()) for k in want) > 1e-3  # the EMA is not the weights

    for k, v in model_state(model).items():  # the trained weights came back after each evaluation
        assert torch.equal(v, after[-1][k]), k
    averaged = copy.deepcopy(model)
    averaged.load_state_dict(got)
    expected = evaluate(averaged, sft, EVAL, collate, KW["batch_size"])
    assert summary["eval/loss"] == pytest.approx(expected["eval/loss"], rel=1e-6)
    assert rows(Path(cfg.out))[-1]["eval/loss"] == summary["eval/loss"]


def test_killed_and_resumed_run_keeps_the_ema_bitwise(tmp_path):
    def fresh():
        return TinyLM(dropout=0.2, seed=3)

    cfg = cfg_for(tmp_path / "straight", **KW)
    straight = fresh()
    train(straight, sft, TRAIN, collate, cfg, eval_examples=EVAL, log=quiet)
    cfg_b = cfg_for(tmp_path / "killed", **KW)
    with pytest.raises(Killed):  # during step 5's window: the checkpoint is at step 3
        train(fresh(), killing(sft, 9), TRAIN, collate, cfg_b, eval_examples=EVAL, log=quiet)
    resumed = fresh()
    train(resumed, sft, TRAIN, collate, dataclasses.replace(cfg_b, resume=True), eval_examples=EVAL, log=quiet)

    assert steady(rows(Path(cfg_b.out))) == steady(rows(Path(cfg.out)))
    assert_same_weights(resumed, straight)
    a = load_file(Path(cfg.out) / "checkpoint" / "ema.safetensors")
    b = load_file(Path(cfg_b.out) / "checkpoint" / "ema.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_with_another_ema_decay_is_refused(tmp_path):
    cfg = cfg_for(tmp_path, **{**KW, "epochs": 0.4})
    train(TinyLM(), sft, TRAIN, collate, cfg, log=quiet)
    from minitrain.errors import UserError

    with pytest.raises(UserError, match="checkpoint was made with ema_decay=0.7, this run has ema_decay=0.9"):
        train(TinyLM(), sft, TRAIN, collate, dataclasses.replace(cfg, resume=True, ema_decay=0.9), log=quiet)


@pytest.fixture(scope="module")
def model_dir(hf_causal, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ema") / "model"
    shutil.copytree(hf_causal("ema_llama"), d)
    make_bpe_tokenizer(d)
    return d


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_recipe_saves_the_ema_beside_the_adapter_or_model(model_dir, tmp_path, capsys, finetune):
    out = tmp_path / "run"
    keys = dict(model=model_dir, data=DATA, eval_data=DATA, out=out, max_steps=3, batch_size=2, grad_accum=1,
                lr=1e-2, chat_format="mistral", device="cpu", lora_r=4, finetune=finetune, ema_decay=0.5)
    assert run_cli([str(REPO / "recipes" / "sft_llama.py")] + [f"{k}={v}" for k, v in keys.items()]) == 0, \
        capsys.readouterr().err
    log = capsys.readouterr().out
    assert "step 3 (EMA weights): eval/loss" in log
    ema = load_file(out / "checkpoint" / "ema.safetensors")
    if finetune == "lora":  # PEFT keys: base_model.model.<module>.lora_A.weight
        saved = load_file(out / "adapter_ema" / "adapter_model.safetensors")
        saved = {k.removeprefix("base_model.model."): v for k, v in saved.items()}
        trained = load_file(out / "adapter" / "adapter_model.safetensors")
    else:
        saved = load_file(out / "model_ema" / "model.safetensors")
        trained = load_file(out / "model" / "model.safetensors")
        assert (out / "model_ema" / "config.json").is_file() and (out / "model_ema" / "tokenizer.json").is_file()
    assert set(saved) == set(ema) and all(torch.equal(saved[k], ema[k]) for k in ema)
    assert any(not torch.equal(v, saved[k.removeprefix("base_model.model.")]) for k, v in trained.items())
