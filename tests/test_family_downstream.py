"""Everything downstream of loading, per family (issue 15): QLoRA nf4 / int8 trains a step through
the SFT recipe, and on Gemma 2 and Phi-3 our QLoRA model equals transformers + bitsandbytes + PEFT
on the same quantized weights (logits and the adapters' gradients); `minitrain merge` gives a
folder whose logits (ours and transformers') equal the adapter model's; the gradient-path audit
is healthy; and 2 DDP ranks over gloo (`python -m torch.distributed.run`) equal one process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_families import family_checkpoint, load_hf
from test_families_cli import data, model_folder  # noqa: F401  (data: a fixture)

import models
from minitrain.adapters.lora import LoRAConfig, apply_lora
from minitrain.adapters.peft_format import save_adapter
from minitrain.cli import run_cli
from minitrain.weights import load_pretrained

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ["qwen2_window", "qwen3", "gemma2", "gemma3", "phi3"]
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # Phi-3: its fused two
IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 17, 40], [1, 100, 3, 3, 8, 64, 127, 11]])


def sft_args(model: Path, data_file: Path, out: Path, **more) -> list[str]:
    keys = {"model": model, "data": data_file, "eval_data": "", "out": out, "max_steps": 2, "batch_size": 2,
            "grad_accum": 1, "lora_r": 4, "lora_alpha": 8, "max_len": 64, "log_every": 1, "device": "cpu",
            "precision": "fp32", "warmup": 0, **more}
    return [str(REPO / "recipes" / "sft.py")] + [f"{k}={v}" for k, v in keys.items()]


def random_adapter(model: torch.nn.Module, seed: int = 1) -> LoRAConfig:
    """LoRA on every linear with random A and B (B is zero at init: the adapter would be a no-op)."""
    cfg = LoRAConfig(r=4, alpha=8, targets=ALL)
    apply_lora(model, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.1 * torch.randn_like(p))
    return cfg


def logits(model, ids=IDS) -> torch.Tensor:
    out = model(ids) if not hasattr(model, "peft_config") else model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else model.output_projection(out)


# ----------------------------------------------------------------------------------- QLoRA


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("name", FAMILIES)
def test_qlora_trains_a_step(hf_causal, tmp_path, capsys, data, name, kind):  # noqa: F811
    pytest.importorskip("bitsandbytes")
    model = model_folder(hf_causal, tmp_path, name)
    assert run_cli(sft_args(model, data["sft"], tmp_path / "out", quantize=kind)) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    saved = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert saved and all(v.dtype == torch.float32 for v in saved.values())  # rule 3: fp32 adapters on a quantized base


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_qlora_equals_peft_and_bitsandbytes(hf_causal, tmp_path, name):
    """nf4 base (fp32 compute) + the same adapter: our model and transformers' bnb model under PEFT
    give the same logits and the same adapter gradients. The packed 4-bit weights are bit-equal;
    transformers keeps the block scales (absmax) in bf16, so ours are copied into its layers: both
    then compute with the very same quantized weights."""
    peft = pytest.importorskip("peft")
    bnb = pytest.importorskip("bitsandbytes")
    import transformers

    from minitrain.adapters.quant import quantize_hook
    from minitrain.objectives.losses import shift_labels

    folder = family_checkpoint(hf_causal, name)
    ours = load_pretrained(folder, models.from_hf_config, tensor_hook=quantize_hook(
        "nf4", compute_dtype=torch.float32, double_quant=False))
    save_adapter(ours, tmp_path / "adapter", random_adapter(ours), base_model_name_or_path=str(folder))
    bnb_cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                              bnb_4bit_compute_dtype=torch.float32, bnb_4bit_use_double_quant=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_cfg, dtype=torch.float32,
                                                           device_map="cpu")
    ref = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    theirs = {n.replace("base_model.model.", "").replace(".base_layer", ""): m for n, m in ref.named_modules()
              if isinstance(m, bnb.nn.Linear4bit)}
    mine = {n: m for n, m in ours.named_modules() if hasattr(m, "lora_A")}
    assert set(mine) == set(theirs) and len(mine) == 2 * (4 if name == "phi3" else 7)  # every linear, 2 layers
    for n, m in mine.items():
        assert torch.equal(m.weight.data, theirs[n].weight.data)  # the same 4-bit codes
        qs = theirs[n].weight.quant_state
        torch.testing.assert_close(qs.absmax.float(), m.weight.quant_state.absmax, rtol=2**-8, atol=0)
        qs.absmax = m.weight.quant_state.absmax.clone()
    ours.train(), ref.train()  # dropout is 0; train mode is bitsandbytes' plain CPU path
    labels = IDS.clone()
    a, b = logits(ours), logits(ref)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    ce = lambda x: torch.nn.functional.cross_entropy(x.flatten(0, 1), shift_labels(labels).flatten())  # noqa: E731
    ce(a).backward()
    ce(b).backward()
    grads = {n.replace("base_model.model.", "").replace(".default", ""): p.grad for n, p in ref.named_parameters()
             if "lora_" in n}
    for n, p in ours.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------ merge, audit


@pytest.mark.parametrize("name", FAMILIES)
def test_merge_gives_the_adapter_models_logits(hf_causal, tmp_path, name):
    import importlib

    merge = importlib.import_module("minitrain.commands.merge")
    folder = family_checkpoint(hf_causal, name)
    adapted = load_pretrained(folder, models.from_hf_config).eval()
    save_adapter(adapted, tmp_path / "adapter", random_adapter(adapted), base_model_name_or_path=str(folder))
    assert merge.main(["--model", str(folder), "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "m")]) == 0
    merged = load_pretrained(tmp_path / "m", models.from_hf_config).eval()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        want = logits(adapted)
        assert (want - logits(load_pretrained(folder, models.from_hf_config).eval())).abs().max() > 1e-3
        torch.testing.assert_close(logits(merged), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(logits(load_hf(tmp_path / "m")), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_audit_is_healthy(hf_causal, tmp_path, data, name):  # noqa: F811
    import contextlib
    import io

    from test_audit_recipes import audit_tool

    model = model_folder(hf_causal, tmp_path, name)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = audit_tool().main(sft_args(model, data["sft"], tmp_path / "out"))
    text = out.getvalue()
    assert code == 0, text
    assert text.strip().splitlines()[-1].startswith("audit: healthy") and "problem:" not in text
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------- DDP


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_ddp_two_ranks_equal_one_process(hf_causal, tmp_path, capsys, data, name):  # noqa: F811
    model = model_folder(hf_causal, tmp_path, name)
    args = lambda out: sft_args(model, data["sft"], out, batch_size=4, max_steps=2)  # noqa: E731
    assert run_cli(args(tmp_path / "one")) == 0, capsys.readouterr().err
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "minitrain",
                        *args(tmp_path / "two")], cwd=REPO, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-4000:]
    want = load_file(tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    got = load_file(tmp_path / "two" / "adapter" / "adapter_model.safetensors")
    start = {k: v for k, v in want.items() if "lora_B" in k}
    assert max(float(v.abs().max()) for v in start.values()) > 1e-4  # training moved B away from zero
    assert set(got) == set(want) and max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-5
