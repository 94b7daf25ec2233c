"""Low-rank correction (LoftQ-initialised QLoRA) on any causal family minitrain loads (LLaMA,
Mistral, Qwen2 / Qwen2.5, Qwen3, Gemma 2, Gemma 3, Phi-3): the family-agnostic name of
recipes/lrc_llama.py, whose code it runs (same keys, defaults and outputs; `--help` lists them).

    python -m minitrain recipes/lrc.py model=/path/to/Qwen3-0.6B data=train.jsonl out=runs/lrc max_steps=200 \\
        checkpointing=true   # 12 GB GPU

recipes/lrc_llama.py is the canonical file (named when LLaMA was the only family; its docstring
documents the method); this alias exists so a command's name does not mislead.
"""

from minitrain.bundled import recipes_dir
from minitrain.cli import load_recipe

globals().update({k: v for k, v in vars(load_recipe(str(recipes_dir() / ("lrc_llama.py"))).module).items()
                  if not k.startswith("__")})
