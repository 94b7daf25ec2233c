"""KTO on a Mistral checkpoint with a LoRA adapter: preference tuning from unpaired thumbs-up / -down rows.

    python -m minitrain recipes/kto_mistral.py                       # the built-in demo (CPU, a minute)
    python -m minitrain recipes/kto_mistral.py model=/path/to/Mistral-7B-Instruct-v0.2 \\
        data=feedback.jsonl eval_data=feedback_eval.jsonl quantize=nf4 lr=5e-6 max_steps=-1 epochs=1 \\
        batch_size=8 grad_accum=4 max_len=1024 lora_r=16 lora_alpha=32 checkpointing=true out=runs/kto   # 12 GB GPU

Rows are `{"prompt", "completion", "label": true|false}`: the prompt a string or a list of chat
messages, the completion the answer that got the thumbs-up (true) or -down (false). No pairs are
needed (the data many teams actually collect). The loss is TRL's KTO (`beta`, `desirable_weight`,
`undesirable_weight`, see `minitrain.objectives.kto`); the KL reference point comes from mismatched
prompt-completion pairs (each row's prompt with the previous row's completion in its block of
`batch_size` rows), so `batch_size` must be at least 2. TRL's advice on imbalanced data: keep
`desirable_weight * #desirable / (undesirable_weight * #undesirable)` within [1, 4/3]; the
ratio is printed before training.

metrics.jsonl logs TRL's names each step (`kl`, `rewards/chosen`, `rewards/rejected`,
`rewards/margins`, `logps/chosen`, `logps/rejected`; "chosen" = desirable rows); with `eval_data`,
the same over the held-out rows (`eval/...`), also in out/eval.jsonl with the value before step 1.

The reference is never a second model, as in DPO (`recipes/dpo_mistral.py`): the base with the
adapter switched off (fresh adapter), a frozen copy of the Stage A adapter (`init_adapter=DIR`),
or either one precomputed once (`precompute_ref=true`, cached in out/ref_logps/, the KL rows too).

A vision-language folder (Qwen2.5-VL, Qwen3-VL, Gemma 3) reads images in a chat prompt (TRL's `images` column with
`{"type": "image"}` parts, or parts with a path; paths from the data file's folder): a row and its KL row
(the same prompt) see them, the reference too. Such a row is never cut (longer than `max_len`: one error).
"""

from __future__ import annotations

import functools

import models
from minitrain.bundled import demo_dir
from minitrain.device import resolve_precision
from minitrain.errors import UserError
from minitrain.objectives.configs import KTOConfig
from minitrain.objectives.kto import KTOObjective, add_kl_rows, collate_kto, precompute_kto_reference
from minitrain.objectives.reference import make_reference
from minitrain.progress import log
from minitrain.run import (Job, attach_adapters, check_out_dir, eval_log, evaluate_at_start, evaluate_only, finish,
                           load_image_examples, load_model, load_tokenizer, prepare_out_dir, rows_have_images,
                           with_images)
from minitrain.train import train

DEMO = demo_dir()  # demo/ in a clone, minitrain/demo in an installed wheel

config = KTOConfig(
    model=str(DEMO / "model"),
    data=str(DEMO / "kto_train.jsonl"),
    eval_data=str(DEMO / "kto_eval.jsonl"),
    out="runs/kto_mistral",
    max_steps=100,
    batch_size=8,
    grad_accum=1,
    lr=2e-3,
    warmup=0.1,
    schedule="cosine",
    max_len=128,
    log_every=10,
    eval_every=20,
    lora_r=8,
    lora_alpha=16.0,
    lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"],
    beta=0.1,
)


def setup(config: KTOConfig) -> Job:
    """Load the model, attach (or continue) the adapter, pick the reference, read the rows; writes nothing."""
    tok = load_tokenizer(config)
    # before the weights: seconds, not minutes; a vision-language checkpoint reads the prompts' images
    train_examples, eval_examples, images = load_image_examples(config, tok, "unpaired")
    model, tok = load_model(config, models.from_hf_config, tok)
    if model.is_encoder_decoder:
        raise UserError(f"{config.model}: is an encoder-decoder (T5) model — KTO here trains causal LMs")
    lora = attach_adapters(model, config, train_towers=rows_have_images(images, train_examples))
    reference = make_reference(model, config.init_adapter)  # before any step: the snapshot is Stage A
    train_examples = add_kl_rows(train_examples, config.batch_size)  # each KL row made when its example is read
    eval_examples = add_kl_rows(eval_examples, config.batch_size) if eval_examples else eval_examples
    good = int(train_examples.column("label").sum())
    bad = len(train_examples) - good
    ratio = (config.desirable_weight * good) / (config.undesirable_weight * bad) if bad else float("inf")
    log(f"kto: beta={config.beta}, desirable_weight={config.desirable_weight}, undesirable_weight="
        f"{config.undesirable_weight}; {good} desirable / {bad} undesirable rows (weighted ratio {ratio:.2f}, "
        f"TRL advises 1 to 4/3); reference = "
        + (f"Stage A adapter (frozen copy of {config.init_adapter})" if config.init_adapter
           else "base model (adapter disabled)")
        + (", precomputed once" if config.precompute_ref else ", run each step under no_grad"))
    objective = KTOObjective(config.beta, config.desirable_weight, config.undesirable_weight, reference)
    # a row's images in it and in its KL row (the same prompt), the reference's forward too
    collate = with_images(functools.partial(collate_kto, pad_id=tok.pad_id), images, copies=2)
    return Job(model, objective, train_examples, collate, eval_examples, lora, tok, images)


def run(config: KTOConfig) -> dict:
    """Train the adapter with KTO and save it; returns the loop's summary plus the held-out metrics."""
    check_out_dir(config)
    job = setup(config)
    if config.eval_only:  # KTO's loss and reward metrics of init_adapter (or the base) on the held-out rows
        return evaluate_only(config, job)
    out = prepare_out_dir(config, job)
    device = next(job.model.parameters()).device
    amp_dtype, _ = resolve_precision(config.precision, device)
    if config.precompute_ref:
        batch = config.ref_batch_size or 2 * config.batch_size
        for name, examples in (("train", job.train_examples), ("eval", job.eval_examples)):
            if examples:
                precompute_kto_reference(job.model, job.objective.reference, examples, out / "ref_logps" / name,
                                         job.tok.pad_id, batch, amp_dtype, log,
                                         spec=job.images.spec if job.images else None)

    record = eval_log(out)  # out/eval.jsonl: the value before step 1, then each evaluation (rank 0)
    evaluate_at_start(job, config, record)
    summary = train(job.model, job.objective, job.train_examples, job.collate, config,
                    eval_examples=job.eval_examples, eval_fn=record if job.eval_examples else None)
    finish(job.model, config, job.lora, summary)
    log(f"KTO adapter: {out / 'adapter'} (PEFT format)")
    return summary
