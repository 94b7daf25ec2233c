"""DPO: the loss and its metrics against TRL's DPOTrainer, and the reference without a second model.

References: TRL 1.x `DPOTrainer._compute_loss` run on the same log-probs (its own code, with a
stub model that returns them), then the whole `compute_loss` on HF models with the same weights
(plain models, a fresh PEFT adapter whose reference is the base, a continued PEFT adapter whose
reference is a frozen copy of it); the DPO paper's step-0 fact that a policy equal to its
reference has loss log 2 and zero rewards; and a fresh reference forward for the cache.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import types

import pytest
import torch
from safetensors.torch import load_file

import models
from minitrain.adapters.lora import LoRAConfig, LoRALinear, apply_lora, disable_adapters, freeze_for_adapters
from minitrain.adapters.peft_format import load_adapter, save_adapter
from minitrain.config import validate
from minitrain.data.collate import collate_preference
from minitrain.errors import UserError
from minitrain.objectives.dpo import DPOConfig, collate_with_reference, dpo_loss, evaluate_dpo, make_dpo_objective
from minitrain.objectives.reference import AdapterSnapshotReference, BaseReference, precompute_reference, sequence_logps
from minitrain.train import evaluate, train
from minitrain.weights import load_pretrained

PAD = 0
# (prompt, chosen, rejected) token ids of 4 pairs with different prompt and answer lengths
PAIRS = [
    ([1, 5, 6, 7], [8, 9, 10, 2], [11, 2]),
    ([1, 12, 13], [14, 2], [15, 16, 17, 18, 2]),
    ([1, 19, 20, 21, 22, 23], [24, 25, 2], [26, 27, 28, 2]),
    ([1, 30], [31, 32, 33, 34, 35, 2], [36, 2]),
]
CASES = [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.0), ("robust", 0.2)]
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")


def our_examples(pairs=PAIRS) -> list[dict]:
    """The pairs as `minitrain.data.readers.read_preference` makes them (labels -100 on the prompt)."""
    out = []
    for p, c, r in pairs:
        out.append({"chosen_ids": p + c, "chosen_labels": [-100] * len(p) + c,
                    "rejected_ids": p + r, "rejected_labels": [-100] * len(p) + r})
    return out


def trl_batch(trainer, pairs=PAIRS) -> dict:
    """The same pairs through TRL's own collator (prompt_ids / chosen_ids / rejected_ids)."""
    return trainer.data_collator([{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in pairs])


def make_trainer(tmp_path, model, ref_model=None, peft_config=None, tok_dir=None):
    """A TRL DPOTrainer on a tiny model (building it costs a few seconds: use sparingly)."""
    import datasets
    import transformers
    import trl

    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    ds = datasets.Dataset.from_list([{"prompt": "the a", "chosen": " of to", "rejected": " in and"}] * 2)
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, beta=0.1,
                         gradient_checkpointing=False, disable_tqdm=True)
    return trl.DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=ds, processing_class=tok,
                          peft_config=peft_config)


def trl_loss(trainer, model, inputs, loss_type, label_smoothing, beta=0.1) -> tuple[float, dict]:
    """TRL's loss and logged metrics for one batch, with the trainer set to this loss."""
    trainer.loss_types, trainer.loss_weights = [loss_type], [1.0]
    trainer.label_smoothing, trainer.beta = label_smoothing, beta
    trainer._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    with torch.no_grad():
        loss = trainer._compute_loss(model, inputs, False)
    mode = "train" if trainer.model.training else "eval"
    return float(loss), {k: trainer._metrics[mode][k][-1] for k in TRL_METRICS}


def assert_matches_trl(ours: dict, trl: tuple[float, dict], tol=1e-5):
    loss, metrics = trl
    assert ours["loss"] == pytest.approx(loss, abs=tol, rel=tol)
    for k in TRL_METRICS:
        assert ours[k] == pytest.approx(metrics[k], abs=tol, rel=tol), k


def our_stats(objective, model, batch) -> dict:
    with torch.no_grad():
        stats = objective.pair_stats(model, batch)
    return {k: float(v.float().mean()) for k, v in stats.items()}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from _tok import make_bpe_tokenizer

    return make_bpe_tokenizer(tmp_path_factory.mktemp("tok"))


def load_ours(folder):
    return load_pretrained(folder, models.from_hf_config).eval()


def load_hf(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


# ----------------------------------------------------------------------------- the formulas


@pytest.fixture(scope="module")
def formula_trainer(hf_causal, tok_dir, tmp_path_factory):
    folder = hf_causal("dpo_policy")
    return make_trainer(tmp_path_factory.mktemp("t"), load_hf(folder), load_hf(folder), tok_dir=tok_dir)


@pytest.mark.parametrize("loss_type,label_smoothing", CASES)
def test_dpo_loss_equals_trl_on_the_same_logps(formula_trainer, loss_type, label_smoothing):
    """TRL's own `_compute_loss` fed per-token log-probs by a stub model and precomputed reference
    log-probs, against `dpo_loss` on the same numbers (IPO's per-length normalisation included)."""
    trainer = formula_trainer
    g = torch.Generator().manual_seed(1)
    inputs = trl_batch(trainer)
    shift_mask = inputs["completion_mask"][:, 1:].float()  # (2P, T-1): which next tokens are scored
    per_token = -3 * torch.rand(shift_mask.shape, generator=g) * shift_mask  # TRL sums over T: zeros elsewhere
    P = len(PAIRS)
    ref = per_token.sum(1) + torch.randn(2 * P, generator=g)  # a reference that differs per sequence
    inputs = {**inputs, "ref_chosen_logps": ref[:P], "ref_rejected_logps": ref[P:]}
    zeros = torch.zeros_like(per_token)
    stub = lambda **kw: types.SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros,  # noqa: E731
                                              is_top1=zeros.bool())
    trainer.precompute_ref_logps = True
    try:
        expected = trl_loss(trainer, stub, inputs, loss_type, label_smoothing)
    finally:
        trainer.precompute_ref_logps = False

    logps, lengths = per_token.sum(1), shift_mask.sum(1)
    losses, rc, rr = dpo_loss(logps[:P], logps[P:], ref[:P], ref[P:], beta=0.1, loss_type=loss_type,
                              label_smoothing=label_smoothing, chosen_lengths=lengths[:P], rejected_lengths=lengths[P:])
    ours = {"loss": float(losses.mean()), "rewards/chosen": float(rc.mean()), "rewards/rejected": float(rr.mean()),
            "rewards/accuracies": float((rc > rr).float().mean()), "rewards/margins": float((rc - rr).mean()),
            "logps/chosen": float(logps[:P].mean()), "logps/rejected": float(logps[P:].mean())}
    assert_matches_trl(ours, expected)
    assert 0 < ours["rewards/accuracies"] < 1  # the data exercises both outcomes


def test_cdpo_label_smoothing_is_the_conservative_dpo_formula():
    """sigmoid + label_smoothing: cDPO (Mitchell 2023, TRL < 1.0), a mixture of both label directions."""
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, generator=g) for _ in range(4))
    beta, e = 0.3, 0.1
    losses, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=e)
    d = (pc - rc) - (pr - rr)
    p = torch.sigmoid(beta * d)
    torch.testing.assert_close(losses, -(1 - e) * torch.log(p) - e * torch.log(1 - p))


# ----------------------------------------------------------------------------- whole forward vs TRL


@pytest.mark.parametrize("loss_type,label_smoothing", CASES)
def test_parity_with_trl_compute_loss_two_models(hf_causal, tok_dir, tmp_path, loss_type, label_smoothing):
    """HF policy + HF reference in TRL vs our models loaded from the same safetensors: one
    concatenated forward, chunked log-probs, dpo_loss and metrics, to 1e-5."""
    pol_dir, ref_dir = hf_causal("dpo_policy"), hf_causal("dpo_ref", seed=1)
    trainer = _two_model_trainer(pol_dir, ref_dir, tok_dir, tmp_path)
    expected = trl_loss(trainer, trainer.model, trl_batch(trainer), loss_type, label_smoothing)

    policy, reference = load_ours(pol_dir), load_ours(ref_dir)

    class OtherModel:  # a separate reference model: only for this comparison, never in minitrain
        def logps(self, model, batch):
            s = sequence_logps(reference, batch)
            return s.chosen, s.rejected

    objective = make_dpo_objective(0.1, loss_type, label_smoothing, reference=OtherModel())
    batch = collate_preference(our_examples(), PAD)
    assert_matches_trl(our_stats(objective, policy, batch), expected)


_TRAINERS: dict = {}


def _two_model_trainer(pol_dir, ref_dir, tok_dir, tmp_path):
    if "two" not in _TRAINERS:
        _TRAINERS["two"] = make_trainer(tmp_path, load_hf(pol_dir), load_hf(ref_dir), tok_dir=tok_dir)
    return _TRAINERS["two"]


def test_sft_term_equals_trl_sigmoid_plus_sft_when_chosen_lengths_are_equal(formula_trainer):
    """`sft_weight` adds each pair's per-token mean NLL of its chosen answer. TRL's `sft` loss is the
    token mean over the whole batch: the two agree exactly when every chosen answer is as long."""
    pairs = [([1, 5, 6], [8, 9, 2], [11, 2]), ([1, 12, 13, 14], [15, 16, 2], [17, 18, 19, 20, 2]),
             ([1, 21], [22, 23, 2], [24, 25, 26, 2])]  # chosen answers: 3 tokens each
    trainer = formula_trainer
    g = torch.Generator().manual_seed(2)
    inputs = trl_batch(trainer, pairs)
    shift_mask = inputs["completion_mask"][:, 1:].float()
    per_token = -3 * torch.rand(shift_mask.shape, generator=g) * shift_mask
    P = len(pairs)
    ref = per_token.sum(1) + torch.randn(2 * P, generator=g)
    inputs = {**inputs, "ref_chosen_logps": ref[:P], "ref_rejected_logps": ref[P:]}
    zeros = torch.zeros_like(per_token)
    stub = lambda **kw: types.SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros,  # noqa: E731
                                              is_top1=zeros.bool())
    trainer.precompute_ref_logps = True
    try:
        trl_loss(trainer, stub, inputs, "sigmoid", 0.0)  # set the trainer up, then two losses
        trainer.loss_types, trainer.loss_weights = ["sigmoid", "sft"], [1.0, 0.5]
        with torch.no_grad():
            expected = float(trainer._compute_loss(stub, inputs, False))
    finally:
        trainer.precompute_ref_logps = False
    logps, lengths = per_token.sum(1), shift_mask.sum(1)
    losses, _, _ = dpo_loss(logps[:P], logps[P:], ref[:P], ref[P:], beta=0.1)
    ours = losses + 0.5 * -logps[:P] / lengths[:P]
    assert float(ours.mean()) == pytest.approx(expected, rel=1e-6)


# ----------------------------------------------------------------------------- references with adapters vs TRL


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _randomize_peft(model, which: str, seed: int, scale: float = 0.2):
    """Move a PEFT adapter's tensors away from their init (B = 0 would make it a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if f".{which}." in n and "lora_" in n:
                p.add_(scale * torch.randn(p.shape, generator=g))


def test_parity_with_trl_fresh_adapter_reference_is_the_base(hf_causal, tok_dir, tmp_path):
    """Mode (a): TRL with `peft_config` (its reference: the model with adapters disabled) vs our
    `BaseReference`, after the adapter has moved (otherwise policy == reference trivially)."""
    import peft

    folder = hf_causal("dpo_policy")
    trainer = make_trainer(tmp_path, load_hf(folder), None, peft_config=peft.LoraConfig(**LORA), tok_dir=tok_dir)
    _randomize_peft(trainer.model, "default", seed=3)
    trainer.model.save_pretrained(str(tmp_path / "moved"))
    ours = load_ours(folder)
    load_adapter(ours, tmp_path / "moved", trainable=True)
    batch = collate_preference(our_examples(), PAD)
    for loss_type, ls in CASES:
        expected = trl_loss(trainer, trainer.model, trl_batch(trainer), loss_type, ls)
        objective = make_dpo_objective(0.1, loss_type, ls, reference=BaseReference())
        assert_matches_trl(our_stats(objective, ours, batch), expected)


def test_parity_with_trl_continued_adapter_reference_is_stage_a(hf_causal, tok_dir, tmp_path):
    """Mode (b): TRL given a trained PEFT adapter keeps a frozen "ref" copy of it; ours keeps a
    snapshot of the adapter tensors. After the policy adapter moves, both losses agree — and the
    adapter-disabled base, the wrong reference here, gives another loss."""
    import peft

    folder = hf_causal("dpo_policy")
    stage_a = peft.get_peft_model(load_hf(folder), peft.LoraConfig(**LORA))
    _randomize_peft(stage_a, "default", seed=4)
    stage_a.save_pretrained(str(tmp_path / "stage_a"))
    trl_model = peft.PeftModel.from_pretrained(load_hf(folder), str(tmp_path / "stage_a"), is_trainable=True)
    trainer = make_trainer(tmp_path, trl_model, None, tok_dir=tok_dir)
    assert "ref" in trainer.model.peft_config  # TRL made its frozen copy of Stage A
    _randomize_peft(trainer.model, "default", seed=5, scale=0.1)  # "training" moved the policy
    trainer.model.save_pretrained(str(tmp_path / "moved"), selected_adapters=["default"])

    ours = load_ours(folder)
    load_adapter(ours, tmp_path / "stage_a", trainable=True)
    reference = AdapterSnapshotReference(ours)  # Stage A, before any step
    load_adapter(ours, tmp_path / "moved", trainable=True)  # the moved policy, into the same layout
    batch = collate_preference(our_examples(), PAD)
    for loss_type, ls in CASES:
        expected = trl_loss(trainer, trainer.model, trl_batch(trainer), loss_type, ls)
        assert_matches_trl(our_stats(make_dpo_objective(0.1, loss_type, ls, reference=reference), ours, batch),
                           expected)
    wrong = our_stats(make_dpo_objective(0.1, "sigmoid", reference=BaseReference()), ours, batch)
    assert abs(wrong["loss"] - trl_loss(trainer, trainer.model, trl_batch(trainer), "sigmoid", 0.0)[0]) > 1e-3


# ----------------------------------------------------------------------------- step 0: policy == reference


def our_lora_model(folder, targets=("q_proj", "v_proj")):
    model = load_ours(folder)
    cfg = LoRAConfig(r=4, alpha=8.0, targets=list(targets))
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    return model, cfg


@pytest.fixture
def stage_a_adapter(hf_causal, tmp_path):
    """A saved Stage A adapter that is far from a no-op (A and B random)."""
    model, cfg = our_lora_model(hf_causal("dpo_policy"))
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return save_adapter(model, tmp_path / "stage_a", cfg)


def stage_b_model(folder, adapter):
    """Stage B: the Stage A adapter loaded trainable (rule 4), nothing stacked on it."""
    model = load_ours(folder)
    load_adapter(model, adapter, trainable=True)
    return model


def _collate(examples):
    return collate_with_reference(examples, PAD)


@pytest.mark.parametrize("mode", ["fresh", "stage_a", "fresh+precomputed", "stage_a+precomputed"])
def test_first_loss_is_log2_and_rewards_zero(hf_causal, stage_a_adapter, tmp_path, mode):
    """The reference equals the policy at step 0 in every mode, so the sigmoid loss is log 2."""
    folder = hf_causal("dpo_policy")
    if mode.startswith("fresh"):
        model, _ = our_lora_model(folder)
        reference = BaseReference()
    else:
        model = stage_b_model(folder, stage_a_adapter)
        reference = AdapterSnapshotReference(model)
    examples = our_examples()
    if mode.endswith("precomputed"):
        precompute_reference(model, reference, examples, tmp_path / "ref" / "train", _collate, 3, log=lambda s: None)
        objective = make_dpo_objective(0.1, "sigmoid", reference=None)  # only the cached values exist
    else:
        objective = make_dpo_objective(0.1, "sigmoid", reference=reference)
    stats = our_stats(objective, model.train(), _collate(examples))
    assert stats["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert stats[k] == pytest.approx(0.0, abs=1e-6), k


def test_the_base_is_the_wrong_reference_for_a_continued_adapter(hf_causal, stage_a_adapter):
    """Why mode (b) exists: with the Stage A adapter, the adapter-disabled base is another model."""
    model = stage_b_model(hf_causal("dpo_policy"), stage_a_adapter)
    stats = our_stats(make_dpo_objective(0.1, "sigmoid", reference=BaseReference()), model, _collate(our_examples()))
    assert abs(stats["loss"] - math.log(2)) > 1e-3


def test_stage_a_adapter_keeps_training_unstacked_and_the_snapshot_stays_stage_a(hf_causal, stage_a_adapter,
                                                                                 tmp_path):
    folder = hf_causal("dpo_policy")
    model = stage_b_model(folder, stage_a_adapter)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 2 * 2  # q_proj and v_proj in 2 layers: one LoRA each
    assert not any(isinstance(c, LoRALinear) for n in wrapped for c in model.get_submodule(n).modules()
                   if c is not model.get_submodule(n))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    in_file = load_file(stage_a_adapter / "adapter_model.safetensors")
    saved = sorted(k.removeprefix("base_model.model.") for k in in_file)
    assert trainable == saved  # exactly the Stage A tensors train, nothing new

    reference = AdapterSnapshotReference(model)
    objective = make_dpo_objective(0.1, "sigmoid", reference=reference)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    cfg = DPOConfig(out=str(tmp_path / "run"), max_steps=3, batch_size=2, lr=1e-2, warmup=0, schedule="constant")
    train(model, objective, our_examples(), _collate, cfg, log=lambda s: None)
    moved = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(not torch.equal(before[n], moved[n]) for n in before)  # A and B both train

    batch = _collate(our_examples())
    frozen_stage_a = stage_b_model(folder, stage_a_adapter).eval()
    ref_c, ref_r = reference.logps(model, batch)
    want = sequence_logps(frozen_stage_a, batch)
    torch.testing.assert_close(ref_c, want.chosen, rtol=0, atol=1e-5)  # the reference is still Stage A
    torch.testing.assert_close(ref_r, want.rejected, rtol=0, atol=1e-5)
    for n, p in model.named_parameters():  # and the swap put the trained values back
        if p.requires_grad:
            assert torch.equal(p, moved[n]), n


def _grads(model, objective, batch):
    model.zero_grad(set_to_none=True)
    loss, _, _ = objective(model, batch)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_snapshot_reference_leaves_gradients_exact_with_and_without_checkpointing(hf_causal, stage_a_adapter,
                                                                                  tmp_path):
    """Field report 002 lost gradients to checkpointing + LoRA. Here: the gradient with the live
    Stage A reference equals the one with precomputed reference log-probs (the swap disturbs
    nothing), equals it again under non-reentrant checkpointing, and reaches every adapter tensor."""
    from minitrain.train import enable_checkpointing

    model = stage_b_model(hf_causal("dpo_policy"), stage_a_adapter).train()
    reference = AdapterSnapshotReference(model)
    with torch.no_grad():  # move the policy so the loss has a gradient in A and B alike
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.mul_(1.1)
    examples = our_examples()
    live = _grads(model, make_dpo_objective(0.1, "sigmoid", sft_weight=0.3, reference=reference), _collate(examples))
    precompute_reference(model, reference, examples, tmp_path / "ref", _collate, 4, log=lambda s: None)
    cached = _grads(model, make_dpo_objective(0.1, "sigmoid", sft_weight=0.3), _collate(examples))
    assert enable_checkpointing(model) == 2
    checkpointed = _grads(model, make_dpo_objective(0.1, "sigmoid", sft_weight=0.3, reference=reference),
                          _collate([{k: v for k, v in ex.items() if not k.startswith("ref_")} for ex in examples]))
    for n in live:
        assert live[n].abs().sum() > 0, n
        torch.testing.assert_close(cached[n], live[n], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(checkpointed[n], live[n], rtol=1e-5, atol=1e-7)


def test_reference_after_a_live_policy_graph_fails_loudly(hf_causal, stage_a_adapter):
    """The snapshot is copied in place; run after the policy forward, autograd refuses the
    backward instead of giving wrong gradients. The objective therefore runs the reference first."""
    model = stage_b_model(hf_causal("dpo_policy"), stage_a_adapter)
    reference = AdapterSnapshotReference(model)
    batch = _collate(our_examples())
    logps = sequence_logps(model, batch)
    reference.logps(model, batch)
    with pytest.raises(RuntimeError, match="inplace"):
        logps.chosen.sum().backward()


# ----------------------------------------------------------------------------- precomputed reference cache


@pytest.mark.parametrize("mode", ["fresh", "stage_a"])
def test_cache_holds_the_reference_not_the_policy(hf_causal, stage_a_adapter, tmp_path, mode):
    """Train one step so policy and reference differ, rebuild the cache: it equals a fresh
    reference forward and differs from the policy. Then: reused while fresh, rebuilt when the
    data or the weights file change."""
    folder = hf_causal("dpo_policy")
    if mode == "fresh":
        model, _ = our_lora_model(folder)
        reference = BaseReference()
    else:
        model = stage_b_model(folder, stage_a_adapter)
        reference = AdapterSnapshotReference(model)
    examples = our_examples()
    cache = tmp_path / "ref_logps" / "train"
    quiet = lambda s: None  # noqa: E731
    assert not precompute_reference(model, reference, examples, cache, _collate, 3, log=quiet)
    cfg = DPOConfig(out=str(tmp_path / "run"), max_steps=1, batch_size=4, lr=5e-2, warmup=0, schedule="constant")
    train(model, make_dpo_objective(0.1, "sigmoid", reference=reference), examples, _collate, cfg, log=quiet)

    for suffix in (".safetensors", ".json"):
        cache.with_suffix(suffix).unlink()
    clean = our_examples()
    assert not precompute_reference(model, reference, clean, cache, _collate, 3, log=quiet)
    cached = load_file(str(cache.with_suffix(".safetensors")))
    batch = collate_preference(our_examples(), PAD)
    fresh_c, fresh_r = reference.logps(model, batch)
    with torch.no_grad():
        policy = sequence_logps(model.eval(), batch)
    torch.testing.assert_close(cached["ref_chosen_logps"], fresh_c, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached["ref_rejected_logps"], fresh_r, rtol=0, atol=1e-5)
    assert (cached["ref_chosen_logps"] - policy.chosen).abs().max() > 1e-3  # the policy moved away

    assert precompute_reference(model, reference, our_examples(), cache, _collate, 3, log=quiet)  # fresh: reused
    assert not precompute_reference(model, reference, our_examples(PAIRS[:3]), cache, _collate, 3, log=quiet)
    weights = model.source_dir / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, another file identity
    try:
        messages = []
        assert not precompute_reference(model, reference, our_examples(PAIRS[:3]), cache, _collate, 3,
                                        log=messages.append)
        assert "weights" in messages[0]
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_cache_that_cannot_be_written_is_one_line_and_leaves_no_temporary(hf_causal, tmp_path, monkeypatch):
    import minitrain.objectives.reference as reference_mod

    model, _ = our_lora_model(hf_causal("dpo_policy"))
    cache = tmp_path / "ref_logps" / "train"

    def full(tensors, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(reference_mod, "save_file", full)
    with pytest.raises(UserError) as e:
        precompute_reference(model, BaseReference(), our_examples(), cache, _collate, 3, log=lambda s: None)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"{cache.with_suffix('.safetensors')}: cannot write the reference cache: ")
    assert list(cache.parent.iterdir()) == []


# ----------------------------------------------------------------------------- the unit is the pair


def test_batch4_accum1_equals_batch2_accum2_with_sft_term(hf_causal, tmp_path):
    """Rule 2 for DPO: one SGD step on 4 pairs in one micro-batch equals 2 micro-batches of 2."""
    folder = hf_causal("dpo_policy")
    results = []
    for batch_size, accum in ((4, 1), (2, 2)):
        torch.manual_seed(0)  # the same LoRA A in both runs (drawn from the global generator)
        model, _ = our_lora_model(folder)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
        params = [p for p in model.parameters() if p.requires_grad]
        cfg = DPOConfig(out=str(tmp_path / f"b{batch_size}"), max_steps=1, batch_size=batch_size, grad_accum=accum,
                        lr=1.0, warmup=0, schedule="constant", max_grad_norm=0.0)
        objective = make_dpo_objective(0.1, "sigmoid", sft_weight=0.5, reference=BaseReference())
        train(model, objective, our_examples(), _collate, cfg, optimizer=torch.optim.SGD(params, lr=1.0),
              log=lambda s: None)
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_evaluate_dpo_weighs_every_pair_the_same(hf_causal):
    model, _ = our_lora_model(hf_causal("dpo_policy"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(8))
    objective = make_dpo_objective(0.1, "sigmoid", reference=BaseReference())
    got = evaluate_dpo(model, objective, our_examples(), _collate, batch_size=3)  # batches of 3 and 1
    want = our_stats(objective, model.eval(), _collate(our_examples()))  # one batch: per-pair means
    assert set(got) == {"eval/" + k for k in want}
    for k, v in want.items():
        assert got["eval/" + k] == pytest.approx(v, abs=1e-6), k


# held-out pairs with tokens no training pair has (so a forward of them is recognisable)
EVAL_PAIRS = [
    ([1, 40, 41], [42, 43, 2], [44, 2]),
    ([1, 45], [46, 47, 48, 2], [49, 50, 2]),
    ([1, 51, 52, 53], [54, 2], [55, 56, 57, 58, 2]),
]


def by_hand_mean_loss(model, pairs, beta, sft_weight) -> float:
    """The mean DPO (+ NLL) loss per pair, one pair at a time, from log-probs written out here:
    policy = the model, reference = adapters off, sigmoid loss, NLL per chosen token."""
    losses = []
    with torch.no_grad():
        for prompt, chosen, rejected in pairs:
            logps = []
            for adapters_on in (True, False):
                for answer in (chosen, rejected):
                    ids = torch.tensor([prompt + answer])
                    with contextlib.ExitStack() as stack:
                        if not adapters_on:
                            stack.enter_context(disable_adapters(model))
                        logits = model.output_projection(model(ids, torch.ones_like(ids))).float()  # (1, T, V)
                    token_logps = logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]  # (T - 1,)
                    logps.append(float(token_logps[len(prompt) - 1 :].sum()))
            pol_c, pol_r, ref_c, ref_r = logps
            delta = (pol_c - ref_c) - (pol_r - ref_r)
            losses.append(-math.log(1 / (1 + math.exp(-beta * delta))) + sft_weight * -pol_c / len(chosen))
    return sum(losses) / len(losses)


def test_training_eval_is_the_dpo_pass_once_with_eval_loss_and_no_perplexity(hf_causal, tmp_path):
    """The loop evaluates a DPO run with the objective's own pass (`DPOObjective.evaluate`): each
    held-out pair is scored once per evaluation (a reference and a policy forward), `eval/loss`
    is the mean loss per pair and TRL's `eval/...` metrics come with it, and no `eval/ppl`
    (exp of a pair loss is no perplexity) is logged or returned."""
    model, _ = our_lora_model(hf_causal("dpo_policy"))
    objective = make_dpo_objective(0.1, "sigmoid", sft_weight=0.5, reference=BaseReference())
    eval_examples = our_examples(EVAL_PAIRS)
    held_out = {tuple(p + c) for p, c, _ in EVAL_PAIRS}
    scored = collections.Counter()  # held-out chosen sequence -> forwards it went through
    counting = [True]

    def count(module, args):
        if counting[0]:
            for row, mask in zip(args[0].tolist(), args[1].tolist()):
                seq = tuple(t for t, m in zip(row, mask) if m)
                if seq in held_out:
                    scored[seq] += 1

    model.register_forward_pre_hook(count)
    by_hand = {}

    def eval_fn(m, step, row):  # the loss at this evaluation, computed here without the library's DPO code
        counting[0] = False
        by_hand[step] = by_hand_mean_loss(m, EVAL_PAIRS, beta=0.1, sft_weight=0.5)
        counting[0] = True
        return {}

    cfg = DPOConfig(out=str(tmp_path / "run"), max_steps=3, batch_size=2, eval_every=2, log_every=1, lr=5e-2,
                    warmup=0, schedule="constant", skip_audit=True)
    summary = train(model, objective, our_examples(), _collate, cfg, eval_examples=eval_examples, eval_fn=eval_fn,
                    log=lambda s: None)

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [2, 3]
    assert by_hand[2] != pytest.approx(by_hand[3], abs=1e-4)  # training moved the policy between evaluations
    for r in evals:
        assert r["eval/loss"] == pytest.approx(by_hand[r["step"]], abs=1e-5)
        assert {"eval/" + k for k in TRL_METRICS} <= set(r)
    assert not any("eval/ppl" in r for r in rows) and "eval/ppl" not in summary
    assert summary["eval/loss"] == pytest.approx(by_hand[3], abs=1e-5)
    # 2 evaluations x (1 reference + 1 policy forward) per held-out pair: the set is scored once each time
    assert scored == {seq: 4 for seq in held_out}
    assert evaluate_dpo(model, objective, eval_examples, _collate, 2) == pytest.approx(
        {k: v for k, v in evals[-1].items() if k.startswith("eval/")}, abs=1e-6)

    # the generic pass on the same objective: the same eval/loss, and no perplexity for a pair unit
    generic = evaluate(model, objective, eval_examples, _collate, 2)
    assert set(generic) == {"eval/loss"} and generic["eval/loss"] == pytest.approx(by_hand[3], abs=1e-5)


def test_config_rejects_label_smoothing_where_it_means_nothing():
    validate(DPOConfig(model="m", data="d", loss_type="robust", label_smoothing=0.1))
    validate(DPOConfig(model="m", data="d", loss_type="sigmoid", label_smoothing=0.1))
    with pytest.raises(UserError, match="label_smoothing"):
        validate(DPOConfig(model="m", data="d", loss_type="ipo", label_smoothing=0.1))
    with pytest.raises(UserError, match="loss_type"):
        validate(DPOConfig(model="m", data="d", loss_type="kto"))


# ----------------------------------------------------------------------------- QLoRA: quantized base


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_step0_is_log2_and_gradients_reach_the_adapter(hf_causal, stage_a_adapter, kind):
    """The field report's QLoRA Stage B: an 8-bit / 4-bit base, fresh or Stage A adapter. The
    reference must equal the policy at step 0 and leave training intact, so it may not switch
    the model to eval (bitsandbytes' int8 matmul differs between modes; its CPU 4-bit layer
    repacks for inference on an eval no-grad forward and then passes no gradient): every adapter
    tensor gets a gradient through the quantized layers after it, also with checkpointing."""
    pytest.importorskip("bitsandbytes")
    from minitrain.adapters.quant import quantize_hook
    from minitrain.train import enable_checkpointing

    folder = hf_causal("dpo_policy")
    for mode in ("fresh", "stage_a"):
        hook = quantize_hook(kind, compute_dtype=torch.float32)
        model = load_pretrained(folder, models.from_hf_config, tensor_hook=hook)
        if mode == "fresh":
            cfg = LoRAConfig(r=4, alpha=8.0, targets=["q_proj", "v_proj"])
            apply_lora(model, cfg)
            freeze_for_adapters(model, cfg)
            reference = BaseReference()
        else:
            load_adapter(model, stage_a_adapter, trainable=True)
            reference = AdapterSnapshotReference(model)
        model.train()
        objective = make_dpo_objective(0.1, "sigmoid", reference=reference)
        batch = _collate(our_examples())
        stats = our_stats(objective, model, batch)
        assert stats["loss"] == pytest.approx(math.log(2), abs=1e-5), (kind, mode)
        ref_c, ref_r = reference.logps(model, batch)
        with torch.no_grad():
            pol = sequence_logps(model, batch)
        torch.testing.assert_close(ref_c, pol.chosen, rtol=0, atol=1e-6)
        torch.testing.assert_close(ref_r, pol.rejected, rtol=0, atol=1e-6)
        enable_checkpointing(model)
        with torch.no_grad():  # move the adapter so that A and B both have a gradient
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
        grads = _grads(model, objective, batch)
        assert grads and all(g.abs().sum() > 0 for g in grads.values()), (kind, mode)
