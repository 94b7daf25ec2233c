"""The memory plan of Qwen3.5 (`models/qwen3_5.py`): Gated DeltaNet layers among gated full-attention ones.

LLaMA's method (`minitrain.plan.decoder`), block by block, since the two kinds of layer keep different
tensors: `layer_types` says which layer is which, and a shape with `mixer` set is one kind's block
(its mixer's linears + the SwiGLU MLP). Every norm but the gated one is Gemma's (1 + w), which keeps
LLaMA's fp32 input. What differs (read off the autograd graph of a LoRA SFT step on the CPU):

- a DeltaNet layer (value heads H of dv, key heads of dk, convolution channels Ch = 2 Hk dk + H dv,
  the chunk C = 64) keeps per token: the convolution's output (SiLU's input, Ch x s), one float mask per
  tap (K x 4, restarts at sequence starts), q and k repeated to the value heads for the L2 norm (2 H dk
  x 4, fp32) with their rsqrt, beta and the log decay (2 H x 4), and the gated RMSNorm's fp32 tensors
  (its input, the normalised value, the gate and SiLU's output: 4 H dv x 4, + an rsqrt per head);
- the chunked delta rule keeps, per token of the sequence padded to whole chunks, eight (C, C) blocks
  per head (the decay, the triangular system and its solve, q . k, ...: 8 H C x 4) and the pair mask
  (C bytes), four dk-wide and one dv-wide fp32 tensor per head (the chunked keys, the solve's
  right-hand side, each chunk's updates u: (4 dk + dv) H x 4) and six scalars per head; and per chunk
  the recurrent state S entering it (H dk dv x 4). So memory grows with the sequence times the chunk,
  never with the sequence squared;
- under checkpointing, the block whose recompute and backward hold the most is the peak, not the last
  one (a DeltaNet block keeps more than an attention block). A DeltaNet block's recompute peaks at the end
  of its delta rule (the stack of the chunks' outputs), before the block keeps its later tensors: beside
  what it keeps, per padded token and value head, the chunks' outputs (dv x s), the padded v, the solve's
  right-hand side and the decayed keys that nothing keeps ((2 dk + 2 dv) x 4), and under autocast the fp32
  padded q and k (2 dk x 4: the matmuls keep bf16 copies). Its backward holds less than the block keeps:
  the rule's tensors are freed as it goes (measured on the CPU: the largest moment is SwiGLU's backward);
- a full-attention layer: Qwen3's (q / k norms) with the output gate, whose product keeps the
  attention output and sigmoid's output (2 Hq x s) and gives o_proj its own input; RoPE tables of the
  rotary dims only (`partial_rotary_factor`);
- adapters on `in_proj_qkv`, `in_proj_z`, `in_proj_a`, `in_proj_b` read the normed x (as q / k / v);
  on `out_proj` the gated norm's output (H dv x s).

The MoE sizes (`Qwen3_5MoeShape`): every MLP the experts, counted as `minitrain.plan.moe` counts them, and a
shared expert.

Full fine-tuning (`finetune=full`): every weight in fp32 with its gradient and AdamW moments (`all_tensors`, block
by block); an attention block keeps LLaMA's full terms and o_proj's own input, a DeltaNet block its linears' inputs,
its convolution's input and its gated norm's normalised value (`full_block_saved`).

Modelled: LoRA / QLoRA runs and full fine-tuning, in one process and on several ranks; measured
against the CPU (tests/test_plan.py, tests/test_plan_hybrid.py) on SFT steps (fp32, bf16 autocast, checkpointing,
rows several chunks long); DPO / KTO use the same terms, unmeasured for this family (a shared-prompt row, which runs
as one row per sequence, is not modelled). GRPO's sampler: its hybrid cache (`sampler_cache`: the attention layers'
keys and values, the DeltaNet layers' states), equal to what the cache holds after sampling; a GRPO step's peak is
not measured for this family. Several ranks (`minitrain.plan.sharded`): a DeltaNet block's conv1d, dt_bias, A_log
and gated norm (`block_tensors`, `block_vectors`) sharded with its linears; LoRA, QLoRA (under fsdp the base by rows)
and full fine-tuning under ddp and fsdp measured on 2 gloo ranks (tests/test_plan_ranks.py); QLoRA under fsdp on the
MoE sizes is refused with one line (`minitrain.plan.moe`). Distillation with a Qwen3.5 student or teacher
(`minitrain.plan.decoder`'s teacher terms): the teacher's weights, and its no_grad forward block by block, whose largest
stage is a DeltaNet block's delta rule (what `deltanet_saved` counts, without its gated norm, which runs after it:
`no_grad_block`); a step measured in tests/test_plan_teacher.py (fp32), as a student and as a teacher. Under bf16
autocast that stage is counted high for a teacher (measured once on the CPU: its forward 0.75 of the plan's, a step
whose peak it is 0.69); not refined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from minitrain.errors import UserError
from minitrain.plan.decoder import ByBlock, ModelShape, adapted_linears, block_saved
from minitrain.plan.moe import ExpertBlocks, SharedExpert
from minitrain.plan.run_shape import RunShape, Term

CHUNK = 64  # models.qwen3_5.GatedDeltaNet.chunk_size
DEFAULTS = dict(num_key_value_heads=4, head_dim=256, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                linear_num_value_heads=32, full_attention_interval=4)  # transformers' class defaults
EARLY = ("in_proj_qkv", "in_proj_a", "in_proj_b")  # the linears a DeltaNet block runs before its delta rule
DELTANET = {"linear_attn.in_proj_qkv": "xn", "linear_attn.in_proj_z": "xn", "linear_attn.in_proj_b": "xn",
            "linear_attn.in_proj_a": "xn", "linear_attn.out_proj": "dn"}


@dataclass(frozen=True)
class Qwen3_5Shape(ByBlock, ModelShape):
    """A Qwen3.5 (dense) checkpoint's dims. `mixer`: None for the whole model, or one kind of layer
    ("linear_attention", "full_attention") whose block `block_saved` then describes."""

    layer_types: tuple[str, ...] = ()
    rotary_dim: int = 0
    conv_kernel: int = 4
    key_heads: int = 16
    value_heads: int = 32
    key_dim: int = 128
    value_dim: int = 128
    mixer: str | None = None
    FAMILY: ClassVar[str] = "Qwen3.5"
    FULL: ClassVar[bool] = True
    SAMPLER: ClassVar[bool] = True
    FAMILIES: ClassVar[tuple[str, ...]] = ("qwen3_5_text",)
    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3_5_text", "qwen3_5_moe_text")  # the multimodal ones: plan/vision.py
    MOE_DEFAULTS: ClassVar[dict[str, Any]] = {}  # transformers' class defaults of the MoE fields

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> "Qwen3_5Shape":
        """The dense sizes' shape, or the MoE sizes' (`Qwen3_5MoeShape`)."""
        if d.get("model_type") == "qwen3_5_moe_text" and cls is Qwen3_5Shape:
            return Qwen3_5MoeShape.from_hf(d, where)
        full = {**DEFAULTS, **cls.MOE_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
        rope = full.get("rope_parameters") or full.get("rope_scaling") or {}
        partial = rope.get("partial_rotary_factor", full["partial_rotary_factor"])
        dims = cls._dims({**full, **cls.mlp_dims(full)}, where, {})
        L, n = dims["num_hidden_layers"], full["full_attention_interval"]
        types = tuple(full.get("layer_types") or ["full_attention" if (i + 1) % n == 0 else "linear_attention"
                                                  for i in range(L)])
        if len(types) != L or set(types) - {"linear_attention", "full_attention"}:
            raise UserError(f"{where}: layer_types must list linear_attention / full_attention once per layer — "
                            f"the memory plan cannot read {list(types)}")
        bias = bool(full.get("attention_bias", False))
        return cls(**dims, qkv_bias=bias, o_bias=bias, qk_norm=True, layer_types=types,
                   rotary_dim=int(dims["head_dim"] * partial), conv_kernel=full["linear_conv_kernel_dim"],
                   key_heads=full["linear_num_key_heads"], value_heads=full["linear_num_value_heads"],
                   key_dim=full["linear_key_head_dim"], value_dim=full["linear_value_head_dim"], **cls.moe_fields(full))

    @staticmethod
    def mlp_dims(full: dict[str, Any]) -> dict[str, Any]:
        """config.json fields the shape reads differently (dense: none; `intermediate_size` is the MLP's width)."""
        return {}

    @staticmethod
    def moe_fields(full: dict[str, Any]) -> dict[str, Any]:
        """The MoE sizes' own dataclass fields (dense: none)."""
        return {}

    def of(self, mixer: str | None) -> "Qwen3_5Shape":
        return replace(self, mixer=mixer)

    def block_view(self, i: int) -> "Qwen3_5Shape":
        return self.of(self.layer_types[i])

    @property
    def channels(self) -> int:
        """The DeltaNet convolution's channels: q, k (key heads x dk) and v (value heads x dv)."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        D, Hv, C = self.hidden_size, self.value_heads, self.channels
        out = {}
        if self.mixer != "linear_attention":
            q, kv = self.q_width, self.kv_width
            out.update({"self_attn.q_proj": (D, 2 * q), "self_attn.k_proj": (D, kv), "self_attn.v_proj": (D, kv),
                        "self_attn.o_proj": (q, D)})
        if self.mixer != "full_attention":
            out.update({"linear_attn.in_proj_qkv": (D, C), "linear_attn.in_proj_z": (D, Hv * self.value_dim),
                        "linear_attn.in_proj_b": (D, Hv), "linear_attn.in_proj_a": (D, Hv),
                        "linear_attn.out_proj": (Hv * self.value_dim, D)})
        return {**out, **self.mlp_linears()}

    def mlp_linears(self) -> dict[str, tuple[int, int]]:
        D, F = self.hidden_size, self.intermediate_size
        return {"mlp.gate_proj": (D, F), "mlp.up_proj": (D, F), "mlp.down_proj": (F, D)}

    def layers_with(self, name: str) -> int:
        if name.startswith("mlp."):
            return self.num_hidden_layers
        return self.layer_types.count("linear_attention" if name.startswith("linear_attn.") else "full_attention")

    def inputs(self) -> tuple[dict[str, str], dict[str, int]]:
        """o_proj reads the gated product (its own tensor, "gated"); out_proj the gated norm's output."""
        of, width = super().inputs()
        return ({**of, **DELTANET, "self_attn.o_proj": "gated"},
                {**width, "dn": self.value_heads * self.value_dim, "gated": self.q_width})

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim

    def small_params(self) -> tuple[int, str]:
        """Per block the two norms; an attention layer's q / k norms (+ biases); a DeltaNet layer's
        convolution (Ch x K), dt_bias and A_log (H each) and gated norm (dv); the final norm."""
        D, hd = self.hidden_size, self.head_dim
        full, lin = self.layer_types.count("full_attention"), self.layer_types.count("linear_attention")
        attn = 2 * hd + (2 * self.q_width + 2 * self.kv_width + D if self.qkv_bias else 0)
        delta = self.channels * self.conv_kernel + 2 * self.value_heads + self.value_dim
        n = self.num_hidden_layers * 2 * D + full * attn + lin * delta + D
        return n, f"{self.num_hidden_layers} x 2 x {D} + {full} x {attn:,} + {lin} x {delta:,} + {D}"

    def block_small(self, i: int) -> list[int]:
        """Block i's two norms; an attention layer's q / k norms (+ biases, q_proj's gate-wide); a DeltaNet layer's
        convolution, dt_bias, A_log and gated norm (as `small_params` counts them)."""
        D, hd, q, kv = self.hidden_size, self.head_dim, self.q_width, self.kv_width
        if self.layer_types[i] == "linear_attention":
            return [D, D, self.channels * self.conv_kernel, self.value_heads, self.value_heads, self.value_dim]
        return [D, D, hd, hd] + ([2 * q, kv, kv, D] if self.qkv_bias else [])

    def full_block_saved(self, run: RunShape) -> list[Term]:
        """Full fine-tuning: an attention block keeps LLaMA's terms and o_proj's own input (the gated product); a
        DeltaNet block its two norms' normalised inputs, the inputs of its linears (in fp32 in_proj_* share the normed
        x; under autocast each keeps its own cast; out_proj the gated norm's output), the convolution's input and
        the gated norm's normalised value (for their weights' gradients)."""
        N, s, D, F = run.tokens, run.s, self.hidden_size, self.intermediate_size
        if self.mixer != "linear_attention":
            return super().full_block_saved(run) + [Term("o_proj's input: the gated product", N * self.q_width * s,
                                                         "Hq x s per token")]
        Hdv, casts = self.value_heads * self.value_dim, 6 * D if s < 4 else 2 * D  # in_proj_* x 4, gate, up
        return [Term("norms' normalised inputs (weight grads)", N * 2 * D * 4, "2 x D x 4 per token"),
                Term("linear inputs kept for weight grads", N * (casts + F + Hdv) * s,
                     f"({'6' if s < 4 else '2'} D + F + H dv) x {s} B per token"),
                Term("DeltaNet: the convolution's input, the gated norm's normalised value",
                     N * (self.channels * s + Hdv * 4), "Ch x s + H dv x 4 per token")]

    def sampler_cache(self, run: RunShape) -> list[Term]:
        """GRPO's hybrid cache: keys and values of the attention layers only; a DeltaNet layer's state per row, its
        convolution's window (the last K - 1 inputs: Ch x (K - 1) x s) and its recurrent state (H x dk x dv, fp32)."""
        R, T, s = run.sample_rows, run.seq, run.s
        full, lin = self.layer_types.count("full_attention"), self.layer_types.count("linear_attention")
        kv = R * T * full * 2 * self.kv_width * s
        K, H = self.conv_kernel, self.value_heads
        state = R * lin * (self.channels * (K - 1) * s + H * self.key_dim * self.value_dim * 4)
        return [Term("sampler: KV cache (attention layers)", kv, f"{R} rows x {T} slots x {full} layers x 2 x "
                                                                  f"{self.kv_width} x {s} B"),
                Term("sampler: DeltaNet states", state, f"{R} rows x {lin} layers x (Ch x (K - 1) x {s} + H dk dv x 4) B")]

    def describe(self) -> str:
        lin = self.layer_types.count("linear_attention")
        return (f"{self.num_hidden_layers} layers ({lin} Gated DeltaNet, {self.num_hidden_layers - lin} full "
                f"attention), hidden {self.hidden_size}, vocab {self.vocab_size:,}")

    def saved_per_layer(self, run: RunShape) -> list[int]:
        per = {t: sum(x.bytes for x in block_saved(self.of(t), run)) for t in set(self.layer_types)}
        return [per[t] for t in self.layer_types]

    def attention_saved(self, run: RunShape) -> list[Term]:
        if self.mixer == "linear_attention":
            return self.deltanet_saved(run)
        N, s, q = run.tokens, run.s, self.q_width
        return super().attention_saved(run) + [
            Term("output gate: attention output + sigmoid", N * 2 * q * s, "2 x Hq x s per token")]

    def block_vectors(self) -> list[tuple[str, int]]:
        """A DeltaNet block's norms: its two and the gated norm (dv); a full-attention block's: Qwen3's, its q bias
        (`attention_bias`) as wide as the gated q_proj."""
        if self.mixer != "linear_attention":
            return [(n, 2 * d if n == "self_attn.q_proj.bias" else d) for n, d in super().block_vectors()]
        return [("norm0", self.hidden_size), ("norm1", self.hidden_size), ("linear_attn.norm", self.value_dim)]

    def block_tensors(self, run: RunShape) -> list[tuple[str, tuple[int, ...], bool]]:
        """A DeltaNet block's convolution (Ch, 1, K), dt_bias and A_log (H each), as FSDP2 shards them."""
        if self.mixer != "linear_attention":
            return super().block_tensors(run)
        H = self.value_heads
        conv = (self.channels, 1, self.conv_kernel)
        own = [("linear_attn.conv1d", conv), ("linear_attn.dt_bias", (H,)), ("linear_attn.A_log", (H,))]
        return super().block_tensors(run) + [(n, shape, run.full) for n, shape in own]

    def deltanet_saved(self, run: RunShape) -> list[Term]:
        """What a DeltaNet layer keeps beyond its linears' inputs (the module docstring)."""
        N, s, H, dk, dv, K = run.tokens, run.s, self.value_heads, self.key_dim, self.value_dim, self.conv_kernel
        repeated = self.value_heads > self.key_heads  # else q, k are views of SiLU's output, kept whole
        per = self.channels * s + K * 4 + (2 * H * dk * 4 if repeated else self.channels * s) + 2 * H * 4 + 2 * H * 4
        padded = padded_tokens(run)
        chunks = padded // CHUNK
        per_padded = 8 * H * CHUNK * 4 + CHUNK + (4 * dk + dv) * H * 4 + 6 * H * 4
        return [Term("DeltaNet: conv output, tap masks, q / k norm inputs, beta, decay", N * per,
                     f"{per:,} B per token"),
                Term("DeltaNet: chunked delta rule (per chunk: C x C blocks, u, keys)", padded * per_padded,
                     f"{padded:,} padded tokens x (8 H C x 4 + C + (4 dk + dv) H x 4 + 6 H x 4) = {per_padded:,} B"),
                Term("DeltaNet: the state entering each chunk", chunks * H * dk * dv * 4,
                     f"{chunks} chunks x H x dk x dv x 4"),
                Term("DeltaNet: gated RMSNorm (fp32)", N * (4 * H * dv + H) * 4, "(4 H dv + H) x 4 per token")]

    def recompute_peaks(self, run: RunShape, saved: int) -> list[list[Term]]:
        """A DeltaNet block's recompute peaks at the end of the chunked delta rule (the stack of its chunks'
        outputs), before the block keeps its later tensors (the gated norm's, out_proj's and in_proj_z's inputs,
        the MLP's), beside the rule's own tensors that nothing keeps (the module docstring)."""
        peaks = super().recompute_peaks(run, saved)
        if self.mixer != "linear_attention":
            return peaks
        early = [n for n in adapted_linears(self, run.lora_targets) if n.rsplit(".", 1)[-1] in EARLY]
        late = ("DeltaNet: gated RMSNorm", "gated MLP", "experts", "shared expert")
        kept = sum(t.bytes for t in block_saved(self, replace(run, lora_targets=tuple(early)))
                   if not t.name.startswith(late)) - run.tokens * self.hidden_size * 4  # (the MLP's norm: not yet)
        H, dk, dv, s = self.value_heads, self.key_dim, self.value_dim, run.s
        per = H * ((2 * dk + 2 * dv) * 4 + dv * s + (2 * dk * 4 if s < 4 else 0))
        return peaks + [[Term("one block recomputed, up to the end of the delta rule", kept, "block_saved, in part"),
                         Term("DeltaNet: the delta rule's chunk outputs and unkept tensors", padded_tokens(run) * per,
                              f"padded tokens x H x ((2 dk + 2 dv) x 4 + dv x s{' + 2 dk x 4' if s < 4 else ''})")]]


def padded_tokens(run: RunShape) -> int:
    """The tokens the chunked delta rule runs over: each row padded to whole chunks (a ragged batch: one row)."""
    rows = 1 if run.real_tokens is not None else run.rows
    return rows * math.ceil(run.tokens / rows / CHUNK) * CHUNK


@dataclass(frozen=True)
class Qwen3_5MoeShape(SharedExpert, ExpertBlocks, Qwen3_5Shape):
    """The MoE sizes (35B-A3B, 122B-A10B, 397B-A17B): every block's MLP the experts (`ExpertBlocks`: every
    expert in memory, each token through K of them) beside a shared expert of width `shared_size`, scaled by
    sigmoid(`shared_expert_gate`) (`SharedExpert`; LLaMA's names select its linears: peft maps none onto
    Qwen3.5's experts)."""

    num_experts: int = 256
    top_k: int = 8
    expert_size: int = 512
    shared_size: int = 512
    ALIASED: ClassVar[bool] = False
    FAMILY: ClassVar[str] = "Qwen3.5 MoE"
    FAMILIES: ClassVar[tuple[str, ...]] = ("qwen3_5_moe_text",)
    MOE_DEFAULTS: ClassVar[dict[str, Any]] = dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                                  shared_expert_intermediate_size=512)

    @staticmethod
    def mlp_dims(full: dict[str, Any]) -> dict[str, Any]:
        return {"intermediate_size": full["num_experts_per_tok"] * full["moe_intermediate_size"]
                + full["shared_expert_intermediate_size"]}

    @staticmethod
    def moe_fields(full: dict[str, Any]) -> dict[str, Any]:
        return dict(num_experts=full["num_experts"], top_k=full["num_experts_per_tok"],
                    expert_size=full["moe_intermediate_size"], shared_size=full["shared_expert_intermediate_size"])

    def mlp_linears(self) -> dict[str, tuple[int, int]]:
        return self.shared_linears()

    def describe(self) -> str:
        return super().describe() + f", {self.num_experts} experts of {self.expert_size} (top {self.top_k}) + a shared one"
