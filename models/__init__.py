"""Hand-written model families that load HF safetensors key-for-key.

Each family file (llama.py, t5.py) imports only torch and can be copied alone.
`from_hf_config` picks the family from a `config.json` dict.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

SUPPORTED = ("llama", "mistral", "t5")


def config_from_hf(config: dict[str, Any]):
    """The family config dataclass for an HF `config.json` dict (ValueError if unsupported)."""
    model_type = config.get("model_type")
    if model_type in ("llama", "mistral"):
        from models.llama import LlamaConfig

        return LlamaConfig.from_hf(config)
    if model_type == "t5":
        from models.t5 import T5Config

        return T5Config.from_hf(config)
    raise ValueError(
        f"config.json: model_type {model_type!r} is not supported — minitrain loads {', '.join(SUPPORTED)}"
    )


def from_hf_config(config: dict[str, Any]) -> nn.Module:
    """Build the model for an HF `config.json` dict on the current default device.

    Call it under `with torch.device("meta"):` to build without allocating weights.
    """
    cfg = config_from_hf(config)
    if cfg.model_type == "t5":
        from models.t5 import T5ForConditionalGeneration

        return T5ForConditionalGeneration(cfg)
    from models.llama import LlamaForCausalLM

    return LlamaForCausalLM(cfg)
