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
  the hidden states (as `minitrain.losses` does), each chunk under non-reentrant checkpointing
  with a lean custom backward, and the teacher runs under `no_grad` in eval mode.

Teacher and student must share a tokenizer: `check_same_tokenizer` compares the tokenizer files,
vocabulary tables, special ids and the encoding of a probe string, and refuses a mismatch
naming both folders (a KL between two vocabularies that do not line up trains on noise).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from minitrain.config import TrainConfig, doc
from minitrain.errors import UserError
from minitrain.losses import IGNORE_INDEX, chunked_cross_entropy_sum, default_chunk, shift_labels
from minitrain.tokenizer import Tokenizer

METRICS = ("kd", "ce", "kd_weighted", "ce_weighted", "ppl")


@dataclass
class DistillConfig(TrainConfig):
    """A distillation run: `TrainConfig` (the student is `model`) plus the teacher and the KD mix."""

    teacher: str = doc("", "HF-format teacher model folder (same tokenizer as the student)")
    teacher_quantize: str = doc("none", "quantize the teacher's linears as they load (nf4, int8: bitsandbytes)",
                                choices=("none", "nf4", "int8"))
    temperature: float = doc(2.0, "softening temperature T of both distributions (the KL is scaled by T^2)", gt=0)
    kd_weight: float = doc(0.5, "weight of the KD term (per target token)", ge=0)
    ce_weight: float = doc(0.5, "weight of the student's cross-entropy on the labels (per target token)", ge=0)
    top_k: int = doc(0, "subset KD over the teacher's top-k tokens per position (0: the full vocabulary)", ge=0)

    def check(self) -> None:
        super().check()
        if self.kd_weight == 0 and self.ce_weight == 0:
            raise UserError("kd_weight=0 and ce_weight=0: the loss would be zero — give at least one a positive weight, "
                            "e.g. kd_weight=0.5 ce_weight=0.5")
        if not self.teacher:
            raise UserError("teacher: not set — pass teacher=path/to/hf_teacher_folder (same tokenizer as model=)")


# ----------------------------------------------------------------------------- the per-token losses


class _KDAndCE(torch.autograd.Function):
    """Per-row `(ce, kd)` from student logits `z (n, V)`, fp32, with a lean backward.

    Teacher side: `u` is `(n, V)` teacher logits (full KD) or `(n, k)` teacher logits at the
    indices `idx (n, k)` (subset KD). Gradients (with q, p the tempered student / teacher
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
        zs = zf if idx is None else zf.gather(1, idx)  # (n, V) or (n, k)
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
        zs = zf if not ctx.subset else zf.gather(1, idx)
        q = torch.softmax(zs / T, dim=1)
        p = torch.softmax(u.to(zf.dtype) / T, dim=1)
        g = (q - p).mul_(T * g_kd[:, None].to(q.dtype))
        if ctx.subset:
            grad.scatter_add_(1, idx, g)
        else:
            grad.add_(g)
        return grad.to(z.dtype), None, None, None, None


def kd_ce_from_logits(student_logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor, *,
                      temperature: float, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row `(ce, kd)`, fp32, for student / teacher logits `(n, V)` and labels `(n,)` (no -100).

    `top_k > 0`: KD over the teacher's top-k tokens of each row, both distributions renormalised
    over them. The teacher side carries no gradient.
    """
    teacher_logits = teacher_logits.detach()
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
            u = t_head(h_t)  # (c, V)
        return _KDAndCE.apply(z, y, u, None, temperature)
    return _KDAndCE.apply(z, y, u_top, idx, temperature)


def chunked_kd_ce(student_hidden: torch.Tensor, student_head: nn.Module, teacher_hidden: torch.Tensor,
                  teacher_head: nn.Module, targets: torch.Tensor, *, temperature: float, top_k: int = 0,
                  chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target-token `(ce, kd)` (n,) fp32 from hidden states, never holding all logits.

    student_hidden (..., D), teacher_hidden (..., Dt), targets (...) aligned with both (already
    shifted for causal models; -100: no target, never projected). Rows come out in the order of
    the target positions in `targets.reshape(-1)`. `chunk`: target positions per chunk (default
    `minitrain.losses.default_chunk`).
    """
    flat_y = targets.reshape(-1)
    keep = (flat_y != IGNORE_INDEX).nonzero().squeeze(1)  # (n,)
    h_s = student_hidden.reshape(-1, student_hidden.shape[-1]).index_select(0, keep)  # (n, D)
    h_t = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).index_select(0, keep).detach()  # (n, Dt)
    y = flat_y.index_select(0, keep)
    if keep.numel() == 0:
        zero = student_hidden.new_zeros(0, dtype=torch.float32)
        return zero, zero
    chunk = chunk or default_chunk(student_head, h_s.device)
    track = torch.is_grad_enabled() and (h_s.requires_grad or any(p.requires_grad for p in student_head.parameters()))
    ces, kds = [], []
    for start in range(0, h_s.shape[0], chunk):
        sl = slice(start, start + chunk)
        u_top = idx = None
        if top_k:
            with torch.no_grad():
                u = teacher_head(h_t[sl])  # (c, V): freed once its top-k is taken
                u_top, idx = u.topk(min(top_k, u.shape[1]), dim=1)  # (c, k) each
                del u
        args = (student_head, h_s[sl], y[sl], teacher_head, h_t[sl], u_top, idx, float(temperature))
        ce, kd = checkpoint(_chunk_losses, *args, use_reentrant=False) if track else _chunk_losses(*args)
        ces.append(ce)
        kds.append(kd)
    return torch.cat(ces), torch.cat(kds)


# ----------------------------------------------------------------------------- the objective


class DistillObjective:
    """`(student, batch) -> (loss summed over target tokens, target tokens, metrics)` for the loop.

    Training: `kd_weight * sum kd + ce_weight * sum ce`; metrics are per-token means over the
    micro-batch: `kd`, `ce`, `kd_weighted`, `ce_weighted`, and `ppl = exp(ce)`. Eval mode
    (`student.training` False): the student's token CE alone (the loop's `eval/loss`, `eval/ppl`),
    with no teacher forward. The teacher runs in eval mode under `no_grad`, on the batch as given.
    """

    def __init__(self, teacher: nn.Module, *, temperature: float, kd_weight: float, ce_weight: float,
                 top_k: int = 0, chunk: int | None = None):
        if not temperature > 0:
            raise UserError(f"temperature={temperature}: must be > 0 — e.g. temperature=2.0")
        if kd_weight < 0 or ce_weight < 0 or (kd_weight == 0 and ce_weight == 0):
            raise UserError(f"kd_weight={kd_weight}, ce_weight={ce_weight}: weights must be >= 0 and not both 0 "
                            f"— e.g. kd_weight=0.5 ce_weight=0.5")
        if top_k < 0:
            raise UserError(f"top_k={top_k}: must be >= 0 (0: full vocabulary) — e.g. top_k=256")
        teacher.eval()
        teacher.requires_grad_(False)
        self.teacher = teacher
        self.temperature, self.kd_weight, self.ce_weight, self.top_k = float(temperature), kd_weight, ce_weight, top_k
        self.chunk = chunk

    def token_losses(self, student: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-target-token `(ce, kd)` (n,) fp32 for a causal batch (`input_ids`, `attention_mask`, `labels`)."""
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        with torch.no_grad():
            t_hidden = self.teacher(ids, mask)  # (B, T, Dt), compute dtype of the teacher
        s_hidden = student(ids, mask)  # (B, T, D)
        return chunked_kd_ce(s_hidden, student.output_projection, t_hidden, self.teacher.output_projection,
                             shift_labels(batch["labels"]), temperature=self.temperature, top_k=self.top_k,
                             chunk=self.chunk)

    def __call__(self, student: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any, dict[str, float]]:
        targets = shift_labels(batch["labels"])
        count = (targets != IGNORE_INDEX).sum()
        if not student.training:  # evaluation: the student as a language model
            hidden = student(batch["input_ids"], batch.get("attention_mask"))
            loss_sum, count = chunked_cross_entropy_sum(hidden, student.output_projection, targets, chunk=self.chunk)
            return loss_sum, count, {}
        ce, kd = self.token_losses(student, batch)
        ce_sum, kd_sum = ce.sum(), kd.sum()
        loss_sum = self.kd_weight * kd_sum + self.ce_weight * ce_sum
        n = count.clamp(min=1).float()
        ce_mean, kd_mean = (ce_sum.detach() / n), (kd_sum.detach() / n)
        values = torch.stack([kd_mean, ce_mean, self.kd_weight * kd_mean, self.ce_weight * ce_mean,
                              ce_mean.exp()]).tolist()  # one host sync
        return loss_sum, count, dict(zip(METRICS, values))


def make_distill_objective(teacher: nn.Module, *, temperature: float, kd_weight: float, ce_weight: float,
                           top_k: int = 0, chunk: int | None = None) -> DistillObjective:
    """The distillation objective for `minitrain.train.train` (see `DistillObjective`)."""
    return DistillObjective(teacher, temperature=temperature, kd_weight=kd_weight, ce_weight=ce_weight,
                            top_k=top_k, chunk=chunk)


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


def check_same_vocab(student: nn.Module, teacher: nn.Module, student_dir: str | Path, teacher_dir: str | Path) -> None:
    """The two output heads must score the same number of ids (UserError naming both folders)."""
    vs = getattr(student.output_projection, "out_features", None)
    vt = getattr(teacher.output_projection, "out_features", None)
    if vs != vt:
        raise UserError(f"teacher={teacher_dir}: its output head scores {vt} ids but the student's "
                        f"(model={student_dir}) scores {vs} — KD needs the same vocabulary on both sides; use a "
                        f"teacher and student whose embeddings have the same size")
