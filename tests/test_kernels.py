"""`minitrain.kernels`: flash-linear-attention's kernels on Qwen3.5's Gated DeltaNet layers.

fla's kernels are Triton, CUDA only: `tests/test_cuda.py::test_fla_kernels_equal_torch_path` compares them with
the torch path on a GPU. Here, on the CPU, the glue around them is checked against a stand-in written from
fla's documented contract (`chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
cu_seqlens=...)` with q / k `[1, N, H, K]`, v `[1, N, HV, V]`, value head i reading q / k head
i // (HV / H), L2 normalisation x / sqrt(sum x^2 + 1e-6), scale K^-1/2, a zero state at each sequence of
`cu_seqlens`; `causal_conv1d(x [1, N, D], weight [D, W], activation="silu", cu_seqlens=...)`, tap j reading
x_{t - W + 1 + j} of its own sequence), computed token by token: the stand-in shares no code with the torch
path's chunked rule. Through it a padded batch, a packed row and a batch without padding give the torch
path's logits and gradients, so the batch is laid out and cut into sequences as the torch path cuts it (a
wrong `cu_seqlens` leaks a state across documents: 0.77 of the logits, tests/test_qwen3_5.py).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from test_qwen3_5 import batch, checkpoints, folder, load_ours, rel  # noqa: F401 (fixtures)

from minitrain.errors import UserError
from minitrain.kernels import FlaDeltaNet, attach, deltanet_layers, resolve_kernels
from models.qwen3_5 import sequence_bounds


def _spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def stand_in_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=False, cu_seqlens=None, scale=None):
    assert use_qk_l2norm_in_kernel and q.shape[0] == 1 and cu_seqlens is not None
    H, HV = q.shape[2], v.shape[2]
    q, k = (t.float() / torch.sqrt((t.float() ** 2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = []  # per token (HV, V), the tokens in order
    for bos, eos in _spans(cu_seqlens):
        S = [torch.zeros(q.shape[-1], v.shape[-1]) for _ in range(HV)]  # (K, V) per value head, zero at the start
        for t in range(bos, eos):
            o_t = []
            for h in range(HV):
                qh, kh = q[0, t, h // (HV // H)] * scale, k[0, t, h // (HV // H)]
                Sh = S[h] * g[0, t, h].float().exp()
                delta = beta[0, t, h].float() * (v[0, t, h].float() - kh @ Sh)
                S[h] = Sh + kh[:, None] * delta[None, :]
                o_t.append(qh @ S[h])
            out.append(torch.stack(o_t))
    return torch.stack(out)[None].to(v.dtype), None


def stand_in_conv(x, weight, activation=None, cu_seqlens=None):
    assert activation == "silu" and x.shape[0] == 1 and cu_seqlens is not None
    W = weight.shape[1]
    pieces = []
    for bos, eos in _spans(cu_seqlens):
        seq = F.pad(x[0, bos:eos], (0, 0, W - 1, 0))  # (W - 1 + n, D): zeros before the sequence
        n = eos - bos
        pieces.append(sum(seq[j:j + n] * weight[:, j] for j in range(W)))
    return F.silu(torch.cat(pieces))[None], None


@pytest.fixture
def stand_in_fla(monkeypatch):
    """`fla` as sys.modules sees it: the two functions `FlaDeltaNet` imports, as the stand-ins above."""
    fla = types.ModuleType("fla")
    conv = types.ModuleType("fla.modules.causal_conv1d")
    rule = types.ModuleType("fla.ops.gated_delta_rule")
    conv.causal_conv1d, rule.chunk_gated_delta_rule = stand_in_conv, stand_in_rule
    for name, mod in {"fla": fla, "fla.modules": types.ModuleType("fla.modules"), "fla.modules.causal_conv1d": conv,
                      "fla.ops": types.ModuleType("fla.ops"), "fla.ops.gated_delta_rule": rule}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return FlaDeltaNet()


def forward_backward(model, ids, mask=None, **kw):
    model.zero_grad()
    out = model(ids, mask, **kw)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_sequence_bounds_cut_rows_and_their_starts():
    starts = torch.tensor([[False, False, True, False], [True, True, False, False]])
    assert sequence_bounds(starts, 2, 4, torch.device("cpu")).tolist() == [0, 2, 4, 5, 8]
    assert sequence_bounds(None, 3, 5, torch.device("cpu")).tolist() == [0, 5, 10, 15]


@pytest.mark.parametrize("layout", ["packed", "left_padded_ragged", "left_padded", "plain"])
def test_kernel_glue_gives_the_torch_paths_logits_and_gradients(checkpoints, stand_in_fla, layout):
    model = load_ours(checkpoints("dense"), 16).requires_grad_(True)
    assert len(deltanet_layers(model)) == 3
    g = torch.Generator().manual_seed(5)
    kw = {}
    if layout == "packed":  # three documents and padding in one row
        lengths = [21, 30, 9]
        ids = torch.randint(3, 128, (1, sum(lengths) + 4), generator=g)
        kw["document_ids"] = torch.cat([torch.full((1, n), i + 1) for i, n in enumerate(lengths)]
                                       + [torch.full((1, 4), -1)], 1)
        kw["position_ids"] = torch.cat([torch.arange(n)[None] for n in lengths] + [torch.zeros(1, 4, dtype=torch.long)], 1)
        mask = None
    elif layout == "plain":
        ids, mask = torch.randint(3, 128, (2, 40), generator=g), None
    else:  # T >= 32 runs without its padding on a CPU (`Ragged`), T < 32 padded
        ids, mask = batch(50, "left", n_pad=17, seed=6) if layout == "left_padded_ragged" else batch(20, "left", n_pad=6, seed=6)
    ref, ref_grads = forward_backward(model, ids, mask, **kw)
    assert attach(model, stand_in_fla) == 3
    out, grads = forward_backward(model, ids, mask, **kw)
    real = torch.ones_like(ref[..., 0], dtype=torch.bool) if mask is None else mask.bool()
    assert rel(out[real], ref[real]) <= 1e-4
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert rel(grad, ref_grads[name]) <= 1e-4, name
    attach(model, None)  # back on the torch path
    assert rel(forward_backward(model, ids, mask, **kw)[0][real], ref[real]) == 0


def test_generation_keeps_the_torch_path(checkpoints, stand_in_fla, monkeypatch):
    """With a KV cache (`generate`, the sampler: prefill and decoding) the layer runs its own recurrence, never
    the kernels, and generates what it does without them."""
    import models
    from test_llama import prompts

    model = load_ours(checkpoints("dense"), 16)
    ids, mask = prompts()
    ref = models.family(model).generate(model, ids, mask, max_new_tokens=6, eos_token_id=[], pad_token_id=0)
    attach(model, stand_in_fla)
    for name in ("rule", "conv"):
        monkeypatch.setattr(stand_in_fla, name, lambda *a, **k: pytest.fail("kernels used under a cache"))
    out = models.family(model).generate(model, ids, mask, max_new_tokens=6, eos_token_id=[], pad_token_id=0)
    assert torch.equal(out, ref)


def test_settings(checkpoints, folder):
    model = load_ours(folder)
    cpu = torch.device("cpu")
    assert resolve_kernels("auto", model, cpu) is False  # the torch path on a CPU, silently
    assert resolve_kernels("torch", model, torch.device("cuda")) is False
    with pytest.raises(UserError, match="kernels=fla: fla's kernels run on CUDA only"):
        resolve_kernels("fla", model, cpu)
    with pytest.raises(UserError, match="kernels='triton' — use one of auto, fla, torch"):
        resolve_kernels("triton", model, cpu)
    assert resolve_kernels("fla", torch.nn.Linear(2, 2), cpu) is False  # no DeltaNet layer: nothing to do
