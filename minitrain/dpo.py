"""Direct Preference Optimization without a second model in memory.

Field report 002: DPO Stage B on Mistral-7B after an SFT LoRA Stage A did not fit 12 GB because
a second 7B model was loaded as the reference, the Stage A adapter got a second LoRA stacked on
it, and checkpointing broke gradients. Here the reference is never a second model:

(a) fresh adapter: the reference is the same model with its adapters switched off
    (`disable_adapters()` under `torch.no_grad()`), i.e. the base model the adapter starts from;
(b) continuing a trained adapter (`init_adapter=DIR`, Stage A -> Stage B): the reference is the
    Stage A policy, kept as a frozen copy of the adapter tensors only (a few MB). For the
    reference forward those tensors are copied in under `no_grad` and the training values copied
    back. The adapter-disabled base would be the wrong reference here, and the Stage A adapter
    keeps training itself: nothing is stacked on it;
(c) `precompute_ref=true`: the reference log-probs of (a) or (b) are computed once before
    training, cached beside the run as safetensors + JSON keyed by what they depend on, and read
    back during training, so the loop does one forward per step instead of two.

The loss (`dpo_loss`) follows TRL's `DPOTrainer` formulas (sigmoid, ipo, hinge, robust) and its
metric names (`rewards/chosen`, ...). Sequences are scored from one concatenated forward of
`[chosen; rejected]` through `chunked_token_logprobs`, so no `B x T x V` logits tensor exists.
The unit of the loss is the pair (DESIGN rule 2): an objective returns the loss summed over
pairs and the number of pairs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from minitrain import distributed
from minitrain.config import TrainConfig, doc
from minitrain.collate import collate_preference
from minitrain.errors import UserError
from minitrain.lora import disable_adapters
from minitrain.losses import IGNORE_INDEX, chunked_token_logprobs, shift_labels
from minitrain.objectives import batch_token_logprobs, causal_hidden
from minitrain.packing import collate_packed_pairs, per_sequence
from minitrain.weights import io_error_reason

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


@dataclass
class DPOConfig(TrainConfig):
    """A DPO run: `TrainConfig` plus the preference-loss keys (names and defaults as TRL's DPOConfig)."""

    beta: float = doc(0.1, "how far the policy may move from the reference (higher: less); IPO's tau", gt=0)
    loss_type: str = doc("sigmoid", "preference loss", choices=LOSS_TYPES)
    label_smoothing: float = doc(0.0, "probability a preference label is flipped: sigmoid (cDPO) and robust only",
                                 ge=0, lt=0.5)
    sft_weight: float = doc(0.0, "weight of an NLL term on the chosen answers (per-token mean per pair; RPO)", ge=0)
    precompute_ref: bool = doc(False, "compute the reference log-probs once before training, cached in out/ref_logps")
    ref_batch_size: int = doc(0, "pairs per batch when precomputing the reference (0: 2 x batch_size)", ge=0)
    drop_identical_pairs: bool = doc(False, "drop pairs whose chosen and rejected are the same tokens (counted); "
                                            "else such a pair is an error naming its line")
    shared_prompt: bool = doc(False, "one row [prompt, chosen, rejected] per pair: the prompt's forward and "
                                     "backward run once (exact; faster when prompts are long)")
    packing: bool = doc(False, "pack each micro-batch's chosen and rejected sequences into rows of up to max_len "
                               "tokens (positions restart, attention stays inside each sequence; same loss)")

    def check(self) -> None:
        super().check()
        self.check_layout()
        if self.finetune == "full":
            raise UserError(f"finetune=full: loss_type={self.loss_type}'s reference is the base model, which "
                            f"minitrain gets by disabling the adapters — use finetune=lora (or a reference-free "
                            f"loss_type: orpo, cpo, simpo)")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust"):
            raise UserError(f"label_smoothing={self.label_smoothing}: has no meaning for loss_type={self.loss_type} "
                            f"— use loss_type=sigmoid or robust, or label_smoothing=0")

    def check_layout(self) -> None:
        """How pairs are laid out in rows: shared_prompt or packing, not both."""
        if self.packing and self.shared_prompt:
            raise UserError("packing=true: does not combine with shared_prompt=true — use shared_prompt for long "
                            "prompts, packing for short pairs of varied length")


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


# ----------------------------------------------------------------------------- scoring sequences


class SequenceLogps(NamedTuple):
    """Summed completion log-probs and completion token counts of the pairs of one batch, (P,) each."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def num_pairs(batch: dict[str, Any]) -> int:
    """P for a `collate_preference` batch of 2P rows `[chosen; rejected]`."""
    return int(batch.get("num_pairs") or batch["input_ids"].shape[0] // 2)


def sequence_logps(model: nn.Module, batch: dict[str, Any]) -> SequenceLogps:
    """Score chosen and rejected answers with ONE forward of the concatenated `[chosen; rejected]` batch.

    One forward (not two) halves the kernel launches and keeps both halves under the same
    padding, so a pair's two scores differ only by their answers. Log-probs come from
    `chunked_token_logprobs` (no `2P x T x V` logits tensor) in fp32. A `collate_shared_prompt`
    batch (P rows) is scored from its one row per pair, the shared prefix computed once; a packed
    batch (`collate_packed_pairs`) sums each sequence's tokens wherever its row put them.
    """
    if "rejected_targets" in batch:  # collate_shared_prompt: one row [prompt, chosen, rejected] per pair
        hidden = causal_hidden(model, batch)  # (P, T, D)
        head = model.output_projection
        c_t, r_t = batch["chosen_targets"], batch["rejected_targets"]  # (P, T), already shifted
        c = chunked_token_logprobs(hidden, head, c_t).sum(dim=1)  # (P,)
        r = chunked_token_logprobs(hidden, head, r_t).sum(dim=1)
        return SequenceLogps(c, r, (c_t != IGNORE_INDEX).sum(dim=1), (r_t != IGNORE_INDEX).sum(dim=1))
    labels = batch["labels"]  # (rows, T), aligned with input_ids, -100 off the completion
    logps = per_sequence(batch, batch_token_logprobs(model, batch, labels))  # (2P,)
    tokens = per_sequence(batch, shift_labels(labels) != IGNORE_INDEX)  # (2P,) scored tokens per sequence
    P = num_pairs(batch)
    return SequenceLogps(logps[:P], logps[P:], tokens[:P], tokens[P:])


# ----------------------------------------------------------------------------- the reference


class BaseReference:
    """Mode (a), a fresh adapter: the reference is the model with its adapters disabled.

    At step 0 a fresh LoRA (B = 0) makes the policy equal to this base exactly.
    """

    def logps(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) reference log-probs (P,), without a graph."""
        with torch.no_grad(), dropout_off(model), disable_adapters(model):
            s = sequence_logps(model, batch)
        return s.chosen, s.rejected

    def fingerprint(self) -> str:
        return "base model (adapters disabled)"


class AdapterSnapshotReference:
    """Mode (b), continuing a trained adapter: the reference is the policy as it was when made.

    Keeps a frozen copy of the trainable (adapter) tensors only — LoRA A/B (a few MB for a 7B
    model) and any `modules_to_save`, which are copied in full — and, for each reference forward,
    copies them in under `no_grad` and the live training values back afterwards. Create it right
    after `load_adapter(..., trainable=True)`, before any step. The reference forward must run before the policy forward
    of the same step: the copies change the tensors in place, which autograd would catch (an
    in-place error) if a policy graph were alive, instead of giving silently wrong gradients.
    """

    def __init__(self, model: nn.Module):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise UserError("reference: the model has no trainable adapter tensors to snapshot — load the adapter "
                            "with load_adapter(model, folder, trainable=True) first")
        self.names = [n for n, _ in named]
        self.frozen = [p.detach().clone() for _, p in named]

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[nn.Module]:
        """Within: the model's adapter tensors hold the snapshot; after: their training values again."""
        params = dict(model.named_parameters())
        live = [params[n] for n in self.names]
        with torch.no_grad():
            kept = [p.detach().clone() for p in live]
            for p, ref in zip(live, self.frozen):
                p.copy_(ref)
        try:
            yield model
        finally:
            with torch.no_grad():
                for p, value in zip(live, kept):
                    p.copy_(value)

    def logps(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) reference log-probs (P,), without a graph."""
        with torch.no_grad(), dropout_off(model), self.swapped_in(model):
            s = sequence_logps(model, batch)
        return s.chosen, s.rejected

    def fingerprint(self) -> str:
        """A content hash of the snapshot: names, shapes, dtypes and values."""
        h = hashlib.sha256()
        for n, t in zip(self.names, self.frozen):
            h.update(f"{n}:{tuple(t.shape)}:{t.dtype};".encode())
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
        return "adapter snapshot " + h.hexdigest()


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[None]:
    """Switch off every dropout module, and nothing else, while scoring for the reference / eval.

    Not `model.eval()`: quantized layers change their kernels with the mode (bitsandbytes' int8
    matmul quantizes activations in eval mode, and its CPU 4-bit layer repacks its weight for
    inference on an eval-mode no-grad forward, after which that weight passes no gradient), so
    an eval-mode reference would neither equal the policy at step 0 nor leave training intact.
    """
    switched = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.training]
    for m in switched:
        m.eval()
    try:
        yield
    finally:
        for m in switched:
            m.train()


def make_reference(model: nn.Module, init_adapter: str = "") -> BaseReference | AdapterSnapshotReference:
    """The reference for a run: the adapter snapshot when continuing `init_adapter`, else the base."""
    return AdapterSnapshotReference(model) if init_adapter else BaseReference()


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
        if "ref_chosen_logps" in batch:
            ref_c, ref_r = batch["ref_chosen_logps"].float(), batch["ref_rejected_logps"].float()
        elif self.reference is not None:
            ref_c, ref_r = self.reference.logps(model, batch)  # before the policy graph exists
        else:
            raise ValueError("DPOObjective: no reference and the batch carries no ref_*_logps")
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
        return stats["loss"].sum(), num_pairs(batch), dict(zip(keys, means))

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
    real tokens, `block_mask` (P, 1, T, T) bool (True = may attend; padding keys are seen by themselves only),
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

    seg = pad(segs, 3)  # 0 prefix, 1 chosen, 2 rejected, 3 padding
    idx = torch.arange(T)
    allowed = (idx[None, :] <= idx[:, None])[None] & (seg[:, None, :] != 3)  # (P, T, T) causal, real keys
    allowed &= ~((seg[:, :, None] == 2) & (seg[:, None, :] == 1))  # rejected never sees chosen
    allowed |= torch.eye(T, dtype=torch.bool)[None]  # every query sees itself (no empty row)
    return {"input_ids": pad(rows, pad_id), "position_ids": pad(pos, 0), "attention_mask": (seg != 3).long(),
            "block_mask": allowed[:, None], "chosen_targets": pad(c_tg, IGNORE_INDEX),
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
    have = ["ref_chosen_logp" in ex for ex in examples]
    if any(have):
        if not all(have):
            raise ValueError("collate_with_reference: some examples have precomputed reference log-probs, some not")
        batch["ref_chosen_logps"] = torch.tensor([ex["ref_chosen_logp"] for ex in examples], dtype=torch.float32)
        batch["ref_rejected_logps"] = torch.tensor([ex["ref_rejected_logp"] for ex in examples], dtype=torch.float32)
    return batch


def reference_cache_key(model: nn.Module, reference: BaseReference | AdapterSnapshotReference,
                        examples: Sequence[dict], amp_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """What the reference log-probs depend on, as a JSON-able dict with its `key` (sha256).

    - the base weights: each safetensors file of `model.source_dir` by resolved path, size and
      mtime (a changed or replaced file changes the key; nothing is read), and config.json;
    - how they sit in memory: every parameter's name, dtype and shape (quantization, base
      dtype, adapter layout), and the autocast dtype;
    - the reference: base, or a content hash of the adapter snapshot;
    - the data: a hash of the tokenized pairs (ids and labels), which covers the data file, the
      tokenizer, the chat format, max_len and truncation at once.
    """
    files = []
    source = getattr(model, "source_dir", None)
    if source is not None:
        from minitrain.weights import checkpoint_files

        for f in [*checkpoint_files(source), Path(source) / "config.json"]:
            st = f.stat()
            files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    layout = hashlib.sha256()
    for n, p in model.named_parameters():
        layout.update(f"{n}:{p.dtype}:{tuple(p.shape)};".encode())
    data = hashlib.sha256()
    for ex in examples:
        for k in ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"):
            data.update(json.dumps(ex[k]).encode())
    parts = {"weights": files, "layout": layout.hexdigest(), "autocast": str(amp_dtype),
             "reference": reference.fingerprint(), "data": data.hexdigest(), "pairs": len(examples)}
    parts["key"] = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return parts


@torch.no_grad()
def compute_reference_logps(model: nn.Module, reference: BaseReference | AdapterSnapshotReference,
                            examples: Sequence[dict], collate: Callable[[list[dict]], dict[str, Any]],
                            batch_size: int, amp_dtype: torch.dtype | None = None,
                            desc: str = "reference log-probs") -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) reference log-probs of every pair, (N,) fp32 on the CPU, batched with a bar.

    Runs with the model in training mode (as the loop will score the policy; dropout off), so
    that mode-dependent quantized kernels give the reference the policy's numbers at step 0.
    """
    device = next(model.parameters()).device
    chosen, rejected = [], []
    was = model.training
    model.train()
    try:
        for i in tqdm(range(0, len(examples), batch_size), desc=desc, dynamic_ncols=True, disable=None):
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                     for k, v in collate(list(examples[i : i + batch_size])).items()}
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                c, r = reference.logps(model, batch)
            chosen.append(c.float().cpu())
            rejected.append(r.float().cpu())
    finally:
        model.train(was)
    return torch.cat(chosen), torch.cat(rejected)


def precompute_reference(model: nn.Module, reference: BaseReference | AdapterSnapshotReference,
                         examples: Sequence[dict], cache: str | os.PathLike,
                         collate: Callable[[list[dict]], dict[str, Any]], batch_size: int,
                         amp_dtype: torch.dtype | None = None, log: Callable[[str], None] = print) -> bool:
    """Give every example its `ref_chosen_logp` / `ref_rejected_logp`, from `cache` when fresh.

    `cache` is a path stem: `<cache>.safetensors` holds the (N,) tensors, `<cache>.json` the key
    parts (see `reference_cache_key`). A cache whose key differs is stale and rebuilt; both
    files are written to temporary names and renamed. Returns True when the cache was reused.
    Call it before training (mode (c)): the reference is then never run again.
    """
    parts = reference_cache_key(model, reference, examples, amp_dtype)
    stem = Path(cache)
    tensors_path, meta_path = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
    reused = False
    if tensors_path.is_file() and meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text())
        except ValueError:
            old = {}
        if old.get("key") == parts["key"]:
            t = load_file(str(tensors_path))
            chosen, rejected = t["ref_chosen_logps"], t["ref_rejected_logps"]
            reused = chosen.shape == (len(examples),) and rejected.shape == (len(examples),)
        if reused:
            log(f"reference log-probs: reusing {tensors_path} ({len(examples)} pairs)")
        else:
            changed = [k for k in parts if k != "key" and old.get(k) != parts[k]]
            why = ", ".join(changed) or "unreadable"
            log(f"reference log-probs: {tensors_path} is stale ({why} changed) — rebuilding")
    if not reused:
        chosen, rejected = compute_reference_logps(model, reference, examples, collate, batch_size, amp_dtype)

        def write() -> None:  # rank 0 alone under torchrun (every rank computed the same values)
            tmp = tensors_path.with_name(f".{tensors_path.name}.tmp")
            try:
                stem.parent.mkdir(parents=True, exist_ok=True)
                save_file({"ref_chosen_logps": chosen.contiguous(), "ref_rejected_logps": rejected.contiguous()},
                          str(tmp))
                os.replace(tmp, tensors_path)
                tmp = meta_path.with_name(f".{meta_path.name}.tmp")
                tmp.write_text(json.dumps(parts, indent=2) + "\n")
                os.replace(tmp, meta_path)
            except (OSError, SafetensorError) as e:
                tmp.unlink(missing_ok=True)
                raise UserError(f"{tensors_path}: cannot write the reference cache: {io_error_reason(e)} — free "
                                f"space or choose a writable out folder") from None

        distributed.main_only(write)
        log(f"reference log-probs: {len(examples)} pairs cached in {tensors_path}")
    for ex, c, r in zip(examples, chosen.tolist(), rejected.tolist()):
        ex["ref_chosen_logp"], ex["ref_rejected_logp"] = c, r
    return reused
