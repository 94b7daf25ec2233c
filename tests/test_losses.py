"""Chunked token losses against F.cross_entropy / log_softmax on the full logits.

Run `PYTHONPATH=. python tests/test_losses.py` to print the peak-memory figures (full logits vs chunked) at
vocab 32k and 128k, B=4, T=512, D=256 on CPU, each measured in a fresh subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minitrain.objectives.losses import chunked_cross_entropy_sum, chunked_token_logprobs, shift_labels


def _data(B=3, T=11, D=16, V=50, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, requires_grad=True)
    head = nn.Linear(D, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g) * 0.5)
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) < 0.35] = -100  # prompt / padding positions, scattered
    labels[0, :4] = -100
    return hidden, head, labels


@pytest.mark.parametrize("chunk", [1, 4, 7, None])
@pytest.mark.parametrize("bias", [False, True])
def test_sum_and_grads_equal_full_cross_entropy(chunk, bias):
    hidden, head, labels = _data(bias=bias)
    loss, count = chunked_cross_entropy_sum(hidden, head, labels, chunk=chunk)
    loss.backward()
    ours = [hidden.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if bias else [])
    hidden.grad = None
    head.zero_grad(set_to_none=True)

    ref = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    ref.backward()
    refs = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
    assert count.item() == (labels != -100).sum().item()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    for a, b in zip(ours, refs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 4, 7, None])
@pytest.mark.parametrize("bias", [False, True])
def test_frozen_head_path_gives_the_same_values_and_hidden_grads(chunk, bias, monkeypatch):
    # a frozen plain Linear takes the path that computes the row gradients in the forward: no checkpoint
    import minitrain.objectives.losses as losses

    monkeypatch.setattr(losses, "checkpoint", lambda *a, **k: pytest.fail("frozen head went through checkpoint"))
    hidden, head, labels = _data(bias=bias, seed=3)
    head.requires_grad_(False)
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(4))  # DPO-like: per-token weights
    lp = chunked_token_logprobs(hidden, head, labels, chunk=chunk)
    (lp * weights).sum().backward()
    ours, hidden.grad = hidden.grad.clone(), None

    full = F.log_softmax(head(hidden), dim=-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    ref = full.masked_fill(labels == -100, 0.0)
    (ref * weights).sum().backward()
    torch.testing.assert_close(lp, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours, hidden.grad, rtol=1e-5, atol=1e-6)
    assert head.weight.grad is None


@pytest.mark.parametrize("tile", [None, 7])
@pytest.mark.parametrize("offset", [0.0, 95.0, -120.0])
def test_frozen_head_blocks_and_the_shifted_path_against_fp64(offset, tile, monkeypatch):
    """The frozen path in blocks of rows x vocabulary columns (`tile` 7 over V=50: seven full
    blocks and one of a single column), exps unshifted where that is safe. With logits past exp's
    range (a bias of +95: exp overflows in fp32; -120: every exp underflows to 0) it must redo the
    rows shifted by their max (the only place it takes a max). Log-probs and the rows' gradient
    against fp64 log_softmax and its autograd gradient."""
    from minitrain.objectives.losses import frozen_head_logprobs

    maxes = []
    real_amax = torch.Tensor.amax
    monkeypatch.setattr(torch.Tensor, "amax", lambda self, *a, **k: maxes.append(1) or real_amax(self, *a, **k))
    hidden, head, labels = _data(bias=True, seed=6, V=50)
    keep = labels != -100
    h, y = hidden.detach()[keep], labels[keep]
    with torch.no_grad():
        head.bias.add_(offset)
    grad = torch.empty_like(h)
    lp = frozen_head_logprobs(h, head.weight.detach(), head.bias.detach(), y, 5, grad, tile=tile)
    assert (len(maxes) > 0) == (offset != 0)
    h64 = h.double().requires_grad_()
    ref = F.log_softmax(F.linear(h64, head.weight.double(), head.bias.double()), dim=-1).gather(1, y[:, None])[:, 0]
    ref.sum().backward()
    assert torch.isfinite(lp).all()
    torch.testing.assert_close(lp.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), h64.grad, rtol=1e-5, atol=1e-5)


def test_frozen_head_block_on_a_cpu_covers_a_micro_batch_in_cache_sized_tiles():
    from minitrain.objectives.losses import CPU_TILE, frozen_head_block, logits_per_chunk

    rows, cols = frozen_head_block(700, 128256, "cpu", low=False)
    assert rows == 700 and cols == CPU_TILE < 128256 and rows * cols <= logits_per_chunk("cpu")
    assert frozen_head_block(700, 128256, "cpu", low=True) == (128, 128256)  # bf16: whole-vocabulary chunks
    assert frozen_head_block(700, 50, "cpu", low=False, chunk=5) == (5, 50)


def test_frozen_and_checkpointed_paths_agree_under_bf16_autocast():
    hidden, head, labels = _data(seed=5, V=300)
    grads, values = [], []
    for frozen in (True, False):
        head.requires_grad_(not frozen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = chunked_cross_entropy_sum(hidden, head, labels, chunk=4)
        loss.backward()
        grads.append(hidden.grad.clone())
        values.append(loss.detach())
        hidden.grad = None
    assert values[0].dtype == torch.float32
    torch.testing.assert_close(values[0], values[1], rtol=1e-6, atol=1e-6)  # the same bf16 logits, fp32 sums
    torch.testing.assert_close(grads[0], grads[1], rtol=0.02, atol=2e-3)  # bf16 products, other order


def test_token_logprobs_equal_log_softmax_and_zero_on_ignored():
    hidden, head, labels = _data(seed=1)
    with torch.no_grad():
        lp = chunked_token_logprobs(hidden, head, labels, chunk=5)
        full = F.log_softmax(head(hidden), dim=-1)
        ref = full.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1).masked_fill(labels == -100, 0.0)
    assert lp.shape == labels.shape and lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref, rtol=1e-6, atol=1e-6)
    assert (lp[labels == -100] == 0).all()


class CountingHead(nn.Module):
    """A head that records how many rows it is applied to (forward and recompute)."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head
        self.rows: list[int] = []

    def forward(self, x):
        self.rows.append(x.shape[0])
        return self.head(x)


def test_ignored_positions_are_never_projected_and_chunks_bound_the_rows():
    hidden, head, labels = _data(B=4, T=20)
    counting = CountingHead(head)
    loss, count = chunked_cross_entropy_sum(hidden, counting, labels, chunk=6)
    forward_rows = list(counting.rows)
    loss.backward()
    n = int((labels != -100).sum())
    assert sum(forward_rows) == n and max(forward_rows) <= 6
    assert sum(counting.rows) == 2 * n  # the backward recomputed each chunk once, targets only


def test_no_targets_gives_zero_sum_and_count():
    hidden, head, _ = _data()
    labels = torch.full(hidden.shape[:2], -100)
    loss, count = chunked_cross_entropy_sum(hidden, head, labels)
    assert loss.item() == 0.0 and count.item() == 0


def test_bf16_autocast_reduces_in_fp32_and_matches_fp32_loosely():
    hidden, head, labels = _data(seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = chunked_token_logprobs(hidden, head, labels, chunk=4)
    assert lp.dtype == torch.float32
    with torch.no_grad():
        ref = chunked_token_logprobs(hidden, head, labels, chunk=4)
    torch.testing.assert_close(lp, ref, rtol=0.05, atol=0.1)  # bf16 matmul, fp32 reduction


def test_shift_labels_is_next_token():
    labels = torch.tensor([[5, 6, 7, -100], [-100, 8, 9, 10]])
    assert shift_labels(labels).tolist() == [[6, 7, -100, -100], [8, 9, 10, -100]]


# ---------------------------------------------------------------------------- objectives vs transformers


def _causal_batch(seed=0, B=3, T=9, V=128):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 6:] = 0  # right padding
    mask[2, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100  # prompt tokens
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_sft_objective_equals_transformers_llama_loss(hf_causal):
    import transformers

    import models
    from minitrain.objectives.sft import sft
    from minitrain.weights import load_pretrained

    folder = hf_causal("llama_obj")
    ours = load_pretrained(folder, models.from_hf_config)
    ref = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    batch = _causal_batch()
    loss_sum, count, _ = sft(ours, batch)
    with torch.no_grad():
        want = ref(**batch).loss  # HF shifts the labels inside and takes the token mean
    assert count.item() == int((batch["labels"][:, 1:] != -100).sum())
    torch.testing.assert_close(loss_sum / count, want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    import transformers

    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # tied head (v1.0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    folder = tmp_path_factory.mktemp("t5_obj")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("with_decoder_inputs", [False, True])
def test_seq2seq_objective_equals_transformers_t5_loss(t5_folder, with_decoder_inputs):
    import transformers

    import models
    from minitrain.data.collate import collate_seq2seq
    from minitrain.objectives.sft import seq2seq
    from minitrain.weights import load_pretrained

    ours = load_pretrained(t5_folder, models.from_hf_config).eval()  # dropout_rate 0.1 in the config
    ref = transformers.T5ForConditionalGeneration.from_pretrained(t5_folder).eval()
    g = torch.Generator().manual_seed(3)
    examples = [{"input_ids": torch.randint(2, 64, (n,), generator=g).tolist() + [1],
                 "labels": torch.randint(2, 64, (m,), generator=g).tolist() + [1]}
                for n, m in ((5, 3), (9, 7), (2, 1))]
    batch = collate_seq2seq(examples, pad_id=0)
    if not with_decoder_inputs:  # the objective shifts the labels right itself
        batch = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    loss_sum, count, _ = seq2seq(ours, batch)
    with torch.no_grad():
        want = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    assert count.item() == sum(len(ex["labels"]) for ex in examples)
    torch.testing.assert_close(loss_sum / count, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- peak memory

_MEASURE = r"""
import json, re, sys, torch, torch.nn.functional as F
from torch import nn
sys.path.insert(0, {root!r})
from minitrain.objectives.losses import chunked_cross_entropy_sum
torch.set_num_threads(1)
B, T, D, V, mode, chunk, train_head = {B}, {T}, {D}, {V}, {mode!r}, {chunk!r}, {train_head!r}
torch.manual_seed(0)
hidden = torch.randn(B, T, D, requires_grad=True)
head = nn.Linear(D, V, bias=False).requires_grad_(train_head)
labels = torch.randint(0, V, (B, T))
hidden.grad = torch.zeros_like(hidden)  # gradient buffers exist before the measurement
if train_head:
    head.weight.grad = torch.zeros_like(head.weight)
def status(key):  # MiB, from the kernel's accounting of this process
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024
def run(h, y):
    if mode == "full":
        loss = F.cross_entropy(head(h).flatten(0, 1).float(), y.flatten(), reduction="sum")
    else:
        loss, _ = chunked_cross_entropy_sum(h, head, y, chunk=chunk)
    loss.backward()
    return loss
run(hidden[:1, :2].detach().requires_grad_(), labels[:1, :2])  # warm-up: lazy imports, kernels
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
base = status("VmRSS")
loss = run(hidden, labels)
print(json.dumps({{"peak_mb": status("VmHWM") - base, "loss": loss.item()}}))
"""


def measure_peak(mode: str, *, B: int, T: int, D: int, V: int, chunk: int | None = None,
                 train_head: bool = True) -> dict:
    """Peak RSS growth (MiB) of one loss forward + backward in a fresh process (Linux)."""
    import pathlib

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")

    root = str(pathlib.Path(__file__).resolve().parents[1])
    code = _MEASURE.format(root=root, B=B, T=T, D=D, V=V, mode=mode, chunk=chunk, train_head=train_head)
    # fixed glibc thresholds: big blocks are mmapped and unmapped on free, so RSS tracks live bytes
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_chunked_loss_peak_memory_is_a_fraction_of_full_logits():
    # B*T*V = 2*256*32000 fp32 logits = 62.5 MiB per copy; the full path holds several copies
    shape = dict(B=2, T=256, D=64, V=32000)
    full, chunked = measure_peak("full", **shape), measure_peak("chunked", **shape, chunk=64)
    print(f"peak RSS growth: full {full['peak_mb']:.0f} MiB, chunked {chunked['peak_mb']:.0f} MiB")
    assert abs(full["loss"] - chunked["loss"]) <= 1e-4 * abs(full["loss"])
    assert full["peak_mb"] > 100  # the full logits really were materialised
    assert chunked["peak_mb"] < full["peak_mb"] / 2


if __name__ == "__main__":
    for train_head in (True, False):  # a trained head (full FT) adds its (V, D) gradient per chunk
        for V in (32000, 128256):
            shape = dict(B=4, T=512, D=256, V=V, train_head=train_head)
            full, chunked = measure_peak("full", **shape), measure_peak("chunked", **shape)
            print(f"B=4 T=512 D=256 V={V} head {'trained' if train_head else 'frozen '}: logits "
                  f"{4 * 512 * V * 4 / 2**20:.0f} MiB fp32 | peak RSS growth full {full['peak_mb']:.0f} MiB, "
                  f"chunked {chunked['peak_mb']:.0f} MiB ({full['peak_mb'] / max(chunked['peak_mb'], 1):.1f}x less)")
