"""Gemma 2 and Gemma 3 (text: `Gemma3ForCausalLM`, model_type `gemma3_text`), importing only torch.

What differs from LLaMA is structure, so the family has its own file (config, attention, block,
model); the norms, rotary tables, the KV cache, masks, soft-capped attention, the body's forward and
`generate` are the floor's (models/layers.py, which needs nothing but torch):

- RMSNorm multiplies by `(1 + weight)` and casts back after the multiply (weights start at 0);
- embeddings are scaled by sqrt(hidden_size), that factor rounded to the activations' dtype first
  (as transformers does: 48.0 in bf16 is exact, sqrt(1152) is not);
- every block is "sandwiched": norm -> attention -> norm -> + residual, norm -> MLP -> norm -> + residual;
- the MLP is GeGLU with tanh-approximated GELU (`gelu_pytorch_tanh`);
- attention scores are scaled by `query_pre_attn_scalar ** -0.5`, not head_dim ** -0.5;
- layers alternate between a sliding window and global attention (`layer_types`: Gemma 2 every
  other layer, Gemma 3 five local to one global);
- Gemma 2 soft-caps attention scores (`cap * tanh(s / cap)` before the mask and softmax) and the
  final logits. SDPA cannot apply a function between the scores and the softmax, so a
  soft-capped layer runs an explicit attention (scores in memory: B x H x T x S); a layer without
  a cap keeps SDPA. The final cap lives in the head (`SoftcappedLinear`), so
  `output_projection(hidden)` are the model's logits for every loss and tool;
- Gemma 3 adds per-head `q_norm` / `k_norm` (the same (1 + w) RMSNorm) and two RoPE bases: local
  layers use `rope_local_base_freq` (10k) without scaling, global layers `rope_theta` (1M) with
  `rope_scaling` (e.g. linear x8 on the 4B+ checkpoints). Gemma 3 caps no attention scores (its
  `attn_logit_softcapping` is null, and transformers ignores the field even when set); the
  final-logit cap applies when set.

Multimodal Gemma 3 checkpoints (model_type `gemma3`) are gemma3_vl.py's, which builds this text model
beside the SigLIP tower.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

from models.layers import (
    IGNORED_FIELDS as SHARED_IGNORED,
    Attention,
    CausalLM,
    DecoderBody,
    GatedMLP,
    KVCache,
    OffsetRMSNorm,
    RopeSpec,
    RotaryEmbedding,
    SoftcappedLinear,
    check_fields,
    check_heads,
    check_layer_types,
    drop_ignored,
    generate,
    normalize_rope_scaling,
    require_zero,
)

__all__ = ["GemmaConfig", "GemmaForCausalLM", "KVCache", "generate", "config_from_hf"]

FAMILIES = ("gemma2", "gemma3_text")
# harmless config.json fields (generation / cache bookkeeping) besides LLaMA's
IGNORED_FIELDS: tuple[str, ...] = (*SHARED_IGNORED, "cache_implementation", "_sliding_window_pattern")

# transformers' class defaults for fields a config.json may leave out
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, rope_theta=10000.0,
                   sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   query_pre_attn_scalar=256, tie_word_embeddings=True),
    "gemma3_text": dict(num_key_value_heads=4, head_dim=256, max_position_embeddings=131072, rope_theta=1e6,
                        rope_local_base_freq=10000.0, sliding_window=4096, final_logit_softcapping=None,
                        attn_logit_softcapping=None, query_pre_attn_scalar=256, tie_word_embeddings=True),
}


@dataclass
class GemmaConfig:
    """Gemma 2 / Gemma 3 text hyper-parameters under their HF `config.json` names.

    `rope_theta` / `rope_scaling`: the global layers' RoPE (Gemma 2: every layer's);
    `rope_local_base_freq`: the sliding layers' base (Gemma 3 only; never scaled).
    `layer_types` lists "sliding_attention" / "full_attention" per layer (derived from
    `sliding_window_pattern` as transformers does when absent).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_local_base_freq: float | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = 0
    model_type: str = "gemma2"

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(f"config.json: model_type {self.model_type!r} is not Gemma — use one of {FAMILIES}")
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(
                f"config.json: hidden_activation {self.hidden_activation!r} is not supported — Gemma uses "
                "'gelu_pytorch_tanh'"
            )
        if self.model_type == "gemma2" and self.rope_local_base_freq is not None:
            raise ValueError("config.json: rope_local_base_freq is a Gemma 3 field — remove it from a gemma2 config")
        if self.layer_types is None:  # Gemma 2: local, global, ...; Gemma 3 reads sliding_window_pattern
            self.layer_types = [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.num_hidden_layers)
            ]
        check_layer_types(self.layer_types, self.num_hidden_layers)
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "GemmaConfig":
        """From an HF `config.json` dict: old spellings (`rope_theta`, `rope_scaling`,
        `rope_local_base_freq`, `sliding_window_pattern`) or transformers v5's `rope_parameters`
        (Gemma 3: one dict per layer type). Unknown maths fields are ValueErrors."""
        d = dict(d)
        model_type = d.pop("model_type", None)
        if model_type not in FAMILIES:
            raise ValueError(f"config.json: model_type {model_type!r} is not Gemma — use one of {FAMILIES}")
        drop_ignored(d, IGNORED_FIELDS)
        require_zero(d, "attention_dropout")
        if d.pop("use_bidirectional_attention", None):
            raise ValueError(
                "config.json: use_bidirectional_attention=true (an embedding model) is not supported — "
                "minitrain trains causal Gemma models"
            )
        act = d.pop("hidden_act", None)  # old Gemma 2 configs carry both names
        if act is not None and act != d.get("hidden_activation", act):
            raise ValueError(f"config.json: hidden_act {act!r} and hidden_activation disagree — keep one")
        if act is not None:
            d.setdefault("hidden_activation", act)
        pattern = d.pop("sliding_window_pattern", None)
        if pattern is not None and d.get("layer_types") is None:
            d["layer_types"] = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(d.get("num_hidden_layers", 0))
            ]
        elif model_type == "gemma3_text" and d.get("layer_types") is None:
            d["layer_types"] = [
                "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(d.get("num_hidden_layers", 0))
            ]

        params = d.pop("rope_parameters", None) or {}
        if "full_attention" in params or "sliding_attention" in params:  # v5 Gemma 3: one per layer type
            local = dict(params.get("sliding_attention") or {})
            if normalize_rope_scaling(local, 0) is not None:
                raise ValueError(
                    f"config.json: rope_parameters.sliding_attention {local} scales the local RoPE — Gemma 3 "
                    "scales only the global layers; remove the scaling"
                )
            if "rope_theta" in local:
                d["rope_local_base_freq"] = local["rope_theta"]
            params = dict(params.get("full_attention") or {})
        if params:
            if "rope_theta" in params:
                d["rope_theta"] = params["rope_theta"]
            if d.get("rope_scaling") and normalize_rope_scaling(d["rope_scaling"], 0) != normalize_rope_scaling(
                params, 0
            ):
                raise ValueError("config.json: rope_scaling and rope_parameters disagree — keep only one of them")
            d["rope_scaling"] = d.get("rope_scaling") or params

        check_fields(d, cls, model_type)
        kw = {**_DEFAULTS[model_type], **d}
        kw["rope_theta"] = float(kw["rope_theta"])
        if kw.get("rope_local_base_freq") is not None:
            kw["rope_local_base_freq"] = float(kw["rope_local_base_freq"])
        return cls(**kw, model_type=model_type)

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict transformers loads (old RoPE spelling, which v4 and v5 read)."""
        d = asdict(self)
        d["architectures"] = ["Gemma2ForCausalLM" if self.model_type == "gemma2" else "Gemma3ForCausalLM"]
        if self.model_type == "gemma2":
            d.pop("rope_local_base_freq")
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d

    def layer_windows(self) -> list[int | None]:
        """The sliding window of each layer (None: global attention)."""
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]


# --------------------------------------------------------------------------------------------
# Attention, block
# --------------------------------------------------------------------------------------------


class GemmaAttention(Attention):
    """The floor's grouped-query attention at `query_pre_attn_scalar`'s scale, with Gemma 2's score
    soft-cap and Gemma 3's (1 + w) q/k norms."""

    def __init__(self, config: GemmaConfig, layer_idx: int) -> None:
        eps = config.rms_norm_eps
        super().__init__(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim, layer_idx,
            qkv_bias=config.attention_bias, o_bias=config.attention_bias,
            qk_norm=(lambda hd: OffsetRMSNorm(hd, eps)) if config.model_type == "gemma3_text" else None,
            scaling=config.query_pre_attn_scalar**-0.5,
            # transformers' Gemma 3 keeps the field but never applies it (Gemma 3 dropped the score cap
            # for QK-norm); a gemma3_text config that sets it means what it means there: nothing
            cap=config.attn_logit_softcapping if config.model_type == "gemma2" else None,
        )


class GemmaDecoderLayer(nn.Module):
    """Sandwich block: x + norm(attn(norm(x))), then + norm(mlp(norm(x))). Checkpointed and
    compiled as one unit."""

    def __init__(self, config: GemmaConfig, layer_idx: int) -> None:
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_idx)
        self.mlp = GatedMLP(D, config.intermediate_size, "gelu_pytorch_tanh")
        self.input_layernorm = OffsetRMSNorm(D, eps)
        self.post_attention_layernorm = OffsetRMSNorm(D, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(D, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(D, eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        return_attention: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> (B, T, D); `return_attention`: and the attention probabilities (B, H, T, S)."""
        h = self.input_layernorm(x)
        a, probs = (self.self_attn(h, cos, sin, mask, cache, return_probs=True) if return_attention
                    else (self.self_attn(h, cos, sin, mask, cache), None))
        x = x + self.post_attention_layernorm(a)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return (x, probs) if return_attention else x


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class GemmaModel(DecoderBody):
    """Scaled embeddings, sandwich blocks, final (1 + w) norm (HF's `model.` prefix); the floor's
    forward, each layer with its layer type's RoPE."""

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.windows = config.layer_windows()
        spec = RopeSpec(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)
        self.rotary = {"full_attention": RotaryEmbedding(spec)}
        if config.model_type == "gemma3_text":  # local layers: their own base, no scaling
            local = RopeSpec(config.head_dim, config.rope_local_base_freq or 10000.0, None,
                             config.max_position_embeddings)
            self.rotary["sliding_attention"] = RotaryEmbedding(local)
        self.rope_kinds = [t if t in self.rotary else "full_attention" for t in config.layer_types]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times sqrt(hidden_size), that factor rounded to their dtype first, as HF."""
        x = self.embed_tokens(input_ids)  # (B, T, D)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)


class GemmaForCausalLM(CausalLM):
    """`model` + `lm_head` (soft-capped when the config says so); forward returns hidden states."""

    block_types = (GemmaDecoderLayer,)

    def __init__(self, config: GemmaConfig) -> None:
        cap = config.final_logit_softcapping
        head = SoftcappedLinear(config.hidden_size, config.vocab_size, cap) if cap else None
        super().__init__(config, GemmaModel(config), head)


def config_from_hf(d: dict[str, Any]) -> GemmaConfig:
    """The registry's entry point (models/__init__.py): `GemmaConfig.from_hf`."""
    return GemmaConfig.from_hf(d)
