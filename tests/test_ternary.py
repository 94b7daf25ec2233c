"""minitrain.adapters.ternary: BitNet b1.58 ternary bases, LoRA and low-rank correction on them, recipes/lrc_llama.py.

References: hand-made matrices whose absmean and rounding are worked out below; BitNet b1.58's
published training-tips code for `weight_quant` / `activation_quant` (restated in `bitnet_*`);
dense `F.linear` with the dequantized weight; the transformers model's own state dict; PEFT
loading an adapter with a `rank_pattern`; the Eckart-Young residual of a (whitened) matrix.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _tok import corpus, make_bpe_tokenizer

from minitrain.adapters.lora import (LoRAConfig, LoRALinearTernary, apply_lora, count_parameters, freeze_for_adapters,
                                     set_trainable)
from minitrain.adapters.lrc import init_lrc, lrc_factors, lrc_ranks, resolve_rank
from minitrain.adapters.merge import merged_state_dict
from minitrain.adapters.peft_format import load_adapter, save_adapter
from minitrain.adapters.quant import quantize_hook
from minitrain.adapters.ternary import (TernaryLinear, dequantize_ternary, fake_quantize_activations, pack_ternary,
                                        ternary_quantize, unpack_ternary)
from minitrain.errors import UserError
from minitrain.plan.run_shape import ternary_bytes
from minitrain.train import cpu_compiler

REPO = Path(__file__).resolve().parents[1]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# abs sums: row 0 5, row 1 3; mean over all 8 entries 1.0 (per tensor), per row 1.25 and 0.75
W_HAND = torch.tensor([[1.75, -2.25, 0.25, 0.75],
                       [-0.25, 0.0, 1.5, -1.25]])


def bitnet_weight_quant(w: torch.Tensor) -> torch.Tensor:
    """BitNet b1.58 training tips, `weight_quant`: per-tensor absmean, round, clip to [-1, 1]."""
    scale = 1.0 / w.abs().mean().clamp_(min=1e-5)
    return (w * scale).round().clamp_(-1, 1) / scale


def bitnet_activation_quant(x: torch.Tensor) -> torch.Tensor:
    """BitNet b1.58 training tips, `activation_quant`: per-token absmax to int8."""
    scale = 127.0 / x.abs().max(dim=-1, keepdim=True).values.clamp_(min=1e-5)
    return (x * scale).round().clamp_(-128, 127) / scale


# ----------------------------------------------------------------------------- quantize / pack


def test_quantize_by_hand_per_tensor_and_per_channel():
    codes, s = ternary_quantize(W_HAND, "tensor")
    assert s.shape == (1, 1) and s.item() == 1.0  # 8 / 8
    # W / 1 = W: 1.75 -> 2 -> 1, -2.25 -> -2 -> -1, 0.25 -> 0, 0.75 -> 1; -0.25 -> 0, 0, 1.5 -> 2 -> 1, -1.25 -> -1
    assert codes.dtype == torch.int8 and codes.tolist() == [[1, -1, 0, 1], [0, 0, 1, -1]]
    codes, s = ternary_quantize(W_HAND, "channel")
    assert s.flatten().tolist() == [1.25, 0.75]
    # row 0 / 1.25 = 1.4, -1.8, 0.2, 0.6; row 1 / 0.75 = -0.33, 0, 2, -1.67
    assert codes.tolist() == [[1, -1, 0, 1], [0, 0, 1, -1]]
    deq = dequantize_ternary(pack_ternary(codes), s, 4)
    assert deq.tolist() == [[1.25, -1.25, 0.0, 1.25], [0.0, 0.0, 0.75, -0.75]]


def test_quantize_matches_bitnet_reference_on_random_weights():
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    # BitNet multiplies by 1 / scale where we divide by the scale: equal to the last bit of a float
    codes, s = ternary_quantize(w, "tensor")
    ref = bitnet_weight_quant(w.clone())
    assert torch.equal(codes.float(), torch.sign(ref))
    torch.testing.assert_close(dequantize_ternary(pack_ternary(codes), s, 48), ref, rtol=1e-6, atol=0)
    codes, s = ternary_quantize(w, "channel")
    ref = torch.stack([bitnet_weight_quant(r.clone()) for r in w])
    assert torch.equal(codes.float(), torch.sign(ref))
    torch.testing.assert_close(dequantize_ternary(pack_ternary(codes), s, 48), ref, rtol=1e-6, atol=0)
    assert ternary_quantize(torch.zeros(2, 3))[0].abs().sum() == 0  # all-zero: the 1e-5 floor, no NaN


@pytest.mark.parametrize("in_features", [1, 3, 4, 5, 8, 9])
def test_packing_round_trip_exact_with_padding(in_features):
    codes = torch.randint(-1, 2, (7, in_features), generator=torch.Generator().manual_seed(in_features)).to(torch.int8)
    packed = pack_ternary(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (7, math.ceil(in_features / 4))
    assert torch.equal(unpack_ternary(packed, in_features).to(torch.int8) - 1, codes)
    assert ternary_bytes(in_features, 7) == packed.numel() + 4
    assert ternary_bytes(in_features, 7, "channel") == packed.numel() + 7 * 4


def test_packed_byte_layout_by_hand():
    # codes -1, 0, 1, 1 -> 0, 1, 2, 2 in bits 0-1, 2-3, 4-5, 6-7: 0 + 4 + 32 + 128
    assert pack_ternary(torch.tensor([[-1, 0, 1, 1]], dtype=torch.int8)).tolist() == [[164]]


# ----------------------------------------------------------------------------- the layer


@pytest.mark.parametrize("scale", ["tensor", "channel"])
def test_forward_and_backward_equal_dense_matmul_with_dequantized_weight(scale):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(12, 10, generator=g), torch.randn(12, generator=g)
    layer = TernaryLinear.from_weight(w, nn.Parameter(b, requires_grad=False), scale=scale)
    deq = layer.dequantized_weight()
    x = torch.randn(2, 3, 10, generator=g, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, ref = layer(x), F.linear(x_ref, deq, b)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    y.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)


def test_activation_fake_quant_is_bitlinear_with_straight_through_gradient():
    g = torch.Generator().manual_seed(2)
    layer = TernaryLinear.from_weight(torch.randn(6, 16, generator=g), act_bits=8)
    x = torch.randn(4, 16, generator=g, requires_grad=True)
    torch.testing.assert_close(fake_quantize_activations(x, 8), bitnet_activation_quant(x.detach()), rtol=0, atol=0)
    y = layer(x)
    torch.testing.assert_close(y, F.linear(bitnet_activation_quant(x.detach()), layer.dequantized_weight()))
    y.sum().backward()  # straight-through: d/dx of q(x) taken as 1
    torch.testing.assert_close(x.grad, layer.dequantized_weight().sum(0).expand(4, 16))


def test_autocast_runs_the_product_in_bf16():
    layer = TernaryLinear.from_weight(torch.randn(6, 8, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, F.linear(x.bfloat16(), layer.dequantized_weight().bfloat16()))
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32


@pytest.mark.parametrize("autocast", [False, True])
def test_compiles_as_one_graph_with_equal_results(autocast):
    """torch.compile traces the ternary layer with a LoRA adapter (and autocast) without a graph break."""
    model = nn.Sequential()
    model.add_module("q_proj", TernaryLinear.from_weight(torch.randn(8, 12, generator=torch.Generator().manual_seed(4)),
                                                         act_bits=8))
    apply_lora(model, LoRAConfig(r=2, targets=["q_proj"]))
    with torch.no_grad():
        model.q_proj.lora_B.weight.normal_()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 12, requires_grad=True)

    def run(m):
        x.grad = model.q_proj.lora_B.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m(x)
        y.float().square().sum().backward()
        return y, x.grad, model.q_proj.lora_B.weight.grad

    for a, b in zip(run(compiled), run(model)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_equals_cpu():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(5))
    cpu = TernaryLinear.from_weight(w, scale="channel", act_bits=8)
    gpu = TernaryLinear.from_weight(w.cuda(), scale="channel", act_bits=8)
    assert torch.equal(gpu.weight.cpu(), cpu.weight)
    x = torch.randn(4, 96)
    ref = cpu(x)
    y = torch.compile(gpu)(x.cuda())
    torch.testing.assert_close(y.cpu(), ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- loading and LoRA


@pytest.fixture(scope="module")
def folder(hf_causal) -> Path:
    return hf_causal("ternary_qwen3", model_type="qwen3", num_key_value_heads=2, head_dim=16, initializer_range=0.1)


def ternary_model(folder: Path, scale: str = "tensor", act_bits: int = 0, **lora):
    import models
    from minitrain.weights import load_pretrained

    model = load_pretrained(folder, models.from_hf_config,
                            tensor_hook=quantize_hook("ternary", torch.float32, ternary_scale=scale, act_bits=act_bits))
    if lora:
        cfg = LoRAConfig(**lora)
        apply_lora(model, cfg)
        freeze_for_adapters(model, cfg)
    return model


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def test_loaded_model_is_the_float_model_with_dequantized_weights(folder):
    import models
    from minitrain.weights import load_pretrained

    q = ternary_model(folder, "channel")
    ref = load_pretrained(folder, models.from_hf_config)
    W = hf_weights(folder)
    n = 0
    with torch.no_grad():
        for name, m in q.named_modules():
            if name.rpartition(".")[2] in TARGETS:
                assert isinstance(m, TernaryLinear) and m.weight.dtype == torch.uint8 and not m.weight.requires_grad
                codes, s = ternary_quantize(W[f"{name}.weight"], "channel")
                assert torch.equal(m.weight, pack_ternary(codes)) and torch.equal(m.weight_scale, s)
                ref.get_submodule(name).weight.copy_(m.dequantized_weight())
                n += 1
    assert n == 14 and type(q.lm_head) is nn.Linear  # the head stays float
    ids = torch.randint(4, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(q.output_projection(q(ids)), ref.output_projection(ref(ids)), rtol=1e-5, atol=1e-5)
    assert count_parameters(q) == count_parameters(ref)  # the packed bytes count as the weights they hold


def test_lora_on_ternary_base_trains_only_adapters_and_guards_the_base(folder):
    model = ternary_model(folder, r=4, alpha=8, targets="all-linear")
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, LoRALinearTernary)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n, _ in model.named_parameters() if ".lora_" in n}
    with pytest.raises(UserError, match=r"q_proj.weight: is a ternary quantized tensor .* train a LoRA adapter"):
        set_trainable(model, ["model.layers.0.self_attn.q_proj.weight"])
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(3, 64)
    expected = F.linear(x, layer.dequantized_weight()) + layer.scaling * x @ layer.lora_A.weight.T @ layer.lora_B.weight.T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    sd = merged_state_dict(model)
    torch.testing.assert_close(sd["model.layers.0.self_attn.q_proj.weight"],
                               layer.dequantized_weight() + layer.delta_weight())
    assert not any("weight_scale" in k or "lora_" in k for k in sd)


def test_merge_tool_folds_an_adapter_into_the_dequantized_ternary_base(folder, tmp_path):
    import transformers

    model = ternary_model(folder, "channel", r=4, alpha=8, targets="all-linear")
    init_lrc(model, folder)
    save_adapter(model, tmp_path / "adapter")
    args = ["--model", str(folder), "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged"),
            "--quantize", "ternary", "--ternary-scale", "channel"]
    p = subprocess.run([sys.executable, "-m", "minitrain", "merge", *args], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.randint(4, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.output_projection(model(ids)), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- LRC on ternary


def best_rank_r(E: torch.Tensor, r: int) -> torch.Tensor:
    """E projected on its top-r right singular vectors, from an eigendecomposition of E^T E (float64)."""
    E = E.double()
    _, evecs = torch.linalg.eigh(E.T @ E)
    V = evecs[:, -r:]
    return E @ V @ V.T


def test_lrc_adapters_are_the_best_rank_r_fit_of_the_ternary_error(folder):
    model = ternary_model(folder, r=5, alpha=10, targets="all-linear")
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "lora_A")}
    report = init_lrc(model, folder)
    W = hf_weights(folder)
    assert {x.name for x in report} == set(layers)
    for x in report:
        m = layers[x.name]
        E = W[f"{x.name}.weight"] - m.dequantized_weight()
        torch.testing.assert_close(m.delta_weight().double(), best_rank_r(E, 5), rtol=1e-3, atol=2e-5)
        assert 0 < x.error_after < x.error_before


def test_loftq_iterations_requantize_the_ternary_base(folder):
    one = ternary_model(folder, r=5, alpha=10, targets="all-linear")
    three = ternary_model(folder, r=5, alpha=10, targets="all-linear")
    before = three.model.layers[0].mlp.up_proj.weight.clone()
    rep1, rep3 = init_lrc(one, folder), init_lrc(three, folder, iters=3)
    assert sum(x.error_after for x in rep3) < sum(x.error_after for x in rep1)
    assert not torch.equal(three.model.layers[0].mlp.up_proj.weight, before)  # re-quantized from W - sBA
    assert three.model.layers[0].mlp.up_proj.weight.dtype == torch.uint8


def test_calibrated_factors_minimise_the_activation_weighted_error():
    g = torch.Generator().manual_seed(6)
    E = torch.randn(12, 10, generator=g, dtype=torch.float64)
    X = torch.randn(200, 10, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, 10, dtype=torch.float64)
    sigma = X.T @ X / 200
    A, B = lrc_factors(E, 3, 2.0, sigma)
    A0, B0 = lrc_factors(E, 3, 2.0)
    damped = sigma + 0.01 * sigma.diagonal().mean() * torch.eye(10, dtype=torch.float64)
    evals, Q = torch.linalg.eigh(damped)
    R = Q @ torch.diag(evals.sqrt()) @ Q.T  # reference whitening, independently computed

    def weighted(a, b):
        return ((E - 2.0 * b.double() @ a.double()) @ R).norm().item()

    s = torch.linalg.svdvals(E @ R)
    assert weighted(A, B) == pytest.approx(s[3:].square().sum().sqrt().item(), rel=1e-4)  # Eckart-Young, whitened
    assert weighted(A, B) < weighted(A0, B0)


def test_rank_fraction_resolves_per_layer_and_saves_as_peft_rank_pattern(folder, tmp_path):
    assert resolve_rank(0.15, 1024, 3072) == 153  # report 004: 15% of Qwen3-0.6B's 1024
    assert resolve_rank(0.15, 64, 32) == 4 and resolve_rank(0.01, 64, 32) == 1
    assert resolve_rank(16, 64, 32) == 16 and resolve_rank(100, 64, 32) == 32
    model = ternary_model(folder)
    r, pattern = lrc_ranks(model, "all-linear", 0.15)
    assert (r, pattern) == (9, {"k_proj": 4, "v_proj": 4})  # 0.15 x 64 (hidden) and 0.15 x 32 (2 kv heads x 16)
    cfg = LoRAConfig(r=r, alpha=16, targets="all-linear", rank_pattern=pattern)
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    init_lrc(model, folder)
    assert model.model.layers[1].self_attn.k_proj.r == 4 and model.model.layers[1].mlp.up_proj.r == 9
    save_adapter(model, tmp_path / "a", cfg)
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["rank_pattern"] == pattern

    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "a")
    assert pm.base_model.model.model.layers[0].self_attn.k_proj.r["default"] == 4
    assert pm.base_model.model.model.layers[0].self_attn.q_proj.r["default"] == 9
    again = ternary_model(folder)
    load_adapter(again, tmp_path / "a")
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n


# ----------------------------------------------------------------------------- the recipe (report 004's setup)


def test_recipe_ternary_qwen3_lrc_15_percent_checkpointing_compile(folder, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    make_bpe_tokenizer(model)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(8, seed=5)))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = {"model": model, "data": data, "out": out, "quantize": "ternary", "lrc_rank": 0.15,
            "lora_targets": "all-linear", "checkpointing": "true", "compile": "true", "max_steps": 12,
            "batch_size": 8, "lr": 5e-3, "schedule": "constant", "lrc_calibration": 1, "ternary_act_bits": 8,
            "device": "cpu"}
    p = subprocess.run([sys.executable, "-m", "minitrain", str(REPO / "recipes" / "lrc_llama.py"),
                        *[f"{k}={v}" for k, v in args.items()]], cwd=REPO, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    for line in ("base in ternary (2 bits a weight, per-tensor absmean scale, 8-bit activations)",
                 "lrc: lrc_rank=0.15 -> rank 9, k_proj 4, v_proj 4 (lora_r is not used)",
                 "lrc: 14 adapters initialised to the rank-4,9 activation-weighted SVD",
                 "activation checkpointing (non-reentrant) on 2 blocks",
                 # compiled on the CPU too (inductor), as on the author's GPU, where a C++ compiler is found
                 "torch.compile on 2 blocks" if cpu_compiler() else "notice: compile=true ignored on cpu"):
        assert line in p.stdout, line
    assert "embeddings                  0" in p.stdout  # frozen embeddings
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.1, losses  # one batch, seen 12 times
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 9 and saved["rank_pattern"] == {"k_proj": 4, "v_proj": 4}


@pytest.mark.parametrize("args,line", [
    (["lrc_rank=2.5"], "error: lrc_rank=2.5: 1 or more is a rank and must be whole — e.g. lrc_rank=16, or "
                       "lrc_rank=0.15 for 15% of each layer's full rank"),
    (["quantize=nf4", "ternary_act_bits=8"], "error: ternary_act_bits=8: applies to quantize=ternary only (this run "
                                             "has quantize=nf4) — add quantize=ternary or drop ternary_act_bits"),
    (["quantize=ternary", "ternary_act_bits=1"], "error: ternary_act_bits=1: one bit cannot hold a signed value — "
                                                 "use 8 (BitLinear's) or 0 (off)"),
])
def test_recipe_user_errors(args, line, capsys):
    from minitrain.cli import run_cli

    assert run_cli([str(REPO / "recipes" / "lrc_llama.py"), "model=x", "data=y", *args]) == 2
    assert capsys.readouterr().err.strip() == line
