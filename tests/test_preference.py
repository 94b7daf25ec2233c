"""ORPO, CPO and SimPO against TRL's `trl.experimental.orpo.ORPOTrainer` / `trl.experimental.cpo.CPOTrainer`.

References: TRL's own loss functions (`odds_ratio_loss`, `cpo_loss`) on the same log-probs; TRL's
`get_batch_loss_metrics` on an HF model with the same weights as ours (loss, every metric we log,
and the gradient of every parameter); TRL's `Trainer.train()` for a few SGD steps against our
loop (per-step loss and the final weights). TRL's NLL term is the token mean over the batch and
ours each pair's own token mean (rule 2): they are equal when the chosen rows have equal lengths,
which the NLL-carrying batches here have; the reference-free terms are compared on any lengths.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import models
from minitrain.config import validate
from minitrain.data.collate import collate_preference
from minitrain.errors import UserError
from minitrain.objectives.preference import (ORPO_METRICS, PAIR_METRICS, PreferenceConfig, ReferenceFreeObjective,
                                             cpo_loss, make_pair_objective, orpo_loss)
from minitrain.train import train
from minitrain.weights import load_pretrained

PAD = 0
# (prompt, chosen, rejected): lengths vary everywhere (the reference-free terms)
VARIED = [
    ([1, 5, 6, 7], [8, 9, 10, 2], [11, 2]),
    ([1, 12, 13], [14, 2], [15, 16, 17, 18, 2]),
    ([1, 19, 20, 21, 22, 23], [24, 25, 2], [26, 27, 28, 2]),
    ([1, 30], [31, 32, 33, 34, 35, 2], [36, 2]),
]
# equal prompt and chosen lengths, rejected lengths vary: TRL's batch-token-mean NLL == our per-pair mean
EVEN = [
    ([1, 5, 6], [8, 9, 10, 2], [11, 2]),
    ([1, 12, 13], [14, 40, 41, 2], [15, 16, 17, 18, 2]),
    ([1, 19, 20], [24, 25, 42, 2], [26, 27, 28, 2]),
    ([1, 30, 43], [31, 32, 33, 2], [36, 37, 38, 39, 44, 2]),
]
# (ours: loss_type, sft_weight, simpo_gamma, label_smoothing) -> TRL trainer and its settings
CASES = {
    "orpo": ("orpo", 1.0, 0.5, 0.0),
    "cpo": ("cpo", 1.0, 0.5, 0.0),
    "cpo_smoothed": ("cpo", 1.0, 0.5, 0.2),
    "simpo": ("simpo", 0.0, 0.5, 0.0),
    "cpo_simpo": ("simpo", 1.0, 1.2, 0.0),
}


def features(pairs) -> list[dict]:
    """The pairs as TRL's ORPO / CPO `tokenize_row` makes them (prompt tokens labelled -100)."""
    out = []
    for p, c, r in pairs:
        out.append({"prompt_input_ids": p, "prompt_attention_mask": [1] * len(p),
                    "chosen_input_ids": p + c, "chosen_attention_mask": [1] * len(p + c),
                    "chosen_labels": [-100] * len(p) + c,
                    "rejected_input_ids": p + r, "rejected_attention_mask": [1] * len(p + r),
                    "rejected_labels": [-100] * len(p) + r})
    return out


def our_examples(pairs) -> list[dict]:
    return [{"chosen_ids": p + c, "chosen_labels": [-100] * len(p) + c,
             "rejected_ids": p + r, "rejected_labels": [-100] * len(p) + r} for p, c, r in pairs]


def _collate(examples):
    return collate_preference(examples, PAD)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from _tok import make_bpe_tokenizer

    return make_bpe_tokenizer(tmp_path_factory.mktemp("tok"))


def load_hf(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def trl_trainer(case: str, model, tok_dir, out, **train_args):
    """TRL's ORPOTrainer (orpo) or CPOTrainer (the rest) set up as `case` says, on `model`."""
    import datasets
    import transformers

    loss_type, sft_weight, gamma, smoothing = CASES[case]
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    ds = datasets.Dataset.from_list([{"prompt": "the a", "chosen": " of to", "rejected": " in and"}] * 2)
    common = dict(output_dir=str(out), report_to=[], use_cpu=True, bf16=False, beta=0.1, disable_tqdm=True,
                  max_length=64, **train_args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if loss_type == "orpo":
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer

            return ORPOTrainer(model=model, args=ORPOConfig(**common), train_dataset=ds, processing_class=tok)
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(loss_type="sigmoid" if loss_type == "cpo" else "simpo", cpo_alpha=sft_weight,
                         simpo_gamma=gamma, label_smoothing=smoothing, **common)
        return CPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)


def our_objective(case: str) -> ReferenceFreeObjective:
    loss_type, sft_weight, gamma, smoothing = CASES[case]
    return ReferenceFreeObjective(loss_type, 0.1, sft_weight, gamma, smoothing)


# ----------------------------------------------------------------------------- the formulas


def test_orpo_and_cpo_formulas_equal_trl_on_the_same_logps(hf_causal, tok_dir, tmp_path):
    """TRL's `odds_ratio_loss` / `cpo_loss` methods fed the same (P,) log-probs as ours."""
    model = load_hf(hf_causal("pref_policy"))
    g = torch.Generator().manual_seed(0)
    c, r = -3 * torch.rand(6, generator=g) - 1e-3, -3 * torch.rand(6, generator=g) - 1e-3  # log-probs < 0
    c[0] = -1e-7  # near log 1: log1mexp's other branch
    orpo = trl_trainer("orpo", model, tok_dir, tmp_path / "o")
    want = orpo.odds_ratio_loss(c, r)
    got = orpo_loss(c, r, 0.1)
    torch.testing.assert_close(got[0], -want[0])  # TRL returns beta * logsigmoid (subtracted from the NLL)
    for i in (1, 2):
        torch.testing.assert_close(got[i], want[i])
    torch.testing.assert_close(got[3].mean(), want[3])
    torch.testing.assert_close(got[4].mean(), want[4])
    for case in ("cpo", "cpo_smoothed", "simpo", "cpo_simpo"):
        trainer = trl_trainer(case, model, tok_dir, tmp_path / case)
        loss_type, _, gamma, smoothing = CASES[case]
        want = trainer.cpo_loss(c, r)
        got = cpo_loss(c, r, beta=0.1, loss_type=loss_type, simpo_gamma=gamma, label_smoothing=smoothing)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- whole forward: loss, metrics, grads


def _trl_loss_and_grads(trainer, batch):
    trainer.model.zero_grad(set_to_none=True)
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    loss.backward()
    return float(loss.detach()), metrics, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def _our_loss_and_grads(objective, model, examples):
    model.zero_grad(set_to_none=True)
    loss_sum, count, metrics = objective(model, _collate(examples))
    (loss_sum / count).backward()
    return float(loss_sum.detach()) / count, metrics, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_metrics_and_gradients_equal_trl(hf_causal, tok_dir, tmp_path, case):
    """Same weights, same pairs: TRL's `get_batch_loss_metrics` + backward on the HF model and our
    objective + backward on ours agree to 1e-5 in the loss, every metric we log (TRL's names) and
    every parameter's gradient. Pairs with equal chosen lengths where there is an NLL term."""
    folder = hf_causal("pref_policy")
    sft_weight = CASES[case][1]
    pairs = EVEN if sft_weight else VARIED
    trainer = trl_trainer(case, load_hf(folder).train(), tok_dir, tmp_path)
    t_loss, t_metrics, t_grads = _trl_loss_and_grads(trainer, trainer.data_collator(features(pairs)))
    ours = load_pretrained(folder, models.from_hf_config).train().requires_grad_(True)  # full fine-tuning
    objective = our_objective(case)
    loss, metrics, grads = _our_loss_and_grads(objective, ours, our_examples(pairs))

    assert loss == pytest.approx(t_loss, abs=1e-5, rel=1e-5)
    names = ORPO_METRICS if case == "orpo" else PAIR_METRICS
    assert set(metrics) == set(names) and set(names) <= set(t_metrics)
    for k in names:
        if k == "nll_loss" and not sft_weight:
            continue  # TRL logs 0 with cpo_alpha=0; ours: the chosen answers' NLL all the same
        assert metrics[k] == pytest.approx(t_metrics[k], abs=1e-5, rel=1e-5), k
    assert 0 < metrics["rewards/accuracies"] < 1 or case == "orpo"
    assert set(grads) == set(t_grads)
    for n, g in grads.items():
        torch.testing.assert_close(g, t_grads[n], rtol=1e-5, atol=1e-6, msg=n)
        assert t_grads[n].abs().sum() > 0, n


def test_nll_is_per_pair_so_grouping_does_not_change_it(hf_causal):
    """Rule 2 for ORPO: the loss of 4 pairs in one micro-batch equals 2 + 2 (summed, / 4) on pairs
    of different lengths; TRL's batch-token-mean NLL would differ."""
    ours = load_pretrained(hf_causal("pref_policy"), models.from_hf_config)
    objective = our_objective("orpo")
    with torch.no_grad():
        whole, n, _ = objective(ours, _collate(our_examples(VARIED)))
        a, na, _ = objective(ours, _collate(our_examples(VARIED[:2])))
        b, nb, _ = objective(ours, _collate(our_examples(VARIED[2:])))
    assert n == na + nb == 4
    assert float(whole) == pytest.approx(float(a + b), abs=1e-5)


@pytest.mark.parametrize("case", ["orpo", "cpo_simpo"])
def test_batch4_accum1_equals_batch2_accum2_in_the_loop(hf_causal, tmp_path, case):
    """Rule 2 through `train()`: one SGD step on 4 pairs of different lengths in one micro-batch
    equals 2 micro-batches of 2 (the unit is the pair, the NLL each pair's own mean)."""
    folder = hf_causal("pref_policy")
    results = []
    for batch_size, accum in ((4, 1), (2, 2)):
        model = load_pretrained(folder, models.from_hf_config).requires_grad_(True)
        loss_type, sft_weight, gamma, _ = CASES[case]
        cfg = PreferenceConfig(out=str(tmp_path / f"{case}{batch_size}"), max_steps=1, batch_size=batch_size,
                               grad_accum=accum, lr=1.0, warmup=0, schedule="constant", max_grad_norm=0.0,
                               loss_type=loss_type, sft_weight=sft_weight, simpo_gamma=gamma, skip_audit=True)
        train(model, make_pair_objective(cfg), our_examples(VARIED), _collate, cfg,
              optimizer=torch.optim.SGD(list(model.parameters()), lr=1.0), log=lambda s: None)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- trajectory vs TRL's trainer


@pytest.mark.parametrize("case", ["orpo", "cpo", "simpo"])
def test_three_sgd_steps_follow_trl_trainer_step_by_step(hf_causal, tok_dir, tmp_path, case):
    """TRL's `Trainer.train()` (its loss, its loop: SGD, constant LR, no clipping) for 3 steps on all
    4 pairs at once, against our `train()` with the same optimizer: the loss of every step and
    the final weights agree."""
    import datasets

    folder = hf_causal("pref_policy")
    pairs = EVEN
    steps, lr = 3, 0.5
    trainer = trl_trainer(case, load_hf(folder), tok_dir, tmp_path / "trl", max_steps=steps, learning_rate=lr,
                          optim="sgd", lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
                          weight_decay=0.0, per_device_train_batch_size=len(pairs), logging_steps=1,
                          save_strategy="no", dataloader_drop_last=False, remove_unused_columns=False)
    trainer.train_dataset = datasets.Dataset.from_list(features(pairs))  # our token ids, as TRL's rows
    trainer.train()
    t_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    t_chosen = [h["rewards/chosen"] for h in trainer.state.log_history if "rewards/chosen" in h]

    ours = load_pretrained(folder, models.from_hf_config).train().requires_grad_(True)
    params = list(ours.parameters())
    loss_type, sft_weight, gamma, smoothing = CASES[case]
    cfg = PreferenceConfig(out=str(tmp_path / "ours"), max_steps=steps, batch_size=len(pairs), lr=lr, warmup=0,
                           schedule="constant", max_grad_norm=0.0, loss_type=loss_type, sft_weight=sft_weight,
                           simpo_gamma=gamma, skip_audit=True)
    train(ours, make_pair_objective(cfg), our_examples(pairs), _collate, cfg,
          optimizer=torch.optim.SGD(params, lr=lr), log=lambda s: None)
    rows = [json.loads(x) for x in (tmp_path / "ours" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    chosen = [r["rewards/chosen"] for r in rows if "rewards/chosen" in r]
    assert len(losses) == len(t_losses) == steps
    assert losses == pytest.approx(t_losses, abs=1e-4)  # TRL's Trainer rounds its logged loss to 4 places
    assert chosen == pytest.approx(t_chosen, abs=1e-5, rel=1e-5)
    assert losses[-1] < losses[0]
    hf = dict(trainer.model.named_parameters())
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.detach(), hf[n].detach(), rtol=1e-5, atol=1e-6, msg=n)


# ----------------------------------------------------------------------------- config


def test_config_refusals_are_one_line():
    validate(PreferenceConfig(model="m", data="d", loss_type="simpo", sft_weight=0.0))
    validate(PreferenceConfig(model="m", data="d", loss_type="cpo", label_smoothing=0.1))
    validate(PreferenceConfig(model="m", data="d", loss_type="orpo"))  # unset: ORPO's own NLL weight, 1
    for bad, key in ((dict(loss_type="orpo", sft_weight=0.0), "sft_weight=0"),
                     (dict(loss_type="simpo", precompute_ref=True), "precompute_ref"),
                     (dict(loss_type="orpo", sft_weight=1.0, label_smoothing=0.1), "label_smoothing"),
                     (dict(loss_type="kto"), "loss_type")):
        with pytest.raises(UserError, match=key) as e:
            validate(PreferenceConfig(model="m", data="d", **bad))
        assert "\n" not in str(e.value) and " — " in str(e.value)


def test_plan_knows_the_reference_free_methods_forwards():
    """minitrain plan's model: orpo / cpo / simpo forward 2 x pairs rows with a graph and no reference
    forward at all (DPO's `sigmoid` with the same keys has one: its peak can only be higher)."""
    from minitrain.plan.decoder import ModelShape
    from minitrain.plan.predict import predict, run_shape

    model = ModelShape.from_hf({"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
                                  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                                  "num_key_value_heads": 8})
    for loss_type in ("orpo", "cpo", "simpo"):
        run = run_shape(PreferenceConfig(loss_type=loss_type, batch_size=2, max_len=1024))
        assert run.rows == 4 and run.dpo_reference == "none"
        assert not any("reference" in m for m in predict(model, run).moments)
    dpo = run_shape(PreferenceConfig(loss_type="sigmoid", batch_size=2, max_len=1024))
    assert dpo.rows == 4 and "DPO reference forward" in predict(model, dpo).moments
