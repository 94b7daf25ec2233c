"""Distillation: a LLaMA / Mistral student (LoRA) learns from a larger teacher of the same tokenizer.

    python -m minitrain recipes/distill_llama.py model=path/to/student teacher=path/to/teacher \\
        data=train.jsonl out=runs/distill max_steps=200 temperature=2 kd_weight=0.5 ce_weight=0.5

The loss per target token is `kd_weight * T^2 * KL(teacher || student at temperature T) +
ce_weight * CE(student, label)` (see `minitrain.distill`); `top_k=256` distils over the teacher's
256 most likely tokens only. metrics.jsonl logs `kd`, `ce`, their weighted values and `ppl`
(= exp of the mean token CE) every step; `eval/loss` and `eval/ppl` are the student's own CE and
perplexity on `eval_data`. The teacher runs frozen under no_grad in the compute dtype;
`teacher_quantize=nf4` loads it 4-bit (a GPU with bitsandbytes). `finetune=full` trains every weight of
the student (fp32) instead of a LoRA adapter and saves it as an HF folder in out/model. Teacher and student must share
the tokenizer and vocabulary size: a mismatch is refused before training, naming both folders.
Data rows are as for SFT (`{"prompt","completion"}`, `{"messages"}`, `{"text"}`).
"""

from __future__ import annotations

import dataclasses
import functools

import models
from minitrain.collate import collate_causal
from minitrain.distill import DistillConfig, check_same_tokenizer, check_same_vocab, make_distill_objective
from minitrain.errors import UserError
from minitrain.run import (Job, attach_adapters, check_out_dir, finish, load_examples, load_model, load_tokenizer, log,
                           prepare_out_dir)
from minitrain.train import train

config = DistillConfig(
    out="runs/distill_llama",
    lr=2e-4,
    warmup=0.03,
    schedule="cosine",
    batch_size=4,
    grad_accum=4,
    max_len=1024,
    lora_r=16,
    lora_alpha=32.0,
    lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    temperature=2.0,
    kd_weight=0.5,
    ce_weight=0.5,
)


def setup(config: DistillConfig) -> Job:
    """Load student and teacher, check they share a tokenizer, adapt the student, read the data; writes nothing."""
    check_same_tokenizer(config.model, config.teacher)  # before minutes of loading weights
    tok = load_tokenizer(config)
    train_examples, eval_examples = load_examples(config, tok, "sft")  # before the weights: seconds, not minutes
    model, tok = load_model(config, models.from_hf_config, tok)
    teacher, _ = load_model(dataclasses.replace(config, model=config.teacher, quantize=config.teacher_quantize,
                                                finetune="lora"),  # frozen: the compute dtype, even for a full student
                            models.from_hf_config)
    for folder, m in ((config.model, model), (config.teacher, teacher)):
        if m.is_encoder_decoder:
            raise UserError(f"{folder}: is an encoder-decoder (T5) model — this recipe distils causal LMs")
    check_same_vocab(model, teacher, config.model, config.teacher)
    lora = attach_adapters(model, config)
    objective = make_distill_objective(teacher, temperature=config.temperature, kd_weight=config.kd_weight,
                                       ce_weight=config.ce_weight, top_k=config.top_k)
    log(f"distill: T={config.temperature} (KL x T^2), kd_weight={config.kd_weight}, ce_weight={config.ce_weight}, "
        f"{'top-' + str(config.top_k) + ' subset' if config.top_k else 'full-vocabulary'} KD; "
        f"teacher frozen ({config.teacher_quantize if config.teacher_quantize != 'none' else 'not quantized'})")
    return Job(model, objective, train_examples, functools.partial(collate_causal, pad_id=tok.pad_id), eval_examples,
               lora, tok)


def run(config: DistillConfig) -> dict:
    """Distil into the student's adapter and save it; returns the loop's summary."""
    check_out_dir(config)  # a refusal comes before minutes of loading
    job = setup(config)
    prepare_out_dir(config, job)
    summary = train(job.model, job.objective, job.train_examples, job.collate, config,
                    eval_examples=job.eval_examples)
    finish(job.model, config, job.lora, summary)
    return summary
