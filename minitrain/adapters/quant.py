"""Quantized bases: swap each base `nn.Linear` for a quantized layer as its weight streams in.

nf4 and int8 are bitsandbytes layers; ternary (BitNet b1.58, {-1, 0, +1} x a scale, 2 bits a
weight) is minitrain's own plain-torch `TernaryLinear` (minitrain.adapters.ternary), with no extra dependency.

Use it as the loader's tensor hook, with the loader's `dtype` equal to the compute dtype so the
layers left in float (embeddings, norms, the skipped head) match what the quantized ones compute in:

    model = load_pretrained(folder, build, dtype=torch.bfloat16,
                            tensor_hook=quantize_hook("nf4", compute_dtype=torch.bfloat16))

The model is built on meta, so when `...q_proj.weight` arrives its Linear is still empty; the hook
quantizes that one tensor and puts a `Linear4bit` / `Linear8bitLt` / `TernaryLinear` holding it in
the Linear's place. At no point does a full-precision copy of the whole model exist: peak memory is the
quantized model plus one float tensor. Quantized weights are uint8 / int8 and never trainable;
adapters (minitrain.adapters.lora) wrap these layers and train float tensors beside them.
"""

from __future__ import annotations

import logging
import warnings
from typing import Literal

import torch
import torch.nn as nn

from minitrain.adapters.lora import frozen_linear8bit
from minitrain.adapters.quant_experts import QuantizedExpertWeight, check_experts, put
from minitrain.adapters.ternary import SCALES, TernaryLinear
from minitrain.errors import UserError
from minitrain.weights import TensorHook

INSTALL = "pip install 'minitrain[quant]'"


def require_bitsandbytes():
    """Import and return `bitsandbytes`, or a UserError saying how to install it.

    On a CPU with AVX512-BF16, bitsandbytes' import logs that it failed to fetch an optional kernel from
    the Hugging Face hub (the `kernels` package): it then uses its own CPU kernels, and there is nothing
    for the user to do, so its log is held below errors while it imports; so are the deprecation
    warnings of the torch APIs it uses (`torch.jit.script_method`), which are its to act on."""
    quiet = logging.getLogger("bitsandbytes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import bitsandbytes
    except ImportError as e:
        raise UserError(f"quantized loading: bitsandbytes is not installed ({e}) — {INSTALL}") from None
    finally:
        quiet.setLevel(level)
    return bitsandbytes


def quantize_hook(
    kind: Literal["nf4", "int8", "ternary"] = "nf4",
    compute_dtype: torch.dtype = torch.bfloat16,
    skip: tuple[str, ...] = ("lm_head",),
    *,
    double_quant: bool = True,
    blocksize: int = 64,
    ternary_scale: str = "tensor",
    act_bits: int = 0,
) -> TensorHook:
    """A `load_pretrained` tensor hook that quantizes each arriving `nn.Linear` weight.

    kind: "nf4" (QLoRA's 4-bit NormalFloat, `Linear4bit`, computing in `compute_dtype`; with
    `double_quant` the per-block scales are themselves quantized) or "int8" (LLM.int8(),
    `Linear8bitLt` with `has_fp16_weights=False`, computing in the input's dtype) or "ternary"
    (`TernaryLinear`: absmean per tensor or per output channel, `ternary_scale`; `act_bits` > 0
    fake-quantizes its input per token as BitLinear does; computes in the input's or autocast dtype).
    skip: module names left in float — a name matches itself and any module path ending in
    `.name` (the default keeps the output head exact). Weights that are tied to another
    parameter (a tied head) are never quantized.
    """
    if kind not in ("nf4", "int8", "ternary"):
        raise UserError(f"quantize_hook: kind {kind!r} is not supported — use \"nf4\", \"int8\" or \"ternary\"")
    if not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise UserError(f"quantize_hook: compute_dtype {compute_dtype!r} is not a float dtype — use torch.bfloat16")
    if kind == "ternary":
        if ternary_scale not in SCALES:
            raise UserError(f"ternary_scale={ternary_scale}: must be tensor or channel — e.g. ternary_scale=tensor")
        if act_bits == 1 or not 0 <= act_bits <= 16:
            raise UserError(f"ternary_act_bits={act_bits}: must be 0 (off) or 2..16 — e.g. ternary_act_bits=8")
        bnb, quantized_types = None, (TernaryLinear,)
    else:
        bnb = require_bitsandbytes()
        quantized_types = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)

    def skipped(name: str) -> bool:
        return any(name == s or name.endswith("." + s) for s in skip)

    checked: list[bool] = []

    def hook(model: nn.Module, key: str, tensor: torch.Tensor) -> bool:
        if not checked:  # once, at the first tensor: before anything is quantized or written
            checked.append(True)
            check_experts(model, kind)
        owner, _, leaf = key.rpartition(".")
        if owner and tensor.dim() == 3 and tensor.is_floating_point() and kind != "ternary":
            experts = model.get_submodule(owner)
            if leaf in getattr(experts, "expert_projections", ()):  # an MoE's experts, each matrix quantized
                put(experts, leaf, QuantizedExpertWeight.of(tensor, kind, compute_dtype, bnb))
                return True
        if leaf != "weight" or not owner or skipped(owner) or not tensor.is_floating_point():
            return False
        module = model.get_submodule(owner)
        if not isinstance(module, nn.Linear) or isinstance(module, quantized_types):
            return False
        if any(p is module.weight for n, p in model.named_parameters(remove_duplicate=False) if n != key):
            return False  # tied (e.g. the head to the embedding): quantizing one name would untie them
        if kind == "ternary":  # quantized from the loaded tensor (the compute dtype), as nf4 is
            # the bias (a meta Parameter until it arrives, if it comes later in the file) is kept in place
            new = TernaryLinear.from_weight(tensor, module.bias, scale=ternary_scale, act_bits=act_bits)
        else:
            new = _quantize_linear(bnb, module, tensor, kind, compute_dtype, double_quant, blocksize)
        parent_name, _, child = owner.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        return True

    return hook


def _quantize_linear(bnb, old: nn.Linear, w: torch.Tensor, kind: str, compute_dtype: torch.dtype, double_quant: bool, blocksize: int) -> nn.Module:
    """A bitsandbytes layer holding `w` (out, in) quantized, with `old`'s bias carried over if loaded."""
    out_f, in_f = old.out_features, old.in_features
    has_bias = old.bias is not None
    if kind == "nf4":
        new = bnb.nn.Linear4bit(
            in_f, out_f, bias=has_bias, compute_dtype=compute_dtype, compress_statistics=double_quant,
            quant_type="nf4", quant_storage=torch.uint8, device="meta",
        )
        # quantized from the compute dtype, so dequantization yields exactly what the matmul uses
        packed, state = bnb.functional.quantize_4bit(
            w.to(compute_dtype).contiguous(), blocksize=blocksize, compress_statistics=double_quant,
            quant_type="nf4", quant_storage=torch.uint8,
        )
        new.weight = bnb.nn.Params4bit(
            packed, requires_grad=False, quant_state=state, blocksize=blocksize, compress_statistics=double_quant,
            quant_type="nf4", quant_storage=torch.uint8, module=new, bnb_quantized=True,
        )
        new.quant_state = state
        # bitsandbytes would repack the weight for a faster CPU kernel on the first eval + no_grad
        # forward; through the repacked kernel no gradient flows (only a torch warning): a QLoRA run
        # that evaluates once would then train with silently wrong gradients. Keep one layout.
        new.support_avx512bf16_for_cpu = False
    else:
        # (its matmul keeps no input on its autograd node: minitrain.adapters.lora.frozen_int8_matmul)
        new = frozen_linear8bit(in_f, out_f, bias=has_bias, has_fp16_weights=False, threshold=0.0, device="meta")
        # row-wise absmax int8 (LLM.int8()); bitsandbytes quantizes from fp16
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(w.to(torch.float16).contiguous())
        new.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
    if has_bias and not old.bias.is_meta:  # the bias arrived first (keys in file order): keep it
        new.bias = old.bias
    return new

