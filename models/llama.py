"""LLaMA 2 / 3 / 3.1 / 3.2, Mistral v0.1-v0.3, Qwen2 / Qwen2.5 and Qwen3 in one file, over the shared
floor (`models/layers.py`, which needs nothing but torch).

Read top to bottom: config, attention, block, model. Norms, rotary embeddings (every rope_scaling type
these checkpoints use), the KV cache, masks, the body's forward (padding, the unpadded CPU path, rows
of several sequences), the causal-LM wrapper and `generate` are the floor's. Module names are Hugging
Face's (`model.layers.0.self_attn.q_proj`, ...) so HF safetensors load key-for-key, and the maths is
HF's (rotate-half RoPE, RMSNorm in fp32), so the same weights give the same logits.

The model returns hidden states after the final norm, never logits: callers apply
`model.output_projection` to the slices they need (see docs/contracts.md).

Mistral is LLaMA with `sliding_window` set: key j is visible from query i when
`i - window < j <= i` (sequence indices, as HF does). Qwen2 is LLaMA with q/k/v biases (and a
window on the layers `layer_types` names "sliding_attention", when `use_sliding_window`); Qwen3
adds an RMSNorm over each query and key head (`q_norm`, `k_norm`) before RoPE. LLaMA exports with
`attention_bias` (q/k/v/o) or `mlp_bias` (gate/up/down) get those biases.

Shapes in comments: B batch, T new tokens, S keys (cached + new), D hidden_size, H query heads,
Hkv key/value heads, hd head_dim, V vocab_size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from models.layers import (
    IGNORED_FIELDS,
    Attention,
    CausalLM,
    DecoderBody,
    GatedMLP,
    KVCache,
    PreNormBlock,
    RMSNorm,
    check_fields,
    check_heads,
    check_layer_types,
    drop_ignored,
    generate,
    normalize_rope_scaling,
    read_rope,
    require_zero,
)

__all__ = ["LlamaConfig", "LlamaForCausalLM", "KVCache", "generate", "config_from_hf", "IGNORED_FIELDS"]

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------
# HF's class defaults for fields a config.json may leave out (they differ between the families).
_QWEN_DEFAULTS = {"max_position_embeddings": 32768, "num_key_value_heads": None, "sliding_window": 4096,
                  "use_sliding_window": False, "max_window_layers": 28, "bos_token_id": None, "eos_token_id": None}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "sliding_window": None},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": _QWEN_DEFAULTS,
    "qwen3": {**_QWEN_DEFAULTS, "head_dim": 128},
}
FAMILIES = tuple(_DEFAULTS)
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}  # the model_types this file loads
# fields that exist only in some of the families (HF's config classes differ): name -> families
_FAMILY_FIELDS: dict[str, tuple[str, ...]] = {
    "sliding_window": ("mistral", "qwen2", "qwen3"),
    "use_sliding_window": ("qwen2", "qwen3"),
    "max_window_layers": ("qwen2", "qwen3"),
    "layer_types": ("qwen2", "qwen3"),
    "attention_bias": ("llama", "qwen3"),
    "mlp_bias": ("llama",),
}


@dataclass
class LlamaConfig:
    """LLaMA / Mistral / Qwen2 / Qwen3 hyper-parameters under their HF `config.json` names.

    `head_dim=None` means `hidden_size // num_attention_heads`; `num_key_value_heads=None` means
    plain multi-head attention. `rope_scaling` is HF's dict (None for plain RoPE), normalised to
    carry `rope_type`. `sliding_window`: Mistral windows every layer; Qwen windows the layers
    `layer_types` marks "sliding_attention", and only with `use_sliding_window` (as transformers:
    otherwise the field is kept for the round trip but means nothing). `layer_windows()` says
    which window each layer uses.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    use_sliding_window: bool = False
    max_window_layers: int | None = None
    layer_types: list[str] | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(
                f"config.json: model_type {self.model_type!r} is not one of this file's families — use one of {FAMILIES}"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim={self.head_dim} is odd — rotary embeddings need an even head_dim")
        if self.hidden_act != "silu":
            raise ValueError(
                f"config.json: hidden_act {self.hidden_act!r} is not supported — LLaMA/Mistral/Qwen use 'silu'"
            )
        for name, families in _FAMILY_FIELDS.items():
            default = getattr(type(self), name, None)
            if self.model_type not in families and getattr(self, name) not in (default, None, False):
                raise ValueError(
                    f"config.json: {name}={getattr(self, name)!r} is not a {self.model_type} field (transformers "
                    f"ignores it there) — remove it, or use the model_type of the family that has it ({families})"
                )
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"config.json: sliding_window={self.sliding_window!r} — use a positive int or null")
        if self.model_type in ("qwen2", "qwen3") and self.layer_types is None:
            # transformers' rule: layers from max_window_layers on slide (when windows are on)
            on = self.use_sliding_window and self.sliding_window is not None
            self.layer_types = [
                "sliding_attention" if on and i >= (self.max_window_layers or 0) else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        if self.layer_types is not None:
            check_layer_types(self.layer_types, self.num_hidden_layers)
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)

    def layer_windows(self) -> list[int | None]:
        """The sliding window of each layer (None: full causal attention)."""
        if self.model_type == "mistral":
            return [self.sliding_window] * self.num_hidden_layers
        if self.model_type in ("qwen2", "qwen3") and self.use_sliding_window and self.sliding_window:
            return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]
        return [None] * self.num_hidden_layers

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Build from an HF `config.json` dict, old (`rope_theta`/`rope_scaling`) or
        transformers-v5 (`rope_parameters`) spelling. Unknown fields are ValueErrors unless listed
        in IGNORED_FIELDS; fields with one safe value (`pretraining_tp`, `attention_dropout`) are
        checked and dropped."""
        d = dict(d)
        model_type = d.pop("model_type", None)
        if model_type not in _DEFAULTS:
            raise ValueError(f"config.json: model_type {model_type!r} is not one of this file's families — use one of {FAMILIES}")
        drop_ignored(d, IGNORED_FIELDS)
        tp = d.pop("pretraining_tp", 1)
        if tp not in (None, 1):
            raise ValueError(
                f"config.json: pretraining_tp={tp} is not supported — set it to 1 (it only reorders the maths "
                "of a tensor-parallel run and changes results)"
            )
        require_zero(d, "attention_dropout")
        theta, scaling = read_rope(d)
        check_fields(d, cls, model_type)
        kw = {**_DEFAULTS[model_type], **d}  # an explicit null num_key_value_heads means "= heads"
        return cls(**kw, rope_theta=theta if theta is not None else 10000.0, rope_scaling=scaling,
                   model_type=model_type)

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict transformers loads (old `rope_theta`/`rope_scaling` spelling,
        which every transformers version reads)."""
        d = asdict(self)
        d["architectures"] = [_ARCHITECTURES[self.model_type]]
        for name, families in _FAMILY_FIELDS.items():
            if self.model_type not in families:
                d.pop(name)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d


# --------------------------------------------------------------------------------------------
# Attention, block, model
# --------------------------------------------------------------------------------------------


class LlamaAttention(Attention):
    """The floor's grouped-query attention with this file's fields: Qwen2's biases on q/k/v (not o);
    `attention_bias` (LLaMA, Qwen3) on q/k/v/o; Qwen3's `q_norm` / `k_norm`, an RMSNorm over each
    head's hd features, before RoPE."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        qk_norm = (lambda hd: RMSNorm(hd, config.rms_norm_eps)) if config.model_type == "qwen3" else None
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                         layer_idx, qkv_bias=config.attention_bias or config.model_type == "qwen2",
                         o_bias=config.attention_bias, qk_norm=qk_norm)


class LlamaDecoderLayer(PreNormBlock):
    """Pre-norm block: x + attn(norm(x)), then + SwiGLU(norm(x)). The unit the engine checkpoints
    and compiles."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__(LlamaAttention(config, layer_idx),
                         GatedMLP(config.hidden_size, config.intermediate_size, "silu", config.mlp_bias),
                         config.hidden_size, config.rms_norm_eps)


class LlamaModel(DecoderBody):
    """Embeddings, decoder layers, final norm (HF's `model.` prefix); the floor's forward."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.build(LlamaDecoderLayer)


class LlamaForCausalLM(CausalLM):
    """The causal LM: `model` (body) + `lm_head`. forward returns hidden states, not logits."""

    block_types = (LlamaDecoderLayer,)
    # derived tables that older transformers versions saved as weights: skipped by the loader
    ignore_checkpoint_keys = (r"\.rotary_emb\.inv_freq$",)

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config, LlamaModel(config))


def config_from_hf(d: dict[str, Any]) -> LlamaConfig:
    """The registry's entry point (models/__init__.py): `LlamaConfig.from_hf`."""
    return LlamaConfig.from_hf(d)
