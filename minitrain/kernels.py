"""Optional CUDA kernels for Qwen3.5's Gated DeltaNet layers: flash-linear-attention's (`fla`, the `kernels`
extra: `pip install "minitrain[kernels]"`) chunked gated delta rule and causal convolution, both Triton.

They are never required. `use_kernels(model, setting)` puts them on every DeltaNet layer of a model on CUDA
(`kernels=auto`, the default: when `fla` imports; `kernels=fla`: or one line saying what to install;
`kernels=torch`: never). The layer then runs, for a forward without a KV cache (training, evaluation,
a reference model's log-probs):

    conv    fla's `causal_conv1d` with SiLU, over the batch's sequences laid end to end (`cu_seqlens`:
            `models.qwen3_5.sequence_bounds`), so a packed row's documents and a padded row's padding
            restart it exactly where the torch path's segments do
    scan    fla's `chunk_gated_delta_rule` on the same sequences: q / k L2-normalised in the kernel (x /
            sqrt(sum x^2 + 1e-6), as the torch path), scaled by dk^-1/2, each q / k head serving
            Hv / Hk consecutive value heads (fla's grouped values, the torch path's repeat_interleave)

Generation (a KV cache: the sampler's prefill and decoding) keeps the torch path. The kernels compute in
the inputs' dtype with fp32 accumulation (bf16 under autocast), where the torch path computes the scan in
fp32: equal to its rounding, which `tests/test_cuda.py::test_fla_kernels_equal_torch_path` measures on a
GPU (`tools/gpu_check.py --parts tests`).
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch
from torch import nn

from minitrain.errors import UserError

SETTINGS = ("auto", "fla", "torch")


def fla_installed() -> bool:
    """Whether flash-linear-attention imports here (without importing it)."""
    return importlib.util.find_spec("fla") is not None


class FlaDeltaNet:
    """The two kernels a `GatedDeltaNet` layer calls (see the module docstring); stateless, one per model."""

    def __init__(self) -> None:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        self._conv, self._rule = causal_conv1d, chunk_gated_delta_rule
        # Triton kernels of their own: a compiled block calls them as they are (wrapped here, not where the class
        # is defined: `torch.compiler.disable` imports dynamo, which a run without these kernels never needs)
        self.conv, self.rule = torch.compiler.disable(self.conv), torch.compiler.disable(self.rule)

    def conv(self, mixed: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        """silu(causal depthwise convolution) of mixed (B, C, T) with weight (C, 1, K), restarting at each
        sequence of `bounds` -> (B, C, T)."""
        B, C, T = mixed.shape
        x = mixed.transpose(1, 2).reshape(1, B * T, C)
        y, _ = self._conv(x, weight.squeeze(1), activation="silu", cu_seqlens=bounds)
        return y.view(B, T, C).transpose(1, 2)

    def rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             bounds: torch.Tensor) -> torch.Tensor:
        """The gated delta rule over each sequence of `bounds`, from a zero state: q, k (B, T, Hk, dk),
        v (B, T, H, dv), g (log decay) and beta (B, T, H) -> o (B, T, H, dv)."""
        B, T = v.shape[:2]
        flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
        o, _ = self._rule(*flat, use_qk_l2norm_in_kernel=True, cu_seqlens=bounds)
        return o.view(B, T, *o.shape[2:])


def deltanet_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that take linear-attention kernels (a `kernels` attribute and a
    `_forward_kernels` method: Qwen3.5's `GatedDeltaNet`)."""
    return [m for m in model.modules() if hasattr(m, "kernels") and hasattr(m, "_forward_kernels")]


def attach(model: nn.Module, kernels: object | None) -> int:
    """Set `kernels` (None: the torch path) on every DeltaNet layer of `model`; returns how many."""
    layers = deltanet_layers(model)
    for m in layers:
        m.kernels = kernels
    return len(layers)


def resolve_kernels(setting: str, model: nn.Module, device: torch.device) -> bool:
    """Whether `setting` (auto | fla | torch) puts fla's kernels on `model` on `device` (module docstring).
    `kernels=fla` where they cannot apply is a `UserError` naming what is missing; the recipes' model
    loading calls this before anything is written, `train` then `use_kernels`."""
    if setting not in SETTINGS:
        raise UserError(f"kernels={setting!r} — use one of {', '.join(SETTINGS)}")
    if setting == "torch" or not deltanet_layers(model):
        return False
    cuda = torch.device(device).type == "cuda"
    if cuda and fla_installed():
        return True
    if setting == "fla":
        why = ("fla's kernels run on CUDA only" if not cuda else
               "flash-linear-attention is not installed: pip install \"minitrain[kernels]\"")
        raise UserError(f"kernels=fla: {why} — or leave kernels=auto (the torch path where they cannot apply)")
    return False


def use_kernels(model: nn.Module, setting: str, device: torch.device,
                log: Callable[[str], None] = print) -> int:
    """Put fla's kernels on `model`'s DeltaNet layers when `resolve_kernels` says so; returns the number of
    layers that got them (0: the torch path)."""
    if not resolve_kernels(setting, model, device):
        return 0
    n = attach(model, FlaDeltaNet())
    log(f"Gated DeltaNet: fla's chunked kernels on {n} layers (kernels=torch for the torch path)")
    return n
