"""Fuzzing what users type and feed: the JSONL readers and the command-line override parser.

Property: whatever the input, the result is a valid value or a one-line `UserError` — never
another exception type (a traceback is a bug, docs/design.md rule 9). Complements the row-shaped
fuzzing in test_data.py and the single-argument fuzzing in test_cli.py with inputs those do not
draw: arbitrary bytes (broken UTF-8, BOMs, NULs, CRs), lines that are not JSON, JSON that Python
accepts but users do not mean (NaN, 1e999, lone surrogates, duplicate keys, deep nesting), bad
reader options, and whole command lines of several arguments run through `apply_overrides` and
`validate` as the CLI does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import pytest
from _tok import make_bpe_tokenizer
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minitrain.cli import _Bad, apply_overrides, parse_value
from minitrain.config import TrainConfig, conforms, doc, field_types, unwrap_optional, validate
from minitrain.data.collate import IGNORE_INDEX
from minitrain.data.readers import Examples, read_preference, read_seq2seq, read_sft
from minitrain.errors import UserError
from minitrain.text.tokenizer import Tokenizer

_BASE = settings(deadline=None, database=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# CI draws a fixed sample (derandomized: the same cases every run); MINITRAIN_FUZZ_LONG=N draws N
# times as many, at random, for a longer local search
_LONG = int(os.environ.get("MINITRAIN_FUZZ_LONG", "0"))


def fuzz(n: int) -> settings:
    return settings(_BASE, max_examples=n * _LONG, derandomize=False) if _LONG else settings(_BASE, max_examples=n)
READERS = {"sft": read_sft, "seq2seq": read_seq2seq, "preference": read_preference}

_TOK: list[Tokenizer] = []


def tok() -> Tokenizer:
    if not _TOK:
        folder = Path(tempfile.mkdtemp(prefix="fuzz_tok_"))
        _TOK.append(Tokenizer.from_folder(make_bpe_tokenizer(folder), chat_format="mistral"))
    return _TOK[0]


def one_line(e: UserError) -> None:
    text = str(e)
    assert text and "\n" not in text and "\r" not in text, repr(text)


# ----------------------------------------------------------------------------- data readers

# text users may write, lone surrogates included (written as \ud800 escapes by json.dumps)
texts = st.text(max_size=40) | st.text(st.characters(categories=["Cs", "Zs", "Cc", "Lu"]), max_size=6) \
    | st.sampled_from(["", " ", "\n", "a b c", "the word of it.", "\ufeff", "[INST]", "</s>", "<s>"])
scalars = st.none() | st.booleans() | st.integers() | st.floats() | texts
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(texts, kids, max_size=3),
                           max_leaves=6)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "bot", ""]) | scalars,
                                           "content": texts | json_values}) | json_values, max_size=4)
KEYS = ["prompt", "completion", "messages", "text", "chosen", "rejected"]


@st.composite
def rows(draw) -> dict:
    """An object with some of the keys the readers look at, holding anything."""
    keys = draw(st.lists(st.sampled_from(KEYS), max_size=4, unique=True))
    row = {k: draw(messages if k in ("messages", "prompt", "chosen", "rejected") and draw(st.booleans()) else
                   texts | json_values) for k in keys}
    if draw(st.booleans()):
        row[draw(texts)] = draw(json_values)
    return row


WORDS = "the a of to in and is it that was for on are with as word Q: A: 1 22 . , ?".split()
sentences = st.lists(st.sampled_from(WORDS), min_size=1, max_size=40).map(" ".join) | st.text(min_size=1, max_size=30)


@st.composite
def good_rows(draw, kind: str) -> dict:
    """A row the `kind` reader should accept (so the valid path, truncation and skips get fuzzed too)."""
    chat = [{"role": "user", "content": draw(sentences)}, {"role": "assistant", "content": draw(sentences)}]
    shapes = {
        "sft": [{"prompt": draw(sentences), "completion": draw(sentences)}, {"messages": chat},
                {"text": draw(sentences)}],
        "seq2seq": [{"prompt": draw(sentences), "completion": draw(sentences)}],
        "preference": [{"prompt": draw(sentences), "chosen": draw(sentences), "rejected": draw(sentences)},
                       {"prompt": chat[:1], "chosen": draw(sentences), "rejected": chat[1:]}],
    }[kind]
    return draw(st.sampled_from(shapes))


@st.composite
def jsonl_lines(draw, kind: str) -> bytes:
    """Lines of: rows, any JSON value, JSON text Python accepts loosely, or not JSON at all
    (half the files: good rows only)."""
    out = []
    only_good = draw(st.booleans())
    for _ in range(draw(st.integers(0, 4))):
        what = "good" if only_good else draw(st.sampled_from(["good", "row", "row", "value", "loose", "text"]))
        if what == "good":
            line = json.dumps(draw(good_rows(kind)), ensure_ascii=draw(st.booleans()))
        elif what == "row":
            line = json.dumps(draw(rows()), ensure_ascii=draw(st.booleans()))
        elif what == "value":
            line = json.dumps(draw(json_values))
        elif what == "loose":
            line = draw(st.sampled_from([
                '{"prompt": NaN, "completion": Infinity}', '{"prompt": "a", "prompt": "b", "completion": "c"}',
                '{"text": "' + "x" * 300 + '"}', "[" * 5000 + "]" * 5000, '{"text": 1e999}', "{}", "null",
                '{"prompt": "\\ud83d", "completion": "ok"}', '{"messages": [{"role": "user", "content": "\\udfff"}]}']))
        else:
            line = draw(texts)
        out.append(line.encode("utf-8", "surrogatepass"))
    end = draw(st.sampled_from([b"\n", b"\r\n", b""]))
    data = b"\n".join(out) + end
    return (b"\xef\xbb\xbf" + data) if draw(st.booleans()) else data


options = st.fixed_dictionaries({  # mostly valid (-2..1 and "middle" are refused)
    "max_len": st.integers(-2, 48),
    "truncation_side": st.sampled_from(["left", "right"] * 4 + ["middle"]),
})


def read_or_user_error(kind: str, data: bytes, opts: dict) -> Examples | None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.jsonl"
        path.write_bytes(data)
        try:
            return READERS[kind](path, tok(), **opts)
        except UserError as e:
            one_line(e)
            return None


def check_examples(kind: str, ex: Examples, max_len: int) -> None:
    vocab = tok().vocab_size
    assert ex.truncated >= 0 and ex.skipped >= 0
    pairs = [("chosen_ids", "chosen_labels"), ("rejected_ids", "rejected_labels")] if kind == "preference" \
        else [("input_ids", "labels")]
    for e in ex:
        for ids_k, lab_k in pairs:
            ids, labels = e[ids_k], e[lab_k]
            assert ids and len(ids) <= max_len
            assert all(type(i) is int and 0 <= i < vocab for i in ids)
            assert all(type(x) is int and (x == IGNORE_INDEX or 0 <= x < vocab) for x in labels)
            if kind == "seq2seq":
                assert labels and len(labels) <= max_len
            else:
                assert len(labels) == len(ids) and any(x != IGNORE_INDEX for x in labels[1:])  # never all -100


@pytest.mark.parametrize("kind", sorted(READERS))
@fuzz(200)
@given(draw=st.data(), opts=options)
def test_readers_on_arbitrary_jsonl(kind, draw, opts):
    data = draw.draw(jsonl_lines(kind), label="file")
    ex = read_or_user_error(kind, data, opts)
    event("user error" if ex is None else f"read: {min(len(ex), 2)}+ examples")  # --hypothesis-show-statistics
    if ex is not None:
        check_examples(kind, ex, opts["max_len"])


@pytest.mark.parametrize("kind", sorted(READERS))
@fuzz(150)
@given(data=st.binary(max_size=200) | st.lists(st.sampled_from(
    [b"{", b"}", b'"prompt"', b'"completion"', b":", b",", b'"a b"', b"\xff", b"\xc3", b"\x00", b"\n", b"\r", b" "]),
    max_size=30).map(b"".join))
def test_readers_on_arbitrary_bytes(kind, data):
    ex = read_or_user_error(kind, data, {"max_len": 16})
    if ex is not None:
        check_examples(kind, ex, 16)


@fuzz(100)
@given(fields=st.dictionaries(texts | st.sampled_from(KEYS), texts | json_values, max_size=3),
       max_prompt_len=st.none() | st.integers(-2, 20) | st.floats(0, 5))
def test_reader_options_are_checked(fields, max_prompt_len):
    data = json.dumps({"prompt": "a b", "completion": " c d"}).encode() + b"\n"
    ex = read_or_user_error("sft", data, {"max_len": 16, "fields": fields, "max_prompt_len": max_prompt_len})
    if ex is not None:
        check_examples("sft", ex, 16)


# ----------------------------------------------------------------------------- override parser


@dataclass
class AllTypes(TrainConfig):
    """TrainConfig's fields (str, int, float, bool, list[str]) plus every other type the CLI parses."""

    counts: list[int] = doc([1, 2], "a list of ints")
    weights: list[float] = doc([0.5], "a list of floats")
    bare: list = doc([], "a bare list")
    dims: tuple[int, ...] = doc((1, 2), "a tuple of ints")
    maybe_int: Optional[int] = doc(None, "an optional int")
    maybe_float: float | None = doc(None, "an optional float")
    extra: dict = doc({}, "a JSON object")
    mode: Literal["fast", "slow"] = doc("fast", "a literal")
    path: Path = doc(Path("x"), "a path")


TYPES = field_types(AllTypes)
# text shaped like each kind of value, and text that is not
values = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(categories=["Cs", "Cc", "Zs", "Nd"]), max_size=6),
    st.from_regex(r"[-+]?[0-9_]*\.?[0-9]*(e[-+]?[0-9]+)?", fullmatch=True),
    st.from_regex(r"\[[-0-9., \"a-z\[\]{}:]*\]?", fullmatch=True),
    st.sampled_from(["none", "null", "None", "true", "True", "1", "0", "yes", "nan", "-inf", "1e999", "0x10",
                     "1_000", "٣", "[]", "[[]]", "[NaN]", "[1e999]", '["a",1]', "{}", '{"a": [1]}', "a,,b", ","]),
)


@fuzz(1000)
@given(key=st.sampled_from(sorted(TYPES)), text=values)
def test_parse_value_gives_the_type_or_bad(key, text):
    """`parse_value` alone: a value of the field's type, or `_Bad` (which the CLI turns into a UserError)."""
    try:
        value = parse_value(text, TYPES[key])
    except _Bad:
        return
    assert conforms(value, TYPES[key]), (key, text, value)
    if unwrap_optional(TYPES[key])[0] is float:
        assert value is None or math.isfinite(value)
    if typing.get_origin(TYPES[key]) is list and typing.get_args(TYPES[key]) == (float,):
        assert all(math.isfinite(v) for v in value)


@fuzz(500)
@given(args=st.lists(st.one_of(
    st.tuples(st.sampled_from(sorted(TYPES)), values).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(max_size=20),
    st.tuples(st.sampled_from(["-", "--", " ", "="]), st.sampled_from(sorted(TYPES))).map("".join),
), max_size=4))
def test_command_line_gives_a_valid_config_or_one_user_error(args):
    """What the CLI does with `key=value ...`: apply_overrides, then validate."""
    try:
        cfg = apply_overrides(AllTypes(), args, where="fuzz.py")
        validate(cfg)
    except UserError as e:
        one_line(e)
        event("user error")
        return
    event("valid config")
    for f in dataclasses.fields(cfg):
        assert conforms(getattr(cfg, f.name), TYPES[f.name]), f.name


def test_fuzz_inputs_reach_both_outcomes():
    """The strategies are not all-error (or all-valid): a sample of each kind of input gives both."""
    ok = bad = 0
    for data in (b'{"prompt": "a b", "completion": " c"}\n', b"\xff\n", b'{"prompt": NaN}\n'):
        ex = read_or_user_error("sft", data, {"max_len": 16})
        ok, bad = ok + (ex is not None), bad + (ex is None)
    assert ok and bad
    assert parse_value("3", TYPES["counts"]) == [3]
    with pytest.raises(_Bad):
        parse_value("nan", TYPES["lr"])

