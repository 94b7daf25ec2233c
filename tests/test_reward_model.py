"""Reward models (`recipes/reward_model.py`, `minitrain.objectives.reward_model`).

- loss, gradients and metrics equal TRL's RewardTrainer on the same token ids (with and without the
  margin column and `center_rewards_coefficient`), on a tiny transformers `LlamaForSequenceClassification`;
- the recipe through the command line, LoRA and full: the saved folder scores as transformers'
  `AutoModelForSequenceClassification` does (full) and as peft's `PeftModel` over it (LoRA + head);
- GRPO's `rewards=model:DIR` scores with that folder; bad inputs are one line, exit 2.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tok import corpus, make_bpe_tokenizer

import models
from minitrain.data.readers import read_preference
from minitrain.errors import UserError
from minitrain.adapters.peft_format import load_adapter
from minitrain.objectives.reward_model import (ModelReward, RewardObjective, attach_score, collate_reward_pairs,
                                               last_non_pad, sequence_rewards, with_scalar_head)
from minitrain.text.tokenizer import Tokenizer
from minitrain.weights import load_pretrained

REPO = Path(__file__).resolve().parents[1]
PAD = 0
# (chosen, rejected, margin) token ids of 4 pairs of different lengths (eos = 2 ends each)
PAIRS = [
    ([1, 5, 6, 7, 8, 9, 2], [1, 5, 6, 7, 11, 2], 0.5),
    ([1, 12, 13, 14, 2], [1, 12, 13, 15, 16, 17, 18, 2], -0.25),
    ([1, 19, 20, 21, 22, 23, 24, 25, 2], [1, 19, 26, 27, 2], 1.0),
    ([1, 30, 31, 32, 33, 2], [1, 30, 36, 2], 0.0),
]


def our_examples(margin: bool, pairs: list = PAIRS) -> list[dict]:
    return [{"chosen_ids": c, "chosen_labels": c, "rejected_ids": r, "rejected_labels": r,
             **({"margin": m} if margin else {})} for c, r, m in pairs]


@pytest.fixture(scope="module")
def rm_folder(hf_causal, tmp_path_factory) -> Path:
    """A tiny transformers LlamaForSequenceClassification (num_labels 1, pad 0) with a BPE tokenizer."""
    import transformers

    folder = tmp_path_factory.mktemp("rm") / "model"
    torch.manual_seed(0)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(hf_causal("rm_base")), num_labels=1,
                                                                         pad_token_id=PAD)
    with torch.no_grad():
        hf.score.weight.normal_(0, 0.3)  # a head that matters (transformers draws it at 0.02)
    hf.save_pretrained(folder)
    make_bpe_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def trl_trainer(rm_folder, tmp_path_factory):
    import datasets
    import transformers
    import trl

    tok = transformers.AutoTokenizer.from_pretrained(str(rm_folder))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(rm_folder), dtype=torch.float32)
    ds = datasets.Dataset.from_list([{"chosen": "the a", "rejected": "of to"}] * 2)
    args = trl.RewardConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[], use_cpu=True, bf16=False,
                            disable_tqdm=True, gradient_checkpointing=False)
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    assert trainer.model.config.pad_token_id == PAD
    return trainer


# PAIRS with 30 more tokens in each answer: rows of 32+ positions, so a padded CPU batch runs unpadded and the
# last layer for the scored positions only (models/layers.py `Queries`)
LONG_PAIRS = [(c[:-1] + list(range(40, 70)) + c[-1:], r[:-1] + list(range(70, 100)) + r[-1:], m) for c, r, m in PAIRS]


# LONG_PAIRS after a 40-token prompt: with shared_prompt=true, rows [prompt, chosen rest, rejected rest] of 32+
# tokens a sequence, which a CPU runs sequence by sequence (models/layers.py `document_runs`)
PROMPT = [3 + (7 * i) % 120 for i in range(40)]
SHARED_PAIRS = [(c[:1] + PROMPT + c[1:], r[:1] + PROMPT + r[1:], m) for c, r, m in LONG_PAIRS]


@pytest.mark.parametrize("margin,center,pairs,shared", [
    (False, None, PAIRS, False), (True, None, PAIRS, False), (True, 0.01, PAIRS, False), (False, 0.3, PAIRS, False),
    (False, None, LONG_PAIRS, False), (True, 0.01, LONG_PAIRS, False), (True, 0.01, PAIRS, True),
    (True, 0.01, SHARED_PAIRS, True)], ids=str)
def test_loss_gradients_and_metrics_equal_trl_reward_trainer(trl_trainer, rm_folder, margin, center, pairs, shared):
    trainer = trl_trainer
    trainer.args.center_rewards_coefficient = center
    trainer._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    hf = trainer.model.train()
    hf.zero_grad()
    inputs = trainer.data_collator([{"chosen_ids": c, "rejected_ids": r, **({"margin": m} if margin else {})}
                                    for c, r, m in pairs])
    loss = trainer.compute_loss(hf, inputs)
    loss.backward()
    theirs = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}

    ours_model = load_pretrained(rm_folder, with_scalar_head(models.from_hf_config)).train()
    for p in ours_model.parameters():
        p.requires_grad_(True)
    objective = RewardObjective(PAD, center)
    batch = collate_reward_pairs(our_examples(margin, pairs), PAD, shared_prompt=shared)
    if shared:  # one row per pair; long enough rows run sequence by sequence, the last layer at the scores only
        assert batch["input_ids"].shape[0] == len(pairs)
        layout = ours_model.model.document_layout(batch["document_ids"], batch["position_ids"])
        assert (layout is not None) == (pairs is SHARED_PAIRS)
    loss_sum, count, metrics = objective(ours_model, batch)
    (loss_sum / count).backward()

    assert float(loss_sum.detach() / count) == pytest.approx(float(loss), abs=1e-5, rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(trainer._metrics["train"]["accuracy"][-1], abs=1e-6)
    assert metrics["margin"] == pytest.approx(trainer._metrics["train"]["margin"][-1], abs=1e-5)
    assert metrics["mean_reward"] == pytest.approx(trainer._metrics["train"]["mean_reward"][-1], abs=1e-5)
    grads = {n: p.grad for n, p in ours_model.named_parameters() if p.grad is not None}
    assert set(grads) == set(theirs)  # score.weight and every body tensor; no lm_head
    for n, g in theirs.items():
        torch.testing.assert_close(grads[n], g, atol=1e-5, rtol=1e-5, msg=n)


def test_last_non_pad_is_transformers_rule():
    ids = torch.tensor([[5, 6, 0, 0], [0, 7, 8, 9], [4, 0, 5, 0], [0, 0, 0, 0]])
    assert last_non_pad(ids, 0).tolist() == [1, 3, 2, 0]


def test_margin_column_is_read_and_bad_margins_are_one_line(tmp_path, rm_folder):
    tok = Tokenizer.from_folder(rm_folder)
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "the a", "chosen": " of to", "rejected": " in", "margin": 1.5}) + "\n"
                    + json.dumps({"prompt": "the", "chosen": " and", "rejected": " is"}) + "\n")
    ex = read_preference(good, tok, max_len=64, margin=True)
    assert [e["margin"] for e in ex] == [1.5, 0.0]
    assert "margin" not in read_preference(good, tok, max_len=64)[0]  # DPO reads no margin
    from minitrain.data.store_build import open_or_build  # the token store keeps the floats bit for bit

    store = open_or_build(tmp_path / "cache", [str(good)], "preference", read_preference, tok,
                          {"max_len": 64, "margin": True}, workers=1)
    assert [store[i]["margin"] for i in range(len(store))] == [1.5, 0.0] and store[1] == ex[1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "the", "chosen": " of", "rejected": " in", "margin": "high"}) + "\n")
    with pytest.raises(UserError, match=r'bad.jsonl:1: "margin" is \'high\', not a finite number'):
        read_preference(bad, tok, max_len=64, margin=True)


# ----------------------------------------------------------------------------- the command line


def _pairs_file(path: Path, n: int = 12, seed: int = 5, **extra) -> Path:
    lines = [t.split() for t in corpus(n, seed=seed)]
    path.write_text("".join(json.dumps({"prompt": " ".join(w[:3]), "chosen": " " + (" ".join(w[3:6]) or "yes"),
                                        "rejected": " " + (" ".join(w[6:8]) or "no"), "margin": i % 3 * 0.5,
                                        **extra}) + "\n" for i, w in enumerate(lines)))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "minitrain", str(REPO / "recipes" / "reward_model.py"), *args],
                          capture_output=True, text=True, env=env, timeout=None)


def _texts_batch(folder: Path, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    tok = Tokenizer.from_folder(folder)
    rows = [[tok.bos_id] + tok.encode(t) + [tok.eos_id] for t in ("the a of to", "in", "and is it that was for")]
    T = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    return ids, (ids != pad).long()


@pytest.fixture(scope="module")
def base_model(tiny_model) -> Path:
    return tiny_model  # a tiny causal LLaMA with a BPE tokenizer (pad 0)


@pytest.fixture(scope="module")
def full_run(base_model, tmp_path_factory) -> Path:
    """`recipes/reward_model.py finetune=full` through the command line, 3 steps; its out folder."""
    tmp = tmp_path_factory.mktemp("rm_full")
    data = _pairs_file(tmp / "prefs.jsonl")
    out = tmp / "run"
    r = _cli(f"model={base_model}", f"data={data}", f"eval_data={data}", "finetune=full", "max_steps=3",
             "batch_size=4", "max_len=64", "center_rewards_coefficient=0.01", f"out={out}", "device=cpu")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out accuracy" in r.stdout
    return out


def test_cli_full_finetune_saves_a_folder_transformers_scores_equally(full_run):
    import transformers

    out = full_run
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 3] and all("eval/accuracy" in row for row in rows)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "accuracy" in metrics[0] and "eval/accuracy" in metrics[-1]

    folder = out / "model"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["pad_token_id"] == PAD
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert hf.config.num_labels == 1
    ours = load_pretrained(folder, with_scalar_head(models.from_hf_config)).eval()
    ids, mask = _texts_batch(folder, PAD)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits[:, 0]
        mine = sequence_rewards(ours, ids, mask, PAD)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)

    # GRPO's rewards=model:DIR: TRL's reward signature, the same scores as transformers on the same rows
    reward = ModelReward(folder, models.from_hf_config, device="cpu", batch_size=2)
    values = reward(prompts=["the a", "in"], completions=[" of to", " and"])
    tok = Tokenizer.from_folder(folder)
    rows = [[tok.bos_id] + tok.encode(p) + tok.encode(c, continuation=True) + [tok.eos_id]
            for p, c in (("the a", " of to"), ("in", " and"))]
    with torch.no_grad():
        for row, v in zip(rows, values):
            assert v == pytest.approx(float(hf(input_ids=torch.tensor([row])).logits[0, 0]), abs=1e-5)


def test_cli_lora_adapter_loads_in_peft_with_equal_scores(base_model, tmp_path):
    import peft
    import transformers

    data = _pairs_file(tmp_path / "prefs.jsonl")
    out = tmp_path / "run"
    r = _cli(f"model={base_model}", f"data={data}", "eval_split=0.25", "max_steps=3", "batch_size=4",
             "max_len=64", "lora_r=4", "lora_alpha=8", "lr=0.01", f"out={out}", "device=cpu")
    assert r.returncode == 0, r.stderr[-3000:]
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and adapter["modules_to_save"] == ["score"]

    base = transformers.AutoModelForSequenceClassification.from_pretrained(str(base_model), num_labels=1,
                                                                           pad_token_id=PAD, dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    ours = load_pretrained(base_model, with_scalar_head(models.from_hf_config))
    attach_score(ours, 123, PAD)  # a head of other values: the adapter's modules_to_save replaces it
    load_adapter(ours, out / "adapter")
    ids, mask = _texts_batch(base_model, PAD)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits[:, 0]
        mine = sequence_rewards(ours.eval(), ids, mask, PAD)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    assert theirs.std() > 0  # the rows score differently: the comparison means something

    # minitrain merge folds it into an XForSequenceClassification folder (GRPO's rewards=model:DIR)
    from minitrain.commands.merge import merge

    merged = merge(str(base_model), str(out / "adapter"), str(tmp_path / "merged"))
    hf_merged = transformers.AutoModelForSequenceClassification.from_pretrained(str(merged), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(hf_merged.eval()(input_ids=ids, attention_mask=mask).logits[:, 0], theirs,
                                   atol=1e-5, rtol=1e-5)
    ModelReward(merged, models.from_hf_config)  # taken as a reward model


def test_cli_bad_inputs_are_one_line_exit_2(base_model, tmp_path):
    rows = tmp_path / "no_rejected.jsonl"
    rows.write_text(json.dumps({"prompt": "the", "chosen": " a"}) + "\n")
    r = _cli(f"model={base_model}", f"data={rows}", f"out={tmp_path / 'o'}", "device=cpu")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "no_rejected.jsonl:1" in r.stderr and "rejected" in r.stderr and not (tmp_path / "o").exists()

    margins = _pairs_file(tmp_path / "bad_margin.jsonl", n=3)
    margins.write_text(margins.read_text().replace('"margin": 0.5', '"margin": "lots"'))
    r = _cli(f"model={base_model}", f"data={margins}", f"out={tmp_path / 'o'}", "device=cpu", "data_cache=false")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "bad_margin.jsonl:2" in r.stderr and '"margin"' in r.stderr

    from minitrain.config import validate
    from minitrain.objectives.configs import RewardConfig

    with pytest.raises(UserError, match="parallel=fsdp: a reward model's new scalar head is not sharded yet"):
        validate(RewardConfig(model="m", data="d", parallel="fsdp"))
    cfg = RewardConfig(model="m", data="d", modules_to_save=["model.norm"])
    validate(cfg)
    assert cfg.modules_to_save == ["model.norm", "score"]  # the new head always trains (LoRA)


def test_grpo_scores_with_the_reward_model_folder(full_run, base_model, tmp_path, capsys):
    from minitrain.cli import run_cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(w.split()[:3])}) + "\n" for w in corpus(4, seed=9)))
    out = tmp_path / "grpo"
    code = run_cli([str(REPO / "recipes" / "grpo_qwen.py"), f"model={base_model}", f"data={prompts}",
                    f"rewards=model:{full_run / 'model'}", "num_generations=2", "max_completion_length=4",
                    "max_steps=2", "batch_size=2", "lora_r=4", "lora_alpha=8", "device=cpu", f"out={out}"])
    assert code == 0, capsys.readouterr().err[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(isinstance(row["rewards/model/mean"], float) for row in rows), rows[0]

    code = run_cli([str(REPO / "recipes" / "grpo_qwen.py"), f"model={base_model}", f"data={prompts}",
                    f"rewards=model:{base_model}", "device=cpu", f"out={tmp_path / 'bad'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "has no scalar head" in err, err
    assert not (tmp_path / "bad").exists()


def test_memory_plan_counts_grpos_reward_model(rm_folder, base_model):
    from minitrain.objectives.configs import GRPOConfig
    from minitrain.plan.predict import predict, run_shape, shape_from_hf

    cfg = GRPOConfig(model=str(base_model), rewards=f"model:{rm_folder}", max_len=64, max_completion_length=16,
                     batch_size=2, num_generations=4)
    run = run_shape(cfg, device="cpu")
    plan = predict(shape_from_hf(json.loads((base_model / "config.json").read_text())), run)
    counted = sum(t.bytes for t in plan.persistent if t.name.startswith("reward model weights"))
    loaded = load_pretrained(rm_folder, with_scalar_head(models.from_hf_config))
    assert counted == sum(p.numel() * p.element_size() for p in loaded.parameters())
    assert "GRPO reward model scoring (no grad)" in plan.moments
    assert run_shape(GRPOConfig(model=str(base_model)), device="cpu").reward_model is None


def test_model_reward_refuses_a_folder_without_a_scalar_head(base_model, rm_folder, tmp_path):
    with pytest.raises(UserError, match=r"rewards=model:.*has no scalar head \(no score.weight\)"):
        ModelReward(base_model, models.from_hf_config)
    with pytest.raises(UserError, match=r"no such folder"):
        ModelReward(tmp_path / "missing", models.from_hf_config)
    ModelReward(rm_folder, models.from_hf_config)  # a transformers-made reward model is taken


FAMILIES = ["qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe", "qwen2_moe", "mixtral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_decoder_family_scores_as_transformers_sequence_classification(hf_causal, tmp_path, family):
    """A transformers XForSequenceClassification folder of each family loads here (its `score`, no
    lm_head) and scores a right-padded batch as transformers does, at each row's last non-pad token."""
    import transformers
    from test_families import FAMILY_VARIANTS
    from test_moe import MOE_VARIANTS

    variants = {**FAMILY_VARIANTS, **MOE_VARIANTS}
    causal = hf_causal(f"fam_{family}" if family in FAMILY_VARIANTS else f"moe_{family}", **variants[family])
    torch.manual_seed(1)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(causal), num_labels=1, pad_token_id=PAD,
                                                                         dtype=torch.float32)
    with torch.no_grad():
        hf.score.weight.normal_(0, 0.3)
    hf.save_pretrained(tmp_path / "rm")
    ours = load_pretrained(tmp_path / "rm", with_scalar_head(models.from_hf_config)).eval()
    assert ours.lm_head is None and ours.score.weight.shape == (1, hf.config.hidden_size)
    rows = [[1, 5, 9, 17, 33, 40, 2], [1, 7, 2], [1, 11, 12, 13, 2]]
    T = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (T - len(r)) for r in rows])
    mask = (ids != PAD).long()
    with torch.no_grad():
        theirs = hf.eval()(input_ids=ids, attention_mask=mask).logits[:, 0]
        mine = sequence_rewards(ours, ids, mask, PAD)
    torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-4)


SHORTCUT_FAMILIES = ["llama", "llama_checkpointed", "gemma2", "gemma3", "phi3_partial_window", "qwen3_moe", "mixtral",
                     "gpt_oss", "qwen3_5", "gemma4"]


@pytest.mark.parametrize("family", SHORTCUT_FAMILIES)
def test_reading_the_scored_positions_only_equals_the_full_forward(hf_causal, family):
    """`sequence_rewards` asks the model for the scored positions only (`read_at`): on a padded CPU batch of
    rows of 32+ positions the last layer then runs its queries, MLP and final norm for those rows alone
    (models/layers.py `Queries`). Scores and every gradient equal the full forward's, gathered after it:
    LLaMA, Gemma 2 (score soft-cap, window 5), Gemma 3 (local / global layers), Phi-3 (partial rotary,
    window 6), the MoE families (experts, a window, gpt-oss's sinks), Qwen3.5 (DeltaNet layers before a
    gated full-attention last layer), LLaMA under the engine's activation checkpointing. Gemma 4 (no
    unpadded path) runs the full forward and gathers."""
    from minitrain.train import enable_checkpointing
    from test_families import FAMILY_VARIANTS
    from test_gemma4 import CONFIGS, TEXT
    from test_moe import MOE_VARIANTS
    from test_qwen3_5 import QWEN35

    if family in ("llama", "llama_checkpointed"):
        folder = hf_causal("rm_base")
    elif family == "qwen3_5":
        folder = hf_causal("qwen3_5", **QWEN35)
    elif family == "gemma4":
        folder = hf_causal("rm_gemma4", model_type="gemma4_text", **TEXT, **CONFIGS["dense"])
    elif family in FAMILY_VARIANTS:
        folder = hf_causal(f"fam_{family}", **FAMILY_VARIANTS[family])
    else:
        folder = hf_causal(f"moe_{family}", **MOE_VARIANTS[family])
    model = load_pretrained(folder, with_scalar_head(models.from_hf_config)).train()
    attach_score(model, 0, PAD)
    for p in model.parameters():
        p.requires_grad_(True)
    if family == "llama_checkpointed":
        assert enable_checkpointing(model) == 2
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 100, (n,), generator=g).tolist() + [2] for n in (40, 33, 47, 36)]
    rows[2][-1] = PAD  # pad == eos: the scored token is the one before this row's last real token
    T = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    at = last_non_pad(ids, PAD)
    assert at.tolist() == [40, 33, 46, 36]

    seen: list[int] = []  # the rows the last layer's MLP saw
    mlp = model.model.layers[-1].mlp
    hook = mlp.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[:-1].numel()))
    fast = sequence_rewards(model, ids, mask, PAD)
    hook.remove()
    assert seen == [4 * T if family == "gemma4" else 4]
    fast.square().sum().backward()
    fast_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    full = model.score(model(ids, mask)[torch.arange(4), at]).squeeze(-1)  # (B,) from every position's hidden
    full.square().sum().backward()
    torch.testing.assert_close(fast, full, atol=1e-5, rtol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(fast_grads) == set(grads)
    for n, grad in grads.items():  # float rounding: within 1e-5 of the tensor's largest entry (gpt-oss's reach 20)
        torch.testing.assert_close(fast_grads[n], grad, atol=1e-5 * max(1.0, float(grad.abs().max())), rtol=1e-5, msg=n)


def test_a_killed_run_resumes_bitwise(base_model, tmp_path, capsys):
    """stop_after=2 then resume=true: the steps after the checkpoint equal the uninterrupted run's (the
    head in modules_to_save, the margin column, the optimizer state all in the checkpoint). The same run
    with shared_prompt=true logs the same steps to float rounding."""
    from minitrain.cli import run_cli

    data = _pairs_file(tmp_path / "prefs.jsonl")
    args = [str(REPO / "recipes" / "reward_model.py"), f"model={base_model}", f"data={data}", "max_steps=4",
            "batch_size=2", "max_len=64", "lora_r=4", "lora_alpha=8", "lr=0.01", "device=cpu", "log_every=1",
            "center_rewards_coefficient=0.05"]
    assert run_cli([*args, f"out={tmp_path / 'a'}"]) == 0
    assert run_cli([*args, f"out={tmp_path / 'b'}", "stop_after=2"]) == 0
    assert run_cli([*args, f"out={tmp_path / 'b'}", "resume=true"]) == 0, capsys.readouterr().err[-2000:]
    rows = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("a", "b")]
    assert [r["step"] for r in rows[1]] == [1, 2, 3, 4]
    for x, y in zip(*rows):
        assert (x["loss"], x["grad_norm"], x["accuracy"]) == (y["loss"], y["grad_norm"], y["accuracy"])
    # shared_prompt=true: a row [prompt, chosen rest, rejected rest] per pair, the same run to float rounding
    assert run_cli([*args, f"out={tmp_path / 'c'}", "shared_prompt=true"]) == 0
    shared = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    for x, y in zip(rows[0], shared, strict=True):
        assert (x["loss"], x["grad_norm"], x["accuracy"]) == pytest.approx((y["loss"], y["grad_norm"], y["accuracy"]),
                                                                          abs=1e-5, rel=1e-5)
