"""gpt-oss (model_type `gpt_oss`: gpt-oss-20b, gpt-oss-120b), importing only torch and the shared floor
(`models/layers.py`).

Read top to bottom: config, MXFP4, attention, block, model. What is particular to gpt-oss:

- attention with biases on q/k/v/o and a learned sink per head (`self_attn.sinks`): one more logit
  in each row's softmax that takes probability and is then dropped (the floor's `Attention` with
  `sinks`, written out: SDPA has no such column);
- layers alternate between a sliding window (128) and full attention (`layer_types`);
- YaRN RoPE (factor 32 over 4096 positions, `truncate: false`), the floor's `rope_inv_freq`;
- RMSNorm that multiplies by the weight before casting back (`RMSNormCastLast`);
- the router has a bias and takes the top-k logits first, then a softmax over those
  (`Router(scoring="topk_softmax")`), under the name `mlp.router`;
- the experts have biases, their `gate_up_proj` is (E, D, 2F) with gate and up interleaved (even /
  odd columns) and `down_proj` (E, F, D), and the gate is a clamped SwiGLU:
  `(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)` with g = clamp(gate, max=7)
  (`Experts(layout="in_out", swiglu_limit=..., swiglu_alpha=...)`).

The released checkpoints store the experts in MXFP4 (`quantization_config.quant_method: mxfp4`):
`mlp.experts.gate_up_proj_blocks` (E, 2F, D / 32, 16) uint8, two 4-bit E2M1 codes a byte (low nibble
first), and `_scales` (E, 2F, D / 32) uint8, one power of two per 32 values (exponent + 127).
minitrain dequantizes them as they load (`mxfp4_dequantize`, the same values as transformers'
dequantization: every E2M1 value times a power of two is exact in bf16) and holds the experts in the
run's dtype; it does not keep them packed. A bf16 checkpoint (`save_pretrained` of a dequantized
model) loads key for key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from models.layers import (
    IGNORED_FIELDS,
    Attention,
    DecoderBody,
    Experts,
    KVCache,
    MoeCausalLM,
    PreNormBlock,
    RMSNormCastLast,
    Router,
    SparseMoeBlock,
    check_fields,
    check_heads,
    check_layer_types,
    drop_ignored,
    generate,
    normalize_rope_scaling,
    read_rope,
    require_zero,
)

__all__ = ["GptOssConfig", "GptOssForCausalLM", "KVCache", "generate", "config_from_hf", "mxfp4_dequantize"]

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

# transformers' RoPE when a config.json names none
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


@dataclass
class GptOssConfig:
    """gpt-oss hyper-parameters under their HF `config.json` names (transformers' defaults).

    `intermediate_size`: each expert's F; `num_local_experts` E, `num_experts_per_tok` K;
    `swiglu_limit` / `swiglu_alpha`: the experts' clamped SwiGLU; `layer_types`: "sliding_attention"
    / "full_attention" per layer (alternating, sliding first, when absent). `quantization_config`
    is kept for the loader: only `mxfp4` on the experts is understood.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = 8
    head_dim: int | None = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 131072
    sliding_window: int | None = 128
    layer_types: list[str] | None = None
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    quantization_config: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    model_type: str = "gpt_oss"

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act {self.hidden_act!r} is not supported — gpt-oss uses 'silu' "
                             "(its experts' clamped SwiGLU)")
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"config.json: num_experts_per_tok={self.num_experts_per_tok} — use "
                             f"1..num_local_experts ({self.num_local_experts})")
        q = self.quantization_config
        if q is not None and q.get("quant_method") != "mxfp4":
            raise ValueError(f"config.json: quantization_config quant_method {q.get('quant_method')!r} is not "
                             "understood — gpt-oss checkpoints are read in bf16 / fp32 or with MXFP4 experts")
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                for i in range(self.num_hidden_layers)]
        check_layer_types(self.layer_types, self.num_hidden_layers)
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)

    def layer_windows(self) -> list[int | None]:
        """The sliding window of each layer (None: full causal attention)."""
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    def sparse_layers(self) -> list[bool]:
        """Per layer: whether its MLP is the experts (every gpt-oss layer's is)."""
        return [True] * self.num_hidden_layers

    @property
    def mxfp4(self) -> bool:
        """Whether the checkpoint stores the experts in MXFP4 (`*_blocks` + `*_scales`)."""
        return self.quantization_config is not None

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "GptOssConfig":
        """From an HF `config.json` dict (`rope_scaling` or transformers v5's `rope_parameters`)."""
        d = dict(d)
        if d.pop("model_type", None) != "gpt_oss":
            raise ValueError("config.json: model_type is not 'gpt_oss'")
        drop_ignored(d, IGNORED_FIELDS)
        require_zero(d, "attention_dropout")
        if "router_jitter_noise" in d:  # not a gpt-oss field; some exports carry Mixtral's
            require_zero(d, "router_jitter_noise")
        theta, scaling = read_rope(d)
        check_fields(d, cls, "gpt_oss", "gpt-oss")
        if theta is not None:
            d["rope_theta"] = theta
        return cls(**d, rope_scaling=scaling if scaling is not None else dict(_DEFAULT_ROPE))

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict transformers loads; the experts are saved dequantized, so without
        `quantization_config`."""
        d = asdict(self)
        d["architectures"] = ["GptOssForCausalLM"]
        d.pop("quantization_config")
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else {"rope_type": "default"}
        return d


# --------------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------------

# the 16 values of a 4-bit E2M1 code (sign, 2 exponent bits, 1 mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 experts -> fp32 in our layout: blocks (E, R, G, 16) uint8 (32 codes per group of a row,
    the low nibble first), scales (E, R, G) uint8 (the group's power of two, + 127) -> (E, G * 32, R),
    every value `FP4_VALUES[code] * 2 ** (scale - 127)` (as transformers' `convert_moe_packed_tensors`,
    whose result is transposed the same way)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} do not pair — expected uint8 (E, R, G, 16) and (E, R, G)")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    E, R, G, B = blocks.shape
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # (E, R, G, 16, 2): low nibble first
    values = lut[codes].reshape(E, R, G, 2 * B)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].float())
    return values.reshape(E, R, G * 2 * B).transpose(1, 2).contiguous()  # (E, in, out)


def mxfp4_conversions(config: GptOssConfig) -> dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor]]]:
    """Each expert weight of an MXFP4 checkpoint -> (its two checkpoint keys, the function of them)."""
    out = {}
    for i in range(config.num_hidden_layers):
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{name}"
            out[key] = ((f"{key}_blocks", f"{key}_scales"), mxfp4_dequantize)
    return out


# --------------------------------------------------------------------------------------------
# Attention, block, model
# --------------------------------------------------------------------------------------------


class GptOssAttention(Attention):
    """The floor's grouped-query attention with biases and a learned sink per head."""

    def __init__(self, config: GptOssConfig, layer_idx: int) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                         layer_idx, qkv_bias=config.attention_bias, o_bias=config.attention_bias, sinks=True)


class GptOssDecoderLayer(PreNormBlock):
    """Pre-norm block: x + attn(norm(x)), then + experts(norm(x)). The unit the engine checkpoints and
    compiles."""

    def __init__(self, config: GptOssConfig, layer_idx: int) -> None:
        D, E, K = config.hidden_size, config.num_local_experts, config.num_experts_per_tok
        router = Router(D, E, K, scoring="topk_softmax", bias=True)
        experts = Experts(E, D, config.intermediate_size, layout="in_out", bias=True,
                          swiglu_limit=config.swiglu_limit, swiglu_alpha=config.swiglu_alpha)
        mlp = SparseMoeBlock(router, experts, router_name="router")
        super().__init__(GptOssAttention(config, layer_idx), mlp, D, config.rms_norm_eps, norm=RMSNormCastLast)


class GptOssModel(DecoderBody):
    """Embeddings, decoder layers, final norm (HF's `model.` prefix); the floor's forward."""

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__(config)
        self.build(GptOssDecoderLayer, RMSNormCastLast)


class GptOssForCausalLM(MoeCausalLM):
    """The causal LM: `model` + `lm_head`; forward returns hidden states, not logits."""

    block_types = (GptOssDecoderLayer,)

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__(config, GptOssModel(config))

    def checkpoint_conversions(self) -> dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor]]]:
        """Parameters a checkpoint stores in another form: {parameter key: (its checkpoint keys, the
        function of those tensors that gives it)} — the MXFP4 experts, when the config says so."""
        return mxfp4_conversions(self.config) if self.config.mxfp4 else {}


def config_from_hf(d: dict[str, Any]) -> GptOssConfig:
    """The registry's entry point (models/__init__.py): `GptOssConfig.from_hf`."""
    return GptOssConfig.from_hf(d)
