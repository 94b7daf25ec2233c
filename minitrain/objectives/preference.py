"""Reference-free preference objectives on pairs: ORPO, CPO and SimPO (one forward per pair).

DPO (`minitrain.objectives.dpo`) needs a reference forward of every pair (or a precomputed cache). These
methods need none: the policy's own log-probs of the chosen and rejected answers, from ONE
concatenated forward of `[chosen; rejected]` (chunked log-probs, no `2P x T x V` logits), are
the whole loss. The formulas, defaults and metric names are TRL's (`trl.experimental.orpo`
`ORPOTrainer`, `trl.experimental.cpo` `CPOTrainer`):

- `orpo` (Hong et al. 2024): `NLL(chosen) - beta * logsigmoid(log_odds)`, with
  `log_odds = (a_c - a_r) - (log(1 - exp a_c) - log(1 - exp a_r))` on the per-token MEAN
  completion log-probs `a`; `beta` is the paper's lambda. As in TRL (and the ORPO authors'
  code), the NLL runs over the chosen row's whole sequence, prompt tokens included (a vision-language
  model's image placeholders excepted: an image is input, never a target, as in SFT).
- `cpo` (Xu et al. 2024): `-logsigmoid(beta * (s_c - s_r)) + sft_weight * NLL(chosen answer)`
  on SUMMED completion log-probs `s` (TRL's CPO `loss_type="sigmoid"`; `sft_weight` is TRL's
  `cpo_alpha`, whose default there is 1.0).
- `simpo` (Meng et al. 2024): `-logsigmoid(beta * (a_c - a_r) - simpo_gamma)` on MEAN
  completion log-probs (TRL writes `beta * (a_c - a_r - gamma / beta)`), plus
  `sft_weight * NLL(chosen answer)`: `sft_weight=0` is SimPO as published, `> 0` is TRL's
  CPO-SimPO. `label_smoothing` gives both cpo and simpo the conservative mixture TRL applies.

Rewards, as TRL logs them: `beta * logp` of each answer (mean log-probs for orpo and simpo,
summed for cpo), detached; `rewards/accuracies` counts a pair when the chosen reward is higher.

The unit of the loss is the pair (docs/design.md rule 2). TRL's NLL term is a token mean over the whole
micro-batch, which depends on how pairs are grouped; here it is each pair's own token mean
(`NLL / tokens` of that pair's chosen row), so `batch 8 x accum 1 == batch 2 x accum 4`. The
two agree exactly when every chosen row of the batch has as many scored tokens (the parity
tests use such batches; the other terms agree on any batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minitrain.data.collate import IGNORE_INDEX
from minitrain.data.packing import per_sequence, sequence_ids
from minitrain.errors import UserError
from minitrain.objectives.configs import REFERENCE_FREE, PreferenceConfig
from minitrain.objectives.dpo import evaluate_dpo, make_dpo_objective
from minitrain.objectives.losses import shift_labels
from minitrain.objectives.reference import num_pairs
from minitrain.objectives.sft import batch_token_logprobs, router_aux

PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected", "nll_loss")
ORPO_METRICS = PAIR_METRICS + ("log_odds_ratio", "log_odds_chosen")


# ----------------------------------------------------------------------------- the losses


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (branch at -log 2, Maechler 2012)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor, beta: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO's odds-ratio term per pair, as TRL's `ORPOTrainer.odds_ratio_loss` (signs: a loss to add).

    Inputs: (P,) per-token mean completion log-probs. Returns `(losses, chosen_rewards,
    rejected_rewards, log_sigmoid_odds, log_odds)`, each (P,): `losses = -beta * logsigmoid(log_odds)`
    (add the NLL of the chosen answer for ORPO's loss), rewards `beta * logp` detached, and the two
    values TRL logs as `log_odds_ratio` and `log_odds_chosen` (detached).
    """
    c, r = chosen_mean_logps.float(), rejected_mean_logps.float()
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))  # (P,)
    ratio = F.logsigmoid(log_odds)
    return -beta * ratio, beta * c.detach(), beta * r.detach(), ratio.detach(), log_odds.detach()


def cpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, *, beta: float, loss_type: str = "cpo",
             simpo_gamma: float = 0.5, label_smoothing: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPO / SimPO per pair, as TRL's `CPOTrainer.cpo_loss` (`loss_type` "sigmoid" there is `cpo` here).

    Inputs: (P,) completion log-probs, summed (cpo) or per-token means (simpo). With
    `z = beta * (chosen - rejected)` (simpo: minus `simpo_gamma`) and `e = label_smoothing`:
    `losses = -(1 - e) logsigmoid(z) - e logsigmoid(-z)`. Returns `(losses, chosen_rewards,
    rejected_rewards)`, rewards `beta * logp` detached. The NLL term is added by the caller.
    """
    if loss_type not in ("cpo", "simpo"):
        raise ValueError(f"cpo_loss: loss_type must be cpo or simpo, got {loss_type!r}")
    logits = chosen_logps - rejected_logps  # (P,)
    if loss_type == "simpo":
        logits = logits - simpo_gamma / beta
    e = label_smoothing
    losses = -F.logsigmoid(beta * logits) * (1 - e) - F.logsigmoid(-beta * logits) * e
    return losses, beta * chosen_logps.detach(), beta * rejected_logps.detach()


# ----------------------------------------------------------------------------- the objective


class ReferenceFreeObjective:
    """`(model, batch) -> (loss summed over pairs, number of pairs, metrics)`: orpo, cpo or simpo.

    One forward of the `collate_preference` batch `[chosen; rejected]` (or its packed rows,
    `collate_packed_pairs`) scores everything: the
    completion log-probs of both answers and the NLL of the chosen one (for orpo over the
    chosen row's whole sequence, so the prompt tokens of the chosen rows are scored too).
    Metrics are TRL's names, means over the batch's pairs: `rewards/chosen`, `rewards/rejected`,
    `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected` (TRL's: per-token
    means for orpo and simpo, sums for cpo), `nll_loss` (each pair's per-token NLL; TRL: the
    batch's token mean), and for orpo `log_odds_ratio`, `log_odds_chosen`. TRL's `logits/chosen`
    and `logits/rejected` (means over a full logits tensor) are not logged: none is built.
    Held-out evaluation is `evaluate_dpo` (the loss and these metrics, every pair weighing the same).
    """

    token_level = False
    reference = None

    def __init__(self, loss_type: str, beta: float, sft_weight: float = 0.0, simpo_gamma: float = 0.5,
                 label_smoothing: float = 0.0):
        if loss_type not in REFERENCE_FREE:
            raise UserError(f"loss_type={loss_type}: not a reference-free loss — use one of {', '.join(REFERENCE_FREE)}")
        self.loss_type, self.beta, self.sft_weight = loss_type, beta, sft_weight
        self.simpo_gamma, self.label_smoothing = simpo_gamma, label_smoothing
        self.metrics = ORPO_METRICS if loss_type == "orpo" else PAIR_METRICS

    def pair_stats(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Per-pair tensors (P,): `loss` (with graph) and the metric values (detached)."""
        P = num_pairs(batch)
        labels = batch["labels"]  # (rows, T): the completion tokens, -100 elsewhere
        answer = shift_labels(labels) != IGNORE_INDEX  # (rows, T) scored completion positions
        scored = labels
        if self.loss_type == "orpo":  # the chosen rows' NLL covers prompt and answer (TRL, ORPO's code)
            seq = sequence_ids(batch)  # (rows, T)
            starts = torch.ones_like(seq, dtype=torch.bool)  # never a target: keeps the shift in each sequence
            starts[:, 1:] = seq[:, 1:] != seq[:, :-1]
            ids = batch["input_ids"]
            images = torch.tensor(getattr(model, "placeholder_ids", ()), dtype=ids.dtype, device=ids.device)
            # an image placeholder is input, never a target (as in SFT)
            whole = ids.masked_fill((seq < 0) | starts | torch.isin(ids, images), IGNORE_INDEX)
            scored = torch.where((seq >= 0) & (seq < P), whole, labels)
        token_logps = batch_token_logprobs(model, batch, scored)  # (rows, T)
        sums = per_sequence(batch, token_logps * answer)  # (2P,) completion log-probs
        means = sums / per_sequence(batch, answer).clamp(min=1)
        if self.loss_type == "orpo":
            nll_tokens = per_sequence(batch, shift_labels(scored) != IGNORE_INDEX)[:P].clamp(min=1)
            nll = -per_sequence(batch, token_logps)[:P] / nll_tokens  # (P,) per-token NLL of each chosen row
            ratio_losses, r_c, r_r, ratio, log_odds = orpo_loss(means[:P], means[P:], self.beta)
            losses = self.sft_weight * nll + ratio_losses
            logps = means
            extra = {"log_odds_ratio": ratio, "log_odds_chosen": log_odds}
        else:
            logps = means if self.loss_type == "simpo" else sums
            losses, r_c, r_r = cpo_loss(logps[:P], logps[P:], beta=self.beta, loss_type=self.loss_type,
                                        simpo_gamma=self.simpo_gamma, label_smoothing=self.label_smoothing)
            nll = -means[:P]  # (P,) per-token NLL of each chosen answer
            if self.sft_weight:
                losses = losses + self.sft_weight * nll
            extra = {}
        return {"loss": losses, "rewards/chosen": r_c, "rewards/rejected": r_r,
                "rewards/accuracies": (r_c > r_r).float(), "rewards/margins": r_c - r_r,
                "logps/chosen": logps[:P].detach(), "logps/rejected": logps[P:].detach(),
                "nll_loss": nll.detach(), **extra}

    def __call__(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, int, dict[str, float]]:
        stats = self.pair_stats(model, batch)
        means = torch.stack([stats[k].mean() for k in self.metrics]).tolist()  # one host sync
        loss_sum, count, routing = router_aux(model, batch, stats["loss"].sum(), num_pairs(batch))  # (an MoE's)
        return loss_sum, count, {**dict(zip(self.metrics, means)), **routing}

    def evaluate(self, model: nn.Module, examples: Sequence[dict], collate: Callable[[list[dict]], dict[str, Any]],
                 batch_size: int, amp_dtype: torch.dtype | None = None) -> dict[str, float]:
        """`eval/loss` (mean per pair) and `eval/<TRL metric>` over `examples` (see `evaluate_dpo`)."""
        return evaluate_dpo(model, self, examples, collate, batch_size, amp_dtype)


def make_pair_objective(config: PreferenceConfig, reference=None):
    """The objective `config.loss_type` names: `ReferenceFreeObjective` for orpo / cpo / simpo (no
    reference), else DPO's (`minitrain.objectives.dpo.DPOObjective`, which needs `reference` or a cache)."""
    if config.loss_type in REFERENCE_FREE:
        return ReferenceFreeObjective(config.loss_type, config.beta, config.sft_weight, config.simpo_gamma,
                                      config.label_smoothing)
    return make_dpo_objective(config.beta, config.loss_type, config.label_smoothing, config.sft_weight, reference)
