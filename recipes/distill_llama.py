"""Distillation: a student (LoRA) learns from a larger teacher of the same tokenizer; both of any decoder-only family
(LLaMA / Mistral / Qwen / Gemma / Phi-3, Qwen3.5, Gemma 4, the MoE families; the two may differ).

    python -m minitrain recipes/distill_llama.py model=path/to/student teacher=path/to/teacher \\
        data=train.jsonl out=runs/distill max_steps=200 temperature=2 kd_weight=0.5 ce_weight=0.5 \\
        feature_weight=0.1 attention_weight=0.1

The loss per target token is `kd_weight * T^2 * KL(teacher || student at temperature T) +
ce_weight * CE(student, label) + feature_weight * feature + attention_weight * attention` (see
`minitrain.objectives.distill`); `top_k=256` distils over the teacher's 256 most likely tokens only.
Feature matching compares the hidden states of mapped layers (`feature_layers`, default every
student layer; student layer i meets teacher layer ceil((i+1)*Lt/Ls)-1 unless `layer_map=i:j,...`
says otherwise) by `feature_loss=mse|cosine`, through a learned projection when the widths differ
(saved as adapter/distill_projections.safetensors). Attention transfer is the KL between the
teacher's and student's attention distributions on `attention_layers` (default the last), head
groups averaged when the head counts differ (attention layers only: a Qwen3.5 Gated DeltaNet layer is refused). metrics.jsonl logs each term raw and weighted
(`kd`, `kd_weighted`, ...) and `ppl` (= exp of the mean token CE) every step; after
`balance_steps` steps the run says once if a term's share of the loss is far from its weight's.
`eval/loss` and `eval/ppl` are the student's own CE and perplexity on `eval_data`. The teacher
runs frozen under no_grad in the compute dtype; `teacher_quantize=nf4` loads it 4-bit (a GPU with
bitsandbytes). Teacher and student must share the tokenizer (a mismatch is refused before
training, naming both folders); heads of different sizes distil over the ids both have.
`finetune=full` trains every weight of the student (fp32) instead of a LoRA adapter and saves it as
an HF folder in out/model (the projections beside it, not in it).
Data rows are as for SFT (`{"prompt","completion"}`, `{"messages"}`, `{"text"}`).
"""

from __future__ import annotations

import dataclasses
import functools

import models
from minitrain import ema
from minitrain.parallel import distributed
from minitrain.data.collate import collate_causal
from minitrain.errors import UserError
from minitrain.objectives.configs import DistillConfig
from minitrain.objectives.distill import (PROJECTIONS, PROJECTIONS_FILE, attach_projections,
                                          captures_layers, check_ids_shared, check_same_tokenizer,
                                          make_distill_objective, map_layers, save_projections, shared_vocab,
                                          take_projections)
from minitrain.progress import log
from minitrain.run import (EMA_SUFFIX, Job, attach_adapters, check_out_dir, evaluate_only, finish, load_examples,
                           load_model, load_tokenizer, prepare_out_dir)
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
                                                finetune="lora",  # frozen: the compute dtype, even for a full student
                                                parallel="ddp"),  # read whole on each rank: FSDP shards the student
                            models.from_hf_config)
    for folder, m in ((config.model, model), (config.teacher, teacher)):
        if m.is_encoder_decoder:
            raise UserError(f"{folder}: is an encoder-decoder (T5) model — this recipe distils causal LMs")
    shared = shared_vocab(model, teacher)
    top = check_ids_shared([train_examples, eval_examples], shared, config.teacher)
    vs, vt = model.output_projection.out_features, teacher.output_projection.out_features
    if vs != vt:
        log(f"vocab: the student's head scores {vs} ids, the teacher's {vt}: KD runs over the {shared} ids both "
            f"have (the data's largest id is {top})")
    lora = attach_adapters(model, config)
    feature_map = (map_layers(model, teacher, config.feature_layers or None, config.layer_map, "feature_layers")
                   if config.feature_weight > 0 else {})
    attention_map = (map_layers(model, teacher, config.attention_layers, config.layer_map, "attention_layers")
                     if config.attention_weight > 0 else {})
    if (feature_map or attention_map) and not captures_layers(model):
        raise UserError(f"{config.model}: this model family does not return hidden states or attention — set "
                        f"feature_weight=0 attention_weight=0")
    proj = attach_projections(model, teacher, feature_map, seed=config.seed)
    objective = make_distill_objective(teacher, temperature=config.temperature, kd_weight=config.kd_weight,
                                       ce_weight=config.ce_weight, top_k=config.top_k,
                                       feature_weight=config.feature_weight, attention_weight=config.attention_weight,
                                       feature_loss=config.feature_loss, feature_map=feature_map,
                                       attention_map=attention_map, balance_steps=0,  # watched from step 1: run()
                                       balance_factor=config.balance_factor, micro_batches=config.grad_accum, log=log)
    log(f"distill: T={config.temperature} (KL x T^2), kd_weight={config.kd_weight}, ce_weight={config.ce_weight}, "
        f"{'top-' + str(config.top_k) + ' subset' if config.top_k else 'full-vocabulary'} KD; "
        f"teacher frozen ({config.teacher_quantize if config.teacher_quantize != 'none' else 'not quantized'})")
    if feature_map:
        log(f"distill: feature_weight={config.feature_weight} ({config.feature_loss}) on student:teacher layers "
            f"{', '.join(f'{i}:{j}' for i, j in feature_map.items())}"
            + (f"; {len(proj)} projections {proj[next(iter(proj))].in_features}->"
               f"{proj[next(iter(proj))].out_features} train with the student" if proj else ""))
    if attention_map:
        log(f"distill: attention_weight={config.attention_weight} on student:teacher layers "
            f"{', '.join(f'{i}:{j}' for i, j in attention_map.items())}")
    return Job(model, objective, train_examples, functools.partial(collate_causal, pad_id=tok.pad_id), eval_examples,
               lora, tok)


def run(config: DistillConfig) -> dict:
    """Distil into the student's adapter (or, finetune=full, the student itself) and save it, with the
    feature projections beside it; returns the loop's summary."""
    check_out_dir(config)  # a refusal comes before minutes of loading
    job = setup(config)
    if config.eval_only:  # the student's held-out loss / perplexity (the objective in eval mode), nothing trained
        return evaluate_only(config, job)
    prepare_out_dir(config, job)  # the gradient audit runs the objective: its calls are no steps
    job.objective.restart_balance(config.balance_steps)
    summary = train(job.model, job.objective, job.train_examples, job.collate, config,
                    eval_examples=job.eval_examples)
    projections = take_projections(job.model)  # off the student: out/model holds the model alone
    folder = finish(job.model, config, job.lora, summary)
    averaged = ema.whole(job.model) or {}  # ema_decay: the projections' average goes beside the EMA's folder
    prefix = PROJECTIONS + "."
    averaged = {k[len(prefix):]: v for k, v in averaged.items() if k.startswith(prefix)}
    for tensors, to in ((projections, folder), (averaged, folder.with_name(folder.name + EMA_SUFFIX))):
        saved = distributed.main_only(lambda: save_projections(tensors, to / PROJECTIONS_FILE,
                                                               job.objective.feature_map))
        if saved:
            log(f"feature projections: {saved}")
    return summary
