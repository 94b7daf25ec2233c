"""The memory plan of Gemma 4 text (`models/gemma4.py`): layers that differ by kind, block by block (a multimodal
folder with a vision tower: `minitrain.plan.vision.Gemma4VLShape` / `Gemma4MoeVLShape`, the tower's terms over
this plan).

Gemma 3's method (`GemmaShape`: four sandwich norms keeping their fp32 inputs, GeGLU's three F-wide
tensors, q / k norms, the soft-capped head's checkpointed loss chunks) over layers that are not alike,
so each block is planned on its own (`layer_view`) and the model's linears are keyed by group
(`sliding.self_attn.q_proj`, `global-shared.mlp.up_proj`: a target suffix still selects them):

- global layers (`full_attention`) have `global_head_dim` and, with `attention_k_eq_v`,
  `num_global_key_value_heads` and no `v_proj`;
- the last `num_kv_shared_layers` layers hold no k / v projections or norms: they read the keys and
  values of an earlier layer (kept by that layer's SDPA already), and with `use_double_wide_mlp` their
  MLP is 2 x `intermediate_size` wide;
- values get a norm without weight (its fp32 input, an rsqrt per kv head);
- per-layer embeddings (PLE, width P): a second table (vocab_size_per_layer_input x L P) and the
  projection of the embeddings (D -> L P) are weights; the per-layer inputs are kept once for the whole
  forward ((D + L P) x s per token: `Gemma4Model.embed`'s concatenation, sliced by every layer); each
  block keeps GELU's input (P x s) and a fifth norm's fp32 input (D x 4);
- a padded CPU batch keeps its padding (`Gemma4Model.unpadded = False`): every token and the masks count.

The MoE size (`enable_moe_block`, 26B-A4B: `Gemma4MoeShape`) adds `minitrain.plan.moe.ExpertBlocks`' terms
(every expert, the router, the expert adapters, the routing tensors) beside the dense MLP, with the router's
scale and per-expert scale, three more norms and the experts' GeGLU (K x F_e rows).

Full fine-tuning (`finetune=full`): every parameter in fp32 with its gradient and AdamW moments (`all_tensors`:
`layer_scalar` is a buffer, a weight never trained); a block keeps LLaMA's full terms, the two more sandwich
norms' (and PLE's) normalised inputs and the inputs of the per-layer input's gate and projection.

Modelled: LoRA / QLoRA runs and full fine-tuning runs, in one process and on several ranks, of the
dense sizes and the MoE size (its experts quantized each expert apart under nf4 / int8, as `minitrain.plan.moe`
counts them), and distillation with a Gemma 4 student or teacher (`minitrain.plan.decoder`'s teacher terms: the
teacher's weights with its per-layer embeddings, its no_grad forward over the per-layer inputs, every position of a
padded CPU batch (it keeps its padding beside a student that drops it: `teacher_run`), its largest stage: the
double-wide MLP, or the MoE size's experts or the dense MLP beside them; tests/test_plan_teacher.py); GRPO's sampler
is refused with one line. Measured against the CPU on SFT steps
(fp32, fp32 with checkpointing, bf16 autocast; full fine-tuning and the MoE size's QLoRA in
tests/test_plan_hybrid.py). Several ranks (`minitrain.plan.sharded`): a kv-shared block without k / v or k norm,
the per-layer input's norm (`block_vectors`), the MoE size's router scales and three more norms (`block_tensors`),
and in the root the per-layer embeddings, their projection and its norm (`root_tensors`; `layer_scalar` is a
buffer, whole on each rank and not in the fsdp shards); LoRA, QLoRA under fsdp (the dense size: the base by rows, the
projection too) and full fine-tuning measured on 2 gloo ranks (tests/test_plan_ranks.py). On CUDA one bool mask is counted where sliding and global
layers build two.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from minitrain.plan.decoder import ByBlock, GemmaShape, block_saved, matches
from minitrain.plan.moe import ExpertBlocks
from minitrain.plan.run_shape import RunShape, Term, linears_bytes

GLOBAL = "full_attention"


def _default_types(n: int) -> list[str]:
    return ["sliding_attention" if (i + 1) % 6 else GLOBAL for i in range(n)]  # models.gemma4.default_layer_types


@dataclass(frozen=True)
class Gemma4Shape(ByBlock, GemmaShape):
    """A Gemma 4 (dense) checkpoint's dims. `layer`: None for the whole model, or one block whose own
    dims (`head_dim`, `num_key_value_heads`, `intermediate_size`) the shape then carries."""

    layer_types: tuple[str, ...] = ()
    global_head_dim: int = 512
    global_kv_heads: int = 4
    k_eq_v: bool = False
    kv_shared: int = 0
    double_wide: bool = False
    ple: int = 0
    ple_vocab: int = 0
    layer: int | None = None
    FAMILY: ClassVar[str] = "Gemma 4"
    FULL: ClassVar[bool] = True
    FAMILIES: ClassVar[tuple[str, ...]] = ("gemma4_text",)
    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gemma4_text", "gemma4")
    NORMS: ClassVar[int] = 4
    UNPADS_ON_CPU: ClassVar[bool] = False  # Gemma4Model.unpadded

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> "Gemma4Shape":
        if d.get("model_type") == "gemma4":  # the multimodal checkpoint: its language model
            d = {**d.get("text_config", {}), "model_type": "gemma4_text",
                 "tie_word_embeddings": d.get("tie_word_embeddings", True)}
        if d.get("enable_moe_block") and cls is Gemma4Shape:  # (the multimodal one: plan.vision's Gemma4MoeVLShape)
            return Gemma4MoeShape.from_hf(d, where)
        full = {"num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True, "global_head_dim": 512,
                "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144, "sliding_window": 512,
                **{k: v for k, v in d.items() if v is not None}}
        for per in (d.get("per_layer_config") or {}).values():  # transformers 5's spelling of the global heads
            full["global_head_dim"] = per.get("head_dim", full["global_head_dim"])
            full["num_global_key_value_heads"] = per.get("num_key_value_heads")
        dims = cls._dims(full, where, {})
        L = dims["num_hidden_layers"]
        types = [*(full.get("layer_types") or _default_types(L))[:-1], GLOBAL]  # the last layer is global
        k_eq_v = bool(full.get("attention_k_eq_v", False))
        kv = full.get("num_global_key_value_heads") if k_eq_v else None
        return cls(**dims, qk_norm=True, final_softcap=full.get("final_logit_softcapping"),
                   sliding_window=full["sliding_window"], layer_types=tuple(types),
                   global_head_dim=full["global_head_dim"], global_kv_heads=kv or dims["num_key_value_heads"],
                   k_eq_v=k_eq_v, kv_shared=full.get("num_kv_shared_layers", 0),
                   double_wide=bool(full.get("use_double_wide_mlp", False)),
                   ple=full["hidden_size_per_layer_input"] or 0, ple_vocab=full["vocab_size_per_layer_input"],
                   **cls.expert_fields(full))

    @classmethod
    def expert_fields(cls, full: dict[str, Any]) -> dict[str, Any]:
        """The MoE size's fields (`Gemma4MoeShape`); none for the dense sizes."""
        return {}

    # ------------------------------------------------------------------ one block's view

    def shares(self, i: int) -> bool:
        """Whether layer i reads another layer's keys and values (the last `num_kv_shared_layers`)."""
        return i >= self.num_hidden_layers - self.kv_shared

    def group(self, i: int) -> str:
        return ("global" if self.layer_types[i] == GLOBAL else "sliding") + ("-shared" if self.shares(i) else "")

    def block_view(self, i: int) -> "Gemma4Shape":
        return self.layer_view(i)

    def layer_view(self, i: int) -> "Gemma4Shape":
        glob = self.layer_types[i] == GLOBAL
        wide = self.double_wide and self.shares(i)
        return replace(self, layer=i, head_dim=self.global_head_dim if glob else self.head_dim,
                       num_key_value_heads=self.global_kv_heads if glob else self.num_key_value_heads,
                       intermediate_size=self.intermediate_size * (2 if wide else 1))

    def block_linears(self) -> dict[str, tuple[int, int]]:
        """This block's linears (a layer view): q / o, k / v unless shared (no v under k_eq_v on a global
        layer), the MLP, the per-layer input's gate and projection."""
        D, F, q, kv, i = self.hidden_size, self.intermediate_size, self.q_width, self.kv_width, self.layer
        out = {"self_attn.q_proj": (D, q)}
        if not self.shares(i):
            out["self_attn.k_proj"] = (D, kv)
            if not (self.k_eq_v and self.layer_types[i] == GLOBAL):
                out["self_attn.v_proj"] = (D, kv)
        out.update({"self_attn.o_proj": (q, D), "mlp.gate_proj": (D, F), "mlp.up_proj": (D, F),
                    "mlp.down_proj": (F, D)})
        if self.ple:
            out.update({"per_layer_input_gate": (D, self.ple), "per_layer_projection": (self.ple, D)})
        return out

    def linears(self) -> dict[str, tuple[int, int]]:
        """A layer view: its block's linears; the whole model: each group's, keyed `group.name`."""
        if self.layer is not None:
            return self.block_linears()
        out = {}
        for i in range(self.num_hidden_layers):
            out.update({f"{self.group(i)}.{n}": v for n, v in self.layer_view(i).block_linears().items()})
        return out

    def block_vectors(self) -> list[tuple[str, int]]:
        """A layer view's norms: the four sandwich norms, PLE's, the q norm and (unless shared) the k norm."""
        D, hd = self.hidden_size, self.head_dim
        norms = [(f"norm{k}", D) for k in range(self.NORMS + (1 if self.ple else 0))] + [("self_attn.q_norm", hd)]
        return norms + ([] if self.shares(self.layer) else [("self_attn.k_norm", hd)])

    def root_tensors(self, run: RunShape) -> list[tuple[str, tuple[int, ...], bool]]:
        """The per-layer embeddings' table (vocab_size_per_layer_input x L P), their projection (L P x D), its norm
        (P), and LoRA on the projection when the targets reach it (`trainable_tensors`)."""
        if not self.ple:
            return []
        D, n = self.hidden_size, self.num_hidden_layers * self.ple
        out = [("model.embed_tokens_per_layer", (self.ple_vocab, n), run.full),
               ("model.per_layer_model_projection", (n, D), run.full),
               ("model.per_layer_projection_norm", (self.ple,), run.full)]
        targets = run.lora_targets
        if not run.full and any(t == "all-linear" or matches("per_layer_model_projection", t) for t in targets):
            r = run.rank(D, n)
            out += [("per_layer_model_projection.lora_A", (r, D), True),
                    ("per_layer_model_projection.lora_B", (n, r), True)]
        return out

    def layers_with(self, name: str) -> int:
        if self.layer is not None:
            return 1
        return sum(self.group(i) == name.split(".")[0] for i in range(self.num_hidden_layers))

    def inputs(self) -> tuple[dict[str, str], dict[str, int]]:
        of, width = super().inputs()
        return {**of, "per_layer_input_gate": "out", "per_layer_projection": "ple"}, {
            **width, "out": self.hidden_size, "ple": self.ple}

    @property
    def rope_dim(self) -> int:
        """One table per layer type: the sliding layers' head dim and the global layers'."""
        kinds = set(self.layer_types)
        return (self.head_dim if len(kinds) > 1 or GLOBAL not in kinds else 0) + (
            self.global_head_dim if GLOBAL in kinds else 0)

    # ------------------------------------------------------------------ the whole model

    def small_params(self) -> tuple[int, str]:
        """Per block the sandwich norms (+ PLE's), q / k norms (own k only), `layer_scalar`; the final
        norm and the PLE projection's norm."""
        D, L, P = self.hidden_size, self.num_hidden_layers, self.ple
        per = [(self.NORMS + (1 if P else 0)) * D + 1 + v.head_dim * (1 if self.shares(i) else 2)
               for i, v in ((i, self.layer_view(i)) for i in range(L))]
        return sum(per) + D + (P if P else 0), f"{sum(per):,} in blocks + {D}" + (f" + {P} (PLE norm)" if P else "")

    def block_small(self, i: int) -> list[int]:
        """Block i's sandwich norms (+ PLE's), q norm and k norm (own keys only), as `small_params` counts them
        (`layer_scalar` is a buffer: counted as a weight, never trained)."""
        v = self.layer_view(i)
        return [self.hidden_size] * (self.NORMS + (1 if self.ple else 0)) + [v.head_dim] * (1 if self.shares(i) else 2)

    def full_block_saved(self, run: RunShape) -> list[Term]:
        """Full fine-tuning: LLaMA's terms, + the normalised inputs of the two more sandwich norms (and PLE's) for
        their weights' gradients, and the inputs of the per-layer input's gate and projection."""
        N, s, D, P = run.tokens, run.s, self.hidden_size, self.ple
        norms = 2 + (1 if P else 0)
        return super().full_block_saved(run) + [
            Term("more norms' normalised inputs (weight grads)", N * norms * D * 4, f"{norms} x D x 4 per token"),
            Term("per-layer input: its linears' inputs (weight grads)", N * (D + P) * s if P else 0, "(D + P) x s per token")]

    def all_tensors(self) -> list[int]:
        """Every parameter: the blocks' (`ByBlock`), the per-layer embeddings' table, projection and its norm."""
        L, P = self.num_hidden_layers, self.ple
        return super().all_tensors() + ([self.ple_vocab * L * P, self.hidden_size * L * P, P] if P else [])

    def trainable_tensors(self, run: RunShape) -> list[int]:
        """The blocks' adapters (and modules_to_save), plus LoRA on the model's `per_layer_model_projection` (D ->
        L x P, outside the blocks) when the targets reach it: all-linear, or its name."""
        out = super().trainable_tensors(run)
        if self.ple and not run.full and any(t == "all-linear" or matches("per_layer_model_projection", t)
                                             for t in run.lora_targets):
            D, n = self.hidden_size, self.num_hidden_layers * self.ple
            out += [run.rank(D, n) * D, n * run.rank(D, n)]
        return out

    def ple_params(self) -> int:
        """The per-layer embeddings' table (vocab_size_per_layer_input x L P) and projection (D x L P)."""
        return (self.ple_vocab + self.hidden_size) * self.num_hidden_layers * self.ple

    def num_params(self) -> int:
        return super().num_params() + self.ple_params()

    def weight_terms(self, run: RunShape) -> list[Term]:
        """LLaMA's, + the per-layer embeddings' table in the compute dtype and their projection, a linear in the run's
        format (the loader quantizes it)."""
        terms = super().weight_terms(run)
        if self.ple:
            L, P = self.num_hidden_layers, self.ple
            run = replace(run, compute="fp32") if run.full else run  # full fine-tuning: fp32, as every weight
            proj, formula = linears_bytes([(self.hidden_size, L * P, 1)], run)
            terms.append(Term("weights: per-layer embeddings + projection", self.ple_vocab * L * P * run.s + proj,
                              f"{self.ple_vocab:,} x {L} x {P} x {run.s} B + projection: {formula}"))
        return terms

    def saved_per_layer(self, run: RunShape) -> list[int]:
        return [sum(t.bytes for t in block_saved(self.layer_view(i), run)) for i in range(self.num_hidden_layers)]

    def attention_saved(self, run: RunShape) -> list[Term]:
        """A shared layer's SDPA keeps its queries, output and lse (its keys and values are its source's);
        an own layer's also the v norm's fp32 input and rsqrt; every block GELU's input of PLE."""
        N, s = run.tokens, run.s
        terms = super().attention_saved(run)
        if self.shares(self.layer):
            q, H = self.q_width, self.num_attention_heads
            terms = [Term("attention q, k, v, out + lse (k, v: the source layer's)", N * (2 * q * s + H * 4),
                          "2 Hq x s + heads x 4 per token"),
                     Term("q norm input (fp32) + rsqrt", N * (q + H) * 4, "(Hq + heads) x 4 per token")] + [
                t for t in terms if t.name.startswith("attention mask")]
        else:
            terms.append(Term("v norm input (fp32) + rsqrt", N * (self.kv_width + self.num_key_value_heads) * 4,
                              "(Hk + kv heads) x 4 per token"))
        if self.ple:
            terms.append(Term("per-layer input: GELU input, post norm input (fp32)", N * self.ple * s
                              + N * self.hidden_size * 4, "P x s + D x 4 per token"))
        return terms

    def describe(self) -> str:
        g = self.layer_types.count(GLOBAL)
        return (f"{self.num_hidden_layers} layers ({self.num_hidden_layers - g} sliding, {g} global, "
                f"{self.kv_shared} sharing k/v), hidden {self.hidden_size}, per-layer inputs {self.ple}, "
                f"vocab {self.vocab_size:,}")

    def extra_model_saved(self, run: RunShape) -> list[Term]:
        """Kept once per forward: the embeddings with every layer's per-layer input after them."""
        if not self.ple:
            return []
        w = self.hidden_size + self.num_hidden_layers * self.ple
        return [Term("per-layer inputs (with the embeddings)", run.tokens * w * run.s, "(D + L P) x s per token")]


@dataclass(frozen=True)
class Gemma4MoeShape(ExpertBlocks, Gemma4Shape):
    """Gemma 4's MoE size (`enable_moe_block`, 26B-A4B): every block's dense MLP, and beside it the floor's expert
    block (E GeGLU experts of F_e, top K) behind Gemma 4's router (`router.proj` E x D, `scale` D,
    `per_expert_scale` E) with three more norms. LoRA reaches the experts by `experts.gate_up_proj` /
    `experts.down_proj` (or their suffixes: `down_proj` adapts the dense MLP's and the experts', as peft); under
    nf4 / int8 the experts are quantized each expert apart (`minitrain.adapters.quant_experts`), the router float."""

    num_experts: int = 128
    top_k: int = 8
    expert_size: int = 704
    ALIASED: ClassVar[bool] = False  # `gate_proj` / `up_proj` name the dense MLP's linears
    EXPERTS: ClassVar[str] = "experts"
    ROUTER: ClassVar[str] = "router"

    @classmethod
    def expert_fields(cls, full: dict[str, Any]) -> dict[str, Any]:
        Fe = full.get("moe_intermediate_size") or full.get("expert_intermediate_size")
        return dict(num_experts=full["num_experts"], top_k=full["top_k_experts"], expert_size=Fe)

    @property
    def mlp_beside_experts(self) -> int:
        """The dense MLP's width, which runs beside the experts (`minitrain.plan.decoder.no_grad_block`)."""
        return self.intermediate_size

    def router_tensors(self) -> list[int]:
        return [self.num_experts * self.hidden_size, self.hidden_size, self.num_experts]

    def block_small(self, i: int) -> list[int]:
        """Gemma 4's, + the three MoE norms and the router's scale and per-expert scale."""
        D = self.hidden_size
        return super().block_small(i) + [D] * 4 + [self.num_experts]

    def small_params(self) -> tuple[int, str]:
        """Gemma 4's, + per block three norms and the router's scale and per-expert scale."""
        n, formula = super().small_params()
        per = 4 * self.hidden_size + self.num_experts
        L = self.num_hidden_layers
        return n + L * per, f"{formula} + {L} x {per:,} (MoE norms, router scales)"

    def block_tensors(self, run: RunShape) -> list[tuple[str, tuple[int, ...], bool]]:
        """`ExpertBlocks`' (experts, `router.proj` as the router, expert adapters), + the router's scale (D) and
        per-expert scale (E) and the three more norms (D each)."""
        D = self.hidden_size
        extra = [("router.scale", (D,)), ("router.per_expert_scale", (self.num_experts,))]
        extra += [(f"moe_norm{k}", (D,)) for k in range(3)]
        return super().block_tensors(run) + [(n, shape, run.full) for n, shape in extra]

    def extra_block_saved(self, run: RunShape) -> list[Term]:
        """The experts' GeGLU (K x F_e rows: the first product's output, GELU's output), the routing tensors
        (`ExpertBlocks`), the router's and the three more norms' fp32 inputs (fp32: the two post norms' own; under autocast also the router's and
        the pre norm's copies of x) and rsqrts."""
        N, s, D, KF = run.tokens, run.s, self.hidden_size, self.top_k * self.expert_size
        norms = 2 if s == 4 else 4
        return super().extra_block_saved(run) + [
            Term("experts: GeGLU (gate, act, up)", N * 3 * KF * s, "3 x K F_e x s per token"),
            Term("MoE norms and router: fp32 inputs + rsqrt", N * (norms * D * 4 + 4 * 4),
                 f"{norms} x D x 4 + 16 per token")]

    def describe(self) -> str:
        return (super().describe()
                + f"; {self.num_experts} experts of {self.expert_size} (top {self.top_k}) beside the MLP")
