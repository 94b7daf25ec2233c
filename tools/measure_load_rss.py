"""Peak memory of loading a checkpoint: minitrain's `load_pretrained` against transformers.

    python tools/measure_load_rss.py [--dtype float32|bfloat16] [--nf4] [--keep DIR]
    python tools/measure_load_rss.py --world 1,2,4 [--keep DIR]     # parallel=fsdp's sharded load, per rank

Saves a ~300M-parameter LLaMA-shaped checkpoint with transformers (hidden 1024, 18 layers,
intermediate 2816, vocab 32000: 297M parameters) in `--dtype` (default float32) into a temporary
folder, then loads it in a fresh interpreter per loader, in the same dtype, and reports

    peak RSS during the load - RSS just before it (after imports), as a ratio to the bytes on disk.

Peak RSS is the kernel's high-water mark of resident pages (VmHWM, reset after the imports),
file-backed (mmapped) pages included: a loader that maps the file and then copies out of it pays
for both. The target for minitrain is <= 1.3x (the model itself is 1.0x). With `--nf4` the
minitrain load is repeated with `quantize_hook("nf4")`, whose ratio should sit far below 1.0x.
Needs the bench/test extra (transformers, psutil). Not a test: it takes a minute and ~3 GB.

`--world`: the sharded load of `parallel=fsdp` (`minitrain.parallel.fsdp`: built on meta, `fully_shard`, each
rank reads its rows) in N processes started by torchrun (gloo, CPU), against the one-process load:
each rank's peak RSS of the load minus its RSS before it (after joining the process group and the
FSDP imports), as a ratio to the one-process figure. The goal: <= 0.6x at 2 ranks, <= 0.35x at 4.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=18,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark (Linux >= 4.0), so the import phase does not count."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM (reset by reset_peak); where /proc is not there, getrusage's lifetime maximum."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def save_checkpoint(folder: Path, dtype: str, layers: int) -> int:
    """Write the checkpoint with transformers; returns the parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": layers})
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True)
    return n


def child(loader: str, folder: Path, dtype: str) -> None:
    """Runs in a fresh interpreter: import, take the baseline, load, report one JSON line."""
    import psutil
    import torch

    torch_dtype = getattr(torch, dtype)
    if loader == "transformers":
        import transformers

        def load():
            return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch_dtype)

    else:
        sys.path.insert(0, str(ROOT))
        from minitrain.weights import load_pretrained
        from models import from_hf_config

        hook = None
        if loader == "minitrain+nf4":
            from minitrain.adapters.quant import quantize_hook

            hook = quantize_hook("nf4", compute_dtype=torch_dtype)

        def load():
            return load_pretrained(folder, from_hf_config, dtype=torch_dtype, tensor_hook=hook)

    proc = psutil.Process()
    if not reset_peak():
        print("warning: could not reset the RSS high-water mark; the import phase may count", file=sys.stderr)
    baseline = proc.memory_info().rss
    model = load()
    peak = peak_rss_bytes()
    after = proc.memory_info().rss
    tensors = list(model.state_dict().values())
    held = sum(t.numel() * t.element_size() for t in tensors)
    for t in tensors:  # read every weight once, as a first forward pass would (pages in lazy mmaps)
        t.view(-1)[:: max(1, 4096 // t.element_size())].sum()
    out = dict(peak_delta=peak - baseline, after_delta=after - baseline, touched_delta=proc.memory_info().rss - baseline)
    print(json.dumps({**out, "model_bytes": held}))


def child_fsdp(folder: Path, dtype: str, out: Path) -> None:
    """One rank of the sharded load (under torchrun): join gloo, take the baseline, load, report."""
    import psutil
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    import torch.distributed.fsdp  # noqa: F401  (imported before the baseline: not the load's memory)
    import torch.distributed.tensor  # noqa: F401

    from minitrain.parallel import fsdp
    from minitrain.weights import open_pretrained
    from models import from_hf_config

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    proc = psutil.Process()
    dist.barrier()
    reset_peak()
    baseline = proc.memory_info().rss
    model, headers = open_pretrained(folder, from_hf_config)
    fsdp.defer_weights(model, folder, headers, getattr(torch, dtype), torch.device("cpu"))
    fsdp.prepare(model, torch.device("cpu"), log=lambda _: None)
    peak = peak_rss_bytes()
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(dict(peak_delta=peak - baseline, held=held)))
    dist.barrier()
    dist.destroy_process_group()


def measure_world(folder: Path, dtype: str, worlds: list[int]) -> None:
    """The per-rank table of `--world` (see the module docstring)."""
    one = subprocess.run([sys.executable, __file__, "--child", "minitrain", str(folder), dtype],
                         check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    one = json.loads(one)["peak_delta"]
    print(f"one process (load_pretrained, the whole model): peak - baseline {one / 2**20:.0f} MiB")
    print(f"{'ranks':>5} {'rank':>4} {'peak-baseline':>13} {'shards held':>11} {'vs one':>6}")
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                            __file__, "--fsdp-child", str(folder), dtype, tmp], check=True, capture_output=True,
                           text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
            for r in range(world):
                got = json.loads((Path(tmp) / f"rank{r}.json").read_text())
                print(f"{world:>5} {r:>4} {got['peak_delta'] / 2**20:>9.0f} MiB {got['held'] / 2**20:>7.0f} MiB "
                      f"{got['peak_delta'] / one:>5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--nf4", action="store_true", help="also measure minitrain with quantize_hook('nf4')")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="fewer for a quick try")
    ap.add_argument("--keep", type=Path, help="save the checkpoint here (reused if present) instead of a temp dir")
    ap.add_argument("--world", type=lambda s: [int(x) for x in s.split(",")],
                    help="the sharded load of parallel=fsdp at these numbers of ranks, e.g. 1,2,4")
    ap.add_argument("--child", nargs=3, metavar=("LOADER", "FOLDER", "DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--fsdp-child", nargs=3, metavar=("FOLDER", "DTYPE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), args.child[2])
        return
    if args.fsdp_child:
        child_fsdp(Path(args.fsdp_child[0]), args.fsdp_child[1], Path(args.fsdp_child[2]))
        return

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp) / "ckpt"
        if not (folder / "config.json").exists():
            # in a child too, so the saving process's memory is gone before any measurement
            code = f"import sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); import measure_load_rss as m; print(m.save_checkpoint(__import__('pathlib').Path({str(folder)!r}), {args.dtype!r}, {args.layers}))"
            n = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()[-1])
            print(f"saved {n / 1e6:.0f}M parameters ({args.dtype}) with transformers to {folder}")
        disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        if args.world:
            print(f"checkpoint on disk: {disk / 2**20:.0f} MiB ({args.dtype})")
            measure_world(folder, args.dtype, args.world)
            return
        print(f"checkpoint on disk: {disk / 2**20:.0f} MiB; loading in {args.dtype}")
        print(f"{'loader':<14} {'peak-baseline':>13} {'ratio':>6} {'after load':>10} {'after touch':>11} {'model':>9}")
        loaders = ["minitrain", "transformers"] + (["minitrain+nf4"] if args.nf4 else [])
        for loader in loaders:
            out = subprocess.run(
                [sys.executable, __file__, "--child", loader, str(folder), args.dtype],
                check=True, capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1]
            r = {k: v / 2**20 for k, v in json.loads(out).items()}
            print(
                f"{loader:<14} {r['peak_delta']:>9.0f} MiB {r['peak_delta'] * 2**20 / disk:>5.2f}x "
                f"{r['after_delta']:>6.0f} MiB {r['touched_delta']:>7.0f} MiB {r['model_bytes']:>5.0f} MiB"
            )
        print("ratio = peak RSS during the load (minus the RSS before it) / checkpoint bytes on disk; "
              "'after touch' = RSS once every weight page was read (lazy mmaps count only then)")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from minitrain.cli import main_quietly

    sys.exit(main_quietly(main))
