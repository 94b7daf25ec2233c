"""Write `demo/grpo/`: a tiny LLaMA that rarely answers "the last digit of a sum" right, and its prompts.

    python tools/make_grpo_demo.py            # rewrites demo/grpo/ (about a minute of CPU time, one thread)

The task: `47+385=` -> the last digit of the sum (2). A reward function checks it (the last digit
in the completion; `recipes/grpo_qwen.py`'s `last_digit`). The model is pre-trained here on
answers of two kinds, as a model often knows a careful way and a careless one:

- careful (12% of the answers): `7+5=12 so 2` — the last digits added, then the answer, which the
  model learns to get right;
- careless (88%): `so 3` — a digit at random, so the model cannot get it right that way.

So its greedy answer is the careless one (held-out reward about 0.1) and one sampled answer in
eight or so is careful. GRPO rewards those, and the policy learns to answer carefully: the held-out
reward goes to about 1 (prompts whose number pairs no training prompt has). With shuffled rewards
nothing separates careful from careless and the held-out reward stays where it was.

Files (about 0.5 MB):

    demo/grpo/model/        config.json, model.safetensors (bf16), tokenizer.json (+ config): model_type llama
    demo/grpo/train.jsonl   {"prompt": "47+385=", "answer": "2"}   GRPO's prompts (the answer: for the reward)
    demo/grpo/eval.jsonl    held-out prompts: number pairs in no training row

Deterministic from `--seed` on one thread, as tools/make_demo.py.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere in a checkout

from make_demo import pretrain, save_checkpoint, sign, write_jsonl  # noqa: E402

from minitrain.text.tokenizer import Tokenizer  # noqa: E402
from models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

MODEL = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=24, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
             tie_word_embeddings=False, hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=0,
             model_type="llama")
CAREFUL = 0.12  # share of careful answers in the pre-training text


def pair(rng: random.Random) -> tuple[int, int]:
    return rng.randrange(1000), rng.randrange(1000)


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer(rng: random.Random, a: int, b: int, careful: bool) -> str:
    if careful:
        x, y = a % 10, b % 10
        return f"{x}+{y}={x + y} so {(x + y) % 10}"
    return f"so {rng.randrange(10)}"


def make_tokenizer(folder: Path) -> Tokenizer:
    """A character-level vocabulary (digits, + = space, the letters of `so`) in HF tokenizers' format."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = list("0123456789+=so") + ["▁"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**names, "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
         "model_max_length": MODEL["max_position_embeddings"]}, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")
    return Tokenizer.from_folder(folder)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "demo" / "grpo"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500, help="pre-training steps")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--prompts", type=int, default=2000, help="GRPO training prompts")
    ap.add_argument("--eval-prompts", type=int, default=100, help="held-out prompts")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    rng = random.Random(args.seed)
    tok = make_tokenizer(out / "model")
    assert tok.decode(tok.encode("7+5=12 so 2")) == "7+5=12 so 2"

    texts = []
    for _ in range(20000):
        a, b = pair(rng)
        texts.append(prompt(a, b) + answer(rng, a, b, rng.random() < CAREFUL))
    seqs = [tok.encode(t, bos=True, eos=True) for t in texts]
    config = LlamaConfig.from_hf({**MODEL, "vocab_size": tok.vocab_size})
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    print(f"model: llama, {sum(p.numel() for p in model.parameters()):,} parameters; pre-training {args.steps} "
          f"steps of {args.batch_size} answers ({CAREFUL:.0%} careful)")
    pretrain(model, seqs, args.steps, args.batch_size, args.lr, args.seed, tok.pad_id)
    save_checkpoint(model, config, out / "model")

    seen: set[tuple[int, int]] = set()
    rows = []
    for n in (args.prompts, args.eval_prompts):
        part = []
        while len(part) < n:
            a, b = pair(rng)
            if (a, b) not in seen:
                seen.add((a, b))
                part.append({"prompt": prompt(a, b), "answer": str((a + b) % 10)})
        rows.append(part)
    write_jsonl(out / "train.jsonl", rows[0])
    write_jsonl(out / "eval.jsonl", rows[1])
    sign(out, "demo/grpo/", "tools/make_grpo_demo.py", __doc__)


if __name__ == "__main__":
    from minitrain.cli import main_quietly  # a closed pipe (`| head`) ends it quietly

    sys.exit(main_quietly(main))
