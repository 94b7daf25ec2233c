"""Distil a tiny LLaMA student from a tiny LLaMA teacher, fully fine-tuned, and compare held-out perplexity.

    python tools/distill_demo.py                       # runs/distill_demo, a few CPU minutes
    python tools/distill_demo.py --out /tmp/kd --seed 1 --student-steps 300

Field report 001 distilled a 1.1B teacher into a fully trained 135M student with KD, feature
matching and attention transfer. This is the same setup at a size that runs on a laptop, every
step through the command line a user would type (`python -m minitrain recipes/...`):

1. A language with real structure and real uncertainty: each document has a hidden topic (one of
   `--topics`) and its words follow that topic's word-to-word transition table (each word has a
   few possible successors with random Dirichlet weights), for 16 to 31 words. The next word
   depends on the previous one and on the topic, which only the context reveals, so a model
   needs its attention to do well. The best possible held-out perplexity (the generating
   process's own, topic posterior included) is computed exactly and printed as the floor.
2. A word-level tokenizer (one id per word, plus <unk> <s> </s> <pad>), shared by both models.
   The teacher's head is padded to a multiple of 64 ids and the student's is not, so KD runs over
   the shared ids (`minitrain.objectives.distill.shared_vocab`).
3. The teacher (4 layers, width 128) is trained from a random init on many documents with
   `recipes/sft_llama.py finetune=full`.
4. The student (2 layers, width 64, random init) sees only a small set of documents, many times,
   with `recipes/distill_llama.py finetune=full`, three ways: CE only (kd_weight=0), KD + CE, and
   KD + CE + feature matching (student layers 0, 1 -> teacher layers 1, 3 through learned
   projections 64 -> 128) + attention transfer (student layer 1 -> teacher layer 3). The held-out
   perplexity (`eval/ppl`, the student's own next-token CE on unseen documents) is read from
   each run's metrics.jsonl, at the end and at its best evaluation.

With few documents a student trained on the labels alone memorises them; the teacher's soft
next-word distributions carry what it learned from the many (Hinton et al. 2015), which is
what the comparison measures. Writes `<out>/results.json` and prints the table and the commands.
Deterministic for a given `--seed` on one thread (the runs use OMP_NUM_THREADS=1 unless set).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere in a checkout

from minitrain.weights import save_pretrained  # noqa: E402
from models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
MIN_WORDS, MAX_WORDS = 16, 31


# ----------------------------------------------------------------------------- the language


class Language:
    """Topic-conditioned word bigrams: P(doc) = sum_z P(z) P(w_1 | z) prod_t P(w_t | w_{t-1}, z),
    the length uniform in [MIN_WORDS, MAX_WORDS]."""

    def __init__(self, rng: random.Random, n_words: int, n_topics: int, successors: int = 6, alpha: float = 0.7):
        syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
        words: set[str] = set()
        while len(words) < n_words:
            words.add(rng.choice(syllables) + rng.choice(syllables))
        self.words = sorted(words)
        self.n_topics = n_topics

        def dirichlet(k: int) -> list[float]:
            g = [rng.gammavariate(alpha, 1.0) for _ in range(k)]
            return [x / sum(g) for x in g]

        self.start = []  # per topic: {word: p}
        self.next = []  # per topic: {word: {next word: p}}
        for _ in range(n_topics):
            first = rng.sample(self.words, 8)
            self.start.append(dict(zip(first, dirichlet(len(first)))))
            table = {}
            for w in self.words:
                nxt = rng.sample(self.words, successors)
                table[w] = dict(zip(nxt, dirichlet(successors)))
            self.next.append(table)

    def sample(self, rng: random.Random) -> list[str]:
        z = rng.randrange(self.n_topics)
        n = rng.randint(MIN_WORDS, MAX_WORDS)
        dist = self.start[z]
        doc = []
        for _ in range(n):
            w = rng.choices(list(dist), weights=list(dist.values()))[0]
            doc.append(w)
            dist = self.next[z][w]
        return doc

    def nll(self, doc: list[str]) -> float:
        """-log P(words, then </s>) under the process: the exact next-word distributions (the topic
        posterior updated word by word) and the length's hazard, in nats."""
        log_post = [-math.log(self.n_topics)] * self.n_topics  # log P(z | words so far), unnormalised
        total = 0.0
        for t, w in enumerate(doc):
            n_seen = t  # words before this one; the doc may end here (eos) only once n_seen >= MIN_WORDS
            p_end = 1.0 / (MAX_WORDS - n_seen + 1) if n_seen >= MIN_WORDS else 0.0
            m = max(log_post)
            post = [math.exp(lp - m) for lp in log_post]
            s = sum(post)
            per_topic = [(self.start[z] if t == 0 else self.next[z][doc[t - 1]]).get(w, 0.0)
                         for z in range(self.n_topics)]
            p = sum(q / s * pz for q, pz in zip(post, per_topic))
            total -= math.log((1 - p_end) * p)
            log_post = [lp + math.log(pz) if pz > 0 else -math.inf for lp, pz in zip(log_post, per_topic)]
        return total - math.log(1.0 / (MAX_WORDS - len(doc) + 1))  # </s> after the last word


# ----------------------------------------------------------------------------- files


def write_tokenizer(words: list[str], folder: Path) -> int:
    """A word-level `tokenizer.json` (split on spaces; ids: the specials, then the words); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIALS)
    # bos before each text, as add_bos_token says (transformers 5 follows this post-processor, not the flag)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    specials = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**specials, "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False},
        indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return len(vocab)


def write_model(folder: Path, tokenizer: Path, seed: int, **shape: int) -> None:
    """A random-init LLaMA (fp32) in HF layout, with the tokenizer files beside it."""
    cfg = LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3, max_position_embeddings=64, **shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    save_pretrained(model, folder, cfg.to_hf())
    for f in tokenizer.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())


def write_jsonl(path: Path, docs: list[list[str]]) -> None:
    path.write_text("".join(json.dumps({"text": " ".join(d)}) + "\n" for d in docs))


# ----------------------------------------------------------------------------- runs


def minitrain(recipe: str, out: Path, keys: dict, log: Path) -> tuple[list[str], float]:
    """`python -m minitrain recipes/<recipe> key=value ...`; returns the command and its seconds."""
    cmd = [sys.executable, "-m", "minitrain", str(REPO / "recipes" / recipe), *[f"{k}={v}" for k, v in keys.items()],
           f"out={out}", "overwrite=true"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    if p.returncode:
        sys.exit(f"error: {' '.join(cmd)} failed (exit {p.returncode}); its output is in {log}")
    return cmd, time.time() - t0


def eval_ppl(run: Path) -> tuple[float, float]:
    """(final, best) `eval/ppl` in a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ppl = [r["eval/ppl"] for r in rows if "eval/ppl" in r]
    return ppl[-1], min(ppl)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/distill_demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--words", type=int, default=120)
    ap.add_argument("--topics", type=int, default=6)
    ap.add_argument("--teacher-docs", type=int, default=8000)
    ap.add_argument("--student-docs", type=int, default=200)
    ap.add_argument("--eval-docs", type=int, default=400)
    ap.add_argument("--teacher-steps", type=int, default=800)
    ap.add_argument("--student-steps", type=int, default=400)
    ap.add_argument("--feature-weight", type=float, default=0.1)
    ap.add_argument("--attention-weight", type=float, default=0.1)
    ap.add_argument("--feature-loss", default="cosine", choices=("mse", "cosine"))
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    rng = random.Random(args.seed)
    lang = Language(rng, args.words, args.topics)
    teacher_docs = [lang.sample(rng) for _ in range(args.teacher_docs)]
    student_docs = teacher_docs[: args.student_docs]  # the student's few documents: some of the teacher's
    eval_docs = [lang.sample(rng) for _ in range(args.eval_docs)]  # unseen by both
    for name, docs in (("teacher_train", teacher_docs), ("student_train", student_docs), ("eval", eval_docs)):
        write_jsonl(out / f"{name}.jsonl", docs)
    floor = math.exp(sum(lang.nll(d) for d in eval_docs) / sum(len(d) + 1 for d in eval_docs))
    print(f"language: {args.words} words, {args.topics} topics; {len(teacher_docs)} teacher documents, "
          f"{len(student_docs)} student documents, {len(eval_docs)} held-out; the process's own held-out "
          f"perplexity (the floor): {floor:.3f}", flush=True)

    n_ids = write_tokenizer(lang.words, out / "tokenizer")
    padded = -(-n_ids // 64) * 64
    write_model(out / "teacher_init", out / "tokenizer", args.seed, vocab_size=padded, hidden_size=128,
                intermediate_size=256, num_hidden_layers=4, num_attention_heads=4)
    write_model(out / "student_init", out / "tokenizer", args.seed + 1, vocab_size=n_ids, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)

    common = {"eval_data": out / "eval.jsonl", "finetune": "full", "device": "cpu", "precision": "fp32",
              "grad_accum": 1, "schedule": "cosine", "max_len": 64, "seed": args.seed}
    commands, results = {}, {"floor_ppl": floor}
    teacher_run = out / "teacher"
    cmd, secs = minitrain("sft_llama.py", teacher_run, {
        **common, "model": out / "teacher_init", "data": out / "teacher_train.jsonl", "batch_size": 32, "lr": 3e-3,
        "warmup": 40, "max_steps": args.teacher_steps, "eval_every": args.teacher_steps}, out / "teacher.log")
    commands["teacher"] = " ".join(map(str, cmd))
    results["teacher"] = {"eval_ppl": eval_ppl(teacher_run)[0], "seconds": round(secs)}
    print(f"teacher: held-out ppl {results['teacher']['eval_ppl']:.3f} ({secs:.0f}s)", flush=True)

    student = {"model": out / "student_init", "teacher": teacher_run / "model", "data": out / "student_train.jsonl",
               "batch_size": 16, "lr": 3e-3, "warmup": 20, "max_steps": args.student_steps, "temperature": 1.0,
               "eval_every": max(1, args.student_steps // 10), "weight_decay": 0.0, **common}
    variants = {
        "ce_only": {"kd_weight": 0.0, "ce_weight": 1.0},
        "kd_ce": {"kd_weight": 0.5, "ce_weight": 0.5},
        "kd_ce_feature_attention": {"kd_weight": 0.5, "ce_weight": 0.5, "feature_weight": args.feature_weight,
                                    "attention_weight": args.attention_weight, "feature_loss": args.feature_loss},
    }
    for name, weights in variants.items():
        run = out / name
        cmd, secs = minitrain("distill_llama.py", run, {**student, **weights}, out / f"{name}.log")
        commands[name] = " ".join(map(str, cmd))
        final, best = eval_ppl(run)
        results[name] = {"eval_ppl": final, "best_eval_ppl": best, "seconds": round(secs), **weights}
        print(f"{name}: held-out ppl {final:.3f} (best {best:.3f}) ({secs:.0f}s)", flush=True)

    (out / "results.json").write_text(json.dumps({"results": results, "commands": commands}, indent=2,
                                                 default=str) + "\n")
    print("\n| run | held-out ppl (end) | best during the run |\n|---|---|---|")
    print(f"| generating process (floor) | {floor:.3f} | |")
    print(f"| teacher (4 layers, width 128, {len(teacher_docs)} docs) | {results['teacher']['eval_ppl']:.3f} | |")
    for name in variants:
        r = results[name]
        print(f"| student {name} ({len(student_docs)} docs) | {r['eval_ppl']:.3f} | {r['best_eval_ppl']:.3f} |")
    print(f"\nresults: {out / 'results.json'} (with each command); logs: {out}/*.log")


if __name__ == "__main__":
    main()
