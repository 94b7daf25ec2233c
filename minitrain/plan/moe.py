"""The memory plan of a mixture-of-experts checkpoint (Qwen3-MoE, Qwen2-MoE, Mixtral): every expert in memory.

LLaMA's method (`minitrain.plan.decoder`) over Qwen3 / Mistral attention, with the MLP of each layer
the experts: E gated MLPs of width F_e, of which each token goes through K. What differs:

- weights: the attention linears (in the run's format), the experts' 3-D weights (every expert:
  3 x D x F_e each; nf4 / int8 quantized per expert as `minitrain.adapters.quant_experts` holds them)
  and each layer's router (D x E, never quantized);
- adapters: LoRA on the attention linears the targets name, and an expert LoRA per adapted expert
  weight (`experts.gate_up_proj`, `experts.down_proj`, or the per-expert names that map onto them):
  E x r x (in + out) each;
- activations: per token the K (token, expert) rows go through SwiGLU, so the gated MLP's terms are
  LLaMA's with F = K x F_e; besides, each sparse block keeps the router's logits and fp32
  probabilities, the K choices and weights, the gathered rows an adapted `gate_up_proj` reads, the
  rows an adapted `down_proj` reads, the experts' outputs before their routing weights and after them (what
  `index_add_` keeps).

Qwen2-MoE (`Qwen2MoeShape`) adds a shared expert to every sparse block (`SharedExpert`, as Qwen3.5's MoE sizes).
Qwen's dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step`) hold LLaMA's SwiGLU of
`intermediate_size` in place of the experts: their blocks are planned on their own (`MoeShape.block_view`), and
on Qwen3-MoE their `gate_proj` / `up_proj` / `down_proj` stay unadapted (peft moves those names onto the experts).
Full fine-tuning: every expert and router trains in fp32 (`all_tensors`, `block_matrices`: the gradients
and autocast's bf16 copies); a block keeps the gathered rows its experts' `gate_up_proj` read for their
weight gradients besides LLaMA's full terms.

`ExpertBlocks` holds these expert terms; Qwen3.5's MoE sizes (`minitrain.plan.qwen3_5`) and Gemma 4's
(`minitrain.plan.gemma4`: its experts and router under their own module names, `EXPERTS` / `ROUTER`) add them too.
Several ranks: `minitrain.plan.sharded` (ddp: the whole model per rank; fsdp: FSDP2 shards each expert weight,
expert adapter and router by its first dim, E, with the block that holds it: `block_tensors`).
Modelled: LoRA / QLoRA and full fine-tuning in one process and under ddp, LoRA (a trained router too:
modules_to_save, its frozen copy whole on each rank), QLoRA (each rank's experts quantized, E first) and full
fine-tuning under fsdp (measured against the CPU in tests/test_plan.py; dense layers, gpt-oss and 2 ranks in
tests/test_plan_moe.py; Qwen3.5's and Gemma 4's MoE sizes, LoRA and Gemma 4's trained router on 2 ranks, in
tests/test_plan_ranks.py).
Distillation: an MoE student or teacher (`minitrain.plan.decoder`'s teacher terms: the teacher's experts and routers
in the compute dtype or quantized each expert apart under `teacher_quantize`, its no_grad forward by its largest
stage, the routed experts' or the MLP beside them: `no_grad_block`), measured in tests/test_plan_teacher.py.
gpt-oss: `minitrain.plan.gpt_oss`, over these terms.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from minitrain.plan.decoder import ModelShape, block_saved, matches
from minitrain.plan.run_shape import RunShape, Term, int8_bytes, nf4_bytes

NF4_CODE = 16 * 4  # the nf4 value table (fp32) `nf4_bytes` counts, which quantized experts do not keep

# what peft 0.21 (and minitrain's `expert_aliases`) map onto the fused expert weights
ALIASES = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj",
           "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}


class ExpertBlocks:
    """What a shape whose every block's MLP is the experts adds to its family's terms (MoeShape; Qwen3.5's
    MoE sizes, `minitrain.plan.qwen3_5`): the experts' and routers' weights, the expert adapters, and each
    sparse block's routing tensors. The shape has `num_experts`, `top_k` and `expert_size` (F_e)."""

    num_experts: int
    top_k: int
    expert_size: int
    EXPERTS: ClassVar[str] = "mlp.experts"  # the experts' module path in a block (Gemma 4's: `experts`)
    ROUTER: ClassVar[str] = "mlp.gate"  # the router's (Gemma 4's: `router`), which `modules_to_save` may train
    PROBS: ClassVar[int] = 4  # bytes per expert of the router's probabilities (a softmax over every expert, fp32)

    @property
    def sparse_count(self) -> int:
        """The blocks whose MLP is the experts (every block here; a Qwen-MoE's dense layers: `MoeShape`)."""
        return self.num_hidden_layers

    @property
    def has_experts(self) -> bool:
        """Whether this shape (the whole model, or one block's view) holds experts (a dense layer's view: no)."""
        return True

    def expert_weights(self) -> dict[str, tuple[int, int]]:
        """Each sparse block's expert weights: name -> (in, out) of one expert's matrix."""
        D, F = self.hidden_size, self.expert_size
        return {"gate_up_proj": (D, 2 * F), "down_proj": (F, D)}

    def adapted_experts(self, targets) -> list[str]:
        """The expert weights a LoRA target list adapts (as `minitrain.adapters.lora_experts.split_targets`)."""
        if "all-linear" in targets:
            return list(self.expert_weights())
        picked = {ALIASES[t] for t in targets if t in ALIASES and self.ALIASED}
        picked |= {n for n in self.expert_weights() for t in targets if matches(f"{self.EXPERTS}.{n}", t)}
        return [n for n in self.expert_weights() if n in picked]

    def expert_matrices(self) -> int:
        """Numel of one sparse block's expert weights and router."""
        return sum(i * o for i, o in self.expert_weights().values()) * self.num_experts + self.num_experts * self.hidden_size

    def expert_params(self) -> int:
        """The experts' and routers' parameters."""
        return self.sparse_count * self.expert_matrices()

    def expert_weight_terms(self, run: RunShape) -> list[Term]:
        if run.full:  # full fine-tuning loads every weight in fp32: they are the master weights
            run = replace(run, compute="fp32")
        E, D, L, s = self.num_experts, self.hidden_size, self.sparse_count, run.s
        if run.quantize == "nf4":  # each matrix's packed weights and absmax (the nf4 table: bitsandbytes', at use)
            per = sum(nf4_bytes(i * o, double_quant=False) - NF4_CODE for i, o in self.expert_weights().values())
            how = "per expert: nf4 (0.5 B a weight + an fp32 absmax per 64)"
        elif run.quantize == "int8":
            per = sum(int8_bytes(i, o) for i, o in self.expert_weights().values())
            how = "per expert: int8 + an fp32 scale per row"
        else:
            per = sum(i * o for i, o in self.expert_weights().values()) * s
            how = f"{s} B a weight"
        return [Term("weights: experts", int(L * E * per), f"{L} layers x {E} experts x (3 x D x F_e), {how}"),
                Term("weights: routers", L * E * D * s, f"{L} x E x D x {s} B")]

    def expert_tensors(self, run: RunShape) -> list[int]:
        """Numel of each expert adapter tensor (and a trained router's)."""
        E, L = self.num_experts, self.sparse_count
        if run.full:  # every weight, the experts' and routers' among them (`all_tensors`)
            return []
        out = []
        for name in self.adapted_experts(run.lora_targets):
            i, o = self.expert_weights()[name]
            r = run.rank(i, o)
            out += [E * r * i, E * o * r] * L
        return out + self.router_tensors() * L * sum(matches(self.ROUTER, m) for m in run.modules_to_save)

    def router_tensors(self) -> list[int]:
        """Numel of each of one block's router's parameters."""
        return [self.num_experts * self.hidden_size]

    def block_tensors(self, run: RunShape) -> list[tuple[str, tuple[int, ...], bool]]:
        """A sparse block's experts (E first: FSDP2 gives each rank ceil(E / N) experts), router and expert
        adapters (`ExpertLoRA`'s (E, r, in) and (E, out, r))."""
        if not self.has_experts:
            return super().block_tensors(run)
        E, D = self.num_experts, self.hidden_size
        out = [(f"{self.EXPERTS}.{n}", (E, o, i), run.full) for n, (i, o) in self.expert_weights().items()]
        out += [(f"{self.ROUTER}.weight", (E, D), run.full)]
        for n in ([] if run.full else self.adapted_experts(run.lora_targets)):
            i, o = self.expert_weights()[n]
            r = run.rank(i, o)
            out += [(f"{n}.lora_A", (E, r, i), True), (f"{n}.lora_B", (E, o, r), True)]
        return super().block_tensors(run) + out

    def expert_summary(self, run: RunShape) -> str:
        experts = self.adapted_experts(run.lora_targets)
        return f" + {len(experts)} expert weights x {self.sparse_count} blocks" if experts else ""

    # the family's terms plus the experts' (this class comes first in the shape's bases)
    def num_params(self) -> int:
        return super().num_params() + self.expert_params()

    def all_tensors(self) -> list[int]:
        E, D = self.num_experts, self.hidden_size
        per = [E * i * o for i, o in self.expert_weights().values()] + [E * D]
        return super().all_tensors() + per * self.sparse_count

    def block_matrices(self) -> int:
        return super().block_matrices() + (self.expert_matrices() if self.has_experts else 0)

    def weight_terms(self, run: RunShape) -> list[Term]:
        return super().weight_terms(run) + self.expert_weight_terms(run)

    def trainable_tensors(self, run: RunShape) -> list[int]:
        return super().trainable_tensors(run) + self.expert_tensors(run)

    def adapted_summary(self, run: RunShape) -> str:
        return super().adapted_summary(run) + self.expert_summary(run)

    def extra_block_saved(self, run: RunShape) -> list[Term]:
        """What a sparse block keeps beyond the gated MLP's K x F_e-wide tensors (the module docstring)."""
        if not self.has_experts:
            return []
        N, s, D, E, K, F = run.tokens, run.s, self.hidden_size, self.num_experts, self.top_k, self.expert_size
        adapted = list(self.expert_weights()) if run.full else self.adapted_experts(run.lora_targets)
        per = E * (s + self.PROBS) + K * (8 + 8 + 2 * s) + K * D * s  # logits, fp32 probs; choices, order; weights; outputs
        per += K * D * s  # the weighted outputs, which `index_add_` keeps (read off a saved-tensors hook)
        per += K * D * s if "gate_up_proj" in adapted else 0  # the gathered rows gate_up's weight grad reads
        # the product down's weight grad reads (full fine-tuning: `_full_block_saved` counts it, as F)
        per += K * F * s if "down_proj" in adapted and not run.full else 0
        if not run.full:  # the expert LoRA B inputs
            per += sum(K * run.rank(*self.expert_weights()[n]) * s for n in adapted)
        return [Term("experts: routing, gathered rows, outputs (twice), adapter inputs", N * per, f"{per:,} B per token")]


class SharedExpert:
    """A shared expert of width `shared_size` beside the routed ones, scaled by sigmoid(`shared_expert_gate`)
    (Qwen2-MoE, Qwen3.5's MoE sizes). Its linears are block linears (`shared_linears`, which LLaMA's names
    select): gate_proj / up_proj and the gate read the normed x, down_proj its F_s-wide product; its gated
    output keeps D x s + s per token. The gated-MLP terms read `intermediate_size` = K x F_e + F_s."""

    shared_size: int

    def shared_linears(self) -> dict[str, tuple[int, int]]:
        D, F = self.hidden_size, self.shared_size
        return {"mlp.shared_expert.gate_proj": (D, F), "mlp.shared_expert.up_proj": (D, F),
                "mlp.shared_expert.down_proj": (F, D), "mlp.shared_expert_gate": (D, 1)}

    def inputs(self) -> tuple[dict[str, str], dict[str, int]]:
        of, width = super().inputs()
        return ({**of, "mlp.shared_expert.gate_proj": "xn2", "mlp.shared_expert.up_proj": "xn2",
                 "mlp.shared_expert_gate": "xn2", "mlp.shared_expert.down_proj": "shared"},
                {**width, "shared": self.shared_size})

    def extra_block_saved(self, run: RunShape) -> list[Term]:
        N, s, D = run.tokens, run.s, self.hidden_size
        if not self.has_experts:
            return super().extra_block_saved(run)
        return super().extra_block_saved(run) + [
            Term("shared expert: sigmoid gate x output", N * (D + 1) * s, "(D + 1) x s per token")]


@dataclass(frozen=True)
class MoeShape(ExpertBlocks, ModelShape):
    """A Qwen3-MoE / Mixtral checkpoint's dims. `intermediate_size` is the gated MLP's width per token
    (K x F_e: the rows its K experts compute), `expert_size` each expert's F_e.

    Qwen's dense layers (`mlp_only_layers`, `decoder_sparse_step`): `sparse` says which layers hold the experts
    (empty: every one) and the others a SwiGLU of `dense_size`; a shape with `layer` set is that block's view
    (its MLP's linears, width and terms), planned block by block. On Qwen3-MoE the per-expert names map onto the
    experts, so a dense layer's `gate_proj` / `up_proj` / `down_proj` stay unadapted (`never_adapted`)."""

    num_experts: int = 8
    top_k: int = 2
    expert_size: int = 0
    sparse: tuple[bool, ...] = ()
    dense_size: int = 0
    layer: int | None = None
    ALIASED: ClassVar[bool] = True  # the per-expert names (`gate_proj`, `w1`, ...) reach the experts
    FAMILIES: ClassVar[tuple[str, ...]] = ("qwen3_moe", "mixtral")
    DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {  # transformers' class defaults
        "qwen3_moe": dict(num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          intermediate_size=6144),
        "mixtral": dict(num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
    }

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> "MoeShape":
        kind = d.get("model_type")
        defaults = cls.DEFAULTS.get(kind, {})
        full = {**defaults, **{k: v for k, v in d.items() if v is not None}}
        E = full.get("num_local_experts") or full.get("num_experts")
        K = full["num_experts_per_tok"]
        Fe = full["intermediate_size"] if kind == "mixtral" else full["moe_intermediate_size"]
        dims = cls._dims({**full, "intermediate_size": K * Fe}, where, {})
        window = full.get("sliding_window") if kind == "mixtral" or full.get("use_sliding_window") else None
        bias = bool(full.get("attention_bias", False)) and kind == "qwen3_moe"
        return cls(**dims, sliding_window=window, qkv_bias=bias, o_bias=bias, qk_norm=kind == "qwen3_moe",
                   num_experts=E, top_k=K, expert_size=Fe, **cls.dense_layers(full, dims["num_hidden_layers"]))

    @staticmethod
    def dense_layers(full: dict[str, Any], L: int) -> dict[str, Any]:
        """`sparse` and `dense_size` from Qwen's `mlp_only_layers` / `decoder_sparse_step` (as
        `models.moe.MoeConfig.sparse_layers`); none when every layer is sparse (Mixtral's always are)."""
        if full.get("model_type") == "mixtral":
            return {}
        dense, step = full.get("mlp_only_layers") or [], full.get("decoder_sparse_step") or 1
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(L))
        return {} if all(sparse) else dict(sparse=sparse, dense_size=full["intermediate_size"])

    @property
    def sparse_count(self) -> int:
        return sum(self.sparse) if self.sparse else self.num_hidden_layers

    @property
    def has_experts(self) -> bool:
        return self.sparse_count > 0 if self.layer is None or not self.sparse else self.sparse[self.layer]

    def block_view(self, i: int) -> "MoeShape":
        """Block i's shape: the model's own when every layer is sparse, else its MLP's (experts or dense)."""
        if not self.sparse:
            return self
        return replace(self, layer=i, intermediate_size=self.intermediate_size if self.sparse[i] else self.dense_size)

    def saved_per_layer(self, run: RunShape) -> list[int]:
        if not self.sparse:
            return super().saved_per_layer(run)
        per = {k: sum(t.bytes for t in block_saved(self.block_view(self.sparse.index(k)), run)) for k in set(self.sparse)}
        return [per[k] for k in self.sparse]

    def sparse_linears(self) -> dict[str, tuple[int, int]]:
        """A sparse block's linears beside the experts (Qwen2-MoE's shared expert; none here)."""
        return {}

    def dense_linears(self) -> dict[str, tuple[int, int]]:
        D, F = self.hidden_size, self.dense_size
        return {"mlp.gate_proj": (D, F), "mlp.up_proj": (D, F), "mlp.down_proj": (F, D)}

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each block's linears: the attention's (the experts are 3-D weights, `expert_weights`), and the
        MLP's of the blocks that have them (a block's view: its own)."""
        out = {k: v for k, v in super().linears().items() if k.startswith("self_attn.")}
        whole = self.layer is None
        if self.has_experts:
            out.update(self.sparse_linears())
        if self.sparse and (self.sparse_count < self.num_hidden_layers if whole else not self.sparse[self.layer]):
            out.update(self.dense_linears())
        return out

    def layers_with(self, name: str) -> int:
        if self.layer is not None:
            return 1
        if name in self.sparse_linears():
            return self.sparse_count
        if name.startswith("mlp."):
            return self.num_hidden_layers - self.sparse_count
        return self.num_hidden_layers

    def never_adapted(self) -> frozenset[str]:
        return frozenset(ALIASES) if self.ALIASED else frozenset()

    def describe(self) -> str:
        dense = self.num_hidden_layers - self.sparse_count
        return (f"{self.num_hidden_layers} layers, hidden {self.hidden_size}, {self.num_experts} experts of "
                f"{self.expert_size} (top {self.top_k}), vocab {self.vocab_size:,}"
                + (f"; {dense} dense MLP layers of {self.dense_size}" if dense else ""))

    def check_run(self, run: RunShape) -> None:
        """Every run: LoRA / QLoRA and full fine-tuning, GRPO's sampler, one process and several ranks (LLaMA's
        refusals do not apply)."""


@dataclass(frozen=True)
class Qwen2MoeShape(SharedExpert, MoeShape):
    """A Qwen2-MoE checkpoint's dims: Qwen2's attention (q / k / v biases) and, in every sparse block, the routed
    experts (top K, not renormalised by default: no difference in memory) beside the shared expert."""

    shared_size: int = 5632
    ALIASED: ClassVar[bool] = False  # `gate_proj` / `up_proj` / `down_proj` name the shared expert's linears (as in peft)
    FAMILIES: ClassVar[tuple[str, ...]] = ("qwen2_moe",)
    DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {  # transformers' class defaults
        "qwen2_moe": dict(num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                          shared_expert_intermediate_size=5632, intermediate_size=5632),
    }

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> "Qwen2MoeShape":
        full = {**cls.DEFAULTS["qwen2_moe"], **{k: v for k, v in d.items() if v is not None}}
        K, Fe, Fs = full["num_experts_per_tok"], full["moe_intermediate_size"], full["shared_expert_intermediate_size"]
        dims = cls._dims({**full, "intermediate_size": K * Fe + Fs}, where, {})
        window = full.get("sliding_window") if full.get("use_sliding_window") else None
        return cls(**dims, sliding_window=window, qkv_bias=bool(full.get("qkv_bias", True)),
                   num_experts=full["num_experts"], top_k=K, expert_size=Fe, shared_size=Fs,
                   **cls.dense_layers(full, dims["num_hidden_layers"]))

    def sparse_linears(self) -> dict[str, tuple[int, int]]:
        return self.shared_linears()

    def describe(self) -> str:
        return super().describe() + f" + a shared one of {self.shared_size}"
