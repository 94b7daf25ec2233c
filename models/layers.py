"""The floor every decoder family stands on: what LLaMA, Mistral, Qwen, Gemma, Phi-3 and the
mixture-of-experts families share, in plain torch. A family file keeps only what is particular to it
(its config, its attention's quirks, its block) and imports the rest from here, as transformers'
"modular" files are a diff over shared pieces; a family file plus this one can be copied alone.

Read top to bottom: config helpers (the fields no family's maths reads, RoPE dicts, the checks every
`from_hf` makes), norms (RMSNorm, Gemma's (1 + w) form), rotary embeddings (every rope_scaling type
the checkpoints use, partial rotation), the KV cache and masks (a padded batch without its padding:
`Ragged`; rows of several sequences: `Documents`), attention (GQA over SDPA, windows, soft-capped
scores, attention sinks), gated MLPs, the mixture-of-experts block (router + experts, dropless, one
grouped product per projection), the pre-norm block, the decoder body every family's `model.` is,
the causal-LM wrapper, generation.

Shapes in comments: B batch, T new tokens, S keys (cached + new), D hidden_size, H query heads,
Hkv key/value heads, hd head_dim, V vocab_size, N tokens of a flattened batch, E experts, K experts
per token, F an MLP's (or an expert's) intermediate size.
"""

from __future__ import annotations

import inspect
import math
import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Callable, Collection, Iterable, NamedTuple, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------
# Config helpers
# --------------------------------------------------------------------------------------------

# config.json fields that do not change the forward maths (bookkeeping, generation defaults,
# init settings that only matter when training from scratch).
IGNORED_FIELDS: tuple[str, ...] = (
    "_name_or_path",
    "architectures",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "initializer_range",
    "tokenizer_class",
    "max_sequence_length",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "max_length",
    "min_length",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "num_beams",
    "repetition_penalty",
)

# Keys each supported rope type may carry (besides rope_type/type/rope_theta), with HF's meaning.
ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "factor", "attention_factor", "original_max_position_embeddings"),
}
ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}


def normalize_rope_scaling(
    rope_scaling: dict[str, Any] | None, max_position_embeddings: int
) -> dict[str, Any] | None:
    """`rope_scaling` with `rope_type` spelled out and HF's defaults filled; None for plain RoPE.

    Accepts the old `{"type": ...}` spelling. Unknown types or keys are ValueErrors: a RoPE we
    only half understand gives a model that loads fine and is quietly wrong at every position.
    """
    if not rope_scaling:
        return None
    r = dict(rope_scaling)
    rope_type = r.pop("rope_type", None) or r.pop("type", None) or "default"
    r.pop("type", None)
    r.pop("rope_theta", None)  # carried by the config's rope_theta
    partial = r.pop("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"config.json: rope partial_rotary_factor={partial} is not supported — "
            "LLaMA/Mistral rotate the whole head (partial_rotary_factor 1.0)"
        )
    if rope_type not in ROPE_KEYS:
        raise ValueError(
            f"config.json: rope_type {rope_type!r} is not supported — supported: {', '.join(ROPE_KEYS)}"
        )
    unknown = sorted(set(r) - set(ROPE_KEYS[rope_type]))
    if unknown:
        raise ValueError(
            f"config.json: rope_scaling key(s) {unknown} are not understood for rope_type {rope_type!r} — "
            f"supported keys: {list(ROPE_KEYS[rope_type]) or 'none'}"
        )
    missing = [k for k in ROPE_REQUIRED.get(rope_type, ()) if k not in r]
    if missing:
        raise ValueError(f"config.json: rope_scaling of type {rope_type!r} is missing {missing} — add them")
    if rope_type == "default":
        return None
    if rope_type in ("yarn", "llama3", "longrope"):
        r.setdefault("original_max_position_embeddings", max_position_embeddings)
    return {"rope_type": rope_type, **r}



@dataclass
class RopeSpec:
    """What `RotaryEmbedding` reads of a config: one RoPE (a family's, or one layer type's)."""

    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int


def drop_ignored(d: dict[str, Any], names: Iterable[str]) -> None:
    """Remove the fields `names` (harmless bookkeeping) from a config.json dict, in place."""
    for name in names:
        d.pop(name, None)


def require_zero(d: dict[str, Any], *names: str) -> None:
    """Pop each dropout-like field of `names` from `d`; a non-zero value is a ValueError (a
    forward that drops activations is not the checkpoint's forward)."""
    for name in names:
        p = d.pop(name, 0.0)
        if p not in (None, 0, 0.0):
            raise ValueError(f"config.json: {name}={p} is not supported — set it to 0.0")


REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def check_fields(d: dict[str, Any], cls: type, model_type: str, what: str | None = None,
                 required: Sequence[str] = REQUIRED_FIELDS) -> None:
    """The checks every `from_hf` makes on what is left of a config.json dict: the `required`
    fields are there, and every field is one of the dataclass `cls`'s (a field we do not know may
    change the maths: refused, never ignored). `what` names the family in the message."""
    missing = [k for k in required if k not in d]
    if missing:
        raise ValueError(f"config.json: missing {missing} — this does not look like a {what or model_type} config")
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(
            f"config.json: field(s) {unknown} are not understood by minitrain's {model_type} model and may "
            "change its maths — remove them if harmless, or this checkpoint needs a different model"
        )


def read_rope(d: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """Pop a config's RoPE fields -> (rope_theta or None, the scaling dict or None). `rope_scaling`
    (old) and `rope_parameters` (transformers v5) are two spellings of the same dict, and v5 moves
    rope_theta inside it; spellings that disagree are a ValueError."""
    scaling = d.pop("rope_scaling", None)
    params = d.pop("rope_parameters", None)
    theta = d.pop("rope_theta", None)
    if params:
        if scaling and normalize_rope_scaling(scaling, 0) != normalize_rope_scaling(params, 0):
            raise ValueError("config.json: rope_scaling and rope_parameters disagree — keep only one of them")
        inner_theta = params.get("rope_theta")
        if theta is not None and inner_theta is not None and float(theta) != float(inner_theta):
            raise ValueError(
                f"config.json: rope_theta={theta} and rope_parameters.rope_theta={inner_theta} disagree — keep one"
            )
        theta = inner_theta if inner_theta is not None else theta
        scaling = scaling or params
    return (float(theta) if theta is not None else None), scaling


def text_config_of(d: dict[str, Any], from_hf: Callable[[dict[str, Any]], Any], text_type: str,
                   tie_default: bool) -> Any:
    """A multimodal checkpoint's config.json (`*ForConditionalGeneration`) -> its language model's config:
    `from_hf` of its `text_config` (as `text_type`; the outer `tie_word_embeddings` is the one transformers
    honours), with the outer `model_type`, and the rest of the dict in `multimodal` for `multimodal_to_hf`."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json: a multimodal {d.get('model_type')} config without a text_config — restore "
                         "the checkpoint's config.json")
    cfg = from_hf({**text, "model_type": text_type, "tie_word_embeddings": d.get("tie_word_embeddings", tie_default)})
    cfg.model_type = d["model_type"]
    cfg.multimodal = {k: v for k, v in d.items() if k != "text_config"}
    return cfg


def multimodal_to_hf(text: dict[str, Any], outer: dict[str, Any] | None, text_type: str) -> dict[str, Any]:
    """A text model's `to_hf` dict as transformers writes it: alone (`outer` None), or inside the multimodal
    config `outer` (what `text_config_of` kept) as its `text_config`."""
    if outer is None:
        return text
    text.pop("architectures", None)
    return {**outer, "tie_word_embeddings": text["tie_word_embeddings"], "text_config": {**text, "model_type": text_type}}


def check_heads(num_attention_heads: int, num_key_value_heads: int) -> None:
    """Grouped-query attention needs the query heads to be a multiple of the key/value heads."""
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"config.json: num_attention_heads={num_attention_heads} is not a multiple of "
            f"num_key_value_heads={num_key_value_heads} — fix the config"
        )


def check_layer_types(layer_types: list[str], num_hidden_layers: int) -> None:
    """`layer_types` lists "sliding_attention" / "full_attention" once per layer."""
    bad = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if bad or len(layer_types) != num_hidden_layers:
        raise ValueError(
            f"config.json: layer_types must list 'sliding_attention' / 'full_attention' once per layer "
            f"({num_hidden_layers}) — got {len(layer_types)} entries{f', unknown {bad}' if bad else ''}"
        )


# --------------------------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """x / rms(x) * weight, with the statistics in fp32 and the result cast back like HF."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a frozen weight in eager mode: `_RMSNorm`, the same forward with a backward of its own
        # (torch.compile fuses the written-out form anyway)
        if self.weight.requires_grad or not x.requires_grad or torch.compiler.is_compiling():
            return _rms_norm(x, self.weight, self.eps)[0]
        return _RMSNorm.apply(x, self.weight, self.eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's RMSNorm, op for op -> (the output, the fp32 `1 / rms(x)` (..., 1))."""
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # HF multiplies after the cast back, so an fp32 weight on a bf16 input gives fp32 (as HF)
    return weight * (x32 * r).to(x.dtype), r


class _RMSNorm(torch.autograd.Function):
    """RMSNorm under a frozen weight, saving x and 1 / rms(x) only. With u = g * w and r = 1 / rms(x)
    the gradient is `r u - x r^3 mean(u x)`: four passes over x where autograd's graph of the
    written-out form makes nine (the pow, mean and product nodes' own products, copies and sums)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, r = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, r)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        u = (g * weight).to(x.dtype).float()  # rounded to x's dtype first, as autograd's cast back does
        x32 = x.float()
        c = torch.linalg.vecdot(u, x32).unsqueeze(-1).mul_(r.pow(3)).div_(-x.shape[-1])  # -r^3 mean(u x)
        return u.mul_(r).addcmul_(x32, c).to(x.dtype), None, None


class RMSNormCastLast(nn.Module):
    """gpt-oss's RMSNorm: (weight * x / rms(x)) in fp32, cast back last (LLaMA's casts before the weight;
    the two differ only when the activations are narrower than fp32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """Gemma's norm: x / rms(x) * (1 + weight), all in fp32, cast back at the end (HF's Gemma order;
    the weights start at 0)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


# --------------------------------------------------------------------------------------------
# Rotary embeddings
# --------------------------------------------------------------------------------------------


def rope_inv_freq(config: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (hd/2,) fp32 on CPU and the cos/sin scale, per HF's rope formulas.

    `seq_len` (max position + 1 in the batch) only matters for `dynamic`, whose base grows once
    the sequence is longer than `max_position_embeddings`.
    """
    dim = config.head_dim
    base = config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # (hd/2,)
    r = config.rope_scaling or {"rope_type": "default"}
    kind = r["rope_type"]

    if kind == "default":
        return 1.0 / (base**exponents), 1.0

    if kind == "linear":  # positions / factor == frequencies / factor
        return 1.0 / (base**exponents) / r["factor"], 1.0

    if kind == "dynamic":  # NTK-aware: raise the base once past the trained length
        factor, max_pos = r["factor"], config.max_position_embeddings
        seq_len = max(seq_len or max_pos, max_pos)
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base**exponents), 1.0

    if kind == "llama3":  # keep high frequencies, divide low ones by factor, blend in between
        inv_freq = 1.0 / (base**exponents)
        factor, low, high = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
        old_len = r["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0

    if kind == "yarn":  # interpolate low frequencies, extrapolate high ones, ramp in between
        old_len = r["original_max_position_embeddings"]
        factor = r["factor"] if r["factor"] is not None else config.max_position_embeddings / old_len

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = r.get("attention_factor")
        if attention_factor is None:
            if r.get("mscale") and r.get("mscale_all_dim"):
                attention_factor = mscale(factor, r["mscale"]) / mscale(factor, r["mscale_all_dim"])
            else:
                attention_factor = mscale(factor)
        beta_fast = r.get("beta_fast") or 32
        beta_slow = r.get("beta_slow") or 1

        def correction_dim(n_rotations: float) -> float:  # the dim that turns n times in old_len
            return (dim * math.log(old_len / (n_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if r.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a division by zero in the ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv_freq, float(attention_factor)

    if kind == "longrope":  # Phi-3: per-frequency divisors, the long set once past the trained length
        old_len = r["original_max_position_embeddings"]
        factor = r.get("factor") or config.max_position_embeddings / old_len
        attention_factor = r.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
        ext = r["long_factor"] if seq_len and seq_len > old_len else r["short_factor"]
        if len(ext) != dim // 2:
            raise ValueError(f"config.json: rope_scaling factors have {len(ext)} entries — RoPE needs head_dim/2 = {dim // 2}")
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**exponents), float(attention_factor)

    raise ValueError(f"config.json: rope_type {kind!r} is not supported")  # from_hf already refused it


class RotaryEmbedding:
    """cos/sin tables for given position ids. A plain object, not an nn.Module: nothing is
    registered, so the model builds on the meta device and the loader never sees a buffer.
    Inverse frequencies are cached per device in a dict (dynamic RoPE past the trained length is
    recomputed per call, as its base depends on the length)."""

    def __init__(self, config: RopeSpec) -> None:
        self.config = config
        self._cache: dict[tuple, tuple[torch.Tensor, float]] = {}  # (device[, long]) -> table

    def inv_freq(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        device = position_ids.device
        r = self.config.rope_scaling
        key: tuple = (device,)
        if r is not None and r["rope_type"] in ("dynamic", "longrope"):
            seq_len = int(position_ids.max()) + 1  # HF: the longest position in the batch
            if r["rope_type"] == "dynamic" and seq_len > self.config.max_position_embeddings:
                inv_freq, scale = rope_inv_freq(self.config, seq_len)
                return inv_freq.to(device), scale
            if r["rope_type"] == "longrope":  # two tables: short and long factors
                key = (device, seq_len > r["original_max_position_embeddings"])
                seq_len = seq_len if key[1] else None
        if key not in self._cache:
            inv_freq, scale = rope_inv_freq(self.config, seq_len if len(key) > 1 else None)
            self._cache[key] = (inv_freq.to(device), scale)
        return self._cache[key]

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (B, T) -> cos, sin (B, T, hd) in `dtype` (the residual stream's, as HF)."""
        inv_freq, scale = self.inv_freq(position_ids)
        freqs = position_ids[..., None].float() * inv_freq  # (B, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, hd): rotate-half layout
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the last dim: HF's RoPE layout (not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, to: torch.dtype | None = None) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in three passes over x, the same bits as that written-out
    form (a + (-b) is a - b in IEEE arithmetic). With `to` (the input's dtype), the rotation back
    instead, which is the gradient: g * cos + (u2, -u1) for u = g * sin, each product cast to `to`
    before the sum, as autograd does for a bf16 input under fp32 tables."""
    # halves by `chunk`, a method of C++ (`split` goes through a Python wrapper: a decoding step is
    # short enough for that to show)
    (x1, x2), (s1, s2) = x.chunk(2, dim=-1), sin.chunk(2, dim=-1)
    if to is None:
        y = x * cos
        y1, y2 = y.chunk(2, dim=-1)
        y1.sub_(x2 * s1)
        y2.add_(x1 * s2)
        return y
    y = (x * cos).to(to)
    y1, y2 = y.chunk(2, dim=-1)
    y1.add_((x2 * s2).to(to))
    y2.sub_((x1 * s1).to(to))
    return y


class _Rotary(torch.autograd.Function):
    """RoPE with a backward of its own, `_rotate` both ways, saving only cos / sin. Autograd's
    graph of the written-out form makes the rotated halves, their concatenation and a sum of two
    full-size products in each direction; this makes the products and sums in place."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos, sin, to=ctx.dtype), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hd), cos/sin (B, T, hd) -> rotated x, `x * cos + rotate_half(x) * sin`
    (as HF, to the bit). Also x (N, heads, hd) with cos/sin (N, hd): an unpadded batch."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd)
    # Written out under torch.compile, which fuses it anyway: with `_Rotary` in the per-block graph,
    # torch 2.11 (CUDA) held 1.30 GB more at the peak of LoRA SFT on a Llama-3-8B shape (H100,
    # BENCHMARKS.md). And for tables that require grad, which ours never do.
    if torch.compiler.is_compiling() or cos.requires_grad or sin.requires_grad:
        return x * cos + rotate_half(x) * sin
    if not torch.is_grad_enabled():  # (generation: no graph, so no autograd.Function call to pay for)
        return _rotate(x, cos, sin)
    return _Rotary.apply(x, cos, sin)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hd), cos/sin (B, T, rd) with rd <= hd: rotate the first rd dims, keep the rest.
    Also x (N, heads, hd) with cos/sin (N, rd): an unpadded batch."""
    rd = cos.shape[-1]
    return torch.cat([apply_rotary(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)


# --------------------------------------------------------------------------------------------
# KV cache and attention masks
# --------------------------------------------------------------------------------------------


class KVCache:
    """Keys and values of every layer for incremental decoding, preallocated to `max_len` slots.

    Layout: `keys[i]`, `values[i]`: (B, Hkv, max_len, hd) for layer i, after RoPE; slots
    `[0, length)` are filled. `mask`: (B, max_len) bool, True where the slot holds a real token
    (False for padding). Tensors are allocated on the first write, with the dtype and device of
    the keys that layer produces. One forward call appends T slots to every layer, then
    `length += T`. `states[i]`: a recurrent layer's state instead (linear attention: its convolution
    window and recurrent state), a tuple of tensors whose first dim is the batch, which the layer
    replaces at each call.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.states: dict[int, tuple[torch.Tensor, ...]] = {}
        self.mask: torch.Tensor | None = None

    def begin(self, valid: torch.Tensor) -> torch.Tensor:
        """Record the new tokens' mask (B, T); return the mask of all keys so far (B, length+T)."""
        B, T = valid.shape
        if self.length + T > self.max_len:
            raise ValueError(f"KVCache: {self.length} + {T} tokens exceed max_len={self.max_len} — make it larger")
        if self.mask is None:
            self.mask = torch.zeros(B, self.max_len, dtype=torch.bool, device=valid.device)
        self.mask[:, self.length : self.length + T] = valid
        return self.mask[:, : self.length + T]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, hd) at the current slots; return all keys/values (B, Hkv, S, hd)."""
        B, Hkv, T, hd = k.shape
        if layer not in self.keys:
            self.keys[layer] = k.new_zeros(B, Hkv, self.max_len, hd)
            self.values[layer] = v.new_zeros(B, Hkv, self.max_len, hd)
        end = self.length + T
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def end(self, n_new: int) -> None:
        self.length += n_new

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` (1-D, in that order): decoding goes on without finished rows."""
        for store in (self.keys, self.values):
            for layer, t in store.items():
                store[layer] = t.index_select(0, index)
        for layer, state in self.states.items():
            self.states[layer] = tuple(t.index_select(0, index) for t in state)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)

    def repeat_rows(self, n: int) -> None:
        """Each row's slots repeated n times in its place (row i -> rows i*n .. i*n+n-1): a prompt
        prefilled once, then continued n ways (GRPO's G completions of one prompt)."""
        for store in (self.keys, self.values):
            for layer, t in store.items():
                store[layer] = t.repeat_interleave(n, dim=0)
        for layer, state in self.states.items():
            self.states[layer] = tuple(t.repeat_interleave(n, dim=0) for t in state)
        if self.mask is not None:
            self.mask = self.mask.repeat_interleave(n, dim=0)


def attention_mask_4d(key_valid: torch.Tensor, q_start: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean SDPA mask (B, 1, T, S), True = may attend: causal, not padding, inside the window.

    key_valid (B, S): which key slots hold real tokens; the T queries sit at slots
    [q_start, S). Each query also sees itself, so a padding query's row is never empty
    (an all-False row makes SDPA return NaN, which would poison sums over the batch);
    padding outputs are garbage either way and never reach real tokens.
    """
    S = key_valid.shape[1]
    device = key_valid.device
    if q_start == S - 1 and sliding_window is None:  # one new token (decoding): every real key, and itself
        allowed = key_valid.clone()
        allowed[:, -1] = True
        return allowed[:, None, None]  # (B, 1, 1, S)
    q_idx = torch.arange(q_start, S, device=device)[:, None]  # (T, 1)
    kv_idx = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = kv_idx <= q_idx  # (T, S) causal
    if sliding_window is not None:
        allowed = allowed & (kv_idx > q_idx - sliding_window)
    allowed = allowed[None] & key_valid[:, None, :]  # (B, T, S)
    allowed = allowed | (kv_idx == q_idx)[None]
    return allowed[:, None]  # (B, 1, T, S)


def image_blocks(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """(B, T) -> each token's image block: runs of `image_token_id` numbered 0, 1, ... in each row, -1 for text
    (transformers' `get_block_sequence_ids_for_mask` of the processor's `token_type_ids` / `mm_token_type_ids`)."""
    is_image = input_ids == image_token_id
    starts = is_image & ~F.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, starts.long().cumsum(1) - 1, -1)


def image_masks(valid: torch.Tensor, blocks: torch.Tensor, windows: Collection[int | None],
                both_ways: Collection[int | None] | None = None) -> dict[int | None, torch.Tensor]:
    """Per sliding window (None: global), the bool (B, 1, T, T) mask of a forward with images, True = may
    attend: (causal or, for the windows in `both_ways` (default: every one), the same image block) and a real
    key and (with a window) fewer than `window` slots back; every position sees itself (no empty row).
    Gemma 3 lets an image's tokens see each other both ways in every layer; Gemma 4 in its sliding layers only."""
    T = blocks.shape[1]
    i = torch.arange(T, device=blocks.device)
    causal = (i[None, :] <= i[:, None])[None] & valid[:, None, :]  # (B, T, T)
    same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    out = {}
    for w in windows:
        m = causal | same & valid[:, None, :] if both_ways is None or w in both_ways else causal
        if w is not None:
            m = m & (i[None, :] > i[:, None] - w)
        out[w] = (m | (i[None, :] == i[:, None]))[:, None]
    return out


@dataclass(frozen=True)
class Ragged:
    """An unpadded batch's layout, given to the layers in place of a mask: the batch's sequences
    laid end to end as the rows of one (N, ...) tensor, sequence i at rows [sum(lengths[:i]),
    sum(lengths[:i + 1])). Each attends causally to itself only, inside `window` when set.

    The LLaMA, Gemma and Phi-3 models use it on a CPU for a padded batch (`unpadded_lengths`,
    `forward_unpadded`): the linears, norms, RoPE and MLP then see the N real tokens instead of
    B x T positions (a quarter of the bench's SFT positions are padding), and attention runs per
    sequence with SDPA's causal kernel, which skips the blocks above the diagonal that an explicit
    mask makes it compute. Real tokens get the padded batch's values (to float rounding); padding
    positions come out as zeros. Not on CUDA: there a Python loop over sequences would defeat the
    per-block compile (a graph per set of lengths), and padding is what length grouping removes.

    `prefixes`: rows of several sequences with a shared prefix (`document_runs`: DPO's and the reward
    model's [prompt, chosen, rejected], GRPO's [prompt, completions]): per sequence, the index of the
    sequence it also sees before its own tokens (its prompt, whose positions its own continue), -1
    none; empty: none does.
    """

    lengths: tuple[int, ...]
    window: int | None = None
    prefixes: tuple[int, ...] = ()

    def seen(self, i: int, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """What sequence i's queries may read of a per-sequence split (`parts`): its prefix's, then its own."""
        j = self.prefixes[i] if self.prefixes else -1
        return parts[i] if j < 0 else torch.cat([parts[j], parts[i]])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attention: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """q (N, H, hd), k / v (N, Hkv, hd) -> (N, H, hd): attention over each sequence alone (and its
        prefix). `attention(q, k, v, mask)` on (1, H, n, hd) tensors, mask None (causal) or bool
        (1, 1, n, m) (a prefix, or a window shorter than the sequence); default SDPA."""
        attention = attention or sdpa
        n_rep, out = q.shape[1] // k.shape[1], []
        # `split`, not slices: its backward is one concatenation, where each slice's would fill a
        # zero tensor the size of the whole batch and add into it
        k_parts, v_parts = k.split(self.lengths), v.split(self.lengths)
        for i, qs in enumerate(q.split(self.lengths)):
            ks, vs = self.seen(i, k_parts), self.seen(i, v_parts)
            n, m = qs.shape[0], ks.shape[0]  # query j is key m - n + j
            qs, ks, vs = (t.transpose(0, 1)[None] for t in (qs, ks, vs))  # (1, heads, n | m, hd)
            ks, vs = repeat_kv(ks, n_rep), repeat_kv(vs, n_rep)
            mask = None  # causal, unless a prefix comes first or a window is shorter than the sequence
            if m > n or (self.window is not None and m > self.window):
                at = torch.arange(m - n, m, device=q.device)[:, None]  # (n, 1) each query's index among the keys
                key = torch.arange(m, device=q.device)[None]
                mask = key <= at
                if self.window is not None:
                    mask = mask & (at - key < self.window)
                mask = mask[None, None]
            out.append(attention(qs, ks, vs, mask)[0].transpose(0, 1))
        return torch.cat(out)


@dataclass(frozen=True)
class Queries:
    """The last layer of an unpadded forward read at some positions only (a reward model's score):
    given in place of a mask, with x the M read positions' rows (M, D) only, so the layer's query path,
    attention output, residual and MLP run for those rows alone. `keys` (N, D) is the layer's normed
    input at every real token (`layout`'s, end to end), with `cos` / `sin` (N, hd): what its keys and
    values are made of. `reads`: each read's (sequence, position within the sequence's own tokens)."""

    layout: Ragged
    reads: tuple[tuple[int, int], ...]
    keys: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attention: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """q (M, H, hd), k / v (N, Hkv, hd) -> (M, H, hd): each query over its sequence's keys (after its
        prefix's) up to its position (inside the window). `attention(q, k, v, mask)` as `Ragged.attend`'s."""
        attention = attention or sdpa
        lay = self.layout
        n_rep, out = q.shape[1] // k.shape[1], []
        k_parts, v_parts = k.split(lay.lengths), v.split(lay.lengths)
        for i, (s, p) in enumerate(self.reads):
            ks, vs = lay.seen(s, k_parts), lay.seen(s, v_parts)
            at = ks.shape[0] - lay.lengths[s] + p  # the query's index among the keys
            lo = 0 if lay.window is None else max(0, at + 1 - lay.window)  # the keys the query may see
            qs = q[i : i + 1].transpose(0, 1)[None]  # (1, H, 1, hd)
            ks, vs = (repeat_kv(t[lo : at + 1].transpose(0, 1)[None], n_rep) for t in (ks, vs))  # (1, H, n, hd)
            # all True, not None: SDPA's causal mask is aligned top-left (one query would see one key)
            mask = torch.ones(1, 1, 1, at + 1 - lo, dtype=torch.bool, device=q.device)
            out.append(attention(qs, ks, vs, mask)[0].transpose(0, 1))
        return torch.cat(out)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         scale: float | None = None) -> torch.Tensor:
    """SDPA with a bool mask (True = may attend), or causal when the mask is None."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


def forward_unpadded(x: torch.Tensor, valid: torch.Tensor, layout: Ragged,
                     layers: Sequence[tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], int | None]],
                     norm: nn.Module, read_at: torch.Tensor | None = None,
                     additions: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """A padded batch's layer loop without its padding (see `Ragged`): x (B, T, D) the embedded
    batch, `layout` its real tokens' sequences in row-major order (its window unset), `layers` (layer,
    (cos, sin) (B, T, hd), window) in order -> hidden (B, T, D) after `norm`, zeros at the padding.
    Each layer gets x (N, D), its tables (N, hd) and the layout with its window; `additions[i]` (B, T, D),
    when given, is added to layer i's output (`DecoderBody.forward`).

    `read_at` (B,) or (B, K): real positions of each row -> hidden (B, D) or (B, K, D) at those
    positions; the last layer then gets those rows only and a `Queries` (see `reads_at_positions`)."""
    B, T, D = x.shape
    real = valid.flatten().nonzero().squeeze(1)  # (N,) row-major: each row's tokens in order
    h = x.flatten(0, 1)[real]  # (N, D)
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # each distinct table gathered once
    for i, (layer, (cos, sin), window) in enumerate(layers):
        if id(cos) not in tables:
            tables[id(cos)] = cos.flatten(0, 1)[real], sin.flatten(0, 1)[real]
        cos_n, sin_n = tables[id(cos)]
        at_window = dataclasses.replace(layout, window=window)
        if read_at is not None and i == len(layers) - 1:
            flat = (torch.arange(B, device=x.device)[:, None] * T + read_at.reshape(B, -1)).flatten()
            rows = torch.searchsorted(real, flat)  # (M,) into the N rows
            lengths = torch.tensor(layout.lengths, device=x.device)
            starts = lengths.cumsum(0) - lengths
            seqs = torch.searchsorted(starts, rows, right=True) - 1
            reads = tuple(zip(seqs.tolist(), (rows - starts[seqs]).tolist()))
            keys = Queries(at_window, reads, layer.input_layernorm(h), cos_n, sin_n)
            return norm(layer(h[rows], cos_n[rows], sin_n[rows], keys)).view(*read_at.shape, D)
        h = layer(h, cos_n, sin_n, at_window)
        if i < len(additions):
            h = h + additions[i].flatten(0, 1)[real]
    out = h.new_zeros(B, T, D)  # written through a (B * T, D) view, so the result is no view (FSDP2 warns of one)
    out.view(B * T, D).index_copy_(0, real, norm(h))
    return out


def reads_at_positions(layer: nn.Module) -> bool:
    """Whether a layer can run for some positions only (`Queries`): the floor's `Attention` as its
    `self_attn` after an `input_layernorm` (HF's names), the rest of the block row by row. Not a
    linear-attention layer (Qwen3.5's DeltaNet: a recurrent state runs over every token)."""
    return isinstance(getattr(layer, "self_attn", None), Attention) and hasattr(layer, "input_layernorm")


# Below this many positions per row, `Ragged`'s loop over sequences costs more than the padding it
# skips (a GRPO batch of 32 rows x 26 positions, 29% padding: 44 ms CPU for forward + backward
# unpadded, 36 ms padded; 16 x 64: level; 4 x 384: 62 against 99).
RAGGED_MIN_LENGTH = 32


def unpadded_lengths(valid: torch.Tensor, padded: bool, cache: "KVCache | None") -> tuple[int, ...] | None:
    """The `Ragged` lengths when a forward runs without its padding: a padded batch on a CPU of rows
    of at least `RAGGED_MIN_LENGTH` positions, no KV cache, each row's real tokens one run
    (`ragged_lengths`); else None (the padded path)."""
    if not padded or cache is not None or valid.device.type != "cpu" or valid.shape[1] < RAGGED_MIN_LENGTH:
        return None
    return ragged_lengths(valid)


def ragged_lengths(valid: torch.Tensor) -> tuple[int, ...] | None:
    """valid (B, T) bool -> each row's count of real tokens (empty rows left out), or None when
    some row's real tokens are not one contiguous run (left or right padding, or both, are)."""
    changes = (valid[:, 1:] != valid[:, :-1]).sum(1)
    if bool(((changes > 2) | ((changes == 2) & valid[:, 0])).any()):
        return None
    return tuple(n for n in valid.sum(1).tolist() if n)


def document_runs(document_ids: torch.Tensor, position_ids: torch.Tensor) -> Ragged | None:
    """Rows of several sequences (`document_mask_mod`'s ids) as the `Ragged` layout of their real tokens
    in row-major order: per row its prefix (id 0) and each document, a document with the row's prefix
    seeing it (`prefixes`). None where the per-sequence loop does not apply: a CPU forward only; in each
    row the prefix one run before every document, each document one run, positions counting up by one
    within a run and a document's continuing its prefix's (so that index distances are position
    distances, as windows need); sequences of `RAGGED_MIN_LENGTH` tokens or more on average (below,
    the loop costs more than the dense mask)."""
    if document_ids.device.type != "cpu":
        return None
    lengths, prefixes = [], []
    for ids, pos in zip(document_ids.tolist(), position_ids.tolist()):
        prefix, last, seen, t = -1, 0, set(), 0  # last: the prefix's last position
        while t < len(ids):
            d, u = ids[t], t + 1
            while u < len(ids) and ids[u] == d:
                u += 1
            if d >= 0:
                if d in seen or (d == 0 and seen) or any(pos[w + 1] != pos[w] + 1 for w in range(t, u - 1)):
                    return None
                if d == 0:
                    prefix, last = len(lengths), pos[u - 1]
                elif prefix >= 0 and pos[t] != last + 1:
                    return None
                seen.add(d)
                lengths.append(u - t)
                prefixes.append(prefix if d > 0 else -1)
            t = u
    if not lengths or sum(lengths) < RAGGED_MIN_LENGTH * len(lengths):
        return None
    return Ragged(tuple(lengths), prefixes=tuple(prefixes) if max(prefixes) >= 0 else ())


# --------------------------------------------------------------------------------------------
# Rows of several sequences: document ids, their dense mask, FlexAttention
# --------------------------------------------------------------------------------------------

# how rows of several sequences attend (the model's `packed_attention`): a dense bool mask through
# SDPA, or FlexAttention with a block mask built from the rows' document ids
PACKED_ATTENTION = ("sdpa", "flex")


def document_mask_mod(document_ids: torch.Tensor, position_ids: torch.Tensor,
                      window: int | None) -> Callable[..., torch.Tensor]:
    """The attention rule of rows of several sequences, as FlexAttention's `mask_mod(b, h, q, k)`.

    document_ids (B, T) long: -1 padding; 0 the row's shared prefix (DPO's prompt in the shared-
    prompt layout, GRPO's prompt), which every document of the row also sees; 1, 2, ...: documents
    (packed examples, DPO's chosen / rejected answers, GRPO's completions), each seeing itself and
    the prefix. Key k is visible from query q when k <= q, q is real, k is in q's document or in
    the prefix and (with `window`) their positions (B, T) are less than `window` apart, as in each
    sequence alone; every position also sees itself, so a padding row is never empty (no NaN).
    Only indexing and comparisons: on broadcast index grids it gives the dense mask (`document_mask`).
    """
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        dq, dk = document_ids[b, q], document_ids[b, k]
        allowed = (k <= q) & (dq >= 0) & ((dk == dq) | (dk == 0))
        if window is not None:
            allowed = allowed & (position_ids[b, q] - position_ids[b, k] < window)
        return allowed | (q == k)

    return mask_mod


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) -> each token's index in its run of equal document ids (packed rows: its position in its
    sequence), what windows and layouts read where a model's RoPE positions are not token counts
    (Qwen's 3-D M-RoPE over images)."""
    T = document_ids.shape[1]
    t = torch.arange(T, device=document_ids.device).expand_as(document_ids)
    start = torch.ones_like(document_ids, dtype=torch.bool)
    start[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return t - torch.where(start, t, 0).cummax(dim=1).values


def document_mask(document_ids: torch.Tensor, position_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """`document_mask_mod` as a dense bool (B, 1, T, T) mask, True = may attend (the SDPA path)."""
    B, T = document_ids.shape
    i = torch.arange(T, device=document_ids.device)
    b = torch.arange(B, device=document_ids.device)[:, None, None]
    return document_mask_mod(document_ids, position_ids, window)(b, 0, i[None, :, None], i[None, None, :])[:, None]


@dataclass(frozen=True)
class Documents:
    """Rows of several sequences given to the layers in place of a dense mask, for FlexAttention:
    the `BlockMask` of `document_mask_mod` (`build`, once per forward and window, shared by the
    layers). FlexAttention visits only the (128 x 128) blocks where some key is visible, so the
    blocks of other documents, above the diagonal and of padding cost nothing, and the layers read
    no (T, T) mask; SDPA with an explicit mask computes every block and on CUDA cannot use its flash
    kernels. (torch's eager `create_block_mask` evaluates the rule into a transient (B, 1, T, T) bool
    on the device to find the blocks: once per forward and window, on the device, then freed.)

    On CUDA it is fast under torch.compile (the engine compiles each block); eager it runs an
    unfused reference. On a CPU, torch's FlexAttention has a forward only (inputs that require
    grad are refused), so training there uses the dense mask. `torch.nn.attention.flex_attention`
    imports torch._dynamo: it is imported here, when a `Documents` is built, never at import time.
    """

    block_mask: Any  # torch.nn.attention.flex_attention.BlockMask

    @classmethod
    def build(cls, document_ids: torch.Tensor, position_ids: torch.Tensor, window: int | None) -> "Documents":
        from torch.nn.attention.flex_attention import create_block_mask

        B, T = document_ids.shape
        mask_mod = document_mask_mod(document_ids, position_ids, window)
        return cls(create_block_mask(mask_mod, B, None, T, T, device=document_ids.device))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               cap: float | None = None) -> torch.Tensor:
        """q (B, H, T, hd), k / v (B, Hkv, T, hd) -> (B, H, T, hd); the shared heads read in place.
        `scale` default 1/sqrt(hd); `cap`: scores soft-capped, `cap * tanh(s / cap)` (Gemma 2)."""
        from torch.nn.attention.flex_attention import flex_attention

        device = q.device.type
        if torch.is_autocast_enabled(device):  # as SDPA under autocast: q, k, v in its dtype (an fp32 residual
            dtype = torch.get_autocast_dtype(device)  # stream rotates q / k in fp32; older torch's flex has
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)  # no autocast rule, and wants one dtype)
        score_mod = None
        if cap is not None:
            def score_mod(score, b, h, q_idx, kv_idx):  # applied to the scaled scores, before the mask
                return cap * torch.tanh(score / cap)
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=self.block_mask, scale=scale,
                              enable_gqa=q.shape[1] != k.shape[1])


def row_masks(mask: torch.Tensor | None, position_ids: torch.Tensor, document_ids: torch.Tensor | None,
              windows: Iterable[int | None], flex: bool) -> dict[int | None, "torch.Tensor | Documents"]:
    """What the layers of each distinct window get for rows of several sequences: a `Documents`
    (`flex`, from `document_ids`), else a dense bool (B, 1, T, T): the caller's 4-D `mask`, or
    `document_mask` of `document_ids` without one, narrowed to the window on positions."""
    if document_ids is not None:
        document_ids = document_ids.to(position_ids.device)
    if flex:
        if document_ids is None:
            raise ValueError("packed_attention='flex' needs document_ids (B, T) — a dense 4-D mask does not say "
                             "which sequence each token is in; pass the collator's document_ids")
        return {w: Documents.build(document_ids, position_ids, w) for w in windows}
    if mask is None:
        return {w: document_mask(document_ids, position_ids, w) for w in windows}
    mask = mask.to(device=position_ids.device, dtype=torch.bool)
    apart = position_ids[:, None, :, None] - position_ids[:, None, None, :]  # (B, 1, T, T)
    return {w: mask if w is None else mask & (apart < w) for w in windows}


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, S, hd) -> (B, Hkv * n_rep, S, hd): query head h reads key/value head h // n_rep."""
    if n_rep == 1:
        return x
    B, Hkv, S, hd = x.shape
    return x[:, :, None].expand(B, Hkv, n_rep, S, hd).reshape(B, Hkv * n_rep, S, hd)


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) over the allowed keys: q (B, H, T, hd), k (B, H, S, hd), `mask`
    a bool (B, 1, T, S) (True = may attend) or None (causal) -> (B, H, T, S), fp32 (HF's eager
    attention, whose softmax is fp32 too). Only for layers whose probabilities are asked for:
    it holds the (T, S) scores that SDPA never materialises."""
    scores = torch.matmul(q, k.transpose(-2, -1)).float() / math.sqrt(q.shape[-1])  # (B, H, T, S)
    if mask is None:  # causal, the T queries being the last T of the S keys
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           return_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(attention output (B, H, T, hd), None) through SDPA (scale 1/sqrt(hd), as in HF; `mask`
    None: causal); with `return_probs`, written out so that the probabilities exist (attention
    transfer): (output, `attention_probs` (B, H, T, S) fp32). q (B, H, T, hd), k / v (B, H, S, hd)."""
    if not return_probs:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None), None
    probs = attention_probs(q, k, mask)
    return torch.matmul(probs.to(v.dtype), v), probs



def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): smooth, bounded to (-cap, cap), about x for |x| << cap."""
    return torch.tanh(x / cap) * cap


def capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, cap: float
) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap) masked) v, the softmax in fp32 (as HF's eager path).

    q (B, H, T, hd), k / v (B, H, S, hd), mask (B, 1, T, S) bool or None (causal, the T queries
    being the last T of the S keys) -> (B, H, T, hd). Holds the (B, H, T, S) scores.
    """
    return torch.matmul(scaled_attention_probs(q, k, mask, scale, cap).to(q.dtype), v)


def scaled_attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
                           cap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The attention probabilities (B, H, T, S) fp32: softmax of the scores q k^T * scale, soft-capped
    when `cap` is set, over the allowed keys (`mask` as `capped_attention`'s), zero elsewhere.

    `sinks` (H,): gpt-oss's attention sinks, one learned logit per head that joins each row's
    softmax as an extra column and is then dropped, so a row's probabilities sum to less than one
    (the rest went to "nothing"). As transformers, the row's max is subtracted first (the sink
    included), and the softmax runs in the scores' dtype."""
    T, S = q.shape[2], k.shape[2]
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # (B, H, T, S)
    if cap is not None:
        scores = softcap(scores, cap)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    scores = scores.masked_fill(~mask, float("-inf"))  # every row keeps at least its own key
    if sinks is None:
        return scores.softmax(-1, dtype=torch.float32)
    sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, T, 1).to(scores.dtype)
    combined = torch.cat([scores, sink], dim=-1)  # (B, H, T, S + 1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return combined.softmax(-1, dtype=combined.dtype)[..., :-1].float()


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


class Attention(nn.Module):
    """Grouped-query attention with RoPE over unfused q/k/v projections (HF names, LoRA-swappable).

    What the families vary is a field: biases on q/k/v (`qkv_bias`) and on o (`o_bias`); a norm
    over each query and key head before RoPE (`qk_norm`: Qwen3, Gemma 3); the score scale
    (`scaling`, None = 1/sqrt(hd); Gemma's `query_pre_attn_scalar ** -0.5`); soft-capped scores
    (`cap`, Gemma 2); attention sinks (`sinks`, gpt-oss: a learned logit per head, `self.sinks`).
    An output gate (`output_gate`, Qwen3.5): q_proj yields a query and a gate per head, (hd | hd),
    and the attention output is scaled by sigmoid(gate) before o_proj.
    A layer with a cap or sinks runs its attention written out (scores in memory: B x H x T x S),
    since SDPA cannot apply a function between the scores and the softmax; the others run SDPA.
    A family whose projections differ (Phi-3's fused `qkv_proj`) passes them as `projections`
    ({name: module}, registered where q/k/v would be) and overrides `project`.
    """

    rotate = staticmethod(apply_rotary)  # Phi-3: `apply_partial_rotary`

    def __init__(self, hidden_size: int, n_heads: int, n_kv: int, head_dim: int, layer_idx: int, *,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm: Callable[[int], nn.Module] | None = None,
                 scaling: float | None = None, cap: float | None = None, sinks: bool = False,
                 projections: dict[str, nn.Module] | None = None, output_gate: bool = False) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.scaling, self.cap, self.output_gate = scaling, cap, output_gate
        D, hd = hidden_size, head_dim
        if projections is None:
            self.q_proj = nn.Linear(D, n_heads * hd * (2 if output_gate else 1), bias=qkv_bias)
            self.k_proj = nn.Linear(D, n_kv * hd, bias=qkv_bias)
            self.v_proj = nn.Linear(D, n_kv * hd, bias=qkv_bias)
        for name, module in (projections or {}).items():  # a family's own (fused) input projections
            self.add_module(name, module)
        self.o_proj = nn.Linear(n_heads * hd, D, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(hd)
            self.k_norm = qk_norm(hd)
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(n_heads))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., D) -> q (..., H, hd), k and v (..., Hkv, hd), the q/k norms applied; with the
        output gate, also the gate (..., H, hd)."""
        q = self.q_proj(x).unflatten(-1, (self.n_heads, -1))  # (..., H, hd), or (..., H, 2 hd): query | gate
        gate = None
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
        k = self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        if hasattr(self, "q_norm"):  # per-head norms (Qwen3, Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        return (q, k, v) if gate is None else (q, k, v, gate)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        return_probs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> (B, T, D). `mask` (B, 1, T, S) bool, or None for plain causal attention.
        `return_probs`: also the attention probabilities (B, H, T, S) fp32. A `Ragged` mask: x (N, D)
        holds the batch's real tokens end to end, cos / sin (N, hd). A `Documents` mask: rows of
        several sequences through FlexAttention (a cap as its `score_mod`)."""
        if isinstance(mask, Queries):  # x: the read rows (M, D); keys and values from every token's (N, D)
            q, _, _, *gate = self.project(x)  # (M, H, hd)
            _, k, v, *_ = self.project(mask.keys)  # (N, Hkv, hd)
            q, k = self.rotate(q, cos, sin), self.rotate(k, mask.cos, mask.sin)
            return self.o_proj(self._gated(mask.attend(q, k, v, self._attention).flatten(1), gate))
        q, k, v, *gate = self.project(x)  # (B, T, H, hd), (B, T, Hkv, hd) x 2[, the gate (B, T, H, hd)]
        if isinstance(mask, Ragged):  # (N, heads, hd): RoPE per token, then attention per sequence
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
            return self.o_proj(self._gated(mask.attend(q, k, v, self._attention).flatten(1), gate))
        B, T, _ = x.shape
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        n_rep = self.n_heads // self.n_kv
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, S, hd)
        plain = self.cap is None and not hasattr(self, "sinks")  # SDPA can run it
        if isinstance(mask, Documents):  # FlexAttention reads the shared heads in place
            if hasattr(self, "sinks"):
                raise ValueError("attention sinks have no FlexAttention path — use packed_attention='sdpa'")
            y, probs = mask.attend(q, k, v, self.scaling, self.cap), None
        elif cache is not None and not return_probs and plain:  # decoding: SDPA reads the shared heads in place
            y, probs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_rep > 1,
                                                      scale=self.scaling), None
        else:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, S, hd)
            if not return_probs:
                y, probs = self._attention(q, k, v, mask), None
            elif plain and self.scaling is None:
                y, probs = attend(q, k, v, mask, return_probs=True)
            else:  # written out, so the probabilities exist (attention transfer)
                probs = self._probs(q, k, mask)
                y = torch.matmul(probs.to(v.dtype), v)
        y = self.o_proj(self._gated(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim), gate))
        return (y, probs) if return_probs else y

    @staticmethod
    def _gated(y: torch.Tensor, gate: list[torch.Tensor]) -> torch.Tensor:
        """y (..., H hd) times sigmoid(gate) when `project` gave a gate (the output gate), else y."""
        return y * torch.sigmoid(gate[0].flatten(-2)) if gate else y

    def _probs(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The written-out attention probabilities (B, H, T, S) fp32 at this layer's scale, cap and sinks."""
        scale = self.scaling if self.scaling is not None else self.head_dim**-0.5
        return scaled_attention_probs(q, k, mask, scale, self.cap, getattr(self, "sinks", None))

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """(B, H, T, hd), k / v (B, H, S, hd) -> (B, H, T, hd): SDPA at this layer's scale, or written
        out when the scores are capped or a sink joins the softmax."""
        if self.cap is None and not hasattr(self, "sinks"):
            return sdpa(q, k, v, mask, scale=self.scaling)
        return torch.matmul(self._probs(q, k, mask).to(q.dtype), v)


# --------------------------------------------------------------------------------------------
# MLP
# --------------------------------------------------------------------------------------------

# HF's activation names -> the function (the gated MLPs' gate activation)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """HF's activation `name` as a function; a name we do not know is a ValueError."""
    if name not in ACTIVATIONS:
        raise ValueError(f"config.json: activation {name!r} is not supported — use one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with `act="silu"` (LLaMA), GeGLU with
    `"gelu_pytorch_tanh"` (Gemma); biases when `bias` (LLaMA's `mlp_bias`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        D, F_ = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(D, F_, bias=bias)
        self.up_proj = nn.Linear(D, F_, bias=bias)
        self.down_proj = nn.Linear(F_, D, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


# --------------------------------------------------------------------------------------------
# Mixture of experts: router, experts, the sparse block
# --------------------------------------------------------------------------------------------


class Router(nn.Module):
    """Top-k routing of each token to K of E experts (HF's `mlp.gate`; gpt-oss's `mlp.router`).

    `scoring="softmax"` (Qwen-MoE, Mixtral): a softmax over all E logits in fp32, the K largest,
    renormalised to sum to one when `norm_topk_prob` (Mixtral always: a softmax over its top K);
    the weights are cast back to the logits' dtype when `cast_back` (Qwen), kept fp32 otherwise
    (Mixtral). `scoring="topk_softmax"` (gpt-oss): the K largest logits, then a softmax over them.
    forward: x (N, D) -> (logits (N, E), weights (N, K), indices (N, K)), as transformers' routers
    return them. Not an `nn.Linear`, so a LoRA target list never wraps it (train it whole, or not).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, scoring: str = "softmax",
                 norm_topk_prob: bool = False, cast_back: bool = True, bias: bool = False) -> None:
        super().__init__()
        if scoring not in ("softmax", "topk_softmax"):
            raise ValueError(f"router scoring {scoring!r} — use 'softmax' or 'topk_softmax'")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"config.json: num_experts_per_tok={top_k} — use 1..num_experts ({num_experts})")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if bias:
            self.bias = nn.Parameter(torch.empty(num_experts))
        self.in_features, self.out_features = hidden_size, num_experts  # as a Linear's (a FLOP count reads them)
        self.top_k, self.scoring, self.norm_topk_prob, self.cast_back = top_k, scoring, norm_topk_prob, cast_back

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, getattr(self, "bias", None))  # (N, E)
        if self.scoring == "topk_softmax":
            top, indices = torch.topk(logits, self.top_k, dim=-1)  # (N, K)
            return logits, top.softmax(dim=-1, dtype=top.dtype), indices
        probs = logits.float().softmax(dim=-1)  # (N, E) fp32
        top, indices = torch.topk(probs, self.top_k, dim=-1)  # (N, K)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, (top.to(logits.dtype) if self.cast_back else top), indices

    def extra_repr(self) -> str:
        E, D = self.weight.shape
        return f"{D} -> {E} experts, top {self.top_k}, {self.scoring}{', renormalised' if self.norm_topk_prob else ''}"


class LowRank(NamedTuple):
    """A per-expert low-rank term beside a grouped product: expert e adds `scaling * x A[e]^T B[e]^T`,
    a (E, r, in), b (E, out, r) (an expert adapter's factors, `minitrain.adapters.lora_experts`, which returns
    them as a plain `(a, b, scaling)` tuple: the engine never imports models/)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None,
                   bias: torch.Tensor | None = None, in_out: bool = False,
                   low_rank: LowRank | None = None) -> torch.Tensor:
    """One grouped product: rows of x (M, in) sorted by expert, `counts[e]` rows for expert e, each
    group times its expert's matrix -> (M, out), plus `low_rank`'s term when given.

    weight (E, out, in) (`F.linear`'s layout, Qwen / Mixtral) or, with `in_out`, (E, in, out)
    (gpt-oss); bias (E, out) or None. On CUDA with bf16 operands whose sizes suit it,
    `torch._grouped_mm` runs every group in one kernel (no host sync); elsewhere a loop over the
    experts that received rows (`sizes`: counts as a list, one host sync per layer, made once by the
    caller), each an ordinary matmul: a loop over at most E experts, never over tokens. That loop is
    one autograd node (`_GroupedProduct`: each expert's products written in place into one output,
    the low-rank term added to it, and a backward written out) when its operands share a dtype and
    autocast is off; otherwise each product is its own node."""
    w = weight if in_out else weight.transpose(1, 2)  # (E, in, out)
    if sizes is None and x.is_cuda and _grouped_mm_fits(x, w):
        y = torch._grouped_mm(x, w, offs=counts.cumsum(0).to(torch.int32))  # (M, out)
        if bias is not None:
            y = y + bias.to(y.dtype).repeat_interleave(counts, dim=0, output_size=x.shape[0])
        return y if low_rank is None else y + _low_rank_term(x, counts, sizes, low_rank)
    if sizes is None:
        sizes = counts.tolist()
    a, b, scaling = low_rank if low_rank is not None else (None, None, 0.0)
    one_dtype = len({t.dtype for t in (x, weight, bias, a, b) if t is not None}) == 1
    if one_dtype and not torch.is_autocast_enabled(x.device.type):
        return _GroupedProduct.apply(x, weight, bias, a, b, sizes, in_out, scaling)
    outs = []
    biases = bias.unbind(0) if bias is not None else [None] * len(sizes)
    # `unbind`, not w[e]: its backward is one stack, where each index's would fill a zero tensor the
    # size of every expert's weights
    for n, xe, we, be in zip(sizes, x.split(sizes), weight.unbind(0), biases):
        if n:
            if in_out:
                outs.append(xe @ we + be if be is not None else xe @ we)
            else:
                outs.append(F.linear(xe, we, be))
    y = torch.cat(outs) if outs else x.new_zeros(0, w.shape[-1])
    return y if low_rank is None else y + _low_rank_term(x, counts, sizes, low_rank)


def _low_rank_term(x: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None, low_rank: LowRank) -> torch.Tensor:
    """`low_rank`'s term alone, as two grouped products (the CUDA and autocast paths)."""
    a, b, scaling = low_rank
    z = grouped_linear(x.to(a.dtype), a, counts, sizes) * scaling  # (M, r)
    return grouped_linear(z, b, counts, sizes).to(x.dtype)  # (M, out)


class _GroupedProduct(torch.autograd.Function):
    """The CPU loop of `grouped_linear` as one node. Forward, per expert e with rows (slice s):
    y[s] = x[s] W_e (+ bias_e) (+ scaling (x[s] A_e^T) B_e^T), each product written into y or added to
    it in place (no concatenation, no separate sum); it keeps x and the (M, r) low-rank inputs z.
    Backward, with g = dy[s] and gz = scaling g B_e: dx[s] = g W_e^T + gz A_e, dW_e = g^T x[s] (or
    x[s]^T g), dbias_e = sum g, dB_e = scaling g^T z[s], dA_e = gz^T x[s]; each only when its input
    needs it. An expert without rows gets zero gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, sizes, in_out, scaling):
        out_features = weight.shape[2] if in_out else weight.shape[1]
        y = x.new_empty(x.shape[0], out_features)
        z = None if a is None else x.new_empty(x.shape[0], a.shape[1])
        start = 0
        for e, n in enumerate(sizes):
            if n:
                s = slice(start, start + n)
                torch.mm(x[s], weight[e] if in_out else weight[e].t(), out=y[s])
                if bias is not None:
                    y[s] += bias[e]
                if a is not None:
                    torch.mm(x[s], a[e].t(), out=z[s])
                    y[s].addmm_(z[s], b[e].t(), alpha=scaling)
            start += n
        ctx.save_for_backward(x, weight, a, b, z)
        ctx.sizes, ctx.in_out, ctx.scaling = sizes, in_out, scaling
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, a, b, z = ctx.saved_tensors
        sizes, in_out, scaling = ctx.sizes, ctx.in_out, ctx.scaling
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        dx = x.new_empty(x.shape) if need_x else None
        dw = torch.zeros_like(weight) if need_w else None
        dbias = dy.new_zeros(len(sizes), dy.shape[1]) if need_bias else None
        da = torch.zeros_like(a) if need_a else None
        db = torch.zeros_like(b) if need_b else None
        start = 0
        for e, n in enumerate(sizes):
            if n:
                s = slice(start, start + n)
                g = dy[s]
                if need_x:
                    torch.mm(g, weight[e].t() if in_out else weight[e], out=dx[s])
                if need_w:
                    torch.mm(x[s].t(), g, out=dw[e]) if in_out else torch.mm(g.t(), x[s], out=dw[e])
                if need_bias:
                    torch.sum(g, dim=0, out=dbias[e])
                if a is not None:
                    if need_b:
                        torch.mm(g.t(), z[s], out=db[e]).mul_(scaling)
                    if need_x or need_a:
                        gz = (g @ b[e]).mul_(scaling)  # (n, r)
                        if need_x:
                            dx[s].addmm_(gz, a[e])
                        if need_a:
                            torch.mm(gz.t(), x[s], out=da[e])
            start += n
        return dx, dw, dbias, da, db, None, None, None


def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands: this torch has it, both bf16, the inner and
    outer sizes multiples of 8 (16-byte rows)."""
    return (hasattr(torch, "_grouped_mm") and x.dtype == w.dtype == torch.bfloat16
            and x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0)


class Experts(nn.Module):
    """E gated MLPs as 3-D parameters under transformers 5's names: `gate_up_proj` and `down_proj`.

    Layout "out_in" (Qwen-MoE, Mixtral): gate_up_proj (E, 2F, D), [gate | up] along the output, and
    down_proj (E, D, F); the Hub's files hold one matrix per expert and projection, which the loader
    fills in (`checkpoint_parts`). Layout "in_out" (gpt-oss): gate_up_proj (E, D, 2F) with gate and up
    interleaved (even / odd columns), down_proj (E, F, D), and biases `gate_up_proj_bias` (E, 2F),
    `down_proj_bias` (E, D). The gate: `act(gate) * up` ("silu": SwiGLU), or gpt-oss's clamped
    SwiGLU, `(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)` with g = clamp(gate, max=l), when
    `swiglu_limit` is set.

    forward(x (N, D), indices (N, K), weights (N, K)) -> (N, D): dropless; the N K (token, expert)
    pairs sorted by expert, one grouped product per projection (`grouped_linear`), each pair's
    output times its routing weight, summed back into its token.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, layout: str = "out_in",
                 act: str = "silu", bias: bool = False, swiglu_limit: float | None = None,
                 swiglu_alpha: float | None = None) -> None:
        super().__init__()
        E, D, F_ = num_experts, hidden_size, intermediate_size
        if layout not in ("out_in", "in_out"):
            raise ValueError(f"expert layout {layout!r} — use 'out_in' or 'in_out'")
        self.in_out = layout == "in_out"
        self.num_experts, self.intermediate_size = E, F_
        self.gate_up_proj = nn.Parameter(torch.empty((E, D, 2 * F_) if self.in_out else (E, 2 * F_, D)))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * F_))
        self.down_proj = nn.Parameter(torch.empty((E, F_, D) if self.in_out else (E, D, F_)))
        if bias:
            self.down_proj_bias = nn.Parameter(torch.empty(E, D))
        self.act = activation(act)
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        # projection name -> a module whose call returns a `LowRank` added to that grouped product (or None for
        # nothing): an adapter's per-expert low-rank update (minitrain.adapters.lora_experts)
        self.deltas = nn.ModuleDict()

    # the 3-D parameters an adapter may target, each one grouped product
    expert_projections = ("gate_up_proj", "down_proj")

    def gate(self, h: torch.Tensor) -> torch.Tensor:
        """(M, 2F) from the first product -> (M, F): the gated activation."""
        if self.swiglu_limit is None:
            gate, up = h.chunk(2, dim=-1)
            return self.act(gate) * up
        limit = self.swiglu_limit
        gate, up = h[..., ::2], h[..., 1::2]  # interleaved (gpt-oss)
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))

    def project(self, name: str, x: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
        """The grouped product of projection `name` ("gate_up_proj" / "down_proj") over rows sorted by
        expert, plus `deltas[name]`'s term when an adapter put one there. A projection held in another
        form (a module in the parameter's place: quantized experts) computes its product itself,
        called `(x, counts, sizes)` (out_in layout, no bias)."""
        w = getattr(self, name)
        low_rank = self.deltas[name]() if name in self.deltas else None
        if not isinstance(w, nn.Module):
            return grouped_linear(x, w, counts, sizes, getattr(self, f"{name}_bias", None), self.in_out, low_rank)
        y = w(x, counts, sizes)
        return y if low_rank is None else y + _low_rank_term(x, counts, sizes, low_rank)

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        N, K = indices.shape
        flat = indices.flatten()  # (N K,) the expert of each (token, slot) pair
        order = flat.argsort(stable=True)  # pairs sorted by expert, tokens in order inside each
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,)
        token = order // K  # (N K,) the token of each sorted pair
        grouped = x.is_cuda and _grouped_mm_fits(x, self.gate_up_proj)
        sizes = None if grouped else counts.tolist()  # the CPU loop's group sizes: one host sync
        h = self.project("gate_up_proj", x[token], counts, sizes)  # (N K, 2F)
        y = self.project("down_proj", self.gate(h), counts, sizes)  # (N K, D)
        y = y * weights.flatten()[order, None]
        return x.new_zeros(N, x.shape[-1]).index_add_(0, token, y.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.num_experts} experts, intermediate {self.intermediate_size}, {'in_out' if self.in_out else 'out_in'}"


class SparseMoeBlock(nn.Module):
    """The MLP of a mixture-of-experts layer: a router (`router_name`: HF's `gate`, gpt-oss's
    `router`), the experts, and optionally a shared expert every token goes through, scaled by
    sigmoid(`shared_expert_gate`(x)) (Qwen2-MoE).

    x (..., D) -> (..., D). A forward in training mode keeps its routing in `self.routing` (the
    router's logits (N, E) and top-k indices (N, K), N the rows it saw) for the load-balancing loss
    and the expert-load metrics (`MoeCausalLM.router_aux_loss`, which clears it)."""

    def __init__(self, router: Router, experts: Experts, *, router_name: str = "gate",
                 shared_expert: nn.Module | None = None, shared_expert_gate: nn.Module | None = None) -> None:
        super().__init__()
        self.router_name = router_name
        self.add_module(router_name, router)
        self.experts = experts
        experts.top_k = router.top_k  # the rows each token sends through the experts (a FLOP count reads it)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = shared_expert_gate
        self.routing: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def top_k_router(self) -> Router:
        """The router, whichever HF name it has."""
        return getattr(self, self.router_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])  # (N, D)
        logits, weights, indices = self.top_k_router(h)
        # kept for the loss's routing terms; not by activation checkpointing's recompute, which runs inside
        # the backward: its logits' graph (the block's recomputed activations) would outlive the step
        if self.training and torch._C._current_graph_task_id() == -1:
            self.routing = (logits, indices)
        y = self.experts(h, indices, weights)
        if hasattr(self, "shared_expert"):
            y = y + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return y.reshape(shape)


# --------------------------------------------------------------------------------------------
# Block
# --------------------------------------------------------------------------------------------


# the Hub's per-expert projection names -> the fused parameter's part: "gate" fills gate_up_proj[e, :F],
# "up" gate_up_proj[e, F:], "down" down_proj[e]
QWEN_EXPERT_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def per_expert_keys(ours: str, theirs: str, num_experts: int, expert_size: int,
                    names: dict[str, str] = QWEN_EXPERT_NAMES) -> dict[str, tuple[str, tuple]]:
    """One sparse layer's per-expert checkpoint keys (`{theirs}.experts.{e}.{name}.weight`, the layout the
    Hub's files and transformers 5's `save_pretrained` use) -> (the fused `Experts` parameter under
    `{ours}.experts.`, the index it fills): a model's `checkpoint_parts()`, layer by layer."""
    F_ = expert_size
    halves = {"gate": ("gate_up_proj", slice(0, F_)), "up": ("gate_up_proj", slice(F_, 2 * F_)), "down": ("down_proj", None)}
    parts: dict[str, tuple[str, tuple]] = {}
    for e in range(num_experts):
        for name, half in names.items():
            param, rows = halves[half]
            parts[f"{theirs}.experts.{e}.{name}.weight"] = (f"{ours}.experts.{param}", (e,) if rows is None else (e, rows))
    return parts


class PreNormBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)). The unit the engine checkpoints and
    compiles. A family subclasses it to build its own `self_attn` and `mlp` under HF's names."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 norm: Callable[[int, float], nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm(hidden_size, eps)
        self.post_attention_layernorm = norm(hidden_size, eps)

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
        if return_attention:
            a, probs = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, return_probs=True)
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x)), probs
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------------------------
# Decoder body and causal LM
# --------------------------------------------------------------------------------------------
class Captured(NamedTuple):
    """What a forward with `hidden_layers` / `attention_layers` returns (distillation's features).

    hidden: (B, T, D) after the final norm, as the plain forward returns it; hidden_states:
    {layer i: the output of decoder layer i (B, T, D), the residual stream before any final norm};
    attentions: {layer i: its attention probabilities (B, H, T, S) fp32, padding and future keys 0}.
    """

    hidden: torch.Tensor
    hidden_states: dict[int, torch.Tensor]
    attentions: dict[int, torch.Tensor]


def capture_layers(layers: Sequence[nn.Module], norm: nn.Module, x: torch.Tensor,
                   tables: Sequence[tuple[torch.Tensor, torch.Tensor]], masks: Sequence[torch.Tensor | None],
                   cache: "KVCache | None", hidden_layers: Collection[int],
                   attention_layers: Collection[int], additions: Sequence[torch.Tensor] = ()) -> Captured:
    """A layer loop that keeps the named layers' outputs and attention probabilities (a `Captured`):
    layer i gets x, `tables[i]` (its cos, sin), `masks[i]` and the cache; the layers named in
    `attention_layers` are called with `return_attention=True` and return (x, probabilities);
    `additions[i]` is added to layer i's output."""
    for i in (*hidden_layers, *attention_layers):
        if not 0 <= i < len(layers):
            raise ValueError(f"layer {i} does not exist: the model has layers 0..{len(layers) - 1}")
    hidden_states, attentions = {}, {}
    for i, (layer, (cos, sin), mask) in enumerate(zip(layers, tables, masks)):
        if i in attention_layers:
            x, attentions[i] = layer(x, cos, sin, mask, cache, return_attention=True)
        else:
            x = layer(x, cos, sin, mask, cache)
        if i < len(additions):
            x = x + additions[i]
        if i in hidden_layers:
            hidden_states[i] = x
    return Captured(norm(x), hidden_states, attentions)



class DecoderBody(nn.Module):
    """A decoder-only family's body (HF's `model.` prefix): embeddings, layers, final norm.

    A family builds `embed_tokens`, `layers`, `norm`, `windows` (each layer's sliding window or
    None), `rotary` ({kind: RotaryEmbedding}) and `rope_kinds` (each layer's key into `rotary`),
    and may override `embed` (Gemma scales the embeddings); this class runs the forward every
    family shares: padding, positions, the KV cache, the unpadded CPU path, rows of several
    sequences, captured layers.
    """

    # whether a padded batch on a CPU may run without its padding (`forward_unpadded`); a family whose
    # layers take more than (x, cos, sin, mask, cache) (Gemma 4: per-layer inputs, shared keys) says no
    unpadded = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.packed_attention = "sdpa"  # how rows of several sequences attend (`_forward_block_mask`)

    def build(self, block: Callable[[Any, int], nn.Module], norm: Callable[[int, float], nn.Module] = RMSNorm,
              rope: Any = None) -> None:
        """The usual layout (HF's names): `embed_tokens`, `layers` of `block(config, i)`, a final `norm`,
        one RoPE for every layer (`rope`: what `RotaryEmbedding` reads, by default the config) and the
        config's `layer_windows()`."""
        c = self.config
        # no padding_idx: with pad == eos (LLaMA 3 recipes) that row is a real token and must train
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(block(c, i) for i in range(c.num_hidden_layers))
        self.norm = norm(c.hidden_size, c.rms_norm_eps)
        self.rotary = {"rope": RotaryEmbedding(rope if rope is not None else c)}
        self.rope_kinds = ["rope"] * c.num_hidden_layers
        self.windows = c.layer_windows()  # per layer: its sliding window or None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) -> the residual stream's first values (B, T, D)."""
        return self.embed_tokens(input_ids)

    def rope_tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) (B, T, hd) for position_ids (B, T); one table per RoPE kind, shared."""
        tables = {kind: rotary(position_ids, dtype=dtype) for kind, rotary in self.rotary.items()}
        return [tables[kind] for kind in self.rope_kinds]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        hidden_layers: Collection[int] = (),
        attention_layers: Collection[int] = (),
        document_ids: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
        read_at: torch.Tensor | None = None,
        additions: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor | Captured:
        """input_ids (B, T) -> hidden (B, T, D) after the final norm. `embeds` (B, T, D): the residual
        stream's first values when the caller made them (a vision-language model's image features
        scattered into the text embeddings), in place of `embed(input_ids)`. `additions`: (B, T, D) tensors,
        `additions[i]` added to the output of layer i (Qwen3-VL's DeepStack: features of the vision tower's
        middle layers at the image positions, zeros elsewhere).

        attention_mask (B, T): 1 for real tokens, 0 for padding (left or right), for the T new
        tokens only (the cache remembers earlier ones). position_ids default to the count of real
        tokens before each one (mask cumsum - 1), so left-padded rows start at position 0.
        Or a bool (B, 1, T, T) mask, True = may attend, with position_ids given: several sequences
        in one row (packing, DPO's shared prompt; see `_forward_block_mask`), and / or the same layout
        as `document_ids` (B, T) (`document_mask_mod`), which the FlexAttention path needs.

        `hidden_layers` / `attention_layers` (layer indices; distillation): return a `Captured`
        with those layers' outputs and attention probabilities. Only the named layers write their
        attention out (`attention_probs`); every other layer keeps SDPA.

        `read_at` (B,): one position per row (a reward model's scored token) -> hidden (B, D) there,
        `forward(...)[arange(B), read_at]` to float rounding. On the unpadded CPU path the last layer
        runs its query path, residual, MLP and the final norm for those positions only (its keys and
        values for every token, `reads_at_positions`); otherwise the full forward, then the gather.
        """
        if read_at is not None:
            if cache is not None or hidden_layers or attention_layers or embeds is not None or additions:
                raise ValueError("read_at reads a plain forward: no KV cache, captured layers, embeds or additions")
            return self.read_positions(input_ids, attention_mask, position_ids, read_at, document_ids)
        B, T = input_ids.shape
        x = self.embed(input_ids) if embeds is None else embeds  # (B, T, D)
        if document_ids is not None or (attention_mask is not None and attention_mask.dim() == 4):
            return self._forward_block_mask(x, attention_mask, position_ids, document_ids, cache,
                                            hidden_layers, attention_layers, additions)
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
        tables = self.rope_tables(position_ids, x.dtype)  # per layer: cos, sin (B, T, hd)
        lengths = None if hidden_layers or attention_layers or not self.unpadded else unpadded_lengths(valid, padded, cache)
        if lengths:
            return forward_unpadded(x, valid, Ragged(lengths), list(zip(self.layers, tables, self.windows)), self.norm,
                                    additions=additions)
        # one mask per distinct window (Qwen mixes full and sliding layers); None lets SDPA use its
        # causal kernels (flash on CUDA); otherwise an explicit bool mask (B, 1, T, S)
        masks = {
            w: None if cache is None and not padded and (w is None or T <= w) else attention_mask_4d(key_valid, start, w)
            for w in set(self.windows)
        }
        out = self._layers(x, tables, [masks[w] for w in self.windows], cache, hidden_layers, attention_layers,
                           additions)
        if cache is not None:
            cache.end(T)
        return out

    def forward_images(self, x: torch.Tensor, attention_mask: torch.Tensor | None, blocks: torch.Tensor,
                       cache: KVCache | None, hidden_layers: Collection[int] = (), attention_layers: Collection[int] = (),
                       both_ways: Collection[int | None] | None = None) -> torch.Tensor | Captured:
        """A forward with images (training, or a cache's first call): x (B, T, ...) the embeddings with the image
        features in place, `blocks` (`image_blocks`); each image's tokens attend to each other both ways in the
        layers whose window is in `both_ways` (None: every layer; `image_masks`). Positions count the real
        tokens, as the plain forward's."""
        B, T = blocks.shape
        valid = (torch.ones(B, T, dtype=torch.bool, device=x.device) if attention_mask is None
                 else attention_mask.to(x.device).bool())
        key_valid = cache.begin(valid) if cache is not None else valid
        position_ids = (key_valid.long().cumsum(-1) - 1).clamp(min=0)
        masks = image_masks(key_valid, blocks.to(x.device), set(self.windows), both_ways)
        out = self._layers(x, self.rope_tables(position_ids, x.dtype), [masks[w] for w in self.windows], cache,
                           hidden_layers, attention_layers)
        if cache is not None:
            cache.end(T)
        return out

    def read_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor | None, read_at: torch.Tensor,
                       document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` with `read_at` (B,) or (B, K): hidden (B, D) or (B, K, D) after the final norm at
        those positions of each row (with `document_ids`: rows of several sequences)."""
        B, T = input_ids.shape
        index = read_at.to(input_ids.device).reshape(B, -1)  # (B, K)
        layout = None
        if document_ids is not None:
            if position_ids is None:
                raise ValueError("read_at with document_ids needs position_ids")
            layout = self.document_layout(document_ids, position_ids)
            valid = document_ids.to(input_ids.device) >= 0
        elif attention_mask is not None and attention_mask.dim() == 2 and position_ids is None and self.unpadded:
            valid = attention_mask.to(device=input_ids.device).bool()
            lengths = unpadded_lengths(valid, True, None)  # a batch without padding too: its Ragged costs the same
            if lengths and len(lengths) == B:
                layout, position_ids = Ragged(lengths), (valid.long().cumsum(-1) - 1).clamp(min=0)
        if layout is not None and reads_at_positions(self.layers[-1]) and bool(valid.gather(1, index).all()):
            x = self.embed(input_ids)
            tables = self.rope_tables(position_ids.to(x.device), x.dtype)
            return forward_unpadded(x, valid, layout, list(zip(self.layers, tables, self.windows)), self.norm, index
                                    ).view(*read_at.shape, -1)
        hidden = self(input_ids, attention_mask, position_ids, document_ids=document_ids)  # (B, T, D)
        return hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1])).view(*read_at.shape, -1)

    def document_layout(self, document_ids: torch.Tensor, position_ids: torch.Tensor) -> Ragged | None:
        """The `Ragged` layout of rows of several sequences (`document_runs`) where this model's layers take
        one (the unpadded path, every layer the floor's attention block); else None (a dense or block mask)."""
        if not self.unpadded or not all(reads_at_positions(layer) for layer in self.layers):
            return None
        return document_runs(document_ids, position_ids)

    def _layers(self, x: torch.Tensor, tables: Sequence[tuple[torch.Tensor, torch.Tensor]], masks: Sequence,
                cache: KVCache | None, hidden_layers: Collection[int], attention_layers: Collection[int],
                additions: Sequence[torch.Tensor] = ()) -> torch.Tensor | Captured:
        """The layer loop: layer i gets `tables[i]` (cos, sin) and `masks[i]`, `additions[i]` is added to
        its output; a `Captured` when asked."""
        if hidden_layers or attention_layers:
            return capture_layers(self.layers, self.norm, x, tables, masks, cache, hidden_layers, attention_layers,
                                  additions)
        for i, (layer, (cos, sin), mask) in enumerate(zip(self.layers, tables, masks)):
            x = layer(x, cos, sin, mask, cache)
            if i < len(additions):
                x = x + additions[i]
        return self.norm(x)

    def _forward_block_mask(self, x: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                            document_ids: torch.Tensor | None, cache: KVCache | None,
                            hidden_layers: Collection[int] = (), attention_layers: Collection[int] = (),
                            additions: Sequence[torch.Tensor] = ()) -> torch.Tensor | Captured:
        """Several sequences in one row (packed rows, DPO's [prompt, chosen, rejected], GRPO's [prompt,
        completions]): the caller gives each token's position_ids (B, T) and the layout, as a bool mask
        (B, 1, T, T), True = may attend, and / or as `document_ids` (B, T). Each layer's sliding
        window applies to positions, so it stays inside each sequence.

        `packed_attention` (set by the engine; "sdpa" by default) picks how: "sdpa" runs the dense
        mask (the caller's, else `document_mask` of the ids); "flex" builds one FlexAttention
        `BlockMask` per window from the ids (`Documents`), which the layers read instead. A forward that
        captures attention probabilities (distillation) keeps the dense mask. 3-D position_ids (3, B, T) (Qwen's
        M-RoPE over images, with `document_ids`) turn RoPE; the windows and the layout read each token's index in
        its sequence (`document_positions`). `additions` as `forward`'s."""
        if cache is not None or position_ids is None:
            raise ValueError("a 4-D attention_mask or document_ids need position_ids and no KV cache")
        rope = position_ids.to(x.device)
        if rope.dim() == 3 and document_ids is None:
            raise ValueError("3-D position_ids in rows of several sequences need their document_ids")
        pos = document_positions(document_ids.to(x.device)) if rope.dim() == 3 else rope
        tables = self.rope_tables(rope, x.dtype)
        if document_ids is not None and (mask is None or mask.dim() == 2) and not (hidden_layers or attention_layers):
            layout = self.document_layout(document_ids, pos)  # on a CPU: each sequence alone, no (T, T) mask
            if layout is not None:
                return forward_unpadded(x, document_ids.to(x.device) >= 0, layout,
                                        list(zip(self.layers, tables, self.windows)), self.norm, additions=additions)
        flex = self.packed_attention == "flex" and not (hidden_layers or attention_layers)
        masks = row_masks(mask, pos, document_ids, set(self.windows), flex)
        return self._layers(x, tables, [masks[w] for w in self.windows], None, hidden_layers, attention_layers,
                            additions)


class LanguageModel(nn.Module):
    """A multimodal checkpoint's `model.`: its text body as `model.language_model` (the keys in the
    checkpoint, and in the adapters peft writes on transformers' multimodal class). The towers beside
    it (vision, audio, their projectors) are neither built nor read: a family's `carry_checkpoint_keys`
    write them back as they were."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.language_model = body

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                hidden_layers: Collection[int] = (), attention_layers: Collection[int] = (),
                document_ids: torch.Tensor | None = None, read_at: torch.Tensor | None = None):
        return self.language_model(input_ids, attention_mask, position_ids, cache, hidden_layers, attention_layers,
                                   document_ids, read_at)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    @property
    def packed_attention(self) -> str:
        return self.language_model.packed_attention

    @packed_attention.setter
    def packed_attention(self, kind: str) -> None:
        self.language_model.packed_attention = kind


class CausalLM(nn.Module):
    """A decoder-only causal LM: `model` (a `DecoderBody`) + `lm_head`. forward returns hidden
    states, not logits (`output_projection(hidden)` are the logits). A family subclasses it with its
    `block_types` and builds its body and head in `__init__`."""

    block_types: tuple[type[nn.Module], ...] = ()
    ignore_checkpoint_keys: tuple[str, ...] = ()  # regexes of derived keys the loader skips
    is_encoder_decoder = False

    def __init__(self, config: Any, body: nn.Module, lm_head: nn.Linear | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = body
        self.lm_head = lm_head if lm_head is not None else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        hidden_layers: Collection[int] = (),
        attention_layers: Collection[int] = (),
        document_ids: torch.Tensor | None = None,
        read_at: torch.Tensor | None = None,
    ) -> torch.Tensor | Captured:
        """input_ids (B, T) -> hidden (B, T, D); logits are `self.output_projection(hidden)`.
        With `hidden_layers` / `attention_layers`: a `Captured`; `document_ids`: rows of several
        sequences; `read_at` (B,): hidden (B, D) at one position per row (see `DecoderBody.forward`)."""
        rows = {} if document_ids is None else {"document_ids": document_ids}
        if read_at is not None:
            rows["read_at"] = read_at
        if not hidden_layers and not attention_layers:  # a family's body that captures nothing may take 4
            return self.model(input_ids, attention_mask, position_ids, cache, **rows)
        return self.model(input_ids, attention_mask, position_ids, cache, hidden_layers, attention_layers, **rows)

    @property
    def packed_attention(self) -> str:
        """How rows of several sequences attend: "sdpa" (a dense bool mask, the default) or "flex"
        (FlexAttention with a block mask of the rows' `document_ids`; for CUDA under torch.compile,
        forward-only on a CPU). The engine sets it (`attention=` in the config); see `Documents`."""
        return self.model.packed_attention

    @packed_attention.setter
    def packed_attention(self, kind: str) -> None:
        if kind not in PACKED_ATTENTION:
            raise ValueError(f"packed_attention={kind!r} — use one of {PACKED_ATTENTION}")
        self.model.packed_attention = kind

    @property
    def captures_layers(self) -> bool:
        """Whether forward takes `hidden_layers` / `attention_layers`: the shared body does; a family
        with a body of its own may not (docs/contracts.md)."""
        return "hidden_layers" in inspect.signature(self.model.forward).parameters

    def tie_weights(self) -> None:
        """Make lm_head share the input embedding's Parameter when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def output_projection(self) -> nn.Module:
        return self.lm_head

    def resize_token_embeddings(self, n: int) -> None:
        """Resize embedding and head to n rows; old rows are kept, new rows are the mean of the old
        ones (a neutral start for added special tokens). Records `config.vocab_size = n`."""

        def resized(w: torch.Tensor) -> nn.Parameter:
            old = w.shape[0]
            new = w.new_empty(n, w.shape[1])
            new[: min(old, n)] = w[: min(old, n)].detach()
            if n > old:
                new[old:] = w.detach().float().mean(0).to(w.dtype)
            return nn.Parameter(new, requires_grad=w.requires_grad)

        emb = self.model.embed_tokens
        emb.weight = resized(emb.weight)
        emb.num_embeddings = n
        if self.config.tie_word_embeddings:
            self.lm_head.weight = emb.weight
        else:
            self.lm_head.weight = resized(self.lm_head.weight)
        self.lm_head.out_features = n
        self.config.vocab_size = n


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The router's load-balancing loss as transformers computes it (`load_balancing_loss_func`, the
    Switch Transformer's): E * sum_e f_e P_e, where over every layer's rows (the real tokens when
    `token_mask` (N,) is given) f_e is the share of top-k choices that went to expert e, times K, and
    P_e the mean router probability of e. router_logits: one (N, E) per sparse layer -> a scalar fp32
    (K when choices and probabilities are uniform)."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = logits.float().softmax(-1)  # (N, E)
        chosen = torch.topk(probs, top_k, dim=-1).indices  # (N, K)
        w = torch.ones(probs.shape[0], device=device) if token_mask is None else token_mask.float().to(device)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.flatten(), w.repeat_interleave(top_k))
        probs_sum = probs_sum + (probs * w[:, None]).sum(0)
        rows = rows + w.sum()
    return (counts / rows * (probs_sum / rows)).sum() * num_experts


def router_z_loss(router_logits: Sequence[torch.Tensor], token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean over every layer's rows (the real
    tokens when `token_mask` (N,) is given) of logsumexp(router logits)^2, which keeps the logits
    small. router_logits: one (N, E) per sparse layer -> a scalar fp32."""
    z = torch.cat([torch.logsumexp(logits.float(), dim=-1) ** 2 for logits in router_logits])  # (layers N,)
    if token_mask is None:
        return z.mean()
    w = token_mask.float().to(z.device).repeat(len(router_logits))
    return (z * w).sum() / w.sum()


class MoeCausalLM(CausalLM):
    """A causal LM whose MLPs are (some of them) `SparseMoeBlock`s: the load-balancing loss and the
    expert-load metrics of its last training forward (`router_aux_loss`). `router_z_loss_coef` (a
    training setting, not a config.json field; 0: off) adds that times the router z-loss."""

    router_z_loss_coef: float = 0.0

    def moe_blocks(self) -> list[SparseMoeBlock]:
        """The sparse blocks, in layer order."""
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def router_aux_loss(self, token_mask: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor | None, dict[str, float]] | None:
        """What the last training forward's routing adds to the loss and logs, then forgets it (None:
        no training forward since). token_mask (B, T): the real tokens (1 / True), as the forward's
        attention_mask; rows the model ran without their padding (a CPU's unpadded path) are all real.

        Returns (the term to add to the mean loss: `router_aux_loss_coef` x `load_balancing_loss` when
        the config's `output_router_logits` turns it on, as transformers trains, plus
        `router_z_loss_coef` x `router_z_loss` when that is set; None when neither is; metrics:
        `aux_loss` (logged either way), `z_loss` (when its coefficient is set) and `expert_load/<layer>`,
        the share of that layer's real (token, expert) choices that went to its busiest expert (1 / E
        when balanced))."""
        blocks = [(i, b) for i, b in enumerate(self.model.layers) if isinstance(b.mlp, SparseMoeBlock)
                  and b.mlp.routing is not None]
        if not blocks:
            return None
        routings = [b.mlp.routing for _, b in blocks]
        for _, b in blocks:
            b.mlp.routing = None
        n = routings[0][0].shape[0]
        mask = None
        if token_mask is not None and token_mask.numel() == n and not bool(token_mask.all()):
            mask = token_mask.reshape(-1).bool().to(routings[0][0].device)
        E, K = routings[0][0].shape[1], routings[0][1].shape[1]
        aux = load_balancing_loss([logits for logits, _ in routings], E, K, mask)
        metrics = {"aux_loss": float(aux.detach())}
        for (i, _), (_, chosen) in zip(blocks, routings):
            chosen = chosen if mask is None else chosen[mask]
            load = torch.bincount(chosen.flatten(), minlength=E)
            metrics[f"expert_load/{i}"] = float(load.max()) / max(1, chosen.numel())
        term = self.config.router_aux_loss_coef * aux if self.config.output_router_logits else None
        if self.router_z_loss_coef:
            z = router_z_loss([logits for logits, _ in routings], mask)
            metrics["z_loss"] = float(z.detach())
            term = self.router_z_loss_coef * z + (0 if term is None else term)
        return term, metrics


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of tokens whose probability sum reaches top_p
    (at least one), set the rest to -inf. logits (B, V) -> (B, V)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False)  # (B, V) ascending
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cum <= (1 - top_p)  # the low-probability tail
    drop_sorted[:, -1] = False  # always keep the most likely token
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@torch.no_grad()
def generate(
    model: CausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    **inputs: torch.Tensor,
) -> torch.Tensor:
    """Continue each row of input_ids (B, T); returns (B, T + n) with n <= max_new_tokens.

    Greedy by default; `do_sample` draws from softmax(logits / temperature) after top-p, with a
    torch.Generator seeded by `seed` (reproducible) or torch's global RNG when seed is None.
    Batches must be left-padded (attention_mask 0 on the left). A row that produced an EOS gets
    `pad_token_id` afterwards; generation stops early once every row has finished.
    `eos_token_id=None` means the config's EOS (an int or a list); pass [] to never stop early.
    The model runs in eval mode (adapter dropout off) and is put back as it was. `inputs`: more of the
    prompt's inputs, given to its first forward only (a vision-language model's `pixel_values`).
    """
    cfg = model.config
    B, T = input_ids.shape
    device = input_ids.device
    eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
    eos_list = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    eos_ids = torch.tensor(eos_list, dtype=torch.long, device=device)
    if pad_token_id is None:
        pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (int(eos_ids[0]) if len(eos_ids) else 0)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device).long()
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("generate: attention_mask has padding after real tokens — left-pad prompts for generation")
    if do_sample and temperature <= 0:
        raise ValueError(f"generate: temperature={temperature} — use a positive temperature, or do_sample=False")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p={top_p} — use a value in (0, 1]")
    generator = None
    if do_sample and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)

    was_training = model.training
    model.eval()
    try:
        cache = KVCache(T + max_new_tokens)
        hidden = model(input_ids, mask, cache=cache, **inputs)  # (B, T, D)
        unfinished = torch.ones(B, dtype=torch.bool, device=device)
        step_mask = torch.ones(B, 1, dtype=torch.long, device=device)
        new_tokens = []
        for step in range(max_new_tokens):
            logits = model.output_projection(hidden[:, -1]).float()  # (B, V)
            if do_sample:
                probs = top_p_filter(logits / temperature, top_p).softmax(-1)
                token = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
            else:
                token = logits.argmax(-1)  # (B,)
            token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
            new_tokens.append(token)
            unfinished = unfinished & ~torch.isin(token, eos_ids)
            if step == max_new_tokens - 1 or not bool(unfinished.any()):
                break
            hidden = model(token[:, None], step_mask, cache=cache)  # (B, 1, D)
    finally:
        model.train(was_training)
    if not new_tokens:
        return input_ids
    return torch.cat([input_ids, torch.stack(new_tokens, 1)], dim=1)

