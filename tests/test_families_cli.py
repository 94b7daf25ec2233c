"""Every new family through the CLI: `python -m minitrain recipes/sft_llama.py` and
`recipes/dpo_mistral.py` on a tiny random checkpoint saved by transformers (plus a tiny BPE
tokenizer), as `run_cli` (what `python -m minitrain` calls; in-process to keep the suite fast).
Then the SFT adapter the run saved loads through PEFT onto transformers' model and gives our
logits: the run trained the HF-named modules, Phi-3's fused ones included (the recipes' default
target list, written with LLaMA's names, adapts Phi-3's `qkv_proj` / `gate_up_proj`).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from _tok import corpus, make_bpe_tokenizer
from test_families import FAMILY_VARIANTS

from minitrain.cli import run_cli

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ["qwen2_window", "qwen3", "gemma2", "gemma3", "phi3"]
# what the recipes' default lists (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) adapt on Phi-3
PHI3_SFT_TARGETS = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family_data")
    lines = corpus(40, seed=3)
    sft = [{"prompt": lines[2 * i], "completion": " " + lines[2 * i + 1]} for i in range(8)]
    prefs = [{"prompt": lines[i], "chosen": " " + lines[i + 10], "rejected": " " + lines[i + 20]} for i in range(8)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    (root / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prefs))
    return {"sft": root / "sft.jsonl", "prefs": root / "prefs.jsonl"}


def model_folder(hf_causal, tmp_path: Path, name: str) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(hf_causal(f"fam_{name}", **FAMILY_VARIANTS[name]), folder)
    make_bpe_tokenizer(folder)
    return folder


def run(capsys, recipe: str, model: Path, data: Path, out: Path, **more) -> list[dict]:
    keys = {"model": model, "data": data, "eval_data": "", "out": out, "max_steps": 2, "batch_size": 2,
            "grad_accum": 1, "lora_r": 4, "lora_alpha": 8, "max_len": 64, "log_every": 1, **more}
    code = run_cli([str(REPO / "recipes" / recipe)] + [f"{k}={v}" for k, v in keys.items()])
    _, err = capsys.readouterr()
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    return rows


@pytest.mark.parametrize("name", FAMILIES)
def test_sft_and_dpo_cli_runs(hf_causal, tmp_path, capsys, data, name):
    peft = pytest.importorskip("peft")
    import transformers

    import models
    from minitrain.adapters.peft_format import load_adapter
    from minitrain.weights import load_pretrained

    model = model_folder(hf_causal, tmp_path, name)
    run(capsys, "sft_llama.py", model, data["sft"], tmp_path / "sft")
    run(capsys, "dpo_mistral.py", model, data["prefs"], tmp_path / "dpo")

    adapter = tmp_path / "sft" / "adapter"
    saved = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    if name.startswith("phi3"):
        assert set(saved) == PHI3_SFT_TARGETS
    ours = load_pretrained(model, models.from_hf_config).eval()
    load_adapter(ours, adapter)
    ref = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(model), adapter).eval()
    ids = torch.tensor([[1, 17, 42, 99, 5, 63, 2]])
    with torch.no_grad():
        got = ours.output_projection(ours(ids))
        want = ref(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_phi3_part_of_a_fused_linear_is_refused(hf_causal, tmp_path, capsys, data):
    """q_proj and v_proj without k_proj cannot be adapted on Phi-3's fused qkv_proj: one line, exit 2,
    before anything is written."""
    model = model_folder(hf_causal, tmp_path, "phi3")
    keys = {"model": model, "data": data["sft"], "eval_data": "", "out": tmp_path / "out", "max_steps": 1,
            "lora_targets": "q_proj,v_proj,o_proj"}
    code = run_cli([str(REPO / "recipes" / "sft_llama.py")] + [f"{k}={v}" for k, v in keys.items()])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == ("error: targets q_proj, v_proj: this model fuses q_proj, k_proj, v_proj into one linear "
                       "'qkv_proj', and an adapter on it adapts all of them — name qkv_proj (or all of q_proj, "
                       "k_proj, v_proj), or leave q_proj, v_proj out")
    assert not (tmp_path / "out").exists()
