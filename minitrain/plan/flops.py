"""Model FLOPs of a training step, for FLOP/s (every device) and MFU (CUDA) in metrics.jsonl.

The count is the usual "model FLOPs" (PaLM, appendix B), adapted to LoRA over a frozen base: the
matmuls the maths needs, not what the hardware ran (no checkpointing recompute, no elementwise
work). Per token, for a linear layer of `in x out`:

- forward `2 in out`; backward `2 in out` for the gradient of its input, plus `2 in out` for the
  gradient of its weight only when the weight trains. A frozen base linear: `4 in out`; a trained
  one: `6 in out`;
- a LoRA adapter of rank r on it (A: `in x r`, B: `r x out`, both trained): `6 r (in + out)`;
- mixture-of-experts: the active parameters, each token's `top_k` experts (a projection of `in x out`
  per expert K times, its per-expert adapter too), the router a linear `D x E`;
- attention, per layer: `2 x 2 x W` per visible (query, key) pair for `QK^T` and `AV` (W = the
  query width, heads x head_dim), times 3 with the backward (q, k and v are all activations).
  Pairs are counted from the batch: a causal row of n real tokens has `n (n + 1) / 2`; a packed
  row counts each of its segments alone;
- the output projection on target positions only (the loss never projects the others): frozen
  `4 D V`, trained `6 D V` per target.

Encoder-decoder models: the linears and the head are counted as above (encoder linears over source
tokens, decoder linears over target tokens are both approximated by all input tokens), attention is
left out. The DPO reference forward (no grad) is not counted either: its MFU is a lower bound.

MFU = model FLOPs / seconds / the device's dense bf16 peak (`PEAK_BF16`, by device name), the
figure vendors quote without sparsity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from minitrain.data.collate import IGNORE_INDEX

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets.
PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("GH200", 989e12),
    ("A100", 312e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("V100", 125e12),  # fp16 (no bf16 on V100)
)


def device_peak_flops(device: torch.device | str) -> float | None:
    """The dense bf16 peak of a CUDA device from its name (`PEAK_BF16`), None when unknown or not CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def _expert_cost(m: nn.Module) -> tuple[float, list[nn.Module]]:
    """Per-token FLOPs of a mixture-of-experts experts module (the active parameters: each token goes
    through `top_k` experts, one row per expert): each 3-D projection of `in x out` per expert counts
    as a linear, K times, and its per-expert adapter (`deltas`) as a LoRA of its rank; -> (FLOPs, the
    adapter modules, counted here)."""
    k = getattr(m, "top_k", 1)
    cost, adapters = 0.0, []
    for p in m.expert_projections:
        w = getattr(m, p)
        fin, fout = (w.shape[1], w.shape[2]) if getattr(m, "in_out", False) else (w.shape[2], w.shape[1])
        cost += k * (6 if w.requires_grad else 4) * fin * fout
        d = m.deltas[p] if p in getattr(m, "deltas", {}) else None
        if d is not None:
            adapters.append(d)
            if not getattr(d, "merged", False) and not getattr(d, "disabled", False):
                cost += k * 6 * d.r * (fin + fout)
    return cost, adapters


@dataclass
class FlopCounter:
    """Per-token FLOPs of a model's parts, read once from its modules (see the module docstring)."""

    body_per_token: float  # linears (frozen or trained) + adapters, per input token
    head_per_target: float  # the output projection, per target token
    attn_width: int  # sum over attention layers of the query width (heads x head_dim)
    causal: bool

    @classmethod
    def of(cls, model: nn.Module) -> "FlopCounter":
        head = getattr(model, "output_projection", None)
        body = head_cost = 0.0
        width = 0
        inner = set()  # the adapters' own A / B linears, counted with their LoRA layer
        for name, m in model.named_modules():
            if id(m) in inner:
                continue
            if hasattr(m, "expert_projections"):  # MoE experts: each token's K rows, their adapters with them
                cost, adapters = _expert_cost(m)
                body += cost
                inner.update(id(x) for d in adapters for x in d.modules())
                continue
            a, b = getattr(m, "lora_A", None), getattr(m, "lora_B", None)
            fin, fout = getattr(m, "in_features", None), getattr(m, "out_features", None)
            if not (isinstance(fin, int) and isinstance(fout, int)):
                continue
            w = getattr(m, "weight", None)
            trained = isinstance(w, torch.Tensor) and w.requires_grad
            cost = (6 if trained else 4) * fin * fout
            if isinstance(a, nn.Module) and isinstance(b, nn.Module):
                inner.update({id(a), id(b)})
                r = getattr(m, "r", None) or a.weight.shape[0]
                if not getattr(m, "merged", False):
                    cost += 6 * r * (fin + fout)
            if m is head:
                head_cost = cost
            else:
                body += cost
            if name.endswith(("q_proj", ".q")) and "EncDecAttention" not in name:
                width += fout
        causal = not getattr(model, "is_encoder_decoder", False)
        return cls(body, head_cost, width if causal else 0, causal)

    def batch(self, batch: dict[str, Any]) -> float:
        """Model FLOPs of one forward + backward over `batch` (the collated CPU tensors)."""
        mask = batch.get("attention_mask")
        ids = batch.get("input_ids")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            lengths = mask.sum(1).double()
        elif isinstance(ids, torch.Tensor):
            lengths = torch.full((ids.shape[0],), float(ids.shape[-1]), dtype=torch.float64)
        else:
            return 0.0
        tokens = float(lengths.sum())
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor):  # causal: position 0 is never a target (labels shift left)
            targets = float(((labels[:, 1:] if self.causal else labels) != IGNORE_INDEX).sum())
        else:
            targets = tokens
        seg = batch.get("segment_lengths")  # packed rows: attention stays inside each segment
        if isinstance(seg, torch.Tensor):
            lengths = seg[seg > 0].double()
        pairs = float((lengths * (lengths + 1) / 2).sum())
        return self.body_per_token * tokens + self.head_per_target * targets + 12.0 * self.attn_width * pairs
