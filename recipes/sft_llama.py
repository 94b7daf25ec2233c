"""SFT: supervised fine-tuning of a causal checkpoint with a LoRA adapter: LLaMA, Mistral, Qwen2 / Qwen2.5,
Qwen3, Gemma 2, Gemma 3, Phi-3 (`recipes/sft.py` runs this file under a family-agnostic name).

Trains on rows of any of these shapes (they may be mixed in one file), in JSON lines, JSON, CSV /
TSV, Parquet, Arrow or a `datasets` folder (docs/data.md; other column names: `fields=`):

    {"prompt": "...", "completion": "..."}           loss on the completion tokens only
    {"messages": [{"role": "user", "content": ...},  loss on the assistant turns, rendered with
                  {"role": "assistant", ...}]}         the checkpoint's chat template
    {"conversations": [{"from": "human", ...}]}       ShareGPT, and Alpaca {"instruction", "input",
                                                      "output"}: chats too
    {"text": "..."}                                   loss on every token

    python -m minitrain recipes/sft_llama.py model=/path/to/Meta-Llama-3-8B-Instruct data=train.jsonl \\
        quantize=nf4 checkpointing=true out=runs/sft                    # 12 GB GPU

`model` is an HF-format folder (config.json, *.safetensors, tokenizer files). The run writes
out/config.json, out/metrics.jsonl (one line per optimizer step), out/checkpoint/ (resume with
resume=true) and out/adapter/ (PEFT format: loads with peft.PeftModel.from_pretrained).
Add quantize=nf4 for QLoRA on a GPU. `--help` lists every key.
"""

from __future__ import annotations


import models
from minitrain.config import SFTConfig
from minitrain.run import Job, check_out_dir, eval_log, evaluate_at_start, evaluate_only, finish, prepare_out_dir, sft_job
from minitrain.train import train

config = SFTConfig(
    out="runs/sft_llama",
    lr=2e-4,
    warmup=0.03,
    schedule="cosine",
    batch_size=4,
    grad_accum=4,
    max_len=1024,
    lora_r=16,
    lora_alpha=32.0,
    lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)


def setup(config: SFTConfig) -> Job:
    """Load the model, attach the adapter, read the data; writes nothing."""
    return sft_job(config, models.from_hf_config)


def run(config: SFTConfig) -> dict:
    """Load, adapt, train, save the adapter; returns the loop's summary."""
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
    return summary
