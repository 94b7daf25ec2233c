"""Qwen3-MoE, Qwen2-MoE (Qwen1.5-MoE) and Mixtral: LLaMA-shaped attention over a mixture-of-experts MLP,
importing only torch and the shared floor (`models/layers.py`).

Read top to bottom: config, the checkpoint layouts, attention, block, model. The router, the experts
(dropless: the (token, expert) pairs sorted by expert, one grouped product per projection) and the
sparse block are the floor's (`Router`, `Experts`, `SparseMoeBlock`); what differs between the three
is a field:

- `qwen3_moe`: Qwen3's attention (per-head q/k RMSNorm, `attention_bias` on q/k/v/o); routing is a
  softmax over every expert, its top `num_experts_per_tok`, renormalised when `norm_topk_prob`;
  layer i is sparse unless it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step` is not 0,
  and a dense layer has a SwiGLU MLP of `intermediate_size` (`moe_intermediate_size`: each expert's);
  `use_sliding_window` windows every layer (as transformers);
- `qwen2_moe`: Qwen2's attention (q/k/v biases, `qkv_bias`), the same routing and dense layers,
  plus a shared expert every token goes through (`shared_expert`, a SwiGLU of
  `shared_expert_intermediate_size`) scaled by sigmoid(`shared_expert_gate`(x));
  windows on the layers `layer_types` names (transformers' rule when absent);
- `mixtral`: Mistral's attention (a window on every layer when `sliding_window` is set), every layer
  sparse, top-2 routing renormalised (a softmax over the chosen logits), the weights kept in fp32.

Expert weights are held as transformers 5 holds them, `mlp.experts.gate_up_proj` (E, 2F, D) and
`mlp.experts.down_proj` (E, D, F), so a fused checkpoint (and peft's `target_parameters` adapters)
match key for key. The Hub's files (and what transformers 5's `save_pretrained` writes) keep one
matrix per expert and projection (`mlp.experts.3.gate_proj.weight`; Mixtral:
`block_sparse_moe.experts.3.w1.weight`): `checkpoint_parts()` says which slice of which fused
parameter each of those keys fills, and the loader fills it (a missing expert is a missing key).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch.nn as nn

from models.layers import (
    IGNORED_FIELDS,
    QWEN_EXPERT_NAMES,
    Attention,
    DecoderBody,
    Experts,
    GatedMLP,
    KVCache,
    MoeCausalLM,
    PreNormBlock,
    RMSNorm,
    Router,
    SparseMoeBlock,
    check_fields,
    check_heads,
    check_layer_types,
    drop_ignored,
    generate,
    normalize_rope_scaling,
    per_expert_keys,
    read_rope,
    require_zero,
)

__all__ = ["MoeConfig", "MoeForCausalLM", "KVCache", "generate", "config_from_hf"]

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM"}
# transformers' class defaults for fields a config.json may leave out
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_key_value_heads=4, max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096,
                      moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128, bos_token_id=None,
                      eos_token_id=None),
    "qwen2_moe": dict(num_key_value_heads=16, max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096,
                      max_window_layers=28, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      num_experts_per_tok=4, num_experts=60, qkv_bias=True, bos_token_id=None, eos_token_id=None),
    "mixtral": dict(num_key_value_heads=8, max_position_embeddings=4096 * 32, rope_theta=1e6, rms_norm_eps=1e-5,
                    sliding_window=None, num_experts_per_tok=2, num_experts=8),
}
# fields that exist only in some of the families: name -> families (elsewhere: refused when set)
_FAMILY_FIELDS: dict[str, tuple[str, ...]] = {
    "attention_bias": ("qwen3_moe",),
    "qkv_bias": ("qwen2_moe",),
    "use_sliding_window": ("qwen3_moe", "qwen2_moe"),
    "max_window_layers": ("qwen3_moe", "qwen2_moe"),
    "layer_types": ("qwen2_moe",),
    "decoder_sparse_step": ("qwen3_moe", "qwen2_moe"),
    "mlp_only_layers": ("qwen3_moe", "qwen2_moe"),
    "norm_topk_prob": ("qwen3_moe", "qwen2_moe"),
    "moe_intermediate_size": ("qwen3_moe", "qwen2_moe"),
    "shared_expert_intermediate_size": ("qwen2_moe",),
    "router_jitter_noise": ("mixtral",),
}


@dataclass
class MoeConfig:
    """Qwen3-MoE / Qwen2-MoE / Mixtral hyper-parameters under their HF `config.json` names.

    `num_experts` is also read as `num_local_experts` (Mixtral's name; transformers 5 writes it for
    Qwen3-MoE too). `moe_intermediate_size`: each expert's F (Mixtral: `intermediate_size`);
    `intermediate_size`: a dense layer's (Qwen). `output_router_logits` / `router_aux_loss_coef`:
    the load-balancing loss transformers adds in training. `layer_windows()` / `sparse_layers()`
    say which window and which MLP each layer has.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    use_sliding_window: bool = False
    max_window_layers: int | None = None
    layer_types: list[str] | None = None
    attention_bias: bool = False
    qkv_bias: bool = False
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    model_type: str = "qwen3_moe"

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(f"config.json: model_type {self.model_type!r} is not one of this file's families — "
                             f"use one of {FAMILIES}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act {self.hidden_act!r} is not supported — these MoE models use 'silu'")
        for name, families in _FAMILY_FIELDS.items():
            default = getattr(type(self), name, None)
            value = getattr(self, name)
            if self.model_type not in families and value not in (default, None, False, []):
                raise ValueError(
                    f"config.json: {name}={value!r} is not a {self.model_type} field (transformers ignores it there) "
                    f"— remove it, or use the model_type of the family that has it ({families})"
                )
        if self.router_jitter_noise not in (None, 0, 0.0):
            raise ValueError(
                f"config.json: router_jitter_noise={self.router_jitter_noise} (random noise on the router's input in "
                "training) is not supported — set it to 0.0"
            )
        if self.num_experts < 1 or not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"config.json: num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok} — "
                "use at least one expert and 1..num_experts experts per token"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"config.json: decoder_sparse_step={self.decoder_sparse_step} — use a positive int")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"config.json: mlp_only_layers {bad} are not layers of this model — use indices "
                             f"0..{self.num_hidden_layers - 1}")
        if self.model_type != "mixtral" and self.moe_intermediate_size is None:
            raise ValueError("config.json: moe_intermediate_size is missing — each expert's intermediate size")
        if self.model_type == "qwen2_moe" and self.shared_expert_intermediate_size is None:
            raise ValueError("config.json: shared_expert_intermediate_size is missing — Qwen2-MoE's shared expert")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 0):
            raise ValueError(f"config.json: sliding_window={self.sliding_window!r} — use a positive int or null")
        if self.model_type == "qwen2_moe" and self.layer_types is None:  # transformers' rule
            self.layer_types = [
                "sliding_attention" if (i + 1) % 2 and i < (self.max_window_layers or 0) and self.use_sliding_window
                else "full_attention" for i in range(self.num_hidden_layers)
            ]
        if self.layer_types is not None:
            check_layer_types(self.layer_types, self.num_hidden_layers)
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)

    @property
    def expert_size(self) -> int:
        """Each expert's intermediate size F."""
        return self.intermediate_size if self.model_type == "mixtral" else self.moe_intermediate_size

    def sparse_layers(self) -> list[bool]:
        """Per layer: whether its MLP is the experts (else a dense SwiGLU of `intermediate_size`)."""
        if self.model_type == "mixtral":
            return [True] * self.num_hidden_layers
        return [i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                for i in range(self.num_hidden_layers)]

    def layer_windows(self) -> list[int | None]:
        """The sliding window of each layer (None: full causal attention), as transformers applies them."""
        L, w = self.num_hidden_layers, self.sliding_window or None
        if self.model_type == "mixtral":
            return [w] * L
        if not self.use_sliding_window or w is None:
            return [None] * L
        if self.model_type == "qwen3_moe":
            return [w] * L
        return [w if t == "sliding_attention" else None for t in self.layer_types]

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "MoeConfig":
        """From an HF `config.json` dict (old `rope_theta` / `rope_scaling` or v5 `rope_parameters`).
        A field this file does not know is a ValueError: in an MoE most fields change the maths."""
        d = dict(d)
        model_type = d.pop("model_type", None)
        if model_type not in FAMILIES:
            raise ValueError(f"config.json: model_type {model_type!r} is not one of this file's families — "
                             f"use one of {FAMILIES}")
        drop_ignored(d, IGNORED_FIELDS)
        require_zero(d, "attention_dropout")
        local = d.pop("num_local_experts", None)
        if local is not None and d.get("num_experts", local) != local:
            raise ValueError(f"config.json: num_experts={d['num_experts']} and num_local_experts={local} disagree — keep one")
        if local is not None:
            d["num_experts"] = local
        if d.get("mlp_only_layers") is None:
            d.pop("mlp_only_layers", None)
        theta, scaling = read_rope(d)
        check_fields(d, cls, model_type)
        kw = {**_DEFAULTS[model_type], **d}
        if theta is not None:
            kw["rope_theta"] = theta
        return cls(**kw, rope_scaling=scaling, model_type=model_type)

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict transformers loads (old RoPE spelling, which v4 and v5 read)."""
        d = asdict(self)
        d["architectures"] = [_ARCHITECTURES[self.model_type]]
        for name, families in _FAMILY_FIELDS.items():
            if self.model_type not in families:
                d.pop(name)
        if self.model_type == "mixtral":
            d["num_local_experts"] = d.pop("num_experts")
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d


# --------------------------------------------------------------------------------------------
# Checkpoint layouts
# --------------------------------------------------------------------------------------------

# the Hub's per-expert names of each family, and the sparse block's name in its files
_EXPERT_NAMES: dict[str, tuple[str, dict[str, str]]] = {
    "qwen3_moe": ("mlp", QWEN_EXPERT_NAMES),
    "qwen2_moe": ("mlp", QWEN_EXPERT_NAMES),
    "mixtral": ("block_sparse_moe", {"w1": "gate", "w3": "up", "w2": "down"}),
}


def per_expert_parts(config: MoeConfig) -> dict[str, tuple[str, tuple]]:
    """Each per-expert checkpoint key -> (the fused parameter's key, the index it fills): the Hub's
    layout of every sparse layer (Mixtral's router too, stored as `block_sparse_moe.gate.weight`)."""
    block, names = _EXPERT_NAMES[config.model_type]
    parts: dict[str, tuple[str, tuple]] = {}
    for i, sparse in enumerate(config.sparse_layers()):
        if not sparse:
            continue
        ours, theirs = f"model.layers.{i}.mlp", f"model.layers.{i}.{block}"
        if block != "mlp":
            parts[f"{theirs}.gate.weight"] = (f"{ours}.gate.weight", ())
        parts.update(per_expert_keys(ours, theirs, config.num_experts, config.expert_size, names))
    return parts


# --------------------------------------------------------------------------------------------
# Attention, block, model
# --------------------------------------------------------------------------------------------


class MoeAttention(Attention):
    """The floor's grouped-query attention: Qwen3-MoE's q/k norms and `attention_bias`, Qwen2-MoE's
    q/k/v biases, Mixtral's plain projections."""

    def __init__(self, config: MoeConfig, layer_idx: int) -> None:
        qwen3 = config.model_type == "qwen3_moe"
        qkv_bias = config.attention_bias if qwen3 else config.qkv_bias and config.model_type == "qwen2_moe"
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                         layer_idx, qkv_bias=qkv_bias, o_bias=qwen3 and config.attention_bias,
                         qk_norm=(lambda hd: RMSNorm(hd, config.rms_norm_eps)) if qwen3 else None)


def sparse_block(config: MoeConfig) -> SparseMoeBlock:
    """The experts' MLP of one layer: router, experts, and Qwen2-MoE's shared expert with its gate."""
    D, E, K = config.hidden_size, config.num_experts, config.num_experts_per_tok
    mixtral = config.model_type == "mixtral"
    router = Router(D, E, K, norm_topk_prob=mixtral or config.norm_topk_prob, cast_back=not mixtral)
    experts = Experts(E, D, config.expert_size)
    if config.model_type != "qwen2_moe":
        return SparseMoeBlock(router, experts)
    return SparseMoeBlock(router, experts, shared_expert=GatedMLP(D, config.shared_expert_intermediate_size),
                          shared_expert_gate=nn.Linear(D, 1, bias=False))


class MoeDecoderLayer(PreNormBlock):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)), the MLP the experts or a dense SwiGLU.
    The unit the engine checkpoints and compiles."""

    def __init__(self, config: MoeConfig, layer_idx: int) -> None:
        sparse = config.sparse_layers()[layer_idx]
        mlp = sparse_block(config) if sparse else GatedMLP(config.hidden_size, config.intermediate_size)
        super().__init__(MoeAttention(config, layer_idx), mlp, config.hidden_size, config.rms_norm_eps)


class MoeModel(DecoderBody):
    """Embeddings, decoder layers, final norm (HF's `model.` prefix); the floor's forward."""

    def __init__(self, config: MoeConfig) -> None:
        super().__init__(config)
        self.build(MoeDecoderLayer)


class MoeForCausalLM(MoeCausalLM):
    """The causal LM: `model` + `lm_head`; forward returns hidden states, not logits."""

    block_types = (MoeDecoderLayer,)

    def __init__(self, config: MoeConfig) -> None:
        super().__init__(config, MoeModel(config))
        # HF's per-expert names (v4, the Hub's files) -> the fused expert parameter they are part of: a
        # LoRA target list written with them adapts the experts, as peft 0.21 maps them for Qwen3-MoE and
        # Mixtral (and then a dense linear of such a name has no form peft loads, so it stays unadapted);
        # Qwen2-MoE's names stay its dense and shared-expert linears', as in peft
        self.expert_aliases = {
            "qwen3_moe": {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"},
            "mixtral": {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj", "gate_proj": "gate_up_proj",
                        "up_proj": "gate_up_proj", "down_proj": "down_proj"},
        }.get(config.model_type, {})

    def checkpoint_parts(self) -> dict[str, tuple[str, tuple]]:
        """Checkpoint keys that fill part of one of this model's parameters (the Hub's per-expert
        layout): key -> (parameter key, index). The loader takes either these or the fused keys."""
        return per_expert_parts(self.config)


def config_from_hf(d: dict[str, Any]) -> MoeConfig:
    """The registry's entry point (models/__init__.py): `MoeConfig.from_hf`."""
    return MoeConfig.from_hf(d)
