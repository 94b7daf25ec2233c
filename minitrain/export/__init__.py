"""Export: a trained model in the file formats other programs run.

Modules, in reading order:
    gguf_file   HF-layout weights + config.json -> a GGUF file for llama.cpp: per-family tensor
                names, layouts and transforms, the model's metadata, f32 / f16 / bf16 / q8_0
    gguf_vocab  the tokenizer in GGUF's terms: sentencepiece scores or BPE merges, token types,
                special tokens, bos / eos / add_bos, the chat template

Both write with the `gguf` package (llama.cpp's own Python writer, the `export` extra).
`minitrain export` loads the model, folds an adapter in (`minitrain.adapters.merge`) and calls them.
"""
