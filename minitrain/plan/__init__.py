"""Plan: how much memory will this run need, and does it fit? Answered from `config.json` and the
run's keys before any weight is read; and how many FLOPs a step does.

Modules, in reading order:
    predict    `predict(model shape, run shape) -> Plan`: what is counted and how; the shapes from
               `config.json` and from a recipe's config; what to change to use less
    run_shape  what a micro-batch looks like to memory (`RunShape`), the `Term`s and `Plan` a
               prediction returns, bytes per dtype and per quantized weight
    decoder    the decoder-only families' terms: LLaMA / Mistral / Qwen2 / Qwen3, Gemma, Phi-3
    moe        a mixture-of-experts checkpoint's terms (Qwen3-MoE, Qwen2-MoE, Mixtral): every expert in memory
    gpt_oss    gpt-oss: the experts' terms over attention with sinks written out, the clamped SwiGLU experts
    qwen3_5    Qwen3.5's Gated DeltaNet and gated attention blocks: chunk and state terms; its MoE sizes
    gemma4     Gemma 4's blocks, each its own: per-layer embeddings, kv-shared layers, the double-wide MLP
    vision     the vision-language checkpoints (Qwen2.5-VL, Qwen3-VL, Qwen3.5, Gemma 3): the text family's terms + the tower
    t5         T5's encoder-decoder terms
    sharded    one rank's memory under torchrun: parallel=fsdp (FSDP2's shards, gathered blocks) and ddp
    fit        the check a run makes before loading (`memory_check`, `auto_fit`, `gpu_mem`)
    flops      model FLOPs of a step: FLOP/s and MFU in metrics.jsonl
    measure    measured CPU peaks, to check the plan against
"""
