"""Knowledge distillation: a student learns the teacher's next-token distributions (field report 001).

Per target token t, with student logits z and teacher logits u (both over the same vocabulary):

    kd(t) = T^2 * KL(p || q),   p = softmax(u / T),  q = softmax(z / T)      (forward KL, teacher -> student)
    ce(t) = -log softmax(z)[y_t]                                             (the usual LM loss, T = 1)
    loss  = kd_weight * sum_t kd(t) + ce_weight * sum_t ce(t),   count = number of target tokens

Hinton, Vinyals & Dean 2015, "Distilling the Knowledge in a Neural Network": soften both
distributions with a temperature T and multiply the KL by T^2, so that its gradient, which scales
as 1/T^2, keeps the same size relative to the CE term whatever T is. Everything is in log-space
and fp32 (`log_softmax` on both sides; rule 8): no `exp(logits / T)` that overflows at T = 3.

`top_k > 0` is subset KD: the teacher's k most likely tokens of each position, with both
distributions renormalised over that subset (the tail the teacher gives almost no mass is dropped).

What field report 001 got wrong, and how this file avoids it:

- the unit is the target token: `loss_sum` is summed over tokens and `count` is the number of
  target tokens, so the loop's normalisation over the accumulation window is exact (rule 2);
- every component is logged raw and weighted (`kd`, `ce`, `kd_weighted`, `ce_weighted`, per-token
  means), so a term that dominates shows at once instead of after 3000 steps;
- `ppl = exp(ce_sum / count)`: from the mean token CE, never from the mixed loss, a sum or a cap.
  In eval mode (`model.training` False, as in the loop's `evaluate`) the objective returns the
  student's token CE alone, so `eval/loss` is the student's LM loss and `eval/ppl` its perplexity;
- no `B x T x V` tensor for either model: logits are made `chunk` target positions at a time from
  the hidden states (as `minitrain.objectives.losses` does), each chunk under non-reentrant checkpointing
  with a lean custom backward, and the teacher runs under `no_grad` in eval mode.

Two more terms match the student's insides to the teacher's, on mapped layers (student layer i
with teacher layer j; `uniform_layer_map` is the default rule, `layer_map=i:j,...` overrides it):

    feature(t)   = mean over mapped i of  mse:    mean_d (P_i h_s^i(t) - h_t^j(t))_d^2
                                          cosine: 1 - cos(P_i h_s^i(t), h_t^j(t))
    attention(t) = mean over mapped i of  mean over head groups g of KL(A_t^j[g](t, .) || A_s^i[g](t, .))
    loss = kd_weight * sum kd + ce_weight * sum ce + feature_weight * sum feature
           + attention_weight * sum attention                     (sums over the same target tokens)

h^i(t) is the output of decoder layer i at position t (the residual stream); P_i a learned
`Linear(D_student, D_teacher, bias=False)` when the widths differ (trained with the student, in
fp32, saved beside the adapter or model: `save_projections`), the identity when they agree. A(t, .)
is the attention distribution of query t over the keys: 0 on padding and future keys on both
sides. Different head counts: G = gcd(H_student, H_teacher) groups of consecutive heads, each
side's heads averaged within a group (an average of distributions is a distribution), so equal
counts compare head by head and coprime counts compare the head-averaged distributions. Only the
mapped layers write their attention out (`models/llama.py`'s `attention_layers`); the other
layers keep SDPA. Every term is a per-target-token quantity summed over the same positions as
KD and CE, so the weights compare like with like and the loop's normalisation stays exact;
padding query positions count 0.

Report 001's feature term ran at 40x its intended share unnoticed. Each term is logged raw and
weighted, and after the first `balance_steps` steps the objective says once, in one line with the
figures, when a term's share of the loss is off from its weight's share by more than
`balance_factor`, with the weights that would give the intended shares at the measured scales.

Teacher and student must share a tokenizer: `check_same_tokenizer` compares the tokenizer files,
vocabulary tables, special ids and the encoding of a probe string, and refuses a mismatch
naming both folders (a KL between two vocabularies that do not line up trains on noise). Their
heads may score different numbers of ids (padded vocabularies, common between sizes of a family):
KD then runs over the ids both have (`shared_vocab`, the smaller head), each distribution
renormalised over them, and `check_ids_shared` refuses data holding an id beyond that range.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from minitrain import progress
from minitrain.parallel import distributed
from minitrain.data.collate import IGNORE_INDEX
from minitrain.errors import UserError
from minitrain.objectives.configs import TERMS, DistillConfig
from minitrain.objectives.losses import _vocab_size, chunked_cross_entropy_sum, default_chunk, shift_labels
from minitrain.text.tokenizer import Tokenizer

PROJECTIONS = "distill_projections"  # the student's submodule holding the feature projections
PROJECTIONS_FILE = "distill_projections.safetensors"  # where they are saved, beside the adapter or model


# ----------------------------------------------------------------------------- the per-token losses


class _KDAndCE(torch.autograd.Function):
    """Per-row `(ce, kd)` from student logits `z (n, V)`, fp32, with a lean backward.

    Teacher side: `u` is `(n, V')` teacher logits over the first V' <= V ids (full KD; V' < V when
    the teacher's head is smaller: the shared ids) or `(n, k)` teacher logits at the indices
    `idx (n, k)` (subset KD). Gradients (with q, p the tempered student / teacher
    distributions, over V or over the subset):

        d ce / dz = softmax(z) - onehot(y)          d kd / dz = T * (q - p)   (T^2 * (1/T) * (q - p))

    The backward builds one `(n, V)` tensor in place; autograd's graph of the same expression
    would hold four or five of them.
    """

    @staticmethod
    def forward(ctx, z: torch.Tensor, y: torch.Tensor, u: torch.Tensor, idx: torch.Tensor | None,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        zf = z.to(torch.promote_types(z.dtype, torch.float32))  # fp32 (fp64 stays fp64, for gradcheck)
        ce = torch.logsumexp(zf, dim=1) - zf.gather(1, y[:, None]).squeeze(1)  # (n,)
        zs = zf[:, : u.shape[1]] if idx is None else zf.gather(1, idx)  # (n, V') or (n, k)
        log_q = torch.log_softmax(zs / temperature, dim=1)
        log_p = torch.log_softmax(u.to(zf.dtype) / temperature, dim=1)
        p = log_p.exp()
        # p * (log p - log q), with 0 where p == 0 (0 * log 0 = 0, not NaN)
        kd = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(1) * temperature**2  # (n,)
        ctx.save_for_backward(z, y, u, idx)
        ctx.temperature, ctx.subset = temperature, idx is not None
        return ce, kd

    @staticmethod
    def backward(ctx, g_ce: torch.Tensor, g_kd: torch.Tensor):
        z, y, u, idx = ctx.saved_tensors
        T = ctx.temperature
        zf = z.to(torch.promote_types(z.dtype, torch.float32))
        grad = torch.softmax(zf, dim=1).mul_(g_ce[:, None])  # (n, V) fp32
        grad.scatter_add_(1, y[:, None], -g_ce[:, None].to(grad.dtype))  # softmax - onehot, times g_ce
        zs = zf[:, : u.shape[1]] if not ctx.subset else zf.gather(1, idx)
        q = torch.softmax(zs / T, dim=1)
        p = torch.softmax(u.to(zf.dtype) / T, dim=1)
        g = (q - p).mul_(T * g_kd[:, None].to(q.dtype))
        if ctx.subset:
            grad.scatter_add_(1, idx, g)
        else:
            grad[:, : u.shape[1]].add_(g)
        return grad.to(z.dtype), None, None, None, None


def kd_ce_from_logits(student_logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor, *,
                      temperature: float, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row `(ce, kd)`, fp32, for student logits `(n, Vs)`, teacher logits `(n, Vt)` and labels
    `(n,)` (no -100).

    KD runs over the ids both score (the first min(Vs, Vt)), each distribution renormalised over
    them; CE over all of the student's. `top_k > 0`: KD over the teacher's top-k tokens of each row
    (among the shared ids), both distributions renormalised over them. The teacher side carries
    no gradient.
    """
    teacher_logits = teacher_logits.detach()[:, : student_logits.shape[1]]
    idx = None
    if top_k:
        k = min(top_k, teacher_logits.shape[1])
        teacher_logits, idx = teacher_logits.topk(k, dim=1)  # (n, k) each
    return _KDAndCE.apply(student_logits, labels, teacher_logits, idx, float(temperature))


def _chunk_losses(s_head: nn.Module, h_s: torch.Tensor, y: torch.Tensor, t_head: nn.Module, h_t: torch.Tensor,
                  u_top: torch.Tensor | None, idx: torch.Tensor | None, temperature: float):
    """One chunk's `(ce, kd)`: student logits made here (recomputed in backward under checkpoint).

    Full KD makes the teacher's `(c, V)` logits here too, under `no_grad`, so they exist only while
    this chunk is computed; subset KD gets the teacher's `(c, k)` top-k logits and indices instead.
    """
    z = s_head(h_s)  # (c, V)
    if idx is None:
        with torch.no_grad():
            u = t_head(h_t)[:, : z.shape[1]]  # (c, V'): the ids both heads score
        return _KDAndCE.apply(z, y, u, None, temperature)
    return _KDAndCE.apply(z, y, u_top, idx, temperature)


def chunked_kd_ce(student_hidden: torch.Tensor, student_head: nn.Module, teacher_hidden: torch.Tensor,
                  teacher_head: nn.Module, targets: torch.Tensor, *, temperature: float, top_k: int = 0,
                  chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target-token `(ce, kd)` (n,) fp32 from hidden states, never holding all logits.

    student_hidden (..., D), teacher_hidden (..., Dt), targets (...) aligned with both (already
    shifted for causal models; -100: no target, never projected). KD runs over the ids both heads
    score (see `kd_ce_from_logits`). Rows come out in the order of
    the target positions in `targets.reshape(-1)`. `chunk`: target positions per chunk (default
    `minitrain.objectives.losses.default_chunk`).
    """
    flat_y = targets.reshape(-1)
    keep = (flat_y != IGNORE_INDEX).nonzero().squeeze(1)  # (n,)
    h_s = student_hidden.reshape(-1, student_hidden.shape[-1]).index_select(0, keep)  # (n, D)
    h_t = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).index_select(0, keep).detach()  # (n, Dt)
    y = flat_y.index_select(0, keep)
    chunk = chunk or default_chunk(student_head, h_s.device)
    track = torch.is_grad_enabled() and (h_s.requires_grad or any(p.requires_grad for p in student_head.parameters()))
    shared = _vocab_size(student_head)  # the teacher's extra ids (if any) are dropped; None: all
    student_head = distributed.gathered_call(student_head)  # (parallel=fsdp: gathered once, on every rank)
    if keep.numel() == 0:
        zero = student_hidden.new_zeros(0, dtype=torch.float32)
        return zero, zero
    ces, kds = [], []
    for start in range(0, h_s.shape[0], chunk):
        sl = slice(start, start + chunk)
        u_top = idx = None
        if top_k:
            with torch.no_grad():
                u = teacher_head(h_t[sl])[:, :shared]  # (c, V'): freed once its top-k is taken
                u_top, idx = u.topk(min(top_k, u.shape[1]), dim=1)  # (c, k) each
                del u
        args = (student_head, h_s[sl], y[sl], teacher_head, h_t[sl], u_top, idx, float(temperature))
        ce, kd = checkpoint(_chunk_losses, *args, use_reentrant=False) if track else _chunk_losses(*args)
        ces.append(ce)
        kds.append(kd)
    return torch.cat(ces), torch.cat(kds)


# ----------------------------------------------------------------------------- hidden states and attention


def feature_distance(student_h: torch.Tensor, teacher_h: torch.Tensor, kind: str = "mse") -> torch.Tensor:
    """Per-row distance (n,) fp32 between `(n, D)` hidden states (the student's already projected):
    `mse` the mean over D of the squared differences, `cosine` 1 - their cosine similarity."""
    a, b = student_h.float(), teacher_h.float()
    if kind == "mse":
        return (a - b).pow(2).mean(-1)
    if kind == "cosine":
        return 1 - F.cosine_similarity(a, b, dim=-1, eps=1e-8)
    raise UserError(f"feature_loss={kind}: must be mse or cosine — e.g. feature_loss=mse")


def head_groups(probs: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H, T, S) attention probabilities -> (B, groups, T, S): consecutive heads averaged."""
    B, H, T, S = probs.shape
    return probs.reshape(B, groups, H // groups, T, S).mean(2)


def attention_kl(student_probs: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """Per query `(B, T)` fp32: KL(teacher || student) of the attention distributions, averaged over
    G = gcd(H_student, H_teacher) groups of consecutive heads (each side averaged within a group).

    Both are `(B, H, T, S)` probabilities with 0 on masked keys; a key the teacher gives 0 adds 0
    (0 log 0 = 0). The student side is clamped at the smallest normal float before the log, so a
    probability that underflowed gives a large finite term, not inf.
    """
    g = math.gcd(student_probs.shape[1], teacher_probs.shape[1])
    s, t = head_groups(student_probs.float(), g), head_groups(teacher_probs.float().detach(), g)
    tiny = torch.finfo(torch.float32).tiny
    kl = torch.where(t > 0, t * (t.clamp_min(tiny).log() - s.clamp_min(tiny).log()), torch.zeros_like(t))
    return kl.sum(-1).mean(1)


def uniform_layer_map(n_student: int, n_teacher: int) -> dict[int, int]:
    """Student layer i -> teacher layer ceil((i + 1) * Lt / Ls) - 1: the teacher layer that ends the
    same fraction of the depth (the last meets the last; equal depths map i -> i)."""
    return {i: -(-(i + 1) * n_teacher // n_student) - 1 for i in range(n_student)}


def count_layers(model: nn.Module) -> int:
    """The model's repeated blocks (`block_types`, the model contract)."""
    return sum(isinstance(m, tuple(model.block_types)) for m in model.modules())


def map_layers(student: nn.Module, teacher: nn.Module, layers: Sequence[int] | None, layer_map: Sequence[str],
               key: str) -> dict[int, int]:
    """{student layer: teacher layer} for the student `layers` (negative: from the end; None: all),
    by the uniform rule unless `layer_map` ("i:j" strings) names the pair. `key` names the config
    key in errors."""
    ls, lt = count_layers(student), count_layers(teacher)
    pairs = uniform_layer_map(ls, lt)
    for item in layer_map:
        i, _, j = str(item).partition(":")
        try:
            i, j = int(i), int(j)
        except ValueError:
            raise UserError(f"layer_map: {item!r} is not student:teacher layer numbers — e.g. layer_map=0:1,1:3") \
                from None
        if not (0 <= i < ls and 0 <= j < lt):
            raise UserError(f"layer_map: {item} is out of range — the student has layers 0..{ls - 1}, the teacher "
                            f"0..{lt - 1}")
        pairs[i] = j
    chosen = range(ls) if layers is None else layers
    for i in chosen:
        if not -ls <= i < ls:
            raise UserError(f"{key}: layer {i} does not exist — the student has layers 0..{ls - 1} (or -{ls}..-1)")
    mapped = {i % ls: pairs[i % ls] for i in chosen}
    if key == "attention_layers":  # a linear-attention (Gated DeltaNet) layer has no attention probabilities
        for side, model, layer in [("student", student, i) for i in mapped] + [("teacher", teacher, j) for j in
                                                                               mapped.values()]:
            kinds = getattr(getattr(model, "config", None), "layer_types", None) or ()
            if layer < len(kinds) and kinds[layer] == "linear_attention":
                attending = [k for k, kind in enumerate(kinds) if kind != "linear_attention"]
                raise UserError(f"attention_layers: {side} layer {layer} is a linear-attention (Gated DeltaNet) "
                                f"layer, which has no attention probabilities — transfer attention on the {side}'s "
                                f"attention layers ({', '.join(map(str, attending))}: attention_layers= / layer_map=) "
                                f"or set attention_weight=0")
    return mapped


def captures_layers(model: nn.Module) -> bool:
    """Whether the model's forward takes `hidden_layers` / `attention_layers` (`model.captures_layers`,
    docs/contracts.md)."""
    return bool(getattr(model, "captures_layers", False))


def width(model: nn.Module) -> int:
    return model.input_embeddings.embedding_dim


def attach_projections(student: nn.Module, teacher: nn.Module, feature_map: Mapping[int, int], *,
                       seed: int = 0) -> nn.ModuleDict | None:
    """Give the student a learned `Linear(D_student, D_teacher, bias=False)` per mapped layer when the
    widths differ (None when they agree or nothing is mapped), as the submodule `distill_projections`
    (keys: the student layer), fp32 on the student's device, trainable: the optimizer, checkpoints
    and the gradient audit see them like any other trainable tensor. Initialised from `seed`
    (nn.Linear's default init) without touching the global RNG."""
    ds, dt = width(student), width(teacher)
    if ds == dt or not feature_map:
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        proj = nn.ModuleDict({str(i): nn.Linear(ds, dt, bias=False) for i in sorted(feature_map)})
    student.add_module(PROJECTIONS, proj.to(student.input_embeddings.weight.device))
    return proj


def take_projections(student: nn.Module) -> dict[str, torch.Tensor]:
    """The student's feature projections as whole fp32 CPU tensors (`<layer>.weight`; empty when it
    has none), taken off the student so that what is saved as the model is the model alone. Every
    rank calls it (FSDP: the shards are gathered)."""
    proj = getattr(student, PROJECTIONS, None)
    if proj is None:
        return {}
    tensors = {k: distributed.full_tensor(v.detach()).float().contiguous().cpu() for k, v in proj.state_dict().items()}
    delattr(student, PROJECTIONS)
    return tensors


def save_projections(tensors: Mapping[str, torch.Tensor], path: str | Path, feature_map: Mapping[int, int]) -> Path | None:
    """Write `take_projections`' tensors to `path` (safetensors, written to a temporary name and
    renamed; the layer map in the metadata). None, writing nothing, when there are none."""
    if not tensors:
        return None
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(dict(tensors), str(tmp), metadata={"format": "pt", "minitrain.layer_map": json.dumps(
        {str(i): j for i, j in feature_map.items()})})
    tmp.replace(path)
    return path


# ----------------------------------------------------------------------------- the loss balance


def balance_note(raw: Mapping[str, float], weights: Mapping[str, float], factor: float, steps: int) -> str | None:
    """One line when a term's share of the loss is off its weight's share by more than `factor`
    (x or 1/x), else None. `raw`: each term's mean per-token value over the first `steps` steps.

    Intended share of term k: w_k / sum w; actual: w_k r_k / sum_j w_j r_j. The weights
    w'_k = w_k * S / (W r_k) (S the actual total, W the sum of weights) give exactly the intended
    shares at these raw scales, with the same total loss: the line suggests them.
    """
    terms = [k for k in TERMS if weights.get(k, 0) > 0 and k in raw]
    total = sum(weights[k] * raw[k] for k in terms)
    wsum = sum(weights[k] for k in terms)
    if len(terms) < 2 or not math.isfinite(total) or total <= 0:
        return None
    off = []
    for k in terms:
        share, intended = weights[k] * raw[k] / total, weights[k] / wsum
        ratio = share / intended
        if ratio > factor or ratio < 1 / factor:
            off.append(f"{k} is {share * 100:.3g}% of the loss, its weight intends {intended * 100:.3g}% ({ratio:.3g}x)")
    if not off:
        return None
    scales = ", ".join(f"{k} {raw[k]:.4g}" for k in terms)
    fair = " ".join(f"{k}_weight={weights[k] * total / (wsum * raw[k]):.3g}" for k in terms if raw[k] > 0)
    return (f"distill: loss balance over the first {steps} steps is off (factor {factor:g}): {'; '.join(off)} "
            f"— the raw per-token terms have different scales ({scales}); weights giving the intended shares at "
            f"these scales: {fair}")


# ----------------------------------------------------------------------------- the objective


class DistillObjective:
    """`(student, batch) -> (loss summed over target tokens, target tokens, metrics)` for the loop.

    Training: `kd_weight * sum kd + ce_weight * sum ce + feature_weight * sum feature +
    attention_weight * sum attention` (module docstring); metrics are per-token means over the
    micro-batch: each term raw and `<term>_weighted` (feature / attention when their weight is
    positive), and `ppl = exp(ce)`. Eval mode (`student.training` False): the student's token CE
    alone (the loop's `eval/loss`, `eval/ppl`), with no teacher forward. The teacher runs in eval
    mode under `no_grad`, on the batch as given.

    `feature_map` / `attention_map`: {student layer: teacher layer} (`map_layers`); feature
    projections are the student's `distill_projections` (`attach_projections`). The first
    `balance_steps` steps of `micro_batches` training calls each (from construction or
    `restart_balance`) are watched for the loss balance (`balance_note`), said once through `log`.
    """

    def __init__(self, teacher: nn.Module, *, temperature: float, kd_weight: float, ce_weight: float,
                 top_k: int = 0, chunk: int | None = None, feature_weight: float = 0.0,
                 attention_weight: float = 0.0, feature_loss: str = "mse",
                 feature_map: Mapping[int, int] | None = None, attention_map: Mapping[int, int] | None = None,
                 balance_steps: int = 0, balance_factor: float = 4.0, micro_batches: int = 1,
                 log: Callable[[str], None] | None = None):
        if not temperature > 0:
            raise UserError(f"temperature={temperature}: must be > 0 — e.g. temperature=2.0")
        weights = {"kd": kd_weight, "ce": ce_weight, "feature": feature_weight, "attention": attention_weight}
        if any(w < 0 for w in weights.values()) or not any(w > 0 for w in weights.values()):
            raise UserError(", ".join(f"{k}_weight={w}" for k, w in weights.items()) + ": weights must be >= 0 and "
                            "not all 0 — e.g. kd_weight=0.5 ce_weight=0.5")
        if top_k < 0:
            raise UserError(f"top_k={top_k}: must be >= 0 (0: full vocabulary) — e.g. top_k=256")
        feature_distance(torch.zeros(1, 1), torch.zeros(1, 1), feature_loss)  # a bad kind: one error line
        self.feature_map = dict(feature_map or {}) if feature_weight > 0 else {}
        self.attention_map = dict(attention_map or {}) if attention_weight > 0 else {}
        for key, w, m in (("feature", feature_weight, self.feature_map), ("attention", attention_weight,
                                                                          self.attention_map)):
            if w > 0 and not m:
                raise UserError(f"{key}_weight={w}: no layers are mapped for it — name them ({key}_layers=...) "
                                f"or set {key}_weight=0")
        if (self.feature_map or self.attention_map) and not captures_layers(teacher):
            raise UserError("feature_weight / attention_weight: the teacher's model family does not return hidden "
                            "states or attention (hidden_layers / attention_layers) — set both weights to 0")
        teacher.eval()
        teacher.requires_grad_(False)
        self.teacher = teacher
        self.temperature, self.top_k, self.chunk = float(temperature), top_k, chunk
        self.weights = weights
        self.kd_weight, self.ce_weight = kd_weight, ce_weight
        self.feature_loss = feature_loss
        self.balance_steps, self.balance_factor, self.micro_batches = balance_steps, balance_factor, micro_batches
        self.log = log or progress.log
        self.restart_balance()

    def restart_balance(self, steps: int | None = None) -> None:
        """Watch the next `steps` (default `balance_steps`) steps' calls afresh. A recipe builds the
        objective with `balance_steps=0` and calls this after the gradient audit, whose forwards
        are not training steps."""
        self.balance_steps = self.balance_steps if steps is None else steps
        self._balance_left = self.balance_steps * self.micro_batches  # calls still to watch
        self._balance_sums = dict.fromkeys(TERMS, 0.0)
        self._balance_calls = 0

    @property
    def terms(self) -> tuple[str, ...]:
        """The terms this objective computes and logs (kd and ce always; the others when weighted)."""
        return tuple(t for t in TERMS if t in ("kd", "ce") or self.weights[t] > 0)

    def token_losses(self, student: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-target-token terms {name: (n,) fp32} for a causal batch (`input_ids`, `attention_mask`, `labels`)."""
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        targets = shift_labels(batch["labels"])
        inside = bool(self.feature_map or self.attention_map)  # capture the mapped layers (a `Captured` each)
        s_capture = {"hidden_layers": tuple(self.feature_map), "attention_layers": tuple(self.attention_map)}
        t_capture = {"hidden_layers": tuple(sorted(set(self.feature_map.values()))),
                     "attention_layers": tuple(sorted(set(self.attention_map.values())))}
        with torch.no_grad():
            t = self.teacher(ids, mask, **t_capture) if inside else self.teacher(ids, mask)
        s = student(ids, mask, **s_capture) if inside else student(ids, mask)
        ce, kd = chunked_kd_ce(s.hidden if inside else s, student.output_projection, t.hidden if inside else t,
                               self.teacher.output_projection, targets, temperature=self.temperature,
                               top_k=self.top_k, chunk=self.chunk)
        out = {"kd": kd, "ce": ce}
        if not inside:
            return out
        rows = (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)  # the target positions, as for kd / ce
        real = (torch.ones_like(targets) if mask is None or mask.dim() != 2 else mask).reshape(-1)[rows].float()
        if self.feature_map:
            proj = getattr(student, PROJECTIONS, None)
            terms = []
            for i, j in self.feature_map.items():
                hs = s.hidden_states[i].reshape(-1, s.hidden_states[i].shape[-1]).index_select(0, rows)  # (n, D)
                ht = t.hidden_states[j].reshape(-1, t.hidden_states[j].shape[-1]).index_select(0, rows)  # (n, Dt)
                if hs.shape[-1] != ht.shape[-1]:
                    if proj is None or str(i) not in proj:
                        raise UserError(f"feature_layers: student layer {i} is {hs.shape[-1]} wide, teacher layer "
                                        f"{j} {ht.shape[-1]} — attach_projections(student, teacher, feature_map) "
                                        f"first")
                    hs = proj[str(i)](hs.to(proj[str(i)].weight.dtype))
                terms.append(feature_distance(hs, ht, self.feature_loss))
            out["feature"] = torch.stack(terms).mean(0) * real
        if self.attention_map:
            terms = [attention_kl(s.attentions[i], t.attentions[j]).reshape(-1).index_select(0, rows)
                     for i, j in self.attention_map.items()]
            out["attention"] = torch.stack(terms).mean(0) * real
        return out

    def __call__(self, student: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any, dict[str, float]]:
        targets = shift_labels(batch["labels"])
        count = (targets != IGNORE_INDEX).sum()
        if not student.training:  # evaluation: the student as a language model
            hidden = student(batch["input_ids"], batch.get("attention_mask"))
            loss_sum, count = chunked_cross_entropy_sum(hidden, student.output_projection, targets, chunk=self.chunk)
            return loss_sum, count, {}
        losses = self.token_losses(student, batch)
        sums = {k: v.sum() for k, v in losses.items()}
        loss_sum = sum(self.weights[k] * v for k, v in sums.items() if self.weights[k] > 0)  # a 0 weight: no graph
        n = count.clamp(min=1).float()
        means = torch.stack([sums[k].detach() / n for k in self.terms])
        *raw, ppl = torch.cat([means, means[1:2].exp()]).tolist()  # one host sync; means[1] is ce
        values = dict(zip(self.terms, raw))
        metrics = {**values, **{f"{k}_weighted": self.weights[k] * v for k, v in values.items()}, "ppl": ppl}
        self._watch_balance(values)
        return loss_sum, count, metrics

    def _watch_balance(self, raw: Mapping[str, float]) -> None:
        """Sum the first calls' raw terms; after the last watched call, say once if the balance is off."""
        if self._balance_left <= 0:
            return
        for k in self.terms:
            self._balance_sums[k] += raw[k]
        self._balance_calls += 1
        self._balance_left -= 1
        if self._balance_left == 0:
            means = {k: self._balance_sums[k] / self._balance_calls for k in self.terms}
            line = balance_note(means, self.weights, self.balance_factor, self.balance_steps)
            if line:
                self.log(line)


def make_distill_objective(teacher: nn.Module, *, temperature: float, kd_weight: float, ce_weight: float,
                           top_k: int = 0, chunk: int | None = None, **terms: Any) -> DistillObjective:
    """The distillation objective for `minitrain.train.train` (see `DistillObjective`; `terms`: its
    feature / attention / balance keywords)."""
    return DistillObjective(teacher, temperature=temperature, kd_weight=kd_weight, ce_weight=ce_weight,
                            top_k=top_k, chunk=chunk, **terms)


# ----------------------------------------------------------------------------- same tokenizer


PROBE = ("The quick brown fox jumps over the lazy dog. 0123456789 3.14159 — naïve café, Straße; "
         "日本語のテキスト, 한국어, emoji 🙂!\n\tdef f(x):\n        return x**2  # code   spaces")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model")


def check_same_tokenizer(student_dir: str | Path, teacher_dir: str | Path, student_tok: Tokenizer | None = None,
                         teacher_tok: Tokenizer | None = None) -> None:
    """Refuse (UserError naming both folders) a teacher whose tokenizer is not the student's.

    Identical tokenizer files pass at once. Otherwise the vocabulary size, bos / eos ids, the whole
    id -> token table and the ids of a probe string (words, digits, accents, CJK, emoji, code,
    runs of spaces) must all agree: the same table with another normaliser or merge order still
    encodes text differently.
    """
    student_dir, teacher_dir = Path(student_dir), Path(teacher_dir)
    same_files = [n for n in _TOKENIZER_FILES if (student_dir / n).is_file() and (teacher_dir / n).is_file()]
    s = student_tok or Tokenizer.from_folder(student_dir)
    t = teacher_tok or Tokenizer.from_folder(teacher_dir)

    def refuse(what: str) -> UserError:
        return UserError(f"teacher={teacher_dir}: its tokenizer differs from the student's (model={student_dir}): "
                         f"{what} — distillation compares the two next-token distributions id by id; use a teacher "
                         f"with the student's tokenizer (same family)")

    if same_files and all((student_dir / n).read_bytes() == (teacher_dir / n).read_bytes() for n in same_files) \
            and (s.vocab_size, s.bos_id, s.eos_id) == (t.vocab_size, t.bos_id, t.eos_id):
        return
    if s.vocab_size != t.vocab_size:
        raise refuse(f"{s.vocab_size} vs {t.vocab_size} tokens")
    for name in ("bos_id", "eos_id"):
        if getattr(s, name) != getattr(t, name):
            raise refuse(f"{name} {getattr(s, name)} vs {getattr(t, name)}")
    for i in range(s.vocab_size):
        if s.id_to_token(i) != t.id_to_token(i):
            raise refuse(f"id {i} is {s.id_to_token(i)!r} vs {t.id_to_token(i)!r}")
    a, b = s.encode(PROBE), t.encode(PROBE)
    if a != b:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise refuse(f"a probe string encodes differently from token {at} on ({a[at:at + 4]} vs {b[at:at + 4]})")


def shared_vocab(student: nn.Module, teacher: nn.Module) -> int:
    """How many ids both models take and score: the smallest of the two heads and input embeddings.

    A family's sizes often pad the same tokenizer's vocabulary to different multiples (32000 vs
    32064 rows); KD runs over the first `shared_vocab` ids, which `check_ids_shared` checks the
    data keeps to."""
    sizes = [_vocab_size(m.output_projection) for m in (student, teacher)]
    sizes += [m.input_embeddings.num_embeddings for m in (student, teacher)]
    return min(n for n in sizes if n)


def check_ids_shared(examples: Sequence[Sequence[dict]], shared: int, teacher_dir: str | Path) -> int:
    """The largest token id in `examples` (lists of `input_ids` / `labels` examples); a UserError
    naming the data file and the example when one is `shared` or beyond (the teacher cannot score it)."""
    top = -1
    for part in examples:
        if hasattr(part, "list_max"):  # a token store: each example's largest id, from its arrays
            maxima = part.list_max("input_ids")
            if "labels" in part.lists:
                maxima = np.maximum(maxima, part.list_max("labels"))
            found = [(int(k), int(maxima[k])) for k in np.flatnonzero(maxima >= shared)[:1]]
            found.append((-1, int(maxima.max(initial=-1))))
        else:
            found = ((k, max(max(ex["input_ids"], default=-1), max(ex.get("labels", ()), default=-1)))
                     for k, ex in enumerate(part or ()))
        for k, m in found:
            if m >= shared:
                raise UserError(f"{getattr(part, 'path', 'data')}: example {k} holds token id {m}, but the teacher "
                                f"(teacher={teacher_dir}) and the student share only ids 0..{shared - 1} — drop the "
                                f"rows with that token, or use a teacher whose vocabulary covers it")
            top = max(top, m)
    return top
