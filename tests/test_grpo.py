"""GRPO against TRL's GRPOTrainer (the reference), on the same weights, prompts, fixed completions and rewards.

- the loss and every parameter's gradient equal `trl.GRPOTrainer._compute_loss`'s for each loss_type,
  with and without beta, with old log-probs (num_iterations > 1) and an asymmetric clip;
- the advantages equal TRL's formula (its own `nanstd`) for scale_rewards group | batch | none, with
  a reward function that does not apply to some rows (None -> NaN).
"""

from __future__ import annotations

import collections

import pytest
import torch

import models
from minitrain.objectives.grpo import completion_logps, group_advantages, grpo_loss, shared_prompt_layout
from minitrain.weights import load_pretrained

TEMPERATURE = 0.7
MAX_COMPLETION = 6
# two prompts (left-padded) x G=2 completions (right-padded; the last one truncated: no eos)
PROMPTS = [[0, 0, 1, 17, 23], [1, 40, 41, 42, 43]]
COMPLETIONS = [[5, 6, 7, 2, 0, 0], [8, 9, 2, 0, 0, 0], [10, 11, 12, 13, 14, 2], [15, 16, 17, 18, 19, 20]]


def batch_tensors():
    prompt_ids = torch.tensor([p for p in PROMPTS for _ in range(2)])
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = torch.tensor(COMPLETIONS)
    completion_mask = torch.zeros_like(completion_ids)
    for i, c in enumerate(COMPLETIONS):
        n = c.index(2) + 1 if 2 in c else len(c)
        completion_mask[i, :n] = 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def trl_trainer(hf_causal, tmp_path_factory, trainer_cls: str, **extra):
    """A TRL `trainer_cls` (GRPOTrainer, RLOOTrainer) on a tiny Qwen2, with its config class of the
    same stem and `extra` settings: the reference the loss tests compare against."""
    import datasets
    import transformers
    import trl
    from _tok import make_bpe_tokenizer

    folder = hf_causal("grpo_policy", model_type="qwen2", num_key_value_heads=2)
    tok_dir = make_bpe_tokenizer(tmp_path_factory.mktemp("tok"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.config.dropout = 0.0
    config = getattr(trl, trainer_cls.replace("Trainer", "Config"))
    args = config(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[], use_cpu=True, bf16=False,
                  per_device_train_batch_size=4, num_generations=2, max_completion_length=MAX_COMPLETION,
                  temperature=TEMPERATURE, disable_tqdm=True, gradient_checkpointing=False, **extra)
    ds = datasets.Dataset.from_list([{"prompt": "the a"}] * 4)
    t = getattr(trl, trainer_cls)(model=hf, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                  args=args, train_dataset=ds, processing_class=tok)
    t.model.train()
    return t, folder


@pytest.fixture(scope="module")
def trainer(hf_causal, tmp_path_factory):
    """A TRL GRPOTrainer on a tiny Qwen2 (a few seconds to build: once per module)."""
    return trl_trainer(hf_causal, tmp_path_factory, "GRPOTrainer")


def trl_metric_names(loss_type: str, beta: float) -> list[str]:
    """The metrics TRL 1.x's `_compute_loss` logs for this loss type (beside the rewards')."""
    names = ["entropy", *(("kl",) if beta else ())]
    if loss_type == "cispo":
        return names + ["cispo_clip_ratio"]
    if loss_type == "vespo":
        return names + ["vespo/phi_seq_mean"]
    if loss_type == "sapo":
        return names
    return names + ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]


def trl_loss_and_grads(trainer, inputs, loss_type, beta, epsilon, epsilon_high, level="token", delta=None):
    import collections

    trainer.loss_type, trainer.beta = loss_type, beta
    trainer.epsilon_low, trainer.epsilon_high = epsilon, epsilon_high
    trainer.importance_sampling_level, trainer.args.delta = level, delta
    trainer.current_gradient_accumulation_steps = 1
    trainer._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {k: trainer._metrics["train"][k][-1] for k in trl_metric_names(loss_type, beta)}
    return float(loss), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}, metrics


# (loss_type, beta, old log-probs off the current ones, epsilon_high, importance_sampling_level, delta)
CASES = [(lt, beta, old, eps_high, "token", None) for lt in ("grpo", "bnpo", "dr_grpo", "dapo")
         for beta, old, eps_high in ((0.0, False, None), (0.04, True, 0.28))]
CASES += [("luspo", 0.04, True, 0.28, "sequence", None),  # GSPO's sequence ratio; LUSPO's per-completion sum
          ("dapo", 0.0, True, None, "sequence", None),  # GSPO
          ("dapo", 0.0, True, 0.28, "token", 1.5),  # two-sided clipping
          ("cispo", 0.04, True, 1.3, "token", None),  # capped ratio (max 1.3: some tokens are capped)
          ("sapo", 0.0, True, None, "token", None),
          ("sapo", 0.04, True, None, "sequence", None),
          ("vespo", 0.0, True, None, "token", None)]


@pytest.mark.parametrize("loss_type,beta,old,eps_high,level,delta", CASES)
def test_loss_and_gradients_equal_trl(trainer, loss_type, beta, old, eps_high, level, delta):
    t, folder = trainer
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch_tensors()
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])
    g = torch.Generator().manual_seed(1)
    shape = completion_ids.shape
    # old log-probs a little off the current ones (num_iterations > 1: the policy moved since sampling),
    # large enough that some ratios leave [1 - eps, 1 + eps_high] and are clipped
    ours = load_pretrained(folder, models.from_hf_config)
    ours.train()
    with torch.no_grad():
        now, _ = completion_logps(ours, prompt_ids, prompt_mask, completion_ids, completion_mask, TEMPERATURE)
    old_logps = now + 0.3 * torch.randn(shape, generator=g) if old else None
    ref_logps = now + 0.5 * torch.randn(shape, generator=g) if beta else None
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages,
              "num_items_in_batch": completion_mask.sum()}
    if old:
        inputs["old_per_token_logps"] = old_logps
    if beta:
        inputs["ref_per_token_logps"] = ref_logps
    expected, expected_grads, expected_metrics = trl_loss_and_grads(t, inputs, loss_type, beta, 0.2,
                                                                    eps_high or 0.2, level, delta)

    for p in ours.parameters():
        p.requires_grad_(True)
    # the graph through the shared-prompt layout (each prompt once for its G = 2 rows), as a run takes it
    assert shared_prompt_layout(prompt_ids, prompt_mask, completion_mask, 2, ours.config.hidden_size) is not None
    logps, ent = completion_logps(ours, prompt_ids, prompt_mask, completion_ids, completion_mask, TEMPERATURE,
                                  entropy=True, group=2)
    loss_sum, count, stats = grpo_loss(logps, advantages, completion_mask, old_logps=old_logps, ref_logps=ref_logps,
                                       loss_type=loss_type, epsilon=0.2, epsilon_high=eps_high or 0.0, beta=beta,
                                       max_completion_length=MAX_COMPLETION, importance_sampling_level=level,
                                       delta=delta)
    loss = loss_sum / count
    loss.backward()
    assert float(loss) == pytest.approx(expected, abs=1e-5, rel=1e-5)
    n = float(stats["tokens"])
    ours_metrics = {"entropy": float(ent.sum()) / n, **{k: float(a) / float(u) for k, (a, u) in stats["means"].items()}}
    assert ours_metrics == pytest.approx(expected_metrics, abs=1e-5, rel=1e-5)
    if old and level == "token" and "clip_ratio/low_mean" in ours_metrics:
        assert ours_metrics["clip_ratio/low_mean"] > 0 and ours_metrics["clip_ratio/high_mean"] > 0  # both clipped
    if loss_type == "cispo":
        assert 0 < ours_metrics["cispo_clip_ratio"] < 1  # the cap binds on some tokens, not all
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert set(expected_grads) <= set(grads)
    for n, ref in expected_grads.items():
        torch.testing.assert_close(grads[n], ref, atol=1e-5, rtol=1e-4, msg=n)


def trl_advantages(rewards_per_func, weights, G, scale):
    """TRL 1.16's `_generate_and_score_completions` advantage lines, with its own `nanstd`."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    if scale in ("group", "none"):
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(scale):
    nan = float("nan")
    rewards = torch.tensor([[1.0, 0.5], [0.0, nan], [2.0, 1.0], [2.0, 1.0], [nan, nan], [3.0, 0.0]])
    weights = torch.tensor([1.0, 0.5])
    ours, _, zero = group_advantages(rewards, weights, 2, scale)
    ref, ref_zero = trl_advantages(rewards, weights, 2, scale)
    torch.testing.assert_close(ours, ref)
    assert zero.tolist() == ref_zero.tolist()
    if scale == "group":
        assert zero.tolist() == [False, False, True, True, False, False]  # the equal pair only (a lone scored
        # completion's std is NaN, as in TRL)


REWARDS = [[1.0, 0.5], [0.0, float("nan")], [2.0, 1.0], [2.0, 1.0], [5.0, 0.0], [3.0, 0.0], [0.0, 0.0], [4.0, 2.0]]


def batch_std_worker(rank: int, out: str) -> None:
    """Rank r holds the groups r, r + 2, ... of REWARDS (2 completions a group), as torchrun splits prompts."""
    import json
    from pathlib import Path

    rows = torch.tensor(REWARDS).view(-1, 2, 2)[rank::2].reshape(-1, 2)
    adv, _, _ = group_advantages(rows, torch.tensor([1.0, 0.5]), 2, "batch")
    Path(out, f"adv{rank}.json").write_text(json.dumps(adv.tolist()))


def test_batch_scaling_under_torchrun_uses_every_ranks_rewards(tmp_path):
    """`scale_rewards=batch` with 2 ranks: each rank's advantages are TRL's over the whole batch
    (rewards gathered from both), not over its own share."""
    import json

    from test_distributed import launch

    launch(tmp_path, "batch_std_worker", str(tmp_path), module="test_grpo")
    ref, _ = trl_advantages(torch.tensor(REWARDS), torch.tensor([1.0, 0.5]), 2, "batch")
    ref = ref.view(-1, 2)  # (groups, 2 completions)
    for rank in (0, 1):
        got = torch.tensor(json.loads((tmp_path / f"adv{rank}.json").read_text()))
        torch.testing.assert_close(got, ref[rank::2].reshape(-1))
    own, _ = trl_advantages(torch.tensor(REWARDS).view(-1, 2, 2)[0::2].reshape(-1, 2), torch.tensor([1.0, 0.5]), 2,
                            "batch")
    assert not torch.allclose(own, ref[0::2].reshape(-1))  # one rank's share alone would scale otherwise


def placeholder_worker(rank: int, out: str) -> None:
    """Rank 0 holds every group of REWARDS; rank 1 has no prompt left (a short last batch) and runs the
    loop's weight-0 placeholder: the first group again, not counted."""
    import json
    from pathlib import Path

    rows = torch.tensor(REWARDS) if rank == 0 else torch.tensor(REWARDS[:2])
    adv, _, _ = group_advantages(rows, torch.tensor([1.0, 0.5]), 2, "batch", counted=rank == 0)
    Path(out, f"adv{rank}.json").write_text(json.dumps(adv.tolist()))


def test_batch_scaling_leaves_a_placeholder_ranks_rewards_out(tmp_path):
    """A rank that a short last batch leaves without prompts runs one at weight 0: its rewards are not
    in the batch's std, so the other rank's advantages are TRL's over the real batch alone."""
    import json

    from test_distributed import launch

    launch(tmp_path, "placeholder_worker", str(tmp_path), module="test_grpo")
    ref, _ = trl_advantages(torch.tensor(REWARDS), torch.tensor([1.0, 0.5]), 2, "batch")
    torch.testing.assert_close(torch.tensor(json.loads((tmp_path / "adv0.json").read_text())), ref)
    counted, _ = trl_advantages(torch.tensor(REWARDS + REWARDS[:2]), torch.tensor([1.0, 0.5]), 2, "batch")
    assert not torch.allclose(counted[:len(REWARDS)], ref)  # counting the placeholder would change them


def test_memory_plan_counts_the_samplers_kv_cache(hf_causal):
    """The plan's GRPO sampling moment: its KV cache term equals the bytes the sampler's cache holds."""
    import json

    from minitrain.objectives.sampling import sample
    from minitrain.plan.decoder import sampling_terms
    from minitrain.plan.predict import shape_from_hf
    from minitrain.plan.run_shape import RunShape

    folder = hf_causal("grpo_policy", model_type="qwen2", num_key_value_heads=2)
    model = load_pretrained(folder, models.from_hf_config)
    caches = []

    def new_cache(n):
        caches.append(models.family(model).KVCache(n))
        return caches[-1]

    prompt = torch.tensor([[1, 17, 23, 5], [0, 1, 40, 41]])
    sample(model, prompt, (prompt != 0).long(), new_cache=new_cache, num_generations=3, max_new_tokens=6,
           eos_ids=[], pad_id=0)
    held = sum(t.numel() * t.element_size() for d in (caches[0].keys, caches[0].values) for t in d.values())
    run = RunShape(rows=6, seq=4 + 6, compute="fp32", sample_rows=6)
    shape = shape_from_hf(json.loads((folder / "config.json").read_text()))
    assert next(t.bytes for t in sampling_terms(shape, run) if t.name == "sampler: KV cache") == held


def test_prompt_rows_chat_and_text_with_their_columns(tmp_path):
    """`read_prompts`: a conversation is the checkpoint's chat template with the generation prompt, as
    transformers' `apply_chat_template(add_generation_prompt=True)` renders it; a string gets no bos on a
    Qwen tokenizer (as transformers' encode); `fields` renames the prompt column; every other column is
    kept for the rewards; each example knows its file:line."""
    import json

    import transformers
    from _tok import make_qwen_tokenizer

    from minitrain.data.readers import read_prompts
    from minitrain.text.tokenizer import Tokenizer

    import shutil
    from pathlib import Path

    folder = make_qwen_tokenizer(tmp_path / "tok")  # with Qwen2.5's own chat template
    shutil.copy(Path(__file__).parent / "fixtures" / "chat_templates" / "qwen2_5.jinja", folder / "chat_template.jinja")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the a of to"}]
    rows = [{"question": msgs, "answer": "7", "level": 2}, {"question": "the of and", "answer": "3"}]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ex = read_prompts(data, Tokenizer.from_folder(folder), max_len=256, fields={"prompt": "question"})
    assert ex.truncated == 0
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ref = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert ex[0]["prompt_ids"] == list(ref) and ex[0]["prompt"] == msgs
    assert ex[1]["prompt_ids"] == hf("the of and")["input_ids"]
    assert ex[0]["columns"] == {"answer": "7", "level": 2} and ex[1]["columns"] == {"answer": "3"}
    assert [e["row"] for e in ex] == [f"{data}:1", f"{data}:2"]


def _sum_mod_10(prompts, completions, completion_ids, **kw):
    """A reward that differs within both groups of COMPLETIONS (0, 9 and 2, 5): no advantage is 0."""
    return [float(sum(ids) % 10) for ids in completion_ids]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_rollout_reuse_and_masked_truncation_equal_trl(hf_causal, tmp_path, monkeypatch, loss_type):
    """From the rollout to the loss, two optimizer steps on one generation (`num_iterations=2`) with
    `mask_truncated_completions`: TRL's `_prepare_inputs` (which generates, scores, masks the truncated
    completion, keeps the sampling policy's log-probs and buffers the batch for the next step) against
    our `GRPOObjective` called by the loop twice; the same fixed completions fed to both (generation
    replaced on both sides), the same SGD step in between. Loss and every gradient equal at both steps;
    the second step reuses the first's completions under the moved policy (its loss differs)."""
    import datasets
    import transformers
    import trl
    from _tok import make_bpe_tokenizer

    import minitrain.objectives.grpo as grpo_module
    from minitrain.objectives.grpo import GRPOConfig, GRPOObjective
    from minitrain.objectives.sampling import Completions
    from minitrain.text.tokenizer import Tokenizer

    folder = hf_causal("grpo_policy", model_type="qwen2", num_key_value_heads=2)
    tok_dir = make_bpe_tokenizer(tmp_path / "tok")
    ours_tok = Tokenizer.from_folder(tok_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.config.dropout = 0.0
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                          per_device_train_batch_size=4, num_generations=2, max_completion_length=MAX_COMPLETION,
                          temperature=TEMPERATURE, disable_tqdm=True, gradient_checkpointing=False, loss_type=loss_type,
                          num_iterations=2, mask_truncated_completions=True, beta=0.0)
    t = trl.GRPOTrainer(model=hf, reward_funcs=_sum_mod_10, args=args,
                        processing_class=transformers.AutoTokenizer.from_pretrained(str(tok_dir)),
                        train_dataset=datasets.Dataset.from_list([{"prompt": "the a"}] * 4))
    t.model.train()
    texts = ["the a of", "to and the"]  # the two prompts' strings (what the reward functions see)
    ids = [c[: c.index(2) + 1] if 2 in c else c for c in COMPLETIONS]  # as generated: up to the eos
    prompt_lists = [[x for x in p if x != 0] for p in PROMPTS for _ in range(2)]
    decoded = [ours_tok.decode(c) for c in ids]

    def trl_generate(prompts):
        return prompt_lists, ids, None, decoded, None, {}, None, None

    monkeypatch.setattr(t, "_generate", trl_generate)
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
                     loss_type=loss_type, num_iterations=2, mask_truncated_completions=True, grad_accum=1)
    objective = GRPOObjective(cfg, [("sum_mod_10", _sum_mod_10)], ours_tok, new_cache=None, eos_ids=[2])
    batch = {"prompt_ids": torch.tensor(PROMPTS), "prompt_attention_mask": torch.tensor(PROMPTS).ne(0).long(),
             "prompts": texts, "columns": {}, "rows": ["p.jsonl:1", "p.jsonl:2"]}

    lr, losses = 0.5, []
    for step in (1, 2):
        inputs = t._prepare_inputs(rows)
        assert int((inputs["completion_mask"].sum(1) == 0).sum()) == 1  # TRL masked the truncated one (rows shuffled)
        assert ("old_per_token_logps" in inputs) and (step == 1 or inputs["advantages"].abs().min() > 0)
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
        assert set(expected_grads) <= set(grads)
        for n, ref in expected_grads.items():
            torch.testing.assert_close(grads[n], ref, atol=1e-5, rtol=1e-4, msg=f"step {step}: {n}")
        losses.append(float(loss))
        with torch.no_grad():  # the same plain SGD step on both sides
            for model in (t.model, ours):
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(lr * p.grad)
        t._step += 1
    assert losses[1] != pytest.approx(losses[0], abs=1e-4)  # step 2: the moved policy against the old log-probs
    assert objective.calls == 2 and metrics["clip_ratio/region_mean"] >= 0


def test_the_shared_prompt_layout_gives_each_rows_log_probs_and_gradients(hf_causal):
    """GRPO's G rows of a prompt run it once (`shared_prompt_layout`): log-probs, entropies and every
    gradient equal the padded batch's, a truncated completion whose mask is 0 included; rows whose
    prompts differ, and long completions (where one row of G is dearer), keep the padded batch."""
    model = load_pretrained(hf_causal("grpo_policy", model_type="qwen2", num_key_value_heads=2), models.from_hf_config)
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    g = torch.Generator().manual_seed(3)
    G, P, C = 4, 7, 9
    prompts = torch.randint(3, 100, (3, P), generator=g)
    prompt_mask = torch.ones(3, P, dtype=torch.long)
    prompt_mask[0, :3], prompt_mask[2, :1] = 0, 0  # left padding
    prompt_ids = (prompts * prompt_mask).repeat_interleave(G, 0)
    prompt_mask = prompt_mask.repeat_interleave(G, 0)
    completion_ids = torch.randint(3, 100, (3 * G, C), generator=g)
    lengths = torch.randint(1, C + 1, (3 * G,), generator=g)
    lengths[5] = 0  # a truncated completion under mask_truncated_completions
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    weights = torch.randn(3 * G, C, generator=g)

    def run(group):
        model.zero_grad()
        logps, ent = completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7,
                                      entropy=True, group=group)
        (logps * weights).sum().backward()
        return logps.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert shared_prompt_layout(prompt_ids, prompt_mask, completion_mask, G, model.config.hidden_size) is not None
    (a, ea, ga), (b, eb, gb) = run(1), run(G)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eb, ea, atol=1e-5, rtol=1e-5)
    assert set(ga) == set(gb) and len(ga) > 0
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], atol=1e-5, rtol=1e-4, msg=n)
    assert float(a[completion_mask.bool()].abs().min()) > 0  # real log-probs, not zeros
    # rows of a group with different prompts, or completions so long that G of them in a row cost more
    other = prompt_ids.clone()
    other[1, -1] += 1
    assert shared_prompt_layout(other, prompt_mask, completion_mask, G, model.config.hidden_size) is None
    long_mask = torch.ones(3 * G, 4000, dtype=torch.long)
    assert shared_prompt_layout(prompt_ids, prompt_mask, long_mask, G, model.config.hidden_size) is None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logps_never_holds_the_whole_logits(hf_causal, temperature):
    """The policy's completion log-probs score B x C tokens over the vocabulary a chunk at a time
    (minitrain.objectives.losses; a tempered head through checkpointed chunks): the peak of its
    forward and backward stays below one fp32 (B, C, V) logits tensor. (The 28 Nov H200 notes
    suspected that tensor behind the GRPO step's 59.59 GB: it was the activations of a forward
    without checkpointing, BENCHMARKS.md.)"""
    from minitrain.plan.measure import measure_peak_allocated

    V, B, P, C = 32768, 8, 8, 128
    model = load_pretrained(hf_causal("grpo_wide_vocab", model_type="qwen2", num_key_value_heads=2, vocab_size=V),
                            models.from_hf_config)
    model.train()
    for n, p in model.named_parameters():
        p.requires_grad_(".layers." in n)  # the blocks train, the head is frozen (as under LoRA)
    g = torch.Generator().manual_seed(0)
    prompt_ids, completion_ids = torch.randint(3, V, (B, P), generator=g), torch.randint(3, V, (B, C), generator=g)

    def step() -> torch.Tensor:
        logps, _ = completion_logps(model, prompt_ids, torch.ones_like(prompt_ids), completion_ids,
                                    torch.ones_like(completion_ids), temperature)
        logps.sum().backward()
        return logps.detach()

    peak, logps = measure_peak_allocated(step)
    assert peak < B * C * V * 4, (peak, B * C * V * 4)
    with torch.no_grad():  # the unchunked formula
        hidden = model(torch.cat([prompt_ids, completion_ids], 1), torch.ones(B, P + C, dtype=torch.long))
        logits = model.output_projection(hidden[:, P - 1 : -1]).float() / temperature  # (B, C, V)
        ref = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(logps, ref, atol=1e-6, rtol=1e-6)


def test_finished_rows_leave_the_batch_and_change_no_completion(hf_causal):
    """Once half the rows decoded have ended, they leave the batch with their cache slots
    (`KVCache.keep_rows`): greedy completions, masks and truncation equal those of the batch kept whole."""
    from minitrain.objectives.sampling import sample

    model = load_pretrained(hf_causal("grpo_policy", model_type="qwen2", num_key_value_heads=2), models.from_hf_config)
    model.train()
    kv = models.family(model).KVCache
    calls = []

    class Whole(kv):  # no keep_rows: every row decoded to the end
        keep_rows = property(lambda self: (_ for _ in ()).throw(AttributeError("keep_rows")))

    class Counted(kv):
        def keep_rows(self, index):
            calls.append(index.numel())
            super().keep_rows(index)

    g = torch.Generator().manual_seed(5)
    prompt_ids = torch.randint(3, 100, (4, 6), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = 0
    free = sample(model, prompt_ids, prompt_mask, new_cache=Whole, num_generations=3, max_new_tokens=10, greedy=True)
    # ids that end prompts 0 and 1 early (their G rows at once: greedy) but never appear for prompts 2 and 3
    late = set(free.ids[6:].flatten().tolist())
    eos = [t for t in (int(free.ids[0, 2]), int(free.ids[3, 4])) if t not in late]
    assert eos
    a = sample(model, prompt_ids, prompt_mask, new_cache=Whole, num_generations=3, max_new_tokens=10, greedy=True,
               eos_ids=eos)
    b = sample(model, prompt_ids, prompt_mask, new_cache=Counted, num_generations=3, max_new_tokens=10, greedy=True,
               eos_ids=eos)
    assert calls and calls[0] < 12  # the batch shrank
    assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask) and torch.equal(a.truncated, b.truncated)
    assert bool(a.truncated.any()) and not bool(a.truncated.all())  # some ended, some ran to the limit


def assert_sampler_greedy_equals_generate(ours, hf) -> None:
    """The GRPO sampler's greedy completions (2 per prompt, 10 tokens, a left-padded prompt, no eos) equal
    `hf.generate`'s (transformers, or a peft model over it)."""
    from minitrain.objectives.sampling import sample

    prompt_ids = torch.tensor([[0, 0, 1, 17, 23, 5], [1, 40, 41, 42, 43, 44]])
    prompt_mask = (prompt_ids != 0).long()
    hf.generation_config.eos_token_id = None
    ref = hf.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=10, do_sample=False,
                      pad_token_id=0)[:, 6:]
    got = sample(ours, prompt_ids, prompt_mask, new_cache=models.family(ours).KVCache, num_generations=2,
                 max_new_tokens=10, greedy=True, eos_ids=[], pad_id=0)
    assert torch.equal(got.ids, ref.repeat_interleave(2, 0))


def test_lora_layers_decode_with_a_merged_copy_and_sample_as_peft(hf_causal):
    """On a CPU the sampler runs each fp32 LoRA layer as one product with `W + scaling * B @ A`
    (`merged_for_decoding`): greedy completions equal transformers + peft's `generate` with the same
    adapter; inside, a no-graph forward equals the three-product one to float rounding while a forward
    with a graph still takes the three products (gradients reach A and B); a bf16 base is left alone;
    the copies are gone afterwards."""
    import peft
    import transformers

    from minitrain.adapters.lora import LoRAConfig, LoRALinear, apply_lora, lora_layers, merged_for_decoding

    folder = hf_causal("grpo_policy", model_type="qwen2", num_key_value_heads=2)
    ours = load_pretrained(folder, models.from_hf_config).train()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    apply_lora(ours, LoRAConfig(r=4, alpha=8, targets=tuple(targets)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    g = torch.Generator().manual_seed(3)
    hf_layers = dict(hf.base_model.model.named_modules())
    with torch.no_grad():  # a trained-looking adapter (B != 0), the same tensors on both sides
        for name, m in lora_layers(ours):
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.3)
            twin = hf_layers[name]
            twin.lora_A["default"].weight.copy_(m.lora_A.weight)
            twin.lora_B["default"].weight.copy_(m.lora_B.weight)
    assert_sampler_greedy_equals_generate(ours, hf)
    assert all(m.decoding_weight is None for _, m in lora_layers(ours))

    x = torch.randint(3, 100, (3, 7))
    with torch.no_grad():
        three = ours(x)
        with merged_for_decoding(ours) as n:
            one = ours(x)
            assert n == len(lora_layers(ours)) == 7 * ours.config.num_hidden_layers
            q, h = ours.model.layers[0].self_attn.q_proj, torch.randn(3, 7, 64)
            torch.testing.assert_close(q.decoding_weight, q.weight + q.delta_weight(), rtol=0, atol=1e-6)
            assert torch.equal(q(h), torch.nn.functional.linear(h, q.decoding_weight, q.bias))  # one product
    assert not torch.equal(one, three)  # (the copy was used) ...
    torch.testing.assert_close(one, three, rtol=0, atol=1e-5)  # ... and is the same layer to float rounding
    with merged_for_decoding(ours):
        ours(x).sum().backward()  # a graph: the three products
    assert all(m.lora_A.weight.grad is not None and m.lora_A.weight.grad.abs().sum() > 0 for _, m in lora_layers(ours))

    half = LoRALinear(torch.nn.Linear(8, 4).to(torch.bfloat16), r=2, alpha=4)
    with merged_for_decoding(torch.nn.Sequential(half)) as n:
        assert n == 0 and half.decoding_weight is None
