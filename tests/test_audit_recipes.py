"""Every recipe in `recipes/`: `tools/audit.py` audits it (healthy on a tiny model), and it reads its
data before its weights.

The README promises the audit for any recipe; a recipe without `setup(config)` (lora_t5 had
none) or with a gradient path the audit misreads (a false alarm) fails here. A new recipe must
add its command line to `args_for`: the test refuses a recipe it does not know.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch
from _tok import corpus, make_bpe_tokenizer, make_t5_tokenizer

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.py") if not p.name.startswith("_"))
NEEDS_BNB = {"lrc_llama.py", "lrc.py"}  # a quantized base by default


@pytest.fixture(scope="module")
def inputs(hf_causal, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("audit_recipes")
    llama = root / "llama"
    import shutil

    shutil.copytree(hf_causal("audit_recipes_llama"), llama)
    make_bpe_tokenizer(llama)
    mistral = root / "mistral"
    shutil.copytree(hf_causal("audit_recipes_mistral", model_type="mistral", sliding_window=8), mistral)
    make_bpe_tokenizer(mistral)

    import transformers

    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1))
    t5.save_pretrained(root / "t5")
    make_t5_tokenizer(root / "t5")

    lines = [t.split() for t in corpus(12, seed=3)]
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": " ".join(w[:3]), "completion": " ".join(w[3:]) or "end"}) + "\n"
                           for w in lines))
    prefs = root / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": " ".join(w[:3]), "chosen": " ".join(w[3:6]) or "yes",
                                         "rejected": " ".join(w[6:8]) or "no"}) + "\n" for w in lines))
    kto = root / "kto.jsonl"
    kto.write_text("".join(json.dumps({"prompt": " ".join(w[:3]), "completion": " ".join(w[3:6]) or "yes",
                                       "label": i % 2 == 0}) + "\n" for i, w in enumerate(lines)))
    rewards = root / "rewards.py"  # GRPO's reward: any function of the completions
    rewards.write_text("def length(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    return {"llama": llama, "mistral": mistral, "t5": root / "t5", "sft": sft, "prefs": prefs, "kto": kto,
            "root": root, "rewards": rewards}


def args_for(recipe: str, d: dict[str, Path]) -> list[str]:
    common = {"batch_size": "2", "lora_r": "4", "lora_alpha": "8", "device": "cpu", "out": str(d["root"] / "out")}
    per = {
        "sft_llama.py": {"model": d["llama"], "data": d["sft"]},
        "sft.py": {"model": d["llama"], "data": d["sft"]},  # sft_llama.py's family-agnostic alias
        "sft_mistral.py": {"model": d["mistral"], "data": d["sft"]},
        "dpo_mistral.py": {"model": d["mistral"], "data": d["prefs"], "eval_data": d["prefs"]},
        "distill_llama.py": {"model": d["llama"], "teacher": d["llama"], "data": d["sft"]},
        "ard_lora_llama.py": {"model": d["llama"], "data": d["sft"], "eval_data": d["sft"]},
        "lrc_llama.py": {"model": d["llama"], "data": d["sft"]},
        "lrc.py": {"model": d["llama"], "data": d["sft"]},
        "lora_t5.py": {"model": d["t5"], "data": d["sft"]},
        "kto_mistral.py": {"model": d["mistral"], "data": d["kto"], "eval_data": d["kto"]},
        "grpo_qwen.py": {"model": d["llama"], "data": d["sft"], "rewards": f"{d['rewards']}:length",
                         "num_generations": 2, "max_completion_length": 4},
    }
    assert recipe in per, f"recipes/{recipe}: add its command line to args_for in this test"
    return [str(REPO / "recipes" / recipe)] + [f"{k}={v}" for k, v in {**common, **per[recipe]}.items()]


def audit_tool():
    spec = importlib.util.spec_from_file_location("tools_audit", REPO / "tools" / "audit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
