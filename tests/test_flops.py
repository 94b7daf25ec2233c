"""Model FLOPs (minitrain.plan.flops) against torch's own FlopCounterMode, and their place in metrics.jsonl."""

from __future__ import annotations

import json

import torch
from torch.utils.flop_counter import FlopCounterMode, mm_flop

from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.config import TrainConfig
from minitrain.data.collate import collate_causal
from minitrain.objectives.sft import sft
from minitrain.plan.flops import FlopCounter, device_peak_flops
from models.llama import LlamaConfig, LlamaForCausalLM

# (self, a, b) -> the FLOPs of a @ b: torch counts `addmm`, not the in-place `addmm_` LoRA uses
ADDMM_ = lambda self_shape, a_shape, b_shape, **kwargs: mm_flop(a_shape, b_shape)  # noqa: E731

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _model(**lora) -> LlamaForCausalLM:
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
    cfg = LoRAConfig(r=4, alpha=8, targets=ALL, **lora)
    apply_lora(m, cfg)
    freeze_for_adapters(m, cfg)
    return m


def test_matmul_flops_equal_torch_flop_counter():
    """Linears (frozen base 4 in out, adapters 6 r (in + out), head on targets only) equal the matmul
    FLOPs torch counts in one forward + backward (trained embeddings, so every input gradient is
    computed, no padding); attention is the formula's 12 W n (n + 1) / 2 (torch does not count CPU SDPA)."""
    m = _model(modules_to_save=("embed_tokens",))
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: ADDMM_}) as fc:
        loss, _, _ = sft(m, batch)
        loss.backward()
    torch_mm = sum(fc.get_flop_counts()["Global"].values())
    counter = FlopCounter.of(m)
    assert counter.attn_width == 2 * 64  # two layers, 4 heads x 16
    attention = 12 * counter.attn_width * 2 * (10 * 11 / 2)
    assert counter.batch(batch) == torch_mm + attention
    # padding and packing: only real tokens count, and a packed row's attention stays in its segments
    padded = dict(batch, attention_mask=torch.tensor([[1] * 10, [1] * 6 + [0] * 4]))
    assert counter.batch(padded) < counter.batch(batch)
    packed = dict(batch, segment_lengths=torch.tensor([[4, 6], [10, 0]]))
    assert counter.batch(batch) - counter.batch(packed) == 12 * counter.attn_width * (55 - 10 - 21)


def test_metrics_rows_carry_flops_per_s_and_no_mfu_on_cpu(tmp_path):
    from minitrain.train import train

    m = _model()
    rows = [{"input_ids": list(range(3, 3 + n)), "labels": [-100] * 2 + list(range(5, 3 + n))} for n in (6, 9, 12, 7)]
    cfg = TrainConfig(out=str(tmp_path / "run"), max_steps=2, batch_size=2, precision="fp32", skip_audit=True)
    train(m, sft, rows, lambda ex: collate_causal(ex, pad_id=0), cfg, log=lambda s: None)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["flops_per_s"] > 0 and "mfu" not in r for r in lines)
    assert device_peak_flops("cpu") is None


def test_moe_flops_count_the_active_experts():
    """A mixture-of-experts model with LoRA on its experts (every token through its top-k experts,
    each expert its own pair) and the router: the count equals torch's matmul FLOPs, as for a dense one."""
    from models.moe import MoeConfig, MoeForCausalLM

    torch.manual_seed(0)
    m = MoeForCausalLM(MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, model_type="qwen3_moe"))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    cfg = LoRAConfig(r=4, alpha=8, targets=ALL, modules_to_save=("embed_tokens",))
    apply_lora(m, cfg)
    freeze_for_adapters(m, cfg)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: ADDMM_}) as fc:
        loss, _, _ = sft(m.train(), batch)
        loss.backward()
    torch_mm = sum(fc.get_flop_counts()["Global"].values())
    counter = FlopCounter.of(m)
    assert counter.batch(batch) == torch_mm + 12 * counter.attn_width * 2 * (10 * 11 / 2)
