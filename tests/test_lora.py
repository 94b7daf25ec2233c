"""LoRA: checked against peft (same adapter tensors -> same logits, both ways), torch's init, and
bitsandbytes' own layers and dequantization. Models are tiny: a hand-made module with HF names,
transformers' LlamaForCausalLM, and our models.llama.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from minitrain.adapters.lora import (LoRAConfig, LoRALinear, apply_lora, disable_adapters, freeze_for_adapters,
                                     set_trainable, trainable_report)
from minitrain.adapters.merge import merge, merged_state_dict, unmerge
from minitrain.adapters.peft_format import load_adapter, save_adapter
from minitrain.errors import UserError

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------- a tiny model with HF names


class Block(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.self_attn = nn.Module()
        for n in ATTN:
            setattr(self.self_attn, n, nn.Linear(d, d, bias=(n == "q_proj")))
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.mlp.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, h):
        a = self.self_attn
        h = h + a.o_proj(a.q_proj(h) * torch.sigmoid(a.k_proj(h)) + a.v_proj(h))
        return h + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class TinyLM(nn.Module):
    """Not a transformer: just the HF module names and the model contract (`input_embeddings`,
    `output_projection`, `resize_token_embeddings`, hidden states out)."""

    is_encoder_decoder = False

    def __init__(self, vocab: int = 32, d: int = 16, f: int = 24, layers: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(Block(d, f) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    @property
    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def output_projection(self) -> nn.Module:
        return self.lm_head

    def resize_token_embeddings(self, n: int) -> None:
        old = self.model.embed_tokens.weight.data
        new = torch.cat([old, old.mean(0, keepdim=True).expand(n - old.shape[0], -1)])
        self.model.embed_tokens = nn.Embedding.from_pretrained(new, freeze=False)
        head = self.lm_head.weight.data
        self.lm_head = nn.Linear(head.shape[1], n, bias=False)
        self.lm_head.weight.data = torch.cat([head, head.mean(0, keepdim=True).expand(n - head.shape[0], -1)])

    def forward(self, ids):
        h = self.model.embed_tokens(ids)
        for block in self.model.layers:
            h = block(h)
        return h


def ids(vocab=32, b=2, t=5, seed=1):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def randomize_lora(model, seed=3, scale=0.2):
    """B starts at zero (so LoRA is the identity); give it values so the adapter matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(scale * torch.randn(m.lora_B.weight.shape, generator=g))


def bnb_or_skip():
    return pytest.importorskip("bitsandbytes")


# ----------------------------------------------------------------------------- wrapping


def test_wrap_keeps_base_keys_and_matches_base_at_init():
    base = TinyLM()
    model = copy.deepcopy(base)
    q = model.model.layers[0].self_attn.q_proj.weight
    names = apply_lora(model, LoRAConfig(r=4, alpha=8, targets=("q_proj", "v_proj")))
    assert names == [f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("q_proj", "v_proj")]
    sd = model.state_dict()
    assert set(base.state_dict()) <= set(sd)
    assert set(sd) - set(base.state_dict()) == {f"{n}.{ab}.weight" for n in names for ab in ("lora_A", "lora_B")}
    assert model.model.layers[0].self_attn.q_proj.weight is q  # the same Parameter, not a copy
    x = ids()
    assert torch.equal(model(x), base(x))


def test_init_is_kaiming_uniform_a_sqrt5_and_zero_b():
    lin = nn.Linear(16, 8)
    torch.manual_seed(123)
    ref = torch.empty(4, 16)
    nn.init.kaiming_uniform_(ref, a=math.sqrt(5))  # what PEFT does to lora_A
    torch.manual_seed(123)
    m = LoRALinear(lin, r=4, alpha=8)
    assert torch.equal(m.lora_A.weight, ref)
    assert torch.equal(m.lora_B.weight, torch.zeros(8, 4))


def test_targets_by_suffix_t5_names_and_all_linear():
    model = nn.Module()
    model.SelfAttention = nn.Module()
    for n in ("q", "k", "v", "o"):
        setattr(model.SelfAttention, n, nn.Linear(8, 8, bias=False))
    model.DenseReluDense = nn.Module()
    model.DenseReluDense.wi_0 = nn.Linear(8, 16, bias=False)
    model.DenseReluDense.wo = nn.Linear(16, 8, bias=False)
    # "o" must not catch "wo", nor "wi_0" anything but itself
    assert apply_lora(copy.deepcopy(model), LoRAConfig(targets=("o", "wi_0"))) == [
        "SelfAttention.o", "DenseReluDense.wi_0"]
    tiny = TinyLM()
    wrapped = apply_lora(tiny, LoRAConfig(targets="all-linear"))
    assert len(wrapped) == 2 * 7 and "lm_head" not in wrapped  # every linear but the head
    assert isinstance(tiny.lm_head, nn.Linear) and not isinstance(tiny.lm_head, LoRALinear)
    with pytest.raises(UserError, match="output_projection"):
        apply_lora(model, LoRAConfig(targets="all-linear"))  # no head known: refuse, do not guess
    with pytest.raises(UserError, match="match no module"):
        apply_lora(TinyLM(), LoRAConfig(targets=("query",)))


def test_double_wrap_is_an_error():
    model = TinyLM()
    cfg = LoRAConfig(targets=("q_proj",))
    apply_lora(model, cfg)
    with pytest.raises(UserError, match="applied once"):
        apply_lora(model, cfg)
    with pytest.raises(UserError, match="applied once"):
        apply_lora(model, LoRAConfig(targets=("v_proj",)))  # a second adapter elsewhere is stacking too
    # a model holding a LoRALinear that apply_lora did not record (e.g. built by hand)
    other = TinyLM()
    other.model.layers[0].self_attn.q_proj = LoRALinear(other.model.layers[0].self_attn.q_proj, 2, 4)
    with pytest.raises(UserError, match="already has LoRA"):
        apply_lora(other, cfg)
    # wrapping a wrapped layer by hand: the constructor refuses too (the inner adapter would be dropped)
    with pytest.raises(UserError, match="already has a LoRA adapter"):
        LoRALinear(other.model.layers[0].self_attn.q_proj, 2, 4)


def test_rslora_scaling_equals_peft():
    peft = pytest.importorskip("peft")
    for rslora in (False, True):
        torch.manual_seed(0)
        ref = nn.Sequential()
        ref.add_module("q_proj", nn.Linear(12, 6))
        ours = copy.deepcopy(ref)
        pm = peft.get_peft_model(ref, peft.LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj"],
                                                      use_rslora=rslora, init_lora_weights=False))
        apply_lora(ours, LoRAConfig(r=4, alpha=6, targets=("q_proj",), rslora=rslora))
        peft_layer = pm.base_model.model.q_proj
        assert ours.q_proj.scaling == pytest.approx(peft_layer.scaling["default"], rel=1e-12)
        with torch.no_grad():  # same tensors -> same outputs
            ours.q_proj.lora_A.weight.copy_(peft_layer.lora_A["default"].weight)
            ours.q_proj.lora_B.weight.copy_(peft_layer.lora_B["default"].weight)
        x = torch.randn(3, 12)
        torch.testing.assert_close(ours(x), pm(x), rtol=0, atol=1e-6)


def test_bf16_base_gets_fp32_adapter_and_bf16_output():
    lin = nn.Linear(16, 8).to(torch.bfloat16)
    m = LoRALinear(lin, r=4, alpha=8)
    assert m.lora_A.weight.dtype == torch.float32 and m.lora_B.weight.dtype == torch.float32
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert m.lora_B.weight.grad.dtype == torch.float32
    with pytest.raises(UserError, match="floating point"):
        LoRAConfig(dtype=torch.int8)


# ----------------------------------------------------------------------------- freeze, guard, report


def test_freeze_and_report_counts_by_hand():
    model = TinyLM(vocab=32, d=16, f=24, layers=2)
    total = sum(p.numel() for p in model.parameters())
    cfg = LoRAConfig(r=4, alpha=8, targets=("q_proj", "down_proj"))
    apply_lora(model, cfg)
    n = freeze_for_adapters(model, cfg)
    hand = 2 * (4 * (16 + 16) + 4 * (24 + 16))  # r*(in+out) per wrapped layer, 2 layers
    assert n == hand
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"model.layers.{i}.{m}.{ab}.weight" for i in range(2)
                         for m in ("self_attn.q_proj", "mlp.down_proj") for ab in ("lora_A", "lora_B")}
    report = trainable_report(model)
    assert f"trainable: {hand:,} of {total + hand:,} parameters ({100 * hand / (total + hand):.2f}%)" in report
    assert "WARNING" not in report


def test_modules_to_save_is_loud_and_disable_restores_them():
    base = TinyLM()
    model = copy.deepcopy(base)
    cfg = LoRAConfig(r=2, alpha=4, targets=("q_proj",), modules_to_save=("embed_tokens",))
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    emb = 32 * 16
    lora = 2 * 2 * (16 + 16)
    total = sum(p.numel() for p in model.parameters())
    report = trainable_report(model)
    assert model.model.embed_tokens.weight.requires_grad
    line = [x for x in report.splitlines() if x.startswith("WARNING")]
    assert len(line) == 1 and "model.embed_tokens" in line[0]
    assert f"{emb:,} parameters = {100 * emb / total:.1f}%" in line[0]
    rows = {r.split()[0]: int(r.split()[1].replace(",", "")) for r in report.splitlines() if r.startswith("  ")}
    assert rows == {"lora_A/lora_B": lora, "embeddings": emb, "head": 0, "other": 0}
    assert f"trainable: {emb + lora:,} of {total:,}" in report
    # train the embedding (and the adapter): the reference under disable_adapters is still the base
    randomize_lora(model)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    x = ids()
    with torch.no_grad():
        assert not torch.allclose(model(x), base(x))
        with disable_adapters(model):
            torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)
            with disable_adapters(model):  # nested: still the base, and the outer exit restores
                torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)
            torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)
        assert not torch.allclose(model(x), base(x))  # restored on exit
    assert model.model.embed_tokens.weight.requires_grad


def test_dtype_guard_names_the_tensor():
    bnb = bnb_or_skip()
    model = TinyLM()
    attn = model.model.layers[0].self_attn
    attn.q_proj = bnb.nn.Linear4bit(16, 16, bias=False, quant_type="nf4", compute_dtype=torch.float32).to("cpu")
    attn.k_proj = bnb.nn.Linear8bitLt(16, 16, bias=False, has_fp16_weights=False).to("cpu")
    model.model.step = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(UserError) as e:
        set_trainable(model, ["model.layers.0.self_attn.q_proj.weight"])
    msg = str(e.value)
    assert msg.startswith("model.layers.0.self_attn.q_proj.weight: is a 4-bit quantized tensor (uint8)")
    assert "LoRA" in msg and "'q_proj'" in msg and "\n" not in msg
    with pytest.raises(UserError, match=r"model.layers.0.self_attn.k_proj.weight: is an 8-bit quantized tensor \(int8\)"):
        set_trainable(model, ["k_proj"])
    with pytest.raises(UserError, match=r"model.step: is an integer tensor \(int64\)"):
        set_trainable(model, ["model.step"])
    with pytest.raises(UserError, match="q_proj.weight: is a 4-bit quantized tensor"):
        apply_lora(model, LoRAConfig(targets=("v_proj",), modules_to_save=("layers.0.self_attn.q_proj",)))
    assert not any(p.requires_grad for p in model.model.layers[0].self_attn.q_proj.parameters())


# ----------------------------------------------------------------------------- quantized bases


def _quantized(bnb, kind: str, lin: nn.Linear) -> nn.Module:
    if kind == "nf4":
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=True, quant_type="nf4",
                              compute_dtype=torch.float32)
        q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4")
    else:
        q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=True, has_fp16_weights=False)
        q.weight = bnb.nn.Int8Params(lin.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
    q.bias = nn.Parameter(lin.bias.data.clone(), requires_grad=False)
    return q.to("cpu")  # bnb quantizes on the move


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_lora_on_bnb_base_forward_backward(kind):
    bnb = bnb_or_skip()
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    ref = _quantized(bnb, kind, lin)
    layer = _quantized(bnb, kind, lin)
    model = nn.Sequential()
    model.add_module("q_proj", layer)
    apply_lora(model, LoRAConfig(r=4, alpha=8, targets=("q_proj",)))
    freeze_for_adapters(model)
    w = model.q_proj
    assert w.weight.dtype == (torch.uint8 if kind == "nf4" else torch.int8)
    assert "q_proj.weight" in model.state_dict() and "q_proj.lora_A.weight" in model.state_dict()
    x = torch.randn(3, 64)
    with torch.no_grad():  # B is zero: exactly bnb's own layer (training mode: the same kernels)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
        if kind == "int8":  # in eval mode bnb's 8-bit quantizes the input too; we call it the same way
            ref.eval(), model.eval()
            torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
        else:  # bnb's nf4 eval path on CPU repacks to a bf16 kernel; ours stays exact to the dequantized weight
            model.eval()
            deq = bnb.functional.dequantize_4bit(w.weight.data, w.weight.quant_state)
            torch.testing.assert_close(model(x), x @ deq.T + w.bias, rtol=1e-6, atol=1e-6)
    model.train()
    randomize_lora(model)
    x.requires_grad_(True)
    y = model(x)
    assert y.dtype == torch.float32
    y.square().sum().backward()
    assert w.lora_A.weight.grad.dtype == torch.float32 and w.lora_A.weight.grad.abs().sum() > 0
    assert w.lora_B.weight.grad.dtype == torch.float32 and w.lora_B.weight.grad.abs().sum() > 0
    assert w.weight.grad is None and x.grad is not None
    # the adapter adds exactly scaling * B A x on top of the quantized product
    ref.train()
    with torch.no_grad():
        delta = (x @ w.lora_A.weight.T @ w.lora_B.weight.T) * w.scaling
        torch.testing.assert_close(model(x), ref(x) + delta, rtol=1e-5, atol=1e-5)


def test_wrap_nf4_layer_after_bnb_cpu_inference():
    """bnb repacks a Linear4bit's weight for its CPU inference kernel on an eval forward; wrapping
    such a layer must still see the right weight."""
    bnb = bnb_or_skip()
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    q = _quantized(bnb, "nf4", lin)
    deq = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state).clone()
    q.eval()
    x = torch.randn(3, 64)
    with torch.no_grad():
        q(x)  # may repack (AVX512-BF16 CPUs), rounding the block scales to bf16 on the way
    qs = q.weight.quant_state
    if getattr(qs, "packing_format_for_cpu", False):
        data, qs = bnb.functional._convert_weight_packed_for_cpu_inverse(q.weight.data.clone(), copy.copy(qs))
        now = bnb.functional.dequantize_4bit(data, qs)
    else:
        now = bnb.functional.dequantize_4bit(q.weight.data, qs)
    model = nn.Sequential()
    model.add_module("q_proj", q)
    apply_lora(model, LoRAConfig(targets=("q_proj",)))
    with torch.no_grad():
        torch.testing.assert_close(model(x), x @ now.T + lin.bias, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model(x), x @ deq.T + lin.bias, rtol=0, atol=1e-2)  # not garbage


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_merge_quantized_reports_rounding_error(kind):
    bnb = bnb_or_skip()
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    model = nn.Sequential()
    model.add_module("q_proj", _quantized(bnb, kind, lin))
    apply_lora(model, LoRAConfig(r=4, alpha=8, targets=("q_proj",)))
    randomize_lora(model, scale=0.05)
    w = model.q_proj
    if kind == "nf4":
        deq = lambda: bnb.functional.dequantize_4bit(w.weight.data, w.weight.quant_state).float()  # noqa: E731
    else:
        deq = lambda: bnb.functional.int8_vectorwise_dequant(w.weight.data, w.state.SCB).float()  # noqa: E731
    target = deq() + (w.lora_B.weight @ w.lora_A.weight).detach() * w.scaling
    report = merge(model)
    err = deq() - target  # what was lost, measured with bnb's own dequantization
    assert len(report.layers) == 1 and report.layers[0].quantized
    assert report.max_abs == pytest.approx(err.abs().max().item(), rel=1e-6)
    assert report.max_rel == pytest.approx((err.norm() / target.norm()).item(), rel=1e-6)
    assert report.max_abs > 0
    assert "quantized" in str(report)
    with pytest.raises(UserError, match="already merged"):
        merge(model)
    unmerge(model)
    assert not w.merged


# ----------------------------------------------------------------------------- merge, disable


def test_merge_unmerge_fp32_round_trip_and_merged_state_dict():
    base = TinyLM()
    model = copy.deepcopy(base)
    apply_lora(model, LoRAConfig(r=4, alpha=8, targets="all-linear", dropout=0.1))
    randomize_lora(model)
    model.eval()  # dropout off
    x = ids()
    with torch.no_grad():
        y = model(x)
        w0 = {n: p.clone() for n, p in base.named_parameters()}
        report = merge(model)
        assert report.max_abs < 1e-6 and not any(e.quantized for e in report.layers)
        torch.testing.assert_close(model(x), y, rtol=1e-5, atol=1e-5)
        with pytest.raises(UserError, match="unmerge"):
            with disable_adapters(model):
                pass
        # merged state dict of a merged model = its weights; HF layout, no lora keys
        sd = merged_state_dict(model)
        assert set(sd) == set(base.state_dict())
        fresh = TinyLM(seed=9)
        fresh.load_state_dict(sd)
        torch.testing.assert_close(fresh(x), y, rtol=1e-5, atol=1e-5)
        unmerge(model)
        for n, p in model.named_parameters():
            if n in w0:
                torch.testing.assert_close(p, w0[n], rtol=0, atol=1e-6)
        torch.testing.assert_close(model(x), y, rtol=1e-5, atol=1e-5)
        # merged_state_dict of an unmerged model folds the adapter in without touching the model
        before = {k: v.clone() for k, v in model.state_dict().items()}
        fresh.load_state_dict(merged_state_dict(model))
        torch.testing.assert_close(fresh(x), y, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_merge_into_bf16_reports_what_rounding_lost(caplog):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("v_proj", nn.Linear(32, 32).to(torch.bfloat16))
    w0 = model.v_proj.weight.detach().float().clone()
    apply_lora(model, LoRAConfig(r=2, alpha=2, targets=("v_proj",)))
    randomize_lora(model, scale=1e-3)  # an update far below bf16's resolution at these weights
    v = model.v_proj
    target = w0 + (v.lora_B.weight @ v.lora_A.weight).detach() * v.scaling
    with caplog.at_level("WARNING", logger="minitrain.adapters.merge"):
        report = merge(model)
    err = v.weight.detach().float() - target
    assert report.max_abs == pytest.approx(err.abs().max().item(), rel=1e-6)
    assert report.max_rel_update == pytest.approx((err.norm() / (target - w0).norm()).item(), rel=1e-5)
    assert report.max_rel_update > 0.01 and "of a LoRA update lost" in caplog.text  # loud, not silent


def test_merge_refuses_tied_weight():
    model = TinyLM()
    model.lm_head.weight = model.model.embed_tokens.weight
    apply_lora(model, LoRAConfig(targets=("lm_head",)))
    with pytest.raises(UserError, match="tied"):
        merge(model)


def test_disable_adapters_gives_base_outputs():
    base = TinyLM()
    model = copy.deepcopy(base)
    apply_lora(model, LoRAConfig(r=4, alpha=8, targets="all-linear"))
    randomize_lora(model)
    x = ids()
    with torch.no_grad():
        y = model(x)
        assert not torch.allclose(y, base(x))
        with disable_adapters(model):
            assert torch.equal(model(x), base(x))
            with disable_adapters(model):  # nesting keeps the outer state
                pass
            assert torch.equal(model(x), base(x))
        assert torch.equal(model(x), y)
    with pytest.raises(UserError, match="no adapters"):
        with disable_adapters(TinyLM()):
            pass


# ----------------------------------------------------------------------------- save / load


def test_save_load_round_trip_and_trainable_flag(tmp_path):
    model = TinyLM()
    cfg = LoRAConfig(r=4, alpha=8, targets=("q_proj", "v_proj"), rslora=True)
    apply_lora(model, cfg)
    randomize_lora(model)
    save_adapter(model, tmp_path / "ad", cfg, base_model_name_or_path="tiny")
    files = sorted(p.name for p in (tmp_path / "ad").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]  # no temp files left
    conf = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8
    assert conf["use_rslora"] is True and conf["bias"] == "none" and "vocab_size" not in conf  # PEFT fields only
    from safetensors import safe_open
    with safe_open(str(tmp_path / "ad" / "adapter_model.safetensors"), framework="pt") as f:
        assert f.metadata()["minitrain.vocab_size"] == "32"
    assert conf["target_modules"] == ["q_proj", "v_proj"] and conf["base_model_name_or_path"] == "tiny"
    keys = set(load_file(tmp_path / "ad" / "adapter_model.safetensors"))
    assert keys == {f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight"
                    for i in range(2) for m in ("q_proj", "v_proj") for ab in "AB"}
    x = ids()
    with torch.no_grad():
        y = model(x)
    frozen = TinyLM()
    got = load_adapter(frozen, tmp_path / "ad")
    assert (got.r, got.alpha, got.rslora) == (4, 8, True)
    assert not any(p.requires_grad for n, p in frozen.named_parameters() if "lora_" in n)
    with torch.no_grad():
        torch.testing.assert_close(frozen(x), y, rtol=0, atol=0)
    resumed = TinyLM()
    load_adapter(resumed, tmp_path / "ad", trainable=True)
    assert {n for n, p in resumed.named_parameters() if p.requires_grad} == {
        n for n, _ in resumed.named_parameters() if "lora_" in n}
    with pytest.raises(UserError, match="applied once"):  # onto a model holding another adapter
        other = TinyLM()
        apply_lora(other, LoRAConfig(r=2, targets=("q_proj",)))
        load_adapter(other, tmp_path / "ad")


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_failed_adapter_save_keeps_the_previous_pair(tmp_path, monkeypatch):
    """The weights are written, then the config write fails: the folder still holds the previous
    weights and config together, and no temporary folder is left."""
    model = TinyLM()
    apply_lora(model, LoRAConfig(r=2, alpha=4, targets=("q_proj",)))
    folder = save_adapter(model, tmp_path / "ad")
    before = _files(folder)
    randomize_lora(model)
    real = Path.write_text

    def write_text(self, *a, **kw):
        if "adapter_config.json" in self.name:  # under whatever temporary name
            assert (self.parent / "adapter_model.safetensors").is_file()  # the new weights are written
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(UserError, match=f"^{re.escape(str(folder))}: cannot write the adapter: no space left on "
                                        f"device — free space or choose a writable folder, then save again$"):
        save_adapter(model, folder, base_model_name_or_path="other")
    monkeypatch.undo()
    assert _files(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad"]  # no ad.tmp-* / ad.old-*


def test_adapter_resave_keeps_other_files_and_clears_leftovers(tmp_path, monkeypatch):
    model = TinyLM()
    apply_lora(model, LoRAConfig(r=2, alpha=4, targets=("q_proj",)))
    folder = save_adapter(model, tmp_path / "ad")
    (folder / "tokenizer.json").write_text("{}")  # saved beside the adapter (recipes/lora_t5.py does)
    (folder / "sub").mkdir()
    (folder / "sub" / "adapter_config.json").write_text("another adapter's")
    for leftover in ("ad.tmp-99", "ad.old-98"):  # writers killed mid-save
        shutil.copytree(folder, tmp_path / leftover)
    randomize_lora(model)
    save_adapter(model, folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad"]
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "sub",
                                                        "tokenizer.json"]
    assert (folder / "sub" / "adapter_config.json").read_text() == "another adapter's"
    other = TinyLM()
    load_adapter(other, folder)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="file: cannot write the adapter: not a directory"):
        save_adapter(model, tmp_path / "file")
    monkeypatch.chdir(folder)  # replacing the current folder would leave this process in a deleted one
    with pytest.raises(UserError, match="is \\(or holds\\) the current folder"):
        save_adapter(model, ".")


def test_load_peft_key_variants(tmp_path):
    model = TinyLM()
    apply_lora(model, LoRAConfig(r=2, alpha=4, targets=("k_proj",)))
    randomize_lora(model)
    save_adapter(model, tmp_path)
    path = tmp_path / "adapter_model.safetensors"
    sd = load_file(path)
    save_file({k.replace(".weight", ".default.weight"): v for k, v in sd.items()}, path)  # older PEFT names
    other = TinyLM()
    load_adapter(other, tmp_path)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)


def test_load_onto_other_shapes_names_both(tmp_path):
    model = TinyLM(vocab=34)
    apply_lora(model, LoRAConfig(r=2, alpha=4, targets=("q_proj",), modules_to_save=("embed_tokens",)))
    save_adapter(model, tmp_path / "resized")
    with pytest.raises(UserError) as e:
        load_adapter(TinyLM(vocab=32), tmp_path / "resized")
    msg = str(e.value)
    assert "34" in msg and "32" in msg and "special tokens" in msg and "resize_token_embeddings(34)" in msg
    resized = TinyLM(vocab=32)
    resized.resize_token_embeddings(34)
    load_adapter(resized, tmp_path / "resized")  # the fix the message names works
    # a PEFT-style file without our vocab_size metadata: the embedding's shape check says the same
    wpath = tmp_path / "resized" / "adapter_model.safetensors"
    save_file(load_file(wpath), wpath)
    with pytest.raises(UserError, match=r"embed_tokens.weight has shape \(34, 16\) but the model's is \(32, 16\) "
                                        r"— the adapter was trained with 34 tokens: add the same special tokens"):
        load_adapter(TinyLM(vocab=32), tmp_path / "resized")
    # another hidden size: the module and both shapes
    apply_lora(wide := TinyLM(d=24), LoRAConfig(r=2, alpha=4, targets=("q_proj",)))
    save_adapter(wide, tmp_path / "wide")
    narrow = TinyLM(d=16)
    with pytest.raises(UserError, match=r"model.layers.0.self_attn.q_proj.lora_A.weight has shape \(2, 24\) "
                                        r"but model.layers.0.self_attn.q_proj .* needs \(2, 16\)"):
        load_adapter(narrow, tmp_path / "wide")
    assert not any(isinstance(m, LoRALinear) for m in narrow.modules())  # checked before changing anything


# ----------------------------------------------------------------------------- PEFT interop on LLaMA


def _hf_llama(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def _our_llama(folder):
    pytest.importorskip("models.llama")
    import models
    from minitrain.weights import load_pretrained

    return load_pretrained(folder, models.from_hf_config).eval()


def _logits(model, x):
    with torch.no_grad():
        out = model(x)
        if hasattr(out, "logits"):  # transformers
            return out.logits
        return model.output_projection(out)  # ours: hidden states -> head


TOKENS = torch.tensor([[1, 5, 9, 33, 70, 2, 17], [1, 100, 3, 3, 8, 64, 127]])


@pytest.mark.parametrize("impl", ["ours", "hf"])
def test_our_adapter_loads_in_peft_with_equal_logits(hf_causal, tmp_path, impl):
    peft = pytest.importorskip("peft")
    folder = hf_causal("llama_lora")
    model = _our_llama(folder) if impl == "ours" else _hf_llama(folder)
    cfg = LoRAConfig(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), rslora=True)
    apply_lora(model, cfg)
    randomize_lora(model, scale=0.1)
    save_adapter(model, tmp_path, cfg, base_model_name_or_path=str(folder))
    ref = peft.PeftModel.from_pretrained(_hf_llama(folder), tmp_path).eval()
    base = _logits(_hf_llama(folder), TOKENS)
    ours, theirs = _logits(model, TOKENS), _logits(ref, TOKENS)
    assert (theirs - base).abs().max() > 1e-3  # the adapter really changes the output
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    with disable_adapters(model), ref.disable_adapter():
        torch.testing.assert_close(_logits(model, TOKENS), _logits(ref, TOKENS), rtol=0, atol=1e-5)


def test_our_adapter_with_modules_to_save_loads_in_peft(hf_causal, tmp_path):
    peft = pytest.importorskip("peft")
    folder = hf_causal("llama_lora")
    model = _our_llama(folder)
    cfg = LoRAConfig(r=2, alpha=4, targets=("o_proj",), modules_to_save=("embed_tokens",))
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    randomize_lora(model, scale=0.1)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)  # "trained"
    save_adapter(model, tmp_path)
    ref = peft.PeftModel.from_pretrained(_hf_llama(folder), tmp_path).eval()
    torch.testing.assert_close(_logits(model, TOKENS), _logits(ref, TOKENS), rtol=0, atol=1e-5)
    with disable_adapters(model), ref.disable_adapter():
        torch.testing.assert_close(_logits(model, TOKENS), _logits(ref, TOKENS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("impl,targets,save", [
    ("ours", ["k_proj", "o_proj", "gate_proj", "up_proj"], None),
    ("hf", ["k_proj", "o_proj", "gate_proj", "up_proj"], None),
    ("ours", "all-linear", ["embed_tokens"]),  # PEFT writes the full module names for all-linear
])
def test_peft_adapter_loads_in_ours_with_equal_logits(hf_causal, tmp_path, impl, targets, save):
    peft = pytest.importorskip("peft")
    folder = hf_causal("llama_lora")
    torch.manual_seed(0)
    ref = peft.get_peft_model(_hf_llama(folder), peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=targets, modules_to_save=save,
        init_lora_weights=False, task_type="CAUSAL_LM")).eval()  # init False: B random too
    if save:
        with torch.no_grad():
            ref.base_model.model.model.embed_tokens.modules_to_save["default"].weight.mul_(1.5)
    ref.save_pretrained(tmp_path)
    model = _our_llama(folder) if impl == "ours" else _hf_llama(folder)
    cfg = load_adapter(model, tmp_path)
    assert cfg.r == 4 and cfg.alpha == 16 and not cfg.rslora
    adapter = [p for n, p in model.named_parameters() if "lora_" in n or "embed_tokens" in n and save]
    assert adapter and not any(p.requires_grad for p in adapter)  # loaded frozen (rule 4)
    torch.testing.assert_close(_logits(model, TOKENS), _logits(ref, TOKENS), rtol=0, atol=1e-5)
    with disable_adapters(model), ref.disable_adapter():
        torch.testing.assert_close(_logits(model, TOKENS), _logits(ref, TOKENS), rtol=0, atol=1e-5)


def test_merged_llama_loads_in_transformers(hf_causal):
    folder = hf_causal("llama_lora")
    model = _our_llama(folder)
    apply_lora(model, LoRAConfig(r=4, alpha=8, targets="all-linear"))
    randomize_lora(model, scale=0.1)
    want = _logits(model, TOKENS)
    hf = _hf_llama(folder)
    hf.load_state_dict(merged_state_dict(model), strict=True)  # HF layout, key for key
    torch.testing.assert_close(_logits(hf, TOKENS), want, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- T5 names


@pytest.fixture(scope="module")
def hf_t5(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("t5")
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(folder)
    return folder


def _t5_logits(model, enc, dec):
    with torch.no_grad():
        if hasattr(model, "output_projection"):  # ours: decoder hidden -> head
            return model.output_projection(model(enc, torch.ones_like(enc), dec))
        return model(input_ids=enc, decoder_input_ids=dec).logits


@pytest.mark.parametrize("impl", ["ours", "hf"])
def test_t5_targets_match_peft(hf_t5, tmp_path, impl):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    hf = lambda: transformers.T5ForConditionalGeneration.from_pretrained(hf_t5).eval()  # noqa: E731
    if impl == "ours":
        pytest.importorskip("models.t5")
        import models
        from minitrain.weights import load_pretrained

        model = load_pretrained(hf_t5, models.from_hf_config).eval()
    else:
        model = hf()
    targets = ("q", "k", "v", "o", "wi_0", "wi_1", "wo")
    wrapped = apply_lora(model, LoRAConfig(r=2, alpha=4, targets=targets))
    assert len(wrapped) == 2 * 4 + 2 * 4 * 2 + 4 * 3  # enc self-attn, dec self+cross attn, every FFN
    randomize_lora(model, scale=0.1)
    save_adapter(model, tmp_path)
    assert sorted(json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]) == sorted(targets)
    ref = peft.PeftModel.from_pretrained(hf(), tmp_path).eval()
    enc, dec = torch.tensor([[5, 9, 33, 7, 1]]), torch.tensor([[0, 4, 12]])
    torch.testing.assert_close(_t5_logits(model, enc, dec), _t5_logits(ref, enc, dec), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- quantized LLaMA end to end


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_llama_trains_adapters_and_merges_to_hf(hf_causal, kind):
    bnb_or_skip()
    pytest.importorskip("models.llama")
    import models
    from minitrain.adapters.quant import quantize_hook
    from minitrain.weights import load_pretrained

    folder = hf_causal("llama_lora")
    model = load_pretrained(folder, models.from_hf_config, dtype=torch.float32,
                            tensor_hook=quantize_hook(kind, compute_dtype=torch.float32))
    cfg = LoRAConfig(r=4, alpha=8, targets="all-linear")
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    randomize_lora(model, scale=0.05)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    hidden = model(TOKENS[:, :-1], None)
    F.cross_entropy(model.output_projection(hidden).flatten(0, 1), TOKENS[:, 1:].flatten()).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable)
    # the merged, dequantized weights in HF layout give transformers the same logits (training-mode
    # kernels: in eval mode bnb's int8 matmul also quantizes the activations; no dropout here)
    want = _logits(model, TOKENS)
    hf = _hf_llama(folder)
    hf.load_state_dict(merged_state_dict(model), strict=True)
    torch.testing.assert_close(_logits(hf, TOKENS), want, rtol=0, atol=1e-5)


def test_wrapped_layers_follow_the_model_mode():
    """A model in eval() gets adapter layers in eval(): their dropout must not switch on."""
    model = TinyLM().eval()
    apply_lora(model, LoRAConfig(r=2, alpha=4, dropout=0.5, targets=("q_proj",)))
    assert not any(m.training for m in model.modules())


@pytest.mark.parametrize("autocast", [False, True])
def test_update_is_accumulated_into_the_base_output_in_place(autocast):
    """The update `(x A^T s) B^T` is added by one GEMM into the base output itself: the same bits and
    gradients as the out-of-place `addmm` over a copy (fp32, and bf16 autocast, where B is cast as
    autocast's addmm casts it), and no CopySlices node (the in-place op is on no view)."""
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(32, 48), r=4, alpha=8)
    nn.init.normal_(layer.lora_B.weight)
    x0 = torch.randn(3, 5, 32, requires_grad=True)
    x = x0 * 1  # a hidden state, not a leaf (autocast caches a leaf's cast, shared by both products)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.profiler.profile() as prof:
            y = layer(x)
        z = (layer.lora_A(x) * layer.scaling).reshape(-1, 4)
        ref = torch.addmm(F.linear(x, layer.weight, layer.bias).reshape(-1, 48), z, layer.lora_B.weight.t())
    assert y.shape == (3, 5, 48) and y.dtype == ref.dtype
    assert torch.equal(y, ref.view(3, 5, 48))
    ops = [e.name for e in prof.events()]  # the base's addmm (its bias), the update's addmm_, no add
    assert ops.count("aten::addmm") == 1 and ops.count("aten::addmm_") == 1 and "aten::add" not in ops
    assert [f.name() for f, _ in y.grad_fn.next_functions] == ["AddmmBackward0"]  # view <- addmm_, no CopySlices
    params = [x0, layer.lora_A.weight, layer.lora_B.weight]
    up = torch.randn(y.shape).to(y.dtype)
    ours = torch.autograd.grad(y, params, up, retain_graph=True)  # x0 * 1 is shared
    for a, b in zip(ours, torch.autograd.grad(ref, params, up.view(-1, 48))):
        assert torch.equal(a, b)
