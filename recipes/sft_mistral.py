"""SFT (Stage A) of a Mistral checkpoint with a LoRA adapter, on chat or prompt/completion rows.

    python -m minitrain recipes/sft_mistral.py                         # the built-in demo (CPU)
    python -m minitrain recipes/dpo_mistral.py init_adapter=runs/sft_mistral/adapter   # then Stage B
    python -m minitrain recipes/sft_mistral.py model=/path/to/Mistral-7B-Instruct-v0.2 \\
        data=chats.jsonl quantize=nf4 out=runs/sft                      # 12 GB GPU

Rows: `{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}` rendered with the
tokenizer's chat format (Mistral's `[INST] ... [/INST]`; the loss is on the assistant turns),
`{"prompt", "completion"}` (loss on the completion) or `{"text"}`. The adapter goes to
out/adapter in PEFT's format; Stage B (recipes/dpo_mistral.py) continues it with
`init_adapter=`: it keeps training that same adapter, and its DPO reference is this Stage A
policy. The defaults are for a real 7B run (one epoch, 4 x 4 accumulation, lr 2e-4, max_len
1024, LoRA r=16, checkpointing); `model=` and `data=` must be given. Only a command that names
none of model / data / eval_data trains the committed demo (demo/sft_train.jsonl: faithful
summaries) with the `demo` settings below. At the end the run prints the Stage B command,
carrying this run's model, quantize, max_len and adapter, with the preference data to fill in.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import models
from minitrain.bundled import demo_dir
from minitrain.config import SFTConfig
from minitrain.progress import log
from minitrain.run import Job, check_out_dir, eval_log, evaluate_at_start, evaluate_only, finish, prepare_out_dir, sft_job
from minitrain.train import train

DEMO = demo_dir()  # demo/ in a clone, minitrain/demo in an installed wheel

config = SFTConfig(  # a real run: model= and data= are asked for; no eval_data, no held-out evaluation
    out="runs/sft_mistral",
    max_steps=-1,
    epochs=1.0,
    batch_size=4,
    grad_accum=4,
    lr=2e-4,
    warmup=0.1,
    schedule="cosine",
    max_len=1024,
    log_every=10,
    lora_r=16,
    lora_alpha=32.0,
    lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"],
    checkpointing=True,  # a 7B model's activations at 4 x 1024 tokens do not fit 12 GB without it
)

# the built-in demo: used only when the command names none of model / data / eval_data
demo = dict(
    model=str(DEMO / "model"),
    data=str(DEMO / "sft_train.jsonl"),
    max_steps=100,
    batch_size=8,
    grad_accum=1,
    lr=2e-3,
    max_len=128,
    lora_r=8,
    lora_alpha=16.0,
    checkpointing=False,
)

# for a 12 GB GPU: fits by minitrain plan (tests/test_advertised.py checks every advertised command)
REAL_CHECKPOINT = ("python -m minitrain recipes/sft_mistral.py model=/path/to/Mistral-7B-Instruct-v0.2 "
                   "data=chats.jsonl quantize=nf4 out=runs/sft")


def setup(config: SFTConfig) -> Job:
    """Load the model, attach the adapter, read the data; writes nothing."""
    return sft_job(config, models.from_hf_config)


def run(config: SFTConfig) -> dict:
    """Train the Stage A adapter and save it; returns the loop's summary."""
    check_out_dir(config)  # a refusal comes before minutes of loading
    job = setup(config)
    if config.eval_only:  # the held-out loss / perplexity of the base or init_adapter, nothing trained
        return evaluate_only(config, job)
    out = prepare_out_dir(config, job)
    record = eval_log(out)  # out/eval.jsonl: step 0 (the model it starts from), then each evaluation
    evaluate_at_start(job, config, record)
    summary = train(job.model, job.objective, job.train_examples, job.collate, config,
                    eval_examples=job.eval_examples, eval_fn=record if job.eval_examples else None)
    finish(job.model, config, job.lora, summary)
    if job.lora is not None:  # finetune=full saved a model, which Stage B's DPO (an adapter's) does not continue
        log(f"Stage B (DPO) continuing this adapter:\n  {stage_b_command(config)}")
    return summary


def stage_b_command(config: SFTConfig) -> str:
    """The `recipes/dpo_mistral.py` command that continues this run's adapter.

    On the demo: the demo's Stage B. Otherwise a real run's: the same model, quantize, max_len
    and device, the preference pairs to fill in (PREFS.jsonl), and an out beside this one, so
    nothing falls back to the demo's data or to this run's folder."""
    out = Path(config.out)
    adapter = f"init_adapter={out / 'adapter'}"
    if (config.model, config.data) == (demo["model"], demo["data"]):
        return f"python -m minitrain recipes/dpo_mistral.py {adapter}"
    keep = [f"model={config.model}", adapter, "data=PREFS.jsonl", "eval_data=PREFS_EVAL.jsonl",
            f"out={out.parent / (out.name + '_dpo')}", f"quantize={config.quantize}", f"max_len={config.max_len}"]
    keep += [f"{k}={getattr(config, k)}" for k in ("device", "precision", "chat_format")
             if getattr(config, k) != "auto"]
    return "python -m minitrain recipes/dpo_mistral.py " + " ".join(shlex.quote(a) for a in keep)
