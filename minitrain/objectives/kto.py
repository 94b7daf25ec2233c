"""KTO (Ethayarajh et al. 2024): preference tuning from unpaired thumbs-up / thumbs-down rows.

Rows are `{"prompt", "completion", "label": true|false}` (`minitrain.data.readers.read_unpaired`). The
loss and metric names are TRL's `KTOTrainer` (`trl.experimental.kto`, now `trl.KTOTrainer`):

    r = logp_policy(y|x) - logp_ref(y|x)                     (summed completion log-probs)
    z0 = max(0, mean over the batch's KL rows of [logp_policy(y'|x) - logp_ref(y'|x)])   detached
    desirable:   desirable_weight   * (1 - sigmoid(beta * (r - z0)))
    undesirable: undesirable_weight * (1 - sigmoid(beta * (z0 - r)))

The reference point z0 estimates KL(policy || reference) from MISMATCHED prompt-completion pairs,
as the paper and TRL do: row i's KL row is its prompt followed by the completion of row i - 1
within its block of `batch_size` consecutive rows of the file (the first takes the block's last),
TRL's `add_kl_completion_ids`; `add_kl_rows` makes each KL row when its example is read (`KLRows`), so
a token store (`data_cache=`) stays on disk. TRL samples those blocks in order, so a block is a batch; here the
pairing is fixed when the data is read (so it can be cached with the reference), and a batch's KL
rows come from its rows' blocks — the same estimator of the policy-reference KL. z0 is computed
per micro-batch (TRL: per micro-batch too, averaged over ranks).

The reference is the same model as in DPO (`minitrain.objectives.dpo`): adapters disabled (a fresh adapter),
a frozen copy of the Stage A adapter (`init_adapter=`), or precomputed once (`precompute_ref=true`,
the matched AND the KL rows, cached like DPO's). Per step: one reference forward of the batch's 2B
rows (matched + KL) under no_grad, one policy forward of the KL rows under no_grad, and one policy
forward of the matched rows with a graph (with a cache: the two policy forwards only).

The unit of the loss is the row (docs/design.md rule 2): the objective returns the sum of the weighted row
losses and the number of rows; TRL's loss is the mean over the batch's rows, the same thing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from minitrain.parallel import distributed
from minitrain.data.collate import IGNORE_INDEX, collate_preference
from minitrain.data.images import ImageSpec, SquareSpec, collate_images
from minitrain.data.store import carries
from minitrain.objectives.configs import KTOConfig
from minitrain.objectives.reference import (AdapterSnapshotReference, BaseReference, attach_precomputed, dropout_off,
                                            num_pairs, precompute_reference, reference_logps)
from minitrain.objectives.sft import causal_token_logprobs, image_inputs, router_aux

METRICS = ("kl", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected", "rewards/margins")


# ----------------------------------------------------------------------------- the loss


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, *,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KTO losses (B,) and rewards `beta * (policy - ref)` (B,, detached), as TRL's `KTOTrainer`.

    `desirable` (B,) bool; `kl` the detached, clamped reference point z0 (a scalar).
    """
    logratios = policy_logps - ref_logps  # (B,)
    good = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    return torch.where(desirable, good, bad), beta * logratios.detach()


def kl_reference_point(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor, weight: float = 1.0
                       ) -> torch.Tensor:
    """z0 = max(0, mean(policy - reference) over the KL rows), detached (no gradient flows through it).

    Under torchrun, as TRL (`gather_for_metrics(kl).mean()`): the mean of the ranks' means, clamped
    after averaging, so every rank uses the same z0; a rank scoring a stand-in row passes `weight=0`.
    Every rank must call it the same number of times (the loop and `evaluate_kto` ensure that).
    """
    kl = (policy_kl_logps - ref_kl_logps).mean().detach().float()
    if distributed.world_size() > 1:
        both = torch.stack([kl * weight, torch.tensor(float(weight), device=kl.device)])
        distributed.all_reduce_sum([both])
        kl = both[0] / both[1].clamp(min=1e-12)
    return kl.clamp(min=0)


# ----------------------------------------------------------------------------- the data


def add_kl_rows(examples: Sequence[dict], block: int) -> KLRows:
    """`examples` (a list, or a token store read through its memory map) as KTO reads them: each with
    its KL row, its prompt + the completion of the previous row in its block of `block` consecutive
    rows (the first row takes the block's last), TRL's rotation. See `KLRows`."""
    return KLRows(examples, block)


class KLRows(Sequence):
    """KTO's examples, each read with its KL row: `kl_ids` / `kl_labels` (-100 on the prompt) are made
    when an example is read, from it and its block neighbour, so a token store's rows are never held
    as Python lists. A last short block rotates within itself, and a block of one row pairs it with
    itself (no mismatch: TRL would do the same). Precomputed reference log-probs (`set_values`) are
    held as one array per key, as the store holds DPO's."""

    def __init__(self, examples: Sequence[dict], block: int):
        if block < 1:
            raise ValueError(f"KLRows: block must be >= 1, got {block}")
        self.examples, self.block = examples, block
        self.extra: dict[str, np.ndarray] = {}
        for c in ("path", "truncated", "skipped", "bos_in_text", "identical", "shapes"):
            if hasattr(examples, c):
                setattr(self, c, getattr(examples, c))

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n, i = len(self), int(i)
        i = i + n if i < 0 else i
        if not 0 <= i < n:
            raise IndexError(i)
        start = i - i % self.block
        j = i - 1 if i > start else min(start + self.block, n) - 1  # the block's first row: its last
        ex = dict(self.examples[i])
        other = ex if j == i else self.examples[j]
        p, q = ex["prompt_len"], other["prompt_len"]
        ex["kl_ids"] = list(ex["input_ids"][:p]) + list(other["input_ids"][q:])
        ex["kl_labels"] = [IGNORE_INDEX] * p + list(other["labels"][q:])
        for k, v in self.extra.items():
            ex[k] = float(v[i])
        return ex

    def __iter__(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self[i]

    def carries(self, key: str) -> np.ndarray:
        """Per row, whether it has `key` (`images`; its KL row has the same prompt): a store's from its offsets."""
        return carries(self.examples, key)

    @property
    def batch_lengths(self) -> np.ndarray:
        """`input_ids` lengths (the loop's length grouping; the KL rows do not count, as in memory)."""
        got = getattr(self.examples, "batch_lengths", None)
        return np.asarray(got if got is not None else [len(ex["input_ids"]) for ex in self.examples])

    def column(self, key: str) -> np.ndarray:
        """Every example's `key` (`label`), from a store's array or the examples' dicts."""
        column = getattr(self.examples, "column", None)
        return column(key) if column is not None else np.asarray([ex[key] for ex in self.examples])

    def set_values(self, columns: dict[str, Sequence[float]]) -> None:
        """Give every example a float under each key (the precomputed reference log-probs)."""
        out = {k: np.asarray(v, dtype=np.float64) for k, v in columns.items()}
        if any(v.shape != (len(self),) for v in out.values()):
            raise ValueError(f"KLRows.set_values: every column needs {len(self)} values")
        self.extra.update(out)


def _as_pair(ex: dict) -> dict:
    """The example in `collate_preference`'s shape: "chosen" = the row, "rejected" = its KL row."""
    view = {"chosen_ids": ex["input_ids"], "chosen_labels": ex["labels"], "rejected_ids": ex["kl_ids"],
            "rejected_labels": ex["kl_labels"]}
    if "images" in ex:  # the prompt's images: in the row and in its KL row (the same prompt)
        view["images"], view["where"] = ex["images"], ex["where"]
    if "ref_logp" in ex:
        view["ref_chosen_logp"], view["ref_rejected_logp"] = ex["ref_logp"], ex["ref_kl_logp"]
    return view


class _Pairs(Sequence):
    """KTO examples read as DPO's pairs (`_as_pair`), one at a time: what `precompute_reference` scores."""

    def __init__(self, examples: Sequence[dict]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i):
        got = self.examples[i]
        return [_as_pair(ex) for ex in got] if isinstance(i, slice) else _as_pair(got)

    def __iter__(self) -> Iterator[dict]:
        return (_as_pair(ex) for ex in self.examples)

    def set_values(self, columns: dict[str, Sequence[float]]) -> None:
        chosen, rejected = columns["ref_chosen_logp"], columns["ref_rejected_logp"]
        if hasattr(self.examples, "set_values"):
            self.examples.set_values({"ref_logp": chosen, "ref_kl_logp": rejected})
            return
        for ex, c, r in zip(self.examples, chosen, rejected):  # a plain list of examples with their KL rows
            ex["ref_logp"], ex["ref_kl_logp"] = float(c), float(r)


def collate_kto(examples: Sequence[dict], pad_id: int) -> dict[str, Any]:
    """One batch of 2B rows `[rows; KL rows]` padded together (`num_pairs` = B), `label` (B,) bool,
    and `ref_logps` / `ref_kl_logps` (B,) when the examples carry precomputed reference log-probs."""
    batch = collate_preference([_as_pair(ex) for ex in examples], pad_id)
    batch["label"] = torch.tensor([bool(ex["label"]) for ex in examples])
    return attach_precomputed(batch, examples, {"ref_logp": "ref_logps", "ref_kl_logp": "ref_kl_logps"}, "collate_kto")


def precompute_kto_reference(model: nn.Module, reference: BaseReference | AdapterSnapshotReference,
                             examples: Sequence[dict], cache, pad_id: int, batch_size: int,
                             amp_dtype: torch.dtype | None = None, log: Callable[[str], None] = print,
                             spec: ImageSpec | SquareSpec | None = None) -> bool:
    """`ref_logp` and `ref_kl_logp` for every example (`add_kl_rows`' examples: held as arrays), from
    `cache` when fresh (DPO's cache: the rows and their KL rows are scored as DPO scores a pair's two
    answers, read one batch at a time; `spec`: how a vision-language checkpoint reads the prompts' images).
    Returns True if reused."""
    collate = functools.partial(collate_preference, pad_id=pad_id)
    if spec is not None:
        collate = functools.partial(collate_images, collate=collate, spec=spec, copies=2)
    return precompute_reference(model, reference, _Pairs(examples), cache, collate, batch_size, amp_dtype, log)


# ----------------------------------------------------------------------------- the objective


def _completion_logps(model: nn.Module, input_ids, attention_mask, labels, images: dict | None = None) -> torch.Tensor:
    """Summed completion log-probs (B,) of rows whose `labels` are -100 off the completion (`images`: theirs)."""
    return causal_token_logprobs(model, input_ids, attention_mask, labels, images).sum(1)


class KTOObjective:
    """`(model, batch) -> (loss summed over rows, number of rows, metrics)` for the loop.

    Metrics are TRL's names: `kl` (z0), `rewards/chosen` and `logps/chosen` (means over the
    batch's desirable rows), `rewards/rejected` and `logps/rejected` (undesirable rows),
    `rewards/margins` (their difference); a batch without desirable (or undesirable) rows logs
    none of theirs, as TRL. `evaluate` is the held-out pass (`evaluate_kto`).
    """

    token_level = False

    def __init__(self, beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                 reference: BaseReference | AdapterSnapshotReference | None = None):
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight
        self.reference = reference

    def row_stats(self, model: nn.Module, batch: dict[str, Any], weight: float = 1.0) -> dict[str, torch.Tensor]:
        """`loss` (B,) with graph, `rewards`, `logps` (B,), `label` (B,) bool and `kl` (scalar), detached;
        `weight` is this rank's weight in z0's mean over ranks (0 for a stand-in batch)."""
        B = num_pairs(batch)
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]  # (2B, T)
        # the rows' images: the first of the two identical halves a [rows; KL rows] batch carries (copies=2)
        images = {k: v[: v.shape[0] // 2] for k, v in image_inputs(batch).items()}
        ref, ref_kl = reference_logps(model, batch, self.reference, ("ref_logps", "ref_kl_logps"),
                                      "KTOObjective")  # before the policy graph exists
        with torch.no_grad():
            kl = kl_reference_point(_completion_logps(model, ids[B:], mask[B:], labels[B:], images), ref_kl, weight)
        logps = _completion_logps(model, ids[:B], mask[:B], labels[:B], images)  # (B,) with graph
        desirable = batch["label"].to(logps.device).bool()
        losses, rewards = kto_loss(logps, ref, desirable, kl, beta=self.beta,
                                   desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight)
        return {"loss": losses, "rewards": rewards, "logps": logps.detach(), "label": desirable, "kl": kl}

    def __call__(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, int, dict[str, float]]:
        s = self.row_stats(model, batch)
        # an MoE's load-balancing loss on the policy forward of the completions (the last one), as TRL's
        B = num_pairs(batch)
        loss_sum, count, routing = router_aux(model, {"attention_mask": batch["attention_mask"][:B]}, s["loss"].sum(), B)
        return loss_sum, count, {**metrics_from_sums(*_sums(s)), **routing}

    def evaluate(self, model: nn.Module, examples: Sequence[dict], collate: Callable[[list[dict]], dict[str, Any]],
                 batch_size: int, amp_dtype: torch.dtype | None = None) -> dict[str, float]:
        """`eval/loss` (mean per row) and `eval/<TRL metric>` over `examples` (see `evaluate_kto`)."""
        return evaluate_kto(model, self, examples, collate, batch_size, amp_dtype)


def _sums(s: dict[str, torch.Tensor]) -> tuple[dict[str, float], float]:
    """(per-key sums over desirable / undesirable rows and counts, z0) with one host sync."""
    d, u = s["label"].float(), (~s["label"]).float()
    vals = torch.stack([s["loss"].detach().float().sum(), d.sum(), u.sum(), (s["rewards"] * d).sum(),
                        (s["logps"] * d).sum(), (s["rewards"] * u).sum(), (s["logps"] * u).sum(), s["kl"].float()])
    keys = ("loss", "n_chosen", "n_rejected", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected")
    out = vals.tolist()
    return dict(zip(keys, out[:-1])), out[-1]


def metrics_from_sums(sums: dict[str, float], kl: float) -> dict[str, float]:
    """TRL's KTO metrics from per-row sums: means over the desirable / undesirable rows, and `kl`."""
    m = {"kl": kl}
    for side, n in (("chosen", sums["n_chosen"]), ("rejected", sums["n_rejected"])):
        if n:
            m[f"rewards/{side}"] = sums[f"rewards/{side}"] / n
            m[f"logps/{side}"] = sums[f"logps/{side}"] / n
    if sums["n_chosen"] and sums["n_rejected"]:
        m["rewards/margins"] = m["rewards/chosen"] - m["rewards/rejected"]
    return m


@torch.no_grad()
def evaluate_kto(model: nn.Module, objective: KTOObjective, examples: Sequence[dict],
                 collate: Callable[[list[dict]], dict[str, Any]], batch_size: int,
                 amp_dtype: torch.dtype | None = None, prefix: str = "eval/") -> dict[str, float]:
    """`eval/loss` (mean per row) and TRL's metrics over held-out rows: rewards and log-probs are
    means over all desirable / undesirable rows, `kl` the mean of the batches' z0 (weighted by rows).

    Under torchrun each batch is split across ranks and the sums added over ranks (every rank
    returns the same figures); a rank left without rows scores one at weight 0.
    """
    device = next(model.parameters()).device
    world, rank = distributed.world_size(), distributed.rank()
    keys = ("loss", "n_chosen", "n_rejected", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected",
            "kl", "rows")
    total = torch.zeros(len(keys), device=device)
    with dropout_off(model):
        for i in range(0, len(examples), batch_size):
            mine = list(examples[i : i + batch_size])[rank::world]
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                     for k, v in collate(mine or list(examples[i : i + 1])).items()}
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                s = objective.row_stats(model, batch, weight=1.0 if mine else 0.0)
            sums, kl = _sums(s)
            n = float(len(s["loss"]))
            row = torch.tensor([*(sums[k] for k in keys[:7]), kl * n, n], device=device)
            total += row * (1.0 if mine else 0.0)
    distributed.all_reduce_sum([total])
    t = dict(zip(keys, total.tolist()))
    m = metrics_from_sums(t, t["kl"] / max(t["rows"], 1.0))
    return {prefix + "loss": t["loss"] / max(t["rows"], 1.0), **{prefix + k: v for k, v in m.items()}}
