"""Hand-written model families that load HF safetensors key-for-key.

layers.py is the floor the decoder families share (norms, RoPE, attention with windows / soft caps /
sinks, gated MLPs, the expert block, masks, the KV cache, the body's forward, generation). Each family
file (llama.py: LLaMA / Mistral / Qwen2 / Qwen3; gemma.py: Gemma 2 / Gemma 3 text; phi3.py: Phi-3;
moe.py: Qwen3-MoE / Qwen2-MoE / Mixtral; gpt_oss.py: gpt-oss; qwen3_5.py: Qwen3.5, dense and MoE (multimodal: over
qwen3_vl.py's tower); gemma4.py: Gemma 4;
qwen2_5_vl.py: Qwen2.5-VL, its vision tower too; qwen3_vl.py: Qwen3-VL, Qwen2.5-VL's file with its own tower,
DeepStack and interleaved M-RoPE; qwen3_vl_moe.py: Qwen3-VL-MoE, Qwen3-VL's model over moe.py's language model; gemma3_vl.py: multimodal Gemma 3, its SigLIP tower and projector; gemma4_vl.py: multimodal Gemma 4, its vision
tower and embedder; t5.py)
imports only torch and that floor (a multimodal family also its text family), holds what is
particular to it, and exposes `config_from_hf(d)`. `from_hf_config` picks the family from a `config.json` dict.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch.nn as nn

# model_type -> family file (module in models/) and its causal-LM class
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "LlamaForCausalLM"),
    "qwen2": ("llama", "LlamaForCausalLM"),
    "qwen3": ("llama", "LlamaForCausalLM"),
    "gemma2": ("gemma", "GemmaForCausalLM"),
    "gemma3_text": ("gemma", "GemmaForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen3_moe": ("moe", "MoeForCausalLM"),
    "qwen2_moe": ("moe", "MoeForCausalLM"),
    "mixtral": ("moe", "MoeForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
    "qwen3_5_text": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "qwen3_5": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe_text": ("qwen3_5", "Qwen3_5MoeForCausalLM"),
    "qwen3_5_moe": ("qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    "gemma4_text": ("gemma4", "Gemma4ForCausalLM"),
    "gemma4": ("gemma4_vl", "Gemma4ForConditionalGeneration"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),
    "gemma3": ("gemma3_vl", "Gemma3ForConditionalGeneration"),
    "t5": ("t5", "T5ForConditionalGeneration"),
}
SUPPORTED = tuple(FAMILIES)


def config_from_hf(config: dict[str, Any]):
    """The family config dataclass for an HF `config.json` dict (ValueError if unsupported)."""
    model_type = config.get("model_type")
    if model_type in FAMILIES:
        return importlib.import_module(f"models.{FAMILIES[model_type][0]}").config_from_hf(config)
    raise ValueError(
        f"config.json: model_type {model_type!r} is not supported — minitrain loads {', '.join(SUPPORTED)}"
    )


def from_hf_config(config: dict[str, Any]) -> nn.Module:
    """Build the model for an HF `config.json` dict on the current default device.

    Call it under `with torch.device("meta"):` to build without allocating weights.
    """
    cfg = config_from_hf(config)
    module_name, class_name = FAMILIES[cfg.model_type]
    return getattr(importlib.import_module(f"models.{module_name}"), class_name)(cfg)


def family(model: nn.Module):
    """The family module (models.llama, models.gemma, ...) of a model built here: its `generate`,
    `KVCache`, config class. Chosen by the model's config, never by the class."""
    return importlib.import_module(f"models.{FAMILIES[model.config.model_type][0]}")
