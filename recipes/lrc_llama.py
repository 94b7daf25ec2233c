"""Low-rank correction: QLoRA whose adapters start as the SVD of the quantization error (LoftQ).

    python -m minitrain recipes/lrc_llama.py model=path/to/llama data=train.jsonl out=runs/lrc max_steps=200

The base is quantized as it loads (`quantize=nf4` by default, or int8); every LoRA adapter on a
quantized linear is then set to the best rank-r approximation of `W - dequant(Q(W))`, with W read
from the checkpoint one tensor at a time (see `minitrain.lrc`), so training starts from a model
nearer the full-precision one than plain QLoRA's. `lrc_iters=5` runs LoftQ's alternation (the
base is re-quantized too). Works with `checkpointing=true` as is (non-reentrant; no
input-requires-grad hack). The saved adapter belongs on this same quantized base.
Data rows are as for SFT (`{"prompt","completion"}`, `{"messages"}`, `{"text"}`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


import models
from minitrain.config import TrainConfig, doc
from minitrain.collate import collate_causal
from minitrain.errors import UserError
from minitrain.lrc import init_lrc
from minitrain.objectives import sft
from minitrain.run import Job, attach_adapters, check_out_dir, finish, load_examples, load_model, log, prepare_out_dir
from minitrain.train import train


@dataclass
class LRCConfig(TrainConfig):
    """`TrainConfig` with a quantized base by default and the LoftQ iteration count."""

    quantize: str = doc("nf4", "quantize base linears as they load; the adapters start as the quantization error",
                        choices=("nf4", "int8"))
    lrc_iters: int = doc(1, "LoftQ alternations (1: one SVD of the error of the base as loaded)", ge=1)


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
    model, tok = load_model(config, models.from_hf_config)
    if model.is_encoder_decoder:
        raise UserError(f"{config.model}: is an encoder-decoder (T5) model — this recipe trains causal LMs")
    if config.init_adapter:
        raise UserError(f"init_adapter={config.init_adapter}: a saved adapter already holds trained values; the "
                        f"low-rank correction initialises new adapters — continue it with recipes/sft_llama.py "
                        f"(quantize={config.quantize}) instead")
    lora = attach_adapters(model, config)
    init_lrc(model, config.model, iters=config.lrc_iters, log=log)
    train_examples, eval_examples = load_examples(config, tok, "sft")
    return Job(model, sft, train_examples, functools.partial(collate_causal, pad_id=tok.pad_id), eval_examples,
               lora, tok)


def run(config: LRCConfig) -> dict:
    """Load, correct, train, save the adapter; returns the loop's summary."""
    check_out_dir(config)  # a refusal comes before minutes of loading
    job = setup(config)
    prepare_out_dir(config)
    summary = train(job.model, job.objective, job.train_examples, job.collate, config,
                    eval_examples=job.eval_examples)
    finish(job.model, config, job.lora, summary)
    return summary
