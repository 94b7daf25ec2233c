"""DPO with the prompt computed once (`collate_shared_prompt`) against the two-sequence form."""

from __future__ import annotations

import random

import pytest
import torch

import models
from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.data.collate import collate_preference
from minitrain.objectives.dpo import collate_shared_prompt, make_dpo_objective
from minitrain.objectives.reference import BaseReference, sequence_logps
from minitrain.weights import load_pretrained
from models.layers import document_mask

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def pairs(n: int, seed: int = 0) -> list[dict]:
    """Pairs with prompts of 1-30 tokens, answers of 1-12 that sometimes start alike, and -100 inside
    some answers (chat templates leave non-assistant tokens in them)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [1] + [rng.randrange(3, 128) for _ in range(rng.randint(0, 29))]
        common = [rng.randrange(3, 128) for _ in range(rng.choice([0, 0, 2]))]
        ex = {}
        for name in ("chosen", "rejected"):
            a = common + [rng.randrange(3, 128) for _ in range(rng.randint(1, 12))]
            lab = list(a)
            if i % 3 == 0 and len(a) > 3:
                lab[1] = -100
            ex[f"{name}_ids"], ex[f"{name}_labels"] = p + a, [-100] * len(p) + lab
        out.append(ex)
    out.append({"chosen_ids": [1, 5, 6], "chosen_labels": [-100, 5, 6],  # identical answers
                "rejected_ids": [1, 5, 6], "rejected_labels": [-100, 5, 6]})
    return out


@pytest.fixture(params=["llama", "mistral-window"])
def policy(request, hf_causal):
    kw = {"model_type": "mistral", "sliding_window": 8} if request.param == "mistral-window" else {}
    model = load_pretrained(hf_causal(f"shared_{request.param}", **kw), models.from_hf_config)
    cfg = LoRAConfig(r=4, alpha=8, targets=ALL)
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.train()


def _grads(model, objective, batch):
    model.zero_grad(set_to_none=True)
    loss, count, metrics = objective(model, batch)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_shared_prompt_equals_two_sequences(policy):
    """Sequence log-probs, token counts, the DPO loss (reference = adapters off, sft term on), its
    metrics and every adapter gradient equal the [chosen; rejected] form to 1e-5 in fp32, with a
    sliding window shorter than the rows, shared answer starts and -100 inside answers."""
    ex = pairs(7)
    two, one = collate_preference(ex, pad_id=0), collate_shared_prompt(ex, pad_id=0)
    assert one["input_ids"].shape[0] == len(ex) and one["input_ids"].shape[1] < two["input_ids"].shape[1] * 2
    with torch.no_grad():
        a, b = sequence_logps(policy, two), sequence_logps(policy, one)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
    objective = make_dpo_objective(0.1, "sigmoid", 0.0, 0.5, BaseReference())
    l2, m2, g2 = _grads(policy, objective, two)
    l1, m1, g1 = _grads(policy, objective, one)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)
    for k in m2:
        assert m1[k] == pytest.approx(m2[k], abs=1e-5)
    for n in g2:
        torch.testing.assert_close(g1[n], g2[n], atol=1e-5, rtol=1e-4)


def test_rejected_tokens_never_see_the_chosen_ones():
    """The mask: causal, rejected rows blind to chosen columns, padding keys hidden but to themselves;
    rejected positions continue from the prefix."""
    ex = {"chosen_ids": [1, 7, 8, 9], "chosen_labels": [-100, 7, 8, 9],
          "rejected_ids": [1, 7, 5], "rejected_labels": [-100, 7, 5]}
    short = {"chosen_ids": [1, 4], "chosen_labels": [-100, 4], "rejected_ids": [1, 3], "rejected_labels": [-100, 3]}
    b = collate_shared_prompt([ex, short], pad_id=0)
    # prefix [1, 7] (ids and labels equal), chosen rest [8, 9], rejected rest [5]
    assert b["input_ids"][0].tolist() == [1, 7, 8, 9, 5]
    assert b["position_ids"][0].tolist() == [0, 1, 2, 3, 2]
    assert b["chosen_targets"][0].tolist() == [7, 8, 9, -100, -100]
    assert b["rejected_targets"][0].tolist() == [7, 5, -100, -100, -100]
    assert b["document_ids"].tolist() == [[0, 0, 1, 1, 2], [0, 1, 2, -1, -1]]
    masks = document_mask(b["document_ids"], b["position_ids"], None)  # the model's mask of these ids
    m = masks[0, 0].int().tolist()
    assert m[4] == [1, 1, 0, 0, 1]  # the rejected token sees the prefix and itself only
    assert m[3] == [1, 1, 1, 1, 0]
    pad = masks[1, 0].int().tolist()
    assert b["attention_mask"][1].tolist() == [1, 1, 1, 0, 0] and pad[2] == [1, 0, 1, 0, 0] and pad[4] == [0, 0, 0, 0, 1]


def _rows(layouts: list[list[tuple[int, int]]], g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Rows from (document id, length) runs (-1 padding): ids, positions (a document with the row's
    prefix (0) continuing its positions, every other run from 0) and document ids."""
    T = max(sum(n for _, n in row) for row in layouts)
    ids, pos, docs = [], [], []
    for row in layouts:
        p, d, prefix = [], [], 0
        for doc, n in row + [(-1, T - sum(n for _, n in row))]:
            start = prefix if doc > 0 else 0
            p += list(range(start, start + n))
            d += [doc] * n
            prefix = n if doc == 0 else prefix
        ids.append(torch.randint(3, 100, (T,), generator=g))
        pos.append(p)
        docs.append(d)
    return torch.stack(ids), torch.tensor(pos), torch.tensor(docs)


SEVERAL = ["llama", "mistral-window", "gemma2", "phi3_partial_window", "qwen3_moe", "gpt_oss"]


@pytest.mark.parametrize("family", SEVERAL)
def test_rows_of_several_sequences_run_each_sequence_alone_on_a_cpu(hf_causal, family):
    """Rows of several sequences (DPO's and the reward model's [prompt, chosen, rejected], packed rows,
    GRPO's [prompt, completions], with padding at either end) run on a CPU through the per-sequence loop
    (`models.layers.document_runs`: no (T, T) mask; each sequence after its prefix): the hidden states,
    the hidden states read at some positions (`read_at` (B, K): the reward model's two scores a row)
    and every gradient equal the dense-mask forward's (`unpadded = False`). Windows (shorter than the
    sequences), soft caps, partial rotary, experts and gpt-oss's sinks included."""
    from test_families import FAMILY_VARIANTS
    from test_moe import MOE_VARIANTS

    if family in ("llama", "mistral-window"):
        kw = {"model_type": "mistral", "sliding_window": 8} if family == "mistral-window" else {}
        folder = hf_causal(f"shared_{family}", **kw)
    elif family in FAMILY_VARIANTS:
        folder = hf_causal(f"fam_{family}", **FAMILY_VARIANTS[family])
    else:
        folder = hf_causal(f"moe_{family}", **MOE_VARIANTS[family])
    model = load_pretrained(folder, models.from_hf_config).train()
    for p in model.parameters():
        p.requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    layouts = [[(0, 40), (1, 32), (2, 30)], [(-1, 3), (0, 35), (1, 40), (2, 24), (-1, 2)],
               [(1, 33), (2, 37), (3, 36)], [(0, 40), (1, 30), (2, 35), (3, 33)]]  # 32+ tokens a sequence
    ids, pos, docs = _rows(layouts, g)
    body = model.model
    assert body.document_layout(docs, pos).prefixes == (-1, 0, 0, -1, 3, 3, -1, -1, -1, -1, 9, 9, 9)
    reads = torch.tensor([[71, 101], [77, 101], [32, 105], [69, 137]])  # a real position or two of each row
    weights = torch.randn(ids.shape + (model.config.hidden_size,), generator=g)

    def run(unpadded: bool):
        body.unpadded = unpadded
        model.zero_grad(set_to_none=True)
        hidden = model(ids, position_ids=pos, document_ids=docs)
        read = model(ids, position_ids=pos, document_ids=docs, read_at=reads)  # (B, 2, D)
        ((hidden * weights * (docs >= 0)[..., None]).sum() + read.square().sum()).backward()
        return hidden.detach(), read.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                if p.grad is not None}

    try:
        runs, dense = run(True), run(False)
    finally:
        body.unpadded = True
    real = (docs >= 0)[..., None]
    torch.testing.assert_close(runs[0] * real, dense[0] * real, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runs[1], dense[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runs[1], dense[0][torch.arange(4)[:, None], reads], atol=1e-5, rtol=1e-5)
    assert set(runs[2]) == set(dense[2])
    for n, grad in dense[2].items():
        torch.testing.assert_close(runs[2][n], grad, atol=1e-5 * max(1.0, float(grad.abs().max())), rtol=1e-5, msg=n)
