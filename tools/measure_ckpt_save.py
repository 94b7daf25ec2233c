"""Per-rank cost of one checkpoint save under parallel=fsdp: memory rise, bytes written, seconds.

    python tools/measure_ckpt_save.py [--ranks 2 4] [--layers 12] [--width 2048] [--src DIR]

For each world size, starts `torchrun --nproc_per_node N` (gloo, CPU) on this file: a stack of
`--layers` bias-free Linear(width, width) layers, FSDP2-sharded per layer, one AdamW step (so the
optimizer holds its two moments), then one `minitrain.checkpoint.save`. Each rank reports the rise
of its resident memory during the save (sampled every 2 ms), the bytes of the tensor files it wrote
(its parts; rank 0 also the whole files of a non-sharded layout), and the save's seconds. `--src`: the
minitrain checkout to measure (default: this one), e.g. an older one to compare layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(out: str, layers: int, width: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from minitrain import checkpoint as ckpt
    from minitrain.optim import AdamW

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    opt = AdamW([p for _, p in named], lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()

    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    dist.barrier()
    base = rss()
    peak, done = [base], [False]

    def sample() -> None:
        while not done[0]:
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    t0 = time.perf_counter()
    ckpt.save(out, named, opt, {"step": 1})
    seconds = time.perf_counter() - t0
    done[0] = True
    t.join()
    folder = Path(out) / "checkpoint"
    mine = [p for p in folder.glob("*.safetensors") if not p.name.startswith("rng")
            and (f".rank{rank}." in p.name or (rank == 0 and ".rank" not in p.name))]
    print(json.dumps({"rank": rank, "rss_rise_mb": (peak[0] - base) / 2**20,
                      "written_mb": sum(p.stat().st_size for p in mine) / 2**20, "save_s": seconds}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes to measure (default 2 4)")
    ap.add_argument("--layers", type=int, default=12, help="Linear layers (default 12)")
    ap.add_argument("--width", type=int, default=2048, help="their width (default 2048: 16 MiB each in fp32)")
    ap.add_argument("--src", default=str(REPO), help="the minitrain checkout to measure (default: this one)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.layers, args.width)
        return 0
    state_mb = args.layers * args.width**2 * 4 * 3 / 2**20  # weights + AdamW's two moments, fp32
    print(f"{args.layers} x Linear({args.width}, {args.width}): weights + optimizer state {state_mb:.0f} MiB; "
          f"src {args.src}")
    print("| ranks | rank | memory rise in the save (MiB) | tensor files written (MiB) | save (s) |")
    print("| --- | --- | --- | --- | --- |")
    env = {**os.environ, "PYTHONPATH": args.src, "OMP_NUM_THREADS": "1"}
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as out:
            p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
                                __file__, "--child", out, "--layers", str(args.layers), "--width", str(args.width)],
                               env=env, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            print(p.stderr[-3000:], file=sys.stderr)
            return 1
        for row in sorted((json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")), key=lambda r: r["rank"]):
            print(f"| {n} | {row['rank']} | {row['rss_rise_mb']:.0f} | {row['written_mb']:.0f} | {row['save_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
