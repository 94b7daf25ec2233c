"""Merge a LoRA adapter into its base and save an HF-format folder (transformers loads it).

    python tools/merge.py --model demo/model --adapter runs/dpo_mistral/adapter --out merged/
    python tools/merge.py --model path/to/Mistral-7B --adapter runs/x/adapter --out merged/ --dtype bfloat16

The base is loaded in float (never quantized: merging into 4-bit weights would round the update
away), the adapter is folded in (W + scaling * B @ A), and the folder gets config.json, the
weights (sharded above 5 GB) and the tokenizer files of the adapter folder if it has them, else
of the base. Written to a temporary folder and renamed: nothing half-written.

A low-rank-correction adapter (recipes/lrc_llama.py) corrects the *quantized* base: merged into the
float weights it would add the quantization error instead of removing it. Pass the run's format
(`--quantize ternary --ternary-scale tensor`, or nf4 / int8): the base is then loaded quantized as
the run did, and the saved weights are its dequantized values plus the update, a float model that
computes what the trained one did (BitLinear's activation quantizer, `ternary_act_bits`, aside).

    python tools/merge.py --model path/to/qwen3 --adapter runs/lrc/adapter --out merged/ --quantize ternary
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402

import models  # noqa: E402
from minitrain.adapters.merge import merged_state_dict
from minitrain.adapters.peft_format import load_adapter  # noqa: E402
from minitrain.errors import UserError  # noqa: E402
from minitrain.weights import SIDE_FILES, load_pretrained, save_pretrained  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def merge(model_dir: str, adapter_dir: str, out: str, dtype: str = "float32", quantize: str = "none",
          ternary_scale: str = "tensor") -> Path:
    """Load base (quantized as `quantize` says) + adapter, fold the adapter in, save an HF folder at `out`."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: not one of {', '.join(DTYPES)}")
    hook = None
    if quantize != "none":
        from minitrain.adapters.quant import quantize_hook

        hook = quantize_hook(quantize, torch.float32, ternary_scale=ternary_scale)
    model = load_pretrained(model_dir, models.from_hf_config, dtype=torch.float32, tensor_hook=hook)
    load_adapter(model, adapter_dir)
    emb = model.input_embeddings
    config = dict(model.hf_config, vocab_size=emb.num_embeddings)  # an adapter trained on added tokens
    folder = save_pretrained(model, out, config, dtype=DTYPES[dtype], state_dict=merged_state_dict(model))
    for src in (Path(adapter_dir), Path(model_dir)):
        found = [f for f in SIDE_FILES if (src / f).is_file()]
        if any(f in found for f in ("tokenizer.json", "tokenizer.model", "spiece.model")):
            for f in found:
                shutil.copy2(src / f, folder / f)
            break
    return folder


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the base: an HF-format folder")
    p.add_argument("--adapter", required=True, help="a PEFT-format adapter folder (minitrain's out/adapter)")
    p.add_argument("--out", required=True, help="folder to write the merged model into")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 for the saved weights")
    p.add_argument("--quantize", default="none", choices=("none", "nf4", "int8", "ternary"),
                   help="the base format the adapter was trained on (an LRC adapter: the run's quantize)")
    p.add_argument("--ternary-scale", default="tensor", choices=("tensor", "channel"),
                   help="with --quantize ternary: the run's ternary_scale")
    args = p.parse_args(argv)
    try:
        folder = merge(args.model, args.adapter, args.out, args.dtype, args.quantize, args.ternary_scale)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"merged model (HF format): {folder}")
    return 0


if __name__ == "__main__":
    from minitrain.cli import main_quietly  # a closed pipe (`| head`) ends it quietly

    sys.exit(main_quietly(main, sys.argv[1:]))
