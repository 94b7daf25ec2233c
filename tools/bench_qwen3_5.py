"""Qwen3.5's forward + backward against transformers' torch path (CPU, one thread): CPU-seconds and peak memory.

    nice python tools/bench_qwen3_5.py [--mode lora|full] [--tokens 2048] [--repeats 3] [--steps 2] [--cache DIR]

The checkpoint: a small Qwen3.5 shape (`SHAPE`: 4 layers, three Gated DeltaNet and one gated attention
layer, hidden 512, vocab 32000) with random weights, saved once by transformers (fp32 safetensors). Each
measured run is a fresh `python` process with OMP_NUM_THREADS=1 that loads it (ours: `load_pretrained`;
HF: `AutoModelForCausalLM.from_pretrained`, its torch path: no `fla` / `causal-conv1d` installed); `--mode
lora` (the default) puts LoRA r=16 on every linear of the blocks (`TARGETS`; HF: peft), `full` makes every
parameter trainable; then it runs one row of `--tokens` random ids: a cross-entropy loss on every
next token (ours: `chunked_cross_entropy_sum` over the head; HF: `labels=`, its loss), backward. One
untimed warm-up step, then `--steps` timed ones; runs interleaved mt, hf, hf, mt, ... (`--repeats` each),
medians reported. Measured in the child: CPU-seconds per step (`time.process_time`), and the step's
memory: the peak RSS (`ru_maxrss`) over the RSS just before the first step (the activations, gradients
and temporaries; the weights and libraries are below it); by the parent: the child's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(model_type="qwen3_5_text", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
             linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=4096)


def make_checkpoint(folder: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**SHAPE)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv", "in_proj_z",
           "out_proj")


def child(side: str, folder: str, tokens: int, steps: int, mode: str) -> None:
    import torch

    torch.manual_seed(0)
    ids = torch.randint(3, SHAPE["vocab_size"], (1, tokens))
    if side == "mt":
        sys.path.insert(0, str(ROOT))
        import models
        from minitrain.objectives.losses import chunked_cross_entropy_sum, shift_labels
        from minitrain.weights import load_pretrained

        model = load_pretrained(folder, models.from_hf_config).train()
        if mode == "lora":
            from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters

            apply_lora(model, LoRAConfig(r=16, alpha=32, targets=TARGETS))
            freeze_for_adapters(model)

        def step():
            loss_sum, count = chunked_cross_entropy_sum(model(ids), model.output_projection, shift_labels(ids))
            (loss_sum / count).backward()
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
        if mode == "lora":
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                               target_modules=list(TARGETS)))

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
    if mode == "full":
        for p in model.parameters():
            p.requires_grad_(True)
    rss_before = _rss_mib()
    step()  # warm-up
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
        model.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"cpu_s": statistics.median(times), "step_mib": peak - rss_before}))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(side: str, folder: Path, tokens: int, steps: int, mode: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, __file__, "--child", side, "--folder", str(folder), "--tokens", str(tokens),
                             "--steps", str(steps), "--mode", mode], stdout=subprocess.PIPE, env=env, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"{side} run failed (status {status})")
    return {**json.loads(out.strip().splitlines()[-1]), "peak_mib": usage.ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "minitrain-bench" / "qwen3_5"))
    ap.add_argument("--mode", choices=("lora", "full"), default="lora")
    ap.add_argument("--child")
    ap.add_argument("--folder")
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.folder, a.tokens, a.steps, a.mode)
    folder = make_checkpoint(Path(a.cache))
    runs = {"mt": [], "hf": []}
    order = ["mt", "hf", "hf", "mt"] * a.repeats
    for side in order[: 2 * a.repeats]:
        runs[side].append(run(side, folder, a.tokens, a.steps, a.mode))
        print(side, runs[side][-1], flush=True)
    med = {s: {k: statistics.median(r[k] for r in runs[s]) for k in runs[s][0]} for s in runs}
    rows = [("CPU-seconds per forward + backward", "cpu_s"), ("tokens per CPU-second", None),
            ("step memory (peak RSS over the RSS before it, MiB)", "step_mib"), ("peak RSS (MiB)", "peak_mib")]
    print(f"| {a.mode}, {a.tokens} tokens, 1 thread | minitrain | HF | minitrain / HF |\n|---|---|---|---|")
    for label, key in rows:
        mt, hf = ((a.tokens / med[s]["cpu_s"]) if key is None else med[s][key] for s in ("mt", "hf"))
        print(f"| {label} | {mt:.4g} | {hf:.4g} | **{mt / hf:.2f}x** |")


if __name__ == "__main__":
    main()
