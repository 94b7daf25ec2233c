"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`, model_type `qwen2_5_vl`): the vision tower and the
Qwen2 language model with its 3-D multimodal RoPE, importing only torch, the shared floor and llama.py
(whose Qwen2 decoder layers the language model is).

Read top to bottom: config (the text config is a Qwen2 `LlamaConfig` plus `mrope_section`; the vision
config its own dataclass), the vision tower (patch embedding, 2-D rotary, window attention, the patch
merger), the language model's positions (`rope_index`), the model.

Qwen3-VL (qwen3_vl.py) is this file with other parts: its config subclasses this one (the class attributes
`text_family`, `vision_class`, `default_mrope`, `interleaved` and `mrope_axes`), its model this model (its
`vision_tower`, and `image_features`, whose DeepStack features the language model adds to its first layers'
outputs); the positions, generation, checkpoint layouts and the forward are shared. Multimodal Qwen3.5
(qwen3_5.py) is Qwen3-VL's model with its own language model (`text_model`, whose RoPE reads 3-D positions
through `MRopeBody`).

The modules are transformers' (`model.language_model.layers.N.*`, `model.visual.blocks.N.*`, `lm_head`), so
peft's adapters on transformers' class name the same modules. The Hub's checkpoints (and transformers 5's
saves) store the same tensors as `model.layers.N.*` and `visual.*`: both layouts load key for key
(`checkpoint_parts`); a save writes the module tree's.

Vision tower. An image of (H, W) pixels, resized to multiples of `patch_size * spatial_merge_size`, is cut
into an (h, w) grid of patches of `temporal_patch_size` frames (an image repeats its one frame); the image
processor flattens each patch in (C, t, p, p) order and orders the patches by 2x2 merge block (row-major
over blocks, row-major inside each), so every `spatial_merge_size**2` consecutive patches are one block.
The patch embedding is a Conv3d whose kernel is the patch: a linear map of the flattened patch. Each
block of the ViT is pre-norm (RMSNorm) attention + SwiGLU MLP (with biases). Attention is bidirectional
within a window of `window_size` pixels (`window_size // patch_size // merge` blocks a side) except in the
`fullatt_block_indexes` layers, which see the whole image; never across images. The tokens are reordered
window by window once at the start (whole merge blocks), so every window is a contiguous run, and put back
after the merger. Rotary: half of each head's frequencies turn with the patch row, half with the column
(`theta`, head_dim / 2 of them, rotate-half layout). The merger: RMSNorm, the 4 patches of a block
concatenated, Linear-GELU-Linear to the language model's width: one token per block.

Language model. Image features replace the embeddings of the `<|image_pad|>` tokens (`image_token_id`),
in order. Positions are 3-D (temporal, height, width): a text token has its index on all three axes;
an image's tokens have (start, start + row, start + column) over its merged grid, and the text after it
resumes at start + max(rows, columns). Each RoPE frequency of the head follows one axis: the first
`mrope_section[0]` frequencies the temporal one, then height, then width (and the same again for the
second half of the rotate-half layout). With text only, all three axes are equal: Qwen2's RoPE.

Generation: a prompt with images goes in the cache's first call (`generate(..., pixel_values=,
image_grid_thw=)`); each row's offset (its largest prompt position + 1 - its real tokens) stays in the cache
(`states[ROPE_DELTA]`) and the tokens after the prompt count on from it, as transformers' `rope_deltas`.

Rows of several sequences (packing: `document_ids`) carry images too: each sequence's 3-D positions start
again (`rope_index`), the images in the order the sequences lie in the rows.

Videos (`pixel_values_videos`, `video_grid_thw`): the same tower on the frames, cut as an image's with
`temporal_patch_size` frames to a patch (a frame's windows and full attention stay inside the frame); the features
take the places of the `<|video_pad|>` tokens (`video_token_id`), and a video's tokens have positions (start +
int(k * tokens_per_second * second_per_grid_ts), start + row, start + column) for temporal patch k
(`video_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Collection, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.layers import (
    CausalLM,
    DecoderBody,
    GatedMLP,
    KVCache,
    LanguageModel,
    Ragged,
    RMSNorm,
    apply_rotary,
    generate,
    multimodal_to_hf,
)
from models.llama import LlamaConfig, LlamaDecoderLayer, LlamaModel

__all__ = ["Qwen2_5_VLConfig", "VisionConfig", "Qwen2_5_VLForConditionalGeneration", "KVCache", "generate",
           "config_from_hf", "rope_index"]

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

# transformers' defaults for the vision config's fields
_VISION_DEFAULTS: dict[str, Any] = dict(
    depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16, in_channels=3,
    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=4, window_size=112,
    out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31], rope_theta=10000.0)
# token ids of the outer config (transformers' defaults)
_TOKEN_DEFAULTS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                       vision_end_token_id=151653)


@dataclass
class VisionConfig:
    """The vision tower's hyper-parameters under `vision_config`'s names (`rope_theta` from its
    `rope_parameters`, which must be "axial")."""

    depth: int
    hidden_size: int
    hidden_act: str
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    tokens_per_second: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: list[int]
    rope_theta: float

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "VisionConfig":
        return vision_from_hf(cls, d, _VISION_DEFAULTS, "qwen2_5_vl")


def vision_from_hf(cls: type, d: dict[str, Any], defaults: dict[str, Any], family: str) -> Any:
    """A `vision_config` dict -> the dataclass `cls` (`defaults`: transformers' for the fields it leaves out);
    `rope_theta` from its "axial" `rope_parameters`; a field `cls` does not have is a ValueError."""
    d = dict(d)
    for name in ("model_type", "initializer_range", "dtype", "torch_dtype", "_name_or_path", "architectures",
                 "transformers_version"):
        d.pop(name, None)
    rope = d.pop("rope_parameters", None) or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"config.json: vision_config rope_type {rope.get('rope_type')!r} — {family}'s tower uses "
                         "'axial'")
    d.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"config.json: vision_config field(s) {unknown} are not understood by minitrain's "
                         f"{family} tower and may change its maths — remove them if harmless")
    return cls(**{**defaults, **d})


@dataclass
class Qwen2_5_VLConfig(LlamaConfig):
    """The language model's config (a Qwen2 `LlamaConfig`, model_type "qwen2_5_vl") plus what the
    multimodal model adds: `mrope_section` (how many RoPE frequencies follow the temporal, height and
    width axes), the tower's `vision`, the placeholder token ids, and `multimodal` (the outer config.json
    without its text_config, for `to_hf`)."""

    mrope_section: list[int] | None = None
    vision: VisionConfig | None = None
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    multimodal: dict[str, Any] | None = None

    # what Qwen3-VL's subclass changes: the text family (its layers and checks), the vision config's class,
    # the default `mrope_section` and its layout (`mrope_axes`)
    family: ClassVar[str] = "qwen2_5_vl"
    interleaved: ClassVar[bool] = False
    text_family: ClassVar[str] = "qwen2"
    text_class: ClassVar[type] = LlamaConfig  # the text model's config class (Qwen3-VL-MoE's: MoeConfig)
    vision_class: ClassVar[type] = VisionConfig
    default_mrope: ClassVar[tuple[int, ...]] = (16, 24, 24)

    def __post_init__(self) -> None:
        model_type, self.model_type = self.model_type, self.text_family  # the text model's checks are its family's
        super().__post_init__()
        self.model_type = model_type

    def layer_windows(self) -> list[int | None]:
        on = self.use_sliding_window and self.sliding_window
        return [self.sliding_window if on and t == "sliding_attention" else None for t in self.layer_types]

    def mrope_axes(self) -> torch.Tensor:
        """The axis (0 temporal, 1 height, 2 width) each of the head's hd RoPE features turns with: the first
        `mrope_section[0]` frequencies the temporal one, then height, then width, in both halves."""
        return torch.cat([torch.full((n,), i % 3) for i, n in enumerate(list(self.mrope_section) * 2)])

    @classmethod
    def from_multimodal(cls, d: dict[str, Any]) -> "Qwen2_5_VLConfig":
        """A `qwen2_5_vl` config.json: its text_config as Qwen2's, its vision_config, its token ids."""
        text = d.get("text_config")
        if not isinstance(text, dict) or not isinstance(d.get("vision_config"), dict):
            raise ValueError(f"config.json: a {cls.family} config without text_config / vision_config — restore the "
                             "checkpoint's config.json")
        text = dict(text, model_type=cls.text_family, tie_word_embeddings=d.get("tie_word_embeddings", False))
        rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
        section = rope.pop("mrope_section", None)
        interleaved = rope.pop("mrope_interleaved", None)
        if interleaved is not None and bool(interleaved) != cls.interleaved:
            raise ValueError(f"config.json: mrope_interleaved={interleaved!r}, but {cls.family} lays its M-RoPE "
                             f"sections out {'interleaved' if cls.interleaved else 'one after another'} — remove the field")
        if rope.get("rope_type", rope.get("type")) == "mrope":
            rope["rope_type"] = "default"
            rope.pop("type", None)
        text["rope_parameters"] = rope or None
        base = cls.text_class.from_hf(text)
        hd = base.head_dim
        section = list(section if section is not None else cls.default_mrope)
        if sum(section) != hd // 2:
            raise ValueError(f"config.json: mrope_section {section} sums to {sum(section)} — it must be head_dim / 2 "
                             f"= {hd // 2}")
        outer = {k: v for k, v in d.items() if k != "text_config"}
        if outer.pop("vocab_size", base.vocab_size) != base.vocab_size:  # a full fine-tuning run writes it there too
            raise ValueError(f"config.json: vocab_size={d['vocab_size']} and text_config.vocab_size={base.vocab_size} "
                             "disagree — make them equal")
        unknown = sorted(set(outer) - set(_TOKEN_DEFAULTS) - {"model_type", "vision_config", "architectures", "dtype",
                         "torch_dtype", "transformers_version", "tie_word_embeddings", "_name_or_path", "use_cache"})
        if unknown:
            raise ValueError(f"config.json: field(s) {unknown} are not understood by minitrain's {cls.family} "
                             "model — remove them if harmless")
        tokens = {k: outer.get(k, v) for k, v in _TOKEN_DEFAULTS.items()}
        kw = {f.name: getattr(base, f.name) for f in fields(cls.text_class)}
        return cls(**{**kw, "model_type": cls.family}, mrope_section=section,
                   vision=cls.vision_class.from_hf(d["vision_config"]), multimodal=outer, **tokens)

    def to_hf(self) -> dict[str, Any]:
        """The config.json transformers loads: the multimodal config read, the text config written anew."""
        text = self.text_class(**{f.name: getattr(self, f.name) for f in fields(self.text_class)
                                  if f.name != "model_type"}, model_type=self.text_family).to_hf()
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                                   "mrope_section": list(self.mrope_section)}
        if self.interleaved:
            text["rope_parameters"]["mrope_interleaved"] = True
        if text.pop("rope_scaling"):
            raise ValueError(f"{self.family}: a scaled RoPE cannot be written back yet")
        return multimodal_to_hf(text, dict(self.multimodal or {}), f"{self.family}_text")


# --------------------------------------------------------------------------------------------
# Vision tower
# --------------------------------------------------------------------------------------------


def window_layout(grid_thw: torch.Tensor, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """grid_thw (n, 3) of each image's patch grid -> (the merge blocks' order window by window (M,), each
    window's length in patches, image after image). `window`: blocks a side; a window at the right or
    bottom edge holds what is left."""
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        bh, bw = h // merge, w // merge
        index = torch.arange(t * bh * bw).view(t, bh, bw)
        for frame in index:
            for r in range(0, bh, window):
                for c in range(0, bw, window):
                    block = frame[r:r + window, c:c + window].flatten()
                    order.append(block + offset)
                    lengths.append(block.numel() * merge * merge)
        offset += t * bh * bw
    return torch.cat(order), lengths


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """Each patch's (row, column) in its image (N, 2), patches in the processor's order (merge block by
    merge block, row-major inside a block; the frames of a video repeat the grid)."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        rc = torch.stack([rows.reshape(blocks).transpose(1, 2).flatten(), cols.reshape(blocks).transpose(1, 2).flatten()], -1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def bidirectional(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention with no mask inside a run (`Ragged.attend`'s `attention`; its causal mask never comes:
    no window)."""
    return F.scaled_dot_product_attention(q, k, v)


class VisionAttention(nn.Module):
    """Multi-head attention with a fused `qkv` projection, 2-D rotary, no mask inside a run."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        N, D = x.shape
        q, k, v = self.qkv(x).view(N, 3, self.heads, -1).unbind(1)  # (N, H, hd) each
        # rotated in fp32 and cast back, as transformers
        q, k = (apply_rotary(t.float(), cos, sin).to(x.dtype) for t in (q, k))
        return self.proj(Ragged(tuple(lengths)).attend(q, k, v, bidirectional).reshape(N, D))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)); the norms' eps is 1e-6 whatever the config."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(c.hidden_size, 1e-6)
        self.norm2 = RMSNorm(c.hidden_size, 1e-6)
        self.attn = VisionAttention(c.hidden_size, c.num_heads)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (`proj.weight` (D, C, t, p, p); a bias in Qwen3-VL's) applied as what it is
    on whole patches: a linear map of each flattened patch."""

    def __init__(self, c: Any, bias: bool = False) -> None:
        super().__init__()
        p, t = c.patch_size, c.temporal_patch_size
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, (t, p, p), stride=(t, p, p), bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixel_values.to(w.dtype), w.flatten(1), self.proj.bias)  # (N, C t p p) -> (N, D)


class PatchMerger(nn.Module):
    """RMSNorm each patch, concatenate each merge block's patches, Linear-GELU-Linear (`mlp.0`, `mlp.2`)."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        d = c.hidden_size * c.spatial_merge_size ** 2
        self.ln_q = RMSNorm(c.hidden_size, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, c.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


def vision_rotary(c: Any, grid_thw: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's 2-D rotary for every patch: cos, sin (N, hd) fp32, the first hd/4 frequencies turning with
    the patch's row, the next hd/4 with its column (the same again for the second half)."""
    quarter = c.hidden_size // c.num_heads // 2
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
    freqs = (patch_positions(grid_thw, c.spatial_merge_size)[..., None].float() * inv_freq).flatten(1)  # (N, hd/2)
    emb = torch.cat([freqs, freqs], -1).to(device)
    return emb.cos(), emb.sin()


class VisionTower(nn.Module):
    """pixel_values (N, C t p p), grid_thw (n, 3) -> one feature (N / merge**2, out_hidden_size) per merge
    block, images in order (transformers' `visual`)."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        c = self.config
        unit = c.spatial_merge_size ** 2
        grid_thw = grid_thw.cpu()
        order, window_lengths = window_layout(grid_thw, c.spatial_merge_size,
                                              c.window_size // c.spatial_merge_size // c.patch_size)
        image_lengths = (grid_thw[:, 1] * grid_thw[:, 2]).repeat_interleave(grid_thw[:, 0]).tolist()
        x = self.patch_embed(pixel_values)  # (N, D)
        N = x.shape[0]
        order = order.to(x.device)

        def windowed(t: torch.Tensor) -> torch.Tensor:  # merge blocks put window by window
            return t.view(N // unit, unit, -1)[order].reshape(N, -1)

        x = windowed(x)
        cos, sin = (windowed(t) for t in vision_rotary(c, grid_thw, x.device))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, image_lengths if i in c.fullatt_block_indexes else window_lengths)
        return self.merger(x)[torch.argsort(order)]


# --------------------------------------------------------------------------------------------
# The language model's positions, the model
# --------------------------------------------------------------------------------------------

# the KV cache's `states` slot of a prompt with images: each row's position offset (B, 1), which
# `keep_rows` / `repeat_rows` carry with the rows
ROPE_DELTA = -1



def rope_index(input_ids: torch.Tensor, valid: torch.Tensor, grid_thw: torch.Tensor | None, image_token_id: int,
               merge: int, document_ids: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
               video_token_id: int | None = None, intervals: torch.Tensor | None = None) -> torch.Tensor:
    """The 3-D positions (3, B, T) of a batch: text tokens count on all three axes; each run of image tokens
    (one image, `grid_thw` (n, 3) in order over the rows) gets its merged grid's (start, start + row,
    start + column), and the next token start + max(rows, columns). A run of video tokens (`video_token_id`,
    `video_grid_thw` (v, 3) in order) the same, its frame k at start + int(k * `intervals`[v]) on the temporal
    axis (Qwen2.5-VL: tokens_per_second * seconds per temporal patch; 1 when None). Padding (valid False) gets 0.
    With `document_ids` (B, T) (packed rows), the count starts again at each sequence, as for each alone."""
    B, T = input_ids.shape
    pos = torch.zeros(3, B, T, dtype=torch.long)
    grids = {1: iter([] if grid_thw is None else grid_thw.tolist()),
             2: iter([] if video_grid_thw is None else video_grid_thw.tolist())}
    steps = iter([] if intervals is None else intervals.cpu())
    ids, valid = input_ids.cpu(), valid.cpu().bool()
    docs = None if document_ids is None else document_ids.cpu()
    video = -1 if video_grid_thw is None or video_token_id is None else video_token_id  # no videos: text
    for b in range(B):
        row = ids[b][valid[b]]
        kind = ((row == image_token_id).long() + 2 * (row == video).long()).tolist()  # 0 text, 1 image, 2 video
        d = [0] * len(row) if docs is None else docs[b][valid[b]].tolist()
        new = [t > 0 and d[t] != d[t - 1] for t in range(len(row))]  # a sequence starts here
        parts, start, i = [], 0, 0
        while i < len(row):
            if new[i]:
                start = 0
            j = i + 1
            while j < len(row) and kind[j] == kind[i] and not new[j]:
                j += 1
            if not kind[i]:
                parts.append(torch.arange(start, start + j - i).expand(3, -1))
                start += j - i
            else:
                t, h, w = next(grids[kind[i]])
                h, w = h // merge, w // merge
                frames = torch.arange(t)
                if kind[i] == 2 and intervals is not None:  # float32 and truncated, as transformers
                    frames = (frames * next(steps)).long()
                tt, hh, ww = torch.meshgrid(frames, torch.arange(h), torch.arange(w), indexing="ij")
                parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + start)
                start += max(h, w)
            i = j
        if parts:
            pos[:, b, valid[b]] = torch.cat(parts, 1)
    return pos.to(input_ids.device)


class MRopeBody:
    """A decoder body (a `DecoderBody` subclass comes after this in the bases) whose RoPE reads 3-D positions
    (3, B, T) too: each rotated feature turns with the axis `config.mrope_axes()` gives it (Qwen3.5's body too)."""

    def rope_tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if position_ids.dim() == 2:  # text: the three axes agree, so the sections make plain RoPE
            return super().rope_tables(position_ids, dtype)
        rotary = self.rotary["rope"]
        cos, sin = (torch.stack(t) for t in zip(*(rotary(p, dtype) for p in position_ids)))  # (3, B, T, rd)
        axis = self.config.mrope_axes().to(cos.device)  # (rd,)
        pick = axis.view(1, 1, 1, -1).expand(1, *cos.shape[1:])
        table = cos.gather(0, pick)[0], sin.gather(0, pick)[0]  # (B, T, rd)
        return [table] * len(self.layers)


class Qwen2_5_VLTextModel(MRopeBody, LlamaModel):
    """Qwen2's body (`model.language_model.`) whose RoPE reads 3-D positions (3, B, T) too (`mrope_section`)."""

    def __init__(self, config: Qwen2_5_VLConfig) -> None:
        DecoderBody.__init__(self, config)
        text = replace(config, model_type=config.text_family)  # the layers are Qwen2's (q/k/v biases), Qwen3's
        self.build(lambda c, i: LlamaDecoderLayer(text, i))


class Qwen2_5_VLModel(LanguageModel):
    """transformers' `model.`: the language model (`language_model`) and the tower (`visual`)."""

    def __init__(self, body: nn.Module, visual: nn.Module) -> None:
        super().__init__(body)
        self.visual = visual


class Qwen2_5_VLForConditionalGeneration(CausalLM):
    """The language model (`model.`, `lm_head`) and the vision tower (`visual.`). forward returns hidden
    states, as every family's; with `pixel_values` and `image_grid_thw`, the images' features take the
    places of the `<|image_pad|>` tokens and the positions are 3-D (`rope_index`)."""

    block_types = (LlamaDecoderLayer,)
    ignore_checkpoint_keys = (r"\.rotary_emb\.inv_freq$",)
    towers = ("model.visual",)  # frozen unless a regex target names it (LoRA suffixes adapt the language model)
    packs_images = True  # rows of several sequences (`document_ids`) may carry images (Qwen3.5's may not yet)

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """The ids that stand for image features in the input, never an output (a sampler does not draw them)."""
        return (self.config.image_token_id,)
    vision_tower = VisionTower  # the class of `model.visual` (Qwen3-VL's subclass has its own)
    text_model = Qwen2_5_VLTextModel  # the class of `model.language_model` (Qwen3.5's: its own body)

    def __init__(self, config: Qwen2_5_VLConfig) -> None:
        super().__init__(config, Qwen2_5_VLModel(self.text_model(config), self.vision_tower(config.vision)))

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
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
    ):
        """input_ids (B, T) -> hidden (B, T, D); `pixel_values` (N, C t p p) and `image_grid_thw` (n, 3) as
        the image processor makes them, the images in the order of their placeholders over the rows; the same
        for videos (`pixel_values_videos`, `video_grid_thw`, their `<|video_pad|>` tokens), with
        `second_per_grid_ts` (v,) the seconds each temporal patch spans (Qwen2.5-VL's positions; None: 1)."""
        if pixel_values is None and pixel_values_videos is None:
            if cache is not None and ROPE_DELTA in cache.states and position_ids is None:
                position_ids = self._continued_positions(input_ids, attention_mask, cache)
            return super().forward(input_ids, attention_mask, position_ids, cache, hidden_layers, attention_layers,
                                   document_ids)
        if cache is not None and cache.length:
            raise ValueError(f"{self.config.family}: images go in a plain forward, packed rows or a cache's first call "
                             "(the prompt), not in a continued cache")
        if document_ids is not None and not self.packs_images:
            raise ValueError(f"{self.config.family}: images in packed rows are not supported yet — pack rows without "
                             "images, or set packing=false")
        text = self.model.language_model
        x = text.embed(input_ids)
        additions: list[torch.Tensor] = []
        video_token = getattr(self.config, "video_token_id", None)  # (multimodal Qwen3.5's config has none yet)
        for kind, token, pixels, grid in (("image", self.config.image_token_id, pixel_values, image_grid_thw),
                                          ("video", video_token, pixel_values_videos, video_grid_thw)):
            if pixels is None:
                continue
            placeholders = input_ids == token
            features, deep = self.image_features(pixels, grid)  # the tower reads a video's frames as an image's
            if int(placeholders.sum()) != features.shape[0]:
                raise ValueError(f"{self.config.family}: {int(placeholders.sum())} {kind} placeholder tokens for "
                                 f"{features.shape[0]} {kind} features — the ids and the {kind}s do not match")
            at = placeholders[..., None].to(x.device)
            x = x.masked_scatter(at, features.to(x.dtype))
            deep = [torch.zeros_like(x).masked_scatter(at, f.to(x.dtype)) for f in deep]  # (B, T, D) each
            additions = [a + d for a, d in zip(additions, deep)] if additions else deep
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if document_ids is not None:  # packed rows: the collator's positions count tokens; these restart per sequence
            valid = document_ids >= 0
        if position_ids is None or document_ids is not None:
            videos, intervals = (None, None) if video_grid_thw is None else self.video_positions(video_grid_thw,
                                                                                              second_per_grid_ts)
            position_ids = rope_index(input_ids, valid, image_grid_thw, self.config.image_token_id,
                                      self.config.vision.spatial_merge_size, document_ids, videos, video_token,
                                      intervals)
            if cache is not None:  # the tokens after the prompt continue from its largest position
                last = position_ids.masked_fill(~valid.to(position_ids.device), -1).amax(dim=(0, 2))  # (B,)
                cache.states[ROPE_DELTA] = ((last + 1 - valid.sum(1).to(last.device))[:, None],)
        return text(input_ids, attention_mask, position_ids, cache, hidden_layers, attention_layers, document_ids,
                    embeds=x, additions=additions)

    def video_positions(self, video_grid_thw: torch.Tensor, second_per_grid_ts: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The videos' grids as `rope_index` walks them and each one's temporal step: Qwen2.5-VL's video is one run
        of tokens whose temporal patch k sits at int(k * tokens_per_second * second_per_grid_ts) (float32, as
        transformers; seconds 1 when not given)."""
        seconds = (torch.ones(len(video_grid_thw)) if second_per_grid_ts is None
                   else torch.as_tensor(second_per_grid_ts, dtype=torch.float32).cpu())
        return video_grid_thw, self.config.vision.tokens_per_second * seconds

    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tower's features (one per `<|image_pad|>`), and what it adds to the first layers' outputs at
        those places (Qwen3-VL's DeepStack; none here)."""
        return self.model.visual(pixel_values, image_grid_thw), []


    @staticmethod
    def _continued_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: KVCache
                             ) -> torch.Tensor:
        """The positions (B, T) of tokens that continue a prompt with images through the cache: the count of
        real tokens before each, plus the row's offset (its largest prompt position + 1 - its real tokens)."""
        valid = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device).long()
        before = cache.mask[:, :cache.length].sum(1, keepdim=True) if cache.mask is not None else 0
        return (before + valid.cumsum(-1) - 1).clamp(min=0) + cache.states[ROPE_DELTA][0].to(input_ids.device)

    def checkpoint_parts(self) -> dict[str, tuple[str, tuple]]:
        """The Hub's layout of the same tensors (`visual.*` for `model.visual.*`, `model.*` for
        `model.language_model.*`; transformers 5 saves it too): each key fills its whole parameter. Ours, the
        module tree of transformers' class (so that peft's adapters name the same modules), is what
        transformers 4.52 to 4.5x saved."""
        out = {}
        for k in self.state_dict():
            if k.startswith("model.visual."):
                out[k[len("model."):]] = (k, ())
            elif k.startswith("model.language_model."):
                out["model." + k[len("model.language_model."):]] = (k, ())
        return out


def config_from_hf(d: dict[str, Any]) -> Qwen2_5_VLConfig:
    """The registry's entry point (models/__init__.py)."""
    return Qwen2_5_VLConfig.from_multimodal(d)
