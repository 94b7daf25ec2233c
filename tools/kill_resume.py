"""Crash-safety harness: SIGKILL a training run at random moments, resume it, check nothing is lost.

    python tools/kill_resume.py --kills 20 [--seed 0] [--steps 8] [--work DIR] [--keep]

1. Makes a tiny LLaMA (random weights, saved by `minitrain.weights.save_pretrained`), a tiny BPE
   tokenizer and a JSONL file in a work folder (`--model` / `--data` use yours instead), and a
   LoRA adapter every run starts from (`init_adapter=`, lora_dropout 0.1: the dropout RNG must
   resume too). A saved start is needed because the recipe does not seed a new adapter's init.
2. Runs `python -m minitrain recipes/sft_llama.py ... save_every=1` once uninterrupted: the reference.
3. Runs the same command again and again, killing it with SIGKILL (seeded random choices), each
   restart with `resume=true` when a checkpoint exists (else `overwrite=true`: the run died before
   its first save). Kill moments are drawn three ways, so enough of them land inside a checkpoint
   write: any time after the process starts (loading, setup), any time during the training phase
   (after the loop prints its `examples:` line), and inside a checkpoint write (the out folder is
   polled for `checkpoint.tmp-*` and the process is killed the moment one appears).
4. After every kill: every complete checkpoint on disk (`checkpoint/`, `checkpoint.old-*`) must load
   (state.json, the safetensors files, and `minitrain.checkpoint.load` into a fresh optimizer), and
   `metrics.jsonl` must parse with consecutive steps from 1.
5. When a run completes: its adapter must equal the reference's bitwise, and its `metrics.jsonl`
   must hold each step 1..steps exactly once, with the reference's loss, lr, grad_norm and token
   counts (bitwise). If kills remain, a new round starts in a fresh folder.

Prints a summary; exit code 0 when every check held, 1 otherwise. `--json FILE` writes the summary.
`tests/test_kill_resume.py` runs it with 3 kills.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RECIPE = REPO / "recipes" / "sft_llama.py"
# metrics that must be identical after kills and resumes (timing and memory are not)
EXACT_METRICS = ("step", "loss", "lr", "grad_norm", "tokens", "target_tokens", "epoch", "skipped_steps")
MODES = ("anytime", "training", "in-write")

TINY_LLAMA = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
    rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
WORDS = ("the a of to in and is it that was for on are with as be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said each she which "
         "do their time if will way about many then them write would like so these her long make thing "
         "see him two has look more day could go come did number sound no most people my over know").split()


# ----------------------------------------------------------------------------- the tiny run


def corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + rng.choice(".?!") for _ in range(n)]


def make_model(folder: Path, seed: int = 0) -> Path:
    """A tiny random LLaMA in HF layout plus a BPE tokenizer (vocab <= 128) trained on `corpus`."""
    import torch
    from tokenizers import Tokenizer, decoders, models as tok_models, normalizers, pre_tokenizers, trainers

    import models
    from minitrain.weights import save_pretrained

    torch.manual_seed(seed)
    model = models.from_hf_config(dict(TINY_LLAMA))
    save_pretrained(model, folder, dict(TINY_LLAMA))
    tok = Tokenizer(tok_models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  show_progress=False)
    tok.train_from_iterator(corpus(300, seed), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    return folder


def make_data(path: Path, rows: int = 24, seed: int = 1) -> Path:
    lines = corpus(2 * rows, seed)
    path.write_text("".join(json.dumps({"prompt": lines[2 * i], "completion": " " + lines[2 * i + 1]}) + "\n"
                            for i in range(rows)))
    return path


def make_start_adapter(model: Path, folder: Path, seed: int = 0) -> Path:
    """A LoRA adapter (r=4, dropout 0.1, lora_B not zero) that every run starts from (`init_adapter=`).

    The recipe draws a new adapter's lora_A from torch's unseeded generator, so two runs with the
    same `seed` start from different adapters; starting from a saved one pins the start, so the
    killed run and the reference can be compared bitwise.
    """
    import torch

    import models
    from minitrain.adapters.lora import LoRAConfig, apply_lora
    from minitrain.adapters.peft_format import save_adapter
    from minitrain.weights import load_pretrained

    torch.manual_seed(seed)
    base = load_pretrained(model, models.from_hf_config)
    cfg = LoRAConfig(r=4, alpha=8.0, dropout=0.1, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    apply_lora(base, cfg)
    with torch.no_grad():
        for n, p in base.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.02)  # not zero: dropout masks change the loss from step 1
    return save_adapter(base, folder, cfg)


def command(model: Path, data: Path, adapter: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """The run's command line; `extra` key=value settings are added or replace the harness's."""
    keys = {"model": model, "data": data, "out": out, "init_adapter": adapter, "max_steps": steps, "save_every": 1,
            "batch_size": 2, "grad_accum": 2, "warmup": 2, "device": "cpu", "seed": 0}
    keys.update(e.split("=", 1) for e in extra)
    return [sys.executable, "-m", "minitrain", str(RECIPE)] + [f"{k}={v}" for k, v in keys.items()]


def environment() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}


# ----------------------------------------------------------------------------- one process


class Child:
    """A training process whose stdout lines are timestamped (to see when training starts)."""

    def __init__(self, argv: list[str], log: Path):
        self.t0 = time.monotonic()
        self.training_at: float | None = None  # when the loop printed its `examples:` line
        self.stderr_f = open(log.with_suffix(".err"), "w")
        self.proc = subprocess.Popen(argv, cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                                     stderr=self.stderr_f, text=True, start_new_session=True)
        self.stdout: list[str] = []
        self.err_path = log.with_suffix(".err")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self.training_at is None and line.startswith("examples:"):
                self.training_at = time.monotonic()
            self.stdout.append(line)

    def kill(self) -> bool:
        """SIGKILL now; False if it had already exited."""
        if self.proc.poll() is not None:
            return False
        os.kill(self.proc.pid, signal.SIGKILL)
        return True

    def wait(self) -> int:
        rc = self.proc.wait()
        self._reader.join()
        self.stderr_f.close()
        return rc

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")


def run_to_end(argv: list[str], log: Path) -> tuple[int, float, float, str]:
    """(exit code, seconds to the training phase, seconds in it, stderr) of an uninterrupted run."""
    child = Child(argv, log)
    rc = child.wait()
    end = time.monotonic()
    start = child.training_at or end
    return rc, start - child.t0, end - start, child.stderr


# ----------------------------------------------------------------------------- checks


def tmp_checkpoints(out: Path) -> list[Path]:
    return sorted(out.glob("checkpoint.tmp-*"))


def complete_checkpoints(out: Path) -> list[Path]:
    """Every folder `minitrain.checkpoint.find` could pick: `checkpoint` and `checkpoint.old-*` with a state.json."""
    return [c for c in [out / "checkpoint", *sorted(out.glob("checkpoint.old-*"))] if (c / "state.json").is_file()]


def load_checkpoint(folder: Path) -> int:
    """Load a checkpoint folder completely; return its step. Raises on anything unreadable."""
    import torch
    from safetensors.torch import load_file

    from minitrain import checkpoint as ckpt

    state = json.loads((folder / "state.json").read_text())
    for name in ("weights", "optimizer", "rng"):
        load_file(folder / f"{name}.safetensors")
    weights = load_file(folder / "weights.safetensors")
    named = [(n, torch.nn.Parameter(torch.zeros_like(t))) for n, t in weights.items()]
    optimizer = torch.optim.AdamW([p for _, p in named], lr=1.0)
    with tempfile.TemporaryDirectory() as d:  # ckpt.load reads `<out>/checkpoint`: give it this one alone
        os.symlink(folder.resolve(), Path(d) / ckpt.NAME)
        rng = torch.get_rng_state()
        loaded = ckpt.load(d, named, optimizer)
        torch.set_rng_state(rng)
    for n, p in named:
        if not torch.equal(p.detach(), weights[n]):
            raise AssertionError(f"{folder}: {n} did not load")
    if len(optimizer.state) != len(named):
        raise AssertionError(f"{folder}: optimizer state for {len(optimizer.state)} of {len(named)} tensors")
    if loaded["step"] != state["step"]:
        raise AssertionError(f"{folder}: step {loaded['step']} vs state.json {state['step']}")
    return int(state["step"])


def metric_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def adapter_tensors(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(out / "adapter" / "adapter_model.safetensors")


def compare_final(out: Path, ref_out: Path, steps: int) -> list[str]:
    """Problems (empty: none) between a killed-and-resumed run and the reference."""
    import torch

    problems = []
    got, want = adapter_tensors(out), adapter_tensors(ref_out)
    if set(got) != set(want):
        problems.append(f"adapter keys differ: {sorted(set(got) ^ set(want))[:4]}")
    differ = [k for k in want if k in got and not torch.equal(got[k], want[k])]
    if differ:
        worst = max(float((got[k] - want[k]).abs().max()) for k in differ)
        problems.append(f"adapter differs from the uninterrupted run in {len(differ)} tensors (max abs diff {worst:.3g})")
    rows, ref_rows = metric_rows(out), metric_rows(ref_out)
    seen = [r["step"] for r in rows]
    if seen != list(range(1, steps + 1)):
        dup = sorted({s for s in seen if seen.count(s) > 1})
        missing = sorted(set(range(1, steps + 1)) - set(seen))
        problems.append(f"metrics.jsonl steps {seen}: duplicated {dup}, missing {missing}")
    else:
        for r, q in zip(rows, ref_rows):
            diff = [k for k in EXACT_METRICS if r.get(k) != q.get(k)]
            if diff:
                problems.append(f"metrics.jsonl step {r['step']}: {', '.join(f'{k} {r.get(k)!r} vs {q.get(k)!r}' for k in diff)}")
                break
    return problems


# ----------------------------------------------------------------------------- the harness


@dataclass
class Summary:
    kills: int = 0
    by_mode: dict[str, int] = field(default_factory=lambda: {m: 0 for m in MODES})
    before_training: int = 0  # killed before the loop started (loading, setup)
    in_checkpoint_write: int = 0  # a checkpoint.tmp-* was left behind by the kill
    between_renames: int = 0  # the kill left only checkpoint.old-* (no checkpoint/)
    no_checkpoint_yet: int = 0  # restarts that had no checkpoint to resume (overwrite=true)
    resumes: int = 0
    exited_before_kill: int = 0
    rounds: int = 0
    checkpoints_loaded: int = 0
    stale_tmp_folders: int = 0  # checkpoint.tmp-* still on disk when a round ended
    stale_old_folders: int = 0  # checkpoint.old-* still on disk when a round ended
    problems: list[str] = field(default_factory=list)
    reference: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        lines = [
            f"kills: {self.kills} (modes: " + ", ".join(f"{m} {n}" for m, n in self.by_mode.items()) + ")",
            f"  landed: {self.before_training} before training started, {self.in_checkpoint_write} inside a "
            f"checkpoint write (tmp folder left), {self.between_renames} between the checkpoint renames",
            f"restarts: {self.resumes} with resume=true, {self.no_checkpoint_yet} with overwrite=true "
            f"(no checkpoint yet); {self.exited_before_kill} runs finished before their kill",
            f"rounds completed: {self.rounds}; complete checkpoints loaded after kills: {self.checkpoints_loaded}",
            f"left on disk at the end of rounds: {self.stale_tmp_folders} checkpoint.tmp-*, "
            f"{self.stale_old_folders} checkpoint.old-* folders",
            f"reference run: {self.reference.get('setup_s', 0):.1f}s to training, "
            f"{self.reference.get('train_s', 0):.1f}s training; harness {self.seconds:.0f}s",
        ]
        if self.problems:
            lines.append(f"FAILED: {len(self.problems)} problem(s)")
            lines += [f"  - {p}" for p in self.problems]
        else:
            lines.append("OK: every checkpoint loaded after every kill; each resumed run's adapter equals the "
                         "uninterrupted run's bitwise; metrics.jsonl has each step once, with the same values")
        return "\n".join(lines)


def check_after_kill(out: Path, summary: Summary, where: str) -> None:
    for c in complete_checkpoints(out):
        try:
            load_checkpoint(c)
            summary.checkpoints_loaded += 1
        except Exception as e:  # noqa: BLE001 - any failure to load is what we are looking for
            summary.problems.append(f"{where}: {c.name} does not load: {type(e).__name__}: {e}")
    try:
        steps = [r["step"] for r in metric_rows(out)]
    except (ValueError, KeyError) as e:
        summary.problems.append(f"{where}: metrics.jsonl does not parse: {e}")
        return
    if steps != list(range(1, len(steps) + 1)):
        summary.problems.append(f"{where}: metrics.jsonl steps {steps} are not 1..n")


def kill_moment(child: Child, out: Path, mode: str, rng: random.Random, ref: dict[str, float], left: float) -> None:
    """Return when `child` should be killed (or has exited); `left`: the fraction of the run still to train."""
    def alive() -> bool:
        return child.proc.poll() is None

    train_s = ref["train_s"] * left
    if mode == "anytime":
        deadline = child.t0 + rng.uniform(0, ref["setup_s"] + train_s)
        while alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        return
    while alive() and child.training_at is None:
        time.sleep(0.002)
    if mode == "training":
        deadline = (child.training_at or time.monotonic()) + rng.uniform(0, train_s)
        while alive() and time.monotonic() < deadline:
            time.sleep(0.002)
        return
    # in-write: the n-th checkpoint write this process starts
    want, seen, inside = rng.randint(1, 3), 0, False
    while alive():
        now_inside = bool(tmp_checkpoints_of(out, child.proc.pid))
        if now_inside and not inside:
            seen += 1
            if seen >= want:
                return
        inside = now_inside
        time.sleep(0.0002)


def tmp_checkpoints_of(out: Path, pid: int) -> bool:
    return (out / f"checkpoint.tmp-{pid}").exists()


def harness(kills: int, seed: int, steps: int, work: Path, model: Path | None, data: Path | None,
            log=print) -> Summary:
    summary = Summary()
    t_start = time.monotonic()
    rng = random.Random(seed)
    if model is None:
        model = make_model(work / "model")
    if data is None:
        data = make_data(work / "train.jsonl")
    adapter = make_start_adapter(model, work / "start_adapter", seed)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    ref_out = work / "reference"
    rc, setup_s, train_s, err = run_to_end(command(model, data, adapter, ref_out, steps), logs / "reference")
    if rc != 0:
        summary.problems.append(f"the uninterrupted reference run failed (exit {rc}): {err.strip()[-2000:]}")
        return summary
    summary.reference = {"setup_s": setup_s, "train_s": train_s}
    log(f"reference: {steps} steps, {setup_s:.1f}s to training, {train_s:.1f}s training")

    attempt = 0
    while summary.kills < kills and not summary.problems:
        out = work / f"round{summary.rounds}"
        shutil.rmtree(out, ignore_errors=True)
        while not summary.problems:
            attempt += 1
            extra: list[str] = []
            if complete_checkpoints(out):
                extra.append("resume=true")
                summary.resumes += 1
            elif out.exists() and any(out.iterdir()):
                extra.append("overwrite=true")
                summary.no_checkpoint_yet += 1
            kill = summary.kills < kills
            mode = rng.choice(MODES) if kill else "none"
            child = Child(command(model, data, adapter, out, steps, *extra), logs / f"attempt{attempt}")
            if kill:
                done = _step(out)
                left = 1 - (int(done) / steps if done.isdigit() else 0)
                kill_moment(child, out, mode, rng, summary.reference, max(left, 0.1))
                killed = child.kill()
            else:
                killed = False
            rc = child.wait()
            where = f"attempt {attempt} ({' '.join(extra) or 'fresh'}, {mode})"
            if killed:
                summary.kills += 1
                summary.by_mode[mode] += 1
                summary.before_training += child.training_at is None
                left_tmp = tmp_checkpoints_of(out, child.proc.pid)
                summary.in_checkpoint_write += left_tmp
                summary.between_renames += (not (out / "checkpoint").exists()) and (out / f"checkpoint.old-{child.proc.pid}").exists()
                log(f"kill {summary.kills}: {where}, "
                    + ("before training" if child.training_at is None else
                       f"{time.monotonic() - child.training_at:.2f}s into training")
                    + (", inside a checkpoint write" if left_tmp else "")
                    + f"; checkpoint at step {_step(out)}")
                check_after_kill(out, summary, where)
                continue
            if rc != 0:
                summary.problems.append(f"{where}: exited {rc}: {child.stderr.strip()[-2000:]}")
                break
            if kill:
                summary.exited_before_kill += 1
            summary.rounds += 1
            summary.stale_tmp_folders += len(tmp_checkpoints(out))
            summary.stale_old_folders += len(list(out.glob("checkpoint.old-*")))
            for p in compare_final(out, ref_out, steps):
                summary.problems.append(f"round {summary.rounds}: {p}")
            log(f"round {summary.rounds} finished after {summary.kills} kills in all: "
                + ("matches the reference" if not summary.problems else "DIFFERS"))
            break
    summary.seconds = time.monotonic() - t_start
    return summary


def _step(out: Path) -> str:
    found = complete_checkpoints(out)
    if not found:
        return "none"
    try:
        return str(json.loads((found[0] / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs in all (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (save_every=1)")
    ap.add_argument("--work", type=Path, help="work folder (default: a temporary one, removed unless --keep)")
    ap.add_argument("--model", type=Path, help="an HF model folder with a tokenizer (default: a tiny one made here)")
    ap.add_argument("--data", type=Path, help="SFT JSONL (default: generated)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    ap.add_argument("--json", type=Path, help="also write the summary as JSON here")
    args = ap.parse_args(argv)
    if args.kills < 1 or args.steps < 2:
        ap.error("--kills must be >= 1 and --steps >= 2")
    work = args.work or Path(tempfile.mkdtemp(prefix="kill_resume_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        summary = harness(args.kills, args.seed, args.steps, work, args.model, args.data)
    finally:
        if args.work is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.work is None:
            print(f"work folder kept: {work}")
    print(summary.text())
    if args.json:
        args.json.write_text(json.dumps({**summary.__dict__, "ok": summary.ok}, indent=2))
    return 0 if summary.ok else 1


if __name__ == "__main__":
    from minitrain.cli import main_quietly  # a closed pipe (`| head`) ends it quietly

    sys.exit(main_quietly(main))
