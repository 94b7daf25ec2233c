"""T5 encoder-decoder (T5 v1.0, v1.1, FLAN-T5) in plain PyTorch, loading HF checkpoints key-for-key.

Read top to bottom: config, RMS norm, relative position buckets, attention, feed-forward, block,
stack, model, then `shift_right` and `generate` (greedy and beam search with a KV cache).

The two generations of checkpoints differ in three places, all driven by config.json:

- feed-forward: v1.0 `DenseReluDense.wi -> relu -> wo`; v1.1 / FLAN-T5 gated
  `gelu_new(wi_0 x) * wi_1 x -> wo` (`feed_forward_proj="gated-gelu"`, gelu with the tanh approximation);
- head: v1.0 ties `lm_head` to the input embedding `shared`; v1.1 keeps its own `lm_head`;
- head input: v1.0 multiplies the decoder output by `d_model ** -0.5` before the tied head (the
  embedding rows are large, std ~1, so the logits would otherwise be ~sqrt(d_model) too big).
  `forward` returns the hidden states already scaled, so `output_projection(hidden)` is the logits.

Precision. T5's feed-forward activations grow past 65504 in the larger checkpoints, so float16
overflows to inf and then NaN (the classic "T5 fp16 NaN loss"). bfloat16 (float32's range) is
the fast path. Norms and attention softmax always run in float32. float16 is refused unless the
caller opts in with `model.allow_fp16 = True`; then it warns and clamps the residual stream the way
transformers does (to `finfo(float16).max - 1000` once an inf appears), which keeps it finite but
is not faithful where values really overflow.

This file imports only torch and the standard library.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100  # label value that the loss skips; treated as padding wherever ids are decoded

# ----------------------------------------------------------------------------- config

# config.json fields that do not change the maths of this model (bookkeeping, training-only
# defaults of other libraries, generation defaults, or values derived from fields we do read).
IGNORED_FIELDS: tuple[str, ...] = (
    "_name_or_path",
    "architectures",
    "bos_token_id",
    "chunk_size_feed_forward",  # chunking the FF changes memory, not results
    "classifier_dropout",
    "dense_act_fn",  # derived from feed_forward_proj (transformers recomputes it too)
    "dtype",
    "early_stopping",
    "finetuning_task",
    "gradient_checkpointing",
    "id2label",
    "initializer_factor",
    "is_decoder",
    "is_encoder_decoder",
    "is_gated_act",  # derived from feed_forward_proj
    "label2id",
    "length_penalty",
    "max_length",
    "min_length",
    "model_type",  # checked separately
    "n_positions",  # T5 has no absolute positions; old configs carry it anyway
    "no_repeat_ngram_size",
    "num_beams",
    "output_attentions",
    "output_hidden_states",
    "output_past",
    "prefix",
    "problem_type",
    "return_dict",
    "task_specific_params",
    "tokenizer_class",
    "torch_dtype",
    "torchscript",
    "transformers_version",
    "use_cache",
)

# activation names transformers uses in `feed_forward_proj` ("relu", "gated-gelu", ...)
_ACTIVATIONS = ("relu", "gelu", "gelu_new", "gelu_pytorch_tanh", "silu", "swish")


@dataclass
class T5Config:
    """T5 hyper-parameters under their HF `config.json` names (defaults are transformers' defaults)."""

    model_type: ClassVar[str] = "t5"

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64  # per-head width; num_heads * d_kv need not equal d_model
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None  # None: same as num_layers
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"  # "relu" (v1.0) or "gated-gelu" (v1.1 / FLAN-T5), "gated-<act>"
    tie_word_embeddings: bool = True  # lm_head is `shared` (v1.0)
    # multiply the decoder output by d_model**-0.5 before the head. None: same as tie_word_embeddings
    # (the rule of every config written before transformers 5, which writes this field explicitly)
    scale_decoder_outputs: bool | None = None
    decoder_start_token_id: int | None = None  # None: pad_token_id (T5 starts decoding from pad)
    pad_token_id: int = 0
    eos_token_id: int | list[int] = 1

    def __post_init__(self) -> None:
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        if self.scale_decoder_outputs is None:
            self.scale_decoder_outputs = self.tie_word_embeddings
        if self.decoder_start_token_id is None:
            self.decoder_start_token_id = self.pad_token_id
        _ = self.activation  # raises ValueError for a feed_forward_proj we do not implement

    @property
    def is_gated(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @property
    def activation(self) -> str:
        """The feed-forward activation; "gated-gelu" means gelu_new (tanh approximation), as in transformers."""
        parts = self.feed_forward_proj.split("-")
        act = parts[-1]
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated") or act not in _ACTIVATIONS:
            raise ValueError(
                f"config.json: feed_forward_proj: {self.feed_forward_proj!r} is not supported — "
                f"use 'relu' (T5 v1.0), 'gated-gelu' (v1.1 / FLAN-T5) or '[gated-]<act>' with act in {_ACTIVATIONS}"
            )
        if self.feed_forward_proj == "gated-gelu":
            return "gelu_new"
        return act

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "T5Config":
        """Read an HF `config.json` dict; a field that would change the maths and that we do not
        implement is a ValueError naming it (harmless ones are listed in IGNORED_FIELDS)."""
        if d.get("model_type", "t5") != "t5":
            raise ValueError(f"config.json: model_type: {d.get('model_type')!r} is not 't5' — use the matching family")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in names and k not in IGNORED_FIELDS)
        if unknown:
            raise ValueError(
                f"config.json: {', '.join(unknown)}: not understood by minitrain's T5 and may change the model — "
                "remove the field if it is harmless, or use a model family that implements it"
            )
        kw = {k: d[k] for k in names if k in d}
        for k in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "relative_attention_num_buckets",
                  "relative_attention_max_distance"):
            if k in kw and (not isinstance(kw[k], int) or isinstance(kw[k], bool) or kw[k] <= 0):
                raise ValueError(f"config.json: {k}: {kw[k]!r} is not a positive integer — fix the value")
        if kw.get("num_decoder_layers") is not None and (
            not isinstance(kw["num_decoder_layers"], int) or kw["num_decoder_layers"] <= 0
        ):
            raise ValueError(f"config.json: num_decoder_layers: {kw['num_decoder_layers']!r} is not a positive integer — fix it")
        if kw.get("pad_token_id") is None:
            kw.pop("pad_token_id", None)  # T5 pads with 0
        if kw.get("eos_token_id") is None:
            kw.pop("eos_token_id", None)
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict: loadable by transformers (4.x and 5.x) with the same maths."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(
            model_type="t5",
            architectures=["T5ForConditionalGeneration"],
            is_encoder_decoder=True,
            dense_act_fn=self.activation,  # written by transformers; older versions read it
            is_gated_act=self.is_gated,
        )
        return d


# ----------------------------------------------------------------------------- norm


class T5LayerNorm(nn.Module):
    """RMS norm: `x / sqrt(mean(x^2) + eps) * weight`; no mean subtraction and no bias.

    Computed in float32 whatever the input dtype: the mean of squares of bf16/fp16 activations
    loses precision (and overflows in fp16); the result is cast back to a half weight's dtype.
    """

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x32 = x32.to(self.weight.dtype)
        return self.weight * x32


# ----------------------------------------------------------------------------- relative positions


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Map `key_pos - query_pos` to a bucket id in [0, num_buckets) (Mesh TensorFlow's scheme).

    Bidirectional (encoder): half the buckets for keys after the query, half for before. Causal
    (decoder): only keys at or before the query count; later ones fall in bucket 0 (and are masked).
    Within a half, the first `max_exact` distances get a bucket each, larger ones share
    logarithmically wider buckets up to `max_distance`, beyond which everything is the last bucket.
    The float ops follow transformers' order so bucket boundaries round identically.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # clamp(min=1): log(0) would be -inf; those positions take the `is_small` branch anyway
    large = max_exact + (
        torch.log(distance.clamp(min=1).float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


# ----------------------------------------------------------------------------- attention


class T5Attention(nn.Module):
    """Multi-head attention with T5's conventions: no biases, no 1/sqrt(d_kv) scaling.

    There is no `1/sqrt(d_kv)` on the scores: Mesh TensorFlow folded it into the initialisation of
    `q` (std `(d_model * d_kv) ** -0.5`) and every checkpoint was trained that way, so adding it
    would flatten every attention distribution. Positions enter only through an additive bias on
    the scores, computed once per stack from the first block's `relative_attention_bias`.
    """

    def __init__(self, config: T5Config, has_relative_attention_bias: bool):
        super().__init__()
        self.n_heads = config.num_heads
        self.d_kv = config.d_kv
        inner = config.num_heads * config.d_kv
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        if has_relative_attention_bias:  # block 0 of each stack only
            self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_heads)
        self.dropout = config.dropout_rate

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H*d_kv) -> (B, H, T, d_kv)"""
        return x.view(x.shape[0], x.shape[1], self.n_heads, self.d_kv).transpose(1, 2)

    def project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `source` (B, S, D), each (B, H, S, d_kv)."""
        return self.heads(self.k(source)), self.heads(self.v(source))

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Attend from `x` (B, Tq, D) over keys/values (B, H, Tk, d_kv).

        `bias` (B or 1, H or 1, Tq, Tk) float32 already holds the position bias and the mask
        (`finfo.min` where attention is not allowed).
        """
        q = self.heads(self.q(x))  # (B, H, Tq, d_kv)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() + bias  # (B, H, Tq, Tk), no 1/sqrt(d_kv)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)  # softmax in fp32
        probs = F.dropout(probs, self.dropout, self.training)
        out = torch.matmul(probs, v)  # (B, H, Tq, d_kv)
        return self.o(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class T5DenseReluDense(nn.Module):
    """The feed-forward: `wo(act(wi x))` (v1.0) or `wo(act(wi_0 x) * wi_1 x)` (gated, v1.1).

    HF calls the module `DenseReluDense` whatever the activation; we keep the name for the keys.
    """

    def __init__(self, config: T5Config):
        super().__init__()
        self.gated = config.is_gated
        if self.gated:
            self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
            self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        else:
            self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.act = config.activation
        self.dropout = config.dropout_rate

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "relu":
            return F.relu(x)
        if self.act == "gelu":
            return F.gelu(x)  # exact erf gelu
        if self.act in ("gelu_new", "gelu_pytorch_tanh"):
            return F.gelu(x, approximate="tanh")  # transformers' gelu_new
        return F.silu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h = self.activate(self.wi_0(x)) * self.wi_1(x)  # (B, T, d_ff)
        else:
            h = self.activate(self.wi(x))
        return self.wo(F.dropout(h, self.dropout, self.training))


# ----------------------------------------------------------------------------- block


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config: T5Config, has_relative_attention_bias: bool):
        super().__init__()
        self.SelfAttention = T5Attention(config, has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)


class T5LayerCrossAttention(nn.Module):
    def __init__(self, config: T5Config):
        super().__init__()
        self.EncDecAttention = T5Attention(config, has_relative_attention_bias=False)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)


class T5LayerFF(nn.Module):
    def __init__(self, config: T5Config):
        super().__init__()
        self.DenseReluDense = T5DenseReluDense(config)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)


def clamp_fp16(x: torch.Tensor) -> torch.Tensor:
    """transformers' fp16 guard: once any value is inf, clamp all to +-(finfo.max - 1000); else no-op.

    Only float16 tensors are touched (bf16 and fp32 have float32's range and never need it).
    """
    if x.dtype != torch.float16:
        return x
    big = torch.finfo(torch.float16).max
    limit = torch.where(torch.isinf(x).any(), big - 1000, big)
    return torch.clamp(x, min=-limit, max=limit)


class T5Block(nn.Module):
    """Pre-norm residual block: self-attention, (decoder) cross-attention, feed-forward.

    HF keeps the sub-layers in a list, so the keys read `layer.0` (self-attn), `layer.1`
    (cross-attn in the decoder, FF in the encoder) and `layer.2` (decoder FF).
    """

    def __init__(self, config: T5Config, is_decoder: bool, layer_idx: int):
        super().__init__()
        self.is_decoder = is_decoder
        self.layer_idx = layer_idx  # where this block's K/V live in a T5Cache
        self.dropout = config.dropout_rate
        layers: list[nn.Module] = [T5LayerSelfAttention(config, has_relative_attention_bias=layer_idx == 0)]
        if is_decoder:
            layers.append(T5LayerCrossAttention(config))
        layers.append(T5LayerFF(config))
        self.layer = nn.ModuleList(layers)

    def forward(
        self,
        x: torch.Tensor,
        self_bias: torch.Tensor,
        encoder_hidden: torch.Tensor | None = None,
        cross_bias: torch.Tensor | None = None,
        cache: "T5Cache | None" = None,
    ) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D). With a cache (decoding), `x` holds only the new positions:
        their K/V are appended to the cache, and cross-attention K/V are projected once and kept."""
        sa = self.layer[0]
        h = sa.layer_norm(x)
        k, v = sa.SelfAttention.project_kv(h)  # (B, H, T, d_kv)
        if cache is not None:
            k, v = cache.append_self(self.layer_idx, k, v)
        x = clamp_fp16(x + F.dropout(sa.SelfAttention(h, k, v, self_bias), self.dropout, self.training))

        if self.is_decoder:
            ca = self.layer[1]
            h = ca.layer_norm(x)
            kv = cache.cross_kv[self.layer_idx] if cache is not None else None
            if kv is None:
                kv = ca.EncDecAttention.project_kv(encoder_hidden)  # (B, H, S, d_kv)
                if cache is not None:
                    cache.cross_kv[self.layer_idx] = kv
            x = clamp_fp16(x + F.dropout(ca.EncDecAttention(h, *kv, cross_bias), self.dropout, self.training))

        ff = self.layer[-1]
        x = x + F.dropout(ff.DenseReluDense(ff.layer_norm(x)), self.dropout, self.training)
        return clamp_fp16(x)


# ----------------------------------------------------------------------------- decoder cache


class T5Cache:
    """Decoder K/V for incremental decoding, one entry per decoder block.

    Self-attention K/V (B, H, T_so_far, d_kv) grow by the new positions at every call; cross-attention
    K/V (B, H, S, d_kv) are projected from the encoder output on the first call and reused after.
    """

    def __init__(self, num_layers: int):
        self.self_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.cross_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers

    @property
    def length(self) -> int:
        """How many decoder positions are cached (the position of the next token)."""
        return 0 if self.self_kv[0] is None else self.self_kv[0][0].shape[2]

    def append_self(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.self_kv[i] is not None:
            k = torch.cat([self.self_kv[i][0], k], dim=2)
            v = torch.cat([self.self_kv[i][1], v], dim=2)
        self.self_kv[i] = (k, v)
        return k, v

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` of the self-attention K/V (beam search picks which beams continue).

        Cross-attention K/V need no reordering: a beam is only ever replaced by a beam of the
        same input, whose encoder rows are identical.
        """
        self.self_kv = [None if kv is None else (kv[0].index_select(0, index), kv[1].index_select(0, index))
                        for kv in self.self_kv]


# ----------------------------------------------------------------------------- stack


class T5Stack(nn.Module):
    """The encoder or the decoder: embedding (shared), blocks, final norm."""

    def __init__(self, config: T5Config, embed_tokens: nn.Embedding, is_decoder: bool):
        super().__init__()
        self.is_decoder = is_decoder
        self.config = config
        # the same module as the model's `shared`: HF's name, one Parameter (key `shared.weight`)
        self.embed_tokens = embed_tokens
        n = config.num_decoder_layers if is_decoder else config.num_layers
        self.block = nn.ModuleList([T5Block(config, is_decoder, i) for i in range(n)])
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    def position_bias(self, q_len: int, k_len: int, offset: int, device: torch.device) -> torch.Tensor:
        """(1, H, q_len, k_len) float32 bias from block 0's table, shared by every block.

        Queries sit at positions offset .. offset+q_len-1 (offset > 0 when decoding with a cache).
        """
        q_pos = torch.arange(q_len, device=device)[:, None] + offset
        k_pos = torch.arange(k_len, device=device)[None, :]
        buckets = relative_position_bucket(
            k_pos - q_pos,
            bidirectional=not self.is_decoder,
            num_buckets=self.config.relative_attention_num_buckets,
            max_distance=self.config.relative_attention_max_distance,
        )  # (q_len, k_len)
        table = self.block[0].layer[0].SelfAttention.relative_attention_bias
        return table(buckets).float().permute(2, 0, 1).unsqueeze(0)  # (1, H, q_len, k_len)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: T5Cache | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) -> hidden (B, T, D) after the final norm.

        `attention_mask` (B, T_keys) of 1/0 masks padded keys; with a cache it covers the cached
        and the new positions. `encoder_attention_mask` (B, S) masks padded encoder positions.
        Several sequences in one row (packing): `attention_mask` a bool (B, 1, T, T) mask, True =
        may attend (the decoder's causal part included), and `encoder_attention_mask` a bool
        (B, 1, T, S) cross-attention mask. No positions are needed: the bias depends on `k - q`
        only, which inside one sequence is the same wherever the sequence sits in the row, so every
        allowed pair gets the bucket it has in the sequence alone.
        """
        B, T = input_ids.shape
        device = input_ids.device
        neg = torch.finfo(torch.float32).min  # additive "not allowed"; finite, so a fully masked row is no NaN
        offset = cache.length if cache is not None else 0
        k_len = offset + T

        bias = self.position_bias(T, k_len, offset, device)  # (1, H, T, k_len)
        allowed = None  # (B or 1, 1, T, k_len) bool
        if attention_mask is not None and attention_mask.dim() == 4:  # the caller's own mask (packed rows)
            if cache is not None:
                raise ValueError("a 4-D attention_mask cannot be used with a cache")
            allowed = attention_mask.to(device).bool()  # (B, 1, T, T)
        elif self.is_decoder:  # causal: key j visible from query i when j <= offset + i
            allowed = (torch.arange(k_len, device=device)[None, :]
                       <= torch.arange(T, device=device)[:, None] + offset)[None, None]
        if attention_mask is not None and attention_mask.dim() == 2:
            keys = attention_mask[:, None, None, :].bool()  # (B, 1, 1, k_len)
            allowed = keys if allowed is None else allowed & keys
        if allowed is not None:
            bias = bias.masked_fill(~allowed, neg)  # (B, H, T, k_len)

        cross_bias = None
        if self.is_decoder:
            S = encoder_hidden.shape[1] if encoder_hidden is not None else cache.cross_kv[0][0].shape[2]
            cross_bias = torch.zeros(1, 1, 1, S, device=device)  # no position bias across stacks
            if encoder_attention_mask is not None:
                cross = encoder_attention_mask.bool()
                cross = cross if cross.dim() == 4 else cross[:, None, None, :]  # (B, 1, T or 1, S)
                cross_bias = cross_bias.masked_fill(~cross, neg)

        x = F.dropout(self.embed_tokens(input_ids), self.config.dropout_rate, self.training)  # (B, T, D)
        for block in self.block:
            x = block(x, bias, encoder_hidden, cross_bias, cache)
        return F.dropout(self.final_layer_norm(x), self.config.dropout_rate, self.training)


# ----------------------------------------------------------------------------- model


class T5ForConditionalGeneration(nn.Module):
    """T5 with its LM head; `forward` returns decoder hidden states, `output_projection` the head.

    Module names are transformers' (`shared`, `encoder.block.N.layer.0.SelfAttention.q`, ...), so
    `model.state_dict()` keys are the checkpoint keys. `encoder.embed_tokens` and
    `decoder.embed_tokens` are the `shared` module itself; when the config ties the head,
    `lm_head.weight` is `shared.weight` too. Those extra names appear in `state_dict()` as aliases of
    one tensor; `load_state_dict` accepts a checkpoint holding any one of them (HF writes only
    `shared.weight`), and refuses a tied checkpoint whose stored `lm_head.weight` differs.
    """

    is_encoder_decoder = True
    block_types: ClassVar[tuple[type[nn.Module], ...]] = (T5Block,)  # wrapped for checkpointing / compile
    allow_fp16 = False  # float16 is refused unless set True on the model (see the module docstring)
    # keys (regexes) that old checkpoints carry but no module uses (transformers ignores them too);
    # minitrain's loader skips them as well
    ignore_checkpoint_keys: tuple[str, ...] = (r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$",)

    def __init__(self, config: T5Config):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, self.shared, is_decoder=False)
        self.decoder = T5Stack(config, self.shared, is_decoder=True)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()
        self.register_load_state_dict_pre_hook(_check_checkpoint_keys)
        self.register_load_state_dict_post_hook(_accept_tied_aliases)
        self._warned_fp16 = False

    def used_outside_blocks(self) -> list[nn.Parameter]:
        """Parameters inside a block that the stacks also use outside it: block 0's relative position
        table, read by each stack before its blocks run (a sharding wrapper must keep it whole then)."""
        return [s.block[0].layer[0].SelfAttention.relative_attention_bias.weight for s in (self.encoder, self.decoder)]

    @property
    def input_embeddings(self) -> nn.Embedding:
        return self.shared

    @property
    def output_projection(self) -> nn.Module:
        return self.lm_head

    def tie_weights(self) -> None:
        """Make `lm_head.weight` the `shared.weight` Parameter when the config ties them (else no-op).

        Loading with `assign=True` replaces Parameters one by one, which breaks the tie; call again after.
        """
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight

    def resize_token_embeddings(self, n: int) -> None:
        """Resize `shared` and the head to `n` rows together; new rows are the mean of the old ones.

        Keeps the old rows (the first `n` when shrinking), the dtype, device and `requires_grad`,
        and records `config.vocab_size = n`. Do this before loading an adapter trained on the resized model.
        """
        self.shared.weight = _resized(self.shared.weight, n)
        self.shared.num_embeddings = n
        if not self.config.tie_word_embeddings:
            self.lm_head.weight = _resized(self.lm_head.weight, n)
        self.lm_head.out_features = n
        self.tie_weights()
        self.config.vocab_size = n

    def shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """Decoder inputs for teacher forcing from `labels` (see the module-level `shift_right`)."""
        return shift_right(labels, self.config.decoder_start_token_id, self.config.pad_token_id)

    def _check_precision(self, device: torch.device) -> None:
        """Refuse float16 (weights or autocast) unless `allow_fp16`; warn once when allowed."""
        fp16 = self.shared.weight.dtype == torch.float16 or (
            torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == torch.float16
        )
        if not fp16:
            return
        if not self.allow_fp16:
            raise ValueError(
                "float16: T5 activations overflow float16 (max 65504) and turn into inf/NaN — "
                "run in bfloat16 or float32, or set model.allow_fp16 = True to accept transformers' clamping"
            )
        if not self._warned_fp16:
            warnings.warn(
                "T5 in float16: activations are clamped to +-(65504 - 1000) once they overflow; "
                "results differ from float32 where that happens — prefer bfloat16",
                stacklevel=3,
            )
            self._warned_fp16 = True

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder hidden states (B, S, D) after the encoder's final norm."""
        self._check_precision(input_ids.device)
        return self.encoder(input_ids, attention_mask)

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        encoder_hidden: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        cache: T5Cache | None = None,
    ) -> torch.Tensor:
        """Decoder hidden (B, Td, D), scaled by d_model**-0.5 when the config says so (v1.0).

        `attention_mask` (B, S) is the encoder's padding mask (packed rows: a bool (B, 1, Td, S)
        cross-attention mask). With a `cache` (from `new_cache()`),
        `decoder_input_ids` are only the new tokens; the first call projects the cross-attention K/V
        from `encoder_hidden`, later calls may pass `encoder_hidden=None`.
        """
        self._check_precision(decoder_input_ids.device)
        if encoder_hidden is None and (cache is None or cache.cross_kv[0] is None):
            raise ValueError("decode: encoder_hidden is None — pass model.encode(...) on the first call (or without a cache)")
        h = self.decoder(decoder_input_ids, decoder_attention_mask, encoder_hidden, attention_mask, cache)
        if self.config.scale_decoder_outputs:
            h = h * self.config.d_model**-0.5  # the tied head expects rescaled inputs (see module docstring)
        return h

    def new_cache(self) -> T5Cache:
        return T5Cache(self.config.num_decoder_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        decoder_input_ids: torch.Tensor,
        decoder_attention_mask: torch.Tensor | None = None,
        cross_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher-forced pass: decoder hidden (B, Td, D); `output_projection(hidden)` are the logits.

        Packed rows (several examples per row, see `T5Stack.forward`): bool masks `attention_mask`
        (B, 1, S, S), `decoder_attention_mask` (B, 1, Td, Td) (causal within each example) and
        `cross_attention_mask` (B, 1, Td, S) (each example's decoder sees its own encoder tokens).
        """
        encoder_hidden = self.encode(input_ids, attention_mask)
        cross = attention_mask if cross_attention_mask is None else cross_attention_mask
        return self.decode(decoder_input_ids, encoder_hidden, cross, decoder_attention_mask)


def _resized(weight: nn.Parameter, n: int) -> nn.Parameter:
    """A (n, D) copy of `weight`'s rows; rows past the old size are the mean of the old rows."""
    old = weight.shape[0]
    with torch.no_grad():
        new = torch.empty(n, weight.shape[1], dtype=weight.dtype, device=weight.device)
        keep = min(old, n)
        new[:keep] = weight[:keep]
        if n > old:
            new[old:] = weight.float().mean(0, keepdim=True).to(weight.dtype)
    return nn.Parameter(new, requires_grad=weight.requires_grad)


def _tied_groups(model: T5ForConditionalGeneration) -> list[list[str]]:
    """Names that are one tensor: `shared.weight`, the two embed_tokens, and the head when tied."""
    group = ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]
    if model.config.tie_word_embeddings:
        group.append("lm_head.weight")
    return [group]


def _check_checkpoint_keys(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """load_state_dict pre-hook: drop keys no module uses; refuse a tied head that differs from `shared`."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if any(re.search(p, key[len(prefix):]) for p in module.ignore_checkpoint_keys):
            state_dict.pop(key)
    head, emb = state_dict.get(prefix + "lm_head.weight"), state_dict.get(prefix + "shared.weight")
    if module.config.tie_word_embeddings and head is not None and emb is not None:
        if head.shape != emb.shape or not torch.equal(head.to(emb.dtype), emb):
            raise ValueError(
                "config.json: tie_word_embeddings: true, but the checkpoint's lm_head.weight differs from "
                "shared.weight — set tie_word_embeddings to false (transformers >= 5 writes true even for "
                "untied v1.1 / FLAN-T5 heads)"
            )


def _accept_tied_aliases(module, incompatible) -> None:
    """load_state_dict post-hook: a tied tensor needs only one of its names; then re-tie (assign=True)."""
    for group in _tied_groups(module):
        if any(name not in incompatible.missing_keys for name in group):
            for name in group:
                if name in incompatible.missing_keys:
                    incompatible.missing_keys.remove(name)
    module.tie_weights()


# ----------------------------------------------------------------------------- labels and decoding


def shift_right(labels: torch.Tensor, decoder_start_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Teacher-forcing decoder inputs: `[start, y0, ..., y_{T-2}]`, with -100 (ignored labels) as pad. (B, T)"""
    dec = labels.new_full(labels.shape, pad_token_id)
    dec[..., 0] = decoder_start_token_id
    dec[..., 1:] = labels[..., :-1]
    return dec.masked_fill(dec == IGNORE_INDEX, pad_token_id)


def ignored_to_pad(ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Ids safe to detokenize: every negative id (-100 from labels) becomes pad.

    Decoding raw labels crashes tokenizers on -100; do this first (e.g. in eval metrics).
    """
    return ids.masked_fill(ids < 0, pad_token_id)


def _as_list(eos: int | list[int] | None) -> list[int]:
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


@torch.no_grad()
def generate(
    model: T5ForConditionalGeneration,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 20,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    early_stopping: bool | str = False,
) -> torch.Tensor:
    """Greedy (num_beams=1) or beam search; returns (B, 1 + generated) ids starting with the decoder start id.

    The encoder runs once; the decoder runs one token per step on a KV cache. Beam search scores
    a finished hypothesis as `sum of log-probs / generated_length ** length_penalty`, where the
    length counts the generated tokens including eos (not the start token). `early_stopping` is
    transformers': False stops an input once its best running beam, scored at the current length,
    cannot beat its worst finished hypothesis; "never" scores it at the maximum length instead
    (when length_penalty > 0); True also stops as soon as `num_beams` hypotheses are finished.
    Outputs equal transformers' `generate(do_sample=False)` with the same arguments, including
    its padding after eos (pad, or eos when pad is 0). Call `model.eval()` first (dropout).
    """
    cfg = model.config
    eos = _as_list(cfg.eos_token_id if eos_token_id is None else eos_token_id)
    B = input_ids.shape[0]
    start = torch.full((B, 1), cfg.decoder_start_token_id, dtype=torch.long, device=input_ids.device)
    encoder_hidden = model.encode(input_ids, attention_mask)  # (B, S, D), once
    if num_beams == 1:
        return _greedy(model, encoder_hidden, attention_mask, start, max_new_tokens, eos)
    return _beam_search(model, encoder_hidden, attention_mask, start, max_new_tokens, eos, num_beams,
                        length_penalty, early_stopping)


def _next_logprobs(model, token_ids, encoder_hidden, attention_mask, cache) -> torch.Tensor:
    """(N, 1) newest tokens -> (N, V) float32 logits of the token after them."""
    h = model.decode(token_ids, encoder_hidden, attention_mask, cache=cache)  # (N, 1, D)
    return model.output_projection(h[:, -1]).float()


def _greedy(model, encoder_hidden, attention_mask, start, max_new_tokens, eos) -> torch.Tensor:
    cache = model.new_cache()
    out, last = start, start
    eos_t = torch.tensor(eos, device=start.device)
    done = torch.zeros(start.shape[0], dtype=torch.bool, device=start.device)
    for _ in range(max_new_tokens):
        logits = _next_logprobs(model, last, encoder_hidden if cache.length == 0 else None, attention_mask, cache)
        tok = logits.argmax(-1)  # (B,)
        tok = torch.where(done, model.config.pad_token_id, tok)  # finished rows keep emitting pad
        out = torch.cat([out, tok[:, None]], dim=1)
        done = done | torch.isin(tok, eos_t)
        if done.all():
            break
        last = tok[:, None]
    return out


def _beam_search(model, encoder_hidden, attention_mask, start, max_new_tokens, eos, K, length_penalty,
                 early_stopping) -> torch.Tensor:
    """Beam search with transformers' rules, per input `b`:

    - running: the K best unfinished beams (scores = summed log-probs); at step 1 only beam 0 is
      live (the others start at -1e9) so the K beams differ;
    - each step ranks the K*V continuations, keeps the best 2K, and continues the best K that do
      not end (eos, or the length limit);
    - a continuation that ends, and is among the best K of those 2K, competes for the K finished
      slots with score / length ** length_penalty;
    - `b`'s finished set is frozen once the early-stopping bound says no running beam can beat
      its worst finished one (and, with early_stopping=True, once all K slots are full);
    - the search stops when no input can improve, or every candidate ends (eos or length limit).
    """
    B, device = start.shape[0], start.device
    V = model.config.vocab_size
    L = 1 + max_new_tokens  # longest output incl. the start token
    eos_t = torch.tensor(eos, device=device)
    neg = -1.0e9
    # transformers fills positions after a hypothesis ends with `(pad or eos[0]) if eos else -1`:
    # with T5's pad 0 that is eos. Copied so outputs compare equal.
    fill = (model.config.pad_token_id or eos[0]) if eos else -1

    rows = torch.arange(B, device=device)[:, None]  # (B, 1)
    run_seq = torch.full((B, K, L), fill, dtype=torch.long, device=device)
    run_seq[:, :, 0] = start[:, 0, None]
    run_score = torch.full((B, K), neg, device=device)
    run_score[:, 0] = 0.0
    fin_seq = run_seq.clone()
    fin_score = torch.full((B, K), neg, device=device)
    fin_len = torch.zeros((B, K), dtype=torch.long, device=device)  # generated tokens of each finished one
    fin_done = torch.zeros((B, K), dtype=torch.bool, device=device)
    improvable = torch.ones(B, dtype=torch.bool, device=device)

    cache = model.new_cache()
    enc = encoder_hidden.repeat_interleave(K, dim=0)  # (B*K, S, D)
    mask = attention_mask.repeat_interleave(K, dim=0) if attention_mask is not None else None
    last = run_seq[:, :, 0].reshape(B * K, 1)
    for t in range(1, L):  # t: position being filled = number of tokens generated after this step
        logp = torch.log_softmax(_next_logprobs(model, last, enc if t == 1 else None, mask, cache), dim=-1)
        total = (logp.view(B, K, V) + run_score[:, :, None]).view(B, K * V)
        cand_score, cand_idx = total.topk(2 * K, dim=1)  # (B, 2K), best first
        cand_beam, cand_tok = cand_idx // V, cand_idx % V
        cand_seq = run_seq[rows, cand_beam]  # (B, 2K, L)
        cand_seq[:, :, t] = cand_tok
        ends = torch.isin(cand_tok, eos_t) | (t + 1 >= L)  # (B, 2K)

        # running beams for the next step: best K that go on
        keep = (cand_score + ends.float() * neg).topk(K, dim=1).indices  # (B, K)
        run_seq = cand_seq[rows, keep]
        run_score = (cand_score + ends.float() * neg)[rows, keep]
        src_beam = cand_beam[rows, keep]  # which old beam each new one extends

        # finished hypotheses: merge the newly ended (among the best K candidates) into the K slots
        new_score = cand_score / (t**length_penalty)
        eligible = ends.clone()
        eligible[:, K:] = False
        eligible &= improvable[:, None]
        if early_stopping is True:
            eligible &= ~fin_done.all(dim=1, keepdim=True)
        new_score = torch.where(eligible, new_score, new_score + neg)
        all_score = torch.cat([fin_score, new_score], dim=1)  # (B, 3K)
        best = all_score.topk(K, dim=1).indices
        fin_seq = torch.cat([fin_seq, cand_seq], dim=1)[rows, best]
        fin_len = torch.cat([fin_len, torch.full_like(cand_tok, t)], dim=1)[rows, best]
        fin_done = torch.cat([fin_done, eligible], dim=1)[rows, best]
        fin_score = all_score[rows, best]

        # can a running beam still beat the worst finished one? (transformers' heuristic)
        if early_stopping == "never" and length_penalty > 0.0:
            best_len = L - 1
        else:
            best_len = t
        best_running = run_score[:, 0] / (best_len**length_penalty)
        worst_finished = torch.where(fin_done, fin_score.min(dim=1, keepdim=True).values, neg)
        improvable &= (best_running[:, None] > worst_finished).any(dim=1)

        if not improvable.any() or (early_stopping is True and fin_done.all()) or ends.all():
            break
        cache.reorder((rows * K + src_beam).reshape(-1))
        last = run_seq[:, :, t].reshape(B * K, 1)

    out_len = 1 + int(fin_len[:, 0].max())
    return fin_seq[:, 0, :out_len]


def config_from_hf(d: dict) -> T5Config:
    """The registry's entry point (models/__init__.py): `T5Config.from_hf`."""
    return T5Config.from_hf(d)
