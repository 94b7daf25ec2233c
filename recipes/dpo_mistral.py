"""DPO (Stage B) on a Mistral checkpoint with a LoRA adapter — the reference without a second model.

    python -m minitrain recipes/dpo_mistral.py                       # the built-in demo (CPU, seconds)
    python -m minitrain recipes/dpo_mistral.py model=/path/to/Mistral-7B-Instruct-v0.2 \\
        data=prefs.jsonl eval_data=prefs_eval.jsonl quantize=nf4 out=runs/dpo   # 12 GB GPU

Rows are `{"prompt", "chosen", "rejected"}`: the prompt a string or a list of chat messages
(rendered with the checkpoint's chat template, e.g. Mistral's `[INST] ... [/INST]`), the answers
strings (or assistant messages); or TRL's conversational pairs `{"chosen": [...], "rejected":
[...]}` (the shared leading messages are the prompt). Any file format of docs/data.md. The loss is TRL's DPO (`loss_type` sigmoid | ipo | hinge |
robust, `beta`, `label_smoothing`), plus an optional NLL term on the chosen answers
(`sft_weight`). metrics.jsonl logs TRL's names each step (`rewards/chosen`, `rewards/rejected`,
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`); with `eval_data`, the
same on the held-out pairs (`eval/...`) every `eval_every` steps and at the end, in metrics.jsonl
and, with the value before step 1, in out/eval.jsonl.

`loss_type=orpo | cpo | simpo` trains without any reference (one forward per pair, TRL's ORPO and
CPO trainers' formulas and metric names, see `minitrain.objectives.preference`): ORPO adds the chosen NLL
(`sft_weight=1` as published) to `beta` x its odds-ratio term; CPO's NLL weight (TRL's `cpo_alpha`)
is `sft_weight`; SimPO uses `beta` and the margin `simpo_gamma` on per-token mean log-probs
(`sft_weight=0`: SimPO as published, `> 0`: TRL's CPO-SimPO). Left unset, `sft_weight` is each
method's own: 1 for orpo and cpo, 0 for simpo and the DPO losses.

A vision-language folder (Qwen2.5-VL, Qwen3-VL, Gemma 3) reads images in a chat prompt (TRL's vision rows: an
`images` column with `{"type": "image"}` parts, or parts with a path; paths from the data file's folder): both
answers, and the reference, see the same images (docs/preference.md). Such a pair is never cut (longer than
`max_len`: one error); `shared_prompt` and `packing` are refused with image pairs.

`packing=true` packs each micro-batch's chosen and rejected sequences into rows of up to `max_len`
tokens (positions restart, attention stays inside each sequence, log-probs summed per sequence: the
same loss and metrics, less padding; any loss_type). `shared_prompt=true` instead runs each pair as
one row `[prompt, chosen, rejected]`; the two do not combine.

The reference model is never loaded a second time (field report 002: two 7B models did not fit
12 GB):

- a fresh adapter: the reference is the base, i.e. this model with its adapter switched off;
- `init_adapter=runs/sft_mistral/adapter` (Stage A -> Stage B): that adapter keeps training — it
  is loaded trainable, nothing is stacked on it — and the reference is the Stage A policy, from a
  frozen copy of the adapter's tensors (not the base, which would be the wrong reference);
- `precompute_ref=true`: either reference is run once over the data before training and cached
  in out/ref_logps/ (reused while the weights, adapter, data, tokenizer and max_len are the same),
  so each step runs one forward instead of two.

The defaults are for a real 7B run (one epoch, 2 pairs x 8 accumulation, lr 5e-6, max_len
1024, LoRA r=16, checkpointing, `sft_weight=0` as in TRL): `model=` and `data=` must be given,
and without `eval_data` nothing is evaluated (the run says so). Only a command that names none
of model / data / eval_data trains the committed demo (demo/, written by tools/make_demo.py)
with the `demo` settings below: a tiny Mistral that, like the report's Stage A model, puts
invented facts in its summaries; the pairs prefer the summary that copies the note. Its
held-out pairs are about people seen in no training pair.
"""

from __future__ import annotations

import functools

import models
from minitrain.bundled import demo_dir
from minitrain.device import resolve_precision
from minitrain.errors import UserError
from minitrain.objectives.dpo import collate_with_reference
from minitrain.objectives.configs import REFERENCE_FREE, PreferenceConfig
from minitrain.objectives.preference import make_pair_objective
from minitrain.objectives.reference import make_reference, precompute_reference
from minitrain.progress import log
from minitrain.run import (Job, attach_adapters, check_out_dir, eval_log, evaluate_at_start, evaluate_only, finish,
                           load_image_examples, load_model, load_tokenizer, prepare_out_dir, rows_have_images,
                           with_images)
from minitrain.train import train

DEMO = demo_dir()  # demo/ in a clone, minitrain/demo in an installed wheel

config = PreferenceConfig(  # a real run: model= and data= are asked for; no eval_data, no held-out evaluation
    out="runs/dpo_mistral",
    max_steps=-1,
    epochs=1.0,
    batch_size=2,
    grad_accum=8,
    lr=5e-6,
    warmup=0.1,
    schedule="cosine",
    max_len=1024,
    log_every=10,
    lora_r=16,
    lora_alpha=32.0,
    lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"],
    checkpointing=True,  # a 7B model's activations at 2 pairs x 1024 tokens: ~25 GiB without it
    beta=0.1,
    loss_type="sigmoid",
)

# the built-in demo: used only when the command names none of model / data / eval_data
demo = dict(
    model=str(DEMO / "model"),
    data=str(DEMO / "prefs_train.jsonl"),
    eval_data=str(DEMO / "prefs_eval.jsonl"),
    max_steps=100,
    batch_size=8,
    grad_accum=1,
    lr=2e-3,
    max_len=128,
    eval_every=20,
    lora_r=8,
    lora_alpha=16.0,
    checkpointing=False,
    sft_weight=1.0,  # demo: pure DPO pushes the chosen log-probs down too and garbles generation
)

# for a 12 GB GPU: fits by minitrain plan (tests/test_advertised.py checks every advertised command)
REAL_CHECKPOINT = ("python -m minitrain recipes/dpo_mistral.py model=/path/to/Mistral-7B-Instruct-v0.2 "
                   "data=prefs.jsonl eval_data=prefs_eval.jsonl quantize=nf4 out=runs/dpo")


def setup(config: PreferenceConfig) -> Job:
    """Load the model, attach (or continue) the adapter, pick the reference, read the pairs; writes nothing."""
    tok = load_tokenizer(config)
    # before the weights: seconds, not minutes; a vision-language checkpoint reads the prompts' images
    train_examples, eval_examples, images = load_image_examples(config, tok, "preference")
    model, tok = load_model(config, models.from_hf_config, tok)
    if model.is_encoder_decoder:
        raise UserError(f"{config.model}: is an encoder-decoder (T5) model — DPO here trains causal LMs")
    lora = attach_adapters(model, config, train_towers=rows_have_images(images, train_examples))
    if config.loss_type in REFERENCE_FREE:  # orpo / cpo / simpo: one forward per pair, no reference
        reference, ref = None, "none (reference-free: one forward per pair)"
    else:
        reference = make_reference(model, config.init_adapter)  # before any step: the snapshot is Stage A
        ref = (f"Stage A adapter (frozen copy of {config.init_adapter})" if config.init_adapter
               else "base model (adapter disabled)")
        ref += ", precomputed once" if config.precompute_ref else ", run each step under no_grad"
    log(f"{'dpo' if reference else config.loss_type}: loss {config.loss_type}, beta={config.beta}"
        + (f", simpo_gamma={config.simpo_gamma}" if config.loss_type == "simpo" else "")
        + (f", label_smoothing={config.label_smoothing}" if config.label_smoothing else "")
        + (f", sft_weight={config.sft_weight}" if config.sft_weight else "")
        + f"; reference = {ref}")
    objective = make_pair_objective(config, reference)
    if not eval_examples:
        log("note: no eval_data — no held-out evaluation (pass eval_data=pairs.jsonl for eval/rewards/...)")
    collate = functools.partial(collate_with_reference, pad_id=tok.pad_id, shared_prompt=config.shared_prompt,
                                pack_len=config.max_len if config.packing else 0)
    # a pair's images in both of its rows (chosen, rejected), the reference's forward too
    return Job(model, objective, train_examples, with_images(collate, images, copies=2), eval_examples, lora, tok,
               images)


def run(config: PreferenceConfig) -> dict:
    """Train the adapter with DPO and save it; returns the loop's summary plus the held-out metrics."""
    check_out_dir(config)  # a refusal comes before minutes of loading
    job = setup(config)
    if config.eval_only:  # loss and reward metrics of init_adapter (or the base) on the held-out pairs
        return evaluate_only(config, job)
    out = prepare_out_dir(config, job)
    device = next(job.model.parameters()).device
    amp_dtype, _ = resolve_precision(config.precision, device)
    if config.precompute_ref:
        batch = config.ref_batch_size or 2 * config.batch_size
        for name, examples in (("train", job.train_examples), ("eval", job.eval_examples)):
            if examples:
                precompute_reference(job.model, job.objective.reference, examples, out / "ref_logps" / name,
                                     job.collate, batch, amp_dtype, log)

    # out/eval.jsonl: the loop has already scored the held-out pairs with the objective's own pass
    # (`DPOObjective.evaluate`: loss and TRL's metrics); step 0 is the value before step 1, where the
    # reference is the policy, so rewards are 0
    record = eval_log(out)
    evaluate_at_start(job, config, record)
    summary = train(job.model, job.objective, job.train_examples, job.collate, config,
                    eval_examples=job.eval_examples, eval_fn=record if job.eval_examples else None)
    folder = finish(job.model, config, job.lora, summary)
    log(f"Stage B {'adapter' if job.lora else 'model'}: {folder} ({'PEFT' if job.lora else 'HF'} format)")
    if (config.model, config.data) == (demo["model"], demo["data"]):
        log(f"to train a real checkpoint (12 GB GPU, QLoRA):\n  {REAL_CHECKPOINT}")
    return summary
