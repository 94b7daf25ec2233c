"""A model of a training run's peak GPU memory, from the model's `config.json` and the run's keys.

Plain functions over two small descriptions: `ModelShape` (the dims of a LLaMA / Mistral
checkpoint, read from `config.json` only, never the weights) and `RunShape` (micro-batch, length,
dtype, quantization, adapter, checkpointing, DPO reference mode). `predict(model, run)` returns a
`Plan`: every term in bytes with the formula it comes from, and the peak. `tools/plan.py` prints
it for a recipe; `tests/test_plan.py` checks it against peaks measured on the CPU.

What is counted, and how (s = bytes per element of the compute dtype: 2 for bf16, 4 for fp32):

- weights: float tensors in the base dtype; nf4 (bitsandbytes `Linear4bit`): 0.5 byte / param
  packed + one absmax per 64-block (fp32, or uint8 with double quantization plus a second level
  of one fp32 absmax per 256 blocks, a 256-entry fp32 code and an fp32 offset) + the 16-entry nf4
  code; int8 (`Linear8bitLt`): 1 byte / param + one fp32 scale per output row. Embeddings, norms
  and the (unquantized) head stay in the compute dtype.
- adapters: LoRA A (r x in) and B (out x r) per adapted linear, fp32; their gradients (fp32) and
  AdamW's two fp32 moments each (+ one fp32 `step` per tensor).
- activations: what autograd keeps for backward in `models/llama.py` + `minitrain/lora.py`, per
  block and per token (read off the autograd graph; see `block_saved`), the per-block inputs
  only under checkpointing plus one block recomputed, and the loss's chunked logits
  (`minitrain.losses.LOGITS_PER_CHUNK` logits per chunk, never the full `B x T x V`).
- transients at the peak moment: the logits chunk in forward / backward, one block's backward
  working set, a dequantized 4-bit weight in bitsandbytes' backward, the DPO reference forward.

The peak is the largest of those moments (end of forward, loss backward, first block backward,
reference forward, optimizer step), on top of what persists (weights, adapters, gradients and
AdamW state: the steady state from step 2 on). It models `torch.cuda.max_memory_allocated`; the
CUDA context and allocator slack come on top (`RESERVE_*`, used by the verdict).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

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
             "self_attn.o_proj": "attn", "mlp.gate_proj": "xn2", "mlp.up_proj": "xn2", "mlp.down_proj": "act"}


def logits_per_chunk(device: str = "cuda") -> int:
    """The loss's chunk size in logits on `device` (from `minitrain.losses`, so the plan follows the code)."""
    from minitrain.losses import logits_per_chunk as per_device

    return per_device(device)


# ----------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class ModelShape:
    """A LLaMA / Mistral checkpoint's dims, under HF's `config.json` names."""

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

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> "ModelShape":
        """From a `config.json` dict (HF's defaults for the fields it may leave out)."""
        kind = d.get("model_type")
        if kind not in ("llama", "mistral"):
            raise UserError(f"{where}: model_type {kind!r} — the memory plan models LLaMA / Mistral "
                            f"checkpoints only (T5 is not modelled yet)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if not isinstance(d.get(k), int)]
        if missing:
            raise UserError(f"{where}: missing {', '.join(missing)} — not a LLaMA / Mistral config.json")
        heads = d["num_attention_heads"]
        kv = d.get("num_key_value_heads", 8 if kind == "mistral" else None) or heads
        window = d.get("sliding_window", 4096 if kind == "mistral" else None) if kind == "mistral" else None
        return cls(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                   intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                   num_attention_heads=heads, num_key_value_heads=kv,
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                   sliding_window=window, model_type=kind)

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

    def num_params(self) -> int:
        D, V = self.hidden_size, self.vocab_size
        per_block = sum(i * o for i, o in self.linears().values()) + 2 * D
        return V * D * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_block + D


@dataclass(frozen=True)
class RunShape:
    """What one training micro-batch looks like to memory.

    rows: sequences per forward (SFT: batch_size; DPO: 2 x pairs, chosen and rejected together).
    seq: the padded length T (the worst case is max_len). targets: positions that get a loss
    (None: all of them, the worst case). compute: activation dtype (bf16 under autocast on a GPU).
    mask: whether an explicit attention mask is built (padding in the batch, or T > window);
    the plain-causal path builds none.
    """

    rows: int
    seq: int
    compute: str = "bf16"
    quantize: str = "none"  # none | nf4 | int8 (base linears; the head stays in float)
    double_quant: bool = True
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    adapter_dtype: str = "fp32"
    modules_to_save: tuple[str, ...] = ()
    checkpointing: bool = False
    targets: int | None = None
    mask: bool = True
    dpo_reference: str | None = None  # None: not DPO | base | snapshot | precomputed
    optimizer_temps: bool = True  # foreach AdamW temporaries (minitrain.optim; False: a fused optimizer)
    logits_chunk: int | None = None  # logits per chunk (None: minitrain.losses' value on `device`)
    device: str = "cuda"  # cuda | cpu: only the default logits chunk depends on it

    @property
    def s(self) -> int:
        return DTYPE_BYTES[self.compute]

    @property
    def tokens(self) -> int:
        return self.rows * self.seq

    @property
    def cast_copies(self) -> bool:
        """fp32 adapters under bf16 autocast: each adapter casts its input to fp32 and autocast
        casts it back, so each keeps its own compute-dtype copy of its input for backward."""
        return self.adapter_dtype != self.compute


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
    """Block linears (`self_attn.q_proj`, ...) that LoRA wraps for these target suffixes."""
    if "all-linear" in targets:
        return list(LINEARS)
    return [n for n in LINEARS if any(_matches(n, t) for t in targets)]


def nf4_bytes(numel: int, *, double_quant: bool = True, blocksize: int = NF4_BLOCK) -> int:
    """Bytes of one bitsandbytes nf4 weight: packed 4-bit values and its quantization constants."""
    blocks = -(-numel // blocksize)
    packed = -(-numel // 2)
    code = 16 * 4  # the nf4 value table
    if not double_quant:
        return packed + blocks * 4 + code
    blocks2 = -(-blocks // NF4_BLOCK2)
    return packed + blocks + blocks2 * 4 + NF4_BLOCK2 * 4 + 4 + code  # uint8 absmax, absmax2, code2, offset


def int8_bytes(in_features: int, out_features: int) -> int:
    """Bytes of one bitsandbytes int8 weight: int8 values + one fp32 absmax scale per output row."""
    return in_features * out_features + out_features * 4


def weight_terms(model: ModelShape, run: RunShape) -> list[Term]:
    """The base model's bytes: block linears (by format), embeddings + head, norms."""
    s = run.s  # the loader casts float tensors to the compute dtype (quantized runs too)
    L, D, V = model.num_hidden_layers, model.hidden_size, model.vocab_size
    lin = model.linears()
    numel = L * sum(i * o for i, o in lin.values())
    if run.quantize == "nf4":
        b = L * sum(nf4_bytes(i * o, double_quant=run.double_quant) for i, o in lin.values())
        f = (f"{numel:,} params x 0.5 B + absmax per {NF4_BLOCK}-block "
             + ("(uint8, double-quant) + 2nd level" if run.double_quant else "(fp32)"))
    elif run.quantize == "int8":
        b = L * sum(int8_bytes(i, o) for i, o in lin.values())
        f = f"{numel:,} params x 1 B + fp32 scale per row"
    else:
        b, f = numel * s, f"{numel:,} params x {s} B"
    heads = 1 if model.tie_word_embeddings else 2
    return [Term("weights: block linears", b, f),
            Term("weights: embeddings + head", heads * V * D * s,
                 f"{heads} x {V:,} x {D:,} x {s} B" + (" (tied)" if heads == 1 else "")),
            Term("weights: norms", (2 * L + 1) * D * s, f"{2 * L + 1} x {D:,} x {s} B")]


def trainable_tensors(model: ModelShape, run: RunShape) -> list[int]:
    """Numel of each trainable tensor: LoRA A and B of every adapted linear, modules_to_save."""
    lin = model.linears()
    out = []
    for name in adapted_linears(model, run.lora_targets):
        i, o = lin[name]
        out += [run.lora_r * i, o * run.lora_r] * model.num_hidden_layers
    D, V = model.hidden_size, model.vocab_size
    for m in run.modules_to_save:
        if _matches("lm_head", m) or _matches("model.embed_tokens", m):
            out.append(V * D)
        elif _matches("model.norm", m):
            out.append(D)
    return out


def adapter_terms(model: ModelShape, run: RunShape) -> list[Term]:
    """Adapters (fp32), their gradients (fp32) and AdamW state (two fp32 moments + a step each)."""
    tensors = trainable_tensors(model, run)
    n, k, a = sum(tensors), len(tensors), DTYPE_BYTES[run.adapter_dtype]
    named = adapted_linears(model, run.lora_targets)
    what = f"r={run.lora_r} on {len(named)} linears x {model.num_hidden_layers} blocks"
    if run.modules_to_save:
        what += f" + {','.join(run.modules_to_save)}"
    terms = [Term("adapters", n * a, f"{n:,} params x {a} B ({what})"),
             Term("gradients", n * a, f"{n:,} x {a} B"),
             Term("optimizer (AdamW)", n * 2 * 4 + k * 4, f"{n:,} x 2 moments x 4 B + {k} steps")]
    if run.dpo_reference == "snapshot":
        terms.append(Term("DPO reference: adapter snapshot", n * a, "frozen copy of the adapter tensors"))
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
    Hq, H = model.q_width, model.num_attention_heads
    Hk = Hq if model.n_rep > 1 else model.kv_width
    adapted = adapted_linears(model, run.lora_targets)
    lin = model.linears()
    width = {"xn": D, "attn": Hq, "xn2": D, "act": F}
    terms = [Term("norm inputs (fp32)", N * 2 * D * 4, "2 x D x 4 per token"),
             Term("attention q, k, v, out + lse", N * ((2 * Hq + 2 * Hk) * s + H * 4),
                  f"(2 Hq + 2 Hk{' (repeated)' if model.n_rep > 1 else ''}) x {s} + heads x 4 per token")]
    if run.mask:
        terms.append(Term("attention mask (float, per block)", run.rows * run.seq * run.seq * s, "rows x T x T x s"))
    terms.append(Term("SwiGLU gate, silu, up", N * 3 * F * s, "3 x F x s per token"))
    if run.cast_copies:
        kept = sum(lin[n][0] for n in adapted)  # one copy per adapter
        shared = {_INPUT_OF[n] for n in LINEARS if run.quantize == "int8"} - {"attn"}
    else:
        kept = 0
        shared = {_INPUT_OF[n] for n in adapted}
        if run.quantize == "int8":
            shared |= {_INPUT_OF[n] for n in LINEARS}
        shared -= {"attn"}  # the attention output is already counted (SDPA keeps it)
    kept += sum(width[k] for k in shared)
    if kept:
        terms.append(Term("linear inputs kept for adapter / int8 grads", N * kept * s,
                          f"{kept:,} x {s} B per token"
                          + (" (one copy per adapter: autocast)" if run.cast_copies else "")))
    if adapted:
        terms.append(Term("LoRA B inputs", N * len(adapted) * run.lora_r * s, f"{len(adapted)} x r x {s} per token"))
    return terms


def _block_backward(model: ModelShape, run: RunShape) -> list[Term]:
    """The working set of one block's backward beyond its saved tensors (measured on the CPU).

    The largest moment is in SwiGLU's backward: the gradients of its F-wide tensors (2 x F x s
    beyond what is freed as it goes), or, under autocast with an adapted down_proj, the fp32
    gradient of that adapter's input cast (F x 4), whichever is larger; plus the incoming
    gradient of the residual (D x s). A 4-bit base dequantizes its weight (in x out, compute
    dtype) to back-propagate through it, one linear at a time.
    """
    N, s, D, F = run.tokens, run.s, model.hidden_size, model.intermediate_size
    cast = run.cast_copies and "mlp.down_proj" in adapted_linears(model, run.lora_targets)
    width = max(2 * F * s, F * 4 if cast else 0)
    terms = [Term("block backward: SwiGLU grads", N * (width + D * s),
                  ("F x 4" if width > 2 * F * s else "2 x F x s") + " + D x s per token")]
    return terms + _dequantized(model, run)


def _block_forward(model: ModelShape, run: RunShape) -> list[Term]:
    """The working set of one block's forward beyond what it keeps: at down_proj, the SwiGLU
    product when nothing keeps it (F x s), the fp32 cast of it for an adapted down_proj under
    autocast (F x 4), and the output (D x s). Matters when checkpointing recomputes a block."""
    N, s, D, F = run.tokens, run.s, model.hidden_size, model.intermediate_size
    down = "mlp.down_proj" in adapted_linears(model, run.lora_targets)
    kept = (down and not run.cast_copies) or run.quantize == "int8"
    width = (0 if kept else F * s) + (F * 4 if down and run.cast_copies else 0) + D * s
    work = Term("block forward (recompute) working set", N * width, f"{width:,} B per token")
    return [work] + _dequantized(model, run)


def _dequantized(model: ModelShape, run: RunShape) -> list[Term]:
    if run.quantize != "nf4":
        return []
    big = max(i * o for i, o in model.linears().values())
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
    copy when s < 4 and logsumexp's fp32 temporary (measured: 8 B per logit in fp32, 10 in bf16).
    A frozen head (not trained, not adapted) computes the rows' gradient in that forward and keeps
    it (n x D x s); the backward only scales it. Any other head keeps the gathered rows for each
    chunk's checkpoint; its backward recomputes the forward, then holds the logits (s), the fp32
    gradient (4) and its compute-dtype copy when s < 4; plus the gradient of the gathered rows.
    """
    n = run.tokens if run.targets is None else min(run.targets, run.tokens)
    V, D, s = model.vocab_size, model.hidden_size, run.s
    per_chunk = run.logits_chunk or logits_per_chunk(run.device)
    c = min(n, max(64, per_chunk // V))
    gathered = Term("loss: gathered target rows", n * D * s, "n x D x s")
    rows_grad = Term("loss: grad of gathered rows", n * D * s, "n x D x s")
    fwd_per = s + (4 if s < 4 else 0) + 4
    fwd = [gathered, Term("loss: final hidden states", run.tokens * D * s, "N x D x s"),
           Term("loss: logits chunk (forward)", c * V * fwd_per, f"c={c:,} x V x {fwd_per} B")]
    if head_is_frozen(model, run):
        kept = Term("loss: rows' gradient made in forward", n * D * s, "n x D x s")
        return fwd + [kept], [kept, rows_grad], n
    bwd_per = max(fwd_per, s + 4 + (s if s < 4 else 0))  # the recompute, then the gradient
    bwd = [gathered, Term("loss: logits chunk (backward)", c * V * bwd_per, f"c={c:,} x V x {bwd_per} B"),
           rows_grad]
    return fwd, bwd, n


def head_is_frozen(model: ModelShape, run: RunShape) -> bool:
    """Whether the output projection is a plain frozen Linear (minitrain.losses' two-matmul path)."""
    trained = list(run.lora_targets) + list(run.modules_to_save)
    tied_embed = model.tie_word_embeddings and any(_matches("model.embed_tokens", m) for m in run.modules_to_save)
    return not (any(_matches("lm_head", m) for m in trained) or tied_embed)


def _scaled(terms: list[Term], k: int, name: str, formula: str) -> Term:
    return Term(name, k * sum(t.bytes for t in terms), formula)


def predict(model: ModelShape, run: RunShape) -> Plan:
    """The memory plan of one run: persistent terms and the activation terms at each candidate peak."""
    L, N, s, D = model.num_hidden_layers, run.tokens, run.s, model.hidden_size
    persistent = weight_terms(model, run) + adapter_terms(model, run)
    blk = block_saved(model, run)
    per_block = sum(t.bytes for t in blk)
    bwd = _block_backward(model, run)
    msaved = _model_saved(model, run)
    lfwd, lbwd, n = _logits(model, run)
    if run.checkpointing:
        kept = [Term(f"block inputs x {L} (checkpointing)", L * N * D * s, f"{L} x N x D x {s}")]
        fwd = _block_forward(model, run)
        worst = fwd if sum(t.bytes for t in fwd) > sum(t.bytes for t in bwd) else bwd
        grads_moment = kept + [Term("one block recomputed", per_block, "block_saved")] + worst
    else:
        kept = [Term(f"saved activations x {L} blocks", L * per_block, f"{L} x {per_block / N:,.0f} B per token")]
        grads_moment = kept + bwd
    moments = {
        "end of forward (loss forward)": msaved + kept + lfwd,
        "loss backward": msaved + kept + lbwd,
        "last block backward": [t for t in msaved if "final norm" not in t.name] + grads_moment,
    }
    trainable = sum(trainable_tensors(model, run)) * DTYPE_BYTES[run.adapter_dtype]
    moments["optimizer step"] = [Term("AdamW temporaries", trainable if run.optimizer_temps else 0,
                                      "1 x trainable (foreach)" if run.optimizer_temps else "fused: none")]
    notes = []
    if run.dpo_reference in ("base", "snapshot"):
        # no_grad forward before the policy's: at most one block's tensors alive at a time
        one = Term("reference forward: one block (no grad)", per_block, "block_saved, freed as it goes")
        ref = msaved + [one] + lfwd
        if run.dpo_reference == "snapshot":
            ref.append(Term("reference: live adapter values kept aside", trainable, "clone of the adapter tensors"))
        moments["DPO reference forward"] = ref
    peak = max(moments, key=lambda k: sum(t.bytes for t in moments[k]))
    if model.n_rep > 1:
        notes.append("GQA: repeat_kv copies of k and v are counted (SDPA keeps the repeated tensors)")
    return Plan(persistent, moments, peak, notes)


# ----------------------------------------------------------------------------- from a recipe config


def run_shape(cfg: Any, *, device: str = "cuda", seq: int | None = None, targets: int | None = None) -> RunShape:
    """The `RunShape` a recipe config trains with on `device` (worst case: every row `max_len` long).

    DPO configs (with `beta` and `precompute_ref`) forward 2 x batch_size rows and have a
    reference: `precomputed` with precompute_ref, `snapshot` when continuing an adapter
    (init_adapter), else `base` (adapters disabled).
    """
    precision = getattr(cfg, "precision", "auto")
    if precision == "auto":
        compute = "bf16" if device == "cuda" else "fp32"
    else:
        compute = precision
    is_dpo = hasattr(cfg, "beta") and hasattr(cfg, "precompute_ref")
    ref = None
    if is_dpo:
        ref = "precomputed" if cfg.precompute_ref else ("snapshot" if getattr(cfg, "init_adapter", "") else "base")
    rows = cfg.batch_size * (2 if is_dpo else 1)
    return RunShape(rows=rows, seq=seq or cfg.max_len, compute=compute, quantize=getattr(cfg, "quantize", "none"),
                    lora_r=cfg.lora_r, lora_targets=tuple(cfg.lora_targets),
                    modules_to_save=tuple(getattr(cfg, "modules_to_save", ())),
                    checkpointing=bool(cfg.checkpointing), targets=targets, mask=True, dpo_reference=ref,
                    device=device)


def suggestions(model: ModelShape, run: RunShape, batch_size: int, grad_accum: int) -> list[tuple[str, int, int]]:
    """What to change to use less memory: (the keys to set, the predicted saving, the new peak)."""
    base = predict(model, run).peak
    out: list[tuple[str, int, int]] = []

    def add(keys: str, new: RunShape) -> None:
        peak = predict(model, new).peak
        if peak < base:
            out.append((keys, base - peak, peak))

    if run.quantize == "none":
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
            replace(run, rows=b * per_row))
    if run.dpo_reference in ("base", "snapshot"):
        add("precompute_ref=true", replace(run, dpo_reference="precomputed"))
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
