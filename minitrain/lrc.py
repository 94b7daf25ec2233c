"""Low-rank correction (LRC): LoRA adapters on a quantized base that start as its quantization error.

A plain QLoRA adapter starts at zero, so training starts from the quantized model `Q(W)`, which
can be noticeably worse than the full-precision one. LoftQ (Li, Yu, Liang, He, Karampatziakis,
Chen & Zhao 2023, "LoftQ: LoRA-Fine-Tuning-Aware Quantization for Large Language Models") starts
the adapter at the best rank-r approximation of the quantization error instead:

    E = W - dequant(Q(W))                 (out, in), fp32
    E ~ U_r S_r V_r^T                     truncated SVD: the best rank-r approximation in the
                                          Frobenius and spectral norms (Eckart & Young 1936)
    B = U_r sqrt(S_r / s),  A = sqrt(S_r / s) V_r^T      so that  s * B @ A = U_r S_r V_r^T

where s is the LoRA scaling (alpha / r): the singular values are split evenly between A and B, so
both start with the same norm and neither factor's gradient is starved. The adapted layer then
computes `Q(W) x + s B A x`, nearer to `W x` than `Q(W) x` is. With `iters > 1` the LoftQ
alternation runs: the base is re-quantized from `W - s B A` and the adapter re-fitted to the new
error, `iters` times (iteration 1 is the one-step correction of the base as loaded).

The full-precision W comes from the checkpoint on disk, read one tensor at a time while the model
holds only its quantized weights: no second model in memory (field report 004), peak extra
memory about one fp32 weight matrix and its SVD.

Field report 004 also needed `enable_input_require_grads()` to make gradient checkpointing work on
frozen embeddings. Nothing of the kind is needed or done here: the loop's checkpointing is
non-reentrant (`minitrain.train.enable_checkpointing`), which records the graph through adapters
whose block input does not require grad (tests/test_lrc.py checks the gradients are equal).

An adapter made this way corrects *this* quantized base: load it onto the same base quantized the
same way (and, with `iters > 1`, re-quantized by `init_lrc` again, which is deterministic), not
onto the full-precision model, where it would add the quantization error instead of removing it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from minitrain.errors import UserError
from minitrain.lora import LoRALinear, LoRALinear4bit, LoRALinear8bit
from minitrain.weights import read_tensor, checkpoint_files, read_header

QUANTIZED_LORA = (LoRALinear4bit, LoRALinear8bit)


def lrc_factors(error: torch.Tensor, r: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(A (r, in), B (out, r))` fp32 with `scaling * B @ A` the best rank-r approximation of `error`."""
    U, S, Vh = torch.linalg.svd(error.float(), full_matrices=False)  # (out, k), (k,), (k, in)
    root = (S[:r] / scaling).sqrt()  # (r,)
    B = U[:, :r] * root  # (out, r)
    A = root[:, None] * Vh[:r]  # (r, in)
    return A, B


@dataclass
class LRCLayer:
    """One corrected layer: relative weight errors `||W - Wq - s B A|| / ||W||` before (B A = 0) and after."""

    name: str
    error_before: float
    error_after: float

    @property
    def ratio(self) -> float:
        """after / before: the share of the quantization error the adapter does not remove."""
        return self.error_after / self.error_before if self.error_before > 0 else 0.0


def quantized_lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(name, layer) of every LoRA layer whose base is bitsandbytes-quantized (4-bit or int8)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QUANTIZED_LORA)]


@torch.no_grad()
def init_lrc(model: nn.Module, fp_weights_source: str | os.PathLike, rank: int | None = None, *, iters: int = 1,
             log: Callable[[str], None] | None = None) -> list[LRCLayer]:
    """Initialise every LoRA layer over a quantized base to the rank-r SVD of its quantization error.

    fp_weights_source: the HF checkpoint folder the model was loaded from (`*.safetensors`,
        sharded or not); each needed weight is read alone, in file order, and freed after use.
    rank: the adapters' rank (None: each layer's own `r`); another value is a UserError, since
        the adapters' shapes are fixed by `apply_lora`.
    iters: LoftQ alternations (1: correct the base as loaded; T > 1 also re-quantizes the base).
    Layers over float bases are left as they are (zero-initialised B). Returns one `LRCLayer` per
    corrected layer.
    """
    if iters < 1:
        raise UserError(f"lrc iters={iters}: must be >= 1 (1: one SVD of the quantization error) — e.g. iters=1")
    layers = dict(quantized_lora_layers(model))
    if not layers:
        raise UserError("init_lrc: no LoRA layer sits on a quantized base — load the model with quantize=nf4 (or "
                        "int8) and apply LoRA to its linears first; a float base has no quantization error to correct")
    for name, m in layers.items():
        if rank is not None and rank != m.r:
            raise UserError(f"init_lrc: rank={rank} but {name} has a LoRA adapter of rank {m.r} — apply LoRA with "
                            f"r={rank}, or leave rank unset to use the adapters' own")
        if m.merged:
            raise UserError(f"init_lrc: {name} is merged — unmerge(model) first")
    folder = Path(fp_weights_source)
    wanted = {f"{name}.weight": name for name in layers}
    found: dict[str, tuple[Path, int, dict]] = {}
    for path in checkpoint_files(folder):
        header, start = read_header(path)
        for key, info in header.items():
            if key in wanted:
                found[key] = (path, start, info)
    missing = [k for k in wanted if k not in found]
    if missing:
        raise UserError(f"{folder}: has no {missing[0]}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} "
                        f"— pass the full-precision checkpoint the quantized model was loaded from")

    report = []
    by_file: dict[Path, list[str]] = {}
    for key, (path, _, info) in sorted(found.items(), key=lambda kv: (str(kv[1][0]), kv[1][2]["data_offsets"][0])):
        by_file.setdefault(path, []).append(key)
    for path, keys in by_file.items():
        with open(path, "rb") as f:
            for key in keys:
                _, start, info = found[key]
                name = wanted[key]
                m = layers[name]
                if list(info["shape"]) != [m.out_features, m.in_features]:
                    raise UserError(f"{path}: {key} has shape {tuple(info['shape'])} but the model's layer is "
                                    f"({m.out_features}, {m.in_features}) — pass the checkpoint this model was loaded from")
                W = read_tensor(f, path, start, info).to(device=m.lora_A.weight.device, dtype=torch.float32)
                report.append(_correct(name, m, W, iters))
                del W
    if log is not None and report:
        mean = sum(r.ratio for r in report) / len(report)
        ranks = ",".join(str(r) for r in sorted({layers[x.name].r for x in report}))
        log(f"lrc: {len(report)} adapters initialised to the rank-{ranks} SVD of their "
            f"quantization error ({iters} LoftQ iteration{'s' if iters > 1 else ''}); weight error "
            f"||W - Wq - sBA|| / ||W - Wq|| = {mean:.3f} on average (1.0 = zero-init)")
    return report


def _correct(name: str, m: LoRALinear, W: torch.Tensor, iters: int) -> LRCLayer:
    """Fit one layer's adapter (and, for iters > 1, its re-quantized base) to `W` (out, in) fp32."""
    norm = W.norm().item() or 1.0
    before = (W - m.dequantized_weight()).norm().item() / norm
    A = B = None
    for t in range(iters):
        if t > 0:  # LoftQ: quantize what the adapter does not carry, then fit the adapter to the rest
            m._store_weight(W - m.scaling * (B @ A))
        A, B = lrc_factors(W - m.dequantized_weight(), m.r, m.scaling)
    m.lora_A.weight.copy_(A.to(m.lora_A.weight.dtype))
    m.lora_B.weight.copy_(B.to(m.lora_B.weight.dtype))
    after = (W - m.dequantized_weight() - m.delta_weight()).norm().item() / norm
    return LRCLayer(name, before, after)
