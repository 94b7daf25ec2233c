"""Token losses computed from hidden states in chunks, so `B x T x V` logits never exist.

Field report 004: a `16 x 1024 x 152k` logits tensor is ~10 GB in fp32, before its gradient.
Here the head (`model.output_projection`, any module: a Linear, a LoRA-wrapped Linear, ...)
is applied to `chunk` target positions at a time. Positions whose label is `-100` are never
projected at all. Two paths, the same values and gradients:

- frozen plain `nn.Linear` head (every LoRA run that does not train `lm_head`): the gradient
  with respect to the chunk's hidden rows, `(onehot - softmax) @ W`, is computed in the forward,
  chunk by chunk, and kept (`c x D`, the size of the rows themselves); the backward only scales
  it. Two head matmuls per chunk instead of three, and no `c x V` tensor outlives its chunk.
- any other head (trainable, LoRA-wrapped, quantized): each chunk runs under non-reentrant
  `torch.utils.checkpoint`: the forward keeps only the chunk's hidden rows and its per-token
  log-probs; the backward recomputes that chunk's logits, back-propagates them and frees them.

Alignment: `hidden[..., t, :]` is scored against `labels[..., t]`. Causal objectives shift the
labels themselves (`shift_labels`): position t predicts token t+1. Logits and log-probs are
reduced in fp32 whatever the autocast dtype (rule 8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100

# Default chunk: about 2**24 logits (64 MiB in fp32) per chunk whatever the vocabulary size
# (512 positions at V=32k, 128 at V=128k): small next to activations, big enough for a good GPU
# matmul. On a CPU a 4x smaller chunk is as fast and saves ~100 MiB of peak memory (BENCHMARKS.md).
LOGITS_PER_CHUNK = 2**24
CPU_LOGITS_PER_CHUNK = 2**22


def logits_per_chunk(device: torch.device | str) -> int:
    """Logits per chunk on `device`: `LOGITS_PER_CHUNK` on accelerators, `CPU_LOGITS_PER_CHUNK` on a CPU."""
    return CPU_LOGITS_PER_CHUNK if torch.device(device).type == "cpu" else LOGITS_PER_CHUNK


def default_chunk(head: nn.Module, device: torch.device | str) -> int:
    """Target positions per chunk for `head` on `device`: `logits_per_chunk // vocab`, at least 64."""
    vocab = _vocab_size(head) or 32768
    return max(64, logits_per_chunk(device) // vocab)


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
    incoming gradient. The softmax is made in place over the chunk's fp32 logits.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                chunk: int) -> torch.Tensor:
        n = h.shape[0]
        out = torch.empty(n, dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        w = weight  # cast once to the logits' dtype (under autocast a frozen weight is not cached)
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            w = _FrozenHeadLogProb.chunk(h[rows], w, bias, labels[rows], out[rows],
                                         None if grad is None else grad[rows])
        ctx.save_for_backward(grad)
        return out

    @staticmethod
    def chunk(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, out: torch.Tensor,
              grad: torch.Tensor | None) -> torch.Tensor:
        """One chunk: log-probs into `out` (c,), row gradients into `grad` (c, D); returns the cast weight.

        A function of its own so the chunk's `(c, V)` tensors are freed before the next chunk.
        """
        logits = F.linear(h, w, bias)  # (c, V)
        w = w.to(logits.dtype)
        acc = logits.to(out.dtype)  # the same tensor when the logits are fp32 already
        del logits
        lse = torch.logsumexp(acc, dim=1)  # (c,)
        out.copy_(acc.gather(1, y[:, None]).squeeze(1) - lse)
        if grad is not None:
            p = _onehot_minus_softmax_(acc.sub_(lse[:, None]), y)  # in place over the fp32 logits
            grad.copy_(p.to(w.dtype) @ w)  # (c, D)
        return w

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_out[:, None].to(grad.dtype), None, None, None, None


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
    if keep.numel() == 0:
        return out.reshape(labels.shape)
    chunk = chunk or default_chunk(head, hidden.device)
    h = flat_h.index_select(0, keep)  # (n, D)
    y = flat_y.index_select(0, keep)  # (n,)
    track = torch.is_grad_enabled() and (
        h.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    if track and _is_frozen_linear(head):
        picked = _FrozenHeadLogProb.apply(h, head.weight, head.bias, y, chunk)
        return out.to(picked.dtype).index_put((keep,), picked).reshape(labels.shape)
    pieces = []
    for start in range(0, h.shape[0], chunk):
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
