"""Token losses computed from hidden states in chunks, so `B x T x V` logits never exist.

Field report 004: a `16 x 1024 x 152k` logits tensor is ~10 GB in fp32, before its gradient.
Here the head (`model.output_projection`, any module: a Linear, a LoRA-wrapped Linear, ...)
is applied to `chunk` target positions at a time. Positions whose label is `-100` are never
projected at all. Two paths, the same values and gradients:

- frozen plain `nn.Linear` head (every LoRA run that does not train `lm_head`): the gradient
  with respect to the chunk's hidden rows, `(onehot - softmax) @ W`, is computed in the forward,
  chunk by chunk, and kept (`c x D`, the size of the rows themselves); the backward only scales
  it. Two head matmuls per chunk instead of three; the exps are made in place in one buffer
  reused by every block of logits (`frozen_head_logprobs`, `frozen_head_block`: on a CPU in fp32
  all target rows by 2048 vocabulary columns, elsewhere `c x V`; no-grad passes take it too).
- any other head (trainable, LoRA-wrapped, quantized): each chunk runs under non-reentrant
  `torch.utils.checkpoint`: the forward keeps only the chunk's hidden rows and its per-token
  log-probs; the backward recomputes that chunk's logits, back-propagates them and frees them.

Alignment: `hidden[..., t, :]` is scored against `labels[..., t]`. Causal objectives shift the
labels themselves (`shift_labels`): position t predicts token t+1. Logits and log-probs are
reduced in fp32 whatever the autocast dtype (rule 8).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from minitrain.parallel import distributed
from minitrain.data.collate import IGNORE_INDEX


# Default chunk: about 2**24 logits (64 MiB in fp32) per chunk whatever the vocabulary size
# (512 positions at V=32k, 128 at V=128k): small next to activations, big enough for a good GPU
# matmul. On a CPU a 4x smaller chunk is as fast and saves ~100 MiB of peak memory (BENCHMARKS.md).
LOGITS_PER_CHUNK = 2**24
CPU_LOGITS_PER_CHUNK = 2**22


def logits_per_chunk(device: torch.device | str) -> int:
    """Logits per chunk on `device`: `LOGITS_PER_CHUNK` on accelerators, `CPU_LOGITS_PER_CHUNK` on a CPU."""
    return CPU_LOGITS_PER_CHUNK if torch.device(device).type == "cpu" else LOGITS_PER_CHUNK


def chunk_rows(logits: int, vocab: int, device: torch.device | str) -> int:
    """Target positions per chunk of `logits` logits: `logits // vocab`, at least 64 (128 on a CPU,
    where a 64-row head GEMM at V=128k runs at 0.92x the rate of a 128-row one, BENCHMARKS.md)."""
    return max(128 if torch.device(device).type == "cpu" else 64, logits // vocab)


def default_chunk(head: nn.Module, device: torch.device | str) -> int:
    """Target positions per chunk for `head` on `device`: `chunk_rows` of `logits_per_chunk`."""
    return chunk_rows(logits_per_chunk(device), _vocab_size(head) or 32768, device)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Causal targets: `out[:, t] = labels[:, t + 1]`, and `-100` at the last position. (B, T)"""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _vocab_size(head: nn.Module) -> int | None:
    """The head's output width if it says so (Linear-like modules), else None."""
    n = getattr(head, "out_features", None)
    if n is None and isinstance(getattr(head, "weight", None), torch.Tensor):
        n = head.weight.shape[0]
    return int(n) if n else None


def _onehot_minus_softmax_(shifted: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`onehot(labels) - softmax`, made in place from `shifted` = logits - logsumexp (n, V); returned."""
    shifted.exp_().neg_()  # -softmax
    return shifted.scatter_add_(1, labels[:, None], torch.ones_like(shifted[:, :1]))


class _LabelLogProb(torch.autograd.Function):
    """`log_softmax(logits)[row, label]` in fp32 (at least), with a lean backward.

    The backward allocates one `(n, V)` tensor, `g * (onehot - softmax)`, built in place from
    the saved logits; autograd's `gather - logsumexp` would hold three or four of them.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 for fp64 logits
        lse = torch.logsumexp(logits.to(acc), dim=1)  # (n,)
        ctx.save_for_backward(logits, labels, lse)
        return logits.gather(1, labels[:, None]).squeeze(1).to(acc) - lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = _onehot_minus_softmax_(logits - lse[:, None], labels)  # (n, V) in lse's dtype (fp32 at least)
        grad.mul_(grad_out[:, None])
        return grad.to(logits.dtype), None


class _FrozenHeadLogProb(torch.autograd.Function):
    """`log_softmax(h @ W.T + b)[row, label]` for a frozen head, chunk by chunk, fp32 result.

    The forward also computes the gradient of each row with respect to `h`, `(onehot - softmax)
    @ W` (`c x D` per chunk, in `h`'s dtype), and saves only that; the backward scales it by the
    incoming gradient. See `frozen_head_logprobs` for the memory.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                chunk: int | None) -> torch.Tensor:
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        out = frozen_head_logprobs(h, weight, bias, labels, chunk, grad)
        ctx.save_for_backward(grad)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_out[:, None].to(grad.dtype), None, None, None, None


# `frozen_head_logprobs` exponentiates logits unshifted when every row's sum of exps lands in
# [EXP_SUM_MIN, inf): no exp overflowed, and the largest logit is above about -46, so every exp
# that matters to the sum is a normal float. Otherwise the rows are redone shifted by their max.
EXP_SUM_MIN = 1e-20
CPU_TILE = 2048  # fp32 on a CPU: vocabulary columns per block


def frozen_head_block(n: int, vocab: int, device: torch.device | str, low: bool,
                      chunk: int | None = None) -> tuple[int, int]:
    """(rows, vocabulary columns) of the logits block `frozen_head_logprobs` makes at a time, for n
    target rows. In fp32 on a CPU: up to `logits_per_chunk // CPU_TILE` rows (every target of a
    usual micro-batch) by CPU_TILE columns: the block stays in cache from its GEMM to its `exp` and
    the gradient's GEMM, and every GEMM has many rows (at V=128k, 1.2x the rate of 128-row chunks
    over the whole vocabulary; 2048 columns measured 2-8% faster than 8192 or than one block of
    `logits_per_chunk`, BENCHMARKS.md). Elsewhere (accelerators; bf16 / fp16 compute, whose
    gradient needs the whole normalised softmax before its GEMM): `chunk_rows` rows over the whole
    vocabulary. `chunk` fixes the rows."""
    budget = logits_per_chunk(device)
    if torch.device(device).type == "cpu" and not low:
        return min(n, chunk or budget // CPU_TILE), min(vocab, CPU_TILE)
    return min(n, chunk or chunk_rows(budget, vocab, device)), vocab


def frozen_head_logprobs(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                         chunk: int | None = None, grad: torch.Tensor | None = None,
                         tile: int | None = None, *, offset: int = 0, vocab: int | None = None,
                         reduce: Callable[[torch.Tensor, str], torch.Tensor] | None = None) -> torch.Tensor:
    """log p(label) under a frozen head for rows h (n, D), labels (n,) -> (n,) fp32 (at least).

    With `grad` (n, D) given, also writes `(onehot - softmax) @ W` into it (the rows' gradient).
    The logits are made one block of (rows, columns) at a time (`frozen_head_block`; `chunk` fixes
    the rows, `tile` the columns) into one reused fp32 buffer (plus one in the compute dtype under
    bf16 / fp16 autocast), and `exp` runs in place over it: no block allocates a temporary of its
    size (torch's `logsumexp` makes one per call, and a fresh block is page faults on a CPU).
    The max shift is skipped while it is not needed (`EXP_SUM_MIN`; log p = logit - log sum exp,
    the same value to float rounding), and in fp32 the softmax is never normalised in the buffer:
    the gradient is `W[label] - (sum over blocks of exp(logits) @ W) / sum of exps`, the division
    on the (rows, D) product. So two passes over the logits besides the GEMMs: `exp` and the sums.

    A head sharded by rows (`parallel=fsdp`, a DTensor: `minitrain.parallel.fsdp.shard_vocab`) goes to
    `_sharded_frozen_head_logprobs`, which calls this with this rank's rows of `weight` (the columns
    `offset` .. of a `vocab`-wide head) and `reduce`, the sum / max over ranks of each row's label
    logit, sum of exps and max: every rank's rows are scored over this rank's columns, and `grad`
    gets this rank's columns' share of each row's gradient (the caller sums them over ranks).
    """
    if distributed.is_sharded(weight):
        return _sharded_frozen_head_logprobs(h, weight, bias, labels, chunk, grad, tile)
    n, device = h.shape[0], h.device
    acc = torch.promote_types(h.dtype, torch.float32)
    cdt = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else h.dtype
    low = cdt != acc
    V = weight.shape[0]  # (this rank's columns of the vocabulary when sharded)
    rows, cols = frozen_head_block(n, vocab or V, device, low, chunk)
    rows = max(1, rows)  # (no rows at all: a rank of a sharded head whose ranks have no targets)
    cols = max(1, min(V, tile or cols))
    if low and cols < V:
        raise ValueError("frozen_head_logprobs: a bf16 / fp16 head needs whole-vocabulary blocks (tile = None)")
    out = torch.empty(n, dtype=acc, device=device)
    buf = torch.empty(rows * cols, dtype=acc, device=device)  # flat, so each block's view is contiguous
    low_buf = torch.empty(rows * cols, dtype=cdt, device=device) if low else None
    w = weight.to(cdt)  # cast once (under autocast a frozen weight is not cached)
    b = None if bias is None else bias.to(cdt)

    def blocks(hc: torch.Tensor):  # (first column, logits (m, t) in fp32) for each block of the rows hc
        m = hc.shape[0]
        for v0 in range(0, V, cols):
            t = min(cols, V - v0)
            x = buf[: m * t].view(m, t)
            dst = x if low_buf is None else low_buf[: m * t].view(m, t)
            if b is None:
                torch.mm(hc, w[v0 : v0 + t].t(), out=dst)
            else:
                torch.addmm(b[v0 : v0 + t], hc, w[v0 : v0 + t].t(), out=dst)
            if low_buf is not None:
                x.copy_(dst)
            yield v0, x

    def exp_pass(hc: torch.Tensor, y: torch.Tensor, g: torch.Tensor | None, shift: torch.Tensor | None):
        """(label logits, sums of exps) of the rows, with `shift` subtracted first when given; in
        fp32 also the sum over blocks of exp(logits) @ W into g. The last block stays in `buf`."""
        m = hc.shape[0]
        picked = torch.zeros(m, dtype=acc, device=device)  # (a label in another rank's columns: 0 here)
        total = torch.zeros(m, dtype=acc, device=device)
        x = None
        for v0, x in blocks(hc):
            here = ((y >= v0) & (y < v0 + x.shape[1])).nonzero().squeeze(1)
            picked[here] = x[here, y[here] - v0]
            if shift is not None:
                x.sub_(shift[:, None])
            total += x.exp_().sum(dim=1)
            if g is not None and not low:
                if v0 == 0:
                    torch.mm(x, w[: x.shape[1]], out=g)
                else:
                    g.addmm_(x, w[v0 : v0 + x.shape[1]])
        if reduce is not None:
            reduce(picked, "sum")
            reduce(total, "sum")
        return (picked if shift is None else picked - shift), total, x

    with torch.autocast(device.type, enabled=False):
        for start in range(0, n, rows):
            y = labels[start : start + rows] - offset  # (this rank's columns: 0 .. V - 1)
            hc = h[start : start + rows].to(cdt)
            g = None if grad is None else grad[start : start + y.shape[0]]  # (m, D)
            picked, total, x = exp_pass(hc, y, g, None)
            if not bool(((total >= EXP_SUM_MIN) & (total < float("inf"))).all()):  # redo it shifted
                shift = torch.stack([x.amax(dim=1) for _, x in blocks(hc)]).amax(dim=0)
                if reduce is not None:
                    reduce(shift, "max")
                picked, total, x = exp_pass(hc, y, g, shift)
            out[start : start + y.shape[0]] = picked - total.log()
            if g is None:
                continue
            mine = ((y >= 0) & (y < V)).nonzero().squeeze(1)  # the rows whose label is in these columns
            if not low:  # W[label] - (exp @ W) / sum: the division on (m, D), not (m, V)
                g.div_(total[:, None]).neg_().index_add_(0, mine, w[y[mine]].to(g.dtype))
                continue
            # a bf16 / fp16 GEMM over the one whole-vocabulary block: onehot - softmax made in fp32
            # first, so that the label's 1 - p is not left to a cancellation after the product's rounding
            x.mul_(total.reciprocal_().neg_()[:, None])
            x[mine, y[mine]] += 1
            lo = low_buf[: x.numel()].view_as(x).copy_(x)
            if g.dtype == cdt:
                torch.mm(lo, w, out=g)
            else:  # fp32 rows under bf16 autocast: the product in bf16, as autocast's matmul
                g.copy_(lo @ w)
    return out


def _sharded_frozen_head_logprobs(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                  labels: torch.Tensor, chunk: int | None, grad: torch.Tensor | None,
                                  tile: int | None) -> torch.Tensor:
    """`frozen_head_logprobs` for a head sharded by rows of the vocabulary: every rank's rows (h, labels,
    gathered: N x this rank's, padded) scored over this rank's columns, the sums over ranks taken per
    block of rows, then this rank's rows kept. The head is never gathered: the logits are made from
    the rows each rank holds, and the gradient of each row is the sum of every rank's share (one
    all-reduce of N x (n, D)). Every rank calls it (collectives), whatever its number of targets."""
    every_h, m = distributed.gather_rows(h)  # (N * m, D)
    every_y, _ = distributed.gather_rows(labels)  # (N * m,); padding rows score label 0, dropped below
    every_g = None if grad is None else torch.empty_like(every_h)
    local, start = distributed.local_rows(weight)
    bias = None if bias is None else distributed.local_rows(bias)[0]
    out = frozen_head_logprobs(every_h, local, bias, every_y, chunk, every_g, tile, offset=start, vocab=weight.shape[0],
                               reduce=distributed.all_reduce_)
    mine = slice(distributed.rank() * m, distributed.rank() * m + h.shape[0])
    if grad is not None:
        grad.copy_(distributed.all_reduce_(every_g)[mine])
    return out[mine]


def _is_frozen_linear(head: nn.Module) -> bool:
    """A plain `nn.Linear` (not a subclass: LoRA, quantized) whose weight and bias are frozen."""
    return type(head) is nn.Linear and not any(p.requires_grad for p in head.parameters())


def _label_logprob(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) for a few rows: hidden (n, D), labels (n,) -> (n,) fp32."""
    logits = head(hidden)  # (n, V): the only V-wide tensor alive, one chunk's worth
    return _LabelLogProb.apply(logits, labels)


def chunked_token_logprobs(
    hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, *, chunk: int | None = None
) -> torch.Tensor:
    """Per-token log-probability of `labels` under `head(hidden)`, never holding all logits.

    hidden (..., D), labels (...) aligned with it (`-100`: no target). Returns fp32 of the
    labels' shape with 0 at `-100` positions. `chunk`: target positions per chunk (default
    `default_chunk(head, hidden.device)`).
    """
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # (N, D), a view for contiguous hidden
    flat_y = labels.reshape(-1)  # (N,)
    keep = (flat_y != IGNORE_INDEX).nonzero().squeeze(1)  # (n,) target positions only
    out = torch.zeros(flat_y.shape, dtype=torch.float32, device=hidden.device)
    sharded = any(distributed.is_sharded(p) for p in head.parameters())  # every rank takes part, targets or none
    if keep.numel() == 0 and not sharded:
        return out.reshape(labels.shape)
    h = flat_h.index_select(0, keep)  # (n, D)
    y = flat_y.index_select(0, keep)  # (n,)
    track = torch.is_grad_enabled() and (
        h.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    if _is_frozen_linear(head):
        if track:
            picked = _FrozenHeadLogProb.apply(h, head.weight, head.bias, y, chunk)
        else:  # reference / evaluation forwards: the same in-place buffer, no row gradients
            picked = frozen_head_logprobs(h, head.weight, head.bias, y, chunk)
        return out.to(picked.dtype).index_put((keep,), picked).reshape(labels.shape)
    chunk = chunk or default_chunk(head, hidden.device)
    head = distributed.gathered_call(head)  # (sharded: gathered once here; the chunks below are each rank's own)
    pieces = []
    # (sharded: one chunk even without targets, so that the gathered weight's backward, a collective, runs here too)
    for start in range(0, max(h.shape[0], int(sharded)), chunk):
        h_c, y_c = h[start : start + chunk], y[start : start + chunk]  # (c, D), (c,)
        if track:  # keep only h_c and the (c,) result; recompute the (c, V) logits in backward
            pieces.append(checkpoint(_label_logprob, head, h_c, y_c, use_reentrant=False))
        else:
            pieces.append(_label_logprob(head, h_c, y_c))
    picked = torch.cat(pieces)  # (n,)
    return out.to(picked.dtype).index_put((keep,), picked).reshape(labels.shape)


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, *, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token cross-entropies over targets (fp32 scalar), number of targets (int64)).

    The sum, not the mean: the loop divides by the token count of the whole accumulation
    window (rule 2). Equals `F.cross_entropy(head(hidden).flatten(0, -2), labels.flatten(),
    ignore_index=-100, reduction="sum")` without the full logits.
    """
    logp = chunked_token_logprobs(hidden, head, labels, chunk=chunk)
    return -logp.sum(), (labels != IGNORE_INDEX).sum()
