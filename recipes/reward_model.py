"""A reward model: any decoder family with a scalar head, trained on preference pairs (Bradley-Terry).

    python -m minitrain recipes/reward_model.py                       # the built-in demo (CPU, seconds)
    python -m minitrain recipes/reward_model.py model=/path/to/Qwen3-0.6B \\
        data=prefs.jsonl eval_data=prefs_eval.jsonl out=runs/rm      # LoRA + the head, 12 GB GPU
    python -m minitrain recipes/reward_model.py model=... data=... finetune=full    # every weight

Rows are DPO's (`{"prompt", "chosen", "rejected"}`, TRL's conversational `{"chosen": [...],
"rejected": [...]}`, any file format of docs/data.md), with an optional `margin` column: a number
subtracted from the reward gap (TRL's RewardTrainer), 0 where a row has none. Each answer is scored
after its prompt, `[bos] prompt answer [eos]` (a chat prompt through the checkpoint's chat template).

The model is the checkpoint with its LM head taken off and a `score` head (hidden -> 1) put on, read
at each sequence's last non-pad token as transformers' `XForSequenceClassification` reads it. The
loss is TRL's: `-logsigmoid(r_chosen - r_rejected - margin)` per pair, plus
`center_rewards_coefficient * (r_chosen + r_rejected)^2` when set. metrics.jsonl logs `accuracy`,
`margin`, `rewards/chosen`, `rewards/rejected`, `mean_reward`; with held-out pairs (`eval_data` or
`eval_split`) the same as `eval/accuracy`, ... every `eval_every` steps, at the end and before step 1
(out/eval.jsonl).

What it writes: with LoRA (the default), `out/adapter/` in peft's format, task SEQ_CLS, the head
trained whole as `modules_to_save=score` (`PeftModel.from_pretrained` over
`AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, pad_token_id=<the run's pad
id, printed at the end>)`); with `finetune=full`, `out/model/`, an HF folder of
`XForSequenceClassification` (num_labels 1, `pad_token_id` set) that
`AutoModelForSequenceClassification.from_pretrained` loads and that GRPO scores with
(`recipes/grpo_qwen.py rewards=model:runs/rm/model`); `minitrain merge --model BASE --adapter
runs/rm/adapter --out runs/rm/merged` makes such a folder of a LoRA run.

Only a command that names none of model / data / eval_data trains the committed demo (demo/: the
tiny Mistral and the DPO demo's pairs, which prefer the summary that copies every fact of the note;
its held-out pairs are about people seen in no training pair).
"""

from __future__ import annotations

import functools

import models
from minitrain.bundled import demo_dir
from minitrain.objectives.configs import RewardConfig
from minitrain.objectives.reward_model import (RewardObjective, attach_score, collate_reward_pairs,
                                               with_scalar_head)
from minitrain.progress import log
from minitrain.run import (Job, attach_adapters, check_out_dir, eval_log, evaluate_at_start, evaluate_only, finish,
                           load_examples, load_model, load_tokenizer, prepare_out_dir)
from minitrain.train import train

DEMO = demo_dir()  # demo/ in a clone, minitrain/demo in an installed wheel

config = RewardConfig(  # a real run: model= and data= are asked for
    out="runs/reward_model",
    max_steps=-1,
    epochs=1.0,
    batch_size=4,
    grad_accum=4,
    lr=1e-4,
    warmup=0.03,
    schedule="linear",
    max_len=1024,
    log_every=10,
    lora_r=16,
    lora_alpha=32.0,
    lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"],
    checkpointing=True,
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
)


def setup(config: RewardConfig) -> Job:
    """Load the model with a scalar head, attach the adapter (the head trains whole), read the pairs;
    writes nothing."""
    tok = load_tokenizer(config)
    train_examples, eval_examples = load_examples(config, tok, "preference", margin=True)  # before the weights
    model, tok = load_model(config, with_scalar_head(models.from_hf_config), tok)
    attach_score(model, config.seed, tok.pad_id)  # a fresh head unless the folder is a reward model already
    lora = attach_adapters(model, config)
    log(f"reward model: scalar head `score` on the last non-pad token (pad id {tok.pad_id}); loss Bradley-Terry"
        + (f" + {config.center_rewards_coefficient} x (r_chosen + r_rejected)^2" if config.center_rewards_coefficient
           is not None else "") + ", minus each pair's margin column where given")
    if not eval_examples:
        log("note: no eval_data — no held-out accuracy (pass eval_data=pairs.jsonl or eval_split=0.05)")
    objective = RewardObjective(tok.pad_id, config.center_rewards_coefficient)
    collate = functools.partial(collate_reward_pairs, pad_id=tok.pad_id, shared_prompt=config.shared_prompt)
    return Job(model, objective, train_examples, collate, eval_examples, lora, tok)


def run(config: RewardConfig) -> dict:
    """Train the reward model and save it; returns the loop's summary plus the held-out metrics."""
    check_out_dir(config)
    job = setup(config)
    if config.eval_only:
        return evaluate_only(config, job)
    out = prepare_out_dir(config, job)
    record = eval_log(out)
    evaluate_at_start(job, config, record)
    summary = train(job.model, job.objective, job.train_examples, job.collate, config,
                    eval_examples=job.eval_examples, eval_fn=record if job.eval_examples else None)
    folder = finish(job.model, config, job.lora, summary)
    if "eval/accuracy" in summary:
        log(f"held-out accuracy {summary['eval/accuracy']:.3f} (chosen scored above rejected)")
    if job.lora is not None:
        log(f"reward model adapter (peft, SEQ_CLS, head in modules_to_save): {folder} — load it over "
            f"AutoModelForSequenceClassification.from_pretrained({config.model!r}, num_labels=1, "
            f"pad_token_id={job.tok.pad_id})")
    else:
        log(f"reward model (XForSequenceClassification): {folder} — GRPO scores with it: rewards=model:{folder}")
    return summary
