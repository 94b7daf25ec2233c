"""GRPO end to end from the command line (recipes/grpo_qwen.py on the committed demo/grpo/).

- the demo learns: held-out reward (greedy completions of unseen prompts) <= 0.2 before step 1 and
  >= 0.9 after 30 steps; the same run with the rewards shuffled within each batch stays <= 0.2;
- resume: a run stopped at step 2 and resumed samples the same completions and ends with the same
  metrics as the run straight through (the sampler's RNG is in the checkpoint);
- bad rewards: one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minitrain.cli import run_cli

ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "recipes" / "grpo_qwen.py")
DEMO = ROOT / "demo" / "grpo"

SHUFFLED = '''
import random
import sys

sys.path.insert(0, {root!r})
from recipes.grpo_qwen import last_digit

_rng = random.Random(0)


def shuffled(prompts, completions, answer, **kw):
    """last_digit's rewards, permuted within the batch: no longer tied to the completions."""
    values = last_digit(prompts, completions, answer)
    _rng.shuffle(values)
    return values
'''


def eval_rewards(out: Path) -> dict[int, float]:
    return {r["step"]: r["eval/reward"] for r in map(json.loads, (out / "eval.jsonl").read_text().splitlines())}


def test_demo_learns_and_shuffled_rewards_stay_flat(tmp_path, capsys):
    assert run_cli([RECIPE, f"out={tmp_path / 'real'}"]) == 0
    real = eval_rewards(tmp_path / "real")
    assert real[0] <= 0.2 and real[30] >= 0.9, real
    rows = [json.loads(x) for x in (tmp_path / "real" / "metrics.jsonl").read_text().splitlines()]
    for k in ("reward", "reward_std", "rewards/last_digit/mean", "frac_reward_zero_std", "completions/mean_length",
              "completions/clipped_ratio", "clip_ratio/region_mean", "entropy"):
        assert k in rows[-1], k
    assert (tmp_path / "real" / "completions.jsonl").is_file() and (tmp_path / "real" / "adapter").is_dir()

    (tmp_path / "shuffled.py").write_text(SHUFFLED.format(root=str(ROOT)))
    assert run_cli([RECIPE, f"out={tmp_path / 'control'}", "model=" + str(DEMO / "model"),
                    "data=" + str(DEMO / "train.jsonl"), "eval_data=" + str(DEMO / "eval.jsonl"),
                    f"rewards={tmp_path / 'shuffled.py'}:shuffled", "max_steps=30", "batch_size=8", "lr=2e-3",
                    "schedule=constant", "warmup=0", "max_len=48", "max_completion_length=16", "eval_every=10",
                    "lora_r=8", "lora_alpha=16", "checkpointing=false", "grad_accum=1"]) == 0
    control = eval_rewards(tmp_path / "control")
    assert max(control.values()) <= 0.2, control



BAD = '''
import math


def raises(prompts, completions, answer, **kw):
    out = []
    for c, a in zip(completions, answer):
        out.append(1.0 / (int(a) - 7))  # the rows whose answer is 7 divide by zero
    return out


def too_few(prompts, completions, **kw):
    return [0.0] * (len(completions) - 1)


def not_a_number(prompts, completions, **kw):
    return ["1"] * len(completions)


def nan(prompts, completions, **kw):
    return [math.nan] * len(completions)


def a_string(prompts, completions, **kw):
    return "1.0,0.0"


def never_applies(prompts, completions, **kw):
    return [None] * len(completions)
'''

SMALL = ["batch_size=2", "num_generations=2", "max_completion_length=4", "max_len=24",
         "lora_r=2", "lora_alpha=4", "checkpointing=false", "grad_accum=1", "log_completions_every=0"]


@pytest.mark.parametrize("spec, message", [
    ("{tmp}/missing.py:fn", r"missing\.py: no such file"),
    ("{tmp}/bad.py:absent", r"bad\.py: defines no function 'absent'"),
    ("absent", r"the recipe defines no reward function 'absent'"),
    ("{tmp}/bad.py:raises", r"bad\.py:8: reward raises raised ZeroDivisionError: .* on the completion of "
                            r".*train\.jsonl:\d+ — fix"),
    ("{tmp}/bad.py:too_few", r"bad\.py:\d+: reward too_few returned 1 values for 2 completions"),
    ("{tmp}/bad.py:not_a_number", r"reward not_a_number returned str '1' for the completion of .*train\.jsonl:\d+"),
    ("{tmp}/bad.py:nan", r"reward nan returned nan for the completion of .*train\.jsonl:\d+ — return a finite"),
    ("{tmp}/bad.py:a_string", r"bad\.py:\d+: reward a_string returned a str, not a list — return one float"),
    ("{tmp}/bad.py:never_applies", r"rewards: never_applies returned None for all \d+ completions of the batch of "
                                   r".*train\.jsonl:\d+.* — nothing to learn from"),
])
def test_bad_rewards_are_one_line_exit_2_nothing_written(tmp_path, capsys, spec, message):
    import re

    (tmp_path / "bad.py").write_text(BAD)
    rows = [json.loads(x) for x in (DEMO / "train.jsonl").read_text().splitlines()]
    sevens = [r for r in rows if r["answer"] == "7"][:2]  # the batch raises on any row: make it every row
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sevens))
    out = tmp_path / "out"
    code = run_cli([RECIPE, f"out={out}", f"model={DEMO / 'model'}", f"data={tmp_path / 'train.jsonl'}",
                    "rewards=" + spec.format(tmp=tmp_path), "max_steps=1", *SMALL])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]
    assert not out.exists()


KILLING = '''
import os
import sys

sys.path.insert(0, {root!r})
from recipes.grpo_qwen import last_digit

def killing(prompts, completions, answer, **kw):
    """last_digit, except that the first call after the run's first checkpoint dies (once: while the
    marker file exists)."""
    if os.path.exists({marker!r}) and os.path.isdir({checkpoint!r}):
        os.remove({marker!r})
        raise KeyboardInterrupt("killed")
    return last_digit(prompts, completions, answer)
'''


def test_resumed_run_samples_the_same_completions(tmp_path):
    """Killed in step 3's rollout (the first after the step-2 checkpoint), resumed from that checkpoint:
    steps 3 and 4 sample the same completions and log the same metrics as a run
    straight through, and the adapters are equal bit for bit."""
    marker = tmp_path / "kill-once"
    (tmp_path / "killing.py").write_text(KILLING.format(root=str(ROOT), marker=str(marker),
                                                         checkpoint=str(tmp_path / "resumed" / "checkpoint")))
    args = [f"model={DEMO / 'model'}", f"data={DEMO / 'train.jsonl'}", f"rewards={tmp_path / 'killing.py'}:killing",
            "max_steps=4", "save_every=2", "batch_size=4", "num_generations=4", "max_completion_length=16",
            "max_len=48", "lr=2e-3", "schedule=constant", "warmup=0", "lora_r=4", "lora_alpha=8",
            "checkpointing=false", "grad_accum=1", "log_completions_every=1"]
    assert run_cli([RECIPE, f"out={tmp_path / 'straight'}", *args]) == 0
    marker.touch()
    assert run_cli([RECIPE, f"out={tmp_path / 'resumed'}", *args]) == 130  # died in step 3: checkpoint at 2
    assert not marker.exists()
    assert run_cli([RECIPE, f"out={tmp_path / 'resumed'}", *args, "resume=true"]) == 0

    def logged(name, run):
        return [json.loads(x) for x in (tmp_path / run / name).read_text().splitlines()]

    straight, resumed = logged("completions.jsonl", "straight"), logged("completions.jsonl", "resumed")
    assert [r for r in resumed if r["step"] >= 3] == [r for r in straight if r["step"] >= 3] != []
    keys = ("loss", "reward", "grad_norm", "completions/mean_length", "entropy")
    m_straight, m_resumed = logged("metrics.jsonl", "straight"), logged("metrics.jsonl", "resumed")
    assert [[r[k] for k in keys] for r in m_resumed] == [[r[k] for k in keys] for r in m_straight]
    a, b = (load_file(tmp_path / run / "adapter" / "adapter_model.safetensors") for run in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_each_sample_the_completions_of_their_own_prompts(tmp_path):
    """torchrun, 2 ranks (gloo): each rank takes its share of every batch of prompts (the loop's
    `idx[rank::world]`) and samples all G completions of each of them, so a group never spans ranks:
    rank 0's logged groups are G rows of one prompt each, all from its own share of step 1's batch."""
    import os
    import subprocess
    import sys

    from minitrain.data.batcher import Batcher
    from minitrain.data.readers import read_prompts
    from minitrain.text.tokenizer import Tokenizer

    out, G = tmp_path / "ddp", 3
    args = [f"model={DEMO / 'model'}", f"data={DEMO / 'train.jsonl'}", "rewards=last_digit", "max_steps=1",
            "batch_size=4", f"num_generations={G}", "max_completion_length=8", "max_len=40", "lora_r=2",
            "lora_alpha=4", "checkpointing=false", "grad_accum=1", "log_completions_every=1", f"out={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "minitrain",
                        RECIPE, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "checkpoint" / "rng.rank1.safetensors").is_file()  # rank 1's sampler RNG is kept too
    examples = read_prompts(DEMO / "train.jsonl", Tokenizer.from_folder(DEMO / "model"), max_len=32)
    first = next(iter(Batcher([len(ex["prompt_ids"]) for ex in examples], 4, seed=0, shuffle=True,
                              group_by_length=True)))  # as the loop orders them (seed 0: the default)
    mine = {examples[i]["row"] for i in first[0::2]}
    logged = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    groups = [logged[i : i + G] for i in range(0, len(logged), G)]
    assert len(groups) == 2 and all(len({r["row"] for r in g}) == 1 for g in groups)
    assert {g[0]["row"] for g in groups} == mine


def test_equal_rewards_everywhere_are_said_once_and_wrong_weights_are_refused(tmp_path, capsys):
    """Every group's rewards equal for 10 rollouts in a row: one warning, once, saying what to change.
    reward_weights of the wrong length: one line, exit 2, nothing written."""
    (tmp_path / "flat.py").write_text("def flat(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    args = [RECIPE, f"model={DEMO / 'model'}", f"data={DEMO / 'train.jsonl'}", *SMALL]
    assert run_cli([*args, f"out={tmp_path / 'flat'}", f"rewards={tmp_path / 'flat.py'}:flat", "max_steps=12"]) == 0
    out = capsys.readouterr().out
    assert out.count("every advantage is 0 and nothing is learned") == 1
    assert "give partial credit in the reward, raise num_generations or temperature" in out
    assert run_cli([*args, f"out={tmp_path / 'weights'}", "rewards=last_digit", "reward_weights=1,2",
                    "max_steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reward_weights: 2 weights for 1 reward functions (last_digit)" in err[0], err
    assert not (tmp_path / "weights").exists()


def test_num_iterations_reuses_each_rollout_for_that_many_steps(tmp_path):
    """num_iterations=2: steps 1 and 2 train on the same completions (step 2 with the old log-probs of
    step 1's policy, so its ratios move off 1), step 3 samples new ones."""
    out = tmp_path / "it2"
    (tmp_path / "digit.py").write_text(  # a reward that differs within groups: the last digit written
        "def digit(prompts, completions, **kw):\n"
        "    return [float(next((ch for ch in reversed(c) if ch.isdigit()), 0)) for c in completions]\n")
    assert run_cli([RECIPE, f"model={DEMO / 'model'}", f"data={DEMO / 'train.jsonl'}",
                    f"rewards={tmp_path / 'digit.py'}:digit",
                    *SMALL[:-1], "log_completions_every=1", "max_steps=3", "lr=5e-2",
                    "num_iterations=2", f"out={out}"]) == 0
    logged = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in logged}) == [1, 3]  # a rollout is logged at the step that sampled it
    m = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    same = ("reward", "reward_std", "completions/mean_length", "frac_reward_zero_std")
    assert [m[1][k] for k in same] == [m[0][k] for k in same]  # step 2: step 1's completions and rewards
    assert m[1]["loss"] != m[0]["loss"]  # ... under the moved policy: ratios off 1 (old log-probs kept)


VARIED = "def varied(prompts, completions, **kw):\n    return [float(sum(map(ord, c)) % 5) for c in completions]\n"


@pytest.mark.parametrize("setting", ["quantize=nf4", "finetune=full", "compile=true"])
def test_trains_with_qlora_full_finetuning_and_compile(tmp_path, capsys, monkeypatch, setting):
    """Two steps of GRPO on the demo model with an nf4 base (bitsandbytes' CPU kernels), with every
    weight training (finetune=full), and with compiled blocks: the audit passes before step 1, the
    losses are finite, the gradients are not zero and what trains has moved.

    compile: inductor builds C++ kernels for about a minute of CPU here (2 steps: 57 CPU-s, 154 s wall on
    the loaded 2-core machine), too long for a unit test, so the blocks are compiled with dynamo's
    `aot_eager` backend (the same graph capture, recompiles and AOT autograd, no code generation); its
    losses and gradient norms equal those of the same run without compile."""
    from minitrain import train as train_module

    (tmp_path / "varied.py").write_text(VARIED)
    args = [RECIPE, f"model={DEMO / 'model'}", f"data={DEMO / 'train.jsonl'}",
            f"rewards={tmp_path / 'varied.py'}:varied", *[a for a in SMALL if not a.startswith("num_generations=")], "num_generations=4", "max_steps=2", "warmup=0", "lr=5e-2", "log_every=1", setting]
    if setting == "compile=true":
        compile_blocks = train_module.compile_blocks
        monkeypatch.setattr(train_module, "compile_blocks", lambda model: compile_blocks(model, backend="aot_eager"))
        monkeypatch.setattr(train_module, "cpu_compiler", lambda: "c++")
    out = tmp_path / "run"
    assert run_cli([*args, f"out={out}"]) == 0
    said = capsys.readouterr().out
    assert "audit: healthy" in said
    assert {"quantize=nf4": "base in nf4", "finetune=full": "trainable: 308,448 of 308,448",
            "compile=true": "torch.compile on 3 blocks"}[setting] in said, said
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[0]["frac_reward_zero_std"] < 1 and all(r["grad_norm"] > 0 for r in rows)
    if setting == "finetune=full":
        before = load_file(DEMO / "model" / "model.safetensors")
        after = load_file(out / "model" / "model.safetensors")
        assert before.keys() == after.keys() and all(torch.isfinite(v.float()).all() for v in after.values())
        assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2
    else:
        adapter = load_file(out / "adapter" / "adapter_model.safetensors")
        b = [v for k, v in adapter.items() if "lora_B" in k]
        assert b and all(torch.isfinite(v).all() for v in adapter.values())
        assert all(v.abs().sum() > 0 for v in b)  # every B left its zero start
    if setting == "compile=true":
        monkeypatch.undo()
        assert run_cli([*args[:-1], f"out={tmp_path / 'eager'}"]) == 0
        eager = [json.loads(x) for x in (tmp_path / "eager" / "metrics.jsonl").read_text().splitlines()]
        for k in ("loss", "grad_norm", "reward", "entropy"):
            assert [r[k] for r in rows] == pytest.approx([r[k] for r in eager], rel=1e-5, abs=1e-6), k
