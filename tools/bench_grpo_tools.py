"""GRPO steps with tools: minitrain against TRL 1.x's GRPOTrainer(tools=...), per CPU-second, one thread.

    python tools/bench_grpo_tools.py [--repeats 3] [--steps 8] [--write BENCHMARKS.md]

Both sides train the tool-use demo (demo/grpo_tools: a tiny LLaMA that calls the calculator `mul` in
about one completion in seven at the start): the same prompts per step, G, max_completion_length,
max_tool_calls (TRL's max_tool_calling_iterations), temperature 1, loss dapo, beta 0, LoRA r=8 on
q,k,v,o, AdamW at a constant 2e-3, no eval, no checkpointing, one thread (OMP_NUM_THREADS=1). TRL
parses the demo template's calls with its Qwen response template (`qwen3_template`: the demo writes
Qwen's `<tool_call>` JSON); its reward strips the `</s>` its parser leaves in the content. Sampling
differs between the sides, so the tool calls are the same in distribution, not call for call: each
side's measured `tools/call_frequency` is reported beside its throughput.

Throughput: completions (prompts x G per step) per CPU-second of the child over steps 2..N (step 1
excluded: warm-up), from `tools/bench.py`'s `timed_run` (its step lines' arrival, the child's CPU
seconds from /proc); runs interleaved mt, hf, hf, mt, ...; medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench import timed_run  # noqa: E402

DEMO = ROOT / "demo" / "grpo_tools"


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
             HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TRL_EXPERIMENTAL_SILENCE="1",
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.pop("CUDA_VISIBLE_DEVICES", None)
    return e


def mt_command(a: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, "-m", "minitrain", "recipes/grpo_qwen.py", f"config={DEMO / 'run.json'}",
            f"model={DEMO / 'model'}", f"data={DEMO / 'train.jsonl'}", "eval_data=", f"tools={DEMO / 'calc.py'}:mul",
            f"rewards={DEMO / 'calc.py'}:correct", f"out={out}", f"max_steps={a.steps}", f"batch_size={a.prompts}",
            f"num_generations={a.g}", f"max_completion_length={a.length}", f"max_tool_calls={a.rounds}",
            "lora_targets=q_proj,k_proj,v_proj,o_proj", "lora_dropout=0.0", "threads=1", "save_every=0",
            "log_completions_every=0", "group_by_length=false", "overwrite=true", f"seed={a.seed}"]


def hf_worker(spec_path: str) -> int:
    """TRL's GRPOTrainer with tools=[mul] + peft on the same demo (in its own process)."""
    spec = json.loads(Path(spec_path).read_text())
    import importlib.util

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    clock = open(out / "steps.jsonl", "w", buffering=1)
    logged = open(out / "logs.jsonl", "w", buffering=1)

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            clock.write(json.dumps({"step": state.global_step, "tokens": 0}) + "\n")

        def on_log(self, args, state, control, logs=None, **kw):
            logged.write(json.dumps(logs or {}) + "\n")

    calc_spec = importlib.util.spec_from_file_location("calc", DEMO / "calc.py")
    calc = importlib.util.module_from_spec(calc_spec)
    calc_spec.loader.exec_module(calc)

    def correct(prompts, completions, answer, **_):  # TRL's parser leaves the eos in the content
        return [1.0 if c[-1].get("content", "").replace("</s>", "").strip() == x else 0.0
                for c, x in zip(completions, answer)]

    tok = AutoTokenizer.from_pretrained(str(DEMO / "model"))
    tok.response_template = qwen3_template  # the demo writes Qwen's <tool_call> JSON
    model = AutoModelForCausalLM.from_pretrained(str(DEMO / "model"), dtype=torch.float32)
    rows = [json.loads(line) for line in open(DEMO / "train.jsonl") if line.strip()]
    rows = rows[: spec["steps"] * spec["prompts"]]
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")
    args = GRPOConfig(output_dir=str(out / "trainer"), per_device_train_batch_size=spec["prompts"] * spec["g"],
                      gradient_accumulation_steps=1, max_steps=spec["steps"], learning_rate=2e-3,
                      lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                      optim="adamw_torch", logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
                      use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0, dataloader_pin_memory=False,
                      seed=spec["seed"], gradient_checkpointing=False, num_generations=spec["g"],
                      max_completion_length=spec["length"], max_tool_calling_iterations=spec["rounds"],
                      temperature=1.0, beta=0.0, loss_type="dapo", log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, peft_config=lora, tools=[calc.mul], callbacks=[StepClock()])
    trainer.train()
    clock.close()
    logged.close()
    return 0


def run(side: str, a: argparse.Namespace, rep: int) -> dict:
    work = Path(a.cache) / f"{side}-{rep}"
    work.mkdir(parents=True, exist_ok=True)
    if side == "mt":
        cmd, steps = mt_command(a, work / "out"), work / "out" / "metrics.jsonl"
    else:
        spec = {"out": str(work / "hf"), "steps": a.steps, "prompts": a.prompts, "g": a.g, "length": a.length,
                "rounds": a.rounds, "seed": a.seed}
        (work / "spec.json").write_text(json.dumps(spec))
        cmd, steps = [sys.executable, str(Path(__file__).resolve()), "--worker", str(work / "spec.json")], \
            work / "hf" / "steps.jsonl"
    r = timed_run(cmd, steps, work / "log.txt", env())
    if r["rc"] != 0 or len(r["rows"]) < 2:
        raise SystemExit(f"{side} run {rep} failed (exit {r['rc']}); see {work / 'log.txt'}:\n"
                         + (work / "log.txt").read_text()[-3000:])
    cpu = r["cpu"][-1] - r["cpu"][0]
    n = a.prompts * a.g * (len(r["rows"]) - 1)
    if side == "mt":
        logs = [row for row in r["rows"]]
    else:
        logs = [json.loads(x) for x in (work / "hf" / "logs.jsonl").read_text().splitlines()]
    calls = [x["tools/call_frequency"] for x in logs if "tools/call_frequency" in x]
    s = {"side": side, "completions_per_cpu_s": n / cpu, "cpu_s_per_step": cpu / (len(r["rows"]) - 1),
         "peak_rss_mb": r["peak_rss_mb"], "call_frequency": sum(calls) / len(calls) if calls else float("nan")}
    print(f"  {side} run {rep}: {s['completions_per_cpu_s']:.1f} completions/CPU-s, {s['cpu_s_per_step']:.2f} "
          f"CPU-s/step, tool calls per completion {s['call_frequency']:.3f}, peak RSS {s['peak_rss_mb']:.0f} MiB",
          flush=True)
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--g", type=int, default=8)
    ap.add_argument("--length", type=int, default=24, help="max_completion_length")
    ap.add_argument("--rounds", type=int, default=5, help="max_tool_calls / max_tool_calling_iterations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default="/tmp/minitrain_bench_grpo_tools")
    ap.add_argument("--write", help="append the result to this Markdown file")
    a = ap.parse_args(argv)
    if a.worker:
        return hf_worker(a.worker)
    results: dict[str, list[dict]] = {"mt": [], "hf": []}
    order = [s for i in range(a.repeats) for s in (("mt", "hf") if i % 2 == 0 else ("hf", "mt"))]
    for i, side in enumerate(order):
        results[side].append(run(side, a, i))
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "side"} for side, rs in results.items()}
    ratio = med["mt"]["completions_per_cpu_s"] / med["hf"]["completions_per_cpu_s"]
    line = (f"| GRPO step with tools (demo/grpo_tools, {a.prompts} prompts x G={a.g}, up to {a.length} tokens, "
            f"{a.rounds} tool rounds, 1 thread, {a.steps} steps, medians of {a.repeats}) | "
            f"{med['mt']['completions_per_cpu_s']:.1f} | {med['hf']['completions_per_cpu_s']:.1f} | **{ratio:.2f}x** | "
            f"{med['mt']['call_frequency']:.3f} / {med['hf']['call_frequency']:.3f} | "
            f"{med['mt']['peak_rss_mb']:.0f} / {med['hf']['peak_rss_mb']:.0f} MiB |")
    print(line)
    if a.write:
        with open(a.write, "a") as f:
            f.write("\n" + line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
