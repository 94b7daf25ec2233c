"""RLOO against TRL's RLOOTrainer (the reference), on the same weights, prompts and fixed completions.

- the loss, its clip metrics and every parameter's gradient equal `trl.RLOOTrainer._compute_loss`'s,
  with the old log-probs equal to the current ones and off them (clipping bites), and an asymmetric clip;
- the advantages equal TRL's lines (leave-one-out over the scored siblings, None rewards, the KL
  penalty in the reward, normalize_advantages; under torchrun over every rank's advantages);
- `GRPOObjective` with loss_type=rloo, from the rollout to the loss over two SGD steps, equals TRL's
  `_prepare_inputs` + `_compute_loss` (num_iterations=2 reuse; beta > 0 with the KL in the rewards).
  lr 0.2 there: with the unnormalised advantages (up to ~5) at lr 0.5, step 2's gradients drift by up
  to 2e-4 on a few embedding entries, with or without beta (step 1's 1e-6 differences amplified);
- the GRPO recipe runs it from the command line (a wrong key is one line) and the demo learns with it.
"""

from __future__ import annotations

import collections

import pytest
import torch

import models
from minitrain.objectives.grpo import completion_logps
from minitrain.objectives.rloo import rloo_advantages, rloo_loss
from minitrain.weights import load_pretrained
from test_grpo import MAX_COMPLETION, TEMPERATURE, batch_tensors, trl_trainer


@pytest.fixture(scope="module")
def trainer(hf_causal, tmp_path_factory):
    """A TRL RLOOTrainer on a tiny Qwen2 (a few seconds to build: once per module)."""
    return trl_trainer(hf_causal, tmp_path_factory, "RLOOTrainer", beta=0.0)


CLIP_METRICS = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]


@pytest.mark.parametrize("old,eps_high", [(False, None), (True, None), (True, 0.28)])
def test_loss_and_gradients_equal_trl(trainer, old, eps_high):
    t, folder = trainer
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch_tensors()
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])
    ours = load_pretrained(folder, models.from_hf_config)
    ours.train()
    with torch.no_grad():
        now, _ = completion_logps(ours, prompt_ids, prompt_mask, completion_ids, completion_mask, TEMPERATURE)
    # old log-probs off the current ones (the policy moved since sampling): the sequence ratios of
    # rows 0 and 1 leave [1 - eps, 1 + eps_high] on the side their advantage clips, rows 2 and 3 stay
    old_logps = now + torch.tensor([[-0.3], [0.3], [0.01], [-0.01]]) * completion_mask if old else None
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages,
              "old_logps": ((now if old_logps is None else old_logps) * completion_mask).sum(1)}
    t.epsilon_low, t.epsilon_high = 0.2, eps_high or 0.2
    t._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    t.model.zero_grad(set_to_none=True)
    expected = t._compute_loss(t.model, inputs)
    expected.backward()
    expected_grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
    expected_metrics = {k: t._metrics["train"][k][-1] for k in ["entropy", *CLIP_METRICS]}

    for p in ours.parameters():
        p.requires_grad_(True)
    logps, ent = completion_logps(ours, prompt_ids, prompt_mask, completion_ids, completion_mask, TEMPERATURE,
                                  entropy=True, group=2)
    loss_sum, count, stats = rloo_loss(logps, advantages, completion_mask, old_logps=old_logps, epsilon=0.2,
                                       epsilon_high=eps_high)
    loss = loss_sum / count
    loss.backward()
    assert float(loss) == pytest.approx(float(expected), abs=1e-5, rel=1e-5)
    metrics = {"entropy": float(ent.sum()) / float(stats["tokens"]),
               **{k: float(a) / float(n) for k, (a, n) in stats["means"].items()}}
    assert metrics == pytest.approx(expected_metrics, abs=1e-5, rel=1e-5)
    if old:
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0  # both sides clipped
        assert metrics["clip_ratio/region_mean"] < 1  # and some rows not
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert expected_grads and set(expected_grads) <= set(grads)
    for n, ref in expected_grads.items():
        torch.testing.assert_close(grads[n], ref, atol=1e-5, rtol=1e-4, msg=n)


def trl_rloo_advantages(rewards_per_func, weights, G, kl, beta, normalize):
    """TRL 1.16's `RLOOTrainer._generate_and_score_completions` advantage lines, with its own `nanstd`."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    if beta != 0.0:
        rewards = rewards - beta * kl
    grouped = rewards.view(-1, G)
    std = nanstd(grouped, dim=1)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1)).view(-1)
    adv = rewards - baselines
    if normalize:
        adv = (adv - torch.nanmean(adv)) / (nanstd(adv) + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("normalize", [False, True])
def test_advantages_equal_trl(beta, normalize):
    nan = float("nan")
    # groups of 3: all scored; one unscored (None from every function); one scored alone; equal rewards
    rewards = torch.tensor([[1.0, 0.5], [0.0, nan], [2.0, 1.0],
                            [3.0, 0.0], [nan, nan], [1.0, 4.0],
                            [nan, nan], [2.5, nan], [nan, nan],
                            [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    weights = torch.tensor([1.0, 0.5])
    g = torch.Generator().manual_seed(0)
    old, ref = torch.randn(12, 5, generator=g), torch.randn(12, 5, generator=g)
    mask = (torch.rand(12, 5, generator=g) > 0.3).float()
    kl = ((old - ref) * mask).sum(-1)  # the first-order estimate, summed over the completion's tokens
    ours, _, zero = rloo_advantages(rewards, weights, 3, kl=kl, beta=beta, normalize=normalize)
    expected, expected_zero = trl_rloo_advantages(rewards, weights, 3, kl, beta, normalize)
    torch.testing.assert_close(ours, expected)
    assert zero.tolist() == expected_zero.repeat_interleave(3).tolist()
    assert ours[4] == 0 and ours[6:9].tolist() == [0.0, 0.0, 0.0]  # unscored, and scored without a sibling
    if not beta and not normalize:
        assert ours[0] == pytest.approx(1.25 - (0.0 + 2.5) / 2) and ours[9:].tolist() == [0.0, 0.0, 0.0]


SPLIT = [[1.0, 0.5], [0.0, float("nan")], [2.0, 1.0], [2.0, 3.0], [5.0, 0.0], [3.0, 0.0], [0.0, 0.0], [4.0, 2.0]]


def normalize_worker(rank: int, out: str) -> None:
    """Rank r holds the groups r, r + 2, ... of SPLIT (2 completions a group), as torchrun splits prompts."""
    import json
    from pathlib import Path

    rows = torch.tensor(SPLIT).view(-1, 2, 2)[rank::2].reshape(-1, 2)
    adv, _, _ = rloo_advantages(rows, torch.tensor([1.0, 0.5]), 2, normalize=True)
    Path(out, f"adv{rank}.json").write_text(json.dumps(adv.tolist()))


def test_normalize_advantages_under_torchrun_uses_every_ranks_advantages(tmp_path):
    """normalize_advantages with 2 ranks: each rank's advantages are TRL's over the whole batch (its
    gathered rewards), not over the rank's own share."""
    import json

    from test_distributed import launch

    launch(tmp_path, "normalize_worker", str(tmp_path), module="test_rloo")
    ref, _ = trl_rloo_advantages(torch.tensor(SPLIT), torch.tensor([1.0, 0.5]), 2, None, 0.0, True)
    ref = ref.view(-1, 2)
    for rank in (0, 1):
        got = torch.tensor(json.loads((tmp_path / f"adv{rank}.json").read_text()))
        torch.testing.assert_close(got, ref[rank::2].reshape(-1))
    own, _ = trl_rloo_advantages(torch.tensor(SPLIT).view(-1, 2, 2)[0::2].reshape(-1, 2), torch.tensor([1.0, 0.5]),
                                 2, None, 0.0, True)
    assert not torch.allclose(own, ref[0::2].reshape(-1))  # one rank's share alone would normalise otherwise


def test_grpo_recipe_runs_rloo_from_the_command_line(tmp_path, capsys):
    """`loss_type=rloo` on the GRPO recipe's demo: two steps with the KL penalty (beta, against the adapter
    off) and normalize_advantages; metrics.jsonl has TRL's RLOO metrics and the adapter is written.
    With scale_rewards (GRPO's) it is one line and exit 2."""
    import json
    from pathlib import Path

    from minitrain.cli import run_cli

    root = Path(__file__).resolve().parent.parent
    recipe, demo = str(root / "recipes" / "grpo_qwen.py"), root / "demo" / "grpo"
    args = [f"model={demo / 'model'}", f"data={demo / 'train.jsonl'}", "rewards=last_digit", "loss_type=rloo",
            "max_steps=2", "batch_size=4", "num_generations=4", "max_completion_length=16", "max_len=48",
            "lr=2e-3", "schedule=constant", "warmup=0", "lora_r=4", "lora_alpha=8", "checkpointing=false",
            "grad_accum=1"]
    out = tmp_path / "run"
    assert run_cli([recipe, f"out={out}", *args, "beta=0.04", "normalize_advantages=true"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    for k in ("reward", "frac_reward_zero_std", "kl", "clip_ratio/region_mean", "entropy"):
        assert k in steps[-1], k
    assert all(r["loss"] == r["loss"] for r in steps) and (out / "adapter").is_dir()

    capsys.readouterr()
    assert run_cli([recipe, f"out={tmp_path / 'bad'}", *args, "scale_rewards=batch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scale_rewards=batch" in err[0] and "normalize_advantages" in err[0]
    assert not (tmp_path / "bad").exists()


def _sum_mod_10(prompts, completions, completion_ids, **kw):
    """A reward that differs within both groups of the fixed completions: no advantage is 0."""
    return [float(sum(ids) % 10) for ids in completion_ids]


class _InitialWeights:
    """The reference as TRL's RLOOTrainer builds it for a full model: the policy's starting weights."""

    def __init__(self, model):
        self.init = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def applied(self, model):
        import contextlib

        @contextlib.contextmanager
        def swapped():
            now = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.load_state_dict(self.init)
            try:
                yield
            finally:
                model.load_state_dict(now)
        return swapped()


@pytest.mark.parametrize("num_iterations,beta,normalize", [(2, 0.0, True), (1, 0.05, False)])
def test_rollout_to_loss_equals_trl(hf_causal, tmp_path, monkeypatch, num_iterations, beta, normalize):
    """`GRPOObjective` with loss_type=rloo from the rollout to the loss, two optimizer steps, against TRL's
    RLOOTrainer `_prepare_inputs` + `_compute_loss` on the same fixed completions (generation replaced on
    both sides), the same SGD step in between, mask_truncated_completions on: loss and every gradient
    equal at both steps. num_iterations=2: step 2 reuses step 1's rollout and old log-probs;
    beta > 0: each step samples, and step 2's KL (the moved policy against the starting weights) enters
    the rewards."""
    import datasets
    import transformers
    import trl
    from _tok import make_bpe_tokenizer

    import minitrain.objectives.grpo as grpo_module
    from minitrain.objectives.grpo import GRPOConfig, GRPOObjective
    from minitrain.objectives.sampling import Completions
    from minitrain.text.tokenizer import Tokenizer
    from test_grpo import COMPLETIONS, PROMPTS

    folder = hf_causal("grpo_policy", model_type="qwen2", num_key_value_heads=2)
    tok_dir = make_bpe_tokenizer(tmp_path / "tok")
    ours_tok = Tokenizer.from_folder(tok_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.config.dropout = 0.0
    args = trl.RLOOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                          per_device_train_batch_size=4, num_generations=2, max_completion_length=MAX_COMPLETION,
                          temperature=TEMPERATURE, disable_tqdm=True, gradient_checkpointing=False,
                          num_iterations=num_iterations, mask_truncated_completions=True, beta=beta,
                          normalize_advantages=normalize, epsilon_high=0.28)
    t = trl.RLOOTrainer(model=hf, reward_funcs=_sum_mod_10, args=args,
                        processing_class=transformers.AutoTokenizer.from_pretrained(str(tok_dir)),
                        train_dataset=datasets.Dataset.from_list([{"prompt": "the a"}] * 4))
    t.model.train()
    if beta:
        t.ref_model.eval()
    texts = ["the a of", "to and the"]
    ids = [c[: c.index(2) + 1] if 2 in c else c for c in COMPLETIONS]  # as generated: up to the eos
    prompt_lists = [[x for x in p if x != 0] for p in PROMPTS for _ in range(2)]
    decoded = [ours_tok.decode(c) for c in ids]
    monkeypatch.setattr(t, "_generate", lambda prompts: (prompt_lists, ids, decoded))
    t._step, t._buffered_inputs = 0, None
    t.current_gradient_accumulation_steps = 1
    rows = [{"prompt": p} for p in texts for _ in range(2)]

    ours = load_pretrained(folder, models.from_hf_config)
    ours.train()
    for p in ours.parameters():
        p.requires_grad_(True)
    *_, completion_ids, completion_mask = batch_tensors()
    monkeypatch.setattr(grpo_module, "sample", lambda *a, **kw: Completions(
        completion_ids, completion_mask, torch.tensor([2 not in c for c in COMPLETIONS])))
    cfg = GRPOConfig(num_generations=2, max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE,
                     loss_type="rloo", num_iterations=num_iterations, mask_truncated_completions=True, grad_accum=1,
                     beta=beta, normalize_advantages=normalize, epsilon_high=0.28)
    objective = GRPOObjective(cfg, [("sum_mod_10", _sum_mod_10)], ours_tok, new_cache=None, eos_ids=[2],
                              reference=_InitialWeights(ours))
    batch = {"prompt_ids": torch.tensor(PROMPTS), "prompt_attention_mask": torch.tensor(PROMPTS).ne(0).long(),
             "prompts": texts, "columns": {}, "rows": ["p.jsonl:1", "p.jsonl:2"]}

    lr = 0.2
    for step in (1, 2):
        inputs = t._prepare_inputs(rows)
        t._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
        t.model.zero_grad(set_to_none=True)
        expected = t._compute_loss(t.model, inputs)
        expected.backward()
        expected_grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
        ours.zero_grad(set_to_none=True)
        loss_sum, count, metrics = objective(ours, batch)
        loss = loss_sum / count
        loss.backward()
        assert float(loss) == pytest.approx(float(expected), abs=1e-5, rel=1e-5), step
        grads = {n: p.grad for n, p in ours.named_parameters()}
        assert expected_grads and set(expected_grads) <= set(grads)
        for n, ref in expected_grads.items():
            torch.testing.assert_close(grads[n], ref, atol=1e-5, rtol=1e-4, msg=lambda m: f"step {step}: {n}: {m}")
        if beta and step == 2:
            assert abs(metrics["kl"]) > 1e-3  # the moved policy: the penalty is in play
        with torch.no_grad():  # the same plain SGD step on both sides
            for model in (t.model, ours):
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(lr * p.grad)
        t._step += 1


def test_the_demo_learns_with_rloo(tmp_path):
    """The GRPO recipe's built-in demo with loss_type=rloo (its other keys as the demo sets them): the
    held-out reward goes from <= 0.2 before step 1 to >= 0.9 after 30 steps (measured: 0.07 -> 0.99)."""
    import json
    from pathlib import Path

    from minitrain.cli import run_cli

    recipe = str(Path(__file__).resolve().parent.parent / "recipes" / "grpo_qwen.py")
    assert run_cli([recipe, f"out={tmp_path}", "loss_type=rloo"]) == 0
    evals = {r["step"]: r["eval/reward"] for r in map(json.loads, (tmp_path / "eval.jsonl").read_text().splitlines())}
    assert evals[0] <= 0.2 and evals[30] >= 0.9, evals
