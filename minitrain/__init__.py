"""minitrain: fine-tuning in plain PyTorch that refuses to train silently wrong.

The engine is model-agnostic: it never imports `models/`. Recipes (plain Python files in
`recipes/`) are where the two meet. The floor plan, in reading order (docs/design.md has it with
the direction of imports; docs/contracts.md the imports a recipe may rely on):

The loop and its services (this folder):
    cli          `python -m minitrain RECIPE.py key=value`: load the recipe, typed overrides, run it
    config       the run's keys: `TrainConfig` and its checks
    run          the steps a recipe takes in order: tokenizer, examples, model, adapters, finish
    train        the training loop, one function top to bottom
    checkpoint   resumable checkpoints (safetensors + JSON, atomic)
    checkpoint_shards  a checkpoint's tensors on disk: whole, or one part per rank (FSDP)
    optim        AdamW
    schedule     learning rate as a pure function of the optimizer step
    device       the device, the frozen weights' dtype, autocast
    cpu          how many threads a CPU run uses
    distributed  torchrun: the process group and the few collectives the loop uses
    progress     what a run prints and where its metrics go
    ema          a moving average of the trained tensors
    audit        does every trainable tensor get a gradient from the loss?
    weights      HF safetensors in and out, a tensor at a time
    errors       `UserError`: one line and exit code 2

The wings (each folder's docstring lists its modules):
    data/        files -> rows -> examples -> batches
    text/        tokenizers, chat templates, hand-written chat formats
    adapters/    what trains on a frozen base: LoRA, quantized bases, ternary, LRC, ARD
    objectives/  (model, batch) -> (loss sum, count, metrics)
    evaluate/    held-out evaluation that generates
    plan/        memory before the weights are read, FLOPs
"""

__version__ = "0.1.0"
