"""RLOO: REINFORCE with a leave-one-out baseline (TRL's RLOOTrainer loss), on GRPO's rollout.

Each completion's advantage is its reward less the mean reward of the other completions of its
group (`rloo_advantages`); a KL penalty against the reference enters the reward, not the loss:
beta x the sum over the completion's tokens of (old_logp - ref_logp), the first-order estimate of
Ahmadian et al. (2024). The loss is PPO's clipped surrogate on the whole sequence,

    ratio = exp(sum_t logp - sum_t old_logp)     (old_logp: the sampling policy's)
    loss  = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)

averaged over completions (the unit of the loop's normalisation, rule 2, is the completion):
TRL 1.16's `RLOOTrainer._compute_loss` and the advantage lines of its
`_generate_and_score_completions`, term for term (tests/test_rloo.py). `GRPOObjective` runs it
with `loss_type=rloo`.
"""

from __future__ import annotations

from typing import Any

import torch

from minitrain.parallel import distributed

STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)


def rloo_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int, *,
                    kl: torch.Tensor | None = None, beta: float = 0.0, normalize: bool = False,
                    counted: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages (N,), rewards (N,), std_is_zero (N,)) from rewards_per_func (N, F): NaN where a
    function does not apply; rows in groups of `num_generations` consecutive ones.

    The reward is the weighted sum ignoring NaNs (NaN where no function scored the completion), less
    beta x `kl` (N,: each completion's summed old - ref log-prob) when beta > 0. The baseline of a
    completion is the mean reward of its group's other scored completions; a completion with no
    scored sibling, or unscored itself, gets advantage 0. `normalize`: the advantages of the scored
    completions less their mean, over their std + 1e-4, over the whole batch (every rank's under
    torchrun, gathered: every rank calls this at the same point; a placeholder rank, `counted`
    False, adds none). std_is_zero: the group's rewards are all equal (a metric)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights[None]).nansum(dim=1)
    rewards[unscorable] = torch.nan
    if beta:
        rewards = rewards - beta * kl.to(rewards)
    grouped = rewards.view(-1, num_generations)  # (prompts, G)
    scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scored - 1)  # 0 / 0 = NaN: alone
    advantages = rewards - baselines.view(-1)
    if normalize:
        mine = advantages[~torch.isnan(advantages)].tolist() if counted else []
        every = torch.tensor([x for part in distributed.gather_objects(mine) for x in part], dtype=advantages.dtype)
        mean = every.mean() if every.numel() else torch.tensor(float("nan"))
        std = every.std() if every.numel() > 1 else torch.tensor(float("nan"))
        advantages = (advantages - mean) / (std + STD_EPS)
    mean_g = torch.nanmean(grouped, dim=1, keepdim=True)
    std_g = ((torch.nanmean((grouped - mean_g) ** 2, dim=1) * scored[:, 0] / (scored[:, 0] - 1)).sqrt())
    zero_std = torch.isclose(std_g, torch.zeros_like(std_g)).repeat_interleave(num_generations)
    return torch.nan_to_num(advantages, nan=0.0), rewards, zero_std


def rloo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              old_logps: torch.Tensor | None = None, epsilon: float = 0.2,
              epsilon_high: float | None = None) -> tuple[torch.Tensor, float, dict[str, Any]]:
    """(loss_sum, count, stats) of TRL's RLOO loss on one micro-batch; the loss is loss_sum / count.

    logps (B, C) the policy's completion log-probs (with a graph), advantages (B,), mask (B, C) 1 on
    the completion tokens; old_logps (B, C) the sampling policy's (None: `logps` detached, one step
    per generation). The sequence's log-prob is the masked sum of its tokens'. epsilon_high None or
    0: epsilon. stats: `tokens`, and `means`: the clip ratios as (sum, completions)."""
    epsilon_high = epsilon if not epsilon_high else epsilon_high
    mask = mask.to(logps.dtype)
    B = logps.shape[0]
    seq = (logps * mask).sum(-1)  # (B,)
    old = seq.detach() if old_logps is None else (old_logps.to(logps.dtype) * mask).sum(-1)
    ratio = torch.exp(seq - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_seq = -torch.min(ratio * advantages, clipped * advantages)
    low = (ratio < 1 - epsilon) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    n = torch.tensor(float(B))
    means = {"clip_ratio/low_mean": (low.float().sum(), n), "clip_ratio/high_mean": (high.float().sum(), n),
             "clip_ratio/region_mean": ((low | high).float().sum(), n)}
    return per_seq.sum(), float(B), {"tokens": mask.sum(), "means": means}
