"""minitrain/evaluate/rouge.py against hand-computed examples (Lin 2004's definitions) and the `rouge-score` package."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rouge_score import rouge_scorer
from rouge_score import tokenize as rs_tokenize

from minitrain.evaluate.rouge import Score, corpus_scores, lcs_length, rouge_l, rouge_n, score, tokenize

TYPES = ["rouge1", "rouge2", "rouge3", "rougeL"]
REFERENCE = rouge_scorer.RougeScorer(TYPES, use_stemmer=False)


def same(ours: Score, theirs) -> None:
    assert (ours.precision, ours.recall, ours.fmeasure) == pytest.approx(
        (theirs.precision, theirs.recall, theirs.fmeasure), abs=1e-12)


# ----------------------------------------------------------------------------- by hand


def test_lin_2004_rouge_l_example():
    """Lin (2004) section 3.1: reference S1 "police killed the gunman"; S2 "police kill the gunman"
    has LCS "police the gunman" (3 of 4), S3 "the gunman kill police" has LCS "the gunman" (2 of 4)."""
    s2 = score("police killed the gunman", "police kill the gunman")
    s3 = score("police killed the gunman", "the gunman kill police")
    assert s2["rougeL"] == Score(0.75, 0.75, 0.75)
    assert s3["rougeL"] == Score(0.5, 0.5, 0.5)
    # "S2 and S3 would have the same ROUGE-2 score, since they both have one bigram, i.e. 'the gunman'":
    # 1 of 3 bigrams on either side
    assert s2["rouge2"] == s3["rouge2"] == Score(1 / 3, 1 / 3, pytest.approx(1 / 3))
    # ROUGE-1: S2 shares police, the, gunman (3 of 4); S3 too
    assert s2["rouge1"].recall == s3["rouge1"].recall == 0.75


def test_rouge_n_clips_repeated_ngrams():
    """Count_match is min(count in reference, count in prediction): "the" x3 vs x2 matches twice."""
    s = score("the the the cat", "the the dog")["rouge1"]
    assert (s.precision, s.recall) == (2 / 3, 2 / 4)
    assert s.fmeasure == pytest.approx(2 * (2 / 3) * (1 / 2) / (2 / 3 + 1 / 2))  # = 4/7
    assert s.fmeasure == pytest.approx(4 / 7)


def test_rouge_l_is_in_order_but_not_contiguous():
    # reference a b c d e, prediction a x c y e: LCS a c e = 3; no shared bigram
    s = score("a b c d e", "a x c y e")
    assert s["rougeL"] == Score(0.6, 0.6, pytest.approx(0.6))
    assert s["rouge2"] == Score(0.0, 0.0, 0.0)
    assert lcs_length("abcbdab", "bdcaba") == 4  # CLRS's example: "bcba"


def test_precision_and_recall_use_their_own_lengths():
    # reference 2 tokens, prediction 4 tokens containing both: P = 2/4, R = 2/2, F = 2/3
    s = score("cat sat", "the cat sat down")
    assert s["rouge1"] == Score(0.5, 1.0, pytest.approx(2 / 3))
    assert s["rougeL"] == Score(0.5, 1.0, pytest.approx(2 / 3))
    assert s["rouge2"] == Score(1 / 3, 1.0, pytest.approx(0.5))  # "cat sat" of 3 bigrams / of 1


def test_tokenisation_is_rouge_scores_default():
    assert tokenize("It's 5 p.m.!  The END") == ["it", "s", "5", "p", "m", "the", "end"]
    assert tokenize("Café naïve") == ["caf", "na", "ve"]  # non-ASCII letters split words
    assert tokenize("模型 训练") == []  # no Latin letters or digits: no tokens (so ROUGE 0)
    assert tokenize("[Question] What is x_1?") == ["question", "what", "is", "x", "1"]


def test_empty_sides_score_zero():
    for ref, pred in (("", ""), ("a b", ""), ("", "a b"), ("...", "!!")):
        for s in score(ref, pred).values():
            assert s == Score(0.0, 0.0, 0.0)


def test_identical_texts_score_one_and_case_or_punctuation_do_not_matter():
    for s in score("The gunman, killed.", "the GUNMAN killed").values():
        assert s == Score(1.0, 1.0, 1.0)


def test_stemmer_only_touches_tokens_longer_than_three():
    seen = []

    def stem(t: str) -> str:
        seen.append(t)
        return t[:4]

    assert tokenize("cats run quickly away", stemmer=stem) == ["cats", "run", "quic", "away"]
    assert seen == ["cats", "quickly", "away"]


def test_corpus_scores_are_means_of_example_scores():
    refs = ["police killed the gunman", "a b c d e"]
    preds = ["police kill the gunman", "a x c y e"]
    c = corpus_scores(refs, preds)
    assert c["rougeL"].fmeasure == pytest.approx((0.75 + 0.6) / 2)
    assert c["rouge2"].recall == pytest.approx((1 / 3 + 0.0) / 2)
    assert corpus_scores([], [])["rouge1"] == Score(0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="2 references but 1 predictions"):
        corpus_scores(refs, preds[:1])


def test_unknown_type_and_bad_n():
    with pytest.raises(ValueError, match="unknown type 'rougeLsum'"):
        score("a", "a", types=["rougeLsum"])
    with pytest.raises(ValueError):
        rouge_n(["a"], ["a"], 0)


# ----------------------------------------------------------------------------- against rouge-score


WORDS = ("the a gunman police killed kill cat cats sat on mat is was what why how question answer "
         "model train data 42 7 x").split()
PUNCT = ("", "", "", ",", ".", "?", "!", "'s", "-", " ", "  ", "\n", "\t", "é", "_")


def random_sentence(rng: random.Random) -> str:
    n = rng.choice([0, 1, 2, 3, 5, 8, 13, 21])
    words = []
    for _ in range(n):
        w = rng.choice(WORDS)
        if rng.random() < 0.2:
            w = w.upper() if rng.random() < 0.5 else w.capitalize()
        words.append(w + rng.choice(PUNCT))
    return " ".join(words)


def test_equals_rouge_score_on_many_random_pairs():
    rng = random.Random(0)
    for _ in range(1500):
        ref, pred = random_sentence(rng), random_sentence(rng)
        if rng.random() < 0.3:  # a prediction that copies part of its reference, so scores are not all small
            cut = ref.split()
            pred = " ".join(cut[rng.randrange(len(cut) + 1):] + pred.split()[:3])
        ours = score(ref, pred, TYPES)
        theirs = REFERENCE.score(ref, pred)
        for t in TYPES:
            same(ours[t], theirs[t])


@settings(max_examples=300, deadline=None)
@given(st.text(), st.text())
def test_equals_rouge_score_on_arbitrary_text(ref, pred):
    assert tokenize(ref) == rs_tokenize.tokenize(ref, None)
    ours = score(ref, pred, TYPES)
    theirs = REFERENCE.score(ref, pred)
    for t in TYPES:
        same(ours[t], theirs[t])


def test_with_nltk_porter_stemmer_equals_use_stemmer_true():
    porter = pytest.importorskip("nltk.stem.porter")
    stem = porter.PorterStemmer().stem
    ref_scorer = rouge_scorer.RougeScorer(TYPES, use_stemmer=True)
    rng = random.Random(1)
    for _ in range(300):
        ref, pred = random_sentence(rng), random_sentence(rng)
        ours = score(ref, pred, TYPES, stemmer=stem)
        theirs = ref_scorer.score(ref, pred)
        for t in TYPES:
            same(ours[t], theirs[t])
    # "killed" / "kill" match once stemmed
    assert score("police killed", "police kill", stemmer=stem)["rouge1"].fmeasure == 1.0

