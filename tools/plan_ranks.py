"""The memory plan of one rank (`minitrain plan --world N`) against each rank's measured peak, on the CPU.

    python tools/plan_ranks.py [--ranks 1,2,4] [--modes full,lora] [--parallel fsdp] [--family llama|qwen2]
                               [--hidden 1024] [--ffn 2816] [--layers 6] [--heads 16] [--kv-heads 16]
                               [--vocab 16000] [--seq 128] [--batch 4] [--write BENCHMARKS.md]

Makes a random-weight LLaMA-shaped (or Qwen2-shaped: q/k/v biases) checkpoint once in a temporary folder (transformers'
`save_pretrained`, a word-level tokenizer, rows of plain text longer than `--seq`, so every row is
`--seq` tokens and every position a target: the plan's worst case), then for each mode and world
size N runs the real command under torchrun (gloo, one thread per rank):

    torchrun --nproc_per_node N -m minitrain recipes/sft_llama.py model=... parallel=fsdp ...

through this script's `--child`, which calls `minitrain.cli.run_cli` unchanged and reads the
kernel's RSS figures (/proc/self/status) around the training phase:

- the baseline: once the process group is joined, before the model is read (the libraries the run
  imports later, FSDP2's torch._dynamo and sympy among them, are imported before it: code is not
  device memory);
- the high-water mark (VmHWM) is reset when the loop builds its optimizer (after loading and
  sharding), read before each checkpoint save (its buffers are the save's, not training's) and
  reset after it, and read when the loop ends (before the result is gathered and written);
- measured peak = that high-water mark - RSS at the reset + the anonymous memory (RssAnon) gained
  since the baseline: what loading leaves behind counts, as it would on a device, but not the
  file-backed pages (the mapped checkpoint, library code), which are not device memory.

`MALLOC_MMAP_THRESHOLD_=65536` makes glibc return every freed tensor to the kernel, so RSS follows
the live bytes (otherwise freed heap stays resident and the peak reads high by chance).
The plan is `minitrain.plan.predict` for the same config with `device=cpu` and `world=N`: rank 0's.

`--write` puts the table between `<!-- bench:begin plan-ranks -->` markers in the file (`--tag` names
other markers). Needs the
bench extra (transformers). Run it under `nice`: it is CPU-bound and takes minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MMAP_THRESHOLD = "65536"
# what the run imports after the process group is joined (FSDP2 imports torch._dynamo, and with it sympy)
PREIMPORT = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.device_mesh",
             "torch.utils.checkpoint", "tokenizers", "numpy.random", "models.llama", "minitrain.run",
             "minitrain.cpu", "safetensors.torch")


# ----------------------------------------------------------------------------- in each rank


def status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def child(out: str, argv: list[str]) -> int:
    """One rank: `python -m minitrain ARGV` with the RSS readings around its training phase."""
    sys.path.insert(0, str(ROOT))
    import importlib
    import importlib.util

    for name in PREIMPORT + (("bitsandbytes",) if importlib.util.find_spec("bitsandbytes") else ()):
        importlib.import_module(name)  # their code and tables are not device memory: resident before the baseline
    import minitrain.checkpoint as ckpt
    import minitrain.train as train_mod
    from minitrain import cli
    from minitrain.plan import fit

    seen: dict = {"peak": 0}

    def wrap(owner, name, before=None, after=None):
        fn = getattr(owner, name)

        def wrapped(*a, **k):
            if before:
                before()
            result = fn(*a, **k)
            if after:
                after()
            return result

        setattr(owner, name, wrapped)

    def baseline():
        gc.collect()
        seen["baseline"] = status("VmRSS")
        seen["detail0"] = {k: status(k) for k in ("RssAnon", "RssFile", "RssShmem")}

    def start():
        gc.collect()
        seen["train_start"] = status("VmRSS")
        seen["detail"] = {k: status(k) - seen["detail0"][k] for k in ("RssAnon", "RssFile", "RssShmem")}
        reset_peak()

    def read():
        seen["peak"] = max(seen["peak"], status("VmHWM"))
        seen["file_end"] = status("RssFile") - seen["detail0"]["RssFile"]

    def after_save():
        gc.collect()
        reset_peak()

    wrap(fit, "check", before=baseline)  # the CLI: after joining the process group, before the recipe runs
    wrap(train_mod, "build_optimizer", before=start)  # after loading (and sharding)
    wrap(ckpt, "save", before=read, after=after_save)
    wrap(train_mod, "attach", before=read)  # the loop has ended; unshard and saving follow
    code = cli.run_cli(argv)
    rank = int(os.environ.get("RANK", "0"))
    Path(out, f"rank{rank}.json").write_text(json.dumps({**seen, "rank": rank, "code": code}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter finalisation (gloo's threads; see tests/test_distributed.py)


# ----------------------------------------------------------------------------- the cases


def make_checkpoint(folder: Path, a: argparse.Namespace) -> dict:
    """A random-weight LLaMA-shaped checkpoint, its tokenizer and the data rows; returns config.json."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tools"))
    from bench import make_tokenizer

    hf = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
              num_attention_heads=a.heads, num_key_value_heads=a.kv_heads or a.heads,
              max_position_embeddings=max(2048, a.seq), tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
    torch.manual_seed(0)
    family = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
              "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[a.family]
    family[0](family[1](**hf)).save_pretrained(folder / "model")
    words = make_tokenizer(folder / "model", a.vocab)
    rng = random.Random(0)
    with open(folder / "train.jsonl", "w") as f:
        for _ in range(a.batch * a.steps):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(a.seq + 16))}) + "\n")
    return json.loads((folder / "model" / "config.json").read_text())


def case_args(folder: Path, out: Path, mode: str, a: argparse.Namespace) -> list[str]:
    args = [f"model={folder / 'model'}", f"data={folder / 'train.jsonl'}", f"out={out}", "overwrite=true",
            f"parallel={a.parallel}", "device=cpu", "precision=fp32", "threads=1", f"max_len={a.seq}",
            f"batch_size={a.batch}", "grad_accum=1", f"max_steps={a.steps}", "log_every=1", "save_every=0",
            "warmup=0", "group_by_length=false"]
    return args + {"full": ["finetune=full"], "lora": [f"lora_r={a.lora_r}"],
                   "qlora": [f"lora_r={a.lora_r}", "quantize=nf4"]}[mode]


def plan_peak(recipe: str, args: list[str], world: int) -> tuple[int, str]:
    """(rank 0's planned peak in bytes, its moment): `minitrain plan --device cpu --world N`'s figure."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tools"))
    from plan import load_config, read_model_config

    from minitrain.plan.predict import predict, run_shape, shape_from_hf

    cfg = load_config(recipe, args, {"--world": world})
    hf, _ = read_model_config(cfg)
    plan = predict(shape_from_hf(hf), run_shape(cfg, device="cpu", world=world))
    return plan.peak, plan.peak_moment


def measure(recipe: str, args: list[str], world: int, work: Path) -> list[dict]:
    """Each rank's readings (rank order) from one torchrun."""
    got = work / f"rss-{world}-{abs(hash(tuple(args)))}"
    got.mkdir(parents=True)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(29500 + random.randrange(2000)), str(Path(__file__).resolve()), "--child", str(got), "--",
           recipe, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:  # reported in the table: the last error line of rank 0
        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln and ln.startswith("[rank0]")]
        print(proc.stderr[-4000:], file=sys.stderr)
        return [{"rank": 0, "failed": (errors or ["torchrun failed"])[-1].removeprefix("[rank0]: ")}]
    return [json.loads((got / f"rank{r}.json").read_text()) for r in range(world)]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--modes", default="full,lora", help="full, lora, qlora (an nf4 base: needs bitsandbytes)")
    ap.add_argument("--parallel", default="fsdp", choices=["fsdp", "ddp"])
    ap.add_argument("--family", default="llama", choices=["llama", "qwen2"])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0, help="key / value heads (0: --heads)")
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--write", type=Path, default=None)
    ap.add_argument("--tag", default="plan-ranks", help="the markers' tag in the --write file")
    a = ap.parse_args(argv)
    recipe = str(ROOT / "recipes" / "sft_llama.py")
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan-ranks-") as tmp:
        work = Path(tmp)
        hf = make_checkpoint(work, a)
        size = sum(f.stat().st_size for f in (work / "model").glob("*.safetensors"))
        for mode in a.modes.split(","):
            for world in map(int, a.ranks.split(",")):
                args = case_args(work, work / f"run-{mode}-{world}", mode, a)
                planned, moment = plan_peak(recipe, args, world)
                ranks = measure(recipe, args, world, work)
                # file-backed pages (the mapped checkpoint, library code) are not device memory
                for r in [r for r in ranks if "failed" not in r]:
                    r["loaded"] = r["detail"]["RssAnon"] + r["detail"]["RssShmem"]
                    r["measured"] = r["peak"] - r["train_start"] + r["loaded"]
                rows.append(dict(mode=mode, world=world, planned=planned, moment=moment, ranks=ranks))
                print(json.dumps(rows[-1]), flush=True)
    text = render(a, hf, size, rows, argv)
    print(text)
    if a.write:
        from bench import markers, write_benchmarks

        begin, end = markers(a.tag)
        write_benchmarks(a.write, f"{begin}\n{text}\n{end}", a.tag)
    return 0


def render(a: argparse.Namespace, hf: dict, size: int, rows: list[dict], argv: list[str]) -> str:
    mib = 2**20
    params = size // 4
    lines = [f"Command: `python tools/plan_ranks.py {shlex.join(argv)}` (random-weight "
             f"{ {'llama': 'LLaMA', 'qwen2': 'Qwen2'}[a.family]} shape: hidden {a.hidden}, intermediate {a.ffn}, "
             f"{a.layers} layers, {a.heads} heads ({a.kv_heads or a.heads} key / value), vocab {a.vocab}, "
             f"{params / 1e6:.0f}M parameters; {size / mib:.0f} MiB of fp32 "
             f"safetensors; parallel={a.parallel}, global micro-batch {a.batch} rows x {a.seq} tokens, "
             f"{a.steps} steps, fp32, gloo, one thread per rank). Measured: each rank's peak RSS of the training "
             f"phase above its RSS before loading, file-backed pages (the mapped checkpoint, code) left out; after "
             f"loading: the anonymous memory gained by the time the loop builds its optimizer. Planned: "
             f"`minitrain plan --device cpu --world N` (rank 0's share, the largest).", "",
             "| run | ranks | rank | planned peak (rank 0) | measured peak | planned / measured | measured / one "
             "process | after loading | planned peak moment |", "|---|---|---|---|---|---|---|---|---|"]
    one = {row["mode"]: row["ranks"][0] for row in rows if row["world"] == 1 and "failed" not in row["ranks"][0]}
    for row in rows:
        for r in row["ranks"]:
            mode = {"full": "full fine-tune", "lora": f"LoRA r={a.lora_r} (every linear)",
                    "qlora": f"QLoRA: nf4 base, LoRA r={a.lora_r}"}[row["mode"]]
            if "failed" in r:
                lines.append(f"| {mode} | {row['world']} | - | {row['planned'] / mib:.1f} MiB | the run failed: "
                             f"`{r['failed']}` | | | | |")
                continue
            ref = one.get(row["mode"])
            vs = (f"{r['measured'] / ref['measured']:.2f}x (loaded {r['loaded'] / ref['loaded']:.2f}x)"
                  if ref else "-")
            lines.append(f"| {mode} | {row['world']} | {r['rank']} | {row['planned'] / mib:.1f} MiB | "
                         f"{r['measured'] / mib:.1f} MiB | {row['planned'] / r['measured']:.3f} | {vs} | "
                         f"{r['loaded'] / mib:.1f} MiB | {row['moment']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from minitrain.cli import main_quietly  # a closed pipe (`| head`) ends it quietly

    sys.exit(main_quietly(main, sys.argv[1:]))
