"""Where a run computes: the device, the dtype its frozen weights are stored in, and the autocast
dtype and loss scaler of its `precision`.

    pick_device(cfg.device)                   auto: the GPU when there is one, else the CPU
    base_dtype(cfg.precision, device)         bf16 on a bf16 GPU, else fp32 (frozen weights)
    resolve_precision(cfg.precision, device)  (autocast dtype or None, GradScaler or None)

How many threads a CPU run uses is `minitrain.cpu`.
"""

from __future__ import annotations

from typing import Any

import torch

from minitrain import distributed
from minitrain.errors import UserError


def pick_device(name: str) -> torch.device:
    """`auto`: the GPU when there is one, else the CPU; an unavailable device is a UserError.

    Under torchrun, `auto` / `cuda` is this process's GPU, `cuda:LOCAL_RANK`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if distributed.launched() and name.startswith("cuda") and torch.cuda.is_available():
        mine = f"cuda:{distributed.local_rank()}"
        if name not in ("cuda", mine):
            raise UserError(f"device={name}: under torchrun each process uses its own GPU ({mine} here) — "
                            f"use device=auto or device=cuda")
        name = mine
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={name}: no CUDA device is available here — use device=cpu (or auto)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"device={name}: there are {torch.cuda.device_count()} CUDA devices — "
                        f"use device=cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return device


def base_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype the frozen base weights are stored in for `precision` on `device`.

    bf16 (or fp16) where that is the compute dtype, halving memory; fp32 otherwise. Trainable
    tensors stay fp32 regardless (adapters are created in fp32; see `attach_adapters`).
    """
    if precision == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def resolve_precision(precision: str, device: torch.device) -> tuple[torch.dtype | None, Any]:
    """(autocast dtype or None for plain fp32, GradScaler or None) for `cfg.precision` on `device`.

    auto: bf16 autocast on a CUDA device with bf16, else fp32 (CPU bf16 autocast works but is
    slow, so only on request); fp16 always comes with a GradScaler (loss scaling)."""
    if precision == "auto":
        bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return (torch.bfloat16 if bf16_ok else None), None
    if precision == "fp32":
        return None, None
    if precision == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UserError("precision: this GPU has no bf16 support — use precision=fp16 or fp32")
        return torch.bfloat16, None
    if precision == "fp16":
        # loss SUMs give per-token gradients ~count times a mean's, so start lower than torch's 2**16
        return torch.float16, torch.amp.GradScaler(device.type, init_scale=2.0**10)
    raise UserError(f"precision: unknown value {precision!r} — use auto, bf16, fp32 or fp16")
