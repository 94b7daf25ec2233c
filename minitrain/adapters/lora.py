"""LoRA adapters: wrap base linears in place, train only the adapter, switch it off.

`apply_lora(model, cfg)` swaps each target linear (`nn.Linear`, bitsandbytes `Linear4bit` /
`Linear8bitLt`, minitrain's `TernaryLinear`) for a `LoRALinear` that holds the base `weight` / `bias` itself (torchtune's
design), so `model.state_dict()` keeps `...q_proj.weight` at its HF key and the adapter adds
`...q_proj.lora_A.weight` / `...q_proj.lora_B.weight`:

    y = base(x) + B(A(dropout(x))) * scaling        scaling = alpha / r  (rsLoRA: alpha / sqrt(r))

The rules this module enforces (docs/design.md rules 3 and 4):

- adapter tensors are floating point (fp32 by default) whatever the base dtype (bf16, nf4, int8);
  asking to train a quantized or integer tensor is a `UserError` that names it;
- adapters are applied once: a second `apply_lora`, or wrapping a wrapped layer, is a `UserError`;
  a saved adapter loads frozen unless `trainable=True` is asked for (`minitrain.adapters.peft_format`,
  which saves and loads adapters in PEFT's format);
- merging into a quantized base reports its rounding error instead of losing quality silently
  (`minitrain.adapters.merge`; each layer's `merge` / `unmerge` is here).

bitsandbytes is optional and never imported here: a bnb layer can only exist once the user has
imported bitsandbytes, so we look it up in `sys.modules` when we meet a layer.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from minitrain.adapters.ternary import dequantize_ternary, is_ternary, store_ternary, ternary_linear
from minitrain.errors import UserError
from minitrain.adapters import lora_experts
from minitrain.weights import skip_init

ALL_LINEAR = "all-linear"
_NAME = re.compile(r"[\w.-]+")  # a module-name suffix; a target with other characters is a regular expression
_STATE_ATTR = "minitrain_lora"  # where apply_lora records what it did on the model


# ----------------------------------------------------------------------------- config


@dataclass
class LoRAConfig:
    """What to adapt and how. `targets` are module-name suffixes (`q_proj`; T5 `q`, `wi_0`), a
    regular expression matched against the full module name (a string other than "all-linear",
    as PEFT reads one, or a list of one target that is not a plain name: `lora_targets=model\\.visual\\..*`;
    it selects the linears among the modules it matches, a vision tower's or merger's too), or
    "all-linear": every linear layer except the model's output head.
    `modules_to_save` are trained fully (embeddings, head): costly, reported loudly.
    `rank_pattern` gives some modules another rank than `r` (PEFT's field: a module-name suffix ->
    its rank, the first key that matches wins), e.g. a rank per layer shape (minitrain.adapters.lrc)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: Sequence[str] | str = ("q_proj", "v_proj")
    rslora: bool = False
    dtype: torch.dtype = torch.float32
    modules_to_save: Sequence[str] = ()
    rank_pattern: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise UserError(f"LoRAConfig.r={self.r!r}: the rank must be a whole number >= 1 — e.g. r=8")
        self.rank_pattern = dict(self.rank_pattern or {})
        for k, v in self.rank_pattern.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"LoRAConfig.rank_pattern[{k!r}]={v!r}: a rank must be a whole number >= 1 — e.g. 8")
        if not self.alpha > 0:
            raise UserError(f"LoRAConfig.alpha={self.alpha!r}: must be > 0 — e.g. alpha=2*r")
        if not 0 <= self.dropout < 1:
            raise UserError(f"LoRAConfig.dropout={self.dropout!r}: must be in [0, 1) — e.g. dropout=0.05")
        if not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise UserError(f"LoRAConfig.dtype={self.dtype!r}: adapters must be floating point (rule 3) "
                            f"— use torch.float32 (default) or torch.bfloat16")
        if not isinstance(self.targets, str):
            self.targets = tuple(self.targets)
            expressions = [t for t in self.targets if not _NAME.fullmatch(t)]
            if self.targets == (ALL_LINEAR,) or expressions and len(self.targets) == 1:
                self.targets = self.targets[0]  # lora_targets=all-linear, or one regular expression
            elif expressions:
                raise UserError(f"targets {list(self.targets)}: {expressions[0]!r} is a regular expression, which "
                                "must be the only target — join the alternatives with | in one expression, e.g. "
                                r"'.*\.(q_proj|v_proj)|model\.visual\.merger\..*'")
        if isinstance(self.targets, str) and self.targets != ALL_LINEAR:
            try:
                re.compile(self.targets)
            except re.error as e:
                raise UserError(f"targets {self.targets!r}: not a regular expression ({e}) — fix it, or list "
                                "module-name suffixes") from None
        self.modules_to_save = tuple(self.modules_to_save or ())

    def rank_for(self, name: str) -> int:
        """The rank of module `name`: its `rank_pattern` entry (first match), else `r`."""
        return next((v for k, v in self.rank_pattern.items() if name_matches(name, k)), self.r)

    @property
    def scaling(self) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA (rank-stabilised: update size independent of r)."""
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


@dataclass
class Applied:
    """What `apply_lora` did to a model (kept as a plain attribute on it)."""

    config: LoRAConfig
    wrapped: tuple[str, ...]  # full names of the LoRALinear modules
    # modules_to_save: (parameter name, the live Parameter, a frozen copy of its base value).
    # The copy is what `disable_adapters` puts back, so a DPO reference really is the base model.
    saved: list[tuple[str, nn.Parameter, nn.Parameter]] = field(default_factory=list)
    experts: tuple[str, ...] = ()  # MoE: the 3-D expert parameters with an `ExpertLoRA` (module.param paths)
    # MoE: linears the targets name but that stay unadapted (peft would save them onto the experts)
    unadapted: tuple[str, ...] = ()


def applied(model: nn.Module) -> Applied | None:
    """What `apply_lora` (or `load_adapter`) did to this model, or None: no adapter applied."""
    return getattr(model, _STATE_ATTR, None)


def adapter_signature(model: nn.Module) -> dict[str, Any] | None:
    """What a checkpoint records of the model's adapter (r, alpha, rslora, targets, modules_to_save),
    JSON-able; None without one. Two runs with equal signatures train the same tensors the same way."""
    st = applied(model)
    if st is None:
        return None
    c = st.config
    sig = {"r": c.r, "alpha": float(c.alpha), "rslora": c.rslora, "targets": minimal_targets(model, st.wrapped),
           "modules_to_save": list(c.modules_to_save)}
    if st.experts:
        sig["expert_parameters"] = list(st.experts)
    if c.rank_pattern:
        sig["rank_pattern"] = dict(c.rank_pattern)
    return sig


def minimal_targets(model: nn.Module, wrapped: Sequence[str]) -> list[str]:
    """Leaf names if they select exactly the wrapped modules (`q_proj`), else the full names. Full names
    too for a model whose transformers class builds modules it does not (`hf_only_modules`: a multimodal
    checkpoint's towers, where peft would find a vision `q_proj` by its leaf name)."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in wrapped})
    # an expert adapter's own module (`experts.deltas.down_proj`) is no linear peft would look for
    selected = {n for n, m in model.named_modules()
                if n and not isinstance(m, lora_experts.ExpertLoRA) and any(name_matches(n, t) for t in leaves)}
    return leaves if selected == set(wrapped) and not getattr(model, "hf_only_modules", ()) else sorted(wrapped)


# ----------------------------------------------------------------------------- dtype guard


def loaded_bnb():
    """bitsandbytes if the user has imported it (only then can a bnb layer exist), else None."""
    return sys.modules.get("bitsandbytes")


def quant_kind(obj: Any) -> str | None:
    """'4bit' / '8bit' for bitsandbytes linears or their weight parameters, 'ternary' for
    `TernaryLinear` or its packed weight, else None."""
    if is_ternary(obj):
        return "ternary"
    if getattr(obj, "minitrain_quant", None):  # adapters/quant_rows.py: nf4 / int8 as rows FSDP2 shards
        return obj.minitrain_quant
    bnb = loaded_bnb()
    if bnb is None:
        return None
    if isinstance(obj, (bnb.nn.Linear4bit, bnb.nn.Params4bit)):
        return "4bit"
    if isinstance(obj, (bnb.nn.Linear8bitLt, bnb.nn.Int8Params)):
        return "8bit"
    return None


def logical_numel(p: torch.Tensor) -> int:
    """Number of weights a tensor stands for (a packed 4-bit tensor holds two per byte): the count to
    show a user, never `p.numel()` (which halves every nf4 layer)."""
    if getattr(p, "logical_shape", None) is not None:  # an nf4 weight as rows (adapters/quant_rows.py)
        return math.prod(p.logical_shape)
    qs = getattr(p, "quant_state", None)
    if quant_kind(p) == "4bit" and qs is not None:
        return math.prod(qs.shape)
    if quant_kind(p) == "ternary":
        return math.prod(p.ternary_shape)  # four 2-bit weights a byte
    return p.numel()


def check_float_trainable(name: str, p: torch.Tensor) -> None:
    """Raise a `UserError` naming `name` unless `p` is a floating-point tensor (rule 3).

    torch itself refuses `requires_grad` on integer tensors with a message that names nothing;
    this says which tensor it was and what to train instead.
    """
    if p.dtype.is_floating_point and quant_kind(p) is None:
        return
    parts = name.split(".")
    leaf = parts[-2] if len(parts) > 1 else parts[0]  # "...self_attn.q_proj.weight" -> "q_proj"
    kind = quant_kind(p)
    if kind == "4bit":
        what = f"a 4-bit quantized tensor ({str(p.dtype).removeprefix('torch.')})"
    elif kind == "8bit":
        what = f"an 8-bit quantized tensor ({str(p.dtype).removeprefix('torch.')})"
    elif kind == "ternary":
        what = "a ternary quantized tensor (uint8, four 2-bit weights a byte)"
    else:
        what = f"an integer tensor ({str(p.dtype).removeprefix('torch.')})"
    if kind is not None:
        todo = f"train a LoRA adapter on it instead (targets=[{leaf!r}]) and leave the base frozen"
    else:
        todo = "only floating-point tensors can be trained; leave it frozen"
    raise UserError(f"{name}: is {what} and cannot be trained — {todo}")


def set_trainable(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Make the named parameters or modules (name suffixes) fully trainable; returns the
    parameter names. Every one is checked to be floating point first, so nothing changes on error."""
    names = list(names)
    params = dict(model.named_parameters())
    chosen: dict[str, nn.Parameter] = {}
    for want in names:
        hits = {n: p for n, p in params.items() if name_matches(n, want)}
        for mod_name, mod in model.named_modules():
            if mod_name and name_matches(mod_name, want):
                hits.update({f"{mod_name}.{n}": p for n, p in mod.named_parameters()})
        if not hits:
            raise UserError(f"set_trainable: {want!r} names no parameter or module of the model — "
                            f"use a name suffix such as 'lm_head' or 'model.norm.weight'")
        chosen.update(hits)
    for n, p in chosen.items():
        check_float_trainable(n, p)
    for p in chosen.values():
        p.requires_grad_(True)
    return sorted(chosen)


# ----------------------------------------------------------------------------- the layer


@dataclass
class MergeError:
    """Rounding error of one merge / unmerge: the stored weight vs the exact fp32 target.

    `max_abs` = max |stored - target|; `rel` = ||stored - target|| / ||target||;
    `rel_update` = ||stored - target|| / ||scaling * B @ A||: the share of the LoRA update lost."""

    name: str
    max_abs: float
    rel: float
    rel_update: float
    quantized: bool

    def __str__(self) -> str:
        return (f"{self.name}: max abs {self.max_abs:.3g}, relative {self.rel:.3g}, "
                f"{self.rel_update:.3g} of the LoRA update")


class LoRALinear(nn.Module):
    """A linear layer plus a low-rank update, holding the base `weight` / `bias` itself.

    The base weight is the same Parameter object as before wrapping (ties survive, the key is
    unchanged). Adapter tensors are created in `dtype` (fp32 by default) whatever the base dtype:
    the input is cast to the adapter dtype and the update back to the base output dtype.
    Subclasses replace only `base_forward`, `dequantized_weight` and `_store_weight`.
    """

    decoding_weight: torch.Tensor | None = None  # W + scaling * B @ A while `merged_for_decoding` holds

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0,
                 rslora: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        if isinstance(base, LoRALinear) or hasattr(base, "lora_A"):
            raise UserError("LoRALinear: the layer already has a LoRA adapter — adapters are applied once (rule 4); "
                            "to keep training a saved adapter use load_adapter(model, folder, trainable=True)")
        self.in_features: int = base.in_features
        self.out_features: int = base.out_features
        self.weight = base.weight  # (out, in); packed for bnb 4-bit
        self.register_parameter("bias", base.bias)  # (out,) or None
        self.r, self.alpha, self.rslora = r, alpha, rslora
        self.scaling = alpha / (math.sqrt(r) if rslora else r)
        device = base.weight.device
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # no throw-away default init, so reset_lora's draws are the only ones (and nothing is built on
        # meta: nn.utils.skip_init would, importing torch's Python decompositions on first use)
        with skip_init():
            self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)
            self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)
        self.reset_lora()
        self.merged = False  # base weight currently holds W + scaling * B @ A
        self.disabled = False  # set by `disable_adapters`

    def reset_lora(self) -> None:
        """PEFT's init: A kaiming-uniform(a=sqrt(5)), B zeros, so the layer starts equal to its base."""
        if self.lora_A.weight.device.type == "meta":
            return
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    # the base product: overridden for quantized weights
    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """A fresh fp32 copy of the base weight, (out, in)."""
        return self.weight.detach().to(torch.float32, copy=True)

    def _store_weight(self, w: torch.Tensor) -> None:
        """Write an fp32 (out, in) weight into the base storage, rounding to its dtype in place."""
        with torch.no_grad():
            self.weight.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged or self.disabled:
            return self.base_forward(x)
        if self.decoding_weight is not None and not torch.is_grad_enabled():  # inside `merged_for_decoding`
            return F.linear(x, self.decoding_weight, self.bias)
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (rows, in): the base output below is then no view
        out = self.base_forward(x)  # (rows, out) in the base output dtype
        a = self.lora_A.weight
        h = x.to(a.dtype)  # (rows, in) in the adapter dtype
        drop, lora_a = self.lora_dropout, self.lora_A
        if type(lora_a) is nn.Linear and not torch.is_grad_enabled() and not (drop.training and getattr(drop, "p", 0.0)):
            z = F.linear(h, a) * self.scaling  # no graph, no dropout (sampling, evaluation): no module calls
        else:  # (a gated `lora_A`, ARD's `RankGate`, has a forward of its own)
            z = lora_a(drop(h)) * self.scaling  # (rows, r): the scaling costs r, not out, per row
        if z.dtype != out.dtype:  # e.g. a bf16 base with fp32 adapters outside autocast
            return (out + self.lora_B(z).to(out.dtype)).view(*lead, -1)
        # z @ B.T accumulated into `out` itself by one GEMM: no (rows, out) delta, no copy, no add pass.
        # In place on a tensor that is not a view and that no backward reads, so autograd adds nothing.
        b = self.lora_B.weight  # (out, r); in place, autocast casts nothing, so cast it as its addmm would
        return out.addmm_(z, b.t() if b.dtype == out.dtype else b.t().to(out.dtype)).view(*lead, -1)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A in fp32, (out, in)."""
        a = self.lora_A.weight.detach().float()
        b = self.lora_B.weight.detach().float()
        return (b @ a) * self.scaling

    def _write(self, target: torch.Tensor, delta: torch.Tensor, name: str) -> MergeError:
        self._store_weight(target)
        err = self.dequantized_weight() - target  # what the stored weight lost in rounding
        en, tn, dn = err.norm().item(), target.norm().item(), delta.norm().item()
        return MergeError(
            name=name,
            max_abs=err.abs().max().item() if err.numel() else 0.0,
            rel=en / tn if tn > 0 else 0.0,
            rel_update=en / dn if dn > 0 else (0.0 if en == 0 else math.inf),
            quantized=quant_kind(self.weight) is not None,
        )

    def merge(self, name: str = "") -> MergeError:
        """Fold the update into the base weight (dequantize, add, requantize for bnb)."""
        if self.merged:
            raise UserError(f"{name or 'LoRALinear'}: already merged — merging twice would add the update twice; "
                            f"call unmerge(model) first")
        delta = self.delta_weight()
        report = self._write(self.dequantized_weight() + delta, delta, name)
        self.merged = True
        return report

    def unmerge(self, name: str = "") -> MergeError:
        """Take the update back out of the base weight (exact-ish for fp32; rounds again if quantized)."""
        if not self.merged:
            raise UserError(f"{name or 'LoRALinear'}: is not merged — nothing to unmerge")
        delta = self.delta_weight()
        report = self._write(self.dequantized_weight() - delta, delta, name)
        self.merged = False
        return report

    def extra_repr(self) -> str:
        base = str(self.weight.dtype).removeprefix("torch.")
        kind = quant_kind(self.weight)
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"base={kind or base}, r={self.r}, alpha={self.alpha}, rslora={self.rslora}, "
                f"adapter={str(self.lora_A.weight.dtype).removeprefix('torch.')}")


class LoRALinear4bit(LoRALinear):
    """LoRA on a bitsandbytes `Linear4bit` (nf4 / fp4): holds its `Params4bit` weight and calls
    `bnb.matmul_4bit` itself, so the weight key stays `...q_proj.weight`."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0,
                 rslora: bool = False, dtype: torch.dtype = torch.float32):
        bnb = loaded_bnb()
        w = base.weight
        if getattr(w, "quant_state", None) is None and w.device.type != "meta":
            base = base.to(w.device)  # bnb quantizes on the first move to a device
            w = base.weight
        qs = w.quant_state
        if getattr(qs, "packing_format_for_cpu", False):  # bnb's CPU inference layout: undo it
            w.data, w.quant_state = bnb.functional._convert_weight_packed_for_cpu_inverse(w.data, qs)
        super().__init__(base, r, alpha, dropout, rslora, dtype)
        self.compute_dtype: torch.dtype | None = base.compute_dtype

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        bnb = loaded_bnb()
        cdt = self.compute_dtype or x.dtype
        bias = None if self.bias is None else self.bias.to(cdt)
        out = bnb.matmul_4bit(x.to(cdt), self.weight.t(), quant_state=self.weight.quant_state, bias=bias)
        return out.to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        bnb = loaded_bnb()
        return bnb.functional.dequantize_4bit(self.weight.data, self.weight.quant_state).to(torch.float32)

    def _store_weight(self, w: torch.Tensor) -> None:
        bnb = loaded_bnb()
        qs = self.weight.quant_state
        packed, new_qs = bnb.functional.quantize_4bit(
            w.to(qs.dtype).contiguous(), blocksize=qs.blocksize, compress_statistics=qs.nested,
            quant_type=qs.quant_type, quant_storage=self.weight.quant_storage)
        self.weight.data = packed
        self.weight.quant_state = new_qs


def frozen_int8_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: Any) -> torch.Tensor:
    """bitsandbytes' `matmul(x, weight, bias, state)` (LLM.int8) of a frozen int8 weight. When x needs a
    gradient it runs inside `_FrozenInt8`, whose node keeps no tensor: bitsandbytes' own keeps x as an attribute
    of its node (`ctx.A` on a CPU, `ctx.tensors` on CUDA), which activation checkpointing cannot free, so every
    checkpointed block's int8 inputs would live to the end of the backward."""
    bnb = loaded_bnb()
    frozen = not weight.requires_grad and (bias is None or not bias.requires_grad)
    if frozen and torch.is_grad_enabled() and x.requires_grad:
        return _FrozenInt8.apply(x, weight, bias, state)
    return bnb.matmul(x, weight, bias=bias, state=state)


class _FrozenInt8(torch.autograd.Function):
    """bitsandbytes' int8 matmul forward; backward dx = dy @ (CB x SCB / 127), bitsandbytes' own formula for a
    frozen weight (its CPU and CUDA functions alike), from the state's int8 rows and scales: nothing saved."""

    @staticmethod
    def forward(ctx, x, weight, bias, state):
        ctx.state, ctx.dtype, ctx.shape = state, x.dtype, x.shape
        return loaded_bnb().matmul(x, weight, bias=bias, state=state)  # (no graph in here: nothing kept)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        state = ctx.state
        w = state.CB.to(ctx.dtype, copy=True).mul_(state.SCB.unsqueeze(1).mul(1.0 / 127.0))  # (out, in)
        dy = dy.reshape(-1, dy.shape[-1]).contiguous() if dy.dim() == 3 else dy
        return torch.matmul(dy.to(ctx.dtype), w).view(ctx.shape), None, None, None


def frozen_linear8bit(*args: Any, **kwargs: Any) -> nn.Module:
    """A bitsandbytes `Linear8bitLt` (same arguments) whose forward goes through `frozen_int8_matmul`."""
    return _frozen_linear8bit_class()(*args, **kwargs)


@functools.cache
def _frozen_linear8bit_class() -> type:
    bnb = loaded_bnb()

    class FrozenLinear8bitLt(bnb.nn.Linear8bitLt):
        """`Linear8bitLt` whose matmul keeps no input on its node when the weight is frozen (`frozen_int8_matmul`)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # bitsandbytes' forward, but for the matmul
            self.state.is_training = self.training
            if self.weight.CB is not None:
                self.init_8bit_state()
            if self.bias is not None and self.bias.dtype != x.dtype:
                self.bias.data = self.bias.data.to(x.dtype)
            out = frozen_int8_matmul(x, self.weight, self.bias, self.state)
            if not self.state.has_fp16_weights and self.state.CB is not None:
                self.weight.data = self.state.CB
            return out

    return FrozenLinear8bitLt


class LoRALinear8bit(LoRALinear):
    """LoRA on a bitsandbytes `Linear8bitLt` (LLM.int8, int8 weights): holds its `Int8Params`
    weight and the layer's `MatmulLtState`, and calls `bnb.matmul` itself."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0,
                 rslora: bool = False, dtype: torch.dtype = torch.float32):
        w = base.weight
        if w.dtype != torch.int8 and w.device.type != "meta":
            base = base.to(w.device)  # bnb quantizes on the first move to a device
        if base.weight.CB is not None:  # statistics live on the state from here on, as bnb's forward does
            base.init_8bit_state()
        super().__init__(base, r, alpha, dropout, rslora, dtype)
        self.state = base.state

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state.is_training = self.training
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return frozen_int8_matmul(x, self.weight, bias, self.state)

    def dequantized_weight(self) -> torch.Tensor:
        bnb = loaded_bnb()
        return bnb.functional.int8_vectorwise_dequant(self.weight.data, self.state.SCB).to(torch.float32)

    def _store_weight(self, w: torch.Tensor) -> None:
        bnb = loaded_bnb()
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(w.to(torch.float16).contiguous())  # as Int8Params does
        self.weight.data = cb
        self.state.CB, self.state.SCB = cb, scb


class LoRALinearTernary(LoRALinear):
    """LoRA on a `TernaryLinear` (minitrain.adapters.ternary): holds its packed weight and scale, and runs
    its matmul (with its activation fake-quantization); the adapter reads the unquantized input."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0,
                 rslora: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__(base, r, alpha, dropout, rslora, dtype)
        self.register_buffer("weight_scale", base.weight_scale)
        self.act_bits, self.scale_mode = base.act_bits, base.scale_mode

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return ternary_linear(x, self.weight, self.weight_scale, self.in_features, self.bias, self.act_bits)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_ternary(self.weight, self.weight_scale, self.in_features)

    def _store_weight(self, w: torch.Tensor) -> None:
        store_ternary(self, w)


def _wrap(base: nn.Module, cfg: LoRAConfig, r: int | None = None) -> LoRALinear:
    kind = quant_kind(base)
    cls = getattr(type(base), "lora_class", None) or {  # (quant_rows' layers name their own)
        "4bit": LoRALinear4bit, "8bit": LoRALinear8bit, "ternary": LoRALinearTernary, None: LoRALinear}[kind]
    # the new layer follows the model's mode: dropout stays off on a model in eval()
    return cls(base, r or cfg.r, cfg.alpha, cfg.dropout, cfg.rslora, cfg.dtype).train(base.training)


# ----------------------------------------------------------------------------- applying


def name_matches(name: str, suffix: str) -> bool:
    """PEFT's list matching: the full name, or a suffix starting at a dot."""
    return name == suffix or name.endswith("." + suffix)


def _is_wrappable(m: nn.Module) -> bool:
    return type(m) is nn.Linear or quant_kind(m) is not None


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output layer: its LM head (`output_projection`), or the module a reward model names
    as its `classification_head` (the scalar `score`, `minitrain.objectives.reward_model`)."""
    head = getattr(model, "output_projection", None)
    if head is None and getattr(model, "classification_head", None):
        head = model.get_submodule(model.classification_head)
    return head if isinstance(head, nn.Module) else None


def in_tower(model: nn.Module, name: str) -> bool:
    """Whether module `name` is inside one of the model's `towers` (docs/contracts.md: a vision-language
    model's encoder, e.g. `visual`), which target suffixes and all-linear leave frozen (its MLP's
    `gate_proj` is not the language model's); a regular expression or a module's full name may still name it."""
    return any(name == t or name.startswith(t + ".") for t in getattr(model, "towers", ()))


def target_names(model: nn.Module, targets: Sequence[str] | str, strict: bool = False) -> list[str]:
    """Full names of the modules `targets` selects (every one checked to be a supported linear).

    `strict` (new adapters): every listed suffix must select a module — one typo among valid names
    (`q_prj,v_proj`) would otherwise train `v_proj` alone. A saved PEFT adapter's list is read as
    PEFT reads it (names absent from this model are skipped)."""
    # a quantized expert weight is a module at its parameter's path: an expert target, never a linear one
    experts = set(lora_experts.expert_parameters(model))
    if targets == ALL_LINEAR:
        head = output_head(model)
        if head is None:
            raise UserError(f"targets={ALL_LINEAR!r}: the model has no `output_projection`, so its head cannot be "
                            f"left out — list the targets instead, e.g. targets=['q_proj', 'v_proj']")
        chosen = [n for n, m in model.named_modules() if _is_wrappable(m) and m is not head and not in_tower(model, n)]
    elif isinstance(targets, str):  # a regular expression over the full name, as PEFT reads one: the linears it
        # names (a tower or merger included); the containers and norms it also matches (`merger\..*`) are skipped
        chosen = [n for n, m in model.named_modules() if n and n not in experts and re.fullmatch(targets, n)
                  and (_is_wrappable(m) or isinstance(m, LoRALinear))]
    else:
        if strict:
            targets = fused_targets(getattr(model, "fused_linears", None) or {}, targets)
        chosen = [n for n, _ in model.named_modules()  # a tower's module by its full name only (a saved adapter's)
                  if n and n not in experts and (n in targets or not in_tower(model, n))
                  and any(name_matches(n, t) for t in targets)]
        missed = [t for t in targets if not any(name_matches(n, t) for n in chosen)]
        if strict and missed and chosen:  # none at all: apply_lora's own message lists the linears
            raise UserError(_no_module(model, "target", missed[0]))
    modules = dict(model.named_modules())
    for n in chosen:
        m = modules[n]
        if quant_kind(m) == "8bit" and getattr(getattr(m, "state", None), "has_fp16_weights", False):
            raise UserError(f"{n}: a Linear8bitLt with has_fp16_weights=True keeps a float weight, not an int8 "
                            f"one — build it with has_fp16_weights=False to train LoRA on an int8 base")
        if isinstance(m, LoRALinear):
            raise UserError(f"{n}: already has a LoRA adapter — adapters are applied once (rule 4); to keep "
                            f"training a saved adapter use load_adapter(model, folder, trainable=True)")
        if not _is_wrappable(m):
            raise UserError(f"{n}: is a {type(m).__name__}, not a linear layer LoRA can wrap (nn.Linear, "
                            f"bitsandbytes Linear4bit / Linear8bitLt, TernaryLinear) — target its linear "
                            f"submodules instead")
    return chosen


def fused_targets(fused: dict[str, tuple[str, ...]], targets: Sequence[str]) -> list[str]:
    """`targets` with the unfused names of a fused linear replaced by its own name.

    A model whose linears are fused (Phi-3: `qkv_proj` holds q, k and v; `gate_up_proj` gate and up)
    declares them as `model.fused_linears = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), ...}`, so
    a list written for LLaMA (the recipes' defaults) adapts the same projections there. One adapter
    on a fused linear adapts all of its parts: a list naming only some of them cannot be honoured.
    """
    out = list(targets)
    for name, parts in fused.items():
        named = [t for t in out if t in parts]
        if not named:
            continue
        if len(named) < len(parts):
            raise UserError(f"targets {', '.join(named)}: this model fuses {', '.join(parts)} into one linear "
                            f"{name!r}, and an adapter on it adapts all of them — name {name} (or all of "
                            f"{', '.join(parts)}), or leave {', '.join(named)} out")
        at = out.index(named[0])
        out = [t for t in out if t not in parts]
        if name not in out:
            out.insert(at, name)
    return out


def _did_you_mean(model: nn.Module, want: str) -> str:
    """`did you mean 'q_proj'? ` for the module-name ending closest to `want`, or ""."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n})
    close = difflib.get_close_matches(want.rsplit(".", 1)[-1], leaves, n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _no_module(model: nn.Module, what: str, want: str) -> str:
    """`<what> 'q_prj' matches no module of the model — did you mean 'q_proj'? ...` (linears listed)."""
    linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _is_wrappable(m)})
    if ".experts." in f".{want}." and not lora_experts.expert_parameters(model):
        return (f"{what} {want!r} names a mixture-of-experts parameter, but this model has no experts — target "
                f"its linear layers (they end in {', '.join(linears) or '(none)'}), or all-linear")
    return (f"{what} {want!r} matches no module of the model — {_did_you_mean(model, want)}its linear layers end "
            f"in {', '.join(linears) or '(none)'}")


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def apply_lora(model: nn.Module, cfg: LoRAConfig, *, every_target: bool = True) -> list[str]:
    """Swap every target linear for a `LoRALinear` in place, and put an `ExpertLoRA` on every targeted
    expert parameter of a mixture-of-experts model (`minitrain.adapters.lora_experts`); returns the
    wrapped module names, then the adapted expert parameters' paths.

    Base parameters are not frozen here: call `freeze_for_adapters(model, cfg)` next. Applying a
    second time, or to a model that already has LoRA layers, is a `UserError` (rule 4), and so is a
    listed target that selects no module (`every_target`; `load_adapter` reads a saved list as
    PEFT does, skipping names this model lacks).
    """
    if applied(model) is not None or any(isinstance(m, LoRALinear) for m in model.modules()):
        raise UserError("apply_lora: the model already has LoRA adapters — adapters are applied once (rule 4); "
                        "to continue a saved adapter use load_adapter(model, folder, trainable=True), "
                        "to start a new one build the base model again")
    experts, linear_targets, never = lora_experts.split_targets(model, cfg.targets) if cfg.targets else ([], (), set())
    names = target_names(model, linear_targets, strict=every_target) if linear_targets else []
    unadapted = [n for n, m in model.named_modules() if n and _is_wrappable(m) and n.rsplit(".", 1)[-1] in never
                 and _selected(n, cfg.targets)]
    names = [n for n in names if n not in unadapted]
    if not names and not experts and unadapted:
        raise UserError(f"targets={cfg.targets!r}: select only {', '.join(sorted({n.rsplit('.', 1)[-1] for n in unadapted}))} "
                        f"linears, which on this mixture-of-experts model name the experts in peft's format, so an "
                        f"adapter on them could not be saved — target the attention (q_proj, ...) or the experts")
    if not names and not experts and cfg.targets:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _is_wrappable(m)})
        first = cfg.targets if isinstance(cfg.targets, str) else cfg.targets[0]
        raise UserError(f"targets={cfg.targets!r}: match no module of the model — {_did_you_mean(model, first)}its "
                        f"linear layers end in {', '.join(linears) or '(none)'}")
    saved = _resolve_modules_to_save(model, cfg, names)
    if not names and not saved:
        raise UserError("apply_lora: no targets and no modules_to_save, so nothing would train — "
                        "name modules to adapt, e.g. targets=['q_proj', 'v_proj'] (or 'all-linear')")
    for n in names:
        _set_module(model, n, _wrap(model.get_submodule(n), cfg, cfg.rank_for(n)))
    lora_experts.attach(model, experts, cfg.r, cfg.alpha, cfg.rslora, cfg.dtype, cfg.rank_for)
    setattr(model, _STATE_ATTR, Applied(cfg, tuple(names), saved, tuple(experts), tuple(unadapted)))
    return names + experts


def _selected(name: str, targets: Sequence[str] | str) -> bool:
    """Whether `targets` (a list of suffixes, a regular expression or "all-linear") select module `name`."""
    if targets == ALL_LINEAR:
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name_matches(name, t) for t in targets)


def _resolve_modules_to_save(model: nn.Module, cfg: LoRAConfig, wrapped: list[str]):
    """The parameters of `cfg.modules_to_save`, each with a frozen copy of its base value."""
    out: list[tuple[str, nn.Parameter, nn.Parameter]] = []
    seen: set[int] = set()
    for want in cfg.modules_to_save:
        hits = [n for n, _ in model.named_modules() if n and name_matches(n, want)]
        if not hits:
            raise UserError(f"modules_to_save: {want!r} matches no module of the model — "
                            f"{_did_you_mean(model, want)}use a module name "
                            f"suffix such as 'lm_head' or 'embed_tokens'")
        for n in hits:
            if any(w == n or w.startswith(n + ".") for w in wrapped):
                raise UserError(f"modules_to_save: {n} also gets a LoRA adapter — train it one way: drop it from "
                                f"modules_to_save or from the targets")
            for pn, p in model.get_submodule(n).named_parameters():
                check_float_trainable(f"{n}.{pn}", p)
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{n}.{pn}", p, nn.Parameter(p.detach().clone(), requires_grad=False)))
    return out


def freeze_for_adapters(model: nn.Module, cfg: LoRAConfig | None = None) -> int:
    """requires_grad False everywhere except the LoRA tensors and `modules_to_save`; returns the
    number of trainable parameters. `cfg` must be the one `apply_lora` used (defaults to it)."""
    st = applied(model)
    if st is None:
        raise UserError("freeze_for_adapters: the model has no adapters — call apply_lora(model, cfg) "
                        "or load_adapter(model, folder, trainable=True) first")
    if cfg is not None and tuple(cfg.modules_to_save) != st.config.modules_to_save:
        raise UserError(f"freeze_for_adapters: modules_to_save={list(cfg.modules_to_save)} differs from the "
                        f"{list(st.config.modules_to_save)} given to apply_lora — pass the same config to both")
    for n, p in model.named_parameters():
        p.requires_grad_(False)
    names = [n for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]
    names += [n for n, _, _ in st.saved]
    params = dict(model.named_parameters(remove_duplicate=False))
    for n in names:
        check_float_trainable(n, params[n])
        params[n].requires_grad_(True)
    return sum(logical_numel(p) for p in model.parameters() if p.requires_grad)


def count_parameters(model: nn.Module) -> int:
    """The model's logical parameter count (shared tensors once; nf4 layers at their unpacked size)."""
    return sum(logical_numel(p) for p in model.parameters())


# ----------------------------------------------------------------------------- using


def lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Run the base model: LoRA updates off and `modules_to_save` back at their base values.

    This is the DPO reference model. Restores the previous state on exit, also on error.
    """
    st = applied(model)
    layers = lora_layers(model)
    if st is None and not layers and not lora_experts.expert_adapters(model):
        raise UserError("disable_adapters: the model has no adapters, so there is no base model to fall back to "
                        "— apply_lora / load_adapter first, or use a separate reference model")
    merged = [n for n, m in layers if m.merged] + [n for n, d in lora_experts.expert_adapters(model) if d.merged]
    if merged:
        raise UserError(f"disable_adapters: {merged[0]} is merged, so its base weight already holds the update "
                        f"— call unmerge(model) first")
    # swap each fully trained Parameter (wherever it is registered, ties included) for its base copy
    saved = st.saved if st else []
    original = {id(live): base for _, live, base in saved}
    present = {id(p) for m in model.modules() for p in m._parameters.values() if p is not None}
    swapped = [(mod, key, p) for mod in model.modules() for key, p in mod._parameters.items()
               if p is not None and id(p) in original]
    missing = [n for n, live, base in saved if id(live) not in present and id(base) not in present]
    if missing:
        raise UserError(f"disable_adapters: {missing[0]} was replaced after apply_lora (e.g. a resize), so "
                        f"its base value is lost — resize before apply_lora / load_adapter")
    before = [(m, m.disabled) for _, m in layers + lora_experts.expert_adapters(model)]
    try:
        for mod, key, p in swapped:
            mod._parameters[key] = original[id(p)]
        for m, _ in before:
            m.disabled = True
        yield model
    finally:
        for mod, key, p in swapped:
            mod._parameters[key] = p
        for m, was in before:
            m.disabled = was


@contextlib.contextmanager
def merged_for_decoding(model: nn.Module) -> Iterator[int]:
    """Decoding without a graph (a sampler's rollout): each LoRA layer that can runs as ONE product with
    a merged copy `W + scaling * B @ A`, made here once, instead of three (the base, A, then B). Yields
    how many layers took a copy; they are dropped on exit, and the base weight is never written.

    Only on a CPU, for fp32 float bases with fp32 adapters, no dropout, outside autocast: there a
    decoding step's products are a few rows each and each costs its fixed overhead, so the adapter's
    two extra products (and their casts and scaling) were a fifth of a GRPO rollout on the demo model;
    fp32 keeps the update (a bf16 copy would round most of it away); and a CPU run has the memory for
    the copies (one of each adapted weight, for the rollout), which a CUDA run's memory plan does not
    count. Quantized bases, gated adapters (ARD), merged or disabled layers keep their own forward.
    The copy rounds differently from the three products (float rounding: a step's logits agree to
    ~1e-7), which a draw notices only on an exact tie."""
    layers = [] if torch.is_autocast_enabled("cpu") else [m for _, m in lora_layers(model) if _decodes_merged(m)]
    try:
        with torch.no_grad():
            for m in layers:  # W + scaling * (B @ A), (out, in)
                m.decoding_weight = torch.addmm(m.weight, m.lora_B.weight, m.lora_A.weight, alpha=m.scaling)
        yield len(layers)
    finally:
        for m in layers:
            m.decoding_weight = None


def _decodes_merged(m: LoRALinear) -> bool:
    drop = m.lora_dropout
    dropping = isinstance(drop, nn.Dropout) and drop.training and drop.p > 0
    return (type(m).base_forward is LoRALinear.base_forward and type(m.lora_A) is nn.Linear
            and not (m.merged or m.disabled or dropping) and m.weight.device.type == "cpu"
            and m.weight.dtype == m.lora_A.weight.dtype == m.lora_B.weight.dtype == torch.float32)


# ----------------------------------------------------------------------------- report


def _bytes(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


def trainable_report(model: nn.Module) -> str:
    """What will train: count, % of all parameters, by kind (LoRA, embeddings, head, other).

    Fully trained tensors outside LoRA get a WARNING line with their share of the model and the
    extra memory they cost (gradients + two fp32 AdamW moments, plus the base copy kept for
    `disable_adapters`): the 46%-trainable surprise of `modules_to_save` must not go unnoticed.
    """
    st = applied(model)
    copied = {id(live) for _, live, _ in st.saved} if st is not None else set()
    head = output_head(model)
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    emb_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    kinds = {"lora_A/lora_B": 0, "embeddings": 0, "head": 0, "other": 0}
    full: dict[str, list[str]] = {}  # module -> parameter names, for fully trained non-LoRA tensors
    extra_bytes = 0
    total = trainable = 0
    for n, p in model.named_parameters():  # shared (tied) parameters are counted once
        k = logical_numel(p)
        total += k
        if not p.requires_grad:
            continue
        trainable += k
        if ".lora_A." in n or ".lora_B." in n:
            kind = "lora_A/lora_B"
        else:
            kind = "embeddings" if id(p) in emb_ids else "head" if id(p) in head_ids else "other"
            if not (kind == "head" and getattr(model, "classification_head", None)):  # a new head must train
                full.setdefault(n.rpartition(".")[0] or n, []).append(n)
            has_copy = id(p) in copied  # modules_to_save keep a frozen base copy for disable_adapters
            extra_bytes += k * ((2 if has_copy else 1) * _bytes(p.dtype) + 8)  # grad (+ copy) + 2 fp32 moments
        kinds[kind] += k
    pct = lambda k: 100.0 * k / max(total, 1)  # noqa: E731
    layers = lora_layers(model)
    lines = [f"trainable: {trainable:,} of {total:,} parameters ({pct(trainable):.2f}%)"]
    experts = lora_experts.expert_adapters(model)
    for kind, k in kinds.items():
        note = ""
        if kind == "lora_A/lora_B" and (layers or experts):
            rs = sorted({m.r for _, m in layers} | {m.r for _, m in experts})
            note = f"  in {len(layers)} layers, r={','.join(map(str, rs))}"
            if experts:
                k_exp = sum(logical_numel(p) for _, m in experts for p in m.parameters() if p.requires_grad)
                note = (f"  in {len(layers)} linear layers and {len(experts)} expert weights "
                        f"({sum(m.num_experts for _, m in experts)} experts' pairs: {k_exp:,}, {pct(k_exp):.2f}%), "
                        f"r={','.join(map(str, rs))}")
        lines.append(f"  {kind:<14} {k:>14,}  ({pct(k):.2f}%){note}")
    if lora_experts.expert_parameters(model) and st is not None and not experts and (st.wrapped or st.saved):
        lines.append("  experts: none adapted — the targets reach no expert (name experts.gate_up_proj / "
                     "experts.down_proj, or all-linear)")
    if st is not None and st.unadapted:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in st.unadapted})
        lines.append(f"  left unadapted: {len(st.unadapted)} dense linears ({', '.join(leaves)}: "
                     f"{', '.join(st.unadapted[:3])}{', ...' if len(st.unadapted) > 3 else ''}) — on this model "
                     f"peft reads these names as the experts', so an adapter on them would not load there")
    if full:
        k_full = sum(logical_numel(model.get_parameter(n)) for names in full.values() for n in names)
        lines.append(f"WARNING: fully training {', '.join(full)}: {k_full:,} parameters = {pct(k_full):.1f}% "
                     f"of the model, ~{extra_bytes / 2**20:,.1f} MiB more for gradients, AdamW state and the "
                     f"base copy — drop modules_to_save unless the task needs them (new tokens do not)")
    return "\n".join(lines)
