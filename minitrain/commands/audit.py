"""Gradient-path audit for any recipe: does every trainable tensor get gradient from the loss?

    minitrain audit recipes/sft_llama.py model=path/to/llama data=train.jsonl [key=value ...]
    minitrain audit recipes/dpo_mistral.py --json

Builds the recipe's job exactly as a run would (its `setup(config)`: model, adapters, data),
then runs ONE forward and backward on a 32-token slice of the shortest example of the data (no optimizer step, nothing
written) and prints a table per module (tensors, status, gradient norm), the gradient norm per
layer (does signal reach the deep layers?) and a one-line verdict.

Exit code: 0 healthy, 1 broken (a trainable tensor unreachable from the loss, a loss without a
graph, an optimizer missing tensors, ...), 2 bad input (recipe, key, file).
See docs/audit.md for the output on a healthy run and on each failure it names.
"""

from __future__ import annotations

import contextlib
import sys

from minitrain.audit import audit
from minitrain.cli import load_recipe, recipe_path, resolve_config
from minitrain.config import validate
from minitrain.errors import UserError
from minitrain.train import audit_inputs


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    args = [a for a in argv if a != "--json"]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if args else 2
    try:
        recipe = load_recipe(recipe_path(args[0]))
        config, _ = resolve_config(recipe, args[1:])  # a recipe's demo settings only without model / data
        validate(config)
        setup = getattr(recipe.module, "setup", None)
        if setup is None:
            raise UserError(f"{args[0]}: has no setup(config) function — a recipe exposes setup() so tools can build "
                            f"its job without training (see recipes/sft_llama.py)")
        # with --json, stdout carries the JSON alone: the recipe's progress lines go to stderr
        with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
            job = setup(config)
            batch, optimizer, amp_dtype = audit_inputs(job.model, job.train_examples, job.collate, config)
            report = audit(job.model, job.objective, batch, optimizer=optimizer, amp_dtype=amp_dtype)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.to_json() if as_json else report.table())
    return 0 if report.ok else 1

