"""Adapters: what trains on a frozen base, and the forms the base is stored in.

Modules, in reading order:
    lora         LoRA layers on any base linear (float, nf4, int8, ternary): applied once, only
                 float tensors trainable, switched off for a reference (`disable_adapters`)
    lora_experts LoRA on a mixture-of-experts model's experts: each expert its own low-rank pair,
                 grouped like the experts' products; peft's `target_parameters` layout
    peft_format  adapters saved and loaded in PEFT's format
    merge        adapters folded into their base weights, the rounding error reported
    quant        quantized bases: each base linear quantized as its weight streams in (bitsandbytes
                 nf4 / int8, minitrain's ternary)
    quant_rows   nf4 / int8 bases as plain row-major tensors FSDP2 can shard (parallel=fsdp)
    quant_experts an MoE's experts quantized (nf4 / int8) each expert apart, dequantized one at a time
    ternary      the ternary (BitNet b1.58) linear: 2 bits a weight, plain torch
    lrc          low-rank correction: LoRA on a quantized base that starts at its quantization error
    ard          ARD-LoRA: gated rank components under an ARD prior (its objective is
                 `minitrain.objectives.ard`)
"""
