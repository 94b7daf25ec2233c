"""LoRA on the experts of a mixture-of-experts model: each expert its own low-rank pair.

An experts module (the model contract: a module with `expert_projections`, the names of its 3-D
parameters, each `(E, out, in)` or with `in_out` `(E, in, out)`, and a `deltas` ModuleDict whose
entry for a projection, called, gives the factors the module adds to that product) gets an
`ExpertLoRA` per targeted projection: `lora_A` (E, r, in) and `lora_B` (E, out, r), the update of
expert e `scaling * B[e] @ A[e]`, computed by the floor's `grouped_linear` over the rows the experts
module has already sorted by expert, inside its grouped product, never a loop over tokens.

Targets (`split_targets`): an expert parameter is named by its path (`experts.gate_up_proj`,
`mlp.experts.down_proj`: peft's `target_parameters`), by "all-linear", or by the names the model's
`expert_aliases` maps onto it (HF's per-expert names, `gate_proj` / `up_proj` -> `gate_up_proj`, as
peft 0.21 maps them for Qwen3-MoE and Mixtral). On such a model a dense linear whose name is an alias
(a Qwen3-MoE `mlp_only_layers` MLP) would be saved under a name peft moves onto the experts: it is
left unadapted and named in the trainable report, never written where peft would drop it.

On disk (`minitrain.adapters.peft_format`) an expert adapter is peft's `ParamWrapper`: `lora_A` as
(E * r, in), expert-major, and `lora_B` as (out, r * E), rank-major (`B.reshape(out, r, E)`), under the
experts module's key, one `base_layer.` deeper for each adapted projection registered after it (peft
wraps a module's parameters in their registration order, gate_up_proj first: the innermost).
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import torch
import torch.nn as nn

from minitrain.errors import UserError

ALL_LINEAR = "all-linear"


class _Factor(nn.Module):
    """One factor of an expert adapter, a 3-D `weight`, in a module of its own so its key ends in
    `.lora_A.weight` / `.lora_B.weight` like a linear adapter's."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class ExpertLoRA(nn.Module):
    """The low-rank update of one 3-D expert parameter: expert e adds `scaling * x A[e]^T B[e]^T`.

    Built from the experts module and the projection's name; `lora_A` (E, r, in) is drawn as peft
    draws its (E * r, in) matrix (kaiming-uniform, a = sqrt(5)) and `lora_B` (E, out, r) starts at
    zero, so the model starts equal to its base. forward() -> the factors and scaling the experts
    module's grouped product adds (models/layers.py's `LowRank`), or None while disabled or merged."""

    def __init__(self, experts: nn.Module, name: str, r: int, alpha: float, rslora: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        w = getattr(experts, name)
        E = w.shape[0]
        self.in_out = bool(experts.in_out)
        self.in_features, self.out_features = (w.shape[1], w.shape[2]) if self.in_out else (w.shape[2], w.shape[1])
        self.num_experts, self.r, self.alpha, self.rslora = E, r, alpha, rslora
        self.scaling = alpha / (math.sqrt(r) if rslora else r)
        self.lora_A = _Factor((E, r, self.in_features), dtype, w.device)
        self.lora_B = _Factor((E, self.out_features, r), dtype, w.device)
        self.reset_lora()
        self.disabled = False  # set by `disable_adapters`
        self.merged = False

    def reset_lora(self) -> None:
        if self.lora_A.weight.device.type == "meta":
            return
        with torch.no_grad():
            a = torch.empty(self.num_experts * self.r, self.in_features, dtype=self.lora_A.weight.dtype,
                            device=self.lora_A.weight.device)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            self.lora_A.weight.copy_(a.view_as(self.lora_A.weight))
            self.lora_B.weight.zero_()

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(A, B, scaling): the factors the experts module adds to its grouped product (the floor's `LowRank`),
        or None while disabled or merged.
        (Called as a module, so that the audit's hooks see where and whether it ran with gradients on.)"""
        if self.disabled or self.merged:
            return None
        return self.lora_A.weight, self.lora_B.weight, self.scaling

    def delta_weight(self) -> torch.Tensor:
        """scaling * B[e] @ A[e] for every expert, fp32, in the parameter's layout ((E, out, in), or
        (E, in, out) with `in_out`)."""
        d = torch.bmm(self.lora_B.weight.detach().float(), self.lora_A.weight.detach().float()) * self.scaling
        return d.transpose(1, 2) if self.in_out else d

    def extra_repr(self) -> str:
        return (f"{self.num_experts} experts, in={self.in_features}, out={self.out_features}, r={self.r}, "
                f"alpha={self.alpha}")


def expert_parameters(model: nn.Module) -> list[str]:
    """Every 3-D expert parameter an adapter can target, as `module.param` paths, in model order."""
    return [f"{n}.{p}" for n, m in model.named_modules() if hasattr(m, "expert_projections")
            for p in m.expert_projections]


def hits_params(m: nn.Module) -> bool:
    """Whether module `m` is an experts module (its own 3-D parameters are the targets, not it)."""
    return hasattr(m, "expert_projections")


def _matches(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


def split_targets(model: nn.Module, targets: Sequence[str] | str) -> tuple[list[str], Sequence[str] | str, set[str]]:
    """(the expert parameters `targets` select, the targets left for the linear layers, the leaf names
    of linears never to adapt: the model's `expert_aliases`, which peft saves onto the experts).

    Named targets that select only expert parameters (a path, or an alias) leave the linear list;
    "all-linear" selects every expert parameter and stays; a regular expression is matched against the
    parameters' paths and stays for the linears too. An alias of a fused parameter named without its
    partner (`gate_proj` without `up_proj`) is refused: one adapter on `gate_up_proj` adapts both."""
    params = expert_parameters(model)
    if not params:
        return [], targets, set()
    aliases: dict[str, str] = dict(getattr(model, "expert_aliases", None) or {})
    if targets == ALL_LINEAR:
        return params, targets, set(aliases)
    if isinstance(targets, str):
        return [p for p in params if re.fullmatch(targets, p)], targets, set(aliases)
    chosen: list[str] = []
    linear_targets: list[str] = []
    for t in targets:
        if t in aliases:
            chosen += [p for p in params if p.rsplit(".", 1)[1] == aliases[t]]
        else:
            hits = [p for p in params if _matches(p, t)]
            chosen += hits
            # (a name both kinds have, `down_proj`, selects both; a quantized expert weight is a module at its
            # parameter's path, not a linear)
            if not hits or any(_matches(n, t) for n, m in model.named_modules()
                               if n and not hits_params(m) and n not in params):
                linear_targets.append(t)
    for fused in set(aliases.values()):
        parts = [a for a, f in aliases.items() if f == fused and a in targets]
        need = {a for a, f in aliases.items() if f == fused and a != fused}
        groups = [g for g in (("gate_proj", "up_proj"), ("w1", "w3")) if set(g) <= need]
        if parts and not any(set(g) <= set(parts) for g in groups) and fused not in targets and len(need) > 1:
            missing = sorted(set(next((g for g in groups if set(g) & set(parts)), need)) - set(parts))
            raise UserError(f"targets {', '.join(parts)}: the experts hold them fused in one parameter {fused!r}, "
                            f"and an adapter on it adapts all of them — also name {', '.join(missing)} (or "
                            f"{fused}), or leave {', '.join(parts)} out")
    return list(dict.fromkeys(p for p in params if p in chosen)), linear_targets, set(aliases)


def attach(model: nn.Module, paths: Sequence[str], r: int, alpha: float, rslora: bool, dtype: torch.dtype,
           rank_for: Any = None) -> None:
    """Put an `ExpertLoRA` on each expert parameter `paths` names (`rank_for(path)`: its rank, else r)."""
    for path in paths:
        owner, _, name = path.rpartition(".")
        experts = model.get_submodule(owner)
        if name in experts.deltas:
            raise UserError(f"{path}: already has a LoRA adapter — adapters are applied once (rule 4)")
        rank = rank_for(path) if rank_for is not None else r
        experts.deltas[name] = ExpertLoRA(experts, name, rank, alpha, rslora, dtype).train(experts.training)


def expert_adapters(model: nn.Module) -> list[tuple[str, ExpertLoRA]]:
    """(the expert parameter's path, its adapter) for every expert adapter of the model."""
    return [(f"{n}.{k}", d) for n, m in model.named_modules() if isinstance(getattr(m, "deltas", None), nn.ModuleDict)
            for k, d in m.deltas.items() if isinstance(d, ExpertLoRA)]


# ----------------------------------------------------------------------------- peft's layout


def peft_tensors(model: nn.Module, prefix: str, state: dict[str, torch.Tensor] | None = None
                 ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The expert adapters as peft saves a `ParamWrapper` (see the module docstring): {key: tensor} and
    the `target_parameters` list."""
    state = state or {}
    tensors: dict[str, torch.Tensor] = {}
    by_module: dict[str, list[tuple[str, ExpertLoRA]]] = {}
    for path, d in expert_adapters(model):
        owner, _, name = path.rpartition(".")
        by_module.setdefault(owner, []).append((name, d))
    for owner, items in by_module.items():
        items.sort(key=lambda kv: model.get_submodule(owner).expert_projections.index(kv[0]))
        for i, (name, d) in enumerate(items):
            depth = "base_layer." * (len(items) - 1 - i)
            key = f"{owner}.deltas.{name}"
            a = state.get(f"{key}.lora_A.weight", d.lora_A.weight).detach()  # (E, r, in)
            b = state.get(f"{key}.lora_B.weight", d.lora_B.weight).detach()  # (E, out, r)
            E, r = a.shape[0], a.shape[1]
            tensors[f"{prefix}{owner}.{depth}lora_A.weight"] = a.reshape(E * r, -1).contiguous().cpu()
            tensors[f"{prefix}{owner}.{depth}lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * E).contiguous().cpu()
    return tensors, _target_parameters(model, [p for p, _ in expert_adapters(model)])


def _target_parameters(model: nn.Module, paths: list[str]) -> list[str]:
    """peft's `target_parameters` for these paths: `<block>.experts.<param>` suffixes when those select
    exactly them (the usual case), else the full paths; in each module's projection order."""
    order = {p: i for i, p in enumerate(("gate_up_proj", "down_proj"))}
    short = sorted({".".join(p.rsplit(".", 3)[-3:]) for p in paths}, key=lambda s: order.get(s.rsplit(".", 1)[1], 9))
    every = expert_parameters(model)
    if {p for p in every if any(_matches(p, s) for s in short)} == set(paths):
        return short
    return sorted(paths, key=lambda s: order.get(s.rsplit(".", 1)[1], 9))


def from_peft(model: nn.Module, tensors: dict[str, torch.Tensor], target_parameters: Sequence[str], where: str
              ) -> tuple[list[str], dict[str, torch.Tensor]]:
    """peft's ParamWrapper tensors (keys normalised: `<module>.[base_layer.]*lora_A.weight`) -> (the expert
    parameter paths they adapt, {our key: tensor} in our layout); those keys are removed from `tensors`.
    Which projection each nesting depth holds: peft's order (the module's first registered parameter is
    the innermost), checked against the shapes."""
    params = expert_parameters(model)
    modules = {p.rpartition(".")[0] for p in params}
    found: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key in list(tensors):
        m = re.fullmatch(r"(.+?)\.((?:base_layer\.)*)(lora_[AB])\.weight", key)
        if m and m.group(1) in modules:
            found.setdefault(m.group(1), {}).setdefault(m.group(2).count("base_layer."), {})[m.group(3)] = tensors.pop(key)
    paths: list[str] = []
    ours: dict[str, torch.Tensor] = {}
    for owner, depths in found.items():
        experts = model.get_submodule(owner)
        # peft wraps a module's parameters in their registration order (the first is innermost), whatever
        # the order of `target_parameters`
        listed = [n for n in experts.expert_projections
                  if any(_matches(f"{owner}.{n}", t) for t in target_parameters)]
        if len(listed) != len(depths):
            raise UserError(f"{where}: {owner} holds {len(depths)} expert adapters but target_parameters "
                            f"{list(target_parameters)} select {len(listed)} of its parameters — the file and "
                            f"adapter_config.json do not belong together")
        for i, name in enumerate(listed):
            ab = depths.get(len(listed) - 1 - i, {})
            if set(ab) != {"lora_A", "lora_B"}:
                raise UserError(f"{where}: {owner}: lora_A / lora_B of {name} incomplete — save the adapter again")
            w = getattr(experts, name)
            E = w.shape[0]
            n_in, n_out = (w.shape[1], w.shape[2]) if experts.in_out else (w.shape[2], w.shape[1])
            a, b = ab["lora_A"], ab["lora_B"]
            if a.dim() != 2 or a.shape[0] % E or a.shape[1] != n_in or tuple(b.shape) != (n_out, a.shape[0]):
                raise UserError(f"{where}: the expert adapter of {owner}.{name} has lora_A {tuple(a.shape)} and "
                                f"lora_B {tuple(b.shape)}, but {E} experts of in {n_in}, out {n_out} need "
                                f"(E * r, {n_in}) and ({n_out}, E * r) — load it onto the base model it was trained on")
            r = a.shape[0] // E
            key = f"{owner}.deltas.{name}"
            ours[f"{key}.lora_A.weight"] = a.reshape(E, r, n_in)
            ours[f"{key}.lora_B.weight"] = b.reshape(n_out, r, E).permute(2, 0, 1).contiguous()
            paths.append(f"{owner}.{name}")
    return paths, ours
