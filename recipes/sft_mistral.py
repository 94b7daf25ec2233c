"""SFT (Stage A) of a Mistral checkpoint with a LoRA adapter, on chat or prompt/completion rows.

    python -m minitrain recipes/sft_mistral.py                         # the built-in demo (CPU)
    python -m minitrain recipes/dpo_mistral.py init_adapter=runs/sft_mistral/adapter   # then Stage B
    python -m minitrain recipes/sft_mistral.py model=/path/to/Mistral-7B-Instruct-v0.2 data=chats.jsonl \\
        quantize=nf4 lr=2e-4 max_steps=-1 epochs=1 batch_size=4 grad_accum=4 max_len=1024 out=runs/sft

Rows: `{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}` rendered with the
tokenizer's chat format (Mistral's `[INST] ... [/INST]`; the loss is on the assistant turns),
`{"prompt", "completion"}` (loss on the completion) or `{"text"}`. The adapter goes to
out/adapter in PEFT's format; Stage B (recipes/dpo_mistral.py) continues it with
`init_adapter=`: it keeps training that same adapter, and its DPO reference is this Stage A
policy. The defaults train the committed demo (demo/sft_train.jsonl: faithful summaries).
"""

from __future__ import annotations

from pathlib import Path

import models
from minitrain.config import SFTConfig
from minitrain.run import Job, check_out_dir, finish, log, prepare_out_dir, sft_job
from minitrain.train import train

DEMO = Path(__file__).resolve().parent.parent / "demo"

config = SFTConfig(
    model=str(DEMO / "model"),
    data=str(DEMO / "sft_train.jsonl"),
    out="runs/sft_mistral",
    max_steps=100,
    batch_size=8,
    lr=2e-3,
    warmup=0.1,
    schedule="cosine",
    max_len=128,
    log_every=10,
    lora_r=8,
    lora_alpha=16.0,
    lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"],
)


def setup(config: SFTConfig) -> Job:
    """Load the model, attach the adapter, read the data; writes nothing."""
    return sft_job(config, models.from_hf_config)


def run(config: SFTConfig) -> dict:
    """Train the Stage A adapter and save it; returns the loop's summary."""
    check_out_dir(config)  # a refusal comes before minutes of loading
    job = setup(config)
    out = prepare_out_dir(config)
    summary = train(job.model, job.objective, job.train_examples, job.collate, config,
                    eval_examples=job.eval_examples)
    finish(job.model, config, job.lora, summary)
    log(f"Stage B (DPO) continuing this adapter:\n  python -m minitrain recipes/dpo_mistral.py "
        f"init_adapter={out / 'adapter'}" + (f" model={config.model}" if config.model != str(DEMO / "model") else ""))
    return summary
