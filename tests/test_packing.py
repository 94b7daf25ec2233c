"""Sample packing (minitrain.data.packing): packed == unpacked for SFT, and a packed run resumes exactly."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import models
from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.data.collate import collate_causal
from minitrain.data.packing import collate_packed_causal, first_fit_decreasing, pack
from minitrain.objectives.sft import sft
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
    assert first_fit_decreasing([(5,), (3,), (8,), (2,), (6,)], (10,)) == [[2, 3], [4, 1], [0]]
    assert first_fit_decreasing([(12,), (3,)], (10,)) == [[0], [1]]  # longer than max_len: a row of its own
    assert first_fit_decreasing([(4, 1), (3, 5), (2, 2)], (7, 6)) == [[0, 1], [2]]  # every part must fit


def positions(lengths, rows):
    return len(rows) * max(sum(lengths[i] for i in row) for row in rows)


def test_rows_never_take_more_positions_than_padding():
    """Rows as long as the fewest positions need: similar lengths are not filled up to max_len."""
    assert pack([5, 3, 8, 2, 6], 10) == [[2], [4, 3], [0, 1]]  # 3 x 8 = 24 positions (rows of 10: 30)
    similar = [100, 110, 105, 98]
    assert pack(similar, 384) == [[1, 3], [2, 0]]  # 2 x 208 positions < 4 x 110; not 313 + 98 -> 2 x 313
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 9))]
        rows = pack(lengths, 64)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert max(sum(lengths[i] for i in row) for row in rows) <= 64
        assert positions(lengths, rows) <= len(lengths) * max(lengths)
    assert pack([(4, 1), (3, 5), (2, 2)], (7, 6)) == [[0, 2], [1]]  # 2 x (6 + 5) positions, not 2 x (7 + 6)


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


def grads(model, objective, batch):
    """(loss, count, metrics, adapter gradients) of one micro-batch."""
    model.zero_grad(set_to_none=True)
    loss, count, metrics = objective(model, batch)
    loss.backward()
    return (loss.detach(), int(count), metrics,
            {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})


def assert_same(got, want):
    """Loss to 1e-5, the same count, metrics to 1e-5 and every gradient to 1e-5 (fp32)."""
    assert got[1] == want[1]
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-6)
    assert got[2].keys() == want[2].keys()
    for k in want[2]:
        assert got[2][k] == pytest.approx(want[2][k], abs=1e-5), k
    for k in want[3]:
        torch.testing.assert_close(got[3][k], want[3][k], atol=1e-5, rtol=1e-4)


def resumes_bitwise(tmp_path, fresh, objective, examples, collate, batch_size=4):
    """A run killed mid-way (checkpoint at step 2) and resumed ends bitwise equal to the straight run."""
    from test_resume import Killed, killing
    from test_train import cfg_for, quiet

    from minitrain.train import train

    kw = dict(batch_size=batch_size, grad_accum=1, max_steps=5, save_every=2, lr=5e-3, skip_audit=True)
    straight = fresh()
    train(straight, objective, examples, collate, cfg_for(tmp_path / "a", **kw), log=quiet)
    cfg = cfg_for(tmp_path / "b", **kw)
    with pytest.raises(Killed):
        train(fresh(), killing(objective, 3), examples, collate, cfg, log=quiet)
    resumed = fresh()
    train(resumed, objective, examples, collate, dataclasses.replace(cfg, resume=True), log=quiet)
    for (k, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k


def tiny_lora(seed: int = 3):
    from models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=2))
    cfg = LoRAConfig(r=2, alpha=4, targets=["q_proj", "v_proj"], dropout=0.1)
    apply_lora(m, cfg)
    freeze_for_adapters(m, cfg)
    return m


def test_packed_equals_unpacked(policy):
    """Loss sum, target count and every adapter gradient of one micro-batch: packed into rows of 48
    tokens equal the padded batch to 1e-5 (fp32), with a sliding window shorter than the rows."""
    ex = examples(12)
    padded, packed = collate_causal(ex, pad_id=0), collate_packed_causal(ex, pad_id=0, max_len=48)
    assert packed["input_ids"].numel() < padded["input_ids"].numel()
    assert int(packed["attention_mask"].sum()) == int(padded["attention_mask"].sum())
    assert_same(grads(policy, sft, packed), grads(policy, sft, padded))


def test_packed_run_resumes_bitwise(tmp_path):
    """A packed run killed mid-way and resumed ends bitwise equal to the uninterrupted run: the
    packing is a pure function of the Batcher's micro-batch."""
    resumes_bitwise(tmp_path, tiny_lora, sft, examples(24, seed=3),
                    lambda b: collate_packed_causal(b, pad_id=0, max_len=40))


# ----------------------------------------------------------------------------- preference pairs


def _pair_objective(loss: str, reference=None):
    from minitrain.objectives.dpo import make_dpo_objective
    from minitrain.objectives.preference import ReferenceFreeObjective
    from minitrain.objectives.reference import BaseReference

    if loss == "sigmoid":
        return make_dpo_objective(0.1, "sigmoid", 0.0, 0.5, reference or BaseReference())
    return ReferenceFreeObjective(loss, 0.1, 0.0 if loss == "simpo" else 1.0, 0.5)


@pytest.mark.parametrize("loss", ["sigmoid", "orpo", "simpo", "cpo"])
def test_packed_pairs_equal_unpacked(policy, loss):
    """DPO (reference = adapters off, with an sft term), ORPO, SimPO and CPO on pairs packed into rows
    of 48 tokens: loss sum, pair count, every metric and every adapter gradient equal the padded
    `[chosen; rejected]` batch to 1e-5 (fp32), with a sliding window shorter than the rows."""
    from minitrain.data.collate import collate_preference
    from minitrain.data.packing import collate_packed_pairs
    from test_shared_prompt import pairs

    ex = pairs(9)
    padded, packed = collate_preference(ex, pad_id=0), collate_packed_pairs(ex, pad_id=0, max_len=48)
    assert packed["input_ids"].numel() < padded["input_ids"].numel() and packed["input_ids"].shape[0] < 2 * len(ex)
    want = grads(policy, _pair_objective(loss), padded)
    assert want[1] == len(ex)
    assert_same(grads(policy, _pair_objective(loss), packed), want)


def test_packed_pairs_keep_every_reference_mode(policy):
    """The reference forward in the packed layout: adapters disabled, the Stage A snapshot (swapped in),
    and the precomputed cache (batched through the packed collator, read back by it) give the padded
    batch's log-probs to 1e-5; the snapshot's swap leaves the training values in place."""
    from minitrain.objectives.dpo import collate_with_reference
    from minitrain.objectives.reference import AdapterSnapshotReference, BaseReference, compute_reference_logps
    from test_shared_prompt import pairs

    ex = pairs(7, seed=1)
    padded, packed = collate_with_reference(ex, 0), collate_with_reference(ex, 0, pack_len=40)
    snapshot = AdapterSnapshotReference(policy)
    with torch.no_grad():  # the policy moves: the snapshot is no longer the live adapter
        for n, p in policy.named_parameters():
            if "lora_A" in n:
                p.mul_(1.5)
    live = {n: p.clone() for n, p in policy.named_parameters() if p.requires_grad}
    for reference in (BaseReference(), snapshot):
        for a, b in zip(reference.logps(policy, padded), reference.logps(policy, packed)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for n, p in policy.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, live[n]), n
    cached = [compute_reference_logps(policy, snapshot, ex, collate, 3)
              for collate in (lambda b: collate_with_reference(b, 0), lambda b: collate_with_reference(b, 0, pack_len=40))]
    for a, b in zip(*cached):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for e, c, r in zip(ex, *cached[1]):
        e["ref_chosen_logp"], e["ref_rejected_logp"] = float(c), float(r)
    objective = _pair_objective("sigmoid", snapshot)
    assert_same(grads(policy, objective, collate_with_reference(ex, 0, pack_len=40)),
                grads(policy, objective, collate_with_reference(ex, 0)))


@pytest.mark.parametrize("loss", ["sigmoid", "orpo"])
def test_packed_pairs_run_resumes_bitwise(tmp_path, loss):
    """A packed DPO / ORPO run killed mid-way and resumed ends bitwise equal to the straight run."""
    from minitrain.objectives.dpo import collate_with_reference
    from test_shared_prompt import pairs

    resumes_bitwise(tmp_path, tiny_lora, _pair_objective(loss), pairs(16, seed=4),
                    lambda b: collate_with_reference(b, pad_id=0, pack_len=48), batch_size=3)


def test_pair_layouts_that_do_not_combine_are_one_line():
    from minitrain.config import validate
    from minitrain.errors import UserError
    from minitrain.objectives.preference import PreferenceConfig

    for loss in ("sigmoid", "orpo"):
        with pytest.raises(UserError, match=r"^packing=true: does not combine with shared_prompt=true — "):
            validate(PreferenceConfig(loss_type=loss, packing=True, shared_prompt=True))
    with pytest.raises(UserError, match=r"^shared_prompt=true: loss_type=simpo is scored on \[chosen; rejected\] "):
        validate(PreferenceConfig(loss_type="simpo", shared_prompt=True))
    validate(PreferenceConfig(loss_type="orpo", packing=True))


# ----------------------------------------------------------------------------- seq2seq (T5)


def s2s_examples(n: int, seed: int = 0) -> list[dict]:
    """Encoder rows of 2-30 tokens, targets of 1-12 ending in eos (1), some with -100 inside."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        src = [rng.randrange(3, 96) for _ in range(rng.choice([2, 4, 9, rng.randint(12, 30)]))] + [1]
        tgt = [rng.randrange(3, 96) for _ in range(rng.randint(0, 11))] + [1]
        if i % 3 == 0 and len(tgt) > 3:
            tgt[1] = -100
        out.append({"input_ids": src, "labels": tgt})
    return out


def tiny_t5(seed: int = 0, dropout: float = 0.0, gated: bool = True):
    from models.t5 import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    m = T5ForConditionalGeneration(T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=12, dropout_rate=dropout, feed_forward_proj="gated-gelu" if gated else "relu",
        tie_word_embeddings=not gated))
    with torch.no_grad():  # a visible position table: each bucket its own bias
        for stack in (m.encoder, m.decoder):
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 1.0)
    cfg = LoRAConfig(r=2, alpha=4, targets=["q", "k", "v", "o", "wi_0" if gated else "wi"], dropout=dropout)
    apply_lora(m, cfg)
    freeze_for_adapters(m, cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return m.train()


@pytest.mark.parametrize("gated", [True, False])
def test_packed_seq2seq_equals_unpacked(gated):
    """T5 (v1.1 gated and v1.0 tied-and-scaled) on encoder rows packed up to 40 tokens and decoder
    rows up to 16: loss sum, count and every adapter gradient equal the padded batch to 1e-5 (fp32),
    with segments longer than the position table's exact range (its log buckets) and a table whose
    every bucket differs."""
    from minitrain.data.collate import collate_seq2seq
    from minitrain.data.packing import collate_packed_seq2seq
    from minitrain.objectives.sft import seq2seq

    model = tiny_t5(gated=gated)
    ex = s2s_examples(10)
    padded = collate_seq2seq(ex, pad_id=0, decoder_start_id=0)
    packed = collate_packed_seq2seq(ex, pad_id=0, max_len=40, max_target_len=16, decoder_start_id=0)
    assert packed["input_ids"].shape[0] < len(ex) and packed["input_ids"].shape[1] <= 40
    assert packed["labels"].shape[1] <= 16
    assert int(packed["attention_mask"].sum()) == int(padded["attention_mask"].sum())
    assert_same(grads(model, seq2seq, packed), grads(model, seq2seq, padded))


def test_packed_seq2seq_masks():
    """Two examples in one row: the encoder sees its own segment both ways, the decoder its own
    causally, cross-attention its own encoder segment; targets shift per example."""
    from minitrain.data.packing import collate_packed_seq2seq

    ex = [{"input_ids": [5, 6, 1], "labels": [7, 8, 1]}, {"input_ids": [9, 1], "labels": [10, 1]}]
    b = collate_packed_seq2seq(ex, pad_id=0, max_len=8, max_target_len=8)
    assert b["input_ids"].tolist() == [[5, 6, 1, 9, 1]]
    assert b["decoder_input_ids"].tolist() == [[0, 7, 8, 0, 10]] and b["labels"].tolist() == [[7, 8, 1, 10, 1]]
    assert b["block_mask"][0, 0].int().tolist()[1] == [1, 1, 1, 0, 0]
    assert b["decoder_block_mask"][0, 0].int().tolist()[4] == [0, 0, 0, 1, 1]
    assert b["cross_block_mask"][0, 0].int().tolist()[3] == [0, 0, 0, 1, 1]


def test_packed_seq2seq_run_resumes_bitwise(tmp_path):
    """A packed T5 run with dropout, killed mid-way and resumed, ends bitwise equal to the straight run."""
    from minitrain.data.packing import collate_packed_seq2seq
    from minitrain.objectives.sft import seq2seq

    resumes_bitwise(tmp_path, lambda: tiny_t5(3, dropout=0.1), seq2seq, s2s_examples(20, seed=2),
                    lambda b: collate_packed_seq2seq(b, pad_id=0, max_len=40, max_target_len=16))


# ----------------------------------------------------------------------------- the recipes


def test_recipes_pack_when_asked(tmp_path, capsys):
    """`packing=true` reaches the collators of recipes/dpo_mistral.py (the demo's pairs) and
    recipes/lora_t5.py (a tiny T5); with shared_prompt=true the DPO recipe stops in one line, exit 2."""
    from pathlib import Path

    from minitrain.cli import load_recipe, resolve_config, run_cli
    from minitrain.config import validate
    from test_lora_t5 import save_tiny_t5, write_rows

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    dpo = load_recipe(str(recipes / "dpo_mistral.py"))
    cfg = resolve_config(dpo, ["packing=true", "max_len=96", f"out={tmp_path / 'dpo'}"])[0]
    validate(cfg)
    job = dpo.module.setup(cfg)
    batch = job.collate(job.train_examples[:8])
    assert batch["num_pairs"] == 8 and batch["input_ids"].shape[0] < 16 and batch["input_ids"].shape[1] <= 96
    assert batch["sequence_ids"].max() == 15

    capsys.readouterr()
    assert run_cli([str(recipes / "dpo_mistral.py"), "packing=true", "shared_prompt=true",
                    f"out={tmp_path / 'no'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: packing=true: does not combine with shared_prompt=true — use shared_prompt for long "
                   "prompts, packing for short pairs of varied length"]

    model = save_tiny_t5(tmp_path / "t5")
    rows = write_rows(tmp_path / "rows.jsonl", [f"line {i} " + "word " * (i % 7) for i in range(8)])
    t5 = load_recipe(str(recipes / "lora_t5.py"))
    cfg = resolve_config(t5, [f"model={model}", f"data={rows}", "packing=true", "max_len=64", "max_target_len=32",
                              'fields={"prompt": "question", "completion": "answer"}', f"out={tmp_path / 't5o'}"])[0]
    validate(cfg)
    job = t5.module.setup(cfg)
    batch = job.collate(job.train_examples)
    (B, S), T = batch["input_ids"].shape, batch["labels"].shape[1]
    assert B < 8 and S <= 64 and T <= 32 and batch["cross_block_mask"].shape == (B, 1, T, S)
