"""AdamW, the loop's default optimizer, without `torch.optim`.

Why not `torch.optim.AdamW`: in torch 2.13 `torch.optim.Optimizer.__init__` is wrapped in
`_disable_dynamo`, which imports `torch._dynamo` (and sympy) on first use: about one CPU-second
before the first step of every run (BENCHMARKS.md, "What stands in the way", item 7). This class
does the same arithmetic with the same `torch._foreach_*` calls as torch's multi-tensor AdamW
(`torch.optim.adam._multi_tensor_adam`, decoupled weight decay), so its results equal torch's
bit for bit (tests/test_optim.py), and it keeps torch's state layout, so the two swap freely:

- `state[p]`: `{"step": 0-d float32 CPU tensor, "exp_avg", "exp_avg_sq"}` (p's dtype and device),
  exactly torch's keys and dtypes: `minitrain.checkpoint` saves and loads it by parameter name,
  and checkpoints written with `torch.optim.AdamW` (fused or not) load here, and back;
- `state_dict()` / `load_state_dict()` in torch's format (state keyed by index, param groups with
  index lists): a state dict from either class loads into the other;
- `param_groups`: dicts with "params", "lr", "betas", "eps", "weight_decay"; set `g["lr"]` between
  steps (the loop does, from its schedule);
- `torch.amp.GradScaler` works with it: `unscale_` reads `param_groups` and keys its bookkeeping by
  `id(optimizer)`; `scaler.step` calls `step()` when no gradient overflowed;
- `register_step_post_hook(hook)`: `hook(optimizer, args, kwargs)` after each `step()`
  (`minitrain.objectives.ard.PriorSchedule.attach` uses it).

One code path: foreach on every device, also on CUDA, where the loop used `fused=True` before
(a fused kernel saves the one temporary of the size of the trainable tensors, `sqrt(exp_avg_sq)`,
which a LoRA run does not miss). Foreach ops accept DTensors, so FSDP2 shards train as they are.
Not a `torch.optim.Optimizer`: torch's LR schedulers, which check for one, do not take it
(minitrain's schedule sets `lr` itself). No amsgrad, maximize, capturable, differentiable or
complex parameters: those are refused, never ignored. torch's other group flags (foreach, fused,
decoupled_weight_decay), met in a loaded state dict, are kept in the group and change nothing.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any, Callable, Iterable

import torch
from torch.utils.hooks import RemovableHandle

UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")  # torch's flags this class refuses


class AdamW:
    """AdamW (Loshchilov & Hutter) with torch's defaults and torch's bias correction.

    For each parameter `p` with a gradient `g`, at its step `t` (counted per parameter):

        p *= 1 - lr * weight_decay                       (decoupled weight decay)
        m = beta1 * m + (1 - beta1) * g                  (exp_avg, as a lerp)
        v = beta2 * v + (1 - beta2) * g * g              (exp_avg_sq)
        p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    params: tensors, or dicts with "params" and any of the hyperparameters (per-group values).
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        if isinstance(params, torch.Tensor):
            raise TypeError("AdamW: params must be an iterable of tensors or of dicts, not a tensor")
        self.defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.param_groups: list[dict[str, Any]] = []
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)  # as torch's: {} until stepped
        self._post_hooks: OrderedDict[int, Callable] = OrderedDict()  # (a handle holds a weakref to it)
        groups = list(params)
        if not groups:
            raise ValueError("AdamW: got an empty parameter list")
        for g in groups if isinstance(groups[0], dict) else [{"params": groups}]:
            self.add_param_group(g)

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a group of parameters; hyperparameters it does not set come from the constructor's."""
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group = {**self.defaults, **group, "params": params}
        _check_group(group)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if len({id(p) for p in params} | seen) != len(params) + len(seen):
            raise ValueError("AdamW: a parameter appears twice (in one group or in two)")
        self.param_groups.append(group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient; returns `closure()`'s value, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            # one foreach call per (device, dtype): a CUDA kernel takes lists of one kind only
            for params in _by_device_and_dtype(p for p in group["params"] if p.grad is not None):
                grads = [p.grad for p in params]
                states = [self._state_of(p) for p in params]
                steps = [s["step"] for s in states]
                exp_avgs = [s["exp_avg"] for s in states]
                exp_avg_sqs = [s["exp_avg_sq"] for s in states]

                torch._foreach_add_(steps, 1.0)
                if wd != 0:
                    torch._foreach_mul_(params, 1 - lr * wd)
                torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
                # bias corrections as Python floats, per parameter (its own step), as torch computes them
                t = [s.item() for s in steps]
                step_sizes = [-lr / (1 - beta1**n) for n in t]
                bias_correction2_sqrt = [(1 - beta2**n) ** 0.5 for n in t]
                denom = torch._foreach_sqrt(exp_avg_sqs)  # the one temporary: 1 x the parameters
                torch._foreach_div_(denom, bias_correction2_sqrt)
                torch._foreach_add_(denom, eps)
                torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)
                del denom
        for hook in list(self._post_hooks.values()):
            hook(self, (), {})
        return loss

    def _state_of(self, p: torch.Tensor) -> dict[str, Any]:
        """p's state, created at its first step: torch's keys, dtypes and placement (step on the CPU)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (`set_to_none`, the default) or zero them in place."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def register_step_post_hook(self, hook: Callable[[Any, tuple, dict], None]) -> RemovableHandle:
        """Call `hook(optimizer, args, kwargs)` after every `step()`; `.remove()` on the handle undoes it."""
        handle = RemovableHandle(self._post_hooks)
        self._post_hooks[handle.id] = hook
        return handle

    def state_dict(self) -> dict[str, Any]:
        """torch's format: `{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}`.

        Parameters are numbered in group order. The state tensors are the optimizer's own (not
        copies), as in torch: save or clone them before stepping again if you need them as they are.
        """
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            ids = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: dict(s) for p, s in self.state.items() if s}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of `torch.optim.AdamW`; the groups must match in number and size.

        The saved hyperparameters replace the current ones (as in torch). State tensors are copied
        to each parameter's device and dtype; `step` becomes a float32 CPU tensor (torch's fused
        and capturable AdamW keep it on the parameter's device).
        """
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"AdamW: loaded state dict has {len(saved)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("AdamW: loaded state dict has a parameter group that does not match the size of "
                             "this optimizer's group")
        groups = [{**s, "params": g["params"]} for s, g in zip(saved, self.param_groups)]
        for g in groups:
            _check_group(g)
        by_index = {i: p for s, g in zip(saved, groups) for i, p in zip(s["params"], g["params"])}
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for i, entries in state_dict["state"].items():
            p = by_index[i]
            state[p] = {k: _placed(k, v, p) for k, v in entries.items()}
        self.param_groups, self.state = groups, state


def _placed(key: str, value: Any, p: torch.Tensor) -> Any:
    """A loaded state entry as `step` expects it: a copy, on p's device in p's dtype (step: float32 CPU)."""
    if key == "step":
        return torch.tensor(float(value), dtype=torch.float32)  # also an old torch's plain float
    if isinstance(value, torch.Tensor):
        return value.to(device=p.device, dtype=p.dtype if p.is_floating_point() else value.dtype, copy=True)
    return value


def _check_group(group: dict[str, Any]) -> None:
    """Refuse what this AdamW would otherwise silently do differently from what was asked."""
    on = [k for k in UNSUPPORTED if group.get(k)]
    if on:
        raise ValueError(f"AdamW: {', '.join(on)} not supported by minitrain.optim.AdamW — use torch.optim.AdamW "
                         f"(train() takes it as optimizer=)")
    beta1, beta2 = group["betas"]
    if not (group["lr"] >= 0 and group["eps"] >= 0 and group["weight_decay"] >= 0
            and 0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"AdamW: invalid hyperparameters lr={group['lr']}, betas={group['betas']}, "
                         f"eps={group['eps']}, weight_decay={group['weight_decay']}")
    for p in group["params"]:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"AdamW: params must be tensors, got {type(p).__name__}")
        if not (p.is_leaf or p.retains_grad):
            raise ValueError("AdamW: cannot optimize a non-leaf tensor")
        if p.is_complex():
            raise ValueError("AdamW: complex parameters are not supported — use torch.optim.AdamW")


def _by_device_and_dtype(params: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` split into lists of one device and dtype each, in order of first appearance."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    return list(groups.values())
