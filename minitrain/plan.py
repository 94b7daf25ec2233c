"""A model of a training run's peak GPU memory, from the model's `config.json` and the run's keys.

Plain functions over two small descriptions: a model shape (the dims of a checkpoint, read from
`config.json` only, never the weights: `ModelShape` for LLaMA / Mistral / Qwen2 / Qwen3 (biases
and per-head q/k norms are fields), `GemmaShape` for Gemma 2 / Gemma 3 text, `Phi3Shape` for
Phi-3's fused projections, `T5Shape` for T5 v1.0, v1.1 and FLAN-T5; `shape_from_hf` picks one) and `RunShape` (micro-batch, lengths, dtype,
quantization, adapter, checkpointing, DPO reference mode). `predict(model, run)` returns a `Plan`:
every term in bytes with the formula it comes from, and the peak. The family-specific parts
(weights, trainable tensors, the activation moments) are methods of the shape, so `predict` reads
the same for every family. `tools/plan.py` prints it for a recipe; `tests/test_plan.py` checks it
against peaks measured on the CPU.

What is counted, and how (s = bytes per element of the compute dtype: 2 for bf16, 4 for fp32):

- weights: float tensors in the base dtype; nf4 (bitsandbytes `Linear4bit`): 0.5 byte / param
  packed + one absmax per 64-block (fp32, or uint8 with double quantization plus a second level
  of one fp32 absmax per 256 blocks, a 256-entry fp32 code and an fp32 offset) + the 16-entry nf4
  code; int8 (`Linear8bitLt`): 1 byte / param + one fp32 scale per output row; ternary
  (`minitrain.ternary`): 2 bits / param packed four to a byte along each row (ceil(in / 4) bytes a
  row) + one fp32 scale per tensor or per output row. Embeddings, norms and the (unquantized) head
  stay in the compute dtype.
- adapter rank: `lora_r`, or LRC's `lrc_rank` (below 1: that fraction of each linear's min(in, out),
  as `minitrain.lrc.resolve_rank`).
- adapters: LoRA A (r x in) and B (out x r) per adapted linear, fp32; their gradients (fp32) and
  AdamW's two fp32 moments each (+ one fp32 `step` per tensor).
- `ema_decay`: the moving average, one more copy of the trained tensors (fp32).
- full fine-tuning (`finetune=full`, LLaMA / Mistral): every weight in fp32 (the loader reads them
  so), an fp32 gradient and two fp32 moments each; every linear keeps its input and every norm its
  normalised input for the weight gradients, the residual stream is fp32 (the fp32 embedding feeds
  it), and under bf16 autocast each linear keeps a bf16 copy of its weight (autocast's cast cache,
  held for backward) and a bf16 copy of its fp32 input.
- activations: what autograd keeps for backward in `models/llama.py` + `minitrain/lora.py`, per
  block and per token (read off the autograd graph; see `block_saved`), the per-block inputs
  only under checkpointing plus one block recomputed, and the loss's chunked logits
  (`minitrain.losses.LOGITS_PER_CHUNK` logits per chunk, never the full `B x T x V`).
- transients at the peak moment: the logits chunk in forward / backward, one block's backward
  working set, a dequantized 4-bit weight in bitsandbytes' backward, a dequantized ternary weight
  in forward and backward (its uint8 codes + the compute-dtype weight, one linear at a time: the
  ternary matmul saves only the packed weight; `ternary_act_bits`' per-token transients are not
  modelled), the DPO reference forward.
- distillation (`RunShape.teacher`): the teacher's weights (frozen, compute dtype or
  `teacher_quantize`), its no_grad forward (one block at a time) and final hidden states, the
  KD chunks in place of the SFT loss's (both heads' logits and `_KDAndCE`'s fp32 temporaries,
  measured per logit), the matched layers' hidden states and both sides' attention probabilities
  with attention_kl's tensors, and the learned projections (trained like adapters).

The peak is the largest of those moments (end of forward, loss backward, first block backward,
reference forward, optimizer step), on top of what persists (weights, adapters, gradients and
AdamW state: the steady state from step 2 on). It models `torch.cuda.max_memory_allocated`; the
CUDA context and allocator slack come on top (`RESERVE_*`, used by the verdict).

T5 (`T5Shape`, `models/t5.py`): the same method over an encoder of rows x source-length tokens and
a decoder of rows x target-length tokens whose blocks also attend over the encoder output (each
keeps its cross-attention keys and values, rows x source long); see `T5Shape.block_saved`. T5 runs
train with the checkpoint's `dropout_rate` (0.1 for the published ones) and the recipe's
`lora_dropout`: each dropout keeps its mask (bool on CUDA, the input's dtype on the CPU).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ClassVar

from minitrain.errors import UserError

KiB, MiB, GiB = 2**10, 2**20, 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NF4_BLOCK = 64  # quantize_hook's default blocksize
NF4_BLOCK2 = 256  # bitsandbytes' second-level block for double quantization
# outside `max_memory_allocated`: the CUDA context (+ cuBLAS / cuDNN workspaces), and the caching
# allocator's fragmentation, as a share of the allocated peak
RESERVE_CONTEXT = 600 * MiB
RESERVE_SLACK = 0.10

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# which activation each linear reads: its input is what an adapter (or an int8 base) keeps
_INPUT_OF = {"self_attn.q_proj": "xn", "self_attn.k_proj": "xn", "self_attn.v_proj": "xn",
             "self_attn.o_proj": "attn", "mlp.gate_proj": "xn2", "mlp.up_proj": "xn2", "mlp.down_proj": "act",
             "self_attn.qkv_proj": "xn", "mlp.gate_up_proj": "xn2"}


# ----------------------------------------------------------------------------- shapes


def shape_from_hf(d: dict[str, Any], where: str = "config.json") -> "ModelShape | T5Shape":
    """The shape of the family `config.json`'s model_type names (LLaMA / Mistral / Qwen, Gemma,
    Phi-3, T5)."""
    kind = d.get("model_type")
    if kind == "t5":
        return T5Shape.from_hf(d, where)
    if kind in GemmaShape.FAMILIES:
        return GemmaShape.from_hf(d, where)
    if kind in Phi3Shape.FAMILIES:
        return Phi3Shape.from_hf(d, where)
    return ModelShape.from_hf(d, where)


PLANNED = "LLaMA, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text), Phi-3 and T5"


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
        linears = sum(i * o for i, o in self.linears().values())
        return V * D * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * linears + self.small_params()[0]

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
        L, D, V = self.num_hidden_layers, self.hidden_size, self.vocab_size
        block = [i * o for i, o in self.linears().values()] + [D, D]
        return [V * D] * (1 if self.tie_word_embeddings else 2) + block * L + [D]

    def trainable_tensors(self, run: "RunShape") -> list[int]:
        return trainable_tensors(self, run)

    def adapted_summary(self, run: "RunShape") -> str:
        if run.full:
            return "every weight (full fine-tuning)"
        return f"{len(adapted_linears(self, run.lora_targets))} linears x {self.num_hidden_layers} blocks"

    def moments(self, run: "RunShape") -> tuple[dict[str, list["Term"]], list[str]]:
        return llama_moments(self, run)


@dataclass(frozen=True)
class RunShape:
    """What one training micro-batch looks like to memory.

    rows: sequences per forward (SFT: batch_size; DPO, ORPO, CPO, SimPO: 2 x pairs, chosen and
    rejected together; KTO: batch_size rows with a graph, while its reference scores them and their
    KL rows, `reference_rows` = 2 x batch_size, and a no_grad policy forward scores the KL rows).
    seq: the padded length T (the worst case is max_len; encoder-decoder: the source length).
    target_seq: the decoder's length (encoder-decoder only; None: seq). targets: positions that
    get a loss (None: all of them, the worst case). compute: activation dtype (bf16 under autocast
    on a GPU). lora_dropout: above 0 every adapter keeps its own dropped input and mask.
    mask: whether an explicit attention mask is built (padding in the batch, or T > window);
    the plain-causal path builds none. real_tokens: the batch's non-padding tokens (None: rows x
    seq, the worst case). On a CPU the decoder-only families run a padded batch without its padding
    (`models.llama.Ragged`): their per-token terms then count the real tokens and, without a
    window shorter than seq, no mask is built (`predict` applies this; T5 ignores it). teacher:
    distillation's teacher (`distill_terms`), run frozen in the compute dtype (or
    `teacher_quantize`).
    """

    rows: int
    seq: int
    target_seq: int | None = None
    compute: str = "bf16"
    quantize: str = "none"  # none | nf4 | int8 | ternary (base linears; the head stays in float)
    double_quant: bool = True
    ternary_scale: str = "tensor"  # tensor | channel: one fp32 scale per ternary weight or per output row
    lora_r: int = 16
    lrc_rank: float = 0.0  # LRC: below 1 a fraction of each linear's full rank, 1 or more a rank; 0: lora_r
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    adapter_dtype: str = "fp32"
    lora_dropout: float = 0.0
    modules_to_save: tuple[str, ...] = ()
    checkpointing: bool = False
    targets: int | None = None
    mask: bool = True
    dpo_reference: str | None = None  # None: not DPO | base | snapshot | precomputed | none (orpo, cpo, simpo)
    reference_rows: int | None = None  # rows of the no_grad reference forward (None: rows; KTO: 2 x rows)
    optimizer_temps: bool = True  # foreach AdamW temporaries (minitrain.optim; False: a fused optimizer)
    logits_chunk: int | None = None  # logits per chunk (None: minitrain.losses' value on `device`)
    full: bool = False  # finetune=full: every weight trains (no adapters; lora_* ignored)
    ema: bool = False  # ema_decay > 0: one more copy of the trained tensors (minitrain.ema)
    device: str = "cuda"  # cuda | cpu: the default logits chunk and the dropout mask's dtype depend on it
    real_tokens: int | None = None
    teacher: Any = None  # distillation: the teacher's ModelShape (its weights, forward and kept states)
    teacher_quantize: str = "none"  # distillation: the teacher's linears (teacher_quantize)
    kd_top_k: int = 0  # distillation: subset KD over the teacher's top-k tokens (0: the full vocabulary)
    kd_features: int = 0  # distillation: student layers whose hidden states are matched (-1: every layer)
    kd_attention: int = 0  # distillation: student layers whose attention is transferred (-1: every layer)

    @property
    def s(self) -> int:
        return DTYPE_BYTES[self.compute]

    def rank(self, in_features: int, out_features: int) -> int:
        """The adapter rank of a linear: `lora_r`, or `lrc_rank` resolved as `minitrain.lrc.resolve_rank`."""
        if not self.lrc_rank:
            return self.lora_r
        from minitrain.lrc import resolve_rank  # (imports torch: only for LRC runs)

        return resolve_rank(self.lrc_rank, in_features, out_features)

    @property
    def rank_text(self) -> str:
        """`r=16`, or `lrc_rank=0.15 of each linear's full rank`."""
        if not self.lrc_rank:
            return f"r={self.lora_r}"
        return f"lrc_rank={self.lrc_rank:g}" + (" of each linear's full rank" if self.lrc_rank < 1 else "")

    @property
    def tokens(self) -> int:
        return self.rows * self.seq if self.real_tokens is None else self.real_tokens

    @property
    def cast_copies(self) -> bool:
        """fp32 adapters under bf16 autocast: each adapter casts its input to fp32 and autocast
        casts it back, so each keeps its own compute-dtype copy of its input for backward."""
        return self.adapter_dtype != self.compute

    def mask_bytes(self, elem: int) -> int:
        """Bytes per element of the mask a dropout keeps: bool on CUDA (fused kernel), the input's
        dtype on the CPU (`input * bernoulli_noise`)."""
        return 1 if self.device == "cuda" else elem


@dataclass
class Term:
    """One line of the plan: bytes, and the formula that gives them."""

    name: str
    bytes: int
    formula: str = ""


@dataclass
class Plan:
    """Persistent terms, the activation terms at the peak moment, the peak and which moment it is."""

    persistent: list[Term]
    moments: dict[str, list[Term]]
    peak_moment: str
    notes: list[str] = field(default_factory=list)

    @property
    def persistent_bytes(self) -> int:
        return sum(t.bytes for t in self.persistent)

    def moment_bytes(self, name: str) -> int:
        return sum(t.bytes for t in self.moments[name])

    @property
    def activation_peak(self) -> int:
        return self.moment_bytes(self.peak_moment)

    @property
    def peak(self) -> int:
        return self.persistent_bytes + self.activation_peak

    def term(self, name: str) -> int:
        return sum(t.bytes for t in self.persistent if t.name == name)


# ----------------------------------------------------------------------------- weights and adapters


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def adapted_linears(model: ModelShape, targets: tuple[str, ...] | list[str]) -> list[str]:
    """Block linears (`self_attn.q_proj`, ...) that LoRA wraps for these target suffixes (on a
    model with fused linears, LLaMA's names select the fused ones, as `minitrain.lora` reads them)."""
    names = list(model.linears())
    if "all-linear" in targets:
        return names
    if model.FUSED:
        from minitrain.lora import fused_targets

        targets = fused_targets(model.FUSED, targets)
    return [n for n in names if any(_matches(n, t) for t in targets)]


def nf4_bytes(numel: int, *, double_quant: bool = True, blocksize: int = NF4_BLOCK) -> int:
    """Bytes of one bitsandbytes nf4 weight: packed 4-bit values and its quantization constants."""
    blocks = -(-numel // blocksize)
    packed = -(-numel // 2)
    code = 16 * 4  # the nf4 value table
    if not double_quant:
        return packed + blocks * 4 + code
    blocks2 = -(-blocks // NF4_BLOCK2)
    return packed + blocks + blocks2 * 4 + NF4_BLOCK2 * 4 + 4 + code  # uint8 absmax, absmax2, code2, offset


def ternary_bytes(in_features: int, out_features: int, scale: str = "tensor") -> int:
    """Bytes of one ternary weight (minitrain.ternary): packed 2-bit codes, ceil(in / 4) bytes a row,
    + the fp32 scale(s): one per tensor, or one per output row."""
    return out_features * -(-in_features // 4) + 4 * (out_features if scale == "channel" else 1)


def int8_bytes(in_features: int, out_features: int) -> int:
    """Bytes of one bitsandbytes int8 weight: int8 values + one fp32 absmax scale per output row."""
    return in_features * out_features + out_features * 4


def _linears_bytes(linears: list[tuple[int, int, int]], run: RunShape) -> tuple[int, str]:
    """(bytes, formula) of base linears given as (in, out, how many), in the run's format."""
    numel = sum(i * o * k for i, o, k in linears)
    if run.quantize == "nf4":
        b = sum(k * nf4_bytes(i * o, double_quant=run.double_quant) for i, o, k in linears)
        return b, (f"{numel:,} params x 0.5 B + absmax per {NF4_BLOCK}-block "
                   + ("(uint8, double-quant) + 2nd level" if run.double_quant else "(fp32)"))
    if run.quantize == "int8":
        return sum(k * int8_bytes(i, o) for i, o, k in linears), f"{numel:,} params x 1 B + fp32 scale per row"
    if run.quantize == "ternary":
        return (sum(k * ternary_bytes(i, o, run.ternary_scale) for i, o, k in linears),
                f"{numel:,} params x 0.25 B (2-bit, rows padded to 4) + fp32 scale per {run.ternary_scale}")
    return numel * run.s, f"{numel:,} params x {run.s} B"


def weight_terms(model: ModelShape, run: RunShape) -> list[Term]:
    """The base model's bytes: block linears (by format), embeddings + head, norms."""
    if run.full:  # full fine-tuning loads every weight in fp32: they are the master weights
        run = replace(run, compute="fp32")
    s = run.s  # the loader casts float tensors to the compute dtype (quantized runs too)
    L, D, V = model.num_hidden_layers, model.hidden_size, model.vocab_size
    b, f = _linears_bytes([(i, o, L) for i, o in model.linears().values()], run)
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
        out += [run.rank(i, o) * i, o * run.rank(i, o)] * model.num_hidden_layers
    D, V = model.hidden_size, model.vocab_size
    for m in run.modules_to_save:
        if _matches("lm_head", m) or _matches("model.embed_tokens", m):
            out.append(V * D)
        elif _matches("model.norm", m):
            out.append(D)
    return out + kd_projections(model, run)


def kd_projections(model: ModelShape, run: RunShape) -> list[int]:
    """Numel of distillation's learned projections (`minitrain.distill.attach_projections`): one
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
      int8 bases keep their input too (bitsandbytes `MatMul8bitLt`), nf4 and frozen float bases don't;
    - r x s per adapted linear: B's input.
    """
    N, s, D, F = run.tokens, run.s, model.hidden_size, model.intermediate_size
    Hq = model.q_width
    adapted = [] if run.full else adapted_linears(model, run.lora_targets)
    lin = model.linears()
    width = {"xn": D, "attn": Hq, "xn2": D, "act": F}
    norms = model.NORMS
    terms = [Term("norm inputs (fp32)", N * norms * D * 4, f"{norms} x D x 4 per token")]
    terms += model.attention_saved(run)
    terms.append(Term("gated MLP: gate, act, up", N * 3 * F * s, "3 x F x s per token"))
    if run.full:
        return terms + _full_block_saved(model, run)
    kept_attn = not any(t.name.startswith("attention q, k, v, out") for t in terms)  # SDPA keeps its output
    if run.cast_copies:
        kept = sum(lin[n][0] for n in adapted)  # one copy per adapter
        shared = {_INPUT_OF[n] for n in lin if run.quantize == "int8"} - {"attn"}
    else:
        kept = 0
        shared = {_INPUT_OF[n] for n in adapted}
        if run.quantize == "int8":
            shared |= {_INPUT_OF[n] for n in lin}
        if not kept_attn:
            shared -= {"attn"}  # the attention output is already counted (SDPA keeps it)
    kept += sum(width[k] for k in shared)
    if kept:
        terms.append(Term("linear inputs kept for adapter / int8 grads", N * kept * s,
                          f"{kept:,} x {s} B per token"
                          + (" (one copy per adapter: autocast)" if run.cast_copies else "")))
    if adapted:
        r = sum(run.rank(*lin[n]) for n in adapted)
        terms.append(Term("LoRA B inputs", N * r * s, f"{len(adapted)} x r ({r:,} in all) x {s} per token"))
    return terms


def _full_block_saved(model: ModelShape, run: RunShape) -> list[Term]:
    """What full fine-tuning adds to a block's saved tensors: the inputs of the weight gradients.

    Each RMSNorm keeps its normalised input (fp32: the residual stream is fp32); the linears keep
    their inputs: in fp32 q/k/v share the normed x, gate/up the other, down its F-wide input (o_proj
    reads SDPA's output, already counted); under autocast q, k, v, gate and up each keep their own
    bf16 cast of the fp32 normed x. The bf16 weight copies are `_weight_copies`."""
    N, s, D, F = run.tokens, run.s, model.hidden_size, model.intermediate_size
    casts = 5 * D if s < 4 else 2 * D  # q, k, v, gate, up: own casts; else xn and xn2, shared
    return [Term("norms' normalised inputs (weight grads)", N * 2 * D * 4, "2 x D x 4 per token"),
            Term("linear inputs kept for weight grads", N * (casts + F) * s,
                 f"({'5' if s < 4 else '2'} D + F) x {s} B per token")]


def _weight_copies(model: ModelShape, run: RunShape, blocks: int, head: bool) -> list[Term]:
    """Full fine-tuning under bf16 autocast: the cast cache's bf16 copy of the fp32 weights of
    `blocks` blocks' linears (+ the head's, while the loss runs), kept by the matmuls for backward."""
    if not run.full or run.s == 4:
        return []
    n = blocks * sum(i * o for i, o in model.linears().values())
    n += model.vocab_size * model.hidden_size if head else 0
    return [Term("autocast: bf16 copies of the weights", n * run.s,
                 f"{n:,} x {run.s} B ({blocks} blocks' linears{' + head' if head else ''})")]


def _full_grads(model: ModelShape, run: RunShape) -> dict[str, list[Term]]:
    """Full fine-tuning: which fp32 gradients exist at each moment. The loop zeroes them with
    set_to_none, so none live through the forward: the head's (and final norm's) appear in the
    loss backward, one block's more at the first block's backward, all of them at the AdamW step."""
    D, V = model.hidden_size, model.vocab_size
    head = V * D + D
    block = sum(i * o for i, o in model.linears().values()) + 2 * D
    return {"loss backward": [Term("gradients: head, final norm", head * 4, f"{head:,} x 4 B")],
            "last block backward": [Term("gradients: head, final norm, one block", (head + block) * 4,
                                         f"{head + block:,} x 4 B")],
            "optimizer step": [Term("gradients", sum(model.all_tensors()) * 4, "every weight's, fp32")]}


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
    kept = (down and not run.cast_copies) or run.quantize == "int8" or run.full
    width = (0 if kept else F * s) + (F * 4 if down and run.cast_copies else 0) + D * s
    work = Term("block forward (recompute) working set", N * width, f"{width:,} B per token")
    return [work] + _dequantized(model, run)


def _dequantized(model: ModelShape, run: RunShape) -> list[Term]:
    big = max(i * o for i, o in model.linears().values())
    if run.quantize == "ternary":  # its uint8 codes, then the compute-dtype weight (scaled in place)
        return [Term("ternary weight dequantized for a matmul", big * (1 + run.s), f"largest linear x (1 + {run.s}) B")]
    if run.quantize != "nf4":
        return []
    return [Term("4-bit weight dequantized for a matmul", big * run.s, "largest linear x s")]


def _model_saved(model: ModelShape, run: RunShape) -> list[Term]:
    """Kept once per forward, outside the blocks: batch tensors, masks, RoPE tables, final norm."""
    N, s = run.tokens, run.s
    terms = [Term("batch tensors (ids, mask, labels)", N * 3 * 8, "3 x int64 per token"),
             Term("RoPE cos, sin", N * 2 * model.head_dim * s, "2 x head_dim x s per token"),
             Term("final norm input (fp32)", N * model.hidden_size * 4, "D x 4 per token")]
    if run.mask:
        terms.append(Term("attention mask (bool)", run.rows * run.seq * run.seq, "rows x T x T x 1"))
    return terms


def _logits(model: ModelShape, run: RunShape) -> tuple[list[Term], list[Term], int]:
    """(forward terms, backward terms, target rows n) of the chunked loss.

    The loss gathers the n target rows of the final hidden state (n x D x s) and projects
    c = min(n, chunk) rows at a time: forward holds the chunk's logits (c x V x s), their fp32
    copy when s < 4 and logsumexp's fp32 temporary (measured: 8 B per logit in fp32, 10 in bf16);
    a frozen head writes its GEMM into one reused fp32 buffer and makes the softmax in place
    (4 B per logit in fp32; 6 in bf16, with the compute-dtype buffer), one block of
    `minitrain.losses.frozen_head_block` at a time (on a CPU in fp32: all n rows by a few thousand
    vocabulary columns).
    A LoRA-wrapped head holds its base logits, the delta and their sum at once (3 x s per logit).
    A frozen head (not trained, not adapted) computes the rows' gradient in that forward and keeps
    it (n x D x s); the backward only scales it. Any other head keeps the gathered rows for each
    chunk's checkpoint; its backward recomputes the forward, then holds the logits (s), the fp32
    gradient (4) and its compute-dtype copy when s < 4; plus the gradient of the gathered rows.
    """
    n = run.tokens if run.targets is None else min(run.targets, run.tokens)
    V, D, s = model.vocab_size, model.hidden_size, run.s
    from minitrain.losses import chunk_rows, frozen_head_block, logits_per_chunk  # the loss's own rules

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
    elif any(_matches("lm_head", t) for t in run.lora_targets):
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


# distillation's chunk (`minitrain.distill.chunked_kd_ce`), measured at its peak with torch 2.13:
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
    from minitrain.losses import chunk_rows, logits_per_chunk

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


def teacher_weight_terms(run: RunShape) -> list[Term]:
    """The teacher's weights, frozen in the compute dtype (its linears as `teacher_quantize` says)."""
    teacher = run.teacher
    plain = replace(run, quantize=run.teacher_quantize, full=False, lora_targets=(), modules_to_save=(), teacher=None)
    return [Term(f"teacher {t.name}", t.bytes, t.formula) for t in teacher.weight_terms(plain)]


def teacher_forward(run: RunShape) -> list[Term]:
    """The teacher's no_grad forward before the student's: at most one block's tensors alive at a
    time, over the teacher's batch tensors and tables, and its final hidden states."""
    teacher, plain = run.teacher, replace(run, lora_targets=(), teacher=None)
    N = run.tokens
    return _model_saved(teacher, plain) + [
        Term("teacher forward: one block (no grad)", sum(t.bytes for t in block_saved(teacher, plain)),
             "block_saved, freed as it goes"),
        Term("teacher: final hidden states", N * teacher.hidden_size * run.s, "N x D_teacher x s")]


def head_is_frozen(model: ModelShape, run: RunShape) -> bool:
    """Whether the output projection is a plain frozen Linear (minitrain.losses' two-matmul path)."""
    if run.full or not getattr(model, "plain_head", True):
        return False
    trained = list(run.lora_targets) + list(run.modules_to_save)
    saved = run.modules_to_save
    tied_embed = model.tie_word_embeddings and any(_matches(e, m) for e in model.EMBEDDINGS for m in saved)
    return not (any(_matches("lm_head", m) for m in trained) or tied_embed)


def _scaled(terms: list[Term], k: int, name: str, formula: str) -> Term:
    return Term(name, k * sum(t.bytes for t in terms), formula)


def predict(model: "ModelShape | T5Shape", run: RunShape) -> Plan:
    """The memory plan of one run: persistent terms and the activation terms at each candidate peak."""
    if run.full and model.is_encoder_decoder:
        raise UserError("finetune=full: the memory plan models full fine-tuning of LLaMA / Mistral only — "
                        "memory_check=false skips the plan")
    if run.real_tokens is not None:  # padding that only the decoder-only families on a CPU leave out
        if run.device == "cpu" and getattr(model, "UNPADS_ON_CPU", False):
            windowed = model.sliding_window is not None and model.sliding_window < run.seq
            run = replace(run, mask=run.mask and windowed)
        else:
            run = replace(run, real_tokens=None)
    persistent = model.weight_terms(run) + adapter_terms(model, run)
    if run.teacher is not None:
        persistent += teacher_weight_terms(run)
    if run.full:  # the gradients are in the moments where they exist (set_to_none between steps)
        persistent = [t for t in persistent if t.name != "gradients"]
    moments, notes = model.moments(run)
    trainable = sum(model.trainable_tensors(run)) * DTYPE_BYTES[run.adapter_dtype]
    moments["optimizer step"] = moments.get("optimizer step", []) + [
        Term("AdamW temporaries", trainable if run.optimizer_temps else 0,
             "1 x trainable (foreach)" if run.optimizer_temps else "fused: none")]
    peak = max(moments, key=lambda k: sum(t.bytes for t in moments[k]))
    return Plan(persistent, moments, peak, notes)


def llama_moments(model: ModelShape, run: RunShape) -> tuple[dict[str, list[Term]], list[str]]:
    """LLaMA's candidate peaks (activations and transients) and notes."""
    L, N, s, D = model.num_hidden_layers, run.tokens, run.s, model.hidden_size
    blk = block_saved(model, run)
    per_block = sum(t.bytes for t in blk)
    bwd = _block_backward(model, run)
    msaved = _model_saved(model, run)
    lfwd, lbwd, n = (_logits if run.teacher is None else _kd_logits)(model, run)
    res = 4 if run.full else s  # full fine-tuning: the fp32 embedding makes the residual stream fp32
    if run.checkpointing:
        kept = [Term(f"block inputs x {L} (checkpointing)", L * N * D * res, f"{L} x N x D x {res}")]
        fwd = _block_forward(model, run)
        worst = fwd if sum(t.bytes for t in fwd) > sum(t.bytes for t in bwd) else bwd
        grads_moment = kept + [Term("one block recomputed", per_block, "block_saved")] + worst
    else:
        kept = [Term(f"saved activations x {L} blocks", L * per_block, f"{L} x {per_block / N:,.0f} B per token")]
        grads_moment = kept + bwd
    copies = _weight_copies(model, run, L, head=True)  # the forward's: with checkpointing too (autocast's cache)
    blocks_copies = _weight_copies(model, run, 1 if run.checkpointing else L, head=False)  # a recompute: its own
    moments = {
        "end of forward (loss forward)": msaved + kept + lfwd + copies,
        "loss backward": msaved + kept + lbwd + copies,
        "last block backward": [t for t in msaved if "final norm" not in t.name] + grads_moment + blocks_copies,
    }
    if run.full:
        for name, grads in _full_grads(model, run).items():
            moments[name] = moments.get(name, []) + grads
    trainable = sum(trainable_tensors(model, run)) * DTYPE_BYTES[run.adapter_dtype]
    notes = []
    if run.dpo_reference in ("base", "snapshot"):
        # no_grad forward before the policy's: at most one block's tensors alive at a time
        r = run if run.reference_rows in (None, run.rows) else replace(run, rows=run.reference_rows, targets=None)
        one = Term("reference forward: one block (no grad)", sum(t.bytes for t in block_saved(model, r)),
                   "block_saved, freed as it goes" + (f"; {r.rows} rows" if r is not run else ""))
        ref = (_model_saved(model, r) if r is not run else msaved) + [one] + (_logits(model, r)[0] if r is not run
                                                                               else lfwd)
        if run.dpo_reference == "snapshot":
            ref.append(Term("reference: live adapter values kept aside", trainable, "clone of the adapter tensors"))
        moments["DPO reference forward"] = ref
    if run.teacher is not None:
        moments["teacher forward (no grad)"] = teacher_forward(run)
        _, kl = _kd_captured(model, run)
        if kl:  # one layer's KL at a time, after the KD chunks
            chunk = [t for t in lfwd if t.name.startswith("loss: KD chunk")]
            moments["attention KL (loss forward)"] = msaved + kept + [t for t in lfwd if t not in chunk] + kl + copies
    if model.n_rep > 1:
        notes.append("GQA: repeat_kv copies of k and v are counted (SDPA keeps the repeated tensors)")
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
    `gate_up_proj` (D -> 2F), which LLaMA-named targets select (as `minitrain.lora` reads them).
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


# ----------------------------------------------------------------------------- T5


@dataclass(frozen=True)
class T5Shape:
    """A T5 checkpoint's dims, under HF's `config.json` names (`models/t5.py`).

    v1.0: `feed_forward_proj="relu"` (`wi -> relu -> wo`), head tied to `shared` (the decoder
    output is scaled by d_model**-0.5 first: a scalar product, which keeps nothing for backward);
    v1.1 / FLAN-T5: "gated-gelu" (`gelu(wi_0 x) * wi_1 x -> wo`), own `lm_head`. Either way the head
    is a plain `nn.Linear` (`output_projection`), so a frozen one takes the loss's frozen-head path.
    """

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_decoder_layers: int
    num_heads: int
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    relative_attention_num_buckets: int = 32
    dropout_rate: float = 0.1
    model_type: str = "t5"
    is_encoder_decoder: ClassVar[bool] = True
    EMBEDDINGS: ClassVar[tuple[str, ...]] = ("shared", "encoder.embed_tokens", "decoder.embed_tokens")

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> "T5Shape":
        """From a T5 `config.json` dict (transformers' T5Config defaults for the fields it may leave out)."""
        kw: dict[str, Any] = {}
        for k, default in (("vocab_size", 32128), ("d_model", 512), ("d_kv", 64), ("d_ff", 2048), ("num_layers", 6),
                           ("num_heads", 8), ("relative_attention_num_buckets", 32)):
            v = d.get(k, default)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UserError(f"{where}: {k}: {v!r} is not a positive integer — not a T5 config.json")
            kw[k] = v
        dec = d.get("num_decoder_layers")
        if dec is not None and (not isinstance(dec, int) or isinstance(dec, bool) or dec <= 0):
            raise UserError(f"{where}: num_decoder_layers: {dec!r} is not a positive integer — fix the value")
        ff = d.get("feed_forward_proj", "relu")
        if not isinstance(ff, str) or not ff:
            raise UserError(f"{where}: feed_forward_proj: {ff!r} — use 'relu' (T5 v1.0) or 'gated-gelu' (v1.1)")
        return cls(**kw, num_decoder_layers=dec or kw["num_layers"], feed_forward_proj=ff,
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
                   dropout_rate=float(d.get("dropout_rate", 0.1) or 0.0))

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def inner(self) -> int:
        return self.num_heads * self.d_kv

    @property
    def is_gated(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    def linears(self, decoder: bool) -> dict[str, tuple[int, int]]:
        """One encoder (decoder) block's linears, by their name in the block: name -> (in, out)."""
        D, inner, F = self.d_model, self.inner, self.d_ff
        attn = ["layer.0.SelfAttention"] + (["layer.1.EncDecAttention"] if decoder else [])
        out: dict[str, tuple[int, int]] = {}
        for a in attn:
            out.update({f"{a}.q": (D, inner), f"{a}.k": (D, inner), f"{a}.v": (D, inner), f"{a}.o": (inner, D)})
        ff = f"layer.{len(attn)}.DenseReluDense"
        out.update({f"{ff}.{w}": (D, F) for w in (("wi_0", "wi_1") if self.is_gated else ("wi",))})
        out[f"{ff}.wo"] = (F, D)
        return out

    def adapted(self, run: RunShape, decoder: bool) -> list[str]:
        """The block linears LoRA wraps for the run's target suffixes (`q`, `wi_0`, ... or all-linear)."""
        if "all-linear" in run.lora_targets:
            return list(self.linears(decoder))
        return [n for n in self.linears(decoder) if any(_matches(n, t) for t in run.lora_targets)]

    def _stacks(self) -> tuple[tuple[int, bool], tuple[int, bool]]:
        return (self.num_layers, False), (self.num_decoder_layers, True)

    def num_params(self) -> int:
        D, V = self.d_model, self.vocab_size
        linears = sum(L * sum(i * o for i, o in self.linears(dec).values()) for L, dec in self._stacks())
        norms = (2 * self.num_layers + 3 * self.num_decoder_layers + 2) * D
        return linears + V * D * (1 if self.tie_word_embeddings else 2) + norms + self._bias_tables()

    def _bias_tables(self) -> int:
        return 2 * self.relative_attention_num_buckets * self.num_heads  # block 0 of each stack

    def describe(self) -> str:
        return (f"{self.num_layers} encoder + {self.num_decoder_layers} decoder layers, d_model {self.d_model}, "
                f"{self.feed_forward_proj} d_ff {self.d_ff}, vocab {self.vocab_size:,}"
                + (", tied head" if self.tie_word_embeddings else ""))

    # -- persistent terms

    def weight_terms(self, run: RunShape) -> list[Term]:
        """Block linears (by format), shared embedding (+ lm_head when untied), norms, position-bias tables."""
        s, D, V = run.s, self.d_model, self.vocab_size
        b, f = _linears_bytes([(i, o, L) for L, dec in self._stacks() for i, o in self.linears(dec).values()], run)
        heads = 1 if self.tie_word_embeddings else 2
        norms = 2 * self.num_layers + 3 * self.num_decoder_layers + 2
        return [Term("weights: block linears", b, f),
                Term("weights: embeddings + head", heads * V * D * s,
                     f"{heads} x {V:,} x {D:,} x {s} B" + (" (tied)" if heads == 1 else "")),
                Term("weights: norms", norms * D * s, f"{norms} x {D:,} x {s} B"),
                Term("weights: relative position bias", self._bias_tables() * s,
                     f"2 stacks x {self.relative_attention_num_buckets} buckets x {self.num_heads} heads x {s} B")]

    def trainable_tensors(self, run: RunShape) -> list[int]:
        """LoRA A and B of every adapted linear; `shared` / `lm_head` / final norms in modules_to_save."""
        out = []
        for L, dec in self._stacks():
            lin = self.linears(dec)
            for name in self.adapted(run, dec):
                i, o = lin[name]
                out += [run.rank(i, o) * i, o * run.rank(i, o)] * L
        full = set()  # a tied head is `shared` itself: one tensor
        for m in run.modules_to_save:
            if any(_matches(e, m) for e in self.EMBEDDINGS):
                full.add("shared")
            if _matches("lm_head", m):
                full.add("shared" if self.tie_word_embeddings else "lm_head")
            if _matches("encoder.final_layer_norm", m) or _matches("decoder.final_layer_norm", m):
                full.add(m)
        return out + [self.d_model if n.endswith("final_layer_norm") else self.vocab_size * self.d_model
                      for n in sorted(full)]

    def adapted_summary(self, run: RunShape) -> str:
        return (f"{len(self.adapted(run, False))} linears x {self.num_layers} encoder blocks + "
                f"{len(self.adapted(run, True))} x {self.num_decoder_layers} decoder blocks")

    # -- activations

    def _tokens(self, run: RunShape) -> tuple[int, int]:
        """(encoder tokens, decoder tokens) of one micro-batch."""
        return run.rows * run.seq, run.rows * (run.target_seq or run.seq)

    def _own_copies(self, run: RunShape) -> bool:
        """Whether every adapter keeps its own copy of its input (autocast casts, or lora_dropout)."""
        return run.cast_copies or run.lora_dropout > 0

    def _kept_inputs(self, run: RunShape, decoder: bool) -> set[str]:
        """Linear inputs kept once and shared when adapters do not copy them (and int8 bases keep theirs)."""
        names = set(self.linears(decoder)) if run.quantize == "int8" else set()
        if not self._own_copies(run):
            names |= set(self.adapted(run, decoder))
        kept = {_t5_input(n) for n in names}
        if not self.is_gated and self.dropout_rate == 0:
            kept.discard("ff")  # relu keeps its output, wo's input, already
        return kept

    def block_saved(self, run: RunShape, decoder: bool) -> list[Term]:
        """What one encoder (decoder) block keeps for backward, read off the autograd graph of
        `models/t5.py` + `minitrain/lora.py` (no checkpointing; the test enumerates it).

        Per query token (n = rows x source length in the encoder, rows x target length in the
        decoder), s = compute bytes, m = a dropout mask's bytes per element, I = heads x d_kv,
        F = d_ff, k = keys per query (self: the block's own length, cross: the source length):

        - D x 4 + 4 per layer norm (2, decoder 3): its fp32 input (`x.float()`, kept by `pow`), rsqrt;
        - attention: q, k, v (3 x I x s; cross-attention's k and v are source-length rows, per
          decoder block); per key and head: softmax's fp32 probs (4) and their compute-dtype copy
          that `probs @ v` keeps when s < 4, or with dropout its mask and the dropped probs (m + s);
        - feed-forward: relu keeps its output (F x s), gated-gelu gelu's input, its output and
          wi_1's output (3 x F x s); with dropout + a mask (F x m) and D x m per residual branch;
        - inputs of the adapted linears: fp32 runs without lora_dropout share them (q/k/v read one
          normed x, o the attention output, wi* another normed x, wo the feed-forward product,
          cross-attention k/v the encoder output, counted once per run in `_model_saved`); under
          autocast (fp32 adapters) or with lora_dropout every adapter keeps its own copy (x s, + a
          fp32-input mask with lora_dropout); B's input (r x s); under autocast each adapter's
          A and B weights cast to the compute dtype (r x (in + out) x s, per block).
        """
        s, D, inner, F, H, r = run.s, self.d_model, self.inner, self.d_ff, self.num_heads, run.lora_r
        enc_n, dec_n = self._tokens(run)
        n, keys = (dec_n, run.target_seq or run.seq) if decoder else (enc_n, run.seq)
        drop = self.dropout_rate > 0
        m = run.mask_bytes(s)
        per_key = 4 + ((m + s) if drop else (s if s < 4 else 0))
        sub = 3 if decoder else 2
        terms = [Term("norm inputs (fp32) + rsqrt", n * sub * (D * 4 + 4), f"{sub} x (D x 4 + 4) per token"),
                 Term("self-attention q, k, v", n * 3 * inner * s, "3 x I x s per token"),
                 Term("self-attention probs", n * H * keys * per_key, f"heads x {keys} keys x {per_key} B per token")]
        if decoder:
            terms += [Term("cross-attention q (+ k, v over the source)", (dec_n + 2 * enc_n) * inner * s,
                           "I x s per target token + 2 x I x s per source token"),
                      Term("cross-attention probs", n * H * run.seq * per_key,
                           f"heads x {run.seq} source keys x {per_key} B per token")]
        ff = 3 if self.is_gated else 1
        terms.append(Term("feed-forward " + ("gelu in, out, wi_1 out" if self.is_gated else "relu out"),
                          n * (ff * F * s + (F * m if drop else 0)), f"{ff} x F x s" + (" + F x m" if drop else "")
                          + " per token"))
        if drop:
            terms.append(Term("dropout masks (residual branches)", n * sub * D * m, f"{sub} x D x {m} per token"))
        rows = {"h_sa": n, "attn_sa": n, "h_ca": n, "attn_ca": n, "enc": enc_n, "h_ff": n, "ff": n}
        width = {"h_sa": D, "attn_sa": inner, "h_ca": D, "attn_ca": inner, "enc": D, "h_ff": D, "ff": F}
        adapted = self.adapted(run, decoder)
        lin = self.linears(decoder)
        inputs = [_t5_input(name) for name in adapted]
        if self._own_copies(run):
            mask = run.mask_bytes(DTYPE_BYTES[run.adapter_dtype]) if run.lora_dropout > 0 else 0
            b = sum(rows[k] * width[k] * (s + mask) for k in inputs)
            how = "own copy per adapter" + (f" + lora_dropout mask ({mask} B)" if mask else "")
        else:
            b, how = 0, "shared"
        shared = self._kept_inputs(run, decoder) - {"enc"}
        b += sum(rows[k] * width[k] * s for k in shared)
        if b:
            terms.append(Term("linear inputs kept for adapter / int8 grads", b, f"{how}, x {s} B"))
        if adapted:
            terms.append(Term("LoRA B inputs", sum(rows[k] for k in inputs) * r * s,
                              f"{len(adapted)} x r x {s} per row"))
        if run.cast_copies and adapted:
            terms.append(Term("LoRA weights cast by autocast", sum(r * sum(lin[x]) for x in adapted) * s,
                              "r x (in + out) x s per adapter"))
        return terms

    def _model_saved(self, run: RunShape) -> list[Term]:
        """Kept once per forward, outside the blocks: batch tensors, the two final norms (+ dropout
        masks), and the encoder output when cross-attention adapters share it."""
        s, D = run.s, self.d_model
        enc_n, dec_n = self._tokens(run)
        terms = [Term("batch tensors (ids, masks, labels)", (2 * enc_n + 3 * dec_n) * 8,
                      "2 x int64 per source + 3 per target token"),
                 Term("encoder final norm input (fp32)", enc_n * (D * 4 + 4), "D x 4 + 4 per source token"),
                 Term("decoder final norm input (fp32)", dec_n * (D * 4 + 4), "D x 4 + 4 per target token")]
        if self.dropout_rate > 0:
            m = run.mask_bytes(s)
            terms.append(Term("final dropout masks", (enc_n + dec_n) * D * m, f"D x {m} per token"))
        if "enc" in self._kept_inputs(run, decoder=True):
            terms.append(Term("encoder output (cross-attention adapters' input)", enc_n * D * s,
                              "source tokens x D x s"))
        return terms

    def _bias(self, run: RunShape, decoder: bool) -> Term:
        """The fp32 attention bias (position bias + mask) every block of a stack takes as an input:
        rows x heads x length^2 (the encoder's without a padding mask: one for all rows), and the
        decoder's cross-attention mask (rows x source)."""
        if decoder:
            T = run.target_seq or run.seq
            return Term("decoder attention biases (fp32, block inputs)",
                        run.rows * (self.num_heads * T * T + run.seq) * 4, "rows x (heads x T^2 + S) x 4")
        return Term("encoder attention bias (fp32, block input)",
                    (run.rows if run.mask else 1) * self.num_heads * run.seq ** 2 * 4, "rows x heads x S^2 x 4")

    def _block_backward(self, run: RunShape, decoder: bool) -> list[Term]:
        """One block's backward working set beyond its saved tensors (measured on the CPU): the larger
        of the feed-forward's (2 x F x s, F x 4 for an adapted wo under autocast) and the attention's
        (per key and head: the probs' gradient in fp32 and the scores' gradient, 2 x 4, + s when
        s < 4; less the feed-forward's saved tensors, freed by then as backward runs the block in
        reverse), plus the incoming gradient of the residual (D x s)."""
        s, D, F, H = run.s, self.d_model, self.d_ff, self.num_heads
        enc_n, dec_n = self._tokens(run)
        n = dec_n if decoder else enc_n
        keys = max(run.target_seq or run.seq, run.seq) if decoder else run.seq
        cast = run.cast_copies and any(x.endswith(".wo") for x in self.adapted(run, decoder))
        ff = max(2 * F * s, F * 4 if cast else 0)
        attn = max(0, H * keys * (8 + (s if s < 4 else 0)) - (3 if self.is_gated else 1) * F * s)
        terms = [Term("block backward: " + ("feed-forward" if ff >= attn else "attention") + " grads",
                      n * (max(ff, attn) + D * s), f"max({ff:,}, {attn:,}) + D x s B per token")]
        return terms + self._dequantized(run)

    def _block_forward(self, run: RunShape, decoder: bool) -> list[Term]:
        """One block's forward working set beyond what it keeps, when checkpointing recomputes it: the
        scores before softmax (fp32, + their compute-dtype matmul output when s < 4) or the
        feed-forward's product / fp32 adapter cast (F x s, F x 4), plus the output (D x s)."""
        s, D, F, H = run.s, self.d_model, self.d_ff, self.num_heads
        enc_n, dec_n = self._tokens(run)
        n = dec_n if decoder else enc_n
        keys = max(run.target_seq or run.seq, run.seq) if decoder else run.seq
        wo = any(x.endswith(".wo") for x in self.adapted(run, decoder))
        ff = F * s + (F * 4 if wo and run.cast_copies else 0)
        attn = H * keys * (4 + (s if s < 4 else 0))
        work = Term("block forward (recompute) working set", n * (max(ff, attn) + D * s),
                    f"max({ff:,}, {attn:,}) + D x s B per token")
        return [work] + self._dequantized(run)

    def _dequantized(self, run: RunShape) -> list[Term]:
        if run.quantize != "nf4":
            return []
        big = max(i * o for i, o in self.linears(True).values())
        return [Term("4-bit weight dequantized for a matmul", big * run.s, "largest linear x s")]

    def _recomputed(self, run: RunShape, saved: list[Term], decoder: bool) -> list[Term]:
        """Checkpointing: one block's saved tensors recomputed, + its larger forward or backward working set."""
        fwd, bwd = self._block_forward(run, decoder), self._block_backward(run, decoder)
        worst = fwd if sum(t.bytes for t in fwd) > sum(t.bytes for t in bwd) else bwd
        name = "decoder" if decoder else "encoder"
        return [Term(f"one {name} block recomputed", sum(t.bytes for t in saved), "block_saved")] + worst

    def moments(self, run: RunShape) -> tuple[dict[str, list[Term]], list[str]]:
        """The candidate peaks: end of forward and loss backward (everything the two stacks keep +
        the chunked loss over the decoder's tokens), the first decoder and the first encoder block
        backward (the decoder's activations are gone by the encoder's)."""
        s, D = run.s, self.d_model
        Le, Ld = self.num_layers, self.num_decoder_layers
        enc_n, dec_n = self._tokens(run)
        enc, dec = self.block_saved(run, False), self.block_saved(run, True)
        enc_b, dec_b = sum(t.bytes for t in enc), sum(t.bytes for t in dec)
        msaved = self._model_saved(run)
        lfwd, lbwd, _ = _logits(self, replace(run, seq=run.target_seq or run.seq))
        batch = [t for t in msaved if t.name.startswith("batch")]
        if run.checkpointing:
            enc_kept = [Term(f"encoder block inputs x {Le} (checkpointing)", Le * enc_n * D * s,
                             f"{Le} x N_src x D x {s}"), self._bias(run, False)]
            dec_kept = [Term(f"decoder block inputs x {Ld} (checkpointing)", Ld * dec_n * D * s,
                             f"{Ld} x N_tgt x D x {s}")]
            if not any(t.name.startswith("encoder output") for t in msaved):
                dec_kept.append(Term("encoder output (decoder blocks' input)", enc_n * D * s, "N_src x D x s"))
            dec_kept.append(self._bias(run, True))
            dec_moment, enc_moment = self._recomputed(run, dec, True), self._recomputed(run, enc, False)
        else:
            enc_kept = [Term(f"saved activations x {Le} encoder blocks", Le * enc_b,
                             f"{Le} x {enc_b / enc_n:,.0f} B per source token")]
            dec_kept = [Term(f"saved activations x {Ld} decoder blocks", Ld * dec_b,
                             f"{Ld} x {dec_b / dec_n:,.0f} B per target token")]
            dec_moment, enc_moment = self._block_backward(run, True), self._block_backward(run, False)
        enc_grad = Term("grad of the encoder output (summed over cross-attentions)", enc_n * D * s, "N_src x D x s")
        moments = {
            "end of forward (loss forward)": msaved + enc_kept + dec_kept + lfwd,
            "loss backward": msaved + enc_kept + dec_kept + lbwd,
            "last decoder block backward": [t for t in msaved if not t.name.startswith("decoder final")]
                                           + enc_kept + dec_kept + dec_moment + [enc_grad],
            "last encoder block backward": batch + enc_kept + enc_moment + [enc_grad],
        }
        notes = []
        if self.dropout_rate > 0 or run.lora_dropout > 0:
            notes.append(f"dropout_rate={self.dropout_rate}, lora_dropout={run.lora_dropout}: dropout masks counted "
                         f"({run.mask_bytes(1)} B per element on {run.device})")
        return moments, notes


def _t5_input(name: str) -> str:
    """Which activation a T5 block linear reads (`layer.1.EncDecAttention.k` -> the encoder output)."""
    leaf = name.rsplit(".", 1)[-1]
    if "DenseReluDense" in name:
        return "ff" if leaf == "wo" else "h_ff"
    cross = "EncDecAttention" in name
    if leaf == "o":
        return "attn_ca" if cross else "attn_sa"
    if cross:
        return "h_ca" if leaf == "q" else "enc"
    return "h_sa"



# ----------------------------------------------------------------------------- from a recipe config


def run_shape(cfg: Any, *, device: str = "cuda", seq: int | None = None, targets: int | None = None) -> RunShape:
    """The `RunShape` a recipe config trains with on `device` (worst case: every row `max_len` long;
    seq2seq configs: every source `max_len`, every target `max_target_len` long).

    DPO configs (with `beta` and `precompute_ref`) forward 2 x batch_size rows and have a
    reference: `precomputed` with precompute_ref, `snapshot` when continuing an adapter
    (init_adapter), else `base` (adapters disabled). `loss_type` orpo / cpo / simpo: the same
    rows and no reference (`none`). KTO configs (`desirable_weight`): batch_size rows with a
    graph, and a reference forward of 2 x batch_size rows (the rows and their KL rows).
    """
    precision = getattr(cfg, "precision", "auto")
    if precision == "auto":
        compute = "bf16" if device == "cuda" else "fp32"
    else:
        compute = precision
    is_dpo = hasattr(cfg, "beta") and hasattr(cfg, "precompute_ref")
    is_kto = is_dpo and hasattr(cfg, "desirable_weight")
    ref = None
    if is_dpo:
        ref = "precomputed" if cfg.precompute_ref else ("snapshot" if getattr(cfg, "init_adapter", "") else "base")
        if getattr(cfg, "loss_type", "") in ("orpo", "cpo", "simpo"):
            ref = "none"
    rows = cfg.batch_size * (2 if is_dpo and not is_kto else 1)
    feats = (len(cfg.feature_layers) or -1) if getattr(cfg, "feature_weight", 0.0) > 0 else 0  # empty: every layer
    attns = (len(cfg.attention_layers) or -1) if getattr(cfg, "attention_weight", 0.0) > 0 else 0
    return RunShape(rows=rows, seq=seq or cfg.max_len, target_seq=getattr(cfg, "max_target_len", None),
                    compute=compute, quantize=getattr(cfg, "quantize", "none"),
                    ternary_scale=getattr(cfg, "ternary_scale", "tensor"), lrc_rank=float(getattr(cfg, "lrc_rank", 0)),
                    lora_r=cfg.lora_r, lora_targets=tuple(cfg.lora_targets), lora_dropout=float(cfg.lora_dropout),
                    modules_to_save=tuple(getattr(cfg, "modules_to_save", ())),
                    checkpointing=bool(cfg.checkpointing), targets=targets, mask=True, dpo_reference=ref,
                    reference_rows=2 * rows if is_kto else None, device=device,
                    full=getattr(cfg, "finetune", "lora") == "full", ema=getattr(cfg, "ema_decay", 0.0) > 0,
                    teacher=teacher_shape(cfg), teacher_quantize=getattr(cfg, "teacher_quantize", "none"),
                    kd_top_k=getattr(cfg, "top_k", 0) if getattr(cfg, "teacher", "") else 0, kd_features=feats,
                    kd_attention=attns)


def teacher_shape(cfg: Any) -> "ModelShape | None":
    """A distillation config's teacher (`teacher=` folder's config.json), or None: not
    distillation, or a folder the plan cannot read (loading it reports that in its own words)."""
    folder = getattr(cfg, "teacher", "")
    if not folder:
        return None
    try:
        shape = shape_from_hf(json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, UserError, TypeError, KeyError):
        return None
    return None if shape.is_encoder_decoder else shape


def suggestions(model: ModelShape, run: RunShape, batch_size: int, grad_accum: int) -> list[tuple[str, int, int]]:
    """What to change to use less memory: (the keys to set, the predicted saving, the new peak)."""
    base = predict(model, run).peak
    out: list[tuple[str, int, int]] = []

    def add(keys: str, new: RunShape) -> None:
        peak = predict(model, new).peak
        if peak < base:
            out.append((keys, base - peak, peak))

    if run.full:
        add("finetune=lora", replace(run, full=False))
    elif run.quantize == "none":
        add("quantize=nf4", replace(run, quantize="nf4"))
    elif run.quantize == "int8":
        add("quantize=nf4", replace(run, quantize="nf4"))
    if not run.checkpointing:
        add("checkpointing=true", replace(run, checkpointing=True))
    if run.compute == "fp32":
        add("precision=bf16", replace(run, compute="bf16"))
    per_row = run.rows // batch_size
    b = batch_size
    while b > 1:
        b //= 2
        add(f"batch_size={b} grad_accum={grad_accum * batch_size // b} (same effective batch)",
            replace(run, rows=b * per_row, reference_rows=run.reference_rows and run.reference_rows * b // batch_size))
    if run.dpo_reference in ("base", "snapshot"):
        add("precompute_ref=true", replace(run, dpo_reference="precomputed"))
    if run.teacher is not None and run.teacher_quantize == "none":
        add("teacher_quantize=nf4", replace(run, teacher_quantize="nf4"))
    if run.teacher is not None and not run.kd_top_k:
        add("top_k=256", replace(run, kd_top_k=256))
    return out


def fmt_bytes(n: float) -> str:
    """Bytes as the larger unit that reads well: 512 B, 1.5 MiB, 6.12 GiB."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str) -> int:
    """`12GiB`, `12 GB`, `8000MiB`, `1.5GiB` -> bytes (GB = 1e9, GiB = 2**30; a bare number is GiB)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise UserError(f"--gpu-mem {text}: not a size — e.g. --gpu-mem 12GiB or --gpu-mem 24GB")
    value, unit = float(m.group(1)), (m.group(2) or "GiB").upper()
    scale = {"B": 1, "K": 1e3, "KB": 1e3, "KI": KiB, "KIB": KiB, "M": 1e6, "MB": 1e6, "MI": MiB, "MIB": MiB,
             "G": 1e9, "GB": 1e9, "GI": GiB, "GIB": GiB, "T": 1e12, "TB": 1e12, "TI": 2**40, "TIB": 2**40}[unit]
    return int(value * scale)


# ----------------------------------------------------------------------------- measuring (CPU tests)


def measure_peak_allocated(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(peak bytes allocated above the start while `fn()` runs, its result), on the CPU.

    Uses `torch.profiler`'s memory events (every CPU allocator allocation and free, in order):
    the running sum of their sizes is the bytes allocated since the start, and its maximum is
    the peak, like `torch.cuda.max_memory_allocated` minus what was allocated before. Frees of
    blocks allocated before the start are not reported by the profiler, so the figure never
    counts down below memory it did not see allocated.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type().name == "CPU")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, result
