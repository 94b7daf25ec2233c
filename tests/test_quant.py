"""minitrain.adapters.quant: base Linears quantized by bitsandbytes as their weights stream in.

References: the fp32 model loaded without the hook, and bitsandbytes' own dequantization
(`dequantize_4bit`, and `CB * SCB / 127` for int8) of the very weights the hook produced.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

from minitrain.errors import UserError
from minitrain.weights import load_pretrained, read_header, save_pretrained

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("models.llama")
from models import from_hf_config  # noqa: E402

from minitrain.adapters.quant import quantize_hook, require_bitsandbytes  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYER = {"nf4": bnb.nn.Linear4bit, "int8": bnb.nn.Linear8bitLt}


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.output_projection(model(ids)).float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def dequantized(m: nn.Module) -> torch.Tensor:
    """The float weight a bitsandbytes layer computes with, by bitsandbytes' own inverse."""
    if isinstance(m, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).float()
    cb = m.weight.data if m.weight.CB is None else m.weight.CB
    scb = m.weight.SCB if m.weight.SCB is not None else m.state.SCB
    return cb.float() * scb.float()[:, None] / 127


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_every_target_linear_is_quantized_frozen_and_the_rest_stays_float(hf_causal, kind):
    folder = hf_causal("q_llama")
    q = load_pretrained(folder, from_hf_config, dtype=torch.bfloat16, tensor_hook=quantize_hook(kind))
    n_quant = 0
    for name, m in q.named_modules():
        if name.rpartition(".")[2] in TARGETS:
            assert isinstance(m, LAYER[kind]), name
            n_quant += 1
            for pn, p in m.named_parameters():
                assert not p.is_floating_point() and not p.requires_grad, f"{name}.{pn}"
                with pytest.raises(RuntimeError):  # torch itself refuses gradients on integer tensors
                    p.requires_grad_(True)
    assert n_quant == len(TARGETS) * 2
    assert type(q.lm_head) is nn.Linear and q.lm_head.weight.dtype == torch.bfloat16  # skipped by default
    assert type(q.model.embed_tokens) is nn.Embedding
    for name, p in q.named_parameters():
        if "norm" in name or "embed" in name or "lm_head" in name:
            assert p.dtype == torch.bfloat16, name
        assert not p.is_meta, name


def test_nf4_computes_exactly_with_its_dequantized_weights(hf_causal, ids):
    """With fp32 compute, the only difference to the float model is the weights themselves."""
    folder = hf_causal("q_llama")
    q = load_pretrained(folder, from_hf_config, tensor_hook=quantize_hook("nf4", compute_dtype=torch.float32))
    ref = load_pretrained(folder, from_hf_config)
    with torch.no_grad():
        for name, m in q.named_modules():
            if isinstance(m, bnb.nn.Linear4bit):
                ref.get_submodule(name).weight.copy_(dequantized(m))
    q.train()  # eval mode on CPU repacks the weight for a bf16 kernel; train mode is the plain path
    torch.testing.assert_close(logits(q, ids), logits(ref, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_logits_close_to_fp32(hf_causal, ids, kind, compute_dtype):
    """Tolerance: the logits may be off by about what the weights are off, not more.

    Each quantized Linear's output is off relative to its float output by about the relative
    error of its weight (for inputs not aligned with the error); residual connections carry the
    exact embedding through, so the logits' relative error stays near the largest weight error
    (measured: ~1.2x for nf4). We allow 2x that, plus 0.01 for int8's quantized activations and
    bf16 compute (a plain bf16 model is already ~0.007 off here).
    """
    folder = hf_causal("q_llama")
    ref = load_pretrained(folder, from_hf_config).eval()
    q = load_pretrained(folder, from_hf_config, dtype=compute_dtype, tensor_hook=quantize_hook(kind, compute_dtype=compute_dtype))
    weight_err = max(
        rel(dequantized(m), ref.get_submodule(name).weight) for name, m in q.named_modules() if isinstance(m, LAYER[kind])
    )
    assert 0 < weight_err < (0.15 if kind == "nf4" else 0.02)  # nf4 has 16 levels per block, int8 255 per row
    for mode in ("train", "eval"):
        getattr(q, mode)()
        assert rel(logits(q, ids), logits(ref, ids)) <= 2 * weight_err + (0.01 if kind == "int8" or compute_dtype != torch.float32 else 0)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_linear_weight_memory_drops(hf_causal, kind):
    """Bytes held for the targeted weights, scales included, against fp32 and the formats' sizes."""
    folder = hf_causal("q_llama")
    ref = load_pretrained(folder, from_hf_config)
    q = load_pretrained(folder, from_hf_config, dtype=torch.bfloat16, tensor_hook=quantize_hook(kind))
    fp32 = quant = 0
    for name, m in q.named_modules():
        if not isinstance(m, LAYER[kind]):
            continue
        w = ref.get_submodule(name).weight
        held = sum(t.numel() * t.element_size() for t in m.state_dict().values())
        if kind == "nf4":  # 4 bits a weight + one uint8 scale per 64 (double quant) + small fixed tables
            assert held <= w.numel() // 2 + w.numel() // 64 + 2048, name
        else:  # 8 bits a weight + one fp32 scale per output row (+ a 1-byte format tag)
            assert held == w.numel() + 4 * w.shape[0] + 1, name
        fp32 += w.numel() * 4
        quant += held
    assert quant < (0.25 if kind == "nf4" else 0.3) * fp32


def test_skip_and_tied_heads_stay_float(hf_causal, ids):
    folder = hf_causal("q_tied", tie_word_embeddings=True, seed=1)
    q = load_pretrained(folder, from_hf_config, dtype=torch.float32, tensor_hook=quantize_hook("nf4", skip=("down_proj",)))
    assert all(type(layer.mlp.down_proj) is nn.Linear for layer in q.model.layers)
    assert isinstance(q.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)
    assert q.lm_head.weight is q.model.embed_tokens.weight

    # a tied checkpoint that also stores the head: the head arrives as a key, and is still left alone
    full = load_pretrained(folder, from_hf_config)
    tensors = {k: v.clone() for k, v in full.state_dict().items()}  # includes lm_head.weight
    from safetensors.torch import save_file

    out = folder.parent / "q_tied_with_head"
    out.mkdir(exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text((folder / "config.json").read_text())
    q2 = load_pretrained(out, from_hf_config, tensor_hook=quantize_hook("nf4", skip=()))
    assert q2.lm_head.weight is q2.model.embed_tokens.weight and type(q2.lm_head) is nn.Linear


class Biased(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.proj = nn.Linear(64, 32, bias=True)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16])
def test_bias_is_kept_whichever_arrives_first(tmp_path, bias_dtype):
    torch.manual_seed(0)
    m = Biased({})
    m.proj.bias.data = m.proj.bias.data.to(bias_dtype)  # fp16 bias is written after the fp32 weight
    save_pretrained(m, tmp_path, {"model_type": "toy"})
    header, _ = read_header(tmp_path / "model.safetensors")
    first = min(header, key=lambda k: header[k]["data_offsets"][0])
    assert first == ("proj.bias" if bias_dtype == torch.float32 else "proj.weight")
    q = load_pretrained(tmp_path, Biased, tensor_hook=quantize_hook("nf4", compute_dtype=torch.float32))
    assert isinstance(q.proj, bnb.nn.Linear4bit) and not q.proj.bias.is_meta
    assert torch.equal(q.proj.bias, m.proj.bias.float())
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = nn.functional.linear(x, dequantized(q.proj), m.proj.bias.float())
        torch.testing.assert_close(q.proj(x), want, rtol=1e-5, atol=1e-5)


def test_missing_bitsandbytes_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with pytest.raises(UserError, match=r"bitsandbytes is not installed.*pip install 'minitrain\[quant\]'"):
        require_bitsandbytes()
    with pytest.raises(UserError, match=r"pip install 'minitrain\[quant\]'"):
        quantize_hook("nf4")


def test_bad_kind_or_compute_dtype():
    with pytest.raises(UserError, match="kind 'fp8'"):
        quantize_hook("fp8")
    with pytest.raises(UserError, match="compute_dtype"):
        quantize_hook("nf4", compute_dtype=torch.int8)


def test_nf4_gradients_survive_an_eval_forward(hf_causal, ids):
    """An evaluation (eval() + no_grad) must not change what backward computes afterwards.

    bitsandbytes repacks a CPU Linear4bit's weight on its first eval + no_grad forward, and the
    repacked kernel passes no gradient (torch only warns): gradients into the embedding came out
    about 3x smaller after one evaluation. quantize_hook keeps one layout."""
    model = load_pretrained(hf_causal("quant_llama"), from_hf_config,
                            tensor_hook=quantize_hook("nf4", compute_dtype=torch.float32))
    emb = model.input_embeddings.weight.requires_grad_(True)

    def grad() -> torch.Tensor:
        emb.grad = None
        model(ids).float().pow(2).mean().backward()
        return emb.grad.clone()

    before = grad()
    model.eval()
    with torch.no_grad():
        model(ids)
    model.train()
    torch.testing.assert_close(grad(), before, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_parameter_counts_are_logical_with_a_quantized_base(hf_causal, kind, tmp_path, capsys):
    """The model line, the trainable report and the audit count weights, not packed bytes: an nf4
    base is transformers' own `num_parameters()` (before: the packed 4-bit bytes, half of each layer)."""
    import shutil

    import transformers
    from _tok import make_bpe_tokenizer

    from minitrain.adapters.lora import count_parameters, trainable_report
    from minitrain.audit import audit
    from minitrain.config import TrainConfig
    from minitrain.objectives.sft import sft
    from minitrain.run import attach_adapters, load_model

    folder = tmp_path / "model"
    shutil.copytree(hf_causal("quant_count"), folder)
    make_bpe_tokenizer(folder)
    want = transformers.AutoModelForCausalLM.from_pretrained(folder).num_parameters()
    cfg = TrainConfig(model=str(folder), device="cpu", quantize=kind, lora_r=4, lora_targets=["q_proj", "v_proj"])
    model, _ = load_model(cfg, from_hf_config)
    assert count_parameters(model) == want
    assert f"(llama, {want:,} parameters)" in capsys.readouterr().out
    attach_adapters(model, cfg)
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert f"trainable: {lora:,} of {want + lora:,} parameters" in trainable_report(model)
    ids = torch.randint(3, 128, (1, 8))
    report = audit(model, sft, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    assert report.frozen_numel == want


def test_bitsandbytes_imports_without_noise():
    """bitsandbytes' import logs a failed optional-kernel download on CPUs with AVX512-BF16 ("Failed to
    load CPU gemm_4bit_forward ... No module named 'kernels'"): nothing for the user to do, so nothing shown."""
    import subprocess
    import sys

    pytest.importorskip("bitsandbytes")
    p = subprocess.run([sys.executable, "-c", "from minitrain.adapters.quant import require_bitsandbytes; "
                        "require_bitsandbytes()"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stderr == "" and p.stdout == "", p.stderr
