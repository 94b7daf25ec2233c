"""Gemma 4 (text: `Gemma4ForCausalLM`, model_type `gemma4_text`; the language model of the multimodal
`Gemma4ForConditionalGeneration`, model_type `gemma4`, whose vision tower is gemma4_vl.py's), importing only
torch and the shared floor (`models/layers.py`).

Gemma 3's block (sandwich norms around attention and the GeGLU MLP, embeddings scaled by
sqrt(hidden_size) rounded to their dtype, sliding and global layers) with these differences:

- every norm is `weight * x / rms(x)` in fp32, cast back last (weights start at 1, not Gemma 3's
  `1 + weight`); values get a norm without a weight (`v_norm`) besides the q / k norms; attention
  scores are not scaled (scale 1.0: the q / k norms set their size);
- global layers (`full_attention`) have their own head dim (`global_head_dim`) and, with
  `attention_k_eq_v`, their own count of key/value heads (`num_global_key_value_heads`) and no
  `v_proj`: the values are the keys' projection before the k-norm and RoPE, through `v_norm`;
- RoPE per layer type: sliding layers the default RoPE over `head_dim` (base 10k), global layers
  "proportional" RoPE over `global_head_dim`: the first `partial_rotary_factor * hd / 2` frequencies
  of the default table at base `rope_theta` (exponents over the whole head dim), the rest zero (those
  pairs are not turned), all divided by `factor`;
- per-layer embeddings (PLE, `hidden_size_per_layer_input` = P > 0): a second embedding table
  (`embed_tokens_per_layer`, L x P wide, scaled by sqrt(P)) plus a projection of the scaled embeddings
  (`per_layer_model_projection` / sqrt(D), normed per layer) give each layer l an input
  (token part + context part) / sqrt(2); after its MLP, layer l adds
  `post_per_layer_input_norm(per_layer_projection(gelu(per_layer_input_gate(x)) * input_l))`;
- the last `num_kv_shared_layers` layers compute no keys or values: each reuses those of the last
  earlier layer of its type (`kv_sources`), and has no k/v projections or norms; with
  `use_double_wide_mlp` those layers' MLPs are twice `intermediate_size` wide;
- each layer's output is multiplied by `layer_scalar` (a stored buffer);
- the final logits are soft-capped (`final_logit_softcapping`); attention scores are not.

The layers take more than the floor's `(x, cos, sin, mask, cache)`: their per-layer input and the keys
and values of the layer they share with. `Gemma4Model.embed` returns the per-layer inputs in the
channels after the D of the residual stream ((B, T, D + L P)), and `_layers`, the layer loop, splits
them off before the first layer: the floor's forward (masks, positions, cache, packed rows) runs
unchanged, and each layer gets its slice and the shared keys as arguments (activation checkpointing
then saves them as inputs). A padded CPU batch keeps its padding (`unpadded = False`).

The mixture-of-experts size (`enable_moe_block`, Gemma 4 26B-A4B) adds to every layer, beside the MLP, the
floor's expert block (`Experts`: `gate_up_proj` (E, 2F, D), `down_proj` (E, D, F), GeGLU) behind Gemma 4's
router (`Gemma4Router`), fed the MLP's input before its norm; the two outputs are normed apart and summed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Collection, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.layers import (
    IGNORED_FIELDS,
    Attention,
    Captured,
    CausalLM,
    DecoderBody,
    Documents,
    Experts,
    GatedMLP,
    KVCache,
    LanguageModel,
    RMSNormCastLast,
    RopeSpec,
    Router,
    RotaryEmbedding,
    SoftcappedLinear,
    activation,
    check_fields,
    check_heads,
    check_layer_types,
    drop_ignored,
    generate,
    multimodal_to_hf,
    normalize_rope_scaling,
    repeat_kv,
    require_zero,
    text_config_of,
)

__all__ = ["Gemma4Config", "Gemma4ForCausalLM", "KVCache", "generate", "config_from_hf"]

# transformers' defaults when a config.json leaves `rope_parameters` out
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
}
PROPORTIONAL_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}


def default_layer_types(n: int) -> list[str]:
    """transformers' default: five sliding layers to one global."""
    return ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]


@dataclass
class Gemma4Config:
    """Gemma 4 text hyper-parameters under their HF `config.json` names (transformers' defaults).

    `global_head_dim` / `num_global_key_value_heads` (None: `num_key_value_heads`): the global layers'
    heads (transformers 5 saves them as `per_layer_config`, which `from_hf` reads back).
    `rope_parameters`: one dict per layer type. `multimodal`: a `gemma4` checkpoint's config.json
    without its `text_config`, kept for `to_hf`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, dict[str, Any]] | None = None
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262144
    hidden_size_per_layer_input: int | None = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = 0
    model_type: str = "gemma4_text"
    multimodal: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.enable_moe_block:
            for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"config.json: {name}={value!r} with enable_moe_block=true — the expert block "
                                     "needs a positive int here")
            if self.top_k_experts > self.num_experts:
                raise ValueError(f"config.json: top_k_experts={self.top_k_experts} — use 1..num_experts "
                                 f"({self.num_experts})")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"config.json: hidden_activation {self.hidden_activation!r} is not supported — "
                             "Gemma 4 uses 'gelu_pytorch_tanh'")
        if self.use_bidirectional_attention not in (None, "vision"):
            raise ValueError(f"config.json: use_bidirectional_attention={self.use_bidirectional_attention!r} (an "
                             "embedding model) is not supported — minitrain trains causal Gemma 4 models")
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        check_heads(self.num_attention_heads, self.global_kv_heads)
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        check_layer_types(self.layer_types, self.num_hidden_layers)
        self.layer_types = [*self.layer_types[:-1], "full_attention"]  # as transformers: the last layer is global
        self.rope_parameters = {t: dict(p) for t, p in (self.rope_parameters or DEFAULT_ROPE).items()}
        for t in set(self.layer_types):
            self.rope_spec(t)  # a RoPE we do not understand is refused here
        if not 0 <= self.num_kv_shared_layers < self.num_hidden_layers:
            raise ValueError(f"config.json: num_kv_shared_layers={self.num_kv_shared_layers} — it must leave at "
                             f"least one of the {self.num_hidden_layers} layers computing keys and values")
        self.kv_sources()

    @property
    def ple(self) -> int:
        """The per-layer input width P (0: no per-layer embeddings)."""
        return self.hidden_size_per_layer_input or 0

    @property
    def global_kv_heads(self) -> int:
        return self.num_global_key_value_heads or self.num_key_value_heads

    def layer_heads(self, i: int) -> tuple[int, int]:
        """Layer i's (head dim, key/value heads)."""
        if self.layer_types[i] == "full_attention":
            return self.global_head_dim, self.global_kv_heads
        return self.head_dim, self.num_key_value_heads

    def kv_sources(self) -> list[int | None]:
        """Per layer: the earlier layer whose keys and values it reuses (the last one of its type before
        the shared layers), or None when it computes its own."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        last = {t: i for i, t in enumerate(self.layer_types[:first])}
        sources = []
        for i, t in enumerate(self.layer_types):
            if i >= first and t not in last:
                raise ValueError(f"config.json: layer {i} ({t}) shares keys and values, but no earlier layer of its "
                                 "type computes them — lower num_kv_shared_layers")
            sources.append(last[t] if i >= first else None)
        return sources

    def layer_windows(self) -> list[int | None]:
        """The sliding window of each layer (None: global attention)."""
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    def rope_spec(self, layer_type: str) -> RopeSpec:
        """The RoPE of a layer type; "proportional" keeps its fields in `rope_scaling` (`ProportionalRotary`)."""
        p = dict(self.rope_parameters.get(layer_type) or {})
        if not p:
            raise ValueError(f"config.json: rope_parameters has no entry for {layer_type} — add one")
        hd = self.layer_heads(self.layer_types.index(layer_type))[0]
        theta = float(p.get("rope_theta", 10000.0))
        if p.get("rope_type") == "proportional":
            unknown = sorted(set(p) - PROPORTIONAL_KEYS)
            if unknown:
                raise ValueError(f"config.json: rope_parameters.{layer_type} key(s) {unknown} are not understood for "
                                 "proportional RoPE — supported: factor, partial_rotary_factor")
            return RopeSpec(hd, theta, p, self.max_position_embeddings)
        return RopeSpec(hd, theta, normalize_rope_scaling(p, self.max_position_embeddings), self.max_position_embeddings)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Gemma4Config":
        """From an HF `config.json` dict: `global_head_dim` / `num_global_key_value_heads` (the published
        spelling; the global kv heads apply with `attention_k_eq_v` only, as transformers reads them) or
        transformers 5's `per_layer_config`. A field this file does not know is a ValueError."""
        d = dict(d)
        model_type = d.pop("model_type", None)
        if model_type != "gemma4_text":
            raise ValueError(f"config.json: model_type {model_type!r} is not 'gemma4_text'")
        drop_ignored(d, IGNORED_FIELDS)
        require_zero(d, "attention_dropout")
        if "multimodal" in d:  # ours (what from_multimodal keeps), never a config.json field
            raise ValueError("config.json: field 'multimodal' is not understood — remove it")
        older = d.pop("expert_intermediate_size", None)  # transformers 5.5-5.7's name of moe_intermediate_size
        if older is not None and d.get("moe_intermediate_size", older) != older:
            raise ValueError("config.json: expert_intermediate_size and moe_intermediate_size disagree — keep one")
        if older is not None:
            d["moe_intermediate_size"] = older
        per_layer = d.pop("per_layer_config", None)
        if per_layer is not None:
            d.update(_global_heads(per_layer, d))
        elif not d.get("attention_k_eq_v"):
            d.pop("num_global_key_value_heads", None)  # transformers reads it only with attention_k_eq_v
        check_fields(d, cls, model_type, "Gemma 4")
        return cls(**d, model_type=model_type)

    @classmethod
    def from_multimodal(cls, d: dict[str, Any]) -> "Gemma4Config":
        """A multimodal Gemma 4 (`Gemma4ForConditionalGeneration`, model_type "gemma4"): its language model's
        config (`text_config`; the outer `tie_word_embeddings` is the one transformers honours), the rest
        kept for `to_hf`. The vision and audio towers are not built."""
        return text_config_of(d, cls.from_hf, "gemma4_text", tie_default=True)

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict transformers loads (the global heads as `per_layer_config`, which
        transformers reads whatever `attention_k_eq_v` says); a multimodal checkpoint's whole config, the
        text model's inside `text_config`."""
        d = asdict(self)
        d["architectures"] = ["Gemma4ForCausalLM"]
        heads = {"head_dim": d.pop("global_head_dim")}
        if d.pop("num_global_key_value_heads") is not None:
            heads["num_key_value_heads"] = self.num_global_key_value_heads
        d["per_layer_config"] = {str(i): dict(heads) for i, t in enumerate(self.layer_types) if t == "full_attention"}
        return multimodal_to_hf(d, d.pop("multimodal"), "gemma4_text")


def _global_heads(per_layer: dict, d: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's `per_layer_config` ({layer: {head_dim, num_key_value_heads}}, the global layers)
    -> `global_head_dim` / `num_global_key_value_heads`; any other use of it is a ValueError."""
    entries = [dict(v) for v in per_layer.values()] if isinstance(per_layer, dict) else []
    bad = not entries or any(set(e) - {"head_dim", "num_key_value_heads"} or e != entries[0] for e in entries)
    types = d.get("layer_types") or default_layer_types(d.get("num_hidden_layers", 0))
    if not bad:
        full = {i for i, t in enumerate([*types[:-1], "full_attention"]) if t == "full_attention"}
        bad = {int(k) for k in per_layer} != full
    if bad:
        raise ValueError("config.json: per_layer_config other than the global layers' head_dim / "
                         "num_key_value_heads is not supported — Gemma 4 varies only those")
    out = {"global_head_dim": entries[0].get("head_dim", d.get("global_head_dim", 512))}
    out["num_global_key_value_heads"] = entries[0].get("num_key_value_heads")
    return out


# --------------------------------------------------------------------------------------------
# RoPE, attention, block
# --------------------------------------------------------------------------------------------


class ProportionalRotary(RotaryEmbedding):
    """Gemma 4's global-layer RoPE: the default table's first `partial_rotary_factor * hd / 2` inverse
    frequencies (exponents 2i / hd over the whole head dim), zeros after them (cos 1, sin 0: those
    pairs stay as they are), all divided by `factor`. The tables span the whole head dim."""

    def inv_freq(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        device = position_ids.device
        if device not in self._cache:
            spec, p = self.config, self.config.rope_scaling
            hd = spec.head_dim
            angles = int(p.get("partial_rotary_factor", 1.0) * hd // 2)
            turned = 1.0 / spec.rope_theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / hd)
            inv_freq = torch.cat([turned, torch.zeros(hd // 2 - angles)]) / p.get("factor", 1.0)
            self._cache[device] = (inv_freq.to(device), 1.0)
        return self._cache[device]


def rotary(spec: RopeSpec) -> RotaryEmbedding:
    kind = (spec.rope_scaling or {}).get("rope_type")
    return ProportionalRotary(spec) if kind == "proportional" else RotaryEmbedding(spec)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in fp32, cast back: Gemma 4's norm without a weight (`v_norm`, the router's)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


class Gemma4Attention(Attention):
    """Attention with q / k / v norms at scale 1.0, its layer type's head dim and kv heads; without
    `v_proj` under `attention_k_eq_v` (global layers: the values are the keys' projection), without any
    k / v projection on a layer that reuses another's keys and values.

    forward(x, cos, sin, mask, cache, return_probs, shared) -> (output, (k, v) after RoPE (B, Hkv, S, hd),
    the probabilities or None): `shared` the (k, v) of the layer this one reuses."""

    def __init__(self, config: Gemma4Config, layer_idx: int) -> None:
        D, H, bias, eps = config.hidden_size, config.num_attention_heads, config.attention_bias, config.rms_norm_eps
        hd, n_kv = config.layer_heads(layer_idx)
        self.reuses = config.kv_sources()[layer_idx] is not None
        projections = {"q_proj": nn.Linear(D, H * hd, bias=bias)}
        if not self.reuses:
            projections["k_proj"] = nn.Linear(D, n_kv * hd, bias=bias)
            if not (config.attention_k_eq_v and config.layer_types[layer_idx] == "full_attention"):
                projections["v_proj"] = nn.Linear(D, n_kv * hd, bias=bias)
        super().__init__(D, H, n_kv, hd, layer_idx, o_bias=bias, scaling=1.0, projections=projections)
        self.q_norm = RMSNormCastLast(hd, eps)
        if not self.reuses:
            self.k_norm = RMSNormCastLast(hd, eps)
        self.eps = eps

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x (B, T, D) -> q (B, T, H, hd), k and v (B, T, Hkv, hd) normed (None on a layer that reuses)."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim)))
        if self.reuses:
            return q, None, None
        k = self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim)) if hasattr(self, "v_proj") else k
        v = unit_rms(v, self.eps)  # v_norm: no weight
        return q, self.k_norm(k), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any,
                cache: KVCache | None = None, return_probs: bool = False,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None):
        B, T, _ = x.shape
        q, k, v = self.project(x)
        q = self.rotate(q.transpose(1, 2), cos, sin)  # (B, H, T, hd)
        if k is None:
            k, v = shared  # (B, Hkv, S, hd): rotated, and the cache's keys included
        else:
            k, v = self.rotate(k.transpose(1, 2), cos, sin), v.transpose(1, 2)
            if cache is not None:
                k, v = cache.update(self.layer_idx, k, v)
        probs = None
        if isinstance(mask, Documents):
            y = mask.attend(q, k, v, self.scaling)
        else:
            n_rep = self.n_heads // self.n_kv
            kr, vr = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            if return_probs:
                probs = self._probs(q, kr, mask)
                y = torch.matmul(probs.to(v.dtype), vr)
            else:
                y = self._attention(q, kr, vr, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)), (k, v), probs


class Gemma4Router(nn.Module):
    """The MoE sizes' router (HF's `router`): unit_rms(x) * `scale` / sqrt(D) -> logits (`proj`), a softmax
    in fp32, the top K renormalised to sum to one, each times its expert's `per_expert_scale`.
    forward: x (N, D) -> (logits (N, E), weights (N, K), indices (N, K))."""

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        D, E = config.hidden_size, config.num_experts
        self.proj = Router(D, E, config.top_k_experts, norm_topk_prob=True, cast_back=False)
        self.scale = nn.Parameter(torch.ones(D))
        self.per_expert_scale = nn.Parameter(torch.ones(E))
        self.eps = config.rms_norm_eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, weights, indices = self.proj(unit_rms(x, self.eps) * self.scale * x.shape[-1] ** -0.5)
        return logits, weights * self.per_expert_scale[indices], indices


class Gemma4DecoderLayer(nn.Module):
    """Sandwich block (Gemma's), then the per-layer input, then times `layer_scalar`. Checkpointed and
    compiled as one unit. forward(x, cos, sin, mask, cache, return_attention, per_layer_input, shared)
    -> (x (B, T, D), this layer's (k, v), its attention probabilities or None)."""

    def __init__(self, config: Gemma4Config, layer_idx: int) -> None:
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        wide = config.use_double_wide_mlp and config.kv_sources()[layer_idx] is not None
        self.self_attn = Gemma4Attention(config, layer_idx)
        self.mlp = GatedMLP(D, config.intermediate_size * (2 if wide else 1), "gelu_pytorch_tanh")
        self.input_layernorm = RMSNormCastLast(D, eps)
        self.post_attention_layernorm = RMSNormCastLast(D, eps)
        self.pre_feedforward_layernorm = RMSNormCastLast(D, eps)
        self.post_feedforward_layernorm = RMSNormCastLast(D, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        # whether a later layer reuses this one's keys and values (the forward returns them only then; the body's
        # layer loop sets it from its `sources`)
        self.kv_read_later = layer_idx in config.kv_sources()
        if config.enable_moe_block:  # experts beside the MLP, fed the MLP's input before its norm
            self.router = Gemma4Router(config)
            self.experts = Experts(config.num_experts, D, config.moe_intermediate_size, act="gelu_pytorch_tanh")
            self.experts.top_k = config.top_k_experts  # the rows each token sends through the experts (FLOP count)
            self.post_feedforward_layernorm_1 = RMSNormCastLast(D, eps)
            self.pre_feedforward_layernorm_2 = RMSNormCastLast(D, eps)
            self.post_feedforward_layernorm_2 = RMSNormCastLast(D, eps)
        if config.ple:
            self.per_layer_input_gate = nn.Linear(D, config.ple, bias=False)
            self.per_layer_projection = nn.Linear(config.ple, D, bias=False)
            self.post_per_layer_input_norm = RMSNormCastLast(D, eps)
            self.act = activation("gelu_pytorch_tanh")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any, cache: KVCache | None = None,
                return_attention: bool = False, per_layer_input: torch.Tensor | None = None,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None):
        a, kv, probs = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, return_attention, shared)
        x = x + self.post_attention_layernorm(a)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if hasattr(self, "experts"):
            flat = x.reshape(-1, x.shape[-1])  # (N, D)
            _, weights, indices = self.router(flat)
            moe = self.experts(self.pre_feedforward_layernorm_2(flat), indices, weights).reshape(x.shape)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
        x = x + self.post_feedforward_layernorm(h)
        if per_layer_input is not None:  # (B, T, P)
            h = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        if not self.kv_read_later:
            kv = None
        elif torch.is_grad_enabled() and kv[1].requires_grad:  # v a fresh tensor, not the transposed view: FSDP2
            kv = (kv[0], kv[1].clone())  # warns of a block returning a view (its in-place use skips the all-gather)
        return x * self.layer_scalar, kv, probs


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class Gemma4Model(DecoderBody):
    """Scaled embeddings (and the per-layer inputs), the layers, the final norm (HF's `model.` prefix);
    the floor's forward with Gemma 4's layer loop (`_layers`)."""

    unpadded = False  # the layers take per-layer inputs and shared keys: no `Ragged` path

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__(config)
        c, D, L, P = config, config.hidden_size, config.num_hidden_layers, config.ple
        self.embed_tokens = nn.Embedding(c.vocab_size, D)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(c, i) for i in range(L))
        self.norm = RMSNormCastLast(D, c.rms_norm_eps)
        self.windows = c.layer_windows()
        self.rotary = {t: rotary(c.rope_spec(t)) for t in sorted(set(c.layer_types))}
        self.rope_kinds = list(c.layer_types)
        self.sources = c.kv_sources()
        if P:
            self.embed_tokens_per_layer = nn.Embedding(c.vocab_size_per_layer_input, L * P)
            self.per_layer_model_projection = nn.Linear(D, L * P, bias=False)
            self.per_layer_projection_norm = RMSNormCastLast(P, c.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor,
              placed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids (B, T) -> the scaled embeddings (B, T, D), followed by the per-layer inputs (L P
        channels, layer by layer) when the model has them; `_layers` splits them off. `placed`: (where
        (B, T) bool, features (N, D)), features that replace the embeddings there (a multimodal model's images)
        before the per-layer inputs' context part reads them; the token part reads `input_ids` as given."""
        D, P = self.config.hidden_size, self.config.ple
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(D**0.5, dtype=x.dtype)  # the factor rounded to the dtype first, as HF
        if placed is not None:
            x = x.masked_scatter(placed[0][..., None].to(x.device), placed[1].to(x.dtype))
        if not P:
            return x
        token = self.embed_tokens_per_layer(input_ids)
        if placed is not None:  # the row the features' places read (the pad token's) learns nothing from them,
            token = torch.where(placed[0][..., None].to(token.device), token.detach(), token)  # as HF's padding_idx
        token = (token * torch.tensor(P**0.5, dtype=token.dtype)).unflatten(-1, (-1, P))  # (B, T, L, P)
        context = self.per_layer_projection_norm((self.per_layer_model_projection(x) * D**-0.5).unflatten(-1, (-1, P)))
        per_layer = (context + token) * 2**-0.5
        return torch.cat([x, per_layer.flatten(-2).to(x.dtype)], -1)

    def _layers(self, x: torch.Tensor, tables: Sequence[tuple[torch.Tensor, torch.Tensor]], masks: Sequence,
                cache: KVCache | None, hidden_layers: Collection[int] = (), attention_layers: Collection[int] = (),
                additions: Sequence[torch.Tensor] = ()):
        """The layer loop: layer i gets its per-layer input (B, T, P) and, when it reuses another layer's
        keys and values, those; `additions[i]` is added to its output; a `Captured` when layers are named."""
        D, P = self.config.hidden_size, self.config.ple
        x, per_layer = (x[..., :D], x[..., D:].unflatten(-1, (-1, P))) if P else (x, None)
        for i in (*hidden_layers, *attention_layers):
            if not 0 <= i < len(self.layers):
                raise ValueError(f"layer {i} does not exist: the model has layers 0..{len(self.layers) - 1}")
        kvs, hidden_states, attentions = {}, {}, {}
        for i, (layer, (cos, sin), mask) in enumerate(zip(self.layers, tables, masks)):
            source = self.sources[i]
            layer.kv_read_later = i in self.sources
            x, kvs[i], probs = layer(x, cos, sin, mask, cache, i in attention_layers,
                                     None if per_layer is None else per_layer[..., i, :],
                                     None if source is None else kvs[source])
            if i < len(additions):
                x = x + additions[i]
            if i in hidden_layers:
                hidden_states[i] = x
            if probs is not None:
                attentions[i] = probs
        out = self.norm(x)
        return Captured(out, hidden_states, attentions) if hidden_layers or attention_layers else out


class Gemma4ForCausalLM(CausalLM):
    """`model` + `lm_head` (soft-capped when the config says so); forward returns hidden states.
    Keys a checkpoint may hold for the shared layers' k / v (transformers ignores them) are not read
    and are written back as they were."""

    block_types = (Gemma4DecoderLayer,)

    def __init__(self, config: Gemma4Config, multimodal: bool = False) -> None:
        cap = config.final_logit_softcapping
        head = SoftcappedLinear(config.hidden_size, config.vocab_size, cap) if cap else None
        body = Gemma4Model(config)
        super().__init__(config, LanguageModel(body) if multimodal else body, head)
        prefix = r"model\.language_model\." if multimodal else r"model\."
        shared = [i for i, s in enumerate(config.kv_sources()) if s is not None]
        unused = [rf"^{prefix}layers\.{i}\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\." for i in shared]
        self.ignore_checkpoint_keys = self.carry_checkpoint_keys = (*self.ignore_checkpoint_keys, *unused)


def config_from_hf(d: dict[str, Any]) -> Gemma4Config:
    """The registry's entry point (models/__init__.py): `Gemma4Config.from_hf`, or `from_multimodal`."""
    return Gemma4Config.from_multimodal(d) if d.get("model_type") == "gemma4" else Gemma4Config.from_hf(d)
