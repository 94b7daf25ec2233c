"""ARD-LoRA's training: the ELBO objective, the held-out uncertainty evaluation, the prior's schedule.

The adapter itself (gated rank components, their KL, the ARD update) is `minitrain.adapters.ard`,
whose docstring gives the model (field report 000).

The ELBO and its unit. Summed over a dataset of N target tokens, -ELBO = sum_t NLL_t + KL. The
objective (`ARDObjective`) adds `beta * KL * n_batch / N` to each batch's loss sum of n_batch
target tokens, so over one epoch the KL is counted exactly `beta` times, and after the loop's
division by the token count the per-token loss is `mean NLL + beta * KL / N` (beta = 1: the ELBO).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from minitrain import checkpoint
from minitrain.parallel import distributed
from minitrain.adapters.ard import ard_kl, gates, load_prior_state, prior_state, relevance, update_prior
from minitrain.data.collate import IGNORE_INDEX
from minitrain.errors import UserError
from minitrain.objectives.losses import default_chunk, shift_labels
from minitrain.objectives.sft import sft
from minitrain.progress import strict_json


# ----------------------------------------------------------------------------- the objective


class ARDObjective:
    """`(model, batch) -> (NLL sum + beta * KL * n / N, n target tokens, metrics)` (see the module doc).

    `base` is the token objective (default: causal SFT). Metrics: `nll` (mean token NLL), `kl`
    (the total KL, nats), `kl_per_token` (beta * KL / N: what the KL adds to the per-token loss).
    Eval mode (`model.training` False): the base objective alone under the posterior-mean gates,
    so the loop's `eval/loss` is the held-out NLL and `eval/ppl` its perplexity.
    """

    def __init__(self, dataset_tokens: int, beta: float = 1.0, base: Callable | None = None):
        if dataset_tokens < 1:
            raise UserError(f"ARDObjective: dataset_tokens={dataset_tokens} — the training set has no target tokens")
        if beta < 0:
            raise UserError(f"beta={beta}: the KL weight must be >= 0 — e.g. beta=1.0 (the ELBO)")
        self.dataset_tokens, self.beta, self.base = int(dataset_tokens), float(beta), base or sft

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any, dict[str, float]]:
        nll_sum, count, metrics = self.base(model, batch)
        if not model.training:
            return nll_sum, count, metrics
        kl = ard_kl(model)
        loss_sum = nll_sum + (self.beta * kl) * (count / self.dataset_tokens)
        n = torch.as_tensor(count).clamp(min=1).float()
        nll, kl_v = torch.stack([nll_sum.detach().float() / n, kl.detach()]).tolist()
        return loss_sum, count, {**metrics, "nll": nll, "kl": kl_v,
                                 "kl_per_token": self.beta * kl_v / self.dataset_tokens}


def dataset_target_tokens(examples: Sequence[dict]) -> int:
    """Target tokens of causal examples: labels after the first that are not -100 (what `sft` counts);
    a token store counts them in its arrays."""
    counts = getattr(examples, "target_counts", None)
    if counts is not None:
        return int(counts().sum())
    return sum(sum(1 for y in ex["labels"][1:] if y != IGNORE_INDEX) for ex in examples)


# ----------------------------------------------------------------------------- uncertainty


def calibration_bins(confidence: torch.Tensor, correct: torch.Tensor, bins: int) -> torch.Tensor:
    """(bins, 3) sums of [count, confidence, correct] per equal-width confidence bin.

    Bin m holds confidences in ((m-1)/M, m/M] (Guo, Pleiss, Sun & Weinberger 2017, "On Calibration of
    Modern Neural Networks"); a confidence of exactly 0 goes to the first bin.
    """
    idx = (confidence * bins).ceil().long().sub(1).clamp(0, bins - 1)
    out = torch.zeros(bins, 3, dtype=torch.float64, device=confidence.device)
    vals = torch.stack([torch.ones_like(confidence), confidence, correct.to(confidence.dtype)], 1).double()
    return out.index_add_(0, idx, vals)


def ece_from_bins(sums: torch.Tensor) -> float:
    """Expected calibration error sum_m (|B_m| / n) |acc(B_m) - conf(B_m)| from `calibration_bins` sums."""
    n = sums[:, 0].sum().item()
    return (sums[:, 2] - sums[:, 1]).abs().sum().item() / n if n else float("nan")


@torch.no_grad()
def uncertainty_eval(model: nn.Module, examples: Sequence[dict], collate: Callable, batch_size: int, *,
                     bins: int = 15, samples: int = 0, max_batches: int = 0, chunk: int | None = None) -> dict[str, float]:
    """Token accuracy, mean NLL and expected calibration error of the next-token predictions.

    samples = 0: the posterior-mean model (eval mode). samples = S > 0: the Monte-Carlo predictive
    `mean_s softmax(logits_s)` over S gate draws (the prediction Bayesian model averaging makes).
    Targets are the causal labels (shifted, -100 skipped); logits are made in chunks of target
    positions. `max_batches` > 0 looks at that many batches only. Returns `acc`, `nll`, `ece`, `tokens`.
    """
    if bins < 1:
        raise UserError(f"ece_bins={bins}: needs at least 1 bin — e.g. ece_bins=15")
    was = model.training
    model.eval()
    layers = [g for _, g in gates(model)]
    device = next(model.parameters()).device
    sums = torch.zeros(bins, 3, dtype=torch.float64, device=device)
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    head = model.output_projection
    chunk = chunk or default_chunk(head, device)
    try:
        for g in layers:
            g.sample = samples > 0
        for b, start in enumerate(range(0, len(examples), batch_size)):
            if max_batches and b >= max_batches:
                break
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                     for k, v in collate(list(examples[start:start + batch_size])).items()}
            y = shift_labels(batch["labels"]).reshape(-1)
            keep = (y != IGNORE_INDEX).nonzero().squeeze(1)
            hiddens = [model(batch["input_ids"], batch.get("attention_mask")) for _ in range(max(samples, 1))]
            hiddens = [h.reshape(-1, h.shape[-1]).index_select(0, keep) for h in hiddens]  # (n, D) each
            y = y.index_select(0, keep)
            for s in range(0, y.numel(), chunk):
                logps = torch.stack([torch.log_softmax(head(h[s:s + chunk]).float(), -1) for h in hiddens])  # (S, c, V)
                logp = torch.logsumexp(logps, 0) - math.log(len(hiddens))  # log of the mean probability, (c, V)
                conf, pred = logp.max(-1)  # (c,)
                target = y[s:s + chunk]
                nll_sum -= logp.gather(1, target[:, None]).double().sum()
                sums += calibration_bins(conf.exp(), pred == target, bins)
    finally:
        for g in layers:
            g.sample = None
        model.train(was)
    n = sums[:, 0].sum().item()
    return {"acc": sums[:, 2].sum().item() / max(n, 1), "nll": nll_sum.item() / max(n, 1),
            "ece": ece_from_bins(sums), "tokens": int(n)}


# ----------------------------------------------------------------------------- every N steps


class PriorSchedule:
    """Re-estimate the ARD prior every `every` optimizer steps and evaluate uncertainty on held-out data.

    Call `on_step(model, step)` after each optimizer step (a post-step hook on the optimizer does
    it: `attach(optimizer, model)`). At steps that are multiples of `every` it runs `update_prior`,
    then `uncertainty_eval` on the held-out examples (if any), logs one line and appends a row
    `{"step", "acc", "nll", "ece", "kept_ranks", "alpha"}` to `path` (out/ard.jsonl), whose alpha
    values let a resumed run restore the prior exactly (`restore`).
    """

    def __init__(self, every: int, path: str | Path, *, eval_examples: Sequence[dict] | None = None,
                 collate: Callable | None = None, batch_size: int = 4, bins: int = 15, samples: int = 0,
                 max_batches: int = 0, log: Callable[[str], None] = print):
        self.every, self.path = every, Path(path)
        self.eval_examples, self.collate, self.batch_size = eval_examples, collate, batch_size
        self.bins, self.samples, self.max_batches, self.log = bins, samples, max_batches, log

    def on_step(self, model: nn.Module, step: int) -> dict[str, Any] | None:
        if not self.every or step % self.every:
            return None
        update_prior(model)
        row: dict[str, Any] = {"step": step}
        if self.eval_examples:
            row.update(uncertainty_eval(model, self.eval_examples, self.collate, self.batch_size, bins=self.bins,
                                        samples=self.samples, max_batches=self.max_batches))
        kept = relevance(model)
        row["kept_ranks"] = sum(kept.values())
        self.log(f"step {step}: ARD prior re-estimated; {row['kept_ranks']} rank components with alpha < 1e3"
                 + (f"; held-out acc {row['acc']:.4f} nll {row['nll']:.4f} ece {row['ece']:.4f}" if "acc" in row else ""))
        row["alpha"] = prior_state(model)
        if distributed.rank() == 0:  # (under torchrun every rank re-estimates the same prior)
            with open(self.path, "a") as f:
                f.write(strict_json(row) + "\n")
        return row

    def attach(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        """Run `on_step` after every optimizer step, with the step read from the optimizer's own state
        (AdamW's per-parameter `step`, restored with the checkpoint, so a resumed run counts on)."""
        first = optimizer.param_groups[0]["params"][0]

        def hook(opt, args, kwargs) -> None:
            step = opt.state[first].get("step")
            if step is not None:
                self.on_step(model, int(step))

        optimizer.register_step_post_hook(hook)

    def restore(self, model: nn.Module, step: int) -> None:
        """For a run resumed at `step`: the prior of the last update at or before it; later rows are dropped."""
        keep = checkpoint.truncate_log(self.path, step)
        if keep:
            load_prior_state(model, keep[-1]["alpha"])
