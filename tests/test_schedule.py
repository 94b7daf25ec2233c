"""LR schedules against closed forms and transformers' schedulers; step accounting under accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from minitrain.errors import UserError
from minitrain.schedule import lr_at, resolve_steps


def _ours(kind, total, warm, peak=1e-3, min_ratio=0.0):
    return [lr_at(s, total_steps=total, warmup_steps=warm, peak_lr=peak, kind=kind, min_lr_ratio=min_ratio)
            for s in range(1, total + 1)]


def _hf(factory, total, warm, peak=1e-3, **kw):
    """LRs transformers' scheduler gives update k (1-based): its lambda at k - 1 calls."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=peak)
    sched = factory(opt, num_warmup_steps=warm, num_training_steps=total, **kw)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("total,warm", [(20, 0), (20, 5), (7, 3), (1, 0), (5, 5)])
def test_post_warmup_matches_transformers_cosine_and_linear(total, warm):
    import transformers

    # transformers' first update runs at LR 0 (k-1 = 0 warmup calls); ours at peak/W. After
    # warmup both use progress (k - 1 - W) / (N - W): the decay must match to the last digit.
    for kind, factory in (("cosine", transformers.get_cosine_schedule_with_warmup),
                          ("linear", transformers.get_linear_schedule_with_warmup)):
        ours, ref = _ours(kind, total, warm), _hf(factory, total, warm)
        assert ours[warm:] == pytest.approx(ref[warm:], rel=1e-12, abs=1e-15)


def test_cosine_min_lr_matches_transformers_min_lr_variant():
    import transformers

    total, warm, ratio = 30, 4, 0.1
    ref = _hf(transformers.get_cosine_with_min_lr_schedule_with_warmup, total, warm, min_lr_rate=ratio)
    assert _ours("cosine", total, warm, min_ratio=ratio)[warm:] == pytest.approx(ref[warm:], rel=1e-12)


def test_closed_forms():
    peak, total, warm, ratio = 3e-4, 25, 5, 0.2
    lo = peak * ratio
    cos = _ours("cosine", total, warm, peak, ratio)
    lin = _ours("linear", total, warm, peak, ratio)
    const = _ours("constant", total, warm, peak, ratio)
    for k in range(1, warm + 1):  # linear warmup from 0: peak * k / W
        assert cos[k - 1] == lin[k - 1] == const[k - 1] == pytest.approx(peak * k / warm)
    for k in range(warm + 1, total + 1):
        p = (k - warm - 1) / (total - warm)
        assert cos[k - 1] == pytest.approx(lo + (peak - lo) * (1 + math.cos(math.pi * p)) / 2)
        assert lin[k - 1] == pytest.approx(lo + (peak - lo) * (1 - p))
        assert const[k - 1] == pytest.approx(peak)
    # a real half cosine: peak right after warmup, the midpoint at (peak + min) / 2, never below min
    assert cos[warm] == pytest.approx(peak)
    assert all(a >= b for a, b in zip(cos[warm:], cos[warm + 1 :]))
    assert min(cos[warm:]) > lo and cos[-1] < lo + 0.01 * (peak - lo)
    mid = warm + 1 + (total - warm) // 2  # p = 1/2 exactly when (total - warm) is even
    assert (total - warm) % 2 == 0 and cos[mid - 1] == pytest.approx((peak + lo) / 2)


def test_no_update_runs_at_zero_lr():
    for kind in ("constant", "linear", "cosine"):
        for total, warm in ((10, 0), (10, 3), (3, 3)):
            assert min(_ours(kind, total, warm)) > 0


def test_steps_are_optimizer_steps_under_accumulation():
    # 100 examples, batch 4 -> 25 micro-batches per epoch; accum 5 -> 5 optimizer steps per epoch
    assert resolve_steps(100, 4, 5, 1.0, -1, 0.0) == (5, 0, 25)
    assert resolve_steps(100, 4, 5, 3.0, -1, 2) == (15, 2, 25)
    assert resolve_steps(100, 4, 5, 3.0, -1, 0.1) == (15, 2, 25)  # ceil(0.1 * 15)
    assert resolve_steps(101, 4, 5, 1.0, -1, 0.0) == (5, 0, 26)  # the 26th micro-batch fills no window
    assert resolve_steps(100, 4, 5, 1.0, 40, 0.25) == (40, 10, 25)  # max_steps wins over epochs
    assert resolve_steps(3, 4, 8, 1.0, -1, 0.0) == (1, 0, 1)  # at least one step
    # field report 001: 25,000 batches x 3 epochs with accum 16 are 4,687 updates, not 75,000
    assert resolve_steps(25_000 * 8, 8, 16, 3.0, -1, 0.0)[0] == 75_000 // 16


@pytest.mark.parametrize("args,key", [
    ((100, 4, 5, 1.0, -1, 6), "warmup"),  # 6 warmup steps, 5-step run
    ((100, 4, 5, 1.0, -1, 2.5), "warmup"),
    ((100, 4, 5, 1.0, -1, -1), "warmup"),
    ((100, 0, 5, 1.0, -1, 0), "batch_size"),
    ((100, 4, 0, 1.0, -1, 0), "grad_accum"),
    ((0, 4, 1, 1.0, -1, 0), "data"),
])
def test_bad_settings_are_user_errors_naming_the_key(args, key):
    with pytest.raises(UserError) as e:
        resolve_steps(*args)
    assert str(e.value).startswith(key) and " — " in str(e.value)


def test_unknown_kind():
    with pytest.raises(UserError, match="^schedule"):
        lr_at(1, total_steps=2, warmup_steps=0, peak_lr=1.0, kind="step")
