"""minitrain.adapters.ard against closed forms and hand-written references, and recipes/ard_lora_llama.py.

References: the Gaussian KL from its textbook formula and from torch.distributions; the layer
output from `base(x) + s * B diag(z) A x` written out; ECE from a Python loop over tokens with the
bin intervals ((m-1)/M, m/M] of Guo et al. 2017; the ELBO normalisation by summing the KL terms
of every batch of an epoch.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _tok import corpus, make_bpe_tokenizer
from torch.distributions import Normal, kl_divergence

from minitrain.adapters.ard import ARDLoRALinear, RankGate, ard_kl, fold_gates, gate_kl, gates, make_ard, update_prior
from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.adapters.peft_format import load_adapter, save_adapter
from minitrain.errors import UserError
from minitrain.objectives.ard import (ARDObjective, PriorSchedule, calibration_bins, dataset_target_tokens,
                                      ece_from_bins, uncertainty_eval)

REPO = Path(__file__).resolve().parents[1]


def test_kl_closed_form_and_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(9, generator=g, dtype=torch.float64)
    logvar = torch.randn(9, generator=g, dtype=torch.float64)
    alpha = torch.rand(9, generator=g, dtype=torch.float64) * 5 + 0.1
    got = gate_kl(mu, logvar, alpha)
    var = logvar.exp()
    # KL(N(m, v) || N(0, 1/a)) = 1/2 [ log((1/a) / v) + (v + m^2) a - 1 ]
    by_hand = sum(0.5 * (math.log((1 / a) / v) + (v + m * m) * a - 1) for m, v, a in zip(mu.tolist(), var.tolist(),
                                                                                         alpha.tolist()))
    assert got.item() == pytest.approx(by_hand, rel=1e-6)
    want = kl_divergence(Normal(mu, var.sqrt()), Normal(torch.zeros(9, dtype=torch.float64), alpha.rsqrt())).sum()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_ard_update_is_the_m_step():
    """alpha = 1 / (mu^2 + sigma^2) maximises -KL over alpha; the KL is then 1/2 log(1 + mu^2 / sigma^2)."""
    gate = RankGate(torch.nn.Linear(4, 3, bias=False))
    with torch.no_grad():
        gate.gate_mu.copy_(torch.tensor([0.5, -2.0, 0.0]))
        gate.gate_logvar.copy_(torch.tensor([-1.0, 0.3, -3.0]))
    gate.update_prior()
    mu, var = gate.gate_mu.detach().double(), gate.gate_logvar.detach().double().exp()
    torch.testing.assert_close(gate.prior_precision.double(), 1 / (mu**2 + var), rtol=1e-6, atol=0)
    assert gate.kl().item() == pytest.approx((0.5 * torch.log1p(mu**2 / var)).sum().item(), rel=1e-5, abs=1e-6)
    # a stationary point in each alpha_k: d KL / d alpha = 0 there, and KL grows either way
    for k in range(3):
        for f in (0.9, 1.1):
            a = gate.prior_precision.clone()
            a[k] *= f
            assert gate_kl(gate.gate_mu, gate.gate_logvar, a).item() > gate.kl().item()


# ----------------------------------------------------------------------------- the layer


def ard_linear(seed: int = 0, r: int = 3, init_std: float = 0.5) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A model holding one LoRA-wrapped Linear with ARD gates and random A, B, mu."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5))
    apply_lora(model, LoRAConfig(r=r, alpha=2 * r, targets=["0"]))
    freeze_for_adapters(model)
    make_ard(model, init_std=init_std)
    layer = model[0]
    with torch.no_grad():
        layer.lora_B.weight.normal_()
        layer.lora_A.gate_mu.normal_()
    return model, layer


def test_eval_uses_the_mean_and_train_samples_around_it():
    model, layer = ard_linear()
    assert isinstance(layer, ARDLoRALinear) and isinstance(layer.lora_A, RankGate)
    x = torch.randn(4, 6)
    W, b = layer.weight.detach(), layer.bias.detach()
    A, B, mu = layer.lora_A.weight.detach(), layer.lora_B.weight.detach(), layer.lora_A.gate_mu.detach()
    mean = x @ W.T + b + layer.scaling * (x @ A.T * mu) @ B.T
    model.eval()
    torch.testing.assert_close(model(x), mean)
    torch.testing.assert_close(model(x), model(x))
    model.train()
    draws = torch.stack([model(x).detach() for _ in range(4000)])
    assert not torch.equal(draws[0], draws[1])  # a fresh gate draw each forward
    # linear in z: the average of the draws converges to the posterior-mean output
    sd = draws.std(0) / math.sqrt(len(draws))
    assert ((draws.mean(0) - mean).abs() < 5 * sd + 1e-6).all()
    # and the draws have the variance sum_k (s * (B_k (A_k x)))^2 sigma_k^2 of a Gaussian gate
    var = ((layer.scaling * (x @ A.T)[:, None, :] * B[None]) ** 2 * layer.lora_A.gate_logvar.detach().exp()).sum(-1)
    torch.testing.assert_close(draws.var(0), var, rtol=0.1, atol=1e-5)


def test_kl_is_in_the_graph_of_the_gates_by_construction():
    model, layer = ard_linear()
    with torch.no_grad():
        layer.lora_B.weight.zero_()  # a fresh adapter: the data term gives the gates no gradient
    model.train()
    loss = model(torch.randn(2, 6)).sum() + ard_kl(model)
    loss.backward()
    g = layer.lora_A
    assert g.gate_mu.grad is not None and g.gate_mu.grad.abs().sum() > 0
    assert g.gate_logvar.grad is not None and g.gate_logvar.grad.abs().sum() > 0
    # d KL / d mu = alpha * mu;  d KL / d logvar = 1/2 (alpha sigma^2 - 1)
    torch.testing.assert_close(g.gate_mu.grad, g.prior_precision * g.gate_mu.detach())
    torch.testing.assert_close(g.gate_logvar.grad, 0.5 * (g.prior_precision * g.gate_logvar.detach().exp() - 1))


def test_fold_keeps_the_model_and_makes_the_plain_lora_the_posterior_mean(tmp_path):
    model, layer = ard_linear()
    update_prior(model)
    with torch.no_grad():
        layer.lora_A.gate_mu[1] = -0.7  # a negative mean folds into the sign of A's row
    model.eval()
    x = torch.randn(3, 6)
    before, kl, delta = model(x).detach(), ard_kl(model).item(), layer.delta_weight()
    fold_gates(model)
    torch.testing.assert_close(model(x), before)
    assert ard_kl(model).item() == pytest.approx(kl, rel=1e-5)
    assert torch.equal(layer.lora_A.gate_mu.detach(), torch.ones(3))
    torch.testing.assert_close(layer.delta_weight(), delta)
    plain = layer.scaling * layer.lora_B.weight.detach() @ layer.lora_A.weight.detach()
    torch.testing.assert_close(plain, delta)
    # the PEFT-format adapter, loaded as a plain LoRA, gives the ARD model's eval output
    save_adapter(model, tmp_path / "a")
    torch.manual_seed(5)
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5))
    fresh[0].load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    load_adapter(fresh, tmp_path / "a")
    torch.testing.assert_close(fresh.eval()(x), before)


def test_merge_uses_the_posterior_mean():
    from minitrain.adapters.merge import merge

    model, _ = ard_linear()
    model.eval()
    x = torch.randn(3, 6)
    want = model(x).detach()
    merge(model)
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)


def test_make_ard_errors():
    with pytest.raises(UserError, match="no LoRA layers"):
        make_ard(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    model, _ = ard_linear()
    with pytest.raises(UserError, match="already has ARD gates"):
        make_ard(model)


# ----------------------------------------------------------------------------- calibration


def ece_by_hand(conf: list[float], correct: list[bool], M: int) -> float:
    total = 0.0
    for m in range(1, M + 1):
        lo, hi = (m - 1) / M, m / M
        members = [i for i, c in enumerate(conf) if (lo < c <= hi) or (m == 1 and c == 0)]
        if members:
            acc = sum(correct[i] for i in members) / len(members)
            avg = sum(conf[i] for i in members) / len(members)
            total += len(members) / len(conf) * abs(acc - avg)
    return total


@pytest.mark.parametrize("M", [1, 5, 15])
def test_ece_equals_the_definition(M):
    g = torch.Generator().manual_seed(1)
    conf = torch.rand(200, generator=g, dtype=torch.float64)
    conf[:4] = torch.tensor([0.2, 0.4, 1.0, 0.0], dtype=torch.float64)  # bin edges
    correct = torch.rand(200, generator=g) < conf.float()
    got = ece_from_bins(calibration_bins(conf, correct, M))
    assert got == pytest.approx(ece_by_hand(conf.tolist(), correct.tolist(), M), rel=1e-12, abs=1e-15)
    # perfectly calibrated in one bin: every prediction at 0.5, half of them right
    assert ece_from_bins(calibration_bins(torch.full((4,), 0.5), torch.tensor([1, 0, 1, 0]), M)) == 0.0


@pytest.fixture(scope="module")
def llama(hf_causal):
    import models
    from minitrain.weights import load_pretrained

    def make(seed: int = 0):
        model = load_pretrained(hf_causal("ard_llama"), models.from_hf_config)
        cfg = LoRAConfig(r=4, alpha=8, targets=["q_proj", "v_proj"])
        apply_lora(model, cfg)
        freeze_for_adapters(model, cfg)
        make_ard(model, init_std=0.3)
        torch.manual_seed(seed)
        with torch.no_grad():
            for _, g in gates(model):
                g.gate_mu.add_(0.3 * torch.randn_like(g.gate_mu))
            for n, p in model.named_parameters():
                if ".lora_B." in n:
                    p.normal_(0, 0.3)
        return model

    return make


def rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(4, 128, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return out


def collate(examples):
    from minitrain.data.collate import collate_causal

    return collate_causal(examples, pad_id=0)


def test_uncertainty_eval_equals_full_logit_reference(llama):
    model = llama()
    ex = rows(5, seed=2)
    got = uncertainty_eval(model, ex, collate, batch_size=2, bins=7, chunk=3)
    conf, correct, nll = [], [], []
    model.eval()
    with torch.no_grad():
        for e in ex:
            ids = torch.tensor([e["input_ids"]])
            logp = torch.log_softmax(model.output_projection(model(ids, None))[0].double(), -1)
            for t in range(len(e["input_ids"]) - 1):
                y = e["labels"][t + 1]
                if y == -100:
                    continue
                conf.append(logp[t].exp().max().item())
                correct.append(int(logp[t].argmax()) == y)
                nll.append(-logp[t, y].item())
    assert got["tokens"] == len(nll)
    assert got["acc"] == pytest.approx(sum(correct) / len(correct))
    assert got["nll"] == pytest.approx(sum(nll) / len(nll), rel=1e-5)
    assert got["ece"] == pytest.approx(ece_by_hand(conf, correct, 7), rel=1e-4, abs=1e-6)
    assert model.training is False  # left as found (eval here)


def test_mc_predictive_with_tiny_sigma_is_the_mean_model(llama):
    model = llama()
    with torch.no_grad():
        for _, g in gates(model):
            g.gate_logvar.fill_(-40.0)
    ex = rows(4, seed=3)
    mean = uncertainty_eval(model, ex, collate, batch_size=2, bins=10)
    mc = uncertainty_eval(model, ex, collate, batch_size=2, bins=10, samples=3)
    for k in ("acc", "nll", "ece"):
        assert mc[k] == pytest.approx(mean[k], rel=1e-5, abs=1e-7)
    with torch.no_grad():
        for _, g in gates(model):
            g.gate_logvar.fill_(0.0)
    assert uncertainty_eval(model, ex, collate, batch_size=2, bins=10, samples=3)["nll"] != pytest.approx(mean["nll"])


# ----------------------------------------------------------------------------- the objective


def test_kl_is_counted_once_per_epoch_and_per_token_as_the_elbo(llama):
    model = llama().train()
    ex = rows(6, seed=4)
    N = dataset_target_tokens(ex)
    assert N == sum(len(e["input_ids"]) - 1 for e in ex)
    obj = ARDObjective(N, beta=0.5)
    kl = ard_kl(model).item()
    total_kl_terms, total_count = 0.0, 0
    for i in range(0, 6, 2):
        batch = collate(ex[i:i + 2])
        torch.manual_seed(i)
        loss_sum, count, m = obj(model, batch)
        torch.manual_seed(i)
        nll_sum, _, _ = obj.base(model, batch)  # same gate draw
        total_kl_terms += (loss_sum - nll_sum).item()
        total_count += int(count)
        assert m["kl"] == pytest.approx(kl, rel=1e-6) and m["kl_per_token"] == pytest.approx(0.5 * kl / N, rel=1e-6)
    assert total_count == N
    assert total_kl_terms == pytest.approx(0.5 * kl, rel=1e-5)  # beta * KL once over the epoch
    # eval: the NLL alone
    model.eval()
    batch = collate(ex[:2])
    with torch.no_grad():
        assert torch.equal(obj(model, batch)[0], obj.base(model, batch)[0])


def test_audit_finds_every_adapter_tensor_reachable(llama):
    from minitrain.audit import audit

    model = llama()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.zero_()  # fresh: A's gradient is zero at init, to be confirmed by the probe
    report = audit(model.train(), ARDObjective(100), collate(rows(2, seed=5)))
    assert report.ok, report.table()
    names = {t.name for t in report.tensors}
    assert any(n.endswith("lora_A.gate_mu") for n in names) and any(n.endswith("lora_A.gate_logvar") for n in names)


def test_checkpointing_replays_the_same_gate_draw(llama):
    from minitrain.train import enable_checkpointing

    model = llama().train()
    batch = collate(rows(2, seed=6))
    obj = ARDObjective(50)

    def grads():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        obj(model, batch)[0].backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain = grads()
    enable_checkpointing(model)
    ckpt = grads()
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-5, atol=1e-7)


def test_nf4_base(hf_causal):
    pytest.importorskip("bitsandbytes")
    import models
    from minitrain.adapters.ard import ARDLoRALinear4bit
    from minitrain.adapters.quant import quantize_hook
    from minitrain.weights import load_pretrained

    model = load_pretrained(hf_causal("ard_llama"), models.from_hf_config,
                            tensor_hook=quantize_hook("nf4", compute_dtype=torch.float32))
    cfg = LoRAConfig(r=4, alpha=8, targets=["q_proj", "v_proj"])
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    make_ard(model)
    assert all(type(model.get_submodule(n)) is ARDLoRALinear4bit for n, _ in gates(model))
    loss, _, _ = ARDObjective(100)(model.train(), collate(rows(2, seed=8)))
    loss.backward()
    assert all(g.gate_mu.grad is not None and g.gate_mu.dtype == torch.float32 for _, g in gates(model))


# ----------------------------------------------------------------------------- the prior schedule


def test_schedule_updates_every_n_steps_and_restores_exactly(llama, tmp_path):
    model = llama().train()
    path = tmp_path / "ard.jsonl"
    sched = PriorSchedule(2, path, eval_examples=rows(3, seed=9), collate=collate, batch_size=2, bins=5,
                          log=lambda s: None)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)
    sched.attach(opt, model)
    batch = collate(rows(2, seed=10))
    obj = ARDObjective(40)
    alphas = {}
    for step in range(1, 5):
        obj(model, batch)[0].backward()
        opt.step()
        opt.zero_grad()
        alphas[step] = {n: g.prior_precision.clone() for n, g in gates(model)}
        if step == 2:
            for n, g in gates(model):  # the M-step at step 2, from q after step 2
                want = 1 / (g.gate_mu.detach() ** 2 + g.gate_logvar.detach().exp())
                torch.testing.assert_close(g.prior_precision, want)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4]
    assert all(0 <= r["ece"] <= 1 and 0 <= r["acc"] <= 1 and r["nll"] > 0 and r["tokens"] > 0 for r in lines)
    # a run resumed at step 3 gets the prior of step 2, and the row of step 4 is dropped
    other = llama(seed=1)
    sched2 = PriorSchedule(2, path, log=lambda s: None)
    sched2.restore(other, 3)
    for n, g in gates(other):
        assert torch.equal(g.prior_precision, alphas[3][n])
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [2]


# ----------------------------------------------------------------------------- the recipe


@pytest.mark.parametrize("ranks", [1, 2])
def test_recipe_smoke(hf_causal, tmp_path, ranks):
    """The recipe end to end, in one process and under torchrun (2 ranks, ddp: rank 0 alone writes
    ard.jsonl; every rank used to append its row)."""
    model = tmp_path / "model"
    shutil.copytree(hf_causal("ard_llama"), model)
    make_bpe_tokenizer(model)
    lines = corpus(12, seed=7)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[:8]))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[8:]))
    out = tmp_path / "out"
    args = {"model": model, "data": tmp_path / "train.jsonl", "eval_data": tmp_path / "eval.jsonl", "out": out,
            "max_steps": 2, "batch_size": 2, "grad_accum": 1, "lora_r": 4, "lora_alpha": 8, "ard_every": 1, "ece_bins": 10,
            "device": "cpu"}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launch = ["-m", "torch.distributed.run", "--nproc_per_node", "2"] if ranks == 2 else []
    p = subprocess.run([sys.executable, *launch, "-m", "minitrain", str(REPO / "recipes" / "ard_lora_llama.py"),
                        *[f"{k}={v}" for k, v in args.items()]], cwd=REPO, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    # bitsandbytes is in the test extra: quantize=auto gives the 4-bit base, on the CPU too
    assert "base in nf4" in p.stdout, p.stdout
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2]
    for r in metrics:
        assert r["kl"] > 0 and math.isfinite(r["nll"]) and r["kl_per_token"] > 0
        if ranks == 1:  # (under torchrun `loss` is the whole batch's per token, the metrics the mean of the ranks')
            assert r["loss"] == pytest.approx(r["nll"] + r["kl_per_token"], rel=1e-5)
    ard = [json.loads(x) for x in (out / "ard.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ard] == [1, 2] and all(0 <= r["ece"] <= 1 for r in ard)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "adapter" / "ard_gates.safetensors").is_file()
    assert "ard: held-out acc" in p.stdout
