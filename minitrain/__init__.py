"""minitrain: fine-tuning in plain PyTorch that refuses to train silently wrong.

The engine is model-agnostic: it never imports `models/`. Recipes (plain Python files in
`recipes/`) are where the two meet. See DESIGN.md and docs/contracts.md.
"""

__version__ = "0.1.0"
