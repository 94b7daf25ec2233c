"""Peak memory of loading a checkpoint: minitrain's `load_pretrained` against transformers.

    python tools/measure_load_rss.py [--dtype float32|bfloat16] [--nf4] [--keep DIR]

Saves a ~300M-parameter LLaMA-shaped checkpoint with transformers (hidden 1024, 18 layers,
intermediate 2816, vocab 32000: 297M parameters) in `--dtype` (default float32) into a temporary
folder, then loads it in a fresh interpreter per loader, in the same dtype, and reports

    peak RSS during the load - RSS just before it (after imports), as a ratio to the bytes on disk.

Peak RSS is the kernel's high-water mark of resident pages (VmHWM, reset after the imports),
file-backed (mmapped) pages included: a loader that maps the file and then copies out of it pays
for both. The target for minitrain is <= 1.3x (the model itself is 1.0x). With `--nf4` the
minitrain load is repeated with `quantize_hook("nf4")`, whose ratio should sit far below 1.0x.
Needs the bench/test extra (transformers, psutil). Not a test: it takes a minute and ~3 GB.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--nf4", action="store_true", help="also measure minitrain with quantize_hook('nf4')")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="fewer for a quick try")
    ap.add_argument("--keep", type=Path, help="save the checkpoint here (reused if present) instead of a temp dir")
    ap.add_argument("--child", nargs=3, metavar=("LOADER", "FOLDER", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), args.child[2])
        return

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp) / "ckpt"
        if not (folder / "config.json").exists():
            # in a child too, so the saving process's memory is gone before any measurement
            code = f"import sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); import measure_load_rss as m; print(m.save_checkpoint(__import__('pathlib').Path({str(folder)!r}), {args.dtype!r}, {args.layers}))"
            n = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()[-1])
            print(f"saved {n / 1e6:.0f}M parameters ({args.dtype}) with transformers to {folder}")
        disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
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
