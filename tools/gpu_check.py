"""Everything only a GPU can show, in one command (2.5 minutes on one H200, 26 Nov 2026):

    python tools/gpu_check.py [--write BENCHMARKS.md] [--sft-steps 8] [--sft-rows 4] [--sft-seq 1024] [--skip-hf]
                              [--logs DIR]

1. the CUDA tests (`tests/test_cuda.py`): bf16 autocast close to fp32, per-block `torch.compile`
   with non-reentrant checkpointing giving eager's gradients, nf4 / int8 QLoRA equal to peft +
   bitsandbytes on CUDA, packed rows through compiled FlexAttention equal to the padded batch
   (loss and gradients; the speed comparison is `tools/packed_attention_bench.py`);
2. QLoRA DPO on a Mistral-7B shape (random weights, nf4, seq 1024, checkpointing, one pair):
   `torch.cuda.max_memory_allocated` against `minitrain.plan`'s prediction (target <= 8 GB),
   through `tools/bench.py --gpu-dpo-7b`;
3. LoRA SFT on a Llama-3-8B shape (random bf16 weights, LoRA r=16 on all seven linears,
   checkpointing and per-block compile, `--sft-rows` x `--sft-seq` tokens a step) through
   `minitrain.train.train`: tokens/s, MFU (`minitrain.plan.flops`: model FLOPs / s / the device's dense
   bf16 peak) and peak memory; beside it, in the same run, the HF stack on the same shape and
   batch (transformers `LlamaForCausalLM` + peft, gradient checkpointing, torch's fused AdamW),
   with the same FLOPs count for its MFU.

Each part runs in its own process (peak memory is its own). The results go to a dated section
between `<!-- gpu:begin -->` and `<!-- gpu:end -->` of `--write` (BENCHMARKS.md by default; the
markers are appended when absent); `--logs DIR` keeps each part's whole output there (tests.log,
dpo.log, mt_sft.log, hf_sft.log). Without CUDA it prints `skipped: ...`, writes nothing and exits
0 (tested in CI: `tests/test_gpu_check.py`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- gpu:begin -->", "<!-- gpu:end -->"
LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                 rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=128000, eos_token_id=128001)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GB = 1e9


def _rows(n: int, seq: int, vocab: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (seq,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (seq // 2) + ids[seq // 2:]})
    return out


def _random_bf16_llama(device):
    """The Llama-3-8B shape with random bf16 weights drawn on the GPU one tensor at a time."""
    import torch

    import models

    with torch.device("meta"):
        model = models.from_hf_config(LLAMA3_8B)
    for name, p in list(model.named_parameters()):
        w = torch.randn(p.shape, dtype=torch.bfloat16, device=device) * (0.02 if p.dim() > 1 else 1.0)
        if p.dim() == 1:
            w = 1.0 + 0.1 * w
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(w, requires_grad=False))
    return model


def child_mt_sft(a: argparse.Namespace) -> dict:
    import torch

    from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
    from minitrain.config import TrainConfig
    from minitrain.data.collate import collate_causal
    from minitrain.objectives.sft import sft
    from minitrain.train import train

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = _random_bf16_llama(device)
    cfg = LoRAConfig(r=16, alpha=32, targets=TARGETS)
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 adapters (minitrain.run.attach_adapters)
    rows = _rows(a.sft_rows * a.sft_steps, a.sft_seq, LLAMA3_8B["vocab_size"])
    out = Path(tempfile.mkdtemp(prefix="minitrain_gpu_sft_"))
    tc = TrainConfig(out=str(out), max_steps=a.sft_steps, batch_size=a.sft_rows, lr=1e-4, warmup=0.0,
                     schedule="constant", precision="bf16", checkpointing=True, compile=True, device="cuda",
                     save_every=0, log_every=1, group_by_length=False)
    torch.cuda.reset_peak_memory_stats()
    train(model, sft, rows, lambda ex: collate_causal(ex, 0), tc, out_dir=out, log=lambda s: None)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    steady = [r for r in lines if r["step"] > 2]  # steps 1-2: compilation
    tps = sum(r["tokens"] for r in steady) / sum(r["tokens"] / r["tokens_per_s"] for r in steady)
    mfu = sum(r.get("mfu", 0.0) for r in steady) / len(steady)
    return {"tokens_per_s": tps, "mfu": mfu, "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "steps_timed": len(steady)}


def child_hf_sft(a: argparse.Namespace) -> dict:
    import peft
    import torch
    import transformers

    from minitrain.plan.flops import FlopCounter, device_peak_flops

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k != "model_type"})
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    rows = _rows(a.sft_rows * a.sft_steps, a.sft_seq, LLAMA3_8B["vocab_size"])
    counter = FlopCounter.of(_counter_model())
    torch.cuda.reset_peak_memory_stats()
    times, flops, tokens = [], 0.0, 0
    for s in range(a.sft_steps):
        chunk = rows[s * a.sft_rows:(s + 1) * a.sft_rows]
        ids = torch.tensor([r["input_ids"] for r in chunk], device="cuda")
        labels = torch.tensor([r["labels"] for r in chunk], device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if s >= 2:
            times.append(time.perf_counter() - t0)
            tokens += ids.numel()
            flops += counter.batch({"input_ids": ids.cpu(), "labels": labels.cpu()})
    peak = device_peak_flops("cuda")
    return {"tokens_per_s": tokens / sum(times), "mfu": flops / sum(times) / peak if peak else None,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "steps_timed": len(times)}


def _counter_model():
    """The 8B shape on meta with the same LoRA: only its module shapes are read (minitrain.plan.flops)."""
    import torch

    import models
    from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters

    with torch.device("meta"):
        model = models.from_hf_config(LLAMA3_8B)
        cfg = LoRAConfig(r=16, alpha=32, targets=TARGETS)
        apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    return model


def _sub(args: list[str], timeout: int, log: Path | None = None) -> tuple[int, str, float]:
    """Run `python args` from the repository: (exit code, output, seconds); the output also to `log`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {timeout}s\n{(e.stdout or '')[-2000:]}"
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(out)
    return rc, out, time.perf_counter() - t0


def _log(a: argparse.Namespace, name: str) -> Path | None:
    """Where `--logs` keeps part `name`'s output (None without `--logs`)."""
    return Path(a.logs) / f"{name}.log" if a.logs else None


def _child(name: str, a: argparse.Namespace, timeout: int) -> dict:
    rc, out, secs = _sub([str(Path(__file__).resolve()), "--child", name, "--sft-steps", str(a.sft_steps),
                          "--sft-rows", str(a.sft_rows), "--sft-seq", str(a.sft_seq)], timeout, _log(a, name))
    last = [x for x in out.splitlines() if x.startswith("{")]
    if rc or not last:
        return {"error": f"exit {rc}: {out[-600:]}", "seconds": secs}
    return {**json.loads(last[-1]), "seconds": secs}


def render(results: dict, when: str, device: str) -> str:
    """The dated BENCHMARKS.md section from the results dict (pure: tested on fake results)."""
    t = results.get("tests", {})
    d = results.get("dpo", {})
    lines = [f"### GPU check, {when} on {device}", "",
             f"`python tools/gpu_check.py` at git {results.get('git', '?')}; torch {results.get('torch', '?')}.", "",
             f"- CUDA tests (`tests/test_cuda.py`): {t.get('summary', 'not run')}"]
    if "max_allocated_bytes" in d:
        lines.append(f"- QLoRA DPO, Mistral-7B shape, nf4, seq {d.get('seq')}, checkpointing: measured "
                     f"{d['max_allocated_bytes'] / GB:.2f} GB max allocated ({d['max_reserved_bytes'] / GB:.2f} GB "
                     f"reserved) against {d['predicted_peak_bytes'] / GB:.2f} GB planned (measured / planned "
                     f"{d['measured_over_predicted']:.3f}); target <= 8 GB: "
                     f"{'met' if d['max_reserved_bytes'] <= 8 * GB else 'NOT met'}")
    else:
        lines.append(f"- QLoRA DPO, Mistral-7B shape: {d.get('error', 'not run')}")
    lines += ["", "| LoRA SFT, Llama-3-8B shape, bf16, checkpointing | tokens/s | MFU | peak allocated |",
              "|---|---|---|---|"]
    for side, label in (("mt", "minitrain (per-block compile)"), ("hf", "transformers + peft")):
        r = results.get(side, {})
        if "tokens_per_s" in r:
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
            lines.append(f"| {label} | {r['tokens_per_s']:.0f} | {mfu} | {r['peak_allocated_bytes'] / GB:.2f} GB |")
        else:
            lines.append(f"| {label} | {r.get('error', 'not run')[:200]} | | |")
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace the text between the gpu markers (appended with them when absent)."""
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        text = f"{head}{BEGIN}\n\n{section}\n{END}{tail}"
    else:
        text = f"{text.rstrip()}\n\n## GPU check\n\n{BEGIN}\n\n{section}\n{END}\n"
    path.write_text(text)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--sft-steps", type=int, default=8)
    p.add_argument("--sft-rows", type=int, default=4)
    p.add_argument("--sft-seq", type=int, default=1024)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--logs", help="a folder where each part's whole output is kept")
    p.add_argument("--child", choices=("mt_sft", "hf_sft"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device here (torch.cuda.is_available() is False) — run "
              "python tools/gpu_check.py on a machine with an NVIDIA GPU; nothing was written")
        return 0
    if a.child:
        sys.path.insert(0, str(ROOT))
        print(json.dumps({"mt_sft": child_mt_sft, "hf_sft": child_hf_sft}[a.child](a)))
        return 0
    results: dict = {"torch": torch.__version__}
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    results["git"] = git.stdout.strip() or "?"
    rc, out, secs = _sub(["-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "tests/test_cuda.py"], 240,
                         _log(a, "tests"))
    summary = next((x for x in reversed(out.splitlines()) if re.search(r"passed|failed|error", x)), out[-300:])
    results["tests"] = {"rc": rc, "summary": f"{summary.strip()} ({secs:.0f} s)"}
    print("tests:", results["tests"]["summary"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rc, out, secs = _sub([str(ROOT / "tools" / "bench.py"), "--gpu-dpo-7b", "--seq", "1024", "--dpo-steps", "3",
                              "--out", f"{tmp}/dpo.json"], 240, _log(a, "dpo"))
        results["dpo"] = (json.loads(Path(f"{tmp}/dpo.json").read_text()) if rc == 0 and Path(f"{tmp}/dpo.json").exists()
                          else {"error": f"exit {rc}: {out[-400:]}"})
    print("dpo:", json.dumps(results["dpo"])[:400], flush=True)
    results["mt"] = _child("mt_sft", a, 300)
    print("minitrain sft:", results["mt"], flush=True)
    if not a.skip_hf:
        results["hf"] = _child("hf_sft", a, 240)
        print("hf sft:", results["hf"], flush=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = render(results, when, f"{torch.cuda.get_device_name()} ({platform.node()})")
    print(section)
    if a.write:
        write_section(Path(a.write), section)
        print(f"written to {a.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
