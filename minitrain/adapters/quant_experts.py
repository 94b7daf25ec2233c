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

from minitrain.errors import UserError

NF4_BLOCK = 64
_CODES: dict[torch.device, torch.Tensor] = {}


def nf4_code(bnb: Any, device: torch.device) -> torch.Tensor:
    """bitsandbytes' nf4 value table on `device`, made once per device (`bnb`: the bitsandbytes module)."""
    if device not in _CODES:
        _CODES[device] = bnb.functional.get_4bit_type("nf4", device=device)
    return _CODES[device]


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

    def __init__(self, shape: tuple[int, int, int], kind: str, compute_dtype: torch.dtype, bnb: Any) -> None:
        """Its frozen tensors on meta, not filled (`of` quantizes a weight into them; under
        `parallel=fsdp` the loader fills this rank's experts, `minitrain.parallel.fsdp`), every one with the experts
        along dim 0 (FSDP2 shards them there): nf4 `weight` (E, out * in / 2) uint8 and `absmax` (E, out * in / 64)
        fp32; int8 `weight` (E, out, in) int8 and `scale` (E, out) fp32, each row's absmax. `bnb`: the bitsandbytes
        module (`minitrain.adapters.quant.require_bitsandbytes`)."""
        super().__init__()
        if kind not in ("nf4", "int8"):
            raise ValueError(f"QuantizedExpertWeight: kind {kind!r} — use nf4 or int8")
        self.kind, self.compute_dtype, self.shape, self._bnb = kind, compute_dtype, torch.Size(shape), bnb
        E, out, inp = shape

        def frozen(size: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(size, dtype=dtype, device="meta"), requires_grad=False)

        if kind == "nf4":
            self.weight = frozen((E, out * inp // 2), torch.uint8)
            self.absmax = frozen((E, -(-out * inp // NF4_BLOCK)), torch.float32)
        else:
            self.weight = frozen((E, out, inp), torch.int8)
            self.scale = frozen((E, out), torch.float32)
        self._mark()

    @classmethod
    def of(cls, w: torch.Tensor, kind: str, compute_dtype: torch.dtype, bnb: Any) -> "QuantizedExpertWeight":
        """The experts' weight w (E, out, in) quantized (the loader's hook in one process)."""
        store = cls(tuple(w.shape), kind, compute_dtype, bnb)
        for leaf, t in store.quantized(w).items():
            setattr(store, leaf, nn.Parameter(t, requires_grad=False))
        store._mark()
        return store

    def _mark(self) -> None:
        """What `lora.logical_numel` counts: the weights the packed tensor stands for (a byte holds two nf4
        codes), none for the scales."""
        self.weight.logical_shape = tuple(self.shape)
        (self.absmax if self.kind == "nf4" else self.scale).logical_shape = (0,)

    def quantized(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Experts' matrices w (n, out, in), each quantized alone as bitsandbytes quantizes a linear's weight
        (the module docstring), by parameter name: n rows of each tensor (n: all E, or a rank's experts)."""
        f = self._bnb.functional
        w = w.detach().to(self.compute_dtype)
        if self.kind == "int8":
            cb, scb, _ = f.int8_vectorwise_quant(w.reshape(-1, w.shape[-1]).contiguous())
            return {"weight": cb.view(w.shape), "scale": scb.float().view(w.shape[:2])}
        packed, absmax = [], []
        for m in w.unbind(0):  # each expert's matrix quantized alone, as a Linear4bit of it
            p, state = f.quantize_4bit(m.contiguous(), blocksize=NF4_BLOCK, quant_type="nf4", quant_storage=torch.uint8)
            packed.append(p.flatten())
            absmax.append(state.absmax.float())
        return {"weight": torch.stack(packed), "absmax": torch.stack(absmax)}

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
            state = f.QuantState(absmax=self.absmax[e], shape=torch.Size(self.shape[1:]),
                                 code=nf4_code(self._bnb, self.weight.device),
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


def check_experts(model: nn.Module, kind: str) -> None:
    """A mixture-of-experts model whose experts `quantize=kind` cannot take: one line, before anything loads."""
    experts = [m for m in model.modules() if hasattr(m, "expert_projections")]
    if not experts:
        return
    if kind == "ternary":
        raise UserError("quantize=ternary: reaches linear layers only, and this mixture-of-experts model holds most of "
                        "its weights in its experts' 3-D tensors — use quantize=nf4 or int8 (each expert quantized)")
    if any(getattr(m, "in_out", False) or getattr(m, "gate_up_proj_bias", None) is not None for m in experts):
        raise UserError(f"quantize={kind}: this model's experts (gpt-oss: an in-out layout with biases, stored as MXFP4 "
                        f"in its checkpoints) are not ones minitrain quantizes — drop quantize= (LoRA on the "
                        f"dequantized experts)")


def replace_experts(model: nn.Module, kind: str, compute_dtype: torch.dtype, bnb: Any) -> int:
    """Under `parallel=fsdp` (the model on meta): put an empty `QuantizedExpertWeight` in the place of every
    expert projection, as the one-process loader's hook does once the weights arrive, for the sharded loader to
    fill with this rank's experts (`minitrain.parallel.fsdp`); the experts `quantize=` cannot take are refused
    first, as in one process. `bnb`: the bitsandbytes module. Returns how many."""
    check_experts(model, kind)
    n = 0
    for experts in [m for m in model.modules() if hasattr(m, "expert_projections")]:
        for leaf in experts.expert_projections:
            w = experts._parameters.get(leaf)
            if w is None or w.dim() != 3 or not w.is_floating_point():
                continue
            put(experts, leaf, QuantizedExpertWeight(tuple(w.shape), kind, compute_dtype, bnb))
            n += 1
    return n


def put(experts: nn.Module, leaf: str, store: QuantizedExpertWeight) -> None:
    """`store` in the place of the experts module's parameter `leaf`."""
    del experts._parameters[leaf]  # (a parameter's name takes a module only once it is free)
    experts.add_module(leaf, store)
