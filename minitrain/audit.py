"""Gradient-path audit: does every trainable tensor actually receive a gradient from the loss?

The most common silent failure in fine-tuning is an adapter that is not training (field reports
000, 002, 004): reentrant checkpointing over frozen embeddings, a loss built from detached logits,
a `no_grad` section, an adapter loaded frozen, a layer wrapped twice whose outer copy bypasses the
inner one, an optimizer that does not hold the trainable tensors. `audit` runs ONE forward and
backward on a real batch (no optimizer step, gradients and RNG restored afterwards) and reports,
per trainable tensor and per module, whether its gradient is

    unreachable  None: no autograd path from the loss (the run would silently not train it)
    zero         exactly zero (suspicious unless expected)
    zero at init exactly zero because its zero-initialised, trainable partner (LoRA B) is zero:
                 confirmed by a probe that makes B non-zero and sees the gradient appear (rule 5);
                 any other exact zero (a frozen zero partner, a `* 0` term) is a problem
    non-finite   NaN / inf
    ok           with its norm

and, when a path is cut, names where: the module whose output stopped requiring grad, a region
that ran under `no_grad`, a loss detached from the model's output, an adapter merged into its
base (or disabled) whose layers it lists. A gradient that is exactly zero with no partner that
can move (a LoRA B frozen at zero, a loss that reaches the tensors only through `* 0`) is a
problem: no verdict with such a tensor is "healthy". `preflight` is what the training loop runs
before step 1 (recipes run it in `run.prepare_out_dir`, before `out` is written);
`minitrain audit` prints the same report for any recipe.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint as tuc
from torch import nn

from minitrain.parallel import distributed
from minitrain.adapters.lora import LoRALinear, logical_numel
from minitrain.device import eager
from minitrain.errors import UserError

Objective = Callable[[nn.Module, dict], tuple[torch.Tensor, Any, dict]]

OK, ZERO, ZERO_AT_INIT, UNREACHABLE, NONFINITE = "ok", "zero", "zero at init", "unreachable", "non-finite"
_LAYER = re.compile(r"^(.*?\b(?:layers|block|h)\.\d+)\.")


@dataclass
class TensorAudit:
    """One trainable tensor: its status and gradient norm (None when unreachable)."""

    name: str
    module: str
    status: str
    grad_norm: float | None
    numel: int


@dataclass
class AuditReport:
    """What `audit` found. `ok` is False when any problem would make the run silently wrong."""

    tensors: list[TensorAudit]
    problems: list[str]  # broken gradient paths, each one line: what is wrong, where, what to do
    numeric: list[str]  # non-finite loss or gradients on this batch (the loop skips such steps: rule 6)
    notes: list[str]  # worth knowing, not fatal
    frozen: int  # number of frozen parameter tensors
    frozen_numel: int
    quantized: list[str]  # quantized (non-float) tensors, never trainable
    layer_norms: dict[str, float]  # per block: gradient norm of its trainable tensors
    loss: float | None
    # not fatal, but the verdict cannot be "healthy": some (not all) tensors get an exactly zero
    # gradient on this batch with nothing to explain it (data-dependent, or a `* 0` term)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.numeric

    @property
    def paths_ok(self) -> bool:
        """Every trainable tensor is reachable and applied: what the preflight requires."""
        return not self.problems

    def verdict(self) -> str:
        n = len(self.tensors)
        if self.ok and self.warnings:
            return f"audit: WARNING — {self.warnings[0]}" + (f" (+{len(self.warnings) - 1} more)"
                                                              if len(self.warnings) > 1 else "")
        if self.ok:
            reached = sum(t.status in (OK, ZERO_AT_INIT) for t in self.tensors)
            init = sum(t.status == ZERO_AT_INIT for t in self.tensors)
            extra = f" ({init} zero at init as expected: their LoRA B is zero; probe confirmed)" if init else ""
            return f"audit: healthy — {reached} of {n} trainable tensors receive gradient from the loss{extra}"
        found = self.problems + self.numeric
        return f"audit: BROKEN — {found[0]}" + (f" (+{len(found) - 1} more)" if len(found) > 1 else "")

    def modules(self) -> list[tuple[str, int, str, float | None]]:
        """Roll-up per module: (module, tensors, worst status, gradient norm)."""
        order = [NONFINITE, UNREACHABLE, ZERO, ZERO_AT_INIT, OK]
        rows: dict[str, list[TensorAudit]] = {}
        for t in self.tensors:
            rows.setdefault(t.module, []).append(t)
        out = []
        for mod, ts in rows.items():
            status = min((t.status for t in ts), key=order.index)
            norms = [t.grad_norm for t in ts if t.grad_norm is not None and math.isfinite(t.grad_norm)]
            out.append((mod, len(ts), status, math.sqrt(sum(x * x for x in norms)) if norms else None))
        return out

    def table(self) -> str:
        """The human-readable report: per-module table, per-layer norms, problems, verdict."""
        rows = self.modules()
        w = max([len("module")] + [len(m) for m, *_ in rows])
        lines = [f"{'module':<{w}}  tensors  {'status':<12}  grad norm", "-" * (w + 38)]
        for mod, n, status, norm in rows:
            lines.append(f"{mod:<{w}}  {n:>7}  {status:<12}  {_fmt(norm)}")
        if self.layer_norms:
            lines.append("")
            lines.append("gradient norm per layer (does the signal reach the deep layers?):")
            for layer, norm in self.layer_norms.items():
                lines.append(f"  {layer:<{w}}  {_fmt(norm)}")
        lines.append("")
        lines.append(f"frozen: {self.frozen} tensors ({self.frozen_numel:,} parameters)"
                     + (f", of which {len(self.quantized)} quantized" if self.quantized else ""))
        if self.loss is not None:
            lines.append(f"loss on the audit batch: {self.loss:.6g}")
        for n in self.notes:
            lines.append(f"note: {n}")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        for p in self.problems + self.numeric:
            lines.append(f"problem: {p}")
        n = len(self.problems) + len(self.numeric)
        lines.append(self.verdict() if self.ok else f"audit: BROKEN — {n} problem{'s' * (n > 1)} above")
        return "\n".join(lines)

    def to_json(self) -> str:
        d = asdict(self)
        d["ok"] = self.ok
        d["verdict"] = self.verdict()
        d["modules"] = [dict(zip(("module", "tensors", "status", "grad_norm"), r)) for r in self.modules()]
        return json.dumps(d, indent=2, default=_json_default)


def _json_default(x: Any) -> Any:
    return None if isinstance(x, float) and not math.isfinite(x) else str(x)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3e}"


# ----------------------------------------------------------------------------- forward records


@dataclass
class _Call:
    """What one module call looked like in the audited forward."""

    grad_enabled: bool
    in_requires_grad: bool
    out_requires_grad: bool


def _any_requires_grad(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.requires_grad
    if isinstance(x, (list, tuple)):
        return any(_any_requires_grad(v) for v in x)
    if isinstance(x, dict):
        return any(_any_requires_grad(v) for v in x.values())
    return False


@contextlib.contextmanager
def _record_calls(model: nn.Module) -> Iterator[tuple[dict[str, list[_Call]], set[str]]]:
    """Record every module call of the forward run inside: grad mode at entry, whether its inputs
    and outputs require grad; and which modules ran reentrant activation checkpointing."""
    calls: dict[str, list[_Call]] = {}
    reentrant: set[str] = set()
    stack: list[tuple[str, bool]] = []
    handles = []
    for name, mod in model.named_modules():
        def pre(m, args, kwargs, _name=name or "<model>"):
            stack.append((_name, torch.is_grad_enabled()))

        def post(m, args, kwargs, out, _name=name or "<model>"):
            grad_at_entry = stack.pop()[1] if stack else torch.is_grad_enabled()
            calls.setdefault(_name, []).append(
                _Call(grad_at_entry, _any_requires_grad((args, kwargs)), _any_requires_grad(out)))

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))

    # torch.utils.checkpoint looks CheckpointFunction up at call time: a subclass that notes which
    # module is running tells reentrant checkpointing apart from a user's no_grad section.
    original = tuc.CheckpointFunction

    class _Watched(original):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx, run_function, preserve_rng_state, *args):
            reentrant.add(stack[-1][0] if stack else "<model>")
            return original.forward(ctx, run_function, preserve_rng_state, *args)

    tuc.CheckpointFunction = _Watched
    try:
        yield calls, reentrant
    finally:
        tuc.CheckpointFunction = original
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _expert_tokens(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """How many (token, expert) pairs each expert of each experts module received in the forward run
    inside: {module name: (E,) counts} (the MoE contract: a module with `expert_projections` and
    `num_experts`, called `(x, indices (N, K), weights)`)."""
    routed: dict[str, torch.Tensor] = {}

    def pre(m, args, _name):
        if len(args) < 2 or not isinstance(args[1], torch.Tensor):  # (not called as the contract says: no count)
            return
        got = torch.bincount(args[1].detach().flatten().cpu(), minlength=m.num_experts)
        routed[_name] = routed[_name] + got if _name in routed else got

    handles = [m.register_forward_pre_hook(lambda m, args, _name=name: pre(m, args, _name))
               for name, m in model.named_modules() if hasattr(m, "expert_projections")]
    try:
        yield routed
    finally:
        for h in handles:
            h.remove()


def _idle_experts(routed: dict[str, torch.Tensor]) -> list[str]:
    """A note naming the experts that received no token of the audit batch: their slices of the expert
    weights and adapters get no gradient from it, which is routing (each token goes to its top k),
    not a cut path — the tensors they live in are audited whole, and another batch reaches them."""
    idle = [(name, int((c == 0).sum()), c.numel()) for name, c in routed.items() if bool((c == 0).any())]
    if not idle:
        return []
    shown = ", ".join(f"{name} {k} of {E}" for name, k, E in idle[:3]) + (f" and {len(idle) - 3} more layers"
                                                                         if len(idle) > 3 else "")
    return [f"experts that received no token of the audit batch (routing, not a cut path: their slices of the "
            f"expert tensors get no gradient from this batch alone): {shown}"]


def _reachable_leaves(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors the autograd graph of `loss` accumulates into."""
    seen, found, stack = set(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            found.add(id(var))
        stack.extend(fn for fn, _ in node.next_functions)
    return found


# ----------------------------------------------------------------------------- the audit


def audit(
    model: nn.Module,
    objective: Objective,
    batch: dict,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    amp_dtype: torch.dtype | None = None,
    probe: bool = True,
) -> AuditReport:
    """One forward + backward of `objective(model, batch)`; report who gets gradient and why not.

    Leaves the model as it found it: gradients, RNG state and parameter values are restored.
    An objective may name what to audit in its place (`objective.audit_objective`: GRPO's rollout
    with fixed non-zero advantages, since all-equal rewards would zero every gradient).
    """
    objective = getattr(objective, "audit_objective", objective)
    named = dict(model.named_parameters())
    trainable = [(n, p) for n, p in named.items() if p.requires_grad]
    frozen = [(n, p) for n, p in named.items() if not p.requires_grad]
    quantized = [n for n, p in frozen if not p.dtype.is_floating_point]
    problems: list[str] = []
    numeric: list[str] = []
    notes: list[str] = []

    for n, p in trainable:
        if not p.dtype.is_floating_point:
            problems.append(f"{n}: a {p.dtype} tensor is marked trainable — only floating-point tensors can "
                            f"train; train a LoRA adapter on this layer instead")
    problems += _double_wrapped(model)
    bypassed = _bypassed_adapters(model)
    problems += bypassed
    adapters_frozen = [n for n, _ in frozen if ".lora_" in n]
    if not trainable:
        if adapters_frozen:
            problems.append(f"no trainable tensors: the adapter is frozen (e.g. {adapters_frozen[0]}) — it was loaded "
                            f"without trainable=True; load it with load_adapter(..., trainable=True) / init_adapter=")
        else:
            problems.append("no trainable tensors: every parameter is frozen — attach an adapter (apply_lora) or "
                            "mark the tensors to train")
    elif adapters_frozen:
        notes.append(f"{len(adapters_frozen)} adapter tensors are frozen (e.g. {adapters_frozen[0]}), so they will "
                     f"not train")
    if optimizer is not None:
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in trainable if id(p) not in held]
        if missing:
            problems.append(f"{missing[0]}" + (f" and {len(missing) - 1} more trainable tensors are" if len(missing) > 1
                                               else " is trainable but") + " not in the optimizer — they get gradients "
                            "that nothing applies; build the optimizer after attaching adapters, over every trainable tensor")
        extra = len(held - {id(p) for _, p in trainable})
        if extra:
            notes.append(f"the optimizer holds {extra} tensors that are frozen (harmless, but probably not intended)")

    saved_grads = {n: p.grad for n, p in trainable}
    loss_value: float | None = None
    statuses: dict[str, TensorAudit] = {}
    # eager, compiled blocks too: its hooks, removed before the backward, would make a block compiled
    # under its checkpoint (a quantized one, minitrain.train.compile_blocks) recompute another graph
    with torch.random.fork_rng(devices=_cuda_devices(model)), eager():
        try:
            for _, p in trainable:
                p.grad = None
            with _record_calls(model) as (calls, reentrant), _expert_tokens(model) as routed:
                loss = _forward_loss(model, objective, batch, amp_dtype)
            loss_value = float(loss.detach().float())
            if not math.isfinite(loss_value):
                numeric.append(f"the loss on the audit batch is {loss_value} — look for fp16 overflow, a NaN in the "
                                f"data, or an empty target (all labels -100)")
            if loss.grad_fn is None:
                if not bypassed:  # a merged / disabled adapter already says why nothing reaches the loss
                    problems.append(_why_no_graph(model, calls, reentrant, trainable))
                reachable: set[int] = set()
            else:
                # under FSDP2 the graph's leaves are the gathered copies, not the shards: the shards'
                # gradients (None where nothing reached) are what tell
                sharded = any(distributed.is_sharded(p) for _, p in trainable)
                reachable = set() if sharded else _reachable_leaves(loss)
                if trainable:
                    loss.backward()
            for n, p in trainable:
                statuses[n] = _status(n, p, reachable)
            if probe:
                _probe_zero_at_init(model, objective, batch, amp_dtype, trainable, statuses, problems)
        finally:
            for n, p in trainable:
                p.grad = saved_grads[n]

    skipped = _bypassed_modules(model)
    unreachable = [t for t in statuses.values() if t.status == UNREACHABLE and t.module not in skipped]
    if unreachable and loss_value is not None and not any("no grad_fn" in p for p in problems):
        where = _locate_cut(model, calls, reentrant, unreachable)
        problems.append(f"{len(unreachable)} of {len(trainable)} trainable tensors are unreachable from the loss "
                        f"(e.g. {unreachable[0].name}){': ' + where if where else ''}")
    for t in statuses.values():
        if t.status == NONFINITE:
            numeric.append(f"{t.name}: non-finite gradient — check the data, the learning rate and the precision")
    stuck, warnings = _unexplained_zeros(model, statuses, len(trainable))
    problems += stuck
    notes += _idle_experts(routed)
    return AuditReport(
        tensors=list(statuses.values()),
        problems=problems,
        numeric=numeric,
        notes=notes,
        frozen=len(frozen),
        frozen_numel=sum(logical_numel(p) for _, p in frozen),
        quantized=quantized,
        layer_norms=_layer_norms(statuses.values()),
        loss=loss_value,
        warnings=warnings,
    )


def preflight(
    model: nn.Module,
    objective: Objective,
    batch: dict,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    amp_dtype: torch.dtype | None = None,
    log: Callable[[str], None] = print,
) -> AuditReport:
    """The check every run makes before step 1: log the verdict; on a broken path, log the whole
    report and stop with a `UserError` (exit 2) rather than train for hours while learning nothing.

    Non-finite values alone do not stop it: the loop skips and reports such steps (rule 6)."""
    report = audit(model, objective, batch, optimizer=optimizer, amp_dtype=amp_dtype)
    if report.paths_ok:
        log(report.verdict() if report.ok else f"warning: {report.numeric[0]} (the loop skips such steps)")
        return report
    log(report.table())
    raise UserError(f"gradient-path audit before step 1: {report.problems[0]} — fix it (report above), "
                    f"or pass skip_audit=true to train anyway")


# ----------------------------------------------------------------------------- pieces


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def _forward_loss(model: nn.Module, objective: Objective, batch: dict, amp_dtype: torch.dtype | None) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        loss_sum, count, _ = objective(model, batch)
    count = float(count) if not isinstance(count, torch.Tensor) else count.float()
    return loss_sum / count


def _status(name: str, p: torch.Tensor, reachable: set[int]) -> TensorAudit:
    g = p.grad
    module = _module_of(name)
    if g is None or (reachable and id(p) not in reachable):
        return TensorAudit(name, module, UNREACHABLE, None, p.numel())
    g = distributed.full_tensor(g).float()  # (a shard's gradient: gathered, on every rank alike)
    if not torch.isfinite(g).all():
        return TensorAudit(name, module, NONFINITE, float("nan"), p.numel())
    norm = float(g.norm())
    return TensorAudit(name, module, OK if norm > 0 else ZERO, norm, p.numel())


def _module_of(param_name: str) -> str:
    """`...q_proj.lora_A.weight` -> `...q_proj`; `...embed_tokens.weight` -> `...embed_tokens`."""
    mod = param_name.rsplit(".", 1)[0]
    return re.sub(r"\.lora_[AB]$", "", mod)


def _is_adapter(m: nn.Module) -> bool:
    return isinstance(m, LoRALinear) or (hasattr(m, "lora_A") and hasattr(m, "lora_B"))


def _double_wrapped(model: nn.Module) -> list[str]:
    """An adapter inside another adapter (by hand, or a saved adapter wrapped again): one of the
    two copies does not run as intended — rule 4, adapters are applied once."""
    out = []
    for name, m in model.named_modules():
        if _is_adapter(m):
            for sub, inner in m.named_modules():
                if sub and _is_adapter(inner):
                    out.append(f"{name} is wrapped twice (adapter {name}.{sub} sits inside adapter {name}) — wrap each "
                               f"layer once; to continue a saved adapter load it with trainable=True instead")
    return out


def _probe_zero_at_init(model, objective, batch, amp_dtype, trainable, statuses, problems) -> None:
    """A LoRA A whose gradient is exactly zero because its B is zero is expected at init; prove it
    by making B non-zero (tiny random values), re-running, and seeing A's gradient appear.

    Only a B that can move explains the zero: a frozen B stays zero for ever, and so does A's
    gradient (`_unexplained_zeros` reports it). A zero that the probe does not lift stays ZERO."""
    named = dict(trainable)
    every = dict(model.named_parameters())
    suspects = []
    for n, t in statuses.items():
        if t.status == ZERO and ".lora_A." in n:
            partner = every.get(n.replace(".lora_A.", ".lora_B."))
            if partner is not None and partner.requires_grad and not distributed.full_tensor(partner.detach()).any():
                suspects.append((n, partner))
    if not suspects:
        return
    local = [b.to_local() if distributed.is_sharded(b) else b for _, b in suspects]  # (a shard: this rank's rows)
    saved = [(b, b.detach().clone()) for b in local]
    try:
        with torch.no_grad():
            for b in local:
                b.copy_(torch.randn_like(b) * 1e-3)
        for _, p in trainable:
            p.grad = None
        loss = _forward_loss(model, objective, batch, amp_dtype)
        if loss.grad_fn is not None:
            loss.backward()
        for n, _ in suspects:
            g = named[n].grad
            g = None if g is None else distributed.full_tensor(g)
            if g is not None and torch.isfinite(g).all() and g.abs().sum() > 0:
                statuses[n].status = ZERO_AT_INIT
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


def _unexplained_zeros(model: nn.Module, statuses: dict[str, TensorAudit],
                       n_trainable: int) -> tuple[list[str], list[str]]:
    """(problems, warnings) for trainable tensors whose gradient is exactly zero with no partner that
    can move. A partner frozen at zero, or every trainable tensor at zero, means nothing can ever
    train: a problem. Some tensors at zero may be this batch alone (a single loss position makes
    attention's q / k gradients exactly zero): a warning, and the verdict is not "healthy"."""
    every = dict(model.named_parameters())
    swap = {".lora_A.": ".lora_B.", ".lora_B.": ".lora_A."}
    stuck: list[tuple[str, str, str]] = []  # (tensor, its frozen zero partner, the partner's side)
    others: list[str] = []
    for n, t in statuses.items():
        if t.status != ZERO:
            continue
        kind = next((k for k in swap if k in n), None)
        partner_name = n.replace(kind, swap[kind]) if kind else ""
        partner = every.get(partner_name)
        if partner is not None and not partner.requires_grad and not partner.detach().any():
            stuck.append((n, partner_name, "B" if kind == ".lora_A." else "A"))
        else:
            others.append(n)
    problems, warnings = [], []
    if stuck:
        n, partner, side = stuck[0]
        more = f" (and {len(stuck) - 1} more like it)" if len(stuck) > 1 else ""
        problems.append(f"{n}{more}: gradient exactly zero for ever — its LoRA {side} ({partner}) is zero and frozen "
                        f"(requires_grad=False), so nothing can make it non-zero — train {side} as well (to freeze one "
                        f"side, as LoRA-FA does, freeze A and train B)")
    if others and len(others) == n_trainable:
        problems.append(f"{len(others)} of {n_trainable} trainable tensors get an exactly zero gradient (e.g. "
                        f"{others[0]}{f' and {len(others) - 1} more' if len(others) > 1 else ''}), so they would "
                        f"never change: the loss reaches them only through a factor that is zero (a `+ p.sum() * 0` "
                        f"term, a frozen tensor that is zero, a mask over every target) — make the loss depend on them")
    elif others:
        warnings.append(f"{len(others)} of {n_trainable} trainable tensors get an exactly zero gradient on this batch "
                        f"(e.g. {others[0]}): either this example does not exercise them (one loss position gives "
                        f"attention's q / k a zero gradient) or the loss reaches them only through `* 0` — check "
                        f"with a longer example")
    return problems, warnings


def _bypassed_modules(model: nn.Module) -> dict[str, str]:
    """LoRA layers whose forward skips the adapter: {module name: "merged" | "disabled"}."""
    return {n: "merged" if m.merged else "disabled" for n, m in model.named_modules()
            if isinstance(m, LoRALinear) and (m.merged or m.disabled)}


def _bypassed_adapters(model: nn.Module) -> list[str]:
    """Adapters folded into their base (`merge`) or switched off (`disable_adapters`) do not run in
    the forward, so their trainable tensors get no gradient: say which layers and what to do."""
    found = _bypassed_modules(model)
    todo = {"merged": "merged into its base weights", "disabled": "disabled"}
    fix = {"merged": "call minitrain.adapters.merge.unmerge(model) before training (merge only to export a trained "
                     "adapter)",
           "disabled": "train outside the disable_adapters() block"}
    out = []
    for state in ("merged", "disabled"):
        names = [n for n, s in found.items() if s == state]
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            out.append(f"the adapter is {todo[state]} in {len(names)} layer{'s' * (len(names) > 1)} ({shown}), so "
                       f"their lora_A / lora_B do not run in the forward and get no gradient — {fix[state]}")
    return out


def _grad_off_where(calls: dict[str, list[_Call]], reentrant: set[str], mod: str) -> str:
    """`mod` ran with grad disabled: say whether reentrant checkpointing or a no_grad section did it."""
    enclosing = _enclosing_with_grad(calls, mod)
    if enclosing is not None and enclosing in reentrant:
        return (f"{mod} ran under no_grad inside reentrant activation checkpointing of {enclosing}, whose inputs do "
                f"not require grad (e.g. frozen embeddings), so the checkpoint's output has no graph — use "
                f"non-reentrant checkpointing (checkpointing=true does; use_reentrant=False)")
    where = f" inside {enclosing}'s forward" if enclosing else ""
    return f"{mod} ran with gradients disabled: a torch.no_grad() / inference_mode section{where} — remove it"


def _locate_cut(model: nn.Module, calls: dict[str, list[_Call]], reentrant: set[str],
                unreachable: list[TensorAudit]) -> str:
    """Name where the path from a tensor to the loss is cut, from the recorded module calls."""
    mod = unreachable[0].module
    recs = calls.get(mod)
    if not (recs and all(not r.grad_enabled for r in recs)):
        holder = _detached_holder(model, calls)
        if holder:
            return _cut_at(calls, reentrant, holder)
    if not recs:
        return (f"{mod} never ran in the forward — it is not on the path to the loss (an outer wrapper computes "
                f"around it, or this objective does not use it)")
    if all(not r.grad_enabled for r in recs):
        return _grad_off_where(calls, reentrant, mod)
    if all(not r.out_requires_grad for r in recs):
        return f"the output of {mod} does not require grad although it holds trainable tensors (a .detach() inside it)"
    cut = _first_cut(calls)
    if cut:
        return _cut_at(calls, reentrant, cut)
    return ("the objective does not use this path: its output requires grad but the loss is built without it "
            "(.detach(), .item(), a numpy round trip or a no_grad section between the model output and the loss)")


def _detached_holder(model: nn.Module, calls: dict[str, list[_Call]]) -> str | None:
    """The innermost module entered with grad on whose output does not require grad although it holds trainable
    tensors (a .detach() or a no_grad section inside it: a vision-language model's merger between a trained tower
    or merger and the language model), or None."""
    holders = [n for n, recs in calls.items() if n != "<model>" and all(r.grad_enabled and not r.out_requires_grad
                                                                      for r in recs)
               and any(p.requires_grad for p in model.get_submodule(n).parameters())]
    inner = [n for n in holders if not any(h.startswith(n + ".") for h in holders)]
    return inner[0] if inner else None


def _enclosing_with_grad(calls: dict[str, list[_Call]], mod: str) -> str | None:
    """The innermost ancestor of `mod` that was entered with grad enabled."""
    parts = mod.split(".")
    for i in range(len(parts) - 1, -1, -1):
        anc = ".".join(parts[:i]) or "<model>"
        recs = calls.get(anc)
        if recs and any(r.grad_enabled for r in recs):
            return anc
    return None


def _first_cut(calls: dict[str, list[_Call]]) -> str | None:
    """The first module (in completion order) entered with grad on whose input required grad but whose
    output does not."""
    for name, recs in calls.items():
        if any(r.in_requires_grad and not r.out_requires_grad and r.grad_enabled for r in recs):
            return name
    return None


def _cut_at(calls: dict[str, list[_Call]], reentrant: set[str], cut: str) -> str:
    """`cut`'s input required grad, its output does not: a no_grad section or a detach inside it."""
    inside = [n for n, recs in calls.items() if n.startswith(cut + ".") and all(not r.grad_enabled for r in recs)]
    if inside:
        return _grad_off_where(calls, reentrant, inside[0])
    return (f"the output of {cut} does not require grad although "
            f"{'its input does' if any(r.in_requires_grad for r in calls[cut]) else 'it holds trainable tensors'} "
            "(a .detach() inside it)")


def _why_no_graph(model: nn.Module, calls: dict[str, list[_Call]], reentrant: set[str], trainable: list) -> str:
    """The loss has no grad_fn: say where the graph stopped."""
    base = "the loss has no grad_fn (the classic 'element 0 of tensors does not require grad')"
    if not trainable:
        return base + " because nothing is trainable"
    owners = sorted({_module_of(n) for n, _ in trainable})
    ran = [o for o in owners if o in calls]
    if not ran:
        return base + f": none of the modules holding trainable tensors ran (e.g. {owners[0]})"
    if all(not r.grad_enabled for o in ran for r in calls[o]):
        return base + ": " + _grad_off_where(calls, reentrant, ran[0])
    cut = _first_cut(calls)
    if cut:
        return base + ": " + _cut_at(calls, reentrant, cut)
    return (base + ": the model's trainable path ran with grad, so the objective cut it — a .detach(), .item(), "
            "a numpy round trip or a no_grad section between the model output and the loss")


def _layer_norms(tensors) -> dict[str, float]:
    sums: dict[str, float] = {}
    for t in tensors:
        m = _LAYER.match(t.name)
        if m and t.grad_norm is not None and math.isfinite(t.grad_norm):
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + t.grad_norm ** 2
    return {k: math.sqrt(v) for k, v in sums.items()}
