"""The memory plan of the hybrid families (Qwen3.5's Gated DeltaNet layers among attention layers, Gemma 4)
against what the CPU measures: steps long enough for the delta rule to run over many chunks.

Peaks are measured as tests/test_plan.py measures them (`measured_step`: a steady-state step's peak bytes
allocated, from the profiler's memory events) and compared with the plan's activation peak + gradients.
"""

from __future__ import annotations

import pytest
import torch

from minitrain.objectives.sft import sft
from minitrain.plan.predict import predict, shape_from_hf
from minitrain.plan.run_shape import RunShape, fmt_bytes
from minitrain.train import enable_checkpointing
from test_plan import ALL, DELTANET, QWEN3_5, batch_of, build, full_model, hf_config, measured_step


def check_step(hf: dict, targets, rows: int, seq: int, ckpt: bool = False, compute: str = "fp32",
               full: bool = False) -> float:
    """plan / measured of one SFT step (LoRA on `targets`, or `full`) on `rows` padded rows of `seq`, within 20%."""
    model = full_model(hf) if full else build(hf, torch.bfloat16 if compute == "bf16" else torch.float32, targets)
    if ckpt:
        enable_checkpointing(model)
    batch = batch_of(rows, seq, hf["vocab_size"])
    measured = measured_step(model, sft, batch, autocast=compute == "bf16")
    run = RunShape(rows=rows, seq=seq, compute=compute, lora_targets=() if full else targets, checkpointing=ckpt,
                   targets=int((batch["labels"][:, 1:] != -100).sum()), device="cpu",
                   real_tokens=int(batch["attention_mask"].sum()), full=full)
    plan = predict(shape_from_hf(hf), run)
    ratio = (plan.activation_peak + plan.term("gradients")) / measured
    assert 0.8 <= ratio <= 1.2, (plan.peak_moment, fmt_bytes(plan.activation_peak), fmt_bytes(measured), ratio)
    return ratio


# ----------------------------------------------------------------------------- Qwen3.5: the DeltaNet blocks' peaks

# measured when written: 1.02, 1.06, 1.04 (the plan before, whose recomputed block was the last one, an attention
# block: 0.88 and 0.74 under checkpointing)
LONG = {"fp32": dict(), "fp32 ckpt": dict(ckpt=True), "bf16 ckpt": dict(compute="bf16", ckpt=True)}


@pytest.mark.parametrize("case", list(LONG))
def test_qwen3_5_long_rows_step_peak_within_20_percent(case):
    """Two padded rows of 1024 (27 chunks of the delta rule, end to end): under checkpointing the peak is a DeltaNet
    block's recompute and backward, which keeps more than the last block (an attention one)."""
    check_step(hf_config(**QWEN3_5), ALL + DELTANET, 2, 1024, **LONG[case])


def test_qwen3_5_checkpointed_peak_is_the_largest_block():
    """Under checkpointing the plan's recomputed block is a DeltaNet one (every block alike: the last one, as before);
    the moment inside a DeltaNet block's delta rule is among its candidates."""
    shape = shape_from_hf(hf_config(**QWEN3_5))
    run = RunShape(rows=2, seq=1024, lora_targets=ALL + DELTANET, checkpointing=True, mask=False)
    saved = shape.saved_per_layer(run)
    lin, att = shape.layer_types.index("linear_attention"), shape.layer_types.index("full_attention")
    assert saved[lin] > saved[att]
    moment = predict(shape, run).moments["last block backward"]
    assert [t.bytes for t in moment if t.name.startswith("one block recomputed")] == [saved[lin]]
    peaks = shape.block_view(lin).recompute_peaks(run, saved[lin])
    assert any(t.name.startswith("DeltaNet: the delta rule's chunk outputs") for t in peaks[-1])
