"""Seq2seq LoRA on T5 / FLAN-T5, evaluated by generation (ROUGE-1/2/L), with early stopping.

Trains on JSONL rows `{"prompt": "...", "completion": "..."}` (other key names: `fields`):

    python -m minitrain recipes/lora_t5.py model=/path/to/flan-t5-base data=train.jsonl \\
        eval_data=val.jsonl out=runs/flan-t5-base eval_every=500 patience=10   # 12 GB GPU
    python -m minitrain recipes/lora_t5.py ... fields='{"prompt": "context", "completion": "question"}'

Loss: decoder cross-entropy on the completion + eos, teacher-forced (objective `seq2seq`). Every
`eval_every` optimizer steps and at the end, on `eval_data`: `eval/loss`, then the model generates
(greedy, or beam search with `num_beams`) and is scored against the references with ROUGE
(`eval/rouge1`, `eval/rouge2`, `eval/rougeL`: mean F-measure, rouge-score's tokenisation, no
stemming). `out/best_adapter` keeps the adapter of the best evaluation by `early_stop_metric`;
with `patience` > 0 the run stops after that many evaluations without an improvement larger
than `min_delta`.

LoRA: r=16 on every attention and feed-forward projection (`q k v o`, and `wi_0 wi_1 wo` on
v1.1 / FLAN-T5 or `wi wo` on T5 v1.0: the default list keeps those the model has; a target you
list yourself must name a module of the model).
`packing=true` packs each micro-batch's examples into rows of up to `max_len` encoder and
`max_target_len` decoder tokens, attention kept inside each example (the same loss; no padding).
Precision: bf16 autocast where the GPU supports it (`precision=auto`); T5's activations overflow
float16, so `precision=fp16` is refused. `warmup` below 1 is a ratio of the optimizer steps.

`added_tokens='["[Question]"]'` (JSON, as the value starts with "[") adds special tokens to the tokenizer and grows the embedding and head
(new rows: the mean of the old ones) BEFORE the adapters attach; the adapter then records the
grown vocabulary size, and `out/adapter` holds the tokenizer with the new tokens. To use such an
adapter elsewhere: load the tokenizer from the adapter folder, `model.resize_token_embeddings`
to its size, then load the adapter. The new rows only train if you also pass
`modules_to_save=shared,lm_head`, which trains both matrices in full (costly; reported loudly).

Writes out/config.json, metrics.jsonl, predictions/step_NNNNNNN.jsonl (every evaluation's outputs
with per-example scores), checkpoint/ (resume=true), adapter/ (last step) and best_adapter/
(PEFT format, with the tokenizer). Compare runs: `minitrain plot runs/a runs/b --metric
loss,eval/rougeL --out curves.png`. `--help` lists every key.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

import models
from models.t5 import generate
from minitrain.adapters.peft_format import adapter_vocab_size
from minitrain.config import TrainConfig, doc
from minitrain.parallel.distributed import main_only
from minitrain.data.collate import collate_seq2seq
from minitrain.data.packing import collate_packed_seq2seq
from minitrain.device import base_dtype, pick_device
from minitrain.errors import UserError
from minitrain.evaluate.generation import BEST_DIR, BEST_FILE, PREDICTIONS_DIR, EarlyStopping, GenerationEval
from minitrain.objectives.sft import seq2seq
from minitrain.progress import log
from minitrain.run import (ADAPTER_DIR, Job, attach_adapters, check_out_dir, eval_log, evaluate_at_start, evaluate_only,
                           finish, load_examples, load_model, load_tokenizer, prepare_out_dir, write_adapter)
from minitrain.text.tokenizer import Tokenizer
from minitrain.train import train

T5_TARGETS = ["q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo"]


@dataclass
class Seq2SeqConfig(TrainConfig):
    """TrainConfig plus the keys of a generation-evaluated seq2seq run."""

    max_target_len: int = doc(256, "maximum decoder tokens per example (completion + eos); longer ones are cut", ge=1)
    added_tokens: list[str] = doc([], 'special tokens to add, e.g. \'["[Question]"]\'; embeddings grow before adapters attach')
    num_beams: int = doc(1, "generation at eval: 1 is greedy, more is beam search", ge=1)
    max_new_tokens: int = doc(128, "tokens generated per eval example at most", ge=1)
    early_stop_metric: str = doc("eval/rougeL", "the eval metric that picks out/best_adapter and drives patience",
                                 choices=("eval/rougeL", "eval/rouge1", "eval/rouge2", "eval/loss"))
    patience: int = doc(0, "stop after this many evaluations in a row without improvement (0: never stop early)", ge=0)
    min_delta: float = doc(0.0, "an improvement must exceed this to reset patience (best_adapter follows any gain)",
                           ge=0)
    packing: bool = doc(False, "pack each micro-batch's examples into rows of up to max_len encoder and max_target_len "
                               "decoder tokens (attention stays inside each example; same loss, no padding)")

    def check(self) -> None:
        super().check()
        if self.finetune == "full":
            raise UserError("finetune=full: this recipe keeps the best LoRA adapter by its eval metric — use "
                            "finetune=lora")
        if self.precision == "fp16":
            raise UserError("precision=fp16: T5 activations overflow float16 (inf, then NaN loss) — use "
                            "precision=bf16 on a GPU that has it, or fp32 (precision=auto picks for you)")
        for k, v in self.fields.items():
            if k not in ("prompt", "completion") or not isinstance(v, str) or not v:
                raise UserError(f"fields: {json.dumps({k: v})} — map \"prompt\" and/or \"completion\" to the key "
                                f"names of your rows, e.g. fields={{\"prompt\": \"question\"}}")
        if self.patience and not self.eval_data:
            raise UserError(f"patience={self.patience}: early stopping needs eval_data — pass eval_data=val.jsonl, "
                            f"or patience=0")
        if self.patience and not self.eval_every:
            raise UserError(f"patience={self.patience}: with eval_every=0 the run is evaluated only at its end — "
                            f"pass eval_every=<optimizer steps between evaluations>")


config = Seq2SeqConfig(
    out="runs/lora_t5",
    lr=3e-4,
    warmup=0.06,
    schedule="linear",
    batch_size=8,
    grad_accum=1,
    max_len=512,
    lora_r=16,
    lora_alpha=32.0,
    lora_dropout=0.05,
    lora_targets=list(T5_TARGETS),
)


def add_tokens(model, tok: Tokenizer, tokens: list[str]) -> None:
    """Add special tokens, then grow the embedding and head to the tokenizer's size (never shrink).

    Before the adapters attach, so the adapter (and any modules_to_save copy) sees the final
    vocabulary. T5 checkpoints carry spare rows (32128 rows for 32100 tokens): tokens that fit
    there need no resize, but their rows were never trained either.
    """
    if not tokens:
        return
    new = tok.add_special_tokens(tokens)
    ids = {t: tok.token_to_id(t) for t in tokens}
    rows = model.input_embeddings.num_embeddings
    if tok.vocab_size > rows:
        model.resize_token_embeddings(tok.vocab_size)
        log(f"added_tokens: {new} new ({ids}); embedding and head resized {rows} -> {tok.vocab_size} rows "
            f"(new rows = mean of the old ones)")
    else:
        log(f"added_tokens: {new} new ({ids}); they fit in the model's {rows} embedding rows, no resize")


def check_init_adapter_vocab(cfg: Seq2SeqConfig, model) -> None:
    """An adapter trained with added tokens needs the same tokens here: say which, before loading."""
    if not cfg.init_adapter:
        return
    vocab = adapter_vocab_size(cfg.init_adapter)  # None: load_adapter reports what is wrong with the folder
    rows = model.input_embeddings.num_embeddings
    if vocab is None or vocab == rows:
        return
    hint = ""
    try:
        saved = Tokenizer.from_folder(cfg.init_adapter)  # the recipe saves the tokenizer with the adapter
        extra = [saved.id_to_token(i) for i in range(rows, saved.vocab_size)]
        if extra and all(extra):
            hint = f" (its tokenizer adds {', '.join(extra)})"
    except (UserError, OSError, ValueError):
        pass
    raise UserError(f"init_adapter={cfg.init_adapter}: the adapter was trained with {vocab} embedding rows, this "
                    f"model has {rows} — pass the added_tokens of the run that trained it{hint}, so the embeddings "
                    f"are resized before the adapter loads")


def read_examples(cfg: Seq2SeqConfig, tok: Tokenizer) -> tuple[list[dict], list[dict] | None]:
    """(train, eval) seq2seq examples, with `fields` and `max_target_len` (eval: None without eval_data
    or eval_split)."""
    return load_examples(cfg, tok, "seq2seq", max_target_len=cfg.max_target_len)


def t5_targets(config: Seq2SeqConfig, model) -> Seq2SeqConfig:
    """The recipe's default targets name both T5 feed-forward layouts (`wi` on v1.0; `wi_0`, `wi_1` on
    v1.1 / FLAN-T5): keep those this model has. Targets the user lists must all exist."""
    if list(config.lora_targets) != T5_TARGETS:
        return config
    leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    return dataclasses.replace(config, lora_targets=[t for t in T5_TARGETS if t in leaves])


def setup(config: Seq2SeqConfig) -> Job:
    """Read the data (tokenizer only), load the model, add tokens, attach the adapter; writes nothing."""
    tok = load_tokenizer(config)
    tok.add_special_tokens(config.added_tokens)  # the data is tokenized with them
    train_examples, eval_examples = read_examples(config, tok)  # a bad row costs seconds, not a model load
    model, tok = load_model(config, models.from_hf_config)  # its own tokenizer: add_tokens grows the model to it
    if not model.is_encoder_decoder:
        raise UserError(f"{config.model}: is a causal LM ({model.hf_config.get('model_type')}) — this recipe trains "
                        f"T5 / FLAN-T5; use recipes/sft_llama.py")
    add_tokens(model, tok, config.added_tokens)
    check_init_adapter_vocab(config, model)
    lora = attach_adapters(model, t5_targets(config, model))
    start = model.config.decoder_start_token_id
    collate = (functools.partial(collate_packed_seq2seq, pad_id=tok.pad_id, max_len=config.max_len,
                                 max_target_len=config.max_target_len, decoder_start_id=start) if config.packing
               else functools.partial(collate_seq2seq, pad_id=tok.pad_id, decoder_start_id=start))
    return Job(model, seq2seq, train_examples, collate, eval_examples, lora, tok)


def generation_eval(config: Seq2SeqConfig, job: Job, save_best) -> GenerationEval:
    """ROUGE of greedy (or beam) outputs on the held-out rows, the best adapter kept, early stopping."""
    dtype = base_dtype(config.precision, pick_device(config.device))
    stopper = EarlyStopping(config.early_stop_metric, config.patience, config.min_delta)
    return GenerationEval(job.eval_examples, job.tok, generate, out_dir=config.out, save_best=save_best,
                          stopper=stopper, batch_size=config.batch_size, max_new_tokens=config.max_new_tokens,
                          num_beams=config.num_beams, amp_dtype=None if dtype == torch.float32 else dtype)


def run(config: Seq2SeqConfig) -> dict:
    """Load, add tokens, adapt, train with generation eval, save the last and the best adapter."""
    check_out_dir(config)  # a refusal comes before minutes of loading
    job = setup(config)
    model, tok, lora, eval_examples = job.model, job.tok, job.lora, job.eval_examples
    if config.eval_only:  # loss, perplexity and ROUGE of the base (or init_adapter); predictions in out/predictions
        rouge = generation_eval(config, job, None)
        return evaluate_only(config, job, eval_fn=lambda m, step, row: rouge.score(m, step))
    out = prepare_out_dir(config, job)
    if not config.resume:  # no stale best adapter or predictions beside a new run
        main_only(lambda: [shutil.rmtree(out / stale, ignore_errors=True) for stale in (BEST_DIR, PREDICTIONS_DIR)])

    def save_with_tokenizer(m, folder: Path) -> None:  # every rank calls it; rank 0 writes
        write_adapter(m, folder, lora)
        main_only(lambda: tok.save(folder))

    eval_fn = None
    if eval_examples:
        rouge = generation_eval(config, job, save_with_tokenizer)
        # out/eval.jsonl: step 0 (the model it starts from: loss and ROUGE, outside early stopping), then
        # each of the loop's evaluations
        evaluate_at_start(job, config, eval_log(out, lambda m, step, row: rouge.score(m, step)))
        eval_fn = eval_log(out, rouge)
    summary = train(model, seq2seq, job.train_examples, job.collate, config, eval_examples=eval_examples,
                    eval_fn=eval_fn)
    finish(model, config, lora, summary)
    main_only(lambda: tok.save(out / ADAPTER_DIR))
    if (out / BEST_DIR / BEST_FILE).is_file():
        best = json.loads((out / BEST_DIR / BEST_FILE).read_text())
        log(f"best adapter: {out / BEST_DIR} (step {best['step']}, {best['metric']} {best['value']:.4f})")
    return summary
