"""Folding LoRA adapters into their base weights (`merge` / `unmerge`, `merged_state_dict`), with
the rounding error reported instead of lost.

On a quantized base a merge dequantizes, adds and requantizes: the error of each layer is
measured against the exact fp32 target and logged (a warning when the base is quantized or over
1% of an update is lost). `merged_state_dict` gives the HF-layout weights with every adapter
folded in, without changing the model: what `minitrain merge` and a full fine-tune's export write.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from minitrain.adapters.lora import LoRALinear, MergeError, loaded_bnb, lora_layers, quant_kind
from minitrain.adapters.lora_experts import expert_adapters
from minitrain.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class MergeReport:
    """Rounding errors of a merge / unmerge, one per layer; `str()` is the one-line summary."""

    layers: list[MergeError]

    @property
    def max_abs(self) -> float:
        return max((e.max_abs for e in self.layers), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((e.rel for e in self.layers), default=0.0)

    @property
    def max_rel_update(self) -> float:
        return max((e.rel_update for e in self.layers), default=0.0)

    def __str__(self) -> str:
        q = sum(e.quantized for e in self.layers)
        worst = max(self.layers, key=lambda e: e.rel_update, default=None)
        return (f"{len(self.layers)} layers ({q} quantized): max abs error {self.max_abs:.3g}, "
                f"max relative {self.max_rel:.3g}, up to {self.max_rel_update:.3g} of a LoRA update lost"
                + (f" (worst {worst.name})" if worst else ""))


def _check_untied(model: nn.Module, layers: list[tuple[str, LoRALinear]], where: str = "merge") -> None:
    """Merging into a weight shared with another module (tied lm_head / embeddings) changes both."""
    count: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        count.setdefault(id(p), []).append(n)
    for n, m in layers:
        names = count.get(id(m.weight), [])
        if len(names) > 1:
            other = next(x for x in names if x != f"{n}.weight")
            raise UserError(f"{where}: {n}.weight is tied to {other}, so merging would change both — "
                            f"keep the adapter unmerged, or untie the weights first")


def merge(model: nn.Module) -> MergeReport:
    """Fold every adapter into its base weight; the forward then skips the adapter path.

    On a quantized base this dequantizes, adds and requantizes: the rounding error is returned
    and logged (a warning when the base is quantized or over 1% of an update is lost), never
    silently dropped.
    """
    layers = lora_layers(model)
    experts = expert_adapters(model)
    if not layers and not experts:
        raise UserError("merge: the model has no LoRA layers — apply_lora or load_adapter first")
    _check_untied(model, layers)
    report = MergeReport([m.merge(n) for n, m in layers] + [_merge_experts(model, n, d, +1) for n, d in experts])
    _log_report("merge", report)
    return report


def _merge_experts(model: nn.Module, path: str, d: nn.Module, sign: int) -> MergeError:
    """Add (sign +1) or take out (-1) an expert adapter's update in its 3-D base parameter."""
    if d.merged == (sign > 0):
        raise UserError(f"{path}: {'already' if sign > 0 else 'not'} merged — "
                        f"{'call unmerge(model) first' if sign > 0 else 'nothing to unmerge'}")
    owner, _, leaf = path.rpartition(".")
    w = getattr(model.get_submodule(owner), leaf)
    if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point:
        raise UserError(f"{path}: a quantized expert weight cannot take an update — merge onto a float base "
                        f"(minitrain merge loads it unquantized)")
    delta = d.delta_weight().to(w.device)
    target = w.detach().float() + sign * delta
    with torch.no_grad():
        w.copy_(target)
    err = w.detach().float() - target
    en, tn, dn = err.norm().item(), target.norm().item(), delta.norm().item()
    d.merged = sign > 0
    return MergeError(name=path, max_abs=err.abs().max().item() if err.numel() else 0.0, rel=en / tn if tn else 0.0,
                      rel_update=en / dn if dn else 0.0, quantized=False)


def unmerge(model: nn.Module) -> MergeReport:
    """Undo `merge`: subtract every update from its base weight (a quantized base rounds again)."""
    layers = lora_layers(model)
    experts = expert_adapters(model)
    if not layers and not experts:
        raise UserError("unmerge: the model has no LoRA layers — nothing to unmerge")
    report = MergeReport([m.unmerge(n) for n, m in layers] + [_merge_experts(model, n, d, -1) for n, d in experts])
    _log_report("unmerge", report)
    return report


def _log_report(what: str, report: MergeReport) -> None:
    # quantized bases always round; a bf16 base can also swallow a small update
    loud = any(e.quantized for e in report.layers) or report.max_rel_update > 0.01
    level = logging.WARNING if loud else logging.INFO
    log.log(level, "%s: %s", what, report)


def merged_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's weights in HF layout with every adapter folded in; the model is not changed.

    No `lora_*` keys; quantized bases (LoRA-wrapped or not) come out dequantized. Floating tensors
    are cast to `dtype` if given; otherwise float bases keep their dtype and quantized ones
    become fp32 (pass `dtype=torch.bfloat16` for a smaller file).
    """
    _check_untied(model, lora_layers(model), "merged_state_dict")
    sd = model.state_dict()
    special: dict[str, nn.Module] = {n: m for n, m in model.named_modules()
                                     if isinstance(m, LoRALinear) or quant_kind(m) is not None}
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        owner = _owner(key, special)
        # of a LoRA / bnb layer keep only the bias here: the weight is rebuilt below, and its
        # lora_A / lora_B tensors and bnb's quantization statistics have no place in HF layout
        if owner is None or key == f"{owner}.bias":
            out[key] = t
    for n, m in special.items():
        if isinstance(m, LoRALinear):
            w = m.dequantized_weight()
            if not m.merged:
                w = w + m.delta_weight().to(w.device)
            base_dtype = m.weight.dtype if quant_kind(m.weight) is None else torch.float32
        elif quant_kind(m) == "ternary":  # an unwrapped ternary linear: dequantize
            w = m.dequantized_weight()
            base_dtype = torch.float32
        else:  # an unwrapped bitsandbytes linear: dequantize
            w = _dequantize_bnb(m)
            base_dtype = torch.float32
        out[f"{n}.weight"] = w.to(base_dtype)
    for path, d in expert_adapters(model):  # the experts' 3-D weights with their update, no adapter keys
        owner = path.rpartition(".")[0]
        for key in [k for k in out if k.startswith(f"{owner}.deltas.")]:
            del out[key]
        w = model.get_parameter(path)
        out[path] = (w.detach().float() + (0 if d.merged else d.delta_weight().to(w.device))).to(w.dtype)
    if dtype is not None:
        out = {k: (v.to(dtype) if v.dtype.is_floating_point else v) for k, v in out.items()}
    return out


def _owner(key: str, modules: dict[str, nn.Module]) -> str | None:
    """The name of the module in `modules` that `key` belongs to (`a.b.weight.absmax` -> `a.b`)."""
    head = key
    while "." in head:
        head = head.rpartition(".")[0]
        if head in modules:
            return head
    return None


def _dequantize_bnb(m: nn.Module) -> torch.Tensor:
    bnb = loaded_bnb()
    w = m.weight
    if quant_kind(m) == "4bit":
        data, qs = w.data, w.quant_state
        if getattr(qs, "packing_format_for_cpu", False):  # bnb's CPU inference layout (changes qs in place)
            data, qs = bnb.functional._convert_weight_packed_for_cpu_inverse(data.clone(), copy.copy(qs))
        return bnb.functional.dequantize_4bit(data, qs).to(torch.float32)
    scb = w.SCB if getattr(w, "SCB", None) is not None else m.state.SCB
    return bnb.functional.int8_vectorwise_dequant(w.data, scb).to(torch.float32)
