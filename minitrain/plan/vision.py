"""The memory plan of the vision-language checkpoints: Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, multimodal Qwen3.5 (dense
and MoE), multimodal Gemma 3 and Gemma 4 (`models/qwen2_5_vl.py`, `models/qwen3_vl.py`, `models/qwen3_vl_moe.py`,
`models/qwen3_5.py`, `models/gemma3_vl.py`, `models/gemma4_vl.py`).

The language model is planned as its text family (Qwen2's, Qwen3's, Qwen3-MoE's, Qwen3.5's block by block, Gemma
3's shape, from `text_config`; Qwen3.5's tower is Qwen3-VL's without DeepStack);
the image placeholders are positions of its rows, so `seq` already counts them. The tower adds (`Tower`, from
`vision_config`; P = patches, `patches_per_token` per placeholder: merge**2 for Qwen, the pooling kernel**2
for Gemma 3):

- its weights (the compute dtype; fp32 under `finetune=full`, with their gradients and AdamW moments);
- the batch's pixel values, fp32, in every moment (P x C t p p x 4: Qwen's patches of `temporal_patch_size`
  frames; Gemma 3's whole images);
- frozen (LoRA on the language model): nothing else. No tower weight and no pixel needs a gradient, so
  autograd keeps nothing of its forward, which is over before the language model's starts;
- trained (`finetune=full`): everything its blocks keep for backward, per patch per block (read off the
  autograd graph, fp32; Dv wide, Fv MLP, H heads): Qwen2.5-VL (RMSNorms keep their input, normalised input
  and output; the fused qkv output, rotated q and k, SDPA's output, the SwiGLU's four tensors)
  13 Dv + 4 Fv + H + 2 floats; Qwen3-VL (LayerNorms: input, mean, rstd; a GELU MLP) 11 Dv + 2 Fv + H + 4;
  Gemma 3's SigLIP 8 Dv + 2 Fv + H + 4; plus the 2-D rotary tables (Qwen), the position taps (Qwen3-VL)
  and the merger / projector (and Qwen3-VL's DeepStack mergers), kept until the backward reaches the tower,
  after the language model's: the "vision tower backward" moment holds every language-model gradient then.

Gemma 4 (`Gemma4VLShape`, over its block-by-block text plan): each image padded to its budget of patches (k**2
a soft token when the image fills it), the pixels with their int64 positions; the frozen tower's forward is a
moment of its own (the pixels' scaled copies, one block's working set, or the pooler's one-hot over the budget:
`max_soft_tokens`, the processor's default 280 unless told), before the language model's. LoRA / QLoRA on the
language model only: `finetune=full` and a regular-expression `lora_targets` reaching the tower are refused.

`RunShape.image_tokens`: the placeholders in a micro-batch; None (what `run_shape` gives a recipe) counts
every position of every row as one: the worst case, since how many images a row holds is the data's.
Several ranks (multimodal Qwen3.5 and Gemma 4, `WithTowerByBlock`; LoRA / QLoRA on the language model, the tower
frozen): `minitrain.plan.sharded`, the tower's parameters in FSDP2's root (`Tower.shapes`, `root_tensors`: the
shapes the model holds, dim 0 what FSDP2 cuts), measured on 2 gloo ranks (tests/test_plan_ranks.py). Refused there:
full fine-tuning (its tower's gradients in the root, unmeasured) and `quantize=` under fsdp (the tower's linears
are quantized by rows too); the other vision-language families on several ranks.

Modelled: LoRA / QLoRA on the language model and full fine-tuning in one process (multimodal Gemma 4: LoRA / QLoRA
only), measured against the CPU
(tests/test_plan_vision.py) on image rows; bf16 full fine-tuning counts the tower's activations as fp32
(autocast's bf16 tensors and copies unmodelled: the plan 1.16 x the measured peak, on the safe side); the
tower's own forward working set (one block at a time) is not a moment; the adapters of a regular-expression
`lora_targets` (the merger's, the tower's) are not counted, and under `quantize` the tower's linears are counted
in the compute dtype (notes say so).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from minitrain.errors import UserError
from minitrain.plan.decoder import GemmaShape, ModelShape
from minitrain.plan.gemma4 import Gemma4MoeShape, Gemma4Shape
from minitrain.plan.moe import MoeShape
from minitrain.plan.qwen3_5 import Qwen3_5MoeShape, Qwen3_5Shape
from minitrain.plan.run_shape import RunShape, Term

# transformers' defaults for the vision_config fields a config.json may leave out
_QWEN2_5 = dict(depth=32, hidden_size=3584, intermediate_size=3420, num_heads=16, in_channels=3, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584)
_QWEN3 = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584, num_position_embeddings=2304,
              deepstack_visual_indexes=[8, 16, 24])
_SIGLIP = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, num_channels=3,
               image_size=224, patch_size=16)
_GEMMA4 = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12, head_dim=64,
               pooling_kernel_size=3, patch_size=16, position_embedding_size=10240)  # Gemma4VisionConfig's
# the towers of Qwen3-VL's design (Qwen3.5's: no DeepStack) -> transformers' defaults of their vision_config
_QWEN3_TOWERS = {"qwen3_vl": _QWEN3, "qwen3_vl_moe": _QWEN3,
                 **dict.fromkeys(("qwen3_5", "qwen3_5_moe"), {**_QWEN3, "deepstack_visual_indexes": []})}
# floats a block keeps per patch: (x Dv, x Fv, + heads, + the norms' statistics)
_BLOCK = {"qwen2_5_vl": (13, 4, 2), "gemma3": (8, 2, 4), **dict.fromkeys(_QWEN3_TOWERS, (11, 2, 4))}


def _linear(i: int, o: int) -> list[tuple[int, ...]]:
    """A linear's weight (out, in) and bias, as the model holds them."""
    return [(o, i), (o,)]


@dataclass(frozen=True)
class Tower:
    """A vision tower's dims as the plan counts them: `shapes` each parameter's (the merger or projector's too; dim 0
    first, as the model holds it: what FSDP2 shards), `buffers` the numel of each buffer (whole on every rank),
    `outside` the floats per patch kept outside the blocks when it trains."""

    kind: str
    depth: int
    width: int
    ffn: int
    heads: int
    patch_values: int  # pixel values per patch (C t p p)
    patches_per_token: int  # patches behind one image placeholder
    shapes: tuple[tuple[int, ...], ...]
    outside: float
    buffers: tuple[int, ...] = ()

    @property
    def tensors(self) -> list[int]:
        """The numel of each parameter and buffer."""
        return [math.prod(t) for t in self.shapes] + list(self.buffers)

    @classmethod
    def from_hf(cls, kind: str, d: dict[str, Any], text_width: int, tokens_per_image: int) -> "Tower":
        if kind == "gemma4":
            return cls.gemma4(d, text_width)
        if kind == "gemma3":
            v = {**_SIGLIP, **d}
            Dv, F, C, p = v["hidden_size"], v["intermediate_size"], v["num_channels"], v["patch_size"]
            side = v["image_size"] // p
            k2 = side * side // tokens_per_image  # the average pool's kernel, squared
            layer = [(Dv,)] * 4 + 4 * _linear(Dv, Dv) + _linear(Dv, F) + _linear(F, Dv)
            # the patch convolution, the position table, the layers, post_layernorm, the projector's norm and matrix
            tensors = ([(Dv, C * p * p), (Dv,), (side * side, Dv)] + layer * v["num_hidden_layers"]
                       + [(Dv,)] * 3 + [(Dv, text_width)])
            # post_layernorm (input, output, 2 stats), the pool's input copy, the pooled tokens' RMSNorm
            outside = 3 * Dv + 2 + (3 * Dv + 1) / k2
            return cls(kind, v["num_hidden_layers"], Dv, F, v["num_attention_heads"], C * p * p, k2, tuple(tensors),
                       outside)
        v = {**_QWEN3_TOWERS.get(kind, _QWEN2_5), **d}
        Dv, F, Do, m = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"], v["spatial_merge_size"]
        patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
        hd, M = Dv // v["num_heads"], Dv * m * m
        attn = _linear(Dv, 3 * Dv) + _linear(Dv, Dv)
        if kind in _QWEN3_TOWERS:
            deep = len(v["deepstack_visual_indexes"])
            block = [(Dv,)] * 4 + attn + _linear(Dv, F) + _linear(F, Dv)
            merger = [(Dv,)] * 2 + _linear(M, M) + _linear(M, Do)
            deep_merger = [(M,)] * 2 + _linear(M, M) + _linear(M, Do)
            tensors = ([(Dv, patch), (Dv,), (v["num_position_embeddings"], Dv)] + block * v["depth"] + merger
                       + deep_merger * deep)
            # rotary tables, the position taps (int64 index + fp32 weights), the merger (LayerNorm input, output,
            # 2 stats; fc1's output and GELU's) and each DeepStack merger (its norm's output + stats, fc1, GELU)
            outside = 2 * hd + 12 + 4 * Dv + 2 + deep * (3 * Dv + 2 / (m * m))
        else:
            block = [(Dv,)] * 2 + attn + 2 * _linear(Dv, F) + _linear(F, Dv)
            tensors = [(Dv, patch)] + block * v["depth"] + [(Dv,)] + _linear(M, M) + _linear(M, Do)
            outside = 2 * hd + 5 * Dv + 1  # rotary tables; the merger's RMSNorm (3 Dv + 1), fc1 and GELU
        return cls(kind, v["depth"], Dv, F, v["num_heads"], patch, m * m, tuple(tensors), outside)

    @classmethod
    def gemma4(cls, d: dict[str, Any], text_width: int) -> "Tower":
        """Gemma 4's tower (models/gemma4_vl.py): the patch embedder (`input_proj`, the x / y position table), the
        sandwich blocks (q / k / v / o, q / k norms, four norms, GeGLU), the clipped linears' bounds and the
        standardisation's buffers when the config has them (`buffers`), `embed_vision`'s projection. Each image is padded to
        the budget (`max_soft_tokens` k**2 patches): an image that fills it has k**2 patches a soft token; a patch's
        values come with its int64 (x, y) position (4 floats' bytes)."""
        v = {**_GEMMA4, **d}
        Dv, F, H, hd, p = v["hidden_size"], v["intermediate_size"], v["num_attention_heads"], v["head_dim"], v["patch_size"]
        clips = 7 * 4 if v.get("use_clipped_linears") else 0  # input / output min / max of each linear
        layer = [(H * hd, Dv)] * 3 + [(Dv, H * hd), (hd,), (hd,)] + [(Dv,)] * 4 + [(F, Dv)] * 2 + [(Dv, F)]
        tensors = [(Dv, 3 * p * p), (2, v["position_embedding_size"], Dv)] + layer * v["num_hidden_layers"]
        buffers = [1] * clips * v["num_hidden_layers"] + [Dv] * (2 if v.get("standardize") else 0)
        return cls("gemma4", v["num_hidden_layers"], Dv, F, H, 3 * p * p + 4, v["pooling_kernel_size"] ** 2,
                   tuple(tensors + [(text_width, Dv)]), 0.0, tuple(buffers))

    def saved_per_patch(self) -> float:
        """Floats a trained tower keeps for backward per patch (all its blocks and the rest)."""
        d, f, stats = _BLOCK[self.kind]
        return self.depth * (d * self.width + f * self.ffn + self.heads + stats) + self.outside


class WithTower:
    """What the vision-language shapes add to their text family's (`ModelShape`, `GemmaShape`)."""

    tower: Tower
    MODEL_TYPES: ClassVar[dict[str, str]] = {}  # config.json's model_type -> the text family's

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> Any:
        kind = d.get("model_type")
        text, vision = d.get("text_config"), d.get("vision_config")
        if not isinstance(text, dict) or not isinstance(vision, dict):
            raise UserError(f"{where}: a {kind} config without text_config / vision_config — restore the "
                            "checkpoint's config.json")
        tied = d.get("tie_word_embeddings", kind in ("gemma3", "gemma4"))  # the outer one is what transformers honours
        shape = super().from_hf({**text, "model_type": cls.MODEL_TYPES[kind], "tie_word_embeddings": tied}, where)
        per_image = int(d.get("mm_tokens_per_image", 256))
        return replace(shape, tower=Tower.from_hf(kind, vision, shape.hidden_size, per_image))

    RANKS: ClassVar[bool] = False  # whether LoRA on several ranks is modelled (multimodal Qwen3.5, Gemma 4)

    def check_run(self, run: RunShape) -> None:
        several = run.world > 1 or run.parallel == "fsdp"
        ranks = several and self.RANKS
        refused = [what for what, asked in (
            ("several ranks", several and not self.RANKS), ("finetune=full on several ranks", ranks and run.full),
            (f"quantize={run.quantize} under fsdp: the tower's linears are quantized by rows too",
             ranks and run.parallel == "fsdp" and run.quantize != "none"),
            ("a teacher", run.teacher is not None), ("GRPO's sampler", run.sample_rows)) if asked]
        if refused:
            raise UserError("the memory plan models vision-language LoRA / QLoRA and full fine-tuning runs in one "
                            "process, and multimodal Qwen3.5's and Gemma 4's LoRA on several ranks (not "
                            f"{', '.join(refused)}) — memory_check=false skips the plan")

    def root_tensors(self, run: RunShape) -> list[tuple[str, tuple[int, ...], bool]]:
        """The text family's, + the tower's parameters (its merger / projector's too): FSDP2's root holds them
        (`minitrain.parallel.fsdp.shard` wraps only the language model's blocks)."""
        return super().root_tensors(run) + [(f"vision.{i}", shape, run.full) for i, shape in enumerate(self.tower.shapes)]

    def image_tokens(self, run: RunShape) -> int:
        return run.rows * run.seq if run.image_tokens is None else run.image_tokens

    def num_params(self) -> int:
        return super().num_params() + sum(self.tower.tensors)

    def all_tensors(self) -> list[int]:
        return super().all_tensors() + list(self.tower.tensors)

    def weight_terms(self, run: RunShape) -> list[Term]:
        s = 4 if run.full else run.s
        n = sum(self.tower.tensors)
        what = "vision tower + " + ("projector" if self.tower.kind in ("gemma3", "gemma4") else "merger")
        return super().weight_terms(run) + [Term(f"weights: {what}", n * s, f"{n:,} x {s} B")]

    def adapted_summary(self, run: RunShape) -> str:
        return ("every weight, the tower's too (full fine-tuning)" if run.full
                else super().adapted_summary(run) + " (tower frozen)")

    def describe(self) -> str:
        t = self.tower
        return (f"{super().describe()}; vision tower {t.depth} blocks, width {t.width}, "
                f"{t.patches_per_token} patches per image token")

    def tower_terms(self, run: RunShape) -> list[Term]:
        """What the tower adds to every moment of the language model's step: the pixel values (and, trained,
        its saved activations)."""
        n = self.image_tokens(run)
        P = n * self.tower.patches_per_token
        terms = [Term("batch: pixel values (fp32)", P * self.tower.patch_values * 4,
                      f"{n:,} image tokens x {self.tower.patches_per_token} patches x {self.tower.patch_values} x 4 B")]
        if run.full:
            per = self.tower.saved_per_patch()
            terms.append(Term("vision tower: saved activations (fp32)", int(P * per * 4),
                              f"{P:,} patches x {per:,.0f} x 4 B"))
        return terms

    def moments(self, run: RunShape) -> tuple[dict[str, list[Term]], list[str]]:
        moments, notes = super().moments(run)
        tower = self.tower_terms(run)
        for name in moments:
            if name != "optimizer step":
                moments[name] = moments[name] + tower
        if run.full:  # after the language model's backward: its gradients exist, its activations are freed
            lm = sum(super().all_tensors())
            grads = Term("gradients: the language model's", lm * 4, f"{lm:,} x 4 B")
            moments["vision tower backward"] = tower + [grads]
        if run.quantize != "none" and not run.full:
            notes.append(f"quantize={run.quantize}: the tower's linears, quantized too, are counted in the compute "
                         "dtype (an upper bound)")
        if run.image_tokens is None:
            notes.append(f"vision: every position counted as an image token ({self.image_tokens(run):,}: the worst "
                         "case); fewer images in the rows need less")
        return moments, notes


@dataclass(frozen=True)
class QwenVLShape(WithTower, ModelShape):
    """Qwen2.5-VL (a Qwen2 language model) and Qwen3-VL (Qwen3's) with their towers."""

    tower: Tower | None = None
    MODEL_TYPES: ClassVar[dict[str, str]] = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}


@dataclass(frozen=True)
class QwenVLMoeShape(WithTower, MoeShape):
    """Qwen3-VL-MoE: Qwen3-VL's tower over a Qwen3-MoE language model (`minitrain.plan.moe`: every expert in
    memory, dense layers where `mlp_only_layers` / `decoder_sparse_step` put them). No per-expert name reaches
    its experts (peft maps none): `gate_proj` / `up_proj` / `down_proj` name the dense layers' linears."""

    tower: Tower | None = None
    ALIASED: ClassVar[bool] = False
    MODEL_TYPES: ClassVar[dict[str, str]] = {"qwen3_vl_moe": "qwen3_moe"}


@dataclass(frozen=True)
class Gemma3VLShape(WithTower, GemmaShape):
    """Multimodal Gemma 3: Gemma 3's language model, the SigLIP tower and the projector. A forward with images
    keeps its padding on a CPU too (the image-block masks are dense)."""

    tower: Tower | None = None
    MODEL_TYPES: ClassVar[dict[str, str]] = {"gemma3": "gemma3_text"}
    UNPADS_ON_CPU: ClassVar[bool] = False


class WithTowerByBlock(WithTower):
    """Multimodal Qwen3.5 and Gemma 4: the tower's terms over the text plan, whose refusals hold too; LoRA on several
    ranks too (`minitrain.plan.sharded`: the tower in FSDP2's root, `root_tensors`)."""

    RANKS: ClassVar[bool] = True

    def check_run(self, run: RunShape) -> None:
        super().check_run(run)
        super(WithTower, self).check_run(run)  # the text plan's (`ByBlock`'s, Gemma 4 MoE's quantize=)


@dataclass(frozen=True)
class Qwen3_5VLShape(WithTowerByBlock, Qwen3_5Shape):
    """Multimodal Qwen3.5 (`qwen3_5`): Qwen3.5's language model planned block by block, Qwen3-VL's tower."""

    tower: Tower | None = None
    MODEL_TYPES: ClassVar[dict[str, str]] = {"qwen3_5": "qwen3_5_text"}


@dataclass(frozen=True)
class Qwen3_5MoeVLShape(WithTowerByBlock, Qwen3_5MoeShape):
    """Multimodal Qwen3.5 MoE (`qwen3_5_moe`): the MoE sizes' language model, the same tower."""

    tower: Tower | None = None
    MODEL_TYPES: ClassVar[dict[str, str]] = {"qwen3_5_moe": "qwen3_5_moe_text"}


class Gemma4Tower(WithTowerByBlock):
    """Multimodal Gemma 4 (`gemma4` with a `vision_config`): Gemma 4's language model planned block by block, its
    tower frozen (a regular-expression `lora_targets` that reaches the tower is refused: its activations are not
    planned). The tower runs before the language model, without a graph: its moment is the pixels and its
    forward's working set (`tower_forward`)."""

    max_soft_tokens: int
    MODEL_TYPES: ClassVar[dict[str, str]] = {"gemma4": "gemma4_text"}
    TOWER_NAMES: ClassVar[tuple[str, ...]] = ("model.vision_tower.encoder.layers.0.self_attn.q_proj.linear",
                                              "model.vision_tower.patch_embedder.input_proj",
                                              "model.embed_vision.embedding_projection")

    def check_run(self, run: RunShape) -> None:
        super().check_run(run)
        if run.full:
            raise UserError("finetune=full: the memory plan models multimodal Gemma 4 LoRA / QLoRA runs (full fine-tuning "
                            "of its text model only) — memory_check=false skips the plan")
        for t in run.lora_targets:
            if any(re.fullmatch(t, n) for n in self.TOWER_NAMES):
                raise UserError(f"lora_targets {t!r} reaches Gemma 4's vision tower — the memory plan models its "
                                "tower frozen (LoRA on the language model); memory_check=false skips the plan")

    def tower_forward(self, run: RunShape) -> Term:
        """The tower's forward, nothing kept, at its largest of (per patch): the patch embedder's two fp32 copies of
        the pixels (2 (x - 0.5)); one block's working set (the residual, its norm, q / k / v, the GeGLU's inputs:
        about 5 Dv + 2 Fv in the compute dtype; SDPA on a CPU works in tiles); the pooler's one-hot weights over the
        budget's soft tokens (int64 + fp32) beside the residual. (Read off measured forwards.)"""
        t, P, s = self.tower, self.image_tokens(run) * self.tower.patches_per_token, run.s
        pixels = 2 * (t.patch_values - 4) * 4
        block = (5 * t.width + 2 * t.ffn) * s
        pool = self.max_soft_tokens * 12 + t.width * 4
        per = max(pixels, block, pool)
        what = {pixels: "the pixels' two scaled copies", block: "one block (5 Dv + 2 Fv)",
                pool: f"the pooler's one-hot over {self.max_soft_tokens} soft tokens"}[per]
        return Term(f"vision tower forward: {what}", P * per, f"{P:,} patches x {per:,} B")

    def moments(self, run: RunShape) -> tuple[dict[str, list[Term]], list[str]]:
        moments, notes = super().moments(run)
        pixels = self.tower_terms(run)
        moments["vision tower forward (no grad)"] = pixels + [self.tower_forward(run)]
        return moments, notes


@dataclass(frozen=True)
class Gemma4VLShape(Gemma4Tower, Gemma4Shape):
    """Multimodal Gemma 4's dense sizes."""

    tower: Tower | None = None
    max_soft_tokens: int = 280  # Gemma4ImageProcessor's default budget (a folder's preprocessor_config.json may differ)


@dataclass(frozen=True)
class Gemma4MoeVLShape(Gemma4Tower, Gemma4MoeShape):
    """Multimodal Gemma 4's MoE size (26B-A4B, `enable_moe_block` in its `text_config`)."""

    tower: Tower | None = None
    max_soft_tokens: int = 280
