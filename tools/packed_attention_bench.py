"""Packed rows on a GPU: SDPA with a dense mask against FlexAttention (`attention=sdpa|flex`), in one command:

    python tools/packed_attention_bench.py [--layers 4] [--rows 4] [--seq 4096] [--steps 5]

A LLaMA shape (Llama-3-8B's width and heads, `--layers` blocks, random bf16 weights, LoRA r=16 on
q/k/v/o) runs LoRA SFT forward + backward on packed rows (`collate_packed_causal`: sequences of
seq/16 .. seq/2 tokens in `--rows` rows of up to `--seq`), blocks compiled and checkpointed, bf16
autocast, as `train` runs them. For each attention, on the same weights and batches: milliseconds per
step after two warm-up steps (compilation), the peak memory, and the first batch's loss; the two
losses must agree (to bf16 rounding). Prints one JSON line. Without CUDA: prints `skipped: ...`
and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
             num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192)


def batches(n: int, rows: int, seq: int, vocab: int) -> list[dict]:
    import torch

    from minitrain.data.packing import collate_packed_causal

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        examples, room = [], rows * seq
        while True:
            k = int(torch.randint(seq // 16, seq // 2 + 1, (1,), generator=g))
            if k > room:
                break
            ids = torch.randint(3, vocab, (k,), generator=g).tolist()
            examples.append({"input_ids": ids, "labels": [-100] * (k // 4) + ids[k // 4:]})
            room -= k
        out.append(collate_packed_causal(examples, pad_id=0, max_len=seq))
    return out


def run(a: argparse.Namespace) -> dict:
    import torch

    import models
    from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
    from minitrain.objectives.sft import sft
    from minitrain.train import compile_blocks, enable_checkpointing

    device = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(device):
        model = models.from_hf_config({**SHAPE, "num_hidden_layers": a.layers}).to(torch.bfloat16)
    cfg = LoRAConfig(r=16, alpha=32, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    enable_checkpointing(model)
    compile_blocks(model)
    data = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()}
            for b in batches(a.steps + 2, a.rows, a.seq, SHAPE["vocab_size"])]
    result = {"shape": f"{a.layers} LLaMA-3-8B blocks, {a.rows} x {a.seq} packed",
              "tokens_per_step": sum(int(b["attention_mask"].sum()) for b in data) / len(data),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for kind in ("sdpa", "flex"):
        model.packed_attention = kind
        torch.cuda.reset_peak_memory_stats()
        times, first = [], None
        for i, batch in enumerate(data):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, n, _ = sft(model, batch)
            (loss / n).backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t)
            first = float(loss / n) if first is None else first
        result[kind] = {"ms_per_step": 1000 * sum(times) / len(times), "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
                        "first_loss": first}
    result["flex_speedup"] = result["sdpa"]["ms_per_step"] / result["flex"]["ms_per_step"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device here — FlexAttention trains on CUDA only; nothing was measured")
        return 0
    sys.path.insert(0, str(ROOT))
    print(json.dumps(run(a)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
