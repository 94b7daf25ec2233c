"""nf4 / int8 bases that FSDP2 can shard: the quantized weight as plain row-major tensors.

bitsandbytes keeps an nf4 weight as a `Params4bit` (a flat packed tensor carrying its `QuantState`)
and an int8 one as `Int8Params` with its scales on the layer's state: tensor subclasses FSDP2
cannot cut. Under `parallel=fsdp` a quantized base is held instead as ordinary frozen parameters
whose rows are the weight's rows, which FSDP2 shards on dim 0 like any other:

    NF4Rows   weight (out, in/2) uint8: two 4-bit codes a byte, row by row (bitsandbytes' packing)
              absmax (out, in/blocksize) fp32: the per-block scales
    Int8Rows  weight (out, in) int8 and scb (out,) fp32: LLM.int8()'s row-wise absmax scales

Each rank quantizes one whole weight at a time, exactly as the one-process loader does
(`quant.quantize_hook`: from the compute dtype, nf4 with double quantization), and keeps its rows.
The nested (double-quantized) scales are stored dequantized, the values bitsandbytes itself computes
before every matmul, so the forward (through bitsandbytes' own `matmul_4bit` / `matmul`) equals the
one-process QLoRA layer's; the cost is 0.5 bit a weight for the scales instead of ~0.13.
An nf4 layer needs `in_features` to be a multiple of the block size (64), so that every row holds
whole blocks; every released model's linears are.
"""

from __future__ import annotations

import torch
from torch import nn

from minitrain.adapters.lora import LoRALinear, name_matches
from minitrain.adapters.lora import frozen_int8_matmul
from minitrain.adapters.quant_experts import nf4_code
from minitrain.errors import UserError


def _bnb():
    from minitrain.adapters.quant import require_bitsandbytes

    return require_bitsandbytes()


def _frozen(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, logical=None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    if logical is not None:
        p.logical_shape = logical  # what `lora.logical_numel` counts: the weights it stands for (scales: none)
    return p


# ----------------------------------------------------------------------------- the matmuls


def nf4_matmul(x: torch.Tensor, weight: torch.Tensor, absmax: torch.Tensor, bias: torch.Tensor | None,
               shape: tuple[int, int], blocksize: int, compute_dtype: torch.dtype) -> torch.Tensor:
    """x @ W.T (+ bias) for the nf4 weight `weight` / `absmax` (whole: FSDP2 has gathered them)."""
    bnb = _bnb()
    state = bnb.functional.QuantState(absmax=absmax.reshape(-1), shape=torch.Size(shape), code=nf4_code(bnb, x.device),
                                      blocksize=blocksize, quant_type="nf4", dtype=compute_dtype)
    bias = None if bias is None else bias.to(compute_dtype)
    out = bnb.matmul_4bit(x.to(compute_dtype), weight.reshape(-1, 1).t(), quant_state=state, bias=bias)
    return out.to(x.dtype)


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scb: torch.Tensor, bias: torch.Tensor | None,
                training: bool) -> torch.Tensor:
    """LLM.int8()'s x @ W.T (+ bias) with the row scales `scb` (threshold 0: no outlier split)."""
    bnb = _bnb()
    state = bnb.MatmulLtState()
    state.CB, state.SCB, state.has_fp16_weights, state.threshold, state.is_training = weight, scb, False, 0.0, training
    return frozen_int8_matmul(x, weight, None if bias is None else bias.to(x.dtype), state)


# ----------------------------------------------------------------------------- the base layers


class NF4Rows(nn.Module):
    """A frozen nf4 linear as row-major tensors (see the module docstring)."""

    minitrain_quant = "4bit"

    def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype,
                 blocksize: int = 64, device: torch.device | str = "meta"):
        super().__init__()
        if in_features % blocksize:
            raise UserError(f"quantize=nf4 with parallel=fsdp: a linear of {in_features} inputs is not a whole number "
                            f"of {blocksize}-weight blocks a row — use parallel=ddp for this model")
        self.in_features, self.out_features, self.blocksize, self.compute_dtype = (
            in_features, out_features, blocksize, compute_dtype)
        self.weight = _frozen((out_features, in_features // 2), torch.uint8, device, (out_features, in_features))
        self.absmax = _frozen((out_features, in_features // blocksize), torch.float32, device, logical=(0,))
        self.bias = _frozen((out_features,), compute_dtype, device) if bias else None

    def quantized(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The whole weight `w` (out, in) quantized as the one-process loader does, by parameter name."""
        bnb = _bnb()
        packed, state = bnb.functional.quantize_4bit(w.to(self.compute_dtype).contiguous(), blocksize=self.blocksize,
                                                     compress_statistics=True, quant_type="nf4",
                                                     quant_storage=torch.uint8)
        absmax = state.absmax
        if state.nested:  # as bitsandbytes' dequantize_4bit computes it
            absmax = bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
        return {"weight": packed.reshape(self.out_features, self.in_features // 2),
                "absmax": absmax.float().reshape(self.out_features, -1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_matmul(x, self.weight, self.absmax, self.bias, (self.out_features, self.in_features),
                          self.blocksize, self.compute_dtype)


class Int8Rows(nn.Module):
    """A frozen LLM.int8() linear as row-major tensors (see the module docstring)."""

    minitrain_quant = "8bit"

    def __init__(self, in_features: int, out_features: int, bias: bool, bias_dtype: torch.dtype,
                 device: torch.device | str = "meta"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _frozen((out_features, in_features), torch.int8, device)
        self.scb = _frozen((out_features,), torch.float32, device, logical=(0,))
        self.bias = _frozen((out_features,), bias_dtype, device) if bias else None

    def quantized(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The whole weight `w` (out, in) quantized as the one-process loader does (from fp16)."""
        cb, scb, _ = _bnb().functional.int8_vectorwise_quant(w.to(torch.float16).contiguous())
        return {"weight": cb, "scb": scb.float()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, self.weight, self.scb, self.bias, self.training)


def replace_linears(model: nn.Module, kind: str, compute_dtype: torch.dtype, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Swap the linears `quant.quantize_hook` would quantize for `NF4Rows` / `Int8Rows` on meta (the
    same rule: not `skip`, not tied to another parameter); returns how many."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    tied = {i for i, n in seen.items() if n > 1}
    n = 0
    for name, m in list(model.named_modules()):
        if type(m) is not nn.Linear or any(name_matches(name, s) for s in skip) or id(m.weight) in tied:
            continue
        bias = m.bias is not None
        new = (NF4Rows(m.in_features, m.out_features, bias, compute_dtype) if kind == "nf4"
               else Int8Rows(m.in_features, m.out_features, bias, compute_dtype))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        n += 1
    return n


# ----------------------------------------------------------------------------- LoRA on them


def _not_merged(self, *args) -> None:
    raise UserError("merge: the base is sharded by parallel=fsdp — merge the saved adapter afterwards "
                    "(minitrain merge)")


class LoRALinearNF4Rows(LoRALinear):
    """LoRA on an `NF4Rows` base: its weight and scales stay parameters of this layer (sharded)."""

    def __init__(self, base: NF4Rows, r: int, alpha: float, dropout: float = 0.0, rslora: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__(base, r, alpha, dropout, rslora, dtype)
        self.absmax = base.absmax
        self.blocksize, self.compute_dtype = base.blocksize, base.compute_dtype
        self.quantized = base.quantized

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_matmul(x, self.weight, self.absmax, self.bias, (self.out_features, self.in_features),
                          self.blocksize, self.compute_dtype)

    dequantized_weight = _not_merged
    _store_weight = _not_merged


class LoRALinearInt8Rows(LoRALinear):
    """LoRA on an `Int8Rows` base."""

    def __init__(self, base: Int8Rows, r: int, alpha: float, dropout: float = 0.0, rslora: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__(base, r, alpha, dropout, rslora, dtype)
        self.scb = base.scb
        self.quantized = base.quantized

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, self.weight, self.scb, self.bias, self.training)

    dequantized_weight = _not_merged
    _store_weight = _not_merged


NF4Rows.lora_class = LoRALinearNF4Rows
Int8Rows.lora_class = LoRALinearInt8Rows
