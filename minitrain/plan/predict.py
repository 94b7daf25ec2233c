"""A model of a training run's peak GPU memory, from the model's `config.json` and the run's keys.

Plain functions over two small descriptions: a model shape (the dims of a checkpoint, read from
`config.json` only, never the weights: `ModelShape` for LLaMA / Mistral / Qwen2 / Qwen3 (biases
and per-head q/k norms are fields), `GemmaShape` for Gemma 2 / Gemma 3 text, `Phi3Shape` for
Phi-3's fused projections (`minitrain.plan.decoder`), `Qwen3_5Shape` (`minitrain.plan.qwen3_5`) and
`Gemma4Shape` (`minitrain.plan.gemma4`) planned block by block, the mixture-of-experts checkpoints
(`minitrain.plan.moe`, `minitrain.plan.gpt_oss`), the vision-language checkpoints with their
towers (`minitrain.plan.vision`), `T5Shape` for T5 v1.0, v1.1 and FLAN-T5
(`minitrain.plan.t5`); `shape_from_hf` picks one) and `RunShape` (`minitrain.plan.run_shape`:
micro-batch, lengths, dtype, quantization, adapter, checkpointing, DPO reference mode; `run_shape`
reads it from a recipe's config). `predict(model, run)` returns a `Plan`:
every term in bytes with the formula it comes from, and the peak. The family-specific parts
(weights, trainable tensors, the activation moments) are methods of the shape, so `predict` reads
the same for every family. `minitrain plan` prints it for a recipe; `tests/test_plan.py` checks it
against peaks measured on the CPU.

What is counted, and how (s = bytes per element of the compute dtype: 2 for bf16, 4 for fp32):

- weights: float tensors in the base dtype; nf4 (bitsandbytes `Linear4bit`): 0.5 byte / param
  packed + one absmax per 64-block (fp32, or uint8 with double quantization plus a second level
  of one fp32 absmax per 256 blocks, a 256-entry fp32 code and an fp32 offset) + the 16-entry nf4
  code; int8 (`Linear8bitLt`): 1 byte / param + one fp32 scale per output row; ternary
  (`minitrain.adapters.ternary`): 2 bits / param packed four to a byte along each row (ceil(in / 4) bytes a
  row) + one fp32 scale per tensor or per output row. Embeddings, norms and the (unquantized) head
  stay in the compute dtype.
- adapter rank: `lora_r`, or LRC's `lrc_rank` (below 1: that fraction of each linear's min(in, out),
  as `minitrain.adapters.lrc.resolve_rank`).
- adapters: LoRA A (r x in) and B (out x r) per adapted linear, fp32; their gradients (fp32) and
  AdamW's two fp32 moments each (+ one fp32 `step` per tensor).
- `ema_decay`: the moving average, one more copy of the trained tensors (fp32).
- full fine-tuning (`finetune=full`, LLaMA / Mistral): every weight in fp32 (the loader reads them
  so), an fp32 gradient and two fp32 moments each; every linear keeps its input and every norm its
  normalised input for the weight gradients, the residual stream is fp32 (the fp32 embedding feeds
  it), and under bf16 autocast each linear keeps a bf16 copy of its weight (autocast's cast cache,
  held for backward) and a bf16 copy of its fp32 input.
- activations: what autograd keeps for backward in `models/llama.py` + `minitrain/adapters/lora.py`, per
  block and per token (read off the autograd graph; see `block_saved`), only the block inputs of the
  checkpointed blocks (all, or the first N with `checkpointing=N`) plus one block recomputed, and
  the loss's chunked logits
  (`minitrain.objectives.losses.LOGITS_PER_CHUNK` logits per chunk, never the full `B x T x V`).
  An int8 base's linears keep no input: bitsandbytes' own matmul would hold it on its autograd node, out
  of checkpointing's reach, so minitrain runs them through `minitrain.adapters.lora.frozen_int8_matmul`.
- transients at the peak moment: the logits chunk in forward / backward, one block's backward
  working set, a dequantized 4-bit or int8 weight in bitsandbytes' backward, a dequantized ternary weight
  in forward and backward (its uint8 codes + the compute-dtype weight, one linear at a time: the
  ternary matmul saves only the packed weight; `ternary_act_bits`' per-token transients are not
  modelled), the DPO reference forward.
- distillation (`RunShape.teacher`): the teacher's weights (frozen, compute dtype or
  `teacher_quantize`), its no_grad forward (one block at a time) and final hidden states, the
  KD chunks in place of the SFT loss's (both heads' logits and `_KDAndCE`'s fp32 temporaries,
  measured per logit), the matched layers' hidden states and both sides' attention probabilities
  with attention_kl's tensors, and the learned projections (trained like adapters).

The peak is the largest of those moments (end of forward, loss backward, first block backward,
reference forward, optimizer step), on top of what persists (weights, adapters, gradients and
AdamW state: the steady state from step 2 on). It models `torch.cuda.max_memory_allocated`; the
CUDA context and allocator slack come on top (`RESERVE_*`, used by the verdict).

T5 (`minitrain.plan.t5`): the same method over an encoder and a decoder.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from minitrain.errors import UserError
from minitrain.plan.decoder import (GemmaShape, ModelShape, Phi3Shape, adapter_terms, reward_model_terms,
                                    sampling_terms, teacher_weight_terms)
from minitrain.plan.run_shape import DTYPE_BYTES, Plan, RunShape, Term
from minitrain.plan.moe import MoeShape, Qwen2MoeShape
from minitrain.plan.gemma4 import Gemma4Shape
from minitrain.plan.gpt_oss import GptOssShape
from minitrain.plan.qwen3_5 import Qwen3_5Shape
from minitrain.plan.t5 import T5Shape
from minitrain.plan.vision import (Gemma3VLShape, Gemma4MoeVLShape, Gemma4VLShape, Qwen3_5MoeVLShape, Qwen3_5VLShape,
                                   QwenVLMoeShape, QwenVLShape)


def shape_from_hf(d: dict[str, Any], where: str = "config.json") -> "ModelShape | T5Shape":
    """The shape of the family `config.json`'s model_type names (LLaMA / Mistral / Qwen, Gemma,
    Phi-3, the MoE families, Qwen3.5, Gemma 4, Qwen2.5-VL / Qwen3-VL / multimodal Qwen3.5 / Gemma 3, T5)."""
    kind = d.get("model_type")
    if kind == "t5":
        return T5Shape.from_hf(d, where)
    if kind in GemmaShape.FAMILIES:
        return GemmaShape.from_hf(d, where)
    if kind in Phi3Shape.FAMILIES:
        return Phi3Shape.from_hf(d, where)
    for moe in (MoeShape, Qwen2MoeShape, GptOssShape):
        if kind in moe.FAMILIES:
            return moe.from_hf(d, where)
    if kind in Gemma4VLShape.MODEL_TYPES and isinstance(d.get("vision_config"), dict):
        moe = (d.get("text_config") or {}).get("enable_moe_block")
        return (Gemma4MoeVLShape if moe else Gemma4VLShape).from_hf(d, where)
    if kind in Gemma4Shape.MODEL_TYPES:
        return Gemma4Shape.from_hf(d, where)
    if kind in Qwen3_5Shape.MODEL_TYPES:
        return Qwen3_5Shape.from_hf(d, where)
    for vl in (QwenVLShape, QwenVLMoeShape, Qwen3_5VLShape, Qwen3_5MoeVLShape, Gemma3VLShape):
        if kind in vl.MODEL_TYPES:
            return vl.from_hf(d, where)
    return ModelShape.from_hf(d, where)


def predict(model: "ModelShape | T5Shape", run: RunShape) -> Plan:
    """The memory plan of one run: persistent terms and the activation terms at each candidate peak.
    Under torchrun (`run.world` > 1, or `parallel=fsdp`): rank 0's (`minitrain.plan.sharded`). A shape
    may refuse a run it does not model (`check_run`)."""
    if hasattr(model, "check_run"):
        model.check_run(run)
    if run.world > 1 or run.parallel == "fsdp":
        from minitrain.plan import sharded

        if run.parallel == "fsdp" and model.is_encoder_decoder:
            raise UserError("parallel=fsdp: the per-rank memory plan models the decoder-only families only, not T5 "
                            "— memory_check=false skips the plan")
        local = predict(model, sharded.local_run(run))
        return (sharded.fsdp_plan if run.parallel == "fsdp" else sharded.ddp_plan)(model, run, local)
    if run.full and model.is_encoder_decoder:
        raise UserError("finetune=full: the memory plan models full fine-tuning of LLaMA / Mistral only — "
                        "memory_check=false skips the plan")
    if run.real_tokens is not None:  # padding that only the decoder-only families on a CPU leave out
        if run.device == "cpu" and getattr(model, "UNPADS_ON_CPU", False) and run.seq >= model.UNPADS_FROM:
            windowed = model.sliding_window is not None and model.sliding_window < run.seq
            run = replace(run, mask=run.mask and windowed)
        else:
            run = replace(run, real_tokens=None)
    persistent = model.weight_terms(run) + adapter_terms(model, run)
    if run.teacher is not None:
        persistent += teacher_weight_terms(run)
    if run.full:  # the gradients are in the moments where they exist (set_to_none between steps)
        persistent = [t for t in persistent if t.name != "gradients"]
    moments, notes = model.moments(run)
    if run.sample_rows:  # GRPO: generation has its own moment (no graph; the cache is freed before the forward)
        moments["GRPO sampling (KV cache, no grad)"] = sampling_terms(model, run)
    if run.reward_model is not None:  # GRPO's rewards=model:DIR: its weights stay; it scores between the two
        weights, scoring = reward_model_terms(run)
        persistent += weights
        moments["GRPO reward model scoring (no grad)"] = scoring
    trainable = sum(model.trainable_tensors(run)) * DTYPE_BYTES[run.adapter_dtype]
    moments["optimizer step"] = moments.get("optimizer step", []) + [
        Term("AdamW temporaries", trainable if run.optimizer_temps else 0,
             "1 x trainable (foreach)" if run.optimizer_temps else "fused: none")]
    peak = max(moments, key=lambda k: sum(t.bytes for t in moments[k]))
    if not run.full and any(not re.fullmatch(r"[\w.-]+", t) for t in run.lora_targets):
        notes.append(f"lora_targets {run.lora_targets[0]!r} is a regular expression: the adapters it selects are not "
                     "counted (list module-name suffixes to plan them)")
    return Plan(persistent, moments, peak, notes)


def run_shape(cfg: Any, *, device: str = "cuda", seq: int | None = None, targets: int | None = None,
              world: int = 1) -> RunShape:
    """The `RunShape` a recipe config trains with on `device` (worst case: every row `max_len` long;
    seq2seq configs: every source `max_len`, every target `max_target_len` long), on each of
    `world` ranks with the config's `parallel` (ddp or fsdp).

    DPO configs (with `beta` and `precompute_ref`) forward 2 x batch_size rows and have a
    reference: `precomputed` with precompute_ref, `snapshot` when continuing an adapter
    (init_adapter), else `base` (adapters disabled). `loss_type` orpo / cpo / simpo: the same
    rows and no reference (`none`). KTO configs (`desirable_weight`): batch_size rows with a
    graph, and a reference forward of 2 x batch_size rows (the rows and their KL rows). GRPO configs
    (`num_generations` G): batch_size x G rows of max_len (prompt + completion), the same rows in the
    sampler's KV cache, and with `beta` the reference forward (base, or snapshot with init_adapter);
    with `rewards=model:DIR` the reward model's weights and scoring. Reward-model configs
    (`center_rewards_coefficient`): 2 x batch_size rows, planned as an LM (its head and logits counted:
    more than the scalar head needs).
    """
    precision = getattr(cfg, "precision", "auto")
    if precision == "auto":
        compute = "bf16" if device == "cuda" else "fp32"
    else:
        compute = precision
    is_dpo = hasattr(cfg, "beta") and hasattr(cfg, "precompute_ref")
    is_kto = is_dpo and hasattr(cfg, "desirable_weight")
    ref = None
    if is_dpo:
        ref = "precomputed" if cfg.precompute_ref else ("snapshot" if getattr(cfg, "init_adapter", "") else "base")
        if getattr(cfg, "loss_type", "") in ("orpo", "cpo", "simpo"):
            ref = "none"
    is_reward_model = hasattr(cfg, "center_rewards_coefficient")  # [chosen; rejected] rows, as DPO's
    rows = cfg.batch_size * (2 if is_dpo and not is_kto or is_reward_model else 1)
    generations = getattr(cfg, "num_generations", 0)  # GRPO: every prompt's G completions are forwarded
    if generations:
        rows = cfg.batch_size * generations
        ref = None if not cfg.beta else ("snapshot" if getattr(cfg, "init_adapter", "") else "base")
    feats = (len(cfg.feature_layers) or -1) if getattr(cfg, "feature_weight", 0.0) > 0 else 0  # empty: every layer
    attns = (len(cfg.attention_layers) or -1) if getattr(cfg, "attention_weight", 0.0) > 0 else 0
    return RunShape(rows=rows, seq=seq or cfg.max_len, target_seq=getattr(cfg, "max_target_len", None),
                    compute=compute, quantize=getattr(cfg, "quantize", "none"),
                    ternary_scale=getattr(cfg, "ternary_scale", "tensor"), lrc_rank=float(getattr(cfg, "lrc_rank", 0)),
                    lora_r=cfg.lora_r, lora_targets=tuple(cfg.lora_targets), lora_dropout=float(cfg.lora_dropout),
                    modules_to_save=tuple(getattr(cfg, "modules_to_save", ())),
                    checkpointing=cfg.checkpointing, targets=targets, mask=not _flex_rows(cfg, device),
                    dpo_reference=ref,
                    reference_rows=2 * rows if is_kto else None, device=device,
                    full=getattr(cfg, "finetune", "lora") == "full", ema=getattr(cfg, "ema_decay", 0.0) > 0,
                    teacher=teacher_shape(cfg), teacher_quantize=getattr(cfg, "teacher_quantize", "none"),
                    kd_top_k=getattr(cfg, "top_k", 0) if getattr(cfg, "teacher", "") else 0, kd_features=feats,
                    kd_attention=attns, sample_rows=rows if generations else 0, world=world,
                    parallel=getattr(cfg, "parallel", "ddp"), reward_model=reward_model_shape(cfg))


def _flex_rows(cfg: Any, device: str) -> bool:
    """Whether the run's rows of several sequences (packing, DPO's shared prompt) go through FlexAttention
    (`attention=flex`, or auto on CUDA with compile: `minitrain.device.resolve_attention`'s rule), whose
    layers read a block mask of (T / 128)^2 entries, not the dense (T, T) one. GRPO's layout is chosen per
    batch, so a GRPO run keeps the dense mask in its plan (the larger)."""
    several = getattr(cfg, "packing", False) or getattr(cfg, "shared_prompt", False)
    attention = getattr(cfg, "attention", "auto")
    auto_flex = attention == "auto" and device == "cuda" and getattr(cfg, "compile", False)
    return several and (attention == "flex" or auto_flex)


def teacher_shape(cfg: Any) -> "ModelShape | None":
    """A distillation config's teacher (`teacher=` folder's config.json), or None: not
    distillation, or a folder the plan cannot read (loading it reports that in its own words)."""
    folder = getattr(cfg, "teacher", "")
    if not folder:
        return None
    try:
        shape = shape_from_hf(json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, UserError, TypeError, KeyError):
        return None
    return None if shape.is_encoder_decoder else shape


def reward_model_shape(cfg: Any) -> "ModelShape | None":
    """A GRPO config's reward model (`rewards=model:DIR`, its config.json), or None: no reward model, or
    a folder the plan cannot read (`load_rewards` reports that in its own words)."""
    spec = str(getattr(cfg, "rewards", "") or "")
    if not spec.startswith("model:"):
        return None
    try:
        shape = shape_from_hf(json.loads((Path(spec[len("model:"):]) / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, UserError, TypeError, KeyError):
        return None
    return None if shape.is_encoder_decoder else shape


def suggestions(model: ModelShape, run: RunShape, batch_size: int, grad_accum: int) -> list[tuple[str, int, int]]:
    """What to change to use less memory: (the keys to set, the predicted saving, the new peak)."""
    base = predict(model, run).peak
    out: list[tuple[str, int, int]] = []

    def add(keys: str, new: RunShape) -> None:
        try:
            peak = predict(model, new).peak
        except UserError:  # a change the plan does not model (several ranks on a hybrid) is not suggested
            return
        if peak < base:
            out.append((keys, base - peak, peak))

    if run.world > 1 and run.parallel == "ddp" and not model.is_encoder_decoder:
        add("parallel=fsdp", replace(run, parallel="fsdp"))
    if run.full:
        add("finetune=lora", replace(run, full=False))
    elif run.quantize == "none":
        add("quantize=nf4", replace(run, quantize="nf4"))
    elif run.quantize == "int8":
        add("quantize=nf4", replace(run, quantize="nf4"))
    if run.checkpointed(model.blocks) < model.blocks:
        add("checkpointing=true", replace(run, checkpointing=True))
    if run.compute == "fp32":
        add("precision=bf16", replace(run, compute="bf16"))
    per_row = run.rows // batch_size
    b = batch_size
    while b // 2 >= run.world:  # under torchrun, at least one row per rank
        b //= 2
        add(f"batch_size={b} grad_accum={grad_accum * batch_size // b} (same effective batch)",
            replace(run, rows=b * per_row, reference_rows=run.reference_rows and run.reference_rows * b // batch_size))
    if run.dpo_reference in ("base", "snapshot"):
        add("precompute_ref=true", replace(run, dpo_reference="precomputed"))
    if run.teacher is not None and run.teacher_quantize == "none":
        add("teacher_quantize=nf4", replace(run, teacher_quantize="nf4"))
    if run.teacher is not None and not run.kd_top_k:
        add("top_k=256", replace(run, kd_top_k=256))
    return out
