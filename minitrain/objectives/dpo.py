"""Direct Preference Optimization without a second model in memory.

Field report 002: DPO Stage B on Mistral-7B after an SFT LoRA Stage A did not fit 12 GB because
a second 7B model was loaded as the reference, the Stage A adapter got a second LoRA stacked on
it, and checkpointing broke gradients. Here the reference is never a second model:

(a) fresh adapter: the reference is the same model with its adapters switched off;
(b) continuing a trained adapter (`init_adapter=DIR`, Stage A -> Stage B): the reference is the
    Stage A policy, kept as a frozen copy of the adapter tensors only (a few MB); the Stage A
    adapter keeps training itself: nothing is stacked on it;
(c) `precompute_ref=true`: the reference log-probs of (a) or (b) computed once before training
    and cached, so the loop does one forward per step instead of two.

How each is scored and cached is `minitrain.objectives.reference`.

The loss (`dpo_loss`) follows TRL's `DPOTrainer` formulas (sigmoid, ipo, hinge, robust) and its
metric names (`rewards/chosen`, ...). Sequences are scored from one concatenated forward of
`[chosen; rejected]` through `chunked_token_logprobs`, so no `B x T x V` logits tensor exists.
The unit of the loss is the pair (docs/design.md rule 2): an objective returns the loss summed over
pairs and the number of pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minitrain.parallel import distributed
from minitrain.data.collate import IGNORE_INDEX, collate_preference
from minitrain.data.packing import collate_packed_pairs
from minitrain.errors import UserError
from minitrain.objectives.configs import DPO_LOSS_TYPES, DPOConfig
from minitrain.objectives.reference import (AdapterSnapshotReference, BaseReference, attach_precomputed, dropout_off,
                                            num_pairs, reference_logps, sequence_logps)
from minitrain.objectives.sft import router_aux

LOSS_TYPES = DPO_LOSS_TYPES
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


# ----------------------------------------------------------------------------- the loss


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses and the implicit rewards, as TRL's `DPOTrainer` computes them.

    Inputs are (P,) summed completion log-probs for P pairs. With
    `delta = (pi_c - ref_c) - (pi_r - ref_r)`:

    - `sigmoid` (DPO, Rafailov et al. 2023): `-logsigmoid(beta * delta)`; with
      `label_smoothing = e > 0` the conservative cDPO form
      `-(1 - e) logsigmoid(beta delta) - e logsigmoid(-beta delta)` (TRL < 1.0 did this; TRL 1.x
      ignores label smoothing for sigmoid, so parity with it holds at `e = 0`);
    - `hinge` (SLiC): `relu(1 - beta * delta)`;
    - `ipo` (Azar et al. 2023, eq. 17): `(delta_avg - 1 / (2 beta))^2` where `delta_avg` uses
      log-ratios divided by each completion's token count, as TRL does (agreed with the IPO
      authors): pass `chosen_lengths` / `rejected_lengths` (P,);
    - `robust` (Chowdhury et al. 2024), `e` = probability a label is flipped, `0 <= e < 0.5`:
      `(-(1 - e) logsigmoid(beta delta) + e logsigmoid(-beta delta)) / (1 - 2 e)`.

    Returns `(losses (P,), chosen_rewards (P,), rejected_rewards (P,))`; rewards are
    `beta * (pi - ref)` on summed log-probs for every loss type, detached (TRL logs these).
    """
    chosen_logratios = policy_chosen_logps - ref_chosen_logps  # (P,)
    rejected_logratios = policy_rejected_logps - ref_rejected_logps  # (P,)
    delta = chosen_logratios - rejected_logratios  # (P,)
    e = label_smoothing
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
        if e:
            losses = (1 - e) * losses - e * F.logsigmoid(-beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("dpo_loss(loss_type='ipo') needs chosen_lengths and rejected_lengths")
        avg_delta = chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(min=1)
        losses = (avg_delta - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        if not 0.0 <= e < 0.5:
            raise ValueError(f"dpo_loss(loss_type='robust') needs 0 <= label_smoothing < 0.5, got {e}")
        losses = ((1 - e) * -F.logsigmoid(beta * delta) + e * F.logsigmoid(-beta * delta)) / (1 - 2 * e)
    else:
        raise ValueError(f"dpo_loss: unknown loss_type {loss_type!r}, expected one of {LOSS_TYPES}")
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


# ----------------------------------------------------------------------------- the objective


class DPOObjective:
    """`(model, batch) -> (loss summed over pairs, number of pairs, metrics)` for the loop.

    Metrics are TRL's names, means over the batch's pairs: `rewards/chosen`, `rewards/rejected`,
    `rewards/accuracies` (share of pairs with chosen reward > rejected reward; a tie, as at
    step 0, counts as wrong, like TRL), `rewards/margins`, `logps/chosen`, `logps/rejected`.
    With `sft_weight > 0`, each pair adds `sft_weight * NLL(chosen) / tokens(chosen)` (the
    per-token mean over that pair's chosen answer, as RPO, Pang et al. 2024; both terms are also
    logged alone, as `dpo_loss` and `sft_nll`), so the term does
    not depend on how pairs are grouped into micro-batches (rule 2); TRL's `sft` loss takes the
    token mean over the whole batch instead, which equals this when chosen lengths are equal.
    Batches carrying `ref_chosen_logps` / `ref_rejected_logps` (precomputed) use them;
    otherwise `reference.logps(model, batch)` runs first, then the policy forward.

    For the loop's evaluation (`minitrain.train.train`): `token_level = False` (the unit is the
    pair, so exp of the loss is no perplexity and the generic `evaluate` reports none), and
    `evaluate(...)` is the held-out pass the loop calls instead of the generic one: `evaluate_dpo`,
    the loss and TRL's metrics from one pass over the pairs.
    """

    token_level = False

    def __init__(self, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 sft_weight: float = 0.0, reference: BaseReference | AdapterSnapshotReference | None = None):
        if loss_type not in LOSS_TYPES:
            raise UserError(f"loss_type={loss_type}: unknown — use one of {', '.join(LOSS_TYPES)}")
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.sft_weight, self.reference = sft_weight, reference

    def pair_stats(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Per-pair tensors (P,): `loss` (with graph) and the metric values (detached)."""
        ref_c, ref_r = reference_logps(model, batch, self.reference, ("ref_chosen_logps", "ref_rejected_logps"),
                                       "DPOObjective")  # before the policy graph exists
        pol = sequence_logps(model, batch)
        losses, r_c, r_r = dpo_loss(pol.chosen, pol.rejected, ref_c, ref_r, beta=self.beta,
                                    loss_type=self.loss_type, label_smoothing=self.label_smoothing,
                                    chosen_lengths=pol.chosen_tokens, rejected_lengths=pol.rejected_tokens)
        stats = {"rewards/chosen": r_c, "rewards/rejected": r_r,
                 "rewards/accuracies": (r_c > r_r).float(), "rewards/margins": r_c - r_r,
                 "logps/chosen": pol.chosen.detach(), "logps/rejected": pol.rejected.detach()}
        if self.sft_weight:  # the two terms logged apart too: the pure DPO loss stays visible
            nll = -pol.chosen / pol.chosen_tokens.clamp(min=1)
            stats.update({"dpo_loss": losses.detach(), "sft_nll": nll.detach()})
            losses = losses + self.sft_weight * nll
        return {"loss": losses, **stats}

    def __call__(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, int, dict[str, float]]:
        stats = self.pair_stats(model, batch)
        keys = [k for k in stats if k != "loss"]  # METRICS (+ dpo_loss, sft_nll with sft_weight)
        means = torch.stack([stats[k].mean() for k in keys]).tolist()  # one host sync
        # an MoE's load-balancing loss on the policy forward (the last one), as TRL adds it per pair
        loss_sum, count, routing = router_aux(model, batch, stats["loss"].sum(), num_pairs(batch))
        return loss_sum, count, {**dict(zip(keys, means)), **routing}

    def evaluate(self, model: nn.Module, examples: Sequence[dict], collate: Callable[[list[dict]], dict[str, Any]],
                 batch_size: int, amp_dtype: torch.dtype | None = None) -> dict[str, float]:
        """`eval/loss` (mean per pair) and `eval/<TRL metric>` over `examples` (see `evaluate_dpo`)."""
        return evaluate_dpo(model, self, examples, collate, batch_size, amp_dtype)


def make_dpo_objective(beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                       sft_weight: float = 0.0, reference=None) -> DPOObjective:
    """The DPO objective for `minitrain.train.train` (see `DPOObjective`)."""
    return DPOObjective(beta, loss_type, label_smoothing, sft_weight, reference)


@torch.no_grad()
def evaluate_dpo(model: nn.Module, objective: DPOObjective, examples: Sequence[dict],
                 collate: Callable[[list[dict]], dict[str, Any]], batch_size: int,
                 amp_dtype: torch.dtype | None = None, prefix: str = "eval/") -> dict[str, float]:
    """Loss and TRL's metrics over held-out pairs, each a mean over all pairs, keys `eval/...`.

    Unlike a mean of per-batch means, every pair weighs the same whatever the batch sizes.
    Scored as in training (same module modes, so the same kernels as the reference) with
    dropout off (see `dropout_off`). `eval/loss` is the mean training loss per pair (with the
    `sft_weight` term), the value the generic `minitrain.train.evaluate` would give.

    Under torchrun each batch of `batch_size` pairs is split across ranks (as the loop's
    `evaluate` does) and the sums are added over ranks, so every rank returns the same figures.
    A rank left without pairs in the last batch scores one at weight 0, so that every rank runs
    the same forwards (FSDP's collectives stay in step).
    """
    device = next(model.parameters()).device
    world, rank = distributed.world_size(), distributed.rank()
    sums: dict[str, torch.Tensor] = {}
    with dropout_off(model):
        for i in range(0, len(examples), batch_size):
            mine = list(examples[i : i + batch_size])[rank::world]
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                     for k, v in collate(mine or list(examples[i : i + 1])).items()}
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                stats = objective.pair_stats(model, batch)
            for k, v in stats.items():
                sums[k] = sums.get(k, 0) + v.detach().float().sum() * (1.0 if mine else 0.0)
    distributed.all_reduce_sum(list(sums.values()))
    n = max(len(examples), 1)
    return {prefix + k: float(v) / n for k, v in sums.items()}


# ----------------------------------------------------------------------------- precomputed reference (c)


def collate_shared_prompt(examples: Sequence[dict], pad_id: int) -> dict[str, Any]:
    """One row per pair, `[prefix, chosen rest, rejected rest]`, so the prompt runs forward and
    backward once per pair instead of twice.

    The prefix is the longest start the two sequences share, ids and labels alike (the prompt,
    and any first answer tokens they have in common). The rejected tokens take the positions
    that follow the prefix (as in their own sequence) and attend to the prefix and to themselves,
    never to the chosen tokens; a causal model therefore gives every token the hidden state it
    has in the two-sequence form. Keys: `input_ids`, `position_ids`, `attention_mask` (P, T) of
    real tokens, the model's `document_ids` (P, T) (0 the prefix, seen by both answers, 1 chosen,
    2 rejected, -1 padding: rejected never sees chosen),
    `chosen_targets` / `rejected_targets` (P, T): the token each position predicts for that
    answer, -100 elsewhere (already shifted: the last prefix position predicts both first answer
    tokens), and `num_pairs`.
    """
    rows, pos, c_tg, r_tg, segs = [], [], [], [], []
    for ex in examples:
        c, r, cl, rl = ex["chosen_ids"], ex["rejected_ids"], ex["chosen_labels"], ex["rejected_labels"]
        n = 0  # shared prefix: equal ids and equal labels
        while n < min(len(c), len(r)) - 1 and c[n] == r[n] and cl[n] == rl[n]:
            n += 1
        rows.append(list(c) + list(r[n:]))
        pos.append(list(range(len(c))) + list(range(n, len(r))))
        c_tg.append(list(cl[1:]) + [IGNORE_INDEX] * (len(r) - n + 1))
        r_tg.append(list(rl[1 : n + 1]) + [IGNORE_INDEX] * (len(c) - n) + list(rl[n + 1 :]) + [IGNORE_INDEX])
        segs.append([0] * n + [1] * (len(c) - n) + [2] * (len(r) - n))
    T = max(len(x) for x in rows)

    def pad(xs: list[list[int]], value: int) -> torch.Tensor:
        return torch.tensor([x + [value] * (T - len(x)) for x in xs], dtype=torch.long)

    seg = pad(segs, -1)  # 0 prefix, 1 chosen, 2 rejected, -1 padding
    return {"input_ids": pad(rows, pad_id), "position_ids": pad(pos, 0), "attention_mask": (seg >= 0).long(),
            "document_ids": seg, "chosen_targets": pad(c_tg, IGNORE_INDEX),
            "rejected_targets": pad(r_tg, IGNORE_INDEX), "num_pairs": len(examples)}


def collate_with_reference(examples: Sequence[dict], pad_id: int, shared_prompt: bool = False,
                           pack_len: int = 0) -> dict[str, Any]:
    """`collate_preference` (or `collate_shared_prompt` with `shared_prompt`, or with `pack_len > 0`
    `collate_packed_pairs` into rows of up to `pack_len` tokens), plus `ref_chosen_logps` /
    `ref_rejected_logps` (P,) when the examples carry precomputed reference log-probs (see
    `precompute_reference`)."""
    if shared_prompt and pack_len:
        raise ValueError("collate_with_reference: shared_prompt and packing do not combine")
    if pack_len:
        batch = collate_packed_pairs(examples, pad_id, pack_len)
    else:
        batch = (collate_shared_prompt if shared_prompt else collate_preference)(examples, pad_id)
    return attach_precomputed(batch, examples, {"ref_chosen_logp": "ref_chosen_logps",
                                                "ref_rejected_logp": "ref_rejected_logps"}, "collate_with_reference")
