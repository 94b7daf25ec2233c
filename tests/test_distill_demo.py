"""tools/distill_demo.py's pieces: the generating process's perplexity floor against the joint
probability summed over topics, and the word-level tokenizer (one id per word) as minitrain reads it.
The whole demo (minutes of CPU) is run by hand; its figures are in the issue note."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import pytest

from minitrain.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]


def load_demo():
    spec = importlib.util.spec_from_file_location("distill_demo", REPO / "tools" / "distill_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_floor_equals_the_joint_probability_over_topics():
    """-log P(doc, </s>) two ways: the demo's word-by-word posterior update, and
    -log(sum_z P(z) P(w_1|z) prod_t P(w_t|w_{t-1},z)) - log P(length) with the length uniform."""
    demo = load_demo()
    rng = random.Random(3)
    lang = demo.Language(rng, 30, 4)
    for _ in range(20):
        doc = lang.sample(rng)
        assert demo.MIN_WORDS <= len(doc) <= demo.MAX_WORDS
        joint = 0.0
        for z in range(lang.n_topics):
            p = lang.start[z].get(doc[0], 0.0)
            for a, b in zip(doc, doc[1:]):
                p *= lang.next[z][a].get(b, 0.0)
            joint += p / lang.n_topics
        want = -math.log(joint) + math.log(demo.MAX_WORDS - demo.MIN_WORDS + 1)
        assert lang.nll(doc) == pytest.approx(want, rel=1e-9)


def test_word_level_tokenizer(tmp_path):
    demo = load_demo()
    words = ["bada", "kilo", "mure"]
    n = demo.write_tokenizer(words, tmp_path)
    tok = Tokenizer.from_folder(tmp_path)
    assert n == tok.vocab_size == 7 and (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    assert tok.encode("kilo bada mure kilo") == [5, 4, 6, 5]
