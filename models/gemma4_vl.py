"""Multimodal Gemma 4 (`Gemma4ForConditionalGeneration`, model_type `gemma4`): the vision tower, its embedder
into the language model and the Gemma 4 language model of gemma4.py, importing only torch, the shared floor and
gemma4.py. The audio tower is not built: its tensors (`model.audio_tower.*`, `model.embed_audio.*`) are carried
untouched, and a folder without a `vision_config` is its language model alone.

Read top to bottom: config (gemma4.py's `Gemma4Config` of the `text_config` plus the tower's dataclass), the
tower, the embedder, the model.

Vision tower (transformers' `Gemma4VisionModel`). The image processor (`minitrain.data.images`) resizes each
image, its aspect kept, to at most `max_soft_tokens * k**2` patches of `patch_size` pixels (k the
`pooling_kernel_size`), both sides multiples of k patches, and gives each image's patches as rows of 3 p p
pixels in [0, 1] (`pixel_values` (n, max_patches, 3 p p), zero rows after the real ones) with each patch's
(x, y) in its grid (`image_position_ids` (n, max_patches, 2), -1 on the padding). Then:
- `patch_embedder`: 2 (x - 0.5) through `input_proj` (no bias), plus a learned embedding of x and one of y
  (`position_embedding_table` (2, S, D)), zero on the padding;
- pre- and post-normed blocks like the language model's (four RMSNorms `weight * x / rms(x)`, fp32 cast last):
  attention at scale 1.0 with q / k norms, a `v_norm` without a weight, 2-D RoPE (the first half of each head
  turned by x, the second by y, each half rotate-half over hd / 4 frequencies, base `rope_theta`), every real
  patch of an image seeing every other (padding never seen); a GeGLU MLP. Each linear is a
  `Gemma4ClippableLinear` (`*.linear`), its input and output clamped by stored bounds when
  `use_clipped_linears`;
- `pooler`: the padding zeroed, each k x k square of patches averaged (in fp32) into one soft token, times
  sqrt(D); the real tokens kept, image after image; with `standardize`, (x - std_bias) * std_scale.
An image of h x w patches gives h w / k**2 soft tokens.

Embedder (`embed_vision`): x / rms(x) (no weight), then `embedding_projection` to the language model's width.

Language model. The processor writes each image as `<|image>` + `<|image|>` x (its soft tokens) + `<image|>`
where the chat template wrote `<|image|>`; the features replace the embeddings of the `<|image|>` tokens
(`image_token_id`), in order, after the sqrt(D) scaling (they are not scaled). Every image / audio / video
token id is embedded as the pad token first, for the embeddings and for the per-layer inputs' token part (as
transformers, whose `padding_idx` keeps the pad row's gradient at zero: ours takes none from the image places); the
per-layer inputs' context part reads the embeddings with the features in place. With
`use_bidirectional_attention: "vision"` (the larger sizes), a forward with images lets each image's tokens
attend to each other both ways in the sliding layers only; the global layers stay causal (transformers'
`create_masks_for_vision_model`); without it, causal everywhere. Decoded tokens attend causally.

Not yet: videos, audio in rows, rows of several sequences with images (packing).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Collection

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.gemma4 import Gemma4Config, Gemma4ForCausalLM, unit_rms
from models.layers import (
    KVCache,
    RMSNormCastLast,
    activation,
    apply_rotary,
    check_fields,
    drop_ignored,
    generate,
    image_blocks,
    require_zero,
)

__all__ = ["Gemma4VLConfig", "VisionConfig", "Gemma4ForConditionalGeneration", "KVCache", "generate",
           "config_from_hf"]

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

# transformers' defaults of Gemma4VisionConfig
_VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=12,
    head_dim=64, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_theta=100.0, pooling_kernel_size=3,
    patch_size=16, position_embedding_size=10240, use_clipped_linears=False, standardize=False)
# the outer config's token ids (transformers' defaults); the image / video / audio ones embed as the pad token
_TOKEN_DEFAULTS = dict(image_token_id=258_880, video_token_id=258_884, audio_token_id=258_881)


@dataclass
class VisionConfig:
    """The tower's hyper-parameters under `vision_config`'s names (`rope_theta` from its `rope_parameters`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_activation: str
    rms_norm_eps: float
    rope_theta: float
    pooling_kernel_size: int
    patch_size: int
    position_embedding_size: int
    use_clipped_linears: bool
    standardize: bool

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "VisionConfig":
        d = dict(d)
        drop_ignored(d, ("model_type", "initializer_range", "dtype", "torch_dtype", "_name_or_path", "architectures",
                         "transformers_version", "max_position_embeddings"))
        require_zero(d, "attention_dropout")
        if d.pop("attention_bias", False):  # transformers' tower builds its linears without a bias whatever it says
            raise ValueError("config.json: vision_config.attention_bias=true — Gemma 4's tower has no biases; set "
                             "it to false")
        rope = dict(d.pop("rope_parameters", None) or {"rope_type": "axial", "rope_theta": 100.0})
        if rope.pop("rope_type", "axial") != "axial" or set(rope) - {"rope_theta"}:
            raise ValueError(f"config.json: vision_config.rope_parameters {rope} — Gemma 4's tower takes the axial "
                             "RoPE (rope_type 'axial', rope_theta) only")
        d["rope_theta"] = float(rope.get("rope_theta", 100.0))
        check_fields(d, cls, "gemma4 (vision_config)", required=())
        c = cls(**{**_VISION_DEFAULTS, **d})
        if c.num_attention_heads != c.num_key_value_heads or c.head_dim % 4:
            raise ValueError("config.json: vision_config needs num_key_value_heads == num_attention_heads and a "
                             "head_dim divisible by 4, as Gemma 4's tower")
        return c


@dataclass
class Gemma4VLConfig(Gemma4Config):
    """The language model's config (gemma4.py's, of the `text_config`; `multimodal` keeps the outer config.json
    for `to_hf`) plus the tower's `vision` (None: a folder without a vision_config) and the token ids."""

    vision: VisionConfig | None = None
    image_token_id: int = 258_880
    video_token_id: int = 258_884
    audio_token_id: int = 258_881

    @classmethod
    def from_multimodal(cls, d: dict[str, Any]) -> "Gemma4VLConfig":
        cfg = super().from_multimodal(d)
        vision = d.get("vision_config")
        cfg.vision = VisionConfig.from_hf(vision) if isinstance(vision, dict) else None
        for k, v in _TOKEN_DEFAULTS.items():
            setattr(cfg, k, int(d.get(k) if d.get(k) is not None else v))
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """The config.json transformers loads: the multimodal config read, the text config written anew."""
        return Gemma4Config(**{f.name: getattr(self, f.name) for f in fields(Gemma4Config)}).to_hf()


# --------------------------------------------------------------------------------------------
# Vision tower, embedder
# --------------------------------------------------------------------------------------------


class ClippableLinear(nn.Module):
    """transformers' `Gemma4ClippableLinear`: `linear` (no bias), its input and output clamped by the stored
    `input_min` / `input_max` / `output_min` / `output_max` when the config says `use_clipped_linears`."""

    def __init__(self, c: VisionConfig, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.clipped = c.use_clipped_linears
        if self.clipped:
            for name, v in (("input_min", -1), ("input_max", 1), ("output_min", -1), ("output_max", 1)):
                self.register_buffer(name, torch.tensor(v * float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        return self.linear(x.clamp(self.input_min, self.input_max)).clamp(self.output_min, self.output_max)


class PatchEmbedder(nn.Module):
    """(n, P, 3 p p) pixels in [0, 1], positions (n, P, 2) -> (n, P, D): `input_proj` of 2 (x - 0.5) plus the
    x and y position embeddings (zero on the padding)."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * c.patch_size ** 2, c.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.ones(2, c.position_embedding_size, c.hidden_size))

    def forward(self, pixel_values: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = self.input_proj((2 * (pixel_values - 0.5)).to(self.input_proj.weight.dtype))
        at = positions.clamp(min=0)
        table = self.position_embedding_table
        pos = F.embedding(at[..., 0], table[0]) + F.embedding(at[..., 1], table[1])
        return x + torch.where(padding[..., None], 0.0, pos)


def axial_rope(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions (n, P, 2) -> cos, sin (n, P, hd): hd / 4 frequencies of base `theta` over a quarter of the head,
    laid out (x, x, y, y): the first half of a head rotate-half by x, the second by y (transformers' axial RoPE)."""
    quarter = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=positions.device) / quarter)
    freqs = positions[..., None].float() * inv_freq  # (n, P, 2, hd / 4)
    cos, sin = freqs.cos(), freqs.sin()
    layout = lambda t: torch.cat([t[:, :, 0], t[:, :, 0], t[:, :, 1], t[:, :, 1]], -1).to(dtype)  # noqa: E731
    return layout(cos), layout(sin)


def rotate_axes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (n, H, P, hd): each half of the head rotated by its own axis' half of the tables (n, P, hd)."""
    return torch.cat([apply_rotary(a, c, s) for a, c, s in zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1))],
                     -1)


class VisionAttention(nn.Module):
    """Attention over one image's patches: q / k norms, a weightless v norm, axial RoPE, scale 1.0; the padding
    patches are never attended to."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        D, H, hd = c.hidden_size, c.num_attention_heads, c.head_dim
        self.heads, self.head_dim, self.eps = H, hd, c.rms_norm_eps
        self.q_proj, self.k_proj, self.v_proj = (ClippableLinear(c, D, H * hd) for _ in range(3))
        self.o_proj = ClippableLinear(c, H * hd, D)
        self.q_norm = RMSNormCastLast(hd, c.rms_norm_eps)
        self.k_norm = RMSNormCastLast(hd, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n, P, _ = x.shape
        split = lambda t: t.unflatten(-1, (self.heads, self.head_dim))  # noqa: E731  (n, P, H, hd)
        q = rotate_axes(self.q_norm(split(self.q_proj(x))).transpose(1, 2), cos, sin)
        k = rotate_axes(self.k_norm(split(self.k_proj(x))).transpose(1, 2), cos, sin)
        v = unit_rms(split(self.v_proj(x)), self.eps).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)  # (n, H, P, hd)
        return self.o_proj(y.transpose(1, 2).reshape(n, P, -1))


class VisionMLP(nn.Module):
    """down(act(gate(x)) * up(x)), each a `ClippableLinear`."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = ClippableLinear(c, c.hidden_size, c.intermediate_size)
        self.up_proj = ClippableLinear(c, c.hidden_size, c.intermediate_size)
        self.down_proj = ClippableLinear(c, c.intermediate_size, c.hidden_size)
        self.act = activation(c.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionLayer(nn.Module):
    """The sandwich block: x + post_attention_layernorm(attn(input_layernorm(x))), then the same around the MLP."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        D, eps = c.hidden_size, c.rms_norm_eps
        self.self_attn = VisionAttention(c)
        self.mlp = VisionMLP(c)
        self.input_layernorm = RMSNormCastLast(D, eps)
        self.post_attention_layernorm = RMSNormCastLast(D, eps)
        self.pre_feedforward_layernorm = RMSNormCastLast(D, eps)
        self.post_feedforward_layernorm = RMSNormCastLast(D, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x


class VisionModel(nn.Module):
    """transformers' `vision_tower`: pixel_values (n, P, 3 p p), positions (n, P, 2) -> the soft tokens of every
    image, image after image (N, D), fp32 until the standardisation, then in the patches' dtype."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.config = c
        self.patch_embedder = PatchEmbedder(c)
        self.encoder = VisionEncoder(c)
        if c.standardize:
            self.register_buffer("std_bias", torch.zeros(c.hidden_size))
            self.register_buffer("std_scale", torch.ones(c.hidden_size))

    def pool(self, x: torch.Tensor, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, P, D) with the padding zeroed -> (n, length, D) fp32, each k x k square of patches averaged into
        slot x / k + (w / k) (y / k), and which slots hold a token (n, length) (transformers' `Gemma4VisionPooler`)."""
        k = int((x.shape[1] // length) ** 0.5)
        at = positions.clamp(min=0)
        width = at[..., 0].max(dim=-1, keepdim=True)[0] + 1  # (n, 1) the grid's width in patches
        cell = torch.div(at, k, rounding_mode="floor")
        weights = F.one_hot((cell[..., 0] + (width // k) * cell[..., 1]).long(), length).float() / k ** 2
        return (weights.transpose(1, 2) @ x.float()).to(x.dtype), (weights != 0).any(dim=1)

    def forward(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.config
        positions = positions.to(pixel_values.device)
        padding = (positions == -1).all(dim=-1)  # (n, P)
        x = self.patch_embedder(pixel_values, positions, padding)
        cos, sin = axial_rope(positions, c.head_dim, c.rope_theta, x.dtype)
        x = self.encoder(x, cos, sin, ~padding[:, None, None, :])
        x = x.masked_fill(padding[..., None], 0.0)
        length = pixel_values.shape[-2] // c.pooling_kernel_size ** 2
        kept = ~padding
        if x.shape[1] != length:
            x, kept = self.pool(x, positions, length)
        x = x.float()[kept] * c.hidden_size ** 0.5  # (N, D) fp32: the scaling may overflow fp16
        if c.standardize:
            x = (x - self.std_bias.float()) * self.std_scale.float()
        return x.to(self.patch_embedder.input_proj.weight.dtype)


class MultimodalEmbedder(nn.Module):
    """transformers' `embed_vision`: soft tokens (N, Dv) -> (N, D): x / rms(x), then `embedding_projection`."""

    def __init__(self, c: VisionConfig, hidden_size: int) -> None:
        super().__init__()
        self.embedding_projection = nn.Linear(c.hidden_size, hidden_size, bias=False)
        self.eps = c.rms_norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(unit_rms(x, self.eps))


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The language model (`model.language_model`, `lm_head`), the vision tower (`model.vision_tower`) and its
    embedder (`model.embed_vision`). forward returns hidden states, as every family's; with `pixel_values`
    (n, P, 3 p p) and `image_position_ids` (n, P, 2), the images' features take the places of the image tokens.
    The audio tower's tensors (and, without a vision_config, the vision tower's) are neither built nor read, and
    a save writes them back as they were read from the source folder."""

    towers = ("model.vision_tower", "model.embed_vision")  # frozen unless a regex target names them

    def __init__(self, config: Gemma4VLConfig) -> None:
        super().__init__(config, multimodal=True)
        outside = r"^model\.(audio_tower|embed_audio)\." if config.vision else r"^model\.(?!language_model\.)"
        self.hf_only_modules = (outside,)  # transformers' class builds them: adapters name full paths
        self.ignore_checkpoint_keys = self.carry_checkpoint_keys = (*self.carry_checkpoint_keys, outside)
        if config.vision:
            self.model.vision_tower = VisionModel(config.vision)
            self.model.embed_vision = MultimodalEmbedder(config.vision, config.hidden_size)

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """The tokens that stand for image / video / audio features in the input, never an output."""
        c = self.config
        return (c.image_token_id, c.video_token_id, c.audio_token_id)

    def image_features(self, pixel_values: torch.Tensor, image_position_ids: torch.Tensor) -> torch.Tensor:
        """(n, P, 3 p p), (n, P, 2) -> (N, D): every image's soft tokens in the language model's width."""
        return self.model.embed_vision(self.model.vision_tower(pixel_values, image_position_ids))

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
        pixel_values: torch.Tensor | None = None,
        image_position_ids: torch.Tensor | None = None,
    ):
        """input_ids (B, T) -> hidden (B, T, D); `pixel_values` / `image_position_ids` as the image processor
        makes them, the images in the order of their image tokens over the rows."""
        c = self.config
        special = torch.isin(input_ids, torch.tensor(self.placeholder_ids, device=input_ids.device))
        text_ids = input_ids.masked_fill(special, c.pad_token_id or 0)
        if pixel_values is None:
            return super().forward(text_ids, attention_mask, position_ids, cache, hidden_layers, attention_layers,
                                   document_ids, read_at)
        if image_position_ids is None or not hasattr(self.model, "vision_tower"):
            raise ValueError("gemma4: pixel_values need image_position_ids and a checkpoint with a vision tower")
        if cache is not None and cache.length or document_ids is not None or position_ids is not None \
                or read_at is not None:
            raise ValueError("gemma4: images go in a plain forward or a cache's first call (the prompt), not in "
                             "packed rows, a continued cache, with position_ids or read_at — not yet")
        placeholders = input_ids == c.image_token_id
        features = self.image_features(pixel_values, image_position_ids)
        if int(placeholders.sum()) != features.shape[0]:
            raise ValueError(f"gemma4: {int(placeholders.sum())} image tokens for {features.shape[0]} image features "
                             f"({pixel_values.shape[0]} images) — the ids and the images do not match")
        text = self.model.language_model
        x = text.embed(text_ids, (placeholders, features))
        both_ways = {w for w in text.windows if w is not None} if c.use_bidirectional_attention == "vision" else ()
        return text.forward_images(x, attention_mask, image_blocks(input_ids, c.image_token_id), cache,
                                   hidden_layers, attention_layers, both_ways)


def config_from_hf(d: dict[str, Any]) -> Gemma4VLConfig:
    """The registry's entry point (models/__init__.py)."""
    return Gemma4VLConfig.from_multimodal(d)
