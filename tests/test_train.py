"""The training loop against references: a full-batch run, torch.optim.AdamW in a hand loop,
closed-form schedules, F.cross_entropy; plus checkpointing with frozen embeddings and
non-finite step skipping.

`TinyLM` is a small causal LM satisfying the model contract (HF module names, forward ->
hidden, `output_projection`, `block_types`); `test_resume.py` imports it from here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.config import TrainConfig
from minitrain.data.batcher import Batcher
from minitrain.data.collate import collate_causal
from minitrain.errors import UserError
from minitrain.objectives.sft import sft
from minitrain.train import cpu_compiler, enable_checkpointing, train

VOCAB = 48


# ----------------------------------------------------------------------------- a tiny causal LM


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = (p(x).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(d)
        self.self_attn = Attention(d, heads)
        self.post_attention_layernorm = nn.LayerNorm(d)
        self.mlp = nn.Sequential()
        self.mlp.add_module("up_proj", nn.Linear(d, 2 * d))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("down_proj", nn.Linear(2 * d, d))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), mask))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class TinyLM(nn.Module):
    """Embedding -> blocks -> norm -> hidden; `lm_head` is the output projection."""

    block_types = (Block,)
    is_encoder_decoder = False

    def __init__(self, vocab: int = VOCAB, d: int = 16, layers: int = 2, heads: int = 2, dropout: float = 0.0, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.model.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():  # non-trivial norms so every tensor matters
            for n, p in self.named_parameters():
                if "norm" in n:
                    p.add_(0.2 * torch.randn_like(p))

    @property
    def output_projection(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        keys = torch.ones(B, T, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask = (causal[None] & keys[:, None, :])[:, None]  # (B, 1, T, T)
        x = self.model.embed_tokens(input_ids)  # (B, T, D)
        for block in self.model.layers:
            x = block(x, mask)
        return self.model.norm(x)


def make_examples(n: int, seed: int = 0, lo: int = 3, hi: int = 24) -> list[dict]:
    """Variable-length SFT examples: a prompt (label -100) and a completion of very uneven length."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(1, 6), rng.choice([1, 2, rng.randint(lo, hi)])
        ids = [rng.randrange(3, VOCAB) for _ in range(p + c)]
        out.append({"input_ids": ids, "labels": [-100] * p + ids[p:]})
    return out


def collate(examples):
    return collate_causal(examples, pad_id=0)


def cfg_for(tmp_path: Path, **kw) -> TrainConfig:
    # group_by_length off: length grouping forms batches of a given size from similar lengths, so
    # batch 8 and batch 2 x accum 4 would see other examples per step; the order stays seeded
    base = dict(out=str(tmp_path / "run"), lr=1e-2, warmup=0.0, schedule="constant", precision="fp32",
                max_grad_norm=0.0, batch_size=8, grad_accum=1, epochs=1.0, group_by_length=False)
    return TrainConfig(**{**base, **kw})


def freeze_embeddings(model: nn.Module) -> nn.Module:
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| / |b| over tensors (norms), the measure the accumulation test bounds."""
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b)


def quiet(_msg: str) -> None:
    pass


# ----------------------------------------------------------------------------- (a) accumulation


def naive_mean(model, batch):
    """A per-micro-batch mean (what many loops do): the loop then averages means over the window."""
    loss_sum, count, m = sft(model, batch)
    return loss_sum / count, torch.tensor(1), m


def _run(tmp_path, name, objective, examples, **kw):
    """3 steps of LoRA (minitrain.adapters.lora) on TinyLM; returns the adapter weights.

    SGD, not AdamW: Adam's first steps divide each gradient entry by its own magnitude, so an
    entry of ~3e-7 (a cancellation whose fp32 rounding differs between batchings by ~1e-3 of
    it) moves the update by ~1e-5 relative: measured, and the same in a naive vs our 8x1 run.
    SGD keeps the weights linear in the gradients, which is what rule 2 is about; the AdamW
    path is compared with torch's separately below.
    """
    model = TinyLM()
    lcfg = LoRAConfig(r=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    apply_lora(model, lcfg)
    freeze_for_adapters(model, lcfg)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    train(model, objective, examples, collate, cfg_for(tmp_path / name, max_steps=3, **kw), optimizer=opt, log=quiet)
    return trainable_state(model)


def test_batch8_accum1_equals_batch2_accum4_and_mean_of_means_does_not(tmp_path):
    examples = make_examples(24, seed=1)
    counts = [sum(t != -100 for t in ex["labels"][1:]) for ex in examples[:8]]
    assert max(counts) >= 5 * max(1, min(counts))  # the targets per example differ a lot

    full = _run(tmp_path, "b8", sft, examples, batch_size=8, grad_accum=1)
    accum = _run(tmp_path, "b2x4", sft, examples, batch_size=2, grad_accum=4)
    assert len(full) == 24 and all(v.abs().sum() > 0 for v in full.values())  # every A and B moved
    assert max_rel_diff(accum, full) <= 1e-6

    # the same comparison with per-micro-batch means: the data makes the difference visible
    naive_full = _run(tmp_path, "n8", naive_mean, examples, batch_size=8, grad_accum=1)
    naive_accum = _run(tmp_path, "n2x4", naive_mean, examples, batch_size=2, grad_accum=4)
    assert max_rel_diff(naive_full, full) <= 1e-6  # one micro-batch: its mean is the token mean
    assert max_rel_diff(naive_accum, naive_full) > 1e-2


# ----------------------------------------------------------------------------- (b) schedule


def test_lr_per_step_from_metrics_is_the_closed_form_under_accumulation(tmp_path):
    # 100 examples, batch 4 -> 25 micro-batches per epoch; accum 5 -> 5 steps per epoch; 2 epochs
    msgs: list[str] = []
    cfg = cfg_for(tmp_path, batch_size=4, grad_accum=5, epochs=2.0, warmup=0.2, schedule="cosine",
                  lr=3e-3, min_lr_ratio=0.1)
    model = freeze_embeddings(TinyLM(d=8, layers=1))
    summary = train(model, sft, make_examples(100, seed=2, hi=8), collate, cfg, log=msgs.append)
    assert "optimizer steps: 10" in msgs[0] and "warmup steps: 2" in msgs[0] and "grad_accum: 5" in msgs[0]
    assert "micro-batches/epoch: 25" in msgs[0] and "examples: 100" in msgs[0]
    assert summary["total_steps"] == 10 and summary["warmup_steps"] == 2
    got = rows(Path(cfg.out))
    assert [r["step"] for r in got] == list(range(1, 11))
    peak, lo, W, N = 3e-3, 3e-4, 2, 10
    for r in got:
        s = r["step"]
        want = peak * s / W if s <= W else lo + (peak - lo) * 0.5 * (1 + math.cos(math.pi * (s - W - 1) / (N - W)))
        assert r["lr"] == pytest.approx(want, rel=1e-12)
    for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_mem_mb"):
        assert all(math.isfinite(r[key]) for r in got), key


# ----------------------------------------------------------------------------- (c) AdamW path


def test_loop_equals_hand_loop_with_torch_adamw_and_full_logits(tmp_path):
    examples = make_examples(24, seed=3)
    cfg = cfg_for(tmp_path, batch_size=3, grad_accum=2, max_steps=4, lr=2e-2, weight_decay=0.1,
                  max_grad_norm=0.5, warmup=2, schedule="linear", min_lr_ratio=0.0)
    model = freeze_embeddings(TinyLM(seed=5))
    train(model, sft, examples, collate, cfg, log=quiet)
    got = rows(Path(cfg.out))

    # reference: same init, same data order, mean token CE over the window on full logits,
    # torch.optim.AdamW with decay on matrices only, clip, LR from the closed form
    ref = freeze_embeddings(TinyLM(seed=5))
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=2e-2)
    order = iter(Batcher([len(e["input_ids"]) for e in examples], 3, seed=cfg.seed, shuffle=True,
                         group_by_length=False))
    norms = []
    for step in range(1, 5):
        batches = [collate([examples[i] for i in next(order)]) for _ in range(2)]
        total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        for b in batches:
            logits = ref.lm_head(ref(b["input_ids"], b["attention_mask"]))[:, :-1]  # (B, T-1, V)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1), reduction="sum")
            (loss / total).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in named], 0.5)))
        for g in opt.param_groups:
            g["lr"] = 2e-2 * step / 2 if step <= 2 else 2e-2 * (1 - (step - 3) / 2)
        opt.step()
        opt.zero_grad()
    assert [r["grad_norm"] for r in got] == pytest.approx(norms, rel=1e-5)
    assert max(norms) > 0.5  # clipping was active, and the log holds the pre-clip norm
    assert max_rel_diff(trainable_state(model), trainable_state(ref)) <= 1e-5


# ----------------------------------------------------------------------------- (d) overfit


def test_overfitting_one_batch_drives_the_loss_near_zero(tmp_path):
    examples = make_examples(4, seed=4, lo=6, hi=10)
    cfg = cfg_for(tmp_path, batch_size=4, max_steps=150, lr=1e-2, max_grad_norm=1.0)
    model = TinyLM(d=32, layers=2, heads=4)
    summary = train(model, sft, examples, collate, cfg, log=quiet)
    first = rows(Path(cfg.out))[0]["loss"]
    assert first > 3.0 and summary["loss"] < 0.05


# ----------------------------------------------------------------------------- eval


def test_eval_loss_and_ppl_are_mean_token_ce(tmp_path):
    train_ex, eval_ex = make_examples(8, seed=5), make_examples(7, seed=6)
    cfg = cfg_for(tmp_path, batch_size=4, max_steps=3, eval_every=2)
    model = freeze_embeddings(TinyLM())
    summary = train(model, sft, train_ex, collate, cfg, eval_examples=eval_ex, log=quiet)
    evals = [r for r in rows(Path(cfg.out)) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [2, 3]  # every 2 steps and at the end
    with torch.no_grad():
        b = collate(eval_ex)
        logits = model.lm_head(model(b["input_ids"], b["attention_mask"]))[:, :-1]
        ref = F.cross_entropy(logits.reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1)).item()
    assert summary["eval/loss"] == pytest.approx(ref, rel=1e-5)
    assert summary["eval/ppl"] == pytest.approx(math.exp(ref), rel=1e-5)
    for r in evals:  # the token is sft's unit: every evaluation row has its perplexity
        assert r["eval/ppl"] == pytest.approx(math.exp(r["eval/loss"]), rel=1e-12)


# ----------------------------------------------------------------------------- (h) checkpointing


def _grads(model, batch):
    loss, count, _ = sft(model, batch)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_non_reentrant_checkpointing_gives_the_same_grads_with_frozen_embeddings():
    batch = collate(make_examples(4, seed=7))
    plain = freeze_embeddings(TinyLM())
    for n, p in plain.named_parameters():  # adapter-like: only the attention projections train
        p.requires_grad_("self_attn" in n)
    wrapped = TinyLM()
    wrapped.load_state_dict(plain.state_dict())
    for n, p in wrapped.named_parameters():
        p.requires_grad_("self_attn" in n)
    assert enable_checkpointing(wrapped) == 2 and enable_checkpointing(wrapped) == 0  # once only
    ref, got = _grads(plain, batch), _grads(wrapped, batch)
    assert ref.keys() == got.keys() and len(ref) == 8
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-7)
        assert ref[n].abs().sum() > 0


def test_checkpointing_the_first_n_blocks_gives_the_same_grads():
    """checkpointing=1 of TinyLM's 2 blocks: only block 0 wrapped; the grads equal the unchecked run's."""
    batch = collate(make_examples(4, seed=7))
    plain = freeze_embeddings(TinyLM())
    wrapped = freeze_embeddings(TinyLM())
    wrapped.load_state_dict(plain.state_dict())
    assert enable_checkpointing(wrapped, 1) == 1 and enable_checkpointing(wrapped, 1) == 0
    assert [getattr(b, "_minitrain_checkpointed", False) for b in wrapped.model.layers] == [True, False]
    ref, got = _grads(plain, batch), _grads(wrapped, batch)
    assert ref.keys() == got.keys() and len(ref) > 8
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-7)
        assert ref[n].abs().sum() > 0
    assert enable_checkpointing(wrapped, True) == 1  # the rest, once
    with pytest.raises(UserError, match="^checkpointing=3: the model has 2 blocks — give 0 to 2"):
        enable_checkpointing(TinyLM(), 3)


def test_reentrant_checkpointing_loses_the_gradients_there():
    """Field report 004: the block input does not require grad (frozen embeddings), so reentrant
    checkpointing returns an output with no graph and the trainable tensors inside get nothing."""
    batch = collate(make_examples(4, seed=7))
    model = TinyLM()
    for n, p in model.named_parameters():
        p.requires_grad_("self_attn" in n)
    for block in model.model.layers:
        inner = block.forward
        block.forward = lambda *a, _f=inner: checkpoint(_f, *a, use_reentrant=True)
    with pytest.warns(UserWarning, match="requires_grad"):
        loss, _, _ = sft(model, batch)
    assert not loss.requires_grad  # nothing to backpropagate: "element 0 ... does not require grad"
    assert all(p.grad is None for p in model.parameters())


def test_checkpointing_in_the_loop_trains_identically(tmp_path):
    examples = make_examples(16, seed=8)
    states, said = [], []
    for flag in (False, True, 1):
        model = freeze_embeddings(TinyLM())
        train(model, sft, examples, collate, cfg_for(tmp_path / str(flag), batch_size=4, max_steps=3,
                                                      checkpointing=flag), log=said.append)
        states.append(trainable_state(model))
    assert max_rel_diff(states[1], states[0]) <= 1e-6 and max_rel_diff(states[2], states[0]) <= 1e-6
    assert [m for m in said if m.startswith("activation checkpointing")] == [
        "activation checkpointing (non-reentrant) on 2 blocks",
        "activation checkpointing (non-reentrant) on the first 1 of 2 blocks"]


# ----------------------------------------------------------------------------- non-finite steps


def poison_collate(examples):
    batch = collate(examples)
    batch["poison"] = any(ex.get("poison") for ex in examples)
    return batch


def poisoned_sft(model, batch):
    loss_sum, count, m = sft(model, batch)
    return (loss_sum * float("nan") if batch["poison"] else loss_sum), count, m


def test_a_nan_batch_is_skipped_counted_and_reported(tmp_path):
    examples = make_examples(16, seed=9)
    examples[5]["poison"] = True
    msgs: list[str] = []
    cfg = cfg_for(tmp_path, batch_size=2, grad_accum=2, epochs=1.0)  # 4 steps, 4 windows per epoch
    model = freeze_embeddings(TinyLM())
    summary = train(model, poisoned_sft, examples, poison_collate, cfg, log=msgs.append)
    got = rows(Path(cfg.out))
    # the skipped window is not an optimizer step: 4 real steps (one window drawn from epoch 2)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert got[-1]["epoch"] == pytest.approx(5 / 4)
    assert summary["skipped_steps"] == 1 and got[-1]["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    bad = [m for m in msgs if "non-finite loss" in m]
    assert len(bad) == 1 and "5" in bad[0].split("examples", 1)[1] and "skipped" in bad[0]


def test_a_run_of_bad_steps_stops_with_a_checkpoint(tmp_path):
    examples = make_examples(16, seed=10)
    for ex in examples:
        ex["poison"] = True
    cfg = cfg_for(tmp_path, batch_size=2, epochs=1.0, max_bad_steps=3)
    with pytest.raises(UserError, match="3 bad steps in a row") as e:
        train(freeze_embeddings(TinyLM()), poisoned_sft, examples, poison_collate, cfg, log=quiet)
    assert "resume=true" in str(e.value)
    assert (Path(cfg.out) / "checkpoint" / "state.json").is_file()
    state = json.loads((Path(cfg.out) / "checkpoint" / "state.json").read_text())
    assert state["step"] == 0 and state["counters"]["skipped_steps"] == 3


# ----------------------------------------------------------------------------- misc


def test_out_dir_with_a_previous_run_needs_resume_or_overwrite(tmp_path):
    examples = make_examples(8, seed=11)
    cfg = cfg_for(tmp_path, batch_size=4, max_steps=1)
    train(freeze_embeddings(TinyLM()), sft, examples, collate, cfg, log=quiet)
    with pytest.raises(UserError, match="resume=true .* overwrite=true"):
        train(freeze_embeddings(TinyLM()), sft, examples, collate, cfg, log=quiet)
    again = dataclasses.replace(cfg, overwrite=True, max_steps=2)
    train(freeze_embeddings(TinyLM()), sft, examples, collate, again, log=quiet)
    assert [r["step"] for r in rows(Path(cfg.out))] == [1, 2]


def test_integer_trainable_tensor_is_refused():
    model = TinyLM()
    model.register_parameter("count", nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
    with pytest.raises(UserError, match="^count: torch.int64"):
        train(model, sft, make_examples(4), collate, TrainConfig(out="/nonexistent"), trainable=["count"], log=quiet)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_autocast_precisions_train_in_fp32_master_weights(tmp_path, precision):
    examples = make_examples(8, seed=12)
    losses = {}
    for p in ("fp32", precision):
        cfg = cfg_for(tmp_path / p, batch_size=4, max_steps=2, precision=p, lr=1e-3)
        model = freeze_embeddings(TinyLM())
        before = trainable_state(model)
        summary = train(model, sft, examples, collate, cfg, log=quiet)
        assert summary["step"] == 2 and all(v.dtype == torch.float32 for v in trainable_state(model).values())
        assert max_rel_diff(trainable_state(model), before) > 0
        losses[p] = [r["loss"] for r in rows(Path(cfg.out))]
    assert losses[precision] == pytest.approx(losses["fp32"], rel=2e-2)  # same run, lower-precision matmuls


def _real_llama_grads(folder, wrap) -> dict[str, torch.Tensor]:
    """LoRA grads of models/llama.py loaded from `folder`, after `wrap(model)` (checkpointing, compile)."""
    import models
    from minitrain.weights import load_pretrained

    model = load_pretrained(folder, models.from_hf_config)
    torch.manual_seed(0)  # the same adapter init in every run
    lcfg = LoRAConfig(r=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
    apply_lora(model, lcfg)
    freeze_for_adapters(model, lcfg)  # embeddings frozen: the case reentrant checkpointing breaks
    with torch.no_grad():  # B = 0 at init would leave A without gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    wrap(model)
    return _grads(model, collate_causal(make_examples(3, seed=13), pad_id=0))


@pytest.mark.parametrize("setting,wrapped", [(True, 2), (1, 1)])
def test_checkpointing_a_real_llama_with_lora_gives_the_same_grads(hf_causal, setting, wrapped):
    def checkpointed(model):
        assert enable_checkpointing(model, setting) == wrapped

    folder = hf_causal("llama_ckpt")
    grads = [_real_llama_grads(folder, lambda m: None), _real_llama_grads(folder, checkpointed)]
    assert len(grads[0]) == 12 and grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-6, atol=1e-8)
        assert grads[0][n].abs().sum() > 0


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="torch.compile's CPU backend needs a C compiler")
def test_compiled_checkpointed_blocks_give_the_same_grads(hf_causal):
    """What train() does on CUDA with compile=true checkpointing=true (each block compiled, under
    non-reentrant checkpointing; frozen embeddings), run on the CPU: the LoRA grads equal eager ones."""
    from minitrain.train import compile_blocks

    def compiled(model):
        enable_checkpointing(model)
        assert compile_blocks(model) == 2

    folder = hf_causal("llama_ckpt")
    grads = [_real_llama_grads(folder, lambda m: None), _real_llama_grads(folder, compiled)]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6)
        assert grads[0][n].abs().sum() > 0


def _saved_bytes_and_grads(model, batch) -> tuple[int, dict[str, torch.Tensor]]:
    """(bytes of the tensors autograd keeps from the forward, parameters aside; the LoRA grads)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _, _ = sft(model, batch)
    loss.backward()
    return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow
@pytest.mark.skipif(not cpu_compiler(), reason="torch.compile's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("kind", ["ternary", "nf4"])
def test_quantized_blocks_are_checkpointed_outside_their_compiled_graph(hf_causal, kind):
    """QLoRA 8B with compile=true checkpointing=true peaked at 2.05x the plan on an H200 (torch 2.11,
    BENCHMARKS.md): inside a compiled graph, torch 2.11's checkpointing does not recompute what an
    autograd Function computes (bitsandbytes' matmul, TernaryMatmul), so inductor kept every base
    product's output. A block with a quantized base keeps its checkpoint outside the graph and compiles
    its own forward: no graph holds a checkpoint, the forward keeps what eager checkpointing keeps,
    and the grads are eager's, also after the gradient-path audit (eager: its hooks, gone by the
    backward, would have the recompute trace another graph than the forward's)."""
    if kind == "nf4":
        pytest.importorskip("bitsandbytes")
    import models
    from torch._inductor.compile_fx import compile_fx

    from minitrain.adapters.quant import quantize_hook
    from minitrain.audit import audit
    from minitrain.train import compile_blocks
    from minitrain.weights import load_pretrained

    folder, graphs = hf_causal("llama_ckpt"), []

    def inductor(gm, example_inputs):  # inductor, noting each graph dynamo hands it
        graphs.append(str(gm.graph))
        return compile_fx(gm, example_inputs)

    def run(compiled: bool):
        torch.manual_seed(0)
        model = load_pretrained(folder, models.from_hf_config, tensor_hook=quantize_hook(kind, torch.float32))
        lcfg = LoRAConfig(r=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
        apply_lora(model, lcfg)
        freeze_for_adapters(model, lcfg)
        with torch.no_grad():  # B = 0 at init would leave A without gradient
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        enable_checkpointing(model)
        batch = collate_causal(make_examples(3, seed=13), pad_id=0)
        if compiled:
            assert compile_blocks(model, backend=inductor) == 2
            assert audit(model, sft, batch).ok  # before step 1, as train() does: its hooks leave no other graph
        return _saved_bytes_and_grads(model, batch)

    torch._dynamo.reset()
    (eager_bytes, eager), (bytes_, grads) = run(False), run(True)
    assert bytes_ == eager_bytes
    assert graphs and not any("checkpoint" in g for g in graphs)
    for n in eager:
        torch.testing.assert_close(grads[n], eager[n], rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.skipif(not cpu_compiler(), reason="torch.compile's CPU backend needs a C++ compiler")
def test_compile_on_cpu_compiles_each_block_and_trains_as_eager(tmp_path):
    """compile=true on a CPU: inductor's kernels for each block, the same losses as eager (3 steps)."""
    runs = {}
    for compiled in (False, True):
        msgs: list[str] = []
        model = freeze_embeddings(TinyLM())
        train(model, sft, make_examples(12), collate,
              cfg_for(tmp_path / str(compiled), batch_size=4, max_steps=3, compile=compiled), log=msgs.append)
        runs[compiled] = [r["loss"] for r in rows(tmp_path / str(compiled) / "run")]
        assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.model.layers) == compiled
    assert "torch.compile on 2 blocks (inductor's C++ kernels, built in the first steps)" in msgs
    assert len(runs[True]) == 3
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-5, atol=0)


def test_compile_on_cpu_without_a_compiler_is_a_logged_no_op(tmp_path, monkeypatch):
    monkeypatch.setattr("minitrain.train.cpu_compiler", lambda: None)
    msgs: list[str] = []
    model = freeze_embeddings(TinyLM())
    train(model, sft, make_examples(4), collate, cfg_for(tmp_path, batch_size=4, max_steps=1, compile=True),
          log=msgs.append)
    assert any(m.startswith("notice: compile=true ignored on cpu: torch.compile's CPU backend needs a C++ compiler")
               for m in msgs)
    assert not hasattr(model.model.layers[0], "_compiled_call_impl") or model.model.layers[0]._compiled_call_impl is None


def test_objective_metrics_are_averaged_over_the_window(tmp_path):
    def with_metric(model, batch):
        loss_sum, count, _ = sft(model, batch)
        return loss_sum, count, {"n_examples": float(batch["input_ids"].shape[0])}

    # 10 examples, batch 4, accum 3: one window of micro-batches with 4, 4 and 2 examples
    cfg = cfg_for(tmp_path, batch_size=4, grad_accum=3, max_steps=1)
    train(freeze_embeddings(TinyLM()), with_metric, make_examples(10), collate, cfg, log=quiet)
    assert rows(Path(cfg.out))[0]["n_examples"] == pytest.approx(10 / 3)


_RANK = r"""
import sys, torch, torch.distributed as dist
sys.path[:0] = [{tests!r}, {root!r}]
torch.set_num_threads(1)
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method={init!r}, rank=rank, world_size=2)
from safetensors.torch import save_file
from test_train import TinyLM, cfg_for, collate, freeze_embeddings, make_examples, quiet, trainable_state
from minitrain.objectives.sft import sft
from minitrain.train import train
from pathlib import Path
model = freeze_embeddings(TinyLM())
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
train(model, sft, make_examples(24, seed=1), collate, cfg_for(Path({out!r}), batch_size=4, max_steps=3),
      optimizer=opt, log=quiet)
save_file(trainable_state(model), {out!r} + f"/rank{{rank}}.safetensors")
dist.destroy_process_group()
import os; os._exit(0)  # skip interpreter teardown: gloo can abort there (pytorch/pytorch#179291), as in test_distributed
"""


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_the_whole_batch(tmp_path):
    """Rule 2 across ranks: each rank takes half of each micro-batch; counts and grads are summed."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    here = Path(__file__).resolve().parent
    out = tmp_path / "dist"
    out.mkdir()
    code = _RANK.format(tests=str(here), root=str(here.parent), init=f"file://{tmp_path / 'rendezvous'}", out=str(out))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    errs = [p.communicate(timeout=None)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs

    model = freeze_embeddings(TinyLM())
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    train(model, sft, make_examples(24, seed=1), collate, cfg_for(tmp_path / "one", batch_size=4, max_steps=3),
          optimizer=opt, log=quiet)
    one = trainable_state(model)
    r0, r1 = load_file(out / "rank0.safetensors"), load_file(out / "rank1.safetensors")
    assert all(torch.equal(r0[k], r1[k]) for k in r0)  # the ranks stayed in sync
    assert max_rel_diff(r0, one) <= 1e-6
    assert [r["step"] for r in rows(out / "run")] == [1, 2, 3]  # rank 0 alone wrote the log


def test_fp16_overflow_redoes_the_same_window_with_a_lower_scale(tmp_path):
    def loud(model, batch):  # gradients 300x larger: fp16 backward overflows at the initial scale
        loss_sum, count, m = sft(model, batch)
        return loss_sum * 300.0, count, m

    examples = make_examples(8, seed=14)
    runs = {}
    for p in ("fp32", "fp16"):
        msgs: list[str] = []
        cfg = cfg_for(tmp_path / p, batch_size=4, max_steps=2, precision=p, lr=1e-3)
        summary = train(freeze_embeddings(TinyLM()), loud, examples, collate, cfg, log=msgs.append)
        runs[p] = (rows(Path(cfg.out)), msgs, summary)
    (ref, _, _), (got, msgs, summary) = runs["fp32"], runs["fp16"]
    assert any("fp16 gradient overflow" in m and "redoing" in m for m in msgs)
    assert summary["skipped_steps"] == 0 and [r["step"] for r in got] == [1, 2]
    assert [r["target_tokens"] for r in got] == [r["target_tokens"] for r in ref]  # same data, no window lost
    assert got[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-2)


def test_a_metric_some_micro_batches_lack_is_averaged_over_those_that_have_it(tmp_path):
    """KTO reports `rewards/rejected` only for a micro-batch holding an undesirable row: a step's value
    is the mean over the micro-batches that report it, not diluted by the others."""
    calls = []

    def every_other(model, batch):
        loss, count, metrics = sft(model, batch)
        calls.append(1)
        return loss, count, {**metrics, "sometimes": 3.0} if len(calls) % 2 else metrics

    cfg = cfg_for(tmp_path, batch_size=2, grad_accum=4, max_steps=2, skip_audit=True)
    train(TinyLM(), every_other, make_examples(16), collate, cfg, log=quiet)
    steps = [m for m in rows(tmp_path / "run") if "sometimes" in m]
    assert len(steps) == 2 and all(m["sometimes"] == 3.0 for m in steps)


def _dpo_like_block_calls(model) -> None:
    """The block calls of a DPO run with the reference = adapters disabled: the audit's one-row
    forward + backward, then per step the reference forward (no grad, adapters off), the policy
    forward + backward and an eval pass, at three lengths."""
    from minitrain.adapters.lora import disable_adapters

    loss, count, _ = sft(model, collate_causal(make_examples(1, seed=9), pad_id=0))
    (loss / count).backward()
    for seed in (1, 2, 3):
        batch = collate_causal(make_examples(2, seed=seed, lo=4 * seed, hi=4 * seed), pad_id=0)
        with torch.no_grad(), disable_adapters(model):
            sft(model, batch)
        loss, count, _ = sft(model, batch)
        (loss / count).backward()
        model.eval()
        with torch.no_grad():
            sft(model, batch)
        model.train()


def test_compiled_blocks_stay_compiled_through_a_dpo_runs_variants(hf_causal, monkeypatch):
    """Seen on an H200 (BENCHMARKS.md): the DPO demo with compile=true hit dynamo's recompile limit
    (8) in its first steps, grad mode x the block input's requires_grad x static / dynamic shapes,
    and the rest ran eagerly without a word. compile_blocks raises the limit so that every variant
    of such a run is compiled; with the default limit the same calls hit it (dynamo made to fail
    there instead of falling back: the guards are the same on every backend)."""
    import torch._dynamo

    from minitrain import train as T
    import models
    from minitrain.weights import load_pretrained

    folder = hf_causal("llama_ckpt")

    def run() -> None:
        torch._dynamo.reset()
        model = load_pretrained(folder, models.from_hf_config)
        lcfg = LoRAConfig(r=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
        apply_lora(model, lcfg)
        freeze_for_adapters(model, lcfg)
        enable_checkpointing(model)
        assert T.compile_blocks(model, backend="eager") == 2
        _dpo_like_block_calls(model)

    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        run()
    monkeypatch.setattr(T, "RECOMPILE_LIMIT", 8)
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        with pytest.raises(Exception, match="(?i)recompile|cache.?size|limit"):
            run()
    torch._dynamo.reset()
