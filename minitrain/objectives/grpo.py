"""GRPO: group-relative policy optimisation from rewards a program computes (TRL's GRPOTrainer loss).

For each prompt the policy samples G completions (`minitrain.objectives.sampling`), reward functions
score them (`minitrain.objectives.rewards`), and each completion's advantage is its reward less its
group's mean, divided by the group's (or the batch's) standard deviation (`group_advantages`). The
loss is PPO's clipped surrogate per completion token,

    ratio = exp(logp - old_logp)      (old_logp: the policy that sampled; = logp detached when
                                       each generation is used for one step)
    loss_t = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * kl_t
    kl_t = exp(ref - logp) - (ref - logp) - 1          (k3 estimator, against the reference;
                                                        times ratio with use_bias_correction_kl, TRL's default)

summed over completion tokens and normalised as `loss_type` says (`grpo_loss`): TRL's formulas,
term for term (trl 1.16 `GRPOTrainer._compute_loss` and `_generate_and_score_completions`), so that
on the same model, completions and rewards the loss and its gradients equal TRL's
(tests/test_grpo.py).

The unit of the loop's normalisation (docs/design.md rule 2) follows the loss_type: `grpo`
averages each completion's token mean over completions (the unit is the completion), `dapo` and
`bnpo` average over every completion token of the window (the unit is the token), `dr_grpo`
divides by completions x max_completion_length. TRL's `dapo` normalises by the tokens of the whole
generation batch as here; its `bnpo` by each micro-batch's tokens (the same with one micro-batch per
step; minitrain uses the window's, rule 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minitrain.config import TrainConfig, doc
from minitrain.errors import UserError
from minitrain.objectives.losses import chunked_token_logprobs

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)


@dataclass
class GRPOConfig(TrainConfig):
    """A GRPO run: `TrainConfig` plus generation and loss keys (names and defaults as TRL's GRPOConfig).

    `batch_size` counts prompts per micro-batch; each gets `num_generations` completions."""

    rewards: str = doc("", "reward functions: path/to/file.py:fn[,fn2...] (TRL's signature fn(prompts, "
                           "completions, **columns) -> list of float | None); empty: the recipe's own")
    reward_weights: list[float] = doc([], "one weight per reward function (empty: all 1)")
    num_generations: int = doc(8, "completions sampled per prompt (the group)", ge=2)
    max_completion_length: int = doc(256, "new tokens per completion at most", ge=1)
    temperature: float = doc(1.0, "sampling temperature (the log-probs are of logits / temperature, as TRL)", gt=0)
    top_p: float = doc(1.0, "nucleus sampling: keep the smallest set of tokens of probability >= top_p", gt=0, le=1)
    top_k: int = doc(0, "sample among the k most likely tokens only (0: all)", ge=0)
    loss_type: str = doc("dapo", "how token losses are averaged (TRL's loss_type)", choices=LOSS_TYPES)
    scale_rewards: str = doc("group", "advantages divided by the group's std, the batch's, or not at all",
                             choices=SCALE_REWARDS)
    epsilon: float = doc(0.2, "lower clip of the ratio: 1 - epsilon", gt=0, lt=1)
    epsilon_high: float = doc(0.0, "upper clip of the ratio: 1 + epsilon_high (0: epsilon)", ge=0)
    beta: float = doc(0.0, "weight of the KL term against the reference (0: no reference is run)", ge=0)
    use_bias_correction_kl: bool = doc(True, "multiply the KL term by the ratio (TRL's default: an unbiased "
                                             "reverse-KL gradient)")
    num_iterations: int = doc(1, "optimizer steps on each generation (old log-probs kept from the first)", ge=1)
    mask_truncated_completions: bool = doc(False, "completions cut at max_completion_length take no loss")
    log_completions_every: int = doc(10, "write a sample of prompts, completions and rewards to "
                                         "out/completions.jsonl every this many steps (0: never)", ge=0)

    def check(self) -> None:
        super().check()
        if self.beta and self.finetune == "full":
            raise UserError(f"beta={self.beta}: the reference is the model with its adapter switched off, which "
                            f"finetune=full has none of — use finetune=lora, or beta=0")


# ----------------------------------------------------------------------------- advantages


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased standard deviation ignoring NaNs (TRL's `nanstd`)."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    var = torch.nanmean((x - mean) ** 2, dim=dim)
    n = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    return (var * n / (n - 1)).sqrt()


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages (N,), rewards (N,), std_is_zero (N,)) from rewards_per_func (N, F): NaN where a
    function does not apply to a completion; rows in groups of `num_generations` consecutive ones.

    TRL's "sum_then_normalize": the weighted sum ignoring NaNs (a completion no function scored
    is NaN: left out of its group's mean and std, advantage 0); minus the group mean; divided by
    the group's std (`group`), the whole batch's (`batch`) plus 1e-4, or by nothing (`none`)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights[None]).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), rewards, zero_std


# ----------------------------------------------------------------------------- log-probs


class _Tempered(nn.Module):
    """The output projection divided by a temperature (TRL scores logits / temperature)."""

    def __init__(self, head: nn.Module, temperature: float):
        super().__init__()
        self.head, self.temperature = head, temperature

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h) / self.temperature


def completion_logps(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                     completion_ids: torch.Tensor, completion_mask: torch.Tensor, temperature: float = 1.0,
                     entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(completion token t | prompt, completion < t) under softmax(logits / temperature): (B, C) fp32,
    0 where completion_mask is 0; and, with `entropy`, each position's entropy (B, C), without a graph.

    prompt_ids (B, P) left-padded, completion_ids (B, C) right-padded. One forward of [prompt;
    completion]; logits only for the completion positions, in chunks (never B x T x V)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    C = completion_ids.shape[1]
    hidden = model(ids, mask)[:, -C - 1 : -1]  # (B, C, D): position t predicts completion token t
    head = model.output_projection
    head = head if temperature == 1.0 else _Tempered(head, temperature)
    labels = completion_ids.masked_fill(completion_mask == 0, -100)
    logps = chunked_token_logprobs(hidden, head, labels)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = torch.zeros_like(logps)
            h = hidden.detach()
            for b in range(h.shape[0]):  # one row of logits (C, V) at a time
                logp = torch.log_softmax(head(h[b]).float(), dim=-1)
                ent[b] = -(logp.exp() * logp).sum(-1)
            ent = ent * completion_mask
    return logps, ent


# ----------------------------------------------------------------------------- the loss


def grpo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
              loss_type: str = "dapo", epsilon: float = 0.2, epsilon_high: float | None = None,
              beta: float = 0.0, max_completion_length: int | None = None, bias_correction_kl: bool = True
              ) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """(loss_sum, count, stats) of TRL's GRPO loss on one micro-batch.

    logps (B, C) the policy's completion log-probs (with a graph), advantages (B,), mask (B, C)
    1 on the completion tokens that take loss; old_logps (B, C) the sampling policy's (None:
    `logps` detached, one step per generation); ref_logps (B, C) the reference's (needed when
    beta > 0; `bias_correction_kl`: the KL term times the ratio, TRL's `use_bias_correction_kl`). The loss is `loss_sum / count` (count summed over the window by the loop).
    stats: sums over tokens for the metrics (`kl_sum`, `low_clipped`, ...) and `tokens`."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"grpo_loss: loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    epsilon_high = epsilon if epsilon_high is None or epsilon_high == 0 else epsilon_high
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)  # (B, C)
    A = advantages[:, None]
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token = -torch.min(ratio * A, clipped * A)
    stats: dict[str, torch.Tensor] = {}
    if beta:
        if ref_logps is None:
            raise ValueError("grpo_loss: beta > 0 needs ref_logps")
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        if bias_correction_kl:  # TRL's default: x ratio, the unbiased reverse-KL gradient (DeepSeek-V3.2)
            kl = kl * ratio
        per_token = per_token + beta * kl
        stats["kl_sum"] = (kl.detach() * mask).sum()
    B = logps.shape[0]
    if loss_type == "grpo":
        loss_sum = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
        count = float(B)
    elif loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("grpo_loss: dr_grpo needs max_completion_length")
        loss_sum = (per_token * mask).sum()
        count = float(B * max_completion_length)
    else:  # bnpo, dapo: per completion token
        loss_sum = (per_token * mask).sum()
        count = float(mask.sum())
    r = ratio.detach()
    low = ((r < 1 - epsilon) & (A < 0)).to(mask.dtype) * mask
    high = ((r > 1 + epsilon_high) & (A > 0)).to(mask.dtype) * mask
    stats.update(tokens=mask.sum(), low_clipped=low.sum(), high_clipped=high.sum())
    return loss_sum, count, stats
