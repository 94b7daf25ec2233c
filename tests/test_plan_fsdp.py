"""The per-rank memory plan under torchrun (`minitrain.plan.sharded`, `minitrain plan --world N`).

- the arithmetic, against sums worked out by hand from the shapes of a small LLaMA (FSDP2 shards
  dim 0 of every parameter into ceil(rows / N)-row pieces: small tensors round up), for
  `parallel=fsdp` (full fine-tuning and LoRA) and `parallel=ddp` (the rank's rows, the all-reduce
  bucket);
- 2 ranks (gloo, FSDP2 applied by `minitrain.parallel.fsdp.shard`, the loop's AdamW): each rank's
  parameter shards and optimizer state equal the plan's persistent terms to the byte, and its
  whole peak (those + the peak bytes allocated during a steady-state step, measured as
  tests/test_plan.py does with `minitrain.plan.measure`) is within 20% of the plan's, LoRA and full
  fine-tuning. The per-rank RSS table at a few hundred MB is `tools/plan_ranks.py` (BENCHMARKS.md);
- `minitrain plan --world N --parallel fsdp` prints rank 0's plan; a world the batch cannot feed is one line, exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minitrain.plan.decoder import ModelShape
from minitrain.plan.predict import predict
from minitrain.plan.run_shape import RunShape

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# tiny shape for the hand sums: D=6, F=10, V=10, 2 layers, 2 heads of 3
TINY = ModelShape(vocab_size=10, hidden_size=6, intermediate_size=10, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=3)


def terms(plan, moment=None) -> dict[str, int]:
    return {t.name: t.bytes for t in (plan.persistent if moment is None else plan.moments[moment])}


def backward(plan) -> dict[str, int]:
    """The terms of the block backward moment (planned at the block where it is largest)."""
    (name,) = [m for m in plan.moments if m.endswith("backward") and m != "loss backward" and "pre-" not in m]
    return terms(plan, name)


def test_fsdp_full_finetune_shards_by_hand():
    plan = predict(TINY, RunShape(rows=4, seq=8, compute="fp32", full=True, world=4, parallel="fsdp"))
    # one block, rows ceil(d0 / 4): q, k, v, o (6 x 6) -> 2 x 6 = 12 each; gate, up (10 x 6) -> 3 x 6 = 18 each;
    # down (6 x 10) -> 2 x 10 = 20; two norms (6,) -> 2 each: 48 + 36 + 20 + 4 = 108 elements
    # root: embed, head (10 x 6) -> 3 x 6 = 18 each; final norm (6,) -> 2: 38 elements
    shard = (2 * 108 + 38) * 4
    got = terms(plan)
    assert got["trained tensors: 1/N shard"] == shard == 1016
    assert got["weights: 1/N shard (FSDP2)"] == 0
    tensors = 2 * 9 + 3  # 7 linears + 2 norms per block, embed, head, norm
    assert got["optimizer (AdamW): 1/N shard"] == 2 * shard + 4 * tensors
    gathered = backward(plan)
    # the embeddings and the head are sharded by rows outside FSDP2's root: the root is the final norm
    assert gathered["FSDP: root gathered (final norm)"] == 4 * 2 * 4  # 4 shards, padded
    assert gathered["gradients: the head's 1/N shard"] == 3 * 6 * 4  # reduce-scattered after the loss
    # the trained head is gathered whole (10 x 6, unpadded) for the loss, forward to backward
    for moment in ("end of forward (loss forward)", "loss backward"):
        assert terms(plan, moment)["head gathered whole (trained: for the loss)"] == 10 * 6 * 4
    assert gathered["FSDP: two blocks gathered"] == 2 * 4 * 108 * 4
    assert gathered["gradients: this block's, whole"] == 4 * 108 * 4  # fp32, padded as gathered
    # the optimizer step: gradient shards and foreach temporaries, 1/N each
    step = terms(plan, "optimizer step")
    assert step == {"AdamW temporaries: 1/N shard": shard, "gradients: 1/N shard": shard}


def test_fsdp_lora_shards_by_hand():
    run = RunShape(rows=5, seq=8, compute="fp32", lora_r=2, lora_targets=("q_proj", "v_proj"), world=4,
                   parallel="fsdp", device="cpu")
    plan = predict(TINY, run)
    got = terms(plan)
    assert got["weights: 1/N shard (FSDP2)"] == 1016  # every frozen tensor, as above, fp32
    # per adapted linear: A (2 x 6) -> 1 x 6 = 6, B (6 x 2) -> 2 x 2 = 4; q and v in 2 blocks
    assert got["trained tensors: 1/N shard"] == 2 * 2 * 10 * 4 == 160
    assert got["gradients: 1/N shard"] == 160
    assert got["optimizer (AdamW): 1/N shard"] == 2 * 160 + 4 * 8
    # rank 0 computes ceil(5 / 4) = 2 of the 5 rows: its activations are one device's at 2 rows
    one = predict(TINY, RunShape(rows=2, seq=8, compute="fp32", lora_r=2, lora_targets=("q_proj", "v_proj"),
                                 device="cpu"))
    fwd = terms(plan, "end of forward (loss forward)")
    assert fwd["saved activations x 2 blocks"] == terms(one, "end of forward (loss forward)")[
        "saved activations x 2 blocks"]
    # on the CPU (gloo) a block being all-gathered is there twice more: the output and gloo's own copy
    gathering = terms(plan, "last block forward (FSDP: all-gather)")
    assert gathering["FSDP: blocks while one is all-gathered"] == 3 * 4 * (108 + 2 * 10) * 4
    assert plan.peak == max(plan.persistent_bytes + plan.moment_bytes(m) for m in plan.moments)


def test_fsdp_quantized_base_by_rows_by_hand():
    run = RunShape(rows=4, seq=8, compute="fp32", quantize="int8", lora_r=2, lora_targets=("q_proj",), world=4,
                   parallel="fsdp")
    # int8 rows (out x in int8) + one fp32 scale per row, ceil(out / 4) rows a rank: q, k, v, o (6 x 6): 2 rows,
    # 2 x 6 + 2 x 4 = 20 each; gate, up (10 x 6): 3 x 6 + 3 x 4 = 30 each; down (6 x 10): 2 x 10 + 2 x 4 = 28;
    # two fp32 norms of 6: 2 x 2 x 4 = 16
    block = 4 * 20 + 2 * 30 + 28 + 16
    root = 2 * 3 * 6 * 4 + 2 * 4  # embed and head (10 x 6, fp32): 3 rows each; the final norm: 2 values
    assert terms(predict(TINY, run))["weights: 1/N shard (FSDP2)"] == 2 * block + root == 520
    # nf4 (in a multiple of 64): D=64, F=128, one layer: codes (out, in / 2) bytes + (out, in / 64) fp32 scales
    wide = ModelShape(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32)
    nf4 = predict(wide, RunShape(rows=4, seq=8, compute="fp32", quantize="nf4", lora_targets=(), world=4,
                                 parallel="fsdp"))
    # q, k, v, o: 16 rows of 32 + 1 scale: 16 x (32 + 4) = 576 each; gate, up: 32 x 36 = 1152 each;
    # down (64 x 128): 16 x (64 + 2 x 4) = 1152; norms: 2 x 16 x 4; root: 2 x 3 x 64 x 4 + 16 x 4
    assert terms(nf4)["weights: 1/N shard (FSDP2)"] == 4 * 576 + 3 * 1152 + 128 + 1536 + 64


def test_ddp_rank_share_and_bucket_by_hand():
    plan = predict(TINY, RunShape(rows=5, seq=8, compute="fp32", full=True, world=2, parallel="ddp"))
    one = predict(TINY, RunShape(rows=3, seq=8, compute="fp32", full=True))  # rank 0: ceil(5 / 2) rows
    assert plan.persistent == one.persistent  # the whole model on every rank
    # every gradient in one bucket (far below 64 MiB): 2 x (4 x 36 + 3 x 60 + 12) + 2 x 60 + 6 elements, fp32
    bucket = terms(plan, "gradient all-reduce (ddp)")["all-reduce bucket (flat copy)"]
    assert bucket == (2 * (4 * 36 + 3 * 60 + 12) + 2 * 60 + 6) * 4
    assert plan.moments["end of forward (loss forward)"] == one.moments["end of forward (loss forward)"]


def test_fsdp_world_one_copies_the_block_and_the_tool_plans_a_rank(tmp_path):
    plan = predict(TINY, RunShape(rows=4, seq=8, compute="fp32", full=True, world=1, parallel="fsdp"))
    assert terms(plan)["trained tensors: 1/N shard"] == sum(TINY.all_tensors()) * 4  # nothing to shard with
    assert backward(plan)["FSDP: one block gathered"] == (4 * 36 + 3 * 60 + 12) * 4
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4)))
    cmd = [sys.executable, "-m", "minitrain", "plan", str(ROOT / "recipes" / "sft_llama.py"),
           f"model={tmp_path}", "data=x.jsonl", "batch_size=4"]
    out = subprocess.run(cmd + ["--world", "4", "--parallel", "fsdp", "--device", "cpu"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert "per rank: rank 0 of 4 (fsdp), 1 of the 4 rows" in out.stdout
    assert "weights: 1/N shard (FSDP2)" in out.stdout
    bad = subprocess.run(cmd + ["--world", "8", "--parallel", "fsdp"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: batch_size=4: smaller than the 8 processes") and bad.stderr.count("\n") == 1


# ----------------------------------------------------------------------------- 2 ranks, measured

HF = dict(model_type="llama", vocab_size=2049, hidden_size=256, intermediate_size=705, num_hidden_layers=4,
          num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)  # odd rows: shards pad
ROWS, SEQ, R = 4, 128, 8


def measured_worker(rank: int, out: str) -> None:
    """One rank: per mode, build, shard (FSDP2), one warm-up step, then one measured step."""
    import torch

    import models
    from minitrain.parallel import distributed, fsdp
    from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
    from minitrain.objectives.sft import sft
    from minitrain.plan.measure import measure_peak_allocated
    from minitrain.train import build_optimizer

    results = {}
    for mode in ("lora", "full"):
        torch.manual_seed(0)
        model = models.from_hf_config(HF)
        if mode == "lora":
            cfg = LoRAConfig(r=R, alpha=2 * R, dropout=0.0, targets=list(ALL))
            apply_lora(model, cfg)
            freeze_for_adapters(model, cfg)
        fsdp.shard(model, torch.device("cpu"))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        opt = build_optimizer(named, 0.0, 1e-4)
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(4, HF["vocab_size"], (ROWS // 2, SEQ), generator=g)  # this rank's rows
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

        def step(model=model, opt=opt, batch=batch):
            loss, _, _ = sft(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # the optimizer state exists from here on: the steady state
        peak, _ = measure_peak_allocated(step)
        local = [p.to_local() for p in model.parameters()]
        storage = lambda ts: sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())  # noqa: E731
        state = [v.to_local() if distributed.is_sharded(v) else v for s in opt.state.values() for v in s.values()]
        results[mode] = dict(frozen=storage([t for t, p in zip(local, model.parameters()) if not p.requires_grad]),
                             trained=storage([t for t, p in zip(local, model.parameters()) if p.requires_grad]),
                             optimizer=storage(state), step_peak=peak)
        del model, opt
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def launch_two(tmp_path: Path, fn: str, *args, module: str = "test_plan_fsdp") -> None:
    code = (f"import sys, torch, torch.distributed as dist\n"
            f"sys.path[:0] = [{str(HERE)!r}, {str(ROOT)!r}]\n"
            f"torch.set_num_threads(1)\n"
            f"rank = int(sys.argv[1])\n"
            f"dist.init_process_group('gloo', init_method={'file://' + str(tmp_path / 'rdv')!r}, rank=rank, "
            f"world_size=2)\n"
            f"import {module}\n"
            f"{module}.{fn}(rank, *{args!r})\n"
            f"dist.destroy_process_group()\n"
            f"sys.stdout.flush(); sys.stderr.flush()\n"
            f"import os; os._exit(0)\n")  # (gloo's threads at finalisation: see tests/test_distributed.py)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stderr=subprocess.PIPE, text=True, env=env)
             for r in (0, 1)]
    errs = [p.communicate()[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for e in errs)


def test_two_ranks_measured_against_the_plan(tmp_path):
    launch_two(tmp_path, "measured_worker", str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    ms = ModelShape.from_hf(HF)
    for mode in ("lora", "full"):
        run = RunShape(rows=ROWS, seq=SEQ, compute="fp32", device="cpu", mask=False, lora_r=R, lora_targets=ALL,
                       full=mode == "full", world=2, parallel="fsdp")
        plan = predict(ms, run)
        got = terms(plan)
        for r, m in enumerate(r[mode] for r in ranks):
            # rank 0's shards to the byte (FSDP2 pads the last rank's; the embeddings' and the head's rows,
            # minitrain's, are not padded: rank 1 holds one row fewer of each)
            for key, plan_key in (("frozen", "weights: 1/N shard (FSDP2)"), ("trained", "trained tensors: 1/N shard")):
                assert (m[key] == got[plan_key]) if r == 0 else (m[key] <= got[plan_key]), (mode, r, key)
            # AdamW's state follows each rank's own (unpadded) chunk: rank 0 holds ceil(rows / 2), the plan's
            assert (m["optimizer"] == got["optimizer (AdamW): 1/N shard"]) if r == 0 else (
                m["optimizer"] <= got["optimizer (AdamW): 1/N shard"]), (mode, r)
            # gradients are made and freed within the step (set_to_none): the measured step holds them
            persistent = m["frozen"] + m["trained"] + m["optimizer"]
            measured = persistent + m["step_peak"]
            print(f"{mode} rank {r}: measured {measured / 2**20:.2f} MiB, planned {plan.peak / 2**20:.2f} MiB "
                  f"({plan.peak / measured:.3f}, {plan.peak_moment})")
            assert measured == pytest.approx(plan.peak, rel=0.2), (mode, r, measured, plan.peak, plan.peak_moment)


def test_fit_check_plans_one_rank_under_fsdp(monkeypatch):
    """The check before loading (`minitrain.plan.fit`) now checks fsdp runs, against one rank's plan:
    full fine-tuning of Mistral-7B's config.json (fp32 master weights and AdamW: ~110 GB whole)."""
    from minitrain.parallel import distributed
    from minitrain.cli import load_recipe, resolve_config
    from minitrain.errors import UserError
    from minitrain.plan import fit

    mistral = ROOT / "tests" / "fixtures" / "configs" / "Mistral-7B-Instruct-v0.2"
    cfg = resolve_config(load_recipe(str(ROOT / "recipes" / "sft_llama.py")),
                         [f"model={mistral}", "data=x.jsonl", "finetune=full", "parallel=fsdp", "batch_size=8",
                          "max_len=512", "checkpointing=true", "gpu_mem=80GiB"])[0]
    monkeypatch.setattr(distributed, "world_size", lambda: 8)
    lines: list[str] = []
    assert fit.check(cfg, log=lines.append) is cfg
    assert lines and lines[0].startswith("memory: planned peak ") and "fits: gpu_mem=80GiB" in lines[0]
    monkeypatch.setattr(distributed, "world_size", lambda: 1)  # one rank holds all of it
    with pytest.raises(UserError, match=r"^memory: the plan needs "):
        fit.check(cfg, log=lines.append)
