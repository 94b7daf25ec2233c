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

Bases: nf4 and int8 (bitsandbytes) and ternary (minitrain.adapters.ternary, BitNet b1.58's {-1, 0, +1} x
absmean scale, whose error is far larger: there the correction matters most, field report 004).

Rank: one `r` for every adapter, or per layer as a fraction of its full rank (`resolve_rank`:
`rank=0.15` gives each linear `floor(0.15 * min(out, in))`, as report 004's "15% LRC rank"; 1 or
more is a rank, capped at the layer's full rank), carried by the LoRA config's `rank_pattern`.

Activation-aware initialisation (`calibrate`): what matters is the layer's output error on the
inputs it sees, E_x ||(W - Wq - s B A) x||^2 = ||(E - s B A) R||_F^2 with R = Sigma^(1/2) and
Sigma = E[x x^T] (in, in), the second moment of the layer's inputs over a few calibration batches
(the quantized model's own activations, every position of the batch; an (in, in) fp32 matrix per
adapted layer is held during the initialisation). Its best rank-r
minimiser is the whitened truncated SVD (as in SVD-LLM, Wang et al. 2024):

    E R ~ U_r S_r V_r^T,    s B A = U_r S_r V_r^T R^-1

with Sigma damped by 1% of its mean diagonal so that R is invertible (GPTQ's damping). Without
calibration Sigma = I and this is the plain SVD above. The correction is of the weight only: the
error of the activation quantizer (`ternary_act_bits`) is left to training.

The full-precision W comes from the checkpoint on disk, read one tensor at a time while the model
holds only its quantized weights: no second model in memory (field report 004), peak extra
memory about one fp32 weight matrix and its SVD.

Field report 004 also needed `enable_input_require_grads()` to make gradient checkpointing work on
frozen embeddings. Nothing of the kind is needed or done here: the loop's checkpointing is
non-reentrant (`minitrain.train.enable_checkpointing`), which records the graph through adapters
whose block input does not require grad (tests/test_lrc.py checks the gradients are equal).

An adapter made this way corrects *this* quantized base: load it onto the same base quantized the
same way (and, with `iters > 1`, re-quantized by `init_lrc` again, which is deterministic), not
onto the full-precision model, where it would add the quantization error instead of removing it
(`minitrain merge --quantize <format>` folds it into the dequantized base, a float model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from minitrain.adapters.lora import LoRALinear, LoRALinear4bit, LoRALinear8bit, LoRALinearTernary, target_names
from minitrain.errors import UserError
from minitrain.weights import checkpoint_files, read_header, read_tensor

QUANTIZED_LORA = (LoRALinear4bit, LoRALinear8bit, LoRALinearTernary)
DAMP = 0.01  # Sigma + DAMP * mean(diag Sigma) * I


def resolve_rank(rank: float, in_features: int, out_features: int) -> int:
    """A layer's LRC rank: below 1 a fraction of its full rank min(out, in) (floored, at least 1);
    1 or more a rank (capped at the full rank)."""
    full = min(in_features, out_features)
    return max(1, int(rank * full)) if rank < 1 else min(int(rank), full)


def lrc_ranks(model: nn.Module, targets, rank: float) -> tuple[int, dict[str, int]]:
    """`(r, rank_pattern)` for `LoRAConfig`: each target linear's `resolve_rank`, the most common as `r`
    and the others by leaf name (`k_proj`), or by full name where one leaf has several ranks."""
    ranks = {n: resolve_rank(rank, m.in_features, m.out_features)
             for n in target_names(model, targets, strict=True) for m in [model.get_submodule(n)]}
    if not ranks:
        raise UserError(f"lora_targets={targets}: match no linear of the model — e.g. lora_targets=all-linear")
    values = list(ranks.values())
    r = max(set(values), key=values.count)
    by_leaf: dict[str, set[int]] = {}
    for n, v in ranks.items():
        by_leaf.setdefault(n.rsplit(".", 1)[-1], set()).add(v)
    pattern = {}
    for n, v in ranks.items():
        leaf = n.rsplit(".", 1)[-1]
        if len(by_leaf[leaf]) == 1:
            if v != r:
                pattern[leaf] = v
        elif v != r:
            pattern[n] = v
    return r, pattern


def _whitening(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, R^-1) with R = (Sigma + damping)^(1/2), symmetric, fp32; from an fp64 eigendecomposition."""
    S = sigma.double()
    S = S + DAMP * S.diagonal().mean().clamp(min=1e-12) * torch.eye(S.shape[0], dtype=S.dtype, device=S.device)
    evals, Q = torch.linalg.eigh(S)
    root = evals.clamp(min=1e-12).sqrt()
    return (Q * root) @ Q.T, (Q / root) @ Q.T


def lrc_factors(error: torch.Tensor, r: int, scaling: float,
                sigma: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(A (r, in), B (out, r))` fp32 with `scaling * B @ A` the best rank-r approximation of `error`:
    in the Frobenius norm, or with `sigma` (in, in) the inputs' second moment, in E_x ||(.) x||^2."""
    E = error.float()
    R = Rinv = None
    if sigma is not None:
        R, Rinv = (t.to(E.dtype) for t in _whitening(sigma))
        E = E @ R
    U, S, Vh = torch.linalg.svd(E, full_matrices=False)  # (out, k), (k,), (k, in)
    # each singular pair is defined up to its sign, which LAPACK and cuSOLVER choose differently:
    # fix it (the largest |entry| of each U column positive) so that a run starts from the same
    # adapter on every device
    sign = U.gather(0, U.abs().argmax(0, keepdim=True)).sign().squeeze(0)  # (k,)
    sign[sign == 0] = 1
    U, Vh = U * sign, Vh * sign[:, None]
    root = (S[:r] / scaling).sqrt()  # (r,)
    B = U[:, :r] * root  # (out, r)
    A = root[:, None] * Vh[:r]  # (r, in)
    return (A if Rinv is None else A @ Rinv), B


@torch.no_grad()
def input_moments(model: nn.Module, layers: dict[str, nn.Module], calibrate: Callable[[nn.Module], None]) \
        -> dict[str, torch.Tensor]:
    """Sigma = X^T X / n (in, in) fp32 of each layer's input over the forwards `calibrate(model)` runs."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name: str):
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, module.in_features).float()  # (n, in)
            sums[name] = sums[name] + x.T @ x if name in sums else x.T @ x
            counts[name] = counts.get(name, 0) + x.shape[0]
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    was_training = model.training
    try:
        model.eval()
        calibrate(model)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    missing = [n for n in layers if n not in sums]
    if missing:
        raise UserError(f"lrc calibration: {missing[0]} saw no input — the calibration batches must run the "
                        f"model's forward (give at least one batch)")
    return {n: sums[n] / counts[n] for n in layers}


@dataclass
class LRCLayer:
    """One corrected layer: relative weight errors `||W - Wq - s B A|| / ||W||` before (B A = 0) and after
    (calibrated: output errors on the calibration inputs, `||(W - Wq - s B A) R|| / ||W R||`)."""

    name: str
    error_before: float
    error_after: float

    @property
    def ratio(self) -> float:
        """after / before: the share of the quantization error the adapter does not remove."""
        return self.error_after / self.error_before if self.error_before > 0 else 0.0


def quantized_lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(name, layer) of every LoRA layer whose base is quantized (nf4, int8, ternary)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QUANTIZED_LORA)]


@torch.no_grad()
def init_lrc(model: nn.Module, fp_weights_source: str | os.PathLike, rank: int | None = None, *, iters: int = 1,
             log: Callable[[str], None] | None = None,
             calibrate: Callable[[nn.Module], None] | None = None) -> list[LRCLayer]:
    """Initialise every LoRA layer over a quantized base to the rank-r SVD of its quantization error.

    fp_weights_source: the HF checkpoint folder the model was loaded from (`*.safetensors`,
        sharded or not); each needed weight is read alone, in file order, and freed after use.
    rank: the adapters' rank (None: each layer's own `r`); another value is a UserError, since
        the adapters' shapes are fixed by `apply_lora`.
    iters: LoftQ alternations (1: correct the base as loaded; T > 1 also re-quantizes the base).
    calibrate: runs the model's forward on a few batches (`calibrate(model)`): the error is then
        weighted by each layer's input second moment (activation-aware; the module docstring), and
        the reported errors are output errors on those inputs, ||(W - Wq - sBA) R|| / ||W R||.
    Layers over float bases are left as they are (zero-initialised B). Returns one `LRCLayer` per
    corrected layer.
    """
    if iters < 1:
        raise UserError(f"lrc iters={iters}: must be >= 1 (1: one SVD of the quantization error) — e.g. iters=1")
    layers = dict(quantized_lora_layers(model))
    if not layers:
        raise UserError("init_lrc: no LoRA layer sits on a quantized base — load the model with quantize=nf4 (or "
                        "int8, ternary) and apply LoRA to its linears first; a float base has no quantization error "
                        "to correct")
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

    sigmas = input_moments(model, layers, calibrate) if calibrate is not None else {}
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
                report.append(_correct(name, m, W, iters, sigmas.pop(name, None)))
                del W
    if log is not None and report:
        mean = sum(r.ratio for r in report) / len(report)
        ranks = ",".join(str(r) for r in sorted({layers[x.name].r for x in report}))
        how = "activation-weighted output" if calibrate is not None else "weight"
        log(f"lrc: {len(report)} adapters initialised to the rank-{ranks} "
            f"{'activation-weighted ' if calibrate is not None else ''}SVD of their "
            f"quantization error ({iters} LoftQ iteration{'s' if iters > 1 else ''}); {how} error "
            f"||W - Wq - sBA|| / ||W - Wq|| = {mean:.3f} on average (1.0 = zero-init)")
    return report


def _correct(name: str, m: LoRALinear, W: torch.Tensor, iters: int, sigma: torch.Tensor | None) -> LRCLayer:
    """Fit one layer's adapter (and, for iters > 1, its re-quantized base) to `W` (out, in) fp32."""
    R = None if sigma is None else _whitening(sigma)[0].float()

    def size(D: torch.Tensor) -> float:  # ||D|| or, calibrated, ||D R||
        return (D if R is None else D @ R).norm().item()

    norm = size(W) or 1.0
    before = size(W - m.dequantized_weight()) / norm
    A = B = None
    for t in range(iters):
        if t > 0:  # LoftQ: quantize what the adapter does not carry, then fit the adapter to the rest
            m._store_weight(W - m.scaling * (B @ A))
        A, B = lrc_factors(W - m.dequantized_weight(), m.r, m.scaling, sigma)
    m.lora_A.weight.copy_(A.to(m.lora_A.weight.dtype))
    m.lora_B.weight.copy_(B.to(m.lora_B.weight.dtype))
    after = size(W - m.dequantized_weight() - m.delta_weight()) / norm
    return LRCLayer(name, before, after)
