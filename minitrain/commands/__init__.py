"""The programs a user runs besides the recipes: `minitrain NAME ...` (and `python -m minitrain NAME`).

Each module is one subcommand with a `main(argv) -> int` (its flags are its own; `--help` lists
them). Like the recipes, and unlike the engine below them, they may import the model families
(`models/`). `minitrain --help` lists them (`minitrain.cli.COMMANDS`).

Modules, in reading order:
    merge       fold a LoRA adapter into its base and write a standalone HF folder
    generate    try a model (and an adapter) on a prompt: greedy, sampled, beams
    plan        a recipe's predicted peak GPU memory and what to change to make it fit
    audit       the gradient-path audit of a recipe: does every trainable tensor get gradient?
    export      a model (with an adapter folded in) as one GGUF file for llama.cpp
    evaluate    lm-evaluation-harness tasks on a model and adapter, with minitrain's model code
    plot        training curves of one or more runs on one figure (PNG)
"""
