"""SFT with a LoRA adapter on any causal family minitrain loads (LLaMA, Mistral, Qwen2 / Qwen2.5,
Qwen3, Gemma 2, Gemma 3, Phi-3): the family-agnostic name of recipes/sft_llama.py, whose code it
runs (same keys, defaults and outputs; `--help` lists them).

    python -m minitrain recipes/sft.py model=/path/to/Qwen3-0.6B data=train.jsonl out=runs/sft   # 12 GB GPU

recipes/sft_llama.py is the canonical file (named when LLaMA was the only family; its docstring
documents the rows and outputs); this alias exists so a command's name does not mislead.
"""

from minitrain.bundled import recipes_dir
from minitrain.cli import load_recipe

globals().update({k: v for k, v in vars(load_recipe(str(recipes_dir() / ("sft_llama.py"))).module).items()
                  if not k.startswith("__")})
