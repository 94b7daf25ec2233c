"""G completions per prompt, sampled in one batch with the model's KV cache (GRPO's rollout).

    sample(model, prompt_ids, prompt_mask, new_cache=KVCache, num_generations=G, ...) -> Completions

The engine never imports `models/`: the recipe passes the family's cache class in
(`models.family(model).KVCache`), and the model is run through the contract's cached forward
(`model(ids, mask, cache=cache) -> hidden`, `model.output_projection`). Prompts are left-padded and
prefilled once each (a vision-language model's with their images: `images`); the cache is then repeated
G times (`cache.repeat_rows(G)`: rows `i * G .. i * G + G - 1` are prompt i's group) and every row decoded
one token per step; a row stops at its first eos / end-of-turn id and is padded after it; decoding stops when every row has or at `max_new_tokens`. Once the finished rows are
half of those still decoded, they leave the batch, their cache slots with them (`cache.keep_rows`):
short answers then stop costing the long ones' steps.

A vision-language model's image placeholder tokens (`model.placeholder_ids`) are never drawn (where transformers'
`generate` would draw one, the training forward with the batch's images would have no features for it).
Sampling follows transformers' logits processors in their order: logits / temperature, then top-k,
then top-p (the smallest set of most likely tokens whose probability reaches top_p; the most likely
token always stays), then one draw. `greedy=True` takes the argmax instead (greedy decoding equals
transformers' `generate`, tests/test_families.py). Draws come from torch's RNG on the model's device
(`generator`, default the global one that the training checkpoint saves and restores, so a resumed
run samples the same completions). No autograd; dropout is switched off but the model stays in
training mode (quantized kernels depend on the mode, see `minitrain.objectives.reference.dropout_off`),
with its adapters on: the completions are the policy's. On a CPU, fp32 LoRA layers decode with a merged
copy of their weight (`minitrain.adapters.lora.merged_for_decoding`: one product instead of three).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from minitrain.adapters.lora import merged_for_decoding
from minitrain.device import eager
from minitrain.objectives.reference import dropout_off


@dataclass
class Completions:
    """What `sample` returns: ids (N, C) right-padded with `pad_id`, mask (N, C) 1 up to and including
    the eos, truncated (N,) True where no eos came within `max_new_tokens` (N = prompts x G)."""

    ids: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits (N, V) with the tokens outside top-k, then outside the top-p nucleus, set to -inf
    (transformers' TopKLogitsWarper then TopPLogitsWarper)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # the mass before a token already reaches top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def sample(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
           new_cache: Callable[[int], Any], num_generations: int = 1, max_new_tokens: int = 32,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
           eos_ids: Sequence[int] = (), pad_id: int = 0, generator: torch.Generator | None = None,
           images: dict[str, torch.Tensor] | None = None) -> Completions:
    """`num_generations` completions of each left-padded prompt (B, P) -> `Completions` of B x G rows.
    `images`: the prompts' images as the model's forward takes them (`pixel_values`, ...), in the prefill."""
    if bool((prompt_mask[:, 1:] < prompt_mask[:, :-1]).any()):
        raise ValueError("sample: prompt_mask has padding after real tokens — left-pad the prompts")
    images = images or {}
    device = prompt_ids.device
    G = num_generations
    N = prompt_ids.shape[0] * G  # group i is rows i*G .. i*G+G-1
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    # a vision-language model's image placeholders are inputs only: a completion holding one would have no image
    # features in the forwards that carry the batch's images (transformers' and TRL's would stop there)
    never = list(getattr(model, "placeholder_ids", ()))
    out = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    length = torch.zeros(N, dtype=torch.long, device=device)  # tokens kept per row (eos included)
    # eager even where the blocks are compiled (compile=true): each decoding step has a new cache
    # length, which would recompile the blocks over and over; the training forward stays compiled.
    with dropout_off(model), eager(), merged_for_decoding(model):  # (a CPU's fp32 LoRA: one product a layer)
        cache = new_cache(prompt_ids.shape[1] + max_new_tokens)
        if hasattr(cache, "repeat_rows"):  # each prompt prefilled once, its cache then repeated G times
            hidden = model(prompt_ids, prompt_mask.long(), cache=cache, **images)[:, -1].repeat_interleave(G, dim=0)
            cache.repeat_rows(G)  # hidden (N, D)
        else:
            if images:
                raise ValueError("sample: prompts with images need a cache that repeats its rows (repeat_rows)")
            hidden = model(prompt_ids.repeat_interleave(G, dim=0), prompt_mask.repeat_interleave(G, dim=0).long(),
                           cache=cache)[:, -1]
        step_mask = torch.ones(N, 1, dtype=torch.long, device=device)
        # per row still decoded (n,): its output row, whether it has ended, the tokens it kept; `done` and
        # `length` learn them when rows leave the batch and at the end (a step's bookkeeping: few ops)
        rows = torch.arange(N, device=device)
        ended = torch.zeros(N, dtype=torch.bool, device=device)
        kept = torch.zeros(N, dtype=torch.long, device=device)
        for t in range(max_new_tokens):
            logits = model.output_projection(hidden).float()  # (n, V)
            if never:
                logits[:, [i for i in never if i < logits.shape[-1]]] = float("-inf")
            if greedy:
                token = logits.argmax(-1)
            else:
                probs = filter_logits(logits if temperature == 1.0 else logits / temperature, top_k, top_p).softmax(-1)
                token = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (n,)
            token = token.masked_fill(ended, pad_id)  # rows that have ended get padding
            out[rows, t] = token
            kept += ~ended  # this token counts where the row had not ended before it (an eos counts)
            ended |= torch.isin(token, eos)
            n_done = int(ended.sum())
            last = n_done == rows.numel() or t == max_new_tokens - 1
            shrink = 2 * n_done >= rows.numel() and hasattr(cache, "keep_rows")  # drop the finished half
            if last or shrink:
                length[rows], done[rows] = kept, ended
            if last:
                break
            if shrink:
                keep = (~ended).nonzero().squeeze(1)
                cache.keep_rows(keep)
                rows, token, step_mask, ended, kept = (x[keep] for x in (rows, token, step_mask, ended, kept))
            hidden = model(token[:, None], step_mask, cache=cache)[:, -1]
    C = int(length.max()) if N else 0
    keep = torch.arange(C, device=device)[None] < length[:, None]
    return Completions(out[:, :C], keep.long(), ~done)
