"""Write `demo/vl_colours/`: a tiny Qwen2.5-VL that answers "What colour is the shape?" without looking.

    python tools/make_vl_demo.py      # rewrites demo/vl_colours/ (under a minute of CPU time, one thread)

The task: a 32 x 32 picture of one shape (a square, a disc or a triangle, of any size, anywhere, on a grey
background) in one of five colours (red, green, blue, yellow, purple); the answer is the colour's name. The
model (the Qwen2.5-VL architecture: a 2-block vision tower with the 2x2 patch merger, a 2-layer Qwen2 language
model with M-RoPE; 0.13 M parameters) is pre-trained here, with minitrain's own full fine-tuning, on
pictures whose answers are drawn at random: it learns the format (a colour's name, then `<|im_end|>`) and that
the picture says nothing, so its greedy answer is one colour whatever it sees: held-out accuracy near chance
(0.2). LoRA SFT on the language model (the tower frozen) on rows whose answers are the true colours teaches
it to read the picture: `python -m minitrain recipes/sft.py config=demo/vl_colours/run.json`, then
`python tools/answer_accuracy.py --model demo/vl_colours/model --adapter runs/vl_colours/adapter
--data demo/vl_colours/eval.jsonl` (the held-out share of rows whose greedy answer is the label).

Files (about 0.7 MB):

    demo/vl_colours/model/        config.json (model_type qwen2_5_vl), model.safetensors (fp32),
                                  preprocessor_config.json (patches of 4 pixels), tokenizer.json (+ config:
                                  ChatML, `<|image_pad|>`): loads in minitrain and in transformers
    demo/vl_colours/images/       train_NNN.png, eval_NNN.png (32 x 32)
    demo/vl_colours/train.jsonl   {"images": ["images/train_000.png"], "messages": [user question, assistant colour]}
    demo/vl_colours/eval.jsonl    held-out rows: pictures drawn afresh
    demo/vl_colours/run.json      the SFT run's keys (`config=demo/vl_colours/run.json`)

Deterministic from `--seed` on one thread, as tools/make_demo.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere in a checkout

from make_demo import sign, write_jsonl  # noqa: E402

COLOURS = {"red": (210, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 210), "yellow": (225, 200, 40),
           "purple": (140, 60, 170)}
SHAPES = ("square", "disc", "triangle")
QUESTION = "What colour is the shape?"
SIDE = 32
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
            "<|video_pad|>"]
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}")
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "merge_size": 2,
                "temporal_patch_size": 2, "min_pixels": 64, "max_pixels": SIDE * SIDE,
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
TEXT = dict(model_type="qwen2_5_vl_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
            hidden_act="silu", tie_word_embeddings=False, use_sliding_window=False, attention_dropout=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
VISION = dict(model_type="qwen2_5_vl", depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
              out_hidden_size=64, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
              fullatt_block_indexes=[1], hidden_act="silu", tokens_per_second=4)
# the demo's SFT run: python -m minitrain recipes/sft.py config=demo/vl_colours/run.json
RUN = {"model": "demo/vl_colours/model", "data": "demo/vl_colours/train.jsonl", "eval_data": "demo/vl_colours/eval.jsonl",
       "max_steps": 300, "batch_size": 8, "grad_accum": 1, "lr": 0.005, "schedule": "cosine", "warmup": 0.0,
       "max_len": 64, "lora_r": 8, "lora_alpha": 16.0,
       "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
       "eval_every": 100, "out": "runs/vl_colours"}


def picture(rng: random.Random, colour: str):
    """One shape of `colour` on a grey background, as a Pillow image."""
    from PIL import Image, ImageDraw

    grey = rng.randrange(150, 235)
    image = Image.new("RGB", (SIDE, SIDE), (grey, grey, grey))
    size = rng.randrange(10, 22)
    x, y = rng.randrange(0, SIDE - size), rng.randrange(0, SIDE - size)
    draw, fill = ImageDraw.Draw(image), COLOURS[colour]
    shape = rng.choice(SHAPES)
    if shape == "square":
        draw.rectangle((x, y, x + size, y + size), fill=fill)
    elif shape == "disc":
        draw.ellipse((x, y, x + size, y + size), fill=fill)
    else:
        draw.polygon([(x, y + size), (x + size, y + size), (x + size // 2, y)], fill=fill)
    return image


def rows(rng: random.Random, folder: Path, prefix: str, n: int, truthful: bool = True) -> list[dict]:
    """`n` rows, each with its picture saved as `folder/prefix_NNN.png`; the answer is the shape's colour
    (`truthful`) or a colour drawn apart from it."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        colour = rng.choice(list(COLOURS))
        name = f"{prefix}_{i:03d}.png"
        picture(rng, colour).save(folder / name, optimize=True)
        answer = colour if truthful else rng.choice(list(COLOURS))
        out.append({"images": [f"{folder.name}/{name}"],
                    "messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer}]})
    return out


def make_tokenizer(folder: Path) -> None:
    """Characters plus the colours' names and the question as added tokens; Qwen's special tokens."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    chars = sorted(set(QUESTION + "".join(COLOURS) + "userasistn\n") - {" "}) + ["▁"]
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in [QUESTION, *COLOURS]])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIALS}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "bos_token": None, "unk_token": None, "add_bos_token": False, "add_eos_token": False,
         "model_max_length": TEXT["max_position_embeddings"], "added_tokens_decoder": added, "chat_template": CHATML},
        indent=2) + "\n")
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")


def make_config(folder: Path) -> dict:
    """The checkpoint's config.json (transformers' qwen2_5_vl layout), from the tokenizer's ids."""
    ids = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in ids}
    vocab = max(ids.values()) + 1
    config = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
              "text_config": {**TEXT, "vocab_size": vocab, "eos_token_id": ids["<|im_end|>"],
                              "pad_token_id": ids["<|endoftext|>"], "bos_token_id": None},
              "vision_config": VISION, "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def init_weights(folder: Path, seed: int) -> None:
    """Random weights in minitrain's model as transformers initialises them (weights N(0, 0.02), biases 0, norms
    1: the image features then vary with the image, not with a bias), seeded, saved as safetensors."""
    from safetensors.torch import save_file

    import models

    config = json.loads((folder / "config.json").read_text())
    torch.manual_seed(seed)
    model = models.from_hf_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # RMSNorm
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


def pretrain(folder: Path, data: Path, steps: int, seed: int) -> None:
    """Full fine-tuning by minitrain itself on rows with random answers; its written language model replaces
    `folder`'s (the tower keeps its initial weights: trained to predict nothing, it would only blur them)."""
    from safetensors.torch import load_file, save_file

    from minitrain.cli import run_cli

    with tempfile.TemporaryDirectory() as tmp:
        code = run_cli(["recipes/sft.py", f"model={folder}", f"data={data}", f"out={tmp}/run", "finetune=full",
                        f"max_steps={steps}", "batch_size=16", "grad_accum=1", "lr=0.003", "warmup=0.05", "schedule=cosine",
                        f"seed={seed}", "max_len=64", "device=cpu", "precision=fp32", "data_cache=false",
                        "skip_audit=true"])
        if code:
            raise SystemExit(f"pre-training failed ({code})")
        start = load_file(folder / "model.safetensors")
        trained = load_file(Path(tmp) / "run" / "model" / "model.safetensors")
        assert sorted(trained) == sorted(start), "the written model's keys are not the initial ones"
        weights = {k: start[k] if ".visual." in k else v.contiguous() for k, v in trained.items()}
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "demo" / "vl_colours"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=150, help="pre-training steps (16 rows each)")
    ap.add_argument("--train", type=int, default=480, help="SFT rows (300 steps x 8 see each 5 times)")
    ap.add_argument("--eval", type=int, default=100, help="held-out rows")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.chdir(Path(__file__).resolve().parent.parent)  # recipes/sft.py and run.json's paths are the checkout's
    out = Path(args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    rng = random.Random(args.seed)
    make_tokenizer(out / "model")
    make_config(out / "model")
    init_weights(out / "model", args.seed)
    write_jsonl(out / "train.jsonl", rows(rng, out / "images", "train", args.train))
    write_jsonl(out / "eval.jsonl", rows(rng, out / "images", "eval", args.eval))
    with tempfile.TemporaryDirectory() as tmp:  # the pre-training rows: answers at random, pictures not kept
        data = Path(tmp) / "pretrain.jsonl"
        write_jsonl(data, rows(rng, Path(tmp) / "images", "pre", 16 * args.steps // 2, truthful=False))
        if args.steps:
            pretrain(out / "model", data, args.steps, args.seed)
    (out / "run.json").write_text(json.dumps(RUN, indent=2) + "\n")
    sign(out, "demo/vl_colours/", "tools/make_vl_demo.py", __doc__)


if __name__ == "__main__":
    from minitrain.cli import main_quietly  # a closed pipe (`| head`) ends it quietly

    sys.exit(main_quietly(main))
