"""Merge a LoRA adapter into its base and save an HF-format folder (transformers loads it).

    minitrain merge --model demo/model --adapter runs/dpo_mistral/adapter --out merged/
    minitrain merge --model path/to/Mistral-7B --adapter runs/x/adapter --out merged/ --dtype float32

The base is loaded in float (never quantized: merging into 4-bit weights would round the update
away), the adapter is folded in (W + scaling * B @ A) in fp32, and saved in the base's own dtype
(the floating dtype of its safetensors: a bf16 base gives a bf16 model, not one twice its size;
`--dtype` chooses another). The folder gets config.json, the
weights (sharded above 5 GB) and the tokenizer files of the adapter folder if it has them, else
of the base. Written to a temporary folder and renamed: nothing half-written. A reward model's
adapter (`recipes/reward_model.py`: peft task SEQ_CLS, the `score` head in modules_to_save) merges into
an `XForSequenceClassification` folder, as `finetune=full` saves one (GRPO's `rewards=model:DIR`).

A low-rank-correction adapter (recipes/lrc_llama.py) corrects the *quantized* base: merged into the
float weights it would add the quantization error instead of removing it. Pass the run's format
(`--quantize ternary --ternary-scale tensor`, or nf4 / int8): the base is then loaded quantized as
the run did, and the saved weights are its dequantized values plus the update, a float model that
computes what the trained one did (BitLinear's activation quantizer, `ternary_act_bits`, aside).
Without `--quantize`, an LRC adapter is refused (the run's out/config.json beside the adapter says
what it was), and a QLoRA adapter (trained on an nf4 / int8 base) gets a note: merged into the
full-precision base it computes a little differently from the trained model, which saw rounded
weights; `--quantize nf4` merges into the dequantized base the run trained on instead.

    minitrain merge --model path/to/qwen3 --adapter runs/lrc/adapter --out merged/ --quantize ternary
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


import torch

import models
from minitrain.adapters.merge import merged_state_dict
from minitrain.adapters.peft_format import load_adapter
from minitrain.errors import UserError
from minitrain.objectives.reward_model import attach_score, with_scalar_head
from minitrain.text.tokenizer import Tokenizer
from minitrain.weights import (SIDE_FILES, checkpoint_files, load_pretrained, read_header,
                               save_pretrained)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def base_dtype_name(model_dir: str) -> str:
    """The floating dtype the base's weights are stored in (the most common one across its tensors)."""
    counts: dict[str, int] = {}
    for path in checkpoint_files(model_dir):
        for info in read_header(path)[0].values():
            name = _SAFETENSORS_DTYPES.get(info["dtype"])
            if name:
                counts[name] = counts.get(name, 0) + 1
    return max(counts, key=counts.get) if counts else "float32"


def check_run(adapter_dir: str, quantize: str) -> str | None:
    """A note (or a UserError) from the run that trained the adapter (out/config.json beside it) about
    merging into a base of another format than it trained on."""
    config_file = Path(adapter_dir).parent / "config.json"
    try:
        run = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    trained = run.get("quantize", "none") if isinstance(run, dict) else "none"
    if trained == "none" or quantize != "none":
        return None
    if "lrc_rank" in run:
        raise UserError(f"{adapter_dir}: a low-rank-correction adapter trained on a {trained} base ({config_file}) "
                        f"corrects that base's rounding; merged into the full-precision base it would add the error "
                        f"— pass --quantize {trained}" + (f" --ternary-scale {run.get('ternary_scale', 'tensor')}"
                                                        if trained == "ternary" else ""))
    return (f"note: the adapter was trained on a {trained} base ({config_file}); merged into the full-precision "
            f"base it computes slightly differently from the trained model (which saw rounded weights) — usually "
            f"what you want for deployment; --quantize {trained} merges into the dequantized {trained} base instead")


def merge(model_dir: str, adapter_dir: str, out: str, dtype: str = "auto", quantize: str = "none",
          ternary_scale: str = "tensor") -> Path:
    """Load base (quantized as `quantize` says) + adapter, fold the adapter in, save an HF folder at `out`
    in `dtype` ("auto": the base's own)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: not one of auto, {', '.join(DTYPES)}")
    if not Path(adapter_dir).is_dir():
        raise UserError(f"--adapter {adapter_dir}: no such folder — pass the run's adapter folder (out/adapter)")
    if dtype == "auto":
        dtype = base_dtype_name(model_dir) if Path(model_dir).is_dir() else "float32"
    hook = None
    if quantize != "none":
        from minitrain.adapters.quant import quantize_hook

        hook = quantize_hook(quantize, torch.float32, ternary_scale=ternary_scale)
    reward_model = _task_type(adapter_dir) == "SEQ_CLS"  # recipes/reward_model.py: LoRA + the scalar head
    build = with_scalar_head(models.from_hf_config) if reward_model else models.from_hf_config
    model = load_pretrained(model_dir, build, dtype=torch.float32, tensor_hook=hook)
    if reward_model:  # a head to load the adapter's trained one into; the folder becomes XForSequenceClassification
        attach_score(model, 0, Tokenizer.from_folder(adapter_dir if _has_tokenizer(adapter_dir) else model_dir).pad_id)
    load_adapter(model, adapter_dir)
    emb = model.input_embeddings
    config = dict(model.hf_config, vocab_size=emb.num_embeddings)  # an adapter trained on added tokens
    folder = save_pretrained(model, out, config, dtype=DTYPES[dtype], state_dict=merged_state_dict(model))
    for src in (Path(adapter_dir), Path(model_dir)):
        found = [f for f in SIDE_FILES if (src / f).is_file()]
        if _has_tokenizer(src):
            for f in found:
                shutil.copy2(src / f, folder / f)
            break
    return folder


def _has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "spiece.model"))


def _task_type(adapter_dir: str) -> str | None:
    """peft's `task_type` in the adapter's config (SEQ_CLS: a reward model's), or None."""
    try:
        return json.loads((Path(adapter_dir) / "adapter_config.json").read_text(encoding="utf-8")).get("task_type")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return None  # load_adapter says what is wrong with the folder


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="minitrain merge", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the base: an HF-format folder")
    p.add_argument("--adapter", required=True, help="a PEFT-format adapter folder (minitrain's out/adapter)")
    p.add_argument("--out", required=True, help="folder to write the merged model into")
    p.add_argument("--dtype", default="auto", help="auto (the base's own) | float32 | bfloat16 | float16 for the "
                                                   "saved weights")
    p.add_argument("--quantize", default="none", choices=("none", "nf4", "int8", "ternary"),
                   help="the base format the adapter was trained on (an LRC adapter: the run's quantize)")
    p.add_argument("--ternary-scale", default="tensor", choices=("tensor", "channel"),
                   help="with --quantize ternary: the run's ternary_scale")
    args = p.parse_args(argv)
    try:
        note = check_run(args.adapter, args.quantize)
        if note:
            print(note, file=sys.stderr)
        folder = merge(args.model, args.adapter, args.out, args.dtype, args.quantize, args.ternary_scale)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"merged model (HF format, {json.loads((folder / 'config.json').read_text())['torch_dtype']}): {folder}")
    return 0

