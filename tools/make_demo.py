"""Write `demo/`: a tiny Mistral-architecture checkpoint, its tokenizer and a preference set.

    python tools/make_demo.py            # rewrites demo/ (about a minute of CPU time, one thread)
    python tools/make_demo.py --out /tmp/demo --steps 100

The task mirrors field report 002 (a medical-summary model that hallucinates): summarise a short
patient note as `name, age, condition, drug.` The tiny model is pre-trained here on chat
transcripts in which most summaries (60%) get one fact wrong — a fact that is nowhere in the
note — so, like the report's Stage A model, it hallucinates often. The preference pairs then say:
the summary that copies every fact (chosen) beats one with a single invented fact (rejected).

What makes the preference learnable and checkable on held-out pairs:

- every value (age, condition, drug) is as often chosen as rejected, so no word is "good" in
  itself: the only rule that separates chosen from rejected is "copy the fact from the note";
- the held-out pairs are about people whose names appear in no training pair (the pre-trained
  model has met them, as it would any name), in notes drawn afresh, so a policy that only
  memorised training pairs scores at chance there.

Files written (a few MB):

    demo/model/config.json           model_type mistral (GQA, 4 layers, hidden 128), HF format
    demo/model/model.safetensors     bf16 weights (loads in minitrain and in transformers)
    demo/model/tokenizer.json        BPE trained here, with <unk> <s> </s> [INST] [/INST] <pad>
    demo/model/tokenizer_config.json (+ special_tokens_map.json) Mistral chat template
    demo/prefs_train.jsonl           preference pairs {"prompt": [user message], "chosen", "rejected"}
    demo/prefs_eval.jsonl            held-out pairs (unseen people)
    demo/sft_train.jsonl             Stage A data: {"messages": [...]} with faithful summaries
    demo/kto_train.jsonl             unpaired feedback {"prompt", "completion", "label"} (KTO): one answer
                                     of each training pair, chosen (label true) or rejected (false)
    demo/kto_eval.jsonl              the same from the held-out pairs
    demo/README.md                   this text

Deterministic: everything comes from `--seed` (Python's `random`, `torch.manual_seed`), and the
pre-training runs on one thread, so the same machine writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere in a checkout

from minitrain.text.tokenizer import Tokenizer  # noqa: E402  (the same chat rendering the recipes use)
from models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

TRAIN_NAMES = ("Anna Ben Carl Dora Emma Finn Gina Hugo Iris Jack Kira Leo Mia Nora Omar Pia Quinn Rosa Sam "
               "Tara Uma Vera Will Yara Zoe Alma Boris Cleo Dean Elsa").split()
HELDOUT_NAMES = ("Felix Greta Hans Ines Jonas Karl Lena Max Nina Otto").split()
CONDITIONS = ("fever cough rash headache nausea fatigue dizziness insomnia asthma anemia migraine bronchitis "
              "sinusitis gastritis arthritis eczema").split()
DRUGS = ("aspirin ibuprofen insulin penicillin codeine morphine heparin warfarin naproxen lithium cortisone "
         "atropine").split()
AGES = [str(a) for a in range(18, 90)]
NOTES = (
    "{name} is {age} and reports {condition}. Prescribed {drug}.",
    "Prescribed {drug} for {name}, {age}, who reports {condition}.",
    "{name}, aged {age}, has {condition} and takes {drug}.",
    "Reports {condition}: {name}, {age}. Given {drug}.",
)
INSTRUCTION = "Summarise the note: "
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "<pad>"]  # ids 0..5, Mistral's first three
HALLUCINATION_RATE = 0.6  # share of pre-training summaries with one invented fact (report: 60%)

MODEL = dict(model_type="mistral", hidden_size=128, intermediate_size=352, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
             rope_theta=10000.0, sliding_window=None, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=2, pad_token_id=5)
# Mistral-7B-Instruct v0.3's template with [INST] / [/INST] as control tokens (system prompt omitted)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + '[/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)


# ----------------------------------------------------------------------------- the task


def note(rng: random.Random, names: list[str]) -> tuple[dict[str, str], str]:
    """A patient's facts and a note stating them in one of several word orders."""
    facts = {"name": rng.choice(names), "age": rng.choice(AGES), "condition": rng.choice(CONDITIONS),
             "drug": rng.choice(DRUGS)}
    return facts, rng.choice(NOTES).format(**facts)


def summary(facts: dict[str, str]) -> str:
    return f"{facts['name']}, {facts['age']}, {facts['condition']}, {facts['drug']}."


def hallucinate(rng: random.Random, facts: dict[str, str]) -> dict[str, str]:
    """The same facts with one of age / condition / drug replaced by a value not in the note."""
    key = rng.choice(("age", "condition", "drug"))
    pool = {"age": AGES, "condition": CONDITIONS, "drug": DRUGS}[key]
    return {**facts, key: rng.choice([v for v in pool if v != facts[key]])}


def preference_rows(rng: random.Random, names: list[str], n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        facts, text = note(rng, names)
        rows.append({"prompt": [{"role": "user", "content": INSTRUCTION + text}],
                     "chosen": summary(facts), "rejected": summary(hallucinate(rng, facts))})
    return rows


def unpaired_rows(rng: random.Random, pairs: list[dict]) -> list[dict]:
    """Thumbs-up / thumbs-down rows: ONE answer of each pair, the chosen (true) or the rejected (false)."""
    rows = []
    for r in pairs:
        good = rng.random() < 0.5
        rows.append({"prompt": r["prompt"], "completion": r["chosen" if good else "rejected"], "label": good})
    return rows


def chat(rng: random.Random, names: list[str], hallucination_rate: float) -> list[dict]:
    """One transcript: a note to summarise and a summary that is wrong with the given probability."""
    facts, text = note(rng, names)
    said = hallucinate(rng, facts) if rng.random() < hallucination_rate else facts
    return [{"role": "user", "content": INSTRUCTION + text}, {"role": "assistant", "content": summary(said)}]


def as_text(messages: list[dict]) -> str:
    return " ".join(m["content"] for m in messages)


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], folder: Path, vocab_size: int) -> Tokenizer:
    """A small BPE like Mistral's (Metaspace "▁", digits split one by one), trained on `texts`;
    the alphabet holds every ASCII letter so that any name still encodes (in pieces)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Punctuation(behavior="isolated"),
    ])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # bos before each text, as add_bos_token says (transformers 5 follows this post-processor, not the flag)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**specials, "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
         "model_max_length": MODEL["max_position_embeddings"], "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return Tokenizer.from_folder(folder)


# ----------------------------------------------------------------------------- pre-training


def pretrain(model: LlamaForCausalLM, seqs: list[list[int]], steps: int, batch_size: int, lr: float,
             seed: int, pad_id: int) -> float:
    """Next-token training on whole transcripts (plain torch, full logits: the vocab is tiny).

    AdamW, linear warmup then cosine decay, gradient clipping at 1. Returns the last loss.
    """
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    model.train()
    t0, loss = time.time(), float("nan")
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        rows = [seqs[rng.randrange(len(seqs))] for _ in range(batch_size)]
        T = max(map(len, rows))
        ids = torch.full((batch_size, T), pad_id)
        mask = torch.zeros((batch_size, T), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        hidden = model(ids, mask)  # (B, T, D)
        logits = model.output_projection(hidden[:, :-1]).float()  # (B, T-1, V)
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # (B, T-1)
        loss_t = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = loss_t.item()
        if step % 100 == 0 or step == steps - 1:
            print(f"  pretrain step {step + 1}/{steps}: loss {loss:.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    return loss


def save_checkpoint(model: LlamaForCausalLM, config: LlamaConfig, folder: Path) -> None:
    """HF layout: config.json (+ torch_dtype) and one bf16 model.safetensors."""
    hf = {**config.to_hf(), "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def sign(out: Path, demo: str, maker: str, doc: str) -> None:
    """A demo folder's README.md (its maker's docstring under a title naming both), then its size printed."""
    (out / "README.md").write_text(f"# {demo} — written by {maker}\n\n```\n" + doc.strip() + "\n```\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size / 2**20:.2f} MiB)")


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "demo"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=500, help="pre-training steps")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--pairs", type=int, default=2000, help="training preference pairs")
    ap.add_argument("--eval-pairs", type=int, default=200, help="held-out preference pairs")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one thread: the same reductions, so the same bytes, on every run
    out = Path(args.out)
    for old in out.iterdir() if out.exists() else ():  # demo/grpo is tools/make_grpo_demo.py's: kept
        if old.name != "grpo":
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    rng = random.Random(args.seed)

    corpus = [chat(rng, TRAIN_NAMES + HELDOUT_NAMES, HALLUCINATION_RATE) for _ in range(20000)]
    print(f"tokenizer: BPE, vocab {args.vocab}, on {len(corpus)} transcripts")
    tok = train_tokenizer([as_text(m) for m in corpus], out / "model", args.vocab)
    assert tok.chat_template == CHAT_TEMPLATE and [tok.token_to_id(t) for t in SPECIALS] == list(range(len(SPECIALS)))
    seqs = [tok.encode_chat(m)[0] for m in corpus]

    config = LlamaConfig.from_hf({**MODEL, "vocab_size": tok.vocab_size})
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: mistral, {n:,} parameters; pre-training {args.steps} steps of {args.batch_size} transcripts")
    pretrain(model, seqs, args.steps, args.batch_size, args.lr, args.seed, tok.pad_id)
    save_checkpoint(model, config, out / "model")

    train_pairs = preference_rows(rng, TRAIN_NAMES, args.pairs)
    eval_pairs = preference_rows(rng, HELDOUT_NAMES, args.eval_pairs)
    write_jsonl(out / "prefs_train.jsonl", train_pairs)
    write_jsonl(out / "prefs_eval.jsonl", eval_pairs)
    write_jsonl(out / "sft_train.jsonl", [{"messages": chat(rng, TRAIN_NAMES, 0.0)} for _ in range(1000)])
    kto_rng = random.Random(args.seed + 1)  # its own stream: the files above keep their bytes
    write_jsonl(out / "kto_train.jsonl", unpaired_rows(kto_rng, train_pairs))
    write_jsonl(out / "kto_eval.jsonl", unpaired_rows(kto_rng, eval_pairs))
    sign(out, "demo/", "tools/make_demo.py", __doc__)


if __name__ == "__main__":
    from minitrain.cli import main_quietly  # a closed pipe (`| head`) ends it quietly

    sys.exit(main_quietly(main))
