"""The memory of one rank under torchrun: `parallel=fsdp` (FSDP2) and `parallel=ddp`.

`predict` sends a run of `RunShape.world` > 1 ranks, or any `parallel=fsdp` run, here. Each rank
forwards its share of the global micro-batch (`minitrain.train`: `indices[rank::world]`, so rank 0
has the most, ceil(rows / N)); its activations are the one-device plan's at those rows. The
planned rank is rank 0, the largest. What differs:

ddp (`minitrain.parallel.distributed.all_reduce_sum`): every rank holds the whole model, adapters,
gradients and optimizer state; at the optimizer step the gradients are summed over ranks in flat
buckets of about `minitrain.parallel.distributed.BUCKET_BYTES` (a bucket closes once it reaches that size, so the largest is up
to one tensor more): one bucket's `torch.cat` copy is alive beside the gradients.

fsdp (`minitrain.parallel.fsdp.shard`: `fully_shard` on each block of `model.block_types`, then
on the root, the embeddings and the head by rows outside it; torch 2.13's FSDP2, read off
`torch/distributed/fsdp/_fully_shard/`):

- persistent, 1/N: FSDP2 shards dim 0 of every parameter, padded to a multiple of N, so a rank
  holds ceil(rows / N) rows of each (a norm of D values: ceil(D / N)); frozen base weights and
  trained tensors alike. A quantized base is held by rows (`minitrain.adapters.quant_rows`; Gemma 4's root holds
  a linear the loader quantizes too, `ROOT_LINEARS`): nf4 as
  (out, in / 2) bytes of codes + (out, in / 64) fp32 scales (double quantization's nested scales
  stored dequantized), int8 as (out, in) int8 + (out,) fp32 scales; sharded the same way.
  The sharded gradients (one flat reduce-scatter output per block, padded) and AdamW's two moments
  (zeros_like of rank 0's shard, ceil(rows / N) rows) follow the trained tensors.
- the embeddings and the head (`minitrain.parallel.fsdp.shard_vocab`, when both are plain: no LoRA on them, no
  soft cap; `vocab_sharded`) are not FSDP2's: cut by rows of the vocabulary the same way (rank 0's
  ceil(V / N) rows), never gathered while the head is frozen. The lookup gathers every rank's ids
  and sums each rank's rows' part (N x the micro-batch's embeddings, a few MiB); the loss scores
  every rank's target rows over this rank's columns (`_vocab_terms`: the other ranks' rows and
  their gradients, a logits block of more rows). A trained head (full fine-tuning,
  modules_to_save) is gathered whole for the loss, from its forward to the end of its backward,
  and its whole gradient reduce-scattered there.
- gathered while computing: the root (what no block holds: the final norm; the embeddings and the
  head too when they are not sharded by rows) is
  all-gathered at the start of the forward and not resharded after it (FSDP2 keeps the root
  gathered, since the backward needs it at once) until the end of the backward; its all-gather
  output is kept until the first block's copy-out, so the root is there twice for a moment. A block is
  all-gathered in its pre-forward: a flat all-gather output, copied out into the unsharded
  parameters; in the forward that flat output is kept until the next block's copy-out (to overlap
  it with the next all-gather), so two blocks' worth are alive while a block computes. In the
  backward each block prefetches the one before it: its own unsharded parameters + the next one's
  all-gather output, two blocks again. With one rank, the unsharded parameters are a copy of the
  shard (no all-gather buffer is kept). On the CPU, gloo's all-gather gathers into a flat tensor of
  its own and copies it into FSDP2's output: one block more while a block is gathered.
- gradients: a block's gradients are made whole (unsharded, fp32) by autograd, then copied into a
  reduce-scatter input of the same size, whose output is this rank's 1/N; the input is kept until
  the next block's reduce-scatter. The root's gradients stay whole until the end of the backward,
  then are reduce-scattered the same way (full fine-tuning: the final norm's; the head's and the
  embeddings' too when they are the root's; sharded by rows, the embeddings' are made 1/N).
- the optimizer step updates the shards: AdamW's foreach temporaries are 1/N.

A mixture-of-experts block (`minitrain.plan.moe`, `minitrain.plan.gpt_oss`) holds its experts' 3-D weights, router
and expert adapters too, sharded by their first dim (E: ceil(E / N) experts a rank); quantized (QLoRA), each expert
weight is its codes and scales with E first (`_experts`), sharded the same way. A block's module in
`modules_to_save` (a router: `gate`, Gemma 4's `router`) trains its own tensors there, sharded as the rest
(`saved_by`); `apply_lora`'s frozen copy of each (`Applied.saved`, what `disable_adapters` puts back) is a plain
tensor outside FSDP2, whole on every rank in the load dtype. So with the embeddings, the head or the final norm in
`modules_to_save`: the trained tensor is the sharded one, its frozen copy whole. Blocks that differ (Qwen's
dense layers among the sparse ones) are each their own, and the gathered block is the largest one. A hybrid's
blocks differ by kind too (Qwen3.5's DeltaNet and attention layers, Gemma 4's kv-shared ones: each block's
`block_vectors` and `block_tensors`), and a root may hold more than the vocabulary (Gemma 4's per-layer
embeddings: `root_tensors`).

A multimodal folder (`minitrain.plan.vision`: Qwen3.5's, Gemma 4's) keeps its tower in FSDP2's root (`fsdp.shard`
wraps only the language model's blocks): the tower's parameters, by their shapes (`root_tensors`), are 1/N shards
and gathered whole with the root; rank 0's image tokens are its share of the run's.

Not modelled under fsdp: T5 (the plan covers the decoder-only families there), the reference
model of DPO / KTO snapshots and a distillation teacher are counted whole (as one process); buffers (Gemma 4's
layer scalars, its tower's clip bounds) are whole on every rank and not counted. Refused (`check_run`): a multimodal
folder's full fine-tuning on several ranks (its trained tower's gradients in the root: not measured) and its
`quantize=` under fsdp (the tower's linears are quantized by rows too, which the tower's terms count in the compute dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from minitrain.plan.run_shape import NF4_BLOCK, DTYPE_BYTES, Plan, RunShape, Term, fmt_bytes, linears_bytes

if TYPE_CHECKING:
    from minitrain.plan.decoder import ModelShape


# the root's linears beside the head (`root_tensors`), which the loader quantizes as it does the blocks' linears
ROOT_LINEARS = ("model.per_layer_model_projection",)  # Gemma 4's projection of the per-layer inputs


@dataclass(frozen=True)
class Tensor:
    """One parameter: its shape (dim 0 is what FSDP2 shards), bytes per element, and whether it trains (`saved`: as
    a module of `modules_to_save`, whose frozen copy `apply_lora` keeps). A quantized weight is one flat row of its
    bytes (`elem` 1)."""

    name: str
    shape: tuple[int, ...]
    elem: int
    trainable: bool = False
    saved: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def bytes(self) -> int:
        return self.numel * self.elem

    def shard_bytes(self, world: int) -> int:
        """Bytes of one rank's shard: ceil(dim 0 / N) rows (FSDP2 pads dim 0 to a multiple of N)."""
        rows = -(-self.shape[0] // world)
        return rows * (self.numel // self.shape[0]) * self.elem

    def padded_bytes(self, world: int) -> int:
        """Bytes of the whole tensor as FSDP2 gathers it: N shards of `shard_bytes`."""
        return world * self.shard_bytes(world)


def per_rank(n: int, world: int) -> int:
    """Rank 0's share of n things dealt `indices[rank::world]`: ceil(n / world)."""
    return -(-n // world)


def local_run(run: RunShape) -> RunShape:
    """The run one rank computes: its share of the rows (and targets), as a world of one."""
    N = run.world
    return replace(run, world=1, parallel="ddp", rows=per_rank(run.rows, N),
                   targets=None if run.targets is None else per_rank(run.targets, N),
                   real_tokens=None if run.real_tokens is None else per_rank(run.real_tokens, N),
                   reference_rows=run.reference_rows and per_rank(run.reference_rows, N),
                   image_tokens=None if run.image_tokens is None else per_rank(run.image_tokens, N),
                   sample_rows=per_rank(run.sample_rows, N))


def vocab_sharded(model: ModelShape, run: RunShape) -> bool:
    """Whether `minitrain.parallel.fsdp.shard_vocab` takes the embeddings and the head out of FSDP2's root (cut by
    rows of the vocabulary, never gathered for a frozen head): a plain embedding and a plain head (not
    soft-capped, no LoRA on either); a tied pair shares its fate."""
    from minitrain.plan.decoder import matches

    adapted = lambda name: any(matches(name, t) for t in run.lora_targets) if not run.full else False  # noqa: E731
    return getattr(model, "plain_head", True) and not adapted("lm_head") and not adapted("model.embed_tokens")


def parameters(model: ModelShape, run: RunShape) -> tuple[list[Tensor], list[list[Tensor]]]:
    """(the root's tensors, each block's tensors), as `fully_shard` groups them: each block holds its
    linears (in the run's format), norms, biases and adapters (an MoE's experts, router and expert adapters
    too: `block_tensors`); the root holds the rest, the embeddings and the head among them (`vocab`: which of
    the root's are those). Blocks alike are one list L times; a model planned block by block (an MoE's dense
    layers) has each block's own."""
    from minitrain.plan.decoder import matches

    full = run.full
    s = 4 if full else run.s  # the loader's dtype: fp32 master weights for full fine-tuning
    a = DTYPE_BYTES[run.adapter_dtype]
    D, V, L = model.hidden_size, model.vocab_size, model.num_hidden_layers
    views = [model.block_view(i) for i in range(L)]
    blocks = [_block(views[0], run)] * L if all(v is model for v in views) else [_block(v, run) for v in views]
    root = [Tensor("embed_tokens", (V, D), s, full)]
    if not model.tie_word_embeddings:
        root.append(Tensor("lm_head", (V, D), s, full))  # (names: `vocab` below)
    root.append(Tensor("norm", (D,), s, full))
    for name, shape, trained in model.root_tensors(run):
        if name in ROOT_LINEARS:  # (out, in): quantized as a block's linears are
            root += _linear(name, shape[1], shape[0], run)
        else:
            root.append(Tensor(name, shape, a if trained and not full else s, trained))
    if not full:  # the embeddings, the head (tied: the embeddings) or the final norm in modules_to_save
        modules = {"embed_tokens": ("model.embed_tokens",) + (("lm_head",) if model.tie_word_embeddings else ()),
                   "lm_head": ("lm_head",), "norm": ("model.norm",)}
        root = [_trained(t, run) if any(matches(n, m) for n in modules.get(t.name, ()) for m in run.modules_to_save)
                else t for t in root]
    return root, blocks


def _trained(t: Tensor, run: RunShape) -> Tensor:
    """`t` trained in place as a module of `modules_to_save` (in the adapters' dtype)."""
    return replace(t, trainable=True, elem=DTYPE_BYTES[run.adapter_dtype], saved=True)


def _block(model: ModelShape, run: RunShape) -> list[Tensor]:
    """One block's tensors (the shape is that block's view)."""
    from minitrain.plan.decoder import adapted_linears

    full = run.full
    s = 4 if full else run.s
    a = DTYPE_BYTES[run.adapter_dtype]
    block = [t for name, (i, o) in model.linears().items() for t in _linear(name, i, o, run)]
    block += [Tensor(n, (d,), s, full) for n, d in model.block_vectors()]
    experts = {f"{model.EXPERTS}.{n}" for n in model.expert_weights()} if getattr(model, "has_experts", False) else ()
    for name, shape, trained in model.block_tensors(run):
        if name in experts and run.quantize in ("nf4", "int8") and not full:
            block += _experts(name, shape, run.quantize)
        else:
            block.append(Tensor(name, shape, a if trained and not full else s, trained))
    if not full:  # a module of the block in modules_to_save (an MoE's router): its own tensors train
        block = [_trained(t, run) if saved_by(t, run) else t for t in block]
    if not full:
        lin = model.linears()
        for name in adapted_linears(model, run.lora_targets):
            i, o = lin[name]
            r = run.rank(i, o)
            block += [Tensor(name + ".lora_A", (r, i), a, True), Tensor(name + ".lora_B", (o, r), a, True)]
    return block


def saved_by(t: Tensor, run: RunShape) -> bool:
    """Whether `t`, a block's tensor, belongs to a module `run.modules_to_save` names (`mlp.gate.weight`: `gate`)."""
    from minitrain.plan.decoder import matches

    owner = t.name.rpartition(".")[0]
    return any(matches(owner, m) for m in run.modules_to_save)


def _linear(name: str, i: int, o: int, run: RunShape) -> list[Tensor]:
    """A frozen linear's weight (in -> out) in the run's format (full fine-tuning: fp32, trained)."""
    if run.quantize == "none" or run.full:
        return [Tensor(name, (o, i), 4 if run.full else run.s, run.full)]
    if run.quantize == "nf4":  # `minitrain.adapters.quant_rows.NF4Rows`: codes and fp32 scales, by rows
        return [Tensor(name, (o, -(-i // 2)), 1), Tensor(name + ".absmax", (o, -(-i // NF4_BLOCK)), 4)]
    if run.quantize == "int8":  # `Int8Rows`: int8 rows and one fp32 scale per row
        return [Tensor(name, (o, i), 1), Tensor(name + ".scb", (o,), 4)]
    b, _ = linears_bytes([(i, o, 1)], run)  # (ternary is refused under fsdp: 1/N of its bytes)
    return [Tensor(name, (b,), 1)]


def _experts(name: str, shape: tuple[int, ...], kind: str) -> list[Tensor]:
    """A quantized expert weight (E, out, in) as `minitrain.adapters.quant_experts.QuantizedExpertWeight` holds it,
    E first: nf4 (E, out x in / 2) bytes of codes + (E, out x in / 64) fp32 scales; int8 (E, out, in) + (E, out)."""
    E, o, i = shape
    if kind == "nf4":
        return [Tensor(name, (E, o * i // 2), 1), Tensor(name + ".absmax", (E, -(-o * i // NF4_BLOCK)), 4)]
    return [Tensor(name, (E, o, i), 1), Tensor(name + ".scale", (E, o), 4)]


def vocab(root: list[Tensor]) -> list[Tensor]:
    """The root's vocabulary matrices: the embeddings and the head."""
    from minitrain.plan.decoder import matches

    return [t for t in root if matches("lm_head", t.name) or matches("model.embed_tokens", t.name)]


def _sum(tensors: list[Tensor], how: str, world: int = 1) -> int:
    if how == "bytes":
        return sum(t.bytes for t in tensors)
    if how == "shard":
        return sum(t.shard_bytes(world) for t in tensors)
    return sum(t.padded_bytes(world) for t in tensors)


def _grad(t: Tensor, run: RunShape) -> Tensor:
    """A trained tensor's gradient: fp32 (the trained tensors are fp32)."""
    return replace(t, elem=DTYPE_BYTES[run.adapter_dtype] if not run.full else 4)


def fsdp_plan(model: ModelShape, run: RunShape, local: Plan) -> Plan:
    """Rank 0's plan under FSDP2 from `local`, the plan of one device computing rank 0's rows."""
    N, L = run.world, model.num_hidden_layers
    every_root, blocks = parameters(model, run)
    outside = vocab(every_root) if vocab_sharded(model, run) else []  # minitrain's, by rows: never gathered whole
    root = [t for t in every_root if t not in outside]  # FSDP2's root
    every = every_root + [t for b in blocks for t in b]
    trained = [t for t in every if t.trainable]
    grads = [_grad(t, run) for t in trained]
    root_grads = [_grad(t, run) for t in root if t.trainable]
    # the gathered block and its gradients: the largest block's (every block's, when they are alike)
    block = max(blocks, key=lambda b: _sum(b, "padded", N))
    block_grads = max(([_grad(t, run) for t in b if t.trainable] for b in blocks), key=lambda g: _sum(g, "padded", N))
    base = [t for t in every if not t.trainable]
    n_train = sum(t.numel for t in trained)
    persistent = [
        Term("weights: 1/N shard (FSDP2)", _sum(base, "shard", N),
             f"ceil(rows / {N}) rows of each frozen tensor ({sum(t.numel for t in base):,} params"
             + (f", {run.quantize} bytes" if run.quantize != "none" and not run.full else "") + ")"),
        Term("trained tensors: 1/N shard", _sum(trained, "shard", N),
             f"{n_train:,} params, ceil(rows / {N}) rows each" + (" (fp32 master weights)" if run.full else "")),
        Term("optimizer (AdamW): 1/N shard", 2 * _sum([replace(t, elem=4) for t in trained], "shard", N)
             + 4 * len(trained), f"2 fp32 moments of each shard + {len(trained)} steps"),
    ]
    shard_grads = Term("gradients: 1/N shard", _sum(grads, "shard", N), "reduce-scatter outputs, fp32")
    if not run.full:
        persistent.append(shard_grads)
    copies = [t for t in every if t.saved]
    if copies:  # `apply_lora` keeps each a frozen copy of its base value (`Applied.saved`), a plain tensor
        persistent.append(Term("modules_to_save: frozen base copies (whole)", sum(t.numel for t in copies) * run.s,
                               f"{len(copies)} tensors outside FSDP2, whole on every rank"))
    for t in local.persistent:  # what FSDP does not shard here
        if t.name.startswith("teacher") or t.name.startswith("DPO reference"):
            persistent.append(t)
        elif t.name.startswith("EMA"):
            persistent.append(Term(t.name + " (1/N shard)", _sum(grads, "shard", N), "fp32 copy of the shards"))
    root_full = _sum(root, "padded", N)
    gloo = int(run.device == "cpu" and N > 1)  # measured: gloo's all-gather fills a flat tensor of its own first
    block_full = _sum(block, "padded", N)
    root_term = Term("FSDP: root gathered (" + ("final norm" if outside else "embeddings, head, final norm") + ")",
                     root_full, "whole, from the forward to the end of the backward")
    loss_terms, head_grads = _vocab_terms(model, run, local, outside)
    one = Term("FSDP: one block gathered", block_full, "the next block's all-gather output" if N > 1
               else "the block's parameters (a copy of the shard)")
    two = Term("FSDP: two blocks gathered", 2 * block_full,
               "this block's parameters + the next one's all-gather output") if N > 1 else one
    gathering = [Term("FSDP: blocks while one is all-gathered", (2 + gloo) * block_full,
                      "the last one's + the one being gathered" + (" + gloo's flat copy of it" if gloo else ""))]
    if N == 1:
        gathering = [one]
    block_rs = _sum(block_grads, "padded", N)
    moments: dict[str, list[Term]] = {}
    for name, terms in local.moments.items():
        terms = list(terms)
        if name == "optimizer step":
            terms = [Term("AdamW temporaries: 1/N shard", _sum(grads, "shard", N) if run.optimizer_temps else 0,
                          "1 x trainable shards (foreach)")
                     if t.name == "AdamW temporaries" else shard_grads if t.name == "gradients" else t for t in terms]
            moments[name] = terms
        elif name == "last block backward":
            moments.update(_backward_moments(local, terms, root_term, gathering, two, one, block_rs,
                                             _sum(block_grads, "shard", N), N, L, head_grads))
        else:
            moments[name] = terms + [root_term] + loss_terms.get(name, []) + ([two] if name.startswith("GRPO") else [])
    # the last block's forward: every block's saved tensors so far, one block all-gathered
    fwd = local.moments.get("end of forward (loss forward)", [])
    kept = [t for t in fwd if not t.name.startswith("loss") and not t.name.startswith("teacher")]
    moments["last block forward (FSDP: all-gather)"] = kept + [root_term] + gathering
    if N > 1:  # the root's all-gather output is kept until the first block's copy-out
        batch = [t for t in kept if t.name.startswith(("batch tensors", "RoPE", "attention mask"))]
        moments["first block forward (FSDP: all-gather)"] = batch + [
            root_term, Term("FSDP: the root's all-gather output", root_full, "kept until the first block's copy-out"),
            Term("FSDP: the first block's all-gather output", (1 + gloo) * block_full,
                 "+ gloo's flat copy of it" if gloo else "")]
    if root_grads:  # the root's reduce-scatter, after every block's (its parameters resharded first)
        whole = _sum(root_grads, "padded", N)
        vocab_shards = _sum([_grad(t, run) for t in outside if t.trainable], "shard", N)
        block_shards = sum(_sum([_grad(t, run) for t in b if t.trainable], "shard", N) for b in blocks) + vocab_shards
        moments["end of backward (FSDP: the root's reduce-scatter)"] = [
            Term("gradients: the blocks' 1/N shards", block_shards,
                 f"{L} blocks" + (" + embeddings, head" if outside else "")),
            Term("gradients: the root's, whole", whole, "embeddings, head, final norm (fp32)"),
            Term("FSDP: reduce-scatter input + output", whole + whole // N, "the root's gradients, copied + 1/N")]
    peak = max(moments, key=lambda k: sum(t.bytes for t in moments[k]))
    notes = list(local.notes) + [(f"per rank of {N} (parallel=fsdp): rank 0's share, {run_rows(run)}; "
                                  f"gathered: root {fmt_bytes(root_full)}, one block {fmt_bytes(block_full)}")]
    return Plan(persistent, moments, peak, notes)


def _vocab_terms(model: ModelShape, run: RunShape, local: Plan, outside: list[Tensor]
                 ) -> tuple[dict[str, list[Term]], list[Term] | None]:
    """What the embeddings and the head sharded by rows (`outside`) add to the loss's moments, and the
    head's gradients during the blocks' backward (None: the one-device plan's).

    A frozen head is never gathered: every rank scores the target rows of every rank over its columns of
    the vocabulary (`minitrain.objectives.losses._sharded_frozen_head_logprobs`): the other ranks' rows
    and their gradients (2 x (N - 1) x n x D x s), and a logits block of up to N x n rows. A trained
    head is gathered whole for the loss (`distributed.gathered`: from the loss forward to the end of
    its backward), its whole gradient reduce-scattered then: the blocks' backward holds a 1/N shard."""
    N = run.world
    if not outside or N == 1:
        return {}, None
    from minitrain.objectives.losses import frozen_head_block

    fwd = local.moments.get("end of forward (loss forward)", [])
    per_token = model.hidden_size * run.s
    n = next((t.bytes // per_token for t in fwd if t.name == "loss: gathered target rows"), 0)
    tied = model.tie_word_embeddings
    head = [t for t in outside if t.name.endswith("lm_head") or (t.name == "embed_tokens" and tied)]
    trained = [t for t in head if t.trainable]
    if trained:
        whole = Term("head gathered whole (trained: for the loss)", sum(t.bytes for t in trained),
                     "from the loss forward to the end of its backward")
        grads = [Term("gradients: the head's 1/N shard", _sum([_grad(t, run) for t in trained], "shard", N),
                      "reduce-scattered after the loss backward")]
        grads += [t for t in local.moments.get("loss backward", []) if t.name.startswith("gradients")
                  and t.name != "gradients: head, final norm"]
        return {"end of forward (loss forward)": [whole], "loss backward": [whole]}, grads
    V, s = model.vocab_size, run.s
    one, cols = frozen_head_block(n, V, run.device, low=s < 4)
    every, _ = frozen_head_block(N * n, V, run.device, low=s < 4)
    extra = [Term("loss: every rank's target rows (sharded head)", 2 * (N - 1) * n * per_token,
                  f"and their gradients: 2 x {N - 1} x n x D x s"),
             Term("loss: logits block of every rank's rows", (every - one) * cols * (4 + (s if s < 4 else 0)),
                  f"{every:,} rows instead of {one:,}")]
    return {"end of forward (loss forward)": extra}, None


def _backward_moments(local: Plan, terms: list[Term], root: Term, gathering: list[Term], two: Term, one: Term,
                      block_rs: int, block_shard: int, N: int, L: int,
                      head_grads: list[Term] | None = None) -> dict[str, list[Term]]:
    """The backward of block i (L - 1 first, down to 0) in three moments: its pre-backward (the block
    before it being all-gathered), its backward (two blocks gathered, its gradients whole) and its
    reduce-scatter (its parameters resharded, its saved tensors freed). From block L - 2 on, the
    reduce-scatter input of the block after it is still alive (FSDP2 frees it at the next
    reduce-scatter), and the blocks done hold their gradients' 1/N shards; the saved activations of the
    blocks above are freed. Each moment is planned at the block where it is largest."""
    work = [t for t in terms if t.name.startswith(("block backward", "4-bit", "ternary"))]
    full_grads = [t for t in terms if t.name.startswith("gradients")]  # full fine-tuning: head, norm, one block
    kept = [t for t in terms if t not in work and t not in full_grads]
    head = head_grads if head_grads is not None else [
        t for t in local.moments.get("loss backward", []) if t.name.startswith("gradients")]
    whole = Term("gradients: this block's, whole", block_rs, "before its reduce-scatter")

    def at(i: int, *, freed: bool = False) -> list[Term]:
        left = i + (0 if freed else 1)  # blocks whose saved tensors are still alive
        out = [Term(t.name.replace(f"x {L} blocks", f"of {left} blocks (of {L})"), t.bytes * left // L, t.formula)
               if t.name.startswith("saved activations") else t for t in kept]
        out += head + [root]
        if i < L - 1:
            out.append(Term(f"gradients: 1/N shards of {L - 1 - i} blocks done", block_shard * (L - 1 - i),
                            "reduce-scatter outputs"))
            if not freed and block_rs:
                out.append(Term("FSDP: the block after's reduce-scatter input", block_rs, "kept until the next one"))
        return out

    rs = [Term("FSDP: reduce-scatter input + output", block_rs + block_rs // N,
               "this block's gradients copied whole + this rank's 1/N")] if block_rs else []
    candidates = {
        "pre-backward (FSDP: all-gather)": lambda i: at(i) + gathering,
        "backward": lambda i: at(i) + work + [whole, two],
        "reduce-scatter (FSDP)": lambda i: at(i, freed=True) + [whole, one] + rs,
    }
    out = {}
    for what, make in candidates.items():
        best = max(range(L), key=lambda i: sum(t.bytes for t in make(i)))
        label = "last block backward" if what == "backward" and best == L - 1 else (
            f"block {best} of {L} {what}" if best < L - 1 else f"last block {what}")
        out[label] = make(best)
    return out


def run_rows(run: RunShape) -> str:
    """'2 of 4 rows per micro-batch'."""
    return f"{per_rank(run.rows, run.world)} of {run.rows} rows per micro-batch"


def ddp_plan(model: ModelShape, run: RunShape, local: Plan) -> Plan:
    """Rank 0's plan under ddp: the whole model, its share of the rows, and at the step one
    all-reduce bucket's flat copy beside the gradients."""
    from minitrain.parallel.distributed import BUCKET_BYTES

    tensors = [n * DTYPE_BYTES[run.adapter_dtype if not run.full else "fp32"] for n in model.trainable_tensors(run)]
    largest = size = 0
    for b in tensors:  # a bucket closes once it holds BUCKET_BYTES or more
        if size >= BUCKET_BYTES:
            size = 0
        size += b
        largest = max(largest, size)
    moments = dict(local.moments)
    if run.world > 1:
        step = [t for t in local.moments["optimizer step"] if t.name != "AdamW temporaries"]
        moments["gradient all-reduce (ddp)"] = step + [
            Term("all-reduce bucket (flat copy)", largest,
                 f"the largest bucket: gradients in ~{fmt_bytes(BUCKET_BYTES)} buckets, {fmt_bytes(sum(tensors))} in all")]
    peak = max(moments, key=lambda k: sum(t.bytes for t in moments[k]))
    notes = list(local.notes) + [f"per rank of {run.world} (parallel=ddp): the whole model, {run_rows(run)}"]
    return Plan(list(local.persistent), moments, peak, notes)
