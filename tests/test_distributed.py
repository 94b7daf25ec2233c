"""Data parallel training on CPU with gloo, 2 processes: the same result as one process.

- `train()` in 2 ranks with batch_size=4 (2 examples per rank) equals 1 process with the whole
  batch (trained tensors within 1e-5, metrics alike), with a short last batch that leaves rank 1
  nothing: LoRA with parallel=ddp, LoRA with parallel=fsdp (FSDP2 `fully_shard` on CPU / gloo,
  activation checkpointing on), and full fine-tuning with parallel=fsdp.
- A 2-rank run stopped by SIGTERM on ONE rank stops both after the same step; resumed at 2
  ranks it equals the uninterrupted 2-rank run bitwise (per-rank dropout RNG restored); resuming
  at another world size works and says that dropout masks differ (tests/test_checkpoint_sharded.py
  checks such resumes against uninterrupted runs).
- `torchrun --nproc_per_node 2 -m minitrain recipes/sft_llama.py ...` equals the 1-process CLI
  run, and rank 0 alone wrote the out folder.

Ranks are separate processes (`python -c`, a file rendezvous), each running a function of this
module; the 1-process references run in the test process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_train import TinyLM, cfg_for, collate, freeze_embeddings, make_examples, quiet, rows, trainable_state

from minitrain.parallel import checkpoint_shards as shards
from minitrain.parallel import distributed, fsdp
from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.config import TrainConfig
from minitrain.errors import UserError
from minitrain.objectives.sft import sft
from minitrain.train import Interrupted, train

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TRAIN = make_examples(21, seed=3)  # batch 4: 6 micro-batches per epoch, the last holds 1 example
EVAL = make_examples(5, seed=4)
STRIP = ("tokens_per_s", "flops_per_s", "mfu", "peak_mem_mb")  # wall-clock and process figures


def lora_model(dropout: float = 0.0) -> torch.nn.Module:
    model = freeze_embeddings(TinyLM())
    torch.manual_seed(1)
    cfg = LoRAConfig(r=4, alpha=8.0, dropout=dropout, targets=["q_proj", "v_proj", "up_proj", "down_proj"])
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    return model


def config(out: Path, **kw) -> TrainConfig:
    return cfg_for(out, batch_size=4, grad_accum=2, lr=1e-2, max_grad_norm=0.2, **{"out": str(out), **kw})


def launch(tmp_path: Path, fn: str, *args, module: str = "test_distributed") -> list[str]:
    """Run `fn(rank, *args)` of `module` (a test module, default this one) in 2 processes joined by gloo;
    their stderr."""
    code = (f"import sys, torch, torch.distributed as dist\n"
            f"sys.path[:0] = [{str(HERE)!r}, {str(REPO)!r}]\n"
            f"torch.set_num_threads(1)\n"
            f"rank = int(sys.argv[1])\n"
            f"dist.init_process_group('gloo', init_method={'file://' + str(tmp_path / ('rdv-' + fn))!r}, "
            f"rank=rank, world_size=2)\n"
            f"import {module}\n"
            f"{module}.{fn}(rank, *{args!r})\n"
            f"dist.destroy_process_group()\n"
            # skip interpreter finalisation: gloo's worker threads may still hold tensors then, and
            # freeing them without an interpreter aborts now and then (pytorch/pytorch#179291)
            f"sys.stdout.flush(); sys.stderr.flush()\n"
            f"import os; os._exit(0)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    errs = [p.communicate(timeout=None)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for e in errs)
    return errs


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in b)


# ----------------------------------------------------------------------------- 2 ranks x 2 == 1 x 4


def model_for(case: str) -> torch.nn.Module:
    return TinyLM() if case == "fsdp-full" else lora_model()  # full fine-tuning: every tensor trains


def equal_batches_worker(rank: int, out: str, case: str) -> None:
    model = model_for(case)
    parallel = case.split("-")[0]
    cfg = config(Path(out) / "run", parallel=parallel, checkpointing=case == "fsdp-lora")  # with recompute
    summary = train(model, sft, TRAIN, collate, cfg, eval_examples=EVAL, log=quiet)
    save_file(fsdp.gather_whole(trainable_state(model)), f"{out}/rank{rank}.safetensors")  # (fsdp: gathered)
    Path(f"{out}/summary{rank}.json").write_text(json.dumps(summary))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ddp-lora", "fsdp-lora", "fsdp-full"])
def test_two_ranks_equal_one_process_with_the_whole_batch(tmp_path, case):
    one = model_for(case)
    ref_cfg = config(tmp_path / "one")
    ref_summary = train(one, sft, TRAIN, collate, ref_cfg, eval_examples=EVAL, log=quiet)
    want = trainable_state(one)

    out = tmp_path / "two"
    out.mkdir()
    launch(tmp_path, "equal_batches_worker", str(out), case)
    r0, r1 = load_file(out / "rank0.safetensors"), load_file(out / "rank1.safetensors")
    assert all(torch.equal(r0[k], r1[k]) for k in r0)  # the ranks agree
    start = trainable_state(model_for(case))
    assert max_abs_diff(want, start) > 1e-3  # training moved the adapter: the comparison means something
    assert max_abs_diff(r0, want) <= 1e-5

    got, ref = rows(out / "run"), rows(Path(ref_cfg.out))
    assert [r["step"] for r in got] == [1, 2, 3]  # rank 0 alone wrote the log
    for g, w in zip(got, ref):
        exact = ("tokens", "target_tokens", "epoch")
        assert {k: g[k] for k in exact} == {k: w[k] for k in exact}
        for k in ("loss", "grad_norm"):
            assert g[k] == pytest.approx(w[k], rel=1e-5), k
    assert got[-1]["eval/loss"] == pytest.approx(ref[-1]["eval/loss"], rel=1e-5)
    for r in (0, 1):
        summary = json.loads((out / f"summary{r}.json").read_text())
        assert summary["eval/loss"] == pytest.approx(ref_summary["eval/loss"], rel=1e-5)
    ck = out / "run" / "checkpoint"
    files = (["optimizer.safetensors", "weights.safetensors"] if case.startswith("ddp")  # fsdp: each rank its part
             else [f"{s}.rank{r}.safetensors" for s in ("optimizer", "weights") for r in (0, 1)])
    assert sorted(p.name for p in ck.iterdir()) == sorted([*files, "rng.rank1.safetensors", "rng.safetensors",
                                                           "state.json"])
    saved = shards.Tensors(ck, "weights", None if case.startswith("ddp") else 2)
    assert max_abs_diff({n: saved.whole(n) for n in saved.shapes}, want) <= 1e-5


def placeholder_worker(rank: int, out: str) -> None:
    seen = []

    def objective(model, batch):  # sft, noting whether the loop marked the batch as a placeholder
        seen.append(bool(batch.get("placeholder", False)))
        return sft(model, batch)

    train(lora_model(), objective, TRAIN, collate, config(Path(out) / "run", max_steps=3), log=quiet)
    Path(f"{out}/seen{rank}.json").write_text(json.dumps(seen))


def test_a_rank_left_without_examples_gets_a_batch_marked_placeholder(tmp_path):
    """The last micro-batch of TRAIN holds 1 example: rank 1 runs one at weight 0, marked `placeholder`
    (for objectives that gather across ranks: GRPO's batch std), and no other batch is."""
    launch(tmp_path, "placeholder_worker", str(tmp_path))
    seen = [json.loads((tmp_path / f"seen{r}.json").read_text()) for r in (0, 1)]
    assert len(seen[0]) == len(seen[1]) >= 6  # 3 steps x grad_accum 2, and the audit's before step 1
    assert not any(seen[0]) and sum(seen[1]) == 1 and seen[1][-1]  # the 6th micro-batch, the last run


def with_example_metric(model, batch):
    """sft, with a metric that is a mean over the micro-batch's examples: each example's first token id."""
    loss, count, metrics = sft(model, batch)
    return loss, count, {**metrics, "first_id": float(batch["input_ids"][:, 0].float().mean())}


def metrics_worker(rank: int, out: str) -> None:
    train(lora_model(), with_example_metric, TRAIN[:16], collate, config(Path(out) / "run"), log=quiet)


def test_logged_metrics_are_every_ranks_not_rank_0s_share(tmp_path):
    """An objective's metrics under 2 ranks are the mean over both ranks' micro-batches: with even splits
    they equal one process's on the whole batch (before: rank 0's half alone)."""
    ref_cfg = config(tmp_path / "one")
    train(lora_model(), with_example_metric, TRAIN[:16], collate, ref_cfg, log=quiet)
    launch(tmp_path, "metrics_worker", str(tmp_path / "two"))
    got, want = rows(tmp_path / "two" / "run"), rows(Path(ref_cfg.out))
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g["first_id"] == pytest.approx(w["first_id"], rel=1e-6)
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)


# ----------------------------------------------------------------------------- stop on one rank, resume at 2


def stop_resume_worker(rank: int, root: str, parallel: str) -> None:
    cfg = config(Path(root) / "straight", epochs=2.0, parallel=parallel)  # 6 steps
    straight = lora_model(dropout=0.2)  # dropout: each rank's RNG must resume exactly
    train(straight, sft, TRAIN, collate, cfg, log=quiet)
    save_file(fsdp.gather_whole(trainable_state(straight)), f"{root}/straight{rank}.safetensors")

    calls = [0]

    def sigterm_on_rank1(model, batch):  # rank 1 alone gets SIGTERM in step 2's first micro-batch
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return sft(model, batch)

    cut = dataclasses.replace(cfg, out=str(Path(root) / "cut"), skip_audit=True)  # (the audit calls the objective)
    try:
        train(lora_model(dropout=0.2), sigterm_on_rank1, TRAIN, collate, cut, log=quiet)
        raise AssertionError("not interrupted")
    except Interrupted as e:
        Path(f"{root}/stopped{rank}.json").write_text(json.dumps([e.step, e.exit_code]))
    resumed = lora_model(dropout=0.2)
    train(resumed, sft, TRAIN, collate, dataclasses.replace(cut, resume=True), log=quiet)
    save_file(fsdp.gather_whole(trainable_state(resumed)), f"{root}/resumed{rank}.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_sigterm_on_one_rank_stops_both_and_resume_equals_the_uninterrupted_two_rank_run(tmp_path, parallel):
    launch(tmp_path, "stop_resume_worker", str(tmp_path), parallel)
    for r in (0, 1):  # both ranks stopped after step 2, though only rank 1 got the signal
        assert json.loads((tmp_path / f"stopped{r}.json").read_text()) == [2, 143]
    straight, resumed = load_file(tmp_path / "straight0.safetensors"), load_file(tmp_path / "resumed0.safetensors")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)  # bitwise
    assert all(torch.equal(load_file(tmp_path / "resumed1.safetensors")[k], straight[k]) for k in straight)
    got, want = rows(tmp_path / "cut"), rows(tmp_path / "straight")
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [{k: v for k, v in r.items() if k not in STRIP} for r in got] == \
           [{k: v for k, v in r.items() if k not in STRIP} for r in want]
    # the ranks drew different dropout masks, and each one's generator is saved
    ck = tmp_path / "straight" / "checkpoint"
    rng0, rng1 = load_file(ck / "rng.safetensors"), load_file(ck / "rng.rank1.safetensors")
    assert not torch.equal(rng0["torch_cpu"], rng1["torch_cpu"])

    # the 2-rank checkpoint resumes in one process (ddp), saying that dropout masks now differ
    lines: list[str] = []
    train(lora_model(dropout=0.2), sft, TRAIN, collate, config(tmp_path / "straight", epochs=2.0, resume=True),
          log=lines.append)
    assert sum("saved by 2 processes, this run has 1" in ln and "dropout masks" in ln for ln in lines) == 1


# ----------------------------------------------------------------------------- DPO held-out metrics


def demo_dpo_job():
    """The demo DPO job (tiny Mistral, held-out pairs) in fp32, so batch shapes do not move the figures."""
    from minitrain.cli import load_recipe, resolve_config

    recipe = load_recipe(str(REPO / "recipes" / "dpo_mistral.py"))
    return recipe.module.setup(resolve_config(recipe, ["precision=fp32"])[0])


def dpo_eval_worker(rank: int, out: str, parallel: str) -> None:
    from minitrain.objectives.dpo import evaluate_dpo

    job = demo_dpo_job()
    if parallel == "fsdp":
        fsdp.shard(job.model, torch.device("cpu"))
    m = evaluate_dpo(job.model, job.objective, job.eval_examples[:5], job.collate, batch_size=4)
    Path(f"{out}/eval{rank}.json").write_text(json.dumps(m))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_dpo_held_out_metrics_are_split_across_ranks_and_equal_one_process(tmp_path, parallel):
    from minitrain.objectives.dpo import evaluate_dpo

    job = demo_dpo_job()
    want = evaluate_dpo(job.model, job.objective, job.eval_examples[:5], job.collate, batch_size=4)
    launch(tmp_path, "dpo_eval_worker", str(tmp_path), parallel)
    got = [json.loads((tmp_path / f"eval{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1]  # every rank returns the same figures
    assert set(got[0]) == set(want) and "eval/loss" in want
    # 5 pairs in batches of 4: the ranks score 2 + 2, then 1 + none (rank 1 runs one pair at weight 0)
    for k in want:
        assert got[0][k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k


# ----------------------------------------------------------------------------- settings refused


def test_batch_smaller_than_the_world_and_fsdp_without_torchrun_are_refused():
    with pytest.raises(UserError, match=r"^batch_size=1: smaller than the 2 processes — "):
        distributed.check(TrainConfig(batch_size=1), world=2, under_torchrun=True)
    with pytest.raises(UserError, match=r"^parallel=fsdp: needs processes started by torchrun — "):
        distributed.check(TrainConfig(parallel="fsdp"), world=1, under_torchrun=False)
    with pytest.raises(UserError, match=r"^parallel=fsdp with precision=fp16: "):
        distributed.check(TrainConfig(parallel="fsdp", precision="fp16"), world=2, under_torchrun=True)
    distributed.check(TrainConfig(batch_size=2), world=2, under_torchrun=True)  # no error


def test_cli_refuses_fsdp_without_torchrun_before_writing(tmp_path, capsys, monkeypatch):
    from minitrain.cli import run_cli

    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "out"
    assert run_cli([str(REPO / "recipes" / "sft_llama.py"), f"out={out}", "parallel=fsdp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: parallel=fsdp: needs processes started by torchrun — ")
    assert not out.exists()


def test_more_processes_than_gpus_is_refused_on_every_rank_before_joining(tmp_path, capsys, monkeypatch):
    # torchrun --nproc_per_node 4 on a 2-GPU machine: had ranks 2 and 3 refused alone, ranks 0 and 1
    # would wait to join and nobody would print why; every rank refuses, rank 0 says it once
    from minitrain.cli import run_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    joined = []
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *a, **k: joined.append(a))
    out = tmp_path / "out"
    printed = []
    for rank in (3, 0):
        for k, v in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", 4), ("LOCAL_WORLD_SIZE", 4)):
            monkeypatch.setenv(k, str(v))
        assert run_cli([str(REPO / "recipes" / "sft_llama.py"), f"out={out}"]) == 2
        printed.append(capsys.readouterr().err.strip().splitlines())
    assert printed[0] == []  # rank 3: the same refusal, not printed again
    assert printed[1] == ["error: torchrun: 4 processes on this machine, 2 GPUs — use --nproc_per_node 2 or fewer "
                          "(or device=cpu)"]
    assert joined == [] and not out.exists()


# ----------------------------------------------------------------------------- torchrun + the CLI


def cli_args(model: Path, out: Path, *extra: str) -> list[str]:
    data = REPO / "tests" / "bad_inputs" / "data" / "good.jsonl"
    return [str(REPO / "recipes" / "sft_llama.py"), f"model={model}", f"data={data}", f"out={out}", "max_steps=3",
            "batch_size=4", "grad_accum=1", "lora_r=4", "device=cpu", "precision=fp32", "chat_format=mistral",
            "warmup=0", "save_every=2", *extra]


@pytest.mark.slow
def test_torchrun_cli_equals_one_process_and_rank0_alone_writes(tiny_model, tmp_path, capsys):
    from minitrain.cli import run_cli

    one = tmp_path / "one"
    assert run_cli(cli_args(tiny_model, one)) == 0, capsys.readouterr().err
    capsys.readouterr()

    two = tmp_path / "two"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "minitrain", *cli_args(tiny_model, two)],
                       cwd=REPO, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "Traceback" not in p.stderr
    assert p.stdout.count("done: step 3/3") == 1  # rank 0 alone prints
    assert sorted(x.name for x in two.iterdir()) == ["adapter", "checkpoint", "config.json", "metrics.jsonl"]
    assert (two / "checkpoint" / "rng.rank1.safetensors").is_file()
    want = load_file(one / "adapter" / "adapter_model.safetensors")
    got = load_file(two / "adapter" / "adapter_model.safetensors")
    assert max_abs_diff(got, want) <= 1e-5
    for g, w in zip(rows(two), rows(one), strict=True):
        assert (g["step"], g["tokens"], g["target_tokens"]) == (w["step"], w["tokens"], w["target_tokens"])
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)

    # the 2-process run resumes in one process (another world size: a note, no refusal)
    assert run_cli(cli_args(tiny_model, two, "resume=true")) == 0
    assert "saved by 2 processes, this run has 1" in capsys.readouterr().out


# ----------------------------------------------------------------------------- KTO's reference point


def kto_kl_worker(rank: int, out: str) -> None:
    from minitrain.objectives.kto import kl_reference_point

    policy = {0: torch.tensor([-1.0, -2.0]), 1: torch.tensor([-1.0, -3.0, -2.0])}[rank]
    ref = {0: torch.tensor([-0.5, -1.9]), 1: torch.tensor([-2.0, -3.0, -2.5])}[rank]
    both = kl_reference_point(policy, ref)  # rank means: -0.3 and +0.5
    only_rank1 = kl_reference_point(policy, ref, weight=float(rank))  # rank 0 scores a stand-in row
    Path(f"{out}/kl{rank}.json").write_text(json.dumps([float(both), float(only_rank1)]))


def test_kto_reference_point_is_the_mean_of_the_ranks_means_clamped_after(tmp_path):
    """TRL: `gather_for_metrics(kl).mean().clamp(min=0)`: every rank gets (-0.3 + 0.5) / 2 = 0.1, not its
    own clamped mean (0 on rank 0, 0.5 on rank 1); a rank at weight 0 does not count."""
    launch(tmp_path, "kto_kl_worker", str(tmp_path))
    for r in (0, 1):
        both, only_rank1 = json.loads((tmp_path / f"kl{r}.json").read_text())
        assert both == pytest.approx(0.1, abs=1e-6) and only_rank1 == pytest.approx(0.5, abs=1e-6)


def two_nodes(commands: list[list[str]]) -> tuple[list[int], list[tuple[str, str]]]:
    """Start one `torchrun --nnodes 2 --rdzv-backend c10d` launcher (one process) per command, as two
    machines meeting at a rendezvous endpoint on localhost; their exit codes and (stdout, stderr)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", uuid.uuid4().hex,
                "-m", "minitrain"]
    nodes = [subprocess.Popen(launcher + args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for args in commands]
    outs = [n.communicate(timeout=600) for n in nodes]
    return [n.returncode for n in nodes], outs


@pytest.mark.slow
def test_two_nodes_on_localhost_equal_one_process(tiny_model, tmp_path, capsys):
    """`torchrun --nnodes 2 --rdzv-backend c10d`: two launchers (two "machines", one process each) that
    meet at a rendezvous endpoint train what one process trains with the whole batch."""
    from minitrain.cli import run_cli

    one = tmp_path / "one"
    assert run_cli(cli_args(tiny_model, one)) == 0, capsys.readouterr().err
    capsys.readouterr()
    two = tmp_path / "two"
    codes, outs = two_nodes([cli_args(tiny_model, two)] * 2)
    for code, (out, err) in zip(codes, outs):
        assert code == 0, err[-4000:]
        assert "Traceback" not in err
    assert sum(out.count("done: step 3/3") for out, _ in outs) == 1  # global rank 0 alone prints
    want = load_file(one / "adapter" / "adapter_model.safetensors")
    got = load_file(two / "adapter" / "adapter_model.safetensors")
    assert max_abs_diff(got, want) <= 1e-5
    for g, w in zip(rows(two), rows(one), strict=True):
        assert (g["step"], g["tokens"], g["target_tokens"]) == (w["step"], w["tokens"], w["target_tokens"])
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["data", "model"])
def test_machines_that_read_other_files_are_refused_before_step_1(tiny_model, tmp_path, what):
    """Two machines given other data (or another checkpoint) under the same names: each rank would
    train on its own files and the run would mean nothing; every rank stops before step 1, one line."""
    other = tmp_path / "other"
    if what == "data":
        rows = (REPO / "tests" / "bad_inputs" / "data" / "good.jsonl").read_text().splitlines()
        other.write_text("\n".join(reversed(rows)) + "\n")  # the same rows in another order
        swap = f"data={other}"
    else:
        shutil.copytree(tiny_model, other)
        from safetensors.torch import load_file, save_file

        weights = load_file(other / "model.safetensors")
        save_file({k: v + 0.01 for k, v in weights.items()}, other / "model.safetensors")  # a fine-tune of it
        swap = f"model={other}"
    out = tmp_path / "out"
    key = swap.partition("=")[0] + "="
    codes, outs = two_nodes([cli_args(tiny_model, out), [swap if a.startswith(key) else a
                                                         for a in cli_args(tiny_model, out)]])
    errors = [ln for _, err in outs for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, [err[-2000:] for _, err in outs]
    assert errors[0].startswith(f"error: {what}: rank 1 reads other {what} than rank 0"), errors
    assert all(code != 0 for code in codes) and not out.exists()
    assert all("minitrain/" not in err.partition("Traceback")[2] for _, err in outs)  # torchrun's own report only
