"""The seed run of issue 15 (field report 004's low-rank correction was on Qwen3-0.6B).

- a Qwen3-0.6B-shaped `config.json` (vocab 151936, tied head, q/k norms, head_dim 128 != hidden /
  heads) plans with `minitrain plan`: its parameters counted as transformers builds that config;
- its tiny random-weight sibling (the same particulars at toy sizes, saved by transformers, with a
  Qwen-shaped tokenizer) trains through `recipes/lrc.py` and `recipes/sft.py` and through their old
  names `recipes/lrc_llama.py` / `recipes/sft_llama.py`, which run the same code: equal losses.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tok import corpus, make_qwen_tokenizer

from minitrain.cli import run_cli
from minitrain.plan.predict import shape_from_hf

ROOT = Path(__file__).resolve().parents[1]
QWEN3_0_6B = json.loads((ROOT / "tests" / "fixtures" / "configs" / "Qwen3-0.6B" / "config.json").read_text())
# the sibling: tied, q/k norms, head_dim 32 != 64 / 4, GQA 2:1, intermediate 3 x hidden; vocab above
# the tokenizer's 305 ids, as Qwen's 151936 is above its tokenizer's 151669
TINY = dict(model_type="qwen3", vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
            max_position_embeddings=256, rope_theta=1000000.0)


def test_qwen3_0_6b_plans(tmp_path):
    import transformers

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**QWEN3_0_6B))
    assert shape_from_hf(QWEN3_0_6B).num_params() == sum(p.numel() for p in hf.parameters())  # 596,049,920
    for recipe in ("lrc.py", "sft.py"):
        out = subprocess.run([sys.executable, "-m", "minitrain", "plan", str(ROOT / "recipes" / recipe),
                              f"model={tmp_path}", "batch_size=1", "max_len=1024", "checkpointing=true",
                              "--gpu-mem", "12GiB"], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert out.returncode == 0, out.stderr
        assert "FITS in 12.00 GiB" in out.stdout and "151,936" in out.stdout and "(tied)" in out.stdout


@pytest.fixture(scope="module")
def sibling(hf_causal, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seed")
    model = root / "qwen3_tiny"
    shutil.copytree(hf_causal("seed_qwen3", **TINY), model)
    make_qwen_tokenizer(model)
    lines = corpus(24, seed=4)
    rows = [{"prompt": lines[2 * i], "completion": " " + lines[2 * i + 1]} for i in range(12)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": model, "data": root / "train.jsonl"}


def losses(capsys, recipe: str, sibling: dict, out: Path) -> list[float]:
    keys = {"model": sibling["model"], "data": sibling["data"], "eval_data": "", "out": out, "max_steps": 2,
            "batch_size": 2, "grad_accum": 1, "lora_r": 4, "lora_alpha": 8, "max_len": 64, "log_every": 1,
            "device": "cpu"}
    code = run_cli([str(ROOT / "recipes" / recipe)] + [f"{k}={v}" for k, v in keys.items()])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert set(saved) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("new, old", [("lrc.py", "lrc_llama.py"), ("sft.py", "sft_llama.py")])
def test_tiny_qwen3_trains_through_the_recipe_and_its_alias(sibling, tmp_path, capsys, new, old):
    if new == "lrc.py":
        pytest.importorskip("bitsandbytes")
    a = losses(capsys, new, sibling, tmp_path / "new")
    b = losses(capsys, old, sibling, tmp_path / "old")
    assert len(a) == 2 and all(math.isfinite(x) for x in a)
    assert a == b  # the alias runs the same recipe: same seed, same losses
