"""ARD-LoRA: a LoRA adapter with a Gaussian gate per rank component and an ARD prior (variational Bayes).

    python -m minitrain recipes/ard_lora_llama.py model=path/to/llama data=train.jsonl eval_data=dev.jsonl \\
        out=runs/ard max_steps=500 beta=1.0 ard_every=50 ece_bins=15

Each rank component k of each adapter is scaled by a gate z_k ~ N(mu_k, sigma_k^2) with the prior
N(0, 1/alpha_k) (see `minitrain.adapters.ard`). The loss per target token is the NLL plus `beta * KL / N`
(N: target tokens of the training set), the ELBO for beta = 1. Every `ard_every` optimizer steps
the prior is re-estimated (alpha_k = 1 / (mu_k^2 + sigma_k^2)) and the held-out data is scored for
token accuracy, NLL and expected calibration error (`ece_bins` bins; `uncertainty_samples` > 0
averages that many gate draws), written to out/ard.jsonl. metrics.jsonl logs `nll`, `kl` and
`kl_per_token` each step. The base is 4-bit (nf4) by default on a GPU with bitsandbytes; without
them it stays in float and the run says so. The saved adapter is the posterior-mean LoRA in
PEFT's format (out/adapter), with the gate distributions beside it (ard_gates.safetensors).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import models
from minitrain import checkpoint
from minitrain.adapters.ard import fold_gates, make_ard, save_gates
from minitrain.adapters.lora import trainable_report
from minitrain.adapters.quant import INSTALL, require_bitsandbytes
from minitrain.config import TrainConfig, doc
from minitrain.data.collate import collate_causal
from minitrain.parallel.distributed import main_only
from minitrain.errors import UserError
from minitrain.objectives.ard import ARDObjective, PriorSchedule, dataset_target_tokens, uncertainty_eval
from minitrain.progress import log
from minitrain.parallel.fsdp import whole_model_only
from minitrain.run import (ADAPTER_DIR, Job, attach_adapters, check_out_dir, evaluate_only, finish, load_examples,
                           load_model, load_tokenizer, prepare_out_dir)
from minitrain.train import build_optimizer, train

ARD_LOG = "ard.jsonl"


@dataclass
class ARDConfig(TrainConfig):
    """`TrainConfig` plus the gates, the prior schedule and the uncertainty evaluation."""

    quantize: str = doc("auto", "base linears: auto (nf4 on a GPU with bitsandbytes, else float) | none | nf4 | int8",
                        choices=("auto", "none", "nf4", "int8"))
    beta: float = doc(1.0, "weight of the KL term (1: the ELBO; the KL is spread over the training set's tokens)", ge=0)
    ard_every: int = doc(50, "re-estimate the ARD prior and score the held-out data every N optimizer steps (0: never)",
                         ge=0)
    gate_init_std: float = doc(0.1, "initial standard deviation of each gate (its mean starts at 1)", gt=0)
    ece_bins: int = doc(15, "equal-width confidence bins of the expected calibration error", ge=1)
    uncertainty_samples: int = doc(0, "gate draws averaged by the uncertainty eval (0: the posterior mean)", ge=0)
    uncertainty_batches: int = doc(8, "held-out batches per periodic uncertainty eval (0: all; the final one uses all)",
                                   ge=0)

    def check(self) -> None:
        if self.finetune == "full":
            raise UserError("finetune=full: ARD puts its gates on LoRA adapters — use finetune=lora")
        super().check()


config = ARDConfig(
    out="runs/ard_lora_llama",
    lr=1e-4,
    warmup=0.03,
    schedule="cosine",
    batch_size=4,
    grad_accum=16,
    max_len=2048,
    lora_r=16,
    lora_alpha=32.0,
    lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"],
)


def resolve_quantize(config: ARDConfig) -> str:
    """`quantize=auto`: nf4 where bitsandbytes is installed (its CPU kernels are slow but work), else none (said so)."""
    if config.quantize != "auto":
        return config.quantize
    try:
        require_bitsandbytes()
    except UserError:
        log(f"notice: quantize=auto: bitsandbytes is not installed, so the base stays in float ({INSTALL} "
            f"for a 4-bit base)")
        return "none"
    return "nf4"


def setup(config: ARDConfig) -> Job:
    """Load the base, attach LoRA with ARD gates, read the data; writes nothing."""
    whole_model_only(config, "ARD-LoRA's gates (made after the base is read)")
    tok = load_tokenizer(config)
    train_examples, eval_examples = load_examples(config, tok, "sft")  # before the weights: seconds, not minutes
    model, tok = load_model(dataclasses.replace(config, quantize=resolve_quantize(config)), models.from_hf_config, tok)
    if model.is_encoder_decoder:
        raise UserError(f"{config.model}: is an encoder-decoder (T5) model — this recipe trains causal LMs")
    lora = attach_adapters(model, config)
    names = make_ard(model, init_std=config.gate_init_std)
    log(f"ard: gates on {len(names)} adapters (mu=1, sigma={config.gate_init_std}, prior N(0, 1)); now "
        + trainable_report(model).splitlines()[0])
    objective = ARDObjective(dataset_target_tokens(train_examples), beta=config.beta)
    log(f"ard: KL x beta={config.beta} spread over {objective.dataset_tokens:,} training target tokens")
    return Job(model, objective, train_examples, functools.partial(collate_causal, pad_id=tok.pad_id), eval_examples,
               lora, tok)


def run(config: ARDConfig) -> dict:
    """Train the ARD-LoRA adapter, re-estimating the prior on schedule; save the posterior-mean adapter."""
    out = check_out_dir(config)
    job = setup(config)
    if config.eval_only:  # held-out loss / perplexity, then accuracy, NLL and ECE (as after training)
        def uncertainty(model, step, row):
            final = uncertainty_eval(model, job.eval_examples, job.collate, config.batch_size, bins=config.ece_bins,
                                     samples=config.uncertainty_samples)
            return {f"eval/{k}": v for k, v in final.items()}
        return evaluate_only(config, job, eval_fn=uncertainty)
    prepare_out_dir(config, job)
    model = job.model
    schedule = PriorSchedule(config.ard_every, out / ARD_LOG, eval_examples=job.eval_examples, collate=job.collate,
                             batch_size=config.batch_size, bins=config.ece_bins, samples=config.uncertainty_samples,
                             max_batches=config.uncertainty_batches, log=log)
    if config.resume:
        schedule.restore(model, checkpoint.read_state(out)["step"])  # the prior as it was at the checkpoint's step
    else:
        main_only(lambda: (out / ARD_LOG).unlink(missing_ok=True))  # (rank 0 writes it)
    device = next(model.parameters()).device
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = build_optimizer(named, config.weight_decay, config.lr, device)  # the loop's own default
    schedule.attach(optimizer, model)
    summary = train(model, job.objective, job.train_examples, job.collate, config, eval_examples=job.eval_examples,
                    optimizer=optimizer)
    if job.eval_examples:
        final = uncertainty_eval(model, job.eval_examples, job.collate, config.batch_size, bins=config.ece_bins,
                                 samples=config.uncertainty_samples)
        log(f"ard: held-out acc {final['acc']:.4f} nll {final['nll']:.4f} ece {final['ece']:.4f} "
            f"({final['tokens']} tokens, {config.ece_bins} bins)")
        summary.update({f"eval/{k}": v for k, v in final.items()})
    fold_gates(model)  # the PEFT adapter below is then the posterior mean
    finish(model, config, job.lora, summary)
    main_only(lambda: save_gates(model, out / ADAPTER_DIR / "ard_gates.safetensors"))  # (rank 0: one file)
    return summary
