"""The command line: recipe loading, typed overrides, validation, one-line errors, --help.

Most tests call `run_cli` in-process (fast); a few run `python -m minitrain` in a subprocess to
check what a user really sees: exit code, one `error:` line on stderr, no traceback.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minitrain import __version__
from minitrain.cli import apply_overrides, load_recipe, parse_override, run_cli
from minitrain.config import TrainConfig, conforms, doc, field_types, from_json, to_json, validate
from minitrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]

# A recipe whose config has one field of every type the override parser supports.
TYPED_RECIPE = '''
"""Typed test recipe: every field type the CLI parses."""
from __future__ import annotations

import json
from dataclasses import dataclass, asdict
from typing import Literal, Optional

from minitrain.config import TrainConfig, doc


@dataclass
class TypedConfig(TrainConfig):
    """TrainConfig plus fields of the remaining types."""

    counts: list[int] = doc([1, 2], "a list of ints")
    weights: list[float] = doc([0.5], "a list of floats")
    anything: list = doc([], "a bare list")
    dims: tuple[int, ...] = doc((1, 2), "a tuple of ints")
    maybe_int: Optional[int] = doc(None, "an optional int")
    maybe_float: float | None = doc(None, "an optional float (PEP 604)")
    extra: dict = doc({}, "a JSON object")
    mode: Literal["fast", "slow"] = doc("fast", "a literal")
    beta: float = doc(0.1, "DPO-like beta", gt=0)


config = TypedConfig(lr=1e-4, out="runs/typed")


def run(config):
    print("RUN " + json.dumps(asdict(config)))
'''


@pytest.fixture
def recipe(tmp_path) -> Path:
    p = tmp_path / "typed.py"
    p.write_text(TYPED_RECIPE)
    return p


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = run_cli([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def ran_config(out: str) -> dict:
    (line,) = [ln for ln in out.splitlines() if ln.startswith("RUN ")]
    return json.loads(line[4:])


def assert_one_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ----------------------------------------------------------------------------- typed overrides


def test_overrides_typed_for_every_field_type(capsys, recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "some" / "folder").mkdir(parents=True)  # the command checks that model= names a folder
    code, out, err = cli(
        capsys, recipe,
        "max_steps=7", "lr=3e-3", "checkpointing=yes", "compile=0", "model=some/folder",
        "lora_targets=q_proj, v_proj", "counts=[3,4,5]", "weights=1,2.5", "anything=[1,\"a\"]",
        "dims=4,5", "maybe_int=12", "maybe_float=none", 'extra={"k": [1]}', "mode=slow", "beta=0.5",
    )
    assert code == 0, err
    c = ran_config(out)
    assert c["max_steps"] == 7 and isinstance(c["max_steps"], int)
    assert c["lr"] == 3e-3
    assert c["checkpointing"] is True and c["compile"] is False
    assert c["model"] == "some/folder"
    assert c["lora_targets"] == ["q_proj", "v_proj"]
    assert c["counts"] == [3, 4, 5]
    assert c["weights"] == [1.0, 2.5]
    assert c["anything"] == [1, "a"]
    assert c["dims"] == [4, 5]  # a tuple, through JSON
    assert c["maybe_int"] == 12 and c["maybe_float"] is None
    assert c["extra"] == {"k": [1]}
    assert c["mode"] == "slow" and c["beta"] == 0.5
    assert c["out"] == "runs/typed"  # the recipe's own value stays when not overridden


@pytest.mark.parametrize("text,value", [
    ("true", True), ("True", True), ("1", True), ("yes", True), ("YES", True),
    ("false", False), ("0", False), ("no", False), ("FALSE", False),
])
def test_bool_spellings(recipe, text, value):
    r = load_recipe(str(recipe))
    assert apply_overrides(r.config, [f"rslora={text}"]).rslora is value


@pytest.mark.parametrize("text,value", [
    ("", []), ("[]", []), ("lm_head", ["lm_head"]), ("a,b,", ["a", "b"]),
    ('["a,b", "c"]', ["a,b", "c"]), (" q_proj , k_proj ", ["q_proj", "k_proj"]),
])
def test_list_forms(text, value):
    assert apply_overrides(TrainConfig(), [f"modules_to_save={text}"]).modules_to_save == value


def test_optional_takes_none_and_values(recipe):
    r = load_recipe(str(recipe))
    c = apply_overrides(r.config, ["maybe_int=null", "maybe_float=2"])
    assert c.maybe_int is None and c.maybe_float == 2.0 and isinstance(c.maybe_float, float)


def test_overrides_do_not_touch_the_recipe_config(recipe):
    r = load_recipe(str(recipe))
    before = dataclasses.asdict(r.config)
    apply_overrides(r.config, ["lora_targets=x", "lr=1"])
    assert dataclasses.asdict(r.config) == before


def test_value_may_contain_equals(recipe):
    c = apply_overrides(load_recipe(str(recipe)).config, ["model=a=b"])
    assert c.model == "a=b"


# ----------------------------------------------------------------------------- one-line errors


@pytest.mark.parametrize("arg,needles", [
    ("lrr=1", ["unknown key 'lrr'", "typed.py", "did you mean 'lr'", "valid keys:", "max_steps"]),
    ("lr=abc", ["lr=abc: expected a float", "e.g. lr=0.0001"]),
    ("max_steps=2.5", ["max_steps=2.5: expected an int"]),
    ("checkpointing=maybe", ["checkpointing=maybe: expected an int or true or false", "e.g. checkpointing=true"]),
    ("checkpointing=2.5", ["checkpointing=2.5: expected an int or true or false"]),  # a union: int | bool
    ("checkpointing=-1", ["checkpointing=-1: must be >= 0"]),
    ("counts=a,b", ["counts=a,b: expected a list of int"]),
    ("lora_targets=[1]", ["lora_targets=[1]: expected a list of str"]),
    ("extra=[1]", ["extra=[1]: expected a JSON object"]),
    ("mode=medium", ["mode=medium: expected one of fast | slow"]),
    ("lr=nan", ["lr=nan: expected a finite float"]),
    ("lr=inf", ["lr=inf: expected a finite float"]),
    ("lr", ["'lr': expected key=value", "e.g. lr=0.0001"]),
    ("--lr=1", ["--lr=1: keys take no dashes", "lr=1"]),
    ("--frobnicate", ["--frobnicate: unknown option"]),
    ("lr=-1", ["lr=-1.0: must be > 0"]),
    ("lr=0", ["lr=0.0: must be > 0"]),
    ("batch_size=0", ["batch_size=0: must be >= 1"]),
    ("grad_accum=-2", ["grad_accum=-2: must be >= 1"]),
    ("lora_dropout=1", ["lora_dropout=1.0: must be < 1"]),
    ("schedule=cosin", ["schedule=cosin: must be one of constant | linear | cosine", "schedule=cosine"]),
    ("precision=fp8", ["precision=fp8: must be one of auto | bf16 | fp32 | fp16"]),
    ("quantize=nf3", ["quantize=nf3: must be one of none | nf4 | int8"]),
    ("chat_format=chatml", ["chat_format=chatml: must be one of auto | mistral | llama2 | llama3"]),
    ("device=gpu", ["device=gpu: not a device — use auto, cpu, cuda or cuda:N"]),
    ("beta=0", ["beta=0.0: must be > 0"]),  # a subclass's own bound, no extra code
    ("warmup=2.5", ["warmup=2.5:", "whole"]),  # TrainConfig.check(): a cross-field rule
    ("max_steps=0", ["max_steps=0: would train nothing"]),
])
def test_bad_argument_is_one_error_line(capsys, recipe, arg, needles):
    code, out, err = cli(capsys, recipe, arg)
    assert_one_error(code, err, *needles)
    assert "RUN " not in out  # run(config) was not called


def test_checkpointing_takes_true_false_or_a_number_of_blocks(capsys, recipe):
    """`int | bool`: the first member that takes the text, so digits are a count of blocks (0: none)."""
    for text, want in (("true", True), ("no", False), ("3", 3), ("0", 0)):
        code, out, err = cli(capsys, recipe, f"checkpointing={text}")
        assert code == 0, err
        got = ran_config(out)["checkpointing"]
        assert got == want and type(got) is type(want), (text, got)
    assert from_json('{"checkpointing": 2}', TrainConfig).checkpointing == 2
    assert from_json('{"checkpointing": true}', TrainConfig).checkpointing is True


def test_key_given_twice(capsys, recipe):
    code, _, err = cli(capsys, recipe, "lr=1", "lr=2")
    assert_one_error(code, err, "lr: given twice")


def test_empty_targets_is_an_error(capsys, recipe):
    code, _, err = cli(capsys, recipe, "lora_targets=")
    assert_one_error(code, err, "lora_targets: empty")


def test_no_arguments(capsys):
    code, _, err = cli(capsys)
    assert_one_error(code, err, "no recipe given", "usage:")


def test_override_before_recipe(capsys):
    code, _, err = cli(capsys, "lr=1")
    assert_one_error(code, err, "lr=1: the first argument must be the recipe file")


def test_missing_recipe_file_lists_recipes_there(capsys, tmp_path, recipe):
    code, _, err = cli(capsys, tmp_path / "nope.py")
    assert_one_error(code, err, "nope.py: no such recipe file", "typed.py")


def test_a_folder_lists_only_its_recipes(capsys, tmp_path, recipe):
    """A missing file's folder lists the Python files there that are recipes (`config` and `run`),
    not the user's other scripts."""
    (tmp_path / "plot_loss.py").write_text("import sys\nprint(sys.argv)\n")
    code, _, err = cli(capsys, tmp_path / "nope.py")
    assert_one_error(code, err, "nope.py: no such recipe file", "typed.py")
    assert "plot_loss.py" not in err


def test_ls_lists_the_shipped_recipes(capsys):
    code, out, _ = cli(capsys, "ls")
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()[:len(list((REPO / "recipes").glob("*.py")))]]
    assert names == sorted(p.stem for p in (REPO / "recipes").glob("*.py"))
    assert "dpo_mistral" in out and "DPO (Stage B) on a Mistral checkpoint" in out


def test_cp_copies_and_never_overwrites(capsys, tmp_path):
    code, out, _ = cli(capsys, "cp", "kto_mistral", tmp_path / "mine.py")
    assert code == 0 and "minitrain " + str(tmp_path / "mine.py") in out
    assert (tmp_path / "mine.py").read_bytes() == (REPO / "recipes" / "kto_mistral.py").read_bytes()
    code, _, err = cli(capsys, "cp", "kto_mistral", tmp_path / "mine.py")
    assert_one_error(code, err, "mine.py: already exists")
    code, _, err = cli(capsys, "cp", "kto_mistral", tmp_path / "mine.txt")
    assert_one_error(code, err, "mine.txt: a recipe copy must end in .py")
    code, _, err = cli(capsys, "cp")
    assert_one_error(code, err, "usage: minitrain cp NAME [DEST]")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.py"]


def test_a_recipe_by_name(capsys):
    code, out, _ = cli(capsys, "sft_llama", "--help")
    assert code == 0 and f"usage: python -m minitrain {REPO / 'recipes' / 'sft_llama.py'}" in out
    code, _, err = cli(capsys, "sft_lama")
    assert_one_error(code, err, "sft_lama: no such recipe file, and minitrain has no recipe of that name",
                     "did you mean sft_llama?", "minitrain ls")


def test_recipe_is_a_folder(capsys, tmp_path):
    code, _, err = cli(capsys, tmp_path)
    assert_one_error(code, err, "is a folder, not a recipe file")


def test_recipe_not_python(capsys, tmp_path):
    (tmp_path / "r.yaml").write_text("lr: 1\n")
    code, _, err = cli(capsys, tmp_path / "r.yaml")
    assert_one_error(code, err, "r.yaml: a recipe is a Python file")


@pytest.mark.parametrize("source,needles", [
    ("config = 1\n\ndef run(c):\n    pass\n\nx = (\n", ["bad.py:6: does not parse:", "fix the recipe"]),
    ("def run(c):\n  pass\n   y = 2\n", ["bad.py:3: does not parse:"]),
    ("def run(c):\n    pass\n", ["bad.py: defines no `config`"]),
    ("config = {'lr': 1}\ndef run(c):\n    pass\n", ["bad.py: `config` is a dict, not a dataclass instance"]),
    ("from minitrain.config import TrainConfig\nconfig = TrainConfig\ndef run(c):\n    pass\n",
     ["`config` is a type, not a dataclass instance"]),
    ("from minitrain.config import TrainConfig\nconfig = TrainConfig()\n", ["bad.py: defines no `run(config)`"]),
    ("import no_such_module_xyz\n", ["bad.py: cannot import 'no_such_module_xyz'"]),
])
def test_bad_recipe_file(capsys, tmp_path, source, needles):
    (tmp_path / "bad.py").write_text(source)
    code, _, err = cli(capsys, tmp_path / "bad.py")
    assert_one_error(code, err, *needles)


def test_user_error_inside_run_exits_2(capsys, tmp_path):
    (tmp_path / "r.py").write_text(textwrap.dedent("""
        from minitrain.config import TrainConfig
        from minitrain.errors import UserError
        config = TrainConfig()
        def run(config):
            raise UserError("data.jsonl:3: missing key \\"completion\\" — add it")
    """))
    code, _, err = cli(capsys, tmp_path / "r.py")
    assert_one_error(code, err, 'data.jsonl:3: missing key "completion"')


def test_keyboard_interrupt_exits_130(capsys, tmp_path):
    (tmp_path / "r.py").write_text(textwrap.dedent("""
        from minitrain.config import TrainConfig
        config = TrainConfig()
        def run(config):
            raise KeyboardInterrupt
    """))
    code, _, err = cli(capsys, tmp_path / "r.py")
    assert code == 130 and "interrupted" in err and "Traceback" not in err


def test_our_bugs_keep_their_traceback(capsys, tmp_path):
    (tmp_path / "r.py").write_text(textwrap.dedent("""
        from minitrain.config import TrainConfig
        config = TrainConfig()
        def run(config):
            raise RuntimeError("a bug")
    """))
    with pytest.raises(RuntimeError, match="a bug"):
        run_cli([str(tmp_path / "r.py")])


# ----------------------------------------------------------------------------- --help / --version


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_docstring_and_fields(capsys, recipe, flag):
    code, out, _ = cli(capsys, recipe, "lr=bad-but-ignored", flag)
    assert code == 0
    assert "Typed test recipe: every field type the CLI parses." in out
    assert "  lr: float = 0.0001" in out  # the recipe's value, not the class default
    assert "peak learning rate [> 0]" in out
    assert "  schedule: str = cosine" in out and "one of constant | linear | cosine" in out
    assert "  counts: list[int] = 1,2" in out and "a list of ints" in out
    assert "  maybe_int: int | None = none" in out
    assert "  lora_targets: list[str] = q_proj,k_proj,v_proj,o_proj" in out
    for f in dataclasses.fields(load_recipe(str(recipe)).config):
        assert f"  {f.name}: " in out
    assert "RUN " not in out


def test_help_without_recipe(capsys):
    code, out, _ = cli(capsys, "--help")
    assert code == 0 and "usage: minitrain RECIPE [key=value ...]" in out and "minitrain ls" in out
    assert "  minitrain merge --model DIR" in out and "  minitrain cache [list|clear" in out  # every command


def _python_m(*argv, cwd=REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "minitrain", *map(str, argv)],
                          cwd=cwd, env=env, capture_output=True, text=True)


def test_version_subprocess(recipe):
    p = _python_m("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"minitrain {__version__}"
    p = _python_m(recipe, "--version")
    assert p.returncode == 0 and p.stdout.strip() == f"minitrain {__version__}"


def test_errors_as_the_user_sees_them(tmp_path, recipe):
    """Real processes: exit 2, exactly one `error:` line on stderr, no traceback, nothing on stdout."""
    (tmp_path / "broken.py").write_text("config = (\n")
    cases = [
        ((recipe, "lrr=1"), "unknown key 'lrr'"),
        ((recipe, "lr=abc"), "lr=abc: expected a float"),
        ((recipe, "quantize=int4"), "quantize=int4: must be one of"),
        ((tmp_path / "missing.py",), "missing.py: no such recipe file"),
        ((tmp_path / "broken.py",), "broken.py:1: does not parse"),
    ]
    for argv, needle in cases:
        p = _python_m(*argv)
        assert_one_error(p.returncode, p.stderr, needle)
        assert p.stdout == ""


def test_run_subprocess_ok(recipe):
    p = _python_m(recipe, "max_steps=3")
    assert p.returncode == 0, p.stderr
    assert ran_config(p.stdout)["max_steps"] == 3


# ----------------------------------------------------------------------------- fuzzing the parser


@pytest.fixture(scope="module")
def typed_config(tmp_path_factory):
    p = tmp_path_factory.mktemp("fuzz") / "typed.py"
    p.write_text(TYPED_RECIPE)
    return load_recipe(str(p)).config


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from([f.name for f in dataclasses.fields(TrainConfig)] + [
    "counts", "weights", "anything", "dims", "maybe_int", "maybe_float", "extra", "mode", "beta"]),
    text=st.one_of(st.text(), st.from_regex(r"-?[0-9.e+_]*", fullmatch=True),
                   st.from_regex(r"\[[0-9, .\"a-z\[\]]*\]?", fullmatch=True),
                   st.sampled_from(["none", "null", "true", "nan", "1e999", "[[[[", "[NaN]", "{}"])))
def test_fuzz_value_parses_to_its_type_or_user_error(typed_config, key, text):
    types_ = field_types(type(typed_config))
    try:
        k, value = parse_override(f"{key}={text}", typed_config, types_, "typed.py")
    except UserError as e:
        assert len(str(e).splitlines()) == 1 and str(e).startswith(f"{key}=")
        return
    assert k == key and conforms(value, types_[key]), (key, text, value)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arg=st.text())
def test_fuzz_whole_argument(typed_config, arg):
    types_ = field_types(type(typed_config))
    try:
        k, value = parse_override(arg, typed_config, types_, "typed.py")
    except UserError as e:
        assert len(str(e).splitlines()) == 1  # one line, whatever the user typed
        return
    assert k in types_ and conforms(value, types_[k])


# ----------------------------------------------------------------------------- config.py


def test_default_config_validates_and_round_trips(recipe):
    c = TrainConfig()
    validate(c)
    assert from_json(to_json(c), TrainConfig) == c
    typed = apply_overrides(load_recipe(str(recipe)).config, ["dims=3,4", "maybe_int=5", 'extra={"a": 1}'])
    assert from_json(to_json(typed), type(typed)) == typed  # tuples, optionals, dicts


def test_from_json_keeps_float_fields_float():
    c = from_json('{"lr": 1, "epochs": 2}', TrainConfig)
    assert c.lr == 1.0 and isinstance(c.lr, float) and isinstance(c.epochs, float)


@pytest.mark.parametrize("text,needle", [
    ("{", "config.json: not valid JSON"),
    ("[1]", "expected a JSON object"),
    ('{"lrr": 1}', "unknown key(s) lrr"),
    ('{"lr": "fast"}', 'lr="fast" is not float'),
    ('{"checkpointing": "yes"}', 'checkpointing="yes" is not int | bool'),
    ('{"lora_targets": "q_proj"}', "is not list[str]"),
])
def test_from_json_is_strict(text, needle):
    with pytest.raises(UserError) as e:
        from_json(text, TrainConfig)
    assert needle in str(e.value)


def test_validate_checks_types_set_in_python():
    with pytest.raises(UserError, match=r"^batch_size=4\.0: expected int"):
        validate(TrainConfig(batch_size=4.0))  # type: ignore[arg-type]


def test_subclass_fields_are_validated_from_their_metadata():
    @dataclasses.dataclass
    class DPOConfig(TrainConfig):
        beta: float = doc(0.1, "DPO beta", gt=0)
        loss: str = doc("sigmoid", "DPO loss", choices=("sigmoid", "ipo"))

    validate(DPOConfig())
    with pytest.raises(UserError, match=r"^beta=-1\.0: must be > 0 — e\.g\. beta=0\.1$"):
        validate(DPOConfig(beta=-1.0))
    with pytest.raises(UserError, match=r"^loss=ipp: must be one of sigmoid \| ipo — did you mean loss=ipo\?$"):
        validate(DPOConfig(loss="ipp"))


def test_list_of_str_starting_with_bracket_is_a_plain_value():
    """`added_tokens=[Question]`: not JSON, so a plain string list (a JSON list still works)."""
    from minitrain.cli import parse_value

    assert parse_value("[Question]", list[str]) == ["[Question]"]
    assert parse_value("[Question],[Answer]", list[str]) == ["[Question]", "[Answer]"]
    assert parse_value('["a","b"]', list[str]) == ["a", "b"]


def test_hugging_face_names_get_a_did_you_mean():
    """Every name in cli.HF_NAMES is a real Hugging Face name (a field of transformers'
    TrainingArguments / BitsAndBytesConfig, PEFT's LoraConfig, TRL's SFT/DPO/GKD configs, or the
    example scripts' ModelArguments / DataTrainingArguments), and each maps to a key of our configs
    with a did-you-mean that carries the value."""
    import dataclasses

    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    trl = pytest.importorskip("trl")
    from minitrain.cli import HF_NAMES, apply_overrides
    from minitrain.config import TrainConfig
    from minitrain.errors import UserError
    from minitrain.objectives.distill import DistillConfig
    from minitrain.objectives.dpo import DPOConfig

    real = set()
    for cls in (transformers.TrainingArguments, transformers.BitsAndBytesConfig, peft.LoraConfig, trl.SFTConfig,
                trl.DPOConfig, getattr(trl, "GKDConfig", trl.SFTConfig)):
        real |= {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    real |= set(inspect.signature(transformers.BitsAndBytesConfig).parameters)
    real |= set(inspect.signature(transformers.PreTrainedModel.from_pretrained).parameters)
    # examples/pytorch/language-modeling/run_clm.py's ModelArguments / DataTrainingArguments, and the
    # names people write for a teacher in distillation scripts
    scripts = {"model_name_or_path", "train_file", "validation_file", "dataset", "eval_dataset", "rank", "alpha",
               "dropout", "teacher_model", "teacher_model_name_or_path", "max_length", "train_batch_size"}
    # names of transformers 4.x / TRL < 0.20 (gone from the installed versions, still in most tutorials)
    older = {"warmup_ratio", "overwrite_output_dir", "max_seq_length", "model_max_length"}
    assert set(HF_NAMES) - real - scripts - older == set()
    ours = {f.name for cls in (TrainConfig, DPOConfig, DistillConfig) for f in dataclasses.fields(cls)}
    assert {k for k, _ in HF_NAMES.values()} <= ours
    for hf, (key, value) in HF_NAMES.items():
        config = DistillConfig() if key == "teacher" else TrainConfig()
        with pytest.raises(UserError) as e:
            apply_overrides(config, [f"{hf}=true" if value else f"{hf}=7"])
        assert f"did you mean {key}={value or 7}? ({hf} is the Hugging Face name)" in str(e.value), str(e.value)


def test_warnings_are_one_note_line_each(tmp_path):
    """A warning during a run prints as one `note:` line, once, without Python's source path and code
    line."""
    noisy = tmp_path / "noisy.py"
    noisy.write_text(TYPED_RECIPE.replace('''def run(config):
    print("RUN " + json.dumps(asdict(config)))''', '''def run(config):
    import warnings

    import torch

    for _ in range(3):
        warnings.warn("the data has odd rows,\\n  twice over")
    torch.tensor([1.0, 2.0]).resize_(1).numpy()  # fine
    torch.nn.functional.softmax(torch.ones(2))  # a library's warning ("Implicit dimension choice ...")
    print("RUN " + json.dumps(asdict(config)))'''))
    p = _python_m(noisy)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[0] == "note: the data has odd rows, twice over"
    assert len(lines) == 2 and lines[1].startswith("note: Implicit dimension choice for softmax"), lines
    assert "Warning" not in p.stderr and "noisy.py" not in p.stderr


def test_error_examples_suggest_a_useful_value(capsys, recipe):
    """A key whose default suggests nothing (`{}`, `0.0`, `[]`) gets its `example` in the error instead."""
    for arg, example in (("fields=abc", 'fields={"prompt": "question", "completion": "answer"}'),
                         ("eval_split=abc", "eval_split=0.05"), ("eval_split=2", "eval_split=0.05"),
                         ("ema_decay=1", "ema_decay=0.999"),
                         ("chat_template_kwargs=x", 'chat_template_kwargs={"enable_thinking": false}')):
        code, _, err = cli(capsys, recipe, arg)
        assert_one_error(code, err, f"— e.g. {example}")


# ----------------------------------------------------------------------------- run files, early checks

BUNDLED = ["sft_llama", "sft_mistral", "dpo_mistral", "kto_mistral", "grpo_qwen", "reward_model", "distill_llama", "lora_t5",
           "ard_lora_llama", "lrc_llama"]


@pytest.mark.parametrize("mistake, says", [
    (["lerning_rate=1"], "unknown key 'lerning_rate'"),
    (["model=/no/such/model", "data=x.jsonl"], "/no/such/model: no such model folder"),
    (["data=/no/such/data.jsonl"], "/no/such/data.jsonl: no such file — check the data path"),
    (["lr=fast"], "lr=fast: expected a float"),
])
def test_a_mistake_is_answered_before_torch_is_imported(tmp_path, mistake, says):
    """Every recipe minitrain ships: a mistyped key, a missing model or data file and a bad value are
    answered from the recipe's config alone, before torch (the seconds of a start) is imported."""
    model = tmp_path / "m"
    model.mkdir()
    probe = ("import sys, json; from minitrain.cli import run_cli\n"
             "codes = [run_cli(a) for a in json.loads(sys.argv[1])]\n"
             "print('CODES', codes, 'torch' in sys.modules)\n")
    runs = [[r, *([] if any(a.startswith("model=") for a in mistake) else [f"model={model}"]),
             *([f"teacher={model}"] if r == "distill_llama" else []), *mistake] for r in BUNDLED]
    r = subprocess.run([sys.executable, "-c", probe, json.dumps(runs)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert f"CODES {[2] * len(BUNDLED)} False" in r.stdout, (r.stdout, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == len(BUNDLED) and all(says in e for e in errors), r.stderr


def test_minitrain_config_writes_a_run_file_that_reads_back_as_the_recipe(tmp_path):
    """`minitrain config RECIPE > run.yaml` (through the command): every key with its value and its
    help as a comment; read back as a run file it gives the recipe's own config."""
    r = subprocess.run([sys.executable, "-m", "minitrain", "config", "dpo_mistral"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (tmp_path / "run.yaml").write_text(r.stdout)
    recipe = load_recipe(str(REPO / "recipes" / "dpo_mistral.py"))
    assert "# preference loss: DPO's sigmoid" in r.stdout and "\nbeta: 0.1\n" in r.stdout
    from minitrain.cli import read_run_file

    values = read_run_file(str(tmp_path / "run.yaml"), recipe.config, recipe.path)
    assert values == {f.name: getattr(recipe.config, f.name) for f in dataclasses.fields(recipe.config)}


def test_a_run_file_sets_keys_and_the_command_line_overrides_it(capsys, recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("# my run\nlr: 2e-4\nmax_steps: 9\ncounts: [7, 8]\nmode: slow\n"
                                       "weights: 1\ndims: [3, 4]\nmaybe_int: null\n")
    code, out, err = cli(capsys, recipe, "config=run.yaml", "max_steps=3")
    assert code == 0, err
    c = ran_config(out)
    assert (c["lr"], c["max_steps"], c["counts"], c["mode"], c["dims"]) == (2e-4, 3, [7, 8], "slow", [3, 4])
    (tmp_path / "run.json").write_text('{\n  "lr": 0.5,\n  "epochs": 2\n}\n')
    code, out, err = cli(capsys, recipe, "config=run.json")
    assert code == 0, err
    assert (ran_config(out)["lr"], ran_config(out)["epochs"]) == (0.5, 2)


@pytest.mark.parametrize("text, says", [
    ("lr: 1e-4\nlerning_rate: 3\n", "run.yaml:2: unknown key 'lerning_rate' for"),
    ("lr: 1e-4\n\nmax_steps: many\n", "run.yaml:3: max_steps: expected an int — e.g. max_steps: "),
    ("mode: medium\n", "mode: expected one of fast | slow"),
    ("- lr\n- 3\n", "run.yaml: holds a list, not key: value lines"),
    ("lr: [1\n", "run.yaml:2: not YAML"),
])
def test_a_bad_run_file_is_one_line_naming_its_file_and_line(capsys, recipe, tmp_path, text, says):
    (tmp_path / "run.yaml").write_text(text)
    code, out, err = cli(capsys, recipe, f"config={tmp_path / 'run.yaml'}")
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert "RUN " not in out


def test_a_run_file_naming_the_model_turns_the_demo_off_and_config_json_means_its_folder(tmp_path, monkeypatch):
    from minitrain.cli import resolve_config

    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(str(REPO / "recipes" / "dpo_mistral.py"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "run.yaml").write_text("model: m/config.json\n")
    config, demo = resolve_config(recipe, ["config=run.yaml"])
    assert demo == {} and config.model == "m" and config.data == recipe.config.data
    config, demo = resolve_config(recipe, ["model=demo", "data=mine.jsonl"])  # the built-in model, your data
    assert demo == {} and Path(config.model) == REPO / "demo" / "model" and config.data == "mine.jsonl"


def test_help_is_read_from_the_config_alone_and_says_what_the_full_import_says(tmp_path):
    from minitrain.cli import Recipe, _light_module, recipe_path, recipe_help

    for name in BUNDLED:
        path = recipe_path(name)
        light = _light_module(path)
        assert light is not None, name
        assert recipe_help(Recipe(path, light, light.config, print)) == recipe_help(load_recipe(path)), name
    probe = ("import sys, contextlib, io; from minitrain.cli import run_cli\n"
             "with contextlib.redirect_stdout(io.StringIO()) as out: code = run_cli(['grpo_qwen', '--help'])\n"
             "print(code, 'torch' in sys.modules, 'keys (GRPOConfig' in out.getvalue())\n")
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.stdout.split() == ["0", "False", "True"], (r.stdout, r.stderr)


def test_a_moved_import_is_named_for_a_recipe_given_by_a_relative_path(tmp_path):
    (tmp_path / "mine.py").write_text((REPO / "tests" / "bad_inputs" / "recipes" / "old_parallel.py").read_text())
    r = subprocess.run([sys.executable, "-m", "minitrain", "mine.py"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("error: mine.py:4: cannot import from minitrain.distributed — "
                                                     "minitrain's modules live in subpackages now: main_only is in "
                                                     "minitrain.parallel.distributed"), r.stderr
