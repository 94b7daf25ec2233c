"""Resume under torchrun, as a user runs it: `python -m torch.distributed.run ... -m minitrain RECIPE.py`.

Every launch here goes through the command line (never `train()` directly), and every multi-rank
launch records each rank's collectives (`MINITRAIN_TRACE_COLLECTIVES`): the ranks' sequences must be
equal, over whole runs with evaluation, checkpoints, resume and the final save.

- SFT, the whole matrix: a run cut after 2 of 4 steps (`stop_after=2`) by 1 process, 2 ddp ranks or
  2 fsdp ranks, resumed with `resume=true` at 1 -> 2 (ddp, fsdp), 2 -> 2, 2 -> 1 and 2 -> 4 ranks,
  equals the uninterrupted one-process run (adapter to 1e-5, each step's loss to 1e-5 relative: other
  world sizes sum in another order). One uninterrupted run and three cut runs serve every chain.
- A SIGKILL of one rank in mid-run ends the run (never a hang), and the resume equals the uninterrupted
  run; so does the resume of a checkpoint whose save was cut short (a temporary folder of parts left
  beside it, or a save killed between its two renames).
- Every other recipe (DPO, KTO, GRPO, distillation, T5, ARD, LRC, the reward model), in each mode it supports: cut at 2
  ranks, resumed at 2 ranks for one step (2 -> 2: that step's row as the uninterrupted 2-rank ddp run's,
  bitwise for ddp, to 1e-5 for fsdp; one uninterrupted run per recipe; GRPO's completions equal),
  then in one process (2 -> 1: the adapter to 1e-5 where the steps draw no random numbers; GRPO's
  sampling and ARD's gates drew rank 1's numbers from a generator a one-process run no longer has,
  `checkpoint.world_note`).
- A collective planted on rank 0 alone is caught: by the trace comparison, or (inside `main_only`)
  refused at once.
- Fail fast: a rank stopped (SIGSTOP) in mid-run makes rank 0 print one line naming it within
  `dist_timeout`, and the run ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _recipes import args_for
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
ADAPTER = Path("adapter") / "adapter_model.safetensors"


# ----------------------------------------------------------------------------- launching


def _env(trace: Path | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    env.pop("MINITRAIN_TRACE_COLLECTIVES", None)
    if trace is not None:
        env["MINITRAIN_TRACE_COLLECTIVES"] = str(trace)
    return env


def keys(args: list[str], *extra: str) -> list[str]:
    """`args` with the `key=value` settings of `extra` added, or replacing the same key's."""
    names = {e.partition("=")[0] for e in extra}
    return [a for a in args if a.partition("=")[0] not in names] + list(extra)


def command(world: int, args: list[str]) -> list[str]:
    """How a user starts it: one process plainly, several through torchrun (`--standalone`: a free port)."""
    if world == 1:
        return [sys.executable, "-m", "minitrain", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
            "-m", "minitrain", *args]


def launch(world: int, args: list[str], expect: int = 0) -> subprocess.CompletedProcess:
    """Run the command to its end; the ranks' collective sequences must be equal."""
    out = Path(next(a for a in args if a.startswith("out=")).partition("=")[2])
    trace = out.parent / f"trace-{out.name}-{time.monotonic_ns()}" if world > 1 else None
    p = subprocess.run(command(world, args), cwd=REPO, env=_env(trace), capture_output=True, text=True, timeout=900)
    assert p.returncode == expect, f"{' '.join(args)}\nexit {p.returncode}\n{p.stderr[-4000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-4000:]
    assert "returned a view tensor" not in p.stderr  # FSDP2's warning about the model's output
    if trace is not None:
        assert same_collectives(trace, world) is None, same_collectives(trace, world)
    return p


def same_collectives(trace: Path, world: int) -> str | None:
    """None when every rank made the same collectives in the same order, else where they part."""
    seqs = [(trace / f"collectives.rank{r}.txt").read_text().splitlines() for r in range(world)]
    names = [[line.split()[0] for line in s] for s in seqs]
    for r in range(1, world):
        if names[r] != names[0]:
            i = next((i for i, (a, b) in enumerate(zip(names[0], names[r])) if a != b), min(len(names[0]), len(names[r])))
            show = lambda s: s[i] if i < len(s) else "(none: the run ended)"  # noqa: E731
            return f"collective #{i + 1}: rank 0 made {show(seqs[0])}, rank {r} made {show(seqs[r])}"
    return None


def rows(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(x) for x in (out / name).read_text().splitlines() if x.strip()]


def assert_equal_runs(got: Path, want: Path, tol: float = 1e-5, keys: tuple[str, ...] = ("loss",)) -> None:
    """The same adapter (to `tol`) and, step by step, the same `keys` (relative `tol`) and token counts."""
    a, b = load_file(got / ADAPTER), load_file(want / ADAPTER)
    assert a.keys() == b.keys()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= tol, f"{got}: adapter differs from {want} by {diff}"
    g, w = rows(got), rows(want)
    assert [r["step"] for r in g] == [r["step"] for r in w]
    for x, y in zip(g, w):
        assert x["target_tokens"] == y["target_tokens"]
        for k in keys:
            assert x[k] == pytest.approx(y[k], rel=tol, abs=tol), (x["step"], k)


def worker_pids(launcher: int, world: int, timeout: float = 120) -> dict[int, int]:
    """{rank: pid} of torchrun's workers (its children), read from their environment."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = {}
        for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = int(child)
        if len(found) == world:
            return found
        time.sleep(0.05)
    raise AssertionError(f"torchrun did not start {world} workers")


# ----------------------------------------------------------------------------- SFT: the whole matrix


class SFT:
    """The SFT runs, each made once and shared by the chains that start from it."""

    def __init__(self, root: Path, model: Path):
        self.root, self.made = root, {}
        data = REPO / "tests" / "bad_inputs" / "data" / "good.jsonl"
        self.args = [str(REPO / "recipes" / "sft_llama.py"), f"model={model}", f"data={data}", f"eval_data={data}",
                     "max_steps=4", "save_every=2", "eval_every=2", "batch_size=4", "lora_r=4", "device=cpu",
                     "precision=fp32", "chat_format=mistral", "warmup=0", "dist_timeout=60"]

    def run(self, name: str, world: int, *extra: str, start: Path | None = None) -> Path:
        if name not in self.made:
            out = self.root / name
            if start is not None:
                shutil.copytree(start, out)
            launch(world, keys(self.args, f"out={out}", *extra))
            self.made[name] = out
        return self.made[name]

    def straight(self) -> Path:
        return self.run("straight", 1)

    def cut(self, world: int, mode: str) -> Path:
        out = self.run(f"cut{world}{mode}", world, f"parallel={mode}", "stop_after=2")
        assert rows(out)[-1]["step"] == 2 and not (out / "adapter").exists()
        return out


@pytest.fixture(scope="module")
def sft(tiny_model, tmp_path_factory) -> SFT:
    return SFT(tmp_path_factory.mktemp("torchrun_resume"), tiny_model)


@pytest.mark.parametrize("src,dst", [((1, "ddp"), (2, "ddp")), ((1, "ddp"), (2, "fsdp")),
                                     ((2, "ddp"), (2, "ddp")), ((2, "ddp"), (1, "ddp")), ((2, "ddp"), (4, "ddp")),
                                     ((2, "fsdp"), (2, "fsdp")), ((2, "fsdp"), (1, "ddp")), ((2, "fsdp"), (4, "fsdp"))],
                         ids=lambda x: f"{x[0]}{x[1]}")
def test_sft_resumed_at_another_world_size_or_mode_equals_the_uninterrupted_run(sft, src, dst):
    cut = sft.cut(*src)
    resumed = sft.run(f"{src[0]}{src[1]}-to-{dst[0]}{dst[1]}", dst[0], f"parallel={dst[1]}", "resume=true", start=cut)
    assert_equal_runs(resumed, sft.straight())
    evals = rows(resumed, "eval.jsonl")
    assert [r["step"] for r in evals] == [0, 2, 4]  # the rows after the checkpoint written again, once


def test_sigkill_of_one_rank_ends_the_run_and_the_resume_equals_the_uninterrupted_run(sft):
    """10 steps, save_every=1; rank 1 is SIGKILLed in mid-run, once step 2 is logged (the step-1 checkpoint is
    complete, step 2's may be in its save): the run ends (torchrun stops the other rank; a collective
    with the dead rank fails at once, or within dist_timeout), no adapter is written, and
    resume=true on 2 ranks ends where the uninterrupted run ends."""
    out = sft.root / "killed"
    longer = ["max_steps=10", "eval_every=0"]  # long enough to be killed in (killed once step 2 is logged)
    args = keys(sft.args, f"out={out}", *longer, "save_every=1", "dist_timeout=20")
    p = subprocess.Popen(command(2, args), cwd=REPO, env=_env(None), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    ranks = worker_pids(p.pid, 2)
    end = time.monotonic() + 300
    while time.monotonic() < end and p.poll() is None and not (
            (out / "metrics.jsonl").is_file() and len(rows(out)) >= 2):
        time.sleep(0.01)
    os.kill(ranks[1], signal.SIGKILL)
    killed = time.monotonic()
    p.communicate(timeout=120)
    assert p.returncode != 0 and time.monotonic() - killed < 20 + 30  # dist_timeout + torchrun's own grace
    assert not (out / "adapter").exists()
    resumed = launch(2, keys(args, "resume=true"))
    assert "resumed from" in resumed.stdout
    assert_equal_runs(out, sft.run("straight10", 1, *longer))


@pytest.mark.parametrize("state", ["writing parts", "between renames"])
def test_a_checkpoint_whose_save_was_cut_short_resumes_from_the_last_complete_one(sft, state):
    """What a save killed in mid-write leaves, made from the 2-rank fsdp cut (per-rank parts): a
    temporary folder with some parts and no state.json beside the complete checkpoint ("writing
    parts"), or, killed between the save's two renames, no `checkpoint/` but the previous one as
    `checkpoint.old-*` ("between renames"). Resumed on 2 fsdp ranks: the uninterrupted run's result."""
    out = sft.root / f"cut-short-{state.replace(' ', '-')}"
    shutil.copytree(sft.cut(2, "fsdp"), out)
    partial = out / "checkpoint.tmp-99998"
    partial.mkdir()
    shutil.copy(out / "checkpoint" / "weights.rank0.safetensors", partial)
    if state == "between renames":
        (out / "checkpoint").rename(out / "checkpoint.old-99999")
    p = launch(2, keys(sft.args, f"out={out}", "parallel=fsdp", "resume=true"))
    assert ("resuming from checkpoint.old-99999 (step 2)" in p.stdout) == (state == "between renames")
    assert_equal_runs(out, sft.straight())
    assert not partial.exists()  # the next save removed what the killed one left


# ----------------------------------------------------------------------------- every other recipe


RECIPES = {  # recipe: (modes it supports under torchrun, extra keys, whether its steps draw random numbers)
    "dpo_mistral.py": (("ddp", "fsdp"), (), False),
    "kto_mistral.py": (("ddp", "fsdp"), (), False),
    "grpo_qwen.py": (("ddp",), ("batch_size=2", "log_completions_every=1"), True),  # sampling (refuses fsdp: it samples with the whole model)
    "distill_llama.py": (("ddp", "fsdp"), (), False),
    "lora_t5.py": (("ddp", "fsdp"), ("lora_dropout=0",), False),  # (and the tiny T5 has dropout_rate 0)
    "ard_lora_llama.py": (("ddp",), (), True),  # its gates are sampled (it refuses fsdp: they need the whole model)
    "lrc_llama.py": (("ddp",), ("quantize=ternary",), False),  # ternary bases are not sharded
    # one row [prompt, chosen rest, rejected rest] per pair (its two-row default resumes bitwise in one process,
    # tests/test_reward_model.py); it refuses fsdp
    "reward_model.py": (("ddp",), ("shared_prompt=true",), False),
}
EXACT = ("step", "loss", "grad_norm", "tokens", "target_tokens")  # a row's values that a resume must repeat


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory) -> dict:
    """Each recipe's uninterrupted 2-rank ddp run, made once: its ddp and its fsdp chains both start from it."""
    return {"root": tmp_path_factory.mktemp("straight")}


@pytest.mark.parametrize("recipe,mode", [(r, m) for r, (modes, _, _) in RECIPES.items() for m in modes])
def test_every_recipe_resumed_2_to_2_then_2_to_1_equals_its_uninterrupted_run(recipe_inputs, straight_runs, tmp_path,
                                                                               recipe, mode):
    """3 steps: cut after step 1 at 2 ranks, resumed at 2 ranks for step 2 (its row equal to the
    uninterrupted 2-rank ddp run's: bitwise for ddp, to 1e-5 for fsdp, which sums in another order),
    then in one process for step 3: the adapter and step 3's loss equal the uninterrupted run's to
    1e-5 (float summation order), where the steps draw no random numbers; where they do (GRPO's
    sampling, ARD's gates), rank 1's generator is gone at one process (`checkpoint.world_note`), so
    the run is only checked to continue at step 3."""
    modes, extra, draws = RECIPES[recipe]
    base = keys(keys(args_for(recipe, recipe_inputs), "max_steps=3", "save_every=1", "log_every=1", "batch_size=4",
                     "precision=fp32", "warmup=0", "dist_timeout=60", f"parallel={mode}"), *extra)
    if recipe not in straight_runs:
        straight_runs[recipe] = straight_runs["root"] / recipe
        launch(2, keys(base, f"out={straight_runs[recipe]}", "parallel=ddp"))
    straight, cut = straight_runs[recipe], tmp_path / "cut"
    launch(2, keys(base, f"out={cut}", "stop_after=1"))
    launch(2, keys(base, f"out={cut}", "stop_after=1", "resume=true"))  # 2 -> 2, step 2
    got, want = ([[r[k] for k in EXACT] for r in rows(out)[:2]] for out in (cut, straight))
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g == (w if mode == "ddp" else pytest.approx(w, rel=1e-5, abs=1e-5)), (g, w)
    if recipe == "grpo_qwen.py":  # the same ranks drew the same completions
        step2 = lambda out: [r for r in rows(out, "completions.jsonl") if r["step"] == 2]  # noqa: E731
        assert step2(cut) == step2(straight) != []
    one = launch(1, keys(base, f"out={cut}", "parallel=ddp", "resume=true"))  # 2 -> 1, step 3
    assert "saved by 2 processes, this run has 1" in one.stdout
    assert [r["step"] for r in rows(cut)] == [1, 2, 3] and (cut / ADAPTER).is_file()
    if not draws:
        assert_equal_runs(cut, straight)


# ----------------------------------------------------------------------------- collectives that cannot drift


PLANTED = {
    # a rank-0 branch that reaches a collective: the ranks' sequences part there
    "branch": "if distributed.rank() == 0:\n        torch.distributed.barrier()\n",
    # a collective inside main_only: refused at once on rank 0
    "main_only": "distributed.main_only(lambda: distributed.gather_objects(1))\n",
}


@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_a_planted_rank_0_collective_is_caught(tiny_model, tmp_path, plant):
    """A copy of sft_llama.py whose `run` makes a collective on rank 0 alone before training."""
    recipe = tmp_path / "planted.py"
    text = (REPO / "recipes" / "sft_llama.py").read_text()
    head, sep, rest = text.partition("\ndef run(config")
    signature, colon, body = rest.partition(":\n")
    assert sep and colon
    recipe.write_text(f"{head}\nimport torch\nfrom minitrain.parallel import distributed\n{sep}{signature}{colon}\n    "
                      f"{PLANTED[plant]}{body}")
    data = REPO / "tests" / "bad_inputs" / "data" / "good.jsonl"
    out, trace = tmp_path / "out", tmp_path / "trace"
    args = [str(recipe), f"model={tiny_model}", f"data={data}", f"out={out}", "max_steps=2", "batch_size=4",
            "lora_r=4", "device=cpu", "chat_format=mistral", "dist_timeout=10"]
    p = subprocess.run(command(2, args), cwd=REPO, env=_env(trace), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    if plant == "main_only":
        assert "CollectiveInMainOnly: gather_objects inside distributed.main_only" in p.stderr
    else:
        parted = same_collectives(trace, 2)
        assert parted is not None and "rank 0 made barrier  planted.py:" in parted, parted


# ----------------------------------------------------------------------------- fail fast, never hang


def test_a_stuck_rank_is_named_by_rank_0_within_dist_timeout(sft):
    """Rank 1 stopped (SIGSTOP) in mid-run: rank 0's next collective waits dist_timeout (5 s), then
    rank 0 prints one line naming rank 1 and exits; the run ends once rank 1 can be stopped."""
    out = sft.root / "stuck"
    args = keys(sft.args, f"out={out}", "max_steps=200", "save_every=0", "eval_every=0", "dist_timeout=5")
    p = subprocess.Popen(command(2, args), cwd=REPO, env=_env(None), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    ranks = worker_pids(p.pid, 2)
    errors: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: errors.extend((time.monotonic(), ln) for ln in p.stderr), daemon=True)
    reader.start()
    end = time.monotonic() + 300
    while time.monotonic() < end and not (out / "metrics.jsonl").is_file():
        time.sleep(0.05)
    while time.monotonic() < end and len(rows(out)) < 2:
        time.sleep(0.05)
    os.kill(ranks[1], signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        while time.monotonic() < stopped + 60 and not any(ln.startswith("error:") for _, ln in errors):
            time.sleep(0.1)
    finally:
        os.kill(ranks[1], signal.SIGCONT)
    p.wait(timeout=120)
    reader.join(timeout=10)
    said = [(t, ln) for t, ln in errors if ln.startswith("error:")]
    assert len(said) == 1, [ln for _, ln in errors][-20:]
    when, line = said[0]
    assert line.startswith("error: rank 1 stopped answering"), line
    assert "rank 0 in minitrain/" in line
    assert when - stopped < 5 + 5 + 10  # dist_timeout + the wait for the other ranks' word + slack
    assert p.returncode != 0



def test_grpo_with_tools_cut_and_resumed_under_torchrun(tmp_path):
    """The tool-use demo (tool calls in the rollout, each rank its own) on 2 ddp ranks, cut after 2 of 4
    steps and resumed with resume=true: the ranks make the same collectives, every step is logged once,
    with its tool metrics."""
    args = ["recipes/grpo_qwen.py", f"config={REPO / 'demo' / 'grpo_tools' / 'run.json'}", "max_steps=4",
            "eval_every=0", f"out={tmp_path / 'run'}"]
    launch(2, keys(args, "stop_after=2"))
    launch(2, keys(args, "resume=true"))
    got = rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert all("tools/call_frequency" in r and "tools/failure_frequency" in r for r in got)
