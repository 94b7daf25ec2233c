"""Padding collators: lists of token-id examples -> batch tensors (B, T).

Pads are masked (`attention_mask` 0, label `IGNORE_INDEX`), so the pad id only needs to be valid.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

IGNORE_INDEX = -100  # a label that takes no loss (prompt, bos, padding): HF's and torch's convention


def _pad(rows: Sequence[Sequence[int]], value: int, length: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return out


def _mask(rows: Sequence[Sequence[int]], length: int) -> torch.Tensor:
    out = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = 1
    return out


def collate_causal(examples: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """`input_ids`, `attention_mask`, `labels` (B, T), right-padded to the longest example
    (pads: `pad_id` in inputs, 0 in the mask, -100 in labels)."""
    ids = [ex["input_ids"] for ex in examples]
    T = max(len(r) for r in ids)
    return {"input_ids": _pad(ids, pad_id, T), "attention_mask": _mask(ids, T),
            "labels": _pad([ex["labels"] for ex in examples], IGNORE_INDEX, T)}


def collate_seq2seq(examples: Sequence[dict], pad_id: int, decoder_start_id: int | None = None) -> dict[str, torch.Tensor]:
    """Encoder `input_ids` / `attention_mask` (B, S), decoder `labels` (B, T) padded with -100,
    and `decoder_input_ids` = labels shifted right behind `decoder_start_id` (default: pad, as
    T5) with `decoder_attention_mask`."""
    start = pad_id if decoder_start_id is None else decoder_start_id
    src = [ex["input_ids"] for ex in examples]
    tgt = [ex["labels"] for ex in examples]
    S, T = max(len(r) for r in src), max(len(r) for r in tgt)
    labels = _pad(tgt, IGNORE_INDEX, T)
    dec = torch.cat([torch.full((len(tgt), 1), start, dtype=torch.long), labels[:, :-1]], dim=1)
    return {"input_ids": _pad(src, pad_id, S), "attention_mask": _mask(src, S),
            "labels": labels, "decoder_input_ids": dec.masked_fill(dec == IGNORE_INDEX, pad_id),
            "decoder_attention_mask": _mask(tgt, T)}


def collate_preference(examples: Sequence[dict], pad_id: int) -> dict[str, Any]:
    """One batch of 2B rows, `[chosen_0..chosen_{B-1}; rejected_0..rejected_{B-1}]`, padded to a
    common length (one forward computes both), plus `num_pairs` = B."""
    rows = [ex["chosen_ids"] for ex in examples] + [ex["rejected_ids"] for ex in examples]
    labels = [ex["chosen_labels"] for ex in examples] + [ex["rejected_labels"] for ex in examples]
    T = max(len(r) for r in rows)
    return {"input_ids": _pad(rows, pad_id, T), "attention_mask": _mask(rows, T),
            "labels": _pad(labels, IGNORE_INDEX, T), "num_pairs": len(examples)}
