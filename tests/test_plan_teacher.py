"""The memory plan of distillation with a teacher of the 2026 families (Qwen3.5 dense and MoE, Gemma 4 dense and
MoE) and the mixture-of-experts ones (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss), beside a student of any family.

- the teacher's weights (`minitrain.plan.decoder.teacher_weight_terms`) to the byte against the teacher as the
  recipe holds it (built from config.json, frozen in the compute dtype; `teacher_quantize=nf4` / `int8` as the
  loader's hook quantizes it, each expert apart), beside a dense LLaMA student and, the reverse, a LLaMA teacher
  beside a student of these families; gpt-oss's experts under teacher_quantize are one line;
- a distillation step (the teacher's no_grad forward, the student's LoRA step with the KD chunks) measured on
  the CPU as tests/test_plan.py measures its distillation step (`measured_step`) within 20% of the plan's
  activation peak + gradients: Qwen3.5 student and Qwen3.5 MoE teacher (feature matching and attention transfer
  on the attention layer too), Gemma 4 and Gemma 4 MoE, Qwen3-MoE and gpt-oss, a LLaMA student and a wider
  Qwen3.5 teacher (whose forward is the peak).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from test_plan import (ALL, DELTANET, GEMMA4, GEMMA4_MOE, MOE_FAMILIES, QWEN3_5, batch_of, build, hf_config,
                       measured_step, qwen3_5_moe_config, quant_state_tensors, tensor_bytes)
from test_plan_hybrid import quantized
from test_plan_moe import GPT_OSS

import models
from minitrain.errors import UserError
from minitrain.plan.decoder import teacher_weight_terms
from minitrain.plan.measure import measure_peak_allocated
from minitrain.plan.predict import predict, shape_from_hf
from minitrain.plan.run_shape import RunShape, fmt_bytes
from minitrain.train import enable_checkpointing

TEACHERS = {
    "qwen3_5": lambda: hf_config(**QWEN3_5),
    "qwen3_5_moe": qwen3_5_moe_config,
    "gemma4": lambda: hf_config(**GEMMA4),
    "gemma4_moe": lambda: hf_config(**GEMMA4_MOE),
    "qwen3_moe": lambda: hf_config(**MOE_FAMILIES["qwen3_moe"]),
    "qwen2_moe": lambda: hf_config(**MOE_FAMILIES["qwen2_moe"]),
    "mixtral": lambda: hf_config(**MOE_FAMILIES["mixtral"]),
    "gpt_oss": lambda: hf_config(**GPT_OSS),
}
WEIGHT_CASES = {"qwen3_5 fp32": "none", "qwen3_5_moe bf16": "none", "qwen3_5_moe fp32": "nf4", "gemma4 bf16": "none",
                "gemma4_moe fp32": "int8", "qwen3_moe bf16": "none", "qwen2_moe fp32": "nf4", "mixtral bf16": "none",
                "gpt_oss bf16": "none"}


def teacher_bytes(plan) -> int:
    return sum(t.bytes for t in plan.persistent if t.name.startswith("teacher "))


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_teacher_weights_exact_beside_a_dense_student_and_the_reverse(case):
    """The teacher as the recipe holds it, to the byte: in the compute dtype, or under teacher_quantize as the
    loader's hook quantizes it (the student's own `quantize` plays no part); the plan of a dense LLaMA student
    gains exactly those bytes, and a student of the teacher's family plans a LLaMA teacher the same way."""
    name, compute = case.split()
    kind = WEIGHT_CASES[case]
    thf = TEACHERS[name]()
    dtype = torch.bfloat16 if compute == "bf16" else torch.float32
    if kind != "none":
        pytest.importorskip("bitsandbytes")
        teacher = quantized(thf, kind, dtype)
    else:
        torch.manual_seed(0)
        teacher = models.from_hf_config(thf).to(dtype)
    held = list(teacher.parameters()) + list(teacher.buffers())
    held += [t for p in teacher.parameters() for t in quant_state_tensors(p)]
    llama = shape_from_hf(hf_config(num_key_value_heads=2))
    run = RunShape(rows=2, seq=64, compute=compute, lora_targets=ALL, quantize="nf4", teacher=shape_from_hf(thf),
                   teacher_quantize=kind)
    assert sum(t.bytes for t in teacher_weight_terms(run)) == tensor_bytes(held)
    with_teacher, alone = predict(llama, run), predict(llama, replace(run, teacher=None))
    assert teacher_bytes(with_teacher) == tensor_bytes(held)
    assert with_teacher.persistent_bytes == alone.persistent_bytes + tensor_bytes(held)
    student = shape_from_hf(thf)  # the reverse: this family's student, a LLaMA teacher
    reverse = replace(run, quantize="none", teacher=llama, teacher_quantize="none")
    with_teacher, alone = predict(student, reverse), predict(student, replace(reverse, teacher=None))
    held = tensor_bytes(models.from_hf_config(hf_config(num_key_value_heads=2)).to(dtype).parameters())
    assert teacher_bytes(with_teacher) == held
    assert with_teacher.persistent_bytes == alone.persistent_bytes + held


def test_a_gpt_oss_teacher_under_teacher_quantize_is_one_line():
    run = RunShape(rows=1, seq=8, teacher=shape_from_hf(hf_config(**GPT_OSS)), teacher_quantize="nf4")
    with pytest.raises(UserError) as e:
        predict(shape_from_hf(hf_config()), run)
    assert str(e.value) == ("teacher_quantize=nf4: gpt-oss's experts (an in-out layout with biases, MXFP4 in its "
                            "checkpoints) are not ones minitrain quantizes — drop teacher_quantize=")


# student config, its LoRA targets, teacher config, {student layer: teacher layer} matched and transferred
STEP_CASES = {
    "qwen3_5 + qwen3_5_moe teacher, feature + attention": (lambda: hf_config(**QWEN3_5), ALL + DELTANET,
                                                           qwen3_5_moe_config, {3: 3}),
    "gemma4 + gemma4_moe teacher": (lambda: hf_config(**GEMMA4), ALL, lambda: hf_config(**GEMMA4_MOE), {}),
    "qwen3_moe + gpt_oss teacher": (lambda: hf_config(**MOE_FAMILIES["qwen3_moe"]), ALL + ("experts.gate_up_proj",),
                                    lambda: hf_config(**GPT_OSS), {}),
    # top-k KD (small chunks), the student checkpointed: the teacher's forward is the step's peak
    "llama + wider qwen3_5 teacher, top-k, ckpt": (lambda: hf_config(num_key_value_heads=2), ALL, lambda: hf_config(
        **{**QWEN3_5, "linear_num_value_heads": 8}, hidden_size=512, intermediate_size=2816), {}),
}


# (the MoE sizes of Qwen3.5 and Gemma 4 in fp32 peak where their dense sizes do, measured: the delta rule, the
# double-wide MLP; they are the teachers of the steps below)
FORWARD_CASES = [n for n in TEACHERS if n not in ("qwen3_5_moe", "gemma4_moe")] + ["qwen3_5 nf4", "gemma4_moe nf4"]


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_teacher_forward_within_20_percent(case):
    """The teacher's no_grad forward (eval mode, as the objective runs it) on 4 padded rows of 256: its measured
    CPU peak against the plan's `teacher forward (no grad)` moment (its batch tensors and tables, its largest
    block's largest stage, its final hidden states; under teacher_quantize=nf4 a dequantized weight), beside a
    LLaMA student that drops the padding."""
    name, kind = (case.split() + ["none"])[:2]
    thf = TEACHERS[name]()
    torch.manual_seed(0)
    if kind != "none":
        pytest.importorskip("bitsandbytes")
    teacher = (quantized(thf, kind) if kind != "none" else models.from_hf_config(thf)).eval()
    batch = batch_of(4, 256, 2048)

    def forward():
        with torch.no_grad():
            teacher(batch["input_ids"].clone(), batch["attention_mask"].clone())

    forward()
    measured, _ = measure_peak_allocated(forward)
    run = RunShape(rows=4, seq=256, compute="fp32", device="cpu", real_tokens=int(batch["attention_mask"].sum()),
                   teacher=shape_from_hf(thf), teacher_quantize=kind)
    plan = predict(shape_from_hf(hf_config()), run)
    planned = sum(t.bytes for t in plan.moments["teacher forward (no grad)"])
    print(f"{case}: planned / measured {planned / measured:.3f}")
    assert 0.8 <= planned / measured <= 1.2, (case, fmt_bytes(planned), fmt_bytes(measured))


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_distill_step_peak_within_20_percent(case):
    """A LoRA distillation step on 2 padded rows of 256 (KD + CE at T=2, full vocabulary or top-64): the measured CPU peak
    against the plan's activation peak + gradients."""
    from minitrain.objectives.distill import attach_projections, make_distill_objective

    make_student, targets, make_teacher, matched = STEP_CASES[case]
    hf, thf = make_student(), make_teacher()
    student = build(hf, torch.float32, targets)
    ckpt, top_k = case.endswith("ckpt"), 64 if "top-k" in case else 0
    if ckpt:
        enable_checkpointing(student)
    torch.manual_seed(1)
    teacher = models.from_hf_config(thf)
    attach_projections(student, teacher, matched)
    weight = 0.1 if matched else 0.0
    objective = make_distill_objective(teacher, temperature=2.0, kd_weight=0.5, ce_weight=0.5, top_k=top_k,
                                       feature_weight=weight,
                                       attention_weight=weight, feature_map=matched, attention_map=matched)
    batch = batch_of(2, 256, 2048)
    measured = measured_step(student, objective, batch, autocast=False)
    run = RunShape(rows=2, seq=256, compute="fp32", lora_targets=targets, checkpointing=ckpt, device="cpu",
                   targets=int((batch["labels"][:, 1:] != -100).sum()), real_tokens=int(batch["attention_mask"].sum()),
                   teacher=shape_from_hf(thf), kd_top_k=top_k, kd_features=len(matched), kd_attention=len(matched))
    plan = predict(shape_from_hf(hf), run)
    predicted = plan.activation_peak + plan.term("gradients")
    print(f"{case}: planned / measured {predicted / measured:.3f} at {plan.peak_moment!r}")
    assert 0.8 <= predicted / measured <= 1.2, (case, plan.peak_moment, fmt_bytes(predicted), fmt_bytes(measured))
    assert (plan.peak_moment == "teacher forward (no grad)") == bool(top_k)


def test_plan_tool_on_a_distillation_of_these_families(tmp_path):
    """`minitrain plan` on the distillation recipe with a Qwen3.5 student folder and a Gemma 4 MoE teacher folder
    (refused in one line before): the teacher's weights (its nf4 experts, its per-layer embeddings) and final hidden
    states are in its table."""
    from test_plan import ROOT, plan_cli

    for name, hf in (("student", hf_config(**QWEN3_5)), ("teacher", hf_config(**GEMMA4_MOE))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(hf))
    out = plan_cli(str(ROOT / "recipes" / "distill_llama.py"), f"model={tmp_path / 'student'}",
                   f"teacher={tmp_path / 'teacher'}", "batch_size=1", "max_len=512", "teacher_quantize=nf4")
    assert out.returncode == 0, out.stderr
    for line in ("teacher weights: experts", "per expert: nf4", "teacher weights: per-layer embeddings",
                 "teacher: final hidden states"):
        assert line in out.stdout, line
