"""Phi-3 / Phi-3.5 mini (model_type `phi3`), importing only torch.

Phi-3 is LLaMA's maths with two fused projections, which change the module names (and so the
checkpoint keys and the LoRA / PEFT target names), so it has its own file:

- `self_attn.qkv_proj`: one Linear D -> (H + 2 Hkv) hd whose output is [q | k | v] in that order;
- `mlp.gate_up_proj`: one Linear D -> 2F whose output is [gate | up]; `down(silu(gate) * up)`.

RoPE: plain, or `longrope` (the `su` of the first Phi-3 128k configs): one divisor per frequency,
`short_factor` while the longest position is within `original_max_position_embeddings`,
`long_factor` beyond, and cos/sin scaled by sqrt(1 + ln(factor) / ln(original length)).
`partial_rotary_factor` < 1 rotates only the first part of each head. `sliding_window` (Phi-3
mini 4k: 2047) applies to every layer, as in transformers. Rotary tables, masks, the KV cache,
RMSNorm, the attention's forward, the block, the body's forward, `generate` and the captured layers of
distillation are the floor's (models/layers.py, which needs nothing but torch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.layers import (
    IGNORED_FIELDS,
    Attention,
    CausalLM,
    DecoderBody,
    KVCache,
    PreNormBlock,
    RMSNorm,
    RopeSpec,
    apply_partial_rotary,
    check_fields,
    check_heads,
    drop_ignored,
    generate,
    normalize_rope_scaling,
    require_zero,
)

__all__ = ["Phi3Config", "Phi3ForCausalLM", "KVCache", "generate", "config_from_hf"]


@dataclass
class Phi3Config:
    """Phi-3 hyper-parameters under their HF `config.json` names (transformers' defaults)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 32000
    pad_token_id: int | None = 32000
    model_type: str = "phi3"

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act {self.hidden_act!r} is not supported — Phi-3 uses 'silu'")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(
                f"config.json: partial_rotary_factor={self.partial_rotary_factor} gives {self.rotary_dim} rotary "
                "dims — use a factor in (0, 1] that gives an even number"
            )
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"config.json: sliding_window={self.sliding_window!r} — use a positive int or null")
        r = dict(self.rope_scaling or {})
        if r.get("rope_type", r.get("type")) in ("su", "yarn"):  # transformers reads both as longrope
            r.pop("type", None)
            r["rope_type"] = "longrope"
        if r.get("rope_type", r.get("type", "default")) not in ("default", "longrope"):
            raise ValueError(
                f"config.json: rope_scaling type {r.get('rope_type', r.get('type'))!r} is not a Phi-3 RoPE — "
                "Phi-3 uses no scaling or 'longrope' ('su')"
            )
        if r.get("rope_type") == "longrope":
            r.setdefault("original_max_position_embeddings", self.original_max_position_embeddings)
        self.rope_scaling = normalize_rope_scaling(r, self.max_position_embeddings)
        for key in ("short_factor", "long_factor"):
            n = len((self.rope_scaling or {}).get(key, [0] * (self.rotary_dim // 2)))
            if n != self.rotary_dim // 2:
                raise ValueError(
                    f"config.json: rope_scaling {key} has {n} entries — longrope needs one per rotated frequency, "
                    f"head_dim/2 = {self.rotary_dim // 2}"
                )

    def layer_windows(self) -> list[int | None]:
        """The sliding window of each layer: the same on every layer, as transformers applies it."""
        return [self.sliding_window] * self.num_hidden_layers

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Phi3Config":
        """From an HF `config.json` dict (old `rope_theta` / `rope_scaling` or v5 `rope_parameters`)."""
        d = dict(d)
        if d.pop("model_type", None) != "phi3":
            raise ValueError("config.json: model_type is not 'phi3'")
        drop_ignored(d, (*IGNORED_FIELDS, "auto_map"))  # auto_map: remote-code class names of the original upload
        require_zero(d, "attention_dropout", "resid_pdrop", "embd_pdrop")
        params = dict(d.pop("rope_parameters", None) or {})
        if "rope_theta" in params:
            d["rope_theta"] = params.pop("rope_theta")
        if "partial_rotary_factor" in params:
            d.setdefault("partial_rotary_factor", params.pop("partial_rotary_factor"))
        if params.get("rope_type", params.get("type", "default")) != "default":
            d["rope_scaling"] = d.get("rope_scaling") or params
        check_fields(d, cls, "phi3", "Phi-3")
        if "rope_theta" in d:
            d["rope_theta"] = float(d["rope_theta"])
        return cls(**d)

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict transformers loads."""
        d = asdict(self)
        d["architectures"] = ["Phi3ForCausalLM"]
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d


class Phi3Attention(Attention):
    """The floor's grouped-query attention with one fused `qkv_proj` ([q | k | v] along the output)
    and RoPE on the first `rotary_dim` features of each head."""

    rotate = staticmethod(apply_partial_rotary)

    def __init__(self, config: Phi3Config, layer_idx: int) -> None:
        H, Hkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        qkv_proj = nn.Linear(config.hidden_size, (H + 2 * Hkv) * hd, bias=False)
        super().__init__(config.hidden_size, H, Hkv, hd, layer_idx, projections={"qkv_proj": qkv_proj})

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., D) -> q (..., H, hd), k and v (..., Hkv, hd), split from the fused projection."""
        hd = self.head_dim
        q, k, v = self.qkv_proj(x).split([self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        return q.unflatten(-1, (-1, hd)), k.unflatten(-1, (-1, hd)), v.unflatten(-1, (-1, hd))


class Phi3MLP(nn.Module):
    """SwiGLU from one fused `gate_up_proj` ([gate | up] along the output)."""

    def __init__(self, config: Phi3Config) -> None:
        super().__init__()
        D, F_ = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(D, 2 * F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


class Phi3DecoderLayer(PreNormBlock):
    """Pre-norm block, the floor's forward: x + attn(norm(x)), then + mlp(norm(x)), over Phi-3's fused
    attention and MLP."""

    def __init__(self, config: Phi3Config, layer_idx: int) -> None:
        super().__init__(Phi3Attention(config, layer_idx), Phi3MLP(config), config.hidden_size, config.rms_norm_eps)


class Phi3Model(DecoderBody):
    """Embeddings, decoder layers, final norm (HF's `model.` prefix); the floor's forward, every
    layer with the same RoPE and window."""

    def __init__(self, config: Phi3Config) -> None:
        super().__init__(config)
        self.build(Phi3DecoderLayer, rope=RopeSpec(config.rotary_dim, config.rope_theta, config.rope_scaling,
                                                   config.max_position_embeddings))


class Phi3ForCausalLM(CausalLM):
    """`model` + `lm_head`; forward returns hidden states."""

    block_types = (Phi3DecoderLayer,)
    # fused linear -> the unfused names it holds: LoRA target lists written for LLaMA (q_proj, ...,
    # up_proj) adapt these modules, and one naming part of a fused linear is refused
    fused_linears = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: Phi3Config) -> None:
        super().__init__(config, Phi3Model(config))


def config_from_hf(d: dict[str, Any]) -> Phi3Config:
    """The registry's entry point (models/__init__.py): `Phi3Config.from_hf`."""
    return Phi3Config.from_hf(d)
