"""Distillation (recipes/distill_llama.py, `minitrain.objectives.distill`) on the 2026 families and the MoE ones.

The tiny checkpoints are the ones tests/test_qwen3_5.py, tests/test_gemma4.py and tests/test_moe.py save with
transformers (their session fixtures). Each pair (a Qwen3.5 student with a Qwen3.5 MoE teacher, a Gemma 4
student with a Gemma 4 teacher of another layout, a Qwen3-MoE student with a gpt-oss teacher) trains two steps
through the command with KD, CE, feature matching and attention transfer; and the objective's KD + CE on one
batch equals the definitions (tests/test_distill.py's `reference`) on transformers' own logits of both models.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from _tok import corpus, make_bpe_tokenizer
from safetensors.torch import load_file
from test_distill import ROWS, batch_of, reference
from test_gemma4 import g4  # noqa: F401  (session fixtures)
from test_moe import hub_checkpoint
from test_qwen3_5 import checkpoints  # noqa: F401

import models
from minitrain.objectives.distill import make_distill_objective
from minitrain.weights import load_pretrained

REPO = Path(__file__).resolve().parents[1]

# student, teacher: which fixture makes each folder; the attention layer must be one with attention
PAIRS = {
    "qwen3_5": (("qwen3_5", "dense"), ("qwen3_5", "moe")),
    "gemma4": (("gemma4", "dense"), ("gemma4", "e2b")),
    "qwen3_moe": (("moe", "qwen3_moe"), ("moe", "gpt_oss")),
}


@pytest.fixture(scope="module")
def folder(checkpoints, g4, hf_causal):  # noqa: F811
    """(fixture, name) -> the checkpoint's folder (saved by transformers)."""
    make = {"qwen3_5": checkpoints, "gemma4": g4, "moe": lambda name: hub_checkpoint(hf_causal, name)}
    return lambda which: make[which[0]](which[1])


@pytest.fixture(scope="module")
def with_tokenizer(folder, tmp_path_factory):
    """(fixture, name) -> a copy of the checkpoint with a BPE tokenizer (what a recipe reads), made once."""
    cache = {}

    def make(which):
        if which not in cache:
            cache[which] = tmp_path_factory.mktemp("_".join(which)) / "model"
            shutil.copytree(folder(which), cache[which])
            make_bpe_tokenizer(cache[which])
        return cache[which]

    return make


@pytest.mark.parametrize("pair", list(PAIRS))
def test_distillation_through_the_cli(with_tokenizer, pair, tmp_path, capsys):
    """Two steps of KD + CE + feature matching (every student layer) + attention transfer (the last layer): finite
    losses, every term logged, and the adapters moved (LoRA B starts at 0)."""
    from test_families_cli import run

    student, teacher = (with_tokenizer(w) for w in PAIRS[pair])
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(8, seed=3)))
    rows = run(capsys, "distill_llama.py", student, data, tmp_path / "out", teacher=teacher, top_k=16,
               feature_weight=0.1, attention_weight=0.1)
    for r in rows:
        for k in ("kd", "ce", "feature", "attention"):
            assert math.isfinite(r[k]) and r[k] > 0, (k, r)
        assert r["loss"] == pytest.approx(sum(r[f"{k}_weighted"] for k in ("kd", "ce", "feature", "attention")),
                                          rel=1e-5)
    adapter = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    b = [v for k, v in adapter.items() if "lora_B" in k]
    assert b and all(v.abs().sum() > 0 for v in b)


def hf_logits(folder: Path, batch: dict) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("pair", list(PAIRS))
def test_kd_and_ce_equal_the_definitions_on_transformers_logits(folder, pair):
    """The objective's loss on one padded batch (full-vocabulary KD at T=2, weighted with CE) equals the
    definitions computed from transformers' logits of the student and the teacher."""
    s_dir, t_dir = (folder(w) for w in PAIRS[pair])
    student = load_pretrained(s_dir, models.from_hf_config).train()
    teacher = load_pretrained(t_dir, models.from_hf_config)
    batch = batch_of(ROWS)
    obj = make_distill_objective(teacher, temperature=2.0, kd_weight=0.7, ce_weight=0.3, chunk=5)
    loss_sum, count, _ = obj(student, batch)
    y = F.pad(batch["labels"][:, 1:], (0, 1), value=-100).reshape(-1)
    keep = y != -100
    z, u = (hf_logits(d, batch).reshape(-1, 128)[keep] for d in (s_dir, t_dir))
    ce, kd = reference(z, y[keep], u, 2.0)
    assert int(count) == int(keep.sum())
    torch.testing.assert_close(loss_sum.double(), 0.7 * kd.sum() + 0.3 * ce.sum(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("keys,side,layer", [(dict(attention_layers=0), "student", 0),
                                              (dict(layer_map="3:1"), "teacher", 1)])
def test_attention_transfer_on_a_deltanet_layer_is_one_line(with_tokenizer, tmp_path, capsys, keys, side, layer):
    """A Gated DeltaNet layer has no attention probabilities: naming one (the student's, or the teacher's through
    layer_map) for attention transfer stops the run in one error line (exit 2), nothing written."""
    from minitrain.cli import run_cli

    student, teacher = (with_tokenizer(w) for w in PAIRS["qwen3_5"])
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(4, seed=3)))
    args = {"model": student, "teacher": teacher, "data": data, "out": tmp_path / "out", "max_steps": 1,
            "attention_weight": 0.1, **keys}
    assert run_cli([str(REPO / "recipes" / "distill_llama.py")] + [f"{k}={v}" for k, v in args.items()]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"error: attention_layers: {side} layer {layer} is a linear-attention (Gated DeltaNet) layer, which "
                   f"has no attention probabilities — transfer attention on the {side}'s attention layers (3: "
                   "attention_layers= / layer_map=) or set attention_weight=0")
    assert not (tmp_path / "out").exists()
