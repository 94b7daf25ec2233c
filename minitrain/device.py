"""Where a run computes: the device, the dtype its frozen weights are stored in, and the autocast
dtype and loss scaler of its `precision`.

    pick_device(cfg.device)                   auto: the GPU when there is one, else the CPU
    base_dtype(cfg.precision, device)         bf16 on a bf16 GPU, else fp32 (frozen weights)
    resolve_precision(cfg.precision, device)  (autocast dtype or None, GradScaler or None)
    with eager(): ...                         compiled functions run eagerly inside

How many threads a CPU run uses is `minitrain.cpu`.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

from minitrain.parallel import distributed
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


def resolve_attention(attention: str, model: Any, device: torch.device, compiled: bool) -> str:
    """What `attention` (auto | sdpa | flex) means for `model` on `device`: "sdpa" or "flex", the value
    of the model's `packed_attention` (docs/contracts.md), which only rows of several sequences use
    (packing, DPO's shared prompt, GRPO's shared-prompt layout); padded batches are not affected.

    auto: flex on CUDA when the blocks are compiled (`compiled`; eager FlexAttention is an unfused
    reference, slower than SDPA) and the model has the path, else sdpa. flex elsewhere is a
    UserError: torch's FlexAttention has no backward on a CPU, and a family without
    `packed_attention` (T5) has no FlexAttention path."""
    has = hasattr(model, "packed_attention")
    if attention == "auto":
        return "flex" if has and compiled and device.type == "cuda" and _has_flex() else "sdpa"
    if attention == "flex":
        if not has:
            raise UserError("attention=flex: this model family has no FlexAttention path (the decoder-only "
                            "families have one) — use attention=sdpa")
        if device.type != "cuda":
            raise UserError(f"attention=flex: torch's FlexAttention has no backward on {device.type}, so it cannot "
                            f"train there — use attention=auto or sdpa (flex is for CUDA)")
        if not _has_flex():
            raise UserError(f"attention=flex: torch {torch.__version__} has no FlexAttention — use torch>=2.5 "
                            f"or attention=sdpa")
    return attention


def set_attention(cfg: Any, model: Any, device: torch.device, log: Any = None) -> None:
    """`resolve_attention(cfg.attention, ...)` set as the model's `packed_attention` (when it has one);
    logs when that is flex. `train` calls it for the model it trains (and compiles); the recipes'
    `load_model` only resolves, to refuse a bad value before anything is written."""
    compiled = bool(getattr(cfg, "compile", False)) and device.type == "cuda"
    kind = resolve_attention(getattr(cfg, "attention", "auto"), model, device, compiled)
    if hasattr(model, "packed_attention") and model.packed_attention != kind:
        model.packed_attention = kind
        if log is not None and kind == "flex":
            log("attention: FlexAttention for rows of several sequences (block masks from document ids)"
                + ("" if compiled else "; notice: without compile=true it runs unfused, slower than sdpa"))


def _has_flex() -> bool:
    """Whether this torch has `torch.nn.attention.flex_attention` (found, not imported: it imports dynamo)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    except ModuleNotFoundError:
        return False


def eager() -> contextlib.AbstractContextManager:
    """A context in which compiled functions (the blocks of compile=true) run eagerly, for passes that
    must not compile: decoding steps (a new cache length each) and the gradient-path audit.
    `torch.compiler.set_stance` imports torch._dynamo (about 65 MiB): a no-op until something has."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")
