"""minitrain's own training steps against the machine: CPU time per step, FLOP/s against a one-thread
GEMM peak, a torch.profiler op table, and A/B comparisons of code versions or options.

    python tools/step_bench.py gemm                                  # one-thread fp32 GEMM peak (GFLOP/s)
    python tools/step_bench.py sft [--vocab 32000] [--code DIR ...] [--variants eager,compiled] [--profile]
    python tools/step_bench.py dpo [--prompt 400] [--answer 80] [--variants two,shared] [--repeats 3]

Every measured run is its own `python` process (so peak RSS is the run's), one thread
(`OMP_NUM_THREADS=1`), runs interleaved across variants (A B B A A B ...), medians reported. The
model is the bench's shape (`tools/bench.py`: LLaMA, 4 layers, hidden 256, intermediate 688, 4
heads, vocab 32000 unless `--vocab`) with random weights built in place (no checkpoint), LoRA r=16
on all seven linears, fp32, minitrain's AdamW; steps 2..N are timed in CPU-seconds of the process
(`time.process_time`), which the load of a shared machine disturbs far less than wall time.

- `sft`: 4 rows a step, prompt and answer lengths drawn like the bench's data (8-190 words each,
  cut to 384 tokens). Reports tokens per CPU-second and model FLOP/s (`minitrain.plan.flops`, the same
  count for every variant) as a share of the GEMM peak measured in the same run. `--code DIR`
  (repeatable) runs the same steps with `PYTHONPATH=DIR`, e.g. a worktree of an older commit: the
  A/B of a code change. `--variants eager,compiled` runs each code version both ways: `compiled` is
  `compile=true` (`minitrain.train.compile_blocks`, its graphs built on two untimed steps first), the
  same batches timed. `--profile` prints the torch.profiler table of one step (self CPU time by op).
- `dpo`: 2 pairs a step, prompts of `--prompt` tokens (+-25%), answers of `--answer` (+-25%);
  variants `two` (`[chosen; rejected]`, two rows per pair) and `shared` (`collate_shared_prompt`,
  one row per pair). Reports pairs per CPU-second and peak RSS.
- `packing --objective sft|dpo|seq2seq`: sample packing against padded batches on data with a wide
  length spread. Every variant trains on the same `--steps` micro-batches' worth of examples (one
  epoch of the Batcher over them, after one untimed warm-up step): `ungrouped` (seeded order,
  padded), `grouped` (`group_by_length`, the default; padded), `packed` (ungrouped batches,
  `minitrain.data.packing`) and `packed-grouped` (what `packing=true` does with the default grouping).
  sft: 8 rows a step, prompt and answer 8-190 tokens each (the bench's spread), max_len 384;
  dpo: 4 pairs a step (sigmoid, reference = adapters off), prompts 16-300 tokens, each answer
  8-150, max_len 512; seq2seq: a T5 v1.1 of the bench's width (d_model 256, 4 + 4 layers, vocab
  32128), 8 examples a step, inputs 16-400 tokens, targets 4-120, max_len 512 / 128. Reports real
  tokens (pairs for dpo) per CPU-second and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def gemm_peak(n: int = 1024, reps: int = 5) -> float:
    """Best-of-`reps` fp32 `n x n x n` matmul rate on this thread, GFLOP/s."""
    import torch

    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    torch.mm(a, b, out=c)
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        for _ in range(4):
            torch.mm(a, b, out=c)
        best = min(best, (time.process_time() - t) / 4)
    return 2 * n**3 / best / 1e9


# ----------------------------------------------------------------------------- the child process


def _model(vocab: int):
    import torch

    from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
    from models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **SHAPE))
    cfg = LoRAConfig(r=16, alpha=32, targets=ALL)
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    return model.train()


def sft_rows(n: int, vocab: int, seed: int = 0, max_len: int = 384) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(8, 190), rng.randint(8, 190)
        ids = [1] + [rng.randrange(4, vocab) for _ in range(p + c)] + [2]
        ids = ids[:max_len]
        out.append({"input_ids": ids, "labels": [-100] * (p + 1) + ids[p + 1:]})
    return out


def dpo_rows(n: int, vocab: int, prompt: int, answer: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [1] + [rng.randrange(4, vocab) for _ in range(rng.randint(int(prompt * 0.75), int(prompt * 1.25)))]
        ex = {}
        for name in ("chosen", "rejected"):
            a = [rng.randrange(4, vocab) for _ in range(rng.randint(int(answer * 0.75), int(answer * 1.25)))] + [2]
            ex[f"{name}_ids"], ex[f"{name}_labels"] = p + a, [-100] * len(p) + a
        out.append(ex)
    return out


PACKING = {"sft": dict(batch=8, max_len=384), "dpo": dict(batch=4, max_len=512),
           "seq2seq": dict(batch=8, max_len=(512, 128))}


def packing_setup(objective: str, vocab: int, n: int, seed: int = 0):
    """(model, objective fn, examples, lengths, padded collate, packed collate, units of a batch)."""
    import functools

    from minitrain.data import packing
    from minitrain.data.collate import collate_causal, collate_seq2seq

    rng = random.Random(seed)
    spec = PACKING[objective]
    if objective == "sft":
        from minitrain.objectives.sft import sft

        rows = sft_rows(n, vocab, seed, spec["max_len"])
        return (_model(vocab), sft, rows, [len(r["input_ids"]) for r in rows], functools.partial(collate_causal, pad_id=0),
                functools.partial(packing.collate_packed_causal, pad_id=0, max_len=spec["max_len"]),
                lambda b: int(b["attention_mask"].sum()))
    if objective == "dpo":
        from minitrain.objectives.dpo import collate_with_reference, make_dpo_objective
        from minitrain.objectives.reference import BaseReference

        rows = []
        for _ in range(n):
            p = [1] + [rng.randrange(4, vocab) for _ in range(rng.randint(16, 300))]
            ex = {}
            for name in ("chosen", "rejected"):
                a = [rng.randrange(4, vocab) for _ in range(rng.randint(8, 150))] + [2]
                ex[f"{name}_ids"], ex[f"{name}_labels"] = p + a, [-100] * len(p) + a
            rows.append(ex)
        return (_model(vocab), make_dpo_objective(0.1, "sigmoid", 0.0, 0.0, BaseReference()), rows,
                [max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows],
                functools.partial(collate_with_reference, pad_id=0),
                functools.partial(collate_with_reference, pad_id=0, pack_len=spec["max_len"]),
                lambda b: int(b["num_pairs"]))
    import torch

    from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
    from minitrain.objectives.sft import seq2seq
    from models.t5 import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=32128, d_model=256, d_kv=64, d_ff=688, num_layers=4,
                                                num_heads=4, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                                                tie_word_embeddings=False))
    cfg = LoRAConfig(r=16, alpha=32, targets=["q", "k", "v", "o", "wi_0", "wi_1", "wo"])
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    rows = [{"input_ids": [rng.randrange(4, 32000) for _ in range(rng.randint(16, 400))] + [1],
             "labels": [rng.randrange(4, 32000) for _ in range(rng.randint(4, 120))] + [1]} for _ in range(n)]
    S, T = spec["max_len"]
    return (model.train(), seq2seq, rows, [len(r["input_ids"]) for r in rows],
            functools.partial(collate_seq2seq, pad_id=0),
            functools.partial(packing.collate_packed_seq2seq, pad_id=0, max_len=S, max_target_len=T),
            lambda b: int(b["attention_mask"].sum() + b["decoder_attention_mask"].sum()))


def packing_child(args: argparse.Namespace) -> None:
    """One variant of `packing`: the same examples for every variant, laid out as it says."""
    import resource

    import torch

    from minitrain.data.batcher import Batcher
    from minitrain.optim import AdamW

    torch.set_num_threads(1)
    bs = PACKING[args.objective]["batch"]
    model, objective, rows, lengths, padded, packed, units = packing_setup(args.objective, args.vocab,
                                                                           bs * (args.steps + 1))
    warm, rows, lengths = rows[:bs], rows[bs:], lengths[bs:]
    grouped = args.variant in ("grouped", "packed-grouped")
    order = Batcher(lengths, bs, seed=0, group_by_length=grouped).epoch_batches(0)
    collate = packed if args.variant.startswith("packed") else padded
    opt = AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    done, cpu, positions = 0, 0.0, 0
    for i, b in enumerate([warm] + [[rows[k] for k in idx] for idx in order]):
        t0 = time.process_time()
        batch = collate(b)
        loss, _, _ = objective(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step is warm-up
            cpu += time.process_time() - t0
            done += units(batch)
            positions += batch["input_ids"].numel() + (batch["labels"].numel() if args.objective == "seq2seq" else 0)
    print(json.dumps({"cpu_s": cpu, "units": done, "positions": positions, "steps": len(order),
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def child(args: argparse.Namespace) -> None:
    import resource

    import torch

    from minitrain.data.collate import collate_causal
    from minitrain.objectives.sft import sft
    from minitrain.optim import AdamW

    torch.set_num_threads(1)
    model = _model(args.vocab)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = AdamW(params, lr=1e-4)
    steps = args.steps
    if args.mode == "sft":
        rows = sft_rows(4 * steps, args.vocab)
        batches = [collate_causal(rows[i : i + 4], 0) for i in range(0, len(rows), 4)]
        objective = sft
    else:
        from minitrain.data.collate import collate_preference
        from minitrain.objectives.dpo import make_dpo_objective
        from minitrain.objectives.reference import BaseReference

        rows = dpo_rows(2 * steps, args.vocab, args.prompt, args.answer)
        if args.variant == "shared":
            from minitrain.objectives.dpo import collate_shared_prompt as collate
        else:
            collate = collate_preference
        batches = [collate(rows[i : i + 2], 0) for i in range(0, len(rows), 2)]
        objective = make_dpo_objective(0.1, "sigmoid", 0.0, 0.0, BaseReference())
    if args.variant == "compiled":  # compile=true: per-block torch.compile, its graphs built before timing
        from minitrain.train import compile_blocks

        compile_blocks(model)
        for batch in batches[:2]:  # the first shape's graphs, then the dynamic ones
            objective(model, batch)[0].backward()
        opt.zero_grad(set_to_none=True)
    tokens, cpu, timed = 0, 0.0, 0
    for i, batch in enumerate(batches):
        t0 = time.process_time()
        if args.profile and i == 2:  # profiled, not timed
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                loss, _, _ = objective(model, batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)
            continue
        loss, _, _ = objective(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 1:  # step 1 is warm-up
            cpu += time.process_time() - t0
            timed += 1
            tokens += int(batch["attention_mask"].sum())
    units = timed * (4 if args.mode == "sft" else 2)
    print(json.dumps({"cpu_s": cpu, "tokens": tokens, "units": units,
                      "steps": timed, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


# ----------------------------------------------------------------------------- the parent


def run_child(args: argparse.Namespace, variant: str, code: str | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(x for x in (code or str(ROOT), os.environ.get("PYTHONPATH", "")) if x))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", args.mode, "--variant", variant,
           "--vocab", str(args.vocab), "--steps", str(args.steps), "--prompt", str(args.prompt),
           "--answer", str(args.answer), "--objective", args.objective] + (["--profile"] if args.profile else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"child failed ({variant}, {code}):\n{p.stderr[-3000:]}")
    if args.profile:
        print(f"--- profile: {variant} {code or ''}\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def flops_per_unit(args: argparse.Namespace) -> float:
    """Model FLOPs per SFT step of the first timed batches, averaged (the same for every code version)."""
    sys.path.insert(0, str(ROOT))
    from minitrain.data.collate import collate_causal
    from minitrain.plan.flops import FlopCounter

    counter = FlopCounter.of(_model(args.vocab))
    rows = sft_rows(4 * args.steps, args.vocab)
    batches = [collate_causal(rows[i : i + 4], 0) for i in range(4, len(rows), 4)]
    return sum(counter.batch(b) for k, b in enumerate(batches) if not (args.profile and k == 1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["gemm", "sft", "dpo", "packing"])
    ap.add_argument("--objective", choices=sorted(PACKING), default="sft")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="")
    ap.add_argument("--variants", default=None)
    ap.add_argument("--code", action="append", default=[])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=400)
    ap.add_argument("--answer", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    if args.child:
        return packing_child(args) if args.mode == "packing" else child(args)
    if args.mode == "packing" and args.variants is None:
        args.variants = "ungrouped,grouped,packed,packed-grouped"
    if args.mode == "dpo" and args.variants is None:
        args.variants = "two,shared"
    if args.mode == "gemm":
        import torch

        torch.set_num_threads(1)
        print(f"one-thread fp32 GEMM peak (1024^3, best of 5): {gemm_peak():.1f} GFLOP/s")
        return
    if args.mode == "sft":
        modes = (args.variants or "eager").split(",")
        variants = [(m, c) for c in (args.code or [str(ROOT)]) for m in modes]
    else:
        variants = [(v, None) for v in args.variants.split(",")]
    results: dict[tuple, list[dict]] = {v: [] for v in variants}
    order = []
    for r in range(args.repeats):
        order += variants if r % 2 == 0 else variants[::-1]
    for v in order:
        results[v].append(run_child(args, v[0], v[1]))
    import torch

    torch.set_num_threads(1)
    peak = gemm_peak()
    load = os.getloadavg()
    print(f"shared machine: load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; OMP_NUM_THREADS=1; "
          f"medians of {args.repeats} interleaved runs; one-thread GEMM peak {peak:.1f} GFLOP/s")
    flops = flops_per_unit(args) if args.mode == "sft" else None
    for v, rs in results.items():
        cpu = statistics.median(r["cpu_s"] for r in rs)
        rss = statistics.median(r["peak_rss_mib"] for r in rs)
        name = (v[1] + ("" if v[0] == "eager" else f" [{v[0]}]")) if args.mode == "sft" else v[0]
        if args.mode == "sft":
            tok = statistics.median(r["tokens"] / r["cpu_s"] for r in rs)
            gf = flops / cpu / 1e9
            print(f"{name}: {tok:.0f} tokens per CPU-s, {gf:.1f} GFLOP/s model FLOPs = {100 * gf / peak:.0f}% of "
                  f"the GEMM peak, {cpu / rs[0]['steps']:.3f} CPU-s/step, peak RSS {rss:.0f} MiB "
                  f"(runs: {' '.join(str(round(r['tokens'] / r['cpu_s'])) for r in rs)} tokens per CPU-s)")
        elif args.mode == "packing":
            unit = "pairs" if args.objective == "dpo" else "tokens"
            rate = statistics.median(r["units"] / r["cpu_s"] for r in rs)
            digits = 3 if unit == "pairs" else 0
            runs = " ".join(f"{r['units'] / r['cpu_s']:.{digits}f}" for r in rs)
            print(f"{args.objective} {name}: {rate:.{digits}f} {unit} per CPU-s, {rs[0]['positions']} token positions "
                  f"for {rs[0]['steps']} steps, peak RSS {rss:.0f} MiB (runs: {runs})")
        else:
            pps = statistics.median(r["units"] / r["cpu_s"] for r in rs)
            print(f"{name}: {pps:.2f} pairs per CPU-s, peak RSS {rss:.0f} MiB "
                  f"(runs: {' '.join(str(round(r['units'] / r['cpu_s'], 2)) for r in rs)})")


if __name__ == "__main__":
    main()
