"""minitrain against the HF stack on the same LoRA SFT, DPO, ORPO, KTO, GRPO and reward-model runs (CPU), and QLoRA DPO 7B GPU memory.

    python tools/bench.py [--repeats 3] [--only sft|dpo|orpo|kto|grpo|rm] [--kinds sft,dpo] [--write BENCHMARKS.md] [--cache DIR] [--threads N]
                          [--experts 8 --top-k 2 --expert-ffn 256 --tag moe]   (a Qwen3-MoE shape: LoRA on the experts too)
                          [--steps 10] [--batch 4] [--accum 1] [--dpo-steps 8] [--dpo-batch 2] [--dpo-accum 1]
                          [--max-len 384] [--layers 4] [--dim 256] [--ffn 688] [--heads 4] [--kv-heads 4]
                          [--vocab 32000] [--lora-r 16] [--targets q_proj,k_proj,v_proj,o_proj,...]
    python tools/bench.py --gpu-dpo-7b [--seq 1024] [--dpo-steps 3] [--compile] [--out FILE.json]   (CUDA only)
    python tools/bench.py --profile mt-sft|mt-dpo   (one minitrain run under cProfile: the top functions)
    python tools/bench.py --sampler [--gen-batch 8] [--gen-prompt 32] [--gen-new 64]   (GRPO's sampler vs generate)

What runs (each run a fresh `python` subprocess, so peak RSS and start-up are honest):

- the checkpoint: a LLaMA-shaped model (default 4 layers, hidden 256, vocab 32000) with random
  weights, or with `--experts E` a Qwen3-MoE of that shape (every layer sparse, E experts of
  `--expert-ffn`, top `--top-k` renormalised; LoRA on the attention and on every expert: minitrain's
  `experts.gate_up_proj,experts.down_proj` targets, peft's `target_parameters`),
  saved once by `transformers` (`save_pretrained`, fp32 safetensors) into the cache, with
  a word-level tokenizer (`tokenizer.json`, 32000 ids) whose ids compose (prompt + completion
  tokenizes to prompt ids + completion ids), so both sides see the same token sequences;
- the data: synthetic JSONL made once, variable lengths (prompt and answers 8-200 words), exactly
  one epoch of the run (steps x batch x accumulation rows), so both sides train on the same rows;
- SFT: `python -m minitrain recipes/sft_llama.py ...` against transformers `Trainer` + peft
  `get_peft_model` (the usual HF script: tokenized with the same rule, `DataCollatorForSeq2Seq`
  padding to the batch's longest);
- DPO: `python -m minitrain recipes/dpo_mistral.py ...` (fresh adapter: reference = adapter off)
  against trl `DPOTrainer` + peft (`ref_model=None`: the reference is the adapter-disabled model);
- ORPO (`--kinds orpo`): `recipes/dpo_mistral.py loss_type=orpo sft_weight=1` (no reference, one
  forward per pair) against `trl.experimental.orpo.ORPOTrainer` + peft, on the DPO pairs;
- KTO (`--kinds kto`): `recipes/kto_mistral.py` (reference = adapter off) against
  `trl.experimental.kto.KTOTrainer` + peft (`ref_model=None`), on the DPO pairs unpaired (each pair
  gives its chosen answer, label true, and its rejected one, label false: 2 x pairs rows per step);
  TRL's KTO requires sequential sampling (its KL rows are fixed neighbours), so its HF side runs
  `train_sampling_strategy="sequential"`; minitrain shuffles as for the other kinds;
- reward model (`--kinds rm`): `recipes/reward_model.py` (LoRA + the scalar head, `modules_to_save=score`)
  against `trl.RewardTrainer` + peft (`AutoModelForSequenceClassification`, num_labels 1, task SEQ_CLS,
  `modules_to_save=["score"]`), on the DPO pairs (prompt + answer, both sides: no row is cut or dropped);
  `--shared-prompt` runs minitrain's DPO and reward model with `shared_prompt=true` (one row [prompt,
  chosen rest, rejected rest] per pair, exact; TRL has no such layout, its side is unchanged);
- GRPO (`--kinds grpo`): `recipes/grpo_qwen.py` against `trl.GRPOTrainer` + peft on the demo's toy
  task and tiny model (demo/grpo: "the last digit of a sum", the recipe's `last_digit` reward on both
  sides), the same prompts per step, G, max_completion_length, temperature 1, loss dapo, beta 0 (no
  reference); throughput in completions (prompts x G per step) per second and per CPU-second;
- the same on both: fp32 on CPU, batch, accumulation, steps, max_len, LoRA r / alpha / dropout 0 /
  targets, constant LR, no warmup, AdamW (torch, foreach), grad clip 1.0, no eval, no saving
  during the run (minitrain writes its final checkpoint and adapter after the last step, outside
  the timed steps), dataloader workers 0, no gradient checkpointing (TRL's DPOConfig defaults it on: set off),
  logging every step on both sides (minitrain writes metrics.jsonl each step; HF logging_steps=1),
  no length grouping on either side (minitrain `group_by_length=false`, its default is true; HF
  `train_sampling_strategy="random"`, its default),
  the same thread count (OMP_NUM_THREADS);
- runs interleaved: mt, hf, hf, mt, mt, hf ... (`--repeats` each); medians reported.

Measured per run, by this parent process:

- time to first step: from just before the subprocess starts to the moment its first optimizer
  step is on disk (minitrain: the first line of out/metrics.jsonl; HF: a `TrainerCallback`'s
  `on_step_end` line), polled every 5 ms: interpreter start, imports, loading, tokenizing and
  step 1 are all inside;
- throughput over steps 2..N (step 1 excluded: warm-up): SFT tokens/s = non-padding input tokens
  processed (sum of the attention masks of every micro-batch, the same definition on both sides,
  counted by minitrain's loop and by a forward pre-hook on HF's model, grad-enabled forwards
  only) / seconds between the end of step 1 and the end of step N; DPO and ORPO pairs/s = pairs per
  step x (N - 1) / the same seconds; KTO rows/s the same with its rows (2 x pairs per step);
- peak memory: the child's peak RSS (`os.wait4` rusage `ru_maxrss`), libraries included;
- the same in CPU-seconds (user + system time of the child, all threads, read from /proc/PID/stat
  when each step line appears): on a shared machine wall-clock swings with the other jobs' load,
  the CPU time a run needs much less, so the CPU-time ratios are the steadier comparison
  (`--threads 1`, the default, keeps spinning worker threads out of it).

Results print as medians and ratios minitrain / HF; `--write` puts them, the machine (CPU, cores,
RAM, load average), versions and the exact command into BENCHMARKS.md between the
`<!-- bench:begin -->` / `<!-- bench:end -->` markers (the analysis around them is kept).
Needs the bench extra (transformers, peft, trl, datasets, accelerate, psutil).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
NAN = float("nan")
UNITS = {"dpo": "pairs", "orpo": "pairs", "kto": "rows", "grpo": "completions", "rm": "pairs"}
GRPO_DEMO = ROOT / "demo" / "grpo"  # GRPO's toy task and tiny model, the same on both sides  # what a preference kind's throughput counts
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"]


# ----------------------------------------------------------------------------- setup (once, cached)


# Bumped whenever `prepare` writes other files, so that an older cache is made again rather than
# reused (2: the tokenizer's add_bos_token true, which minitrain reads since 2888a34; 3: its post-processor
# adds bos too, as the flag says).
CACHE_VERSION = 3


def shape_key(a: argparse.Namespace) -> str:
    keys = ("layers", "dim", "ffn", "heads", "kv_heads", "vocab", "steps", "batch", "accum", "dpo_steps",
            "dpo_batch", "dpo_accum", "max_len", "seed", "experts", "top_k", "expert_ffn")
    blob = json.dumps({"cache_version": CACHE_VERSION, **{k: getattr(a, k) for k in keys}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def words(vocab: int) -> list[str]:
    """vocab - 4 distinct lower-case pseudo-words (syllables), deterministic."""
    rng = random.Random(1234)
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    out, seen = [], set()
    while len(out) < vocab - len(SPECIALS):
        w = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 4)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def make_tokenizer(folder: Path, vocab: int) -> list[str]:
    """A word-level `tokenizer.json` with `vocab` ids (<pad> 0, <s> 1, </s> 2, <unk> 3) + HF configs."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors

    w = words(vocab)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + w)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    # bos before each text, as add_bos_token says (transformers 5 follows this post-processor, not the flag)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
           "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
           "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "special_tokens_map.json").write_text(json.dumps({k: cfg[k] for k in
                                                                ("bos_token", "eos_token", "pad_token", "unk_token")}))
    return w


def text(rng: random.Random, vocab_words: list[str], lo: int, hi: int) -> str:
    n = rng.randint(lo, hi)
    # Zipf-like word frequencies, so the embedding rows used look like real text's
    return " ".join(vocab_words[min(int(rng.paretovariate(1.1)) - 1, len(vocab_words) - 1)] for _ in range(n))


def prepare(a: argparse.Namespace) -> dict:
    """The cached checkpoint folder and the two JSONL files; made once per shape."""
    cache = Path(a.cache) / shape_key(a)
    done = cache / "ready.json"
    if done.is_file():
        info = json.loads(done.read_text())
        if "kto" not in info:  # a cache made before the KTO rows existed
            info["kto"] = unpaired(Path(info["dpo"]))
            done.write_text(json.dumps(info))
        return info
    cache.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    folder = cache / "model"
    folder.mkdir(exist_ok=True)
    shape = dict(vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                 num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                 max_position_embeddings=max(2048, a.max_len), tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0)
    torch.manual_seed(a.seed)
    if a.experts:  # Qwen3-MoE: every layer sparse (no mlp_only_layers)
        cfg = transformers.Qwen3MoeConfig(**shape, head_dim=a.dim // a.heads, num_experts=a.experts,
                                          num_experts_per_tok=a.top_k, moe_intermediate_size=a.expert_ffn,
                                          norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    model.save_pretrained(folder, safe_serialization=True)
    vocab_words = make_tokenizer(folder, a.vocab)
    rng = random.Random(a.seed)
    half = (a.max_len - 2) // 2
    sft = cache / "sft.jsonl"
    with open(sft, "w") as f:
        for _ in range(a.steps * a.batch * a.accum):
            f.write(json.dumps({"prompt": text(rng, vocab_words, 8, min(200, half)),
                                "completion": text(rng, vocab_words, 8, min(200, half))}) + "\n")
    dpo = cache / "dpo.jsonl"
    third = (a.max_len - 2) // 3
    with open(dpo, "w") as f:
        for _ in range(a.dpo_steps * a.dpo_batch * a.dpo_accum):
            f.write(json.dumps({"prompt": text(rng, vocab_words, 8, min(200, half)),
                                "chosen": text(rng, vocab_words, 8, min(150, third)),
                                "rejected": text(rng, vocab_words, 8, min(150, third))}) + "\n")
    info = {"model": str(folder), "sft": str(sft), "dpo": str(dpo),
            "params": sum(p.numel() for p in model.parameters())}
    info["kto"] = unpaired(dpo)
    done.write_text(json.dumps(info))
    return info


def unpaired(dpo: Path) -> str:
    """KTO's rows from the DPO pairs: the chosen answer (label true), then the rejected one (false)."""
    kto = dpo.with_name("kto.jsonl")
    with open(dpo) as f, open(kto, "w") as g:
        for line in f:
            r = json.loads(line)
            for answer, label in (("chosen", True), ("rejected", False)):
                g.write(json.dumps({"prompt": r["prompt"], "completion": r[answer], "label": label}) + "\n")
    return str(kto)


# ----------------------------------------------------------------------------- one run


def mt_command(kind: str, a: argparse.Namespace, info: dict, out: Path) -> list[str]:
    """The exact `python -m minitrain ...` command line of a minitrain run."""
    common = [f"model={info['model']}", f"out={out}", f"max_len={a.max_len}", f"lora_r={a.lora_r}",
              f"lora_alpha={2 * a.lora_r}", "lora_dropout=0.0", f"lora_targets={','.join(a.targets)}",
              f"lr={a.lr}", "warmup=0", "schedule=constant", "precision=fp32", "device=cpu", "log_every=1",
              "save_every=0", "max_grad_norm=1.0", "weight_decay=0.0", f"seed={a.seed}", "overwrite=true",
              "checkpointing=false",
              "group_by_length=false"]  # as HF's default sampler: both sides see the same shuffled, ungrouped batches
    if kind == "sft":
        return [sys.executable, "-m", "minitrain", "recipes/sft_llama.py", f"data={info['sft']}", "eval_data=",
                f"max_steps={a.steps}", f"batch_size={a.batch}", f"grad_accum={a.accum}", *common]
    if kind == "kto":
        return [sys.executable, "-m", "minitrain", "recipes/kto_mistral.py", f"data={info['kto']}", "eval_data=",
                f"max_steps={a.dpo_steps}", f"batch_size={2 * a.dpo_batch}", f"grad_accum={a.dpo_accum}", "beta=0.1",
                *common]
    shared = ["shared_prompt=true"] if a.shared_prompt and kind in ("dpo", "rm") else []
    if kind == "rm":
        return [sys.executable, "-m", "minitrain", "recipes/reward_model.py", f"data={info['dpo']}", "eval_data=",
                f"max_steps={a.dpo_steps}", f"batch_size={a.dpo_batch}", f"grad_accum={a.dpo_accum}", *shared, *common]
    if kind == "grpo":  # the demo's toy task and model (demo/grpo), not the bench checkpoint
        return [sys.executable, "-m", "minitrain", "recipes/grpo_qwen.py", f"model={GRPO_DEMO / 'model'}",
                f"data={GRPO_DEMO / 'train.jsonl'}", "eval_data=", "rewards=last_digit", f"out={out}",
                f"max_steps={a.grpo_steps}", f"batch_size={a.grpo_prompts}", f"num_generations={a.grpo_g}",
                f"max_completion_length={a.grpo_len}", "max_len=64", "temperature=1.0", "loss_type=dapo", "beta=0.0",
                "lora_r=8", "lora_alpha=16", "lora_dropout=0.0", "lora_targets=q_proj,k_proj,v_proj,o_proj",
                "lr=2e-3", "warmup=0", "schedule=constant", "precision=fp32", "device=cpu", "log_every=1",
                "save_every=0", "max_grad_norm=1.0", "weight_decay=0.0", f"seed={a.seed}", "overwrite=true",
                "checkpointing=false", "grad_accum=1", "log_completions_every=0", "group_by_length=false"]
    loss = ["loss_type=orpo", "sft_weight=1.0"] if kind == "orpo" else ["loss_type=sigmoid", "sft_weight=0.0"]
    return [sys.executable, "-m", "minitrain", "recipes/dpo_mistral.py", f"data={info['dpo']}", "eval_data=",
            f"max_steps={a.dpo_steps}", f"batch_size={a.dpo_batch}", f"grad_accum={a.dpo_accum}", "beta=0.1",
            *loss, *shared, *common]


def hf_spec(kind: str, a: argparse.Namespace, info: dict, out: Path) -> dict:
    if kind == "grpo":
        return {"kind": kind, "model": str(GRPO_DEMO / "model"), "data": str(GRPO_DEMO / "train.jsonl"),
                "out": str(out), "steps": a.grpo_steps, "batch": a.grpo_prompts * a.grpo_g, "g": a.grpo_g,
                "completion_len": a.grpo_len, "accum": 1, "max_len": 64, "lora_r": 8,
                "targets": ["q_proj", "k_proj", "v_proj", "o_proj"], "lr": 2e-3, "seed": a.seed}
    sft = kind == "sft"
    data = info["sft"] if sft else info["kto"] if kind == "kto" else info["dpo"]
    experts = [t for t in a.targets if t.startswith("experts.")]  # peft's target_parameters (under mlp.)
    return {"kind": kind, "model": info["model"], "data": data, "out": str(out),
            "target_parameters": [f"mlp.{t}" for t in experts],
            "steps": a.steps if sft else a.dpo_steps,
            "batch": a.batch if sft else 2 * a.dpo_batch if kind == "kto" else a.dpo_batch,
            "accum": a.accum if sft else a.dpo_accum, "max_len": a.max_len, "lora_r": a.lora_r,
            "targets": [t for t in a.targets if t not in experts], "lr": a.lr, "seed": a.seed}


def child_env(a: argparse.Namespace, side: str = "") -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if side == "mt":
        for kv in a.mt_env:  # experiments: e.g. a sitecustomize on PYTHONPATH that patches a proposed fix in
            key, _, value = kv.partition("=")
            env[key] = value + (os.pathsep + env[key] if key == "PYTHONPATH" and env.get(key) else "")
    return env


def timed_run(cmd: list[str], steps_file: Path, log_file: Path, env: dict) -> dict:
    """Run `cmd`; return the arrival times of its step lines, their rows, peak RSS and exit code.

    The child is waited for with `os.wait4`, which gives its own rusage (`ru_maxrss`: its peak
    RSS), while its step file is read every 5 ms; a line's time is when it was first seen.
    If this parent is interrupted, the child is killed rather than left running.
    """
    steps_file.parent.mkdir(parents=True, exist_ok=True)
    steps_file.unlink(missing_ok=True)
    rows: list[dict] = []
    times: list[float] = []
    cpu: list[float] = []
    buf, pos, usage, status = "", 0, None, 0
    with open(log_file, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                now = time.perf_counter() - t0
                if steps_file.is_file():
                    with open(steps_file) as f:
                        f.seek(pos)
                        buf += f.read()
                        pos = f.tell()
                    while "\n" in buf:
                        line, buf = buf.split("\n", 1)
                        if line.strip():
                            rows.append(json.loads(line))
                            times.append(now)
                            cpu.append(cpu_seconds(proc.pid))
                if pid:
                    break
                time.sleep(0.005)
        except BaseException:
            proc.kill()  # interrupted: do not leave the run behind
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": proc.returncode, "times": times, "cpu": cpu, "rows": rows, "wall": time.perf_counter() - t0,
            "cpu_total": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process `pid` has used so far, all threads (/proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, IndexError, ValueError):
        return float("nan")


def summarize(kind: str, side: str, r: dict, pairs_per_step: int) -> dict:
    times, rows, cpu = r["times"], r["rows"], r.get("cpu") or [NAN] * len(r["times"])
    out = {"side": side, "rc": r["rc"], "wall_s": r["wall"], "peak_rss_mb": r["peak_rss_mb"], "steps": len(rows),
           "times": times, "cpu": cpu}
    if r["rc"] != 0 or len(rows) < 2:
        return out
    tokens = [row["tokens"] for row in rows]  # non-pad input tokens of each optimizer step
    span, cpu_span = times[-1] - times[0], cpu[-1] - cpu[0]
    # steps seen in the same poll (a tiny model, a loaded machine) give span 0: no rate, not a crash
    per_s = lambda n, dt: n / dt if dt > 0 else NAN  # noqa: E731
    out.update(first_step_s=times[0], steady_s_per_step=span / (len(rows) - 1),
               tokens_per_s=per_s(sum(tokens[1:]), span), tokens_total=sum(tokens),
               cpu_first_step_s=cpu[0], cpu_s_per_step=cpu_span / (len(rows) - 1),
               tokens_per_cpu_s=per_s(sum(tokens[1:]), cpu_span))
    if kind in UNITS:  # preference kinds: pairs (rows for KTO) per second
        unit = UNITS[kind]
        out[f"{unit}_per_s"] = per_s(pairs_per_step * (len(rows) - 1), span)
        out[f"{unit}_per_cpu_s"] = per_s(pairs_per_step * (len(rows) - 1), cpu_span)
    return out


def run_one(kind: str, side: str, a: argparse.Namespace, info: dict, rep: int) -> dict:
    work = Path(a.cache) / shape_key(a) / "runs" / f"{a.tag + '-' if a.tag else ''}{kind}-{side}-{rep}"
    work.mkdir(parents=True, exist_ok=True)
    if side == "mt":
        out = work / "out"
        cmd = mt_command(kind, a, info, out)
        steps_file = out / "metrics.jsonl"
    else:
        spec = hf_spec(kind, a, info, work / "hf_out")
        (work / "spec.json").write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(work / "spec.json")]
        steps_file = work / "hf_out" / "steps.jsonl"
    r = timed_run(cmd, steps_file, work / "log.txt", child_env(a, side))
    pairs = a.grpo_prompts * a.grpo_g if kind == "grpo" else a.dpo_batch * a.dpo_accum * (2 if kind == "kto" else 1)
    s = summarize(kind, side, r, pairs)
    s["command"] = cmd
    if r["rc"] != 0:
        tail = (work / "log.txt").read_text()[-3000:]
        print(f"  {kind} {side} run {rep} FAILED (exit {r['rc']}); log {work / 'log.txt'}:\n{tail}", flush=True)
    else:
        print(f"  {kind} {side} run {rep}: first step {s.get('first_step_s', float('nan')):.2f}s, "
              f"{s.get('tokens_per_s', float('nan')):.0f} tok/s"
              + "".join(f", {s[u + '_per_s']:.2f} {u}/s" for u in ("pairs", "rows") if u + "_per_s" in s)
              + f", peak RSS {s['peak_rss_mb']:.0f} MiB, {s['steps']} steps", flush=True)
    return s


# ----------------------------------------------------------------------------- the HF worker


def hf_worker(spec_path: str) -> int:
    """One HF run (in its own process): Trainer + peft (SFT) or trl DPOTrainer + peft (DPO)."""
    spec = json.loads(Path(spec_path).read_text())
    import torch
    import transformers
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    clock = open(out / "steps.jsonl", "w", buffering=1)
    seen = {"tokens": 0, "padded": 0, "last": 0}

    def count_tokens(module, args, kwargs):
        """Non-pad tokens of each training forward (the reference forward runs under no_grad: skipped).

        Counted at the forward, not in the collator: the Trainer fetches micro-batches ahead."""
        mask = kwargs.get("attention_mask")
        if torch.is_grad_enabled() and mask is not None:
            seen["tokens"] += int(mask.sum())
            seen["padded"] += int(mask.numel())

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            tokens = seen["tokens"] - seen["last"]
            seen["last"] = seen["tokens"]
            clock.write(json.dumps({"step": state.global_step, "tokens": tokens, "padded": seen["padded"]}) + "\n")
            clock.flush()

    rows = [json.loads(line) for line in open(spec["data"]) if line.strip()]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    if spec["kind"] == "rm":  # a scalar head on the causal checkpoint, as TRL's RewardTrainer loads one
        model = AutoModelForSequenceClassification.from_pretrained(spec["model"], num_labels=1, dtype=torch.float32,
                                                                   pad_token_id=tok.pad_token_id)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    if spec["kind"] == "grpo":
        rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows[: spec["steps"] * spec["batch"]]]
    lora = LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], lora_dropout=0.0,
                      target_modules=spec["targets"], target_parameters=spec.get("target_parameters") or None,
                      task_type="SEQ_CLS" if spec["kind"] == "rm" else "CAUSAL_LM",
                      modules_to_save=["score"] if spec["kind"] == "rm" else None)
    common = dict(output_dir=str(out / "trainer"), per_device_train_batch_size=spec["batch"],
                  gradient_accumulation_steps=spec["accum"], max_steps=spec["steps"], learning_rate=spec["lr"],
                  lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                  optim="adamw_torch", logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
                  train_sampling_strategy="random",
                  use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0, dataloader_pin_memory=False,
                  seed=spec["seed"], gradient_checkpointing=False)
    if spec["kind"] == "sft":
        bos, eos = tok.bos_token_id, tok.eos_token_id

        def tokenize(row):
            p = [bos] + tok(row["prompt"], add_special_tokens=False)["input_ids"]
            c = tok(row["completion"], add_special_tokens=False)["input_ids"] + [eos]
            ids = (p + c)[: spec["max_len"]]
            return {"input_ids": ids, "labels": ([-100] * len(p) + c)[: spec["max_len"]]}

        ds = Dataset.from_list(rows).map(tokenize, remove_columns=["prompt", "completion"])
        model = get_peft_model(model, lora)
        args = transformers.TrainingArguments(remove_unused_columns=False, **common)
        collator = transformers.DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                                       callbacks=[StepClock()])
    elif spec["kind"] == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        from recipes.grpo_qwen import last_digit

        common["train_sampling_strategy"] = "random"
        args = GRPOConfig(num_generations=spec["g"], max_completion_length=spec["completion_len"], temperature=1.0,
                          beta=0.0, loss_type="dapo", log_completions=False, **common)
        trainer = GRPOTrainer(model=model, reward_funcs=last_digit, args=args, train_dataset=Dataset.from_list(rows),
                              processing_class=tok, peft_config=lora, callbacks=[StepClock()])
    elif spec["kind"] == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        args = ORPOConfig(beta=0.1, max_length=spec["max_len"], **common)
        trainer = ORPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                              peft_config=lora, callbacks=[StepClock()])
    elif spec["kind"] == "rm":
        from trl import RewardConfig, RewardTrainer

        args = RewardConfig(max_length=spec["max_len"], **common)
        trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                                peft_config=lora, callbacks=[StepClock()])
    elif spec["kind"] == "kto":
        from trl.experimental.kto import KTOConfig, KTOTrainer

        common["train_sampling_strategy"] = "sequential"  # TRL's KTO requires it (its KL rows are fixed neighbours)
        args = KTOConfig(beta=0.1, max_length=spec["max_len"], precompute_ref_log_probs=False, **common)
        trainer = KTOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                             peft_config=lora, callbacks=[StepClock()])
    else:
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(beta=0.1, loss_type=["sigmoid"], max_length=spec["max_len"], precompute_ref_log_probs=False,
                         **common)
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                             peft_config=lora, callbacks=[StepClock()])
    trainer.model.register_forward_pre_hook(count_tokens, with_kwargs=True)
    trainer.train()
    clock.close()
    return 0


# ----------------------------------------------------------------------------- report


def machine() -> dict:
    cpu = platform.processor() or "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "os": platform.platform()}
    try:
        import psutil

        info["ram_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return info


def versions() -> dict:
    out = {}
    code = ("import json,importlib.metadata as m\nd={}\nfor p in ('torch','transformers','peft','trl','accelerate',"
            "'datasets'):\n  try: d[p]=m.version(p)\n  except Exception: d[p]=None\nimport minitrain\n"
            "d['minitrain']=minitrain.__version__\nprint(json.dumps(d))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        pass
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        out["git"] = sha.stdout.strip()
    except OSError:
        pass
    return out


def import_times(env: dict) -> dict:
    """Seconds to import what each side's command imports before any work (fresh interpreter, best of 3)."""
    probes = {"minitrain (cli + sft recipe imports)": "import minitrain.cli, models, minitrain.run, minitrain.train, "
                                                      "minitrain.objectives.sft, minitrain.data.readers",
              "torch alone": "import torch",
              "HF (transformers Trainer + peft + trl + datasets)": "import transformers, peft, trl, datasets; "
                                                                   "from transformers import Trainer; "
                                                                   "from trl import DPOTrainer"}
    out = {}
    for name, stmt in probes.items():
        best = float("inf")
        for _ in range(3):
            code = f"import time; t=time.perf_counter(); {stmt}; print(time.perf_counter()-t)"
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
            try:
                best = min(best, float(r.stdout.strip().splitlines()[-1]))
            except (ValueError, IndexError):
                pass
        out[name] = best
    return out


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else NAN


def table(results: dict, kind: str, moe: bool = False) -> list[str]:
    mt = [r for r in results[kind]["mt"] if r["rc"] == 0]
    hf = [r for r in results[kind]["hf"] if r["rc"] == 0]
    speed = (">= 3x" if moe else ">= 1.5x") if kind == "sft" else ""  # issue 40's goals for the MoE shape
    metrics = [("tokens/s (non-pad input tokens, steps 2..N)", "tokens_per_s", "" if moe else speed),
               ("tokens per CPU-second (steps 2..N)", "tokens_per_cpu_s", speed)]
    if kind in UNITS:
        u, goal = UNITS[kind], ">= 2x" if kind == "dpo" else ""
        metrics += [(f"{u}/s (steps 2..N)", f"{u}_per_s", goal),
                    (f"{u} per CPU-second (steps 2..N)", f"{u}_per_cpu_s", goal)]
    if kind in ("grpo", "rm"):  # issue 43: per CPU-second, >= 2x TRL
        metrics[-2:] = [(n, k, ">= 2x" if k.endswith("per_cpu_s") else g) for n, k, g in metrics[-2:]]
    goals = kind in ("sft", "dpo")  # the goals were set for these two
    memory = "<= 0.5x" if kind == "grpo" or (moe and kind == "sft") else "<= 0.6x" if goals else ""
    metrics += [("peak RSS (MiB)", "peak_rss_mb", memory),
                ("time to first step (s)", "first_step_s", "<= 0.5x" if goals else ""),
                ("CPU-seconds to first step", "cpu_first_step_s", "<= 0.5x" if goals else ""),
                ("seconds per step (steps 2..N)", "steady_s_per_step", ""),
                ("CPU-seconds per step (steps 2..N)", "cpu_s_per_step", "")]
    lines = [f"| {kind.upper()} | minitrain | HF | minitrain / HF | goal | runs (mt, hf) |",
             "|---|---|---|---|---|---|"]
    for name, key, goal in metrics:
        m, h = med([r.get(key) for r in mt]), med([r.get(key) for r in hf])
        ratio = m / h if h and h == h and m == m else NAN
        spread = " / ".join(", ".join(f"{r.get(key, NAN):.3g}" for r in side) for side in (mt, hf))
        lines.append(f"| {name} | {m:.4g} | {h:.4g} | **{ratio:.2f}x** | {goal} | {spread} |")
    tok_m, tok_h = med([r.get("tokens_total") for r in mt]), med([r.get("tokens_total") for r in hf])
    lines.append(f"| tokens processed in the run (non-pad) | {tok_m:.0f} | {tok_h:.0f} | {tok_m / tok_h:.3f} "
                 f"| same data | |")
    return lines


def markers(tag: str = "") -> tuple[str, str]:
    """The comment lines that delimit a generated block in BENCHMARKS.md (one pair per --tag)."""
    return (BEGIN, END) if not tag else (BEGIN.replace(" -->", f" {tag} -->"), END.replace(" -->", f" {tag} -->"))


def render(a: argparse.Namespace, results: dict, info: dict, argv: list[str], extra: dict) -> str:
    mach, ver = extra["machine"], extra["versions"]
    begin, end = markers(getattr(a, "tag", ""))
    lines = [begin, "",
             f"Measured {extra['date']} on {mach['cpu']}, {mach['cores']} cores, {mach.get('ram_gib', '?')} GiB RAM, "
             f"{mach['os']}, Python {mach['python']}; load average before / after: {extra['load_before']} / "
             f"{extra['load_after']} (shared machine: other jobs ran at the same time, so absolute figures are noisy; "
             f"runs were interleaved and medians are reported).",
             "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()),
             "",
             f"Command: `python tools/bench.py {' '.join(shlex.quote(x) for x in argv)}`",
             "",
             (f"Checkpoint: Qwen3-MoE-shaped, {a.layers} layers (all sparse), hidden {a.dim}, {a.experts} experts of "
              f"intermediate {a.expert_ffn}, top {a.top_k} renormalised" if a.experts else
              f"Checkpoint: LLaMA-shaped, {a.layers} layers, hidden {a.dim}, intermediate {a.ffn}")
             + f", {a.heads} heads ({a.kv_heads} kv), vocab {a.vocab}: {info['params']:,} parameters, fp32; LoRA "
             f"r={a.lora_r} alpha={2 * a.lora_r} dropout 0 on {','.join(a.targets)}"
             + (" (HF: peft's target_modules for the linears, target_parameters for the experts)" if a.experts else "")
             + f"; {a.threads} threads.",
             f"SFT: {a.steps} steps x batch {a.batch} x accumulation {a.accum}, max_len {a.max_len}. "
             f"DPO: {a.dpo_steps} steps x {a.dpo_batch} pairs x accumulation {a.dpo_accum}, beta 0.1, sigmoid"
             + ("; ORPO: the same pairs, beta (lambda) 0.1, no reference" if "orpo" in results else "")
             + (f"; KTO: the same pairs unpaired, {2 * a.dpo_batch} rows x accumulation {a.dpo_accum} per step, "
                f"beta 0.1, weights 1 / 1, reference = adapter off (HF: sequential sampling, as TRL's KTO requires)"
                if "kto" in results else "")
             + (f"; GRPO: the demo's toy task and model (demo/grpo, {a.grpo_steps} steps x {a.grpo_prompts} prompts x "
                f"G={a.grpo_g}, up to {a.grpo_len} new tokens, temperature 1, dapo, beta 0, LoRA r=8 on q,k,v,o; "
                f"tokens: minitrain counts prompt tokens, HF the policy forward's; compare completions)"
                if "grpo" in results else "")
             + (f"; reward model: the same pairs, {a.dpo_batch} pairs x accumulation {a.dpo_accum} per step, LoRA + "
                f"the scalar head (modules_to_save score; HF: AutoModelForSequenceClassification, TRL's RewardTrainer)"
                if "rm" in results else "")
             + ("; minitrain's DPO and reward model with shared_prompt=true (one row [prompt, chosen rest, rejected "
                "rest] per pair; TRL's two rows)" if a.shared_prompt else "") + ".",
             ""]
    for kind in results:
        lines += table(results, kind, moe=bool(a.experts)) + [""]
    if extra.get("imports"):
        lines += ["Import time (fresh interpreter, best of 3): " + "; ".join(
            f"{k} {v:.2f}s" for k, v in extra["imports"].items()), ""]
    if extra.get("padding"):
        lines += [extra["padding"], ""]
    lines.append(end)
    return "\n".join(lines)


def write_benchmarks(path: Path, block: str, tag: str = "") -> None:
    """Put `block` between its markers in `path` (appended when they are not there yet); the rest is kept."""
    begin, end = markers(tag)
    old = path.read_text() if path.is_file() else "# Benchmarks\n\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + block + old[old.index(end) + len(end):]
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(new)
    tmp.replace(path)


def padding_note(a: argparse.Namespace, info: dict) -> str:
    """How much of minitrain's SFT micro-batches is padding, with and without length grouping (its Batcher)."""
    sys.path.insert(0, str(ROOT))
    from minitrain.data.batcher import Batcher
    from minitrain.data.readers import read_sft
    from minitrain.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(info["model"])
    ex = read_sft(info["sft"], tok, max_len=a.max_len)
    lengths = [len(e["input_ids"]) for e in ex]
    out = []
    for group in (False, True):
        b = Batcher(lengths, a.batch, seed=a.seed, shuffle=True, group_by_length=group)
        real = padded = 0
        for batch in b.epoch_batches(0):
            ls = [lengths[i] for i in batch]
            real += sum(ls)
            padded += max(ls) * len(ls)
        out.append(f"{'grouped' if group else 'as run (no grouping)'}: {1 - real / padded:.1%} padding")
    return ("Padding in minitrain's SFT micro-batches (its Batcher, same seed; HF pads to the batch's longest too, "
            "and its sampler shuffles differently): "
            + "; ".join(out) + ".")


# ----------------------------------------------------------------------------- the sampler


def sampler_bench(a: argparse.Namespace) -> int:
    """GRPO's batched sampler against transformers' `generate` on the bench checkpoint: the same model
    weights, a batch of `--gen-batch` left-padded prompts, `--gen-new` new tokens each (greedy, no eos, so
    both decode every step), each side with its KV cache (transformers: its default dynamic cache), in this
    one process on `--threads` threads; CPU-seconds (process time) per call, median of `--repeats`
    interleaved calls; both sides' tokens are checked equal."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    import models
    from minitrain.objectives.sampling import sample
    from minitrain.weights import load_pretrained

    torch.set_num_threads(a.threads)
    info = prepare(a)
    ours = load_pretrained(info["model"], models.from_hf_config)
    hf = transformers.AutoModelForCausalLM.from_pretrained(info["model"], dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(a.seed)
    B, P, n = a.gen_batch, a.gen_prompt, a.gen_new
    ids = torch.randint(3, a.vocab, (B, P), generator=g)
    mask = torch.ones_like(ids)
    for i in range(B):  # left padding: row i has i * P // (2 * B) pads
        mask[i, : i * P // (2 * B)] = 0
    ids = ids.masked_fill(mask == 0, 0)
    times: dict[str, list[float]] = {"minitrain": [], "transformers": []}
    outs = {}
    for rep in range(a.repeats + 1):  # the first call of each side warms up, uncounted
        for side in (("minitrain", "transformers") if rep % 2 == 0 else ("transformers", "minitrain")):
            t0 = time.process_time()
            with torch.no_grad():
                if side == "minitrain":
                    out = sample(ours, ids, mask, new_cache=models.family(ours).KVCache, max_new_tokens=n,
                                 greedy=True, eos_ids=[], pad_id=0).ids
                else:
                    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                      pad_token_id=0)[:, P:]
            if rep:
                times[side].append(time.process_time() - t0)
            outs[side] = out
    same = torch.equal(outs["minitrain"], outs["transformers"])
    tps = {k: B * n / med(v) for k, v in times.items()}
    print(f"sampler: batch {B}, prompts {P} tokens (left-padded), {n} new tokens, greedy, {a.threads} thread(s), "
          f"median of {a.repeats}: minitrain {tps['minitrain']:.0f} tok per CPU-s, transformers generate "
          f"{tps['transformers']:.0f} ({tps['minitrain'] / tps['transformers']:.2f}x); tokens equal: {same}")
    return 0 if same else 1


# ----------------------------------------------------------------------------- profile


def profile_run(a: argparse.Namespace, kind: str) -> int:
    info = prepare(a)
    work = Path(a.cache) / shape_key(a) / "runs" / f"profile-{kind}"
    work.mkdir(parents=True, exist_ok=True)
    cmd = mt_command(kind.removeprefix("mt-"), a, info, work / "out")
    cmd = [cmd[0], "-m", "cProfile", "-o", str(work / "run.prof"), *cmd[1:]]
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, env=child_env(a), capture_output=True, text=True)
    if r.returncode:
        print(r.stdout[-2000:], r.stderr[-2000:])
        return r.returncode
    import pstats

    st = pstats.Stats(str(work / "run.prof"))
    st.sort_stats("cumulative").print_stats(35)
    st.sort_stats("tottime").print_stats(25)
    return 0


# ----------------------------------------------------------------------------- QLoRA DPO 7B on a GPU


MISTRAL_7B = dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
TINY_MISTRAL = dict(MISTRAL_7B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def gpu_dpo_7b(a: argparse.Namespace) -> int:
    """Peak GPU memory of QLoRA DPO on a Mistral-7B-shaped model with random weights, vs the plan.

    nf4 base (double quantization, bf16 compute, head and embeddings in bf16), LoRA r=16 alpha 32
    on `--targets` (fp32), checkpointing on, one pair per micro-batch of `--seq` tokens (prompt
    half, answers of different lengths so the batch is padded), reference = the adapter disabled,
    `--dpo-steps` optimizer steps through `minitrain.train.train` (the real loop, minitrain.optim.AdamW).
    Weights are drawn on the GPU one linear at a time and quantized by minitrain's loader hook as
    it would quantize a checkpoint's tensors: no 14 GB file and no full-precision model in memory.
    """
    import torch

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("skipped: --gpu-dpo-7b needs a CUDA device and torch.cuda.is_available() is False here "
              "(run it on a GPU machine: python tools/bench.py --gpu-dpo-7b)")
        return 0
    sys.path.insert(0, str(ROOT))
    import models
    from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
    from minitrain.adapters.quant import quantize_hook
    from minitrain.objectives.dpo import DPOConfig, make_dpo_objective
    from minitrain.objectives.reference import make_reference
    from minitrain.plan.decoder import ModelShape
    from minitrain.plan.predict import predict
    from minitrain.plan.run_shape import RunShape
    from minitrain.train import train

    hf = TINY_MISTRAL if a.tiny else MISTRAL_7B
    dtype = torch.bfloat16
    torch.manual_seed(0)
    with torch.device("meta"):
        model = models.from_hf_config(hf)
    hook = quantize_hook("nf4", compute_dtype=dtype)
    for name, p in list(model.named_parameters()):  # draw each tensor where it lives, quantize the linears
        w = torch.randn(p.shape, dtype=dtype, device=device) * (0.02 if p.dim() > 1 else 1.0)
        if p.dim() == 1:
            w = 1.0 + 0.1 * w
        if not hook(model, name, w):
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(w, requires_grad=False))
        del w
    model.tie_weights()
    targets = a.targets
    lcfg = LoRAConfig(r=16, alpha=32.0, dropout=0.0, targets=list(targets))
    apply_lora(model, lcfg)
    freeze_for_adapters(model, lcfg)
    seq, V = a.seq, hf["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, V, (seq // 2,), generator=g).tolist()
    chosen = torch.randint(3, V, (seq - seq // 2,), generator=g).tolist()
    rejected = torch.randint(3, V, (seq - seq // 2 - 7,), generator=g).tolist()  # shorter: a padded batch
    ex = {"chosen_ids": prompt + chosen, "chosen_labels": [-100] * len(prompt) + chosen,
          "rejected_ids": prompt + rejected, "rejected_labels": [-100] * len(prompt) + rejected}
    examples = [dict(ex) for _ in range(a.dpo_steps)]
    from minitrain.objectives.dpo import collate_with_reference

    out = Path(tempfile.mkdtemp(prefix="minitrain_gpu_dpo_"))
    cfg = DPOConfig(out=str(out), max_steps=a.dpo_steps, batch_size=1, grad_accum=1, lr=5e-6, warmup=0,
                    schedule="constant", max_len=seq, precision="bf16", checkpointing=True, lora_r=16,
                    lora_alpha=32.0, lora_targets=list(targets), quantize="nf4", device=str(device), beta=0.1,
                    save_every=0, log_every=1, compile=a.compile)
    objective = make_dpo_objective(cfg.beta, reference=make_reference(model, ""))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    summary = train(model, objective, examples, lambda b: collate_with_reference(b, 0), cfg, out_dir=out)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "seq": seq,
              "steps": summary["step"], "seconds": time.perf_counter() - t0, "targets": list(targets),
              "shape": "tiny" if a.tiny else "mistral-7b", "compile": a.compile}
    if device.type == "cuda":
        result.update(weights_and_adapters_bytes=before, max_allocated_bytes=torch.cuda.max_memory_allocated(),
                      max_reserved_bytes=torch.cuda.max_memory_reserved())
    run = RunShape(rows=2, seq=seq, compute="bf16", quantize="nf4", lora_r=16, lora_targets=tuple(targets),
                     checkpointing=True, dpo_reference="base", device=device.type,
                     targets=len(chosen) + len(rejected))  # positions whose next token is an answer token
    plan = predict(ModelShape.from_hf(hf), run)
    result.update(predicted_peak_bytes=plan.peak, predicted_moment=plan.peak_moment,
                  predicted_persistent_bytes=plan.persistent_bytes)
    if "max_allocated_bytes" in result:
        result["measured_over_predicted"] = result["max_allocated_bytes"] / plan.peak
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


# ----------------------------------------------------------------------------- main


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=("sft", "dpo", "orpo", "kto", "grpo", "rm"))
    p.add_argument("--sampler", action="store_true", help="GRPO's sampler against transformers' generate")
    p.add_argument("--gen-batch", type=int, default=8)
    p.add_argument("--gen-prompt", type=int, default=32)
    p.add_argument("--gen-new", type=int, default=64)
    p.add_argument("--grpo-steps", type=int, default=8)
    p.add_argument("--grpo-prompts", type=int, default=4)
    p.add_argument("--grpo-g", type=int, default=8)
    p.add_argument("--grpo-len", type=int, default=16)
    p.add_argument("--kinds", type=lambda s: s.split(","), default=["sft", "dpo"],
                   help="which runs, comma-separated: sft,dpo (default), orpo, kto, grpo, rm")
    p.add_argument("--write", metavar="BENCHMARKS.md")
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "minitrain_bench"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--dpo-steps", type=int, default=8)
    p.add_argument("--dpo-batch", type=int, default=2)
    p.add_argument("--dpo-accum", type=int, default=1)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--targets", type=lambda s: s.split(","), default=None,
                   help=f"LoRA targets (default {','.join(ALL_LINEAR)}; with --experts "
                        f"{','.join(MOE_TARGETS)})")
    p.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE checkpoint with this many experts (0: LLaMA)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-imports", action="store_true", help="skip the import-time probe")
    p.add_argument("--mt-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the minitrain runs only (experiments; PYTHONPATH is prepended)")
    p.add_argument("--shared-prompt", action="store_true",
                   help="minitrain's DPO and reward-model runs with shared_prompt=true (a row [prompt, chosen, "
                        "rejected] per pair; TRL has no such layout: its side is unchanged)")
    p.add_argument("--tag", default="", help="a name for this set of runs (kept apart in the cache)")
    p.add_argument("--sides", type=lambda x: x.split(","), default=["mt", "hf"], help="mt,hf (default) or one of them")
    p.add_argument("--worker", metavar="SPEC.json", help=argparse.SUPPRESS)
    p.add_argument("--profile", choices=("mt-sft", "mt-dpo"))
    p.add_argument("--gpu-dpo-7b", action="store_true")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help="--gpu-dpo-7b: torch.compile each block")
    p.add_argument("--out", metavar="FILE.json")
    a = p.parse_args(argv)
    if a.targets is None:
        a.targets = list(MOE_TARGETS if a.experts else ALL_LINEAR)
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    if a.worker:
        return hf_worker(a.worker)
    if a.gpu_dpo_7b:
        if a.targets == list(ALL_LINEAR) and "--targets" not in " ".join(argv):
            a.targets = ["q_proj", "k_proj", "v_proj", "o_proj"]  # recipes/dpo_mistral.py's default targets
        return gpu_dpo_7b(a)
    if a.profile:
        return profile_run(a, a.profile)
    if a.sampler:
        return sampler_bench(a)
    info = prepare(a)
    print(f"checkpoint {info['model']} ({info['params']:,} params); data {info['sft']}, {info['dpo']}", flush=True)
    env = child_env(a)
    extra = {"machine": machine(), "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M"),
             "load_before": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    kinds = [a.only] if a.only else a.kinds
    bad = [k for k in kinds if k not in ("sft", "dpo", "orpo", "kto", "grpo", "rm")]
    if bad:
        print(f"error: --kinds: unknown {', '.join(bad)} — use sft, dpo, orpo, kto, grpo, rm", file=sys.stderr)
        return 2
    results = {k: {"mt": [], "hf": []} for k in kinds}
    for rep in range(a.repeats):
        order = [x for x in (("mt", "hf") if rep % 2 == 0 else ("hf", "mt")) if x in a.sides]
        for kind in kinds:
            for side in order:
                results[kind][side].append(run_one(kind, side, a, info, rep))
    extra["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    if not a.no_imports:
        extra["imports"] = import_times(env)
    if "sft" in kinds:
        extra["padding"] = padding_note(a, info)
    block = render(a, results, info, argv, extra)
    print(block)
    raw = Path(a.cache) / shape_key(a) / f"results{'-' + a.tag if a.tag else ''}.json"
    raw.write_text(json.dumps({"results": results, "extra": extra}, indent=2, default=str))
    if a.write:
        write_benchmarks(Path(a.write), block, a.tag)
        print(f"wrote {a.write} (raw results: {raw})")
    failed = [r for k in results.values() for side in k.values() for r in side if r["rc"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from minitrain.cli import main_quietly

    sys.exit(main_quietly(main, sys.argv[1:]))
