"""Ternary bases (BitNet b1.58): each base linear's weight as {-1, 0, +1} x a scale, 2 bits a weight.

Quantization is BitNet b1.58's absmean (Ma et al. 2024, "The Era of 1-bit LLMs"):

    scale = mean |W|                       per tensor (one fp32 number) or per output channel (out,)
    Wq    = clamp(round(W / scale), -1, 1) in {-1, 0, +1}
    W    ~= scale * Wq

Storage: the codes Wq + 1 in {0, 1, 2} are packed four to a byte along the input dimension
(code of column 4j + k in bits 2k..2k+1 of byte j), so a weight of (out, in) is a uint8 tensor of
(out, ceil(in / 4)) plus its fp32 scale: 0.25 byte per weight + 4 bytes per tensor (or per row).

The forward dequantizes in plain torch (shifts, masks, a cast, a multiply: torch.compile fuses
them into one elementwise kernel; eager holds the uint8 codes and the compute-dtype weight) inside `TernaryMatmul`, an autograd Function that keeps only the
packed weight for backward and dequantizes again there: autograd would otherwise keep every
layer's dequantized weight until the backward reaches it, a full-precision copy of the model.

Optional activation fake-quantization as BitLinear does (`act_bits=8`): per token (last dim)
absmax to signed `act_bits` integers and back, `x + (q(x) - x).detach()` (straight-through: the
gradient passes as if unquantized). BitLinear's own RMSNorm before the quantizer is the model's
business, not this layer's. LoRA / low-rank-correction adapters beside a ternary base read the
unquantized input (minitrain.adapters.lora, minitrain.adapters.lrc).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minitrain.errors import UserError

SCALES = ("tensor", "channel")
EPS = 1e-5  # BitNet's floor for the scale (an all-zero weight or token)


def ternary_quantize(w: torch.Tensor, scale: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """`(codes, s)`: codes int8 in {-1, 0, 1} of w's shape (out, in), s fp32 of shape (1, 1) or (out, 1)."""
    if scale not in SCALES:
        raise UserError(f"ternary_scale={scale}: must be tensor or channel — e.g. ternary_scale=tensor")
    w = w.float()
    a = w.abs()
    s = (a.mean() if scale == "tensor" else a.mean(dim=1)).reshape(-1, 1).clamp(min=EPS)  # (1, 1) | (out, 1)
    return (w / s).round().clamp(-1, 1).to(torch.int8), s


_SHIFTS = (0, 2, 4, 6)


def pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes (out, in) in {-1, 0, 1} -> uint8 (out, ceil(in / 4)), four 2-bit codes a byte."""
    out_f, in_f = codes.shape
    pad = -in_f % 4
    c = (codes.to(torch.int16) + 1).to(torch.uint8)  # {0, 1, 2}
    if pad:
        c = F.pad(c, (0, pad), value=1)  # padding holds a zero weight
    c = c.view(out_f, -1, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_ternary(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 (out, ceil(in / 4)) -> uint8 codes + 1 in {0, 1, 2}, (out, in_features)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.uint8, device=packed.device)
    c = (packed.unsqueeze(-1) >> shifts) & 3  # (out, in4, 4)
    return c.reshape(packed.shape[0], -1)[:, :in_features]


def dequantize_ternary(packed: torch.Tensor, scale: torch.Tensor, in_features: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fresh weight (out, in) in `dtype`: (code - 1) * scale (in place: one weight-sized float tensor)."""
    w = unpack_ternary(packed, in_features).to(dtype)
    return w.sub_(1).mul_(scale.to(dtype))


def fake_quantize_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """BitLinear's activation quantizer: per token absmax to `bits`-bit integers and back, straight-through."""
    qmax = 2 ** (bits - 1) - 1
    with torch.no_grad():
        s = qmax / x.abs().amax(dim=-1, keepdim=True).float().clamp(min=EPS)  # (..., 1) fp32
        q = ((x.float() * s).round().clamp(-qmax - 1, qmax) / s).to(x.dtype)
    return x + (q - x).detach()


class TernaryMatmul(torch.autograd.Function):
    """`x @ W.T` with W dequantized from the packed weight, in forward and again in backward.

    The weight never needs a gradient, so only the packed weight and scale are saved; the input
    gradient is `grad @ W` with W rebuilt. Under autocast the product runs in the autocast dtype.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, in_features: int) -> torch.Tensor:
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        ctx.save_for_backward(packed, scale)
        ctx.in_features, ctx.dtype, ctx.x_dtype = in_features, dtype, x.dtype
        with torch.autocast(dev, enabled=False):
            return x.to(dtype) @ dequantize_ternary(packed, scale, in_features, dtype).t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        packed, scale = ctx.saved_tensors
        w = dequantize_ternary(packed, scale, ctx.in_features, ctx.dtype)  # (out, in)
        return (grad.to(ctx.dtype) @ w).to(ctx.x_dtype), None, None, None


def ternary_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, in_features: int,
                   bias: torch.Tensor | None, act_bits: int) -> torch.Tensor:
    """A ternary linear layer's output: fake-quantized input (act_bits > 0) times the dequantized weight, + bias."""
    if act_bits:
        x = fake_quantize_activations(x, act_bits)
    out = TernaryMatmul.apply(x, packed, scale, in_features)
    return out if bias is None else out + bias.to(out.dtype)


def is_ternary(obj) -> bool:
    """Whether `obj` is a `TernaryLinear` or the packed weight of one (wrapped by LoRA or not)."""
    return isinstance(obj, TernaryLinear) or getattr(obj, "ternary_shape", None) is not None


def _packed_parameter(packed: torch.Tensor, out_f: int, in_f: int) -> nn.Parameter:
    p = nn.Parameter(packed, requires_grad=False)
    p.ternary_shape = (out_f, in_f)  # what the packed bytes stand for (logical_numel, the dtype guard)
    return p


class TernaryLinear(nn.Module):
    """A frozen linear layer with a ternary weight: `weight` uint8 (out, ceil(in / 4)) + `weight_scale` fp32.

    The weight stays a (frozen, integer) Parameter under its HF key so LoRA can wrap the layer as
    it wraps `nn.Linear`; `weight_scale` is a buffer ((1, 1) per tensor, (out, 1) per channel).
    """

    def __init__(self, in_features: int, out_features: int, packed: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None, act_bits: int = 0, scale_mode: str = "tensor"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _packed_parameter(packed, out_features, in_features)
        self.register_buffer("weight_scale", scale)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        self.act_bits, self.scale_mode = act_bits, scale_mode

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None = None, *, scale: str = "tensor",
                    act_bits: int = 0) -> "TernaryLinear":
        """Quantize a float weight (out, in) into a new layer on w's device."""
        codes, s = ternary_quantize(w, scale)
        return cls(w.shape[1], w.shape[0], pack_ternary(codes), s, bias, act_bits, scale)

    def dequantized_weight(self) -> torch.Tensor:
        """A fresh fp32 (out, in) copy of the weight the layer computes with."""
        return dequantize_ternary(self.weight, self.weight_scale, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ternary_linear(x, self.weight, self.weight_scale, self.in_features, self.bias, self.act_bits)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"scale={self.scale_mode}, act_bits={self.act_bits or 'off'}")


def store_ternary(layer: nn.Module, w: torch.Tensor) -> None:
    """Re-quantize fp32 `w` (out, in) into a ternary layer (or its LoRA wrapper) in place, same scale mode."""
    codes, s = ternary_quantize(w, layer.scale_mode)
    layer.weight.data = pack_ternary(codes).to(layer.weight.device)
    layer.weight_scale = s.to(layer.weight_scale.device)

