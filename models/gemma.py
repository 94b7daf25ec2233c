"""Gemma 2 and Gemma 3 (text: `Gemma3ForCausalLM`, model_type `gemma3_text`), importing only torch.

What differs from LLaMA is structure, so the family has its own file (config, norm, attention,
MLP, block, model); rotary tables, the KV cache, masks and `generate` are LLaMA's (imported from
models/llama.py, which needs nothing but torch):

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

Multimodal Gemma 3 checkpoints (model_type `gemma3`) are refused by the registry: this is the
text model only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Collection

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.llama import (
    Captured,
    Documents,
    IGNORED_FIELDS as LLAMA_IGNORED,
    KVCache,
    LlamaForCausalLM,
    Ragged,
    RotaryEmbedding,
    _normalize_rope_scaling,
    apply_rotary,
    attention_mask_4d,
    capture_layers,
    forward_unpadded,
    generate,
    repeat_kv,
    row_masks,
    sdpa,
    unpadded_lengths,
)

__all__ = ["GemmaConfig", "GemmaForCausalLM", "KVCache", "generate", "config_from_hf"]

FAMILIES = ("gemma2", "gemma3_text")
# harmless config.json fields (generation / cache bookkeeping) besides LLaMA's
IGNORED_FIELDS: tuple[str, ...] = (*LLAMA_IGNORED, "cache_implementation", "_sliding_window_pattern")

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
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} — fix the config"
            )
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
        bad = sorted(set(self.layer_types) - {"sliding_attention", "full_attention"})
        if bad or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config.json: layer_types must list 'sliding_attention' / 'full_attention' once per layer "
                f"({self.num_hidden_layers}) — got {len(self.layer_types)} entries{f', unknown {bad}' if bad else ''}"
            )
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "GemmaConfig":
        """From an HF `config.json` dict: old spellings (`rope_theta`, `rope_scaling`,
        `rope_local_base_freq`, `sliding_window_pattern`) or transformers v5's `rope_parameters`
        (Gemma 3: one dict per layer type). Unknown maths fields are ValueErrors."""
        d = dict(d)
        model_type = d.pop("model_type", None)
        if model_type not in FAMILIES:
            raise ValueError(f"config.json: model_type {model_type!r} is not Gemma — use one of {FAMILIES}")
        for name in IGNORED_FIELDS:
            d.pop(name, None)
        dropout = d.pop("attention_dropout", 0.0)
        if dropout not in (None, 0, 0.0):
            raise ValueError(f"config.json: attention_dropout={dropout} is not supported — set it to 0.0")
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
            if _normalize_rope_scaling(local, 0) is not None:
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
            if d.get("rope_scaling") and _normalize_rope_scaling(d["rope_scaling"], 0) != _normalize_rope_scaling(
                params, 0
            ):
                raise ValueError("config.json: rope_scaling and rope_parameters disagree — keep only one of them")
            d["rope_scaling"] = d.get("rope_scaling") or params

        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"config.json: missing {missing} — this does not look like a {model_type} config")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(
                f"config.json: field(s) {unknown} are not understood by minitrain's {model_type} model and may "
                "change its maths — remove them if harmless, or this checkpoint needs a different model"
            )
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


@dataclass
class RopeSpec:
    """What `models.llama.RotaryEmbedding` reads of a config: one RoPE (a Gemma 3 layer type's)."""

    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int


# --------------------------------------------------------------------------------------------
# Norm, head
# --------------------------------------------------------------------------------------------


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in fp32, cast back at the end (HF's Gemma order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): smooth, bounded to (-cap, cap), about x for |x| << cap."""
    return torch.tanh(x / cap) * cap


class SoftcappedLinear(nn.Linear):
    """The head of a model with `final_logit_softcapping`: `cap * tanh(linear(x) / cap)`.

    An `nn.Linear` subclass so its key stays `lm_head.weight` and a tied embedding shares the
    Parameter; not a plain Linear, so the losses take their generic path, which calls the module
    (and so applies the cap) on every chunk.
    """

    def __init__(self, in_features: int, out_features: int, cap: float) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.cap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softcap(super().forward(x), self.cap)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, softcap={self.cap}"


# --------------------------------------------------------------------------------------------
# Attention, MLP, block
# --------------------------------------------------------------------------------------------


class GemmaAttention(nn.Module):
    """GQA with RoPE; `query_pre_attn_scalar` scaling; optional score soft-capping and q/k norms."""

    def __init__(self, config: GemmaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        self.scaling = config.query_pre_attn_scalar**-0.5
        # transformers' Gemma 3 keeps the field but never applies it (Gemma 3 dropped the score cap
        # for QK-norm); a gemma3_text config that sets it means what it means there: nothing
        self.cap = config.attn_logit_softcapping if config.model_type == "gemma2" else None
        D, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(D, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(D, self.n_kv * hd, bias=bias)
        self.v_proj = nn.Linear(D, self.n_kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, D, bias=bias)
        if config.model_type == "gemma3_text":
            self.q_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(hd, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        return_probs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> (B, T, D). `mask` (B, 1, T, S) bool, or None for plain causal.
        `return_probs`: also the attention probabilities (B, H, T, S) fp32 (`gemma_attention_probs`).
        A `Ragged` mask: x (N, D), the batch's real tokens end to end, cos / sin (N, hd). A `Documents`
        mask: rows of several sequences through FlexAttention (the score cap as its `score_mod`)."""
        q = self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim))  # (B, T, H, hd)
        k = self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim))  # (B, T, Hkv, hd)
        if hasattr(self, "q_norm"):  # Gemma 3
            q, k = self.q_norm(q), self.k_norm(k)
        if isinstance(mask, Ragged):  # (N, H, hd): RoPE per token, attention per sequence
            v = self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            return self.o_proj(mask.attend(q, k, v, self._attention).flatten(1))
        B, T, _ = x.shape
        q, k = apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin)
        v = self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim)).transpose(1, 2)  # (B, Hkv, T, hd)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, S, hd)
        if isinstance(mask, Documents):  # FlexAttention: the shared heads read in place
            y = mask.attend(q, k, v, self.scaling, self.cap)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        n_rep = self.n_heads // self.n_kv
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, S, hd)
        probs = None
        if return_probs:  # written out, so the probabilities exist (attention transfer)
            probs = gemma_attention_probs(q, k, mask, self.scaling, self.cap)
            y = torch.matmul(probs.to(v.dtype), v)
        else:
            y = self._attention(q, k, v, mask)
        y = self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        return (y, probs) if return_probs else y

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """(B, H, T, hd) -> (B, H, T, hd): soft-capped (Gemma 2) or SDPA, at `query_pre_attn_scalar`'s scale."""
        if self.cap is None:
            return sdpa(q, k, v, mask, scale=self.scaling)
        return capped_attention(q, k, v, mask, self.scaling, self.cap)


def capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, cap: float
) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap) masked) v, the softmax in fp32 (as HF's eager path).

    q (B, H, T, hd), k / v (B, H, S, hd), mask (B, 1, T, S) bool or None (causal, the T queries
    being the last T of the S keys) -> (B, H, T, hd). Holds the (B, H, T, S) scores.
    """
    return torch.matmul(gemma_attention_probs(q, k, mask, scale, cap).to(q.dtype), v)


def gemma_attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
                          cap: float | None) -> torch.Tensor:
    """The attention probabilities (B, H, T, S) fp32: softmax of the scores q k^T * scale, soft-capped
    when `cap` is set, over the allowed keys (`mask` as `capped_attention`'s), zero elsewhere."""
    T, S = q.shape[2], k.shape[2]
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # (B, H, T, S)
    if cap is not None:
        scores = softcap(scores, cap)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    scores = scores.masked_fill(~mask, float("-inf"))  # every row keeps at least its own key
    return scores.softmax(-1, dtype=torch.float32)


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        D, F_ = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(D, F_, bias=False)
        self.up_proj = nn.Linear(D, F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    """Sandwich block: x + norm(attn(norm(x))), then + norm(mlp(norm(x))). Checkpointed and
    compiled as one unit."""

    def __init__(self, config: GemmaConfig, layer_idx: int) -> None:
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_idx)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(D, eps)
        self.post_attention_layernorm = GemmaRMSNorm(D, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(D, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(D, eps)

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


class GemmaModel(nn.Module):
    """Scaled embeddings, sandwich blocks, final (1 + w) norm (HF's `model.` prefix)."""

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.windows = config.layer_windows()
        spec = RopeSpec(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)
        self.rotary = {"full_attention": RotaryEmbedding(spec)}
        if config.model_type == "gemma3_text":  # local layers: their own base, no scaling
            local = RopeSpec(config.head_dim, config.rope_local_base_freq or 10000.0, None,
                             config.max_position_embeddings)
            self.rotary["sliding_attention"] = RotaryEmbedding(local)
        else:
            self.rotary["sliding_attention"] = self.rotary["full_attention"]
        self.packed_attention = "sdpa"  # rows of several sequences: "sdpa" or "flex" (`models.llama.row_masks`)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        hidden_layers: Collection[int] = (),
        attention_layers: Collection[int] = (),
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | Captured:
        """input_ids (B, T) -> hidden (B, T, D) after the final norm (same contract as LLaMA, the
        captured layers of `hidden_layers` / `attention_layers` and rows of several sequences, a 4-D
        mask and / or `document_ids`, included)."""
        B, T = input_ids.shape
        x = self.embed_tokens(input_ids)  # (B, T, D)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)  # the factor rounded as HF
        if document_ids is not None or (attention_mask is not None and attention_mask.dim() == 4):
            if cache is not None or position_ids is None:
                raise ValueError("a 4-D attention_mask or document_ids need position_ids and no KV cache")
            pos = position_ids.to(x.device)
            flex = self.packed_attention == "flex" and not (hidden_layers or attention_layers)
            masks = row_masks(attention_mask, pos, document_ids, set(self.windows), flex)
            rope = {kind: r(pos, dtype=x.dtype) for kind, r in self.rotary.items()}
            return self._layers(x, [rope[kind] for kind in self.config.layer_types],
                                [masks[w] for w in self.windows], None, hidden_layers, attention_layers)
        valid = (
            torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
            if attention_mask is None
            else attention_mask.to(device=input_ids.device).bool()
        )
        start = cache.length if cache is not None else 0
        key_valid = cache.begin(valid) if cache is not None else valid  # (B, S)
        if position_ids is None:
            position_ids = (key_valid.long().cumsum(-1) - 1).clamp(min=0)[:, start:]  # (B, T)
        padded = attention_mask is not None and not bool(valid.all())
        rope = {kind: r(position_ids, dtype=x.dtype) for kind, r in self.rotary.items()}  # cos, sin (B, T, hd)
        tables = [rope[kind] for kind in self.config.layer_types]
        lengths = None if hidden_layers or attention_layers else unpadded_lengths(valid, padded, cache)
        if lengths:
            return forward_unpadded(x, valid, lengths, zip(self.layers, tables, self.windows), self.norm)
        masks = {
            w: None if cache is None and not padded and (w is None or T <= w) else attention_mask_4d(key_valid, start, w)
            for w in set(self.windows)
        }
        out = self._layers(x, tables, [masks[w] for w in self.windows], cache, hidden_layers, attention_layers)
        if cache is not None:
            cache.end(T)
        return out

    def _layers(self, x: torch.Tensor, tables: list, masks: list, cache: KVCache | None,
                hidden_layers: Collection[int], attention_layers: Collection[int]) -> torch.Tensor | Captured:
        """The layer loop: layer i gets `tables[i]` (cos, sin) and `masks[i]`; a `Captured` when asked."""
        if hidden_layers or attention_layers:
            return capture_layers(self.layers, self.norm, x, tables, masks, cache, hidden_layers, attention_layers)
        for layer, (cos, sin), mask in zip(self.layers, tables, masks):
            x = layer(x, cos, sin, mask, cache)
        return self.norm(x)


class GemmaForCausalLM(LlamaForCausalLM):
    """`model` + `lm_head` (soft-capped when the config says so); forward returns hidden states.

    Tying, `input_embeddings`, `output_projection` and `resize_token_embeddings` are LLaMA's.
    """

    block_types = (GemmaDecoderLayer,)
    ignore_checkpoint_keys = ()

    def __init__(self, config: GemmaConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = GemmaModel(config)
        cap = config.final_logit_softcapping
        if cap:
            self.lm_head = SoftcappedLinear(config.hidden_size, config.vocab_size, cap)
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()


def config_from_hf(d: dict[str, Any]) -> GemmaConfig:
    """The registry's entry point (models/__init__.py): `GemmaConfig.from_hf`."""
    return GemmaConfig.from_hf(d)
