"""Run configuration: one dataclass per recipe kind, fields documented in `metadata["help"]`.

`TrainConfig` holds the keys every training recipe has. Objective-specific recipes subclass it
(e.g. `DPOConfig(TrainConfig)` adds `beta`), so no god-config branches on the family or objective.
The CLI applies typed `key=value` overrides to these dataclasses (see `minitrain.cli`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def doc(default, help: str):
    """A dataclass field with its help text (shown by `python -m minitrain RECIPE.py --help`)."""
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    """Keys every training recipe has."""

    model: str = doc("", "HF-format model folder (config.json + *.safetensors + tokenizer)")
    data: str = doc("", "training data, JSONL")
    eval_data: str = doc("", "held-out data, JSONL (empty: no eval)")
    out: str = doc("runs/run", "output folder: metrics.jsonl, config.json, adapter/, checkpoint/")
    max_steps: int = doc(-1, "optimizer steps to run (-1: derived from epochs)")
    epochs: float = doc(1.0, "passes over the data when max_steps is -1")
    batch_size: int = doc(4, "examples per micro-batch (pairs for DPO)")
    grad_accum: int = doc(1, "micro-batches per optimizer step")
    lr: float = doc(2e-4, "peak learning rate")
    weight_decay: float = doc(0.0, "AdamW weight decay")
    max_grad_norm: float = doc(1.0, "clip the global gradient norm to this (0: no clipping)")
    warmup: float = doc(0.0, "warmup: optimizer steps if >= 1, else a ratio of the total steps")
    schedule: str = doc("cosine", "LR schedule after warmup: constant | linear | cosine")
    min_lr_ratio: float = doc(0.0, "cosine / linear decay floor as a fraction of lr")
    seed: int = doc(0, "seed for init, shuffling and dropout")
    max_len: int = doc(512, "maximum tokens per sequence (prompt + completion)")
    truncation_side: str = doc("left", "which end of an over-long prompt to cut: left | right")
    precision: str = doc("auto", "auto (bf16 autocast where supported, else fp32) | bf16 | fp32 | fp16")
    checkpointing: bool = doc(False, "non-reentrant activation checkpointing per block")
    compile: bool = doc(False, "torch.compile each block (CUDA only)")
    save_every: int = doc(0, "save a resumable checkpoint every N optimizer steps (0: only at the end)")
    eval_every: int = doc(0, "evaluate every N optimizer steps (0: only at the end)")
    log_every: int = doc(1, "write metrics every N optimizer steps")
    resume: bool = doc(False, "continue exactly from out/checkpoint")
    overwrite: bool = doc(False, "allow writing into an output folder that holds a different run")
    max_bad_steps: int = doc(5, "stop (with a checkpoint) after this many non-finite steps in a row")
    skip_audit: bool = doc(False, "skip the gradient-path audit before step 1 (the skip is logged)")
    # adapters
    lora_r: int = doc(16, "LoRA rank")
    lora_alpha: float = doc(32.0, "LoRA alpha (scaling alpha / r, or alpha / sqrt(r) with rslora)")
    lora_dropout: float = doc(0.0, "dropout on the LoRA input")
    lora_targets: list = doc(["q_proj", "k_proj", "v_proj", "o_proj"], "module-name suffixes to adapt, or ['all-linear']")
    rslora: bool = doc(False, "rank-stabilised LoRA scaling")
    modules_to_save: list = doc([], "modules to train fully (e.g. ['lm_head']): costly, reported loudly")
    init_adapter: str = doc("", "continue training this saved adapter folder (loaded trainable)")
    quantize: str = doc("none", "quantize base linears as they load: none | nf4 | int8 (needs bitsandbytes)")
