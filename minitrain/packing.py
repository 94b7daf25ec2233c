"""Sample packing for causal SFT (`packing=true`): a micro-batch's examples in as few rows as fit.

The Batcher still chooses which examples form a micro-batch (so the data order, the loss unit and
an exact resume are those of the unpacked run); the collator only lays them out differently:
first-fit decreasing into rows of at most `max_len` tokens. In each row every example keeps its own
positions (from 0) and attends only to itself: a block-diagonal causal mask (B, 1, T, T) that the
model gives to SDPA (`models.llama`: `attention_mask` 4-D with `position_ids`). The first label of
each example is set to -100 (it is never a target: a causal model predicts token t + 1 from t), so
the objective's usual one-step label shift never makes a row's last token predict the next row's
first. Loss sum and target count are those of the unpacked batch: only the padding is gone.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from minitrain.losses import IGNORE_INDEX


def pack(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Rows of example indices, first-fit decreasing: longest first, each into the first row with room."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = lengths[i]
        j = next((r for r in range(len(rows)) if room[r] >= n), None)
        if j is None:
            rows.append([i])
            room.append(max(max_len, n) - n)
        else:
            rows[j].append(i)
            room[j] -= n
    return rows


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids (0 = padding) -> (B, 1, T, T) bool: causal within a segment; each
    position also sees itself (a padding row is never empty, so SDPA never returns NaN)."""
    T = segments.shape[1]
    idx = torch.arange(T)
    same = segments[:, :, None] == segments[:, None, :]
    allowed = same & (idx[None, :] <= idx[:, None])[None] & (segments[:, None, :] != 0)
    return (allowed | torch.eye(T, dtype=torch.bool)[None])[:, None]


def collate_packed_causal(examples: Sequence[dict], pad_id: int, max_len: int) -> dict[str, Any]:
    """Causal examples packed into rows of at most `max_len` (see the module docstring).

    Keys: `input_ids`, `labels`, `attention_mask` (B, T: 1 on real tokens), `position_ids` (B, T),
    `block_mask` (B, 1, T, T) bool, `segment_lengths` (B, K) (0-padded).
    """
    rows = pack([len(ex["input_ids"]) for ex in examples], max_len)
    T = max(sum(len(examples[i]["input_ids"]) for i in row) for row in rows)
    B, K = len(rows), max(len(r) for r in rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros((B, T), dtype=torch.long)
    seg = torch.zeros((B, T), dtype=torch.long)
    seg_len = torch.zeros((B, K), dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for k, i in enumerate(row):
            x, y = examples[i]["input_ids"], examples[i]["labels"]
            n = len(x)
            ids[b, at : at + n] = torch.as_tensor(list(x))
            labels[b, at : at + n] = torch.as_tensor(list(y))
            labels[b, at] = IGNORE_INDEX  # never a target; keeps the shift inside the example
            pos[b, at : at + n] = torch.arange(n)
            seg[b, at : at + n] = k + 1
            seg_len[b, k] = n
            at += n
    return {"input_ids": ids, "labels": labels, "attention_mask": (seg != 0).long(), "position_ids": pos,
            "block_mask": block_causal_mask(seg), "segment_lengths": seg_len}
