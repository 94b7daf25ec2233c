"""KTO against TRL's `trl.experimental.kto.KTOTrainer` (TRL's stable `KTOTrainer` behind the experimental path).

References: TRL's own `_compute_loss` fed per-token log-probs by a stub model (the formula, the
KL reference point, the weights, every metric); the same on HF models with the same weights as
ours (a separate reference model; a fresh PEFT adapter whose reference is the base), including
every parameter's gradient; TRL's `Trainer.train()` for 3 SGD steps against our loop; the
precomputed reference against the live one; TRL's KL rotation against ours.
"""

from __future__ import annotations

import collections
import json
import types
import warnings

import pytest
import torch

import models
from minitrain.adapters.peft_format import load_adapter
from minitrain.config import validate
from minitrain.data.readers import read_unpaired
from minitrain.errors import UserError
from minitrain.objectives.kto import (KTOConfig, KTOObjective, add_kl_rows, collate_kto, evaluate_kto,
                                      precompute_kto_reference)
from minitrain.objectives.reference import AdapterSnapshotReference, BaseReference, sequence_logps
from minitrain.train import train
from minitrain.weights import load_pretrained

PAD = 0
# (prompt, completion, label) token ids: lengths vary, both labels present
ROWS = [
    ([1, 5, 6, 7], [8, 9, 10, 2], True),
    ([1, 12, 13], [14, 2], False),
    ([1, 19, 20, 21, 22, 23], [24, 25, 2], True),
    ([1, 30], [31, 32, 33, 34, 35, 2], False),
    ([1, 40, 41], [42, 43, 2], True),
]
TRL_METRICS = ("kl", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected", "rewards/margins")


def our_examples(rows=ROWS, block=None) -> list[dict]:
    out = [{"input_ids": p + c, "labels": [-100] * len(p) + c, "label": y, "prompt_len": len(p)} for p, c, y in rows]
    return add_kl_rows(out, block or len(out))


def trl_features(rows=ROWS) -> list[dict]:
    """TRL's rows, with TRL's own KL rotation (`add_kl_completion_ids`: `[c[-1]] + c[:-1]` per batch)."""
    completions = [c for _, c, _ in rows]
    kl = [completions[-1]] + completions[:-1]
    return [{"prompt_ids": p, "completion_ids": c, "KL_completion_ids": k, "label": y}
            for (p, c, y), k in zip(rows, kl)]


def _collate(examples):
    return collate_kto(examples, PAD)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from _tok import make_bpe_tokenizer

    return make_bpe_tokenizer(tmp_path_factory.mktemp("tok"))


def load_hf(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def load_ours(folder):
    return load_pretrained(folder, models.from_hf_config)


def make_trainer(tmp_path, model, tok_dir, ref_model=None, peft_config=None, beta=0.1, dw=1.0, uw=1.0, **kw):
    import datasets
    import transformers

    from trl.experimental.kto import KTOConfig as TRLConfig
    from trl.experimental.kto import KTOTrainer

    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    ds = datasets.Dataset.from_list([{"prompt": "the a", "completion": " of to", "label": True},
                                     {"prompt": "the a", "completion": " in", "label": False}] * 2)
    args = dict(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, beta=beta,
                desirable_weight=dw, undesirable_weight=uw, disable_tqdm=True, gradient_checkpointing=False,
                per_device_train_batch_size=len(ROWS), train_sampling_strategy="sequential")
    args.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return KTOTrainer(model=model, ref_model=ref_model, args=TRLConfig(**args), train_dataset=ds,
                          processing_class=tok, peft_config=peft_config)


def trl_loss(trainer, model, inputs) -> tuple[torch.Tensor, dict]:
    trainer._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    loss = trainer._compute_loss(model, inputs, False)
    mode = "train" if trainer.model.training else "eval"
    return loss, {k: trainer._metrics[mode][k][-1] for k in TRL_METRICS}


def assert_metrics(ours: dict, theirs: dict, tol=1e-5):
    assert set(ours) == set(TRL_METRICS)
    for k in TRL_METRICS:
        assert ours[k] == pytest.approx(theirs[k], abs=tol, rel=tol), k


class OtherModel:
    """A separate reference model: only for comparing with TRL's `ref_model=`, never in minitrain."""

    def __init__(self, model):
        self.model = model

    def logps(self, model, batch):
        with torch.no_grad():
            s = sequence_logps(self.model, batch)
        return s.chosen, s.rejected


# ----------------------------------------------------------------------------- the formula


@pytest.mark.parametrize("beta,dw,uw", [(0.1, 1.0, 1.0), (0.5, 1.33, 0.7)])
def test_kto_on_the_same_logps_equals_trl(hf_causal, tok_dir, tmp_path, beta, dw, uw):
    """TRL's `_compute_loss` with a stub model that returns given per-token log-probs (matched and
    KL rows) and precomputed reference log-probs, against our objective on the same numbers."""
    trainer = make_trainer(tmp_path, load_hf(hf_causal("kto_policy")), tok_dir, ref_model=None, beta=beta, dw=dw,
                           uw=uw, precompute_ref_log_probs=True)
    inputs = trainer.data_collator(trl_features())
    g = torch.Generator().manual_seed(0)
    B = len(ROWS)
    tok = -2 * torch.rand(inputs["input_ids"].shape[0], inputs["input_ids"].shape[1] - 1, generator=g)
    tok_kl = -2 * torch.rand(inputs["KL_input_ids"].shape[0], inputs["KL_input_ids"].shape[1] - 1, generator=g)
    tok = tok * inputs["completion_mask"][:, 1:]  # TRL sums over T: zeros off the completion
    tok_kl = tok_kl * inputs["KL_completion_mask"][:, 1:]
    ref, ref_kl = tok.sum(1) + torch.randn(B, generator=g), tok_kl.sum(1) - 0.5 * torch.rand(B, generator=g)
    inputs = {**inputs, "ref_logps": ref, "ref_KL_logps": ref_kl}

    def stub(**kw):
        lp = tok_kl if kw["input_ids"].shape == inputs["KL_input_ids"].shape and torch.equal(
            kw["input_ids"], inputs["KL_input_ids"]) else tok
        z = torch.zeros_like(lp)
        return types.SimpleNamespace(log_probs=lp, entropy=z, mean_logits=z)

    with torch.no_grad():
        loss, expected = trl_loss(trainer, stub, inputs)

    # ours on the same numbers: policy and reference log-probs through our loss function and metrics
    from minitrain.objectives.kto import _sums, kl_reference_point, kto_loss, metrics_from_sums

    labels = inputs["label"].bool()
    kl = kl_reference_point(tok_kl.sum(1), ref_kl)
    assert float(kl) > 0  # the clamp is not what decides here
    losses, rewards = kto_loss(tok.sum(1), ref, labels, kl, beta=beta, desirable_weight=dw, undesirable_weight=uw)
    ours = metrics_from_sums(*_sums({"loss": losses, "rewards": rewards, "logps": tok.sum(1), "label": labels,
                                     "kl": kl}))
    assert float(losses.mean()) == pytest.approx(float(loss), abs=1e-6)
    assert_metrics(ours, expected)


# ----------------------------------------------------------------------------- whole forward vs TRL


def test_loss_metrics_gradients_with_a_separate_reference_equal_trl(hf_causal, tok_dir, tmp_path):
    """HF policy + HF reference in TRL vs our models from the same safetensors: loss, TRL's metrics
    (z0 from the KL rows included) and the gradient of every parameter, to 1e-5."""
    pol, ref = hf_causal("kto_policy"), hf_causal("kto_ref", seed=1)
    trainer = make_trainer(tmp_path, load_hf(pol).train(), tok_dir, ref_model=load_hf(ref))
    trainer.model.zero_grad()
    loss, expected = trl_loss(trainer, trainer.model, trainer.data_collator(trl_features()))
    loss.backward()
    t_grads = {n: p.grad for n, p in trainer.model.named_parameters()}

    ours = load_ours(pol).train().requires_grad_(True)
    objective = KTOObjective(0.1, reference=OtherModel(load_ours(ref)))
    loss_sum, count, metrics = objective(ours, _collate(our_examples()))
    (loss_sum / count).backward()
    assert count == len(ROWS)
    assert float(loss_sum) / count == pytest.approx(float(loss), abs=1e-5)
    assert expected["kl"] > 0
    assert_metrics(metrics, expected)
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, t_grads[n], rtol=1e-5, atol=1e-6, msg=n)
        assert t_grads[n].abs().sum() > 0, n


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def test_fresh_adapter_reference_is_the_base_as_in_trl_and_precomputed_agrees(hf_causal, tok_dir, tmp_path):
    """TRL with `peft_config` (its reference: adapters disabled) vs our `BaseReference`, after the
    adapter moved; then the same from our precomputed cache (`precompute_kto_reference`)."""
    import peft

    folder = hf_causal("kto_policy")
    trainer = make_trainer(tmp_path, load_hf(folder), tok_dir, peft_config=peft.LoraConfig(**LORA))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_" in n:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    trainer.model.save_pretrained(str(tmp_path / "moved"))
    with torch.no_grad():
        loss, expected = trl_loss(trainer, trainer.model, trainer.data_collator(trl_features()))
    ours = load_ours(folder)
    load_adapter(ours, tmp_path / "moved", trainable=True)
    objective = KTOObjective(0.1, reference=BaseReference())
    with torch.no_grad():
        loss_sum, count, metrics = objective(ours, _collate(our_examples()))
    assert float(loss_sum) / count == pytest.approx(float(loss), abs=1e-5)
    assert_metrics(metrics, expected)

    examples = our_examples()
    assert not precompute_kto_reference(ours, BaseReference(), examples, tmp_path / "ref" / "train", PAD, 2,
                                        log=lambda s: None)
    with torch.no_grad():
        cached_sum, _, cached = KTOObjective(0.1, reference=None)(ours, _collate(examples))
    assert float(cached_sum) == pytest.approx(float(loss_sum), abs=1e-5)
    assert cached == pytest.approx(metrics, abs=1e-5)
    assert precompute_kto_reference(ours, BaseReference(), our_examples(), tmp_path / "ref" / "train", PAD, 2,
                                    log=lambda s: None)  # fresh: reused


def _move_lora(model, seed: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n and ".default." in n:
                p.add_(scale * torch.randn(p.shape, generator=g))


def test_continued_adapter_reference_is_the_stage_a_copy_as_in_trl(hf_causal, tok_dir, tmp_path):
    """Given a trained PEFT adapter, TRL keeps a frozen "ref" copy of it; ours keeps a snapshot of the
    adapter tensors (`AdapterSnapshotReference`). After the policy adapter moves, loss and TRL's
    metrics agree to 1e-5; the adapter-disabled base, the wrong reference here, gives another loss."""
    import peft

    folder = hf_causal("kto_policy")
    torch.manual_seed(0)  # peft draws lora_A from the global generator
    stage_a = peft.get_peft_model(load_hf(folder), peft.LoraConfig(**LORA))
    _move_lora(stage_a, seed=4, scale=0.3)
    stage_a.save_pretrained(str(tmp_path / "stage_a"))
    trl_model = peft.PeftModel.from_pretrained(load_hf(folder), str(tmp_path / "stage_a"), is_trainable=True)
    trainer = make_trainer(tmp_path, trl_model, tok_dir)
    assert "ref" in trainer.model.peft_config  # TRL made its frozen copy of Stage A
    _move_lora(trainer.model, seed=5, scale=0.2)  # "training" moved the policy
    trainer.model.save_pretrained(str(tmp_path / "moved"), selected_adapters=["default"])
    with torch.no_grad():
        loss, expected = trl_loss(trainer, trainer.model, trainer.data_collator(trl_features()))

    ours = load_ours(folder)
    load_adapter(ours, tmp_path / "stage_a", trainable=True)
    reference = AdapterSnapshotReference(ours)  # Stage A, before any step
    load_adapter(ours, tmp_path / "moved", trainable=True)  # the moved policy, into the same layout
    with torch.no_grad():
        loss_sum, count, metrics = KTOObjective(0.1, reference=reference)(ours, _collate(our_examples()))
        _, _, wrong = KTOObjective(0.1, reference=BaseReference())(ours, _collate(our_examples()))
    assert float(loss_sum) / count == pytest.approx(float(loss), abs=1e-5)
    assert_metrics(metrics, expected)
    assert abs(wrong["rewards/chosen"] - expected["rewards/chosen"]) > 1e-3  # the base: other rewards


# ----------------------------------------------------------------------------- trajectory vs TRL's trainer


def test_three_sgd_steps_follow_trl_trainer_step_by_step(hf_causal, tok_dir, tmp_path):
    """TRL's `Trainer.train()` (SGD, constant LR, no clipping, one batch of all rows per step, a
    separate reference model) against our `train()`: every step's metrics and the final weights."""
    import datasets

    pol, ref = hf_causal("kto_policy"), hf_causal("kto_ref", seed=1)
    steps, lr = 3, 2.0
    trainer = make_trainer(tmp_path, load_hf(pol), tok_dir, ref_model=load_hf(ref), max_steps=steps,
                           learning_rate=lr, optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
                           max_grad_norm=0.0, weight_decay=0.0, logging_steps=1, save_strategy="no",
                           remove_unused_columns=False)
    trainer.train_dataset = datasets.Dataset.from_list(trl_features())
    trainer.train()
    hist = [h for h in trainer.state.log_history if "kl" in h]

    ours = load_ours(pol).train().requires_grad_(True)
    cfg = KTOConfig(out=str(tmp_path / "ours"), max_steps=steps, batch_size=len(ROWS), lr=lr, warmup=0,
                    schedule="constant", max_grad_norm=0.0, skip_audit=True)
    train(ours, KTOObjective(0.1, reference=OtherModel(load_ours(ref))), our_examples(), _collate, cfg,
          optimizer=torch.optim.SGD(list(ours.parameters()), lr=lr), log=lambda s: None)
    rows = [json.loads(x) for x in (tmp_path / "ours" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(hist) == steps
    for r, h in zip(rows, hist):
        assert r["loss"] == pytest.approx(h["loss"], abs=1e-4)  # TRL's Trainer rounds its logged loss
        for k in TRL_METRICS:
            assert r[k] == pytest.approx(h[k], abs=1e-5, rel=1e-5), (r["step"], k)
    assert rows[-1]["loss"] < rows[0]["loss"]
    hf = dict(trainer.model.named_parameters())
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.detach(), hf[n].detach(), rtol=1e-5, atol=1e-6, msg=n)


# ----------------------------------------------------------------------------- unit, data, config


def test_the_unit_is_the_row_batch4_accum1_equals_batch2_accum2(hf_causal, tmp_path):
    """Rule 2 for KTO: one SGD step on 4 rows equals 2 micro-batches of 2 when z0 is the same
    (here 0: the reference is the base and the policy starts equal to it, so z0 clamps to 0)."""
    folder = hf_causal("kto_policy")
    results = []
    for batch_size, accum in ((4, 1), (2, 2)):
        model = load_ours(folder).requires_grad_(True)
        cfg = KTOConfig(out=str(tmp_path / f"b{batch_size}"), max_steps=1, batch_size=batch_size, grad_accum=accum,
                        lr=1.0, warmup=0, schedule="constant", max_grad_norm=0.0, skip_audit=True,
                        group_by_length=False)
        ref = OtherModel(load_ours(folder))
        train(model, KTOObjective(0.1, reference=ref), our_examples(ROWS[:4], block=2), _collate, cfg,
              optimizer=torch.optim.SGD(list(model.parameters()), lr=1.0), log=lambda s: None)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_evaluate_kto_weighs_every_row_the_same(hf_causal):
    model = load_ours(hf_causal("kto_policy"))
    objective = KTOObjective(0.1, reference=OtherModel(load_ours(hf_causal("kto_ref", seed=1))))
    examples = our_examples(ROWS[:4], block=2)
    got = evaluate_kto(model, objective, examples, _collate, batch_size=2)
    parts = [objective.row_stats(model, _collate(examples[i : i + 2])) for i in (0, 2)]
    with torch.no_grad():
        loss = torch.cat([p["loss"] for p in parts]).mean()
        rewards = torch.cat([p["rewards"] for p in parts])
        labels = torch.cat([p["label"] for p in parts])
    assert got["eval/loss"] == pytest.approx(float(loss), abs=1e-6)
    assert got["eval/rewards/chosen"] == pytest.approx(float(rewards[labels].mean()), abs=1e-6)
    assert got["eval/kl"] == pytest.approx(float(sum(p["kl"] for p in parts)) / 2, abs=1e-6)


def test_kl_rows_are_trls_rotation_within_blocks():
    ex = our_examples(ROWS, block=2)  # blocks [0, 1], [2, 3], [4]
    comp = [c for _, c, _ in ROWS]
    prompts = [p for p, _, _ in ROWS]
    for i, j in ((0, 1), (1, 0), (2, 3), (3, 2), (4, 4)):
        assert ex[i]["kl_ids"] == prompts[i] + comp[j]
        assert ex[i]["kl_labels"] == [-100] * len(prompts[i]) + comp[j]
    whole = our_examples(ROWS)
    for ours, theirs in zip(whole, trl_features()):
        assert ours["kl_ids"] == theirs["prompt_ids"] + theirs["KL_completion_ids"]


def test_read_unpaired_rows_and_refusals(tmp_path, tok_dir):
    from minitrain.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(tok_dir)
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "the a", "completion": " of to", "label": true}\n'
                    '{"prompt": "the", "completion": " in", "label": false}\n')
    ex = read_unpaired(good, tok, max_len=32)
    assert [e["label"] for e in ex] == [True, False]
    for e in ex:
        p = e["prompt_len"]
        assert e["labels"][:p] == [-100] * p and e["labels"][p:] == e["input_ids"][p:]
        assert e["input_ids"][0] == tok.bos_id and e["input_ids"][-1] == tok.eos_id
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "the a", "completion": " of to", "label": "yes"}\n')
    with pytest.raises(UserError, match=r'bad.jsonl:1: "label" must be true or false') as e:
        read_unpaired(bad, tok, max_len=32)
    assert "\n" not in str(e.value)


def test_config_refuses_a_batch_of_one():
    validate(KTOConfig(model="m", data="d", batch_size=2))
    with pytest.raises(UserError, match="batch_size=1"):
        validate(KTOConfig(model="m", data="d", batch_size=1))


def test_plan_counts_ktos_grad_rows_and_its_double_reference_forward():
    """minitrain plan's model of KTO: batch_size rows with a graph; the reference forward scores the
    rows and their KL rows (2 x batch_size), so its one-block term is twice the 1-row-per-example one."""
    from dataclasses import replace

    from minitrain.plan.decoder import ModelShape
    from minitrain.plan.predict import predict, run_shape, suggestions

    model = ModelShape.from_hf({"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
                                  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                                  "num_key_value_heads": 8})
    run = run_shape(KTOConfig(batch_size=4, max_len=512))
    assert run.rows == 4 and run.reference_rows == 8 and run.dpo_reference == "base"
    ref = {t.name: t.bytes for t in predict(model, run).moments["DPO reference forward"]}
    same = {t.name: t.bytes for t in predict(model, replace(run, reference_rows=None)).moments["DPO reference forward"]}
    one = "reference forward: one block (no grad)"
    assert ref[one] == 2 * same[one]
    halved = [r for keys, _, r in suggestions(model, run, 4, 1) if keys.startswith("batch_size=2")]
    assert halved and halved[0] == predict(model, replace(run, rows=2, reference_rows=4)).peak
