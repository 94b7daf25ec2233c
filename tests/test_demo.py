"""The committed demo (demo/, tools/make_demo.py) and the Mistral recipes run on it from the CLI.

References: transformers loads the same folder (logits, tokenizer, chat template); the script
that made the demo, rerun, rewrites the same tokenizer, config and data bytes; the recipes run
end to end as a user runs them (`python -m minitrain RECIPE.py key=value`), in a subprocess.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models
from minitrain.data.readers import read_preference, read_sft
from minitrain.text.tokenizer import Tokenizer
from minitrain.weights import load_pretrained

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo"
NAME = re.compile(r"^([A-Z][a-z]+), ")  # summaries start with the person's name


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DEMO / name).read_text().splitlines()]


def test_demo_model_loads_in_minitrain_and_transformers_with_equal_logits():
    import transformers

    tok = Tokenizer.from_folder(DEMO / "model")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(DEMO / "model"))
    pairs = rows("prefs_eval.jsonl")[:4]
    ids = []
    for r in pairs:
        msgs = r["prompt"] + [{"role": "assistant", "content": r["chosen"]}]
        ours, _ = tok.encode_chat(msgs)
        theirs = hf_tok.apply_chat_template(msgs, tokenize=True)
        theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
        assert ours == list(theirs)  # the tokenizer and its Mistral chat template agree with transformers
        ids.append(ours)
    T = max(map(len, ids))
    x = torch.full((len(ids), T), tok.pad_id)
    mask = torch.zeros_like(x)
    for i, s in enumerate(ids):
        x[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1

    ours = load_pretrained(DEMO / "model", models.from_hf_config).eval()
    assert ours.hf_config["model_type"] == "mistral"
    assert ours.config.num_key_value_heads < ours.config.num_attention_heads  # GQA, as Mistral-7B
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEMO / "model"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "MistralForCausalLM"
    with torch.no_grad():
        got = ours.output_projection(ours(x, mask))
        want = hf(input_ids=x, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)


def test_demo_data_reads_and_held_out_people_are_in_no_training_pair():
    tok = Tokenizer.from_folder(DEMO / "model")
    assert tok.chat_template is not None and tok.chat_format is None  # the checkpoint's own template
    train = read_preference(DEMO / "prefs_train.jsonl", tok, max_len=128)
    held = read_preference(DEMO / "prefs_eval.jsonl", tok, max_len=128)
    sft = read_sft(DEMO / "sft_train.jsonl", tok, max_len=128)
    assert len(train) >= 1000 and len(held) >= 100 and len(sft) >= 100
    assert train.truncated == train.skipped == held.truncated == held.skipped == 0
    names = lambda rs, key: {NAME.match(r[key]).group(1) for r in rs}  # noqa: E731
    seen = names(rows("prefs_train.jsonl"), "chosen") | {NAME.match(r["messages"][1]["content"]).group(1)
                                                         for r in rows("sft_train.jsonl")}
    assert not names(rows("prefs_eval.jsonl"), "chosen") & seen
    # chosen copies the note, rejected changes exactly one fact, which the note does not contain
    for r in rows("prefs_eval.jsonl") + rows("prefs_train.jsonl")[:200]:
        note = r["prompt"][0]["content"]
        c, rj = r["chosen"].rstrip(".").split(", "), r["rejected"].rstrip(".").split(", ")
        assert all(re.search(rf"\b{re.escape(v)}\b", note) for v in c)
        diff = [(a, b) for a, b in zip(c, rj) if a != b]
        assert len(diff) == 1 and not re.search(rf"\b{re.escape(diff[0][1])}\b", note)


def test_make_demo_rewrites_the_committed_tokenizer_config_and_data(tmp_path):
    """Data and tokenizer do not depend on the pre-training steps: a 2-step rerun must write the
    committed bytes (the weights differ, of course), and two reruns the same weights."""
    for out in ("a", "b"):
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_demo.py"), "--out", str(tmp_path / out),
                        "--steps", "2"], check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for f in ("model/config.json", "model/tokenizer.json", "model/tokenizer_config.json",
              "model/special_tokens_map.json", "README.md", "prefs_train.jsonl", "prefs_eval.jsonl", "sft_train.jsonl",
              "kto_train.jsonl", "kto_eval.jsonl"):
        assert (tmp_path / "a" / f).read_bytes() == (DEMO / f).read_bytes(), f
    a, b = (tmp_path / x / "model" / "model.safetensors" for x in "ab")
    assert a.read_bytes() == b.read_bytes()
    # a few MB, the wheel's demos together (demo/vl_colours, 0.7 MB of them, took it past 4 MiB)
    assert sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file()) < 5 * 2**20


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "minitrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True)


def test_short_demo_runs_from_the_cli_stage_a_then_stage_b(tmp_path):
    """`python -m minitrain recipes/sft_mistral.py`, then `recipes/dpo_mistral.py` continuing its
    adapter with a precomputed reference, as a user would type them (few steps)."""
    sft = cli(str(ROOT / "recipes" / "sft_mistral.py"), "max_steps=2", "out=runs/a", cwd=tmp_path)
    assert sft.returncode == 0, sft.stderr
    stage_a = tmp_path / "runs" / "a" / "adapter"
    assert (stage_a / "adapter_model.safetensors").is_file()
    assert f"init_adapter={Path('runs/a/adapter')}" in sft.stdout

    dpo = cli(str(ROOT / "recipes" / "dpo_mistral.py"), "max_steps=2", "out=runs/b", f"init_adapter={stage_a}",
              "precompute_ref=true", cwd=tmp_path)
    assert dpo.returncode == 0, dpo.stderr
    out = tmp_path / "runs" / "b"
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "ref_logps" / "train.safetensors").is_file() and (out / "ref_logps" / "eval.json").is_file()
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    assert evals[0]["eval/rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # reference == Stage A policy
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"rewards/chosen", "rewards/accuracies", "logps/rejected"} <= set(metrics[-1])
    assert "Stage A adapter" in dpo.stdout and "reusing" not in dpo.stdout
    assert "model=/path/to/Mistral-7B-Instruct-v0.2" in dpo.stdout and "quantize=nf4" in dpo.stdout

    again = cli(str(ROOT / "recipes" / "dpo_mistral.py"), "max_steps=2", "out=runs/b", f"init_adapter={stage_a}",
                "precompute_ref=true", "overwrite=true", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("reusing") == 2  # train and eval caches are fresh


def test_dpo_demo_defaults_run_with_no_arguments_but_the_output_folder(tmp_path):
    """The default run (fresh adapter, base as reference) shortened to 3 steps."""
    res = cli(str(ROOT / "recipes" / "dpo_mistral.py"), "max_steps=3", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "runs" / "dpo_mistral"
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert "base model (adapter disabled)" in res.stdout
    first = json.loads((out / "eval.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["eval/rewards/accuracies"] == 0.0  # every pair ties at step 0


def test_dpo_recipe_scores_the_held_out_pairs_once_per_evaluation_and_logs_no_perplexity(tmp_path, monkeypatch,
                                                                                          capsys):
    """The recipe's evaluations (before step 1, then the loop's) each score every held-out pair
    once: one reference and one policy forward, counted on the model. `eval/loss` is the mean DPO
    loss per pair in metrics.jsonl, out/eval.jsonl and the summary alike, and `eval/ppl` (exp of
    a pair loss) appears nowhere: not logged, not written, not returned."""
    from minitrain.cli import load_recipe

    recipe = load_recipe(str(ROOT / "recipes" / "dpo_mistral.py"))
    for name, n in (("prefs_train.jsonl", 32), ("prefs_eval.jsonl", 12)):  # a few pairs: seconds, not minutes
        (tmp_path / name).write_text("".join(line + "\n" for line in (DEMO / name).read_text().splitlines()[:n]))
    cfg = dataclasses.replace(recipe.config, **{**recipe.module.demo, "data": str(tmp_path / "prefs_train.jsonl"),
                                                "eval_data": str(tmp_path / "prefs_eval.jsonl"),
                                                "out": str(tmp_path / "out"), "max_steps": 2, "eval_every": 1})
    held_out, scored = set(), collections.Counter()  # held-out chosen sequence -> forwards it went through

    def count(module, args):
        for row, mask in zip(args[0].tolist(), args[1].tolist()):
            seq = tuple(t for t, m in zip(row, mask) if m)
            if seq in held_out:
                scored[seq] += 1

    setup = recipe.module.setup

    def counting_setup(config):
        job = setup(config)
        held_out.update(tuple(ex["chosen_ids"]) for ex in job.eval_examples)
        job.model.register_forward_pre_hook(count)
        return job

    monkeypatch.setattr(recipe.module, "setup", counting_setup)
    summary = recipe.run(cfg)
    printed = capsys.readouterr().out

    assert len(held_out) == 12
    assert scored == {seq: 3 * 2 for seq in held_out}  # evaluations at steps 0, 1, 2 x (reference + policy)
    out = tmp_path / "out"
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1, 2] and [m["step"] for m in metrics] == [1, 2]
    for m, e in zip(metrics, evals[1:]):
        assert {k: v for k, v in m.items() if k.startswith("eval/")} == {k: v for k, v in e.items() if k != "step"}
        assert {"eval/loss", "eval/rewards/accuracies", "eval/rewards/margins"} <= set(m)
    assert summary["eval/loss"] == evals[-1]["eval/loss"]
    assert "eval/ppl" not in summary and not any("eval/ppl" in m for m in metrics) and "eval/ppl" not in printed
    assert f"step 2: eval/loss {evals[-1]['eval/loss']:.4f} | eval/rewards/chosen" in printed  # one line each
    assert printed.count("step 2: eval/loss") == 1

    # a run killed after logging an evaluation past its last checkpoint, then resumed: that row goes
    with open(out / "eval.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "eval/loss": 0.0}) + "\n")
    recipe.run(dataclasses.replace(cfg, resume=True))
    assert [json.loads(line)["step"] for line in (out / "eval.jsonl").read_text().splitlines()] == [0, 1, 2]
