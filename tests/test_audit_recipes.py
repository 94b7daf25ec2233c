"""Every recipe in `recipes/`: `minitrain audit` audits it (healthy on a tiny model), and it reads its
data before its weights.

The README promises the audit for any recipe; a recipe without `setup(config)` (lora_t5 had
none) or with a gradient path the audit misreads (a false alarm) fails here. A new recipe must
add its command line to `args_for`: the test refuses a recipe it does not know.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from pathlib import Path

import pytest
from _recipes import args_for

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.py") if not p.name.startswith("_"))
NEEDS_BNB = {"lrc_llama.py", "lrc.py"}  # a quantized base by default


@pytest.fixture(scope="module")
def inputs(recipe_inputs) -> dict[str, Path]:
    return recipe_inputs


def audit_tool():
    module = importlib.import_module("minitrain.commands.audit")
    return module


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_is_auditable_and_healthy(recipe, inputs):
    if recipe in NEEDS_BNB:
        pytest.importorskip("bitsandbytes")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = audit_tool().main(args_for(recipe, inputs))
    text = out.getvalue()
    assert code == 0, f"{recipe}: exit {code}\n{err.getvalue()}\n{text}"
    verdict = text.strip().splitlines()[-1]
    assert verdict.startswith("audit: healthy"), verdict
    assert "problem:" not in text
    assert not (inputs["root"] / "out").exists()  # the audit writes nothing


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_reads_the_data_before_the_weights(recipe, inputs, tmp_path, capsys):
    """A bad row costs seconds: the data is read (with the light tokenizer) before any weight, so with
    a bad data file AND a truncated weights file the error is the data's (before: the weights')."""
    import shutil

    from minitrain.cli import run_cli

    if recipe in NEEDS_BNB:
        pytest.importorskip("bitsandbytes")
    bad = {}
    for kind in ("sft", "prefs", "kto"):  # one good row, then a broken one
        bad[kind] = tmp_path / f"bad_{kind}.jsonl"
        bad[kind].write_text(inputs[kind].read_text().splitlines()[0] + "\n{not json\n")
    broken = {}
    for kind in ("llama", "mistral", "t5"):
        d = broken[kind] = tmp_path / kind
        shutil.copytree(inputs[kind], d)
        w = d / "model.safetensors"
        w.write_bytes(w.read_bytes()[:1000])
    argv = args_for(recipe, {**inputs, **broken, **bad, "root": tmp_path})
    capsys.readouterr()
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and ".jsonl:2: malformed JSON" in err, err
    assert not (tmp_path / "out").exists()
