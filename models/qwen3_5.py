"""Qwen3.5 (dense `qwen3_5_text`, mixture-of-experts `qwen3_5_moe_text`): a hybrid of Gated DeltaNet layers
(linear attention with a recurrent state and a short causal convolution) and gated full-attention layers,
importing only torch and the shared floor (`models/layers.py`); the multimodal folders also Qwen3-VL's file
(`models/qwen3_vl.py`, over `models/qwen2_5_vl.py`) for their tower and image forward.

Read top to bottom: config, the gated delta rule (chunked for training and prefill, recurrent for
decoding), the causal convolution, the DeltaNet layer, the attention, block, model.

- Layer i is a DeltaNet layer when `layer_types[i] == "linear_attention"` (by default three of every
  four: `full_attention_interval`), else full attention.
- DeltaNet (HF's `linear_attn`): x -> `in_proj_qkv` -> a depthwise causal convolution of
  `linear_conv_kernel_dim` taps over time, then SiLU -> q, k (Hk heads of dk), v (Hv heads of dv);
  each q / k head serves Hv / Hk consecutive value heads. beta = sigmoid(`in_proj_b` x) and the log
  decay g = -exp(`A_log`) softplus(`in_proj_a` x + `dt_bias`) per value head. With q, k L2-normalised
  and q scaled by dk^-1/2, the state S (dk, dv) of each head follows the gated delta rule

      S_t = e^{g_t} S_{t-1} + k_t (beta_t (v_t - k_t^T e^{g_t} S_{t-1}))^T,   o_t = S_t^T q_t,

  and the output is `out_proj`(RMSNorm(o) * weight * silu(`in_proj_z` x)) (the gated RMSNorm).
- Full attention: Qwen3's (per-head q / k norms) with an output gate (q_proj gives a query and a gate
  per head; the output is scaled by sigmoid(gate) before o_proj) and RoPE on the first
  `partial_rotary_factor` of each head's dims. Qwen3.5's multimodal RoPE (`mrope_section`) gives a
  text token the same position on its three axes, which is plain RoPE.
- Every norm but the gated one is (1 + weight) x / rms(x), Gemma's form (`OffsetRMSNorm`).
- The MLP: a SwiGLU of `intermediate_size` (dense), or in the MoE sizes (35B-A3B, 122B-A10B, 397B-A17B) on
  every layer the floor's `SparseMoeBlock`: a softmax over `num_experts` router logits (`mlp.gate`), its
  top `num_experts_per_tok` always renormalised, experts of `moe_intermediate_size` held fused as
  transformers 5 holds them (`mlp.experts.gate_up_proj` (E, 2F, D), `down_proj` (E, D, F)), plus a shared
  expert (`mlp.shared_expert`, a SwiGLU of `shared_expert_intermediate_size`) scaled by
  sigmoid(`mlp.shared_expert_gate` x). Files with one tensor per expert and projection (what
  transformers 5's `save_pretrained` writes: `mlp.experts.3.gate_proj.weight`) load too (`checkpoint_parts`).

Multimodal folders (`Qwen3_5ForConditionalGeneration`, `qwen3_5`; `qwen3_5_moe`): Qwen3-VL's model over this
language model: its tower (`model.visual.*`: Qwen3-VL's without DeepStack, as transformers' `Qwen3_5VisionModel`),
the images' features in the `<|image_pad|>` places, 3-D positions for the image tokens (`rope_index`: an image at
(start, start + row, start + column) of its merged grid, the text after it at start + max(rows, columns)) that the
attention layers turn with Qwen3-VL's interleaved sections over their rotated dims (`Qwen3_5VLConfig.mrope_axes`),
generation after an image prompt counting on from its largest position. Not yet: videos.

State never crosses a sequence boundary: a padded batch, a packed row and a batch run without its
padding tell each DeltaNet layer where sequences start (`segment_starts`), and the scan and the
convolution restart there. Rows of several sequences that share a prefix (DPO's shared prompt, GRPO's
prompt + completions) run as one row per sequence, each [prefix; sequence] (`_forward_block_mask`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Collection, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.layers import (
    IGNORED_FIELDS,
    Attention,
    CausalLM,
    DecoderBody,
    Documents,
    Experts,
    GatedMLP,
    KVCache,
    MoeCausalLM,
    OffsetRMSNorm,
    Ragged,
    RopeSpec,
    Router,
    SparseMoeBlock,
    _rms_norm,
    apply_partial_rotary,
    check_fields,
    check_heads,
    drop_ignored,
    generate,
    multimodal_to_hf,
    normalize_rope_scaling,
    per_expert_keys,
    read_rope,
    require_zero,
    text_config_of,
)
from models.qwen2_5_vl import MRopeBody, vision_from_hf
from models.qwen3_vl import VISION_DEFAULTS, Qwen3VLForConditionalGeneration, Qwen3VLVisionConfig, interleaved_axes

__all__ = ["Qwen3_5Config", "Qwen3_5VLConfig", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
           "Qwen3_5MoeForConditionalGeneration", "KVCache", "generate", "config_from_hf", "chunk_gated_delta_rule",
           "recurrent_gated_delta_rule"]

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

LAYER_TYPES = ("linear_attention", "full_attention")
TEXT_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
# a multimodal checkpoint's model_type -> its text_config's
MULTIMODAL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# the mixture-of-experts fields (only `qwen3_5_moe_text` has them) and transformers' class defaults
MOE_FIELDS = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
              "shared_expert_intermediate_size": 512, "output_router_logits": False, "router_aux_loss_coef": 0.001}
# rope_parameters keys of the multimodal RoPE: for text (the same position on every axis) they change nothing
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


@dataclass
class Qwen3_5Config:
    """Qwen3.5 text hyper-parameters under their HF `config.json` names (transformers' defaults).

    `linear_*`: the DeltaNet layers' heads (`linear_num_key_heads` q / k heads of
    `linear_key_head_dim`, `linear_num_value_heads` v heads of `linear_value_head_dim`) and their
    convolution's taps. `partial_rotary_factor` (inside `rope_parameters` in v5): the share of each
    attention head's dims that RoPE turns. `mtp_*`: the multi-token-prediction head the checkpoint may
    carry (`mtp.*` keys), which the causal LM does not use.

    The MoE sizes (`qwen3_5_moe_text`): `num_experts` experts of `moe_intermediate_size`, the top
    `num_experts_per_tok` per token, a shared expert of `shared_expert_intermediate_size`;
    `output_router_logits` / `router_aux_loss_coef`: the load-balancing loss transformers adds in training.
    Their `intermediate_size`, when a config.json carries one, is read by nothing (as in transformers).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int | None = None
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attn_output_gate: bool = True
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    model_type: str = "qwen3_5_text"
    # a multimodal checkpoint's config.json without its text_config (model_type "qwen3_5"), for `to_hf`
    multimodal: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act {self.hidden_act!r} is not supported — Qwen3.5 uses 'silu'")
        self._check_mlp()
        if not self.attn_output_gate:
            raise ValueError("config.json: attn_output_gate=false is not supported — Qwen3.5's attention layers are "
                             "gated (remove the field)")
        rd = self.rotary_dim
        if not 0 < rd <= self.head_dim or rd % 2:
            raise ValueError(f"config.json: partial_rotary_factor={self.partial_rotary_factor} turns {rd} of "
                             f"head_dim={self.head_dim} dims — use a factor that gives an even count in 2..head_dim")
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "full_attention_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.json: {name}={value!r} is not understood — the DeltaNet layers need a "
                                 "positive int here")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"config.json: linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads} — each q / k head serves a whole group of v heads"
            )
        if self.layer_types is None:  # transformers' rule: every `full_attention_interval`-th layer attends
            n = self.full_attention_interval
            self.layer_types = ["full_attention" if (i + 1) % n == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config.json: layer_types must list {' / '.join(LAYER_TYPES)} once per layer "
                f"({self.num_hidden_layers}) — got {len(self.layer_types)} entries{f', unknown {bad}' if bad else ''}"
            )
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)

    @property
    def moe(self) -> bool:
        """Whether every MLP is the experts (the MoE sizes), else a dense SwiGLU."""
        return self.model_type in ("qwen3_5_moe_text", "qwen3_5_moe")

    def _check_mlp(self) -> None:
        """The dense model's `intermediate_size`, or the MoE fields (and none of them on a dense model)."""
        if not self.moe:
            stray = [k for k, v in MOE_FIELDS.items() if getattr(self, k) not in (None, v)]
            if stray:
                raise ValueError(f"config.json: {stray[0]}={getattr(self, stray[0])!r} is not a {self.model_type} "
                                 "field — remove it, or use model_type 'qwen3_5_moe_text' for the MoE sizes")
            sizes = {"intermediate_size": self.intermediate_size}
        else:
            sizes = {k: getattr(self, k) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                    "shared_expert_intermediate_size")}
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.json: {name}={value!r} is not understood — use a positive int")
        if self.moe and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"config.json: num_experts_per_tok={self.num_experts_per_tok} — use 1..num_experts "
                             f"({self.num_experts})")

    @property
    def rotary_dim(self) -> int:
        """The dims of each attention head RoPE turns (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def rope_spec(self) -> RopeSpec:
        return RopeSpec(self.rotary_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings)

    def layer_windows(self) -> list[int | None]:
        """No sliding windows: every attention layer attends to its whole sequence."""
        return [None] * self.num_hidden_layers

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Qwen3_5Config":
        """From an HF `config.json` dict (v5 `rope_parameters`, or `rope_theta` / `rope_scaling` with a
        top-level `partial_rotary_factor`). A field this file does not know is a ValueError."""
        d = dict(d)
        model_type = d.pop("model_type", None)
        if model_type not in TEXT_TYPES:
            raise ValueError(f"config.json: model_type {model_type!r} is not one of {TEXT_TYPES}")
        if model_type == "qwen3_5_moe_text":  # Qwen3-Next's fields that transformers drops: no layer dense, always renormalised
            d = {**MOE_FIELDS, **d}
            if d.pop("mlp_only_layers", None) or d.pop("norm_topk_prob", True) is not True:
                raise ValueError("config.json: mlp_only_layers / norm_topk_prob=false are not Qwen3.5 MoE fields (every "
                                 "layer is sparse, its top-k renormalised) — remove them")
        drop_ignored(d, IGNORED_FIELDS)
        require_zero(d, "attention_dropout")
        if "multimodal" in d:  # ours (what from_multimodal keeps), never a config.json field
            raise ValueError("config.json: field 'multimodal' is not understood — remove it")
        theta, scaling = read_rope(d)
        scaling = dict(scaling or {})
        for key in _MROPE_KEYS:
            scaling.pop(key, None)
        partial = scaling.pop("partial_rotary_factor", None)
        if partial is not None and d.get("partial_rotary_factor", partial) != partial:
            raise ValueError("config.json: partial_rotary_factor and rope_parameters.partial_rotary_factor disagree "
                             "— keep one")
        if partial is not None:
            d["partial_rotary_factor"] = partial
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        check_fields(d, cls, model_type, "Qwen3.5",
                     required=required + (() if model_type == "qwen3_5_moe_text" else ("intermediate_size",)))
        return cls(**d, rope_theta=theta if theta is not None else 10000.0, rope_scaling=scaling or None,
                   model_type=model_type)

    @classmethod
    def from_multimodal(cls, d: dict[str, Any]) -> "Qwen3_5VLConfig":
        """A multimodal Qwen3.5 (`Qwen3_5ForConditionalGeneration`, model_type "qwen3_5";
        `Qwen3_5MoeForConditionalGeneration`, "qwen3_5_moe"): its language model's config (`text_config`;
        the outer `tie_word_embeddings` is the one transformers honours), the rest kept for `to_hf`, and what
        the images need (`Qwen3_5VLConfig`)."""
        text = d.get("text_config")
        rope = (text.get("rope_parameters") or text.get("rope_scaling") or {}) if isinstance(text, dict) else {}
        base = text_config_of(d, cls.from_hf, MULTIMODAL_TYPES[d["model_type"]], tie_default=False)
        section = list(rope.get("mrope_section") or DEFAULT_MROPE)
        # (transformers reads sections past the rotated frequencies as reaching the end: its default (11, 11, 10)
        # on a narrower head too, so no sum is required)
        if len(section) != 3 or not all(isinstance(n, int) and n >= 0 for n in section):
            raise ValueError(f"config.json: mrope_section {section} — it must be three counts (temporal, height, "
                             "width)")
        vision = d.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError(f"config.json: a {d['model_type']} config without vision_config — restore the checkpoint's "
                             "config.json")
        if "deepstack_visual_indexes" in vision:
            raise ValueError("config.json: vision_config deepstack_visual_indexes is not a Qwen3.5 field (its tower has "
                             "no DeepStack) — remove it")
        return Qwen3_5VLConfig(**{f.name: getattr(base, f.name) for f in fields(Qwen3_5Config)},
                               vision=vision_from_hf(Qwen3VLVisionConfig, vision, VISION_TOWER_DEFAULTS, "qwen3_5"),
                               mrope_section=section, image_token_id=int(d.get("image_token_id", IMAGE_TOKEN_ID)))

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict transformers loads (v5's `rope_parameters`); a multimodal checkpoint's
        whole config, the text model's inside `text_config`."""
        d = asdict(self)
        d["architectures"] = ["Qwen3_5MoeForCausalLM" if self.moe else "Qwen3_5ForCausalLM"]
        if not self.moe:  # a dense config.json has no expert fields, an MoE one no intermediate_size unless it came with one
            for name in MOE_FIELDS:
                d.pop(name)
        elif self.intermediate_size is None:
            d.pop("intermediate_size")
        d["rope_parameters"] = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": d.pop("rope_theta"),
                                "partial_rotary_factor": d.pop("partial_rotary_factor")}
        d.pop("rope_scaling")
        d.pop("full_attention_interval")  # layer_types says it
        return multimodal_to_hf(d, d.pop("multimodal"), "qwen3_5_moe_text" if self.moe else "qwen3_5_text")


# transformers' defaults of a multimodal config: Qwen3-VL's tower without DeepStack, the M-RoPE sections (of
# the rotated quarter of a 256-wide head), the image placeholder
VISION_TOWER_DEFAULTS = {**VISION_DEFAULTS, "deepstack_visual_indexes": []}
DEFAULT_MROPE = (11, 11, 10)
IMAGE_TOKEN_ID = 248056


@dataclass
class Qwen3_5VLConfig(Qwen3_5Config):
    """A multimodal checkpoint's config (model_type "qwen3_5" / "qwen3_5_moe"): the language model's, plus the
    tower's (`vision`: Qwen3-VL's dataclass, no DeepStack layers), `mrope_section` (how many of a head's rotated
    frequencies follow the temporal, height and width axes, interleaved as Qwen3-VL's) and `image_token_id`."""

    vision: Qwen3VLVisionConfig | None = None
    mrope_section: list[int] | None = None
    image_token_id: int = IMAGE_TOKEN_ID

    @property
    def family(self) -> str:
        """The name the image forward's messages give (Qwen2.5-VL's `family`)."""
        return self.model_type

    def mrope_axes(self) -> torch.Tensor:
        """The axis each of the `rotary_dim` rotated features turns with (`interleaved_axes`)."""
        return interleaved_axes(self.rotary_dim // 2, self.mrope_section)

    def to_hf(self) -> dict[str, Any]:
        """The language model's `to_hf` inside the multimodal config read, its M-RoPE sections written back."""
        out = Qwen3_5Config(**{f.name: getattr(self, f.name) for f in fields(Qwen3_5Config)}).to_hf()
        out["text_config"]["rope_parameters"].update(mrope_section=list(self.mrope_section), mrope_interleaved=True)
        return out


# --------------------------------------------------------------------------------------------
# The gated delta rule
# --------------------------------------------------------------------------------------------


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """fp32, (B, H, T, ·) layout, q / k repeated to the value heads, L2-normalised (as the `fla`
    kernels: x / sqrt(sum x^2 + 1e-6)), q scaled by dk^-1/2."""
    n_rep = v.shape[2] // q.shape[2]
    q, k = (t.float().repeat_interleave(n_rep, dim=2) if n_rep > 1 else t.float() for t in (q, k))
    q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    return [t.transpose(1, 2).float() for t in (q, k, v, g, beta)]


@torch.compiler.disable  # a Python loop over T / C chunks: a graph per length; the block around it compiles
def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           segments: torch.Tensor | None = None, state: torch.Tensor | None = None,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over whole chunks: q, k (B, T, Hk, dk), v (B, T, H, dv), g (log decay) and
    beta (B, T, H) -> (o (B, T, H, dv) in v's dtype, the final state (B, H, dk, dv) fp32).

    `segments` (B, T) long, non-decreasing along each row: token t continues the state of token t - 1
    only when their segment ids are equal (segment 0 continues `state`, the state carried in, zero by
    default). Within a chunk of C tokens, the state's updates u (the "new values") solve one unit
    lower-triangular system (the WY / UT form): with G_i the cumulative log decay inside the chunk,
    u_i + sum_{j<i} beta_i e^{G_i - G_j} (k_i . k_j) u_j = beta_i (v_i - e^{G_i} k_i^T S0), and then
    o_i = e^{G_i} q_i^T S0 + sum_{j<=i} e^{G_i - G_j} (q_i . k_j) u_j; S = e^{G_C} S0 + sum_j e^{G_C - G_j} k_j u_j^T.
    Pairs of tokens of different segments get no term, and a token after a restart reads no S0.
    Memory grows with T x C (the (C, C) blocks of each chunk), never with T^2; a loop over the T / C chunks.
    """
    dtype = v.dtype
    B, T = v.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # (B, H, T, ·)
    H, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    if pad:  # zero tokens at the end: no decay, no update
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (T + pad) // C
    q, k, v = (t.reshape(B, H, n, C, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(B, H, n, C), beta.reshape(B, H, n, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    if segments is None:
        G = g.cumsum(-1)  # (B, H, n, C) log decay from the chunk's start to each token
        pairs = causal
        carry = carry_last = same_last = None
    else:
        seg = F.pad(segments, (0, pad), mode="replicate") if pad else segments
        seg = seg.reshape(B, 1, n, C)
        before = F.pad(seg[..., :-1, -1], (1, 0))[..., None]  # (B, 1, n, 1): the segment carried in (0 at the start)
        carry = (seg == before).float()  # (B, 1, n, C) token i reads the state carried in
        carry_last = carry[..., -1:]
        same_last = (seg == seg[..., -1:]).float()  # token j's update reaches the chunk's final state
        pairs = causal & (seg[..., :, None] == seg[..., None, :])  # (B, 1, n, C, C)
        # the log decay summed over each token's own segment only (a masked sum, not cumsum's differences:
        # G_i - G_j of a document that starts inside a chunk would keep the rounding of the decays the
        # documents before it summed, and read them: 1e-4 of its outputs, 0.3% of its gradients)
        G = torch.einsum("bxnij,bhnj->bhni", pairs.to(g.dtype), g)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~pairs, float("-inf")).exp()  # (B, H, n, C, C) e^{G_i - G_j}
    eG = G.exp()
    kdec = k * eG[..., None] if carry is None else k * (eG * carry)[..., None]
    system = (k @ k.transpose(-1, -2)) * decay * beta[..., None]  # strictly lower part used (unit diagonal)
    rhs = torch.cat([v, kdec], dim=-1) * beta[..., None]
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u0, w = solved[..., :dv], solved[..., dv:]  # u = u0 - w S0
    attn = (q @ k.transpose(-1, -2)) * decay  # (B, H, n, C, C)
    qdec = q * eG[..., None] if carry is None else q * (eG * carry)[..., None]
    last = G[..., -1:]  # (B, H, n, 1)
    # (other segments' G are their own sums now, so last - G may be large there: masked before the exp)
    to_end = (last - G).exp() if same_last is None else (last - G).masked_fill(same_last == 0, float("-inf")).exp()
    kend = k * to_end[..., None]  # (B, H, n, C, dk)
    keep = last.exp() if carry_last is None else last.exp() * carry_last  # (B, H, n, 1)
    S = state.float() if state is not None else q.new_zeros(B, H, dk, dv)
    out = []
    # per chunk by `unbind`, not c-indexing: its backward is one stack, where each index's would fill a
    # zero tensor of the whole sequence's size and add into it
    for u0_c, w_c, q_c, a_c, k_c, keep_c in zip(*(t.unbind(2) for t in (u0, w, qdec, attn, kend, keep[..., None]))):
        u = u0_c - w_c @ S  # (B, H, C, dv)
        out.append(q_c @ S + a_c @ u)
        S = S * keep_c + k_c.transpose(-1, -2) @ u
    o = torch.stack(out, 2).reshape(B, H, n * C, dv)[:, :, :T]
    return o.transpose(1, 2).to(dtype), S


@torch.compiler.disable
def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (decoding): the same arguments and results as
    `chunk_gated_delta_rule` without segments."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # (B, H, T, ·)
    B, H, T, dv = v.shape
    S = state.float() if state is not None else q.new_zeros(B, H, k.shape[-1], dv)
    out = []
    for t in range(T):
        S = S * g[:, :, t, None, None].exp()
        delta = (v[:, :, t] - (k[:, :, t, :, None] * S).sum(-2)) * beta[:, :, t, None]  # (B, H, dv)
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(out, 2).transpose(1, 2).to(dtype), S


# --------------------------------------------------------------------------------------------
# Where sequences start, the causal convolution
# --------------------------------------------------------------------------------------------


def segment_starts(mask: Any, T: int) -> torch.Tensor | None:
    """Which of the T new tokens start a sequence (B, T) bool, from what the attention layers get: None
    (causal rows of one sequence each: none), a bool (B, 1, T, S) mask (the T queries at the last T of
    S slots) or a `Documents`. Token t starts one when it may not attend to the token before it."""
    if mask is None:
        return None
    if isinstance(mask, Documents):
        mask_mod, B = mask.block_mask.mask_mod, mask.block_mask.shape[0]
        t = torch.arange(1, T, device=mask.block_mask.kv_indices.device)
        sees = mask_mod(torch.arange(B, device=t.device)[:, None], 0, t[None], t[None] - 1)
        return F.pad(~sees, (1, 0), value=True)
    S = mask.shape[-1]
    t = torch.arange(T, device=mask.device)
    prev = t + (S - T) - 1  # the slot of each query's predecessor
    sees = mask[:, 0, t, prev.clamp(min=0)] & (prev >= 0)
    return ~sees


def ragged_starts(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """(1, N) bool: True at each sequence's first token in a `Ragged` batch laid end to end."""
    starts = torch.zeros(1, sum(lengths), dtype=torch.bool, device=device)
    starts[0, torch.tensor([0, *lengths[:-1]], device=device).cumsum(0)] = True
    return starts


def sequence_bounds(starts: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    """The batch's sequences laid end to end (B * T tokens, row-major) as cumulative offsets (N + 1,) int64
    (flash-attention's and `fla`'s `cu_seqlens`): a sequence starts at each row's first token and wherever
    `starts` (B, T) bool (the tokens that start a sequence, `segment_starts`; None: none do) says so."""
    first = torch.zeros(B, T, dtype=torch.bool, device=device)
    first[:, 0] = True
    if starts is not None:
        first |= starts.to(device)
    at = first.flatten().nonzero().squeeze(1)
    return torch.cat([at, at.new_tensor([B * T])])


def causal_conv(x: torch.Tensor, weight: torch.Tensor, head: torch.Tensor | None,
                segments: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution over time: x (B, C, T), weight (C, 1, K), `head` (B, C, K-1) the
    inputs before x (None: zeros) -> (B, C, T), out_t = sum_j weight[:, j] x_{t - K + 1 + j}. With
    `segments` (B, K - 1 + T) (the head's slots and x's), a tap reads only inputs of its token's segment."""
    K = weight.shape[-1]
    if segments is None:
        if head is None:
            return F.conv1d(x, weight, padding=K - 1, groups=x.shape[1])[..., : x.shape[-1]]
        return F.conv1d(torch.cat([head, x], -1), weight, groups=x.shape[1])
    T = x.shape[-1]
    full = torch.cat([head if head is not None else x.new_zeros(*x.shape[:2], K - 1), x], -1)  # (B, C, K-1+T)
    own = segments[:, K - 1:]
    out = None
    for j in range(K):
        tap = full[..., j : j + T] * weight[:, :, j] * (segments[:, j : j + T] == own)[:, None].to(x.dtype)
        out = tap if out is None else out + tap
    return out


# --------------------------------------------------------------------------------------------
# Gated DeltaNet
# --------------------------------------------------------------------------------------------


class GatedRMSNorm(nn.Module):
    """weight * x / rms(x) (LLaMA's RMSNorm, the weights start at 1), times silu(gate) in fp32, cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (_rms_norm(x, self.weight, self.eps)[0] * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer (HF's `linear_attn`), see the module docstring. `chunk_size`: the chunk
    of the training / prefill scan (64, as transformers; any size gives the same values).

    forward(x (B, T, D), segments, cache) -> (B, T, D): `segments` (B, T) bool, the tokens that start a
    sequence (None: none do), or a `Ragged` (x (N, D), the batch's sequences end to end). With a cache,
    the layer continues the state of its earlier calls (`cache.states[layer]`: the convolution's last
    K - 1 inputs and the recurrent state) and leaves its own there."""

    def __init__(self, config: Qwen3_5Config, layer_idx: int) -> None:
        super().__init__()
        D, K = config.hidden_size, config.linear_conv_kernel_dim
        self.layer_idx = layer_idx
        self.n_k, self.n_v = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.n_k * self.dk, self.n_v * self.dv
        channels = 2 * self.key_dim + self.value_dim
        self.chunk_size = 64
        self.in_proj_qkv = nn.Linear(D, channels, bias=False)
        self.in_proj_z = nn.Linear(D, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(D, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(D, self.n_v, bias=False)
        # a Conv1d for its key and shape (C, 1, K); the forward is `causal_conv`'s
        self.conv1d = nn.Conv1d(channels, channels, K, groups=channels, bias=False, padding=K - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)

    # kernels for the convolution and the scan, set per layer by `minitrain.kernels` (fla's Triton kernels on
    # CUDA): `conv(mixed (B, C, T), weight (C, 1, K), bounds)` -> silu(conv) (B, C, T) and `rule(q, k, v, g, beta,
    # bounds)` -> o (B, T, H, dv), over the sequences `bounds` gives (`sequence_bounds`); used without a cache only
    kernels: Any = None

    def forward(self, x: torch.Tensor, segments: Any, cache: KVCache | None = None) -> torch.Tensor:
        if isinstance(segments, Ragged):  # one row, a restart at each sequence
            return self.forward(x[None], ragged_starts(segments.lengths, x.device))[0]
        if self.kernels is not None and cache is None:
            return self._forward_kernels(x, segments)
        B, T, _ = x.shape
        prior = cache.states.get(self.layer_idx) if cache is not None else None
        if segments is not None:
            if prior is None:
                segments = segments.clone()
                segments[:, 0] = False  # the first token starts from zeros anyway
            segments = segments.long().cumsum(1) if bool(segments.any()) else None  # (B, T) segment ids
        K = self.conv1d.kernel_size[0]
        mixed = self.in_proj_qkv(x).transpose(1, 2)  # (B, C, T)
        conv_segments = None if segments is None else F.pad(segments, (K - 1, 0))
        mixed_conv = F.silu(causal_conv(mixed, self.conv1d.weight, prior[0] if prior else None, conv_segments))
        q, k, v, g, beta = self._split(x, mixed_conv)
        state = prior[1] if prior else None
        if prior is not None and T == 1:
            o, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
        else:
            o, state = chunk_gated_delta_rule(q, k, v, g, beta, segments, state, self.chunk_size)
        if cache is not None:  # the last K - 1 inputs of each row's last sequence, and the state
            # (a copy, not a view: the view would keep the whole concatenation, a prefill's every input, alive)
            head = torch.cat([prior[0] if prior else mixed.new_zeros(B, mixed.shape[1], K - 1), mixed], -1)[..., -(K - 1):].contiguous()
            if conv_segments is not None:
                tail = conv_segments[:, -(K - 1):]
                head = head * (tail == conv_segments[:, -1:])[:, None].to(head.dtype)
            cache.states[self.layer_idx] = (head.detach(), state.detach())
        return self._output(x, o)

    def _split(self, x: torch.Tensor, mixed_conv: torch.Tensor):
        """(q, k, v, g, beta) from the convolution's output (B, C, T) and the layer's input x (B, T, D)."""
        q, k, v = mixed_conv.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.unflatten(-1, (self.n_k, self.dk)), k.unflatten(-1, (self.n_k, self.dk))
        v = v.unflatten(-1, (self.n_v, self.dv))
        beta = self.in_proj_b(x).sigmoid()  # (B, T, Hv)
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # (B, T, Hv) log decay
        return q, k, v, g, beta

    def _output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        z = self.in_proj_z(x).unflatten(-1, (self.n_v, self.dv))
        return self.out_proj(self.norm(o, z).flatten(-2))

    def _forward_kernels(self, x: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
        """The forward through `self.kernels` (no cache): the same values as the torch path, to the kernels' rounding."""
        bounds = sequence_bounds(starts, *x.shape[:2], x.device)
        mixed_conv = self.kernels.conv(self.in_proj_qkv(x).transpose(1, 2), self.conv1d.weight, bounds)
        return self._output(x, self.kernels.rule(*self._split(x, mixed_conv), bounds))


# --------------------------------------------------------------------------------------------
# Attention, block, model
# --------------------------------------------------------------------------------------------


class Qwen3_5Attention(Attention):
    """The floor's attention with Qwen3.5's fields: the output gate, per-head (1 + w) q / k norms,
    RoPE on the first `rotary_dim` dims of each head, `attention_bias` on q / k / v / o."""

    rotate = staticmethod(apply_partial_rotary)

    def __init__(self, config: Qwen3_5Config, layer_idx: int) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                         layer_idx, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                         qk_norm=lambda hd: OffsetRMSNorm(hd, config.rms_norm_eps), output_gate=True)


def sparse_block(config: Qwen3_5Config) -> SparseMoeBlock:
    """The MoE sizes' MLP: the router (top-k always renormalised), the experts, the shared expert and its gate."""
    D, E = config.hidden_size, config.num_experts
    return SparseMoeBlock(Router(D, E, config.num_experts_per_tok, norm_topk_prob=True),
                          Experts(E, D, config.moe_intermediate_size),
                          shared_expert=GatedMLP(D, config.shared_expert_intermediate_size),
                          shared_expert_gate=nn.Linear(D, 1, bias=False))


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm block: x + mixer(norm(x)), then + mlp(norm(x)); the mixer a DeltaNet (`linear_attn`)
    or attention (`self_attn`), the MLP a SwiGLU or the experts. The unit the engine checkpoints and compiles."""

    def __init__(self, config: Qwen3_5Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = Qwen3_5Attention(config, layer_idx)
        self.mlp = sparse_block(config) if config.moe else GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any, cache: KVCache | None = None,
                return_attention: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> (B, T, D). `mask`: the attention mask, or for a DeltaNet layer its segment
        starts (see `Qwen3_5Model._layers`); a `Ragged` for either."""
        h = self.input_layernorm(x)
        probs = None
        if self.layer_type == "linear_attention":
            if return_attention:
                raise ValueError(f"layer {self.linear_attn.layer_idx} is a linear-attention (Gated DeltaNet) layer: it "
                                 "has no attention probabilities — name full-attention layers")
            h = self.linear_attn(h, mask, cache)
        elif return_attention:
            h, probs = self.self_attn(h, cos, sin, mask, cache, return_probs=True)
        else:
            h = self.self_attn(h, cos, sin, mask, cache)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return (x, probs) if return_attention else x


def _check_no_shared_prefix(mask: torch.Tensor) -> None:
    """A caller's 4-D mask (B, 1, T, T) where a token that does not see the token before it sees earlier
    ones: a sequence that continues a shared prefix, which a recurrent state cannot branch to."""
    starts = segment_starts(mask.bool(), mask.shape[-1])
    b, t = starts.nonzero(as_tuple=True)
    if len(t) and bool((mask[b, 0, t].sum(-1) > 1).any()):
        raise ValueError("rows whose sequences share a prefix, given as a 4-D mask, cannot run through linear-attention "
                         "layers — pass document_ids (0 the prefix) with position_ids: each sequence then runs after it")


class Qwen3_5Model(DecoderBody):
    """Embeddings, decoder layers, final norm (HF's `model.` prefix); the floor's forward, with the
    DeltaNet layers given where sequences start instead of a mask."""

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__(config)
        self.build(Qwen3_5DecoderLayer, norm=OffsetRMSNorm, rope=config.rope_spec())

    def _layers(self, x: torch.Tensor, tables: Sequence[tuple[torch.Tensor, torch.Tensor]], masks: Sequence,
                cache: KVCache | None, hidden_layers: Collection[int], attention_layers: Collection[int],
                additions: Sequence[torch.Tensor] = ()):
        starts = segment_starts(masks[0], x.shape[1])  # one mask for every layer (no windows)
        masks = [starts if t == "linear_attention" else m for t, m in zip(self.config.layer_types, masks)]
        return super()._layers(x, tables, masks, cache, hidden_layers, attention_layers, additions)


    def _forward_block_mask(self, x: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                            document_ids: torch.Tensor | None, cache: KVCache | None,
                            hidden_layers: Collection[int] = (), attention_layers: Collection[int] = (),
                            additions: Sequence[torch.Tensor] = ()):
        """Rows of several sequences. A row whose documents share a prefix (document id 0, DPO's prompt,
        GRPO's prompt) runs as one row per document, [prefix; document], since a recurrent state cannot
        branch inside a row; each token's hidden state is that of its first copy (the prefix's: from its
        first document's row). Without a shared prefix, as the floor (restarts at each document). `additions`
        (DeepStack's) are not taken: Qwen3.5 has none, and its images do not go in packed rows yet."""
        if additions:
            raise ValueError("qwen3_5: additions to the layers' outputs in rows of several sequences — not supported")
        if document_ids is None and mask is not None and position_ids is not None:
            _check_no_shared_prefix(mask)
        if document_ids is None or position_ids is None or cache is not None or not bool((document_ids == 0).any()):
            return super()._forward_block_mask(x, mask, position_ids, document_ids, cache, hidden_layers,
                                               attention_layers)
        if hidden_layers or attention_layers:
            raise ValueError("captured layers of rows whose documents share a prefix are not supported by Qwen3.5 "
                             "— lay each sequence out in a row of its own")
        B, T, D = x.shape
        rows, first = [], {}  # first: a flat position (b T + t) -> (row, slot) of its first copy
        for b, ids in enumerate(document_ids.tolist()):
            prefix = [t for t, d in enumerate(ids) if d == 0]
            for d in sorted({d for d in ids if d > 0}) or [None]:
                row = prefix + [t for t, i in enumerate(ids) if i == d]
                for slot, t in enumerate(row):
                    first.setdefault(b * T + t, (len(rows), slot))
                rows.append([b * T + t for t in row])
        L = max(len(r) for r in rows)
        index = torch.tensor([r + [r[-1]] * (L - len(r)) for r in rows], device=x.device)  # (M, L), right-padded
        docs = torch.tensor([[1] * len(r) + [-1] * (L - len(r)) for r in rows], device=x.device)
        out = super()._forward_block_mask(x.flatten(0, 1)[index], None, position_ids.to(x.device).flatten()[index],
                                          docs, None)  # (M, L, D)
        source = [first.get(p, (0, 0)) for p in range(B * T)]  # padding: any copy, zeroed below
        flat = torch.tensor([r * L + s for r, s in source], device=x.device)
        real = torch.tensor([p in first for p in range(B * T)], device=x.device)
        return (out.flatten(0, 1)[flat] * real[:, None].to(out.dtype)).view(B, T, D)


class Qwen3_5ForCausalLM(CausalLM):
    """The causal LM: `model` + `lm_head`; forward returns hidden states, not logits."""

    block_types = (Qwen3_5DecoderLayer,)
    # the multi-token-prediction head (mtp.*): not part of the causal LM's forward, never read at load;
    # a saved model (full fine-tuning, minitrain merge) carries it over as it was
    ignore_checkpoint_keys = carry_checkpoint_keys = (r"^mtp\.",)

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__(config, Qwen3_5Model(config))


class Qwen3_5VLTextModel(MRopeBody, Qwen3_5Model):
    """Qwen3.5's body (`model.language_model.`) whose attention layers' RoPE reads 3-D positions (3, B, T) too."""


class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """A multimodal Qwen3.5 checkpoint (`Qwen3_5ForConditionalGeneration`): Qwen3-VL's model (its tower
    `model.visual.*`, without DeepStack; the images' features in the `<|image_pad|>` places, 3-D positions by
    `rope_index`, interleaved M-RoPE over the rotated dims) over Qwen3.5's language model
    (`model.language_model.*`, `lm_head`). A save (full fine-tuning, minitrain merge) writes the `mtp.*` head
    back as it was read from the source folder (`carry_checkpoint_keys`)."""

    block_types = (Qwen3_5DecoderLayer,)
    text_model = Qwen3_5VLTextModel
    packs_images = False  # its DeltaNet body's packed path takes no 3-D positions yet
    ignore_checkpoint_keys = (r"^mtp\.", r"\.rotary_emb\.inv_freq$")
    carry_checkpoint_keys = (r"^mtp\.",)


class Qwen3_5MoeForCausalLM(MoeCausalLM, Qwen3_5ForCausalLM):
    """The MoE sizes' causal LM: the load-balancing loss and expert metrics of `MoeCausalLM`; the experts
    read from fused keys or the per-expert ones (`checkpoint_parts`)."""

    def checkpoint_parts(self) -> dict[str, tuple[str, tuple]]:
        return expert_parts(self.config, "model")


def expert_parts(c: Qwen3_5Config, body: str) -> dict[str, tuple[str, tuple]]:
    """The per-expert checkpoint keys (`{body}.layers.N.mlp.experts.{e}.{gate,up,down}_proj.weight`) -> (the fused
    parameter, the index each fills)."""
    parts: dict[str, tuple[str, tuple]] = {}
    for i in range(c.num_hidden_layers):
        mlp = f"{body}.layers.{i}.mlp"
        parts.update(per_expert_keys(mlp, mlp, c.num_experts, c.moe_intermediate_size))
    return parts


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration, MoeCausalLM):
    """A multimodal Qwen3.5 MoE checkpoint (`Qwen3_5MoeForConditionalGeneration`): the same tower and image
    forward over the MoE sizes' language model (the load-balancing loss and expert metrics of `MoeCausalLM`)."""

    def checkpoint_parts(self) -> dict[str, tuple[str, tuple]]:
        """The per-expert keys under `model.language_model.` (the layout transformers 5 saves; not the flat one,
        whose fused expert keys would be a second source of the same parameters)."""
        return expert_parts(self.config, "model.language_model")


def config_from_hf(d: dict[str, Any]) -> Qwen3_5Config:
    """The registry's entry point (models/__init__.py): `Qwen3_5Config.from_hf`, or `from_multimodal`."""
    return Qwen3_5Config.from_multimodal(d) if d.get("model_type") in MULTIMODAL_TYPES else Qwen3_5Config.from_hf(d)
