"""The cost of Gemma 2's soft-capped attention against SDPA on the same shapes (CPU).

    python tools/softcap_attention.py [--seqs 512,1024,2048] [--repeat 3]

Gemma 2 caps its attention scores (`cap * tanh(s / cap)` before the mask and softmax), which
`torch.nn.functional.scaled_dot_product_attention` cannot do, so `models/gemma.py` runs those
layers through `capped_attention` (the scores in memory, softmax in fp32, as transformers' eager
path) and keeps SDPA for the layers without a cap (every Gemma 3 layer). Shapes are Gemma 2 2B's
attention: one row, 8 query heads over 4 key/value heads (repeated, as the model does), head_dim
256, scale 256 ** -0.5, cap 50, causal, fp32. For each length: forward + backward time (median of
`--repeat`, after a warm-up) and the peak bytes allocated during it (torch.profiler's memory
events, `minitrain.plan.measure.measure_peak_allocated`), for both paths. Times are the process's CPU time
(one thread), so other load on the machine does not count. The outputs agree to 1e-4
when the cap is huge (tanh is then the identity), which the tool checks first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minitrain.plan.measure import measure_peak_allocated  # noqa: E402
from models.layers import capped_attention, repeat_kv  # noqa: E402

HEADS, KV, HD, CAP = 8, 4, 256, 50.0


def inputs(T: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, T, HD, generator=g).requires_grad_(True)
    k = torch.randn(1, KV, T, HD, generator=g).requires_grad_(True)
    v = torch.randn(1, KV, T, HD, generator=g).requires_grad_(True)
    return q, k, v


def step(path: str, q, k, v, cap: float = CAP) -> torch.Tensor:
    kr, vr = repeat_kv(k, HEADS // KV), repeat_kv(v, HEADS // KV)
    if path == "sdpa":
        y = F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=HD**-0.5)
    else:
        y = capped_attention(q, kr, vr, None, HD**-0.5, cap)
    return y


def fwd_bwd(path: str, q, k, v) -> None:
    step(path, q, k, v).square().sum().backward()
    q.grad = k.grad = v.grad = None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="512,1024,2048")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    q, k, v = inputs(64)
    with torch.no_grad():
        diff = (step("sdpa", q, k, v) - step("capped", q, k, v, cap=1e9)).abs().max().item()
    assert diff <= 1e-4, f"capped attention with an infinite cap differs from SDPA by {diff}"
    print("| tokens | SDPA: fwd+bwd / peak allocated | capped: fwd+bwd / peak allocated | time ratio | memory ratio |")
    print("|---|---|---|---|---|")
    for T in map(int, args.seqs.split(",")):
        q, k, v = inputs(T)
        got = {}
        for path in ("sdpa", "capped"):
            fwd_bwd(path, q, k, v)  # warm-up
            times = []
            for _ in range(args.repeat):
                t0 = time.process_time()
                fwd_bwd(path, q, k, v)
                times.append(time.process_time() - t0)
            peak, _ = measure_peak_allocated(lambda: fwd_bwd(path, q, k, v))
            got[path] = (statistics.median(times), peak / 2**20)
        (ts, ms), (tc, mc) = got["sdpa"], got["capped"]
        print(f"| {T} | {ts * 1e3:,.0f} ms / {ms:,.1f} MiB | {tc * 1e3:,.0f} ms / {mc:,.1f} MiB | {tc / ts:.2f} | "
              f"{mc / ms:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
