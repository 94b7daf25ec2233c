"""Gemma 3 multimodal (`Gemma3ForConditionalGeneration`, model_type `gemma3`): a SigLIP vision tower, the
multimodal projector and the Gemma 3 text model of gemma.py, importing only torch, the shared floor and
gemma.py.

Read top to bottom: config (the text config is gemma.py's `GemmaConfig` of the `text_config`; the tower's
its own dataclass), the tower, the projector, the model (the attention rule of image tokens: layers.py's
`image_masks`, which Gemma 4 shares).

Vision tower (SigLIP, transformers' `SiglipVisionModel` without its pooling head). An image resized to
`image_size` square (`minitrain.data.images`, pixel values (n, 3, S, S)) is cut into (S / patch)**2 patches
by a strided Conv2d (with bias), plus a learned position embedding per patch; then pre-norm blocks:
x + attn(layer_norm1(x)), x + mlp(layer_norm2(x)), LayerNorms with biases, multi-head attention with biased
q / k / v / out projections and no mask (every patch sees the image), a gelu-tanh MLP (fc1, fc2); a final
`post_layernorm`.

Projector. The patches laid out as their (S / patch)-square grid are average-pooled down to
`mm_tokens_per_image` (a square number) tokens, normed by Gemma's (1 + w) RMSNorm and multiplied by
`mm_input_projection_weight` (vision width x text width): one feature per image token.

Language model. The processor writes each image as `\\n\\n<start_of_image>` + `<image_soft_token>` x
mm_tokens_per_image + `<end_of_image>\\n\\n`; the features replace the embeddings of the soft tokens
(`image_token_index`), in order. They replace the scaled embeddings: the features themselves are not
multiplied by sqrt(hidden_size). A forward with images (training, or the prompt of a generation) lets each
image's run of soft tokens attend to each other both ways (transformers' `token_type_ids`: a run of image
tokens is one block), the rest causal; a sliding layer's window still applies. The tokens decoded after
the prompt attend causally (transformers passes no `token_type_ids` after the first step).

The modules are transformers' (`model.language_model.*`, `model.vision_tower.{embeddings, encoder,
post_layernorm}`, `model.multi_modal_projector.*`, `lm_head`), so peft's adapters on transformers' class name
the same modules. transformers 5 saves `language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`;
the Hub's checkpoints `vision_tower.vision_model.*` for the tower: every layout loads key for key
(`checkpoint_parts`); a save writes the module tree's, which transformers loads.

Not yet: pan-and-scan crops (`do_pan_and_scan`), rows of several sequences with images (packing).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Collection

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.gemma import GemmaConfig, GemmaDecoderLayer, GemmaModel
from models.layers import (
    CausalLM,
    KVCache,
    LanguageModel,
    OffsetRMSNorm,
    SoftcappedLinear,
    activation,
    check_fields,
    drop_ignored,
    generate,
    image_blocks,
    multimodal_to_hf,
    require_zero,
)

__all__ = ["Gemma3VLConfig", "VisionConfig", "Gemma3ForConditionalGeneration", "KVCache", "generate",
           "config_from_hf", "image_blocks"]

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

# transformers' defaults of SiglipVisionConfig
_VISION_DEFAULTS: dict[str, Any] = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                        num_attention_heads=12, num_channels=3, image_size=224, patch_size=16,
                                        hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
# the outer config's token ids (transformers' defaults; `*_index` is how Gemma3Config spells them)
_TOKEN_DEFAULTS = dict(boi_token_index=255_999, eoi_token_index=256_000, image_token_index=262_144)
_OUTER_FIELDS = {"model_type", "text_config", "vision_config", "architectures", "dtype", "torch_dtype",
                 "transformers_version", "tie_word_embeddings", "_name_or_path", "use_cache", "initializer_range",
                 "mm_tokens_per_image", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", *_TOKEN_DEFAULTS}


@dataclass
class VisionConfig:
    """The SigLIP tower's hyper-parameters under `vision_config`'s names."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "VisionConfig":
        d = dict(d)
        drop_ignored(d, ("model_type", "initializer_range", "dtype", "torch_dtype", "_name_or_path", "architectures",
                         "transformers_version", "projection_dim"))
        require_zero(d, "attention_dropout")
        if d.pop("vision_use_head", False):
            raise ValueError("config.json: vision_config.vision_use_head=true — Gemma 3 reads the tower's patches, "
                             "not a pooled head; set it to false")
        check_fields(d, cls, "gemma3 (vision_config)", required=())
        return cls(**{**_VISION_DEFAULTS, **d})


@dataclass
class Gemma3VLConfig(GemmaConfig):
    """The language model's config (gemma.py's `GemmaConfig` of the `text_config`, model_type "gemma3") plus
    what the multimodal model adds: the tower's `vision`, `mm_tokens_per_image`, the token ids
    (`image_token_index`: the soft token the features replace; `boi` / `eoi`: the image's start and end),
    and `multimodal` (the outer config.json without its text_config, for `to_hf`)."""

    vision: VisionConfig | None = None
    mm_tokens_per_image: int = 256
    boi_token_index: int = 255_999
    eoi_token_index: int = 256_000
    image_token_index: int = 262_144
    multimodal: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        model_type, self.model_type = self.model_type, "gemma3_text"  # the text model's checks are Gemma 3's
        super().__post_init__()
        self.model_type = model_type

    def text(self) -> GemmaConfig:
        """The text model's own config (model_type "gemma3_text"), which gemma.py's layers read."""
        return GemmaConfig(**{f.name: getattr(self, f.name) for f in fields(GemmaConfig) if f.name != "model_type"},
                           model_type="gemma3_text")

    @classmethod
    def from_multimodal(cls, d: dict[str, Any]) -> "Gemma3VLConfig":
        """A `gemma3` config.json: its text_config as Gemma 3's (the outer `tie_word_embeddings` is the one
        transformers honours, and the outer bos / eos / pad ids when given: the Hub's checkpoints end turns with
        eos [1, 106] there), its vision_config, its token ids."""
        if not isinstance(d.get("text_config"), dict) or not isinstance(d.get("vision_config"), dict):
            raise ValueError("config.json: a gemma3 config without text_config / vision_config — restore the "
                             "checkpoint's config.json")
        base = GemmaConfig.from_hf({**d["text_config"], "model_type": "gemma3_text",
                                    "tie_word_embeddings": d.get("tie_word_embeddings", True)})
        outer = {k: v for k, v in d.items() if k != "text_config"}
        unknown = sorted(set(outer) - _OUTER_FIELDS)
        if unknown:
            raise ValueError(f"config.json: field(s) {unknown} are not understood by minitrain's gemma3 model — "
                             "remove them if harmless")
        if outer.get("vocab_size", base.vocab_size) != base.vocab_size:  # a full fine-tuning run writes it there too
            raise ValueError(f"config.json: vocab_size={d['vocab_size']} and text_config.vocab_size={base.vocab_size} "
                             "disagree — make them equal")
        vision = VisionConfig.from_hf(d["vision_config"])
        n = int(d.get("mm_tokens_per_image", 256))
        side, patches = round(n ** 0.5), vision.image_size // vision.patch_size
        if side * side != n or patches % side:
            raise ValueError(f"config.json: mm_tokens_per_image={n} must be a square whose side divides the tower's "
                             f"{patches} patches a side")
        tokens = {k: int(d.get(k, v)) for k, v in _TOKEN_DEFAULTS.items()}
        kw = {f.name: getattr(base, f.name) for f in fields(GemmaConfig) if f.name != "model_type"}
        kw.update({k: outer[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in outer})
        return cls(**kw, model_type="gemma3", vision=vision, mm_tokens_per_image=n, multimodal=outer, **tokens)

    def to_hf(self) -> dict[str, Any]:
        """The config.json transformers loads: the multimodal config read, the text config written anew."""
        return multimodal_to_hf(self.text().to_hf(), dict(self.multimodal or {}), "gemma3_text")


# --------------------------------------------------------------------------------------------
# Vision tower, projector
# --------------------------------------------------------------------------------------------


class VisionEmbeddings(nn.Module):
    """pixel_values (n, C, S, S) -> (n, P, D): the patches' Conv2d (`patch_embedding`) plus a learned
    position embedding per patch."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size)
        self.position_embedding = nn.Embedding((c.image_size // c.patch_size) ** 2, c.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    """Multi-head attention over one image's patches, no mask (biased q / k / v / out projections)."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        D = c.hidden_size
        self.heads = c.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, P, D = x.shape
        q, k, v = (p(x).view(n, P, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, P, D))


class VisionMLP(nn.Module):
    """fc2(act(fc1(x)))."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    """x + attn(layer_norm1(x)), then + mlp(layer_norm2(x))."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = VisionAttention(c)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = VisionMLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class VisionTower(nn.Module):
    """transformers' `vision_tower`: pixel_values (n, C, S, S) -> patches (n, P, D) after `post_layernorm`."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(c)
        self.encoder = VisionEncoder(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


class Projector(nn.Module):
    """transformers' `multi_modal_projector`: patches (n, P, Dv) -> (n, mm_tokens_per_image, D): the patch grid
    average-pooled to the tokens' grid, (1 + w) RMSNorm, times `mm_input_projection_weight` (Dv, D)."""

    def __init__(self, config: Gemma3VLConfig) -> None:
        super().__init__()
        v = config.vision
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(v.hidden_size, config.hidden_size))
        self.mm_soft_emb_norm = OffsetRMSNorm(v.hidden_size, v.layer_norm_eps)
        self.side = v.image_size // v.patch_size
        self.kernel = self.side // round(config.mm_tokens_per_image ** 0.5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, Dv = patches.shape
        grid = patches.transpose(1, 2).reshape(n, Dv, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # (n, tokens, Dv)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).type_as(patches)


# --------------------------------------------------------------------------------------------
# The model (the attention rule of image tokens: `image_masks` in layers.py)
# --------------------------------------------------------------------------------------------


class Gemma3Model(LanguageModel):
    """transformers' `model.`: the language model, the tower (`vision_tower`), the projector."""

    def __init__(self, config: Gemma3VLConfig) -> None:
        super().__init__(GemmaModel(config.text()))
        self.vision_tower = VisionTower(config.vision)
        self.multi_modal_projector = Projector(config)


class Gemma3ForConditionalGeneration(CausalLM):
    """The language model (`model.language_model`, `lm_head`), the tower and the projector. forward returns
    hidden states, as every family's; with `pixel_values` (n, 3, S, S), the images' features take the places
    of the soft tokens, each image's tokens attending to each other both ways."""

    block_types = (GemmaDecoderLayer,)
    towers = ("model.vision_tower", "model.multi_modal_projector")  # frozen unless a regex target names them

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """The soft token that stands for image features in the input, never an output (a sampler does not draw it)."""
        return (self.config.image_token_index,)

    def __init__(self, config: Gemma3VLConfig) -> None:
        cap = config.final_logit_softcapping
        head = SoftcappedLinear(config.hidden_size, config.vocab_size, cap) if cap else None
        super().__init__(config, Gemma3Model(config), head)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values (n, C, S, S) -> (n * mm_tokens_per_image, D), image after image."""
        return self.model.multi_modal_projector(self.model.vision_tower(pixel_values)).flatten(0, 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        hidden_layers: Collection[int] = (),
        attention_layers: Collection[int] = (),
        document_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        read_at: torch.Tensor | None = None,
    ):
        """input_ids (B, T) -> hidden (B, T, D); `pixel_values` (n, C, S, S) as the image processor makes them,
        the images in the order of their soft tokens over the rows."""
        text = self.model.language_model
        image_id = self.config.image_token_index
        if pixel_values is None:
            if image_id >= self.config.vocab_size:  # a soft token outside the vocabulary embeds as token 0
                input_ids = input_ids.masked_fill(input_ids == image_id, 0)
            rows = {} if read_at is None else {"read_at": read_at}
            return text(input_ids, attention_mask, position_ids, cache, hidden_layers, attention_layers,
                        document_ids, **rows)
        if cache is not None and cache.length or document_ids is not None or position_ids is not None \
                or read_at is not None:
            raise ValueError("gemma3: images go in a plain forward or a cache's first call (the prompt), not in "
                             "packed rows, a continued cache, with position_ids or read_at — not yet")
        placeholders = input_ids == image_id
        features = self.image_features(pixel_values)
        if int(placeholders.sum()) != features.shape[0]:
            raise ValueError(f"gemma3: {int(placeholders.sum())} image soft tokens for {features.shape[0]} image "
                             f"features ({pixel_values.shape[0]} images) — the ids and the images do not match")
        x = text.embed(input_ids.masked_fill(placeholders, 0) if image_id >= self.config.vocab_size else input_ids)
        x = x.masked_scatter(placeholders[..., None].to(x.device), features.to(x.dtype))
        return text.forward_images(x, attention_mask, image_blocks(input_ids, image_id), cache, hidden_layers,
                                   attention_layers)

    def checkpoint_parts(self) -> dict[str, tuple[str, tuple]]:
        """The layouts transformers saves and the Hub holds, each key filling its whole parameter:
        `language_model.model.*` (and `language_model.lm_head.weight` when not tied), `vision_tower.*` or
        `vision_tower.vision_model.*`, `multi_modal_projector.*`. Ours is the module tree of transformers'
        class (`model.language_model.*`, `model.vision_tower.*`, ...)."""
        out = {}
        for k in self.state_dict():
            if k.startswith("model.language_model."):
                out["language_model.model." + k[len("model.language_model."):]] = (k, ())
            elif k.startswith("model.vision_tower."):
                rest = k[len("model.vision_tower."):]
                out["vision_tower." + rest] = out["vision_tower.vision_model." + rest] = (k, ())
            elif k.startswith("model.multi_modal_projector."):
                out[k[len("model."):]] = (k, ())
            elif k == "lm_head.weight" and not self.config.tie_word_embeddings:
                out["language_model.lm_head.weight"] = (k, ())
        return out


def config_from_hf(d: dict[str, Any]) -> Gemma3VLConfig:
    """The registry's entry point (models/__init__.py)."""
    return Gemma3VLConfig.from_multimodal(d)
