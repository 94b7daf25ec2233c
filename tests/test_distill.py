"""minitrain.objectives.distill against hand-written references, and recipes/distill_llama.py end to end.

References are written from the definitions (Hinton et al. 2015): p = exp(u/T) / sum exp(u/T)
computed directly in float64, KD = T^2 * sum p (log p - log q), CE = -log softmax(z)[y]; subset
KD renormalises both distributions over the teacher's k largest logits, found by sorting.
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
from _tok import corpus, make_bpe_tokenizer, make_sp_tokenizer

from minitrain.errors import UserError
from minitrain.objectives.distill import (PROJECTIONS, DistillObjective, attach_projections, attention_kl, balance_note,
                                          captures_layers, check_ids_shared, check_same_tokenizer, chunked_kd_ce,
                                          feature_distance, kd_ce_from_logits, make_distill_objective, map_layers,
                                          save_projections, shared_vocab, take_projections, uniform_layer_map)

REPO = Path(__file__).resolve().parents[1]


def reference(z: torch.Tensor, y: torch.Tensor, u: torch.Tensor, T: float, top_k: int = 0):
    """(ce, kd) per row from the definitions, in float64 without log_softmax."""
    z, u = z.double(), u.double()
    ce = torch.stack([-(z[i, y[i]] - torch.log(torch.exp(z[i]).sum())) for i in range(len(y))])
    kd = []
    for i in range(len(y)):
        keep = torch.argsort(u[i], descending=True)[:top_k] if top_k else torch.arange(u.shape[1])
        eu, ez = torch.exp(u[i, keep] / T), torch.exp(z[i, keep] / T)
        p, q = eu / eu.sum(), ez / ez.sum()
        kd.append(T * T * (p * (torch.log(p) - torch.log(q))).sum())
    return ce, torch.stack(kd)


@pytest.mark.parametrize("T", [1.0, 2.0, 20.0])
@pytest.mark.parametrize("top_k", [0, 5])
def test_kd_and_ce_equal_the_definitions(T, top_k):
    g = torch.Generator().manual_seed(0)
    z, u = torch.randn(6, 17, generator=g) * 3, torch.randn(6, 17, generator=g) * 3
    y = torch.randint(0, 17, (6,), generator=g)
    ce, kd = kd_ce_from_logits(z, y, u, temperature=T, top_k=top_k)
    ce_ref, kd_ref = reference(z, y, u, T, top_k)
    assert ce.dtype == kd.dtype == torch.float32
    torch.testing.assert_close(ce.double(), ce_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kd.double(), kd_ref, rtol=1e-4, atol=1e-6)
    # and torch's own KL (full vocabulary)
    if not top_k:
        want = F.kl_div(F.log_softmax(z / T, 1), F.log_softmax(u / T, 1), log_target=True, reduction="none").sum(1)
        torch.testing.assert_close(kd, want * T * T, rtol=1e-4, atol=1e-6)


def test_large_temperature_kd_is_finite_and_matches_the_small_logit_limit():
    """At T=20 with large logits nothing overflows; for T -> inf, T^2 KL -> (1/2V) sum((u-z) - mean)^2."""
    g = torch.Generator().manual_seed(1)
    z, u = torch.randn(4, 50, generator=g) * 30, torch.randn(4, 50, generator=g) * 30
    y = torch.zeros(4, dtype=torch.long)
    ce, kd = kd_ce_from_logits(z, y, u, temperature=20.0)
    assert torch.isfinite(kd).all() and torch.isfinite(ce).all()
    torch.testing.assert_close(kd.double(), reference(z, y, u, 20.0)[1], rtol=1e-4, atol=1e-5)
    # second-order expansion of KL in 1/T (Hinton et al. 2015, section 2.1): exact in the limit
    d = (u - z).double()
    d = d - d.mean(1, keepdim=True)
    limit = (d * d).mean(1) / 2
    _, kd_big = kd_ce_from_logits(z.double(), y, u.double(), temperature=1e4)
    torch.testing.assert_close(kd_big, limit, rtol=1e-3, atol=0)


def test_top_k_covering_the_vocabulary_is_full_kd():
    g = torch.Generator().manual_seed(2)
    z, u, y = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g), torch.randint(0, 11, (5,), generator=g)
    full = kd_ce_from_logits(z, y, u, temperature=3.0)[1]
    torch.testing.assert_close(kd_ce_from_logits(z, y, u, temperature=3.0, top_k=11)[1], full)
    torch.testing.assert_close(kd_ce_from_logits(z, y, u, temperature=3.0, top_k=99)[1], full)


@pytest.mark.parametrize("top_k", [0, 4])
def test_custom_backward_equals_autograd_of_the_definition(top_k):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(7, 13, generator=g, dtype=torch.float64, requires_grad=True)
    u = torch.randn(7, 13, generator=g, dtype=torch.float64)
    y = torch.randint(0, 13, (7,), generator=g)
    w_ce, w_kd = torch.rand(7, generator=g, dtype=torch.float64), torch.rand(7, generator=g, dtype=torch.float64)
    ce, kd = kd_ce_from_logits(z, y, u, temperature=2.5, top_k=top_k)
    (grad,) = torch.autograd.grad((w_ce * ce).sum() + (w_kd * kd).sum(), z)
    z2 = z.detach().clone().requires_grad_(True)
    ce_r, kd_r = reference(z2, y, u, 2.5, top_k)
    (want,) = torch.autograd.grad((w_ce * ce_r).sum() + (w_kd * kd_r).sum(), z2)
    torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: kd_ce_from_logits(t, y, u, temperature=2.5, top_k=top_k), (z,))


@pytest.mark.parametrize("top_k", [0, 6])
@pytest.mark.parametrize("chunk", [1, 3, None])
def test_chunked_from_hidden_equals_full_logits(top_k, chunk):
    """Per-token losses and the gradients (student head weight, hidden) equal the unchunked maths."""
    torch.manual_seed(4)
    V, D, Dt = 19, 8, 12
    s_head, t_head = torch.nn.Linear(D, V, bias=False), torch.nn.Linear(Dt, V, bias=False)
    t_head.requires_grad_(False)
    h = torch.randn(2, 5, D, requires_grad=True)
    ht = torch.randn(2, 5, Dt)
    y = torch.randint(0, V, (2, 5))
    y[0, :2] = -100
    y[1, 4] = -100
    ce, kd = chunked_kd_ce(h, s_head, ht, t_head, y, temperature=2.0, top_k=top_k, chunk=chunk)
    keep = (y.reshape(-1) != -100)
    z = s_head(h).reshape(-1, V)[keep]
    u = t_head(ht).reshape(-1, V)[keep]
    ce_r, kd_r = reference(z, y.reshape(-1)[keep], u, 2.0, top_k)
    torch.testing.assert_close(ce.double(), ce_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kd.double(), kd_r, rtol=1e-4, atol=1e-6)
    got = torch.autograd.grad(0.3 * kd.sum() + 0.7 * ce.sum(), (s_head.weight, h))
    want = torch.autograd.grad((0.3 * kd_r.sum() + 0.7 * ce_r.sum()).float(), (s_head.weight, h))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- the objective on our LLaMA


@pytest.fixture(scope="module")
def pair(hf_causal):
    import models
    from minitrain.weights import load_pretrained

    s_dir = hf_causal("distill_student")
    t_dir = hf_causal("distill_teacher", seed=1, hidden_size=96, intermediate_size=160, num_hidden_layers=3)
    student = load_pretrained(s_dir, models.from_hf_config)
    teacher = load_pretrained(t_dir, models.from_hf_config)
    return student, teacher


def batch_of(rows: list[list[int]], prompt: int = 2) -> dict[str, torch.Tensor]:
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


ROWS = [[1, 5, 9, 33, 7, 8, 2], [1, 44, 12, 99], [1, 17, 42, 99, 5, 63, 21, 2], [1, 3, 70, 71, 72]]


def test_objective_equals_full_logit_reference_and_sums_over_tokens(pair):
    student, teacher = pair
    student.train()
    batch = batch_of(ROWS)
    obj = make_distill_objective(teacher, temperature=3.0, kd_weight=0.7, ce_weight=0.2, top_k=0, chunk=5)
    loss_sum, count, metrics = obj(student, batch)
    y = F.pad(batch["labels"][:, 1:], (0, 1), value=-100).reshape(-1)
    keep = y != -100
    with torch.no_grad():
        z = student.output_projection(student(batch["input_ids"], batch["attention_mask"])).reshape(-1, 128)[keep]
        u = teacher.output_projection(teacher(batch["input_ids"], batch["attention_mask"])).reshape(-1, 128)[keep]
    ce_r, kd_r = reference(z, y[keep], u, 3.0)
    assert int(count) == int(keep.sum()) == sum(len(r) - 2 for r in ROWS)  # labels 2.. are targets
    torch.testing.assert_close(loss_sum.double(), 0.7 * kd_r.sum() + 0.2 * ce_r.sum(), rtol=1e-5, atol=1e-5)
    n = int(count)
    assert metrics["kd"] == pytest.approx(kd_r.sum().item() / n, rel=1e-4)  # fp32 KL of a small value
    assert metrics["ce"] == pytest.approx(ce_r.sum().item() / n, rel=1e-5)
    assert metrics["kd_weighted"] == pytest.approx(0.7 * metrics["kd"], rel=1e-6)
    assert metrics["ce_weighted"] == pytest.approx(0.2 * metrics["ce"], rel=1e-6)
    assert metrics["ppl"] == pytest.approx(math.exp(ce_r.mean().item()), rel=1e-5)
    # the token is the unit: two micro-batches sum to the whole batch (exact accumulation)
    a = obj(student, batch_of(ROWS[:2]))
    b = obj(student, batch_of(ROWS[2:]))
    torch.testing.assert_close(a[0] + b[0], loss_sum, rtol=1e-5, atol=1e-5)
    assert int(a[1]) + int(b[1]) == n


def test_gradients_reach_only_the_student_and_top_k_reference(pair):
    import copy

    student, teacher = pair
    s = copy.deepcopy(student).train()
    for p in s.parameters():
        p.requires_grad_(True)
    obj = DistillObjective(teacher, temperature=2.0, kd_weight=1.0, ce_weight=0.0, top_k=7, chunk=4)
    batch = batch_of(ROWS)
    loss_sum, count, _ = obj(s, batch)
    loss_sum.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert s.output_projection.weight.grad is not None and s.output_projection.weight.grad.abs().sum() > 0
    # the same loss from full logits and a sorted top-7 by hand
    y = F.pad(batch["labels"][:, 1:], (0, 1), value=-100).reshape(-1)
    keep = y != -100
    with torch.no_grad():
        z = s.output_projection(s(batch["input_ids"], batch["attention_mask"])).reshape(-1, 128)[keep]
        u = teacher.output_projection(teacher(batch["input_ids"], batch["attention_mask"])).reshape(-1, 128)[keep]
    torch.testing.assert_close(loss_sum.double(), reference(z, y[keep], u, 2.0, 7)[1].sum(), rtol=1e-5, atol=1e-5)


def test_student_equal_to_teacher_has_zero_kd(pair):
    student, _ = pair
    obj = make_distill_objective(student, temperature=4.0, kd_weight=1.0, ce_weight=0.0)
    student.train()
    _, _, m = obj(student, batch_of(ROWS))
    assert abs(m["kd"]) < 1e-6 and m["ce"] > 0


def test_eval_mode_returns_the_student_token_ce(pair):
    student, teacher = pair
    obj = make_distill_objective(teacher, temperature=2.0, kd_weight=1.0, ce_weight=0.0)
    batch = batch_of(ROWS)
    student.eval()
    with torch.no_grad():
        loss_sum, count, _ = obj(student, batch)
        y = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        logits = student.output_projection(student(batch["input_ids"], batch["attention_mask"]))
    want = F.cross_entropy(logits.reshape(-1, 128), y.reshape(-1), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(loss_sum, want, rtol=1e-5, atol=1e-5)
    assert int(count) == int((y != -100).sum())


def test_nf4_teacher(pair, hf_causal):
    """A 4-bit teacher: the KD is against the quantized teacher's own logits, still no gradient into it."""
    pytest.importorskip("bitsandbytes")
    import models
    from minitrain.adapters.quant import quantize_hook
    from minitrain.weights import load_pretrained

    student, _ = pair
    # widths multiples of 64: bitsandbytes' CPU inference kernel of an (unwrapped) Linear4bit needs whole blocks
    t_dir = hf_causal("distill_teacher_128", seed=1, hidden_size=128, intermediate_size=256)
    teacher = load_pretrained(t_dir, models.from_hf_config, tensor_hook=quantize_hook("nf4", compute_dtype=torch.float32))
    obj = make_distill_objective(teacher, temperature=2.0, kd_weight=1.0, ce_weight=0.0, top_k=9)
    batch = batch_of(ROWS)
    loss_sum, _, _ = obj(student.train(), batch)
    y = F.pad(batch["labels"][:, 1:], (0, 1), value=-100).reshape(-1)
    keep = y != -100
    with torch.no_grad():
        z = student.output_projection(student(batch["input_ids"], batch["attention_mask"])).reshape(-1, 128)[keep]
        u = teacher.output_projection(teacher(batch["input_ids"], batch["attention_mask"])).reshape(-1, 128)[keep]
    torch.testing.assert_close(loss_sum.double(), reference(z, y[keep], u, 2.0, 9)[1].sum(), rtol=1e-5, atol=1e-5)
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(kd_weight=0.0, ce_weight=0.0), dict(top_k=-1)])
def test_bad_settings_are_user_errors(pair, bad):
    kw = {**dict(temperature=2.0, kd_weight=0.5, ce_weight=0.5), **bad}
    with pytest.raises(UserError):
        make_distill_objective(pair[1], **kw)


# ----------------------------------------------------------------------------- feature and attention terms


@pytest.mark.parametrize("kind", ["mse", "cosine"])
def test_feature_distance_equals_per_element_loops(kind):
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(4, 6, generator=g) * 3, torch.randn(4, 6, generator=g)
    got = feature_distance(a, b, kind)
    for r in range(4):
        if kind == "mse":
            want = sum((a[r, d].item() - b[r, d].item()) ** 2 for d in range(6)) / 6
        else:
            dot = sum(a[r, d].item() * b[r, d].item() for d in range(6))
            na = math.sqrt(sum(a[r, d].item() ** 2 for d in range(6)))
            nb = math.sqrt(sum(b[r, d].item() ** 2 for d in range(6)))
            want = 1 - dot / (na * nb)
        assert got[r].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    if kind == "mse":
        torch.testing.assert_close(got, F.mse_loss(a, b, reduction="none").mean(-1))


def random_attention(B: int, H: int, T: int, g: torch.Generator, key_valid: torch.Tensor) -> torch.Tensor:
    """Causal attention probabilities (B, H, T, T) with 0 on future and padding keys."""
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & key_valid[:, None, None, :].bool()
    allowed = allowed | torch.eye(T, dtype=torch.bool)
    return (torch.randn(B, H, T, T, generator=g) * 2).masked_fill(~allowed, float("-inf")).softmax(-1)


@pytest.mark.parametrize("hs,ht", [(4, 4), (2, 4), (4, 2), (4, 6), (3, 4)])
def test_attention_kl_equals_per_element_loops(hs, ht):
    """KL(teacher || student) per query, from loops: heads averaged in gcd(hs, ht) consecutive
    groups, 0 log 0 = 0 on masked keys, averaged over the groups."""
    g = torch.Generator().manual_seed(6)
    B, T = 2, 5
    key_valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    s, t = random_attention(B, hs, T, g, key_valid), random_attention(B, ht, T, g, key_valid)
    got = attention_kl(s, t)
    G = math.gcd(hs, ht)
    for b in range(B):
        for q in range(T):
            total = 0.0
            for grp in range(G):
                for k in range(T):
                    ps = sum(s[b, h, q, k].item() for h in range(grp * hs // G, (grp + 1) * hs // G)) / (hs // G)
                    pt = sum(t[b, h, q, k].item() for h in range(grp * ht // G, (grp + 1) * ht // G)) / (ht // G)
                    if pt > 0:
                        total += pt * (math.log(pt) - math.log(ps))
            assert got[b, q].item() == pytest.approx(total / G, rel=1e-4, abs=1e-6)
    if hs == ht:  # and torch's KL, head by head
        want = F.kl_div(s.clamp_min(1e-38).log(), t, reduction="none").sum(-1).mean(1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_uniform_layer_map_and_overrides(pair):
    assert uniform_layer_map(2, 4) == {0: 1, 1: 3}
    assert uniform_layer_map(3, 4) == {0: 1, 1: 2, 2: 3}
    assert uniform_layer_map(4, 2) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert uniform_layer_map(3, 3) == {0: 0, 1: 1, 2: 2}
    student, teacher = pair  # 2 layers, 3 layers
    assert map_layers(student, teacher, None, [], "feature_layers") == {0: 1, 1: 2}
    assert map_layers(student, teacher, [-1], ["1:0"], "attention_layers") == {1: 0}
    with pytest.raises(UserError, match="^feature_layers: layer 2 does not exist"):
        map_layers(student, teacher, [2], [], "feature_layers")
    with pytest.raises(UserError, match="^layer_map: 0:3 is out of range"):
        map_layers(student, teacher, None, ["0:3"], "feature_layers")
    with pytest.raises(UserError, match="^layer_map: 'a:b' is not"):
        map_layers(student, teacher, None, ["a:b"], "feature_layers")


@pytest.fixture(scope="module")
def pair6(hf_causal):
    """Student (2 layers, width 64, 4 heads) and a teacher of 3 layers, width 96, 6 heads over 2 kv heads,
    plus both as transformers models with eager attention (the reference's hidden states and attention)."""
    import transformers

    import models
    from minitrain.weights import load_pretrained

    s_dir = hf_causal("distill_student")
    t_dir = hf_causal("distill_teacher_h6", seed=2, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2)
    ours = [load_pretrained(d, models.from_hf_config) for d in (s_dir, t_dir)]
    hf = [transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
          .eval() for d in (s_dir, t_dir)]
    return ours, hf


def hf_inside(model, batch):
    """transformers' logits, attentions and each decoder layer's output (caught by forward hooks:
    HF's own hidden_states give the last layer after the final norm)."""
    pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    layers = []
    hooks = [layer.register_forward_hook(lambda m, args, out: layers.append(out[0] if isinstance(out, tuple) else out))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=pos,
                        output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    out.layer_outputs = layers
    return out


@pytest.mark.parametrize("kind", ["mse", "cosine"])
def test_objective_with_all_terms_equals_the_reference(pair6, kind):
    """Every term from transformers' hidden states / attentions and explicit torch.nn.functional:
    student layers 0, 1 -> teacher 1, 2 (uniform rule) for features through the projections,
    student layer 1 -> teacher layer 2 for attention (4 vs 6 heads: 2 groups), on target tokens."""
    import copy

    (student, teacher), (hs, ht) = pair6
    student = copy.deepcopy(student).train()
    fmap, amap = map_layers(student, teacher, None, [], "f"), map_layers(student, teacher, [-1], [], "a")
    assert fmap == {0: 1, 1: 2} and amap == {1: 2}
    proj = attach_projections(student, teacher, fmap, seed=0)
    assert set(proj) == {"0", "1"} and proj["0"].weight.shape == (96, 64) and proj["0"].weight.requires_grad
    w = dict(kd_weight=0.3, ce_weight=0.2, feature_weight=0.4, attention_weight=0.1)
    obj = make_distill_objective(teacher, temperature=2.0, top_k=0, chunk=3, feature_loss=kind, feature_map=fmap,
                                 attention_map=amap, **w)
    batch = batch_of(ROWS)
    loss_sum, count, m = obj(student, batch)

    y = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    keep = y != -100  # (B, T): the target positions
    so, to = hf_inside(hs, batch), hf_inside(ht, batch)
    ce_r, kd_r = reference(so.logits[keep], y[keep], to.logits[keep], 2.0)
    feats = []
    for i, j in ((0, 1), (1, 2)):
        a = proj[str(i)](so.layer_outputs[i][keep]).detach()
        b = to.layer_outputs[j][keep]
        feats.append(F.mse_loss(a, b, reduction="none").mean(-1) if kind == "mse"
                     else 1 - F.cosine_similarity(a, b, dim=-1))
    feat_r = torch.stack(feats).mean(0)
    B, _, T, _ = so.attentions[1].shape
    sa = so.attentions[1].reshape(B, 2, 2, T, T).mean(2)  # 4 heads -> 2 groups of 2
    ta = to.attentions[2].reshape(B, 2, 3, T, T).mean(2)  # 6 heads -> 2 groups of 3
    att_r = F.kl_div(sa.clamp_min(1e-38).log(), ta, reduction="none").sum(-1).mean(1)[keep]
    want = {"kd": kd_r.sum(), "ce": ce_r.sum(), "feature": feat_r.sum(), "attention": att_r.sum()}
    n = int(keep.sum())
    assert int(count) == n
    torch.testing.assert_close(loss_sum.double(), sum(w[f"{k}_weight"] * v.double() for k, v in want.items()),
                               rtol=1e-4, atol=1e-5)
    for k, v in want.items():
        assert m[k] == pytest.approx(v.item() / n, rel=1e-4, abs=1e-6), k
        assert m[f"{k}_weighted"] == pytest.approx(w[f"{k}_weight"] * m[k], rel=1e-6), k
    assert m["feature"] > 0 and m["attention"] > 0


def test_gradients_reach_the_student_and_projections_only(pair6):
    """Feature term alone on student layer 0: the projection and student layer 0 (and the
    embedding) get gradients; student layer 1, its head and every teacher tensor do not."""
    import copy

    (student, teacher), _ = pair6
    s = copy.deepcopy(student).train()
    s.requires_grad_(True)
    fmap = {0: 1}
    attach_projections(s, teacher, fmap)
    obj = make_distill_objective(teacher, temperature=2.0, kd_weight=0.0, ce_weight=0.0, feature_weight=1.0,
                                 attention_weight=1.0, feature_map=fmap, attention_map={0: 0})
    loss_sum, _, _ = obj(s, batch_of(ROWS))
    loss_sum.backward()
    assert all(p.grad is None for p in teacher.parameters()) and not any(p.requires_grad for p in teacher.parameters())
    grads = {n: p.grad for n, p in s.named_parameters()}
    assert grads[f"{PROJECTIONS}.0.weight"].abs().sum() > 0
    assert grads["model.layers.0.mlp.down_proj.weight"].abs().sum() > 0
    assert grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0  # attention transfer reaches q, k
    assert grads["model.embed_tokens.weight"].abs().sum() > 0
    assert all(g is None for n, g in grads.items() if n.startswith(("model.layers.1.", "lm_head", "model.norm")))


def test_phi3_teacher_and_student_take_feature_and_attention_terms(hf_causal):
    """Phi-3 captures its layers (tests/test_families.py checks them against transformers): a Phi-3
    student learns from a wider Phi-3 teacher through every term, and the feature and attention
    terms reach the student's mapped layer (its fused qkv_proj included) and the projection."""
    import models
    from minitrain.weights import load_pretrained

    s = load_pretrained(hf_causal("distill_phi3_s", model_type="phi3", num_key_value_heads=2),
                        models.from_hf_config).train()
    teacher = load_pretrained(hf_causal("distill_phi3_t", seed=3, model_type="phi3", num_key_value_heads=2,
                                        hidden_size=96, intermediate_size=160, num_hidden_layers=3),
                              models.from_hf_config)
    s.requires_grad_(True)
    fmap = {0: 1}
    attach_projections(s, teacher, fmap)
    obj = make_distill_objective(teacher, temperature=2.0, kd_weight=0.5, ce_weight=0.5, feature_weight=1.0,
                                 attention_weight=1.0, feature_map=fmap, attention_map={0: 0})
    assert obj.terms == ("kd", "ce", "feature", "attention")
    loss_sum, count, metrics = obj(s, batch_of(ROWS))
    loss_sum.backward()
    assert torch.isfinite(loss_sum) and count > 0 and metrics["feature"] > 0 and metrics["attention"] > 0
    grads = {n: p.grad for n, p in s.named_parameters()}
    assert grads[f"{PROJECTIONS}.0.weight"].abs().sum() > 0
    assert grads["model.layers.0.self_attn.qkv_proj.weight"].abs().sum() > 0


def test_padded_vocabularies_distil_over_the_shared_ids(pair, hf_causal):
    """A teacher whose head scores 160 ids (the same first 128 + padding): KD renormalises both
    distributions over ids 0..127; CE stays the student's over its own 128. And the reverse."""
    import models
    from minitrain.weights import load_pretrained

    student, _ = pair
    big = load_pretrained(hf_causal("distill_v160_t", seed=3, vocab_size=160), models.from_hf_config)
    batch = batch_of(ROWS)
    y = F.pad(batch["labels"][:, 1:], (0, 1), value=-100).reshape(-1)
    keep = y != -100
    for s, t in ((student, big), (big, student)):
        obj = make_distill_objective(t, temperature=2.0, kd_weight=1.0, ce_weight=1.0)
        loss_sum, _, m = obj(s.train(), batch)
        with torch.no_grad():
            z = s.output_projection(s(batch["input_ids"], batch["attention_mask"])).reshape(-1, s.config.vocab_size)
            u = t.output_projection(t(batch["input_ids"], batch["attention_mask"])).reshape(-1, t.config.vocab_size)
        z, u = z[keep], u[keep]
        ce_r = F.cross_entropy(z, y[keep], reduction="none")  # over the student's whole head
        kd_r = reference(z[:, :128], y[keep], u[:, :128], 2.0)[1]
        torch.testing.assert_close(loss_sum.double(), (ce_r.double() + kd_r).sum(), rtol=1e-5, atol=1e-5)
        for top_k in (5,):
            obj = make_distill_objective(t, temperature=2.0, kd_weight=1.0, ce_weight=0.0, top_k=top_k)
            got = obj(s, batch)[0]
            torch.testing.assert_close(got.double(), reference(z[:, :128], y[keep], u[:, :128], 2.0, top_k)[1].sum(),
                                       rtol=1e-5, atol=1e-5)


def test_balance_note_matches_report_001():
    """Report 001's figures: kd 21.14, feature 40.79, attention 0.4858 at weights 0.7 / 0.1 / 0.1."""
    raw, w = {"kd": 21.1447, "feature": 40.786, "attention": 0.4858}, {"kd": 0.7, "feature": 0.1, "attention": 0.1}
    line = balance_note(raw, w, 4.0, 20)
    total = 0.7 * 21.1447 + 0.1 * 40.786 + 0.1 * 0.4858  # 18.93
    assert line.startswith("distill: loss balance over the first 20 steps is off (factor 4)") and "\n" not in line
    assert f"attention is {0.04858 / total * 100:.3g}% of the loss, its weight intends {0.1 / 0.9 * 100:.3g}% (" in line
    assert "kd is" not in line and "feature is" not in line  # 78% vs 78%, 21.5% vs 11.1%: within 4x
    fair = dict(kv.split("=") for kv in line.rsplit(": ", 1)[1].split())
    got = {k: float(fair[f"{k}_weight"]) * raw[k] for k in raw}  # the suggested weights give the intended shares
    for k in raw:
        assert got[k] / sum(got.values()) == pytest.approx(w[k] / 0.9, rel=2e-3)
    assert balance_note(raw, w, 100.0, 20) is None
    assert balance_note({"kd": 1.0, "ce": 2.0}, {"kd": 0.5, "ce": 0.5}, 4.0, 20) is None


def test_balance_is_reported_once(pair6):
    (student, teacher), _ = pair6
    lines = []
    obj = make_distill_objective(teacher, temperature=2.0, kd_weight=0.5, ce_weight=0.5, feature_weight=0.5,
                                 attention_weight=0.0, feature_map={0: 1}, balance_steps=2, micro_batches=2,
                                 balance_factor=1.01, log=lines.append)
    import copy

    s = copy.deepcopy(student).train()
    attach_projections(s, teacher, {0: 1})
    seen = []
    for k in range(7):
        seen.append(obj(s, batch_of(ROWS[k % 4:k % 4 + 1]))[2])
        assert len(lines) == (1 if k >= 3 else 0)  # after 2 steps x 2 micro-batches, and never again
    assert lines[0].startswith("distill: loss balance over the first 2 steps is off (factor 1.01)")
    raw = {k: sum(r[k] for r in seen[:4]) / 4 for k in ("kd", "ce", "feature")}
    assert lines[0] == balance_note(raw, obj.weights, 1.01, 2)


def test_projections_are_saved_and_taken_off_the_model(pair6, tmp_path):
    import copy

    from safetensors import safe_open

    (student, teacher), _ = pair6
    s = copy.deepcopy(student)
    proj = attach_projections(s, teacher, {0: 1, 1: 2})
    want = {k: v.detach().clone() for k, v in proj.state_dict().items()}
    path = save_projections(take_projections(s), tmp_path / "p.safetensors", {0: 1, 1: 2})
    assert not hasattr(s, PROJECTIONS) and not any(n.startswith(PROJECTIONS) for n, _ in s.named_parameters())
    with safe_open(str(path), "pt") as f:
        assert json.loads(f.metadata()["minitrain.layer_map"]) == {"0": 1, "1": 2}
        for k, v in want.items():
            torch.testing.assert_close(f.get_tensor(k), v)
    assert take_projections(s) == {} and save_projections({}, tmp_path / "q.safetensors", {}) is None
    assert not (tmp_path / "q.safetensors").exists()
    assert attach_projections(s, student, {0: 0}) is None  # same width: no projection


def test_a_family_without_captured_layers_is_refused(pair):
    """A model family without `captures_layers` (docs/contracts.md: False when absent; every family
    minitrain ships now has it) is refused for feature / attention terms in one error line, and
    still taught by KD + CE."""
    other = torch.nn.Linear(4, 4)  # stands for a family's model without the capture arguments
    assert pair[1].captures_layers and not captures_layers(other)
    with pytest.raises(UserError, match="^feature_weight / attention_weight: the teacher's model family does not"):
        make_distill_objective(other, temperature=2.0, kd_weight=0.5, ce_weight=0.5, feature_weight=0.1,
                               feature_map={0: 0})
    make_distill_objective(other, temperature=2.0, kd_weight=0.5, ce_weight=0.5)  # KD + CE need no layers


@pytest.mark.parametrize("bad,match", [(dict(feature_weight=1.0), "^feature_weight=1.0: no layers are mapped"),
                                        (dict(feature_loss="l1"), "^feature_loss=l1: must be mse or cosine"),
                                        (dict(kd_weight=0.0, ce_weight=0.0), "weights must be >= 0 and not all 0")])
def test_bad_term_settings_are_user_errors(pair, bad, match):
    kw = {**dict(temperature=2.0, kd_weight=0.5, ce_weight=0.5), **bad}
    with pytest.raises(UserError, match=match):
        make_distill_objective(pair[1], **kw)


# ----------------------------------------------------------------------------- same tokenizer


def test_tokenizer_check(tmp_path):
    a, b, c = make_bpe_tokenizer(tmp_path / "a"), make_bpe_tokenizer(tmp_path / "b"), make_sp_tokenizer(tmp_path / "c")
    check_same_tokenizer(a, b)  # identical files
    with pytest.raises(UserError) as e:
        check_same_tokenizer(a, c)
    msg = str(e.value)
    assert f"teacher={c}" in msg and f"model={a}" in msg and " — " in msg and "\n" not in msg
    # same table, one token renamed: caught by the id -> token comparison
    d = make_bpe_tokenizer(tmp_path / "d")
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    merges = tj["model"]["merges"]
    used = {x for m in merges for x in (m.split(" ") if isinstance(m, str) else m)}
    used |= {"".join(m.split(" ") if isinstance(m, str) else m) for m in merges}
    specials = {t["content"] for t in tj.get("added_tokens", [])}
    victim = next(t for t in sorted(vocab, key=vocab.get, reverse=True) if t not in used and t not in specials)
    vocab["zzzq"] = vocab.pop(victim)
    (d / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(UserError, match=f"id {vocab['zzzq']} is"):
        check_same_tokenizer(a, d)


def test_shared_vocab_and_ids_beyond_it(pair, hf_causal):
    import models
    from minitrain.data.readers import Examples
    from minitrain.weights import load_pretrained

    padded = load_pretrained(hf_causal("distill_v160", vocab_size=160), models.from_hf_config)
    assert shared_vocab(pair[0], padded) == shared_vocab(padded, pair[0]) == 128
    assert shared_vocab(pair[0], pair[1]) == 128
    ok = Examples([{"input_ids": [1, 5, 127], "labels": [-100, 5, 127]}], path="train.jsonl")
    assert check_ids_shared([ok, None], 128, "t_dir") == 127
    bad = Examples([*ok, {"input_ids": [1, 140], "labels": [-100, 140]}], path="train.jsonl")
    with pytest.raises(UserError) as e:
        check_ids_shared([ok, bad], 128, "t_dir")
    msg = str(e.value)
    assert msg.startswith("train.jsonl: example 1 holds token id 140") and "0..127" in msg and "\n" not in msg


# ----------------------------------------------------------------------------- the recipe


@pytest.fixture(scope="module")
def tiny(hf_causal, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill_recipe")
    student, teacher = root / "student", root / "teacher"
    shutil.copytree(hf_causal("distill_student"), student)
    shutil.copytree(hf_causal("distill_teacher", seed=1, hidden_size=96, intermediate_size=160,
                              num_hidden_layers=3), teacher)
    make_bpe_tokenizer(student)
    make_bpe_tokenizer(teacher)
    lines = corpus(16, seed=3)
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[:12]))
    (root / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[12:]))
    return {"root": root, "student": student, "teacher": teacher}


def run_recipe(tiny, out: Path, *extra: str) -> subprocess.CompletedProcess:
    keys = {"model": tiny["student"], "teacher": tiny["teacher"], "data": tiny["root"] / "train.jsonl",
            "eval_data": tiny["root"] / "eval.jsonl", "out": out, "max_steps": 2, "batch_size": 2,
            "lora_r": 4, "lora_alpha": 8, "grad_accum": 1, "top_k": 16}
    keys.update(e.split("=", 1) for e in extra)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "minitrain", str(REPO / "recipes" / "distill_llama.py"),
                           *[f"{k}={v}" for k, v in keys.items()]], cwd=REPO, env=env, capture_output=True, text=True)


def test_recipe_smoke(tiny):
    out = tiny["root"] / "out"
    p = run_recipe(tiny, out)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in ("kd", "ce", "kd_weighted", "ce_weighted", "ppl"):
            assert math.isfinite(r[k]), (k, r)
        assert r["kd"] > 0 and r["ppl"] == pytest.approx(math.exp(r["ce"]), rel=1e-6)
        assert r["loss"] == pytest.approx(r["kd_weighted"] + r["ce_weighted"], rel=1e-5)
    assert rows[-1]["eval/ppl"] == pytest.approx(math.exp(rows[-1]["eval/loss"]), rel=1e-9)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_recipe_refuses_another_tokenizer(tiny, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny["teacher"], teacher)
    (teacher / "tokenizer.json").unlink()
    make_sp_tokenizer(teacher)
    p = run_recipe(tiny, tmp_path / "out", f"teacher={teacher}")
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: teacher=") and "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_recipe_with_feature_and_attention_terms(tiny, finetune):
    """All four terms through the CLI (checkpointing on, an EMA kept): each logged raw and weighted, the
    loss their weighted sum, the balance line said once, the projections saved beside the adapter or
    the model and their average beside the EMA's (finetune=full: out/model and out/model_ema hold the
    student's own keys only and load in transformers)."""
    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = tiny["root"] / f"out_terms_{finetune}"
    p = run_recipe(tiny, out, "feature_weight=0.3", "attention_weight=0.2", "feature_loss=cosine",
                   "checkpointing=true", "balance_steps=1", "balance_factor=1.01", f"finetune={finetune}", "ema_decay=0.5")
    assert p.returncode == 0, p.stderr
    assert "feature_weight=0.3 (cosine) on student:teacher layers 0:1, 1:2; 2 projections 64->96" in p.stdout
    assert "attention_weight=0.2 on student:teacher layers 1:2" in p.stdout
    assert p.stdout.count("distill: loss balance over the first 1 steps is off") == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        parts = [r[f"{k}_weighted"] for k in ("kd", "ce", "feature", "attention")]
        assert r["loss"] == pytest.approx(sum(parts), rel=1e-5)
        assert r["feature_weighted"] == pytest.approx(0.3 * r["feature"], rel=1e-6) and r["attention"] > 0
    name = "adapter" if finetune == "lora" else "model"
    projections = []
    for folder in (out / name, out / f"{name}_ema"):
        projections.append(load_file(folder / "distill_projections.safetensors"))
        assert sorted(projections[-1]) == ["0.weight", "1.weight"] and projections[-1]["0.weight"].shape == (96, 64)
        if finetune == "full":
            keys = set(load_file(folder / "model.safetensors"))
            assert keys == set(load_file(tiny["student"] / "model.safetensors"))
            transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert not torch.equal(projections[0]["0.weight"], projections[1]["0.weight"])  # the average, not a copy


@pytest.mark.slow  # three runs of the recipe (~12 s)
def test_continued_distillation_with_projections_is_bitwise_the_straight_run(tiny, tmp_path, capsys):
    """finetune=full with feature and attention terms, constant LR: 2 steps then resume to 4 equals 4
    straight, the projections (in the checkpoint, then beside the model) included."""
    from safetensors.torch import load_file

    from minitrain.cli import run_cli

    def argv(out, steps, *extra):
        keys = {"model": tiny["student"], "teacher": tiny["teacher"], "data": tiny["root"] / "train.jsonl",
                "out": out, "max_steps": steps, "batch_size": 2, "grad_accum": 1, "finetune": "full",
                "schedule": "constant", "warmup": 0, "feature_weight": 0.3, "attention_weight": 0.2,
                "save_every": 2, "device": "cpu", "precision": "fp32", "skip_audit": "true"}
        return [str(REPO / "recipes" / "distill_llama.py"), *[f"{k}={v}" for k, v in keys.items()], *extra]

    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_cli(argv(straight, 4)) == 0, capsys.readouterr().err
    assert run_cli(argv(split, 2)) == 0, capsys.readouterr().err
    assert run_cli(argv(split, 4, "resume=true", "extend=true")) == 0, capsys.readouterr().err
    names = ("model/model.safetensors", "model/distill_projections.safetensors", "checkpoint/weights.safetensors",
             "checkpoint/optimizer.safetensors")
    for name in names:
        a, b = load_file(straight / name), load_file(split / name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
    assert any(k.startswith("distill_projections.") for k in load_file(split / "checkpoint/weights.safetensors"))
