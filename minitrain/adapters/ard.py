"""ARD-LoRA: LoRA with a Gaussian gate on each rank component and an ARD prior over the gates.

Field report 000 ("ARD-LoRA", a probabilistic LoRA with ARD priors) trained such an adapter and
hit a KL term with no gradient path, patched by `loss + param.sum() * 0`. Here the KL is a
closed-form function of the adapter's own gate parameters, so it is in the graph by construction.
This module is the adapter; its training (the ELBO objective, the uncertainty evaluation and the
prior's schedule) is `minitrain.objectives.ard`.

The model (variational Bayes over per-rank gates):

    y = base(x) + s * B diag(z) A x,          z_k ~ q(z_k) = N(mu_k, sigma_k^2)    (k = 1..r)
    prior  p(z_k) = N(0, 1 / alpha_k)                                            (one precision per rank)
    KL(q || p) = sum_k 1/2 [ alpha_k (mu_k^2 + sigma_k^2) - 1 - log(alpha_k sigma_k^2) ]

- Automatic Relevance Determination: one prior precision per group of weights, re-estimated from
  the evidence, so the groups the data does not need are driven to zero (MacKay 1994, "Bayesian
  non-linear modeling for the prediction competition"; Tipping 2001, "Sparse Bayesian Learning
  and the Relevance Vector Machine", JMLR 1). Bishop 1999 ("Bayesian PCA", NIPS 11) put exactly
  this per-column ARD prior on a low-rank factorisation to choose its rank; here the groups are the
  rank components of a LoRA update.
- Variational inference with reparameterised samples `z = mu + sigma * eps` (Kingma & Welling 2014,
  "Auto-Encoding Variational Bayes"; Blundell et al. 2015, "Weight Uncertainty in Neural
  Networks"), as Bayesian LoRA methods do for the adapter weights themselves (Wang et al. 2024,
  "BLoB: Bayesian Low-Rank Adaptation by Backpropagation for Large Language Models").
  Not to be confused with Shinwari & Usama 2025 ("ARD-LoRA: Dynamic Rank Allocation ...", arXiv
  2506.18267), which learns deterministic per-head scaling factors under l1 / total-variation
  penalties: the report's system is the Bayesian one above.

Train mode draws one gate sample per rank per forward (shared by the batch; checkpointing replays
the same draw, torch.utils.checkpoint restores the RNG); eval mode uses the posterior mean mu.

The ARD update (`update_prior`) is the exact M-step of variational EM for the prior precisions:
`alpha_k = argmax_alpha E_q[log p(z_k | alpha)] = 1 / E_q[z_k^2] = 1 / (mu_k^2 + sigma_k^2)`. The
gates are shared by all tokens, so this update depends on the data only through q; the held-out
batches serve the uncertainty evaluation run at the same moment (token accuracy, NLL, expected
calibration error), which is how the report judged the prior. Between updates alpha is constant.

The gate parameters live on the `lora_A` submodule (whose r outputs they scale), named
`lora_A.gate_mu` / `lora_A.gate_logvar`, so every name-based tool sees them as adapter tensors:
`freeze_for_adapters`, `trainable_report`, the gradient audit, checkpoints. The layers become
`ARDLoRALinear*` subclasses of the LoRA layers (the class swap `torch.nn.utils.parametrize` also
uses), which changes only `delta_weight` to the posterior-mean update `s * B diag(mu) A`, so
merging is right. `fold_gates` rewrites a layer exactly into `mu = 1` form (A <- diag(mu) A, the
gate distribution scaled with it), after which the PEFT-format adapter that `save_adapter` writes
is the posterior-mean LoRA, loadable by PEFT.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from minitrain.adapters.lora import LoRALinear, LoRALinear4bit, LoRALinear8bit
from minitrain.errors import UserError


# ----------------------------------------------------------------------------- the gate


def gate_kl(mu: torch.Tensor, logvar: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """sum_k KL(N(mu_k, exp(logvar_k)) || N(0, 1/alpha_k)), closed form, fp32 scalar."""
    mu, logvar, alpha = mu.float(), logvar.float(), alpha.float()
    return 0.5 * (alpha * (mu * mu + logvar.exp()) - 1.0 - alpha.log() - logvar).sum()


class RankGate(nn.Linear):
    """`lora_A` of an ARD layer: `A x` (r outputs), each output k multiplied by its gate z_k.

    weight (r, in): A, the same Parameter as before (key `...lora_A.weight` unchanged).
    gate_mu, gate_logvar (r,): q(z) = N(mu, exp(logvar)), trainable, fp32.
    prior_precision (r,): alpha, a buffer set by `update_prior` (never trained).
    `sample`: None follows `self.training` (sample in train, mean in eval); True / False forces it.
    """

    def __init__(self, linear: nn.Linear, init_std: float = 0.1, prior_precision: float = 1.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", None)
        r, device = linear.out_features, linear.weight.device
        self.gate_mu = nn.Parameter(torch.ones(r, device=device))
        self.gate_logvar = nn.Parameter(torch.full((r,), 2 * math.log(init_std), device=device))
        self.register_buffer("prior_precision", torch.full((r,), float(prior_precision), device=device))
        self.sample: bool | None = None

    def gate(self) -> torch.Tensor:
        """z (r,) fp32: a reparameterised draw `mu + sigma * eps` when sampling, else the mean mu."""
        sampling = self.training if self.sample is None else self.sample
        if not sampling:
            return self.gate_mu
        eps = torch.randn_like(self.gate_mu)
        return self.gate_mu + (0.5 * self.gate_logvar).exp() * eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.weight)  # (..., r) in the adapter dtype
        return h * self.gate().to(h.dtype)

    def kl(self) -> torch.Tensor:
        return gate_kl(self.gate_mu, self.gate_logvar, self.prior_precision)

    @torch.no_grad()
    def update_prior(self) -> None:
        """ARD M-step: alpha_k = 1 / E_q[z_k^2] = 1 / (mu_k^2 + sigma_k^2)."""
        second_moment = self.gate_mu.float() ** 2 + self.gate_logvar.float().exp()
        self.prior_precision.copy_(1.0 / second_moment.clamp(min=1e-12))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, r={self.out_features}, gated (ARD)"


class _ARDDelta:
    """Mixin for the LoRA layers: the merged update is the posterior mean `s * B diag(mu) A`."""

    def delta_weight(self) -> torch.Tensor:
        a = self.lora_A.weight.detach().float() * self.lora_A.gate_mu.detach().float()[:, None]  # (r, in)
        return (self.lora_B.weight.detach().float() @ a) * self.scaling


class ARDLoRALinear(_ARDDelta, LoRALinear):
    """`LoRALinear` (float base) with a gated `lora_A` (`RankGate`)."""


class ARDLoRALinear4bit(_ARDDelta, LoRALinear4bit):
    """`LoRALinear4bit` (bitsandbytes nf4 / fp4 base) with a gated `lora_A`."""


class ARDLoRALinear8bit(_ARDDelta, LoRALinear8bit):
    """`LoRALinear8bit` (bitsandbytes int8 base) with a gated `lora_A`."""


_ARD_CLASS = {LoRALinear: ARDLoRALinear, LoRALinear4bit: ARDLoRALinear4bit, LoRALinear8bit: ARDLoRALinear8bit}


def make_ard(model: nn.Module, *, init_std: float = 0.1, prior_precision: float = 1.0) -> list[str]:
    """Turn every LoRA layer of `model` (after `apply_lora` / `load_adapter`) into an ARD layer.

    Gates start at mu = 1 (the layer computes what it did before in eval mode), sigma = init_std,
    with the prior N(0, 1 / prior_precision); the gate tensors are trainable exactly when the
    layer's `lora_A.weight` is. Returns the names of the converted layers.
    """
    if not init_std > 0 or not prior_precision > 0:
        raise UserError(f"make_ard: init_std={init_std}, prior_precision={prior_precision} must be > 0 — e.g. 0.1 and 1.0")
    modules = list(model.named_modules())  # collected first: the loop below replaces submodules
    for name, m in modules:
        if isinstance(m, _ARDDelta):
            raise UserError(f"make_ard: {name} already has ARD gates — convert a model once")
    names = []
    for name, m in modules:
        if type(m) in _ARD_CLASS:
            train = m.lora_A.weight.requires_grad
            m.lora_A = RankGate(m.lora_A, init_std, prior_precision)
            m.lora_A.gate_mu.requires_grad_(train)
            m.lora_A.gate_logvar.requires_grad_(train)
            m.__class__ = _ARD_CLASS[type(m)]  # same attributes; only delta_weight differs
            names.append(name)
    if not names:
        raise UserError("make_ard: the model has no LoRA layers — apply_lora(model, cfg) first")
    return names


def gates(model: nn.Module) -> list[tuple[str, RankGate]]:
    """(layer name, its RankGate) for every ARD layer."""
    return [(n.removesuffix(".lora_A"), m) for n, m in model.named_modules() if isinstance(m, RankGate)]


def ard_kl(model: nn.Module) -> torch.Tensor:
    """Total KL(q || p) over every gate of the model (fp32 scalar, in the graph of the gate parameters)."""
    terms = [g.kl() for _, g in gates(model)]
    if not terms:
        raise UserError("ard_kl: the model has no ARD gates — call make_ard(model) after apply_lora")
    return torch.stack(terms).sum()


def update_prior(model: nn.Module) -> None:
    """The ARD M-step on every gate (see `RankGate.update_prior`)."""
    for _, g in gates(model):
        g.update_prior()


def relevance(model: nn.Module, threshold: float = 1e3) -> dict[str, int]:
    """Per layer, how many rank components the prior still keeps (alpha_k < threshold)."""
    return {n: int((g.prior_precision < threshold).sum()) for n, g in gates(model)}


@torch.no_grad()
def fold_gates(model: nn.Module) -> None:
    """Rewrite each ARD layer exactly so that mu = 1: A_k <- mu_k A_k, z_k <- z_k / mu_k.

    The posterior over the layer's update is unchanged (sigma and the prior scale by 1/|mu_k|, so
    the KL is unchanged too), and `lora_A.weight` / `lora_B.weight` are then the posterior-mean
    LoRA: what `save_adapter` writes in PEFT's format. A gate with mu_k == 0 keeps a zero row.
    """
    for _, g in gates(model):
        mu = g.gate_mu.float()
        scale = torch.where(mu == 0, torch.ones_like(mu), mu.abs())
        g.weight.mul_(mu[:, None].to(g.weight.dtype))
        g.gate_logvar.sub_(2 * scale.log())
        g.prior_precision.mul_(scale ** 2)
        g.gate_mu.copy_(torch.where(mu == 0, torch.zeros_like(mu), torch.ones_like(mu)))


def save_gates(model: nn.Module, path: str | Path) -> Path:
    """The gate distributions and priors (`<layer>.gate_mu`, `.gate_logvar`, `.prior_precision`) as safetensors."""
    tensors = {}
    for n, g in gates(model):
        for k in ("gate_mu", "gate_logvar", "prior_precision"):
            tensors[f"{n}.{k}"] = getattr(g, k).detach().float().contiguous().cpu()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    return path


def prior_state(model: nn.Module) -> dict[str, list[float]]:
    """The prior precisions by layer, as JSON-able lists (for the run's ard.jsonl)."""
    return {n: g.prior_precision.tolist() for n, g in gates(model)}


def load_prior_state(model: nn.Module, state: dict[str, list[float]]) -> None:
    """Set the prior precisions from `prior_state` output (exact: float32 values round-trip through JSON)."""
    by_name = dict(gates(model))
    if set(state) != set(by_name):
        raise UserError("ard prior: the saved prior names other layers than the model's ARD gates — resume with "
                        "the same lora_targets")
    for n, values in state.items():
        by_name[n].prior_precision.copy_(torch.tensor(values, dtype=torch.float32))
