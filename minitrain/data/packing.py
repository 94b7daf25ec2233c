"""Sample packing (`packing=true`): a micro-batch's sequences in as few rows as fit.

The Batcher still chooses which examples form a micro-batch (so the data order, the loss unit and
an exact resume are those of the unpacked run); the collator only lays them out differently:
first-fit decreasing into rows of at most `max_len` tokens, as long as the fewest token positions
need (`pack`: never more than the padded batch). In each row every sequence keeps its
own positions (from 0) and attends only to itself (causal models: `document_ids` with `position_ids`,
from which the model builds its block-diagonal mask, dense for SDPA or FlexAttention's block mask;
`models.t5`: the encoder, decoder and cross-attention masks as dense bool tensors).

- causal SFT (`collate_packed_causal`): the first label of each example is set to -100 (it is
  never a target: a causal model predicts token t + 1 from t), so the objective's usual one-step
  label shift never makes a row's last token predict the next row's first. Loss sum and target
  count are those of the unpacked batch: only the padding is gone.
- preference pairs (`collate_packed_pairs`): the 2P sequences `[chosen_0..; rejected_0..]` packed
  alike, with `sequence_ids` naming each token's sequence, so `per_sequence` sums a per-token value
  into the (2P,) vector the padded batch gives by summing its rows: DPO's unit stays the pair.
- seq2seq (`collate_packed_seq2seq`): encoder and decoder sequences of the same examples packed into
  the same rows (each within its own length limit); the encoder mask is block-diagonal, the decoder's
  block-diagonal causal, and cross-attention lets each example's decoder see its own encoder segment
  only. T5 needs no positions: its relative bias depends on `k - q` alone, which inside a sequence
  is the sequence's own wherever the row puts it (the mask hides every other pair).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from minitrain.data.collate import IGNORE_INDEX


def first_fit_decreasing(sizes: Sequence[tuple[int, ...]], capacity: Sequence[int]) -> list[list[int]]:
    """Rows of example indices: longest first (by the first part), each into the first row with room
    in every part; an example over the capacity gets a row alone."""
    rows: list[list[int]] = []
    room: list[list[int]] = []
    for i in sorted(range(len(sizes)), key=lambda k: (tuple(-n for n in sizes[k]), k)):
        need = sizes[i]
        j = next((r for r in range(len(rows)) if all(a >= n for a, n in zip(room[r], need))), None)
        if j is None:
            rows.append([i])
            room.append([max(c, n) - n for c, n in zip(capacity, need)])
        else:
            rows[j].append(i)
            room[j] = [a - n for a, n in zip(room[j], need)]
    return rows


def pack(lengths: Sequence[int] | Sequence[tuple[int, ...]], max_len: int | tuple[int, ...]) -> list[list[int]]:
    """Rows of example indices for one micro-batch, as few token positions (rows x row length) as
    first-fit decreasing reaches: rows of at most `max_len` tokens, and no longer than needed.

    Filling rows up to `max_len` can cost more than padding: four examples of ~100 tokens make a
    row of ~300 and one of ~100, padded to 2 x 300 positions where the padded batch has 4 x 100.
    So for each row count k the smallest row capacity that packs into k rows is searched for
    (from `max(longest, total / k)` up to `max_len`), and the packing with the fewest positions
    (then the shortest rows) is kept. k = n is the padded batch itself, so packing never lays out
    more positions than padding. With tuples (seq2seq: encoder and decoder lengths, `max_len` a
    tuple of limits), every part fits its own limit, the capacities grow together and the
    positions of the parts add up.
    """
    sizes = [n if isinstance(n, tuple) else (n,) for n in lengths]
    limits = max_len if isinstance(max_len, tuple) else (max_len,)
    parts = range(len(limits))
    longest = [max(n[d] for n in sizes) for d in parts]
    total = [sum(n[d] for n in sizes) for d in parts]
    hi = [max(m, lo) for m, lo in zip(limits, longest)]

    def rows_at(k: int, t: int, steps: int) -> list[list[int]]:  # capacity t/steps of the way from the floor to hi
        lo = [min(h, max(longest[d], -(-total[d] // k))) for d, h in zip(parts, hi)]
        return first_fit_decreasing(sizes, [a + -(-(h - a) * t // steps) for a, h in zip(lo, hi)])

    best = None
    for k in range(1, len(sizes) + 1):
        steps = max(1, max(h - min(h, max(longest[d], -(-total[d] // k))) for d, h in zip(parts, hi)))
        a, b = 0, steps  # the smallest t whose packing takes at most k rows (t = steps: the widest rows)
        while a < b:
            mid = (a + b) // 2
            a, b = (a, mid) if len(rows_at(k, mid, steps)) <= k else (mid + 1, b)
        rows = rows_at(k, a, steps)
        width = sum(max(sum(sizes[i][d] for i in row) for row in rows) for d in parts)
        if best is None or (len(rows) * width, width) < best[0]:
            best = ((len(rows) * width, width), rows)
    return best[1]


def lay_out(seqs: Sequence[Sequence[int]], rows: list[list[int]], fill: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`seqs` placed side by side in the rows `pack` chose: `(values, position_ids, sequence_ids)`,
    each (B, T): `fill` after a row's last sequence, positions from 0 in each sequence, and the
    index into `seqs` of each token's sequence (-1 on padding)."""
    T = max(sum(len(seqs[i]) for i in row) for row in rows)
    values = torch.full((len(rows), T), fill, dtype=torch.long)
    pos = torch.zeros((len(rows), T), dtype=torch.long)
    seq = torch.full((len(rows), T), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for i in row:
            n = len(seqs[i])
            values[b, at : at + n] = torch.as_tensor(list(seqs[i]), dtype=torch.long)
            pos[b, at : at + n] = torch.arange(n)
            seq[b, at : at + n] = i
            at += n
    return values, pos, seq


def segment_lengths(seqs: Sequence[Sequence[int]], rows: list[list[int]]) -> torch.Tensor:
    """(B, K) the lengths of each row's sequences, 0-padded (the FLOP count's attention pairs)."""
    out = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=torch.long)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor([len(seqs[i]) for i in row])
    return out


def block_mask(q_seq: torch.Tensor, k_seq: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """(B, Tq) / (B, Tk) sequence ids (-1 = padding) -> (B, 1, Tq, Tk) bool, True = may attend: a query
    sees the keys of its own sequence (causal: those at or before it); with `k_seq` None the keys
    are the queries, and each position also sees itself (a padding row is never empty, so SDPA
    never returns NaN)."""
    self_attn = k_seq is None
    k_seq = q_seq if self_attn else k_seq
    allowed = (q_seq[:, :, None] == k_seq[:, None, :]) & (k_seq[:, None, :] >= 0)  # (B, Tq, Tk)
    if causal:
        allowed &= torch.ones(q_seq.shape[1], k_seq.shape[1], dtype=torch.bool).tril()[None]
    if self_attn:
        allowed |= torch.eye(q_seq.shape[1], dtype=torch.bool)[None]
    return allowed[:, None]


def document_ids(seq: torch.Tensor) -> torch.Tensor:
    """(B, T) sequence ids (-1 = padding) -> the model's `document_ids` (B, T): sequence i is document
    i + 1 (document 0 is a row's shared prefix, which packed rows do not have), padding -1: each
    token attends causally to its own sequence (docs/contracts.md, `models.layers.document_mask_mod`)."""
    return torch.where(seq >= 0, seq + 1, -1)


def collate_packed_causal(examples: Sequence[dict], pad_id: int, max_len: int) -> dict[str, Any]:
    """Causal examples packed into rows of at most `max_len` (see the module docstring).

    Keys: `input_ids`, `labels`, `attention_mask` (B, T: 1 on real tokens), `position_ids` (B, T),
    `document_ids` (B, T: the model's layout of the rows, `document_ids`), `sequence_ids` (B, T: the
    example's index, -1 on padding), `num_sequences`, `segment_lengths` (B, K) (0-padded). No (T, T)
    mask: the model derives the one its attention needs from `document_ids`.
    """
    ids = [ex["input_ids"] for ex in examples]
    rows = pack([len(x) for x in ids], max_len)
    input_ids, pos, seq = lay_out(ids, rows, pad_id)
    labels = lay_out([ex["labels"] for ex in examples], rows, IGNORE_INDEX)[0]
    labels[pos == 0] = IGNORE_INDEX  # never a target; keeps the shift inside the example
    return {"input_ids": input_ids, "labels": labels, "attention_mask": (seq >= 0).long(), "position_ids": pos,
            "document_ids": document_ids(seq), "sequence_ids": seq, "num_sequences": len(ids),
            "segment_lengths": segment_lengths(ids, rows)}


def collate_packed_pairs(examples: Sequence[dict], pad_id: int, max_len: int) -> dict[str, Any]:
    """Preference pairs packed: the 2P sequences `[chosen_0..chosen_{P-1}; rejected_0..]` of
    `collate_preference` in rows of at most `max_len`, keys as `collate_packed_causal` (sequence
    `p` is chosen of pair `p`, `P + p` its rejected) plus `num_pairs` = P."""
    seqs = [{"input_ids": ex[f"{side}_ids"], "labels": ex[f"{side}_labels"]}
            for side in ("chosen", "rejected") for ex in examples]
    return {**collate_packed_causal(seqs, pad_id, max_len), "num_pairs": len(examples)}


def sequence_ids(batch: dict[str, Any]) -> torch.Tensor:
    """(B, T) each token's sequence index, -1 on padding: `sequence_ids` of a packed batch, or the row
    index of a padded one (`attention_mask` 0 is padding)."""
    seq = batch.get("sequence_ids")
    if seq is not None:
        return seq
    ids = batch["input_ids"]
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    mask = batch.get("attention_mask")
    return rows if mask is None else rows.masked_fill(mask == 0, -1)


def per_sequence(batch: dict[str, Any], values: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token values -> (N,) their sum over each sequence of the batch: a row's sum when
    padded, each sequence's tokens (`sequence_ids`) when packed. Bool values are counted."""
    if values.dtype == torch.bool:
        values = values.long()
    seq = batch.get("sequence_ids")
    if seq is None:
        return values.sum(dim=1)
    n = batch["num_sequences"]
    index = seq.where(seq >= 0, n).flatten()  # padding into a spare slot, dropped
    return values.new_zeros(n + 1).index_add(0, index, values.flatten())[:n]


def collate_packed_seq2seq(examples: Sequence[dict], pad_id: int, max_len: int, max_target_len: int,
                           decoder_start_id: int | None = None) -> dict[str, Any]:
    """Encoder-decoder examples packed: each row holds the encoder ids of some examples (at most
    `max_len` tokens) and their decoder targets (at most `max_target_len`), in the same order.

    Keys as `collate_seq2seq` (`input_ids`, `attention_mask`, `labels`, `decoder_input_ids`: each
    example's labels shifted right behind `decoder_start_id`, default the pad id, as T5;
    `decoder_attention_mask` of real tokens) plus the bool masks `block_mask` (B, 1, S, S) (each
    encoder sequence sees itself, both ways), `decoder_block_mask` (B, 1, T, T) (causal within each
    example) and `cross_block_mask` (B, 1, T, S) (an example's decoder sees its own encoder tokens).
    """
    start = pad_id if decoder_start_id is None else decoder_start_id
    src = [ex["input_ids"] for ex in examples]
    tgt = [ex["labels"] for ex in examples]
    rows = pack([(len(s), len(t)) for s, t in zip(src, tgt)], (max_len, max_target_len))
    input_ids, _, seq = lay_out(src, rows, pad_id)
    labels, _, dec_seq = lay_out(tgt, rows, IGNORE_INDEX)
    shifted = [[start, *(pad_id if y == IGNORE_INDEX else y for y in t[:-1])] for t in tgt]
    return {"input_ids": input_ids, "attention_mask": (seq >= 0).long(), "labels": labels,
            "decoder_input_ids": lay_out(shifted, rows, pad_id)[0], "decoder_attention_mask": (dec_seq >= 0).long(),
            "block_mask": block_mask(seq, causal=False), "decoder_block_mask": block_mask(dec_seq),
            "cross_block_mask": block_mask(dec_seq, seq, causal=False)}
