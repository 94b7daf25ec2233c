"""Sample packing (minitrain.packing): packed == unpacked for SFT, and a packed run resumes exactly."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import models
from minitrain.data import collate_causal
from minitrain.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.objectives import sft
from minitrain.packing import collate_packed_causal, pack
from minitrain.weights import load_pretrained

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def examples(n: int, seed: int = 0) -> list[dict]:
    """Lengths 3-40 (a realistic spread: many short, a few long), prompts labelled -100; some rows
    without a prompt (`{"text"}` rows: every label but the first a target)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.choice([3, 5, 8, 12, rng.randint(20, 40)])
        ids = [1] + [rng.randrange(3, 128) for _ in range(length - 1)]
        p = 0 if i % 4 == 0 else rng.randint(1, length - 2)
        out.append({"input_ids": ids, "labels": [-100] * p + ids[p:]})
    return out


def test_first_fit_decreasing():
    assert pack([5, 3, 8, 2, 6], 10) == [[2, 3], [4, 1], [0]]
    assert pack([12, 3], 10) == [[0], [1]]  # a row longer than max_len gets a row of its own


@pytest.fixture(params=["llama", "mistral-window"])
def policy(request, hf_causal):
    kw = {"model_type": "mistral", "sliding_window": 6} if request.param == "mistral-window" else {}
    model = load_pretrained(hf_causal(f"pack_{request.param}", **kw), models.from_hf_config)
    cfg = LoRAConfig(r=4, alpha=8, targets=ALL)
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.train()


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss, count, _ = sft(model, batch)
    loss.backward()
    return loss.detach(), int(count), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_packed_equals_unpacked(policy):
    """Loss sum, target count and every adapter gradient of one micro-batch: packed into rows of 48
    tokens equal the padded batch to 1e-5 (fp32), with a sliding window shorter than the rows."""
    ex = examples(12)
    padded, packed = collate_causal(ex, pad_id=0), collate_packed_causal(ex, pad_id=0, max_len=48)
    assert packed["input_ids"].numel() < padded["input_ids"].numel()
    assert int(packed["attention_mask"].sum()) == int(padded["attention_mask"].sum())
    l0, n0, g0 = _loss_and_grads(policy, padded)
    l1, n1, g1 = _loss_and_grads(policy, packed)
    assert n1 == n0
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-6)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-5, rtol=1e-4)


def test_packed_run_resumes_bitwise(tmp_path):
    """A packed run killed mid-way (checkpoint at step 2) and resumed ends bitwise equal to the
    uninterrupted run: the packing is a pure function of the Batcher's micro-batch."""
    from test_resume import Killed, killing
    from test_train import cfg_for, quiet

    from minitrain.train import train
    from models.llama import LlamaConfig, LlamaForCausalLM

    def fresh():
        torch.manual_seed(3)
        m = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=2))
        cfg = LoRAConfig(r=2, alpha=4, targets=["q_proj", "v_proj"], dropout=0.1)
        apply_lora(m, cfg)
        freeze_for_adapters(m, cfg)
        return m

    ex = examples(24, seed=3)

    def collate(b):
        return collate_packed_causal(b, pad_id=0, max_len=40)

    kw = dict(batch_size=4, grad_accum=1, max_steps=5, save_every=2, lr=5e-3, skip_audit=True)
    straight = fresh()
    train(straight, sft, ex, collate, cfg_for(tmp_path / "a", **kw), log=quiet)
    cfg = cfg_for(tmp_path / "b", **kw)
    with pytest.raises(Killed):
        train(fresh(), killing(sft, 3), ex, collate, cfg, log=quiet)
    resumed = fresh()
    train(resumed, sft, ex, collate, dataclasses.replace(cfg, resume=True), log=quiet)
    for (k, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k
