"""The memory plan (`minitrain.plan`, `minitrain plan`) against what the CPU can measure.

- persistent terms are exact: weights (fp32, bf16, nf4 with and without double quantization,
  int8), adapters, gradients and AdamW state are counted tensor by tensor and must equal the plan
  to the byte;
- activations: the peak bytes allocated during a steady-state training step (forward, loss,
  backward, clip, AdamW step; the optimizer state already exists) are measured on the CPU with
  `torch.profiler`'s memory events (`minitrain.plan.measure.measure_peak_allocated`: every allocation and
  free of the CPU allocator in order, the running sum's maximum) and compared with the plan's
  activation peak + gradients: within 20% for fp32 and bf16 autocast, with and without
  checkpointing, GQA, attention-only and all-linear adapters, a 32k vocabulary (logits-bound),
  a 4-bit base, an int8 base with checkpointing and a DPO step (reference forward + policy forward of
  [chosen; rejected]);
- T5 (v1.0 relu + tied scaled head, v1.1 gated-gelu + own head): the same exact terms, each
  block's saved tensors equal to the bytes the autograd graph keeps (enumerated with
  saved-tensor hooks), and seq2seq step peaks within 20% (fp32 and bf16 autocast, with and
  without checkpointing, dropout + lora_dropout, a 32k vocabulary with a frozen and an adapted head).
  RSS is not used: the allocator returns memory to the OS lazily and other processes share the
  machine, so it says little about one step.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
import sys
from pathlib import Path

import pytest
import torch

import models
from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.config import parse_bytes
from minitrain.errors import UserError
from minitrain.plan.decoder import ModelShape, adapter_terms, block_saved, head_is_frozen, weight_terms
from minitrain.plan.measure import measure_peak_allocated
from minitrain.plan.predict import predict, run_shape, shape_from_hf, suggestions
from minitrain.plan.run_shape import RESERVE_CONTEXT, RESERVE_SLACK, GiB, RunShape, fmt_bytes
from minitrain.plan.t5 import T5Shape
from minitrain.train import build_optimizer, enable_checkpointing, train

ROOT = Path(__file__).resolve().parents[1]
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = ATTN + ("gate_proj", "up_proj", "down_proj")


def hf_config(**kw) -> dict:
    d = dict(model_type="llama", vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    d.update(kw)
    return d


def build(hf: dict, dtype=torch.float32, targets=ATTN, r=16, quantize=None, lrc_rank=0.0, **hook_options):
    torch.manual_seed(0)
    model = models.from_hf_config(hf).to(dtype)
    if quantize:
        if quantize != "ternary":
            pytest.importorskip("bitsandbytes")
        from minitrain.adapters.quant import quantize_hook

        hook = quantize_hook(quantize, compute_dtype=dtype, **hook_options)
        for name, m in list(model.named_modules()):
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                assert hook(model, name + ".weight", m.weight.data)
    pattern = {}
    if lrc_rank:
        from minitrain.adapters.lrc import lrc_ranks

        r, pattern = lrc_ranks(model, list(targets), lrc_rank)
    cfg = LoRAConfig(r=r, alpha=2 * r, dropout=0.0, targets=list(targets), rank_pattern=pattern)
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    return model


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def quant_state_tensors(p) -> list:
    qs = getattr(p, "quant_state", None)
    out = []
    if qs is not None:
        out += [qs.absmax, qs.code, getattr(qs, "offset", None)]
        if getattr(qs, "state2", None) is not None:
            out += [qs.state2.absmax, qs.state2.code]
    if getattr(p, "SCB", None) is not None:
        out.append(p.SCB)
    return out


# ----------------------------------------------------------------------------- exact terms


@pytest.mark.parametrize("dtype,compute", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("tied", [False, True])
def test_weights_adapters_optimizer_grads_exact(dtype, compute, tied):
    hf = hf_config(num_key_value_heads=2, tie_word_embeddings=tied)
    model = build(hf, dtype, ALL, r=8)
    ms, run = ModelShape.from_hf(hf), RunShape(rows=2, seq=16, compute=compute, lora_r=8, lora_targets=ALL)
    base = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = sum(t.bytes for t in weight_terms(ms, run))
    assert weights == tensor_bytes(base)
    assert predict(ms, run).term("adapters") == tensor_bytes(trainable)
    assert ms.num_params() == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) - sum(
        p.numel() for p in trainable)
    # gradients and AdamW state after one step
    opt = build_optimizer([(n, p) for n, p in model.named_parameters() if p.requires_grad], 0.0, 1e-3,
                          torch.device("cpu"))
    ids = torch.randint(0, 2048, (2, 16))
    model(ids).float().pow(2).mean().backward()
    assert predict(ms, run).term("gradients") == tensor_bytes(p.grad for p in trainable)
    opt.step()
    state = [v for s in opt.state.values() for v in s.values()]
    assert predict(ms, run).term("optimizer (AdamW)") == tensor_bytes(state)


@pytest.mark.parametrize("kind,double_quant", [("nf4", True), ("nf4", False), ("int8", False)])
def test_quantized_weights_exact(kind, double_quant):
    pytest.importorskip("bitsandbytes")
    from minitrain.adapters.quant import quantize_hook

    hf = hf_config(num_key_value_heads=2, hidden_size=192, intermediate_size=520)  # sizes not multiples of 64*256
    torch.manual_seed(0)
    model = models.from_hf_config(hf).to(torch.bfloat16)
    hook = quantize_hook(kind, compute_dtype=torch.bfloat16, double_quant=double_quant)
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            assert hook(model, name + ".weight", m.weight.data)
    linears = [m.weight for n, m in model.named_modules() if n.startswith("model.layers.") and hasattr(m, "weight")
               and not n.endswith("norm")]
    measured = tensor_bytes(linears) + sum(tensor_bytes(quant_state_tensors(w)) for w in linears)
    run = RunShape(rows=1, seq=8, compute="bf16", quantize=kind, double_quant=double_quant)
    terms = {t.name: t.bytes for t in weight_terms(ModelShape.from_hf(hf), run)}
    assert terms["weights: block linears"] == measured
    rest = [p for n, p in model.named_parameters() if not n.startswith("model.layers.") or "norm" in n]
    assert terms["weights: embeddings + head"] + terms["weights: norms"] == tensor_bytes(rest)


@pytest.mark.parametrize("extra", [dict(model_type="qwen2"), dict(model_type="qwen3", tie_word_embeddings=True),
                                   dict(model_type="llama", attention_bias=True)])
def test_qwen_weights_exact(extra):
    hf = hf_config(num_key_value_heads=2, head_dim=64, **extra)
    model = build(hf, torch.bfloat16, ALL, r=8)
    ms = ModelShape.from_hf(hf)
    run = RunShape(rows=1, seq=8, compute="bf16", lora_r=8, lora_targets=ALL)
    base = [p for p in model.parameters() if not p.requires_grad]
    assert sum(t.bytes for t in weight_terms(ms, run)) == tensor_bytes(base)
    assert ms.num_params() == sum(p.numel() for p in {id(p): p for p in base}.values())


@pytest.mark.parametrize("scale", ["tensor", "channel"])
def test_ternary_weights_and_lrc_rank_adapters_exact(scale):
    hf = hf_config(num_key_value_heads=2, hidden_size=192, intermediate_size=522)  # rows not multiples of 4
    model = build(hf, torch.bfloat16, ALL, quantize="ternary", lrc_rank=0.15, ternary_scale=scale)
    blocks = [m for n, m in model.named_modules() if n.startswith("model.layers.") and hasattr(m, "weight_scale")]
    measured = tensor_bytes(m.weight for m in blocks) + tensor_bytes(m.weight_scale for m in blocks)
    run = RunShape(rows=1, seq=8, compute="bf16", quantize="ternary", ternary_scale=scale, lrc_rank=0.15,
                     lora_targets=ALL)
    ms = ModelShape.from_hf(hf)
    terms = {t.name: t.bytes for t in weight_terms(ms, run)}
    assert terms["weights: block linears"] == measured
    # 0.15 x min(in, out): 28 for 192-wide, 9 for the kv projections (2 heads x 48 = 96 wide)
    assert {m.r for m in blocks} == {28, 14}
    assert predict(ms, run).term("adapters") == tensor_bytes(p for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- activations, measured


def batch_of(rows: int, seq: int, vocab: int, prompt: float = 0.4, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    for i in range(1, rows, 2):
        mask[i, seq - seq // (i + 2):] = 0  # right padding of different lengths
    labels = ids.clone()
    labels[:, : int(seq * prompt)] = -100
    labels[mask == 0] = -100
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def measured_step(model, objective, batch: dict, autocast: bool) -> int:
    """Peak bytes allocated during one steady-state training step, as the loop does it."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    opt = build_optimizer(named, 0.0, 1e-4, torch.device("cpu"))

    def step():
        b = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss_sum, count, _ = objective(model, b)
        loss_sum.float().backward()
        del loss_sum  # its graph with it, as the loop (`minitrain.train`) drops it after the backward
        torch._foreach_mul_([p.grad for p in params], 1.0 / float(count))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the AdamW state: the next step is the steady state
    peak, _ = measure_peak_allocated(step)
    return peak


CASES = {
    "fp32 attn": dict(),
    "fp32 attn ckpt": dict(ckpt=True),
    "fp32 all-linear gqa": dict(targets=ALL, kv=2),
    "fp32 all-linear gqa ckpt": dict(targets=ALL, kv=2, ckpt=True),
    "fp32 all-linear gqa ckpt 2 of 4": dict(targets=ALL, kv=2, ckpt=2),  # checkpointing=N: the first N blocks
    "bf16 all-linear ckpt 1 of 4": dict(targets=ALL, compute="bf16", ckpt=1),
    "fp32 vocab32k ckpt 3 of 4 all-linear": dict(vocab=32000, seq=192, targets=ALL, ckpt=3),
    "bf16 all-linear": dict(targets=ALL, compute="bf16"),
    "bf16 all-linear ckpt": dict(targets=ALL, compute="bf16", ckpt=True),
    "fp32 vocab32k": dict(vocab=32000, seq=192),
    "fp32 vocab32k ckpt all-linear": dict(vocab=32000, seq=192, targets=ALL, ckpt=True),
    "fp32 vocab32k adapted head": dict(vocab=32000, seq=192, targets=ATTN + ("lm_head",)),  # checkpointed loss
    "nf4 all-linear": dict(targets=ALL, quantize="nf4"),
    # int8: its bases run through `frozen_int8_matmul`, whose node keeps no input (bitsandbytes' own kept each
    # linear's input out of checkpointing's reach: measured 47.7 MB, now 27.7 MB for the first case); the
    # attention-only case's MLP bases are plain int8 linears (`frozen_linear8bit`), unwrapped
    "int8 all-linear gqa ckpt": dict(targets=ALL, kv=2, quantize="int8", ckpt=True),
    "int8 all-linear gqa ckpt 2 of 4": dict(targets=ALL, kv=2, quantize="int8", ckpt=2),
    "int8 attention ckpt": dict(quantize="int8", ckpt=True),
    "int8 all-linear gqa": dict(targets=ALL, kv=2, quantize="int8"),
    "ternary all-linear lrc 15% ckpt": dict(targets=ALL, kv=2, quantize="ternary", lrc=0.15, ckpt=True),
    "bf16 ternary all-linear": dict(targets=ALL, compute="bf16", quantize="ternary"),
    "qwen3 all-linear gqa": dict(targets=ALL, kv=2, model_type="qwen3"),
    "qwen3 ternary all-linear lrc 15% ckpt": dict(targets=ALL, kv=2, quantize="ternary", lrc=0.15, ckpt=True,
                                                  model_type="qwen3"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sft_step_peak_within_20_percent(case):
    from minitrain.objectives.sft import sft

    c = dict(targets=ATTN, kv=4, ckpt=False, compute="fp32", vocab=2048, rows=4, seq=256, quantize=None, lrc=0.0,
             model_type="llama")
    c.update(CASES[case])
    hf = hf_config(vocab_size=c["vocab"], num_key_value_heads=c["kv"], model_type=c["model_type"], head_dim=64)
    dtype = torch.bfloat16 if c["compute"] == "bf16" else torch.float32
    model = build(hf, dtype, c["targets"], quantize=c["quantize"], lrc_rank=c["lrc"])
    if c["ckpt"]:
        assert enable_checkpointing(model, c["ckpt"]) == (4 if c["ckpt"] is True else c["ckpt"])
    batch = batch_of(c["rows"], c["seq"], c["vocab"])
    measured = measured_step(model, sft, batch, autocast=c["compute"] == "bf16")
    targets = int((batch["labels"][:, 1:] != -100).sum())
    run = RunShape(rows=c["rows"], seq=c["seq"], compute=c["compute"], lora_targets=c["targets"],
                     checkpointing=c["ckpt"], targets=targets, quantize=c["quantize"] or "none", device="cpu",
                     lrc_rank=c["lrc"], real_tokens=int(batch["attention_mask"].sum()))
    plan = predict(ModelShape.from_hf(hf), run)
    predicted = plan.activation_peak + plan.term("gradients")
    assert 0.8 <= predicted / measured <= 1.2, (case, plan.peak_moment, fmt_bytes(predicted), fmt_bytes(measured))


def test_the_loop_drops_a_micro_batch_graph_after_its_backward(tmp_path):
    """The plan counts what an autograd node holds outside its saved tensors (an int8 base's input, which
    bitsandbytes keeps on its node) to the end of the backward: the loop must not keep the graph (its loss)
    through the optimizer step and into the next micro-batch's forward."""
    import weakref

    from minitrain.objectives.sft import sft
    from test_train import TinyLM, cfg_for, collate, freeze_embeddings, make_examples, quiet

    kept = []

    class Held(torch.autograd.Function):  # keeps a tensor on its node, as bitsandbytes' int8 matmul does
        @staticmethod
        def forward(ctx, x):
            ctx.kept = torch.ones(1)
            kept.append(weakref.ref(ctx.kept))
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    alive = []

    def objective(model, batch):
        alive.append(sum(r() is not None for r in kept))  # the earlier micro-batches' nodes, at this forward
        loss_sum, count, metrics = sft(model, batch)
        return Held.apply(loss_sum), count, metrics

    train(freeze_embeddings(TinyLM(d=8, layers=1)), objective, make_examples(16), collate,
          cfg_for(tmp_path, batch_size=4, grad_accum=2, max_steps=2), log=quiet)
    assert len(alive) >= 4 and not any(alive), alive


def test_partial_checkpointing_peak_is_planned_neither_as_none_nor_as_all():
    """checkpointing=2 of 4 blocks: the plan (2 block inputs + 2 blocks' saved tensors) within 20% of
    the measured step, where the plans of no checkpointing and of every block are not."""
    from minitrain.objectives.sft import sft

    hf = hf_config(num_key_value_heads=2, head_dim=64)
    model = build(hf, torch.float32, ALL)
    assert enable_checkpointing(model, 2) == 2
    assert [getattr(b, "_minitrain_checkpointed", False) for b in model.model.layers] == [True, True, False, False]
    batch = batch_of(4, 256, 2048)
    measured = measured_step(model, sft, batch, autocast=False)
    run = RunShape(rows=4, seq=256, compute="fp32", lora_targets=ALL, checkpointing=2, device="cpu",
                   targets=int((batch["labels"][:, 1:] != -100).sum()), real_tokens=int(batch["attention_mask"].sum()))
    ratio = {}
    for k in (0, 2, True):
        plan = predict(ModelShape.from_hf(hf), replace(run, checkpointing=k))
        ratio[k] = (plan.activation_peak + plan.term("gradients")) / measured
        if k == 2:
            names = [t.name for t in plan.moments[plan.peak_moment]]
            assert "block inputs x 2 (checkpointing)" in names and "saved activations x 2 blocks" in names
    assert 0.8 <= ratio[2] <= 1.2 and not 0.8 <= ratio[0] <= 1.2 and not 0.8 <= ratio[True] <= 1.2, ratio


@pytest.mark.parametrize("ckpt", [False, True])
def test_dpo_step_peak_within_20_percent(ckpt):
    dpo = pytest.importorskip("minitrain.objectives.dpo")
    hf = hf_config(num_key_value_heads=2)
    model = build(hf, torch.float32, ALL)
    if ckpt:
        enable_checkpointing(model)
    pairs, seq = 2, 256
    b = batch_of(2 * pairs, seq, 2048)
    b["input_ids"][pairs:, : int(seq * 0.4)] = b["input_ids"][:pairs, : int(seq * 0.4)]  # shared prompts
    b["num_pairs"] = pairs
    objective = dpo.make_dpo_objective(beta=0.1, reference=dpo.BaseReference())
    measured = measured_step(model, objective, b, autocast=False)
    run = RunShape(rows=2 * pairs, seq=seq, compute="fp32", lora_targets=ALL, checkpointing=ckpt,
                     targets=int((b["labels"][:, 1:] != -100).sum()), dpo_reference="base", device="cpu",
                     real_tokens=int(b["attention_mask"].sum()))
    plan = predict(ModelShape.from_hf(hf), run)
    predicted = plan.activation_peak + plan.term("gradients")
    assert 0.8 <= predicted / measured <= 1.2, (plan.peak_moment, fmt_bytes(predicted), fmt_bytes(measured))


# ----------------------------------------------------------------------------- distillation

TEACHER = dict(hidden_size=384, intermediate_size=768, num_hidden_layers=6, num_attention_heads=6)
DISTILL_CASES = {
    "kd + ce": dict(),
    "kd + ce ckpt vocab32k": dict(ckpt=True, vocab=32000),
    "top-k ckpt vocab32k": dict(ckpt=True, vocab=32000, top_k=64),
    "feature + attention": dict(captured=True),
    "feature + attention ckpt": dict(ckpt=True, captured=True),
}


@pytest.mark.parametrize("case", list(DISTILL_CASES))
def test_distill_step_peak_within_20_percent(case):
    """The student's step with the teacher's forward and the KD chunks (`plan._kd_logits`), and the
    captured layers of feature matching and attention transfer (`_kd_captured`)."""
    from minitrain.objectives.distill import attach_projections, make_distill_objective

    c = dict(ckpt=False, vocab=2048, top_k=0, captured=False)
    c.update(DISTILL_CASES[case])
    hf = hf_config(num_key_value_heads=2, vocab_size=c["vocab"])
    thf = hf_config(num_key_value_heads=2, vocab_size=c["vocab"], **TEACHER)
    student = build(hf, torch.float32, ALL)
    teacher = models.from_hf_config(thf)
    if c["ckpt"]:
        enable_checkpointing(student)
    last = {3: 5} if c["captured"] else {}
    if last:
        attach_projections(student, teacher, last)
    objective = make_distill_objective(teacher, temperature=2.0, kd_weight=0.5, ce_weight=0.5, top_k=c["top_k"],
                                       feature_weight=0.1 if last else 0.0, attention_weight=0.1 if last else 0.0,
                                       feature_map=last, attention_map=last)
    batch = batch_of(4, 256, c["vocab"])
    measured = measured_step(student, objective, batch, autocast=False)
    run = RunShape(rows=4, seq=256, compute="fp32", lora_targets=ALL, checkpointing=c["ckpt"], device="cpu",
                     targets=int((batch["labels"][:, 1:] != -100).sum()), real_tokens=int(batch["attention_mask"].sum()),
                     teacher=ModelShape.from_hf(thf), kd_top_k=c["top_k"], kd_features=len(last),
                     kd_attention=len(last))
    plan = predict(ModelShape.from_hf(hf), run)
    predicted = plan.activation_peak + plan.term("gradients")
    assert 0.8 <= predicted / measured <= 1.2, (case, plan.peak_moment, fmt_bytes(predicted), fmt_bytes(measured))


@pytest.mark.parametrize("dtype,compute", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_distill_teacher_weights_exact_and_read_from_the_recipe(tmp_path, dtype, compute):
    """The teacher's weights join the persistent terms to the byte (it runs frozen in the compute
    dtype), and `run_shape` reads the teacher from a distillation config's `teacher=` folder."""
    import importlib.util

    thf = hf_config(num_key_value_heads=2, tie_word_embeddings=True, **TEACHER)
    teacher = models.from_hf_config(thf).to(dtype)
    hf = hf_config(num_key_value_heads=2)
    run = RunShape(rows=2, seq=16, compute=compute, lora_targets=ALL, teacher=ModelShape.from_hf(thf))
    with_teacher, alone = predict(ModelShape.from_hf(hf), run), predict(ModelShape.from_hf(hf),
                                                                             replace(run, teacher=None))
    teacher_bytes = sum(t.bytes for t in with_teacher.persistent if t.name.startswith("teacher "))
    assert teacher_bytes == tensor_bytes({id(p): p for p in teacher.parameters()}.values())
    assert with_teacher.persistent_bytes == alone.persistent_bytes + teacher_bytes
    (tmp_path / "config.json").write_text(json.dumps(thf))
    spec = importlib.util.spec_from_file_location("distill_recipe", ROOT / "recipes" / "distill_llama.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    cfg = replace(recipe.config, teacher=str(tmp_path), top_k=256, feature_weight=0.1, attention_weight=0.1)
    got = run_shape(cfg, device="cuda")
    assert got.teacher == ModelShape.from_hf(thf) and got.kd_top_k == 256
    assert (got.kd_features, got.kd_attention) == (-1, 1)  # every student layer (the default), the last one
    assert run_shape(replace(cfg, teacher=str(tmp_path / "nowhere"))).teacher is None


# ----------------------------------------------------------------------------- full fine-tuning


def full_model(hf: dict) -> torch.nn.Module:
    """Every weight trains in fp32, as `finetune=full` loads and unfreezes it."""
    torch.manual_seed(0)
    model = models.from_hf_config(hf)
    model.tie_weights()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_full_finetune_weights_grads_optimizer_exact(tied):
    hf = hf_config(num_key_value_heads=2, tie_word_embeddings=tied)
    model = full_model(hf)
    ms, run = ModelShape.from_hf(hf), RunShape(rows=2, seq=16, compute="bf16", full=True)
    params = list(model.parameters())  # a tied head once
    assert sum(t.bytes for t in weight_terms(ms, run)) == tensor_bytes(params)  # fp32 whatever the compute
    assert sum(ms.all_tensors()) == sum(p.numel() for p in params) == ms.num_params()
    opt = build_optimizer(list(model.named_parameters()), 0.0, 1e-3)
    model.output_projection(model(torch.randint(0, 2048, (2, 16)))).float().pow(2).mean().backward()
    terms = {t.name: t.bytes for t in adapter_terms(ms, run)}
    assert terms["adapters"] == 0 and terms["gradients"] == tensor_bytes(p.grad for p in params)
    opt.step()
    assert terms["optimizer (AdamW)"] == tensor_bytes(v for st in opt.state.values() for v in st.values())
    with_ema = {t.name: t.bytes for t in adapter_terms(ms, replace(run, ema=True))}
    assert with_ema["EMA of the trained tensors"] == tensor_bytes(params)  # minitrain.ema: one fp32 copy


FULL_CASES = {"fp32": dict(), "fp32 ckpt": dict(ckpt=True), "bf16": dict(compute="bf16"),
              "bf16 ckpt gqa": dict(compute="bf16", ckpt=True, kv=2), "fp32 ckpt 2 of 4": dict(ckpt=2),
              "bf16 ckpt 3 of 4": dict(compute="bf16", ckpt=3)}


@pytest.mark.parametrize("case", list(FULL_CASES))
def test_full_finetune_step_peak_within_20_percent(case):
    """fp32 weights under bf16 autocast too; the gradients (set_to_none between steps) are in the
    moments where they exist, so the activation peak alone is compared with the measured step."""
    from minitrain.objectives.sft import sft

    c = {"kv": 4, "ckpt": False, "compute": "fp32", "rows": 4, "seq": 256, **FULL_CASES[case]}
    hf = hf_config(num_key_value_heads=c["kv"])
    model = full_model(hf)
    if c["ckpt"]:
        enable_checkpointing(model, c["ckpt"])
    batch = batch_of(c["rows"], c["seq"], 2048)
    measured = measured_step(model, sft, batch, autocast=c["compute"] == "bf16")
    run = RunShape(rows=c["rows"], seq=c["seq"], compute=c["compute"], checkpointing=c["ckpt"], device="cpu",
                     targets=int((batch["labels"][:, 1:] != -100).sum()), full=True)
    plan = predict(ModelShape.from_hf(hf), run)
    assert plan.term("gradients") == 0  # not persistent: in the moments
    assert 0.8 <= plan.activation_peak / measured <= 1.2, (case, plan.peak_moment, plan.activation_peak, measured)


def test_full_finetune_plan_of_a_recipe_and_its_suggestion(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL_7B))
    p = plan_cli(str(ROOT / "recipes" / "sft_llama.py"), f"model={tmp_path}", "batch_size=1", "max_len=1024",
                 "finetune=full", "checkpointing=true", "--gpu-mem", "80GiB")
    assert p.returncode == 1, p.stderr  # 7B x (4 weight + 4 grad + 8 AdamW) B = 112 GiB: no single GPU
    assert "full fine-tuning: every weight trains" in p.stdout and "DOES NOT FIT" in p.stdout
    assert "finetune=lora" in p.stdout and "quantize=nf4" not in p.stdout
    n = ModelShape.from_hf(MISTRAL_7B).num_params()
    weights = sum(t.bytes for t in weight_terms(ModelShape.from_hf(MISTRAL_7B), RunShape(1, 8, full=True)))
    assert weights == 4 * n


# ----------------------------------------------------------------------------- the model's logic


MISTRAL_7B = dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  sliding_window=None, tie_word_embeddings=False)


def qlora_dpo_7b(**kw) -> RunShape:
    base = dict(rows=2, seq=1024, compute="bf16", quantize="nf4", lora_r=16, lora_targets=ALL, checkpointing=True,
                dpo_reference="base")
    base.update(kw)
    return RunShape(**base)


def test_qlora_dpo_7b_prediction_under_8gb():
    """The target of field report 002: QLoRA DPO on Mistral-7B, seq 1024, one pair, checkpointing."""
    plan = predict(ModelShape.from_hf(MISTRAL_7B), qlora_dpo_7b())
    assert 7.2e9 < ModelShape.from_hf(MISTRAL_7B).num_params() < 7.3e9  # Mistral-7B: 7.24B
    needed = plan.peak * (1 + RESERVE_SLACK) + RESERVE_CONTEXT
    assert needed <= 8e9, fmt_bytes(needed)
    assert plan.peak > 4 * GiB  # the nf4 base alone is ~3.9 GiB: a plan below that is broken


def test_each_suggestion_lowers_the_peak():
    ms = ModelShape.from_hf(MISTRAL_7B)
    run = RunShape(rows=4, seq=2048, compute="bf16", lora_targets=ALL, dpo_reference="snapshot")
    base = predict(ms, run).peak
    tips = dict((k.split()[0], (saving, peak)) for k, saving, peak in suggestions(ms, run, 2, 4))
    assert {"quantize=nf4", "checkpointing=true", "batch_size=1", "precompute_ref=true"} <= set(tips)
    for saving, peak in tips.values():
        assert saving > 0 and peak == base - saving
    assert tips["quantize=nf4"][0] > 8 * GiB  # bf16 7B linears -> nf4
    assert predict(ms, qlora_dpo_7b(checkpointing=False)).peak > predict(ms, qlora_dpo_7b()).peak


def test_activations_scale_with_tokens_and_checkpointing_keeps_block_inputs():
    ms = ModelShape.from_hf(hf_config())
    a = predict(ms, RunShape(rows=2, seq=128, compute="fp32", mask=False))
    b = predict(ms, RunShape(rows=4, seq=128, compute="fp32", mask=False))
    block_a = sum(t.bytes for t in block_saved(ms, RunShape(rows=2, seq=128, compute="fp32", mask=False)))
    block_b = sum(t.bytes for t in block_saved(ms, RunShape(rows=4, seq=128, compute="fp32", mask=False)))
    assert block_b == 2 * block_a
    assert b.activation_peak > a.activation_peak
    ck = predict(ms, RunShape(rows=4, seq=128, compute="fp32", mask=False, checkpointing=True))
    assert ck.activation_peak < b.activation_peak


def test_from_hf_defaults_and_refusals():
    m = ModelShape.from_hf({"model_type": "mistral", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 128,
                              "num_hidden_layers": 2, "num_attention_heads": 4})
    assert m.num_key_value_heads == 8  # HF's MistralConfig default
    assert m.head_dim == 16 and m.sliding_window == 4096
    with pytest.raises(UserError, match="the memory plan models LLaMA, Mistral"):
        shape_from_hf({"model_type": "gpt2"})
    assert isinstance(shape_from_hf({"model_type": "t5"}), T5Shape)  # transformers' T5Config defaults
    assert shape_from_hf({"model_type": "t5"}).num_decoder_layers == 6
    with pytest.raises(UserError, match="d_model"):
        shape_from_hf({"model_type": "t5", "d_model": "512"})
    with pytest.raises(UserError, match="missing"):
        ModelShape.from_hf({"model_type": "llama", "vocab_size": 10})


def test_parse_and_format_bytes():
    assert parse_bytes("12GiB") == 12 * 2**30
    assert parse_bytes("24GB") == 24 * 10**9
    assert parse_bytes("1.5 gib") == int(1.5 * 2**30)
    assert parse_bytes("8") == 8 * 2**30
    with pytest.raises(UserError, match="not a size"):
        parse_bytes("lots")
    assert fmt_bytes(3 * 2**30) == "3.00 GiB" and fmt_bytes(512) == "512 B"


# ----------------------------------------------------------------------------- minitrain plan


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minitrain", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_plan_tool_table_verdict_and_exit_codes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL_7B))
    common = [str(ROOT / "recipes" / "sft_llama.py"), f"model={tmp_path}", "batch_size=1", "max_len=1024"]
    ok = plan_cli(*common, "quantize=nf4", "checkpointing=true", "--gpu-mem", "12GiB")
    assert ok.returncode == 0, ok.stderr
    assert "weights: block linears" in ok.stdout and "FITS in 12.00 GiB" in ok.stdout
    assert "block inputs x 32 (checkpointing)" in ok.stdout
    big = plan_cli(*common, "checkpointing=false", "--gpu-mem=12GiB")
    assert big.returncode == 1 and "DOES NOT FIT" in big.stdout
    assert "quantize=nf4" in big.stdout and "checkpointing=true" in big.stdout  # what to change, with savings
    bad = plan_cli(*common, "--gpu-mem", "lots")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --gpu-mem lots: not a size")
    unknown = plan_cli(*common, "lr_typo=1")
    assert unknown.returncode == 2 and "error:" in unknown.stderr


def test_plan_tool_follows_the_recipes_device(tmp_path):
    """device=cpu plans a CPU run (no CUDA context in the verdict, the CPU loss chunk) without --device;
    --device still wins, and device=auto plans for CUDA."""
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL_7B))
    common = [str(ROOT / "recipes" / "sft_llama.py"), f"model={tmp_path}", "batch_size=1", "max_len=1024"]
    cpu = plan_cli(*common, "device=cpu")
    assert cpu.returncode == 0, cpu.stderr
    assert "run: cpu," in cpu.stdout
    assert "run: cuda," in plan_cli(*common, "device=cpu", "--device", "cuda").stdout
    assert "run: cuda," in plan_cli(*common).stdout


# ----------------------------------------------------------------------------- the other decoder families

# each family's particulars at plan-test sizes: Qwen2's biases, Qwen3's q/k norms and wide heads,
# Gemma 2's soft-capped (written-out) attention and capped head, Gemma 3's norms and sliding layers,
# Phi-3's fused linears with and without GQA
FAMILIES = {
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=96, tie_word_embeddings=True),
    "gemma2": dict(model_type="gemma2", num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
                   sliding_window=128, tie_word_embeddings=True),
    "gemma3": dict(model_type="gemma3_text", num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
                   sliding_window=128, sliding_window_pattern=2, tie_word_embeddings=True),
    "phi3": dict(model_type="phi3", num_key_value_heads=4),
    "phi3_gqa": dict(model_type="phi3", num_key_value_heads=2),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_params_and_adapters_exact(name):
    """Parameters (norms, biases, tied heads) and LoRA tensors on every linear (LLaMA's target names
    select Phi-3's fused linears) counted as the model built from the same config.json has them."""
    hf = hf_config(**FAMILIES[name])
    shape = shape_from_hf(hf)
    with torch.device("meta"):
        model = models.from_hf_config(hf)
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    cfg = LoRAConfig(r=8, targets=list(ALL))
    apply_lora(model, cfg)
    lora = [p.numel() for n, p in model.named_parameters() if "lora_" in n]
    assert sorted(shape.trainable_tensors(RunShape(rows=1, seq=8, lora_r=8, lora_targets=ALL))) == sorted(lora)


FAMILY_CASES = {
    "qwen2 fp32": dict(),
    "qwen3 bf16 ckpt": dict(compute="bf16", ckpt=True),
    "gemma2 fp32": dict(),
    "gemma2 bf16 ckpt vocab32k": dict(compute="bf16", ckpt=True, vocab=32000, seq=192),  # the capped head's chunks
    "gemma3 fp32 ckpt": dict(ckpt=True),
    "phi3 fp32": dict(),
    "phi3_gqa bf16": dict(compute="bf16"),
}


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_family_step_peak_within_20_percent(case):
    from minitrain.objectives.sft import sft

    c = dict(ckpt=False, compute="fp32", vocab=2048, seq=256)
    c.update(FAMILY_CASES[case])
    hf = hf_config(vocab_size=c["vocab"], **FAMILIES[case.split()[0]])
    model = build(hf, torch.bfloat16 if c["compute"] == "bf16" else torch.float32, ALL)
    if c["ckpt"]:
        enable_checkpointing(model)
    batch = batch_of(4, c["seq"], c["vocab"])
    measured = measured_step(model, sft, batch, autocast=c["compute"] == "bf16")
    run = RunShape(rows=4, seq=c["seq"], compute=c["compute"], lora_targets=ALL, checkpointing=c["ckpt"],
                     targets=int((batch["labels"][:, 1:] != -100).sum()), device="cpu",
                     real_tokens=int(batch["attention_mask"].sum()))
    plan = predict(shape_from_hf(hf), run)
    predicted = plan.activation_peak + plan.term("gradients")
    assert 0.8 <= predicted / measured <= 1.2, (case, plan.peak_moment, fmt_bytes(predicted), fmt_bytes(measured))


# ----------------------------------------------------------------------------- T5


T5_ALL = ("q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo")  # recipes/lora_t5.py's targets


def t5_config(v10: bool = False, **kw) -> dict:
    """A tiny T5 v1.0 (relu, tied head scaled by d_model**-0.5) or v1.1 (gated-gelu, own head) config."""
    d = dict(model_type="t5", vocab_size=2048, d_model=256, d_kv=64, d_ff=1024 if v10 else 704, num_layers=2,
             num_decoder_layers=2, num_heads=4, feed_forward_proj="relu" if v10 else "gated-gelu",
             tie_word_embeddings=v10, dropout_rate=0.0)
    d.update(kw)
    return d


def build_t5(hf: dict, dtype=torch.float32, targets=T5_ALL, r=16, lora_dropout=0.0, modules_to_save=()):
    """As the recipe does it: LoRA on the targets, fp32 trainable tensors, training mode (dropout on)."""
    torch.manual_seed(0)
    model = models.from_hf_config(hf).to(dtype)
    leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    targets = [t for t in targets if t in leaves]  # recipes/lora_t5.py keeps the defaults the model has
    cfg = LoRAConfig(r=r, alpha=2 * r, dropout=lora_dropout, targets=list(targets),
                     modules_to_save=list(modules_to_save))
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # minitrain.run.attach_adapters: fp32 master weights
    return model.train()


def seq2seq_batch(rows: int, src: int, tgt: int, vocab: int, seed: int = 0) -> dict:
    """collate_seq2seq's keys: padded sources and targets of different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, src), generator=g)
    mask = torch.ones(rows, src, dtype=torch.long)
    labels = torch.randint(3, vocab, (rows, tgt), generator=g)
    for i in range(1, rows, 2):
        mask[i, src - src // (i + 2):] = 0
        labels[i, tgt - tgt // (i + 2):] = -100
    ids[mask == 0] = 0
    dec = torch.cat([torch.zeros(rows, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "decoder_input_ids": dec.masked_fill(dec == -100, 0), "decoder_attention_mask": (labels != -100).long()}


@pytest.mark.parametrize("dtype,compute", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("v10", [True, False], ids=["v1.0", "v1.1"])
def test_t5_weights_adapters_optimizer_grads_exact(dtype, compute, v10):
    hf = t5_config(v10, d_kv=48, num_decoder_layers=3)  # heads x d_kv != d_model, more decoder than encoder blocks
    model = build_t5(hf, dtype, T5_ALL, r=8)
    ms = shape_from_hf(hf)
    run = RunShape(rows=2, seq=16, target_seq=8, compute=compute, lora_r=8, lora_targets=T5_ALL)
    base = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(t.bytes for t in ms.weight_terms(run)) == tensor_bytes(base)
    assert ms.num_params() == sum(p.numel() for p in base)
    plan = predict(ms, run)
    assert plan.term("adapters") == tensor_bytes(trainable)
    opt = build_optimizer([(n, p) for n, p in model.named_parameters() if p.requires_grad], 0.0, 1e-3,
                          torch.device("cpu"))
    from minitrain.objectives.sft import seq2seq

    loss, _, _ = seq2seq(model, seq2seq_batch(2, 16, 8, hf["vocab_size"]))
    loss.backward()
    assert plan.term("gradients") == tensor_bytes(p.grad for p in trainable)
    opt.step()
    state = [v for s in opt.state.values() for v in s.values()]
    assert plan.term("optimizer (AdamW)") == tensor_bytes(state)


def test_t5_flan_small_and_trained_head_counts():
    from test_lora_t5 import FLAN_T5_SMALL

    ms = shape_from_hf(FLAN_T5_SMALL)
    assert ms.num_params() == 76_961_152  # google/flan-t5-small
    v10 = shape_from_hf(t5_config(True))
    run = RunShape(rows=1, seq=8, lora_targets=("q",), modules_to_save=("shared", "lm_head"))
    assert v10.trainable_tensors(run)[-1:] == [2048 * 256]  # tied: lm_head is `shared`, one tensor
    assert not head_is_frozen(v10, run) and head_is_frozen(v10, RunShape(rows=1, seq=8, lora_targets=("q",)))


def saved_bytes_per_block(model, batch: dict, autocast: bool) -> dict[str, int]:
    """Bytes each block keeps for backward, from saved-tensor hooks: every saved tensor's storage
    (parameters excluded) counted once, for the innermost module running when it was first saved."""
    from minitrain.objectives.sft import seq2seq

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack, seen, hooks = ["model"], {}, []
    for name, m in model.named_modules():
        hooks.append(m.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))  # returns None
        hooks.append(m.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1]))  # None: output unchanged

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault((st.data_ptr(), st.nbytes()), (stack[-1], st.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            seq2seq(model, batch)
    for h in hooks:
        h.remove()
    out: dict[str, int] = {}
    for owner, nbytes in seen.values():
        parts = owner.split(".")
        key = ".".join(parts[:3]) if len(parts) >= 3 and parts[1] == "block" else owner
        out[key] = out.get(key, 0) + nbytes
    return out


SAVED_CASES = {
    "v1.1 fp32": dict(),
    "v1.0 fp32 o,wo": dict(v10=True, targets=("o", "wo")),
    "v1.1 bf16": dict(compute="bf16"),
    "v1.1 fp32 dropout": dict(dropout=0.1, lora_dropout=0.05),
    "v1.0 bf16 dropout q,v,wo": dict(v10=True, compute="bf16", dropout=0.1, lora_dropout=0.05,
                                     targets=("q", "v", "wo")),
    "v1.1 fp32 dropout q,v": dict(dropout=0.1, targets=("q", "v")),
}


@pytest.mark.parametrize("case", list(SAVED_CASES))
def test_t5_block_saved_equals_the_autograd_graph(case):
    """Block 1 of each stack (block 0's input comes from the frozen embedding and needs no grad)."""
    c = dict(v10=False, compute="fp32", targets=T5_ALL, dropout=0.0, lora_dropout=0.0)
    c.update(SAVED_CASES[case])
    hf = t5_config(c["v10"], vocab_size=512, d_model=64, d_kv=16, d_ff=160, num_heads=4, dropout_rate=c["dropout"])
    model = build_t5(hf, torch.bfloat16 if c["compute"] == "bf16" else torch.float32, c["targets"], r=8,
                     lora_dropout=c["lora_dropout"])
    got = saved_bytes_per_block(model, seq2seq_batch(2, 64, 32, 512), autocast=c["compute"] == "bf16")
    ms = shape_from_hf(hf)
    run = RunShape(rows=2, seq=64, target_seq=32, compute=c["compute"], lora_r=8, lora_targets=c["targets"],
                     lora_dropout=c["lora_dropout"], device="cpu")
    assert got["encoder.block.1"] == sum(t.bytes for t in ms.block_saved(run, decoder=False))
    assert got["decoder.block.1"] == sum(t.bytes for t in ms.block_saved(run, decoder=True))


T5_CASES = {
    "v1.1 fp32": dict(),
    "v1.1 fp32 ckpt": dict(ckpt=True),
    "v1.0 fp32": dict(v10=True),
    "v1.0 fp32 ckpt": dict(v10=True, ckpt=True),
    "v1.1 bf16": dict(compute="bf16"),
    "v1.1 bf16 ckpt": dict(compute="bf16", ckpt=True),
    "v1.1 fp32 ckpt 1 of 4": dict(ckpt=1),  # the first encoder block
    "v1.1 bf16 ckpt 3 of 4": dict(compute="bf16", ckpt=3),  # the encoder's two and the first decoder block
    "v1.0 bf16 ckpt": dict(v10=True, compute="bf16", ckpt=True),
    "v1.1 fp32 q,v": dict(targets=("q", "v")),
    "v1.1 fp32 dropout": dict(dropout=0.1, lora_dropout=0.05, rows=2),  # the recipe's (and FLAN-T5's) dropout
    "v1.1 bf16 dropout ckpt": dict(compute="bf16", dropout=0.1, lora_dropout=0.05, rows=2, ckpt=True),
    "v1.1 long source ckpt": dict(src=512, tgt=64, ckpt=True),  # attention-bound backward
    "v1.1 vocab32k": dict(vocab=32000, tgt=192),  # logits-bound, frozen head
    # a LoRA-wrapped head: the loss's checkpointed path
    "v1.0 vocab32k adapted head": dict(v10=True, vocab=32000, tgt=192, targets=("q", "v", "lm_head")),
    "v1.1 bf16 vocab32k adapted head": dict(compute="bf16", vocab=32000, tgt=192, targets=("q", "v", "lm_head")),
}


@pytest.mark.parametrize("case", list(T5_CASES))
def test_t5_step_peak_within_20_percent(case):
    from minitrain.objectives.sft import seq2seq

    c = dict(v10=False, compute="fp32", ckpt=False, targets=T5_ALL, vocab=2048, rows=4, src=256, tgt=128,
             dropout=0.0, lora_dropout=0.0)
    c.update(T5_CASES[case])
    hf = t5_config(c["v10"], vocab_size=c["vocab"], dropout_rate=c["dropout"])
    model = build_t5(hf, torch.bfloat16 if c["compute"] == "bf16" else torch.float32, c["targets"],
                     lora_dropout=c["lora_dropout"])
    if c["ckpt"]:
        assert enable_checkpointing(model, c["ckpt"]) == (4 if c["ckpt"] is True else c["ckpt"])  # T5Block, both stacks
    batch = seq2seq_batch(c["rows"], c["src"], c["tgt"], c["vocab"])
    measured = measured_step(model, seq2seq, batch, autocast=c["compute"] == "bf16")
    run = RunShape(rows=c["rows"], seq=c["src"], target_seq=c["tgt"], compute=c["compute"], lora_targets=c["targets"],
                     lora_dropout=c["lora_dropout"], checkpointing=c["ckpt"],
                     targets=int((batch["labels"] != -100).sum()), device="cpu")
    plan = predict(shape_from_hf(hf), run)
    predicted = plan.activation_peak + plan.term("gradients")
    assert 0.8 <= predicted / measured <= 1.2, (case, plan.peak_moment, fmt_bytes(predicted), fmt_bytes(measured))


def test_plan_tool_on_the_t5_recipe(tmp_path):
    from test_lora_t5 import FLAN_T5_SMALL

    (tmp_path / "config.json").write_text(json.dumps({**FLAN_T5_SMALL, "dropout_rate": 0.1}))
    p = plan_cli(str(ROOT / "recipes" / "lora_t5.py"), f"model={tmp_path}", "--gpu-mem", "8GiB", "--all")
    assert p.returncode == 0, p.stderr
    assert "8 encoder + 8 decoder layers" in p.stdout and "0.08B params" in p.stdout
    assert "8 rows x 512 source + 256 target tokens" in p.stdout  # batch_size, max_len, max_target_len
    assert "saved activations x 8 decoder blocks" in p.stdout and "FITS in 8.00 GiB" in p.stdout
    short = plan_cli(str(ROOT / "recipes" / "lora_t5.py"), f"model={tmp_path}", "max_target_len=64",
                     "checkpointing=true", "--all")
    assert short.returncode == 0 and "512 source + 64 target tokens" in short.stdout
    assert "decoder block inputs x 8 (checkpointing)" in short.stdout


def test_packed_rows_through_flexattention_plan_no_dense_mask():
    """attention=flex (or auto on CUDA with compile) reads a block mask, not the (T, T) one: the plan of
    packed rows / DPO's shared prompt leaves the dense mask's terms out there, and keeps them with sdpa,
    on a CPU (where auto is sdpa) and for GRPO's layout (chosen per batch)."""
    from minitrain.config import SFTConfig
    from minitrain.objectives.dpo import DPOConfig
    from minitrain.objectives.grpo import GRPOConfig

    ms = ModelShape.from_hf(dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8))

    def mask_bytes(cfg, device="cuda"):
        plan = predict(ms, run_shape(cfg, device=device))
        return sum(t.bytes for terms in plan.moments.values() for t in terms if "attention mask" in t.name)

    packed = SFTConfig(packing=True, compile=True, max_len=2048, batch_size=2)
    assert mask_bytes(packed) == 0 and mask_bytes(replace(packed, compile=False, attention="flex")) == 0
    assert mask_bytes(replace(packed, attention="sdpa")) > 0
    assert mask_bytes(replace(packed, compile=False)) > 0  # auto without compile: sdpa
    assert mask_bytes(packed, device="cpu") > 0
    assert mask_bytes(replace(packed, packing=False)) > 0  # a padded batch: its padding mask
    assert mask_bytes(DPOConfig(shared_prompt=True, compile=True, max_len=2048)) == 0
    assert mask_bytes(GRPOConfig(compile=True, max_len=2048)) > 0
    less = predict(ms, run_shape(packed)).peak
    assert less < predict(ms, run_shape(replace(packed, attention="sdpa"))).peak


# ----------------------------------------------------------------------------- mixture of experts

# every layer sparse; Qwen3-MoE's q/k norms, Mixtral's experts of `intermediate_size`
MOE_FAMILIES = {
    "qwen3_moe": dict(model_type="qwen3_moe", num_key_value_heads=2, head_dim=64, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=176, norm_topk_prob=True),
    "mixtral": dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=352),
    # a shared expert beside the routed ones; `gate_proj` / `up_proj` / `down_proj` name its linears (and
    # `down_proj` the experts' too)
    "qwen2_moe": dict(model_type="qwen2_moe", num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=176, shared_expert_intermediate_size=352),
}
# (their exact weights, adapters, gradients and AdamW state: tests/test_plan_moe.py)


# planned / measured when written (the weighted rows index_add_ keeps counted): 0.979, 1.052, 0.977, 0.946, 0.975,
# 1.170, 1.078; full 0.962, 0.976, 0.986, 1.053, 1.000 (without those rows qwen3_moe fp32 planned 0.895)
MOE_CASES = {"qwen3_moe fp32": dict(), "qwen3_moe fp32 ckpt": dict(ckpt=True), "mixtral fp32": dict(),
             "qwen3_moe fp32 attention only": dict(targets=ATTN), "qwen2_moe fp32": dict(),
             "qwen2_moe fp32 ckpt": dict(ckpt=True), "qwen2_moe bf16": dict(compute="bf16"),
             "qwen3_moe full fp32": dict(full=True), "mixtral full fp32": dict(full=True),
             "qwen2_moe full fp32": dict(full=True), "qwen3_moe full bf16": dict(full=True, compute="bf16"),
             "qwen3_moe full bf16 ckpt": dict(full=True, compute="bf16", ckpt=True)}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_step_peak_within_20_percent(case):
    c = {"targets": ALL, **MOE_CASES[case]}
    check_sft_step(hf_config(**MOE_FAMILIES[case.split()[0]]), c.pop("targets"), case, **c)


# ----------------------------------------------------------------------------- Qwen3.5 (Gated DeltaNet hybrid)

# three DeltaNet layers and one gated attention layer; value heads repeat the key heads, dk != dv
QWEN3_5 = dict(model_type="qwen3_5_text", num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=48)
DELTANET = ("in_proj_qkv", "in_proj_z", "out_proj")
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def qwen3_5_moe_config() -> dict:
    """The MoE sizes: every MLP 8 experts (top 2) beside a shared expert; no intermediate_size, as transformers
    writes their config.json."""
    hf = hf_config(**{**QWEN3_5, "model_type": "qwen3_5_moe_text"}, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=96, shared_expert_intermediate_size=128)
    del hf["intermediate_size"]
    return hf


def test_qwen3_5_params_weights_and_adapters_exact():
    """Both kinds of block counted as the model built from config.json holds them: parameters (the
    DeltaNet convolution, decay and gated norm, the gated q_proj), weight bytes, and LoRA tensors on the
    attention, DeltaNet and MLP linears; a multimodal config.json plans its text model and the tower
    (`minitrain.plan.vision`) as the model built from it holds them."""
    hf = hf_config(**QWEN3_5)
    shape = shape_from_hf(hf)
    with torch.device("meta"):
        meta = models.from_hf_config(hf)
    assert shape.num_params() == sum(p.numel() for p in meta.parameters())
    model = build(hf, torch.bfloat16, ALL + DELTANET)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert sum(t.bytes for t in shape.weight_terms(RunShape(rows=1, seq=8, compute="bf16"))) == tensor_bytes(frozen)
    lora = sorted(p.numel() for p in model.parameters() if p.requires_grad)
    assert sorted(shape.trainable_tensors(RunShape(rows=1, seq=8, lora_r=16, lora_targets=ALL + DELTANET))) == lora
    multimodal = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": hf, "vision_config": {}}
    check_multimodal_params(multimodal, shape)


def check_multimodal_params(multimodal: dict, text_shape) -> None:
    """A multimodal Qwen3.5 config.json (the tower of transformers' defaults): the language model as the text
    config's shape, plus the tower, as the model built from it on the meta device holds them."""
    with torch.device("meta"):
        meta = models.from_hf_config(multimodal)
    shape = shape_from_hf(multimodal)
    assert shape.num_params() == sum(p.numel() for p in meta.parameters())
    assert shape.num_params() - sum(shape.tower.tensors) == text_shape.num_params()


def test_qwen3_5_moe_params_weights_and_adapters_exact():
    """The MoE sizes as the model built from config.json holds them: every expert and router, the shared
    expert and its gate; LoRA tensors on the linears (the shared expert's by LLaMA's names), on the experts
    (each expert's pair) and all-linear; a multimodal config.json plans its text model and the tower."""
    hf = qwen3_5_moe_config()
    shape = shape_from_hf(hf)
    with torch.device("meta"):
        meta = models.from_hf_config(hf)
    assert shape.num_params() == sum(p.numel() for p in meta.parameters())
    for targets in (ALL + DELTANET + EXPERTS, ATTN + ("mlp.experts.down_proj",), ("all-linear",)):
        model = build(hf, torch.bfloat16, targets)
        frozen = [p for p in model.parameters() if not p.requires_grad]
        assert sum(t.bytes for t in shape.weight_terms(RunShape(rows=1, seq=8, compute="bf16"))) == tensor_bytes(frozen)
        lora = sorted(p.numel() for p in model.parameters() if p.requires_grad)
        assert sorted(shape.trainable_tensors(RunShape(rows=1, seq=8, lora_r=16, lora_targets=targets))) == lora
    check_multimodal_params({"model_type": "qwen3_5_moe", "text_config": hf, "vision_config": {}}, shape)


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_qwen3_5_moe_quantized_weights_exact(quantize):
    """A QLoRA base as the loader's hook quantizes it: every linear, the shared expert's gate and each expert
    apart (the routers and the convolution stay float)."""
    pytest.importorskip("bitsandbytes")
    from minitrain.adapters.quant import quantize_hook

    hf = qwen3_5_moe_config()
    torch.manual_seed(0)
    model = models.from_hf_config(hf)
    hook = quantize_hook(quantize, compute_dtype=torch.float32)
    quantized = [n for n, p in list(model.named_parameters())
                 if n != "lm_head.weight" and "embed" not in n and p.dim() >= 2 and hook(model, n, p.data)]
    assert any(n.endswith("experts.gate_up_proj") for n in quantized) and not any(".mlp.gate." in n for n in quantized)
    held = list(model.parameters()) + list(model.buffers())
    held += [t for p in model.parameters() for t in quant_state_tensors(p)]
    run = RunShape(rows=1, seq=8, compute="fp32", quantize=quantize)
    assert sum(t.bytes for t in shape_from_hf(hf).weight_terms(run)) == tensor_bytes(held)


QWEN3_5_CASES = {"fp32": dict(), "fp32 ckpt": dict(ckpt=True), "bf16": dict(compute="bf16"),
                 "moe fp32": dict(), "moe fp32 ckpt": dict(ckpt=True), "moe bf16": dict(compute="bf16")}


@pytest.mark.parametrize("case", list(QWEN3_5_CASES))
def test_qwen3_5_step_peak_within_20_percent(case):
    """A LoRA SFT step on every linear (DeltaNet's too; the MoE sizes: the experts and the shared expert) of
    a padded batch, several chunks long (measured, MoE: 1.03, 0.92 with checkpointing, 1.14 under bf16)."""
    if case.startswith("moe"):
        check_sft_step(qwen3_5_moe_config(), ALL + DELTANET + EXPERTS, case, **QWEN3_5_CASES[case])
    else:
        check_sft_step(hf_config(**QWEN3_5), ALL + DELTANET, case, **QWEN3_5_CASES[case])


def check_sft_step(hf: dict, targets, case: str, ckpt: bool = False, compute: str = "fp32", full: bool = False) -> None:
    """The plan's activation peak + gradients against a LoRA SFT step's measured CPU peak (4 padded rows
    of 256), within 20% (`full`: a full fine-tuning step's; fp32 weights under autocast too)."""
    from minitrain.objectives.sft import sft

    model = full_model(hf) if full else build(hf, torch.bfloat16 if compute == "bf16" else torch.float32, targets)
    if ckpt:
        enable_checkpointing(model)
    batch = batch_of(4, 256, 2048)
    measured = measured_step(model, sft, batch, autocast=compute == "bf16")
    run = RunShape(rows=4, seq=256, compute=compute, lora_targets=targets, checkpointing=ckpt,
                   targets=int((batch["labels"][:, 1:] != -100).sum()), device="cpu",
                   real_tokens=int(batch["attention_mask"].sum()), full=full)
    plan = predict(shape_from_hf(hf), run)
    predicted = plan.activation_peak + plan.term("gradients")
    assert 0.8 <= predicted / measured <= 1.2, (case, plan.peak_moment, fmt_bytes(predicted), fmt_bytes(measured))


def test_qwen3_5_deltanet_memory_grows_with_the_sequence_not_its_square():
    """The DeltaNet block's saved bytes double with the sequence (the chunk fixed), where the attention
    block's mask grows with its square; full fine-tuning on several ranks is planned (measured in
    tests/test_plan_ranks.py), no longer refused."""
    shape = shape_from_hf(hf_config(**QWEN3_5))
    lin = shape.layer_types.index("linear_attention")

    def saved(seq):
        return shape.saved_per_layer(RunShape(rows=1, seq=seq, lora_targets=ALL + DELTANET, mask=False))[lin]

    assert saved(8192) == 2 * saved(4096) == 4 * saved(2048)
    assert predict(shape, RunShape(rows=1, seq=8, full=True, world=2)).peak > 0


def test_plan_tool_on_a_qwen3_5_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": hf_config(**QWEN3_5),
                                                      "vision_config": {}}))
    out = plan_cli(str(ROOT / "recipes" / "sft_llama.py"), f"model={tmp_path}", "batch_size=1", "max_len=512")
    assert out.returncode == 0, out.stderr
    assert "3 Gated DeltaNet, 1 full attention" in out.stdout and "predicted peak" in out.stdout


# ----------------------------------------------------------------------------- Gemma 4 (dense)

# e2b's particulars at plan-test sizes: per-layer embeddings, global layers with their own head dim and
# k = v, the last two layers reading earlier layers' keys and values with double-wide MLPs, a capped head
GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
GEMMA4 = dict(model_type="gemma4_text", num_hidden_layers=5, num_key_value_heads=2, head_dim=64, global_head_dim=128,
              num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
              hidden_size_per_layer_input=32, vocab_size_per_layer_input=2048, sliding_window=128,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                           "full_attention"], final_logit_softcapping=30.0, rope_parameters=GEMMA4_ROPE,
              tie_word_embeddings=True)


def test_gemma4_params_weights_and_adapters_exact():
    """Every block as the model built from config.json holds it (shared layers without k / v, k = v
    global layers without v_proj, double-wide MLPs, the PLE table and projection, layer scalars);
    a multimodal config.json plans its text model."""
    hf = hf_config(**GEMMA4)
    shape = shape_from_hf(hf)
    with torch.device("meta"):
        meta = models.from_hf_config(hf)
    assert shape.num_params() == sum(p.numel() for p in meta.parameters()) + sum(b.numel() for b in meta.buffers())
    model = build(hf, torch.bfloat16, ALL)
    frozen = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    assert sum(t.bytes for t in shape.weight_terms(RunShape(rows=1, seq=8, compute="bf16"))) == tensor_bytes(frozen)
    for targets in (ALL, ("all-linear",)):  # all-linear: the model's per_layer_model_projection too
        model = build(hf, torch.bfloat16, targets)
        lora = sorted(p.numel() for p in model.parameters() if p.requires_grad)
        assert sorted(shape.trainable_tensors(RunShape(rows=1, seq=8, lora_r=16, lora_targets=targets))) == lora
    assert shape_from_hf({"model_type": "gemma4", "text_config": hf}).num_params() == shape.num_params()


GEMMA4_CASES = {"fp32 ckpt": dict(ckpt=True), "bf16": dict(compute="bf16")}  # fp32 without: 1.02 (measured once)


@pytest.mark.parametrize("case", list(GEMMA4_CASES))
def test_gemma4_step_peak_within_20_percent(case):
    check_sft_step(hf_config(**GEMMA4), ALL, case, **GEMMA4_CASES[case])


# the MoE size (26B-A4B's shape at plan-test sizes): the expert block beside every layer's dense MLP
GEMMA4_MOE = dict(GEMMA4, enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=128)
GEMMA4_MOE_TARGETS = {"all linears + experts": ALL + ("experts.gate_up_proj",), "attention + experts": ATTN
                      + ("gate_up_proj", "experts.down_proj")}


@pytest.mark.parametrize("targets", list(GEMMA4_MOE_TARGETS))
def test_gemma4_moe_params_weights_and_adapters_exact(targets):
    """The experts (E x 3 x D x F_e a block), the router (E x D, its scale and per-expert scale) and the three more
    norms beside the dense MLP, as the built model holds them; the frozen bytes to the byte; the adapters on the
    experts (`down_proj` names the dense MLP's and the experts') and the linears as LoRA puts them."""
    hf = hf_config(**GEMMA4_MOE)
    shape = shape_from_hf(hf)
    with torch.device("meta"):
        meta = models.from_hf_config(hf)
    assert shape.num_params() == sum(p.numel() for p in meta.parameters()) + sum(b.numel() for b in meta.buffers())
    names = GEMMA4_MOE_TARGETS[targets]
    model = build(hf, torch.bfloat16, names)
    frozen = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    assert sum(t.bytes for t in shape.weight_terms(RunShape(rows=1, seq=8, compute="bf16"))) == tensor_bytes(frozen)
    lora = sorted(p.numel() for p in model.parameters() if p.requires_grad)
    assert sorted(shape.trainable_tensors(RunShape(rows=1, seq=8, lora_r=16, lora_targets=names))) == lora
    qlora, lora = (predict(shape, RunShape(rows=1, seq=8, quantize=q, lora_targets=names)) for q in ("nf4", "none"))
    assert qlora.persistent_bytes < lora.persistent_bytes  # QLoRA on the experts too (tests/test_plan_hybrid.py)


# planned / measured when written: 1.15 (checkpointed: the recomputed block's experts' tensors are counted beside the
# dense MLP's backward, where autograd has probably freed them, running the later MoE branch's backward first (not
# verified with a hook); the dense size: 1.06),
# 1.028, 1.03 (bf16); the dense plan alone 0.92, 0.75, 0.73
GEMMA4_MOE_CASES = {"fp32 ckpt": dict(ckpt=True), "fp32": dict(), "bf16": dict(compute="bf16")}


@pytest.mark.parametrize("case", list(GEMMA4_MOE_CASES))
def test_gemma4_moe_step_peak_within_20_percent(case):
    check_sft_step(hf_config(**GEMMA4_MOE), ALL + ("experts.gate_up_proj",), case, **GEMMA4_MOE_CASES[case])


def test_plan_tool_on_a_gemma4_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": hf_config(**GEMMA4)}))
    out = plan_cli(str(ROOT / "recipes" / "sft_llama.py"), f"model={tmp_path}", "batch_size=1", "max_len=512")
    assert out.returncode == 0, out.stderr
    assert "2 sharing k/v" in out.stdout and "per-layer inputs (with the embeddings)" in out.stdout
