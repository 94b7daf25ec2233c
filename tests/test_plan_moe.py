"""The memory plan of the mixture-of-experts checkpoints beyond tests/test_plan.py's every-layer-sparse cases.

- Qwen3-MoE / Qwen2-MoE with dense MLP layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step`):
  the parameters, the frozen weights' bytes (float, nf4, int8), the LoRA tensors (Qwen3-MoE's per-expert names
  leave a dense layer's MLP unadapted, as `minitrain.adapters.lora_experts.split_targets`), the full fine-tuning
  gradients and AdamW state, all exact against the model built from config.json; a LoRA and a full fine-tuning
  SFT step's CPU peak within 20% of the plan (`check_sft_step`);
- gpt-oss (attention with sinks written out, sliding / full layers, the clamped SwiGLU experts with biases, the
  router's bias): the same exact terms, what the model holds after loading a tiny MXFP4 folder (made by the
  format's rules) equal to the plan's float weights, and LoRA / full fine-tuning steps within 20%;
- several ranks: 2 gloo ranks (as tests/test_plan_fsdp.py), a Qwen3-MoE with dense layers and gpt-oss, LoRA on
  the experts and full fine-tuning under `parallel=fsdp` (FSDP2 shards the experts by their first dim, E), a
  trained router (modules_to_save=gate) under fsdp and LoRA under `parallel=ddp` (the loop's bucketed all-reduce):
  rank 0's shards (or whole model), AdamW state and modules_to_save's whole frozen copies equal the plan's
  persistent terms to the byte, and its measured step peak plus those is within 20% of the plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import save_file
from test_plan import (ALL, ATTN, MOE_FAMILIES, build, check_sft_step, full_model, hf_config, quant_state_tensors,
                       tensor_bytes)
from test_plan_fsdp import launch_two

import models
from minitrain.adapters.lora import logical_numel
from minitrain.errors import UserError
from minitrain.plan.decoder import adapter_terms
from minitrain.plan.predict import predict, shape_from_hf
from minitrain.plan.run_shape import RunShape
from minitrain.train import build_optimizer, enable_checkpointing
from minitrain.weights import load_pretrained

# two of the four layers dense (mlp_only_layers: the last one among them on Qwen2-MoE; every second layer sparse),
# a dense MLP wider than the experts' rows
DENSE = {"qwen3_moe only": dict(MOE_FAMILIES["qwen3_moe"], mlp_only_layers=[0, 2], intermediate_size=512),
         "qwen3_moe step": dict(MOE_FAMILIES["qwen3_moe"], decoder_sparse_step=2, intermediate_size=512),
         "qwen2_moe only": dict(MOE_FAMILIES["qwen2_moe"], mlp_only_layers=[1, 3], intermediate_size=512)}


def dense_config(case: str) -> dict:
    return hf_config(**DENSE[case])


def moe_config(name: str) -> dict:
    """test_plan's every-layer-sparse families, the ones with dense layers (`DENSE`) and gpt-oss, by name."""
    return hf_config(**{**MOE_FAMILIES, **DENSE, "gpt_oss": GPT_OSS}[name])


@pytest.mark.parametrize("quantize", [None, "nf4", "int8"])
@pytest.mark.parametrize("name", list(MOE_FAMILIES) + list(DENSE))
def test_moe_weights_and_adapters_exact(name, quantize):
    """Every expert in memory: the base's bytes (float, or nf4 / int8 linears and experts as the loader's
    hook quantizes them, each expert apart) and the adapters (attention LoRA and each expert's pair, by
    the per-expert names, by path, all-linear; a dense layer's MLP by its path) counted as the model built
    from config.json holds them."""
    hf = moe_config(name)
    torch.manual_seed(0)
    model = models.from_hf_config(hf)
    shape = shape_from_hf(hf)
    if name in DENSE:
        assert sum(not hasattr(layer.mlp, "experts") for layer in model.model.layers) == 2
    if quantize:
        pytest.importorskip("bitsandbytes")
        from minitrain.adapters.quant import quantize_hook

        hook = quantize_hook(quantize, compute_dtype=torch.float32)
        for name_, p in list(model.named_parameters()):  # as the loader: every linear but the head (the hook picks)
            if name_ != "lm_head.weight":
                assert hook(model, name_, p.data) or not (p.dim() == 3 or name_.endswith("proj.weight")), name_
    held = list(model.parameters()) + list(model.buffers())
    held += [t for p in model.parameters() for t in quant_state_tensors(p)]
    run = RunShape(rows=1, seq=8, compute="fp32", quantize=quantize or "none")
    assert sum(t.bytes for t in shape.weight_terms(run)) == tensor_bytes(held)
    assert shape.num_params() == sum(logical_numel(p) for p in model.parameters())
    dense = [ATTN + ("mlp.gate_proj", "mlp.up_proj")] if name in DENSE else []
    for targets in [ALL, ATTN + ("experts.down_proj",), ("q_proj", "mlp.experts.gate_up_proj"), ("all-linear",), *dense]:
        built = build(hf, torch.float32, targets)
        lora = sorted(p.numel() for p in built.parameters() if p.requires_grad)
        assert sorted(shape.trainable_tensors(RunShape(rows=1, seq=8, lora_r=16, lora_targets=targets))) == lora, targets


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "qwen3_moe only", "qwen2_moe only", "gpt_oss"])
def test_moe_full_finetune_weights_grads_optimizer_exact(name):
    """finetune=full on an MoE: every expert, router, shared expert, dense MLP (gpt-oss: sink and bias) trains;
    the plan's fp32 weights, gradients and AdamW state are the bytes the model and torch's optimizer hold."""
    hf = moe_config(name)
    model = full_model(hf)
    shape, run = shape_from_hf(hf), RunShape(rows=2, seq=16, compute="bf16", full=True)
    params = list(model.parameters())
    assert sum(t.bytes for t in shape.weight_terms(run)) == tensor_bytes(params)
    assert sum(shape.all_tensors()) == sum(p.numel() for p in params) == shape.num_params()
    assert sorted(shape.trainable_tensors(run)) == sorted(p.numel() for p in params)
    opt = build_optimizer(list(model.named_parameters()), 0.0, 1e-3)
    model.output_projection(model(torch.randint(0, 2048, (2, 16)))).float().pow(2).mean().backward()
    opt.step()
    terms = {t.name: t.bytes for t in adapter_terms(shape, run)}
    assert terms["gradients"] == tensor_bytes(p.grad for p in params)
    assert terms["optimizer (AdamW)"] == tensor_bytes(v for st in opt.state.values() for v in st.values())


# planned / measured when written: 0.962, 1.013, 1.165, 0.966, 1.183 (a sparse block's recompute planned: where the
# last block is dense, the plan's moment is the largest checkpointed block's, else 0.874), full 0.960, 0.959
DENSE_CASES = {"qwen3_moe only fp32": dict(), "qwen3_moe only fp32 ckpt": dict(ckpt=True),
               "qwen3_moe step bf16": dict(compute="bf16"), "qwen2_moe only fp32": dict(),
               "qwen2_moe only fp32 ckpt": dict(ckpt=True),
               "qwen3_moe only full fp32": dict(full=True), "qwen2_moe only full bf16": dict(full=True, compute="bf16")}


@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_dense_layers_step_peak_within_20_percent(case):
    c = {"targets": ALL, **DENSE_CASES[case]}
    check_sft_step(dense_config(" ".join(case.split()[:2])), c.pop("targets"), case, **c)


def qwen3_vl_moe_dense(tmp_path) -> dict:
    """test_plan_vision's Qwen3-VL-MoE with its layer 0 dense (`mlp_only_layers`), as transformers writes it."""
    import test_plan_vision as vision
    import transformers

    text = {**vision.TEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
            "mlp_only_layers": [0], "rope_parameters": {**vision.ROPE, "mrope_interleaved": True}}
    transformers.Qwen3VLMoeConfig(text_config=text, vision_config={**vision.QWEN3_VISION, **vision.WIDE},
                                  image_token_id=vision.IMAGE, video_token_id=151, vision_start_token_id=152,
                                  vision_end_token_id=153).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_qwen3_vl_moe_dense_layers_exact_and_step_within_20_percent(tmp_path):
    """Qwen3-VL-MoE maps no per-expert name onto its experts: `gate_proj` / `up_proj` / `down_proj` adapt the dense
    layer's linears (and `down_proj` the experts'); counted as built, and a LoRA step on image rows within 20%
    (0.897 when written)."""
    from test_plan import measured_step
    from test_plan_vision import image_batch

    from minitrain.objectives.sft import sft

    hf = qwen3_vl_moe_dense(tmp_path)
    shape = shape_from_hf(hf)
    with torch.device("meta"):
        assert shape.num_params() == sum(p.numel() for p in models.from_hf_config(hf).parameters())
    for targets in (ALL, ("all-linear",), ("gate_proj", "up_proj")):
        model = build(hf, torch.float32, targets)
        frozen = [p for p in model.parameters() if not p.requires_grad]
        assert sum(t.bytes for t in shape.weight_terms(RunShape(rows=1, seq=8, compute="fp32"))) == tensor_bytes(frozen)
        lora = sorted(p.numel() for p in model.parameters() if p.requires_grad)
        assert sorted(shape.trainable_tensors(RunShape(rows=1, seq=8, lora_targets=targets))) == lora, targets
    batch, images = image_batch("qwen3_vl_moe")
    measured = measured_step(build(hf, torch.float32, ALL), sft, batch, autocast=False)
    run = RunShape(rows=2, seq=192, compute="fp32", lora_targets=ALL, targets=int((batch["labels"][:, 1:] != -100).sum()),
                   device="cpu", real_tokens=int(batch["attention_mask"].sum()), image_tokens=images)
    plan = predict(shape, run)
    assert 0.8 <= (plan.activation_peak + plan.term("gradients")) / measured <= 1.2, plan.peak_moment


# ----------------------------------------------------------------------------- gpt-oss

# sinks, alternating sliding (a window shorter than the measured rows) / full layers, 4 experts of 192 (top 2)
GPT_OSS = dict(model_type="gpt_oss", num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
               intermediate_size=192, sliding_window=128)
GPT_OSS_TARGETS = ATTN + ("experts.gate_up_proj", "experts.down_proj")


def test_gpt_oss_weights_and_adapters_exact():
    """The frozen base (fp32, bf16: sinks, router and expert biases among it) and the adapters as built."""
    hf = hf_config(**GPT_OSS)
    shape = shape_from_hf(hf)
    for dtype, compute in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        model = build(hf, dtype, GPT_OSS_TARGETS)
        frozen = [p for p in model.parameters() if not p.requires_grad]
        assert sum(t.bytes for t in shape.weight_terms(RunShape(rows=1, seq=8, compute=compute))) == tensor_bytes(frozen)
    for targets in (GPT_OSS_TARGETS, ("all-linear",), ("q_proj", "mlp.experts.down_proj")):
        lora = sorted(p.numel() for p in build(hf, torch.float32, targets).parameters() if p.requires_grad)
        assert sorted(shape.trainable_tensors(RunShape(rows=1, seq=8, lora_targets=targets))) == lora, targets


def test_gpt_oss_mxfp4_folder_holds_the_planned_float_experts(tmp_path):
    """A tiny MXFP4 folder (per expert and output row, 32 inputs as 16 bytes of E2M1 codes + one uint8 power of
    two, `quantization_config.quant_method: mxfp4`): after loading, the model holds its experts dequantized in
    the run's dtype and nothing packed, the bytes the plan counts."""
    hf = hf_config(**GPT_OSS)
    torch.manual_seed(0)
    sd = {k: v.contiguous() for k, v in models.from_hf_config(hf).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, n_in, n_out = sd.pop(k).shape  # ours: (E, in, out); the file's rows are the outputs
        sd[f"{k}_blocks"] = torch.randint(0, 256, (E, n_out, n_in // 32, 16), generator=g, dtype=torch.uint8)
        sd[f"{k}_scales"] = torch.randint(121, 128, (E, n_out, n_in // 32), generator=g, dtype=torch.uint8)
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**hf, "quantization_config": {"quant_method": "mxfp4"}}))
    shape = shape_from_hf(json.loads((tmp_path / "config.json").read_text()))
    for dtype, compute in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        model = load_pretrained(tmp_path, models.from_hf_config, dtype=dtype)
        held = list(model.parameters()) + list(model.buffers())
        assert all(p.dtype == dtype for p in held)
        assert sum(t.bytes for t in shape.weight_terms(RunShape(rows=1, seq=8, compute=compute))) == tensor_bytes(held)


# planned / measured when written: LoRA 1.017, 1.060, 1.030; full 0.976, 1.020 (0.817 before the fp32 products of
# the fp32 biases under autocast were counted)
GPT_OSS_CASES = {"lora fp32": dict(), "lora fp32 ckpt": dict(ckpt=True), "lora bf16": dict(compute="bf16"),
                 "full fp32": dict(full=True), "full bf16": dict(full=True, compute="bf16")}


@pytest.mark.parametrize("case", list(GPT_OSS_CASES))
def test_gpt_oss_step_peak_within_20_percent(case):
    check_sft_step(hf_config(**GPT_OSS), GPT_OSS_TARGETS, case, **GPT_OSS_CASES[case])


def test_moe_runs_the_plan_does_not_model_are_one_line():
    with pytest.raises(UserError, match="gpt-oss's experts .* are not ones minitrain quantizes"):
        predict(shape_from_hf(hf_config(**GPT_OSS)), RunShape(rows=1, seq=8, quantize="nf4"))


# ----------------------------------------------------------------------------- several ranks, measured

# rank 0's planned / measured peak when written: Qwen3-MoE (dense layers) LoRA fsdp 1.129, full fsdp 0.984, LoRA ddp
# 1.017, LoRA with the router trained (modules_to_save=gate) under fsdp 1.108-1.122, QLoRA fsdp nf4 1.072, int8 1.004;
# gpt-oss LoRA fsdp 1.001, full fsdp 0.989
RANKS = {"qwen3_moe": (lambda: dense_config("qwen3_moe only"), ALL + ("experts.gate_up_proj",),
                       ("lora fsdp", "full fsdp", "lora ddp", "router fsdp", "qlora fsdp", "int8 fsdp")),
         "gpt_oss": (lambda: hf_config(**GPT_OSS), GPT_OSS_TARGETS, ("lora fsdp", "full fsdp"))}
ROWS, SEQ = 4, 128


def ranks_worker(rank: int, out: str, module: str = "test_plan_moe") -> None:
    """One rank: per model and mode of `module`'s `RANKS`, build, shard (fsdp) or not (ddp), one warm-up step, one
    measured step. A mode is `<what> <ddp|fsdp>[ ckpt]`, what: `lora`, `full`, `qlora` (nf4) / `int8` (the base
    quantized as the loader does: by rows under fsdp), `router` / `head` (LoRA + that module in modules_to_save);
    an entry's `Images` gives image rows."""
    import importlib

    from minitrain.adapters.lora import LoRAConfig, applied, apply_lora, freeze_for_adapters
    from minitrain.objectives.sft import sft
    from minitrain.parallel import distributed, fsdp
    from minitrain.plan.measure import measure_peak_allocated

    results = {}
    for name, (config, targets, modes, *images) in importlib.import_module(module).RANKS.items():
        for mode in modes:
            torch.manual_seed(0)
            model = models.from_hf_config(config())
            if quantized(mode) != "none" and mode.split()[1] == "ddp":  # as the loader's hook quantizes them
                from minitrain.adapters.quant import quantize_hook

                hook = quantize_hook(quantized(mode), compute_dtype=torch.float32)
                for n, p in list(model.named_parameters()):
                    if n != "lm_head.weight" and "embed" not in n and p.dim() == 2:
                        hook(model, n, p.data)
            elif quantized(mode) != "none":  # under fsdp: as rows FSDP2 cuts (`minitrain.adapters.quant_rows`)
                by_rows(model, quantized(mode))
            if not mode.startswith("full"):
                cfg = LoRAConfig(r=8, alpha=16, dropout=0.0, targets=list(targets), modules_to_save=saved(mode, config))
                apply_lora(model, cfg)
                freeze_for_adapters(model, cfg)
            if mode.endswith("ckpt"):  # (before sharding, as `train` does)
                enable_checkpointing(model)
            if mode.split()[1] == "fsdp":
                fsdp.shard(model, torch.device("cpu"))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            opt = build_optimizer(named, 0.0, 1e-4)
            if images:  # this rank's rows of image rows (every rank the same ones)
                batch, n_images = images[0].batch()
            else:
                ids = torch.randint(4, 2048, (ROWS // 2, SEQ), generator=torch.Generator().manual_seed(rank))
                batch, n_images = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}, None

            def step(model=model, opt=opt, batch=batch, named=named, ddp=mode.split()[1] == "ddp"):
                loss, _, _ = sft(model, batch)
                loss.backward()
                if ddp:
                    distributed.all_reduce_sum([p.grad for _, p in named])
                opt.step()
                opt.zero_grad(set_to_none=True)

            step()  # the optimizer state exists from here on: the steady state
            peak, _ = measure_peak_allocated(step)
            local = [p.to_local() if distributed.is_sharded(p) else p for p in model.parameters()]
            state = [v.to_local() if distributed.is_sharded(v) else v for st in opt.state.values() for v in st.values()]
            quant = [t for p in model.parameters() for t in quant_state_tensors(p)]
            copies = [base for _, _, base in (applied(model).saved if applied(model) else ())]
            rows = dict(seq=batch["input_ids"].shape[1], images=n_images, real=int(batch["attention_mask"].sum()),
                        targets=int((batch["labels"][:, 1:] != -100).sum()))
            results[f"{name} {mode}"] = dict(rows=rows, copies=tensor_bytes(copies),
                frozen=tensor_bytes([t for t, p in zip(local, model.parameters()) if not p.requires_grad] + quant),
                trained=tensor_bytes(t for t, p in zip(local, model.parameters()) if p.requires_grad),
                optimizer=tensor_bytes(state), step_peak=peak, buffers=tensor_bytes(model.buffers()))
            del model, opt
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


@dataclass(frozen=True)
class Images:
    """A `RANKS` entry's image rows (a multimodal folder): `batch()` -> (this rank's rows, their image tokens), and
    the shape's fields the rows decide (Gemma 4's `max_soft_tokens`)."""

    batch: Callable[[], tuple[dict, int]]
    shape: dict = field(default_factory=dict)


def quantized(mode: str) -> str:
    """The base's format a mode of `RANKS` names: `qlora ...` nf4, `int8 ...` int8."""
    return {"qlora": "nf4", "int8": "int8"}.get(mode.split()[0], "none")


def saved(mode: str, config) -> tuple[str, ...]:
    """The modules_to_save a mode of `RANKS` names, trained beside the LoRA targets: `router ...` the family's router
    (Qwen's `gate`, Gemma 4's `router`), `head ...` the head."""
    if mode.startswith("router"):
        return (shape_from_hf(config()).ROUTER.rpartition(".")[2],)
    return ("lm_head",) if mode.startswith("head") else ()


def by_rows(model: torch.nn.Module, kind: str) -> None:
    """Swap the linears for `quant_rows`' layers and an MoE's expert weights for empty `QuantizedExpertWeight`s as a
    sharded load does (`replace_linears`, `replace_experts`), each filled by the module's own `quantized` (of the whole
    weight, or of every expert), as `minitrain.parallel.fsdp._read_rows` does before keeping a rank's rows."""
    from minitrain.adapters.quant import require_bitsandbytes
    from minitrain.adapters.quant_experts import replace_experts
    from minitrain.adapters.quant_rows import replace_linears

    whole = {n: m.weight for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    whole.update({f"{n}.{leaf}": getattr(m, leaf) for n, m in model.named_modules()
                  if hasattr(m, "expert_projections") for leaf in m.expert_projections})
    biases = {n: m.bias for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    replace_experts(model, kind, torch.float32, require_bitsandbytes())
    replace_linears(model, kind, torch.float32)
    with torch.no_grad():
        for n, m in model.named_modules():
            if hasattr(m, "quantized"):
                m.to_empty(device="cpu")
                values = {**m.quantized(whole[n]), "bias": biases.get(n)}
                for k, p in m.named_parameters():
                    p.copy_(values[k])


def test_two_ranks_measured_against_the_plan(tmp_path):
    check_two_ranks(tmp_path, "test_plan_moe")


def check_two_ranks(tmp_path: Path, module: str) -> None:
    """Run `ranks_worker` on 2 gloo ranks over `module`'s `RANKS`; rank 0's shards, AdamW state and peak against the
    plan."""
    import importlib

    launch_two(tmp_path, "ranks_worker", str(tmp_path), module, module="test_plan_moe")
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    for name, (config, targets, modes, *images) in importlib.import_module(module).RANKS.items():
        for mode in modes:
            m = rank0[f"{name} {mode}"]
            shape, rows = shape_from_hf(config()), m["rows"]
            if images:  # image rows, the same on each rank (with padding); Gemma 4's budget of soft tokens
                shape = replace(shape, **images[0].shape)
                batch = dict(seq=rows["seq"], mask=True, image_tokens=2 * rows["images"], targets=2 * rows["targets"],
                             real_tokens=2 * rows["real"])
            else:
                batch = dict(seq=SEQ, mask=False)
            run = RunShape(rows=ROWS, **batch, compute="fp32", device="cpu", lora_r=8, lora_targets=targets,
                           full=mode.startswith("full"), world=2, parallel=mode.split()[1],
                           quantize=quantized(mode), checkpointing=mode.endswith("ckpt"),
                           modules_to_save=saved(mode, config))
            plan = predict(shape, run)
            got = {t.name: t.bytes for t in plan.persistent}
            if run.parallel == "fsdp":
                assert m["frozen"] == got["weights: 1/N shard (FSDP2)"], (name, mode)
                assert m["trained"] == got["trained tensors: 1/N shard"], (name, mode)
                assert m["optimizer"] == got["optimizer (AdamW): 1/N shard"], (name, mode)
                # a module_to_save's frozen base copy, whole on each rank (a plain tensor, outside FSDP2)
                assert m["copies"] == got.get("modules_to_save: frozen base copies (whole)", 0), (name, mode)
            else:  # the whole model on each rank (Gemma 4's `layer_scalar` buffers among its weights; the frozen
                # copies as the base weights, the trained modules as adapters)
                held = m["frozen"] + m["trained"] + m["buffers"] + m["copies"]
                # (full fine-tuning: the gradients are the step's, not persistent)
                assert held == plan.persistent_bytes - got.get("gradients", 0) - got["optimizer (AdamW)"], (name, mode)
                assert m["optimizer"] == got["optimizer (AdamW)"], (name, mode)
            measured = m["frozen"] + m["trained"] + m["optimizer"] + m["copies"] + m["step_peak"]  # (gradients: in the step)
            print(f"{name} {mode}: planned / measured {plan.peak / measured:.3f} ({plan.peak_moment})")
            assert measured == pytest.approx(plan.peak, rel=0.2), (name, mode, measured, plan.peak, plan.peak_moment)
