"""minitrain.optim.AdamW against torch.optim.AdamW, the reference.

Exactness: the same update as torch's multi-tensor AdamW, op for op, so the parameters must be
EQUAL (max difference 0.0), not close: a wrong bias correction, a weight decay applied to the
gradient, or one step count shared by all parameters changes the last bits at least. In fp32 and
fp64 torch's single-tensor path (its CPU default) gives the same bits as its foreach path, so both
are references; in bf16 torch's own two paths differ by rounding (the single-tensor path rounds
`exp_avg_sq * beta2` before adding, the foreach kernels do not), and ours follows the foreach one.

Format: state dicts and minitrain checkpoints go from ours to torch's and back, and continue to
the same values as the optimizer that never stopped.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minitrain import checkpoint as ckpt
from minitrain.optim import AdamW

REPO = Path(__file__).resolve().parents[1]
LRS = [1e-2, 3e-2, 2e-2, 5e-3, 1e-3, 2e-2, 7e-3]  # a new LR before each step, as the loop's schedule does


def make_params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 5), (5,), (3, 6)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """Decay on the matrices; the vector alone with other betas and eps (per-group hyperparameters)."""
    return [{"params": [params[0], params[2]], "weight_decay": 0.1},
            {"params": [params[1]], "weight_decay": 0.0, "betas": (0.8, 0.95), "eps": 1e-6}]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """Gradients of varying scale; the third tensor gets none at step 2 (its step count falls behind)."""
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g) * 10.0 ** (i - step % 3)
        p.grad = None if (i == 2 and step == 2) else grad.to(p.dtype)


def run(opt, params: list[torch.nn.Parameter], steps: range) -> None:
    for s in steps:
        set_grads(params, s)
        for group in opt.param_groups:
            group["lr"] = LRS[s % len(LRS)]
        opt.step()
        opt.zero_grad(set_to_none=True)


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.detach().double() - y.detach().double()).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("dtype,foreach", [(torch.float32, False), (torch.float32, True), (torch.float64, False),
                                           (torch.float64, True), (torch.bfloat16, True)])
def test_same_bits_as_torch_adamw(dtype, foreach):
    ours, ref = make_params(dtype), make_params(dtype)
    opt = AdamW(groups(ours), lr=1e-3)
    torch_opt = torch.optim.AdamW(groups(ref), lr=1e-3, foreach=foreach)
    run(opt, ours, range(6))
    run(torch_opt, ref, range(6))
    assert max_diff(ours, ref) == 0.0
    assert ours[0].detach().sub(make_params(dtype)[0]).abs().max() > 1e-3  # it did train
    for p, q in zip(ours, ref):
        mine, theirs = opt.state[p], torch_opt.state[q]
        assert sorted(mine) == sorted(theirs) == ["exp_avg", "exp_avg_sq", "step"]
        assert mine["step"].dtype == theirs["step"].dtype == torch.float32 and mine["step"].dim() == 0
        assert mine["step"].device == theirs["step"].device and mine["step"].item() == theirs["step"].item()
        for k in ("exp_avg", "exp_avg_sq"):
            assert mine[k].dtype == p.dtype and torch.equal(mine[k], theirs[k])
    assert opt.state[ours[2]]["step"].item() == 5  # no gradient at step 2: counted per tensor


def test_state_dict_loads_into_either_and_continues_the_same():
    # ours -> (ours, torch): both continue exactly as the original does
    params = make_params()
    opt = AdamW(groups(params), lr=1e-3)
    run(opt, params, range(3))
    sd = opt.state_dict()
    assert sorted(sd) == ["param_groups", "state"] and [g["params"] for g in sd["param_groups"]] == [[0, 1], [2]]
    copies = []
    for cls in (AdamW, torch.optim.AdamW):
        q = [torch.nn.Parameter(p.detach().clone()) for p in params]
        other = cls(groups(q), lr=0.5)
        other.load_state_dict(copy.deepcopy(sd))  # (torch's load does not copy: keep the two apart)
        copies.append((other, q))
    run(opt, params, range(3, 6))
    for other, q in copies:
        run(other, q, range(3, 6))
        assert max_diff(params, q) == 0.0
    # torch -> ours: continues exactly as torch does
    ref = make_params()
    torch_opt = torch.optim.AdamW(groups(ref), lr=1e-3)
    run(torch_opt, ref, range(3))
    q = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt = AdamW(groups(q), lr=0.5)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert opt.param_groups[1]["betas"] == (0.8, 0.95) and opt.param_groups[0]["lr"] == LRS[2]
    run(torch_opt, ref, range(3, 6))
    run(opt, q, range(3, 6))
    assert max_diff(ref, q) == 0.0


def test_checkpoint_resumes_exactly_and_reads_torch_written_checkpoints(tmp_path):
    names = ["a.weight", "b.bias", "c.weight"]
    for writer in (AdamW, torch.optim.AdamW):  # torch's: checkpoints written before minitrain had its own
        params = make_params()
        opt = writer(groups(params), lr=1e-3)
        run(opt, params, range(3))
        ckpt.save(tmp_path / writer.__module__, list(zip(names, params)), opt, {"step": 3})
        fresh = make_params(seed=1)  # other values: the checkpoint must restore them
        resumed = AdamW(groups(fresh), lr=0.5)
        assert ckpt.load(tmp_path / writer.__module__, list(zip(names, fresh)), resumed)["step"] == 3
        assert max_diff(params, fresh) == 0.0
        run(opt, params, range(3, 6))
        run(resumed, fresh, range(3, 6))
        assert max_diff(params, fresh) == 0.0


def test_grad_scaler_unscales_steps_and_skips_an_overflow():
    results = []
    for cls in (AdamW, torch.optim.AdamW):
        params = make_params()
        opt = cls(groups(params), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for s in range(3):
            loss = sum((p * (i + 1)).pow(2).sum() for i, p in enumerate(params))
            scaler.scale(loss).backward()
            if s == 1:
                params[1].grad[0] = float("inf")  # an overflow: the step is skipped, the scale halved
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scaler.get_scale() == 2.0**9 and opt.state[params[0]]["step"].item() == 2
        results.append(params)
    assert max_diff(*results) == 0.0


def test_post_step_hook_zero_grad_and_refusals():
    params = make_params()
    opt = AdamW(groups(params), lr=1e-2)
    seen = []
    handle = opt.register_step_post_hook(lambda o, args, kwargs: seen.append(int(o.state[params[0]]["step"])))
    run(opt, params, range(2))
    handle.remove()
    run(opt, params, range(2, 3))
    assert seen == [1, 2]
    set_grads(params, 0)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params)
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW([{"params": params, "amsgrad": True}])
    with pytest.raises(ValueError, match="twice"):
        AdamW([{"params": params[:2]}, {"params": params[1:]}])
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(torch.optim.AdamW(groups(make_params()), amsgrad=True).state_dict())


def test_constructing_and_stepping_imports_no_dynamo():
    code = ("import sys, torch\n"
            "from minitrain.optim import AdamW\n"
            "p = torch.nn.Parameter(torch.randn(4, 4))\n"
            "opt = AdamW([p], lr=0.1)\n"
            "p.sum().backward(); opt.step(); opt.zero_grad(); opt.state_dict()\n"
            "print('torch._dynamo' in sys.modules)\n"
            "torch.optim.AdamW([p], lr=0.1)\n"  # the reason for this class: torch's does import it
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
