"""The memory plan of gpt-oss (`models/gpt_oss.py`): every expert in memory, in the run's float dtype.

`minitrain.plan.moe`'s expert terms (`ExpertBlocks`) over LLaMA's method, with what gpt-oss changes:

- weights: q / k / v / o biases, a sink per head, the router's bias (E) and the experts' biases (E x 2F_e
  and E x D per block), in the compute dtype. The released checkpoints store the experts in MXFP4
  (`*_blocks` + `*_scales`, about 0.53 B a weight): the loader dequantizes them as they arrive and keeps
  nothing packed, so they count as float weights (tests/test_plan_moe.py loads an MXFP4 folder and
  counts what the model holds). `quantize=` cannot reach them (the loader refuses it: one line here too);
- attention: every layer's is written out (a sink joins each row's softmax, which SDPA cannot take),
  so a block keeps its queries, the repeated keys and the values, and per query and key the softmax's
  output (S + 1 columns with the sink's; under autocast also the compute-dtype copy the second matmul
  reads) and the row maxima's int64 indices; the sliding / full layers differ only in their masks;
- the experts' clamped SwiGLU keeps twice SwiGLU's tensors per (token, expert) row: the first product
  (gate and up interleaved), the clamped gate, sigmoid's output, up + 1 and the gated product;
- routing: the top-K logits' softmax, so no fp32 probabilities over every expert (`ExpertBlocks` counts
  the router's logits, the choices and weights).

Modelled: LoRA and full fine-tuning in one process and on several ranks (ddp, fsdp: `minitrain.plan.sharded`, each
block's sinks and biases sharded with it), measured against the CPU in tests/test_plan_moe.py; distillation with a
gpt-oss student or teacher (its no_grad forward's largest stage: the written-out attention or the experts), measured in
tests/test_plan_teacher.py. `quantize=` and, on a gpt-oss teacher, `teacher_quantize=` are refused with one line
(`check_quantize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from minitrain.errors import UserError
from minitrain.plan.decoder import ModelShape
from minitrain.plan.moe import ExpertBlocks
from minitrain.plan.run_shape import RunShape, Term


@dataclass(frozen=True)
class GptOssShape(ExpertBlocks, ModelShape):
    """A gpt-oss checkpoint's dims. `intermediate_size` is K x F_e (the rows a token's experts compute),
    `expert_size` each expert's F_e; every block sparse."""

    num_experts: int = 128
    top_k: int = 4
    expert_size: int = 2880
    ATTENTION: ClassVar[str] = "the attention written out for its sinks"
    ALIASED: ClassVar[bool] = False  # peft maps no per-expert name onto gpt-oss's experts
    ROUTER: ClassVar[str] = "mlp.router"
    PROBS: ClassVar[int] = 0  # the top-K logits' softmax: no fp32 probabilities over every expert
    FAMILIES: ClassVar[tuple[str, ...]] = ("gpt_oss",)
    DEFAULTS: ClassVar[dict[str, Any]] = dict(num_key_value_heads=8, head_dim=64, num_local_experts=128,
                                              num_experts_per_tok=4, sliding_window=128, attention_bias=True)

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> "GptOssShape":
        full = {**cls.DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
        K, Fe = full["num_experts_per_tok"], full["intermediate_size"]
        dims = cls._dims({**full, "intermediate_size": K * Fe}, where, {})
        bias = bool(full["attention_bias"])
        return cls(**dims, sliding_window=full["sliding_window"], qkv_bias=bias, o_bias=bias,
                   num_experts=full["num_local_experts"], top_k=K, expert_size=Fe)

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each block's linears: the attention's (the experts are 3-D weights)."""
        return {k: v for k, v in super().linears().items() if k.startswith("self_attn.")}

    def block_biases(self) -> list[int]:
        """Numel of one block's tensors beside its matrices that `ModelShape` does not count: the sinks, the
        router's bias and the experts' biases."""
        E, D, F = self.num_experts, self.hidden_size, self.expert_size
        return [self.num_attention_heads, E, E * 2 * F, E * D]

    def block_tensors(self, run: RunShape) -> list[tuple[str, tuple[int, ...], bool]]:
        E, D, F = self.num_experts, self.hidden_size, self.expert_size
        return super().block_tensors(run) + [
            ("self_attn.sinks", (self.num_attention_heads,), run.full), ("mlp.router.bias", (E,), run.full),
            ("mlp.experts.gate_up_proj_bias", (E, 2 * F), run.full), ("mlp.experts.down_proj_bias", (E, D), run.full)]

    def router_tensors(self) -> list[int]:
        return [self.num_experts * self.hidden_size, self.num_experts]

    def small_params(self) -> tuple[int, str]:
        n, formula = super().small_params()
        L, per = self.num_hidden_layers, sum(self.block_biases())
        return n + L * per, f"{formula} + {L} x {per:,} (sinks, router and expert biases)"

    def all_tensors(self) -> list[int]:
        return super().all_tensors() + self.block_biases() * self.num_hidden_layers

    def attention_saved(self, run: RunShape) -> list[Term]:
        """The written-out attention's tensors (the module docstring): S keys per query (+ the sink's column)."""
        N, s, Hq, H, S = run.tokens, run.s, self.q_width, self.num_attention_heads, run.seq
        Hk = Hq if self.n_rep > 1 else self.kv_width
        per_key = s + (s if s < 4 else 0)
        return [Term("attention (written out): q, k, v + the row maxima's indices", N * ((Hq + 2 * Hk) * s + H * 8),
                     f"(Hq + 2 Hk{' (repeated)' if self.n_rep > 1 else ''}) x {s} + heads x 8 per token"),
                Term("attention (written out): softmax output with the sink", N * H * (S + 1) * per_key,
                     f"heads x {S + 1} keys x {per_key} B per token")]

    def extra_block_saved(self, run: RunShape) -> list[Term]:
        """`ExpertBlocks`' terms (no fp32 probabilities: `PROBS`), + the clamped SwiGLU's own."""
        N, s, KF, KD = run.tokens, run.s, self.top_k * self.expert_size, self.top_k * self.hidden_size
        terms = super().extra_block_saved(run) + [
            Term("experts: clamped SwiGLU (clamped gate, sigmoid, up + 1)", N * 3 * KF * s, "3 x K F_e x s per token")]
        if run.full and s < 4:  # the fp32 biases make each product's output fp32: the SwiGLU's rows and the outputs
            terms.append(Term("experts: fp32 products (the fp32 biases under autocast)", N * (6 * KF + 2 * KD) * (4 - s),
                              f"(6 K F_e + 2 K D) x {4 - s} B per token"))
        return terms

    def describe(self) -> str:
        return (f"{self.num_hidden_layers} layers (sliding window {self.sliding_window} / full, alternating), hidden "
                f"{self.hidden_size}, {self.num_experts} experts of {self.expert_size} (top {self.top_k}), vocab "
                f"{self.vocab_size:,}")

    @staticmethod
    def check_quantize(key: str, kind: str) -> None:
        """`key`=`kind` (quantize=, or a teacher's teacher_quantize=) refused in one line: the loader cannot."""
        if kind != "none":
            raise UserError(f"{key}={kind}: gpt-oss's experts (an in-out layout with biases, MXFP4 in its "
                            f"checkpoints) are not ones minitrain quantizes — drop {key}=" + (
                                " (LoRA on the dequantized experts)" if key == "quantize" else ""))

    def check_run(self, run: RunShape) -> None:
        self.check_quantize("quantize", run.quantize)
