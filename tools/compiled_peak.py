"""Peak memory of a compiled, checkpointed LoRA SFT run, measured on the CPU: a stand-in for the
GPU's peak when no GPU is at hand.

    python tools/compiled_peak.py [--code DIR ...] [--eager] [--nf4]

A 4-layer LLaMA (hidden 512, intermediate 1536, 8 heads / 2 kv, vocab 1024) with random bf16
weights, LoRA r=16 on all seven linears (fp32 adapters), bf16 autocast, non-reentrant
checkpointing and per-block `torch.compile` (inductor; `--eager` leaves it out), 3 optimizer
steps of 4 x 512 tokens through `minitrain.train.train`, as `tools/gpu_check.py` runs its SFT part
on CUDA; `--nf4` quantizes the base linears to nf4 as they are drawn (bitsandbytes, as the QLoRA
part does). The peak is `minitrain.plan.measure.measure_peak_allocated`'s over the whole run (the CPU
allocations torch.profiler records: the same to the byte from run to run). Each `--code DIR` (repeatable, e.g. a
tree of an older commit made with `git archive`) runs in its own process with that tree first on
`sys.path`. With torch 2.11 it showed the cost of an autograd Function inside a compiled block
(BENCHMARKS.md, GPU notes of the H100 lease), which the same run on CUDA had shown as +1.30 GB;
with torch 2.11 and `--nf4`, the base products saved by a compiled checkpoint (GPU notes of 28 Nov).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(model_type="llama", vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=1024)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def child(compile_blocks: bool, nf4: bool = False) -> float:
    """The run in this process; its peak of recorded CPU allocations in MiB."""
    import torch

    import models
    from minitrain import train as T
    from minitrain.adapters.quant import quantize_hook
    from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
    from minitrain.config import TrainConfig
    from minitrain.data.collate import collate_causal
    from minitrain.objectives.sft import sft
    from minitrain.plan.measure import measure_peak_allocated

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = models.from_hf_config(SHAPE)
    hook = quantize_hook("nf4", compute_dtype=torch.bfloat16) if nf4 else None
    for name, p in list(model.named_parameters()):
        w = torch.randn(p.shape, dtype=torch.bfloat16)
        w = w * 0.02 if p.dim() > 1 else 1.0 + 0.1 * w  # norms' weights near 1
        if hook is not None and hook(model, name, w):
            continue
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(w, requires_grad=False))
    cfg = LoRAConfig(r=16, alpha=32, targets=TARGETS)
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(12):
        ids = torch.randint(3, SHAPE["vocab_size"], (512,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 256 + ids[256:]})
    T.enable_checkpointing(model)
    if compile_blocks:
        T.compile_blocks(model)
    out = Path(tempfile.mkdtemp(prefix="minitrain_compiled_peak_"))
    tc = TrainConfig(out=str(out), max_steps=3, batch_size=4, lr=1e-4, warmup=0.0, schedule="constant",
                     precision="bf16", checkpointing=True, compile=False, device="cpu", save_every=0,
                     log_every=1, group_by_length=False)
    peak, _ = measure_peak_allocated(lambda: T.train(model, sft, rows, lambda ex: collate_causal(ex, 0), tc,
                                                     out_dir=out, log=lambda s: None))
    return peak / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--code", action="append", default=[], help="a source tree to measure (repeatable)")
    ap.add_argument("--eager", action="store_true", help="leave the per-block compile out")
    ap.add_argument("--nf4", action="store_true", help="an nf4 base (bitsandbytes), as QLoRA")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(f"{child(not a.eager, a.nf4):.2f}")
        return 0
    import torch

    print(f"torch {torch.__version__}; {'eager' if a.eager else 'compiled'} blocks{', nf4 base' if a.nf4 else ''}")
    for code in a.code or [str(ROOT)]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (code, os.environ.get("PYTHONPATH")) if x))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child"] + (["--eager"] if a.eager else []) + (["--nf4"] if a.nf4 else [])
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"{code}: the run failed:\n{p.stderr[-3000:]}")
        print(f"{code}: peak {p.stdout.split()[-1]} MiB of CPU allocations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
