"""ROUGE-N and ROUGE-L (Lin 2004), scored exactly as Google's `rouge-score` package scores them.

    tokens(text):  lowercase -> every run of characters outside [a-z0-9] becomes a space -> split
                   (an optional stemmer is applied to tokens longer than 3 characters, as rouge-score does)
    ROUGE-N:       overlap = sum over n-grams g of min(count_ref(g), count_pred(g))   (clipped counts)
                   precision = overlap / #pred n-grams, recall = overlap / #ref n-grams
    ROUGE-L:       lcs = length of the longest common subsequence of the two token lists
                   precision = lcs / #pred tokens, recall = lcs / #ref tokens
    F-measure:     2PR / (P + R) (Lin's F with beta = 1), 0 when P + R = 0

A count of 0 n-grams divides by 1 (ROUGE-N) and an empty side scores 0 (ROUGE-L), as in rouge-score,
so an empty prediction scores 0 rather than raising. `rouge-score` with `use_stemmer=False` (its
default) is the reference: our scores equal its scores (tests/test_rouge.py). To match
`use_stemmer=True`, pass `stemmer=nltk.stem.porter.PorterStemmer().stem` (nltk is not a
dependency of minitrain).

Beware of what this tokenisation does to text outside ASCII: accented letters split words
("café" -> "caf") and scripts without Latin letters or digits (Chinese, Arabic, ...) produce no
tokens at all, so every score is 0. That is rouge-score's behaviour, kept for comparability.

`corpus_scores` averages the per-example scores (mean F-measure, as HF examples and the
`evaluate` library's non-bootstrap path report): it is not the F-measure of the mean P and R.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")

_NON_ALNUM = re.compile(r"[^a-z0-9]+")
_VALID = re.compile(r"^[a-z0-9]+$")

Stemmer = Callable[[str], str]


@dataclass(frozen=True)
class Score:
    """Precision, recall and F-measure (beta = 1) of one ROUGE type."""

    precision: float
    recall: float
    fmeasure: float


def tokenize(text: str, stemmer: Stemmer | None = None) -> list[str]:
    """rouge-score's default tokens: lowercase alphanumeric runs; stem tokens of more than 3 characters."""
    tokens = _NON_ALNUM.sub(" ", text.lower()).split()
    if stemmer is not None:
        tokens = [stemmer(t) if len(t) > 3 else t for t in tokens]
    # a stemmer could return something else than [a-z0-9]+: dropped, as rouge-score does
    return [t for t in tokens if _VALID.match(t)]


def fmeasure(precision: float, recall: float) -> float:
    """2PR / (P + R); 0 when both are 0."""
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def ngrams(tokens: Sequence[str], n: int) -> Counter:
    """Counts of the n-grams (tuples) of `tokens`."""
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def rouge_n(reference: Sequence[str], prediction: Sequence[str], n: int) -> Score:
    """ROUGE-N of token lists: clipped n-gram overlap over the prediction's / reference's n-grams."""
    if n < 1:
        raise ValueError(f"rouge_n: n must be >= 1, got {n}")
    ref, pred = ngrams(reference, n), ngrams(prediction, n)
    overlap = sum(min(c, pred[g]) for g, c in ref.items())
    precision = overlap / max(sum(pred.values()), 1)
    recall = overlap / max(sum(ref.values()), 1)
    return Score(precision, recall, fmeasure(precision, recall))


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence (dynamic programming, two rows of len(b) + 1)."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(reference: Sequence[str], prediction: Sequence[str]) -> Score:
    """ROUGE-L of token lists (sentence level): LCS over the prediction's / reference's length."""
    if not reference or not prediction:
        return Score(0.0, 0.0, 0.0)
    lcs = lcs_length(reference, prediction)
    precision, recall = lcs / len(prediction), lcs / len(reference)
    return Score(precision, recall, fmeasure(precision, recall))


def _check_types(types: Sequence[str]) -> None:
    for t in types:
        if t != "rougeL" and not re.fullmatch(r"rouge[1-9]", t):
            raise ValueError(f"rouge: unknown type {t!r} — use rouge1 .. rouge9 or rougeL")


def score(reference: str, prediction: str, types: Sequence[str] = ROUGE_TYPES,
          stemmer: Stemmer | None = None) -> dict[str, Score]:
    """Scores of one prediction against its reference, per type (`rouge1`, `rouge2`, `rougeL`, ...).

    The argument order is rouge-score's `RougeScorer.score(target, prediction)`.
    """
    _check_types(types)
    ref, pred = tokenize(reference, stemmer), tokenize(prediction, stemmer)
    return {t: rouge_l(ref, pred) if t == "rougeL" else rouge_n(ref, pred, int(t[5:])) for t in types}


def corpus_scores(references: Sequence[str], predictions: Sequence[str], types: Sequence[str] = ROUGE_TYPES,
                  stemmer: Stemmer | None = None) -> dict[str, Score]:
    """Per type, the mean precision, recall and F-measure over the example pairs (0 for no pairs)."""
    if len(references) != len(predictions):
        raise ValueError(f"corpus_scores: {len(references)} references but {len(predictions)} predictions")
    _check_types(types)
    sums = {t: [0.0, 0.0, 0.0] for t in types}
    for ref, pred in zip(references, predictions):
        for t, s in score(ref, pred, types, stemmer).items():
            sums[t][0] += s.precision
            sums[t][1] += s.recall
            sums[t][2] += s.fmeasure
    n = max(len(references), 1)
    return {t: Score(p / n, r / n, f / n) for t, (p, r, f) in sums.items()}
