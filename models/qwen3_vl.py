"""Qwen3-VL (`Qwen3VLForConditionalGeneration`, model_type `qwen3_vl`): Qwen2.5-VL's design (qwen2_5_vl.py,
whose positions, generation, layouts and forward it reuses) with a different tower, Qwen3's language model,
interleaved M-RoPE and DeepStack. Imports only torch, the shared floor, llama.py and qwen2_5_vl.py.

Read top to bottom: config (the text config is a Qwen3 `LlamaConfig` plus `mrope_section`, the M-RoPE
sections interleaved; the vision config its own dataclass), the vision tower, the model.

Vision tower. Images are cut into patches as for Qwen2.5-VL (patches of 16 pixels on the Hub's checkpoints, in
merge-block order; `minitrain/data/images.py`). The patch embedding is the checkpoint's Conv3d (with a bias) as
a linear map of each flattened patch, plus a learned position embedding: a square table of
`num_position_embeddings` (side x side) entries resampled bilinearly (align_corners) to the image's patch grid,
as transformers (`pos_embed`). The blocks are pre-norm LayerNorm (eps 1e-6) attention with 2-D rotary (as
Qwen2.5-VL's) over each image alone (no windows), and a GELU (tanh) MLP `linear_fc1` / `linear_fc2`. The
merger: LayerNorm of each patch, the 4 patches of a merge block concatenated, Linear-GELU-Linear. DeepStack:
after each block in `deepstack_visual_indexes`, a merger of its own (`deepstack_merger_list.k`, LayerNorm after
the concatenation) makes one more feature per merge block; the k-th is added to the output of language layer
k at the image positions.

Language model. Qwen3's layers (q/k norms). Positions as Qwen2.5-VL's (`rope_index`: an image's tokens at
(start, start + row, start + column), the text after it at start + max(rows, columns)). The RoPE frequencies
alternate between the axes: frequency j follows height when j % 3 == 1 and j < 3 mrope_section[1], width when
j % 3 == 2 and j < 3 mrope_section[2], otherwise the temporal axis (transformers' `mrope_interleaved`, which its
Qwen3-VL applies whatever the flag says; a config that sets it false is refused).

Checkpoints: transformers 5 saves, and the Hub's Qwen3-VL folders hold, `model.language_model.*` and
`model.visual.*`: our module tree, key for key; the flat layout (`model.layers.*`, `visual.*`) loads too.

Qwen3-VL-MoE (`qwen3_vl_moe`) is this model over Qwen3-MoE's language model: models/qwen3_vl_moe.py.

Videos (`pixel_values_videos`, `video_grid_thw`): the tower reads their frames as an image's (DeepStack
features too, added at the `<|video_pad|>` places); the processor writes each temporal patch as its own run
`<t seconds><|vision_start|><|video_pad|> x n<|vision_end|>` (minitrain/data/videos.py), placed as an image of
one frame (`video_positions`): time is in the text, not in the positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
import torch.nn as nn

from models.layers import KVCache, activation, generate
from models.qwen2_5_vl import (
    PatchEmbed,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    VisionAttention,
    patch_positions,
    rope_index,
    vision_from_hf,
    vision_rotary,
)

__all__ = ["Qwen3VLConfig", "Qwen3VLVisionConfig", "Qwen3VLForConditionalGeneration", "KVCache", "generate",
           "config_from_hf", "rope_index", "interleaved_axes"]

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

# transformers' defaults for the vision config's fields
VISION_DEFAULTS: dict[str, Any] = dict(
    depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16, in_channels=3,
    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584, num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24], rope_theta=10000.0)


@dataclass
class Qwen3VLVisionConfig:
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
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: list[int]
    rope_theta: float

    def __post_init__(self) -> None:
        side = int(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"config.json: vision_config num_position_embeddings={self.num_position_embeddings} is "
                             "not a square — the position table is side x side")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"config.json: vision_config deepstack_visual_indexes {bad} are not blocks of the "
                             f"{self.depth}-block tower — fix the config")
        activation(self.hidden_act)  # a name we do not know: one line now

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Qwen3VLVisionConfig":
        return vision_from_hf(cls, d, VISION_DEFAULTS, "qwen3_vl")


@dataclass
class Qwen3VLConfig(Qwen2_5_VLConfig):
    """Qwen2.5-VL's config with Qwen3's text model (model_type "qwen3_vl"), Qwen3-VL's tower and the M-RoPE
    sections interleaved."""

    family: ClassVar[str] = "qwen3_vl"
    text_family: ClassVar[str] = "qwen3"
    vision_class: ClassVar[type] = Qwen3VLVisionConfig
    default_mrope: ClassVar[tuple[int, ...]] = (24, 20, 20)
    interleaved: ClassVar[bool] = True

    def mrope_axes(self) -> torch.Tensor:
        return interleaved_axes(self.head_dim // 2, self.mrope_section)


def interleaved_axes(n: int, section: Sequence[int]) -> torch.Tensor:
    """The axis (0 temporal, 1 height, 2 width) of each of the 2n rotated features (n frequencies, rotate-half
    layout): frequency j follows height when j % 3 == 1 and j < 3 section[1], width when j % 3 == 2 and
    j < 3 section[2], else the temporal axis; the same in both halves (Qwen3-VL's and Qwen3.5's M-RoPE)."""
    j = torch.arange(n)
    _, h, w = section
    axis = torch.where((j % 3 == 1) & (j < 3 * h), 1, torch.where((j % 3 == 2) & (j < 3 * w), 2, 0))
    return torch.cat([axis, axis])


# --------------------------------------------------------------------------------------------
# Vision tower
# --------------------------------------------------------------------------------------------


def position_taps(grid_thw: torch.Tensor, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bilinear resampling (align_corners) of a side x side position table to each image's patch grid:
    per patch (processor order), the 4 table rows it reads (N, 4) and their weights (N, 4) fp32, as
    transformers' `get_vision_interpolation_indices_and_weights`."""
    rc = patch_positions(grid_thw, merge).float()  # (N, 2)
    sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grid_thw.tolist()]).float()
    src = rc * (side - 1) / (sizes - 1).clamp(min=1)  # (N, 2) in table coordinates
    floor = src.floor()
    taps = (floor.long()[..., None] + torch.arange(2)).clamp(0, side - 1)  # (N, 2 axes, 2)
    weights = (1 - (src[..., None] - floor[..., None] - torch.arange(2)).abs()).clamp(min=0)
    index = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).flatten(1)  # (row tap, column tap) -> (N, 4)
    return index, (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(1)


class VisionMLP(nn.Module):
    """linear_fc2(act(linear_fc1(x))), with biases."""

    def __init__(self, c: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.linear_fc2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)); LayerNorms of eps 1e-6."""

    def __init__(self, c: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.attn = VisionAttention(c.hidden_size, c.num_heads)
        self.mlp = VisionMLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm (of each patch, or with `after` of the concatenation), each merge block's patches
    concatenated, Linear-GELU-Linear to the language model's width."""

    def __init__(self, c: Qwen3VLVisionConfig, after: bool) -> None:
        super().__init__()
        d = c.hidden_size * c.spatial_merge_size ** 2
        self.after = after
        self.norm = nn.LayerNorm(d if after else c.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(d, d)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(d, c.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.linear_fc1.in_features
        x = self.norm(x.view(-1, d)) if self.after else self.norm(x).view(-1, d)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """pixel_values (N, C t p p), grid_thw (n, 3) -> (one feature (N / merge**2, out_hidden_size) per merge
    block, images in order; the DeepStack features, one such tensor per `deepstack_visual_indexes`)."""

    def __init__(self, c: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c, bias=True)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c, after=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(c, after=True) for _ in c.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        c = self.config
        grid_thw = grid_thw.cpu()
        x = self.patch_embed(pixel_values)  # (N, D)
        index, weights = (t.to(x.device) for t in position_taps(grid_thw, int(c.num_position_embeddings ** 0.5),
                                                                c.spatial_merge_size))
        x = x + (self.pos_embed(index) * weights[..., None]).sum(1).to(x.dtype)
        cos, sin = vision_rotary(c, grid_thw, x.device)
        lengths = (grid_thw[:, 1] * grid_thw[:, 2]).repeat_interleave(grid_thw[:, 0]).tolist()  # each frame alone
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if i in c.deepstack_visual_indexes:
                deep.append(self.deepstack_merger_list[c.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deep


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """The language model (`model.language_model.`, `lm_head`) and the vision tower (`model.visual.`):
    Qwen2.5-VL's forward (hidden states; with `pixel_values` and `image_grid_thw`, the images' features in
    the `<|image_pad|>` places and 3-D positions), with the DeepStack features added to the first language
    layers' outputs."""

    vision_tower = VisionTower

    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tower's features and its DeepStack features (added to language layers 0, 1, ...)."""
        return self.model.visual(pixel_values, image_grid_thw)

    def video_positions(self, video_grid_thw: torch.Tensor, second_per_grid_ts: torch.Tensor | None
                        ) -> tuple[torch.Tensor, None]:
        """Each frame (temporal patch) of a video is a run of tokens of its own, placed as an image's (its timestamp
        text between the runs): the grids (t, h, w) split into t grids (1, h, w); `second_per_grid_ts` unused."""
        grid = video_grid_thw.cpu()
        return torch.cat([grid[:, 1:].new_ones(len(grid), 1), grid[:, 1:]], 1).repeat_interleave(grid[:, 0], 0), None


def config_from_hf(d: dict[str, Any]) -> Qwen3VLConfig:
    """The registry's entry point (models/__init__.py)."""
    return Qwen3VLConfig.from_multimodal(d)
