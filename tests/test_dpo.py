"""DPO: the loss and its metrics against TRL's DPOTrainer, and the reference without a second model.

References: TRL 1.x `DPOTrainer._compute_loss` run on the same log-probs (its own code, with a
stub model that returns them), then the whole `compute_loss` on HF models with the same weights
(plain models, a fresh PEFT adapter whose reference is the base, a continued PEFT adapter whose
reference is a frozen copy of it); the DPO paper's step-0 fact that a policy equal to its
reference has loss log 2 and zero rewards; and a fresh reference forward for the cache.
"""

from __future__ import annotations

import math
import os
import types

import pytest
import torch
from safetensors.torch import load_file

import models
from minitrain.data import collate_preference
from minitrain.dpo import (
    LOSS_TYPES,
    AdapterSnapshotReference,
    BaseReference,
    DPOConfig,
    collate_with_reference,
    dpo_loss,
    evaluate_dpo,
    make_dpo_objective,
    precompute_reference,
    sequence_logps,
)
from minitrain.config import validate
from minitrain.errors import UserError
from minitrain.lora import LoRAConfig, LoRALinear, apply_lora, freeze_for_adapters, load_adapter, save_adapter
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
    """The pairs as `minitrain.data.read_preference` makes them (labels -100 on the prompt)."""
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
    trainer._metrics = {"train": __import__("collections").defaultdict(list),
                        "eval": __import__("collections").defaultdict(list)}
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
