"""HF-layout weights and config.json -> a GGUF file llama.cpp runs, per family.

What changes on the way (as llama.cpp's own converter does it, convert_hf_to_gguf.py):

- names: llama.cpp's (`blk.N.attn_q.weight`, `token_embd.weight`, ...), from the `gguf` package's
  own HF -> GGUF table (`gguf.get_tensor_name_map`); a tensor with no place there is refused;
- LLaMA and Mistral (llama.cpp's `llama` architecture) apply rotary embeddings to interleaved
  pairs where HF rotates halves: the rows of q_proj and k_proj are permuted per head to match
  (`permute_qk`); Qwen2, Qwen3, Gemma and Phi-3 rotate halves in llama.cpp too and keep theirs;
- Gemma 2 / 3 scale by (1 + w) in every RMSNorm: llama.cpp stores 1 + w;
- a tied output head is not written (llama.cpp reuses the token embedding);
- LLaMA 3.1's `llama3` RoPE scaling becomes the `rope_freqs` tensor, Phi-3's long-context
  factors `rope_factors_long` / `rope_factors_short`;
- mixture-of-experts (Qwen2-MoE `qwen2moe`, Qwen3-MoE `qwen3moe`, Mixtral on `llama`): the fused
  `experts.gate_up_proj` (E, 2F, D) splits into llama.cpp's stacked `ffn_gate_exps` / `ffn_up_exps`
  (E, F, D), `experts.down_proj` (E, D, F) is `ffn_down_exps` as it is; the router is `ffn_gate_inp`,
  Qwen2-MoE's shared expert and its gate the `*_shexp` tensors;
- gpt-oss (`gpt-oss`): the experts as HF's (E, D, 2F) hold them transposed to llama.cpp's (E, 2F, D), their
  interleaved gate / up rows (and biases) split into `ffn_gate_exps` / `ffn_up_exps`, `down_proj` (E, F, D)
  transposed to `ffn_down_exps`; the router `ffn_gate_inp` with its bias, the sinks `attn_sinks`; llama.cpp
  fixes what this export cannot change (SwiGLU clamped at 7, sliding layers the even ones), so a config that
  differs is refused;
- Qwen3.5 (`qwen35`, the MoE sizes `qwen35moe`: their experts, router and shared expert as Qwen2-MoE's;
  a multimodal folder's language model, without its towers and `mtp.*` head): the
  (1 + w) norms store 1 + w but the DeltaNet's gated norm; `A_log` is stored as A = -exp(A_log)
  (`ssm_a`), `dt_bias` as `ssm_dt.bias`, the convolution as (channels, kernel); with fewer key heads than
  value heads the value heads are reordered from grouped by key head to tiled (rows of the value part of
  `in_proj_qkv`, of `in_proj_z`, `in_proj_a`, `in_proj_b`, `A_log`, `dt_bias` and of the convolution's
  value channels; columns of `out_proj`), the order llama.cpp's broadcast reads; the layer pattern is
  written as `full_attention_interval`, the multimodal RoPE sections as `rope.dimension_sections`;
- Gemma 4 (`gemma4`; a multimodal folder's language model): its keys, RoPE tensor and checks are
  `gguf_gemma4.py`'s.

`check_exportable(config)` refuses, in one line, what llama.cpp would run differently from the
checkpoint: another family, a RoPE scaling it does not take, a sliding window shorter than the context
on the `llama` architecture (Mistral) or on `phi3` (Phi-3-mini-4k: llama.cpp disables Phi's window), a
Gemma query scale other than the one llama.cpp computes, an MoE with dense layers between its sparse ones
(llama.cpp's qwen2moe / qwen3moe make every layer sparse) or whose top-k renormalisation is not the one
llama.cpp's architecture applies (qwen2moe never renormalises, qwen3moe and Mixtral always do). LLaMA's `attention_bias` / `mlp_bias` are
written as the optional bias tensors llama.cpp's llama loader reads (q / k biases permuted with their rows). Types: f32; f16
and bf16 (1-D tensors, norms and biases, the routers `ffn_gate_inp` / `ffn_gate_inp_shexp` and the DeltaNet's
convolution stay f32 as llama.cpp's converter keeps them); q8_0 (blocks of 32
along a row with one f16 scale; a tensor whose rows are not a multiple of 32 is written f16).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minitrain.errors import UserError
from minitrain.export import gguf_gemma4 as gemma4
from minitrain.export.gguf_vocab import add_vocab

TYPES = ("f32", "f16", "bf16", "q8_0")
# written f32 in every type, as llama.cpp's converter does (besides 1-D tensors): the 2-D biases (gpt-oss's per
# expert), the routers (a rounded router moves which experts a token reaches), the DeltaNet's convolution
# (llama.cpp's ssm_conv reads f32)
F32_KEPT = (".bias", "ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


@dataclass(frozen=True)
class Family:
    arch: str  # llama.cpp's architecture name (`general.architecture`)
    permute_qk: bool  # interleaved rotary pairs in llama.cpp: permute q_proj / k_proj rows
    norm_plus_one: bool  # Gemma: RMSNorm scales by (1 + w)


FAMILIES = {
    "llama": Family("llama", True, False),
    "mistral": Family("llama", True, False),
    "qwen2": Family("qwen2", False, False),
    "qwen3": Family("qwen3", False, False),
    "gemma2": Family("gemma2", False, True),
    "gemma3_text": Family("gemma3", False, True),
    "phi3": Family("phi3", False, False),
    "qwen2_moe": Family("qwen2moe", False, False),
    "qwen3_moe": Family("qwen3moe", False, False),
    "mixtral": Family("llama", True, False),
    "qwen3_5_text": Family("qwen35", False, True),  # (1 + w) norms but the DeltaNet's gated one (`linear_attn.norm`)
    "qwen3_5": Family("qwen35", False, True),
    "gpt_oss": Family("gpt-oss", False, False),
    "qwen3_5_moe_text": Family("qwen35moe", False, True),
    "qwen3_5_moe": Family("qwen35moe", False, True),
    "gemma4_text": Family("gemma4", False, False),  # Gemma 4 scales by w: stored as it is (gguf_gemma4.py)
    "gemma4": Family("gemma4", False, False),
}
DELTANET = ("qwen35", "qwen35moe")  # the architectures with Qwen3.5's Gated DeltaNet layers
GPT_OSS_SWIGLU_LIMIT = 7.0  # llama.cpp's gpt-oss graph clamps its SwiGLU here, whatever the config says
# the top-k routing weights renormalised to sum to 1 (`norm_topk_prob`), as llama.cpp's graph has it
RENORMALISES = {"qwen2_moe": False, "qwen3_moe": True}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}  # llama.cpp scales queries by hidden / heads there


def head_dim(config: Mapping[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def rope_params(config: Mapping[str, Any], layers: str = "full_attention") -> dict[str, Any]:
    """config.json's RoPE settings of the full (or sliding) attention layers: `rope_scaling` (transformers 4)
    or `rope_parameters` (transformers 5, per layer type for Gemma 3), with the top-level `rope_theta`."""
    rs = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rs = rs.get(layers, rs if layers == "full_attention" else {}) if isinstance(rs, dict) else {}
    return {"rope_theta": config.get("rope_theta"), "partial_rotary_factor": config.get("partial_rotary_factor"),
            **{k: v for k, v in rs.items() if v is not None}}


def rope_scaling(config: Mapping[str, Any]) -> dict[str, Any]:
    """The full-attention layers' RoPE scaling, {} without one."""
    rs = rope_params(config)
    kind = rs.get("rope_type", rs.get("type"))
    return {} if kind in (None, "default") else dict(rs, rope_type=kind)


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A multimodal config.json's language model settings (`text_config`, over the outer keys) with the
    outer `model_type`; a text config as it is."""
    inner = config.get("text_config")
    return dict(config) if not isinstance(inner, Mapping) else {**config, **inner, "model_type": config["model_type"]}


def full_attention_interval(config: Mapping[str, Any]) -> int:
    """Qwen3.5's layer pattern as llama.cpp's qwen35 reads it: every n-th layer attends, the others are
    DeltaNet layers; a `layer_types` list of another pattern is a UserError."""
    n = int(config.get("full_attention_interval") or 4)
    types = config.get("layer_types")
    if types:
        n = next((i + 1 for i, t in enumerate(types) if t == "full_attention"), len(types) + 1)
        if types != ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(len(types))]:
            raise UserError("config.json: layer_types is not one full-attention layer every n layers — llama.cpp's "
                            "qwen35 places its attention layers by full_attention_interval alone; not exported")
    return n


def check_exportable(config: Mapping[str, Any]) -> Family:
    """The family of config.json, or a `UserError` saying what llama.cpp cannot run as the checkpoint does."""
    config = text_config(config)
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise UserError(f"config.json: model_type {kind!r} — GGUF export takes {', '.join(FAMILIES)}")
    fam = FAMILIES[kind]
    if fam.arch == "gemma4":  # RoPE per layer type, and what else llama.cpp's gemma4 would compute otherwise
        gemma4.check(config)
        return fam
    rs = rope_scaling(config)
    allowed = {"llama": ("linear", "llama3"), "qwen2": ("linear", "yarn"), "qwen3": ("linear", "yarn"),
               "qwen2moe": ("linear", "yarn"), "qwen3moe": ("linear", "yarn"),
               "gemma2": (), "gemma3": ("linear",), "phi3": ("longrope", "su"), "qwen35": (),
               "qwen35moe": (), "gpt-oss": ("yarn",)}[fam.arch]
    if rs and rs["rope_type"] not in allowed:
        raise UserError(f"config.json: rope_scaling {rs['rope_type']!r} on {kind} — llama.cpp's {fam.arch} takes "
                        f"{', '.join(allowed) or 'none'}; not exported")
    if fam.arch == "llama":
        window = config.get("sliding_window")
        if window and window < config.get("max_position_embeddings", 0):
            raise UserError(f"config.json: sliding_window={window} — llama.cpp's llama architecture attends to the "
                            f"whole context, so beyond {window} tokens it would not compute this model; not exported")
    window = config.get("sliding_window")
    if fam.arch == "phi3" and window and window < config.get("max_position_embeddings", 0):
        raise UserError(f"config.json: sliding_window={window} — llama.cpp's phi3 attends to the whole context (its "
                        f"sliding window is disabled), so beyond {window} tokens it would not compute this model; "
                        f"not exported")
    if kind in RENORMALISES:
        dense = config.get("mlp_only_layers") or []
        step = config.get("decoder_sparse_step") or 1
        if dense or step != 1:
            raise UserError(f"config.json: {kind} with dense layers (mlp_only_layers={dense}, decoder_sparse_step="
                            f"{step}) — llama.cpp's {fam.arch} makes every layer sparse; not exported")
        if bool(config.get("norm_topk_prob")) != RENORMALISES[kind]:
            raise UserError(f"config.json: norm_topk_prob={bool(config.get('norm_topk_prob'))} — llama.cpp's "
                            f"{fam.arch} {'always' if RENORMALISES[kind] else 'never'} renormalises the top-k "
                            f"routing weights, so it would not compute this model; not exported")
    if fam.arch in DELTANET:
        full_attention_interval(config)
    if fam.arch == "gpt-oss":
        types = config.get("layer_types") or []
        if types != ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(types))]:
            raise UserError("config.json: layer_types do not alternate sliding / full from layer 0 — llama.cpp's gpt-oss "
                            "makes the even layers sliding and the odd ones full; not exported")
        limit = config.get("swiglu_limit", GPT_OSS_SWIGLU_LIMIT)
        if limit != GPT_OSS_SWIGLU_LIMIT:
            raise UserError(f"config.json: swiglu_limit={limit} — llama.cpp's gpt-oss clamps its SwiGLU at "
                            f"{GPT_OSS_SWIGLU_LIMIT}; not exported")
    if kind in ("qwen2", "qwen2_moe") and config.get("use_sliding_window"):
        raise UserError("config.json: use_sliding_window=true — llama.cpp's qwen2 attends to the whole context; "
                        "not exported")
    if kind == "gemma2" and config.get("tie_word_embeddings") is False:
        raise UserError("config.json: gemma2 with its own lm_head (tie_word_embeddings=false) — llama.cpp's gemma2 "
                        "uses the token embedding as the output head; not exported")
    if kind in GEMMA_27B_LAYERS:
        scalar = config.get("query_pre_attn_scalar", head_dim(config))
        big = config.get("num_hidden_layers") == GEMMA_27B_LAYERS[kind]
        theirs = config["hidden_size"] // config["num_attention_heads"] if big else head_dim(config)
        if scalar != theirs:
            raise UserError(f"config.json: query_pre_attn_scalar={scalar} — llama.cpp scales {kind}'s queries by "
                            f"1/sqrt({theirs}); not exported")
    return fam


def write_metadata(writer: Any, config: Mapping[str, Any], fam: Family) -> None:
    """The architecture's hyper-parameters under llama.cpp's keys."""
    c = config
    if fam.arch == "gemma4":
        gemma4.write_metadata(writer, c)
        return
    writer.add_context_length(c.get("max_position_embeddings", 4096))
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    if c.get("intermediate_size"):  # Qwen3.5's MoE sizes may have none: every MLP is the experts
        writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c.get("num_key_value_heads") or c["num_attention_heads"])
    writer.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(c["vocab_size"])
    experts = c.get("num_experts") or c.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c["num_experts_per_tok"])
        if c.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if c.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    hd = head_dim(c)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    rp = rope_params(c)
    writer.add_rope_freq_base(float(rp.get("rope_theta") or 10000.0))
    rotary = int(hd * (rp.get("partial_rotary_factor") or 1.0))
    writer.add_rope_dimension_count(rotary)
    import gguf

    rs = rope_scaling(c)
    if rs.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rs["factor"])
    elif rs.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rs["factor"])
        writer.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
    if fam.arch in ("gemma2", "gemma3"):
        if c.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        if c.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(c["final_logit_softcapping"])
        if c.get("sliding_window"):
            writer.add_sliding_window(c["sliding_window"])
            types = c.get("layer_types")
            if types:  # per layer, as the checkpoint says
                writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
            elif fam.arch == "gemma3":
                writer.add_sliding_window_pattern(c.get("sliding_window_pattern", 6))
        local = rope_params(c, "sliding_attention").get("rope_theta") or c.get("rope_local_base_freq")
        if fam.arch == "gemma3" and local:
            writer.add_rope_freq_base_swa(float(local))
    if fam.arch == "gpt-oss":
        writer.add_sliding_window(c["sliding_window"])
        writer.add_expert_feed_forward_length(c["intermediate_size"])
    if fam.arch in DELTANET:
        writer.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(c["linear_key_head_dim"])
        writer.add_ssm_group_count(c["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(c["linear_num_value_heads"])
        writer.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
        writer.add_full_attention_interval(full_attention_interval(c))
        pairs = rotary // 2  # without sections in the config, thirds of the rotary pairs ((11, 11, 10) for 32); on
        sections = list(rp.get("mrope_section") or ((pairs + 2) // 3, (pairs + 1) // 3, pairs // 3))  # text every
        # section reads the same position
        writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    if fam.arch == "phi3":
        writer.add_sliding_window(c.get("sliding_window") or 0)
        if rs:
            orig = c.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings")
            writer.add_rope_scaling_orig_ctx_len(orig)
            scale = c["max_position_embeddings"] / orig
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)


def extra_tensors(config: Mapping[str, Any], fam: Family) -> dict[str, torch.Tensor]:
    """llama.cpp's RoPE factor tensors: LLaMA 3.1's `rope_freqs`, Phi-3's long / short factors."""
    if fam.arch == "gemma4":
        return {"rope_freqs.weight": gemma4.rope_freqs(config)}
    rs, hd = rope_scaling(config), head_dim(config)
    if rs.get("rope_type") == "llama3":
        theta = rs.get("rope_theta") or 10000.0
        freqs = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        factor, low, high = rs.get("factor", 8.0), rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        out = []
        for f in freqs.tolist():
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                out.append(1.0)
            elif wavelen > old / low:
                out.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                out.append(1 / ((1 - smooth) / factor + smooth))
        return {"rope_freqs.weight": torch.tensor(out, dtype=torch.float32)}
    if fam.arch == "phi3" and rs.get("long_factor"):
        return {"rope_factors_long.weight": torch.tensor(rs["long_factor"], dtype=torch.float32),
                "rope_factors_short.weight": torch.tensor(rs["short_factor"], dtype=torch.float32)}
    return {}


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of q_proj / k_proj (n_head * hd, ...) from HF's rotate-half order to llama.cpp's pairs:
    per head, the two halves interleave (rows i and hd/2 + i become neighbours)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiled_value_heads(t: torch.Tensor, dim: int, key_heads: int, size: int) -> torch.Tensor:
    """Qwen3.5's value heads along `dim` (blocks of `size`) from grouped by key head (k0's values, then
    k1's, ...) to tiled (each key head's first value head, then each one's second, ...): llama.cpp's order."""
    shape = list(t.shape)
    per_key = shape[dim] // size // key_heads
    t = t.reshape(*shape[:dim], key_heads, per_key, size, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def qwen35_tensor(key: str, t: torch.Tensor, c: Mapping[str, Any]) -> tuple[str, torch.Tensor]:
    """A Qwen3.5 DeltaNet tensor as llama.cpp's qwen35 stores it: (its key, its values)."""
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    if key.endswith(".conv1d.weight"):
        t = t.squeeze(1)  # (channels, 1, kernel) -> (channels, kernel)
    if key.endswith(".A_log"):
        t = -torch.exp(t)
    if key.endswith(".dt_bias"):
        key = key.removesuffix("dt_bias") + "dt_proj.bias"
    if nk == nv:
        return key, t
    qk = 2 * nk * dk  # q and k rows (channels) before the values
    if key.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        t = torch.cat([t[:qk], tiled_value_heads(t[qk:], 0, nk, dv)])
    elif key.endswith(".in_proj_z.weight"):
        t = tiled_value_heads(t, 0, nk, dv)
    elif key.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_proj.bias")):
        t = tiled_value_heads(t, 0, nk, 1)
    elif key.endswith(".out_proj.weight"):
        t = tiled_value_heads(t, 1, nk, dv)
    return key, t


def gguf_tensors(state: Mapping[str, torch.Tensor], config: Mapping[str, Any], fam: Family) -> dict[str, torch.Tensor]:
    """HF-named tensors -> llama.cpp-named fp32 tensors, transformed for `fam` (the module docstring)."""
    import gguf

    config = text_config(config)
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == fam.arch)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    # Gemma ties unless it says otherwise
    tied = config.get("tie_word_embeddings", fam.arch in ("gemma2", "gemma3", "gemma4"))
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        key = key.replace("model.language_model.", "model.", 1)  # a multimodal folder's language model
        if key == "lm_head.weight" and tied:
            continue
        t = t.detach().float().cpu()
        if fam.norm_plus_one and key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight"):
            t = t + 1
        if fam.arch in DELTANET and ".linear_attn." in key:
            key, t = qwen35_tensor(key, t, config)
            if key.endswith(".A_log"):  # llama.cpp's `ssm_a` has no suffix
                out[names.get_name(key)] = t
                continue
        if fam.permute_qk and key.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            t = permute_qk(t, heads)  # (LLaMA's attention_bias: the biases follow their rows)
        elif fam.permute_qk and key.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            t = permute_qk(t, kv)
        if fam.arch == "gpt-oss" and ".experts." in key:  # (E, D, 2F) / (E, 2F), gate and up interleaved; (E, F, D)
            stem = key[: key.index(".experts.") + len(".experts.")]
            if key.endswith("gate_up_proj") or key.endswith("gate_up_proj_bias"):
                t = t.transpose(-1, -2) if t.dim() == 3 else t
                bias = key.endswith("_bias")
                for part, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                    half = t[:, rows].contiguous()
                    out[names.get_name(stem + part) + (".bias" if bias else ".weight")] = half
            else:
                bias = key.endswith("_bias")
                out[names.get_name(stem + "down_proj") + (".bias" if bias else ".weight")] = (
                    t if bias else t.transpose(-1, -2).contiguous())
            continue
        if fam.arch == "gemma4" and gemma4.rename(key) != key:
            out[gemma4.rename(key)] = t
            continue
        if key.endswith(".experts.gate_up_proj") and fam.arch != "gemma4":  # (E, 2F, D): gate rows first, then up
            half = t.shape[1] // 2
            stem = key.removesuffix("gate_up_proj")
            out[names.get_name(stem + "gate_proj") + ".weight"] = t[:, :half].contiguous()
            out[names.get_name(stem + "up_proj") + ".weight"] = t[:, half:].contiguous()
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UserError(f"{key}: a tensor llama.cpp's {fam.arch} has no place for — not exported")
        out[name if key.endswith((".weight", ".bias")) else f"{name}.weight"] = t  # fused experts: no suffix
    return {**out, **extra_tensors(config, fam)}


def write_gguf(state: Mapping[str, torch.Tensor], config: Mapping[str, Any], tokenizer: str | Path, out: str | Path,
               kind: str = "f16", name: str | None = None) -> Path:
    """Write `state` (HF names, adapters already folded in) as a GGUF file at `out` (written aside and
    renamed: nothing half-written); `tokenizer`: the folder with the tokenizer files; `kind`: TYPES."""
    import gguf
    from gguf.quants import quantize

    if kind not in TYPES:
        raise UserError(f"--type {kind}: not one of {', '.join(TYPES)} (llama.cpp's own tools quantize further)")
    config = text_config(config)
    fam = check_exportable(config)
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]
    tensors = gguf_tensors(state, config, fam)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    writer = gguf.GGUFWriter(tmp, fam.arch)
    try:
        writer.add_name(name or out.stem)
        write_metadata(writer, config, fam)
        writer.add_file_type(ftype)
        add_vocab(writer, tokenizer, config["vocab_size"], fam.arch)
        for tname, t in tensors.items():
            data = t.numpy()
            want = qtype if data.ndim > 1 and not tname.endswith(F32_KEPT) else gguf.GGMLQuantizationType.F32
            if want == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % 32:
                want = gguf.GGMLQuantizationType.F16  # rows not in whole blocks of 32 (as llama.cpp falls back)
            if want in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                writer.add_tensor(tname, quantize(data, want))
            else:
                writer.add_tensor(tname, quantize(data, want), raw_dtype=want)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out
