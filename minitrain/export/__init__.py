"""Export: a trained model in the file formats other programs run.

Modules, in reading order:
    gguf_file   HF-layout weights + config.json -> a GGUF file for llama.cpp: per-family tensor
                names, layouts and transforms, the model's metadata, f32 / f16 / bf16 / q8_0
    gguf_gemma4 Gemma 4 as llama.cpp's gemma4 reads it: its keys (two head dims, shared keys, per-layer
                inputs), the proportional RoPE's `rope_freqs`, its renamed scales, what it refuses
    gguf_vocab  the tokenizer in GGUF's terms: sentencepiece scores or BPE merges, token types,
                special tokens, bos / eos / add_bos, the chat template

They write with the `gguf` package (llama.cpp's own Python writer, the `export` extra).
`minitrain export` loads the model, folds an adapter in (`minitrain.adapters.merge`) and calls them.
"""
