"""Held-out answer accuracy of a chat model (and an adapter): the share of rows whose greedy answer is the label.

    python tools/answer_accuracy.py --model demo/vl_colours/model --data demo/vl_colours/eval.jsonl
    python tools/answer_accuracy.py --model demo/vl_colours/model --adapter runs/vl_colours/adapter \\
        --data demo/vl_colours/eval.jsonl

Rows are SFT chat rows (`{"messages"}`, with images for a vision-language checkpoint: docs/data.md), read
as `recipes/sft.py` reads them (the chat template, the images decoded per batch). A row counts as answered
when every assistant token, its end-of-turn token included, is the model's most likely next token given the
conversation before it: exactly when greedy decoding from the prompt writes the answer and stops (what
tests/test_vl_demo.py checks against generation), in one forward per batch. Prints one line:
`accuracy 0.930 (93/100)`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere in a checkout

import models  # noqa: E402
from minitrain.config import SFTConfig  # noqa: E402
from minitrain.data.collate import IGNORE_INDEX  # noqa: E402
from minitrain.objectives.losses import shift_labels  # noqa: E402
from minitrain.objectives.sft import causal_hidden  # noqa: E402
from minitrain.run import sft_job  # noqa: E402


def answered(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B,) bool: every target token of the row is the argmax of the logits before it."""
    targets = shift_labels(batch["labels"])  # (B, T): the next token where it is a target, else -100
    with torch.no_grad():
        guess = model.output_projection(causal_hidden(model, batch)).argmax(-1)  # (B, T)
    scored = targets != IGNORE_INDEX
    return ((guess == targets) | ~scored).all(-1) & scored.any(-1)


def accuracy(model_dir: str, data: str, adapter: str = "", batch_size: int = 16) -> tuple[int, int]:
    """(rows answered, rows) over the file `data`, with the model (and adapter) loaded as a run loads them."""
    cfg = SFTConfig(model=model_dir, data=data, init_adapter=adapter, device="cpu", precision="fp32",
                    data_cache="false", max_len=4096)
    with contextlib.redirect_stdout(io.StringIO()):  # the run's loading report: not this tool's output
        job = sft_job(cfg, models.from_hf_config)
    model = job.model.eval()
    right = 0
    for i in range(0, len(job.train_examples), batch_size):
        batch = job.collate(list(job.train_examples[i:i + batch_size]))
        right += int(answered(model, batch).sum())
    return right, len(job.train_examples)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF-format checkpoint folder")
    ap.add_argument("--adapter", default="", help="a PEFT-format adapter folder (a run's out/adapter)")
    ap.add_argument("--data", required=True, help="chat rows whose last assistant turn is the label")
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args(argv)
    right, n = accuracy(args.model, args.data, args.adapter, args.batch_size)
    print(f"accuracy {right / n:.3f} ({right}/{n})")


if __name__ == "__main__":
    from minitrain.cli import main_quietly  # a closed pipe (`| head`) ends it quietly

    sys.exit(main_quietly(main))
