"""Write `demo/grpo_tools/`: a tiny LLaMA that can call a calculator but seldom does, and its prompts.

    python tools/make_grpo_tools_demo.py      # rewrites demo/grpo_tools/ (about a minute of CPU time, one thread)

The task: `47*38=` -> the product (1786), which a 0.3 M-parameter model cannot work out in its head.
Its chat template offers tools in Qwen's way (`<tool_call>{"name", "arguments"}</tool_call>`, the
result in `<tool_response>...</tool_response>`), and the tool is `calc.py:mul`. The model is
pre-trained here on answers of two kinds:

- with the tool (15% of the answers): `<tool_call>{"name": "mul", "arguments": {"a": 47, "b": 38}}</tool_call>`,
  then, after the tool's `<tool_response>1786</tool_response>`, the number it read;
- in its head (85%): an estimate, the product to two significant digits (1800) — wrong but for the
  few products that end in 00.

So its greedy answer is the estimate (held-out accuracy near 0) and about one sampled answer in
seven calls the tool. GRPO (`calc.py:correct`: 1 for the exact product) rewards those, and the policy
learns to call the calculator: the held-out accuracy (prompts whose number pairs no training prompt
has) goes to about 1. With the tool's results hidden (`calc_hidden.py:mul` answers `?`) calling it
earns nothing and the accuracy stays low.

Files (about 0.6 MB):

    demo/grpo_tools/model/          config.json, model.safetensors (bf16), tokenizer.json (+ config),
                                    chat_template.jinja: model_type llama
    demo/grpo_tools/train.jsonl     {"prompt": [{"role": "user", "content": "47*38="}], "answer": "1786"}
    demo/grpo_tools/eval.jsonl      held-out prompts: number pairs in no training row
    demo/grpo_tools/calc.py         the tool `mul` and the reward `correct`
    demo/grpo_tools/calc_hidden.py  the control's `mul`: its result hidden
    demo/grpo_tools/run.json        the GRPO run's keys (`config=demo/grpo_tools/run.json`)

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
from make_grpo_demo import MODEL  # noqa: E402  (the same tiny LLaMA shape as the GRPO demo's)

from minitrain.text.tokenizer import Tokenizer  # noqa: E402
from models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

WITH_TOOL = 0.15  # share of answers that call the tool in the pre-training text
# pieces of a call, one token each (added tokens), so that a call is a few tokens long
ASSISTANT = "<|im_start|>assistant\n"  # the assistant's header (Qwen's, so TRL's Qwen parser finds the turn)
PIECES = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", '{"name": "mul", "arguments": {"a": ',
          ', "b": ', "}}", "<tools>", ASSISTANT]
TEMPLATE = """{%- for m in messages -%}
{%- if m.role == 'user' -%}{{ bos_token }}{% if tools %}<tools>{% endif %}{{ m.content }}
{%- elif m.role == 'assistant' -%}<|im_start|>assistant
{% if m.tool_calls -%}{%- for c in m.tool_calls -%}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{%- endfor -%}
{%- else -%}{{ m.content }}{%- endif -%}{{ eos_token }}
{%- elif m.role == 'tool' -%}<tool_response>{{ m.content }}</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}
"""
CALC = '''"""The demo's calculator tool and its reward (tools/make_grpo_tools_demo.py)."""


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def correct(prompts, completions, answer, **_) -> list[float]:
    """1 when the model's last message is exactly the row's `answer`, else 0."""
    return [1.0 if c[-1]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]
'''
CALC_HIDDEN = '''"""The demo's control: the calculator's result is hidden from the model (tools/make_grpo_tools_demo.py)."""


def mul(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return "?"
'''


# the demo's GRPO run: python -m minitrain recipes/grpo_qwen.py config=demo/grpo_tools/run.json
RUN = {"model": "demo/grpo_tools/model", "data": "demo/grpo_tools/train.jsonl", "eval_data": "demo/grpo_tools/eval.jsonl",
       "tools": "demo/grpo_tools/calc.py:mul", "rewards": "demo/grpo_tools/calc.py:correct", "max_steps": 30,
       "batch_size": 8, "grad_accum": 1, "lr": 0.002, "schedule": "constant", "warmup": 0.0, "max_len": 48,
       "num_generations": 8, "max_completion_length": 24, "eval_every": 10, "log_completions_every": 10, "lora_r": 8,
       "lora_alpha": 16.0, "checkpointing": False, "out": "runs/grpo_tools"}


def pair(rng: random.Random) -> tuple[int, int]:
    return rng.randrange(10, 100), rng.randrange(10, 100)


def transcript(a: int, b: int, with_tool: bool) -> str:
    """One pre-training conversation as the chat template renders it."""
    head = f"<s><tools>{a}*{b}={ASSISTANT}"
    if with_tool:
        call = f'<tool_call>{{"name": "mul", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call></s>'
        return head + call + f"<tool_response>{a * b}</tool_response>{ASSISTANT}{a * b}</s>"
    guess = round(a * b, 1 - len(str(a * b)))  # two significant digits: 1786 -> 1800
    return head + f"{guess}</s>"


def make_tokenizer(folder: Path) -> Tokenizer:
    """A character vocabulary (digits, * =, the characters of a call) plus the call pieces as added tokens."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = sorted(set("0123456789*=?" + "".join(PIECES) + "dumy")) + ["▁"]
    chars = [c for c in chars if c not in " \n"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.add_special_tokens(specials)
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in PIECES])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**names, "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
         "model_max_length": MODEL["max_position_embeddings"]}, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return Tokenizer.from_folder(folder)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "demo" / "grpo_tools"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500, help="pre-training steps")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--prompts", type=int, default=400, help="GRPO training prompts (30 steps x 8 take 240)")
    ap.add_argument("--eval-prompts", type=int, default=100, help="held-out prompts")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    rng = random.Random(args.seed)
    tok = make_tokenizer(out / "model")
    sample = transcript(47, 38, True)
    assert tok.decode(tok.encode(sample), skip_special=False) == sample, tok.decode(tok.encode(sample), skip_special=False)

    # held-out pairs first, so that no pre-training or training row has them
    seen: set[tuple[int, int]] = set()
    rows = []
    for n in (args.eval_prompts, args.prompts):
        part = []
        while len(part) < n:
            a, b = pair(rng)
            if (a, b) not in seen:
                seen.add((a, b))
                part.append({"prompt": [{"role": "user", "content": f"{a}*{b}="}], "answer": str(a * b)})
        rows.append(part)
    held = {tuple(map(int, r["prompt"][0]["content"][:-1].split("*"))) for r in rows[0]}
    texts = []
    while len(texts) < 20000:
        a, b = pair(rng)
        if (a, b) not in held:
            texts.append(transcript(a, b, rng.random() < WITH_TOOL))
    seqs = [tok.encode(t) for t in texts]
    config = LlamaConfig.from_hf({**MODEL, "vocab_size": tok.vocab_size})
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    print(f"model: llama, {sum(p.numel() for p in model.parameters()):,} parameters; pre-training {args.steps} "
          f"steps of {args.batch_size} answers ({WITH_TOOL:.0%} with the tool), longest {max(map(len, seqs))} tokens")
    pretrain(model, seqs, args.steps, args.batch_size, args.lr, args.seed, tok.pad_id)
    save_checkpoint(model, config, out / "model")
    write_jsonl(out / "train.jsonl", rows[1])
    write_jsonl(out / "eval.jsonl", rows[0])
    (out / "calc.py").write_text(CALC)
    (out / "calc_hidden.py").write_text(CALC_HIDDEN)
    (out / "run.json").write_text(json.dumps(RUN, indent=2) + "\n")
    sign(out, "demo/grpo_tools/", "tools/make_grpo_tools_demo.py", __doc__)


if __name__ == "__main__":
    from minitrain.cli import main_quietly  # a closed pipe (`| head`) ends it quietly

    sys.exit(main_quietly(main))
