"""Try a model (and an adapter) on a prompt: greedy or sampled, LLaMA / Mistral or T5.

    minitrain generate --model demo/model --adapter runs/dpo_mistral/adapter --prompt "Summarise: ..."
    minitrain generate --model demo/model --adapter runs/dpo_mistral/adapter      # interactive
    minitrain generate --model path/to/flan-t5 --adapter runs/t5/adapter --prompt "..." --num-beams 4

Causal models get the prompt in the format the run trained with (`--format auto`): the run's
`out/config.json` beside the adapter says whether its prompt strings went through the chat template
(`trained_format`), and which `chat_template=` it was given; without a run config, as one user turn
in the tokenizer's chat format when it has one. `--format chat` / `--format raw` (or `--raw`) choose.
Decoding runs with a KV cache; `--temperature` > 0 samples
(with `--top-p` and `--seed`), else greedy (T5: greedy or beam search).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


import torch

import models
from minitrain.adapters.peft_format import load_adapter
from minitrain.errors import UserError
from minitrain.text.chat_template import resolve_template
from minitrain.text.tokenizer import Tokenizer
from minitrain.weights import load_pretrained


def run_format(adapter_dir: str | None, tok: Tokenizer) -> tuple[str | None, str]:
    """("chat" | "raw" | None, why) from the run that trained `adapter_dir` (its out/config.json);
    a `chat_template=` the run was given is set on `tok`."""
    config_file = Path(adapter_dir).parent / "config.json" if adapter_dir else None
    if config_file is None or not config_file.is_file():
        return None, ""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None, ""
    if config.get("chat_template"):
        tok.chat_template = resolve_template(config["chat_template"], str(config_file), tok.special_id)
        tok.chat_format = None
    trained = config.get("trained_format") or {}
    if trained.get("prompts") not in ("chat", "raw"):
        return None, ""
    return trained["prompts"], f"{config_file}: trained with prompts as {trained.get('rendered_by', trained['prompts'])}"


def load(model_dir: str, adapter_dir: str | None) -> tuple[torch.nn.Module, Tokenizer]:
    """The base (fp32, CPU) with the adapter applied, and the tokenizer (the adapter's if saved with it)."""
    model = load_pretrained(model_dir, models.from_hf_config, dtype=torch.float32)
    tok_dir = model_dir
    if adapter_dir:
        if any((Path(adapter_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "spiece.model")):
            tok_dir = adapter_dir  # added tokens travel with the adapter
            tok = Tokenizer.from_folder(tok_dir)
            if tok.vocab_size > model.input_embeddings.num_embeddings:
                model.resize_token_embeddings(tok.vocab_size)
        load_adapter(model, adapter_dir)
    return model.eval(), Tokenizer.from_folder(tok_dir)


def complete(model: torch.nn.Module, tok: Tokenizer, prompt: str, args: argparse.Namespace) -> str:
    """The model's answer to one prompt (decoded, special tokens dropped)."""
    if model.is_encoder_decoder:
        from models.t5 import generate as t5_generate

        ids = torch.tensor([tok.encode(prompt, eos=True)])
        out = t5_generate(model, ids, torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                          num_beams=args.num_beams, eos_token_id=tok.eos_id)
        return tok.decode(out[0].tolist())
    from models.llama import generate as llama_generate

    if args.format == "chat" and not (tok.chat_format or tok.chat_template):
        raise UserError(f"--format chat: {tok.source} has no chat template — use --format raw")
    if args.format == "chat":
        ids, _ = tok.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        ids = tok.encode(prompt, bos=tok.add_bos)  # as the training rows begin (docs/data.md)
    x = torch.tensor([ids])
    out = llama_generate(model, x, torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                         do_sample=args.temperature > 0, temperature=max(args.temperature, 1e-6),
                         top_p=args.top_p, seed=args.seed, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    return tok.decode(out[0, len(ids):].tolist())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="minitrain generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the base: an HF-format folder")
    p.add_argument("--adapter", default=None, help="a PEFT-format adapter folder (optional)")
    p.add_argument("--prompt", default=None, help="one prompt; without it, read prompts from stdin")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-beams", type=int, default=1, help="T5 only: beam search width")
    p.add_argument("--format", choices=("auto", "chat", "raw"), default="auto",
                   help="auto: as the run trained (its config.json), else chat when the tokenizer has a template")
    p.add_argument("--raw", action="store_true", help="the same as --format raw")
    args = p.parse_args(argv)
    if args.raw:
        args.format = "raw"
    try:
        model, tok = load(args.model, args.adapter)
        trained, why = run_format(args.adapter, tok)
        if args.format == "auto":
            args.format = trained or ("chat" if tok.chat_format or tok.chat_template else "raw")
            if trained:
                print(f"note: prompts sent as {'the chat template renders them' if trained == 'chat' else 'plain text'}"
                      f" ({why}); --format chat / raw to choose", file=sys.stderr)
        if args.prompt is not None:
            print(complete(model, tok, args.prompt, args))
            return 0
        interactive = sys.stdin.isatty()
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                return 0
            if line.strip():
                print(complete(model, tok, line.rstrip("\n"), args), flush=True)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

