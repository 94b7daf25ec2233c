"""Text: how a string or a conversation becomes the token ids the checkpoint's own tokenizer makes.

Modules, in reading order:
    tokenizer      `Tokenizer`: one interface over a model folder's tokenizer, its special tokens,
                   and the chat path (the checkpoint's template or a hand-written format)
    backends       the two engines behind it: sentencepiece models and HF `tokenizers` files
    chat_template  the checkpoint's Jinja chat template, rendered as transformers renders it, and
                   which of its tokens are targets
    chat_formats   the hand-written formats `chat_format=` selects (Mistral, Llama-2, Llama-3)

The tokenizer imports the two chat modules; they take the tokenizer as an argument (a
`Vocabulary`: the few things they ask of it) and never import it.
"""
