"""recipes/sft_llama.py with its LoRA B frozen (LoRA-FA done backwards; tests/bad_inputs).

B is zero at init and cannot move, so A's gradient is zero for ever: the preflight must refuse it,
and refuse it before anything is written to `out` (even with overwrite=true over a finished run).
"""


import models
from minitrain.config import TrainConfig
from minitrain.run import check_out_dir, finish, prepare_out_dir, sft_job
from minitrain.train import train

config = TrainConfig(lora_targets=["q_proj", "v_proj"])


def run(config: TrainConfig) -> dict:
    check_out_dir(config)
    job = sft_job(config, models.from_hf_config)
    for name, p in job.model.named_parameters():
        if ".lora_B." in name:
            p.requires_grad_(False)
    prepare_out_dir(config, job)
    summary = train(job.model, job.objective, job.train_examples, job.collate, config)
    finish(job.model, config, job.lora, summary)
    return summary


