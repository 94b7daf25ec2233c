"""The memory of the decoder-only families: LLaMA / Mistral / Qwen2 / Qwen3 (`ModelShape`), Gemma 2 /
Gemma 3 text (`GemmaShape`) and Phi-3 (`Phi3Shape`).

A shape holds a checkpoint's dims under HF's `config.json` names, read from `config.json` only,
never the weights. Its terms (weights, adapters, what each block keeps for backward, the loss's
chunked logits, distillation's teacher and captured layers) are the module-level functions below,
which ask the shape for what differs between the families. `minitrain.plan.predict` sums them.

A distillation teacher may be of any decoder-only family the plan models, the student's or another (Qwen3.5, Gemma 4
and the MoE families too: tests/test_plan_teacher.py): its weights (`teacher_weight_terms`, in the compute dtype or
as `teacher_quantize` says), its no_grad forward (`teacher_forward`: its largest block's largest stage,
`no_grad_block`, over its own padding rule, `teacher_run`), its final hidden states and the KD chunks (`_kd_logits`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from minitrain.errors import UserError
from minitrain.objectives.configs import REWARD_BATCH
from minitrain.plan.run_shape import DTYPE_BYTES, RunShape, Term, linears_bytes


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# which activation each linear reads: its input is what an adapter (or an int8 base) keeps
_INPUT_OF = {"self_attn.q_proj": "xn", "self_attn.k_proj": "xn", "self_attn.v_proj": "xn",
             "self_attn.o_proj": "attn", "mlp.gate_proj": "xn2", "mlp.up_proj": "xn2", "mlp.down_proj": "act",
             "self_attn.qkv_proj": "xn", "mlp.gate_up_proj": "xn2"}


PLANNED = ("LLaMA, Mistral, Qwen2, Qwen3, Qwen3.5 (dense and MoE), Gemma 2, Gemma 3 (text and multimodal), "
           "Gemma 4 (dense, MoE, multimodal), Phi-3, Qwen2.5-VL, Qwen3-VL (dense and MoE), Qwen3-MoE, Qwen2-MoE, "
           "Mixtral, gpt-oss and T5")


@dataclass(frozen=True)
class ModelShape:
    """A LLaMA / Mistral / Qwen2 / Qwen3 checkpoint's dims, under HF's `config.json` names.

    What `predict` asks of a family (T5Shape has the same): `weight_terms`, `trainable_tensors`,
    `adapted_summary`, `moments`, `describe`; its LLaMA formulas are the module-level functions below,
    which ask the shape for what differs between the decoder-only families (`linears`,
    `attention_saved`, `NORMS` per block, `FUSED` linears, `plain_head`).
    Qwen2's q/k/v biases (`attention_bias` on LLaMA and Qwen3: o_proj's too) keep nothing for backward and
    count as weights; Qwen3's per-head q/k norms keep their fp32 inputs.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    model_type: str = "llama"
    qkv_bias: bool = False  # Qwen2 (and `attention_bias`): biases on q / k / v
    o_bias: bool = False  # `attention_bias` (LLaMA, Qwen3): a bias on o_proj too
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3 (Gemma 3): RMSNorm per head on q and k
    is_encoder_decoder: ClassVar[bool] = False
    EMBEDDINGS: ClassVar[tuple[str, ...]] = ("model.embed_tokens",)  # what a tied head is
    FAMILIES: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2", "qwen3")
    NORMS: ClassVar[int] = 2  # RMSNorms per block
    FUSED: ClassVar[dict[str, tuple[str, ...]]] = {}  # fused linear -> the unfused names (Phi-3)
    UNPADS_ON_CPU: ClassVar[bool] = True  # LLaMA, Gemma, Phi-3 run a padded batch unpadded on a CPU (T5 does not)
    ATTENTION: ClassVar[str] = "SDPA"  # what keeps GQA's repeated keys and values (a note names it)
    UNPADS_FROM: ClassVar[int] = 32  # ... rows of at least this many positions (models.layers.RAGGED_MIN_LENGTH)

    @classmethod
    def _dims(cls, d: dict[str, Any], where: str, defaults: dict[str, Any]) -> dict[str, Any]:
        """The dims every decoder-only family shares, from `config.json` with HF's class defaults."""
        kind = d.get("model_type")
        if kind not in cls.FAMILIES:
            raise UserError(f"{where}: model_type {kind!r} — the memory plan models {PLANNED} checkpoints only")
        d = {**defaults, **{k: v for k, v in d.items() if v is not None}}
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if not isinstance(d.get(k), int)]
        if missing:
            raise UserError(f"{where}: missing {', '.join(missing)} — not a {kind} config.json")
        heads = d["num_attention_heads"]
        return dict(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                    intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                    num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
                    head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                    tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), model_type=kind)

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> "ModelShape":
        """From a `config.json` dict (HF's defaults for the fields it may leave out)."""
        kind = d.get("model_type")
        mistral = dict(num_key_value_heads=8, sliding_window=4096) if kind == "mistral" else {}
        dims = cls._dims(d, where, {**mistral, **(dict(head_dim=128) if kind == "qwen3" else {})})  # HF's defaults
        if kind == "mistral":
            window = d.get("sliding_window", 4096)
        else:  # Qwen's window applies only with use_sliding_window (off in the released checkpoints)
            window = d.get("sliding_window") if kind in ("qwen2", "qwen3") and d.get("use_sliding_window") else None
        bias = bool(d.get("attention_bias", False)) and kind in ("llama", "qwen3")  # Qwen2: q/k/v always, o never
        return cls(**dims, sliding_window=window, qkv_bias=bias or kind == "qwen2", o_bias=bias,
                   mlp_bias=bool(d.get("mlp_bias", False)) and kind == "llama", qk_norm=kind == "qwen3")

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each block's linears: name -> (in_features, out_features)."""
        D, F, q, kv = self.hidden_size, self.intermediate_size, self.q_width, self.kv_width
        return {"self_attn.q_proj": (D, q), "self_attn.k_proj": (D, kv), "self_attn.v_proj": (D, kv),
                "self_attn.o_proj": (q, D), "mlp.gate_proj": (D, F), "mlp.up_proj": (D, F),
                "mlp.down_proj": (F, D)}

    def layers_with(self, name: str) -> int:
        """How many blocks hold the linear `name` (every block here; a hybrid's mixers differ by layer)."""
        return self.num_hidden_layers

    def inputs(self) -> tuple[dict[str, str], dict[str, int]]:
        """(which activation each linear reads, the width of each activation): what an adapter keeps."""
        return _INPUT_OF, {"xn": self.hidden_size, "attn": self.q_width, "xn2": self.hidden_size,
                           "act": self.intermediate_size}

    def block_view(self, i: int) -> "ModelShape":
        """Block i's shape (every block alike here: the model's own)."""
        return self

    def saved_per_layer(self, run: "RunShape") -> list[int]:
        """Bytes each block keeps for backward (`block_saved`), layer by layer."""
        return [sum(t.bytes for t in block_saved(self, run))] * self.num_hidden_layers

    @property
    def rope_dim(self) -> int:
        """The dims of each head RoPE turns (its cos / sin tables' width)."""
        return self.head_dim

    @property
    def blocks(self) -> int:
        """The repeated blocks (`model.block_types` instances) that `checkpointing` counts."""
        return self.num_hidden_layers

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def n_rep(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def small_params(self) -> tuple[int, str]:
        """(numel, formula) of the norms and biases: per block NORMS x D (+ 2 x head_dim of q/k
        norms) and the biases, + the final norm."""
        L, D, F = self.num_hidden_layers, self.hidden_size, self.intermediate_size
        per = self.NORMS * D + (2 * self.head_dim if self.qk_norm else 0)
        per += (self.q_width + 2 * self.kv_width if self.qkv_bias else 0) + (D if self.o_bias else 0)
        per += 2 * F + D if self.mlp_bias else 0
        return L * per + D, f"{L} x {per:,} + {D:,}"

    def num_params(self) -> int:
        D, V = self.hidden_size, self.vocab_size
        linears = sum(i * o * self.layers_with(n) for n, (i, o) in self.linears().items())
        return V * D * (1 if self.tie_word_embeddings else 2) + linears + self.small_params()[0]

    @property
    def plain_head(self) -> bool:
        """Whether the head is a plain Linear (a frozen one takes the loss's two-matmul path)."""
        return True

    def attention_saved(self, run: "RunShape") -> list["Term"]:
        """What one block's attention keeps beyond the linears' inputs: SDPA's query, key, value and
        output (Hk' = Hq under GQA: `repeat_kv`'s copies are what SDPA keeps) + its fp32 logsumexp;
        Qwen3's q/k norms their fp32 inputs."""
        N, s, Hq, H = run.tokens, run.s, self.q_width, self.num_attention_heads
        Hk = Hq if self.n_rep > 1 else self.kv_width
        terms = [Term("attention q, k, v, out + lse", N * ((2 * Hq + 2 * Hk) * s + H * 4),
                      f"(2 Hq + 2 Hk{' (repeated)' if self.n_rep > 1 else ''}) x {s} + heads x 4 per token")]
        if self.qk_norm:  # + rsqrt's output, one per head
            terms.append(Term("q/k norm inputs (fp32) + rsqrt", N * (Hq + self.kv_width + H + self.num_key_value_heads) * 4,
                              "(Hq + Hk + heads + kv heads) x 4 per token"))
        if run.mask:
            terms.append(Term("attention mask (float, per block)", run.rows * run.seq * run.seq * s,
                              "rows x T x T x s"))
        return terms

    def describe(self) -> str:
        return f"{self.num_hidden_layers} layers, hidden {self.hidden_size}, vocab {self.vocab_size:,}"

    # the family interface of `predict`
    def weight_terms(self, run: "RunShape") -> list["Term"]:
        return weight_terms(self, run)

    def all_tensors(self) -> list[int]:
        """Numel of every parameter tensor (a tied head once): what full fine-tuning trains."""
        L, D, V, F = self.num_hidden_layers, self.hidden_size, self.vocab_size, self.intermediate_size
        linears = [i * o for n, (i, o) in self.linears().items() for _ in range(self.layers_with(n))]
        block = [D] * self.NORMS
        block += [self.head_dim] * 2 if self.qk_norm else []
        block += [self.q_width, self.kv_width, self.kv_width] if self.qkv_bias else []
        block += ([D] if self.o_bias else []) + ([F, F, D] if self.mlp_bias else [])
        return [V * D] * (1 if self.tie_word_embeddings else 2) + linears + block * L + [D]

    def block_matrices(self) -> int:
        """Numel of one block's weight matrices: what its weight gradients and autocast's bf16 copies hold
        under full fine-tuning (here its linears; an MoE's experts and router too)."""
        return sum(i * o for i, o in self.linears().values())

    def block_tensors(self, run: "RunShape") -> list[tuple[str, tuple[int, ...], bool]]:
        """One block's parameters beyond its linears, norms and biases, as FSDP2 shards them by dim 0 (`minitrain.plan
        .sharded`): (name, shape, whether it trains); none here (an MoE's experts, router and expert adapters)."""
        return []

    def block_vectors(self) -> list[tuple[str, int]]:
        """One block's biases and norm weights as FSDP2 shards them (`minitrain.plan.sharded`): (name, size); NORMS
        of D, Qwen3's q / k norms (a hybrid's blocks differ: Qwen3.5's DeltaNet layers, Gemma 4's kv-shared ones)."""
        D, F = self.hidden_size, self.intermediate_size
        out = []
        if self.qkv_bias:
            out += [("self_attn.q_proj.bias", self.q_width), ("self_attn.k_proj.bias", self.kv_width),
                    ("self_attn.v_proj.bias", self.kv_width)]
        if self.o_bias:
            out.append(("self_attn.o_proj.bias", D))
        if self.mlp_bias:
            out += [("mlp.gate_proj.bias", F), ("mlp.up_proj.bias", F), ("mlp.down_proj.bias", D)]
        out += [(f"norm{k}", D) for k in range(self.NORMS)]
        qk = [("self_attn.q_norm", self.head_dim), ("self_attn.k_norm", self.head_dim)]
        return out + (qk if self.qk_norm else [])

    def root_tensors(self, run: "RunShape") -> list[tuple[str, tuple[int, ...], bool]]:
        """The root's parameters beyond the embeddings, the head and the final norm, as `block_tensors`: none here
        (Gemma 4's per-layer embeddings and their projection)."""
        return []

    def never_adapted(self) -> frozenset[str]:
        """Leaf names of block linears LoRA leaves unadapted whatever the targets (an MoE's `expert_aliases`,
        which peft moves onto the experts: `minitrain.adapters.lora_experts.split_targets`); none here."""
        return frozenset()

    def trainable_tensors(self, run: "RunShape") -> list[int]:
        return trainable_tensors(self, run)

    def adapted_summary(self, run: "RunShape") -> str:
        if run.full:
            return "every weight (full fine-tuning)"
        return f"{len(adapted_linears(self, run.lora_targets))} linears x {self.num_hidden_layers} blocks"

    def moments(self, run: "RunShape") -> tuple[dict[str, list["Term"]], list[str]]:
        return llama_moments(self, run)

    def extra_model_saved(self, run: "RunShape") -> list["Term"]:
        """What a forward keeps once beyond LLaMA's (`_model_saved`): none here; Gemma 4's per-layer inputs."""
        return []

    def extra_block_saved(self, run: "RunShape") -> list["Term"]:
        """What a block keeps beyond LLaMA's (`block_saved`): none here; an MoE's routing and experts."""
        return []

    def sampler_cache(self, run: "RunShape") -> list["Term"]:
        """GRPO's sampler cache: every layer's keys and values for `sample_rows` rows x `seq` slots (compute dtype)."""
        R, T, L = run.sample_rows, run.seq, self.num_hidden_layers
        kv = R * T * L * 2 * self.num_key_value_heads * self.head_dim * run.s
        return [Term("sampler: KV cache", kv, f"{R} rows x {T} slots x {L} layers x 2 x {self.kv_width} x {run.s} B")]

    def full_block_saved(self, run: "RunShape") -> list["Term"]:
        """What full fine-tuning adds to a block's saved tensors (`_full_block_saved`)."""
        return _full_block_saved(self, run)

    def recompute_peaks(self, run: "RunShape", saved: int) -> list[list["Term"]]:
        """This block recomputed under checkpointing, then its backward: the candidate peaks beyond the block
        inputs (its `saved` bytes with its backward's or its forward's working set); `llama_moments` takes the
        largest. Qwen3.5's DeltaNet blocks add one inside their forward."""
        one = Term("one block recomputed", saved, "block_saved")
        return [[one] + _block_backward(self, run), [one] + _block_forward(self, run)]


class ByBlock:
    """What a shape planned block by block shares (Qwen3.5, Gemma 4: `saved_per_layer` from a view of
    one block): its adapted linears counted over the blocks that hold them, and the runs it models."""

    FAMILY: ClassVar[str] = ""
    FULL: ClassVar[bool] = False  # whether finetune=full is modelled
    SAMPLER: ClassVar[bool] = False  # whether GRPO's sampler (its cache) is modelled

    def adapted_summary(self, run: "RunShape") -> str:
        if run.full:
            return "every weight (full fine-tuning)"
        return f"{sum(self.layers_with(n) for n in adapted_linears(self, run.lora_targets))} linears"

    def block_small(self, i: int) -> list[int]:
        """Numel of block i's tensors besides its linears (norms, biases, ...): what `all_tensors` adds."""
        raise NotImplementedError

    def all_tensors(self) -> list[int]:
        """Every parameter tensor, block by block (a tied head once)."""
        V, D = self.vocab_size, self.hidden_size
        blocks = [n for i in range(self.num_hidden_layers)
                  for n in [a * b for a, b in self.block_view(i).linears().values()] + self.block_small(i)]
        return [V * D] * (1 if self.tie_word_embeddings else 2) + blocks + [D]

    def check_run(self, run: "RunShape") -> None:
        refused = [what for what, asked in (("finetune=full", run.full and not self.FULL),
                                            ("GRPO's sampler", run.sample_rows and not self.SAMPLER)) if asked]
        if refused:
            what = ("LoRA / QLoRA and full fine-tuning runs, in one process and on several ranks"
                    if self.FULL else "LoRA / QLoRA runs in one process and on several ranks")
            raise UserError(f"the memory plan models {self.FAMILY} {what} (not {', '.join(refused)}) — "
                            "memory_check=false skips the plan")


# ----------------------------------------------------------------------------- weights and adapters


def matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def adapted_linears(model: ModelShape, targets: tuple[str, ...] | list[str]) -> list[str]:
    """Block linears (`self_attn.q_proj`, ...) that LoRA wraps for these target suffixes (on a
    model with fused linears, LLaMA's names select the fused ones, as `minitrain.adapters.lora` reads them)."""
    names = [n for n in model.linears() if n.rsplit(".", 1)[-1] not in model.never_adapted()]
    if "all-linear" in targets:
        return names
    if model.FUSED:
        from minitrain.adapters.lora import fused_targets

        targets = fused_targets(model.FUSED, targets)
    return [n for n in names if any(matches(n, t) for t in targets)]


def weight_terms(model: ModelShape, run: RunShape) -> list[Term]:
    """The base model's bytes: block linears (by format), embeddings + head, norms."""
    if run.full:  # full fine-tuning loads every weight in fp32: they are the master weights
        run = replace(run, compute="fp32")
    s = run.s  # the loader casts float tensors to the compute dtype (quantized runs too)
    L, D, V = model.num_hidden_layers, model.hidden_size, model.vocab_size
    b, f = linears_bytes([(i, o, model.layers_with(n)) for n, (i, o) in model.linears().items()], run)
    heads = 1 if model.tie_word_embeddings else 2
    small, formula = model.small_params()
    return [Term("weights: block linears", b, f),
            Term("weights: embeddings + head", heads * V * D * s,
                 f"{heads} x {V:,} x {D:,} x {s} B" + (" (tied)" if heads == 1 else "")),
            Term("weights: norms" + (" + biases" if model.qkv_bias or model.o_bias or model.mlp_bias else ""),
                 small * s, f"({formula}) x {s} B")]


def trainable_tensors(model: ModelShape, run: RunShape) -> list[int]:
    """Numel of each trainable tensor: LoRA A and B of every adapted linear, modules_to_save (full
    fine-tuning: every weight)."""
    if run.full:
        return model.all_tensors() + kd_projections(model, run)
    lin = model.linears()
    out = []
    for name in adapted_linears(model, run.lora_targets):
        i, o = lin[name]
        out += [run.rank(i, o) * i, o * run.rank(i, o)] * model.layers_with(name)
    D, V = model.hidden_size, model.vocab_size
    for m in run.modules_to_save:
        if matches("lm_head", m) or matches("model.embed_tokens", m):
            out.append(V * D)
        elif matches("model.norm", m):
            out.append(D)
    return out + kd_projections(model, run)


def kd_projections(model: ModelShape, run: RunShape) -> list[int]:
    """Numel of distillation's learned projections (`minitrain.objectives.distill.attach_projections`): one
    D x D_teacher per matched layer when the widths differ; they train beside the adapters."""
    if run.teacher is None or not run.kd_features or run.teacher.hidden_size == model.hidden_size:
        return []
    L = model.num_hidden_layers
    return [model.hidden_size * run.teacher.hidden_size] * (L if run.kd_features < 0 else min(run.kd_features, L))


def adapter_terms(model: ModelShape, run: RunShape) -> list[Term]:
    """Adapters (fp32), their gradients (fp32) and AdamW state (two fp32 moments + a step each)."""
    tensors = model.trainable_tensors(run)
    n, k, a = sum(tensors), len(tensors), DTYPE_BYTES[run.adapter_dtype]
    what = model.adapted_summary(run) if run.full else f"{run.rank_text} on {model.adapted_summary(run)}"
    if run.modules_to_save and not run.full:
        what += f" + {','.join(run.modules_to_save)}"
    projections = kd_projections(model, run)
    if projections:
        what += f" + {len(projections)} distillation projections"
    proj = sum(projections)
    adapters = (Term("adapters", proj * a, "none: the weights themselves train (counted above in fp32)"
                     + (f"; {proj:,} params x {a} B of distillation projections" if proj else "")) if run.full
                else Term("adapters", n * a, f"{n:,} params x {a} B ({what})"))
    terms = [adapters,
             Term("gradients", n * a, f"{n:,} x {a} B"),
             Term("optimizer (AdamW)", n * 2 * 4 + k * 4, f"{n:,} x 2 moments x 4 B + {k} steps")]
    if run.dpo_reference == "snapshot":
        terms.append(Term("DPO reference: adapter snapshot", n * a, "frozen copy of the adapter tensors"))
    if run.ema:
        terms.append(Term("EMA of the trained tensors", n * a, f"{n:,} x {a} B (ema_decay)"))
    return terms


# ----------------------------------------------------------------------------- activations


def block_saved(model: ModelShape, run: RunShape) -> list[Term]:
    """What one decoder block keeps for backward (no checkpointing), read off the autograd graph.

    Per token (N = rows x seq tokens, s = compute bytes, D hidden, F intermediate, Hq = heads x
    head_dim, Hk = kv_heads x head_dim, r = LoRA rank):

    - 2 x D x 4   the two RMSNorms' fp32 inputs (`x.float()`, kept by `pow`; fp32 runs: the residual);
    - (2 Hq + 2 Hk') x s   SDPA's query, key, value and output (Hk' = Hq under GQA: `repeat_kv`'s
      copies are what SDPA keeps), + heads x 4 its fp32 logsumexp; o_proj reads the output in place;
    - T x s       the float mask SDPA makes from the bool mask, per block, when there is a mask;
    - 3 x F x s   SwiGLU: gate output (silu's input), silu's output and up's output (the product);
    - inputs of the adapted linears (their A's weight gradient needs them): fp32 runs share them
      (q/k/v read one normed x, gate/up another, o_proj the attention output, down its own F-wide
      input); under autocast with fp32 adapters every adapter keeps its own compute-dtype copy;
      no frozen base keeps its own (an int8 one runs through `lora.frozen_int8_matmul`, whose node keeps
      nothing; nf4 and float bases save none either);
    - r x s per adapted linear: B's input.
    """
    N, s, D, F = run.tokens, run.s, model.hidden_size, model.intermediate_size
    Hq = model.q_width
    adapted = [] if run.full else adapted_linears(model, run.lora_targets)
    lin = model.linears()
    input_of, width = model.inputs()
    norms = model.NORMS
    terms = [Term("norm inputs (fp32)", N * norms * D * 4, f"{norms} x D x 4 per token")]
    terms += model.attention_saved(run)
    terms.append(Term("gated MLP: gate, act, up", N * 3 * F * s, "3 x F x s per token"))
    if run.full:
        return terms + model.full_block_saved(run) + model.extra_block_saved(run)
    kept_attn = not any(t.name.startswith("attention q, k, v, out") for t in terms)  # SDPA keeps its output
    if run.cast_copies:
        kept = sum(lin[n][0] for n in adapted)  # one copy per adapter
        shared: set[str] = set()
    else:
        kept = 0
        shared = {input_of[n] for n in adapted}
        if not kept_attn:
            shared -= {"attn"}  # the attention output is already counted (SDPA keeps it)
    kept += sum(width[k] for k in shared)
    if kept:
        terms.append(Term("linear inputs kept for adapter grads", N * kept * s,
                          f"{kept:,} x {s} B per token"
                          + (" (one copy per adapter: autocast)" if run.cast_copies else "")))
    if adapted:
        r = sum(run.rank(*lin[n]) for n in adapted)
        terms.append(Term("LoRA B inputs", N * r * s, f"{len(adapted)} x r ({r:,} in all) x {s} per token"))
    return terms + model.extra_block_saved(run)


def _full_block_saved(model: ModelShape, run: RunShape) -> list[Term]:
    """What full fine-tuning adds to a block's saved tensors: the inputs of the weight gradients.

    Each RMSNorm keeps its normalised input (fp32: the residual stream is fp32); the linears keep
    their inputs: in fp32 q/k/v share the normed x, gate/up the other, down its F-wide input (o_proj
    reads SDPA's output, already counted); under autocast q, k, v, gate and up each keep their own
    bf16 cast of the fp32 normed x. The bf16 weight copies are `_weight_copies`."""
    N, s, D, F = run.tokens, run.s, model.hidden_size, model.intermediate_size
    casts = 5 * D if s < 4 else 2 * D  # q, k, v, gate, up: own casts; else xn and xn2, shared
    terms = [Term("norms' normalised inputs (weight grads)", N * 2 * D * 4, "2 x D x 4 per token"),
             Term("linear inputs kept for weight grads", N * (casts + F) * s,
                  f"({'5' if s < 4 else '2'} D + F) x {s} B per token")]
    if model.qk_norm:  # Qwen3's q / k norms, trained too: their normalised queries and keys
        terms.append(Term("q/k norms' normalised inputs (weight grads)", N * (model.q_width + model.kv_width) * 4,
                          "(Hq + Hk) x 4 per token"))
    return terms


def _matrices(model: ModelShape, blocks: range) -> int:
    """Numel of these blocks' weight matrices (`block_matrices` of each block's view: a hybrid's differ)."""
    return sum(model.block_view(i).block_matrices() for i in blocks)


def _weight_copies(model: ModelShape, run: RunShape, blocks: range, head: bool) -> list[Term]:
    """Full fine-tuning under bf16 autocast: the cast cache's bf16 copy of the fp32 weights of
    these blocks' linears (+ the head's, while the loss runs), kept by the matmuls for backward."""
    if not run.full or run.s == 4:
        return []
    n = _matrices(model, blocks)
    n += model.vocab_size * model.hidden_size if head else 0
    return [Term("autocast: bf16 copies of the weights", n * run.s,
                 f"{n:,} x {run.s} B ({len(blocks)} blocks' weights{' + head' if head else ''})")]


def _full_grads(model: ModelShape, run: RunShape) -> dict[str, list[Term]]:
    """Full fine-tuning: which fp32 gradients exist at each moment. The loop zeroes them with
    set_to_none, so none live through the forward: the head's (and final norm's) appear in the
    loss backward, a block's more at each block's backward (`llama_moments`), all of them at the AdamW step."""
    return {"loss backward": [_grads_of(model, range(0))],
            "optimizer step": [Term("gradients", sum(model.all_tensors()) * 4, "every weight's, fp32")]}


def _grads_of(model: ModelShape, blocks: range) -> Term:
    """Full fine-tuning: the fp32 gradients of the head, the final norm and these blocks (the last ones)."""
    D, V = model.hidden_size, model.vocab_size
    n = V * D + D + _matrices(model, blocks) + len(blocks) * 2 * D
    which = {0: "", 1: ", one block"}.get(len(blocks), f", {len(blocks)} blocks")
    return Term(f"gradients: head, final norm{which}",
                n * 4, f"{n:,} x 4 B")


def _block_backward(model: ModelShape, run: RunShape) -> list[Term]:
    """The working set of one block's backward beyond its saved tensors (measured on the CPU).

    The largest moment is in SwiGLU's backward: the gradients of its F-wide tensors (2 x F x s
    beyond what is freed as it goes), or, under autocast with an adapted down_proj, the fp32
    gradient of that adapter's input cast (F x 4), whichever is larger; plus the incoming
    gradient of the residual (D x s). A 4-bit base dequantizes its weight (in x out, compute
    dtype) to back-propagate through it, one linear at a time.
    """
    N, s, D, F = run.tokens, run.s, model.hidden_size, model.intermediate_size
    cast = run.cast_copies and not run.full and "mlp.down_proj" in adapted_linears(model, run.lora_targets)
    width = max(2 * F * s, F * 4 if cast else 0)
    terms = [Term("block backward: SwiGLU grads", N * (width + D * s),
                  ("F x 4" if width > 2 * F * s else "2 x F x s") + " + D x s per token")]
    return terms + _dequantized(model, run)


def _block_forward(model: ModelShape, run: RunShape) -> list[Term]:
    """The working set of one block's forward beyond what it keeps: at down_proj, the SwiGLU
    product when nothing keeps it (F x s), the fp32 cast of it for an adapted down_proj under
    autocast (F x 4), and the output (D x s). Matters when checkpointing recomputes a block."""
    N, s, D, F = run.tokens, run.s, model.hidden_size, model.intermediate_size
    down = not run.full and "mlp.down_proj" in adapted_linears(model, run.lora_targets)
    kept = (down and not run.cast_copies) or run.full
    width = (0 if kept else F * s) + (F * 4 if down and run.cast_copies else 0) + D * s
    work = Term("block forward (recompute) working set", N * width, f"{width:,} B per token")
    return [work] + _dequantized(model, run)


def _dequantized(model: ModelShape, run: RunShape) -> list[Term]:
    big = max(i * o for i, o in model.linears().values())
    if run.quantize == "ternary":  # its uint8 codes, then the compute-dtype weight (scaled in place)
        return [Term("ternary weight dequantized for a matmul", big * (1 + run.s), f"largest linear x (1 + {run.s}) B")]
    if run.quantize == "int8":  # the backward dequantizes the weight (`frozen_int8_matmul`; on the CPU the forward too)
        return [Term("int8 weight dequantized for a matmul", big * run.s, "largest linear x s")]
    if run.quantize != "nf4":
        return []
    return [Term("4-bit weight dequantized for a matmul", big * run.s, "largest linear x s")]


def _model_saved(model: ModelShape, run: RunShape) -> list[Term]:
    """Kept once per forward, outside the blocks: batch tensors, masks, RoPE tables, final norm."""
    N, s = run.tokens, run.s
    terms = [Term("batch tensors (ids, mask, labels)", N * 3 * 8, "3 x int64 per token"),
             Term("RoPE cos, sin", N * 2 * model.rope_dim * s, f"2 x {model.rope_dim} (rotary dims) x s per token"),
             Term("final norm input (fp32)", N * model.hidden_size * 4, "D x 4 per token")]
    if run.mask:
        terms.append(Term("attention mask (bool)", run.rows * run.seq * run.seq, "rows x T x T x 1"))
    return terms + model.extra_model_saved(run)


def logits_terms(model: ModelShape, run: RunShape) -> tuple[list[Term], list[Term], int]:
    """(forward terms, backward terms, target rows n) of the chunked loss.

    The loss gathers the n target rows of the final hidden state (n x D x s) and projects
    c = min(n, chunk) rows at a time: forward holds the chunk's logits (c x V x s), their fp32
    copy when s < 4 and logsumexp's fp32 temporary (measured: 8 B per logit in fp32, 10 in bf16);
    a frozen head writes its GEMM into one reused fp32 buffer and makes the softmax in place
    (4 B per logit in fp32; 6 in bf16, with the compute-dtype buffer), one block of
    `minitrain.objectives.losses.frozen_head_block` at a time (on a CPU in fp32: all n rows by a few thousand
    vocabulary columns).
    A LoRA-wrapped head holds its base logits, the delta and their sum at once (3 x s per logit).
    A frozen head (not trained, not adapted) computes the rows' gradient in that forward and keeps
    it (n x D x s); the backward only scales it. Any other head keeps the gathered rows for each
    chunk's checkpoint; its backward recomputes the forward, then holds the logits (s), the fp32
    gradient (4) and its compute-dtype copy when s < 4; plus the gradient of the gathered rows.
    """
    n = run.tokens if run.targets is None else min(run.targets, run.tokens)
    V, D, s = model.vocab_size, model.hidden_size, run.s
    from minitrain.objectives.losses import chunk_rows, frozen_head_block, logits_per_chunk  # the loss's own rules

    per_chunk = run.logits_chunk or logits_per_chunk(run.device)
    c = min(n, chunk_rows(per_chunk, V, run.device))
    cols = V
    if head_is_frozen(model, run):  # its blocks (rows x columns)
        c, cols = frozen_head_block(n, V, run.device, low=s < 4, chunk=c if run.logits_chunk else None)
    gathered = Term("loss: gathered target rows", n * D * s, "n x D x s")
    rows_grad = Term("loss: grad of gathered rows", n * D * s, "n x D x s")
    fwd_per = s + (4 if s < 4 else 0) + 4 + (0 if getattr(model, "plain_head", True) else s)  # + tanh's output
    if head_is_frozen(model, run):  # one reused fp32 buffer (+ one in the compute dtype when s < 4)
        fwd_per = 4 + (s if s < 4 else 0)
    elif any(matches("lm_head", t) for t in run.lora_targets):
        fwd_per = max(fwd_per, 3 * s)  # a LoRA head: base logits, the LoRA delta and their sum at once
    fwd = [gathered, Term("loss: final hidden states", run.tokens * D * s, "N x D x s"),
           Term("loss: logits chunk (forward)", c * cols * fwd_per,
                f"c={c:,} x {'V' if cols == V else f'{cols:,} columns'} x {fwd_per} B")]
    if head_is_frozen(model, run):
        kept = Term("loss: rows' gradient made in forward", n * D * s, "n x D x s")
        return fwd + [kept], [kept, rows_grad], n
    bwd_per = max(fwd_per, s + 4 + (s if s < 4 else 0) + (0 if getattr(model, "plain_head", True) else s))
    bwd = [gathered, Term("loss: logits chunk (backward)", c * V * bwd_per, f"c={c:,} x V x {bwd_per} B"),
           rows_grad]
    return fwd, bwd, n


# distillation's chunk (`minitrain.objectives.distill.chunked_kd_ce`), measured at its peak with torch 2.13:
# the student's and the teacher's (c x V) logits and `_KDAndCE`'s fp32 temporaries, 33 B per logit
# (fp32 or bf16); with top_k, 8 (the teacher's logits are reduced to k before the chunk, and the
# CE over V is what is left)
KD_BYTES_PER_LOGIT = 33
KD_TOP_K_BYTES_PER_LOGIT = 8
KD_KL_TENSORS = 4  # attention_kl: (rows, G, T, T) fp32 tensors alive at its peak (measured)


def _kd_logits(model: ModelShape, run: RunShape) -> tuple[list[Term], list[Term], int]:
    """(forward terms, backward terms, n) of distillation's chunked KD + CE loss: the n target rows
    of the student's and the teacher's final hidden states gathered, then c rows at a time (each
    chunk under checkpoint, whatever the student's head) both heads' logits and the KD / CE
    temporaries; the backward recomputes a chunk and adds the gradient of the gathered rows."""
    n = run.tokens if run.targets is None else min(run.targets, run.tokens)
    V, D, Dt, s = model.vocab_size, model.hidden_size, run.teacher.hidden_size, run.s
    from minitrain.objectives.losses import chunk_rows, logits_per_chunk

    c = min(n, chunk_rows(run.logits_chunk or logits_per_chunk(run.device), V, run.device))
    per = KD_TOP_K_BYTES_PER_LOGIT if run.kd_top_k else KD_BYTES_PER_LOGIT
    rows = [Term("loss: gathered target rows", n * D * s, "n x D x s"),
            Term("loss: the teacher's gathered rows", n * Dt * s, "n x D_teacher x s")]
    chunk = Term("loss: KD chunk (both heads' logits + temporaries)", c * V * per, f"c={c:,} x V x {per} B")
    inside, _ = _kd_captured(model, run)
    fwd = rows + inside + [Term("loss: final hidden states", run.tokens * D * s, "N x D x s"),
                           Term("teacher: final hidden states", run.tokens * Dt * s, "N x D_teacher x s"), chunk]
    return fwd, rows + inside + [chunk, Term("loss: grad of gathered rows", n * D * s, "n x D x s")], n


def _kd_captured(model: ModelShape, run: RunShape) -> tuple[list[Term], list[Term]]:
    """(kept, KL) terms of feature matching and attention transfer. Kept from the forwards to the
    loss's backward: per matched layer the teacher's hidden states, per transferred layer both
    sides' attention probabilities (fp32). KL: attention_kl's head-grouped fp32 tensors (G = gcd of
    the head counts), made after the KD chunks are freed (`llama_moments`' "attention KL" moment)."""
    L, teacher, N, s = model.num_hidden_layers, run.teacher, run.tokens, run.s
    feats = L if run.kd_features < 0 else min(run.kd_features, L)
    attns = L if run.kd_attention < 0 else min(run.kd_attention, L)
    kept, kl = [], []
    if feats:
        kept.append(Term("teacher: matched hidden states", feats * N * teacher.hidden_size * s,
                         f"{feats} x N x D_teacher x s"))
    if attns:
        H, Ht = model.num_attention_heads, teacher.num_attention_heads
        G, qk = math.gcd(H, Ht), run.rows * run.seq * run.seq * 4
        kept.append(Term("captured attention probabilities (both sides)", attns * (H + Ht) * qk,
                         f"{attns} x (heads + teacher heads) x rows x T x T x 4"))
        kl.append(Term("attention KL: head-grouped tensors", KD_KL_TENSORS * G * qk,
                       f"{KD_KL_TENSORS} x G={G} x rows x T x T x 4"))
    return kept, kl


def teacher_run(run: RunShape) -> RunShape:
    """The run as the teacher sees it: frozen (no adapters, nothing trained), its linears as `teacher_quantize`
    says, one process (the teacher is whole on each rank); a teacher whose family keeps a CPU batch's padding
    (Gemma 4) runs every position, with its mask, beside a student that drops it."""
    plain = replace(run, quantize=run.teacher_quantize, full=False, lora_targets=(), modules_to_save=(), teacher=None,
                    dpo_reference=None, sample_rows=0, reward_model=None, world=1, parallel="ddp")
    if run.real_tokens is not None and not getattr(run.teacher, "UNPADS_ON_CPU", False):
        plain = replace(plain, real_tokens=None, mask=True)
    return plain


def teacher_weight_terms(run: RunShape) -> list[Term]:
    """The teacher's weights, frozen in the compute dtype (its linears, and an MoE's experts, as `teacher_quantize`
    says; a family whose weights it cannot quantize, gpt-oss's experts, is one line: `check_quantize`)."""
    teacher, plain = run.teacher, teacher_run(run)
    if run.teacher_quantize != "none" and hasattr(teacher, "check_quantize"):
        teacher.check_quantize("teacher_quantize", run.teacher_quantize)
    return [Term(f"teacher {t.name}", t.bytes, t.formula) for t in teacher.weight_terms(plain)]


def teacher_forward(run: RunShape) -> list[Term]:
    """The teacher's no_grad forward before the student's: at most one block's tensors alive at a time (its
    largest block: `saved_per_layer`, a hybrid's or an MoE's blocks differ), over the teacher's batch tensors
    and tables (Gemma 4's per-layer inputs among them), and its final hidden states."""
    teacher, plain = run.teacher, teacher_run(run)
    block = max(no_grad_block(teacher.block_view(i), plain) for i in range(teacher.num_hidden_layers))
    return _model_saved(teacher, plain) + [
        Term("teacher forward: its largest block (no grad)", block,
             "the residual + a norm's fp32 output + the block's largest stage (its mixer's, or its MLP's) of "
             "block_saved's tensors"),
        Term("teacher: final hidden states", plain.tokens * teacher.hidden_size * run.s, "N x D_teacher x s")]


# a block's stages, by the names of `block_saved`'s terms, which a no_grad forward frees before the next: the mixer
# (the rest), Qwen3.5's gated norm after its delta rule, and the MLP (dense, the experts and a shared expert)
GATED_NORM = ("DeltaNet: gated RMSNorm",)
MLP_STAGE = ("gated MLP", "experts", "shared expert", "MoE norms")


def no_grad_block(block: ModelShape, run: RunShape) -> int:
    """Bytes a block's no_grad forward holds at its peak (a teacher's; measured on the CPU at the MLP's product, the
    experts' gathered rows or the end of the delta rule): the residual x (s) and a norm's fp32 output (4) per
    token, the largest stage of what `block_saved` counts (the mixer's, Qwen3.5's gated norm, the MLP's), and
    under teacher_quantize=nf4 one linear's dequantized weight (`_dequantized`). An MoE block runs its routed
    experts, then the MLP beside them (a shared expert, Gemma 4's dense MLP): not together, so its MLP stage is the
    larger of the two."""
    N, s, D = run.tokens, run.s, block.hidden_size
    terms = [t for t in block_saved(block, run) if not t.name.startswith("norm inputs")]
    size = lambda names: sum(t.bytes for t in terms if t.name.startswith(names))  # noqa: E731
    mlp, gated = size(MLP_STAGE), size(GATED_NORM)
    stages = [sum(t.bytes for t in terms) - mlp - gated, gated, mlp]
    beside = getattr(block, "mlp_beside_experts", getattr(block, "shared_size", 0))
    if getattr(block, "has_experts", False) and beside:  # `gated MLP` counts its 3 x F_beside share
        alone = N * 3 * beside * s + size(("shared expert",))
        stages[-1:] = [alone, mlp - alone]
    return N * D * (s + 4) + max(stages) + sum(t.bytes for t in _dequantized(block, run))


def reward_model_terms(run: RunShape) -> tuple[list[Term], list[Term]]:
    """GRPO's reward model (`rewards=model:DIR`): its frozen weights in the compute dtype, a one-row
    `score` in place of the LM head (persistent), and its no_grad scoring of up to `REWARD_BATCH`
    rows of `seq` tokens (a moment: one block's tensors at a time, its final hidden states)."""
    rm = run.reward_model
    plain = replace(run, quantize="none", full=False, lora_targets=(), modules_to_save=(), teacher=None,
                    reward_model=None, rows=min(REWARD_BATCH, run.sample_rows or run.rows), real_tokens=None)
    V, D = rm.vocab_size, rm.hidden_size
    weights = []
    for t in rm.weight_terms(plain):
        if t.name == "weights: embeddings + head":  # the reward model holds no LM head
            t = Term("weights: embeddings + score", (V * D + D) * run.s, f"({V:,} x {D:,} + {D:,}) x {run.s} B")
        weights.append(Term(f"reward model {t.name}", t.bytes, t.formula))
    scoring = _model_saved(rm, plain) + [
        Term("reward model forward: one block (no grad)", sum(t.bytes for t in block_saved(rm, plain)),
             "block_saved, freed as it goes"),
        Term("reward model: final hidden states", plain.tokens * D * run.s, "rows x T x D x s")]
    return weights, scoring


def head_is_frozen(model: ModelShape, run: RunShape) -> bool:
    """Whether the output projection is a plain frozen Linear (minitrain.objectives.losses' two-matmul path)."""
    if run.full or not getattr(model, "plain_head", True):
        return False
    trained = list(run.lora_targets) + list(run.modules_to_save)
    saved = run.modules_to_save
    tied_embed = model.tie_word_embeddings and any(matches(e, m) for e in model.EMBEDDINGS for m in saved)
    return not (any(matches("lm_head", m) for m in trained) or tied_embed)


def _scaled(terms: list[Term], k: int, name: str, formula: str) -> Term:
    return Term(name, k * sum(t.bytes for t in terms), formula)


def llama_moments(model: ModelShape, run: RunShape) -> tuple[dict[str, list[Term]], list[str]]:
    """LLaMA's candidate peaks (activations and transients) and notes."""
    L, N, s, D = model.num_hidden_layers, run.tokens, run.s, model.hidden_size
    per_layer = model.saved_per_layer(run)
    msaved = _model_saved(model, run)
    lfwd, lbwd, n = (logits_terms if run.teacher is None else _kd_logits)(model, run)
    res = 4 if run.full else s  # full fine-tuning: the fp32 embedding makes the residual stream fp32
    k = run.checkpointed(L)  # the first k blocks keep only their input; the other L - k their saved tensors
    inputs = [Term(f"block inputs x {k} (checkpointing)", k * N * D * res, f"{k} x N x D x {res}")] if k else []
    after = sum(per_layer[k:])
    kept = inputs + ([Term(f"saved activations x {L - k} blocks", after,
                           f"{after / N:,.0f} B per token over {L - k} blocks")] if k < L else [])
    copies = _weight_copies(model, run, range(L), head=True)  # the forward's: with checkpointing too (autocast's cache)
    front = [t for t in msaved if "final norm" not in t.name]
    moments = {
        "end of forward (loss forward)": msaved + kept + lfwd + copies,
        "loss backward": msaved + kept + lbwd + copies,
    }
    total = lambda terms: sum(t.bytes for t in terms)  # noqa: E731
    # full fine-tuning: the gradients (set_to_none until then) of the last block, or of the last checkpointed one and
    # those after it, whichever block peaks (an earlier block's backward holds a few more, which its own terms
    # over-count by about as much: measured on LLaMA)
    grads_from = lambda first: [_grads_of(model, range(first, L))] if run.full else []  # noqa: E731

    def backward_of(j: int) -> list[Term]:
        """Block j (kept its activations) backward: the blocks before it still hold theirs."""
        held = [Term(f"saved activations x {j + 1 - k} blocks", sum(per_layer[k:j + 1]),
                     f"{sum(per_layer[k:j + 1]) / N:,.0f} B per token over {j + 1 - k} blocks")]
        return (front + inputs + held + _block_backward(model.block_view(j), run)
                + _weight_copies(model, run, range(k, L), head=False) + grads_from(L - 1))

    def recomputed(i: int) -> list[Term]:
        """Checkpointed block i recomputed, then its backward (the blocks after it are done and freed)."""
        worst = max(model.block_view(i).recompute_peaks(run, per_layer[i]), key=total)
        return (front + inputs + worst
                + _weight_copies(model, run, range(i, i + 1), head=False) + grads_from(k - 1))  # a recompute: its own copies

    # the last block, or in a hybrid (Qwen3.5, Gemma 4) a block of another kind whose own terms hold more
    if k < L:
        moments["last block backward"] = max((backward_of(j) for j in reversed(range(k, L))), key=total)
    if k:
        name = "last block backward" if k == L else "last checkpointed block backward (recomputed)"
        moments[name] = max((recomputed(i) for i in reversed(range(k))), key=total)
    if run.full:
        for name, grads in _full_grads(model, run).items():
            moments[name] = moments.get(name, []) + grads
    trainable = sum(trainable_tensors(model, run)) * DTYPE_BYTES[run.adapter_dtype]
    notes = []
    if run.dpo_reference in ("base", "snapshot"):
        # no_grad forward before the policy's: at most one block's tensors alive at a time
        r = run if run.reference_rows in (None, run.rows) else replace(run, rows=run.reference_rows, targets=None)
        one = Term("reference forward: one block (no grad)", max(model.saved_per_layer(r)),
                   "block_saved, freed as it goes" + (f"; {r.rows} rows" if r is not run else ""))
        ref = (_model_saved(model, r) if r is not run else msaved) + [one] + (logits_terms(model, r)[0] if r is not run
                                                                               else lfwd)
        if run.dpo_reference == "snapshot":
            ref.append(Term("reference: live adapter values kept aside", trainable, "clone of the adapter tensors"))
        moments["DPO reference forward"] = ref
    if run.teacher is not None:
        moments["teacher forward (no grad)"] = teacher_forward(run)
        if run.teacher_quantize == "int8":
            notes.append("teacher_quantize=int8: the int8 matmuls' own tensors in the teacher's forward (the "
                         "activations' fp16 casts and int8 codes, the int32 products) are not counted")
        _, kl = _kd_captured(model, run)
        if kl:  # one layer's KL at a time, after the KD chunks
            chunk = [t for t in lfwd if t.name.startswith("loss: KD chunk")]
            moments["attention KL (loss forward)"] = msaved + kept + [t for t in lfwd if t not in chunk] + kl + copies
    if model.n_rep > 1:
        notes.append(f"GQA: repeat_kv copies of k and v are counted ({model.ATTENTION} keeps the repeated tensors)")
    if run.lora_dropout > 0:
        notes.append(f"lora_dropout={run.lora_dropout}: its per-adapter copies and masks are not modelled for LLaMA")
    return moments, notes


# ----------------------------------------------------------------------------- Gemma, Phi-3


@dataclass(frozen=True)
class GemmaShape(ModelShape):
    """Gemma 2 / Gemma 3 text (`models/gemma.py`): LLaMA's method with four (1 + w) norms per block
    (each keeps its fp32 input), GeGLU (the same three F-wide tensors as SwiGLU) and Gemma 3's q/k
    norms. Gemma 2 soft-caps its attention scores, which SDPA cannot do, so its attention is written
    out and every block keeps its scores: per query and key, tanh's output (s) and softmax's fp32
    probabilities (+ their compute-dtype copy when s < 4), besides the queries, the (repeated) keys
    and the values. A final-logit cap makes the head a `SoftcappedLinear`, so the loss takes its
    generic (checkpointed) path, whose chunk also holds tanh's output.
    """

    attn_softcap: float | None = None
    final_softcap: float | None = None
    FAMILIES: ClassVar[tuple[str, ...]] = ("gemma2", "gemma3_text")
    NORMS: ClassVar[int] = 4
    # transformers' class defaults for fields a config.json may leave out
    DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "gemma2": dict(num_key_value_heads=4, head_dim=256, tie_word_embeddings=True, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0),
        "gemma3_text": dict(num_key_value_heads=4, head_dim=256, tie_word_embeddings=True),
    }

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> "GemmaShape":
        kind = d.get("model_type")
        defaults = cls.DEFAULTS.get(kind, {})
        cap = lambda k: d[k] if k in d else defaults.get(k)  # noqa: E731  (an explicit null: no cap)
        return cls(**cls._dims(d, where, defaults), qk_norm=kind == "gemma3_text",
                   attn_softcap=cap("attn_logit_softcapping") if kind == "gemma2" else None,
                   final_softcap=cap("final_logit_softcapping"))

    @property
    def plain_head(self) -> bool:
        return self.final_softcap is None

    def attention_saved(self, run: RunShape) -> list[Term]:
        if self.attn_softcap is None:
            return super().attention_saved(run)
        N, s, Hq, H, S = run.tokens, run.s, self.q_width, self.num_attention_heads, run.seq
        Hk = Hq if self.n_rep > 1 else self.kv_width
        per_key = s + 4 + (s if s < 4 else 0)
        return [Term("capped attention: q, k, v", N * (Hq + 2 * Hk) * s,
                     f"(Hq + 2 Hk{' (repeated)' if self.n_rep > 1 else ''}) x {s} per token"),
                Term("capped attention: tanh out + fp32 probs", N * H * S * per_key,
                     f"heads x {S} keys x {per_key} B per token")]


@dataclass(frozen=True)
class Phi3Shape(ModelShape):
    """Phi-3 (`models/phi3.py`): LLaMA's method over the fused `qkv_proj` (D -> Hq + 2 Hk) and
    `gate_up_proj` (D -> 2F), which LLaMA-named targets select (as `minitrain.adapters.lora` reads them).
    Without GQA, SDPA's value is a view of the fused qkv output, which it keeps whole."""

    FAMILIES: ClassVar[tuple[str, ...]] = ("phi3",)
    FUSED: ClassVar[dict[str, tuple[str, ...]]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                                    "gate_up_proj": ("gate_proj", "up_proj")}

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> "Phi3Shape":
        return cls(**cls._dims(d, where, {}), sliding_window=d.get("sliding_window"))

    def linears(self) -> dict[str, tuple[int, int]]:
        D, F, q, kv = self.hidden_size, self.intermediate_size, self.q_width, self.kv_width
        return {"self_attn.qkv_proj": (D, q + 2 * kv), "self_attn.o_proj": (q, D), "mlp.gate_up_proj": (D, 2 * F),
                "mlp.down_proj": (F, D)}

    def attention_saved(self, run: RunShape) -> list[Term]:
        terms = super().attention_saved(run)
        if self.n_rep == 1:
            terms.append(Term("fused qkv output (held by v's view)", run.tokens * (self.q_width + self.kv_width) * run.s,
                              f"(Hq + Hk) x {run.s} per token"))
        return terms


def sampling_terms(model: ModelShape, run: RunShape) -> list[Term]:
    """GRPO's rollout (`minitrain.objectives.sampling`), a moment of its own: no graph, before the
    policy forward. The KV cache of every layer for `sample_rows` rows x `seq` slots, in the compute
    dtype, and one decoding step's hidden states and fp32 logits (with the filtered copy and softmax)."""
    R, T = run.sample_rows, run.seq
    return model.sampler_cache(run) + [
            Term("sampler: prefill hidden states", R * T * model.hidden_size * run.s * 2, "rows x T x D x s x 2"),
            Term("sampler: one step's logits (fp32, filtered, softmax)", R * model.vocab_size * 4 * 3,
                 "rows x V x 4 B x 3")]

