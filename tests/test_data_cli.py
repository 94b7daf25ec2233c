"""The command line with data in other files and shapes: SFT and DPO from Parquet, eval_split,
chat_template_kwargs, and one-line errors for data a user gets wrong. Every recipe takes `fields`."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _tok import corpus, make_bpe_tokenizer

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


@pytest.fixture(scope="module")
def tiny(hf_causal, tmp_path_factory) -> dict[str, Path]:
    """A tiny LLaMA whose tokenizer carries Zephyr's chat template (plain-text role tags, eos)."""
    root = tmp_path_factory.mktemp("data_cli")
    model = root / "model"
    shutil.copytree(hf_causal("data_cli_llama"), model)
    make_bpe_tokenizer(model)
    shutil.copy(TEMPLATES / "zephyr.jinja", model / "chat_template.jinja")
    lines = corpus(48, seed=2)
    sft = []
    for i in range(12):
        a, b = lines[2 * i], lines[2 * i + 1]
        sft.append({"prompt": a, "completion": " " + b, "messages": None} if i % 2 else
                   {"prompt": None, "completion": None,
                    "messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]})
    pq.write_table(pa.Table.from_pylist(sft), root / "sft.parquet")
    prefs = [{"chosen": [{"role": "user", "content": lines[i]}, {"role": "assistant", "content": lines[i + 1]}],
              "rejected": [{"role": "user", "content": lines[i]}, {"role": "assistant", "content": lines[i + 2]}]}
             for i in range(0, 24, 3)]
    pq.write_table(pa.Table.from_pylist(prefs), root / "prefs.parquet")
    return {"root": root, "model": model}


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "minitrain", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True)


def common(tiny, out, model=None) -> list[str]:
    return [f"model={model or tiny['model']}", f"out={out}", "max_steps=2", "batch_size=2", "lora_r=4", "lora_alpha=8",
            "device=cpu", "max_len=96", "grad_accum=1"]


def test_sft_from_parquet_with_eval_split(tiny):
    out = tiny["root"] / "sft_out"
    p = cli(REPO / "recipes" / "sft_llama.py", *common(tiny, out), f"data={tiny['root'] / 'sft.parquet'}",
            "eval_split=0.25", "seed=1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "data (train): 9 examples from" in p.stdout and "sft.parquet" in p.stdout
    assert "data (eval): 3 examples from" in p.stdout and "eval_split=0.25" in p.stdout
    assert "chats: 6 rows rendered by the checkpoint's chat template" in p.stdout
    assert "prompt / completion: 6 rows trained as plain text, not through the chat template" in p.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/loss" in r for r in rows)
    assert json.loads((out / "config.json").read_text())["eval_split"] == 0.25


def test_dpo_from_parquet_trl_conversational_pairs(tiny):
    out = tiny["root"] / "dpo_out"
    p = cli(REPO / "recipes" / "dpo_mistral.py", *common(tiny, out), f"data={tiny['root'] / 'prefs.parquet'}",
            "eval_data=")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "data (train): 8 examples from" in p.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and "rewards/accuracies" in rows[-1] and rows[-1]["step"] == 2


def one_error(p: subprocess.CompletedProcess, needle: str) -> str:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-3000:]
    assert needle in lines[0], lines[0]
    return lines[0]


def test_template_refusal_and_kwargs_from_the_command_line(tiny, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny["model"], model)
    (model / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' and not allow_system %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}{% endfor %}")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello there"}]}) + "\n")
    base = [REPO / "recipes" / "sft_llama.py", *common(tiny, tmp_path / "out", model), f"data={data}"]
    line = one_error(cli(*base), "the chat template refuses this conversation: System role not supported")
    assert line.startswith(f"error: {data}:1: ")
    assert not (tmp_path / "out").exists()
    p = cli(*[a for a in base if not str(a).startswith("max_steps")], 'chat_template_kwargs={"allow_system": true}',
            "max_steps=1")
    assert p.returncode == 0, p.stderr[-3000:]


def test_data_folder_and_binary_file_errors(tiny, tmp_path):
    base = [REPO / "recipes" / "sft_llama.py", *common(tiny, tmp_path / "out")]
    (tmp_path / "empty").mkdir()
    one_error(cli(*base, f"data={tmp_path / 'empty'}"), "is a folder with no data files")
    blob = tmp_path / "train.jsonl"
    blob.write_bytes(bytes(range(256)) * 8)
    one_error(cli(*base, f"data={blob}"), "binary, not Parquet or Arrow")


def test_every_recipe_takes_fields_and_the_data_keys():
    for path in sorted((REPO / "recipes").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"recipe_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        names = {f.name for f in dataclasses.fields(module.config)}
        assert {"fields", "eval_split", "chat_template_kwargs"} <= names, path.name
