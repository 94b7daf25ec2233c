"""Low-rank correction: QLoRA whose adapters start as the SVD of the quantization error (LoftQ).

    python -m minitrain recipes/lrc_llama.py model=path/to/llama data=train.jsonl out=runs/lrc max_steps=200

The base is quantized as it loads (`quantize=nf4` by default, int8, or ternary: BitNet b1.58's
{-1, 0, +1} x absmean scale, `ternary_scale=tensor|channel`, `ternary_act_bits=8` for BitLinear's
8-bit activations); every LoRA adapter on a quantized linear is then set to the best rank-r
approximation of `W - dequant(Q(W))`, with W read from the checkpoint one tensor at a time (see
`minitrain.adapters.lrc`), so training starts from a model nearer the full-precision one than plain
QLoRA's. `lrc_rank=0.15` gives each adapter 15% of its layer's full rank min(out, in) (an integer:
that rank; unset: lora_r); `lrc_calibration=8` weights the error by the inputs of 8 training
micro-batches (activation-aware); `lrc_iters=5` runs LoftQ's alternation (the base is
re-quantized too). Works with `checkpointing=true` and `compile=true` as is (non-reentrant; no
input-requires-grad hack; embeddings stay frozen). The saved adapter belongs on this same
quantized base (`minitrain merge --quantize ternary` folds it into the dequantized base). Data rows are as for SFT (`{"prompt","completion"}`, `{"messages"}`, `{"text"}`).

Field report 004's setup on a Qwen3 checkpoint:

    python -m minitrain recipes/lrc_llama.py model=path/to/qwen3 data=train.jsonl quantize=ternary \
        lrc_rank=0.15 lora_targets=all-linear checkpointing=true compile=true out=runs/lrc_ternary
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import models
from minitrain.adapters.lrc import init_lrc, lrc_ranks
from minitrain.config import TrainConfig, doc, format_value
from minitrain.data.collate import collate_causal
from minitrain.errors import UserError
from minitrain.objectives.sft import sft
from minitrain.progress import log
from minitrain.parallel.fsdp import whole_model_only
from minitrain.run import (Job, attach_adapters, check_out_dir, evaluate_only, finish, load_examples, load_model,
                           load_tokenizer, lora_config, prepare_out_dir)
from minitrain.train import train


@dataclass
class LRCConfig(TrainConfig):
    """`TrainConfig` with a quantized base by default and the LoftQ iteration count."""

    quantize: str = doc("nf4", "quantize base linears as they load (ternary: BitNet b1.58, plain torch); the "
                               "adapters start as the quantization error", choices=("nf4", "int8", "ternary"))
    lrc_iters: int = doc(1, "LoftQ alternations (1: one SVD of the error of the base as loaded)", ge=1)
    lrc_rank: float = doc(0.0, "adapter rank: below 1 a fraction of each layer's full rank min(out, in) (0.15: "
                               "15%), 1 or more a rank (capped at the full rank); 0: lora_r", ge=0)
    lrc_calibration: int = doc(0, "activation-aware init: weight the error by each layer's input second moment "
                                  "over this many training micro-batches (0: plain SVD)", ge=0)

    def check(self) -> None:
        if self.finetune == "full":  # before TrainConfig's advice (quantize=none), which this recipe refuses
            raise UserError("finetune=full: this recipe trains adapters that correct a quantized base, and full "
                            "fine-tuning trains unquantized weights — use recipes/sft_llama.py finetune=full, or "
                            "drop finetune=full here")
        super().check()
        if self.lrc_rank >= 1 and self.lrc_rank != int(self.lrc_rank):
            raise UserError(f"lrc_rank={format_value(self.lrc_rank)}: 1 or more is a rank and must be whole — "
                            f"e.g. lrc_rank=16, or lrc_rank=0.15 for 15% of each layer's full rank")


config = LRCConfig(
    out="runs/lrc_llama",
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


def setup(config: LRCConfig) -> Job:
    """Load the quantized base, attach adapters, set them to the quantization error, read the data; writes nothing."""
    whole_model_only(config, "the low-rank correction (computed from the whole base weights)")
    tok = load_tokenizer(config)
    train_examples, eval_examples = load_examples(config, tok, "sft")  # before the weights: seconds, not minutes
    model, tok = load_model(config, models.from_hf_config, tok)
    if model.is_encoder_decoder:
        raise UserError(f"{config.model}: is an encoder-decoder (T5) model — this recipe trains causal LMs")
    if config.init_adapter:
        raise UserError(f"init_adapter={config.init_adapter}: a saved adapter already holds trained values; the "
                        f"low-rank correction initialises new adapters — continue it with recipes/sft_llama.py "
                        f"(quantize={config.quantize}) instead")
    lora = lora_config(config)
    if config.lrc_rank:
        r, pattern = lrc_ranks(model, lora.targets, config.lrc_rank)
        lora = replace(lora, r=r, rank_pattern=pattern)
        log(f"lrc: lrc_rank={format_value(config.lrc_rank)} -> rank {r}"
            + "".join(f", {k} {v}" for k, v in pattern.items()) + " (lora_r is not used)")
    lora = attach_adapters(model, config, lora)
    collate = functools.partial(collate_causal, pad_id=tok.pad_id)
    calibrate = None
    if config.lrc_calibration:
        device = model.input_embeddings.weight.device
        n = min(len(train_examples), config.batch_size * config.lrc_calibration)  # read only those (a store)
        batches = [train_examples[i:i + config.batch_size] for i in range(0, n, config.batch_size)]

        def calibrate(m):
            for rows in batches:
                batch = collate(rows)
                m(batch["input_ids"].to(device), batch["attention_mask"].to(device))

        log(f"lrc: calibrating on {len(batches)} micro-batches ({sum(map(len, batches))} examples)")
    init_lrc(model, config.model, iters=config.lrc_iters, log=log, calibrate=calibrate)
    return Job(model, sft, train_examples, collate, eval_examples, lora, tok)


def run(config: LRCConfig) -> dict:
    """Load, correct, train, save the adapter; returns the loop's summary."""
    check_out_dir(config)  # a refusal comes before minutes of loading
    job = setup(config)
    if config.eval_only:  # the corrected quantized base's held-out loss / perplexity, nothing trained
        return evaluate_only(config, job)
    prepare_out_dir(config, job)
    summary = train(job.model, job.objective, job.train_examples, job.collate, config,
                    eval_examples=job.eval_examples)
    finish(job.model, config, job.lora, summary)
    return summary
