"""`eval_only=true` on every recipe, and the evaluation before step 1 (SFT, seq2seq).

Each recipe runs in-process on a tiny checkpoint saved by transformers. The figures are checked
against references: SFT's held-out loss against transformers' own cross-entropy on the same token
ids; DPO's at the base against the formula (the reference is the policy: loss log 2, rewards 0);
a trained adapter evaluated with `init_adapter` against the last evaluation of the run that trained
it; distillation's eval loss (the student's CE) against SFT's on the same model and rows.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from _tok import corpus, make_bpe_tokenizer

from minitrain.cli import run_cli

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tiny(hf_causal, tmp_path_factory) -> dict[str, Path]:
    """A tiny LLaMA + BPE tokenizer, SFT / preference / unpaired rows (train and eval)."""
    root = tmp_path_factory.mktemp("eval_only")
    model = root / "model"
    shutil.copytree(hf_causal("eval_only_llama"), model)
    make_bpe_tokenizer(model)
    lines = corpus(40, seed=3)

    def write(name: str, rows: list[dict]) -> Path:
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return root / name

    sft = [{"prompt": a, "completion": " " + b} for a, b in zip(lines[0::2], lines[1::2])]
    prefs = [{"prompt": a, "chosen": " " + b, "rejected": " " + c} for a, b, c in zip(lines, lines[7:], lines[13:])]
    kto = [{"prompt": a, "completion": " " + b, "label": i % 2 == 0} for i, (a, b) in enumerate(zip(lines, lines[5:]))]
    return {"root": root, "model": model,
            "sft": write("sft.jsonl", sft[:14]), "sft_eval": write("sft_eval.jsonl", sft[14:]),
            "prefs": write("prefs.jsonl", prefs[:16]), "prefs_eval": write("prefs_eval.jsonl", prefs[16:24]),
            "kto": write("kto.jsonl", kto[:16]), "kto_eval": write("kto_eval.jsonl", kto[16:24])}


def cli(capsys, recipe: str, **keys) -> tuple[int, str, str]:
    capsys.readouterr()
    base = {"batch_size": 4, "grad_accum": 1, "lora_r": 4, "lora_alpha": 8, "device": "cpu", "precision": "fp32",
            "checkpointing": "false"}
    code = run_cli([str(RECIPES / recipe), *[f"{k}={v}" for k, v in {**base, **keys}.items()]])
    out, err = capsys.readouterr()
    return code, out, err


def only_eval_written(out: Path) -> dict:
    """What an eval_only run leaves: config.json and one eval.jsonl row at step 0; nothing trained."""
    assert sorted(p.name for p in out.iterdir() if p.name != "predictions") == ["config.json", "eval.jsonl"]
    rows = rows_of(out / "eval.jsonl")
    assert len(rows) == 1 and rows[0]["step"] == 0
    return rows[0]


def hf_eval_loss(model_dir: Path, data: Path) -> float:
    """transformers' mean token CE over the held-out rows, on the token ids our reader makes."""
    import transformers

    from minitrain.data.readers import read_sft
    from minitrain.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(model_dir)
    examples = read_sft(str(data), tok, max_len=1024, truncation_side="left")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex["input_ids"]])
            labels = torch.tensor([ex["labels"]])
            logits = hf(ids).logits[0, :-1].float()
            target = labels[0, 1:]
            keep = target != -100
            total += torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum").item()
            count += int(keep.sum())
    return total / count


def test_sft_eval_only_equals_transformers_then_step0_then_init_adapter(capsys, tiny, tmp_path):
    base_out = tmp_path / "base"
    code, out, err = cli(capsys, "sft_llama.py", model=tiny["model"], data=tiny["sft"], eval_data=tiny["sft_eval"],
                         out=base_out, eval_only="true")
    assert code == 0, err
    row = only_eval_written(base_out)
    assert "nothing is trained" in out
    ref = hf_eval_loss(tiny["model"], tiny["sft_eval"])
    assert row["eval/loss"] == pytest.approx(ref, rel=1e-5)
    assert row["eval/ppl"] == pytest.approx(math.exp(ref), rel=1e-5)

    # a training run evaluates at step 0 (the same base) and at its end
    run = tmp_path / "run"
    code, out, err = cli(capsys, "sft_llama.py", model=tiny["model"], data=tiny["sft"], eval_data=tiny["sft_eval"],
                         out=run, max_steps=3, lr=5e-3)
    assert code == 0, err
    rows = rows_of(run / "eval.jsonl")
    assert [r["step"] for r in rows] == [0, 3]
    assert rows[0]["eval/loss"] == pytest.approx(row["eval/loss"], rel=1e-6)
    assert rows[1]["eval/loss"] != pytest.approx(rows[0]["eval/loss"], rel=1e-4)  # the adapter did train
    last = [r for r in rows_of(run / "metrics.jsonl") if "eval/loss" in r][-1]
    assert last["eval/loss"] == rows[1]["eval/loss"]

    # the trained adapter, evaluated without training, gives that run's last evaluation
    again = tmp_path / "again"
    code, out, err = cli(capsys, "sft_llama.py", model=tiny["model"], data=tiny["sft"], eval_data=tiny["sft_eval"],
                         out=again, eval_only="true", init_adapter=run / "adapter")
    assert code == 0, err
    assert only_eval_written(again)["eval/loss"] == pytest.approx(rows[1]["eval/loss"], rel=1e-5)


def test_dpo_eval_only_at_the_base_is_log2_with_zero_rewards(capsys, tiny, tmp_path):
    out = tmp_path / "dpo"
    code, _, err = cli(capsys, "dpo_mistral.py", model=tiny["model"], data=tiny["prefs"],
                       eval_data=tiny["prefs_eval"], out=out, eval_only="true", chat_format="mistral")
    assert code == 0, err
    row = only_eval_written(out)
    assert row["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)  # -logsigmoid(beta * 0)
    assert row["eval/rewards/chosen"] == pytest.approx(0, abs=1e-6)
    assert row["eval/rewards/margins"] == pytest.approx(0, abs=1e-6)


def test_kto_eval_only_writes_its_reward_metrics(capsys, tiny, tmp_path):
    out = tmp_path / "kto"
    code, _, err = cli(capsys, "kto_mistral.py", model=tiny["model"], data=tiny["kto"], eval_data=tiny["kto_eval"],
                       out=out, eval_only="true", chat_format="mistral")
    assert code == 0, err
    row = only_eval_written(out)
    assert math.isfinite(row["eval/loss"])
    rewards = [k for k in row if k.startswith("eval/rewards/")]
    assert rewards and all(row[k] == pytest.approx(0, abs=1e-6) for k in rewards)  # policy == reference


def test_distill_eval_only_is_the_students_ce(capsys, tiny, tmp_path):
    out = tmp_path / "distill"
    code, _, err = cli(capsys, "distill_llama.py", model=tiny["model"], teacher=tiny["model"], data=tiny["sft"],
                       eval_data=tiny["sft_eval"], out=out, eval_only="true")
    assert code == 0, err
    row = only_eval_written(out)
    assert row["eval/loss"] == pytest.approx(hf_eval_loss(tiny["model"], tiny["sft_eval"]), rel=1e-5)


def test_ard_and_lrc_eval_only(capsys, tiny, tmp_path):
    code, _, err = cli(capsys, "ard_lora_llama.py", model=tiny["model"], data=tiny["sft"], eval_data=tiny["sft_eval"],
                       out=tmp_path / "ard", eval_only="true", quantize="none")
    assert code == 0, err
    row = only_eval_written(tmp_path / "ard")
    assert {"eval/loss", "eval/acc", "eval/nll", "eval/ece"} <= set(row)
    code, _, err = cli(capsys, "lrc_llama.py", model=tiny["model"], data=tiny["sft"], eval_data=tiny["sft_eval"],
                       out=tmp_path / "lrc", eval_only="true", quantize="ternary")
    assert code == 0, err
    assert math.isfinite(only_eval_written(tmp_path / "lrc")["eval/loss"])


def test_seq2seq_eval_only_and_step0(capsys, tmp_path):
    from test_lora_t5 import save_tiny_t5, write_rows

    lines = corpus(24, seed=5)
    model = save_tiny_t5(tmp_path / "t5")
    data, evals = write_rows(tmp_path / "train.jsonl", lines[:16]), write_rows(tmp_path / "val.jsonl", lines[16:])
    keys = {"model": model, "data": data, "eval_data": evals, "max_new_tokens": 4,
            "fields": '{"prompt": "question", "completion": "answer"}', "added_tokens": '["[Question]"]'}
    code, _, err = cli(capsys, "lora_t5.py", out=tmp_path / "only", eval_only="true", **keys)
    assert code == 0, err
    row = only_eval_written(tmp_path / "only")
    assert {"eval/loss", "eval/ppl", "eval/rouge1", "eval/rougeL"} <= set(row)
    assert (tmp_path / "only" / "predictions" / "step_0000000.jsonl").is_file()
    code, _, err = cli(capsys, "lora_t5.py", out=tmp_path / "run", max_steps=2, eval_every=2, **keys)
    assert code == 0, err
    rows = rows_of(tmp_path / "run" / "eval.jsonl")
    assert [r["step"] for r in rows] == [0, 2]
    for k in ("eval/loss", "eval/rougeL"):
        assert rows[0][k] == pytest.approx(row[k], rel=1e-6)


@pytest.mark.parametrize("extra, needle", [
    ({}, "eval_only=true: no held-out data"),
    ({"eval_data": "E", "resume": "true"}, "nothing to resume"),
])
def test_eval_only_refusals_are_one_line(capsys, tiny, tmp_path, extra, needle):
    extra = {k: (tiny["sft_eval"] if v == "E" else v) for k, v in extra.items()}
    code, _, err = cli(capsys, "sft_llama.py", model=tiny["model"], data=tiny["sft"], out=tmp_path / "o",
                       eval_only="true", **extra)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "o").exists()


def test_eval_only_refuses_a_training_runs_folder(capsys, tiny, tmp_path):
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    code, _, err = cli(capsys, "sft_llama.py", model=tiny["model"], data=tiny["sft"], eval_data=tiny["sft_eval"],
                       out=run, eval_only="true", overwrite="true")
    assert code == 2 and "holds a training run" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in run.iterdir()) == ["adapter", "config.json"]
