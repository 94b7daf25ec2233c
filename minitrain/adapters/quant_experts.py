"""A mixture-of-experts model's experts held quantized (nf4 / int8), each expert's matrix on its own.

An experts module (docs/contracts.md) holds each projection as a 3-D parameter (E, out, in); its
projection may instead be a module called `(x, counts, sizes)` on the rows sorted by expert. The
loader's quantize hook (`minitrain.adapters.quant`) puts a `QuantizedExpertWeight` there as the
parameter arrives (fused), or once all its experts have (the Hub's one tensor per expert), so the
experts never sit in memory at full size together.

Each expert's (out, in) matrix is quantized as bitsandbytes quantizes a linear's weight:
- nf4: `quantize_4bit` of that matrix alone (blocks of 64 along its rows, one absmax per block, no
  double quantization), what a `Linear4bit` of it would hold;
- int8: `int8_vectorwise_quant`, one absmax scale per output row, what a `Linear8bitLt` holds.
The product dequantizes one expert's matrix at a time to the compute dtype (its gradient too: the
backward dequantizes again rather than keep the matrix), so the working set is one expert's matrix.
The int8 product is on the dequantized weight (weight-only int8), not LLM.int8's int8 matmul.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

NF4_BLOCK = 64


class _Dequantized(torch.autograd.Function):
    """x (n, in) @ W_e^T with W_e dequantized in the forward and again in the backward (not saved)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, store: "QuantizedExpertWeight", e: int) -> torch.Tensor:
        ctx.store, ctx.e = store, e
        return F.linear(x, store.matrix(e).to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.store.matrix(ctx.e).to(grad.dtype), None, None


class QuantizedExpertWeight(nn.Module):
    """One 3-D expert parameter (E, out, in), frozen and quantized per expert; called like the experts'
    grouped product: forward(x (M, in) sorted by expert, counts (E,), sizes) -> (M, out)."""

    requires_grad = False  # as the parameter it stands for (a FLOP count reads it)

    def __init__(self, w: torch.Tensor, kind: str, compute_dtype: torch.dtype, bnb: Any) -> None:
        """`bnb`: the bitsandbytes module (`minitrain.adapters.quant.require_bitsandbytes`)."""
        super().__init__()
        self.kind, self.compute_dtype, self.shape = kind, compute_dtype, w.shape
        w = w.detach().to(compute_dtype)
        if kind == "nf4":
            packed, absmax = [], []
            for m in w.unbind(0):  # each expert's matrix quantized alone, as a Linear4bit of it
                p, state = bnb.functional.quantize_4bit(m.contiguous(), blocksize=NF4_BLOCK, quant_type="nf4",
                                                       quant_storage=torch.uint8)
                packed.append(p.flatten())
                absmax.append(state.absmax)
            self.weight = nn.Parameter(torch.stack(packed), requires_grad=False)  # (E, out * in / 2) uint8
            self.register_buffer("absmax", torch.stack(absmax))  # (E, blocks) fp32
            self.register_buffer("code", state.code)
        elif kind == "int8":
            cb, scb, _ = bnb.functional.int8_vectorwise_quant(w.reshape(-1, w.shape[-1]).contiguous())
            self.weight = nn.Parameter(cb.view(w.shape), requires_grad=False)  # (E, out, in) int8
            self.register_buffer("scale", scb.view(w.shape[:2]))  # (E, out): each row's absmax
        else:
            raise ValueError(f"QuantizedExpertWeight: kind {kind!r} — use nf4 or int8")
        self.weight.logical_shape = tuple(self.shape)  # the weights it stands for (a packed byte holds two)
        self._bnb = bnb

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def matrix(self, e: int) -> torch.Tensor:
        """Expert e's (out, in) matrix dequantized to the compute dtype."""
        f = self._bnb.functional
        if self.kind == "nf4":
            state = f.QuantState(absmax=self.absmax[e], shape=torch.Size(self.shape[1:]), code=self.code,
                                 blocksize=NF4_BLOCK, quant_type="nf4", dtype=self.compute_dtype)
            return f.dequantize_4bit(self.weight[e].view(-1, 1), state)
        return f.int8_vectorwise_dequant(self.weight[e], self.scale[e]).to(self.compute_dtype)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
        sizes = counts.tolist() if sizes is None else sizes
        outs = [_Dequantized.apply(xe, self, e) for e, (n, xe) in enumerate(zip(sizes, x.split(sizes))) if n]
        return torch.cat(outs) if outs else x.new_zeros(0, self.shape[1])

    def extra_repr(self) -> str:
        E, out, inp = self.shape
        return f"{E} experts, in={inp}, out={out}, {self.kind}"
