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
RMSNorm, `generate` and the captured layers of distillation are LLaMA's (imported from
models/llama.py, which needs nothing but torch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Collection

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.llama import (
    IGNORED_FIELDS,
    Captured,
    Documents,
    KVCache,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    RotaryEmbedding,
    Ragged,
    _normalize_rope_scaling,
    apply_rotary,
    attend,
    attention_mask_4d,
    capture_layers,
    forward_unpadded,
    generate,
    repeat_kv,
    row_masks,
    unpadded_lengths,
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
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} — fix the config"
            )
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
        self.rope_scaling = _normalize_rope_scaling(r, self.max_position_embeddings)
        for key in ("short_factor", "long_factor"):
            n = len((self.rope_scaling or {}).get(key, [0] * (self.rotary_dim // 2)))
            if n != self.rotary_dim // 2:
                raise ValueError(
                    f"config.json: rope_scaling {key} has {n} entries — longrope needs one per rotated frequency, "
                    f"head_dim/2 = {self.rotary_dim // 2}"
                )

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
        for name in IGNORED_FIELDS:
            d.pop(name, None)
        d.pop("auto_map", None)  # remote-code class names of the original upload
        for name in ("attention_dropout", "resid_pdrop", "embd_pdrop"):
            p = d.pop(name, 0.0)
            if p not in (None, 0, 0.0):
                raise ValueError(f"config.json: {name}={p} is not supported — set it to 0.0")
        params = dict(d.pop("rope_parameters", None) or {})
        if "rope_theta" in params:
            d["rope_theta"] = params.pop("rope_theta")
        if "partial_rotary_factor" in params:
            d.setdefault("partial_rotary_factor", params.pop("partial_rotary_factor"))
        if params.get("rope_type", params.get("type", "default")) != "default":
            d["rope_scaling"] = d.get("rope_scaling") or params
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"config.json: missing {missing} — this does not look like a Phi-3 config")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(
                f"config.json: field(s) {unknown} are not understood by minitrain's phi3 model and may change its "
                "maths — remove them if harmless, or this checkpoint needs a different model"
            )
        if "rope_theta" in d:
            d["rope_theta"] = float(d["rope_theta"])
        return cls(**d)

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict transformers loads."""
        d = asdict(self)
        d["architectures"] = ["Phi3ForCausalLM"]
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d


@dataclass
class RopeSpec:
    """What `models.llama.RotaryEmbedding` reads of a config: the rotated dims and their RoPE."""

    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hd), cos/sin (B, T, rd) with rd <= hd: rotate the first rd dims, keep the rest.
    Also x (N, heads, hd) with cos/sin (N, rd): an unpadded batch."""
    rd = cos.shape[-1]
    return torch.cat([apply_rotary(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)


class Phi3Attention(nn.Module):
    """GQA with RoPE from one fused `qkv_proj` ([q | k | v] along the output)."""

    def __init__(self, config: Phi3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        D = config.hidden_size
        self.qkv_proj = nn.Linear(D, (self.n_heads + 2 * self.n_kv) * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, D, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        return_probs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> (B, T, D). `mask` None means plain causal attention (no padding).
        `return_probs`: also the attention probabilities (B, H, T, S) fp32 (`models.llama.attend`).
        A `Ragged` mask: x (N, D), the batch's real tokens end to end, cos / sin (N, rd). A `Documents`
        mask: rows of several sequences through FlexAttention."""
        hd = self.head_dim
        q, k, v = self.qkv_proj(x).split([self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        if isinstance(mask, Ragged):  # (N, heads, hd): RoPE per token, attention per sequence
            q, k, v = (t.unflatten(-1, (-1, hd)) for t in (q, k, v))  # (N, heads, hd)
            q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
            return self.o_proj(mask.attend(q, k, v).flatten(1))
        B, T, _ = x.shape
        q = q.view(B, T, self.n_heads, hd).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_kv, hd).transpose(1, 2)  # (B, Hkv, T, hd)
        v = v.view(B, T, self.n_kv, hd).transpose(1, 2)  # (B, Hkv, T, hd)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, S, hd)
        if isinstance(mask, Documents):  # FlexAttention: the shared heads read in place
            y, probs = mask.attend(q, k, v), None
        else:
            n_rep = self.n_heads // self.n_kv
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, S, hd)
            y, probs = attend(q, k, v, mask, return_probs)  # (B, H, T, hd)
        y = self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * hd))
        return (y, probs) if return_probs else y


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


class Phi3DecoderLayer(LlamaDecoderLayer):
    """Pre-norm block, LLaMA's forward: x + attn(norm(x)), then + mlp(norm(x)), over Phi-3's fused
    attention and MLP."""

    def __init__(self, config: Phi3Config, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = Phi3Attention(config, layer_idx)
        self.mlp = Phi3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Phi3Model(nn.Module):
    """Embeddings, decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(self, config: Phi3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Phi3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        spec = RopeSpec(config.rotary_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)
        self.rotary = RotaryEmbedding(spec)
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
        w = self.config.sliding_window
        if document_ids is not None or (attention_mask is not None and attention_mask.dim() == 4):
            if cache is not None or position_ids is None:
                raise ValueError("a 4-D attention_mask or document_ids need position_ids and no KV cache")
            pos = position_ids.to(x.device)
            flex = self.packed_attention == "flex" and not (hidden_layers or attention_layers)
            mask = row_masks(attention_mask, pos, document_ids, (w,), flex)[w]
            return self._layers(x, self.rotary(pos, dtype=x.dtype), mask, None, hidden_layers, attention_layers)
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
        cos, sin = self.rotary(position_ids, dtype=x.dtype)  # (B, T, rd)
        lengths = None if hidden_layers or attention_layers else unpadded_lengths(valid, padded, cache)
        if lengths:
            return forward_unpadded(x, valid, lengths, ((layer, (cos, sin), w) for layer in self.layers), self.norm)
        plain = cache is None and not padded and (w is None or T <= w)
        mask = None if plain else attention_mask_4d(key_valid, start, w)  # (B, 1, T, S)
        out = self._layers(x, (cos, sin), mask, cache, hidden_layers, attention_layers)
        if cache is not None:
            cache.end(T)
        return out

    def _layers(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], mask, cache: KVCache | None,
                hidden_layers: Collection[int], attention_layers: Collection[int]) -> torch.Tensor | Captured:
        """The layer loop, every layer with the same (cos, sin) and mask; a `Captured` when asked."""
        L = len(self.layers)
        if hidden_layers or attention_layers:
            return capture_layers(self.layers, self.norm, x, [tables] * L, [mask] * L, cache, hidden_layers,
                                  attention_layers)
        for layer in self.layers:
            x = layer(x, *tables, mask, cache)
        return self.norm(x)


class Phi3ForCausalLM(LlamaForCausalLM):
    """`model` + `lm_head`; forward returns hidden states. Tying, `input_embeddings`,
    `output_projection` and `resize_token_embeddings` are LLaMA's."""

    block_types = (Phi3DecoderLayer,)
    ignore_checkpoint_keys = ()
    # fused linear -> the unfused names it holds: LoRA target lists written for LLaMA (q_proj, ...,
    # up_proj) adapt these modules, and one naming part of a fused linear is refused
    fused_linears = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: Phi3Config) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = Phi3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()


def config_from_hf(d: dict[str, Any]) -> Phi3Config:
    """The registry's entry point (models/__init__.py): `Phi3Config.from_hf`."""
    return Phi3Config.from_hf(d)
