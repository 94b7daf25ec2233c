"""SFT: supervised fine-tuning of a LLaMA / Mistral checkpoint with a LoRA adapter.

Trains on JSONL rows of any of these shapes (they may be mixed in one file):

    {"prompt": "...", "completion": "..."}           loss on the completion tokens only
    {"messages": [{"role": "user", "content": ...},  loss on the assistant turns, rendered with
                  {"role": "assistant", ...}]}         the tokenizer's chat format
    {"text": "..."}                                   loss on every token

    python -m minitrain recipes/sft_llama.py model=path/to/llama data=train.jsonl out=runs/sft max_steps=200

`model` is an HF-format folder (config.json, *.safetensors, tokenizer files). The run writes
out/config.json, out/metrics.jsonl (one line per optimizer step), out/checkpoint/ (resume with
resume=true) and out/adapter/ (PEFT format: loads with peft.PeftModel.from_pretrained).
Add quantize=nf4 for QLoRA on a GPU. `--help` lists every key.
"""

from __future__ import annotations

import functools

import models
from minitrain.config import TrainConfig
from minitrain.data import collate_causal
from minitrain.errors import UserError
from minitrain.objectives import sft
from minitrain.run import Job, attach_adapters, check_out_dir, finish, load_examples, load_model, prepare_out_dir
from minitrain.train import train

config = TrainConfig(
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


def setup(config: TrainConfig) -> Job:
    """Load the model, attach adapters, read the data; writes nothing."""
    model, tok = load_model(config, models.from_hf_config)
    if model.is_encoder_decoder:
        raise UserError(f"{config.model}: is an encoder-decoder (T5) model — this recipe trains causal LMs; "
                        f"use recipes/lora_t5.py for it")
    lora = attach_adapters(model, config)
    train_examples, eval_examples = load_examples(config, tok, "sft")
    return Job(model, sft, train_examples, functools.partial(collate_causal, pad_id=tok.pad_id), eval_examples,
               lora, tok)


def run(config: TrainConfig) -> dict:
    """Load, adapt, train, save the adapter; returns the loop's summary."""
    check_out_dir(config)  # a refusal comes before minutes of loading
    job = setup(config)
    prepare_out_dir(config)
    summary = train(job.model, job.objective, job.train_examples, job.collate, config,
                    eval_examples=job.eval_examples)
    finish(job.model, config, job.lora, summary)
    return summary
