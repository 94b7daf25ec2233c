"""Everything only a GPU can show, in one command:

    python tools/gpu_check.py [--parts tests,dpo,sft,packed,qlora,grpo,moe,deltanet,vl] [--write BENCHMARKS.md] [--append]
                              [--logs DIR] [--sft-steps 8] [--sft-rows 4] [--sft-seq 1024] [--skip-hf]
    python tools/gpu_check.py --tiny [--write FILE]   # every part on tiny shapes (on the CPU without a GPU)

Parts (each side of each comparison in its own process, so that its peak memory is its own):

1. `tests`: the CUDA tests (`tests/test_cuda.py`): bf16 autocast, per-block compile with checkpointing,
   nf4 / int8 QLoRA against peft + bitsandbytes, FlexAttention on packed rows against the padded batch,
   a one-GPU FSDP2 + nf4 run equal to the plain QLoRA run;
2. `dpo`: QLoRA DPO on a Mistral-7B shape (random weights, nf4, seq 1024, checkpointing, one pair):
   peak memory against `minitrain.plan`'s prediction (target <= 8 GB), eager and with per-block compile
   (`tools/bench.py --gpu-dpo-7b [--compile]`);
3. `sft`: LoRA SFT on a Llama-3-8B shape (random bf16 weights, r=16 on all seven linears, `--sft-rows` x
   `--sft-seq` tokens a step) through `minitrain.train.train`, one lever at a time (`SFT_VARIANTS`:
   checkpointing as the plan fits it to a 24 GB card, `checkpointing=N` between none and every block (on
   the GPU's own memory, 80 GB or more, the plan would checkpoint nothing: the `none` row again),
   checkpointing on every block, none, eager blocks), beside the HF
   stack on the same shape and batch (transformers + peft with gradient checkpointing and torch's fused
   AdamW; the same with Liger kernels when `liger-kernel` is installed, the bench extra);
4. `packed`: the same shape on rows of mixed lengths (64 .. `--sft-seq`): minitrain's padded batch,
   minitrain's packed rows (`packing=true`) through SDPA with a dense mask and through FlexAttention
   (`attention=sdpa|flex`), transformers + peft's padded batch; tokens/s counts real tokens;
5. `qlora`: the 8B shape with an nf4 base: minitrain against transformers + bitsandbytes + peft;
6. `grpo`: GRPO on a Qwen2.5-1.5B shape: the sampler's tokens/s against transformers' `generate`
   (same weights, batch, KV cache; greedy, no eos), and one GRPO step's time split into generation and
   training (policy forward, loss, backward);
7. `moe`: LoRA SFT on a Qwen3-30B-A3B shape cut to `MOE_LAYERS` layers (128 experts, top 8, random bf16
   weights, r=16 on the attention and every expert, checkpointing every block): minitrain's grouped
   experts (`torch._grouped_mm`) against transformers' `grouped_mm` experts + peft (`target_parameters`);
   MFU counts the active parameters (each token's 8 experts), the same count for both.
8. `deltanet`: the gated delta rule of one Qwen3.5 DeltaNet layer (`DELTANET`: 16 q / k heads and 32 value
   heads of 128, 4096 tokens as 4 packed sequences, bf16 inputs): forward + backward of minitrain's chunked
   torch path against flash-linear-attention's `chunk_gated_delta_rule` (the `kernels` extra, which
   `kernels=auto` uses on CUDA), their outputs' largest difference, in this process. The device machine
   reaches no network: carry the wheels (`pip download flash-linear-attention fla-core einops -d wheels`,
   then `pip install --no-index --find-links wheels flash-linear-attention` there).
9. `vl`: LoRA SFT on image rows, a Qwen2.5-VL-7B shape cut to `VL_LAYERS` language layers (its whole 32-block
   tower, random bf16 weights, one 448 x 448 image and a short answer a row, batch 4): minitrain against TRL's
   `SFTTrainer` (`tools/bench_vl.py --device cuda`, each side in its own process), images per second and the
   CUDA allocator's peak.

Tokens/s, MFU (`minitrain.plan.flops`: model FLOPs / s / the device's dense bf16 peak, the same count
for both stacks) and peak allocated memory go to a dated section between `<!-- gpu:begin -->` and
`<!-- gpu:end -->` of `--write` (BENCHMARKS.md by default; the markers are appended when absent);
`--logs DIR` keeps each part's whole output. Without CUDA it prints `skipped: ...`, writes nothing and
exits 0, unless `--tiny`: then the same code runs on tiny shapes on the CPU (no compile, no Liger), which
CI runs to keep this script working between GPU sessions (`tests/test_gpu_check.py`); its figures mean
nothing.

Time, measured on an H200 on 28 Nov (the machine's start, about 30 s, aside): `sft` 379 s (its first
child 164 s with inductor's cache cold; a later child with the same keys 76 s), `grpo` 139 s, the CUDA
tests more than 190 s (cut there), minitrain's nf4 child 47 s. Not measured yet, estimated: `dpo` about
2 minutes (the eager child 30 s on 26 Nov; the compiled one compiles), `packed` about 7 (four children;
the first compiles with a cold cache, FlexAttention compiles kernels of its own), HF's nf4 child about 3
(it saves and reloads the 8B checkpoint). Every part: about 25 minutes, more than one 15-minute lease.
Run it in calls of under 10 minutes each, the parts that have never run on a GPU first:

    python tools/gpu_check.py --parts tests,dpo --logs gpu_logs            # about 6 min
    python tools/gpu_check.py --parts packed --append --logs gpu_logs      # about 7 min
    python tools/gpu_check.py --parts qlora --append --logs gpu_logs       # about 4 min
    python tools/gpu_check.py --parts sft --append --logs gpu_logs         # 6.5 min on 28 Nov
    python tools/gpu_check.py --parts grpo --append --logs gpu_logs        # 2.5 min on 28 Nov
    python tools/gpu_check.py --parts moe --append --logs gpu_logs         # not run yet: about 3 min (estimate)
    python tools/gpu_check.py --parts deltanet --append --logs gpu_logs    # not run yet: under 1 min (estimate)
    python tools/gpu_check.py --parts vl --append --logs gpu_logs          # not run yet: about 4 min (estimate)

A lease holds the first two; the next lease goes on where it stopped. The section is written after
every part, so a call cut short keeps what finished; `--append` keeps the sections already between the
markers (the earlier calls') and adds its own below them.
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
QWEN2_1_5B = dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151645)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
MOE_LAYERS = 4  # of Qwen3-30B-A3B's 48: a few layers of the real width fit any card
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     num_hidden_layers=MOE_LAYERS, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                     bos_token_id=151643, eos_token_id=151645)
VL_LAYERS = 4  # of Qwen2.5-VL-7B's 28 language layers (the tower whole)
# one DeltaNet layer's rule: (q / k heads, value heads, head dim, tokens, packed sequences)
DELTANET = dict(heads=16, value_heads=32, dim=128, tokens=4096, sequences=4)
DELTANET_TINY = dict(heads=2, value_heads=4, dim=16, tokens=96, sequences=3)
MOE_TINY = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16)  # with TINY
# on Qwen3-MoE, LLaMA's MLP names are the experts' (as peft 0.21 maps them): attention + every expert
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PARTS = ("tests", "dpo", "sft", "packed", "qlora", "grpo", "moe", "deltanet", "vl")
GB = 1e9

# one lever at a time: TrainConfig keys over the base (bf16, per-block compile on CUDA)
SFT_VARIANTS = {
    # fitted to a 24 GB card's budget: checkpointing=N, between the two rows below (on the GPU's own 80 GB
    # or more the plan checkpoints nothing: the "none" row again)
    "plan": ("minitrain, checkpointing as the plan fits it to 24 GB", {"checkpointing": False, "auto_fit": True,
                                                                       "gpu_mem": "24GB"}),
    "ckpt": ("minitrain, checkpointing every block", {"checkpointing": True}),
    "none": ("minitrain, no checkpointing", {"checkpointing": False, "memory_check": False}),
    "eager": ("minitrain, every block checkpointed, eager (no compile)", {"checkpointing": True, "compile": False}),
}
HF_VARIANTS = {"peft": "transformers + peft", "liger": "transformers + peft + Liger kernels",
               "mixed": "transformers + peft, padded batch", "nf4": "transformers + bitsandbytes nf4 + peft"}
PACKED_VARIANTS = {"padded": ("minitrain, padded batch", {}),
                   "packed_sdpa": ("minitrain, packed rows, SDPA with a dense mask", {"packing": True, "attention": "sdpa"}),
                   "packed": ("minitrain, packed rows, FlexAttention", {"packing": True, "attention": "flex"})}


def shape(a: argparse.Namespace, hf: dict) -> dict:
    """`hf`, or its tiny version under `--tiny` (same family, a few small layers)."""
    return {**hf, **TINY, **(MOE_TINY if "num_experts" in hf else {})} if a.tiny else hf


def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rows(n: int, seq: int, vocab: int, mixed: bool = False) -> list[dict]:
    """n rows of random tokens, loss on the second half; `mixed`: lengths drawn from 64 .. seq."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = int(torch.randint(min(64, seq), seq + 1, (1,), generator=g)) if mixed else seq
        ids = torch.randint(3, vocab, (t,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (t // 2) + ids[t // 2:]})
    return out


def _random_model(hf: dict, dev, nf4: bool = False):
    """A model of `hf`'s shape with random bf16 weights drawn on `dev` one tensor at a time (nf4:
    each linear quantized as it arrives, by minitrain's loader hook)."""
    import torch

    import models
    from minitrain.adapters.quant import quantize_hook

    with torch.device("meta"):
        model = models.from_hf_config(hf)
    hook = quantize_hook("nf4", compute_dtype=torch.bfloat16) if nf4 else None
    for name, p in list(model.named_parameters()):
        w = torch.randn(p.shape, dtype=torch.bfloat16, device=dev) * (0.02 if p.dim() > 1 else 1.0)
        if p.dim() == 1:
            w = 1.0 + 0.1 * w
        if hook is None or not hook(model, name, w):
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(w, requires_grad=False))
    model.tie_weights()
    return model


def _add_lora(model) -> None:
    """LoRA r=16 on all seven linears, the rest frozen, the adapters in fp32 (minitrain.run.attach_adapters)."""
    from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters

    cfg = LoRAConfig(r=16, alpha=32, targets=TARGETS)
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()


def _peak(dev) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if dev.type == "cuda" else None


def child_mt_sft(a: argparse.Namespace) -> dict:
    """minitrain's LoRA SFT step on the 8B shape with `--variant`'s keys: tokens/s, MFU, peak memory."""
    import torch

    from minitrain.config import TrainConfig
    from minitrain.data.collate import collate_causal
    from minitrain.data.packing import collate_packed_causal
    from minitrain.objectives.sft import sft
    from minitrain.plan.fit import check
    from minitrain.train import train

    dev = device()
    hf = shape(a, QWEN3_30B_A3B if a.variant == "moe" else LLAMA3_8B)
    variants = {**SFT_VARIANTS, **PACKED_VARIANTS, "nf4": ("", {"checkpointing": True}),
                "moe": ("", {"checkpointing": True})}
    keys = dict(variants[a.variant][1])  # a copy
    out = Path(tempfile.mkdtemp(prefix="minitrain_gpu_sft_"))
    (out / "model").mkdir()
    (out / "model" / "config.json").write_text(json.dumps(hf))  # what the plan reads (auto_fit)
    total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 64 * 2**30
    base = dict(out=str(out / "run"), model=str(out / "model"), max_steps=a.sft_steps, batch_size=a.sft_rows,
                lr=1e-4, warmup=0.0, schedule="constant", precision="bf16", compile=dev.type == "cuda",
                device=dev.type, save_every=0, log_every=1, group_by_length=False, max_len=a.sft_seq,
                lora_r=16, lora_alpha=32.0, lora_targets=TARGETS, gpu_mem=f"{total}B",
                quantize="nf4" if a.variant == "nf4" else "none")
    packing = keys.pop("packing", False)
    if keys.get("attention") == "flex" and dev.type != "cuda":
        return {"error": "FlexAttention trains only on CUDA (no backward on a CPU)", "optional": True}
    tc = TrainConfig(**{**base, **keys})
    tc = check(tc, log=print)  # auto_fit picks checkpointing; the others are only checked (memory_check)
    torch.manual_seed(0)
    model = _random_model(hf, dev, nf4=a.variant == "nf4")
    _add_lora(model)
    mixed = a.variant in PACKED_VARIANTS
    rows = _rows(a.sft_rows * a.sft_steps * (3 if mixed else 1), a.sft_seq, hf["vocab_size"], mixed)
    collate = ((lambda ex: collate_packed_causal(ex, 0, a.sft_seq)) if packing else (lambda ex: collate_causal(ex, 0)))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    train(model, sft, rows, collate, tc, out_dir=out / "run", log=lambda s: None)
    lines = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    steady = [r for r in lines if r["step"] > 2] or lines  # steps 1-2: compilation
    tps = sum(r["tokens"] for r in steady) / sum(r["tokens"] / r["tokens_per_s"] for r in steady)
    mfu = sum(r.get("mfu", 0.0) for r in steady) / len(steady)
    return {"tokens_per_s": tps, "mfu": mfu, "peak_allocated_bytes": _peak(dev), "steps_timed": len(steady),
            "checkpointing": tc.checkpointing}


def child_hf_sft(a: argparse.Namespace) -> dict:
    """transformers + peft (+ Liger, + bitsandbytes nf4) on the same shape, rows and FLOPs count."""
    import peft
    import torch
    import transformers

    from minitrain.plan.flops import FlopCounter, device_peak_flops

    dev = device()
    hf = shape(a, QWEN3_30B_A3B if a.variant == "moe" else LLAMA3_8B)
    torch.manual_seed(0)
    if a.variant == "liger":
        if dev.type != "cuda":
            return {"error": "Liger kernels need CUDA (Triton)", "optional": True}
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()  # patches transformers' Llama modules before the model is built
    cfg = None if a.variant == "moe" else transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    if a.variant == "nf4":  # quantized as transformers loads a checkpoint: save random weights, load in 4 bits
        folder = Path(tempfile.mkdtemp(prefix="minitrain_gpu_hf_nf4_"))
        with torch.device(dev):
            transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).save_pretrained(folder)
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
        model = transformers.LlamaForCausalLM.from_pretrained(folder, quantization_config=q, dtype=torch.bfloat16,
                                                              device_map={"": dev.index or 0} if dev.type == "cuda"
                                                              else {"": "cpu"})
    elif a.variant == "moe":  # transformers' grouped experts (torch._grouped_mm), LoRA on them by peft's target_parameters
        with torch.device(dev):
            model = transformers.Qwen3MoeForCausalLM._from_config(
                transformers.Qwen3MoeConfig(**{k: v for k, v in hf.items() if k != "model_type"}), dtype=torch.bfloat16,
                experts_implementation="grouped_mm")
    else:
        with torch.device(dev):
            model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    experts = dict(target_modules=TARGETS[:4], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                       **(experts if a.variant == "moe" else
                                                          dict(target_modules=TARGETS))))
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4, fused=dev.type == "cuda")
    mixed = a.variant == "mixed"
    rows = _rows(a.sft_rows * a.sft_steps * (3 if mixed else 1), a.sft_seq, hf["vocab_size"], mixed)
    counter = FlopCounter.of(_counter_model(hf))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times, flops, tokens = [], 0.0, 0
    for s in range(len(rows) // a.sft_rows):
        chunk = rows[s * a.sft_rows:(s + 1) * a.sft_rows]
        T = max(len(r["input_ids"]) for r in chunk)
        ids = torch.tensor([r["input_ids"] + [0] * (T - len(r["input_ids"])) for r in chunk])
        labels = torch.tensor([r["labels"] + [-100] * (T - len(r["labels"])) for r in chunk])
        mask = (torch.arange(T)[None] < torch.tensor([len(r["input_ids"]) for r in chunk])[:, None]).long()
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), labels=labels.to(dev)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if s >= 2:
            times.append(time.perf_counter() - t0)
            tokens += int(mask.sum())
            flops += counter.batch({"input_ids": ids, "attention_mask": mask, "labels": labels})
    peak = device_peak_flops(dev)
    return {"tokens_per_s": tokens / sum(times), "mfu": flops / sum(times) / peak if peak else None,
            "peak_allocated_bytes": _peak(dev), "steps_timed": len(times)}


def child_grpo(a: argparse.Namespace) -> dict:
    """GRPO's sampler against transformers' `generate` on a Qwen2.5-1.5B shape (base weights, greedy,
    no eos), then one GRPO step's time split: sampling G completions per prompt with the adapters on,
    and the policy's forward, loss and backward on them (no checkpointing: the step's peak is mostly
    that forward's activations, 59.59 GB on 28 Nov, not its logits, which are chunked)."""
    import torch

    import models
    from minitrain.objectives.grpo import completion_logps, grpo_loss
    from minitrain.objectives.sampling import sample

    dev = device()
    hf = shape(a, QWEN2_1_5B)
    B, P, n, G = (8, 16, 12, 4) if a.tiny else (64, 128, 256, 8)
    torch.manual_seed(0)
    ours = _random_model(hf, dev).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, hf["vocab_size"], (B, P), generator=g)
    mask = torch.ones_like(ids)
    for i in range(B):  # left padding: row i has i * P // (2 * B) pads
        mask[i, : i * P // (2 * B)] = 0
    ids, mask = ids.masked_fill(mask == 0, 0).to(dev), mask.to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return out, time.perf_counter() - t0

    cache = models.family(ours).KVCache
    result: dict = {"batch": B, "prompt": P, "new_tokens": n, **_against_generate(ours, hf, ids, mask, n, cache, timed)}
    _add_lora(ours)
    prompts, pmask = ids[: B // G], mask[: B // G]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for rep in range(2):
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
            done, t_gen = timed(lambda: sample(ours, prompts, pmask, new_cache=cache, num_generations=G,
                                               max_new_tokens=n, temperature=1.0, eos_ids=[], pad_id=0))

        def step():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logps, _ = completion_logps(ours.train(), prompts.repeat_interleave(G, 0), pmask.repeat_interleave(G, 0),
                                            done.ids, done.mask, group=G)
                adv = torch.randn(logps.shape[0], device=dev)
                loss, count, _ = grpo_loss(logps, adv, done.mask)
            (loss / count).backward()
            ours.zero_grad(set_to_none=True)

        _, t_train = timed(step)
    result.update(step_generation_s=t_gen, step_training_s=t_train, completions=B // G * G,
                  step_peak_allocated_bytes=_peak(dev))
    return result


def child_deltanet(a: argparse.Namespace) -> dict:
    """Forward + backward of the gated delta rule, minitrain's torch path against fla's kernels (`DELTANET`)."""
    import torch

    from minitrain.kernels import fla_installed
    from models.qwen3_5 import chunk_gated_delta_rule

    dev = device()
    c = DELTANET_TINY if a.tiny else DELTANET
    T, H, HV, d, n = c["tokens"], c["heads"], c["value_heads"], c["dim"], c["sequences"]
    g = torch.Generator(device="cpu").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dev)  # noqa: E731
    q, k, v = make(1, T, H, d).bfloat16(), make(1, T, H, d).bfloat16(), make(1, T, HV, d).bfloat16()
    g_log = -torch.rand(1, T, HV, generator=g).to(dev) * 0.2  # log decays in (-0.2, 0]
    beta = torch.rand(1, T, HV, generator=g).to(dev).bfloat16()
    cu = torch.arange(n + 1, device=dev) * (T // n)
    cu[-1] = T
    starts = torch.zeros(1, T, dtype=torch.bool, device=dev)
    starts[0, cu[1:-1]] = True
    segments = starts.long().cumsum(1)
    grad_out = make(1, T, HV, d).bfloat16()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(f) -> tuple[float, torch.Tensor]:
        ins = [t.detach().requires_grad_(t.is_floating_point()) for t in (q, k, v, g_log, beta)]
        out = f(*ins)
        out.backward(grad_out)
        sync()
        times = []
        for _ in range(2 if a.tiny else 5):
            t0 = time.perf_counter()
            f(*ins).backward(grad_out)
            sync()
            times.append(time.perf_counter() - t0)
        return min(times), out.detach().float()

    torch_s, ref = timed(lambda *x: chunk_gated_delta_rule(*x, segments=segments)[0])
    result = {"shape": c, "torch_ms": 1e3 * torch_s, "torch_tokens_per_s": T / torch_s}
    if not fla_installed() or dev.type != "cuda":
        return {**result, "fla": "flash-linear-attention is not installed" if not fla_installed() else "needs CUDA"}
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    fla_s, out = timed(lambda *x: fla_rule(*x, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0])
    diff = float((out - ref).abs().max() / ref.abs().max())
    return {**result, "fla_ms": 1e3 * fla_s, "fla_tokens_per_s": T / fla_s, "max_rel_diff": diff}


def _against_generate(ours, hf: dict, ids, mask, n: int, cache, timed) -> dict:
    """The sampler against transformers' `generate` on the same weights (greedy, no eos), each timed
    on its second call: tokens/s of each and how many rows came out equal."""
    import torch
    import transformers

    from minitrain.objectives.sampling import sample

    theirs = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{k: v for k, v in hf.items() if k != "model_type"}))
    theirs = theirs.to(device=ids.device, dtype=torch.bfloat16).eval()
    missing = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not missing.unexpected_keys and all("rotary" in k for k in missing.missing_keys), missing
    theirs.generation_config.eos_token_id = None
    B, P = ids.shape
    with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16):
        for _ in range(2):  # the first call of each warms up
            mt, t_mt = timed(lambda: sample(ours, ids, mask, new_cache=cache, max_new_tokens=n, greedy=True,
                                            eos_ids=[], pad_id=0).ids)
            ref, t_hf = timed(lambda: theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                                      do_sample=False, pad_token_id=0)[:, P:])
    return {"sampler_tokens_per_s": B * n / t_mt, "generate_tokens_per_s": B * n / t_hf,
            "equal_rows": int((mt == ref).all(1).sum())}


def _counter_model(hf: dict):
    """`hf`'s shape on meta with the same LoRA: only its module shapes are read (minitrain.plan.flops)."""
    import torch

    import models
    from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters

    with torch.device("meta"):
        model = models.from_hf_config(hf)
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


def _child(name: str, a: argparse.Namespace, timeout: int, variant: str = "") -> dict:
    """One side of a comparison in its own process (its peak memory its own): the child's JSON line, or
    the error; under `--tiny`, in this process (nothing to measure, only the code to run)."""
    if a.tiny:
        t0 = time.perf_counter()
        try:
            return {**CHILDREN[name](argparse.Namespace(**{**vars(a), "child": name, "variant": variant})),
                    "seconds": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - reported in the section, as a child's exit would be
            return {"error": f"{type(e).__name__}: {e}"[:600], "seconds": time.perf_counter() - t0}
    args = [str(Path(__file__).resolve()), "--child", name, "--variant", variant, "--sft-steps", str(a.sft_steps),
            "--sft-rows", str(a.sft_rows), "--sft-seq", str(a.sft_seq)] + (["--tiny"] if a.tiny else [])
    rc, out, secs = _sub(args, timeout, _log(a, f"{name}-{variant}" if variant else name))
    last = [x for x in out.splitlines() if x.startswith("{")]
    if rc or not last:
        return {"error": f"exit {rc}: {out[-600:]}", "seconds": secs}
    return {**json.loads(last[-1]), "seconds": secs}


def _gb(x) -> str:
    return f"{x / GB:.2f} GB" if x else "n/a"


def _table(title: str, rows: list[tuple[str, dict]], against: dict | None) -> list[str]:
    """A markdown table of tokens/s, MFU and peak memory; the ratios against `against` (an HF run)."""
    lines = ["", f"| {title} | tokens/s | MFU | peak allocated | vs HF tokens/s | vs HF memory |", "|---|---|---|---|---|---|"]
    for label, r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {label} | {str(r.get('error', 'not run'))[:200]} | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        ok = against and "tokens_per_s" in against and r is not against
        speed = f"{r['tokens_per_s'] / against['tokens_per_s']:.2f}x" if ok else ""
        mem = (f"{r['peak_allocated_bytes'] / against['peak_allocated_bytes']:.2f}x"
               if ok and r.get("peak_allocated_bytes") and against.get("peak_allocated_bytes") else "")
        extra = f" (checkpointing={str(r['checkpointing']).lower()})" if "checkpointing" in r else ""
        lines.append(f"| {label}{extra} | {r['tokens_per_s']:.0f} | {mfu} | {_gb(r.get('peak_allocated_bytes'))} "
                     f"| {speed} | {mem} |")
    return lines


def render(results: dict, when: str, device: str) -> str:
    """The dated BENCHMARKS.md section from the results dict (pure: tested on fake results)."""
    t = results.get("tests", {})
    lines = [f"### GPU check, {when} on {device}", "",
             f"`python tools/gpu_check.py{results.get('argv', '')}` at git {results.get('git', '?')}; "
             f"torch {results.get('torch', '?')}.", "",
             f"- CUDA tests (`tests/test_cuda.py`): {t.get('summary', 'not run')}"]
    for key, how in (("dpo", "eager"), ("dpo_compile", "per-block compile")):
        d = results.get(key)
        if d is None:
            continue
        if "max_allocated_bytes" in d:
            lines.append(f"- QLoRA DPO, Mistral-7B shape, nf4, seq {d.get('seq')}, checkpointing, {how}: measured "
                         f"{d['max_allocated_bytes'] / GB:.2f} GB max allocated ({d['max_reserved_bytes'] / GB:.2f} GB "
                         f"reserved) against {d['predicted_peak_bytes'] / GB:.2f} GB planned (measured / planned "
                         f"{d['measured_over_predicted']:.3f}); target <= 8 GB: "
                         f"{'met' if d['max_reserved_bytes'] <= 8 * GB else 'NOT met'}; {d.get('seconds', 0):.0f} s "
                         f"for {d.get('steps', '?')} steps")
        elif "error" in d:
            lines.append(f"- QLoRA DPO, Mistral-7B shape, {how}: {d['error']}")
        else:
            lines.append(f"- QLoRA DPO, {d.get('shape')} shape, seq {d.get('seq')}, {how}: {d.get('steps')} steps in "
                         f"{d.get('seconds', 0):.0f} s (no CUDA memory figures)")
    sft = results.get("sft", {})
    if sft:
        rows = [(label, sft.get(k, {})) for k, (label, _) in SFT_VARIANTS.items()]
        rows += [(HF_VARIANTS[k], sft.get("hf_" + k, {})) for k in ("peft", "liger") if "hf_" + k in sft]
        lines += _table("LoRA SFT, Llama-3-8B shape, bf16, equal rows", rows, sft.get("hf_peft"))
    packed = results.get("packed", {})
    if packed:
        rows = [(label, packed.get(k, {})) for k, (label, _) in PACKED_VARIANTS.items()]
        rows.append((HF_VARIANTS["mixed"], packed.get("hf_mixed", {})))
        lines += _table("LoRA SFT, Llama-3-8B shape, rows of mixed lengths (real tokens/s)", rows, packed.get("hf_mixed"))
    qlora = results.get("qlora", {})
    if qlora:
        lines += _table("QLoRA SFT, Llama-3-8B shape, nf4 base", [("minitrain, nf4", qlora.get("nf4", {})),
                        (HF_VARIANTS["nf4"], qlora.get("hf_nf4", {}))], qlora.get("hf_nf4"))
    moe = results.get("moe", {})
    if moe:
        lines += _table(f"LoRA SFT, Qwen3-30B-A3B shape ({MOE_LAYERS} of its layers: 128 experts, top 8), bf16, "
                        f"MFU on active parameters", [("minitrain, grouped experts", moe.get("moe", {})),
                                                      ("transformers grouped_mm experts + peft", moe.get("hf_moe", {}))],
                        moe.get("hf_moe"))
    g = results.get("grpo")
    if g is not None:
        if "sampler_tokens_per_s" in g:
            lines += ["", f"- GRPO sampler, Qwen2.5-1.5B shape, batch {g['batch']}, prompts {g['prompt']} tokens "
                          f"(left-padded), {g['new_tokens']} new tokens, greedy, bf16: minitrain "
                          f"{g['sampler_tokens_per_s']:.0f} tokens/s, transformers `generate` "
                          f"{g['generate_tokens_per_s']:.0f} ({g['sampler_tokens_per_s'] / g['generate_tokens_per_s']:.2f}x); "
                          f"rows with equal tokens {g['equal_rows']}/{g['batch']}",
                      f"- GRPO step ({g['completions']} completions of {g['new_tokens']} tokens, LoRA r=16): generation "
                      f"{g['step_generation_s']:.2f} s ({g['completions'] * g['new_tokens'] / g['step_generation_s']:.0f} "
                      f"tokens/s with the adapters, sampling at temperature 1), training (forward, loss, backward) {g['step_training_s']:.2f} s "
                      f"({100 * g['step_generation_s'] / (g['step_generation_s'] + g['step_training_s']):.0f}% generating); "
                      f"peak {_gb(g.get('step_peak_allocated_bytes'))} (the policy without checkpointing)"]
        else:
            lines += ["", f"- GRPO: {g.get('error', 'not run')}"]
    vl = results.get("vl")
    if vl is not None:
        if "mt" not in vl:
            lines += ["", f"- LoRA SFT on image rows: {vl.get('error', 'not run')}"]
        else:
            mt, hf = vl["mt"], vl["hf"]
            what = "tiny shape" if vl.get("tiny") else f"Qwen2.5-VL-7B shape, {VL_LAYERS} language layers, the whole tower"
            if "images_per_s" in mt:
                lines += ["", f"- LoRA SFT on image rows ({what}, bf16, 448 px, batch 4): minitrain "
                              f"{mt['images_per_s']:.1f} images/s, TRL's SFTTrainer {hf['images_per_s']:.1f} "
                              f"({mt['images_per_s'] / hf['images_per_s']:.2f}x); peak allocated "
                              f"{mt['peak_mem_mb'] / 1024:.1f} / {hf['peak_mem_mb'] / 1024:.1f} GiB "
                              f"({mt['peak_mem_mb'] / hf['peak_mem_mb']:.2f}x)"]
            else:
                lines += ["", f"- LoRA SFT on image rows ({what}, CPU): minitrain {mt['images_per_cpu_s']:.1f} images per "
                              f"CPU-second, TRL {hf['images_per_cpu_s']:.1f}"]
    dn = results.get("deltanet")
    if dn is not None:
        if "torch_ms" not in dn:
            lines += ["", f"- Gated DeltaNet rule: {dn.get('error', 'not run')}"]
        else:
            c = dn["shape"]
            head = (f"- Gated DeltaNet rule, forward + backward ({c['tokens']} tokens as {c['sequences']} packed "
                    f"sequences, {c['heads']} q / k heads, {c['value_heads']} value heads of {c['dim']}, bf16): minitrain's "
                    f"torch path {dn['torch_ms']:.1f} ms ({dn['torch_tokens_per_s']:.0f} tokens/s)")
            if "fla_ms" in dn:
                head += (f", fla's `chunk_gated_delta_rule` {dn['fla_ms']:.1f} ms ({dn['fla_ms'] / dn['torch_ms']:.2f}x "
                         f"the time); outputs within {dn['max_rel_diff']:.1e} of the largest")
            else:
                head += f"; fla: {dn['fla']}"
            lines += ["", head]
    return "\n".join(lines) + "\n"


def between_markers(path: Path) -> str:
    """The text between the gpu markers of `path` (stripped; empty when it has none)."""
    text = path.read_text() if path.exists() else ""
    if BEGIN not in text or END not in text:
        return ""
    return text.partition(BEGIN)[2].partition(END)[0].strip()


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
    p.add_argument("--parts", type=lambda x: x.split(","), default=list(PARTS), help=",".join(PARTS) + " (default: all)")
    p.add_argument("--write", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--sft-steps", type=int, default=8)
    p.add_argument("--sft-rows", type=int, default=4)
    p.add_argument("--sft-seq", type=int, default=1024)
    p.add_argument("--skip-hf", action="store_true", help="minitrain's runs only")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, on the CPU without CUDA: checks this script")
    p.add_argument("--logs", help="a folder where each part's whole output is kept")
    p.add_argument("--append", action="store_true",
                   help="keep the sections already between the markers and add this run's below them "
                        "(the second call of a check split in two)")
    p.add_argument("--child", choices=tuple(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    bad = [x for x in a.parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {', '.join(bad)} — choose from {', '.join(PARTS)}")
    if a.tiny and not a.child:
        a.sft_seq, a.sft_steps = min(a.sft_seq, 64), min(a.sft_steps, 3)
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    import torch

    if not torch.cuda.is_available() and not a.tiny:
        print("skipped: no CUDA device here (torch.cuda.is_available() is False) — run "
              "python tools/gpu_check.py on a machine with an NVIDIA GPU; nothing was written")
        return 0
    if a.child:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(CHILDREN[a.child](a)))
        return 0
    results: dict = {"torch": torch.__version__, "argv": "".join(" " + x for x in argv)}
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    results["git"] = git.stdout.strip() or "?"
    big = 1 if a.tiny else 4  # timeouts, scaled down for the tiny shapes
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (--tiny: the figures mean nothing)"
    target = Path(a.write) if a.write and not (a.tiny and a.write == str(ROOT / "BENCHMARKS.md")) else None
    kept = between_markers(target) if target and a.append else ""

    def publish() -> str:
        """Render what has run so far and write it (after every part: a run cut short keeps what finished)."""
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        section = render(results, when, f"{where} ({platform.node()})")
        if target:
            write_section(target, f"{kept}\n\n{section}" if kept else section)
        return section

    if "tests" in a.parts and not a.tiny:
        rc, out, secs = _sub(["-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "tests/test_cuda.py"],
                             300, _log(a, "tests"))
        summary = next((x for x in reversed(out.splitlines()) if re.search(r"passed|failed|error", x)), out[-300:])
        results["tests"] = {"rc": rc, "summary": f"{summary.strip()} ({secs:.0f} s)"}
        print("tests:", results["tests"]["summary"], flush=True)
        publish()
    if "dpo" in a.parts:
        for key, extra in (("dpo", []), ("dpo_compile", ["--compile"]))[:2 if torch.cuda.is_available() else 1]:
            with tempfile.TemporaryDirectory() as tmp:
                tiny = ["--tiny", "--device", "cuda" if torch.cuda.is_available() else "cpu", "--seq", "64"] if a.tiny else []
                rc, out, secs = _sub([str(ROOT / "tools" / "bench.py"), "--gpu-dpo-7b", "--seq", "1024", "--dpo-steps", "3",
                                      "--out", f"{tmp}/dpo.json", *extra, *tiny], 60 * big, _log(a, key))
                done = Path(f"{tmp}/dpo.json")
                results[key] = (json.loads(done.read_text()) if rc == 0 and done.exists()
                                else {"error": f"exit {rc}: {out[-400:]}"})
            print(f"{key}:", json.dumps(results[key])[:400], flush=True)
        publish()
    for part, mt, hf in (("sft", list(SFT_VARIANTS), ["peft", "liger"]), ("packed", list(PACKED_VARIANTS), ["mixed"]),
                         ("qlora", ["nf4"], ["nf4"]), ("moe", ["moe"], ["moe"])):
        if part not in a.parts:
            continue
        results[part] = {}
        for v in mt:
            results[part][v] = _child("mt_sft", a, 90 * big, v)
            print(f"{part} minitrain {v}:", results[part][v], flush=True)
        for v in [] if a.skip_hf else hf:
            if v == "liger" and not _has("liger_kernel"):
                results[part]["hf_liger"] = {"error": "liger-kernel is not installed (pip install -e .[bench])",
                                             "optional": True}
                continue
            results[part]["hf_" + v] = _child("hf_sft", a, 90 * big, v)
            print(f"{part} hf {v}:", results[part]["hf_" + v], flush=True)
        publish()
    if "grpo" in a.parts:
        results["grpo"] = _child("grpo", a, 90 * big)
        print("grpo:", results["grpo"], flush=True)
    if "vl" in a.parts:
        with tempfile.TemporaryDirectory() as tmp:
            shape = (["--device", "cpu", "--layers", "1", "--dim", "64", "--vision-depth", "2", "--vision-dim", "32",
                      "--vocab", "500", "--side", "56", "--steps", "3", "--batch", "2"] if a.tiny else
                     ["--device", "cuda", "--shape", "qwen2_5_vl_7b", "--layers", str(VL_LAYERS), "--vision-depth", "32",
                      "--side", "448", "--steps", "8", "--batch", "4"])
            rc, out, secs = _sub([str(ROOT / "tools" / "bench_vl.py"), *shape, "--repeats", "1", "--cache", tmp,
                                  "--out", f"{tmp}/vl.json"], 150 * big, _log(a, "vl"))
            done = Path(f"{tmp}/vl.json")
            results["vl"] = json.loads(done.read_text()) if rc == 0 and done.exists() else {"error": f"exit {rc}: {out[-400:]}"}
        results["vl"]["tiny"] = a.tiny
        print("vl:", results["vl"], flush=True)
        publish()
    if "deltanet" in a.parts:
        results["deltanet"] = _child("deltanet", a, 30 * big)
        print("deltanet:", results["deltanet"], flush=True)
    print(publish())
    if target:
        print(f"written to {target}")
    failed = failures(results)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


CHILDREN = {"mt_sft": child_mt_sft, "hf_sft": child_hf_sft, "grpo": child_grpo, "deltanet": child_deltanet}


def failures(results: dict) -> list[str]:
    """The parts that did not run (an optional side that is not installed or needs CUDA aside)."""
    out = ["tests"] if results.get("tests", {}).get("rc") else []
    out += [k for k in ("dpo", "dpo_compile", "grpo", "deltanet", "vl") if "error" in results.get(k, {})]
    return out + [f"{part} {k}" for part in ("sft", "packed", "qlora", "moe") for k, r in results.get(part, {}).items()
                  if "error" in r and not r.get("optional")]


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    raise SystemExit(main())
