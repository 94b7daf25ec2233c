"""Export a model (with an adapter folded in) as one GGUF file for llama.cpp and the apps built on it.

    minitrain export --model path/to/Qwen3-0.6B --adapter runs/sft/adapter --out sft.gguf --type q8_0
    minitrain export --model demo/model --out demo.gguf                # f16, no adapter

Families: LLaMA, Mistral, Qwen2 / 2.5, Qwen3, Gemma 2, Gemma 3 (text), Gemma 4, Phi-3, the MoE families,
gpt-oss and Qwen3.5 (docs/evaluate-and-export.md). The base is loaded
in fp32 and the adapter folded in there (W + scaling * B @ A, `minitrain.adapters.merge`), then the
weights are renamed, re-laid-out and stored as llama.cpp expects them (`minitrain.export.gguf_file`)
in `--type` f16 (default), bf16, q8_0 or f32, with the tokenizer (the adapter folder's if it was saved
with it, else the base's) and its chat template (`minitrain.export.gguf_vocab`). An adapter trained on
a quantized base by low-rank correction (recipes/lrc.py) is folded into that base: pass the run's
`--quantize` (without it such an adapter is refused, as minitrain merge refuses it). Written to a temporary name and renamed. Needs the `export` extra (pip install
'minitrain[export]'). Then: `llama-cli -m sft.gguf`, or llama-cpp-python's `Llama(model_path=...)`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import models
from minitrain.commands import merge as merge_command
from minitrain.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def export(model_dir: str, out: str, adapter_dir: str | None = None, kind: str = "f16", quantize: str = "none",
           ternary_scale: str = "tensor") -> Path:
    """Load, fold the adapter in (fp32), write the GGUF file; every refusal comes before the weights load."""
    import json

    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UserError("the gguf package is not installed — pip install 'minitrain[export]' "
                        "(or pip install gguf)") from None
    from minitrain.adapters.lora import in_tower
    from minitrain.adapters.merge import merged_state_dict
    from minitrain.adapters.peft_format import load_adapter
    from minitrain.checkpoint import check_adapter_base
    from minitrain.export.gguf_file import TYPES, check_exportable, write_gguf
    from minitrain.weights import load_pretrained

    if kind not in TYPES:
        raise UserError(f"--type {kind}: not one of {', '.join(TYPES)}")
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise UserError(f"--model {model_dir}: no config.json — pass an HF-format model folder")
    check_exportable(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    if adapter_dir is not None:
        if not (Path(adapter_dir) / "adapter_config.json").is_file():
            raise UserError(f"--adapter {adapter_dir}: no adapter_config.json — pass a PEFT-format adapter folder "
                            f"(a run's out/adapter)")
        check_adapter_base(adapter_dir, model_dir)
        note = merge_command.check_run(adapter_dir, quantize)  # an LRC adapter needs its base's format
        if note:
            print(note)
    if not Path(out).parent.is_dir():
        raise UserError(f"--out {out}: folder {Path(out).parent} does not exist — create it or choose another path")
    hook = None
    if quantize != "none":
        from minitrain.adapters.quant import quantize_hook

        hook = quantize_hook(quantize, torch.float32, ternary_scale=ternary_scale)
    model = load_pretrained(model_dir, models.from_hf_config, dtype=torch.float32, tensor_hook=hook)
    tok_dir = model_dir
    if adapter_dir is not None:
        if any((Path(adapter_dir) / f).is_file() for f in TOKENIZER_FILES):
            tok_dir = adapter_dir  # added tokens travel with the adapter
        from minitrain.adapters.peft_format import adapter_vocab_size

        vocab = adapter_vocab_size(adapter_dir)
        if vocab is not None and vocab != model.input_embeddings.num_embeddings:
            model.resize_token_embeddings(vocab)
        load_adapter(model, adapter_dir)
    config = dict(model.hf_config, vocab_size=model.input_embeddings.num_embeddings)
    # a multimodal folder's language model: its towers (`model.towers`, Qwen3.5's vision tower) are not part of
    # llama.cpp's model file (llama.cpp reads a tower from a separate mmproj file)
    state = {k: v for k, v in merged_state_dict(model, dtype=torch.float32).items() if not in_tower(model, k)}
    return write_gguf(state, config, tok_dir, out, kind)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="minitrain export", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the base: an HF-format folder")
    p.add_argument("--adapter", default=None, help="a PEFT-format adapter folder to fold in (a run's out/adapter)")
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--type", default="f16", help="f16 (default), bf16, q8_0 or f32")
    p.add_argument("--quantize", default="none", choices=("none", "nf4", "int8", "ternary"),
                   help="an LRC adapter: the base format it was trained on (the run's quantize)")
    p.add_argument("--ternary-scale", default="tensor", choices=("tensor", "channel"))
    args = p.parse_args(argv)
    try:
        path = export(args.model, args.out, args.adapter, args.type, args.quantize, args.ternary_scale)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"GGUF ({args.type}): {path}")
    return 0

