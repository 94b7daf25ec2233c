"""What one training micro-batch looks like to memory (`RunShape`), what a plan is made of (`Term`,
`Plan`), and bytes: per element of a dtype, per quantized weight, and as text.

A `RunShape` is read from a recipe's config by `minitrain.plan.predict.run_shape`; the family
shapes (`minitrain.plan.decoder`, `minitrain.plan.t5`) turn it into terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any



KiB, MiB, GiB = 2**10, 2**20, 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NF4_BLOCK = 64  # quantize_hook's default blocksize
NF4_BLOCK2 = 256  # bitsandbytes' second-level block for double quantization
# outside `max_memory_allocated`: the CUDA context (+ cuBLAS / cuDNN workspaces), and the caching
# allocator's fragmentation, as a share of the allocated peak
RESERVE_CONTEXT = 600 * MiB
RESERVE_SLACK = 0.10


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
    seq, the worst case). On a CPU the decoder-only families run a padded batch of rows of at least
    `UNPADS_FROM` positions without its padding
    (`models.layers.Ragged`): their per-token terms then count the real tokens and, without a
    window shorter than seq, no mask is built (`predict` applies this; T5 ignores it). teacher:
    distillation's teacher (`distill_terms`), run frozen in the compute dtype (or
    `teacher_quantize`). image_tokens: a vision-language checkpoint's image placeholders among the
    rows' positions (`minitrain.plan.vision`; None: all of them, the worst case). world, parallel: under torchrun the plan is rank 0's
    (`minitrain.plan.sharded`): rows (and targets) stay the global micro-batch, which it splits.
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
    checkpointing: int | bool = False  # true: every block, N: the first N blocks (`checkpointed`)
    targets: int | None = None
    mask: bool = True
    dpo_reference: str | None = None  # None: not DPO | base | snapshot | precomputed | none (orpo, cpo, simpo)
    reference_rows: int | None = None  # rows of the no_grad reference forward (None: rows; KTO: 2 x rows)
    optimizer_temps: bool = True  # foreach AdamW temporaries (minitrain.optim; False: a fused optimizer)
    logits_chunk: int | None = None  # logits per chunk (None: minitrain.objectives.losses' value on `device`)
    full: bool = False  # finetune=full: every weight trains (no adapters; lora_* ignored)
    ema: bool = False  # ema_decay > 0: one more copy of the trained tensors (minitrain.ema)
    device: str = "cuda"  # cuda | cpu: the default logits chunk and the dropout mask's dtype depend on it
    real_tokens: int | None = None
    teacher: Any = None  # distillation: the teacher's ModelShape (its weights, forward and kept states)
    teacher_quantize: str = "none"  # distillation: the teacher's linears (teacher_quantize)
    kd_top_k: int = 0  # distillation: subset KD over the teacher's top-k tokens (0: the full vocabulary)
    kd_features: int = 0  # distillation: student layers whose hidden states are matched (-1: every layer)
    kd_attention: int = 0  # distillation: student layers whose attention is transferred (-1: every layer)
    sample_rows: int = 0  # GRPO: completions sampled per micro-batch (prompts x G), each with seq KV slots
    reward_model: Any = None  # GRPO's rewards=model:DIR: the reward model's ModelShape (its weights, its scoring)
    world: int = 1  # ranks under torchrun: the plan is rank 0's (`minitrain.plan.sharded`); rows stay the global batch
    parallel: str = "ddp"  # ddp: every rank holds the whole model | fsdp: FSDP2 shards it (`minitrain.plan.sharded`)
    image_tokens: int | None = None  # a vision-language model's image placeholders in the rows (None: every position)

    @property
    def s(self) -> int:
        return DTYPE_BYTES[self.compute]

    def rank(self, in_features: int, out_features: int) -> int:
        """The adapter rank of a linear: `lora_r`, or `lrc_rank` resolved as `minitrain.adapters.lrc.resolve_rank`."""
        if not self.lrc_rank:
            return self.lora_r
        from minitrain.adapters.lrc import resolve_rank  # (imports torch: only for LRC runs)

        return resolve_rank(self.lrc_rank, in_features, out_features)

    @property
    def rank_text(self) -> str:
        """`r=16`, or `lrc_rank=0.15 of each linear's full rank`."""
        if not self.lrc_rank:
            return f"r={self.lora_r}"
        return f"lrc_rank={self.lrc_rank:g}" + (" of each linear's full rank" if self.lrc_rank < 1 else "")

    def checkpointed(self, blocks: int) -> int:
        """How many of a model's `blocks` blocks run checkpointed (the first ones; `checkpointing`)."""
        from minitrain.config import checkpointed_blocks

        return checkpointed_blocks(self.checkpointing, blocks)

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
    """Bytes of one ternary weight (minitrain.adapters.ternary): packed 2-bit codes, ceil(in / 4) bytes a row,
    + the fp32 scale(s): one per tensor, or one per output row."""
    return out_features * -(-in_features // 4) + 4 * (out_features if scale == "channel" else 1)


def int8_bytes(in_features: int, out_features: int) -> int:
    """Bytes of one bitsandbytes int8 weight: int8 values + one fp32 absmax scale per output row."""
    return in_features * out_features + out_features * 4


def linears_bytes(linears: list[tuple[int, int, int]], run: RunShape) -> tuple[int, str]:
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


def fmt_bytes(n: float) -> str:
    """Bytes as the larger unit that reads well: 512 B, 1.5 MiB, 6.12 GiB."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
