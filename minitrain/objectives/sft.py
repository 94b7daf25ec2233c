"""Objectives: functions `(model, batch) -> (loss_sum, count, metrics)`.

`loss_sum` is an fp32 scalar summed over the batch's loss units (target tokens for SFT and
seq2seq; pairs for preference objectives), `count` the number of those units, `metrics` a
dict of floats the loop averages over the accumulation window. The loop adds `loss_sum` and
`count` over the window (and ranks) and divides the gradients by the total count (rule 2), so
an objective never takes a mean itself. The loop knows nothing else about objectives: new
ones (DPO, distillation) are new functions in this file.

Two optional attributes shape the loop's held-out evaluation (`minitrain.train`):

- `token_level: bool` (absent: True): the unit is the target token, so exp of the mean loss is
  a perplexity and the generic `evaluate` reports `eval/ppl`; DPO's unit is the pair (False);
- `evaluate(model, examples, collate, batch_size, amp_dtype) -> dict`: the objective's own
  held-out pass, called by the loop instead of the generic one; it returns `eval/loss` (with the
  meaning the generic pass would give it) and any other `eval/...` metrics, the same values on
  every rank (DPO: `DPOObjective.evaluate`, TRL's metrics from the same forwards as the loss).

Batches are the collators' dicts of tensors already on the model's device:
`input_ids (B, T)`, `attention_mask (B, T)`, `labels (B, T)` with `-100` where no loss is taken
(prompt tokens, padding). For causal models `labels` are aligned with `input_ids` (as HF does)
and shifted here; for encoder-decoder models `labels` are the decoder targets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minitrain.data.collate import IGNORE_INDEX
from minitrain.objectives.losses import chunked_cross_entropy_sum, chunked_token_logprobs, shift_labels


def causal_token_logprobs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor,
    images: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) at every position whose next label is a target.

    Returns (B, T) fp32, 0 where `shift_labels(labels)` is -100. Summing over T gives the
    sequence log-likelihood of the completion (what preference objectives need). `images`: the rows'
    images as a vision-language model's forward takes them (`image_inputs`).
    """
    hidden = model(input_ids, attention_mask, **(images or {}))  # (B, T, D)
    return chunked_token_logprobs(hidden, model.output_projection, shift_labels(labels))


def causal_hidden(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Hidden states (B, T, D) of a causal batch: padded rows, or rows of several sequences (packed,
    DPO's shared prompt) with their `document_ids` and `position_ids` (the model builds the mask its
    `packed_attention` needs: a dense one for SDPA, or FlexAttention's block mask)."""
    if "document_ids" in batch:
        return model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"],
                     **image_inputs(batch))
    return model(batch["input_ids"], batch.get("attention_mask"), **image_inputs(batch))


def image_inputs(batch: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """A batch's images as a vision-language model's forward takes them (`minitrain.data.images.collate_images`:
    `pixel_values`, Qwen's `image_grid_thw`, Gemma 4's `image_position_ids`; `prefix` "group_": those of GRPO's
    rows); {} without images."""
    keys = ("pixel_values", "image_grid_thw", "image_position_ids", "pixel_values_videos", "video_grid_thw",
            "second_per_grid_ts")
    return {k: batch[prefix + k] for k in keys if prefix + k in batch}


def batch_token_logprobs(model: nn.Module, batch: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """`causal_token_logprobs` of a batch in any layout (`causal_hidden`): (B, T) fp32."""
    return chunked_token_logprobs(causal_hidden(model, batch), model.output_projection, shift_labels(labels))


def sft(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Causal-LM cross-entropy on the completion tokens (prompt tokens carry label -100).

    A packed batch (`minitrain.data.packing`) brings its block mask and per-example positions."""
    hidden = causal_hidden(model, batch)  # (B, T, D)
    loss_sum, count = chunked_cross_entropy_sum(hidden, model.output_projection, shift_labels(batch["labels"]))
    return router_aux(model, batch, loss_sum, count)


def router_aux(model: nn.Module, batch: dict[str, torch.Tensor], loss_sum: torch.Tensor, count: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """A mixture-of-experts model's routing terms after its forward on `batch` (the model's optional
    `router_aux_loss`, docs/contracts.md): the load-balancing loss joins the loss when the model's config
    turns it on, as `count` x the term, so that after the window's division by its token count it adds
    the term per token, as transformers adds it to its mean loss; `aux_loss` and the expert loads are
    logged either way. Any other model: (loss_sum, count, {})."""
    aux = getattr(model, "router_aux_loss", None)
    if aux is None:
        return loss_sum, count, {}
    real = batch["document_ids"] >= 0 if "document_ids" in batch else batch.get("attention_mask")
    out = aux(real)
    if out is None:  # an eval-mode forward routes without keeping it
        return loss_sum, count, {}
    term, metrics = out
    if term is not None:
        loss_sum = loss_sum + term * count
    return loss_sum, count, metrics


def shift_right(labels: torch.Tensor, start_id: int, pad_id: int) -> torch.Tensor:
    """Decoder inputs for teacher forcing: `[start, y0, y1, ...]` with -100 replaced by pad. (B, T)"""
    dec = labels.new_full(labels.shape, pad_id)
    dec[:, 0] = start_id
    dec[:, 1:] = labels[:, :-1]
    return dec.masked_fill(dec == IGNORE_INDEX, pad_id)


def seq2seq(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Encoder-decoder cross-entropy: the decoder at position t predicts `labels[:, t]`.

    `decoder_input_ids` come from the batch when the collator made them, else they are
    `labels` shifted right behind `config.decoder_start_token_id` (T5: the pad id, 0). A packed
    batch brings its three masks.
    """
    if not getattr(model, "is_encoder_decoder", False):
        raise TypeError("seq2seq objective needs an encoder-decoder model (model.is_encoder_decoder)")
    labels = batch["labels"]  # (B, Td)
    dec_in = batch.get("decoder_input_ids")
    if dec_in is None:
        cfg = getattr(model, "config", None)
        pad = getattr(cfg, "pad_token_id", None)
        pad = 0 if pad is None else pad
        start = getattr(cfg, "decoder_start_token_id", None)
        dec_in = shift_right(labels, pad if start is None else start, pad)
    if "block_mask" in batch:  # packed rows (`minitrain.data.packing.collate_packed_seq2seq`)
        hidden = model(batch["input_ids"], batch["block_mask"], dec_in, batch["decoder_block_mask"],
                       cross_attention_mask=batch["cross_block_mask"])  # (B, Td, D)
    else:
        hidden = model(
            batch["input_ids"], batch.get("attention_mask"), dec_in, batch.get("decoder_attention_mask")
        )  # (B, Td, D)
    loss_sum, count = chunked_cross_entropy_sum(hidden, model.output_projection, labels)
    return loss_sum, count, {}
