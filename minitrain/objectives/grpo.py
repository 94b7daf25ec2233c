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

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from minitrain.parallel import distributed
from minitrain.errors import UserError
from minitrain.objectives.agent import Agent, agent_rollout, completion_messages
from minitrain.objectives.configs import GRPO_LOSS_TYPES, GRPOConfig
from minitrain.objectives.losses import chunked_token_logprobs, default_chunk
from minitrain.objectives.reference import dropout_off
from minitrain.objectives.rewards import score
from minitrain.objectives.rloo import rloo_advantages, rloo_loss
from minitrain.objectives.sampling import sample
from minitrain.objectives.sft import image_inputs
from minitrain.progress import strict_json

LOSS_TYPES = GRPO_LOSS_TYPES
STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)


# ----------------------------------------------------------------------------- advantages


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased standard deviation ignoring NaNs (TRL's `nanstd`)."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    var = torch.nanmean((x - mean) ** 2, dim=dim)
    n = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    return (var * n / (n - 1)).sqrt()


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str, counted: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages (N,), rewards (N,), std_is_zero (N,)) from rewards_per_func (N, F): NaN where a
    function does not apply to a completion; rows in groups of `num_generations` consecutive ones.

    TRL's "sum_then_normalize": the weighted sum ignoring NaNs (a completion no function scored
    is NaN: left out of its group's mean and std, advantage 0); minus the group mean; divided by
    the group's std (`group`), the whole batch's (`batch`) plus 1e-4, or by nothing (`none`).
    Under torchrun the batch is every rank's rows (TRL gathers them too): with `batch`, every rank
    calls this at the same point (a collective); a rank whose rows are a placeholder (`counted`
    False: the loop's weight-0 batch when a short last batch leaves it no prompt) adds none."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights[None]).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":  # over the global batch: each rank's rewards, gathered
        mine = rewards.tolist() if counted else []
        every = torch.tensor([x for part in distributed.gather_objects(mine) for x in part])
        std = nanstd(every).expand_as(rewards) if every.numel() > 1 else torch.zeros_like(rewards)
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


def shared_prompt_layout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                         group: int, width: int = 0) -> dict[str, Any] | None:
    """One row per group of `group` rows that share their prompt: the prompt's real tokens once, then
    each completion's real tokens, each at the positions that follow the prompt and attending to the
    prompt and to itself only (a causal model gives every token the hidden state it has in its own
    row). Returns `rows` (B, T) indices into [prompt_ids | completion_ids] flattened (N, P + C),
    `position_ids`, the model's `document_ids` (B, T) (0 the prompt, seen by every completion, j + 1
    completion j, -1 padding), and `predicts` (N, C): the flat (B * T) position
    whose hidden state predicts each completion token. None when the rows' prompts differ, or when
    the layout costs more than the padded batch: positions x 7 `width` (the multiply-adds of a
    block's linears per position, over those of one attention entry, for an MLP ~3.5x as wide) plus
    attention entries, B x T against N x (P + C) positions (long completions make one row of G of
    them the dearer layout: its attention grows with the square of G x C)."""
    N, P = prompt_ids.shape
    C = completion_mask.shape[1]
    if group < 2 or N % group:
        return None
    B = N // group
    firsts = prompt_ids[::group].repeat_interleave(group, 0)
    if not (torch.equal(prompt_ids, firsts) and torch.equal(prompt_mask, prompt_mask[::group].repeat_interleave(group, 0))):
        return None
    p_len = prompt_mask[::group].sum(1).tolist()
    c_len = completion_mask.sum(1).tolist()
    T = max(p + sum(c_len[g * group : (g + 1) * group]) for g, p in enumerate(p_len))
    if B * T * (7 * width + T) > N * (P + C) * (7 * width + P + C):
        return None
    rows, pos, seg = [], [], []  # per group: flat indices, positions, segment (0 prompt, j + 1 completion j, -1 pad)
    predicts = [[0] * C for _ in range(N)]
    for g, p in enumerate(p_len):
        first = g * group  # the group's first row: its prompt tokens are the last p of its P slots
        r, q, sg = list(range(first * (P + C) + P - p, first * (P + C) + P)), list(range(p)), [0] * p
        for j in range(group):
            row, n = first + j, int(c_len[first + j])
            # token t of completion j is predicted by the prompt's last position (t = 0), else by token t - 1
            if n:
                predicts[row][:n] = [g * T + p - 1] + [g * T + len(r) + t for t in range(n - 1)]
            r += range(row * (P + C) + P, row * (P + C) + P + n)
            q += range(p, p + n)
            sg += [j + 1] * n
        rows.append(r + [0] * (T - len(r)))
        pos.append(q + [0] * (T - len(q)))
        seg.append(sg + [-1] * (T - len(sg)))
    rows, pos, seg, predicts = (torch.tensor(x, dtype=torch.long) for x in (rows, pos, seg, predicts))
    return {"rows": rows, "position_ids": pos, "document_ids": seg, "predicts": predicts}


def completion_logps(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                     completion_ids: torch.Tensor, completion_mask: torch.Tensor, temperature: float = 1.0,
                     entropy: bool = False, group: int = 1, images: dict[str, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(completion token t | prompt, completion < t) under softmax(logits / temperature): (B, C) fp32,
    0 where completion_mask is 0; and, with `entropy`, each position's entropy (B, C), without a graph.

    prompt_ids (B, P) left-padded, completion_ids (B, C) right-padded. One forward of [prompt;
    completion]; logits only for the completion positions, in chunks (never B x T x V). `group`: rows
    come in groups of that many sharing their prompt (GRPO's G), which then runs once per group
    (`shared_prompt_layout`) where that is the cheaper layout; the values are the same. `images`: the rows'
    images as the model's forward takes them (each row's prompt images, in row order; the padded layout)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    C = completion_ids.shape[1]
    width = getattr(getattr(model, "config", None), "hidden_size", 0) or 0
    layout = None if images else shared_prompt_layout(prompt_ids, prompt_mask, completion_mask, group, width)
    if layout is not None:
        dev = ids.device
        shared = model(ids.reshape(-1)[layout["rows"].to(dev)], position_ids=layout["position_ids"].to(dev),
                       document_ids=layout["document_ids"].to(dev))  # (B, T, D)
        hidden = shared.flatten(0, 1)[layout["predicts"].to(dev)]  # (N, C, D)
    else:
        mask = torch.cat([prompt_mask, completion_mask], dim=1)
        hidden = model(ids, mask, **(images or {}))[:, -C - 1 : -1]  # (B, C, D): position t predicts token t
    head = model.output_projection
    head = head if temperature == 1.0 else _Tempered(head, temperature)
    labels = completion_ids.masked_fill(completion_mask == 0, -100)
    logps = chunked_token_logprobs(hidden, head, labels)
    ent = None
    if entropy:
        with torch.no_grad():
            keep = completion_mask.reshape(-1).nonzero().squeeze(1)  # the completion tokens only
            h = hidden.detach().reshape(-1, hidden.shape[-1]).index_select(0, keep)  # (n, D)
            flat = torch.zeros(completion_mask.numel(), dtype=torch.float32, device=hidden.device)
            chunk = default_chunk(model.output_projection, hidden.device)
            for i in range(0, h.shape[0], chunk):  # (chunk, V) logits at a time
                logp = torch.log_softmax(head(h[i : i + chunk]).float(), dim=-1)
                flat[keep[i : i + chunk]] = -(logp.exp() * logp).sum(-1)
            ent = flat.view(completion_mask.shape)
    return logps, ent


# ----------------------------------------------------------------------------- the loss


def grpo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
              loss_type: str = "dapo", epsilon: float = 0.2, epsilon_high: float | None = None,
              beta: float = 0.0, max_completion_length: int | None = None, bias_correction_kl: bool = True,
              importance_sampling_level: str = "token", delta: float | None = None,
              sapo_temperatures: tuple[float, float] = (1.0, 1.05),
              vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
              ) -> tuple[torch.Tensor, float, dict[str, Any]]:
    """(loss_sum, count, stats) of TRL's GRPO loss on one micro-batch.

    logps (B, C) the policy's completion log-probs (with a graph), advantages (B,), mask (B, C)
    1 on the completion tokens that take loss; old_logps (B, C) the sampling policy's (None:
    `logps` detached, one step per generation); ref_logps (B, C) the reference's (needed when
    beta > 0; `bias_correction_kl`: the KL term times the ratio, TRL's `use_bias_correction_kl`).
    The loss is `loss_sum / count` (count summed over the window by the loop).

    The importance weight is per token, or per sequence (`importance_sampling_level="sequence"`:
    GSPO, the exp of the mean log-ratio over the completion). The policy term by `loss_type`:
    grpo / bnpo / dr_grpo / dapo / luspo clip the weight to [1 - epsilon, 1 + epsilon_high] (`delta`:
    the unclipped side capped too); cispo weighs the log-prob by the weight capped at `epsilon_high`,
    detached; sapo replaces the clip by a sigmoid gate of temperature (`sapo_temperatures`: for
    positive, non-positive advantages); vespo weighs the log-prob by a gamma function of the sequence
    weight (`vespo`: k and lambda for non-negative, negative advantages; detached). The sum over
    tokens is divided as TRL divides each: per completion then per batch (grpo, sapo), per token
    (bnpo, dapo, cispo, vespo), by B x max_completion_length (dr_grpo), per completion's sum (luspo).
    stats: `tokens`, and `means`: metric name -> (sum, units) as TRL averages it (`kl`, the clip
    ratios, `cispo_clip_ratio`, `vespo/phi_seq_mean`)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"grpo_loss: loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"grpo_loss: importance_sampling_level {importance_sampling_level!r}: token or sequence")
    epsilon_high = epsilon if epsilon_high is None or epsilon_high == 0 else epsilon_high
    mask = mask.to(logps.dtype)
    B = logps.shape[0]
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old  # (B, C)
    if importance_sampling_level == "sequence":
        log_weight = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]  # (B, 1)
    else:
        log_weight = log_ratio
    ratio = torch.exp(log_weight)  # (B, C) or (B, 1)
    A = advantages[:, None]

    def mean_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # TRL's global_masked_mean, as (sum, units)
        x = x.detach().to(mask.dtype)
        if x.shape[1] == 1:  # one value per sequence
            return x.sum(), torch.tensor(float(B))
        return (x * mask).sum(), mask.sum()

    means: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * A * logps
        means["cispo_clip_ratio"] = mean_of((ratio > epsilon_high) & (A > 0))
    elif loss_type == "sapo":
        t = torch.where(A > 0, sapo_temperatures[0], sapo_temperatures[1])
        per_token = -torch.sigmoid(t * (ratio - 1)) * 4 / t * A
    elif loss_type == "vespo":
        phi = _vespo_weights(A, log_ratio, mask, *vespo)
        per_token = -phi * A * logps
        means["vespo/phi_seq_mean"] = mean_of(phi)
    else:  # grpo, bnpo, dr_grpo, dapo, luspo: the clipped ratio
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
        capped = torch.clamp(ratio, max=delta) if delta is not None else ratio
        per_token = -torch.min(capped * A, clipped * A)
        low = (ratio < 1 - epsilon) & (A < 0)
        high = (ratio > 1 + epsilon_high) & (A > 0)
        means.update({"clip_ratio/low_mean": mean_of(low), "clip_ratio/high_mean": mean_of(high),
                      "clip_ratio/region_mean": mean_of(low | high)})
    if beta:
        if ref_logps is None:
            raise ValueError("grpo_loss: beta > 0 needs ref_logps")
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        if bias_correction_kl:  # TRL's default: x ratio, the unbiased reverse-KL gradient (DeepSeek-V3.2)
            kl = kl * ratio
        per_token = per_token + beta * kl
        means["kl"] = mean_of(kl)
    masked = per_token * mask  # (a per-sequence term counts once per completion token, as in TRL)
    if loss_type in ("grpo", "sapo"):
        loss_sum, count = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), float(B)
    elif loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("grpo_loss: dr_grpo needs max_completion_length")
        loss_sum, count = masked.sum(), float(B * max_completion_length)
    elif loss_type == "luspo":
        loss_sum, count = masked.sum(), float(B)
    else:  # bnpo, dapo, cispo, vespo: per completion token
        loss_sum, count = masked.sum(), float(mask.sum())
    return loss_sum, count, {"tokens": mask.sum(), "means": means}


@torch.no_grad()
def _vespo_weights(A: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, k_pos: float, lambda_pos: float,
                   k_neg: float, lambda_neg: float) -> torch.Tensor:
    """VESPO's gamma weight of each sequence (B, 1), phi(w) = e^lambda w^k e^(-lambda w) with w the
    sequence's importance ratio (the sum of its clamped token log-ratios), in log space as TRL
    computes it; a gradient scale only."""
    floor = math.log(1e-8)
    log_w = torch.clamp((torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True), floor, 20.0)
    nonneg = A >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def loss_settings(cfg: Any) -> dict[str, Any]:
    """`grpo_loss`'s keyword arguments from a run's config (TRL's GRPOConfig names)."""
    return dict(loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
                max_completion_length=cfg.max_completion_length, bias_correction_kl=cfg.use_bias_correction_kl,
                importance_sampling_level=cfg.importance_sampling_level, delta=cfg.delta,
                sapo_temperatures=(cfg.sapo_temperature_pos, cfg.sapo_temperature_neg),
                vespo=(cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg))


# ----------------------------------------------------------------------------- the objective


def collate_prompts(examples: list[dict], pad_id: int) -> dict[str, Any]:
    """`read_prompts` examples -> left-padded `prompt_ids` / `prompt_attention_mask` (B, P) and, as
    lists, each row's `prompts`, `columns` (column name -> values; None where a row lacks it) and `rows`."""
    P = max(len(ex["prompt_ids"]) for ex in examples)
    ids = torch.full((len(examples), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), P), dtype=torch.long)
    for i, ex in enumerate(examples):
        n = len(ex["prompt_ids"])
        ids[i, P - n :] = torch.tensor(ex["prompt_ids"], dtype=torch.long)
        mask[i, P - n :] = 1
    names = list(dict.fromkeys(k for ex in examples for k in ex["columns"]))
    return {"prompt_ids": ids, "prompt_attention_mask": mask, "prompts": [ex["prompt"] for ex in examples],
            "columns": {k: [ex["columns"].get(k) for ex in examples] for k in names},
            "rows": [ex["row"] for ex in examples]}


ZERO_STD_WARN_AFTER = 10  # rollouts in a row whose every group had equal rewards before the warning


class GRPOObjective:
    """`(model, prompt batch) -> (loss_sum, count, metrics)`: sample G completions per prompt with the
    adapters on (`sampling.sample`), score them (`rewards.score`), then TRL's GRPO loss on them.

    new_cache: the family's KV cache class (`models.family(model).KVCache`); eos_ids: the ids that end
    a completion (eos, end-of-turn); reference: `minitrain.objectives.reference`'s, run only when
    beta > 0; out: the run's folder, for `completions.jsonl`; agent: the tools and environment the
    completions may call (`minitrain.objectives.agent`; None: plain completions).

    With `num_iterations` = k > 1 the rollout of the window's j-th micro-batch is kept, with the
    log-probs of the policy that sampled it (`old_logps`), and reused by the j-th micro-batch of the
    next k - 1 optimizer steps (TRL's reuse); the prompts the loop hands those steps are not used.
    Call `start_at(step)` when resuming, so that the cycle and the logs continue from the checkpoint's
    step (a resume inside a cycle samples afresh: save_every a multiple of k resumes exactly).
    """

    token_level = False

    def __init__(self, cfg: GRPOConfig, rewards: list, tok: Any, new_cache: Any, eos_ids: list[int],
                 reference: Any = None, out: Any = None, log: Any = print, agent: Agent | None = None):
        self.cfg, self.rewards, self.tok, self.new_cache, self.agent = cfg, rewards, tok, new_cache, agent
        self.eos_ids, self.reference, self.out, self.log = list(eos_ids), reference, out, log
        weights = list(cfg.reward_weights) or [1.0] * len(rewards)
        if agent is not None and agent.environments is not None and agent.environments.has_reward \
                and len(weights) == len(rewards) - 1:  # the environment's reward weighs 1 (TRL), after the user's
            weights.append(1.0)
        if len(weights) != len(rewards):
            raise UserError(f"reward_weights: {len(weights)} weights for {len(rewards)} reward functions "
                            f"({', '.join(n for n, _ in rewards)}) — give one weight per function")
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.calls, self.kept, self.zero_std_run, self.warned = 0, {}, 0, False

    def start_at(self, step: int) -> None:
        self.calls = step * self.cfg.grad_accum

    # -- the rollout: no graph
    @torch.no_grad()
    def rollout(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        cfg, G = self.cfg, self.cfg.num_generations
        prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_attention_mask"]
        tool_mask, extra = None, {}
        if self.agent is not None:  # tools / an environment: rounds of calls, the tool turns masked from the loss
            ar = agent_rollout(model, batch, G, self.agent, tok=self.tok, new_cache=self.new_cache,
                               max_new_tokens=cfg.max_completion_length, eos_ids=self.eos_ids,
                               temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
            comp, tool_mask = ar.completions, ar.tool_mask
            prompt_rows, prompt_row_mask = ar.prompt_ids, ar.prompt_mask
            extra = {"tools/call_frequency": ar.calls / comp.ids.shape[0],
                     "tools/failure_frequency": ar.failures / ar.calls if ar.calls else 0.0}
        else:
            comp = sample(model, prompt_ids, prompt_mask, new_cache=self.new_cache, num_generations=G,
                          max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                          top_k=cfg.top_k, top_p=cfg.top_p, eos_ids=self.eos_ids, pad_id=self.tok.pad_id,
                          images=image_inputs(batch))
            prompt_rows, prompt_row_mask = prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
        lengths = comp.mask.sum(1).tolist()
        ids = [row[:n] for row, n in zip(comp.ids.tolist(), lengths)]
        prompts = [p for p in batch["prompts"] for _ in range(G)]
        texts = [self.tok.decode(i) for i in ids]
        if self.agent is not None:
            masks = [row[:n] for row, n in zip(tool_mask.tolist(), lengths)]
            completions = [completion_messages(self.tok, i, m, msgs) for i, m, msgs in zip(ids, masks, ar.messages)]
        else:
            completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                           for p, t in zip(prompts, texts)]
        columns = {k: [v for v in vs for _ in range(G)] for k, vs in batch["columns"].items()}
        if self.agent is not None and ar.instances is not None:
            columns["environments"] = ar.instances  # TRL hands reward functions the rollouts' instances
        rows = [r for r in batch["rows"] for _ in range(G)]
        per_func = score(self.rewards, prompts, completions, ids, columns, rows)  # (N, F)
        rloo = cfg.loss_type == "rloo"
        if not rloo:
            advantages, rewards, zero_std = group_advantages(per_func, self.weights, G, cfg.scale_rewards,
                                                             counted=not batch.get("placeholder", False))
        mask = comp.mask
        if cfg.mask_truncated_completions:
            mask = mask * (~comp.truncated)[:, None].long()
        device = prompt_ids.device
        # the tokens that take loss: the model's own (TRL's completion_mask * tool_mask); the tool turns are context
        loss_mask = mask if tool_mask is None else mask * tool_mask
        r = {"prompt_ids": prompt_rows, "prompt_mask": prompt_row_mask, "completion_ids": comp.ids,
             "completion_mask": mask.to(device), "loss_mask": loss_mask.to(device), "old_logps": None,
             "ref_logps": None, "images": image_inputs(batch, "group_")}  # each prompt's images in its G rows
        if cfg.num_iterations > 1 or (rloo and cfg.beta):  # the sampling policy's log-probs (RLOO's KL is against them)
            with dropout_off(model):
                r["old_logps"] = self._logps(model, r)[0]
        if cfg.beta:
            with dropout_off(model), self.reference.applied(model):
                r["ref_logps"] = self._logps(model, r)[0]
        if rloo:  # the KL penalty in the reward, then the leave-one-out baseline (minitrain.objectives.rloo)
            kl = None
            if cfg.beta:
                per_token = (r["old_logps"] - r["ref_logps"]) * r["completion_mask"]
                kl = per_token.sum(-1).cpu()
                extra["kl"] = float(per_token.sum()) / max(float(r["completion_mask"].sum()), 1.0)
            advantages, _, zero_std = rloo_advantages(per_func, self.weights, G, kl=kl, beta=cfg.beta,
                                                      normalize=cfg.normalize_advantages,
                                                      counted=not batch.get("placeholder", False))
            rewards = (per_func * self.weights[None]).nansum(dim=1)  # logged without the penalty, as TRL
            rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
        r["advantages"] = advantages.to(device)
        valid = ~torch.isnan(rewards)
        r["metrics"] = {
            **extra,
            "reward": float(rewards[valid].mean()) if valid.any() else float("nan"),
            "reward_std": float(nanstd(rewards)) if valid.sum() > 1 else 0.0,
            **{f"rewards/{name}/mean": float(torch.nanmean(per_func[:, j]))
               for j, (name, _) in enumerate(self.rewards)},
            "frac_reward_zero_std": float(zero_std.float().mean()),
            # the model's tokens only (TRL leaves the tool turns out)
            "completions/mean_length": float(comp.mask.sum() if tool_mask is None else (comp.mask * tool_mask).sum())
                                       / len(lengths),
            "completions/clipped_ratio": float(comp.truncated.float().mean()),
        }
        r["sample"] = [{"prompt": p, "completion": t, "reward": None if math.isnan(float(x)) else float(x),
                        "advantage": float(a), "row": w}
                       for p, t, x, a, w in zip(prompts, texts, rewards, advantages, rows)]
        return r

    def _logps(self, model: nn.Module, r: dict[str, Any], entropy: bool = False):
        return completion_logps(model, r["prompt_ids"], r["prompt_mask"], r["completion_ids"], r["completion_mask"],
                                self.cfg.temperature, entropy, group=self.cfg.num_generations, images=r.get("images"))

    # -- the loss on a rollout: the graph
    def loss(self, model: nn.Module, r: dict[str, Any]) -> tuple[torch.Tensor, float, dict[str, float]]:
        cfg = self.cfg
        logps, ent = self._logps(model, r, entropy=True)
        if cfg.loss_type == "rloo":  # the KL is in the advantages already
            loss_sum, count, st = rloo_loss(logps, r["advantages"], r["loss_mask"], old_logps=r["old_logps"],
                                            epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high)
        else:
            loss_sum, count, st = grpo_loss(logps, r["advantages"], r["loss_mask"], **loss_settings(cfg),
                                            old_logps=r["old_logps"], ref_logps=r["ref_logps"])
        tokens = max(float(st["tokens"]), 1.0)
        metrics = {**r["metrics"], "entropy": float((ent * r["loss_mask"]).sum()) / tokens,
                   **{k: float(a) / max(float(n), 1.0) for k, (a, n) in st["means"].items()}}
        return loss_sum, count, metrics

    def __call__(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, float, dict[str, float]]:
        cfg = self.cfg
        k, self.calls = self.calls, self.calls + 1
        pos, step = k % cfg.grad_accum, k // cfg.grad_accum + 1
        if (step - 1) % cfg.num_iterations == 0 or pos not in self.kept:
            r = self.rollout(model, batch)
            self.kept = {**(self.kept if pos else {}), pos: r} if cfg.num_iterations > 1 else {}
            self._watch(r, step, first=pos == 0)
        else:
            r = self.kept[pos]
        return self.loss(model, r)

    def _watch(self, r: dict[str, Any], step: int, first: bool) -> None:
        """The zero-advantage warning (once) and the sample in completions.jsonl."""
        if r["metrics"]["frac_reward_zero_std"] == 1.0:
            self.zero_std_run += 1
            if self.zero_std_run == ZERO_STD_WARN_AFTER and not self.warned:
                self.warned = True
                self.log(f"warning: step {step}: the last {ZERO_STD_WARN_AFTER} rollouts gave every completion of each "
                         f"group the same reward, so every advantage is 0 and nothing is learned — give partial "
                         f"credit in the reward, raise num_generations or temperature, or use easier prompts")
        else:
            self.zero_std_run = 0
        every = self.cfg.log_completions_every
        if self.out is not None and every and first and step % every == 0:
            def write() -> None:
                with open(self.out / "completions.jsonl", "a") as f:
                    for s in r["sample"][: 2 * self.cfg.num_generations]:
                        f.write(strict_json({"step": step, **s}, default=str) + "\n")
            distributed.main_only(write)

    def audit_objective(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, float, dict]:
        """What the gradient-path audit runs: a rollout of the batch with advantages +1, -1, ... instead
        of its rewards' (which may all be equal, and 0 advantages would zero every gradient), through the
        same loss. Counts nothing and writes nothing."""
        r = self.rollout(model, batch)
        n = r["advantages"].shape[0]
        r["advantages"] = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(n)],
                                       device=r["advantages"].device)
        if r["loss_mask"].sum() == 0:  # every completion masked (truncated): score them anyway
            r["completion_mask"] = torch.ones_like(r["completion_mask"])
            r["loss_mask"] = r["completion_mask"]
        return self.loss(model, r)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: list[dict], collate: Any, batch_size: int,
                 amp_dtype: torch.dtype | None = None) -> dict[str, float]:
        """The held-out reward: one greedy completion per prompt (the policy's most likely answer), scored
        by the reward functions; `eval/reward` is the mean of the weighted sums (completions no function
        scores left out). Every rank computes the same figure over every example."""
        device = next(model.parameters()).device
        totals: list[float] = []
        for i in range(0, len(examples), batch_size):
            batch = collate(list(examples[i : i + batch_size]))
            ids, mask = batch["prompt_ids"].to(device), batch["prompt_attention_mask"].to(device)
            columns = dict(batch["columns"])
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                if self.agent is not None:
                    ar = agent_rollout(model, {**batch, "prompt_ids": ids, "prompt_attention_mask": mask}, 1,
                                       self.agent, tok=self.tok, new_cache=self.new_cache, greedy=True,
                                       max_new_tokens=self.cfg.max_completion_length, eos_ids=self.eos_ids)
                    comp = ar.completions
                    if ar.instances is not None:
                        columns["environments"] = ar.instances
                else:
                    comp = sample(model, ids, mask, new_cache=self.new_cache, greedy=True, eos_ids=self.eos_ids,
                                  max_new_tokens=self.cfg.max_completion_length, pad_id=self.tok.pad_id,
                                  images={k: v.to(device) for k, v in image_inputs(batch).items()})
            lengths = comp.mask.sum(1).tolist()
            cids = [row[:n] for row, n in zip(comp.ids.tolist(), lengths)]
            if self.agent is not None:
                masks = [row[:n] for row, n in zip(ar.tool_mask.tolist(), lengths)]
                completions = [completion_messages(self.tok, c, m, msgs)
                               for c, m, msgs in zip(cids, masks, ar.messages)]
            else:
                completions = [[{"role": "assistant", "content": self.tok.decode(c)}] if isinstance(p, list)
                               else self.tok.decode(c) for p, c in zip(batch["prompts"], cids)]
            per_func = score(self.rewards, batch["prompts"], completions, cids, columns, batch["rows"])
            unscored = torch.isnan(per_func).all(1)
            summed = (per_func * self.weights[None]).nansum(1)
            totals += summed[~unscored].tolist()
        return {"eval/reward": sum(totals) / len(totals) if totals else float("nan")}
