"""Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`, model_type `qwen3_vl_moe`; Qwen3-VL-30B-A3B,
235B-A22B): Qwen3-VL's model (qwen3_vl.py: its tower with DeepStack, interleaved M-RoPE, the image forward)
over Qwen3-MoE's language model (moe.py: Qwen3's attention, a softmax router over every expert whose top k
always renormalise, fused experts, dense layers where `mlp_only_layers` / `decoder_sparse_step` put them,
the load-balancing loss and expert metrics). Imports only torch, the shared floor, moe.py, qwen2_5_vl.py and
qwen3_vl.py.

Checkpoints: `model.language_model.*` and `model.visual.*`, our module tree key for key, each sparse layer's
experts fused: the model holds `mlp.experts.gate_up_proj` (E, 2F, D) and `mlp.experts.down_proj` (E, D, F), as
transformers does in memory and saves (so peft's `target_parameters` adapters match); the Hub's files hold them
transposed, (E, D, 2F) and (E, F, D), which the loader transposes (`checkpoint_conversions`: a tensor of the
model's shape is read as it is, as transformers' `Transpose(check_dims=True)` does). The flat layout
(`model.layers.*`, `visual.*`) is not read.

`norm_topk_prob` is not a field of this family: its router always renormalises the top k (transformers'
`Qwen3VLMoeTextTopKRouter`). Peft maps no per-expert name onto these experts (its conversions for this
family only transpose), so `gate_proj` / `up_proj` / `down_proj` targets name the dense layers' linears
(`down_proj` also the experts' parameter of that name); `experts.gate_up_proj`, `experts.down_proj` name
the experts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar

import torch

from models.layers import DecoderBody, KVCache, MoeCausalLM, generate
from models.moe import MoeConfig, MoeDecoderLayer, MoeModel
from models.qwen2_5_vl import MRopeBody, Qwen2_5_VLConfig
from models.qwen3_vl import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLVisionConfig, interleaved_axes

__all__ = ["Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "KVCache", "generate", "config_from_hf"]

@dataclass
class Qwen3VLMoeConfig(MoeConfig):
    """Qwen3-MoE's config (`text_config`, read as model_type "qwen3_moe" with `norm_topk_prob` true) plus
    Qwen3-VL's multimodal fields (`mrope_section`, the tower's `vision`, the placeholder ids, the outer
    config for `to_hf`); model_type "qwen3_vl_moe"."""

    mrope_section: list[int] | None = None
    vision: Qwen3VLVisionConfig | None = None
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    multimodal: dict[str, Any] | None = None

    family: ClassVar[str] = "qwen3_vl_moe"
    text_family: ClassVar[str] = "qwen3_moe"
    text_class: ClassVar[type] = MoeConfig
    vision_class: ClassVar[type] = Qwen3VLVisionConfig
    default_mrope: ClassVar[tuple[int, ...]] = Qwen3VLConfig.default_mrope
    interleaved: ClassVar[bool] = True

    def __post_init__(self) -> None:
        model_type, self.model_type = self.model_type, self.text_family  # the text model's checks are Qwen3-MoE's
        super().__post_init__()
        self.model_type = model_type

    def mrope_axes(self) -> torch.Tensor:
        return interleaved_axes(self.head_dim // 2, self.mrope_section)

    @classmethod
    def from_multimodal(cls, d: dict[str, Any]) -> "Qwen3VLMoeConfig":
        """A `qwen3_vl_moe` config.json (Qwen2.5-VL's reading, `Qwen2_5_VLConfig.from_multimodal`, with
        Qwen3-MoE's text config). `norm_topk_prob` given false is refused: this family renormalises always."""
        text = d.get("text_config")
        if isinstance(text, dict):
            if text.get("norm_topk_prob", True) is not True:
                raise ValueError("config.json: text_config norm_topk_prob=false — Qwen3-VL-MoE's router always "
                                 "renormalises its top k (transformers ignores the field); remove it")
            d = {**d, "text_config": {**text, "norm_topk_prob": True}}
        return Qwen2_5_VLConfig.from_multimodal.__func__(cls, d)

    to_hf = Qwen2_5_VLConfig.to_hf


class Qwen3VLMoeTextModel(MRopeBody, MoeModel):
    """Qwen3-MoE's body (`model.language_model.`) whose RoPE reads 3-D positions (3, B, T) too."""

    def __init__(self, config: Qwen3VLMoeConfig) -> None:
        DecoderBody.__init__(self, config)
        text = replace(config, model_type=config.text_family)  # the layers are Qwen3-MoE's
        self.build(lambda c, i: MoeDecoderLayer(text, i))


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration, MoeCausalLM):
    """Qwen3-VL's model (tower, DeepStack, image forward) over Qwen3-MoE's language model, with its
    load-balancing loss and expert metrics (`MoeCausalLM`)."""

    block_types = (MoeDecoderLayer,)
    text_model = Qwen3VLMoeTextModel

    def checkpoint_parts(self) -> dict[str, tuple[str, tuple]]:
        """None: the fused experts come through `checkpoint_conversions`; the flat layout is not read."""
        return {}

    def checkpoint_conversions(self) -> dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor]]]:
        """Each sparse layer's fused experts, stored transposed (the module docstring): {parameter: ((its
        key,), the transpose when the stored shape is not the model's)}."""
        c = self.config
        E, D, F = c.num_experts, c.hidden_size, c.moe_intermediate_size
        out = {}
        for i, sparse in enumerate(c.sparse_layers()):
            if sparse:
                for name, shape in (("gate_up_proj", (E, 2 * F, D)), ("down_proj", (E, D, F))):
                    key = f"model.language_model.layers.{i}.mlp.experts.{name}"
                    out[key] = ((key,), _as_shape(shape))
        return out


def _as_shape(shape: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The stored experts in the model's layout: as they are when they have its shape, else transposed."""
    def convert(t: torch.Tensor) -> torch.Tensor:
        return t if tuple(t.shape) == shape else t.transpose(1, 2).contiguous()
    return convert


def config_from_hf(d: dict[str, Any]) -> Qwen3VLMoeConfig:
    """The registry's entry point (models/__init__.py)."""
    return Qwen3VLMoeConfig.from_multimodal(d)
